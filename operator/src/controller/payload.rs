//! Where a fine-tuning job's files are inside its pods (pure).
//!
//! A `model.pretrained` job reads a checkpoint and a data file and writes a
//! fine-tuned model. Every claim the spec names is mounted once, at
//! `/var/lib/headroom/claims/<claim>` (read-only unless the output goes
//! there), so the same claim can hold the model, the data and the output. A
//! checkpoint from the Hugging Face hub is downloaded into the job's own
//! checkpoint claim (`model/`), which outlives attempts, so retries never
//! download it again; the output defaults to `output/` on that claim, which
//! is kept when the job succeeds.
//!
//! The initializer pod ([`initializer_pod`]) fetches and checks what the job
//! names before anything is planned; the worker pods get the same mounts and
//! the paths in their assignment ([`payload_files`]).

use std::collections::BTreeMap;

use headroom_api::{
    DEFAULT_CHECKPOINT_DIR, DEFAULT_HF_ENDPOINT, DataFormat, DataSource, HF_DATASET_TOKEN_ENV,
    HF_TOKEN_ENV, HubModel, INITIALIZE_JSON_ENV, InitializerAssignment, LABEL_JOB,
    MemoryAwareTrainingJob, ModelSource, PayloadFiles, TERMINATION_MESSAGE_PATH, TextFormat,
    VolumePath,
};
use k8s_openapi::api::core::v1::{
    Container, EnvVar, EnvVarSource, LocalObjectReference, PersistentVolumeClaimVolumeSource, Pod,
    PodSpec, ResourceRequirements, SecretKeySelector, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::ResourceExt;

use super::children::{
    checkpoint_claim_name, dns_label, job_volumes, owner, restricted_container_security,
    restricted_pod_security,
};

/// Where the claims a job names are mounted.
const CLAIMS_DIR: &str = "/var/lib/headroom/claims";
/// The label that tells an initializer pod from the workers.
pub const LABEL_ROLE: &str = "headroom.dev/role";
pub const ROLE_INITIALIZER: &str = "initializer";
/// The initializer streams files and tokenizes the text: bounded, small.
const INITIALIZER_MEMORY: &str = "1Gi";

/// The in-pod path of a file or directory on a claim.
fn claim_path(v: &VolumePath) -> String {
    let path = v.path.trim_matches('/');
    if path.is_empty() {
        format!("{CLAIMS_DIR}/{}", v.claim_name)
    } else {
        format!("{CLAIMS_DIR}/{}/{path}", v.claim_name)
    }
}

/// The files of a `model.pretrained` job as its pods see them; `None` for
/// any other job.
pub fn payload_files(job: &MemoryAwareTrainingJob) -> Option<PayloadFiles> {
    let spec = &job.spec;
    let pretrained = spec.model.pretrained.as_ref()?;
    let data = spec.data.as_ref()?;
    let model_dir = match &pretrained.volume {
        Some(v) => claim_path(v),
        None => format!("{DEFAULT_CHECKPOINT_DIR}/model"),
    };
    let output_dir = match &spec.output {
        Some(o) => claim_path(&o.volume),
        None => format!("{DEFAULT_CHECKPOINT_DIR}/output"),
    };
    let data_file = match (&data.volume, &data.hugging_face) {
        (Some(v), _) => claim_path(v),
        // Downloaded by the initializer into the job's checkpoint volume,
        // where every attempt's workers read it.
        (None, Some(hf)) => format!("{DEFAULT_CHECKPOINT_DIR}/data/{}", hf.file),
        (None, None) => return None,
    };
    Some(PayloadFiles {
        model_dir,
        data_file,
        data_format: match data.format {
            TextFormat::Jsonl => DataFormat::Jsonl {
                field: data.field.clone(),
            },
            TextFormat::Text => DataFormat::Text,
        },
        output_dir,
        hub_model: pretrained.hugging_face.as_ref().map(|hf| HubModel {
            repo: hf.repo.clone(),
            revision: hf.revision.clone(),
        }),
    })
}

/// Where the output is, for the status: `<claim>:<path>`.
pub fn output_location(job: &MemoryAwareTrainingJob) -> Option<String> {
    job.spec.model.pretrained.as_ref()?;
    Some(match &job.spec.output {
        Some(o) => format!("{}:{}", o.volume.claim_name, o.volume.path),
        None => format!("{}:output", checkpoint_claim_name(job)),
    })
}

/// The user's claims a job's pods mount (besides the job's checkpoint
/// claim): each once, writable only if the output goes there.
pub fn claim_mounts(job: &MemoryAwareTrainingJob) -> (Vec<Volume>, Vec<VolumeMount>) {
    let spec = &job.spec;
    let mut claims: BTreeMap<String, bool> = BTreeMap::new(); // name → writable
    let mut add = |v: &VolumePath, writable: bool| {
        *claims.entry(v.claim_name.clone()).or_insert(false) |= writable;
    };
    if let Some(v) = spec
        .model
        .pretrained
        .as_ref()
        .and_then(|p| p.volume.as_ref())
    {
        add(v, false);
    }
    if let Some(v) = spec.data.as_ref().and_then(|d| d.volume.as_ref()) {
        add(v, false);
    }
    if let Some(o) = &spec.output {
        add(&o.volume, true);
    }
    claims.remove(&checkpoint_claim_name(job)); // already mounted, writable
    claims
        .into_iter()
        .enumerate()
        .map(|(i, (claim, writable))| {
            let name = format!("claim-{i}");
            (
                Volume {
                    name: name.clone(),
                    persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                        claim_name: claim.clone(),
                        read_only: Some(!writable),
                    }),
                    ..Volume::default()
                },
                VolumeMount {
                    name,
                    mount_path: format!("{CLAIMS_DIR}/{claim}"),
                    read_only: Some(!writable),
                    ..VolumeMount::default()
                },
            )
        })
        .unzip()
}

/// The initializer pod of run `run` (1-based; a transient failure starts another).
pub fn initializer_pod_name(job: &MemoryAwareTrainingJob, run: u32) -> String {
    dns_label(&job.name_any(), &format!("-init-{run}"))
}

/// A spec's `endpoint`, else the Hugging Face hub.
fn endpoint_or_hub(endpoint: &Option<String>) -> String {
    endpoint
        .clone()
        .unwrap_or_else(|| DEFAULT_HF_ENDPOINT.into())
}

/// What the initializer is asked to do.
pub fn initializer_assignment(job: &MemoryAwareTrainingJob) -> Option<InitializerAssignment> {
    let pretrained = job.spec.model.pretrained.as_ref()?;
    let files = payload_files(job)?;
    let model = match &pretrained.hugging_face {
        Some(hf) => ModelSource::HuggingFace {
            repo: hf.repo.clone(),
            revision: hf.revision.clone(),
            endpoint: endpoint_or_hub(&hf.endpoint),
        },
        None => ModelSource::Volume,
    };
    let data = match job.spec.data.as_ref().and_then(|d| d.hugging_face.as_ref()) {
        Some(hf) => DataSource::HuggingFace {
            repo: hf.repo.clone(),
            revision: hf.revision.clone(),
            endpoint: endpoint_or_hub(&hf.endpoint),
            file: hf.file.clone(),
        },
        None => DataSource::Volume,
    };
    Some(InitializerAssignment {
        job: job.name_any(),
        namespace: job.namespace().unwrap_or_default(),
        model,
        model_dir: files.model_dir,
        data_file: files.data_file,
        data,
        data_format: files.data_format,
        sequence_length: pretrained.sequence_length,
    })
}

/// The initializer pod: the worker image (`image`, the one the job's workers
/// run) in its initializer mode, with the job's claims and, for a gated repository, the token (no other pod of the
/// job sees it). Its report comes through its termination message, which
/// the operator reads; while it runs it reports its progress, as the
/// workers their telemetry, through the operator's worker API
/// ([`super::children::worker_api_access`]), which writes it into its own
/// entry of `status.workers`.
pub fn initializer_pod(
    job: &MemoryAwareTrainingJob,
    run: u32,
    image: &str,
    cfg: &super::config::ChildConfig,
) -> Result<Option<Pod>, serde_json::Error> {
    let Some(assignment) = initializer_assignment(job) else {
        return Ok(None);
    };
    let spec = &job.spec;
    let mut env = vec![
        EnvVar {
            name: INITIALIZE_JSON_ENV.into(),
            value: Some(serde_json::to_string(&assignment)?),
            ..EnvVar::default()
        },
        super::children::pod_name_env(),
        super::children::telemetry_interval_env(cfg),
    ];
    let model_token = spec
        .model
        .pretrained
        .as_ref()
        .and_then(|p| p.hugging_face.as_ref())
        .and_then(|hf| hf.token_secret.as_ref());
    let data_token = spec
        .data
        .as_ref()
        .and_then(|d| d.hugging_face.as_ref())
        .and_then(|hf| hf.token_secret.as_ref());
    for (name, secret) in [
        (HF_TOKEN_ENV, model_token),
        (HF_DATASET_TOKEN_ENV, data_token),
    ] {
        let Some(secret) = secret else { continue };
        env.push(EnvVar {
            name: name.into(),
            value_from: Some(EnvVarSource {
                secret_key_ref: Some(SecretKeySelector {
                    name: secret.name.clone(),
                    key: secret.key.clone(),
                    optional: Some(false),
                }),
                ..EnvVarSource::default()
            }),
            ..EnvVar::default()
        });
    }
    let (mut volumes, mut mounts) = job_volumes(job);
    let (claim_volumes, claim_mounts) = claim_mounts(job);
    volumes.extend(claim_volumes);
    mounts.extend(claim_mounts);
    let (api_env, api_volumes, api_mounts) = super::children::worker_api_access(cfg);
    env.extend(api_env);
    volumes.extend(api_volumes);
    mounts.extend(api_mounts);
    let labels: BTreeMap<String, String> = [
        (LABEL_JOB.to_string(), job.name_any()),
        (LABEL_ROLE.to_string(), ROLE_INITIALIZER.to_string()),
        (
            "app.kubernetes.io/managed-by".to_string(),
            "headroom".to_string(),
        ),
        (
            "app.kubernetes.io/component".to_string(),
            "initializer".to_string(),
        ),
    ]
    .into_iter()
    .collect();
    let memory = Quantity(INITIALIZER_MEMORY.into());
    let resources: BTreeMap<String, Quantity> = [("memory".to_string(), memory)].into();
    Ok(Some(Pod {
        metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
            name: Some(initializer_pod_name(job, run)),
            namespace: job.namespace(),
            labels: Some(labels),
            owner_references: Some(vec![owner(job)]),
            ..Default::default()
        },
        spec: Some(PodSpec {
            restart_policy: Some("Never".into()),
            // No API rights and no API token: its download progress goes
            // through the operator's worker API, as the workers' telemetry.
            service_account_name: Some("default".into()),
            automount_service_account_token: Some(false),
            priority_class_name: spec.worker.priority_class_name.clone(),
            image_pull_secrets: (!spec.worker.image_pull_secrets.is_empty()).then(|| {
                spec.worker
                    .image_pull_secrets
                    .iter()
                    .map(|name| LocalObjectReference { name: name.clone() })
                    .collect()
            }),
            node_selector: (!spec.worker.node_selector.is_empty())
                .then(|| spec.worker.node_selector.clone()),
            tolerations: (!spec.worker.tolerations.is_empty()).then(|| {
                crate::inventory::worker_tolerations(job, headroom_planner::DeviceKind::Cpu)
            }),
            security_context: Some(restricted_pod_security()),
            containers: vec![Container {
                name: "initializer".into(),
                image: Some(image.into()),
                image_pull_policy: spec.worker.image_pull_policy.map(|p| p.as_str().into()),
                env: Some(env),
                resources: Some(ResourceRequirements {
                    limits: Some(resources.clone()),
                    requests: Some(resources),
                    ..ResourceRequirements::default()
                }),
                termination_message_path: Some(TERMINATION_MESSAGE_PATH.into()),
                termination_message_policy: Some("FallbackToLogsOnError".into()),
                security_context: Some(restricted_container_security()),
                volume_mounts: Some(mounts),
                ..Container::default()
            }],
            volumes: Some(volumes),
            ..PodSpec::default()
        }),
        ..Pod::default()
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controller::children::tests::job;
    use crate::controller::config::ChildConfig;
    use headroom_api::POD_NAME_ENV;

    fn finetune(yaml_extra: &str) -> MemoryAwareTrainingJob {
        let base = include_str!("../../../samples/cpu-finetune-tiny-llama.yaml");
        job(&format!("{base}{yaml_extra}"))
    }

    fn mounts(pod: &Pod) -> Vec<(String, String, bool)> {
        let spec = pod.spec.as_ref().expect("spec");
        let container = &spec.containers[0];
        container
            .volume_mounts
            .iter()
            .flatten()
            .map(|m| {
                let claim = spec
                    .volumes
                    .iter()
                    .flatten()
                    .find(|v| v.name == m.name)
                    .and_then(|v| v.persistent_volume_claim.as_ref())
                    .map_or("-".to_string(), |c| c.claim_name.clone());
                (m.mount_path.clone(), claim, m.read_only.unwrap_or(false))
            })
            .collect()
    }

    #[test]
    fn files_are_on_the_named_claims_and_only_the_output_claim_is_writable() {
        let j = finetune("  output:\n    volume: {claimName: models, path: tuned/tiny}\n");
        let files = payload_files(&j).expect("a fine-tuning job");
        assert_eq!(
            files.model_dir,
            "/var/lib/headroom/claims/models/tiny-llama"
        );
        assert_eq!(
            files.data_file,
            "/var/lib/headroom/claims/datasets/declaration-of-independence.jsonl"
        );
        assert_eq!(
            files.output_dir,
            "/var/lib/headroom/claims/models/tuned/tiny"
        );
        assert_eq!(
            files.hub_model, None,
            "a model from a volume names its directory"
        );
        let (volumes, mounts) = claim_mounts(&j);
        assert_eq!(volumes.len(), 2, "each claim once");
        let writable: Vec<_> = mounts
            .iter()
            .map(|m| (m.mount_path.as_str(), m.read_only))
            .collect();
        assert_eq!(
            writable,
            vec![
                ("/var/lib/headroom/claims/datasets", Some(true)),
                ("/var/lib/headroom/claims/models", Some(false)),
            ]
        );
        // No output named: the job's own claim, kept on success.
        let j = finetune("");
        assert_eq!(
            payload_files(&j).expect("files").output_dir,
            format!("{DEFAULT_CHECKPOINT_DIR}/output")
        );
        assert_eq!(
            output_location(&j).as_deref(),
            Some("finetune-tiny-llama-checkpoints:output")
        );
    }

    #[test]
    fn the_initializer_alone_gets_the_token_and_reports_through_the_worker_api() {
        let j = job(include_str!(
            "../../../samples/gpu-finetune-llama-3.2-1b.yaml"
        ));
        let config = ChildConfig {
            worker_api_url: Some("http://10.96.0.20:8081".into()),
            ..ChildConfig::default()
        };
        let pod = initializer_pod(&j, 1, "registry.example/headroom-worker-cuda:1", &config)
            .expect("build")
            .expect("a pretrained job");
        let spec = pod.spec.as_ref().expect("spec");
        // No API token and no rights: progress goes through the worker API
        // with a token only that API accepts.
        assert_eq!(spec.automount_service_account_token, Some(false));
        assert_eq!(spec.service_account_name.as_deref(), Some("default"));
        let env = spec.containers[0].env.clone().unwrap_or_default();
        let value = |name: &str| env.iter().find(|e| e.name == name)?.value.clone();
        assert_eq!(
            value(headroom_api::WORKER_API_ENV).as_deref(),
            Some("http://10.96.0.20:8081")
        );
        let projected = spec
            .volumes
            .iter()
            .flatten()
            .find_map(|v| v.projected.as_ref())
            .and_then(|p| p.sources.as_ref()?.first()?.service_account_token.clone())
            .expect("a projected token");
        assert_eq!(
            projected.audience.as_deref(),
            Some(headroom_api::WORKER_API_AUDIENCE)
        );
        let pod_name = env
            .iter()
            .find(|e| e.name == POD_NAME_ENV)
            .and_then(|e| e.value_from.as_ref()?.field_ref.as_ref())
            .map(|f| f.field_path.as_str());
        assert_eq!(pod_name, Some("metadata.name"));
        let token = env
            .iter()
            .find(|e| e.name == HF_TOKEN_ENV)
            .expect("token env");
        let secret = token
            .value_from
            .as_ref()
            .and_then(|v| v.secret_key_ref.as_ref())
            .expect("from the Secret");
        assert_eq!(
            (secret.name.as_str(), secret.key.as_str()),
            ("hf-token", "token")
        );
        let assignment: InitializerAssignment = serde_json::from_str(
            env.iter()
                .find(|e| e.name == INITIALIZE_JSON_ENV)
                .and_then(|e| e.value.as_deref())
                .expect("assignment"),
        )
        .expect("JSON");
        assert_eq!(
            assignment.model,
            ModelSource::HuggingFace {
                repo: "meta-llama/Llama-3.2-1B".into(),
                revision: "main".into(),
                endpoint: DEFAULT_HF_ENDPOINT.into()
            }
        );
        assert_eq!(
            assignment.model_dir,
            format!("{DEFAULT_CHECKPOINT_DIR}/model")
        );
        // Downloads go to the job's checkpoint claim; the data claim is read-only.
        assert!(mounts(&pod).contains(&(
            DEFAULT_CHECKPOINT_DIR.to_string(),
            "finetune-llama-3-2-1b-checkpoints".to_string(),
            false
        )));
        assert!(mounts(&pod).contains(&(
            "/var/lib/headroom/claims/datasets".to_string(),
            "datasets".to_string(),
            true
        )));
        let sc = spec.containers[0]
            .security_context
            .as_ref()
            .expect("restricted");
        assert_eq!(sc.read_only_root_filesystem, Some(true));
        assert_eq!(sc.allow_privilege_escalation, Some(false));
    }
}

#[cfg(test)]
mod hub_data_tests {
    use super::*;
    use crate::controller::children::tests::job;
    use crate::controller::config::ChildConfig;

    #[test]
    fn a_dataset_from_the_hub_goes_to_the_checkpoint_volume_with_its_own_token() {
        let j = job(&include_str!("../../../samples/gpu-finetune-llama-3.2-1b.yaml").replace(
            "volume: {claimName: datasets, path: support-tickets.jsonl}",
            "huggingFace: {repo: acme/tickets, revision: v2, file: data/train.jsonl, tokenSecret: {name: hf-data}}",
        ));
        let files = payload_files(&j).expect("files");
        assert_eq!(
            files.data_file,
            format!("{DEFAULT_CHECKPOINT_DIR}/data/data/train.jsonl")
        );
        // The model's hub id reaches the workers, for the adapter's config.
        assert_eq!(
            files.hub_model,
            Some(HubModel {
                repo: "meta-llama/Llama-3.2-1B".into(),
                revision: "main".into(),
            })
        );
        let a = initializer_assignment(&j).expect("assignment");
        assert_eq!(
            a.data,
            DataSource::HuggingFace {
                repo: "acme/tickets".into(),
                revision: "v2".into(),
                endpoint: DEFAULT_HF_ENDPOINT.into(),
                file: "data/train.jsonl".into(),
            }
        );
        let pod = initializer_pod(
            &j,
            1,
            "registry.example/headroom-worker-cuda:1",
            &ChildConfig::default(),
        )
        .expect("build")
        .expect("pod");
        let env = pod.spec.expect("spec").containers[0]
            .env
            .clone()
            .unwrap_or_default();
        let secret = |name: &str| {
            env.iter()
                .find(|e| e.name == name)
                .and_then(|e| e.value_from.as_ref()?.secret_key_ref.as_ref())
                .map(|s| (s.name.clone(), s.key.clone()))
        };
        assert_eq!(
            secret(HF_TOKEN_ENV),
            Some(("hf-token".into(), "token".into()))
        );
        assert_eq!(
            secret(HF_DATASET_TOKEN_ENV),
            Some(("hf-data".into(), "token".into()))
        );
        // No claim of the user's is mounted for the data any more.
        let (volumes, _) = claim_mounts(&j);
        let claims: Vec<String> = volumes
            .iter()
            .filter_map(|v| Some(v.persistent_volume_claim.as_ref()?.claim_name.clone()))
            .collect();
        assert_eq!(claims, ["models"], "only the output's claim");
    }
}
