//! Harness for tests against the real control plane (`make test-apiserver`):
//! the CRD, a fresh namespace per test, an in-process controller scoped to it,
//! polling waits with a timeout that dump the namespace's state on failure.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use headroom_api::MemoryAwareTrainingJob;
use headroom_operator::controller::{self, ControllerConfig};
use headroom_operator::metrics::Metrics;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::{Client, ResourceExt};
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub const TIMEOUT: Duration = Duration::from_secs(30);

pub async fn client() -> Client {
    Client::try_default()
        .await
        .expect("KUBECONFIG must point at the test control plane (make test-apiserver)")
}

pub async fn install_crd(client: &Client) {
    headroom_operator::crd::install(client, "headroom-tests")
        .await
        .expect("CRD installed and established");
}

/// A namespace of one's own for one test.
pub struct TestNs {
    pub client: Client,
    pub name: String,
}

impl TestNs {
    pub async fn new(prefix: &str) -> Self {
        let client = client().await;
        install_crd(&client).await;
        let suffix: u32 = std::process::id()
            ^ (std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.subsec_nanos()));
        let name = format!("{prefix}-{:06x}", suffix & 0xff_ffff);
        let ns: Namespace = serde_json::from_value(serde_json::json!({"metadata": {"name": name, "labels": {"headroom.dev/test": "true"}}})).expect("ns");
        Api::<Namespace>::all(client.clone())
            .patch(
                &name,
                &PatchParams::apply("headroom-tests"),
                &Patch::Apply(&ns),
            )
            .await
            .expect("namespace");
        TestNs { client, name }
    }

    pub fn jobs(&self) -> Api<MemoryAwareTrainingJob> {
        Api::namespaced(self.client.clone(), &self.name)
    }

    pub fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.client.clone(), &self.name)
    }

    /// Runs a controller scoped to this namespace.
    pub fn start_operator(&self, config: ControllerConfig) -> Operator {
        let (stop, rx) = watch::channel(false);
        let metrics = Arc::new(Metrics::default());
        let client = self.client.clone();
        let config = ControllerConfig {
            namespace: Some(self.name.clone()),
            ..config
        };
        let m = metrics.clone();
        let handle = tokio::spawn(async move {
            let mut rx = rx;
            let shutdown = async move {
                let _ = rx.wait_for(|s| *s).await;
            };
            controller::run(client, m, config, "test-operator", shutdown).await;
        });
        Operator {
            stop,
            handle,
            metrics,
        }
    }

    /// Applies a job manifest (YAML) in this namespace.
    pub async fn apply_job(&self, yaml: &str) -> MemoryAwareTrainingJob {
        let mut job: MemoryAwareTrainingJob = serde_yaml::from_str(yaml).expect("job manifest");
        job.metadata.namespace = Some(self.name.clone());
        let name = job.name_any();
        self.jobs()
            .patch(
                &name,
                &PatchParams::apply("headroom-tests"),
                &Patch::Apply(&job),
            )
            .await
            .expect("job applies")
    }

    /// Polls until `ok` holds for the job, or fails the test with the namespace's state.
    pub async fn wait_job(
        &self,
        name: &str,
        what: &str,
        ok: impl Fn(&MemoryAwareTrainingJob) -> bool,
    ) -> MemoryAwareTrainingJob {
        let deadline = tokio::time::Instant::now() + TIMEOUT;
        loop {
            match self.jobs().get(name).await {
                Ok(job) if ok(&job) => return job,
                Ok(_) => {}
                Err(e) => eprintln!("get {name}: {e}"),
            }
            if tokio::time::Instant::now() > deadline {
                panic!("timed out waiting for {what}\n{}", self.dump().await);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Polls until `ok` holds for the pod list (sorted by name).
    pub async fn wait_pods(&self, what: &str, ok: impl Fn(&[Pod]) -> bool) -> Vec<Pod> {
        let deadline = tokio::time::Instant::now() + TIMEOUT;
        loop {
            let mut pods = self
                .pods()
                .list(&ListParams::default())
                .await
                .expect("list pods")
                .items;
            pods.sort_by_key(ResourceExt::name_any);
            if ok(&pods) {
                return pods;
            }
            if tokio::time::Instant::now() > deadline {
                panic!("timed out waiting for {what}\n{}", self.dump().await);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Writes a pod's status the way a kubelet would.
    pub async fn set_pod_status(&self, pod: &str, status: serde_json::Value) {
        self.pods()
            .patch_status(
                pod,
                &PatchParams::default(),
                &Patch::Merge(serde_json::json!({"status": status})),
            )
            .await
            .expect("pod status patch");
    }

    pub async fn dump(&self) -> String {
        let jobs = self
            .jobs()
            .list(&ListParams::default())
            .await
            .map(|l| l.items)
            .unwrap_or_default();
        let pods = self
            .pods()
            .list(&ListParams::default())
            .await
            .map(|l| l.items)
            .unwrap_or_default();
        let mut out = format!("--- namespace {} ---\n", self.name);
        for j in jobs {
            out.push_str(&format!(
                "job {}: {}\n",
                j.name_any(),
                serde_json::to_string_pretty(&j.status).unwrap_or_default()
            ));
        }
        for p in pods {
            out.push_str(&format!(
                "pod {} phase {:?}\n",
                p.name_any(),
                p.status.and_then(|s| s.phase)
            ));
        }
        out
    }

    /// Deletes the namespace's jobs (children go with them) and the namespace.
    pub async fn cleanup(self) {
        if std::env::var_os("HEADROOM_KEEP_TEST_NAMESPACES").is_some() {
            return;
        }
        let _ = Api::<Namespace>::all(self.client.clone())
            .delete(&self.name, &DeleteParams::default())
            .await;
    }
}

/// An in-process controller.
pub struct Operator {
    stop: watch::Sender<bool>,
    handle: JoinHandle<()>,
    pub metrics: Arc<Metrics>,
}

impl Operator {
    /// Graceful stop: in-flight reconciles finish first.
    pub async fn stop(self) {
        let _ = self.stop.send(true);
        let _ = tokio::time::timeout(TIMEOUT, self.handle).await;
    }
}

pub fn oom_killed() -> serde_json::Value {
    terminated(137, "OOMKilled", None)
}

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

pub fn running() -> serde_json::Value {
    serde_json::json!({
        "phase": "Running",
        "containerStatuses": [{"name": "worker", "image": "headroom-worker:dev", "imageID": "", "ready": true, "restartCount": 0, "state": {"running": {}}}]
    })
}
