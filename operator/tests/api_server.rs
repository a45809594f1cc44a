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
