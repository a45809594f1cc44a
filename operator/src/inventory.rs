//! Node and Pod objects → the planner's [`NodeFacts`], and the inventory one
//! job may use: the nodes its workers may be placed on (its node selector,
//! the taints it tolerates), less the devices any pod already holds.

use std::collections::BTreeMap;

use headroom_api::MemoryAwareTrainingJob;
use headroom_planner::{DeviceKind, Inventory, NodeFacts};
use k8s_openapi::api::core::v1::{
    Container, Node, Pod, PodSpec, PodStatus, ResourceRequirements, Taint, Toleration,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use headroom_api::quantity::{parse_bytes, parse_cores};
use headroom_planner::units::format_bytes;

/// Extended resources that count devices (`nvidia.com/gpu`, `nvidia.com/mig-…`).
fn is_device_resource(name: &str) -> bool {
    name.starts_with("nvidia.com/")
}

/// Device counts requested by a pod that still holds its devices.
fn pod_device_requests(pod: &Pod) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    let terminal = pod
        .status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .is_some_and(|p| p == "Succeeded" || p == "Failed");
    let Some(spec) = pod.spec.as_ref().filter(|_| !terminal) else {
        return out;
    };
    for container in &spec.containers {
        let resources = container.resources.as_ref();
        // Extended resources must have requests == limits; either may be given.
        let declared = resources.and_then(|r| r.limits.as_ref().or(r.requests.as_ref()));
        for (name, quantity) in declared.into_iter().flatten() {
            if is_device_resource(name)
                && let Ok(n) = parse_bytes(&quantity.0)
            {
                *out.entry(name.clone()).or_insert(0) += n;
            }
        }
    }
    out
}

/// What the planner needs from one node, given the pods that may be bound to it.
pub fn node_facts<'a>(node: &Node, pods: impl IntoIterator<Item = &'a Pod>) -> NodeFacts {
    let name = node.metadata.name.clone().unwrap_or_default();
    let labels = node.metadata.labels.clone().unwrap_or_default();
    let reported = node.status.as_ref().and_then(|s| s.allocatable.as_ref());
    let allocatable = reported
        .map(|a| {
            a.iter()
                .filter(|(k, _)| is_device_resource(k))
                .filter_map(|(k, q)| parse_bytes(&q.0).ok().map(|n| (k.clone(), n)))
                .collect()
        })
        .unwrap_or_default();
    let mut in_use: BTreeMap<String, u64> = BTreeMap::new();
    for pod in pods
        .into_iter()
        .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(name.as_str()))
    {
        for (resource, n) in pod_device_requests(pod) {
            *in_use.entry(resource).or_insert(0) += n;
        }
    }
    let cordoned = node
        .spec
        .as_ref()
        .and_then(|s| s.unschedulable)
        .unwrap_or(false);
    // A node object without conditions (e.g. from a file) is taken as Ready.
    let not_ready = node
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|c| c.iter().find(|c| c.type_ == "Ready"))
        .is_some_and(|c| c.status != "True");
    let host_memory_bytes = reported
        .and_then(|a| a.get("memory"))
        .and_then(|q| parse_bytes(&q.0).ok());
    NodeFacts {
        name,
        labels,
        allocatable,
        allocatable_reported: reported.is_some_and(|a| !a.is_empty()),
        host_memory_bytes,
        in_use,
        schedulable: !cordoned && !not_ready,
    }
}

/// The toleration every GPU worker carries: GPU nodes are commonly tainted
/// `nvidia.com/gpu:NoSchedule` so that only pods that need a GPU land there.
pub fn gpu_toleration() -> Toleration {
    Toleration {
        key: Some("nvidia.com/gpu".into()),
        operator: Some("Exists".into()),
        effect: Some("NoSchedule".into()),
        ..Toleration::default()
    }
}

/// The tolerations of a job's worker pods on `kind` devices: the user's
/// (`spec.worker.tolerations`), then Headroom's GPU one.
pub fn worker_tolerations(job: &MemoryAwareTrainingJob, kind: DeviceKind) -> Vec<Toleration> {
    let mut out = job.spec.worker.tolerations.clone();
    if kind == DeviceKind::Gpu {
        out.push(gpu_toleration());
    }
    out
}

/// The scheduler's rule: an empty effect matches every effect; `Exists`
/// with an empty key matches every taint; `Equal` (the default) needs the
/// same key and value.
fn tolerates(toleration: &Toleration, taint: &Taint) -> bool {
    let effect_ok = toleration
        .effect
        .as_deref()
        .is_none_or(|e| e.is_empty() || e == taint.effect);
    let key = toleration.key.as_deref().unwrap_or("");
    let matches = match toleration.operator.as_deref().unwrap_or("Equal") {
        "Exists" => key.is_empty() || key == taint.key,
        _ => {
            key == taint.key
                && toleration.value.as_deref().unwrap_or("") == taint.value.as_deref().unwrap_or("")
        }
    };
    effect_ok && matches
}

/// Whether a worker pod with this node selector and these tolerations may
/// be placed on `node`: every selector label matches, and every NoSchedule
/// or NoExecute taint is tolerated (PreferNoSchedule only prefers).
pub fn admits(
    node: &Node,
    selector: &BTreeMap<String, String>,
    tolerations: &[Toleration],
) -> bool {
    refusal(node, selector, tolerations).is_none()
}

/// Why [`admits`] says no: the first selector label the node lacks, or
/// the first taint no toleration matches.
fn refusal(
    node: &Node,
    selector: &BTreeMap<String, String>,
    tolerations: &[Toleration],
) -> Option<String> {
    let labels = node.metadata.labels.as_ref();
    if let Some((k, v)) = selector
        .iter()
        .find(|(k, v)| labels.and_then(|l| l.get(*k)) != Some(*v))
    {
        return Some(format!("no label {k}={v}"));
    }
    let taints = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_deref())
        .unwrap_or(&[]);
    taints
        .iter()
        .filter(|t| t.effect == "NoSchedule" || t.effect == "NoExecute")
        .find(|taint| !tolerations.iter().any(|t| tolerates(t, taint)))
        .map(|t| {
            format!(
                "taint {}{}:{} not tolerated",
                t.key,
                t.value
                    .as_deref()
                    .map(|v| format!("={v}"))
                    .unwrap_or_default(),
                t.effect
            )
        })
}

/// The GPU inventory `job` may plan with: the nodes its GPU workers may be
/// placed on, less the devices `pods` hold; with `one_node`, each device
/// type's free count is one node's (the job's stages must share a node).
pub fn job_inventory<'a>(
    job: &MemoryAwareTrainingJob,
    nodes: impl IntoIterator<Item = &'a Node>,
    pods: impl IntoIterator<Item = &'a Pod>,
    one_node: bool,
) -> Inventory {
    // One pass over the pods, not one per node.
    let mut by_node: BTreeMap<&str, Vec<&Pod>> = BTreeMap::new();
    for pod in pods {
        if let Some(node) = pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) {
            by_node.entry(node).or_default().push(pod);
        }
    }
    let tolerations = worker_tolerations(job, DeviceKind::Gpu);
    let mut facts: Vec<NodeFacts> = Vec::new();
    let mut left_out = Vec::new();
    for node in nodes {
        let name = node.metadata.name.as_deref().unwrap_or_default();
        let node_facts = node_facts(node, by_node.get(name).into_iter().flatten().copied());
        match refusal(node, &job.spec.worker.node_selector, &tolerations) {
            None => facts.push(node_facts),
            // Only nodes that offer GPUs are worth naming.
            Some(why) if !Inventory::from_nodes([&node_facts]).devices.is_empty() => {
                left_out.push(format!("{name} ({why})"));
            }
            Some(_) => {}
        }
    }
    let mut inventory = Inventory::from_nodes(&facts);
    inventory.left_out = left_out;
    if one_node {
        inventory.on_one_node()
    } else {
        inventory
    }
}

/// Whether a pod holds devices the inventory counts (a non-terminal pod
/// requesting a GPU or MIG slice). Device requests are immutable, so a pod
/// that holds none never will.
pub fn holds_devices(pod: &Pod) -> bool {
    !pod_device_requests(pod).is_empty()
}

/// Keeps only what [`node_facts`] reads of a pod cached for its device
/// requests: name, namespace, node, phase and device quantities. The
/// operator caches every device-holding pod in the cluster (not only its
/// own: other workloads' GPUs are not free), so each entry stays small.
pub fn keep_device_facts(pod: &mut Pod) {
    let meta = std::mem::take(&mut pod.metadata);
    pod.metadata = ObjectMeta {
        name: meta.name,
        namespace: meta.namespace,
        uid: meta.uid,
        resource_version: meta.resource_version,
        ..ObjectMeta::default()
    };
    let devices_only = |m: Option<BTreeMap<String, _>>| {
        m.map(|m| {
            m.into_iter()
                .filter(|(k, _)| is_device_resource(k))
                .collect::<BTreeMap<_, _>>()
        })
    };
    pod.spec = pod.spec.take().map(|spec| PodSpec {
        node_name: spec.node_name,
        containers: spec
            .containers
            .into_iter()
            .map(|c| Container {
                name: c.name,
                resources: c.resources.map(|r| ResourceRequirements {
                    limits: devices_only(r.limits),
                    requests: devices_only(r.requests),
                    ..ResourceRequirements::default()
                }),
                ..Container::default()
            })
            .collect(),
        ..PodSpec::default()
    });
    pod.status = pod.status.take().map(|s| PodStatus {
        phase: s.phase,
        ..PodStatus::default()
    });
}

/// What one CPU worker of `job` takes: its memory limit (bytes) and its
/// cores (1 when the spec names none). `None` for a GPU job.
pub fn cpu_worker_size(job: &MemoryAwareTrainingJob) -> Option<(u64, f64)> {
    let cpu = job.spec.resources.cpu.as_ref()?;
    let limit = parse_bytes(&cpu.memory_limit.0).ok()?.max(1);
    let cores = match &cpu.cores {
        Some(c) => parse_cores(&c.0).ok()?,
        None => 1.0,
    };
    Some((limit, cores))
}

/// The CPU inventory `job` may plan with: how many of its workers (each
/// `memoryLimit` of memory and `cores` of CPU) the nodes its pods may use can
/// hold, by their allocatable memory and CPU. Nodes too small for one worker
/// are named in `left_out` with their figures, so a job no node could ever
/// hold is refused with numbers. What other pods use is not counted (the
/// operator does not watch every pod): a full node shows up as unschedulable
/// pods, and the job waits. `None` when no node is known (a control plane
/// without kubelets): the job's own budget is then all there is to plan with.
pub fn cpu_inventory<'a>(
    job: &MemoryAwareTrainingJob,
    nodes: impl IntoIterator<Item = &'a Node>,
    one_node: bool,
) -> Option<Inventory> {
    let cpu = job.spec.resources.cpu.as_ref()?;
    let (limit, cores) = cpu_worker_size(job)?;
    let tolerations = worker_tolerations(job, DeviceKind::Cpu);
    let (mut free, mut free_one, mut total, mut total_one) = (0u32, 0u32, 0u32, 0u32);
    let mut left_out = Vec::new();
    let mut seen = false;
    for node in nodes {
        seen = true;
        let name = node.metadata.name.as_deref().unwrap_or_default();
        if let Some(why) = refusal(node, &job.spec.worker.node_selector, &tolerations) {
            left_out.push(format!("{name} ({why})"));
            continue;
        }
        let alloc = node.status.as_ref().and_then(|s| s.allocatable.as_ref());
        let get = |k: &str| alloc.and_then(|a| a.get(k)).map(|q| q.0.clone());
        let memory = get("memory")
            .and_then(|q| parse_bytes(&q).ok())
            .unwrap_or(0);
        let node_cores = get("cpu").and_then(|q| parse_cores(&q).ok()).unwrap_or(0.0);
        let fit = (memory / limit).min((node_cores / cores + 1e-9).floor() as u64);
        let fit = u32::try_from(fit).unwrap_or(u32::MAX);
        if fit == 0 {
            left_out.push(format!(
                "{name} (allocatable {} memory and {node_cores} cpu; one worker needs {} and {cores} cpu)",
                format_bytes(memory),
                format_bytes(limit)
            ));
            continue;
        }
        total = total.saturating_add(fit);
        total_one = total_one.max(fit);
        if node_facts(node, []).schedulable {
            free = free.saturating_add(fit);
            free_one = free_one.max(fit);
        }
    }
    if !seen {
        return None;
    }
    let cap = cpu.max_workers.max(1);
    let mut inventory = Inventory::cpu(limit, cap);
    let device = &mut inventory.devices[0];
    device.free = free.min(cap);
    device.free_on_one_node = free_one.min(cap);
    device.total = total.min(cap);
    device.total_on_one_node = total_one.min(cap);
    inventory.left_out = left_out;
    Some(if one_node {
        inventory.on_one_node()
    } else {
        inventory
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn from_yaml<T: serde::de::DeserializeOwned>(y: &str) -> T {
        serde_yaml::from_str(y).expect("fixture")
    }

    /// A Node as GFD labels it in the mixed MIG strategy and the device
    /// plugin advertises it: one A100-80GB cut into seven 1g.10gb slices.
    /// Only the slices are devices (a worker pod requests
    /// `nvidia.com/mig-1g.10gb`, see controller/pods/worker.rs), not the full GPU its labels describe.
    #[test]
    fn a_mixed_mig_node_offers_its_slices_and_no_full_gpu() {
        let node: Node = from_yaml(
            r#"
metadata:
  name: mig-1
  labels:
    nvidia.com/gpu.product: NVIDIA-A100-SXM4-80GB
    nvidia.com/gpu.memory: "81920"
    nvidia.com/gpu.count: "1"
    nvidia.com/mig.strategy: mixed
    nvidia.com/mig-1g.10gb.count: "7"
    nvidia.com/mig-1g.10gb.memory: "9728"
    nvidia.com/mig-1g.10gb.product: NVIDIA-A100-SXM4-80GB-MIG-1g.10gb
status:
  allocatable: {nvidia.com/mig-1g.10gb: "7", memory: 1Ti, cpu: "64", pods: "110"}
"#,
        );
        let facts = node_facts(&node, &[]);
        let inv = Inventory::from_nodes([&facts]);
        let devices: Vec<_> = inv
            .devices
            .iter()
            .map(|d| (d.name.as_str(), d.resource.as_str(), d.free))
            .collect();
        assert_eq!(
            devices,
            [(
                "NVIDIA-A100-SXM4-80GB-MIG-1g.10gb",
                "nvidia.com/mig-1g.10gb",
                7
            )]
        );
    }

    #[test]
    fn counts_free_gpus_from_allocatable_and_bound_pods() {
        let node: Node = from_yaml(
            r#"
metadata:
  name: gpu-1
  labels: {nvidia.com/gpu.product: NVIDIA-L4, nvidia.com/gpu.memory: "23034", nvidia.com/gpu.count: "4"}
status:
  allocatable: {nvidia.com/gpu: "4", memory: 64Gi, cpu: "16"}
  conditions: [{type: Ready, status: "True"}]
"#,
        );
        let running: Pod = from_yaml(
            r#"
spec:
  nodeName: gpu-1
  containers: [{name: w, resources: {limits: {nvidia.com/gpu: "3"}}}]
status: {phase: Running}
"#,
        );
        let done: Pod = from_yaml(
            r#"
spec:
  nodeName: gpu-1
  containers: [{name: w, resources: {limits: {nvidia.com/gpu: "1"}}}]
status: {phase: Succeeded}
"#,
        );
        let facts = node_facts(&node, &[running.clone(), done.clone()]);
        assert_eq!(facts.allocatable.get("nvidia.com/gpu"), Some(&4));
        assert_eq!(facts.in_use.get("nvidia.com/gpu"), Some(&3));
        assert!(facts.schedulable);
        assert!(!facts.allocatable.contains_key("memory"));
        // Host memory is kept apart: GPU pods request their host-side bytes from it.
        assert_eq!(facts.host_memory_bytes, Some(64 << 30));
        assert!(holds_devices(&running) && !holds_devices(&done));
    }

    #[test]
    fn placement_follows_the_schedulers_selector_and_taint_rules() {
        let node: Node = from_yaml(
            r#"
metadata: {name: n, labels: {pool: train, zone: a}}
spec:
  taints:
  - {key: nvidia.com/gpu, value: present, effect: NoSchedule}
  - {key: dedicated, value: research, effect: NoExecute}
  - {key: soft, effect: PreferNoSchedule}
"#,
        );
        let tol = |y: &str| -> Toleration { from_yaml(y) };
        let gpu = gpu_toleration();
        let research = tol("{key: dedicated, operator: Equal, value: research}");
        let selector = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        let none = selector(&[]);
        assert!(admits(&node, &none, &[gpu.clone(), research.clone()]));
        assert!(
            !admits(&node, &none, std::slice::from_ref(&gpu)),
            "dedicated not tolerated"
        );
        assert!(
            !admits(&node, &none, std::slice::from_ref(&research)),
            "the GPU taint not tolerated"
        );
        let other_value = tol("{key: dedicated, value: production}");
        assert!(!admits(&node, &none, &[gpu.clone(), other_value]));
        let wrong_effect = tol("{key: dedicated, value: research, effect: NoSchedule}");
        assert!(!admits(&node, &none, &[gpu.clone(), wrong_effect]));
        assert!(
            admits(&node, &none, &[tol("{operator: Exists}")]),
            "tolerates everything"
        );
        assert!(admits(
            &node,
            &selector(&[("pool", "train")]),
            &[gpu.clone(), research.clone()]
        ));
        assert!(!admits(
            &node,
            &selector(&[("pool", "serve")]),
            &[gpu.clone(), research.clone()]
        ));
        assert!(!admits(
            &node,
            &selector(&[("gpu", "yes")]),
            &[gpu, research]
        ));
    }

    #[test]
    fn a_jobs_inventory_counts_only_nodes_its_workers_may_use() {
        let gpu_node = |name: &str, product: &str, extra: &str| -> Node {
            from_yaml(&format!(
                "metadata: {{name: {name}, labels: {{nvidia.com/gpu.product: {product}, nvidia.com/gpu.memory: \"81920\"{extra}}}}}\nstatus: {{allocatable: {{nvidia.com/gpu: \"8\"}}}}\n"
            ))
        };
        let mut tainted = gpu_node("tainted", "A", ", pool: train");
        tainted.spec = Some(from_yaml(
            "taints: [{key: dedicated, value: research, effect: NoSchedule}]",
        ));
        let nodes = [
            tainted,
            gpu_node("plain", "B", ", pool: train"),
            gpu_node("other-pool", "C", ""),
        ];
        let mut job: MemoryAwareTrainingJob =
            from_yaml(include_str!("../../samples/gpu-gpt2-medium.yaml"));
        let names = |inv: &Inventory| -> Vec<String> {
            inv.devices.iter().map(|d| d.name.clone()).collect()
        };

        let all = job_inventory(&job, &nodes, std::iter::empty(), false);
        assert_eq!(
            names(&all),
            vec!["B", "C"],
            "the tainted node is not tolerated"
        );
        assert_eq!(
            all.left_out,
            vec!["tainted (taint dedicated=research:NoSchedule not tolerated)"]
        );
        job.spec
            .worker
            .node_selector
            .insert("pool".into(), "train".into());
        job.spec.worker.tolerations = vec![from_yaml("{key: dedicated, operator: Exists}")];
        let placed = job_inventory(&job, &nodes, std::iter::empty(), false);
        assert_eq!(
            names(&placed),
            vec!["A", "B"],
            "the pool, with the research nodes"
        );
        assert_eq!(placed.left_out, vec!["other-pool (no label pool=train)"]);
    }

    #[test]
    fn a_pod_cached_for_its_devices_keeps_only_what_the_inventory_reads() {
        let mut pod: Pod = from_yaml(
            r#"
metadata:
  name: other-team-trainer
  namespace: research
  labels: {app: trainer}
  annotations: {big: "a large annotation"}
spec:
  nodeName: gpu-1
  containers:
  - name: w
    image: example/trainer:1
    env: [{name: A, value: b}]
    resources: {limits: {nvidia.com/gpu: "2", memory: 64Gi}, requests: {cpu: "8", nvidia.com/gpu: "2"}}
status: {phase: Running, podIP: 10.0.0.9}
"#,
        );
        let node: Node =
            from_yaml("metadata: {name: gpu-1}\nstatus: {allocatable: {nvidia.com/gpu: \"8\"}}\n");
        let before = node_facts(&node, std::slice::from_ref(&pod));
        keep_device_facts(&mut pod);
        assert_eq!(node_facts(&node, std::slice::from_ref(&pod)), before);
        assert_eq!(before.in_use.get("nvidia.com/gpu"), Some(&2));
        let yaml = serde_yaml::to_string(&pod).expect("yaml");
        for gone in [
            "labels",
            "annotations",
            "image",
            "env",
            "memory",
            "cpu",
            "podIP",
        ] {
            assert!(!yaml.contains(gone), "{gone} kept:\n{yaml}");
        }
    }

    #[test]
    fn cordoned_or_not_ready_nodes_are_not_schedulable() {
        let cordoned: Node = from_yaml("metadata: {name: a}\nspec: {unschedulable: true}\n");
        assert!(!node_facts(&cordoned, &[]).schedulable);
        let not_ready: Node = from_yaml(
            "metadata: {name: b}\nstatus: {conditions: [{type: Ready, status: \"False\"}]}\n",
        );
        assert!(!node_facts(&not_ready, &[]).schedulable);
    }
}
