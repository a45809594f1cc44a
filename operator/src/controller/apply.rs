//! The apply step: everything reconcile writes to the API server. Each write
//! fails with an [`Error`] naming its step and object.

use std::time::Instant;

use headroom_api::{MemoryAwareTrainingJob, MemoryAwareTrainingJobStatus, OPERATOR_FIELD_MANAGER};
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::events::{Event, EventType};
use kube::runtime::reflector::ObjectRef;
use kube::{Client, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::decide::{CacheWrite, Decision, InitializerRun, Launch};
use super::lifecycle::JobEvent;
use super::{Context, Error, LAUNCH_EXPECTATION, pods};

/// Writes the operator's status as a JSON merge patch of what changed,
/// guarded by the resourceVersion we decided on. Returns the job as written
/// (None when nothing changed), for a second write in the same reconcile.
///
/// A merge patch rather than a server-side apply: it carries only the
/// changed fields, and the telemetry prune below goes in the same write
/// (a retry used to take two). The API server's CPU for the write is about
/// the same either way (profiled on a burst of launches: the apply's YAML
/// parsing and merge give way to the patch's decode and JSON merge); what
/// it costs is the size of the job object it decodes, validates and stores.
///
/// Telemetry entries (`status.workers`) belong to the operator's telemetry
/// field manager ([`crate::worker_reports`]) and stay out of the patch, except
/// that the entries of earlier attempts are dropped once a new attempt is
/// recorded (the list is documented as the current attempt's; what they
/// said is already folded into that attempt's history, `observedPeakBytes`
/// and `lastStep`). A
/// telemetry write between our read and this write makes the
/// resourceVersion guard refuse it (409) rather than lose that write.
pub(super) async fn apply_status(
    client: &Client,
    job: &MemoryAwareTrainingJob,
    decision: &Decision,
) -> Result<Option<MemoryAwareTrainingJob>, Error> {
    let current = job.status.clone().unwrap_or_default();
    let mut status = decision.status.clone();
    status.workers = current
        .workers
        .iter()
        .filter(|w| decision.status.attempt.is_none_or(|n| w.attempt >= n))
        .cloned()
        .collect();
    // A job stored in the old shape (each attempt with its whole plan) is
    // rewritten in the lean one by the first status write that sees it.
    let migrate = current.attempts.iter().any(|a| a.stored_with_plan);
    if status == current && !migrate {
        return Ok(None);
    }
    let failed = |source| Error::ApplyStatus {
        job: job.name_any(),
        source,
    };
    let as_json = |s: &MemoryAwareTrainingJobStatus| {
        serde_json::to_value(s).map_err(|e| failed(kube::Error::SerdeError(e)))
    };
    let written = as_json(&status)?;
    let mut status_patch = merge_patch(&as_json(&current)?, &written);
    if migrate && let Some(attempts) = written.get("attempts") {
        status_patch["attempts"] = attempts.clone();
    }
    let patch = serde_json::json!({
        "metadata": {"resourceVersion": job.resource_version()},
        "status": status_patch,
    });
    let api: Api<MemoryAwareTrainingJob> =
        Api::namespaced(client.clone(), &job.namespace().unwrap_or_default());
    api.patch_status(
        &job.name_any(),
        &PatchParams {
            field_manager: Some(OPERATOR_FIELD_MANAGER.into()),
            ..PatchParams::default()
        },
        &Patch::Merge(&patch),
    )
    .await
    .map(Some)
    .map_err(failed)
}

/// The JSON merge patch (RFC 7386) that turns `from` into `to`: the keys
/// whose values changed (objects compared key by key), removed keys as
/// null, arrays and scalars whole.
pub(super) fn merge_patch(from: &serde_json::Value, to: &serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    let (Value::Object(from), Value::Object(to)) = (from, to) else {
        return to.clone();
    };
    let mut patch = serde_json::Map::new();
    for (key, new) in to {
        match from.get(key) {
            Some(old) if old == new => {}
            Some(old) => {
                patch.insert(key.clone(), merge_patch(old, new));
            }
            None => {
                patch.insert(key.clone(), new.clone());
            }
        }
    }
    for key in from.keys().filter(|k| !to.contains_key(*k)) {
        patch.insert(key.clone(), Value::Null);
    }
    Value::Object(patch)
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

/// Deletes `job` (its `spec.ttlSecondsAfterFinished` has passed); one
/// already gone is fine. Only this job: the uid is a precondition, so a new
/// job of the same name is not deleted in its place.
pub(super) async fn delete_job(
    client: &Client,
    ns: &str,
    job: &MemoryAwareTrainingJob,
) -> Result<(), Error> {
    let api: Api<MemoryAwareTrainingJob> = Api::namespaced(client.clone(), ns);
    let params = DeleteParams {
        preconditions: job.uid().map(|uid| kube::api::Preconditions {
            uid: Some(uid),
            ..Default::default()
        }),
        ..DeleteParams::background()
    };
    match api.delete(&job.name_any(), &params).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if matches!(e.code, 404 | 409) => Ok(()),
        Err(source) => Err(Error::DeleteJob {
            job: job.name_any(),
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
) -> Option<(&'a headroom_planner::Plan, Vec<pods::Slot>)> {
    let plan = plan_of(status, attempt)?;
    let existing: Vec<String> = own.iter().map(|p| p.name_any()).collect();
    let missing: Vec<pods::Slot> = pods::slots(plan)
        .filter(|&slot| !existing.contains(&pods::pod_name(job, attempt, plan, slot)))
        .collect();
    let key = (job.uid().unwrap_or_default(), attempt);
    (!missing.is_empty() && !ctx.launched_recently(&key)).then_some((plan, missing))
}

/// Launches attempt `attempt`: the pods (and the Service) it still lacks,
/// and the checkpoint claim they mount. A pod must never mount a claim that
/// is not this job's (one kept after an earlier job of the same name holds
/// that job's checkpoints). The claim cache says which case this is:
/// * this job's claim: only the pods are created;
/// * another's: nothing is, and the launch is refused ([`Error::ClaimTaken`]);
/// * none: the claim and the pods are created in the same round. Should the
///   claim turn out to exist after all (made in the moment the cache has
///   not seen) and not be this job's, or not be created at all (a quota),
///   the pods are deleted again, before any node could have started them,
///   and the next try starts over.
///
/// A scheduler that sees such a pod before its claim retries it when the
/// claim appears (the volume-binding plugin's claim events).
pub(super) async fn launch_attempt(
    ctx: &Context,
    job: &MemoryAwareTrainingJob,
    status: &MemoryAwareTrainingJobStatus,
    launch: &Launch,
    own: &[&Pod],
) -> Result<(), Error> {
    let attempt = launch.attempt;
    let ns = job.namespace().unwrap_or_default();
    let name = pods::checkpoint_claim_name(job);
    let cached = ctx
        .claims
        .get(&ObjectRef::new(&name).within(&ns))
        .map(|claim| pods::claim_belongs_to(claim.as_ref(), job));
    match cached {
        Some(true) => ensure_children(ctx, job, status, launch, own).await,
        // Not this job's, says the cache: the server's word (and the
        // holder's name) for the refusal, or a claim deleted since.
        Some(false) => {
            ensure_claim(ctx, job, plan_of(status, attempt)).await?;
            ensure_children(ctx, job, status, launch, own).await
        }
        None => {
            let (claimed, launched) = futures::join!(
                ensure_claim(ctx, job, plan_of(status, attempt)),
                ensure_children(ctx, job, status, launch, own)
            );
            if claimed.is_err() {
                undo_launch(ctx, job, status, attempt).await;
                return claimed;
            }
            launched
        }
    }
}

/// The whole plan of attempt `attempt`, when it is the current one (the
/// status stores the current attempt's plan only; earlier attempts' pods
/// are found by their labels, never by their plan).
fn plan_of(status: &MemoryAwareTrainingJobStatus, attempt: u32) -> Option<&headroom_planner::Plan> {
    (status.attempts.last().map(|a| a.number) == Some(attempt))
        .then_some(status.plan.as_ref())
        .flatten()
}

/// Deletes the pods of attempt `attempt` that a launch just created, and
/// forgets that it launched them (best effort: what is left is found by the
/// next decision, see `Builder::start`).
pub(super) async fn undo_launch(
    ctx: &Context,
    job: &MemoryAwareTrainingJob,
    status: &MemoryAwareTrainingJobStatus,
    attempt: u32,
) {
    let Some(plan) = plan_of(status, attempt) else {
        return;
    };
    let ns = job.namespace().unwrap_or_default();
    for slot in pods::slots(plan) {
        let pod = pods::pod_name(job, attempt, plan, slot);
        if let Err(error) = delete_worker(&ctx.client, &ns, &pod).await {
            tracing::warn!(%error, "could not delete a pod of an undone launch");
        }
    }
    if let Ok(mut m) = ctx.launched.lock() {
        m.remove(&(job.uid().unwrap_or_default(), attempt));
    }
}

/// Creates the pods (and the Service) attempt `attempt` still lacks; a
/// no-op once all its pods exist. Only [`launch_attempt`] calls it, which
/// sees to the checkpoint claim. `image`: the workers' image, as the
/// decision chose it.
async fn ensure_children(
    ctx: &Context,
    job: &MemoryAwareTrainingJob,
    status: &MemoryAwareTrainingJobStatus,
    launch: &Launch,
    own: &[&Pod],
) -> Result<(), Error> {
    let attempt = launch.attempt;
    let Some((plan, missing)) = missing_workers(ctx, job, status, attempt, own) else {
        return Ok(());
    };
    let ns = job.namespace().unwrap_or_default();
    let c = &ctx.client;
    let svc = pods::headless_service(job);
    let fence = pods::peer_network_policy(job);
    let workers = missing
        .iter()
        .map(|&slot| {
            pods::worker_pod(job, launch, slot, plan, &ctx.config.children).map_err(|source| {
                Error::BuildChild {
                    kind: "Pod".into(),
                    name: pods::pod_name(job, attempt, plan, slot),
                    source,
                }
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    // One round: the Service only gives the pods DNS names, and the
    // NetworkPolicy fences ports the workers open only once they start.
    let first_launch = attempt == 1 && status.initializations.unwrap_or(0) == 0;
    futures::try_join!(
        async {
            if plan.workers > 1 {
                futures::try_join!(
                    put::<Service>(c, &ns, &svc, first_launch),
                    put::<NetworkPolicy>(c, &ns, &fence, first_launch),
                )
                .map(|_| ())
            } else {
                Ok(())
            }
        },
        futures::future::try_join_all(workers.iter().map(|pod| put::<Pod>(c, &ns, pod, true))),
    )?;
    if let Ok(mut m) = ctx.launched.lock() {
        m.retain(|_, at| at.elapsed() < LAUNCH_EXPECTATION);
        m.insert((job.uid().unwrap_or_default(), attempt), Instant::now());
    }
    Ok(())
}

/// The job's checkpoint claim, created if missing (sized for `plan` when
/// the job is planned already) and checked to be this job's ([`create_claim`]).
async fn ensure_claim(
    ctx: &Context,
    job: &MemoryAwareTrainingJob,
    plan: Option<&headroom_planner::Plan>,
) -> Result<(), Error> {
    let ns = job.namespace().unwrap_or_default();
    let claim = pods::checkpoint_claim(job, &ctx.config.children, plan);
    create_claim(&ctx.client, &ns, job, &claim).await
}

/// Makes sure initializer run `init.run`'s pod exists, and the checkpoint
/// claim it downloads into; with a shared model cache (`status.modelCache`
/// of the decided `status`), the cache claim's write first
/// ([`write_model_cache`]): a claim another job made in the meantime leaves
/// the pod uncreated, and the next decision waits for that job.
pub(super) async fn ensure_initializer(
    ctx: &Context,
    job: &MemoryAwareTrainingJob,
    status: &MemoryAwareTrainingJobStatus,
    init: &InitializerRun,
    cache: Option<&CacheWrite>,
    own: &[&Pod],
) -> Result<(), Error> {
    let run = init.run;
    let name = pods::initializer_pod_name(job, run);
    if own.iter().any(|p| p.name_any() == name) {
        return Ok(());
    }
    // The pod reads the cache claim the decision chose, which the observed
    // job's status may not show yet.
    let with_cache;
    let job = match &status.model_cache {
        Some(claim) if job.status.as_ref().and_then(|s| s.model_cache.as_ref()) != Some(claim) => {
            let mut j = job.clone();
            j.status.get_or_insert_with(Default::default).model_cache = Some(claim.clone());
            with_cache = j;
            &with_cache
        }
        _ => job,
    };
    let Some(pod) =
        pods::initializer_pod_filling(job, run, &init.image, &ctx.config.children, init.fill_cache)
            .map_err(|source| Error::BuildChild {
                kind: "Pod".into(),
                name: name.clone(),
                source,
            })?
    else {
        return Ok(());
    };
    if let Some(write) = cache
        && !write_model_cache(ctx, job, write).await?
    {
        return Ok(());
    }
    // The claim first, checked to be this job's (see ensure_children); made
    // before the plan, at the spec's or the default size.
    ensure_claim(ctx, job, None).await?;
    let ns = job.namespace().unwrap_or_default();
    apply::<Pod>(&ctx.client, &ns, &pod).await
}

/// Carries out `write` on the job's shared model cache claim. False when
/// the job lost the claim to another (made or taken over first): it waits.
pub(super) async fn write_model_cache(
    ctx: &Context,
    job: &MemoryAwareTrainingJob,
    write: &CacheWrite,
) -> Result<bool, Error> {
    let ns = job.namespace().unwrap_or_default();
    let api: Api<PersistentVolumeClaim> = Api::namespaced(ctx.client.clone(), &ns);
    let now = jiff::Timestamp::now();
    let params = PatchParams {
        field_manager: Some(OPERATOR_FIELD_MANAGER.into()),
        ..PatchParams::default()
    };
    let (claim, result) = match write {
        CacheWrite::Create { claim } => {
            let made = pods::cache_claim(job, claim, &ctx.config.children, now);
            let post = PostParams {
                field_manager: Some(OPERATOR_FIELD_MANAGER.into()),
                ..PostParams::default()
            };
            match api.create(&post, &made).await {
                Ok(_) => return Ok(true),
                // Made by another job first (or by this one, moments ago).
                Err(kube::Error::Api(e)) if e.code == 409 => {
                    let existing = api.get_metadata(claim).await;
                    return match existing {
                        Ok(c) => Ok(matches!(
                            pods::CacheState::of(Some(&c)),
                            pods::CacheState::Filling { filler: Some((uid, _)) }
                                if Some(uid.clone()) == job.uid()
                        )),
                        Err(kube::Error::Api(e)) if e.code == 404 => Ok(false),
                        Err(source) => Err(Error::ApplyChild {
                            kind: "PersistentVolumeClaim".into(),
                            name: claim.clone(),
                            source,
                        }),
                    };
                }
                Err(e) => (claim, Err(e)),
            }
        }
        CacheWrite::TakeOver {
            claim,
            resource_version,
        } => {
            let patch = pods::take_over_patch(job, resource_version);
            match api.patch(claim, &params, &Patch::Merge(&patch)).await {
                Ok(_) => return Ok(true),
                // Another job took it over first: this one waits.
                Err(kube::Error::Api(e)) if e.code == 409 || e.code == 404 => return Ok(false),
                Err(e) => (claim, Err(e)),
            }
        }
        CacheWrite::Used { claim } => (
            claim,
            api.patch(claim, &params, &Patch::Merge(&pods::used_patch(now)))
                .await
                .map(|_| ()),
        ),
        CacheWrite::Ready { claim, commit } => (
            claim,
            api.patch(
                claim,
                &params,
                &Patch::Merge(&pods::ready_patch(commit.as_deref(), now)),
            )
            .await
            .map(|_| ()),
        ),
    };
    result.map(|()| true).map_err(|source| Error::ApplyChild {
        kind: "PersistentVolumeClaim".into(),
        name: claim.clone(),
        source,
    })
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
            if pods::claim_belongs_to(&existing, job) {
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

/// Grows the job's checkpoint claim (its StorageClass allows expansion)
/// by raising its storage request; the volume is resized before the next
/// pod mounts it.
pub(super) async fn grow_claim(
    client: &Client,
    ns: &str,
    growth: &super::decide::ClaimGrowth,
) -> Result<(), Error> {
    let api: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), ns);
    let to = headroom_planner::disk::quantity(growth.to_bytes);
    let patch = serde_json::json!({"spec": {"resources": {"requests": {"storage": to}}}});
    api.patch(
        &growth.claim,
        &PatchParams {
            field_manager: Some(OPERATOR_FIELD_MANAGER.into()),
            ..PatchParams::default()
        },
        &Patch::Merge(patch),
    )
    .await
    .map(|_| ())
    .map_err(|source| Error::ApplyChild {
        kind: "PersistentVolumeClaim".into(),
        name: growth.claim.clone(),
        source,
    })
}

/// Lets the checkpoint claim outlive the job (`RetainOnSuccess` on success).
/// Runs before the status says Succeeded, so a failure here is retried.
pub(super) async fn keep_claim(
    client: &Client,
    ns: &str,
    job: &MemoryAwareTrainingJob,
) -> Result<(), Error> {
    let name = pods::checkpoint_claim_name(job);
    let api: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), ns);
    match api
        .patch(
            &name,
            &PatchParams::default(),
            &Patch::Merge(pods::release_claim_patch(job)),
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

#[cfg(test)]
mod tests {
    use super::merge_patch;
    use proptest::prelude::*;
    use serde_json::{Value, json};

    /// JSON without nulls (a status serializes absent fields by leaving them out).
    fn document() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            any::<bool>().prop_map(Value::from),
            (0u8..4).prop_map(Value::from),
            "[ab]{0,2}".prop_map(Value::from),
        ];
        leaf.prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..3).prop_map(Value::from),
                prop::collection::btree_map("[abc]", inner, 0..4)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest! {
        /// Applied by json-patch's RFC 7386 implementation, the patch turns
        /// `from` into `to`, whatever both are.
        #[test]
        fn the_patch_turns_the_old_status_into_the_new(from in document(), to in document()) {
            let mut patched = from.clone();
            json_patch::merge(&mut patched, &merge_patch(&from, &to));
            prop_assert_eq!(patched, to);
        }
    }

    #[test]
    fn the_patch_carries_only_what_changed() {
        let from = json!({"phase": "Pending", "plan": {"workers": 1, "fit": "a"}, "message": "m"});
        let to = json!({"phase": "Running", "plan": {"workers": 1, "fit": "b"}});
        assert_eq!(
            merge_patch(&from, &to),
            json!({"phase": "Running", "plan": {"fit": "b"}, "message": null})
        );
    }
}
