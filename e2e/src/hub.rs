//! A local stand-in for the Hugging Face hub, for the initializer's tests
//! (worker/tests/initialize.rs, on loopback) and the e2e suite (an
//! initializer pod downloads from it over the node's address).
//!
//! A plain HTTP/1.1 server that answers as the hub does, as far as a
//! download needs: it lists a repository as
//! `GET /api/models/{repo}/revision/{rev}` does (the commit as `sha`, files
//! as `siblings`), serves files under `/{repo}/resolve/{rev}/{file}` (LFS
//! files — weights — by a 302 to a `/cdn/...` path with `X-Linked-Size`, as
//! the hub redirects to its CDN), honours `Range` with 206 and 416, answers
//! HEAD, serves dataset repositories under `/api/datasets/…` and
//! `/datasets/{repo}/resolve/…` the same way (files in subdirectories
//! too), wants `Authorization: Bearer <token>` for a private repository
//! (401 with the hub's `X-Error-Code` otherwise) and 404s unknown
//! repositories, revisions and files. It records every request, so a test
//! can tell what was downloaded and how, and it can cut a transfer off
//! halfway through.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex, MutexGuard};

/// The commit every repository of the stand-in is at (`main` resolves to it).
pub const HUB_COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

/// One repository: file name → bytes, and the token it wants, if private.
#[derive(Clone, Debug, Default)]
pub struct HubRepo {
    pub files: BTreeMap<String, Vec<u8>>,
    pub token: Option<String>,
}

impl HubRepo {
    /// A public repository holding every file of `dir` (not recursive).
    pub fn from_dir(dir: &std::path::Path) -> std::io::Result<HubRepo> {
        let mut files = BTreeMap::new();
        for entry in std::fs::read_dir(dir)? {
            let entry = entry?;
            if entry.file_type()?.is_file() {
                let name = entry.file_name().to_string_lossy().into_owned();
                files.insert(name, std::fs::read(entry.path())?);
            }
        }
        Ok(HubRepo { files, token: None })
    }
}

/// One request as the stand-in saw it.
#[derive(Clone, Debug)]
pub struct HubRequest {
    pub method: String,
    /// Without the query.
    pub path: String,
    pub range: Option<String>,
    pub authorization: Option<String>,
}

/// What a test can see and steer while the stand-in serves.
#[derive(Debug, Default)]
pub struct HubState {
    pub requests: Vec<HubRequest>,
    /// Weight downloads still to cut off after half their bytes.
    pub cut_next: u32,
    /// Cut off every weight download after half its bytes.
    pub cut_always: bool,
    /// Send CDN bodies in 64 KiB pieces this far apart (a slow link, so a
    /// download can be watched while it runs).
    pub pace: Option<std::time::Duration>,
}

/// Repository id → repository: `owner/name` for a model, `datasets/owner/name`
/// for a dataset.
pub type HubRepos = BTreeMap<String, HubRepo>;

/// The stand-in; serves until the process ends.
#[derive(Debug)]
pub struct LocalHub {
    port: u16,
    state: Arc<Mutex<HubState>>,
}

impl LocalHub {
    /// Serves `repos` on `listen` (`127.0.0.1:0` for a test on this
    /// machine, `0.0.0.0:0` for pods that reach it over the node's address).
    pub fn start(listen: &str, repos: HubRepos) -> LocalHub {
        let listener =
            TcpListener::bind(listen).unwrap_or_else(|e| panic!("hub stand-in on {listen}: {e}"));
        let port = listener.local_addr().expect("bound address").port();
        let state = Arc::new(Mutex::new(HubState::default()));
        let repos = Arc::new(repos);
        let shared = state.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let (state, repos) = (shared.clone(), repos.clone());
                std::thread::spawn(move || serve(stream, &state, &repos));
            }
        });
        LocalHub { port, state }
    }

    /// The endpoint on loopback.
    pub fn endpoint(&self) -> String {
        self.endpoint_on("127.0.0.1")
    }

    /// The endpoint as a client that reaches this machine at `host` sees it.
    pub fn endpoint_on(&self, host: &str) -> String {
        format!("http://{host}:{}", self.port)
    }

    pub fn state(&self) -> MutexGuard<'_, HubState> {
        self.state.lock().expect("hub state")
    }

    /// The requests since the last call, and forget them.
    pub fn take_requests(&self) -> Vec<HubRequest> {
        std::mem::take(&mut self.state().requests)
    }
}

/// Files the hub keeps in LFS (served from the CDN).
pub fn is_lfs(name: &str) -> bool {
    name.ends_with(".safetensors") || name.ends_with(".bin")
}

fn serve(stream: TcpStream, state: &Mutex<HubState>, repos: &HubRepos) {
    let Some(seen) = read_request(&stream) else {
        return;
    };
    state.lock().expect("hub state").requests.push(seen.clone());
    let head = seen.method == "HEAD";
    let mut out = stream;
    let Some((key, route)) = route(&seen.path) else {
        return json_error(&mut out, 404, "no such route", None);
    };
    let Some(repo) = repos.get(&key) else {
        return json_error(&mut out, 404, "Repository not found", None);
    };
    let authorized = match &repo.token {
        None => true,
        Some(token) => seen.authorization.as_deref() == Some(&format!("Bearer {token}")),
    };
    match route {
        Route::Listing(rev) => listing(&mut out, repo, &key, rev, authorized, head),
        Route::Resolve(rev, file) => {
            resolve(&mut out, repo, &key, (rev, &file), authorized, head);
        }
        Route::Cdn(file) => {
            let Some(bytes) = repo.files.get(&file) else {
                return json_error(&mut out, 404, "no such object", None);
            };
            serve_object(&mut out, state, &seen, bytes, head);
        }
    }
}

/// The request line and headers, as the stand-in records them; `None`
/// when the client sent nothing readable.
fn read_request(stream: &TcpStream) -> Option<HubRequest> {
    let mut reader = BufReader::new(stream.try_clone().ok()?);
    let mut line = String::new();
    if reader.read_line(&mut line).is_err() || line.is_empty() {
        return None;
    }
    let mut parts = line.split_whitespace();
    let method = parts.next().unwrap_or_default().to_string();
    let target = parts.next().unwrap_or_default().to_string();
    let mut headers = BTreeMap::new();
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h).is_err() || h.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            headers.insert(k.trim().to_lowercase(), v.trim().to_string());
        }
    }
    Some(HubRequest {
        method,
        path: target.split('?').next().unwrap_or_default().to_string(),
        range: headers.get("range").cloned(),
        authorization: headers.get("authorization").cloned(),
    })
}

/// The repository a path names (its key in [`HubRepos`]) and what it asks
/// of it. Datasets are keyed `datasets/owner/name` in the repositories; the
/// CDN path keeps the key whole: `/cdn/{m|d}/{owner}/{name}/{file...}`.
fn route(path: &str) -> Option<(String, Route<'_>)> {
    let segments: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    Some(match segments.as_slice() {
        ["api", "models", owner, name, "revision", rev] => {
            (format!("{owner}/{name}"), Route::Listing(rev))
        }
        ["api", "datasets", owner, name, "revision", rev] => {
            (format!("datasets/{owner}/{name}"), Route::Listing(rev))
        }
        ["datasets", owner, name, "resolve", rev, file @ ..] if !file.is_empty() => (
            format!("datasets/{owner}/{name}"),
            Route::Resolve(rev, file.join("/")),
        ),
        [owner, name, "resolve", rev, file @ ..] if !file.is_empty() => (
            format!("{owner}/{name}"),
            Route::Resolve(rev, file.join("/")),
        ),
        ["cdn", kind @ ("m" | "d"), owner, name, file @ ..] if !file.is_empty() => {
            let prefix = if *kind == "d" { "datasets/" } else { "" };
            (
                format!("{prefix}{owner}/{name}"),
                Route::Cdn(file.join("/")),
            )
        }
        _ => return None,
    })
}

fn known_revision(rev: &str) -> bool {
    rev == "main" || rev == HUB_COMMIT
}

/// The repository's listing at `rev`, as the hub's API gives it.
fn listing(
    out: &mut TcpStream,
    repo: &HubRepo,
    key: &str,
    rev: &str,
    authorized: bool,
    head: bool,
) {
    if !authorized {
        // What the hub answers a private repository without a token.
        return json_error(
            out,
            401,
            "Invalid credentials in Authorization header",
            Some("RepoNotFound"),
        );
    }
    if !known_revision(rev) {
        return json_error(out, 404, "Invalid rev id", Some("RevisionNotFound"));
    }
    let mut siblings = vec![
        serde_json::json!({"rfilename": ".gitattributes"}),
        serde_json::json!({"rfilename": "README.md"}),
    ];
    for (name, bytes) in &repo.files {
        // Sizes for all but the LFS files (the hub gives all with
        // `blobs=true`, a mirror may give none), so both ways to
        // know a size are exercised: the listing's, and a HEAD
        // request (answered by the 302's X-Linked-Size).
        siblings.push(if is_lfs(name) {
            serde_json::json!({"rfilename": name})
        } else {
            serde_json::json!({"rfilename": name, "size": bytes.len()})
        });
    }
    let id = key.trim_start_matches("datasets/");
    let body = serde_json::json!({"id": id, "sha": HUB_COMMIT, "siblings": siblings});
    respond(
        out,
        "200 OK",
        &[("Content-Type", "application/json".into())],
        body.to_string().as_bytes(),
        head,
    );
}

/// A file at a revision: an LFS file by a 302 to the CDN (with its size),
/// any other file itself.
fn resolve(
    out: &mut TcpStream,
    repo: &HubRepo,
    key: &str,
    (rev, file): (&str, &str),
    authorized: bool,
    head: bool,
) {
    if !authorized {
        return json_error(out, 401, "Invalid credentials", Some("RepoNotFound"));
    }
    let Some(bytes) = repo.files.get(file).filter(|_| known_revision(rev)) else {
        return json_error(out, 404, "Entry not found", Some("EntryNotFound"));
    };
    if is_lfs(file) {
        let kind = if key.starts_with("datasets/") {
            "d"
        } else {
            "m"
        };
        let id = key.trim_start_matches("datasets/");
        respond(
            out,
            "302 Found",
            &[
                ("Location", format!("/cdn/{kind}/{id}/{file}?signature=x")),
                ("X-Linked-Size", bytes.len().to_string()),
            ],
            b"",
            head,
        );
    } else {
        respond(out, "200 OK", &[], bytes, head);
    }
}

/// What a request asks of a repository.
enum Route<'a> {
    /// The listing at a revision.
    Listing(&'a str),
    /// A file at a revision.
    Resolve(&'a str, String),
    /// An LFS object on the CDN.
    Cdn(String),
}

/// A CDN object, whole or from `Range: bytes=N-`, possibly cut off halfway.
fn serve_object(
    out: &mut TcpStream,
    state: &Mutex<HubState>,
    seen: &HubRequest,
    bytes: &[u8],
    head: bool,
) {
    let start = seen
        .range
        .as_deref()
        .and_then(|r| r.strip_prefix("bytes="))
        .and_then(|r| r.strip_suffix('-'))
        .and_then(|r| r.parse::<usize>().ok());
    let (status, body, extra) = match start {
        Some(s) if s < bytes.len() => (
            "206 Partial Content",
            &bytes[s..],
            vec![(
                "Content-Range",
                format!("bytes {s}-{}/{}", bytes.len() - 1, bytes.len()),
            )],
        ),
        Some(_) => {
            return respond(
                out,
                "416 Range Not Satisfiable",
                &[("Content-Range", format!("bytes */{}", bytes.len()))],
                b"",
                head,
            );
        }
        None => ("200 OK", bytes, vec![]),
    };
    let cut = !head && {
        let mut s = state.lock().expect("hub state");
        let cut = s.cut_always || s.cut_next > 0;
        s.cut_next = s.cut_next.saturating_sub(1);
        cut
    };
    if cut {
        // Promise the whole body, send half, hang up.
        let _ = out.write_all(head_text(status, body.len(), &extra).as_bytes());
        let _ = out.write_all(&body[..body.len() / 2]);
        let _ = out.flush();
        let _ = out.shutdown(std::net::Shutdown::Both);
        return;
    }
    let pace = state.lock().expect("hub state").pace;
    match pace {
        Some(pause) if !head => {
            let _ = out.write_all(head_text(status, body.len(), &extra).as_bytes());
            for piece in body.chunks(64 << 10) {
                if out.write_all(piece).and_then(|()| out.flush()).is_err() {
                    return;
                }
                std::thread::sleep(pause);
            }
        }
        _ => respond(out, status, &extra, body, head),
    }
}

fn head_text(status: &str, length: usize, headers: &[(&str, String)]) -> String {
    let mut text =
        format!("HTTP/1.1 {status}\r\nContent-Length: {length}\r\nConnection: close\r\n");
    for (k, v) in headers {
        text.push_str(&format!("{k}: {v}\r\n"));
    }
    text.push_str("\r\n");
    text
}

fn respond(out: &mut TcpStream, status: &str, headers: &[(&str, String)], body: &[u8], head: bool) {
    let _ = out.write_all(head_text(status, body.len(), headers).as_bytes());
    if !head {
        let _ = out.write_all(body);
    }
    let _ = out.flush();
}

fn json_error(out: &mut TcpStream, status: u16, message: &str, code: Option<&str>) {
    let reason = match status {
        401 => "401 Unauthorized",
        _ => "404 Not Found",
    };
    let mut headers = vec![("Content-Type", "application/json".to_string())];
    if let Some(code) = code {
        headers.push(("X-Error-Code", code.to_string()));
    }
    let body = serde_json::json!({ "error": message }).to_string();
    respond(out, reason, &headers, body.as_bytes(), false);
}
