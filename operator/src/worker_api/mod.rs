//! The operator's API for its own workers: telemetry in, peers' addresses
//! and their job's link key out.
//!
//! Why it exists: a worker used to run under a per-job ServiceAccount, Role
//! and RoleBinding so that it could patch its job's status and read its
//! peers' pods. That was three API writes per job before its first pod (the
//! launch path's largest cost) and Kubernetes API rights inside
//! every training container. Now workers hold none. A worker presents the
//! token the kubelet projects into its pod (bound to the pod, audience
//! [`WORKER_API_AUDIENCE`], useless against the API server itself); the
//! operator checks it with a TokenReview, finds the pod it is bound to and
//! that pod's job, and acts for it within that job only:
//!
//! * `POST /v1/telemetry` — a [`WorkerTelemetry`] becomes the caller's own
//!   `status.workers` entry: held with its job's other entries and written
//!   with them at most once per telemetry interval ([`crate::worker_reports`]),
//!   or, when the operator holds as many as it will, server-side applied at
//!   once under the caller's own field manager (`headroom-worker/<pod>`).
//!   An entry beyond the schema's bounds is refused here
//!   ([`WorkerTelemetry::check_bounds`]).
//! * `GET /v1/peers/<pod>` — the IP of another pod of the caller's job.
//! * `GET /v1/peer-key` — the link key of the caller's attempt of its job
//!   ([`peer_key`]), with which the attempt's stages and replicas
//!   authenticate each other; none for the initializer.
//!
//! The API is reachable from every pod of the cluster, so it is built to
//! shed load rather than fall over (SECURITY.md):
//!
//! * `identity` — who is calling. On the leader a checked token is
//!   remembered while its pod is in the controller's pod cache, up to the
//!   token's expiry and at most [`WATCHED_IDENTITY_TTL`] (a worker costs one
//!   TokenReview per ten minutes and no pod read); elsewhere for
//!   [`IDENTITY_TTL`] (one TokenReview and one pod read a minute). A
//!   refused one, whatever refused it, is remembered for [`REFUSAL_TTL`];
//!   a token whose own claims name another audience, no pod or a past
//!   expiry is refused without a review; reviews in flight are capped.
//! * `GET /v1/peers/<pod>` reads the leader's pod cache, not the API server.
//! * the caller is known before a body is read, and a body is read only up
//!   to [`MAX_BODY_BYTES`];
//! * [`crate::listener`] — a connection cap, a per-source share of it, and
//!   header-read and request deadlines;
//! * `tls` — the serving certificate each replica issues itself at start
//!   from the chart's CA, which workers alone trust for this API.

use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use headroom_api::{
    MemoryAwareTrainingJob, PeerAddress, PeerKey, WORKER_API_AUDIENCE, WORKER_API_PEER_KEY_PATH,
    WORKER_API_PEERS_PATH, WORKER_API_TELEMETRY_PATH, WORKER_FIELD_MANAGER_PREFIX, WorkerTelemetry,
};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, Patch, PatchParams};
use kube::{Client, Resource};

use crate::watched_pods::WatchedPods;
use crate::worker_reports::Recorded;

mod identity;
pub mod peer_key;
pub mod tls;

use crate::watched_pods::owning_job;
use identity::Identities;
pub use identity::{
    Caller, IDENTITY_TTL, MAX_CONCURRENT_REVIEWS, MAX_TOKEN_BYTES, REFUSAL_TTL,
    WATCHED_IDENTITY_TTL,
};
pub use peer_key::OperatorKey;
// Served, like the operator's other ports, by its one listener.
pub use crate::listener::{Limits, serve};
pub use tls::ServingTls;

pub use crate::worker_reports::WorkerReports;

/// The largest request body read, bytes. A worker's telemetry is well under
/// 8 KiB (a few numbers per GPU; the CRD bounds its strings and lists).
pub const MAX_BODY_BYTES: usize = 64 * 1024;

/// Why a call was refused; the status code and a plain-text reason go back
/// to the worker, which logs them.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    #[error("no bearer token: send the pod's projected token (audience {WORKER_API_AUDIENCE})")]
    NoToken,
    #[error("token not accepted: {0}")]
    Unauthenticated(String),
    #[error("{0}")]
    Forbidden(String),
    #[error("{0}")]
    BadRequest(String),
    #[error("request body over {MAX_BODY_BYTES} bytes")]
    TooLarge,
    #[error("too many token checks in flight; retry shortly")]
    Busy,
    #[error("the worker API could not reach the Kubernetes API: {0}")]
    Upstream(#[source] kube::Error),
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        let code = match &self {
            Refusal::NoToken | Refusal::Unauthenticated(_) => StatusCode::UNAUTHORIZED,
            Refusal::Forbidden(_) => StatusCode::FORBIDDEN,
            Refusal::BadRequest(_) => StatusCode::BAD_REQUEST,
            Refusal::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Refusal::Busy => StatusCode::SERVICE_UNAVAILABLE,
            Refusal::Upstream(_) => StatusCode::BAD_GATEWAY,
        };
        // Refusals without a caller are logged at debug: a flood of them
        // must not become a flood of log lines.
        match &self {
            Refusal::BadRequest(_) => {}
            Refusal::NoToken | Refusal::Unauthenticated(_) | Refusal::TooLarge | Refusal::Busy => {
                tracing::debug!(code = code.as_u16(), reason = %self, "worker API call refused")
            }
            Refusal::Forbidden(_) | Refusal::Upstream(_) => {
                tracing::info!(code = code.as_u16(), reason = %self, "worker API call refused")
            }
        }
        (code, self.to_string()).into_response()
    }
}

struct WorkerApi {
    client: Client,
    identities: Identities,
    key: OperatorKey,
    reports: Arc<WorkerReports>,
    /// The leader's pod cache: callers' pods and their peers are read from it.
    pods: WatchedPods,
}

/// The worker API's routes, acting with `client` (the operator's own
/// credentials: it needs `create` on tokenreviews, `get` on pods and `patch`
/// on memoryawaretrainingjobs/status), handing out job keys derived from
/// `key`, handing telemetry to `reports` (whose flusher writes it), and
/// reading callers' pods from `pods` once the controller has filled it.
pub fn router(
    client: Client,
    key: OperatorKey,
    reports: Arc<WorkerReports>,
    pods: WatchedPods,
) -> Router {
    let state = Arc::new(WorkerApi {
        identities: Identities::new(client.clone(), pods.clone()),
        client,
        key,
        reports,
        pods,
    });
    Router::new()
        .route(WORKER_API_TELEMETRY_PATH, post(telemetry))
        .route(&format!("{WORKER_API_PEERS_PATH}{{pod}}"), get(peer))
        .route(WORKER_API_PEER_KEY_PATH, get(job_key))
        .with_state(state)
}

/// `POST /v1/telemetry`: the caller's own status entry. The token is
/// checked before a byte of the body is read.
async fn telemetry(
    State(api): State<Arc<WorkerApi>>,
    headers: HeaderMap,
    body: Body,
) -> Result<StatusCode, Refusal> {
    let caller = api.caller(&headers).await?;
    let body = axum::body::to_bytes(body, MAX_BODY_BYTES)
        .await
        .map_err(|_| Refusal::TooLarge)?;
    let de = &mut serde_json::Deserializer::from_slice(&body);
    let telemetry: WorkerTelemetry = serde_path_to_error::deserialize(de)
        .map_err(|e| Refusal::BadRequest(format!("telemetry body: {e}")))?;
    telemetry
        .check_bounds()
        .map_err(|e| Refusal::BadRequest(format!("telemetry body: {e}")))?;
    if telemetry.name != caller.pod {
        return Err(Refusal::Forbidden(format!(
            "telemetry names worker {:?}, but the token is pod {}'s: a worker reports only its own entry",
            telemetry.name, caller.pod
        )));
    }
    // The pod's labels, which only the operator writes, say which attempt
    // and stage it is; a worker cannot report for another.
    if (telemetry.attempt, telemetry.stage) != (caller.attempt, caller.stage) {
        return Err(Refusal::Forbidden(format!(
            "telemetry says attempt {} stage {}, but pod {} is attempt {} stage {}",
            telemetry.attempt, telemetry.stage, caller.pod, caller.attempt, caller.stage
        )));
    }
    let gone = || {
        Refusal::Forbidden(format!(
            "job {}/{} has ended or is gone: its telemetry is no longer written",
            caller.namespace, caller.job
        ))
    };
    match api
        .reports
        .record(&caller.namespace, &caller.job, &caller.job_uid, telemetry)
    {
        Recorded::Held => Ok(StatusCode::NO_CONTENT),
        Recorded::Closed => Err(gone()),
        Recorded::Superseded { current } => Err(Refusal::Forbidden(format!(
            "pod {} is of attempt {}, but job {}/{} runs attempt {current}",
            caller.pod, caller.attempt, caller.namespace, caller.job
        ))),
        Recorded::Full(telemetry) => {
            write_through(&api, &caller, &telemetry)
                .await
                .map_err(|e| match e {
                    kube::Error::Api(e) if matches!(e.code, 404 | 409) => gone(),
                    e => Refusal::Upstream(e),
                })?;
            Ok(StatusCode::NO_CONTENT)
        }
    }
}

/// The caller's entry applied at once under its own field manager, as
/// workers wrote it before the operator held reports: for a worker beyond
/// the reports the operator holds.
async fn write_through(
    api: &WorkerApi,
    caller: &Caller,
    telemetry: &WorkerTelemetry,
) -> Result<(), kube::Error> {
    let jobs: Api<MemoryAwareTrainingJob> = Api::namespaced(api.client.clone(), &caller.namespace);
    let body = serde_json::json!({
        "apiVersion": MemoryAwareTrainingJob::api_version(&()),
        "kind": MemoryAwareTrainingJob::kind(&()),
        // The uid makes the write a precondition: never onto a newer job of the same name.
        "metadata": {"name": caller.job, "uid": caller.job_uid},
        "status": {"workers": [telemetry]},
    });
    let manager = format!("{WORKER_FIELD_MANAGER_PREFIX}{}", caller.pod);
    api.reports.writes.inc();
    jobs.patch_status(
        &caller.job,
        &PatchParams::apply(&manager).force(),
        &Patch::Apply(&body),
    )
    .await
    .map(drop)
}

/// `GET /v1/peers/<pod>`: a pod of the caller's own job.
async fn peer(
    State(api): State<Arc<WorkerApi>>,
    headers: HeaderMap,
    Path(pod): Path<String>,
) -> Result<Response, Refusal> {
    let caller = api.caller(&headers).await?;
    if !is_object_name(&pod) {
        return Err(Refusal::BadRequest(format!(
            "{pod:?} is not a pod name (lowercase letters, digits, '-' and '.', at most 253)"
        )));
    }
    let Some(peer) = api.peer_pod(&caller.namespace, &pod).await? else {
        // Not created yet (its attempt is being launched) reads as no IP yet.
        return Ok(address(None));
    };
    if owning_job(&peer).as_ref().map(|(_, uid)| uid) != Some(&caller.job_uid) {
        return Err(Refusal::Forbidden(format!(
            "pod {pod} is not a worker of job {}/{}",
            caller.namespace, caller.job
        )));
    }
    Ok(address(peer.status.as_ref().and_then(|s| s.pod_ip.clone())))
}

/// `GET /v1/peer-key`: the link key of the caller's attempt of its job.
async fn job_key(
    State(api): State<Arc<WorkerApi>>,
    headers: HeaderMap,
) -> Result<Response, Refusal> {
    let caller = api.caller(&headers).await?;
    let body = serde_json::to_string(&peer_key_for(&api.key, &caller)?).unwrap_or_default();
    Ok((
        [
            (header::CONTENT_TYPE, "application/json"),
            (header::CACHE_CONTROL, "no-store"),
        ],
        body,
    )
        .into_response())
}

/// The key a caller may learn: its own attempt's. The initializer (attempt
/// 0: it has no attempt label) links to no peers, so it gets none, and a
/// job's image that runs as its initializer cannot learn the key the
/// training workers will use.
fn peer_key_for(key: &OperatorKey, caller: &Caller) -> Result<PeerKey, Refusal> {
    if caller.attempt == 0 {
        return Err(Refusal::Forbidden(format!(
            "pod {} is job {}/{}'s initializer: it links to no peers, so it gets no peer key",
            caller.pod, caller.namespace, caller.job
        )));
    }
    Ok(PeerKey {
        key: key.attempt_key_hex(&caller.namespace, &caller.job_uid, caller.attempt),
    })
}

/// A DNS-1123 subdomain, what Kubernetes accepts as a pod name: checked
/// before it becomes part of an API path.
fn is_object_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name
            .bytes()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-' || c == b'.')
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name.ends_with(|c: char| c.is_ascii_alphanumeric())
}

fn address(pod_ip: Option<String>) -> Response {
    let body = serde_json::to_string(&PeerAddress { pod_ip }).unwrap_or_default();
    ([(header::CONTENT_TYPE, "application/json")], body).into_response()
}

/// A peer from the leader's pod cache: `None` on a replica without one,
/// else the answer, `Some(None)` for a pod the cache does not hold (not
/// created yet, or no job's pod at all: either way no address to give).
fn cached_peer(pods: &WatchedPods, namespace: &str, name: &str) -> Option<Option<Arc<Pod>>> {
    pods.is_filled().then(|| pods.get(namespace, name))
}

impl WorkerApi {
    /// The pod `name` of `namespace`: from the leader's pod cache, so that
    /// workers polling for their peers' addresses cost the API server
    /// nothing; read from the API server only on a replica without it.
    async fn peer_pod(&self, namespace: &str, name: &str) -> Result<Option<Arc<Pod>>, Refusal> {
        if let Some(cached) = cached_peer(&self.pods, namespace, name) {
            return Ok(cached);
        }
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        let read = pods.get_opt(name).await.map_err(Refusal::Upstream)?;
        Ok(read.map(Arc::new))
    }

    /// The caller behind the request's bearer token.
    async fn caller(&self, headers: &HeaderMap) -> Result<Caller, Refusal> {
        let token = crate::token_cache::bearer_token(headers).ok_or(Refusal::NoToken)?;
        self.identities.caller(token).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::runtime::{reflector, watcher};

    fn caller(attempt: u32) -> Caller {
        Caller {
            namespace: "team-a".into(),
            pod: "job-a1-s0".into(),
            job: "job".into(),
            job_uid: "uid-1".into(),
            attempt,
            stage: 0,
        }
    }

    /// Each attempt's workers learn their own attempt's key; the
    /// initializer learns none.
    #[test]
    fn a_worker_learns_its_attempts_key_and_the_initializer_none() {
        let key = OperatorKey::random().expect("random");
        let first = peer_key_for(&key, &caller(1)).expect("a worker of attempt 1");
        let second = peer_key_for(&key, &caller(2)).expect("a worker of attempt 2");
        assert_eq!(first.key, key.attempt_key_hex("team-a", "uid-1", 1));
        assert_ne!(first.key, second.key);
        let refused = peer_key_for(&key, &caller(0));
        assert!(
            matches!(&refused, Err(Refusal::Forbidden(m)) if m.contains("initializer")),
            "{refused:?}"
        );
    }

    /// On the leader a peer's address comes from the pod cache, never the
    /// API server; only a replica without the cache reads it.
    #[test]
    fn peers_come_from_the_pod_cache_when_there_is_one() {
        let standby = WatchedPods::default();
        assert!(cached_peer(&standby, "team-a", "job-a1-s1").is_none());
        let (store, mut writer) = reflector::store::<Pod>();
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "job-a1-s1", "namespace": "team-a"},
            "status": {"podIP": "10.0.0.7"}
        }))
        .expect("pod");
        writer.apply_watcher_event(&watcher::Event::Apply(pod));
        let leader = WatchedPods::default();
        leader.fill(store);
        let peer = cached_peer(&leader, "team-a", "job-a1-s1")
            .expect("the leader answers from its cache")
            .expect("the pod is cached");
        assert_eq!(
            peer.status.as_ref().and_then(|s| s.pod_ip.as_deref()),
            Some("10.0.0.7")
        );
        assert!(matches!(
            cached_peer(&leader, "team-b", "job-a1-s1"),
            Some(None)
        ));
        assert!(matches!(
            cached_peer(&leader, "team-a", "not-yet"),
            Some(None)
        ));
    }

    #[test]
    fn only_object_names_become_api_paths() {
        for good in ["job-a1-s0", "a", "x.y-1", &"a".repeat(253)] {
            assert!(is_object_name(good), "{good}");
        }
        for bad in [
            "",
            "../secrets",
            "a/b",
            "A",
            "-a",
            "a-",
            "a%2fb",
            "a?b",
            &"a".repeat(254),
        ] {
            assert!(!is_object_name(bad), "{bad}");
        }
    }
}
