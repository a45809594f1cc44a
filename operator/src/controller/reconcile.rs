//! One reconcile: dereference (`observe.rs`: this job's pods, its queue,
//! the inventory) → decide (pure, `decide/`) → apply (here, writing through
//! `apply.rs`): the status and a new attempt's children in one round, then
//! events and stopped pods.

use std::sync::Arc;
use std::time::{Duration, Instant};

use headroom_api::{ClaimRetention, JobPhase, MemoryAwareTrainingJob};
use jiff::Timestamp;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::core::DeserializeGuard;
use kube::runtime::controller::Action;

use super::apply::{
    apply_status, delete_job, delete_worker, ensure_initializer, grow_claim, keep_claim,
    launch_attempt, missing_workers, publish_events, undo_launch, write_model_cache,
};
use super::decide::refused::{Refused, refused};
use super::decide::{CacheWrite, Decision, Launch, decide};
use super::observe::observe;
use super::{Context, Error};
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
    let seen = observe(ctx, job, &ns).await?;
    let own: Vec<&Pod> = seen.pods.iter().map(AsRef::as_ref).collect();

    let started = Instant::now();
    let decision = decide(&seen.observation(ctx, &own));
    ctx.metrics
        .planning_seconds
        .observe(started.elapsed().as_secs_f64());

    apply_decision(ctx, &ns, &seen.job, &own, decision).await
}

/// Carries out `decision` for `job` (as observed, with its `own` pods).
///
/// A launch with nothing to stop first is one round: the status that
/// records the attempt, and the attempt's pods with their claim
/// (`launch_attempt`). If the API server refuses the status write for good,
/// the pods are deleted again; if the write lost a race (409), may have
/// landed (a server error, no answer), or the operator stops between the
/// two, the next decision finds the pods and records the plan they run
/// (`Builder::start`). With pods to stop first: status, deletions, then
/// the launch.
async fn apply_decision(
    ctx: &Context,
    ns: &str,
    job: &MemoryAwareTrainingJob,
    own: &[&Pod],
    decision: Decision,
) -> Result<Action, Error> {
    if decision.delete_job {
        // Its pods, Service and claim go with it (their owner), except a
        // claim its retention released when it ended.
        delete_job(&ctx.client, ns, job).await?;
        return Ok(Action::await_change());
    }
    keep_claim_on_success(ctx, ns, job, &decision).await?;
    // Before the status that says Initialized: a filled cache claim is
    // marked ready, or the next reconcile (which sees the same report) tries again.
    if let Some(write @ CacheWrite::Ready { .. }) = &decision.model_cache {
        write_model_cache(ctx, job, write).await?;
    }
    // Before the status that starts the retry: a claim that could not be
    // grown leaves the attempt to the next reconcile, which decides again.
    if let Some(growth) = &decision.grow_claim {
        grow_claim(&ctx.client, ns, growth).await?;
    }
    let launch = decision
        .launch
        .as_ref()
        .filter(|l| missing_workers(ctx, job, &decision.status, l.attempt, own).is_some());
    let at_once = launch.filter(|_| decision.delete_pods.is_empty());
    let (written, launched) = write_status_and_launch(ctx, job, &decision, at_once, own).await?;
    if let Some(after) = &written {
        ctx.wrote(job, after);
    }
    follow_attempt_telemetry(ctx, job, &decision);
    // The newest version, for a second status write below.
    let latest = written.as_ref().unwrap_or(job);
    record_ended(ctx, decision.ended);
    publish_events(ctx, job, decision.events.clone());
    for pod in &decision.delete_pods {
        delete_worker(&ctx.client, ns, pod).await?;
    }
    let cache = decision
        .model_cache
        .as_ref()
        .filter(|w| !matches!(w, CacheWrite::Ready { .. }));
    if let Some(init) = &decision.initialize
        && let Err(error) = ensure_initializer(ctx, job, &decision.status, init, cache, own).await
    {
        let what = Refused::Initializer { run: init.run };
        return on_refusal(ctx, job, latest, &decision, what, error).await;
    }
    let launched = match (launched, launch) {
        (Some(result), _) => result,
        (None, Some(l)) => launch_attempt(ctx, job, &decision.status, l, own).await,
        (None, None) => Ok(()),
    };
    if let (Some(l), Err(error)) = (launch, launched) {
        let what = Refused::Launch {
            attempt: l.attempt,
            pods: own,
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

/// A job that succeeds now and keeps its checkpoints: releases the claim
/// before the status says Succeeded (after it, nothing would retry this).
async fn keep_claim_on_success(
    ctx: &Context,
    ns: &str,
    job: &MemoryAwareTrainingJob,
    decision: &Decision,
) -> Result<(), Error> {
    let succeeds_now = decision.status.phase == Some(JobPhase::Succeeded)
        && job.status.as_ref().and_then(|s| s.phase) != Some(JobPhase::Succeeded);
    if succeeds_now && job.spec.checkpoints.retention == ClaimRetention::RetainOnSuccess {
        keep_claim(&ctx.client, ns, job).await?;
    }
    Ok(())
}

/// Writes the decided status and, together with it, launches `at_once`
/// (an attempt with nothing to stop first). The job as the write returned
/// it (None: nothing changed), and the launch's result when there was one.
/// A status write the API server refused for good undoes the launch.
async fn write_status_and_launch(
    ctx: &Context,
    job: &MemoryAwareTrainingJob,
    decision: &Decision,
    at_once: Option<&Launch>,
    own: &[&Pod],
) -> Result<(Option<MemoryAwareTrainingJob>, Option<Result<(), Error>>), Error> {
    let (written, launched) = futures::join!(apply_status(&ctx.client, job, decision), async {
        match at_once {
            Some(l) => Some(launch_attempt(ctx, job, &decision.status, l, own).await),
            None => None,
        }
    });
    match written {
        Ok(written) => Ok((written, launched)),
        Err(error) => {
            // Not after a conflict: this decision was made from a stale view
            // (most often a telemetry write it did not see), and the next,
            // on the newer job, records the attempt on these very pods.
            // Deleted under it, a pod that had not started yet would end
            // that attempt as disrupted (ContainerStatusUnknown).
            if let Some(l) = at_once.filter(|_| error.refused_for_good()) {
                undo_launch(ctx, job, &decision.status, l.attempt).await;
            }
            Err(error)
        }
    }
}

/// Tells the held worker telemetry which attempt (and memory budget) the
/// status now shows, the run's total steps and tokens per step, or that the job ended: its
/// workers' entries are in the status and their series go.
fn follow_attempt_telemetry(ctx: &Context, job: &MemoryAwareTrainingJob, decision: &Decision) {
    let Some(uid) = job.uid() else {
        return;
    };
    match decision.status.phase {
        Some(JobPhase::Succeeded | JobPhase::Failed) => ctx.reports.close(&uid),
        _ => {
            if let Some(attempt) = decision.status.attempt {
                let budget = decision.status.plan.as_ref().map(|p| p.budget_bytes);
                ctx.reports.attempt(&uid, attempt, budget);
                // The decision's status holds the recipe it may just have recorded.
                let recorded = decision.status.recipe.as_ref().map(|r| r.total_steps);
                if let Some(total) = recorded.or_else(|| job.total_steps()) {
                    ctx.reports.total_steps(&uid, total);
                }
                if let Some(tokens) = job.tokens_per_step() {
                    ctx.reports.tokens_per_step(&uid, tokens);
                }
            }
        }
    }
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
