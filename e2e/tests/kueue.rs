//! Kueue admits, Headroom sizes: jobs labelled `kueue.x-k8s.io/queue-name`
//! on a real Kueue (built from its Go module and installed by
//! e2e/kueue/kueue.sh) and real pods. A ClusterQueue that holds one job at a
//! time runs two in order; a higher-priority job preempts a running one,
//! which resumes from its checkpoint and finishes without the preemption
//! counting as a failure. (A queue that can never hold a job refuses it with
//! the figures: operator/tests/kueue.rs, on the API server.)

use std::time::Duration;

use headroom_api::{AttemptOutcome, JobPhase};
use headroom_e2e::fixtures::{CPU_PIPELINE_RETRY as PIPELINE_RETRY, CPU_TINY as TINY};
use headroom_e2e::kueue::{QueueSpec, queued};
use headroom_e2e::{E2E, TestNs, phase, telemetry_step};
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;

const RUN: Duration = Duration::from_secs(600);

/// samples/cpu-tiny.yaml named `name`, with `steps` steps, half a core and a
/// checkpoint every 2 steps; its pod requests 1 GiB and 500m.
fn tiny(name: &str, steps: u32) -> String {
    let manifest = TINY
        .replace("name: tiny-cpu", &format!("name: {name}"))
        .replace(
            "steps: 200",
            &format!("steps: {steps}\n    checkpointEverySteps: 2"),
        )
        .replace("cores: \"1\"", "cores: 500m");
    assert!(
        manifest.contains("cores: 500m") && manifest.contains("checkpointEverySteps"),
        "samples/cpu-tiny.yaml changed"
    );
    manifest
}

/// Room for one such worker (1 GiB, 500m), not two.
const ONE_JOB: &[(&str, &str)] = &[("cpu", "750m"), ("memory", "1536Mi")];

fn gated(pod: &Pod) -> bool {
    pod.spec
        .as_ref()
        .and_then(|s| s.scheduling_gates.as_ref())
        .is_some_and(|g| g.iter().any(|g| g.name == "kueue.x-k8s.io/admission"))
}

fn condition<'a>(
    job: &'a headroom_api::MemoryAwareTrainingJob,
    type_: &str,
) -> Option<&'a k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition> {
    job.status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == type_)
}

#[tokio::test]
#[ignore = "needs a cluster with Headroom and Kueue installed: make e2e"]
async fn two_queued_jobs_run_one_at_a_time_in_order() {
    let ns = TestNs::new(E2E, "e2e-kueue-order").await;
    ns.opt_into_kueue().await;
    let queue = ns.kueue_queue(&QueueSpec::one(ONE_JOB)).await;
    ns.apply_job(&queued(&tiny("first", 4), &queue.local, None))
        .await;
    ns.wait_job("first", "Running", RUN, |j| {
        phase(j) == Some(JobPhase::Running)
    })
    .await;
    ns.apply_job(&queued(&tiny("second", 4), &queue.local, None))
        .await;

    // The second waits in the queue, says so, and its pod is gated.
    let waiting = ns
        .wait_job("second", "Waiting=True, reason Queued", RUN, |j| {
            condition(j, "Waiting").is_some_and(|c| c.status == "True" && c.reason == "Queued")
        })
        .await;
    let message = condition(&waiting, "Waiting")
        .map(|c| c.message.clone())
        .unwrap_or_default();
    assert!(
        message.contains(&format!("LocalQueue {}", queue.local)),
        "{message}"
    );
    let pod = ns.pods().get("second-a1-s0").await.ok();
    // The first may have finished meanwhile; while it runs, the second is gated.
    let first_running = ns
        .jobs()
        .get("first")
        .await
        .ok()
        .is_some_and(|j| phase(&j) == Some(JobPhase::Running));
    if first_running {
        assert!(
            pod.as_ref().is_some_and(gated),
            "the second job's pod is gated while the first runs: {pod:?}"
        );
    }

    let first = ns.wait_succeeded("first", RUN).await;
    let second = ns.wait_succeeded("second", RUN).await;
    assert_eq!(first.attempts.len(), 1, "{first:?}");
    assert_eq!(second.attempts.len(), 1, "{second:?}");
    let admitted = second
        .conditions
        .iter()
        .find(|c| c.type_ == "Waiting")
        .expect("Waiting condition");
    assert_eq!(
        (admitted.status.as_str(), admitted.reason.as_str()),
        ("False", "Admitted")
    );
    // In order: the second's worker started after the first's ended.
    let pods = ns.pod_list().await;
    let finish_of = |name: &str| {
        pods.iter()
            .find(|p| p.name_any() == name)
            .and_then(|p| {
                p.status
                    .as_ref()?
                    .container_statuses
                    .as_ref()?
                    .first()
                    .cloned()
            })
            .and_then(|c| c.state?.terminated)
    };
    let (a, b) = (finish_of("first-a1-s0"), finish_of("second-a1-s0"));
    let (Some(a), Some(b)) = (a, b) else {
        panic!("both workers' pods are kept with their terminated state: {pods:?}");
    };
    {
        let a_end = a.finished_at.expect("finishedAt").0;
        let b_start = b.started_at.expect("startedAt").0;
        assert!(
            b_start >= a_end,
            "the second worker started at {b_start}, before the first ended at {a_end}"
        );
    }
    ns.delete_kueue_objects(&queue, &[]).await;
    ns.cleanup().await;
}

#[tokio::test]
#[ignore = "needs a cluster with Headroom and Kueue installed: make e2e"]
async fn a_higher_priority_job_preempts_and_the_preempted_one_resumes() {
    let ns = TestNs::new(E2E, "e2e-kueue-preempt").await;
    ns.opt_into_kueue().await;
    let queue = ns
        .kueue_queue(&QueueSpec {
            preempt_lower_priority: true,
            ..QueueSpec::one(ONE_JOB)
        })
        .await;
    let low = ns.kueue_priority("low", 100).await;
    let high = ns.kueue_priority("high", 1000).await;
    // maxAttempts 1: a preemption that counted as a failure would end it.
    let low_job = tiny("low", 12).replace(
        "  worker:",
        "  memoryPolicy: {maxAttempts: 1, backoffSeconds: 1}\n  worker:",
    );
    ns.apply_job(&queued(&low_job, &queue.local, Some(&low)))
        .await;
    let before = ns
        .wait_job("low", "attempt 1 at step 3", RUN, |j| {
            telemetry_step(j, 1).is_some_and(|s| s >= 3)
        })
        .await;
    let reached = telemetry_step(&before, 1).expect("step");

    ns.apply_job(&queued(&tiny("high", 4), &queue.local, Some(&high)))
        .await;
    let preempted = ns
        .wait_job("low", "attempt 1 ended as disrupted", RUN, |j| {
            j.status.as_ref().is_some_and(|s| {
                s.attempts
                    .first()
                    .is_some_and(|a| a.outcome == AttemptOutcome::Disrupted)
            })
        })
        .await;
    let first = &preempted.status.expect("status").attempts[0];
    assert_eq!(first.reason.as_deref(), Some("StoppedByKueue"), "{first:?}");

    let high_done = ns.wait_succeeded("high", RUN).await;
    assert_eq!(high_done.attempts.len(), 1, "{high_done:?}");
    let low_done = ns.wait_succeeded("low", RUN).await;
    assert_eq!(low_done.attempts.len(), 2, "{low_done:?}");
    assert_eq!(low_done.attempts[1].last_step, Some(12));
    let resumed = ns.resumed_step().await;
    let resumed = resumed.unwrap_or_else(|| panic!("no worker log says it resumed"));
    assert!(
        resumed >= reached.saturating_sub(2) && resumed < 12,
        "resumed at step {resumed}; attempt 1 had reached step {reached}"
    );
    ns.delete_kueue_objects(&queue, &[low, high]).await;
    ns.cleanup().await;
}

/// A retry that needs more quota waits for it: the queue holds two workers
/// of 350Mi/300m; a long job holds one; samples/cpu-pipeline-retry.yaml
/// runs its pinned single stage in the other, is OOM-killed, and is
/// replanned as two stages (no more than the queue holds), which Kueue
/// admits only once the long job has ended.
#[tokio::test]
#[ignore = "needs a cluster with Headroom and Kueue installed: make e2e"]
async fn an_oom_retry_that_needs_more_quota_waits_for_it() {
    let ns = TestNs::new(E2E, "e2e-kueue-retry").await;
    ns.opt_into_kueue().await;
    let queue = ns
        .kueue_queue(&QueueSpec::one(&[("cpu", "600m"), ("memory", "700Mi")]))
        .await;
    let holder = tiny("holder", 16)
        .replace("memoryLimit: 1Gi", "memoryLimit: 350Mi")
        .replace("cores: 500m", "cores: 300m");
    ns.apply_job(&queued(&holder, &queue.local, None)).await;
    ns.wait_job("holder", "Running", RUN, |j| {
        phase(j) == Some(JobPhase::Running)
    })
    .await;
    assert!(PIPELINE_RETRY.contains("memoryLimit: 350Mi, maxWorkers: 3, cores: 300m"));
    ns.apply_job(&queued(PIPELINE_RETRY, &queue.local, None))
        .await;
    let queued_retry = ns
        .wait_job("oom-then-split", "attempt 2 queued, or ended", RUN, |j| {
            let queued = condition(j, "Waiting").is_some_and(|c| {
                c.status == "True" && c.reason == "Queued" && c.message.starts_with("attempt 2 ")
            });
            queued || headroom_e2e::ended(j)
        })
        .await;
    let holder_now = ns.jobs().get("holder").await.expect("holder");
    assert!(
        condition(&queued_retry, "Waiting").is_some_and(|c| c.reason == "Queued")
            || phase(&holder_now) != Some(JobPhase::Running),
        "the two-stage retry ran while the holder held half the quota: {:?}",
        queued_retry.status
    );
    let holder_done = ns.wait_succeeded("holder", RUN).await;
    let split = ns.wait_succeeded("oom-then-split", RUN).await;
    assert_eq!(split.attempts[0].outcome, AttemptOutcome::HostOutOfMemory);
    let last = split.attempts.last().expect("attempts");
    assert_eq!(last.workers, 2, "as many stages as the queue holds");
    assert_eq!(holder_done.attempts.len(), 1);
    ns.delete_kueue_objects(&queue, &[]).await;
    ns.cleanup().await;
}
