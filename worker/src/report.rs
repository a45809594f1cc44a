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
//!
//! The training loop also logs one line per optimizer step ([`StepLine`]):
//! the step of the run's total, the loss, tokens per second and the time
//! left at the pace [`StepPace`] measures.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use headroom_api::{
    DownloadProgress, MemorySample, SteppedDown, WORKER_API_ENV, WORKER_FIELD_MANAGER_PREFIX,
    WorkerTelemetry, human_duration,
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
    /// Loss on the held-out data at the last evaluation; None until one
    /// ran. Set by [`Reporter::record_eval_loss`]; an [`Reporter::update`]
    /// without one keeps it (it stands until the next evaluation).
    pub eval_loss: Option<f64>,
    pub tokens_per_second: Option<f64>,
    pub download: Option<DownloadProgress>,
    /// The settings the memory guard stepped down to in place; set by
    /// [`Reporter::stepped_down`], kept by every later update.
    pub stepped_down: Option<SteppedDown>,
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
            // A cross-entropy is at least 0: anything else is not reported
            // (the operator would refuse the whole report).
            eval_loss: progress.eval_loss.filter(|l| l.is_finite() && *l >= 0.0),
            tokens_per_second: progress.tokens_per_second.filter(|t| t.is_finite()),
            memory,
            download: progress.download.clone(),
            stepped_down: progress.stepped_down,
            updated_at: Time(k8s_openapi::jiff::Timestamp::now()),
        }
    }
}

/// The run loop's pace: wall-clock seconds per optimizer step, from the
/// end of one step to the end of the next (so checkpoint saves, telemetry
/// and waits for peers count, as they do for the time left), smoothed
/// over the last steps. The first step is not measured: it starts with the
/// model's load or resume and the kernels' first compilation.
#[derive(Clone, Debug, Default)]
pub struct StepPace {
    last_step_end: Option<Instant>,
    seconds_per_step: Option<f64>,
}

impl StepPace {
    /// Weight of the newest step in the average: about the last 10 steps count.
    pub const SMOOTHING: f64 = 0.1;

    /// A step ended at `now`.
    pub fn step_done(&mut self, now: Instant) {
        if let Some(last) = self.last_step_end {
            let seconds = now.duration_since(last).as_secs_f64();
            self.seconds_per_step = Some(match self.seconds_per_step {
                None => seconds,
                Some(mean) => mean + Self::SMOOTHING * (seconds - mean),
            });
        }
        self.last_step_end = Some(now);
    }

    /// Seconds per step so far; None before two steps ended.
    pub fn seconds_per_step(&self) -> Option<f64> {
        self.seconds_per_step
    }

    /// The time left to `total` from `step` at this pace, whole seconds
    /// rounded up (0 only once the last step is done).
    pub fn eta_seconds(&self, step: u64, total: u64) -> Option<u64> {
        let left = total.saturating_sub(step);
        if left == 0 {
            return Some(0);
        }
        self.seconds_per_step
            .map(|s| (left as f64 * s).ceil().min(u64::MAX as f64) as u64)
    }
}

/// The line the run loop logs at info level after each optimizer step:
/// `step 120/500 loss 2.3457 tokens/s 1234 eta 3m20s` (`n/a` where a
/// figure is unknown: a stage before the last has no loss).
#[derive(Clone, Debug, PartialEq)]
pub struct StepLine {
    pub step: u64,
    pub total: u64,
    pub loss: Option<f64>,
    pub tokens_per_second: Option<f64>,
    pub eta_seconds: Option<u64>,
}

impl std::fmt::Display for StepLine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "step {}/{} loss ", self.step, self.total)?;
        match self.loss {
            Some(loss) => write!(f, "{loss:.4}")?,
            None => f.write_str("n/a")?,
        }
        f.write_str(" tokens/s ")?;
        match self.tokens_per_second {
            Some(t) => write!(f, "{t:.0}")?,
            None => f.write_str("n/a")?,
        }
        match self.eta_seconds {
            Some(eta) => write!(f, " eta {}", human_duration(eta)),
            None => f.write_str(" eta n/a"),
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

    /// Records the training loop's position (cheap: one uncontended mutex);
    /// the last evaluation's loss stays unless `progress` has a newer one.
    pub fn update(&self, progress: Progress) {
        let mut held = self.progress.lock().unwrap_or_else(|p| p.into_inner());
        let eval_loss = progress.eval_loss.or(held.eval_loss);
        let stepped_down = progress.stepped_down.or(held.stepped_down);
        *held = Progress {
            eval_loss,
            stepped_down,
            ..progress
        };
    }

    /// Records that the memory guard stepped the worker down in place to
    /// `micro_batch` × `gradient_accumulation`: reported from the next
    /// write on, as `steppedDown`.
    pub fn stepped_down(&self, micro_batch: u32, gradient_accumulation: u32) {
        self.progress
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .stepped_down = Some(SteppedDown {
            micro_batch,
            gradient_accumulation,
        });
    }

    /// Records the loss of an evaluation on the held-out data: reported
    /// from the next write on, as `evalLoss`, until the next evaluation.
    pub fn record_eval_loss(&self, loss: f64) {
        self.progress
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .eval_loss = Some(loss);
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
        reporter.record_eval_loss(1.75);
        reporter.update(Progress {
            step: 7,
            loss: Some(1.5),
            eval_loss: None,
            tokens_per_second: Some(f64::NAN),
            download: None,
            stepped_down: None,
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
        assert_eq!(
            final_report.eval_loss,
            Some(1.75),
            "a step's update keeps the last evaluation's loss"
        );
        assert_eq!(final_report.tokens_per_second, None, "NaN is not written");
        assert_eq!(final_report.memory.peak_bytes, last.peak_bytes);
        assert!(last.peak_bytes > 0);
        assert_eq!(identity().field_manager(), "headroom-worker/job-a1-s0");
    }

    /// The report as the worker API receives it: `evalLoss` beside `loss`
    /// when an evaluation ran, absent otherwise; a value the CRD would
    /// refuse (negative, not finite) is not sent.
    #[test]
    fn the_eval_loss_is_serialised_as_eval_loss_when_there_is_one() {
        let memory = MemorySample {
            peak_bytes: 1,
            ..MemorySample::default()
        };
        let mut progress = Progress {
            step: 3,
            loss: Some(2.0),
            ..Progress::default()
        };
        let json =
            serde_json::to_value(identity().telemetry(&progress, memory.clone())).expect("json");
        assert_eq!(json["loss"], serde_json::json!(2.0));
        assert!(json.get("evalLoss").is_none(), "{json}");
        progress.eval_loss = Some(2.25);
        let report = identity().telemetry(&progress, memory.clone());
        assert_eq!(report.check_bounds(), Ok(()));
        let json = serde_json::to_value(&report).expect("json");
        assert_eq!(json["evalLoss"], serde_json::json!(2.25));
        let back: WorkerTelemetry = serde_json::from_value(json).expect("reads back");
        // The time is written to the second.
        assert_eq!(
            back,
            WorkerTelemetry {
                updated_at: back.updated_at.clone(),
                ..report
            }
        );
        for refused in [-1.0, f64::INFINITY, f64::NAN] {
            progress.eval_loss = Some(refused);
            let report = identity().telemetry(&progress, memory.clone());
            assert_eq!(report.eval_loss, None, "{refused}");
        }
    }

    #[test]
    fn the_pace_skips_the_first_step_and_smooths_the_rest() {
        let t0 = Instant::now();
        let mut pace = StepPace::default();
        // The first step ends 30 s in (loading, compiling): not a step's time.
        pace.step_done(t0 + Duration::from_secs(30));
        assert_eq!(pace.seconds_per_step(), None);
        assert_eq!(pace.eta_seconds(1, 10), None);
        assert_eq!(pace.eta_seconds(10, 10), Some(0), "nothing left");
        pace.step_done(t0 + Duration::from_secs(32));
        assert_eq!(pace.seconds_per_step(), Some(2.0));
        assert_eq!(pace.eta_seconds(2, 10), Some(16));
        // One slow step (a checkpoint) moves the average a tenth of the way.
        pace.step_done(t0 + Duration::from_secs(44));
        let s = pace.seconds_per_step().expect("measured");
        assert!((s - 3.0).abs() < 1e-9, "{s}");
        let mut fast = StepPace::default();
        fast.step_done(t0);
        fast.step_done(t0 + Duration::from_millis(120));
        assert_eq!(fast.eta_seconds(12, 15), Some(1), "0.36 s left is not 0s");
    }

    #[test]
    fn one_step_line_says_step_loss_throughput_and_eta() {
        let line = StepLine {
            step: 120,
            total: 500,
            loss: Some(2.345_678),
            tokens_per_second: Some(1234.4),
            eta_seconds: Some(200),
        };
        assert_eq!(
            line.to_string(),
            "step 120/500 loss 2.3457 tokens/s 1234 eta 3m20s"
        );
        let first_stage = StepLine {
            loss: None,
            eta_seconds: None,
            ..line
        };
        assert_eq!(
            first_stage.to_string(),
            "step 120/500 loss n/a tokens/s 1234 eta n/a"
        );
    }
}
