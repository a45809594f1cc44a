//! Checkpoints on the job's volume: model + optimizer + step, written so that
//! a crash at any moment leaves the last good checkpoint intact.
//!
//! Layout under the checkpoint directory:
//!
//! ```text
//! step-000000000050/        one complete checkpoint
//!   model.bpk               burnpack: parameters with their ParamIds
//!   optimizer.bpk           burnpack: optimizer state keyed by those ParamIds
//!   meta.json               written last: step, model shape, sizes and CRC-32 of both files
//! .tmp-step-000000000060-<pid>/   a checkpoint being written (ignored, removed on start)
//! ```
//!
//! A checkpoint is written into a temporary directory, every file and the
//! directory are fsynced, and the directory is renamed into place (atomic on
//! POSIX), then the parent is fsynced. A reader accepts a directory only if
//! `meta.json` parses and both files have the recorded size and CRC, so a torn
//! or half-copied checkpoint is skipped and the previous one is used.
//!
//! Nothing in a checkpoint depends on micro-batch or accumulation, and the
//! data of step k is fixed by (seed, k), so an attempt with other settings
//! resumes the same run.

use std::fs::{self, File};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::optim::ModuleOptimizer;
use burn::store::ModuleRecord;
use headroom_planner::{Settings, TransformerShape};
use serde::{Deserialize, Serialize};

use crate::model::TransformerLm;

const MODEL_FILE: &str = "model.bpk";
const OPTIMIZER_FILE: &str = "optimizer.bpk";
const META_FILE: &str = "meta.json";
const PREFIX: &str = "step-";
const TMP_PREFIX: &str = ".tmp-";
/// Complete checkpoints kept; older ones are removed after a successful save.
pub const KEEP: usize = 2;

/// `meta.json`: what a checkpoint holds and how to verify it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CheckpointMeta {
    pub format: u32,
    /// Optimizer steps completed when it was taken.
    pub step: u64,
    /// Mean loss of the last step before it.
    pub loss: Option<f64>,
    pub seed: u64,
    pub attempt: u32,
    pub shape: TransformerShape,
    pub layer_start: u32,
    pub layer_end: u32,
    /// Settings of the attempt that wrote it (informational: resuming does not need them).
    pub settings: Settings,
    pub files: Vec<FileDigest>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FileDigest {
    pub name: String,
    pub bytes: u64,
    pub crc32: u32,
}

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("checkpoint I/O at {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("checkpoint record at {path}: {message}")]
    Record { path: PathBuf, message: String },
    #[error("checkpoint {path} is invalid: {reason}")]
    Invalid { path: PathBuf, reason: String },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn record_error(path: &Path, e: impl std::fmt::Display) -> CheckpointError {
    CheckpointError::Record {
        path: path.to_path_buf(),
        message: e.to_string(),
    }
}

/// The directory name of the checkpoint at `step`.
pub fn dir_name(step: u64) -> String {
    format!("{PREFIX}{step:012}")
}

/// Writes a checkpoint of `model` and `optimizer` at `meta.step` under `root`
/// atomically, then prunes all but the newest [`KEEP`]. Returns its directory.
pub fn save(
    root: &Path,
    model: &TransformerLm,
    optimizer: &ModuleOptimizer,
    mut meta: CheckpointMeta,
) -> Result<PathBuf, CheckpointError> {
    fs::create_dir_all(root).map_err(io(root))?;
    let name = dir_name(meta.step);
    let tmp = root.join(format!("{TMP_PREFIX}{name}-{}", std::process::id()));
    if tmp.exists() {
        fs::remove_dir_all(&tmp).map_err(io(&tmp))?;
    }
    fs::create_dir(&tmp).map_err(io(&tmp))?;

    // One record at a time: the serialised copy of the weights is dropped
    // before the optimizer state's is made.
    let model_path = tmp.join(MODEL_FILE);
    model
        .clone()
        .into_record()
        .save(&model_path)
        .map_err(|e| record_error(&model_path, e))?;
    let optimizer_path = tmp.join(OPTIMIZER_FILE);
    optimizer
        .save(&optimizer_path)
        .map_err(|e| record_error(&optimizer_path, e))?;

    meta.format = 1;
    meta.files = vec![digest(&model_path)?, digest(&optimizer_path)?];
    let meta_path = tmp.join(META_FILE);
    let json = serde_json::to_vec_pretty(&meta).map_err(|e| record_error(&meta_path, e))?;
    let mut file = File::create(&meta_path).map_err(io(&meta_path))?;
    file.write_all(&json).map_err(io(&meta_path))?;
    file.sync_all().map_err(io(&meta_path))?;
    drop(file);
    for path in [&model_path, &optimizer_path] {
        File::open(path)
            .and_then(|f| f.sync_all())
            .map_err(io(path))?;
    }
    sync_dir(&tmp)?;

    let done = root.join(&name);
    if done.exists() {
        // Same step written by an earlier attempt: replace it (the new one is complete).
        fs::remove_dir_all(&done).map_err(io(&done))?;
    }
    fs::rename(&tmp, &done).map_err(io(&done))?;
    sync_dir(root)?;
    prune(root, KEEP)?;
    Ok(done)
}

fn digest(path: &Path) -> Result<FileDigest, CheckpointError> {
    let mut file = File::open(path).map_err(io(path))?;
    let mut hasher = crc32fast::Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut bytes = 0u64;
    loop {
        let n = file.read(&mut buf).map_err(io(path))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        bytes += n as u64;
    }
    Ok(FileDigest {
        name: path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        bytes,
        crc32: hasher.finalize(),
    })
}

fn sync_dir(dir: &Path) -> Result<(), CheckpointError> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(io(dir))
}

/// Complete-looking checkpoint directories under `root`, newest first.
fn candidates(root: &Path) -> Result<Vec<(u64, PathBuf)>, CheckpointError> {
    let entries = match fs::read_dir(root) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(vec![]),
        Err(e) => return Err(io(root)(e)),
    };
    let mut found = Vec::new();
    for entry in entries {
        let entry = entry.map_err(io(root))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if let Some(step) = name
            .strip_prefix(PREFIX)
            .and_then(|s| s.parse::<u64>().ok())
        {
            found.push((step, entry.path()));
        }
    }
    found.sort_by_key(|(step, _)| std::cmp::Reverse(*step));
    Ok(found)
}

/// Reads and verifies one checkpoint's `meta.json` and files.
pub fn verify(dir: &Path) -> Result<CheckpointMeta, CheckpointError> {
    let invalid = |reason: String| CheckpointError::Invalid {
        path: dir.to_path_buf(),
        reason,
    };
    let meta_path = dir.join(META_FILE);
    let json = fs::read(&meta_path).map_err(|e| invalid(format!("{META_FILE}: {e}")))?;
    let meta: CheckpointMeta =
        serde_json::from_slice(&json).map_err(|e| invalid(format!("{META_FILE}: {e}")))?;
    for expected in &meta.files {
        let actual = digest(&dir.join(&expected.name))
            .map_err(|e| invalid(format!("{}: {e}", expected.name)))?;
        if actual.bytes != expected.bytes || actual.crc32 != expected.crc32 {
            return Err(invalid(format!(
                "{}: {} bytes with CRC {:08x}, expected {} bytes with CRC {:08x}",
                expected.name, actual.bytes, actual.crc32, expected.bytes, expected.crc32
            )));
        }
    }
    if ![MODEL_FILE, OPTIMIZER_FILE]
        .iter()
        .all(|f| meta.files.iter().any(|d| d.name == *f))
    {
        return Err(invalid(
            "meta.json does not list model and optimizer".into(),
        ));
    }
    Ok(meta)
}

/// A checkpoint found on start, loaded.
pub struct Restored {
    pub model: TransformerLm,
    pub optimizer: ModuleOptimizer,
    pub found: Found,
}

/// Where a resumed run came from.
#[derive(Clone, Debug, PartialEq)]
pub struct Found {
    pub meta: CheckpointMeta,
    pub dir: PathBuf,
    /// Newer checkpoint directories that failed verification, with why.
    pub skipped: Vec<String>,
}

impl std::fmt::Debug for Restored {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Restored")
            .field("found", &self.found)
            .finish_non_exhaustive()
    }
}

/// Loads the newest checkpoint under `root` that verifies and fits `model`'s
/// shape into `model` and `optimizer`. `Ok(None)` when there is none (a fresh
/// start); invalid ones are skipped and reported in [`Restored::skipped`].
pub fn restore_newest(
    root: &Path,
    shape: &TransformerShape,
    model: TransformerLm,
    optimizer: ModuleOptimizer,
) -> Result<Option<Restored>, CheckpointError> {
    remove_stale_temporaries(root)?;
    let mut skipped = Vec::new();
    for (_, dir) in candidates(root)? {
        let meta = match verify(&dir) {
            Ok(meta) => meta,
            Err(e) => {
                skipped.push(e.to_string());
                continue;
            }
        };
        if &meta.shape != shape {
            skipped.push(format!(
                "{}: written for another model shape ({:?})",
                dir.display(),
                meta.shape
            ));
            continue;
        }
        let model_path = dir.join(MODEL_FILE);
        let record = match ModuleRecord::load(&model_path) {
            Ok(r) => r.cast_to_module_dtype(),
            Err(e) => {
                skipped.push(record_error(&model_path, e).to_string());
                continue;
            }
        };
        let model = match model.clone().try_load_record(record) {
            Ok(m) => m,
            Err(e) => {
                skipped.push(record_error(&model_path, e).to_string());
                continue;
            }
        };
        let optimizer_path = dir.join(OPTIMIZER_FILE);
        let optimizer = match optimizer.clone().load(&optimizer_path) {
            Ok(o) => o,
            Err(e) => {
                skipped.push(record_error(&optimizer_path, e).to_string());
                continue;
            }
        };
        return Ok(Some(Restored {
            model,
            optimizer,
            found: Found { meta, dir, skipped },
        }));
    }
    Ok(None)
}

/// Removes half-written checkpoints left by a crash.
fn remove_stale_temporaries(root: &Path) -> Result<(), CheckpointError> {
    let entries = match fs::read_dir(root) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io(root)(e)),
    };
    for entry in entries.flatten() {
        if entry.file_name().to_string_lossy().starts_with(TMP_PREFIX) {
            let path = entry.path();
            fs::remove_dir_all(&path).map_err(io(&path))?;
        }
    }
    Ok(())
}

/// Keeps the newest `keep` checkpoints.
fn prune(root: &Path, keep: usize) -> Result<(), CheckpointError> {
    for (_, dir) in candidates(root)?.into_iter().skip(keep) {
        fs::remove_dir_all(&dir).map_err(io(&dir))?;
    }
    Ok(())
}
