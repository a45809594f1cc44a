//! The initializer: the worker binary started with `HEADROOM_INITIALIZE`
//! (an [`InitializerAssignment`] as JSON) instead of a plan. It runs once
//! before a fine-tuning job is planned:
//!
//! 1. **fetch** ([`hub`]) — for a Hugging Face source, download the files
//!    training needs into `model_dir`, resumably, skipping what is already
//!    there (a retried initializer downloads only what is missing);
//! 2. **inspect** ([`inspect`]) — check the checkpoint's safetensors headers
//!    against its config.json, and the data against the tokenizer, the way
//!    training will read them;
//! 3. **report** — write what it found, an [`InitializerReport`], as JSON to
//!    the termination-message path and exit 0, so the operator can plan from
//!    the real checkpoint without reading the volume itself.
//!
//! While it runs in a pod (`POD_NAME` and the operator's worker API set) it
//! reports like a worker, through the worker API: its own entry of
//! `status.workers` (attempt 0), with its memory and, while it downloads,
//! the download's progress.
//!
//! On failure it writes an ordinary `TerminationMessage` instead: outcome
//! `InvalidPlan` when the input is wrong (no such repository, a token
//! missing or refused, shapes that disagree, unusable data) and retrying is
//! pointless, `Failed` when the network or the volume may heal (the pod's
//! retry then resumes the download where it stopped), `DiskFull` when the
//! download would not fit on the claim (with the bytes more it needs, which
//! the operator may grow an expandable claim by). Each reason names the
//! file, tensor or URL at fault.

pub mod hub;
pub mod inspect;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use headroom_api::{
    DataSource, HF_DATASET_TOKEN_FILE_ENV, HF_TOKEN_FILE_ENV, INITIALIZE_JSON_ENV,
    InitializerAssignment, InitializerReport, ModelSource, POD_NAME_ENV, TELEMETRY_INTERVAL_ENV,
    TERMINATION_MESSAGE_PATH, WorkerOutcome,
};
use headroom_planner::LlamaShape;

use crate::env::TERMINATION_MESSAGE_PATH_ENV;
use crate::exit::Exit;
use crate::memory_probe::MemoryProbe;
use crate::report::{
    DEFAULT_INTERVAL, DEFAULT_SAMPLE_EVERY, Progress, Reporter, TelemetrySink, WorkerApiSink,
    WorkerIdentity, WritePolicy,
};
use crate::text::{DataLocation, Format};
use crate::worker_api::WorkerApi;
use crate::{TERMINATION_MESSAGE_LIMIT, write_termination_message};

pub use hub::Retry;

/// The initializer's environment: present only when `HEADROOM_INITIALIZE` is set.
///
/// The hub tokens are not in the environment: the operator mounts each one
/// key of the job's Secret as a read-only file into the initializer pod
/// alone, and the environment names the files' paths, which [`run`] reads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InitializerEnv {
    /// `HEADROOM_INITIALIZE`: the assignment, not yet parsed (a malformed
    /// one is reported through the termination message like any bad input).
    pub assignment: String,
    /// `HEADROOM_HF_TOKEN_FILE`, when set and not blank: the file holding
    /// the model repository's token (`model.pretrained.huggingFace.tokenSecret`).
    pub token_file: Option<PathBuf>,
    /// `HEADROOM_HF_DATASET_TOKEN_FILE`, when set and not blank: the file
    /// holding the dataset's (`data.huggingFace.tokenSecret`).
    pub data_token_file: Option<PathBuf>,
    /// `HEADROOM_TERMINATION_MESSAGE_PATH`, else `/dev/termination-log`.
    pub termination_message_path: PathBuf,
    /// `POD_NAME`: set in a pod, where the initializer reports its progress
    /// into the job's status under this name.
    pub pod_name: Option<String>,
    /// `HEADROOM_TELEMETRY_INTERVAL_SECONDS`: the least time between status writes.
    pub telemetry_interval: Duration,
}

impl InitializerEnv {
    /// Reads the process environment; `None` when this process is not an
    /// initializer.
    pub fn from_env() -> Option<Self> {
        Self::from_lookup(|key| std::env::var(key).ok())
    }

    /// Reads the environment through `env` (tests pass a map).
    pub fn from_lookup(env: impl Fn(&str) -> Option<String>) -> Option<Self> {
        let assignment = env(INITIALIZE_JSON_ENV)?;
        Some(InitializerEnv {
            assignment,
            token_file: env(HF_TOKEN_FILE_ENV)
                .filter(|p| !p.trim().is_empty())
                .map(PathBuf::from),
            data_token_file: env(HF_DATASET_TOKEN_FILE_ENV)
                .filter(|p| !p.trim().is_empty())
                .map(PathBuf::from),
            termination_message_path: env(TERMINATION_MESSAGE_PATH_ENV)
                .map_or_else(|| PathBuf::from(TERMINATION_MESSAGE_PATH), PathBuf::from),
            pod_name: env(POD_NAME_ENV).filter(|p| !p.trim().is_empty()),
            telemetry_interval: env(TELEMETRY_INTERVAL_ENV).map_or(DEFAULT_INTERVAL, |v| {
                match v.trim().parse::<f64>() {
                    Ok(s) if s.is_finite() && s >= 0.0 => Duration::from_secs_f64(s),
                    // The operator sets it; a bad value costs only the pace of
                    // progress reports, not the initialization.
                    _ => {
                        tracing::warn!(
                            "{TELEMETRY_INTERVAL_ENV}={v:?} is not a number of seconds ≥ 0; using {DEFAULT_INTERVAL:?}"
                        );
                        DEFAULT_INTERVAL
                    }
                }
            }),
        })
    }
}

/// Why the initializer stopped; the variant decides the outcome.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum InitError {
    /// The input is wrong (spec, repository, token, checkpoint or data):
    /// `InvalidPlan`, since the same input fails the same way again.
    #[error("{0}")]
    Invalid(String),
    /// The network failed (after this run's own retries): `Failed`; the
    /// next try resumes.
    #[error("{0}")]
    Network(String),
    /// The volume could not be read or written: `Failed`.
    #[error("{0}")]
    Io(String),
    /// The download would not fit on the job's checkpoint claim, by
    /// `more_bytes`: `DiskFull`, with those bytes as the termination
    /// message's `requestedBytes` (the operator grows an expandable claim
    /// by them and runs the initializer again).
    #[error("{message}")]
    NoSpace { message: String, more_bytes: u64 },
}

impl InitError {
    pub fn outcome(&self) -> WorkerOutcome {
        match self {
            InitError::Invalid(_) => WorkerOutcome::InvalidPlan,
            InitError::Network(_) | InitError::Io(_) => WorkerOutcome::Failed,
            InitError::NoSpace { .. } => WorkerOutcome::DiskFull,
        }
    }
}

/// The hub tokens of a job, each from its own Secret.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Tokens {
    /// For `model.pretrained.huggingFace`.
    pub model: Option<String>,
    /// For `data.huggingFace`.
    pub data: Option<String>,
}

impl Tokens {
    /// Reads the token files `env` names. A file named but unreadable is
    /// the deployment's fault, not the network's: `Invalid`, naming the
    /// spec field whose Secret it is (never the token). A blank file is no
    /// token.
    pub fn read(env: &InitializerEnv) -> Result<Self, InitError> {
        let read = |path: &Option<PathBuf>, field: &str| -> Result<Option<String>, InitError> {
            let Some(path) = path else { return Ok(None) };
            let text = std::fs::read_to_string(path).map_err(|e| {
                InitError::Invalid(format!(
                    "cannot read the token of {field} at {}: {e}",
                    path.display()
                ))
            })?;
            let token = text.trim();
            Ok((!token.is_empty()).then(|| token.to_string()))
        };
        Ok(Tokens {
            model: read(&env.token_file, "model.pretrained.huggingFace.tokenSecret")?,
            data: read(&env.data_token_file, "data.huggingFace.tokenSecret")?,
        })
    }
}

impl std::fmt::Debug for Tokens {
    // Never the tokens.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokens")
            .field("model", &self.model.as_ref().map(|_| "(set)"))
            .field("data", &self.data.as_ref().map(|_| "(set)"))
            .finish()
    }
}

/// The commit `revision` of the hub model `repo` names now: the revision
/// itself when it is a commit, otherwise what the hub's listing says (one
/// request, no file). A shared model cache filled from a branch is checked
/// with it; a hub that cannot be reached leaves the cache in use (`None`,
/// with a warning) rather than stop a job whose checkpoint is already here.
fn current_commit(
    endpoint: &str,
    repo: &str,
    revision: &str,
    token: Option<String>,
    retry: Retry,
) -> Result<Option<String>, InitError> {
    if headroom_api::is_commit(revision) {
        return Ok(Some(revision.to_string()));
    }
    let hub = hub::Hub::new(hub::RepoKind::Model, endpoint, repo, revision, token, retry)?;
    match hub.list() {
        Ok(listing) => {
            tracing::info!(
                repo = %repo,
                revision = %revision,
                commit = listing.commit.as_deref().unwrap_or("(not given)"),
                "the shared model cache's revision names this commit now"
            );
            Ok(listing.commit)
        }
        Err(e @ (InitError::Network(_) | InitError::Io(_))) => {
            tracing::warn!(
                "cannot ask {endpoint} which commit {repo}@{revision} names now ({e}); reading the shared model cache as it is"
            );
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// Fetches (for a Hugging Face source), inspects and describes the
/// checkpoint and the data of `assignment`.
pub fn initialize(
    assignment: &InitializerAssignment,
    tokens: Tokens,
    retry: Retry,
    observer: Option<hub::ProgressObserver>,
) -> Result<InitializerReport, InitError> {
    let sequence_length = assignment.sequence_length;
    if sequence_length == 0 {
        return Err(InitError::Invalid(
            "sequenceLength must be at least 1".into(),
        ));
    }
    let dir = Path::new(&assignment.model_dir);
    let (downloaded_bytes, commit) = match &assignment.model {
        ModelSource::HuggingFace {
            repo,
            revision,
            endpoint,
        } => {
            let mut hub = hub::Hub::new(
                hub::RepoKind::Model,
                endpoint,
                repo,
                revision,
                tokens.model,
                retry,
            )?;
            if let Some(observer) = &observer {
                hub = hub.observed(observer.clone());
            }
            // Refuse a model Headroom cannot train before its weights are downloaded.
            let check_config = |config: &Path| -> Result<(), InitError> {
                let text = std::fs::read_to_string(config)
                    .map_err(|e| InitError::Io(format!("{}: {e}", config.display())))?;
                LlamaShape::from_hf_config(&text, sequence_length)
                    .map(|_| ())
                    .map_err(|e| InitError::Invalid(format!("{repo} ({revision}): {e}")))
            };
            let fetched = hub.fetch(dir, &check_config)?;
            tracing::info!(
                repo = %repo,
                commit = fetched.commit.as_deref().unwrap_or(revision),
                files = fetched.files.len(),
                downloaded_bytes = fetched.downloaded_bytes,
                dir = %dir.display(),
                "checkpoint fetched"
            );
            (fetched.downloaded_bytes, fetched.commit)
        }
        ModelSource::Volume => match &assignment.cache_of {
            // A shared model cache: which commit its revision names now.
            Some(ModelSource::HuggingFace {
                repo,
                revision,
                endpoint,
            }) => (
                0,
                current_commit(endpoint, repo, revision, tokens.model, retry)?,
            ),
            _ => (0, None),
        },
    };
    let format = Format::from(&assignment.data_format);
    let data_bytes = match &assignment.data {
        DataSource::HuggingFace {
            repo,
            revision,
            endpoint,
            data_dir,
            files,
        } => {
            let mut hub = hub::Hub::new(
                hub::RepoKind::Dataset,
                endpoint,
                repo,
                revision,
                tokens.data,
                retry,
            )?;
            if let Some(observer) = &observer {
                hub = hub.observed(observer.clone());
            }
            let fetched = hub.fetch_data(Path::new(data_dir), files, &format)?;
            tracing::info!(
                repo = %repo,
                commit = fetched.commit.as_deref().unwrap_or(revision),
                files = fetched.files.len(),
                downloaded_bytes = fetched.downloaded_bytes,
                dir = %data_dir,
                "data fetched"
            );
            fetched.downloaded_bytes
        }
        DataSource::Volume => 0,
    };
    let downloaded_bytes = downloaded_bytes + data_bytes;
    let model = inspect::inspect_model(dir, sequence_length)?;
    tracing::info!(
        parameters = model.parameters,
        bytes = model.bytes,
        dtype = %model.dtype,
        "checkpoint checked"
    );
    let data_location = DataLocation::new(&assignment.data_file, assignment.data_split.as_ref());
    let data = inspect::inspect_data(
        dir,
        data_location.clone(),
        &assignment.data_format,
        assignment.train_on,
        assignment.packing,
        sequence_length,
        model.shape.vocabulary,
    )?;
    tracing::info!(
        documents = data.documents,
        tokens = data.tokens,
        samples = data.samples,
        masked_per_mille = data.masked_per_mille,
        longer_than_sample = data.longer_than_sample,
        data = %data_location,
        "data checked"
    );
    Ok(InitializerReport {
        model,
        data,
        downloaded_bytes,
        commit,
    })
}

/// The status reporter of an initializer pod: its own entry of
/// `status.workers` (attempt 0, no layers), through the worker API. `None`
/// without one (local runs): progress is then only logged.
fn start_reporter(
    pod: &str,
    assignment: &InitializerAssignment,
    interval: Duration,
) -> Option<Reporter> {
    let identity = WorkerIdentity {
        name: pod.to_string(),
        job: assignment.job.clone(),
        namespace: assignment.namespace.clone(),
        attempt: 0,
        stage: 0,
        layer_start: 0,
        layer_end: 0,
    };
    let api = WorkerApi::from_env()
        .inspect_err(|e| tracing::error!(%e, "progress is only logged"))
        .ok()
        .flatten();
    let sink = WorkerApiSink::connect(api.as_ref(), &identity)?;
    Some(Reporter::start(
        identity,
        MemoryProbe::for_this_process(None),
        Some(Box::new(sink) as Box<dyn TelemetrySink>),
        DEFAULT_SAMPLE_EVERY,
        WritePolicy::new(interval),
    ))
}

/// Runs the initializer to its end and writes its termination message: the
/// report on success, a `TerminationMessage` otherwise (whose outcome gives
/// the exit code).
pub fn run(env: &InitializerEnv) -> Result<InitializerReport, Exit> {
    let result = serde_json::from_str::<InitializerAssignment>(&env.assignment)
        .map_err(|e| {
            InitError::Invalid(format!(
                "{INITIALIZE_JSON_ENV} is not an initializer assignment: {e}"
            ))
        })
        .and_then(|assignment| {
            tracing::info!(
                job = %assignment.job,
                namespace = %assignment.namespace,
                model_dir = %assignment.model_dir,
                "initializing"
            );
            let reporter = env
                .pod_name
                .as_ref()
                .and_then(|pod| start_reporter(pod, &assignment, env.telemetry_interval));
            let observer = reporter.as_ref().map(|r| {
                let update = r.updater();
                Arc::new(move |p: &headroom_api::DownloadProgress| {
                    update(Progress {
                        download: Some(p.clone()),
                        ..Progress::default()
                    });
                }) as hub::ProgressObserver
            });
            let result = Tokens::read(env)
                .and_then(|tokens| initialize(&assignment, tokens, Retry::default(), observer));
            // A last write, with the download as it ended.
            drop(reporter);
            result
        });
    let path = &env.termination_message_path;
    match result {
        Ok(report) => {
            let written = serde_json::to_string(&report)
                .map_err(std::io::Error::other)
                .and_then(|json| {
                    if json.len() > TERMINATION_MESSAGE_LIMIT {
                        tracing::warn!(
                            bytes = json.len(),
                            "the report is longer than Kubernetes keeps"
                        );
                    }
                    std::fs::write(path, json)
                });
            if let Err(e) = written {
                // The report is what the operator plans from: without it the
                // run is of no use, and a retry (which downloads nothing
                // again) is cheap.
                let exit = Exit::new(
                    WorkerOutcome::Failed,
                    format!("cannot write the report to {}: {e}", path.display()),
                );
                tracing::error!(code = exit.code(), reason = %exit.message.reason, "exiting");
                return Err(exit);
            }
            tracing::info!(downloaded_bytes = report.downloaded_bytes, "initialized");
            Ok(report)
        }
        Err(e) => {
            let mut exit = Exit::new(e.outcome(), e.to_string());
            if let InitError::NoSpace { more_bytes, .. } = &e {
                exit.message.requested_bytes = Some(*more_bytes);
            }
            if let Err(e) = write_termination_message(path, &exit.message) {
                tracing::warn!(
                    "cannot write the termination message to {}: {e}",
                    path.display()
                );
            }
            tracing::error!(code = exit.code(), outcome = %exit.message.outcome, reason = %exit.message.reason, "exiting");
            Err(exit)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_an_initialize_assignment_makes_an_initializer() {
        assert!(InitializerEnv::from_lookup(|_| None).is_none());
        let env = InitializerEnv::from_lookup(|k| match k {
            INITIALIZE_JSON_ENV => Some("{}".into()),
            HF_TOKEN_FILE_ENV => Some("/var/run/secrets/headroom.dev/hf-token/token".into()),
            // A token in the environment is not read.
            "HF_TOKEN" => Some("hf_secret".into()),
            _ => None,
        })
        .expect("initializer");
        assert_eq!(
            env.token_file,
            Some(PathBuf::from(
                "/var/run/secrets/headroom.dev/hf-token/token"
            ))
        );
        assert_eq!(env.data_token_file, None);
        assert_eq!(
            env.termination_message_path,
            PathBuf::from(TERMINATION_MESSAGE_PATH)
        );
        assert!(!format!("{env:?}").contains("hf_secret"));
    }

    /// Each token comes from its file (trimmed; blank is none); a file
    /// named but missing is refused naming the field whose Secret it is.
    #[test]
    fn the_tokens_are_read_from_their_files() {
        let dir = std::env::temp_dir().join(format!("headroom-tokens-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("tmp");
        std::fs::write(dir.join("model"), "hf_model_token\n").expect("write");
        std::fs::write(dir.join("data"), "  \n").expect("write");
        let mut env = InitializerEnv {
            assignment: "{}".into(),
            token_file: Some(dir.join("model")),
            data_token_file: Some(dir.join("data")),
            termination_message_path: dir.join("termination-log"),
            pod_name: None,
            telemetry_interval: DEFAULT_INTERVAL,
        };
        let tokens = Tokens::read(&env).expect("read");
        assert_eq!(tokens.model.as_deref(), Some("hf_model_token"));
        assert_eq!(tokens.data, None, "a blank file is no token");
        assert!(!format!("{tokens:?}").contains("hf_model_token"));

        env.data_token_file = Some(dir.join("missing"));
        let err = Tokens::read(&env).expect_err("missing");
        assert!(
            matches!(&err, InitError::Invalid(m) if m.contains("data.huggingFace.tokenSecret")),
            "{err:?}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_malformed_assignment_is_an_invalid_plan() {
        let dir = std::env::temp_dir().join(format!("headroom-init-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("tmp");
        let path = dir.join("termination-log");
        let exit = run(&InitializerEnv {
            assignment: "{\"job\": 1}".into(),
            token_file: None,
            data_token_file: None,
            termination_message_path: path.clone(),
            pod_name: None,
            telemetry_interval: DEFAULT_INTERVAL,
        })
        .expect_err("malformed");
        assert_eq!(exit.message.outcome, WorkerOutcome::InvalidPlan);
        let written = std::fs::read_to_string(&path).expect("written");
        assert!(written.contains(INITIALIZE_JSON_ENV), "{written}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
