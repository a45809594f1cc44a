//! Pure builders for everything the operator creates for a job: the
//! checkpoint PVC, the headless Service of a multi-worker attempt, one Pod
//! per worker, and the initializer Pod of a fine-tuning job. All carry a
//! controller owner reference to the job (a claim kept after its job
//! excepted) and are written under one field manager. No pod gets
//! Kubernetes API rights: each runs under the namespace's `default` account
//! with no API token mounted, and reaches the operator's worker API
//! ([`crate::worker_api`]) with a token bound to the pod that only that API
//! accepts.
//!
//! Imports go one way: each file imports only from files listed before it.
//!
//! * `names` — every object's name, and the [`Slot`]s of a plan
//! * `files` — where a job's files are in its pods: the checkpoint claim,
//!   the claims a fine-tuning job names, the paths in its assignment
//! * `skeleton` — owner, labels, metadata, and the one restricted pod
//!   skeleton every pod of a job is built on (account, security, volumes,
//!   placement, image, termination message)
//! * `worker`, `initializer`, `claim`, `service`, `network_policy` — each
//!   object on top of the skeleton; none imports another

mod claim;
mod files;
mod initializer;
mod model_cache;
mod names;
mod network_policy;
mod service;
mod skeleton;
mod worker;

pub use claim::{checkpoint_claim, claim_belongs_to, claim_size, disk_inputs, release_claim_patch};
pub use files::output_location;
pub use initializer::{initializer_pod, initializer_pod_filling};
pub use model_cache::{
    CACHE_MODEL_PATH, CacheRole, CacheState, Collect, cache_claim, cache_claim_name, collect,
    is_cache_claim, ready_patch, release_filler_patch, role, shared_cache, take_over_patch,
    used_patch,
};
pub use names::{
    Slot, checkpoint_claim_name, initializer_pod_name, pod_group_name, pod_name, slots,
};
pub use network_policy::peer_network_policy;
pub use service::headless_service;
pub use worker::worker_pod;

#[cfg(test)]
pub(crate) mod tests {
    use headroom_api::{
        LABEL_ATTEMPT, LABEL_JOB, MemoryAwareTrainingJob, MemoryAwareTrainingJobSpec,
    };
    use headroom_planner::{Inventory, Plan, plan};
    use k8s_openapi::api::core::v1::{Container, Pod, PodSpec};
    use kube::ResourceExt;

    use super::*;
    use crate::controller::config::{CheckpointAccess, ChildConfig, WorkerImages};

    pub(crate) fn job(yaml: &str) -> MemoryAwareTrainingJob {
        let mut job: MemoryAwareTrainingJob = serde_yaml::from_str(yaml).expect("job fixture");
        job.metadata.namespace = Some("team-a".into());
        job.metadata.uid = Some("0000-1111".into());
        job
    }

    pub(crate) fn cpu_job() -> MemoryAwareTrainingJob {
        job(include_str!("../../../../samples/cpu-tiny.yaml"))
    }

    pub(crate) fn first_plan(spec: &MemoryAwareTrainingJobSpec) -> Plan {
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
    pub(super) fn pod_for(
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
        worker_pod(
            job,
            &crate::controller::decide::Launch::of(job, attempt, &model, &image),
            slot,
            plan,
            config,
        )
        .expect("pod")
    }

    pub(super) fn image_of(pod: &Pod) -> Option<&str> {
        pod.spec.as_ref()?.containers[0].image.as_deref()
    }

    #[test]
    fn pipeline_stages_share_a_node_only_when_the_checkpoint_volume_is_read_write_once() {
        let job = job(include_str!("../../../../samples/cpu-pipeline.yaml"));
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
            checkpoint_claim(&job, &rwo, None)
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
            checkpoint_claim(&job, &rwx, None)
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

    /// The worker pods and the initializer pod are one skeleton: what the
    /// user sets for the job's pods (pull secrets, node pool, tolerations,
    /// priority, pull policy) reaches both alike, and so do the account, the
    /// security contexts, the job's volumes and the termination message. The
    /// initializer alone has more: the hub tokens' Secret files.
    #[test]
    fn workers_and_the_initializer_share_the_restricted_pod_skeleton() {
        let j = hub_job_with_the_users_placement();
        let config = ChildConfig {
            worker_api_url: Some("https://10.96.0.20:8081".into()),
            worker_api_ca: Some(
                "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n".into(),
            ),
            ..ChildConfig::default()
        };
        // A planned CPU attempt (a fine-tuning job is planned from what its
        // initializer read; any CPU plan builds the same skeleton).
        let tiny = cpu_job();
        let plan = first_plan(&tiny.spec);
        let model = tiny.spec.job_request().expect("valid").model;
        let image = "registry.example/headroom-worker:1";
        let slot = Slot {
            stage: 0,
            replica: 0,
        };
        let worker = worker_pod(
            &j,
            &crate::controller::decide::Launch::of(&j, 1, &model, image),
            slot,
            &plan,
            &config,
        )
        .expect("worker");
        let initializer = initializer_pod(&j, 1, image, &config)
            .expect("build")
            .expect("a pretrained job");

        let (w, i) = (
            worker.spec.as_ref().expect("spec"),
            initializer.spec.as_ref().expect("spec"),
        );
        assert_both_pods_run_as_the_user_placed_them(w, i, &j);
        assert_the_initializer_alone_adds_the_token_files(w, i);
        let (wc, ic) = (&w.containers[0], &i.containers[0]);
        assert_both_containers_are_restricted_alike(wc, ic, &config, image);
        assert_no_secret_value_in_either_environment(wc, ic);
        assert_only_the_component_tells_them_apart(&worker, &initializer);

        // On a GPU plan the workers add the GPU toleration; the initializer,
        // which uses no device, keeps the user's.
        let gpu = crate::inventory::worker_tolerations(&j, headroom_planner::DeviceKind::Gpu);
        assert_eq!(gpu.len(), j.spec.worker.tolerations.len() + 1);
        assert_eq!(i.tolerations.as_ref(), Some(&j.spec.worker.tolerations));
    }

    /// The fine-tuning sample with a gated checkpoint and dataset from the
    /// hub, each with its token, and the user's image, pull policy, pull
    /// secrets, node pool, toleration and priority.
    fn hub_job_with_the_users_placement() -> MemoryAwareTrainingJob {
        let mut j = job(include_str!(
            "../../../../samples/cpu-finetune-tiny-llama.yaml"
        ));
        let pretrained = j.spec.model.pretrained.as_mut().expect("pretrained");
        pretrained.volume = None;
        pretrained.hugging_face = Some(
            serde_yaml::from_str("{repo: acme/llama, tokenSecret: {name: hf-token, key: hf}}")
                .expect("hub model"),
        );
        let data = j.spec.data.as_mut().expect("data");
        data.volume = None;
        data.hugging_face = Some(
            serde_yaml::from_str(
                "{repo: acme/text, file: train.jsonl, tokenSecret: {name: hf-data}}",
            )
            .expect("hub data"),
        );
        j.spec.worker = serde_yaml::from_str(
            r#"
image: registry.example/headroom-worker:1
imagePullPolicy: IfNotPresent
imagePullSecrets: [registry-creds, mirror-creds]
nodeSelector: {pool: train}
tolerations: [{key: dedicated, operator: Equal, value: research, effect: NoSchedule}]
priorityClassName: batch-low
"#,
        )
        .expect("worker spec");
        j
    }

    /// Restart policy, account, API token, priority, pull secrets, node pool,
    /// tolerations and security context: the user's where the user set them,
    /// and the same on both pods.
    fn assert_both_pods_run_as_the_user_placed_them(
        w: &PodSpec,
        i: &PodSpec,
        j: &MemoryAwareTrainingJob,
    ) {
        assert_eq!(w.restart_policy.as_deref(), Some("Never"));
        assert_eq!(w.restart_policy, i.restart_policy);
        assert_eq!(w.service_account_name.as_deref(), Some("default"));
        assert_eq!(w.service_account_name, i.service_account_name);
        assert_eq!(w.automount_service_account_token, Some(false));
        assert_eq!(
            w.automount_service_account_token,
            i.automount_service_account_token
        );
        assert_eq!(w.priority_class_name.as_deref(), Some("batch-low"));
        assert_eq!(w.priority_class_name, i.priority_class_name);
        let secrets: Vec<&str> = w
            .image_pull_secrets
            .iter()
            .flatten()
            .map(|s| s.name.as_str())
            .collect();
        assert_eq!(secrets, ["registry-creds", "mirror-creds"]);
        assert_eq!(w.image_pull_secrets, i.image_pull_secrets);
        assert_eq!(
            w.node_selector.as_ref().map(|s| s["pool"].as_str()),
            Some("train")
        );
        assert_eq!(w.node_selector, i.node_selector);
        assert_eq!(
            w.tolerations.as_ref(),
            Some(&j.spec.worker.tolerations),
            "a CPU plan adds no toleration"
        );
        assert_eq!(w.tolerations, i.tolerations);
        assert_eq!(
            w.security_context.as_ref().and_then(|s| s.run_as_non_root),
            Some(true)
        );
        assert_eq!(w.security_context, i.security_context);
    }

    /// The job's claims and the API token alike; the initializer alone adds
    /// the two tokens' files, each one key of its Secret.
    fn assert_the_initializer_alone_adds_the_token_files(w: &PodSpec, i: &PodSpec) {
        let secret_volumes = |spec: &PodSpec| -> Vec<(String, String)> {
            spec.volumes
                .iter()
                .flatten()
                .filter_map(|v| v.secret.as_ref())
                .flat_map(|s| {
                    s.items
                        .iter()
                        .flatten()
                        .map(|item| (s.secret_name.clone().unwrap_or_default(), item.key.clone()))
                })
                .collect()
        };
        assert_eq!(secret_volumes(w), Vec::<(String, String)>::new());
        assert_eq!(
            secret_volumes(i),
            [
                ("hf-token".to_string(), "hf".to_string()),
                ("hf-data".to_string(), "token".to_string())
            ]
        );
        let (w_volumes, i_volumes) = (
            w.volumes.clone().unwrap_or_default(),
            i.volumes.clone().unwrap_or_default(),
        );
        assert_eq!(i_volumes.len(), w_volumes.len() + 2);
        assert_eq!(
            i_volumes[..w_volumes.len()],
            w_volumes[..],
            "the job's claims and the API token"
        );
        assert!(
            i_volumes[w_volumes.len()..]
                .iter()
                .all(|v| v.secret.is_some()),
            "only the tokens' files are the initializer's own"
        );
    }

    /// Both reach the worker API over TLS, trusting the operator's CA alone;
    /// the same security context, termination message, pull policy, image
    /// and mounts, the initializer's read-only token mounts after the
    /// worker's.
    fn assert_both_containers_are_restricted_alike(
        wc: &Container,
        ic: &Container,
        config: &ChildConfig,
        image: &str,
    ) {
        for c in [wc, ic] {
            let env = |name: &str| {
                c.env
                    .iter()
                    .flatten()
                    .find(|e| e.name == name)
                    .and_then(|e| e.value.clone())
            };
            assert_eq!(env(headroom_api::WORKER_API_CA_ENV), config.worker_api_ca);
            assert_eq!(env(headroom_api::WORKER_API_ENV), config.worker_api_url);
        }
        assert_eq!(
            wc.security_context
                .as_ref()
                .and_then(|s| s.read_only_root_filesystem),
            Some(true)
        );
        assert_eq!(wc.security_context, ic.security_context);
        assert_eq!(
            wc.termination_message_path.as_deref(),
            Some(headroom_api::TERMINATION_MESSAGE_PATH)
        );
        assert_eq!(wc.termination_message_path, ic.termination_message_path);
        assert_eq!(
            wc.termination_message_policy.as_deref(),
            Some("FallbackToLogsOnError")
        );
        assert_eq!(wc.termination_message_policy, ic.termination_message_policy);
        assert_eq!(wc.image_pull_policy.as_deref(), Some("IfNotPresent"));
        assert_eq!(wc.image_pull_policy, ic.image_pull_policy);
        assert_eq!(
            (wc.image.as_deref(), ic.image.as_deref()),
            (Some(image), Some(image))
        );
        let (w_mounts, i_mounts) = (
            wc.volume_mounts.clone().unwrap_or_default(),
            ic.volume_mounts.clone().unwrap_or_default(),
        );
        assert_eq!(i_mounts[..w_mounts.len()], w_mounts[..]);
        let token_mounts: Vec<(&str, Option<bool>)> = i_mounts[w_mounts.len()..]
            .iter()
            .map(|m| (m.mount_path.as_str(), m.read_only))
            .collect();
        assert_eq!(
            token_mounts,
            [
                ("/var/run/secrets/headroom.dev/hf-token", Some(true)),
                ("/var/run/secrets/headroom.dev/hf-dataset-token", Some(true))
            ]
        );
    }

    /// Neither pod has a Secret's value in its environment; only the
    /// initializer is told where the token files are.
    fn assert_no_secret_value_in_either_environment(wc: &Container, ic: &Container) {
        let env = |c: &Container| c.env.clone().unwrap_or_default();
        for e in env(wc).iter().chain(&env(ic)) {
            assert!(
                e.value_from
                    .as_ref()
                    .is_none_or(|v| v.secret_key_ref.is_none()),
                "{e:?}"
            );
        }
        let names = |c| -> Vec<String> { env(c).into_iter().map(|e| e.name).collect() };
        for var in [
            headroom_api::HF_TOKEN_FILE_ENV,
            headroom_api::HF_DATASET_TOKEN_FILE_ENV,
        ] {
            assert!(!names(wc).iter().any(|n| n == var), "{var} on a worker");
            assert!(
                names(ic).iter().any(|n| n == var),
                "{var} on the initializer"
            );
        }
    }

    /// Only the component (and the initializer's role) tells them apart.
    fn assert_only_the_component_tells_them_apart(worker: &Pod, initializer: &Pod) {
        let labels = |pod: &Pod| pod.metadata.labels.clone().expect("labels");
        let (wl, il) = (labels(worker), labels(initializer));
        assert_eq!(wl[headroom_api::LABEL_COMPONENT], "worker");
        assert_eq!(il[headroom_api::LABEL_COMPONENT], "initializer");
        assert_eq!(il[headroom_api::LABEL_ROLE], "initializer");
        assert!(!wl.contains_key(headroom_api::LABEL_ROLE));
        for key in [LABEL_JOB, headroom_api::LABEL_MANAGED_BY] {
            assert_eq!(wl[key], il[key], "{key}");
        }
        assert_eq!(
            worker.metadata.owner_references,
            initializer.metadata.owner_references
        );
    }

    /// Without tolerations, pull secrets or a node pool in the spec, neither
    /// pod names any (rather than empty lists).
    #[test]
    fn unset_placement_stays_unset_on_both_pods() {
        let j = job(include_str!(
            "../../../../samples/cpu-finetune-tiny-llama.yaml"
        ));
        assert!(j.spec.worker.tolerations.is_empty(), "the premise");
        let tiny = cpu_job();
        let plan = first_plan(&tiny.spec);
        let model = tiny.spec.job_request().expect("valid").model;
        let slot = Slot {
            stage: 0,
            replica: 0,
        };
        let config = ChildConfig::default();
        let worker = worker_pod(
            &j,
            &crate::controller::decide::Launch::of(&j, 1, &model, "img"),
            slot,
            &plan,
            &config,
        )
        .expect("worker");
        let initializer = initializer_pod(&j, 1, "img", &config)
            .expect("build")
            .expect("pod");
        for pod in [&worker, &initializer] {
            let spec = pod.spec.as_ref().expect("spec");
            assert_eq!(spec.tolerations, None);
            assert_eq!(spec.image_pull_secrets, None);
            assert_eq!(spec.node_selector, None);
            assert_eq!(spec.priority_class_name, None);
        }
    }
}
