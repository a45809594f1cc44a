//! Who is calling: a pod-bound token checked with a TokenReview, the pod it
//! is bound to, and that pod's job, attempt and stage (from the pod's own
//! labels, which only the operator writes, never from what the caller says).
//!
//! Checking a token costs a TokenReview and a pod read against the
//! operator's own client budget, so the checks are remembered and bounded
//! the way Kubernetes' delegating authenticator bounds them:
//!
//! * an accepted token stands for its pod while the leader's pod cache
//!   ([`WatchedPods`]) still holds that pod, up to the token's own expiry
//!   and at most [`WATCHED_IDENTITY_TTL`]: the pod is read from the cache,
//!   and a deleted pod's token is forgotten as soon as the watch sees the
//!   deletion (kube-apiserver checks a bound token against its informer the
//!   same way). A replica without the cache (a standby, or a pod outside
//!   the watched namespace) reads the pod and keeps the answer for
//!   [`IDENTITY_TTL`];
//! * a refused one is refused again from memory for [`REFUSAL_TTL`], whatever
//!   refused it (the API server, a pod that is no worker of a job, a pod
//!   the operator may not read, a pod gone), so a caller repeating a bad
//!   token costs nothing;
//! * before any review, the token's own claims (read unverified: a
//!   pre-filter only, the TokenReview stays the authority) must name the
//!   worker API's audience, an expiry still ahead and a pod
//!   ([`precheck`]): a string that merely looks like a JWT, a token for
//!   another audience or an expired one is refused without a review;
//! * at most [`MAX_CONCURRENT_REVIEWS`] reviews run at once; a call that
//!   cannot start one within [`REVIEW_QUEUE_WAIT`] is told to come back
//!   (503), instead of queueing without bound behind a flood;
//! * both caches are keyed by SHA-256 of the token: the operator's memory
//!   holds no replayable credential.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine;

use headroom_api::{LABEL_ATTEMPT, LABEL_STAGE, WORKER_API_AUDIENCE};
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};
use kube::{Client, ResourceExt};
use tokio::sync::Semaphore;

use super::Refusal;
use crate::token_cache::{Remembered, token_hash};
use crate::watched_pods::{WatchedPods, owning_job};

/// How long a checked token stands for its pod before it is checked again,
/// on a replica that cannot see the pod go. Short against a projected
/// token's lifetime (at least 10 minutes), long against the telemetry
/// interval. A pod deleted within it keeps its identity until it runs out:
/// its token can still write only that pod's own entry of a job whose uid
/// matches (SECURITY.md).
pub const IDENTITY_TTL: Duration = Duration::from_secs(60);
/// How long at most a checked token stands for its pod while the pod cache
/// shows the pod alive (a projected token's shortest lifetime). A deleted
/// pod ends it at once; what it bounds is the rest of what a TokenReview
/// checks: a service account deleted or recreated.
pub const WATCHED_IDENTITY_TTL: Duration = Duration::from_secs(600);
/// How long a refused token is refused without asking the API server again
/// (what kube-apiserver's webhook token authenticator caches failures for).
pub const REFUSAL_TTL: Duration = Duration::from_secs(10);
/// TokenReviews (each with a pod read) in flight at once.
pub const MAX_CONCURRENT_REVIEWS: usize = 8;
/// How long a call waits for a review slot before it is answered 503.
pub const REVIEW_QUEUE_WAIT: Duration = Duration::from_secs(5);
/// A service-account JWT is 1–2 KiB; anything much longer is not one and
/// is refused before it costs a review.
pub const MAX_TOKEN_BYTES: usize = 8 * 1024;

/// Who called: the pod a token is bound to, that pod's job, and the attempt
/// and stage its labels put it in (0 and 0 for the initializer, which has
/// neither label and reports as attempt 0).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Caller {
    pub namespace: String,
    pub pod: String,
    pub job: String,
    pub job_uid: String,
    pub attempt: u32,
    pub stage: u32,
}

/// An accepted token: who it is, and whether the pod cache vouches for it.
#[derive(Clone)]
pub struct Accepted {
    caller: Caller,
    pod_uid: String,
    /// The pod was found in the leader's cache: the entry holds while it is there.
    watched: bool,
}

/// A refusal worth remembering: the same answer, with the same status
/// code, for every repeat within [`REFUSAL_TTL`].
#[derive(Clone)]
enum Refused {
    Unauthenticated(String),
    Forbidden(String),
}

impl Refused {
    /// Refusals that say something about the token itself. A failure to
    /// reach the API server, or a full review queue, says nothing about it
    /// and is not remembered.
    fn of(refusal: &Refusal) -> Option<Self> {
        match refusal {
            Refusal::Unauthenticated(reason) => Some(Refused::Unauthenticated(reason.clone())),
            Refusal::Forbidden(reason) => Some(Refused::Forbidden(reason.clone())),
            _ => None,
        }
    }

    fn refusal(self) -> Refusal {
        match self {
            Refused::Unauthenticated(reason) => Refusal::Unauthenticated(reason),
            Refused::Forbidden(reason) => Refusal::Forbidden(reason),
        }
    }
}

/// What finds who a token stands for: the API server ([`ApiReviewer`]),
/// or a stand-in that counts its calls in tests.
pub trait Reviewer: Send + Sync {
    fn review(&self, token: &str) -> impl Future<Output = Result<Accepted, Refusal>> + Send;
}

/// Checks tokens, remembering answers and bounding the reviews in flight.
pub struct Identities<R = ApiReviewer> {
    reviewer: R,
    pods: WatchedPods,
    accepted: Remembered<Accepted>,
    refused: Remembered<Refused>,
    reviews: Semaphore,
}

impl Identities {
    pub fn new(client: Client, pods: WatchedPods) -> Self {
        Identities::with_reviewer(
            ApiReviewer {
                client,
                pods: pods.clone(),
            },
            pods,
        )
    }
}

impl<R: Reviewer> Identities<R> {
    fn with_reviewer(reviewer: R, pods: WatchedPods) -> Self {
        Identities {
            reviewer,
            pods,
            accepted: Remembered::new(),
            refused: Remembered::new(),
            reviews: Semaphore::new(MAX_CONCURRENT_REVIEWS),
        }
    }

    /// The caller behind `token` (the bearer token, already taken from the header).
    pub async fn caller(&self, token: &str) -> Result<Caller, Refusal> {
        if token.len() > MAX_TOKEN_BYTES || token.split('.').count() != 3 {
            return Err(Refusal::Unauthenticated(
                "not a service-account token (a JWT of at most 8 KiB)".into(),
            ));
        }
        let key = token_hash(token);
        if let Some(accepted) = self.accepted.get(&key) {
            if !accepted.watched || self.still_watched(&accepted) {
                return Ok(accepted.caller);
            }
            // The pod left the cache (deleted): review the token again,
            // which the API server refuses for a deleted pod.
            self.accepted.forget(&key);
        }
        if let Some(refused) = self.refused.get(&key) {
            return Err(refused.refusal());
        }
        // Not remembered: a failed pre-filter costs a parse, no review.
        let expires_in = precheck(token, unix_now()).map_err(|why| {
            Refusal::Unauthenticated(format!(
                "not a worker-API token: {why} (send the pod's projected token, audience {WORKER_API_AUDIENCE})"
            ))
        })?;
        let _slot = tokio::time::timeout(REVIEW_QUEUE_WAIT, self.reviews.acquire())
            .await
            .map_err(|_| Refusal::Busy)?
            .map_err(|_| Refusal::Busy)?;
        match self.reviewer.review(token).await {
            Ok(accepted) => {
                let ttl = if accepted.watched {
                    WATCHED_IDENTITY_TTL
                } else {
                    IDENTITY_TTL
                };
                let caller = accepted.caller.clone();
                self.accepted.put(key, accepted, expires_in.min(ttl));
                Ok(caller)
            }
            Err(refusal) => {
                if let Some(refused) = Refused::of(&refusal) {
                    self.refused.put(key, refused, REFUSAL_TTL);
                }
                Err(refusal)
            }
        }
    }

    /// Whether the leader's cache still holds the pod an entry was accepted for.
    fn still_watched(&self, accepted: &Accepted) -> bool {
        self.pods
            .get(&accepted.caller.namespace, &accepted.caller.pod)
            .is_some_and(|p| p.uid().as_deref() == Some(accepted.pod_uid.as_str()))
    }
}

/// Reviews tokens with the operator's own client.
pub struct ApiReviewer {
    client: Client,
    pods: WatchedPods,
}

impl Reviewer for ApiReviewer {
    async fn review(&self, token: &str) -> Result<Accepted, Refusal> {
        let (namespace, pod_name, pod_uid) = self.token_review(token).await?;
        let is_bound = |p: &Pod| p.uid().as_deref() == Some(pod_uid.as_str());
        let watched = self.pods.get(&namespace, &pod_name).filter(|p| is_bound(p));
        let pod = match &watched {
            Some(pod) => pod.clone(),
            None => self
                .read_pod(&namespace, &pod_name)
                .await?
                .filter(is_bound)
                .map(std::sync::Arc::new)
                .ok_or_else(|| {
                    Refusal::Unauthenticated(format!("pod {namespace}/{pod_name} no longer exists"))
                })?,
        };
        let (job, job_uid) = owning_job(&pod).ok_or_else(|| {
            Refusal::Forbidden(format!(
                "pod {namespace}/{pod_name} is not a Headroom worker (no job owns it)"
            ))
        })?;
        let label = |key: &str| -> Result<u32, Refusal> {
            pod.labels().get(key).map_or(Ok(0), |v| {
                v.parse().map_err(|_| {
                    Refusal::Forbidden(format!("pod {namespace}/{pod_name} has label {key}={v:?}"))
                })
            })
        };
        Ok(Accepted {
            caller: Caller {
                attempt: label(LABEL_ATTEMPT)?,
                stage: label(LABEL_STAGE)?,
                namespace: namespace.clone(),
                pod: pod_name,
                job,
                job_uid,
            },
            pod_uid,
            watched: watched.is_some(),
        })
    }
}

impl ApiReviewer {
    /// The TokenReview: the namespace, name and uid of the pod the token is
    /// bound to, when the API server accepts it for our audience.
    async fn token_review(&self, token: &str) -> Result<(String, String, String), Refusal> {
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
        // The API server answers for the audiences it found the token valid
        // for; an authenticator that ignored the requested audience (one
        // that answers with none, or others) has not vouched for ours.
        if !status
            .audiences
            .as_ref()
            .is_some_and(|a| a.iter().any(|a| a == WORKER_API_AUDIENCE))
        {
            return Err(Refusal::Unauthenticated(format!(
                "the token is not valid for audience {WORKER_API_AUDIENCE} (reviewed for {:?})",
                status.audiences.unwrap_or_default()
            )));
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
        Ok((namespace, pod_name, pod_uid))
    }

    /// The pod from the API server, on a replica without the cache or for
    /// a pod the cache does not hold. A namespace the operator may not read
    /// pods in (one outside those it watches) is a refusal of the caller,
    /// remembered like any other, not an upstream failure retried per call.
    async fn read_pod(&self, namespace: &str, name: &str) -> Result<Option<Pod>, Refusal> {
        Api::<Pod>::namespaced(self.client.clone(), namespace)
            .get_opt(name)
            .await
            .map_err(|e| match e {
                kube::Error::Api(e) if e.code == 403 => Refusal::Forbidden(format!(
                    "pod {namespace}/{name} is outside the namespaces this operator serves"
                )),
                e => Refusal::Upstream(e),
            })
    }
}

/// The claims of a projected service-account token the pre-filter reads.
#[derive(serde::Deserialize)]
struct Claims {
    aud: Audiences,
    exp: u64,
    #[serde(rename = "kubernetes.io")]
    kubernetes: KubernetesClaims,
}

/// `aud`: one string or a list of them (RFC 7519).
#[derive(serde::Deserialize)]
#[serde(untagged)]
enum Audiences {
    One(String),
    Many(Vec<String>),
}

#[derive(serde::Deserialize)]
struct KubernetesClaims {
    pod: PodClaims,
}

#[derive(serde::Deserialize)]
struct PodClaims {
    name: String,
    uid: String,
}

/// Seconds since the epoch (0 on a clock before it, which expires nothing early).
fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The pre-filter: a token's own claims, read from its payload without
/// checking the signature, must name the worker API's audience, an expiry
/// after `now` (seconds since the epoch) and the pod it is bound to (the
/// kubelet's projected tokens all do). Returns how long the token has left,
/// which also ends a remembered acceptance sooner. It only spares the API
/// server obvious misses: whatever passes is still reviewed. The parse is
/// bounded: the token is at most [`MAX_TOKEN_BYTES`], and serde_json stops
/// at 128 levels of nesting.
fn precheck(token: &str, now: u64) -> Result<Duration, String> {
    let payload = token.split('.').nth(1).unwrap_or_default();
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload.trim_end_matches('='))
        .map_err(|_| "its payload is not base64url".to_string())?;
    let claims: Claims = serde_json::from_slice(&bytes).map_err(|e| {
        format!("its payload is not a projected token's claims (aud, exp, kubernetes.io.pod): {e}")
    })?;
    let audiences = match &claims.aud {
        Audiences::One(one) => std::slice::from_ref(one),
        Audiences::Many(many) => many.as_slice(),
    };
    if !audiences.iter().any(|a| a == WORKER_API_AUDIENCE) {
        return Err(format!("its audience is {audiences:?}"));
    }
    if claims.exp <= now {
        return Err(format!("it expired {} s ago", now - claims.exp));
    }
    let pod = &claims.kubernetes.pod;
    if pod.name.is_empty() || pod.uid.is_empty() {
        return Err("it is not bound to a pod".into());
    }
    Ok(Duration::from_secs(claims.exp - now))
}

#[cfg(test)]
mod tests {
    use super::*;
    use base64::engine::general_purpose::URL_SAFE_NO_PAD;
    use serde_json::json;
    use std::sync::{Arc, Mutex};

    fn jwt(payload: serde_json::Value) -> String {
        let part = |v: serde_json::Value| URL_SAFE_NO_PAD.encode(v.to_string());
        format!("{}.{}.c2ln", part(json!({"alg": "RS256"})), part(payload))
    }

    const NOW: u64 = 1_800_000_000;

    /// A projected token's claims, as the kubelet writes them.
    fn claims(exp: u64) -> serde_json::Value {
        json!({
            "aud": [WORKER_API_AUDIENCE],
            "exp": exp,
            "iat": exp - 600,
            "sub": "system:serviceaccount:team-a:default",
            "kubernetes.io": {
                "namespace": "team-a",
                "pod": {"name": "job-a1-s0", "uid": "pod-uid"},
                "serviceaccount": {"name": "default", "uid": "sa-uid"}
            }
        })
    }

    /// A remembered identity never outlives the token it was checked for;
    /// a token whose own claims already rule it out is never reviewed.
    #[test]
    fn the_pre_filter_reads_audience_expiry_and_pod_from_the_payload() {
        assert_eq!(
            precheck(&jwt(claims(NOW + 300)), NOW),
            Ok(Duration::from_secs(300))
        );
        let mut one_audience = claims(NOW + 5);
        one_audience["aud"] = json!(WORKER_API_AUDIENCE);
        assert_eq!(
            precheck(&jwt(one_audience), NOW),
            Ok(Duration::from_secs(5))
        );
        let refused = |payload: serde_json::Value, why: &str| {
            let err = precheck(&jwt(payload), NOW).expect_err(why);
            assert!(err.contains(why), "{err}");
        };
        let mut api_server = claims(NOW + 300);
        api_server["aud"] = json!(["https://kubernetes.default.svc"]);
        refused(
            api_server,
            "audience is [\"https://kubernetes.default.svc\"]",
        );
        refused(claims(NOW), "expired 0 s ago");
        refused(claims(NOW - 10), "expired 10 s ago");
        let mut unbound = claims(NOW + 300);
        unbound["kubernetes.io"]
            .as_object_mut()
            .expect("object")
            .remove("pod");
        refused(unbound, "kubernetes.io.pod");
        let mut nameless = claims(NOW + 300);
        nameless["kubernetes.io"]["pod"]["name"] = json!("");
        refused(nameless, "not bound to a pod");
        refused(json!({"exp": "soon"}), "not a projected token's claims");
        let err = precheck("a.!!!.c", NOW).expect_err("not base64");
        assert!(err.contains("not base64url"), "{err}");
    }

    /// What a stand-in review answers.
    type Answer = fn() -> Result<Accepted, Refusal>;

    /// Answers what it is told to, and counts the reviews asked of it.
    struct Counting {
        answer: Answer,
        reviews: std::sync::atomic::AtomicUsize,
    }

    impl Reviewer for Counting {
        async fn review(&self, _token: &str) -> Result<Accepted, Refusal> {
            self.reviews
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            (self.answer)()
        }
    }

    fn identities(answer: Answer) -> Identities<Counting> {
        let reviewer = Counting {
            answer,
            reviews: Default::default(),
        };
        Identities::with_reviewer(reviewer, WatchedPods::default())
    }

    fn reviews(ids: &Identities<Counting>) -> usize {
        ids.reviewer
            .reviews
            .load(std::sync::atomic::Ordering::SeqCst)
    }

    fn a_worker() -> Result<Accepted, Refusal> {
        Ok(Accepted {
            caller: Caller {
                namespace: "team-a".into(),
                pod: "job-a1-s0".into(),
                job: "job".into(),
                job_uid: "job-uid".into(),
                attempt: 1,
                stage: 0,
            },
            pod_uid: "pod-uid".into(),
            watched: false,
        })
    }

    /// Every refusal of a review is remembered, whatever refused it: the
    /// API server, or a pod that is no worker, outside the namespaces the
    /// operator serves, or gone. A repeated bad token costs one review.
    #[tokio::test]
    async fn a_refused_token_is_reviewed_once_whatever_refused_it() {
        let answers: [(Answer, u16); 3] = [
            (|| Err(Refusal::Unauthenticated("no".into())), 401),
            (|| Err(Refusal::Forbidden("not a worker".into())), 403),
            (|| Err(Refusal::Forbidden("outside".into())), 403),
        ];
        for (answer, code) in answers {
            let ids = identities(answer);
            let token = jwt(claims(unix_now() + 600));
            for _ in 0..5 {
                let refusal = ids.caller(&token).await.expect_err("refused");
                let status = axum::response::IntoResponse::into_response(refusal).status();
                assert_eq!(status.as_u16(), code);
            }
            assert_eq!(reviews(&ids), 1, "a repeated refused token");
        }
        // A failure to reach the API server says nothing about the token.
        let ids = identities(|| Err(Refusal::Busy));
        let token = jwt(claims(unix_now() + 600));
        for _ in 0..2 {
            ids.caller(&token).await.expect_err("busy");
        }
        assert_eq!(reviews(&ids), 2);
    }

    /// Tokens the pre-filter rules out are refused without a review;
    /// an accepted one is reviewed once.
    #[tokio::test]
    async fn a_token_for_another_audience_or_expired_is_never_reviewed() {
        let ids = identities(a_worker);
        let mut other = claims(unix_now() + 600);
        other["aud"] = json!(["https://kubernetes.default.svc"]);
        for bad in [
            jwt(other),
            jwt(claims(unix_now() - 1)),
            "eyJh.bm90IGpzb24.c2ln".to_string(),
        ] {
            let refusal = ids.caller(&bad).await.expect_err("pre-filtered");
            assert!(
                matches!(&refusal, Refusal::Unauthenticated(r) if r.contains("not a worker-API token")),
                "{refusal}"
            );
        }
        assert_eq!(reviews(&ids), 0, "no review for what the claims rule out");
        let token = jwt(claims(unix_now() + 600));
        for _ in 0..3 {
            let caller = ids.caller(&token).await.expect("accepted");
            assert_eq!(caller.pod, "job-a1-s0");
        }
        assert_eq!(reviews(&ids), 1);
    }

    /// A stand-in API server: every TokenReview accepts the token for pod
    /// team-b/outsider; the pod read answers `pod_code` (403: a namespace
    /// the operator may not read; 404: the pod is gone). Every request's
    /// path is noted in `hits`.
    fn api_server(pod_code: u16, hits: Arc<Mutex<Vec<String>>>) -> Client {
        let service = tower::service_fn(move |request: axum::http::Request<kube::client::Body>| {
            let path = request.uri().path().to_string();
            if let Ok(mut hits) = hits.lock() {
                hits.push(path.clone());
            }
            let (code, body) = if path.ends_with("/tokenreviews") {
                let extra = json!({
                    "authentication.kubernetes.io/pod-name": ["outsider"],
                    "authentication.kubernetes.io/pod-uid": ["pod-uid"]
                });
                let user = json!({
                    "username": "system:serviceaccount:team-b:default", "extra": extra
                });
                let status = json!({
                    "authenticated": true, "audiences": [WORKER_API_AUDIENCE], "user": user
                });
                let review = json!({
                    "apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
                    "spec": {}, "status": status
                });
                (201, review)
            } else {
                let reason = if pod_code == 404 {
                    "NotFound"
                } else {
                    "Forbidden"
                };
                let status = json!({
                    "kind": "Status", "apiVersion": "v1", "status": "Failure",
                    "message": reason, "reason": reason, "code": pod_code
                });
                (pod_code, status)
            };
            let response = axum::http::Response::builder()
                .status(code)
                .header("content-type", "application/json")
                .body(kube::client::Body::from(body.to_string().into_bytes()));
            std::future::ready(response)
        });
        Client::new(service, "default")
    }

    /// With the real review: a pod in a namespace the operator may not read
    /// (its read is forbidden) and a pod gone are refused, and the refusal
    /// is remembered: a repeated token costs one review and one pod read.
    #[tokio::test]
    async fn a_pod_out_of_reach_or_gone_costs_one_review_and_one_read() {
        for (pod_code, code, says) in [
            (403, 403, "outside the namespaces"),
            (404, 401, "no longer exists"),
        ] {
            let hits = Arc::new(Mutex::new(Vec::new()));
            let ids = Identities::new(api_server(pod_code, hits.clone()), WatchedPods::default());
            let token = jwt(claims(unix_now() + 600));
            for _ in 0..3 {
                let refusal = ids.caller(&token).await.expect_err("refused");
                assert!(refusal.to_string().contains(says), "{refusal}");
                let status = axum::response::IntoResponse::into_response(refusal).status();
                assert_eq!(status.as_u16(), code);
            }
            let hits = hits.lock().expect("hits").clone();
            assert_eq!(
                hits,
                [
                    "/apis/authentication.k8s.io/v1/tokenreviews",
                    "/api/v1/namespaces/team-b/pods/outsider"
                ],
                "one review and one read for three calls"
            );
        }
    }
}
