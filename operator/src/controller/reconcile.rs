//! One reconcile: dereference (this job's pods, the inventory) → decide
//! (pure, `decide/`) → apply (`apply.rs`): the status and a new attempt's
//! children in one round, then events and stopped pods.

use std::sync::Arc;
use std::time::{Duration, Instant};

use headroom_api::{ClaimRetention, JobPhase, LABEL_JOB, MemoryAwareTrainingJob};
use headroom_planner::Inventory;
use jiff::Timestamp;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::ResourceExt;
use kube::core::DeserializeGuard;
use kube::runtime::controller::Action;

use super::apply::{
    apply_status, delete_worker, ensure_initializer, keep_claim, launch_attempt, missing_workers,
    publish_events, undo_launch,
};
use super::classify::{PodVerdict, classify};
use super::decide::refused::{Refused, refused};
use super::decide::{Decision, Observation, QueueView, decide};
use super::{Context, Error};
use crate::inventory::{cpu_inventory, cpu_worker_size, job_inventory};
use crate::kueue;
use crate::metrics::{ErrorLabels, OutcomeLabels};

pub(super) fn error_policy(
    _job: Arc<DeserializeGuard<MemoryAwareTrainingJob>>,
    error: &Error,
    ctx: Arc<Context>,
) -> Action {
    ctx.metrics
        .reconcile_errors
        .get_or_create(&ErrorLabels {
            step: error.step().into(),
            error: error.kind().into(),
        })
        .inc();
    if error.is_conflict() {
        // A stale read lost a race with a newer write: the watch brings the new version.
        return Action::requeue(Duration::from_millis(500));
    }
    tracing::warn!(%error, step = error.step(), "reconcile failed");
    Action::requeue(Duration::from_secs(5))
}

pub(super) async fn reconcile(
    guard: Arc<DeserializeGuard<MemoryAwareTrainingJob>>,
    ctx: Arc<Context>,
) -> Result<Action, Error> {
    ctx.metrics.reconciles.inc();
    match &guard.0 {
        Ok(job) => reconcile_job(&ctx.newest(job), &ctx).await,
        Err(invalid) => {
            // Nothing sensible can be done until someone fixes the object; its next change retriggers us.
            ctx.metrics
                .reconcile_errors
                .get_or_create(&ErrorLabels {
                    step: "read_job".into(),
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

    // Dereference: this job's pods, and the inventory it plans with.
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
    // A pod that ended: what its worker reported last (before an OOM kill
    // or an eviction it cannot report after) goes into the status before
    // the attempt is closed from it (`crate::worker_reports`), and the decision
    // is made on the job that write returned.
    let flushed;
    let overlaid;
    let mut job = job;
    let ended: Vec<String> = own
        .iter()
        .filter(|p| has_ended(p))
        .map(|p| p.name_any())
        .collect();
    if let Some(uid) = &uid
        && !ended.is_empty()
    {
        let written = ctx
            .reports
            .flush(&ctx.client, uid, &ended)
            .await
            .map_err(|source| Error::FlushTelemetry {
                job: name.clone(),
                source,
            })?;
        if let Some(mut written) = written {
            written.managed_fields_mut().clear();
            ctx.wrote(job, &written);
            flushed = written;
            job = &flushed;
        }
        // A write of the flusher's that the job cache does not show yet.
        overlaid = ctx.reports.overlay(job, &ended);
        if let Some(newer) = &overlaid {
            job = newer;
        }
    }

    // A job in a Kueue queue plans within what the queue offers, and its
    // waiting message is Kueue's (crate::kueue).
    let (offer, queue) = match kueue::queue_name(job) {
        Some(local) => {
            let offer = ctx.queue_offers.get(&ctx.client, &ns, local).await;
            let gated_group = own
                .iter()
                .filter(|p| kueue::is_gated(p))
                .find_map(|p| p.labels().get(kueue::LABEL_POD_GROUP).cloned());
            let waiting = match &gated_group {
                Some(group) => kueue::workload_wait(&ctx.client, &ns, group).await,
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
            (offer.ok(), Some(view))
        }
        None => (None, None),
    };

    let one_node = ctx.config.children.checkpoint_access.stages_share_a_node();
    let nodes = ctx.nodes.state();
    let node_refs: Vec<&Node> = nodes.iter().map(AsRef::as_ref).collect();
    let inventory = if job.spec.resources.gpu.is_some() {
        let device_pods = ctx.device_pods.state();
        let build = |nodes: &[&Node]| {
            job_inventory(
                job,
                nodes.iter().copied(),
                device_pods.iter().map(AsRef::as_ref),
                one_node,
            )
        };
        match &offer {
            Some(o) => o.gpu_inventory(&node_refs, build),
            None => build(&node_refs),
        }
    } else {
        // A CPU job: what the nodes its pods may use can hold, by size.
        let inventory = cpu_inventory(job, node_refs.iter().copied(), one_node);
        match (&offer, cpu_worker_size(job)) {
            (Some(o), Some((limit, cores))) => {
                // Without nodes (a control plane alone), the job's own
                // worker cap, capped by the queue.
                let mut inventory = inventory.unwrap_or_else(|| {
                    let cap = job.spec.resources.cpu.as_ref().map_or(1, |c| c.max_workers);
                    Inventory::cpu(limit, cap.max(1))
                });
                o.cap_cpu(&mut inventory, limit, cores);
                inventory
            }
            _ => inventory.unwrap_or_default(),
        }
    };

    // Decide (pure).
    let started = Instant::now();
    let decision = decide(&Observation {
        job,
        pods: &own,
        inventory: &inventory,
        now: Timestamp::now(),
        unschedulable_grace: ctx.config.unschedulable_grace,
        default_gpu_host_memory: ctx.config.children.gpu_host_memory_bytes(),
        worker_images: &ctx.config.children.worker_images,
        queue: queue.as_ref(),
    });
    ctx.metrics
        .planning_seconds
        .observe(started.elapsed().as_secs_f64());

    // A job that succeeds now and keeps its checkpoints: release the claim
    // before the status says Succeeded (after it, nothing would retry this).
    let succeeds_now = decision.status.phase == Some(JobPhase::Succeeded)
        && job.status.as_ref().and_then(|s| s.phase) != Some(JobPhase::Succeeded);
    if succeeds_now && job.spec.checkpoints.retention == ClaimRetention::RetainOnSuccess {
        keep_claim(&ctx.client, &ns, job).await?;
    }

    // Apply. A launch with nothing to stop first is one round: the status
    // that records the attempt, and the attempt's pods with their claim
    // (`launch_attempt`). If the status write fails, the pods are deleted
    // again; if the operator stops between the two, the next decision finds
    // the pods and records the plan they run (`Builder::start`). With pods
    // to stop first: status, deletions, then the launch.
    let launch = decision
        .launch
        .as_ref()
        .filter(|l| missing_workers(ctx, job, &decision.status, l.attempt, &own).is_some());
    let at_once = launch.filter(|_| decision.delete_pods.is_empty());
    let (written, launched) = futures::join!(apply_status(&ctx.client, job, &decision), async {
        match at_once {
            Some(l) => Some(launch_attempt(ctx, job, &decision.status, l, &own).await),
            None => None,
        }
    });
    let written = match written {
        Ok(written) => written,
        Err(error) => {
            if let Some(l) = at_once {
                undo_launch(ctx, job, &decision.status, l.attempt).await;
            }
            return Err(error);
        }
    };
    if let Some(after) = &written {
        ctx.wrote(job, after);
    }
    if let Some(uid) = &uid {
        match decision.status.phase {
            // Its workers' entries are in the status; their series go.
            Some(JobPhase::Succeeded | JobPhase::Failed) => ctx.reports.close(uid),
            _ => {
                if let Some(attempt) = decision.status.attempt {
                    let budget = decision.status.plan.as_ref().map(|p| p.budget_bytes);
                    ctx.reports.attempt(uid, attempt, budget);
                }
            }
        }
    }
    // The newest version, for a second status write below.
    let latest = written.as_ref().unwrap_or(job);
    record_ended(ctx, decision.ended);
    publish_events(ctx, job, decision.events.clone());
    for pod in &decision.delete_pods {
        delete_worker(&ctx.client, &ns, pod).await?;
    }
    if let Some(init) = &decision.initialize
        && let Err(error) = ensure_initializer(ctx, job, init.run, &init.image, &own).await
    {
        let what = Refused::Initializer { run: init.run };
        return on_refusal(ctx, job, latest, &decision, what, error).await;
    }
    let launched = match (launched, launch) {
        (Some(result), _) => result,
        (None, Some(l)) => launch_attempt(ctx, job, &decision.status, l, &own).await,
        (None, None) => Ok(()),
    };
    if let (Some(l), Err(error)) = (launch, launched) {
        let what = Refused::Launch {
            attempt: l.attempt,
            pods: &own,
        };
        return on_refusal(ctx, job, latest, &decision, what, error).await;
    }
    Ok(Action::requeue(
        decision
            .requeue_after
            .unwrap_or(ctx.config.resync)
            .min(ctx.config.resync),
    ))
}

/// The API server refused what `decision` asked for (`what`). Any refusal
/// goes where the user looks, on the job: a condition, an event and the
/// status message, written over `latest` (the job as the first status write
/// returned it). One that can pass (a quota, a server error) is asked again
/// after the error policy's delay; one that cannot ends the job with the
/// server's reason. An error that is not a refusal (a transport error) is
/// only retried.
async fn on_refusal(
    ctx: &Context,
    job: &MemoryAwareTrainingJob,
    latest: &MemoryAwareTrainingJob,
    decision: &Decision,
    what: Refused<'_>,
    error: Error,
) -> Result<Action, Error> {
    let Some(refusal) = error.launch_refusal() else {
        return Err(error);
    };
    let after = refused(decision, job, what, &refusal, Timestamp::now());
    if let Some(written) = apply_status(&ctx.client, latest, &after).await? {
        ctx.wrote(latest, &written);
    }
    record_ended(ctx, after.ended);
    publish_events(ctx, job, after.events);
    let ns = job.namespace().unwrap_or_default();
    for pod in &after.delete_pods {
        delete_worker(&ctx.client, &ns, pod).await?;
    }
    if refusal.heals {
        return Err(error);
    }
    tracing::warn!(%error, "refused for good; job failed");
    Ok(Action::await_change())
}

/// Whether a pod's worker can no longer report: its container ended, or
/// the pod is being deleted.
fn has_ended(pod: &Pod) -> bool {
    pod.metadata.deletion_timestamp.is_some()
        || matches!(classify(pod), PodVerdict::Succeeded | PodVerdict::Failed(_))
}

/// Counts an ended attempt by outcome.
fn record_ended(ctx: &Context, ended: Option<headroom_api::AttemptOutcome>) {
    if let Some(outcome) = ended {
        ctx.metrics
            .attempts
            .get_or_create(&OutcomeLabels {
                outcome: format!("{outcome:?}"),
            })
            .inc();
    }
}
