//! Kueue against a real kube-apiserver (Kueue's CRDs installed by `make
//! test-apiserver`; no Kueue controller runs there): a job that names a
//! LocalQueue plans within its ClusterQueue's quota, is refused with the
//! figures when the quota can never hold one worker, and its workers form
//! one Kueue pod group per attempt. Admission, gating and preemption by a
//! running Kueue are the e2e suite's (e2e/tests/kueue.rs).
//!
//! Ignored by plain `cargo test`; run by `make test-apiserver`.

mod support;

use headroom_api::JobPhase;
use headroom_e2e::kueue::{QueueSpec, queued};
use headroom_e2e::phase;
use headroom_operator::controller::ControllerConfig;
use kube::ResourceExt;
use support::*;

#[tokio::test]
#[ignore = "needs the control plane: make test-apiserver"]
async fn a_queued_job_plans_within_its_quota_and_its_workers_form_a_pod_group() {
    let ns = test_ns("hr-kueue").await;
    // Room for one 1 GiB worker of cpu-tiny, not for a 4 GiB one.
    let queue = ns
        .kueue_queue(&QueueSpec {
            quota: &[("cpu", "2"), ("memory", "1536Mi")],
            ..QueueSpec::default()
        })
        .await;
    let op = start_operator(&ns, ControllerConfig::default());

    assert!(CPU_TINY.contains("memoryLimit: 1Gi"), "the sample changed");
    let big = queued(
        &CPU_TINY
            .replace("name: tiny-cpu", "name: too-big")
            .replace("memoryLimit: 1Gi", "memoryLimit: 4Gi"),
        &queue.local,
        None,
    );
    ns.apply_job(&big).await;
    let refused = ns
        .wait_job("too-big", "phase Failed", TIMEOUT, |j| {
            phase(j) == Some(JobPhase::Failed)
        })
        .await;
    let message = refused.status.and_then(|s| s.message).unwrap_or_default();
    assert!(
        message.contains(&format!(
            "flavor {} of LocalQueue {} (ClusterQueue {}) has memory quota 1.5 GiB, one worker needs 4.0 GiB",
            queue.flavor, queue.local, queue.cluster
        )),
        "{message}"
    );

    ns.apply_job(&queued(CPU_TINY, &queue.local, Some("high")))
        .await;
    let pods = ns
        .wait_pods("the worker pod", TIMEOUT, |p| p.len() == 1)
        .await;
    let pod = &pods[0];
    let job = ns.jobs().get("tiny-cpu").await.expect("job");
    let uid = job.uid().unwrap_or_default();
    let group = format!("tiny-cpu-{}-a1", &uid[..5]);
    let labels = pod.labels();
    assert_eq!(labels["kueue.x-k8s.io/queue-name"], queue.local);
    assert_eq!(labels["kueue.x-k8s.io/pod-group-name"], group);
    assert_eq!(labels["kueue.x-k8s.io/priority-class"], "high");
    let annotations = pod.annotations();
    assert_eq!(annotations["kueue.x-k8s.io/pod-group-total-count"], "1");
    assert_eq!(annotations["kueue.x-k8s.io/retriable-in-group"], "false");

    op.stop().await;
    ns.delete_kueue_objects(&queue, &[]).await;
    ns.cleanup().await;
}
