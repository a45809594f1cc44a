//! Serving an HTTP router so that no caller can exhaust the operator.
//!
//! `axum::serve` sets no timer (hyper's header-read timeout never fires), no
//! connection cap and no request deadline: a few hundred slow uploads hold
//! a few hundred buffers, and the operator (256 Mi limit) is OOM-killed
//! with the controller in it. Here every connection holds a permit of a
//! fixed pool (a connection beyond it is closed at once), must send its
//! request head within [`Limits::header_read_timeout`] (also while idle
//! between keep-alive requests, so idle connections do not keep permits),
//! and every request is answered within [`Limits::request_timeout`]. What a
//! connection can make the server hold is then bounded by hyper's read
//! buffer and the handlers' body limit, so the worst case is about
//! `max_connections × (read buffer + body limit)`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use std::convert::Infallible;

use axum::Router;
use axum::body::Body;
use axum::http::Request;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::ServerConfig;
use tower::ServiceExt;

/// What one server lets its callers hold.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Connections open at once.
    pub max_connections: usize,
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
        header_read_timeout: Duration::from_secs(10),
        request_timeout: Duration::from_secs(20),
        max_read_buffer_bytes: 16 * 1024,
    };
    /// The metrics and health server's: scraped by a few callers.
    pub const METRICS: Limits = Limits {
        max_connections: 64,
        header_read_timeout: Duration::from_secs(10),
        request_timeout: Duration::from_secs(20),
        max_read_buffer_bytes: 16 * 1024,
    };
}

/// Serves `app` on `listener` under `limits` until the listener fails; over
/// TLS with `tls` (the handshake, too, must end within the header timeout).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: Limits,
    tls: Option<Arc<ServerConfig>>,
) -> std::io::Result<()> {
    let permits = Arc::new(Semaphore::new(limits.max_connections));
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
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            shed(from);
            continue; // dropping the stream closes it
        };
        let (app, tls) = (app.clone(), tls.clone());
        tokio::spawn(async move {
            match tls {
                None => serve_connection(stream, from, app, limits).await,
                Some(tls) => {
                    match tokio::time::timeout(limits.header_read_timeout, tls.accept(stream)).await
                    {
                        Ok(Ok(stream)) => serve_connection(stream, from, app, limits).await,
                        Ok(Err(e)) => tracing::debug!(%from, %e, "TLS handshake failed"),
                        Err(_) => tracing::debug!(%from, "TLS handshake timed out"),
                    }
                }
            }
            drop(permit);
        });
    }
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

/// Logs a refused connection: the 1st, 2nd, 4th, 8th... of this process,
/// so a flood is visible without flooding the log.
fn shed(from: SocketAddr) {
    static SHED: AtomicU64 = AtomicU64::new(0);
    let n = SHED.fetch_add(1, Ordering::Relaxed) + 1;
    if n.is_power_of_two() {
        tracing::warn!(%from, refused = n, "connection refused: the server is at its connection limit");
    }
}

fn is_transient(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(
        e.kind(),
        ConnectionAborted | ConnectionReset | Interrupted | WouldBlock
    ) || e.raw_os_error().is_some_and(|c| c == 24 || c == 23) // EMFILE, ENFILE
}
