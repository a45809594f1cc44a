//! The names of what the operator creates for a job: stable, so
//! re-applying never duplicates, and valid DNS labels however long the
//! job's name.

use headroom_api::MemoryAwareTrainingJob;
use headroom_planner::Plan;
use kube::ResourceExt;

/// A DNS-1123 label from `base` + `suffix`, shortened with a stable hash when too long.
fn dns_label(base: &str, suffix: &str) -> String {
    let full = format!("{base}{suffix}");
    if full.len() <= 63 {
        return full;
    }
    // FNV-1a: stable across releases (std's hasher is not).
    let hash = base.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    let keep = 63 - suffix.len() - 9;
    format!(
        "{}-{:08x}{suffix}",
        &base[..keep.min(base.len())].trim_end_matches('-'),
        hash as u32
    )
}

/// The job's checkpoint claim, shared by all its attempts.
pub fn checkpoint_claim_name(job: &MemoryAwareTrainingJob) -> String {
    dns_label(&job.name_any(), "-checkpoints")
}

/// The headless Service of a multi-worker attempt.
pub(super) fn service_name(job: &MemoryAwareTrainingJob) -> String {
    dns_label(&job.name_any(), "-workers")
}

/// One worker of a plan: a pipeline stage's data-parallel replica.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slot {
    pub stage: u32,
    pub replica: u32,
}

/// Every worker of `plan`, stage by stage, replicas in rank order.
pub fn slots(plan: &Plan) -> impl Iterator<Item = Slot> {
    let replicas = plan.replicas.max(1);
    (0..plan.stage_count())
        .flat_map(move |stage| (0..replicas).map(move |replica| Slot { stage, replica }))
}

/// Pod name of one worker of one attempt: stable, so re-applying never
/// duplicates. `-a<attempt>-s<stage>`, with `-r<replica>` when the plan has
/// data-parallel replicas.
pub fn pod_name(job: &MemoryAwareTrainingJob, attempt: u32, plan: &Plan, slot: Slot) -> String {
    dns_label(
        &job.name_any(),
        &format!("-a{attempt}-{}", host_name(plan, slot)),
    )
}

/// A worker's hostname under the job's headless Service (`s<k>`, `s<k>-r<r>`).
pub(super) fn host_name(plan: &Plan, Slot { stage, replica }: Slot) -> String {
    if plan.replicas > 1 {
        format!("s{stage}-r{replica}")
    } else {
        format!("s{stage}")
    }
}

/// The Kueue pod group of attempt `attempt` (the `kueue.x-k8s.io/pod-group-name`
/// label, and the name of the Workload Kueue makes for it): one per attempt,
/// with the job's UID in it, so a job deleted and made again under the same
/// name never joins the old job's group while that one is still being cleaned up.
pub fn pod_group_name(job: &MemoryAwareTrainingJob, attempt: u32) -> String {
    let uid = job.metadata.uid.as_deref().unwrap_or_default();
    let short: String = uid
        .chars()
        .filter(char::is_ascii_hexdigit)
        .take(5)
        .collect();
    let suffix = if short.is_empty() {
        format!("-a{attempt}")
    } else {
        format!("-{short}-a{attempt}")
    };
    dns_label(&job.name_any(), &suffix)
}

/// The initializer pod of run `run` (1-based; a transient failure starts another).
pub fn initializer_pod_name(job: &MemoryAwareTrainingJob, run: u32) -> String {
    dns_label(&job.name_any(), &format!("-init-{run}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_names_stay_valid_dns_labels_and_distinct() {
        let base = "x".repeat(80);
        let a = dns_label(&base, "-a1-s0");
        let b = dns_label(&format!("{base}y"), "-a1-s0");
        assert!(a.len() <= 63 && b.len() <= 63);
        assert_ne!(a, b);
        assert!(a.ends_with("-a1-s0"));
        assert_eq!(dns_label("short", "-workers"), "short-workers");
    }
}
