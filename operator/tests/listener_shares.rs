//! One source that holds the operator's ports full (a pod, or a client
//! through a port-forward) must leave the kubelet's probes and every other
//! source answered, in-process on loopback: Linux routes all of 127/8 to
//! `lo`, so a client bound to 127.0.0.2 is another source than 127.0.0.1.
//!
//! With the probes on the metrics port and no share per source, 80 idle
//! connections from one client took all 64 of that port's slots: /healthz
//! failed, the pod went NotReady and its liveness probe failed. The last
//! test here shows that flood working against a pool without a share.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use headroom_operator::listener::{DEFAULT_SOURCE_SHARE, Limits, serve};
use headroom_operator::metrics::{self, Metrics};
use headroom_operator::worker_api::{self, OperatorKey};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};

/// The client that floods every port.
const FLOODER: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 1);
/// The kubelet's probes.
const KUBELET: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 2);
/// Prometheus, or a worker.
const OTHER: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 3);

/// The flood's size per port: more than any of the pools below.
const FLOOD: usize = 80;

/// The operator's three servers on loopback ports.
struct Servers {
    metrics: SocketAddr,
    probes: SocketAddr,
    worker_api: SocketAddr,
}

/// The limits each server runs with here: the operator's own, except the
/// worker API's pool (1,024 would take a few thousand descriptors) and the
/// probes' header timer (long enough that the flood's connections stay for
/// the whole test on a busy machine).
fn limits() -> [Limits; 3] {
    let worker_api = Limits {
        max_connections: 64,
        ..Limits::WORKER_API
    };
    let probes = Limits {
        header_read_timeout: Duration::from_secs(10),
        ..Limits::PROBES
    };
    [Limits::METRICS, probes, worker_api].map(|l| l.with_source_share(DEFAULT_SOURCE_SHARE))
}

async fn spawn(app: axum::Router, limits: Limits) -> SocketAddr {
    let bound = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = bound.local_addr().expect("addr");
    tokio::spawn(serve(bound, app, limits, None));
    addr
}

async fn start(limits: [Limits; 3]) -> Servers {
    let state = Arc::new(Metrics::default());
    state.set_ready(true);
    // The worker API's Kubernetes client points at a port nobody listens
    // on: an unauthenticated call is refused before it is needed.
    let config = kube::Config::new("http://127.0.0.1:9".parse().expect("url"));
    let client = kube::Client::try_from(config).expect("client");
    let worker_api = worker_api::router(
        client.clone(),
        OperatorKey::random().expect("key"),
        worker_api::WorkerReports::start(client, Duration::from_secs(10)),
        Default::default(),
    );
    let [metrics_limits, probe_limits, worker_api_limits] = limits;
    Servers {
        metrics: spawn(metrics::router(state.clone(), None), metrics_limits).await,
        probes: spawn(metrics::probes_router(state), probe_limits).await,
        worker_api: spawn(worker_api, worker_api_limits).await,
    }
}

/// A TCP connection from `source` to `to`.
async fn connect_from(source: Ipv4Addr, to: SocketAddr) -> std::io::Result<TcpStream> {
    let socket = TcpSocket::new_v4()?;
    socket.bind(SocketAddr::from((source, 0)))?;
    tokio::time::timeout(Duration::from_secs(5), socket.connect(to))
        .await
        .map_err(|_| std::io::ErrorKind::TimedOut)?
}

/// Opens `n` idle connections from `source` to `to` and returns those the
/// server still holds once it has closed the ones it refused (or after 5 s).
async fn hold(source: Ipv4Addr, to: SocketAddr, n: usize, kept: usize) -> Vec<TcpStream> {
    let mut open = Vec::new();
    for _ in 0..n {
        open.push(connect_from(source, to).await.expect("connect"));
    }
    let started = Instant::now();
    loop {
        open.retain(|s| {
            let mut byte = [0u8; 1];
            // Closed by the server: end of stream or a reset.
            matches!(s.try_read(&mut byte), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
        });
        if open.len() <= kept || started.elapsed() > Duration::from_secs(5) {
            return open;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The status line `GET path` from `source` is answered with, if any.
async fn get(source: Ipv4Addr, to: SocketAddr, path: &str) -> Option<String> {
    let mut stream = connect_from(source, to).await.ok()?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: operator\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut answer))
        .await
        .ok()?
        .ok()?;
    let text = String::from_utf8_lossy(&answer).into_owned();
    text.lines().next().map(str::to_string)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_source_holding_every_port_leaves_the_probes_and_other_sources_answered() {
    let limits = limits();
    let servers = start(limits).await;
    let ports = [
        ("metrics", servers.metrics),
        ("probes", servers.probes),
        ("worker API", servers.worker_api),
    ];
    // The flooder keeps its share of each port and no more.
    let mut held = Vec::new();
    for ((name, port), limits) in ports.into_iter().zip(limits) {
        let share = limits.max_connections_per_source;
        let kept = hold(FLOODER, port, FLOOD, share).await;
        eprintln!(
            "{name}: {FLOOD} idle connections from {FLOODER}, {} held, {} closed at once (pool {}, share {share})",
            kept.len(),
            FLOOD - kept.len(),
            limits.max_connections
        );
        assert_eq!(kept.len(), share, "{name}: the flooder holds its share");
        held.push(kept);
    }

    // The kubelet's probes are answered on their own port.
    let started = Instant::now();
    for path in ["/healthz", "/readyz"] {
        let answer = get(KUBELET, servers.probes, path).await;
        assert!(
            answer.as_deref().is_some_and(|l| l.contains(" 200 ")),
            "{path}: {answer:?}"
        );
    }
    // Another source is answered on the metrics port and the worker API
    // (401: it has no token; the point is that it gets a connection).
    let scrape = get(OTHER, servers.metrics, "/metrics").await;
    assert!(
        scrape.as_deref().is_some_and(|l| l.contains(" 200 ")),
        "{scrape:?}"
    );
    let call = get(OTHER, servers.worker_api, "/v1/peer-key").await;
    assert!(
        call.as_deref().is_some_and(|l| l.contains(" 401 ")),
        "{call:?}"
    );
    eprintln!(
        "probes, a scrape and a worker API call answered in {:?}",
        started.elapsed()
    );
    // The probes are no longer on the metrics port.
    let moved = get(OTHER, servers.metrics, "/healthz").await;
    assert!(
        moved.as_deref().is_some_and(|l| l.contains(" 404 ")),
        "{moved:?}"
    );

    // The flood's connections are still open: the others were answered
    // beside it, not after it.
    for kept in &mut held {
        kept.retain(|s| {
            let mut byte = [0u8; 1];
            matches!(s.try_read(&mut byte), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
        });
    }
    assert_eq!(
        held.iter().map(Vec::len).collect::<Vec<_>>(),
        limits.map(|l| l.max_connections_per_source).to_vec(),
        "the flooder's share stayed open throughout"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_share_one_source_takes_every_slot() {
    // The pools as they were: one source may hold all of each.
    let whole = limits().map(|l| Limits {
        max_connections_per_source: l.max_connections,
        ..l
    });
    let servers = start(whole).await;
    let _held = hold(FLOODER, servers.metrics, FLOOD, whole[0].max_connections).await;
    assert_eq!(
        get(OTHER, servers.metrics, "/metrics").await,
        None,
        "a full pool without shares refuses every other source"
    );
}
