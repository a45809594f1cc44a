//! The operator's side of the test kit (headroom-e2e) for tests against the
//! loopback control plane (`make test-apiserver`): an in-process controller
//! scoped to a test's namespace, and waits on and reads of what it does
//! ([`jobs`]). Namespaces, waits, the CRD, the corpus and fixtures come from
//! the kit.
#![allow(dead_code)]

mod jobs;

use std::sync::Arc;
use std::time::Duration;

pub use headroom_e2e::fixtures::*;
pub use headroom_e2e::{API_SERVER, TestNs};
use headroom_operator::controller::{self, ControllerConfig};
use headroom_operator::metrics::Metrics;
use headroom_operator::watched_pods::WatchedPods;
use headroom_operator::worker_reports::WorkerReports;
// Each test binary uses its own part of the kit.
#[allow(unused_imports)]
pub use jobs::*;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// How long a wait on the control plane may take.
pub const TIMEOUT: Duration = Duration::from_secs(30);

/// A fresh namespace on the test control plane (the CRD installed).
pub async fn test_ns(prefix: &str) -> TestNs {
    TestNs::new(API_SERVER, prefix).await
}

/// Runs a controller scoped to the test's namespace, with the telemetry
/// holder a worker API of the same process shares ([`Operator::reports`]).
pub fn start_operator(ns: &TestNs, config: ControllerConfig) -> Operator {
    let (stop, mut rx) = watch::channel(false);
    let client = ns.client.clone();
    let reports = WorkerReports::start(client.clone(), config.children.telemetry_interval);
    let metrics = Arc::new(Metrics::with_telemetry(reports.clone()));
    let config = ControllerConfig {
        namespace: Some(ns.name.clone()),
        ..config
    };
    let pods = WatchedPods::default();
    let (m, r, p) = (metrics.clone(), reports.clone(), pods.clone());
    let handle = tokio::spawn(async move {
        let shutdown = async move {
            let _ = rx.wait_for(|s| *s).await;
        };
        controller::watch::run(client, m, r, p, config, "test-operator", shutdown).await;
    });
    Operator {
        stop,
        handle,
        metrics,
        reports,
        pods,
    }
}

/// An in-process controller.
pub struct Operator {
    stop: watch::Sender<bool>,
    handle: JoinHandle<()>,
    pub metrics: Arc<Metrics>,
    /// The workers' held telemetry, for a worker API beside the controller.
    pub reports: Arc<WorkerReports>,
    /// Its pod cache, once synced: the worker API's identity checks read it.
    pub pods: WatchedPods,
}

impl Operator {
    /// Graceful stop: in-flight reconciles finish first.
    pub async fn stop(self) {
        let _ = self.stop.send(true);
        let _ = tokio::time::timeout(TIMEOUT, self.handle).await;
    }
}
