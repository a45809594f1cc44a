//! The controller against a real kube-apiserver: pods appear with the planned
//! spec, simulated terminations (pod status written as a kubelet would) drive
//! the retry ladder, history survives restarts, and nothing is duplicated.
//!
//! Ignored by plain `cargo test`; run by `make test-apiserver`.

mod support;

use std::time::Duration;

use headroom_api::{AttemptOutcome, JobPhase, LABEL_ATTEMPT, MemoryAwareTrainingJob};
use headroom_e2e::{attempts, phase};
use headroom_operator::controller::ControllerConfig;
use k8s_openapi::api::core::v1::{Pod, ServiceAccount};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::ResourceExt;
use kube::api::Api;
use support::*;

#[tokio::test]
#[ignore = "needs the control plane: make test-apiserver"]
async fn apply_plans_and_creates_the_workers_children() {
    let ns = test_ns("hr-apply").await;
    let op = start_operator(&ns, ControllerConfig::default());
    ns.apply_job(CPU_TINY).await;
    let job = ns.wait_attempts("tiny-cpu", 1).await;
    let status = job.status.clone().expect("status");
    let plan = status.plan.clone().expect("plan in status");
    assert_eq!(
        (plan.device.as_str(), plan.workers, plan.global_batch),
        ("cpu", 1, 32)
    );
    assert!(plan.fits(), "{}", plan.fit);
    assert_eq!(status.observed_generation, job.metadata.generation);

    let pod = ns.wait_pod_count("the worker pod", 1).await.remove(0);
    assert_eq!(pod.name_any(), "tiny-cpu-a1-s0");
    assert_eq!(pod.owner_references()[0].uid, job.uid().expect("uid"));
    assert_eq!(limits_of(&pod)["memory"].0, (1u64 << 30).to_string());
    let spec = pod.spec.as_ref().expect("spec");
    assert_eq!(
        spec.containers[0]
            .security_context
            .as_ref()
            .and_then(|s| s.run_as_non_root),
        Some(true)
    );
    assert_the_worker_has_no_api_rights(&ns, &pod).await;
    assert!(
        ns.claims()
            .get_opt("tiny-cpu-checkpoints")
            .await
            .expect("get")
            .is_some()
    );

    ns.set_pod_status("tiny-cpu-a1-s0", running()).await;
    ns.wait_phase("tiny-cpu", JobPhase::Running).await;
    ns.set_pod_status("tiny-cpu-a1-s0", terminated(0, "Completed", None))
        .await;
    let done = ns.wait_phase("tiny-cpu", JobPhase::Succeeded).await;
    assert_eq!(
        status_of(done).attempts[0].outcome,
        AttemptOutcome::Succeeded
    );
    op.stop().await;
    ns.cleanup().await;
}

/// No API rights for the worker: the namespace's default account, no API
/// token mounted, and no Role or binding of the job's.
async fn assert_the_worker_has_no_api_rights(ns: &TestNs, pod: &Pod) {
    let spec = pod.spec.as_ref().expect("spec");
    assert_eq!(spec.service_account_name.as_deref(), Some("default"));
    assert_eq!(spec.automount_service_account_token, Some(false));
    let role: Api<Role> = Api::namespaced(ns.client.clone(), &ns.name);
    let rb: Api<RoleBinding> = Api::namespaced(ns.client.clone(), &ns.name);
    let none = kube::api::ListParams::default();
    assert!(role.list(&none).await.expect("roles").items.is_empty());
    assert!(rb.list(&none).await.expect("bindings").items.is_empty());
}

#[tokio::test]
#[ignore = "needs the control plane: make test-apiserver"]
async fn oom_kill_retries_with_stricter_settings_and_keeps_history() {
    let ns = test_ns("hr-oom").await;
    let op = start_operator(&ns, ControllerConfig::default());
    ns.apply_job(CPU_OOM_FIRST).await;
    ns.wait_attempt_pod(1).await;
    ns.set_pod_status("oom-then-fit-a1-s0", oom_killed()).await;

    let status = status_of(ns.wait_attempts("oom-then-fit", 2).await);
    let (first, second) = (&status.attempts[0], &status.attempts[1]);
    assert_eq!(first.outcome, AttemptOutcome::HostOutOfMemory);
    assert_eq!(
        first.settings.micro_batch, 32,
        "attempt 1 ran the pinned settings"
    );
    assert!(!first.settings.activation_checkpointing);
    // Stricter: checkpointing (the ladder's first rung here; a smaller
    // micro-batch only if that alone were predicted not to fit).
    assert!(second.settings.activation_checkpointing);
    assert!(second.settings.micro_batch <= 32);
    assert!(
        second.predicted_peak_bytes < first.predicted_peak_bytes,
        "{} then {}",
        first.predicted_peak_bytes,
        second.predicted_peak_bytes
    );
    // The whole plan is stored once, for the current attempt.
    let plan = status.plan.as_ref().expect("status.plan");
    assert_eq!(plan.settings, second.settings);
    assert_eq!(plan.global_batch, 32, "the global batch is preserved");
    assert!(plan.fits());
    assert_eq!(status.phase, Some(JobPhase::Retrying));

    let pods = ns.wait_attempt_pod(2).await;
    assert_eq!(
        pods_of_attempt(&pods, 1),
        1,
        "the failed pod is kept for its logs"
    );

    // A device OOM with a termination message on attempt 2: its peak is recorded.
    let msg = r#"{"outcome":"deviceOutOfMemory","reason":"allocation of 512 MiB failed","step":40,"peakBytes":300000000}"#;
    ns.set_pod_status("oom-then-fit-a2-s0", terminated(88, "Error", Some(msg)))
        .await;
    let status = status_of(ns.wait_attempts("oom-then-fit", 3).await);
    let second = &status.attempts[1];
    assert_eq!(second.outcome, AttemptOutcome::DeviceOutOfMemory);
    assert_eq!(
        (second.observed_peak_bytes, second.last_step),
        (Some(300_000_000), Some(40))
    );
    assert_eq!(status.attempts[2].settings.global_batch(), 32);
    assert_eq!(
        status.attempts[0].outcome,
        AttemptOutcome::HostOutOfMemory,
        "history intact"
    );

    // The status names attempt 3 before its pod exists (status is written first).
    ns.wait_attempt_pod(3).await;
    ns.set_pod_status("oom-then-fit-a3-s0", terminated(0, "Completed", None))
        .await;
    let job = ns.wait_phase("oom-then-fit", JobPhase::Succeeded).await;
    assert_eq!(attempts(&job), 3);
    assert!(
        op.metrics
            .encode()
            .contains("headroom_attempts_ended_total{outcome=\"HostOutOfMemory\"} 1")
    );
    op.stop().await;
    ns.cleanup().await;
}

#[tokio::test]
#[ignore = "needs the control plane: make test-apiserver"]
async fn eviction_retries_the_same_settings() {
    let ns = test_ns("hr-evict").await;
    let op = start_operator(&ns, ControllerConfig::default());
    let manifest = CPU_TINY.replace(
        "  worker:",
        "  memoryPolicy: {backoffSeconds: 0}\n  worker:",
    );
    ns.apply_job(&manifest).await;
    ns.wait_pod_count("attempt 1 pod", 1).await;
    ns.set_pod_status("tiny-cpu-a1-s0", serde_json::json!({"phase": "Failed", "reason": "Evicted", "message": "The node was low on resource: memory."})).await;
    let status = status_of(ns.wait_attempts("tiny-cpu", 2).await);
    assert_eq!(status.attempts[0].outcome, AttemptOutcome::Disrupted);
    assert_eq!(
        status.attempts[1].settings, status.attempts[0].settings,
        "no stricter settings for a disruption"
    );
    op.stop().await;
    ns.cleanup().await;
}

#[tokio::test]
#[ignore = "needs the control plane: make test-apiserver"]
async fn restarts_and_a_second_replica_never_duplicate_pods_or_lose_history() {
    let ns = test_ns("hr-restart").await;
    let first = start_operator(&ns, ControllerConfig::default());
    ns.apply_job(CPU_OOM_FIRST).await;
    ns.wait_pod_count("attempt 1 pod", 1).await;
    first.stop().await;

    // Two replicas at once (as during a rollout without leader election).
    let a = start_operator(&ns, ControllerConfig::default());
    let b = start_operator(&ns, ControllerConfig::default());
    tokio::time::sleep(Duration::from_secs(2)).await;
    let job = ns.wait_attempts("oom-then-fit", 1).await;
    assert_eq!(attempts(&job), 1);
    assert_eq!(ns.pod_list().await.len(), 1);

    ns.set_pod_status("oom-then-fit-a1-s0", oom_killed()).await;
    ns.wait_attempts("oom-then-fit", 2).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let job = ns
        .wait_job("oom-then-fit", "still two attempts", TIMEOUT, |_| true)
        .await;
    assert_eq!(attempts(&job), 2, "the OOM was handled exactly once");
    let pods = ns.pod_list().await;
    assert_eq!(
        (pods_of_attempt(&pods, 1), pods_of_attempt(&pods, 2)),
        (1, 1)
    );
    a.stop().await;

    // A restart while attempt 2 runs keeps everything.
    let c = start_operator(&ns, ControllerConfig::default());
    tokio::time::sleep(Duration::from_secs(1)).await;
    let job = ns
        .wait_job("oom-then-fit", "history", TIMEOUT, |_| true)
        .await;
    assert_eq!(attempts(&job), 2);
    assert_eq!(
        status_of(job).attempts[0].outcome,
        AttemptOutcome::HostOutOfMemory
    );
    assert_eq!(ns.pod_list().await.len(), 2);
    b.stop().await;
    c.stop().await;
    ns.cleanup().await;
}

#[tokio::test]
#[ignore = "needs the control plane: make test-apiserver"]
async fn infeasible_job_fails_without_pods() {
    let ns = test_ns("hr-nofit").await;
    let op = start_operator(&ns, ControllerConfig::default());
    let manifest = CPU_TINY.replace("memoryLimit: 1Gi", "memoryLimit: 64Mi");
    ns.apply_job(&manifest).await;
    let status = status_of(ns.wait_phase("tiny-cpu", JobPhase::Failed).await);
    let message = status.message.clone().expect("message");
    assert!(
        message.contains("no feasible plan") && message.contains("budget"),
        "{message}"
    );
    assert!(has_condition(&status, "Planned", "False", "NoFeasiblePlan"));
    ns.assert_no_pods_yet().await;
    op.stop().await;
    ns.cleanup().await;
}

/// A job that names no worker image: an operator without a default for its
/// backend fails it at once with a spec error naming the field, and starts no
/// pod; one with a default runs that image.
#[tokio::test]
#[ignore = "needs the control plane: make test-apiserver"]
async fn a_job_without_an_image_runs_the_default_or_fails_naming_the_field() {
    use headroom_operator::controller::{ChildConfig, WorkerImages};
    let ns = test_ns("hr-noimage").await;
    let manifest = CPU_TINY.replace(
        "  worker:\n    image: localhost/headroom-worker:dev\n",
        "  worker: {}\n",
    );
    assert_ne!(manifest, CPU_TINY, "the premise: the sample names an image");

    let op = start_operator(&ns, ControllerConfig::default());
    ns.apply_job(&manifest).await;
    let status = status_of(ns.wait_phase("tiny-cpu", JobPhase::Failed).await);
    assert_eq!(
        status.message.as_deref(),
        Some(
            "spec.worker.image: required: this operator has no default image for backend flex (install the chart with workerImages.cpu, which sets --worker-image, or set spec.worker.image)"
        )
    );
    assert!(
        has_condition(&status, "Failed", "True", "InvalidSpec"),
        "{:?}",
        status.conditions
    );
    ns.assert_no_pods_yet().await;
    op.stop().await;

    let op = start_operator(
        &ns,
        ControllerConfig {
            children: ChildConfig {
                worker_images: WorkerImages {
                    flex: Some("registry.example/headroom-worker:9".into()),
                    cuda: None,
                },
                ..ChildConfig::default()
            },
            ..ControllerConfig::default()
        },
    );
    ns.apply_job(&manifest.replace("name: tiny-cpu", "name: tiny-default"))
        .await;
    let pod = ns.wait_pod_named("tiny-default-a1-s0").await;
    assert_eq!(
        pod.spec.as_ref().expect("spec").containers[0]
            .image
            .as_deref(),
        Some("registry.example/headroom-worker:9")
    );
    op.stop().await;
    ns.cleanup().await;
}

#[tokio::test]
#[ignore = "needs the control plane: make test-apiserver"]
async fn deleting_a_job_garbage_collects_everything_it_created() {
    let ns = test_ns("hr-gc").await;
    let op = start_operator(&ns, ControllerConfig::default());
    ns.apply_job(CPU_TINY).await;
    ns.wait_pod_count("the worker pod", 1).await;
    ns.jobs()
        .delete("tiny-cpu", &kube::api::DeleteParams::foreground())
        .await
        .expect("delete job");
    // The garbage collector (kube-controller-manager) follows the owner references.
    ns.wait_pod_count("pods collected", 0).await;
    let pvc = ns.claims();
    let last = std::cell::Cell::new(None);
    ns.wait_for("the job's claim collected", TIMEOUT, || async {
        let left = [
            pvc.get_opt("tiny-cpu-checkpoints")
                .await
                .ok()?
                .is_some_and(|p| p.metadata.deletion_timestamp.is_none()),
            ns.jobs().get_opt("tiny-cpu").await.ok()?.is_some(),
        ];
        if last.replace(Some(left)) != Some(left) {
            eprintln!("left behind [pvc, job]: {left:?}");
        }
        left.iter().all(|l| !l).then_some(())
    })
    .await;
    op.stop().await;
    ns.cleanup().await;
}

/// What a job trained outlives it: once it succeeds, its checkpoint claim
/// is no longer owned by it (`RetainOnSuccess`, the default), so deleting the
/// job leaves the claim; a new job of the same name does not resume from
/// that claim (it waits, saying why) until the user deletes it.
#[tokio::test]
#[ignore = "needs the control plane: make test-apiserver"]
async fn a_succeeded_jobs_checkpoints_outlive_it() {
    let ns = test_ns("hr-keep").await;
    let op = start_operator(&ns, ControllerConfig::default());
    ns.apply_job(CPU_TINY).await;
    ns.wait_pod_count("the worker pod", 1).await;
    ns.set_pod_status("tiny-cpu-a1-s0", terminated(0, "Completed", None))
        .await;
    let message = message_of(ns.wait_phase("tiny-cpu", JobPhase::Succeeded).await);
    assert!(message.contains("tiny-cpu-checkpoints"), "{message}");
    let claim = ns
        .claims()
        .get("tiny-cpu-checkpoints")
        .await
        .expect("claim");
    assert!(claim.owner_references().is_empty(), "{:?}", claim.metadata);
    assert_eq!(
        claim
            .labels()
            .get("headroom.dev/retained-from")
            .map(String::as_str),
        Some("tiny-cpu")
    );

    ns.jobs()
        .delete("tiny-cpu", &kube::api::DeleteParams::foreground())
        .await
        .expect("delete job");
    ns.wait_for("the job gone", TIMEOUT, || async {
        ns.jobs()
            .get_opt("tiny-cpu")
            .await
            .ok()?
            .is_none()
            .then_some(())
    })
    .await;
    // The garbage collector had its chance (the job is gone): the claim stays.
    let kept = ns
        .claims()
        .get_opt("tiny-cpu-checkpoints")
        .await
        .expect("get");
    assert!(
        kept.is_some_and(|c| c.metadata.deletion_timestamp.is_none()),
        "the trained checkpoints were deleted with the job"
    );

    // The same name again: not resumed from the old job's checkpoints.
    ns.apply_job(CPU_TINY).await;
    let waiting = ns
        .wait_condition("tiny-cpu", "waiting for the old claim", |c| {
            c.reason == "LaunchRefused" && c.message.contains("kubectl delete pvc")
        })
        .await;
    assert_ne!(phase(&waiting), Some(JobPhase::Failed));
    assert!(ns.pod_list().await.is_empty());
    ns.claims()
        .delete("tiny-cpu-checkpoints", &Default::default())
        .await
        .expect("delete the old claim");
    ns.wait_pods("the new job's worker", Duration::from_secs(60), |p| {
        p.len() == 1
    })
    .await;
    let fresh = ns
        .claims()
        .get("tiny-cpu-checkpoints")
        .await
        .expect("new claim");
    assert_eq!(
        fresh.owner_references()[0].uid,
        waiting.uid().expect("uid"),
        "the new claim belongs to the new job"
    );
    op.stop().await;
    ns.cleanup().await;
}

/// A busy cluster is waited out, a cluster too small is refused with numbers:
/// on one 2-CPU, 24 GiB node, a job asking 4 TiB per worker fails at planning
/// naming the node's size; a job that fits but whose pod the scheduler cannot
/// place yet (a full node) waits — condition, event — instead of failing.
#[tokio::test]
#[ignore = "needs the control plane: make test-apiserver"]
async fn a_busy_cluster_is_waited_out_and_a_small_one_refused_with_numbers() {
    let ns = test_ns("hr-wait").await;
    let node = SmallCpuNode::add(&ns).await;
    let op = start_operator(
        &ns,
        ControllerConfig {
            unschedulable_grace: Duration::from_secs(1),
            ..ControllerConfig::default()
        },
    );

    // Never fits: refused at planning, with the node's figures.
    assert!(CPU_TINY.contains("memoryLimit: 1Gi"), "the sample changed");
    let huge = CPU_TINY
        .replace("name: tiny-cpu", "name: huge")
        .replace("memoryLimit: 1Gi", "memoryLimit: 4Ti");
    ns.apply_job(&huge).await;
    let message = message_of(ns.wait_phase("huge", JobPhase::Failed).await);
    assert!(
        message.contains("can hold one of its workers") && message.contains("24.0 GiB"),
        "{message}"
    );

    // Fits, but the node is full: the scheduler leaves the pod pending.
    ns.apply_job(CPU_TINY).await;
    ns.wait_pod_count("the worker pod", 1).await;
    let pending = serde_json::json!({"phase": "Pending", "conditions": [{
        "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
        "message": "0/1 nodes are available: 1 Insufficient cpu.",
        "lastTransitionTime": "2026-01-01T00:00:00Z"}]});
    ns.set_pod_status("tiny-cpu-a1-s0", pending).await;
    let waiting = ns
        .wait_condition("tiny-cpu", "Waiting=True", |c| {
            c.type_ == "Waiting" && c.status == "True"
        })
        .await;
    let status = status_of(waiting);
    assert_eq!(status.phase, Some(JobPhase::Pending));
    assert_eq!(status.attempts.len(), 1, "no attempt is used up by waiting");
    let event = ns.wait_event("WaitingForCapacity").await;
    assert!(
        event.note.unwrap_or_default().contains("Insufficient cpu"),
        "the event says what it waits for"
    );
    // Still there, still waiting (not Failed) a while later.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let later = ns.jobs().get("tiny-cpu").await.expect("job");
    assert_eq!(phase(&later), Some(JobPhase::Pending));
    assert_eq!(ns.pod_list().await.len(), 1);
    op.stop().await;
    node.remove().await;
    ns.cleanup().await;
}

/// A fake, Ready, untainted node of 2 CPUs and 24 GiB (no kubelet behind it).
struct SmallCpuNode {
    nodes: Api<k8s_openapi::api::core::v1::Node>,
    name: String,
}

impl SmallCpuNode {
    async fn add(ns: &TestNs) -> Self {
        use k8s_openapi::api::core::v1::Node;
        let nodes: Api<Node> = Api::all(ns.client.clone());
        let name = format!("{}-small", ns.name);
        let node: Node = serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "labels": {"headroom.dev/test": "true"}}
        }))
        .expect("node");
        nodes
            .create(&kube::api::PostParams::default(), &node)
            .await
            .expect("node");
        nodes
            .patch(
                &name,
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(serde_json::json!({"spec": {"taints": null}})),
            )
            .await
            .expect("taints");
        nodes
            .patch_status(
                &name,
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(serde_json::json!({"status": {
                    "allocatable": {"cpu": "2", "memory": "24Gi", "pods": "110"},
                    "capacity": {"cpu": "2", "memory": "24Gi", "pods": "110"},
                    "conditions": [{"type": "Ready", "status": "True", "reason": "Test", "message": "fake node",
                                    "lastHeartbeatTime": "2026-01-01T00:00:00Z", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}})),
            )
            .await
            .expect("node status");
        SmallCpuNode { nodes, name }
    }

    async fn remove(self) {
        let _ = self.nodes.delete(&self.name, &Default::default()).await;
    }
}

#[tokio::test]
#[ignore = "needs the control plane: make test-apiserver"]
async fn gpu_type_is_chosen_by_budget_and_replanned_when_unschedulable() {
    let ns = test_ns("hr-gpu").await;
    let mut nodes = GpuNodes::new(&ns);
    let (small, mid, big) = (
        nodes.product("Small"),
        nodes.product("Mid"),
        nodes.product("Big"),
    );
    nodes.add("small", &small, 8192).await;
    nodes.add("mid", &mid, 40960).await;
    nodes.add("big", &big, 81920).await;
    let op = start_operator(
        &ns,
        ControllerConfig {
            unschedulable_grace: Duration::from_secs(1),
            ..ControllerConfig::default()
        },
    );

    ns.apply_job(&gpu_job("gpu-job", &[&small, &mid, &big], 1, ""))
        .await;
    let first = status_of(ns.wait_attempts("gpu-job", 1).await).attempts[0].clone();
    assert_ne!(first.device, small, "the small GPU cannot hold the model");
    let pod = ns.wait_pod_count("GPU pod", 1).await.remove(0);
    let spec = pod.spec.clone().expect("spec");
    assert_eq!(
        spec.node_selector.expect("selector")["nvidia.com/gpu.product"],
        first.device
    );
    assert_eq!(limits_of(&pod)["nvidia.com/gpu"].0, "1");

    // The scheduler cannot place it: after the grace period, another type is planned.
    let pending = serde_json::json!({"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
        "message": "0/3 nodes are available: 1 Insufficient nvidia.com/gpu.", "lastTransitionTime": "2026-01-01T00:00:00Z"}]});
    ns.set_pod_status(&pod.name_any(), pending).await;
    let status = status_of(ns.wait_attempts("gpu-job", 2).await);
    assert_eq!(status.attempts[0].outcome, AttemptOutcome::Unschedulable);
    let second = &status.attempts[1];
    assert_ne!(second.device, first.device);
    assert_ne!(second.device, small);
    op.stop().await;
    nodes.remove().await;
    ns.cleanup().await;
}

/// A mixed-strategy MIG node as GPU Feature Discovery labels it and the
/// device plugin advertises it: the MIG-enabled GPU's `nvidia.com/gpu.*`
/// labels describe a whole 80 GiB GPU, but only its two 3g.40gb slices can
/// be allocated. The job is planned on a slice (named by the node's
/// `.product` label), and its pod requests `nvidia.com/mig-3g.40gb` with a
/// node affinity that node meets, not `nvidia.com/gpu`.
#[tokio::test]
#[ignore = "needs the control plane: make test-apiserver"]
async fn a_mixed_mig_node_gets_pods_for_its_slices_not_its_whole_gpu() {
    let ns = test_ns("hr-mig").await;
    let mut nodes = GpuNodes::new(&ns);
    let big = nodes.product("Big");
    let slice = format!("{big}-MIG-3g.40gb");
    let node_name = nodes
        .add_mixed_mig("mig", &big, 81920, "3g.40gb", 2, 40192)
        .await;
    let op = start_operator(&ns, ControllerConfig::default());

    ns.apply_job(&gpu_job("mig-job", &[&big, &slice], 1, ""))
        .await;
    let plan = status_of(ns.wait_attempts("mig-job", 1).await)
        .plan
        .expect("plan");
    assert_eq!(
        (plan.device.as_str(), plan.resource.as_str()),
        (slice.as_str(), "nvidia.com/mig-3g.40gb"),
        "not the whole GPU the device plugin does not advertise"
    );
    let pod = ns.wait_pod_count("MIG pod", 1).await.remove(0);
    let limits = limits_of(&pod);
    let devices: Vec<_> = limits
        .iter()
        .filter(|(k, _)| k.starts_with("nvidia.com/"))
        .map(|(k, q)| (k.as_str(), q.0.as_str()))
        .collect();
    assert_eq!(devices, [("nvidia.com/mig-3g.40gb", "1")]);

    // The node, as the API server holds it, meets one of the affinity's terms.
    let node = nodes.api.get(&node_name).await.expect("node");
    let labels = node.labels();
    let terms = pod
        .spec
        .and_then(|s| s.affinity)
        .and_then(|a| a.node_affinity)
        .and_then(|a| a.required_during_scheduling_ignored_during_execution)
        .expect("a required node affinity")
        .node_selector_terms;
    let met = terms.iter().any(|t| {
        t.match_expressions.iter().flatten().all(|r| {
            let value = labels.get(&r.key);
            match r.operator.as_str() {
                "In" => value.is_some_and(|v| r.values.iter().flatten().any(|w| w == v)),
                "DoesNotExist" => value.is_none(),
                other => panic!("operator {other}"),
            }
        })
    });
    assert!(met, "{terms:?} against {labels:?}");
    op.stop().await;
    nodes.remove().await;
    ns.cleanup().await;
}

/// A GPU held by a pod that is not Headroom's is not free: with the big
/// GPU taken by another team's pod, the job goes to the mid one it would
/// otherwise not pick.
#[tokio::test]
#[ignore = "needs the control plane: make test-apiserver"]
async fn gpus_held_by_other_workloads_are_not_planned_for() {
    use headroom_operator::inventory::node_facts;
    use headroom_planner::{Inventory, plan};
    let ns = test_ns("hr-busy").await;
    let mut nodes = GpuNodes::new(&ns);
    let (mid, big) = (nodes.product("Mid"), nodes.product("Big"));
    let mid_node = nodes.add("mid", &mid, 40960).await;
    let big_node = nodes.add("big", &big, 81920).await;
    let manifest = gpu_job_with_sequence("gpu-job", &[&mid, &big], 1, "", 4096);

    // The premise: with both GPUs free the planner picks the big one.
    let job: MemoryAwareTrainingJob = serde_yaml::from_str(&manifest).expect("job");
    let mut facts = Vec::new();
    for name in [&mid_node, &big_node] {
        facts.push(node_facts(
            &nodes.api.get(name).await.expect("node"),
            std::iter::empty(),
        ));
    }
    let free = plan(
        &job.spec.job_request().expect("valid"),
        &Inventory::from_nodes(&facts),
    )
    .expect("a plan");
    assert_eq!(free.device, big, "the premise");

    // Another team's pod, bound to the big GPU's node (no Headroom labels).
    let other: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "other-team-trainer", "labels": {"app": "trainer"}},
        "spec": {"nodeName": big_node, "containers": [{"name": "w", "image": "example/trainer:1",
            "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}
    }))
    .expect("pod");
    ns.pods()
        .create(&kube::api::PostParams::default(), &other)
        .await
        .expect("other pod");

    let op = start_operator(&ns, ControllerConfig::default());
    ns.apply_job(&manifest).await;
    let job = ns.wait_attempts("gpu-job", 1).await;
    assert_eq!(status_of(job).attempts[0].device, mid);
    let worker = ns.wait_pod_named("gpu-job-a1-s0").await;
    let selector = worker
        .spec
        .and_then(|s| s.node_selector)
        .expect("a node selector");
    assert_eq!(selector["nvidia.com/gpu.product"], mid);
    op.stop().await;
    // Bound to a node with no kubelet, the pod would never finish a graceful
    // delete and would hold its namespace in Terminating.
    let _ = ns
        .pods()
        .delete(
            "other-team-trainer",
            &kube::api::DeleteParams::default().grace_period(0),
        )
        .await;
    nodes.remove().await;
    ns.cleanup().await;
}

/// Nodes the workers may not use are not planned for: the big GPU's node
/// is tainted for another team, so a job without the toleration goes to the
/// mid GPU and a job with it to the big one, and the pods carry the user's
/// placement.
#[tokio::test]
#[ignore = "needs the control plane: make test-apiserver"]
async fn tainted_nodes_count_only_for_jobs_that_tolerate_them() {
    let ns = test_ns("hr-taint").await;
    let mut nodes = GpuNodes::new(&ns);
    let (mid, big) = (nodes.product("Mid"), nodes.product("Big"));
    nodes.add("mid", &mid, 40960).await;
    let big_node = nodes.add("big", &big, 81920).await;
    let taint = serde_json::json!({"spec": {"taints": [
        {"key": "dedicated", "value": "research", "effect": "NoSchedule"}]}});
    nodes
        .api
        .patch(
            &big_node,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&taint),
        )
        .await
        .expect("taint");
    let op = start_operator(&ns, ControllerConfig::default());
    ns.apply_job(&gpu_job_with_sequence("plain", &[&mid, &big], 1, "", 4096))
        .await;
    ns.apply_job(&gpu_job_with_sequence(
        "research",
        &[&mid, &big],
        1,
        ", tolerations: [{key: dedicated, operator: Equal, value: research, effect: NoSchedule}]",
        4096,
    ))
    .await;
    for (name, device) in [("plain", &mid), ("research", &big)] {
        let job = ns.wait_attempts(name, 1).await;
        assert_eq!(&status_of(job).attempts[0].device, device, "{name}");
    }
    let pods = ns.wait_pod_count("both workers", 2).await;
    let research = pods
        .iter()
        .find(|p| p.name_any() == "research-a1-s0")
        .and_then(|p| p.spec.clone())
        .expect("the research worker");
    let keys: Vec<_> = research
        .tolerations
        .unwrap_or_default()
        .into_iter()
        .filter_map(|t| t.key)
        .collect();
    // Then the API server's default NoExecute tolerations (not-ready, unreachable).
    assert_eq!(keys[..2], ["dedicated", "nvidia.com/gpu"], "{keys:?}");
    op.stop().await;
    nodes.remove().await;
    ns.cleanup().await;
}

/// Three 1-GPU nodes and a model that needs two of those GPUs (without
/// optimizer offload): with the default ReadWriteOnce checkpoint volume its
/// stages would have to share a node, so there is no plan, and the message says how to get one; an
/// operator configured for ReadWriteMany plans it across nodes.
#[tokio::test]
#[ignore = "needs the control plane: make test-apiserver"]
async fn stages_span_nodes_only_with_a_read_write_many_checkpoint_volume() {
    use headroom_operator::controller::{CheckpointAccess, ChildConfig};
    let ns = test_ns("hr-rwx").await;
    let mut nodes = GpuNodes::new(&ns);
    let small = nodes.product("Small");
    // 6 GiB each: the job's bf16 weights, gradients and AdamW moments (8
    // bytes a parameter, 5.8 GiB) need two of them.
    for i in 0..3 {
        nodes.add(&format!("n{i}"), &small, 6144).await;
    }
    // Offloading the optimizer state to host memory would fit it on one
    // GPU (the nodes allocate 64Gi); this job does not allow it.
    let job = |name: &str| {
        gpu_job(name, &[&small], 3, "")
            + "  memoryPolicy: {allowedRungs: [activationCheckpointing, halveMicroBatch, lowerPrecision, cheaperOptimizer, morePipelineStages, largerGpu]}\n"
    };

    let op = start_operator(&ns, ControllerConfig::default());
    ns.apply_job(&job("one-node")).await;
    let failed = status_of(ns.wait_phase("one-node", JobPhase::Failed).await);
    let message = failed.message.expect("message");
    assert!(message.contains("ReadWriteMany"), "{message}");
    op.stop().await;

    let op = start_operator(
        &ns,
        ControllerConfig {
            children: ChildConfig {
                checkpoint_access: CheckpointAccess::ReadWriteMany,
                ..ChildConfig::default()
            },
            ..ControllerConfig::default()
        },
    );
    ns.apply_job(&job("spread")).await;
    let plan = status_of(ns.wait_attempts("spread", 1).await).attempts[0].clone();
    assert!(plan.workers >= 2, "{plan:?}");
    let stages = |p: &[Pod]| -> Vec<Pod> {
        p.iter()
            .filter(|p| p.name_any().starts_with("spread-a1-"))
            .cloned()
            .collect()
    };
    let pods = ns
        .wait_pods("the stages", TIMEOUT, |p| {
            stages(p).len() == plan.workers as usize
        })
        .await;
    for pod in stages(&pods) {
        assert!(
            pod.spec
                .as_ref()
                .and_then(|s| s.affinity.as_ref())
                .is_none(),
            "no co-location with ReadWriteMany: {pod:?}"
        );
    }
    let claim = ns.claims().get("spread-checkpoints").await.expect("claim");
    assert_eq!(
        claim.spec.and_then(|s| s.access_modes),
        Some(vec!["ReadWriteMany".to_string()])
    );
    op.stop().await;
    nodes.remove().await;
    ns.cleanup().await;
}

/// `status.workers` is the current attempt's telemetry: once attempt 2
/// starts, attempt 1's entries are gone (what they said is in attempt 1's
/// history), and attempt 2's entries stay.
#[tokio::test]
#[ignore = "needs the control plane: make test-apiserver"]
async fn telemetry_of_an_ended_attempt_is_pruned() {
    let ns = test_ns("hr-prune").await;
    let op = start_operator(&ns, ControllerConfig::default());
    ns.apply_job(CPU_OOM_FIRST).await;
    ns.wait_attempt_pod(1).await;
    report_telemetry(&ns, 1, 4).await;
    ns.set_pod_status("oom-then-fit-a1-s0", oom_killed()).await;
    ns.wait_attempt_pod(2).await;
    report_telemetry(&ns, 2, 1).await;
    let job = ns
        .wait_job("oom-then-fit", "only attempt 2's telemetry", TIMEOUT, |j| {
            j.status
                .as_ref()
                .is_some_and(|s| s.workers.iter().map(|w| w.attempt).collect::<Vec<_>>() == [2])
        })
        .await;
    let first = &status_of(job).attempts[0];
    assert_eq!(
        first.last_step,
        Some(4),
        "attempt 1's telemetry lives on in its history"
    );
    op.stop().await;
    ns.cleanup().await;
}

/// What worker 0 of `oom-then-fit`'s attempt `attempt` reports: its step
/// and a peak, applied as that worker's field manager.
async fn report_telemetry(ns: &TestNs, attempt: u32, step: u64) {
    let pod = format!("oom-then-fit-a{attempt}-s0");
    let report = serde_json::json!({
        "apiVersion": "headroom.dev/v1alpha1", "kind": "MemoryAwareTrainingJob",
        "metadata": {"name": "oom-then-fit"},
        "status": {"workers": [{
            "name": pod, "attempt": attempt, "stage": 0, "layerStart": 0, "layerEnd": 2,
            "step": step, "memory": {"peakBytes": 123_456_789u64},
            "updatedAt": "2026-11-22T10:00:00Z"}]},
    });
    ns.jobs()
        .patch_status(
            "oom-then-fit",
            &kube::api::PatchParams::apply(&format!("headroom-worker-a{attempt}-s0")).force(),
            &kube::api::Patch::Apply(report),
        )
        .await
        .expect("telemetry");
}

/// Pods the API server refuses (here: a PriorityClass that does not exist)
/// show up on the job as a Warning event with the server's reason, and the
/// attempt starts once the cause is fixed.
#[tokio::test]
#[ignore = "needs the control plane: make test-apiserver"]
async fn refused_worker_pods_are_reported_on_the_job_and_retried() {
    use k8s_openapi::api::scheduling::v1::PriorityClass;
    let ns = test_ns("hr-refused").await;
    let class = format!("{}-batch", ns.name);
    let op = start_operator(&ns, ControllerConfig::default());
    let manifest = CPU_TINY.replace(
        "image: localhost/headroom-worker:dev",
        &format!("image: localhost/headroom-worker:dev\n    priorityClassName: {class}"),
    );
    assert!(
        manifest.contains("priorityClassName"),
        "the sample's worker block changed"
    );
    ns.apply_job(&manifest).await;

    let refused = ns.wait_event("LaunchRefused").await;
    let note = refused.note.unwrap_or_default();
    assert!(note.contains(&class), "{note}");
    assert_eq!(refused.type_.as_deref(), Some("Warning"));
    assert!(ns.pod_list().await.is_empty());
    // A policy decision can change (an admin acts): the job waits, saying why.
    let job = ns
        .wait_condition("tiny-cpu", "Running=False LaunchRefused", |c| {
            c.type_ == "Running" && c.reason == "LaunchRefused"
        })
        .await;
    let status = status_of(job);
    assert_eq!(status.phase, Some(JobPhase::Pending));
    assert!(
        status.message.as_deref().unwrap_or("").contains(&class),
        "{:?}",
        status.message
    );

    // The cluster admin creates the class: the retried reconcile starts the attempt.
    let classes: Api<PriorityClass> = Api::all(ns.client.clone());
    let pc: PriorityClass =
        serde_json::from_value(serde_json::json!({"metadata": {"name": class}, "value": 100}))
            .expect("class");
    classes
        .create(&kube::api::PostParams::default(), &pc)
        .await
        .expect("priority class");
    let pods = ns.wait_pod_count("the worker", 1).await;
    assert_eq!(
        pods[0]
            .spec
            .as_ref()
            .and_then(|s| s.priority_class_name.as_deref()),
        Some(class.as_str())
    );
    op.stop().await;
    let _ = classes
        .delete(&class, &kube::api::DeleteParams::default())
        .await;
    ns.cleanup().await;
}

/// A refusal that would repeat for ever (here an admission policy that
/// answers 422 Invalid, as a validating webhook may) ends the attempt and the
/// job with the server's words, instead of asking again every few seconds.
#[tokio::test]
#[ignore = "needs the control plane: make test-apiserver"]
async fn worker_pods_refused_as_invalid_end_the_job_with_the_reason() {
    let ns = test_ns("hr-invalid-pod").await;
    let refusal = PodRefusal::install(&ns, "worker pods are not welcome here").await;
    let op = start_operator(&ns, ControllerConfig::default());
    ns.apply_job(CPU_TINY).await;
    let status = status_of(ns.wait_phase("tiny-cpu", JobPhase::Failed).await);
    let failed = condition(&status, "Failed");
    assert_eq!(
        (failed.status.as_str(), failed.reason.as_str()),
        ("True", "LaunchRefused")
    );
    assert!(
        failed.message.contains("worker pods are not welcome here"),
        "{}",
        failed.message
    );
    assert!(failed.message.contains("422"), "{}", failed.message);
    let attempt = &status.attempts[0];
    assert_eq!(attempt.outcome, AttemptOutcome::Failed);
    assert_eq!(attempt.reason.as_deref(), Some("LaunchRefused"));
    assert!(ns.pod_list().await.is_empty());
    op.stop().await;
    refusal.remove().await;
    ns.cleanup().await;
}

/// A ValidatingAdmissionPolicy that refuses (422) every pod created in one
/// test namespace, in force once a probe pod is refused.
struct PodRefusal {
    name: String,
    client: kube::Client,
}

impl PodRefusal {
    async fn install(ns: &headroom_e2e::TestNs, message: &str) -> Self {
        use k8s_openapi::api::admissionregistration::v1::{
            ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
        };
        let name = format!("{}-no-pods", ns.name);
        let policy: ValidatingAdmissionPolicy = serde_json::from_value(serde_json::json!({
            "metadata": {"name": name},
            "spec": {
                "failurePolicy": "Fail",
                "matchConstraints": {"resourceRules": [{
                    "apiGroups": [""], "apiVersions": ["v1"],
                    "operations": ["CREATE"], "resources": ["pods"]}]},
                "validations": [{"expression": "false", "reason": "Invalid", "message": message}]
            }
        }))
        .expect("policy");
        let binding: ValidatingAdmissionPolicyBinding = serde_json::from_value(serde_json::json!({
            "metadata": {"name": name},
            "spec": {
                "policyName": name,
                "validationActions": ["Deny"],
                "matchResources": {"namespaceSelector": {"matchLabels": {
                    "kubernetes.io/metadata.name": ns.name}}}
            }
        }))
        .expect("binding");
        let policies: Api<ValidatingAdmissionPolicy> = Api::all(ns.client.clone());
        let bindings: Api<ValidatingAdmissionPolicyBinding> = Api::all(ns.client.clone());
        let pp = kube::api::PostParams::default();
        policies.create(&pp, &policy).await.expect("policy");
        bindings.create(&pp, &binding).await.expect("binding");
        // Policies take effect asynchronously: wait until a probe pod is refused
        // (it names an account of its own, made here).
        let accounts: Api<ServiceAccount> = Api::namespaced(ns.client.clone(), &ns.name);
        let account: ServiceAccount =
            serde_json::from_value(serde_json::json!({"metadata": {"name": "probe"}})).expect("sa");
        accounts.create(&pp, &account).await.expect("probe account");
        let probe: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "probe"},
            "spec": {"serviceAccountName": "probe", "containers": [{"name": "c", "image": "i"}]}
        }))
        .expect("pod");
        ns.wait_for("the policy in force", TIMEOUT, || async {
            match ns.pods().create(&pp, &probe).await {
                Err(kube::Error::Api(e)) if e.code == 422 => Some(()),
                Ok(_) => {
                    let _ = ns.pods().delete("probe", &Default::default()).await;
                    None
                }
                Err(_) => None,
            }
        })
        .await;
        PodRefusal {
            name,
            client: ns.client.clone(),
        }
    }

    async fn remove(self) {
        use k8s_openapi::api::admissionregistration::v1::{
            ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
        };
        let policies: Api<ValidatingAdmissionPolicy> = Api::all(self.client.clone());
        let bindings: Api<ValidatingAdmissionPolicyBinding> = Api::all(self.client);
        let _ = bindings.delete(&self.name, &Default::default()).await;
        let _ = policies.delete(&self.name, &Default::default()).await;
    }
}

#[tokio::test]
#[ignore = "needs the control plane: make test-apiserver"]
async fn a_refused_initializer_pod_ends_the_job_with_the_reason() {
    let ns = test_ns("hr-init-refused").await;
    let refusal = PodRefusal::install(&ns, "initializers are not welcome here").await;
    let op = start_operator(&ns, ControllerConfig::default());
    ns.apply_job(CPU_FINETUNE).await;
    let status = status_of(ns.wait_phase("finetune-tiny-llama", JobPhase::Failed).await);
    let failed = condition(&status, "Failed");
    assert_eq!(failed.reason, "LaunchRefused");
    assert!(
        failed.message.contains("initializer pod")
            && failed.message.contains("initializers are not welcome here")
            && failed.message.contains("422"),
        "{}",
        failed.message
    );
    assert!(status.attempts.is_empty(), "nothing was planned");
    op.stop().await;
    refusal.remove().await;
    ns.cleanup().await;
}

#[tokio::test]
#[ignore = "needs the control plane: make test-apiserver"]
async fn a_job_that_cannot_be_read_does_not_stall_the_others() {
    let ns = test_ns("hr-guard").await;
    // Accepted by the schema (an integer), unreadable by the operator (not a u32).
    let broken = CPU_TINY.replace("name: tiny-cpu", "name: broken");
    ns.apply_job(&broken).await;
    let patched = ns
        .jobs()
        .patch_status(
            "broken",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(serde_json::json!({"status": {"attempt": 5_000_000_000u64}})),
        )
        .await;
    // The server stores it; only the typed read-back fails, which is the point.
    assert!(
        matches!(patched, Err(kube::Error::SerdeError(_))),
        "{patched:?}"
    );
    let op = start_operator(&ns, ControllerConfig::default());
    ns.apply_job(CPU_TINY).await;
    ns.wait_attempts("tiny-cpu", 1).await;
    ns.wait_pod_named("tiny-cpu-a1-s0").await;
    assert!(
        ns.pod_list()
            .await
            .iter()
            .all(|p| !p.name_any().starts_with("broken")),
        "nothing is created for an unreadable job"
    );
    assert!(
        op.metrics.encode().contains("invalid_object"),
        "{}",
        op.metrics.encode()
    );
    op.stop().await;
    ns.cleanup().await;
}

#[tokio::test]
#[ignore = "needs the control plane: make test-apiserver"]
async fn one_leader_at_a_time_and_release_hands_over() {
    use headroom_operator::leader::LeaseLock;
    let ns = test_ns("hr-lease").await;
    let api = || Api::namespaced(ns.client.clone(), &ns.name);
    let a = LeaseLock::new(
        api(),
        "headroom-operator",
        "replica-a",
        Duration::from_secs(15),
    );
    let b = LeaseLock::new(
        api(),
        "headroom-operator",
        "replica-b",
        Duration::from_secs(15),
    );
    assert!(a.try_acquire_or_renew().await.expect("a"));
    assert!(
        !b.try_acquire_or_renew().await.expect("b"),
        "b must stand by while a holds a fresh lease"
    );
    assert!(a.try_acquire_or_renew().await.expect("a renews"));
    a.release().await.expect("release");
    assert!(b.try_acquire_or_renew().await.expect("b takes over"));
    assert!(
        !a.try_acquire_or_renew().await.expect("a"),
        "a must now stand by"
    );
    // An expired lease is taken over without its holder's cooperation.
    let short = LeaseLock::new(api(), "short", "replica-a", Duration::from_secs(1));
    let other = LeaseLock::new(api(), "short", "replica-b", Duration::from_secs(1));
    assert!(short.try_acquire_or_renew().await.expect("short"));
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert!(
        other
            .try_acquire_or_renew()
            .await
            .expect("takeover after expiry")
    );
    ns.cleanup().await;
}

#[tokio::test]
#[ignore = "needs the control plane: make test-apiserver"]
async fn a_pretrained_job_is_initialized_then_planned_from_its_checkpoint() {
    let ns = test_ns("hr-finetune").await;
    let op = start_operator(&ns, ControllerConfig::default());
    ns.apply_job(CPU_FINETUNE).await;
    let pods = ns
        .wait_pods("the initializer pod", TIMEOUT, |p| !p.is_empty())
        .await;
    assert_eq!(
        pods.iter().map(|p| p.name_any()).collect::<Vec<_>>(),
        vec!["finetune-tiny-llama-init-1"],
        "nothing but the initializer before the checkpoint is read"
    );
    assert_the_initializer_reads_the_models_volume(&pods[0]);
    let job = ns
        .wait_condition("finetune-tiny-llama", "Initializing", |c| {
            c.type_ == "Initialized"
        })
        .await;
    assert_eq!(phase(&job), Some(JobPhase::Pending));

    ns.set_pod_status(
        "finetune-tiny-llama-init-1",
        terminated(0, "Completed", Some(&tiny_llama_report(64))),
    )
    .await;
    let status = status_of(ns.wait_attempts("finetune-tiny-llama", 1).await);
    assert_eq!(status.model.as_ref().map(|m| m.parameters), Some(214_592));
    assert_eq!(status.data.as_ref().map(|d| d.samples), Some(15));
    assert_eq!(
        status.output.as_deref(),
        Some("finetune-tiny-llama-checkpoints:output")
    );
    let initialized = condition(&status, "Initialized");
    assert_eq!(
        (initialized.status.as_str(), initialized.reason.as_str()),
        ("True", "Initialized")
    );
    let workers = ns.wait_attempt_pod(1).await;
    let worker = workers
        .iter()
        .find(|p| p.name_any() == "finetune-tiny-llama-a1-s0")
        .expect("worker pod");
    assert_the_worker_builds_the_checkpoints_model(worker);
    op.stop().await;
    ns.cleanup().await;
}

/// The initializer is told to read the model from its volume, at the job's
/// sequence length.
fn assert_the_initializer_reads_the_models_volume(init: &Pod) {
    let assignment: headroom_api::InitializerAssignment = serde_json::from_str(
        &env_of(init, headroom_api::INITIALIZE_JSON_ENV).expect("assignment env"),
    )
    .expect("assignment JSON");
    assert_eq!(assignment.model, headroom_api::ModelSource::Volume);
    assert_eq!(
        assignment.model_dir,
        "/var/lib/headroom/claims/models/tiny-llama"
    );
    assert_eq!(assignment.sequence_length, 64);
}

/// The worker is told where the model and data files are, and builds the
/// model the checkpoint describes.
fn assert_the_worker_builds_the_checkpoints_model(worker: &Pod) {
    let assignment: headroom_api::WorkerAssignment =
        serde_json::from_str(&env_of(worker, headroom_api::PLAN_JSON_ENV).expect("plan env"))
            .expect("assignment JSON");
    let files = assignment
        .files
        .expect("the worker is told where its files are");
    assert_eq!(
        files.model_dir,
        "/var/lib/headroom/claims/models/tiny-llama"
    );
    assert_eq!(
        files.data_file,
        "/var/lib/headroom/claims/datasets/declaration-of-independence.jsonl"
    );
    let headroom_planner::ModelShape::Llama(shape) = assignment.model else {
        panic!("the worker builds the checkpoint's model");
    };
    assert_eq!((shape.layers, shape.sequence_length), (4, 64));
}

#[tokio::test]
#[ignore = "needs the control plane: make test-apiserver"]
async fn a_checkpoint_the_initializer_refuses_fails_the_job_with_its_reason() {
    let ns = test_ns("hr-badsource").await;
    let op = start_operator(&ns, ControllerConfig::default());
    ns.apply_job(CPU_FINETUNE).await;
    ns.wait_pods("the initializer pod", TIMEOUT, |p| !p.is_empty())
        .await;
    let refusal = serde_json::to_string(&headroom_api::TerminationMessage {
        outcome: headroom_api::WorkerOutcome::InvalidPlan,
        reason: "model.layers.0.self_attn.k_proj.weight is [32, 64] in model.safetensors; config.json implies [64, 64]".into(),
        step: None,
        peak_bytes: None,
        requested_bytes: None,
    })
    .expect("JSON");
    ns.set_pod_status(
        "finetune-tiny-llama-init-1",
        terminated(
            headroom_api::WorkerOutcome::InvalidPlan.exit_code(),
            "Error",
            Some(&refusal),
        ),
    )
    .await;
    let status = status_of(ns.wait_phase("finetune-tiny-llama", JobPhase::Failed).await);
    let failed = condition(&status, "Failed");
    assert_eq!(failed.reason, "InvalidSource");
    assert!(failed.message.contains("k_proj"), "{}", failed.message);
    let pods = ns.pods().list(&Default::default()).await.expect("pods");
    assert!(
        pods.items
            .iter()
            .all(|p| p.labels().get(LABEL_ATTEMPT).is_none()),
        "no worker pod for a checkpoint that cannot be used"
    );
    op.stop().await;
    ns.cleanup().await;
}

/// A worker that finds its checkpoint volume full ends its attempt
/// `DiskFull`; the claim's StorageClass allows expansion, so the operator
/// raises the claim's request to twice its size and resumes with the same
/// settings. The claim is bound by hand (no volume controller here: the API
/// server resizes bound claims only).
#[tokio::test]
#[ignore = "needs the control plane: make test-apiserver"]
async fn a_full_expandable_claim_is_grown_and_the_job_resumes() {
    use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
    use k8s_openapi::api::storage::v1::StorageClass;
    use kube::api::{DeleteParams, Patch, PatchParams, PostParams};

    let ns = test_ns("hr-disk").await;
    let class = format!("{}-expandable", ns.name);
    let classes: Api<StorageClass> = Api::all(ns.client.clone());
    classes
        .create(
            &PostParams::default(),
            &serde_json::from_value(serde_json::json!({
                "apiVersion": "storage.k8s.io/v1", "kind": "StorageClass",
                "metadata": {"name": class},
                "provisioner": "example.com/none",
                "allowVolumeExpansion": true,
            }))
            .expect("class"),
        )
        .await
        .expect("create the StorageClass");
    let mut config = ControllerConfig::default();
    config.children.checkpoint_storage_class = Some(class.clone());
    let op = start_operator(&ns, config);
    let manifest = CPU_TINY.replace(
        "  worker:",
        "  memoryPolicy: {backoffSeconds: 0}\n  worker:",
    );
    ns.apply_job(&manifest).await;
    ns.wait_pod_count("attempt 1 pod", 1).await;

    // Bind the claim as a volume controller would.
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(ns.client.clone(), &ns.name);
    let claim = "tiny-cpu-checkpoints";
    // Made in the same round as the pod: it may lag a moment.
    let mut made = None;
    for _ in 0..100 {
        made = claims.get_opt(claim).await.expect("read the claim");
        if made.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let made = made.expect("the checkpoint claim");
    let asked = made
        .spec
        .as_ref()
        .and_then(|s| s.resources.as_ref())
        .and_then(|r| r.requests.as_ref())
        .and_then(|r| r.get("storage"))
        .map(|q| q.0.clone());
    assert_eq!(
        asked.as_deref(),
        Some("1Gi"),
        "a tiny plan keeps the default"
    );
    let volume = format!("{}-pv", ns.name);
    let volumes: Api<PersistentVolume> = Api::all(ns.client.clone());
    volumes
        .create(
            &PostParams::default(),
            &serde_json::from_value(serde_json::json!({
                "apiVersion": "v1", "kind": "PersistentVolume",
                "metadata": {"name": volume},
                "spec": {
                    "capacity": {"storage": "1Gi"},
                    "accessModes": ["ReadWriteOnce"],
                    "storageClassName": class,
                    "hostPath": {"path": "/tmp/headroom-test"},
                    "claimRef": {"namespace": ns.name, "name": claim},
                },
            }))
            .expect("volume"),
        )
        .await
        .expect("create the PersistentVolume");
    claims
        .patch(
            claim,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"volumeName": volume}})),
        )
        .await
        .expect("name the volume");
    claims
        .patch_status(
            claim,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"status": {"phase": "Bound", "accessModes": ["ReadWriteOnce"], "capacity": {"storage": "1Gi"}}})),
        )
        .await
        .expect("bind the claim");

    let msg = r#"{"outcome":"diskFull","reason":"checkpoint at step 4: the volume is full (No space left on device (os error 28))","step":4}"#;
    ns.set_pod_status(
        "tiny-cpu-a1-s0",
        terminated(headroom_api::exit_code::DISK_FULL, "Error", Some(msg)),
    )
    .await;
    let status = status_of(ns.wait_attempts("tiny-cpu", 2).await);
    assert_eq!(status.attempts[0].outcome, AttemptOutcome::DiskFull);
    assert_eq!(status.attempts[0].last_step, Some(4));
    assert_eq!(
        status.attempts[1].settings, status.attempts[0].settings,
        "the same settings: memory was not the problem"
    );
    let grown = claims.get(claim).await.expect("the claim");
    let asked = grown
        .spec
        .as_ref()
        .and_then(|s| s.resources.as_ref())
        .and_then(|r| r.requests.as_ref())
        .and_then(|r| r.get("storage"))
        .map(|q| q.0.clone());
    assert_eq!(asked.as_deref(), Some("2Gi"), "twice its size");
    ns.wait_attempt_pod(2).await;

    op.stop().await;
    ns.cleanup().await;
    let _ = volumes.delete(&volume, &DeleteParams::default()).await;
    let _ = classes.delete(&class, &DeleteParams::default()).await;
}

/// `spec.suspend`: the running attempt's worker is stopped and the job says
/// `Suspended=True`; no pod while suspended; resuming starts the next
/// attempt at once (a suspension costs no attempt, so maxAttempts 1 does
/// not end the job).
#[tokio::test]
#[ignore = "needs the control plane: make test-apiserver"]
async fn a_suspended_job_has_no_pods_and_resumes_in_a_new_attempt() {
    let ns = test_ns("hr-pods-suspend").await;
    let op = start_operator(&ns, ControllerConfig::default());
    let tiny = CPU_TINY.replace("spec:\n", "spec:\n  memoryPolicy: {maxAttempts: 1}\n");
    ns.apply_job(&tiny).await;
    ns.wait_pod_count("the worker pod", 1).await;
    ns.set_pod_status("tiny-cpu-a1-s0", running()).await;
    ns.wait_phase("tiny-cpu", JobPhase::Running).await;

    let suspend = |on: bool| serde_json::json!({"spec": {"suspend": on}});
    ns.jobs()
        .patch(
            "tiny-cpu",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(suspend(true)),
        )
        .await
        .expect("suspend");
    ns.wait_condition("tiny-cpu", "Suspended=True", |c| {
        c.type_ == "Suspended" && c.status == "True"
    })
    .await;
    ns.wait_pod_count("no worker while suspended", 0).await;
    let job = ns.jobs().get("tiny-cpu").await.expect("job");
    assert_eq!(phase(&job), Some(JobPhase::Pending));
    assert_eq!(
        status_of(job).attempts[0].outcome,
        AttemptOutcome::Disrupted
    );

    ns.jobs()
        .patch(
            "tiny-cpu",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(suspend(false)),
        )
        .await
        .expect("resume");
    ns.wait_pod_named("tiny-cpu-a2-s0").await;
    ns.wait_condition("tiny-cpu", "Suspended=False", |c| {
        c.type_ == "Suspended" && c.status == "False" && c.reason == "Resumed"
    })
    .await;
    op.stop().await;
    ns.cleanup().await;
}

/// `spec.ttlSecondsAfterFinished`: a job that succeeded is deleted that
/// long after; the checkpoint claim its retention kept (RetainOnSuccess)
/// stays.
#[tokio::test]
#[ignore = "needs the control plane: make test-apiserver"]
async fn a_finished_job_is_deleted_after_its_ttl_and_its_kept_claim_stays() {
    let ns = test_ns("hr-pods-ttl").await;
    let op = start_operator(&ns, ControllerConfig::default());
    let tiny = CPU_TINY.replace("spec:\n", "spec:\n  ttlSecondsAfterFinished: 2\n");
    ns.apply_job(&tiny).await;
    ns.wait_pod_count("the worker pod", 1).await;
    ns.set_pod_status("tiny-cpu-a1-s0", terminated(0, "Completed", None))
        .await;
    ns.wait_phase("tiny-cpu", JobPhase::Succeeded).await;
    ns.wait_for("the job deleted by its TTL", TIMEOUT, || async {
        ns.jobs()
            .get_opt("tiny-cpu")
            .await
            .ok()?
            .is_none()
            .then_some(())
    })
    .await;
    let claim = ns
        .claims()
        .get("tiny-cpu-checkpoints")
        .await
        .expect("the kept claim");
    assert!(claim.owner_references().is_empty(), "{:?}", claim.metadata);
    op.stop().await;
    ns.cleanup().await;
}

/// The sample fine-tuning job as a LoRA job named `name` on a hub model
/// (`owner/base` at `main`): its checkpoint goes to the shared model cache.
fn lora_on_hub(name: &str) -> String {
    CPU_FINETUNE
        .replace("name: finetune-tiny-llama", &format!("name: {name}"))
        .replace(
            "volume: {claimName: models, path: tiny-llama}",
            "huggingFace: {repo: owner/base, revision: main}",
        )
        .replace("    steps: 30\n", "    steps: 30\n    method: lora\n")
}

/// The initializer's assignment in `pod`, and whether its mount of `claim`
/// is read-only.
fn initializer_on(pod: &Pod, claim: &str) -> (headroom_api::InitializerAssignment, bool) {
    let assignment = serde_json::from_str(
        &env_of(pod, headroom_api::INITIALIZE_JSON_ENV).expect("assignment env"),
    )
    .expect("assignment JSON");
    (assignment, mounts_read_only(pod, claim))
}

/// Whether `pod` mounts `claim` read-only (it must mount it).
fn mounts_read_only(pod: &Pod, claim: &str) -> bool {
    let spec = pod.spec.as_ref().expect("spec");
    let volume = spec
        .volumes
        .iter()
        .flatten()
        .find(|v| {
            v.persistent_volume_claim
                .as_ref()
                .is_some_and(|c| c.claim_name == claim)
        })
        .unwrap_or_else(|| panic!("{} mounts {claim}", pod.name_any()));
    let mount = spec.containers[0]
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| m.name == volume.name)
        .expect("mounted");
    let volume_read_only = volume
        .persistent_volume_claim
        .as_ref()
        .and_then(|c| c.read_only)
        == Some(true);
    mount.read_only == Some(true) && volume_read_only
}

/// Two LoRA jobs on one hub base in one namespace: the first creates the
/// shared model cache claim and its initializer downloads into it
/// (writable); the second waits, naming the claim, while it fills, then
/// only checks it (read-only, nothing to download); both plan their own
/// claims without the model's bytes. Once neither job exists, the claim is
/// deleted after the idle time (`modelCache.idleSeconds`).
#[tokio::test]
#[ignore = "needs the control plane: make test-apiserver"]
async fn a_second_lora_job_reuses_the_shared_model_cache_and_an_idle_one_is_collected() {
    use headroom_operator::controller::{ChildConfig, ModelCacheConfig};
    let ns = test_ns("hr-modelcache").await;
    let op = start_operator(
        &ns,
        ControllerConfig {
            children: ChildConfig {
                model_cache: ModelCacheConfig {
                    idle: Duration::from_secs(3),
                    ..ModelCacheConfig::default()
                },
                ..ChildConfig::default()
            },
            ..ControllerConfig::default()
        },
    );
    ns.apply_job(&lora_on_hub("first")).await;
    let init = ns.wait_pod_named("first-init-1").await;
    let claims = ns.claims();
    let listed = claims.list(&Default::default()).await.expect("claims");
    let cache = listed
        .items
        .iter()
        .find(|c| c.name_any().starts_with("headroom-model-"))
        .unwrap_or_else(|| {
            panic!(
                "a cache claim among {:?}",
                listed
                    .items
                    .iter()
                    .map(|c| c.name_any())
                    .collect::<Vec<_>>()
            )
        });
    let cache_name = cache.name_any();
    assert_eq!(
        cache
            .annotations()
            .get("headroom.dev/cache-state")
            .map(String::as_str),
        Some("filling")
    );
    assert_eq!(
        cache
            .annotations()
            .get("headroom.dev/cache-filler-job")
            .map(String::as_str),
        Some("first")
    );
    assert!(
        cache.owner_references().is_empty(),
        "no job's deletion takes it"
    );
    let (assignment, read_only) = initializer_on(&init, &cache_name);
    assert!(
        matches!(
            assignment.model,
            headroom_api::ModelSource::HuggingFace { .. }
        ),
        "the first job downloads: {:?}",
        assignment.model
    );
    assert!(!read_only, "the filler writes the cache");
    assert_eq!(
        assignment.model_dir,
        format!("/var/lib/headroom/claims/{cache_name}/model")
    );

    ns.apply_job(&lora_on_hub("second")).await;
    let waiting = ns
        .wait_condition("second", "waiting for the cache", |c| {
            c.type_ == "Initialized" && c.reason == "WaitingForModelCache"
        })
        .await;
    let waiting = status_of(waiting);
    let message = &condition(&waiting, "Initialized").message;
    assert!(
        message.contains(&cache_name) && message.contains("first"),
        "{message}"
    );
    assert!(
        ns.pod_list()
            .await
            .iter()
            .all(|p| p.name_any() != "second-init-1"),
        "no initializer while the cache fills"
    );

    ns.set_pod_status(
        "first-init-1",
        terminated(0, "Completed", Some(&tiny_llama_report(64))),
    )
    .await;
    let first = status_of(ns.wait_attempts("first", 1).await);
    assert_eq!(first.model_cache.as_deref(), Some(cache_name.as_str()));
    let disk = first
        .plan
        .as_ref()
        .and_then(|p| p.disk.as_ref())
        .expect("the plan's disk count");
    assert_eq!(disk.model_bytes, 0, "the model is not on the job's claim");
    let ready = claims.get(&cache_name).await.expect("cache claim");
    assert_eq!(
        ready
            .annotations()
            .get("headroom.dev/cache-state")
            .map(String::as_str),
        Some("ready")
    );

    let reader = ns.wait_pod_named("second-init-1").await;
    let (assignment, read_only) = initializer_on(&reader, &cache_name);
    assert_eq!(
        assignment.model,
        headroom_api::ModelSource::Volume,
        "the second job downloads nothing"
    );
    assert!(read_only, "readers mount the cache read-only");
    ns.set_pod_status(
        "second-init-1",
        terminated(0, "Completed", Some(&tiny_llama_report(64))),
    )
    .await;
    let second = status_of(ns.wait_attempts("second", 1).await);
    assert_eq!(second.model_cache.as_deref(), Some(cache_name.as_str()));
    let worker = ns.wait_pod_named("second-a1-s0").await;
    assert!(
        mounts_read_only(&worker, &cache_name),
        "workers mount the cache read-only"
    );
    assert_eq!(
        claims
            .list(&Default::default())
            .await
            .expect("claims")
            .items
            .iter()
            .filter(|c| c.name_any().starts_with("headroom-model-"))
            .count(),
        1,
        "one copy for both jobs"
    );

    // In use, the claim stays past its idle time.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let kept = claims.get(&cache_name).await.expect("kept while used");
    assert!(kept.metadata.deletion_timestamp.is_none());
    for job in ["first", "second"] {
        ns.jobs()
            .delete(job, &Default::default())
            .await
            .expect("delete job");
    }
    ns.wait_for("the idle cache claim deleted", TIMEOUT, || async {
        match claims.get_opt(&cache_name).await {
            Ok(None) => Some(()),
            Ok(Some(c)) if c.metadata.deletion_timestamp.is_some() => Some(()),
            _ => None,
        }
    })
    .await;
    op.stop().await;
    ns.cleanup().await;
}
