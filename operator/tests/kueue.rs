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
use std::collections::BTreeMap;

use headroom_e2e::kueue::{FlavorSpec, QueueSpec, queued};
use headroom_e2e::{attempts, phase};
use headroom_operator::controller::ControllerConfig;
use kube::ResourceExt;
use support::*;

#[tokio::test]
#[ignore = "needs the control plane: make test-apiserver"]
async fn a_queued_job_plans_within_its_quota_and_its_workers_form_a_pod_group() {
    let ns = test_ns("hr-kueue").await;
    // Room for one 1 GiB worker of cpu-tiny, not for a 4 GiB one.
    let queue = ns
        .kueue_queue(&QueueSpec::one(&[("cpu", "2"), ("memory", "1536Mi")]))
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
            queue.flavors[0], queue.local, queue.cluster
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

/// The queue offers one GPU type of the cluster's two: a job that could use
/// either is planned on the queue's (where, without a queue, the planner
/// picks the larger GPU for this sequence length), and its pod is placed on
/// that type; a job only the other type can hold is refused, naming the
/// nodes no flavor of the queue stands for.
#[tokio::test]
#[ignore = "needs the control plane: make test-apiserver"]
async fn a_queued_gpu_job_plans_only_on_its_queues_flavors() {
    let ns = test_ns("hr-kueue-gpu").await;
    let mut nodes = GpuNodes::new(&ns);
    let (mid, big) = (nodes.product("Mid"), nodes.product("Big"));
    nodes.add("mid", &mid, 40960).await;
    let big_node = nodes.add("big", &big, 81920).await;
    let queue = ns
        .kueue_queue(&QueueSpec {
            flavors: vec![FlavorSpec {
                suffix: "mid",
                node_labels: BTreeMap::from([("nvidia.com/gpu.product".into(), mid.clone())]),
                quota: &[("nvidia.com/gpu", "1"), ("cpu", "8"), ("memory", "64Gi")],
            }],
            ..QueueSpec::default()
        })
        .await;
    let op = start_operator(&ns, ControllerConfig::default());

    let either = gpu_job_with_sequence("in-queue", &[&mid, &big], 1, "", 4096);
    ns.apply_job(&queued(&either, &queue.local, None)).await;
    let job = ns
        .wait_job("in-queue", "attempt 1", TIMEOUT, |j| attempts(j) == 1)
        .await;
    let plan = job.status.expect("status").plan.expect("plan");
    assert_eq!(plan.device, mid, "the queue's only GPU type");
    let pods = ns.wait_pods("GPU pod", TIMEOUT, |p| p.len() == 1).await;
    let selector = pods[0]
        .spec
        .clone()
        .and_then(|s| s.node_selector)
        .unwrap_or_default();
    assert_eq!(selector["nvidia.com/gpu.product"], mid);

    ns.apply_job(&queued(
        &gpu_job("big-only", &[&big], 1, ""),
        &queue.local,
        None,
    ))
    .await;
    let refused = ns
        .wait_job("big-only", "phase Failed", TIMEOUT, |j| {
            phase(j) == Some(JobPhase::Failed)
        })
        .await;
    let message = refused.status.and_then(|s| s.message).unwrap_or_default();
    assert!(
        message.contains(&format!(
            "{big_node} (no flavor of LocalQueue {} (ClusterQueue {}) matches its labels)",
            queue.local, queue.cluster
        )),
        "{message}"
    );
    op.stop().await;
    ns.delete_kueue_objects(&queue, &[]).await;
    nodes.remove().await;
    ns.cleanup().await;
}
