//! The end-to-end suite on real pods: `make e2e` (local single-node cluster,
//! images built without Docker, Headroom installed with Helm). Ignored by a
//! plain `cargo test`, which has no cluster.

use std::time::Duration;

use headroom_api::{AttemptOutcome, JobPhase};
use headroom_e2e::TestNs;

const TINY: &str = include_str!("../../samples/cpu-tiny.yaml");
const OOM_FIRST: &str = include_str!("../../samples/cpu-oom-first.yaml");
const RUN: Duration = Duration::from_secs(600);

fn phase(job: &headroom_api::MemoryAwareTrainingJob) -> Option<JobPhase> {
    job.status.as_ref().and_then(|s| s.phase)
}

#[tokio::test]
#[ignore = "needs a cluster with Headroom installed: make e2e"]
async fn a_small_job_succeeds_with_live_telemetry() {
    let ns = TestNs::new("e2e-small").await;
    let manifest = TINY.replace("steps: 200", "steps: 8");
    ns.apply_job(&manifest).await;
    // Telemetry arrives while it runs.
    let running = ns
        .wait_job("tiny-cpu", "live telemetry in status.workers", RUN, |j| {
            j.status
                .as_ref()
                .is_some_and(|s| s.workers.iter().any(|w| w.memory.peak_bytes > 0))
        })
        .await;
    let worker = &running.status.expect("status").workers[0];
    assert_eq!(
        (worker.name.as_str(), worker.attempt),
        ("tiny-cpu-a1-s0", 1)
    );
    let done = ns
        .wait_job("tiny-cpu", "Succeeded", RUN, |j| {
            phase(j) == Some(JobPhase::Succeeded)
        })
        .await;
    let status = done.status.expect("status");
    assert_eq!(status.attempts.len(), 1);
    let attempt = &status.attempts[0];
    assert_eq!(attempt.outcome, AttemptOutcome::Succeeded);
    let peak = attempt
        .observed_peak_bytes
        .expect("the final peak is recorded");
    assert!(
        peak > 0 && peak <= 1 << 30,
        "peak {peak} within the 1Gi limit"
    );
    ns.cleanup().await;
}

#[tokio::test]
#[ignore = "needs a cluster with Headroom installed: make e2e"]
async fn a_job_over_its_limit_is_oom_killed_and_succeeds_stricter() {
    let ns = TestNs::new("e2e-oom").await;
    ns.apply_job(OOM_FIRST).await;
    let done = ns
        .wait_job("oom-then-fit", "Succeeded or Failed", RUN, |j| {
            matches!(phase(j), Some(JobPhase::Succeeded | JobPhase::Failed))
        })
        .await;
    let status = done.status.clone().expect("status");
    assert_eq!(
        phase(&done),
        Some(JobPhase::Succeeded),
        "{}",
        ns.dump().await
    );
    let first = &status.attempts[0];
    assert_eq!(
        first.outcome,
        AttemptOutcome::HostOutOfMemory,
        "the kernel really killed attempt 1"
    );
    assert_eq!(first.reason.as_deref(), Some("OOMKilled"));
    let last = status.attempts.last().expect("attempts");
    assert_eq!(last.outcome, AttemptOutcome::Succeeded);
    assert!(
        last.plan.settings.activation_checkpointing
            || last.plan.settings.micro_batch < first.plan.settings.micro_batch
    );
    assert_eq!(
        last.plan.global_batch, first.plan.global_batch,
        "the global batch is kept"
    );
    assert!(
        last.observed_peak_bytes
            .is_some_and(|p| p <= last.plan.device_memory_bytes)
    );
    ns.cleanup().await;
}

#[tokio::test]
#[ignore = "needs a cluster with Headroom installed: make e2e"]
async fn a_job_that_fits_nowhere_fails_without_pods() {
    let ns = TestNs::new("e2e-nofit").await;
    ns.apply_job(&TINY.replace("memoryLimit: 1Gi", "memoryLimit: 64Mi"))
        .await;
    let job = ns
        .wait_job("tiny-cpu", "Failed", Duration::from_secs(60), |j| {
            phase(j) == Some(JobPhase::Failed)
        })
        .await;
    let message = job.status.and_then(|s| s.message).unwrap_or_default();
    assert!(
        message.contains("no feasible plan") && message.contains("budget"),
        "{message}"
    );
    let pods = ns
        .pods()
        .list(&Default::default())
        .await
        .expect("pods")
        .items;
    assert!(pods.is_empty(), "no pods for an infeasible job");
    ns.cleanup().await;
}
