//! The plan's files against the job's checkpoint claim: a first attempt
//! whose claim cannot hold what its plan keeps there (model, data,
//! checkpoints, output) is refused before it starts, naming the setting
//! that sizes the claim, rather than filling the volume mid-run; and an
//! attempt that filled the claim anyway is retried on a grown claim when
//! its StorageClass allows expansion, or ends the job naming the size to set.

use headroom_api::Attempt;
use headroom_planner::disk::quantity;
use headroom_planner::units::{GIB, format_bytes};
use headroom_planner::{DiskBreakdown, FailureCause, JobRequest};

use super::super::classify::PodFailure;
use super::super::lifecycle::{JobEvent, Reason};
use super::super::pods::{CacheRole, checkpoint_claim_name};
use super::{Builder, ClaimGrowth};

/// What a claim that filled up grows to: twice its size, at least what the
/// plan asks for (`plan_claim`), in whole GiB.
pub(super) fn grown_size(size: u64, plan_claim: Option<u64>) -> u64 {
    size.saturating_mul(2)
        .max(plan_claim.unwrap_or(0))
        .next_multiple_of(GIB)
}

impl Builder<'_> {
    /// Attempt `ended` found the job's checkpoint claim full: grow the claim
    /// and resume from the last checkpoint when its StorageClass allows
    /// expansion (the retry counts as an attempt), else end the job with
    /// the size to create it with.
    pub(super) fn after_disk_full(&mut self, ended: &Attempt, request: &JobRequest) {
        let n = ended.number;
        let claim = checkpoint_claim_name(self.obs.job);
        let facts = self.obs.claim.cloned().unwrap_or_default();
        let plan_claim = self
            .d
            .status
            .plan
            .as_ref()
            .and_then(|p| p.disk.as_ref())
            .map(|d| d.claim_bytes);
        let size = facts.size_bytes;
        let held = size.map_or_else(|| "size unknown".into(), quantity);
        let class = facts.storage_class.as_deref();
        if let (Some(size), Some(true), Some(class)) = (size, facts.expandable, class) {
            let to = grown_size(size, plan_claim);
            self.d.events.push(JobEvent::new(
                true,
                Reason::DiskFull,
                format!(
                    "attempt {n} filled PersistentVolumeClaim {claim} ({held}); StorageClass \
                     {class} allows expansion: growing it to {} and resuming from the last checkpoint",
                    quantity(to)
                ),
            ));
            self.d.grow_claim = Some(ClaimGrowth {
                claim: claim.clone(),
                to_bytes: to,
            });
            return match self.replan_current(request, &FailureCause::Other) {
                Ok(p) => self.start(
                    n + 1,
                    p,
                    Some(format!(
                        "the same settings on claim {claim} grown to {}",
                        quantity(to)
                    )),
                ),
                Err(e) => self.no_plan(e),
            };
        }
        let why = match (class, facts.expandable) {
            (Some(class), Some(false)) => {
                format!("its StorageClass {class} does not allow expansion (allowVolumeExpansion)")
            }
            (Some(class), _) if size.is_some() => {
                format!("its StorageClass {class} could not be read")
            }
            (None, _) if size.is_some() => "it has no StorageClass".into(),
            _ => "the claim could not be read".into(),
        };
        let set = size.map_or(plan_claim, |s| Some(grown_size(s, plan_claim)));
        let set = set.map_or_else(|| "a larger size".into(), quantity);
        self.fail(
            Reason::DiskFull,
            format!(
                "attempt {n} filled the job's checkpoint claim {claim} ({held}) and {why}, so \
                 Headroom cannot grow it: create the job again with spec.checkpoints.size: {set} \
                 (or raise the chart's checkpoints.size; with a StorageClass that has \
                 allowVolumeExpansion: true, the chart's checkpoints.storageClassName, Headroom \
                 grows a full claim itself)"
            ),
        );
    }

    /// Initializer run `run` found the job's claim too small for the
    /// download (`f`: its `requestedBytes` are the bytes more it needs):
    /// grow the claim (twice its size, at least by those bytes) and run the
    /// initializer again when its StorageClass allows expansion and
    /// `memoryPolicy.maxAttempts` runs are not used up; else the job fails
    /// with the initializer's words, which name `spec.checkpoints.size`.
    pub(super) fn initializer_disk_full(&mut self, run: u32, f: &PodFailure) {
        let job = self.obs.job;
        // The filler of a shared model cache claim downloads the model there.
        let claim = match (self.obs.model_cache, self.cache_role()) {
            (Some(view), Some(CacheRole::Fill { .. })) => view.claim.clone(),
            _ => checkpoint_claim_name(job),
        };
        let facts = self.obs.claim.cloned().unwrap_or_default();
        let more_runs = run < job.spec.memory_policy.max_attempts;
        if let (Some(size), Some(true), Some(class), true) = (
            facts.size_bytes,
            facts.expandable,
            facts.storage_class.as_deref(),
            more_runs,
        ) {
            let more = f.requested_bytes.unwrap_or(size);
            let to = grown_size(size, Some(size.saturating_add(more)));
            self.d.events.push(JobEvent::new(
                true,
                Reason::DiskFull,
                format!(
                    "initializer run {run}: PersistentVolumeClaim {claim} ({}) is too small for \
                     the download ({} more needed); StorageClass {class} allows expansion: \
                     growing it to {} and downloading again",
                    quantity(size),
                    format_bytes(more),
                    quantity(to)
                ),
            ));
            self.d.grow_claim = Some(ClaimGrowth {
                claim,
                to_bytes: to,
            });
            return self.start_initializer(run + 1);
        }
        self.fail(Reason::InvalidSource, format!("initializer: {}", f.message));
    }

    /// Whether the job's checkpoint claim holds what a plan keeps on it
    /// (`disk`): `Ok(None)` when it does (or is made for the plan),
    /// `Ok(Some(growth))` for a pretrained model's claim, made before the
    /// plan at the default size, whose StorageClass lets it grow to the
    /// plan's size; else why not, naming the setting that sizes it and the
    /// size that would do.
    pub(super) fn claim_for_plan(
        &self,
        disk: &DiskBreakdown,
    ) -> Result<Option<ClaimGrowth>, String> {
        let job = self.obs.job;
        let need = disk.total_bytes;
        let at_least = quantity(disk.claim_bytes);
        if let Some(size) = &job.spec.checkpoints.size {
            let Ok(have) = headroom_api::quantity::parse_bytes(size) else {
                return Ok(None);
            };
            if have >= need {
                return Ok(None);
            }
            return Err(format!(
                "spec.checkpoints.size: {size} cannot hold what the plan keeps on the job's \
                 checkpoint claim ({}); create the job with at least {at_least} (or without \
                 checkpoints.size: the claim is then sized from the plan)",
                disk.summary()
            ));
        }
        if job.spec.model.pretrained.is_none() {
            return Ok(None); // the claim is made now, for this plan
        }
        // A pretrained model's initializer made the claim before the plan
        // existed, at the operator's default size.
        let facts = self.obs.claim.cloned().unwrap_or_default();
        let have = facts
            .size_bytes
            .unwrap_or(self.obs.default_checkpoint_bytes);
        if have >= need {
            return Ok(None);
        }
        if facts.expandable == Some(true) {
            return Ok(Some(ClaimGrowth {
                claim: checkpoint_claim_name(job),
                to_bytes: disk.claim_bytes,
            }));
        }
        let class = match (&facts.storage_class, facts.expandable) {
            (Some(class), Some(false)) => format!(
                ", and its StorageClass {class} does not allow expansion (allowVolumeExpansion)"
            ),
            _ => String::new(),
        };
        Err(format!(
            "the job's checkpoint claim was made at {} (the chart's checkpoints.size) before its \
             model was read, and the plan keeps more on it ({}){class}; create the job with \
             spec.checkpoints.size: {at_least} (or raise the chart's checkpoints.size)",
            quantity(have),
            disk.summary()
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::*;
    use super::grown_size;
    use crate::controller::config::ChildConfig;
    use crate::controller::pods::claim_size;
    use headroom_api::{AttemptOutcome, WorkerOutcome};
    use headroom_planner::disk::{CHECKPOINTS_KEPT, quantity};
    use headroom_planner::units::GIB;

    /// A worker of attempt `attempt` that found the volume full at step 4.
    fn disk_full_pod(attempt: u32) -> k8s_openapi::api::core::v1::Pod {
        let message = serde_json::to_string(&serde_json::json!({
            "outcome": "diskFull",
            "reason": "checkpoint at step 4: the volume is full (No space left on device (os error 28))",
            "step": 4,
        }))
        .expect("json");
        pod(
            attempt,
            0,
            &format!(
                "  phase: Failed\n  containerStatuses: [{{name: worker, image: i, imageID: '', ready: false, restartCount: 0, state: {{terminated: {{exitCode: {}, message: {} }}}}}}]",
                WorkerOutcome::DiskFull.exit_code(),
                serde_json::to_string(&message).expect("quoted")
            ),
        )
    }

    fn claim(size: u64, class: Option<&str>, expandable: Option<bool>) -> ClaimFacts {
        ClaimFacts {
            size_bytes: Some(size),
            storage_class: class.map(Into::into),
            expandable,
        }
    }

    /// A pretrained model's claim, made by the initializer before the plan
    /// at the default size: grown to the plan's size when its class can
    /// expand and the plan keeps more on it, the job refused otherwise.
    #[test]
    fn a_pretrained_jobs_claim_made_too_small_grows_or_the_job_is_refused() {
        let report = terminated(0, &headroom_e2e::fixtures::tiny_llama_report(64));
        let initialized = |facts: &ClaimFacts| {
            let mut j = finetune_job();
            step(&mut j, &[], t0());
            step_with_claim(&mut j, &[init_pod(1, &report)], t0(), Some(facts))
        };
        let tiny = 1 << 20;
        let grows = initialized(&claim(tiny, Some("standard"), Some(true)));
        assert_eq!(launched(&grows), Some(1));
        let disk = grows
            .status
            .plan
            .as_ref()
            .and_then(|p| p.disk.clone())
            .expect("plan.disk");
        assert!(disk.total_bytes > tiny, "{disk:?}");
        assert_eq!(
            grows.grow_claim,
            Some(super::ClaimGrowth {
                claim: "finetune-tiny-llama-checkpoints".into(),
                to_bytes: disk.claim_bytes,
            })
        );

        let refused = initialized(&claim(tiny, Some("local"), Some(false)));
        assert_eq!(
            (launched(&refused), refused.grow_claim.clone()),
            (None, None)
        );
        assert_eq!(refused.status.phase, Some(JobPhase::Failed));
        let message = refused.status.message.clone().unwrap_or_default();
        assert!(
            message.contains("made at 1Mi")
                && message.contains("StorageClass local does not allow expansion")
                && message.contains(&format!(
                    "spec.checkpoints.size: {}",
                    quantity(disk.claim_bytes)
                )),
            "{message}"
        );

        let fits = initialized(&claim(GIB, Some("local"), Some(false)));
        assert_eq!((launched(&fits), fits.grow_claim.clone()), (Some(1), None));
    }

    /// The initializer found the claim too small for the hub download
    /// (13.5 GiB more): an expandable claim grows by that (whole GiB) and
    /// the initializer runs again; on a class that cannot expand the job
    /// fails with the initializer's words.
    #[test]
    fn an_initializer_short_of_space_grows_the_claim_and_runs_again() {
        let more = 13 * GIB + GIB / 2;
        let message = serde_json::to_string(&serde_json::json!({
            "outcome": "diskFull",
            "reason": "/var/lib/headroom/checkpoints/model: the download needs 13.50 GiB more and the job's checkpoint volume has 0.90 GiB free; give the job a larger claim: spec.checkpoints.size (at least 13Gi more than today)",
            "requestedBytes": more,
        }))
        .expect("json");
        let short = terminated(WorkerOutcome::DiskFull.exit_code(), &message);
        let ran_short = |facts: &ClaimFacts| {
            let mut j = finetune_job();
            step(&mut j, &[], t0());
            step_with_claim(&mut j, &[init_pod(1, &short)], t0(), Some(facts))
        };
        let grows = ran_short(&claim(GIB, Some("standard"), Some(true)));
        assert_eq!(initializer(&grows), Some(2), "downloads again");
        assert_eq!(grows.status.phase, Some(JobPhase::Pending));
        assert_eq!(
            grows.grow_claim,
            Some(super::ClaimGrowth {
                claim: "finetune-tiny-llama-checkpoints".into(),
                to_bytes: 15 * GIB,
            })
        );
        assert!(
            grows.events.iter().any(|e| e.reason == Reason::DiskFull
                && e.note.contains("(1Gi) is too small")
                && e.note.contains("growing it to 15Gi")),
            "{:?}",
            grows.events
        );

        let refused = ran_short(&claim(GIB, Some("local"), Some(false)));
        assert_eq!(
            (initializer(&refused), refused.grow_claim.clone()),
            (None, None)
        );
        assert_eq!(refused.status.phase, Some(JobPhase::Failed));
        let said = refused.status.message.clone().unwrap_or_default();
        assert!(said.contains("spec.checkpoints.size"), "{said}");
    }

    #[test]
    fn a_full_claim_grows_to_twice_its_size_or_the_plans_in_whole_gib() {
        assert_eq!(grown_size(GIB, None), 2 * GIB);
        assert_eq!(grown_size(GIB, Some(5 * GIB)), 5 * GIB);
        assert_eq!(grown_size(1536 << 20, None), 3 * GIB);
        assert_eq!(grown_size(700 << 20, None), 2 * GIB);
    }

    /// An attempt that filled an expandable claim: its own outcome in the
    /// attempt history, an event naming the claim, its size and the new
    /// one, the claim grown (twice its size) and the next attempt started
    /// with the same settings.
    #[test]
    fn a_full_expandable_claim_is_grown_and_the_job_resumes() {
        let mut j = oom_job();
        j.spec.checkpoints.size = Some("1Gi".into());
        assert_eq!(launched(&step(&mut j, &[], t0())), Some(1));
        let facts = claim(GIB, Some("standard"), Some(true));
        let d = step_with_claim(&mut j, &[disk_full_pod(1)], t0(), Some(&facts));
        assert_eq!(d.ended, Some(AttemptOutcome::DiskFull));
        assert_eq!(d.status.attempts[0].outcome, AttemptOutcome::DiskFull);
        assert_eq!(
            d.grow_claim,
            Some(super::ClaimGrowth {
                claim: "oom-then-fit-checkpoints".into(),
                to_bytes: 2 * GIB,
            })
        );
        assert_eq!(launched(&d), Some(2));
        assert_eq!(d.status.attempts[1].outcome, AttemptOutcome::Running);
        assert_eq!(
            d.status.attempts[1].settings, d.status.attempts[0].settings,
            "the same settings: memory was not the problem"
        );
        let grown = d
            .events
            .iter()
            .find(|e| e.reason == Reason::DiskFull && e.note.contains("growing it"))
            .unwrap_or_else(|| panic!("{:?}", d.events));
        assert!(
            grown
                .note
                .contains("PersistentVolumeClaim oom-then-fit-checkpoints (1Gi)")
                && grown.note.contains("StorageClass standard")
                && grown.note.contains("to 2Gi"),
            "{}",
            grown.note
        );
    }

    /// A claim whose StorageClass cannot expand (or cannot be read) ends
    /// the job: the claim, its size and what to set, and no retry.
    #[test]
    fn a_full_claim_that_cannot_grow_ends_the_job_naming_checkpoints_size() {
        for (facts, why) in [
            (
                Some(claim(GIB, Some("local"), Some(false))),
                "StorageClass local does not allow expansion",
            ),
            (
                Some(claim(GIB, Some("gone"), None)),
                "StorageClass gone could not be read",
            ),
            (None, "the claim could not be read"),
        ] {
            let mut j = oom_job();
            assert_eq!(launched(&step(&mut j, &[], t0())), Some(1));
            let d = step_with_claim(&mut j, &[disk_full_pod(1)], t0(), facts.as_ref());
            assert_eq!(d.status.phase, Some(JobPhase::Failed), "{why}");
            assert_eq!((launched(&d), d.grow_claim.clone()), (None, None));
            assert!(has_condition(
                &d.status,
                ConditionType::Failed,
                true,
                Reason::DiskFull
            ));
            let message = d.status.message.clone().unwrap_or_default();
            assert!(
                message.contains("checkpoint claim oom-then-fit-checkpoints")
                    && message.contains(why)
                    && message.contains("spec.checkpoints.size: "),
                "{message}"
            );
            if facts.is_some() {
                assert!(
                    message.contains("(1Gi)") && message.contains("spec.checkpoints.size: 2Gi"),
                    "{message}"
                );
            }
        }
    }

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
