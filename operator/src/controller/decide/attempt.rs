//! The running attempt, as its pods show it: one [`Verdict`], computed once
//! by [`verdict`] (pure), then acted on by [`Builder::follow`].

use std::time::Duration;

use headroom_api::{Attempt, AttemptOutcome, LABEL_ATTEMPT, WorkerOutcome};
use headroom_planner::{FailureCause, JobRequest};
use jiff::Timestamp;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;

use super::super::classify::{PodFailure, PodVerdict, classify, rank};
use super::super::lifecycle::{AttemptEnding, JobEvent, Reason, Transition};
use super::{Builder, Observation, of_attempt};

/// How long a pipeline stage that lost its neighbour waits for the
/// neighbour's own failure to be reported before the attempt ends without it.
const PEER_LOST_GRACE: Duration = Duration::from_secs(30);
/// How often a queued attempt's status reads Kueue's reason again (one
/// Workload read per queued job per poll).
const QUEUE_POLL: Duration = Duration::from_secs(30);

/// What the running attempt's pods say, most decisive first.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Verdict {
    /// A stage failed (the worst failure if several did): the attempt has
    /// failed as a whole, and `live` are its stages still running.
    Failed {
        ending: AttemptEnding,
        worker: Option<WorkerOutcome>,
        live: Vec<String>,
    },
    /// Only lost peers so far: the stage that caused it is still being
    /// reported (its OOM kill decides the retry); look again after `left`.
    PeerLost { left: Duration },
    /// Every worker finished.
    Succeeded,
    /// A worker that reported and whose pod is gone: deleted from outside
    /// (the eviction API, `kubectl delete pod`, a node drained or lost)
    /// after the kubelet had finished it, before this operator saw it fail.
    Vanished { pod: String, live: Vec<String> },
    /// A pod has been unschedulable for the whole grace period; `all` are
    /// the attempt's pods.
    Stuck { why: String, all: Vec<String> },
    /// No pod of this attempt yet, and an earlier attempt's pods are still
    /// shutting down (deleted stages save a checkpoint on SIGTERM).
    Blocked { stopping: Vec<String> },
    /// Every stage exists and `running` of them run.
    Running {
        running: usize,
        recheck: Option<Duration>,
    },
    /// Pods are missing or not running yet (`recheck`: when an unschedulable
    /// pod's grace period ends).
    Waiting { recheck: Option<Duration> },
}

/// The verdict on running attempt `attempt` from the job's pods and the
/// workers' live reports.
pub(super) fn verdict(
    obs: &Observation<'_>,
    attempt: &Attempt,
    reported: &[headroom_api::WorkerTelemetry],
) -> Verdict {
    let n = attempt.number;
    let pods: Vec<(&Pod, PodVerdict)> = of_attempt(obs.pods, n).map(|p| (p, classify(p))).collect();
    if let Some(failed) = failed(obs, &pods) {
        return failed;
    }

    let succeeded = pods
        .iter()
        .filter(|(_, v)| *v == PodVerdict::Succeeded)
        .count();
    if succeeded == attempt.workers as usize && succeeded > 0 {
        return Verdict::Succeeded;
    }

    // Starting a pod in a vanished one's place would not continue the
    // attempt: its peers were mid-exchange with the one that left.
    if let Some(gone) = reported
        .iter()
        .find(|w| w.attempt == n && !pods.iter().any(|(p, _)| p.name_any() == w.name))
    {
        return Verdict::Vanished {
            pod: gone.name.clone(),
            live: live(&pods),
        };
    }

    let mut recheck = None;
    if let Some((unschedulable_since, message)) = first_unschedulable(&pods) {
        let waited = since(obs.now, unschedulable_since);
        if waited >= obs.unschedulable_grace {
            return Verdict::Stuck {
                why: message.unwrap_or_else(|| "no node can take the worker".into()),
                all: pods.iter().map(|(p, _)| p.name_any()).collect(),
            };
        }
        recheck = Some(obs.unschedulable_grace.saturating_sub(waited) + Duration::from_secs(1));
    }

    let stopping = stopping_before(obs, n);
    if pods.is_empty() && !stopping.is_empty() {
        return Verdict::Blocked { stopping };
    }

    let running = pods
        .iter()
        .filter(|(_, v)| *v == PodVerdict::Running)
        .count();
    if running > 0 && pods.len() == attempt.workers as usize {
        Verdict::Running { running, recheck }
    } else {
        Verdict::Waiting { recheck }
    }
}

/// The names of the live ones of an attempt's `pods`.
fn live(pods: &[(&Pod, PodVerdict)]) -> Vec<String> {
    pods.iter()
        .filter(|(_, v)| v.is_live())
        .map(|(p, _)| p.name_any())
        .collect()
}

/// The attempt's verdict when one of its `pods` failed: the worst failure
/// ends it, except that a stage that only lost its neighbour, while other
/// stages live, waits up to [`PEER_LOST_GRACE`] for the neighbour's own
/// failure (the cause) to show.
fn failed(obs: &Observation<'_>, pods: &[(&Pod, PodVerdict)]) -> Option<Verdict> {
    let failures = || {
        pods.iter().filter_map(|(_, v)| match v {
            PodVerdict::Failed(f) => Some(f),
            _ => None,
        })
    };
    let failure = failures().max_by_key(|f| rank(f))?;
    let others_alive = pods.iter().any(|(_, v)| v.is_live());
    if failure.peer_lost() && others_alive {
        let waited = failure
            .finished_at
            .map_or(Duration::ZERO, |t| since(obs.now, t));
        if waited < PEER_LOST_GRACE {
            return Some(Verdict::PeerLost {
                left: PEER_LOST_GRACE - waited + Duration::from_secs(1),
            });
        }
    }
    let PodFailure {
        outcome,
        reason,
        message,
        peak_bytes,
        worker,
        ..
    } = failure.clone();
    Some(Verdict::Failed {
        ending: AttemptEnding {
            outcome,
            reason,
            message,
            peak: peak_bytes,
            step: failures().filter_map(|f| f.step).max(),
        },
        worker,
        live: live(pods),
    })
}

/// Since when the first unschedulable one of `pods` has been so, and the
/// scheduler's word on why.
fn first_unschedulable(pods: &[(&Pod, PodVerdict)]) -> Option<(Timestamp, Option<String>)> {
    pods.iter().find_map(|(_, v)| match v {
        PodVerdict::Pending {
            unschedulable_since: Some(since),
            message,
        } => Some((*since, message.clone())),
        _ => None,
    })
}

/// The live pods of attempts before `n`, still shutting down.
fn stopping_before(obs: &Observation<'_>, n: u32) -> Vec<String> {
    obs.pods
        .iter()
        .filter(|p| {
            p.labels()
                .get(LABEL_ATTEMPT)
                .and_then(|a| a.parse::<u32>().ok())
                .is_some_and(|a| a < n)
                && classify(p).is_live()
                // Deleted and 30 s past its grace period: its node is
                // probably gone, and it must not block the job forever.
                && !p.metadata.deletion_timestamp.as_ref().is_some_and(|t| {
                    obs.now.duration_since(t.0) > jiff::SignedDuration::from_secs(30)
                })
        })
        .map(|p| p.name_any())
        .collect()
}

fn since(now: Timestamp, then: Timestamp) -> Duration {
    now.duration_since(then).unsigned_abs()
}

impl Builder<'_> {
    /// A worker whose memory guard stepped it down in place reports the
    /// micro-batch and accumulation it runs now: the attempt records them
    /// (its settings are what ran; the global batch is the same), with an
    /// event the first time each step down is seen.
    fn record_step_down(&mut self, n: u32) {
        let reported = self
            .d
            .status
            .workers
            .iter()
            .filter(|w| w.attempt == n)
            .filter_map(|w| w.stepped_down)
            .min_by_key(|d| d.micro_batch);
        let Some(down) = reported else {
            return;
        };
        let Some(a) = self.d.status.attempts.last_mut().filter(|a| a.number == n) else {
            return;
        };
        if a.settings.micro_batch <= down.micro_batch {
            return;
        }
        let note = format!(
            "attempt {n}: the memory guard stopped a step before the memory limit and stepped the worker down in place, micro-batch {} × accumulation {} → {} × {} (the same global batch), resuming from its last checkpoint in the same pod",
            a.settings.micro_batch,
            a.settings.gradient_accumulation,
            down.micro_batch,
            down.gradient_accumulation
        );
        a.settings.micro_batch = down.micro_batch;
        a.settings.gradient_accumulation = down.gradient_accumulation;
        self.d
            .events
            .push(JobEvent::new(true, Reason::SteppedDown, note));
    }

    /// Follows the running attempt: acts on its pods' verdict.
    pub(super) fn follow(&mut self, attempt: &Attempt, request: &JobRequest) {
        let n = attempt.number;
        match verdict(self.obs, attempt, &self.d.status.workers) {
            Verdict::Failed {
                ending,
                worker,
                live,
            } => {
                // One stage failing fails the attempt as a whole: stop the others.
                self.d.delete_pods = live;
                self.end_attempt(ending, worker, request);
            }
            Verdict::PeerLost { left } => self.d.requeue_after = Some(left),
            Verdict::Succeeded => {
                let ending = AttemptEnding::new(
                    AttemptOutcome::Succeeded,
                    "Succeeded",
                    "all workers finished".into(),
                );
                self.end_attempt(ending, Some(WorkerOutcome::Succeeded), request);
            }
            Verdict::Vanished { pod, live } => {
                // The attempt ends as disrupted, and the next resumes from the
                // newest checkpoint.
                let ending = AttemptEnding::new(
                    AttemptOutcome::Disrupted,
                    "PodDeleted",
                    format!(
                        "pod {pod} was deleted while attempt {n} ran (an eviction, a deletion or a lost node)"
                    ),
                );
                self.d.delete_pods = live;
                self.end_attempt(ending, None, request);
            }
            Verdict::Stuck { why, all } => {
                let ending =
                    AttemptEnding::new(AttemptOutcome::Unschedulable, "Unschedulable", why.clone());
                // Another device type that fits: move there. Otherwise the
                // pods stay and the job waits (a busy node, a volume still
                // being provisioned): the scheduler places them when it can.
                let cause = FailureCause::Unschedulable {
                    excluded_devices: self.unschedulable_devices(),
                };
                let elsewhere = self
                    .replan_current(request, &cause)
                    .is_ok_and(|p| p.device != attempt.device);
                if elsewhere {
                    self.d.delete_pods = all;
                    return self.end_attempt(ending, None, request);
                }
                let waiting = format!("attempt {n}'s workers cannot be scheduled yet: {why}");
                if let Some(late) = self.past_deadline(&waiting) {
                    self.d.delete_pods = all;
                    self.close_attempt(ending);
                    return self.fail(Reason::WaitedTooLong, late);
                }
                self.launch(n);
                self.wait_for_capacity(waiting);
            }
            Verdict::Blocked { stopping } => {
                // Start this attempt's pods once they are gone, so every
                // stage resumes from the same, newest checkpoint.
                self.d.status.message = Some(format!(
                    "attempt {n}: waiting for {} of an earlier attempt to stop",
                    stopping.join(", ")
                ));
                self.d.requeue_after = Some(Duration::from_secs(2));
            }
            Verdict::Running { running, recheck } => {
                self.d.requeue_after = recheck;
                self.launch(n);
                self.record_step_down(n);
                self.enter(Transition::WorkersRunning {
                    attempt: n,
                    running,
                });
            }
            Verdict::Waiting { recheck } => {
                self.d.requeue_after = recheck;
                self.launch(n);
                // Held back by Kueue: say so, with Kueue's reason.
                let gated = of_attempt(self.obs.pods, n).any(crate::kueue::is_gated);
                match self.obs.queue.filter(|_| gated) {
                    Some(q) => {
                        self.enter(Transition::Queued {
                            attempt: n,
                            queue: q.queue.clone(),
                            message: q.waiting.clone(),
                        });
                        // Kueue's reason changes without a pod event.
                        self.d.requeue_after =
                            Some(recheck.map_or(QUEUE_POLL, |r| r.min(QUEUE_POLL)));
                    }
                    None => self.enter(Transition::Waiting),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::*;
    use super::*;

    /// A user deletes the worker pod: the worker checkpoints and exits 143.
    /// That is a disruption: the next attempt starts at once and no attempt
    /// is used up, even with maxAttempts 1.
    /// The recipe is resolved into the status before the first attempt and
    /// every attempt follows that record: an OOM retry after the spec's
    /// learning rate was edited still runs the recorded schedule.
    #[test]
    fn every_attempt_follows_the_recipe_recorded_before_the_first() {
        let mut j = oom_job();
        j.spec.training.schedule = Some(headroom_api::ScheduleSpec {
            kind: headroom_api::ScheduleType::Cosine,
            warmup_ratio: Some(0.1),
            ..Default::default()
        });
        let d = step(&mut j, &[], t0());
        let recorded = d.status.recipe.clone().expect("status.recipe");
        assert_eq!(
            (
                recorded.total_steps,
                recorded.warmup_steps,
                recorded.max_grad_norm
            ),
            (12, 2, 1.0),
            "12 steps, a warmup of ceil(1.2), the Trainer's clipping"
        );
        assert_eq!(d.launch.as_ref().map(|l| &l.recipe), Some(&recorded));
        j.spec.training.learning_rate = 0.1;
        step(&mut j, &[pod(1, 0, RUNNING)], t0());
        let mut retried = step(&mut j, &[pod(1, 0, OOM)], t0());
        for _ in 0..3 {
            if launched(&retried) == Some(2) {
                break;
            }
            retried = step(
                &mut j,
                &[pod(1, 0, OOM)],
                t0() + jiff::SignedDuration::from_secs(3600),
            );
        }
        assert_eq!(launched(&retried), Some(2), "{:?}", retried.status.message);
        assert_eq!(retried.status.recipe.as_ref(), Some(&recorded));
        assert_eq!(retried.launch.as_ref().map(|l| &l.recipe), Some(&recorded));
    }

    /// `epochs` counts passes over data: a synthetic job has none, and
    /// fails naming the field (the API server's rule says so first).
    #[test]
    fn epochs_without_data_fail_naming_the_field() {
        let mut j = oom_job();
        j.spec.training.steps = None;
        j.spec.training.epochs = Some(2.0);
        let d = step(&mut j, &[], t0());
        assert_eq!(d.status.phase, Some(JobPhase::Failed));
        assert!(
            d.status
                .message
                .as_deref()
                .unwrap_or_default()
                .contains("spec.training.epochs: "),
            "{:?}",
            d.status.message
        );
        assert_eq!(launched(&d), None);
    }

    #[test]
    fn a_deleted_worker_is_a_disruption_that_costs_no_attempt() {
        const SIGTERM: &str = "  phase: Failed\n  containerStatuses: [{name: worker, image: i, imageID: '', ready: false, restartCount: 0, state: {terminated: {exitCode: 143, message: '{\"outcome\":\"terminated\",\"reason\":\"terminated by SIGTERM at step 7; checkpoint saved\",\"step\":7}'}}}]";
        let mut j = oom_job();
        j.spec.memory_policy.max_attempts = 1;
        step(&mut j, &[], t0());
        step(&mut j, &[pod(1, 0, RUNNING)], t0());
        let d = step(&mut j, &[pod(1, 0, SIGTERM)], t0());
        let first = &d.status.attempts[0];
        assert_eq!(first.outcome, AttemptOutcome::Disrupted, "{first:?}");
        assert_eq!(first.reason.as_deref(), Some("Terminated"));
        assert_eq!(first.last_step, Some(7));
        assert_eq!(launched(&d), Some(2), "resumes at once, no backoff");
        assert_eq!(d.status.phase, Some(JobPhase::Retrying));
        // A real failure afterwards is still held to maxAttempts 1.
        let d = step(&mut j, &[pod(1, 0, SIGTERM), pod(2, 0, CRASH)], t0());
        assert_eq!(d.status.phase, Some(JobPhase::Failed));
    }

    /// A queued job: while Kueue gates the attempt's pod, the job says it is
    /// queued, where and why (Kueue's words), with one event per reason;
    /// once admitted and running, `Waiting` turns False as `Admitted`. Kueue
    /// preempting it is a disruption: the next attempt starts at once, with
    /// no attempt used up.
    #[test]
    fn a_queued_attempt_says_where_and_why_and_kueue_preemption_costs_no_attempt() {
        let mut j = oom_job();
        j.spec.memory_policy.max_attempts = 1;
        let mut queue = super::super::QueueView {
            queue: "LocalQueue team-a (ClusterQueue cpu)".into(),
            waiting: Some(
                "insufficient unused quota for memory in flavor default, 320Mi more needed".into(),
            ),
        };
        let images = WorkerImages::default();
        let gated = || {
            let mut p = pod(1, 0, "  phase: Pending");
            p.spec = Some(k8s_openapi::api::core::v1::PodSpec {
                scheduling_gates: Some(vec![k8s_openapi::api::core::v1::PodSchedulingGate {
                    name: crate::kueue::ADMISSION_GATE.into(),
                }]),
                ..Default::default()
            });
            p
        };
        step_queued(&mut j, &[], t0(), &images, Some(&queue));
        let d = step_queued(&mut j, &[gated()], t0(), &images, Some(&queue));
        let status = &d.status;
        assert!(
            has_condition(status, ConditionType::Waiting, true, Reason::Queued),
            "{status:?}"
        );
        let message = status.message.clone().unwrap_or_default();
        assert_eq!(
            message,
            "attempt 1 is queued in Kueue LocalQueue team-a (ClusterQueue cpu): insufficient unused quota for memory in flavor default, 320Mi more needed"
        );
        assert!(
            d.events.iter().any(|e| e.reason == Reason::Queued),
            "{:?}",
            d.events
        );
        assert_eq!(status.phase, Some(JobPhase::Pending));
        // The same reason again: no second event.
        let d = step_queued(&mut j, &[gated()], t0(), &images, Some(&queue));
        assert!(
            !d.events.iter().any(|e| e.reason == Reason::Queued),
            "{:?}",
            d.events
        );
        queue.waiting = None;
        let d = step_queued(&mut j, &[pod(1, 0, RUNNING)], t0(), &images, Some(&queue));
        assert!(
            has_condition(&d.status, ConditionType::Waiting, false, Reason::Admitted),
            "{:?}",
            d.status
        );
        const PREEMPTED: &str = "  phase: Failed\n  conditions: [{type: TerminationTarget, status: 'True', reason: WorkloadEvictedDueToPreempted, message: 'Preempted to accommodate a higher priority workload'}]\n  containerStatuses: [{name: worker, image: i, imageID: '', ready: false, restartCount: 0, state: {terminated: {exitCode: 143}}}]";
        let d = step_queued(&mut j, &[pod(1, 0, PREEMPTED)], t0(), &images, Some(&queue));
        let first = &d.status.attempts[0];
        assert_eq!(first.outcome, AttemptOutcome::Disrupted, "{first:?}");
        assert_eq!(first.reason.as_deref(), Some("StoppedByKueue"));
        assert_eq!(launched(&d), Some(2), "resumes at once, no attempt used");
    }

    /// A worker's pod is deleted from outside and gone before this operator
    /// saw it fail (the kubelet finished it at once): once it has reported,
    /// the attempt ends as disrupted instead of starting a lone pod in its
    /// place that its peers would never exchange with (a ZeRO replica
    /// started again waited for a ring whose other replica had finished).
    #[test]
    fn a_worker_that_reported_and_vanished_ends_its_attempt_as_disrupted() {
        let mut j = oom_job();
        step(&mut j, &[], t0());
        step(&mut j, &[pod(1, 0, RUNNING)], t0());
        // Gone before it ever reported: not known to have run, so started again.
        let d = step(&mut j, &[], t0());
        assert_eq!(launched(&d), Some(1));
        assert_eq!(d.status.attempts[0].outcome, AttemptOutcome::Running);
        let report: headroom_api::WorkerTelemetry = serde_json::from_value(serde_json::json!({
            "name": "p-a1-s0", "attempt": 1, "stage": 0, "layerStart": 0, "layerEnd": 2,
            "step": 7, "memory": {"peakBytes": 1000}, "updatedAt": "2026-11-21T10:00:00Z"
        }))
        .expect("telemetry");
        j.status.as_mut().expect("status").workers.push(report);
        let d = step(&mut j, &[pod(1, 0, RUNNING)], t0());
        assert_eq!(d.status.attempts[0].outcome, AttemptOutcome::Running);
        let d = step(&mut j, &[], t0());
        let first = &d.status.attempts[0];
        assert_eq!(first.outcome, AttemptOutcome::Disrupted, "{first:?}");
        assert_eq!(first.reason.as_deref(), Some("PodDeleted"));
        assert!(
            first
                .message
                .as_deref()
                .is_some_and(|m| m.contains("p-a1-s0")),
            "{first:?}"
        );
        assert_eq!(first.last_step, Some(7), "the step it reported");
        assert_eq!(launched(&d), Some(2), "resumes at once");
    }

    /// An eviction, then a launch whose status write loses a race, as the
    /// decisions see it. A launch writes the status and creates the
    /// pods together; when that status write loses a race with a telemetry
    /// write (409), the next decision, made on the newer job, records the
    /// same attempt on the pods the launch made (`Builder::start`) and
    /// deletes nothing: keeping them is the recovery. Had the lost write's
    /// launch been undone (its pod deleted before it started), the next
    /// decision would still record attempt 3 on that pod, whose end the
    /// kubelet reports as `ContainerStatusUnknown`, a disruption: a fourth
    /// attempt for nothing. So a conflict must not undo the launch
    /// (`Error::refused_for_good`).
    #[test]
    fn a_launch_whose_status_write_lost_a_race_is_taken_up_by_the_next_decision() {
        const EVICTED: &str = "  phase: Failed\n  conditions: [{type: DisruptionTarget, status: 'True', reason: EvictionByEvictionAPI}]\n  containerStatuses: [{name: worker, image: i, imageID: '', ready: false, restartCount: 0, state: {terminated: {exitCode: 143, message: '{\"outcome\":\"terminated\",\"reason\":\"terminated by SIGTERM at step 5; checkpoint saved\",\"step\":5}'}}}]";
        const PENDING: &str = "  phase: Pending";
        const UNKNOWN: &str = "  phase: Failed\n  containerStatuses: [{name: worker, image: i, imageID: '', ready: false, restartCount: 0, state: {terminated: {exitCode: 137, reason: ContainerStatusUnknown, message: 'The container could not be located when the pod was terminated'}}}]";
        let later = |s| t0() + SignedDuration::from_secs(s);
        let mut j = oom_job();
        step(&mut j, &[], t0());
        step(&mut j, &[pod(1, 0, RUNNING)], t0());
        let d = step(&mut j, &[pod(1, 0, OOM)], later(30));
        assert_eq!(launched(&d), Some(2));
        step(&mut j, &[pod(1, 0, OOM), pod(2, 0, RUNNING)], later(40));
        // Attempt 2's pod is evicted: attempt 3 is launched together with
        // the status write that records it, and that write is refused (409).
        let before = j.clone();
        let evicted = [pod(1, 0, OOM), pod(2, 0, EVICTED)];
        let lost = step(&mut j, &evicted, later(60));
        assert_eq!((launched(&lost), lost.delete_pods.len()), (Some(3), 0));
        let outcomes = |d: &super::super::Decision| -> Vec<AttemptOutcome> {
            d.status.attempts.iter().map(|a| a.outcome).collect()
        };
        use AttemptOutcome::{Disrupted, HostOutOfMemory, Running, Succeeded};

        // Kept: the next decision, on the newer job (still at attempt 2),
        // records attempt 3 on its pod, deletes nothing, and it runs on.
        let mut kept = before.clone();
        let with = |a3: &str| [pod(1, 0, OOM), pod(2, 0, EVICTED), pod(3, 0, a3)];
        let next = step(&mut kept, &with(PENDING), later(61));
        assert_eq!(launched(&next), Some(3));
        assert!(next.delete_pods.is_empty(), "{:?}", next.delete_pods);
        assert_eq!(outcomes(&next), [HostOutOfMemory, Disrupted, Running]);
        step(&mut kept, &with(RUNNING), later(62));
        let done = step(&mut kept, &with(DONE), later(90));
        assert_eq!(outcomes(&done), [HostOutOfMemory, Disrupted, Succeeded]);

        // Undone: the same decision records attempt 3 on the pod being
        // deleted, and its end disrupts attempt 3.
        let mut undone = before;
        let mut deleted = pod(3, 0, PENDING);
        deleted.metadata.deletion_timestamp = Some(Time(later(60)));
        let next = step(
            &mut undone,
            &[pod(1, 0, OOM), pod(2, 0, EVICTED), deleted],
            later(61),
        );
        assert_eq!(outcomes(&next), [HostOutOfMemory, Disrupted, Running]);
        let mut gone = pod(3, 0, UNKNOWN);
        gone.metadata.deletion_timestamp = Some(Time(later(60)));
        let after = step(
            &mut undone,
            &[pod(1, 0, OOM), pod(2, 0, EVICTED), gone],
            later(62),
        );
        assert_eq!(
            outcomes(&after),
            [HostOutOfMemory, Disrupted, Disrupted, Running]
        );
        assert_eq!(
            after.status.attempts[2].reason.as_deref(),
            Some("ContainerStatusUnknown")
        );
        assert_eq!(launched(&after), Some(4));
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
            launched(&waiting),
            None,
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
        assert_eq!(launched(&gone), Some(2));
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
        assert_eq!(launched(&blocked), None);
        let later = step(
            &mut j,
            &[stuck, pod(1, 1, OOM)],
            t0() + SignedDuration::from_secs(31),
        );
        assert_eq!(launched(&later), Some(2));
    }

    /// A launch writes the status and creates the pods in one round; when
    /// the status write is lost, the next decision must not plan afresh over
    /// pods that run another plan (it would record one plan and run another).
    #[test]
    fn pods_of_an_attempt_whose_status_write_was_lost_keep_their_plan() {
        use crate::controller::config::ChildConfig;
        use crate::controller::pods::{Slot, worker_pod};
        let mut j = oom_job();
        let planned_now = step(&mut j.clone(), &[], t0());
        let mut theirs = planned_now.status.plan.clone().expect("plan");
        theirs
            .warnings
            .push("made before the inventory changed".into());
        let model = planned_now.launch.clone().expect("launch").model;
        let pod = worker_pod(
            &j,
            &crate::controller::decide::Launch::of(&j, 1, &model, "worker:test"),
            Slot {
                stage: 0,
                replica: 0,
            },
            &theirs,
            &ChildConfig::default(),
        )
        .expect("pod");

        let d = step(&mut j, &[pod], t0());
        assert_eq!(launched(&d), Some(1));
        assert_eq!(d.status.attempts.len(), 1);
        assert_eq!(
            d.status.plan.as_ref(),
            Some(&theirs),
            "the status records the plan the pods run"
        );
        assert_eq!(
            d.status.attempts[0],
            Attempt::start(1, &theirs, d.status.attempts[0].started_at.clone())
        );
    }
}
