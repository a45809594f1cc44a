//! Workers' telemetry held by the operator and written per job
//! (`headroom_operator::worker_reports`), on a real kube-apiserver with the
//! controller running: many reports of a job's workers become a few status
//! writes, and the last report of every worker is in the status (and in the
//! attempt's history) when the controller closes the attempt, after a
//! success, an OOM kill and an eviction, even though the telemetry interval has
//! not come round.
//!
//! Ignored by plain `cargo test`; `make test-apiserver` runs it.

mod support;

use std::time::Duration;

use axum::body::Body;
use axum::http::{Method, Request, StatusCode, header};
use headroom_api::{AttemptOutcome, JobPhase, WORKER_API_AUDIENCE, WORKER_API_TELEMETRY_PATH};
use headroom_operator::controller::{ChildConfig, ControllerConfig};
use headroom_operator::worker_api;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use serde_json::{Value, json};
use support::*;
use tower::ServiceExt;

/// Longer than any test here runs: every write seen is one the rule makes
/// at once (a new worker, a new peak) or one made before a pod's end is
/// acted on, never an interval's.
const INTERVAL: Duration = Duration::from_secs(120);

fn config() -> ControllerConfig {
    ControllerConfig {
        children: ChildConfig {
            worker_api_url: Some("http://10.96.0.99:8081".into()),
            telemetry_interval: INTERVAL,
            ..Default::default()
        },
        ..ControllerConfig::default()
    }
}

/// The training loss stages past the first report (the last stage of a
/// two-stage pipeline computes it).
const LOSS: f64 = 1.234_567_89;

/// A worker's report: its step and peak, stamped `at` milliseconds in.
fn report(pod: &Pod, step: u64, peak: u64, at: u64) -> Value {
    let labels = pod.labels();
    let number = |key: &str| -> u32 { labels[key].parse().expect("numeric label") };
    let stage = number(headroom_api::LABEL_STAGE);
    let mut report = json!({
        "name": pod.name_any(),
        "attempt": number(headroom_api::LABEL_ATTEMPT),
        "stage": number(headroom_api::LABEL_STAGE),
        "layerStart": 0, "layerEnd": 1, "step": step,
        "memory": {"cgroupCurrentBytes": peak / 2, "peakBytes": peak},
        "updatedAt": jiff::Timestamp::from_millisecond(1_800_000_000_000 + at as i64)
            .expect("time")
            .to_string(),
    });
    if stage > 0 {
        report["loss"] = json!(LOSS);
    }
    report
}

async fn post(api: &axum::Router, token: &str, body: Value) {
    let request = Request::builder()
        .method(Method::POST)
        .uri(WORKER_API_TELEMETRY_PATH)
        .header(header::AUTHORIZATION, format!("Bearer {token}"))
        .body(Body::from(body.to_string()))
        .expect("request");
    let response = api.clone().oneshot(request).await.expect("infallible");
    let code = response.status();
    let text = axum::body::to_bytes(response.into_body(), 1 << 16)
        .await
        .expect("body");
    assert_eq!(
        code,
        StatusCode::NO_CONTENT,
        "{}",
        String::from_utf8_lossy(&text)
    );
}

#[tokio::test]
#[ignore = "needs the control plane: make test-apiserver"]
async fn a_pipelines_reports_are_a_few_writes_and_its_last_ones_are_in_the_status_at_success() {
    let ns = test_ns("hr-telemetry-agg").await;
    let op = start_operator(&ns, config());
    let api = worker_api::router(
        ns.client.clone(),
        worker_api::OperatorKey::random().expect("key"),
        op.reports.clone(),
        op.pods.clone(),
    );
    ns.apply_job(CPU_PIPELINE).await;
    let pods = ns
        .wait_pods("the pipeline's stages", TIMEOUT, |p| p.len() >= 2)
        .await;
    let mut workers = Vec::new();
    for pod in &pods {
        workers.push((pod, ns.pod_token(pod, &[WORKER_API_AUDIENCE]).await));
    }

    // Every worker reports every 50 ms for 2 s; stage 0's peak jumps by half once.
    let (rounds, peak) = (40u64, 100_000_000u64);
    let writes_before = op.reports.writes.get();
    for round in 0..rounds {
        for (i, (pod, token)) in workers.iter().enumerate() {
            let jump = if i == 0 && round >= rounds / 2 {
                peak / 2
            } else {
                0
            };
            post(&api, token, report(pod, round + 1, peak + jump, round * 50)).await;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    ns.wait_job("split-to-fit", "every worker's entry", TIMEOUT, |j| {
        j.status
            .as_ref()
            .is_some_and(|s| s.workers.len() == workers.len())
    })
    .await;
    let steady = op.reports.writes.get() - writes_before;
    // The new workers (one write, or two if a tick fell between them) and
    // the new peak: nothing else until the interval.
    assert!(
        (1..=3).contains(&steady),
        "{steady} writes for {} reports",
        rounds * workers.len() as u64
    );

    // Each worker's last report, then its pod's end: no interval has come
    // round, so only the write before the controller acts can carry them.
    for (i, (pod, token)) in workers.iter().enumerate() {
        let last = report(pod, 1000 + i as u64, peak + 7 + i as u64, rounds * 50 + 10);
        post(&api, token, last).await;
    }
    for (pod, _) in &workers {
        ns.set_pod_status(&pod.name_any(), terminated(0, "Completed", None))
            .await;
    }
    let job = ns
        .wait_job("split-to-fit", "phase Succeeded", TIMEOUT, |j| {
            j.status.as_ref().and_then(|s| s.phase) == Some(JobPhase::Succeeded)
        })
        .await;
    let total_steps = job.total_steps().expect("the recorded recipe's steps");
    let status = job.status.expect("status");
    assert_progress_is_the_last_stages(&status, &workers, total_steps);
    assert_kubectl_get_shows_the_progress(&ns, "split-to-fit", &status).await;
    for (i, (pod, _)) in workers.iter().enumerate() {
        let entry = status
            .workers
            .iter()
            .find(|w| w.name == pod.name_any())
            .unwrap_or_else(|| panic!("no entry for {}: {:?}", pod.name_any(), status.workers));
        assert_eq!(
            (entry.step, entry.memory.peak_bytes),
            (1000 + i as u64, peak + 7 + i as u64),
            "{}'s last report",
            pod.name_any()
        );
    }
    let attempt = &status.attempts[0];
    assert_eq!(attempt.outcome, AttemptOutcome::Succeeded);
    let n = workers.len() as u64;
    assert_eq!(
        (attempt.last_step, attempt.observed_peak_bytes),
        (Some(1000 + n - 1), Some(peak + 7 + n - 1)),
        "the attempt was closed from the last reports"
    );
    let total = op.reports.writes.get() - writes_before;
    assert!(
        total <= steady + 2,
        "{total} writes in all ({steady} while training)"
    );
    let managers: Vec<String> = ns
        .jobs()
        .get("split-to-fit")
        .await
        .expect("job")
        .metadata
        .managed_fields
        .into_iter()
        .flatten()
        .filter_map(|m| m.manager)
        .collect();
    assert!(
        managers.iter().any(|m| m == op.reports.field_manager()),
        "{managers:?}"
    );
    // The job ended: its workers' series are gone from the metrics.
    assert!(
        !op.metrics.encode().contains("headroom_worker_peak_bytes"),
        "{}",
        op.metrics.encode()
    );
    op.stop().await;
    ns.cleanup().await;
}

/// `status.progress` of the succeeded pipeline: the last stage's last
/// report (step `1000 + i` for worker `i`) of the run's total, what
/// `kubectl get` prints as Step, and no time left once the attempt ended.
fn assert_progress_is_the_last_stages(
    status: &headroom_api::MemoryAwareTrainingJobStatus,
    workers: &[(&Pod, String)],
    total_steps: u64,
) {
    let stage = |pod: &Pod| -> u32 {
        pod.labels()[headroom_api::LABEL_STAGE]
            .parse()
            .expect("stage")
    };
    let (last, _) = workers
        .iter()
        .enumerate()
        .max_by_key(|(_, (pod, _))| stage(pod))
        .expect("workers");
    let step = 1000 + last as u64;
    let progress = status.progress.as_ref().expect("status.progress");
    assert_eq!(
        (progress.attempt, progress.step, progress.total_steps),
        (1, step, Some(total_steps)),
        "{progress:?}"
    );
    assert_eq!(progress.step_of_total, format!("{step}/{total_steps}"));
    assert_eq!(
        progress.train_loss,
        Some(1.2346),
        "the last stage's, rounded"
    );
    assert_eq!(
        (progress.eta.as_deref(), progress.eta_seconds),
        (None, None),
        "the attempt ended: no time left is estimated"
    );
}

/// The API server's table of the job (what `kubectl get matj` prints) has
/// the Step, Loss and ETA columns, filled from `status.progress`.
async fn assert_kubectl_get_shows_the_progress(
    ns: &TestNs,
    job: &str,
    status: &headroom_api::MemoryAwareTrainingJobStatus,
) {
    let request = axum::http::Request::get(format!(
        "/apis/headroom.dev/v1alpha1/namespaces/{}/memoryawaretrainingjobs/{job}",
        ns.name
    ))
    .header(
        header::ACCEPT,
        "application/json;as=Table;v=v1;g=meta.k8s.io",
    )
    .body(Vec::new())
    .expect("request");
    let table: Value = ns.client.request(request).await.expect("table");
    let columns: Vec<&str> = table["columnDefinitions"]
        .as_array()
        .expect("columns")
        .iter()
        .filter_map(|c| c["name"].as_str())
        .collect();
    let cell = |name: &str| {
        let i = columns
            .iter()
            .position(|c| *c == name)
            .unwrap_or_else(|| panic!("no {name} column: {columns:?}"));
        table["rows"][0]["cells"][i].clone()
    };
    let progress = status.progress.as_ref().expect("status.progress");
    assert_eq!(cell("Step"), json!(progress.step_of_total));
    assert_eq!(cell("Loss"), json!(1.2346));
    assert_eq!(
        cell("ETA"),
        Value::Null,
        "no time left is estimated once it ended"
    );
}

#[tokio::test]
#[ignore = "needs the control plane: make test-apiserver"]
async fn the_last_report_before_an_oom_kill_is_in_the_closed_attempt() {
    let ns = test_ns("hr-telemetry-oom").await;
    let op = start_operator(&ns, config());
    let api = worker_api::router(
        ns.client.clone(),
        worker_api::OperatorKey::random().expect("key"),
        op.reports.clone(),
        op.pods.clone(),
    );
    ns.apply_job(CPU_OOM_FIRST).await;
    let pods = ns
        .wait_pods("attempt 1's pod", TIMEOUT, |p| p.len() == 1)
        .await;
    let pod = &pods[0];
    let token = ns.pod_token(pod, &[WORKER_API_AUDIENCE]).await;
    post(&api, &token, report(pod, 1, 200_000_000, 0)).await;
    ns.wait_job("oom-then-fit", "the first report", TIMEOUT, |j| {
        j.status.as_ref().is_some_and(|s| s.workers.len() == 1)
    })
    .await;
    // Steps go on, the peak grows by less than would be written at once,
    // and the kernel kills the worker before the interval comes round.
    post(&api, &token, report(pod, 9, 210_000_000, 900)).await;
    ns.set_pod_status(&pod.name_any(), oom_killed()).await;
    let job = ns
        .wait_job("oom-then-fit", "attempt 2", TIMEOUT, |j| {
            j.status.as_ref().is_some_and(|s| s.attempts.len() == 2)
        })
        .await;
    let first = &job.status.expect("status").attempts[0];
    assert_eq!(first.outcome, AttemptOutcome::HostOutOfMemory);
    assert_eq!(
        (first.last_step, first.observed_peak_bytes),
        (Some(9), Some(210_000_000)),
        "closed from the last report before the kill"
    );
    op.stop().await;
    ns.cleanup().await;
}

/// An eviction (the kubelet under memory pressure, a drain) ends the
/// attempt as a disruption: the last report before it, held by the
/// operator and not yet written, is in the closed attempt too.
#[tokio::test]
#[ignore = "needs the control plane: make test-apiserver"]
async fn the_last_report_before_an_eviction_is_in_the_closed_attempt() {
    let ns = test_ns("hr-telemetry-evicted").await;
    let op = start_operator(&ns, config());
    let api = worker_api::router(
        ns.client.clone(),
        worker_api::OperatorKey::random().expect("key"),
        op.reports.clone(),
        op.pods.clone(),
    );
    ns.apply_job(CPU_OOM_FIRST).await;
    let pods = ns
        .wait_pods("attempt 1's pod", TIMEOUT, |p| p.len() == 1)
        .await;
    let pod = &pods[0];
    ns.set_pod_status(&pod.name_any(), running()).await;
    let token = ns.pod_token(pod, &[WORKER_API_AUDIENCE]).await;
    post(&api, &token, report(pod, 1, 150_000_000, 0)).await;
    ns.wait_job("oom-then-fit", "the first report", TIMEOUT, |j| {
        j.status.as_ref().is_some_and(|s| s.workers.len() == 1)
    })
    .await;
    post(&api, &token, report(pod, 7, 155_000_000, 700)).await;
    // As the kubelet writes an eviction: the pod Failed, reason Evicted.
    ns.set_pod_status(
        &pod.name_any(),
        json!({
            "phase": "Failed",
            "reason": "Evicted",
            "message": "The node was low on resource: memory.",
        }),
    )
    .await;
    let job = ns
        .wait_job("oom-then-fit", "attempt 2", TIMEOUT, |j| {
            j.status.as_ref().is_some_and(|s| s.attempts.len() == 2)
        })
        .await;
    let first = &job.status.expect("status").attempts[0];
    assert_eq!(first.outcome, AttemptOutcome::Disrupted, "{first:?}");
    assert_eq!(
        (first.last_step, first.observed_peak_bytes),
        (Some(7), Some(155_000_000)),
        "closed from the last report before the eviction"
    );
    op.stop().await;
    ns.cleanup().await;
}
