//! What the decision's tests share: jobs from the samples, pods in each
//! state, and one step of the controller without the API server.

use std::time::Duration;

use headroom_api::MemoryAwareTrainingJobStatus;
use headroom_planner::Inventory;
use jiff::Timestamp;
use k8s_openapi::api::core::v1::Pod;

// What the tests of each concern use besides the fixtures.
pub(super) use headroom_api::{JobPhase, MemoryAwareTrainingJob};
pub(super) use headroom_planner::RetryRung;
pub(super) use jiff::SignedDuration;
pub(super) use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

pub(super) use super::super::LaunchRefusal;
pub(super) use super::super::config::WorkerImages;
pub(super) use super::super::lifecycle::{ConditionType, Reason};
pub(super) use super::ClaimFacts;
use super::{Decision, Observation, QueueView, decide};
use crate::controller::pods::tests::job;

/// The attempt a decision launches, if any.
pub(super) fn launched(d: &Decision) -> Option<u32> {
    d.launch.as_ref().map(|l| l.attempt)
}

/// The initializer run a decision keeps, if any.
pub(super) fn initializer(d: &Decision) -> Option<u32> {
    d.initialize.as_ref().map(|i| i.run)
}

pub(super) fn oom_job() -> MemoryAwareTrainingJob {
    let mut j = job(include_str!("../../../../samples/cpu-oom-first.yaml"));
    j.metadata.generation = Some(1);
    j
}

pub(super) fn pod(attempt: u32, stage: u32, status: &str) -> Pod {
    serde_yaml::from_str(&format!(
        "metadata: {{name: p-a{attempt}-s{stage}, labels: {{headroom.dev/job: oom-then-fit, headroom.dev/attempt: '{attempt}'}}}}\nstatus:\n{status}"
    ))
    .expect("pod fixture")
}

pub(super) const RUNNING: &str = "  phase: Running";
pub(super) const OOM: &str = "  phase: Failed\n  containerStatuses: [{name: worker, image: i, imageID: '', ready: false, restartCount: 0, state: {terminated: {exitCode: 137, reason: OOMKilled}}}]";
pub(super) const CRASH: &str = "  phase: Failed\n  containerStatuses: [{name: worker, image: i, imageID: '', ready: false, restartCount: 0, state: {terminated: {exitCode: 2}}}]";
pub(super) const DONE: &str = "  phase: Succeeded\n  containerStatuses: [{name: worker, image: i, imageID: '', ready: false, restartCount: 0, state: {terminated: {exitCode: 0}}}]";

pub(super) fn step(job: &mut MemoryAwareTrainingJob, pods: &[Pod], now: Timestamp) -> Decision {
    step_with(job, pods, now, &WorkerImages::default())
}

/// [`step`] for an operator with these default worker images.
pub(super) fn step_with(
    job: &mut MemoryAwareTrainingJob,
    pods: &[Pod],
    now: Timestamp,
    worker_images: &WorkerImages,
) -> Decision {
    step_queued(job, pods, now, worker_images, None)
}

/// [`step_with`] for a job in a Kueue queue.
pub(super) fn step_queued(
    job: &mut MemoryAwareTrainingJob,
    pods: &[Pod],
    now: Timestamp,
    worker_images: &WorkerImages,
    queue: Option<&QueueView>,
) -> Decision {
    step_within(
        job,
        pods,
        now,
        (worker_images, queue),
        crate::controller::config::DEFAULT_PLANNING_BUDGET,
    )
}

/// [`step_queued`] with planning given `planning_budget`.
pub(super) fn step_within(
    job: &mut MemoryAwareTrainingJob,
    pods: &[Pod],
    now: Timestamp,
    (worker_images, queue): (&WorkerImages, Option<&QueueView>),
    planning_budget: Duration,
) -> Decision {
    step_full(
        job,
        pods,
        now,
        (worker_images, queue),
        planning_budget,
        None,
    )
}

/// [`step`] seeing the job's checkpoint claim as `claim` says.
pub(super) fn step_with_claim(
    job: &mut MemoryAwareTrainingJob,
    pods: &[Pod],
    now: Timestamp,
    claim: Option<&ClaimFacts>,
) -> Decision {
    step_full(
        job,
        pods,
        now,
        (&WorkerImages::default(), None),
        crate::controller::config::DEFAULT_PLANNING_BUDGET,
        claim,
    )
}

/// [`step`] seeing the job's shared model cache claim as `cache` says.
pub(super) fn step_with_cache(
    job: &mut MemoryAwareTrainingJob,
    pods: &[Pod],
    now: Timestamp,
    cache: &super::CacheView,
) -> Decision {
    step_observed(
        job,
        pods,
        now,
        (&WorkerImages::default(), None),
        crate::controller::config::DEFAULT_PLANNING_BUDGET,
        (None, Some(cache)),
    )
}

fn step_full(
    job: &mut MemoryAwareTrainingJob,
    pods: &[Pod],
    now: Timestamp,
    (worker_images, queue): (&WorkerImages, Option<&QueueView>),
    planning_budget: Duration,
    claim: Option<&ClaimFacts>,
) -> Decision {
    step_observed(
        job,
        pods,
        now,
        (worker_images, queue),
        planning_budget,
        (claim, None),
    )
}

fn step_observed(
    job: &mut MemoryAwareTrainingJob,
    pods: &[Pod],
    now: Timestamp,
    (worker_images, queue): (&WorkerImages, Option<&QueueView>),
    planning_budget: Duration,
    (claim, model_cache): (Option<&ClaimFacts>, Option<&super::CacheView>),
) -> Decision {
    let refs: Vec<&Pod> = pods.iter().collect();
    let inv = Inventory::default();
    let d = decide(&Observation {
        job,
        pods: &refs,
        inventory: &inv,
        now,
        unschedulable_grace: Duration::from_secs(60),
        planning_budget,
        default_gpu_host_memory: 16 << 30,
        default_checkpoint_bytes: 1 << 30,
        worker_images,
        queue,
        claim,
        model_cache,
    });
    job.status = Some(d.status.clone());
    d
}

/// Whether the status carries condition `type_` = `on` with `reason`.
pub(super) fn has_condition(
    status: &MemoryAwareTrainingJobStatus,
    type_: ConditionType,
    on: bool,
    reason: Reason,
) -> bool {
    let on = if on { "True" } else { "False" };
    status.conditions.iter().any(|c| {
        (c.type_.as_str(), c.status.as_str(), c.reason.as_str())
            == (type_.as_str(), on, reason.as_str())
    })
}

pub(super) fn t0() -> Timestamp {
    "2026-11-21T10:00:00Z".parse().expect("time")
}

pub(super) fn finetune_job() -> MemoryAwareTrainingJob {
    let mut j = job(include_str!(
        "../../../../samples/cpu-finetune-tiny-llama.yaml"
    ));
    j.metadata.generation = Some(1);
    j
}

/// The initializer pod of run `run` with `status` (a terminated container's YAML).
pub(super) fn init_pod(run: u32, status: &str) -> Pod {
    serde_yaml::from_str(&format!(
        "metadata: {{name: finetune-tiny-llama-init-{run}, labels: {{headroom.dev/job: finetune-tiny-llama, headroom.dev/role: initializer}}}}\nstatus:\n{status}"
    ))
    .expect("pod fixture")
}

pub(super) fn terminated(code: i32, message: &str) -> String {
    let phase = if code == 0 { "Succeeded" } else { "Failed" };
    format!(
        "  phase: {phase}\n  containerStatuses: [{{name: initializer, image: i, imageID: '', ready: false, restartCount: 0, state: {{terminated: {{exitCode: {code}, finishedAt: '2026-11-21T10:00:05Z', message: {} }}}}}}]",
        serde_json::to_string(message).expect("quoted")
    )
}

pub(super) fn refusal(code: u16) -> LaunchRefusal {
    LaunchRefusal {
        object: "Pod oom-then-fit-a1-s1".into(),
        code,
        message: "denied by policy".into(),
        heals: LaunchRefusal::heals(code),
    }
}
