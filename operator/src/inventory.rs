//! Node and Pod objects → the planner's [`NodeFacts`].

use std::collections::BTreeMap;

use headroom_planner::NodeFacts;
use k8s_openapi::api::core::v1::{Container, Node, Pod, PodSpec, PodStatus, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use headroom_api::quantity::parse_bytes;

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
    let allocatable = node
        .status
        .as_ref()
        .and_then(|s| s.allocatable.as_ref())
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
    NodeFacts {
        name,
        labels,
        allocatable,
        in_use,
        schedulable: !cordoned && !not_ready,
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

#[cfg(test)]
mod tests {
    use super::*;

    fn from_yaml<T: serde::de::DeserializeOwned>(y: &str) -> T {
        serde_yaml::from_str(y).expect("fixture")
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
        assert!(holds_devices(&running) && !holds_devices(&done));
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
