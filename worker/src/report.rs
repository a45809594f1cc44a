//! Live telemetry into the job's status: `status.workers[<pod>]`. The
//! worker posts it to the operator's worker API ([`crate::worker_api`]);
//! the operator holds the latest report of each worker and writes a job's
//! entries together by server-side apply, at most once per interval and
//! sooner on a new peak (`headroom_operator::worker_reports`). Without a worker
//! API (local runs, tests) it is logged.
//!
//! A background thread samples memory every `sample_every` and writes when
//! the [`WritePolicy`] says so: at most once per interval, and at once when
//! the peak has grown by more than 10 % since the last write. The training
//! thread only swaps a small [`Progress`] value per step, so telemetry costs
//! the training loop a mutex per step.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use headroom_api::{
    DownloadProgress, MemorySample, WORKER_API_ENV, WORKER_FIELD_MANAGER_PREFIX, WorkerTelemetry,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use crate::memory_probe::MemoryProbe;
use crate::worker_api::{WorkerApi, WorkerApiError};

/// Default seconds between status writes (overridden by `HEADROOM_TELEMETRY_INTERVAL_SECONDS`).
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(10);
/// Default memory sampling period.
pub const DEFAULT_SAMPLE_EVERY: Duration = Duration::from_millis(500);
/// A peak this much above the last reported one is reported at once.
pub use headroom_api::PEAK_GROWTH_FOR_IMMEDIATE_WRITE;

/// Where the training is; updated by the training loop after each step
/// (or, in an initializer, where its download is).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Progress {
    pub step: u64,
    pub loss: Option<f64>,
    pub tokens_per_second: Option<f64>,
    pub download: Option<DownloadProgress>,
}

/// Who is reporting: the fixed part of a [`WorkerTelemetry`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerIdentity {
    /// Pod name: the key of the status entry.
    pub name: String,
    pub job: String,
    pub namespace: String,
    pub attempt: u32,
    pub stage: u32,
    pub layer_start: u32,
    pub layer_end: u32,
}

impl WorkerIdentity {
    pub fn field_manager(&self) -> String {
        format!("{WORKER_FIELD_MANAGER_PREFIX}{}", self.name)
    }

    pub fn telemetry(&self, progress: &Progress, memory: MemorySample) -> WorkerTelemetry {
        WorkerTelemetry {
            name: self.name.clone(),
            attempt: self.attempt,
            stage: self.stage,
            layer_start: self.layer_start,
            layer_end: self.layer_end,
            step: progress.step,
            loss: progress.loss.filter(|l| l.is_finite()),
            tokens_per_second: progress.tokens_per_second.filter(|t| t.is_finite()),
            memory,
            download: progress.download.clone(),
            updated_at: Time(k8s_openapi::jiff::Timestamp::now()),
        }
    }
}

/// When to write: on the first sample, once per `interval`, or at once when
/// the peak grew by more than `growth` (a fraction) since the last write.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WritePolicy {
    pub interval: Duration,
    pub growth: f64,
    last_write: Option<Instant>,
    last_peak: u64,
}

impl WritePolicy {
    pub fn new(interval: Duration) -> Self {
        WritePolicy {
            interval,
            growth: PEAK_GROWTH_FOR_IMMEDIATE_WRITE,
            last_write: None,
            last_peak: 0,
        }
    }

    pub fn due(&self, now: Instant, peak: u64) -> bool {
        match self.last_write {
            None => true,
            Some(last) => {
                now.duration_since(last) >= self.interval
                    || peak as f64 > self.last_peak as f64 * (1.0 + self.growth)
            }
        }
    }

    pub fn written(&mut self, now: Instant, peak: u64) {
        self.last_write = Some(now);
        self.last_peak = peak;
    }
}

/// Why a telemetry write did not happen.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("status write for job {job}: {source}")]
    WorkerApi {
        job: String,
        #[source]
        source: WorkerApiError,
    },
    #[error("poisoned")]
    Poisoned,
}

/// Where telemetry goes.
pub trait TelemetrySink: Send {
    fn write(&mut self, telemetry: &WorkerTelemetry) -> Result<(), TelemetryError>;
}

/// Posts telemetry to the operator's worker API, which writes it as this
/// worker's `status.workers` entry.
#[derive(Debug)]
pub struct WorkerApiSink {
    api: WorkerApi,
    job: String,
}

impl WorkerApiSink {
    /// Writes through `api`; `None` when there is none (`HEADROOM_WORKER_API`
    /// unset: telemetry stays local).
    pub fn connect(api: Option<&WorkerApi>, identity: &WorkerIdentity) -> Option<Self> {
        let Some(api) = api else {
            tracing::info!(
                "no {WORKER_API_ENV}; telemetry is logged, not written to the job status"
            );
            return None;
        };
        Some(WorkerApiSink {
            api: api.clone(),
            job: identity.job.clone(),
        })
    }
}

impl TelemetrySink for WorkerApiSink {
    fn write(&mut self, telemetry: &WorkerTelemetry) -> Result<(), TelemetryError> {
        self.api
            .post_telemetry(telemetry)
            .map_err(|source| TelemetryError::WorkerApi {
                job: self.job.clone(),
                source,
            })
    }
}

/// Collects telemetry in memory (tests, and local runs that want the figures).
#[derive(Clone, Debug, Default)]
pub struct MemorySink(pub Arc<Mutex<Vec<WorkerTelemetry>>>);

impl TelemetrySink for MemorySink {
    fn write(&mut self, telemetry: &WorkerTelemetry) -> Result<(), TelemetryError> {
        self.0
            .lock()
            .map_err(|_| TelemetryError::Poisoned)?
            .push(telemetry.clone());
        Ok(())
    }
}

/// The sampling/writing thread and the handle the training loop holds.
#[derive(Debug)]
pub struct Reporter {
    progress: Arc<Mutex<Progress>>,
    peak: Arc<AtomicU64>,
    stop: mpsc::Sender<()>,
    thread: Option<JoinHandle<MemorySample>>,
}

impl Reporter {
    /// Starts sampling `probe` every `sample_every`; writes go to `sink` (none: log only).
    pub fn start(
        identity: WorkerIdentity,
        mut probe: MemoryProbe,
        mut sink: Option<Box<dyn TelemetrySink>>,
        sample_every: Duration,
        mut policy: WritePolicy,
    ) -> Self {
        let progress = Arc::new(Mutex::new(Progress::default()));
        let peak = Arc::new(AtomicU64::new(0));
        let (stop, stopped) = mpsc::channel::<()>();
        let thread = {
            let progress = progress.clone();
            let peak = peak.clone();
            std::thread::Builder::new()
                .name("headroom-telemetry".into())
                .spawn(move || {
                    let mut failures = 0u64;
                    let mut write = |sample: MemorySample,
                                     force: bool,
                                     policy: &mut WritePolicy| {
                        let now = Instant::now();
                        if !(force || policy.due(now, sample.peak_bytes)) {
                            return;
                        }
                        let current = progress.lock().unwrap_or_else(|p| p.into_inner()).clone();
                        let telemetry = identity.telemetry(&current, sample);
                        match sink.as_mut() {
                            Some(sink) => match sink.write(&telemetry) {
                                Ok(()) => policy.written(now, telemetry.memory.peak_bytes),
                                Err(e) => {
                                    failures += 1;
                                    // First failure and then every 10th, to keep logs readable.
                                    if failures % 10 == 1 {
                                        tracing::warn!(failures, "telemetry not written: {e}");
                                    }
                                }
                            },
                            None => {
                                tracing::info!(
                                    step = telemetry.step,
                                    loss = telemetry.loss,
                                    peak_bytes = telemetry.memory.peak_bytes,
                                    rss_bytes = telemetry.memory.process_rss_bytes,
                                    "telemetry"
                                );
                                policy.written(now, telemetry.memory.peak_bytes);
                            }
                        }
                    };
                    loop {
                        let sample = probe.sample();
                        peak.store(sample.peak_bytes, Ordering::Relaxed);
                        match stopped.recv_timeout(sample_every) {
                            Err(RecvTimeoutError::Timeout) => write(sample, false, &mut policy),
                            Ok(()) | Err(RecvTimeoutError::Disconnected) => break,
                        }
                    }
                    let last = probe.sample();
                    peak.store(last.peak_bytes, Ordering::Relaxed);
                    write(last.clone(), true, &mut policy);
                    last
                })
                .expect("spawn the telemetry thread")
        };
        Reporter {
            progress,
            peak,
            stop,
            thread: Some(thread),
        }
    }

    /// Records the training loop's position (cheap: one uncontended mutex).
    pub fn update(&self, progress: Progress) {
        *self.progress.lock().unwrap_or_else(|p| p.into_inner()) = progress;
    }

    /// [`Reporter::update`] for a callback that outlives this borrow (the
    /// initializer's download observer).
    pub fn updater(&self) -> impl Fn(Progress) + Send + Sync + 'static {
        let progress = self.progress.clone();
        move |p| *progress.lock().unwrap_or_else(|e| e.into_inner()) = p
    }

    /// The highest peak sampled so far, bytes.
    pub fn peak(&self) -> u64 {
        self.peak.load(Ordering::Relaxed)
    }

    /// Stops sampling, writes a last report and returns the last sample.
    pub fn finish(mut self) -> MemorySample {
        let _ = self.stop.send(());
        self.thread
            .take()
            .and_then(|t| t.join().ok())
            .unwrap_or_default()
    }
}

impl Drop for Reporter {
    fn drop(&mut self) {
        let _ = self.stop.send(());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policy_writes_first_then_per_interval_or_on_peak_growth() {
        let t0 = Instant::now();
        let mut p = WritePolicy::new(Duration::from_secs(10));
        assert!(p.due(t0, 100));
        p.written(t0, 100);
        assert!(
            !p.due(t0 + Duration::from_secs(1), 105),
            "5 % growth waits for the interval"
        );
        assert!(
            p.due(t0 + Duration::from_secs(1), 111),
            "11 % growth is written at once"
        );
        assert!(p.due(t0 + Duration::from_secs(10), 100), "interval elapsed");
    }

    fn identity() -> WorkerIdentity {
        WorkerIdentity {
            name: "job-a1-s0".into(),
            job: "job".into(),
            namespace: "ns".into(),
            attempt: 1,
            stage: 0,
            layer_start: 0,
            layer_end: 2,
        }
    }

    #[test]
    fn reporter_writes_progress_and_a_final_sample() {
        let sink = MemorySink::default();
        let reporter = Reporter::start(
            identity(),
            MemoryProbe::for_this_process(None),
            Some(Box::new(sink.clone())),
            Duration::from_millis(5),
            WritePolicy::new(Duration::from_secs(3600)),
        );
        reporter.update(Progress {
            step: 7,
            loss: Some(1.5),
            tokens_per_second: Some(f64::NAN),
            download: None,
        });
        std::thread::sleep(Duration::from_millis(30));
        let last = reporter.finish();
        let written = sink.0.lock().expect("sink").clone();
        assert!(
            written.len() >= 2,
            "first sample and the final one: {}",
            written.len()
        );
        let final_report = written.last().expect("final");
        assert_eq!(final_report.step, 7);
        assert_eq!(final_report.loss, Some(1.5));
        assert_eq!(final_report.tokens_per_second, None, "NaN is not written");
        assert_eq!(final_report.memory.peak_bytes, last.peak_bytes);
        assert!(last.peak_bytes > 0);
        assert_eq!(identity().field_manager(), "headroom-worker/job-a1-s0");
    }
}
