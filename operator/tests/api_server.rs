//! Against a real kube-apiserver (the e2e control-plane harness): the CRD
//! installs, the samples pass server-side dry-run, and every invalid manifest
//! in e2e/testdata/invalid is rejected with the message its `# expect:` names.
//!
//! Ignored by plain `cargo test`; `make test-apiserver` starts the control
//! plane, exports KUBECONFIG and runs these with `--ignored`.

mod support;

use headroom_e2e::corpus::assert_all_rejected;
use headroom_e2e::crd::dry_run_create;
use support::*;

#[tokio::test]
#[ignore = "needs the control plane: make test-apiserver"]
async fn samples_pass_server_side_dry_run() {
    let ns = test_ns("hr-samples").await;
    let samples = job_samples();
    for (sample, manifest) in &samples {
        if let Err(e) = dry_run_create(&ns.client, &ns.name, manifest).await {
            panic!("{} rejected: {e}", sample.display());
        }
    }
    assert!(samples.len() >= 6, "{} job samples", samples.len());
    ns.cleanup().await;
}

#[tokio::test]
#[ignore = "needs the control plane: make test-apiserver"]
async fn invalid_manifests_are_rejected_with_field_paths() {
    let ns = test_ns("hr-invalid").await;
    assert_all_rejected(async |m| dry_run_create(&ns.client, &ns.name, &m.text).await).await;
    ns.cleanup().await;
}

/// A fine-tuning job's checkpoint and data are read once, by its initializer:
/// the API server refuses to change them afterwards (CEL transition rules),
/// while the rest of the spec stays editable.
#[tokio::test]
#[ignore = "needs the control plane: make test-apiserver"]
async fn a_fine_tuning_jobs_checkpoint_and_data_cannot_change() {
    use kube::api::{Patch, PatchParams};
    let ns = test_ns("hr-immutable").await;
    let sample = include_str!("../../samples/cpu-finetune-tiny-llama.yaml");
    ns.apply_job(sample).await;
    let jobs = ns.jobs();
    let pp = PatchParams::default();
    let refused = |patch: serde_json::Value| {
        let jobs = jobs.clone();
        let pp = pp.clone();
        async move {
            match jobs
                .patch("finetune-tiny-llama", &pp, &Patch::Merge(patch))
                .await
            {
                Ok(_) => None,
                Err(e) => Some(e.to_string()),
            }
        }
    };
    let data = refused(serde_json::json!({"spec": {"data": {"volume": {"path": "other.jsonl"}}}}))
        .await
        .expect("a new data path is refused");
    assert!(data.contains("data is immutable"), "{data}");
    let model =
        refused(serde_json::json!({"spec": {"model": {"pretrained": {"sequenceLength": 128}}}}))
            .await
            .expect("a new sequence length is refused");
    assert!(model.contains("model.pretrained is immutable"), "{model}");
    assert_eq!(
        refused(serde_json::json!({"spec": {"training": {"steps": 40}}})).await,
        None,
        "other fields stay editable"
    );
    ns.cleanup().await;
}
