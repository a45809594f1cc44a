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
//! * a refused one is refused again from memory for [`REFUSAL_TTL`], so a
//!   caller repeating a bad token costs nothing;
//! * at most [`MAX_CONCURRENT_REVIEWS`] reviews run at once; a call that
//!   cannot start one within [`REVIEW_QUEUE_WAIT`] is told to come back
//!   (503), instead of queueing without bound behind a flood;
//! * both caches are keyed by SHA-256 of the token: the operator's memory
//!   holds no replayable credential.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use base64::Engine;

use headroom_api::{
    LABEL_ATTEMPT, LABEL_JOB, LABEL_STAGE, MemoryAwareTrainingJob, WORKER_API_AUDIENCE,
};
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};
use kube::{Client, Resource, ResourceExt};
use sha2::{Digest, Sha256};
use tokio::sync::Semaphore;

use super::Refusal;
use crate::watched_pods::WatchedPods;

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
/// Entries kept per cache at most; beyond it the expired ones are dropped, then all.
const MAX_ENTRIES: usize = 20_000;

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

/// SHA-256 of a token: what the caches are keyed by.
type TokenHash = [u8; 32];

/// A cache of answers per token hash, each good until its own deadline.
struct Remembered<T> {
    entries: Mutex<HashMap<TokenHash, (T, Instant)>>,
}

impl<T: Clone> Remembered<T> {
    fn new() -> Self {
        Remembered {
            entries: Mutex::new(HashMap::new()),
        }
    }

    fn get(&self, key: &TokenHash) -> Option<T> {
        let entries = self.entries.lock().ok()?;
        let (value, until) = entries.get(key)?;
        (Instant::now() < *until).then(|| value.clone())
    }

    fn put(&self, key: TokenHash, value: T, ttl: Duration) {
        if let Ok(mut entries) = self.entries.lock() {
            if entries.len() >= MAX_ENTRIES {
                let now = Instant::now();
                entries.retain(|_, (_, until)| now < *until);
                if entries.len() >= MAX_ENTRIES {
                    entries.clear();
                }
            }
            entries.insert(key, (value, Instant::now() + ttl));
        }
    }

    fn forget(&self, key: &TokenHash) {
        if let Ok(mut entries) = self.entries.lock() {
            entries.remove(key);
        }
    }
}

/// An accepted token: who it is, and whether the pod cache vouches for it.
#[derive(Clone)]
struct Accepted {
    caller: Caller,
    pod_uid: String,
    /// The pod was found in the leader's cache: the entry holds while it is there.
    watched: bool,
}

/// Checks tokens, remembering answers and bounding the reviews in flight.
pub struct Identities {
    client: Client,
    pods: WatchedPods,
    accepted: Remembered<Accepted>,
    refused: Remembered<String>,
    reviews: Semaphore,
}

impl Identities {
    pub fn new(client: Client, pods: WatchedPods) -> Self {
        Identities {
            client,
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
        let key: TokenHash = Sha256::digest(token.as_bytes()).into();
        if let Some(accepted) = self.accepted.get(&key) {
            if !accepted.watched || self.still_watched(&accepted) {
                return Ok(accepted.caller);
            }
            // The pod left the cache (deleted): review the token again,
            // which the API server refuses for a deleted pod.
            self.accepted.forget(&key);
        }
        if let Some(reason) = self.refused.get(&key) {
            return Err(Refusal::Unauthenticated(reason));
        }
        let _slot = tokio::time::timeout(REVIEW_QUEUE_WAIT, self.reviews.acquire())
            .await
            .map_err(|_| Refusal::Busy)?
            .map_err(|_| Refusal::Busy)?;
        match self.review(token).await {
            Ok(accepted) => {
                let ttl = if accepted.watched {
                    WATCHED_IDENTITY_TTL
                } else {
                    IDENTITY_TTL
                };
                let ttl = expires_in(token).map_or(ttl, |left| left.min(ttl));
                let caller = accepted.caller.clone();
                self.accepted.put(key, accepted, ttl);
                Ok(caller)
            }
            Err(Refusal::Unauthenticated(reason)) => {
                self.refused.put(key, reason.clone(), REFUSAL_TTL);
                Err(Refusal::Unauthenticated(reason))
            }
            Err(other) => Err(other),
        }
    }

    /// Whether the leader's cache still holds the pod an entry was accepted for.
    fn still_watched(&self, accepted: &Accepted) -> bool {
        self.pods
            .get(&accepted.caller.namespace, &accepted.caller.pod)
            .is_some_and(|p| p.uid().as_deref() == Some(accepted.pod_uid.as_str()))
    }

    /// TokenReview, then the pod the token is bound to (from the leader's
    /// cache when it has it, else from the API server), then its job.
    async fn review(&self, token: &str) -> Result<Accepted, Refusal> {
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
        let is_bound = |p: &Pod| p.uid().as_deref() == Some(pod_uid.as_str());
        let watched = self.pods.get(&namespace, &pod_name).filter(|p| is_bound(p));
        let pod = match &watched {
            Some(pod) => pod.clone(),
            None => Api::<Pod>::namespaced(self.client.clone(), &namespace)
                .get_opt(&pod_name)
                .await
                .map_err(Refusal::Upstream)?
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

/// How long until a JWT's `exp` claim, read from its payload without
/// checking the signature: only ever called on a token the API server has
/// just accepted, and only to end a cache entry sooner. `None` when the
/// token carries no readable expiry.
fn expires_in(token: &str) -> Option<Duration> {
    let payload = token.split('.').nth(1)?;
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload.trim_end_matches('='))
        .ok()?;
    let exp = serde_json::from_slice::<serde_json::Value>(&bytes)
        .ok()?
        .get("exp")?
        .as_u64()?;
    let now = SystemTime::now().duration_since(UNIX_EPOCH).ok()?.as_secs();
    Some(Duration::from_secs(exp.saturating_sub(now)))
}

/// The job that controls `pod` and carries its label: (name, uid).
pub fn owning_job(pod: &Pod) -> Option<(String, String)> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use base64::engine::general_purpose::URL_SAFE_NO_PAD;
    use serde_json::json;

    fn jwt(payload: serde_json::Value) -> String {
        let part = |v: serde_json::Value| URL_SAFE_NO_PAD.encode(v.to_string());
        format!("{}.{}.c2ln", part(json!({"alg": "RS256"})), part(payload))
    }

    /// A remembered identity never outlives the token it was checked for.
    #[test]
    fn a_tokens_expiry_comes_from_its_payload_and_nothing_else_is_guessed() {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .expect("clock")
            .as_secs();
        let left = expires_in(&jwt(json!({"exp": now + 300, "sub": "x"}))).expect("exp");
        assert!(
            (Duration::from_secs(298)..=Duration::from_secs(300)).contains(&left),
            "{left:?}"
        );
        assert_eq!(
            expires_in(&jwt(json!({"exp": now - 10}))),
            Some(Duration::ZERO)
        );
        assert_eq!(expires_in(&jwt(json!({"sub": "x"}))), None);
        assert_eq!(expires_in(&jwt(json!({"exp": "soon"}))), None);
        assert_eq!(expires_in("a.!!!.c"), None);
        assert_eq!(expires_in("no-dots"), None);
    }

    #[test]
    fn remembered_answers_end_at_their_own_deadline() {
        let cache = Remembered::new();
        cache.put([1; 32], "long", Duration::from_secs(60));
        cache.put([2; 32], "gone", Duration::ZERO);
        assert_eq!(cache.get(&[1; 32]), Some("long"));
        assert_eq!(cache.get(&[2; 32]), None);
        cache.forget(&[1; 32]);
        assert_eq!(cache.get(&[1; 32]), None);
    }
}
