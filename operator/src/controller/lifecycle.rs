//! The job lifecycle, written down: the phases a job moves through, the
//! condition and event reasons it reports, and [`enter`], the one function
//! that moves a job between phases. Each move writes the phase, the
//! conditions that go with it and the event together, so no path can set one
//! and forget the others. Pure.
//!
//! ```text
//!   Initializing / Initialized (a model.pretrained job: the initializer
//!   fetches and checks the checkpoint; the job stays Pending)
//!            Start(first)            WorkersRunning
//!   (none) ───────────────▶ Pending ────────────────▶ Running ──▶ Succeeded
//!      │                      ▲  │ Waiting               │
//!      │                      └──┘                       │ attempt ended:
//!      │ Failed                                          │ Start(retry) / BackingOff
//!      ▼                                                 ▼
//!   Failed ◀──────────── Failed(reason) ────────────── Retrying ──▶ Running …
//! ```
//!
//! Attempts open ([`Transition::Start`]) and close ([`Transition::AttemptEnded`])
//! here too, so an attempt's outcome, reason, message, end time and observed
//! peak are written in one place whatever ended it (its pods, a refusal, a
//! deadline).
//!
//! Succeeded and Failed are final: [`enter`] refuses every move out of them.

use std::time::Duration;

use headroom_api::{Attempt, AttemptOutcome, JobPhase, MemoryAwareTrainingJobStatus};
use headroom_planner::Plan;
use headroom_planner::units::format_bytes;
use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

/// Condition types on the job.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConditionType {
    /// A plan exists for the current attempt (False: none could be made).
    Planned,
    /// The current attempt's workers are running.
    Running,
    /// The job succeeded.
    Complete,
    /// The job failed for good.
    Failed,
    /// The job waits for capacity: it fits the cluster, not what is free now.
    Waiting,
    /// A `model.pretrained` job's checkpoint and data were fetched and checked.
    Initialized,
    /// The job is suspended (`spec.suspend`): no worker pods run.
    Suspended,
}

impl ConditionType {
    pub fn as_str(self) -> &'static str {
        match self {
            ConditionType::Planned => "Planned",
            ConditionType::Running => "Running",
            ConditionType::Complete => "Complete",
            ConditionType::Failed => "Failed",
            ConditionType::Waiting => "Waiting",
            ConditionType::Initialized => "Initialized",
            ConditionType::Suspended => "Suspended",
        }
    }
}

/// Reasons on the job's conditions and events. The strings are API: users
/// and alerts match on them, so a variant's string never changes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reason {
    /// The first attempt was planned.
    Planned,
    /// A later attempt was planned (condition reason).
    Replanned,
    /// A later attempt starts (event reason).
    Retrying,
    /// An attempt's pods are being created.
    Starting,
    /// Every stage of the attempt exists and runs.
    WorkersRunning,
    /// Waiting out the backoff after a non-memory failure.
    BackingOff,
    Succeeded,
    /// An attempt ran out of memory (host or device).
    OutOfMemory,
    /// An attempt ended for another reason.
    AttemptFailed,
    /// The API server refused the attempt's workers (admission, quota, server error).
    LaunchRefused,
    /// The spec cannot be planned (a field is invalid).
    InvalidSpec,
    /// No plan fits (first attempt or retry).
    NoFeasiblePlan,
    /// The worker rejected its plan: retrying it is pointless.
    InvalidPlan,
    /// `memoryPolicy.maxAttempts` attempts have ended.
    MaxAttemptsReached,
    /// The job fits the cluster but not its free capacity (or its pods are
    /// unschedulable and no other device type fits): it waits.
    WaitingForCapacity,
    /// The capacity it waited for came (condition reason).
    CapacityAvailable,
    /// The attempt's pods wait for Kueue to admit them (condition and event).
    Queued,
    /// Kueue admitted the attempt it had queued (condition reason).
    Admitted,
    /// It waited longer than `spec.scheduling.maxWaitSeconds`.
    WaitedTooLong,
    /// The initializer pod fetches and checks the checkpoint and the data.
    Initializing,
    /// The initializer read the checkpoint and the data (condition and event).
    Initialized,
    /// Another job fills the shared model cache claim this job reads
    /// (condition, and an event when the wait starts).
    WaitingForModelCache,
    /// The checkpoint or the data cannot be used (not found, refused, a shape
    /// mismatch, no text): retrying is pointless until the spec or the files change.
    InvalidSource,
    /// An attempt filled the job's checkpoint claim (event), and the job
    /// ended for it when the claim cannot grow (condition).
    DiskFull,
    /// `spec.suspend` is true: no worker pods run (condition and event).
    Suspended,
    /// `spec.suspend` turned false: the job goes on from its last checkpoint.
    Resumed,
    /// The attempts ran `spec.activeDeadlineSeconds` in all.
    DeadlineExceeded,
    /// A worker's memory guard stopped a step before it crossed the memory
    /// limit and checkpointed the last completed step (event).
    NearOutOfMemory,
    /// A worker's memory guard halved its micro-batch in place (event).
    SteppedDown,
    /// The branch or tag a shared model cache claim was filled from names
    /// another commit now: the job reads (or fills) the claim of that
    /// commit instead (event).
    ModelCacheStale,
}

impl Reason {
    pub const ALL: [Reason; 30] = [
        Reason::Planned,
        Reason::Replanned,
        Reason::Retrying,
        Reason::Starting,
        Reason::WorkersRunning,
        Reason::BackingOff,
        Reason::Succeeded,
        Reason::OutOfMemory,
        Reason::AttemptFailed,
        Reason::LaunchRefused,
        Reason::InvalidSpec,
        Reason::NoFeasiblePlan,
        Reason::InvalidPlan,
        Reason::MaxAttemptsReached,
        Reason::WaitingForCapacity,
        Reason::CapacityAvailable,
        Reason::Queued,
        Reason::Admitted,
        Reason::WaitedTooLong,
        Reason::Initializing,
        Reason::Initialized,
        Reason::WaitingForModelCache,
        Reason::InvalidSource,
        Reason::DiskFull,
        Reason::Suspended,
        Reason::Resumed,
        Reason::DeadlineExceeded,
        Reason::NearOutOfMemory,
        Reason::SteppedDown,
        Reason::ModelCacheStale,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Planned => "Planned",
            Reason::Replanned => "Replanned",
            Reason::Retrying => "Retrying",
            Reason::Starting => "Starting",
            Reason::WorkersRunning => "WorkersRunning",
            Reason::BackingOff => "BackingOff",
            Reason::Succeeded => "Succeeded",
            Reason::OutOfMemory => "OutOfMemory",
            Reason::AttemptFailed => "AttemptFailed",
            Reason::LaunchRefused => "LaunchRefused",
            Reason::InvalidSpec => "InvalidSpec",
            Reason::NoFeasiblePlan => "NoFeasiblePlan",
            Reason::InvalidPlan => "InvalidPlan",
            Reason::MaxAttemptsReached => "MaxAttemptsReached",
            Reason::WaitingForCapacity => "WaitingForCapacity",
            Reason::CapacityAvailable => "CapacityAvailable",
            Reason::Queued => "Queued",
            Reason::Admitted => "Admitted",
            Reason::WaitedTooLong => "WaitedTooLong",
            Reason::Initializing => "Initializing",
            Reason::Initialized => "Initialized",
            Reason::WaitingForModelCache => "WaitingForModelCache",
            Reason::InvalidSource => "InvalidSource",
            Reason::DiskFull => "DiskFull",
            Reason::Suspended => "Suspended",
            Reason::Resumed => "Resumed",
            Reason::DeadlineExceeded => "DeadlineExceeded",
            Reason::NearOutOfMemory => "NearOutOfMemory",
            Reason::SteppedDown => "SteppedDown",
            Reason::ModelCacheStale => "ModelCacheStale",
        }
    }

    /// Failures that mean no plan could be made: they also set `Planned=False`.
    fn is_planning_failure(self) -> bool {
        matches!(
            self,
            Reason::InvalidSpec | Reason::NoFeasiblePlan | Reason::InvalidSource
        )
    }
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An event to record on the job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JobEvent {
    pub warning: bool,
    pub reason: Reason,
    pub note: String,
}

impl JobEvent {
    /// Event notes are capped (the API server limits them to 1 KiB).
    pub fn new(warning: bool, reason: Reason, mut note: String) -> Self {
        if note.len() > 1000 {
            let cut = (0..=1000)
                .rev()
                .find(|i| note.is_char_boundary(*i))
                .unwrap_or(0);
            note.truncate(cut);
        }
        JobEvent {
            warning,
            reason,
            note,
        }
    }
}

/// A move of the job between phases.
#[derive(Clone, Debug, PartialEq)]
pub enum Transition {
    /// Attempt `number` starts with `plan`. `retry` says why a later attempt
    /// was planned as it was (`None` on the first attempt).
    Start {
        number: u32,
        plan: Box<Plan>,
        retry: Option<String>,
    },
    /// The running attempt ended (its pods, a refusal or a deadline ended
    /// it). The phase does not change: what comes next (a retry, a backoff,
    /// success, failure) is the next move.
    AttemptEnded(AttemptEnding),
    /// The attempt's pods exist but not all run yet.
    Waiting,
    /// Every stage of attempt `attempt` exists; `running` of them run.
    WorkersRunning { attempt: u32, running: usize },
    /// Attempt `attempt` ended `outcome`; the next starts after `left`.
    BackingOff {
        attempt: u32,
        outcome: AttemptOutcome,
        left: Duration,
    },
    /// The job fits the cluster but not what is free now; `message` says
    /// what it waits for. The phase stays (Pending, or Retrying between
    /// attempts); the event is recorded when what it waits for changes.
    WaitingForCapacity { message: String },
    /// Attempt `attempt`'s pods wait for Kueue to admit their group in
    /// `queue` (a LocalQueue and its ClusterQueue); `message` is Kueue's
    /// word on why (its Workload's condition), when it said one.
    Queued {
        attempt: u32,
        queue: String,
        message: Option<String>,
    },
    /// The API server refused attempt `attempt`'s workers for a reason that
    /// can pass (a quota, a server error): reported, and asked again later.
    /// A refusal that cannot pass ends the job instead ([`Transition::Failed`]).
    LaunchRefused { attempt: u32, message: String },
    /// Attempt `attempt` finished the training; `kept_in` names the
    /// checkpoint claim that outlives the job, when it does.
    Succeeded {
        attempt: u32,
        kept_in: Option<String>,
    },
    /// Initializer run `run` starts; `message` says what it reads.
    Initializing { run: u32, message: String },
    /// The initializer read the checkpoint and the data; `message` says what it found.
    Initialized { message: String },
    /// The job waits for the shared model cache claim it reads (another
    /// job fills it, or it is being deleted); `message` names the claim.
    AwaitingModelCache { message: String },
    /// The API server refused the initializer pod for a reason that can
    /// pass (a quota, a server error): reported, and asked again later.
    InitializerRefused { message: String },
    /// The job ends without success.
    Failed { reason: Reason, message: String },
    /// `spec.suspend` is true: no worker pods run (a running attempt was
    /// ended before, as disrupted). The event only when it starts.
    Suspended,
    /// `spec.suspend` turned false on a suspended job.
    Resumed,
}

/// The reason of an attempt that `spec.suspend` ended (as disrupted).
pub const SUSPENDED_ENDING: &str = "Suspended";

/// How an attempt ended, as its pods (or the API server) showed it.
#[derive(Clone, Debug, PartialEq)]
pub struct AttemptEnding {
    pub outcome: AttemptOutcome,
    /// Kubernetes' or the worker's short reason (`OOMKilled`, `ExitCode2`, …).
    pub reason: String,
    pub message: String,
    /// The peak the pods' exit showed, bytes; the workers' live reports of
    /// the attempt are merged in by [`enter`].
    pub peak: Option<u64>,
    /// The last step the pods' exit showed; merged with the live reports too.
    pub step: Option<u64>,
}

impl AttemptEnding {
    pub fn new(outcome: AttemptOutcome, reason: impl Into<String>, message: String) -> Self {
        AttemptEnding {
            outcome,
            reason: reason.into(),
            message,
            peak: None,
            step: None,
        }
    }
}

/// When a move happens and which spec generation it answers.
#[derive(Clone, Copy, Debug)]
pub struct Stamp {
    pub now: Timestamp,
    pub generation: Option<i64>,
}

/// Moves the job: writes the phase, the conditions and the message that go
/// with `to`, and returns the event to record (if the move has one). Refused
/// (returns `Err`) when the job has already ended: completion is final.
pub fn enter(
    status: &mut MemoryAwareTrainingJobStatus,
    to: Transition,
    at: Stamp,
) -> Result<Option<JobEvent>, Final> {
    if let Some(phase @ (JobPhase::Succeeded | JobPhase::Failed)) = status.phase {
        return Err(Final(phase));
    }
    Ok(match to {
        Transition::Start {
            number,
            plan,
            retry,
        } => Some(start_attempt(status, number, *plan, retry, at)),
        Transition::AttemptEnded(ending) => end_attempt(status, ending, at),
        Transition::Waiting => {
            // A retry stays Retrying until its workers run.
            if status.phase != Some(JobPhase::Retrying) {
                status.phase = Some(JobPhase::Pending);
            }
            None
        }
        Transition::WorkersRunning { attempt, running } => {
            workers_running(status, attempt, running, at);
            None
        }
        Transition::BackingOff {
            attempt,
            outcome,
            left,
        } => {
            back_off(status, attempt, outcome, left, at);
            None
        }
        Transition::WaitingForCapacity { message } => wait_for_capacity(status, message, at),
        Transition::Queued {
            attempt,
            queue,
            message,
        } => queue_in_kueue(status, attempt, &queue, message, at),
        Transition::LaunchRefused { attempt, message } => {
            Some(launch_refused(status, attempt, &message, at))
        }
        Transition::Succeeded { attempt, kept_in } => Some(succeed(status, attempt, kept_in, at)),
        Transition::Initializing { run, message } => {
            Some(start_initializing(status, run, message, at))
        }
        Transition::Initialized { message } => {
            condition(
                status,
                ConditionType::Initialized,
                true,
                Reason::Initialized,
                &message,
                at,
            );
            status.phase.get_or_insert(JobPhase::Pending);
            status.message = Some(message.clone());
            Some(JobEvent::new(false, Reason::Initialized, message))
        }
        Transition::InitializerRefused { message } => {
            Some(initializer_refused(status, &message, at))
        }
        Transition::AwaitingModelCache { message } => {
            let started = !status.conditions.iter().any(|c| {
                c.type_ == ConditionType::Initialized.as_str()
                    && c.reason == Reason::WaitingForModelCache.as_str()
            });
            condition(
                status,
                ConditionType::Initialized,
                false,
                Reason::WaitingForModelCache,
                &message,
                at,
            );
            status.phase.get_or_insert(JobPhase::Pending);
            status.message = Some(message.clone());
            started.then(|| JobEvent::new(false, Reason::WaitingForModelCache, message))
        }
        Transition::Failed { reason, message } => Some(fail(status, reason, message, at)),
        Transition::Suspended => suspend(status, at),
        Transition::Resumed => {
            let message = "spec.suspend is false: going on from the last checkpoint";
            condition(
                status,
                ConditionType::Suspended,
                false,
                Reason::Resumed,
                message,
                at,
            );
            Some(JobEvent::new(false, Reason::Resumed, message.into()))
        }
    })
}

/// No worker pods while `spec.suspend` is true: the job is Pending (none
/// runs), `Suspended=True`, `Running=False`, and waits for nothing.
fn suspend(status: &mut MemoryAwareTrainingJobStatus, at: Stamp) -> Option<JobEvent> {
    let already = status
        .conditions
        .iter()
        .any(|c| c.type_ == ConditionType::Suspended.as_str() && c.status == "True");
    let message =
        "spec.suspend is true: no worker pods run; set it false to go on from the last checkpoint";
    condition(
        status,
        ConditionType::Suspended,
        true,
        Reason::Suspended,
        message,
        at,
    );
    end_waiting(status, at);
    if status
        .conditions
        .iter()
        .any(|c| c.type_ == ConditionType::Running.as_str())
    {
        condition(
            status,
            ConditionType::Running,
            false,
            Reason::Suspended,
            message,
            at,
        );
    }
    status.phase = Some(JobPhase::Pending);
    status.message = Some(message.into());
    (!already).then(|| JobEvent::new(false, Reason::Suspended, message.into()))
}

/// Opens attempt `number` with `plan`: the first (Pending, `Planned`) or a
/// retry (Retrying, `Replanned`; `retry` says why it was planned so).
fn start_attempt(
    status: &mut MemoryAwareTrainingJobStatus,
    number: u32,
    plan: Plan,
    retry: Option<String>,
    at: Stamp,
) -> JobEvent {
    let summary = summary(&plan);
    let (phase, planned, event) = match retry {
        None => {
            let mut note = format!("attempt {number}: {summary}");
            for w in &plan.warnings {
                note.push_str(&format!("; warning: {w}"));
            }
            (
                JobPhase::Pending,
                Reason::Planned,
                JobEvent::new(false, Reason::Planned, note),
            )
        }
        Some(why) => {
            let rungs: Vec<String> = plan.rungs_applied.iter().map(ToString::to_string).collect();
            let how = if rungs.is_empty() {
                String::new()
            } else {
                format!(" (rungs: {})", rungs.join(", "))
            };
            (
                JobPhase::Retrying,
                Reason::Replanned,
                JobEvent::new(
                    false,
                    Reason::Retrying,
                    format!("attempt {number} with {why}{how}: {summary}"),
                ),
            )
        }
    };
    condition(status, ConditionType::Planned, true, planned, &summary, at);
    end_waiting(status, at);
    condition(
        status,
        ConditionType::Running,
        false,
        Reason::Starting,
        &format!("attempt {number} starting"),
        at,
    );
    status
        .attempts
        .push(Attempt::start(number, &plan, Some(Time(at.now))));
    status.attempt = Some(number);
    status.message = Some(format!("attempt {number}: {summary}"));
    status.plan = Some(plan);
    status.phase = Some(phase);
    event
}

/// Every stage of `attempt` exists and `running` of them run.
fn workers_running(
    status: &mut MemoryAwareTrainingJobStatus,
    attempt: u32,
    running: usize,
    at: Stamp,
) {
    end_waiting(status, at);
    condition(
        status,
        ConditionType::Running,
        true,
        Reason::WorkersRunning,
        &format!("attempt {attempt}"),
        at,
    );
    status.phase = Some(JobPhase::Running);
    status.message = Some(format!("attempt {attempt}: {running} worker(s) running"));
}

/// Waits `left` before retrying `attempt` (which ended `outcome`) as it was.
fn back_off(
    status: &mut MemoryAwareTrainingJobStatus,
    attempt: u32,
    outcome: AttemptOutcome,
    left: Duration,
    at: Stamp,
) {
    condition(
        status,
        ConditionType::Running,
        false,
        Reason::BackingOff,
        &format!("retry in {}s", left.as_secs()),
        at,
    );
    status.phase = Some(JobPhase::Retrying);
    status.message = Some(format!(
        "attempt {attempt} {outcome:?}; retrying with the same settings in {}s",
        left.as_secs()
    ));
}

/// Waits for capacity; the event only when what it waits for changes.
fn wait_for_capacity(
    status: &mut MemoryAwareTrainingJobStatus,
    message: String,
    at: Stamp,
) -> Option<JobEvent> {
    let already = start_waiting(status, Reason::WaitingForCapacity, &message, at);
    status.phase.get_or_insert(JobPhase::Pending);
    status.message = Some(format!("waiting for capacity: {message}"));
    (!already).then(|| JobEvent::new(false, Reason::WaitingForCapacity, message))
}

/// Waits for Kueue to admit `attempt` in `queue`, with Kueue's `why` when
/// it said one; the event only when that changes.
fn queue_in_kueue(
    status: &mut MemoryAwareTrainingJobStatus,
    attempt: u32,
    queue: &str,
    why: Option<String>,
    at: Stamp,
) -> Option<JobEvent> {
    let message = match why {
        Some(why) => format!("attempt {attempt} is queued in Kueue {queue}: {why}"),
        None => format!("attempt {attempt} is queued in Kueue {queue}"),
    };
    let already = start_waiting(status, Reason::Queued, &message, at);
    // A retry stays Retrying until its workers run.
    if status.phase != Some(JobPhase::Retrying) {
        status.phase = Some(JobPhase::Pending);
    }
    status.message = Some(message.clone());
    (!already).then(|| JobEvent::new(false, Reason::Queued, message))
}

/// The API server refused `attempt`'s workers for now.
fn launch_refused(
    status: &mut MemoryAwareTrainingJobStatus,
    attempt: u32,
    message: &str,
    at: Stamp,
) -> JobEvent {
    let message = format!("attempt {attempt}: the API server refused the workers: {message}");
    condition(
        status,
        ConditionType::Running,
        false,
        Reason::LaunchRefused,
        &message,
        at,
    );
    status.message = Some(format!("{message}; asking again"));
    // The attempt exists and waits for its workers: Pending or Retrying as before.
    status.phase.get_or_insert(JobPhase::Pending);
    JobEvent::new(true, Reason::LaunchRefused, message)
}

/// `attempt` finished the training; `kept_in` names the claim that outlives the job.
fn succeed(
    status: &mut MemoryAwareTrainingJobStatus,
    attempt: u32,
    kept_in: Option<String>,
    at: Stamp,
) -> JobEvent {
    let mut message = format!("succeeded on attempt {attempt}");
    if let Some(claim) = kept_in {
        message.push_str(&format!(
            "; the trained checkpoints are kept in PersistentVolumeClaim {claim}, which outlives the job"
        ));
    }
    condition(
        status,
        ConditionType::Running,
        false,
        Reason::Succeeded,
        "training finished",
        at,
    );
    condition(
        status,
        ConditionType::Complete,
        true,
        Reason::Succeeded,
        &message,
        at,
    );
    status.phase = Some(JobPhase::Succeeded);
    status.message = Some(message);
    JobEvent::new(
        false,
        Reason::Succeeded,
        format!("attempt {attempt} finished"),
    )
}

/// Initializer run `run` starts, reading what `message` says.
fn start_initializing(
    status: &mut MemoryAwareTrainingJobStatus,
    run: u32,
    message: String,
    at: Stamp,
) -> JobEvent {
    condition(
        status,
        ConditionType::Initialized,
        false,
        Reason::Initializing,
        &message,
        at,
    );
    status.phase.get_or_insert(JobPhase::Pending);
    status.message = Some(format!("initializing: {message}"));
    let note = if run > 1 {
        format!("initializer run {run}: {message}")
    } else {
        message
    };
    JobEvent::new(false, Reason::Initializing, note)
}

/// The API server refused the initializer pod for now.
fn initializer_refused(
    status: &mut MemoryAwareTrainingJobStatus,
    message: &str,
    at: Stamp,
) -> JobEvent {
    let message = format!("the API server refused the initializer pod: {message}");
    condition(
        status,
        ConditionType::Initialized,
        false,
        Reason::LaunchRefused,
        &message,
        at,
    );
    status.phase.get_or_insert(JobPhase::Pending);
    status.message = Some(format!("{message}; asking again"));
    JobEvent::new(true, Reason::LaunchRefused, message)
}

/// The job ends without success, for `reason`.
fn fail(
    status: &mut MemoryAwareTrainingJobStatus,
    reason: Reason,
    message: String,
    at: Stamp,
) -> JobEvent {
    if reason.is_planning_failure() {
        condition(status, ConditionType::Planned, false, reason, &message, at);
    }
    condition(
        status,
        ConditionType::Running,
        false,
        reason,
        "job failed",
        at,
    );
    condition(status, ConditionType::Failed, true, reason, &message, at);
    status.phase = Some(JobPhase::Failed);
    status.message = Some(message.clone());
    JobEvent::new(true, reason, message)
}

/// Closes the running attempt: outcome, reason, message, end time, and the
/// peak and step from the exit and the workers' live reports together. A
/// failed attempt's event says how it ended; a successful one has none (the
/// job's own `Succeeded` move records it).
fn end_attempt(
    status: &mut MemoryAwareTrainingJobStatus,
    ending: AttemptEnding,
    at: Stamp,
) -> Option<JobEvent> {
    let attempt = status
        .attempts
        .last()
        .filter(|a| a.outcome == AttemptOutcome::Running)?
        .number;
    // What the attempt's workers reported live, for when they could not say it on exit.
    let reports = status.workers.iter().filter(|w| w.attempt == attempt);
    let (telemetry_peak, telemetry_step) = reports.fold((None, None), |(peak, step), w| {
        (peak.max(Some(w.memory.peak_bytes)), step.max(Some(w.step)))
    });
    let a = status.attempts.last_mut()?;
    a.outcome = ending.outcome;
    a.reason = Some(ending.reason.clone());
    a.message = Some(ending.message.clone());
    a.finished_at = Some(Time(at.now));
    a.observed_peak_bytes = ending.peak.max(telemetry_peak).or(a.observed_peak_bytes);
    a.last_step = ending.step.max(telemetry_step).or(a.last_step);
    // The time left was this attempt's: gone with it (see JobProgress::forget_eta).
    if let Some(progress) = status.progress.as_mut() {
        progress.forget_eta();
    }
    // A success has its own event, and so has a suspension (`suspend`).
    if ending.outcome == AttemptOutcome::Succeeded || ending.reason == SUSPENDED_ENDING {
        return None;
    }
    let reason = if ending.outcome == AttemptOutcome::NearOutOfMemory {
        Reason::NearOutOfMemory
    } else if ending.outcome.is_memory() {
        Reason::OutOfMemory
    } else if ending.outcome == AttemptOutcome::DiskFull {
        Reason::DiskFull
    } else {
        Reason::AttemptFailed
    };
    Some(JobEvent::new(
        true,
        reason,
        format!(
            "attempt {attempt} {}: {}{}",
            ending.reason,
            ending.message,
            peak_note(a)
        ),
    ))
}

/// What an event can say about an ended attempt's memory. A kernel OOM kill
/// ends the process between telemetry samples, so the last sample is only a
/// lower bound: the kill itself says the limit was reached.
fn peak_note(ended: &Attempt) -> String {
    let limit = ended.device_memory_bytes;
    match (ended.outcome, ended.observed_peak_bytes) {
        (AttemptOutcome::HostOutOfMemory, Some(b)) if b < limit => format!(
            " (killed at its {} limit; the last telemetry sample before the kill was {})",
            format_bytes(limit),
            format_bytes(b)
        ),
        (AttemptOutcome::HostOutOfMemory, None) => {
            format!(" (killed at its {} limit)", format_bytes(limit))
        }
        (_, Some(b)) => format!(" (observed peak {})", format_bytes(b)),
        (_, None) => String::new(),
    }
}

/// Sets `Waiting=True` with `reason` and `message`; whether it already said
/// that message (then its event is not recorded again).
fn start_waiting(
    status: &mut MemoryAwareTrainingJobStatus,
    reason: Reason,
    message: &str,
    at: Stamp,
) -> bool {
    let already = status.conditions.iter().any(|c| {
        c.type_ == ConditionType::Waiting.as_str() && c.status == "True" && c.message == message
    });
    condition(status, ConditionType::Waiting, true, reason, message, at);
    already
}

/// The capacity a waiting job waited for came (or Kueue admitted it):
/// `Waiting` turns False.
fn end_waiting(status: &mut MemoryAwareTrainingJobStatus, at: Stamp) {
    let waited_for = status
        .conditions
        .iter()
        .find(|c| c.type_ == ConditionType::Waiting.as_str() && c.status == "True")
        .map(|c| c.reason == Reason::Queued.as_str());
    if let Some(queued) = waited_for {
        let reason = if queued {
            Reason::Admitted
        } else {
            Reason::CapacityAvailable
        };
        condition(status, ConditionType::Waiting, false, reason, "", at);
    }
}

/// A move was asked of a job that has already ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Final(pub JobPhase);

/// Sets a condition, keeping lastTransitionTime when its status does not change.
fn condition(
    status: &mut MemoryAwareTrainingJobStatus,
    type_: ConditionType,
    on: bool,
    reason: Reason,
    message: &str,
    at: Stamp,
) {
    let conditions = &mut status.conditions;
    let status = if on { "True" } else { "False" }.to_string();
    match conditions.iter_mut().find(|c| c.type_ == type_.as_str()) {
        Some(c) => {
            if c.status != status {
                c.last_transition_time = Time(at.now);
            }
            c.status = status;
            c.reason = reason.as_str().to_string();
            c.message = message.to_string();
            c.observed_generation = at.generation;
        }
        None => conditions.push(Condition {
            type_: type_.as_str().to_string(),
            status,
            reason: reason.as_str().to_string(),
            message: message.to_string(),
            last_transition_time: Time(at.now),
            observed_generation: at.generation,
        }),
    }
}

/// One line about a plan, for events and status messages.
pub fn summary(p: &Plan) -> String {
    format!(
        "{} × {}, {}; predicted {}",
        p.workers, p.device, p.settings, p.fit
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controller::pods::tests::job;

    fn plan() -> Plan {
        let j = job(include_str!("../../../samples/cpu-tiny.yaml"));
        let req = j.spec.job_request().expect("request");
        headroom_planner::plan(&req, &headroom_planner::Inventory::default()).expect("plan")
    }

    fn at() -> Stamp {
        Stamp {
            now: "2026-11-21T10:00:00Z".parse().expect("time"),
            generation: Some(3),
        }
    }

    /// The phase a move leads to.
    #[derive(Clone, Copy)]
    enum Next {
        /// This phase, from any.
        To(JobPhase),
        /// The phase the job was in (`Pending` for a job without one).
        Stays,
        /// `Retrying` from `Retrying`, else `Pending`.
        PendingUnlessRetrying,
    }

    impl Next {
        fn from(self, from: Option<JobPhase>) -> JobPhase {
            match self {
                Next::To(phase) => phase,
                Next::Stays => from.unwrap_or(JobPhase::Pending),
                Next::PendingUnlessRetrying if from == Some(JobPhase::Retrying) => {
                    JobPhase::Retrying
                }
                Next::PendingUnlessRetrying => JobPhase::Pending,
            }
        }
    }

    const T: &str = "True";
    const F: &str = "False";

    /// A move, where it leads, its event (warning?, reason) and the
    /// conditions it writes (type, status, reason).
    struct Row {
        to: Transition,
        next: Next,
        event: Option<(bool, Reason)>,
        conditions: Vec<(ConditionType, &'static str, Reason)>,
    }

    fn row(
        to: Transition,
        next: Next,
        event: Option<(bool, Reason)>,
        conditions: &[(ConditionType, &'static str, Reason)],
    ) -> Row {
        Row {
            to,
            next,
            event,
            conditions: conditions.to_vec(),
        }
    }

    /// A Normal event with this reason.
    fn normal(reason: Reason) -> Option<(bool, Reason)> {
        Some((false, reason))
    }

    /// A Warning event with this reason.
    fn warning(reason: Reason) -> Option<(bool, Reason)> {
        Some((true, reason))
    }

    fn start(number: u32, retry: Option<&str>) -> Transition {
        Transition::Start {
            number,
            plan: Box::new(plan()),
            retry: retry.map(Into::into),
        }
    }

    fn failed(reason: Reason, message: &str) -> Transition {
        Transition::Failed {
            reason,
            message: message.into(),
        }
    }

    /// Every move the lifecycle knows, each once (the ways a job fails once
    /// for each reason that writes different conditions). One row a move,
    /// in the order a job meets them.
    fn moves() -> Vec<Row> {
        use ConditionType as C;
        use JobPhase as P;
        use Next::*;
        use Reason as R;
        vec![
            row(
                start(1, None),
                To(P::Pending),
                normal(R::Planned),
                &[(C::Planned, T, R::Planned), (C::Running, F, R::Starting)],
            ),
            row(
                start(2, Some("stricter settings")),
                To(P::Retrying),
                normal(R::Retrying),
                &[(C::Planned, T, R::Replanned), (C::Running, F, R::Starting)],
            ),
            row(Transition::Waiting, PendingUnlessRetrying, None, &[]),
            row(
                Transition::WorkersRunning {
                    attempt: 1,
                    running: 2,
                },
                To(P::Running),
                None,
                &[(C::Running, T, R::WorkersRunning)],
            ),
            row(
                Transition::BackingOff {
                    attempt: 1,
                    outcome: AttemptOutcome::Failed,
                    left: Duration::from_secs(10),
                },
                To(P::Retrying),
                None,
                &[(C::Running, F, R::BackingOff)],
            ),
            row(
                Transition::WaitingForCapacity {
                    message: "2 × NVIDIA-L4 free (1 free of 8 now)".into(),
                },
                Stays,
                normal(R::WaitingForCapacity),
                &[(C::Waiting, T, R::WaitingForCapacity)],
            ),
            row(
                Transition::LaunchRefused {
                    attempt: 1,
                    message: "exceeded quota: pods=0".into(),
                },
                Stays,
                warning(R::LaunchRefused),
                &[(C::Running, F, R::LaunchRefused)],
            ),
            row(
                failed(
                    R::LaunchRefused,
                    "Pod x: forbidden: maximum memory usage per Container is 64Mi",
                ),
                To(P::Failed),
                warning(R::LaunchRefused),
                &[
                    (C::Running, F, R::LaunchRefused),
                    (C::Failed, T, R::LaunchRefused),
                ],
            ),
            row(
                Transition::Succeeded {
                    attempt: 2,
                    kept_in: Some("tiny-checkpoints".into()),
                },
                To(P::Succeeded),
                normal(R::Succeeded),
                &[
                    (C::Running, F, R::Succeeded),
                    (C::Complete, T, R::Succeeded),
                ],
            ),
            row(
                failed(R::NoFeasiblePlan, "no feasible plan: …"),
                To(P::Failed),
                warning(R::NoFeasiblePlan),
                &[
                    (C::Planned, F, R::NoFeasiblePlan),
                    (C::Running, F, R::NoFeasiblePlan),
                    (C::Failed, T, R::NoFeasiblePlan),
                ],
            ),
            row(
                failed(R::InvalidSpec, "spec.model: …"),
                To(P::Failed),
                warning(R::InvalidSpec),
                &[
                    (C::Planned, F, R::InvalidSpec),
                    (C::Running, F, R::InvalidSpec),
                    (C::Failed, T, R::InvalidSpec),
                ],
            ),
            row(
                Transition::Initializing {
                    run: 1,
                    message: "Hugging Face repository org/m@main".into(),
                },
                Stays,
                normal(R::Initializing),
                &[(C::Initialized, F, R::Initializing)],
            ),
            row(
                Transition::Initialized {
                    message: "LlamaForCausalLM, 1.2 billion parameters".into(),
                },
                Stays,
                normal(R::Initialized),
                &[(C::Initialized, T, R::Initialized)],
            ),
            row(
                Transition::AwaitingModelCache {
                    message: "waiting for job a to download the model into the shared model cache claim headroom-model-0".into(),
                },
                Stays,
                normal(R::WaitingForModelCache),
                &[(C::Initialized, F, R::WaitingForModelCache)],
            ),
            row(
                Transition::InitializerRefused {
                    message: "exceeded quota: pods=0 (403 Pod x-init-1)".into(),
                },
                Stays,
                warning(R::LaunchRefused),
                &[(C::Initialized, F, R::LaunchRefused)],
            ),
            row(
                failed(R::InvalidSource, "repository org/m not found"),
                To(P::Failed),
                warning(R::InvalidSource),
                &[
                    (C::Planned, F, R::InvalidSource),
                    (C::Running, F, R::InvalidSource),
                    (C::Failed, T, R::InvalidSource),
                ],
            ),
            row(
                failed(R::MaxAttemptsReached, "attempt 3 ended …"),
                To(P::Failed),
                warning(R::MaxAttemptsReached),
                &[
                    (C::Running, F, R::MaxAttemptsReached),
                    (C::Failed, T, R::MaxAttemptsReached),
                ],
            ),
        ]
    }

    /// Each move × each phase a job can be in → next phase, event, conditions.
    #[test]
    fn every_move_from_every_phase() {
        for row in moves() {
            for from in [
                None,
                Some(JobPhase::Pending),
                Some(JobPhase::Running),
                Some(JobPhase::Retrying),
            ] {
                assert_the_move_from_an_open_phase(&row, from);
            }
            for ended in [JobPhase::Succeeded, JobPhase::Failed] {
                assert_completion_is_final(&row.to, ended);
            }
        }
    }

    /// From an open phase the move leads to its phase, with its event and its
    /// conditions (and no others), each stamped with the generation.
    fn assert_the_move_from_an_open_phase(row: &Row, from: Option<JobPhase>) {
        let mut status = MemoryAwareTrainingJobStatus {
            phase: from,
            ..Default::default()
        };
        let got = enter(&mut status, row.to.clone(), at()).expect("an open job moves");
        let case = format!("{:?} from {from:?}", row.to);
        assert_eq!(status.phase, Some(row.next.from(from)), "{case}");
        assert_eq!(
            got.as_ref().map(|e| (e.warning, e.reason)),
            row.event,
            "{case}"
        );
        let mut written: Vec<(String, String, String)> = status
            .conditions
            .iter()
            .map(|c| (c.type_.clone(), c.status.clone(), c.reason.clone()))
            .collect();
        let mut expected: Vec<(String, String, String)> = row
            .conditions
            .iter()
            .map(|(t, s, r)| (t.as_str().into(), s.to_string(), r.as_str().into()))
            .collect();
        written.sort();
        expected.sort();
        assert_eq!(written, expected, "{case}");
        assert!(
            status
                .conditions
                .iter()
                .all(|c| c.observed_generation == Some(3)),
            "{case}"
        );
    }

    /// From an ended phase no move is taken, and the status is untouched.
    fn assert_completion_is_final(to: &Transition, ended: JobPhase) {
        let mut status = MemoryAwareTrainingJobStatus {
            phase: Some(ended),
            ..Default::default()
        };
        let before = status.clone();
        assert_eq!(
            enter(&mut status, to.clone(), at()),
            Err(Final(ended)),
            "{to:?} from {ended:?}: completion is final"
        );
        assert_eq!(status, before);
    }

    #[test]
    fn a_condition_keeps_its_transition_time_while_its_status_holds() {
        let mut status = MemoryAwareTrainingJobStatus::default();
        let first = at();
        let later = Stamp {
            now: "2026-11-21T10:05:00Z".parse().expect("time"),
            generation: Some(3),
        };
        let running = Transition::WorkersRunning {
            attempt: 1,
            running: 1,
        };
        enter(&mut status, running.clone(), first).expect("move");
        enter(&mut status, running, later).expect("move");
        assert_eq!(status.conditions[0].last_transition_time, Time(first.now));
        enter(
            &mut status,
            Transition::BackingOff {
                attempt: 1,
                outcome: AttemptOutcome::Disrupted,
                left: Duration::from_secs(5),
            },
            later,
        )
        .expect("move");
        assert_eq!(status.conditions[0].last_transition_time, Time(later.now));
    }

    /// An attempt opens with `Start` and closes with `AttemptEnded`: the
    /// outcome, reason, message and end time together, the peak and step the
    /// exit showed merged with the workers' live reports, the phase
    /// unchanged, and an event only for a failure.
    #[test]
    fn attempts_open_and_close_through_enter() {
        let start = Transition::Start {
            number: 1,
            plan: Box::new(plan()),
            retry: None,
        };
        let mut status = MemoryAwareTrainingJobStatus::default();
        enter(&mut status, start.clone(), at()).expect("move");
        status.workers.push(headroom_api::WorkerTelemetry {
            name: "w".into(),
            attempt: 1,
            stage: 0,
            layer_start: 0,
            layer_end: 2,
            step: 7,
            loss: None,
            eval_loss: None,
            tokens_per_second: None,
            memory: headroom_api::MemorySample {
                peak_bytes: 900,
                ..Default::default()
            },
            download: None,
            stepped_down: None,
            updated_at: Time(at().now),
        });
        status.progress = Some(headroom_api::JobProgress {
            attempt: 1,
            step: 7,
            total_steps: Some(10),
            step_of_total: "7/10".into(),
            train_loss: Some(2.5),
            eval_loss: None,
            tokens_per_second: Some(100.0),
            seconds_per_step: Some(2.0),
            eta_seconds: Some(6),
            eta: Some("6s".into()),
            estimated_completion_time: Some(Time(at().now)),
            updated_at: Time(at().now),
        });
        let later = Stamp {
            now: "2026-11-21T10:05:00Z".parse().expect("time"),
            generation: Some(3),
        };
        let ending = AttemptEnding {
            outcome: AttemptOutcome::HostOutOfMemory,
            reason: "OOMKilled".into(),
            message: "killed".into(),
            peak: Some(800),
            step: None,
        };
        let event = enter(&mut status, Transition::AttemptEnded(ending.clone()), later)
            .expect("move")
            .expect("a failed attempt has an event");
        assert_eq!((event.warning, event.reason), (true, Reason::OutOfMemory));
        assert!(
            event.note.starts_with("attempt 1 OOMKilled: killed"),
            "{}",
            event.note
        );
        let a = &status.attempts[0];
        assert_eq!(a.outcome, AttemptOutcome::HostOutOfMemory);
        assert_eq!(
            (a.reason.as_deref(), a.message.as_deref()),
            (Some("OOMKilled"), Some("killed"))
        );
        assert_eq!(a.finished_at, Some(Time(later.now)));
        assert_eq!((a.observed_peak_bytes, a.last_step), (Some(900), Some(7)));
        let progress = status.progress.as_ref().expect("progress stays");
        assert_eq!(
            (progress.step, progress.train_loss, progress.eta.as_deref()),
            (7, Some(2.5), None),
            "the step and loss stay; the time left went with the attempt"
        );
        assert_eq!(
            (progress.eta_seconds, progress.seconds_per_step),
            (None, None)
        );
        assert_eq!(
            status.phase,
            Some(JobPhase::Pending),
            "the phase waits for the next move"
        );
        // Closed: a second ending changes nothing.
        let before = status.clone();
        assert_eq!(
            enter(&mut status, Transition::AttemptEnded(ending), later),
            Ok(None)
        );
        assert_eq!(status, before);
        // A success closes quietly: the job's own Succeeded move records it.
        let mut status = MemoryAwareTrainingJobStatus::default();
        enter(&mut status, start, at()).expect("move");
        let done = AttemptEnding::new(AttemptOutcome::Succeeded, "Succeeded", "done".into());
        assert_eq!(
            enter(&mut status, Transition::AttemptEnded(done), later),
            Ok(None)
        );
        assert_eq!(status.attempts[0].outcome, AttemptOutcome::Succeeded);
    }

    #[test]
    fn reason_strings_are_distinct_and_event_notes_are_capped() {
        let mut names: Vec<&str> = Reason::ALL.iter().map(|r| r.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), Reason::ALL.len());
        let note = JobEvent::new(false, Reason::Planned, "é".repeat(800)).note;
        assert!(note.len() <= 1000 && note.chars().all(|c| c == 'é'));
    }
}
