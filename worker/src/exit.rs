//! How a worker process ends: [`Exit`] carries the termination message
//! whose outcome gives the exit code (the contract in `headroom_api`), and
//! maps each way a run can fail to its outcome. The run (`run.rs`), the
//! rendezvous and the initializer all end through it.

use headroom_api::{TerminationMessage, WorkerOutcome};

use crate::collective::CollectiveError;
use crate::pipeline::PipelineError;
use crate::train::StepError;

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

    pub(crate) fn invalid_plan(reason: impl Into<String>) -> Self {
        Exit::new(WorkerOutcome::InvalidPlan, reason)
    }

    pub(crate) fn failed(reason: impl Into<String>) -> Self {
        Exit::new(WorkerOutcome::Failed, reason)
    }

    pub(crate) fn pipeline(e: &PipelineError) -> Self {
        match e {
            PipelineError::PeerLost { .. } => Exit::new(WorkerOutcome::PeerLost, e.to_string()),
            PipelineError::Protocol(_) => Exit::failed(e.to_string()),
        }
    }

    /// A replica of the stage went away (`PEER_LOST`, as a pipeline
    /// neighbour), or the replicas disagree (a failure).
    pub(crate) fn replicas(e: &CollectiveError) -> Self {
        let reason = format!("data-parallel replicas: {e}");
        match e {
            CollectiveError::PeerLost { .. } => Exit::new(WorkerOutcome::PeerLost, reason),
            CollectiveError::Protocol(_) | CollectiveError::InvalidSegments(_) => {
                Exit::failed(reason)
            }
        }
    }

    pub(crate) fn step(e: &StepError) -> Self {
        match e {
            StepError::Pipeline(e) => Exit::pipeline(e),
            StepError::Replicas(e) => Exit::replicas(e),
        }
    }

    /// Stamps the step reached, unless the exit already names one (a panic
    /// or a memory limit names the step under way), and the peak so far.
    /// A checkpoint or output write that failed: with the volume full
    /// (ENOSPC) its own outcome, which the operator answers by growing an
    /// expandable claim or by naming the setting that sizes it (a retry on
    /// the same claim would fill it again); any other failure is retried.
    pub(crate) fn write_failed(what: &str, e: &(dyn std::error::Error + 'static)) -> Self {
        if disk_full(e) {
            Exit::new(
                WorkerOutcome::DiskFull,
                format!(
                    "{what}: the volume is full ({e}); the job's checkpoint claim holds the downloaded model and data, the checkpoints kept and the output (status.plan.disk counts them)"
                ),
            )
        } else {
            Exit::failed(format!("{what}: {e}"))
        }
    }

    pub(crate) fn at(mut self, step: u64, peak: u64) -> Self {
        self.message.step.get_or_insert(step);
        let peak = peak.max(self.message.peak_bytes.unwrap_or(0));
        self.message.peak_bytes = (peak > 0).then_some(peak);
        self
    }
}

/// Whether `e` (or what caused it) is a full volume: an I/O error of kind
/// `StorageFull`, or one a library turned into text (`os error 28`).
fn disk_full(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut at = Some(e);
    while let Some(e) = at {
        if let Some(io) = e.downcast_ref::<std::io::Error>()
            && io.kind() == std::io::ErrorKind::StorageFull
        {
            return true;
        }
        if e.to_string().contains("(os error 28)") {
            return true;
        }
        at = e.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use headroom_api::exit_code;

    /// A write to a full volume (Linux's /dev/full answers every write with
    /// ENOSPC) ends the attempt as a full disk, its own outcome (the
    /// operator grows the claim or names its size), not a plain failure;
    /// wrapped in a checkpoint error or turned into text, too.
    #[test]
    fn a_full_volume_is_not_retried_as_a_plain_failure() {
        use std::io::Write;
        let full = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .and_then(|mut f| f.write_all(&[0; 4096]).and_then(|()| f.flush()))
            .expect_err("/dev/full is full");
        assert_eq!(full.kind(), std::io::ErrorKind::StorageFull);
        let text = full.to_string();
        let wrapped = crate::checkpoint::CheckpointError::Io {
            path: "/var/lib/headroom/checkpoints/a1".into(),
            source: full,
        };
        let exit = Exit::write_failed("checkpoint at step 4", &wrapped);
        assert_eq!(exit.message.outcome, WorkerOutcome::DiskFull);
        assert_eq!(exit.code(), exit_code::DISK_FULL);
        assert!(
            exit.message.reason.contains("the volume is full"),
            "{exit:?}"
        );
        let as_text = crate::checkpoint::CheckpointError::Record {
            path: "/x".into(),
            message: text,
        };
        assert_eq!(
            Exit::write_failed("checkpoint", &as_text).message.outcome,
            WorkerOutcome::DiskFull
        );
        let other = std::io::Error::from(std::io::ErrorKind::PermissionDenied);
        assert_eq!(
            Exit::write_failed("checkpoint", &other).message.outcome,
            WorkerOutcome::Failed
        );
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
}
