//! The apply step: everything reconcile writes to the API server. Each write
//! fails with an [`Error`] naming its step and object.

use std::time::Instant;

use headroom_api::{MemoryAwareTrainingJob, MemoryAwareTrainingJobStatus, OPERATOR_FIELD_MANAGER};
use headroom_planner::ModelShape;
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod, Service};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::events::{Event, EventType};
use kube::{Client, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::decide::Decision;
use super::lifecycle::JobEvent;
use super::{Context, Error, LAUNCH_EXPECTATION, children};

/// Server-side applies the operator-owned status, guarded by the resourceVersion
/// we decided on. Returns the job as written (None when nothing changed), for
/// a second write in the same reconcile.
pub(super) async fn apply_status(
    client: &Client,
    job: &MemoryAwareTrainingJob,
    decision: &Decision,
) -> Result<Option<MemoryAwareTrainingJob>, Error> {
    let mut status = decision.status.clone();
    let current = job.status.clone().unwrap_or_default();
    status.workers = current.workers.clone();
    if status == current {
        return Ok(None);
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
    .await
    .map(Some)
    .map_err(|source| Error::ApplyStatus {
        job: job.name_any(),
        source,
    })
}

/// Removes the telemetry entries of earlier attempts from `status.workers`
/// (documented as the current attempt's). What they said is already folded
/// into that attempt's history (`observedPeakBytes`, `lastStep`) when it ended.
/// The entries belong to the workers' field managers, so the operator's apply
/// cannot drop them: a merge patch writes the list without them, guarded by
/// the resourceVersion `job` was read at, so a concurrent telemetry write
/// makes it fail (409) rather than lose that write; the next reconcile tries
/// again. Returns the job as written, when it wrote.
pub(super) async fn prune_telemetry(
    client: &Client,
    job: &MemoryAwareTrainingJob,
    current_attempt: Option<u32>,
) -> Result<Option<MemoryAwareTrainingJob>, Error> {
    let Some(current) = current_attempt else {
        return Ok(None);
    };
    let workers = job.status.as_ref().map(|s| &s.workers[..]).unwrap_or(&[]);
    if workers.iter().all(|w| w.attempt >= current) {
        return Ok(None);
    }
    let kept: Vec<_> = workers.iter().filter(|w| w.attempt >= current).collect();
    let patch = serde_json::json!({
        "metadata": {"resourceVersion": job.resource_version()},
        "status": {"workers": kept},
    });
    let api: Api<MemoryAwareTrainingJob> =
        Api::namespaced(client.clone(), &job.namespace().unwrap_or_default());
    match api
        .patch_status(
            &job.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
    {
        Ok(written) => Ok(Some(written)),
        // A telemetry write came first: the watch brings it, and us back.
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(None),
        Err(source) => Err(Error::ApplyStatus {
            job: job.name_any(),
            source,
        }),
    }
}

/// Records events on the job. Best effort and off the reconcile path: an
/// event must never slow a job down or fail its reconcile.
pub(super) fn publish_events(ctx: &Context, job: &MemoryAwareTrainingJob, events: Vec<JobEvent>) {
    if events.is_empty() {
        return;
    }
    let recorder = ctx.recorder.clone();
    let reference = job.object_ref(&());
    tokio::spawn(async move {
        for e in events {
            let event = Event {
                type_: if e.warning {
                    EventType::Warning
                } else {
                    EventType::Normal
                },
                reason: e.reason.as_str().into(),
                note: Some(e.note),
                action: "Reconcile".into(),
                secondary: None,
            };
            if let Err(err) = recorder.publish(&event, &reference).await {
                tracing::warn!(%err, reason = e.reason.as_str(), "could not record event");
            }
        }
    });
}

/// Deletes one worker pod; one that is already gone is fine.
pub(super) async fn delete_worker(client: &Client, ns: &str, pod: &str) -> Result<(), Error> {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    match api.delete(pod, &DeleteParams::default()).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
        Err(source) => Err(Error::DeleteWorker {
            pod: pod.to_string(),
            source,
        }),
    }
}

/// What the operator writes as a job's child: a namespaced object it can
/// serialize for a create or an apply.
trait Child:
    Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>
    + Clone
    + DeserializeOwned
    + Serialize
    + std::fmt::Debug
{
}

impl<K> Child for K where
    K: Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>
        + Clone
        + DeserializeOwned
        + Serialize
        + std::fmt::Debug
{
}

/// Server-side applies one child under the operator's field manager.
async fn apply<K: Child>(client: &Client, ns: &str, object: &K) -> Result<(), Error> {
    let kind = K::kind(&()).into_owned();
    let name = object.name_any();
    let api: Api<K> = Api::namespaced(client.clone(), ns);
    let mut value = serde_json::to_value(object).map_err(|source| Error::BuildChild {
        kind: kind.clone(),
        name: name.clone(),
        source,
    })?;
    value["apiVersion"] = serde_json::Value::String(K::api_version(&()).into_owned());
    value["kind"] = serde_json::Value::String(kind.clone());
    api.patch(
        &name,
        &PatchParams::apply(OPERATOR_FIELD_MANAGER).force(),
        &Patch::Apply(&value),
    )
    .await
    .map_err(|source| Error::ApplyChild { kind, name, source })?;
    Ok(())
}

/// Writes one child of a launch. With `create_first` (the job's first
/// launch, where nothing of it can exist yet, and every new pod) it is a POST
/// under the operator's field manager, server-side applied instead when it
/// exists already (409). A create is the cheaper request for an object that
/// does not exist: the API server skips the apply merge and its managed-fields
/// bookkeeping, which for a pod is a large part of the write. Otherwise it is
/// applied (the Service of an earlier attempt exists).
async fn put<K: Child>(
    client: &Client,
    ns: &str,
    object: &K,
    create_first: bool,
) -> Result<(), Error> {
    if !create_first {
        return apply(client, ns, object).await;
    }
    let api: Api<K> = Api::namespaced(client.clone(), ns);
    let params = PostParams {
        field_manager: Some(OPERATOR_FIELD_MANAGER.into()),
        ..PostParams::default()
    };
    match api.create(&params, object).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 409 => apply(client, ns, object).await,
        Err(source) => Err(Error::ApplyChild {
            kind: K::kind(&()).into_owned(),
            name: object.name_any(),
            source,
        }),
    }
}

/// The workers attempt `attempt` still lacks, with its plan; None once all
/// its pods exist, or while a launch moments ago has not reached the pod
/// cache yet.
pub(super) fn missing_workers<'a>(
    ctx: &Context,
    job: &MemoryAwareTrainingJob,
    status: &'a MemoryAwareTrainingJobStatus,
    attempt: u32,
    own: &[&Pod],
) -> Option<(&'a headroom_planner::Plan, Vec<children::Slot>)> {
    let plan = status
        .attempts
        .iter()
        .find(|a| a.number == attempt)
        .map(|a| &a.plan)?;
    let existing: Vec<String> = own.iter().map(|p| p.name_any()).collect();
    let missing: Vec<children::Slot> = children::slots(plan)
        .filter(|&slot| !existing.contains(&children::pod_name(job, attempt, plan, slot)))
        .collect();
    let key = (job.uid().unwrap_or_default(), attempt);
    (!missing.is_empty() && !ctx.launched_recently(&key)).then_some((plan, missing))
}

/// Creates the pods (and the Service) attempt `attempt` still lacks; a
/// no-op once all its pods exist. The checkpoint claim must exist and be
/// this job's first ([`ensure_claim`], in the status write's round): a pod
/// must never mount a kept claim of an earlier job of the same name.
/// `image`: the workers' image, as the decision chose it.
pub(super) async fn ensure_children(
    ctx: &Context,
    job: &MemoryAwareTrainingJob,
    status: &MemoryAwareTrainingJobStatus,
    attempt: u32,
    model: &ModelShape,
    image: &str,
    own: &[&Pod],
) -> Result<(), Error> {
    let Some((plan, missing)) = missing_workers(ctx, job, status, attempt, own) else {
        return Ok(());
    };
    let ns = job.namespace().unwrap_or_default();
    let c = &ctx.client;
    let svc = children::headless_service(job);
    let pods = missing
        .iter()
        .map(|&slot| {
            children::worker_pod(job, attempt, slot, plan, model, image, &ctx.config.children)
                .map_err(|source| Error::BuildChild {
                    kind: "Pod".into(),
                    name: children::pod_name(job, attempt, plan, slot),
                    source,
                })
        })
        .collect::<Result<Vec<_>, _>>()?;
    // One round: the Service only gives the pods DNS names.
    let first_launch = attempt == 1 && status.initializations.unwrap_or(0) == 0;
    futures::try_join!(
        async {
            if plan.workers > 1 {
                put::<Service>(c, &ns, &svc, first_launch).await
            } else {
                Ok(())
            }
        },
        futures::future::try_join_all(pods.iter().map(|pod| put::<Pod>(c, &ns, pod, true))),
    )?;
    if let Ok(mut m) = ctx.launched.lock() {
        m.retain(|_, at| at.elapsed() < LAUNCH_EXPECTATION);
        m.insert((job.uid().unwrap_or_default(), attempt), Instant::now());
    }
    Ok(())
}

/// The job's checkpoint claim, created if missing and checked to be this
/// job's ([`create_claim`]).
pub(super) async fn ensure_claim(ctx: &Context, job: &MemoryAwareTrainingJob) -> Result<(), Error> {
    let ns = job.namespace().unwrap_or_default();
    let claim = children::checkpoint_claim(job, &ctx.config.children);
    create_claim(&ctx.client, &ns, job, &claim).await
}

/// Makes sure initializer run `run`'s pod exists, and the checkpoint claim
/// it downloads into. `image`: the job's image, as the decision chose it.
pub(super) async fn ensure_initializer(
    ctx: &Context,
    job: &MemoryAwareTrainingJob,
    run: u32,
    image: &str,
    own: &[&Pod],
) -> Result<(), Error> {
    let name = super::payload::initializer_pod_name(job, run);
    if own.iter().any(|p| p.name_any() == name) {
        return Ok(());
    }
    let Some(pod) = super::payload::initializer_pod(job, run, image, &ctx.config.children)
        .map_err(|source| Error::BuildChild {
            kind: "Pod".into(),
            name: name.clone(),
            source,
        })?
    else {
        return Ok(());
    };
    // The claim first, checked to be this job's (see ensure_children).
    ensure_claim(ctx, job).await?;
    let ns = job.namespace().unwrap_or_default();
    apply::<Pod>(&ctx.client, &ns, &pod).await
}

/// A PVC's spec is immutable once bound: create it once, never re-apply. An
/// existing claim of the same name must be this job's: one kept after an
/// earlier job of the same name holds that job's checkpoints, and resuming
/// from them would be wrong (and overwriting them would lose them).
async fn create_claim(
    client: &Client,
    ns: &str,
    job: &MemoryAwareTrainingJob,
    claim: &PersistentVolumeClaim,
) -> Result<(), Error> {
    let api: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), ns);
    let refused = |source| Error::ApplyChild {
        kind: "PersistentVolumeClaim".into(),
        name: claim.name_any(),
        source,
    };
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
        Err(kube::Error::Api(e)) if e.code == 409 => {
            let existing = api.get(&claim.name_any()).await.map_err(refused)?;
            if children::claim_belongs_to(&existing, job) {
                return Ok(()); // ours: keep it as it is
            }
            Err(Error::ClaimTaken {
                claim: claim.name_any(),
                job: existing
                    .labels()
                    .get(headroom_api::LABEL_RETAINED_FROM)
                    .cloned()
                    .unwrap_or_else(|| job.name_any()),
                holder: existing
                    .annotations()
                    .get(headroom_api::ANNOTATION_JOB_UID)
                    .cloned()
                    .unwrap_or_default(),
            })
        }
        Err(source) => Err(refused(source)),
    }
}

/// Lets the checkpoint claim outlive the job (`RetainOnSuccess` on success).
/// Runs before the status says Succeeded, so a failure here is retried.
pub(super) async fn keep_claim(
    client: &Client,
    ns: &str,
    job: &MemoryAwareTrainingJob,
) -> Result<(), Error> {
    let name = children::checkpoint_claim_name(job);
    let api: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), ns);
    match api
        .patch(
            &name,
            &PatchParams::default(),
            &Patch::Merge(children::release_claim_patch(job)),
        )
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(()), // nothing to keep
        Err(source) => Err(Error::KeepClaim {
            claim: name,
            source,
        }),
    }
}
