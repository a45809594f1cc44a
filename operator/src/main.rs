//! `headroom-operator`: leader-elected controller plus its metrics, health
//! probe and worker API servers.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, Result};
use clap::Parser;
use headroom_operator::controller::{self, ControllerConfig};
use headroom_operator::controller::{CheckpointAccess, ChildConfig, WorkerImages};
use headroom_operator::leader::LeaseLock;
use headroom_operator::listener::{self, Limits};
use headroom_operator::metrics::{self, Metrics};
use headroom_operator::metrics_access::MetricsAccess;
use headroom_operator::watched_pods::WatchedPods;
use headroom_operator::worker_api;
use k8s_openapi::api::core::v1::Service;
use kube::Api;
use tokio::sync::watch;
use tokio_rustls::rustls::ServerConfig;

#[derive(Parser, Debug)]
#[command(
    name = "headroom-operator",
    version,
    about = "Reconciles MemoryAwareTrainingJobs"
)]
struct Args {
    /// Address of the /metrics server.
    #[arg(long, env = "HEADROOM_METRICS_ADDR", default_value = "0.0.0.0:8080")]
    metrics_addr: SocketAddr,
    /// Address of the health probes' server (/healthz, /readyz): a listener
    /// of its own, for the kubelet, so that callers of the metrics port
    /// cannot crowd the probes out.
    #[arg(long, env = "HEADROOM_PROBE_ADDR", default_value = "0.0.0.0:8082")]
    probe_addr: SocketAddr,
    /// Serve /metrics only to callers whose bearer token the API server
    /// accepts (TokenReview) and whose user may `get` the non-resource URL
    /// /metrics (SubjectAccessReview), as kube-rbac-proxy does.
    #[arg(long, env = "HEADROOM_METRICS_AUTHORIZATION")]
    metrics_authorization: bool,
    /// The share of each server's connections (metrics, probes, worker API)
    /// one source address may hold at once, more than 0 and at most 1: the
    /// rest stays for other sources, so no one pod can take them all.
    #[arg(
        long,
        env = "HEADROOM_PER_SOURCE_CONNECTION_SHARE",
        default_value_t = listener::DEFAULT_SOURCE_SHARE
    )]
    per_source_connection_share: f64,
    /// Address of the worker API (workers' telemetry and peer lookups, each
    /// call authenticated by the worker pod's projected token).
    #[arg(long, env = "HEADROOM_WORKER_API_ADDR", default_value = "0.0.0.0:8081")]
    worker_api_addr: SocketAddr,
    /// The URL workers reach the worker API at (`http://host:port`). Without
    /// it (and without --worker-api-service) workers only log their telemetry.
    #[arg(
        long,
        env = "HEADROOM_WORKER_API_URL",
        conflicts_with = "worker_api_service"
    )]
    worker_api_url: Option<String>,
    /// The operator's Service (in its own namespace) whose `worker-api` port
    /// workers call: read once at start, its cluster IP becomes the URL (cluster
    /// DNS is not assumed).
    #[arg(long, env = "HEADROOM_WORKER_API_SERVICE")]
    worker_api_service: Option<String>,
    /// A file of at least 32 random bytes (the chart mounts a Secret) from
    /// which each job's peer-link key is derived. Every replica must read
    /// the same one; without it each process makes its own, which is right
    /// only for a single replica.
    #[arg(long, env = "HEADROOM_PEER_KEY_FILE")]
    peer_key_file: Option<std::path::PathBuf>,
    /// A directory with `ca.crt` and `ca.key` (the chart's worker API CA):
    /// the worker API is then served over TLS with a certificate this
    /// process issues from it for the Service's cluster IP and DNS names,
    /// and workers are told to trust only that CA for it.
    #[arg(long, env = "HEADROOM_WORKER_API_CA_DIR")]
    worker_api_ca_dir: Option<std::path::PathBuf>,
    /// Run without leader election (a single replica, or local development).
    #[arg(long, env = "HEADROOM_NO_LEADER_ELECTION")]
    no_leader_election: bool,
    #[arg(long, env = "HEADROOM_LEASE_NAME", default_value = "headroom-operator")]
    lease_name: String,
    /// Namespace of the Lease (the operator's own namespace).
    #[arg(long, env = "POD_NAMESPACE", default_value = "headroom-system")]
    lease_namespace: String,
    /// This replica's identity (the pod name in a cluster).
    #[arg(long, env = "POD_NAME")]
    identity: Option<String>,
    #[arg(long, env = "HEADROOM_LEASE_SECONDS", default_value_t = 15)]
    lease_seconds: u64,
    /// StorageClass for checkpoint volumes (the cluster default when unset).
    #[arg(long, env = "HEADROOM_CHECKPOINT_STORAGE_CLASS")]
    checkpoint_storage_class: Option<String>,
    #[arg(long, env = "HEADROOM_CHECKPOINT_SIZE", default_value = "1Gi")]
    checkpoint_size: String,
    /// Access mode of checkpoint volumes. ReadWriteOnce keeps each job's
    /// pipeline stages on one node; ReadWriteMany (a shared filesystem) lets
    /// them spread over nodes.
    #[arg(
        long,
        env = "HEADROOM_CHECKPOINT_ACCESS_MODE",
        value_enum,
        default_value = "ReadWriteOnce"
    )]
    checkpoint_access_mode: CheckpointAccess,
    /// The shared model cache (model.pretrained.huggingFace.cache): one
    /// read-only copy of a hub checkpoint per namespace, endpoint, repository
    /// and revision. `false`: every job downloads its own.
    #[arg(
        long,
        env = "HEADROOM_MODEL_CACHE",
        default_value_t = true,
        action = clap::ArgAction::Set
    )]
    model_cache: bool,
    /// Size of a model cache claim when it is made (grown when the download
    /// does not fit and its StorageClass allows expansion).
    #[arg(long, env = "HEADROOM_MODEL_CACHE_SIZE", default_value = "20Gi")]
    model_cache_size: String,
    /// StorageClass of model cache claims (the checkpoint claims' when unset);
    /// a ReadOnlyMany-capable class lets jobs on several nodes read one copy.
    #[arg(long, env = "HEADROOM_MODEL_CACHE_STORAGE_CLASS")]
    model_cache_storage_class: Option<String>,
    /// Seconds a model cache claim no job uses is kept before it is deleted.
    #[arg(
        long,
        env = "HEADROOM_MODEL_CACHE_IDLE_SECONDS",
        default_value_t = 86_400
    )]
    model_cache_idle_seconds: u64,
    /// Host memory limit for GPU workers whose job does not set resources.gpu.hostMemory.
    #[arg(long, env = "HEADROOM_GPU_HOST_MEMORY", default_value = "16Gi")]
    gpu_host_memory: String,
    /// Image of CPU (flex) workers for jobs that set no spec.worker.image.
    /// Without it, such a CPU job fails with a spec error.
    #[arg(long, env = "HEADROOM_WORKER_IMAGE")]
    worker_image: Option<String>,
    /// Image of CUDA workers for jobs that set no spec.worker.image.
    /// Without it, such a GPU job fails with a spec error.
    #[arg(long, env = "HEADROOM_CUDA_WORKER_IMAGE")]
    cuda_worker_image: Option<String>,
    /// Seconds a worker may stay unschedulable before the attempt is replanned.
    #[arg(
        long,
        env = "HEADROOM_UNSCHEDULABLE_GRACE_SECONDS",
        default_value_t = 120
    )]
    unschedulable_grace_seconds: u64,
    /// Seconds one job's planning may take: a job whose search runs longer
    /// fails (its message says what to change) and the operator goes on
    /// with its other jobs. The largest searches take well under a second.
    #[arg(
        long,
        env = "HEADROOM_PLANNING_BUDGET_SECONDS",
        default_value_t = controller::DEFAULT_PLANNING_BUDGET.as_secs_f64()
    )]
    planning_budget_seconds: f64,
    /// How often a worker reports its live telemetry to the operator,
    /// seconds (sooner when a memory peak grows). The operator's metrics
    /// show each report as it arrives.
    #[arg(
        long,
        env = "HEADROOM_TELEMETRY_INTERVAL_SECONDS",
        default_value_t = 10.0
    )]
    telemetry_interval_seconds: f64,
    /// How often the operator writes a job's held reports into its status,
    /// seconds: one API write per job each time, whatever its number of
    /// workers, and that write is what telemetry costs the API server at
    /// scale (docs/benchmarks.md). A new worker, a peak 10 % above the one
    /// written, a phase change and an ended pod are written at once. 60 s
    /// by default: at 2,000 two-worker jobs the writes cost the API server
    /// about half of what 30 s does, under a tenth of a write per report
    /// (docs/benchmarks.md); the metrics show every report as it comes.
    #[arg(long, env = "HEADROOM_STATUS_INTERVAL_SECONDS", default_value_t = 60.0)]
    status_interval_seconds: f64,
    #[arg(long, env = "HEADROOM_CONCURRENCY", default_value_t = 8)]
    concurrency: u16,
    /// Watch jobs in this namespace only (default: all namespaces).
    #[arg(long, env = "HEADROOM_WATCH_NAMESPACE")]
    watch_namespace: Option<String>,
}

/// An interval flag's value: a finite number of seconds, at least 0.5.
fn interval(flag: &str, seconds: f64, example: u32) -> Result<Duration> {
    Some(seconds)
        .filter(|s| s.is_finite() && *s >= 0.5)
        .map(Duration::from_secs_f64)
        .ok_or_else(|| {
            anyhow::anyhow!("{flag} {seconds}: must be a number of seconds ≥ 0.5 (e.g. {example})")
        })
}

#[tokio::main]
async fn main() -> Result<()> {
    init_logging();
    let args = Args::parse();
    let checked = CheckedFlags::from_args(&args)?;
    let client = kube::Client::try_default()
        .await
        .context("connecting to the Kubernetes API")?;
    // Workers' reports, held by the worker API and written per job by its flusher.
    let reports = worker_api::WorkerReports::start(client.clone(), checked.status_interval);
    let metrics = Arc::new(Metrics::with_telemetry(reports.clone()));
    serve_metrics_and_probes(&args, &checked, &metrics, &client).await?;
    // Where workers reach the worker API (read before serving it: its
    // certificate names the Service's cluster IP).
    let endpoint = worker_api_endpoint(&client, &args).await?;
    let watched = WatchedPods::default();
    let tls = endpoint.tls.as_ref();
    serve_worker_api(&args, &checked, &client, &reports, &watched, tls).await?;

    // One shutdown signal for everything: SIGTERM/SIGINT, or lost leadership.
    let (stop_tx, stop_rx) = watch::channel(false);
    let signal_tx = stop_tx.clone();
    tokio::spawn(async move {
        shutdown_signal().await;
        tracing::info!("shutdown requested");
        let _ = signal_tx.send(true);
    });

    let identity = args
        .identity
        .clone()
        .unwrap_or_else(|| format!("{}-{}", hostname(), std::process::id()));
    let lock = (!args.no_leader_election).then(|| {
        LeaseLock::new(
            Api::namespaced(client.clone(), &args.lease_namespace),
            &args.lease_name,
            &identity,
            Duration::from_secs(args.lease_seconds.max(3)),
        )
    });
    if let Some(lock) = &lock {
        if !acquire(lock, &metrics, stop_rx.clone()).await? {
            return Ok(()); // asked to stop while standing by
        }
        tracing::info!(%identity, "leading");
        tokio::spawn(keep_leading(lock.clone(), stop_tx.clone()));
    }

    let config = controller_config(args, checked, endpoint);
    let mut rx = stop_rx.clone();
    let shutdown = async move {
        let _ = rx.wait_for(|stop| *stop).await;
    };
    controller::watch::run(
        client, metrics, reports, watched, config, &identity, shutdown,
    )
    .await;
    if let Some(lock) = &lock
        && let Err(e) = lock.release().await
    {
        tracing::warn!(%e, "could not release the lease");
    }
    Ok(())
}

fn init_logging() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,kube=warn".into()),
        )
        // Colour only for a person at a terminal: log collectors store the
        // escape codes verbatim. NO_COLOR (no-color.org) turns it off there too.
        .with_ansi(
            std::io::IsTerminal::is_terminal(&std::io::stdout())
                && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty()),
        )
        .init();
}

/// The flags checked at start, not when the first job needs them.
struct CheckedFlags {
    /// Of --per-source-connection-share.
    source_share: f64,
    telemetry_interval: Duration,
    status_interval: Duration,
    planning_budget: Duration,
    worker_images: WorkerImages,
}

impl CheckedFlags {
    fn from_args(args: &Args) -> Result<CheckedFlags> {
        // Every GPU job without resources.gpu.hostMemory is planned with it.
        headroom_api::quantity::parse_bytes(&args.gpu_host_memory).map_err(|e| {
            anyhow::anyhow!(
                "--gpu-host-memory {:?}: {e} (e.g. 16Gi)",
                args.gpu_host_memory
            )
        })?;
        let source_share = args.per_source_connection_share;
        if !(source_share > 0.0 && source_share <= 1.0) {
            anyhow::bail!(
                "--per-source-connection-share {source_share}: must be more than 0 and at most 1 (e.g. {})",
                listener::DEFAULT_SOURCE_SHARE
            );
        }
        let budget = args.planning_budget_seconds;
        if !(budget.is_finite() && budget > 0.0 && budget <= 3600.0) {
            anyhow::bail!(
                "--planning-budget-seconds {budget}: must be a number of seconds more than 0 and at most 3600 (e.g. {})",
                controller::DEFAULT_PLANNING_BUDGET.as_secs_f64()
            );
        }
        Ok(CheckedFlags {
            source_share,
            planning_budget: Duration::from_secs_f64(budget),
            telemetry_interval: interval(
                "--telemetry-interval-seconds",
                args.telemetry_interval_seconds,
                10,
            )?,
            status_interval: interval(
                "--status-interval-seconds",
                args.status_interval_seconds,
                30,
            )?,
            worker_images: WorkerImages::from_flags(
                args.worker_image.clone(),
                args.cuda_worker_image.clone(),
            )
            .map_err(anyhow::Error::msg)?,
        })
    }
}

/// Serves /metrics on --metrics-addr (with --metrics-authorization, to the
/// callers allowed to read it) and the health probes on --probe-addr.
async fn serve_metrics_and_probes(
    args: &Args,
    checked: &CheckedFlags,
    metrics: &Arc<Metrics>,
    client: &kube::Client,
) -> Result<()> {
    let share = checked.source_share;
    let access = args
        .metrics_authorization
        .then(|| Arc::new(MetricsAccess::new(client.clone())));
    let app = metrics::router(metrics.clone(), access);
    let limits = Limits::METRICS.with_source_share(share);
    spawn_server("metrics", args.metrics_addr, app, limits, None).await?;
    let app = metrics::probes_router(metrics.clone());
    let limits = Limits::PROBES.with_source_share(share);
    spawn_server("health probe", args.probe_addr, app, limits, None).await
}

/// Binds `addr` and serves `app` there under `limits` (over TLS with `tls`)
/// until the process ends; `what` names the server in the log.
async fn spawn_server(
    what: &'static str,
    addr: SocketAddr,
    app: axum::Router,
    limits: Limits,
    tls: Option<Arc<ServerConfig>>,
) -> Result<()> {
    let bound = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding the {what} server to {addr}"))?;
    let server = listener::serve(bound, app, limits, tls);
    tokio::spawn(async move {
        if let Err(e) = server.await {
            tracing::error!(%e, "{what} server stopped");
        }
    });
    Ok(())
}

/// Where workers reach the worker API, and how it is served.
struct WorkerApiEndpoint {
    /// The URL handed to workers; None: they only log their telemetry.
    url: Option<String>,
    /// TLS from the chart's CA, for the hosts the URL may name.
    tls: Option<worker_api::ServingTls>,
}

/// The worker API's URL, from --worker-api-url or the cluster IP of
/// --worker-api-service, and, with --worker-api-ca-dir, a certificate for
/// the hosts workers reach it by.
async fn worker_api_endpoint(client: &kube::Client, args: &Args) -> Result<WorkerApiEndpoint> {
    let scheme = if args.worker_api_ca_dir.is_some() {
        "https"
    } else {
        "http"
    };
    let (url, mut tls_hosts) = match (&args.worker_api_url, &args.worker_api_service) {
        (Some(url), _) => (Some(url.clone()), vec![url_host(url)]),
        (None, Some(service)) => {
            let (ip, port) = service_address(client, &args.lease_namespace, service).await?;
            let host = if ip.is_ipv6() {
                format!("[{ip}]")
            } else {
                ip.to_string()
            };
            (
                Some(format!("{scheme}://{host}:{port}")),
                worker_api::tls::service_hosts(service, &args.lease_namespace, Some(ip)),
            )
        }
        (None, None) => {
            tracing::warn!(
                "no --worker-api-url or --worker-api-service: workers will only log their telemetry, and pipeline peers need cluster DNS"
            );
            (None, vec![])
        }
    };
    let tls = match &args.worker_api_ca_dir {
        Some(dir) => {
            tls_hosts.retain(|h| !h.is_empty());
            let tls =
                worker_api::ServingTls::issue(dir, &tls_hosts).context("--worker-api-ca-dir")?;
            tracing::info!(hosts = ?tls_hosts, "worker API over TLS");
            Some(tls)
        }
        None => None,
    };
    Ok(WorkerApiEndpoint { url, tls })
}

/// The host of a `scheme://host[:port][/path]` URL (an IPv6 one without
/// its brackets); empty when there is none.
fn url_host(url: &str) -> String {
    let authority = url.split("://").nth(1).unwrap_or_default();
    match authority.strip_prefix('[') {
        // [IPv6]:port
        Some(rest) => rest.split(']').next().unwrap_or_default(),
        None => authority.split(['/', ':']).next().unwrap_or_default(),
    }
    .to_string()
}

/// Serves the worker API on --worker-api-addr. Every replica serves it (a
/// standby too: it needs no cache, and reads callers' pods from the API
/// server until it leads and its controller lends it the pod cache), so the
/// Service answers whichever one it picks.
async fn serve_worker_api(
    args: &Args,
    checked: &CheckedFlags,
    client: &kube::Client,
    reports: &Arc<worker_api::WorkerReports>,
    watched: &WatchedPods,
    tls: Option<&worker_api::ServingTls>,
) -> Result<()> {
    let peer_key = match &args.peer_key_file {
        Some(path) => worker_api::OperatorKey::from_file(path)?,
        None => {
            tracing::warn!(
                "no --peer-key-file: this process derives peer-link keys from a key of its own; with more than one replica, give all of them the same file"
            );
            worker_api::OperatorKey::random()?
        }
    };
    let app = worker_api::router(client.clone(), peer_key, reports.clone(), watched.clone());
    let limits = Limits::WORKER_API.with_source_share(checked.source_share);
    let tls = tls.map(|t| t.config.clone());
    spawn_server("worker API", args.worker_api_addr, app, limits, tls).await
}

/// The controller's settings from the flags.
fn controller_config(
    args: Args,
    checked: CheckedFlags,
    endpoint: WorkerApiEndpoint,
) -> ControllerConfig {
    ControllerConfig {
        children: ChildConfig {
            checkpoint_storage_class: args.checkpoint_storage_class,
            checkpoint_size: args.checkpoint_size,
            checkpoint_access: args.checkpoint_access_mode,
            gpu_host_memory: args.gpu_host_memory,
            worker_images: checked.worker_images,
            telemetry_interval: checked.telemetry_interval,
            worker_api_url: endpoint.url,
            worker_api_ca: endpoint.tls.map(|t| t.ca_pem),
            model_cache: controller::ModelCacheConfig {
                enabled: args.model_cache,
                size: args.model_cache_size,
                storage_class: args.model_cache_storage_class,
                idle: Duration::from_secs(args.model_cache_idle_seconds),
            },
        },
        unschedulable_grace: Duration::from_secs(args.unschedulable_grace_seconds),
        planning_budget: checked.planning_budget,
        concurrency: args.concurrency.max(1),
        namespace: args.watch_namespace,
        ..ControllerConfig::default()
    }
}

/// Waits until this replica holds the lease; false when asked to stop first.
/// A healthy standby reports ready: otherwise a rolling update, whose new pod
/// stands by until the old one leaves, could never make progress.
async fn acquire(
    lock: &LeaseLock,
    metrics: &Metrics,
    mut stop: watch::Receiver<bool>,
) -> Result<bool> {
    let retry = lock.duration() / 3;
    loop {
        match lock.try_acquire_or_renew().await {
            Ok(true) => {
                metrics.set_ready(false); // ready again once the caches have synced
                return Ok(true);
            }
            Ok(false) => {
                metrics.set_ready(true);
                tracing::debug!("standing by: another replica leads");
            }
            Err(e) => {
                metrics.set_ready(false);
                tracing::warn!(%e, "lease");
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(retry) => {}
            _ = stop.wait_for(|s| *s) => return Ok(false),
        }
    }
}

/// Renews the lease; if it cannot for a whole lease duration, stops the controller.
async fn keep_leading(lock: LeaseLock, stop: watch::Sender<bool>) {
    let period = lock.duration() / 3;
    let mut last_ok = tokio::time::Instant::now();
    loop {
        tokio::time::sleep(period).await;
        match lock.try_acquire_or_renew().await {
            Ok(true) => last_ok = tokio::time::Instant::now(),
            Ok(false) => {
                tracing::error!("leadership lost to another replica; stopping");
                let _ = stop.send(true);
                return;
            }
            Err(e) => tracing::warn!(%e, "lease renewal failed"),
        }
        if last_ok.elapsed() > lock.duration() {
            tracing::error!("could not renew the lease in time; stopping");
            let _ = stop.send(true);
            return;
        }
    }
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => return ctrl_c.await.unwrap_or(()),
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}

/// The cluster IP of `service` and its `worker-api` port.
async fn service_address(
    client: &kube::Client,
    namespace: &str,
    service: &str,
) -> Result<(std::net::IpAddr, i32)> {
    let svc = Api::<Service>::namespaced(client.clone(), namespace)
        .get(service)
        .await
        .with_context(|| format!("--worker-api-service: reading Service {namespace}/{service}"))?;
    let spec = svc.spec.unwrap_or_default();
    let ip = spec
        .cluster_ip
        .filter(|ip| !ip.is_empty() && ip != "None")
        .with_context(|| {
            format!("--worker-api-service: Service {namespace}/{service} has no cluster IP (a headless Service will not do)")
        })?;
    let ip = ip.parse().with_context(|| {
        format!("--worker-api-service: Service {namespace}/{service} has cluster IP {ip:?}")
    })?;
    let port = spec
        .ports
        .unwrap_or_default()
        .into_iter()
        .find(|p| p.name.as_deref() == Some("worker-api"))
        .map(|p| p.port)
        .with_context(|| {
            format!(
                "--worker-api-service: Service {namespace}/{service} has no port named worker-api"
            )
        })?;
    Ok((ip, port))
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "headroom".into())
}
