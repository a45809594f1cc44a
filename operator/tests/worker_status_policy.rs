//! The chart's worker status policy (charts/headroom/files/worker-status-policy.yaml)
//! on a real kube-apiserver: with its own pod-bound token a worker writes its
//! telemetry entry, and nothing else — not the phase (which would end its
//! job), not the history, not another worker's entry — and its Role reads no
//! pod when the plan has one stage.
//!
//! The API-server test is ignored by plain `cargo test`; `make test-apiserver` runs it.

mod support;

use headroom_api::JobPhase;
use headroom_e2e::fixtures::workspace_root;
use headroom_operator::controller::ControllerConfig;
use headroom_operator::crd::crd_yaml;
use k8s_openapi::api::admissionregistration::v1::{
    ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
};
use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Pod, ServiceAccount};
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use support::*;

const POLICY: &str = "charts/headroom/files/worker-status-policy.yaml";

fn policy_documents() -> (ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding) {
    let text = std::fs::read_to_string(workspace_root().join(POLICY)).expect("policy file");
    let mut docs = text.split("\n---\n");
    let policy = serde_yaml::from_str(docs.next().expect("policy")).expect("policy parses");
    let binding = serde_yaml::from_str(docs.next().expect("binding")).expect("binding parses");
    (policy, binding)
}

/// Every operator-owned status field has its rule: a field added to the
/// status without one would be writable by every worker.
#[test]
fn the_policy_guards_every_status_field_but_workers() {
    let crd: Value = serde_yaml::from_str(&crd_yaml().expect("crd")).expect("yaml");
    let status = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"];
    let mut fields: Vec<String> = status["properties"]
        .as_object()
        .expect("status properties")
        .keys()
        .filter(|k| *k != "workers")
        .cloned()
        .collect();
    fields.sort();
    let (policy, _) = policy_documents();
    let mut guarded: Vec<String> = policy
        .spec
        .expect("spec")
        .validations
        .unwrap_or_default()
        .iter()
        .filter_map(|v| v.message.as_deref())
        .filter_map(|m| m.strip_prefix("a Headroom worker may not change status."))
        .map(str::to_string)
        .collect();
    guarded.sort();
    assert_eq!(
        guarded, fields,
        "{POLICY}: one rule per status field other than workers"
    );
}

/// Applies the chart's policy (cluster-scoped, idempotent) as the chart would.
async fn install_policy(client: &Client) {
    let (policy, binding) = policy_documents();
    let pp = PatchParams::apply("headroom-tests").force();
    let policies: Api<ValidatingAdmissionPolicy> = Api::all(client.clone());
    let bindings: Api<ValidatingAdmissionPolicyBinding> = Api::all(client.clone());
    policies
        .patch(&policy.name_any(), &pp, &Patch::Apply(&policy))
        .await
        .expect("policy applied");
    bindings
        .patch(&binding.name_any(), &pp, &Patch::Apply(&binding))
        .await
        .expect("binding applied");
}

/// A client that authenticates as `account` with a token bound to `pod`, as
/// the kubelet mounts it into the worker.
async fn client_as(ns: &TestNs, account: &str, pod: &Pod) -> Client {
    let request = TokenRequest {
        spec: TokenRequestSpec {
            audiences: vec![],
            bound_object_ref: Some(BoundObjectReference {
                kind: Some("Pod".into()),
                api_version: Some("v1".into()),
                name: Some(pod.name_any()),
                uid: pod.uid(),
            }),
            expiration_seconds: Some(600),
        },
        ..TokenRequest::default()
    };
    let token = Api::<ServiceAccount>::namespaced(ns.client.clone(), &ns.name)
        .create_token_request(account, &PostParams::default(), &request)
        .await
        .expect("token request")
        .status
        .expect("token")
        .token;
    let mut config = kube::Config::infer().await.expect("kubeconfig");
    config.auth_info =
        serde_json::from_value(json!({ "token": token })).expect("auth info with a token");
    Client::try_from(config).expect("worker client")
}

fn entry(pod: &str, step: u64) -> Value {
    json!({
        "name": pod, "attempt": 1, "stage": 0, "layerStart": 0, "layerEnd": 2, "step": step,
        "memory": {"cgroupCurrentBytes": 1000, "peakBytes": 2000},
        "updatedAt": "2026-11-22T10:00:00Z"
    })
}

/// A status patch through `api`: Ok, or the API server's code and message.
async fn patch_status(
    api: &Api<headroom_api::MemoryAwareTrainingJob>,
    manager: &str,
    status: Value,
) -> Result<(), (u16, String)> {
    let body = json!({
        "apiVersion": "headroom.dev/v1alpha1", "kind": "MemoryAwareTrainingJob",
        "metadata": {"name": "tiny-cpu"}, "status": status,
    });
    api.patch_status(
        "tiny-cpu",
        &PatchParams::apply(manager).force(),
        &Patch::Apply(&body),
    )
    .await
    .map(|_| ())
    .map_err(|e| match e {
        kube::Error::Api(s) => (s.code, s.message),
        other => (0, other.to_string()),
    })
}

#[tokio::test]
#[ignore = "needs the control plane: make test-apiserver"]
async fn a_worker_writes_its_own_telemetry_and_nothing_else() {
    let ns = test_ns("hr-worker-policy").await;
    install_policy(&ns.client).await;
    let op = start_operator(&ns, ControllerConfig::default());
    ns.apply_job(CPU_TINY).await;
    let pods = ns
        .wait_pods("the worker pod", TIMEOUT, |p| p.len() == 1)
        .await;
    let pod = &pods[0];
    let worker = client_as(&ns, "tiny-cpu-worker", pod).await;
    let jobs: Api<headroom_api::MemoryAwareTrainingJob> = Api::namespaced(worker.clone(), &ns.name);
    let manager = "headroom-worker-s0";
    // Policies take effect asynchronously: probe with a write that always
    // changes something (a fresh message) until it is refused.
    let mut probe = 0;
    let denied = ns
        .wait_for("the policy in force", TIMEOUT, || {
            probe += 1;
            let message = format!("probe {probe}");
            let jobs = jobs.clone();
            async move {
                match patch_status(&jobs, "intruder", json!({ "message": message })).await {
                    Err((403, message)) => Some(message),
                    _ => None,
                }
            }
        })
        .await;
    assert!(denied.contains("may not change status.message"), "{denied}");
    let phase = patch_status(&jobs, "intruder", json!({"phase": "Succeeded"})).await;
    assert!(
        matches!(&phase, Err((403, m)) if m.contains("may not change status.phase")),
        "{phase:?}"
    );

    // Its own entry: allowed, and it is there.
    patch_status(
        &jobs,
        manager,
        json!({"workers": [entry(&pod.name_any(), 3)]}),
    )
    .await
    .expect("a worker may write its own telemetry");
    let job = ns.jobs().get("tiny-cpu").await.expect("job");
    let status = job.status.expect("status");
    assert_eq!(status.workers[0].step, 3);
    assert_ne!(status.phase, Some(JobPhase::Succeeded));

    // Another pod's entry, the history, the conditions: refused.
    let other = patch_status(
        &jobs,
        "other",
        json!({"workers": [entry("someone-else", 1)]}),
    )
    .await;
    assert!(
        matches!(&other, Err((_, m)) if m.contains("only its own entry")),
        "{other:?}"
    );
    // Erasing the history (a merge patch replaces the whole list).
    let history = jobs
        .patch_status(
            "tiny-cpu",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"attempts": []}})),
        )
        .await;
    assert!(
        matches!(&history, Err(kube::Error::Api(e)) if e.message.contains("status.attempts")),
        "{history:?}"
    );
    let attempt = patch_status(&jobs, manager, json!({"attempt": 7})).await;
    assert!(
        matches!(&attempt, Err((403, m)) if m.contains("status.attempt")),
        "{attempt:?}"
    );
    let conditions = patch_status(
        &jobs,
        manager,
        json!({"conditions": [{"type": "Complete", "status": "True", "reason": "Succeeded",
                               "message": "", "lastTransitionTime": "2026-11-22T10:00:00Z"}]}),
    )
    .await;
    assert!(
        matches!(&conditions, Err((_, m)) if m.contains("status.conditions")),
        "{conditions:?}"
    );

    // One stage has no neighbour: its Role reads no pod, not even its own.
    let read = Api::<Pod>::namespaced(worker.clone(), &ns.name)
        .get(&pod.name_any())
        .await;
    assert!(
        matches!(&read, Err(kube::Error::Api(e)) if e.code == 403),
        "{read:?}"
    );
    op.stop().await;
    ns.cleanup().await;
}
