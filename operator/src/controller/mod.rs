//! The MemoryAwareTrainingJob controller: watches jobs, their pods (one
//! reflector that also triggers reconciles) and nodes (the GPU inventory);
//! each reconcile is dereference → decide (pure, `decide.rs`) → apply.

pub mod children;
pub mod classify;
pub mod decide;

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use headroom_api::{LABEL_JOB, MemoryAwareTrainingJob, OPERATOR_FIELD_MANAGER};
use headroom_planner::Inventory;
use jiff::Timestamp;
use k8s_openapi::api::core::v1::{Node, PersistentVolumeClaim, Pod, Service, ServiceAccount};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::core::DeserializeGuard;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::inventory::job_inventory;
use crate::metrics::{ErrorLabels, Metrics, OutcomeLabels};
use children::ChildConfig;
use decide::{Decision, Observation, decide};

/// Reconcile failures, each with a short label for metrics.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("serialising a child object: {0}")]
    Serialize(#[from] serde_json::Error),
    #[error("job has no namespace")]
    NoNamespace,
}

impl Error {
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::Kube(kube::Error::Api(e)) if e.code == 409 => "conflict",
            Error::Kube(_) => "kube",
            Error::Serialize(_) => "serialize",
            Error::NoNamespace => "no_namespace",
        }
    }
}

/// Controller settings (flags / Helm values).
#[derive(Clone, Debug)]
pub struct ControllerConfig {
    pub children: ChildConfig,
    pub unschedulable_grace: Duration,
    /// Re-check every job at least this often.
    pub resync: Duration,
    pub concurrency: u16,
    /// Watch only this namespace (all namespaces when None).
    pub namespace: Option<String>,
}

impl Default for ControllerConfig {
    fn default() -> Self {
        ControllerConfig {
            children: ChildConfig::default(),
            unschedulable_grace: Duration::from_secs(120),
            resync: Duration::from_secs(300),
            concurrency: 8,
            namespace: None,
        }
    }
}

/// Shared state of every reconcile.
pub struct Context {
    pub client: Client,
    pub pods: Store<Pod>,
    pub nodes: Store<Node>,
    /// Every pod in the cluster that holds GPUs, Headroom's or not, trimmed
    /// to its node and device requests: the inventory's in-use counts.
    pub device_pods: Store<Pod>,
    pub recorder: Recorder,
    pub metrics: Arc<Metrics>,
    pub config: ControllerConfig,
    /// Attempts whose pods were just created but may not be in the pod cache
    /// yet (job uid, attempt) → when. Without it, the reconcile triggered by
    /// our own status write would create the same children a second time.
    launched: std::sync::Mutex<std::collections::HashMap<(String, u32), Instant>>,
}

/// How long a fresh launch is trusted to show up in the pod cache.
const LAUNCH_EXPECTATION: Duration = Duration::from_secs(10);

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// Runs the controller until `shutdown` resolves; returns after in-flight reconciles finish.
pub async fn run(
    client: Client,
    metrics: Arc<Metrics>,
    config: ControllerConfig,
    identity: &str,
    shutdown: impl Future<Output = ()> + Send + Sync + 'static,
) {
    // Jobs are read through DeserializeGuard: one object that fails to parse
    // (e.g. status written by a mismatched worker) must not stall the others.
    let scoped = |client: &Client| -> (Api<DeserializeGuard<MemoryAwareTrainingJob>>, Api<Pod>) {
        match &config.namespace {
            Some(ns) => (
                Api::namespaced(client.clone(), ns),
                Api::namespaced(client.clone(), ns),
            ),
            None => (Api::all(client.clone()), Api::all(client.clone())),
        }
    };
    let (jobs, pod_api) = scoped(&client);

    // Pods carrying our job label, watched once: the reflector's store is read
    // in reconcile, and every pod it applies or deletes is forwarded as the
    // "owns" trigger of its job. Not kube-runtime's shared store
    // (`store_shared` + `subscribe`): its handle never yields deletions, and
    // when a pod is deleted before the handle reads it, returns Pending
    // without a waker; from then on no pod event triggers a reconcile, and
    // once its 1024-event buffer fills the pod cache stops too.
    let (pods, pod_writer) = reflector::store();
    let (pod_tx, pod_events) = futures::channel::mpsc::unbounded::<Arc<Pod>>();
    let pod_watch = watcher(pod_api, watcher::Config::default().labels(LABEL_JOB))
        .default_backoff()
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

    let (nodes, node_writer) = reflector::store();
    let node_watch = watcher(Api::<Node>::all(client.clone()), watcher::Config::default())
        .default_backoff()
        .reflect(node_writer)
        .for_each(|_| std::future::ready(()));

    // GPUs held by any pod, not only ours, are not free. Terminal pods are
    // filtered by the API server, pods without devices dropped here (device
    // requests are immutable) and the rest trimmed to what the inventory
    // reads, so the cache stays small on a big cluster.
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

    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: "headroom-operator".into(),
            instance: Some(identity.into()),
        },
    );
    let ctx = Arc::new(Context {
        client,
        pods: pods.clone(),
        nodes: nodes.clone(),
        device_pods: device_pods.clone(),
        recorder,
        metrics: metrics.clone(),
        config: config.clone(),
        launched: Default::default(),
    });

    // Reconciling before the caches are complete would plan against a partial
    // inventory (or recreate pods it cannot see yet): drive the reflectors
    // first, and start the controller only once both stores are ready.
    let watches = async {
        tokio::select! {
            _ = pod_watch => tracing::warn!("pod watch ended"),
            _ = node_watch => tracing::warn!("node watch ended"),
            _ = device_watch => tracing::warn!("device pod watch ended"),
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
            } => {
                if ready.is_err() {
                    return;
                }
            }
            _ = shutdown.clone() => return,
        }
        metrics.set_ready(true);
        tracing::info!("caches synced; reconciling");
        Controller::new(jobs, watcher::Config::default())
            .owns_shared_stream(pod_events)
            .with_config(
                kube::runtime::controller::Config::default().concurrency(config.concurrency),
            )
            .graceful_shutdown_on(shutdown)
            .run(reconcile, error_policy, ctx)
            .for_each(|result| async move {
                if let Err(e) = result {
                    tracing::debug!(error = %e, "reconcile trigger failed");
                }
            })
            .await;
        tracing::info!("controller stopped");
    };
    tokio::select! {
        _ = controlled => {}
        _ = watches => {}
    }
}

fn error_policy(
    _job: Arc<DeserializeGuard<MemoryAwareTrainingJob>>,
    error: &Error,
    ctx: Arc<Context>,
) -> Action {
    ctx.metrics
        .reconcile_errors
        .get_or_create(&ErrorLabels {
            error: error.metric_label().into(),
        })
        .inc();
    match error {
        // A stale read lost a race with a newer write: the watch brings the new version.
        Error::Kube(kube::Error::Api(e)) if e.code == 409 => {
            Action::requeue(Duration::from_millis(500))
        }
        _ => {
            tracing::warn!(%error, "reconcile failed");
            Action::requeue(Duration::from_secs(5))
        }
    }
}

async fn reconcile(
    guard: Arc<DeserializeGuard<MemoryAwareTrainingJob>>,
    ctx: Arc<Context>,
) -> Result<Action, Error> {
    ctx.metrics.reconciles.inc();
    match &guard.0 {
        Ok(job) => reconcile_job(job, &ctx).await,
        Err(invalid) => {
            // Nothing sensible can be done until someone fixes the object; its next change retriggers us.
            ctx.metrics
                .reconcile_errors
                .get_or_create(&ErrorLabels {
                    error: "invalid_object".into(),
                })
                .inc();
            tracing::warn!(job = invalid.metadata.name.as_deref().unwrap_or(""), error = %invalid.error, "cannot read job; waiting for a change");
            Ok(Action::await_change())
        }
    }
}

#[tracing::instrument(skip_all, fields(job = %job.name_any(), ns = job.namespace().unwrap_or_default()))]
async fn reconcile_job(job: &MemoryAwareTrainingJob, ctx: &Context) -> Result<Action, Error> {
    let ns = job.namespace().ok_or(Error::NoNamespace)?;
    let name = job.name_any();
    let uid = job.uid();

    // Dereference: this job's pods, and the GPU inventory for GPU jobs.
    let all_pods = ctx.pods.state();
    let own: Vec<&Pod> = all_pods
        .iter()
        .map(AsRef::as_ref)
        .filter(|p: &&Pod| {
            p.namespace().as_deref() == Some(ns.as_str())
                && p.labels().get(LABEL_JOB) == Some(&name)
        })
        .filter(|p| {
            p.owner_references()
                .iter()
                .any(|o| Some(&o.uid) == uid.as_ref())
        })
        .collect();
    let inventory = if job.spec.resources.gpu.is_some() {
        let nodes = ctx.nodes.state();
        let device_pods = ctx.device_pods.state();
        job_inventory(
            job,
            nodes.iter().map(AsRef::as_ref),
            device_pods.iter().map(AsRef::as_ref),
            ctx.config.children.checkpoint_access.stages_share_a_node(),
        )
    } else {
        Inventory::default()
    };

    // Decide (pure).
    let started = Instant::now();
    let decision = decide(&Observation {
        job,
        pods: &own,
        inventory: &inventory,
        now: Timestamp::now(),
        unschedulable_grace: ctx.config.unschedulable_grace,
    });
    ctx.metrics
        .planning_seconds
        .observe(started.elapsed().as_secs_f64());

    // Apply: status first (so a crash never loses an attempt), then events, pods.
    apply_status(&ctx.client, job, &decision).await?;
    if let Some(outcome) = decision.ended {
        ctx.metrics
            .attempts
            .get_or_create(&OutcomeLabels {
                outcome: format!("{outcome:?}"),
            })
            .inc();
    }
    // Events are best effort and must not slow the job down: record them off the reconcile path.
    if !decision.events.is_empty() {
        let recorder = ctx.recorder.clone();
        let reference = job.object_ref(&());
        let events = decision.events.clone();
        tokio::spawn(async move {
            for e in events {
                let event = Event {
                    type_: if e.warning {
                        EventType::Warning
                    } else {
                        EventType::Normal
                    },
                    reason: e.reason.into(),
                    note: Some(e.note),
                    action: "Reconcile".into(),
                    secondary: None,
                };
                if let Err(err) = recorder.publish(&event, &reference).await {
                    tracing::warn!(%err, reason = e.reason, "could not record event");
                }
            }
        });
    }
    let pod_api: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
    for pod in &decision.delete_pods {
        match pod_api.delete(pod, &DeleteParams::default()).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => return Err(e.into()),
        }
    }
    if let Some(attempt) = decision.launch
        && let Err(error) = ensure_children(ctx, job, &decision, attempt, &own).await
    {
        // A refusal the user can act on (admission: a missing PriorityClass,
        // a pod security violation, an invalid field) goes where they look,
        // on the job, not only into the operator's log. The reconcile is
        // retried, so fixing the cause lets the attempt start.
        if let Error::Kube(kube::Error::Api(e)) = &error
            && matches!(e.code, 400 | 403 | 422)
        {
            let event = Event {
                type_: EventType::Warning,
                reason: "LaunchRefused".into(),
                note: Some(format!(
                    "attempt {attempt}: the API server refused the workers: {}",
                    e.message
                )),
                action: "Launch".into(),
                secondary: None,
            };
            if let Err(err) = ctx.recorder.publish(&event, &job.object_ref(&())).await {
                tracing::warn!(%err, "could not record event");
            }
        }
        return Err(error);
    }
    Ok(Action::requeue(
        decision
            .requeue_after
            .unwrap_or(ctx.config.resync)
            .min(ctx.config.resync),
    ))
}

/// Server-side applies the operator-owned status, guarded by the resourceVersion we decided on.
async fn apply_status(
    client: &Client,
    job: &MemoryAwareTrainingJob,
    decision: &Decision,
) -> Result<(), Error> {
    let mut status = decision.status.clone();
    let current = job.status.clone().unwrap_or_default();
    status.workers = current.workers.clone();
    if status == current {
        return Ok(());
    }
    // Telemetry entries belong to the workers' field managers; leave them out.
    status.workers.clear();
    let api: Api<MemoryAwareTrainingJob> =
        Api::namespaced(client.clone(), &job.namespace().unwrap_or_default());
    let patch = serde_json::json!({
        "apiVersion": MemoryAwareTrainingJob::api_version(&()),
        "kind": MemoryAwareTrainingJob::kind(&()),
        "metadata": {"name": job.name_any(), "resourceVersion": job.resource_version()},
        "status": status,
    });
    api.patch_status(
        &job.name_any(),
        &PatchParams::apply(OPERATOR_FIELD_MANAGER).force(),
        &Patch::Apply(&patch),
    )
    .await?;
    Ok(())
}

async fn apply<K>(client: &Client, ns: &str, object: &K) -> Result<(), Error>
where
    K: Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>
        + Clone
        + DeserializeOwned
        + Serialize
        + std::fmt::Debug,
{
    let api: Api<K> = Api::namespaced(client.clone(), ns);
    let mut value = serde_json::to_value(object)?;
    value["apiVersion"] = serde_json::Value::String(K::api_version(&()).into_owned());
    value["kind"] = serde_json::Value::String(K::kind(&()).into_owned());
    api.patch(
        &object.name_any(),
        &PatchParams::apply(OPERATOR_FIELD_MANAGER).force(),
        &Patch::Apply(&value),
    )
    .await?;
    Ok(())
}

/// Creates whatever the attempt still lacks; a no-op once all its pods exist.
async fn ensure_children(
    ctx: &Context,
    job: &MemoryAwareTrainingJob,
    decision: &Decision,
    attempt: u32,
    own: &[&Pod],
) -> Result<(), Error> {
    let Some(plan) = decision
        .status
        .attempts
        .iter()
        .find(|a| a.number == attempt)
        .map(|a| &a.plan)
    else {
        return Ok(());
    };
    let existing: Vec<String> = own.iter().map(|p| p.name_any()).collect();
    let missing: Vec<u32> = (0..plan.workers)
        .filter(|&stage| !existing.contains(&children::pod_name(job, attempt, stage)))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    let key = (job.uid().unwrap_or_default(), attempt);
    let recently = ctx
        .launched
        .lock()
        .ok()
        .and_then(|m| m.get(&key).copied())
        .is_some_and(|at| at.elapsed() < LAUNCH_EXPECTATION);
    if recently {
        return Ok(()); // created moments ago; the pod cache has not caught up yet
    }
    let ns = job.namespace().unwrap_or_default();
    let cfg = &ctx.config.children;
    let c = &ctx.client;
    let (sa, role, rb, pvc, svc) = (
        children::service_account(job),
        children::role(job),
        children::role_binding(job),
        children::checkpoint_claim(job, cfg),
        children::headless_service(job),
    );
    let pods = missing
        .iter()
        .map(|&stage| children::worker_pod(job, attempt, stage, plan, cfg))
        .collect::<Result<Vec<_>, _>>()?;
    // Order matters twice: a RoleBinding to a Role that does not exist yet is
    // refused (RBAC's escalation check must resolve the Role), and a pod
    // naming a missing ServiceAccount is refused by admission. So: account,
    // Role, claim and Service together; then the binding; then the pods.
    futures::try_join!(
        apply::<ServiceAccount>(c, &ns, &sa),
        apply::<Role>(c, &ns, &role),
        apply_claim(c, &ns, &pvc),
        async {
            if plan.workers > 1 {
                apply::<Service>(c, &ns, &svc).await
            } else {
                Ok(())
            }
        },
    )?;
    apply::<RoleBinding>(c, &ns, &rb).await?;
    futures::future::try_join_all(pods.iter().map(|pod| apply::<Pod>(c, &ns, pod))).await?;
    if let Ok(mut m) = ctx.launched.lock() {
        m.retain(|_, at| at.elapsed() < LAUNCH_EXPECTATION);
        m.insert(key, Instant::now());
    }
    Ok(())
}

/// A PVC's spec is immutable once bound: create it once, never re-apply.
async fn apply_claim(
    client: &Client,
    ns: &str,
    claim: &PersistentVolumeClaim,
) -> Result<(), Error> {
    let api: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), ns);
    match api
        .create(
            &PostParams {
                field_manager: Some(OPERATOR_FIELD_MANAGER.into()),
                ..PostParams::default()
            },
            claim,
        )
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(()), // already there: keep it as it is
        Err(e) => Err(e.into()),
    }
}
