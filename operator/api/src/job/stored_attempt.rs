//! How an attempt is read back from the API server: in the lean shape the
//! operator writes, or in the older shape that stored each attempt's whole
//! plan; either becomes an [`Attempt`], and the schema of
//! `status.attempts[]` is this reading's.

use headroom_planner::{Plan, RetryRung, Settings};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use schemars::JsonSchema;
use serde::Deserialize;

use super::status::{Attempt, AttemptOutcome};

/// An attempt as the API server stores it, the tolerant reading (and the
/// schema) of [`Attempt`]: what the attempt ran is either in the fields of
/// this shape or, for jobs stored before it, in `plan`.
#[derive(Clone, Debug, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub(super) struct StoredAttempt {
    /// 1-based.
    number: u32,
    /// The device type the attempt's workers ran on (`cpu` for CPU jobs).
    #[serde(default)]
    device: Option<String>,
    /// Memory of that device (or the CPU worker's container limit), bytes.
    #[serde(default)]
    device_memory_bytes: Option<u64>,
    /// Worker pods (stages × data-parallel replicas).
    #[serde(default)]
    workers: Option<u32>,
    /// Pipeline stages.
    #[serde(default)]
    stages: Option<u32>,
    /// Micro-batch, accumulation, checkpointing, precision, optimizer.
    #[serde(default)]
    // Atomic: see the doc of the `status` module.
    #[schemars(extend("x-kubernetes-map-type" = "atomic"))]
    settings: Option<Settings>,
    /// The plan's predicted peak of its largest worker, bytes.
    #[serde(default)]
    predicted_peak_bytes: Option<u64>,
    /// What a worker may use: device memory (or the CPU worker's limit)
    /// less the job's headroom, bytes.
    #[serde(default)]
    budget_bytes: Option<u64>,
    /// Retry rungs this attempt's plan applied on top of the first.
    #[serde(default)]
    rungs_applied: Vec<RetryRung>,
    outcome: AttemptOutcome,
    /// Short reason the attempt ended (`OOMKilled`, `Terminated`, `ExitCode1`, …).
    #[serde(default)]
    reason: Option<String>,
    /// What ended the attempt, in the worker's or Kubernetes' words.
    #[serde(default)]
    message: Option<String>,
    #[serde(default)]
    started_at: Option<Time>,
    #[serde(default)]
    finished_at: Option<Time>,
    /// Highest peak any worker of this attempt reported, bytes.
    #[serde(default)]
    observed_peak_bytes: Option<u64>,
    /// Last optimizer step reached.
    #[serde(default)]
    last_step: Option<u64>,
    /// Jobs stored before the plan was stored once: the attempt's whole
    /// plan. Read, never written (the operator's next status write
    /// replaces it with the fields above).
    #[serde(default)]
    #[schemars(schema_with = "preserved_object")]
    plan: Option<Box<Plan>>,
}

/// An object whose fields the API server keeps as they are (no schema below
/// it): old-shape data that is read, never written.
fn preserved_object(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": true,
    })
}

impl TryFrom<StoredAttempt> for Attempt {
    type Error = String;

    fn try_from(s: StoredAttempt) -> Result<Attempt, String> {
        let n = s.number;
        let missing = |field: &str| {
            format!("status.attempts[number={n}]: no `{field}` and no `plan` to read it from")
        };
        let plan = s.plan.as_deref();
        let stored_with_plan = plan.is_some();
        Ok(Attempt {
            number: n,
            device: s
                .device
                .or_else(|| plan.map(|p| p.device.clone()))
                .ok_or_else(|| missing("device"))?,
            device_memory_bytes: s
                .device_memory_bytes
                .or(plan.map(|p| p.device_memory_bytes))
                .ok_or_else(|| missing("deviceMemoryBytes"))?,
            workers: s
                .workers
                .or(plan.map(|p| p.workers))
                .ok_or_else(|| missing("workers"))?,
            stages: s
                .stages
                .or(plan.map(Plan::stage_count))
                .ok_or_else(|| missing("stages"))?,
            settings: s
                .settings
                .or(plan.map(|p| p.settings))
                .ok_or_else(|| missing("settings"))?,
            predicted_peak_bytes: s
                .predicted_peak_bytes
                .or(plan.map(|p| p.predicted_peak_bytes))
                .ok_or_else(|| missing("predictedPeakBytes"))?,
            budget_bytes: s
                .budget_bytes
                .or(plan.map(|p| p.budget_bytes))
                .ok_or_else(|| missing("budgetBytes"))?,
            rungs_applied: match plan {
                Some(p) if s.rungs_applied.is_empty() => p.rungs_applied.clone(),
                _ => s.rungs_applied,
            },
            outcome: s.outcome,
            reason: s.reason,
            message: s.message,
            started_at: s.started_at,
            finished_at: s.finished_at,
            observed_peak_bytes: s.observed_peak_bytes,
            last_step: s.last_step,
            stored_with_plan,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::MemoryAwareTrainingJob;

    /// A plan as the planner makes it for the CPU sample that is OOM-killed first.
    fn sample_plan() -> Plan {
        let path = format!(
            "{}/../../samples/cpu-oom-first.yaml",
            env!("CARGO_MANIFEST_DIR")
        );
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        let job: MemoryAwareTrainingJob = serde_yaml::from_str(&text).expect("sample");
        let request = job.spec.job_request().expect("request");
        headroom_planner::plan(&request, &headroom_planner::Inventory::default()).expect("plan")
    }

    /// Both shapes of `status.attempts[]` read into the same attempt: the
    /// lean one as written, the old one (each attempt with its whole plan)
    /// with the summary filled from the plan and marked for rewriting; a
    /// write never carries the plan again.
    #[test]
    fn attempts_of_both_shapes_read_the_same_and_are_written_lean() {
        let plan = sample_plan();
        let lean = Attempt::start(1, &plan, None);
        let written = serde_json::to_value(&lean).expect("serialize");
        assert!(written.get("plan").is_none(), "{written}");
        let back: Attempt = serde_json::from_value(written).expect("lean reads back");
        assert_eq!(back, lean);
        assert!(!back.stored_with_plan);

        let old = serde_json::json!({"number": 1, "plan": plan, "outcome": "Running"});
        let read: Attempt = serde_json::from_value(old).expect("old shape reads");
        assert!(read.stored_with_plan);
        assert_eq!(
            Attempt {
                stored_with_plan: false,
                ..read.clone()
            },
            lean
        );
        let rewritten = serde_json::to_value(&read).expect("serialize");
        assert!(rewritten.get("plan").is_none(), "{rewritten}");

        let neither = serde_json::json!({"number": 3, "outcome": "Failed"});
        let err = serde_json::from_value::<Attempt>(neither).expect_err("nothing to read");
        assert!(
            err.to_string()
                .contains("status.attempts[number=3]: no `device` and no `plan`"),
            "{err}"
        );
    }
}
