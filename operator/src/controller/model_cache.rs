//! The shared model cache's collector: every pass, each cache claim in
//! the claim cache is judged against the jobs that use it
//! ([`pods::collect`](super::pods::collect)): its last use refreshed while
//! unfinished jobs read it, freed when its filler ended without filling it,
//! deleted once no job has used it for `modelCache.idleSeconds`. Writes
//! that could race a job are guarded by the claim's resourceVersion.

use std::sync::Arc;
use std::time::Duration;

use headroom_api::{JobPhase, MemoryAwareTrainingJob, OPERATOR_FIELD_MANAGER};
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, Patch, PatchParams, Preconditions};
use kube::core::DeserializeGuard;
use kube::runtime::reflector::Store;

use super::Context;
use super::pods::{self, Collect};

/// How often the collector looks: a quarter of the idle time, between 1 s
/// and a minute. It is also how stale a used claim's last use may get.
pub fn pass_interval(idle: Duration) -> Duration {
    (idle / 4).clamp(Duration::from_secs(1), Duration::from_secs(60))
}

/// Runs the collector until the future is dropped (with the controller).
pub(super) async fn collect_idle_caches(
    ctx: Arc<Context>,
    jobs: Store<DeserializeGuard<MemoryAwareTrainingJob>>,
) {
    let every = pass_interval(ctx.config.children.model_cache.idle);
    loop {
        tokio::time::sleep(every).await;
        collect_once(&ctx, &jobs, every).await;
    }
}

/// The uids of `ns`'s unfinished jobs that read `claim` or, not yet
/// initialized, would.
fn users(
    jobs: &[Arc<DeserializeGuard<MemoryAwareTrainingJob>>],
    ns: &str,
    claim: &str,
    enabled: bool,
) -> Vec<String> {
    jobs.iter()
        .filter_map(|g| g.0.as_ref().ok())
        .filter(|j| j.namespace().as_deref() == Some(ns))
        .filter(|j| {
            let status = j.status.as_ref();
            let finished = matches!(
                status.and_then(|s| s.phase),
                Some(JobPhase::Succeeded | JobPhase::Failed)
            );
            let reads = match status.and_then(|s| s.model_cache.as_deref()) {
                Some(c) => c == claim,
                None => {
                    status.is_none_or(|s| s.initializations.unwrap_or(0) == 0)
                        && pods::shared_cache(j, enabled).as_deref() == Some(claim)
                }
            };
            !finished && reads
        })
        .filter_map(ResourceExt::uid)
        .collect()
}

/// One pass over every cache claim in scope.
async fn collect_once(
    ctx: &Context,
    jobs: &Store<DeserializeGuard<MemoryAwareTrainingJob>>,
    refresh: Duration,
) {
    let cfg = &ctx.config.children.model_cache;
    let claims: Vec<_> = ctx
        .claims
        .state()
        .into_iter()
        .filter(|c| pods::is_cache_claim(c.as_ref()))
        .collect();
    if claims.is_empty() {
        return;
    }
    let all = jobs.state();
    let now = jiff::Timestamp::now();
    for claim in claims {
        let ns = claim.namespace().unwrap_or_default();
        let name = claim.name_any();
        let users = users(&all, &ns, &name, cfg.enabled);
        let verdict = pods::collect(claim.as_ref(), &users, now, cfg.idle, refresh);
        let api: Api<PersistentVolumeClaim> = Api::namespaced(ctx.client.clone(), &ns);
        let params = PatchParams {
            field_manager: Some(OPERATOR_FIELD_MANAGER.into()),
            ..PatchParams::default()
        };
        let version = claim.resource_version().unwrap_or_default();
        let result = match verdict {
            Collect::Keep => continue,
            Collect::Touch => api
                .patch(&name, &params, &Patch::Merge(pods::used_patch(now)))
                .await
                .map(|_| ()),
            Collect::ReleaseFiller => api
                .patch(
                    &name,
                    &params,
                    &Patch::Merge(pods::release_filler_patch(&version)),
                )
                .await
                .map(|_| ()),
            Collect::Delete => {
                tracing::info!(claim = %name, ns = %ns, idle = ?cfg.idle, "deleting an idle model cache claim");
                api.delete(
                    &name,
                    &DeleteParams {
                        // Not if a job used it since the cache showed it.
                        preconditions: Some(Preconditions {
                            resource_version: Some(version),
                            uid: claim.uid(),
                        }),
                        ..DeleteParams::default()
                    },
                )
                .await
                .map(|_| ())
            }
        };
        match result {
            Ok(()) => {}
            // Changed or gone since the cache showed it: the next pass sees.
            Err(kube::Error::Api(e)) if e.code == 409 || e.code == 404 => {}
            Err(error) => {
                tracing::warn!(%error, claim = %name, ns = %ns, ?verdict, "model cache collector")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_collector_looks_often_enough_for_the_idle_time() {
        assert_eq!(
            pass_interval(Duration::from_secs(2)),
            Duration::from_secs(1)
        );
        assert_eq!(
            pass_interval(Duration::from_secs(40)),
            Duration::from_secs(10)
        );
        assert_eq!(
            pass_interval(Duration::from_secs(86_400)),
            Duration::from_secs(60)
        );
    }
}
