//! The reconcile decision: given a job, its pods and the inventory, what the
//! status should say, which attempt's children must exist, which pods to stop
//! and which events to record. Pure, so every branch is unit-tested; the I/O
//! around it lives in `reconcile.rs` and `apply.rs`. Every change of phase
//! and every attempt opened or closed goes through
//! [`lifecycle::enter`](super::lifecycle::enter); the next plan after a
//! failed attempt comes from the planner's one [`replan`](headroom_planner::replan).
//!
//! By concern, each with its tests:
//! * this file — the decision's types and its entry: a job is checked,
//!   initialized, planned, and its current attempt followed or the next chosen
//! * [`attempt`] — what the running attempt's pods say, as one [`attempt::Verdict`]
//! * [`retry`] — after an attempt ends: the next plan, backoff, waiting for capacity
//! * [`initialize`] — a `model.pretrained` job's initializer runs
//! * [`disk`] — the plan's files against the job's checkpoint claim
//! * [`refused`] — the API server refused what a decision asked for

mod attempt;
mod deadline;
mod disk;
#[cfg(test)]
mod fixtures;
mod initialize;
pub mod refused;
mod retry;
mod suspend;
mod ttl;

use std::time::Duration;

use headroom_api::{
    JobPhase, LABEL_ATTEMPT, MemoryAwareTrainingJob, MemoryAwareTrainingJobStatus, PLAN_JSON_ENV,
    Recipe, WORKER_MAX_STAGES, WorkerAssignment,
};
use headroom_planner::{
    Deadline, FailureCause, Inventory, JobRequest, ModelShape, NoFeasiblePlan, Plan, SearchOptions,
    Target, plan_with, replan_within,
};
use jiff::Timestamp;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;

use super::config::WorkerImages;
use super::lifecycle::{JobEvent, Reason, Stamp, Transition, enter};
use super::pods::{CacheRole, CacheState};

/// What reconcile should do.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    /// The whole operator-owned status (telemetry `workers` are left to the workers).
    pub status: MemoryAwareTrainingJobStatus,
    pub events: Vec<JobEvent>,
    /// The attempt whose children must exist (created when missing).
    pub launch: Option<Launch>,
    /// The initializer run whose pod must exist (created when missing).
    pub initialize: Option<InitializerRun>,
    /// Pods to delete (the live stages of an attempt that has failed as a whole).
    pub delete_pods: Vec<String>,
    /// When to look again even without a change.
    pub requeue_after: Option<Duration>,
    /// The attempt that just ended, for metrics.
    pub ended: Option<headroom_api::AttemptOutcome>,
    /// The checkpoint claim to grow before the next attempt starts (its
    /// last one filled it).
    pub grow_claim: Option<ClaimGrowth>,
    /// Delete the job object: it ended `spec.ttlSecondsAfterFinished` ago.
    pub delete_job: bool,
    /// The write to the shared model cache claim this decision needs.
    pub model_cache: Option<CacheWrite>,
}

/// A claim to grow: its name and its new size, bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClaimGrowth {
    pub claim: String,
    pub to_bytes: u64,
}

/// The job's checkpoint claim, as a full volume's retry needs it (read
/// only when an attempt found the volume full).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClaimFacts {
    /// The size the claim asks for (`spec.resources.requests.storage`,
    /// else its capacity), bytes; `None` when it could not be read.
    pub size_bytes: Option<u64>,
    /// Its StorageClass (the cluster's default is written into the claim
    /// when it is made).
    pub storage_class: Option<String>,
    /// The class's `allowVolumeExpansion`; `None`: the class could not be read.
    pub expandable: Option<bool>,
}

/// An attempt to launch: everything its pods are built from besides the
/// job and its plan (which the status holds).
#[derive(Clone, Debug, PartialEq)]
pub struct Launch {
    pub attempt: u32,
    /// The validated model the workers build.
    pub model: ModelShape,
    /// The image the job's pods run: `spec.worker.image`, else the
    /// operator's default for the job's backend.
    pub image: String,
    /// The optimizer recipe the run follows (`status.recipe`).
    pub recipe: Recipe,
}

#[cfg(test)]
impl Launch {
    /// Attempt `attempt` of `job` with the recipe its spec asks for (tests).
    pub fn of(
        job: &MemoryAwareTrainingJob,
        attempt: u32,
        model: &ModelShape,
        image: &str,
    ) -> Launch {
        Launch {
            attempt,
            model: model.clone(),
            image: image.into(),
            recipe: job.spec.training.recipe(None).expect("a recipe"),
        }
    }
}

/// An initializer run to start (or keep), and the image it runs.
#[derive(Clone, Debug, PartialEq)]
pub struct InitializerRun {
    pub run: u32,
    pub image: String,
    /// It downloads into the shared model cache claim (`status.modelCache`).
    pub fill_cache: bool,
}

impl Decision {
    fn keep(status: MemoryAwareTrainingJobStatus) -> Decision {
        Decision {
            status,
            events: vec![],
            launch: None,
            initialize: None,
            delete_pods: vec![],
            requeue_after: None,
            ended: None,
            grow_claim: None,
            delete_job: false,
            model_cache: None,
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
    /// How long planning this job may take (the operator's
    /// `--planning-budget-seconds`): past it the job fails and the
    /// operator goes on with its other jobs.
    pub planning_budget: Duration,
    /// Host memory a GPU worker pod gets when its job does not set
    /// `resources.gpu.hostMemory` (the operator's `--gpu-host-memory`), bytes.
    pub default_gpu_host_memory: u64,
    /// The size of a checkpoint claim whose job sets no
    /// `spec.checkpoints.size` and is not planned when the claim is made
    /// (the operator's `--checkpoint-size`), bytes.
    pub default_checkpoint_bytes: u64,
    /// The operator's images for jobs that name none, by backend.
    pub worker_images: &'a WorkerImages,
    /// The job's Kueue queue, when it names one (`crate::kueue`).
    pub queue: Option<&'a QueueView>,
    /// The job's checkpoint claim, when an attempt found it full.
    pub claim: Option<&'a ClaimFacts>,
    /// The shared model cache claim the job uses (`status.modelCache`), or
    /// would use before its first initializer; `None` for a job that
    /// downloads its own copy.
    pub model_cache: Option<&'a CacheView>,
}

/// A shared model cache claim as the decision needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheView {
    pub claim: String,
    pub state: CacheState,
    /// The claim's resourceVersion (a take-over is guarded by it).
    pub resource_version: Option<String>,
}

/// What reconcile writes to the job's model cache claim.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CacheWrite {
    /// Create it, `filling` by this job (the lock: refused when another
    /// job made it first), before the initializer that fills it.
    Create { claim: String },
    /// Become the filler of a claim whose filler ended without filling
    /// it, guarded by its resourceVersion.
    TakeOver {
        claim: String,
        resource_version: String,
    },
    /// Record a use now (a reading initializer starts).
    Used { claim: String },
    /// This job's initializer filled it: `ready`, with the commit.
    Ready {
        claim: String,
        commit: Option<String>,
    },
}

/// A queued job's queue as the decision needs it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct QueueView {
    /// `LocalQueue a (ClusterQueue b)`, or the LocalQueue's name alone when
    /// its ClusterQueue could not be read.
    pub queue: String,
    /// Kueue's word on why the current attempt's pod group is not admitted.
    pub waiting: Option<String>,
}

/// A decision being made: the observation, what is decided so far, and what
/// a launch needs once the job is known to be runnable.
struct Builder<'a> {
    obs: &'a Observation<'a>,
    d: Decision,
    image: Option<String>,
    model: Option<ModelShape>,
}

/// Decides the next step for one job.
pub fn decide(obs: &Observation<'_>) -> Decision {
    let mut status = obs.job.status.clone().unwrap_or_default();
    status.observed_generation = obs.job.metadata.generation;
    let mut b = Builder {
        obs,
        d: Decision::keep(status),
        image: None,
        model: None,
    };
    b.run();
    b.look_again_at_the_deadline();
    b.d
}

impl Builder<'_> {
    fn run(&mut self) {
        if matches!(
            self.d.status.phase,
            Some(JobPhase::Succeeded | JobPhase::Failed)
        ) {
            // A job's completion is final; all that is left is its expiry.
            return self.expire();
        }
        if self.obs.job.spec.suspend {
            return self.suspend();
        }
        self.resume();
        if self.past_active_deadline() {
            return;
        }
        // Every pod the job gets (initializer, workers) runs this image:
        // without one, nothing can start.
        match self.obs.worker_images.resolve(&self.obs.job.spec) {
            Ok(image) => self.image = Some(image),
            Err(e) => return self.fail(Reason::InvalidSpec, e.to_string()),
        }
        // A hub's token goes only to an https endpoint unless the job opts
        // in (the API server's CEL rule; a job stored before it, or under an
        // older CRD, is refused here before any initializer gets the token).
        if let Err(e) = self.obs.job.spec.check_hub_endpoints() {
            return self.fail(Reason::InvalidSpec, e.to_string());
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
        self.model = Some(request.model.clone());
        if !self.record_recipe() {
            return;
        }
        let Some(current) = self.d.status.attempts.last().cloned() else {
            let opts = SearchOptions {
                deadline: Some(self.deadline()),
                ..SearchOptions::default()
            };
            return match guarded(|| plan_with(&request, self.obs.inventory, &opts)) {
                Ok(p) => self.start(1, p, None),
                Err(e) => self.no_plan(e),
            };
        };
        if current.outcome == headroom_api::AttemptOutcome::Running {
            self.follow(&current, &request);
        } else {
            self.after_attempt(&current, None, &request);
        }
    }

    /// The next plan after the current attempt's (`status.plan`, which each
    /// attempt's start records: the attempts keep only a summary), corrected
    /// by `cause`. A status without a plan (never written so by the
    /// operator) plans afresh.
    fn replan_current(
        &self,
        request: &JobRequest,
        cause: &FailureCause,
    ) -> Result<Plan, headroom_planner::NoFeasiblePlan> {
        let deadline = self.deadline();
        guarded(|| match &self.d.status.plan {
            Some(current) => {
                replan_within(request, self.obs.inventory, current, cause, Some(deadline))
            }
            None => plan_with(
                request,
                self.obs.inventory,
                &SearchOptions {
                    deadline: Some(deadline),
                    ..SearchOptions::default()
                },
            ),
        })
    }

    /// When planning that starts now must give up.
    fn deadline(&self) -> Deadline {
        Deadline::after(self.obs.planning_budget)
    }

    /// Attempt `attempt`'s children must exist.
    fn launch(&mut self, attempt: u32) {
        // `run` set both before any path that launches.
        if let (Some(model), Some(image), Some(recipe)) =
            (&self.model, &self.image, &self.d.status.recipe)
        {
            self.d.launch = Some(Launch {
                attempt,
                model: model.clone(),
                image: image.clone(),
                recipe: recipe.clone(),
            });
        }
    }

    /// The recipe every attempt follows: the one recorded in the status, or,
    /// before the first attempt, the spec's (over the data the initializer
    /// found, which `training.epochs` counts), recorded now. False when the
    /// spec asks for a recipe that cannot be run: the job failed.
    fn record_recipe(&mut self) -> bool {
        if self.d.status.recipe.is_some() {
            return true;
        }
        let training = &self.obs.job.spec.training;
        match training.recipe(self.d.status.data.as_ref()) {
            Ok(recipe) => {
                self.d.status.recipe = Some(recipe);
                true
            }
            Err(e) => {
                self.fail(Reason::InvalidSpec, e.to_string());
                false
            }
        }
    }

    /// Initializer run `run`'s pod must exist, running the first run's
    /// image; a job whose image has changed since is failed instead.
    fn keep_initializer(&mut self, run: u32) {
        if let Some(image) = self.initializer_image() {
            let fill_cache = matches!(self.cache_role(), Some(CacheRole::Fill { .. }));
            self.cache_write_for_initializer();
            self.d.initialize = Some(InitializerRun {
                run,
                image,
                fill_cache,
            });
        }
    }

    /// The image an initializer run may run: the one the first run ran
    /// (recorded in the status then). The initializer mounts the hub's
    /// token, and admission checks a job's Secrets when it is written, not
    /// when a retry starts: a job whose `spec.worker.image` was changed
    /// after its first run would otherwise hand the token to an image no
    /// one with `get` on the Secret chose. Such a job fails (None). A job
    /// that names no image gets the operator's own default, which the
    /// cluster's administrator chose: an upgraded default is no such change.
    fn initializer_image(&mut self) -> Option<String> {
        let image = self.image.clone()?;
        match self.d.status.initializer_image.clone() {
            None => {
                self.d.status.initializer_image = Some(image.clone());
                Some(image)
            }
            Some(first) if first == image || self.obs.job.spec.worker.image.is_none() => {
                Some(image)
            }
            Some(first) => {
                self.fail(
                    Reason::InvalidSpec,
                    format!(
                        "spec.worker.image: changed from {first} to {image} while the job was \
                         initializing; a later initializer run (it is given the hub token) \
                         runs only the image of the first: create a new job to run {image}"
                    ),
                );
                None
            }
        }
    }

    fn start(&mut self, number: u32, plan: Plan, retry: Option<String>) {
        // The operator creates an attempt's pods in the same round as the
        // status write that records it. When that write was lost (refused,
        // or the operator stopped between the two), the pods exist already:
        // they keep the plan they run, and the status records that plan,
        // not one made now from a changed inventory.
        let launched = self.launched_plan(number);
        let mut plan = launched.clone().unwrap_or(plan);
        if plan.disk.is_none()
            && let Some(model) = &self.model
        {
            let inputs = super::pods::disk_inputs(self.obs.job, &self.d.status);
            plan.disk = Some(plan.disk_needs(model, &inputs));
        }
        // The first attempt's claim is made now (or was, at a size this
        // plan did not choose, and may grow): one that cannot hold the
        // plan's files would fill up mid-run.
        if number == 1
            && launched.is_none()
            && let Some(disk) = &plan.disk
        {
            match self.claim_for_plan(disk) {
                Ok(growth) => self.d.grow_claim = growth,
                Err(problem) => return self.fail(Reason::InvalidSpec, problem),
            }
        }
        self.enter(Transition::Start {
            number,
            plan: Box::new(plan),
            retry,
        });
        self.launch(number);
    }

    /// The plan attempt `number`'s pods run, when any exist: what the
    /// worker's assignment (its `HEADROOM_PLAN` variable) says.
    fn launched_plan(&self, number: u32) -> Option<Plan> {
        of_attempt(self.obs.pods, number)
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
            .then(|| super::pods::checkpoint_claim_name(job));
        self.enter(Transition::Succeeded { attempt, kept_in });
    }

    fn fail(&mut self, reason: Reason, message: String) {
        self.enter(Transition::Failed { reason, message });
        self.d.launch = None;
    }

    /// The one way the job moves: [`enter`] writes phase, conditions,
    /// attempts and the event together.
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

/// Runs the planner, so that a panic in it (an arithmetic overflow on a
/// shape nothing refused, say) fails this job with no feasible plan, the
/// panic's message the reason, and the operator goes on with its other jobs.
/// The planner is pure: nothing it touched outlives the call.
fn guarded(
    planning: impl FnOnce() -> Result<Plan, NoFeasiblePlan>,
) -> Result<Plan, NoFeasiblePlan> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(planning)).unwrap_or_else(|panic| {
        let what = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic".into());
        Err(NoFeasiblePlan {
            summary: format!(
                "the planner stopped on this job ({what}); the model's shape or the job's sizes are beyond what it computes"
            ),
            details: vec![],
            waits_for: None,
            out_of_time: None,
        })
    })
}

/// The pods of attempt `attempt` (by their attempt label).
fn of_attempt<'a>(pods: &'a [&'a Pod], attempt: u32) -> impl Iterator<Item = &'a Pod> + 'a {
    let label = attempt.to_string();
    pods.iter()
        .copied()
        .filter(move |p| p.labels().get(LABEL_ATTEMPT) == Some(&label))
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
    // What the pods will request (the pod builders): the plan then fits only
    // node types that can hold it.
    request.default_host_baseline(default_gpu_host_memory);
    Ok(request)
}

#[cfg(test)]
mod tests {
    use super::fixtures::*;

    /// A panic while planning (an overflow, say) is no plan for this job,
    /// with the panic's words; the operator's other jobs go on.
    #[test]
    fn a_panic_while_planning_is_no_plan_not_a_crash() {
        let refused = super::guarded(|| {
            let layers: u64 = std::hint::black_box(u64::MAX);
            let _ = layers
                .checked_mul(2)
                .expect("attempt to multiply with overflow");
            unreachable!("refused above")
        })
        .expect_err("no plan");
        assert!(
            refused
                .summary
                .contains("attempt to multiply with overflow")
                && refused.waits_for.is_none(),
            "{refused:?}"
        );
        let mut j = oom_job();
        let d = step(&mut j, &[], t0());
        assert_eq!(launched(&d), Some(1), "planning goes on");
    }

    /// A job whose planning runs past the operator's budget fails with a
    /// reason that names the budget and what to change; the next job is
    /// planned as usual. (A zero budget has passed when the search first
    /// looks at the clock, inside its loop: the planner's own tests show
    /// the same for every replan.)
    #[test]
    fn planning_past_its_time_budget_fails_the_job_and_the_operator_goes_on() {
        use std::time::Duration;
        let mut slow = oom_job();
        let d = step_within(
            &mut slow,
            &[],
            t0(),
            (&WorkerImages::default(), None),
            Duration::ZERO,
        );
        assert_eq!(launched(&d), None);
        assert_eq!(d.status.phase, Some(JobPhase::Failed));
        assert!(has_condition(
            &d.status,
            ConditionType::Failed,
            true,
            Reason::NoFeasiblePlan
        ));
        let message = d.status.message.clone().unwrap_or_default();
        assert!(
            message.contains("time budget of 0ns")
                && message.contains("--planning-budget-seconds")
                && message.contains("planningBudgetSeconds")
                && message.contains("training.pipelineStages"),
            "{message}"
        );
        let mut next = oom_job();
        let d = step(&mut next, &[], t0());
        assert_eq!(launched(&d), Some(1), "planning goes on");
    }

    #[test]
    fn a_new_job_is_planned_and_launched() {
        let mut j = oom_job();
        let d = step(&mut j, &[], t0());
        assert_eq!(launched(&d), Some(1));
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
        assert_eq!(launched(&again), Some(1));
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
            (launched(&d), d.launch.as_ref().map(|l| l.image.as_str())),
            (Some(1), Some("localhost/headroom-worker:dev")),
            "a job that names its image needs no default"
        );

        let mut unnamed = oom_job();
        unnamed.spec.worker.image = None;
        let d = step_with(&mut unnamed.clone(), &[], t0(), &cpu_default);
        assert_eq!(
            (launched(&d), d.launch.as_ref().map(|l| l.image.as_str())),
            (Some(1), Some("registry.example/headroom-worker:1"))
        );

        let d = step_with(&mut unnamed, &[], t0(), &WorkerImages::default());
        assert_eq!(d.status.phase, Some(JobPhase::Failed));
        assert_eq!((launched(&d), initializer(&d)), (None, None));
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
            (later.status.phase, launched(&later)),
            (Some(JobPhase::Failed), None)
        );

        // A fine-tuning job: not even the initializer starts.
        let mut finetune = finetune_job();
        finetune.spec.worker.image = None;
        let d = step_with(&mut finetune, &[], t0(), &WorkerImages::default());
        assert_eq!(
            (d.status.phase, initializer(&d)),
            (Some(JobPhase::Failed), None)
        );
    }
}
