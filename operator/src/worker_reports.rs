//! Workers' live telemetry, held by the operator and written into each
//! job's `status.workers` at most once per interval per job.
//!
//! Why: a worker reports every telemetry interval (10 s by default), and each
//! report used to be one status write (12.3 ms of kube-apiserver CPU each,
//! docs/benchmarks.md): about 1.2 API-server cores for 1,000 workers. Now the
//! worker API ([`crate::worker_api`]) only records a report here, and one
//! task writes each job's entries together.
//!
//! The rule ([`JobReports::record`], [`urgent`]):
//!
//! * the latest report of each worker wins (an older one arriving late is
//!   dropped, by `updatedAt`);
//! * a job is written at most once per interval (the operator's
//!   `--status-interval-seconds`, 60 s by default; workers report every
//!   `--telemetry-interval-seconds`, and the metrics show every report),
//!   carrying every held entry of its current attempt;
//! * but at the next tick (a fraction of the interval, [`tick`], so that a
//!   burst of workers starting together is still one write) when a report
//!   says something a user or the controller must see now: a worker the
//!   status has not shown yet, a peak more than
//!   [`PEAK_GROWTH_FOR_IMMEDIATE_WRITE`] above the one last written (the
//!   worker's own rule for reporting early), training starting (step 0 →
//!   more) or a download starting, finishing or ending; yet never sooner
//!   than [`urgent_spacing`] after the job's last write, so a worker that
//!   makes every report urgent forces at most one write per spacing, not
//!   one per tick (the report waits for that slot; the latest still wins);
//! * every write carries the job's `status.progress` too, computed from
//!   the reports this process took ([`crate::progress`]);
//! * and before the controller acts on a pod's end: a worker cannot report
//!   after an OOM kill or an eviction, and its last report, whatever it was,
//!   must be in the status the attempt is closed from. The reconcile that
//!   sees an ended pod calls [`WorkerReports::flush`], which writes at once
//!   if that pod's last report is unwritten, and decides on the job that
//!   write returned ([`WorkerReports::overlay`] covers a write of the
//!   flusher still on its way to the cache).
//!
//! Writes are server-side applies under one field manager per operator
//! process ([`FIELD_MANAGER_PREFIX`] + a random suffix). `status.workers` is
//! a list-map keyed by `name`, so an apply owns the entries it carries, and an
//! entry it stops carrying is removed if no one else owns it: hence every
//! apply carries all the entries this process holds for the job (one
//! process's apply never drops what another process, or this one before a
//! restart, wrote). The controller's own status writes leave `workers` alone
//! except to prune an ended attempt's entries ([`crate::controller::apply`]);
//! [`WorkerReports::attempt`] drops those here too, so the next apply does
//! not bring them back.
//!
//! Memory is bounded: at most [`MAX_HELD_WORKERS`] entries are held; a
//! report of a worker beyond that is written through at once under the
//! worker's own field manager, as before. A job is forgotten when it ends or
//! is deleted, when a write says it is gone (404, or 409: a newer job of the
//! same name), or after [`IDLE_INTERVALS`] intervals without a report.
//!
//! With more than one operator replica a worker's reports reach whichever
//! one the Service picks, and each replica writes the newest it received:
//! between two reports an entry can show the other replica's older one.
//! The chart runs one replica by default.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use headroom_api::{MemoryAwareTrainingJob, WorkerTelemetry};
use kube::api::{Api, Patch, PatchParams};
use kube::{Client, Resource, ResourceExt};
use prometheus_client::metrics::counter::Counter;

use crate::progress::{ProgressTracker, RunCounts};

/// A worker's peak this much above the one last written is written at the
/// next tick (the same fraction at which a worker reports early).
pub use headroom_api::PEAK_GROWTH_FOR_IMMEDIATE_WRITE;
/// Field manager of this process's telemetry writes: the prefix and a
/// random suffix per process (see the module doc for why not one name).
pub use headroom_api::TELEMETRY_FIELD_MANAGER_PREFIX as FIELD_MANAGER_PREFIX;
/// Workers whose latest report is held, all jobs together: about 1 KiB
/// each, so at most ~16 MiB of the operator's 256 Mi.
pub const MAX_HELD_WORKERS: usize = 16_384;
/// A job without a report for this many intervals is forgotten (its
/// workers have all ended, or report to another replica).
pub const IDLE_INTERVALS: u32 = 30;
/// Ended or deleted jobs remembered, so that a late report of one is
/// refused rather than held again.
const MAX_CLOSED_JOBS: usize = 4_096;
/// Status writes in flight at once.
const MAX_CONCURRENT_WRITES: usize = 16;

/// How often the flusher looks for due jobs: a tenth of the interval, at
/// least 20 ms, at most 250 ms. Reports that arrive within one tick share a
/// write, however urgent.
pub fn tick(interval: Duration) -> Duration {
    (interval / 10).clamp(Duration::from_millis(20), Duration::from_millis(250))
}

/// The least time between two writes of one job that an urgent report can
/// force: a second, or the interval when that is shorter. Why a second: it
/// is a tenth of the workers' default telemetry interval (10 s), so an
/// honest job's urgent changes (its workers appearing, training starting, a
/// new peak) still show within about a second, while a worker that makes
/// every report urgent (a peak that keeps growing, a download flipping
/// between done and not) costs the API server one write a second for its
/// job instead of one per tick (four).
pub fn urgent_spacing(interval: Duration) -> Duration {
    MIN_URGENT_SPACING.min(interval)
}

/// See [`urgent_spacing`].
pub const MIN_URGENT_SPACING: Duration = Duration::from_secs(1);

/// What became of a report.
#[derive(Clone, Debug, PartialEq)]
pub enum Recorded {
    /// Held; it is written with its job's next write.
    Held,
    /// Its attempt is older than the job's current one.
    Superseded { current: u32 },
    /// Its job has ended or is gone.
    Closed,
    /// [`MAX_HELD_WORKERS`] are held: the caller writes it itself.
    Full(Box<WorkerTelemetry>),
}

/// One worker's latest report, and the peak the status shows for it.
#[derive(Clone, Debug)]
struct Held {
    report: WorkerTelemetry,
    /// The peak last taken for a write of this worker, bytes (a report
    /// arriving while that write is under way compares with it); None: not
    /// written yet.
    written_peak: Option<u64>,
    /// Not taken for a write since it arrived.
    unwritten: bool,
}

/// Whether `next` must be written at the next tick rather than with the
/// job's next interval, given what is held for its worker.
pub fn urgent(
    held: Option<&WorkerTelemetry>,
    written_peak: Option<u64>,
    next: &WorkerTelemetry,
) -> bool {
    let Some(held) = held else {
        return true; // a worker the status has not shown
    };
    let last_peak = written_peak.unwrap_or(0) as f64;
    let peak_grew =
        next.memory.peak_bytes as f64 > last_peak * (1.0 + PEAK_GROWTH_FOR_IMMEDIATE_WRITE);
    let training_started = held.step == 0 && next.step > 0;
    let downloaded = |t: &WorkerTelemetry| t.download.as_ref().map(|d| d.files_done >= d.files);
    peak_grew || training_started || downloaded(held) != downloaded(next)
}

/// The held reports of one job and when they are due.
#[derive(Debug)]
struct JobReports {
    namespace: String,
    name: String,
    /// By pod name.
    workers: BTreeMap<String, Held>,
    /// The job's current attempt: reports of older ones are refused.
    attempt: u32,
    /// The current attempt's plan budget per worker, bytes (from the controller).
    budget_bytes: Option<u64>,
    /// Where its training stands: written with the entries as `status.progress`.
    progress: ProgressTracker,
    /// When the next write is due; None: everything held is written.
    due: Option<Instant>,
    last_write: Option<Instant>,
    last_report: Instant,
    /// Held while a write of this job is built and sent, so writes go out
    /// in the order their contents were taken.
    writing: Arc<tokio::sync::Mutex<()>>,
}

impl JobReports {
    fn new(namespace: &str, name: &str, now: Instant) -> Self {
        JobReports {
            namespace: namespace.into(),
            name: name.into(),
            workers: BTreeMap::new(),
            attempt: 0,
            budget_bytes: None,
            progress: ProgressTracker::default(),
            due: None,
            last_write: None,
            last_report: now,
            writing: Arc::default(),
        }
    }

    /// Takes `report` (its attempt is not older than the job's) and moves
    /// the job's next write as the rule says. Returns the change in the
    /// number of held workers.
    fn record(&mut self, report: WorkerTelemetry, now: Instant, interval: Duration) -> isize {
        let before = self.workers.len() as isize;
        if report.attempt > self.attempt {
            self.start_attempt(report.attempt, None);
        }
        self.last_report = now;
        let held = self.workers.get(&report.name);
        if held.is_some_and(|h| h.report.updated_at > report.updated_at) {
            return 0; // a late report: the one held is newer
        }
        let spacing = if urgent(
            held.map(|h| &h.report),
            held.and_then(|h| h.written_peak),
            &report,
        ) {
            urgent_spacing(interval)
        } else {
            interval
        };
        let at = self.last_write.map_or(now, |w| (w + spacing).max(now));
        self.due = Some(self.due.map_or(at, |d| d.min(at)));
        let written_peak = held.and_then(|h| h.written_peak);
        self.progress.observe(&report);
        self.workers.insert(
            report.name.clone(),
            Held {
                report,
                written_peak,
                unwritten: true,
            },
        );
        self.workers.len() as isize - before
    }

    /// The job's attempt is now `attempt`: older attempts' entries are
    /// dropped (the controller prunes them from the status). Returns the
    /// change in the number of held workers.
    fn start_attempt(&mut self, attempt: u32, budget_bytes: Option<u64>) -> isize {
        let before = self.workers.len() as isize;
        // Only forward: a controller deciding on a stale job must not bring
        // an older attempt back.
        if attempt > self.attempt {
            self.workers.retain(|_, h| h.report.attempt >= attempt);
            self.attempt = attempt;
            self.progress.start_attempt(attempt);
            self.budget_bytes = None;
        }
        if attempt == self.attempt && budget_bytes.is_some() {
            self.budget_bytes = budget_bytes;
        }
        self.workers.len() as isize - before
    }

    /// Every held entry, when a write is due at `now`, or when one of the
    /// `ended` workers' reports is unwritten (its pod ended: due or not);
    /// the job then counts as written at `now`.
    fn take(&mut self, now: Instant, ended: &[String]) -> Option<Vec<WorkerTelemetry>> {
        let due = self.due?;
        let ended_unwritten = ended
            .iter()
            .any(|pod| self.workers.get(pod).is_some_and(|h| h.unwritten));
        if due > now && !ended_unwritten {
            return None;
        }
        self.due = None;
        self.last_write = Some(now);
        let entries = self
            .workers
            .values_mut()
            .map(|h| {
                h.written_peak = Some(h.written_peak.unwrap_or(0).max(h.report.memory.peak_bytes));
                h.unwritten = false;
                h.report.clone()
            })
            .collect();
        Some(entries)
    }

    /// A write failed for a reason that may pass: try again in an interval.
    fn unwritten(&mut self, now: Instant, interval: Duration) {
        for h in self.workers.values_mut() {
            h.unwritten = true;
        }
        let at = now + interval;
        self.due = Some(self.due.map_or(at, |d| d.min(at)));
    }
}

#[derive(Debug, Default)]
struct Jobs {
    /// By job uid.
    by_uid: HashMap<String, JobReports>,
    /// Workers held, all jobs together.
    held: usize,
    /// Uids of ended or deleted jobs, oldest first.
    closed: VecDeque<String>,
    closed_set: HashSet<String>,
}

impl Jobs {
    fn adjust(&mut self, change: isize) {
        self.held = self.held.saturating_add_signed(change);
    }

    fn close(&mut self, uid: &str) {
        if let Some(job) = self.by_uid.remove(uid) {
            self.held = self.held.saturating_sub(job.workers.len());
        }
        if self.closed_set.insert(uid.to_string()) {
            self.closed.push_back(uid.to_string());
            if self.closed.len() > MAX_CLOSED_JOBS
                && let Some(oldest) = self.closed.pop_front()
            {
                self.closed_set.remove(&oldest);
            }
        }
    }
}

/// The workers' latest reports, per job, and the writes they coalesce into.
#[derive(Debug)]
pub struct WorkerReports {
    interval: Duration,
    field_manager: String,
    jobs: Mutex<Jobs>,
    /// Reports taken (held or written through).
    pub reports: Counter,
    /// Status writes sent (this module's applies and write-throughs).
    pub writes: Counter,
}

impl WorkerReports {
    /// Holds reports for writes at most once per `interval` per job.
    pub fn new(interval: Duration) -> Self {
        let mut suffix = [0u8; 4];
        // Without randomness the process id still tells processes apart on one host.
        let suffix = match getrandom::fill(&mut suffix) {
            Ok(()) => suffix
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<String>(),
            Err(_) => std::process::id().to_string(),
        };
        WorkerReports {
            interval,
            field_manager: format!("{FIELD_MANAGER_PREFIX}{suffix}"),
            jobs: Mutex::default(),
            reports: Counter::default(),
            writes: Counter::default(),
        }
    }

    /// [`WorkerReports::new`] with its flusher running on the current tokio
    /// runtime, writing with `client`.
    pub fn start(client: Client, interval: Duration) -> Arc<Self> {
        let reports = Arc::new(Self::new(interval));
        tokio::spawn(reports.clone().flusher(client));
        reports
    }

    /// The field manager this process writes `status.workers` under.
    pub fn field_manager(&self) -> &str {
        &self.field_manager
    }

    /// The interval of the writes per job.
    pub fn interval(&self) -> Duration {
        self.interval
    }

    fn jobs(&self) -> std::sync::MutexGuard<'_, Jobs> {
        // A panic while holding the lock leaves maps that are still consistent.
        self.jobs.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes a checked report of pod `report.name` of job `namespace/name`
    /// (uid `uid`).
    pub fn record(
        &self,
        namespace: &str,
        name: &str,
        uid: &str,
        report: WorkerTelemetry,
    ) -> Recorded {
        self.reports.inc();
        let now = Instant::now();
        let mut jobs = self.jobs();
        if jobs.closed_set.contains(uid) {
            return Recorded::Closed;
        }
        let known = match jobs.by_uid.get(uid) {
            Some(job) if report.attempt < job.attempt => {
                return Recorded::Superseded {
                    current: job.attempt,
                };
            }
            Some(job) => job.workers.contains_key(&report.name),
            None => false,
        };
        if jobs.held >= MAX_HELD_WORKERS && !known {
            return Recorded::Full(Box::new(report));
        }
        let job = jobs
            .by_uid
            .entry(uid.to_string())
            .or_insert_with(|| JobReports::new(namespace, name, now));
        let change = job.record(report, now, self.interval);
        jobs.adjust(change);
        Recorded::Held
    }

    /// The controller's word on a job: its current attempt and that
    /// attempt's budget per worker (bytes). Older attempts' entries go.
    pub fn attempt(&self, uid: &str, attempt: u32, budget_bytes: Option<u64>) {
        let mut jobs = self.jobs();
        let change = match jobs.by_uid.get_mut(uid) {
            Some(job) => job.start_attempt(attempt, budget_bytes),
            None => return,
        };
        jobs.adjust(change);
    }

    /// The run's total steps of job `uid` ([`MemoryAwareTrainingJob::total_steps`]),
    /// for its `status.progress`.
    pub fn total_steps(&self, uid: &str, total: u64) {
        if let Some(job) = self.jobs().by_uid.get_mut(uid) {
            job.progress.set_total_steps(total);
        }
    }

    /// The tokens one optimizer step of job `uid` trains on
    /// ([`MemoryAwareTrainingJob::tokens_per_step`]), for its tokens counter.
    pub fn tokens_per_step(&self, uid: &str, tokens: u64) {
        if let Some(job) = self.jobs().by_uid.get_mut(uid) {
            job.progress.set_tokens_per_step(tokens);
        }
    }

    /// Forgets an ended or deleted job, and refuses its later reports.
    pub fn close(&self, uid: &str) {
        self.jobs().close(uid);
    }

    /// Writes job `uid`'s held entries now if a report of one of the
    /// `ended` pods is unwritten, waiting for a write of it already under
    /// way. Only the ended pods' reports force it: they do not come again,
    /// so a job with a long-ended pod (its initializer) is not written on
    /// every reconcile. Ok(None): nothing to write, or the job is gone;
    /// otherwise the job as the write returned it.
    pub async fn flush(
        &self,
        client: &Client,
        uid: &str,
        ended: &[String],
    ) -> Result<Option<MemoryAwareTrainingJob>, kube::Error> {
        self.write(client, uid, ended).await
    }

    /// `job` with the `ended` pods' held entries where they are newer than
    /// its own (a write of the flusher the job cache does not show yet);
    /// None when it has them.
    pub fn overlay(
        &self,
        job: &MemoryAwareTrainingJob,
        ended: &[String],
    ) -> Option<MemoryAwareTrainingJob> {
        let uid = job.uid()?;
        let jobs = self.jobs();
        let held = jobs.by_uid.get(&uid)?;
        let current = job
            .status
            .as_ref()
            .map(|s| s.workers.as_slice())
            .unwrap_or_default();
        let newer: Vec<&WorkerTelemetry> = held
            .workers
            .values()
            .map(|h| &h.report)
            .filter(|r| ended.contains(&r.name))
            .filter(|r| {
                current
                    .iter()
                    .find(|w| w.name == r.name)
                    .is_none_or(|w| w.updated_at < r.updated_at)
            })
            .collect();
        if newer.is_empty() {
            return None;
        }
        let mut job = job.clone();
        let workers = &mut job.status.get_or_insert_default().workers;
        for report in newer {
            match workers.iter_mut().find(|w| w.name == report.name) {
                Some(w) => *w = report.clone(),
                None => workers.push(report.clone()),
            }
        }
        Some(job)
    }

    /// One write of job `uid`: its held entries, if due at now or an
    /// `ended` pod's report is unwritten.
    async fn write(
        &self,
        client: &Client,
        uid: &str,
        ended: &[String],
    ) -> Result<Option<MemoryAwareTrainingJob>, kube::Error> {
        let Some(writing) = self.jobs().by_uid.get(uid).map(|j| j.writing.clone()) else {
            return Ok(None);
        };
        let _writing = writing.lock().await;
        let now = Instant::now();
        let (namespace, name, entries, progress) = {
            let mut jobs = self.jobs();
            let Some(job) = jobs.by_uid.get_mut(uid) else {
                return Ok(None);
            };
            let Some(entries) = job.take(now, ended) else {
                return Ok(None);
            };
            let progress = job.progress.progress(jiff::Timestamp::now());
            (job.namespace.clone(), job.name.clone(), entries, progress)
        };
        let mut status = serde_json::json!({"workers": entries});
        // Once this process has shown a job's progress, every write carries
        // it (an apply that left it out would remove it).
        if let Some(progress) = progress {
            status["progress"] = serde_json::json!(progress);
        }
        let body = serde_json::json!({
            "apiVersion": MemoryAwareTrainingJob::api_version(&()),
            "kind": MemoryAwareTrainingJob::kind(&()),
            // The uid makes the write a precondition: never onto a newer job of the same name.
            "metadata": {"name": name, "uid": uid},
            "status": status,
        });
        self.writes.inc();
        let jobs_api: Api<MemoryAwareTrainingJob> = Api::namespaced(client.clone(), &namespace);
        let result = jobs_api
            .patch_status(
                &name,
                &PatchParams::apply(&self.field_manager).force(),
                &Patch::Apply(&body),
            )
            .await;
        let mut jobs = self.jobs();
        match result {
            Ok(written) => Ok(Some(written)),
            Err(kube::Error::Api(e)) if matches!(e.code, 404 | 409) => {
                tracing::debug!(job = %name, ns = %namespace, reason = %e.message, "telemetry of a job that is gone dropped");
                jobs.close(uid);
                Ok(None)
            }
            Err(e) => {
                if let Some(job) = jobs.by_uid.get_mut(uid) {
                    job.unwritten(now, self.interval);
                }
                Err(e)
            }
        }
    }

    /// The uids of the jobs due at `now`; forgets idle ones.
    fn due(&self, now: Instant) -> Vec<String> {
        let idle = self.interval * IDLE_INTERVALS;
        let mut jobs = self.jobs();
        let mut forgotten = 0;
        jobs.by_uid.retain(|_, job| {
            let keep = job.due.is_some() || now.duration_since(job.last_report) < idle;
            if !keep {
                forgotten += job.workers.len();
            }
            keep
        });
        jobs.held = jobs.held.saturating_sub(forgotten);
        jobs.by_uid
            .iter()
            .filter(|(_, job)| job.due.is_some_and(|d| d <= now))
            .map(|(uid, _)| uid.clone())
            .collect()
    }

    /// Writes due jobs every [`tick`], for ever.
    async fn flusher(self: Arc<Self>, client: Client) {
        let mut ticks = tokio::time::interval(tick(self.interval));
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            let due = self.due(Instant::now());
            futures::stream::iter(due)
                .for_each_concurrent(MAX_CONCURRENT_WRITES, |uid| {
                    let (this, client) = (&self, &client);
                    async move {
                        if let Err(e) = this.write(client, &uid, &[]).await {
                            tracing::warn!(%e, job_uid = %uid, "telemetry not written; retrying in an interval");
                        }
                    }
                })
                .await;
        }
    }

    /// Calls `each` with every held job's namespace, name, progress at
    /// `now` and counts of steps and tokens trained: the metrics' view of
    /// the jobs.
    pub fn for_each_progress(
        &self,
        now: jiff::Timestamp,
        mut each: impl FnMut(&str, &str, &headroom_api::JobProgress, RunCounts),
    ) {
        let jobs = self.jobs();
        for job in jobs.by_uid.values() {
            if let Some(progress) = job.progress.progress(now) {
                each(&job.namespace, &job.name, &progress, job.progress.counts());
            }
        }
    }

    /// Calls `each` with every held report of the jobs' current attempts
    /// and its job's namespace, name and budget (bytes): the metrics' view.
    pub fn for_each(&self, mut each: impl FnMut(&str, &str, Option<u64>, &WorkerTelemetry)) {
        let jobs = self.jobs();
        for job in jobs.by_uid.values() {
            for held in job.workers.values() {
                each(&job.namespace, &job.name, job.budget_bytes, &held.report);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use headroom_api::{DownloadProgress, MemorySample};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    const INTERVAL: Duration = Duration::from_secs(10);

    /// A report of `pod` (attempt `attempt`) at second `at` of its clock.
    fn report(pod: &str, attempt: u32, step: u64, peak: u64, at: i64) -> WorkerTelemetry {
        WorkerTelemetry {
            name: pod.into(),
            attempt,
            stage: 0,
            layer_start: 0,
            layer_end: 2,
            step,
            loss: None,
            eval_loss: None,
            tokens_per_second: None,
            memory: MemorySample {
                peak_bytes: peak,
                ..Default::default()
            },
            download: None,
            stepped_down: None,
            updated_at: Time(jiff::Timestamp::from_second(1_800_000_000 + at).expect("time")),
        }
    }

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    /// Steps of the entries a write carries, by pod.
    fn steps(entries: &[WorkerTelemetry]) -> Vec<(&str, u64)> {
        entries.iter().map(|e| (e.name.as_str(), e.step)).collect()
    }

    #[test]
    fn a_job_is_written_once_per_interval_with_every_workers_latest_report() {
        let t0 = Instant::now();
        let mut job = JobReports::new("ns", "j", t0);
        // Two workers appear: both at the next tick, in one write.
        job.record(report("w0", 1, 0, 1000, 0), t0, INTERVAL);
        job.record(report("w1", 1, 0, 1000, 0), t0, INTERVAL);
        let first = job.take(t0, &[]).expect("new workers are due at once");
        assert_eq!(steps(&first), [("w0", 0), ("w1", 0)]);
        // Training starts (step 0 → 1): due at once, once for both.
        job.record(report("w0", 1, 1, 1000, 1), t0 + secs(1), INTERVAL);
        job.record(report("w1", 1, 1, 1000, 1), t0 + secs(1), INTERVAL);
        job.take(t0 + secs(1), &[]).expect("training started");
        // Then a report per worker per second, peaks flat: nothing until the interval.
        for s in 2..11 {
            let now = t0 + secs(s);
            job.record(report("w0", 1, s, 1000, s as i64), now, INTERVAL);
            job.record(report("w1", 1, s, 1000, s as i64), now, INTERVAL);
            assert_eq!(job.take(now, &[]), None, "second {s}");
        }
        let now = t0 + secs(11);
        job.record(report("w0", 1, 11, 1000, 11), now, INTERVAL);
        let write = job
            .take(now, &[])
            .expect("an interval after the last write");
        assert_eq!(
            steps(&write),
            [("w0", 11), ("w1", 10)],
            "the latest of each"
        );
        assert_eq!(job.take(now, &[]), None, "nothing new");
        assert_eq!(
            job.take(now, &["w0".into(), "w1".into()]),
            None,
            "a flush with nothing unwritten writes nothing"
        );
    }

    #[test]
    fn a_new_peak_or_a_phase_change_is_written_at_once() {
        let t0 = Instant::now();
        let mut job = JobReports::new("ns", "j", t0);
        job.record(report("w0", 1, 1, 1000, 0), t0, INTERVAL);
        job.take(t0, &[]).expect("first");
        let now = t0 + secs(1);
        job.record(report("w0", 1, 2, 1100, 1), now, INTERVAL);
        assert_eq!(job.take(now, &[]), None, "10 % more waits for the interval");
        job.record(report("w0", 1, 3, 1101, 2), now, INTERVAL);
        let write = job
            .take(now, &[])
            .expect("more than 10 % above the written peak");
        assert_eq!(write[0].memory.peak_bytes, 1101);

        // An initializer's download: starting it and finishing it are written at once.
        let mut init = JobReports::new("ns", "j", t0);
        let mut downloading = report("j-init-1", 0, 0, 500, 0);
        downloading.download = Some(DownloadProgress {
            files: 2,
            ..Default::default()
        });
        init.record(report("j-init-1", 0, 0, 500, 0), t0, INTERVAL);
        init.take(t0, &[]).expect("first");
        init.record(downloading.clone(), now, INTERVAL);
        init.take(now, &[]).expect("the download started");
        downloading.download.as_mut().expect("download").files_done = 1;
        downloading.updated_at = report("", 0, 0, 0, 1).updated_at;
        init.record(downloading.clone(), now, INTERVAL);
        assert_eq!(init.take(now, &[]), None, "progress waits");
        downloading.download.as_mut().expect("download").files_done = 2;
        init.record(downloading, now, INTERVAL);
        let next = now + MIN_URGENT_SPACING;
        assert!(init.take(next, &[]).is_some(), "every file in place");

        // A pod ended: its worker's unwritten report is written, due or not;
        // another worker's reports do not force a write.
        job.record(report("w1", 1, 4, 1000, 3), next, INTERVAL);
        job.take(next, &[]).expect("w1 is new");
        let later = next + secs(1);
        job.record(report("w0", 1, 4, 1101, 3), later, INTERVAL);
        job.record(report("w1", 1, 5, 1000, 4), later, INTERVAL);
        assert_eq!(job.take(later, &[]), None);
        let ended = ["w0".to_string()];
        assert_eq!(
            steps(&job.take(later, &ended).expect("w0 ended")),
            [("w0", 4), ("w1", 5)]
        );
        job.record(report("w1", 1, 6, 1000, 5), later, INTERVAL);
        assert_eq!(
            job.take(later, &ended),
            None,
            "w0's last report is written: the ended pod forces nothing more"
        );
    }

    /// A worker that makes every report urgent (here a download flipping
    /// between done and not, then a peak that keeps growing) forces one
    /// write per spacing, not one per tick; what it reported meanwhile is
    /// not dropped: the next slot writes the latest.
    #[test]
    fn urgent_reports_of_a_job_force_one_write_per_spacing() {
        let t0 = Instant::now();
        let mut job = JobReports::new("ns", "j", t0);
        job.record(report("w0", 1, 1, 1000, 0), t0, INTERVAL);
        job.take(t0, &[]).expect("a new worker");
        let tick = tick(INTERVAL);
        let mut writes = 0;
        let mut flip = report("w0", 1, 1, 1000, 0);
        // An urgent report every tick (250 ms), all within the spacing.
        for i in 1..4 {
            let now = t0 + tick * i;
            assert!(now < t0 + MIN_URGENT_SPACING);
            flip.download = (i % 2 == 1).then(|| DownloadProgress {
                files: 1,
                files_done: 1,
                ..Default::default()
            });
            flip.updated_at = report("", 0, 0, 0, i.into()).updated_at;
            job.record(flip.clone(), now, INTERVAL);
            writes += usize::from(job.take(now, &[]).is_some());
        }
        assert_eq!(writes, 0, "urgent, but within a second of the last write");
        let slot = t0 + MIN_URGENT_SPACING;
        let write = job.take(slot, &[]).expect("the next slot");
        assert_eq!(write[0].download, flip.download, "the latest report");
        // A peak that doubles every report: again one write per spacing.
        for i in 1..=3u32 {
            let at = slot + tick * i;
            job.record(
                report("w0", 1, 2, 1000 << i, 20 + i64::from(i)),
                at,
                INTERVAL,
            );
            writes += usize::from(job.take(at, &[]).is_some());
        }
        assert_eq!(writes, 0);
        let write = job
            .take(slot + MIN_URGENT_SPACING, &[])
            .expect("the next slot");
        assert_eq!(write[0].memory.peak_bytes, 1000 << 3);
        // An interval shorter than the spacing bounds it instead.
        assert_eq!(urgent_spacing(secs(1) / 2), secs(1) / 2);
        assert_eq!(urgent_spacing(secs(60)), MIN_URGENT_SPACING);
    }

    #[test]
    fn the_latest_report_wins_and_a_late_one_is_dropped() {
        let t0 = Instant::now();
        let mut job = JobReports::new("ns", "j", t0);
        job.record(report("w0", 1, 5, 1000, 5), t0, INTERVAL);
        job.record(report("w0", 1, 4, 1000, 4), t0, INTERVAL);
        assert_eq!(steps(&job.take(t0, &[]).expect("due")), [("w0", 5)]);
    }

    #[test]
    fn a_new_attempt_drops_the_old_ones_entries_and_refuses_its_reports() {
        let reports = WorkerReports::new(INTERVAL);
        for pod in ["j-a1-s0", "j-a1-s1"] {
            assert_eq!(
                reports.record("ns", "j", "uid", report(pod, 1, 3, 10, 0)),
                Recorded::Held
            );
        }
        assert_eq!(
            reports.record("ns", "j", "uid", report("j-a2-s0", 2, 0, 10, 1)),
            Recorded::Held
        );
        let mut held = Vec::new();
        reports.for_each(|_, _, _, r| held.push(r.name.clone()));
        assert_eq!(held, ["j-a2-s0"]);
        assert_eq!(reports.jobs().held, 1);
        assert_eq!(
            reports.record("ns", "j", "uid", report("j-a1-s0", 1, 4, 10, 2)),
            Recorded::Superseded { current: 2 }
        );
        // The controller deciding on an older version of the job does not bring attempt 1 back.
        reports.attempt("uid", 1, Some(99));
        assert_eq!(reports.jobs().by_uid["uid"].attempt, 2);
        assert_eq!(
            reports.jobs().by_uid["uid"].budget_bytes,
            None,
            "attempt 1's budget is not attempt 2's"
        );
        reports.attempt("uid", 2, Some(42));
        assert_eq!(reports.jobs().by_uid["uid"].budget_bytes, Some(42));
        reports.attempt("uid", 3, None);
        assert_eq!(
            reports.jobs().held,
            0,
            "attempt 3 started: attempt 2's entry goes"
        );
    }

    /// The progress a write carries follows the reports taken: a late one
    /// is not, and a new attempt (the controller's word) measures its pace again.
    #[test]
    fn progress_follows_the_reports_taken() {
        let reports = WorkerReports::new(INTERVAL);
        let progress = || {
            let mut shown = Vec::new();
            reports.for_each_progress(jiff::Timestamp::now(), |ns, job, p, _| {
                shown.push((format!("{ns}/{job}"), p.clone()))
            });
            shown
        };
        assert!(progress().is_empty());
        for (step, at) in [(0, 0), (10, 10), (20, 20)] {
            reports.record("ns", "j", "uid", report("j-a1-s0", 1, step, 10, at));
        }
        reports.record("ns", "j", "uid", report("j-a1-s0", 1, 15, 10, 15));
        reports.total_steps("uid", 50);
        let [(job, p)] = &progress()[..] else {
            panic!("one job: {:?}", progress());
        };
        assert_eq!(job, "ns/j");
        assert_eq!(p.step_of_total, "20/50", "the late report is dropped");
        assert_eq!(p.eta.as_deref(), Some("30s"));
        reports.attempt("uid", 2, None);
        let p = &progress()[0].1;
        assert_eq!((p.step, p.attempt, p.eta.as_deref()), (20, 1, None));
    }

    #[test]
    fn ended_jobs_are_closed_and_memory_is_bounded() {
        let reports = WorkerReports::new(INTERVAL);
        assert_eq!(
            reports.record("ns", "j", "uid", report("w0", 1, 1, 10, 0)),
            Recorded::Held
        );
        reports.close("uid");
        assert_eq!(reports.jobs().held, 0);
        assert_eq!(
            reports.record("ns", "j", "uid", report("w0", 1, 2, 10, 1)),
            Recorded::Closed
        );

        for i in 0..MAX_HELD_WORKERS {
            let uid = format!("uid-{}", i / 64);
            assert_eq!(
                reports.record("ns", "j", &uid, report(&format!("w{i}"), 1, 0, 10, 0)),
                Recorded::Held
            );
        }
        assert!(matches!(
            reports.record("ns", "j", "uid-0", report("another", 1, 0, 10, 0)),
            Recorded::Full(_)
        ));
        assert!(matches!(
            reports.record("ns", "k", "new-job", report("w0", 1, 0, 10, 0)),
            Recorded::Full(_)
        ));
        assert!(
            !reports.jobs().by_uid.contains_key("new-job"),
            "no empty job is kept"
        );
        assert_eq!(
            reports.record("ns", "j", "uid-0", report("w0", 1, 1, 10, 1)),
            Recorded::Held,
            "a held worker's next report is still taken"
        );
        reports.close("uid-0");
        assert_eq!(reports.jobs().held, MAX_HELD_WORKERS - 64);
        assert_eq!(
            reports.record("ns", "k", "new-job", report("w0", 1, 0, 10, 0)),
            Recorded::Held
        );
    }

    #[test]
    fn idle_jobs_with_nothing_unwritten_are_forgotten() {
        let reports = WorkerReports::new(INTERVAL);
        reports.record("ns", "j", "quiet", report("w0", 1, 1, 10, 0));
        reports.record("ns", "k", "unwritten", report("w0", 1, 1, 10, 0));
        let now = Instant::now();
        assert_eq!(reports.due(now).len(), 2);
        reports.jobs().by_uid.get_mut("quiet").expect("quiet").due = None;
        let later = now + INTERVAL * IDLE_INTERVALS + secs(1);
        assert_eq!(reports.due(later), ["unwritten"]);
        assert_eq!(reports.jobs().held, 1);
    }

    #[test]
    fn the_flusher_ticks_a_tenth_of_the_interval_within_bounds() {
        assert_eq!(tick(secs(10)), Duration::from_millis(250));
        assert_eq!(
            tick(Duration::from_millis(1000)),
            Duration::from_millis(100)
        );
        assert_eq!(tick(Duration::from_millis(100)), Duration::from_millis(20));
    }
}
