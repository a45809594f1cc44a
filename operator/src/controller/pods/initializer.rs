//! The initializer pod of a fine-tuning (`model.pretrained`) job: before
//! anything is planned, it fetches what the job names into its claims and
//! checks the checkpoint, the tokenizer and the data against each other
//! ([`initializer_assignment`]). It is the restricted skeleton
//! ([`super::skeleton::restricted_pod`]) with the worker image in its
//! initializer mode.

use std::collections::BTreeMap;

use headroom_api::{
    DEFAULT_HF_ENDPOINT, DataSource, HF_DATASET_TOKEN_FILE_ENV, HF_DATASET_TOKEN_PATH,
    HF_TOKEN_FILE_ENV, HF_TOKEN_PATH, INITIALIZE_JSON_ENV, InitializerAssignment,
    MemoryAwareTrainingJob, ModelSource, SecretKey,
};
use headroom_planner::DeviceKind;
use k8s_openapi::api::core::v1::{
    EnvVar, KeyToPath, Pod, ResourceRequirements, SecretVolumeSource, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::ResourceExt;

use super::files::{hub_data_dir, hub_data_files, model_cache_path, payload_files};
use super::names::initializer_pod_name;
use super::skeleton::{
    Component, PodParts, pod_name_env, restricted_pod, telemetry_interval_env, worker_api_access,
};
use crate::controller::config::ChildConfig;

/// The initializer streams files and tokenizes the text: bounded, small.
const INITIALIZER_MEMORY: &str = "1Gi";

/// A spec's `endpoint`, else the Hugging Face hub.
fn endpoint_or_hub(endpoint: &Option<String>) -> String {
    endpoint
        .clone()
        .unwrap_or_else(|| DEFAULT_HF_ENDPOINT.into())
}

/// Owner and group may read a token file; nobody else (the pod's group,
/// `fsGroup`, owns it; the initializer runs in that group).
const TOKEN_FILE_MODE: i32 = 0o440;

/// The Hugging Face tokens the job names (`tokenSecret` of the model and of
/// the dataset), each as what the initializer needs to read it: the one key
/// of the Secret as a read-only file (a secret volume with only that item),
/// and a variable naming the file's path. The token itself is never in the
/// pod's spec or environment.
fn token_files(job: &MemoryAwareTrainingJob) -> Vec<(EnvVar, Volume, VolumeMount)> {
    let spec = &job.spec;
    let model = spec
        .model
        .pretrained
        .as_ref()
        .and_then(|p| p.hugging_face.as_ref())
        .and_then(|hf| hf.token_secret.as_ref());
    let data = spec
        .data
        .as_ref()
        .and_then(|d| d.hugging_face.as_ref())
        .and_then(|hf| hf.token_secret.as_ref());
    let file = |env: &str, path: &str, volume: &str, secret: &SecretKey| {
        let (dir, name) = path.rsplit_once('/').unwrap_or(("/", path));
        (
            EnvVar {
                name: env.into(),
                value: Some(path.into()),
                ..EnvVar::default()
            },
            Volume {
                name: volume.into(),
                secret: Some(SecretVolumeSource {
                    secret_name: Some(secret.name.clone()),
                    items: Some(vec![KeyToPath {
                        key: secret.key.clone(),
                        path: name.into(),
                        mode: None,
                    }]),
                    default_mode: Some(TOKEN_FILE_MODE),
                    optional: Some(false),
                }),
                ..Volume::default()
            },
            VolumeMount {
                name: volume.into(),
                mount_path: dir.into(),
                read_only: Some(true),
                ..VolumeMount::default()
            },
        )
    };
    let mut out = Vec::new();
    if let Some(secret) = model {
        out.push(file(HF_TOKEN_FILE_ENV, HF_TOKEN_PATH, "hf-token", secret));
    }
    if let Some(secret) = data {
        out.push(file(
            HF_DATASET_TOKEN_FILE_ENV,
            HF_DATASET_TOKEN_PATH,
            "hf-dataset-token",
            secret,
        ));
    }
    out
}

/// What the initializer is asked to do.
/// `fill_cache`: the job downloads into the shared model cache claim; a
/// job that reads a filled one (`status.modelCache`, not filling) only
/// checks it, as a model on a volume.
fn initializer_assignment(
    job: &MemoryAwareTrainingJob,
    fill_cache: bool,
) -> Option<InitializerAssignment> {
    let pretrained = job.spec.model.pretrained.as_ref()?;
    let files = payload_files(job)?;
    let reads_cache = model_cache_path(job).is_some() && !fill_cache;
    let hub = pretrained
        .hugging_face
        .as_ref()
        .map(|hf| ModelSource::HuggingFace {
            repo: hf.repo.clone(),
            revision: hf.revision.clone(),
            endpoint: endpoint_or_hub(&hf.endpoint),
        });
    // A reader checks the claim's copy, and asks the hub which commit the
    // revision names now (the operator compares it with the claim's).
    let (model, cache_of) = match hub {
        Some(hub) if reads_cache => (ModelSource::Volume, Some(hub)),
        Some(hub) => (hub, None),
        None => (ModelSource::Volume, None),
    };
    let data = match job.spec.data.as_ref().and_then(|d| d.hugging_face.as_ref()) {
        Some(hf) => DataSource::HuggingFace {
            repo: hf.repo.clone(),
            revision: hf.revision.clone(),
            endpoint: endpoint_or_hub(&hf.endpoint),
            data_dir: hub_data_dir(),
            files: hub_data_files(hf),
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
        train_on: files.train_on,
        data_split: files.data_split,
        packing: files.packing,
        sequence_length: pretrained.sequence_length,
        cache_of,
    })
}

/// The initializer pod of run `run`; `None` for a job that is not a
/// fine-tuning job. The worker image (`image`, the one the job's workers
/// run) in its initializer mode, with the job's claims and, for a gated
/// repository, the token: one key of the job's Secret mounted read-only as
/// a file, whose path is in the environment ([`token_files`]; no other pod
/// of the job sees it). Its report comes through its termination message,
/// which the operator reads; while
/// it runs it reports its progress, as the workers their telemetry, through
/// the operator's worker API ([`super::skeleton::worker_api_access`]),
/// which writes it into its own entry of `status.workers`.
pub fn initializer_pod(
    job: &MemoryAwareTrainingJob,
    run: u32,
    image: &str,
    cfg: &ChildConfig,
) -> Result<Option<Pod>, serde_json::Error> {
    initializer_pod_filling(job, run, image, cfg, false)
}

/// [`initializer_pod`], which with `fill_cache` downloads into the job's
/// shared model cache claim (`status.modelCache`), mounted writable in this
/// pod alone.
pub fn initializer_pod_filling(
    job: &MemoryAwareTrainingJob,
    run: u32,
    image: &str,
    cfg: &ChildConfig,
    fill_cache: bool,
) -> Result<Option<Pod>, serde_json::Error> {
    let Some(assignment) = initializer_assignment(job, fill_cache) else {
        return Ok(None);
    };
    let spec = &job.spec;
    let mut env = vec![
        EnvVar {
            name: INITIALIZE_JSON_ENV.into(),
            value: Some(serde_json::to_string(&assignment)?),
            ..EnvVar::default()
        },
        pod_name_env(),
        telemetry_interval_env(cfg),
    ];
    let tokens = token_files(job);
    env.extend(tokens.iter().map(|(e, _, _)| e.clone()));
    env.extend(worker_api_access(cfg).0);
    let memory = Quantity(INITIALIZER_MEMORY.into());
    let resources: BTreeMap<String, Quantity> = [("memory".to_string(), memory)].into();
    let mut pod = restricted_pod(
        job,
        cfg,
        PodParts {
            name: initializer_pod_name(job, run),
            component: Component::Initializer,
            labels: BTreeMap::new(),
            container: "initializer",
            image,
            env,
            resources: ResourceRequirements {
                limits: Some(resources.clone()),
                requests: Some(resources),
                ..ResourceRequirements::default()
            },
            // Where the workers may run: the user's node pool.
            node_selector: spec.worker.node_selector.clone(),
            // The initializer uses no device: the user's tolerations only,
            // not the GPU one a GPU job's workers add (`worker_tolerations`
            // on `Cpu` is `spec.worker.tolerations` as written; none when it
            // names none).
            tolerations: crate::inventory::worker_tolerations(job, DeviceKind::Cpu),
        },
    );
    // On top of the skeleton, this pod's alone: the token files, and the
    // cache claim it fills writable.
    if let (Some(spec), true, Some(cache)) = (pod.spec.as_mut(), fill_cache, model_cache_path(job))
    {
        let volume = spec.volumes.iter_mut().flatten().find(|v| {
            v.persistent_volume_claim
                .as_ref()
                .is_some_and(|c| c.claim_name == cache.claim_name)
        });
        if let Some(volume) = volume {
            if let Some(c) = volume.persistent_volume_claim.as_mut() {
                c.read_only = Some(false);
            }
            let name = volume.name.clone();
            for c in &mut spec.containers {
                for m in c.volume_mounts.iter_mut().flatten() {
                    if m.name == name {
                        m.read_only = Some(false);
                    }
                }
            }
        }
    }
    if let Some(spec) = pod.spec.as_mut() {
        for (_, volume, mount) in tokens {
            spec.volumes.get_or_insert_with(Vec::new).push(volume);
            if let Some(c) = spec.containers.first_mut() {
                c.volume_mounts.get_or_insert_with(Vec::new).push(mount);
            }
        }
    }
    Ok(Some(pod))
}

#[cfg(test)]
mod tests {
    use headroom_api::{DEFAULT_CHECKPOINT_DIR, DataSplit, HubDataFiles, HubModel, POD_NAME_ENV};

    use super::super::files::claim_mounts;
    use super::super::tests::job;
    use super::*;

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

    /// The pod's Secret volumes as (mount path, Secret, key, file), each
    /// mounted read-only, with only that key and no other pod's access.
    fn token_volumes(pod: &Pod) -> Vec<(String, String, String, String)> {
        let spec = pod.spec.as_ref().expect("spec");
        let container = &spec.containers[0];
        spec.volumes
            .iter()
            .flatten()
            .filter_map(|v| Some((v, v.secret.as_ref()?)))
            .map(|(v, secret)| {
                let mount = container
                    .volume_mounts
                    .iter()
                    .flatten()
                    .find(|m| m.name == v.name)
                    .expect("mounted");
                assert_eq!(mount.read_only, Some(true), "{} read-only", v.name);
                assert_eq!(secret.default_mode, Some(0o440), "{}", v.name);
                assert_eq!(secret.optional, Some(false), "{}", v.name);
                let items = secret.items.clone().unwrap_or_default();
                assert_eq!(items.len(), 1, "{}: only the token's key", v.name);
                (
                    mount.mount_path.clone(),
                    secret.secret_name.clone().unwrap_or_default(),
                    items[0].key.clone(),
                    items[0].path.clone(),
                )
            })
            .collect()
    }

    #[test]
    fn the_initializer_alone_gets_the_token_and_reports_through_the_worker_api() {
        let j = job(include_str!(
            "../../../../samples/gpu-finetune-llama-3.2-1b.yaml"
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
        // The token is a file: one key of the Secret, read-only, and the
        // environment names its path; no variable holds a Secret's value.
        assert_eq!(value(HF_TOKEN_FILE_ENV).as_deref(), Some(HF_TOKEN_PATH));
        assert!(
            env.iter().all(|e| e
                .value_from
                .as_ref()
                .is_none_or(|v| v.secret_key_ref.is_none())),
            "no Secret in the environment: {env:?}"
        );
        assert_eq!(
            token_volumes(&pod),
            [(
                "/var/run/secrets/headroom.dev/hf-token".to_string(),
                "hf-token".to_string(),
                "token".to_string(),
                "token".to_string()
            )]
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

    #[test]
    fn a_dataset_from_the_hub_goes_to_the_checkpoint_volume_with_its_own_token() {
        let j = job(&include_str!("../../../../samples/gpu-finetune-llama-3.2-1b.yaml").replace(
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
        let a = initializer_assignment(&j, false).expect("assignment");
        assert_eq!(
            a.data,
            DataSource::HuggingFace {
                repo: "acme/tickets".into(),
                revision: "v2".into(),
                endpoint: DEFAULT_HF_ENDPOINT.into(),
                data_dir: format!("{DEFAULT_CHECKPOINT_DIR}/data"),
                files: HubDataFiles::File("data/train.jsonl".into()),
            }
        );
        // A split instead of a file: the workers find its files in the
        // download directory as the initializer found them on the hub.
        let by_split = job(
            &include_str!("../../../../samples/gpu-finetune-llama-3.2-1b.yaml").replace(
                "volume: {claimName: datasets, path: support-tickets.jsonl}",
                "huggingFace: {repo: acme/tickets, subset: en}",
            ),
        );
        let split = DataSplit {
            subset: Some("en".into()),
            split: "train".into(),
        };
        let files = payload_files(&by_split).expect("files");
        assert_eq!(files.data_file, format!("{DEFAULT_CHECKPOINT_DIR}/data"));
        assert_eq!(files.data_split, Some(split.clone()));
        let a = initializer_assignment(&by_split, false).expect("assignment");
        assert!(
            matches!(&a.data, DataSource::HuggingFace { files: HubDataFiles::Split(s), .. } if *s == split),
            "{:?}",
            a.data
        );
        assert_eq!(a.data_split, Some(split));
        let pod = initializer_pod(
            &j,
            1,
            "registry.example/headroom-worker-cuda:1",
            &ChildConfig::default(),
        )
        .expect("build")
        .expect("pod");
        // Each token in its own file, from its own Secret.
        assert_eq!(
            token_volumes(&pod),
            [
                (
                    "/var/run/secrets/headroom.dev/hf-token".to_string(),
                    "hf-token".to_string(),
                    "token".to_string(),
                    "token".to_string()
                ),
                (
                    "/var/run/secrets/headroom.dev/hf-dataset-token".to_string(),
                    "hf-data".to_string(),
                    "token".to_string(),
                    "token".to_string()
                )
            ]
        );
        let env = pod.spec.expect("spec").containers[0]
            .env
            .clone()
            .unwrap_or_default();
        let value = |name: &str| env.iter().find(|e| e.name == name)?.value.clone();
        assert_eq!(value(HF_TOKEN_FILE_ENV).as_deref(), Some(HF_TOKEN_PATH));
        assert_eq!(
            value(HF_DATASET_TOKEN_FILE_ENV).as_deref(),
            Some(HF_DATASET_TOKEN_PATH)
        );
        assert!(
            env.iter().all(|e| e
                .value_from
                .as_ref()
                .is_none_or(|v| v.secret_key_ref.is_none())),
            "no Secret in the environment: {env:?}"
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
