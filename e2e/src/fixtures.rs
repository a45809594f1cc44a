//! Jobs, pod statuses and nodes the tests start from.

use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, DeleteParams, Patch, PatchParams};

use crate::TestNs;

/// The workspace root (samples/, crds/, e2e/testdata/ live there).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("e2e/ sits in the workspace")
        .to_path_buf()
}

/// samples/cpu-tiny.yaml: job `tiny-cpu`, one CPU worker, 1Gi limit, 200 steps.
pub const CPU_TINY: &str = include_str!("../../samples/cpu-tiny.yaml");
/// samples/cpu-oom-first.yaml: job `oom-then-fit`, pinned settings over its limit.
pub const CPU_OOM_FIRST: &str = include_str!("../../samples/cpu-oom-first.yaml");
/// samples/cpu-near-oom-guard.yaml: job `near-oom-guarded`, the same
/// settings with the near-OOM guard on (`make demo`'s first job).
pub const CPU_NEAR_OOM_GUARD: &str = include_str!("../../samples/cpu-near-oom-guard.yaml");
/// samples/cpu-pipeline.yaml: job `split-to-fit`, planned as several stages.
pub const CPU_PIPELINE: &str = include_str!("../../samples/cpu-pipeline.yaml");
/// samples/cpu-pipeline-retry.yaml: job `oom-then-split`, one stage first, then more.
pub const CPU_PIPELINE_RETRY: &str = include_str!("../../samples/cpu-pipeline-retry.yaml");

/// samples/cpu-finetune-tiny-llama.yaml: job `finetune-tiny-llama`, a
/// `model.pretrained` job on the claims `models` and `datasets`.
pub const CPU_FINETUNE: &str = include_str!("../../samples/cpu-finetune-tiny-llama.yaml");

/// What the initializer reports for the transformers-made tiny-llama fixture
/// (worker/tests/fixtures/llama/tiny-llama) at `sequence_length`, as its
/// termination message.
pub fn tiny_llama_report(sequence_length: u32) -> String {
    let config = include_str!("../../worker/tests/fixtures/llama/tiny-llama/config.json");
    let shape = headroom_planner::LlamaShape::from_hf_config(config, sequence_length)
        .expect("fixture config");
    serde_json::to_string(&headroom_api::InitializerReport {
        model: headroom_api::ModelFacts {
            parameters: shape.total_params(),
            shape,
            bytes: 862_296,
            dtype: "F32".into(),
        },
        data: headroom_api::DataFacts {
            documents: 4,
            tokens: 1_000,
            samples: 15,
            masked_per_mille: 0,
            longer_than_sample: 0,
        },
        downloaded_bytes: 0,
        commit: None,
    })
    .expect("report JSON")
}

/// Every MemoryAwareTrainingJob in samples/ (path, text), by file name.
pub fn job_samples() -> Vec<(PathBuf, String)> {
    let dir = workspace_root().join("samples");
    let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    paths.sort();
    paths
        .into_iter()
        .map(|p| {
            let text =
                std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            (p, text)
        })
        .filter(|(_, text)| text.contains("kind: MemoryAwareTrainingJob"))
        .collect()
}

// GPU-type selection (tests/gpu_selection.rs, tests/several_nodes.rs), on
// nodes labelled as GPU Feature Discovery does.

/// 1.3B parameters in bf16 with AdamW: about 51 GiB on one GPU, more than a
/// T4's 15 GiB, so one A100-80GB is the fewest devices it fits on.
pub const GPU_NEEDS_A100: &str = r#"
apiVersion: headroom.dev/v1alpha1
kind: MemoryAwareTrainingJob
metadata:
  name: needs-a100
spec:
  model:
    transformer: {layers: 24, hidden: 2048, heads: 16, sequenceLength: 1024, vocabulary: 50257}
  training: {globalBatch: 64, steps: 10, precision: bf16}
  resources:
    gpu: {types: [Tesla-T4, NVIDIA-A100-SXM4-80GB], maxGpus: 4, hostMemory: 256Mi}
  memoryPolicy: {maxAttempts: 1}
  worker: {image: localhost/headroom-worker:dev, backend: cuda}
"#;

/// 4M parameters: fits one T4 easily. It tolerates the taint of
/// gpu_selection's fake node, as a job would a team's dedicated GPU pool.
pub const GPU_FITS_A_T4: &str = r#"
apiVersion: headroom.dev/v1alpha1
kind: MemoryAwareTrainingJob
metadata:
  name: fits-a-t4
spec:
  model:
    transformer: {layers: 4, hidden: 256, heads: 4, sequenceLength: 128, vocabulary: 4096}
  training: {globalBatch: 32, steps: 10}
  resources:
    gpu: {types: [Tesla-T4], maxGpus: 1, hostMemory: 256Mi}
  memoryPolicy: {maxAttempts: 1}
  worker:
    image: localhost/headroom-worker:dev
    backend: cuda
    tolerations: [{key: headroom.dev/e2e-fake-node, operator: Exists, effect: NoSchedule}]
"#;

/// ~0.7e9 parameters in bf16 + AdamW: model state alone exceeds an 8 GiB
/// GPU's budget. `worker_extra` continues the worker's flow mapping.
pub fn gpu_job(name: &str, types: &[&str], max_gpus: u32, worker_extra: &str) -> String {
    gpu_job_with_sequence(name, types, max_gpus, worker_extra, 1024)
}

/// [`gpu_job`] at another sequence length. At 4096 its activations (micro-
/// batch 8, no checkpointing: 59.8 GiB predicted) need an 80 GiB GPU, where
/// a 40 GiB one needs a smaller micro-batch: the planner picks the larger
/// GPU when both are free. (At 1024 that held while burn's attention kept
/// s² per head; with the blocked attention op 8 × 1024 fits 40 GiB.)
pub fn gpu_job_with_sequence(
    name: &str,
    types: &[&str],
    max_gpus: u32,
    worker_extra: &str,
    sequence: u32,
) -> String {
    format!(
        r#"apiVersion: headroom.dev/v1alpha1
kind: MemoryAwareTrainingJob
metadata: {{name: {name}}}
spec:
  model: {{transformer: {{layers: 24, hidden: 1536, heads: 16, sequenceLength: {sequence}, vocabulary: 50257}}}}
  training: {{globalBatch: 8, steps: 10, precision: bf16}}
  resources:
    gpu: {{types: [{types}], maxGpus: {max_gpus}}}
  worker: {{image: headroom-worker:dev{worker_extra}}}
"#,
        types = types.join(", ")
    )
}

/// A worker pod's status as a kubelet writes it when the container was
/// OOM-killed.
pub fn oom_killed() -> serde_json::Value {
    terminated(137, "OOMKilled", None)
}

/// A worker pod's status as a kubelet writes it when the container exited
/// with `code` (0: Succeeded, else Failed) and an optional termination message.
pub fn terminated(code: i32, reason: &str, message: Option<&str>) -> serde_json::Value {
    let phase = if code == 0 { "Succeeded" } else { "Failed" };
    let mut t = serde_json::json!({"exitCode": code, "reason": reason});
    if let Some(m) = message {
        t["message"] = serde_json::Value::String(m.into());
    }
    serde_json::json!({
        "phase": phase,
        "containerStatuses": [{"name": "worker", "image": "headroom-worker:dev", "imageID": "", "ready": false, "restartCount": 0, "state": {"terminated": t}}]
    })
}

/// A worker pod's status while its container runs.
pub fn running() -> serde_json::Value {
    serde_json::json!({
        "phase": "Running",
        "containerStatuses": [{"name": "worker", "image": "headroom-worker:dev", "imageID": "", "ready": true, "restartCount": 0, "state": {"running": {}}}]
    })
}

/// One test's fake GPU nodes (Node objects without a kubelet), named after
/// its namespace and offering GPU products unique to it (so nodes another
/// run left behind never match). For control planes without a node
/// lifecycle controller: the nodes stay Ready as written.
#[derive(Debug)]
pub struct GpuNodes {
    pub api: Api<Node>,
    ns: String,
    field_manager: &'static str,
    label: &'static str,
    names: Vec<String>,
}

impl GpuNodes {
    pub fn new(ns: &TestNs) -> Self {
        GpuNodes {
            api: Api::all(ns.client.clone()),
            ns: ns.name.clone(),
            field_manager: ns.suite().field_manager,
            label: ns.suite().namespace_label,
            names: vec![],
        }
    }

    /// `Test-<kind>-<id of this test's namespace>`.
    pub fn product(&self, kind: &str) -> String {
        let id = self.ns.rsplit('-').next().unwrap_or("x");
        format!("Test-{kind}-{id}")
    }

    /// Registers node `<namespace>-<suffix>` with one `product` GPU, the way
    /// GPU Feature Discovery and the device plugin describe it; returns its name.
    pub async fn add(&mut self, suffix: &str, product: &str, memory_mib: u64) -> String {
        let labels = serde_json::json!({
            "nvidia.com/gpu.product": product, "nvidia.com/gpu.memory": memory_mib.to_string(),
            "nvidia.com/gpu.count": "1"});
        self.add_node(suffix, labels, serde_json::json!({"nvidia.com/gpu": "1"}))
            .await
    }

    /// Registers node `<namespace>-<suffix>` with one `product` GPU of
    /// `memory_mib` cut into `slices` MIG slices of `profile` (e.g.
    /// `3g.40gb`, `slice_mib` each) under the mixed strategy, labelled as GFD
    /// does (NVIDIA/k8s-device-plugin `internal/lm`: the MIG-enabled GPU keeps
    /// its `nvidia.com/gpu.*` labels with `replicas: 0`; per profile
    /// `nvidia.com/mig-<profile>.count|.replicas|.memory|.product`) and
    /// advertised as the device plugin does: `nvidia.com/mig-<profile>`
    /// only, no `nvidia.com/gpu`. Returns its name.
    pub async fn add_mixed_mig(
        &mut self,
        suffix: &str,
        product: &str,
        memory_mib: u64,
        profile: &str,
        slices: u32,
        slice_mib: u64,
    ) -> String {
        let mig = format!("nvidia.com/mig-{profile}");
        let labels = serde_json::json!({
            "nvidia.com/mig.strategy": "mixed",
            "nvidia.com/gpu.product": product, "nvidia.com/gpu.memory": memory_mib.to_string(),
            "nvidia.com/gpu.count": "1", "nvidia.com/gpu.replicas": "0",
            format!("{mig}.product"): format!("{product}-MIG-{profile}"),
            format!("{mig}.count"): slices.to_string(), format!("{mig}.replicas"): "1",
            format!("{mig}.memory"): slice_mib.to_string()});
        self.add_node(suffix, labels, serde_json::json!({mig: slices.to_string()}))
            .await
    }

    async fn add_node(
        &mut self,
        suffix: &str,
        mut labels: serde_json::Value,
        mut devices: serde_json::Value,
    ) -> String {
        let name = format!("{}-{suffix}", self.ns);
        labels[self.label] = "true".into();
        let node: Node = serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "labels": labels}
        }))
        .expect("node");
        self.api
            .patch(
                &name,
                &PatchParams::apply(self.field_manager),
                &Patch::Apply(&node),
            )
            .await
            .expect("node applies");
        // A new node is tainted not-ready (TaintNodesByCondition) until the node
        // lifecycle controller, which this control plane does not run, sees it
        // Ready; lift the taint as it would.
        self.api
            .patch(
                &name,
                &PatchParams::default(),
                &Patch::Merge(serde_json::json!({"spec": {"taints": null}})),
            )
            .await
            .expect("node taints");
        for (k, v) in [("cpu", "8"), ("memory", "64Gi"), ("pods", "110")] {
            devices[k] = v.into();
        }
        let status = serde_json::json!({"status": {
            "allocatable": devices, "capacity": devices,
            "conditions": [{"type": "Ready", "status": "True", "reason": "Test", "message": "fake node",
                            "lastHeartbeatTime": "2026-01-01T00:00:00Z", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}});
        self.api
            .patch_status(&name, &PatchParams::default(), &Patch::Merge(&status))
            .await
            .expect("node status");
        self.names.push(name.clone());
        name
    }

    /// Deletes the nodes this set registered.
    pub async fn remove(self) {
        for name in &self.names {
            let _ = self.api.delete(name, &DeleteParams::default()).await;
        }
    }
}
