//! What the planner is asked and what it answers: the job ([`JobRequest`],
//! [`Target`]), the options a retry adds ([`SearchOptions`]), and a [`Plan`]
//! with its [`Stage`]s or the numbers why none exists ([`NoFeasiblePlan`]).
//!
//! These types sit below every planning step (search, ladder, replan), so the
//! steps import them one way and never each other in a circle.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::adapters::{BaseFormat, LoraConfig};
use crate::backend::{Backend, GpuRuntime};
use crate::disk::{DiskBreakdown, DiskInputs};
use crate::inventory::{DeviceKind, DeviceType, Inventory};
use crate::memory::MemoryBreakdown;
use crate::model::ModelShape;
use crate::rung::RetryRung;
use crate::timing::StepTime;
use crate::training::{Optimizer, Precision, Settings};

/// Where a job may run.
#[derive(Clone, Debug, PartialEq)]
pub enum Target {
    /// NVIDIA GPUs; one pipeline stage per GPU.
    Gpu {
        /// GPU products allowed (GFD `nvidia.com/gpu.product` values); empty: any.
        allowed_types: Vec<String>,
        max_gpus: u32,
        /// Host memory every worker pod requests before the plan's
        /// `hostBytes` (`resources.gpu.hostMemory`, or the operator's
        /// default); `None`: not known here, only `hostBytes` is counted.
        host_baseline_bytes: Option<u64>,
    },
    /// CPU workers, each with its own container memory limit.
    Cpu {
        memory_limit_bytes: u64,
        max_workers: u32,
    },
}

/// What the search ranks plans by.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum Objective {
    /// The lowest estimated time per optimizer step ([`crate::timing`])
    /// within the device cap and what is free: idle devices become
    /// data-parallel replicas (or deeper stages) when the step gets faster
    /// for it. On a backend whose worker runs no replicas, the same as
    /// `FewestGpus`.
    #[default]
    Fastest,
    /// The fewest devices that fit, then the fastest plan on that many.
    FewestGpus,
}

/// Everything the planner needs to know about a job.
#[derive(Clone, Debug, PartialEq)]
pub struct JobRequest {
    pub model: ModelShape,
    /// LoRA adapters on a frozen base (`None`: full fine-tuning). Only for
    /// Llama-family models.
    pub adapters: Option<LoraConfig>,
    /// How the frozen base is stored on the first attempt (QLoRA: int8 or
    /// int4; dense otherwise).
    pub base_format: BaseFormat,
    /// Samples per optimizer step; every plan preserves it exactly.
    pub global_batch: u32,
    pub precision: Precision,
    pub optimizer: Optimizer,
    /// User-pinned micro-batch (honoured on the first attempt).
    pub pinned_micro_batch: Option<u32>,
    /// User-pinned activation checkpointing (honoured on the first attempt).
    pub pinned_checkpointing: Option<bool>,
    /// User-pinned number of pipeline stages (honoured on the first attempt).
    pub pinned_stages: Option<u32>,
    /// User-pinned number of data-parallel replicas (honoured on the first attempt).
    pub pinned_replicas: Option<u32>,
    /// What the search ranks fitting plans by.
    pub objective: Objective,
    pub target: Target,
    /// Fraction of usable device memory kept free, in [0, 1).
    pub headroom_fraction: f64,
    /// Retry rungs the job's policy allows; the search also uses `LowerPrecision`
    /// and `CheaperOptimizer` from it when nothing fits otherwise.
    pub allowed_rungs: Vec<RetryRung>,
}

impl JobRequest {
    /// Sets the host memory a GPU worker pod gets before the plan's
    /// `hostBytes` when the job left it to the operator (`bytes`: its
    /// `--gpu-host-memory`).
    pub fn default_host_baseline(&mut self, bytes: u64) {
        if let Target::Gpu {
            host_baseline_bytes,
            ..
        } = &mut self.target
        {
            host_baseline_bytes.get_or_insert(bytes);
        }
    }

    pub fn backend(&self) -> Backend {
        match self.target {
            Target::Gpu { .. } => Backend::Cuda,
            Target::Cpu { .. } => Backend::Flex,
        }
    }

    /// Most workers (devices: stages × replicas) the job may use.
    pub fn max_devices(&self) -> u32 {
        match &self.target {
            Target::Gpu { max_gpus, .. } => *max_gpus,
            Target::Cpu { max_workers, .. } => *max_workers,
        }
        .max(1)
    }

    /// Most pipeline stages: the device cap, and one layer a stage at least.
    pub fn max_workers(&self) -> u32 {
        self.max_devices()
            .min(self.model.splittable_layers())
            .max(1)
    }

    pub(crate) fn allows(&self, rung: RetryRung) -> bool {
        self.allowed_rungs.contains(&rung)
    }

    /// Whether a device type is one this job may use.
    pub fn accepts(&self, device: &DeviceType) -> bool {
        match &self.target {
            Target::Gpu { allowed_types, .. } => {
                device.kind == DeviceKind::Gpu
                    && (allowed_types.is_empty() || allowed_types.iter().any(|t| t == &device.name))
            }
            Target::Cpu { .. } => device.kind == DeviceKind::Cpu,
        }
    }

    /// The inventory a CPU job plans against; GPU jobs use the cluster's.
    pub fn own_inventory(&self) -> Option<Inventory> {
        match self.target {
            Target::Cpu {
                memory_limit_bytes,
                max_workers,
            } => Some(Inventory::cpu(memory_limit_bytes, max_workers)),
            Target::Gpu { .. } => None,
        }
    }
}

/// One pipeline stage: a worker, its layers and its predicted memory.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Stage {
    /// Stage number, 0-based (pipeline order).
    pub index: u32,
    /// First transformer block of this stage (inclusive).
    pub layer_start: u32,
    /// One past the last block of this stage (exclusive).
    pub layer_end: u32,
    /// Micro-batches whose activations this stage holds at once under 1F1B.
    pub in_flight_micro_batches: u32,
    /// Predicted bytes by component.
    pub memory: MemoryBreakdown,
}

/// A complete, executable plan: where the job runs and how.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Plan {
    /// GPU product (GFD label value) or `cpu`.
    pub device: String,
    /// `gpu` or `cpu`.
    pub device_kind: DeviceKind,
    /// Resource each worker requests one of (`nvidia.com/gpu`, a MIG resource, or `memory`).
    pub resource: String,
    /// Nominal memory of one device in bytes.
    pub device_memory_bytes: u64,
    /// Usable bytes minus headroom: what each worker must stay under.
    pub budget_bytes: u64,
    pub backend: Backend,
    /// Workers, one device each: stages × replicas.
    pub workers: u32,
    /// Data-parallel replicas of every stage (d): each trains on its share
    /// of the global batch, gradients are averaged across them every step,
    /// and each keeps the optimizer state of its share of the trained
    /// tensors (ZeRO-1).
    #[serde(default = "one")]
    pub replicas: u32,
    /// The pipeline stages, `replicas` workers each, with their layers and
    /// predicted memory (of the replica with the largest optimizer-state share).
    #[schemars(length(min = 1))]
    pub stages: Vec<Stage>,
    /// Per replica: micro-batch × accumulation is the global batch over `replicas`.
    pub settings: Settings,
    /// The LoRA adapters trained on a frozen base; absent for full fine-tuning.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adapters: Option<LoraConfig>,
    /// Samples per optimizer step (micro-batch × accumulation × replicas).
    pub global_batch: u64,
    /// Largest stage total, bytes.
    pub predicted_peak_bytes: u64,
    /// Multiplier on the estimated terms (optimizer state, activations,
    /// logits, composed weights, collective buffers) learned from earlier
    /// attempts' out-of-memory failures (1 on a first attempt).
    pub correction_factor: f64,
    /// Estimated time per optimizer step relative to one device running the
    /// whole batch at once without checkpointing (unitless; lower is faster).
    pub relative_step_time: f64,
    /// The estimated time of one optimizer step ([`crate::timing`]).
    #[serde(default)]
    pub step_time: StepTime,
    /// Rungs of the retry ladder that produced this plan from the previous one.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rungs_applied: Vec<RetryRung>,
    /// Things the user should know about this plan (e.g. a pin that was not kept).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
    /// Human summary, e.g. `3.1 GiB / 3.6 GiB (86%)`.
    pub fit: String,
    /// How the worker configures the GPU runtime (allocator, persistent
    /// memory, autotune): the settings the memory model assumed. Absent on
    /// the CPU, and in plans made before it was recorded (the worker then
    /// uses the backend's current choice).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_runtime: Option<GpuRuntime>,
    /// The bytes the job keeps on its checkpoint claim ([`crate::disk`]):
    /// filled in by whoever knows where the job's files are (the operator,
    /// the plugin); absent from a bare search's plan.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk: Option<DiskBreakdown>,
}

fn one() -> u32 {
    1
}

impl Plan {
    pub fn fits(&self) -> bool {
        self.predicted_peak_bytes <= self.budget_bytes
    }

    /// Pipeline stages (p).
    pub fn stage_count(&self) -> u32 {
        self.stages.len() as u32
    }

    /// The bytes this plan keeps on the job's checkpoint claim, training
    /// `model` with the job's files where `inputs` says.
    pub fn disk_needs(&self, model: &ModelShape, inputs: &DiskInputs) -> DiskBreakdown {
        crate::disk::needs(
            model,
            self.adapters.as_ref(),
            &self.settings,
            self.workers,
            inputs,
        )
    }
}

/// Nothing fits now: the numbers that ruled each option out, and whether
/// the job would fit on the same cluster with its devices free.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("no feasible plan: {summary}{}", details.iter().map(|d| format!("\n  - {d}")).collect::<String>())]
pub struct NoFeasiblePlan {
    pub summary: String,
    pub details: Vec<String>,
    /// Set when a plan exists once devices busy with other pods are free:
    /// what the job waits for (e.g. `2 × NVIDIA-L4 free (1 free of 8)`). A job
    /// the cluster could never hold leaves it `None`.
    pub waits_for: Option<String>,
    /// Set when the search stopped at its time budget
    /// ([`SearchOptions::deadline`]) before it found a plan or proved that
    /// none fits: the budget it had.
    pub out_of_time: Option<std::time::Duration>,
}

/// When a search must give up. Planning is computation nothing else
/// interrupts (no thread is killed): the search looks at the clock before
/// each candidate it builds and stops, with [`NoFeasiblePlan::out_of_time`],
/// once the deadline has passed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Deadline {
    /// `None`: a budget too large to add to the clock, never reached.
    at: Option<std::time::Instant>,
    budget: std::time::Duration,
}

impl Deadline {
    /// `budget` from now.
    pub fn after(budget: std::time::Duration) -> Deadline {
        Deadline {
            at: std::time::Instant::now().checked_add(budget),
            budget,
        }
    }

    /// The time the search was given.
    pub fn budget(&self) -> std::time::Duration {
        self.budget
    }

    pub fn passed(&self) -> bool {
        self.at.is_some_and(|at| std::time::Instant::now() >= at)
    }

    /// What a search that ran out of this budget answers.
    pub fn ran_out(&self) -> NoFeasiblePlan {
        NoFeasiblePlan {
            summary: format!(
                "planning stopped at its time budget of {:?} before it found a plan or showed that none fits",
                self.budget
            ),
            details: vec![],
            waits_for: None,
            out_of_time: Some(self.budget),
        }
    }
}

/// Knobs the retry ladder and the operator set beyond the request.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SearchOptions {
    /// Multiplies the estimated terms of every estimate
    /// (`MemoryBreakdown::estimated`; ≥ 1; 1 when unset).
    pub correction: f64,
    /// Device types to skip (e.g. unschedulable on the last attempt).
    pub excluded_devices: Vec<String>,
    /// Ignore the user's pinned micro-batch / checkpointing (retries).
    pub ignore_pins: bool,
    /// Plan with this profile instead of the job's backend's own (tests
    /// and what-if questions, e.g. a backend that runs QLoRA).
    pub profile: Option<&'static crate::backend::BackendProfile>,
    /// Give up when this passes ([`NoFeasiblePlan::out_of_time`]); `None`:
    /// search to the end (the plugin, tests).
    pub deadline: Option<Deadline>,
}
