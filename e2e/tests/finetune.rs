//! Fine-tuning a real (tiny) Hugging Face checkpoint on real pods (`make e2e`):
//! the transformers-made tiny-llama and the public-domain sample text are
//! put on claims, `samples/cpu-finetune-tiny-llama.yaml` is applied, the
//! initializer reads them, the worker trains and writes the fine-tuned
//! model; then a second job fine-tunes *that output*, so its initializer
//! proves in the cluster that what the first wrote is a complete checkpoint
//! of the same model (every tensor, shape and dtype against config.json).

use std::collections::BTreeMap;
use std::time::Duration;

use headroom_api::{AttemptOutcome, JobPhase};
use headroom_e2e::fixtures::{CPU_FINETUNE as FINETUNE, workspace_root};
use headroom_e2e::{E2E, TestNs, pod_phase};
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{ConfigMap, PersistentVolumeClaim, Pod};
use kube::api::{Api, PostParams};

const RUN: Duration = Duration::from_secs(600);

/// An image the local cluster has with a shell and cp (its volume helper).
fn tools_image() -> String {
    std::env::var("HEADROOM_E2E_TOOLS_IMAGE")
        .unwrap_or_else(|_| "localhost/headroom-volume-helper:dev".into())
}

fn claim(name: &str) -> PersistentVolumeClaim {
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": name},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "16Mi"}}}
    }))
    .expect("claim")
}

/// A ConfigMap holding `files` (name → path in the repository) as binary data.
fn files(name: &str, files: &[(&str, &str)]) -> ConfigMap {
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

/// Copies the checkpoint and the text from their ConfigMaps onto the claims.
fn loader(image: &str) -> Pod {
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": "loader"},
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": false,
            "securityContext": {"runAsNonRoot": true, "runAsUser": 65532, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{
                "name": "load", "image": image, "imagePullPolicy": "IfNotPresent",
                "command": ["/bin/sh", "-c",
                    "mkdir -p /models/tiny-llama && cp /checkpoint/* /models/tiny-llama/ && cp /text/* /datasets/"],
                "securityContext": {"allowPrivilegeEscalation": false, "capabilities": {"drop": ["ALL"]}, "readOnlyRootFilesystem": true},
                "volumeMounts": [
                    {"name": "checkpoint", "mountPath": "/checkpoint"},
                    {"name": "text", "mountPath": "/text"},
                    {"name": "models", "mountPath": "/models"},
                    {"name": "datasets", "mountPath": "/datasets"}
                ]
            }],
            "volumes": [
                {"name": "checkpoint", "configMap": {"name": "tiny-llama"}},
                {"name": "text", "configMap": {"name": "text"}},
                {"name": "models", "persistentVolumeClaim": {"claimName": "models"}},
                {"name": "datasets", "persistentVolumeClaim": {"claimName": "datasets"}}
            ]
        }
    }))
    .expect("pod")
}

#[tokio::test]
#[ignore = "needs a cluster with Headroom installed: make e2e"]
async fn a_hugging_face_checkpoint_is_fine_tuned_and_its_output_is_a_checkpoint_again() {
    let ns = TestNs::new(E2E, "e2e-finetune").await;
    let pp = PostParams::default();
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(ns.client.clone(), &ns.name);
    let maps: Api<ConfigMap> = Api::namespaced(ns.client.clone(), &ns.name);
    for name in ["models", "datasets"] {
        claims.create(&pp, &claim(name)).await.expect("claim");
    }
    let fixture = "worker/tests/fixtures/llama/tiny-llama";
    maps.create(
        &pp,
        &files(
            "tiny-llama",
            &[
                ("config.json", &format!("{fixture}/config.json")),
                ("model.safetensors", &format!("{fixture}/model.safetensors")),
                ("tokenizer.json", &format!("{fixture}/tokenizer.json")),
                (
                    "tokenizer_config.json",
                    &format!("{fixture}/tokenizer_config.json"),
                ),
            ],
        ),
    )
    .await
    .expect("checkpoint ConfigMap");
    maps.create(
        &pp,
        &files(
            "text",
            &[(
                "declaration-of-independence.jsonl",
                "samples/data/declaration-of-independence.jsonl",
            )],
        ),
    )
    .await
    .expect("text ConfigMap");
    ns.pods()
        .create(&pp, &loader(&tools_image()))
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

    ns.apply_job(FINETUNE).await;
    let status = ns.wait_succeeded("finetune-tiny-llama", RUN).await;
    let model = status
        .model
        .as_ref()
        .expect("status.model from the initializer");
    assert_eq!(model.parameters, 214_592);
    assert_eq!(model.dtype, "F32");
    let data = status.data.as_ref().expect("status.data");
    assert!(data.samples > 0 && data.tokens > data.samples, "{data:?}");
    let last = status.attempts.last().expect("an attempt");
    assert_eq!(last.outcome, AttemptOutcome::Succeeded);
    assert_eq!(
        status.output.as_deref(),
        Some("finetune-tiny-llama-checkpoints:output")
    );

    // The output, read back by a second job's initializer, is the same model.
    let again = FINETUNE
        .replace("name: finetune-tiny-llama", "name: finetune-again")
        .replace(
            "volume: {claimName: models, path: tiny-llama}",
            "volume: {claimName: finetune-tiny-llama-checkpoints, path: output}",
        )
        .replace("steps: 30", "steps: 2");
    ns.apply_job(&again).await;
    let status = ns.wait_succeeded("finetune-again", RUN).await;
    assert_eq!(status.phase, Some(JobPhase::Succeeded));
    assert_eq!(
        status.model.as_ref().map(|m| m.parameters),
        Some(214_592),
        "the first job's output is a complete checkpoint of the same model"
    );
    ns.cleanup().await;
}
