//! Polling waits with a deadline, and the conditions tests wait for.

use std::future::Future;
use std::time::Duration;

use headroom_api::{JobPhase, MemoryAwareTrainingJob};
use k8s_openapi::api::core::v1::Pod;

/// Polls `probe` every `poll` until it yields a value. After `timeout` the
/// test fails with `what` and the text `on_timeout` produces (a dump of the
/// state that was waited on; awaited only then).
pub async fn until<T, P, PF, D, DF>(
    what: &str,
    timeout: Duration,
    poll: Duration,
    mut probe: P,
    on_timeout: D,
) -> T
where
    P: FnMut() -> PF,
    PF: Future<Output = Option<T>>,
    D: FnOnce() -> DF,
    DF: Future<Output = String>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(found) = probe().await {
            return found;
        }
        if tokio::time::Instant::now() > deadline {
            panic!(
                "timed out after {timeout:?} waiting for {what}\n{}",
                on_timeout().await
            );
        }
        tokio::time::sleep(poll).await;
    }
}

/// Whether the job has ended: Succeeded or Failed.
pub fn ended(job: &MemoryAwareTrainingJob) -> bool {
    matches!(
        job.status.as_ref().and_then(|s| s.phase),
        Some(JobPhase::Succeeded | JobPhase::Failed)
    )
}

/// The job's phase, if it has one yet.
pub fn phase(job: &MemoryAwareTrainingJob) -> Option<JobPhase> {
    job.status.as_ref().and_then(|s| s.phase)
}

/// How many attempts the job's status records.
pub fn attempts(job: &MemoryAwareTrainingJob) -> usize {
    job.status.as_ref().map_or(0, |s| s.attempts.len())
}

/// True when the pod's `Ready` condition is `True`.
pub fn pod_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// The pod's phase (`Pending`, `Running`, ...), empty if unknown.
pub fn pod_phase(pod: &Pod) -> &str {
    pod.status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or_default()
}
