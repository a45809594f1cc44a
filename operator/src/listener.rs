//! Serving an HTTP router so that no caller can exhaust the operator: the
//! one accept loop of all its servers (metrics, health probes, worker API).
//!
//! `axum::serve` sets no timer (hyper's header-read timeout never fires), no
//! connection cap and no request deadline: a few hundred slow uploads hold
//! a few hundred buffers, and the operator (256 Mi limit) is OOM-killed
//! with the controller in it. Here every connection holds a slot of a
//! fixed pool (a connection beyond it is closed at once), must send its
//! request head within [`Limits::header_read_timeout`] (also while idle
//! between keep-alive requests, so idle connections do not keep slots),
//! and every request is answered within [`Limits::request_timeout`]. What a
//! connection can make the server hold is then bounded by hyper's read
//! buffer and the handlers' body limit, so the worst case is about
//! `max_connections × (read buffer + body limit)`.
//!
//! A pool alone can be held by one caller: a client that keeps reopening
//! idle connections keeps every slot taken, and everyone else is shed. So
//! one source address may hold at most [`Limits::max_connections_per_source`]
//! of the slots (a share of the pool, [`DEFAULT_SOURCE_SHARE`] unless the
//! operator's flag says otherwise); the rest stays for other sources. A
//! source is an IP address (an IPv4-mapped IPv6 one counts as its IPv4
//! address): in a cluster, a pod.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::Request;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::ServerConfig;
use tower::ServiceExt;

/// The share of a server's connections one source may hold unless the
/// operator is told otherwise: a quarter, so it takes at least four
/// sources to fill a server.
pub const DEFAULT_SOURCE_SHARE: f64 = 0.25;

/// What one server lets its callers hold.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Connections open at once.
    pub max_connections: usize,
    /// Connections one source address may hold at once (at least 1, at
    /// most `max_connections`).
    pub max_connections_per_source: usize,
    /// From the connection's start (or the end of the last response) to
    /// the end of the next request head.
    pub header_read_timeout: Duration,
    /// From a request head to its response (body read and handling).
    pub request_timeout: Duration,
    /// hyper's read buffer per connection, bytes (the longest request head).
    pub max_read_buffer_bytes: usize,
}

impl Limits {
    /// The worker API's: 1,024 connections × (16 KiB + the 64 KiB body
    /// limit) is at most 80 MiB, inside the operator's 256 Mi with the
    /// controller's own memory; a worker's report takes milliseconds.
    pub const WORKER_API: Limits = Limits {
        max_connections: 1024,
        max_connections_per_source: 1024 / 4,
        header_read_timeout: Duration::from_secs(10),
        request_timeout: Duration::from_secs(20),
        max_read_buffer_bytes: 16 * 1024,
    };
    /// The metrics server's: scraped by a few callers.
    pub const METRICS: Limits = Limits {
        max_connections: 64,
        max_connections_per_source: 64 / 4,
        header_read_timeout: Duration::from_secs(10),
        request_timeout: Duration::from_secs(20),
        max_read_buffer_bytes: 16 * 1024,
    };
    /// The health probes' (`/healthz`, `/readyz`): only the kubelet calls,
    /// a connection per probe (it keeps none alive) that sends its request
    /// at once, so a handful of slots and a short header timer are plenty,
    /// and a caller that connects and waits is soon cut off.
    pub const PROBES: Limits = Limits {
        max_connections: 16,
        max_connections_per_source: 16 / 4,
        header_read_timeout: Duration::from_secs(2),
        request_timeout: Duration::from_secs(5),
        max_read_buffer_bytes: 8 * 1024,
    };

    /// These limits with one source allowed `share` (0 < share ≤ 1) of the
    /// connections, rounded down, and at least one.
    pub fn with_source_share(self, share: f64) -> Limits {
        let share = if share.is_finite() { share } else { 1.0 };
        let per_source = (self.max_connections as f64 * share.clamp(0.0, 1.0)) as usize;
        Limits {
            max_connections_per_source: per_source.clamp(1, self.max_connections.max(1)),
            ..self
        }
    }
}

/// Serves `app` on `listener` under `limits` until the listener fails; over
/// TLS with `tls` (the handshake, too, must end within the header timeout).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: Limits,
    tls: Option<Arc<ServerConfig>>,
) -> std::io::Result<()> {
    let slots = Arc::new(Slots::new(&limits));
    let tls = tls.map(TlsAcceptor::from);
    loop {
        let (stream, from) = match listener.accept().await {
            Ok(accepted) => accepted,
            // Out of descriptors or a connection reset before accept: wait a
            // little rather than spin, and go on.
            Err(e) if is_transient(&e) => {
                tracing::warn!(%e, "accept failed; retrying");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            Err(e) => return Err(e),
        };
        let slot = match slots.take(from.ip()) {
            Ok(slot) => slot,
            Err(refused) => {
                shed(from, refused);
                continue; // dropping the stream closes it
            }
        };
        tokio::spawn(serve_accepted(
            stream,
            from,
            app.clone(),
            limits,
            tls.clone(),
            slot,
        ));
    }
}

/// One accepted connection, its TLS handshake first if any, holding `slot`
/// until it ends.
async fn serve_accepted(
    stream: TcpStream,
    from: SocketAddr,
    app: Router,
    limits: Limits,
    tls: Option<TlsAcceptor>,
    slot: Slot,
) {
    match tls {
        None => serve_connection(stream, from, app, limits).await,
        Some(tls) => {
            match tokio::time::timeout(limits.header_read_timeout, tls.accept(stream)).await {
                Ok(Ok(stream)) => serve_connection(stream, from, app, limits).await,
                Ok(Err(e)) => tracing::debug!(%from, %e, "TLS handshake failed"),
                Err(_) => tracing::debug!(%from, "TLS handshake timed out"),
            }
        }
    }
    drop(slot);
}

/// HTTP/1.1 on one accepted connection, plain or TLS.
async fn serve_connection<S>(stream: S, from: SocketAddr, app: Router, limits: Limits)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let deadline = limits.request_timeout;
    let service = hyper::service::service_fn(move |request: Request<Incoming>| {
        let app = app.clone();
        async move {
            let answer = tokio::time::timeout(deadline, app.oneshot(request.map(Body::new)));
            Ok::<_, Infallible>(match answer.await {
                Ok(Ok(response)) => response,
                Ok(Err(never)) => match never {},
                Err(_) => (
                    StatusCode::REQUEST_TIMEOUT,
                    format!("no complete request within {deadline:?}"),
                )
                    .into_response(),
            })
        }
    });
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .max_buf_size(limits.max_read_buffer_bytes.max(8192));
    if let Err(e) = http.serve_connection(TokioIo::new(stream), service).await {
        tracing::debug!(%from, %e, "connection ended");
    }
}

/// A server's connection slots, counted in all and per source address.
struct Slots {
    max: usize,
    max_per_source: usize,
    held: Mutex<Held>,
}

#[derive(Default)]
struct Held {
    all: usize,
    /// Only sources that hold a slot: the map is as large as the
    /// connections open, never larger.
    by_source: HashMap<IpAddr, usize>,
}

/// Why a connection was not given a slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Refused {
    /// Every slot is held.
    Full,
    /// Its source holds its share already.
    SourceShare,
}

/// A slot held by one connection; given back when dropped.
struct Slot {
    slots: Arc<Slots>,
    source: IpAddr,
}

impl Slots {
    fn new(limits: &Limits) -> Slots {
        Slots {
            max: limits.max_connections,
            max_per_source: limits.max_connections_per_source.max(1),
            held: Mutex::default(),
        }
    }

    fn take(self: &Arc<Self>, source: IpAddr) -> Result<Slot, Refused> {
        let source = source.to_canonical();
        // The count stays right whatever panicked while holding the lock:
        // every change to it is a single step.
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        if held.all >= self.max {
            return Err(Refused::Full);
        }
        let mine = held.by_source.entry(source).or_default();
        if *mine >= self.max_per_source {
            return Err(Refused::SourceShare);
        }
        *mine += 1;
        held.all += 1;
        Ok(Slot {
            slots: self.clone(),
            source,
        })
    }

    #[cfg(test)]
    fn held_by(&self, source: IpAddr) -> usize {
        let held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        held.by_source.get(&source).copied().unwrap_or(0)
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut held = self
            .slots
            .held
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        held.all = held.all.saturating_sub(1);
        if let Some(mine) = held.by_source.get_mut(&self.source) {
            *mine -= 1;
            if *mine == 0 {
                held.by_source.remove(&self.source);
            }
        }
    }
}

/// Logs a refused connection: the 1st, 2nd, 4th, 8th... of this process,
/// so a flood is visible without flooding the log.
fn shed(from: SocketAddr, refused: Refused) {
    static SHED: AtomicU64 = AtomicU64::new(0);
    let n = SHED.fetch_add(1, Ordering::Relaxed) + 1;
    if !n.is_power_of_two() {
        return;
    }
    match refused {
        Refused::Full => tracing::warn!(
            %from, refused = n,
            "connection refused: the server is at its connection limit"
        ),
        Refused::SourceShare => tracing::warn!(
            %from, refused = n,
            "connection refused: its source holds its share of the server's connections"
        ),
    }
}

fn is_transient(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(
        e.kind(),
        ConnectionAborted | ConnectionReset | Interrupted | WouldBlock
    ) || e.raw_os_error().is_some_and(|c| c == 24 || c == 23) // EMFILE, ENFILE
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(text: &str) -> IpAddr {
        text.parse().expect("ip")
    }

    fn slots(max: usize, per_source: usize) -> Arc<Slots> {
        Arc::new(Slots::new(&Limits {
            max_connections: max,
            max_connections_per_source: per_source,
            ..Limits::METRICS
        }))
    }

    #[test]
    fn one_source_holds_at_most_its_share_and_others_get_the_rest() {
        let slots = slots(8, 2);
        let a = ip("10.0.0.1");
        let held_a: Vec<_> = (0..2).map(|_| slots.take(a).expect("a's share")).collect();
        assert_eq!(slots.take(a).err(), Some(Refused::SourceShare));
        let held_others: Vec<_> = (2..8)
            .map(|i| {
                slots
                    .take(ip(&format!("10.0.0.{i}")))
                    .expect("another source")
            })
            .collect();
        // The pool is full: a new source is refused too, for that reason.
        assert_eq!(slots.take(ip("10.0.0.99")).err(), Some(Refused::Full));
        drop(held_others);
        assert!(slots.take(ip("10.0.0.99")).is_ok());
        // A closed connection gives its slot back to its source.
        drop(held_a);
        assert_eq!(slots.held_by(a), 0);
        let _again: Vec<_> = (0..2).map(|_| slots.take(a).expect("a again")).collect();
    }

    #[test]
    fn an_ipv4_mapped_address_is_its_ipv4_source() {
        let slots = slots(8, 1);
        let _v4 = slots.take(ip("10.0.0.1")).expect("first");
        assert_eq!(
            slots.take(ip("::ffff:10.0.0.1")).err(),
            Some(Refused::SourceShare)
        );
        assert!(slots.take(ip("fd00::1")).is_ok());
    }

    #[test]
    fn a_share_is_rounded_down_and_never_below_one_connection() {
        let limits = |max, share| {
            Limits {
                max_connections: max,
                ..Limits::METRICS
            }
            .with_source_share(share)
            .max_connections_per_source
        };
        assert_eq!(limits(64, 0.25), 16);
        assert_eq!(limits(1024, 0.25), 256);
        assert_eq!(limits(10, 0.25), 2);
        assert_eq!(limits(16, 0.01), 1);
        assert_eq!(limits(16, 1.0), 16);
        for (name, l) in [
            ("worker API", Limits::WORKER_API),
            ("metrics", Limits::METRICS),
            ("probes", Limits::PROBES),
        ] {
            assert_eq!(
                l.with_source_share(DEFAULT_SOURCE_SHARE)
                    .max_connections_per_source,
                l.max_connections_per_source,
                "{name}: the constant is the default share"
            );
        }
    }
}
