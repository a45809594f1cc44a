//! Pipeline stages on real pods (`make e2e`): a model that fits no single
//! worker's memory limit is planned as several stages, one pod each, which
//! train together over the pod network and succeed, each reporting its own
//! telemetry and layer range; the same model pinned to one worker is really
//! OOM-killed and retried as more stages.

use std::collections::BTreeSet;
use std::time::Duration;

use headroom_api::{AttemptOutcome, LABEL_JOB, PIPELINE_PORT, REPLICA_PORT};
use headroom_e2e::fixtures::{CPU_PIPELINE as PIPELINE, CPU_PIPELINE_RETRY as PIPELINE_RETRY};
use headroom_e2e::{E2E, TestNs};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::Api;
const RUN: Duration = Duration::from_secs(600);

#[tokio::test]
#[ignore = "needs a cluster with Headroom installed: make e2e"]
async fn a_model_too_big_for_one_worker_trains_as_pipeline_stages() {
    let ns = TestNs::new(E2E, "e2e-pipeline").await;
    ns.apply_job(PIPELINE).await;
    let status = ns.wait_succeeded("split-to-fit", RUN).await;
    let attempt = status.attempts.last().expect("an attempt");
    assert_eq!(attempt.outcome, AttemptOutcome::Succeeded);
    let plan = status.plan.as_ref().expect("status.plan");
    let stages = plan.stages.len();
    assert_eq!(attempt.stages as usize, stages);
    assert!(stages >= 2, "planned as {stages} stage(s)");
    // Every stage reported, with its own layer range, and stayed within its limit.
    let reports: Vec<_> = status
        .workers
        .iter()
        .filter(|w| w.attempt == attempt.number)
        .collect();
    assert_eq!(reports.len(), stages, "{reports:?}");
    let ranges: BTreeSet<(u32, u32)> = reports
        .iter()
        .map(|w| (w.layer_start, w.layer_end))
        .collect();
    let planned: BTreeSet<(u32, u32)> = plan
        .stages
        .iter()
        .map(|s| (s.layer_start, s.layer_end))
        .collect();
    assert_eq!(ranges, planned);
    for w in &reports {
        assert!(
            w.memory.peak_bytes > 0 && w.memory.peak_bytes <= attempt.device_memory_bytes,
            "{w:?}"
        );
    }
    // The chart's default ReadWriteOnce checkpoint volume: the stages carry a
    // required pod affinity to each other, which the real scheduler honoured.
    let pods = ns.pod_list().await;
    let stage_pods: Vec<_> = pods
        .iter()
        .filter(|p| {
            p.metadata
                .name
                .as_deref()
                .is_some_and(|n| n.starts_with(&format!("split-to-fit-a{}-s", attempt.number)))
        })
        .collect();
    assert_eq!(stage_pods.len(), stages, "{}", ns.dump().await);
    let nodes: BTreeSet<_> = stage_pods
        .iter()
        .filter_map(|p| p.spec.as_ref()?.node_name.clone())
        .collect();
    assert_eq!(nodes.len(), 1, "{nodes:?}");
    for pod in &stage_pods {
        let affinity = pod
            .spec
            .as_ref()
            .and_then(|s| s.affinity.as_ref())
            .and_then(|a| a.pod_affinity.as_ref())
            .and_then(|a| {
                a.required_during_scheduling_ignored_during_execution
                    .as_ref()
            });
        assert!(affinity.is_some_and(|t| t.len() == 1), "{pod:?}");
    }
    // The stages' link ports are fenced to the job's own workers (created
    // with the chart's RBAC; enforced where the cluster's CNI enforces
    // NetworkPolicies, which this cluster's bridge CNI does not).
    let policies: Api<NetworkPolicy> = Api::namespaced(ns.client.clone(), &ns.name);
    let fence = policies
        .list(&Default::default())
        .await
        .expect("list")
        .items
        .into_iter()
        .find(|p| {
            p.metadata
                .labels
                .as_ref()
                .is_some_and(|l| l.get(LABEL_JOB).map(String::as_str) == Some("split-to-fit"))
        })
        .expect("the job's NetworkPolicy");
    let spec = fence.spec.expect("spec");
    let ports: Vec<_> = spec
        .ingress
        .iter()
        .flatten()
        .flat_map(|r| r.ports.iter().flatten())
        .filter_map(|p| p.port.clone())
        .collect();
    assert_eq!(
        ports,
        [
            IntOrString::Int(PIPELINE_PORT.into()),
            IntOrString::Int(REPLICA_PORT.into())
        ]
    );
    assert!(
        spec.ingress
            .iter()
            .flatten()
            .all(|r| r.from.as_ref().is_some_and(|f| !f.is_empty())),
        "every rule names who may connect"
    );
    ns.cleanup().await;
}

#[tokio::test]
#[ignore = "needs a cluster with Headroom installed: make e2e"]
async fn a_job_that_ooms_as_one_stage_is_retried_as_more_stages() {
    let ns = TestNs::new(E2E, "e2e-pipeline-retry").await;
    ns.apply_job(PIPELINE_RETRY).await;
    let status = ns.wait_succeeded("oom-then-split", RUN).await;
    let first = &status.attempts[0];
    assert_eq!(first.workers, 1, "the pinned first attempt");
    assert_eq!(
        first.outcome,
        AttemptOutcome::HostOutOfMemory,
        "the kernel really killed the single worker"
    );
    let last = status.attempts.last().expect("attempts");
    assert_eq!(last.outcome, AttemptOutcome::Succeeded);
    assert!(last.workers >= 2, "retried as {} stage(s)", last.workers);
    assert_eq!(
        last.settings.global_batch() * u64::from(last.replicas()),
        first.settings.global_batch() * u64::from(first.replicas())
    );
    ns.cleanup().await;
}
