//! The end-to-end suite on real pods: `make e2e` (local single-node cluster,
//! images built without Docker, Headroom installed with Helm). Ignored by a
//! plain `cargo test`, which has no cluster.

use std::cell::Cell;
use std::collections::BTreeSet;
use std::time::Duration;

use headroom_api::{AttemptOutcome, JobPhase};
use headroom_e2e::corpus::assert_all_rejected;
use headroom_e2e::fixtures::{
    CPU_NEAR_OOM_GUARD as NEAR_OOM_GUARD, CPU_OOM_FIRST as OOM_FIRST, CPU_TINY as TINY,
};
use headroom_e2e::{
    E2E, TestNs, ended, kubectl, operator_namespace, operator_selector, phase, pod_phase,
    pod_ready, telemetry_step,
};
use k8s_openapi::api::core::v1::{ConfigMap, PersistentVolumeClaim, Pod, Service, ServiceAccount};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::api::{Api, DeleteParams, EvictParams, ListParams};
use kube::{Resource, ResourceExt};

const RUN: Duration = Duration::from_secs(600);

/// samples/cpu-tiny.yaml (about 2.4 s a step on a 2-core node) with `steps`
/// steps and half a core requested, so the suite's workers share the node
/// instead of queueing past the operator's unschedulable grace period.
fn tiny(steps: u32) -> String {
    let manifest = TINY
        .replace("steps: 200", &format!("steps: {steps}"))
        .replace("cores: \"1\"", "cores: 500m");
    assert!(
        manifest.contains("cores: 500m"),
        "samples/cpu-tiny.yaml changed"
    );
    manifest
}

#[tokio::test]
#[ignore = "needs a cluster with Headroom installed: make e2e"]
async fn a_small_job_succeeds_with_live_telemetry() {
    let ns = TestNs::new(E2E, "e2e-small").await;
    ns.apply_job(&tiny(SMALL_JOB_STEPS as u32)).await;
    // Telemetry arrives while it runs.
    let running = ns
        .wait_job("tiny-cpu", "live telemetry in status.workers", RUN, |j| {
            j.status
                .as_ref()
                .is_some_and(|s| s.workers.iter().any(|w| w.memory.peak_bytes > 0))
        })
        .await;
    let worker = &running.status.expect("status").workers[0];
    assert_eq!(
        (worker.name.as_str(), worker.attempt),
        ("tiny-cpu-a1-s0", 1)
    );
    // While it runs, what `kubectl get matj` prints (the server's table)
    // has its step of the total, its loss and the time left, once two
    // reports have measured the pace.
    ns.wait_job("tiny-cpu", "a time left in status.progress", RUN, |j| {
        let progress = j.status.as_ref().and_then(|s| s.progress.as_ref());
        progress.is_some_and(|p| p.eta_seconds.is_some_and(|e| e >= 2))
    })
    .await;
    let table = printed_table(&ns, "tiny-cpu").await;
    for column in ["Step", "Loss", "ETA"] {
        let cell = &table[column];
        assert!(
            cell.as_str().is_some_and(|c| !c.is_empty()) || cell.is_number(),
            "{column} of a running job: {table}"
        );
    }
    assert!(
        table["Step"]
            .as_str()
            .is_some_and(|s| s.ends_with(&format!("/{SMALL_JOB_STEPS}"))),
        "{table}"
    );
    let done = ns
        .wait_job("tiny-cpu", "Succeeded", RUN, |j| {
            phase(j) == Some(JobPhase::Succeeded)
        })
        .await;
    let status = done.status.expect("status");
    assert_eq!(status.attempts.len(), 1);
    let attempt = &status.attempts[0];
    assert_eq!(attempt.outcome, AttemptOutcome::Succeeded);
    let peak = attempt
        .observed_peak_bytes
        .expect("the final peak is recorded");
    assert!(
        peak > 0 && peak <= 1 << 30,
        "peak {peak} within the 1Gi limit"
    );
    // What `kubectl get matj` shows of the run: the step of its total and
    // the last loss (the time left only while it runs).
    let progress = status.progress.as_ref().expect("status.progress");
    assert_eq!(
        progress.step_of_total,
        format!("{SMALL_JOB_STEPS}/{SMALL_JOB_STEPS}")
    );
    assert!(
        progress.train_loss.is_some_and(f64::is_finite),
        "{progress:?}"
    );
    let out = tokio::process::Command::new(kubectl())
        .args(["get", "matj", "tiny-cpu", "-n", &ns.name])
        .output()
        .await
        .unwrap_or_else(|e| panic!("run {:?} (set KUBECTL): {e}", kubectl()));
    let table = String::from_utf8_lossy(&out.stdout);
    let header: Vec<&str> = table
        .lines()
        .next()
        .unwrap_or("")
        .split_whitespace()
        .collect();
    for column in ["STEP", "LOSS", "ETA"] {
        assert!(header.contains(&column), "{column} in {table}");
    }
    assert!(
        table.contains(&format!(" {SMALL_JOB_STEPS}/{SMALL_JOB_STEPS} ")),
        "{table}"
    );
    ns.cleanup().await;
}

/// Steps of the small job: long enough (a few seconds a step on half a
/// core) that the pace is measured and a time left shown while it runs.
const SMALL_JOB_STEPS: u64 = 12;

/// The row the API server prints for `kubectl get matj <job>` (the Table
/// kubectl asks for), as column name → cell.
async fn printed_table(ns: &TestNs, job: &str) -> serde_json::Value {
    let request = hyper::Request::get(format!(
        "/apis/headroom.dev/v1alpha1/namespaces/{}/memoryawaretrainingjobs/{job}",
        ns.name
    ))
    .header("Accept", "application/json;as=Table;v=v1;g=meta.k8s.io")
    .body(Vec::new())
    .expect("request");
    let table: serde_json::Value = ns.client.request(request).await.expect("table");
    let names = table["columnDefinitions"].as_array().expect("columns");
    let cells = table["rows"][0]["cells"].as_array().expect("a row");
    names
        .iter()
        .zip(cells)
        .filter_map(|(c, v)| Some((c["name"].as_str()?.to_string(), v.clone())))
        .collect::<serde_json::Map<_, _>>()
        .into()
}

#[tokio::test]
#[ignore = "needs a cluster with Headroom installed: make e2e"]
async fn a_job_over_its_limit_is_oom_killed_and_succeeds_stricter() {
    let ns = TestNs::new(E2E, "e2e-oom").await;
    let manifest = OOM_FIRST.replace("maxWorkers: 2}", "cores: 500m, maxWorkers: 2}");
    assert!(
        manifest.contains("cores: 500m"),
        "samples/cpu-oom-first.yaml changed"
    );
    ns.apply_job(&manifest).await;
    // The lowest step a later attempt's worker reported live: where it resumed, or later.
    let resumed_at: Cell<Option<u64>> = Cell::new(None);
    let done = ns
        .wait_job("oom-then-fit", "Succeeded or Failed", RUN, |j| {
            let attempt = j.status.as_ref().and_then(|s| s.attempt).unwrap_or(1);
            if attempt > 1 {
                let lowest = j
                    .status
                    .iter()
                    .flat_map(|s| &s.workers)
                    .filter(|w| w.attempt == attempt)
                    .map(|w| w.step)
                    .min();
                resumed_at.set(resumed_at.get().min(lowest).or(lowest));
            }
            ended(j)
        })
        .await;
    let status = done.status.clone().expect("status");
    assert_eq!(
        phase(&done),
        Some(JobPhase::Succeeded),
        "{}",
        ns.dump().await
    );
    let first = &status.attempts[0];
    assert_eq!(
        first.outcome,
        AttemptOutcome::HostOutOfMemory,
        "the kernel really killed attempt 1"
    );
    assert_eq!(first.reason.as_deref(), Some("OOMKilled"));
    let last = status.attempts.last().expect("attempts");
    assert_eq!(last.outcome, AttemptOutcome::Succeeded);
    assert!(
        last.settings.activation_checkpointing
            || last.settings.micro_batch < first.settings.micro_batch
    );
    assert_eq!(
        last.settings.global_batch() * u64::from(last.replicas()),
        first.settings.global_batch() * u64::from(first.replicas()),
        "the global batch is kept"
    );
    assert!(
        last.observed_peak_bytes
            .is_some_and(|p| p <= last.device_memory_bytes)
    );
    // The step count continues: the run ends at the job's total, and no later
    // attempt starts before the last checkpoint an earlier one could have
    // written (every 4 steps). With this sample the kernel kills attempt 1
    // in its first step, before any checkpoint (lastStep unset), so the
    // resume from a real checkpoint is checked by
    // an_evicted_worker_resumes_from_its_checkpoint.
    assert_eq!(
        last.last_step,
        Some(12),
        "the run ends at spec.training.steps"
    );
    let checkpointed = first.last_step.map_or(0, |s| s / 4 * 4);
    if let Some(resumed) = resumed_at.get() {
        assert!(
            resumed >= checkpointed,
            "attempt {} reported step {resumed}, before attempt 1's checkpoint at {checkpointed}",
            last.number
        );
    }
    ns.cleanup().await;
}

/// The same job as the kill above with the memory guard on: its worker
/// stops each step that would cross the 320 MiB limit before the kernel
/// kills it, and steps down in place (a fresh process in the same pod, half
/// the micro-batch) or ends its attempt for a stricter one; the kernel
/// kills nothing, and the run ends at the job's total.
#[tokio::test]
#[ignore = "needs a cluster with Headroom installed: make e2e"]
async fn a_guarded_job_steps_down_before_the_kernel_kills_it() {
    let ns = TestNs::new(E2E, "e2e-guard").await;
    // make demo's first job, with the CPU share the suite's jobs get.
    let manifest = NEAR_OOM_GUARD.replace("maxWorkers: 2}", "cores: 500m, maxWorkers: 2}");
    assert!(
        manifest.contains("cores: 500m") && manifest.contains("guard: {enabled: true"),
        "samples/cpu-near-oom-guard.yaml changed"
    );
    ns.apply_job(&manifest).await;
    let status = ns.wait_succeeded("near-oom-guarded", RUN).await;
    assert!(
        status.attempts.iter().all(|a| !matches!(
            a.outcome,
            AttemptOutcome::HostOutOfMemory | AttemptOutcome::DeviceOutOfMemory
        )),
        "a kill or an allocation failure despite the guard: {:#?}",
        status.attempts
    );
    let first = &status.attempts[0];
    let last = status.attempts.last().expect("attempts");
    // The pinned micro-batch of 32 does not fit: the guard stepped down
    // (in place, or through a stricter attempt after NearOutOfMemory).
    assert!(
        last.settings.micro_batch < 32 || last.settings.activation_checkpointing,
        "{:#?}",
        status.attempts
    );
    assert_eq!(
        last.settings.global_batch(),
        first.settings.global_batch(),
        "the global batch is kept"
    );
    assert_eq!(
        last.last_step,
        Some(12),
        "the run ends at spec.training.steps"
    );
    ns.cleanup().await;
}

#[tokio::test]
#[ignore = "needs a cluster with Headroom installed: make e2e"]
async fn a_job_that_fits_nowhere_fails_without_pods() {
    let ns = TestNs::new(E2E, "e2e-nofit").await;
    ns.apply_job(&TINY.replace("memoryLimit: 1Gi", "memoryLimit: 64Mi"))
        .await;
    let job = ns
        .wait_job("tiny-cpu", "Failed", Duration::from_secs(60), |j| {
            phase(j) == Some(JobPhase::Failed)
        })
        .await;
    let message = job.status.and_then(|s| s.message).unwrap_or_default();
    assert!(
        message.contains("no feasible plan") && message.contains("budget"),
        "{message}"
    );
    let pods = ns
        .pods()
        .list(&Default::default())
        .await
        .expect("pods")
        .items;
    assert!(pods.is_empty(), "no pods for an infeasible job");
    ns.cleanup().await;
}

/// The worker pod of attempt 1, once its container runs.
async fn running_worker(ns: &TestNs, job: &str) -> Pod {
    let name = format!("{job}-a1-s0");
    ns.wait_for(&format!("{name} Running"), RUN, || async {
        ns.pods()
            .get_opt(&name)
            .await
            .ok()
            .flatten()
            .filter(|p| pod_phase(p) == "Running")
    })
    .await
}

#[tokio::test]
#[ignore = "needs a cluster with Headroom installed: make e2e"]
async fn the_operator_restarting_mid_job_duplicates_no_pods_and_the_job_finishes() {
    let ns = TestNs::new(E2E, "e2e-restart").await;
    ns.apply_job(&tiny(20)).await;
    let worker = running_worker(&ns, "tiny-cpu").await;

    let operators: Api<Pod> = Api::namespaced(ns.client.clone(), &operator_namespace());
    let labels = operator_selector(&ns.client).await;
    let selector = ListParams::default().labels(&labels);
    // Only live pods: a Deployment's finished pods (e.g. after a node restart) stay listed.
    let old: Vec<Pod> = operators
        .list(&selector)
        .await
        .expect("operator pods")
        .items
        .into_iter()
        .filter(|p| matches!(pod_phase(p), "Pending" | "Running"))
        .collect();
    assert!(
        !old.is_empty(),
        "no live operator pod in {} with {labels}",
        operator_namespace()
    );
    let job = ns.jobs().get("tiny-cpu").await.expect("job");
    assert!(
        !ended(&job),
        "the job must still run when the operator goes"
    );
    for pod in &old {
        operators
            .delete(&pod.name_any(), &DeleteParams::default())
            .await
            .expect("delete the operator pod");
    }
    let old_uids: BTreeSet<String> = old.iter().filter_map(|p| p.uid()).collect();
    ns.wait_for(
        "a replacement operator pod Ready",
        Duration::from_secs(180),
        || async {
            operators
                .list(&selector)
                .await
                .ok()?
                .items
                .into_iter()
                .find(|p| p.uid().is_some_and(|u| !old_uids.contains(&u)) && pod_ready(p))
        },
    )
    .await;

    let status = ns.wait_succeeded("tiny-cpu", RUN).await;
    assert_eq!(status.attempts.len(), 1, "the restart added no attempt");
    assert_eq!(status.attempts[0].last_step, Some(20));
    let pods = ns.pod_list().await;
    let names: Vec<String> = pods.iter().map(ResourceExt::name_any).collect();
    assert_eq!(
        names,
        ["tiny-cpu-a1-s0"],
        "one worker pod, never a duplicate"
    );
    assert_eq!(
        pods[0].uid(),
        worker.uid(),
        "the pod that ran before the restart is the one that finished"
    );
    ns.cleanup().await;
}

/// Every object in the namespace with an owner reference to `uid`, as `Kind/name`.
async fn owned_by(ns: &TestNs, uid: &str) -> Vec<String> {
    async fn of<K>(ns: &TestNs, uid: &str, out: &mut Vec<String>)
    where
        K: Resource<Scope = k8s_openapi::NamespaceResourceScope>
            + Clone
            + std::fmt::Debug
            + k8s_openapi::serde::de::DeserializeOwned,
        K::DynamicType: Default,
    {
        let api: Api<K> = Api::namespaced(ns.client.clone(), &ns.name);
        let items = api.list(&ListParams::default()).await.expect("list").items;
        for item in items {
            if item.owner_references().iter().any(|o| o.uid == uid) {
                out.push(format!(
                    "{}/{}",
                    K::kind(&K::DynamicType::default()),
                    item.name_any()
                ));
            }
        }
    }
    let mut out = Vec::new();
    of::<Pod>(ns, uid, &mut out).await;
    of::<PersistentVolumeClaim>(ns, uid, &mut out).await;
    // Workers get no account, Role or binding of their own (the worker API);
    // none may appear owned by the job.
    of::<ServiceAccount>(ns, uid, &mut out).await;
    of::<Role>(ns, uid, &mut out).await;
    of::<RoleBinding>(ns, uid, &mut out).await;
    of::<Service>(ns, uid, &mut out).await;
    of::<ConfigMap>(ns, uid, &mut out).await;
    of::<k8s_openapi::api::networking::v1::NetworkPolicy>(ns, uid, &mut out).await;
    out.sort();
    out
}

#[tokio::test]
#[ignore = "needs a cluster with Headroom installed: make e2e"]
async fn deleting_a_job_removes_everything_it_created() {
    let ns = TestNs::new(E2E, "e2e-delete").await;
    let job = ns.apply_job(&tiny(1000)).await;
    let uid = job.uid().expect("uid");
    running_worker(&ns, "tiny-cpu").await;
    let created = owned_by(&ns, &uid).await;
    for kind in ["Pod/", "PersistentVolumeClaim/"] {
        assert!(
            created.iter().any(|c| c.starts_with(kind)),
            "no {kind} owned by the job: {created:?}"
        );
    }
    for kind in ["ServiceAccount/", "Role/", "RoleBinding/"] {
        assert!(
            !created.iter().any(|c| c.starts_with(kind)),
            "workers hold no API rights, yet the job owns a {kind}: {created:?}"
        );
    }

    ns.jobs()
        .delete("tiny-cpu", &DeleteParams::background())
        .await
        .expect("delete the job");
    // The garbage collector deletes the dependents; the claim goes once no pod uses it.
    ns.wait_for(
        &format!("garbage collection of the job and {created:?}"),
        Duration::from_secs(180),
        || async {
            let gone = ns.jobs().get_opt("tiny-cpu").await.ok()?.is_none();
            (gone && owned_by(&ns, &uid).await.is_empty()).then_some(())
        },
    )
    .await;
    ns.cleanup().await;
}

#[tokio::test]
#[ignore = "needs a cluster with Headroom installed: make e2e"]
async fn an_evicted_worker_resumes_from_its_checkpoint() {
    let ns = TestNs::new(E2E, "e2e-evict").await;
    // No periodic checkpoint before the end: the one resumed from is the
    // checkpoint the worker writes when it is told to stop (SIGTERM).
    let manifest = tiny(16).replace(
        "  worker:",
        "  memoryPolicy: {backoffSeconds: 1}\n  worker:",
    );
    ns.apply_job(&manifest).await;
    let before = ns
        .wait_job("tiny-cpu", "attempt 1 at step 3", RUN, |j| {
            telemetry_step(j, 1).is_some_and(|s| s >= 3)
        })
        .await;
    let reached = telemetry_step(&before, 1).expect("step");
    ns.pods()
        .evict("tiny-cpu-a1-s0", &EvictParams::default())
        .await
        .expect("evict the worker");

    let status = ns.wait_succeeded("tiny-cpu", RUN).await;
    let last = status.attempts.last().expect("attempts");
    assert_eq!(
        last.last_step,
        Some(16),
        "the run ends at spec.training.steps"
    );
    if status.attempts.len() > 1 {
        let first = &status.attempts[0];
        assert_eq!(
            first.outcome,
            AttemptOutcome::Disrupted,
            "an eviction is a disruption: {first:?}"
        );
        assert!(first.last_step.is_some_and(|s| s >= reached), "{first:?}");
    }

    // The worker that finished says where it resumed.
    let resumed = ns.resumed_step().await;
    let resumed = resumed.unwrap_or_else(|| panic!("no worker log says it resumed"));
    assert!(
        resumed >= reached && resumed < 16,
        "resumed at step {resumed}; attempt 1 had reached step {reached}"
    );
    ns.cleanup().await;
}

#[tokio::test]
#[ignore = "needs a cluster with Headroom installed: make e2e"]
async fn kubectl_apply_of_invalid_manifests_fails_with_field_paths() {
    let ns = TestNs::new(E2E, "e2e-invalid").await;
    assert_all_rejected(async |m| {
        let out = tokio::process::Command::new(kubectl())
            .args(["apply", "-n", &ns.name, "-f"])
            .arg(&m.path)
            .output()
            .await
            .unwrap_or_else(|e| panic!("run {:?} (set KUBECTL): {e}", kubectl()));
        if out.status.success() {
            Ok(())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).into_owned())
        }
    })
    .await;
    let jobs = ns
        .jobs()
        .list(&ListParams::default())
        .await
        .expect("list jobs")
        .items;
    assert!(jobs.is_empty(), "nothing was created: {jobs:?}");
    ns.cleanup().await;
}
