//! `/metrics` behind the API server's review (`--metrics-authorization`,
//! `headroom_operator::metrics_access`) on a real kube-apiserver: the token
//! of a service account bound to a ClusterRole that grants `get` on
//! `/metrics` reads the metrics, another account's token is refused 403,
//! a request without a token or with one the API server does not accept
//! 401.
//!
//! The API-server test is ignored by plain `cargo test`; `make test-apiserver` runs it.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use headroom_e2e::{API_SERVER, TestNs};
use headroom_operator::metrics::{self, Metrics};
use headroom_operator::metrics_access::MetricsAccess;
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::json;
use tower::ServiceExt;

/// How long the API server's authorizer may take to see a new binding.
const TIMEOUT: Duration = Duration::from_secs(30);

/// `GET /metrics` with `token`: the status code and the body.
async fn scrape(app: &axum::Router, token: Option<&str>) -> (StatusCode, String) {
    let mut request = Request::builder().uri("/metrics");
    if let Some(token) = token {
        request = request.header(header::AUTHORIZATION, format!("Bearer {token}"));
    }
    let response = app
        .clone()
        .oneshot(request.body(Body::empty()).expect("request"))
        .await
        .expect("infallible");
    let code = response.status();
    let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
        .await
        .expect("body");
    (code, String::from_utf8_lossy(&bytes).into_owned())
}

/// A service account `name` in the test's namespace and a token of it for
/// the API server's own audience (what a scraper's pod mounts).
async fn account_token(ns: &TestNs, name: &str) -> String {
    let accounts = Api::<ServiceAccount>::namespaced(ns.client.clone(), &ns.name);
    let account: ServiceAccount =
        serde_json::from_value(json!({"metadata": {"name": name}})).expect("account");
    accounts
        .create(&PostParams::default(), &account)
        .await
        .expect("create the account");
    let request = TokenRequest {
        spec: TokenRequestSpec {
            audiences: vec![],
            expiration_seconds: Some(600),
            bound_object_ref: None,
        },
        ..TokenRequest::default()
    };
    accounts
        .create_token_request(name, &PostParams::default(), &request)
        .await
        .expect("a token")
        .status
        .expect("token")
        .token
}

/// The scraper's ClusterRole, as the chart's README documents it, bound to
/// `scraper`; both named after the namespace, and deleted by the caller.
async fn grant_metrics_to(ns: &TestNs, scraper: &str) -> String {
    let name = format!("{}-metrics-reader", ns.name);
    let role: ClusterRole = serde_json::from_value(json!({
        "metadata": {"name": name},
        "rules": [{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}]
    }))
    .expect("role");
    let binding: ClusterRoleBinding = serde_json::from_value(json!({
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": scraper, "namespace": ns.name}]
    }))
    .expect("binding");
    Api::<ClusterRole>::all(ns.client.clone())
        .create(&PostParams::default(), &role)
        .await
        .expect("create the role");
    Api::<ClusterRoleBinding>::all(ns.client.clone())
        .create(&PostParams::default(), &binding)
        .await
        .expect("create the binding");
    name
}

async fn revoke(ns: &TestNs, name: &str) {
    let _ = Api::<ClusterRoleBinding>::all(ns.client.clone())
        .delete(name, &DeleteParams::default())
        .await;
    let _ = Api::<ClusterRole>::all(ns.client.clone())
        .delete(name, &DeleteParams::default())
        .await;
}

fn guarded_metrics(ns: &TestNs) -> axum::Router {
    let access = MetricsAccess::new(ns.client.clone());
    metrics::router(Arc::new(Metrics::default()), Some(Arc::new(access)))
}

#[tokio::test]
#[ignore = "needs the control plane: make test-apiserver"]
async fn only_a_token_whose_user_may_get_metrics_reads_them() {
    let ns = TestNs::new(API_SERVER, "hr-metrics-access").await;
    let scraper = account_token(&ns, "scraper").await;
    let stranger = account_token(&ns, "stranger").await;
    let role = grant_metrics_to(&ns, "scraper").await;

    // The API server's authorizer sees a new binding within moments; each
    // try asks afresh (a check remembers a refusal for 10 s).
    let (code, body) = ns
        .wait_for("the binding to take effect", TIMEOUT, || async {
            let answer = scrape(&guarded_metrics(&ns), Some(&scraper)).await;
            (answer.0 == StatusCode::OK).then_some(answer)
        })
        .await;
    assert_eq!(code, StatusCode::OK);
    assert!(body.contains("headroom_"), "{body}");

    let app = guarded_metrics(&ns);
    let (code, body) = scrape(&app, Some(&scraper)).await;
    assert_eq!(code, StatusCode::OK, "{body}");
    let (code, body) = scrape(&app, Some(&stranger)).await;
    assert_eq!(code, StatusCode::FORBIDDEN, "{body}");
    assert!(
        body.contains(&format!("system:serviceaccount:{}:stranger", ns.name))
            && body.contains("nonResourceURLs"),
        "{body}"
    );
    let (code, body) = scrape(&app, None).await;
    assert_eq!(code, StatusCode::UNAUTHORIZED, "{body}");
    let (code, body) = scrape(&app, Some("not-a-token")).await;
    assert_eq!(code, StatusCode::UNAUTHORIZED, "{body}");
    // A token that was valid, altered: the API server refuses its signature.
    let forged = format!("{scraper}x");
    let (code, body) = scrape(&app, Some(&forged)).await;
    assert_eq!(code, StatusCode::UNAUTHORIZED, "{body}");
    // Without the check (the default), anyone who reaches the port reads them.
    let open = metrics::router(Arc::new(Metrics::default()), None);
    assert_eq!(scrape(&open, None).await.0, StatusCode::OK);

    revoke(&ns, &role).await;
    ns.cleanup().await;
}
