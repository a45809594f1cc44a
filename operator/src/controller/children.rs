//! Pure builders for everything the operator creates for a job: the
//! checkpoint PVC, the headless Service of a multi-worker attempt, and one Pod
//! per worker. All carry a controller owner reference to the job and are
//! written under one field manager. Workers get no Kubernetes API rights:
//! they run under the namespace's `default` account with no API token
//! mounted, and reach the operator's worker API ([`crate::worker_api`]) with
//! a token bound to their pod that only that API accepts.

use std::collections::BTreeMap;

use headroom_api::{
    ANNOTATION_JOB_UID, CHECKPOINT_DIR_ENV, ClaimRetention, DEFAULT_CHECKPOINT_DIR, LABEL_ATTEMPT,
    LABEL_JOB, LABEL_REPLICA, LABEL_RETAINED_FROM, LABEL_STAGE, MemoryAwareTrainingJob,
    PIPELINE_PODS_ENV, PIPELINE_PORT, PIPELINE_SERVICE_ENV, PLAN_JSON_ENV, POD_NAME_ENV,
    REPLICA_PODS_ENV, REPLICA_PORT, TELEMETRY_INTERVAL_ENV, TERMINATION_MESSAGE_PATH,
    WORKER_API_AUDIENCE, WORKER_API_ENV, WORKER_API_TOKEN_ENV, WORKER_API_TOKEN_PATH,
    WorkerAssignment,
};
use headroom_planner::inventory::{LabelRequirement, device_placement};
use headroom_planner::{DeviceKind, ModelShape, Plan};
use k8s_openapi::api::core::v1::{
    Affinity, Capabilities, Container, ContainerPort, EnvVar, EnvVarSource, LocalObjectReference,
    NodeAffinity, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, ObjectFieldSelector,
    PersistentVolumeClaim, PersistentVolumeClaimSpec, PersistentVolumeClaimVolumeSource, Pod,
    PodAffinity, PodAffinityTerm, PodSecurityContext, PodSpec, ProjectedVolumeSource,
    ResourceRequirements, SeccompProfile, SecurityContext, Service, ServiceAccountTokenProjection,
    ServicePort, ServiceSpec, Volume, VolumeMount, VolumeProjection, VolumeResourceRequirements,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta, OwnerReference};
use kube::{Resource, ResourceExt};

use super::config::ChildConfig;

/// How often the pod writes its telemetry (the operator's `--telemetry-interval-seconds`).
pub fn telemetry_interval_env(cfg: &ChildConfig) -> EnvVar {
    EnvVar {
        name: TELEMETRY_INTERVAL_ENV.into(),
        value: Some(cfg.telemetry_interval.as_secs_f64().to_string()),
        ..EnvVar::default()
    }
}

/// `POD_NAME` from the downward API: the name a worker or the initializer
/// reports its status entry under.
pub fn pod_name_env() -> EnvVar {
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

/// Seconds a worker's worker-API token is valid; the kubelet renews it at
/// 80 % of that, and the worker reads it again for every call.
const WORKER_API_TOKEN_SECONDS: i64 = 3600;

/// What a pod needs to reach the operator's worker API: its URL and token
/// path in the environment, and the token itself, projected by the kubelet
/// and bound to the pod, for the worker API's audience only. Nothing when
/// the operator has no worker API URL (workers then log their telemetry).
pub fn worker_api_access(config: &ChildConfig) -> (Vec<EnvVar>, Vec<Volume>, Vec<VolumeMount>) {
    let Some(url) = &config.worker_api_url else {
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

/// The non-root user workers run as.
pub const WORKER_UID: i64 = 65532;

/// A DNS-1123 label from `base` + `suffix`, shortened with a stable hash when too long.
pub fn dns_label(base: &str, suffix: &str) -> String {
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

pub fn checkpoint_claim_name(job: &MemoryAwareTrainingJob) -> String {
    dns_label(&job.name_any(), "-checkpoints")
}

pub fn service_name(job: &MemoryAwareTrainingJob) -> String {
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
fn host_name(plan: &Plan, Slot { stage, replica }: Slot) -> String {
    if plan.replicas > 1 {
        format!("s{stage}-r{replica}")
    } else {
        format!("s{stage}")
    }
}

pub(crate) fn owner(job: &MemoryAwareTrainingJob) -> OwnerReference {
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

fn job_labels(job: &MemoryAwareTrainingJob) -> BTreeMap<String, String> {
    [
        (LABEL_JOB.to_string(), job.name_any()),
        (
            "app.kubernetes.io/managed-by".to_string(),
            "headroom".to_string(),
        ),
        (
            "app.kubernetes.io/component".to_string(),
            "worker".to_string(),
        ),
    ]
    .into_iter()
    .collect()
}

fn meta(
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

/// One volume for all attempts, so a retry resumes from the last checkpoint.
/// Annotated with the job's uid (a kept claim outlives its job); owned by the
/// job (deleted with it) unless `spec.checkpoints.retention` is `Retain`.
/// `RetainOnSuccess` claims are released when the job succeeds ([`release_claim_patch`]).
pub fn checkpoint_claim(
    job: &MemoryAwareTrainingJob,
    config: &ChildConfig,
) -> PersistentVolumeClaim {
    let mut metadata = meta(job, checkpoint_claim_name(job), job_labels(job));
    metadata.annotations = Some(
        [(
            ANNOTATION_JOB_UID.to_string(),
            job.uid().unwrap_or_default(),
        )]
        .into_iter()
        .collect(),
    );
    if job.spec.checkpoints.retention == ClaimRetention::Retain {
        metadata.owner_references = None;
        release_labels(job, &mut metadata);
    }
    PersistentVolumeClaim {
        metadata,
        spec: Some(PersistentVolumeClaimSpec {
            access_modes: Some(vec![config.checkpoint_access.as_str().into()]),
            storage_class_name: config.checkpoint_storage_class.clone(),
            resources: Some(VolumeResourceRequirements {
                requests: Some(
                    [(
                        "storage".to_string(),
                        Quantity(config.checkpoint_size.clone()),
                    )]
                    .into_iter()
                    .collect(),
                ),
                ..VolumeResourceRequirements::default()
            }),
            ..PersistentVolumeClaimSpec::default()
        }),
        ..PersistentVolumeClaim::default()
    }
}

fn release_labels(job: &MemoryAwareTrainingJob, metadata: &mut ObjectMeta) {
    metadata
        .labels
        .get_or_insert_with(BTreeMap::new)
        .insert(LABEL_RETAINED_FROM.into(), job.name_any());
}

/// The merge patch that lets a claim outlive its job: no owner (garbage
/// collection leaves it), labelled with the job's name for finding it.
pub fn release_claim_patch(job: &MemoryAwareTrainingJob) -> serde_json::Value {
    serde_json::json!({
        "metadata": {
            "ownerReferences": null,
            "labels": {LABEL_RETAINED_FROM: job.name_any()},
        }
    })
}

/// Whether an existing claim holds this job's checkpoints (and not those of
/// an earlier job of the same name, kept after it ended).
/// `claim`: the claim or its metadata (the claim cache holds only that).
pub fn claim_belongs_to(claim: &impl ResourceExt, job: &MemoryAwareTrainingJob) -> bool {
    let Some(uid) = job.uid() else {
        return true;
    };
    let annotated = claim
        .annotations()
        .get(ANNOTATION_JOB_UID)
        .map(|u| *u == uid);
    let owned = claim.owner_references().iter().any(|o| o.uid == uid);
    // Claims made before the annotation existed are recognised by their owner.
    annotated.unwrap_or(owned)
}

/// Stable DNS names for the stages of a multi-worker plan (`s<k>.<service>`).
pub fn headless_service(job: &MemoryAwareTrainingJob) -> Service {
    Service {
        metadata: meta(job, service_name(job), job_labels(job)),
        spec: Some(ServiceSpec {
            cluster_ip: Some("None".into()),
            selector: Some(
                [(LABEL_JOB.to_string(), job.name_any())]
                    .into_iter()
                    .collect(),
            ),
            publish_not_ready_addresses: Some(true),
            ports: Some(vec![ServicePort {
                name: Some("pipeline".into()),
                port: i32::from(PIPELINE_PORT),
                ..ServicePort::default()
            }]),
            ..ServiceSpec::default()
        }),
        ..Service::default()
    }
}

/// A required node affinity that a node meets by meeting any one term in full.
fn required_node_affinity(terms: &[Vec<LabelRequirement>]) -> NodeAffinity {
    let requirement = |r: &LabelRequirement| match r {
        LabelRequirement::Equals { key, value } => NodeSelectorRequirement {
            key: key.clone(),
            operator: "In".into(),
            values: Some(vec![value.clone()]),
        },
        LabelRequirement::Absent { key } => NodeSelectorRequirement {
            key: key.clone(),
            operator: "DoesNotExist".into(),
            values: None,
        },
    };
    NodeAffinity {
        required_during_scheduling_ignored_during_execution: Some(NodeSelector {
            node_selector_terms: terms
                .iter()
                .map(|term| NodeSelectorTerm {
                    match_expressions: Some(term.iter().map(requirement).collect()),
                    ..NodeSelectorTerm::default()
                })
                .collect(),
        }),
        ..NodeAffinity::default()
    }
}

/// The pod-level half of the restricted Pod Security profile every pod of a
/// job runs under: the non-root worker user, and its group owning the volumes.
pub(crate) fn restricted_pod_security() -> PodSecurityContext {
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
pub(crate) fn restricted_container_security() -> SecurityContext {
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

/// The volumes every pod of a job mounts: the job's checkpoint claim at the
/// contract's checkpoint directory and a scratch `/tmp` (the root is read-only).
pub(crate) fn job_volumes(job: &MemoryAwareTrainingJob) -> (Vec<Volume>, Vec<VolumeMount>) {
    (
        vec![
            Volume {
                name: "checkpoints".into(),
                persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                    claim_name: checkpoint_claim_name(job),
                    ..PersistentVolumeClaimVolumeSource::default()
                }),
                ..Volume::default()
            },
            Volume {
                name: "tmp".into(),
                empty_dir: Some(Default::default()),
                ..Volume::default()
            },
        ],
        vec![
            VolumeMount {
                name: "checkpoints".into(),
                mount_path: DEFAULT_CHECKPOINT_DIR.into(),
                ..VolumeMount::default()
            },
            VolumeMount {
                name: "tmp".into(),
                mount_path: "/tmp".into(),
                ..VolumeMount::default()
            },
        ],
    )
}

fn quantity_bytes(bytes: u64) -> Quantity {
    Quantity(bytes.to_string())
}

/// Host memory of a GPU stage's pod: the job's baseline (`resources.gpu.hostMemory`
/// or the operator's default) plus what the plan puts in host memory on
/// top of it (`hostBytes`: offloaded optimizer state, or the checkpoint
/// load's host-side transient). The baseline alone when the plan adds nothing,
/// so the user's quantity is kept as written.
fn gpu_worker_host_memory(baseline: &Quantity, plan: &Plan, stage: u32) -> Quantity {
    let extra = plan
        .stages
        .get(stage as usize)
        .map_or(0, |s| s.memory.host_bytes);
    if extra == 0 {
        return baseline.clone();
    }
    match headroom_api::quantity::parse_bytes(&baseline.0) {
        Ok(bytes) => quantity_bytes(bytes + extra),
        // Validated when the job was planned; never reached.
        Err(_) => baseline.clone(),
    }
}

/// The worker pod for one stage's replica of one attempt. `model` is the spec's
/// validated model shape (`JobRequest::model`), so the worker builds exactly
/// what was planned; `image` the one the decision chose
/// ([`WorkerImages::resolve`](super::config::WorkerImages::resolve)).
pub fn worker_pod(
    job: &MemoryAwareTrainingJob,
    attempt: u32,
    slot: Slot,
    plan: &Plan,
    model: &ModelShape,
    image: &str,
    config: &ChildConfig,
) -> Result<Pod, serde_json::Error> {
    let spec = &job.spec;
    let Slot { stage, replica } = slot;
    let assignment = WorkerAssignment {
        job: job.name_any(),
        namespace: job.namespace().unwrap_or_default(),
        attempt,
        stage,
        replica,
        model: model.clone(),
        plan: plan.clone(),
        steps: spec.training.steps,
        learning_rate: spec.training.learning_rate,
        checkpoint_every_steps: spec.training.checkpoint_every_steps,
        seed: spec.training.seed,
        files: super::payload::payload_files(job),
    };
    let (mut volumes, mut mounts) = job_volumes(job);
    let (claim_volumes, claim_mounts) = super::payload::claim_mounts(job);
    volumes.extend(claim_volumes);
    mounts.extend(claim_mounts);
    let mut env = vec![
        EnvVar {
            name: PLAN_JSON_ENV.into(),
            value: Some(serde_json::to_string(&assignment)?),
            ..EnvVar::default()
        },
        pod_name_env(),
        EnvVar {
            name: CHECKPOINT_DIR_ENV.into(),
            value: Some(DEFAULT_CHECKPOINT_DIR.into()),
            ..EnvVar::default()
        },
        telemetry_interval_env(config),
    ];
    let (api_env, api_volumes, api_mounts) = worker_api_access(config);
    env.extend(api_env);
    volumes.extend(api_volumes);
    mounts.extend(api_mounts);

    let multi = plan.workers > 1;
    let pipeline = plan.stage_count() > 1;
    let replicated = plan.replicas > 1;
    let name_of = |stage: u32, replica: u32| pod_name(job, attempt, plan, Slot { stage, replica });
    let mut peers: Vec<(&str, String)> = Vec::new();
    if pipeline {
        // This replica's pipeline: the same replica of every stage.
        let pods: Vec<String> = (0..plan.stage_count())
            .map(|k| name_of(k, replica))
            .collect();
        peers.push((PIPELINE_PODS_ENV, pods.join(",")));
    }
    if multi {
        // The headless Service every worker's DNS name is under: the
        // fallback when a peer's pod IP cannot be read from the API.
        peers.push((PIPELINE_SERVICE_ENV, service_name(job)));
    }
    if replicated {
        // This stage's ring: its replicas in rank order.
        let pods: Vec<String> = (0..plan.replicas).map(|r| name_of(stage, r)).collect();
        peers.push((REPLICA_PODS_ENV, pods.join(",")));
    }
    for (name, value) in peers {
        env.push(EnvVar {
            name: name.into(),
            value: Some(value),
            ..EnvVar::default()
        });
    }

    let mut limits: BTreeMap<String, Quantity> = BTreeMap::new();
    let mut requests: BTreeMap<String, Quantity> = BTreeMap::new();
    // The user's placement (a node pool, tolerations for its taints), which
    // the inventory honoured when planning; the GPU product is added below.
    let mut node_selector = spec.worker.node_selector.clone();
    let mut gpu_node_affinity: Option<NodeAffinity> = None;
    let tolerations = crate::inventory::worker_tolerations(job, plan.device_kind);
    match plan.device_kind {
        DeviceKind::Cpu => {
            // The container limit is the CPU job's device: the plan was sized against it.
            limits.insert("memory".into(), quantity_bytes(plan.device_memory_bytes));
            requests.insert("memory".into(), quantity_bytes(plan.device_memory_bytes));
            let cores = spec
                .resources
                .cpu
                .as_ref()
                .and_then(|c| c.cores.clone())
                .unwrap_or_else(|| Quantity("1".into()));
            requests.insert("cpu".into(), cores);
        }
        DeviceKind::Gpu => {
            limits.insert(plan.resource.clone(), Quantity("1".into()));
            requests.insert(plan.resource.clone(), Quantity("1".into()));
            let baseline = spec
                .resources
                .gpu
                .as_ref()
                .and_then(|g| g.host_memory.clone())
                .unwrap_or_else(|| Quantity(config.gpu_host_memory.clone()));
            let host = gpu_worker_host_memory(&baseline, plan, stage);
            limits.insert("memory".into(), host.clone());
            requests.insert("memory".into(), host);
            requests.insert("cpu".into(), Quantity("1".into()));
            // Onto the nodes this device type was counted on, by the labels
            // its name was read from: the resource alone would let a mixed
            // MIG pod land on another GPU model's slices of the same profile.
            let placement = device_placement(&plan.resource, &plan.device);
            match placement.as_slice() {
                [term]
                    if term
                        .iter()
                        .all(|r| matches!(r, LabelRequirement::Equals { .. })) =>
                {
                    for r in term {
                        if let LabelRequirement::Equals { key, value } = r {
                            node_selector.insert(key.clone(), value.clone());
                        }
                    }
                }
                // Alternatives need node affinity (terms are ORed); the
                // user's nodeSelector still applies on top.
                terms => gpu_node_affinity = Some(required_node_affinity(terms)),
            }
        }
    }

    let mut labels = job_labels(job);
    labels.insert(LABEL_ATTEMPT.into(), attempt.to_string());
    labels.insert(LABEL_STAGE.into(), stage.to_string());
    if replicated {
        labels.insert(LABEL_REPLICA.into(), replica.to_string());
    }

    // Stages of one attempt together on one node when their shared
    // checkpoint volume can attach to only one. The first stage's own labels
    // match the term, so the scheduler may place it anywhere; the planner
    // sized the stage count by the free devices of one node.
    let pod_affinity =
        (multi && config.checkpoint_access.stages_share_a_node()).then(|| PodAffinity {
            required_during_scheduling_ignored_during_execution: Some(vec![PodAffinityTerm {
                label_selector: Some(LabelSelector {
                    match_labels: Some(
                        [
                            (LABEL_JOB.to_string(), job.name_any()),
                            (LABEL_ATTEMPT.to_string(), attempt.to_string()),
                        ]
                        .into_iter()
                        .collect(),
                    ),
                    ..LabelSelector::default()
                }),
                topology_key: "kubernetes.io/hostname".into(),
                ..PodAffinityTerm::default()
            }]),
            ..PodAffinity::default()
        });
    let affinity = (pod_affinity.is_some() || gpu_node_affinity.is_some()).then(|| Affinity {
        pod_affinity,
        node_affinity: gpu_node_affinity,
        ..Affinity::default()
    });

    Ok(Pod {
        metadata: meta(job, name_of(stage, replica), labels),
        spec: Some(PodSpec {
            restart_policy: Some("Never".into()),
            // No API rights and no API token: telemetry and peer lookups go
            // through the operator's worker API (worker_api_access).
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
            hostname: multi.then(|| host_name(plan, slot)),
            subdomain: multi.then(|| service_name(job)),
            node_selector: (!node_selector.is_empty()).then_some(node_selector),
            affinity,
            tolerations: (!tolerations.is_empty()).then_some(tolerations),
            security_context: Some(restricted_pod_security()),
            containers: vec![Container {
                name: "worker".into(),
                image: Some(image.into()),
                image_pull_policy: spec.worker.image_pull_policy.map(|p| p.as_str().into()),
                env: Some(env),
                ports: multi.then(|| {
                    let port = |name: &str, port: u16| ContainerPort {
                        name: Some(name.into()),
                        container_port: i32::from(port),
                        ..ContainerPort::default()
                    };
                    let mut ports = Vec::new();
                    if pipeline {
                        ports.push(port("pipeline", PIPELINE_PORT));
                    }
                    if replicated {
                        ports.push(port("replicas", REPLICA_PORT));
                    }
                    ports
                }),
                resources: Some(ResourceRequirements {
                    limits: Some(limits),
                    requests: Some(requests),
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
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::controller::config::{CheckpointAccess, WorkerImages};
    use headroom_api::MemoryAwareTrainingJobSpec;
    use headroom_planner::{Inventory, plan};
    use k8s_openapi::api::core::v1::Node;

    pub(crate) fn job(yaml: &str) -> MemoryAwareTrainingJob {
        let mut job: MemoryAwareTrainingJob = serde_yaml::from_str(yaml).expect("job fixture");
        job.metadata.namespace = Some("team-a".into());
        job.metadata.uid = Some("0000-1111".into());
        job
    }

    pub(crate) fn cpu_job() -> MemoryAwareTrainingJob {
        job(include_str!("../../../samples/cpu-tiny.yaml"))
    }

    fn first_plan(spec: &MemoryAwareTrainingJobSpec) -> Plan {
        plan(&spec.job_request().expect("valid"), &Inventory::default()).expect("plan")
    }

    /// Default images of an operator installed with both.
    pub(crate) fn both_images() -> WorkerImages {
        WorkerImages {
            flex: Some("registry.example/headroom-worker:2".into()),
            cuda: Some("registry.example/headroom-worker-cuda:2".into()),
        }
    }

    /// The worker pod of one stage, with the spec's validated model and the
    /// image the decision would choose (`config`'s defaults, or
    /// [`both_images`] when it has none).
    fn pod_for(
        job: &MemoryAwareTrainingJob,
        attempt: u32,
        stage: u32,
        plan: &Plan,
        config: &ChildConfig,
    ) -> Pod {
        let model = job.spec.job_request().expect("valid").model;
        let image = config
            .worker_images
            .resolve(&job.spec)
            .or_else(|_| both_images().resolve(&job.spec))
            .expect("an image");
        let slot = Slot { stage, replica: 0 };
        worker_pod(job, attempt, slot, plan, &model, &image, config).expect("pod")
    }

    fn image_of(pod: &Pod) -> Option<&str> {
        pod.spec.as_ref()?.containers[0].image.as_deref()
    }

    /// The job's own image wins; without one, the operator's default for
    /// the job's backend; the CPU sample's plan gets the CPU image.
    #[test]
    fn the_worker_runs_the_jobs_image_else_the_default_for_its_backend() {
        let named = cpu_job();
        let plan = first_plan(&named.spec);
        let with_defaults = ChildConfig {
            worker_images: both_images(),
            ..ChildConfig::default()
        };
        for config in [&ChildConfig::default(), &with_defaults] {
            let pod = pod_for(&named, 1, 0, &plan, config);
            assert_eq!(image_of(&pod), Some("localhost/headroom-worker:dev"));
        }

        let mut unnamed = cpu_job();
        unnamed.spec.worker.image = None;
        let pod = pod_for(&unnamed, 1, 0, &plan, &with_defaults);
        assert_eq!(image_of(&pod), Some("registry.example/headroom-worker:2"));
        // Nothing else about the pod depends on where the image came from.
        let mut same = pod_for(&named, 1, 0, &plan, &with_defaults);
        same.spec.as_mut().expect("spec").containers[0].image =
            Some("registry.example/headroom-worker:2".into());
        assert_eq!(pod, same);
    }

    #[test]
    fn cpu_worker_pod_is_restricted_and_sized_by_the_plan() {
        let job = cpu_job();
        let plan = first_plan(&job.spec);
        let pod = pod_for(&job, 1, 0, &plan, &ChildConfig::default());
        assert_eq!(pod.metadata.name.as_deref(), Some("tiny-cpu-a1-s0"));
        let owner = &pod.metadata.owner_references.as_ref().expect("owner")[0];
        assert_eq!(
            (owner.kind.as_str(), owner.controller),
            ("MemoryAwareTrainingJob", Some(true))
        );
        let spec = pod.spec.as_ref().expect("spec");
        assert_eq!(spec.restart_policy.as_deref(), Some("Never"));
        let c = &spec.containers[0];
        let limits = c
            .resources
            .as_ref()
            .and_then(|r| r.limits.as_ref())
            .expect("limits");
        assert_eq!(limits["memory"].0, (1u64 << 30).to_string());
        let sc = c.security_context.as_ref().expect("securityContext");
        assert_eq!(sc.allow_privilege_escalation, Some(false));
        assert_eq!(sc.read_only_root_filesystem, Some(true));
        assert_eq!(
            sc.capabilities.as_ref().and_then(|c| c.drop.clone()),
            Some(vec!["ALL".to_string()])
        );
        assert_eq!(
            spec.security_context
                .as_ref()
                .and_then(|s| s.run_as_non_root),
            Some(true)
        );
        let env = c.env.as_ref().expect("env");
        let plan_json = env
            .iter()
            .find(|e| e.name == PLAN_JSON_ENV)
            .and_then(|e| e.value.clone())
            .expect("plan env");
        let assignment: WorkerAssignment =
            serde_json::from_str(&plan_json).expect("assignment parses");
        assert_eq!(
            (assignment.attempt, assignment.stage, assignment.plan),
            (1, 0, plan.clone())
        );
        assert!(spec.node_selector.is_none(), "CPU jobs need no GPU node");
        assert!(spec.subdomain.is_none(), "single worker needs no service");
        let interval = |pod: &Pod| {
            pod.spec.as_ref().expect("spec").containers[0]
                .env
                .iter()
                .flatten()
                .find(|e| e.name == TELEMETRY_INTERVAL_ENV)
                .and_then(|e| e.value.clone())
        };
        assert_eq!(interval(&pod).as_deref(), Some("10"));
        let often = ChildConfig {
            telemetry_interval: std::time::Duration::from_millis(1500),
            ..ChildConfig::default()
        };
        let pod = pod_for(&job, 1, 0, &plan, &often);
        assert_eq!(
            interval(&pod).as_deref(),
            Some("1.5"),
            "the worker parses seconds as f64"
        );
    }

    /// A 2-stage × 2-replica plan: four pods, each in its replica's pipeline
    /// and its stage's ring, and a Role naming exactly those four.
    #[test]
    fn replicas_get_a_pod_each_with_their_pipeline_and_their_ring() {
        let job = job(include_str!("../../../samples/cpu-pipeline.yaml"));
        let mut plan = first_plan(&job.spec);
        assert_eq!(plan.stage_count(), 2, "the sample is a 2-stage pipeline");
        plan.replicas = 2;
        plan.workers = 4;
        let names: Vec<String> = slots(&plan)
            .map(|slot| pod_name(&job, 3, &plan, slot))
            .collect();
        let base = job.name_any();
        assert_eq!(
            names,
            ["s0-r0", "s0-r1", "s1-r0", "s1-r1"].map(|s| format!("{base}-a3-{s}"))
        );
        let model = job.spec.job_request().expect("valid").model;
        let config = ChildConfig::default();
        let pod = worker_pod(
            &job,
            3,
            Slot {
                stage: 1,
                replica: 1,
            },
            &plan,
            &model,
            "img",
            &config,
        )
        .expect("pod");
        assert_eq!(pod.metadata.name.as_deref(), Some(names[3].as_str()));
        let labels = pod.metadata.labels.as_ref().expect("labels");
        assert_eq!(
            (labels[LABEL_STAGE].as_str(), labels[LABEL_REPLICA].as_str()),
            ("1", "1")
        );
        let spec = pod.spec.as_ref().expect("spec");
        assert_eq!(spec.hostname.as_deref(), Some("s1-r1"));
        let c = &spec.containers[0];
        let env = |name: &str| {
            c.env
                .as_ref()
                .and_then(|e| e.iter().find(|v| v.name == name))
                .and_then(|v| v.value.clone())
        };
        assert_eq!(
            env(PIPELINE_PODS_ENV),
            Some(format!("{},{}", names[1], names[3]))
        );
        assert_eq!(
            env(REPLICA_PODS_ENV),
            Some(format!("{},{}", names[2], names[3]))
        );
        let assignment: WorkerAssignment =
            serde_json::from_str(&env(PLAN_JSON_ENV).expect("plan")).expect("assignment");
        assert_eq!((assignment.stage, assignment.replica), (1, 1));
        let ports: Vec<i32> = c.ports.iter().flatten().map(|p| p.container_port).collect();
        assert_eq!(ports, [i32::from(PIPELINE_PORT), i32::from(REPLICA_PORT)]);
    }

    #[test]
    fn pipeline_stages_share_a_node_only_when_the_checkpoint_volume_is_read_write_once() {
        let job = job(include_str!("../../../samples/cpu-pipeline.yaml"));
        let plan = first_plan(&job.spec);
        assert!(plan.workers > 1, "the sample is a pipeline: {plan:?}");
        let affinity = |config: &ChildConfig| {
            let pod = pod_for(&job, 2, 1, &plan, config);
            pod.spec.expect("spec").affinity
        };

        let rwo = ChildConfig::default();
        let term = affinity(&rwo)
            .and_then(|a| a.pod_affinity)
            .and_then(|a| a.required_during_scheduling_ignored_during_execution)
            .expect("a required pod-affinity term")
            .remove(0);
        assert_eq!(term.topology_key, "kubernetes.io/hostname");
        let selector = term
            .label_selector
            .and_then(|l| l.match_labels)
            .expect("labels");
        assert_eq!(selector[LABEL_JOB], job.name_any());
        assert_eq!(selector[LABEL_ATTEMPT], "2", "this attempt's stages only");
        assert_eq!(
            checkpoint_claim(&job, &rwo)
                .spec
                .and_then(|s| s.access_modes),
            Some(vec!["ReadWriteOnce".to_string()])
        );

        let rwx = ChildConfig {
            checkpoint_access: CheckpointAccess::ReadWriteMany,
            ..ChildConfig::default()
        };
        assert!(affinity(&rwx).is_none(), "stages may spread over nodes");
        assert_eq!(
            checkpoint_claim(&job, &rwx)
                .spec
                .and_then(|s| s.access_modes),
            Some(vec!["ReadWriteMany".to_string()])
        );

        let single = first_plan(&cpu_job().spec);
        let pod = pod_for(&cpu_job(), 1, 0, &single, &rwo);
        assert!(
            pod.spec.expect("spec").affinity.is_none(),
            "one stage, nothing to co-locate"
        );
    }

    #[test]
    fn gpu_worker_pod_selects_the_planned_product_and_requests_one_gpu() {
        let job = job(include_str!("../../../samples/gpu-gpt2-medium.yaml"));
        let nodes = [headroom_planner::NodeFacts {
            name: "n".into(),
            labels: [
                ("nvidia.com/gpu.product", "NVIDIA-L4"),
                ("nvidia.com/gpu.memory", "23034"),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
            allocatable: [("nvidia.com/gpu".to_string(), 8)].into_iter().collect(),
            in_use: BTreeMap::new(),
            schedulable: true,
            allocatable_reported: true,
            host_memory_bytes: None,
        }];
        let plan = plan(
            &job.spec.job_request().expect("valid"),
            &Inventory::from_nodes(&nodes),
        )
        .expect("plan");
        let mut job = job;
        job.spec.worker = serde_yaml::from_str(
            r#"
image: registry.example/headroom-worker:1
backend: cuda
imagePullPolicy: IfNotPresent
imagePullSecrets: [registry-creds]
nodeSelector: {pool: train}
tolerations: [{key: dedicated, operator: Equal, value: research, effect: NoSchedule}]
priorityClassName: batch-low
"#,
        )
        .expect("worker spec");
        let pod = pod_for(&job, 2, 0, &plan, &ChildConfig::default());
        assert_eq!(image_of(&pod), Some("registry.example/headroom-worker:1"));
        let spec = pod.spec.expect("spec");
        let selector = spec.node_selector.expect("selector");
        assert_eq!(selector["nvidia.com/gpu.product"], "NVIDIA-L4");
        assert_eq!(selector["pool"], "train", "the user's node pool, kept");
        let tolerations: Vec<_> = spec
            .tolerations
            .expect("tolerations")
            .into_iter()
            .map(|t| (t.key.unwrap_or_default(), t.effect.unwrap_or_default()))
            .collect();
        assert_eq!(
            tolerations,
            vec![
                ("dedicated".to_string(), "NoSchedule".to_string()),
                ("nvidia.com/gpu".to_string(), "NoSchedule".to_string())
            ]
        );
        assert_eq!(spec.priority_class_name.as_deref(), Some("batch-low"));
        assert_eq!(
            spec.image_pull_secrets.expect("pull secrets")[0].name,
            "registry-creds"
        );
        assert_eq!(
            spec.containers[0].image_pull_policy.as_deref(),
            Some("IfNotPresent")
        );
        let limits = spec.containers[0]
            .resources
            .clone()
            .and_then(|r| r.limits)
            .expect("limits");
        assert_eq!(limits["nvidia.com/gpu"].0, "1");
        assert_eq!(limits["memory"].0, "16Gi");

        // What the plan puts in host memory (offloaded optimizer state, the
        // checkpoint load's transient) comes on top of the baseline.
        let mut offloaded = plan.clone();
        offloaded.stages[0].memory.host_bytes = 3 << 30;
        let pod = pod_for(&job, 2, 0, &offloaded, &ChildConfig::default());
        let resources = pod.spec.expect("spec").containers[0]
            .resources
            .clone()
            .expect("resources");
        let want = ((16u64 << 30) + (3 << 30)).to_string();
        assert_eq!(resources.limits.expect("limits")["memory"].0, want);
        assert_eq!(resources.requests.expect("requests")["memory"].0, want);
        assert_eq!(pod.metadata.labels.expect("labels")[LABEL_ATTEMPT], "2");
    }

    /// Whether the scheduler could place `pod` on `node`, by the rules that
    /// decide GPU placement: nodeSelector and taints ([`crate::inventory::admits`]),
    /// required node affinity (a term's expressions all hold; any term will
    /// do), and every extended resource requested being allocatable there.
    fn fits_on(pod: &Pod, node: &Node) -> bool {
        let spec = pod.spec.as_ref().expect("spec");
        let labels = node.metadata.labels.clone().unwrap_or_default();
        let selector = spec.node_selector.clone().unwrap_or_default();
        let tolerations = spec.tolerations.clone().unwrap_or_default();
        let holds = |r: &NodeSelectorRequirement| {
            let value = labels.get(&r.key);
            let values = r.values.clone().unwrap_or_default();
            match r.operator.as_str() {
                "In" => value.is_some_and(|v| values.contains(v)),
                "NotIn" => value.is_none_or(|v| !values.contains(v)),
                "Exists" => value.is_some(),
                "DoesNotExist" => value.is_none(),
                other => panic!("operator {other} not modelled"),
            }
        };
        let affinity_ok = spec
            .affinity
            .as_ref()
            .and_then(|a| a.node_affinity.as_ref())
            .and_then(|a| {
                a.required_during_scheduling_ignored_during_execution
                    .as_ref()
            })
            .is_none_or(|s| {
                s.node_selector_terms.iter().any(|t| {
                    t.match_expressions.iter().flatten().all(holds) && t.match_fields.is_none()
                })
            });
        let allocatable = node
            .status
            .as_ref()
            .and_then(|s| s.allocatable.clone())
            .unwrap_or_default();
        let devices_ok = spec.containers.iter().all(|c| {
            c.resources
                .as_ref()
                .and_then(|r| r.limits.as_ref())
                .into_iter()
                .flatten()
                .filter(|(k, _)| k.starts_with("nvidia.com/"))
                .all(|(k, q)| {
                    let want: u64 = q.0.parse().expect("device count");
                    allocatable
                        .get(k)
                        .and_then(|a| a.0.parse::<u64>().ok())
                        .is_some_and(|have| have >= want)
                })
        });
        crate::inventory::admits(node, &selector, &tolerations) && affinity_ok && devices_ok
    }

    /// A Node of one GPU as GPU Feature Discovery labels it in the mixed MIG
    /// strategy (NVIDIA/k8s-device-plugin `internal/lm`: the MIG-enabled GPU
    /// keeps `nvidia.com/gpu.*` with `replicas: 0`; per profile `.count`,
    /// `.memory`, `.product` = `<model>-MIG-<profile>`; `with_product: false`
    /// is the standalone GFD, which wrote no `.product`) and the device plugin
    /// advertises it: seven `nvidia.com/mig-1g.10gb`, no `nvidia.com/gpu`.
    fn mixed_mig_node(name: &str, model: &str, with_product: bool) -> Node {
        let product = if with_product {
            format!("\n    nvidia.com/mig-1g.10gb.product: {model}-MIG-1g.10gb")
        } else {
            String::new()
        };
        serde_yaml::from_str(&format!(
            r#"
metadata:
  name: {name}
  labels:
    nvidia.com/mig.strategy: mixed
    nvidia.com/gpu.product: {model}
    nvidia.com/gpu.count: "1"
    nvidia.com/gpu.replicas: "0"
    nvidia.com/gpu.memory: "81920"
    nvidia.com/mig-1g.10gb.count: "7"
    nvidia.com/mig-1g.10gb.replicas: "1"
    nvidia.com/mig-1g.10gb.memory: "9728"
    nvidia.com/mig-1g.10gb.multiprocessors: "14"{product}
status:
  allocatable: {{nvidia.com/mig-1g.10gb: "7", cpu: "64", memory: 512Gi, pods: "110"}}
"#
        ))
        .expect("node")
    }

    /// The pod of a plan on mixed-strategy MIG slices requests the slice
    /// resource the device plugin advertises, and is placed by labels its
    /// node really has: on that node, and not on another GPU model's node
    /// advertising the same profile.
    #[test]
    fn a_mixed_mig_pod_requests_its_slice_on_the_node_it_was_planned_for() {
        const A100: &str = "NVIDIA-A100-SXM4-80GB";
        const H100: &str = "NVIDIA-H100-80GB-HBM3";
        let mut job = job(include_str!("../../../samples/gpu-gpt2-medium.yaml"));
        // GPT-2 small fits one 1g.10gb slice; the full A100 is listed too,
        // and must not be planned (the device plugin does not offer it).
        job.spec.model = serde_yaml::from_str(
            "transformer: {layers: 12, hidden: 768, heads: 12, sequenceLength: 1024, vocabulary: 50257}",
        )
        .expect("model");
        job.spec.resources.gpu.as_mut().expect("gpu").types =
            vec![A100.into(), format!("{A100}-MIG-1g.10gb")];
        for with_product in [true, false] {
            let a100 = mixed_mig_node("a100", A100, with_product);
            let h100 = mixed_mig_node("h100", H100, with_product);
            let facts = [
                crate::inventory::node_facts(&a100, []),
                crate::inventory::node_facts(&h100, []),
            ];
            let plan = plan(
                &job.spec.job_request().expect("valid"),
                &Inventory::from_nodes(&facts),
            )
            .expect("plan");
            assert_eq!(
                (plan.device.as_str(), plan.resource.as_str()),
                (
                    "NVIDIA-A100-SXM4-80GB-MIG-1g.10gb",
                    "nvidia.com/mig-1g.10gb"
                ),
                "with .product: {with_product}"
            );
            let pod = pod_for(&job, 1, 0, &plan, &ChildConfig::default());
            let resources = pod.spec.as_ref().expect("spec").containers[0]
                .resources
                .clone()
                .expect("resources");
            for devices in [resources.limits, resources.requests] {
                let devices: Vec<_> = devices
                    .expect("set")
                    .into_iter()
                    .filter(|(k, _)| k.starts_with("nvidia.com/"))
                    .map(|(k, q)| (k, q.0))
                    .collect();
                assert_eq!(devices, [("nvidia.com/mig-1g.10gb".into(), "1".into())]);
            }
            let placement = pod
                .spec
                .as_ref()
                .map(|s| (s.node_selector.clone(), s.affinity.clone()));
            assert!(
                fits_on(&pod, &a100),
                "with .product: {with_product}: {placement:?}"
            );
            assert!(
                !fits_on(&pod, &h100),
                "with .product: {with_product}: another model's slices: {placement:?}"
            );
        }
    }

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
