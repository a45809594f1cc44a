//! Headroom worker: the side of the operator/worker contract that runs in the
//! pod. It reads its [`WorkerAssignment`], trains the planned transformer with
//! burn honouring the plan's settings, checkpoints to the job's volume,
//! reports live memory into the job's status and exits with the contract's
//! code and termination message.
//!
//! * plan intake and the termination message — this file
//! * [`model`] — the decoder-only transformer (one pipeline stage's part of it)
//! * [`pipeline`] — stages over TCP: links, handshake, the 1F1B schedule
//! * [`data`] — the synthetic next-token task (deterministic per sample)
//! * [`train`] — micro-batches, accumulation, block-level checkpointing, optimizers
//! * [`checkpoint`] — atomic, verified, per-part checkpoints and resume under any split
//! * [`telemetry`] — cgroup, process, allocator and NVML memory sampling
//! * [`report`] — rate-limited server-side apply of `status.workers[<pod>]`
//! * [`run`] — one process from start to exit, with the exit contract
//!
//! Exit contract (see `headroom_api::exit_code`): every exit writes a JSON
//! [`TerminationMessage`] to the termination-message path, and an unreadable
//! or inconsistent plan exits with `INVALID_PLAN`, distinct from any failure
//! of training itself; a stage whose pipeline neighbour went away exits with
//! `PEER_LOST`.

pub mod checkpoint;
pub mod data;
pub mod model;
pub mod pipeline;
pub mod report;
pub mod run;
pub mod telemetry;
pub mod train;

use std::path::Path;

use headroom_api::{PLAN_FILE_ENV, PLAN_JSON_ENV, TerminationMessage, WorkerAssignment, exit_code};

/// Why the worker cannot start.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error("no plan: set {PLAN_FILE_ENV} (a JSON file) or {PLAN_JSON_ENV} (the JSON itself)")]
    Missing,
    #[error("cannot read plan file {path}: {source}")]
    Unreadable {
        path: String,
        source: std::io::Error,
    },
    #[error("plan is not a valid assignment document: {0}")]
    Malformed(#[from] serde_json::Error),
    #[error("plan is inconsistent: {0}")]
    Inconsistent(String),
}

impl PlanError {
    pub fn exit_code(&self) -> i32 {
        exit_code::INVALID_PLAN
    }
}

/// Reads the assignment from the environment the operator sets up.
pub fn load_assignment(
    env: impl Fn(&str) -> Option<String>,
) -> Result<WorkerAssignment, PlanError> {
    let json = match (env(PLAN_FILE_ENV), env(PLAN_JSON_ENV)) {
        (Some(path), _) => {
            std::fs::read_to_string(&path).map_err(|source| PlanError::Unreadable {
                path: path.clone(),
                source,
            })?
        }
        (None, Some(json)) => json,
        (None, None) => return Err(PlanError::Missing),
    };
    let assignment: WorkerAssignment = serde_json::from_str(&json)?;
    check(&assignment)?;
    Ok(assignment)
}

/// The invariants the trainer relies on; a violation means operator and worker disagree.
pub fn check(a: &WorkerAssignment) -> Result<(), PlanError> {
    let plan = &a.plan;
    let s = &plan.settings;
    let fail = |m: String| Err(PlanError::Inconsistent(m));
    if s.micro_batch == 0 || s.gradient_accumulation == 0 {
        return fail(format!(
            "micro-batch {} × accumulation {} must both be ≥ 1",
            s.micro_batch, s.gradient_accumulation
        ));
    }
    if s.global_batch() != plan.global_batch {
        return fail(format!(
            "micro-batch {} × accumulation {} = {} ≠ global batch {}",
            s.micro_batch,
            s.gradient_accumulation,
            s.global_batch(),
            plan.global_batch
        ));
    }
    if plan.stages.len() != plan.workers as usize {
        return fail(format!(
            "{} stages for {} workers",
            plan.stages.len(),
            plan.workers
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
    if a.steps == 0 || a.checkpoint_every_steps == 0 {
        return fail("steps and checkpointEverySteps must be ≥ 1".into());
    }
    Ok(())
}

/// Kubernetes keeps at most this many bytes of a termination message.
pub const TERMINATION_MESSAGE_LIMIT: usize = 4096;

/// Writes the termination message as JSON, shortening `reason` so the whole
/// document stays valid JSON within Kubernetes' 4 KiB limit.
pub fn write_termination_message(path: &Path, message: &TerminationMessage) -> std::io::Result<()> {
    let mut message = message.clone();
    loop {
        let json = serde_json::to_string(&message).map_err(std::io::Error::other)?;
        if json.len() <= TERMINATION_MESSAGE_LIMIT || message.reason.is_empty() {
            return std::fs::write(path, json);
        }
        let keep = message
            .reason
            .chars()
            .count()
            .saturating_sub(json.len() - TERMINATION_MESSAGE_LIMIT + 8);
        message.reason = message.reason.chars().take(keep).collect::<String>() + "…";
    }
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
            target: Target::Cpu {
                memory_limit_bytes: 1 << 30,
                max_workers: 1,
            },
            headroom_fraction: 0.1,
            allowed_rungs: RetryRung::ALL.to_vec(),
        };
        WorkerAssignment {
            job: "j".into(),
            namespace: "ns".into(),
            attempt: 1,
            stage: 0,
            model: req.model.clone(),
            plan: plan(&req, &Inventory::default()).expect("plan"),
            steps: 10,
            learning_rate: 1e-3,
            checkpoint_every_steps: 5,
            seed: 1,
        }
    }

    fn env_with<'a>(pairs: &'a [(&'a str, String)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| {
            pairs
                .iter()
                .find(|(key, _)| *key == k)
                .map(|(_, v)| v.clone())
        }
    }

    #[test]
    fn loads_a_plan_from_the_environment() {
        let json = serde_json::to_string(&assignment()).expect("json");
        let loaded = load_assignment(env_with(&[(PLAN_JSON_ENV, json)])).expect("valid");
        assert_eq!(loaded, assignment());
    }

    #[test]
    fn missing_malformed_and_inconsistent_plans_get_the_invalid_plan_exit_code() {
        let missing = load_assignment(|_| None).expect_err("missing");
        assert!(missing.to_string().contains(PLAN_FILE_ENV));
        let malformed = load_assignment(env_with(&[(PLAN_JSON_ENV, "{\"job\": 1}".into())]))
            .expect_err("malformed");
        assert!(matches!(malformed, PlanError::Malformed(_)));
        let mut a = assignment();
        a.plan.settings.gradient_accumulation += 1;
        let err = check(&a).expect_err("global batch broken");
        assert!(err.to_string().contains("≠ global batch"), "{err}");
        assert_eq!(err.exit_code(), exit_code::INVALID_PLAN);
        let mut b = assignment();
        b.stage = 3;
        assert!(check(&b).is_err());
        let unreadable = load_assignment(env_with(&[(
            PLAN_FILE_ENV,
            "/nonexistent/plan.json".into(),
        )]))
        .expect_err("unreadable");
        assert!(unreadable.to_string().contains("/nonexistent/plan.json"));
    }

    #[test]
    fn termination_message_is_json_and_bounded() {
        let dir = std::env::temp_dir().join(format!("headroom-worker-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("tmp");
        let path = dir.join("termination-log");
        let msg = TerminationMessage {
            outcome: "deviceOutOfMemory".into(),
            reason: "é".repeat(5_000),
            step: Some(7),
            peak_bytes: Some(1 << 30),
            requested_bytes: Some(1 << 20),
        };
        write_termination_message(&path, &msg).expect("write");
        let written = std::fs::read_to_string(&path).expect("read");
        assert!(written.len() <= TERMINATION_MESSAGE_LIMIT);
        let parsed: TerminationMessage = serde_json::from_str(&written).expect("still valid JSON");
        assert_eq!(parsed.outcome, "deviceOutOfMemory");
        assert_eq!(parsed.step, Some(7));
        assert!(parsed.reason.ends_with('…'));
    }
}
