//! The watches behind the controller: jobs (through `DeserializeGuard`), the
//! jobs' pods (one reflector that also triggers reconciles), nodes and every
//! GPU-holding pod (the inventory), and the metadata of claims (whether a
//! job's checkpoint claim exists, and whose it is). Reconciling starts only
//! once every cache is complete.

use std::sync::Arc;

use futures::StreamExt;
use futures::channel::mpsc::UnboundedReceiver;
use headroom_api::{LABEL_JOB, MemoryAwareTrainingJob};
use k8s_openapi::api::core::v1::{Node, PersistentVolumeClaim, Pod};
use kube::api::Api;
use kube::core::{DeserializeGuard, PartialObjectMeta};
use kube::runtime::controller::Controller;
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};

use super::reconcile::{error_policy, reconcile};
use super::{Context, ControllerConfig};
use crate::metrics::Metrics;
use crate::watched_pods::{WatchedPods, owning_job};
use crate::worker_reports::WorkerReports;

/// Runs the controller until `shutdown` resolves; returns after in-flight
/// reconciles finish. `reports`: the worker API's held telemetry;
/// `watched`: filled with the job pods' cache once it is complete, for the
/// worker API's identity checks.
pub async fn run(
    client: Client,
    metrics: Arc<Metrics>,
    reports: Arc<WorkerReports>,
    watched: WatchedPods,
    config: ControllerConfig,
    identity: &str,
    shutdown: impl Future<Output = ()> + Send + Sync + 'static,
) {
    // Jobs are read through DeserializeGuard: one object that fails to parse
    // (e.g. status written by a mismatched worker) must not stall the others.
    let jobs: Api<DeserializeGuard<MemoryAwareTrainingJob>> = scoped(&client, &config);
    let (pods, pod_events, pod_watch) = watch_job_pods(scoped(&client, &config));
    let (nodes, node_watch) = watch_nodes(&client);
    let (device_pods, device_watch) = watch_device_pods(&client);
    let (claims, claim_watch) = watch_claims(scoped(&client, &config));

    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: "headroom-operator".into(),
            instance: Some(identity.into()),
        },
    );
    let ctx = Arc::new(Context::new(
        client,
        pods.clone(),
        nodes.clone(),
        device_pods.clone(),
        claims.clone(),
        recorder,
        metrics.clone(),
        config.clone(),
        reports.clone(),
    ));

    // Reconciling before the caches are complete would plan against a partial
    // inventory (or recreate pods it cannot see yet): drive the reflectors
    // first, and start the controller only once every store is ready.
    let watches = async {
        tokio::select! {
            _ = pod_watch => tracing::warn!("pod watch ended"),
            _ = node_watch => tracing::warn!("node watch ended"),
            _ = device_watch => tracing::warn!("device pod watch ended"),
            _ = claim_watch => tracing::warn!("claim watch ended"),
        }
    };
    let shutdown = futures::FutureExt::shared(shutdown);
    let controlled = async {
        tokio::select! {
            ready = async {
                pods.wait_until_ready()
                    .await
                    .and(nodes.wait_until_ready().await)
                    .and(device_pods.wait_until_ready().await)
                    .and(claims.wait_until_ready().await)
            } => {
                if ready.is_err() {
                    return;
                }
            }
            _ = shutdown.clone() => return,
        }
        metrics.set_ready(true);
        watched.fill(pods.clone());
        tracing::info!("caches synced; reconciling");
        reconcile_jobs(jobs, pod_events, reports, &config, ctx, shutdown).await;
        tracing::info!("controller stopped");
    };
    tokio::select! {
        _ = controlled => {}
        _ = watches => {}
    }
}

/// `K`s in the controller's namespace, or in all of them.
fn scoped<K>(client: &Client, config: &ControllerConfig) -> Api<K>
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>,
    K::DynamicType: Default,
{
    match &config.namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
}

/// Pods carrying our job label, watched once: the reflector's store is read
/// in reconcile, and every pod it applies or deletes is forwarded (the
/// receiver) as the "owns" trigger of its job. Not kube-runtime's shared
/// store (`store_shared` + `subscribe`): its handle never yields deletions,
/// and when a pod is deleted before the handle reads it, returns Pending
/// without a waker; from then on no pod event triggers a reconcile, and once
/// its 1024-event buffer fills the pod cache stops too.
fn watch_job_pods(
    pod_api: Api<Pod>,
) -> (
    Store<Pod>,
    UnboundedReceiver<Arc<Pod>>,
    impl Future<Output = ()>,
) {
    let (pods, pod_writer) = reflector::store();
    let (pod_tx, pod_events) = futures::channel::mpsc::unbounded::<Arc<Pod>>();
    let pod_watch = watcher(pod_api, watcher::Config::default().labels(LABEL_JOB))
        .default_backoff()
        .filter_map(|event| std::future::ready(only_ours(event)))
        .modify(keep_what_decisions_read)
        .reflect(pod_writer)
        .for_each(move |event| {
            if let Ok(
                watcher::Event::Apply(pod)
                | watcher::Event::Delete(pod)
                | watcher::Event::InitApply(pod),
            ) = event
            {
                // Fails only once the controller has stopped.
                let _ = pod_tx.unbounded_send(Arc::new(pod));
            }
            std::future::ready(())
        });
    (pods, pod_events, pod_watch)
}

/// Only pods a job controls enter the cache. Anyone who may create pods can
/// put the job label on one, and the cache would keep it (with whatever it
/// carries) for as long as it exists: about 200 crafted pods would fill the
/// operator's memory. A pod that is not, or no longer, a job's is removed
/// instead (a `Delete`, which no job's reconcile follows, having no owner).
fn only_ours(
    event: Result<watcher::Event<Pod>, watcher::Error>,
) -> Option<Result<watcher::Event<Pod>, watcher::Error>> {
    use watcher::Event;
    match event {
        Ok(Event::Apply(pod)) if owning_job(&pod).is_none() => Some(Ok(Event::Delete(pod))),
        Ok(Event::InitApply(pod)) if owning_job(&pod).is_none() => None,
        other => Some(other),
    }
}

/// Every node: the inventory's devices and allocatable memory.
fn watch_nodes(client: &Client) -> (Store<Node>, impl Future<Output = ()> + use<>) {
    let (nodes, node_writer) = reflector::store();
    let node_watch = watcher(Api::<Node>::all(client.clone()), watcher::Config::default())
        .default_backoff()
        .reflect(node_writer)
        .for_each(|_| std::future::ready(()));
    (nodes, node_watch)
}

/// GPUs held by any pod, not only ours, are not free. Terminal pods are
/// filtered by the API server, pods without devices dropped here (device
/// requests are immutable) and the rest trimmed to what the inventory
/// reads, so the cache stays small on a big cluster.
fn watch_device_pods(client: &Client) -> (Store<Pod>, impl Future<Output = ()> + use<>) {
    let (device_pods, device_writer) = reflector::store();
    let device_watch = watcher(
        Api::<Pod>::all(client.clone()),
        watcher::Config::default().fields("status.phase!=Succeeded,status.phase!=Failed"),
    )
    .default_backoff()
    .filter(|event| {
        std::future::ready(match event {
            Ok(watcher::Event::Apply(pod) | watcher::Event::InitApply(pod)) => {
                crate::inventory::holds_devices(pod)
            }
            _ => true,
        })
    })
    .modify(crate::inventory::keep_device_facts)
    .reflect(device_writer)
    .for_each(|_| std::future::ready(()));
    (device_pods, device_watch)
}

/// Claims by metadata only (name, owner, annotations: whose checkpoints
/// they hold), every claim in scope and not just labelled ones: a launch
/// reads here whether its checkpoint claim is missing, this job's, or
/// someone else's, and creates its pods in the same round as the claim
/// instead of after it. (`Api<PartialObjectMeta<_>>` lists and watches
/// with metadata-only requests.)
fn watch_claims(
    claim_api: Api<PartialObjectMeta<PersistentVolumeClaim>>,
) -> (
    Store<PartialObjectMeta<PersistentVolumeClaim>>,
    impl Future<Output = ()>,
) {
    let (claims, claim_writer) = reflector::store();
    let claim_watch = watcher(claim_api, watcher::Config::default())
        .default_backoff()
        .modify(keep_what_claim_checks_read)
        .reflect(claim_writer)
        .for_each(|_| std::future::ready(()));
    (claims, claim_watch)
}

/// Watches the jobs and reconciles each on a change of it or of one of its
/// pods (`pod_events`), until `shutdown`.
async fn reconcile_jobs(
    jobs: Api<DeserializeGuard<MemoryAwareTrainingJob>>,
    pod_events: UnboundedReceiver<Arc<Pod>>,
    reports: Arc<WorkerReports>,
    config: &ControllerConfig,
    ctx: Arc<Context>,
    shutdown: impl Future<Output = ()> + Send + Sync + 'static,
) {
    let (job_store, job_writer) = reflector::store();
    ctx.metrics.count_jobs(job_store.clone());
    let job_triggers = watcher(jobs, watcher::Config::default())
        .default_backoff()
        .modify(forget_managed_fields)
        .reflect(job_writer)
        .inspect(move |event| {
            // A deleted job's held telemetry and its workers' series go with it.
            if let Ok(watcher::Event::Delete(job)) = event
                && let Some(uid) = job.uid()
            {
                reports.close(&uid);
            }
        })
        .applied_objects();
    // The model cache's collector runs beside the controller, and stops with it.
    let collector = super::model_cache::collect_idle_caches(ctx.clone(), job_store.clone());
    let controller = Controller::for_stream(job_triggers, job_store)
        .owns_shared_stream(pod_events)
        .with_config(kube::runtime::controller::Config::default().concurrency(config.concurrency))
        .graceful_shutdown_on(shutdown)
        .run(reconcile, error_policy, ctx)
        .for_each(|result| async move {
            if let Err(e) = result {
                tracing::debug!(error = %e, "reconcile trigger failed");
            }
        });
    tokio::select! {
        () = controller => {}
        () = collector => {}
    }
}

/// Field ownership is the API server's bookkeeping: nothing here reads it,
/// and in memory (`fieldsV1` as a JSON tree) it outweighs the rest of a
/// cached job or pod. Dropped before caching; with 1,000 jobs the operator
/// stays under 100 MiB (docs/benchmarks.md).
fn forget_managed_fields(object: &mut impl ResourceExt) {
    object.managed_fields_mut().clear();
}

/// A claim as the cache keeps it: its name, owners and the job-uid
/// annotation, all that `claim_belongs_to` reads. Claims are anyone's in the
/// namespace, and their other labels and annotations are theirs to make as
/// large as the API server allows.
fn keep_what_claim_checks_read(claim: &mut PartialObjectMeta<PersistentVolumeClaim>) {
    forget_managed_fields(claim);
    // A model cache claim's labels and annotations are its state.
    if super::pods::is_cache_claim(claim) {
        if let Some(annotations) = claim.metadata.annotations.as_mut() {
            annotations.retain(|key, _| key.starts_with("headroom.dev/cache-"));
        }
        return;
    }
    claim.metadata.labels = None;
    if let Some(annotations) = claim.metadata.annotations.as_mut() {
        annotations.retain(|key, _| key == headroom_api::ANNOTATION_JOB_UID);
    }
}

/// A job pod as the cache keeps it: what the decisions read (metadata, the
/// node and Kueue's scheduling gates, each container's name and its
/// `HEADROOM_PLAN` assignment, the whole status) and nothing else. A worker
/// pod's spec (volumes, security context, probes, resources, affinity, the
/// other variables) is most of its size, and with thousands of workers the
/// pod cache is most of the operator's memory.
fn keep_what_decisions_read(pod: &mut Pod) {
    use k8s_openapi::api::core::v1::{Container, PodSpec};
    forget_managed_fields(pod);
    // No decision reads a pod's annotations (the operator writes some at
    // creation, for Kueue), and anyone's may be large.
    pod.metadata.annotations = None;
    pod.spec = pod.spec.take().map(|spec| PodSpec {
        node_name: spec.node_name,
        scheduling_gates: spec.scheduling_gates,
        containers: spec
            .containers
            .into_iter()
            .map(|c| Container {
                name: c.name,
                env: c.env.map(|env| {
                    env.into_iter()
                        .filter(|e| e.name == headroom_api::PLAN_JSON_ENV)
                        .collect()
                }),
                ..Container::default()
            })
            .collect(),
        ..PodSpec::default()
    });
}

#[cfg(test)]
mod tests {
    use headroom_api::{PLAN_JSON_ENV, WorkerAssignment};

    use super::{keep_what_claim_checks_read, keep_what_decisions_read, only_ours};
    use crate::controller::config::ChildConfig;
    use crate::controller::pods::tests::{cpu_job, first_plan};
    use crate::controller::pods::{Slot, worker_pod};

    /// The first worker of the CPU sample's first attempt, as the operator
    /// makes it.
    fn a_worker_pod() -> k8s_openapi::api::core::v1::Pod {
        let job = cpu_job();
        let plan = first_plan(&job.spec);
        let model = job.spec.job_request().expect("valid").model;
        let slot = Slot {
            stage: 0,
            replica: 0,
        };
        worker_pod(
            &job,
            &crate::controller::decide::Launch::of(&job, 1, &model, "w:1"),
            slot,
            &plan,
            &ChildConfig::default(),
        )
        .expect("pod")
    }

    /// The cached pod still says which plan it runs and where it stands,
    /// at a fraction of the size.
    #[test]
    fn a_cached_worker_pod_keeps_its_assignment_and_status_and_little_else() {
        let plan = first_plan(&cpu_job().spec);
        let mut pod = a_worker_pod();
        pod.status = serde_json::from_value(headroom_e2e::fixtures::running()).ok();
        let full = serde_json::to_vec(&pod).expect("json").len();
        let mut cached = pod.clone();
        keep_what_decisions_read(&mut cached);
        let kept = serde_json::to_vec(&cached).expect("json").len();

        assert_eq!(cached.metadata.managed_fields.as_deref(), Some(&[][..]));
        assert_eq!(
            (
                &cached.metadata.name,
                &cached.metadata.labels,
                &cached.metadata.owner_references
            ),
            (
                &pod.metadata.name,
                &pod.metadata.labels,
                &pod.metadata.owner_references
            )
        );
        assert_eq!(cached.status, pod.status);
        let spec = cached.spec.as_ref().expect("spec");
        let env: Vec<_> = spec.containers[0].env.iter().flatten().collect();
        assert_eq!(env.len(), 1);
        assert_eq!(env[0].name, PLAN_JSON_ENV);
        let assignment: WorkerAssignment =
            serde_json::from_str(env[0].value.as_deref().expect("value")).expect("assignment");
        assert_eq!(assignment.plan, plan);
        assert!(kept * 10 < full * 8, "kept {kept} of {full} bytes");
    }

    /// A pod someone else labelled with the job label never enters the
    /// cache, and one a job stops controlling leaves it; a job's pod enters.
    #[test]
    fn only_pods_a_job_controls_enter_the_cache() {
        use k8s_openapi::api::core::v1::Pod;
        use kube::runtime::watcher::Event;
        let ours = a_worker_pod();
        let mut crafted: Pod = ours.clone();
        crafted.metadata.owner_references = None;

        assert!(matches!(
            only_ours(Ok(Event::InitApply(ours.clone()))),
            Some(Ok(Event::InitApply(_)))
        ));
        assert!(matches!(
            only_ours(Ok(Event::Apply(ours.clone()))),
            Some(Ok(Event::Apply(_)))
        ));
        assert!(only_ours(Ok(Event::InitApply(crafted.clone()))).is_none());
        assert!(matches!(
            only_ours(Ok(Event::Apply(crafted))),
            Some(Ok(Event::Delete(_)))
        ));
    }

    /// A cached pod keeps no annotations, a cached claim only the one that
    /// says whose checkpoints it holds.
    #[test]
    fn cached_pods_and_claims_keep_only_what_is_read() {
        use k8s_openapi::api::core::v1::PersistentVolumeClaim;
        use kube::core::PartialObjectMeta;
        let mut pod = a_worker_pod();
        pod.metadata
            .annotations
            .get_or_insert_default()
            .insert("big".into(), "x".repeat(100_000));
        keep_what_decisions_read(&mut pod);
        assert_eq!(pod.metadata.annotations, None);

        let mut claim: PartialObjectMeta<PersistentVolumeClaim> =
            serde_json::from_value(serde_json::json!({
                "apiVersion": "v1", "kind": "PersistentVolumeClaim",
                "metadata": {
                    "name": "job-checkpoints",
                    "labels": {"big": "x"},
                    "annotations": {headroom_api::ANNOTATION_JOB_UID: "uid-1", "big": "y"}
                }
            }))
            .expect("claim");
        keep_what_claim_checks_read(&mut claim);
        assert_eq!(claim.metadata.labels, None);
        let kept: Vec<_> = claim.metadata.annotations.iter().flatten().collect();
        assert_eq!(
            kept,
            [(
                &headroom_api::ANNOTATION_JOB_UID.to_string(),
                &"uid-1".to_string()
            )]
        );
    }
}
