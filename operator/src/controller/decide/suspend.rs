//! `spec.suspend`: no worker pods while it is true. A running attempt ends
//! as disrupted (its workers checkpoint on SIGTERM), so that resuming starts
//! the next attempt at once, from the last checkpoint, with no attempt used
//! up, as after an eviction.

use headroom_api::AttemptOutcome;
use kube::ResourceExt;

use super::super::lifecycle::{AttemptEnding, ConditionType, SUSPENDED_ENDING, Transition};
use super::{Builder, of_attempt};

impl Builder<'_> {
    /// The job is suspended: the running attempt's pods are stopped and
    /// the attempt closed; nothing is planned or launched.
    pub(super) fn suspend(&mut self) {
        if let Some(current) = self
            .d
            .status
            .attempts
            .last()
            .filter(|a| a.outcome == AttemptOutcome::Running)
            .cloned()
        {
            let n = current.number;
            self.d.delete_pods = of_attempt(self.obs.pods, n)
                .filter(|p| p.metadata.deletion_timestamp.is_none())
                .map(|p| p.name_any())
                .collect();
            self.close_attempt(AttemptEnding::new(
                AttemptOutcome::Disrupted,
                SUSPENDED_ENDING,
                format!(
                    "spec.suspend: attempt {n}'s workers were stopped; the next attempt goes on from the last checkpoint"
                ),
            ));
        }
        self.enter(Transition::Suspended);
    }

    /// A job that was suspended and no longer is says so; the decision
    /// then goes on as for any job (after a suspended attempt: the next).
    pub(super) fn resume(&mut self) {
        let suspended = self
            .d
            .status
            .conditions
            .iter()
            .any(|c| c.type_ == ConditionType::Suspended.as_str() && c.status == "True");
        if suspended {
            self.enter(Transition::Resumed);
        }
    }
}

#[cfg(test)]
mod tests {
    use headroom_api::AttemptOutcome;

    use super::super::fixtures::*;

    /// Suspending a running job stops its workers and closes the attempt
    /// as disrupted, with no new attempt while suspended; resuming starts
    /// the next attempt at once, and a suspension costs no attempt.
    #[test]
    fn a_suspended_job_runs_no_workers_and_resumes_without_using_an_attempt() {
        let mut j = oom_job();
        j.spec.memory_policy.max_attempts = 1;
        step(&mut j, &[], t0());
        step(&mut j, &[pod(1, 0, RUNNING)], t0());

        j.spec.suspend = true;
        let d = step(&mut j, &[pod(1, 0, RUNNING)], t0());
        assert_eq!(d.delete_pods, ["p-a1-s0"], "the running worker is stopped");
        assert_eq!(launched(&d), None);
        assert_eq!(d.status.attempts[0].outcome, AttemptOutcome::Disrupted);
        assert_eq!(d.status.attempts[0].reason.as_deref(), Some("Suspended"));
        assert_eq!(d.status.phase, Some(JobPhase::Pending));
        assert!(has_condition(
            &d.status,
            ConditionType::Suspended,
            true,
            Reason::Suspended
        ));
        assert!(has_condition(
            &d.status,
            ConditionType::Running,
            false,
            Reason::Suspended
        ));
        assert_eq!(d.events.len(), 1, "{:?}", d.events);
        // Still suspended, the worker gone: nothing starts, no new event.
        let d = step(&mut j, &[], t0());
        assert_eq!(
            (launched(&d), d.delete_pods.len(), d.events.len()),
            (None, 0, 0)
        );
        assert_eq!(d.status.attempts.len(), 1);

        j.spec.suspend = false;
        let d = step(&mut j, &[], t0());
        assert_eq!(
            launched(&d),
            Some(2),
            "goes on at once, maxAttempts 1 notwithstanding"
        );
        assert!(has_condition(
            &d.status,
            ConditionType::Suspended,
            false,
            Reason::Resumed
        ));
        assert!(d.events.iter().any(|e| e.reason == Reason::Resumed));
    }

    /// A job suspended before its first attempt plans nothing until resumed.
    #[test]
    fn a_job_created_suspended_starts_when_resumed() {
        let mut j = oom_job();
        j.spec.suspend = true;
        let d = step(&mut j, &[], t0());
        assert_eq!(launched(&d), None);
        assert!(d.status.attempts.is_empty());
        assert!(has_condition(
            &d.status,
            ConditionType::Suspended,
            true,
            Reason::Suspended
        ));
        j.spec.suspend = false;
        let d = step(&mut j, &[], t0());
        assert_eq!(launched(&d), Some(1));
    }
}
