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

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use burn::tensor::Device;
use headroom_api::WorkerOutcome;
use headroom_planner::Backend;

use crate::assignment::ValidAssignment;
use crate::checkpoint::CheckpointError;
use crate::data::TextSamples;
pub use crate::env::{DEVICE_MEMORY_LIMIT_ENV, STEPPED_DOWN_ENV, TERMINATION_MESSAGE_PATH_ENV};
use crate::env::{InvalidEnv, WorkerEnv};
pub use crate::exit::Exit;
use crate::gpu_runtime::{self, RuntimeSettings};
use crate::memory_guard::{self, MemoryGuard, Trip};
use crate::memory_probe::{CgroupFiles, MemoryProbe, process_memory};
use crate::rendezvous::{Connected, Rendezvous};
use crate::report::{
    DEFAULT_SAMPLE_EVERY, Progress, Reporter, StepLine, StepPace, TelemetrySink, WorkerApiSink,
    WorkerIdentity, WritePolicy,
};
use crate::sigterm::SigtermWatcher;
use crate::text;
use crate::train::{Trainer, training_device};
use crate::worker_api::WorkerApi;
use crate::write_termination_message;

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
    let mut plan = match ValidAssignment::load(&env.plan) {
        Ok(plan) => plan,
        Err(e) => return Exit::invalid_plan(e.to_string()),
    };
    if let Some(d) = env.stepped_down
        && let Err(e) = plan.step_down(d.micro_batch, d.gradient_accumulation)
    {
        return Exit::invalid_plan(format!("{STEPPED_DOWN_ENV}: {e}"));
    }
    let config = plan.config();
    if cfg!(feature = "cuda") {
        configure_gpu_runtime(&plan, env);
    }
    let device = match training_device(config.backend, config.settings.precision) {
        Ok(d) => d,
        Err(e) => return Exit::invalid_plan(e.to_string()),
    };
    let sigterm = match SigtermWatcher::new() {
        Ok(sigterm) => sigterm,
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
    if let Some(d) = env.stepped_down {
        reporter.stepped_down(d.micro_batch, d.gradient_accumulation);
    }
    let terminate = sigterm.watch();
    let exit = WorkerRun {
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

/// cubecl's allocator, persistent memory and autotune level as the plan
/// recorded them, its kernel cache on the checkpoint volume (or where the
/// environment says), set before the device opens. Settings that cannot be
/// applied are logged, and the run goes on.
fn configure_gpu_runtime(plan: &ValidAssignment, env: &WorkerEnv) {
    let a = plan.assignment();
    let cache = env
        .gpu_cache_dir
        .clone()
        .unwrap_or_else(|| gpu_runtime::cache_dir(&env.checkpoint_dir, a.stage, a.replica));
    let settings = RuntimeSettings::for_plan(
        plan.config().backend,
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

/// One run's phases (build, resume, connect, train, write the output) and
/// what they share, gathered once by `run_inner`.
struct WorkerRun<'a> {
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

impl WorkerRun<'_> {
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

    /// Builds the trainer, then resumes, connects, trains to the end (or a
    /// SIGTERM, or the first failure) and writes the output, each phase
    /// returning the exit it ends with. Every exit once the trainer exists
    /// is stamped here, with the step reached and the peak so far.
    fn run(&self, device: Device) -> Exit {
        let mut trainer = match self.build(device) {
            Ok(trainer) => trainer,
            Err(exit) => return exit,
        };
        let rendezvous = Rendezvous {
            plan: self.plan,
            env: self.env,
            worker_api: self.worker_api,
        };
        let exit = match self
            .resume(&mut trainer)
            .and_then(|()| rendezvous.connect(&trainer))
        {
            Err(exit) => exit,
            // The connections stay open until the output is written.
            Ok(mut connected) => {
                self.install_guard(&trainer);
                let started = std::time::Instant::now();
                let trained = self.train(&mut trainer, &mut connected);
                // Off before the output is written: the guard watches steps.
                report_guard_cost(memory_guard::install(None), started.elapsed());
                match trained {
                    Ok(last_loss) => self.write_output(&trainer, last_loss),
                    Err(exit) => exit,
                }
            }
        };
        exit.at(trainer.step, self.peak_now())
    }

    /// Puts the near-OOM guard on this (the training) thread, when the
    /// assignment asks for one and the memory has a limit to guard.
    fn install_guard(&self, trainer: &Trainer) {
        let a = self.plan.assignment();
        let mut guard = MemoryGuard::for_worker(
            a.memory_guard,
            &a.plan,
            a.stage,
            &trainer.device,
            CgroupFiles::of_this_process().as_ref(),
            self.env.device_memory_limit,
        );
        if let Some(g) = &mut guard {
            g.micro_batch_is(
                trainer.config.settings.micro_batch,
                a.plan.settings.micro_batch,
            );
        }
        match &guard {
            Some(g) => tracing::info!(
                limit_bytes = g.limit(),
                "memory guard on: each part of a step is checked against the limit before it runs"
            ),
            None if a.memory_guard.is_some() => {
                tracing::info!("memory guard off: no memory limit to guard (no cgroup limit)")
            }
            None => tracing::info!(
                "memory guard off (spec.memoryPolicy.guard.enabled false, or unset for a GPU worker)"
            ),
        }
        memory_guard::install(guard);
    }

    /// After the guard stopped step `step + 1` in one of its parts:
    /// nothing of the step was applied; the last completed step is
    /// checkpointed (unless it is already). Then, when the plan allows it,
    /// the worker steps down in place: it runs itself again in this pod (a
    /// fresh process, so nothing of the abandoned step stays in memory) at
    /// half the micro-batch and twice the accumulation, the same global
    /// batch, resuming from that checkpoint. Otherwise it ends the attempt
    /// with `NearOutOfMemory`, for the operator's stricter retry.
    fn after_trip(
        &self,
        trainer: &mut Trainer,
        trip: &Trip,
        saved_at: u64,
        last_loss: Option<f64>,
    ) -> Exit {
        memory_guard::with(MemoryGuard::step_abandoned);
        let step = trainer.step;
        let saved = if step == 0 {
            "no step was completed".to_string()
        } else if saved_at == step {
            format!("the last checkpoint is at step {step}")
        } else if !trainer.can_checkpoint() {
            "no checkpoint: the model is no step's".to_string()
        } else {
            match self.save(trainer, last_loss) {
                Ok(dir) => format!("step {step} checkpointed to {}", dir.display()),
                Err(e) => {
                    return Exit::write_failed(&format!("{trip}; checkpoint at step {step}"), &e);
                }
            }
        };
        let s = trainer.config.settings;
        let in_place = self
            .plan
            .assignment()
            .memory_guard
            .is_some_and(|g| g.step_down_in_place)
            && trainer.config.stages == 1
            && trainer.config.replicas <= 1
            && s.micro_batch >= 2
            && s.micro_batch.is_multiple_of(2);
        if in_place {
            let (micro, accumulation) = (s.micro_batch / 2, s.gradient_accumulation.max(1) * 2);
            tracing::warn!(
                micro_batch = micro,
                gradient_accumulation = accumulation,
                "memory guard: {trip}; {saved}; stepping down in place: micro-batch {} × accumulation {} → {micro} × {accumulation} (the same global batch), this worker runs itself again",
                s.micro_batch,
                s.gradient_accumulation.max(1),
            );
            let error = run_again(micro, accumulation);
            tracing::error!("cannot run the worker again ({error}): ending the attempt instead");
        }
        let mut exit = Exit::new(
            WorkerOutcome::NearOutOfMemory,
            format!("memory guard: {trip}; {saved}"),
        )
        .at(step, trip.would_reach().max(self.peak_now()));
        exit.message.requested_bytes = Some(trip.increment);
        exit
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
            let sequence_length = trainer.config.shape.sequence_length() as usize;
            let packed = text::load_text(files, sequence_length).map_err(Exit::invalid_plan)?;
            let samples = TextSamples::packed(packed, trainer.config.seed);
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

    /// Trains to the plan's last step, checkpointing every
    /// `checkpoint_every_steps` and at the end; returns the last loss, or
    /// the exit a SIGTERM, a failed step or a failed checkpoint ends with.
    fn train(&self, trainer: &mut Trainer, connected: &mut Connected) -> Result<Option<f64>, Exit> {
        let every = u64::from(trainer.config.checkpoint_every_steps.max(1));
        let mut last_loss = None;
        let mut saved_at = trainer.step;
        let mut pace = StepPace::default();
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
                    if let Some(trip) = payload.downcast_ref::<Trip>() {
                        return Err(self.after_trip(trainer, trip, saved_at, last_loss));
                    }
                    return Err(classify_panic(
                        &panic_text(&*payload),
                        step,
                        self.peak_now(),
                    ));
                }
            };
            memory_guard::with(|g| g.step_done(report.step));
            if report.loss.is_some() {
                last_loss = report.loss;
            }
            if let Some(eval_loss) = report.eval_loss {
                self.reporter.record_eval_loss(eval_loss);
                tracing::info!(
                    step = report.step,
                    eval_loss,
                    "evaluation on the held-out samples"
                );
            }
            self.reporter.update(Progress {
                step: report.step,
                loss: report.loss,
                // An evaluation reports its loss with Reporter::record_eval_loss.
                eval_loss: None,
                tokens_per_second: Some(report.tokens_per_second()),
                download: None,
                stepped_down: None,
            });
            // Measured before this step's checkpoint: its save counts in the next step's time.
            pace.step_done(std::time::Instant::now());
            let total = trainer.config.steps();
            tracing::info!(
                "{}",
                StepLine {
                    step: report.step,
                    total,
                    loss: report.loss,
                    tokens_per_second: Some(report.tokens_per_second()),
                    eta_seconds: pace.eta_seconds(report.step, total),
                }
            );
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
                        let what = format!("checkpoint at step {}", trainer.step);
                        return Err(Exit::write_failed(&what, &e));
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
                    Err(e) => return Exit::write_failed("writing the trained model", &e),
                };
                tracing::info!(file = %file.display(), "trained weights written");
                if let Err(e) = write_eval_results(out, trainer.last_eval) {
                    return Exit::failed(format!("writing eval_results.json: {e}"));
                }
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

/// Replaces this process with a fresh run of the same worker binary, its
/// arguments and environment, and [`STEPPED_DOWN_ENV`] set to
/// `micro_batch`x`accumulation`. Returns only if that fails.
fn run_again(micro_batch: u32, accumulation: u32) -> std::io::Error {
    use std::os::unix::process::CommandExt;
    let exe = match std::env::current_exe() {
        Ok(exe) => exe,
        Err(e) => return e,
    };
    std::process::Command::new(exe)
        .args(std::env::args_os().skip(1))
        .env(STEPPED_DOWN_ENV, format!("{micro_batch}x{accumulation}"))
        .exec()
}

/// What the guard cost, in the log: its checks and their time (the
/// benchmark's figure is the share of the training time).
fn report_guard_cost(guard: Option<MemoryGuard>, training: std::time::Duration) {
    if let Some(g) = guard {
        tracing::info!(
            checks = g.checks,
            seconds = g.time.as_secs_f64(),
            "memory guard: {} checks took {:.1} ms in all, of a training loop of {:.2} s ({:.3} %)",
            g.checks,
            g.time.as_secs_f64() * 1e3,
            training.as_secs_f64(),
            100.0 * g.time.as_secs_f64() / training.as_secs_f64().max(1e-9)
        );
    }
}

/// `eval_results.json` beside the trained weights, as the Hugging Face
/// Trainer writes it (`eval_loss`, and the step it was measured at), when
/// this stage evaluated (the last stage of a job with an evaluation).
fn write_eval_results(out: &Path, last_eval: Option<(u64, f64)>) -> std::io::Result<()> {
    let Some((step, loss)) = last_eval else {
        return Ok(());
    };
    let json = serde_json::json!({"eval_loss": loss, "step": step});
    std::fs::write(out.join("eval_results.json"), format!("{json:#}\n"))
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
    use headroom_api::{TerminationMessage, exit_code};

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
