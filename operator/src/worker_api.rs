//! The operator's API for its own workers: telemetry in, peers' addresses out.
//!
//! Why it exists: a worker used to run under a per-job ServiceAccount, Role
//! and RoleBinding so that it could patch its job's status and read its
//! peers' pods. That was three API writes per job before its first pod (the
//! launch path's largest cost, issue 16) and Kubernetes API rights inside
//! every training container. Now workers hold none. A worker presents the
//! token the kubelet projects into its pod (bound to the pod, audience
//! [`WORKER_API_AUDIENCE`], useless against the API server itself); the
//! operator checks it with a TokenReview, finds the pod it is bound to and
//! that pod's job, and acts for it within that job only:
//!
//! * `POST /v1/telemetry` — a [`WorkerTelemetry`] becomes the caller's own
//!   `status.workers` entry, server-side applied under the caller's field
//!   manager (`headroom-worker/<pod>`), exactly as workers wrote it before.
//! * `GET /v1/peers/<pod>` — the IP of another pod of the caller's job.
//!
//! A checked token is remembered for [`IDENTITY_TTL`], so a worker reporting
//! every few seconds costs one TokenReview and one pod read a minute, not
//! per report.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use headroom_api::{
    LABEL_JOB, MemoryAwareTrainingJob, PeerAddress, WORKER_API_AUDIENCE, WORKER_API_PEERS_PATH,
    WORKER_API_TELEMETRY_PATH, WORKER_FIELD_MANAGER_PREFIX, WorkerTelemetry,
};
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::{Client, Resource, ResourceExt};

/// How long a checked token stands for its pod before it is checked again.
/// Short against a projected token's lifetime (at least 10 minutes), long
/// against the telemetry interval.
pub const IDENTITY_TTL: Duration = Duration::from_secs(60);
/// Identities kept at most; beyond it the expired ones are dropped, then all.
const MAX_IDENTITIES: usize = 20_000;

/// Who called: the pod a token is bound to, and that pod's job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Caller {
    pub namespace: String,
    pub pod: String,
    pub job: String,
    pub job_uid: String,
}

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
    #[error("the worker API could not reach the Kubernetes API: {0}")]
    Upstream(#[source] kube::Error),
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        let code = match &self {
            Refusal::NoToken | Refusal::Unauthenticated(_) => StatusCode::UNAUTHORIZED,
            Refusal::Forbidden(_) => StatusCode::FORBIDDEN,
            Refusal::BadRequest(_) => StatusCode::BAD_REQUEST,
            Refusal::Upstream(_) => StatusCode::BAD_GATEWAY,
        };
        if code != StatusCode::BAD_REQUEST {
            tracing::info!(code = code.as_u16(), reason = %self, "worker API call refused");
        }
        (code, self.to_string()).into_response()
    }
}

struct WorkerApi {
    client: Client,
    identities: Mutex<HashMap<String, (Caller, Instant)>>,
}

/// The worker API's routes, acting with `client` (the operator's own
/// credentials: it needs `create` on tokenreviews, `get` on pods and `patch`
/// on memoryawaretrainingjobs/status).
pub fn router(client: Client) -> Router {
    let state = Arc::new(WorkerApi {
        client,
        identities: Mutex::new(HashMap::new()),
    });
    Router::new()
        .route(WORKER_API_TELEMETRY_PATH, post(telemetry))
        .route(&format!("{WORKER_API_PEERS_PATH}{{pod}}"), get(peer))
        .with_state(state)
}

/// `POST /v1/telemetry`: the caller's own status entry.
async fn telemetry(
    State(api): State<Arc<WorkerApi>>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<StatusCode, Refusal> {
    let caller = api.caller(&headers).await?;
    let de = &mut serde_json::Deserializer::from_slice(&body);
    let telemetry: WorkerTelemetry = serde_path_to_error::deserialize(de)
        .map_err(|e| Refusal::BadRequest(format!("telemetry body: {e}")))?;
    if telemetry.name != caller.pod {
        return Err(Refusal::Forbidden(format!(
            "telemetry names worker {:?}, but the token is pod {}'s: a worker reports only its own entry",
            telemetry.name, caller.pod
        )));
    }
    let jobs: Api<MemoryAwareTrainingJob> = Api::namespaced(api.client.clone(), &caller.namespace);
    let body = serde_json::json!({
        "apiVersion": MemoryAwareTrainingJob::api_version(&()),
        "kind": MemoryAwareTrainingJob::kind(&()),
        // The uid makes the write a precondition: never onto a newer job of the same name.
        "metadata": {"name": caller.job, "uid": caller.job_uid},
        "status": {"workers": [telemetry]},
    });
    let manager = format!("{WORKER_FIELD_MANAGER_PREFIX}{}", caller.pod);
    match jobs
        .patch_status(
            &caller.job,
            &PatchParams::apply(&manager).force(),
            &Patch::Apply(&body),
        )
        .await
    {
        Ok(_) => Ok(StatusCode::NO_CONTENT),
        Err(kube::Error::Api(e)) if matches!(e.code, 404 | 409) => {
            Err(Refusal::Forbidden(format!(
                "job {}/{} is gone: {}",
                caller.namespace, caller.job, e.message
            )))
        }
        Err(e) => Err(Refusal::Upstream(e)),
    }
}

/// `GET /v1/peers/<pod>`: a pod of the caller's own job.
async fn peer(
    State(api): State<Arc<WorkerApi>>,
    headers: HeaderMap,
    Path(pod): Path<String>,
) -> Result<Response, Refusal> {
    let caller = api.caller(&headers).await?;
    let pods: Api<Pod> = Api::namespaced(api.client.clone(), &caller.namespace);
    let Some(peer) = pods.get_opt(&pod).await.map_err(Refusal::Upstream)? else {
        // Not created yet (its attempt is being launched) reads as no IP yet.
        return Ok(address(None));
    };
    if owning_job(&peer).as_ref().map(|(_, uid)| uid) != Some(&caller.job_uid) {
        return Err(Refusal::Forbidden(format!(
            "pod {pod} is not a worker of job {}/{}",
            caller.namespace, caller.job
        )));
    }
    Ok(address(peer.status.and_then(|s| s.pod_ip)))
}

fn address(pod_ip: Option<String>) -> Response {
    let body = serde_json::to_string(&PeerAddress { pod_ip }).unwrap_or_default();
    ([(header::CONTENT_TYPE, "application/json")], body).into_response()
}

/// The job that controls `pod` and carries its label: (name, uid).
fn owning_job(pod: &Pod) -> Option<(String, String)> {
    let label = pod.labels().get(LABEL_JOB)?;
    pod.owner_references()
        .iter()
        .find(|o| {
            o.controller == Some(true)
                && o.kind == MemoryAwareTrainingJob::kind(&())
                && o.api_version == MemoryAwareTrainingJob::api_version(&())
                && &o.name == label
        })
        .map(|o| (o.name.clone(), o.uid.clone()))
}

impl WorkerApi {
    /// The caller behind the request's bearer token.
    async fn caller(&self, headers: &HeaderMap) -> Result<Caller, Refusal> {
        let token = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .ok_or(Refusal::NoToken)?;
        if let Ok(known) = self.identities.lock()
            && let Some((caller, at)) = known.get(token)
            && at.elapsed() < IDENTITY_TTL
        {
            return Ok(caller.clone());
        }
        let caller = self.review(token).await?;
        if let Ok(mut known) = self.identities.lock() {
            if known.len() >= MAX_IDENTITIES {
                known.retain(|_, (_, at)| at.elapsed() < IDENTITY_TTL);
                if known.len() >= MAX_IDENTITIES {
                    known.clear();
                }
            }
            known.insert(token.to_string(), (caller.clone(), Instant::now()));
        }
        Ok(caller)
    }

    /// TokenReview, then the pod the token is bound to, then its job.
    async fn review(&self, token: &str) -> Result<Caller, Refusal> {
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: Some(token.to_string()),
                audiences: Some(vec![WORKER_API_AUDIENCE.to_string()]),
            },
            ..TokenReview::default()
        };
        let reviewed = Api::<TokenReview>::all(self.client.clone())
            .create(&PostParams::default(), &review)
            .await
            .map_err(Refusal::Upstream)?;
        let status = reviewed.status.unwrap_or_default();
        if status.authenticated != Some(true) {
            return Err(Refusal::Unauthenticated(
                status
                    .error
                    .unwrap_or_else(|| "not authenticated".to_string()),
            ));
        }
        let user = status.user.unwrap_or_default();
        let extra = user.extra.unwrap_or_default();
        let first = |key: &str| extra.get(key).and_then(|v| v.first()).cloned();
        let (Some(pod_name), Some(pod_uid)) = (
            first("authentication.kubernetes.io/pod-name"),
            first("authentication.kubernetes.io/pod-uid"),
        ) else {
            return Err(Refusal::Unauthenticated(format!(
                "the token of {} is not bound to a pod (use the pod's projected token)",
                user.username.unwrap_or_default()
            )));
        };
        // system:serviceaccount:<namespace>:<name>
        let namespace = user
            .username
            .as_deref()
            .and_then(|u| u.strip_prefix("system:serviceaccount:"))
            .and_then(|rest| rest.split_once(':'))
            .map(|(ns, _)| ns.to_string())
            .ok_or_else(|| Refusal::Unauthenticated("not a service-account token".to_string()))?;
        let pod = Api::<Pod>::namespaced(self.client.clone(), &namespace)
            .get_opt(&pod_name)
            .await
            .map_err(Refusal::Upstream)?
            .filter(|p| p.uid().as_deref() == Some(pod_uid.as_str()))
            .ok_or_else(|| {
                Refusal::Unauthenticated(format!("pod {namespace}/{pod_name} no longer exists"))
            })?;
        let (job, job_uid) = owning_job(&pod).ok_or_else(|| {
            Refusal::Forbidden(format!(
                "pod {namespace}/{pod_name} is not a Headroom worker (no job owns it)"
            ))
        })?;
        Ok(Caller {
            namespace,
            pod: pod_name,
            job,
            job_uid,
        })
    }
}
