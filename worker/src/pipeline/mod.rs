//! Pipeline parallelism across worker pods: stage k of p holds a contiguous
//! range of blocks (the first also the embeddings, the last the head and the
//! loss), receives activations from stage k−1 and gradients from stage k+1
//! over TCP, and runs the 1F1B schedule.
//!
//! **Why 1F1B (PipeDream-flush, as in Megatron-LM) rather than GPipe.** Both
//! have the same bubble, (p − 1) / (m + p − 1) of a step idle for m
//! micro-batches, and both keep exact synchronous semantics (one optimizer
//! update per step over the whole global batch, so p = 1, 2, 3 train the same
//! model). GPipe runs all m forwards before any backward and so keeps the
//! activations of m micro-batches alive on every stage; 1F1B starts backward
//! as soon as the last stage can and keeps at most p − k micro-batches in
//! flight on stage k. That bound is what the planner budgets
//! (`StagePlacement::in_flight`), and it does not grow with the accumulation a
//! stricter retry adds.
//!
//! * [`wire`] — frames and links: over TCP (a reader thread per link, so
//!   sends never deadlock) or, for tests, over channels in one process
//! * [`connect`] — finding the neighbours and the handshake
//! * [`schedule`] — the per-stage order of forward and backward passes

pub mod connect;
pub mod schedule;
pub mod wire;

pub use connect::{Hello, Peers, establish};
pub use schedule::{Op, one_f_one_b};
pub use wire::{ChannelLink, Frame, Kind, Link, StageLink};

use std::time::Duration;

/// Why a pipeline stage cannot go on.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PipelineError {
    /// A neighbour closed the connection, stopped answering or never came up:
    /// usually the consequence of a failure elsewhere, which the operator
    /// reads from that stage's pod.
    #[error("pipeline stage {stage}: {detail}")]
    PeerLost { stage: u32, detail: String },
    /// The stages disagree (different attempt, job, schedule or checkpoint step).
    #[error("pipeline protocol: {0}")]
    Protocol(String),
}

/// This stage's connections: none for a single-stage plan. The caller owns
/// them and lends them to every step (`Trainer::train_step_with`).
#[derive(Debug, Default)]
pub struct Links {
    /// From stage k−1 (activations in, gradients out).
    pub prev: Option<Box<dyn StageLink>>,
    /// To stage k+1 (activations out, gradients in).
    pub next: Option<Box<dyn StageLink>>,
}

impl Links {
    /// The links of `stages` stages in one process, joined by
    /// [`ChannelLink`]s, stage k's at index k; `timeout` bounds every wait
    /// for a frame, as `establish`'s `io_timeout` does.
    pub fn in_process(stages: u32, timeout: Duration) -> Vec<Links> {
        let mut all: Vec<Links> = (0..stages).map(|_| Links::default()).collect();
        for k in 1..stages {
            let (next, prev) = ChannelLink::pair(k - 1, timeout);
            all[k as usize - 1].next = Some(Box::new(next));
            all[k as usize].prev = Some(Box::new(prev));
        }
        all
    }

    pub fn to_prev(&mut self) -> Result<&mut (dyn StageLink + 'static), PipelineError> {
        self.prev
            .as_deref_mut()
            .ok_or_else(|| PipelineError::Protocol("no link to the previous stage".into()))
    }

    pub fn to_next(&mut self) -> Result<&mut (dyn StageLink + 'static), PipelineError> {
        self.next
            .as_deref_mut()
            .ok_or_else(|| PipelineError::Protocol("no link to the next stage".into()))
    }
}
