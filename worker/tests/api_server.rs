//! Telemetry reaches `status.workers[<pod>]` of a job on a real kube-apiserver
//! (the e2e control-plane harness) the way it does in a cluster: the worker
//! binary posts it to the operator's worker API
//! (`headroom_operator::worker_api`, served here on a loopback port over TLS
//! with a certificate issued from a chart-made CA, which the worker trusts alone),
//! presenting a token bound to its pod, and the operator writes the job's
//! reports together (`headroom_operator::worker_reports`); two workers keep their
//! own entries, each with its final report. The
//! worker runs without any Kubernetes configuration: it needs no API rights.
//!
//! Ignored by plain `cargo test`. Run with the control plane up:
//!   e2e/cluster/controlplane.sh up
//!   KUBECONFIG=~/.cache/headroom/state/controlplane/kubeconfig \
//!     cargo test -p headroom-worker --test api_server -- --ignored --test-threads=1

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use headroom_api::{
    CHECKPOINT_DIR_ENV, LABEL_ATTEMPT, LABEL_JOB, LABEL_STAGE, MemoryAwareTrainingJob,
    PLAN_JSON_ENV, POD_NAME_ENV, TELEMETRY_INTERVAL_ENV, WORKER_API_AUDIENCE, WORKER_API_CA_ENV,
    WORKER_API_ENV, WORKER_API_TOKEN_ENV, WorkerAssignment, exit_code,
};
use headroom_e2e::fixtures::CPU_TINY;
use headroom_e2e::{API_SERVER, TestNs};
use headroom_planner::Inventory;
use headroom_worker::run::TERMINATION_MESSAGE_PATH_ENV;
use k8s_openapi::api::core::v1::Pod;
use kube::api::PostParams;
use kube::{Resource, ResourceExt};

/// The CA the worker API's certificate is issued from: one made as the
/// chart makes it (Helm's `genCA`), the operator's test fixture.
const WORKER_API_CA: &str = include_str!("../../operator/src/worker_api/testdata/helm-ca.crt");
const WORKER_API_CA_KEY: &str = include_str!("../../operator/src/worker_api/testdata/helm-ca.key");

/// The operator's worker API on a loopback port, over TLS as the chart
/// installs it, acting with the test's (admin) client as the operator acts
/// with its own: its base URL (`https://127.0.0.1:<port>`).
async fn serve_worker_api(ns: &TestNs) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a loopback port");
    let base = format!("https://{}", listener.local_addr().expect("address"));
    let ca_dir = scratch(&format!("ca-{}", ns.name));
    std::fs::write(ca_dir.join("ca.crt"), WORKER_API_CA).expect("ca.crt");
    std::fs::write(ca_dir.join("ca.key"), WORKER_API_CA_KEY).expect("ca.key");
    let tls = headroom_operator::worker_api::ServingTls::issue(&ca_dir, &["127.0.0.1".into()])
        .expect("the worker API's certificate");
    let key = headroom_operator::worker_api::OperatorKey::random().expect("a key");
    // Held reports are written per job every 0.2 s (the workers' interval
    // below), or at once for a new worker or peak.
    let reports = headroom_operator::worker_api::WorkerReports::start(
        ns.client.clone(),
        std::time::Duration::from_millis(200),
    );
    // No controller here: callers' pods are read from the API server.
    let router =
        headroom_operator::worker_api::router(ns.client.clone(), key, reports, Default::default());
    tokio::spawn(async move {
        headroom_operator::worker_api::serve(
            listener,
            router,
            headroom_operator::worker_api::Limits::WORKER_API,
            Some(tls.config),
        )
        .await
        .expect("the worker API serves");
    });
    base
}

/// The pod object of a worker (or initializer) of `job` named `name`, as the
/// operator creates it: labelled with the job and controlled by it. It never
/// runs (no kubelet); the worker binary runs in its stead on this machine.
async fn worker_pod(
    ns: &TestNs,
    job: &MemoryAwareTrainingJob,
    name: &str,
    labels: &[(&str, &str)],
) -> Pod {
    let mut all = BTreeMap::from([(LABEL_JOB.to_string(), job.name_any())]);
    all.extend(labels.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    let pod: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {
            "name": name,
            "labels": all,
            "ownerReferences": [job.controller_owner_ref(&()).expect("the job has a uid")],
        },
        "spec": {
            "serviceAccountName": "default",
            "automountServiceAccountToken": false,
            "containers": [{"name": "worker", "image": "headroom-worker:test"}],
        },
    }))
    .expect("pod object");
    ns.pods()
        .create(&PostParams::default(), &pod)
        .await
        .unwrap_or_else(|e| panic!("pod {name}: {e}"))
}

/// A token bound to `pod` for the worker API, as the kubelet projects it,
/// written to `dir/token`: the file `HEADROOM_WORKER_API_TOKEN` names.
async fn token_file(ns: &TestNs, pod: &Pod, dir: &Path) -> PathBuf {
    let token = ns.pod_token(pod, &[WORKER_API_AUDIENCE]).await;
    let path = dir.join("token");
    std::fs::write(&path, token).expect("token file");
    path
}

/// A fresh scratch directory for one worker process.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("headroom-api-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("tmp");
    dir
}

/// The worker binary with the worker API and its token, and no Kubernetes
/// configuration to fall back on (no KUBECONFIG, a HOME without ~/.kube).
fn worker_command(dir: &Path, worker_api: &str, token: &Path) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_headroom-worker"));
    command
        .env_remove("KUBECONFIG")
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env_remove("KUBERNETES_SERVICE_PORT")
        .env("HOME", dir)
        .env(WORKER_API_ENV, worker_api)
        .env(WORKER_API_CA_ENV, WORKER_API_CA)
        .env(WORKER_API_TOKEN_ENV, token)
        .env(TELEMETRY_INTERVAL_ENV, "0.2");
    command
}

/// The sample CPU job under `name`, shrunk so the worker trains it in seconds.
async fn create_job(ns: &TestNs, name: &str) -> MemoryAwareTrainingJob {
    let mut job: MemoryAwareTrainingJob = serde_yaml::from_str(CPU_TINY).expect("sample parses");
    job.metadata.name = Some(name.into());
    let t = job
        .spec
        .model
        .transformer
        .as_mut()
        .expect("transformer sample");
    (t.layers, t.hidden, t.heads, t.sequence_length, t.vocabulary) = (2, 32, 4, 16, 32);
    job.spec.training.global_batch = 4;
    job.spec.training.steps = Some(30);
    ns.apply(job).await
}

fn assignment(job: &MemoryAwareTrainingJob) -> WorkerAssignment {
    let req = job.spec.job_request().expect("valid spec");
    WorkerAssignment {
        job: job.metadata.name.clone().expect("name"),
        namespace: job.metadata.namespace.clone().expect("namespace"),
        attempt: 1,
        stage: 0,
        replica: 0,
        model: req.model.clone(),
        plan: headroom_planner::plan(&req, &Inventory::default()).expect("plan"),
        recipe: job.spec.training.recipe(None).expect("recipe"),
        checkpoint_every_steps: job.spec.training.checkpoint_every_steps,
        seed: job.spec.training.seed,
        files: None,
        memory_guard: None,
    }
}

fn run_worker(
    assignment: &WorkerAssignment,
    pod: &str,
    dir: &Path,
    worker_api: &str,
    token: &Path,
) -> std::process::Output {
    worker_command(dir, worker_api, token)
        .env(
            PLAN_JSON_ENV,
            serde_json::to_string(assignment).expect("json"),
        )
        .env(CHECKPOINT_DIR_ENV, dir.join("checkpoints"))
        .env(TERMINATION_MESSAGE_PATH_ENV, dir.join("termination-log"))
        .env(POD_NAME_ENV, pod)
        .output()
        .expect("run the worker")
}

#[tokio::test]
#[ignore = "needs the control plane"]
async fn telemetry_reaches_the_job_status_through_the_operator() {
    let ns = TestNs::new(API_SERVER, "hr-telemetry").await;
    let worker_api = serve_worker_api(&ns).await;
    let job = create_job(&ns, "telemetry-tiny").await;
    let a = assignment(&job);

    let pods = ["telemetry-tiny-a1-s0", "telemetry-tiny-a1-s0-twin"];
    for pod in pods {
        let object = worker_pod(&ns, &job, pod, &[(LABEL_ATTEMPT, "1"), (LABEL_STAGE, "0")]).await;
        let dir = scratch(pod);
        let token = token_file(&ns, &object, &dir).await;
        let (a, worker_api, run_dir) = (a.clone(), worker_api.clone(), dir.clone());
        let out =
            tokio::task::spawn_blocking(move || run_worker(&a, pod, &run_dir, &worker_api, &token))
                .await
                .expect("join");
        let _ = std::fs::remove_dir_all(&dir);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(exit_code::SUCCESS), "{stderr}");
        assert!(!stderr.contains("telemetry not written"), "{stderr}");
    }

    // The final reports are written with the job's next write, within an interval.
    let stored = ns
        .wait_for("every worker's final report", RUN_TIMEOUT, || async {
            let job = ns.jobs().get_status("telemetry-tiny").await.ok()?;
            let workers = &job.status.as_ref()?.workers;
            pods.iter()
                .all(|pod| {
                    workers
                        .iter()
                        .any(|w| w.name == *pod && w.step == a.recipe.total_steps)
                })
                .then_some(job)
        })
        .await;
    let status = stored.status.expect("status written");
    for pod in pods {
        let entry = status
            .workers
            .iter()
            .find(|w| w.name == pod)
            .unwrap_or_else(|| panic!("no status.workers entry for {pod}: {:?}", status.workers));
        assert_eq!(
            entry.step, a.recipe.total_steps,
            "the final write carries the last step"
        );
        assert_eq!(
            (
                entry.attempt,
                entry.stage,
                entry.layer_start,
                entry.layer_end
            ),
            (1, 0, 0, 2)
        );
        assert!(entry.loss.is_some_and(f64::is_finite));
        assert!(entry.tokens_per_second.is_some_and(|t| t > 0.0));
        assert!(entry.memory.peak_bytes > 1 << 20, "{:?}", entry.memory);
        assert!(entry.memory.process_rss_bytes.is_some());
    }
    let managers: Vec<String> = stored
        .metadata
        .managed_fields
        .unwrap_or_default()
        .into_iter()
        .filter_map(|m| m.manager)
        .collect();
    assert!(
        managers
            .iter()
            .any(|m| m.starts_with(headroom_operator::worker_reports::FIELD_MANAGER_PREFIX)),
        "the operator's telemetry manager not in {managers:?}"
    );
    ns.cleanup().await;
}

/// The initializer, run as its pod runs it (`POD_NAME`, the worker API and
/// a token bound to its pod; no Kubernetes configuration), against the hub
/// stand-in on a slow link: its download shows in `status.workers[<pod>]`
/// while it runs, through the worker API, and the last write says every
/// file is in place.
#[tokio::test]
#[ignore = "needs the control plane"]
async fn the_initializers_download_progress_is_in_the_status_while_it_runs() {
    use headroom_api::LABEL_ROLE;
    use headroom_api::{
        DataFormat, DataSource, INITIALIZE_JSON_ENV, InitializerAssignment, ModelSource,
    };
    use headroom_e2e::fixtures::CPU_FINETUNE;
    use headroom_e2e::hub::{HubRepo, HubRepos, LocalHub};

    let fixture =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama/tiny-llama");
    let mut repos = HubRepos::new();
    repos.insert(
        "headroom/tiny-llama".into(),
        HubRepo::from_dir(&fixture).expect("fixture"),
    );
    let hub = LocalHub::start("127.0.0.1:0", repos);
    // The weights (862 KB) arrive in 64 KiB pieces 150 ms apart: about 2 s.
    hub.state().pace = Some(std::time::Duration::from_millis(150));
    let weights = std::fs::metadata(fixture.join("model.safetensors"))
        .expect("fixture")
        .len();

    let ns = TestNs::new(API_SERVER, "hr-init-progress").await;
    let manifest = CPU_FINETUNE.replace(
        "volume: {claimName: models, path: tiny-llama}",
        &format!(
            "huggingFace: {{repo: headroom/tiny-llama, endpoint: \"{}\", allowInsecureHttp: true}}",
            hub.endpoint()
        ),
    );
    assert!(manifest.contains("huggingFace"), "the sample changed");
    let worker_api = serve_worker_api(&ns).await;
    let job = ns.apply_job(&manifest).await;
    let name = job.metadata.name.clone().expect("name");
    let pod = format!("{name}-init-1");
    let object = worker_pod(&ns, &job, &pod, &[(LABEL_ROLE, "initializer")]).await;

    let dir = scratch("init");
    let token = token_file(&ns, &object, &dir).await;
    let assignment = InitializerAssignment {
        job: name.clone(),
        namespace: ns.name.clone(),
        model: ModelSource::HuggingFace {
            repo: "headroom/tiny-llama".into(),
            revision: "main".into(),
            endpoint: hub.endpoint(),
        },
        model_dir: dir.join("model").display().to_string(),
        data_file: std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../samples/data/declaration-of-independence.jsonl")
            .display()
            .to_string(),
        data: DataSource::Volume,
        data_format: DataFormat::Jsonl {
            field: "text".into(),
        },
        train_on: headroom_api::TrainOn::Auto,
        data_split: None,
        packing: headroom_api::Packing::Stream,
        sequence_length: 64,
        cache_of: None,
    };
    let child = worker_command(&dir, &worker_api, &token)
        .env(
            INITIALIZE_JSON_ENV,
            serde_json::to_string(&assignment).expect("json"),
        )
        .env(TERMINATION_MESSAGE_PATH_ENV, dir.join("termination-log"))
        .env(POD_NAME_ENV, &pod)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start the initializer");

    // Mid-download: part of the weights, of a known total.
    let seen = ns
        .wait_for("the download in status.workers", RUN_TIMEOUT, || async {
            let job = ns.jobs().get_status(&name).await.ok()?;
            let entry = job.status?.workers.into_iter().find(|w| w.name == pod)?;
            let d = entry.download.clone()?;
            (d.file == "model.safetensors" && d.file_bytes > 0 && d.file_bytes < weights)
                .then_some(entry)
        })
        .await;
    assert_eq!((seen.attempt, seen.layer_end), (0, 0), "{seen:?}");
    let mid = seen.download.expect("download");
    assert_eq!(mid.file_total_bytes, Some(weights), "{mid:?}");
    assert!(mid.files_done < mid.files, "{mid:?}");

    let out = tokio::task::spawn_blocking(move || child.wait_with_output())
        .await
        .expect("join")
        .expect("the initializer ends");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(exit_code::SUCCESS), "{stderr}");
    assert!(!stderr.contains("telemetry not written"), "{stderr}");
    // The last report is written with the job's next write, within an interval.
    let last = ns
        .wait_for("the initializer's last report", RUN_TIMEOUT, || async {
            let job = ns.jobs().get_status(&name).await.ok()?;
            let entry = job.status?.workers.into_iter().find(|w| w.name == pod)?;
            entry.download.filter(|d| d.files_done == d.files)
        })
        .await;
    assert_eq!(last.files_done, last.files, "{last:?}");
    let fixture_bytes: u64 = std::fs::read_dir(&fixture)
        .expect("fixture")
        .map(|e| e.expect("entry").metadata().expect("meta").len())
        .sum();
    assert_eq!(last.downloaded_bytes, fixture_bytes, "{last:?}");
    let _ = std::fs::remove_dir_all(&dir);
    ns.cleanup().await;
}

const RUN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// The link key the worker obtains from the operator's worker API with its
/// pod-bound token: the same for two pods of one job (so their handshakes
/// succeed), different for another job's pod (so it cannot join them).
#[tokio::test]
#[ignore = "needs the control plane: make test-apiserver"]
async fn workers_of_one_job_obtain_one_link_key_and_another_jobs_worker_another() {
    let ns = TestNs::new(API_SERVER, "hr-link-key").await;
    let worker_api = serve_worker_api(&ns).await;
    let mut keys = Vec::new();
    for (job, pod) in [
        ("keys-a", "keys-a-a1-s0"),
        ("keys-a", "keys-a-a1-s1"),
        ("keys-b", "keys-b-a1-s0"),
    ] {
        let job = match ns.jobs().get_opt(job).await.expect("get") {
            Some(existing) => existing,
            None => create_job(&ns, job).await,
        };
        let object = worker_pod(&ns, &job, pod, &[(LABEL_ATTEMPT, "1"), (LABEL_STAGE, "0")]).await;
        let dir = scratch(pod);
        let token = token_file(&ns, &object, &dir).await;
        let base = worker_api.clone();
        let key = tokio::task::spawn_blocking(move || {
            headroom_worker::worker_api::WorkerApi::with_ca(&base, token, WORKER_API_CA)?.peer_key()
        })
        .await
        .expect("join")
        .unwrap_or_else(|e| panic!("{pod}: {e}"));
        let _ = std::fs::remove_dir_all(&dir);
        keys.push(headroom_worker::link_auth::LinkKey::from_hex(&key.key).expect("64 hex digits"));
    }
    assert!(keys[0] == keys[1], "two pods of one job, one key");
    assert!(keys[0] != keys[2], "another job's pod, another key");
    ns.cleanup().await;
}
