//! The API server refused what a decision asked for (an initializer pod, an
//! attempt's workers): the one decision that follows, for either.

use headroom_api::{AttemptOutcome, MemoryAwareTrainingJob};
use jiff::Timestamp;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;

use super::super::LaunchRefusal;
use super::super::lifecycle::{AttemptEnding, Reason, Stamp, Transition, enter};
use super::{Decision, of_attempt};

/// What the API server refused.
#[derive(Clone, Copy, Debug)]
pub enum Refused<'a> {
    /// Initializer run `run`'s pod.
    Initializer { run: u32 },
    /// Attempt `attempt`'s children; `pods` are the job's pods (those of the
    /// attempt that did get created are stopped if the refusal is final).
    Launch { attempt: u32, pods: &'a [&'a Pod] },
}

/// The decision after the API server refused `what`, given what reconcile
/// had just decided and applied (`decided`). A refusal that can pass (a
/// quota, a server error) is reported (condition, event) and asked again
/// later; one that cannot (400, 422: the pods are a pure function of the
/// spec) ends the attempt and the job with the server's words.
pub fn refused(
    decided: &Decision,
    job: &MemoryAwareTrainingJob,
    what: Refused<'_>,
    refusal: &LaunchRefusal,
    now: Timestamp,
) -> Decision {
    let mut d = Decision::keep(decided.status.clone());
    let said = format!("{} ({} {})", refusal.message, refusal.code, refusal.object);
    let moves = match (what, refusal.heals) {
        (Refused::Initializer { .. }, true) => {
            vec![Transition::InitializerRefused { message: said }]
        }
        (Refused::Initializer { run }, false) => vec![Transition::Failed {
            reason: Reason::LaunchRefused,
            message: format!(
                "initializer run {run}: the API server refused the initializer pod, and would again: {said}"
            ),
        }],
        (Refused::Launch { attempt, .. }, true) => vec![Transition::LaunchRefused {
            attempt,
            message: said,
        }],
        (Refused::Launch { attempt, pods }, false) => {
            d.delete_pods = of_attempt(pods, attempt).map(|p| p.name_any()).collect();
            let mut moves = Vec::new();
            let running = d
                .status
                .attempts
                .last()
                .is_some_and(|a| a.number == attempt && a.outcome == AttemptOutcome::Running);
            if running {
                moves.push(Transition::AttemptEnded(AttemptEnding::new(
                    AttemptOutcome::Failed,
                    Reason::LaunchRefused.as_str(),
                    said.clone(),
                )));
                d.ended = Some(AttemptOutcome::Failed);
            }
            moves.push(Transition::Failed {
                reason: Reason::LaunchRefused,
                message: format!(
                    "attempt {attempt}: the API server refused the workers, and would again: {said}"
                ),
            });
            moves
        }
    };
    let at = Stamp {
        now,
        generation: job.metadata.generation,
    };
    for to in moves {
        if let Ok(Some(event)) = enter(&mut d.status, to, at) {
            d.events.push(event);
        }
    }
    d
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::*;
    use super::*;

    #[test]
    fn a_refusal_that_can_pass_is_reported_and_the_attempt_waits() {
        let mut j = oom_job();
        let d = step(&mut j, &[], t0());
        let after = refused(
            &d,
            &j,
            Refused::Launch {
                attempt: 1,
                pods: &[],
            },
            &refusal(403),
            t0(),
        );
        assert_eq!(after.status.phase, Some(JobPhase::Pending));
        assert_eq!(after.status.attempts[0].outcome, AttemptOutcome::Running);
        assert!(has_condition(
            &after.status,
            ConditionType::Running,
            false,
            Reason::LaunchRefused
        ));
        let e = &after.events[0];
        assert!(e.warning && e.reason == Reason::LaunchRefused);
        assert!(
            e.note
                .contains("denied by policy (403 Pod oom-then-fit-a1-s1)"),
            "{}",
            e.note
        );
        assert!(after.delete_pods.is_empty() && after.ended.is_none());
    }

    #[test]
    fn a_refusal_that_cannot_pass_ends_the_attempt_and_the_job() {
        for code in [400, 422] {
            let mut j = oom_job();
            let d = step(&mut j, &[], t0());
            let created = pod(1, 0, "  phase: Pending");
            let after = refused(
                &d,
                &j,
                Refused::Launch {
                    attempt: 1,
                    pods: &[&created],
                },
                &refusal(code),
                t0(),
            );
            assert_eq!(after.status.phase, Some(JobPhase::Failed), "{code}");
            let a = &after.status.attempts[0];
            assert_eq!(a.outcome, AttemptOutcome::Failed);
            assert_eq!(a.reason.as_deref(), Some("LaunchRefused"));
            assert!(a.finished_at.is_some());
            assert_eq!(after.ended, Some(AttemptOutcome::Failed));
            assert_eq!(
                after.delete_pods,
                vec!["p-a1-s0".to_string()],
                "the stage that was created stops"
            );
            assert!(has_condition(
                &after.status,
                ConditionType::Failed,
                true,
                Reason::LaunchRefused
            ));
            // Completion is final: the next reconcile launches nothing.
            j.status = Some(after.status);
            let next = step(&mut j, &[], t0());
            assert_eq!(launched(&next), None);
        }
    }
}
