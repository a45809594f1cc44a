//! The operator's worker API, the worker's only way to the cluster: it posts
//! its telemetry there (the operator writes it into `status.workers[<pod>]`
//! under the worker's field manager) and asks there for its peers' pod IPs.
//! Workers hold no Kubernetes API rights: each call carries a projected
//! service-account token bound to the pod (audience
//! `headroom_api::WORKER_API_AUDIENCE`), which the operator checks.
//!
//! Blocking (ureq): the callers are the telemetry thread and the peer lookup,
//! both synchronous. Every call is bounded by [`CALL_TIMEOUT`].

use std::path::{Path, PathBuf};
use std::time::Duration;

use headroom_api::{
    PeerAddress, PeerKey, WORKER_API_CA_ENV, WORKER_API_ENV, WORKER_API_PEER_KEY_PATH,
    WORKER_API_PEERS_PATH, WORKER_API_TELEMETRY_PATH, WORKER_API_TOKEN_ENV, WORKER_API_TOKEN_PATH,
    WorkerTelemetry,
};

/// The longest one call may take, connecting and reading the answer included.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// Bytes of an error answer's text kept for the error message.
const REASON_LIMIT: u64 = 4096;

/// A failed call to the worker API.
#[derive(Debug, thiserror::Error)]
pub enum WorkerApiError {
    #[error("cannot read the worker API token {} ({WORKER_API_TOKEN_ENV}): {source}", path.display())]
    Token {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the worker API token {} ({WORKER_API_TOKEN_ENV}) is empty", path.display())]
    EmptyToken { path: PathBuf },
    #[error("{WORKER_API_CA_ENV} is not a PEM certificate: {0}")]
    Ca(String),
    #[error("telemetry is not JSON: {0}")]
    Encode(#[source] serde_json::Error),
    #[error("cannot reach the worker API at {url}: {source}")]
    Transport {
        url: String,
        #[source]
        source: Box<ureq::Error>,
    },
    /// A non-2xx answer; `reason` is the operator's text (or the status's name).
    #[error("{url} answered {status}: {reason}")]
    Status {
        url: String,
        status: u16,
        reason: String,
    },
    #[error("{url} answered 200 with no peer address: {source}")]
    Malformed {
        url: String,
        #[source]
        source: serde_json::Error,
    },
    /// The answer to a peer-key request is not a key; `reason` never
    /// quotes the answer (it may be most of a secret).
    #[error("{url} answered 200 with no usable peer key: {reason}")]
    MalformedKey { url: String, reason: String },
}

/// A blocking client of the operator's worker API.
#[derive(Clone)]
pub struct WorkerApi {
    /// `http://host:port`, no trailing slash.
    base: String,
    /// The pod-bound token, read again for every call (the kubelet rotates it).
    token_path: PathBuf,
    agent: ureq::Agent,
}

impl std::fmt::Debug for WorkerApi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerApi")
            .field("base", &self.base)
            .field("token_path", &self.token_path)
            .finish_non_exhaustive()
    }
}

impl WorkerApi {
    /// A client of the worker API at `base` (`http://host:port`), presenting
    /// the token in the file `token_path`.
    pub fn new(base: &str, token_path: impl Into<PathBuf>) -> Self {
        Self::build(base, token_path, None)
    }

    /// A client of an `https` worker API whose certificate is issued from
    /// the CA `ca_pem` (PEM): that CA alone is trusted for it, not the
    /// system's store (`HEADROOM_WORKER_API_CA`).
    pub fn with_ca(
        base: &str,
        token_path: impl Into<PathBuf>,
        ca_pem: &str,
    ) -> Result<Self, WorkerApiError> {
        let ca = ureq::tls::Certificate::from_pem(ca_pem.as_bytes())
            .map_err(|e| WorkerApiError::Ca(e.to_string()))?;
        let tls = ureq::tls::TlsConfig::builder()
            .root_certs(ureq::tls::RootCerts::new_with_certs(&[ca]))
            .build();
        Ok(Self::build(base, token_path, Some(tls)))
    }

    fn build(
        base: &str,
        token_path: impl Into<PathBuf>,
        tls: Option<ureq::tls::TlsConfig>,
    ) -> Self {
        let mut agent = ureq::Agent::config_builder();
        if let Some(tls) = tls {
            agent = agent.tls_config(tls);
        }
        let agent = agent
            // Statuses carry the operator's reason: read it, don't drop it.
            .http_status_as_error(false)
            .timeout_global(Some(CALL_TIMEOUT))
            // The API is in the cluster: a proxy from the environment would
            // not reach it, and the token must not follow a redirect.
            .proxy(None)
            .max_redirects(0)
            .user_agent(concat!("headroom-worker/", env!("CARGO_PKG_VERSION")))
            .build()
            .into();
        WorkerApi {
            base: base.trim_end_matches('/').to_string(),
            token_path: token_path.into(),
            agent,
        }
    }

    /// From `HEADROOM_WORKER_API`, `HEADROOM_WORKER_API_TOKEN` (default
    /// the contract's token path) and `HEADROOM_WORKER_API_CA`; `Ok(None)`
    /// when there is no worker API (the base URL unset or blank: local runs
    /// and tests).
    pub fn from_env() -> Result<Option<Self>, WorkerApiError> {
        Self::from_lookup(|key| std::env::var(key).ok())
    }

    /// [`WorkerApi::from_env`] through `env` (tests pass a map).
    pub fn from_lookup(
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<Self>, WorkerApiError> {
        let Some(base) = env(WORKER_API_ENV).filter(|b| !b.trim().is_empty()) else {
            return Ok(None);
        };
        let token_path = env(WORKER_API_TOKEN_ENV)
            .filter(|p| !p.trim().is_empty())
            .unwrap_or_else(|| WORKER_API_TOKEN_PATH.to_string());
        match env(WORKER_API_CA_ENV).filter(|c| !c.trim().is_empty()) {
            Some(ca) => WorkerApi::with_ca(base.trim(), token_path, &ca).map(Some),
            None => Ok(Some(WorkerApi::new(base.trim(), token_path))),
        }
    }

    /// The base URL, no trailing slash.
    pub fn base(&self) -> &str {
        &self.base
    }

    /// The file the token is read from.
    pub fn token_path(&self) -> &Path {
        &self.token_path
    }

    /// Posts this worker's telemetry; the operator makes it the caller's
    /// `status.workers` entry.
    pub fn post_telemetry(&self, telemetry: &WorkerTelemetry) -> Result<(), WorkerApiError> {
        let body = serde_json::to_vec(telemetry).map_err(WorkerApiError::Encode)?;
        let url = format!("{}{WORKER_API_TELEMETRY_PATH}", self.base);
        let response = self
            .agent
            .post(&url)
            .header("authorization", self.bearer()?)
            .header("content-type", "application/json")
            .send(body)
            .map_err(|e| transport(&url, e))?;
        check(&url, response).map(drop)
    }

    /// The IP of `pod`, a pod of the caller's own job; `None` while it has none.
    pub fn pod_ip(&self, pod: &str) -> Result<Option<String>, WorkerApiError> {
        let url = format!("{}{WORKER_API_PEERS_PATH}{pod}", self.base);
        let text = self.get(&url)?;
        let peer: PeerAddress = serde_json::from_str(&text)
            .map_err(|source| WorkerApiError::Malformed { url, source })?;
        Ok(peer.pod_ip.filter(|ip| !ip.is_empty()))
    }

    /// The caller's job's peer key as the API answers it (hex), which its
    /// workers prove to each other on the pipeline and replica links
    /// (`crate::link_auth::LinkKey::obtain` reads it).
    pub fn peer_key(&self) -> Result<PeerKey, WorkerApiError> {
        let url = format!("{}{WORKER_API_PEER_KEY_PATH}", self.base);
        let text = self.get(&url)?;
        // serde's error could quote the text: say only what was wrong.
        serde_json::from_str(&text).map_err(|_| WorkerApiError::MalformedKey {
            url,
            reason: "not a JSON object with a \"key\" string".into(),
        })
    }

    /// `GET url` with the token: a 2xx answer's text (at most
    /// [`REASON_LIMIT`] bytes), or why there is none.
    fn get(&self, url: &str) -> Result<String, WorkerApiError> {
        let response = self
            .agent
            .get(url)
            .header("authorization", self.bearer()?)
            .call()
            .map_err(|e| transport(url, e))?;
        check(url, response)?
            .into_body()
            .with_config()
            .limit(REASON_LIMIT)
            .read_to_string()
            .map_err(|e| transport(url, e))
    }

    /// `Bearer <token>`, the token read from its file now.
    fn bearer(&self) -> Result<String, WorkerApiError> {
        let token =
            std::fs::read_to_string(&self.token_path).map_err(|source| WorkerApiError::Token {
                path: self.token_path.clone(),
                source,
            })?;
        let token = token.trim();
        if token.is_empty() {
            return Err(WorkerApiError::EmptyToken {
                path: self.token_path.clone(),
            });
        }
        Ok(format!("Bearer {token}"))
    }
}

fn transport(url: &str, source: ureq::Error) -> WorkerApiError {
    WorkerApiError::Transport {
        url: url.to_string(),
        source: Box::new(source),
    }
}

/// The response when it is a 2xx; otherwise its status and text as an error.
fn check(
    url: &str,
    response: ureq::http::Response<ureq::Body>,
) -> Result<ureq::http::Response<ureq::Body>, WorkerApiError> {
    let status = response.status();
    if status.is_success() {
        return Ok(response);
    }
    let text = response
        .into_body()
        .with_config()
        .limit(REASON_LIMIT)
        .read_to_string()
        .unwrap_or_default();
    let text = text.trim();
    let reason = if text.is_empty() {
        status.canonical_reason().unwrap_or("no reason given")
    } else {
        text
    };
    Err(WorkerApiError::Status {
        url: url.to_string(),
        status: status.as_u16(),
        reason: reason.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufRead, BufReader, Read, Write};
    use std::net::TcpListener;
    use std::sync::mpsc;

    use headroom_api::MemorySample;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    /// One request as the server saw it.
    #[derive(Debug)]
    struct Seen {
        /// `METHOD /path`.
        line: String,
        authorization: Option<String>,
        content_type: Option<String>,
        body: Vec<u8>,
    }

    /// A server on a loopback port that answers each connection with the
    /// next of `answers` (status line, body) and reports what it was sent.
    fn serve(answers: Vec<(&'static str, &'static str)>) -> (String, mpsc::Receiver<Seen>) {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let base = format!("http://{}", listener.local_addr().expect("addr"));
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for (status, body) in answers {
                let Ok((stream, _)) = listener.accept() else {
                    return;
                };
                let mut reader = BufReader::new(stream.try_clone().expect("clone"));
                let mut line = String::new();
                reader.read_line(&mut line).expect("request line");
                let mut seen = Seen {
                    line: line.rsplit_once(' ').map_or("", |(l, _)| l).to_string(),
                    authorization: None,
                    content_type: None,
                    body: Vec::new(),
                };
                let mut length = 0usize;
                loop {
                    let mut header = String::new();
                    reader.read_line(&mut header).expect("header");
                    let header = header.trim_end();
                    if header.is_empty() {
                        break;
                    }
                    let (name, value) = header.split_once(':').expect("name: value");
                    let value = value.trim().to_string();
                    match name.to_ascii_lowercase().as_str() {
                        "authorization" => seen.authorization = Some(value),
                        "content-type" => seen.content_type = Some(value),
                        "content-length" => length = value.parse().expect("length"),
                        _ => {}
                    }
                }
                seen.body = vec![0; length];
                reader.read_exact(&mut seen.body).expect("body");
                let _ = tx.send(seen);
                let mut stream = stream;
                let _ = write!(
                    stream,
                    "HTTP/1.1 {status}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
            }
        });
        (base, rx)
    }

    fn token_file(name: &str, token: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("headroom-worker-api-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("tmp");
        let path = dir.join(name);
        std::fs::write(&path, token).expect("token");
        path
    }

    fn telemetry() -> WorkerTelemetry {
        WorkerTelemetry {
            name: "job-a1-s0".into(),
            attempt: 1,
            stage: 0,
            layer_start: 0,
            layer_end: 2,
            step: 7,
            loss: Some(1.5),
            eval_loss: None,
            tokens_per_second: None,
            memory: MemorySample {
                peak_bytes: 1 << 20,
                ..MemorySample::default()
            },
            download: None,
            stepped_down: None,
            updated_at: Time(k8s_openapi::jiff::Timestamp::now()),
        }
    }

    #[test]
    fn telemetry_is_posted_as_json_with_the_token_read_for_every_call() {
        let (base, seen) = serve(vec![("204 No Content", ""), ("204 No Content", "")]);
        let token = token_file("telemetry", "first\n");
        let api = WorkerApi::new(&format!("{base}/"), &token);
        api.post_telemetry(&telemetry()).expect("posted");
        let request = seen.recv().expect("request");
        assert_eq!(request.line, "POST /v1/telemetry");
        assert_eq!(request.authorization.as_deref(), Some("Bearer first"));
        assert_eq!(request.content_type.as_deref(), Some("application/json"));
        let sent: WorkerTelemetry = serde_json::from_slice(&request.body).expect("json");
        assert_eq!(sent, telemetry_with(&sent));

        // The kubelet rotated the token: the next call presents the new one.
        std::fs::write(&token, "second").expect("rotate");
        api.post_telemetry(&telemetry()).expect("posted");
        let request = seen.recv().expect("request");
        assert_eq!(request.authorization.as_deref(), Some("Bearer second"));
    }

    /// The fixture's telemetry with `sent`'s timestamp (made at another instant).
    fn telemetry_with(sent: &WorkerTelemetry) -> WorkerTelemetry {
        WorkerTelemetry {
            stepped_down: None,
            updated_at: sent.updated_at.clone(),
            ..telemetry()
        }
    }

    #[test]
    fn a_refusal_names_the_url_the_status_and_the_operators_reason() {
        let (base, _seen) = serve(vec![(
            "403 Forbidden",
            "pod job-a1-s0 is not a worker of job other\n",
        )]);
        let api = WorkerApi::new(&base, token_file("refused", "t"));
        let e = api.post_telemetry(&telemetry()).expect_err("refused");
        assert!(
            matches!(e, WorkerApiError::Status { status: 403, .. }),
            "{e:?}"
        );
        assert_eq!(
            e.to_string(),
            format!("{base}/v1/telemetry answered 403: pod job-a1-s0 is not a worker of job other")
        );
    }

    #[test]
    fn a_peer_lookup_gets_the_pods_ip_or_none() {
        let (base, seen) = serve(vec![
            ("200 OK", r#"{"podIp":"10.244.1.7"}"#),
            ("200 OK", r#"{"podIp":null}"#),
            ("200 OK", "{}"),
            ("500 Internal Server Error", ""),
            ("200 OK", "not json"),
        ]);
        let api = WorkerApi::new(&base, token_file("peers", "t"));
        assert_eq!(
            api.pod_ip("job-a1-s1").expect("ip").as_deref(),
            Some("10.244.1.7")
        );
        let request = seen.recv().expect("request");
        assert_eq!(request.line, "GET /v1/peers/job-a1-s1");
        assert_eq!(request.authorization.as_deref(), Some("Bearer t"));
        assert_eq!(api.pod_ip("job-a1-s1").expect("no IP yet"), None);
        assert_eq!(api.pod_ip("job-a1-s1").expect("no IP yet"), None);
        let e = api.pod_ip("job-a1-s1").expect_err("500");
        assert_eq!(
            e.to_string(),
            format!("{base}/v1/peers/job-a1-s1 answered 500: Internal Server Error")
        );
        let e = api.pod_ip("job-a1-s1").expect_err("not json");
        assert!(matches!(e, WorkerApiError::Malformed { .. }), "{e:?}");
    }

    #[test]
    fn link_auth_the_peer_key_comes_from_the_worker_api_and_is_never_quoted() {
        let key = "0123456789abcdef".repeat(4);
        let good: &'static str = Box::leak(format!(r#"{{"key":"{key}"}}"#).into_boxed_str());
        let short: &'static str =
            Box::leak(format!(r#"{{"key":"{}"}}"#, &key[..40]).into_boxed_str());
        let (base, seen) = serve(vec![
            ("200 OK", good),
            ("200 OK", short),
            ("200 OK", "secretsecret"),
            ("503 Service Unavailable", ""),
            ("200 OK", good),
        ]);
        let api = WorkerApi::new(&base, token_file("peer-key", "t"));
        let obtain =
            || crate::link_auth::LinkKey::obtain(None, Some(&api), Duration::from_secs(10));
        let got = obtain().expect("key");
        assert_eq!(got.to_hex(), key);
        let request = seen.recv().expect("request");
        assert_eq!(request.line, "GET /v1/peer-key");
        assert_eq!(request.authorization.as_deref(), Some("Bearer t"));
        // Too short a key, then not JSON: refused at once, neither quoted.
        for _ in 0..2 {
            let e = obtain().expect_err("not a key");
            let text = e.to_string();
            assert!(text.contains("peer key"), "{text}");
            assert!(
                !text.contains(&key[..40]) && !text.contains("secret"),
                "{text}"
            );
        }
        // A 5xx (the operator restarting) is asked again.
        let again = obtain().expect("the second answer");
        assert_eq!(again, got);
    }

    #[test]
    fn no_token_no_call_and_an_unreachable_api_names_its_url() {
        let missing = std::env::temp_dir().join("headroom-worker-api-no-such-token");
        let api = WorkerApi::new("http://127.0.0.1:9", &missing);
        let e = api.pod_ip("p").expect_err("no token");
        assert!(matches!(e, WorkerApiError::Token { .. }), "{e:?}");
        assert!(
            e.to_string().contains(&missing.display().to_string()),
            "{e}"
        );

        let api = WorkerApi::new("http://127.0.0.1:9", token_file("empty", " \n"));
        let e = api.pod_ip("p").expect_err("empty token");
        assert!(matches!(e, WorkerApiError::EmptyToken { .. }), "{e:?}");

        // A port nobody listens on.
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("port")
            .port();
        let api = WorkerApi::new(&format!("http://127.0.0.1:{port}"), token_file("ok", "t"));
        let e = api.pod_ip("p").expect_err("unreachable");
        assert!(matches!(e, WorkerApiError::Transport { .. }), "{e:?}");
        assert!(
            e.to_string().starts_with(&format!(
                "cannot reach the worker API at http://127.0.0.1:{port}/v1/peers/p"
            )),
            "{e}"
        );
    }

    #[test]
    fn from_the_environment_only_when_the_base_is_set() {
        let lookup = |base: Option<&'static str>, token: Option<&'static str>| {
            move |key: &str| match key {
                WORKER_API_ENV => base.map(String::from),
                WORKER_API_TOKEN_ENV => token.map(String::from),
                _ => None,
            }
        };
        let configured = |env| WorkerApi::from_lookup(env).expect("no CA, no error");
        assert!(configured(lookup(None, Some("/t"))).is_none());
        assert!(configured(lookup(Some(" "), None)).is_none());
        let api = configured(lookup(Some("http://10.96.0.12:8081/"), None)).expect("configured");
        assert_eq!(api.base(), "http://10.96.0.12:8081");
        assert_eq!(api.token_path(), Path::new(WORKER_API_TOKEN_PATH));
        let api = configured(lookup(Some("http://op:8081"), Some("/tmp/t"))).expect("set");
        assert_eq!(api.token_path(), Path::new("/tmp/t"));
    }

    #[test]
    fn a_ca_that_is_not_a_certificate_is_named_not_ignored() {
        let env = |key: &str| match key {
            WORKER_API_ENV => Some("https://10.96.0.12:8081".to_string()),
            WORKER_API_CA_ENV => Some("not a certificate".to_string()),
            _ => None,
        };
        let err = WorkerApi::from_lookup(env).expect_err("a bad CA");
        assert!(err.to_string().contains(WORKER_API_CA_ENV), "{err}");
    }
}
