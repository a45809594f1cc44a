//! The training loop: one optimizer step = `gradient_accumulation`
//! micro-batches of `micro_batch` samples, gradients summed, one update, so
//! the global batch is the plan's whatever the split.
//!
//! A step runs the 1F1B schedule of this worker's pipeline stage
//! ([`crate::pipeline`]); a single-stage plan is the degenerate case (forward
//! then backward per micro-batch, no links), so p = 1 and p > 1 share one code
//! path. Stage k receives its input activations from stage k−1 and sends the
//! gradient of that input back; the last stage computes the loss.
//!
//! The [`Trainer`] owns the model, the optimizer and the data; the links to
//! the neighbouring stages and the collective of the stage's replicas belong
//! to the caller, which lends them to each step
//! ([`Trainer::train_step_with`]): the worker's over TCP, a test's over
//! channels in one process ([`Links::in_process`]).
//!
//! Activation checkpointing is block-level, the form the planner models
//! (`memory::block_activation_bytes`): the forward pass runs without an
//! autodiff graph and keeps only each block's input; backward then walks the
//! blocks from last to first, recomputing one block with a graph, pulling the
//! upstream gradient through it and keeping the gradient of its input.
//! burn 0.22's own `Device::gradient_checkpointing()` (the `Balanced`
//! strategy) is op-level: it recomputes memory-bound ops but keeps every
//! matmul output, so it cannot give the "input only" figure the plan relies on.
//! With offloaded checkpoints (`Settings::offload_activations`, planned on
//! GPUs only) each kept input waits in host memory as its data
//! ([`KeptInput`]) and goes back to the device when its block is recomputed.
//!
//! With offloaded gradients (`Settings::offload_gradients`, on top of
//! checkpointing and the offloaded optimizer) each block's gradients leave
//! the device as its recomputation produces them and are summed in f32 in
//! host memory ([`HostGradients`]); the step's exchanges and clipping run on
//! those sums, and the update goes block by block (`Trainer::step_by_part`).
//! Stepping each block while backward goes on (optimizer in backward) is
//! not done: clipping by the global norm, the replicas' reduction and the
//! tied-embedding exchange each need all of the step's gradients first, so
//! it could serve only the last micro-batch of one unclipped replica.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use burn::module::Module;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamConfig, GradientsAccumulator, GradientsParams, ModuleOptimizer, SgdConfig};
use burn::tensor::{DType, Device, Int, Tensor, TensorData};
use headroom_api::Recipe;
use headroom_planner::Backend;
use headroom_planner::{LoraConfig, Optimizer, Precision, Settings};

use crate::checkpoint;
use crate::collective::{Collective, CollectiveError, Single};
use crate::data::{ProgressionTask, Samples, TextSamples};
use crate::data_parallel::{Replicas, Shards, stable_param_ids};
use crate::memory_guard;
use crate::model::hf::HfCheckpoint;
use crate::model::lean::linear::AdapterDropout;
use crate::model::{Documents, LmShape, StageLayout, TransformerLm, lora, peft};
use crate::optim::recipe::{DecoupledDecay, LossScale, clip_factor, scale_gradients, squared_norm};
use crate::optim::{AdamW8bitConfig, FusedAdamW, HostGradients, Offloaded};
use crate::pipeline::{Frame, Kind, Links, Op, PipelineError, one_f_one_b};

/// What the trainer runs: one stage of a checked assignment
/// ([`crate::ValidAssignment::config`]), or built directly (tests, calibration).
#[derive(Clone, Debug, PartialEq)]
pub struct TrainConfig {
    pub shape: LmShape,
    /// What this worker's stage holds.
    pub layout: StageLayout,
    /// This worker's stage and the plan's number of stages.
    pub stage: u32,
    pub stages: u32,
    /// This worker's data-parallel rank within its stage and the plan's
    /// number of replicas (d): replica r trains micro-batches
    /// `r·accumulation ..` of every step and keeps the optimizer state of
    /// the tensors [`crate::data_parallel::Shards`] gives it.
    pub replica: u32,
    pub replicas: u32,
    /// Per replica: micro-batch × accumulation is the global batch over `replicas`.
    pub settings: Settings,
    pub backend: Backend,
    /// The run's optimizer recipe: its total steps (a resumed attempt stops
    /// at the same total), the learning rate at each step, AdamW's settings,
    /// weight decay and clipping.
    pub recipe: Recipe,
    pub checkpoint_every_steps: u32,
    pub seed: u64,
    /// The Hugging Face checkpoint a Llama-family model starts from (its
    /// directory); a GPT model starts from seeded random weights.
    pub pretrained: Option<std::path::PathBuf>,
    /// The hub repo `pretrained` was downloaded from: what an adapter names
    /// as its base (`None`: it names the `pretrained` directory).
    pub hub_model: Option<headroom_api::HubModel>,
    /// LoRA adapters on the frozen base (stored as `settings.base_format`
    /// says); `None` trains every parameter.
    pub adapters: Option<LoraConfig>,
}

/// A plan this worker cannot run; exits with `INVALID_PLAN`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {problem}")]
pub struct Unsupported {
    pub field: &'static str,
    pub problem: String,
}

pub(crate) fn unsupported(field: &'static str, problem: impl Into<String>) -> Unsupported {
    Unsupported {
        field,
        problem: problem.into(),
    }
}

impl TrainConfig {
    /// The whole model on one worker, at a constant learning rate without
    /// weight decay or clipping (set [`TrainConfig::recipe`] for more).
    pub fn single_stage(
        shape: impl Into<LmShape>,
        settings: Settings,
        steps: u64,
        learning_rate: f64,
        seed: u64,
    ) -> Self {
        let shape = shape.into();
        TrainConfig {
            layout: StageLayout::whole(&shape),
            stage: 0,
            stages: 1,
            replica: 0,
            replicas: 1,
            shape,
            settings,
            backend: Backend::Flex,
            recipe: Recipe::constant(learning_rate, steps),
            checkpoint_every_steps: 1,
            seed,
            pretrained: None,
            hub_model: None,
            adapters: None,
        }
    }

    /// Trains LoRA adapters on the frozen base instead of every parameter.
    pub fn with_adapters(mut self, adapters: LoraConfig) -> Self {
        self.adapters = Some(adapters);
        self
    }

    /// Starts a Llama-family model from the Hugging Face checkpoint in `dir`.
    pub fn with_pretrained(mut self, dir: impl Into<std::path::PathBuf>) -> Self {
        self.pretrained = Some(dir.into());
        self
    }

    /// Samples per optimizer step over all replicas (the plan's global batch).
    pub fn global_batch(&self) -> u64 {
        self.settings.global_batch() * u64::from(self.replicas.max(1))
    }

    /// Runs as replica `replica` of `replicas` (each with `settings`, the
    /// per-replica micro-batch and accumulation).
    pub fn with_replica(mut self, replica: u32, replicas: u32) -> Self {
        self.replica = replica;
        self.replicas = replicas;
        self
    }

    /// Tokens consumed by one optimizer step.
    pub fn tokens_per_step(&self) -> u64 {
        self.global_batch() * u64::from(self.shape.sequence_length())
    }

    /// Optimizer steps in the whole run.
    pub fn steps(&self) -> u64 {
        self.recipe.total_steps
    }
}

/// The training device for a backend: autodiff over flex (CPU) or CUDA.
pub fn training_device(backend: Backend, precision: Precision) -> Result<Device, Unsupported> {
    match backend {
        Backend::Flex => Ok(Device::flex().autodiff()),
        #[cfg(feature = "cuda")]
        Backend::Cuda => {
            let mut device = Device::cuda(0);
            // The model computes in bf16/fp16; the optimizer keeps f32
            // master weights and moments (`build_optimizer`), as the
            // planner's mixed-precision figure counts.
            let dtype = match precision {
                Precision::Fp32 => None,
                Precision::Bf16 => Some(burn::tensor::FloatDType::BF16),
                Precision::Fp16 => Some(burn::tensor::FloatDType::F16),
            };
            if let Some(dtype) = dtype {
                device.configure(dtype).map_err(|e| {
                    unsupported("plan.settings.precision", format!("{precision}: {e:?}"))
                })?;
            }
            Ok(device.autodiff())
        }
        #[cfg(not(feature = "cuda"))]
        Backend::Cuda => {
            let _ = precision;
            Err(unsupported(
                "plan.backend",
                "this worker binary was built without the `cuda` feature",
            ))
        }
    }
}

/// The optimizer a plan's settings name, with the recipe's betas, epsilon
/// and decoupled weight decay on matrices ([`DecoupledDecay`]), for a model
/// on `device`. Its update is computed in f32 whatever the training dtype
/// ([`Offloaded`]): with `offload_optimizer`, state and update in host
/// memory (the planner asks for it on GPUs only; on the CPU it runs, with
/// nothing to move); in a half precision without offload, the same wrapper
/// with `device` as its "host" moves nothing and keeps f32 master weights
/// and moments on the device, as PyTorch's mixed precision does (the model
/// computes with the master's rounding).
pub fn build_optimizer(
    settings: &Settings,
    recipe: &Recipe,
    device: &Device,
) -> Result<ModuleOptimizer, Unsupported> {
    let adam = &recipe.adam;
    let (beta_1, beta_2, epsilon) = (adam.beta1 as f32, adam.beta2 as f32, adam.epsilon as f32);
    let wrap = Wrapping {
        weight_decay: recipe.weight_decay,
        compact: settings.compact_host_state,
        host: if settings.offload_optimizer {
            Some(Device::flex())
        } else if settings.precision != Precision::Fp32 {
            Some(device.clone())
        } else {
            None
        },
    };
    Ok(match settings.optimizer {
        // burn's AdamW, one pass a parameter on flex (bit for bit the same).
        Optimizer::Adamw => wrap.module(FusedAdamW::new(beta_1, beta_2, epsilon, 0.0)),
        Optimizer::Adam => wrap.module(
            AdamConfig::new()
                .with_beta_1(beta_1)
                .with_beta_2(beta_2)
                .with_epsilon(epsilon)
                .build(),
        ),
        Optimizer::SgdMomentum => wrap.module(
            SgdConfig::new()
                .with_momentum(Some(MomentumConfig::new().with_dampening(0.0)))
                .build(),
        ),
        Optimizer::Sgd => wrap.module(SgdConfig::new().build()),
        // bitsandbytes-style block-wise 8-bit moments, burn's AdamW update.
        Optimizer::Adamw8bit => wrap.module(
            AdamW8bitConfig {
                beta_1,
                beta_2,
                epsilon,
                weight_decay: 0.0,
                ..AdamW8bitConfig::new()
            }
            .build(),
        ),
    })
}

/// What [`build_optimizer`] puts around the plan's optimizer.
struct Wrapping {
    weight_decay: f64,
    /// Offloaded half-precision masters kept as bf16 remainders (the
    /// plan's `compactHostState`).
    compact: bool,
    /// Where the f32 state and update live, when not where the model is
    /// in f32 already.
    host: Option<Device>,
}

impl Wrapping {
    fn module<O: burn::optim::Optimizer>(&self, optimizer: O) -> ModuleOptimizer {
        let decayed = DecoupledDecay::new(optimizer, self.weight_decay);
        match &self.host {
            Some(host) => {
                ModuleOptimizer::from(Offloaded::new(decayed, host.clone()).compact(self.compact))
            }
            None => ModuleOptimizer::from(decayed),
        }
    }
}

/// Where, under the output, an adapter run also writes its merged weights
/// (Hugging Face format; dense base only).
pub const MERGED_DIR: &str = "merged";

/// Why an optimizer step failed: the pipeline or the replicas' ring.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum StepError {
    #[error(transparent)]
    Pipeline(#[from] PipelineError),
    #[error("data-parallel replicas: {0}")]
    Replicas(#[from] CollectiveError),
}

/// What one optimizer step did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepReport {
    /// Optimizer steps completed, this one included.
    pub step: u64,
    /// Mean loss over the global batch (before the update), the same on
    /// every replica; only the last pipeline stage computes it.
    pub loss: Option<f64>,
    pub tokens: u64,
    pub elapsed: Duration,
    /// Of `elapsed`, the time spent exchanging with the other replicas of
    /// the stage: the loss gather, the gradient reduce-scatter and the
    /// parameter all-gather, with the copies into and out of their buckets
    /// and any wait for a slower replica to arrive (a few ns for one
    /// replica). Two `Instant` reads around each call: nothing else.
    pub collective: Duration,
    /// Of `collective`, the loss gather (last stage only): three values per
    /// replica, so nearly all of it is waiting for the slowest replica to
    /// finish its micro-batches.
    pub loss_gather: Duration,
    /// The learning rate this step's update used.
    pub learning_rate: f64,
    /// The loss on the held-out samples after this step's update, when the
    /// recipe's evaluation fell due (last stage only, as `loss`).
    pub eval_loss: Option<f64>,
    /// The model's gradient norm before clipping (`None`: clipping off).
    pub grad_norm: Option<f64>,
    /// Where `elapsed` went, phase by phase.
    pub phases: StepPhases,
}

/// A step's time by phase (`Instant` reads around each call; on an eager
/// backend such as flex the work is done when the call returns, on a
/// queued one such as CUDA a phase may end before its kernels do).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepPhases {
    /// The micro-batches' forward passes, the head and the loss included
    /// (with checkpointing, the first pass without a graph).
    pub forward: Duration,
    /// Their backward passes (with checkpointing, the recomputed blocks and
    /// the head's forward too), with the accumulation of the gradients.
    pub backward: Duration,
    /// The clipping, the update and, with replicas, the collectives.
    pub optimizer: Duration,
}

impl StepReport {
    pub fn tokens_per_second(&self) -> f64 {
        self.tokens as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// Model, optimizer and position in the run.
pub struct Trainer {
    pub config: TrainConfig,
    pub device: Device,
    /// `None` only while the optimizer consumes it inside [`Trainer::train_step`].
    model: Option<TransformerLm>,
    pub optimizer: ModuleOptimizer,
    /// Optimizer steps completed.
    pub step: u64,
    task: Samples,
    /// The checkpoint a Llama-family model was loaded from (names, dtype and
    /// files its trained weights are written back with).
    pretrained: Option<HfCheckpoint>,
    /// The bytes of f32 the replicas exchange at a time: the backend's
    /// `collective_bucket_bytes` unless [`Trainer::set_collective_bucket_bytes`].
    bucket_bytes: u64,
    /// fp16's dynamic loss scale (`None` in other precisions).
    pub loss_scale: Option<LossScale>,
    /// The held-out samples evaluated when the recipe asks, and how many
    /// of them each evaluation reads.
    held_out: Option<(Samples, u32)>,
    /// The last evaluation's step and loss (last stage only).
    pub last_eval: Option<(u64, f64)>,
    /// Set when a step failed after this replica's update and before it had
    /// every other replica's: the model is then no step's, and must not be
    /// saved.
    torn: Option<String>,
    /// Waits for the device at the end of each phase, so that
    /// [`StepReport::phases`] holds each phase's kernels on a queued backend
    /// (CUDA, wgpu) too; off in the worker, where the waits would stall the
    /// queue, on in `calibrate --step-breakdown`.
    pub sync_phases: bool,
}

/// What a forward pass keeps of one micro-batch until its backward pass.
enum Saved {
    /// The autodiff graph: the stage input (a leaf whose gradient goes back
    /// to the previous stage) and the output or, on the last stage, the loss.
    Graph {
        input: Option<Tensor<3>>,
        output: Option<Tensor<3>>,
        loss: Option<Tensor<1>>,
    },
    /// Block-level checkpointing: only each block's input, without a graph.
    Checkpointed {
        tokens: Option<Tensor<2, Int>>,
        targets: Option<Tensor<2, Int>>,
        block_inputs: Vec<KeptInput>,
        /// The last block's output (last stage: the head runs in backward).
        output: Option<Tensor<3>>,
    },
}

/// Where a step's gradients are summed across its micro-batches: burn's
/// accumulator on the device, or, with offloaded gradients, f32 sums in
/// host memory that each block's gradients join as soon as backward has
/// them.
enum StepGradients {
    Device(GradientsAccumulator<TransformerLm>),
    Host(Box<HostGradients>),
}

impl StepGradients {
    fn new(settings: &Settings) -> Self {
        if settings.offload_gradients {
            StepGradients::Host(Box::new(
                HostGradients::new(Device::flex()).compact(settings.compact_host_state),
            ))
        } else {
            StepGradients::Device(GradientsAccumulator::new())
        }
    }

    /// Adds `grads`, the gradients of `part` (a block of `model`, or `model`).
    fn add<M: Module>(&mut self, model: &TransformerLm, part: &M, grads: GradientsParams) {
        match self {
            StepGradients::Device(sums) => sums.accumulate(model, grads),
            StepGradients::Host(sums) => sums.accumulate(part, grads),
        }
    }

    /// The step's sums and, for host sums, the device and dtype their
    /// update sends them back to.
    fn take(&mut self) -> (GradientsParams, Option<(Device, DType)>) {
        match self {
            StepGradients::Device(sums) => (sums.grads(), None),
            StepGradients::Host(sums) => sums.take(),
        }
    }
}

/// A checkpointed block's input between the block's forward and its
/// recomputation in backward: on the device, or, with offloaded checkpoints,
/// in host memory. The copies are synchronous (`into_data` waits for the
/// block's forward to finish): the plan's time model charges them.
enum KeptInput {
    Device(Tensor<3>),
    Host {
        data: TensorData,
        device: Device,
        dtype: DType,
    },
}

impl KeptInput {
    /// Keep `x`, in host memory when `offload`.
    fn keep(x: Tensor<3>, offload: bool) -> Self {
        if !offload {
            return KeptInput::Device(x);
        }
        let (device, dtype) = (x.device(), x.dtype());
        KeptInput::Host {
            data: x.into_data(),
            device,
            dtype,
        }
    }

    /// The input on its device again, bit for bit as it was kept.
    fn restore(self) -> Tensor<3> {
        match self {
            KeptInput::Device(x) => x,
            KeptInput::Host {
                data,
                device,
                dtype,
            } => Tensor::<3>::from_data(data, &device).cast(dtype),
        }
    }
}

impl std::fmt::Debug for Trainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trainer")
            .field("config", &self.config)
            .field("device", &self.device)
            .field("step", &self.step)
            .finish_non_exhaustive()
    }
}

impl Trainer {
    /// Fresh weights (each part seeded from the run's seed) on `device` (an autodiff device).
    pub fn new(config: TrainConfig, device: Device) -> Result<Self, Unsupported> {
        let s = &config.settings;
        if s.offload_gradients && !(s.activation_checkpointing && s.offload_optimizer) {
            return Err(unsupported(
                "plan.settings.offloadGradients",
                format!(
                    "offloaded gradients go block by block from the checkpointed backward to the host optimizer: they need activationCheckpointing and offloadOptimizer on (activationCheckpointing is {}, offloadOptimizer is {})",
                    s.activation_checkpointing, s.offload_optimizer
                ),
            ));
        }
        if s.compact_host_state && !s.offload_optimizer {
            return Err(unsupported(
                "plan.settings.compactHostState",
                "a compact host state is the offloaded optimizer's: it needs offloadOptimizer on",
            ));
        }
        let mut model = TransformerLm::new(&config.shape, &config.layout, config.seed, &device);
        // A frozen embedding may wait in host memory (the plan's
        // `offload_embedding`; the planner asks for it on GPUs only): moved
        // before the load, so the checkpoint fills it there.
        if config.settings.offload_embedding && config.adapters.is_some() {
            model.keep_embedding_on_host(&config.shape, device.settings().float_dtype.into());
        }
        let mut pretrained = None;
        if let LmShape::Llama(shape) = &config.shape {
            let dir = config.pretrained.as_ref().ok_or_else(|| {
                unsupported(
                    "model",
                    format!(
                        "a {} model starts from its Hugging Face checkpoint, and none was given",
                        shape.architecture.hf_name()
                    ),
                )
            })?;
            let checkpoint = HfCheckpoint::open(dir, shape.sequence_length)
                .map_err(|e| unsupported("model", e.to_string()))?;
            if checkpoint.shape.without_sequence() != shape.without_sequence() {
                return Err(unsupported(
                    "model",
                    format!(
                        "{}/config.json describes another model than the plan: {:?} vs {:?}",
                        dir.display(),
                        checkpoint.shape,
                        shape
                    ),
                ));
            }
            match &config.adapters {
                // QLoRA: each block is quantized as soon as it is read, so
                // the load never holds the whole base dense.
                Some(adapters) if config.settings.base_format.is_quantized() => {
                    model = lora::load_quantized(
                        &checkpoint,
                        model,
                        adapters,
                        config.settings.base_format,
                        &config.layout,
                        config.seed,
                        &device,
                    )
                    .map_err(|e| match e {
                        lora::QuantizedLoadError::Checkpoint(e) => {
                            unsupported("model", e.to_string())
                        }
                        lora::QuantizedLoadError::Adapter(e) => unsupported("training.lora", e.0),
                    })?;
                }
                _ => checkpoint
                    .load_stage(&mut model, &config.layout)
                    .map_err(|e| unsupported("model", e.to_string()))?,
            }
            pretrained = Some(checkpoint);
        }
        let loaded_adapted = pretrained.is_some() && config.settings.base_format.is_quantized();
        if let Some(adapters) = config.adapters.as_ref().filter(|_| !loaded_adapted) {
            model = lora::attach(
                model,
                adapters,
                config.settings.base_format,
                &config.layout,
                config.seed,
                &device,
            )
            .map_err(|e| unsupported("training.lora", e.0))?;
        }
        // The same ids on every replica and attempt (optimizer state and
        // checkpoint shards are keyed by them).
        let model = stable_param_ids(model, &config.layout);
        let optimizer = build_optimizer(&config.settings, &config.recipe, &device)?;
        let task = Samples::Progression(task_of(&config));
        let bucket_bytes = config.backend.profile().collective_bucket_bytes;
        // The synthetic task is endless: its held-out samples are another
        // seed's progressions, which training never draws.
        let held_out = config.recipe.evaluation.as_ref().map(|e| {
            let task = ProgressionTask {
                seed: config.seed ^ HELD_OUT_SEED_SALT,
                ..task_of(&config)
            };
            (Samples::Progression(task), e.samples)
        });
        let loss_scale = (config.settings.precision == Precision::Fp16).then(LossScale::default);
        Ok(Trainer {
            loss_scale,
            config,
            device,
            model: Some(model),
            optimizer,
            step: 0,
            task,
            pretrained,
            bucket_bytes,
            held_out,
            last_eval: None,
            torn: None,
            sync_phases: false,
        })
    }

    /// Writes this stage's trained weights into `out` in the format of the
    /// checkpoint it started from (see [`HfCheckpoint::save_stage`]); with
    /// adapters, the adapter in PEFT's format ([`peft::save_stage`]) and,
    /// over a dense base, the merged weights in `out/merged/`. Returns the
    /// weight (or adapter) file written.
    pub fn save_pretrained(
        &self,
        out: &std::path::Path,
    ) -> Result<std::path::PathBuf, crate::model::hf::HfError> {
        let Some(checkpoint) = &self.pretrained else {
            return Err(crate::model::hf::HfError::Index {
                path: out.to_path_buf(),
                problem:
                    "only a model loaded from a Hugging Face checkpoint is written in its format"
                        .into(),
            });
        };
        let c = &self.config;
        let Some(adapters) = &c.adapters else {
            return checkpoint.save_stage(self.model(), &c.layout, c.stage, c.stages, out);
        };
        let base = match (&c.hub_model, &c.pretrained) {
            (Some(hub), _) => peft::BaseModel {
                name_or_path: hub.repo.clone(),
                revision: Some(hub.revision.clone()),
            },
            (None, dir) => peft::BaseModel {
                name_or_path: dir
                    .as_ref()
                    .map(|p| p.display().to_string())
                    .unwrap_or_default(),
                revision: None,
            },
        };
        let file = peft::save_stage(
            self.model(),
            &c.layout,
            adapters,
            c.stage,
            c.stages,
            out,
            &base,
        )?;
        // An adapter directory serves with its base's tokenizer, chat
        // template and generation config, as TRL's save_model leaves it.
        if c.layout.first {
            crate::model::hf::copy_serving_files(&checkpoint.dir, out)?;
        }
        // Merging a quantized base would write its rounded weights; only a
        // dense base merges into what PEFT's merge_and_unload() gives.
        if !c.settings.base_format.is_quantized() {
            let merged = self.model().valid().materialize();
            checkpoint.save_stage(&merged, &c.layout, c.stage, c.stages, &out.join(MERGED_DIR))?;
        }
        Ok(file)
    }

    /// Trains on real text instead of the synthetic task; with an
    /// evaluation in the recipe, its held-out share is split off first.
    pub fn use_text(&mut self, samples: TextSamples) {
        let Some(evaluation) = &self.config.recipe.evaluation else {
            self.task = Samples::Text(samples);
            return;
        };
        let count = evaluation.held_out(samples.len() as u64) as usize;
        if count == 0 {
            self.held_out = None;
            self.task = Samples::Text(samples);
            return;
        }
        let (trained, held) = samples.hold_out(count);
        let read = evaluation.samples.min(held.len() as u32);
        self.held_out = Some((Samples::Text(held), read));
        self.task = Samples::Text(trained);
    }

    /// Whether the recipe's evaluation falls due after step `step`: every
    /// `everySteps` steps and after the last.
    fn evaluation_due(&self, step: u64) -> bool {
        let every = self
            .config
            .recipe
            .evaluation
            .as_ref()
            .map(|e| e.every_steps);
        self.held_out.is_some()
            && (step == self.config.steps()
                || every.is_some_and(|e| step.is_multiple_of(u64::from(e.max(1)))))
    }

    /// The mean loss over the held-out samples, forward only (no graph):
    /// this stage's part of it, the batches going down the pipeline as
    /// [`Kind::EvalActivation`] frames; the replicas of a stage split the
    /// batches (replica r takes every d-th) and sum their losses. The last
    /// stage returns the loss, the others `None`.
    fn evaluate(
        &self,
        links: &mut Links,
        replicas: &mut Replicas,
    ) -> Result<Option<f64>, StepError> {
        let Some((samples, count)) = &self.held_out else {
            return Ok(None);
        };
        let c = &self.config;
        let micro = c.settings.micro_batch.max(1);
        let batches = count.div_ceil(micro);
        let frozen = self.model().valid();
        // The evaluation's parts are its own points, not a step's.
        memory_guard::micro(memory_guard::EVALUATION);
        let (mut sum, mut evaluated) = (0.0, 0.0);
        for batch in (c.replica..batches).step_by(c.replicas.max(1) as usize) {
            let first = batch * micro;
            let size = micro.min(count - first);
            let (tokens, targets) = samples.batch(u64::from(first), size, &self.device);
            let documents = samples.documents(u64::from(first), size);
            let x = if c.layout.first {
                frozen.embed_in(tokens.inner(), documents.as_ref())
            } else {
                links
                    .to_prev()?
                    .recv(Kind::EvalActivation, self.step, batch)?
                    .into_tensor::<3>(&self.device)?
                    .inner()
            };
            let out =
                frozen.blocks_forward_dropping(x, None, c.layout.layers.start, documents.as_ref());
            if c.layout.last {
                // A mean over the trained targets of all held-out samples
                // (a batch with none adds nothing, not its undefined mean).
                let weight = samples
                    .trained_targets(u64::from(first), u64::from(size))
                    .map_or(f64::from(size), |n| n as f64);
                if weight > 0.0 {
                    let loss = frozen.head_loss(out, targets.inner());
                    sum += scalar(&loss) * weight;
                    evaluated += weight;
                }
            } else {
                links.to_next()?.send(&Frame::tensor(
                    Kind::EvalActivation,
                    self.step,
                    batch,
                    out,
                ))?;
            }
        }
        let (sum, evaluated) = (replicas.sum(sum)?, replicas.sum(evaluated)?);
        Ok((c.layout.last && evaluated > 0.0).then(|| sum / evaluated))
    }

    /// Checks that `collective` has this worker as the replica its
    /// assignment says (rank `replica` of `replicas`). Every step checks it;
    /// the worker also does as soon as its ring is up, to fail before
    /// training rather than in the first step.
    pub fn check_replicas(&self, collective: &dyn Collective) -> Result<(), CollectiveError> {
        let c = &self.config;
        if (collective.rank(), collective.size()) != (c.replica, c.replicas.max(1)) {
            return Err(CollectiveError::Protocol(format!(
                "the ring has this worker as replica {} of {}, its assignment says {} of {}",
                collective.rank(),
                collective.size(),
                c.replica,
                c.replicas
            )));
        }
        Ok(())
    }

    /// Moves gradients and weights between the replicas in buckets of
    /// `bytes` instead of the backend's (every replica must use the same):
    /// tests and benchmarks.
    pub fn set_collective_bucket_bytes(&mut self, bytes: u64) {
        self.bucket_bytes = bytes;
    }

    /// The stage's trained tensors and which replica owns each (for `replicas`).
    pub fn shards(&self, replicas: u32) -> Shards {
        let c = &self.config;
        let shards = Shards::of(self.model(), c.adapters.is_some(), replicas);
        // A tied embedding split across stages: both copies all-reduced alike.
        let tied = c.stages > 1 && c.shape.tied_embeddings() && c.adapters.is_none();
        match self.model().token.as_ref().filter(|_| tied) {
            Some(token) => shards.all_reducing(token.weight.id),
            None => shards,
        }
    }

    pub fn model(&self) -> &TransformerLm {
        self.model
            .as_ref()
            .expect("the model is only absent inside train_step")
    }

    /// Replaces the model (e.g. with one loaded from a checkpoint).
    pub fn set_model(&mut self, model: TransformerLm) {
        self.model = Some(model);
    }

    /// Takes the model out (e.g. to record it); put it back with [`Trainer::set_model`].
    pub fn take_model(&mut self) -> TransformerLm {
        self.model
            .take()
            .expect("the model is only absent inside train_step")
    }

    pub fn finished(&self) -> bool {
        self.step >= self.config.steps()
    }

    /// With [`Trainer::sync_phases`], waits for the device's queued work. A
    /// failure is only logged: a timing aid, and the next read of a result
    /// reports the device's error where the step would meet it anyway.
    fn sync_phase(&self) {
        if self.sync_phases
            && let Err(e) = self.device.sync()
        {
            tracing::warn!("waiting for the device at a phase's end: {e:?}");
        }
    }

    /// One optimizer step of a plan with one stage and one replica: nothing
    /// to exchange with (see [`Trainer::train_step_with`]).
    pub fn train_step(&mut self) -> Result<StepReport, StepError> {
        self.train_step_with(&mut Links::default(), &mut Single)
    }

    /// One optimizer step over the plan's global batch: this stage's part of
    /// the 1F1B schedule on this replica's share, the tied-embedding
    /// exchange, the replicas' gradient reduce-scatter, one update of the
    /// owned tensors, their all-gather. `links` reach the neighbouring
    /// stages (none for one stage); `replicas` the other replicas of the
    /// stage ([`Single`] for one).
    pub fn train_step_with(
        &mut self,
        links: &mut Links,
        replicas: &mut dyn Collective,
    ) -> Result<StepReport, StepError> {
        if let Some(torn) = &self.torn {
            return Err(CollectiveError::Protocol(torn.clone()).into());
        }
        self.check_replicas(replicas)?;
        let mut replicas = Replicas::new(replicas, self.bucket_bytes);
        let started = Instant::now();
        let s = self.config.settings;
        let accumulation = s.gradient_accumulation.max(1);
        // The mean over the micro-batches, times fp16's loss scale.
        let loss_scale = self.loss_scale.map_or(1.0, |l| l.scale);
        let scale = loss_scale / f64::from(accumulation);
        let weights = self.micro_weights();
        let mut sums = StepGradients::new(&s);
        let mut single: Option<GradientsParams> = None;
        let mut losses = Vec::new();
        let mut saved: VecDeque<Saved> = VecDeque::new();
        let mut phases = StepPhases::default();
        for op in one_f_one_b(self.config.stage, self.config.stages, accumulation) {
            let began = Instant::now();
            match op {
                Op::Forward(micro) => {
                    memory_guard::micro(micro);
                    let grad_scale = scale * weights[micro as usize];
                    let (kept, loss) = self.forward(links, micro, grad_scale)?;
                    losses.extend(loss.map(|l| l * weights[micro as usize]));
                    saved.push_back(kept);
                    self.sync_phase();
                    phases.forward += began.elapsed();
                }
                Op::Backward(micro) => {
                    let kept = saved
                        .pop_front()
                        .ok_or_else(|| PipelineError::Protocol("backward before forward".into()))?;
                    let weight = weights[micro as usize];
                    memory_guard::micro(micro);
                    let (grads, loss) =
                        self.backward(links, micro, kept, scale * weight, &mut sums)?;
                    losses.extend(loss.map(|l| l * weight));
                    if let Some(grads) = grads {
                        if accumulation == 1 {
                            single = Some(grads);
                        } else {
                            sums.add(self.model(), self.model(), grads);
                        }
                    }
                    self.sync_phase();
                    phases.backward += began.elapsed();
                }
            }
        }
        // The last point a step can be abandoned at: nothing is applied
        // before it (the model is taken for the update below).
        memory_guard::check(memory_guard::Phase::Optimizer, 0);
        let update = Instant::now();
        let (mut grads, origin) = match single {
            Some(grads) => (grads, None),
            None => sums.take(),
        };
        self.exchange_tied_gradient(links, &mut grads)?;
        let shards = self.shards(replicas.size());
        let exchange = Instant::now();
        let loss = replicas.mean_loss(&losses)?;
        let loss_gather = exchange.elapsed();
        replicas.reduce_gradients(&mut grads, &shards)?;
        let (grad_norm, finite) = self.clip_gradients(links, &mut replicas, &mut grads)?;
        let mut collective = exchange.elapsed();
        if !finite {
            // fp16 overflowed somewhere in the model: every worker skips
            // this update (the same global norm says so to all), the scale
            // halves, and the run moves on to the next step's data.
            drop(grads);
            phases.optimizer = update.elapsed();
            return Ok(self.skipped_step(
                started,
                loss,
                (collective, loss_gather),
                grad_norm,
                phases,
            ));
        }
        let learning_rate = self.config.recipe.learning_rate_at(self.step);
        let model = self.take_model();
        let model = match &origin {
            Some(origin) => self.step_by_part(learning_rate, model, grads, origin),
            None => self.optimizer.step(learning_rate, model, grads),
        };
        let gather = Instant::now();
        let (model, gathered) = replicas.gather_parameters(model, &shards);
        collective += gather.elapsed();
        self.model = Some(model);
        if let Err(e) = gathered {
            self.torn = Some(format!(
                "step {} was applied on some replicas only ({e}): this replica's model belongs to no step",
                self.step + 1
            ));
            return Err(e.into());
        }
        self.step += 1;
        self.sync_phase();
        // The step's time and throughput are the training's, not the evaluation's.
        let elapsed = started.elapsed();
        phases.optimizer = update.elapsed();
        let eval_loss = if self.evaluation_due(self.step) {
            self.evaluate(links, &mut replicas)?
        } else {
            None
        };
        if let Some(loss) = eval_loss {
            self.last_eval = Some((self.step, loss));
        }
        Ok(StepReport {
            step: self.step,
            loss,
            tokens: self.config.tokens_per_step(),
            elapsed,
            collective,
            loss_gather,
            learning_rate,
            grad_norm,
            eval_loss,
            phases,
        })
    }

    /// The update from offloaded gradients (host sums), one part at a
    /// time: each block, then the rest (embedding, head). A part's sums go
    /// back to `origin` (the training device and precision) for burn's
    /// optimizer, whose offloaded step takes each tensor to the host state
    /// and returns its weights (see [`HostGradients`]); the device holds
    /// one block's gradients at a time. Every parameter is stepped once,
    /// so the result is the whole model's step.
    fn step_by_part(
        &mut self,
        learning_rate: f64,
        mut model: TransformerLm,
        mut grads: GradientsParams,
        origin: &(Device, DType),
    ) -> TransformerLm {
        for index in 0..model.blocks.len() {
            let part = HostGradients::part_on_device(&mut grads, &model.blocks[index], origin);
            model = self.optimizer.step(learning_rate, model, part);
        }
        let rest = HostGradients::part_on_device(&mut grads, &model, origin);
        self.optimizer.step(learning_rate, model, rest)
    }

    /// A step whose update fp16's overflow skipped: the step counts (the
    /// schedule and the data move on, as with `GradScaler`), the weights
    /// and optimizer state are unchanged, the loss scale halves.
    fn skipped_step(
        &mut self,
        started: Instant,
        loss: Option<f64>,
        (collective, loss_gather): (Duration, Duration),
        grad_norm: Option<f64>,
        phases: StepPhases,
    ) -> StepReport {
        self.loss_scale = self.loss_scale.map(|l| l.after(false));
        tracing::info!(
            step = self.step + 1,
            scale = self.loss_scale.map(|l| l.scale),
            "fp16 gradients overflowed: update skipped, loss scale halved"
        );
        let learning_rate = self.config.recipe.learning_rate_at(self.step);
        self.step += 1;
        StepReport {
            step: self.step,
            loss,
            tokens: self.config.tokens_per_step(),
            elapsed: started.elapsed(),
            collective,
            loss_gather,
            learning_rate,
            grad_norm,
            eval_loss: None,
            phases,
        }
    }

    /// Unscales fp16's gradients and clips them to the recipe's
    /// `max_grad_norm` by the model's global norm, as `clip_grad_norm_`
    /// over the whole model: this worker's squares (its stage's tensors,
    /// and with replicas its share of them) summed over the stage's
    /// replicas, then along the pipeline. Returns the (unscaled) norm
    /// before clipping, `None` when neither clipping nor a loss scale asks
    /// for it, and whether the update goes ahead (false: fp16 overflowed,
    /// skip it; the gradients are then left as they are).
    fn clip_gradients(
        &mut self,
        links: &mut Links,
        replicas: &mut Replicas,
        grads: &mut GradientsParams,
    ) -> Result<(Option<f64>, bool), StepError> {
        let max = self.config.recipe.max_grad_norm;
        let loss_scale = self.loss_scale;
        if max <= 0.0 && loss_scale.is_none() {
            return Ok((None, true));
        }
        // A tied embedding split across stages has one gradient in two
        // copies (the first and the last stage's): counted on the first.
        let c = &self.config;
        let tied_copy = c.stages > 1
            && c.shape.tied_embeddings()
            && c.adapters.is_none()
            && c.layout.last
            && !c.layout.first;
        let skip = self
            .model()
            .token
            .as_ref()
            .filter(|_| tied_copy)
            .map(|t| t.weight.id);
        let own = squared_norm(self.model(), grads, skip);
        let stage = replicas.sum(own)?;
        let scaled = self.sum_over_stages(links, stage)?.sqrt();
        // Only fp16's scale skips a step: in fp32 and bf16 a non-finite
        // gradient is applied as `clip_grad_norm_` applies it, and the next
        // loss says the run diverged (the worker fails on a non-finite loss).
        if !scaled.is_finite() && loss_scale.is_some() {
            return Ok((Some(scaled), false));
        }
        let unscale = loss_scale.map_or(1.0, |l| 1.0 / l.scale);
        self.loss_scale = loss_scale.map(|l| l.after(true));
        let norm = scaled * unscale;
        let factor = unscale * clip_factor(norm, max).unwrap_or(1.0);
        if factor != 1.0 {
            scale_gradients(self.model(), grads, factor);
        }
        Ok((Some(norm), true))
    }

    /// `value` summed over the pipeline's stages, the same on every stage:
    /// partial sums flow from the first stage to the last, the total back.
    fn sum_over_stages(&self, links: &mut Links, value: f64) -> Result<f64, PipelineError> {
        let c = &self.config;
        if c.stages <= 1 {
            return Ok(value);
        }
        let step = self.step;
        let (first, last) = (c.layout.first, c.layout.last);
        let partial = if first {
            value
        } else {
            links
                .to_prev()?
                .recv(Kind::GradientNorm, step, 0)?
                .into_value()?
                + value
        };
        let total = if last {
            partial
        } else {
            let next = links.to_next()?;
            next.send(&Frame::value(Kind::GradientNorm, step, 0, partial))?;
            next.recv(Kind::GradientNorm, step, 1)?.into_value()?
        };
        if !first {
            links
                .to_prev()?
                .send(&Frame::value(Kind::GradientNorm, step, 1, total))?;
        }
        Ok(total)
    }

    /// Whether the model and optimizer are those of [`Trainer::step`]
    /// (false after a failure half way through the replicas' exchange).
    pub fn can_checkpoint(&self) -> bool {
        self.torn.is_none()
    }

    /// The weight of each of this replica's micro-batches' mean losses in
    /// the step's loss, times the number of micro-batches of the step: 1
    /// each when no target is masked. With masked targets the step's loss
    /// is the mean over the trained targets of the whole global batch (as
    /// transformers' `num_items_in_batch` normalises under gradient
    /// accumulation, and TRL's `average_tokens_across_devices` across
    /// replicas): a micro-batch's mean counts by its share of them. Every
    /// sample is a function of the seed and its index, so each worker
    /// counts the global batch's trained targets itself, without a
    /// collective; only the last stage, which computes the loss, needs it.
    fn micro_weights(&self) -> Vec<f64> {
        let c = &self.config;
        let accumulation = c.settings.gradient_accumulation.max(1);
        let ones = vec![1.0; accumulation as usize];
        if !c.layout.last {
            return ones;
        }
        let g = c.global_batch();
        let Some(total) = self.task.trained_targets(self.step * g, g) else {
            return ones;
        };
        let micro = u64::from(c.settings.micro_batch);
        let micros = f64::from(accumulation) * f64::from(c.replicas.max(1));
        (0..accumulation)
            .map(|m| {
                let first = self.step * g + u64::from(c.replica * accumulation + m) * micro;
                let trained = self.task.trained_targets(first, micro).unwrap_or(0);
                if total == 0 {
                    0.0
                } else {
                    trained as f64 * micros / total as f64
                }
            })
            .collect()
    }

    /// Inputs (first stage) and targets (last stage) of a micro-batch of this step.
    fn data(&self, micro: u32) -> (Option<Tensor<2, Int>>, Option<Tensor<2, Int>>) {
        let layout = &self.config.layout;
        if !layout.first && !layout.last {
            return (None, None);
        }
        // Replica r's micro-batches follow those of replicas 0..r in the step.
        let accumulation = self.config.settings.gradient_accumulation.max(1);
        let (tokens, targets) = self.task.micro_batch(
            self.step,
            self.config.global_batch(),
            self.config.settings.micro_batch,
            self.config.replica * accumulation + micro,
            &self.device,
        );
        (
            layout.first.then_some(tokens),
            layout.last.then_some(targets),
        )
    }

    /// Where the documents of micro-batch `micro` of this step lie, on
    /// every stage (each runs blocks over it); `None` for the stream.
    fn documents(&self, micro: u32) -> Option<Documents> {
        let accumulation = self.config.settings.gradient_accumulation.max(1);
        self.task.micro_documents(
            self.step,
            self.config.global_batch(),
            self.config.settings.micro_batch,
            self.config.replica * accumulation + micro,
        )
    }

    /// The activations stage k−1 sent for `micro`.
    fn receive_input(&self, links: &mut Links, micro: u32) -> Result<Tensor<3>, PipelineError> {
        let frame = links.to_prev()?.recv(Kind::Activation, self.step, micro)?;
        frame.into_tensor(&self.device)
    }

    /// The adapter dropout key of micro-batch `micro` of this step: the same
    /// in the forward and in a checkpointed block's recomputation (`None`
    /// without adapters or with dropout 0).
    fn dropout(&self, micro: u32) -> Option<AdapterDropout> {
        /// Mixed into the run's seed so the masks are not the data's draws.
        const DROPOUT_SEED_SALT: u64 = 0x4c6f_5241_2d44_0001;
        let lora = self.config.adapters.as_ref()?;
        AdapterDropout::new(lora.dropout, self.config.seed ^ DROPOUT_SEED_SALT)
            .map(|d| d.part(self.step).part(u64::from(micro)))
    }

    /// Forward pass of one micro-batch; returns what backward needs and, on
    /// the last stage without checkpointing, the micro-batch's loss, whose
    /// backward will start from `grad_scale`.
    fn forward(
        &self,
        links: &mut Links,
        micro: u32,
        grad_scale: f64,
    ) -> Result<(Saved, Option<f64>), PipelineError> {
        let (tokens, targets) = self.data(micro);
        let documents = self.documents(micro);
        let step = self.step;
        if self.config.settings.activation_checkpointing {
            let frozen = self.model().valid();
            let mut x = match &tokens {
                Some(t) => frozen.embed_in(t.clone().inner(), documents.as_ref()),
                None => self.receive_input(links, micro)?.inner(),
            };
            let mut block_inputs = Vec::with_capacity(frozen.blocks.len());
            let dropout = self.dropout(micro);
            let offload = self.config.settings.offload_activations;
            for (index, (block, layer)) in frozen
                .blocks
                .iter()
                .zip(self.config.layout.layers.clone())
                .enumerate()
            {
                memory_guard::check(memory_guard::Phase::Forward, index as u32);
                block_inputs.push(KeptInput::keep(x.clone(), offload));
                x = block.forward_dropping(
                    x,
                    dropout.map(|d| d.part(u64::from(layer))),
                    documents.as_ref(),
                );
            }
            drop(frozen);
            let output = if self.config.layout.last {
                Some(x)
            } else {
                links
                    .to_next()?
                    .send(&Frame::tensor(Kind::Activation, step, micro, x))?;
                None
            };
            let kept = Saved::Checkpointed {
                tokens,
                targets,
                block_inputs,
                output,
            };
            return Ok((kept, None));
        }
        let (x, input) = match tokens {
            Some(tokens) => (self.model().embed_in(tokens, documents.as_ref()), None),
            None => {
                let input = self.receive_input(links, micro)?.require_grad();
                (input.clone(), Some(input))
            }
        };
        let out = self.model().blocks_forward_dropping(
            x,
            self.dropout(micro),
            self.config.layout.layers.start,
            documents.as_ref(),
        );
        match targets {
            Some(targets) => {
                memory_guard::check(memory_guard::Phase::Loss, 0);
                let loss = self.model().head_loss_scaled(out, targets, grad_scale);
                let value = scalar(&loss);
                let kept = Saved::Graph {
                    input,
                    output: None,
                    loss: Some(loss),
                };
                Ok((kept, Some(value)))
            }
            None => {
                links.to_next()?.send(&Frame::tensor(
                    Kind::Activation,
                    step,
                    micro,
                    out.clone(),
                ))?;
                let kept = Saved::Graph {
                    input,
                    output: Some(out),
                    loss: None,
                };
                Ok((kept, None))
            }
        }
    }

    /// The gradient of the loss with respect to this stage's output, from stage k+1.
    fn receive_gradient(&self, links: &mut Links, micro: u32) -> Result<Tensor<3>, PipelineError> {
        let frame = links.to_next()?.recv(Kind::Gradient, self.step, micro)?;
        frame.into_tensor(&self.device)
    }

    fn send_input_gradient(
        &self,
        links: &mut Links,
        micro: u32,
        grad: Tensor<3>,
    ) -> Result<(), PipelineError> {
        links
            .to_prev()?
            .send(&Frame::tensor(Kind::Gradient, self.step, micro, grad))
    }

    /// Backward pass of one micro-batch. Returns this micro-batch's gradients
    /// (graph mode) or accumulates them itself (checkpointed), and the loss
    /// when it is computed here (last stage, checkpointed).
    fn backward(
        &self,
        links: &mut Links,
        micro: u32,
        kept: Saved,
        scale: f64,
        sums: &mut StepGradients,
    ) -> Result<(Option<GradientsParams>, Option<f64>), PipelineError> {
        match kept {
            Saved::Graph {
                input,
                output,
                loss,
            } => {
                memory_guard::check(memory_guard::Phase::Backward, 0);
                let mut grads = match (loss, output) {
                    (Some(loss), _) => loss.mul_scalar(scale).backward(),
                    (None, Some(output)) => {
                        let upstream = self.receive_gradient(links, micro)?;
                        (output * upstream).sum().backward()
                    }
                    (None, None) => unreachable!("a forward keeps a loss or an output"),
                };
                if let Some(input) = input {
                    let grad = input
                        .grad_remove(&mut grads)
                        .expect("gradient of the stage input");
                    self.send_input_gradient(links, micro, grad)?;
                }
                Ok((Some(GradientsParams::from_grads(grads, self.model())), None))
            }
            Saved::Checkpointed {
                tokens,
                targets,
                block_inputs,
                output,
            } => {
                let model = self.model.as_ref().expect("model");
                let (mut upstream, value) = match (output, targets) {
                    (Some(x), Some(targets)) => {
                        // Head and loss, with a graph; the gradient of the last block's output comes back.
                        memory_guard::check(memory_guard::Phase::Loss, 0);
                        let x = x.autodiff().require_grad();
                        let loss = model.head_loss_scaled(x.clone(), targets, scale);
                        let value = scalar(&loss);
                        let mut grads = loss.mul_scalar(scale).backward();
                        let upstream = x
                            .grad_remove(&mut grads)
                            .expect("gradient of the head input");
                        sums.add(model, model, GradientsParams::from_grads(grads, model));
                        (upstream, Some(value))
                    }
                    _ => (self.receive_gradient(links, micro)?.inner(), None),
                };
                // Blocks, last to first: recompute one (its dropout masks
                // drawn again from the same keys), pull the upstream gradient through it.
                let dropout = self.dropout(micro);
                let documents = self.documents(micro);
                let layers = self.config.layout.layers.clone();
                for (index, ((block, input), layer)) in model
                    .blocks
                    .iter()
                    .zip(block_inputs)
                    .zip(layers)
                    .enumerate()
                    .rev()
                {
                    memory_guard::check(memory_guard::Phase::Backward, index as u32);
                    let input = input.restore().autodiff().require_grad();
                    let dropout = dropout.map(|d| d.part(u64::from(layer)));
                    let output = block.forward_dropping(input.clone(), dropout, documents.as_ref());
                    let mut grads = (output * upstream).sum().backward();
                    upstream = input
                        .grad_remove(&mut grads)
                        .expect("gradient of the block input");
                    // With offloaded gradients they leave the device here.
                    sums.add(model, block, GradientsParams::from_grads(grads, block));
                }
                match tokens {
                    // A frozen embedding (adapters) has no gradient to take.
                    Some(_) if self.config.adapters.is_some() => {}
                    Some(tokens) => {
                        // Embeddings (a tied head's embedding gradient adds to the one from the head).
                        let embedded = model.embed_in(tokens, documents.as_ref());
                        let grads = (embedded * upstream).sum().backward();
                        sums.add(model, model, GradientsParams::from_grads(grads, model));
                    }
                    None => self.send_input_gradient(links, micro, upstream)?,
                }
                Ok((None, value))
            }
        }
    }

    /// A tied head split from its embedding: the first stage's token
    /// embedding and the last stage's copy get the same summed gradient
    /// (embedding part + head part, added in that order on both), so the
    /// copies stay equal. Stages in between relay both messages.
    fn exchange_tied_gradient(
        &self,
        links: &mut Links,
        grads: &mut GradientsParams,
    ) -> Result<(), PipelineError> {
        let c = &self.config;
        // With adapters the embedding is frozen: no gradient to share.
        if c.stages <= 1 || !c.shape.tied_embeddings() || c.adapters.is_some() {
            return Ok(());
        }
        let step = self.step;
        let (first, last) = (c.layout.first, c.layout.last);
        // Offloaded gradients are host sums: the other half joins them there.
        let offloaded = c.settings.offload_gradients;
        let arrived = |t: Tensor<2>| {
            if offloaded {
                crate::optim::host_gradients::to_host(t, &Device::flex())
            } else {
                t
            }
        };
        let own = |model: &TransformerLm, grads: &mut GradientsParams| {
            let id = model.token.as_ref().expect("token embedding").weight.id;
            let grad: Tensor<2> = grads.remove(id).expect("gradient of the token embedding");
            (id, grad)
        };
        if first {
            let (id, embedding) = own(self.model.as_ref().expect("model"), grads);
            let next = links.to_next()?;
            next.send(&Frame::tensor(
                Kind::TiedGradient,
                step,
                0,
                embedding.clone(),
            ))?;
            let head: Tensor<2> = next
                .recv(Kind::TiedGradient, step, 1)?
                .into_tensor(&self.device)?;
            grads.register(id, embedding + arrived(head));
        } else if last {
            let (id, head) = own(self.model.as_ref().expect("model"), grads);
            let prev = links.to_prev()?;
            let embedding: Tensor<2> = prev
                .recv(Kind::TiedGradient, step, 0)?
                .into_tensor(&self.device)?;
            prev.send(&Frame::tensor(Kind::TiedGradient, step, 1, head.clone()))?;
            grads.register(id, arrived(embedding) + head);
        } else {
            let forward = links.to_prev()?.recv(Kind::TiedGradient, step, 0)?;
            links.to_next()?.send(&forward)?;
            let backward = links.to_next()?.recv(Kind::TiedGradient, step, 1)?;
            links.to_prev()?.send(&backward)?;
        }
        Ok(())
    }

    /// Saves this stage's parts + optimizer + step under `root` (see
    /// [`crate::checkpoint`]; with replicas, this replica's optimizer shard
    /// and, from replica 0, the parts).
    pub fn save_checkpoint(
        &self,
        root: &std::path::Path,
        attempt: u32,
        loss: Option<f64>,
    ) -> Result<std::path::PathBuf, checkpoint::CheckpointError> {
        if let Some(torn) = &self.torn {
            return Err(checkpoint::CheckpointError::Invalid {
                path: root.to_path_buf(),
                reason: format!("not saved: {torn}"),
            });
        }
        let c = &self.config;
        let meta = checkpoint::CheckpointMeta {
            format: checkpoint::FORMAT,
            step: self.step,
            loss,
            seed: c.seed,
            attempt,
            shape: c.shape.clone(),
            layer_start: c.layout.layers.start,
            layer_end: c.layout.layers.end,
            first: c.layout.first,
            last: c.layout.last,
            settings: c.settings,
            adapters: c.adapters.clone(),
            replica: c.replica,
            replicas: c.replicas.max(1),
            loss_scale: self.loss_scale,
            files: vec![],
        };
        checkpoint::save(root, self.model(), &self.optimizer, meta)
    }

    /// Continues from the newest valid checkpoint under `root`, if any.
    pub fn resume(
        &mut self,
        root: &std::path::Path,
    ) -> Result<Option<checkpoint::Found>, checkpoint::CheckpointError> {
        let fresh_optimizer =
            build_optimizer(&self.config.settings, &self.config.recipe, &self.device).map_err(
                |e| checkpoint::CheckpointError::Invalid {
                    path: root.to_path_buf(),
                    reason: e.to_string(),
                },
            )?;
        let found = checkpoint::restore_newest(
            root,
            &self.config.shape,
            &self.config.layout,
            self.config.adapters.as_ref(),
            checkpoint::Shard {
                replica: self.config.replica,
                replicas: self.config.replicas.max(1),
            },
            self.model().clone(),
            fresh_optimizer,
        )?;
        Ok(found.map(|restored| {
            self.model = Some(restored.model);
            self.optimizer = restored.optimizer;
            self.step = restored.found.meta.step;
            // A checkpoint of another precision has no scale: keep the fresh one.
            if self.loss_scale.is_some() {
                self.loss_scale = restored.found.meta.loss_scale.or(self.loss_scale);
            }
            restored.found
        }))
    }
}

/// Mixed into the run's seed for the synthetic task's held-out samples.
const HELD_OUT_SEED_SALT: u64 = 0x4576_616c_5365_6564;

/// The synthetic task of a run.
fn task_of(config: &TrainConfig) -> ProgressionTask {
    ProgressionTask {
        seed: config.seed,
        vocabulary: config.shape.vocabulary(),
        sequence_length: config.shape.sequence_length(),
    }
}

fn scalar(loss: &Tensor<1>) -> f64 {
    f64::from(loss.clone().into_scalar::<f32>())
}
