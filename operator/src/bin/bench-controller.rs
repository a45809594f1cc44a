//! Controller benchmark on the local API server (not a timed test):
//!
//!     make bench-controller            # = cargo run --release --bin bench-controller -- --jobs 500
//!
//! Starts `headroom-operator` as a child process scoped to a fresh namespace,
//! creates N jobs, and reports: time until every first-attempt pod exists,
//! p50/p99 of apply→pod latency, p50/p99 of failure→next-attempt-pod latency
//! (for a sample of OOM-killed pods), and the operator's peak RSS (VmHWM).
//!
//! With `--report-seconds S` it also measures what running workers' telemetry
//! costs, with every first-attempt pod marked Running and one
//! fake worker per pod posting a report every `--report-interval` seconds:
//! (a) for S seconds as workers wrote before the operator aggregated them,
//! one server-side apply of the job's status per report under the worker's
//! own field manager; (b) for S seconds through the operator's real worker
//! API (a pod-bound token each, checked by TokenReview), which holds the
//! reports and writes each job's status at most once per interval. For each:
//! kube-apiserver CPU (from /proc), its p99 request latency (its own
//! histogram, watches excluded), the operator's CPU and peak RSS.
//!
//!     bench-controller --jobs 2000 --stages 2 --failures 0 --report-seconds 300   # 4,000 workers

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
    /// Pipeline stages per job (workers per job), pinned.
    #[arg(long, default_value_t = 1)]
    stages: u32,
    /// Seconds of each telemetry phase (0: no telemetry phases).
    #[arg(long, default_value_t = 0)]
    report_seconds: u64,
    /// Seconds between one worker's reports (the chart's default is 10).
    #[arg(long, default_value_t = 10.0)]
    report_interval: f64,
    /// The operator's status-write interval (its default is 30).
    #[arg(long, default_value_t = 30.0)]
    status_interval: f64,
    /// kube-apiserver's pid file (its CPU is read from /proc).
    #[arg(long)]
    apiserver_pid_file: Option<PathBuf>,
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

/// When each (job, attempt) pod was first seen.
type PodAppearances = tokio::sync::mpsc::UnboundedReceiver<(String, u32, Instant)>;

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let client = Client::try_default()
        .await
        .context("KUBECONFIG must point at a cluster (make controlplane-up)")?;
    let ns = format!("bench-{}", std::process::id());
    let namespaces: Api<Namespace> = Api::all(client.clone());
    create_namespace(&client, &ns).await?;

    // A free port for the worker API, which the telemetry phase calls.
    let api_port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let api_addr = format!("127.0.0.1:{api_port}");
    let mut child = start_operator(&args, &ns, &api_addr)?;
    let pid = child.id().context("operator pid")?;
    let (pod_watch, mut rx) = watch_pod_appearances(&client, &ns);

    let jobs: Api<MemoryAwareTrainingJob> = Api::namespaced(client.clone(), &ns);
    let started = Instant::now();
    let applied = apply_jobs(&jobs, &ns, &job_template(args.stages)?, &args).await?;
    let applied_all = started.elapsed();
    let first_pod = wait_for_first_pods(&mut rx, args.jobs).await?;
    if args.stages > 1 {
        wait_for_every_stage(&client, &ns, args.jobs * args.stages as usize).await?;
    }
    let all_pods = started.elapsed();
    let mut apply_to_pod: Vec<Duration> = first_pod
        .iter()
        .filter_map(|(j, at)| applied.get(j).map(|a| at.saturating_duration_since(*a)))
        .collect();
    apply_to_pod.sort();

    if args.report_seconds > 0 {
        telemetry::run(
            &client,
            &ns,
            args.jobs * args.stages as usize,
            &api_addr,
            Duration::from_secs_f64(args.report_interval),
            Duration::from_secs_f64(args.status_interval),
            Duration::from_secs(args.report_seconds),
            apiserver_pid(&args)?,
            pid,
        )
        .await?;
    }

    let victims: Vec<String> = first_pod.keys().take(args.failures).cloned().collect();
    let retry = time_retries(&client, &ns, &victims, &mut rx).await?;
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

/// Creates namespace `ns` with its `default` ServiceAccount: workers run
/// under it, and a bare control plane makes no accounts.
async fn create_namespace(client: &Client, ns: &str) -> Result<()> {
    Api::<Namespace>::all(client.clone())
        .create(
            &PostParams::default(),
            &serde_json::from_value(serde_json::json!({"metadata": {"name": ns}}))?,
        )
        .await?;
    Api::<k8s_openapi::api::core::v1::ServiceAccount>::namespaced(client.clone(), ns)
        .create(
            &PostParams::default(),
            &serde_json::from_value(serde_json::json!({"metadata": {"name": "default"}}))?,
        )
        .await?;
    Ok(())
}

/// Starts the operator scoped to `ns`, its worker API on `api_addr`.
fn start_operator(args: &Args, ns: &str, api_addr: &str) -> Result<tokio::process::Child> {
    let operator = args.operator.clone().unwrap_or_else(|| {
        std::env::current_exe()
            .map(|p| p.with_file_name("headroom-operator"))
            .unwrap_or_else(|_| "headroom-operator".into())
    });
    tokio::process::Command::new(&operator)
        .args([
            "--no-leader-election",
            "--watch-namespace",
            ns,
            "--metrics-addr",
            "127.0.0.1:0",
            "--probe-addr",
            "127.0.0.1:0",
            "--concurrency",
            "16",
            "--telemetry-interval-seconds",
            &args.report_interval.to_string(),
            "--status-interval-seconds",
            &args.status_interval.to_string(),
        ])
        .env("RUST_LOG", "warn")
        // Pods as a user's install makes them (the worker API's URL and token volume).
        .env("HEADROOM_WORKER_API_ADDR", api_addr)
        .env("HEADROOM_WORKER_API_URL", "http://127.0.0.1:9")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {}", operator.display()))
}

/// Watches the job pods of `ns`: when each (job, attempt) pod first appears.
fn watch_pod_appearances(
    client: &Client,
    ns: &str,
) -> (tokio::task::JoinHandle<()>, PodAppearances) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<(String, u32, Instant)>();
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
    (pod_watch, rx)
}

/// The sample job whose first attempt runs out of memory, with `stages`
/// pinned pipeline stages.
fn job_template(stages: u32) -> Result<MemoryAwareTrainingJob> {
    let mut template: MemoryAwareTrainingJob =
        serde_yaml::from_str(include_str!("../../../samples/cpu-oom-first.yaml"))?;
    if stages > 1 {
        template.spec.training.pipeline_stages = Some(stages);
        if let Some(cpu) = template.spec.resources.cpu.as_mut() {
            cpu.max_workers = cpu.max_workers.max(stages);
        }
    }
    Ok(template)
}

/// Applies `args.jobs` copies of `template`, `args.parallel` at a time:
/// when each was applied.
async fn apply_jobs(
    jobs: &Api<MemoryAwareTrainingJob>,
    ns: &str,
    template: &MemoryAwareTrainingJob,
    args: &Args,
) -> Result<HashMap<String, Instant>> {
    futures::stream::iter(0..args.jobs)
        .map(|i| {
            let jobs = jobs.clone();
            let mut job = template.clone();
            job.metadata.name = Some(format!("job-{i:04}"));
            job.metadata.namespace = Some(ns.to_string());
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
        .await
        .map_err(Into::into)
}

/// Waits (10 minutes at most) until each of `jobs` jobs has a first-attempt
/// pod: when each appeared.
async fn wait_for_first_pods(
    rx: &mut PodAppearances,
    jobs: usize,
) -> Result<HashMap<String, Instant>> {
    let mut first_pod: HashMap<String, Instant> = HashMap::new();
    let deadline = Instant::now() + Duration::from_secs(600);
    while first_pod.len() < jobs {
        let Ok(Some((job, attempt, at))) =
            tokio::time::timeout_at(deadline.into(), rx.recv()).await
        else {
            bail!(
                "only {} of {} first-attempt pods appeared in time",
                first_pod.len(),
                jobs
            );
        };
        if attempt == 1 {
            first_pod.entry(job).or_insert(at);
        }
    }
    Ok(first_pod)
}

/// Waits (10 minutes at most) until `ns` holds `want` pods: every stage's,
/// not only each job's first.
async fn wait_for_every_stage(client: &Client, ns: &str, want: usize) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let n = Api::<Pod>::namespaced(client.clone(), ns)
            .list_metadata(&Default::default())
            .await?
            .items
            .len();
        if n >= want {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("only {n} of {want} pods appeared in time");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// kube-apiserver's pid, from --apiserver-pid-file or the local control
/// plane's pid file.
fn apiserver_pid(args: &Args) -> Result<u32> {
    let pid_file = args.apiserver_pid_file.clone().unwrap_or_else(|| {
        let cache = std::env::var("HEADROOM_CACHE").unwrap_or_else(|_| {
            format!(
                "{}/.cache/headroom",
                std::env::var("HOME").unwrap_or_default()
            )
        });
        PathBuf::from(cache).join("state/controlplane/run/kube-apiserver.pid")
    });
    std::fs::read_to_string(&pid_file)
        .with_context(|| format!("reading {}", pid_file.display()))?
        .trim()
        .parse()
        .context("kube-apiserver pid")
}

/// Failure → next attempt: OOM-kills the first-attempt pod of each of
/// `victims` (simulated) and waits (5 minutes at most) for each one's
/// second attempt: the latencies, sorted.
async fn time_retries(
    client: &Client,
    ns: &str,
    victims: &[String],
    rx: &mut PodAppearances,
) -> Result<Vec<Duration>> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let status = serde_json::json!({"status": {"phase": "Failed", "containerStatuses": [{"name": "worker", "image": "i", "imageID": "", "ready": false, "restartCount": 0, "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}]}});
    let mut killed: HashMap<String, Instant> = HashMap::new();
    for job in victims {
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
    Ok(retry)
}

/// The telemetry phases (see the file's doc).
mod telemetry {
    use std::collections::BTreeMap;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::{Duration, Instant};

    use anyhow::{Context, Result, bail};
    use futures::future::BoxFuture;
    use futures::{FutureExt, StreamExt, TryStreamExt};
    use headroom_api::{
        LABEL_JOB, LABEL_STAGE, MemoryAwareTrainingJob, WORKER_API_AUDIENCE,
        WORKER_API_TELEMETRY_PATH, WORKER_FIELD_MANAGER_PREFIX,
    };
    use k8s_openapi::api::authentication::v1::{
        BoundObjectReference, TokenRequest, TokenRequestSpec,
    };
    use k8s_openapi::api::core::v1::{Pod, ServiceAccount};
    use kube::api::{Api, Patch, PatchParams, PostParams};
    use kube::{Client, ResourceExt};
    use serde_json::json;

    /// One fake worker: its pod, job, stage and layers, and its token.
    struct Reporter {
        pod: String,
        job: String,
        stage: u32,
        layers: (u32, u32),
        token: String,
    }

    /// CPU seconds a process has used (user + system), from /proc.
    fn cpu_seconds(pid: u32) -> f64 {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        // Fields after the command (which may hold spaces) start after ')'.
        let after = stat.rsplit_once(')').map_or("", |(_, a)| a);
        let fields: Vec<&str> = after.split_whitespace().collect();
        let ticks = |i: usize| {
            fields
                .get(i)
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or(0.0)
        };
        // utime and stime are fields 14 and 15 of the line: 11 and 12 after ')'.
        (ticks(11) + ticks(12)) / 100.0
    }

    /// kube-apiserver's request-duration histogram, summed over every label
    /// set but the long-running verbs: upper bound (s) → cumulative count.
    async fn latency_histogram(client: &Client) -> Result<BTreeMap<String, f64>> {
        let text = client
            .request_text(axum::http::Request::get("/metrics").body(Vec::new())?)
            .await?;
        let mut out = BTreeMap::new();
        for line in text.lines() {
            let Some(rest) = line.strip_prefix("apiserver_request_duration_seconds_bucket{") else {
                continue;
            };
            if rest.contains("verb=\"WATCH\"") || rest.contains("verb=\"CONNECT\"") {
                continue;
            }
            let Some((labels, count)) = rest.rsplit_once("} ") else {
                continue;
            };
            let Some(le) = labels
                .split(',')
                .find_map(|l| l.strip_prefix("le=\""))
                .map(|l| l.trim_end_matches('"').to_string())
            else {
                continue;
            };
            *out.entry(le).or_insert(0.0) += count.trim().parse::<f64>().unwrap_or(0.0);
        }
        Ok(out)
    }

    /// The p99 of the requests between two histogram snapshots: the upper
    /// bound of the first bucket holding 99 % of them.
    fn p99(before: &BTreeMap<String, f64>, after: &BTreeMap<String, f64>) -> (f64, f64) {
        let mut buckets: Vec<(f64, f64)> = after
            .iter()
            .map(|(le, n)| {
                let bound = if le == "+Inf" {
                    f64::INFINITY
                } else {
                    le.parse().unwrap_or(f64::INFINITY)
                };
                (bound, n - before.get(le).copied().unwrap_or(0.0))
            })
            .collect();
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        let total = buckets.last().map_or(0.0, |b| b.1);
        let p99 = buckets
            .iter()
            .find(|(_, n)| *n >= 0.99 * total)
            .map_or(f64::NAN, |b| b.0);
        (p99, total)
    }

    fn vm_hwm_mib(pid: u32) -> f64 {
        super::vm_hwm_kib(pid).map_or(0.0, |k| k as f64 / 1024.0)
    }

    fn report(r: &Reporter, step: u64) -> serde_json::Value {
        json!({
            "name": r.pod, "attempt": 1, "stage": r.stage,
            "layerStart": r.layers.0, "layerEnd": r.layers.1, "step": step,
            "memory": {"cgroupCurrentBytes": 100_000_000u64 + step, "peakBytes": 200_000_000u64},
            "tokensPerSecond": 1000.0,
            "updatedAt": jiff::Timestamp::now().to_string(),
        })
    }

    /// One report through the worker API on a fresh connection: the status
    /// code (0: no answer). Blocking I/O on the blocking pool: the operator's
    /// release build has no tokio io-util, and a loopback call is short.
    async fn post(addr: &str, token: &str, body: &str) -> u16 {
        use std::io::{Read, Write};
        let request = format!(
            "POST {WORKER_API_TELEMETRY_PATH} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {token}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        let addr = addr.to_string();
        tokio::task::spawn_blocking(move || {
            let Ok(mut stream) = std::net::TcpStream::connect(&addr) else {
                return 0;
            };
            let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
            if stream.write_all(request.as_bytes()).is_err() {
                return 0;
            }
            let mut response = Vec::new();
            let _ = stream.read_to_end(&mut response);
            String::from_utf8_lossy(&response)
                .split_whitespace()
                .nth(1)
                .and_then(|c| c.parse().ok())
                .unwrap_or(0)
        })
        .await
        .unwrap_or(0)
    }

    struct Figures {
        apiserver_cores: f64,
        operator_cores: f64,
        p99: f64,
        requests: f64,
        reports: u64,
        refused: u64,
        /// Ticks skipped because the previous report was still in flight.
        missed: u64,
    }

    /// Runs `send` for every reporter every `interval` (each at its own
    /// offset) for `settle` + `seconds`, and measures the last `seconds`:
    /// the steady state, once what happens only when reporting starts is
    /// over.
    #[allow(clippy::too_many_arguments)]
    async fn phase<F, Fut>(
        client: &Client,
        reporters: &Arc<Vec<Reporter>>,
        interval: Duration,
        settle: Duration,
        seconds: Duration,
        pids: (u32, u32),
        send: F,
    ) -> Result<Figures>
    where
        F: Fn(usize, u64) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = bool> + Send,
    {
        let send = Arc::new(send);
        let (sent, refused, missed) = (
            Arc::new(AtomicU64::new(0)),
            Arc::new(AtomicU64::new(0)),
            Arc::new(AtomicU64::new(0)),
        );
        let start = Instant::now();
        let end = start + settle + seconds;
        let n = reporters.len();
        let mut tasks = Vec::with_capacity(n);
        for i in 0..n {
            let (send, sent, refused, missed) =
                (send.clone(), sent.clone(), refused.clone(), missed.clone());
            let offset = interval.mul_f64(i as f64 / n as f64);
            tasks.push(tokio::spawn(async move {
                let mut next = start + offset;
                let mut step = 0u64;
                while next < end {
                    tokio::time::sleep_until(next.into()).await;
                    step += 1;
                    if send(i, step).await {
                        sent.fetch_add(1, Ordering::Relaxed);
                    } else {
                        refused.fetch_add(1, Ordering::Relaxed);
                    }
                    // A worker reports on a timer: a tick missed while its
                    // last report was still being answered is skipped, so
                    // an API server that cannot keep up shows as fewer
                    // reports, not as a phase that never ends.
                    next += interval;
                    let now = Instant::now();
                    while next < now {
                        next += interval;
                        missed.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }));
        }
        tokio::time::sleep_until((start + settle).into()).await;
        let before = latency_histogram(client).await?;
        let (a0, o0) = (cpu_seconds(pids.0), cpu_seconds(pids.1));
        let measured = Instant::now();
        for t in tasks {
            let _ = t.await;
        }
        let elapsed = measured.elapsed().as_secs_f64();
        let (a1, o1) = (cpu_seconds(pids.0), cpu_seconds(pids.1));
        let after = latency_histogram(client).await?;
        let (p99, requests) = p99(&before, &after);
        Ok(Figures {
            apiserver_cores: (a1 - a0) / elapsed,
            operator_cores: (o1 - o0) / elapsed,
            p99,
            requests,
            reports: sent.load(Ordering::Relaxed),
            refused: refused.load(Ordering::Relaxed),
            missed: missed.load(Ordering::Relaxed),
        })
    }

    #[allow(clippy::too_many_arguments)]
    pub async fn run(
        client: &Client,
        ns: &str,
        workers: usize,
        api_addr: &str,
        interval: Duration,
        status_interval: Duration,
        seconds: Duration,
        apiserver_pid: u32,
        operator_pid: u32,
    ) -> Result<()> {
        let jobs_api: Api<MemoryAwareTrainingJob> = Api::namespaced(client.clone(), ns);
        let reporters = Arc::new(running_reporters(client, ns, workers).await?);
        // Let the operator's caches see the Running pods.
        tokio::time::sleep(Duration::from_secs(5)).await;
        let pids = (apiserver_pid, operator_pid);
        let n = reporters.len();

        // What the API server and the operator spend with no reports: the
        // other figures are net of it.
        let quiet = seconds.min(Duration::from_secs(60));
        eprintln!("telemetry (0): no reports, {} s", quiet.as_secs());
        let idle = phase(
            client,
            &reporters,
            interval,
            Duration::ZERO,
            quiet,
            pids,
            |_, _| async { true },
        )
        .await?;
        eprintln!(
            "telemetry (a): {n} workers, one status apply each per report, {} s",
            seconds.as_secs()
        );
        let direct = phase(
            client,
            &reporters,
            interval,
            Duration::ZERO,
            seconds,
            pids,
            apply_each_report(reporters.clone(), jobs_api),
        )
        .await?;
        // Each worker's first report is written at once (a worker the
        // status has not shown); measured from one status interval and one
        // report later, the steady state.
        let settle = status_interval + interval;
        eprintln!(
            "telemetry (b): {n} workers through the worker API, {} s after {} s",
            seconds.as_secs(),
            settle.as_secs()
        );
        let aggregated = phase(
            client,
            &reporters,
            interval,
            settle,
            seconds,
            pids,
            post_to_worker_api(reporters.clone(), api_addr.to_string()),
        )
        .await?;
        println!(
            "telemetry: {n} workers reporting every {:.0} s, {} s per phase measured ((b): after {} s of reports, its workers' first writes)",
            interval.as_secs_f64(),
            seconds.as_secs(),
            settle.as_secs()
        );
        print_figures(n, &idle, &direct, &aggregated);
        println!(
            "operator peak RSS (VmHWM) after both: {:.1} MiB",
            vm_hwm_mib(operator_pid)
        );
        Ok(())
    }

    /// Phase (a): each report one server-side apply of the job's status
    /// under the worker's own field manager, as workers wrote before the
    /// operator held their reports.
    fn apply_each_report(
        reporters: Arc<Vec<Reporter>>,
        jobs_api: Api<MemoryAwareTrainingJob>,
    ) -> impl Fn(usize, u64) -> BoxFuture<'static, bool> + Send + Sync + 'static {
        move |i, step| {
            let (reporters, jobs_api) = (reporters.clone(), jobs_api.clone());
            async move {
                let r = &reporters[i];
                let body = json!({
                    "apiVersion": "headroom.dev/v1alpha1", "kind": "MemoryAwareTrainingJob",
                    "metadata": {"name": r.job},
                    "status": {"workers": [report(r, step)]},
                });
                jobs_api
                    .patch_status(
                        &r.job,
                        &PatchParams::apply(&format!("{WORKER_FIELD_MANAGER_PREFIX}{}", r.pod))
                            .force(),
                        &Patch::Apply(&body),
                    )
                    .await
                    .is_ok()
            }
            .boxed()
        }
    }

    /// Phase (b): each report posted to the operator's worker API at `addr`.
    fn post_to_worker_api(
        reporters: Arc<Vec<Reporter>>,
        addr: String,
    ) -> impl Fn(usize, u64) -> BoxFuture<'static, bool> + Send + Sync + 'static {
        move |i, step| {
            let (reporters, addr) = (reporters.clone(), addr.clone());
            async move {
                let r = &reporters[i];
                let body = report(r, step).to_string();
                matches!(post(&addr, &r.token, &body).await, 200..=299)
            }
            .boxed()
        }
    }

    /// The three phases' figures, (a) and (b) net of the idle phase (0).
    fn print_figures(n: usize, idle: &Figures, direct: &Figures, aggregated: &Figures) {
        println!(
            "(0) no reports                 : kube-apiserver {:.3} cores, operator {:.3} cores (subtracted below)",
            idle.apiserver_cores, idle.operator_cores
        );
        let net = |f: &Figures| (f.apiserver_cores - idle.apiserver_cores).max(0.0);
        for (what, f) in [
            ("(a) one status apply per report", direct),
            ("(b) through the worker API     ", aggregated),
        ] {
            println!(
                "{what}: kube-apiserver +{:.3} cores ({:.1} µs CPU/s per worker), p99 {:.3} s over {:.0} requests; operator +{:.3} cores; reports {} ok, {} refused, {} ticks missed while the last was in flight",
                net(f),
                net(f) * 1e6 / n as f64,
                f.p99,
                f.requests,
                (f.operator_cores - idle.operator_cores).max(0.0),
                f.reports,
                f.refused,
                f.missed
            );
        }
        println!(
            "kube-apiserver CPU per worker, (b) / (a): {:.3}",
            net(aggregated) / net(direct).max(1e-9)
        );
    }

    /// The first attempts' `workers` pods of `ns`, each marked Running, as
    /// fake workers with a pod-bound worker API token each.
    async fn running_reporters(client: &Client, ns: &str, workers: usize) -> Result<Vec<Reporter>> {
        let pods_api: Api<Pod> = Api::namespaced(client.clone(), ns);
        let pods: Vec<Pod> = pods_api
            .list(&Default::default())
            .await?
            .items
            .into_iter()
            .filter(|p| p.name_any().contains("-a1-"))
            .collect();
        if pods.len() < workers {
            bail!("{} first-attempt pods, {workers} expected", pods.len());
        }
        let layers = stage_layers(client, ns).await?;
        eprintln!("telemetry: {} pods Running, a token each", pods.len());
        let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), ns);
        futures::stream::iter(pods)
            .map(|pod| running_reporter(&pods_api, &accounts, &layers, pod))
            .buffer_unordered(32)
            .try_collect()
            .await
    }

    /// Each (job, stage)'s layer range, from the job's plan.
    async fn stage_layers(
        client: &Client,
        ns: &str,
    ) -> Result<BTreeMap<(String, u32), (u32, u32)>> {
        let jobs_api: Api<MemoryAwareTrainingJob> = Api::namespaced(client.clone(), ns);
        let mut layers = BTreeMap::new();
        for job in jobs_api.list(&Default::default()).await?.items {
            if let Some(plan) = job.status.as_ref().and_then(|s| s.plan.as_ref()) {
                for st in &plan.stages {
                    layers.insert((job.name_any(), st.index), (st.layer_start, st.layer_end));
                }
            }
        }
        Ok(layers)
    }

    /// Marks `pod` Running and asks a token bound to it: its fake worker.
    async fn running_reporter(
        pods_api: &Api<Pod>,
        accounts: &Api<ServiceAccount>,
        layers: &BTreeMap<(String, u32), (u32, u32)>,
        pod: Pod,
    ) -> Result<Reporter> {
        let running = json!({"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}],
            "containerStatuses": [{"name": "worker", "image": "i", "imageID": "", "ready": true, "restartCount": 0,
                                   "state": {"running": {"startedAt": "2026-11-28T00:00:00Z"}}}]}});
        let name = pod.name_any();
        pods_api
            .patch_status(&name, &PatchParams::default(), &Patch::Merge(&running))
            .await?;
        let request = TokenRequest {
            spec: TokenRequestSpec {
                audiences: vec![WORKER_API_AUDIENCE.into()],
                bound_object_ref: Some(BoundObjectReference {
                    kind: Some("Pod".into()),
                    api_version: Some("v1".into()),
                    name: Some(name.clone()),
                    uid: pod.uid(),
                }),
                expiration_seconds: Some(7200),
            },
            ..TokenRequest::default()
        };
        let token = accounts
            .create_token_request("default", &PostParams::default(), &request)
            .await?
            .status
            .context("token")?
            .token;
        let job = pod.labels().get(LABEL_JOB).cloned().unwrap_or_default();
        let stage: u32 = pod
            .labels()
            .get(LABEL_STAGE)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let layers = layers.get(&(job.clone(), stage)).copied().unwrap_or((0, 1));
        Ok(Reporter {
            pod: name,
            job,
            stage,
            layers,
            token,
        })
    }
}
