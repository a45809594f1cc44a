//! Nodes labelled as NVIDIA's GPU Feature Discovery labels them, with
//! `nvidia.com/gpu` advertised in their status (a PATCH of the node's status,
//! the documented way to advertise an extended resource), for the scenarios
//! that place GPU jobs without a GPU; and what a job's status says of its plan.

use headroom_api::{JobPhase, MemoryAwareTrainingJob};
use k8s_openapi::api::core::v1::Node;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;

/// The labels GFD puts on a GPU node that Headroom's inventory reads.
pub const GFD_LABELS: [&str; 3] = [
    "nvidia.com/gpu.product",
    "nvidia.com/gpu.memory",
    "nvidia.com/gpu.count",
];

/// Labels `node` as one GPU of `product` with `memory_mib` and advertises it.
pub async fn label_gpu(nodes: &Api<Node>, node: &str, product: &str, memory_mib: u32) {
    let labels = json!({"metadata": {"labels": {
        "nvidia.com/gpu.product": product,
        "nvidia.com/gpu.memory": memory_mib.to_string(),
        "nvidia.com/gpu.count": "1",
    }}});
    nodes
        .patch(node, &PatchParams::default(), &Patch::Merge(&labels))
        .await
        .expect("label the node");
    // Capacity, and allocatable too: the kubelet copies capacity to
    // allocatable only on its next status update, and neither the scheduler
    // nor the operator should wait for it.
    let gpu = json!({"status": {
        "capacity": {"nvidia.com/gpu": "1"},
        "allocatable": {"nvidia.com/gpu": "1"},
    }});
    nodes
        .patch_status(node, &PatchParams::default(), &Patch::Merge(&gpu))
        .await
        .expect("advertise nvidia.com/gpu");
}

/// Undoes [`label_gpu`] and checks that nothing is left; what could not be
/// undone. Safe on a node that was never labelled.
pub async fn unlabel_gpu(nodes: &Api<Node>, node: &str) -> Vec<String> {
    let mut problems = Vec::new();
    let labels: serde_json::Map<String, serde_json::Value> = GFD_LABELS
        .iter()
        .map(|l| ((*l).to_string(), serde_json::Value::Null))
        .collect();
    let unlabel = json!({"metadata": {"labels": labels}});
    if let Err(e) = nodes
        .patch(node, &PatchParams::default(), &Patch::Merge(&unlabel))
        .await
    {
        problems.push(format!("unlabel {node}: {e}"));
    }
    let no_gpu = json!({"status": {
        "capacity": {"nvidia.com/gpu": null},
        "allocatable": {"nvidia.com/gpu": null},
    }});
    if let Err(e) = nodes
        .patch_status(node, &PatchParams::default(), &Patch::Merge(&no_gpu))
        .await
    {
        problems.push(format!("remove nvidia.com/gpu from {node}: {e}"));
    }
    match nodes.get(node).await {
        Ok(n) => {
            let left: Vec<&String> = n
                .labels()
                .keys()
                .filter(|k| GFD_LABELS.contains(&k.as_str()))
                .collect();
            let advertised = n.status.as_ref().is_some_and(|s| {
                [&s.capacity, &s.allocatable]
                    .iter()
                    .any(|r| r.as_ref().is_some_and(|r| r.contains_key("nvidia.com/gpu")))
            });
            if !left.is_empty() || advertised {
                problems.push(format!(
                    "{node} still has {left:?} / nvidia.com/gpu advertised: {advertised}"
                ));
            }
        }
        Err(e) => problems.push(format!("get {node}: {e}")),
    }
    problems
}

/// The GPU type the job is planned on, once it is.
pub fn plan_device(job: &MemoryAwareTrainingJob) -> Option<String> {
    job.status.as_ref()?.plan.as_ref().map(|p| p.device.clone())
}

/// Whether the job has failed.
pub fn job_failed(job: &MemoryAwareTrainingJob) -> bool {
    job.status
        .as_ref()
        .is_some_and(|s| s.phase == Some(JobPhase::Failed))
}
