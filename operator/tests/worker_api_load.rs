//! The worker API under abuse, on loopback, without a Kubernetes API: every
//! pod of a cluster can reach it, so a flood of unauthenticated large
//! uploads and a slow-loris must leave the operator's memory bounded and
//! its runtime responsive, and an honest caller answered afterwards.
//!
//! Before the API authenticated first and served under limits, the flood
//! below made the server buffer every upload (axum reads the body, up to
//! 2 MiB, before the handler runs) and the slow-loris held connections open
//! for ever (`axum::serve` sets no header-read timer).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use headroom_operator::listener::{Limits, serve};
use headroom_operator::worker_api::{self, OperatorKey};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Resident set of this process, bytes (Linux).
fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("/proc/self/statm");
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .expect("resident pages");
    pages * 4096
}

/// One loopback client fills the whole pool here: these tests are about the
/// pool's cap and timers (a source's share of the pool has its own test,
/// `listener_shares.rs`).
const LIMITS: Limits = Limits {
    max_connections: 64,
    max_connections_per_source: 64,
    header_read_timeout: Duration::from_millis(1500),
    request_timeout: Duration::from_secs(3),
    max_read_buffer_bytes: 16 * 1024,
};

/// The worker API on a loopback port, its Kubernetes client pointed at a
/// port nobody listens on (no call here may need it).
async fn start() -> std::net::SocketAddr {
    let config = kube::Config::new("http://127.0.0.1:9".parse().expect("url"));
    let client = kube::Client::try_from(config).expect("client");
    let app = worker_api::router(
        client.clone(),
        OperatorKey::random().expect("key"),
        worker_api::WorkerReports::start(client, Duration::from_secs(10)),
        Default::default(),
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(serve(listener, app, LIMITS, None));
    addr
}

/// Sends `head` and then up to `body` bytes (stopping when the server stops
/// reading), and returns the status line the server answered, if any.
async fn upload(addr: std::net::SocketAddr, head: String, body: &'static [u8]) -> Option<String> {
    let mut stream = TcpStream::connect(addr).await.ok()?;
    stream.write_all(head.as_bytes()).await.ok()?;
    let _ = tokio::time::timeout(Duration::from_secs(2), stream.write_all(body)).await;
    let mut answer = vec![0u8; 512];
    let n = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut answer))
        .await
        .ok()?
        .ok()?;
    let text = String::from_utf8_lossy(&answer[..n]).into_owned();
    text.lines().next().map(str::to_string)
}

/// The runtime's worst scheduling delay while `during` runs: a ticker that
/// should wake every 10 ms records how late it woke.
async fn worst_lag<F: std::future::Future>(during: F) -> (F::Output, Duration) {
    let worst = Arc::new(AtomicU64::new(0));
    let ticker = tokio::spawn({
        let worst = worst.clone();
        async move {
            loop {
                let before = Instant::now();
                tokio::time::sleep(Duration::from_millis(10)).await;
                let late = before.elapsed().saturating_sub(Duration::from_millis(10));
                worst.fetch_max(late.as_micros() as u64, Ordering::Relaxed);
            }
        }
    });
    let out = during.await;
    ticker.abort();
    (out, Duration::from_micros(worst.load(Ordering::Relaxed)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_unauthenticated_uploads_is_answered_without_reading_them() {
    let addr = start().await;
    static BODY: [u8; 1 << 20] = [b'x'; 1 << 20];
    let uploads = 200;
    let rss_before = rss_bytes();
    let peak = Arc::new(AtomicU64::new(rss_before));
    let sampler = tokio::spawn({
        let peak = peak.clone();
        async move {
            loop {
                peak.fetch_max(rss_bytes(), Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    });
    let (answers, lag) = worst_lag(async {
        let flood: Vec<_> = (0..uploads)
            .map(|i| {
                // Half without a token, half with one that is not a JWT.
                let auth = if i % 2 == 0 {
                    String::new()
                } else {
                    format!("Authorization: Bearer {}\r\n", "A".repeat(4_000))
                };
                let head = format!(
                    "POST /v1/telemetry HTTP/1.1\r\nHost: operator\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
                    2 << 20
                );
                tokio::spawn(upload(addr, head, &BODY))
            })
            .collect();
        let mut answers = Vec::new();
        for upload in flood {
            answers.push(upload.await.expect("task"));
        }
        answers
    })
    .await;
    sampler.abort();
    let grown = peak.load(Ordering::Relaxed).saturating_sub(rss_before);
    let refused = answers
        .iter()
        .filter(|a| a.as_deref().is_some_and(|l| l.contains(" 401 ")))
        .count();
    eprintln!(
        "{uploads} uploads of 1 MiB (declaring 2 MiB): {refused} answered 401, the rest shed or closed; RSS grew {:.1} MiB; worst runtime lag {lag:?}",
        grown as f64 / (1 << 20) as f64
    );
    assert!(
        answers.iter().flatten().all(|l| l.contains(" 401 ")),
        "only refusals: {answers:?}"
    );
    // A refused upload's connection is closed with its body unread, so a
    // client may see the reset before the 401: require only that some did.
    assert!(refused > 0, "no upload was answered at all");
    // Buffering the uploads would be 200 MiB; the server's own share is
    // bounded by its 64 connections' read buffers.
    assert!(grown < 48 << 20, "RSS grew {grown} bytes under the flood");
    assert!(lag < Duration::from_millis(500), "runtime stalled {lag:?}");

    // Afterwards an honest caller is answered at once.
    let answer = upload(
        addr,
        "GET /v1/peer-key HTTP/1.1\r\nHost: operator\r\n\r\n".into(),
        b"",
    )
    .await;
    assert!(
        answer.as_deref().is_some_and(|l| l.contains(" 401 ")),
        "{answer:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_loris_is_cut_off_and_connections_beyond_the_cap_are_shed() {
    let addr = start().await;
    // Every permit taken by a connection that never finishes its head.
    let mut loris = Vec::new();
    for _ in 0..LIMITS.max_connections {
        let mut s = TcpStream::connect(addr).await.expect("connect");
        s.write_all(b"GET /v1/peer-key HTTP/1.1\r\nHost: operator\r\n")
            .await
            .expect("write");
        loris.push(s);
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    // One more is closed at once, unanswered.
    let shed = upload(
        addr,
        "GET /v1/peer-key HTTP/1.1\r\nHost: operator\r\n\r\n".into(),
        b"",
    )
    .await;
    assert_eq!(shed, None, "a connection beyond the cap is closed");

    // The slow ones are closed by the server once the header timer runs out.
    let started = Instant::now();
    for s in &mut loris {
        let mut buf = [0u8; 256];
        let read = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
            .await
            .expect("the server closes a slow-loris within its header timeout");
        assert!(
            matches!(read, Ok(0) | Err(_)) || String::from_utf8_lossy(&buf).contains(" 408 "),
            "{read:?}"
        );
    }
    let cut = started.elapsed();
    eprintln!(
        "{} slow-loris connections closed {cut:?} after the cap was reached",
        loris.len()
    );
    assert!(
        cut < LIMITS.header_read_timeout + Duration::from_secs(2),
        "{cut:?}"
    );

    // And their permits are back.
    let answer = upload(
        addr,
        "GET /v1/peer-key HTTP/1.1\r\nHost: operator\r\n\r\n".into(),
        b"",
    )
    .await;
    assert!(
        answer.as_deref().is_some_and(|l| l.contains(" 401 ")),
        "{answer:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_token_is_checked_before_the_body_is_awaited() {
    let addr = start().await;
    // A token whose claims pass the pre-filter is reviewed first (here the
    // API is unreachable: 502) while the body never comes; a server that
    // read the body first would wait for it.
    let token = projected_token_shape();
    let started = Instant::now();
    let answer = upload(
        addr,
        format!("POST /v1/telemetry HTTP/1.1\r\nHost: operator\r\nAuthorization: Bearer {token}\r\nContent-Length: 100\r\n\r\n{{"),
        b"",
    )
    .await;
    let took = started.elapsed();
    assert!(
        answer
            .as_deref()
            .is_some_and(|l| l.contains(" 502 ") || l.contains(" 408 ")),
        "{answer:?}"
    );
    assert!(
        took < LIMITS.request_timeout + Duration::from_secs(2),
        "{took:?}"
    );
}

/// A JWT with a projected token's claims (the worker API's audience, an
/// expiry ahead, a pod) and no valid signature: it passes the worker API's
/// pre-filter, so only the review can refuse it.
fn projected_token_shape() -> String {
    use base64::Engine;
    let exp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs()
        + 600;
    let claims = serde_json::json!({
        "aud": [headroom_api::WORKER_API_AUDIENCE],
        "exp": exp,
        "kubernetes.io": {"namespace": "team-a", "pod": {"name": "p", "uid": "u"}}
    });
    let part = |v: serde_json::Value| {
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v.to_string())
    };
    format!(
        "{}.{}.c2ln",
        part(serde_json::json!({"alg": "RS256"})),
        part(claims)
    )
}
