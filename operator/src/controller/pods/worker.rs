//! The worker pods: one per stage replica of an attempt, on the restricted
//! skeleton ([`super::skeleton::restricted_pod`]), with the worker's
//! assignment, its peers, the resources and placement the plan sized, and
//! the ports and DNS name a multi-worker attempt's peers reach it by.

use std::collections::BTreeMap;

use headroom_api::{
    CHECKPOINT_DIR_ENV, DEFAULT_CHECKPOINT_DIR, LABEL_ATTEMPT, LABEL_JOB, LABEL_REPLICA,
    LABEL_STAGE, MALLOC_ARENA_MAX_ENV, MALLOC_TUNABLES_ENV, MemoryAwareTrainingJob,
    MemoryGuardSettings, MemoryPolicy, PIPELINE_PODS_ENV, PIPELINE_PORT, PIPELINE_SERVICE_ENV,
    PLAN_JSON_ENV, REPLICA_PODS_ENV, REPLICA_PORT, WORKER_MALLOC_ARENAS, WORKER_MALLOC_TUNABLES,
    WorkerAssignment,
};
use headroom_planner::inventory::{LabelRequirement, device_placement};
use headroom_planner::{Backend, DeviceKind, Plan, RetryRung};
use k8s_openapi::api::core::v1::{
    Affinity, ContainerPort, EnvVar, NodeAffinity, NodeSelector, NodeSelectorRequirement,
    NodeSelectorTerm, Pod, PodAffinity, PodAffinityTerm, ResourceRequirements,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::ResourceExt;

use super::files::payload_files;
use super::names::{Slot, host_name, pod_name, service_name};
use super::skeleton::{
    Component, PodParts, pod_name_env, restricted_pod, telemetry_interval_env, worker_api_access,
};
use crate::controller::config::ChildConfig;
use crate::controller::decide::Launch;

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

/// The worker pod for one stage's replica of one attempt. The launch's
/// `model` is the spec's validated model shape (`JobRequest::model`), so the
/// worker builds exactly what was planned; its `image` the one the decision
/// chose ([`WorkerImages::resolve`](crate::controller::config::WorkerImages::resolve));
/// its `recipe` the one recorded in the status.
pub fn worker_pod(
    job: &MemoryAwareTrainingJob,
    launch: &Launch,
    slot: Slot,
    plan: &Plan,
    config: &ChildConfig,
) -> Result<Pod, serde_json::Error> {
    let (attempt, image) = (launch.attempt, launch.image.as_str());
    let multi = plan.workers > 1;
    let assignment = assignment(job, launch, slot, plan);
    let mut env = worker_env(&assignment, config)?;
    env.extend(peer_env(job, attempt, plan, slot));
    let sizing = resources_and_placement(job, plan, slot.stage, config);
    let pod_affinity = stage_colocation(job, attempt, multi, config);
    let node_affinity = sizing.node_affinity;

    let mut pod = restricted_pod(
        job,
        config,
        PodParts {
            name: pod_name(job, attempt, plan, slot),
            component: Component::Worker,
            labels: worker_labels(attempt, slot, plan),
            container: "worker",
            image,
            env,
            resources: ResourceRequirements {
                limits: Some(sizing.limits),
                requests: Some(sizing.requests),
                ..ResourceRequirements::default()
            },
            node_selector: sizing.node_selector,
            tolerations: crate::inventory::worker_tolerations(job, plan.device_kind),
        },
    );
    if let Some(spec) = pod.spec.as_mut()
        && spec.termination_grace_period_seconds.is_none()
    {
        spec.termination_grace_period_seconds = Some(checkpoint_grace_seconds(plan, slot.stage));
    }
    // A queued job's attempt is one Kueue pod group (crate::kueue).
    crate::kueue::join_pod_group(
        &mut pod,
        job,
        &super::names::pod_group_name(job, attempt),
        plan.workers,
    );
    // On top of the skeleton: a multi-worker attempt's peers reach each
    // worker by its name under the Service, on its ports.
    let ports = peer_ports(plan);
    let pod_spec = pod.spec.get_or_insert_default();
    pod_spec.hostname = multi.then(|| host_name(plan, slot));
    pod_spec.subdomain = multi.then(|| service_name(job));
    pod_spec.affinity = merged_affinity(pod_spec.affinity.take(), node_affinity, pod_affinity);
    for container in &mut pod_spec.containers {
        container.ports = ports.clone();
    }
    Ok(pod)
}

/// What the worker in `slot` trains: the job, the attempt's plan and the
/// validated model, handed over whole in [`PLAN_JSON_ENV`].
fn assignment(
    job: &MemoryAwareTrainingJob,
    launch: &Launch,
    slot: Slot,
    plan: &Plan,
) -> WorkerAssignment {
    let training = &job.spec.training;
    WorkerAssignment {
        job: job.name_any(),
        namespace: job.namespace().unwrap_or_default(),
        attempt: launch.attempt,
        stage: slot.stage,
        replica: slot.replica,
        model: launch.model.clone(),
        plan: plan.clone(),
        recipe: launch.recipe.clone(),
        checkpoint_every_steps: training.checkpoint_every_steps,
        seed: training.seed,
        files: payload_files(job),
        memory_guard: memory_guard(&job.spec.memory_policy, plan.backend),
    }
}

/// The guard's settings for the workers (`spec.memoryPolicy.guard`):
/// `None` when it is off. Unset, it is on for CPU workers, whose cgroup
/// meter was measured on real pods, and off on GPUs, where its device meter
/// has not run yet. Stepping down in place halves the micro-batch, so it is
/// offered only where the job allows that rung.
fn memory_guard(policy: &MemoryPolicy, backend: Backend) -> Option<MemoryGuardSettings> {
    let guard = &policy.guard;
    let on = guard.enabled.unwrap_or(backend == Backend::Flex);
    on.then(|| MemoryGuardSettings {
        margin_percent: guard.margin_percent,
        step_down_in_place: guard.step_down_in_place
            && policy.allowed_rungs.contains(&RetryRung::HalveMicroBatch),
    })
}

/// How long a worker of `stage` may take after SIGTERM: Kubernetes' 30 s
/// plus the time to write what its checkpoint holds at most (the stage's
/// weights and optimizer state) at a slow volume's 100 MB/s; at most an hour.
fn checkpoint_grace_seconds(plan: &Plan, stage: u32) -> i64 {
    const WRITE_BYTES_PER_SECOND: u64 = 100_000_000;
    let bytes = plan.stages.get(stage as usize).map_or(0, |s| {
        s.memory.weights.saturating_add(s.memory.optimizer_state)
    });
    let seconds = 30 + bytes.div_ceil(WRITE_BYTES_PER_SECOND);
    i64::try_from(seconds.min(3600)).unwrap_or(3600)
}

fn env_var(name: &str, value: String) -> EnvVar {
    EnvVar {
        name: name.into(),
        value: Some(value),
        ..EnvVar::default()
    }
}

/// Every worker's environment: its assignment, its pod name, where it keeps
/// checkpoints, how often it reports, the allocator's limits, and how it
/// reaches the operator's worker API.
fn worker_env(
    assignment: &WorkerAssignment,
    config: &ChildConfig,
) -> Result<Vec<EnvVar>, serde_json::Error> {
    let mut env = vec![
        env_var(PLAN_JSON_ENV, serde_json::to_string(assignment)?),
        pod_name_env(),
        env_var(CHECKPOINT_DIR_ENV, DEFAULT_CHECKPOINT_DIR.into()),
        telemetry_interval_env(config),
        env_var(MALLOC_ARENA_MAX_ENV, WORKER_MALLOC_ARENAS.into()),
        env_var(MALLOC_TUNABLES_ENV, WORKER_MALLOC_TUNABLES.into()),
    ];
    env.extend(worker_api_access(config).0);
    Ok(env)
}

/// How the worker in `slot` finds its peers in a multi-worker attempt: the
/// pods of its pipeline and of its stage's ring, and the Service they are
/// named under.
fn peer_env(job: &MemoryAwareTrainingJob, attempt: u32, plan: &Plan, slot: Slot) -> Vec<EnvVar> {
    let name_of = |stage: u32, replica: u32| pod_name(job, attempt, plan, Slot { stage, replica });
    let mut peers = Vec::new();
    if plan.stage_count() > 1 {
        // This replica's pipeline: the same replica of every stage.
        let pods: Vec<String> = (0..plan.stage_count())
            .map(|k| name_of(k, slot.replica))
            .collect();
        peers.push(env_var(PIPELINE_PODS_ENV, pods.join(",")));
    }
    if plan.workers > 1 {
        // The headless Service every worker's DNS name is under: the
        // fallback when a peer's pod IP cannot be read from the API.
        peers.push(env_var(PIPELINE_SERVICE_ENV, service_name(job)));
    }
    if plan.replicas > 1 {
        // This stage's ring: its replicas in rank order.
        let pods: Vec<String> = (0..plan.replicas).map(|r| name_of(slot.stage, r)).collect();
        peers.push(env_var(REPLICA_PODS_ENV, pods.join(",")));
    }
    peers
}

/// A worker's container resources and the nodes it may run on.
struct Sizing {
    limits: BTreeMap<String, Quantity>,
    requests: BTreeMap<String, Quantity>,
    /// The user's `spec.worker.nodeSelector`, and a GPU's product labels
    /// when one term of plain labels places it.
    node_selector: BTreeMap<String, String>,
    /// A GPU's placement when it needs alternatives (terms are ORed).
    node_affinity: Option<NodeAffinity>,
}

/// What the plan sized stage `stage`'s worker to, and where it can get
/// that: the user's placement (a node pool, tolerations for its taints),
/// which the inventory honoured when planning, plus the GPU product.
fn resources_and_placement(
    job: &MemoryAwareTrainingJob,
    plan: &Plan,
    stage: u32,
    config: &ChildConfig,
) -> Sizing {
    let mut sizing = Sizing {
        limits: BTreeMap::new(),
        requests: BTreeMap::new(),
        node_selector: job.spec.worker.node_selector.clone(),
        node_affinity: None,
    };
    match plan.device_kind {
        DeviceKind::Cpu => size_cpu_worker(&mut sizing, job, plan),
        DeviceKind::Gpu => {
            size_gpu_worker(&mut sizing, job, plan, stage, config);
            place_on_device_nodes(&mut sizing, plan);
        }
    }
    sizing
}

/// A CPU worker: the container limit is the CPU job's device, the plan was
/// sized against it.
fn size_cpu_worker(sizing: &mut Sizing, job: &MemoryAwareTrainingJob, plan: &Plan) {
    sizing
        .limits
        .insert("memory".into(), quantity_bytes(plan.device_memory_bytes));
    sizing
        .requests
        .insert("memory".into(), quantity_bytes(plan.device_memory_bytes));
    let cores = job
        .spec
        .resources
        .cpu
        .as_ref()
        .and_then(|c| c.cores.clone())
        .unwrap_or_else(|| Quantity("1".into()));
    sizing.requests.insert("cpu".into(), cores);
}

/// A GPU worker: one device, the host memory its stage needs, and the
/// cores `resources.gpu.cores` asks for (a request, as a CPU job's).
fn size_gpu_worker(
    sizing: &mut Sizing,
    job: &MemoryAwareTrainingJob,
    plan: &Plan,
    stage: u32,
    config: &ChildConfig,
) {
    sizing
        .limits
        .insert(plan.resource.clone(), Quantity("1".into()));
    sizing
        .requests
        .insert(plan.resource.clone(), Quantity("1".into()));
    let baseline = job
        .spec
        .resources
        .gpu
        .as_ref()
        .and_then(|g| g.host_memory.clone())
        .unwrap_or_else(|| Quantity(config.gpu_host_memory.clone()));
    let host = gpu_worker_host_memory(&baseline, plan, stage);
    sizing.limits.insert("memory".into(), host.clone());
    sizing.requests.insert("memory".into(), host);
    let cores = job
        .spec
        .resources
        .gpu
        .as_ref()
        .and_then(|g| g.cores.clone())
        .unwrap_or_else(|| Quantity("1".into()));
    sizing.requests.insert("cpu".into(), cores);
}

/// Onto the nodes the plan's device type was counted on, by the labels its
/// name was read from: the resource alone would let a mixed MIG pod land on
/// another GPU model's slices of the same profile.
fn place_on_device_nodes(sizing: &mut Sizing, plan: &Plan) {
    let placement = device_placement(&plan.resource, &plan.device);
    match placement.as_slice() {
        [term]
            if term
                .iter()
                .all(|r| matches!(r, LabelRequirement::Equals { .. })) =>
        {
            for r in term {
                if let LabelRequirement::Equals { key, value } = r {
                    sizing.node_selector.insert(key.clone(), value.clone());
                }
            }
        }
        // Alternatives need node affinity (terms are ORed); the user's
        // nodeSelector still applies on top.
        terms => sizing.node_affinity = Some(required_node_affinity(terms)),
    }
}

/// The user's affinity (`spec.worker.affinity`) with Headroom's placement
/// ANDed in, so that neither loosens the other. A required node affinity
/// is met by any one of its terms, so the two are crossed: each user term
/// joined with each of Headroom's (a GPU product's alternatives). Required
/// pod affinity terms must all hold, so Headroom's (stages on one node) are
/// added to the user's. Preferences and anti-affinity are the user's alone.
fn merged_affinity(
    user: Option<Affinity>,
    node: Option<NodeAffinity>,
    pod: Option<PodAffinity>,
) -> Option<Affinity> {
    let mut affinity = user.unwrap_or_default();
    if let Some(required) = node.and_then(|n| n.required_during_scheduling_ignored_during_execution)
    {
        let user_node = affinity.node_affinity.get_or_insert_default();
        let terms = match user_node
            .required_during_scheduling_ignored_during_execution
            .take()
        {
            None => required.node_selector_terms,
            Some(mine) => mine
                .node_selector_terms
                .iter()
                .flat_map(|u| {
                    required.node_selector_terms.iter().map(move |h| {
                        let joined =
                            |a: &Option<Vec<NodeSelectorRequirement>>,
                             b: &Option<Vec<NodeSelectorRequirement>>| {
                                let all: Vec<NodeSelectorRequirement> =
                                    a.iter().chain(b).flatten().cloned().collect();
                                (!all.is_empty()).then_some(all)
                            };
                        NodeSelectorTerm {
                            match_expressions: joined(&u.match_expressions, &h.match_expressions),
                            match_fields: joined(&u.match_fields, &h.match_fields),
                        }
                    })
                })
                .collect(),
        };
        user_node.required_during_scheduling_ignored_during_execution = Some(NodeSelector {
            node_selector_terms: terms,
        });
    }
    if let Some(required) = pod.and_then(|p| p.required_during_scheduling_ignored_during_execution)
    {
        affinity
            .pod_affinity
            .get_or_insert_default()
            .required_during_scheduling_ignored_during_execution
            .get_or_insert_default()
            .extend(required);
    }
    (affinity != Affinity::default()).then_some(affinity)
}

/// The attempt, stage and (when replicated) replica labels of a worker.
fn worker_labels(attempt: u32, slot: Slot, plan: &Plan) -> BTreeMap<String, String> {
    let mut labels: BTreeMap<String, String> = BTreeMap::new();
    labels.insert(LABEL_ATTEMPT.into(), attempt.to_string());
    labels.insert(LABEL_STAGE.into(), slot.stage.to_string());
    if plan.replicas > 1 {
        labels.insert(LABEL_REPLICA.into(), slot.replica.to_string());
    }
    labels
}

/// Stages of one attempt together on one node when their shared checkpoint
/// volume can attach to only one. The first stage's own labels match the
/// term, so the scheduler may place it anywhere; the planner sized the
/// stage count by the free devices of one node.
fn stage_colocation(
    job: &MemoryAwareTrainingJob,
    attempt: u32,
    multi: bool,
    config: &ChildConfig,
) -> Option<PodAffinity> {
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
    })
}

/// The ports a multi-worker attempt's peers reach a worker on: the
/// pipeline's, the replicas' ring's. None for a lone worker.
fn peer_ports(plan: &Plan) -> Option<Vec<ContainerPort>> {
    (plan.workers > 1).then(|| {
        let port = |name: &str, port: u16| ContainerPort {
            name: Some(name.into()),
            container_port: i32::from(port),
            ..ContainerPort::default()
        };
        let mut ports = Vec::new();
        if plan.stage_count() > 1 {
            ports.push(port("pipeline", PIPELINE_PORT));
        }
        if plan.replicas > 1 {
            ports.push(port("replicas", REPLICA_PORT));
        }
        ports
    })
}

#[cfg(test)]
mod tests {
    use headroom_api::TELEMETRY_INTERVAL_ENV;
    use headroom_planner::{Inventory, plan};
    use k8s_openapi::api::core::v1::Node;

    use super::super::names::slots;
    use super::super::tests::{both_images, cpu_job, first_plan, image_of, job, pod_for};
    use super::*;

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

    /// `spec.worker`'s pod settings reach the pod: the user's variables
    /// before the operator's, labels beside the operator's (which win),
    /// annotations, the runtime class, pull secrets by name (bare names of
    /// an old stored job read too), the service account (never its API
    /// token), and the grace period: the user's, else
    /// 30 s plus the stage's checkpoint at 100 MB/s.
    #[test]
    fn the_users_pod_settings_reach_the_worker_pod() {
        let mut job = cpu_job();
        let plan = first_plan(&job.spec);
        let default = pod_for(&job, 1, 0, &plan, &ChildConfig::default());
        let memory = &plan.stages[0].memory;
        let expected = 30 + (memory.weights + memory.optimizer_state).div_ceil(100_000_000);
        assert_eq!(
            default
                .spec
                .as_ref()
                .expect("spec")
                .termination_grace_period_seconds,
            Some(i64::try_from(expected).expect("seconds"))
        );
        let settings: headroom_api::WorkerSpec = serde_json::from_value(serde_json::json!({
            "image": "localhost/headroom-worker:dev",
            "env": [
                {"name": "HTTPS_PROXY", "value": "http://proxy:3128"},
                {"name": "HF_HUB_ETAG_TIMEOUT", "valueFrom": {"configMapKeyRef": {"name": "hub", "key": "etag"}}}
            ],
            "podLabels": {"team": "nlp", "app.kubernetes.io/managed-by": "me"},
            "podAnnotations": {"sidecar.istio.io/inject": "false"},
            "runtimeClassName": "nvidia",
            "imagePullSecrets": ["old-shape"],
            "terminationGracePeriodSeconds": 600,
            "serviceAccountName": "trainer"
        }))
        .expect("worker settings");
        assert_eq!(settings.image_pull_secrets[0].name, "old-shape");
        job.spec.worker = settings;
        job.spec.job_request().expect("valid settings");
        let pod = pod_for(&job, 1, 0, &plan, &ChildConfig::default());
        let labels = pod.metadata.labels.as_ref().expect("labels");
        assert_eq!(labels["team"], "nlp");
        assert_ne!(
            labels["app.kubernetes.io/managed-by"], "me",
            "the operator's label wins"
        );
        assert_eq!(
            pod.metadata.annotations.as_ref().expect("annotations")["sidecar.istio.io/inject"],
            "false"
        );
        let spec = pod.spec.as_ref().expect("spec");
        assert_eq!(spec.runtime_class_name.as_deref(), Some("nvidia"));
        assert_eq!(spec.termination_grace_period_seconds, Some(600));
        // The user's account, still without its API token (the default
        // pod runs as the namespace's `default`, likewise).
        assert_eq!(spec.service_account_name.as_deref(), Some("trainer"));
        assert_eq!(spec.automount_service_account_token, Some(false));
        let default_spec = default.spec.as_ref().expect("spec");
        assert_eq!(
            default_spec.service_account_name.as_deref(),
            Some("default")
        );
        assert_eq!(default_spec.automount_service_account_token, Some(false));
        assert_eq!(
            spec.image_pull_secrets.as_ref().expect("pull secrets")[0].name,
            "old-shape"
        );
        let env = spec.containers[0].env.as_ref().expect("env");
        assert_eq!(env[0].name, "HTTPS_PROXY");
        assert_eq!(
            env[1]
                .value_from
                .as_ref()
                .and_then(|f| f.config_map_key_ref.as_ref())
                .map(|r| r.key.as_str()),
            Some("etag")
        );
        let default_env = default.spec.as_ref().expect("spec").containers[0]
            .env
            .clone()
            .expect("env");
        assert_eq!(env[2..], default_env[..], "then the operator's, unchanged");
        // The operator's own names, labels and annotations are refused.
        for (field, bad) in [
            (
                "worker.env",
                serde_json::json!({"env": [{"name": "HEADROOM_PLAN", "value": "x"}]}),
            ),
            (
                "worker.env",
                serde_json::json!({"env": [{"name": "MALLOC_ARENA_MAX", "value": "8"}]}),
            ),
            (
                "worker.env",
                serde_json::json!({"env": [{"name": "A", "value": "x", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}}]}),
            ),
            (
                "worker.podLabels",
                serde_json::json!({"podLabels": {"headroom.dev/job": "x"}}),
            ),
            (
                "worker.podAnnotations",
                serde_json::json!({"podAnnotations": {"headroom.dev/x": "y"}}),
            ),
        ] {
            job.spec.worker = serde_json::from_value(bad).expect("shape");
            let e = job.spec.job_request().expect_err(field);
            assert_eq!(e.field, field, "{e}");
        }
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
        // One malloc arena (see `headroom_api::MALLOC_ARENA_MAX_ENV`).
        let arenas = pod.spec.as_ref().expect("spec").containers[0]
            .env
            .iter()
            .flatten()
            .find(|e| e.name == "MALLOC_ARENA_MAX")
            .and_then(|e| e.value.clone());
        assert_eq!(arenas.as_deref(), Some("1"));
        // A fixed mmap threshold on huge pages (see `headroom_api::MALLOC_TUNABLES_ENV`).
        let tunables = pod.spec.as_ref().expect("spec").containers[0]
            .env
            .iter()
            .flatten()
            .find(|e| e.name == "GLIBC_TUNABLES")
            .and_then(|e| e.value.clone());
        assert_eq!(
            tunables.as_deref(),
            Some("glibc.malloc.hugetlb=1:glibc.malloc.mmap_threshold=8388608")
        );
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
        let job = job(include_str!("../../../../samples/cpu-pipeline.yaml"));
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
            &Launch::of(&job, 3, &model, "img"),
            Slot {
                stage: 1,
                replica: 1,
            },
            &plan,
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
    fn gpu_worker_pod_selects_the_planned_product_and_requests_one_gpu() {
        let job = job(include_str!("../../../../samples/gpu-gpt2-medium.yaml"));
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
        let cpu_request = |pod: &Pod| {
            pod.spec.as_ref().expect("spec").containers[0]
                .resources
                .as_ref()
                .and_then(|r| r.requests.as_ref())
                .and_then(|r| r.get("cpu"))
                .map(|q| q.0.clone())
        };
        let default_pod = pod_for(&job, 2, 0, &plan, &ChildConfig::default());
        assert_eq!(
            cpu_request(&default_pod).as_deref(),
            Some("1"),
            "one core unless asked"
        );
        let mut fed = job.clone();
        fed.spec.resources.gpu.as_mut().expect("gpu").cores = Some(Quantity("8".into()));
        fed.spec.job_request().expect("valid cores");
        let pod = pod_for(&fed, 2, 0, &plan, &ChildConfig::default());
        assert_eq!(cpu_request(&pod).as_deref(), Some("8"));
        assert!(
            pod.spec.as_ref().expect("spec").containers[0]
                .resources
                .as_ref()
                .and_then(|r| r.limits.as_ref())
                .is_some_and(|l| !l.contains_key("cpu")),
            "a request, no CPU limit"
        );
        for bad in ["0", "-1", "lots"] {
            fed.spec.resources.gpu.as_mut().expect("gpu").cores = Some(Quantity(bad.into()));
            let e = fed.spec.job_request().expect_err(bad);
            assert_eq!(e.field, "resources.gpu.cores", "{bad}: {e}");
        }

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
        let mut job = job(include_str!("../../../../samples/gpu-gpt2-medium.yaml"));
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
    /// `spec.worker.affinity` is ANDed with Headroom's placement, never
    /// replaced: on mixed MIG slices without a `.product` label (placement
    /// by alternatives, a required node affinity), the user's zone holds
    /// and so does the planned GPU model; the user's preferences and
    /// anti-affinity are kept, and a pipeline's stages still share a node
    /// beside the user's own pod-affinity term.
    #[test]
    fn the_users_affinity_is_anded_with_headrooms_placement() {
        const A100: &str = "NVIDIA-A100-SXM4-80GB";
        const H100: &str = "NVIDIA-H100-80GB-HBM3";
        let mut job = job(include_str!("../../../../samples/gpu-gpt2-medium.yaml"));
        job.spec.model = serde_yaml::from_str(
            "transformer: {layers: 12, hidden: 768, heads: 12, sequenceLength: 1024, vocabulary: 50257}",
        )
        .expect("model");
        job.spec.resources.gpu.as_mut().expect("gpu").types = vec![format!("{A100}-MIG-1g.10gb")];
        let in_zone = |mut node: Node, zone: Option<&str>| {
            if let Some(zone) = zone {
                node.metadata
                    .labels
                    .get_or_insert_default()
                    .insert("topology.kubernetes.io/zone".into(), zone.into());
            }
            node
        };
        let a100_east = in_zone(mixed_mig_node("a100-east", A100, false), Some("east"));
        let a100_west = in_zone(mixed_mig_node("a100-west", A100, false), Some("west"));
        let h100_east = in_zone(mixed_mig_node("h100-east", H100, false), Some("east"));
        let facts: Vec<_> = [&a100_east, &a100_west, &h100_east]
            .into_iter()
            .map(|n| crate::inventory::node_facts(n, []))
            .collect();
        let plan = plan(
            &job.spec.job_request().expect("valid"),
            &Inventory::from_nodes(&facts),
        )
        .expect("plan");
        job.spec.worker.affinity = Some(
            serde_yaml::from_str(
                r#"
nodeAffinity:
  requiredDuringSchedulingIgnoredDuringExecution:
    nodeSelectorTerms:
    - matchExpressions: [{key: topology.kubernetes.io/zone, operator: In, values: [east]}]
  preferredDuringSchedulingIgnoredDuringExecution:
  - weight: 10
    preference:
      matchExpressions: [{key: spot, operator: DoesNotExist}]
podAntiAffinity:
  preferredDuringSchedulingIgnoredDuringExecution:
  - weight: 50
    podAffinityTerm:
      topologyKey: kubernetes.io/hostname
      labelSelector: {matchLabels: {team: nlp}}
"#,
            )
            .expect("affinity"),
        );
        job.spec.job_request().expect("still valid");
        let pod = pod_for(&job, 1, 0, &plan, &ChildConfig::default());
        let placement = pod.spec.as_ref().and_then(|s| s.affinity.clone());
        assert!(fits_on(&pod, &a100_east), "{placement:?}");
        assert!(
            !fits_on(&pod, &a100_west),
            "the user's zone holds: {placement:?}"
        );
        assert!(
            !fits_on(&pod, &h100_east),
            "the planned GPU holds: {placement:?}"
        );
        let affinity = placement.expect("affinity");
        let node = affinity.node_affinity.expect("node affinity");
        assert_eq!(
            node.preferred_during_scheduling_ignored_during_execution
                .map(|p| p.len()),
            Some(1)
        );
        assert!(affinity.pod_anti_affinity.is_some(), "the user's, kept");

        // Beside a pipeline's own pod-affinity term (stages on one node).
        let mut pipeline =
            super::super::tests::job(include_str!("../../../../samples/cpu-pipeline.yaml"));
        let stages = first_plan(&pipeline.spec);
        assert!(stages.workers > 1, "the sample is a pipeline");
        pipeline.spec.worker.affinity = Some(
            serde_yaml::from_str(
                r#"
podAffinity:
  requiredDuringSchedulingIgnoredDuringExecution:
  - topologyKey: topology.kubernetes.io/zone
    labelSelector: {matchLabels: {app: dataset-cache}}
"#,
            )
            .expect("affinity"),
        );
        let pod = pod_for(&pipeline, 2, 1, &stages, &ChildConfig::default());
        let keys: Vec<String> = pod
            .spec
            .and_then(|s| s.affinity)
            .and_then(|a| a.pod_affinity)
            .and_then(|a| a.required_during_scheduling_ignored_during_execution)
            .expect("required pod affinity")
            .into_iter()
            .map(|t| t.topology_key)
            .collect();
        assert_eq!(
            keys,
            ["topology.kubernetes.io/zone", "kubernetes.io/hostname"]
        );
    }
    /// The user's ConfigMap variables and volumes reach the pod after the
    /// operator's own; what would collide with the operator's, reach a
    /// node's files or a Secret is refused offline, naming the field.
    #[test]
    fn the_users_volumes_and_config_maps_reach_the_pod_clear_of_the_operators() {
        let mut job = cpu_job();
        let plan = first_plan(&job.spec);
        let default = pod_for(&job, 1, 0, &plan, &ChildConfig::default());
        job.spec.worker = serde_json::from_value(serde_json::json!({
            "image": "localhost/headroom-worker:dev",
            "envFrom": [{"configMapRef": {"name": "proxy"}, "prefix": "NET_"}],
            "volumes": [
                {"name": "ca", "configMap": {"name": "corporate-ca"}},
                {"name": "shared", "persistentVolumeClaim": {"claimName": "datasets", "readOnly": true}},
                {"name": "scratch", "emptyDir": {"sizeLimit": "2Gi"}}
            ],
            "volumeMounts": [
                {"name": "ca", "mountPath": "/etc/ssl/corporate", "readOnly": true},
                {"name": "shared", "mountPath": "/mnt/datasets"}
            ]
        }))
        .expect("worker settings");
        job.spec.job_request().expect("valid settings");
        let pod = pod_for(&job, 1, 0, &plan, &ChildConfig::default());
        let spec = pod.spec.as_ref().expect("spec");
        let old = default.spec.as_ref().expect("spec");
        let volumes = spec.volumes.as_ref().expect("volumes");
        let old_volumes = old.volumes.as_ref().expect("volumes");
        assert_eq!(
            volumes[..old_volumes.len()],
            old_volumes[..],
            "the operator's first"
        );
        let names: Vec<&str> = volumes[old_volumes.len()..]
            .iter()
            .map(|v| v.name.as_str())
            .collect();
        assert_eq!(names, ["ca", "shared", "scratch"]);
        let shared = &volumes[old_volumes.len() + 1];
        assert_eq!(
            shared
                .persistent_volume_claim
                .as_ref()
                .map(|c| (c.claim_name.as_str(), c.read_only)),
            Some(("datasets", Some(true)))
        );
        let c = &spec.containers[0];
        let mounts = c.volume_mounts.as_ref().expect("mounts");
        let old_mounts = old.containers[0].volume_mounts.as_ref().expect("mounts");
        assert_eq!(mounts[..old_mounts.len()], old_mounts[..]);
        let added: Vec<(&str, Option<bool>)> = mounts[old_mounts.len()..]
            .iter()
            .map(|m| (m.mount_path.as_str(), m.read_only))
            .collect();
        assert_eq!(
            added,
            [("/etc/ssl/corporate", Some(true)), ("/mnt/datasets", None)]
        );
        let from = c.env_from.as_ref().expect("envFrom");
        assert_eq!(
            from[0].config_map_ref.as_ref().map(|r| r.name.as_str()),
            Some("proxy")
        );
        assert_eq!(from[0].prefix.as_deref(), Some("NET_"));
        assert!(from[0].secret_ref.is_none());
        assert!(old.containers[0].env_from.is_none(), "none unless asked");

        let volume = |v: serde_json::Value| serde_json::json!({"volumes": [v]});
        let mounted = |path: &str| {
            serde_json::json!({
                "volumes": [{"name": "x", "emptyDir": {}}],
                "volumeMounts": [{"name": "x", "mountPath": path}]
            })
        };
        for (field, bad, words) in [
            (
                "worker.envFrom",
                serde_json::json!({"envFrom": [{"secretRef": {"name": "hf-token"}}]}),
                "tokenSecret",
            ),
            (
                "worker.volumes",
                volume(serde_json::json!({"name": "host", "hostPath": {"path": "/etc"}})),
                "hostPath is refused",
            ),
            (
                "worker.volumes",
                volume(
                    serde_json::json!({"name": "two", "emptyDir": {}, "configMap": {"name": "c"}}),
                ),
                "one source",
            ),
            (
                "worker.volumes",
                volume(serde_json::json!({"name": "checkpoints", "emptyDir": {}})),
                "operator's volume names",
            ),
            (
                "worker.volumes",
                volume(serde_json::json!({"name": "claim-0", "emptyDir": {}})),
                "operator's volume names",
            ),
            (
                "worker.volumeMounts",
                serde_json::json!({"volumeMounts": [{"name": "nowhere", "mountPath": "/mnt/x"}]}),
                "one of worker.volumes",
            ),
            ("worker.volumeMounts", mounted("/tmp"), "operator's mounts"),
            (
                "worker.volumeMounts",
                mounted("/var/lib/headroom/checkpoints/x"),
                "operator's mounts",
            ),
            ("worker.volumeMounts", mounted("/var"), "operator's mounts"),
            ("worker.volumeMounts", mounted("/mnt/../tmp"), ". or .."),
        ] {
            job.spec.worker = serde_json::from_value(bad.clone()).expect("shape");
            let e = job.spec.job_request().expect_err(&bad.to_string());
            assert_eq!(e.field, field, "{bad}: {e}");
            assert!(e.problem.contains(words), "{bad}: {e}");
        }
        for fine in ["/mnt/x", "/var/lib/other", "/tmpfs", "/home/worker/.cache"] {
            job.spec.worker = serde_json::from_value(mounted(fine)).expect("shape");
            job.spec
                .job_request()
                .unwrap_or_else(|e| panic!("{fine}: {e}"));
        }
    }

    /// Unset, the guard is on for CPU workers and off on GPUs; what the
    /// job says wins either way; stepping down in place needs its rung.
    #[test]
    fn the_guard_is_on_by_default_for_cpu_workers_only() {
        let mut policy = MemoryPolicy::default();
        let cpu = memory_guard(&policy, Backend::Flex).expect("on for a CPU worker");
        assert_eq!(cpu.margin_percent, policy.guard.margin_percent);
        assert!(cpu.step_down_in_place);
        assert_eq!(
            memory_guard(&policy, Backend::Cuda),
            None,
            "off on a GPU unless asked"
        );
        policy.guard.enabled = Some(true);
        assert!(memory_guard(&policy, Backend::Cuda).is_some());
        policy.guard.enabled = Some(false);
        assert_eq!(memory_guard(&policy, Backend::Flex), None);
        policy.guard.enabled = None;
        policy
            .allowed_rungs
            .retain(|r| *r != RetryRung::HalveMicroBatch);
        assert!(
            !memory_guard(&policy, Backend::Flex)
                .expect("on")
                .step_down_in_place
        );
    }
}
