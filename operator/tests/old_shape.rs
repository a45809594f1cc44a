//! Jobs stored before the plan was stored once (each `status.attempts[]`
//! entry with its attempt's whole plan) keep working after an upgrade, on a
//! real kube-apiserver: stored under the CRD Headroom shipped then
//! (tests/fixtures/crd-attempts-with-plan.yaml), read by the current types
//! under the current CRD, rewritten in the lean shape by the operator's next
//! status write, and carried on through a retry with their history intact.
//!
//! Ignored by plain `cargo test`; run by `make test-apiserver`.

mod support;

use headroom_api::{AttemptOutcome, MemoryAwareTrainingJob};
use headroom_e2e::attempts;
use headroom_operator::controller::ControllerConfig;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams, PostParams};
use kube::runtime::wait::{await_condition, conditions};
use serde_json::{Value, json};
use support::*;

const OLD_CRD: &str = include_str!("fixtures/crd-attempts-with-plan.yaml");
const JOB: &str = "oom-then-fit";

/// The namespace's jobs as stored, untyped.
fn raw_jobs(ns: &TestNs) -> Api<DynamicObject> {
    Api::namespaced_with(
        ns.client.clone(),
        &ns.name,
        &ApiResource::erase::<MemoryAwareTrainingJob>(&()),
    )
}

async fn raw_job(ns: &TestNs) -> DynamicObject {
    raw_jobs(ns).get(JOB).await.expect("get the job as stored")
}

/// Server-side applies `crd` and waits until it is established.
async fn apply_crd(ns: &TestNs, crd: &CustomResourceDefinition) {
    let crds: Api<CustomResourceDefinition> = Api::all(ns.client.clone());
    let name = crd.metadata.name.clone().expect("name");
    crds.patch(
        &name,
        &PatchParams::apply(API_SERVER.field_manager).force(),
        &Patch::Apply(crd),
    )
    .await
    .expect("apply the old CRD");
    tokio::time::timeout(
        TIMEOUT,
        await_condition(crds, &name, conditions::is_crd_established()),
    )
    .await
    .expect("established in time")
    .expect("watch the CRD");
}

#[tokio::test]
#[ignore = "needs the control plane: make test-apiserver"]
async fn a_job_stored_with_each_attempts_plan_is_read_rewritten_lean_and_retried() {
    let ns = test_ns("hr-old-shape").await;

    // Attempt 1 planned and launched; then the operator stops.
    let op = start_operator(&ns, ControllerConfig::default());
    ns.apply_job(CPU_OOM_FIRST).await;
    ns.wait_job(JOB, "attempt 1", TIMEOUT, |j| attempts(j) == 1)
        .await;
    ns.wait_pods("attempt 1's pod", TIMEOUT, |p| p.len() == 1)
        .await;
    op.stop().await;

    let old = store_the_old_shape(&ns).await;
    the_current_crd_and_types_read_the_old_shape(&ns, &old).await;
    let op = start_operator(&ns, ControllerConfig::default());
    the_operators_first_status_write_rewrites_the_attempts_lean(&ns, &old).await;
    the_job_carries_on_through_a_retry(&ns, &old).await;
    let raw = raw_job(&ns).await;
    assert_kubectl_get_columns_and_no_attempt_plans(&raw);
    assert_plan_attempts_and_conditions_are_managed_whole(&raw);
    op.stop().await;
    ns.cleanup().await;
}

/// What the old shape held for attempt 1: its whole plan and its start.
struct OldAttempt {
    plan: Value,
    started_at: Value,
}

/// Under the CRD of before, the status as the operator wrote it then: the
/// attempt with its whole plan, no summary fields.
async fn store_the_old_shape(ns: &TestNs) -> OldAttempt {
    let old_crd: CustomResourceDefinition = serde_yaml::from_str(OLD_CRD).expect("old CRD");
    apply_crd(ns, &old_crd).await;
    // Established is not served: for a moment after it the API server may
    // still answer with the current schema, which keeps the fields the old
    // one lacks (the plan's disk); a write then prunes them and the plan read
    // first is not the plan stored. Wait for a read the old schema pruned.
    let mut stored = ns
        .wait_for("reads served by the old CRD", TIMEOUT, || async {
            let raw = raw_job(ns).await;
            raw.data["status"]["plan"]
                .get("disk")
                .is_none()
                .then_some(raw)
        })
        .await;
    let status = &mut stored.data["status"];
    let plan = status["plan"].clone();
    let started_at = status["attempts"][0]["startedAt"].clone();
    status["attempts"] = json!([{
        "number": 1,
        "plan": plan,
        "outcome": "Running",
        "startedAt": started_at,
    }]);
    let written = raw_jobs(ns)
        .replace_status(JOB, &PostParams::default(), &stored)
        .await
        .expect("the old CRD stores the old shape");
    // What is stored is what the old CRD kept of the write.
    let plan = written.data["status"]["attempts"][0]["plan"].clone();
    assert_eq!(plan.get("disk"), None, "stored under the old CRD");
    OldAttempt { plan, started_at }
}

/// The upgrade: the current CRD, which prunes nothing stored on read; the
/// current types read the job, filling each attempt's summary from its plan.
async fn the_current_crd_and_types_read_the_old_shape(ns: &TestNs, old: &OldAttempt) {
    headroom_e2e::crd::install(&ns.client, API_SERVER.field_manager)
        .await
        .expect("the current CRD");
    let raw = raw_job(ns).await;
    assert_eq!(raw.data["status"]["attempts"][0]["plan"], old.plan);
    assert!(raw.data["status"]["attempts"][0].get("settings").is_none());

    let job = ns
        .jobs()
        .get(JOB)
        .await
        .expect("typed read of the old shape");
    let status = job.status.expect("status");
    let first = &status.attempts[0];
    let current = status.plan.clone().expect("status.plan");
    assert!(first.stored_with_plan);
    assert_eq!(
        (
            first.device.as_str(),
            first.workers,
            first.settings,
            first.predicted_peak_bytes
        ),
        (
            current.device.as_str(),
            current.workers,
            current.settings,
            current.predicted_peak_bytes
        )
    );
}

/// The operator's first status write rewrites the attempts lean, keeping
/// what the plan said of them.
async fn the_operators_first_status_write_rewrites_the_attempts_lean(
    ns: &TestNs,
    old: &OldAttempt,
) {
    ns.wait_for("the attempts rewritten lean", TIMEOUT, || async {
        let raw = raw_job(ns).await;
        let a = &raw.data["status"]["attempts"][0];
        (a.get("plan").is_none() && a.get("settings").is_some()).then_some(())
    })
    .await;
    let lean = raw_job(ns).await;
    let a = &lean.data["status"]["attempts"][0];
    assert_eq!(a["settings"], old.plan["settings"]);
    assert_eq!(a["predictedPeakBytes"], old.plan["predictedPeakBytes"]);
    assert_eq!(a["budgetBytes"], old.plan["budgetBytes"]);
    assert_eq!(a["startedAt"], old.started_at);
}

/// And carries on: attempt 1 OOM-killed, attempt 2 stricter.
async fn the_job_carries_on_through_a_retry(ns: &TestNs, old: &OldAttempt) {
    ns.set_pod_status(&format!("{JOB}-a1-s0"), oom_killed())
        .await;
    let job = ns
        .wait_job(JOB, "attempt 2", TIMEOUT, |j| attempts(j) == 2)
        .await;
    let status = job.status.expect("status");
    let (first, second) = (&status.attempts[0], &status.attempts[1]);
    assert_eq!(first.outcome, AttemptOutcome::HostOutOfMemory);
    assert_eq!(
        Value::from(first.settings.micro_batch),
        old.plan["settings"]["microBatch"]
    );
    assert!(second.settings.activation_checkpointing);
    assert_eq!(
        status.plan.as_ref().map(|p| p.settings),
        Some(second.settings)
    );
}

/// What `kubectl get` shows (the printer columns' paths) is still there, and
/// no attempt holds a plan.
fn assert_kubectl_get_columns_and_no_attempt_plans(raw: &DynamicObject) {
    for path in ["device", "workers", "fit"] {
        assert!(
            raw.data["status"]["plan"].get(path).is_some(),
            "status.plan.{path}"
        );
    }
    assert!(
        raw.data["status"]["attempts"]
            .as_array()
            .expect("attempts")
            .iter()
            .all(|a| a.get("plan").is_none())
    );
}

/// The plan, the attempts and the conditions are atomic: the managed fields
/// name each once instead of listing its fields, here too, for an object
/// whose fields the old CRD had listed one by one.
fn assert_plan_attempts_and_conditions_are_managed_whole(raw: &DynamicObject) {
    let managed = serde_json::to_string(&raw.metadata.managed_fields).expect("managed fields");
    for inner in [
        "f:fit",
        "f:correctionFactor",
        "f:settings",
        "f:outcome",
        "f:lastTransitionTime",
        r#"k:{\"number\""#,
        r#"k:{\"type\""#,
    ] {
        assert!(!managed.contains(inner), "{inner} in {managed}");
    }
    for whole in [
        r#""f:plan":{}"#,
        r#""f:attempts":{}"#,
        r#""f:conditions":{}"#,
    ] {
        assert!(managed.contains(whole), "{whole} not in {managed}");
    }
}
