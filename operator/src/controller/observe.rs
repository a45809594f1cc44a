//! The dereference step of a reconcile: everything the decision is made on,
//! read from the caches and, for a job in a Kueue queue, from Kueue's
//! objects. The only write here is the ended pods' last telemetry, which
//! must be in the status before an attempt is closed from it.

use std::borrow::Cow;
use std::sync::Arc;

use headroom_api::{
    AttemptOutcome, LABEL_JOB, LABEL_ROLE, MemoryAwareTrainingJob, ROLE_INITIALIZER,
};
use headroom_planner::Inventory;
use jiff::Timestamp;
use k8s_openapi::api::core::v1::{Node, PersistentVolumeClaim, Pod};
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::{Api, ResourceExt};

use super::classify::{PodVerdict, classify};
use super::decide::{CacheView, ClaimFacts, Observation, QueueView};
use super::pods::{CacheState, checkpoint_claim_name, shared_cache};
use super::{Context, Error};
use crate::inventory::cpu_inventory;
use crate::kueue::{self, QueueOffer};

/// What one reconcile sees of a job and the cluster around it.
pub(super) struct Observed<'a> {
    /// The job, as the telemetry flush returned it when there was one.
    pub job: Cow<'a, MemoryAwareTrainingJob>,
    /// The job's own pods (by label and owner), any attempt.
    pub pods: Vec<Arc<Pod>>,
    /// The job's Kueue queue, when it names one.
    pub queue: Option<QueueView>,
    /// What the job plans within: the nodes, less what other pods hold,
    /// capped by the queue's offer.
    pub inventory: Inventory,
    /// The job's checkpoint claim, read when an attempt found it full.
    pub claim: Option<ClaimFacts>,
    /// The job's shared model cache claim, from the claim cache.
    pub model_cache: Option<CacheView>,
}

impl Observed<'_> {
    /// The pure decision's input, over `pods` (this observation's pods, borrowed).
    pub fn observation<'a>(&'a self, ctx: &'a Context, pods: &'a [&'a Pod]) -> Observation<'a> {
        Observation {
            job: &self.job,
            pods,
            inventory: &self.inventory,
            now: Timestamp::now(),
            unschedulable_grace: ctx.config.unschedulable_grace,
            planning_budget: ctx.config.planning_budget,
            default_gpu_host_memory: ctx.config.children.gpu_host_memory_bytes(),
            default_checkpoint_bytes: ctx.config.children.checkpoint_size_bytes(),
            worker_images: &ctx.config.children.worker_images,
            queue: self.queue.as_ref(),
            claim: self.claim.as_ref(),
            model_cache: self.model_cache.as_ref(),
        }
    }
}

/// Reads what `job` (in namespace `ns`) is decided on.
pub(super) async fn observe<'a>(
    ctx: &Context,
    job: &'a MemoryAwareTrainingJob,
    ns: &str,
) -> Result<Observed<'a>, Error> {
    let pods = own_pods(ctx, job, ns);
    let job = with_ended_pods_telemetry(ctx, job, &pods).await?;
    // A job in a Kueue queue plans within what the queue offers, and its
    // waiting message is Kueue's (crate::kueue).
    let (offer, queue) = match kueue::queue_name(&job) {
        Some(local) => {
            let (offer, view) = read_queue(ctx, ns, local, &pods).await;
            (offer, Some(view))
        }
        None => (None, None),
    };
    let inventory = inventory(ctx, &job, offer.as_ref());
    let model_cache = model_cache(ctx, &job, ns);
    let claim = if found_disk_full(&job, &pods) || claim_made_before_plan(&job, &pods) {
        // A filler's initializer downloads the model onto the cache claim.
        let name = model_cache
            .as_ref()
            .filter(|v| {
                matches!(&v.state, CacheState::Filling { filler: Some((uid, _)) }
                    if Some(uid) == job.metadata.uid.as_ref())
            })
            .map_or_else(|| checkpoint_claim_name(&job), |v| v.claim.clone());
        Some(read_claim(ctx, &name, ns).await)
    } else {
        None
    };
    Ok(Observed {
        job,
        pods,
        queue,
        inventory,
        claim,
        model_cache,
    })
}

/// The shared model cache claim `job` reads (`status.modelCache`), or, before
/// its first initializer, would read (its spec and the operator's
/// `modelCache.enabled`), as the claim cache shows it.
fn model_cache(ctx: &Context, job: &MemoryAwareTrainingJob, ns: &str) -> Option<CacheView> {
    let status = job.status.as_ref();
    let claim = match status.and_then(|s| s.model_cache.clone()) {
        Some(claim) => claim,
        None if status.is_none_or(|s| s.initializations.unwrap_or(0) == 0) => {
            shared_cache(job, ctx.config.children.model_cache.enabled)?
        }
        None => return None,
    };
    let found = ctx
        .claims
        .get(&kube::runtime::reflector::ObjectRef::new(&claim).within(ns));
    Some(CacheView {
        state: CacheState::of(found.as_deref()),
        resource_version: found.as_ref().and_then(|c| c.resource_version()),
        claim,
    })
}

/// Whether an attempt of `job` found its checkpoint volume full: a pod
/// says so now, or the status recorded it (its retry is still to start).
fn found_disk_full(job: &MemoryAwareTrainingJob, pods: &[Arc<Pod>]) -> bool {
    let recorded = job
        .status
        .as_ref()
        .and_then(|s| s.attempts.last())
        .is_some_and(|a| a.outcome == AttemptOutcome::DiskFull);
    recorded
        || pods.iter().any(|p| {
            matches!(classify(p), PodVerdict::Failed(f) if f.outcome == AttemptOutcome::DiskFull)
        })
}

/// Whether `job` is about to plan its first attempt on a claim its
/// initializer made before the plan, at the default size (a pretrained
/// model's job without `spec.checkpoints.size`): the plan may need it grown.
fn claim_made_before_plan(job: &MemoryAwareTrainingJob, pods: &[Arc<Pod>]) -> bool {
    let spec = &job.spec;
    let status = job.status.as_ref();
    let initialized = status.is_some_and(|s| s.model.is_some())
        || pods.iter().any(|p| {
            p.labels().get(LABEL_ROLE).map(String::as_str) == Some(ROLE_INITIALIZER)
                && matches!(classify(p), PodVerdict::Succeeded)
        });
    spec.model.pretrained.is_some()
        && spec.checkpoints.size.is_none()
        && status.is_none_or(|s| s.attempts.is_empty())
        && initialized
}

/// The job's checkpoint claim's size and whether its StorageClass may
/// grow it; what cannot be read is left unknown (the decision then names
/// the setting to change instead of growing the claim).
async fn read_claim(ctx: &Context, name: &str, ns: &str) -> ClaimFacts {
    let name = name.to_string();
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(ctx.client.clone(), ns);
    let claim = match claims.get_opt(&name).await {
        Ok(claim) => claim,
        Err(error) => {
            tracing::warn!(%error, claim = name, "could not read the checkpoint claim");
            None
        }
    };
    let Some(claim) = claim else {
        return ClaimFacts::default();
    };
    let storage = |q: Option<&std::collections::BTreeMap<String, Quantity>>| {
        q.and_then(|m| m.get("storage"))
            .and_then(|q| headroom_api::quantity::parse_bytes(&q.0).ok())
    };
    let spec = claim.spec.as_ref();
    let requested = storage(
        spec.and_then(|s| s.resources.as_ref())
            .and_then(|r| r.requests.as_ref()),
    );
    let capacity = storage(claim.status.as_ref().and_then(|s| s.capacity.as_ref()));
    let storage_class = spec.and_then(|s| s.storage_class_name.clone());
    let expandable = match &storage_class {
        Some(class) => match Api::<StorageClass>::all(ctx.client.clone())
            .get_opt(class)
            .await
        {
            Ok(found) => found.map(|c| c.allow_volume_expansion.unwrap_or(false)),
            Err(error) => {
                tracing::warn!(%error, class, "could not read the checkpoint claim's StorageClass");
                None
            }
        },
        None => None,
    };
    ClaimFacts {
        size_bytes: requested.or(capacity),
        storage_class,
        expandable,
    }
}

/// The pods of `job` in the pod cache: labelled with its name and owned by
/// this very job (not an earlier one of the same name).
fn own_pods(ctx: &Context, job: &MemoryAwareTrainingJob, ns: &str) -> Vec<Arc<Pod>> {
    let name = job.name_any();
    let uid = job.uid();
    ctx.pods
        .state()
        .into_iter()
        .filter(|p| {
            p.namespace().as_deref() == Some(ns) && p.labels().get(LABEL_JOB) == Some(&name)
        })
        .filter(|p| {
            p.owner_references()
                .iter()
                .any(|o| Some(&o.uid) == uid.as_ref())
        })
        .collect()
}

/// `job` with what the workers of its ended pods reported last. A pod that
/// ended cannot report again (after an OOM kill or an eviction), so its
/// last report goes into the status before the attempt is closed from it
/// (`crate::worker_reports`), and the decision is made on the job that
/// write returned.
async fn with_ended_pods_telemetry<'a>(
    ctx: &Context,
    job: &'a MemoryAwareTrainingJob,
    own: &[Arc<Pod>],
) -> Result<Cow<'a, MemoryAwareTrainingJob>, Error> {
    let ended: Vec<String> = own
        .iter()
        .filter(|p| has_ended(p))
        .map(|p| p.name_any())
        .collect();
    let Some(uid) = job.uid().filter(|_| !ended.is_empty()) else {
        return Ok(Cow::Borrowed(job));
    };
    let written = ctx
        .reports
        .flush(&ctx.client, &uid, &ended)
        .await
        .map_err(|source| Error::FlushTelemetry {
            job: job.name_any(),
            source,
        })?;
    let mut job = Cow::Borrowed(job);
    if let Some(mut written) = written {
        written.managed_fields_mut().clear();
        ctx.wrote(&job, &written);
        job = Cow::Owned(written);
    }
    // A write of the flusher's that the job cache does not show yet.
    if let Some(newer) = ctx.reports.overlay(&job, &ended) {
        job = Cow::Owned(newer);
    }
    Ok(job)
}

/// Whether a pod's worker can no longer report: its container ended, or
/// the pod is being deleted.
fn has_ended(pod: &Pod) -> bool {
    pod.metadata.deletion_timestamp.is_some()
        || matches!(classify(pod), PodVerdict::Succeeded | PodVerdict::Failed(_))
}

/// LocalQueue `local`'s offer (None when it cannot be read) and the queue
/// as the decision shows it, with Kueue's word on why the job's gated pod
/// group waits.
async fn read_queue(
    ctx: &Context,
    ns: &str,
    local: &str,
    own: &[Arc<Pod>],
) -> (Option<QueueOffer>, QueueView) {
    let offer = ctx.queue_offers.get(&ctx.client, ns, local).await;
    let gated_group = own
        .iter()
        .filter(|p| kueue::is_gated(p))
        .find_map(|p| p.labels().get(kueue::LABEL_POD_GROUP).cloned());
    let waiting = match &gated_group {
        Some(group) => kueue::workload_wait(&ctx.client, ns, group).await,
        None => None,
    };
    let view = match &offer {
        Ok(o) => QueueView {
            queue: o.describe(),
            waiting,
        },
        // Planned without the queue's limits; Kueue still gates the pods.
        Err(why) => {
            tracing::warn!(queue = local, %why, "cannot read the job's Kueue queue");
            QueueView {
                queue: format!("LocalQueue {local}"),
                waiting: waiting.or_else(|| Some(why.clone())),
            }
        }
    };
    (offer.ok(), view)
}

/// What `job` plans within: the cached nodes' devices (a GPU job) or
/// worker slots (a CPU job), within the queue's `offer` when it has one.
fn inventory(ctx: &Context, job: &MemoryAwareTrainingJob, offer: Option<&QueueOffer>) -> Inventory {
    let one_node = ctx.config.children.checkpoint_access.stages_share_a_node();
    let nodes = ctx.nodes.state();
    let nodes: Vec<&Node> = nodes.iter().map(AsRef::as_ref).collect();
    if job.spec.resources.gpu.is_some() {
        let device_pods = ctx.device_pods.state();
        let device_pods: Vec<&Pod> = device_pods.iter().map(AsRef::as_ref).collect();
        kueue::gpu_inventory_within(job, &nodes, &device_pods, offer, one_node)
    } else {
        let by_nodes = cpu_inventory(job, nodes.iter().copied(), one_node);
        kueue::cpu_inventory_within(job, by_nodes, offer)
    }
}
