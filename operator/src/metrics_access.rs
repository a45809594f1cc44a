//! Who may read `/metrics`, when the operator checks (`--metrics-authorization`,
//! the chart's `metrics.authorization`): as kube-rbac-proxy does, the
//! caller's bearer token is reviewed by the API server (TokenReview), and
//! the user it stands for must be allowed `get` on the non-resource URL
//! `/metrics` (SubjectAccessReview), which a ClusterRole grants:
//!
//! ```yaml
//! rules:
//!   - nonResourceURLs: ["/metrics"]
//!     verbs: ["get"]
//! ```
//!
//! No token or a token the API server does not accept is a 401, a user
//! without that right a 403. The metrics name every tenant's jobs and their
//! losses; the chart's NetworkPolicy already admits only
//! `networkPolicy.metricsFrom`, and this check also holds where
//! NetworkPolicies are not enforced, or against a pod of the monitoring
//! namespace that is not a scraper.
//!
//! Each check costs two API calls, so answers are remembered by the
//! token's SHA-256 ([`crate::token_cache`]): an allowed token for
//! [`ALLOWED_TTL`], a refused one for [`REFUSED_TTL`] (what kube-apiserver's
//! delegating authorizer caches both for), and at most
//! [`MAX_CONCURRENT_REVIEWS`] checks run at once (a call that waits
//! [`REVIEW_QUEUE_WAIT`] for one gets 503): a flood of bad tokens costs the
//! API server at most that many reviews at a time, each token once per
//! [`REFUSED_TTL`].

use std::time::Duration;

use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::authorization::v1::{
    NonResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::Client;
use kube::api::{Api, PostParams};
use tokio::sync::Semaphore;

use crate::token_cache::{Remembered, token_hash};
use crate::worker_api::MAX_TOKEN_BYTES;

/// The path a scraper must be allowed to `get`.
pub const METRICS_PATH: &str = "/metrics";
/// How long an allowed token is let in without asking again: a role
/// binding removed takes at most this long to shut a scraper out.
pub const ALLOWED_TTL: Duration = Duration::from_secs(10);
/// How long a refused token is refused without asking again.
pub const REFUSED_TTL: Duration = Duration::from_secs(10);
/// Checks (a TokenReview, then a SubjectAccessReview) in flight at once.
pub const MAX_CONCURRENT_REVIEWS: usize = 4;
/// How long a call waits for a check slot before it is answered 503.
pub const REVIEW_QUEUE_WAIT: Duration = Duration::from_secs(5);

/// Why a caller may not read `/metrics`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Denied {
    #[error("no bearer token: send a service account's token (Authorization: Bearer …)")]
    NoToken,
    #[error("token not accepted: {0}")]
    Unauthenticated(String),
    #[error("{0}")]
    Forbidden(String),
    #[error("too many access checks in flight; retry shortly")]
    Busy,
    #[error("the access check could not reach the Kubernetes API: {0}")]
    Upstream(String),
}

impl Denied {
    /// Whether the answer says something about the token itself, and is
    /// remembered: not a failure to reach the API server or a full queue.
    fn about_the_token(&self) -> bool {
        matches!(self, Denied::Unauthenticated(_) | Denied::Forbidden(_))
    }
}

impl IntoResponse for Denied {
    fn into_response(self) -> Response {
        let code = match &self {
            Denied::NoToken | Denied::Unauthenticated(_) => StatusCode::UNAUTHORIZED,
            Denied::Forbidden(_) => StatusCode::FORBIDDEN,
            Denied::Busy => StatusCode::SERVICE_UNAVAILABLE,
            Denied::Upstream(_) => StatusCode::BAD_GATEWAY,
        };
        let body = format!("{self}\n");
        if code == StatusCode::UNAUTHORIZED {
            return (code, [(header::WWW_AUTHENTICATE, "Bearer")], body).into_response();
        }
        (code, body).into_response()
    }
}

/// Decides whether a token may read `/metrics`: the API server
/// ([`ApiReviewer`]), or a stand-in in tests.
pub trait Reviewer: Send + Sync {
    fn review(&self, token: &str) -> impl Future<Output = Result<(), Denied>> + Send;
}

/// The access check of `/metrics`, remembering answers.
#[derive(Debug)]
pub struct MetricsAccess<R = ApiReviewer> {
    reviewer: R,
    answers: Remembered<Result<(), Denied>>,
    reviews: Semaphore,
}

impl MetricsAccess {
    /// Checks with the operator's own client (it needs `create` on
    /// tokenreviews and subjectaccessreviews).
    pub fn new(client: Client) -> Self {
        MetricsAccess::with_reviewer(ApiReviewer { client })
    }
}

impl<R: Reviewer> MetricsAccess<R> {
    pub fn with_reviewer(reviewer: R) -> Self {
        MetricsAccess {
            reviewer,
            answers: Remembered::new(),
            reviews: Semaphore::new(MAX_CONCURRENT_REVIEWS),
        }
    }

    /// Whether the request with these headers may read `/metrics`.
    pub async fn check(&self, headers: &HeaderMap) -> Result<(), Denied> {
        let token = crate::token_cache::bearer_token(headers).ok_or(Denied::NoToken)?;
        if token.len() > MAX_TOKEN_BYTES {
            return Err(Denied::Unauthenticated(format!(
                "a bearer token of at most {MAX_TOKEN_BYTES} bytes"
            )));
        }
        let key = token_hash(token);
        if let Some(answer) = self.answers.get(&key) {
            return answer;
        }
        let _slot = tokio::time::timeout(REVIEW_QUEUE_WAIT, self.reviews.acquire())
            .await
            .map_err(|_| Denied::Busy)?
            .map_err(|_| Denied::Busy)?;
        // Another call with the same token may have answered while this
        // one waited for the slot.
        if let Some(answer) = self.answers.get(&key) {
            return answer;
        }
        let answer = self.reviewer.review(token).await;
        match &answer {
            Ok(()) => self.answers.put(key, Ok(()), ALLOWED_TTL),
            Err(denied) if denied.about_the_token() => {
                self.answers.put(key, answer.clone(), REFUSED_TTL)
            }
            Err(_) => {}
        }
        answer
    }
}

/// Reviews tokens and their users' rights with the operator's own client.
pub struct ApiReviewer {
    client: Client,
}

impl std::fmt::Debug for ApiReviewer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiReviewer").finish_non_exhaustive()
    }
}

impl Reviewer for ApiReviewer {
    async fn review(&self, token: &str) -> Result<(), Denied> {
        let upstream = |e: kube::Error| Denied::Upstream(e.to_string());
        // No audience: the API server's own, which a service account's
        // token has unless it was asked for another (kube-rbac-proxy's
        // default too).
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: Some(token.to_string()),
                audiences: None,
            },
            ..TokenReview::default()
        };
        let reviewed = Api::<TokenReview>::all(self.client.clone())
            .create(&PostParams::default(), &review)
            .await
            .map_err(upstream)?;
        let status = reviewed.status.unwrap_or_default();
        if status.authenticated != Some(true) {
            return Err(Denied::Unauthenticated(
                status
                    .error
                    .unwrap_or_else(|| "not authenticated".to_string()),
            ));
        }
        let user = status.user.unwrap_or_default();
        let name = user.username.clone().unwrap_or_default();
        let access = SubjectAccessReview {
            spec: SubjectAccessReviewSpec {
                user: user.username,
                groups: user.groups,
                uid: user.uid,
                extra: user.extra,
                non_resource_attributes: Some(NonResourceAttributes {
                    path: Some(METRICS_PATH.to_string()),
                    verb: Some("get".to_string()),
                }),
                ..SubjectAccessReviewSpec::default()
            },
            ..SubjectAccessReview::default()
        };
        let decided = Api::<SubjectAccessReview>::all(self.client.clone())
            .create(&PostParams::default(), &access)
            .await
            .map_err(upstream)?;
        let status = decided.status.unwrap_or_default();
        if status.allowed {
            return Ok(());
        }
        let why = status
            .reason
            .filter(|r| !r.is_empty())
            .map(|r| format!(" ({r})"))
            .unwrap_or_default();
        Err(Denied::Forbidden(format!(
            "{name} may not get {METRICS_PATH}{why}: bind it to a ClusterRole with \
             nonResourceURLs [\"{METRICS_PATH}\"] and verbs [\"get\"]"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A reviewer that answers `answer` and counts its calls.
    struct Counting {
        answer: Result<(), Denied>,
        calls: Arc<AtomicUsize>,
    }

    impl Reviewer for Counting {
        async fn review(&self, _token: &str) -> Result<(), Denied> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            self.answer.clone()
        }
    }

    fn access(answer: Result<(), Denied>) -> (MetricsAccess<Counting>, Arc<AtomicUsize>) {
        let calls = Arc::new(AtomicUsize::new(0));
        let reviewer = Counting {
            answer,
            calls: calls.clone(),
        };
        (MetricsAccess::with_reviewer(reviewer), calls)
    }

    fn bearer(token: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        let value = HeaderValue::from_str(&format!("Bearer {token}")).expect("header");
        headers.insert(header::AUTHORIZATION, value);
        headers
    }

    #[tokio::test]
    async fn no_token_is_refused_without_a_review() {
        let (access, calls) = access(Ok(()));
        assert_eq!(access.check(&HeaderMap::new()).await, Err(Denied::NoToken));
        assert_eq!(access.check(&bearer(" ")).await, Err(Denied::NoToken));
        let long = "x".repeat(MAX_TOKEN_BYTES + 1);
        assert!(matches!(
            access.check(&bearer(&long)).await,
            Err(Denied::Unauthenticated(_))
        ));
        assert_eq!(calls.load(Ordering::SeqCst), 0);
    }

    /// Allowed and refused answers are each asked for once while
    /// remembered; a failure to reach the API server is asked again.
    #[tokio::test]
    async fn answers_about_a_token_are_remembered_and_upstream_failures_are_not() {
        for answer in [
            Ok(()),
            Err(Denied::Unauthenticated("bad".into())),
            Err(Denied::Forbidden("no".into())),
        ] {
            let (access, calls) = access(answer.clone());
            for _ in 0..3 {
                assert_eq!(access.check(&bearer("a-token")).await, answer);
            }
            assert_eq!(calls.load(Ordering::SeqCst), 1, "{answer:?}");
            access.check(&bearer("another")).await.ok();
            assert_eq!(calls.load(Ordering::SeqCst), 2, "{answer:?}");
        }
        let (access, calls) = access(Err(Denied::Upstream("down".into())));
        for _ in 0..3 {
            assert!(access.check(&bearer("a-token")).await.is_err());
        }
        assert_eq!(calls.load(Ordering::SeqCst), 3);
    }

    #[test]
    fn refusals_answer_401_or_403_and_a_401_asks_for_a_bearer_token() {
        let no_token = Denied::NoToken.into_response();
        assert_eq!(no_token.status(), StatusCode::UNAUTHORIZED);
        assert_eq!(
            no_token.headers().get(header::WWW_AUTHENTICATE),
            Some(&HeaderValue::from_static("Bearer"))
        );
        let forbidden = Denied::Forbidden("no".into()).into_response();
        assert_eq!(forbidden.status(), StatusCode::FORBIDDEN);
    }
}
