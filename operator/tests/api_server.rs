//! Against a real kube-apiserver (the e2e control-plane harness): the CRD
//! installs, the samples pass server-side dry-run, and every invalid manifest
//! in e2e/testdata/invalid is rejected with the message its `# expect:` names.
//!
//! Ignored by plain `cargo test`; `make test-apiserver` starts the control
//! plane, exports KUBECONFIG and runs these with `--ignored`.

mod support;

use std::path::PathBuf;
use std::time::Duration;

use headroom_api::MemoryAwareTrainingJob;
use k8s_openapi::api::core::v1::Namespace;
use kube::Client;
use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams, PostParams};

const NAMESPACE: &str = "headroom-validation";

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

async fn client_with_crd() -> Client {
    let client = support::client().await;
    support::install_crd(&client).await;
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let ns: Namespace =
        serde_json::from_value(serde_json::json!({"metadata": {"name": NAMESPACE}})).expect("ns");
    namespaces
        .patch(
            NAMESPACE,
            &PatchParams::apply("headroom-tests"),
            &Patch::Apply(&ns),
        )
        .await
        .expect("namespace");
    client
}

fn jobs_api(client: &Client) -> Api<DynamicObject> {
    Api::namespaced_with(
        client.clone(),
        NAMESPACE,
        &ApiResource::erase::<MemoryAwareTrainingJob>(&()),
    )
}

async fn dry_run_create(api: &Api<DynamicObject>, manifest: &str) -> Result<(), String> {
    let obj: DynamicObject =
        serde_yaml::from_str(manifest).map_err(|e| format!("not a manifest: {e}"))?;
    let pp = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    // Discovery of a just-established CRD can lag by a moment.
    for _ in 0..20 {
        match api.create(&pp, &obj).await {
            Ok(_) => return Ok(()),
            Err(kube::Error::Api(s)) if s.code == 404 => {
                tokio::time::sleep(Duration::from_millis(250)).await
            }
            Err(kube::Error::Api(s)) => return Err(s.message),
            Err(e) => return Err(e.to_string()),
        }
    }
    Err("resource not served after 5 s".into())
}

#[tokio::test]
#[ignore = "needs the control plane: make test-apiserver"]
async fn samples_pass_server_side_dry_run() {
    let client = client_with_crd().await;
    let api = jobs_api(&client);
    // Every job sample in samples/ (nodes-gfd.yaml is a NodeList).
    let mut samples: Vec<_> = std::fs::read_dir(root().join("samples"))
        .expect("samples")
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    samples.sort();
    let mut checked = 0;
    for sample in &samples {
        let manifest = std::fs::read_to_string(sample).expect("sample");
        if !manifest.contains("kind: MemoryAwareTrainingJob") {
            continue;
        }
        if let Err(e) = dry_run_create(&api, &manifest).await {
            panic!("{} rejected: {e}", sample.display());
        }
        checked += 1;
    }
    assert!(checked >= 6, "{checked} job samples");
}

#[tokio::test]
#[ignore = "needs the control plane: make test-apiserver"]
async fn invalid_manifests_are_rejected_with_field_paths() {
    let client = client_with_crd().await;
    let api = jobs_api(&client);
    let dir = root().join("e2e/testdata/invalid");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .expect("corpus")
        .filter_map(Result::ok)
        .map(|e| e.path())
        .collect();
    files.sort();
    assert!(
        files.len() >= 20,
        "the corpus needs at least 20 manifests, found {}",
        files.len()
    );
    let mut failures = Vec::new();
    for file in &files {
        let manifest = std::fs::read_to_string(file).expect("read");
        let expect = manifest
            .lines()
            .find_map(|l| l.strip_prefix("# expect: "))
            .unwrap_or_else(|| panic!("{} has no `# expect:` line", file.display()))
            .trim()
            .to_string();
        let name = file
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        match dry_run_create(&api, &manifest).await {
            Ok(()) => failures.push(format!(
                "{name}: accepted, expected rejection with {expect:?}"
            )),
            Err(message) if !message.contains(&expect) => failures.push(format!(
                "{name}: rejected, but without {expect:?}:\n    {message}"
            )),
            Err(_) => {}
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} manifests misbehaved:\n{}",
        failures.len(),
        files.len(),
        failures.join("\n")
    );
}
