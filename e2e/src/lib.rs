//! Harness for the end-to-end suite: every test in a fresh namespace of the
//! cluster in `KUBECONFIG` (Headroom installed there, e.g. by `make e2e`),
//! polling waits with a timeout that dump the namespace (jobs, pods, their
//! logs) on failure, cleanup unless `HEADROOM_KEEP_TEST_NAMESPACES` is set.
//!
//! Settings (environment):
//! * `KUBECTL`: the kubectl binary for the tests that run it (default: `kubectl` on `PATH`;
//!   `make e2e` sets the one built by e2e/cluster/build-binaries.sh).
//! * `HEADROOM_NAMESPACE` / `HEADROOM_OPERATOR_DEPLOYMENT`: where the operator runs
//!   (defaults: `headroom-system` / `headroom-operator`, the Helm chart's).

use std::future::Future;
use std::time::Duration;

use headroom_api::{JobPhase, MemoryAwareTrainingJob, MemoryAwareTrainingJobStatus};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::{Api, DeleteParams, ListParams, LogParams, Patch, PatchParams};
use kube::{Client, ResourceExt};

/// Whether the job has ended: Succeeded or Failed.
pub fn ended(job: &MemoryAwareTrainingJob) -> bool {
    matches!(
        job.status.as_ref().and_then(|s| s.phase),
        Some(JobPhase::Succeeded | JobPhase::Failed)
    )
}

/// One test's namespace.
#[derive(Clone)]
pub struct TestNs {
    pub client: Client,
    pub name: String,
}

impl std::fmt::Debug for TestNs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestNs").field("name", &self.name).finish()
    }
}

impl TestNs {
    pub async fn new(prefix: &str) -> Self {
        let client = Client::try_default()
            .await
            .expect("KUBECONFIG must point at a cluster with Headroom installed (make e2e)");
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let name = format!("{prefix}-{:06x}", (std::process::id() ^ nanos) & 0xff_ffff);
        let ns: Namespace = serde_json::from_value(
            serde_json::json!({"metadata": {"name": name, "labels": {"headroom.dev/e2e": "true"}}}),
        )
        .expect("namespace object");
        Api::<Namespace>::all(client.clone())
            .patch(
                &name,
                &PatchParams::apply("headroom-e2e"),
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

    pub async fn apply_job(&self, yaml: &str) -> MemoryAwareTrainingJob {
        let mut job: MemoryAwareTrainingJob = serde_yaml::from_str(yaml).expect("job manifest");
        job.metadata.namespace = Some(self.name.clone());
        self.jobs()
            .patch(
                &job.name_any(),
                &PatchParams::apply("headroom-e2e"),
                &Patch::Apply(&job),
            )
            .await
            .expect("job applies")
    }

    /// Polls every 500 ms until `ok` holds; on timeout fails with the namespace's state.
    pub async fn wait_job(
        &self,
        name: &str,
        what: &str,
        timeout: Duration,
        ok: impl Fn(&MemoryAwareTrainingJob) -> bool,
    ) -> MemoryAwareTrainingJob {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if let Ok(job) = self.jobs().get(name).await
                && ok(&job)
            {
                return job;
            }
            if tokio::time::Instant::now() > deadline {
                panic!(
                    "timed out after {timeout:?} waiting for {what}\n{}",
                    self.dump().await
                );
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// Waits until the job ends; fails with the namespace's state unless it
    /// Succeeded. Returns its status.
    pub async fn wait_succeeded(
        &self,
        name: &str,
        timeout: Duration,
    ) -> MemoryAwareTrainingJobStatus {
        let job = self
            .wait_job(name, "Succeeded or Failed", timeout, ended)
            .await;
        let status = job.status.unwrap_or_default();
        if status.phase != Some(JobPhase::Succeeded) {
            panic!("job {name} ended {:?}\n{}", status.phase, self.dump().await);
        }
        status
    }

    /// Jobs' status, pods' phases and the tail of each pod's log.
    pub async fn dump(&self) -> String {
        let mut out = format!("--- namespace {} ---\n", self.name);
        for j in self
            .jobs()
            .list(&ListParams::default())
            .await
            .map(|l| l.items)
            .unwrap_or_default()
        {
            out.push_str(&format!(
                "job {}: {}\n",
                j.name_any(),
                serde_json::to_string_pretty(&j.status).unwrap_or_default()
            ));
        }
        for p in self
            .pods()
            .list(&ListParams::default())
            .await
            .map(|l| l.items)
            .unwrap_or_default()
        {
            let name = p.name_any();
            out.push_str(&format!(
                "pod {name}: {:?}\n",
                p.status.as_ref().map(|s| (&s.phase, &s.container_statuses))
            ));
            let logs = self
                .pods()
                .logs(
                    &name,
                    &LogParams {
                        tail_lines: Some(20),
                        ..LogParams::default()
                    },
                )
                .await
                .unwrap_or_default();
            out.push_str(&format!("  log:\n{logs}\n"));
        }
        out
    }

    /// Polls `probe` every 500 ms until it yields a value; on timeout fails with
    /// the namespace's state.
    pub async fn wait_for<T, F, Fut>(&self, what: &str, timeout: Duration, mut probe: F) -> T
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Option<T>>,
    {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if let Some(found) = probe().await {
                return found;
            }
            if tokio::time::Instant::now() > deadline {
                panic!(
                    "timed out after {timeout:?} waiting for {what}\n{}",
                    self.dump().await
                );
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// The pods of this namespace, by name.
    pub async fn pod_list(&self) -> Vec<Pod> {
        self.pods()
            .list(&ListParams::default())
            .await
            .expect("list pods")
            .items
    }

    pub async fn cleanup(self) {
        if std::env::var_os("HEADROOM_KEEP_TEST_NAMESPACES").is_none() {
            let _ = Api::<Namespace>::all(self.client.clone())
                .delete(&self.name, &DeleteParams::default())
                .await;
        }
    }
}

/// The kubectl binary: `$KUBECTL`, else `kubectl` on `PATH`.
pub fn kubectl() -> std::path::PathBuf {
    std::env::var_os("KUBECTL")
        .filter(|k| !k.is_empty())
        .map_or_else(|| "kubectl".into(), Into::into)
}

/// Namespace of the Headroom operator (`$HEADROOM_NAMESPACE`, default `headroom-system`).
pub fn operator_namespace() -> String {
    std::env::var("HEADROOM_NAMESPACE").unwrap_or_else(|_| "headroom-system".into())
}

/// The operator's Deployment (`$HEADROOM_OPERATOR_DEPLOYMENT`, default the
/// chart's `headroom-operator`).
pub fn operator_deployment() -> String {
    std::env::var("HEADROOM_OPERATOR_DEPLOYMENT").unwrap_or_else(|_| "headroom-operator".into())
}

/// Label selector of the operator's pods, read from its Deployment.
pub async fn operator_selector(client: &Client) -> String {
    let deployment = Api::<Deployment>::namespaced(client.clone(), &operator_namespace())
        .get(&operator_deployment())
        .await
        .unwrap_or_else(|e| {
            panic!(
                "deployment {}/{}: {e}",
                operator_namespace(),
                operator_deployment()
            )
        });
    deployment
        .spec
        .and_then(|s| s.selector.match_labels)
        .unwrap_or_default()
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// True when the pod's `Ready` condition is `True`.
pub fn pod_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// The pod's phase (`Pending`, `Running`, ...), empty if unknown.
pub fn pod_phase(pod: &Pod) -> &str {
    pod.status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or_default()
}
