//! What a worker pod's state says about its attempt. Pure.

use headroom_api::{AttemptOutcome, TerminationMessage, WorkerOutcome};
use jiff::Timestamp;
use k8s_openapi::api::core::v1::{ContainerStateTerminated, Pod};

use crate::kueue::stopped_by_kueue;

/// A pod's verdict, as far as the attempt is concerned.
#[derive(Clone, Debug, PartialEq)]
pub enum PodVerdict {
    /// Not scheduled yet; `unschedulable_since` is set when the scheduler said it cannot place it.
    Pending {
        unschedulable_since: Option<Timestamp>,
        message: Option<String>,
    },
    Running,
    Succeeded,
    Failed(PodFailure),
}

/// Why a pod failed, with what its worker said.
#[derive(Clone, Debug, PartialEq)]
pub struct PodFailure {
    pub outcome: AttemptOutcome,
    pub reason: String,
    pub message: String,
    /// From the termination message, when the worker wrote one.
    pub step: Option<u64>,
    pub peak_bytes: Option<u64>,
    /// What the worker said of its end (its exit code, confirmed by its
    /// termination message when it wrote one); None when it said nothing
    /// (a kill, a disruption, a crash before it could).
    pub worker: Option<WorkerOutcome>,
    /// When the container ended (for how long to wait for the cause).
    pub finished_at: Option<Timestamp>,
    /// From the termination message: the bytes a failing allocation asked
    /// for, or the bytes more a full volume needs (the initializer's).
    pub requested_bytes: Option<u64>,
}

const DISRUPTION_REASONS: [&str; 6] = [
    "Evicted",
    "Preempting",
    "NodeLost",
    "Shutdown",
    "Terminated",
    "NodeShutdown",
];

/// Classifies one worker pod.
pub fn classify(pod: &Pod) -> PodVerdict {
    let status = pod.status.clone().unwrap_or_default();
    let phase = status.phase.as_deref().unwrap_or("Pending");
    let terminated: Option<ContainerStateTerminated> =
        status.container_statuses.as_ref().and_then(|cs| {
            cs.iter()
                .find_map(|c| c.state.as_ref().and_then(|s| s.terminated.clone()))
        });

    // Disruptions first: an evicted pod's container may also show a non-zero exit.
    // Kueue stopping a pod (preemption) is one too, whatever the exit said.
    if phase == "Failed"
        && let Some((reason, message)) = stopped_by_kueue(pod)
    {
        return PodVerdict::Failed(PodFailure {
            outcome: AttemptOutcome::Disrupted,
            reason: "StoppedByKueue".into(),
            message: format!("Kueue stopped the pod ({reason}): {message}"),
            step: None,
            peak_bytes: None,
            worker: None,
            finished_at: None,
            requested_bytes: None,
        });
    }
    let disrupted_reason = status
        .reason
        .as_deref()
        .filter(|r| DISRUPTION_REASONS.contains(r))
        .map(str::to_string)
        .or_else(|| {
            status
                .conditions
                .as_ref()
                .and_then(|c| {
                    c.iter()
                        .find(|c| c.type_ == "DisruptionTarget" && c.status == "True")
                })
                .map(|c| {
                    c.reason
                        .clone()
                        .unwrap_or_else(|| "DisruptionTarget".into())
                })
        });
    if phase == "Failed"
        && let Some(reason) = disrupted_reason
    {
        return PodVerdict::Failed(PodFailure {
            outcome: AttemptOutcome::Disrupted,
            message: status
                .message
                .clone()
                .unwrap_or_else(|| format!("pod {reason}")),
            reason,
            step: None,
            peak_bytes: None,
            worker: None,
            finished_at: None,
            requested_bytes: None,
        });
    }

    if let Some(t) = &terminated {
        if t.exit_code == 0 {
            return PodVerdict::Succeeded;
        }
        return PodVerdict::Failed(classify_exit(t));
    }
    match phase {
        "Succeeded" => PodVerdict::Succeeded,
        "Failed" => PodVerdict::Failed(PodFailure {
            outcome: AttemptOutcome::Failed,
            reason: status.reason.clone().unwrap_or_else(|| "PodFailed".into()),
            message: status.message.clone().unwrap_or_default(),
            step: None,
            peak_bytes: None,
            worker: None,
            finished_at: None,
            requested_bytes: None,
        }),
        "Running" => PodVerdict::Running,
        _ => {
            let unschedulable = status.conditions.as_ref().and_then(|c| {
                c.iter().find(|c| {
                    c.type_ == "PodScheduled"
                        && c.status == "False"
                        && c.reason.as_deref() == Some("Unschedulable")
                })
            });
            PodVerdict::Pending {
                unschedulable_since: unschedulable.map(|c| {
                    c.last_transition_time
                        .as_ref()
                        .map_or_else(Timestamp::now, |t| t.0)
                }),
                message: unschedulable.and_then(|c| c.message.clone()),
            }
        }
    }
}

impl PodVerdict {
    /// Still running or waiting to run: a pod to stop when its attempt ends.
    pub fn is_live(&self) -> bool {
        matches!(self, PodVerdict::Running | PodVerdict::Pending { .. })
    }
}

impl PodFailure {
    /// A pipeline stage that stopped because a neighbour went away: a
    /// consequence, whose cause another stage's pod shows.
    pub fn peer_lost(&self) -> bool {
        self.worker == Some(WorkerOutcome::PeerLost)
    }
}

fn classify_exit(t: &ContainerStateTerminated) -> PodFailure {
    let said: Option<TerminationMessage> = t
        .message
        .as_deref()
        .and_then(|m| serde_json::from_str(m).ok());
    let step = said.as_ref().and_then(|m| m.step);
    let peak_bytes = said.as_ref().and_then(|m| m.peak_bytes);
    let worker_reason = said.as_ref().map(|m| m.reason.clone());
    // The exit code is the worker's word (the contract pairs each outcome
    // with one); the termination message adds the details.
    let worker = WorkerOutcome::from_exit_code(t.exit_code);
    let (outcome, reason) = if t.reason.as_deref() == Some("OOMKilled") {
        (AttemptOutcome::HostOutOfMemory, "OOMKilled".to_string())
    } else if t.reason.as_deref() == Some("ContainerStatusUnknown") {
        // The kubelet lost the container (node restart): its 137 is not an OOM.
        (
            AttemptOutcome::Disrupted,
            "ContainerStatusUnknown".to_string(),
        )
    } else {
        match (worker, t.exit_code) {
            (Some(WorkerOutcome::DeviceOutOfMemory), _) => (
                AttemptOutcome::DeviceOutOfMemory,
                "DeviceOutOfMemory".to_string(),
            ),
            (Some(WorkerOutcome::InvalidPlan), _) => {
                (AttemptOutcome::Failed, "InvalidPlan".to_string())
            }
            (Some(WorkerOutcome::PeerLost), _) => (AttemptOutcome::Failed, "PeerLost".to_string()),
            (Some(WorkerOutcome::DiskFull), _) => {
                (AttemptOutcome::DiskFull, "DiskFull".to_string())
            }
            (Some(WorkerOutcome::NearOutOfMemory), _) => (
                AttemptOutcome::NearOutOfMemory,
                "NearOutOfMemory".to_string(),
            ),
            // Deleted, evicted or drained: the worker checkpointed and stopped.
            (Some(WorkerOutcome::Terminated), _) => {
                (AttemptOutcome::Disrupted, "Terminated".to_string())
            }
            // SIGKILL without an OOMKilled reason (e.g. cgroup v1 kill racing the status) is still most likely memory.
            (_, 137) => (AttemptOutcome::HostOutOfMemory, "Killed".to_string()),
            (_, code) => (AttemptOutcome::Failed, format!("ExitCode{code}")),
        }
    };
    // Without a JSON termination message the kubelet falls back to the log
    // tail: useful for errors, noise for a kernel OOM kill.
    let message = match (&worker_reason, outcome) {
        (Some(reason), _) => reason.clone(),
        (None, AttemptOutcome::HostOutOfMemory) => {
            "the kernel killed the container at its memory limit".to_string()
        }
        (None, _) => t
            .message
            .as_deref()
            .map(strip_ansi)
            .filter(|m| !m.trim().is_empty())
            .unwrap_or_else(|| format!("container exited with code {}", t.exit_code)),
    };
    PodFailure {
        // An OOM kill or a lost container overrides whatever the code meant.
        worker: worker.filter(|_| {
            !matches!(
                outcome,
                AttemptOutcome::HostOutOfMemory | AttemptOutcome::Disrupted
            )
        }),
        outcome,
        reason,
        message,
        step,
        peak_bytes,
        finished_at: t.finished_at.as_ref().map(|t| t.0),
        requested_bytes: said.as_ref().and_then(|m| m.requested_bytes),
    }
}

/// Removes terminal colour codes (ESC [ ... letter) from a log excerpt.
fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // Skip to the end of the escape sequence.
            for d in chars.by_ref() {
                if d.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out.trim().to_string()
}

/// The failure that explains an attempt: a cause before a lost peer, then by [`severity`].
pub fn rank(f: &PodFailure) -> (bool, u8) {
    (!f.peer_lost(), severity(f.outcome))
}

/// Severity used to pick the attempt's outcome when stages fail differently:
/// memory failures drive the ladder, so they win.
pub fn severity(outcome: AttemptOutcome) -> u8 {
    match outcome {
        AttemptOutcome::DeviceOutOfMemory => 8,
        AttemptOutcome::HostOutOfMemory => 7,
        // The guard's stop explains less than a kill or an allocation
        // failure in another stage, more than anything else.
        AttemptOutcome::NearOutOfMemory => 6,
        AttemptOutcome::Unschedulable => 5,
        // A full volume explains the attempt before a failure it may have
        // caused in another stage.
        AttemptOutcome::DiskFull => 4,
        AttemptOutcome::Failed => 3,
        AttemptOutcome::Disrupted => 2,
        AttemptOutcome::Running | AttemptOutcome::Succeeded => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(status: &str) -> Pod {
        serde_yaml::from_str(&format!("metadata: {{name: p}}\nstatus:\n{status}"))
            .expect("pod fixture")
    }

    #[test]
    fn kernel_oom_kill_is_host_out_of_memory() {
        let p = pod(
            "  phase: Failed\n  containerStatuses: [{name: worker, image: i, imageID: '', ready: false, restartCount: 0, state: {terminated: {exitCode: 137, reason: OOMKilled}}}]",
        );
        let PodVerdict::Failed(f) = classify(&p) else {
            panic!("failed expected")
        };
        assert_eq!(
            (f.outcome, f.reason.as_str()),
            (AttemptOutcome::HostOutOfMemory, "OOMKilled")
        );
    }

    #[test]
    fn device_oom_exit_code_reads_the_termination_message() {
        let msg = r#"{\"outcome\":\"deviceOutOfMemory\",\"reason\":\"CUDA out of memory\",\"step\":12,\"peakBytes\":1000}"#;
        let p = pod(&format!(
            "  phase: Failed\n  containerStatuses: [{{name: worker, image: i, imageID: '', ready: false, restartCount: 0, state: {{terminated: {{exitCode: 88, reason: Error, message: \"{msg}\"}}}}}}]"
        ));
        let PodVerdict::Failed(f) = classify(&p) else {
            panic!("failed expected")
        };
        assert_eq!(f.outcome, AttemptOutcome::DeviceOutOfMemory);
        assert_eq!((f.step, f.peak_bytes), (Some(12), Some(1000)));
        assert_eq!(f.message, "CUDA out of memory");
    }

    #[test]
    fn eviction_is_a_disruption_not_a_memory_failure() {
        let p = pod(
            "  phase: Failed\n  reason: Evicted\n  message: 'The node was low on resource: memory.'",
        );
        let PodVerdict::Failed(f) = classify(&p) else {
            panic!("failed expected")
        };
        assert_eq!(f.outcome, AttemptOutcome::Disrupted);
        let preempted = pod(
            "  phase: Failed\n  conditions: [{type: DisruptionTarget, status: 'True', reason: PreemptionByScheduler}]",
        );
        let PodVerdict::Failed(f) = classify(&preempted) else {
            panic!("failed expected")
        };
        assert_eq!(
            (f.outcome, f.reason.as_str()),
            (AttemptOutcome::Disrupted, "PreemptionByScheduler")
        );
    }

    /// Kueue preempting a queued attempt deletes its pods with a
    /// `TerminationTarget` condition: a disruption even when the container
    /// was killed at the end of its grace period (137 would read as memory).
    #[test]
    fn a_pod_kueue_stopped_is_a_disruption_whatever_its_exit() {
        let p = pod(
            "  phase: Failed\n  conditions: [{type: TerminationTarget, status: 'True', reason: WorkloadEvictedDueToPreempted, message: 'Preempted to accommodate a workload due to prioritization in the ClusterQueue'}]\n  containerStatuses: [{name: worker, image: i, imageID: '', ready: false, restartCount: 0, state: {terminated: {exitCode: 137, reason: Error}}}]",
        );
        let PodVerdict::Failed(f) = classify(&p) else {
            panic!("failed expected")
        };
        assert_eq!(
            (f.outcome, f.reason.as_str()),
            (AttemptOutcome::Disrupted, "StoppedByKueue")
        );
        assert!(
            f.message
                .contains("(WorkloadEvictedDueToPreempted): Preempted to accommodate"),
            "{}",
            f.message
        );
    }

    #[test]
    fn log_fallback_messages_are_cleaned() {
        assert_eq!(
            strip_ansi("\u{1b}[2mtime\u{1b}[0m \u{1b}[31mERROR\u{1b}[0m boom\n"),
            "time ERROR boom"
        );
        let p = pod(
            "  phase: Failed\n  containerStatuses: [{name: worker, image: i, imageID: '', ready: false, restartCount: 0, state: {terminated: {exitCode: 137, reason: OOMKilled, message: 'some log line'}}}]",
        );
        let PodVerdict::Failed(f) = classify(&p) else {
            panic!("failed expected")
        };
        assert_eq!(
            f.message,
            "the kernel killed the container at its memory limit"
        );
    }

    #[test]
    fn a_lost_container_is_a_disruption_even_with_137() {
        let p = pod(
            "  phase: Failed\n  containerStatuses: [{name: worker, image: i, imageID: '', ready: false, restartCount: 0, state: {terminated: {exitCode: 137, reason: ContainerStatusUnknown}}}]",
        );
        let PodVerdict::Failed(f) = classify(&p) else {
            panic!("failed expected")
        };
        assert_eq!(f.outcome, AttemptOutcome::Disrupted);
    }

    /// A worker that found its volume full says so with its own exit
    /// code: an outcome of its own, which outranks a plain failure of
    /// another stage.
    #[test]
    fn a_full_volume_is_its_own_outcome() {
        let msg = r#"{\"outcome\":\"diskFull\",\"reason\":\"checkpoint at step 4: the volume is full\",\"step\":4}"#;
        let p = pod(&format!(
            "  phase: Failed\n  containerStatuses: [{{name: worker, image: i, imageID: '', ready: false, restartCount: 0, state: {{terminated: {{exitCode: {}, reason: Error, message: \"{msg}\"}}}}}}]",
            headroom_api::exit_code::DISK_FULL
        ));
        let PodVerdict::Failed(f) = classify(&p) else {
            panic!("failed expected")
        };
        assert_eq!(
            (f.outcome, f.reason.as_str(), f.worker, f.step),
            (
                AttemptOutcome::DiskFull,
                "DiskFull",
                Some(WorkerOutcome::DiskFull),
                Some(4)
            )
        );
        assert!(f.message.contains("the volume is full"), "{}", f.message);
        assert!(severity(AttemptOutcome::DiskFull) > severity(AttemptOutcome::Failed));
    }

    #[test]
    fn invalid_plan_and_other_errors() {
        let p = pod(
            "  phase: Failed\n  containerStatuses: [{name: worker, image: i, imageID: '', ready: false, restartCount: 0, state: {terminated: {exitCode: 78}}}]",
        );
        let PodVerdict::Failed(f) = classify(&p) else {
            panic!("failed expected")
        };
        assert_eq!(f.worker, Some(WorkerOutcome::InvalidPlan));
        let p = pod(
            "  phase: Failed\n  containerStatuses: [{name: worker, image: i, imageID: '', ready: false, restartCount: 0, state: {terminated: {exitCode: 2}}}]",
        );
        let PodVerdict::Failed(f) = classify(&p) else {
            panic!("failed expected")
        };
        assert_eq!(
            (f.outcome, f.reason.as_str()),
            (AttemptOutcome::Failed, "ExitCode2")
        );
    }

    #[test]
    fn pending_running_succeeded() {
        let p = pod(
            "  phase: Pending\n  conditions: [{type: PodScheduled, status: 'False', reason: Unschedulable, message: '0/1 nodes: Insufficient nvidia.com/gpu', lastTransitionTime: '2026-01-01T00:00:00Z'}]",
        );
        let PodVerdict::Pending {
            unschedulable_since,
            message,
        } = classify(&p)
        else {
            panic!("pending expected")
        };
        assert!(unschedulable_since.is_some());
        assert!(message.is_some_and(|m| m.contains("nvidia.com/gpu")));
        assert_eq!(classify(&pod("  phase: Running")), PodVerdict::Running);
        assert_eq!(classify(&pod("  phase: Succeeded")), PodVerdict::Succeeded);
        assert_eq!(
            classify(&pod("  phase: Pending")),
            PodVerdict::Pending {
                unschedulable_since: None,
                message: None
            }
        );
    }
}
