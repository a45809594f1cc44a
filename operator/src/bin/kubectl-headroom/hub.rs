//! The `config.json` of a `model.pretrained.huggingFace` job, fetched from
//! the hub as the job's initializer fetches it (worker/src/initialize/hub.rs):
//! the revision's commit from `GET {endpoint}/api/models/{repo}/revision/{revision}`
//! (its `sha`), then `GET {endpoint}/{repo}/resolve/{commit}/config.json`, so
//! the plan is of the very commit the initializer will download while the
//! branch stays where it is.
//!
//! The token is the plugin user's own, found as `huggingface_hub` finds it
//! (`HF_TOKEN`, else the file `huggingface-cli login` wrote:
//! `HF_TOKEN_PATH`, else `$HF_HOME/token`, `HF_HOME` defaulting to
//! `$XDG_CACHE_HOME/huggingface` or `~/.cache/huggingface`), never a cluster
//! Secret (the job's `tokenSecret` is for its initializer pod alone). It is
//! sent only to the public hub or to the endpoint the user's `HF_ENDPOINT`
//! names: a manifest planned here may come from someone else, and its
//! `endpoint` must not collect the user's token.
//!
//! The initializer's client is not reused: it lives in the worker crate,
//! which links burn, and the operator crate's only HTTP client is kube's.
//! That one serves here (hyper over rustls, the platform's trust store, as
//! the initializer's ureq verifies); it reads no `HTTPS_PROXY`.

use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use headroom_api::DEFAULT_HF_ENDPOINT;
use headroom_api::HuggingFaceSource;
use headroom_api::hub::encode_path;
use hyper::{Request, StatusCode, Uri};
use kube::client::Body;

/// The largest config.json or listing read (a listing of many files is a few MiB).
const LIMIT: usize = 64 << 20;
/// Redirects followed per request.
const REDIRECTS: usize = 5;
const TIMEOUT: Duration = Duration::from_secs(30);

/// A checkpoint's config.json as the hub gave it.
#[derive(Debug)]
pub struct HubConfig {
    pub text: String,
    /// The commit the revision pointed at, when the listing gave one.
    pub commit: Option<String>,
    /// `repository R (revision V) at E`, for messages.
    pub describe: String,
}

/// What the user's environment says: their token and `HF_ENDPOINT`.
#[derive(Clone, Default)]
pub struct UserHubEnv {
    pub token: Option<String>,
    /// Where the token came from (`HF_TOKEN` or the token file's path), for messages.
    pub token_from: String,
    pub endpoint: Option<String>,
}

impl std::fmt::Debug for UserHubEnv {
    // Never the token.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UserHubEnv")
            .field("token", &self.token.as_ref().map(|_| "(set)"))
            .field("token_from", &self.token_from)
            .field("endpoint", &self.endpoint)
            .finish()
    }
}

impl UserHubEnv {
    pub fn from_env() -> Self {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Reads the variables through `env` (tests pass a map).
    fn from_lookup(env: impl Fn(&str) -> Option<String>) -> Self {
        let var = |k: &str| {
            env(k)
                .map(|v| v.trim().to_string())
                .filter(|v| !v.is_empty())
        };
        let endpoint = var("HF_ENDPOINT").map(|e| normalized(&e));
        if let Some(token) = var("HF_TOKEN") {
            return UserHubEnv {
                token: Some(token),
                token_from: "HF_TOKEN".into(),
                endpoint,
            };
        }
        let file = var("HF_TOKEN_PATH")
            .map(std::path::PathBuf::from)
            .or_else(|| {
                let home = var("HF_HOME").map(std::path::PathBuf::from).or_else(|| {
                    let cache = var("XDG_CACHE_HOME")
                        .map(std::path::PathBuf::from)
                        .or_else(|| var("HOME").map(|h| std::path::Path::new(&h).join(".cache")))?;
                    Some(cache.join("huggingface"))
                })?;
                Some(home.join("token"))
            });
        let token = file.as_ref().and_then(|f| {
            std::fs::read_to_string(f)
                .ok()
                .map(|t| t.trim().to_string())
                .filter(|t| !t.is_empty())
        });
        UserHubEnv {
            token_from: match (&token, &file) {
                (Some(_), Some(f)) => f.display().to_string(),
                _ => "HF_TOKEN".into(),
            },
            token,
            endpoint,
        }
    }

    /// The token, when `endpoint` may have it.
    fn token_for(&self, endpoint: &str) -> Option<&str> {
        let trusted = endpoint == DEFAULT_HF_ENDPOINT || self.endpoint.as_deref() == Some(endpoint);
        self.token.as_deref().filter(|_| trusted)
    }
}

fn normalized(endpoint: &str) -> String {
    endpoint.trim().trim_end_matches('/').to_string()
}

/// Fetches the config.json of `source` (spec field
/// `model.pretrained.huggingFace`).
pub fn fetch_config(source: &HuggingFaceSource, env: &UserHubEnv) -> Result<HubConfig> {
    let endpoint = normalized(source.endpoint.as_deref().unwrap_or(DEFAULT_HF_ENDPOINT));
    let describe = format!(
        "repository {} (revision {}) at {endpoint}",
        source.repo, source.revision
    );
    let token = env.token_for(&endpoint);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let hub = Hub::new(&endpoint, token)?;
        let listing_path = format!(
            "/api/models/{}/revision/{}",
            source.repo,
            encode_path(&source.revision, false)
        );
        let listing = hub
            .get(&listing_path)
            .await
            .and_then(|answer| answer.ok(&describe, env, &endpoint, token.is_some()))
            .with_context(|| format!("listing {describe}"))?;
        let commit = listing_commit(&listing).map_err(|problem| {
            anyhow!(
                "{endpoint}{listing_path} did not answer a Hugging Face model listing: {problem}"
            )
        })?;
        let at = commit.as_deref().unwrap_or(&source.revision);
        let path = format!(
            "/{}/resolve/{}/config.json",
            source.repo,
            encode_path(at, false)
        );
        let text = hub
            .get(&path)
            .await
            .and_then(|answer| answer.ok(&describe, env, &endpoint, token.is_some()))
            .with_context(|| format!("fetching config.json of {describe}"))?;
        Ok(HubConfig {
            text,
            commit,
            describe,
        })
    })
}

/// A client for one endpoint (the token goes with requests to it alone).
struct Hub<'a> {
    endpoint: &'a str,
    client: kube::Client,
    token: Option<&'a str>,
}

/// A status and the body that came with it.
struct Answer {
    url: String,
    status: StatusCode,
    error_code: Option<String>,
    body: String,
}

impl<'a> Hub<'a> {
    fn new(endpoint: &'a str, token: Option<&'a str>) -> Result<Self> {
        Ok(Hub {
            endpoint,
            client: client(endpoint)?,
            token,
        })
    }

    /// GET `path` (with the token), following redirects: one on the same
    /// host keeps the token, one elsewhere (a CDN's signed URL) gets none.
    async fn get(&self, path: &str) -> Result<Answer> {
        let mut origin = self.endpoint.to_string();
        let mut client = self.client.clone();
        let mut token = self.token;
        let mut path = path.to_string();
        for _ in 0..=REDIRECTS {
            let url = format!("{origin}{path}");
            let mut request = Request::get(path.as_str()).header("Accept", "application/json");
            if let Some(token) = token {
                request = request.header("Authorization", format!("Bearer {token}"));
            }
            let response = client
                .send(request.body(Body::from(Vec::new()))?)
                .await
                .map_err(|e| anyhow!("cannot reach {url}: {}", causes(&e)))?;
            let status = response.status();
            let header = |name: &str| {
                response
                    .headers()
                    .get(name)
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_string)
            };
            if status.is_redirection() {
                let location = header("location")
                    .ok_or_else(|| anyhow!("{url} answered {status} without a Location"))?;
                if location.starts_with('/') && !location.starts_with("//") {
                    // A path on the same host, from its root: a mirror's
                    // endpoint may have a path of its own (the token stays:
                    // same host).
                    let host = host_origin(&origin);
                    if host != origin {
                        client = self::client(&host)?;
                        origin = host;
                    }
                    path = location;
                } else {
                    let uri: Uri = location
                        .parse()
                        .with_context(|| format!("{url} redirected to {location:?}"))?;
                    let (Some(scheme), Some(authority)) = (uri.scheme_str(), uri.authority())
                    else {
                        bail!("{url} redirected to {location:?}, not a URL");
                    };
                    let next = format!("{scheme}://{authority}");
                    if next != origin {
                        client = self::client(&next)?;
                        token = None;
                        origin = next;
                    }
                    path = uri
                        .path_and_query()
                        .map_or("/".to_string(), |p| p.to_string());
                }
                continue;
            }
            let error_code = header("x-error-code");
            let bytes = tokio::time::timeout(TIMEOUT, response.into_body().collect_bytes())
                .await
                .map_err(|_| anyhow!("{url}: no whole answer in {TIMEOUT:?}"))?
                .map_err(|e| anyhow!("reading {url}: {}", causes(&e)))?;
            if bytes.len() > LIMIT {
                bail!("{url} answered more than {LIMIT} bytes");
            }
            return Ok(Answer {
                url,
                status,
                error_code,
                body: String::from_utf8_lossy(&bytes).into_owned(),
            });
        }
        bail!("{origin}{path}: more than {REDIRECTS} redirects")
    }
}

impl Answer {
    /// The body of a 200, or what the failure means to the user, in the
    /// initializer's words where they apply.
    fn ok(
        self,
        describe: &str,
        env: &UserHubEnv,
        endpoint: &str,
        sent_token: bool,
    ) -> Result<String> {
        let Answer {
            url,
            status,
            error_code,
            body,
        } = self;
        if status == StatusCode::OK {
            return Ok(body);
        }
        let hub_says = serde_json::from_str::<serde_json::Value>(&body)
            .ok()
            .and_then(|v| v.get("error")?.as_str().map(str::to_string))
            .map(|m| format!(" (the hub says: {m})"))
            .unwrap_or_default();
        let code = error_code.unwrap_or_default();
        let status = status.as_u16();
        let withheld = env.token.is_some() && !sent_token;
        Err(match status {
            401 | 403 if code == "GatedRepo" => anyhow!(
                "{describe} is gated: accept its conditions on the hub with the account whose token is in {}{hub_says}",
                env.token_from
            ),
            401 | 403 if withheld => anyhow!(
                "{url} answered {status}{hub_says}; your token ({}) is sent only to {DEFAULT_HF_ENDPOINT} or the endpoint HF_ENDPOINT names: set HF_ENDPOINT={endpoint} to send it there, or pass --model-dir",
                env.token_from
            ),
            401 | 403 if !sent_token => anyhow!(
                "{url} answered {status}{hub_says}: the repository needs a token: set HF_TOKEN to yours or run `huggingface-cli login` (the job's tokenSecret is the initializer's; the plugin reads no Secret), or pass --model-dir; the hub also answers so for a repository that does not exist"
            ),
            401 | 403 => anyhow!(
                "the token in {} was refused: {url} answered {status}{hub_says}; check that its account can read the repository",
                env.token_from
            ),
            404 if code == "RevisionNotFound" => {
                anyhow!("{describe}: revision not found{hub_says}")
            }
            404 => anyhow!("{url} answered 404{hub_says}"),
            _ => anyhow!("{url} answered {status}{hub_says}"),
        })
    }
}

/// A kube client for `origin`: only its HTTP stack is used (no
/// credentials, no Kubernetes requests).
fn client(origin: &str) -> Result<kube::Client> {
    let uri: Uri = origin.parse().with_context(|| {
        format!("model.pretrained.huggingFace.endpoint {origin:?} is not a URL")
    })?;
    let mut config = kube::Config::new(uri);
    config.connect_timeout = Some(TIMEOUT);
    config.read_timeout = Some(TIMEOUT);
    Ok(kube::Client::try_from(config)?)
}

/// `scheme://host[:port]` of a URL (a mirror's endpoint may have a path).
fn host_origin(url: &str) -> String {
    let after_scheme = url.find("://").map_or(0, |i| i + 3);
    match url[after_scheme..].find('/') {
        Some(i) => url[..after_scheme + i].to_string(),
        None => url.to_string(),
    }
}

/// The commit a listing names (its `sha`), as the initializer reads it.
fn listing_commit(text: &str) -> std::result::Result<Option<String>, String> {
    let v: serde_json::Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
    if !v.get("siblings").is_some_and(serde_json::Value::is_array) {
        return Err("no siblings list".into());
    }
    Ok(v.get("sha")
        .and_then(serde_json::Value::as_str)
        .filter(|s| !s.is_empty())
        .map(str::to_string))
}

/// An error and its causes (a refused connection says so only in its
/// source), each said once (hyper's layers repeat theirs).
fn causes(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let said = cause.to_string();
        if !text.contains(&said) {
            text = format!("{text}: {said}");
        }
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_token_goes_only_to_the_hub_or_the_users_own_endpoint() {
        let env = UserHubEnv {
            token: Some("hf_x".into()),
            token_from: "HF_TOKEN".into(),
            endpoint: Some("https://mirror.example".into()),
        };
        assert!(!format!("{env:?}").contains("hf_x"), "{env:?}");
        assert_eq!(env.token_for(DEFAULT_HF_ENDPOINT), Some("hf_x"));
        assert_eq!(env.token_for("https://mirror.example"), Some("hf_x"));
        assert_eq!(env.token_for("https://elsewhere.example"), None);
        assert_eq!(UserHubEnv::default().token_for(DEFAULT_HF_ENDPOINT), None);
    }

    /// As `huggingface_hub`: HF_TOKEN, else HF_TOKEN_PATH, else
    /// `$HF_HOME/token`, else the XDG cache's or the home's.
    #[test]
    fn the_token_is_found_as_huggingface_hub_finds_it() {
        let dir = std::env::temp_dir().join(format!("headroom-hf-home-{}", std::process::id()));
        std::fs::create_dir_all(dir.join(".cache/huggingface")).expect("tmp");
        std::fs::write(dir.join(".cache/huggingface/token"), "hf_home\n").expect("token");
        std::fs::write(dir.join("other"), " hf_path ").expect("token");
        let home = dir.to_str().expect("utf-8").to_string();
        let from = |vars: &[(&str, &str)]| {
            let vars: std::collections::BTreeMap<String, String> = vars
                .iter()
                .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
                .collect();
            UserHubEnv::from_lookup(|k| vars.get(k).cloned())
        };
        let other = format!("{home}/other");
        let env = from(&[("HF_TOKEN", "hf_env"), ("HOME", &home)]);
        assert_eq!(
            (env.token.as_deref(), env.token_from.as_str()),
            (Some("hf_env"), "HF_TOKEN")
        );
        let env = from(&[("HF_TOKEN_PATH", &other), ("HOME", &home)]);
        assert_eq!(
            (env.token.as_deref(), env.token_from.as_str()),
            (Some("hf_path"), other.as_str())
        );
        let env = from(&[("HOME", &home)]);
        assert_eq!(env.token.as_deref(), Some("hf_home"));
        let env = from(&[("HOME", &home), ("HF_HOME", "/nonexistent")]);
        assert_eq!(env.token, None);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn origins_drop_a_mirrors_path() {
        assert_eq!(host_origin("https://m.example/hf"), "https://m.example");
        assert_eq!(host_origin("http://127.0.0.1:9"), "http://127.0.0.1:9");
    }

    #[test]
    fn revisions_are_one_segment_and_listings_give_the_commit() {
        assert_eq!(encode_path("refs/pr/1", false), "refs%2Fpr%2F1");
        assert_eq!(
            listing_commit(r#"{"sha":"c0ffee","siblings":[]}"#).expect("listing"),
            Some("c0ffee".into())
        );
        assert_eq!(listing_commit(r#"{"siblings":[]}"#).expect("listing"), None);
        assert!(listing_commit("{}").is_err());
    }
}
