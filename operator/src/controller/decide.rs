//! The reconcile decision: given a job, its pods and the inventory, what the
//! status should say, which attempt's children must exist, which pods to stop
//! and which events to record. Pure, so every branch is unit-tested; the I/O
//! around it lives in `mod.rs`.

use std::time::Duration;

use headroom_api::{
    Attempt, AttemptOutcome, JobPhase, LABEL_ATTEMPT, MemoryAwareTrainingJob,
    MemoryAwareTrainingJobStatus, WORKER_MAX_STAGES,
};
use headroom_planner::search::{SearchOptions, plan_with};
use headroom_planner::units::format_bytes;
use headroom_planner::{
    Inventory, MemoryFailure, MemoryFailureKind, Plan, next_stricter_plan, plan,
};
use jiff::Timestamp;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::ResourceExt;

use super::classify::{PodFailure, PodVerdict, classify, rank};

/// Longest wait between retries of non-memory failures.
const MAX_BACKOFF: Duration = Duration::from_secs(3600);
/// How long a pipeline stage that lost its neighbour waits for the
/// neighbour's own failure to be reported before the attempt ends without it.
const PEER_LOST_GRACE: Duration = Duration::from_secs(30);

/// Condition types on the job.
pub const CONDITION_PLANNED: &str = "Planned";
pub const CONDITION_RUNNING: &str = "Running";
pub const CONDITION_COMPLETE: &str = "Complete";
pub const CONDITION_FAILED: &str = "Failed";

/// An event to record on the job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JobEvent {
    pub warning: bool,
    pub reason: &'static str,
    pub note: String,
}

/// What reconcile should do.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    /// The whole operator-owned status (telemetry `workers` are left to the workers).
    pub status: MemoryAwareTrainingJobStatus,
    pub events: Vec<JobEvent>,
    /// Attempt whose children must exist (created when missing).
    pub launch: Option<u32>,
    /// Pods to delete (the live stages of an attempt that has failed as a whole).
    pub delete_pods: Vec<String>,
    /// When to look again even without a change.
    pub requeue_after: Option<Duration>,
    /// The attempt that just ended, for metrics.
    pub ended: Option<AttemptOutcome>,
}

/// Everything the decision depends on.
#[derive(Debug)]
pub struct Observation<'a> {
    pub job: &'a MemoryAwareTrainingJob,
    /// Pods of this job (any attempt).
    pub pods: &'a [&'a Pod],
    pub inventory: &'a Inventory,
    pub now: Timestamp,
    /// How long a pod may stay unschedulable before the attempt is given up.
    pub unschedulable_grace: Duration,
}

struct Builder<'a> {
    obs: &'a Observation<'a>,
    d: Decision,
}

/// Decides the next step for one job.
pub fn decide(obs: &Observation<'_>) -> Decision {
    let mut status = obs.job.status.clone().unwrap_or_default();
    status.observed_generation = obs.job.metadata.generation;
    let mut b = Builder {
        obs,
        d: Decision {
            status,
            events: vec![],
            launch: None,
            delete_pods: vec![],
            requeue_after: None,
            ended: None,
        },
    };
    b.run();
    b.d
}

impl Builder<'_> {
    fn run(&mut self) {
        if matches!(
            self.d.status.phase,
            Some(JobPhase::Succeeded | JobPhase::Failed)
        ) {
            return; // A job's completion is final.
        }
        let request = match runnable_request(self.obs.job) {
            Ok(r) => r,
            Err(e) => return self.fail("InvalidSpec", e.to_string()),
        };
        let Some(current) = self.d.status.attempts.last().cloned() else {
            return match plan(&request, self.obs.inventory) {
                Ok(p) => {
                    self.condition(CONDITION_PLANNED, true, "Planned", &summary(&p));
                    let mut note = format!("attempt 1: {}", summary(&p));
                    for w in &p.warnings {
                        note.push_str(&format!("; warning: {w}"));
                    }
                    self.event(false, "Planned", note);
                    self.start_attempt(1, p);
                }
                Err(e) => {
                    self.condition(CONDITION_PLANNED, false, "NoFeasiblePlan", &e.to_string());
                    self.fail("NoFeasiblePlan", e.to_string());
                }
            };
        };
        if current.outcome == AttemptOutcome::Running {
            self.watch_attempt(&current);
        } else {
            self.after_attempt(&current, &request);
        }
    }

    /// Follows the running attempt's pods.
    fn watch_attempt(&mut self, attempt: &Attempt) {
        let n = attempt.number;
        let pods: Vec<(&Pod, PodVerdict)> = self
            .obs
            .pods
            .iter()
            .filter(|p| {
                p.labels()
                    .get(LABEL_ATTEMPT)
                    .is_some_and(|a| *a == n.to_string())
            })
            .map(|p| (*p, classify(p)))
            .collect();

        let worst: Option<&PodFailure> = pods
            .iter()
            .filter_map(|(_, v)| {
                if let PodVerdict::Failed(f) = v {
                    Some(f)
                } else {
                    None
                }
            })
            .max_by_key(|f| rank(f));
        if let Some(failure) = worst.cloned() {
            // Only lost peers so far: the stage that caused it is still being
            // reported (its OOM kill decides the retry). Wait for it a while.
            let others_alive = pods
                .iter()
                .any(|(_, v)| matches!(v, PodVerdict::Running | PodVerdict::Pending { .. }));
            if failure.peer_lost && others_alive {
                let waited = failure.finished_at.map_or(Duration::ZERO, |t| {
                    self.obs.now.duration_since(t).unsigned_abs()
                });
                if waited < PEER_LOST_GRACE {
                    self.d.requeue_after = Some(PEER_LOST_GRACE - waited + Duration::from_secs(1));
                    return;
                }
            }
            // One stage failing fails the attempt as a whole: stop the others.
            self.d.delete_pods = pods
                .iter()
                .filter(|(_, v)| matches!(v, PodVerdict::Running | PodVerdict::Pending { .. }))
                .map(|(p, _)| p.name_any())
                .collect();
            let step = pods
                .iter()
                .filter_map(|(_, v)| {
                    if let PodVerdict::Failed(f) = v {
                        f.step
                    } else {
                        None
                    }
                })
                .max();
            return self.end_attempt(
                failure.outcome,
                &failure.reason,
                &failure.message,
                failure.peak_bytes,
                step,
            );
        }

        let succeeded = pods
            .iter()
            .filter(|(_, v)| *v == PodVerdict::Succeeded)
            .count();
        if succeeded == attempt.plan.workers as usize && succeeded > 0 {
            self.end_attempt(
                AttemptOutcome::Succeeded,
                "Succeeded",
                "all workers finished",
                None,
                None,
            );
            self.d.status.phase = Some(JobPhase::Succeeded);
            self.d.status.message = Some(format!("succeeded on attempt {n}"));
            self.condition(CONDITION_RUNNING, false, "Succeeded", "training finished");
            self.condition(
                CONDITION_COMPLETE,
                true,
                "Succeeded",
                &format!("succeeded on attempt {n}"),
            );
            self.event(false, "Succeeded", format!("attempt {n} finished"));
            return;
        }

        let stuck = pods.iter().find_map(|(_, v)| match v {
            PodVerdict::Pending {
                unschedulable_since: Some(since),
                message,
            } => Some((*since, message.clone())),
            _ => None,
        });
        if let Some((since, message)) = stuck {
            let waited = self.obs.now.duration_since(since).unsigned_abs();
            if waited >= self.obs.unschedulable_grace {
                self.d.delete_pods = pods.iter().map(|(p, _)| p.name_any()).collect();
                let why = message.unwrap_or_else(|| "no node can take the worker".into());
                return self.end_attempt(
                    AttemptOutcome::Unschedulable,
                    "Unschedulable",
                    &why,
                    None,
                    None,
                );
            }
            self.d.requeue_after =
                Some(self.obs.unschedulable_grace.saturating_sub(waited) + Duration::from_secs(1));
        }

        // An earlier attempt's pods still shutting down (deleted stages save a
        // checkpoint on SIGTERM): start this attempt's pods once they are
        // gone, so every stage resumes from the same, newest checkpoint.
        let stopping: Vec<String> = self
            .obs
            .pods
            .iter()
            .filter(|p| {
                p.labels()
                    .get(LABEL_ATTEMPT)
                    .and_then(|a| a.parse::<u32>().ok())
                    .is_some_and(|a| a < n)
                    && matches!(
                        classify(p),
                        PodVerdict::Running | PodVerdict::Pending { .. }
                    )
                    // Deleted and 30 s past its grace period: its node is
                    // probably gone, and it must not block the job forever.
                    && !p.metadata.deletion_timestamp.as_ref().is_some_and(|t| {
                        self.obs.now.duration_since(t.0) > jiff::SignedDuration::from_secs(30)
                    })
            })
            .map(|p| p.name_any())
            .collect();
        if pods.is_empty() && !stopping.is_empty() {
            self.d.status.message = Some(format!(
                "attempt {n}: waiting for {} of an earlier attempt to stop",
                stopping.join(", ")
            ));
            self.d.requeue_after = Some(Duration::from_secs(2));
            return;
        }
        self.d.launch = Some(n);
        let running = pods
            .iter()
            .filter(|(_, v)| *v == PodVerdict::Running)
            .count();
        if running > 0 && pods.len() == attempt.plan.workers as usize {
            self.d.status.phase = Some(JobPhase::Running);
            self.d.status.message = Some(format!("attempt {n}: {} worker(s) running", running));
            self.condition(
                CONDITION_RUNNING,
                true,
                "WorkersRunning",
                &format!("attempt {n}"),
            );
        } else if self.d.status.phase != Some(JobPhase::Retrying) {
            self.d.status.phase = Some(JobPhase::Pending);
        }
    }

    /// Records how the current attempt ended, then moves on.
    fn end_attempt(
        &mut self,
        outcome: AttemptOutcome,
        reason: &str,
        message: &str,
        peak: Option<u64>,
        step: Option<u64>,
    ) {
        let now = self.obs.now;
        // What the workers of this attempt reported live, for when they could not say it on exit.
        let n = self.d.status.attempts.last().map_or(0, |a| a.number);
        let reports = self.d.status.workers.iter().filter(|w| w.attempt == n);
        let (telemetry_peak, telemetry_step) = reports.fold((None, None), |(peak, step), w| {
            (peak.max(Some(w.memory.peak_bytes)), step.max(Some(w.step)))
        });
        let Some(attempt) = self.d.status.attempts.last_mut() else {
            return;
        };
        attempt.outcome = outcome;
        attempt.reason = Some(reason.to_string());
        attempt.message = Some(message.to_string());
        attempt.finished_at = Some(Time(now));
        attempt.observed_peak_bytes = peak.max(telemetry_peak).or(attempt.observed_peak_bytes);
        attempt.last_step = step.max(telemetry_step).or(attempt.last_step);
        let ended = attempt.clone();
        self.d.ended = Some(outcome);
        if outcome == AttemptOutcome::Succeeded {
            return;
        }
        let memory = matches!(
            outcome,
            AttemptOutcome::HostOutOfMemory | AttemptOutcome::DeviceOutOfMemory
        );
        self.event(
            true,
            if memory {
                "OutOfMemory"
            } else {
                "AttemptFailed"
            },
            format!(
                "attempt {} {reason}: {message}{}",
                ended.number,
                peak_note(&ended)
            ),
        );
        if let Ok(request) = runnable_request(self.obs.job) {
            self.after_attempt(&ended, &request);
        }
    }

    /// Chooses and starts the next attempt after `ended`, or ends the job.
    fn after_attempt(&mut self, ended: &Attempt, request: &headroom_planner::JobRequest) {
        let policy = &self.obs.job.spec.memory_policy;
        let n = ended.number;
        if ended.outcome == AttemptOutcome::Succeeded {
            self.d.status.phase = Some(JobPhase::Succeeded);
            return;
        }
        if ended.reason.as_deref() == Some("InvalidPlan") {
            return self.fail(
                "InvalidPlan",
                format!(
                    "the worker rejected attempt {n}'s plan: {}",
                    ended.message.clone().unwrap_or_default()
                ),
            );
        }
        if n >= policy.max_attempts {
            return self.fail(
                "MaxAttemptsReached",
                format!(
                    "attempt {n} ended {:?} ({}); memoryPolicy.maxAttempts is {}",
                    ended.outcome,
                    ended.message.clone().unwrap_or_default(),
                    policy.max_attempts
                ),
            );
        }
        match ended.outcome {
            AttemptOutcome::HostOutOfMemory | AttemptOutcome::DeviceOutOfMemory => {
                let kind = if ended.outcome == AttemptOutcome::DeviceOutOfMemory {
                    MemoryFailureKind::DeviceOom
                } else {
                    MemoryFailureKind::HostOom
                };
                let failure = MemoryFailure {
                    kind,
                    observed_peak_bytes: ended.observed_peak_bytes,
                };
                match next_stricter_plan(request, self.obs.inventory, &ended.plan, &failure) {
                    Ok(p) => self.retry(n + 1, p, "stricter settings"),
                    Err(e) => {
                        self.condition(CONDITION_PLANNED, false, "NoFeasiblePlan", &e.to_string());
                        self.fail("NoFeasiblePlan", e.to_string());
                    }
                }
            }
            AttemptOutcome::Unschedulable => {
                let excluded: Vec<String> = self
                    .d
                    .status
                    .attempts
                    .iter()
                    .filter(|a| a.outcome == AttemptOutcome::Unschedulable)
                    .map(|a| a.plan.device.clone())
                    .collect();
                let opts = SearchOptions {
                    correction: ended.plan.correction_factor,
                    excluded_devices: excluded,
                    ignore_pins: true,
                };
                match plan_with(request, self.obs.inventory, &opts) {
                    Ok(p) => self.retry(n + 1, p, "another device type"),
                    Err(e) => self.fail(
                        "NoFeasiblePlan",
                        format!("{} was unschedulable; {e}", ended.plan.device),
                    ),
                }
            }
            AttemptOutcome::Disrupted | AttemptOutcome::Failed => {
                // Same settings; exponential backoff over consecutive non-memory failures.
                let streak = self
                    .d
                    .status
                    .attempts
                    .iter()
                    .rev()
                    .take_while(|a| {
                        matches!(
                            a.outcome,
                            AttemptOutcome::Disrupted | AttemptOutcome::Failed
                        )
                    })
                    .count()
                    .max(1);
                let base = Duration::from_secs(u64::from(policy.backoff_seconds));
                let backoff = base
                    .saturating_mul(1 << (streak - 1).min(16))
                    .min(MAX_BACKOFF);
                let finished = ended.finished_at.as_ref().map_or(self.obs.now, |t| t.0);
                let waited = self.obs.now.duration_since(finished).unsigned_abs();
                if waited < backoff {
                    let left = backoff - waited;
                    self.d.status.phase = Some(JobPhase::Retrying);
                    self.d.status.message = Some(format!(
                        "attempt {n} {:?}; retrying with the same settings in {}s",
                        ended.outcome,
                        left.as_secs()
                    ));
                    self.condition(
                        CONDITION_RUNNING,
                        false,
                        "BackingOff",
                        &format!("retry in {}s", left.as_secs()),
                    );
                    self.d.requeue_after = Some(left);
                    return;
                }
                let mut same = ended.plan.clone();
                same.rungs_applied.clear();
                same.warnings.clear();
                self.retry(n + 1, same, "the same settings");
            }
            AttemptOutcome::Running | AttemptOutcome::Succeeded => {}
        }
    }

    fn retry(&mut self, number: u32, p: Plan, why: &str) {
        let rungs: Vec<String> = p.rungs_applied.iter().map(ToString::to_string).collect();
        let how = if rungs.is_empty() {
            String::new()
        } else {
            format!(" (rungs: {})", rungs.join(", "))
        };
        self.event(
            false,
            "Retrying",
            format!("attempt {number} with {why}{how}: {}", summary(&p)),
        );
        self.condition(CONDITION_PLANNED, true, "Replanned", &summary(&p));
        self.start_attempt(number, p);
        self.d.status.phase = Some(JobPhase::Retrying);
    }

    fn start_attempt(&mut self, number: u32, p: Plan) {
        self.d.status.attempts.push(Attempt {
            number,
            plan: p.clone(),
            outcome: AttemptOutcome::Running,
            reason: None,
            message: None,
            started_at: Some(Time(self.obs.now)),
            finished_at: None,
            observed_peak_bytes: None,
            last_step: None,
        });
        self.d.status.attempt = Some(number);
        self.d.status.message = Some(format!("attempt {number}: {}", summary(&p)));
        self.d.status.plan = Some(p);
        self.d.status.phase = Some(JobPhase::Pending);
        self.condition(
            CONDITION_RUNNING,
            false,
            "Starting",
            &format!("attempt {number} starting"),
        );
        self.d.launch = Some(number);
    }

    fn fail(&mut self, reason: &'static str, message: String) {
        self.d.status.phase = Some(JobPhase::Failed);
        self.d.status.message = Some(message.clone());
        self.condition(CONDITION_RUNNING, false, reason, "job failed");
        self.condition(CONDITION_FAILED, true, reason, &message);
        self.event(true, reason, message);
        self.d.launch = None;
    }

    fn event(&mut self, warning: bool, reason: &'static str, mut note: String) {
        if note.len() > 1000 {
            let cut = (0..=1000)
                .rev()
                .find(|i| note.is_char_boundary(*i))
                .unwrap_or(0);
            note.truncate(cut);
        }
        self.d.events.push(JobEvent {
            warning,
            reason,
            note,
        });
    }

    /// Sets a condition, keeping lastTransitionTime when the status does not change.
    fn condition(&mut self, type_: &str, status: bool, reason: &str, message: &str) {
        let status = if status { "True" } else { "False" }.to_string();
        let generation = self.obs.job.metadata.generation;
        let now = Time(self.obs.now);
        let conditions = &mut self.d.status.conditions;
        match conditions.iter_mut().find(|c| c.type_ == type_) {
            Some(c) => {
                if c.status != status {
                    c.last_transition_time = now;
                }
                c.status = status;
                c.reason = reason.to_string();
                c.message = message.to_string();
                c.observed_generation = generation;
            }
            None => conditions.push(Condition {
                type_: type_.to_string(),
                status,
                reason: reason.to_string(),
                message: message.to_string(),
                last_transition_time: now,
                observed_generation: generation,
            }),
        }
    }
}

/// The job's planning request, limited to what the worker can run.
fn runnable_request(
    job: &MemoryAwareTrainingJob,
) -> Result<headroom_planner::JobRequest, headroom_api::SpecError> {
    let mut request = job.spec.job_request()?;
    match &mut request.target {
        headroom_planner::Target::Gpu { max_gpus, .. } => {
            *max_gpus = (*max_gpus).min(WORKER_MAX_STAGES)
        }
        headroom_planner::Target::Cpu { max_workers, .. } => {
            *max_workers = (*max_workers).min(WORKER_MAX_STAGES)
        }
    }
    Ok(request)
}

/// What an event can say about an ended attempt's memory. A kernel OOM kill
/// ends the process between telemetry samples, so the last sample is only a
/// lower bound: the kill itself says the limit was reached.
fn peak_note(ended: &Attempt) -> String {
    let limit = ended.plan.device_memory_bytes;
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
    use crate::controller::children::tests::job;
    use headroom_planner::RetryRung;
    use jiff::SignedDuration;

    fn oom_job() -> MemoryAwareTrainingJob {
        let mut j = job(include_str!("../../../samples/cpu-oom-first.yaml"));
        j.metadata.generation = Some(1);
        j
    }

    fn pod(attempt: u32, stage: u32, status: &str) -> Pod {
        serde_yaml::from_str(&format!(
            "metadata: {{name: p-a{attempt}-s{stage}, labels: {{headroom.dev/job: oom-then-fit, headroom.dev/attempt: '{attempt}'}}}}\nstatus:\n{status}"
        ))
        .expect("pod fixture")
    }

    const RUNNING: &str = "  phase: Running";
    const OOM: &str = "  phase: Failed\n  containerStatuses: [{name: worker, image: i, imageID: '', ready: false, restartCount: 0, state: {terminated: {exitCode: 137, reason: OOMKilled}}}]";
    const CRASH: &str = "  phase: Failed\n  containerStatuses: [{name: worker, image: i, imageID: '', ready: false, restartCount: 0, state: {terminated: {exitCode: 2}}}]";
    const DONE: &str = "  phase: Succeeded\n  containerStatuses: [{name: worker, image: i, imageID: '', ready: false, restartCount: 0, state: {terminated: {exitCode: 0}}}]";

    fn step(job: &mut MemoryAwareTrainingJob, pods: &[Pod], now: Timestamp) -> Decision {
        let refs: Vec<&Pod> = pods.iter().collect();
        let inv = Inventory::default();
        let d = decide(&Observation {
            job,
            pods: &refs,
            inventory: &inv,
            now,
            unschedulable_grace: Duration::from_secs(60),
        });
        job.status = Some(d.status.clone());
        d
    }

    fn t0() -> Timestamp {
        "2026-11-21T10:00:00Z".parse().expect("time")
    }

    #[test]
    fn a_new_job_is_planned_and_launched() {
        let mut j = oom_job();
        let d = step(&mut j, &[], t0());
        assert_eq!(d.launch, Some(1));
        assert_eq!(d.status.phase, Some(JobPhase::Pending));
        assert_eq!(d.status.attempts.len(), 1);
        assert_eq!(d.status.attempt, Some(1));
        assert!(
            d.events
                .iter()
                .any(|e| e.reason == "Planned" && e.note.contains("pinned settings"))
        );
        assert_eq!(d.status.observed_generation, Some(1));
        // Deciding again without change does not add attempts.
        let again = step(&mut j, &[], t0());
        assert_eq!(again.status.attempts.len(), 1);
        assert_eq!(again.launch, Some(1));
        assert!(again.events.is_empty());
    }

    #[test]
    fn oom_kill_climbs_the_ladder_and_keeps_history() {
        let mut j = oom_job();
        step(&mut j, &[], t0());
        let running = step(&mut j, &[pod(1, 0, RUNNING)], t0());
        assert_eq!(running.status.phase, Some(JobPhase::Running));
        let d = step(
            &mut j,
            &[pod(1, 0, OOM)],
            t0() + SignedDuration::from_secs(30),
        );
        assert_eq!(d.ended, Some(AttemptOutcome::HostOutOfMemory));
        assert_eq!(d.status.attempts.len(), 2);
        let (first, second) = (&d.status.attempts[0], &d.status.attempts[1]);
        assert_eq!(first.outcome, AttemptOutcome::HostOutOfMemory);
        assert_eq!(first.reason.as_deref(), Some("OOMKilled"));
        assert!(first.finished_at.is_some());
        assert_eq!(second.outcome, AttemptOutcome::Running);
        assert_eq!(second.plan.global_batch, first.plan.global_batch);
        assert!(second.plan.settings.activation_checkpointing);
        assert_eq!(
            second.plan.rungs_applied.first(),
            Some(&RetryRung::ActivationCheckpointing)
        );
        // Attempt 1 was predicted over budget, so the kill proves no under-estimate: no correction.
        assert_eq!(second.plan.correction_factor, 1.0);
        assert_eq!(d.launch, Some(2));
        assert_eq!(d.status.phase, Some(JobPhase::Retrying));
        let reasons: Vec<_> = d.events.iter().map(|e| e.reason).collect();
        assert_eq!(reasons, ["OutOfMemory", "Retrying"]);
        // The failed attempt's pods are gone from consideration: attempt 2 pods drive it now.
        let d = step(
            &mut j,
            &[pod(1, 0, OOM), pod(2, 0, RUNNING)],
            t0() + SignedDuration::from_secs(40),
        );
        assert_eq!(d.status.phase, Some(JobPhase::Running));
        assert_eq!(d.status.attempts.len(), 2);
    }

    #[test]
    fn success_is_final() {
        let mut j = oom_job();
        step(&mut j, &[], t0());
        let d = step(&mut j, &[pod(1, 0, DONE)], t0());
        assert_eq!(d.status.phase, Some(JobPhase::Succeeded));
        assert_eq!(d.status.attempts[0].outcome, AttemptOutcome::Succeeded);
        assert!(
            d.status
                .conditions
                .iter()
                .any(|c| c.type_ == CONDITION_COMPLETE && c.status == "True")
        );
        assert_eq!(d.launch, None);
        // Even a later failure report cannot reopen it.
        let after = step(&mut j, &[pod(1, 0, OOM)], t0());
        assert_eq!(after.status.phase, Some(JobPhase::Succeeded));
        assert!(after.events.is_empty() && after.launch.is_none());
    }

    #[test]
    fn other_failures_retry_the_same_plan_after_backoff() {
        let mut j = oom_job();
        step(&mut j, &[], t0());
        let first_plan = j
            .status
            .as_ref()
            .and_then(|s| s.plan.clone())
            .expect("plan");
        let d = step(&mut j, &[pod(1, 0, CRASH)], t0());
        assert_eq!(d.ended, Some(AttemptOutcome::Failed));
        assert_eq!(d.status.phase, Some(JobPhase::Retrying));
        assert_eq!(d.launch, None);
        assert_eq!(d.requeue_after, Some(Duration::from_secs(10)));
        let waiting = step(
            &mut j,
            &[pod(1, 0, CRASH)],
            t0() + SignedDuration::from_secs(5),
        );
        assert_eq!(waiting.launch, None);
        assert_eq!(waiting.requeue_after, Some(Duration::from_secs(5)));
        let d = step(
            &mut j,
            &[pod(1, 0, CRASH)],
            t0() + SignedDuration::from_secs(10),
        );
        assert_eq!(d.launch, Some(2));
        assert_eq!(
            d.status.attempts[1].plan.settings, first_plan.settings,
            "non-memory failures never tighten settings"
        );
        // A second crash doubles the backoff.
        let d = step(
            &mut j,
            &[pod(1, 0, CRASH), pod(2, 0, CRASH)],
            t0() + SignedDuration::from_secs(20),
        );
        assert_eq!(d.requeue_after, Some(Duration::from_secs(20)));
    }

    #[test]
    fn max_attempts_ends_the_job() {
        let mut j = oom_job();
        j.spec.memory_policy.max_attempts = 1;
        step(&mut j, &[], t0());
        let d = step(&mut j, &[pod(1, 0, OOM)], t0());
        assert_eq!(d.status.phase, Some(JobPhase::Failed));
        assert!(
            d.status
                .message
                .as_deref()
                .is_some_and(|m| m.contains("maxAttempts is 1"))
        );
        assert!(
            d.events
                .iter()
                .any(|e| e.reason == "MaxAttemptsReached" && e.warning)
        );
        assert!(
            d.status
                .conditions
                .iter()
                .any(|c| c.type_ == CONDITION_FAILED && c.status == "True")
        );
    }

    #[test]
    fn no_feasible_plan_fails_without_pods() {
        let mut j = oom_job();
        j.spec.training.micro_batch = None;
        j.spec.training.activation_checkpointing = None;
        j.spec.resources.cpu.as_mut().expect("cpu").memory_limit.0 = "64Mi".into();
        let d = step(&mut j, &[], t0());
        assert_eq!(d.status.phase, Some(JobPhase::Failed));
        assert_eq!(d.launch, None);
        assert!(d.status.attempts.is_empty());
        let msg = d.status.message.expect("message");
        assert!(
            msg.contains("no feasible plan") && msg.contains("budget"),
            "{msg}"
        );
        assert!(
            d.status
                .conditions
                .iter()
                .any(|c| c.type_ == CONDITION_PLANNED
                    && c.status == "False"
                    && c.reason == "NoFeasiblePlan")
        );
    }

    #[test]
    fn unschedulable_beyond_grace_ends_the_attempt() {
        let mut j = oom_job();
        step(&mut j, &[], t0());
        let pending = "  phase: Pending\n  conditions: [{type: PodScheduled, status: 'False', reason: Unschedulable, message: '0/1 nodes available', lastTransitionTime: '2026-11-21T10:00:00Z'}]";
        let early = step(
            &mut j,
            &[pod(1, 0, pending)],
            t0() + SignedDuration::from_secs(20),
        );
        assert_eq!(early.requeue_after, Some(Duration::from_secs(41)));
        assert_eq!(early.launch, Some(1));
        let late = step(
            &mut j,
            &[pod(1, 0, pending)],
            t0() + SignedDuration::from_secs(61),
        );
        assert_eq!(late.ended, Some(AttemptOutcome::Unschedulable));
        assert_eq!(late.delete_pods, vec!["p-a1-s0".to_string()]);
        // The only device type (cpu) is now excluded: nothing else fits.
        assert_eq!(late.status.phase, Some(JobPhase::Failed));
        assert!(late.status.message.expect("msg").contains("unschedulable"));
    }

    #[test]
    fn one_failed_stage_stops_the_others() {
        let mut j = oom_job();
        step(&mut j, &[], t0());
        let d = step(&mut j, &[pod(1, 0, RUNNING), pod(1, 1, OOM)], t0());
        assert_eq!(d.delete_pods, vec!["p-a1-s0".to_string()]);
        assert_eq!(d.ended, Some(AttemptOutcome::HostOutOfMemory));
    }

    #[test]
    fn a_lost_peer_waits_for_the_stage_that_caused_it() {
        const PEER_LOST: &str = "  phase: Failed\n  containerStatuses: [{name: worker, image: i, imageID: '', ready: false, restartCount: 0, state: {terminated: {exitCode: 75, finishedAt: '2026-11-21T10:00:00Z', message: '{\"outcome\":\"peerLost\",\"reason\":\"pipeline stage 1: closed the connection\"}'}}}]";
        let mut j = oom_job();
        step(&mut j, &[], t0());
        // Stage 0 noticed stage 1 go; stage 1's OOM kill is not reported yet.
        let early = step(
            &mut j,
            &[pod(1, 0, PEER_LOST), pod(1, 1, RUNNING)],
            t0() + SignedDuration::from_secs(2),
        );
        assert_eq!(early.ended, None);
        assert!(early.delete_pods.is_empty());
        assert_eq!(early.requeue_after, Some(Duration::from_secs(29)));
        // Then it is: the OOM kill explains the attempt and drives the ladder.
        let d = step(
            &mut j,
            &[pod(1, 0, PEER_LOST), pod(1, 1, OOM)],
            t0() + SignedDuration::from_secs(3),
        );
        assert_eq!(d.ended, Some(AttemptOutcome::HostOutOfMemory));
        // A neighbour that never reports a cause ends the attempt after the grace.
        let mut j = oom_job();
        step(&mut j, &[], t0());
        let late = step(
            &mut j,
            &[pod(1, 0, PEER_LOST), pod(1, 1, RUNNING)],
            t0() + SignedDuration::from_secs(31),
        );
        assert_eq!(late.ended, Some(AttemptOutcome::Failed));
        assert_eq!(late.delete_pods, vec!["p-a1-s1".to_string()]);
    }

    #[test]
    fn the_next_attempt_waits_for_the_last_ones_pods_to_stop() {
        let mut j = oom_job();
        step(&mut j, &[], t0());
        // Stage 1 is OOM-killed; stage 0 is told to stop and is still saving.
        let ended = step(&mut j, &[pod(1, 0, RUNNING), pod(1, 1, OOM)], t0());
        assert_eq!(ended.ended, Some(AttemptOutcome::HostOutOfMemory));
        let waiting = step(&mut j, &[pod(1, 0, RUNNING), pod(1, 1, OOM)], t0());
        assert_eq!(
            waiting.launch, None,
            "no attempt-2 pods while attempt 1 runs"
        );
        assert!(
            waiting
                .status
                .message
                .as_deref()
                .is_some_and(|m| m.contains("p-a1-s0")),
            "{:?}",
            waiting.status.message
        );
        assert_eq!(waiting.requeue_after, Some(Duration::from_secs(2)));
        let gone = step(&mut j, &[pod(1, 1, OOM)], t0());
        assert_eq!(gone.launch, Some(2));
        // A pod stuck terminating on a lost node does not block the retry forever.
        let mut j = oom_job();
        step(&mut j, &[], t0());
        step(&mut j, &[pod(1, 0, RUNNING), pod(1, 1, OOM)], t0());
        let mut stuck = pod(1, 0, RUNNING);
        stuck.metadata.deletion_timestamp = Some(Time(t0()));
        let blocked = step(
            &mut j,
            &[stuck.clone(), pod(1, 1, OOM)],
            t0() + SignedDuration::from_secs(10),
        );
        assert_eq!(blocked.launch, None);
        let later = step(
            &mut j,
            &[stuck, pod(1, 1, OOM)],
            t0() + SignedDuration::from_secs(31),
        );
        assert_eq!(later.launch, Some(2));
    }
}
