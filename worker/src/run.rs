//! One worker process from start to exit: read the plan, resume, train,
//! checkpoint, report, and leave with the contract's exit code and a
//! termination message on every path.
//!
//! Exit codes (`headroom_api::exit_code`): 0 success; `INVALID_PLAN` for a
//! plan that is missing, malformed, inconsistent or that this worker cannot
//! run; `DEVICE_OUT_OF_MEMORY` for an allocation failure caught in process
//! (a CUDA/cubecl out-of-memory panic, or the optional soft limit below);
//! `FAILURE` for anything else. A kernel OOM kill (137) never reaches us.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use headroom_api::{
    CHECKPOINT_DIR_ENV, DEFAULT_CHECKPOINT_DIR, PIPELINE_ADDRESSES_ENV, PIPELINE_PODS_ENV,
    PIPELINE_PORT, PIPELINE_SERVICE_ENV, PIPELINE_TIMEOUT_ENV, POD_NAME_ENV,
    TELEMETRY_INTERVAL_ENV, TERMINATION_MESSAGE_PATH, TerminationMessage, WorkerAssignment,
    exit_code,
};

use crate::pipeline::{Hello, Links, Peers, PipelineError, establish};
use crate::report::{
    DEFAULT_INTERVAL, DEFAULT_SAMPLE_EVERY, KubeStatusSink, Progress, Reporter, TelemetrySink,
    WorkerIdentity, WritePolicy,
};
use crate::telemetry::{MemoryProbe, process_memory};
use crate::train::{TrainConfig, Trainer, training_device};
use crate::{load_assignment, write_termination_message};

/// Overrides where the termination message goes (tests, local runs).
pub const TERMINATION_MESSAGE_PATH_ENV: &str = "HEADROOM_TERMINATION_MESSAGE_PATH";
/// Optional soft device limit in bytes: when the worker's peak passes it, the
/// worker stops with `DEVICE_OUT_OF_MEMORY` as a GPU worker would. Lets the
/// CPU backend (whose real limit is the kernel's OOM kill) exercise the
/// device-OOM path of the operator; unset in normal runs.
pub const DEVICE_MEMORY_LIMIT_ENV: &str = "HEADROOM_DEVICE_MEMORY_LIMIT_BYTES";

/// How the process ends.
#[derive(Clone, Debug, PartialEq)]
pub struct Exit {
    pub code: i32,
    pub message: TerminationMessage,
}

impl Exit {
    fn new(code: i32, outcome: &str, reason: impl Into<String>) -> Self {
        Exit {
            code,
            message: TerminationMessage {
                outcome: outcome.into(),
                reason: reason.into(),
                step: None,
                peak_bytes: None,
                requested_bytes: None,
            },
        }
    }

    fn invalid_plan(reason: impl Into<String>) -> Self {
        Exit::new(exit_code::INVALID_PLAN, "invalidPlan", reason)
    }

    fn failed(reason: impl Into<String>) -> Self {
        Exit::new(exit_code::FAILURE, "failed", reason)
    }

    fn pipeline(e: &PipelineError) -> Self {
        match e {
            PipelineError::PeerLost { .. } => {
                Exit::new(exit_code::PEER_LOST, "peerLost", e.to_string())
            }
            PipelineError::Protocol(_) => Exit::failed(e.to_string()),
        }
    }

    fn at(mut self, step: u64, peak: u64) -> Self {
        self.message.step = Some(step);
        self.message.peak_bytes = (peak > 0).then_some(peak);
        self
    }
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

/// The environment a run reads, as a lookup (the process env in `main`).
pub type Env<'a> = &'a dyn Fn(&str) -> Option<String>;

/// Runs the worker to its exit and writes the termination message.
pub fn run(env: Env<'_>) -> Exit {
    let exit = run_inner(env);
    let path = env(TERMINATION_MESSAGE_PATH_ENV)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(TERMINATION_MESSAGE_PATH));
    if let Err(e) = write_termination_message(&path, &exit.message) {
        tracing::warn!(
            "cannot write the termination message to {}: {e}",
            path.display()
        );
    }
    match exit.code {
        0 => tracing::info!(reason = %exit.message.reason, "succeeded"),
        code => {
            tracing::error!(code, outcome = %exit.message.outcome, reason = %exit.message.reason, "exiting")
        }
    }
    exit
}

fn run_inner(env: Env<'_>) -> Exit {
    let assignment = match load_assignment(env) {
        Ok(a) => a,
        Err(e) => return Exit::invalid_plan(e.to_string()),
    };
    let config = match TrainConfig::from_assignment(&assignment) {
        Ok(c) => c,
        Err(e) => return Exit::invalid_plan(e.to_string()),
    };
    let limit = match env(DEVICE_MEMORY_LIMIT_ENV).map(|v| v.trim().parse::<u64>()) {
        None => None,
        Some(Ok(v)) => Some(v),
        Some(Err(e)) => {
            return Exit::invalid_plan(format!("{DEVICE_MEMORY_LIMIT_ENV}: {e}"));
        }
    };
    let interval = match env(TELEMETRY_INTERVAL_ENV).map(|v| v.trim().parse::<f64>()) {
        None => DEFAULT_INTERVAL,
        Some(Ok(s)) if s.is_finite() && s >= 0.0 => Duration::from_secs_f64(s),
        Some(_) => {
            return Exit::invalid_plan(format!(
                "{TELEMETRY_INTERVAL_ENV} must be a number of seconds ≥ 0"
            ));
        }
    };
    let device = match training_device(config.backend, config.settings.precision) {
        Ok(d) => d,
        Err(e) => return Exit::invalid_plan(e.to_string()),
    };
    let checkpoint_dir = env(CHECKPOINT_DIR_ENV)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_CHECKPOINT_DIR));
    let pod = env(POD_NAME_ENV)
        .or_else(|| env("HOSTNAME"))
        .unwrap_or_else(|| {
            format!(
                "{}-{}-stage{}",
                assignment.job, assignment.attempt, assignment.stage
            )
        });
    let identity = WorkerIdentity {
        name: pod,
        job: assignment.job.clone(),
        namespace: assignment.namespace.clone(),
        attempt: assignment.attempt,
        stage: assignment.stage,
        layer_start: config.layout.layers.start,
        layer_end: config.layout.layers.end,
    };
    let sink: Option<Box<dyn TelemetrySink>> = match KubeStatusSink::connect(&identity) {
        Ok(Some(sink)) => Some(Box::new(sink)),
        Ok(None) => None,
        Err(e) => {
            tracing::warn!("telemetry disabled: {e}");
            None
        }
    };
    let reporter = Reporter::start(
        identity,
        MemoryProbe::for_this_process(Some(device.clone())),
        sink,
        DEFAULT_SAMPLE_EVERY,
        WritePolicy::new(interval),
    );
    let terminate = watch_sigterm();
    let exit = train(
        env,
        &assignment,
        config,
        device,
        &checkpoint_dir,
        limit,
        &reporter,
        &terminate,
    );
    let last = reporter.finish();
    let peak = last.peak_bytes.max(exit.message.peak_bytes.unwrap_or(0));
    let mut exit = exit;
    exit.message.peak_bytes = (peak > 0).then_some(peak);
    exit
}

/// How this stage reaches the others, the socket its predecessor calls, and
/// how long to wait for them (a multi-stage plan only).
fn pipeline_setup(
    env: Env<'_>,
    assignment: &WorkerAssignment,
    stages: u32,
) -> Result<(Peers, Option<std::net::TcpListener>, Duration), Exit> {
    let timeout = match env(PIPELINE_TIMEOUT_ENV).map(|v| v.trim().parse::<u64>()) {
        None => Duration::from_secs(600),
        Some(Ok(s)) if s > 0 => Duration::from_secs(s),
        Some(_) => {
            return Err(Exit::invalid_plan(format!(
                "{PIPELINE_TIMEOUT_ENV} must be a whole number of seconds ≥ 1"
            )));
        }
    };
    let list = |v: String| -> Vec<String> {
        v.split(',')
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
            .collect()
    };
    let (peers, port) = match (env(PIPELINE_ADDRESSES_ENV), env(PIPELINE_PODS_ENV)) {
        (Some(addresses), _) => {
            let addresses = list(addresses);
            let own = addresses
                .get(assignment.stage as usize)
                .cloned()
                .unwrap_or_default();
            let port = own
                .rsplit_once(':')
                .and_then(|(_, p)| p.parse::<u16>().ok())
                .ok_or_else(|| {
                    Exit::invalid_plan(format!(
                        "{PIPELINE_ADDRESSES_ENV}: stage {} needs a host:port entry, got {own:?}",
                        assignment.stage
                    ))
                })?;
            (Peers::Static(addresses), port)
        }
        (None, Some(pods)) => {
            let service = env(PIPELINE_SERVICE_ENV).unwrap_or_default();
            let pods = list(pods);
            let dns = (0..pods.len()).map(|k| format!("s{k}.{service}")).collect();
            (
                Peers::Pods {
                    namespace: assignment.namespace.clone(),
                    pods,
                    dns,
                    port: PIPELINE_PORT,
                },
                PIPELINE_PORT,
            )
        }
        (None, None) => {
            return Err(Exit::invalid_plan(format!(
                "a {stages}-stage plan needs {PIPELINE_PODS_ENV} (set by the operator) or {PIPELINE_ADDRESSES_ENV}"
            )));
        }
    };
    let listener =
        if assignment.stage > 0 {
            Some(std::net::TcpListener::bind(("0.0.0.0", port)).map_err(|e| {
                Exit::failed(format!("pipeline: cannot listen on port {port}: {e}"))
            })?)
        } else {
            None
        };
    Ok((peers, listener, timeout))
}

#[allow(clippy::too_many_arguments)]
fn train(
    env: Env<'_>,
    assignment: &WorkerAssignment,
    config: TrainConfig,
    device: burn::tensor::Device,
    checkpoint_dir: &std::path::Path,
    limit: Option<u64>,
    reporter: &Reporter,
    terminate: &AtomicBool,
) -> Exit {
    let peak_now = || reporter.peak().max(process_memory().1.unwrap_or(0));
    let mut trainer = match catch_unwind(AssertUnwindSafe(|| Trainer::new(config, device))) {
        Ok(Ok(t)) => t,
        Ok(Err(e)) => return Exit::invalid_plan(e.to_string()),
        Err(payload) => return classify_panic(&panic_text(&*payload), 0, peak_now()),
    };
    match trainer.resume(checkpoint_dir) {
        Ok(Some(found)) => {
            for skipped in &found.skipped {
                tracing::warn!("skipped checkpoint: {skipped}");
            }
            tracing::info!(
                step = found.meta.step,
                dir = %found.dir.display(),
                "resumed (checkpoint written by attempt {} with micro-batch {} × accumulation {})",
                found.meta.attempt,
                found.meta.settings.micro_batch,
                found.meta.settings.gradient_accumulation
            );
        }
        Ok(None) => {
            tracing::info!(dir = %checkpoint_dir.display(), "no checkpoint; starting at step 0")
        }
        Err(e) => return Exit::failed(e.to_string()).at(0, peak_now()),
    }
    let stages = trainer.config.stages;
    if stages > 1 {
        let (peers, listener, timeout) = match pipeline_setup(env, assignment, stages) {
            Ok(setup) => setup,
            Err(exit) => return exit,
        };
        let me = Hello {
            job: assignment.job.clone(),
            namespace: assignment.namespace.clone(),
            attempt: assignment.attempt,
            stage: assignment.stage,
            stages,
            resume_step: trainer.step,
        };
        tracing::info!(stage = me.stage, stages, layers = ?trainer.config.layout.layers, "pipeline: connecting to the neighbouring stages");
        let links: Links = match establish(&me, listener, &peers, timeout, timeout) {
            Ok(links) => links,
            Err(e) => return Exit::pipeline(&e).at(trainer.step, peak_now()),
        };
        trainer.connect(links);
    }
    reporter.update(Progress {
        step: trainer.step,
        ..Progress::default()
    });
    let every = u64::from(trainer.config.checkpoint_every_steps.max(1));
    let mut last_loss = None;
    let mut saved_at = trainer.step;
    while !trainer.finished() {
        if terminate.load(Ordering::SeqCst) {
            // Evicted or deleted: keep the work done since the last checkpoint.
            let step = trainer.step;
            let saved = if saved_at == step {
                "the last checkpoint is at this step".to_string()
            } else {
                match trainer.save_checkpoint(checkpoint_dir, assignment.attempt, last_loss) {
                    Ok(dir) => format!("checkpoint saved to {}", dir.display()),
                    Err(e) => format!("checkpoint failed: {e}"),
                }
            };
            return Exit::failed(format!("terminated by SIGTERM at step {step}; {saved}"))
                .at(step, peak_now());
        }
        let step = trainer.step;
        let report = match catch_unwind(AssertUnwindSafe(|| trainer.train_step())) {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => {
                // The step never reached its update, so this stage is still
                // at `step`. A neighbour that was stopped (eviction, deletion)
                // saved that step on its way out: saving here completes it.
                let mut exit = Exit::pipeline(&e);
                if saved_at != step {
                    let saved = match trainer.save_checkpoint(
                        checkpoint_dir,
                        assignment.attempt,
                        last_loss,
                    ) {
                        Ok(dir) => format!("checkpoint at step {step} saved to {}", dir.display()),
                        Err(err) => format!("checkpoint at step {step} failed: {err}"),
                    };
                    exit.message.reason = format!("{}; {saved}", exit.message.reason);
                }
                return exit.at(step, peak_now());
            }
            Err(payload) => return classify_panic(&panic_text(&*payload), step, peak_now()),
        };
        if report.loss.is_some() {
            last_loss = report.loss;
        }
        reporter.update(Progress {
            step: report.step,
            loss: report.loss,
            tokens_per_second: Some(report.tokens_per_second()),
        });
        tracing::debug!(step = report.step, loss = ?report.loss, "step");
        if let Some(loss) = report.loss.filter(|l| !l.is_finite()) {
            return Exit::failed(format!("loss became {loss} at step {}", report.step))
                .at(report.step, peak_now());
        }
        if let Some(limit) = limit {
            let peak = peak_now();
            if peak > limit {
                return Exit::new(
                    exit_code::DEVICE_OUT_OF_MEMORY,
                    "deviceOutOfMemory",
                    format!(
                        "peak {peak} bytes passed the device limit of {limit} bytes ({DEVICE_MEMORY_LIMIT_ENV}) in step {}",
                        report.step
                    ),
                )
                .at(step, peak);
            }
        }
        if trainer.step.is_multiple_of(every) || trainer.finished() {
            match trainer.save_checkpoint(checkpoint_dir, assignment.attempt, last_loss) {
                Ok(dir) => {
                    saved_at = trainer.step;
                    tracing::info!(step = trainer.step, dir = %dir.display(), "checkpoint");
                }
                Err(e) => {
                    return Exit::failed(format!("checkpoint at step {}: {e}", trainer.step))
                        .at(trainer.step, peak_now());
                }
            }
        }
    }
    Exit::new(
        exit_code::SUCCESS,
        "succeeded",
        format!(
            "trained to step {}; last loss {}",
            trainer.step,
            last_loss.map_or("n/a".into(), |l| format!("{l:.4}"))
        ),
    )
    .at(trainer.step, peak_now())
}

/// A flag set when the process receives SIGTERM (eviction, deletion, node
/// drain). The training loop checks it between steps, saves a checkpoint and
/// exits, inside the pod's grace period when a step is shorter than it.
fn watch_sigterm() -> Arc<AtomicBool> {
    let flag = Arc::new(AtomicBool::new(false));
    let set = flag.clone();
    let (ready, installed) = std::sync::mpsc::channel::<bool>();
    let spawned = std::thread::Builder::new()
        .name("headroom-signals".into())
        .spawn(move || {
            let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                let _ = ready.send(false);
                return;
            };
            runtime.block_on(async move {
                use tokio::signal::unix::{SignalKind, signal};
                match signal(SignalKind::terminate()) {
                    Ok(mut term) => {
                        let _ = ready.send(true);
                        if term.recv().await.is_some() {
                            tracing::warn!("SIGTERM: stopping after this step");
                            set.store(true, Ordering::SeqCst);
                        }
                    }
                    Err(e) => {
                        tracing::warn!(
                            "cannot watch SIGTERM ({e}); it will end the process at once"
                        );
                        let _ = ready.send(false);
                    }
                }
            });
        });
    // Wait until the handler is in place so an early SIGTERM is not lost.
    if spawned.is_ok() {
        let _ = installed.recv_timeout(Duration::from_secs(5));
    }
    flag
}

fn classify_panic(text: &str, step: u64, peak: u64) -> Exit {
    let first_line = text.lines().next().unwrap_or_default().to_string();
    match out_of_memory(text) {
        Some(requested) => {
            let mut exit = Exit::new(
                exit_code::DEVICE_OUT_OF_MEMORY,
                "deviceOutOfMemory",
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
        assert_eq!(oom.code, exit_code::DEVICE_OUT_OF_MEMORY);
        assert_eq!(oom.message.requested_bytes, Some(42));
        assert_eq!(
            (oom.message.step, oom.message.peak_bytes),
            (Some(3), Some(100))
        );
        let other = classify_panic("shape mismatch\nmore", 3, 0);
        assert_eq!(other.code, exit_code::FAILURE);
        assert_eq!(other.message.reason, "step 3: shape mismatch");
        assert_eq!(other.message.peak_bytes, None);
    }
}
