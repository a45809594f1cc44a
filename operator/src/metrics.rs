//! Prometheus metrics and the `/metrics`, `/healthz`, `/readyz` endpoints.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    /// The reconcile step that failed (`apply_status`, `apply_child`, …).
    pub step: String,
    /// What went wrong there (`conflict`, `refused`, `api`, …).
    pub error: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub outcome: String,
}

/// The operator's metrics, registered under the `headroom_` prefix.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    pub reconciles: Counter,
    pub reconcile_errors: Family<ErrorLabels, Counter>,
    pub attempts: Family<OutcomeLabels, Counter>,
    pub planning_seconds: Histogram,
    ready: AtomicBool,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("headroom");
        let reconciles = Counter::default();
        let reconcile_errors = Family::<ErrorLabels, Counter>::default();
        let attempts = Family::<OutcomeLabels, Counter>::default();
        // 10 µs .. ~10 s
        let planning_seconds = Histogram::new(exponential_buckets(1e-5, 4.0, 11));
        registry.register(
            "reconciles",
            "Reconciliations of MemoryAwareTrainingJobs",
            reconciles.clone(),
        );
        registry.register(
            "reconcile_errors",
            "Failed reconciliations by error",
            reconcile_errors.clone(),
        );
        registry.register(
            "attempts_ended",
            "Attempts that ended, by outcome",
            attempts.clone(),
        );
        registry.register(
            "planning_seconds",
            "Time to decide a job's next step (planning included)",
            planning_seconds.clone(),
        );
        Metrics {
            registry,
            reconciles,
            reconcile_errors,
            attempts,
            planning_seconds,
            ready: AtomicBool::new(false),
        }
    }
}

impl Metrics {
    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::Relaxed);
    }

    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// `/metrics`, `/healthz` (the process serves), `/readyz` (caches synced).
pub fn router(metrics: Arc<Metrics>) -> Router {
    Router::new()
        .route(
            "/metrics",
            get(|State(m): State<Arc<Metrics>>| async move { m.encode() }),
        )
        .route("/healthz", get(|| async { "ok" }))
        .route(
            "/readyz",
            get(|State(m): State<Arc<Metrics>>| async move {
                if m.ready.load(Ordering::Relaxed) {
                    (StatusCode::OK, "ready")
                } else {
                    (StatusCode::SERVICE_UNAVAILABLE, "starting")
                }
            }),
        )
        .with_state(metrics)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_encode_with_prefix_and_labels() {
        let m = Metrics::default();
        m.reconciles.inc();
        m.attempts
            .get_or_create(&OutcomeLabels {
                outcome: "HostOutOfMemory".into(),
            })
            .inc();
        m.planning_seconds.observe(0.0002);
        let text = m.encode();
        assert!(text.contains("headroom_reconciles_total 1"), "{text}");
        assert!(
            text.contains("headroom_attempts_ended_total{outcome=\"HostOutOfMemory\"} 1"),
            "{text}"
        );
        assert!(text.contains("headroom_planning_seconds_count 1"), "{text}");
    }
}
