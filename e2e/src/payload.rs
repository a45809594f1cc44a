//! What the fine-tuning scenarios put around a job: claims with the sample
//! text (and the tiny-llama) copied on by a helper pod, the address pods
//! reach the hub stand-in at, the loss a job ended with, a pod that prints
//! files of a claim.

use std::collections::BTreeMap;
use std::time::Duration;

use headroom_api::MemoryAwareTrainingJobStatus;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{ConfigMap, Node, PersistentVolumeClaim, Pod};
use kube::api::{Api, ListParams, LogParams, PostParams};

use crate::fixtures::workspace_root;
use crate::{TestNs, pod_phase};

const RUN: Duration = Duration::from_secs(600);
/// The transformers-made tiny-llama (checkpoint and tokenizer).
pub const TINY_LLAMA: &str = "worker/tests/fixtures/llama/tiny-llama";
/// The public-domain sample text.
pub const TEXT: &str = "samples/data/declaration-of-independence.jsonl";
const FIXTURE: &str = TINY_LLAMA;

/// An image the local cluster has with a shell and cp (its volume helper).
pub fn tools_image() -> String {
    std::env::var("HEADROOM_E2E_TOOLS_IMAGE")
        .unwrap_or_else(|_| "localhost/headroom-volume-helper:dev".into())
}

pub fn claim(name: &str) -> PersistentVolumeClaim {
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": name},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "16Mi"}}}
    }))
    .expect("claim")
}

/// A ConfigMap holding `files` (name → path in the repository) as binary data.
pub fn files(name: &str, files: &[(&str, &str)]) -> ConfigMap {
    let data: BTreeMap<String, ByteString> = files
        .iter()
        .map(|(key, path)| {
            let bytes = std::fs::read(workspace_root().join(path))
                .unwrap_or_else(|e| panic!("{path}: {e}"));
            (key.to_string(), ByteString(bytes))
        })
        .collect();
    ConfigMap {
        metadata: kube::api::ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        binary_data: Some(data),
        ..ConfigMap::default()
    }
}

/// Copies the text (and, with `checkpoint`, the tiny-llama) from their
/// ConfigMaps onto the claims `datasets` (and `models`).
pub fn loader(image: &str, checkpoint: bool) -> Pod {
    let mut script = String::from("cp /text/* /datasets/");
    let mut mounts = vec![
        serde_json::json!({"name": "text", "mountPath": "/text"}),
        serde_json::json!({"name": "datasets", "mountPath": "/datasets"}),
    ];
    let mut volumes = vec![
        serde_json::json!({"name": "text", "configMap": {"name": "text"}}),
        serde_json::json!({"name": "datasets", "persistentVolumeClaim": {"claimName": "datasets"}}),
    ];
    if checkpoint {
        script.push_str(" && mkdir -p /models/tiny-llama && cp /checkpoint/* /models/tiny-llama/");
        mounts.push(serde_json::json!({"name": "checkpoint", "mountPath": "/checkpoint"}));
        mounts.push(serde_json::json!({"name": "models", "mountPath": "/models"}));
        volumes
            .push(serde_json::json!({"name": "checkpoint", "configMap": {"name": "tiny-llama"}}));
        volumes.push(
            serde_json::json!({"name": "models", "persistentVolumeClaim": {"claimName": "models"}}),
        );
    }
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": "loader"},
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": false,
            "securityContext": {"runAsNonRoot": true, "runAsUser": 65532, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{
                "name": "load", "image": image, "imagePullPolicy": "IfNotPresent",
                "command": ["/bin/sh", "-c", script],
                "securityContext": {"allowPrivilegeEscalation": false, "capabilities": {"drop": ["ALL"]}, "readOnlyRootFilesystem": true},
                "volumeMounts": mounts
            }],
            "volumes": volumes
        }
    }))
    .expect("pod")
}

/// Puts the text on the claim `datasets` and, with `checkpoint`, the
/// tiny-llama on the claim `models` (directory `tiny-llama`).
pub async fn load_claims(ns: &TestNs, checkpoint: bool) {
    let pp = PostParams::default();
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(ns.client.clone(), &ns.name);
    let maps: Api<ConfigMap> = Api::namespaced(ns.client.clone(), &ns.name);
    claims.create(&pp, &claim("datasets")).await.expect("claim");
    maps.create(
        &pp,
        &files("text", &[("declaration-of-independence.jsonl", TEXT)]),
    )
    .await
    .expect("text ConfigMap");
    if checkpoint {
        claims.create(&pp, &claim("models")).await.expect("claim");
        let paths: Vec<(&str, String)> = [
            "config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
        ]
        .into_iter()
        .map(|f| (f, format!("{FIXTURE}/{f}")))
        .collect();
        let paths: Vec<(&str, &str)> = paths.iter().map(|(f, p)| (*f, p.as_str())).collect();
        maps.create(&pp, &files("tiny-llama", &paths))
            .await
            .expect("checkpoint ConfigMap");
    }
    ns.pods()
        .create(&pp, &loader(&tools_image(), checkpoint))
        .await
        .expect("loader pod");
    ns.wait_for("the files on the claims", RUN, || async {
        let pods = ns.pod_list().await;
        let phase = pods
            .iter()
            .find(|p| p.metadata.name.as_deref() == Some("loader"))
            .map(|p| pod_phase(p).to_string());
        assert_ne!(phase.as_deref(), Some("Failed"), "the loader pod failed");
        (phase.as_deref() == Some("Succeeded")).then_some(())
    })
    .await;
}

/// The loss the last stage of the last attempt reported last.
pub fn final_loss(status: &MemoryAwareTrainingJobStatus) -> f64 {
    let attempt = status.attempts.last().expect("an attempt").number;
    status
        .workers
        .iter()
        .filter(|w| w.attempt == attempt)
        .find_map(|w| w.loss)
        .unwrap_or_else(|| panic!("no loss reported: {:#?}", status.workers))
}

/// An address of this machine that pods reach: `HEADROOM_E2E_HUB_HOST`, or
/// the first node's InternalIP (the local cluster's node is this machine).
pub async fn hub_host(ns: &TestNs) -> String {
    if let Ok(host) = std::env::var("HEADROOM_E2E_HUB_HOST") {
        return host;
    }
    let nodes: Api<Node> = Api::all(ns.client.clone());
    let nodes = nodes.list(&ListParams::default()).await.expect("nodes");
    nodes
        .items
        .iter()
        .flat_map(|n| n.status.iter().flat_map(|s| s.addresses.iter().flatten()))
        .find(|a| a.type_ == "InternalIP")
        .map(|a| a.address.clone())
        .expect("a node with an InternalIP (or set HEADROOM_E2E_HUB_HOST)")
}

/// Runs `script` (busybox sh) in a pod with the claim `claim` mounted
/// read-only at /claim, waits for it to end and returns its log.
pub async fn claim_output(ns: &TestNs, pod: &str, claim: &str, script: &str) -> String {
    let spec: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": pod},
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": false,
            "securityContext": {"runAsNonRoot": true, "runAsUser": 65532, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{
                "name": "read", "image": tools_image(), "imagePullPolicy": "IfNotPresent",
                "command": ["/bin/sh", "-c", script],
                "securityContext": {"allowPrivilegeEscalation": false, "capabilities": {"drop": ["ALL"]}, "readOnlyRootFilesystem": true},
                "volumeMounts": [{"name": "claim", "mountPath": "/claim", "readOnly": true}]
            }],
            "volumes": [{"name": "claim", "persistentVolumeClaim": {"claimName": claim, "readOnly": true}}]
        }
    }))
    .expect("pod");
    ns.pods()
        .create(&PostParams::default(), &spec)
        .await
        .expect("reader pod");
    ns.wait_for(&format!("pod {pod} to end"), RUN, || async {
        let pods = ns.pod_list().await;
        let phase = pods
            .iter()
            .find(|p| p.metadata.name.as_deref() == Some(pod))
            .map(|p| pod_phase(p).to_string());
        matches!(phase.as_deref(), Some("Succeeded" | "Failed")).then_some(())
    })
    .await;
    ns.pods()
        .logs(pod, &LogParams::default())
        .await
        .expect("reader log")
}
