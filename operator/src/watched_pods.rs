//! The leading replica's cache of its jobs' pods, lent to the worker API.
//!
//! The controller watches the pods carrying the job label and keeps only
//! those a job controls ([`owning_job`]), for its own decisions; once that
//! cache is complete it hands it over here. The worker API then reads a caller's pod from memory instead of the API server, and
//! keeps a checked token for as long as its pod is still in the cache, the
//! way kube-apiserver checks a bound token against its own informer. A
//! replica standing by never fills it and checks callers as before.

use std::sync::{Arc, OnceLock};

use headroom_api::{LABEL_JOB, MemoryAwareTrainingJob};
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Resource, ResourceExt};

/// Shared between the controller (which fills it once) and the worker API.
#[derive(Clone, Default)]
pub struct WatchedPods(Arc<OnceLock<Store<Pod>>>);

impl std::fmt::Debug for WatchedPods {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WatchedPods")
            .field("filled", &self.is_filled())
            .finish()
    }
}

impl WatchedPods {
    /// Called by the controller once its pod cache is complete.
    pub fn fill(&self, store: Store<Pod>) {
        let _ = self.0.set(store);
    }

    /// Whether the cache is there at all (the leader, once synced).
    pub fn is_filled(&self) -> bool {
        self.0.get().is_some()
    }

    /// `namespace/name` as the watch last saw it; `None` when this replica
    /// has no cache or the pod is not in it (deleted, or not a job's pod).
    pub fn get(&self, namespace: &str, name: &str) -> Option<Arc<Pod>> {
        self.0.get()?.get(&ObjectRef::new(name).within(namespace))
    }
}

/// The job that controls `pod` and carries its label: (name, uid).
pub fn owning_job(pod: &Pod) -> Option<(String, String)> {
    let label = pod.labels().get(LABEL_JOB)?;
    pod.owner_references()
        .iter()
        .find(|o| {
            o.controller == Some(true)
                && o.kind == MemoryAwareTrainingJob::kind(&())
                && o.api_version == MemoryAwareTrainingJob::api_version(&())
                && &o.name == label
        })
        .map(|o| (o.name.clone(), o.uid.clone()))
}
