//! `spec.activeDeadlineSeconds`: how long a job's attempts may run in all.
//! Each attempt counts from its start to its end (or now, while it runs);
//! the gaps between attempts (backoffs, waits for capacity, suspensions)
//! do not. Past it, the running attempt's workers are stopped and the job
//! fails with `DeadlineExceeded`.

use std::time::Duration;

use headroom_api::{AttemptOutcome, JobPhase};
use jiff::Timestamp;
use kube::ResourceExt;

use super::super::lifecycle::{AttemptEnding, Reason};
use super::attempt::{Verdict, verdict};
use super::{Builder, of_attempt};

impl Builder<'_> {
    /// How long the job's attempts have run, in all.
    fn active_time(&self) -> Duration {
        let now: Timestamp = self.obs.now;
        self.d
            .status
            .attempts
            .iter()
            .filter_map(|a| {
                let start = a.started_at.as_ref()?.0;
                let end = a.finished_at.as_ref().map_or(now, |t| t.0);
                Some(end.duration_since(start).unsigned_abs())
            })
            .sum()
    }

    /// The time left to the deadline, when the job has one.
    fn active_deadline_left(&self) -> Option<Duration> {
        let limit = Duration::from_secs(self.obs.job.spec.active_deadline_seconds?);
        Some(limit.saturating_sub(self.active_time()))
    }

    /// Past `spec.activeDeadlineSeconds`: the running attempt is stopped
    /// and closed, and the job fails. True when it did. An attempt whose
    /// workers all finished by then succeeds instead (its pods say so).
    pub(super) fn past_active_deadline(&mut self) -> bool {
        if self.active_deadline_left() != Some(Duration::ZERO) {
            return false;
        }
        let finished = self
            .d
            .status
            .attempts
            .last()
            .filter(|a| a.outcome == AttemptOutcome::Running)
            .is_some_and(|a| verdict(self.obs, a, &self.d.status.workers) == Verdict::Succeeded);
        if finished {
            return false;
        }
        let limit = self
            .obs
            .job
            .spec
            .active_deadline_seconds
            .unwrap_or_default();
        let message = format!(
            "spec.activeDeadlineSeconds: the attempts ran {limit}s in all, the job's limit; \
             raise it (or remove it) in a new job to train longer"
        );
        if let Some(current) = self
            .d
            .status
            .attempts
            .last()
            .filter(|a| a.outcome == AttemptOutcome::Running)
            .cloned()
        {
            self.d.delete_pods = of_attempt(self.obs.pods, current.number)
                .filter(|p| p.metadata.deletion_timestamp.is_none())
                .map(|p| p.name_any())
                .collect();
            self.close_attempt(AttemptEnding::new(
                AttemptOutcome::Failed,
                Reason::DeadlineExceeded.as_str(),
                message.clone(),
            ));
        }
        self.fail(Reason::DeadlineExceeded, message);
        true
    }

    /// A job with a deadline that has not ended is looked at again when
    /// the deadline comes, if nothing brings it back sooner.
    pub(super) fn look_again_at_the_deadline(&mut self) {
        if matches!(
            self.d.status.phase,
            Some(JobPhase::Succeeded | JobPhase::Failed)
        ) || self.obs.job.spec.suspend
        {
            return;
        }
        let running = self
            .d
            .status
            .attempts
            .last()
            .is_some_and(|a| a.outcome == AttemptOutcome::Running);
        if let Some(left) = self.active_deadline_left().filter(|_| running) {
            let at = left + Duration::from_secs(1);
            self.d.requeue_after = Some(self.d.requeue_after.map_or(at, |r| r.min(at)));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use headroom_api::AttemptOutcome;

    use super::super::fixtures::*;

    /// The attempts' running time is summed across attempts, the gap
    /// between them left out; past the deadline the running workers are
    /// stopped and the job fails with DeadlineExceeded, naming the field.
    #[test]
    fn a_job_fails_once_its_attempts_ran_the_deadline_in_all() {
        let mut j = oom_job();
        j.spec.active_deadline_seconds = Some(600);
        let at = |s: i64| t0() + SignedDuration::from_secs(s);
        step(&mut j, &[], at(0));
        let d = step(&mut j, &[pod(1, 0, RUNNING)], at(100));
        assert!(
            d.requeue_after
                .is_some_and(|r| r <= Duration::from_secs(501)),
            "looked at again by the deadline: {:?}",
            d.requeue_after
        );
        // Attempt 1 ran 300 s and crashed; after its backoff, attempt 2
        // starts at 400 s.
        let d = step(&mut j, &[pod(1, 0, CRASH)], at(300));
        assert_eq!(launched(&d), None, "backing off");
        let d = step(&mut j, &[pod(1, 0, CRASH)], at(400));
        assert_eq!(launched(&d), Some(2));
        // 650 s by the clock, but the 100 s between the attempts do not
        // count: 300 s + 250 s.
        let d = step(&mut j, &[pod(1, 0, CRASH), pod(2, 0, RUNNING)], at(650));
        assert_ne!(d.status.phase, Some(JobPhase::Failed));
        assert!(d.delete_pods.is_empty());
        let d = step(&mut j, &[pod(1, 0, CRASH), pod(2, 0, RUNNING)], at(701));
        assert_eq!(
            d.status.phase,
            Some(JobPhase::Failed),
            "{:?}",
            d.status.message
        );
        assert_eq!(d.delete_pods, ["p-a2-s0"]);
        assert!(has_condition(
            &d.status,
            ConditionType::Failed,
            true,
            Reason::DeadlineExceeded
        ));
        assert_eq!(d.status.attempts[1].outcome, AttemptOutcome::Failed);
        assert!(
            d.status
                .message
                .as_deref()
                .is_some_and(|m| m.contains("spec.activeDeadlineSeconds")),
            "{:?}",
            d.status.message
        );
    }

    /// Workers that finished by the deadline: the job succeeds.
    #[test]
    fn workers_done_by_the_deadline_succeed() {
        let mut j = oom_job();
        j.spec.active_deadline_seconds = Some(60);
        let at = |s: i64| t0() + SignedDuration::from_secs(s);
        step(&mut j, &[], at(0));
        step(&mut j, &[pod(1, 0, RUNNING)], at(10));
        let d = step(&mut j, &[pod(1, 0, DONE)], at(90));
        assert_eq!(
            d.status.phase,
            Some(JobPhase::Succeeded),
            "{:?}",
            d.status.message
        );
    }

    /// Without a deadline nothing changes, however long it runs.
    #[test]
    fn without_a_deadline_a_job_runs_as_long_as_it_takes() {
        let mut j = oom_job();
        step(&mut j, &[], t0());
        step(&mut j, &[pod(1, 0, RUNNING)], t0());
        let later = t0() + SignedDuration::from_hours(1000);
        let d = step(&mut j, &[pod(1, 0, RUNNING)], later);
        assert_ne!(d.status.phase, Some(JobPhase::Failed));
        assert!(d.delete_pods.is_empty());
    }
}
