//! What every object the operator creates for a job carries (its owner,
//! its labels), and the one restricted pod skeleton that the worker pods
//! and the initializer pod are built on: no Kubernetes API rights, the
//! restricted Pod Security profile, the job's volumes, the user's placement
//! and image settings, and the termination message the operator reads.

use std::collections::BTreeMap;

use headroom_api::{
    COMPONENT_INITIALIZER, COMPONENT_WORKER, LABEL_COMPONENT, LABEL_JOB, LABEL_MANAGED_BY,
    LABEL_ROLE, MANAGED_BY, MemoryAwareTrainingJob, POD_NAME_ENV, ROLE_INITIALIZER,
    TELEMETRY_INTERVAL_ENV, TERMINATION_MESSAGE_PATH, WORKER_API_AUDIENCE, WORKER_API_CA_ENV,
    WORKER_API_ENV, WORKER_API_TOKEN_ENV, WORKER_API_TOKEN_PATH,
};
use k8s_openapi::api::core::v1::{
    Capabilities, ConfigMapEnvSource, ConfigMapKeySelector, ConfigMapVolumeSource, Container,
    EmptyDirVolumeSource, EnvFromSource, EnvVar, EnvVarSource, LocalObjectReference,
    ObjectFieldSelector, PersistentVolumeClaimVolumeSource, Pod, PodSecurityContext, PodSpec,
    ProjectedVolumeSource, ResourceRequirements, SeccompProfile, SecurityContext,
    ServiceAccountTokenProjection, Toleration, Volume, VolumeMount, VolumeProjection,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::{Resource, ResourceExt};

use super::files::job_volumes;
use crate::controller::config::ChildConfig;

/// The non-root user every pod of a job runs as.
const WORKER_UID: i64 = 65532;

/// Seconds a pod's worker-API token is valid; the kubelet renews it at
/// 80 % of that, and the pod reads it again for every call.
const WORKER_API_TOKEN_SECONDS: i64 = 3600;

/// The controller owner reference to the job: what the operator creates
/// for a job goes with it.
fn owner(job: &MemoryAwareTrainingJob) -> OwnerReference {
    job.controller_owner_ref(&())
        .unwrap_or_else(|| OwnerReference {
            api_version: MemoryAwareTrainingJob::api_version(&()).into_owned(),
            kind: MemoryAwareTrainingJob::kind(&()).into_owned(),
            name: job.name_any(),
            uid: job.metadata.uid.clone().unwrap_or_default(),
            controller: Some(true),
            block_owner_deletion: Some(true),
        })
}

/// The part of a job an object is: its `app.kubernetes.io/component` label
/// and, for the initializer, its `headroom.dev/role`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Component {
    /// The worker pods, and what serves them: their headless Service and the
    /// checkpoint claim.
    Worker,
    /// The initializer pod of a fine-tuning job.
    Initializer,
}

/// The labels of everything the operator creates for a job: the job's
/// name, Kubernetes' recommended labels, and the initializer's role.
pub(super) fn job_labels(
    job: &MemoryAwareTrainingJob,
    component: Component,
) -> BTreeMap<String, String> {
    let mut labels: BTreeMap<String, String> = [
        (LABEL_JOB, job.name_any()),
        (LABEL_MANAGED_BY, MANAGED_BY.into()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    let (value, role) = match component {
        Component::Worker => (COMPONENT_WORKER, None),
        Component::Initializer => (COMPONENT_INITIALIZER, Some(ROLE_INITIALIZER)),
    };
    labels.insert(LABEL_COMPONENT.into(), value.into());
    if let Some(role) = role {
        labels.insert(LABEL_ROLE.into(), role.into());
    }
    labels
}

/// Metadata of an object of the job: in its namespace, owned by it.
pub(super) fn meta(
    job: &MemoryAwareTrainingJob,
    name: String,
    labels: BTreeMap<String, String>,
) -> ObjectMeta {
    ObjectMeta {
        name: Some(name),
        namespace: job.namespace(),
        labels: Some(labels),
        owner_references: Some(vec![owner(job)]),
        ..ObjectMeta::default()
    }
}

/// The pod-level half of the restricted Pod Security profile every pod of a
/// job runs under: the non-root worker user, and its group owning the volumes.
fn restricted_pod_security() -> PodSecurityContext {
    PodSecurityContext {
        run_as_non_root: Some(true),
        run_as_user: Some(WORKER_UID),
        run_as_group: Some(WORKER_UID),
        fs_group: Some(WORKER_UID),
        seccomp_profile: Some(SeccompProfile {
            type_: "RuntimeDefault".into(),
            ..SeccompProfile::default()
        }),
        ..PodSecurityContext::default()
    }
}

/// The container-level half: no privilege escalation, no capabilities, a
/// read-only root filesystem.
fn restricted_container_security() -> SecurityContext {
    SecurityContext {
        allow_privilege_escalation: Some(false),
        read_only_root_filesystem: Some(true),
        run_as_non_root: Some(true),
        capabilities: Some(Capabilities {
            drop: Some(vec!["ALL".into()]),
            ..Capabilities::default()
        }),
        seccomp_profile: Some(SeccompProfile {
            type_: "RuntimeDefault".into(),
            ..SeccompProfile::default()
        }),
        ..SecurityContext::default()
    }
}

/// `POD_NAME` from the downward API: the name a worker or the initializer
/// reports its status entry under.
pub(super) fn pod_name_env() -> EnvVar {
    EnvVar {
        name: POD_NAME_ENV.into(),
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                field_path: "metadata.name".into(),
                ..ObjectFieldSelector::default()
            }),
            ..EnvVarSource::default()
        }),
        ..EnvVar::default()
    }
}

/// How often the pod writes its telemetry (the operator's `--telemetry-interval-seconds`).
pub(super) fn telemetry_interval_env(cfg: &ChildConfig) -> EnvVar {
    EnvVar {
        name: TELEMETRY_INTERVAL_ENV.into(),
        value: Some(cfg.telemetry_interval.as_secs_f64().to_string()),
        ..EnvVar::default()
    }
}

/// What a pod needs to reach the operator's worker API: its URL and token
/// path in the environment, and the token itself, projected by the kubelet
/// and bound to the pod, for the worker API's audience only. Nothing when
/// the operator has no worker API URL (workers then log their telemetry).
///
/// The skeleton ([`restricted_pod`]) mounts the token; the environment is
/// the caller's to place among its own variables.
pub(super) fn worker_api_access(cfg: &ChildConfig) -> (Vec<EnvVar>, Vec<Volume>, Vec<VolumeMount>) {
    let Some(url) = &cfg.worker_api_url else {
        return (Vec::new(), Vec::new(), Vec::new());
    };
    let (dir, file) = WORKER_API_TOKEN_PATH
        .rsplit_once('/')
        .unwrap_or(("/", WORKER_API_TOKEN_PATH));
    let env = [
        (WORKER_API_ENV, url.as_str()),
        (WORKER_API_TOKEN_ENV, WORKER_API_TOKEN_PATH),
    ]
    .into_iter()
    // An https API's CA (a public certificate, about 1 KiB).
    .chain(
        cfg.worker_api_ca
            .as_deref()
            .map(|ca| (WORKER_API_CA_ENV, ca)),
    )
    .map(|(name, value)| EnvVar {
        name: name.into(),
        value: Some(value.into()),
        ..EnvVar::default()
    })
    .collect();
    let volume = Volume {
        name: "worker-api-token".into(),
        projected: Some(ProjectedVolumeSource {
            sources: Some(vec![VolumeProjection {
                service_account_token: Some(ServiceAccountTokenProjection {
                    audience: Some(WORKER_API_AUDIENCE.into()),
                    expiration_seconds: Some(WORKER_API_TOKEN_SECONDS),
                    path: file.into(),
                }),
                ..VolumeProjection::default()
            }]),
            ..ProjectedVolumeSource::default()
        }),
        ..Volume::default()
    };
    let mount = VolumeMount {
        name: "worker-api-token".into(),
        mount_path: dir.into(),
        read_only: Some(true),
        ..VolumeMount::default()
    };
    (env, vec![volume], vec![mount])
}

/// A `spec.worker.env` entry as the container's variable.
fn user_env(e: &headroom_api::WorkerEnvVar) -> EnvVar {
    EnvVar {
        name: e.name.clone(),
        value: e.value.clone(),
        value_from: e.value_from.as_ref().map(|from| EnvVarSource {
            config_map_key_ref: Some(ConfigMapKeySelector {
                name: from.config_map_key_ref.name.clone(),
                key: from.config_map_key_ref.key.clone(),
                optional: from.config_map_key_ref.optional,
            }),
            ..EnvVarSource::default()
        }),
    }
}

/// A `spec.worker.envFrom` entry as the container's: a ConfigMap's keys
/// (the only source the spec offers).
fn user_env_from(e: &headroom_api::WorkerEnvFrom) -> EnvFromSource {
    EnvFromSource {
        config_map_ref: e.config_map_ref.as_ref().map(|c| ConfigMapEnvSource {
            name: c.name.clone(),
            optional: c.optional,
        }),
        prefix: e.prefix.clone(),
        ..EnvFromSource::default()
    }
}

/// A `spec.worker.volumes` entry as the pod's: a ConfigMap, a claim or an
/// emptyDir (hostPath is refused when the job is written).
fn user_volume(v: &headroom_api::WorkerVolume) -> Volume {
    Volume {
        name: v.name.clone(),
        config_map: v.config_map.as_ref().map(|c| ConfigMapVolumeSource {
            name: c.name.clone(),
            optional: c.optional,
            ..ConfigMapVolumeSource::default()
        }),
        persistent_volume_claim: v.persistent_volume_claim.as_ref().map(|c| {
            PersistentVolumeClaimVolumeSource {
                claim_name: c.claim_name.clone(),
                read_only: c.read_only,
            }
        }),
        empty_dir: v.empty_dir.as_ref().map(|e| EmptyDirVolumeSource {
            medium: e.medium.clone(),
            size_limit: e.size_limit.clone(),
        }),
        ..Volume::default()
    }
}

/// What sets one kind of a job's pods apart; everything else is the
/// skeleton's ([`restricted_pod`]).
#[derive(Debug)]
pub(super) struct PodParts<'a> {
    pub name: String,
    pub component: Component,
    /// Labels besides [`job_labels`]'.
    pub labels: BTreeMap<String, String>,
    /// The one container's name and image.
    pub container: &'static str,
    pub image: &'a str,
    /// The container's whole environment, [`worker_api_access`]'s included.
    pub env: Vec<EnvVar>,
    pub resources: ResourceRequirements,
    /// The user's `spec.worker.nodeSelector`, with whatever the pod adds.
    pub node_selector: BTreeMap<String, String>,
    /// The user's `spec.worker.tolerations`, with whatever the pod adds
    /// ([`crate::inventory::worker_tolerations`]).
    pub tolerations: Vec<Toleration>,
}

/// The restricted pod every pod of a job is: never restarted (the operator
/// decides what runs next); the user's service account or the namespace's
/// `default`, with no API token mounted, so no Kubernetes API rights (telemetry, progress and peer
/// lookups go through the operator's worker API, [`worker_api_access`]);
/// the user's priority class, pull secrets, node selector, tolerations,
/// affinity and pull policy; the restricted Pod Security profile; the job's volumes
/// ([`job_volumes`]) and the worker-API token; and the termination message
/// the operator reads the pod's outcome from (the log's tail when the
/// process died before writing it).
pub(super) fn restricted_pod(
    job: &MemoryAwareTrainingJob,
    cfg: &ChildConfig,
    parts: PodParts<'_>,
) -> Pod {
    let worker = &job.spec.worker;
    let (mut volumes, mut mounts) = job_volumes(job);
    let (api_env, api_volumes, api_mounts) = worker_api_access(cfg);
    debug_assert!(
        api_env.iter().all(|v| parts.env.contains(v)),
        "the caller places the worker API's environment"
    );
    volumes.extend(api_volumes);
    mounts.extend(api_mounts);
    // The user's after the operator's; their names and paths cannot
    // collide with these (validate.rs).
    volumes.extend(worker.volumes.iter().map(user_volume));
    mounts.extend(worker.volume_mounts.iter().map(|m| VolumeMount {
        name: m.name.clone(),
        mount_path: m.mount_path.clone(),
        read_only: m.read_only,
        ..VolumeMount::default()
    }));
    // The user's labels first: the operator's, which select the pods, win.
    let mut labels = worker.pod_labels.clone();
    labels.extend(job_labels(job, parts.component));
    labels.extend(parts.labels);
    let node_selector = parts.node_selector;
    let tolerations = parts.tolerations;
    // The user's variables first; the operator's names are refused in
    // them (validate.rs), so none is shadowed.
    let mut env: Vec<EnvVar> = worker.env.iter().map(user_env).collect();
    env.extend(parts.env);
    let mut metadata = meta(job, parts.name, labels);
    metadata.annotations =
        (!worker.pod_annotations.is_empty()).then(|| worker.pod_annotations.clone());
    Pod {
        metadata,
        spec: Some(PodSpec {
            restart_policy: Some("Never".into()),
            // The user's account (a cloud identity bound to it), else the
            // namespace's default; either way without its API token: the
            // pods need no Kubernetes API rights, and an identity webhook
            // projects the token it needs itself. A field to mount it would
            // hand a training container whatever the account may do.
            service_account_name: Some(
                worker
                    .service_account_name
                    .clone()
                    .unwrap_or_else(|| "default".into()),
            ),
            automount_service_account_token: Some(false),
            priority_class_name: worker.priority_class_name.clone(),
            image_pull_secrets: (!worker.image_pull_secrets.is_empty()).then(|| {
                worker
                    .image_pull_secrets
                    .iter()
                    .map(|s| LocalObjectReference {
                        name: s.name.clone(),
                    })
                    .collect()
            }),
            runtime_class_name: worker.runtime_class_name.clone(),
            termination_grace_period_seconds: worker
                .termination_grace_period_seconds
                .map(i64::from),
            node_selector: (!node_selector.is_empty()).then_some(node_selector),
            tolerations: (!tolerations.is_empty()).then_some(tolerations),
            // The user's; a worker pod ANDs Headroom's placement into it
            // (`worker::merged_affinity`).
            affinity: worker.affinity.clone(),
            security_context: Some(restricted_pod_security()),
            containers: vec![Container {
                name: parts.container.into(),
                image: Some(parts.image.into()),
                image_pull_policy: worker.image_pull_policy.map(|p| p.as_str().into()),
                env: Some(env),
                // Below `env` in Kubernetes' order: the user's and the
                // operator's variables win over a ConfigMap's keys.
                env_from: (!worker.env_from.is_empty())
                    .then(|| worker.env_from.iter().map(user_env_from).collect()),
                resources: Some(parts.resources),
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
    }
}
