//! The worker's one way to anything asynchronous: a single tokio runtime,
//! built once per process, and the Kubernetes client, created the first time
//! the worker needs the cluster and kept for the rest of the run.
//!
//! The training code is synchronous (burn), so the handle offers
//! [`ClusterHandle::block_on`] to the threads that talk to the API server:
//! the status reporter's thread ([`crate::report::KubeStatusSink`]) and the
//! pipeline's neighbour lookup ([`ClusterHandle::pod_ip`]). The SIGTERM
//! watcher ([`ClusterHandle::watch_sigterm`]) is a task on the same runtime.
//! The runtime has one worker thread of its own, which drives the timers,
//! the sockets and the signal handler whichever thread is waiting.
//!
//! Without a Kubernetes configuration (no in-cluster service account, no
//! KUBECONFIG, no ~/.kube/config: local runs and tests) there is no client:
//! telemetry is logged instead of written, and pipeline peers come from
//! `HEADROOM_PIPELINE_ADDRESSES` or DNS.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use k8s_openapi::api::core::v1::Pod;

/// Why there is no Kubernetes client (decided once per process).
#[derive(Debug, thiserror::Error)]
pub enum NoClient {
    #[error("no Kubernetes configuration ({0})")]
    Configuration(#[source] kube::config::InferConfigError),
    #[error("Kubernetes client: {0}")]
    Client(#[source] kube::Error),
}

/// A failed request through the [`ClusterHandle`].
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("tokio runtime: {0}")]
    Runtime(#[source] std::io::Error),
    #[error(transparent)]
    NoClient(Arc<NoClient>),
    #[error(transparent)]
    Api(#[from] kube::Error),
}

/// The runtime and the (lazily created, then shared) Kubernetes client.
pub struct ClusterHandle {
    runtime: tokio::runtime::Runtime,
    client: OnceLock<Result<kube::Client, Arc<NoClient>>>,
}

impl std::fmt::Debug for ClusterHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let client = match self.client.get() {
            None => "not created yet",
            Some(Ok(_)) => "connected",
            Some(Err(_)) => "unavailable",
        };
        f.debug_struct("ClusterHandle")
            .field("client", &client)
            .finish_non_exhaustive()
    }
}

impl ClusterHandle {
    /// Builds the process's runtime; the client waits for [`ClusterHandle::client`].
    pub fn new() -> Result<Self, ClusterError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("headroom-runtime")
            .enable_all()
            .build()
            .map_err(ClusterError::Runtime)?;
        Ok(ClusterHandle {
            runtime,
            client: OnceLock::new(),
        })
    }

    /// Runs `future` to completion on the shared runtime, blocking this thread
    /// (which must not be one of the runtime's own).
    pub fn block_on<F: Future>(&self, future: F) -> F::Output {
        self.runtime.block_on(future)
    }

    /// The Kubernetes client from the in-cluster service account, KUBECONFIG
    /// or ~/.kube/config, created by the first call; later calls share it, or
    /// the reason there is none.
    pub fn client(&self) -> Result<kube::Client, Arc<NoClient>> {
        self.client
            .get_or_init(|| {
                let config = self
                    .block_on(kube::Config::infer())
                    .map_err(|e| Arc::new(NoClient::Configuration(e)))?;
                // The client's background task goes onto the shared runtime.
                let _inside = self.runtime.enter();
                kube::Client::try_from(config).map_err(|e| Arc::new(NoClient::Client(e)))
            })
            .clone()
    }

    /// A pod's IP from the API server; `None` while it has none.
    pub fn pod_ip(&self, namespace: &str, name: &str) -> Result<Option<String>, ClusterError> {
        let client = self.client().map_err(ClusterError::NoClient)?;
        let pod = self.block_on(kube::Api::<Pod>::namespaced(client, namespace).get_opt(name))?;
        Ok(pod.and_then(|p| p.status).and_then(|s| s.pod_ip))
    }

    /// A flag set when the process receives SIGTERM (eviction, deletion, node
    /// drain). The training loop checks it between steps, saves a checkpoint
    /// and exits, inside the pod's grace period when a step is shorter than
    /// it. The handler is in place when this returns, so an early SIGTERM is
    /// not lost.
    pub fn watch_sigterm(&self) -> Arc<AtomicBool> {
        use tokio::signal::unix::{SignalKind, signal};
        let flag = Arc::new(AtomicBool::new(false));
        let installed = {
            let _inside = self.runtime.enter();
            signal(SignalKind::terminate())
        };
        match installed {
            Ok(mut term) => {
                let set = flag.clone();
                self.runtime.spawn(async move {
                    if term.recv().await.is_some() {
                        tracing::warn!("SIGTERM: stopping after this step");
                        set.store(true, Ordering::SeqCst);
                    }
                });
            }
            Err(e) => {
                tracing::warn!("cannot watch SIGTERM ({e}); it will end the process at once")
            }
        }
        flag
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn threads_share_the_one_runtime() {
        let cluster = Arc::new(ClusterHandle::new().expect("runtime"));
        let started = Instant::now();
        // Timers fire for every waiting thread at once: the runtime's own
        // thread drives them, not whichever thread happens to block.
        let waits: Vec<_> = (0..3)
            .map(|k| {
                let cluster = cluster.clone();
                std::thread::spawn(move || {
                    cluster.block_on(async move {
                        tokio::time::sleep(Duration::from_millis(200)).await;
                        k
                    })
                })
            })
            .collect();
        let done: Vec<i32> = waits
            .into_iter()
            .map(|w| w.join().expect("thread"))
            .collect();
        assert_eq!(done, vec![0, 1, 2]);
        assert!(started.elapsed() < Duration::from_secs(2));
        assert!(format!("{cluster:?}").contains("not created yet"));
    }
}
