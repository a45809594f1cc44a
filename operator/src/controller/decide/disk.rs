//! The plan's files against the job's checkpoint claim: a first attempt
//! whose claim cannot hold what its plan keeps there (model, data,
//! checkpoints, output) is refused before it starts, naming the setting
//! that sizes the claim, rather than filling the volume mid-run.

use headroom_planner::DiskBreakdown;
use headroom_planner::disk::quantity;

use super::Builder;

impl Builder<'_> {
    /// Why the job's checkpoint claim cannot hold what a plan keeps on it
    /// (`disk`), naming the setting that sizes it and the size that would
    /// do; `None` when it can, or when the claim is sized from the plan.
    pub(super) fn claim_too_small(&self, disk: &DiskBreakdown) -> Option<String> {
        let job = self.obs.job;
        let need = disk.total_bytes;
        let at_least = quantity(disk.claim_bytes);
        if let Some(size) = &job.spec.checkpoints.size {
            let have = headroom_api::quantity::parse_bytes(size).ok()?;
            return (have < need).then(|| {
                format!(
                    "spec.checkpoints.size: {size} cannot hold what the plan keeps on the job's \
                     checkpoint claim ({}); create the job with at least {at_least} (or without \
                     checkpoints.size: the claim is then sized from the plan)",
                    disk.summary()
                )
            });
        }
        // A pretrained model's initializer made the claim before the plan
        // existed, at the operator's default size.
        let default = self.obs.default_checkpoint_bytes;
        (job.spec.model.pretrained.is_some() && default < need).then(|| {
            format!(
                "the job's checkpoint claim was made at the chart's checkpoints.size ({}) \
                 before its model was read, and the plan keeps more on it ({}); create the job \
                 with spec.checkpoints.size: {at_least} (or raise the chart's checkpoints.size)",
                quantity(default),
                disk.summary()
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::*;
    use crate::controller::config::ChildConfig;
    use crate::controller::pods::claim_size;
    use headroom_planner::disk::{CHECKPOINTS_KEPT, quantity};

    /// The plan in the status says what it keeps on the claim (a job
    /// trained from scratch: checkpoints only), and the claim is made of
    /// the plan's size when that is more than the operator's default, of
    /// the default otherwise, and of the spec's size when it sets one.
    #[test]
    fn the_plan_says_what_it_keeps_on_the_claim_and_sizes_it() {
        let mut j = oom_job();
        let d = step(&mut j, &[], t0());
        assert_eq!(launched(&d), Some(1));
        let plan = d.status.plan.as_ref().expect("status.plan");
        let disk = plan.disk.as_ref().expect("plan.disk");
        assert_eq!(disk.checkpoints, CHECKPOINTS_KEPT + 1);
        assert_eq!(
            (disk.model_bytes, disk.data_bytes, disk.output_bytes),
            (0, 0, 0)
        );
        assert_eq!(disk.total_bytes, 3 * disk.checkpoint_bytes);
        assert!(disk.checkpoint_bytes > 0);

        let small_default = ChildConfig {
            checkpoint_size: "1Mi".into(),
            ..ChildConfig::default()
        };
        assert_eq!(
            claim_size(&j, &small_default, Some(plan)),
            quantity(disk.claim_bytes)
        );
        let large_default = ChildConfig {
            checkpoint_size: "500Gi".into(),
            ..ChildConfig::default()
        };
        assert_eq!(claim_size(&j, &large_default, Some(plan)), "500Gi");
        assert_eq!(
            claim_size(&j, &small_default, None),
            "1Mi",
            "not planned yet"
        );
        j.spec.checkpoints.size = Some("3Gi".into());
        assert_eq!(claim_size(&j, &small_default, Some(plan)), "3Gi");
    }

    /// A `spec.checkpoints.size` smaller than what the plan keeps on the
    /// claim fails the job before any pod or claim is made, naming the
    /// field and the size that would do; one large enough runs.
    #[test]
    fn a_claim_too_small_for_the_plan_fails_the_job_naming_checkpoints_size() {
        let mut j = oom_job();
        j.spec.checkpoints.size = Some("1Ki".into());
        let d = step(&mut j, &[], t0());
        assert_eq!(launched(&d), None);
        assert_eq!(d.status.phase, Some(JobPhase::Failed));
        assert!(has_condition(
            &d.status,
            ConditionType::Failed,
            true,
            Reason::InvalidSpec
        ));
        let message = d.status.message.clone().unwrap_or_default();
        let mut fits = oom_job();
        let planned = step(&mut fits, &[], t0());
        let disk = planned.status.plan.and_then(|p| p.disk).expect("plan.disk");
        assert!(
            message.starts_with("spec.checkpoints.size: 1Ki cannot hold")
                && message.contains(&format!("at least {}", quantity(disk.claim_bytes)))
                && message.contains("checkpoint"),
            "{message}"
        );
        let mut enough = oom_job();
        enough.spec.checkpoints.size = Some(quantity(disk.total_bytes.next_multiple_of(1 << 20)));
        assert_eq!(launched(&step(&mut enough, &[], t0())), Some(1));
    }

    /// A pretrained model's job: the model read from another claim and
    /// the output written to this one; the plan counts the output at the
    /// size the initializer measured, and a tiny model fits the default.
    #[test]
    fn a_pretrained_jobs_plan_counts_its_output_on_the_claim() {
        let mut j = finetune_job();
        step(&mut j, &[], t0());
        let report = terminated(0, &headroom_e2e::fixtures::tiny_llama_report(64));
        let done = step(&mut j, &[init_pod(1, &report)], t0());
        assert_eq!(launched(&done), Some(1));
        let measured = done.status.model.as_ref().expect("status.model").bytes;
        let disk = done
            .status
            .plan
            .as_ref()
            .and_then(|p| p.disk.clone())
            .expect("plan.disk");
        assert_eq!(disk.model_bytes, 0, "read from the models claim");
        assert_eq!(
            disk.output_bytes,
            measured + headroom_planner::disk::MODEL_FILES_ALLOWANCE_BYTES
        );
    }
}
