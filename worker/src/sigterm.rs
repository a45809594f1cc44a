//! The SIGTERM watch: the worker's one tokio runtime, built once per
//! process, runs the signal handler ([`SigtermWatcher::watch`]) on a worker
//! thread of its own, so the signal is caught whatever the training threads
//! are doing.
//!
//! The worker holds no Kubernetes client: telemetry and the peers' pod IPs go
//! through the operator's worker API ([`crate::worker_api`]), a blocking
//! client that needs no runtime.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// The process's tokio runtime, kept for the SIGTERM handler it runs.
pub struct SigtermWatcher {
    runtime: tokio::runtime::Runtime,
}

impl std::fmt::Debug for SigtermWatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SigtermWatcher").finish_non_exhaustive()
    }
}

impl SigtermWatcher {
    /// Builds the process's runtime (one worker thread).
    pub fn new() -> std::io::Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("headroom-runtime")
            .enable_all()
            .build()?;
        Ok(SigtermWatcher { runtime })
    }

    /// A flag set when the process receives SIGTERM (eviction, deletion, node
    /// drain). The training loop checks it between steps, saves a checkpoint
    /// and exits, inside the pod's grace period when a step is shorter than
    /// it. The handler is in place when this returns, so an early SIGTERM is
    /// not lost.
    pub fn watch(&self) -> Arc<AtomicBool> {
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
