//! Downloads a checkpoint from the Hugging Face hub (or a mirror speaking its
//! protocol) the way `huggingface_hub` does: the revision's file list from
//! `GET {endpoint}/api/models/{repo}/revision/{revision}`, then each file from
//! `GET {endpoint}/{repo}/resolve/{commit}/{file}`, which may redirect to a
//! CDN. Files are resolved by the commit the listing names, so a branch that
//! moves during a long download cannot mix two commits' files.
//!
//! Only what training reads is fetched ([`METADATA_FILES`] and the safetensors
//! weights); a repository with only PyTorch `.bin` weights is refused before
//! anything is downloaded.
//!
//! Downloads survive interruption: bytes go to `<file>.part`, a later try asks
//! for the rest with `Range: bytes=N-`, and the file is renamed into place
//! only when complete. A file already in place with the hub's size is never
//! fetched again, so a retried initializer downloads only what is missing.
//! Network trouble is retried here a few times ([`Retry`]) before the process
//! gives up with `Failed` (and the pod's own retry resumes from the `.part`).

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use headroom_api::hub::encode_path;
use headroom_api::{DownloadProgress, HubDataFiles};

use ureq::http::HeaderMap;

use super::InitError;
use crate::dataset_layout;
use crate::text::Format;

/// The small files of a checkpoint that training (or a later
/// `from_pretrained` of the output) reads, fetched when the repository has them.
pub const METADATA_FILES: [&str; 5] = [
    CONFIG_FILE,
    TOKENIZER_FILE,
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
];
pub const CONFIG_FILE: &str = "config.json";
pub const TOKENIZER_FILE: &str = "tokenizer.json";
pub const SINGLE_FILE: &str = "model.safetensors";
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// The field of the job that holds the token, for messages.
/// How often a download in progress is logged.
const PROGRESS_EVERY: Duration = Duration::from_secs(5);
/// Read buffer of a download.
const CHUNK: usize = 1 << 20;
/// The largest file listing read (a repository with many files is a few MiB).
const LISTING_LIMIT: u64 = 64 << 20;

/// How network failures are retried within one run.
#[derive(Clone, Copy, Debug)]
pub struct Retry {
    /// Tries per request, the first included.
    pub attempts: u32,
    /// Wait before the second try; doubled before each later one.
    pub first_wait: Duration,
}

impl Default for Retry {
    /// Four tries over about seven seconds: enough for a dropped connection
    /// or a brief hub hiccup. Longer outages are the pod restart's to ride out.
    fn default() -> Self {
        Retry {
            attempts: 4,
            first_wait: Duration::from_secs(1),
        }
    }
}

/// What a repository holds: the hub keeps models and datasets apart (their
/// own listing and file URLs), and the job's spec names each in its own field.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RepoKind {
    /// `spec.model.pretrained.huggingFace`: `/api/models/…`, `/{repo}/resolve/…`.
    Model,
    /// `spec.data.huggingFace`: `/api/datasets/…`, `/datasets/{repo}/resolve/…`.
    Dataset,
}

impl RepoKind {
    /// The spec field the repository comes from, for messages.
    fn field(self) -> &'static str {
        match self {
            RepoKind::Model => "model.pretrained.huggingFace",
            RepoKind::Dataset => "data.huggingFace",
        }
    }

    fn noun(self) -> &'static str {
        match self {
            RepoKind::Model => "repository",
            RepoKind::Dataset => "dataset repository",
        }
    }
}

/// Told where a download stands: at each file, and as bytes arrive.
pub type ProgressObserver = std::sync::Arc<dyn Fn(&DownloadProgress) + Send + Sync>;

/// One repository at one revision on one hub.
pub struct Hub {
    agent: ureq::Agent,
    kind: RepoKind,
    endpoint: String,
    repo: String,
    revision: String,
    token: Option<String>,
    retry: Retry,
    /// Where the fetch stands, and who is told (the status reporter).
    progress: Mutex<DownloadProgress>,
    observer: Option<ProgressObserver>,
}

impl std::fmt::Debug for Hub {
    // Never the token.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hub")
            .field("kind", &self.kind)
            .field("endpoint", &self.endpoint)
            .field("repo", &self.repo)
            .field("revision", &self.revision)
            .field("token", &self.token.as_ref().map(|_| "(set)"))
            .finish()
    }
}

/// A revision's files as the hub lists them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Listing {
    /// The commit the revision points at (the listing's `sha`).
    pub commit: Option<String>,
    /// File name → its size, where the listing gives it.
    pub files: BTreeMap<String, Option<u64>>,
}

/// What [`Hub::fetch`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Fetched {
    /// Body bytes received by this run.
    pub downloaded_bytes: u64,
    /// The commit the files came from, when the hub said.
    pub commit: Option<String>,
    /// The files now in the directory, in the order they were fetched.
    pub files: Vec<String>,
}

/// Which request a failed status answered, for its message.
enum Target<'a> {
    Listing,
    File(&'a str),
}

impl Hub {
    /// Checks the repository id and the endpoint (both come from the job's
    /// spec, so a bad one is the user's to fix).
    pub fn new(
        kind: RepoKind,
        endpoint: &str,
        repo: &str,
        revision: &str,
        token: Option<String>,
        retry: Retry,
    ) -> Result<Self, InitError> {
        let endpoint = endpoint.trim().trim_end_matches('/').to_string();
        let host = endpoint
            .strip_prefix("https://")
            .or_else(|| endpoint.strip_prefix("http://"));
        let field = kind.field();
        if host.is_none_or(str::is_empty) {
            return Err(InitError::Invalid(format!(
                "{field}.endpoint must be an http:// or https:// URL, not {endpoint:?}"
            )));
        }
        if !valid_repo_id(repo) {
            return Err(InitError::Invalid(format!(
                "{field}.repo must be a repository id such as owner/name, not {repo:?}"
            )));
        }
        if revision.trim().is_empty() {
            return Err(InitError::Invalid(format!(
                "{field}.revision must not be empty"
            )));
        }
        let agent = ureq::Agent::config_builder()
            // Statuses are answers to interpret (401, 404, 206), not transport errors.
            .http_status_as_error(false)
            // A relative redirect on the same host keeps the token (mirrors
            // do this); a CDN on another host gets a signed URL and no token.
            .redirect_auth_headers(ureq::config::RedirectAuthHeaders::SameHost)
            .user_agent(concat!("headroom-worker/", env!("CARGO_PKG_VERSION")))
            .timeout_connect(Some(Duration::from_secs(30)))
            .timeout_recv_response(Some(Duration::from_secs(60)))
            // A stalled transfer fails (and resumes) instead of hanging the pod;
            // a long one that keeps moving is never cut off.
            .timeout_per_read(Some(Duration::from_secs(60)))
            // The system's trust store (the image's CA bundle, or SSL_CERT_FILE):
            // a mirror behind an internal CA, or a TLS-inspecting proxy the
            // cluster's admins trust, verifies as it does for every other tool.
            .tls_config(
                ureq::tls::TlsConfig::builder()
                    .root_certs(ureq::tls::RootCerts::PlatformVerifier)
                    .build(),
            )
            .build()
            .into();
        Ok(Hub {
            agent,
            kind,
            endpoint,
            repo: repo.to_string(),
            revision: revision.to_string(),
            token: token.filter(|t| !t.trim().is_empty()),
            retry,
            progress: Mutex::new(DownloadProgress::default()),
            observer: None,
        })
    }

    /// Tells `observer` where the fetch stands: when a file starts and
    /// ends, and after every chunk received.
    pub fn observed(mut self, observer: ProgressObserver) -> Self {
        self.observer = Some(observer);
        self
    }

    /// Changes the progress and tells the observer.
    fn progress(&self, change: impl FnOnce(&mut DownloadProgress)) {
        let mut progress = self.progress.lock().unwrap_or_else(|p| p.into_inner());
        change(&mut progress);
        if let Some(observer) = &self.observer {
            observer(&progress);
        }
    }

    /// Brings the checkpoint into `dir`: the metadata files, then (after
    /// `check_config` has accepted the downloaded config.json, so a model
    /// Headroom cannot train costs no weight download) the weights.
    pub fn fetch(
        &self,
        dir: &Path,
        check_config: &dyn Fn(&Path) -> Result<(), InitError>,
    ) -> Result<Fetched, InitError> {
        std::fs::create_dir_all(dir)
            .map_err(|e| InitError::Io(format!("cannot create {}: {e}", dir.display())))?;
        let listing = self.retrying(|| self.list())?;
        tracing::info!(
            repo = %self.repo,
            revision = %self.revision,
            commit = listing.commit.as_deref().unwrap_or("(not given)"),
            files = listing.files.len(),
            "listed the repository"
        );
        let commit = listing
            .commit
            .clone()
            .unwrap_or_else(|| self.revision.clone());
        for required in [CONFIG_FILE, TOKENIZER_FILE] {
            if !listing.files.contains_key(required) {
                return Err(InitError::Invalid(format!(
                    "{} has no {required}{}",
                    self.describe(),
                    if required == TOKENIZER_FILE {
                        " (Headroom reads the fast tokenizer's tokenizer.json)"
                    } else {
                        ""
                    }
                )));
            }
        }
        let weights_single = listing.files.contains_key(SINGLE_FILE);
        let weights_index = listing.files.contains_key(INDEX_FILE);
        if !weights_single && !weights_index {
            let pytorch = listing
                .files
                .keys()
                .any(|f| !f.contains('/') && (f.ends_with(".bin") || f.ends_with(".pth")));
            return Err(InitError::Invalid(if pytorch {
                format!(
                    "{} has only PyTorch .bin/.pth weights; Headroom reads safetensors: pick a revision with {SINGLE_FILE} or {INDEX_FILE} (the hub's conversion bot opens one as a pull request, revision refs/pr/<n>) or upload converted weights",
                    self.describe()
                )
            } else {
                format!(
                    "{} has neither {SINGLE_FILE} nor {INDEX_FILE}",
                    self.describe()
                )
            }));
        }
        let mut fetched = Fetched {
            commit: listing.commit.clone(),
            ..Fetched::default()
        };
        let metadata = METADATA_FILES
            .iter()
            .filter(|name| listing.files.contains_key(**name))
            .count();
        // The weights, or the index (its shards are counted once it is read).
        self.progress(|p| p.files = metadata as u32 + 1);
        let get = |name: &str, fetched: &mut Fetched| -> Result<(), InitError> {
            let size = listing.files.get(name).copied().flatten();
            fetched.downloaded_bytes += self.ensure(&commit, name, size, dir)?;
            fetched.files.push(name.to_string());
            Ok(())
        };
        for name in METADATA_FILES {
            if listing.files.contains_key(name) {
                get(name, &mut fetched)?;
            }
        }
        check_config(&dir.join(CONFIG_FILE))?;
        if weights_single {
            check_space(
                dir,
                &[(
                    SINGLE_FILE,
                    listing.files.get(SINGLE_FILE).copied().flatten(),
                )],
            )?;
            get(SINGLE_FILE, &mut fetched)?;
        } else {
            get(INDEX_FILE, &mut fetched)?;
            let shards = shards(&dir.join(INDEX_FILE))?;
            let sizes: Vec<(&str, Option<u64>)> = shards
                .iter()
                .map(|s| (s.as_str(), listing.files.get(s).copied().flatten()))
                .collect();
            check_space(dir, &sizes)?;
            self.progress(|p| p.files += shards.len() as u32);
            for shard in shards {
                if !listing.files.contains_key(&shard) {
                    return Err(InitError::Invalid(format!(
                        "{INDEX_FILE} of {} names {shard}, which the repository does not have",
                        self.describe()
                    )));
                }
                get(&shard, &mut fetched)?;
            }
        }
        Ok(fetched)
    }

    /// Brings the dataset files `files` names (a path, a glob pattern, or a
    /// split found as `datasets` finds it) under `dir`, keeping their paths
    /// in the repository, resumably; a file already there whole is skipped.
    pub fn fetch_data(
        &self,
        dir: &Path,
        files: &HubDataFiles,
        format: &Format,
    ) -> Result<Fetched, InitError> {
        let field = self.kind.field();
        std::fs::create_dir_all(dir)
            .map_err(|e| InitError::Io(format!("cannot create {}: {e}", dir.display())))?;
        let listing = self.retrying(|| self.list())?;
        let commit = listing
            .commit
            .clone()
            .unwrap_or_else(|| self.revision.clone());
        let mut fetched = Fetched {
            commit: listing.commit.clone(),
            ..Fetched::default()
        };
        let names: Vec<String> = match files {
            HubDataFiles::File(name) => self.named_files(&listing, name)?,
            HubDataFiles::Split(split) => {
                // The card's `configs` say which files are which split.
                let readme = match listing.files.get(dataset_layout::README) {
                    Some(size) => {
                        self.progress(|p| p.files = 1);
                        fetched.downloaded_bytes +=
                            self.ensure(&commit, dataset_layout::README, *size, dir)?;
                        fetched.files.push(dataset_layout::README.into());
                        let path = dir.join(dataset_layout::README);
                        Some(
                            std::fs::read_to_string(&path)
                                .map_err(|e| io_error("reading", &path, e))?,
                        )
                    }
                    None => None,
                };
                let all: Vec<String> = listing.files.keys().cloned().collect();
                dataset_layout::split_files(&all, readme.as_deref(), split, format)
                    .map_err(|e| InitError::Invalid(format!("{}: {field}: {e}", self.describe())))?
            }
        };
        // The names come from the hub's listing: each must stay inside
        // the download directory.
        if let Some(bad) = names.iter().find(|n| !inside_repository(n)) {
            return Err(InitError::Invalid(format!(
                "{} lists {bad:?}, which is not a path inside the repository",
                self.describe()
            )));
        }
        let sizes: Vec<(&str, Option<u64>)> = names
            .iter()
            .map(|n| (n.as_str(), listing.files.get(n).copied().flatten()))
            .collect();
        check_space(dir, &sizes)?;
        self.progress(|p| p.files = (fetched.files.len() + names.len()) as u32);
        for name in names {
            let target = dir.join(&name);
            if let Some(parent) = target.parent() {
                std::fs::create_dir_all(parent).map_err(|e| {
                    InitError::Io(format!("cannot create {}: {e}", parent.display()))
                })?;
            }
            let size = listing.files.get(&name).copied().flatten();
            fetched.downloaded_bytes += self.ensure(&commit, &name, size, dir)?;
            fetched.files.push(name);
        }
        Ok(fetched)
    }

    /// The files `file` names in the listing: itself, or the files its glob
    /// pattern matches (in name order).
    fn named_files(&self, listing: &Listing, name: &str) -> Result<Vec<String>, InitError> {
        let field = self.kind.field();
        if !inside_repository(name) {
            return Err(InitError::Invalid(format!(
                "{field}.file must be a path inside the repository such as data/train.jsonl, not {name:?}"
            )));
        }
        let found = if name.contains(['*', '?', '[']) {
            let names: Vec<String> = listing.files.keys().cloned().collect();
            dataset_layout::matching(name, &names)
                .map_err(|e| InitError::Invalid(format!("{field}.file: {e}")))?
        } else if listing.files.contains_key(name) {
            vec![name.to_string()]
        } else {
            Vec::new()
        };
        if found.is_empty() {
            let mut near: Vec<&str> = listing
                .files
                .keys()
                .map(String::as_str)
                .filter(|f| {
                    [".jsonl", ".json", ".txt", ".parquet"]
                        .iter()
                        .any(|e| f.ends_with(e))
                })
                .take(10)
                .collect();
            near.sort_unstable();
            return Err(InitError::Invalid(format!(
                "{} has no file {name}{}",
                self.describe(),
                if near.is_empty() {
                    String::new()
                } else {
                    format!("; its data files include: {}", near.join(", "))
                }
            )));
        }
        Ok(found)
    }

    /// `repository X (revision R) at ENDPOINT`.
    fn describe(&self) -> String {
        format!(
            "{} {} (revision {}) at {}",
            self.kind.noun(),
            self.repo,
            self.revision,
            self.endpoint
        )
    }

    /// The spec field of the token, for messages.
    fn token_field(&self) -> String {
        format!("{}.tokenSecret", self.kind.field())
    }

    fn listing_url(&self) -> String {
        let api = match self.kind {
            RepoKind::Model => "models",
            RepoKind::Dataset => "datasets",
        };
        format!(
            "{}/api/{api}/{}/revision/{}?blobs=true",
            self.endpoint,
            self.repo,
            encode_path(&self.revision, false)
        )
    }

    fn file_url(&self, commit: &str, name: &str) -> String {
        let prefix = match self.kind {
            RepoKind::Model => "",
            RepoKind::Dataset => "datasets/",
        };
        format!(
            "{}/{prefix}{}/resolve/{}/{}",
            self.endpoint,
            self.repo,
            encode_path(commit, false),
            encode_path(name, true)
        )
    }

    fn authorized<B>(&self, request: ureq::RequestBuilder<B>) -> ureq::RequestBuilder<B> {
        match &self.token {
            Some(token) => request.header("Authorization", format!("Bearer {}", token.trim())),
            None => request,
        }
    }

    /// Runs `attempt` until it succeeds, fails for a reason retrying cannot
    /// fix, or has used up its tries (network failures only).
    fn retrying<T>(
        &self,
        mut attempt: impl FnMut() -> Result<T, InitError>,
    ) -> Result<T, InitError> {
        let mut tries = 1;
        let mut wait = self.retry.first_wait;
        loop {
            match attempt() {
                Err(InitError::Network(reason)) if tries < self.retry.attempts => {
                    tracing::warn!(attempt = tries, wait = ?wait, "{reason}; retrying");
                    std::thread::sleep(wait);
                    wait = wait.saturating_mul(2);
                    tries += 1;
                }
                Err(InitError::Network(reason)) if tries > 1 => {
                    return Err(InitError::Network(format!(
                        "{reason} (gave up after {tries} tries)"
                    )));
                }
                other => return other,
            }
        }
    }

    /// The revision's files and the commit it points at.
    pub fn list(&self) -> Result<Listing, InitError> {
        let url = self.listing_url();
        let response = self
            .authorized(self.agent.get(&url))
            .header("Accept", "application/json")
            .call()
            .map_err(|e| transport(&url, &e))?;
        if response.status().as_u16() != 200 {
            return Err(self.status_error(response, &url, Target::Listing));
        }
        let text = response
            .into_body()
            .into_with_config()
            .limit(LISTING_LIMIT)
            .read_to_string()
            .map_err(|e| InitError::Network(format!("reading {url}: {e}")))?;
        parse_listing(&text).map_err(|problem| {
            InitError::Invalid(format!(
                "{url} did not answer a Hugging Face model listing: {problem}"
            ))
        })
    }

    /// Makes `dir/name` the repository's file, downloading what is missing;
    /// returns the bytes downloaded.
    fn ensure(
        &self,
        commit: &str,
        name: &str,
        listed_size: Option<u64>,
        dir: &Path,
    ) -> Result<u64, InitError> {
        self.progress(|p| {
            p.set_file(name);
            p.file_bytes = 0;
            p.file_total_bytes = listed_size;
        });
        let bytes = self.ensure_file(commit, name, listed_size, dir)?;
        self.progress(|p| {
            p.files_done += 1;
            p.file_bytes = p.file_total_bytes.unwrap_or(p.file_bytes);
        });
        Ok(bytes)
    }

    fn ensure_file(
        &self,
        commit: &str,
        name: &str,
        listed_size: Option<u64>,
        dir: &Path,
    ) -> Result<u64, InitError> {
        let url = self.file_url(commit, name);
        let target = dir.join(name);
        let mut expected = listed_size;
        if let Ok(meta) = std::fs::metadata(&target)
            && meta.is_file()
        {
            if expected.is_none() {
                expected = self.retrying(|| self.remote_size(&url, name))?;
            }
            self.progress(|p| p.file_total_bytes = Some(meta.len()));
            match expected {
                Some(size) if size == meta.len() => {
                    tracing::info!(file = name, bytes = size, "already downloaded");
                    return Ok(0);
                }
                None => {
                    // Files are renamed into place only when complete, so
                    // one that is here is whole.
                    tracing::info!(
                        file = name,
                        bytes = meta.len(),
                        "already downloaded (the hub gave no size to compare)"
                    );
                    return Ok(0);
                }
                Some(size) => tracing::warn!(
                    file = name,
                    have = meta.len(),
                    hub = size,
                    "the file here differs in size from the hub's; downloading it again"
                ),
            }
        }
        let mut downloaded = 0;
        self.retrying(|| self.download(&url, name, expected, dir, &mut downloaded))?;
        Ok(downloaded)
    }

    /// The size the hub gives for a file, from HEAD requests as
    /// `huggingface_hub` makes them: relative redirects are followed (with
    /// the token), a redirect elsewhere is not (a CDN's URL is signed for GET
    /// only), and the hub's `X-Linked-Size` on a redirect to the LFS object
    /// is its size. `None` when no response says.
    fn remote_size(&self, url: &str, name: &str) -> Result<Option<u64>, InitError> {
        let mut url = url.to_string();
        for _ in 0..10 {
            let response = self
                .authorized(self.agent.head(&url))
                .config()
                .max_redirects(0)
                .build()
                .call()
                .map_err(|e| transport(&url, &e))?;
            let headers = response.headers();
            if let Some(size) = header_u64(headers, "x-linked-size") {
                return Ok(Some(size));
            }
            match response.status().as_u16() {
                200 => return Ok(header_u64(headers, "content-length")),
                301 | 302 | 303 | 307 | 308 => match header_str(headers, "location") {
                    Some(location) if location.starts_with('/') && !location.starts_with("//") => {
                        url = format!("{}{location}", origin(&url));
                    }
                    _ => return Ok(None),
                },
                _ => return Err(self.status_error(response, &url, Target::File(name))),
            }
        }
        Ok(None)
    }

    /// One try at downloading `name` into `dir/name.part` from where an
    /// earlier try stopped, renaming it into place once complete.
    fn download(
        &self,
        url: &str,
        name: &str,
        expected: Option<u64>,
        dir: &Path,
        downloaded: &mut u64,
    ) -> Result<(), InitError> {
        let paths = PartPaths {
            target: dir.join(name),
            part: dir.join(format!("{name}.part")),
        };
        let Some(offset) = paths.resume_offset(expected)? else {
            return Ok(());
        };
        let (response, resume, total) =
            match self.request_from(url, name, offset, expected, &paths)? {
                Answer::Complete => return Ok(()),
                Answer::Body {
                    response,
                    resume,
                    total,
                } => (response, resume, total),
            };
        if resume {
            tracing::info!(file = name, from = offset, total, "resuming the download");
        } else {
            tracing::info!(file = name, total, "downloading");
        }
        let body = Body {
            url,
            name,
            resume,
            have: if resume { offset } else { 0 },
            total,
        };
        let have = self.write_body(response, &body, &paths, downloaded)?;
        paths.rename_into_place()?;
        tracing::info!(file = name, bytes = have, "downloaded");
        Ok(())
    }

    /// Asks for `name` from byte `offset` on, and reads what the answer
    /// means for the `.part`: a body to append or to start over with, or
    /// (a `416` for a `.part` that already is the whole file) nothing left
    /// to fetch.
    fn request_from(
        &self,
        url: &str,
        name: &str,
        offset: u64,
        expected: Option<u64>,
        paths: &PartPaths,
    ) -> Result<Answer, InitError> {
        let mut request = self.authorized(self.agent.get(url));
        if offset > 0 {
            request = request.header("Range", format!("bytes={offset}-"));
        }
        let response = request.call().map_err(|e| transport(url, &e))?;
        let status = response.status().as_u16();
        let (resume, total) = match status {
            206 => match content_range(response.headers()) {
                Some((start, total)) if start == offset => (true, total.or(expected)),
                _ => {
                    paths.remove_part()?;
                    return Err(InitError::Network(format!(
                        "{url} answered a range that does not start at byte {offset}; starting {name} over"
                    )));
                }
            },
            200 => {
                if offset > 0 {
                    tracing::info!(
                        file = name,
                        "the server does not resume downloads; starting over"
                    );
                }
                (
                    false,
                    header_u64(response.headers(), "content-length").or(expected),
                )
            }
            416 if offset > 0 => {
                // `bytes */TOTAL`: the `.part` may already be the whole file.
                let total = header_str(response.headers(), "content-range")
                    .and_then(|r| r.rsplit_once('/').and_then(|(_, t)| t.trim().parse().ok()));
                if total == Some(offset) {
                    paths.rename_into_place()?;
                    return Ok(Answer::Complete);
                }
                paths.remove_part()?;
                return Err(InitError::Network(format!(
                    "{url} cannot resume at byte {offset}; starting {name} over"
                )));
            }
            _ => return Err(self.status_error(response, url, Target::File(name))),
        };
        Ok(Answer::Body {
            response,
            resume,
            total,
        })
    }

    /// Writes the response's body into the `.part` (appended when resuming),
    /// reporting progress as it goes, and syncs it; returns the bytes the
    /// `.part` holds, which must be the whole file when its size is known.
    fn write_body(
        &self,
        response: ureq::http::Response<ureq::Body>,
        body: &Body<'_>,
        paths: &PartPaths,
        downloaded: &mut u64,
    ) -> Result<u64, InitError> {
        let (name, total, part) = (body.name, body.total, &paths.part);
        let mut file = if body.resume {
            OpenOptions::new().append(true).open(part)
        } else {
            File::create(part)
        }
        .map_err(|e| io_error("opening", part, e))?;
        let mut have = body.have;
        self.progress(|p| {
            p.file_bytes = have;
            p.file_total_bytes = total;
        });
        let mut reader = response.into_body().into_reader();
        let mut buffer = vec![0u8; CHUNK];
        let mut logged = Instant::now();
        loop {
            let n = match reader.read(&mut buffer) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    file.sync_all().map_err(|e| io_error("writing", part, e))?;
                    return Err(body.lost(have, &e));
                }
            };
            file.write_all(&buffer[..n])
                .map_err(|e| io_error("writing", part, e))?;
            have += n as u64;
            *downloaded += n as u64;
            self.progress(|p| {
                p.file_bytes = have;
                p.downloaded_bytes += n as u64;
            });
            if logged.elapsed() >= PROGRESS_EVERY {
                logged = Instant::now();
                tracing::info!(file = name, bytes = have, total, "downloading");
            }
        }
        file.sync_all().map_err(|e| io_error("writing", part, e))?;
        drop(file);
        if let Some(total) = total
            && have != total
        {
            return Err(body.lost(have, &"the connection closed early"));
        }
        Ok(have)
    }

    /// A status that is not the answer asked for, as the user should read it.
    fn status_error(
        &self,
        response: ureq::http::Response<ureq::Body>,
        url: &str,
        target: Target<'_>,
    ) -> InitError {
        let status = response.status().as_u16();
        let headers = response.headers();
        let code = header_str(headers, "x-error-code").unwrap_or_default();
        let hub_says = header_str(headers, "x-error-message")
            .or_else(|| {
                let mut body = response.into_body();
                let text = body.with_config().limit(4096).read_to_string().ok()?;
                let v: serde_json::Value = serde_json::from_str(&text).ok()?;
                v.get("error").and_then(|e| e.as_str()).map(str::to_string)
            })
            .map(|m| format!(" (the hub says: {m})"))
            .unwrap_or_default();
        let repo = &self.repo;
        let (noun, token_field) = (self.kind.noun(), self.token_field());
        match (status, target) {
            (401 | 403, _) if code == "GatedRepo" => InitError::Invalid(format!(
                "{} is gated: accept its conditions on the hub with the account whose token is in {token_field}{hub_says}",
                self.describe()
            )),
            (401 | 403, _) if self.token.is_none() => InitError::Invalid(format!(
                "{noun} {repo} needs a token (set {token_field}): {url} answered {status}{hub_says}; the hub also answers so for a repository that does not exist"
            )),
            (401 | 403, _) => InitError::Invalid(format!(
                "the token was refused for {noun} {repo}: {url} answered {status}{hub_says}; check the token in {token_field} and that its account can read the repository"
            )),
            (404, Target::Listing) if code == "RevisionNotFound" => InitError::Invalid(format!(
                "revision {} of {noun} {repo} not found at {}{hub_says}",
                self.revision, self.endpoint
            )),
            (404, Target::Listing) => {
                InitError::Invalid(format!("{} not found{hub_says}", self.describe()))
            }
            (404, Target::File(name)) => InitError::Invalid(format!(
                "{name} is listed by {} but {url} answered 404{hub_says}",
                self.describe()
            )),
            (408 | 425 | 429 | 500..=599, _) => {
                InitError::Network(format!("{url} answered {status}{hub_says}"))
            }
            (400..=499, _) => InitError::Invalid(format!("{url} answered {status}{hub_says}")),
            _ => InitError::Network(format!("{url} answered {status}{hub_says}")),
        }
    }
}

/// A file being downloaded: its final path and the `.part` it grows in.
struct PartPaths {
    target: PathBuf,
    part: PathBuf,
}

impl PartPaths {
    /// Where to resume: the `.part`'s size (0 when there is none, or when it
    /// is longer than the file); `None` when it already was the whole file
    /// and is now renamed into place.
    fn resume_offset(&self, expected: Option<u64>) -> Result<Option<u64>, InitError> {
        let offset = std::fs::metadata(&self.part).map_or(0, |m| m.len());
        match expected {
            Some(total) if offset > total => {
                self.remove_part()?;
                Ok(Some(0))
            }
            Some(total) if offset == total && total > 0 => {
                // A complete download that was not renamed yet.
                self.rename_into_place()?;
                Ok(None)
            }
            _ => Ok(Some(offset)),
        }
    }

    fn remove_part(&self) -> Result<(), InitError> {
        std::fs::remove_file(&self.part).map_err(|e| io_error("removing", &self.part, e))
    }

    fn rename_into_place(&self) -> Result<(), InitError> {
        std::fs::rename(&self.part, &self.target)
            .map_err(|e| io_error("renaming into place", &self.target, e))
    }
}

/// What a download request's answer leaves to do.
enum Answer {
    /// The `.part` already was the whole file, and is now in place.
    Complete,
    /// A body to write: appended to the `.part` (`resume`) or replacing
    /// it; the file's size when known.
    Body {
        response: ureq::http::Response<ureq::Body>,
        resume: bool,
        total: Option<u64>,
    },
}

/// The body being written: which file, from where, and of what size.
struct Body<'a> {
    url: &'a str,
    name: &'a str,
    resume: bool,
    /// The bytes the `.part` holds before the body.
    have: u64,
    total: Option<u64>,
}

impl Body<'_> {
    /// The transfer broke off with `have` bytes in the `.part`.
    fn lost(&self, have: u64, e: &dyn std::fmt::Display) -> InitError {
        InitError::Network(format!(
            "downloading {}: the transfer broke off after {have} of {} bytes ({e}); the next try resumes there",
            self.url,
            self.total.map_or("?".to_string(), |t| t.to_string())
        ))
    }
}

/// Whether `name` is a relative path that stays inside the repository
/// (no leading `/`, no empty, `.` or `..` component, no backslash).
fn inside_repository(name: &str) -> bool {
    !name.is_empty()
        && !name.starts_with('/')
        && !name.contains('\\')
        && !name
            .split('/')
            .any(|p| p.is_empty() || p == "." || p == "..")
}

/// Refuses, before a byte of it comes, a download that would not fit on
/// the volume under `dir` (the job's checkpoint claim): the listed sizes of
/// `files`, less what of them is already there, against the space free
/// there. A full volume would otherwise fail the transfer midway (ENOSPC)
/// after minutes of downloading, and every retry again.
fn check_space(dir: &Path, files: &[(&str, Option<u64>)]) -> Result<(), InitError> {
    let have = |name: &str| {
        let target = dir.join(name);
        std::fs::metadata(&target)
            .or_else(|_| std::fs::metadata(dir.join(format!("{name}.part"))))
            .map_or(0, |m| m.len())
    };
    let need: u64 = files
        .iter()
        .map(|(name, size)| size.unwrap_or(0).saturating_sub(have(name)))
        .sum();
    std::fs::create_dir_all(dir).map_err(|e| io_error("creating", dir, e))?;
    let stat = rustix::fs::statvfs(dir)
        .map_err(|e| InitError::Io(format!("the free space under {}: {e}", dir.display())))?;
    let free = stat.f_bavail.saturating_mul(stat.f_frsize);
    match space_shortfall(need, free) {
        Some((problem, more_bytes)) => Err(InitError::NoSpace {
            message: format!("{}: {problem}", dir.display()),
            more_bytes,
        }),
        None => Ok(()),
    }
}

/// What to say when `need` bytes do not fit in `free` (with 1 % and 64 MiB
/// to spare for the checkpoints' own files): the sizes, and the setting
/// that gives the job more (the claim's size, rounded up to GiB); with the
/// bytes more the volume needs.
fn space_shortfall(need: u64, free: u64) -> Option<(String, u64)> {
    const GIB: u64 = 1 << 30;
    let spare = (need / 100).max(64 << 20);
    if need.saturating_add(spare) <= free {
        return None;
    }
    let gib = |b: u64| b as f64 / GIB as f64;
    let more = need + spare - free.min(need + spare);
    let problem = format!(
        "the download needs {:.2} GiB more and the job's checkpoint volume has {:.2} GiB free; give the job a larger claim: spec.checkpoints.size (at least {}Gi more than today, with room for two checkpoints and the output) or the chart's checkpoints.size, or a StorageClass with allowVolumeExpansion (Headroom then grows the claim)",
        gib(need),
        gib(free),
        more.div_ceil(GIB)
    );
    Some((problem, more))
}

fn io_error(what: &str, path: &Path, e: std::io::Error) -> InitError {
    InitError::Io(format!("{what} {}: {e}", path.display()))
}

/// A transport failure, naming the URL. A malformed URL is the spec's fault;
/// the rest may heal.
fn transport(url: &str, e: &ureq::Error) -> InitError {
    match e {
        ureq::Error::BadUri(_) | ureq::Error::Http(_) => {
            InitError::Invalid(format!("{url} is not a usable URL: {e}"))
        }
        _ => InitError::Network(format!("cannot reach {url}: {e}")),
    }
}

/// `scheme://host[:port]` of a URL.
fn origin(url: &str) -> &str {
    let after_scheme = url.find("://").map_or(0, |i| i + 3);
    match url[after_scheme..].find('/') {
        Some(i) => &url[..after_scheme + i],
        None => url,
    }
}

/// `owner/name` or `name`, each part of letters, digits, `-`, `_` and `.`.
fn valid_repo_id(repo: &str) -> bool {
    let parts: Vec<&str> = repo.split('/').collect();
    parts.len() <= 2
        && parts.iter().all(|p| {
            !p.is_empty()
                && *p != "."
                && *p != ".."
                && p.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        })
}

fn header_str(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(|v| v.trim().to_string())
}

fn header_u64(headers: &HeaderMap, name: &str) -> Option<u64> {
    header_str(headers, name)?.parse().ok()
}

/// `Content-Range: bytes START-END/TOTAL` → (START, TOTAL when not `*`).
fn content_range(headers: &HeaderMap) -> Option<(u64, Option<u64>)> {
    let value = header_str(headers, "content-range")?;
    let rest = value.strip_prefix("bytes ")?;
    let (range, total) = rest.split_once('/')?;
    let (start, _) = range.split_once('-')?;
    Some((start.trim().parse().ok()?, total.trim().parse().ok()))
}

/// The listing's `sha` and `siblings[].rfilename` (with `size`, or
/// `lfs.size`, where given).
fn parse_listing(text: &str) -> Result<Listing, String> {
    let v: serde_json::Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
    let siblings = v
        .get("siblings")
        .and_then(serde_json::Value::as_array)
        .ok_or("no siblings list")?;
    let mut files = BTreeMap::new();
    for s in siblings {
        let name = s
            .get("rfilename")
            .and_then(serde_json::Value::as_str)
            .ok_or("a sibling without rfilename")?;
        let size = s
            .get("size")
            .and_then(serde_json::Value::as_u64)
            .or_else(|| s.pointer("/lfs/size").and_then(serde_json::Value::as_u64));
        files.insert(name.to_string(), size);
    }
    Ok(Listing {
        commit: v
            .get("sha")
            .and_then(serde_json::Value::as_str)
            .filter(|s| !s.is_empty())
            .map(str::to_string),
        files,
    })
}

/// The shard files a downloaded `model.safetensors.index.json` names, each
/// once, sorted.
fn shards(index: &Path) -> Result<Vec<String>, InitError> {
    let bad = |problem: String| InitError::Invalid(format!("{}: {problem}", index.display()));
    let text = std::fs::read_to_string(index)
        .map_err(|e| InitError::Io(format!("reading {}: {e}", index.display())))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
    let map = v
        .get("weight_map")
        .and_then(serde_json::Value::as_object)
        .ok_or_else(|| bad("no weight_map object".into()))?;
    let mut files = std::collections::BTreeSet::new();
    for (tensor, file) in map {
        let file = file
            .as_str()
            .filter(|f| {
                !f.contains('/') && !f.contains('\\') && f.ends_with(".safetensors") && *f != ".safetensors"
            })
            .ok_or_else(|| {
                bad(format!(
                    "weight_map.{tensor} must name a .safetensors file in the same directory, not {file}"
                ))
            })?;
        files.insert(file.to_string());
    }
    Ok(files.into_iter().collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A download that does not fit says so with both sizes and the
    /// setting to raise; one that fits with room to spare passes; the free
    /// space of a real directory is read.
    #[test]
    fn listed_names_must_stay_inside_the_repository() {
        for good in [
            "data/train-00000-of-00001.parquet",
            "README.md",
            "a/b/c.jsonl",
        ] {
            assert!(inside_repository(good), "{good}");
        }
        for bad in [
            "",
            "/etc/passwd",
            "data/../../x",
            "./a",
            "a//b",
            "a\\b",
            "..",
        ] {
            assert!(!inside_repository(bad), "{bad}");
        }
    }

    #[test]
    fn a_download_that_would_not_fit_is_refused_naming_the_claims_size() {
        const GIB: u64 = 1 << 30;
        let (problem, more) = space_shortfall(13 * GIB + GIB / 2, GIB - GIB / 10).expect("too big");
        // 13.5 GiB and its 1 % spare, less the 0.9 GiB free.
        assert_eq!(
            more,
            13 * GIB + GIB / 2 + (13 * GIB + GIB / 2) / 100 - (GIB - GIB / 10)
        );
        assert!(
            problem.contains("needs 13.50 GiB more")
                && problem.contains("has 0.90 GiB free")
                && problem.contains("spec.checkpoints.size (at least 13Gi more"),
            "{problem}"
        );
        assert_eq!(space_shortfall(GIB, 2 * GIB), None);
        // The 64 MiB spare: a download of exactly the free space is refused.
        assert!(space_shortfall(GIB, GIB).is_some());
        check_space(&std::env::temp_dir(), &[("nothing-yet", Some(1))]).expect("1 byte fits");
    }

    #[test]
    fn urls_encode_revisions_as_one_segment() {
        let hub = Hub::new(
            RepoKind::Model,
            "https://huggingface.co/",
            "meta-llama/Llama-3.2-1B",
            "refs/pr/1",
            Some(" ".into()),
            Retry::default(),
        )
        .expect("valid");
        assert_eq!(
            hub.listing_url(),
            "https://huggingface.co/api/models/meta-llama/Llama-3.2-1B/revision/refs%2Fpr%2F1?blobs=true"
        );
        assert_eq!(
            hub.file_url("abc", "model-00001-of-00002.safetensors"),
            "https://huggingface.co/meta-llama/Llama-3.2-1B/resolve/abc/model-00001-of-00002.safetensors"
        );
        assert!(hub.token.is_none(), "a blank token is no token");
        let data = Hub::new(
            RepoKind::Dataset,
            "https://huggingface.co",
            "stanfordnlp/imdb",
            "main",
            None,
            Retry::default(),
        )
        .expect("valid");
        assert_eq!(
            data.listing_url(),
            "https://huggingface.co/api/datasets/stanfordnlp/imdb/revision/main?blobs=true"
        );
        assert_eq!(
            data.file_url("abc", "plain_text/train.jsonl"),
            "https://huggingface.co/datasets/stanfordnlp/imdb/resolve/abc/plain_text/train.jsonl"
        );
        let hub = Hub::new(
            RepoKind::Model,
            "http://m",
            "a/b",
            "main",
            Some("hf_secret".into()),
            Retry::default(),
        )
        .expect("valid");
        assert!(!format!("{hub:?}").contains("hf_secret"), "{hub:?}");
    }

    #[test]
    fn bad_repository_ids_and_endpoints_name_the_field() {
        let new =
            |kind, endpoint, repo| Hub::new(kind, endpoint, repo, "main", None, Retry::default());
        for repo in ["", "a/b/c", "../x", "a b", "a/"] {
            let e = new(RepoKind::Model, "https://hf.co", repo).expect_err(repo);
            assert!(
                e.to_string()
                    .starts_with("model.pretrained.huggingFace.repo"),
                "{e}"
            );
        }
        let e = new(RepoKind::Model, "ftp://hf.co", "a/b").expect_err("ftp");
        assert!(
            e.to_string()
                .starts_with("model.pretrained.huggingFace.endpoint"),
            "{e}"
        );
        let e = new(RepoKind::Dataset, "ftp://hf.co", "a/b").expect_err("ftp");
        assert!(
            e.to_string().starts_with("data.huggingFace.endpoint"),
            "{e}"
        );
    }

    #[test]
    fn listings_give_the_commit_and_sizes_where_known() {
        let l = parse_listing(
            r#"{"sha":"c0ffee","siblings":[{"rfilename":"config.json"},
                {"rfilename":"model.safetensors","size":10,"lfs":{"size":10}},
                {"rfilename":"big.safetensors","lfs":{"size":7}}]}"#,
        )
        .expect("listing");
        assert_eq!(l.commit.as_deref(), Some("c0ffee"));
        assert_eq!(l.files["config.json"], None);
        assert_eq!(l.files["model.safetensors"], Some(10));
        assert_eq!(l.files["big.safetensors"], Some(7));
        assert!(parse_listing("{}").is_err());
    }

    #[test]
    fn origins_keep_scheme_host_and_port() {
        assert_eq!(origin("http://127.0.0.1:9/a/b?c"), "http://127.0.0.1:9");
        assert_eq!(origin("https://hf.co"), "https://hf.co");
    }

    #[test]
    fn content_ranges_parse() {
        let mut h = HeaderMap::new();
        h.insert(
            "content-range",
            ureq::http::HeaderValue::from_static("bytes 100-199/200"),
        );
        assert_eq!(content_range(&h), Some((100, Some(200))));
        h.insert(
            "content-range",
            ureq::http::HeaderValue::from_static("bytes 5-9/*"),
        );
        assert_eq!(content_range(&h), Some((5, None)));
    }
}
