//! Plan intake: the [`WorkerAssignment`] is read and checked once, into a
//! [`ValidAssignment`] that everything downstream takes. A plan that breaks
//! an invariant the trainer relies on (operator and worker disagree) or that
//! this worker cannot run is a [`PlanError`]: the worker exits with
//! `INVALID_PLAN`, distinct from any failure of training itself.

use std::path::PathBuf;

use headroom_api::{WorkerAssignment, exit_code};
use headroom_planner::Backend;
use headroom_planner::{ModelShape, Precision};

use crate::env::PlanSource;
use crate::model::StageLayout;
use crate::train::{TrainConfig, Unsupported, unsupported};

/// Why the worker cannot run its assignment.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error("cannot read plan file {path}: {source}")]
    Unreadable {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("plan is not a valid assignment document: {0}")]
    Malformed(#[from] serde_json::Error),
    /// Operator and worker disagree about an invariant of the plan.
    #[error("plan is inconsistent: {0}")]
    Inconsistent(String),
    /// A consistent plan this worker cannot run.
    #[error(transparent)]
    Unsupported(#[from] Unsupported),
}

impl PlanError {
    pub fn exit_code(&self) -> i32 {
        exit_code::INVALID_PLAN
    }
}

/// An assignment that passed every check, with the training run it describes.
#[derive(Clone, Debug, PartialEq)]
pub struct ValidAssignment {
    assignment: WorkerAssignment,
    config: TrainConfig,
}

impl ValidAssignment {
    /// Reads the assignment document from `source` and checks it.
    pub fn load(source: &PlanSource) -> Result<Self, PlanError> {
        let assignment: WorkerAssignment = match source {
            PlanSource::File(path) => {
                let json =
                    std::fs::read_to_string(path).map_err(|source| PlanError::Unreadable {
                        path: path.clone(),
                        source,
                    })?;
                serde_json::from_str(&json)?
            }
            PlanSource::Json(json) => serde_json::from_str(json)?,
        };
        Self::new(assignment)
    }

    /// Checks the invariants the trainer relies on, then that this worker can
    /// run the plan; the one place an assignment is validated.
    pub fn new(assignment: WorkerAssignment) -> Result<Self, PlanError> {
        check_consistency(&assignment)?;
        let config = train_config(&assignment)?;
        Ok(ValidAssignment { assignment, config })
    }

    pub fn assignment(&self) -> &WorkerAssignment {
        &self.assignment
    }

    /// What this worker's stage trains.
    pub fn config(&self) -> &TrainConfig {
        &self.config
    }

    /// Runs the plan at `micro_batch` × `accumulation` instead of its own
    /// (the memory guard's step down in place): refused unless the global
    /// batch stays the plan's.
    pub fn step_down(&mut self, micro_batch: u32, accumulation: u32) -> Result<(), String> {
        let s = &mut self.config.settings;
        let planned = u64::from(s.micro_batch) * u64::from(s.gradient_accumulation.max(1));
        if u64::from(micro_batch) * u64::from(accumulation) != planned {
            return Err(format!(
                "a step down to micro-batch {micro_batch} × accumulation {accumulation} changes the plan's {} × {}",
                s.micro_batch,
                s.gradient_accumulation.max(1)
            ));
        }
        s.micro_batch = micro_batch;
        s.gradient_accumulation = accumulation;
        Ok(())
    }

    pub fn into_config(self) -> TrainConfig {
        self.config
    }
}

/// The invariants the trainer relies on; a violation means operator and worker disagree.
fn check_consistency(a: &WorkerAssignment) -> Result<(), PlanError> {
    let plan = &a.plan;
    let s = &plan.settings;
    let fail = |m: String| Err(PlanError::Inconsistent(m));
    if s.micro_batch == 0 || s.gradient_accumulation == 0 {
        return fail(format!(
            "micro-batch {} × accumulation {} must both be ≥ 1",
            s.micro_batch, s.gradient_accumulation
        ));
    }
    if plan.replicas == 0 {
        return fail("replicas must be ≥ 1".into());
    }
    if s.global_batch() * u64::from(plan.replicas) != plan.global_batch {
        return fail(format!(
            "micro-batch {} × accumulation {} × replicas {} = {} ≠ global batch {}",
            s.micro_batch,
            s.gradient_accumulation,
            plan.replicas,
            s.global_batch() * u64::from(plan.replicas),
            plan.global_batch
        ));
    }
    if plan.stages.len() as u64 * u64::from(plan.replicas) != u64::from(plan.workers) {
        return fail(format!(
            "{} stages × {} replicas for {} workers",
            plan.stages.len(),
            plan.replicas,
            plan.workers
        ));
    }
    if a.replica >= plan.replicas {
        return fail(format!(
            "replica {} of a plan with {} replicas",
            a.replica, plan.replicas
        ));
    }
    if a.stage as usize >= plan.stages.len() {
        return fail(format!(
            "stage {} of a {}-stage plan",
            a.stage,
            plan.stages.len()
        ));
    }
    let mut next = 0;
    for stage in &plan.stages {
        if stage.layer_start != next || stage.layer_end <= stage.layer_start {
            return fail(format!(
                "stage {} holds layers {}..{}, expected to start at {next}",
                stage.index, stage.layer_start, stage.layer_end
            ));
        }
        next = stage.layer_end;
    }
    if a.recipe.total_steps == 0 || a.checkpoint_every_steps == 0 {
        return fail("steps and checkpointEverySteps must be ≥ 1".into());
    }
    Ok(())
}

/// The training run a consistent assignment describes, or why this worker cannot run it.
fn train_config(a: &WorkerAssignment) -> Result<TrainConfig, Unsupported> {
    let shape = match &a.model {
        ModelShape::Transformer(t) => crate::model::LmShape::Gpt(t.clone()),
        ModelShape::Generic(_) => {
            return Err(unsupported(
                "model",
                "the Headroom worker trains transformers only (model.transformer); a generic model can be planned but not run",
            ));
        }
        ModelShape::Llama(l) => {
            if a.files.is_none() {
                return Err(unsupported(
                    "files",
                    format!(
                        "a {} model is fine-tuned from its checkpoint: the assignment must name the model directory, the data and the output",
                        l.architecture.hf_name()
                    ),
                ));
            }
            crate::model::LmShape::Llama(l.clone())
        }
    };
    let plan = &a.plan;
    let stages = plan.stages.len() as u32;
    let stage = plan
        .stages
        .get(a.stage as usize)
        .ok_or_else(|| unsupported("stage", format!("no stage {} in the plan", a.stage)))?;
    // The consistency check saw contiguous non-empty ranges from layer 0;
    // they must also end at the model's last layer.
    if plan.stages.last().map(|s| s.layer_end) != Some(shape.layers()) {
        return Err(unsupported(
            "plan.stages",
            format!(
                "the stages must split layers 0..{} into contiguous non-empty ranges, not {:?}",
                shape.layers(),
                plan.stages
                    .iter()
                    .map(|s| s.layer_start..s.layer_end)
                    .collect::<Vec<_>>()
            ),
        ));
    }
    let s = plan.settings;
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
    check_adapters(a, &shape)?;
    check_recipe(&a.recipe)?;
    Ok(TrainConfig {
        layout: StageLayout {
            layers: stage.layer_start..stage.layer_end,
            first: a.stage == 0,
            last: a.stage + 1 == stages,
        },
        stage: a.stage,
        stages,
        replica: a.replica,
        replicas: plan.replicas,
        shape,
        settings: s,
        backend: plan.backend,
        recipe: a.recipe.clone(),
        checkpoint_every_steps: a.checkpoint_every_steps,
        seed: a.seed,
        pretrained: a.files.as_ref().map(|f| f.model_dir.clone().into()),
        hub_model: a.files.as_ref().and_then(|f| f.hub_model.clone()),
        adapters: plan.adapters.clone(),
    })
}

/// A recipe this worker can follow: finite, positive rates and factors in
/// their ranges (the CRD bounds the spec; this is the assignment's own word).
fn check_recipe(r: &headroom_api::Recipe) -> Result<(), Unsupported> {
    let positive = |field: &'static str, v: f64| {
        if v.is_finite() && v > 0.0 {
            Ok(())
        } else {
            Err(unsupported(
                field,
                format!("must be a positive number, not {v}"),
            ))
        }
    };
    let at_least_zero = |field: &'static str, v: f64| {
        if v.is_finite() && v >= 0.0 {
            Ok(())
        } else {
            Err(unsupported(field, format!("must be 0 or more, not {v}")))
        }
    };
    let below_one = |field: &'static str, v: f64| {
        if (0.0..1.0).contains(&v) {
            Ok(())
        } else {
            Err(unsupported(field, format!("must be in [0, 1), not {v}")))
        }
    };
    positive("recipe.learningRate", r.learning_rate)?;
    at_least_zero("recipe.minLearningRate", r.min_learning_rate)?;
    at_least_zero("recipe.weightDecay", r.weight_decay)?;
    at_least_zero("recipe.maxGradNorm", r.max_grad_norm)?;
    positive("recipe.adam.epsilon", r.adam.epsilon)?;
    below_one("recipe.adam.beta1", r.adam.beta1)?;
    below_one("recipe.adam.beta2", r.adam.beta2)
}

/// LoRA adapters and the base format this worker can run (burn's LoRA).
fn check_adapters(a: &WorkerAssignment, shape: &crate::model::LmShape) -> Result<(), Unsupported> {
    let format = a.plan.settings.base_format;
    let Some(lora) = &a.plan.adapters else {
        if format.is_quantized() {
            return Err(unsupported(
                "plan.settings.baseFormat",
                format!(
                    "a {format} base is for LoRA adapters (qlora), and the plan has none; use dense"
                ),
            ));
        }
        return Ok(());
    };
    if !(0.0..1.0).contains(&lora.dropout) {
        return Err(unsupported(
            "training.lora.dropout",
            format!(
                "{}: must be at least 0 and below 1 (PEFT's lora_dropout); e.g. 0.05",
                lora.dropout
            ),
        ));
    }
    let crate::model::LmShape::Llama(llama) = shape else {
        return Err(unsupported(
            "training.lora",
            "adapters are for Llama-family checkpoints (model.pretrained), not the synthetic transformer; use method: full",
        ));
    };
    if lora.rank == 0 {
        return Err(unsupported("training.lora.rank", "must be at least 1"));
    }
    if !(lora.alpha.is_finite() && lora.alpha > 0.0) {
        return Err(unsupported(
            "training.lora.alpha",
            format!("must be a positive number, not {}", lora.alpha),
        ));
    }
    if lora.target_modules.is_empty() {
        return Err(unsupported(
            "training.lora.targetModules",
            format!(
                "name at least one of {}",
                llama
                    .architecture
                    .lora_targets()
                    .iter()
                    .map(|m| m.hf_name())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        ));
    }
    if let Some(problem) = lora.foreign_targets(llama.architecture) {
        return Err(unsupported("training.lora.targetModules", problem));
    }
    if llama.tied_embeddings && lora.targets(headroom_planner::TargetModule::LmHead) {
        return Err(unsupported(
            "training.lora.targetModules",
            "lm_head is tied to the token embedding in this checkpoint (tie_word_embeddings), and an adapter on it would change the embedding too; remove lm_head",
        ));
    }
    let block_size = |e: crate::model::lora::AdapterError| {
        let problem = e.0.trim_start_matches("training.lora.blockSize: ");
        unsupported("training.lora.blockSize", problem.to_string())
    };
    if crate::model::lora::quant_scheme(format, lora.block_size)
        .map_err(block_size)?
        .is_some()
    {
        crate::model::lora::check_block_size(llama, lora.block_size).map_err(block_size)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use headroom_planner::{
        Inventory, ModelShape, Optimizer, Precision, RetryRung, Target, TransformerShape, plan,
    };

    fn assignment() -> WorkerAssignment {
        let req = headroom_planner::JobRequest {
            model: ModelShape::Transformer(TransformerShape {
                layers: 4,
                hidden: 64,
                heads: 4,
                sequence_length: 32,
                vocabulary: 256,
                feed_forward: None,
                tied_embeddings: true,
            }),
            global_batch: 8,
            precision: Precision::Fp32,
            optimizer: Optimizer::Adamw,
            pinned_micro_batch: None,
            pinned_checkpointing: None,
            pinned_stages: None,
            pinned_replicas: None,
            objective: Default::default(),
            target: Target::Cpu {
                memory_limit_bytes: 1 << 30,
                max_workers: 1,
            },
            headroom_fraction: 0.1,
            allowed_rungs: RetryRung::ALL.to_vec(),
            adapters: None,
            base_format: headroom_planner::BaseFormat::Dense,
        };
        WorkerAssignment {
            job: "j".into(),
            namespace: "ns".into(),
            attempt: 1,
            stage: 0,
            replica: 0,
            model: req.model.clone(),
            plan: plan(&req, &Inventory::default()).expect("plan"),
            recipe: headroom_api::Recipe::constant(1e-3, 10),
            checkpoint_every_steps: 5,
            seed: 1,
            files: None,
            memory_guard: None,
        }
    }

    #[test]
    fn loads_and_checks_a_plan_once() {
        let json = serde_json::to_string(&assignment()).expect("json");
        let loaded = ValidAssignment::load(&PlanSource::Json(json)).expect("valid");
        assert_eq!(loaded.assignment(), &assignment());
        let config = loaded.config();
        assert_eq!((config.stage, config.stages), (0, 1));
        assert_eq!(config.layout.layers, 0..4);
        assert!(config.layout.first && config.layout.last);
        assert_eq!(config.settings, assignment().plan.settings);
        assert_eq!(
            (config.steps(), config.checkpoint_every_steps, config.seed),
            (10, 5, 1)
        );
    }

    #[test]
    fn a_replica_of_a_plan_with_replicas() {
        let mut a = assignment();
        a.plan.replicas = 2;
        a.plan.workers = 2;
        a.plan.global_batch *= 2;
        a.replica = 1;
        let valid = ValidAssignment::new(a).expect("valid");
        let config = valid.config();
        assert_eq!((config.replica, config.replicas), (1, 2));
        assert_eq!(config.global_batch(), valid.assignment().plan.global_batch);
    }

    #[test]
    fn unreadable_malformed_inconsistent_and_unsupported_plans_are_invalid() {
        let malformed =
            ValidAssignment::load(&PlanSource::Json("{\"job\": 1}".into())).expect_err("malformed");
        assert!(matches!(malformed, PlanError::Malformed(_)));
        let unreadable = ValidAssignment::load(&PlanSource::File("/nonexistent/plan.json".into()))
            .expect_err("unreadable");
        assert!(
            unreadable.to_string().contains("/nonexistent/plan.json"),
            "{unreadable}"
        );

        let mut a = assignment();
        a.plan.settings.gradient_accumulation += 1;
        let err = ValidAssignment::new(a).expect_err("global batch broken");
        assert!(err.to_string().contains("≠ global batch"), "{err}");
        assert_eq!(err.exit_code(), exit_code::INVALID_PLAN);
        let mut r = assignment();
        r.replica = 1;
        let err = ValidAssignment::new(r).expect_err("replica 1 of 1");
        assert!(
            err.to_string()
                .contains("replica 1 of a plan with 1 replicas"),
            "{err}"
        );
        let mut r = assignment();
        r.plan.replicas = 2;
        let err = ValidAssignment::new(r).expect_err("the global batch counts the replicas");
        assert!(
            err.to_string()
                .contains("× replicas 2 = 16 ≠ global batch 8"),
            "{err}"
        );
        let mut r = assignment();
        r.plan.replicas = 2;
        r.plan.global_batch *= 2;
        let err = ValidAssignment::new(r).expect_err("workers are stages × replicas");
        assert!(
            err.to_string()
                .contains("1 stages × 2 replicas for 1 workers"),
            "{err}"
        );
        let mut b = assignment();
        b.stage = 3;
        assert!(matches!(
            ValidAssignment::new(b),
            Err(PlanError::Inconsistent(_))
        ));
        let mut c = assignment();
        c.plan.stages[0].layer_end = 3;
        let err = ValidAssignment::new(c).expect_err("layer 3 not covered");
        assert!(err.to_string().starts_with("plan.stages: "), "{err}");
        let mut d = assignment();
        // adamw8bit runs (crate::optim::AdamW8bit): a valid plan.
        d.plan.settings.optimizer = Optimizer::Adamw8bit;
        let eight_bit = ValidAssignment::new(d).expect("adamw8bit is a plan the worker runs");
        assert_eq!(eight_bit.config().settings.optimizer, Optimizer::Adamw8bit);
        let mut f = assignment();
        f.plan.adapters = Some(headroom_planner::LoraConfig {
            rank: 8,
            alpha: 16.0,
            dropout: 1.0,
            target_modules: vec![headroom_planner::TargetModule::QProj],
            block_size: 64,
        });
        let err = ValidAssignment::new(f).expect_err("dropout");
        assert!(
            err.to_string().starts_with("training.lora.dropout: 1: ")
                && err.to_string().ends_with("e.g. 0.05"),
            "{err}"
        );
        let mut g = assignment();
        g.plan.settings.base_format = headroom_planner::BaseFormat::Int8;
        let err = ValidAssignment::new(g).expect_err("int8 base without adapters");
        assert!(
            err.to_string().starts_with("plan.settings.baseFormat: "),
            "{err}"
        );
        let mut e = assignment();
        e.recipe.learning_rate = f64::NAN;
        let err = ValidAssignment::new(e).expect_err("learning rate");
        assert!(
            err.to_string().starts_with("recipe.learningRate: "),
            "{err}"
        );
        assert_eq!(err.exit_code(), exit_code::INVALID_PLAN);
        let mut f = assignment();
        f.recipe.adam.beta2 = 1.0;
        let err = ValidAssignment::new(f).expect_err("beta2");
        assert!(err.to_string().starts_with("recipe.adam.beta2: "), "{err}");
    }
}
