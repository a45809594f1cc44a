//! A namespace of one's own per test, on the cluster in `KUBECONFIG`, with
//! waits that fail with a dump of the namespace (jobs, pods, events, log
//! tails) and a cleanup that deletes it unless
//! `HEADROOM_KEEP_TEST_NAMESPACES` is set.

use std::future::Future;
use std::time::Duration;

use headroom_api::{JobPhase, MemoryAwareTrainingJob, MemoryAwareTrainingJobStatus};
use k8s_openapi::api::core::v1::{Namespace, Pod, ServiceAccount};
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, DeleteParams, ListParams, LogParams, Patch, PatchParams};
use kube::{Client, ResourceExt};

use crate::wait;

/// How a test suite uses its cluster.
#[derive(Clone, Copy, Debug)]
pub struct Suite {
    /// Field manager of everything the kit applies.
    pub field_manager: &'static str,
    /// Label (`<label>: "true"`) on the namespaces and nodes it creates, to
    /// find leftovers.
    pub namespace_label: &'static str,
    /// Install the CRD before creating a namespace: a bare control plane has
    /// no Helm chart that did.
    pub install_crd: bool,
    /// Interval of the polling waits.
    pub poll: Duration,
    /// What `KUBECONFIG` must point at, for the message when it does not.
    pub needs: &'static str,
}

/// The end-to-end suite: a cluster with Headroom installed by the Helm chart
/// (`make e2e`), real pods.
pub const E2E: Suite = Suite {
    field_manager: "headroom-e2e",
    namespace_label: "headroom.dev/e2e",
    install_crd: false,
    poll: Duration::from_millis(500),
    needs: "KUBECONFIG must point at a cluster with Headroom installed (make e2e)",
};

/// Tests against the loopback control plane (`make test-apiserver`): no
/// kubelet, no scheduler, the CRD installed by the test itself.
pub const API_SERVER: Suite = Suite {
    field_manager: "headroom-tests",
    namespace_label: "headroom.dev/test",
    install_crd: true,
    poll: Duration::from_millis(100),
    needs: "KUBECONFIG must point at the test control plane (make controlplane-up; make test-apiserver)",
};

impl Suite {
    /// A client for the cluster in `KUBECONFIG`.
    pub async fn client(&self) -> Client {
        Client::try_default().await.expect(self.needs)
    }
}

/// One test's namespace.
#[derive(Clone)]
pub struct TestNs {
    pub client: Client,
    pub name: String,
    pub(crate) suite: Suite,
}

impl std::fmt::Debug for TestNs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestNs").field("name", &self.name).finish()
    }
}

/// A test namespace older than this is a leftover: no test runs so long.
const LEFTOVER_AGE: Duration = Duration::from_secs(3600);

/// Deletes what failed runs left on a control plane whose state persists
/// between runs (once per process): test namespaces older than
/// [`LEFTOVER_AGE`], and the suite's fake Nodes whose namespace (their name's
/// prefix) is gone or being swept. A leftover Node changes every later
/// planning test's inventory, and a refusal that lists the nodes left out
/// no longer names the one a test made.
async fn sweep_leftovers(client: &Client, suite: Suite) {
    use k8s_openapi::api::core::v1::Node;
    static SWEPT: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();
    SWEPT
        .get_or_init(|| async {
            let selector = ListParams::default().labels(&format!("{}=true", suite.namespace_label));
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs() as i64);
            let namespaces: Api<Namespace> = Api::all(client.clone());
            let Ok(list) = namespaces.list(&selector).await else {
                return;
            };
            let mut live = Vec::new();
            for ns in list.items {
                let age = ns
                    .metadata
                    .creation_timestamp
                    .as_ref()
                    .map_or(0, |t| now - t.0.as_second());
                let terminating = ns.metadata.deletion_timestamp.is_some();
                if age > LEFTOVER_AGE.as_secs() as i64 && !terminating {
                    eprintln!(
                        "sweeping leftover test namespace {} ({age} s old)",
                        ns.name_any()
                    );
                    let _ = namespaces
                        .delete(&ns.name_any(), &DeleteParams::background())
                        .await;
                } else if !terminating {
                    live.push(ns.name_any());
                }
            }
            let nodes: Api<Node> = Api::all(client.clone());
            let Ok(list) = nodes.list(&selector).await else {
                return;
            };
            for node in list.items {
                let name = node.name_any();
                if !live.iter().any(|ns| name.starts_with(&format!("{ns}-"))) {
                    eprintln!("sweeping leftover test node {name}");
                    let _ = nodes.delete(&name, &DeleteParams::background()).await;
                }
            }
        })
        .await;
}

/// `<prefix>-<6 hex digits>`, different per process and call.
pub fn unique_name(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!("{prefix}-{:06x}", (std::process::id() ^ nanos) & 0xff_ffff)
}

impl TestNs {
    /// Creates `<prefix>-<random>` (after installing the CRD, for suites that do).
    pub async fn new(suite: Suite, prefix: &str) -> Self {
        let client = suite.client().await;
        if suite.install_crd {
            crate::crd::install(&client, suite.field_manager)
                .await
                .unwrap_or_else(|e| panic!("CRD installed and served: {e}"));
        }
        if suite.install_crd {
            sweep_leftovers(&client, suite).await;
        }
        let name = unique_name(prefix);
        let ns: Namespace = serde_json::from_value(
            serde_json::json!({"metadata": {"name": name, "labels": {suite.namespace_label: "true"}}}),
        )
        .expect("namespace object");
        Api::<Namespace>::all(client.clone())
            .patch(
                &name,
                &PatchParams::apply(suite.field_manager),
                &Patch::Apply(&ns),
            )
            .await
            .unwrap_or_else(|e| panic!("namespace {name}: {e}"));
        if suite.install_crd {
            // A bare control plane runs no service-account controller; pods
            // (Headroom's workers run under `default`) need the account.
            let account: ServiceAccount =
                serde_json::from_value(serde_json::json!({"metadata": {"name": "default"}}))
                    .expect("account object");
            Api::<ServiceAccount>::namespaced(client.clone(), &name)
                .create(&kube::api::PostParams::default(), &account)
                .await
                .unwrap_or_else(|e| panic!("the default ServiceAccount of {name}: {e}"));
        }
        TestNs {
            client,
            name,
            suite,
        }
    }

    /// A token bound to `pod` for `audiences` (none: the API server's own),
    /// issued for the pod's account as the kubelet projects it into the pod.
    pub async fn pod_token(&self, pod: &Pod, audiences: &[&str]) -> String {
        use k8s_openapi::api::authentication::v1::{
            BoundObjectReference, TokenRequest, TokenRequestSpec,
        };
        let request = TokenRequest {
            spec: TokenRequestSpec {
                audiences: audiences.iter().map(|a| a.to_string()).collect(),
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
        let account = pod
            .spec
            .as_ref()
            .and_then(|s| s.service_account_name.clone())
            .unwrap_or_else(|| "default".into());
        Api::<ServiceAccount>::namespaced(self.client.clone(), &self.name)
            .create_token_request(&account, &kube::api::PostParams::default(), &request)
            .await
            .unwrap_or_else(|e| panic!("a token for pod {}: {e}", pod.name_any()))
            .status
            .expect("token")
            .token
    }

    /// The suite this namespace belongs to.
    pub fn suite(&self) -> Suite {
        self.suite
    }

    pub fn jobs(&self) -> Api<MemoryAwareTrainingJob> {
        Api::namespaced(self.client.clone(), &self.name)
    }

    pub fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.client.clone(), &self.name)
    }

    /// Server-side applies `job` in this namespace.
    pub async fn apply(&self, mut job: MemoryAwareTrainingJob) -> MemoryAwareTrainingJob {
        job.metadata.namespace = Some(self.name.clone());
        let name = job.name_any();
        self.jobs()
            .patch(
                &name,
                &PatchParams::apply(self.suite.field_manager),
                &Patch::Apply(&job),
            )
            .await
            .unwrap_or_else(|e| panic!("job {name} applies: {e}"))
    }

    /// Applies a job manifest (YAML) in this namespace.
    pub async fn apply_job(&self, yaml: &str) -> MemoryAwareTrainingJob {
        self.apply(serde_yaml::from_str(yaml).expect("job manifest"))
            .await
    }

    /// Polls `probe` until it yields a value; on timeout fails with `what`
    /// and the namespace's state.
    pub async fn wait_for<T, F, Fut>(&self, what: &str, timeout: Duration, probe: F) -> T
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Option<T>>,
    {
        wait::until(what, timeout, self.suite.poll, probe, || self.dump()).await
    }

    /// Polls until `ok` holds for the job; on timeout fails with the namespace's state.
    pub async fn wait_job(
        &self,
        name: &str,
        what: &str,
        timeout: Duration,
        ok: impl Fn(&MemoryAwareTrainingJob) -> bool,
    ) -> MemoryAwareTrainingJob {
        self.wait_for(what, timeout, || async {
            match self.jobs().get(name).await {
                Ok(job) => ok(&job).then_some(job),
                Err(e) => {
                    eprintln!("get {name}: {e}");
                    None
                }
            }
        })
        .await
    }

    /// Waits until the job ends; fails with the namespace's state unless it
    /// Succeeded. Returns its status.
    pub async fn wait_succeeded(
        &self,
        name: &str,
        timeout: Duration,
    ) -> MemoryAwareTrainingJobStatus {
        let job = self
            .wait_job(name, "Succeeded or Failed", timeout, wait::ended)
            .await;
        let status = job.status.unwrap_or_default();
        if status.phase != Some(JobPhase::Succeeded) {
            panic!("job {name} ended {:?}\n{}", status.phase, self.dump().await);
        }
        status
    }

    /// Polls until `ok` holds for the namespace's pods (sorted by name).
    pub async fn wait_pods(
        &self,
        what: &str,
        timeout: Duration,
        ok: impl Fn(&[Pod]) -> bool,
    ) -> Vec<Pod> {
        self.wait_for(what, timeout, || async {
            let pods = self.pod_list().await;
            ok(&pods).then_some(pods)
        })
        .await
    }

    /// The pods of this namespace, sorted by name.
    pub async fn pod_list(&self) -> Vec<Pod> {
        let mut pods = self
            .pods()
            .list(&ListParams::default())
            .await
            .expect("list pods")
            .items;
        pods.sort_by_key(ResourceExt::name_any);
        pods
    }

    /// The step some worker of this namespace says (in its log) it resumed
    /// from, if one did.
    pub async fn resumed_step(&self) -> Option<u64> {
        for pod in self.pod_list().await {
            let log = self
                .pods()
                .logs(&pod.name_any(), &LogParams::default())
                .await
                .unwrap_or_default();
            if let Some(step) = wait::resumed_step(&log) {
                return Some(step);
            }
        }
        None
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
            .unwrap_or_else(|e| panic!("pod {pod} status patch: {e}"));
    }

    /// Jobs' status, pods' phases and containers, the tail of each log of a
    /// pod on a node, and the namespace's events.
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
            // Only a kubelet has logs; a control plane without one has none to give.
            if p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_none() {
                continue;
            }
            let params = LogParams {
                tail_lines: Some(20),
                ..LogParams::default()
            };
            let logs =
                tokio::time::timeout(Duration::from_secs(5), self.pods().logs(&name, &params))
                    .await
                    .ok()
                    .and_then(Result::ok)
                    .unwrap_or_default();
            out.push_str(&format!("  log:\n{logs}\n"));
        }
        let events: Api<Event> = Api::namespaced(self.client.clone(), &self.name);
        for e in events
            .list(&ListParams::default())
            .await
            .map(|l| l.items)
            .unwrap_or_default()
        {
            let regarding = e
                .regarding
                .as_ref()
                .map(|r| {
                    format!(
                        "{}/{}",
                        r.kind.as_deref().unwrap_or_default(),
                        r.name.as_deref().unwrap_or_default()
                    )
                })
                .unwrap_or_default();
            out.push_str(&format!(
                "event {} {} {regarding}: {}\n",
                e.type_.as_deref().unwrap_or_default(),
                e.reason.as_deref().unwrap_or_default(),
                e.note.as_deref().unwrap_or_default()
            ));
        }
        out
    }

    /// Deletes the namespace (and so everything in it), unless
    /// `HEADROOM_KEEP_TEST_NAMESPACES` is set.
    pub async fn cleanup(self) {
        if std::env::var_os("HEADROOM_KEEP_TEST_NAMESPACES").is_none() {
            let _ = Api::<Namespace>::all(self.client.clone())
                .delete(&self.name, &DeleteParams::default())
                .await;
        }
    }
}
