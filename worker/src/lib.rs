//! Headroom worker: the side of the operator/worker contract that runs in the
//! pod. It reads its [`headroom_api::WorkerAssignment`], trains the planned transformer with
//! burn honouring the plan's settings, checkpoints to the job's volume,
//! reports live memory into the job's status and exits with the contract's
//! code and termination message.
//!
//! * [`mod@env`] — [`WorkerEnv`]: every environment variable, read and checked once
//! * [`assignment`] — [`ValidAssignment`]: the plan, read and validated once
//! * [`sigterm`] — [`SigtermWatcher`]: the one tokio runtime, for the SIGTERM watch
//! * [`worker_api`] — [`WorkerApi`]: the operator's worker API, the worker's
//!   only way to the cluster (telemetry, peers' pod IPs); no Kubernetes rights
//! * the termination message — this file
//! * [`model`] — the decoder-only transformer (one pipeline stage's part of it)
//! * [`pipeline`] — stages over TCP: links, handshake, the 1F1B schedule
//! * [`collective`] — sums and gathers across data-parallel replicas (a TCP
//!   ring; NCCL over it in the CUDA build, host-staged)
//! * [`link_auth`] — the job's peer key and the mutual proof of it every
//!   pipeline and ring handshake carries
//! * [`rendezvous`] — before the first step: where the neighbouring stages
//!   and the stage's other replicas are, and the links to them
//! * [`data_parallel`] — replicas of a stage: gradient reduce-scatter, ZeRO-1
//!   optimizer shards, weight all-gather, in buckets
//! * [`data`] — the synthetic next-token task (deterministic per sample)
//! * [`text`] — real text: JSONL/plain documents, Hugging Face tokenizer, packed
//!   samples, seeded shuffle, per-rank shares (what a fine-tuning job trains on)
//! * [`gpu_runtime`] — cubecl's allocator, persistent memory and autotune
//!   level as the plan recorded them, its kernel cache on the checkpoint volume
//! * [`train`] — micro-batches, accumulation, block-level checkpointing, optimizers
//! * [`checkpoint`] — atomic, verified, per-part checkpoints and resume under any split
//! * [`memory_probe`] — cgroup, process, allocator and NVML memory sampling
//! * [`report`] — rate-limited telemetry for `status.workers[<pod>]`, through the worker API
//! * [`run`] — one process from start to exit, with the exit contract
//! * [`initialize`] — the binary's other mode (`HEADROOM_INITIALIZE`): fetch a
//!   Hugging Face checkpoint, check it and the data, report what it found
//!
//! Exit contract (see `headroom_api::WorkerOutcome`, which gives each exit
//! its code): every exit writes a JSON [`TerminationMessage`] to the
//! termination-message path, and an unusable environment or an unreadable
//! or inconsistent plan exits with `INVALID_PLAN`, distinct from any failure
//! of training itself; a stage whose pipeline neighbour or data-parallel
//! replica went away exits with `PEER_LOST`.

pub mod assignment;
pub mod chat;
pub mod checkpoint;
pub mod collective;
pub mod data;
pub mod data_parallel;
pub mod dataset_layout;
pub mod env;
pub mod exit;
mod flex_values;
pub mod gpu_runtime;
pub mod initialize;
pub mod link_auth;
pub mod link_mac;
pub mod memory_guard;
pub mod memory_probe;
pub mod model;
pub mod optim;
pub mod pipeline;
pub mod rendezvous;
pub mod report;
pub mod run;
pub mod seeded;
pub mod sigterm;
pub mod text;
pub mod train;
pub mod worker_api;

use std::path::Path;

/// Every worker process allocates through `headroom_ffi::ReusingAllocator`:
/// glibc's malloc, and with `HEADROOM_ALLOCATOR_REUSE=1` a cache of freed
/// large blocks under the process's own peak, so a step's tensors reuse the
/// last step's pages instead of faulting fresh ones in (off by default: its
/// peak is not yet the fixed threshold's on every job).
#[global_allocator]
static ALLOCATOR: headroom_ffi::ReusingAllocator = headroom_ffi::ReusingAllocator;

use headroom_api::TerminationMessage;

pub use assignment::{PlanError, ValidAssignment};
pub use env::WorkerEnv;
pub use sigterm::SigtermWatcher;
pub use worker_api::WorkerApi;

/// Kubernetes keeps at most this many bytes of a termination message.
pub const TERMINATION_MESSAGE_LIMIT: usize = 4096;

/// Writes the termination message as JSON, shortening `reason` so the whole
/// document stays valid JSON within Kubernetes' 4 KiB limit.
pub fn write_termination_message(path: &Path, message: &TerminationMessage) -> std::io::Result<()> {
    let mut message = message.clone();
    loop {
        let json = serde_json::to_string(&message).map_err(std::io::Error::other)?;
        if json.len() <= TERMINATION_MESSAGE_LIMIT || message.reason.is_empty() {
            return std::fs::write(path, json);
        }
        let keep = message
            .reason
            .chars()
            .count()
            .saturating_sub(json.len() - TERMINATION_MESSAGE_LIMIT + 8);
        message.reason = message.reason.chars().take(keep).collect::<String>() + "…";
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use headroom_api::WorkerOutcome;

    #[test]
    fn termination_message_is_json_and_bounded() {
        let dir = std::env::temp_dir().join(format!("headroom-worker-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("tmp");
        let path = dir.join("termination-log");
        let msg = TerminationMessage {
            outcome: WorkerOutcome::DeviceOutOfMemory,
            reason: "é".repeat(5_000),
            step: Some(7),
            peak_bytes: Some(1 << 30),
            requested_bytes: Some(1 << 20),
        };
        write_termination_message(&path, &msg).expect("write");
        let written = std::fs::read_to_string(&path).expect("read");
        assert!(written.len() <= TERMINATION_MESSAGE_LIMIT);
        assert!(
            written.contains("\"outcome\":\"deviceOutOfMemory\""),
            "{written}"
        );
        let parsed: TerminationMessage = serde_json::from_str(&written).expect("still valid JSON");
        assert_eq!(parsed.outcome, WorkerOutcome::DeviceOutOfMemory);
        assert_eq!(parsed.step, Some(7));
        assert!(parsed.reason.ends_with('…'));
    }
}
