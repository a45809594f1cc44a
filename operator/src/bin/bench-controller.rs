//! Controller benchmark on the local API server (not a timed test):
//!
//!     make bench-controller            # = cargo run --release --bin bench-controller -- --jobs 500
//!
//! Starts `headroom-operator` as a child process scoped to a fresh namespace,
//! creates N jobs, and reports: time until every first-attempt pod exists,
//! p50/p99 of apply→pod latency, p50/p99 of failure→next-attempt-pod latency
//! (for a sample of OOM-killed pods), and the operator's peak RSS (VmHWM).

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use futures::{StreamExt, TryStreamExt};
use headroom_api::{LABEL_ATTEMPT, LABEL_JOB, MemoryAwareTrainingJob};
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};

#[derive(Parser, Debug)]
struct Args {
    /// Jobs to create.
    #[arg(long, default_value_t = 500)]
    jobs: usize,
    /// First-attempt pods to OOM-kill (simulated) to time the retry path.
    #[arg(long, default_value_t = 100)]
    failures: usize,
    /// Concurrent job creations.
    #[arg(long, default_value_t = 16)]
    parallel: usize,
    /// The operator binary (default: next to this one).
    #[arg(long)]
    operator: Option<PathBuf>,
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

fn vm_hwm_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let client = Client::try_default()
        .await
        .context("KUBECONFIG must point at a cluster (make controlplane-up)")?;
    let ns = format!("bench-{}", std::process::id());
    let namespaces: Api<Namespace> = Api::all(client.clone());
    namespaces
        .create(
            &PostParams::default(),
            &serde_json::from_value(serde_json::json!({"metadata": {"name": ns}}))?,
        )
        .await?;
    // Workers run under `default`; a bare control plane makes no accounts.
    Api::<k8s_openapi::api::core::v1::ServiceAccount>::namespaced(client.clone(), &ns)
        .create(
            &PostParams::default(),
            &serde_json::from_value(serde_json::json!({"metadata": {"name": "default"}}))?,
        )
        .await?;

    let operator = args.operator.clone().unwrap_or_else(|| {
        std::env::current_exe()
            .map(|p| p.with_file_name("headroom-operator"))
            .unwrap_or_else(|_| "headroom-operator".into())
    });
    let mut child = tokio::process::Command::new(&operator)
        .args([
            "--no-leader-election",
            "--watch-namespace",
            &ns,
            "--metrics-addr",
            "127.0.0.1:0",
            "--concurrency",
            "16",
        ])
        .env("RUST_LOG", "warn")
        // Pods as a user's install makes them (the worker API's URL and token volume).
        .env("HEADROOM_WORKER_API_ADDR", "127.0.0.1:0")
        .env("HEADROOM_WORKER_API_URL", "http://127.0.0.1:9")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {}", operator.display()))?;
    let pid = child.id().context("operator pid")?;

    // Watch pods: record when each (job, attempt) pod first appears.
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(String, u32, Instant)>();
    let pod_watch = tokio::spawn(async move {
        let mut stream = watcher(pods, watcher::Config::default().labels(LABEL_JOB))
            .applied_objects()
            .boxed();
        while let Ok(Some(p)) = stream.try_next().await {
            let job = p.labels().get(LABEL_JOB).cloned().unwrap_or_default();
            let attempt = p
                .labels()
                .get(LABEL_ATTEMPT)
                .and_then(|a| a.parse().ok())
                .unwrap_or(0);
            let _ = tx.send((job, attempt, Instant::now()));
        }
    });

    let template: MemoryAwareTrainingJob =
        serde_yaml::from_str(include_str!("../../../samples/cpu-oom-first.yaml"))?;
    let jobs: Api<MemoryAwareTrainingJob> = Api::namespaced(client.clone(), &ns);
    let started = Instant::now();
    let applied: HashMap<String, Instant> = futures::stream::iter(0..args.jobs)
        .map(|i| {
            let jobs = jobs.clone();
            let mut job = template.clone();
            job.metadata.name = Some(format!("job-{i:04}"));
            job.metadata.namespace = Some(ns.clone());
            async move {
                let name = job.name_any();
                let at = Instant::now();
                jobs.patch(&name, &PatchParams::apply("bench"), &Patch::Apply(&job))
                    .await
                    .map(|_| (name, at))
            }
        })
        .buffer_unordered(args.parallel)
        .try_collect()
        .await?;
    let applied_all = started.elapsed();

    let mut first_pod: HashMap<String, Instant> = HashMap::new();
    let deadline = Instant::now() + Duration::from_secs(600);
    while first_pod.len() < args.jobs {
        let Ok(Some((job, attempt, at))) =
            tokio::time::timeout_at(deadline.into(), rx.recv()).await
        else {
            bail!(
                "only {} of {} first-attempt pods appeared in time",
                first_pod.len(),
                args.jobs
            );
        };
        if attempt == 1 {
            first_pod.entry(job).or_insert(at);
        }
    }
    let all_pods = started.elapsed();
    let mut apply_to_pod: Vec<Duration> = first_pod
        .iter()
        .filter_map(|(j, at)| applied.get(j).map(|a| at.saturating_duration_since(*a)))
        .collect();
    apply_to_pod.sort();

    // Failure → next attempt: OOM-kill a sample of first-attempt pods.
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let victims: Vec<String> = first_pod.keys().take(args.failures).cloned().collect();
    let status = serde_json::json!({"status": {"phase": "Failed", "containerStatuses": [{"name": "worker", "image": "i", "imageID": "", "ready": false, "restartCount": 0, "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}]}});
    let mut killed: HashMap<String, Instant> = HashMap::new();
    for job in &victims {
        let pod = format!("{job}-a1-s0");
        killed.insert(job.clone(), Instant::now());
        pods.patch_status(&pod, &PatchParams::default(), &Patch::Merge(&status))
            .await?;
    }
    let mut retried: HashMap<String, Duration> = HashMap::new();
    let deadline = Instant::now() + Duration::from_secs(300);
    while retried.len() < victims.len() {
        let Ok(Some((job, attempt, at))) =
            tokio::time::timeout_at(deadline.into(), rx.recv()).await
        else {
            bail!(
                "only {} of {} retries appeared in time",
                retried.len(),
                victims.len()
            );
        };
        if attempt == 2
            && let Some(k) = killed.get(&job)
        {
            retried
                .entry(job)
                .or_insert(at.saturating_duration_since(*k));
        }
    }
    let mut retry: Vec<Duration> = retried.into_values().collect();
    retry.sort();
    let rss_mib = vm_hwm_kib(pid).map_or(0.0, |k| k as f64 / 1024.0);

    println!(
        "jobs: {}   (created with {} in flight)",
        args.jobs, args.parallel
    );
    println!(
        "all jobs applied after:          {:>8.2} s",
        applied_all.as_secs_f64()
    );
    println!(
        "all first-attempt pods after:    {:>8.2} s",
        all_pods.as_secs_f64()
    );
    println!(
        "apply → pod latency  p50 / p99:  {:>8.1} ms / {:.1} ms",
        percentile(&apply_to_pod, 0.5).as_secs_f64() * 1e3,
        percentile(&apply_to_pod, 0.99).as_secs_f64() * 1e3
    );
    println!(
        "OOM → next-attempt pod p50 / p99: {:>7.1} ms / {:.1} ms  ({} failures)",
        percentile(&retry, 0.5).as_secs_f64() * 1e3,
        percentile(&retry, 0.99).as_secs_f64() * 1e3,
        victims.len()
    );
    println!("operator peak RSS (VmHWM):       {rss_mib:>8.1} MiB");

    pod_watch.abort();
    let _ = child.kill().await;
    let _ = namespaces.delete(&ns, &DeleteParams::default()).await;
    Ok(())
}
