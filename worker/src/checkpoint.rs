//! Checkpoints on the job's volume: every stage's parameters, optimizer
//! state and step, written so that a crash at any moment leaves the last good
//! checkpoint intact, and laid out by model part so that a retry with another
//! pipeline split resumes from them.
//!
//! Layout under the checkpoint directory (shared by all stages and attempts):
//!
//! ```text
//! step-000000000050/                one optimizer step
//!   stage-0000-0002/                written by the stage holding blocks 0..2
//!     token.bpk position.bpk        the parts it holds (burnpack, with ParamIds)
//!     block-0000.bpk block-0001.bpk
//!     optimizer.bpk                 its optimizer state, keyed by those ParamIds
//!     meta.json                     written last: step, shape, parts, sizes and CRC-32s
//!   stage-0002-0004/
//!     block-0002.bpk block-0003.bpk head.bpk optimizer.bpk meta.json
//!   .tmp-stage-0002-0004-<pod>-<pid>/ a stage directory being written (ignored)
//! ```
//!
//! A stage writes its directory under a temporary name, fsyncs every file and
//! the directory, and renames it into place (atomic on POSIX). A step is
//! *complete* when its verified stage directories together hold every part
//! of the model; a resuming stage takes the newest complete step, so all
//! stages of an attempt resume from the same step (they also check that in
//! their handshake), and a stage whose neighbour died before writing step N
//! goes back to step N − k with everyone else. Each part is loaded from
//! whichever stage directory holds it, and the optimizer state from those
//! directories is merged and filtered to the parameters the stage now holds:
//! that is what lets the "more stages" rung of the retry ladder re-partition
//! the layers.
//!
//! Nothing in a checkpoint depends on micro-batch or accumulation, and the
//! data of step k is fixed by (seed, k), so an attempt with other settings
//! resumes the same run.
//!
//! **Data-parallel replicas.** The replicas of a stage hold the same
//! parameters and each its own shard of the optimizer state (ZeRO-1,
//! [`crate::data_parallel`]), so with d > 1 replica 0 writes the parts and
//! its shard and every other replica its shard alone, each in its own
//! directory named after the stage and the replica:
//!
//! ```text
//! step-000000000050/
//!   stage-0000-0004-r0000-of-0002/    replica 0: the parts, its optimizer.bpk, meta.json
//!   stage-0000-0004-r0001-of-0002/    replica 1: its optimizer.bpk, meta.json
//! ```
//!
//! A stage's directories count only when all d of them are there and
//! verify, so a step is complete when every shard of every stage is. On
//! resume the optimizer files of all shards are merged (each tensor's state
//! is in exactly one) and filtered to the tensors the resuming replica owns
//! under the attempt's d, which may differ from the writer's: a retry that
//! changes d resumes the same run. A plan without replicas writes exactly the
//! layout above, format 2; directories of d > 1 say format 3, which workers
//! that predate replicas refuse instead of resuming one shard's state.
//!
//! With LoRA adapters the base is frozen and is the Hugging Face checkpoint
//! the run started from, so a part file holds only that part's adapter
//! factors (an empty record for a part without adapters) and the optimizer
//! file only their state. A resuming stage loads its base from the original
//! checkpoint files, stores it in the attempt's base format (dense, int8 or
//! int4: what the retry ladder changes) and attaches the saved factors, so a
//! retry with a stricter base format continues the same adapters. A
//! checkpoint written with other adapters (rank, alpha, targets), or with
//! none, is not this run's and is skipped.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::{self, File};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::ModuleOptimizer;
use burn::store::ModuleRecord;
use burn::tensor::Tensor;
use headroom_planner::{LoraConfig, Settings};
use serde::{Deserialize, Serialize};

use crate::model::lora::adapter_ids;
use crate::model::{LmShape, Part, StageLayout, TransformerLm};

const OPTIMIZER_FILE: &str = "optimizer.bpk";
const META_FILE: &str = "meta.json";
const PREFIX: &str = "step-";
const STAGE_PREFIX: &str = "stage-";
const TMP_PREFIX: &str = ".tmp-";
/// Complete checkpoints kept; older steps are removed after a successful save.
pub const KEEP: usize = headroom_planner::disk::CHECKPOINTS_KEPT as usize;
/// A temporary stage directory untouched this long is a crashed writer's.
/// Writing a stage's files takes seconds to minutes; this is well above.
pub const STALE_TEMPORARY_AGE: std::time::Duration = std::time::Duration::from_secs(15 * 60);
/// `meta.json` format of a stage directory without replicas.
pub const FORMAT: u32 = 2;
/// `meta.json` format of one replica's directory (d > 1): it may hold no
/// parts and only part of the optimizer state.
pub const SHARDED_FORMAT: u32 = 3;

/// The optimizer-state shard a data-parallel replica keeps: replica
/// `replica` of `replicas`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    pub replica: u32,
    pub replicas: u32,
}

impl Shard {
    /// No replicas: one worker keeps all of its stage's state.
    pub const WHOLE: Shard = Shard {
        replica: 0,
        replicas: 1,
    };
}

fn one() -> u32 {
    1
}

/// `meta.json` of one stage directory: what it holds and how to verify it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CheckpointMeta {
    pub format: u32,
    /// Optimizer steps completed when it was taken.
    pub step: u64,
    /// Mean loss of the last step before it (the last stage knows it).
    pub loss: Option<f64>,
    pub seed: u64,
    pub attempt: u32,
    pub shape: LmShape,
    pub layer_start: u32,
    pub layer_end: u32,
    pub first: bool,
    pub last: bool,
    /// Settings of the attempt that wrote it (informational: resuming does not need them).
    pub settings: Settings,
    /// The adapters whose factors the part files hold (absent: every parameter).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adapters: Option<LoraConfig>,
    /// The data-parallel replica that wrote it (0 holds the parts) and the
    /// attempt's replicas; 0 of 1 in checkpoints that predate replicas.
    #[serde(default)]
    pub replica: u32,
    #[serde(default = "one")]
    pub replicas: u32,
    /// fp16's dynamic loss scale at this step (absent in other precisions).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<crate::optim::recipe::LossScale>,
    pub files: Vec<FileDigest>,
}

/// Whether checkpoints written with adapters `a` resume a run with `b`: the
/// same rank, alpha and targets, or neither has adapters. Dropout and the
/// base's block size do not change what the factors are.
pub fn same_adapters(a: Option<&LoraConfig>, b: Option<&LoraConfig>) -> bool {
    match (a, b) {
        (None, None) => true,
        (Some(a), Some(b)) => {
            let targets =
                |c: &LoraConfig| c.target_modules.iter().copied().collect::<BTreeSet<_>>();
            a.rank == b.rank && a.alpha == b.alpha && targets(a) == targets(b)
        }
        _ => false,
    }
}

impl CheckpointMeta {
    fn layout(&self) -> StageLayout {
        StageLayout {
            layers: self.layer_start..self.layer_end,
            first: self.first,
            last: self.last,
        }
    }

    /// The parts its directory holds: the stage's, or none for a replica other than 0.
    fn parts(&self) -> Vec<Part> {
        if self.replica == 0 {
            self.layout().parts(&self.shape)
        } else {
            vec![]
        }
    }

    /// The directories that together make this stage's checkpoint.
    fn group(&self) -> (u32, u32, bool, bool, u32) {
        (
            self.layer_start,
            self.layer_end,
            self.first,
            self.last,
            self.replicas.max(1),
        )
    }
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

fn stage_dir_name(layout: &StageLayout, replica: u32, replicas: u32) -> String {
    let stage = format!(
        "{STAGE_PREFIX}{:04}-{:04}",
        layout.layers.start, layout.layers.end
    );
    if replicas > 1 {
        format!("{stage}-r{replica:04}-of-{replicas:04}")
    } else {
        stage
    }
}

fn part_file(part: Part) -> String {
    format!("{}.bpk", part.file_stem())
}

/// Writes this stage's checkpoint at `meta.step` under `root` atomically
/// (with replicas, this replica's part of it: the parts from replica 0 only,
/// and its optimizer shard), then prunes steps older than the newest [`KEEP`]
/// complete ones. Returns the directory written.
pub fn save(
    root: &Path,
    model: &TransformerLm,
    optimizer: &ModuleOptimizer,
    mut meta: CheckpointMeta,
) -> Result<PathBuf, CheckpointError> {
    let layout = meta.layout();
    let step_dir = root.join(dir_name(meta.step));
    fs::create_dir_all(&step_dir).map_err(io(&step_dir))?;
    let name = stage_dir_name(&layout, meta.replica, meta.replicas);
    let tmp = step_dir.join(format!("{TMP_PREFIX}{name}-{}", writer_id()));
    if tmp.exists() {
        fs::remove_dir_all(&tmp).map_err(io(&tmp))?;
    }
    fs::create_dir(&tmp).map_err(io(&tmp))?;

    // One record at a time: each serialised copy is dropped before the next is made.
    let adapters = meta.adapters.is_some();
    let record = |m: &dyn RecordPart| m.record(adapters);
    let mut paths = Vec::new();
    for part in meta.parts() {
        let path = tmp.join(part_file(part));
        let saved = match part {
            // A host embedding is frozen: its adapters-only record is the
            // same (empty) file an on-device one writes.
            Part::Token => match (&model.token, &model.host_token) {
                (Some(m), _) => Some(record(m).save(&path)),
                (None, Some(host)) => Some(record(host.table()).save(&path)),
                (None, None) => None,
            },
            Part::Position => model.position.as_ref().map(|m| record(m).save(&path)),
            Part::Block(i) => model
                .blocks
                .get((i - layout.layers.start) as usize)
                .map(|b| record(b).save(&path)),
            Part::Head => model.head.as_ref().map(|m| record(m).save(&path)),
        };
        saved
            .ok_or_else(|| record_error(&path, format!("the stage has no {part:?}")))?
            .map_err(|e| record_error(&path, e))?;
        paths.push(path);
    }
    let optimizer_path = tmp.join(OPTIMIZER_FILE);
    optimizer
        .save(&optimizer_path)
        .map_err(|e| record_error(&optimizer_path, e))?;
    paths.push(optimizer_path);

    meta.format = if meta.replicas > 1 {
        SHARDED_FORMAT
    } else {
        FORMAT
    };
    meta.files = paths.iter().map(|p| digest(p)).collect::<Result<_, _>>()?;
    let meta_path = tmp.join(META_FILE);
    let json = serde_json::to_vec_pretty(&meta).map_err(|e| record_error(&meta_path, e))?;
    let mut file = File::create(&meta_path).map_err(io(&meta_path))?;
    file.write_all(&json).map_err(io(&meta_path))?;
    file.sync_all().map_err(io(&meta_path))?;
    drop(file);
    for path in &paths {
        File::open(path)
            .and_then(|f| f.sync_all())
            .map_err(io(path))?;
    }
    sync_dir(&tmp)?;

    let done = step_dir.join(&name);
    if done.exists() {
        // Same step written by an earlier attempt: replace it (the new one is complete).
        fs::remove_dir_all(&done).map_err(io(&done))?;
    }
    fs::rename(&tmp, &done).map_err(io(&done))?;
    sync_dir(&step_dir)?;
    sync_dir(root)?;
    prune(root, &meta.shape, meta.adapters.as_ref(), KEEP)?;
    Ok(done)
}

/// A part's record: all of it, or only its adapter factors (the rest is the
/// base, which is the pretrained checkpoint's).
trait RecordPart {
    fn record(&self, adapters_only: bool) -> ModuleRecord;
}

impl<M: Module> RecordPart for M {
    fn record(&self, adapters_only: bool) -> ModuleRecord {
        if adapters_only {
            let ids = adapter_ids(self);
            self.clone()
                .into_record_group(burn::module::ParamGroup::from_ids(ids))
        } else {
            self.clone().into_record()
        }
    }
}

/// Tells this process's temporaries from another pod's: the pod name (a
/// stage's hostname is `s<k>` in every attempt, so not that) and the pid,
/// which is often 1 in every container.
fn writer_id() -> String {
    let pod = std::env::var(headroom_api::POD_NAME_ENV).unwrap_or_default();
    let pid = std::process::id();
    if pod.is_empty() {
        pid.to_string()
    } else {
        format!("{pod}-{pid}")
    }
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

/// Subdirectories of `dir` whose names start with `prefix`, with the number after it, newest first.
fn numbered(dir: &Path, prefix: &str) -> Result<Vec<(u64, PathBuf)>, CheckpointError> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(vec![]),
        Err(e) => return Err(io(dir)(e)),
    };
    let mut found = Vec::new();
    for entry in entries {
        let entry = entry.map_err(io(dir))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if let Some(n) = name
            .strip_prefix(prefix)
            .and_then(|s| s.split('-').next())
            .and_then(|s| s.parse::<u64>().ok())
        {
            found.push((n, entry.path()));
        }
    }
    found.sort_by_key(|(n, _)| std::cmp::Reverse(*n));
    Ok(found)
}

/// Reads one stage directory's `meta.json`: its format and the files it
/// must list, without reading those files.
fn read_meta(dir: &Path) -> Result<CheckpointMeta, CheckpointError> {
    let invalid = |reason: String| CheckpointError::Invalid {
        path: dir.to_path_buf(),
        reason,
    };
    let meta_path = dir.join(META_FILE);
    let json = fs::read(&meta_path).map_err(|e| invalid(format!("{META_FILE}: {e}")))?;
    let meta: CheckpointMeta =
        serde_json::from_slice(&json).map_err(|e| invalid(format!("{META_FILE}: {e}")))?;
    if meta.format != FORMAT && meta.format != SHARDED_FORMAT {
        return Err(invalid(format!(
            "format {}, expected {FORMAT} or {SHARDED_FORMAT}",
            meta.format
        )));
    }
    if meta.replica >= meta.replicas.max(1) {
        return Err(invalid(format!(
            "replica {} of {}",
            meta.replica, meta.replicas
        )));
    }
    let listed = |name: &str| meta.files.iter().any(|d| d.name == name);
    if let Some(missing) = meta
        .parts()
        .into_iter()
        .map(part_file)
        .chain([OPTIMIZER_FILE.to_string()])
        .find(|f| !listed(f))
    {
        return Err(invalid(format!("meta.json does not list {missing}")));
    }
    Ok(meta)
}

/// Reads and verifies one stage directory's `meta.json` and files (sizes and CRCs).
pub fn verify(dir: &Path) -> Result<CheckpointMeta, CheckpointError> {
    let meta = read_meta(dir)?;
    for expected in &meta.files {
        let invalid = |reason: String| CheckpointError::Invalid {
            path: dir.to_path_buf(),
            reason,
        };
        let actual = digest(&dir.join(&expected.name))
            .map_err(|e| invalid(format!("{}: {e}", expected.name)))?;
        if actual.bytes != expected.bytes || actual.crc32 != expected.crc32 {
            return Err(invalid(format!(
                "{}: {} bytes with CRC {:08x}, expected {} bytes with CRC {:08x}",
                expected.name, actual.bytes, actual.crc32, expected.bytes, expected.crc32
            )));
        }
    }
    Ok(meta)
}

/// One step's verified stages, and which holds each part.
struct Step {
    dir: PathBuf,
    /// Stages whose every replica's directory is there: the directories in
    /// replica order (the first holds the parts; one without replicas).
    stages: Vec<Vec<(PathBuf, CheckpointMeta)>>,
    holder: BTreeMap<Part, usize>,
    skipped: Vec<String>,
}

impl Step {
    /// `check` is [`verify`] when loading, and the cheaper [`read_meta`]
    /// when pruning (which must not re-read every checkpoint on every save).
    fn read(
        dir: PathBuf,
        shape: &LmShape,
        adapters: Option<&LoraConfig>,
        check: fn(&Path) -> Result<CheckpointMeta, CheckpointError>,
    ) -> Result<Step, CheckpointError> {
        let mut groups: BTreeMap<_, BTreeMap<u32, (PathBuf, CheckpointMeta)>> = BTreeMap::new();
        let mut skipped = Vec::new();
        for (_, stage_dir) in numbered(&dir, STAGE_PREFIX)? {
            match check(&stage_dir) {
                Ok(meta) if !same_adapters(meta.adapters.as_ref(), adapters) => {
                    skipped.push(format!(
                        "{}: written with other adapters ({:?}, this run: {:?})",
                        stage_dir.display(),
                        meta.adapters,
                        adapters
                    ))
                }
                Ok(meta) if &meta.shape == shape => {
                    groups
                        .entry(meta.group())
                        .or_default()
                        .insert(meta.replica, (stage_dir, meta));
                }
                Ok(meta) => skipped.push(format!(
                    "{}: written for another model shape ({:?})",
                    stage_dir.display(),
                    meta.shape
                )),
                Err(e) => skipped.push(e.to_string()),
            }
        }
        let mut stages = Vec::new();
        let mut holder = BTreeMap::new();
        for ((start, end, _, _, replicas), shards) in groups {
            if shards.len() != replicas as usize {
                let have: Vec<u32> = shards.keys().copied().collect();
                skipped.push(format!(
                    "{}: layers {start}..{end} have the directories of replicas {have:?} of {replicas}, not all",
                    dir.display()
                ));
                continue;
            }
            let shards: Vec<(PathBuf, CheckpointMeta)> = shards.into_values().collect();
            for part in shards[0].1.parts() {
                holder.entry(part).or_insert(stages.len());
            }
            stages.push(shards);
        }
        Ok(Step {
            dir,
            stages,
            holder,
            skipped,
        })
    }

    /// Holds every part of the model.
    fn complete(&self, shape: &LmShape) -> bool {
        StageLayout::whole(shape)
            .parts(shape)
            .iter()
            .all(|p| self.holder.contains_key(p))
    }

    fn missing(&self, shape: &LmShape) -> Vec<Part> {
        StageLayout::whole(shape)
            .parts(shape)
            .into_iter()
            .filter(|p| !self.holder.contains_key(p))
            .collect()
    }

    fn path_of(&self, part: Part) -> Option<PathBuf> {
        let i = *self.holder.get(&part)?;
        Some(self.stages[i][0].0.join(part_file(part)))
    }
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
    /// The step's metadata (the last stage's, which carries the loss; its
    /// first replica's with replicas).
    pub meta: CheckpointMeta,
    pub dir: PathBuf,
    /// Newer checkpoints (or stage directories) that could not be used, with why.
    pub skipped: Vec<String>,
}

impl std::fmt::Debug for Restored {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Restored")
            .field("found", &self.found)
            .finish_non_exhaustive()
    }
}

/// `partial`: the file holds the part's adapter factors only (the base is
/// already loaded).
fn load_part<M: Module>(module: M, path: &Path, partial: bool) -> Result<M, CheckpointError> {
    let record = ModuleRecord::load(path)
        .map_err(|e| record_error(path, e))?
        .cast_to_module_dtype()
        .allow_partial(partial);
    module
        .try_load_record(record)
        .map_err(|e| record_error(path, e))
}

/// The ParamIds of every parameter of `module`.
fn param_ids<M: Module>(module: &M) -> BTreeSet<u64> {
    struct Ids(BTreeSet<u64>);
    impl ModuleVisitor for Ids {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.insert(param.id.val());
        }
    }
    let mut ids = Ids(BTreeSet::new());
    module.visit(&mut ids);
    ids.0
}

/// The parameter ids whose optimizer state `path` holds (its tensors are not read).
fn state_ids(path: &Path) -> Result<BTreeSet<u64>, CheckpointError> {
    let reader = burn_pack::Reader::from_file(path).map_err(|e| record_error(path, e))?;
    Ok(ids_in(&reader))
}

/// State keys are "<param id>" or "<param id>.<field>".
fn ids_in(reader: &burn_pack::Reader) -> BTreeSet<u64> {
    reader
        .scalars()
        .keys()
        .chain(reader.metadata().keys())
        .filter_map(|k| state_id(k))
        .collect()
}

fn state_id(key: &str) -> Option<u64> {
    key.split('.').next().and_then(|id| id.parse::<u64>().ok())
}

/// The optimizer state of `ids`, gathered from several stages' optimizer files.
fn merged_optimizer_state(
    files: &[PathBuf],
    ids: &BTreeSet<u64>,
) -> Result<burn_pack::Bytes, CheckpointError> {
    let mut tensors = Vec::new();
    let mut scalars = BTreeMap::new();
    let mut metadata = BTreeMap::new();
    // A parameter's state comes from the first file that has it: the first
    // and last stage both hold the state of a tied token embedding.
    let mut taken = BTreeSet::new();
    for path in files {
        let reader = burn_pack::Reader::from_file(path).map_err(|e| record_error(path, e))?;
        let here: BTreeSet<u64> = ids_in(&reader)
            .into_iter()
            .filter(|id| ids.contains(id) && !taken.contains(id))
            .collect();
        let ours = |key: &str| state_id(key).is_some_and(|id| here.contains(&id));
        scalars.extend(
            reader
                .scalars()
                .iter()
                .filter(|(k, _)| ours(k))
                .map(|(k, v)| (k.clone(), *v)),
        );
        metadata.extend(
            reader
                .metadata()
                .iter()
                .filter(|(k, _)| ours(k))
                .map(|(k, v)| (k.clone(), v.clone())),
        );
        for tensor in reader.into_tensors().map_err(|e| record_error(path, e))? {
            let (name, dtype, shape, param_id, bytes) =
                tensor.into_parts().map_err(|e| record_error(path, e))?;
            if param_id.is_some_and(|id| here.contains(&id)) {
                tensors.push(burn_pack::Tensor::new(name, dtype, shape, param_id, bytes));
            }
        }
        taken.extend(here);
    }
    let mut writer = burn_pack::Writer::new(tensors);
    for (k, v) in &scalars {
        writer = writer.with_scalar(k, *v);
    }
    for (k, v) in &metadata {
        writer = writer.with_metadata(k, v);
    }
    writer
        .into_bytes()
        .map_err(|e| record_error(files.first().map_or(Path::new("."), |p| p), e))
}

/// Loads this stage's parts of the newest complete step under `root` into
/// `model` and the matching optimizer state into `optimizer`: with replicas,
/// the state of the tensors `shard` owns. `Ok(None)` when there is none (a
/// fresh start); steps that are incomplete or fail to load are skipped and
/// reported in [`Found::skipped`].
pub fn restore_newest(
    root: &Path,
    shape: &LmShape,
    layout: &StageLayout,
    adapters: Option<&LoraConfig>,
    shard: Shard,
    model: TransformerLm,
    optimizer: ModuleOptimizer,
) -> Result<Option<Restored>, CheckpointError> {
    remove_stale_temporaries(root)?;
    let mut skipped = Vec::new();
    for (_, dir) in numbered(root, PREFIX)? {
        let step = Step::read(dir, shape, adapters, verify)?;
        skipped.extend(step.skipped.iter().cloned());
        if !step.complete(shape) {
            skipped.push(format!(
                "{}: incomplete, no stage holds {:?}",
                step.dir.display(),
                step.missing(shape)
            ));
            continue;
        }
        match load_stage(
            &step,
            layout,
            adapters.is_some(),
            shard,
            model.clone(),
            optimizer.clone(),
        ) {
            Ok((model, optimizer)) => {
                let meta = step
                    .stages
                    .iter()
                    .map(|shards| &shards[0].1)
                    .find(|m| m.last)
                    .or(step.stages.first().map(|shards| &shards[0].1))
                    .cloned()
                    .expect("a complete step has stages");
                return Ok(Some(Restored {
                    model,
                    optimizer,
                    found: Found {
                        meta,
                        dir: step.dir,
                        skipped,
                    },
                }));
            }
            Err(e) => skipped.push(e.to_string()),
        }
    }
    Ok(None)
}

fn load_stage(
    step: &Step,
    layout: &StageLayout,
    partial: bool,
    shard: Shard,
    mut model: TransformerLm,
    optimizer: ModuleOptimizer,
) -> Result<(TransformerLm, ModuleOptimizer), CheckpointError> {
    let path = |part: Part| {
        step.path_of(part).ok_or_else(|| CheckpointError::Invalid {
            path: step.dir.clone(),
            reason: format!("no stage holds {part:?}"),
        })
    };
    let mut sources = BTreeSet::new();
    // Every replica's shard of the stage that holds the part; written by the
    // same stage under the same replica count, only this replica's own
    // (ownership depends on the stage's tensors and d alone, so it owns what
    // it owned), which keeps the other shards' state out of memory while
    // resuming.
    let mut note = |part: Part| {
        if let Some(i) = step.holder.get(&part) {
            for (dir, meta) in &step.stages[*i] {
                let same_split = shard.replicas > 1
                    && meta.replicas == shard.replicas
                    && meta.layout() == *layout;
                if !same_split || meta.replica == shard.replica {
                    sources.insert(dir.join(OPTIMIZER_FILE));
                }
            }
        }
    };
    // A tied head's copy of the token embedding is the first stage's, ParamId included.
    if let Some(token) = model.token.take() {
        model.token = Some(load_part(token, &path(Part::Token)?, partial)?);
        note(Part::Token);
    }
    if let Some(position) = model.position.take() {
        model.position = Some(load_part(position, &path(Part::Position)?, partial)?);
        note(Part::Position);
    }
    let mut blocks = Vec::with_capacity(model.blocks.len());
    for (block, part) in std::mem::take(&mut model.blocks)
        .into_iter()
        .zip(layout.layers.clone().map(Part::Block))
    {
        blocks.push(load_part(block, &path(part)?, partial)?);
        note(part);
    }
    model.blocks = blocks;
    if let Some(head) = model.head.take() {
        model.head = Some(load_part(head, &path(Part::Head)?, partial)?);
        note(Part::Head);
    }
    let files: Vec<PathBuf> = sources.into_iter().collect();
    // The ids come from the part files, the same on every replica; which of
    // them this replica owns depends on the attempt's replicas only.
    let keep = if shard.replicas > 1 {
        crate::data_parallel::Shards::of(&model, partial, shard.replicas).owned(shard.replica)
    } else {
        param_ids(&model)
    };
    let optimizer = match files.as_slice() {
        // The usual resume (same stages, same replicas): one file holding
        // only state this worker keeps, loaded file-backed tensor by tensor
        // so the state is in memory once. Merging builds the whole pack in
        // memory first and the optimizer copies it again, which put a
        // resumed replica's peak a shard's state above a fresh one's.
        [only] if state_ids(only)?.is_subset(&keep) => {
            optimizer.load(only).map_err(|e| record_error(only, e))?
        }
        // Another split (the retry changed the stages or the replicas): the
        // merged pack is in memory while it loads, one extra copy of this
        // worker's state for the length of the load.
        _ => optimizer
            .from_bytes(merged_optimizer_state(&files, &keep)?)
            .map_err(|e| record_error(&step.dir, e))?,
    };
    Ok((model, optimizer))
}

/// Removes half-written stage directories left by a crash. One written to
/// in the last [`STALE_TEMPORARY_AGE`] is left alone: it may belong to a
/// stage that is still saving (a pod of the previous attempt that outlived
/// its deletion, or a sibling stage in the same process). Temporaries are
/// ignored when loading, so keeping one a while longer costs only disk.
fn remove_stale_temporaries(root: &Path) -> Result<(), CheckpointError> {
    let now = std::time::SystemTime::now();
    for (_, step_dir) in numbered(root, PREFIX)? {
        let Ok(entries) = fs::read_dir(&step_dir) else {
            continue;
        };
        for entry in entries.flatten() {
            if entry.file_name().to_string_lossy().starts_with(TMP_PREFIX) {
                let path = entry.path();
                let idle = last_written(&path)
                    .and_then(|t| now.duration_since(t).ok())
                    .unwrap_or(std::time::Duration::MAX);
                if idle < STALE_TEMPORARY_AGE {
                    continue;
                }
                match fs::remove_dir_all(&path) {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(io(&path)(e)),
                }
            }
        }
    }
    Ok(())
}

/// When anything in `dir` (itself or a file directly in it) was last
/// modified; `None` once it is gone.
fn last_written(dir: &Path) -> Option<std::time::SystemTime> {
    let mut newest = fs::metadata(dir).and_then(|m| m.modified()).ok()?;
    for entry in fs::read_dir(dir).ok()?.flatten() {
        if let Ok(t) = entry.metadata().and_then(|m| m.modified()) {
            newest = newest.max(t);
        }
    }
    Some(newest)
}

/// Removes every step older than the newest `keep` complete ones. Stages
/// prune concurrently: a directory another stage removed first is fine.
/// Completeness here is by `meta.json` alone (written last, after every file
/// was fsynced); the CRCs are checked when a checkpoint is loaded.
fn prune(
    root: &Path,
    shape: &LmShape,
    adapters: Option<&LoraConfig>,
    keep: usize,
) -> Result<(), CheckpointError> {
    let steps = numbered(root, PREFIX)?;
    let mut complete = 0;
    let mut oldest_kept = None;
    for (n, dir) in &steps {
        if Step::read(dir.clone(), shape, adapters, read_meta)?.complete(shape) {
            complete += 1;
            if complete == keep {
                oldest_kept = Some(*n);
                break;
            }
        }
    }
    let Some(oldest_kept) = oldest_kept else {
        return Ok(());
    };
    for (n, dir) in steps {
        if n < oldest_kept {
            match fs::remove_dir_all(&dir) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(io(&dir)(e)),
            }
        }
    }
    Ok(())
}
