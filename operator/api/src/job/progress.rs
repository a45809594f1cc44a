//! Where a job's training stands, as `status.progress` shows it: the step
//! reached of the run's total, the last losses, the throughput and the time
//! left. The operator computes it from its workers' telemetry and writes it
//! with their entries (`headroom_operator::progress`); `kubectl get matj`
//! prints its `stepOfTotal`, `trainLoss` and `eta`.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::spec::MemoryAwareTrainingJob;

impl MemoryAwareTrainingJob {
    /// Optimizer steps the whole run trains: what a worker trains to and
    /// what `status.progress.totalSteps` counts towards. The recipe recorded
    /// in the status says it (a run given in epochs gets its steps there,
    /// from the data's sample count); before it is recorded, `steps` of the
    /// spec, and nothing for a run in epochs whose data is not read yet.
    pub fn total_steps(&self) -> Option<u64> {
        let recorded = self.status.as_ref().and_then(|s| s.recipe.as_ref());
        recorded.map(|r| r.total_steps).or(self.spec.training.steps)
    }

    /// Tokens one optimizer step trains on, as the worker counts them: the
    /// global batch's samples × the sequence length (samples are packed to
    /// it). None for a model without a sequence length (`generic`).
    pub fn tokens_per_step(&self) -> Option<u64> {
        let model = &self.spec.model;
        let sequence = (model.transformer.as_ref().map(|t| t.sequence_length))
            .or(model.pretrained.as_ref().map(|p| p.sequence_length))?;
        Some(u64::from(self.spec.training.global_batch) * u64::from(sequence))
    }
}

/// A job's training progress, from its workers' latest reports. It covers
/// the whole run, not one attempt: `step` counts the run's optimizer steps,
/// so an attempt that resumes from a checkpoint continues from that
/// checkpoint's step (which is at or below the step the attempt before it
/// reached: the steps after the last checkpoint are trained again, and
/// `step` shows that). `attempt` says whose figures these are.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct JobProgress {
    /// The attempt whose workers reported `step` (a new attempt's figures
    /// replace these once its workers report).
    pub attempt: u32,
    /// Optimizer steps done in the run (the last pipeline stage's count;
    /// data-parallel replicas count together).
    pub step: u64,
    /// Optimizer steps the run trains (`training.steps`); absent until the
    /// operator has read the job since its workers started reporting.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_steps: Option<u64>,
    /// `step/totalSteps` (`step` alone while the total is unknown): the
    /// Step column of `kubectl get`.
    #[schemars(length(max = 41))]
    pub step_of_total: String,
    /// Training loss of the last step reported, rounded to 5 significant
    /// digits (the workers' entries keep it whole). A resumed attempt shows
    /// the attempt before it's until its first step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub train_loss: Option<f64>,
    /// Loss on the held-out data at the last evaluation, rounded likewise;
    /// absent until a worker reports one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_loss: Option<f64>,
    /// The run's training throughput over its last step, tokens per second.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_second: Option<f64>,
    /// Wall-clock seconds per optimizer step, measured over the attempt's
    /// last reports; absent until two reports a step or more apart.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seconds_per_step: Option<f64>,
    /// Estimated seconds left: the steps left × `secondsPerStep`, rounded
    /// up (0 once the last step is done); absent
    /// until measured, and from an attempt's end until the next one's
    /// workers have been measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eta_seconds: Option<u64>,
    /// `etaSeconds` for people (`3m20s`, `2h05m`): the ETA column of `kubectl get`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 32))]
    pub eta: Option<String>,
    /// When the run should end at that pace (`updatedAt` + `etaSeconds`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub estimated_completion_time: Option<Time>,
    /// When the operator computed these figures.
    pub updated_at: Time,
}

impl JobProgress {
    /// The Step column's text: `step/total`, or `step` with no total.
    pub fn step_of_total(step: u64, total: Option<u64>) -> String {
        match total {
            Some(total) => format!("{step}/{total}"),
            None => step.to_string(),
        }
    }

    /// Drops the estimate of the time left, kept otherwise: the attempt it
    /// was measured on has ended, and the next one may run at another pace
    /// (a retry changes the micro-batch, the checkpointing or the device).
    pub fn forget_eta(&mut self) {
        self.seconds_per_step = None;
        self.eta_seconds = None;
        self.eta = None;
        self.estimated_completion_time = None;
    }
}

/// `x` to `digits` significant digits (a loss as a column prints it:
/// 2.3457, not the 17 digits of an f32 widened to f64). Non-finite values
/// and 0 are returned as they are.
pub fn round_significant(x: f64, digits: usize) -> f64 {
    if !x.is_finite() || x == 0.0 {
        return x;
    }
    // Scientific notation with digits-1 decimals has `digits` significant digits.
    format!("{:.*e}", digits.saturating_sub(1), x)
        .parse()
        .unwrap_or(x)
}

/// Whole seconds for people, two units at most: `45s`, `3m20s`, `2h05m`,
/// `3d04h`.
pub fn human_duration(seconds: u64) -> String {
    let (d, h, m, s) = (
        seconds / 86_400,
        seconds / 3_600 % 24,
        seconds / 60 % 60,
        seconds % 60,
    );
    if d > 0 {
        format!("{d}d{h:02}h")
    } else if h > 0 {
        format!("{h}h{m:02}m")
    } else if m > 0 {
        format!("{m}m{s:02}s")
    } else {
        format!("{s}s")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_as_people_write_them() {
        assert_eq!(human_duration(0), "0s");
        assert_eq!(human_duration(45), "45s");
        assert_eq!(human_duration(200), "3m20s");
        assert_eq!(human_duration(3_600 + 5 * 60 + 59), "1h05m");
        assert_eq!(human_duration(3 * 86_400 + 4 * 3_600 + 1), "3d04h");
        assert!(human_duration(u64::MAX).len() <= 32, "the schema's bound");
    }

    #[test]
    fn a_loss_is_rounded_to_five_significant_digits() {
        assert_eq!(round_significant(f64::from(2.345_678_8_f32), 5), 2.3457);
        assert_eq!(round_significant(0.000_123_456, 5), 0.000_123_46);
        assert_eq!(round_significant(10.5, 5), 10.5);
        assert_eq!(round_significant(0.0, 5), 0.0);
    }

    #[test]
    fn the_step_column_shows_the_total_when_known() {
        assert_eq!(JobProgress::step_of_total(120, Some(500)), "120/500");
        assert_eq!(JobProgress::step_of_total(120, None), "120");
        let longest = JobProgress::step_of_total(u64::MAX, Some(u64::MAX));
        assert_eq!(longest.len(), 41, "the schema's bound");
    }
}
