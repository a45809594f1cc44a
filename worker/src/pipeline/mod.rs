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
//! * [`wire`] — frames and links (a reader thread per link, so sends never deadlock)
//! * [`connect`] — finding the neighbours and the handshake
//! * [`schedule`] — the per-stage order of forward and backward passes

pub mod connect;
pub mod schedule;
pub mod wire;

pub use connect::{Hello, Peers, establish};
pub use schedule::{Op, one_f_one_b};
pub use wire::{Frame, Kind, Link};

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

/// This stage's connections: none for a single-stage plan.
#[derive(Debug, Default)]
pub struct Links {
    /// From stage k−1 (activations in, gradients out).
    pub prev: Option<Link>,
    /// To stage k+1 (activations out, gradients in).
    pub next: Option<Link>,
}

impl Links {
    pub fn to_prev(&mut self) -> Result<&mut Link, PipelineError> {
        self.prev
            .as_mut()
            .ok_or_else(|| PipelineError::Protocol("no link to the previous stage".into()))
    }

    pub fn to_next(&mut self) -> Result<&mut Link, PipelineError> {
        self.next
            .as_mut()
            .ok_or_else(|| PipelineError::Protocol("no link to the next stage".into()))
    }
}
