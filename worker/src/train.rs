//! The training loop: one optimizer step = `gradient_accumulation`
//! micro-batches of `micro_batch` samples, gradients summed, one update, so
//! the global batch is the plan's whatever the split.
//!
//! Activation checkpointing is block-level, the form the planner models
//! (`memory::block_activation_bytes`): the forward pass runs without an
//! autodiff graph and keeps only each block's input; backward then walks the
//! blocks from last to first, recomputing one block with a graph, pulling the
//! upstream gradient through it and keeping the gradient of its input.
//! burn 0.22's own `Device::gradient_checkpointing()` (the `Balanced`
//! strategy) is op-level: it recomputes memory-bound ops but keeps every
//! matmul output, so it cannot give the "input only" figure the plan relies on.

use std::ops::Range;
use std::time::{Duration, Instant};

use burn::module::Module;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{
    AdamConfig, AdamWConfig, GradientsAccumulator, GradientsParams, ModuleOptimizer, SgdConfig,
};
use burn::tensor::{Device, Int, Tensor};
use headroom_api::WorkerAssignment;
use headroom_planner::memory::Backend;
use headroom_planner::{ModelShape, Optimizer, Precision, Settings, TransformerShape};

use crate::checkpoint;
use crate::data::ProgressionTask;
use crate::model::TransformerLm;

static INIT_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// What the trainer runs, taken from a checked [`WorkerAssignment`].
#[derive(Clone, Debug, PartialEq)]
pub struct TrainConfig {
    pub shape: TransformerShape,
    /// Blocks this worker's stage holds.
    pub layers: Range<u32>,
    pub settings: Settings,
    pub backend: Backend,
    /// Optimizer steps in the whole run (a resumed attempt stops at the same total).
    pub steps: u64,
    pub learning_rate: f64,
    pub checkpoint_every_steps: u32,
    pub seed: u64,
}

/// A plan this worker cannot run; exits with `INVALID_PLAN`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {problem}")]
pub struct Unsupported {
    pub field: &'static str,
    pub problem: String,
}

fn unsupported(field: &'static str, problem: impl Into<String>) -> Unsupported {
    Unsupported {
        field,
        problem: problem.into(),
    }
}

impl TrainConfig {
    /// The training run an assignment describes, or why this worker cannot run it.
    pub fn from_assignment(a: &WorkerAssignment) -> Result<Self, Unsupported> {
        let shape = match &a.model {
            ModelShape::Transformer(t) => t.clone(),
            ModelShape::Generic(_) => {
                return Err(unsupported(
                    "model",
                    "the Headroom worker trains transformers only (model.transformer); a generic model can be planned but not run",
                ));
            }
        };
        let plan = &a.plan;
        if plan.stages.len() > 1 {
            return Err(unsupported(
                "plan.stages",
                format!(
                    "{} pipeline stages: this worker runs single-stage plans only (pipeline communication is not implemented yet); plan with maxWorkers/maxGpus 1",
                    plan.stages.len()
                ),
            ));
        }
        let stage = plan
            .stages
            .get(a.stage as usize)
            .ok_or_else(|| unsupported("stage", format!("no stage {} in the plan", a.stage)))?;
        if stage.layer_start != 0 || stage.layer_end != shape.layers {
            return Err(unsupported(
                "plan.stages[0]",
                format!(
                    "a single stage must hold layers 0..{}, not {}..{}",
                    shape.layers, stage.layer_start, stage.layer_end
                ),
            ));
        }
        let s = plan.settings;
        if s.optimizer == Optimizer::Adamw8bit {
            return Err(unsupported(
                "plan.settings.optimizer",
                "adamw8bit is not implemented by the burn worker; use adamw, adam, sgdMomentum or sgd",
            ));
        }
        match plan.backend {
            Backend::Flex if s.precision != Precision::Fp32 => {
                return Err(unsupported(
                    "plan.settings.precision",
                    format!("the flex backend trains in fp32 only, not {}", s.precision),
                ));
            }
            Backend::Cuda if !cfg!(feature = "cuda") => {
                return Err(unsupported(
                    "plan.backend",
                    "this worker binary was built without the `cuda` feature; use the CUDA image",
                ));
            }
            _ => {}
        }
        if !(a.learning_rate.is_finite() && a.learning_rate > 0.0) {
            return Err(unsupported(
                "learningRate",
                format!("must be a positive number, not {}", a.learning_rate),
            ));
        }
        Ok(TrainConfig {
            layers: stage.layer_start..stage.layer_end,
            shape,
            settings: s,
            backend: plan.backend,
            steps: a.steps,
            learning_rate: a.learning_rate,
            checkpoint_every_steps: a.checkpoint_every_steps,
            seed: a.seed,
        })
    }

    pub fn global_batch(&self) -> u64 {
        self.settings.global_batch()
    }

    /// Tokens consumed by one optimizer step.
    pub fn tokens_per_step(&self) -> u64 {
        self.global_batch() * u64::from(self.shape.sequence_length)
    }
}

/// The training device for a backend: autodiff over flex (CPU) or CUDA.
pub fn training_device(backend: Backend, precision: Precision) -> Result<Device, Unsupported> {
    match backend {
        Backend::Flex => Ok(Device::flex().autodiff()),
        #[cfg(feature = "cuda")]
        Backend::Cuda => {
            let mut device = Device::cuda(0);
            // Half precision here is plain bf16/fp16 training (no fp32 master
            // copy); the planner's mixed-precision figure is an upper bound.
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

/// The optimizer a plan names, with burn's defaults otherwise.
pub fn build_optimizer(optimizer: Optimizer) -> Result<ModuleOptimizer, Unsupported> {
    Ok(match optimizer {
        Optimizer::Adamw => AdamWConfig::new().init(),
        Optimizer::Adam => AdamConfig::new().init(),
        Optimizer::SgdMomentum => SgdConfig::new()
            .with_momentum(Some(MomentumConfig::new().with_dampening(0.0)))
            .init(),
        Optimizer::Sgd => SgdConfig::new().init(),
        Optimizer::Adamw8bit => {
            return Err(unsupported(
                "plan.settings.optimizer",
                "adamw8bit is not implemented by the burn worker",
            ));
        }
    })
}

/// What one optimizer step did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepReport {
    /// Optimizer steps completed, this one included.
    pub step: u64,
    /// Mean loss over the global batch (before the update).
    pub loss: f64,
    pub tokens: u64,
    pub elapsed: Duration,
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
    task: ProgressionTask,
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
    /// Fresh weights (seeded by the run's seed) on `device` (an autodiff device).
    pub fn new(config: TrainConfig, device: Device) -> Result<Self, Unsupported> {
        // burn's generator is global per backend: hold it while seeding and
        // initialising so concurrent trainers (tests) get reproducible weights.
        let model = {
            let _guard = INIT_LOCK
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            device.seed(config.seed);
            let model = TransformerLm::new(&config.shape, config.layers.clone(), &device);
            model.materialize_params();
            model
        };
        let optimizer = build_optimizer(config.settings.optimizer)?;
        let task = ProgressionTask {
            seed: config.seed,
            vocabulary: config.shape.vocabulary,
            sequence_length: config.shape.sequence_length,
        };
        Ok(Trainer {
            config,
            device,
            model: Some(model),
            optimizer,
            step: 0,
            task,
        })
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
        self.step >= self.config.steps
    }

    /// One optimizer step over the plan's global batch.
    pub fn train_step(&mut self) -> StepReport {
        let started = Instant::now();
        let s = self.config.settings;
        let accumulation = s.gradient_accumulation.max(1);
        let scale = 1.0 / f64::from(accumulation);
        let mut accumulator = GradientsAccumulator::<TransformerLm>::new();
        let mut single: Option<GradientsParams> = None;
        let mut loss_sum = 0.0;
        for micro in 0..accumulation {
            let (tokens, targets) = self.task.micro_batch(
                self.step,
                self.config.global_batch(),
                s.micro_batch,
                micro,
                &self.device,
            );
            let loss = if s.activation_checkpointing {
                self.checkpointed_backward(tokens, targets, scale, &mut accumulator)
            } else {
                let model = self.model();
                let loss = model.loss(tokens, targets);
                let value = scalar(&loss);
                let grads = GradientsParams::from_grads(loss.mul_scalar(scale).backward(), model);
                if accumulation == 1 {
                    single = Some(grads);
                } else {
                    accumulator.accumulate(model, grads);
                }
                value
            };
            loss_sum += loss;
        }
        let grads = single.unwrap_or_else(|| accumulator.grads());
        let model = self.take_model();
        self.model = Some(self.optimizer.step(self.config.learning_rate, model, grads));
        self.step += 1;
        StepReport {
            step: self.step,
            loss: loss_sum / f64::from(accumulation),
            tokens: self.config.tokens_per_step(),
            elapsed: started.elapsed(),
        }
    }

    /// Forward without a graph keeping block inputs, then backward block by
    /// block (see the module docs). Returns the micro-batch's mean loss.
    fn checkpointed_backward(
        &self,
        tokens: Tensor<2, Int>,
        targets: Tensor<2, Int>,
        scale: f64,
        accumulator: &mut GradientsAccumulator<TransformerLm>,
    ) -> f64 {
        let model = self.model();
        let frozen = model.valid();
        let mut inputs: Vec<Tensor<3>> = Vec::with_capacity(frozen.blocks.len());
        let mut x = frozen.embed(tokens.clone().inner());
        for block in &frozen.blocks {
            inputs.push(x.clone());
            x = block.forward(x);
        }
        drop(frozen);

        // Head and loss, with a graph; the gradient of the last block's output comes back.
        let x = x.autodiff().require_grad();
        let loss = model.head_loss(x.clone(), targets);
        let value = scalar(&loss);
        let mut grads = loss.mul_scalar(scale).backward();
        let mut upstream = x
            .grad_remove(&mut grads)
            .expect("gradient of the head input");
        accumulator.accumulate(model, GradientsParams::from_grads(grads, model));

        // Blocks, last to first: recompute one, pull the upstream gradient through it.
        for (block, input) in model.blocks.iter().zip(inputs).rev() {
            let input = input.autodiff().require_grad();
            let output = block.forward(input.clone());
            let mut grads = (output * upstream).sum().backward();
            upstream = input
                .grad_remove(&mut grads)
                .expect("gradient of the block input");
            accumulator.accumulate(model, GradientsParams::from_grads(grads, block));
        }

        // Embeddings (a tied head's embedding gradient adds to the one from the head).
        let embedded = model.embed(tokens);
        let grads = (embedded * upstream).sum().backward();
        accumulator.accumulate(model, GradientsParams::from_grads(grads, model));
        value
    }

    /// Saves model + optimizer + step under `root` (see [`crate::checkpoint`]).
    pub fn save_checkpoint(
        &self,
        root: &std::path::Path,
        attempt: u32,
        loss: Option<f64>,
    ) -> Result<std::path::PathBuf, checkpoint::CheckpointError> {
        let c = &self.config;
        let meta = checkpoint::CheckpointMeta {
            format: 1,
            step: self.step,
            loss,
            seed: c.seed,
            attempt,
            shape: c.shape.clone(),
            layer_start: c.layers.start,
            layer_end: c.layers.end,
            settings: c.settings,
            files: vec![],
        };
        checkpoint::save(root, self.model(), &self.optimizer, meta)
    }

    /// Continues from the newest valid checkpoint under `root`, if any.
    pub fn resume(
        &mut self,
        root: &std::path::Path,
    ) -> Result<Option<checkpoint::Found>, checkpoint::CheckpointError> {
        let fresh_optimizer = build_optimizer(self.config.settings.optimizer).map_err(|e| {
            checkpoint::CheckpointError::Invalid {
                path: root.to_path_buf(),
                reason: e.to_string(),
            }
        })?;
        let found = checkpoint::restore_newest(
            root,
            &self.config.shape,
            self.model().clone(),
            fresh_optimizer,
        )?;
        Ok(found.map(|restored| {
            self.model = Some(restored.model);
            self.optimizer = restored.optimizer;
            self.step = restored.found.meta.step;
            restored.found
        }))
    }
}

fn scalar(loss: &Tensor<1>) -> f64 {
    f64::from(loss.clone().into_scalar::<f32>())
}
