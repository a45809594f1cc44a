//! One worker process from start to exit: read the plan, resume, train,
//! checkpoint, report, and leave with the contract's exit code and a
//! termination message on every path.
//!
//! Exit codes (`headroom_api::exit_code`, each from its
//! [`WorkerOutcome`]): 0 success; `INVALID_PLAN` for an environment or a plan
//! that is missing, malformed, inconsistent or that this worker cannot run;
//! `DEVICE_OUT_OF_MEMORY` for an allocation failure caught in process (a
//! CUDA/cubecl out-of-memory panic, or the optional soft limit
//! `HEADROOM_DEVICE_MEMORY_LIMIT_BYTES`); `PEER_LOST` when a pipeline
//! neighbour or a data-parallel replica of the stage went away (or never
//! came up); `TERMINATED` when told to stop (SIGTERM) after saving a
//! checkpoint at the step reached; `FAILURE` for anything else. A kernel OOM kill (137)
//! never reaches us.

use std::net::TcpListener;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use burn::tensor::Device;
use headroom_api::{
    PIPELINE_ADDRESSES_ENV, PIPELINE_PODS_ENV, PIPELINE_PORT, REPLICA_ADDRESSES_ENV,
    REPLICA_PODS_ENV, REPLICA_PORT, TerminationMessage, WORKER_API_ENV, WorkerOutcome,
};

use crate::assignment::ValidAssignment;
use crate::checkpoint::CheckpointError;
use crate::cluster::ClusterHandle;
use crate::collective::{Collective, CollectiveError, Ring, RingHello, RingTimeouts, Single};
use crate::env::{COLLECTIVE_ENV, CollectiveChoice, InvalidEnv, PipelinePeers, WorkerEnv};
pub use crate::env::{DEVICE_MEMORY_LIMIT_ENV, TERMINATION_MESSAGE_PATH_ENV};
use crate::gpu_runtime::{self, RuntimeSettings};
use crate::link_auth::{KeyError, LinkKey};
use crate::pipeline::{Hello, Links, Peers, PipelineError, establish};
use crate::report::{
    DEFAULT_SAMPLE_EVERY, Progress, Reporter, TelemetrySink, WorkerApiSink, WorkerIdentity,
    WritePolicy,
};
use crate::telemetry::{MemoryProbe, process_memory};
use crate::train::{StepError, Trainer, training_device};
use crate::worker_api::WorkerApi;
use crate::write_termination_message;
use headroom_planner::Backend;

/// How the process ends: the termination message, whose outcome gives the exit code.
#[derive(Clone, Debug, PartialEq)]
pub struct Exit {
    pub message: TerminationMessage,
}

impl Exit {
    pub fn new(outcome: WorkerOutcome, reason: impl Into<String>) -> Self {
        Exit {
            message: TerminationMessage {
                outcome,
                reason: reason.into(),
                step: None,
                peak_bytes: None,
                requested_bytes: None,
            },
        }
    }

    /// The process exit code: the outcome's.
    pub fn code(&self) -> i32 {
        self.message.outcome.exit_code()
    }

    fn invalid_plan(reason: impl Into<String>) -> Self {
        Exit::new(WorkerOutcome::InvalidPlan, reason)
    }

    fn failed(reason: impl Into<String>) -> Self {
        Exit::new(WorkerOutcome::Failed, reason)
    }

    fn pipeline(e: &PipelineError) -> Self {
        match e {
            PipelineError::PeerLost { .. } => Exit::new(WorkerOutcome::PeerLost, e.to_string()),
            PipelineError::Protocol(_) => Exit::failed(e.to_string()),
        }
    }

    /// A replica of the stage went away (`PEER_LOST`, as a pipeline
    /// neighbour), or the replicas disagree (a failure).
    fn replicas(e: &CollectiveError) -> Self {
        let reason = format!("data-parallel replicas: {e}");
        match e {
            CollectiveError::PeerLost { .. } => Exit::new(WorkerOutcome::PeerLost, reason),
            CollectiveError::Protocol(_) | CollectiveError::InvalidSegments(_) => {
                Exit::failed(reason)
            }
        }
    }

    fn step(e: &StepError) -> Self {
        match e {
            StepError::Pipeline(e) => Exit::pipeline(e),
            StepError::Replicas(e) => Exit::replicas(e),
        }
    }

    /// Stamps the step reached, unless the exit already names one (a panic
    /// or a memory limit names the step under way), and the peak so far.
    fn at(mut self, step: u64, peak: u64) -> Self {
        self.message.step.get_or_insert(step);
        let peak = peak.max(self.message.peak_bytes.unwrap_or(0));
        self.message.peak_bytes = (peak > 0).then_some(peak);
        self
    }
}

/// What the replicas of a stage exchange through, once their TCP ring is up:
/// the ring itself on the CPU; on CUDA, NCCL formed over the ring unless
/// `HEADROOM_COLLECTIVE=ring` says otherwise or libnccl cannot be loaded
/// (then the ring, slower, with a warning). Every replica decides alike
/// (same binary, image and environment); one that does not finds out at the
/// first exchange (the ring's frames and NCCL's id do not match).
fn replica_collective(
    ring: Ring,
    backend: Backend,
    choice: CollectiveChoice,
) -> Result<Box<dyn Collective>, CollectiveError> {
    #[cfg(feature = "cuda")]
    if backend == Backend::Cuda {
        use crate::collective::nccl::{Nccl, available};
        match choice {
            CollectiveChoice::Ring => tracing::info!(
                "replica ring: {COLLECTIVE_ENV}=ring, the replicas exchange over TCP"
            ),
            CollectiveChoice::Auto => match available() {
                Ok(version) => {
                    tracing::info!(
                        nccl = version,
                        "replica ring: forming the NCCL communicator"
                    );
                    // Device 0: the one `training_device` trains on.
                    return Ok(Box::new(Nccl::over(ring, 0)?));
                }
                Err(missing) => tracing::warn!(
                    "replica ring: no NCCL ({missing}); the replicas exchange over TCP through \
                     host memory instead, slower ({COLLECTIVE_ENV}=ring chooses this quietly)"
                ),
            },
        }
    }
    #[cfg(not(feature = "cuda"))]
    let _ = (backend, choice, COLLECTIVE_ENV);
    Ok(Box::new(ring))
}

/// If a panic message is an out-of-memory error, the bytes requested (when said).
pub fn out_of_memory(message: &str) -> Option<Option<u64>> {
    let lower = message.to_lowercase();
    let oom = [
        "out of memory",
        "out-of-memory",
        "outofmemory",
        "out of device memory",
        "cuda_error_out_of_memory",
        "memory allocation of",
    ]
    .iter()
    .any(|needle| lower.contains(needle));
    if !oom {
        return None;
    }
    // cubecl: "out of device memory allocating {size} bytes"; std: "memory allocation of {n} bytes failed".
    let requested = ["allocating ", "allocation of "].iter().find_map(|marker| {
        let rest = &lower[lower.find(marker)? + marker.len()..];
        let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
        digits.parse().ok()
    });
    Some(requested)
}

fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "panic without a message".into())
}

/// Runs the worker to its exit and writes the termination message (to the
/// path the environment names, even when the rest of it is unusable).
pub fn run(env: Result<WorkerEnv, InvalidEnv>) -> Exit {
    let (path, exit) = match env {
        Ok(env) => {
            let exit = run_inner(&env);
            (env.termination_message_path, exit)
        }
        Err(invalid) => (
            invalid.termination_message_path,
            Exit::invalid_plan(invalid.error.to_string()),
        ),
    };
    if let Err(e) = write_termination_message(&path, &exit.message) {
        tracing::warn!(
            "cannot write the termination message to {}: {e}",
            path.display()
        );
    }
    match exit.message.outcome {
        WorkerOutcome::Succeeded => tracing::info!(reason = %exit.message.reason, "succeeded"),
        outcome => {
            tracing::error!(code = exit.code(), %outcome, reason = %exit.message.reason, "exiting")
        }
    }
    exit
}

fn run_inner(env: &WorkerEnv) -> Exit {
    let plan = match ValidAssignment::load(&env.plan) {
        Ok(plan) => plan,
        Err(e) => return Exit::invalid_plan(e.to_string()),
    };
    let config = plan.config();
    if cfg!(feature = "cuda") {
        let a = plan.assignment();
        let cache = env
            .gpu_cache_dir
            .clone()
            .unwrap_or_else(|| gpu_runtime::cache_dir(&env.checkpoint_dir, a.stage, a.replica));
        let settings = RuntimeSettings::for_plan(
            config.backend,
            a.plan.gpu_runtime,
            &a.plan.device,
            Some(cache),
        );
        if let Some(settings) = settings {
            match gpu_runtime::install(&settings) {
                Ok(()) => tracing::info!(runtime = %settings.runtime, "GPU runtime configured"),
                Err(e) => tracing::warn!("GPU runtime not configured as planned: {e}"),
            }
        }
    }
    let device = match training_device(config.backend, config.settings.precision) {
        Ok(d) => d,
        Err(e) => return Exit::invalid_plan(e.to_string()),
    };
    let cluster = match ClusterHandle::new() {
        Ok(cluster) => cluster,
        Err(e) => return Exit::failed(format!("tokio runtime: {e}")),
    };
    let identity = identity(&plan, env.pod_name.clone());
    let worker_api = match WorkerApi::from_env() {
        Ok(api) => api,
        Err(e) => return Exit::invalid_plan(e.to_string()),
    };
    let sink = WorkerApiSink::connect(worker_api.as_ref(), &identity)
        .map(|sink| Box::new(sink) as Box<dyn TelemetrySink>);
    // A GPU plan budgets the device's memory; the host's is the pod's limit.
    let peak_on_device = config.backend != Backend::Flex;
    let mut probe = MemoryProbe::for_this_process(Some(device.clone()));
    if peak_on_device {
        probe = probe.device_peak();
    }
    let reporter = Reporter::start(
        identity,
        probe,
        sink,
        DEFAULT_SAMPLE_EVERY,
        WritePolicy::new(env.telemetry_interval),
    );
    let terminate = cluster.watch_sigterm();
    let exit = Training {
        plan: &plan,
        env,
        worker_api: worker_api.as_ref(),
        reporter: &reporter,
        terminate: &terminate,
        peak_on_device,
    }
    .run(device);
    let last = reporter.finish();
    let peak = last.peak_bytes.max(exit.message.peak_bytes.unwrap_or(0));
    let mut exit = exit;
    exit.message.peak_bytes = (peak > 0).then_some(peak);
    exit
}

/// Who reports: the pod (its name, else one made up from the assignment) and its stage.
fn identity(plan: &ValidAssignment, pod: Option<String>) -> WorkerIdentity {
    let a = plan.assignment();
    let layers = &plan.config().layout.layers;
    let replica = if a.plan.replicas > 1 {
        format!("-replica{}", a.replica)
    } else {
        String::new()
    };
    WorkerIdentity {
        name: pod.unwrap_or_else(|| format!("{}-{}-stage{}{replica}", a.job, a.attempt, a.stage)),
        job: a.job.clone(),
        namespace: a.namespace.clone(),
        attempt: a.attempt,
        stage: a.stage,
        layer_start: layers.start,
        layer_end: layers.end,
    }
}

/// What the training loop needs, gathered once by `run_inner`.
struct Training<'a> {
    plan: &'a ValidAssignment,
    env: &'a WorkerEnv,
    /// For the pipeline's and the ring's neighbour lookup; `None`: DNS only.
    worker_api: Option<&'a WorkerApi>,
    reporter: &'a Reporter,
    /// Set by SIGTERM.
    terminate: &'a AtomicBool,
    /// The plan budgets GPU memory: the process's host memory is not the peak.
    peak_on_device: bool,
}

impl Training<'_> {
    /// The highest memory figure seen so far, bytes.
    fn peak_now(&self) -> u64 {
        let host = if self.peak_on_device {
            0
        } else {
            process_memory().1.unwrap_or(0)
        };
        self.reporter.peak().max(host)
    }

    fn save(&self, trainer: &Trainer, loss: Option<f64>) -> Result<PathBuf, CheckpointError> {
        trainer.save_checkpoint(
            &self.env.checkpoint_dir,
            self.plan.assignment().attempt,
            loss,
        )
    }

    /// How this stage reaches the others and the socket its predecessor
    /// calls (a multi-stage plan only).
    fn pipeline_setup(&self, stages: u32) -> Result<(Peers, Option<TcpListener>), Exit> {
        let a = self.plan.assignment();
        let (peers, port) = match &self.env.pipeline_peers {
            Some(PipelinePeers::Addresses(addresses)) => {
                let own = addresses.get(a.stage as usize).cloned().unwrap_or_default();
                let port = own
                    .rsplit_once(':')
                    .and_then(|(_, p)| p.parse::<u16>().ok())
                    .ok_or_else(|| {
                        Exit::invalid_plan(format!(
                            "{PIPELINE_ADDRESSES_ENV}: stage {} needs a host:port entry, got {own:?}",
                            a.stage
                        ))
                    })?;
                (Peers::Static(addresses.clone()), port)
            }
            Some(PipelinePeers::Pods { pods, service }) => (
                Peers::Pods {
                    pods: pods.clone(),
                    dns: (0..pods.len() as u32)
                        .map(|k| format!("{}.{service}", host_name(k, a.replica, a.plan.replicas)))
                        .collect(),
                    port: PIPELINE_PORT,
                    api: self.worker_api.cloned(),
                },
                PIPELINE_PORT,
            ),
            None => {
                return Err(Exit::invalid_plan(format!(
                    "a {stages}-stage plan needs {PIPELINE_PODS_ENV} (set by the operator) or {PIPELINE_ADDRESSES_ENV}"
                )));
            }
        };
        let listener = if a.stage > 0 {
            Some(TcpListener::bind(("0.0.0.0", port)).map_err(|e| {
                Exit::failed(format!("pipeline: cannot listen on port {port}: {e}"))
            })?)
        } else {
            None
        };
        Ok((peers, listener))
    }

    /// This replica's ring: one `host:port` per replica (the next one's
    /// resolved; the others are never called) and its listening socket, on
    /// which the previous replica calls.
    fn ring_setup(&self, replicas: u32) -> Result<(Vec<String>, TcpListener), Exit> {
        let a = self.plan.assignment();
        let next = (a.replica + 1) % replicas;
        let count = |n: usize, variable: &str| {
            if n == replicas as usize {
                Ok(())
            } else {
                Err(Exit::invalid_plan(format!(
                    "{variable}: {n} entries for a plan with {replicas} replicas"
                )))
            }
        };
        match &self.env.replica_peers {
            Some(PipelinePeers::Addresses(addresses)) => {
                count(addresses.len(), REPLICA_ADDRESSES_ENV)?;
                let own = &addresses[a.replica as usize];
                let port = own
                    .rsplit_once(':')
                    .and_then(|(_, p)| p.parse::<u16>().ok())
                    .ok_or_else(|| {
                        Exit::invalid_plan(format!(
                            "{REPLICA_ADDRESSES_ENV}: replica {} needs a host:port entry, got {own:?}",
                            a.replica
                        ))
                    })?;
                Ok((addresses.clone(), self.listen(port)?))
            }
            Some(PipelinePeers::Pods { pods, service }) => {
                count(pods.len(), REPLICA_PODS_ENV)?;
                // Listen first: the previous replica may be calling already.
                let listener = self.listen(REPLICA_PORT)?;
                let dns = (!service.is_empty())
                    .then(|| format!("{}.{service}", host_name(a.stage, next, replicas)));
                let pod = &pods[next as usize];
                let address = self.pod_address(pod, dns, REPLICA_PORT, next)?;
                let mut addresses: Vec<String> =
                    pods.iter().map(|p| format!("{p}:{REPLICA_PORT}")).collect();
                addresses[next as usize] = address;
                Ok((addresses, listener))
            }
            None => Err(Exit::invalid_plan(format!(
                "a plan with {replicas} replicas needs {REPLICA_PODS_ENV} (set by the operator) or {REPLICA_ADDRESSES_ENV}"
            ))),
        }
    }

    fn listen(&self, port: u16) -> Result<TcpListener, Exit> {
        TcpListener::bind(("0.0.0.0", port)).map_err(|e| {
            Exit::failed(format!(
                "data-parallel replicas: cannot listen on port {port}: {e}"
            ))
        })
    }

    /// `pod`'s `ip:port` from the worker API, asking until it has an IP or
    /// the pipeline timeout passes; `dns:port` when the worker API cannot be
    /// asked (there is none, or the call failed).
    fn pod_address(
        &self,
        pod: &str,
        dns: Option<String>,
        port: u16,
        replica: u32,
    ) -> Result<String, Exit> {
        let until = Instant::now() + self.env.pipeline_timeout;
        let mut pause = Duration::from_millis(250);
        loop {
            let asked = match self.worker_api {
                Some(api) => api.pod_ip(pod).map_err(|e| e.to_string()),
                None => Err(format!("no worker API ({WORKER_API_ENV} not set)")),
            };
            let last = match asked {
                Ok(Some(ip)) if ip.contains(':') => return Ok(format!("[{ip}]:{port}")),
                Ok(Some(ip)) => return Ok(format!("{ip}:{port}")),
                Ok(None) => "it has no IP yet".to_string(),
                Err(e) => match &dns {
                    Some(dns) => {
                        tracing::warn!(
                            pod,
                            "replica ring: cannot ask the worker API for the pod's IP ({e}); calling {dns}"
                        );
                        return Ok(format!("{dns}:{port}"));
                    }
                    None => e.to_string(),
                },
            };
            if Instant::now() >= until {
                return Err(Exit::replicas(&CollectiveError::PeerLost {
                    rank: replica,
                    detail: format!(
                        "pod {pod} not found in {:?}: {last}",
                        self.env.pipeline_timeout
                    ),
                }));
            }
            std::thread::sleep(pause.min(until.saturating_duration_since(Instant::now())));
            pause = (pause * 2).min(Duration::from_secs(2));
        }
    }

    /// Builds the trainer, then resumes, connects, trains to the end (or a
    /// SIGTERM, or the first failure) and writes the output, each phase
    /// returning the exit it ends with. Every exit once the trainer exists
    /// is stamped here, with the step reached and the peak so far.
    fn run(&self, device: Device) -> Exit {
        let mut trainer = match self.build(device) {
            Ok(trainer) => trainer,
            Err(exit) => return exit,
        };
        let exit = match self
            .resume(&mut trainer)
            .and_then(|()| self.connect(&trainer))
        {
            Err(exit) => exit,
            // The connections stay open until the output is written, as
            // they did when the trainer owned them.
            Ok(mut connected) => match self.train(&mut trainer, &mut connected) {
                Ok(last_loss) => self.write_output(&trainer, last_loss),
                Err(exit) => exit,
            },
        };
        exit.at(trainer.step, self.peak_now())
    }

    /// The trainer for this stage, on the assignment's text when it has some.
    fn build(&self, device: Device) -> Result<Trainer, Exit> {
        let config = self.plan.config().clone();
        let mut trainer = match catch_unwind(AssertUnwindSafe(|| Trainer::new(config, device))) {
            Ok(Ok(t)) => t,
            Ok(Err(e)) => return Err(Exit::invalid_plan(e.to_string())),
            Err(payload) => {
                return Err(classify_panic(&panic_text(&*payload), 0, self.peak_now()));
            }
        };
        if let Some(files) = &self.plan.assignment().files {
            let samples = load_text(files, &trainer.config).map_err(Exit::invalid_plan)?;
            tracing::info!(samples = samples.len(), data = %files.data_file, "training text");
            trainer.use_text(samples);
        }
        Ok(trainer)
    }

    /// Continues from the newest checkpoint, if any, and says where this
    /// attempt starts.
    fn resume(&self, trainer: &mut Trainer) -> Result<(), Exit> {
        let checkpoint_dir = &self.env.checkpoint_dir;
        match trainer.resume(checkpoint_dir) {
            Ok(Some(found)) => {
                for skipped in &found.skipped {
                    tracing::warn!("skipped checkpoint: {skipped}");
                }
                tracing::info!(
                    step = found.meta.step,
                    dir = %found.dir.display(),
                    "resumed (checkpoint written by attempt {} with micro-batch {} × accumulation {} × {} replicas)",
                    found.meta.attempt,
                    found.meta.settings.micro_batch,
                    found.meta.settings.gradient_accumulation,
                    found.meta.replicas
                );
            }
            Ok(None) => {
                tracing::info!(dir = %checkpoint_dir.display(), "no checkpoint; starting at step 0")
            }
            Err(e) => return Err(Exit::failed(e.to_string())),
        }
        // Live telemetry says where this attempt starts before it waits for peers.
        self.reporter.update(Progress {
            step: trainer.step,
            ..Progress::default()
        });
        Ok(())
    }

    /// The neighbouring stages and the other replicas of the stage,
    /// connected: none of either for one stage of one replica.
    fn connect(&self, trainer: &Trainer) -> Result<Connected, Exit> {
        let mut connected = Connected {
            links: Links::default(),
            replicas: Box::new(Single),
        };
        // Resumed from the last step's checkpoint (a peer that was stopped
        // after the others had finished, and was started again): there is
        // nothing left to exchange, and the peers may be gone, so connect to
        // none of them and go straight to the output.
        if trainer.finished() {
            return Ok(connected);
        }
        if trainer.config.stages <= 1 && trainer.config.replicas <= 1 {
            return Ok(connected);
        }
        let key = self.peer_key()?;
        if trainer.config.stages > 1 {
            connected.links = self.connect_stages(trainer, &key)?;
        }
        if trainer.config.replicas > 1 {
            connected.replicas = self.connect_replicas(trainer, &key)?;
        }
        Ok(connected)
    }

    /// The job's peer key, which both ends of every pipeline and replica
    /// link prove to each other ([`crate::link_auth`]): without it anyone
    /// who knows the job's names could call a worker first and be taken
    /// for its neighbour. `HEADROOM_PEER_KEY` first, else the worker API.
    fn peer_key(&self) -> Result<LinkKey, Exit> {
        LinkKey::obtain(
            self.env.peer_key.as_ref(),
            self.worker_api,
            self.env.pipeline_timeout,
        )
        .map_err(|e| match e {
            KeyError::Missing => Exit::invalid_plan(e.to_string()),
            KeyError::Api(_) | KeyError::Malformed(_) | KeyError::Random(_) => {
                Exit::failed(e.to_string())
            }
        })
    }

    /// The links to the previous and the next stage.
    fn connect_stages(&self, trainer: &Trainer, key: &LinkKey) -> Result<Links, Exit> {
        let stages = trainer.config.stages;
        let (peers, listener) = self.pipeline_setup(stages)?;
        let a = self.plan.assignment();
        let me = Hello {
            job: a.job.clone(),
            namespace: a.namespace.clone(),
            attempt: a.attempt,
            stage: a.stage,
            stages,
            resume_step: trainer.step,
        };
        tracing::info!(stage = me.stage, stages, layers = ?trainer.config.layout.layers, "pipeline: connecting to the neighbouring stages");
        let timeout = self.env.pipeline_timeout;
        establish(&me, key, listener, &peers, timeout, timeout).map_err(|e| Exit::pipeline(&e))
    }

    /// The collective of the stage's replicas: their TCP ring, or what
    /// [`replica_collective`] forms over it.
    fn connect_replicas(
        &self,
        trainer: &Trainer,
        key: &LinkKey,
    ) -> Result<Box<dyn Collective>, Exit> {
        let replicas = trainer.config.replicas;
        let (addresses, listener) = self.ring_setup(replicas)?;
        let a = self.plan.assignment();
        let me = RingHello {
            job: a.job.clone(),
            namespace: a.namespace.clone(),
            attempt: a.attempt,
            stage: a.stage,
            replica: a.replica,
            replicas,
            resume_step: trainer.step,
        };
        tracing::info!(
            stage = me.stage,
            replica = me.replica,
            replicas,
            "replica ring: connecting to the other replicas of the stage"
        );
        let timeouts = RingTimeouts {
            rendezvous: self.env.pipeline_timeout,
            io: self.env.pipeline_timeout,
        };
        // Chunks of an eighth of a bucket: the ring's chunks in flight
        // are what the planner counts beside the bucket
        // (`sharding::collective_buffer_bytes`).
        let bucket = trainer.config.backend.profile().collective_bucket_bytes;
        let chunk = headroom_planner::sharding::ring_chunk_bytes(bucket);
        let collective = Ring::establish(&me, key, &addresses, listener, timeouts)
            .and_then(|mut ring| {
                ring.set_chunk_bytes(usize::try_from(chunk).unwrap_or(usize::MAX));
                let collective =
                    replica_collective(ring, trainer.config.backend, self.env.collective)?;
                trainer.check_replicas(collective.as_ref())?;
                Ok(collective)
            })
            .map_err(|e| Exit::replicas(&e))?;
        let shards = trainer.shards(replicas);
        tracing::info!(
            owned = shards.owned(me.replica).len(),
            tensors = shards.tensors.len(),
            loads = ?shards.loads(),
            "replica ring: connected; optimizer state sharded (elements per replica)"
        );
        Ok(collective)
    }

    /// Trains to the plan's last step, checkpointing every
    /// `checkpoint_every_steps` and at the end; returns the last loss, or
    /// the exit a SIGTERM, a failed step or a failed checkpoint ends with.
    fn train(&self, trainer: &mut Trainer, connected: &mut Connected) -> Result<Option<f64>, Exit> {
        let every = u64::from(trainer.config.checkpoint_every_steps.max(1));
        let mut last_loss = None;
        let mut saved_at = trainer.step;
        while !trainer.finished() {
            let step = trainer.step;
            if self.terminate.load(Ordering::SeqCst) {
                // Evicted or deleted: keep the work done since the last checkpoint.
                let saved = if saved_at == step {
                    "the last checkpoint is at this step".to_string()
                } else {
                    match self.save(trainer, last_loss) {
                        Ok(dir) => format!("checkpoint saved to {}", dir.display()),
                        Err(e) => format!("checkpoint failed: {e}"),
                    }
                };
                return Err(Exit::new(
                    WorkerOutcome::Terminated,
                    format!("terminated by SIGTERM at step {step}; {saved}"),
                ));
            }
            let stepped = catch_unwind(AssertUnwindSafe(|| {
                trainer.train_step_with(&mut connected.links, connected.replicas.as_mut())
            }));
            let report = match stepped {
                Ok(Ok(r)) => r,
                Ok(Err(e)) => {
                    // The step never reached its update, so this stage is still
                    // at `step`. A neighbour that was stopped (eviction, deletion)
                    // saved that step on its way out: saving here completes it.
                    // (Unless the replicas failed half way through sharing
                    // their updates: then this model is no step's.)
                    let mut exit = Exit::step(&e);
                    if saved_at != step && trainer.can_checkpoint() {
                        let saved = match self.save(trainer, last_loss) {
                            Ok(dir) => {
                                format!("checkpoint at step {step} saved to {}", dir.display())
                            }
                            Err(err) => format!("checkpoint at step {step} failed: {err}"),
                        };
                        exit.message.reason = format!("{}; {saved}", exit.message.reason);
                    }
                    return Err(exit);
                }
                Err(payload) => {
                    return Err(classify_panic(
                        &panic_text(&*payload),
                        step,
                        self.peak_now(),
                    ));
                }
            };
            if report.loss.is_some() {
                last_loss = report.loss;
            }
            self.reporter.update(Progress {
                step: report.step,
                loss: report.loss,
                tokens_per_second: Some(report.tokens_per_second()),
                download: None,
            });
            tracing::debug!(step = report.step, loss = ?report.loss, "step");
            if let Some(loss) = report.loss.filter(|l| !l.is_finite()) {
                return Err(Exit::failed(format!(
                    "loss became {loss} at step {}",
                    report.step
                )));
            }
            if let Some(limit) = self.env.device_memory_limit {
                let peak = self.peak_now();
                if peak > limit {
                    // Stamped, as an out-of-memory panic is, with the step
                    // that was under way.
                    return Err(Exit::new(
                        WorkerOutcome::DeviceOutOfMemory,
                        format!(
                            "peak {peak} bytes passed the device limit of {limit} bytes ({DEVICE_MEMORY_LIMIT_ENV}) in step {}",
                            report.step
                        ),
                    )
                    .at(step, peak));
                }
            }
            if trainer.step.is_multiple_of(every) || trainer.finished() {
                match self.save(trainer, last_loss) {
                    Ok(dir) => {
                        saved_at = trainer.step;
                        tracing::info!(step = trainer.step, dir = %dir.display(), "checkpoint");
                    }
                    Err(e) => {
                        return Err(Exit::failed(format!(
                            "checkpoint at step {}: {e}",
                            trainer.step
                        )));
                    }
                }
            }
        }
        Ok(last_loss)
    }

    /// Writes the trained model where the assignment says (one replica of
    /// the stage does) and says so in the exit: success, unless the write
    /// fails.
    fn write_output(&self, trainer: &Trainer, last_loss: Option<f64>) -> Exit {
        let a = self.plan.assignment();
        let written = match &a.files {
            None => String::new(),
            // The replicas of a stage hold the same weights bitwise (the
            // all-gather), so one of them writes the stage's output: two
            // writers of the same files would race.
            Some(files) if a.replica > 0 => format!(
                "; replica {}: replica 0 writes the trained model to {}",
                a.replica, files.output_dir
            ),
            Some(files) => {
                let out = Path::new(&files.output_dir);
                let file = match trainer.save_pretrained(out) {
                    Ok(file) => file,
                    Err(e) => return Exit::failed(format!("writing the trained model: {e}")),
                };
                tracing::info!(file = %file.display(), "trained weights written");
                let c = &trainer.config;
                match &c.adapters {
                    None => format!("; model written to {}", out.display()),
                    Some(_) if c.settings.base_format.is_quantized() => format!(
                        "; PEFT adapter written to {} (no merged weights over a {} base)",
                        out.display(),
                        c.settings.base_format
                    ),
                    Some(_) => format!(
                        "; PEFT adapter written to {}, merged weights to {}",
                        out.display(),
                        out.join(crate::train::MERGED_DIR).display()
                    ),
                }
            }
        };
        Exit::new(
            WorkerOutcome::Succeeded,
            format!(
                "trained to step {}; last loss {}{written}",
                trainer.step,
                last_loss.map_or("n/a".into(), |l| format!("{l:.4}"))
            ),
        )
    }
}

/// What the steps exchange through, connected once before training.
struct Connected {
    /// The neighbouring stages (none for a single-stage plan).
    links: Links,
    /// The other replicas of the stage ([`Single`] for one replica).
    replicas: Box<dyn Collective>,
}

/// The assignment's text, tokenized with the checkpoint's tokenizer and
/// packed into the model's sequence length; errors name the file.
fn load_text(
    files: &headroom_api::PayloadFiles,
    config: &crate::train::TrainConfig,
) -> Result<crate::data::TextSamples, String> {
    use crate::text::{Format, load_tokenizer, pack, read_documents};
    let tokenizer_path = Path::new(&files.model_dir).join("tokenizer.json");
    let tokenizer = load_tokenizer(&tokenizer_path).map_err(|e| e.to_string())?;
    let eos = end_of_sequence(Path::new(&files.model_dir), &tokenizer).ok_or_else(|| {
        format!(
            "{}: no end-of-sequence token (config.json eos_token_id, or </s>, <|endoftext|>, <|end_of_text|> in the vocabulary)",
            tokenizer_path.display()
        )
    })?;
    let format = Format::from(&files.data_format);
    let data = Path::new(&files.data_file);
    let docs = read_documents(data, &format).map_err(|e| e.to_string())?;
    let packed = pack(
        &tokenizer,
        &docs,
        eos,
        config.shape.sequence_length() as usize,
    )
    .map_err(|e| format!("{}: {e}", data.display()))?;
    Ok(crate::data::TextSamples::new(packed.samples, config.seed))
}

/// The id documents are separated by: config.json's `eos_token_id` (the
/// first, where it is a list), else a conventional end token of the vocabulary.
pub(crate) fn end_of_sequence(model_dir: &Path, tokenizer: &tokenizers::Tokenizer) -> Option<u32> {
    let config = std::fs::read_to_string(model_dir.join("config.json")).ok()?;
    let v: serde_json::Value = serde_json::from_str(&config).ok()?;
    let from_config = match &v["eos_token_id"] {
        serde_json::Value::Number(n) => n.as_u64(),
        serde_json::Value::Array(a) => a.first().and_then(serde_json::Value::as_u64),
        _ => None,
    };
    from_config
        .and_then(|id| u32::try_from(id).ok())
        .or_else(|| {
            ["</s>", "<|endoftext|>", "<|end_of_text|>"]
                .iter()
                .find_map(|t| tokenizer.token_to_id(t))
        })
}

/// A worker's hostname under the job's headless Service, as the operator
/// sets it: `s<k>`, or `s<k>-r<r>` in a plan with replicas.
fn host_name(stage: u32, replica: u32, replicas: u32) -> String {
    if replicas > 1 {
        format!("s{stage}-r{replica}")
    } else {
        format!("s{stage}")
    }
}

fn classify_panic(text: &str, step: u64, peak: u64) -> Exit {
    let first_line = text.lines().next().unwrap_or_default().to_string();
    match out_of_memory(text) {
        Some(requested) => {
            let mut exit = Exit::new(
                WorkerOutcome::DeviceOutOfMemory,
                format!("out of device memory in step {step}: {first_line}"),
            )
            .at(step, peak);
            exit.message.requested_bytes = requested;
            exit
        }
        None => Exit::failed(format!("step {step}: {first_line}")).at(step, peak),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use headroom_api::exit_code;

    #[test]
    fn recognises_out_of_memory_messages() {
        assert_eq!(
            out_of_memory("out of device memory allocating 1073741824 bytes\nbacktrace"),
            Some(Some(1 << 30))
        );
        assert_eq!(
            out_of_memory("An out-of-memory error happened during launch\nCaused by: x"),
            Some(None)
        );
        assert_eq!(out_of_memory("CUDA_ERROR_OUT_OF_MEMORY"), Some(None));
        assert_eq!(out_of_memory("index out of bounds"), None);
    }

    #[test]
    fn a_panic_is_classified_with_step_and_peak() {
        let oom = classify_panic("out of device memory allocating 42 bytes", 3, 100);
        assert_eq!(oom.code(), exit_code::DEVICE_OUT_OF_MEMORY);
        assert_eq!(oom.message.outcome, WorkerOutcome::DeviceOutOfMemory);
        assert_eq!(oom.message.requested_bytes, Some(42));
        assert_eq!(
            (oom.message.step, oom.message.peak_bytes),
            (Some(3), Some(100))
        );
        let other = classify_panic("shape mismatch\nmore", 3, 0);
        assert_eq!(other.code(), exit_code::FAILURE);
        assert_eq!(other.message.reason, "step 3: shape mismatch");
        assert_eq!(other.message.peak_bytes, None);
    }

    #[test]
    fn the_exit_code_is_the_outcomes() {
        let lost = Exit::pipeline(&PipelineError::PeerLost {
            stage: 1,
            detail: "closed the connection".into(),
        });
        assert_eq!(
            (lost.message.outcome, lost.code()),
            (WorkerOutcome::PeerLost, exit_code::PEER_LOST)
        );
        let protocol = Exit::pipeline(&PipelineError::Protocol("x".into()));
        assert_eq!(protocol.code(), exit_code::FAILURE);
        let replica = Exit::step(&StepError::Replicas(CollectiveError::PeerLost {
            rank: 1,
            detail: "closed the connection".into(),
        }));
        assert_eq!(replica.code(), exit_code::PEER_LOST);
        assert!(
            replica
                .message
                .reason
                .starts_with("data-parallel replicas: replica 1"),
            "{}",
            replica.message.reason
        );
        let disagree = Exit::step(&StepError::Replicas(CollectiveError::Protocol("x".into())));
        assert_eq!(disagree.code(), exit_code::FAILURE);
        assert_eq!(Exit::invalid_plan("x").code(), exit_code::INVALID_PLAN);
        for outcome in WorkerOutcome::ALL {
            assert_eq!(Exit::new(outcome, "").code(), outcome.exit_code());
        }
    }

    #[test]
    fn an_unusable_environment_exits_with_invalid_plan_at_its_termination_path() {
        let dir = std::env::temp_dir().join(format!("headroom-run-env-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("tmp");
        let path = dir.join("termination-log");
        let exit = run(Err(InvalidEnv {
            termination_message_path: path.clone(),
            error: crate::env::EnvError::NoPlan,
        }));
        assert_eq!(exit.code(), exit_code::INVALID_PLAN);
        let written: TerminationMessage =
            serde_json::from_str(&std::fs::read_to_string(&path).expect("written")).expect("json");
        assert_eq!(written, exit.message);
        assert!(written.reason.starts_with("no plan"), "{}", written.reason);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
