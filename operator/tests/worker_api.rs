//! The operator's worker API (`headroom_operator::worker_api`) on a real
//! kube-apiserver: a worker pod, which runs under the namespace's `default`
//! account with no API token and no Role, reports its telemetry through the
//! operator with the token the kubelet projects into it (bound to the pod,
//! audience `headroom.dev/worker-api`), which the operator writes into the
//! job's status, and looks up a peer of its own job;
//! it cannot write another pod's entry, reach another job's pods, or use the
//! token against the API server itself.
//!
//! The API-server test is ignored by plain `cargo test`; `make test-apiserver` runs it.

mod support;

use axum::body::Body;
use axum::http::{Method, Request, StatusCode, header};
use headroom_api::{
    LABEL_JOB, PeerAddress, PeerKey, WORKER_API_AUDIENCE, WORKER_API_PEER_KEY_PATH,
    WORKER_API_PEERS_PATH, WORKER_API_TELEMETRY_PATH, WORKER_FIELD_MANAGER_PREFIX,
};
use headroom_operator::controller::ControllerConfig;
use headroom_operator::worker_api;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use std::time::Duration;
use support::*;
use tower::ServiceExt;

fn entry(pod: &str, step: u64) -> Value {
    json!({
        "name": pod, "attempt": 1, "stage": 0, "layerStart": 0, "layerEnd": 2, "step": step,
        "memory": {"cgroupCurrentBytes": 1000, "peakBytes": 2000},
        "updatedAt": "2026-11-26T10:00:00Z"
    })
}

/// One call to the worker API: the status code and the body.
async fn call(
    api: &axum::Router,
    method: Method,
    path: &str,
    token: Option<&str>,
    body: Option<Value>,
) -> (StatusCode, String) {
    let mut request = Request::builder().method(method).uri(path);
    if let Some(token) = token {
        request = request.header(header::AUTHORIZATION, format!("Bearer {token}"));
    }
    let body = body.map_or_else(Body::empty, |b| Body::from(b.to_string()));
    let response = api
        .clone()
        .oneshot(request.body(body).expect("request"))
        .await
        .expect("infallible");
    let code = response.status();
    let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
        .await
        .expect("body");
    (code, String::from_utf8_lossy(&bytes).into_owned())
}

/// The worker API beside a controller, and the one worker pod of `tiny-cpu`
/// with its projected worker-API token.
struct Worker {
    api: axum::Router,
    key: worker_api::OperatorKey,
    pod: Pod,
    /// The pod's name.
    me: String,
    token: String,
}

#[tokio::test]
#[ignore = "needs the control plane: make test-apiserver"]
async fn a_worker_reports_its_own_telemetry_through_the_operator_and_nothing_else() {
    let ns = test_ns("hr-worker-api").await;
    let config = ControllerConfig {
        children: headroom_operator::controller::ChildConfig {
            worker_api_url: Some("http://10.96.0.99:8081".into()),
            ..Default::default()
        },
        ..ControllerConfig::default()
    };
    let op = start_operator(&ns, config);
    ns.apply_job(CPU_TINY).await;
    let worker = a_worker_told_where_the_api_is(&ns, &op).await;
    its_own_entry_is_written_by_the_operator(&ns, &op, &worker).await;
    other_entries_bad_bodies_and_other_tokens_are_refused(&ns, &worker).await;
    // Creates the `stranger` pod the later steps use.
    peers_are_pods_of_its_own_job_only(&ns, &worker).await;
    the_link_key_is_its_jobs_and_needs_a_token(&ns, &worker).await;
    a_pod_that_is_no_worker_can_neither_report_nor_learn_a_key(&ns, &worker).await;
    the_token_is_worth_nothing_to_the_api_server(&ns, &worker).await;
    a_deleted_pods_token_is_refused_once_the_cache_sees_it(&ns, &op, &worker).await;
    op.stop().await;
    ns.cleanup().await;
}

/// The worker pod: no API token mounted, the worker API's address in its
/// environment; and the API, with a fresh operator key.
async fn a_worker_told_where_the_api_is(ns: &TestNs, op: &Operator) -> Worker {
    let pods = ns
        .wait_pods("the worker pod", TIMEOUT, |p| p.len() == 1)
        .await;
    let pod = pods[0].clone();
    let spec = pod.spec.as_ref().expect("spec");
    assert_eq!(spec.automount_service_account_token, Some(false));
    let env: Vec<String> = spec.containers[0]
        .env
        .iter()
        .flatten()
        .map(|e| format!("{}={}", e.name, e.value.clone().unwrap_or_default()))
        .collect();
    assert!(
        env.contains(&"HEADROOM_WORKER_API=http://10.96.0.99:8081".to_string()),
        "{env:?}"
    );
    let key = worker_api::OperatorKey::random().expect("key");
    let api = worker_api::router(
        ns.client.clone(),
        key.clone(),
        op.reports.clone(),
        op.pods.clone(),
    );
    let token = ns.pod_token(&pod, &[WORKER_API_AUDIENCE]).await;
    let me = pod.name_any();
    Worker {
        api,
        key,
        pod,
        me,
        token,
    }
}

/// Its own entry: held and written by the operator (a new worker at the
/// flusher's next tick) under the operator's telemetry field manager.
async fn its_own_entry_is_written_by_the_operator(ns: &TestNs, op: &Operator, w: &Worker) {
    let (code, text) = call(
        &w.api,
        Method::POST,
        WORKER_API_TELEMETRY_PATH,
        Some(&w.token),
        Some(entry(&w.me, 3)),
    )
    .await;
    assert_eq!(code, StatusCode::NO_CONTENT, "{text}");
    ns.wait_job("tiny-cpu", "the entry written", TIMEOUT, |j| {
        j.status
            .as_ref()
            .is_some_and(|s| s.workers.iter().map(|w| w.step).collect::<Vec<_>>() == [3])
    })
    .await;
    let job = ns.jobs().get("tiny-cpu").await.expect("job");
    let managers: Vec<String> = job
        .metadata
        .managed_fields
        .iter()
        .flatten()
        .filter_map(|m| m.manager.clone())
        .collect();
    assert!(
        managers.iter().any(|m| m == op.reports.field_manager()),
        "{managers:?}"
    );
    assert!(
        !managers
            .iter()
            .any(|m| m.starts_with(WORKER_FIELD_MANAGER_PREFIX)),
        "{managers:?}"
    );
    // The operator's own status writes leave it there.
    ns.wait_job("tiny-cpu", "the entry kept", TIMEOUT, |j| {
        j.status.as_ref().is_some_and(|s| s.workers.len() == 1)
    })
    .await;
}

/// Another worker's entry, a claim to another attempt or stage, a body that
/// is not telemetry, no token and a token for another audience: each refused,
/// with the reason.
async fn other_entries_bad_bodies_and_other_tokens_are_refused(ns: &TestNs, w: &Worker) {
    let (code, text) = call(
        &w.api,
        Method::POST,
        WORKER_API_TELEMETRY_PATH,
        Some(&w.token),
        Some(entry("someone-else", 1)),
    )
    .await;
    assert_eq!(code, StatusCode::FORBIDDEN, "{text}");
    assert!(text.contains("only its own entry"), "{text}");
    // Its own entry, claiming another attempt or stage than its pod's labels.
    for (attempt, stage) in [(2, 0), (1, 1)] {
        let mut claim = entry(&w.me, 5);
        claim["attempt"] = json!(attempt);
        claim["stage"] = json!(stage);
        let (code, text) = call(
            &w.api,
            Method::POST,
            WORKER_API_TELEMETRY_PATH,
            Some(&w.token),
            Some(claim),
        )
        .await;
        assert_eq!(code, StatusCode::FORBIDDEN, "{text}");
        assert!(text.contains("is attempt 1 stage 0"), "{text}");
    }
    // A body that is not telemetry: the field that is wrong.
    let (code, text) = call(
        &w.api,
        Method::POST,
        WORKER_API_TELEMETRY_PATH,
        Some(&w.token),
        Some(json!({"name": w.me, "attempt": "one"})),
    )
    .await;
    assert_eq!(code, StatusCode::BAD_REQUEST, "{text}");
    assert!(text.contains("attempt"), "{text}");
    // Telemetry beyond the schema's bounds is refused to its worker, not
    // left to fail the job's status write: here a GPU listed twice.
    let mut twice = entry(&w.me, 5);
    twice["memory"]["gpus"] = json!([
        {"index": 0, "usedBytes": 1, "totalBytes": 2},
        {"index": 0, "usedBytes": 1, "totalBytes": 2}
    ]);
    let (code, text) = call(
        &w.api,
        Method::POST,
        WORKER_API_TELEMETRY_PATH,
        Some(&w.token),
        Some(twice),
    )
    .await;
    assert_eq!(code, StatusCode::BAD_REQUEST, "{text}");
    assert!(
        text.contains("memory.gpus: index 0 appears twice"),
        "{text}"
    );
    // No token, or a token for another audience (the API server's own).
    let (code, text) = call(&w.api, Method::POST, WORKER_API_TELEMETRY_PATH, None, None).await;
    assert_eq!(code, StatusCode::UNAUTHORIZED, "{text}");
    let api_token = ns.pod_token(&w.pod, &[]).await;
    let (code, text) = call(
        &w.api,
        Method::POST,
        WORKER_API_TELEMETRY_PATH,
        Some(&api_token),
        Some(entry(&w.me, 4)),
    )
    .await;
    assert_eq!(code, StatusCode::UNAUTHORIZED, "{text}");
    // Refused by its own claims, before a review (whose refusal reads differently).
    assert!(
        text.contains("not a worker-API token: its audience"),
        "{text}"
    );
}

/// Peers: a pod of its own job (no IP: no kubelet here); another pod (the
/// `stranger` made here, labelled as another job's but controlled by none)
/// is not even in the operator's pod cache, which peers are read from, so
/// it reads as a pod not created yet; and a name that is no pod name is
/// refused before it becomes part of an API path.
async fn peers_are_pods_of_its_own_job_only(ns: &TestNs, w: &Worker) {
    let (code, text) = call(
        &w.api,
        Method::GET,
        &format!("{WORKER_API_PEERS_PATH}{}", w.me),
        Some(&w.token),
        None,
    )
    .await;
    assert_eq!(code, StatusCode::OK, "{text}");
    let address: PeerAddress = serde_json::from_str(&text).expect("a PeerAddress");
    assert_eq!(address.pod_ip, None);
    let stranger: Pod = serde_json::from_value(json!({
        "metadata": {"name": "stranger", "labels": {LABEL_JOB: "someone-elses"}},
        "spec": {"containers": [{"name": "c", "image": "example/c:1"}]}
    }))
    .expect("pod");
    ns.pods()
        .create(&PostParams::default(), &stranger)
        .await
        .expect("stranger");
    let (code, text) = call(
        &w.api,
        Method::GET,
        &format!("{WORKER_API_PEERS_PATH}stranger"),
        Some(&w.token),
        None,
    )
    .await;
    assert_eq!(code, StatusCode::OK, "{text}");
    let address: PeerAddress = serde_json::from_str(&text).expect("a PeerAddress");
    assert_eq!(address.pod_ip, None, "a pod no job controls is not cached");
    // A pod the cache does not hold reads as one not created yet.
    let (code, text) = call(
        &w.api,
        Method::GET,
        &format!("{WORKER_API_PEERS_PATH}not-yet"),
        Some(&w.token),
        None,
    )
    .await;
    assert_eq!(code, StatusCode::OK, "{text}");
    assert_eq!(
        serde_json::from_str::<PeerAddress>(&text).expect("a PeerAddress"),
        PeerAddress { pod_ip: None }
    );
    let (code, text) = call(
        &w.api,
        Method::GET,
        &format!("{WORKER_API_PEERS_PATH}Stranger"),
        Some(&w.token),
        None,
    )
    .await;
    assert_eq!(code, StatusCode::BAD_REQUEST, "{text}");
}

/// The job's link key: this job's, derived from the operator's key and the
/// job's uid; nothing without a token.
async fn the_link_key_is_its_jobs_and_needs_a_token(ns: &TestNs, w: &Worker) {
    let (code, text) = call(
        &w.api,
        Method::GET,
        WORKER_API_PEER_KEY_PATH,
        Some(&w.token),
        None,
    )
    .await;
    assert_eq!(code, StatusCode::OK, "{text}");
    let got: PeerKey = serde_json::from_str(&text).expect("a PeerKey");
    let uid = ns
        .jobs()
        .get("tiny-cpu")
        .await
        .expect("job")
        .uid()
        .expect("uid");
    assert_eq!(got.key, w.key.attempt_key_hex(&ns.name, &uid, 1));
    let (code, _) = call(&w.api, Method::GET, WORKER_API_PEER_KEY_PATH, None, None).await;
    assert_eq!(code, StatusCode::UNAUTHORIZED);
}

/// A pod that is no worker (the `stranger`) cannot report at all, nor learn
/// a key.
async fn a_pod_that_is_no_worker_can_neither_report_nor_learn_a_key(ns: &TestNs, w: &Worker) {
    let stranger = ns.pods().get("stranger").await.expect("stranger");
    let stranger_token = ns.pod_token(&stranger, &[WORKER_API_AUDIENCE]).await;
    let (code, text) = call(
        &w.api,
        Method::POST,
        WORKER_API_TELEMETRY_PATH,
        Some(&stranger_token),
        Some(entry("stranger", 1)),
    )
    .await;
    assert_eq!(code, StatusCode::FORBIDDEN, "{text}");
    let (code, text) = call(
        &w.api,
        Method::GET,
        WORKER_API_PEER_KEY_PATH,
        Some(&stranger_token),
        None,
    )
    .await;
    assert_eq!(code, StatusCode::FORBIDDEN, "{text}");
}

/// The worker's token is worth nothing to the API server itself.
async fn the_token_is_worth_nothing_to_the_api_server(ns: &TestNs, w: &Worker) {
    let mut config = kube::Config::infer().await.expect("kubeconfig");
    config.auth_info = serde_json::from_value(json!({ "token": w.token })).expect("auth info");
    let as_worker = Client::try_from(config).expect("worker client");
    let read = Api::<Pod>::namespaced(as_worker, &ns.name).get(&w.me).await;
    assert!(
        matches!(&read, Err(kube::Error::Api(e)) if e.code == 401),
        "{read:?}"
    );
}

/// The checked token stands for its pod while the operator's pod cache
/// holds the pod, and no longer: once the pod is deleted its token is
/// refused as soon as the watch sees it (reviewed again, and the API
/// server refuses a deleted pod's token), not after a time-to-live
/// (IDENTITY_TTL, 60 s, on a replica without the cache).
async fn a_deleted_pods_token_is_refused_once_the_cache_sees_it(
    ns: &TestNs,
    op: &Operator,
    w: &Worker,
) {
    assert!(op.pods.is_filled(), "the controller lends its pod cache");
    ns.pods()
        .delete(&w.me, &DeleteParams::default())
        .await
        .expect("delete the worker pod");
    let deleted = std::time::Instant::now();
    let refused = loop {
        let (code, text) = call(
            &w.api,
            Method::GET,
            WORKER_API_PEER_KEY_PATH,
            Some(&w.token),
            None,
        )
        .await;
        if code == StatusCode::UNAUTHORIZED {
            break deleted.elapsed();
        }
        assert_eq!(code, StatusCode::OK, "{text}");
        assert!(
            deleted.elapsed() < Duration::from_secs(10),
            "a deleted pod's token still accepted after {:?}",
            deleted.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    eprintln!("a deleted pod's token refused after {refused:?}");
}
