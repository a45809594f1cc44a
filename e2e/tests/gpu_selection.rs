//! GPU-type selection on real nodes, without a GPU: the real node is labelled
//! the way GPU Feature Discovery labels an A100 node and advertises one
//! `nvidia.com/gpu` as an extended resource (PATCH of the node's status, the
//! documented way); a second, fake Node object offers four Tesla T4s. A job
//! whose budget needs more than a T4 must be planned on the A100 and its pod
//! bound to the real node; a small job limited to T4s must be planned there.
//!
//! The worker image is CPU-only, so the A100 pod exits 78 (invalid plan: no
//! `cuda` feature) and the job fails; this test is about planning and
//! placement. It mutates cluster-wide objects (the node, a fake node), so it
//! is a test binary of its own: cargo runs test binaries one after another,
//! so nothing else in the suite runs beside it. The labels, resources and the
//! fake node are removed afterwards, also when an assertion fails.

use std::time::Duration;

use headroom_e2e::cluster::{node_ready, schedulable_nodes};
use headroom_e2e::fixtures::{GPU_FITS_A_T4 as FITS_A_T4, GPU_NEEDS_A100 as NEEDS_A100};
use headroom_e2e::gfd::{job_failed, label_gpu, plan_device, unlabel_gpu};
use headroom_e2e::namespace::unique_name;
use headroom_e2e::{E2E, TestNs, pod_phase};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;

/// Label and taint of the fake node: the taint keeps every pod off it (it has
/// no kubelet), the label finds leftovers of an interrupted run.
const FAKE_MARK: &str = "headroom.dev/e2e-fake-node";
const BIG_GPU: &str = "NVIDIA-A100-SXM4-80GB";
const SMALL_GPU: &str = "Tesla-T4";

/// The same job without the toleration: the only T4s are on a node its
/// pods may not use, so there is no plan (rather than a pod that never schedules).
const T4_NOT_TOLERATED: &str = r#"
apiVersion: headroom.dev/v1alpha1
kind: MemoryAwareTrainingJob
metadata:
  name: t4-not-tolerated
spec:
  model:
    transformer: {layers: 4, hidden: 256, heads: 4, sequenceLength: 128, vocabulary: 4096}
  training: {globalBatch: 32, steps: 10}
  resources:
    gpu: {types: [Tesla-T4], maxGpus: 1, hostMemory: 256Mi}
  memoryPolicy: {maxAttempts: 1}
  worker: {image: localhost/headroom-worker:dev, backend: cuda}
"#;

/// A fresh name per run: the node lifecycle controller keeps health data by
/// node name, and a node re-created under a name it still remembers is
/// marked Unknown at once.
fn fake_node_name() -> String {
    unique_name("headroom-e2e-fake-t4")
}

fn is_fake(node: &Node) -> bool {
    node.labels().contains_key(FAKE_MARK)
}

/// The node the pods really run on: `$HEADROOM_E2E_NODE`, else the first
/// Ready node by name that pods may schedule to.
async fn real_node(nodes: &Api<Node>) -> String {
    if let Ok(name) = std::env::var("HEADROOM_E2E_NODE") {
        return name;
    }
    schedulable_nodes(nodes)
        .await
        .into_iter()
        .find(|n| !is_fake(n))
        .map(|n| n.name_any())
        .expect("a Ready node without NoSchedule taints")
}

/// Labels and advertises the real node as one A100, and creates the fake T4 node.
async fn set_up(nodes: &Api<Node>, node: &str, fake_node: &str) {
    label_gpu(nodes, node, BIG_GPU, 81920).await;

    // A node object without a kubelet: Ready as created (node status may be
    // set on create), with a heartbeat of now, so the operator counts its GPUs
    // as free until the node lifecycle controller's grace period
    // (--node-monitor-grace-period: 2 min on the local cluster, 40-50 s by
    // default) marks it Unknown.
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    let fake: Node = serde_json::from_value(json!({
        "metadata": {"name": fake_node, "labels": {
            FAKE_MARK: "true",
            "nvidia.com/gpu.product": SMALL_GPU,
            "nvidia.com/gpu.memory": "15360",
            "nvidia.com/gpu.count": "4",
        }},
        "spec": {"taints": [{"key": FAKE_MARK, "value": "true", "effect": "NoSchedule"}]},
        "status": {
            "capacity": {"nvidia.com/gpu": "4", "cpu": "8", "memory": "32Gi", "pods": "110"},
            "allocatable": {"nvidia.com/gpu": "4", "cpu": "8", "memory": "32Gi", "pods": "110"},
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                            "lastHeartbeatTime": now, "lastTransitionTime": now,
                            "message": "fake node of the headroom e2e suite"}],
        },
    }))
    .expect("fake node");
    let created = nodes
        .create(&PostParams::default(), &fake)
        .await
        .expect("create the fake node");
    if !node_ready(&created) {
        // In case this API server drops status on create.
        nodes
            .patch_status(
                fake_node,
                &PatchParams::default(),
                &Patch::Merge(json!({"status": fake.status})),
            )
            .await
            .expect("fake node status");
    }
}

/// Undoes [`set_up`]; safe to run when nothing (or only part) was set up.
async fn tear_down(nodes: &Api<Node>, node: &str) -> Vec<String> {
    let mut problems = unlabel_gpu(nodes, node).await;
    if let Err(e) = nodes
        .delete_collection(
            &DeleteParams::default(),
            &ListParams::default().labels(FAKE_MARK),
        )
        .await
    {
        problems.push(format!("delete the nodes labelled {FAKE_MARK}: {e}"));
    }
    problems
}

async fn worker_pod(ns: &TestNs, job: &str) -> Pod {
    let name = format!("{job}-a1-s0");
    ns.wait_for(&format!("pod {name}"), Duration::from_secs(120), || async {
        ns.pods().get_opt(&name).await.ok().flatten()
    })
    .await
}

fn selector_and_gpus(pod: &Pod) -> (Option<String>, Option<String>, Vec<String>) {
    let spec = pod.spec.as_ref().expect("pod spec");
    let product = spec
        .node_selector
        .as_ref()
        .and_then(|s| s.get("nvidia.com/gpu.product").cloned());
    let gpus = spec.containers[0]
        .resources
        .as_ref()
        .and_then(|r| r.limits.as_ref())
        .and_then(|l| l.get("nvidia.com/gpu"))
        .map(|q| q.0.clone());
    let tolerations = spec
        .tolerations
        .iter()
        .flatten()
        .filter_map(|t| t.key.clone())
        .collect();
    (product, gpus, tolerations)
}

/// Ready, and the node lifecycle controller has lifted the not-ready taint
/// every new node gets (TaintNodesByCondition): until then no pod may go
/// there, so the planner does not count its GPUs either.
async fn fake_node_ready(ns: &TestNs, fake_node: &str) -> bool {
    Api::<Node>::all(ns.client.clone())
        .get(fake_node)
        .await
        .is_ok_and(|n| {
            let not_ready_taint = n
                .spec
                .as_ref()
                .and_then(|s| s.taints.as_ref())
                .is_some_and(|t| t.iter().any(|t| t.key == "node.kubernetes.io/not-ready"));
            node_ready(&n) && !not_ready_taint
        })
}

async fn the_test(ns: TestNs, node: String, fake_node: String) {
    // The jobs are planned against the labelled cluster.
    ns.wait_for(
        "the fake node Ready without the not-ready taint",
        Duration::from_secs(60),
        || async { fake_node_ready(&ns, &fake_node).await.then_some(()) },
    )
    .await;
    // The operator plans from its node cache: let the watch deliver the change.
    tokio::time::sleep(Duration::from_secs(1)).await;
    ns.apply_job(NEEDS_A100).await;
    ns.apply_job(FITS_A_T4).await;
    ns.apply_job(T4_NOT_TOLERATED).await;
    the_a100_job_is_planned_and_bound_to_the_a100_node(&ns, &node).await;
    the_t4_job_is_planned_on_the_fake_nodes_t4s(&ns).await;
    the_untolerated_t4s_are_not_planned(&ns, &fake_node).await;
}

/// The 51 GiB job is planned on the A100, its pod bound to the real node,
/// and the CPU-only worker image refuses its CUDA plan.
async fn the_a100_job_is_planned_and_bound_to_the_a100_node(ns: &TestNs, node: &str) {
    let big = ns
        .wait_job("needs-a100", "a plan", Duration::from_secs(60), |j| {
            plan_device(j).is_some() || job_failed(j)
        })
        .await;
    assert_eq!(
        plan_device(&big).as_deref(),
        Some(BIG_GPU),
        "the 51 GiB job must be planned on the A100: {:?}",
        big.status.as_ref().map(|s| (&s.message, &s.plan))
    );
    let plan = big
        .status
        .as_ref()
        .and_then(|s| s.plan.clone())
        .expect("plan");
    assert_eq!(
        plan.workers, 1,
        "one A100 is fewer devices than several T4s"
    );
    assert_eq!(plan.resource, "nvidia.com/gpu");

    // Its pod selects the A100 product, requests one GPU and is bound to the real node.
    let pod = worker_pod(ns, "needs-a100").await;
    let (product, gpus, tolerations) = selector_and_gpus(&pod);
    assert_eq!(product.as_deref(), Some(BIG_GPU));
    assert_eq!(gpus.as_deref(), Some("1"));
    assert!(tolerations.contains(&"nvidia.com/gpu".to_string()));
    let bound = ns
        .wait_for(
            "needs-a100-a1-s0 bound to a node",
            Duration::from_secs(120),
            || async {
                ns.pods()
                    .get("needs-a100-a1-s0")
                    .await
                    .ok()
                    .and_then(|p| p.spec.and_then(|s| s.node_name))
            },
        )
        .await;
    assert_eq!(bound, node, "the A100 pod runs on the node labelled A100");

    // The CPU-only worker image refuses a CUDA plan (exit 78): not retried.
    let refused_plan = ns
        .wait_job("needs-a100", "Failed", Duration::from_secs(180), job_failed)
        .await;
    let attempt = &refused_plan.status.expect("status").attempts[0];
    assert_eq!(
        attempt.reason.as_deref(),
        Some("InvalidPlan"),
        "{:?}",
        attempt.message
    );
}

async fn the_t4_job_is_planned_on_the_fake_nodes_t4s(ns: &TestNs) {
    // The small job limited to T4s is planned on the fake node's T4s; its pod
    // selects them (and stays Pending: nothing runs on the fake node).
    let small = ns
        .wait_job("fits-a-t4", "a plan", Duration::from_secs(60), |j| {
            plan_device(j).is_some() || job_failed(j)
        })
        .await;
    assert_eq!(
        plan_device(&small).as_deref(),
        Some(SMALL_GPU),
        "the small job must be planned on the fake node's T4s: {:?}",
        small.status.as_ref().map(|s| &s.message)
    );
    let pod = worker_pod(ns, "fits-a-t4").await;
    let (product, gpus, _) = selector_and_gpus(&pod);
    assert_eq!(product.as_deref(), Some(SMALL_GPU));
    assert_eq!(gpus.as_deref(), Some("1"));
    let pod = ns.pods().get("fits-a-t4-a1-s0").await.expect("pod");
    assert_eq!(pod_phase(&pod), "Pending", "nothing runs on the fake node");
    let tolerated: Vec<String> = pod
        .spec
        .and_then(|s| s.tolerations)
        .unwrap_or_default()
        .into_iter()
        .filter_map(|t| t.key)
        .collect();
    assert!(tolerated.contains(&FAKE_MARK.to_string()), "{tolerated:?}");
}

async fn the_untolerated_t4s_are_not_planned(ns: &TestNs, fake_node: &str) {
    // Without the toleration the fake node's T4s are not the job's to plan.
    let refused = ns
        .wait_job(
            "t4-not-tolerated",
            "Failed",
            Duration::from_secs(60),
            job_failed,
        )
        .await;
    let status = refused.status.expect("status");
    assert!(
        status.attempts.is_empty(),
        "no attempt, no pod: {:?}",
        status.attempts
    );
    assert!(
        status.message.as_deref().is_some_and(|m| m
            .contains("no node this job's pods may use offers the allowed GPU types [Tesla-T4]")
            && m.contains(&format!(
                "{fake_node} (taint {FAKE_MARK}=true:NoSchedule not tolerated)"
            ))),
        "{:?}",
        status.message
    );
}

#[tokio::test]
#[ignore = "needs a cluster with Headroom installed: make e2e"]
async fn gfd_labelled_nodes_get_the_pods_of_the_jobs_that_need_them() {
    let client = Client::try_default().await.expect("KUBECONFIG");
    let nodes: Api<Node> = Api::all(client);
    let node = real_node(&nodes).await;
    let fake_node = fake_node_name();
    // Leftovers of an interrupted run would skew the inventory.
    let _ = tear_down(&nodes, &node).await;
    set_up(&nodes, &node, &fake_node).await;
    // The operator plans from its node cache: let the watch deliver the changes.
    tokio::time::sleep(Duration::from_secs(2)).await;

    let ns = TestNs::new(E2E, "e2e-gpu").await;
    let outcome = tokio::spawn(the_test(ns.clone(), node.clone(), fake_node)).await;
    // Jobs first, then the node (a pod bound to the fake node, which has no
    // kubelet to confirm its deletion, is then removed by the pod GC).
    let _ = ns
        .jobs()
        .delete_collection(&DeleteParams::default(), &ListParams::default())
        .await;
    let problems = tear_down(&nodes, &node).await;
    if let Err(e) = outcome {
        std::panic::resume_unwind(e.into_panic());
    }
    assert!(problems.is_empty(), "cleanup: {problems:?}");
    ns.cleanup().await;
}
