//! A `model.pretrained` job's initializer: started before the first plan,
//! followed, retried after a transient failure, and what it read (the
//! checkpoint's shape, the data) taken into the status.

use std::time::Duration;

use headroom_api::{LABEL_ROLE, ROLE_INITIALIZER, WorkerOutcome};
use headroom_planner::units::format_bytes;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;

use super::super::classify::{PodVerdict, classify};
use super::super::lifecycle::{JobEvent, Reason, Transition};
use super::super::pods::{
    CacheRole, CacheState, cache_claim_name, initializer_pod_name, output_location, role,
};
use super::{Builder, CacheWrite};

impl Builder<'_> {
    /// A `model.pretrained` job before its first plan: start the initializer,
    /// follow it, and take what it read into the status. True once the
    /// checkpoint and the data are read (planning goes on in this decision).
    pub(super) fn initialize(&mut self) -> bool {
        let job = self.obs.job;
        let run = self.d.status.initializations.unwrap_or(0);
        let name = initializer_pod_name(job, run);
        let pod = self.obs.pods.iter().find(|p| {
            run > 0
                && p.name_any() == name
                && p.labels().get(LABEL_ROLE).map(String::as_str) == Some(ROLE_INITIALIZER)
        });
        // An initializer to create waits while another job fills the
        // shared model cache claim it would read.
        if pod.is_none()
            && let Some(CacheRole::Wait(message)) = self.cache_role()
        {
            self.enter(Transition::AwaitingModelCache { message });
            self.d.requeue_after = Some(Duration::from_secs(5));
            return false;
        }
        if run == 0 {
            self.start_initializer(1);
            return false;
        }
        let Some(pod) = pod else {
            // Created moments ago (the cache lags), or deleted: make sure it exists.
            self.keep_initializer(run);
            self.d.requeue_after = Some(Duration::from_secs(2));
            return false;
        };
        match classify(pod) {
            PodVerdict::Running | PodVerdict::Pending { .. } => {
                self.keep_initializer(run);
                self.d.requeue_after = Some(Duration::from_secs(5));
                false
            }
            PodVerdict::Succeeded => self.take_report(&name, pod),
            PodVerdict::Failed(f) if f.worker == Some(WorkerOutcome::DiskFull) => {
                self.initializer_disk_full(run, &f);
                false
            }
            PodVerdict::Failed(f) => {
                let transient = !matches!(f.worker, Some(WorkerOutcome::InvalidPlan));
                let policy = &job.spec.memory_policy;
                if transient && run < policy.max_attempts {
                    let waited = f.finished_at.map_or(Duration::MAX, |t| {
                        self.obs.now.duration_since(t).unsigned_abs()
                    });
                    let backoff = Duration::from_secs(u64::from(policy.backoff_seconds));
                    if waited < backoff {
                        self.d.requeue_after = Some(backoff - waited + Duration::from_secs(1));
                        return false;
                    }
                    self.start_initializer(run + 1);
                    return false;
                }
                let what = if transient {
                    format!(
                        " (initializer run {run} of at most {})",
                        policy.max_attempts
                    )
                } else {
                    String::new()
                };
                self.fail(
                    Reason::InvalidSource,
                    format!("initializer: {}{what}", f.message),
                );
                false
            }
        }
    }

    /// The initializer pod `name` succeeded: its report (the checkpoint's
    /// shape, the data) goes into the status, or the job fails when the
    /// report cannot be read or is not one Headroom plans. True once taken.
    fn take_report(&mut self, name: &str, pod: &Pod) -> bool {
        let said = terminated_message(pod).unwrap_or_default();
        // A report is checked as a job's own spec is before it is
        // planned: a shape beyond the CRD's bounds would ask the
        // planner for any amount of memory and time.
        let report = serde_json::from_str::<headroom_api::InitializerReport>(&said)
            .map_err(|e| format!("ended without a readable report ({e}): {said}"))
            .and_then(|r| match r.model.check() {
                Ok(()) => Ok(r),
                Err(e) => Err(format!("reported a checkpoint Headroom does not plan: {e}")),
            });
        match report {
            Ok(report) if self.moved_past_cache(&report) => false,
            Ok(report) => {
                let m = &report.model;
                let d = &report.data;
                let message = format!(
                    "{}: {} parameters ({}, {}), {} layers; data: {} documents, {} tokens, {} samples of {} tokens{}",
                    m.shape.architecture.hf_name(),
                    m.parameters,
                    m.dtype,
                    format_bytes(m.bytes),
                    m.shape.layers,
                    d.documents,
                    d.tokens,
                    d.samples,
                    m.shape.sequence_length,
                    if report.downloaded_bytes > 0 {
                        format!("; downloaded {}", format_bytes(report.downloaded_bytes))
                    } else {
                        String::new()
                    }
                );
                // The filler's download is checked: the claim is ready
                // for every job that names the same weights.
                if let (Some(view), Some(CacheRole::Fill { .. })) =
                    (self.obs.model_cache, self.cache_role())
                {
                    self.d.model_cache = Some(CacheWrite::Ready {
                        claim: view.claim.clone(),
                        commit: report.commit.clone(),
                    });
                }
                self.d.status.model = Some(report.model);
                self.d.status.data = Some(report.data);
                self.d.status.output = output_location(self.obs.job);
                self.enter(Transition::Initialized { message });
                true
            }
            Err(e) => {
                self.fail(Reason::InvalidSource, format!("initializer pod {name} {e}"));
                false
            }
        }
    }

    /// A reader's initializer found that the branch or tag its shared
    /// model cache claim was filled from names another commit now (its
    /// report's `commit`, the claim's recorded one): the job moves to the
    /// claim of the new commit, to read it or, first there, to fill it; the
    /// next pass starts that run. True when it moved (the report is not taken).
    fn moved_past_cache(&mut self, report: &headroom_api::InitializerReport) -> bool {
        let (Some(view), Some(CacheRole::Read)) = (self.obs.model_cache, self.cache_role()) else {
            return false;
        };
        let (CacheState::Ready { commit: Some(held) }, Some(now)) = (&view.state, &report.commit)
        else {
            return false;
        };
        let Some(hf) = self
            .obs
            .job
            .spec
            .model
            .pretrained
            .as_ref()
            .and_then(|p| p.hugging_face.as_ref())
        else {
            return false;
        };
        let claim = cache_claim_name(hf.endpoint.as_deref(), &hf.repo, now);
        if held == now || claim == view.claim {
            return false;
        }
        let run = self.d.status.initializations.unwrap_or(0) + 1;
        self.d.events.push(JobEvent::new(
            false,
            Reason::ModelCacheStale,
            format!(
                "{}@{} names commit {now} now; the shared model cache claim {} holds {held}: \
                 this job uses {claim}, the claim of {now}",
                hf.repo, hf.revision, view.claim
            ),
        ));
        self.d.status.model_cache = Some(claim.clone());
        self.d.status.initializations = Some(run);
        self.enter(Transition::Initializing {
            run,
            message: format!(
                "{}@{} moved to commit {now}: the checkpoint from the shared model cache claim {claim}",
                hf.repo, hf.revision
            ),
        });
        // The next pass sees that claim and makes (fills) or reads it.
        self.d.requeue_after = Some(Duration::from_secs(1));
        true
    }

    pub(super) fn start_initializer(&mut self, run: u32) {
        let job = self.obs.job;
        let source = match job.spec.model.pretrained.as_ref() {
            Some(p) => match (&p.hugging_face, &p.volume) {
                (Some(hf), _) => format!(
                    "fetching Hugging Face repository {}@{}{} and checking it",
                    hf.repo,
                    hf.revision,
                    hf.endpoint
                        .as_ref()
                        .map(|e| format!(" from {e}"))
                        .unwrap_or_default()
                ),
                (None, Some(v)) => format!(
                    "checking the checkpoint on claim {}:{}",
                    v.claim_name, v.path
                ),
                (None, None) => "checking the checkpoint".into(),
            },
            None => return,
        };
        // A changed image fails the job before the run is counted.
        if self.initializer_image().is_none() {
            return;
        }
        let source = match self.obs.model_cache {
            Some(view) => {
                // From the first run on, the job reads this claim.
                self.d.status.model_cache = Some(view.claim.clone());
                match self.cache_role() {
                    Some(CacheRole::Read) => format!(
                        "checking the checkpoint in the shared model cache claim {}",
                        view.claim
                    ),
                    _ => format!("{source} into the shared model cache claim {}", view.claim),
                }
            }
            None => source,
        };
        self.d.status.initializations = Some(run);
        self.enter(Transition::Initializing {
            run,
            message: format!("{source}, its tokenizer and the training text"),
        });
        self.keep_initializer(run);
        self.d.requeue_after = Some(Duration::from_secs(2));
    }
}

impl Builder<'_> {
    /// What this job does with its shared model cache claim as the claim
    /// cache shows it (`None`: it downloads its own copy).
    pub(super) fn cache_role(&self) -> Option<CacheRole> {
        let view = self.obs.model_cache?;
        Some(role(
            &view.claim,
            &view.state,
            self.obs.job.metadata.uid.as_deref().unwrap_or_default(),
        ))
    }

    /// The claim write an initializer about to be created needs: made (the
    /// lock) or taken over when it fills, its use recorded when it reads.
    pub(super) fn cache_write_for_initializer(&mut self) {
        let Some(view) = self.obs.model_cache else {
            return;
        };
        let claim = view.claim.clone();
        self.d.model_cache = match self.cache_role() {
            Some(CacheRole::Fill { create: true, .. }) => Some(CacheWrite::Create { claim }),
            Some(CacheRole::Fill {
                take_over: true, ..
            }) => view
                .resource_version
                .clone()
                .map(|resource_version| CacheWrite::TakeOver {
                    claim,
                    resource_version,
                }),
            Some(CacheRole::Read) => Some(CacheWrite::Used { claim }),
            _ => None,
        };
    }
}

/// What a container wrote to its termination-message path, once it ended.
fn terminated_message(pod: &Pod) -> Option<String> {
    pod.status
        .as_ref()?
        .container_statuses
        .as_ref()?
        .iter()
        .find_map(|c| c.state.as_ref()?.terminated.as_ref()?.message.clone())
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::*;
    use super::super::*;
    use super::*;

    #[test]
    fn a_pretrained_job_is_initialized_then_planned_from_what_the_initializer_read() {
        let mut j = finetune_job();
        let d = step(&mut j, &[], t0());
        assert_eq!(initializer(&d), Some(1), "the initializer starts first");
        assert_eq!(
            launched(&d),
            None,
            "nothing is planned before the checkpoint is read"
        );
        assert!(has_condition(
            &d.status,
            ConditionType::Initialized,
            false,
            Reason::Initializing
        ));
        assert_eq!(d.status.phase, Some(JobPhase::Pending));
        assert!(d.events.iter().any(
            |e| e.reason == Reason::Initializing && e.note.contains("claim models:tiny-llama")
        ));

        let running = step(&mut j, &[init_pod(1, RUNNING)], t0());
        assert_eq!((initializer(&running), launched(&running)), (Some(1), None));

        let done = step(
            &mut j,
            &[init_pod(
                1,
                &terminated(0, &headroom_e2e::fixtures::tiny_llama_report(64)),
            )],
            t0(),
        );
        assert!(has_condition(
            &done.status,
            ConditionType::Initialized,
            true,
            Reason::Initialized
        ));
        let model = done.status.model.as_ref().expect("status.model");
        assert_eq!(model.parameters, 214_592);
        assert_eq!(model.shape.sequence_length, 64);
        assert_eq!(done.status.data.as_ref().map(|d| d.samples), Some(15));
        assert_eq!(
            done.status.output.as_deref(),
            Some("finetune-tiny-llama-checkpoints:output")
        );
        assert_eq!(launched(&done), Some(1), "planned in the same decision");
        let Some(ModelShape::Llama(planned)) = done.launch.as_ref().map(|l| &l.model) else {
            panic!(
                "the workers build the checkpoint's model: {:?}",
                launched(&done)
            );
        };
        assert_eq!(planned.total_params(), 214_592);
        let recipe = done.status.recipe.as_ref().expect("status.recipe");
        assert_eq!(recipe.total_steps, j.spec.training.steps.expect("steps"));
        assert!(done.events.iter().any(|e| e.reason == Reason::Initialized
            && e.note.contains("LlamaForCausalLM: 214592 parameters")));
    }

    /// `epochs` become steps over the samples the initializer counted:
    /// 1.5 passes over 15 samples in batches of the job's global batch.
    #[test]
    fn epochs_become_steps_over_the_samples_the_initializer_counted() {
        let mut j = finetune_job();
        j.spec.training.steps = None;
        j.spec.training.epochs = Some(1.5);
        step(&mut j, &[], t0());
        let report = terminated(0, &headroom_e2e::fixtures::tiny_llama_report(64));
        let done = step(&mut j, &[init_pod(1, &report)], t0());
        let batch = f64::from(j.spec.training.global_batch);
        let recipe = done.status.recipe.as_ref().expect("status.recipe");
        assert_eq!(recipe.total_steps, (1.5 * 15.0 / batch).ceil() as u64);
        assert_eq!(recipe.epochs, Some(1.5));
        assert_eq!(launched(&done), Some(1));
    }

    /// A report is the job's worker image's word: one whose shape is
    /// beyond the bounds of `spec.model.transformer`, or whose parameter
    /// count is not its shape's, fails the job naming the field, and
    /// nothing is planned (forty million layers under LoRA once took the
    /// planner gigabytes, and the operator down with it).
    #[test]
    fn a_report_beyond_the_crd_bounds_fails_the_job_naming_the_field() {
        let report: headroom_api::InitializerReport =
            serde_json::from_str(&headroom_e2e::fixtures::tiny_llama_report(64)).expect("report");
        type Change = fn(&mut headroom_api::ModelFacts);
        let cases: [(&str, Change); 7] = [
            ("num_hidden_layers: 40000000 exceeds 1024", |m| {
                m.shape.layers = 40_000_000
            }),
            ("hidden_size: 4294967295 exceeds 65536", |m| {
                m.shape.hidden = u32::MAX
            }),
            ("vocab_size: 4294967295 exceeds 4194304", |m| {
                m.shape.vocabulary = u32::MAX
            }),
            ("num_attention_heads: 4294967295 exceeds 1024", |m| {
                m.shape.attention_heads = u32::MAX
            }),
            ("intermediate_size: 4294967295 exceeds 1048576", |m| {
                m.shape.intermediate = u32::MAX
            }),
            ("head_dim: 4294967295 exceeds 65536", |m| {
                m.shape.head_dim = u32::MAX
            }),
            ("parameters: 7 in the report", |m| m.parameters = 7),
        ];
        for (says, change) in cases {
            let mut j = finetune_job();
            step(&mut j, &[], t0());
            let mut bad = report.clone();
            change(&mut bad.model);
            let said = serde_json::to_string(&bad).expect("JSON");
            let d = step(&mut j, &[init_pod(1, &terminated(0, &said))], t0());
            assert_eq!(d.status.phase, Some(JobPhase::Failed), "{says}");
            assert!(has_condition(
                &d.status,
                ConditionType::Failed,
                true,
                Reason::InvalidSource
            ));
            let message = d.status.message.as_deref().unwrap_or_default();
            assert!(
                message.contains("does not plan") && message.contains(says),
                "{says}: {message}"
            );
            assert_eq!((launched(&d), d.status.model.as_ref()), (None, None));
        }
    }

    #[test]
    fn a_bad_source_fails_the_job_and_a_dropped_download_runs_the_initializer_again() {
        let mut j = finetune_job();
        step(&mut j, &[], t0());
        let refused = serde_json::to_string(&headroom_api::TerminationMessage {
            outcome: WorkerOutcome::InvalidPlan,
            reason: "model.layers.0.self_attn.k_proj.weight: [32, 64] in the file, [64, 64] by config.json".into(),
            step: None,
            peak_bytes: None,
            requested_bytes: None,
        })
        .expect("JSON");
        let mut bad = j.clone();
        let d = step(
            &mut bad,
            &[init_pod(
                1,
                &terminated(WorkerOutcome::InvalidPlan.exit_code(), &refused),
            )],
            t0(),
        );
        assert_eq!(d.status.phase, Some(JobPhase::Failed));
        assert!(has_condition(
            &d.status,
            ConditionType::Failed,
            true,
            Reason::InvalidSource
        ));
        assert!(
            d.status
                .message
                .as_deref()
                .is_some_and(|m| m.contains("k_proj")),
            "{:?}",
            d.status.message
        );
        assert_eq!((initializer(&d), launched(&d)), (None, None));

        let dropped = serde_json::to_string(&headroom_api::TerminationMessage {
            outcome: WorkerOutcome::Failed,
            reason: "GET http://hub/…/model.safetensors: connection reset".into(),
            step: None,
            peak_bytes: None,
            requested_bytes: None,
        })
        .expect("JSON");
        let failed = init_pod(1, &terminated(WorkerOutcome::Failed.exit_code(), &dropped));
        // Within the backoff (10 s after 10:00:05) nothing starts yet.
        let early = step(
            &mut j,
            std::slice::from_ref(&failed),
            t0() + SignedDuration::from_secs(8),
        );
        assert_eq!(initializer(&early), None);
        assert!(early.requeue_after.is_some());
        let again = step(&mut j, &[failed], t0() + SignedDuration::from_secs(20));
        assert_eq!(
            initializer(&again),
            Some(2),
            "a second initializer resumes the download"
        );
        assert_eq!(again.status.initializations, Some(2));
        assert_ne!(again.status.phase, Some(JobPhase::Failed));
    }

    /// The initializer is given the hub token: a retry runs the first run's
    /// image or none. A job whose `spec.worker.image` changed after its
    /// first run fails, naming both images, and no pod is made (neither
    /// the next run nor a deleted running one made again); a job that names
    /// no image may follow the operator's default.
    #[test]
    fn a_retried_initializer_never_runs_a_changed_image() {
        let mut j = finetune_job();
        let d = step(&mut j, &[], t0());
        assert_eq!(initializer(&d), Some(1));
        assert_eq!(
            d.status.initializer_image.as_deref(),
            Some("localhost/headroom-worker:dev"),
            "the first run's image is recorded"
        );
        let dropped = serde_json::to_string(&headroom_api::TerminationMessage {
            outcome: WorkerOutcome::Failed,
            reason: "GET https://hub/…/model.safetensors: connection reset".into(),
            step: None,
            peak_bytes: None,
            requested_bytes: None,
        })
        .expect("JSON");
        let failed = init_pod(1, &terminated(WorkerOutcome::Failed.exit_code(), &dropped));
        let later = t0() + SignedDuration::from_secs(20);

        let mut changed = j.clone();
        changed.spec.worker.image = Some("registry.example/other:1".into());
        let d = step(&mut changed, std::slice::from_ref(&failed), later);
        assert_eq!(initializer(&d), None, "no pod gets the token");
        assert_eq!(d.status.phase, Some(JobPhase::Failed));
        assert_eq!(d.status.initializations, Some(1), "no second run counted");
        assert!(has_condition(
            &d.status,
            ConditionType::Failed,
            true,
            Reason::InvalidSpec
        ));
        let message = d.status.message.as_deref().unwrap_or_default();
        assert!(
            message.starts_with(
                "spec.worker.image: changed from localhost/headroom-worker:dev to registry.example/other:1"
            ) && message.contains("create a new job"),
            "{message}"
        );

        // Run 1 still running, its pod gone (deleted): it is not made again
        // with the changed image.
        let mut running = j.clone();
        running.spec.worker.image = Some("registry.example/other:1".into());
        let d = step(&mut running, &[], t0());
        assert_eq!(initializer(&d), None);
        assert_eq!(d.status.phase, Some(JobPhase::Failed));

        // The same image, or the operator's default, runs again.
        let mut same = j.clone();
        let d = step(&mut same, std::slice::from_ref(&failed), later);
        assert_eq!(initializer(&d), Some(2));
        let images = WorkerImages::from_flags(Some("registry.example/default:2".into()), None)
            .expect("images");
        let mut default = j.clone();
        default.spec.worker.image = None;
        let d = step_with(&mut default, &[failed], later, &images);
        assert_eq!(
            d.initialize.map(|i| i.image).as_deref(),
            Some("registry.example/default:2")
        );
    }

    /// A job stored with a plain-HTTP hub endpoint and no opt-in (before
    /// the CRD's rule, or under an older CRD) fails before any initializer
    /// could send its token there; with the opt-in it is initialized.
    #[test]
    fn a_plain_http_hub_without_the_opt_in_gets_no_initializer() {
        let mut j = finetune_job();
        let pretrained = j.spec.model.pretrained.as_mut().expect("pretrained");
        pretrained.volume = None;
        pretrained.hugging_face = Some(
            serde_yaml::from_str(
                "{repo: acme/llama, endpoint: 'http://hub.example', tokenSecret: {name: hf}}",
            )
            .expect("hub source"),
        );
        let mut refused = j.clone();
        let d = step(&mut refused, &[], t0());
        assert_eq!(initializer(&d), None, "no pod gets the token");
        assert_eq!(d.status.phase, Some(JobPhase::Failed));
        assert!(has_condition(
            &d.status,
            ConditionType::Failed,
            true,
            Reason::InvalidSpec
        ));
        let message = d.status.message.as_deref().unwrap_or_default();
        assert!(
            message.starts_with(
                "spec.model.pretrained.huggingFace.endpoint: must start with https://"
            ) && message.contains("allowInsecureHttp: true"),
            "{message}"
        );

        if let Some(hf) = j
            .spec
            .model
            .pretrained
            .as_mut()
            .and_then(|p| p.hugging_face.as_mut())
        {
            hf.allow_insecure_http = Some(true);
        }
        let d = step(&mut j, &[], t0());
        assert_eq!(initializer(&d), Some(1), "opted in");
    }

    /// The sample fine-tuning job as a LoRA job on a hub model.
    fn lora_hub_job() -> MemoryAwareTrainingJob {
        let mut j = crate::controller::pods::tests::job(
            &include_str!("../../../../samples/cpu-finetune-tiny-llama.yaml")
                .replace(
                    "volume: {claimName: models, path: tiny-llama}",
                    "huggingFace: {repo: owner/base, revision: main}",
                )
                .replace("    steps: 30\n", "    steps: 30\n    method: lora\n"),
        );
        j.metadata.generation = Some(1);
        j
    }

    fn cache(state: CacheState) -> CacheView {
        CacheView {
            claim: "headroom-model-0123456789abcdef".into(),
            state,
            resource_version: Some("7".into()),
        }
    }

    /// The first job makes the cache claim and fills it; its report marks
    /// the claim ready, and its plan keeps no model bytes on its own claim.
    #[test]
    fn the_first_job_fills_the_shared_cache_and_marks_it_ready() {
        let mut j = lora_hub_job();
        let d = step_with_cache(&mut j, &[], t0(), &cache(CacheState::Absent));
        assert_eq!(initializer(&d), Some(1));
        assert!(d.initialize.as_ref().is_some_and(|i| i.fill_cache));
        assert_eq!(
            d.model_cache,
            Some(CacheWrite::Create {
                claim: "headroom-model-0123456789abcdef".into()
            })
        );
        assert_eq!(
            d.status.model_cache.as_deref(),
            Some("headroom-model-0123456789abcdef")
        );
        let mine = CacheState::Filling {
            filler: Some(("0000-1111".into(), "finetune-tiny-llama".into())),
        };
        let report = terminated(0, &headroom_e2e::fixtures::tiny_llama_report(64));
        let done = step_with_cache(&mut j, &[init_pod(1, &report)], t0(), &cache(mine));
        assert_eq!(
            done.model_cache,
            Some(CacheWrite::Ready {
                claim: "headroom-model-0123456789abcdef".into(),
                commit: None,
            })
        );
        assert_eq!(launched(&done), Some(1));
        let disk = done
            .status
            .plan
            .as_ref()
            .and_then(|p| p.disk.as_ref())
            .expect("disk");
        assert_eq!(disk.model_bytes, 0, "the model is on the cache claim");
    }

    /// A second job waits while another fills the claim (one event, the
    /// condition naming the claim and the filler), then only reads it.
    #[test]
    fn a_second_job_waits_for_the_filler_then_reads_the_cache() {
        let mut j = lora_hub_job();
        let other = CacheState::Filling {
            filler: Some(("other-uid".into(), "first".into())),
        };
        let d = step_with_cache(&mut j, &[], t0(), &cache(other.clone()));
        assert_eq!(initializer(&d), None, "no initializer while it fills");
        assert!(has_condition(
            &d.status,
            ConditionType::Initialized,
            false,
            Reason::WaitingForModelCache
        ));
        let message = d.status.message.clone().unwrap_or_default();
        assert!(
            message.contains("headroom-model-0123456789abcdef") && message.contains("job first"),
            "{message}"
        );
        assert_eq!(d.events.len(), 1);
        assert!(d.requeue_after.is_some(), "it looks again");
        let again = step_with_cache(&mut j, &[], t0(), &cache(other));
        assert!(again.events.is_empty(), "one event per wait");

        let d = step_with_cache(
            &mut j,
            &[],
            t0(),
            &cache(CacheState::Ready { commit: None }),
        );
        assert_eq!(initializer(&d), Some(1));
        assert!(d.initialize.as_ref().is_some_and(|i| !i.fill_cache));
        assert_eq!(
            d.model_cache,
            Some(CacheWrite::Used {
                claim: "headroom-model-0123456789abcdef".into()
            })
        );
        let report = terminated(0, &headroom_e2e::fixtures::tiny_llama_report(64));
        let done = step_with_cache(
            &mut j,
            &[init_pod(1, &report)],
            t0(),
            &cache(CacheState::Ready { commit: None }),
        );
        assert_eq!(done.model_cache, None, "a reader marks nothing");
        assert_eq!(launched(&done), Some(1));
    }

    /// A reader whose claim was filled from `main` at one commit, told by
    /// its initializer that `main` names another now, moves to the claim of
    /// the new commit (one event) and, first there, fills it; a report of
    /// the claim's own commit is taken as it is.
    #[test]
    fn a_reader_of_a_moved_branch_moves_to_the_claim_of_the_new_commit() {
        let report_at = |commit: &str| {
            let mut r: headroom_api::InitializerReport =
                serde_json::from_str(&headroom_e2e::fixtures::tiny_llama_report(64))
                    .expect("report");
            r.commit = Some(commit.into());
            terminated(0, &serde_json::to_string(&r).expect("json"))
        };
        let held = CacheState::Ready {
            commit: Some("c1".into()),
        };
        let mut same = lora_hub_job();
        let d = step_with_cache(&mut same, &[], t0(), &cache(held.clone()));
        assert_eq!(initializer(&d), Some(1));
        let d = step_with_cache(
            &mut same,
            &[init_pod(1, &report_at("c1"))],
            t0(),
            &cache(held.clone()),
        );
        assert_eq!(launched(&d), Some(1), "the claim holds what main names");

        let mut j = lora_hub_job();
        step_with_cache(&mut j, &[], t0(), &cache(held.clone()));
        let d = step_with_cache(&mut j, &[init_pod(1, &report_at("c2"))], t0(), &cache(held));
        let moved = cache_claim_name(None, "owner/base", "c2");
        assert_eq!(d.status.model_cache.as_deref(), Some(moved.as_str()));
        assert_eq!(d.status.initializations, Some(2));
        assert_eq!(launched(&d), None, "not planned on the old copy");
        assert_eq!(
            d.status.model, None,
            "the report of the old copy is not taken"
        );
        let stale: Vec<_> = d
            .events
            .iter()
            .filter(|e| e.reason == Reason::ModelCacheStale)
            .collect();
        assert_eq!(stale.len(), 1, "{:?}", d.events);
        assert!(
            stale[0].note.contains("c2")
                && stale[0].note.contains("headroom-model-0123456789abcdef"),
            "{}",
            stale[0].note
        );

        // The next pass sees the new claim, absent: this job makes and fills it.
        let fresh = CacheView {
            claim: moved.clone(),
            state: CacheState::Absent,
            resource_version: None,
        };
        let d = step_with_cache(&mut j, &[init_pod(1, &report_at("c2"))], t0(), &fresh);
        assert_eq!(initializer(&d), Some(2));
        assert!(d.initialize.as_ref().is_some_and(|i| i.fill_cache));
        assert_eq!(d.model_cache, Some(CacheWrite::Create { claim: moved }));
    }

    /// A filler that ended without filling the claim is replaced: the next
    /// job takes it over, guarded by the claim's resourceVersion.
    #[test]
    fn an_orphaned_cache_is_taken_over() {
        let mut j = lora_hub_job();
        let d = step_with_cache(
            &mut j,
            &[],
            t0(),
            &cache(CacheState::Filling { filler: None }),
        );
        assert!(d.initialize.as_ref().is_some_and(|i| i.fill_cache));
        assert_eq!(
            d.model_cache,
            Some(CacheWrite::TakeOver {
                claim: "headroom-model-0123456789abcdef".into(),
                resource_version: "7".into(),
            })
        );
    }
}
