//! Prometheus metrics and the `/metrics` endpoint; the `/healthz` and
//! `/readyz` probe endpoints, served on a listener of their own.
//!
//! Besides the controller's own counters, the workers' live telemetry as
//! gauges per worker (`headroom_worker_*`, labels `namespace`, `matj`, the
//! MemoryAwareTrainingJob's name, and `pod`, the worker's pod), read at
//! each scrape from the reports the operator holds
//! ([`crate::worker_reports`]): a worker's series go when its attempt is
//! superseded and its job's when the job ends or is deleted, so their
//! number stays that of the running workers. The labels are the ones
//! cAdvisor, DCGM and kube-state-metrics give a pod (`namespace`, `pod`),
//! so their series join without relabelling; the job's is not `job`, which
//! is Prometheus' own target label.
//!
//! And each job's training progress per job (`headroom_job_*`, labels
//! `namespace`, `matj`): as gauges its step and total, train and eval loss,
//! tokens per second and time left, as `status.progress` shows them
//! ([`crate::progress`]), and as counters the steps and tokens trained, all
//! attempts together; a job's series go when it ends or is deleted.
//!
//! And the jobs the controller watches by phase (`headroom_jobs{phase}`),
//! every phase always present.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};

use headroom_api::{JobPhase, JobProgress, MemoryAwareTrainingJob};
use kube::core::DeserializeGuard;
use kube::runtime::reflector::Store;

use crate::metrics_access::MetricsAccess;
use crate::progress::RunCounts;
use crate::worker_reports::WorkerReports;

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
    /// The controller's cache of jobs, once it watches them.
    jobs: Arc<OnceLock<Store<DeserializeGuard<MemoryAwareTrainingJob>>>>,
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
        let jobs = Arc::<OnceLock<_>>::default();
        registry.register_collector(Box::new(JobPhases(jobs.clone())));
        Metrics {
            registry,
            reconciles,
            reconcile_errors,
            attempts,
            planning_seconds,
            ready: AtomicBool::new(false),
            jobs,
        }
    }
}

impl Metrics {
    /// The controller's metrics and the workers' gauges from `reports`,
    /// with its counts of reports taken and status writes sent.
    pub fn with_telemetry(reports: Arc<WorkerReports>) -> Self {
        let mut m = Metrics::default();
        m.registry.register(
            "telemetry_reports",
            "Telemetry reports workers posted to the worker API and the operator took",
            reports.reports.clone(),
        );
        m.registry.register(
            "telemetry_status_writes",
            "Status writes of workers' telemetry (at most one per job per telemetry interval, sooner on a new peak)",
            reports.writes.clone(),
        );
        m.registry
            .register_collector(Box::new(WorkerGauges(reports)));
        m
    }

    /// Counts the jobs in `store` by phase at each scrape (once: the
    /// controller's one cache).
    pub fn count_jobs(&self, store: Store<DeserializeGuard<MemoryAwareTrainingJob>>) {
        let _ = self.jobs.set(store);
    }

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

/// The `headroom_jobs` gauge: the watched jobs by phase.
#[derive(Debug)]
struct JobPhases(Arc<OnceLock<Store<DeserializeGuard<MemoryAwareTrainingJob>>>>);

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PhaseLabels {
    phase: String,
}

const PHASES: [JobPhase; 5] = [
    JobPhase::Pending,
    JobPhase::Running,
    JobPhase::Retrying,
    JobPhase::Succeeded,
    JobPhase::Failed,
];

impl Collector for JobPhases {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(store) = self.0.get() else {
            return Ok(()); // not watching yet: no count rather than zeros
        };
        let mut counts = [0u64; PHASES.len()];
        for job in store.state() {
            // A job that does not parse is the reconcile errors' to count.
            let Ok(job) = &job.0 else { continue };
            // No phase yet: the controller has not seen it, it waits.
            let phase = job.status.as_ref().and_then(|s| s.phase);
            let phase = phase.unwrap_or(JobPhase::Pending);
            if let Some(i) = PHASES.iter().position(|p| *p == phase) {
                counts[i] += 1;
            }
        }
        let mut family = encoder.encode_descriptor(
            "jobs",
            "MemoryAwareTrainingJobs the controller watches, by phase (a job without one yet counts as Pending)",
            None,
            MetricType::Gauge,
        )?;
        for (phase, count) in PHASES.iter().zip(counts) {
            let labels = PhaseLabels {
                phase: format!("{phase:?}"),
            };
            ConstGauge::new(count as i64).encode(family.encode_family(&labels)?)?;
        }
        Ok(())
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WorkerLabels {
    namespace: String,
    /// The MemoryAwareTrainingJob's name.
    matj: String,
    /// The worker's pod name.
    pod: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct JobLabels {
    namespace: String,
    matj: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GpuLabels {
    namespace: String,
    matj: String,
    pod: String,
    /// The GPU's NVML index.
    gpu: String,
}

/// One worker's figures at a scrape.
struct WorkerRow {
    labels: WorkerLabels,
    peak: u64,
    current: Option<u64>,
    allocator_in_use: Option<u64>,
    allocator_reserved: Option<u64>,
    step: u64,
    tokens_per_second: Option<f64>,
    budget: Option<u64>,
    /// (index, used bytes, total bytes) per GPU.
    gpus: Vec<(u32, u64, u64)>,
}

/// The `headroom_worker_*` gauges, from the held reports at each scrape.
#[derive(Debug)]
struct WorkerGauges(Arc<WorkerReports>);

type Figure = fn(&WorkerRow) -> Option<f64>;

impl Collector for WorkerGauges {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let mut rows = Vec::new();
        // Copied out first: the reports' lock is not held while encoding.
        self.0.for_each(|namespace, job, budget, r| {
            let m = &r.memory;
            rows.push(WorkerRow {
                labels: WorkerLabels {
                    namespace: namespace.into(),
                    matj: job.into(),
                    pod: r.name.clone(),
                },
                peak: m.peak_bytes,
                current: m.cgroup_current_bytes.or(m.process_rss_bytes),
                allocator_in_use: m.allocator_in_use_bytes,
                allocator_reserved: m.allocator_reserved_bytes,
                step: r.step,
                tokens_per_second: r.tokens_per_second,
                budget,
                gpus: m
                    .gpus
                    .iter()
                    .map(|g| (g.index, g.used_bytes, g.total_bytes))
                    .collect(),
            });
        });
        let bytes = Some(&Unit::Bytes);
        // Bytes as f64: exact up to 8 PiB.
        let gauges: [(&str, &str, Option<&Unit>, Figure); 7] = [
            (
                "worker_peak",
                "Highest memory the worker has used so far (its cgroup's peak)",
                bytes,
                |w| Some(w.peak as f64),
            ),
            (
                "worker_current",
                "Memory the worker's cgroup uses now (the process's RSS where the cgroup does not say)",
                bytes,
                |w| w.current.map(|b| b as f64),
            ),
            (
                "worker_allocator_in_use",
                "Bytes the worker's backend allocator has handed out (device memory on a GPU worker)",
                bytes,
                |w| w.allocator_in_use.map(|b| b as f64),
            ),
            (
                "worker_allocator_reserved",
                "Bytes the worker's backend allocator holds, in use and cached",
                bytes,
                |w| w.allocator_reserved.map(|b| b as f64),
            ),
            (
                "worker_budget",
                "The plan's memory budget per worker of the current attempt: what each worker must stay under",
                bytes,
                |w| w.budget.map(|b| b as f64),
            ),
            (
                "worker_step",
                "Optimizer steps the worker has done in its attempt",
                None,
                |w| Some(w.step as f64),
            ),
            (
                "worker_tokens_per_second",
                "The worker's training throughput over its last steps, tokens per second",
                None,
                |w| w.tokens_per_second,
            ),
        ];
        for (name, help, unit, figure) in gauges {
            if rows.iter().all(|w| figure(w).is_none()) {
                continue;
            }
            let mut family = encoder.encode_descriptor(name, help, unit, MetricType::Gauge)?;
            for w in &rows {
                if let Some(value) = figure(w) {
                    ConstGauge::new(value).encode(family.encode_family(&w.labels)?)?;
                }
            }
        }
        if rows.iter().any(|w| !w.gpus.is_empty()) {
            for (name, help, pick) in [
                (
                    "worker_gpu_used",
                    "Memory in use on each of the worker's GPUs, all processes (NVML)",
                    (|g: &(u32, u64, u64)| g.1) as fn(&(u32, u64, u64)) -> u64,
                ),
                (
                    "worker_gpu_total",
                    "Memory size of each of the worker's GPUs (NVML)",
                    |g: &(u32, u64, u64)| g.2,
                ),
            ] {
                let mut family = encoder.encode_descriptor(name, help, bytes, MetricType::Gauge)?;
                for w in &rows {
                    for g in &w.gpus {
                        let labels = GpuLabels {
                            namespace: w.labels.namespace.clone(),
                            matj: w.labels.matj.clone(),
                            pod: w.labels.pod.clone(),
                            gpu: g.0.to_string(),
                        };
                        ConstGauge::new(pick(g) as f64).encode(family.encode_family(&labels)?)?;
                    }
                }
            }
        }
        encode_job_progress(&self.0, &mut encoder)
    }
}

type JobFigure = fn(&JobProgress) -> Option<f64>;

/// The `headroom_job_*` gauges and counters, one series per held job with progress.
fn encode_job_progress(
    reports: &WorkerReports,
    encoder: &mut DescriptorEncoder,
) -> Result<(), std::fmt::Error> {
    let mut rows = Vec::new();
    let mut counts = Vec::new();
    reports.for_each_progress(jiff::Timestamp::now(), |namespace, job, p, c| {
        let labels = JobLabels {
            namespace: namespace.into(),
            matj: job.into(),
        };
        counts.push((labels.clone(), c));
        rows.push((labels, p.clone()));
    });
    type Count = fn(&RunCounts) -> Option<u64>;
    let counters: [(&str, &str, Count); 2] = [
        (
            "job_steps",
            "Optimizer steps the job's workers trained, all attempts together (steps a retry trains again count again)",
            |c| Some(c.steps),
        ),
        (
            "job_tokens",
            "Tokens the job's workers trained on (steps × global batch × sequence length), all attempts together",
            |c| c.tokens,
        ),
    ];
    for (name, help, count) in counters {
        if counts.iter().all(|(_, c)| count(c).is_none()) {
            continue;
        }
        let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
        for (labels, c) in &counts {
            if let Some(value) = count(c) {
                ConstCounter::new(value).encode(family.encode_family(labels)?)?;
            }
        }
    }
    let seconds = Some(&Unit::Seconds);
    let gauges: [(&str, &str, Option<&Unit>, JobFigure); 7] = [
        (
            "job_step",
            "Optimizer steps the job's run has done (a retry resumes at its checkpoint's step)",
            None,
            |p| Some(p.step as f64),
        ),
        (
            "job_total_steps",
            "Optimizer steps the job's run trains",
            None,
            |p| p.total_steps.map(|t| t as f64),
        ),
        (
            "job_train_loss",
            "Training loss of the job's last step reported (its last pipeline stage's)",
            None,
            |p| p.train_loss,
        ),
        (
            "job_eval_loss",
            "Loss on the job's held-out data at its last evaluation",
            None,
            |p| p.eval_loss,
        ),
        (
            "job_tokens_per_second",
            "The job's training throughput over its last step, tokens per second",
            None,
            |p| p.tokens_per_second,
        ),
        (
            "job_step_duration",
            "Wall-clock time per optimizer step, measured over the job's last reports",
            seconds,
            |p| p.seconds_per_step,
        ),
        (
            "job_eta",
            "Estimated time left to the job's last step at the measured pace",
            seconds,
            |p| p.eta_seconds.map(|s| s as f64),
        ),
    ];
    for (name, help, unit, figure) in gauges {
        if rows.iter().all(|(_, p)| figure(p).is_none()) {
            continue;
        }
        let mut family = encoder.encode_descriptor(name, help, unit, MetricType::Gauge)?;
        for (labels, p) in &rows {
            if let Some(value) = figure(p) {
                ConstGauge::new(value).encode(family.encode_family(labels)?)?;
            }
        }
    }
    Ok(())
}

/// `/metrics`, to every caller or, with `access`, to those it lets in
/// ([`crate::metrics_access`]). The health probes have their own router
/// ([`probes_router`]) and listener: scrapers and anyone else who reaches
/// this port cannot crowd out the kubelet's probes.
pub fn router(metrics: Arc<Metrics>, access: Option<Arc<MetricsAccess>>) -> Router {
    Router::new()
        .route(
            crate::metrics_access::METRICS_PATH,
            get(
                |State((m, access)): State<(Arc<Metrics>, Option<Arc<MetricsAccess>>)>,
                 headers: HeaderMap| async move {
                    if let Some(access) = access
                        && let Err(denied) = access.check(&headers).await
                    {
                        return denied.into_response();
                    }
                    m.encode().into_response()
                },
            ),
        )
        .with_state((metrics, access))
}

/// `/healthz` (the process serves) and `/readyz` (caches synced), for the
/// kubelet's probes.
pub fn probes_router(metrics: Arc<Metrics>) -> Router {
    Router::new()
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

    /// A report of `pod` of job `ns/j` as the worker API takes it.
    fn report(pod: &str, attempt: u32, peak: u64) -> headroom_api::WorkerTelemetry {
        serde_json::from_value(serde_json::json!({
            "name": pod, "attempt": attempt, "stage": 0, "layerStart": 0, "layerEnd": 2,
            "step": 12, "tokensPerSecond": 1500.5,
            "memory": {
                "cgroupCurrentBytes": 900, "peakBytes": peak,
                "allocatorInUseBytes": 700, "allocatorReservedBytes": 800,
                "gpus": [{"index": 0, "usedBytes": 5000, "totalBytes": 8000}]
            },
            "updatedAt": "2026-11-26T10:00:00Z"
        }))
        .expect("telemetry")
    }

    #[test]
    fn worker_gauges_follow_the_held_reports_and_go_with_their_job() {
        let reports = Arc::new(WorkerReports::new(std::time::Duration::from_secs(10)));
        let m = Metrics::with_telemetry(reports.clone());
        reports.record("ns", "j", "uid-j", report("j-a1-s0", 1, 1000));
        reports.record("ns", "j", "uid-j", report("j-a1-s1", 1, 2000));
        reports.record("ns", "k", "uid-k", report("k-a1-s0", 1, 3000));
        reports.attempt("uid-j", 1, Some(4096));
        let text = m.encode();
        let w = |pod: &str| format!("{{namespace=\"ns\",matj=\"j\",pod=\"{pod}\"}}");
        for line in [
            format!("headroom_worker_peak_bytes{} 1000", w("j-a1-s0")),
            format!("headroom_worker_peak_bytes{} 2000", w("j-a1-s1")),
            format!("headroom_worker_current_bytes{} 900", w("j-a1-s0")),
            format!("headroom_worker_allocator_in_use_bytes{} 700", w("j-a1-s0")),
            format!("headroom_worker_allocator_reserved_bytes{} 800", w("j-a1-s0")),
            format!("headroom_worker_budget_bytes{} 4096", w("j-a1-s1")),
            format!("headroom_worker_step{} 12", w("j-a1-s0")),
            format!("headroom_worker_tokens_per_second{} 1500.5", w("j-a1-s0")),
            "headroom_worker_gpu_used_bytes{namespace=\"ns\",matj=\"j\",pod=\"j-a1-s0\",gpu=\"0\"} 5000".into(),
            "headroom_worker_gpu_total_bytes{namespace=\"ns\",matj=\"j\",pod=\"j-a1-s0\",gpu=\"0\"} 8000".into(),
            "headroom_worker_peak_bytes{namespace=\"ns\",matj=\"k\",pod=\"k-a1-s0\"} 3000".into(),
            "# TYPE headroom_worker_peak_bytes gauge".into(),
            "headroom_telemetry_reports_total 3".into(),
        ] {
            assert!(
                text.lines().any(|l| l == line || l.starts_with(&format!("{line}."))),
                "{line} in\n{text}"
            );
        }
        assert!(
            !text.contains("headroom_worker_budget_bytes{namespace=\"ns\",matj=\"k\""),
            "k's budget is unknown:\n{text}"
        );

        // Attempt 2 supersedes attempt 1: its workers' series go.
        reports.record("ns", "j", "uid-j", report("j-a2-s0", 2, 500));
        let text = m.encode();
        assert!(text.contains(&w("j-a2-s0")), "{text}");
        assert!(!text.contains("j-a1-"), "{text}");
        // Job j ends (or is deleted): none of its series remain; k's do.
        reports.close("uid-j");
        let text = m.encode();
        assert!(!text.contains("matj=\"j\""), "{text}");
        assert!(text.contains("pod=\"k-a1-s0\""), "{text}");
        reports.close("uid-k");
        let text = m.encode();
        assert!(!text.contains("headroom_worker_"), "{text}");
        assert!(!text.contains("headroom_job_"), "{text}");
    }

    /// A report of the last stage (1) of a two-stage job `ns/p` at second `at`.
    fn stage_report(pod: &str, stage: u32, step: u64, at: u32) -> headroom_api::WorkerTelemetry {
        let mut r = report(pod, 1, 1000);
        r.stage = stage;
        r.step = step;
        r.updated_at = serde_json::from_value(serde_json::json!(format!(
            "2026-11-26T10:{:02}:{:02}Z",
            at / 60,
            at % 60
        )))
        .expect("time");
        if stage == 1 {
            r.loss = Some(2.345_678_8);
            r.eval_loss = Some(2.5);
        }
        r
    }

    #[test]
    fn job_progress_gauges_follow_the_last_stage_and_go_with_their_job() {
        let reports = Arc::new(WorkerReports::new(std::time::Duration::from_secs(10)));
        let m = Metrics::with_telemetry(reports.clone());
        // Stage 1 (the last) reports at 0 (loading), then 2 s a step; stage 0 is ahead.
        for (step, at) in [(0, 0), (10, 20), (20, 40), (30, 60)] {
            reports.record("ns", "p", "uid-p", stage_report("p-a1-s1", 1, step, at));
            reports.record("ns", "p", "uid-p", stage_report("p-a1-s0", 0, step + 1, at));
        }
        let text = m.encode();
        let p = "{namespace=\"ns\",matj=\"p\"}";
        assert!(
            !text.contains("headroom_job_total_steps"),
            "the total is unknown until the controller says it:\n{text}"
        );
        assert!(!text.contains("headroom_job_eta"), "{text}");
        reports.total_steps("uid-p", 130);
        assert!(
            text.contains(&format!("headroom_job_steps_total{p} 30"))
                && !text.contains("headroom_job_tokens_total"),
            "the tokens per step are unknown until the controller says them:\n{text}"
        );
        reports.tokens_per_step("uid-p", 4096);
        let text = m.encode();
        for line in [
            format!("headroom_job_steps_total{p} 30"),
            format!("headroom_job_tokens_total{p} {}", 30 * 4096),
            "# TYPE headroom_job_steps counter".into(),
            format!("headroom_job_step{p} 30.0"),
            format!("headroom_job_total_steps{p} 130.0"),
            format!("headroom_job_train_loss{p} 2.3457"),
            format!("headroom_job_eval_loss{p} 2.5"),
            format!("headroom_job_tokens_per_second{p} 1500.5"),
            format!("headroom_job_step_duration_seconds{p} 2.0"),
            format!("headroom_job_eta_seconds{p} 200.0"),
            "# TYPE headroom_job_eta_seconds gauge".into(),
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
        }
        reports.close("uid-p");
        assert!(!m.encode().contains("headroom_job_"), "the job ended");
    }

    /// Before the controller watches jobs there is no count; then one
    /// series per phase, zeros included, a job without a phase as Pending.
    #[test]
    fn jobs_are_counted_by_phase_zeros_included() {
        use kube::runtime::watcher::Event;
        let m = Metrics::default();
        assert!(!m.encode().contains("headroom_jobs"), "not watching yet");
        let (store, mut writer) = kube::runtime::reflector::store();
        let sample: serde_json::Value =
            serde_yaml::from_str(include_str!("../../samples/cpu-tiny.yaml")).expect("sample");
        let job = |name: &str, phase: Option<&str>| {
            let mut value = sample.clone();
            value["metadata"] = serde_json::json!({"name": name, "namespace": "ns"});
            if name == "unreadable" {
                value["spec"] = serde_json::json!({});
            }
            if let Some(phase) = phase {
                value["status"] = serde_json::json!({"phase": phase});
            }
            serde_json::from_value::<DeserializeGuard<MemoryAwareTrainingJob>>(value)
                .expect("guard")
        };
        for object in [
            job("a", Some("Running")),
            job("b", Some("Running")),
            job("c", Some("Failed")),
            job("d", None),
            job("unreadable", Some("Running")),
        ] {
            writer.apply_watcher_event(&Event::Apply(object));
        }
        m.count_jobs(store);
        let text = m.encode();
        for line in [
            "# TYPE headroom_jobs gauge",
            "headroom_jobs{phase=\"Pending\"} 1",
            "headroom_jobs{phase=\"Running\"} 2",
            "headroom_jobs{phase=\"Retrying\"} 0",
            "headroom_jobs{phase=\"Succeeded\"} 0",
            "headroom_jobs{phase=\"Failed\"} 1",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
        }
    }

    /// Every metric the chart's dashboard and alert rules query is one the
    /// operator serves: a renamed metric or label must take them along.
    #[test]
    fn the_charts_dashboard_and_alerts_query_metrics_that_exist() {
        let reports = Arc::new(WorkerReports::new(std::time::Duration::from_secs(10)));
        let m = Metrics::with_telemetry(reports.clone());
        m.count_jobs(kube::runtime::reflector::store().0);
        m.reconciles.inc();
        m.attempts
            .get_or_create(&OutcomeLabels {
                outcome: "HostOutOfMemory".into(),
            })
            .inc();
        m.reconcile_errors
            .get_or_create(&ErrorLabels {
                step: "apply_status".into(),
                error: "conflict".into(),
            })
            .inc();
        for (step, at) in [(0, 0), (10, 20), (20, 40)] {
            let mut r = stage_report("p-a1-s0", 0, step, at);
            r.loss = Some(2.0);
            r.eval_loss = Some(2.1);
            reports.record("ns", "p", "uid-p", r);
        }
        reports.attempt("uid-p", 1, Some(4096));
        reports.total_steps("uid-p", 100);
        reports.tokens_per_step("uid-p", 4096);
        let text = m.encode();
        let served: std::collections::HashSet<&str> = text
            .lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| l.split(['{', ' ']).next())
            .collect();
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../charts/headroom");
        for file in ["files/dashboard.json", "templates/prometheusrule.yaml"] {
            let queries = std::fs::read_to_string(root.join(file)).expect("chart file");
            let named: Vec<&str> = queries
                .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .filter(|w| w.starts_with("headroom_"))
                .collect();
            assert!(!named.is_empty(), "{file} queries no headroom_ metric");
            for name in named {
                assert!(
                    served.contains(name),
                    "{file} queries {name}, which /metrics does not serve:\n{text}"
                );
            }
            for label in ["job=", "worker=", "(namespace, job)"] {
                assert!(
                    !queries.contains(label),
                    "{file} still uses the old label {label}"
                );
            }
        }
    }
}
