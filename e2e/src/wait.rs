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

/// Highest step any worker of `attempt` reported live.
pub fn telemetry_step(job: &MemoryAwareTrainingJob, attempt: u32) -> Option<u64> {
    job.status
        .as_ref()?
        .workers
        .iter()
        .filter(|w| w.attempt == attempt)
        .map(|w| w.step)
        .max()
}

/// The text of a log without terminal colour sequences (`ESC [ ... m`).
pub fn strip_ansi(log: &str) -> String {
    let mut out = String::with_capacity(log.len());
    let mut chars = log.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// The step in a worker log's `resumed` line (`... resumed ... step=N ...`),
/// if the log has one.
pub fn resumed_step(log: &str) -> Option<u64> {
    let log = strip_ansi(log);
    let line = log.lines().find(|l| l.contains("resumed"))?;
    let step = line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("step="))
        .and_then(|s| {
            s.trim_matches(|c: char| !c.is_ascii_digit())
                .parse::<u64>()
                .ok()
        });
    assert!(step.is_some(), "no step in {line:?}");
    step
}
