//! The shared, read-only model cache (pure): one claim per namespace, hub
//! endpoint, repository and revision (`headroom-model-<hash>`), filled once
//! by the first job's initializer and read by every job that names the
//! same weights (docs/model-cache.md).
//!
//! The claim is the whole state: its creation is the lock (one filler per
//! key: a second create is refused with 409), its annotations say whether
//! it is `filling` (and by which job) or `ready`, and when a job last used
//! it. It has no owner, so no job's deletion takes it; the operator's
//! collector ([`collect`]) deletes it once no job has used it for the idle
//! time.

use std::collections::BTreeMap;
use std::time::Duration;

use headroom_api::{
    ANNOTATION_CACHE_COMMIT, ANNOTATION_CACHE_ENDPOINT, ANNOTATION_CACHE_FILLER,
    ANNOTATION_CACHE_FILLER_JOB, ANNOTATION_CACHE_LAST_USED, ANNOTATION_CACHE_REPO,
    ANNOTATION_CACHE_REVISION, ANNOTATION_CACHE_STATE, CACHE_STATE_FILLING, CACHE_STATE_READY,
    COMPONENT_MODEL_CACHE, LABEL_COMPONENT, LABEL_MANAGED_BY, MANAGED_BY, MemoryAwareTrainingJob,
    ModelCacheMode, TrainingMethod,
};
use jiff::Timestamp;
use k8s_openapi::api::core::v1::{
    PersistentVolumeClaim, PersistentVolumeClaimSpec, VolumeResourceRequirements,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::ResourceExt;

use crate::controller::config::ChildConfig;

/// The prefix of every cache claim's name.
pub const CACHE_CLAIM_PREFIX: &str = "headroom-model-";

/// The hub a source names when it names none.
const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// The directory of the checkpoint on a cache claim.
pub const CACHE_MODEL_PATH: &str = "model";

/// The cache claim of one (endpoint, repository, revision) in a namespace:
/// `headroom-model-` and 16 hex digits of a stable hash (FNV-1a, 64 bits)
/// of the three, the endpoint without a trailing `/` (`None`: the hub).
pub fn cache_claim_name(endpoint: Option<&str>, repo: &str, revision: &str) -> String {
    let endpoint = endpoint.unwrap_or(DEFAULT_ENDPOINT).trim_end_matches('/');
    let hash = [endpoint, repo, revision]
        .iter()
        .flat_map(|part| part.bytes().chain([0u8]))
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        });
    format!("{CACHE_CLAIM_PREFIX}{hash:016x}")
}

/// Whether `job` reads its hub checkpoint from the shared cache: its
/// `cache`, else `Shared` for LoRA and QLoRA (a frozen base, never
/// written) and `Private` for full fine-tuning; `Private` everywhere when
/// the operator's cache is off (`enabled`). The claim's name when it does.
pub fn shared_cache(job: &MemoryAwareTrainingJob, enabled: bool) -> Option<String> {
    let hf = job.spec.model.pretrained.as_ref()?.hugging_face.as_ref()?;
    let mode = hf.cache.unwrap_or(match job.spec.training.method {
        TrainingMethod::Lora | TrainingMethod::Qlora => ModelCacheMode::Shared,
        TrainingMethod::Full => ModelCacheMode::Private,
    });
    (enabled && mode == ModelCacheMode::Shared)
        .then(|| cache_claim_name(hf.endpoint.as_deref(), &hf.repo, &hf.revision))
}

/// A cache claim's state, from its metadata.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CacheState {
    /// No such claim: the next job to look makes it, and fills it.
    Absent,
    /// A job's initializer downloads into it: `filler` (uid, job name),
    /// or `None` once that job ended without filling it (the next job
    /// takes over; the partial download resumes).
    Filling { filler: Option<(String, String)> },
    /// Downloaded and checked: jobs read it. `commit`: the one its files
    /// came from, when the hub said.
    Ready { commit: Option<String> },
    /// Deleted (idle), not yet gone: a job waits, then fills a new one.
    Deleting,
}

impl CacheState {
    /// The state `claim` (its metadata, or none) is in.
    pub fn of(claim: Option<&impl ResourceExt>) -> CacheState {
        let Some(claim) = claim else {
            return CacheState::Absent;
        };
        if claim.meta().deletion_timestamp.is_some() {
            return CacheState::Deleting;
        }
        let a = claim.annotations();
        if a.get(ANNOTATION_CACHE_STATE).map(String::as_str) == Some(CACHE_STATE_READY) {
            return CacheState::Ready {
                commit: a.get(ANNOTATION_CACHE_COMMIT).cloned(),
            };
        }
        CacheState::Filling {
            filler: a.get(ANNOTATION_CACHE_FILLER).map(|uid| {
                (
                    uid.clone(),
                    a.get(ANNOTATION_CACHE_FILLER_JOB)
                        .cloned()
                        .unwrap_or_default(),
                )
            }),
        }
    }
}

/// What a job does with its cache claim, given its state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CacheRole {
    /// Download into it: `create` it first (the lock) or `take_over` from a
    /// filler that ended.
    Fill { create: bool, take_over: bool },
    /// Read it (the initializer only checks it).
    Read,
    /// Wait, for the reason given (names the claim).
    Wait(String),
}

/// The role of the job with uid `uid` on claim `claim` in `state`.
pub fn role(claim: &str, state: &CacheState, uid: &str) -> CacheRole {
    match state {
        CacheState::Absent => CacheRole::Fill {
            create: true,
            take_over: false,
        },
        CacheState::Filling { filler: None } => CacheRole::Fill {
            create: false,
            take_over: true,
        },
        CacheState::Filling {
            filler: Some((filler, _)),
        } if filler == uid => CacheRole::Fill {
            create: false,
            take_over: false,
        },
        CacheState::Filling {
            filler: Some((_, job)),
        } => CacheRole::Wait(format!(
            "waiting for job {job} to download the model into the shared cache claim {claim}"
        )),
        CacheState::Ready { .. } => CacheRole::Read,
        CacheState::Deleting => CacheRole::Wait(format!(
            "the shared model cache claim {claim} is being deleted (no job used it for the idle time); \
             downloading again once it is gone"
        )),
    }
}

/// A new cache claim for `job` to fill: no owner (it outlives every job),
/// `filling` by `job`, with the repository it holds in its annotations.
pub fn cache_claim(
    job: &MemoryAwareTrainingJob,
    name: &str,
    cfg: &ChildConfig,
    now: Timestamp,
) -> PersistentVolumeClaim {
    let hf = job
        .spec
        .model
        .pretrained
        .as_ref()
        .and_then(|p| p.hugging_face.as_ref());
    let mut annotations: BTreeMap<String, String> = [
        (ANNOTATION_CACHE_STATE, CACHE_STATE_FILLING.to_string()),
        (ANNOTATION_CACHE_FILLER, job.uid().unwrap_or_default()),
        (ANNOTATION_CACHE_FILLER_JOB, job.name_any()),
        (ANNOTATION_CACHE_LAST_USED, now.to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    if let Some(hf) = hf {
        annotations.insert(ANNOTATION_CACHE_REPO.into(), hf.repo.clone());
        annotations.insert(ANNOTATION_CACHE_REVISION.into(), hf.revision.clone());
        annotations.insert(
            ANNOTATION_CACHE_ENDPOINT.into(),
            hf.endpoint
                .clone()
                .unwrap_or_else(|| DEFAULT_ENDPOINT.into()),
        );
    }
    PersistentVolumeClaim {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: job.namespace(),
            labels: Some(
                [
                    (LABEL_MANAGED_BY, MANAGED_BY),
                    (LABEL_COMPONENT, COMPONENT_MODEL_CACHE),
                ]
                .into_iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            ),
            annotations: Some(annotations),
            ..ObjectMeta::default()
        },
        spec: Some(PersistentVolumeClaimSpec {
            access_modes: Some(vec![cfg.checkpoint_access.as_str().into()]),
            storage_class_name: cfg
                .model_cache
                .storage_class
                .clone()
                .or_else(|| cfg.checkpoint_storage_class.clone()),
            resources: Some(VolumeResourceRequirements {
                requests: Some(
                    [(
                        "storage".to_string(),
                        Quantity(cfg.model_cache.size.clone()),
                    )]
                    .into(),
                ),
                ..VolumeResourceRequirements::default()
            }),
            ..PersistentVolumeClaimSpec::default()
        }),
        ..PersistentVolumeClaim::default()
    }
}

/// The merge patch that makes `job` the filler of a claim whose filler
/// ended, guarded by the claim's `resource_version` (two takers: one wins).
pub fn take_over_patch(job: &MemoryAwareTrainingJob, resource_version: &str) -> serde_json::Value {
    serde_json::json!({"metadata": {
        "resourceVersion": resource_version,
        "annotations": {
            ANNOTATION_CACHE_FILLER: job.uid().unwrap_or_default(),
            ANNOTATION_CACHE_FILLER_JOB: job.name_any(),
        },
    }})
}

/// The merge patch of a filled claim: `ready`, the commit it holds, no filler.
pub fn ready_patch(commit: Option<&str>, now: Timestamp) -> serde_json::Value {
    serde_json::json!({"metadata": {"annotations": {
        ANNOTATION_CACHE_STATE: CACHE_STATE_READY,
        ANNOTATION_CACHE_COMMIT: commit,
        ANNOTATION_CACHE_FILLER: null,
        ANNOTATION_CACHE_FILLER_JOB: null,
        ANNOTATION_CACHE_LAST_USED: now.to_string(),
    }}})
}

/// The merge patch that records a use of the claim now.
pub fn used_patch(now: Timestamp) -> serde_json::Value {
    serde_json::json!({"metadata": {"annotations": {ANNOTATION_CACHE_LAST_USED: now.to_string()}}})
}

/// The merge patch that frees a claim whose filler ended without filling
/// it, guarded by its `resource_version`.
pub fn release_filler_patch(resource_version: &str) -> serde_json::Value {
    serde_json::json!({"metadata": {
        "resourceVersion": resource_version,
        "annotations": {ANNOTATION_CACHE_FILLER: null, ANNOTATION_CACHE_FILLER_JOB: null},
    }})
}

/// Whether `claim` (its metadata) is a model cache claim.
pub fn is_cache_claim(claim: &impl ResourceExt) -> bool {
    claim.labels().get(LABEL_COMPONENT).map(String::as_str) == Some(COMPONENT_MODEL_CACHE)
}

/// What the collector does with one cache claim.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Collect {
    /// Nothing now.
    Keep,
    /// Jobs use it: record that they do (its last use is older than `refresh`).
    Touch,
    /// Its filler ended without filling it: free it for the next job.
    ReleaseFiller,
    /// No job has used it for the idle time.
    Delete,
}

/// The collector's verdict on `claim`: `users`, the uids of the
/// namespace's unfinished jobs that use or will use it; `now`; `idle`, how
/// long an unused claim is kept; `refresh`, how stale its last use may get
/// while jobs use it.
pub fn collect(
    claim: &impl ResourceExt,
    users: &[String],
    now: Timestamp,
    idle: Duration,
    refresh: Duration,
) -> Collect {
    if claim.meta().deletion_timestamp.is_some() {
        return Collect::Keep;
    }
    if let CacheState::Filling {
        filler: Some((uid, _)),
    } = CacheState::of(Some(claim))
        && !users.contains(&uid)
    {
        return Collect::ReleaseFiller;
    }
    let last_used = claim
        .annotations()
        .get(ANNOTATION_CACHE_LAST_USED)
        .and_then(|t| t.parse::<Timestamp>().ok())
        .or_else(|| claim.meta().creation_timestamp.as_ref().map(|t| t.0));
    let since = last_used.map_or(Duration::MAX, |t| {
        now.duration_since(t).try_into().unwrap_or(Duration::ZERO)
    });
    if !users.is_empty() {
        return if since >= refresh {
            Collect::Touch
        } else {
            Collect::Keep
        };
    }
    if since >= idle {
        Collect::Delete
    } else {
        Collect::Keep
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::job;
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    /// The sample fine-tuning job on a hub model, `extra` added to its
    /// `huggingFace` (`full` keeps `training.method` at its default).
    fn lora_job(extra: &str) -> MemoryAwareTrainingJob {
        let sample = include_str!("../../../../samples/cpu-finetune-tiny-llama.yaml");
        let full = extra.contains("full");
        let hub = format!(
            "huggingFace: {{repo: owner/base, revision: main{}}}",
            extra.replace("full", "")
        );
        let yaml = sample
            .replace("volume: {claimName: models, path: tiny-llama}", &hub)
            .replace(
                "    steps: 30\n",
                if full {
                    "    steps: 30\n"
                } else {
                    "    steps: 30\n    method: lora\n"
                },
            );
        job(&yaml)
    }

    #[test]
    fn the_name_is_a_stable_dns_label_per_endpoint_repo_and_revision() {
        let a = cache_claim_name(None, "owner/base", "main");
        assert_eq!(
            a,
            cache_claim_name(Some("https://huggingface.co/"), "owner/base", "main")
        );
        assert!(a.starts_with(CACHE_CLAIM_PREFIX) && a.len() == CACHE_CLAIM_PREFIX.len() + 16);
        assert!(
            a.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        );
        let others = [
            cache_claim_name(None, "owner/base", "v2"),
            cache_claim_name(None, "owner/other", "main"),
            cache_claim_name(Some("http://mirror:8080"), "owner/base", "main"),
            // The separator keeps the parts apart.
            cache_claim_name(None, "owner/basem", "ain"),
        ];
        for o in &others {
            assert_ne!(&a, o);
        }
        // Stable across releases: a renamed hash would orphan every cache.
        assert_eq!(
            cache_claim_name(None, "owner/base", "main"),
            "headroom-model-".to_string()
                + &format!("{:016x}", {
                    let mut h = 0xcbf2_9ce4_8422_2325u64;
                    for b in b"https://huggingface.co\0owner/base\0main\0" {
                        h = (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
                    }
                    h
                })
        );
    }

    #[test]
    fn lora_shares_by_default_full_fine_tuning_and_opt_outs_do_not() {
        let name = cache_claim_name(None, "owner/base", "main");
        assert_eq!(shared_cache(&lora_job(""), true), Some(name.clone()));
        assert_eq!(
            shared_cache(&lora_job(""), false),
            None,
            "the operator's switch"
        );
        assert_eq!(shared_cache(&lora_job(", cache: Private"), true), None);
        assert_eq!(shared_cache(&lora_job("full"), true), None);
        assert_eq!(
            shared_cache(&lora_job("full, cache: Shared"), true),
            Some(name)
        );
    }

    fn claim(annotations: &[(&str, &str)]) -> PersistentVolumeClaim {
        PersistentVolumeClaim {
            metadata: ObjectMeta {
                name: Some("headroom-model-x".into()),
                labels: Some(
                    [(
                        LABEL_COMPONENT.to_string(),
                        COMPONENT_MODEL_CACHE.to_string(),
                    )]
                    .into(),
                ),
                annotations: Some(
                    annotations
                        .iter()
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .collect(),
                ),
                ..ObjectMeta::default()
            },
            ..PersistentVolumeClaim::default()
        }
    }

    #[test]
    fn the_first_job_fills_the_next_wait_then_read_and_an_orphan_is_taken_over() {
        let me = "uid-me";
        let absent = CacheState::of(None::<&PersistentVolumeClaim>);
        assert_eq!(
            role("c", &absent, me),
            CacheRole::Fill {
                create: true,
                take_over: false
            }
        );
        let mut c = claim(&[
            (ANNOTATION_CACHE_STATE, CACHE_STATE_FILLING),
            (ANNOTATION_CACHE_FILLER, "uid-other"),
            (ANNOTATION_CACHE_FILLER_JOB, "first"),
        ]);
        match role("c", &CacheState::of(Some(&c)), me) {
            CacheRole::Wait(m) => assert!(m.contains("job first") && m.contains("claim c"), "{m}"),
            r => panic!("{r:?}"),
        }
        assert_eq!(
            role("c", &CacheState::of(Some(&c)), "uid-other"),
            CacheRole::Fill {
                create: false,
                take_over: false
            },
            "the filler's retry fills on"
        );
        c.metadata
            .annotations
            .as_mut()
            .expect("annotations")
            .remove(ANNOTATION_CACHE_FILLER);
        assert_eq!(
            role("c", &CacheState::of(Some(&c)), me),
            CacheRole::Fill {
                create: false,
                take_over: true
            }
        );
        let ready = claim(&[(ANNOTATION_CACHE_STATE, CACHE_STATE_READY)]);
        assert_eq!(
            role("c", &CacheState::of(Some(&ready)), me),
            CacheRole::Read
        );
        let mut deleting = ready.clone();
        deleting.metadata.deletion_timestamp = Some(Time(Timestamp::now()));
        assert!(matches!(
            role("c", &CacheState::of(Some(&deleting)), me),
            CacheRole::Wait(_)
        ));
    }

    #[test]
    fn a_new_claim_is_filling_by_its_job_and_owned_by_none() {
        let j = lora_job("");
        let name = shared_cache(&j, true).expect("shared");
        let c = cache_claim(&j, &name, &ChildConfig::default(), Timestamp::UNIX_EPOCH);
        assert!(c.metadata.owner_references.is_none());
        assert!(is_cache_claim(&c));
        assert_eq!(
            CacheState::of(Some(&c)),
            CacheState::Filling {
                filler: Some(("0000-1111".into(), "finetune-tiny-llama".into()))
            }
        );
        assert_eq!(c.annotations()[ANNOTATION_CACHE_REPO], "owner/base");
    }

    #[test]
    fn the_collector_touches_used_claims_frees_orphans_and_deletes_idle_ones() {
        let idle = Duration::from_secs(600);
        let refresh = Duration::from_secs(60);
        let t0: Timestamp = "2026-12-02T00:00:00Z".parse().expect("time");
        let at = |s: i64| t0 + jiff::SignedDuration::from_secs(s);
        let ready = claim(&[
            (ANNOTATION_CACHE_STATE, CACHE_STATE_READY),
            (ANNOTATION_CACHE_LAST_USED, "2026-12-02T00:00:00Z"),
        ]);
        let users = vec!["uid-a".to_string()];
        assert_eq!(
            collect(&ready, &users, at(30), idle, refresh),
            Collect::Keep
        );
        assert_eq!(
            collect(&ready, &users, at(61), idle, refresh),
            Collect::Touch
        );
        assert_eq!(
            collect(&ready, &users, at(10_000), idle, refresh),
            Collect::Touch,
            "in use: never deleted"
        );
        assert_eq!(collect(&ready, &[], at(599), idle, refresh), Collect::Keep);
        assert_eq!(
            collect(&ready, &[], at(600), idle, refresh),
            Collect::Delete
        );
        let orphan = claim(&[
            (ANNOTATION_CACHE_STATE, CACHE_STATE_FILLING),
            (ANNOTATION_CACHE_FILLER, "uid-gone"),
            (ANNOTATION_CACHE_LAST_USED, "2026-12-02T00:00:00Z"),
        ]);
        assert_eq!(
            collect(&orphan, &users, at(1), idle, refresh),
            Collect::ReleaseFiller
        );
        let filling = claim(&[
            (ANNOTATION_CACHE_STATE, CACHE_STATE_FILLING),
            (ANNOTATION_CACHE_FILLER, "uid-a"),
            (ANNOTATION_CACHE_LAST_USED, "2026-12-02T00:00:00Z"),
        ]);
        assert_eq!(
            collect(&filling, &users, at(1), idle, refresh),
            Collect::Keep
        );
    }
}
