//! The reconcile decision: given a job, its pods and the inventory, what the
//! status should say, which attempt's children must exist, which pods to stop
//! and which events to record. Pure, so every branch is unit-tested; the I/O
//! around it lives in `reconcile.rs` and `apply.rs`. Phase changes go through
//! [`lifecycle::enter`](super::lifecycle::enter); the next plan after a failed
//! attempt comes from the planner's one [`replan`].

use std::time::Duration;

use headroom_api::{
    Attempt, AttemptOutcome, JobPhase, LABEL_ATTEMPT, MemoryAwareTrainingJob,
    MemoryAwareTrainingJobStatus, PLAN_JSON_ENV, WORKER_MAX_STAGES, WorkerAssignment,
    WorkerOutcome,
};
use headroom_planner::units::format_bytes;
use headroom_planner::{
    FailureCause, Inventory, JobRequest, MemoryFailure, MemoryFailureKind, ModelShape, Target,
    plan, replan,
};
use jiff::Timestamp;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;

use super::LaunchRefusal;
use super::classify::{PodFailure, PodVerdict, classify, rank};
use super::config::WorkerImages;
use super::lifecycle::{ConditionType, JobEvent, Reason, Stamp, Transition, enter};

/// Longest wait between retries of non-memory failures.
const MAX_BACKOFF: Duration = Duration::from_secs(3600);
/// How often a job waiting for capacity plans again (node and pod changes
/// bring it back sooner).
const CAPACITY_POLL: Duration = Duration::from_secs(30);
/// How long a pipeline stage that lost its neighbour waits for the
/// neighbour's own failure to be reported before the attempt ends without it.
const PEER_LOST_GRACE: Duration = Duration::from_secs(30);

/// What reconcile should do.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    /// The whole operator-owned status (telemetry `workers` are left to the workers).
    pub status: MemoryAwareTrainingJobStatus,
    pub events: Vec<JobEvent>,
    /// Attempt whose children must exist (created when missing).
    pub launch: Option<u32>,
    /// Initializer run whose pod must exist (created when missing).
    pub initialize: Option<u32>,
    /// The validated model the workers build (None when the spec is invalid).
    pub model: Option<ModelShape>,
    /// The image the job's pods run: `spec.worker.image`, else the
    /// operator's default for the job's backend (None when it has neither).
    pub image: Option<String>,
    /// Pods to delete (the live stages of an attempt that has failed as a whole).
    pub delete_pods: Vec<String>,
    /// When to look again even without a change.
    pub requeue_after: Option<Duration>,
    /// The attempt that just ended, for metrics.
    pub ended: Option<AttemptOutcome>,
}

impl Decision {
    /// A second decision in the same reconcile, after the API server refused
    /// what this one asked for: the status so far, nothing more to create.
    fn follow_up(&self) -> Decision {
        Decision {
            status: self.status.clone(),
            events: vec![],
            launch: None,
            initialize: None,
            model: self.model.clone(),
            image: self.image.clone(),
            delete_pods: vec![],
            requeue_after: None,
            ended: None,
        }
    }
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
    /// Host memory a GPU worker pod gets when its job does not set
    /// `resources.gpu.hostMemory` (the operator's `--gpu-host-memory`), bytes.
    pub default_gpu_host_memory: u64,
    /// The operator's images for jobs that name none, by backend.
    pub worker_images: &'a WorkerImages,
}

/// How an attempt ended, as the pods showed it.
struct Ending {
    outcome: AttemptOutcome,
    /// Kubernetes' or the worker's short reason (`OOMKilled`, `ExitCode2`, …).
    reason: String,
    message: String,
    peak: Option<u64>,
    step: Option<u64>,
    /// What the worker itself said, when it said anything.
    worker: Option<WorkerOutcome>,
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
            initialize: None,
            model: None,
            image: None,
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
        // Every pod the job gets (initializer, workers) runs this image:
        // without one, nothing can start.
        match self.obs.worker_images.resolve(&self.obs.job.spec) {
            Ok(image) => self.d.image = Some(image),
            Err(e) => return self.fail(Reason::InvalidSpec, e.to_string()),
        }
        if self.obs.job.spec.model.pretrained.is_some()
            && self.d.status.model.is_none()
            && !self.initialize()
        {
            return;
        }
        let request = match runnable_request(
            self.obs.job,
            &self.d.status,
            self.obs.default_gpu_host_memory,
        ) {
            Ok(r) => r,
            Err(e) => return self.fail(Reason::InvalidSpec, e.to_string()),
        };
        self.d.model = Some(request.model.clone());
        let Some(current) = self.d.status.attempts.last().cloned() else {
            return match plan(&request, self.obs.inventory) {
                Ok(p) => self.start(1, p, None),
                Err(e) => self.no_plan(e),
            };
        };
        if current.outcome == AttemptOutcome::Running {
            self.watch_attempt(&current, &request);
        } else {
            self.after_attempt(&current, None, &request);
        }
    }

    /// Follows the running attempt's pods.
    fn watch_attempt(&mut self, attempt: &Attempt, request: &JobRequest) {
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
            if failure.peer_lost() && others_alive {
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
                Ending {
                    outcome: failure.outcome,
                    reason: failure.reason,
                    message: failure.message,
                    peak: failure.peak_bytes,
                    step,
                    worker: failure.worker,
                },
                request,
            );
        }

        let succeeded = pods
            .iter()
            .filter(|(_, v)| *v == PodVerdict::Succeeded)
            .count();
        if succeeded == attempt.plan.workers as usize && succeeded > 0 {
            self.end_attempt(
                Ending {
                    outcome: AttemptOutcome::Succeeded,
                    reason: "Succeeded".into(),
                    message: "all workers finished".into(),
                    peak: None,
                    step: None,
                    worker: Some(WorkerOutcome::Succeeded),
                },
                request,
            );
            return self.succeed(n);
        }

        // A worker that reported and whose pod is gone: deleted from outside
        // (the eviction API, `kubectl delete pod`, a node drained or lost)
        // after the kubelet had finished it, before this operator saw it
        // fail. Starting a pod in its place would not continue the attempt:
        // its peers were mid-exchange with the one that left. So the attempt
        // ends as disrupted, and the next resumes from the newest checkpoint.
        let vanished: Vec<&str> = self
            .d
            .status
            .workers
            .iter()
            .filter(|w| w.attempt == n && !pods.iter().any(|(p, _)| p.name_any() == w.name))
            .map(|w| w.name.as_str())
            .collect();
        if let Some(first) = vanished.first() {
            let ending = Ending {
                outcome: AttemptOutcome::Disrupted,
                reason: "PodDeleted".into(),
                message: format!(
                    "pod {first} was deleted while attempt {n} ran (an eviction, a deletion or a lost node)"
                ),
                peak: None,
                step: None,
                worker: None,
            };
            self.d.delete_pods = pods
                .iter()
                .filter(|(_, v)| matches!(v, PodVerdict::Running | PodVerdict::Pending { .. }))
                .map(|(p, _)| p.name_any())
                .collect();
            return self.end_attempt(ending, request);
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
                let why = message.unwrap_or_else(|| "no node can take the worker".into());
                let ending = Ending {
                    outcome: AttemptOutcome::Unschedulable,
                    reason: "Unschedulable".into(),
                    message: why.clone(),
                    peak: None,
                    step: None,
                    worker: None,
                };
                // Another device type that fits: move there. Otherwise the
                // pods stay and the job waits (a busy node, a volume still
                // being provisioned): the scheduler places them when it can.
                let cause = FailureCause::Unschedulable {
                    excluded_devices: self.unschedulable_devices(),
                };
                let elsewhere = replan(request, self.obs.inventory, &attempt.plan, &cause)
                    .is_ok_and(|p| p.device != attempt.plan.device);
                if elsewhere {
                    self.d.delete_pods = pods.iter().map(|(p, _)| p.name_any()).collect();
                    return self.end_attempt(ending, request);
                }
                let waiting = format!("attempt {n}'s workers cannot be scheduled yet: {why}");
                if let Some(late) = self.past_deadline(&waiting) {
                    self.d.delete_pods = pods.iter().map(|(p, _)| p.name_any()).collect();
                    self.close_attempt(&ending);
                    return self.fail(Reason::WaitedTooLong, late);
                }
                self.d.launch = Some(n);
                return self.wait_for_capacity(waiting);
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
            self.enter(Transition::WorkersRunning {
                attempt: n,
                running,
            });
        } else {
            self.enter(Transition::Waiting);
        }
    }

    /// Records how the current attempt ended, then moves on.
    fn end_attempt(&mut self, ending: Ending, request: &JobRequest) {
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
        attempt.outcome = ending.outcome;
        attempt.reason = Some(ending.reason.clone());
        attempt.message = Some(ending.message.clone());
        attempt.finished_at = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(now));
        attempt.observed_peak_bytes = ending
            .peak
            .max(telemetry_peak)
            .or(attempt.observed_peak_bytes);
        attempt.last_step = ending.step.max(telemetry_step).or(attempt.last_step);
        let ended = attempt.clone();
        self.d.ended = Some(ending.outcome);
        if ending.outcome == AttemptOutcome::Succeeded {
            return;
        }
        let reason = if is_memory(ending.outcome) {
            Reason::OutOfMemory
        } else {
            Reason::AttemptFailed
        };
        self.d.events.push(JobEvent::new(
            true,
            reason,
            format!(
                "attempt {} {}: {}{}",
                ended.number,
                ending.reason,
                ending.message,
                peak_note(&ended)
            ),
        ));
        self.after_attempt(&ended, ending.worker, request);
    }

    /// Chooses and starts the next attempt after `ended`, or ends the job.
    /// `worker`: what the ended attempt's worker said, when this reconcile saw it end.
    fn after_attempt(
        &mut self,
        ended: &Attempt,
        worker: Option<WorkerOutcome>,
        request: &JobRequest,
    ) {
        let policy = &self.obs.job.spec.memory_policy;
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
        // Disruptions (a deleted or evicted pod, a drained node) are not the
        // job's doing and lose no work (the worker checkpoints on SIGTERM):
        // they do not use up attempts.
        let counted = self
            .d
            .status
            .attempts
            .iter()
            .filter(|a| a.outcome != AttemptOutcome::Disrupted)
            .count();
        if ended.outcome != AttemptOutcome::Disrupted && counted >= policy.max_attempts as usize {
            return self.fail(
                Reason::MaxAttemptsReached,
                format!(
                    "attempt {n} ended {:?} ({}); memoryPolicy.maxAttempts is {}",
                    ended.outcome,
                    ended.message.clone().unwrap_or_default(),
                    policy.max_attempts
                ),
            );
        }
        let (cause, why) = match ended.outcome {
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
                (FailureCause::OutOfMemory(failure), "stricter settings")
            }
            AttemptOutcome::Unschedulable => {
                let cause = FailureCause::Unschedulable {
                    excluded_devices: self.unschedulable_devices(),
                };
                // Another device type if one fits; else the same plan again,
                // waiting for the capacity (a busy cluster never ends a job).
                return match replan(request, self.obs.inventory, &ended.plan, &cause) {
                    Ok(p) => self.start(n + 1, p, Some("another device type".into())),
                    Err(_) => {
                        let same = replan(
                            request,
                            self.obs.inventory,
                            &ended.plan,
                            &FailureCause::Other,
                        );
                        match same {
                            Ok(p) => self.start(
                                n + 1,
                                p,
                                Some("the same plan, waiting for capacity".into()),
                            ),
                            Err(e) => self.no_plan(e),
                        }
                    }
                };
            }
            // Resume at once: nothing failed, and the checkpoint is there.
            AttemptOutcome::Disrupted => (FailureCause::Other, "the same settings"),
            AttemptOutcome::Failed => {
                // Exponential backoff over consecutive failures (disruptions
                // between them neither count nor break the streak).
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
                let base = Duration::from_secs(u64::from(policy.backoff_seconds));
                let backoff = base
                    .saturating_mul(1 << (streak - 1).min(16))
                    .min(MAX_BACKOFF);
                let finished = ended.finished_at.as_ref().map_or(self.obs.now, |t| t.0);
                let waited = self.obs.now.duration_since(finished).unsigned_abs();
                if waited < backoff {
                    let left = backoff - waited;
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
        match replan(request, self.obs.inventory, &ended.plan, &cause) {
            Ok(p) => self.start(n + 1, p, Some(why.to_string())),
            Err(e) => self.no_plan(e),
        }
    }

    /// No plan fits now: wait if one fits the cluster once busy devices are
    /// free, else fail with the numbers.
    fn no_plan(&mut self, e: headroom_planner::NoFeasiblePlan) {
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
    fn unschedulable_devices(&self) -> Vec<String> {
        let status = &self.d.status;
        let mut out: Vec<String> = status
            .attempts
            .iter()
            .filter(|a| {
                a.outcome == AttemptOutcome::Unschedulable
                    || (a.outcome == AttemptOutcome::Running
                        && Some(a.number) == status.attempts.last().map(|l| l.number))
            })
            .map(|a| a.plan.device.clone())
            .collect();
        out.dedup();
        out
    }

    /// Waits for capacity: the condition and event say for what; look again
    /// in a while (node and pod changes also bring the job back).
    fn wait_for_capacity(&mut self, message: String) {
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
    fn past_deadline(&self, what: &str) -> Option<String> {
        let max = self.obs.job.spec.scheduling.max_wait_seconds?;
        (self.deadline_left()? == Duration::ZERO)
            .then(|| format!("waited {max}s for capacity (spec.scheduling.maxWaitSeconds): {what}"))
    }

    /// Records how the running attempt ended without moving on.
    fn close_attempt(&mut self, ending: &Ending) {
        if let Some(a) = self.d.status.attempts.last_mut() {
            a.outcome = ending.outcome;
            a.reason = Some(ending.reason.clone());
            a.message = Some(ending.message.clone());
            a.finished_at = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                self.obs.now,
            ));
            self.d.ended = Some(ending.outcome);
        }
    }

    fn start(&mut self, number: u32, plan: headroom_planner::Plan, retry: Option<String>) {
        // The operator creates an attempt's pods in the same round as the
        // status write that records it. When that write was lost (refused,
        // or the operator stopped between the two), the pods exist already:
        // they keep the plan they run, and the status records that plan,
        // not one made now from a changed inventory.
        let plan = self.launched_plan(number).unwrap_or(plan);
        self.enter(Transition::Start {
            number,
            plan: Box::new(plan),
            retry,
        });
        self.d.launch = Some(number);
    }

    /// The plan attempt `number`'s pods run, when any exist: what the
    /// worker's assignment (its `HEADROOM_PLAN` variable) says.
    fn launched_plan(&self, number: u32) -> Option<headroom_planner::Plan> {
        self.obs
            .pods
            .iter()
            .filter(|p| {
                p.labels()
                    .get(LABEL_ATTEMPT)
                    .is_some_and(|a| *a == number.to_string())
            })
            .flat_map(|p| p.spec.iter().flat_map(|s| &s.containers))
            .flat_map(|c| c.env.iter().flatten())
            .filter(|e| e.name == PLAN_JSON_ENV)
            .find_map(|e| serde_json::from_str::<WorkerAssignment>(e.value.as_deref()?).ok())
            .map(|a| a.plan)
    }

    fn succeed(&mut self, attempt: u32) {
        let job = self.obs.job;
        let kept_in = job
            .spec
            .checkpoints
            .retention
            .keeps(true)
            .then(|| super::children::checkpoint_claim_name(job));
        self.enter(Transition::Succeeded { attempt, kept_in });
    }

    /// A `model.pretrained` job before its first plan: start the initializer,
    /// follow it, and take what it read into the status. True once the
    /// checkpoint and the data are read (planning goes on in this decision).
    fn initialize(&mut self) -> bool {
        use super::payload::{LABEL_ROLE, ROLE_INITIALIZER, initializer_pod_name, output_location};
        let job = self.obs.job;
        let run = self.d.status.initializations.unwrap_or(0);
        if run == 0 {
            self.start_initializer(1);
            return false;
        }
        let name = initializer_pod_name(job, run);
        let Some(pod) = self.obs.pods.iter().find(|p| {
            p.name_any() == name
                && p.labels().get(LABEL_ROLE).map(String::as_str) == Some(ROLE_INITIALIZER)
        }) else {
            // Created moments ago (the cache lags), or deleted: make sure it exists.
            self.d.initialize = Some(run);
            self.d.requeue_after = Some(Duration::from_secs(2));
            return false;
        };
        match classify(pod) {
            PodVerdict::Running | PodVerdict::Pending { .. } => {
                self.d.initialize = Some(run);
                self.d.requeue_after = Some(Duration::from_secs(5));
                false
            }
            PodVerdict::Succeeded => {
                let said = terminated_message(pod).unwrap_or_default();
                match serde_json::from_str::<headroom_api::InitializerReport>(&said) {
                    Ok(report) => {
                        let m = &report.model;
                        let d = &report.data;
                        let message = format!(
                            "{}: {} parameters ({}, {}), {} layers; data: {} documents, {} tokens, {} samples of {} tokens{}",
                            m.shape.architecture.hf_name(),
                            m.parameters,
                            m.dtype,
                            format_bytes(m.bytes),
                            m.shape.layers,
                            d.documents,
                            d.tokens,
                            d.samples,
                            m.shape.sequence_length,
                            if report.downloaded_bytes > 0 {
                                format!("; downloaded {}", format_bytes(report.downloaded_bytes))
                            } else {
                                String::new()
                            }
                        );
                        self.d.status.model = Some(report.model);
                        self.d.status.data = Some(report.data);
                        self.d.status.output = output_location(job);
                        self.enter(Transition::Initialized { message });
                        true
                    }
                    Err(e) => {
                        self.fail(
                            Reason::InvalidSource,
                            format!("initializer pod {name} ended without a readable report ({e}): {said}"),
                        );
                        false
                    }
                }
            }
            PodVerdict::Failed(f) => {
                let transient = !matches!(f.worker, Some(WorkerOutcome::InvalidPlan));
                let policy = &job.spec.memory_policy;
                if transient && run < policy.max_attempts {
                    let waited = f.finished_at.map_or(Duration::MAX, |t| {
                        self.obs.now.duration_since(t).unsigned_abs()
                    });
                    let backoff = Duration::from_secs(u64::from(policy.backoff_seconds));
                    if waited < backoff {
                        self.d.requeue_after = Some(backoff - waited + Duration::from_secs(1));
                        return false;
                    }
                    self.start_initializer(run + 1);
                    return false;
                }
                let what = if transient {
                    format!(
                        " (initializer run {run} of at most {})",
                        policy.max_attempts
                    )
                } else {
                    String::new()
                };
                self.fail(
                    Reason::InvalidSource,
                    format!("initializer: {}{what}", f.message),
                );
                false
            }
        }
    }

    fn start_initializer(&mut self, run: u32) {
        let job = self.obs.job;
        let source = match job.spec.model.pretrained.as_ref() {
            Some(p) => match (&p.hugging_face, &p.volume) {
                (Some(hf), _) => format!(
                    "fetching Hugging Face repository {}@{}{} and checking it",
                    hf.repo,
                    hf.revision,
                    hf.endpoint
                        .as_ref()
                        .map(|e| format!(" from {e}"))
                        .unwrap_or_default()
                ),
                (None, Some(v)) => format!(
                    "checking the checkpoint on claim {}:{}",
                    v.claim_name, v.path
                ),
                (None, None) => "checking the checkpoint".into(),
            },
            None => return,
        };
        self.d.status.initializations = Some(run);
        self.enter(Transition::Initializing {
            run,
            message: format!("{source}, its tokenizer and the training text"),
        });
        self.d.initialize = Some(run);
        self.d.requeue_after = Some(Duration::from_secs(2));
    }

    fn fail(&mut self, reason: Reason, message: String) {
        self.enter(Transition::Failed { reason, message });
        self.d.launch = None;
    }

    /// The one way phases change: [`enter`] writes phase, conditions and the event together.
    fn enter(&mut self, to: Transition) {
        let at = Stamp {
            now: self.obs.now,
            generation: self.obs.job.metadata.generation,
        };
        // `run` returns early for ended jobs, so a refusal cannot happen here.
        if let Ok(Some(event)) = enter(&mut self.d.status, to, at) {
            self.d.events.push(event);
        }
    }
}

/// The decision after the API server refused one of attempt `attempt`'s
/// children, given what reconcile had just decided and applied (`decided`)
/// and the job's pods. A refusal that can pass is reported (condition, event)
/// and the launch is asked again later; one that cannot ends the attempt and
/// the job with the server's words, and stops whatever pods of the attempt
/// did get created.
/// The decision after the API server refused initializer run `run`'s pod:
/// one that can pass (quota, server error) is reported and asked again; one
/// that cannot (400, 422: the pod is a pure function of the spec) ends the job.
pub fn initializer_refused(
    decided: &Decision,
    job: &MemoryAwareTrainingJob,
    run: u32,
    refusal: &LaunchRefusal,
    now: Timestamp,
) -> Decision {
    let mut d = decided.follow_up();
    let at = Stamp {
        now,
        generation: job.metadata.generation,
    };
    let what = format!("{} ({} {})", refusal.message, refusal.code, refusal.object);
    let to = if refusal.heals {
        Transition::InitializerRefused { message: what }
    } else {
        Transition::Failed {
            reason: Reason::LaunchRefused,
            message: format!(
                "initializer run {run}: the API server refused the initializer pod, and would again: {what}"
            ),
        }
    };
    if let Ok(Some(event)) = enter(&mut d.status, to, at) {
        d.events.push(event);
    }
    d
}

pub fn launch_refused(
    decided: &Decision,
    job: &MemoryAwareTrainingJob,
    attempt: u32,
    refusal: &LaunchRefusal,
    pods: &[&Pod],
    now: Timestamp,
) -> Decision {
    let mut d = decided.follow_up();
    let at = Stamp {
        now,
        generation: job.metadata.generation,
    };
    let what = format!("{} ({} {})", refusal.message, refusal.code, refusal.object);
    let to = if refusal.heals {
        Transition::LaunchRefused {
            attempt,
            message: what,
        }
    } else {
        if let Some(a) = d
            .status
            .attempts
            .iter_mut()
            .find(|a| a.number == attempt && a.outcome == AttemptOutcome::Running)
        {
            a.outcome = AttemptOutcome::Failed;
            a.reason = Some(Reason::LaunchRefused.as_str().into());
            a.message = Some(what.clone());
            a.finished_at = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(now));
            d.ended = Some(AttemptOutcome::Failed);
        }
        d.delete_pods = pods
            .iter()
            .filter(|p| {
                p.labels()
                    .get(LABEL_ATTEMPT)
                    .is_some_and(|a| *a == attempt.to_string())
            })
            .map(|p| p.name_any())
            .collect();
        Transition::Failed {
            reason: Reason::LaunchRefused,
            message: format!(
                "attempt {attempt}: the API server refused the workers, and would again: {what}"
            ),
        }
    };
    if let Ok(Some(event)) = enter(&mut d.status, to, at) {
        d.events.push(event);
    }
    d
}

fn is_memory(outcome: AttemptOutcome) -> bool {
    matches!(
        outcome,
        AttemptOutcome::HostOutOfMemory | AttemptOutcome::DeviceOutOfMemory
    )
}

/// What a container wrote to its termination-message path, once it ended.
fn terminated_message(pod: &Pod) -> Option<String> {
    pod.status
        .as_ref()?
        .container_statuses
        .as_ref()?
        .iter()
        .find_map(|c| c.state.as_ref()?.terminated.as_ref()?.message.clone())
}

/// The job's planning request, limited to what the worker can run.
fn runnable_request(
    job: &MemoryAwareTrainingJob,
    status: &MemoryAwareTrainingJobStatus,
    default_gpu_host_memory: u64,
) -> Result<JobRequest, headroom_api::SpecError> {
    let read = status.model.as_ref().map(|m| &m.shape);
    let mut request = job.spec.job_request_for(read)?;
    // The API server refuses these (CEL); one created before that rule existed
    // ends here rather than in a worker that cannot build it.
    if let ModelShape::Generic(_) = request.model {
        return Err(headroom_api::SpecError {
            field: "model.generic".into(),
            problem: "is for planning only (kubectl headroom plan); a job Headroom runs needs model.transformer: the worker trains transformers".into(),
        });
    }
    match &mut request.target {
        Target::Gpu { max_gpus, .. } => *max_gpus = (*max_gpus).min(WORKER_MAX_STAGES),
        Target::Cpu { max_workers, .. } => *max_workers = (*max_workers).min(WORKER_MAX_STAGES),
    }
    // What the pods will request (children.rs): the plan then fits only
    // node types that can hold it.
    request.default_host_baseline(default_gpu_host_memory);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controller::children::tests::job;
    use headroom_planner::RetryRung;
    use jiff::SignedDuration;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

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
        step_with(job, pods, now, &WorkerImages::default())
    }

    /// [`step`] for an operator with these default worker images.
    fn step_with(
        job: &mut MemoryAwareTrainingJob,
        pods: &[Pod],
        now: Timestamp,
        worker_images: &WorkerImages,
    ) -> Decision {
        let refs: Vec<&Pod> = pods.iter().collect();
        let inv = Inventory::default();
        let d = decide(&Observation {
            job,
            pods: &refs,
            inventory: &inv,
            now,
            unschedulable_grace: Duration::from_secs(60),
            default_gpu_host_memory: 16 << 30,
            worker_images,
        });
        job.status = Some(d.status.clone());
        d
    }

    /// Whether the status carries condition `type_` = `on` with `reason`.
    fn has_condition(
        status: &MemoryAwareTrainingJobStatus,
        type_: ConditionType,
        on: bool,
        reason: Reason,
    ) -> bool {
        let on = if on { "True" } else { "False" };
        status.conditions.iter().any(|c| {
            (c.type_.as_str(), c.status.as_str(), c.reason.as_str())
                == (type_.as_str(), on, reason.as_str())
        })
    }

    fn t0() -> Timestamp {
        "2026-11-21T10:00:00Z".parse().expect("time")
    }

    fn finetune_job() -> MemoryAwareTrainingJob {
        let mut j = job(include_str!(
            "../../../samples/cpu-finetune-tiny-llama.yaml"
        ));
        j.metadata.generation = Some(1);
        j
    }

    /// The initializer pod of run `run` with `status` (a terminated container's YAML).
    fn init_pod(run: u32, status: &str) -> Pod {
        serde_yaml::from_str(&format!(
            "metadata: {{name: finetune-tiny-llama-init-{run}, labels: {{headroom.dev/job: finetune-tiny-llama, headroom.dev/role: initializer}}}}\nstatus:\n{status}"
        ))
        .expect("pod fixture")
    }

    fn terminated(code: i32, message: &str) -> String {
        let phase = if code == 0 { "Succeeded" } else { "Failed" };
        format!(
            "  phase: {phase}\n  containerStatuses: [{{name: initializer, image: i, imageID: '', ready: false, restartCount: 0, state: {{terminated: {{exitCode: {code}, finishedAt: '2026-11-21T10:00:05Z', message: {} }}}}}}]",
            serde_json::to_string(message).expect("quoted")
        )
    }

    #[test]
    fn a_pretrained_job_is_initialized_then_planned_from_what_the_initializer_read() {
        let mut j = finetune_job();
        let d = step(&mut j, &[], t0());
        assert_eq!(d.initialize, Some(1), "the initializer starts first");
        assert_eq!(
            d.launch, None,
            "nothing is planned before the checkpoint is read"
        );
        assert!(has_condition(
            &d.status,
            ConditionType::Initialized,
            false,
            Reason::Initializing
        ));
        assert_eq!(d.status.phase, Some(JobPhase::Pending));
        assert!(d.events.iter().any(
            |e| e.reason == Reason::Initializing && e.note.contains("claim models:tiny-llama")
        ));

        let running = step(&mut j, &[init_pod(1, RUNNING)], t0());
        assert_eq!((running.initialize, running.launch), (Some(1), None));

        let done = step(
            &mut j,
            &[init_pod(
                1,
                &terminated(0, &headroom_e2e::fixtures::tiny_llama_report(64)),
            )],
            t0(),
        );
        assert!(has_condition(
            &done.status,
            ConditionType::Initialized,
            true,
            Reason::Initialized
        ));
        let model = done.status.model.as_ref().expect("status.model");
        assert_eq!(model.parameters, 214_592);
        assert_eq!(model.shape.sequence_length, 64);
        assert_eq!(done.status.data.as_ref().map(|d| d.samples), Some(15));
        assert_eq!(
            done.status.output.as_deref(),
            Some("finetune-tiny-llama-checkpoints:output")
        );
        assert_eq!(done.launch, Some(1), "planned in the same decision");
        let Some(ModelShape::Llama(planned)) = &done.model else {
            panic!("the workers build the checkpoint's model: {:?}", done.model);
        };
        assert_eq!(planned.total_params(), 214_592);
        assert!(done.events.iter().any(|e| e.reason == Reason::Initialized
            && e.note.contains("LlamaForCausalLM: 214592 parameters")));
    }

    #[test]
    fn a_bad_source_fails_the_job_and_a_dropped_download_runs_the_initializer_again() {
        let mut j = finetune_job();
        step(&mut j, &[], t0());
        let refused = serde_json::to_string(&headroom_api::TerminationMessage {
            outcome: WorkerOutcome::InvalidPlan,
            reason: "model.layers.0.self_attn.k_proj.weight: [32, 64] in the file, [64, 64] by config.json".into(),
            step: None,
            peak_bytes: None,
            requested_bytes: None,
        })
        .expect("JSON");
        let mut bad = j.clone();
        let d = step(
            &mut bad,
            &[init_pod(
                1,
                &terminated(WorkerOutcome::InvalidPlan.exit_code(), &refused),
            )],
            t0(),
        );
        assert_eq!(d.status.phase, Some(JobPhase::Failed));
        assert!(has_condition(
            &d.status,
            ConditionType::Failed,
            true,
            Reason::InvalidSource
        ));
        assert!(
            d.status
                .message
                .as_deref()
                .is_some_and(|m| m.contains("k_proj")),
            "{:?}",
            d.status.message
        );
        assert_eq!((d.initialize, d.launch), (None, None));

        let dropped = serde_json::to_string(&headroom_api::TerminationMessage {
            outcome: WorkerOutcome::Failed,
            reason: "GET http://hub/…/model.safetensors: connection reset".into(),
            step: None,
            peak_bytes: None,
            requested_bytes: None,
        })
        .expect("JSON");
        let failed = init_pod(1, &terminated(WorkerOutcome::Failed.exit_code(), &dropped));
        // Within the backoff (10 s after 10:00:05) nothing starts yet.
        let early = step(
            &mut j,
            std::slice::from_ref(&failed),
            t0() + SignedDuration::from_secs(8),
        );
        assert_eq!(early.initialize, None);
        assert!(early.requeue_after.is_some());
        let again = step(&mut j, &[failed], t0() + SignedDuration::from_secs(20));
        assert_eq!(
            again.initialize,
            Some(2),
            "a second initializer resumes the download"
        );
        assert_eq!(again.status.initializations, Some(2));
        assert_ne!(again.status.phase, Some(JobPhase::Failed));
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
                .any(|e| e.reason == Reason::Planned && e.note.contains("pinned settings"))
        );
        assert_eq!(d.status.observed_generation, Some(1));
        // Deciding again without change does not add attempts.
        let again = step(&mut j, &[], t0());
        assert_eq!(again.status.attempts.len(), 1);
        assert_eq!(again.launch, Some(1));
        assert!(again.events.is_empty());
    }

    /// A job that names no image runs the operator's default for its
    /// backend; with no default, it fails with a spec error before any pod
    /// (initializer or worker) is asked for, and stays failed.
    #[test]
    fn a_job_without_an_image_runs_the_default_or_fails_naming_the_field() {
        let cpu_default = WorkerImages {
            flex: Some("registry.example/headroom-worker:1".into()),
            cuda: None,
        };
        let mut named = oom_job();
        let d = step_with(&mut named, &[], t0(), &WorkerImages::default());
        assert_eq!(
            (d.launch, d.image.as_deref()),
            (Some(1), Some("localhost/headroom-worker:dev")),
            "a job that names its image needs no default"
        );

        let mut unnamed = oom_job();
        unnamed.spec.worker.image = None;
        let d = step_with(&mut unnamed.clone(), &[], t0(), &cpu_default);
        assert_eq!(
            (d.launch, d.image.as_deref()),
            (Some(1), Some("registry.example/headroom-worker:1"))
        );

        let d = step_with(&mut unnamed, &[], t0(), &WorkerImages::default());
        assert_eq!(d.status.phase, Some(JobPhase::Failed));
        assert_eq!((d.launch, d.initialize, d.image), (None, None, None));
        assert!(d.status.attempts.is_empty(), "nothing was planned");
        assert!(has_condition(
            &d.status,
            ConditionType::Failed,
            true,
            Reason::InvalidSpec
        ));
        assert_eq!(
            d.status.message.as_deref(),
            Some(
                "spec.worker.image: required: this operator has no default image for backend flex (install the chart with workerImages.cpu, which sets --worker-image, or set spec.worker.image)"
            )
        );
        assert!(
            d.events
                .iter()
                .any(|e| e.reason == Reason::InvalidSpec && e.note.contains("spec.worker.image")),
            "{:?}",
            d.events
        );
        // Final: a default that appears later does not revive it.
        let later = step_with(&mut unnamed, &[], t0(), &cpu_default);
        assert_eq!(
            (later.status.phase, later.launch),
            (Some(JobPhase::Failed), None)
        );

        // A fine-tuning job: not even the initializer starts.
        let mut finetune = finetune_job();
        finetune.spec.worker.image = None;
        let d = step_with(&mut finetune, &[], t0(), &WorkerImages::default());
        assert_eq!(
            (d.status.phase, d.initialize),
            (Some(JobPhase::Failed), None)
        );
    }

    fn refusal(code: u16) -> LaunchRefusal {
        LaunchRefusal {
            object: "Pod oom-then-fit-a1-s1".into(),
            code,
            message: "denied by policy".into(),
            heals: LaunchRefusal::heals(code),
        }
    }

    #[test]
    fn a_refusal_that_can_pass_is_reported_and_the_attempt_waits() {
        let mut j = oom_job();
        let d = step(&mut j, &[], t0());
        let after = launch_refused(&d, &j, 1, &refusal(403), &[], t0());
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
            let after = launch_refused(&d, &j, 1, &refusal(code), &[&created], t0());
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
            assert_eq!(next.launch, None);
        }
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

    /// A user deletes the worker pod: the worker checkpoints and exits 143.
    /// That is a disruption: the next attempt starts at once and no attempt
    /// is used up, even with maxAttempts 1.
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
        assert_eq!(d.launch, Some(2), "resumes at once, no backoff");
        assert_eq!(d.status.phase, Some(JobPhase::Retrying));
        // A real failure afterwards is still held to maxAttempts 1.
        let d = step(&mut j, &[pod(1, 0, SIGTERM), pod(2, 0, CRASH)], t0());
        assert_eq!(d.status.phase, Some(JobPhase::Failed));
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
        assert_eq!(d.launch, Some(1));
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
        assert_eq!(d.launch, Some(2), "resumes at once");
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
        assert_eq!(d.launch, None);
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
        assert_eq!(early.launch, Some(1));
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
        assert_eq!(late.launch, Some(1));
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

    /// A launch writes the status and creates the pods in one round; when
    /// the status write is lost, the next decision must not plan afresh over
    /// pods that run another plan (it would record one plan and run another).
    #[test]
    fn pods_of_an_attempt_whose_status_write_was_lost_keep_their_plan() {
        use crate::controller::children::{Slot, worker_pod};
        use crate::controller::config::ChildConfig;
        let mut j = oom_job();
        let planned_now = step(&mut j.clone(), &[], t0());
        let mut theirs = planned_now.status.attempts[0].plan.clone();
        theirs
            .warnings
            .push("made before the inventory changed".into());
        let model = planned_now.model.clone().expect("model");
        let pod = worker_pod(
            &j,
            1,
            Slot {
                stage: 0,
                replica: 0,
            },
            &theirs,
            &model,
            "worker:test",
            &ChildConfig::default(),
        )
        .expect("pod");

        let d = step(&mut j, &[pod], t0());
        assert_eq!(d.launch, Some(1));
        assert_eq!(d.status.attempts.len(), 1);
        assert_eq!(
            d.status.attempts[0].plan, theirs,
            "the status records the plan the pods run"
        );
        assert_eq!(d.status.plan.as_ref(), Some(&theirs));
    }
}
