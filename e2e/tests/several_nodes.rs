//! Scenarios that need several real nodes: `make e2e-kind` runs them on a
//! kind cluster of one control plane and two workers (e2e/kind.sh). The
//! tests sit in `several_nodes::`, which `make e2e` (one node) skips.
//!
//! * ReadWriteOnce checkpoints (the chart's default): a job's pipeline stages
//!   share a node even though another worker has room for them.
//! * Workers labelled as GPU Feature Discovery labels an A100 node and a T4
//!   node get the pods of the jobs planned on those GPUs (the worker image is
//!   CPU-only, so those pods exit 78: placement is the point).
//! * ReadWriteMany checkpoints (`read_write_many_…`, run after e2e/kind.sh
//!   re-installs the chart with `checkpoints.accessMode=ReadWriteMany` on the
//!   kind cluster's shared-filesystem class): when no node has room for two
//!   stages, the stages train on two nodes, over the pod network, with one
//!   checkpoint volume.
//!
//! The GPU labels and the filler pods change what every node offers, so the
//! tests that make them hold [`several_nodes::NODES`] in turn.

mod several_nodes {
    use std::collections::{BTreeMap, BTreeSet};
    use std::time::Duration;

    use headroom_api::quantity::parse_bytes;
    use headroom_api::{AttemptOutcome, MemoryAwareTrainingJob};
    use headroom_e2e::cluster::{operator_checkpoint_access, schedulable_nodes};
    use headroom_e2e::fixtures::{CPU_PIPELINE, GPU_FITS_A_T4, GPU_NEEDS_A100};
    use headroom_e2e::gfd::{job_failed, label_gpu, plan_device, unlabel_gpu};
    use headroom_e2e::kueue::{FlavorSpec, QueueSpec, queued};
    use headroom_e2e::{E2E, TestNs, pod_phase};
    use k8s_openapi::api::core::v1::{Node, PersistentVolumeClaim, Pod};
    use kube::api::{Api, DeleteParams, ListParams, PostParams};
    use kube::{Client, ResourceExt};
    use serde_json::json;

    const RUN: Duration = Duration::from_secs(600);
    const BIG_GPU: &str = "NVIDIA-A100-SXM4-80GB";
    const SMALL_GPU: &str = "Tesla-T4";
    /// The sandbox image every kind node holds (e2e/kind/node-image.sh).
    const PAUSE_IMAGE: &str = "registry.k8s.io/pause:3.10";

    pub static NODES: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

    /// The nodes pods may go to, by name: at least two.
    async fn workers(client: &Client) -> Vec<Node> {
        let nodes = schedulable_nodes(&Api::all(client.clone())).await;
        assert!(
            nodes.len() >= 2,
            "these tests need two schedulable nodes (make e2e-kind), found {:?}",
            nodes.iter().map(ResourceExt::name_any).collect::<Vec<_>>()
        );
        nodes
    }

    /// "300m", "2", "1.5" as millicores.
    fn millicores(q: &str) -> u64 {
        match q.strip_suffix('m') {
            Some(m) => m.parse().expect("millicores"),
            None => (q.parse::<f64>().expect("cores") * 1000.0).round() as u64,
        }
    }

    /// What a pod requests (CPU millicores, memory bytes), summed over its containers.
    fn requests(pod: &Pod) -> (u64, u64) {
        let mut total = (0, 0);
        for c in pod.spec.iter().flat_map(|s| &s.containers) {
            let r = c.resources.as_ref().and_then(|r| r.requests.as_ref());
            if let Some(cpu) = r.and_then(|r| r.get("cpu")) {
                total.0 += millicores(&cpu.0);
            }
            if let Some(mem) = r.and_then(|r| r.get("memory")) {
                total.1 += parse_bytes(&mem.0).expect("memory request");
            }
        }
        total
    }

    /// A node's allocatable CPU and memory less what its live pods request.
    async fn free(client: &Client, node: &Node) -> (u64, u64) {
        let allocatable = node
            .status
            .as_ref()
            .and_then(|s| s.allocatable.clone())
            .unwrap_or_default();
        let cpu = allocatable.get("cpu").map_or(0, |q| millicores(&q.0));
        let memory = allocatable
            .get("memory")
            .map_or(0, |q| parse_bytes(&q.0).expect("allocatable memory"));
        let live = ListParams::default().fields(&format!(
            "spec.nodeName={},status.phase!=Succeeded,status.phase!=Failed",
            node.name_any()
        ));
        let pods = Api::<Pod>::all(client.clone())
            .list(&live)
            .await
            .expect("pods on the node");
        pods.items
            .iter()
            .map(requests)
            .fold((cpu, memory), |(c, m), (rc, rm)| {
                (c.saturating_sub(rc), m.saturating_sub(rm))
            })
    }

    /// The stage pods of the job's last attempt, and the nodes they ran on.
    async fn stage_pods(ns: &TestNs, job: &str, attempt: u32) -> (Vec<Pod>, BTreeSet<String>) {
        let prefix = format!("{job}-a{attempt}-s");
        let pods: Vec<Pod> = ns
            .pod_list()
            .await
            .into_iter()
            .filter(|p| p.name_any().starts_with(&prefix))
            .collect();
        let nodes = pods
            .iter()
            .filter_map(|p| p.spec.as_ref()?.node_name.clone())
            .collect();
        (pods, nodes)
    }

    fn has_pod_affinity(pod: &Pod) -> bool {
        pod.spec
            .as_ref()
            .and_then(|s| s.affinity.as_ref())
            .is_some_and(|a| a.pod_affinity.is_some())
    }

    #[tokio::test]
    #[ignore = "needs a cluster of several nodes with Headroom installed: make e2e-kind"]
    async fn read_write_once_stages_share_a_node_while_another_has_room() {
        let client = Client::try_default().await.expect("KUBECONFIG");
        assert_eq!(
            operator_checkpoint_access(&client).await,
            "ReadWriteOnce",
            "the chart's default checkpoint access mode"
        );
        let workers = workers(&client).await;
        let ns = TestNs::new(E2E, "e2e-rwo-nodes").await;
        ns.apply_job(CPU_PIPELINE).await;
        let status = ns.wait_succeeded("split-to-fit", RUN).await;
        let attempt = status.attempts.last().expect("an attempt");
        assert_eq!(attempt.outcome, AttemptOutcome::Succeeded);
        let stages = attempt.stages as usize;
        assert!(stages >= 2, "planned as {stages} stage(s)");
        let (pods, nodes) = stage_pods(&ns, "split-to-fit", attempt.number).await;
        assert_eq!(pods.len(), stages, "{}", ns.dump().await);
        assert_eq!(nodes.len(), 1, "stages on {nodes:?}");
        assert!(pods.iter().all(has_pod_affinity), "{pods:?}");
        // Another worker could have taken every stage: the shared node was
        // the checkpoint volume's choice, not the only one with room.
        let node = nodes.first().expect("a node");
        let need = pods
            .iter()
            .map(requests)
            .fold((0, 0), |(c, m), (rc, rm)| (c + rc, m + rm));
        let mut room_elsewhere = Vec::new();
        for w in workers.iter().filter(|w| w.name_any() != *node) {
            let (cpu, memory) = free(&client, w).await;
            if cpu >= need.0 && memory >= need.1 {
                room_elsewhere.push(w.name_any());
            }
        }
        assert!(
            !room_elsewhere.is_empty(),
            "no other worker has room for {need:?} (millicores, bytes)"
        );
        ns.cleanup().await;
    }

    /// The node the job's first pod is bound to, once it is.
    async fn bound_node(ns: &TestNs, job: &str) -> String {
        let pod = format!("{job}-a1-s0");
        ns.wait_for(
            &format!("{pod} bound"),
            Duration::from_secs(120),
            || async {
                ns.pods()
                    .get_opt(&pod)
                    .await
                    .ok()
                    .flatten()
                    .and_then(|p| p.spec?.node_name)
            },
        )
        .await
    }

    /// Two workers labelled as GPU Feature Discovery labels an A100 node
    /// and a T4 node, with `nvidia.com/gpu` advertised.
    struct GpuWorkers {
        nodes: Api<Node>,
        a100: String,
        t4: String,
    }

    impl GpuWorkers {
        async fn label() -> Self {
            let client = Client::try_default().await.expect("KUBECONFIG");
            let workers: Vec<String> = workers(&client)
                .await
                .iter()
                .map(ResourceExt::name_any)
                .collect();
            let (a100, t4) = (workers[0].clone(), workers[1].clone());
            let nodes: Api<Node> = Api::all(client);
            label_gpu(&nodes, &a100, BIG_GPU, 81920).await;
            label_gpu(&nodes, &t4, SMALL_GPU, 15360).await;
            // The operator plans from its node cache: let the watch deliver the changes.
            tokio::time::sleep(Duration::from_secs(2)).await;
            GpuWorkers { nodes, a100, t4 }
        }

        /// Removes the labels; what could not be undone.
        async fn unlabel(&self) -> Vec<String> {
            let mut problems = unlabel_gpu(&self.nodes, &self.a100).await;
            problems.extend(unlabel_gpu(&self.nodes, &self.t4).await);
            problems
        }
    }

    /// Each GPU job is planned on its type and its pod bound to that type's
    /// node; with `queue`, the jobs name that LocalQueue (Kueue admits them).
    async fn gpu_placement(ns: TestNs, a100_node: String, t4_node: String, queue: Option<String>) {
        for job in [GPU_NEEDS_A100, GPU_FITS_A_T4] {
            match &queue {
                Some(q) => ns.apply_job(&queued(job, q, None)).await,
                None => ns.apply_job(job).await,
            };
        }
        for (job, device, node) in [
            ("needs-a100", BIG_GPU, &a100_node),
            ("fits-a-t4", SMALL_GPU, &t4_node),
        ] {
            let planned = ns
                .wait_job(job, "a plan", Duration::from_secs(60), |j| {
                    plan_device(j).is_some() || job_failed(j)
                })
                .await;
            assert_eq!(
                plan_device(&planned).as_deref(),
                Some(device),
                "{job}: {:?}",
                planned.status.as_ref().map(|s| &s.message)
            );
            assert_eq!(
                &bound_node(&ns, job).await,
                node,
                "{job}'s pod runs on the node labelled {device}"
            );
        }
    }

    #[tokio::test]
    #[ignore = "needs a cluster of several nodes with Headroom installed: make e2e-kind"]
    async fn gfd_labelled_workers_get_the_pods_of_the_jobs_that_need_them() {
        let _nodes = NODES.lock().await;
        let gpus = GpuWorkers::label().await;
        let ns = TestNs::new(E2E, "e2e-gpu-nodes").await;
        let outcome = tokio::spawn(gpu_placement(
            ns.clone(),
            gpus.a100.clone(),
            gpus.t4.clone(),
            None,
        ))
        .await;
        let _ = ns
            .jobs()
            .delete_collection(&DeleteParams::default(), &ListParams::default())
            .await;
        let problems = gpus.unlabel().await;
        if let Err(e) = outcome {
            std::panic::resume_unwind(e.into_panic());
        }
        assert!(problems.is_empty(), "cleanup: {problems:?}");
        ns.cleanup().await;
    }

    /// The same two GPU types as Kueue ResourceFlavors of one ClusterQueue
    /// (one GPU of quota each, matched to the nodes by GFD's product
    /// label): Kueue admits each job's pod group in the flavor of the type
    /// Headroom planned, and each pod lands on its type's node.
    #[tokio::test]
    #[ignore = "needs a cluster of several nodes with Headroom and Kueue installed: make e2e-kind"]
    async fn kueue_flavors_per_gpu_type_admit_each_job_on_its_type() {
        let _nodes = NODES.lock().await;
        let gpus = GpuWorkers::label().await;
        let ns = TestNs::new(E2E, "e2e-kueue-gpu").await;
        ns.opt_into_kueue().await;
        const QUOTA: &[(&str, &str)] = &[("nvidia.com/gpu", "1"), ("cpu", "2"), ("memory", "2Gi")];
        let flavor = |suffix, product: &str| FlavorSpec {
            suffix,
            node_labels: BTreeMap::from([("nvidia.com/gpu.product".into(), product.into())]),
            quota: QUOTA,
        };
        let queue = ns
            .kueue_queue(&QueueSpec {
                flavors: vec![flavor("a100", BIG_GPU), flavor("t4", SMALL_GPU)],
                ..QueueSpec::default()
            })
            .await;
        let outcome = tokio::spawn(gpu_placement(
            ns.clone(),
            gpus.a100.clone(),
            gpus.t4.clone(),
            Some(queue.local.clone()),
        ))
        .await;
        let _ = ns
            .jobs()
            .delete_collection(&DeleteParams::default(), &ListParams::default())
            .await;
        let problems = gpus.unlabel().await;
        ns.delete_kueue_objects(&queue, &[]).await;
        if let Err(e) = outcome {
            std::panic::resume_unwind(e.into_panic());
        }
        assert!(problems.is_empty(), "cleanup: {problems:?}");
        ns.cleanup().await;
    }

    /// A pod on `node` that requests `millicores` and does nothing.
    fn filler(node: &str, millicores: u64) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": format!("filler-{node}")},
            "spec": {
                "nodeName": node,
                "automountServiceAccountToken": false,
                "securityContext": {"runAsNonRoot": true, "runAsUser": 65535, "seccompProfile": {"type": "RuntimeDefault"}},
                "containers": [{
                    "name": "pause", "image": PAUSE_IMAGE, "imagePullPolicy": "Never",
                    "resources": {"requests": {"cpu": format!("{millicores}m")}},
                    "securityContext": {"allowPrivilegeEscalation": false, "capabilities": {"drop": ["ALL"]}, "readOnlyRootFilesystem": true},
                }],
            },
        }))
        .expect("filler pod")
    }

    async fn spread(ns: TestNs, workers: Vec<Node>) {
        // What each stage pod requests: the job's cores (a whole core by default).
        let job: MemoryAwareTrainingJob =
            serde_yaml::from_str(CPU_PIPELINE).expect("the sample job");
        let cores = job.spec.resources.cpu.expect("a CPU job").cores;
        let stage_cpu = cores.map_or(1000, |q| millicores(&q.0));
        // Earlier tests' pods still terminating hold CPU they are about to give
        // back, room the fillers would not account for.
        ns.wait_for("no pod terminating", Duration::from_secs(180), || async {
            let pods = Api::<Pod>::all(ns.client.clone())
                .list(&ListParams::default())
                .await
                .ok()?;
            (!pods
                .items
                .iter()
                .any(|p| p.metadata.deletion_timestamp.is_some()))
            .then_some(())
        })
        .await;
        // Each worker keeps room for one stage, not two.
        for w in &workers {
            let (cpu, _) = free(&ns.client, w).await;
            let keep = stage_cpu + stage_cpu / 2;
            assert!(cpu > keep, "{} has only {cpu}m free", w.name_any());
            ns.pods()
                .create(&PostParams::default(), &filler(&w.name_any(), cpu - keep))
                .await
                .expect("filler pod");
        }
        ns.wait_pods("the fillers running", Duration::from_secs(120), |pods| {
            pods.iter().filter(|p| pod_phase(p) == "Running").count() == workers.len()
        })
        .await;

        ns.apply_job(CPU_PIPELINE).await;
        let status = ns.wait_succeeded("split-to-fit", RUN).await;
        let attempt = status.attempts.last().expect("an attempt");
        let stages = attempt.stages as usize;
        assert!(stages >= 2, "planned as {stages} stage(s)");
        let (pods, nodes) = stage_pods(&ns, "split-to-fit", attempt.number).await;
        assert_eq!(pods.len(), stages, "{}", ns.dump().await);
        assert_eq!(nodes.len(), stages, "one stage per node: {nodes:?}");
        assert!(!pods.iter().any(has_pod_affinity), "{pods:?}");
        let claims: Api<PersistentVolumeClaim> = Api::namespaced(ns.client.clone(), &ns.name);
        let claim = claims
            .get("split-to-fit-checkpoints")
            .await
            .expect("the checkpoint claim");
        assert_eq!(
            claim.spec.and_then(|s| s.access_modes),
            Some(vec!["ReadWriteMany".to_string()])
        );
    }

    #[tokio::test]
    #[ignore = "needs several nodes and Headroom with ReadWriteMany checkpoints: make e2e-kind"]
    async fn read_write_many_stages_train_on_several_nodes_when_none_has_room_for_two() {
        let _nodes = NODES.lock().await;
        let client = Client::try_default().await.expect("KUBECONFIG");
        assert_eq!(
            operator_checkpoint_access(&client).await,
            "ReadWriteMany",
            "install with --set checkpoints.accessMode=ReadWriteMany (e2e/kind.sh does)"
        );
        let workers = workers(&client).await;
        let ns = TestNs::new(E2E, "e2e-rwx-nodes").await;
        let outcome = tokio::spawn(spread(ns.clone(), workers)).await;
        // The fillers go with the namespace; make sure they go now.
        let _ = ns
            .pods()
            .delete_collection(&DeleteParams::default(), &ListParams::default())
            .await;
        if let Err(e) = outcome {
            std::panic::resume_unwind(e.into_panic());
        }
        ns.cleanup().await;
    }
}
