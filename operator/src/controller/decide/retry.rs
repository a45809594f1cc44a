//! After an attempt ends: record it (through [`lifecycle::enter`](super::super::lifecycle::enter)),
//! then choose the next one — stricter after running out of memory, the same
//! after a disruption, the same after a backoff for other failures, another
//! device type when the pods cannot be scheduled — or wait for capacity, or
//! end the job.

use std::time::Duration;

use headroom_api::{Attempt, AttemptOutcome, WorkerOutcome};
use headroom_planner::{FailureCause, JobRequest, MemoryFailure, MemoryFailureKind};

use super::super::lifecycle::{AttemptEnding, ConditionType, Reason, Transition};
use super::Builder;

/// Longest wait between retries of non-memory failures.
const MAX_BACKOFF: Duration = Duration::from_secs(3600);
/// How often a job waiting for capacity plans again (node and pod changes
/// bring it back sooner).
const CAPACITY_POLL: Duration = Duration::from_secs(30);

/// Why a job whose planning ran past `budget` failed, and what would let
/// it plan: a narrower search, or a larger budget.
fn out_of_time(budget: Duration) -> String {
    format!(
        "planning this job took longer than the operator's time budget of {budget:?} \
         (--planning-budget-seconds, the chart's planningBudgetSeconds); narrow the search \
         (pin training.pipelineStages, training.dataParallelReplicas or training.microBatch, \
         lower resources.gpu.maxGpus, list fewer resources.gpu.types) or have the operator's \
         administrator raise the budget"
    )
}

impl Builder<'_> {
    /// Records how the running attempt ended, then moves on. `worker`: what
    /// its worker said, when it said anything.
    pub(super) fn end_attempt(
        &mut self,
        ending: AttemptEnding,
        worker: Option<WorkerOutcome>,
        request: &JobRequest,
    ) {
        if let Some(ended) = self.close_attempt(ending) {
            self.after_attempt(&ended, worker, request);
        }
    }

    /// Records how the running attempt ended, without moving on: the
    /// lifecycle closes it, as it opened it.
    pub(super) fn close_attempt(&mut self, ending: AttemptEnding) -> Option<Attempt> {
        let outcome = ending.outcome;
        self.enter(Transition::AttemptEnded(ending));
        let ended = self.d.status.attempts.last().cloned()?;
        self.d.ended = Some(outcome);
        Some(ended)
    }

    /// Chooses and starts the next attempt after `ended`, or ends the job.
    /// `worker`: what the ended attempt's worker said, when this reconcile saw it end.
    pub(super) fn after_attempt(
        &mut self,
        ended: &Attempt,
        worker: Option<WorkerOutcome>,
        request: &JobRequest,
    ) {
        let n = ended.number;
        if ended.outcome == AttemptOutcome::Succeeded {
            return self.succeed(n);
        }
        if worker == Some(WorkerOutcome::InvalidPlan) {
            return self.fail(
                Reason::InvalidPlan,
                format!(
                    "the worker rejected attempt {n}'s plan: {}",
                    ended.message.clone().unwrap_or_default()
                ),
            );
        }
        if let Some(message) = self.attempts_used_up(ended) {
            return self.fail(Reason::MaxAttemptsReached, message);
        }
        let (cause, why) = match ended.outcome {
            AttemptOutcome::HostOutOfMemory
            | AttemptOutcome::DeviceOutOfMemory
            | AttemptOutcome::NearOutOfMemory => (
                FailureCause::OutOfMemory(self.memory_failure(ended)),
                "stricter settings",
            ),
            AttemptOutcome::Unschedulable => return self.retry_unschedulable(n, request),
            AttemptOutcome::DiskFull => return self.after_disk_full(ended, request),
            // Resume at once: nothing failed, and the checkpoint is there.
            AttemptOutcome::Disrupted => (FailureCause::Other, "the same settings"),
            AttemptOutcome::Failed => {
                if let Some(left) = self.backoff_left(ended) {
                    self.enter(Transition::BackingOff {
                        attempt: n,
                        outcome: ended.outcome,
                        left,
                    });
                    self.d.requeue_after = Some(left);
                    return;
                }
                (FailureCause::Other, "the same settings")
            }
            AttemptOutcome::Running | AttemptOutcome::Succeeded => return,
        };
        match self.replan_current(request, &cause) {
            Ok(p) => self.start(n + 1, p, Some(why.to_string())),
            Err(e) => self.no_plan(e),
        }
    }

    /// The failure message when `ended` used up `memoryPolicy.maxAttempts`.
    /// Disruptions (a deleted or evicted pod, a drained node) are not the
    /// job's doing and lose no work (the worker checkpoints on SIGTERM):
    /// they do not use up attempts.
    fn attempts_used_up(&self, ended: &Attempt) -> Option<String> {
        let max_attempts = self.obs.job.spec.memory_policy.max_attempts;
        let counted = self
            .d
            .status
            .attempts
            .iter()
            .filter(|a| a.outcome != AttemptOutcome::Disrupted)
            .count();
        (ended.outcome != AttemptOutcome::Disrupted && counted >= max_attempts as usize).then(
            || {
                format!(
                    "attempt {} ended {:?} ({}); memoryPolicy.maxAttempts is {max_attempts}",
                    ended.number,
                    ended.outcome,
                    ended.message.clone().unwrap_or_default(),
                )
            },
        )
    }

    /// What the replan learns from an attempt that ran out of memory.
    fn memory_failure(&self, ended: &Attempt) -> MemoryFailure {
        let kind = match ended.outcome {
            AttemptOutcome::DeviceOutOfMemory => MemoryFailureKind::DeviceOom,
            AttemptOutcome::NearOutOfMemory => MemoryFailureKind::NearOom,
            _ => MemoryFailureKind::HostOom,
        };
        // A step past where the attempt started (the previous attempt's
        // last step bounds its checkpoint from above).
        let started_at = self
            .d
            .status
            .attempts
            .iter()
            .rev()
            .skip(1)
            .find_map(|a| a.last_step)
            .unwrap_or(0);
        MemoryFailure {
            kind,
            observed_peak_bytes: ended.observed_peak_bytes,
            trained: ended.last_step.is_some_and(|s| s > started_at),
        }
    }

    /// After attempt `n`'s pods could not be scheduled: another device type
    /// if one fits; else the same plan again, waiting for the capacity (a
    /// busy cluster never ends a job).
    fn retry_unschedulable(&mut self, n: u32, request: &JobRequest) {
        let cause = FailureCause::Unschedulable {
            excluded_devices: self.unschedulable_devices(),
        };
        match self.replan_current(request, &cause) {
            Ok(p) => self.start(n + 1, p, Some("another device type".into())),
            Err(_) => match self.replan_current(request, &FailureCause::Other) {
                Ok(p) => self.start(n + 1, p, Some("the same plan, waiting for capacity".into())),
                Err(e) => self.no_plan(e),
            },
        }
    }

    /// How much longer to wait before retrying a failed attempt (`ended`),
    /// None when the backoff is over: exponential over consecutive failures
    /// (disruptions between them neither count nor break the streak).
    fn backoff_left(&self, ended: &Attempt) -> Option<Duration> {
        let streak = self
            .d
            .status
            .attempts
            .iter()
            .rev()
            .filter(|a| a.outcome != AttemptOutcome::Disrupted)
            .take_while(|a| a.outcome == AttemptOutcome::Failed)
            .count()
            .max(1);
        let base = Duration::from_secs(u64::from(self.obs.job.spec.memory_policy.backoff_seconds));
        let backoff = base
            .saturating_mul(1 << (streak - 1).min(16))
            .min(MAX_BACKOFF);
        let finished = ended.finished_at.as_ref().map_or(self.obs.now, |t| t.0);
        let waited = self.obs.now.duration_since(finished).unsigned_abs();
        (waited < backoff).then(|| backoff - waited)
    }

    /// No plan fits now: wait if one fits the cluster once busy devices are
    /// free, else fail with the numbers.
    pub(super) fn no_plan(&mut self, e: headroom_planner::NoFeasiblePlan) {
        if let Some(budget) = e.out_of_time {
            return self.fail(Reason::NoFeasiblePlan, out_of_time(budget));
        }
        match e.waits_for.clone() {
            Some(what) => {
                let waiting = format!("needs {what}");
                match self.past_deadline(&waiting) {
                    Some(late) => self.fail(Reason::WaitedTooLong, late),
                    None => self.wait_for_capacity(waiting),
                }
            }
            None => self.fail(Reason::NoFeasiblePlan, e.to_string()),
        }
    }

    /// Device types this job's pods could not be scheduled on, so far (the
    /// current attempt's included).
    pub(super) fn unschedulable_devices(&self) -> Vec<String> {
        let status = &self.d.status;
        let mut out: Vec<String> = status
            .attempts
            .iter()
            .filter(|a| {
                a.outcome == AttemptOutcome::Unschedulable
                    || (a.outcome == AttemptOutcome::Running
                        && Some(a.number) == status.attempts.last().map(|l| l.number))
            })
            .map(|a| a.device.clone())
            .collect();
        out.dedup();
        out
    }

    /// Waits for capacity: the condition and event say for what; look again
    /// in a while (node and pod changes also bring the job back).
    pub(super) fn wait_for_capacity(&mut self, message: String) {
        self.enter(Transition::WaitingForCapacity { message });
        let left = self
            .deadline_left()
            .map_or(CAPACITY_POLL, |left| left.min(CAPACITY_POLL));
        self.d.requeue_after = Some(left + Duration::from_secs(1));
    }

    /// How long the job may still wait (`spec.scheduling.maxWaitSeconds`,
    /// counted from when it started waiting), if it has a deadline.
    fn deadline_left(&self) -> Option<Duration> {
        let max = Duration::from_secs(self.obs.job.spec.scheduling.max_wait_seconds?);
        let since = self
            .d
            .status
            .conditions
            .iter()
            .find(|c| c.type_ == ConditionType::Waiting.as_str() && c.status == "True")
            .map_or(self.obs.now, |c| c.last_transition_time.0);
        let waited = self.obs.now.duration_since(since).unsigned_abs();
        Some(max.saturating_sub(waited))
    }

    /// The failure message when the deadline has passed while waiting for `what`.
    pub(super) fn past_deadline(&self, what: &str) -> Option<String> {
        let max = self.obs.job.spec.scheduling.max_wait_seconds?;
        (self.deadline_left()? == Duration::ZERO)
            .then(|| format!("waited {max}s for capacity (spec.scheduling.maxWaitSeconds): {what}"))
    }
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::*;
    use super::*;

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
        assert_eq!(
            second.settings.global_batch(),
            first.settings.global_batch()
        );
        assert!(second.settings.activation_checkpointing);
        assert_eq!(
            second.rungs_applied.first(),
            Some(&RetryRung::ActivationCheckpointing)
        );
        // The current attempt's whole plan is status.plan, and only there.
        let plan = d.status.plan.as_ref().expect("plan");
        assert_eq!(second.settings, plan.settings);
        assert_eq!(second.predicted_peak_bytes, plan.predicted_peak_bytes);
        // Attempt 1 was predicted over budget, so the kill proves no under-estimate: no correction.
        assert_eq!(plan.correction_factor, 1.0);
        assert_eq!(launched(&d), Some(2));
        assert_eq!(d.status.phase, Some(JobPhase::Retrying));
        let reasons: Vec<_> = d.events.iter().map(|e| e.reason).collect();
        assert_eq!(reasons, [Reason::OutOfMemory, Reason::Retrying]);
        // The failed attempt's pods are gone from consideration: attempt 2 pods drive it now.
        let d = step(
            &mut j,
            &[pod(1, 0, OOM), pod(2, 0, RUNNING)],
            t0() + SignedDuration::from_secs(40),
        );
        assert_eq!(d.status.phase, Some(JobPhase::Running));
        assert_eq!(d.status.attempts.len(), 2);
    }

    /// The guard's stop is its own outcome and event, climbs the ladder as
    /// an OOM does, and says where the last completed step is; what it
    /// would have reached is the attempt's observed peak.
    #[test]
    fn a_guard_stop_is_its_own_outcome_and_climbs_the_ladder() {
        let mut j = oom_job();
        step(&mut j, &[], t0());
        step(&mut j, &[pod(1, 0, RUNNING)], t0());
        let message = r#"{"outcome":"nearOutOfMemory","reason":"memory guard: step 5 stopped before the backward of micro-batch 0: ...; step 4 checkpointed to /checkpoints/step-4","step":4,"peakBytes":400000000,"requestedBytes":90000000}"#;
        let stopped = pod(
            1,
            0,
            &terminated(headroom_api::exit_code::NEAR_OUT_OF_MEMORY, message),
        );
        let d = step(&mut j, &[stopped], t0() + SignedDuration::from_secs(30));
        assert_eq!(d.ended, Some(AttemptOutcome::NearOutOfMemory));
        let (first, second) = (&d.status.attempts[0], &d.status.attempts[1]);
        assert_eq!(first.reason.as_deref(), Some("NearOutOfMemory"));
        assert_eq!(first.last_step, Some(4));
        assert_eq!(first.observed_peak_bytes, Some(400_000_000));
        assert!(
            first
                .message
                .as_deref()
                .unwrap_or("")
                .contains("step 4 checkpointed")
        );
        assert!(second.settings.activation_checkpointing, "{second:?}");
        assert_eq!(
            second.settings.global_batch(),
            first.settings.global_batch()
        );
        let reasons: Vec<_> = d.events.iter().map(|e| e.reason).collect();
        assert_eq!(reasons, [Reason::NearOutOfMemory, Reason::Retrying]);
    }

    /// A worker that stepped down in place: the attempt records what it
    /// runs now, with one event.
    #[test]
    fn a_step_down_in_place_is_recorded_once() {
        let mut j = oom_job();
        step(&mut j, &[], t0());
        let d = step(&mut j, &[pod(1, 0, RUNNING)], t0());
        let planned = d.status.attempts[0].settings;
        let mut report: headroom_api::WorkerTelemetry = serde_json::from_value(serde_json::json!({
            "name": "p-a1-s0", "attempt": 1, "stage": 0, "layerStart": 0, "layerEnd": 1, "step": 0,
            "memory": {"peakBytes": 1}, "updatedAt": "2026-11-26T10:00:00Z",
            "steppedDown": {"microBatch": planned.micro_batch / 2, "gradientAccumulation": planned.gradient_accumulation * 2}
        }))
        .expect("telemetry");
        let status = j.status.get_or_insert_with(Default::default);
        status.workers = vec![report.clone()];
        let d = step(&mut j, &[pod(1, 0, RUNNING)], t0());
        let now = d.status.attempts[0].settings;
        assert_eq!(
            (now.micro_batch, now.gradient_accumulation),
            (planned.micro_batch / 2, planned.gradient_accumulation * 2)
        );
        let stepped: Vec<_> = d
            .events
            .iter()
            .filter(|e| e.reason == Reason::SteppedDown)
            .collect();
        assert_eq!(stepped.len(), 1, "{:?}", d.events);
        // Seen again: nothing new.
        report.step = 3;
        j.status.get_or_insert_with(Default::default).workers = vec![report];
        let d = step(&mut j, &[pod(1, 0, RUNNING)], t0());
        assert!(d.events.iter().all(|e| e.reason != Reason::SteppedDown));
    }

    #[test]
    fn success_is_final() {
        let mut j = oom_job();
        step(&mut j, &[], t0());
        let d = step(&mut j, &[pod(1, 0, DONE)], t0());
        assert_eq!(d.status.phase, Some(JobPhase::Succeeded));
        assert_eq!(d.status.attempts[0].outcome, AttemptOutcome::Succeeded);
        assert!(has_condition(
            &d.status,
            ConditionType::Complete,
            true,
            Reason::Succeeded
        ));
        assert_eq!(launched(&d), None);
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
        assert_eq!(launched(&d), None);
        assert_eq!(d.requeue_after, Some(Duration::from_secs(10)));
        let waiting = step(
            &mut j,
            &[pod(1, 0, CRASH)],
            t0() + SignedDuration::from_secs(5),
        );
        assert_eq!(launched(&waiting), None);
        assert_eq!(waiting.requeue_after, Some(Duration::from_secs(5)));
        let d = step(
            &mut j,
            &[pod(1, 0, CRASH)],
            t0() + SignedDuration::from_secs(10),
        );
        assert_eq!(launched(&d), Some(2));
        assert_eq!(
            d.status.attempts[1].settings, first_plan.settings,
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
                .any(|e| e.reason == Reason::MaxAttemptsReached && e.warning)
        );
        assert!(has_condition(
            &d.status,
            ConditionType::Failed,
            true,
            Reason::MaxAttemptsReached
        ));
    }

    #[test]
    fn no_feasible_plan_fails_without_pods() {
        let mut j = oom_job();
        j.spec.training.micro_batch = None;
        j.spec.training.activation_checkpointing = None;
        j.spec.resources.cpu.as_mut().expect("cpu").memory_limit.0 = "64Mi".into();
        // 8-bit AdamW state would just fit this model in 64Mi; without it nothing does.
        j.spec.memory_policy.allowed_rungs = vec![
            headroom_planner::RetryRung::ActivationCheckpointing,
            headroom_planner::RetryRung::HalveMicroBatch,
        ];
        let d = step(&mut j, &[], t0());
        assert_eq!(d.status.phase, Some(JobPhase::Failed));
        assert_eq!(launched(&d), None);
        assert!(d.status.attempts.is_empty());
        let msg = d.status.message.clone().expect("message");
        assert!(
            msg.contains("no feasible plan") && msg.contains("budget"),
            "{msg}"
        );
        assert!(has_condition(
            &d.status,
            ConditionType::Planned,
            false,
            Reason::NoFeasiblePlan
        ));
    }

    #[test]
    fn an_unschedulable_cpu_job_waits_instead_of_failing() {
        // A busy node (or a volume still being provisioned): the scheduler
        // says no for now. No other device type exists for a CPU job, so it
        // waits with its pods in place: never a failure caused by a busy cluster.
        let mut j = oom_job();
        step(&mut j, &[], t0());
        let pending = "  phase: Pending\n  conditions: [{type: PodScheduled, status: 'False', reason: Unschedulable, message: '0/1 nodes are available: 1 Insufficient cpu', lastTransitionTime: '2026-11-21T10:00:00Z'}]";
        let early = step(
            &mut j,
            &[pod(1, 0, pending)],
            t0() + SignedDuration::from_secs(20),
        );
        assert_eq!(early.requeue_after, Some(Duration::from_secs(41)));
        assert_eq!(launched(&early), Some(1));
        let late = step(
            &mut j,
            &[pod(1, 0, pending)],
            t0() + SignedDuration::from_secs(61),
        );
        assert_eq!(late.ended, None);
        assert!(
            late.delete_pods.is_empty(),
            "the pods keep their place in the queue"
        );
        assert_eq!(launched(&late), Some(1));
        assert_eq!(late.status.phase, Some(JobPhase::Pending));
        assert!(has_condition(
            &late.status,
            ConditionType::Waiting,
            true,
            Reason::WaitingForCapacity
        ));
        let e = late
            .events
            .iter()
            .find(|e| e.reason == Reason::WaitingForCapacity);
        assert!(
            e.is_some_and(|e| e.note.contains("Insufficient cpu")),
            "{:?}",
            late.events
        );
        // Still waiting later: no new event, no failure.
        let later = step(
            &mut j,
            &[pod(1, 0, pending)],
            t0() + SignedDuration::from_secs(3600),
        );
        assert_eq!(later.status.phase, Some(JobPhase::Pending));
        assert!(later.events.is_empty(), "{:?}", later.events);
        // Scheduled at last: Waiting turns False.
        let running = step(
            &mut j,
            &[pod(1, 0, RUNNING)],
            t0() + SignedDuration::from_secs(3700),
        );
        assert_eq!(running.status.phase, Some(JobPhase::Running));
        assert!(has_condition(
            &running.status,
            ConditionType::Waiting,
            false,
            Reason::CapacityAvailable
        ));
    }

    #[test]
    fn a_deadline_ends_the_wait() {
        let mut j = oom_job();
        j.spec.scheduling.max_wait_seconds = Some(600);
        step(&mut j, &[], t0());
        let pending = "  phase: Pending\n  conditions: [{type: PodScheduled, status: 'False', reason: Unschedulable, message: '0/1 nodes are available', lastTransitionTime: '2026-11-21T10:00:00Z'}]";
        let waiting = step(
            &mut j,
            &[pod(1, 0, pending)],
            t0() + SignedDuration::from_secs(61),
        );
        assert_eq!(waiting.status.phase, Some(JobPhase::Pending));
        assert_eq!(waiting.requeue_after, Some(Duration::from_secs(31)));
        let late = step(
            &mut j,
            &[pod(1, 0, pending)],
            t0() + SignedDuration::from_secs(61 + 600),
        );
        assert_eq!(late.status.phase, Some(JobPhase::Failed));
        assert!(has_condition(
            &late.status,
            ConditionType::Failed,
            true,
            Reason::WaitedTooLong
        ));
        assert_eq!(
            late.status.attempts[0].outcome,
            AttemptOutcome::Unschedulable
        );
        assert_eq!(late.delete_pods, vec!["p-a1-s0".to_string()]);
        assert!(
            late.status
                .message
                .as_deref()
                .is_some_and(|m| m.contains("maxWaitSeconds")),
            "{:?}",
            late.status.message
        );
    }
}
