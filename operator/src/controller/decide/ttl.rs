//! `spec.ttlSecondsAfterFinished`: a job that ended (Succeeded or Failed)
//! is deleted that long after, as batch/v1 Job's TTL-after-finished
//! controller does. The checkpoint claim is not this module's: a claim the
//! retention keeps was released when the job ended, and one it does not
//! goes with the job (its owner).

use std::time::Duration;

use super::super::lifecycle::ConditionType;
use super::Builder;

impl Builder<'_> {
    /// An ended job: delete it once its TTL has passed since it ended (the
    /// `Complete` or `Failed` condition's transition), else look again then.
    pub(super) fn expire(&mut self) {
        let Some(ttl) = self.obs.job.spec.ttl_seconds_after_finished else {
            return;
        };
        let ended = self
            .d
            .status
            .conditions
            .iter()
            .find(|c| {
                (c.type_ == ConditionType::Complete.as_str()
                    || c.type_ == ConditionType::Failed.as_str())
                    && c.status == "True"
            })
            .map(|c| c.last_transition_time.0);
        // Always written with the end; a status without it expires now.
        let since = ended.map_or(Duration::ZERO, |at| {
            self.obs.now.duration_since(at).unsigned_abs()
        });
        let ttl = Duration::from_secs(u64::from(ttl));
        if ended.is_none() || since >= ttl {
            self.d.delete_job = true;
        } else {
            self.d.requeue_after = Some(ttl - since + Duration::from_secs(1));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::super::fixtures::*;

    /// A finished job is deleted its TTL after it ended, not before; one
    /// without a TTL is kept; a running one never is.
    #[test]
    fn a_finished_job_is_deleted_its_ttl_after_it_ended() {
        let mut j = oom_job();
        j.spec.ttl_seconds_after_finished = Some(60);
        let at = |s: i64| t0() + SignedDuration::from_secs(s);
        step(&mut j, &[], at(0));
        let d = step(&mut j, &[pod(1, 0, RUNNING)], at(10));
        assert!(!d.delete_job, "running");
        let d = step(&mut j, &[pod(1, 0, DONE)], at(20));
        assert_eq!(d.status.phase, Some(JobPhase::Succeeded));
        assert!(!d.delete_job, "ended just now");
        let d = step(&mut j, &[pod(1, 0, DONE)], at(50));
        assert!(!d.delete_job);
        assert_eq!(d.requeue_after, Some(Duration::from_secs(31)));
        let d = step(&mut j, &[pod(1, 0, DONE)], at(80));
        assert!(d.delete_job, "60 s after it ended");

        j.spec.ttl_seconds_after_finished = None;
        let d = step(&mut j, &[pod(1, 0, DONE)], at(100_000));
        assert!(!d.delete_job, "no TTL: kept");
    }

    /// A failed job expires too (TTL 0: at once, the next time it is seen).
    #[test]
    fn a_failed_job_expires_too() {
        let mut j = oom_job();
        j.spec.ttl_seconds_after_finished = Some(0);
        j.spec.memory_policy.max_attempts = 1;
        step(&mut j, &[], t0());
        let d = step(&mut j, &[pod(1, 0, CRASH)], t0());
        assert_eq!(
            d.status.phase,
            Some(JobPhase::Failed),
            "{:?}",
            d.status.message
        );
        let d = step(&mut j, &[pod(1, 0, CRASH)], t0());
        assert!(d.delete_job);
    }
}
