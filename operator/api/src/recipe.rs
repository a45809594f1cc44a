//! The optimizer recipe: the learning-rate schedule, AdamW's
//! hyper-parameters, weight decay and gradient clipping, named and defaulted
//! as the Hugging Face Trainer names and defaults them (`lr_scheduler_type`,
//! `warmup_steps`/`warmup_ratio`, `weight_decay`, `adam_beta1`/`adam_beta2`/
//! `adam_epsilon`, `max_grad_norm`, `num_train_epochs`), so a recipe moved
//! from a Trainer script means the same here.
//!
//! The spec holds what the user wrote ([`ScheduleSpec`], [`AdamSpec`] and the
//! plain fields of `spec.training`); [`Recipe`] is what a run follows, every
//! default filled and every ratio turned into steps. The operator resolves it
//! once, before the first attempt, and records it in `status.recipe`: every
//! attempt (a retry, a resume with another split) follows the recorded one,
//! so the schedule continues at the step it reached whatever is edited in the
//! spec meanwhile.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::contract::DataFacts;
use crate::job::{SpecError, TrainingSpec};

/// How the learning rate moves after the warmup (Hugging Face's
/// `lr_scheduler_type`; `constant` with a warmup is its
/// `constant_with_warmup`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum ScheduleType {
    /// The peak learning rate throughout.
    Constant,
    /// Down in a straight line to `minLearningRate` at the last step (the
    /// Hugging Face Trainer's default).
    #[default]
    Linear,
    /// Down along half a cosine to `minLearningRate` at the last step.
    Cosine,
}

impl std::fmt::Display for ScheduleType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ScheduleType::Constant => "constant",
            ScheduleType::Linear => "linear",
            ScheduleType::Cosine => "cosine",
        })
    }
}

/// `spec.training.schedule`: the learning rate over the run. The rate rises
/// linearly from 0 to `training.learningRate` over the warmup, then follows
/// `type` down to `minLearningRate` at the last step.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "!has(self.warmupSteps) || !has(self.warmupRatio)",
     "message": "training.schedule: warmupSteps and warmupRatio both set; give the warmup in steps or as a share of the run (e.g. warmupRatio: 0.03), not both"}
]))]
pub struct ScheduleSpec {
    /// `constant`, `linear` (default, as the Hugging Face Trainer) or `cosine`.
    #[serde(default, rename = "type")]
    pub kind: ScheduleType,
    /// Optimizer steps of linear warmup from 0 to the peak (default 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 1000000000))]
    pub warmup_steps: Option<u64>,
    /// The warmup as a share of the run's steps, rounded up (Hugging Face's
    /// `warmup_ratio`), e.g. 0.03.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0, max = 1.0))]
    pub warmup_ratio: Option<f64>,
    /// Where `linear` and `cosine` end (default 0); at most
    /// `training.learningRate`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0, max = 10.0))]
    pub min_learning_rate: Option<f64>,
}

/// `spec.training.adam`: the moments' decay rates and the denominator's
/// epsilon of Adam and AdamW (8-bit AdamW included), Hugging Face's defaults.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AdamSpec {
    /// Decay of the first moment (`adam_beta1`).
    #[serde(default = "default_beta1")]
    #[schemars(range(min = 0.0, max = 0.999999))]
    pub beta1: f64,
    /// Decay of the second moment (`adam_beta2`).
    #[serde(default = "default_beta2")]
    #[schemars(range(min = 0.0, max = 0.999999999))]
    pub beta2: f64,
    /// Added to the denominator (`adam_epsilon`).
    #[serde(default = "default_epsilon")]
    #[schemars(range(min = 1e-12, max = 1.0))]
    pub epsilon: f64,
}

impl Default for AdamSpec {
    fn default() -> Self {
        AdamSpec {
            beta1: default_beta1(),
            beta2: default_beta2(),
            epsilon: default_epsilon(),
        }
    }
}

fn default_beta1() -> f64 {
    0.9
}
fn default_beta2() -> f64 {
    0.999
}
fn default_epsilon() -> f64 {
    1e-8
}

/// `spec.training.evaluation`: a held-out share of the data, evaluated
/// (forward only, the training loss's definition) every `everySteps`
/// optimizer steps and after the last; the eval loss goes into the status,
/// the metrics and `eval_results.json` beside the trained weights. A job
/// with no `spec.data` (the synthetic task) evaluates on `samples` samples
/// the training never draws.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EvaluationSpec {
    /// The share of the data's packed samples held out of training (at
    /// least one sample each way), e.g. 0.05.
    #[serde(default = "default_held_out")]
    #[schemars(range(min = 0.0, max = 0.5))]
    pub held_out_fraction: f64,
    /// Evaluate after every this many optimizer steps, and after the last.
    #[serde(default = "default_eval_every")]
    #[schemars(range(min = 1, max = 1000000))]
    pub every_steps: u32,
    /// At most this many held-out samples are evaluated each time (the
    /// first ones, always the same); default 256.
    #[serde(default = "default_eval_samples")]
    #[schemars(range(min = 1, max = 1000000))]
    pub samples: u32,
}

impl Default for EvaluationSpec {
    fn default() -> Self {
        EvaluationSpec {
            held_out_fraction: default_held_out(),
            every_steps: default_eval_every(),
            samples: default_eval_samples(),
        }
    }
}

impl EvaluationSpec {
    /// Of `samples` packed samples, how many are held out: the fraction
    /// rounded down, at least one, and at least one left to train on
    /// (none when there is only one).
    pub fn held_out(&self, samples: u64) -> u64 {
        if samples < 2 || self.held_out_fraction <= 0.0 {
            return 0;
        }
        ((samples as f64 * self.held_out_fraction) as u64).clamp(1, samples - 1)
    }
}

fn default_held_out() -> f64 {
    0.05
}
fn default_eval_every() -> u32 {
    50
}
fn default_eval_samples() -> u32 {
    256
}

/// What a run follows: the recipe with every default filled and the warmup
/// in steps (`status.recipe`; each worker's assignment).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Recipe {
    /// Optimizer steps of the whole run.
    #[schemars(range(min = 1, max = 1000000000))]
    pub total_steps: u64,
    /// The peak learning rate.
    #[schemars(range(min = 0.0, max = 10.0))]
    pub learning_rate: f64,
    pub schedule: ScheduleType,
    /// Steps of linear warmup from 0 to the peak.
    #[schemars(range(min = 0, max = 1000000000))]
    pub warmup_steps: u64,
    /// Where the decay ends.
    #[schemars(range(min = 0.0, max = 10.0))]
    pub min_learning_rate: f64,
    /// Decoupled weight decay (AdamW's), on every trained matrix; never on
    /// biases and norm weights (the one-dimensional parameters), as the
    /// Hugging Face Trainer leaves them out.
    #[schemars(range(min = 0.0, max = 10.0))]
    pub weight_decay: f64,
    pub adam: AdamSpec,
    /// The gradients' global norm is clipped to this (over every stage and
    /// replica: the model's norm); 0: no clipping.
    #[schemars(range(min = 0.0, max = 1000000.0))]
    pub max_grad_norm: f64,
    /// The held-out evaluation, when the spec asks for one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub evaluation: Option<EvaluationSpec>,
    /// The epochs `total_steps` was derived from, when the spec gave epochs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0, max = 1000000.0))]
    pub epochs: Option<f64>,
}

impl Recipe {
    /// A constant learning rate over `total_steps`: no warmup, no weight
    /// decay, no clipping (tests and benchmarks that exercise memory, not the
    /// recipe).
    pub fn constant(learning_rate: f64, total_steps: u64) -> Self {
        Recipe {
            total_steps,
            learning_rate,
            schedule: ScheduleType::Constant,
            warmup_steps: 0,
            min_learning_rate: 0.0,
            weight_decay: 0.0,
            adam: AdamSpec::default(),
            max_grad_norm: 0.0,
            evaluation: None,
            epochs: None,
        }
    }

    /// The learning rate of optimizer step `step` (0-based: the first update
    /// uses step 0's), as `transformers.get_scheduler` gives it: a warmup of
    /// `w` steps uses `peak·s/w` (0 at the first step), then `linear` falls
    /// as `(T − s)/(T − w)` and `cosine` as `½(1 + cos(π·(s − w)/(T − w)))`,
    /// both lifted onto `minLearningRate` (Hugging Face's
    /// `cosine_with_min_lr`: `factor·(1 − r) + r`, r = min/peak).
    pub fn learning_rate_at(&self, step: u64) -> f64 {
        let peak = self.learning_rate;
        let (s, w, t) = (
            step as f64,
            self.warmup_steps as f64,
            self.total_steps as f64,
        );
        if step < self.warmup_steps {
            return peak * s / w.max(1.0);
        }
        let progress = (s - w) / (t - w).max(1.0);
        let factor = match self.schedule {
            ScheduleType::Constant => return peak,
            ScheduleType::Linear => ((t - s) / (t - w).max(1.0)).max(0.0),
            ScheduleType::Cosine => {
                (0.5 * (1.0 + (std::f64::consts::PI * progress).cos())).max(0.0)
            }
        };
        let floor = if peak > 0.0 {
            (self.min_learning_rate / peak).clamp(0.0, 1.0)
        } else {
            0.0
        };
        peak * (factor * (1.0 - floor) + floor)
    }

    /// The warmup's steps for a run of `total_steps`: `warmup_steps`, or
    /// `warmup_ratio` of the run rounded up (Hugging Face's
    /// `get_warmup_steps`: `ceil(total · ratio)`).
    pub fn warmup_steps_for(schedule: &ScheduleSpec, total_steps: u64) -> u64 {
        match (schedule.warmup_steps, schedule.warmup_ratio) {
            (Some(steps), _) => steps,
            (None, Some(ratio)) => (total_steps as f64 * ratio).ceil() as u64,
            (None, None) => 0,
        }
    }
}

impl TrainingSpec {
    /// The recipe this spec asks for, over `data` (the packed samples
    /// `epochs` counts; what the initializer found): every default filled.
    pub fn recipe(&self, data: Option<&DataFacts>) -> Result<Recipe, SpecError> {
        let (total_steps, epochs) = match (self.steps, self.epochs) {
            (Some(steps), None) => (steps, None),
            (None, Some(epochs)) => (self.steps_of_epochs(epochs, data)?, Some(epochs)),
            _ => {
                return Err(SpecError::new(
                    "training",
                    "give the run's length as steps (optimizer steps) or as epochs (passes over spec.data), exactly one of them",
                ));
            }
        };
        let schedule = self.schedule.clone().unwrap_or_default();
        let recipe = Recipe {
            total_steps,
            learning_rate: self.learning_rate,
            schedule: schedule.kind,
            warmup_steps: Recipe::warmup_steps_for(&schedule, total_steps),
            min_learning_rate: schedule.min_learning_rate.unwrap_or(0.0),
            weight_decay: self.weight_decay,
            adam: self.adam.clone().unwrap_or_default(),
            max_grad_norm: self.max_grad_norm,
            evaluation: self.evaluation.clone(),
            epochs,
        };
        if recipe.min_learning_rate > recipe.learning_rate {
            return Err(SpecError::new(
                "training.schedule.minLearningRate",
                "above training.learningRate, the peak; the decay ends at the minimum, so set it below the peak (e.g. a tenth of it)",
            ));
        }
        Ok(recipe)
    }

    /// `ceil(epochs × samples / globalBatch)`, at least one step.
    fn steps_of_epochs(&self, epochs: f64, data: Option<&DataFacts>) -> Result<u64, SpecError> {
        let Some(data) = data else {
            return Err(SpecError::new(
                "training.epochs",
                "an epoch is a pass over spec.data, and this job has none (the synthetic task never ends); set training.steps instead",
            ));
        };
        if !(epochs.is_finite() && epochs > 0.0) {
            return Err(SpecError::new(
                "training.epochs",
                format!("must be above 0 (e.g. 3, or 0.5 for half the data), not {epochs}"),
            ));
        }
        // An epoch is a pass over what is trained on: the held-out share is not.
        let held_out = self
            .evaluation
            .as_ref()
            .map_or(0, |e| e.held_out(data.samples));
        let trained = data.samples - held_out;
        let steps = (epochs * trained as f64 / f64::from(self.global_batch.max(1))).ceil();
        if steps > 1e9 {
            return Err(SpecError::new(
                "training.epochs",
                format!(
                    "{epochs} epochs of {trained} samples in batches of {} are {steps} steps, above the limit of 10^9; train fewer epochs",
                    self.global_batch
                ),
            ));
        }
        Ok((steps as u64).max(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn recipe(schedule: ScheduleType, warmup: u64, total: u64) -> Recipe {
        Recipe {
            schedule,
            warmup_steps: warmup,
            ..Recipe::constant(1.0, total)
        }
    }

    /// Values from transformers 5.23's `get_linear_schedule_with_warmup`,
    /// `get_cosine_schedule_with_warmup` and `get_constant_schedule_with_warmup`
    /// (warmup 3 of 10 steps; the lambdas evaluated by hand from their
    /// source: warmup `s/w`, linear `(T−s)/(T−w)`, cosine
    /// `½(1 + cos(π·(s−w)/(T−w)))`).
    #[test]
    fn the_schedules_follow_transformers() {
        let linear = recipe(ScheduleType::Linear, 3, 10);
        let got: Vec<f64> = (0..10).map(|s| linear.learning_rate_at(s)).collect();
        let want = [
            0.0,
            1.0 / 3.0,
            2.0 / 3.0,
            1.0,
            6.0 / 7.0,
            5.0 / 7.0,
            4.0 / 7.0,
            3.0 / 7.0,
            2.0 / 7.0,
            1.0 / 7.0,
        ];
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < 1e-12, "{got:?}");
        }
        let cosine = recipe(ScheduleType::Cosine, 3, 10);
        assert_eq!(cosine.learning_rate_at(3), 1.0);
        let mid = cosine.learning_rate_at(3 + 7 / 2);
        let want_mid = 0.5 * (1.0 + (std::f64::consts::PI * 3.0 / 7.0).cos());
        assert!((mid - want_mid).abs() < 1e-12);
        assert!(cosine.learning_rate_at(10).abs() < 1e-12, "0 at the end");
        let constant = recipe(ScheduleType::Constant, 2, 10);
        assert_eq!(
            (0..4)
                .map(|s| constant.learning_rate_at(s))
                .collect::<Vec<_>>(),
            [0.0, 0.5, 1.0, 1.0]
        );
    }

    #[test]
    fn the_held_out_share_leaves_one_each_way_and_epochs_skip_it() {
        let e = EvaluationSpec {
            held_out_fraction: 0.1,
            ..EvaluationSpec::default()
        };
        assert_eq!((e.held_out(1), e.held_out(5), e.held_out(100)), (0, 1, 10));
        let mut training: TrainingSpec =
            serde_json::from_value(serde_json::json!({"globalBatch": 10, "epochs": 2.0}))
                .expect("spec");
        let data = DataFacts {
            documents: 1,
            tokens: 1,
            samples: 100,
            masked_per_mille: 0,
            longer_than_sample: 0,
        };
        assert_eq!(
            training.recipe(Some(&data)).expect("recipe").total_steps,
            20
        );
        training.evaluation = Some(e);
        let recipe = training.recipe(Some(&data)).expect("recipe");
        assert_eq!(
            recipe.total_steps, 18,
            "2 passes over the 90 trained samples"
        );
        assert!(recipe.evaluation.is_some());
    }

    #[test]
    fn a_minimum_lifts_the_decay_and_a_ratio_rounds_up() {
        let r = Recipe {
            min_learning_rate: 0.1,
            ..recipe(ScheduleType::Cosine, 0, 100)
        };
        assert!((r.learning_rate_at(100) - 0.1).abs() < 1e-12);
        assert_eq!(r.learning_rate_at(0), 1.0);
        let schedule = ScheduleSpec {
            warmup_ratio: Some(0.03),
            ..ScheduleSpec::default()
        };
        assert_eq!(Recipe::warmup_steps_for(&schedule, 1000), 30);
        assert_eq!(Recipe::warmup_steps_for(&schedule, 10), 1);
    }
}
