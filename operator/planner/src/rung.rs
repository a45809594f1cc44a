//! The retry rungs: each one way to need less memory per worker, and how it
//! tightens where and how an attempt runs.
//!
//! The rungs are the retry policy's vocabulary. The ladder
//! ([`crate::ladder`]) asks each allowed rung in turn for stricter
//! candidates after an out-of-memory failure; the search ([`crate::search`])
//! asks the numerics rungs (lower precision, cheaper optimizer state) for
//! settings when nothing fits at the user's. Both get the same answer here,
//! so a rung means one thing wherever it is applied.
//!
//! # Order
//!
//! The ladder climbs the rungs cheapest first: first what costs only speed
//! and keeps the numerics, then what changes the numerics least, then what
//! costs devices.
//!
//! 0. `offloadEmbedding` (GPU LoRA jobs with an untied embedding): the
//!    frozen token embedding stays in host memory and only the
//!    micro-batch's rows go to the device, one gather and one upload per
//!    micro-batch; the numerics are the same bit for bit. It frees a fixed
//!    table (1.05 GB for Llama-3-8B's), not what grows with the batch, and
//!    costs a hundredth of the step at most, so it comes first.
//! 1. `activationCheckpointing`: one more forward per block, about a third
//!    more compute; nothing else changes.
//! 2. `halveMicroBatch`: the same samples per step in smaller passes; costs
//!    device utilisation, which small micro-batches show most.
//! 3. `lowerPrecision` (fp32 → bf16): faster on GPUs, but the numerics change.
//! 4. `cheaperOptimizer` (AdamW → 8-bit AdamW): block-wise (de)quantization
//!    of the moments in the step, negligible beside forward and backward;
//!    the moments lose precision. For LoRA jobs it saves little (the
//!    adapters' state is small), but it costs nearly nothing.
//! 5. `quantizeBase` (LoRA only: dense → int8 → nf4, int4 → nf4): every
//!    forward (and every recomputation, and backward) dequantizes the base's
//!    block linears for their products (see [`crate::memory`]), and the frozen
//!    base loses precision; each format step is its own candidate, and a
//!    step the backend does not store smaller (int4 on flex keeps one byte
//!    a value) is never offered.
//! 6. `offloadOptimizer` (GPU only): every step moves gradients to the host
//!    and weights back over PCIe and runs the update on the CPU; costly per
//!    step unless accumulation amortises it, but it needs no more devices.
//! 7. `offloadGradients` (GPU only; turns checkpointing and the optimizer
//!    offload on): each block's gradients leave the device as its backward
//!    produces them (at the training precision over PCIe, accumulated in
//!    fp32 on the host), and the step updates the weights there and sends
//!    them back. The device keeps one block's gradients instead of the
//!    whole gradient, which for a full fine-tune is the size of the
//!    weights, twice with accumulation. It extends the optimizer offload,
//!    so it comes right after it; its copies cost every micro-batch, not
//!    only the step.
//! 8. `offloadActivations` (GPU only, with checkpointing): each block's
//!    checkpointed input goes to the host after its forward and comes back
//!    for its recomputation, a synchronous PCIe round trip per block and
//!    micro-batch; it frees the inputs' bytes, which grow with the sequence
//!    (long-context jobs), and turns checkpointing on if it was off.
//! 9. `shardOptimizerState`: more data-parallel replicas, each keeping a
//!    smaller share of the optimizer state (ZeRO-1); it costs devices but
//!    no speed (the step gets faster, less the larger all-reduce), so it
//!    comes first among the rungs that cost devices. It helps only where
//!    the state is what overflowed: its candidates are checked against the
//!    corrected estimate like any rung's, and when none fits the ladder
//!    goes on from the replicas the failed plan had.
//! 10. `morePipelineStages`, 11. `largerGpu`: more or larger devices, the
//!     scarce thing the search minimises first; the replicas stay.
//!
//! # Adding a rung
//!
//! * Here: a [`RetryRung`] variant in ladder order, in [`RetryRung::ALL`]
//!   (and so [`RetryRung::DEFAULT`]), its name in `Display`, the list under
//!   "Order" above, and, when a backend may lack it, its case in
//!   [`RetryRung::runnable`] (a [`BackendProfile`] flag, set in `FLEX` and
//!   `CUDA`).
//! * A settings rung: [`RetryRung::tighten_settings`], its reason in
//!   `settings_skip_reason` and its arm in [`RetryRung::tighten`]; a
//!   placement rung: a function beside `larger_gpu` that `tighten` calls.
//!   Either way, its note in [`RetryRung::over_budget_note`].
//! * A new setting: its [`Settings`] field (`training.rs`: `Default` and
//!   `Display`), its bytes in [`crate::memory::estimate_stage`], its time in
//!   [`crate::timing::relative_compute`], and in `search.rs`
//!   `describe_numerics` and, if the search may apply it, `NUMERICS_RUNGS`;
//!   the worker must run it (`worker/src/train.rs` reads the plan's settings).
//! * The API: `MemoryPolicy::allowed_rungs` (`operator/api/src/job/spec.rs`) lists
//!   the rungs in its doc and bounds them (`length(max = …)`); `make
//!   manifests` regenerates the CRDs from it.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::adapters::BaseFormat;
use crate::backend::{BackendProfile, CUDA, FLEX};
use crate::inventory::DeviceType;
use crate::training::{Precision, Settings, divisors_desc};
use crate::units::format_bytes;

/// One way to need less memory per worker, in the default order of the ladder.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
#[serde(rename_all = "camelCase")]
pub enum RetryRung {
    /// GPU LoRA jobs: keep the frozen token embedding in host memory and
    /// upload only the micro-batch's rows.
    OffloadEmbedding,
    /// Turn activation checkpointing on.
    ActivationCheckpointing,
    /// Halve the micro-batch and double gradient accumulation.
    HalveMicroBatch,
    /// Move to a lower precision the backend supports (fp32 → bf16).
    LowerPrecision,
    /// Keep optimizer state in 8 bits where the backend runs it (see
    /// [`RetryRung::runnable`]).
    CheaperOptimizer,
    /// LoRA jobs only: store the frozen base in fewer bits (dense → int8 →
    /// int4, seed 002's order), where the backend really saves memory.
    QuantizeBase,
    /// GPU workers only: keep the optimizer state, and its step, in host memory.
    OffloadOptimizer,
    /// GPU workers only: move each block's gradients to a host fp32
    /// accumulator as backward produces them (turns checkpointing and the
    /// optimizer offload on).
    OffloadGradients,
    /// GPU workers only: keep the checkpointed block inputs in host memory
    /// between forward and recomputation (turns checkpointing on).
    OffloadActivations,
    /// More data-parallel replicas, each keeping a smaller share of the
    /// optimizer state (where the worker runs replicas).
    ShardOptimizerState,
    /// Split the layers over more pipeline stages.
    MorePipelineStages,
    /// Move to a GPU type with more memory.
    LargerGpu,
}

impl RetryRung {
    /// Every rung, in the fixed order the ladder climbs them: cheapest in
    /// speed and devices first (the reasons are in the module docs).
    pub const ALL: [RetryRung; 12] = [
        RetryRung::OffloadEmbedding,
        RetryRung::ActivationCheckpointing,
        RetryRung::HalveMicroBatch,
        RetryRung::LowerPrecision,
        RetryRung::CheaperOptimizer,
        RetryRung::QuantizeBase,
        RetryRung::OffloadOptimizer,
        RetryRung::OffloadGradients,
        RetryRung::OffloadActivations,
        RetryRung::ShardOptimizerState,
        RetryRung::MorePipelineStages,
        RetryRung::LargerGpu,
    ];

    /// What a job allows when it names no rungs: every [`runnable`](Self::runnable)
    /// rung, in the ladder's order. A rung the worker cannot run is never offered.
    pub const DEFAULT: [RetryRung; 12] = Self::ALL;

    /// Whether some worker backend can run what this rung produces:
    /// `CheaperOptimizer` needs a profile listing an 8-bit optimizer,
    /// `QuantizeBase` a quantized base format that stores fewer bytes than
    /// bf16, `OffloadOptimizer` a profile with `optimizer_offload`,
    /// `OffloadActivations` one with `activation_offload`,
    /// `OffloadEmbedding` one with `embedding_offload`,
    /// `OffloadGradients` one with `gradient_offload` (and
    /// `optimizer_offload`, which it extends). When a
    /// profile starts listing one, this turns true and the rung belongs in
    /// [`RetryRung::DEFAULT`] (a test says so) and the API's allowed list.
    pub fn runnable(self) -> bool {
        match self {
            RetryRung::CheaperOptimizer => [&FLEX, &CUDA].into_iter().any(|p| {
                p.optimizers
                    .iter()
                    .any(|o| o.cheaper().is_some_and(|c| p.optimizers.contains(&c)))
            }),
            RetryRung::QuantizeBase => [&FLEX, &CUDA].into_iter().any(|p| {
                p.precisions
                    .iter()
                    .any(|&precision| next_base_format(BaseFormat::Dense, precision, p).is_some())
            }),
            RetryRung::OffloadOptimizer => [&FLEX, &CUDA].into_iter().any(|p| p.optimizer_offload),
            RetryRung::OffloadActivations => {
                [&FLEX, &CUDA].into_iter().any(|p| p.activation_offload)
            }
            RetryRung::OffloadEmbedding => [&FLEX, &CUDA].into_iter().any(|p| p.embedding_offload),
            RetryRung::OffloadGradients => [&FLEX, &CUDA]
                .into_iter()
                .any(|p| p.gradient_offload && p.optimizer_offload),
            RetryRung::ShardOptimizerState => [&FLEX, &CUDA].into_iter().any(|p| p.data_parallel),
            _ => true,
        }
    }

    /// The next stricter settings this rung offers from `settings` on
    /// `profile`, keeping `micro-batch × accumulation = global_batch`; `None`
    /// when it has nothing stricter, or when it changes where the job runs
    /// (stages, GPU type) rather than its settings. `lora`: the job trains
    /// adapters on a frozen base (only then may the base be quantized; a
    /// retry never switches between full fine-tuning and LoRA).
    pub fn tighten_settings(
        self,
        settings: &Settings,
        profile: &BackendProfile,
        global_batch: u32,
        lora: bool,
    ) -> Option<Settings> {
        let mut next = *settings;
        match self {
            RetryRung::OffloadEmbedding => {
                // Only a frozen embedding can wait on the host.
                if settings.offload_embedding
                    || !lora
                    || !profile.embedding_offload
                    || profile.device_is_host
                {
                    return None;
                }
                next.offload_embedding = true;
            }
            RetryRung::ActivationCheckpointing => {
                if settings.activation_checkpointing {
                    return None;
                }
                next.activation_checkpointing = true;
            }
            RetryRung::HalveMicroBatch => {
                // At most half; the largest divisor keeps the global batch exact.
                let b = divisors_desc(global_batch)
                    .into_iter()
                    .find(|&d| d <= settings.micro_batch / 2)?;
                next.micro_batch = b;
                next.gradient_accumulation = global_batch / b;
            }
            RetryRung::LowerPrecision => {
                next.precision = settings
                    .precision
                    .lower()
                    .filter(|l| profile.precisions.contains(l))?;
            }
            RetryRung::CheaperOptimizer => {
                next.optimizer = settings
                    .optimizer
                    .cheaper()
                    .filter(|o| profile.optimizers.contains(o))?;
            }
            RetryRung::QuantizeBase => {
                if !lora {
                    return None;
                }
                next.base_format =
                    next_base_format(settings.base_format, settings.precision, profile)?;
            }
            RetryRung::OffloadOptimizer => {
                if settings.offload_optimizer
                    || !profile.optimizer_offload
                    || profile.device_is_host
                {
                    return None;
                }
                next.offload_optimizer = true;
            }
            RetryRung::OffloadGradients => {
                if settings.offload_gradients
                    || !profile.gradient_offload
                    || !profile.optimizer_offload
                    || profile.device_is_host
                {
                    return None;
                }
                // Backward runs block by block only under checkpointing,
                // and the step the gradients go to is the host's.
                next.offload_gradients = true;
                next.activation_checkpointing = true;
                next.offload_optimizer = true;
            }
            RetryRung::OffloadActivations => {
                if settings.offload_activations
                    || !profile.activation_offload
                    || profile.device_is_host
                {
                    return None;
                }
                // The inputs it moves are checkpointing's.
                next.offload_activations = true;
                next.activation_checkpointing = true;
            }
            RetryRung::ShardOptimizerState
            | RetryRung::MorePipelineStages
            | RetryRung::LargerGpu => return None,
        }
        Some(next)
    }

    /// The stricter candidates this rung offers from `from`, least strict first.
    pub fn tighten(self, from: &Candidate, limits: &RungLimits) -> Tightening {
        match self {
            RetryRung::HalveMicroBatch => {
                // Every halving down to micro-batch 1: each costs speed, so
                // the ladder stops at the first that fits.
                Tightening::Try(self.settings_steps(from, limits))
            }
            RetryRung::QuantizeBase => {
                if !limits.lora {
                    return Tightening::Skip(
                        "full fine-tuning: only a LoRA job's frozen base may be quantized".into(),
                    );
                }
                // Each stricter format the backend stores smaller, one at a time.
                let steps = self.settings_steps(from, limits);
                if steps.is_empty() {
                    return Tightening::Skip(format!(
                        "the {} backend stores no base format smaller than {}",
                        limits.profile.backend, from.settings.base_format
                    ));
                }
                Tightening::Try(steps)
            }
            RetryRung::ShardOptimizerState => shard_optimizer_state(from, limits),
            RetryRung::MorePipelineStages => more_pipeline_stages(from, limits),
            RetryRung::LargerGpu => larger_gpu(from, limits),
            RetryRung::OffloadEmbedding
            | RetryRung::ActivationCheckpointing
            | RetryRung::LowerPrecision
            | RetryRung::CheaperOptimizer
            | RetryRung::OffloadOptimizer
            | RetryRung::OffloadGradients
            | RetryRung::OffloadActivations => {
                let s = &from.settings;
                match self.tighten_settings(s, limits.profile, limits.global_batch, limits.lora) {
                    Some(next) => Tightening::Try(vec![Candidate {
                        settings: next,
                        ..from.clone()
                    }]),
                    None => Tightening::Skip(self.settings_skip_reason(s, limits)),
                }
            }
        }
    }

    /// The candidates of a settings rung applied again and again from
    /// `from` until it offers nothing stricter, least strict first.
    fn settings_steps(self, from: &Candidate, limits: &RungLimits) -> Vec<Candidate> {
        let mut steps: Vec<Candidate> = Vec::new();
        let mut at = from.settings;
        while let Some(next) =
            self.tighten_settings(&at, limits.profile, limits.global_batch, limits.lora)
        {
            steps.push(Candidate {
                settings: next,
                ..from.clone()
            });
            at = next;
        }
        steps
    }

    /// Why a settings rung offers nothing stricter than `s`.
    fn settings_skip_reason(self, s: &Settings, limits: &RungLimits) -> String {
        let backend = limits.profile.backend;
        let on_host = limits.profile.device_is_host;
        match self {
            RetryRung::OffloadEmbedding if s.offload_embedding => "already offloaded".into(),
            RetryRung::OffloadEmbedding if !limits.lora => {
                "full fine-tuning trains the embedding: only a LoRA job's frozen one waits on the host".into()
            }
            RetryRung::OffloadEmbedding if on_host => format!(
                "not applicable on the {backend} backend: a CPU worker's embedding is in host memory already"
            ),
            RetryRung::OffloadEmbedding => {
                format!("the {backend} backend keeps the embedding on its device")
            }
            RetryRung::ActivationCheckpointing => "already on".into(),
            RetryRung::LowerPrecision => {
                format!("{backend} backend offers nothing below {}", s.precision)
            }
            RetryRung::CheaperOptimizer => format!(
                "no cheaper-state variant of {} on the {backend} backend",
                s.optimizer
            ),
            RetryRung::OffloadOptimizer if s.offload_optimizer => "already offloaded".into(),
            RetryRung::OffloadOptimizer if on_host => format!(
                "not applicable on the {backend} backend: a CPU worker's optimizer state is in host memory already"
            ),
            RetryRung::OffloadOptimizer => {
                format!("the {backend} backend keeps optimizer state on its device")
            }
            RetryRung::OffloadGradients if s.offload_gradients => "already offloaded".into(),
            RetryRung::OffloadGradients if on_host => format!(
                "not applicable on the {backend} backend: a CPU worker's gradients are in host memory already"
            ),
            RetryRung::OffloadGradients => {
                format!("the {backend} backend keeps gradients on its device")
            }
            RetryRung::OffloadActivations if s.offload_activations => "already offloaded".into(),
            RetryRung::OffloadActivations if on_host => format!(
                "not applicable on the {backend} backend: a CPU worker's activations are in host memory already"
            ),
            RetryRung::OffloadActivations => {
                format!("the {backend} backend keeps checkpointed activations on its device")
            }
            RetryRung::HalveMicroBatch
            | RetryRung::QuantizeBase
            | RetryRung::ShardOptimizerState
            | RetryRung::MorePipelineStages
            | RetryRung::LargerGpu => format!("no stricter settings than {s}"),
        }
    }

    /// Why this rung did not help when none of its candidates fit: `reached`
    /// is the strictest candidate it offered (or where the ladder stood, when
    /// it offered none), `shortfall` that candidate's "peak > budget".
    pub fn over_budget_note(
        self,
        reached: &Candidate,
        tried: &[Candidate],
        shortfall: impl FnOnce() -> String,
    ) -> String {
        let s = &reached.settings;
        match self {
            RetryRung::OffloadEmbedding => format!("embedding offloaded → {}", shortfall()),
            RetryRung::ActivationCheckpointing => format!("on → {}", shortfall()),
            RetryRung::HalveMicroBatch => format!(
                "down to micro-batch {} × accumulation {} → {}",
                s.micro_batch,
                s.gradient_accumulation,
                shortfall()
            ),
            RetryRung::LowerPrecision => format!("{} → {}", s.precision, shortfall()),
            RetryRung::CheaperOptimizer => format!("{} → {}", s.optimizer, shortfall()),
            RetryRung::QuantizeBase => format!("{} base → {}", s.base_format, shortfall()),
            RetryRung::OffloadOptimizer => format!("optimizer offloaded → {}", shortfall()),
            RetryRung::OffloadGradients => format!("gradients offloaded → {}", shortfall()),
            RetryRung::OffloadActivations => format!("checkpoints offloaded → {}", shortfall()),
            RetryRung::ShardOptimizerState => {
                format!("up to {} replicas → {}", reached.replicas, shortfall())
            }
            RetryRung::MorePipelineStages => {
                format!("up to {} stages → {}", reached.stages, shortfall())
            }
            RetryRung::LargerGpu => {
                let mut names: Vec<String> = Vec::new();
                for c in tried {
                    let name = format!(
                        "{} ({})",
                        c.device.name,
                        format_bytes(c.device.memory_bytes)
                    );
                    if names.last() != Some(&name) {
                        names.push(name);
                    }
                }
                format!("tried {}; none fits", names.join(", "))
            }
        }
    }
}

/// `shardOptimizerState`: every larger replica count that divides the
/// global batch, each with the largest micro-batch at most the current one
/// that divides its share.
fn shard_optimizer_state(from: &Candidate, limits: &RungLimits) -> Tightening {
    if !limits.profile.data_parallel {
        return Tightening::Skip(format!(
            "the {} worker runs no data-parallel replicas",
            limits.profile.backend
        ));
    }
    let s = &from.settings;
    let (p, d) = from.shape();
    let global = s.global_batch() * u64::from(d);
    let free = from.device.free.max(from.devices());
    let max_d = (limits.max_devices / p).min(free / p);
    let more: Vec<Candidate> = divisors_desc(u32::try_from(global).unwrap_or(u32::MAX))
        .into_iter()
        .rev()
        .filter(|&n| n > d && n <= max_d)
        .filter_map(|n| {
            let share = u32::try_from(global / u64::from(n)).ok()?;
            let micro_batch = divisors_desc(share)
                .into_iter()
                .find(|&b| b <= s.micro_batch)?;
            Some(Candidate {
                replicas: n,
                settings: Settings {
                    micro_batch,
                    gradient_accumulation: share / micro_batch,
                    ..*s
                },
                ..from.clone()
            })
        })
        .collect();
    if more.is_empty() {
        return Tightening::Skip(format!(
            "already at {d} replica(s): no more that divide the global batch {global} within {} device(s)",
            limits.max_devices.min(free)
        ));
    }
    Tightening::Try(more)
}

/// `morePipelineStages`: every larger stage count the limits and the free
/// devices allow, fewest first.
fn more_pipeline_stages(from: &Candidate, limits: &RungLimits) -> Tightening {
    // The failed attempt's own count was free to it, whatever the
    // inventory says now.
    let p = from.stages;
    let d = from.replicas;
    let free_p = from.device.free.max(from.devices()) / d;
    let max_p = limits.max_workers.min(limits.max_devices / d).min(free_p);
    if p >= max_p {
        return Tightening::Skip(format!(
            "already at {p} stage(s), the most allowed/available"
        ));
    }
    Tightening::Try(
        (p + 1..=max_p)
            .map(|stages| Candidate {
                stages,
                ..from.clone()
            })
            .collect(),
    )
}

/// `largerGpu`: every free allowed GPU type larger than the failed one's.
fn larger_gpu(from: &Candidate, limits: &RungLimits) -> Tightening {
    let d = from.replicas;
    let mut larger: Vec<&DeviceType> = limits
        .devices
        .iter()
        .filter(|dev| dev.memory_bytes > from.device.memory_bytes && dev.free >= d)
        .collect();
    larger.sort_by_key(|dev| dev.memory_bytes);
    if larger.is_empty() {
        return Tightening::Skip(format!(
            "no free allowed GPU type larger than {}",
            format_bytes(from.device.memory_bytes)
        ));
    }
    // Smallest larger type first, fewest stages first on each;
    // the replicas stay (the batch split is the failed one's).
    Tightening::Try(
        larger
            .into_iter()
            .flat_map(|dev| {
                let max_p = limits
                    .max_workers
                    .min(limits.max_devices / d)
                    .min(dev.free / d);
                (1..=max_p).map(move |stages| Candidate {
                    device: dev.clone(),
                    stages,
                    replicas: d,
                    settings: from.settings,
                })
            })
            .collect(),
    )
}

/// Bytes one stored base value occupies on `profile`, its share of the
/// block scales included (at the default 64-value blocks): the training
/// precision's for a dense base; 1 for int8 and the profile's
/// `int4_value_bytes` for int4, each with an f32 scale per block; half a
/// byte for NF4, with a byte per block and an f32 per 256 blocks.
pub fn base_value_bytes(format: BaseFormat, precision: Precision, profile: &BackendProfile) -> f64 {
    let scale = 4.0 / f64::from(crate::adapters::default_block_size());
    match format {
        BaseFormat::Dense => precision.weight_bytes() as f64,
        BaseFormat::Int8 => 1.0 + scale,
        BaseFormat::Int4 => profile.int4_value_bytes + scale,
        BaseFormat::Nf4 => 0.5 + 1.0 / 64.0 + 4.0 / (64.0 * 256.0),
    }
}

/// The next stricter base format (dense → int8 → nf4; int4 → nf4) that
/// `profile` lists and that stores a value in fewer bytes than `from`;
/// `None` when none saves anything.
pub fn next_base_format(
    from: BaseFormat,
    precision: Precision,
    profile: &BackendProfile,
) -> Option<BaseFormat> {
    let current = base_value_bytes(from, precision, profile);
    let mut at = from.stricter();
    while let Some(format) = at {
        if profile.base_formats.contains(&format)
            && base_value_bytes(format, precision, profile) < current
        {
            return Some(format);
        }
        at = format.stricter();
    }
    None
}

impl std::fmt::Display for RetryRung {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RetryRung::OffloadEmbedding => "offloadEmbedding",
            RetryRung::ActivationCheckpointing => "activationCheckpointing",
            RetryRung::HalveMicroBatch => "halveMicroBatch",
            RetryRung::LowerPrecision => "lowerPrecision",
            RetryRung::CheaperOptimizer => "cheaperOptimizer",
            RetryRung::QuantizeBase => "quantizeBase",
            RetryRung::OffloadOptimizer => "offloadOptimizer",
            RetryRung::OffloadGradients => "offloadGradients",
            RetryRung::OffloadActivations => "offloadActivations",
            RetryRung::ShardOptimizerState => "shardOptimizerState",
            RetryRung::MorePipelineStages => "morePipelineStages",
            RetryRung::LargerGpu => "largerGpu",
        })
    }
}

/// Where and how an attempt would run: what the rungs tighten.
#[derive(Clone, Debug, PartialEq)]
pub struct Candidate {
    pub device: DeviceType,
    /// Pipeline stages (p).
    pub stages: u32,
    /// Data-parallel replicas of each stage (d); p × d devices in all.
    pub replicas: u32,
    pub settings: Settings,
}

impl Candidate {
    /// Devices it needs: stages × replicas.
    pub fn devices(&self) -> u32 {
        self.stages * self.replicas
    }

    /// (stages, replicas).
    pub fn shape(&self) -> (u32, u32) {
        (self.stages, self.replicas)
    }
}

/// What the rungs may move to beyond a candidate: the job's limits and the
/// cluster's devices.
#[derive(Clone, Debug)]
pub struct RungLimits {
    /// The job's backend: the precisions and optimizers a worker runs.
    pub profile: &'static BackendProfile,
    /// Samples per optimizer step of one replica (micro-batch ×
    /// accumulation); every candidate keeps it.
    pub global_batch: u32,
    /// The job trains LoRA adapters (only then is `QuantizeBase` offered).
    pub lora: bool,
    /// Most pipeline stages the job may use.
    pub max_workers: u32,
    /// Most devices (stages × replicas) the job may use.
    pub max_devices: u32,
    /// Device types the job may use (`LargerGpu` picks the larger ones with a free device).
    pub devices: Vec<DeviceType>,
}

/// A rung's answer to "what is stricter than this?".
#[derive(Clone, Debug, PartialEq)]
pub enum Tightening {
    /// Stricter candidates, least strict first. The ladder tries each in
    /// turn and carries the last on to the next rung. Empty when the rung
    /// applies but has no step left (micro-batch already 1): the ladder
    /// then says how far over budget it stands.
    Try(Vec<Candidate>),
    /// The rung does not apply from here, and why (e.g. "already on").
    Skip(String),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::DeviceKind;
    use crate::training::{Optimizer, Precision};
    use crate::units::GIB;

    fn settings(micro_batch: u32, accumulation: u32) -> Settings {
        Settings {
            micro_batch,
            gradient_accumulation: accumulation,
            ..Settings::default()
        }
    }

    fn gpu(name: &str, gib: u64, free: u32) -> DeviceType {
        DeviceType {
            name: name.into(),
            kind: DeviceKind::Gpu,
            resource: "nvidia.com/gpu".into(),
            memory_bytes: gib * GIB,
            free,
            free_on_one_node: free,
            total: free,
            total_on_one_node: free,
            host_memory_bytes: None,
        }
    }

    fn limits(devices: Vec<DeviceType>) -> RungLimits {
        RungLimits {
            profile: &CUDA,
            global_batch: 12,
            lora: false,
            max_workers: 3,
            max_devices: 3,
            devices,
        }
    }

    #[test]
    fn the_default_is_every_runnable_rung_in_ladder_order() {
        let runnable: Vec<RetryRung> = RetryRung::ALL
            .into_iter()
            .filter(|r| r.runnable())
            .collect();
        assert_eq!(runnable, RetryRung::DEFAULT.to_vec());
        assert!(RetryRung::CheaperOptimizer.runnable());
        // GPU workers step the optimizer on the host (worker/src/optim/offload.rs).
        assert!(RetryRung::OffloadOptimizer.runnable());
        // Workers run ZeRO-1 replicas (worker/src/data_parallel.rs).
        assert!(RetryRung::ShardOptimizerState.runnable());
    }

    /// More replicas: every larger divisor of the global batch within the
    /// devices, micro-batch kept where it divides the new share.
    #[test]
    fn shard_optimizer_state_adds_replicas_and_keeps_the_global_batch() {
        let from = Candidate {
            device: gpu("NVIDIA-H100-80GB-HBM3", 80, 8),
            stages: 1,
            replicas: 2,
            settings: settings(4, 2),
        };
        let limits = RungLimits {
            profile: &CUDA,
            global_batch: 8,
            max_workers: 8,
            max_devices: 8,
            ..limits(vec![])
        };
        let Tightening::Try(more) = RetryRung::ShardOptimizerState.tighten(&from, &limits) else {
            panic!("replicas can be added");
        };
        let shapes: Vec<(u32, u32, u32, u32)> = more
            .iter()
            .map(|c| {
                (
                    c.stages,
                    c.replicas,
                    c.settings.micro_batch,
                    c.settings.gradient_accumulation,
                )
            })
            .collect();
        // Global batch 16: 4 replicas of 4 (micro-batch 4 × 1), 8 of 2 (2 × 1).
        assert_eq!(shapes, [(1, 4, 4, 1), (1, 8, 2, 1)]);
        // Two stages: at most 4 replicas on 8 devices.
        let two = Candidate {
            stages: 2,
            ..from.clone()
        };
        let Tightening::Try(more) = RetryRung::ShardOptimizerState.tighten(&two, &limits) else {
            panic!("4 replicas fit 8 devices");
        };
        assert_eq!(more.iter().map(|c| c.replicas).collect::<Vec<_>>(), [4]);
        // Where the worker runs no replicas, the rung says so.
        static NO_REPLICAS: BackendProfile = BackendProfile {
            data_parallel: false,
            ..CUDA
        };
        let plain = RungLimits {
            profile: &NO_REPLICAS,
            ..limits.clone()
        };
        assert!(matches!(
            RetryRung::ShardOptimizerState.tighten(&from, &plain),
            Tightening::Skip(why) if why.contains("no data-parallel replicas")
        ));
    }

    #[test]
    fn settings_rungs_tighten_one_step_and_keep_the_global_batch() {
        let s = settings(12, 1);
        let on = RetryRung::ActivationCheckpointing
            .tighten_settings(&s, &CUDA, 12, false)
            .expect("off → on");
        assert!(on.activation_checkpointing);
        assert_eq!(
            RetryRung::ActivationCheckpointing.tighten_settings(&on, &CUDA, 12, false),
            None
        );

        // 12 → 6 → 3 → 1: the largest divisor of the global batch at most half.
        let mut micro = Vec::new();
        let mut at = s;
        while let Some(next) = RetryRung::HalveMicroBatch.tighten_settings(&at, &CUDA, 12, false) {
            assert_eq!(next.global_batch(), 12);
            micro.push(next.micro_batch);
            at = next;
        }
        assert_eq!(micro, vec![6, 3, 1]);

        let lower = RetryRung::LowerPrecision
            .tighten_settings(&s, &CUDA, 12, false)
            .expect("cuda offers bf16");
        assert_eq!(lower.precision, Precision::Bf16);
        assert_eq!(
            RetryRung::LowerPrecision.tighten_settings(&s, &FLEX, 12, false),
            None,
            "flex trains in fp32 only"
        );
        let cheaper = RetryRung::CheaperOptimizer
            .tighten_settings(&s, &FLEX, 12, false)
            .expect("adamw → adamw8bit");
        assert_eq!(cheaper.optimizer, Optimizer::Adamw8bit);
        assert_eq!(
            RetryRung::CheaperOptimizer.tighten_settings(&cheaper, &FLEX, 12, false),
            None,
            "nothing cheaper than 8-bit AdamW"
        );
        for placement in [RetryRung::MorePipelineStages, RetryRung::LargerGpu] {
            assert_eq!(placement.tighten_settings(&s, &CUDA, 12, false), None);
        }
    }

    #[test]
    fn placement_rungs_offer_more_stages_then_larger_types() {
        let t4 = gpu("Tesla-T4", 15, 4);
        let from = Candidate {
            device: t4.clone(),
            stages: 1,
            replicas: 1,
            settings: settings(12, 1),
        };
        let lim = limits(vec![
            gpu("NVIDIA-A100-SXM4-80GB", 80, 1),
            t4.clone(),
            gpu("NVIDIA-L4", 22, 2),
            gpu("NVIDIA-A10G", 22, 0),
        ]);
        let Tightening::Try(more) = RetryRung::MorePipelineStages.tighten(&from, &lim) else {
            panic!("stages 2..=3 are allowed");
        };
        assert_eq!(
            more.iter().map(|c| c.stages).collect::<Vec<_>>(),
            vec![2, 3]
        );

        let Tightening::Try(larger) = RetryRung::LargerGpu.tighten(&from, &lim) else {
            panic!("larger types are free");
        };
        let tried: Vec<(&str, u32)> = larger
            .iter()
            .map(|c| (c.device.name.as_str(), c.stages))
            .collect();
        // Smallest larger type first, fewest stages first; no free A10G.
        assert_eq!(
            tried,
            vec![
                ("NVIDIA-L4", 1),
                ("NVIDIA-L4", 2),
                ("NVIDIA-A100-SXM4-80GB", 1)
            ]
        );
        let note = RetryRung::LargerGpu.over_budget_note(&larger[2], &larger, || unreachable!());
        assert_eq!(
            note,
            "tried NVIDIA-L4 (22.0 GiB), NVIDIA-A100-SXM4-80GB (80.0 GiB); none fits"
        );

        let at_most = Candidate {
            stages: 3,
            replicas: 1,
            ..from.clone()
        };
        assert!(matches!(
            RetryRung::MorePipelineStages.tighten(&at_most, &lim),
            Tightening::Skip(_)
        ));
        let largest = Candidate {
            device: gpu("NVIDIA-A100-SXM4-80GB", 80, 1),
            ..from
        };
        assert!(matches!(
            RetryRung::LargerGpu.tighten(&largest, &lim),
            Tightening::Skip(_)
        ));
    }

    #[test]
    fn a_rung_with_nothing_stricter_says_why() {
        let from = Candidate {
            device: gpu("Tesla-T4", 15, 1),
            stages: 1,
            replicas: 1,
            settings: Settings {
                activation_checkpointing: true,
                ..settings(1, 12)
            },
        };
        let lim = limits(vec![]);
        assert_eq!(
            RetryRung::ActivationCheckpointing.tighten(&from, &lim),
            Tightening::Skip("already on".into())
        );
        let eight_bit = Candidate {
            settings: Settings {
                optimizer: Optimizer::Adamw8bit,
                ..from.settings
            },
            ..from.clone()
        };
        assert_eq!(
            RetryRung::CheaperOptimizer.tighten(&eight_bit, &lim),
            Tightening::Skip("no cheaper-state variant of adamw8bit on the cuda backend".into())
        );
        // Halving applies but has no step left below micro-batch 1.
        assert_eq!(
            RetryRung::HalveMicroBatch.tighten(&from, &lim),
            Tightening::Try(vec![])
        );
    }

    /// FLEX with QLoRA and 8-bit AdamW: every base format listed, int4
    /// still one byte a value.
    static FLEX_QLORA: BackendProfile = BackendProfile {
        base_formats: &[
            BaseFormat::Dense,
            BaseFormat::Int8,
            BaseFormat::Int4,
            BaseFormat::Nf4,
        ],
        optimizers: &[Optimizer::Adamw, Optimizer::Adamw8bit],
        ..FLEX
    };
    /// CUDA with packed int4 and optimizer offload.
    static CUDA_QLORA: BackendProfile = BackendProfile {
        base_formats: &[
            BaseFormat::Dense,
            BaseFormat::Int8,
            BaseFormat::Int4,
            BaseFormat::Nf4,
        ],
        optimizers: &[Optimizer::Adamw, Optimizer::Adamw8bit],
        optimizer_offload: true,
        ..CUDA
    };

    #[test]
    fn quantize_base_offers_only_formats_that_save_bytes_and_only_to_lora_jobs() {
        let dense = settings(4, 3);
        let step = |s: &Settings, p: &BackendProfile, lora: bool| {
            RetryRung::QuantizeBase.tighten_settings(s, p, 12, lora)
        };
        // dense → int8 → nf4 on both backends; nothing after nf4.
        for profile in [&FLEX_QLORA, &CUDA_QLORA] {
            let int8 = step(&dense, profile, true).expect("dense → int8");
            assert_eq!(int8.base_format, BaseFormat::Int8);
            let nf4 = step(&int8, profile, true).expect("int8 → nf4");
            assert_eq!(nf4.base_format, BaseFormat::Nf4);
            assert_eq!(step(&nf4, profile, true), None);
        }
        // A user's int4 goes to nf4 where that saves bytes: always on flex
        // (int4 takes a byte there), and on CUDA too (f32 scales per 64).
        let int4 = Settings {
            base_format: BaseFormat::Int4,
            ..dense
        };
        for profile in [&FLEX_QLORA, &CUDA_QLORA] {
            let next = step(&int4, profile, true).map(|s| s.base_format);
            assert_eq!(next, Some(BaseFormat::Nf4));
        }
        // Without nf4, flex offers no 4-bit step after int8: its int4 costs
        // what int8 does.
        static FLEX_NO_NF4: BackendProfile = BackendProfile {
            base_formats: &[BaseFormat::Dense, BaseFormat::Int8, BaseFormat::Int4],
            ..FLEX_QLORA
        };
        let int8 = step(&dense, &FLEX_NO_NF4, true).expect("dense → int8");
        assert_eq!(step(&int8, &FLEX_NO_NF4, true), None);
        // Never for full fine-tuning, never where no format is listed.
        assert_eq!(step(&dense, &CUDA_QLORA, false), None);
        static DENSE_ONLY: BackendProfile = BackendProfile {
            base_formats: &[BaseFormat::Dense],
            ..CUDA
        };
        assert_eq!(step(&dense, &DENSE_ONLY, true), None);
        let from = Candidate {
            device: gpu("NVIDIA-L4", 22, 1),
            stages: 1,
            replicas: 1,
            settings: dense,
        };
        let lim = RungLimits {
            profile: &CUDA_QLORA,
            lora: true,
            ..limits(vec![])
        };
        let Tightening::Try(steps) = RetryRung::QuantizeBase.tighten(&from, &lim) else {
            panic!("int8 and nf4 are offered");
        };
        let formats: Vec<BaseFormat> = steps.iter().map(|c| c.settings.base_format).collect();
        assert_eq!(formats, vec![BaseFormat::Int8, BaseFormat::Nf4]);
        let full = RungLimits {
            lora: false,
            ..lim.clone()
        };
        assert!(matches!(
            RetryRung::QuantizeBase.tighten(&from, &full),
            Tightening::Skip(_)
        ));
    }

    #[test]
    fn offload_only_where_the_backend_offers_it() {
        let s = settings(4, 3);
        let off = RetryRung::OffloadOptimizer
            .tighten_settings(&s, &CUDA_QLORA, 12, false)
            .expect("cuda with offload");
        assert!(off.offload_optimizer);
        assert_eq!(
            RetryRung::OffloadOptimizer.tighten_settings(&off, &CUDA_QLORA, 12, false),
            None
        );
        let no_offload = BackendProfile {
            optimizer_offload: false,
            ..CUDA
        };
        assert_eq!(
            RetryRung::OffloadOptimizer.tighten_settings(&s, &no_offload, 12, false),
            None
        );
        assert!(
            RetryRung::OffloadOptimizer
                .tighten_settings(&s, &CUDA, 12, false)
                .is_some()
        );
        // A CPU worker's state is in host memory already.
        let flex = BackendProfile {
            optimizer_offload: true,
            ..FLEX
        };
        assert_eq!(
            RetryRung::OffloadOptimizer.tighten_settings(&s, &flex, 12, false),
            None
        );
        // 8-bit AdamW where listed.
        let cheaper = RetryRung::CheaperOptimizer
            .tighten_settings(&s, &FLEX_QLORA, 12, false)
            .expect("adamw → adamw8bit");
        assert_eq!(cheaper.optimizer, Optimizer::Adamw8bit);
    }

    #[test]
    fn offloaded_checkpoints_turn_checkpointing_on_and_only_on_a_gpu() {
        let s = settings(4, 3);
        assert!(!s.activation_checkpointing);
        let off = RetryRung::OffloadActivations
            .tighten_settings(&s, &CUDA, 12, false)
            .expect("cuda offloads checkpoints");
        assert!(off.offload_activations && off.activation_checkpointing);
        assert_eq!((off.micro_batch, off.gradient_accumulation), (4, 3));
        assert_eq!(
            RetryRung::OffloadActivations.tighten_settings(&off, &CUDA, 12, false),
            None
        );
        // A CPU worker's activations are in host memory already.
        assert_eq!(
            RetryRung::OffloadActivations.tighten_settings(&s, &FLEX, 12, false),
            None
        );
        assert!(RetryRung::OffloadActivations.runnable());
    }

    #[test]
    fn offloaded_gradients_turn_checkpointing_and_the_optimizer_offload_on_only_on_a_gpu() {
        let s = settings(4, 3);
        let off = RetryRung::OffloadGradients
            .tighten_settings(&s, &CUDA, 12, false)
            .expect("cuda offloads gradients");
        assert!(off.offload_gradients && off.activation_checkpointing && off.offload_optimizer);
        assert_eq!((off.micro_batch, off.gradient_accumulation), (4, 3));
        assert_eq!(
            RetryRung::OffloadGradients.tighten_settings(&off, &CUDA, 12, false),
            None
        );
        // LoRA jobs too: the adapters' gradients are what leaves.
        assert!(
            RetryRung::OffloadGradients
                .tighten_settings(&s, &CUDA, 12, true)
                .is_some()
        );
        // A CPU worker's gradients are in host memory already; a GPU
        // worker without the optimizer offload has no host step to feed.
        assert_eq!(
            RetryRung::OffloadGradients.tighten_settings(&s, &FLEX, 12, false),
            None
        );
        let no_host_step = BackendProfile {
            optimizer_offload: false,
            ..CUDA
        };
        assert_eq!(
            RetryRung::OffloadGradients.tighten_settings(&s, &no_host_step, 12, false),
            None
        );
        let from = Candidate {
            device: gpu("NVIDIA-GeForce-RTX-4090", 24, 1),
            stages: 1,
            replicas: 1,
            settings: off,
        };
        assert_eq!(
            RetryRung::OffloadGradients.tighten(&from, &limits(vec![])),
            Tightening::Skip("already offloaded".into())
        );
        assert!(RetryRung::OffloadGradients.runnable());
        let at = |r| RetryRung::ALL.iter().position(|x| *x == r);
        assert_eq!(
            at(RetryRung::OffloadGradients),
            at(RetryRung::OffloadOptimizer).map(|i| i + 1),
            "right after the offload it extends"
        );
    }

    #[test]
    fn an_embedding_is_offloaded_only_for_lora_on_a_gpu() {
        let s = settings(4, 3);
        let off = RetryRung::OffloadEmbedding
            .tighten_settings(&s, &CUDA, 12, true)
            .expect("a LoRA job on cuda offloads its frozen embedding");
        assert!(off.offload_embedding);
        assert_eq!(
            Settings {
                offload_embedding: false,
                ..off
            },
            s,
            "nothing else changes"
        );
        assert_eq!(
            RetryRung::OffloadEmbedding.tighten_settings(&off, &CUDA, 12, true),
            None
        );
        // Full fine-tuning trains it; a CPU worker's is in host memory already.
        assert_eq!(
            RetryRung::OffloadEmbedding.tighten_settings(&s, &CUDA, 12, false),
            None
        );
        assert_eq!(
            RetryRung::OffloadEmbedding.tighten_settings(&s, &FLEX, 12, true),
            None
        );
        assert!(RetryRung::OffloadEmbedding.runnable());
        assert_eq!(RetryRung::ALL[0], RetryRung::OffloadEmbedding);
    }
}
