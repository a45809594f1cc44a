//! Waits on a test namespace's jobs, pods and events, and reads of a job's
//! status, that the controller tests would otherwise spell out each time.

use std::time::Duration;

use headroom_api::{JobPhase, LABEL_ATTEMPT, MemoryAwareTrainingJob, MemoryAwareTrainingJobStatus};
use headroom_e2e::{TestNs, attempts, phase};
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::ResourceExt;
use kube::api::Api;

use super::TIMEOUT;

/// Waits (each within [`TIMEOUT`]) on what the controller does in a test's
/// namespace.
pub trait ControllerWaits {
    /// The job once its phase is `phase`.
    async fn wait_phase(&self, job: &str, phase: JobPhase) -> MemoryAwareTrainingJob;
    /// The job once its status records `n` attempts.
    async fn wait_attempts(&self, job: &str, n: usize) -> MemoryAwareTrainingJob;
    /// The job once one of its conditions satisfies `ok`.
    async fn wait_condition(
        &self,
        job: &str,
        what: &str,
        ok: impl Fn(&Condition) -> bool,
    ) -> MemoryAwareTrainingJob;
    /// The namespace's pods once there are exactly `n`.
    async fn wait_pod_count(&self, what: &str, n: usize) -> Vec<Pod>;
    /// The namespace's pods once attempt `n` has exactly one.
    async fn wait_attempt_pod(&self, n: u32) -> Vec<Pod>;
    /// The pod named `name`, once it exists.
    async fn wait_pod_named(&self, name: &str) -> Pod;
    /// The first event of the namespace with this reason, once there is one.
    async fn wait_event(&self, reason: &str) -> Event;
    /// Asserts the namespace has no pods, a moment after the controller
    /// acted (so that a pod it wrongly created would be there).
    async fn assert_no_pods_yet(&self);
    /// The namespace's checkpoint claims.
    fn claims(&self) -> Api<PersistentVolumeClaim>;
}

impl ControllerWaits for TestNs {
    async fn wait_phase(&self, job: &str, want: JobPhase) -> MemoryAwareTrainingJob {
        self.wait_job(job, &format!("phase {want:?}"), TIMEOUT, |j| {
            phase(j) == Some(want)
        })
        .await
    }

    async fn wait_attempts(&self, job: &str, n: usize) -> MemoryAwareTrainingJob {
        self.wait_job(job, &format!("attempt {n}"), TIMEOUT, |j| attempts(j) == n)
            .await
    }

    async fn wait_condition(
        &self,
        job: &str,
        what: &str,
        ok: impl Fn(&Condition) -> bool,
    ) -> MemoryAwareTrainingJob {
        self.wait_job(job, what, TIMEOUT, |j| {
            j.status
                .as_ref()
                .is_some_and(|s| s.conditions.iter().any(&ok))
        })
        .await
    }

    async fn wait_pod_count(&self, what: &str, n: usize) -> Vec<Pod> {
        self.wait_pods(what, TIMEOUT, |p| p.len() == n).await
    }

    async fn wait_attempt_pod(&self, n: u32) -> Vec<Pod> {
        self.wait_pods(&format!("attempt {n} pod"), TIMEOUT, |p| {
            pods_of_attempt(p, n) == 1
        })
        .await
    }

    async fn wait_pod_named(&self, name: &str) -> Pod {
        let pods = self
            .wait_pods(&format!("pod {name}"), TIMEOUT, |p| {
                p.iter().any(|p| p.name_any() == name)
            })
            .await;
        pods.into_iter()
            .find(|p| p.name_any() == name)
            .expect("the pod waited for")
    }

    async fn wait_event(&self, reason: &str) -> Event {
        let events: Api<Event> = Api::namespaced(self.client.clone(), &self.name);
        self.wait_for(&format!("a {reason} event"), TIMEOUT, || async {
            events
                .list(&Default::default())
                .await
                .ok()?
                .items
                .into_iter()
                .find(|e| e.reason.as_deref() == Some(reason))
        })
        .await
    }

    async fn assert_no_pods_yet(&self) {
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(self.pod_list().await.is_empty());
    }

    fn claims(&self) -> Api<PersistentVolumeClaim> {
        Api::namespaced(self.client.clone(), &self.name)
    }
}

/// The job's status, which a job waited for has.
pub fn status_of(job: MemoryAwareTrainingJob) -> MemoryAwareTrainingJobStatus {
    job.status.expect("status")
}

/// The job's status message, or "" without one.
pub fn message_of(job: MemoryAwareTrainingJob) -> String {
    job.status.and_then(|s| s.message).unwrap_or_default()
}

/// The status's condition of this type, which must be there.
pub fn condition<'a>(status: &'a MemoryAwareTrainingJobStatus, type_: &str) -> &'a Condition {
    status
        .conditions
        .iter()
        .find(|c| c.type_ == type_)
        .unwrap_or_else(|| panic!("no {type_} condition in {:?}", status.conditions))
}

/// Whether the status has a condition of this type, status and reason.
pub fn has_condition(
    status: &MemoryAwareTrainingJobStatus,
    type_: &str,
    value: &str,
    reason: &str,
) -> bool {
    status
        .conditions
        .iter()
        .any(|c| c.type_ == type_ && c.status == value && c.reason == reason)
}

/// How many of the pods belong to attempt `n`.
pub fn pods_of_attempt(pods: &[Pod], n: u32) -> usize {
    pods.iter()
        .filter(|p| p.labels().get(LABEL_ATTEMPT) == Some(&n.to_string()))
        .count()
}

/// The value of the first container's environment variable `name`.
pub fn env_of(pod: &Pod, name: &str) -> Option<String> {
    pod.spec.as_ref()?.containers[0]
        .env
        .as_ref()?
        .iter()
        .find(|e| e.name == name)?
        .value
        .clone()
}

/// The first container's limits, which the worker pods all set.
pub fn limits_of(
    pod: &Pod,
) -> std::collections::BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity> {
    pod.spec.as_ref().expect("spec").containers[0]
        .resources
        .as_ref()
        .and_then(|r| r.limits.clone())
        .expect("limits")
}
