//! Hugging Face checkpoints in: `config.json` → [`LlamaShape`], and the
//! `*.safetensors` files (one `model.safetensors`, or shards listed by
//! `model.safetensors.index.json`) → the tensors of one pipeline stage.
//!
//! Loading streams: each file's header is read, and only the tensors this
//! stage's module asks for are read from the file, one at a time with a
//! positional read of that tensor's bytes ([`super::safetensors_reads`]),
//! cast to the stage's float dtype (f32, or the job's half precision on a
//! GPU) and transposed into burn's `[in, out]` linear layout as they
//! arrive, through burn-store's adapters. Nothing maps the files, so the
//! process holds the tensor in flight and what the stage keeps: never
//! another stage's layers, never its share of the file (a memory map kept
//! the pages it had read resident until the part was loaded), never a
//! second copy of the whole checkpoint (the "load everything, then move"
//! spike of seed `000`).
//!
//! Trained weights out ([`HfCheckpoint::save_stage`]): each stage writes its
//! tensors under their original names and in the checkpoint's stored dtype
//! (one `model.safetensors`, or one shard per stage and the index), and the
//! config and tokenizer files are copied, so `from_pretrained(dir)` loads
//! the result.
//!
//! Names: a checkpoint's `model.embed_tokens`, `model.layers.<n>`,
//! `model.norm` and `lm_head` are this crate's `token`, `blocks.<n - first
//! layer of the stage>`, `head.norm` and `head.projection`; the block's own
//! fields carry Hugging Face's names, so nothing else is renamed.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use burn::tensor::DType;
use burn_store::{
    BurnToPyTorchAdapter, ChainAdapter, FloatCastAdapter, KeyRemapper, ModuleAdapter,
    ModuleSnapshot, PyTorchToBurnAdapter, SafetensorsStore,
};
use headroom_planner::{ConfigError, LlamaShape};

use super::safetensors_reads::SafetensorsFile;
use super::{Block, LlamaBlock, StageLayout, TransformerLm};

/// A checkpoint directory Headroom cannot read, with the file and what is wrong.
#[derive(Debug, thiserror::Error)]
pub enum HfError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    Config { path: PathBuf, source: ConfigError },
    #[error("{path}: {problem}")]
    Index { path: PathBuf, problem: String },
    #[error("{path}: {problem}")]
    Tensors { path: PathBuf, problem: String },
}

/// The weight files of a checkpoint directory and which tensor lives where.
#[derive(Clone, Debug)]
pub struct HfCheckpoint {
    pub dir: PathBuf,
    pub shape: LlamaShape,
    /// Tensor name → the file holding it; `None` for a single-file checkpoint.
    weight_map: Option<BTreeMap<String, PathBuf>>,
}

const SINGLE_FILE: &str = "model.safetensors";
const INDEX_FILE: &str = "model.safetensors.index.json";

impl HfCheckpoint {
    /// Reads `dir/config.json` and finds the weights (`model.safetensors` or
    /// the sharded index). `sequence_length` is the training sample length.
    pub fn open(dir: &Path, sequence_length: u32) -> Result<Self, HfError> {
        let config = dir.join("config.json");
        let text = std::fs::read_to_string(&config).map_err(|source| HfError::Io {
            path: config.clone(),
            source,
        })?;
        let shape = LlamaShape::from_hf_config(&text, sequence_length).map_err(|source| {
            HfError::Config {
                path: config.clone(),
                source,
            }
        })?;
        let index = dir.join(INDEX_FILE);
        let weight_map = if index.exists() {
            Some(read_index(&index, dir)?)
        } else if dir.join(SINGLE_FILE).exists() {
            None
        } else {
            return Err(HfError::Index {
                path: dir.to_path_buf(),
                problem: format!(
                    "neither {SINGLE_FILE} nor {INDEX_FILE} is here (a Hugging Face checkpoint saved with safetensors has one)"
                ),
            });
        };
        Ok(HfCheckpoint {
            dir: dir.to_path_buf(),
            shape,
            weight_map,
        })
    }

    /// The checkpoint's names of the tensors a stage holds.
    pub fn stage_tensor_names(&self, layout: &StageLayout) -> Vec<String> {
        let s = &self.shape;
        let mut names = Vec::new();
        if layout.first || (layout.last && s.tied_embeddings) {
            names.push("model.embed_tokens.weight".to_string());
        }
        for layer in layout.layers.clone() {
            let p = format!("model.layers.{layer}");
            let linears = s.architecture.block_linears();
            for m in linears.iter().filter(|m| m.in_attention()) {
                names.push(format!("{p}.self_attn.{}.weight", m.hf_name()));
            }
            if s.attention_bias {
                for proj in ["q_proj", "k_proj", "v_proj"] {
                    names.push(format!("{p}.self_attn.{proj}.bias"));
                }
                if s.architecture != headroom_planner::LlamaArchitecture::Qwen2 {
                    names.push(format!("{p}.self_attn.o_proj.bias"));
                }
            }
            if s.architecture.qk_norm() {
                names.push(format!("{p}.self_attn.q_norm.weight"));
                names.push(format!("{p}.self_attn.k_norm.weight"));
            }
            for m in linears.iter().filter(|m| !m.in_attention()) {
                names.push(format!("{p}.mlp.{}.weight", m.hf_name()));
                if s.mlp_bias {
                    names.push(format!("{p}.mlp.{}.bias", m.hf_name()));
                }
            }
            names.push(format!("{p}.input_layernorm.weight"));
            names.push(format!("{p}.post_attention_layernorm.weight"));
            if s.architecture.gemma() {
                names.push(format!("{p}.pre_feedforward_layernorm.weight"));
                names.push(format!("{p}.post_feedforward_layernorm.weight"));
            }
        }
        if layout.last {
            names.push("model.norm.weight".to_string());
            if !s.tied_embeddings {
                names.push("lm_head.weight".to_string());
            }
        }
        names
    }

    /// Every weight file of the checkpoint, each once, in a fixed order.
    pub fn weight_files(&self) -> Vec<PathBuf> {
        match &self.weight_map {
            None => vec![self.dir.join(SINGLE_FILE)],
            Some(map) => map
                .values()
                .cloned()
                .collect::<BTreeSet<_>>()
                .into_iter()
                .collect(),
        }
    }

    /// The file the index places a tensor in (`None` for a single-file
    /// checkpoint, or a name the index does not list).
    pub fn indexed_file(&self, tensor: &str) -> Option<&Path> {
        self.weight_map.as_ref()?.get(tensor).map(PathBuf::as_path)
    }

    /// The files holding the tensors `names`, each once, in a fixed order.
    fn files_of(&self, names: &[String]) -> Result<Vec<PathBuf>, HfError> {
        let Some(map) = &self.weight_map else {
            return Ok(vec![self.dir.join(SINGLE_FILE)]);
        };
        let mut files = BTreeSet::new();
        for name in names {
            let file = map.get(name).ok_or_else(|| HfError::Index {
                path: self.dir.join(INDEX_FILE),
                problem: format!("weight_map has no entry for {name}"),
            })?;
            files.insert(file.clone());
        }
        Ok(files.into_iter().collect())
    }

    /// Fills a stage built by [`TransformerLm::new`] for this checkpoint's
    /// shape with the checkpoint's weights, as f32.
    pub fn load_stage(
        &self,
        model: &mut TransformerLm,
        layout: &StageLayout,
    ) -> Result<(), HfError> {
        let names = self.stage_tensor_names(layout);
        self.load_part(model, &names, load_remapping(layout), "", layout)?;
        self.load_host_token(model, layout)
    }

    /// Fills a stage's host embedding ([`TransformerLm::keep_embedding_on_host`])
    /// from the checkpoint, in host memory, and casts it to the stage's
    /// dtype; nothing for a stage without one.
    fn load_host_token(
        &self,
        model: &mut TransformerLm,
        layout: &StageLayout,
    ) -> Result<(), HfError> {
        let Some(host) = &mut model.host_token else {
            return Ok(());
        };
        let empty = layout.layers.start..layout.layers.start;
        let names = self.stage_tensor_names(&StageLayout {
            layers: empty,
            first: true,
            last: false,
        });
        let remap = part_remapping(&[(r"^model\.embed_tokens\.", "")]);
        self.load_part(host.table_mut(), &names, remap, "token.", layout)?;
        host.settle();
        Ok(())
    }

    /// Fills a Llama stage built by [`TransformerLm::new`] as
    /// [`Self::load_stage`] does, but one part at a time — the token
    /// embedding, the head, then each decoder block — each from stores of
    /// its own, dropped (with the pages of the checkpoint they mapped)
    /// before the next part is read; each block goes through `each_block`
    /// as soon as it is loaded. When `each_block` quantizes (QLoRA), the
    /// stage holds at most one dense block at a time besides its quantized
    /// ones and its dense embedding and head.
    pub fn load_stage_by_part(
        &self,
        model: &mut TransformerLm,
        layout: &StageLayout,
        mut each_block: impl FnMut(LlamaBlock, u32) -> LlamaBlock,
    ) -> Result<(), HfError> {
        let part = |layers: std::ops::Range<u32>, first: bool, last: bool| StageLayout {
            layers,
            first,
            last,
        };
        let empty = layout.layers.start..layout.layers.start;
        if let Some(token) = &mut model.token {
            let names = self.stage_tensor_names(&part(empty.clone(), true, false));
            let remap = part_remapping(&[(r"^model\.embed_tokens\.", "")]);
            self.load_part(token, &names, remap, "token.", layout)?;
        }
        self.load_host_token(model, layout)?;
        if let Some(head) = &mut model.head {
            let mut names = self.stage_tensor_names(&part(empty, false, true));
            names.retain(|n| n != "model.embed_tokens.weight");
            let remap =
                part_remapping(&[(r"^model\.norm\.", "norm."), (r"^lm_head\.", "projection.")]);
            self.load_part(head, &names, remap, "head.", layout)?;
        }
        let blocks = std::mem::take(&mut model.blocks);
        for (local, (block, layer)) in blocks.into_iter().zip(layout.layers.clone()).enumerate() {
            let Block::Llama(mut block) = block else {
                return Err(HfError::Tensors {
                    path: self.dir.clone(),
                    problem: "a Hugging Face checkpoint loads into Llama-family blocks, not the synthetic transformer's".into(),
                });
            };
            let names = self.stage_tensor_names(&part(layer..layer + 1, false, false));
            let prefix = format!(r"^model\.layers\.{layer}\.");
            let remap = part_remapping(&[(prefix.as_str(), "")]);
            self.load_part(
                &mut block,
                &names,
                remap,
                &format!("blocks.{local}."),
                layout,
            )?;
            model.blocks.push(Block::Llama(each_block(block, layer)));
        }
        Ok(())
    }

    /// Loads `module`, a stage or a part of one (`prefix`: its path in the
    /// stage, for messages), from the files holding the checkpoint tensors
    /// `names`, one store per file, `remap` naming them by the module's paths.
    fn load_part<M: ModuleSnapshot>(
        &self,
        module: &mut M,
        names: &[String],
        remap: KeyRemapper,
        prefix: &str,
        layout: &StageLayout,
    ) -> Result<(), HfError> {
        let mut applied = BTreeSet::new();
        let mut expected = None;
        // Weights take the stage's float dtype (its device's default: bf16
        // when the job trains in bf16), whatever the files store. burn-store
        // keeps a tensor's own dtype, and f32 weights in a bf16 stage mix
        // dtypes in every op that meets a tensor made on the device (rotary
        // tables, activations): an error on flex, garbage on CUDA.
        let float: DType = module
            .devices()
            .first()
            .map_or(DType::F32, |device| device.settings().float_dtype.into());
        for file in self.files_of(names)? {
            // Every tensor of the file, unread; `apply` reads the ones the
            // module has, one at a time, as it reaches them.
            let (tensors, _) = remap.remap(SafetensorsFile::open(&file)?.lazy_tensors()?);
            let adapter: Box<dyn ModuleAdapter> = Box::new(ChainAdapter::new(
                PyTorchToBurnAdapter,
                FloatCastAdapter::to(float),
            ));
            let result = module.apply(tensors, None, Some(adapter), true);
            if let Some(error) = result.errors.first() {
                return Err(HfError::Tensors {
                    path: file.clone(),
                    problem: format!("{error} (config.json says {})", self.describe()),
                });
            }
            applied.extend(result.applied.iter().map(|p| strip_variants(p)));
            // Every file reports the module's parameters it lacked; the ones
            // no file had are the stage's missing tensors.
            let missing: BTreeSet<String> = result
                .missing
                .iter()
                .map(|(p, _)| strip_variants(p))
                .collect();
            expected.get_or_insert_with(|| {
                missing
                    .iter()
                    .cloned()
                    .chain(result.applied.iter().map(|p| strip_variants(p)))
                    .collect::<BTreeSet<_>>()
            });
        }
        let expected = expected.unwrap_or_default();
        let missing: Vec<_> = expected.difference(&applied).collect();
        if !missing.is_empty() {
            return Err(HfError::Tensors {
                path: self.dir.clone(),
                problem: format!(
                    "the checkpoint lacks tensors this {} needs for layers {:?}: {}",
                    self.describe(),
                    layout.layers,
                    missing
                        .iter()
                        .map(|p| checkpoint_name(&format!("{prefix}{p}"), layout))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            });
        }
        Ok(())
    }

    /// The dtype the checkpoint stores its weights in (`dtype`/`torch_dtype`; f32 if unsaid).
    pub fn stored_dtype(&self) -> DType {
        match self.shape.torch_dtype.as_deref() {
            Some("bfloat16") => DType::BF16,
            Some("float16") => DType::F16,
            _ => DType::F32,
        }
    }

    /// Writes stage `stage` of `stages` into `out` in this checkpoint's
    /// format: its tensors, by their original names, cast back to the stored
    /// dtype, into `model.safetensors` (one stage) or shard
    /// `model-<k>-of-<p>.safetensors`. Each file is written beside its final
    /// name and renamed into place; the stage that sees every shard in place
    /// writes the index, so the output is complete once the last stage is
    /// done, whichever that is. The first stage copies `config.json` and the
    /// tokenizer files. Returns the weight file written.
    pub fn save_stage(
        &self,
        model: &TransformerLm,
        layout: &StageLayout,
        stage: u32,
        stages: u32,
        out: &Path,
    ) -> Result<PathBuf, HfError> {
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| HfError::Io { path, source }
        };
        std::fs::create_dir_all(out).map_err(io(out))?;
        let file = out.join(shard_name(stage, stages));
        let tmp = out.join(format!(
            ".{}.tmp-{}",
            shard_name(stage, stages),
            std::process::id()
        ));
        let _ = std::fs::remove_file(&tmp);
        // A host embedding is written as the checkpoint's own.
        let with_token;
        let model = if model.host_token.is_some() {
            with_token = model.with_embedding_as_token();
            &with_token
        } else {
            model
        };
        let mut store = SafetensorsStore::from_file(&tmp)
            .with_to_adapter(ChainAdapter::new(
                BurnToPyTorchAdapter,
                FloatCastAdapter::to(self.stored_dtype()),
            ))
            .skip_enum_variants(true)
            // A last stage's copy of a tied embedding is the first stage's to write.
            .with_regex(if layout.first {
                r"^(token|blocks|head)\."
            } else {
                r"^(blocks|head)\."
            })
            .remap(save_remapping(layout))
            .clear_metadata()
            // transformers refuses a safetensors file without this.
            .metadata("format", "pt");
        model.save_into(&mut store).map_err(|e| HfError::Tensors {
            path: file.clone(),
            problem: e.to_string(),
        })?;
        // burn-store creates it owner-only; the output is for whoever reads the volume next.
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o644))
                .map_err(io(&tmp))?;
        }
        std::fs::rename(&tmp, &file).map_err(io(&file))?;
        if layout.first {
            copy_file(&self.dir, out, "config.json")?;
            copy_serving_files(&self.dir, out)?;
        }
        if stages > 1 {
            write_index_when_complete(out, stage, stages)?;
        }
        Ok(file)
    }

    fn describe(&self) -> String {
        let s = &self.shape;
        format!(
            "{} (hidden {}, {} layers, {} heads / {} key-value heads, intermediate {}, vocabulary {})",
            s.architecture.hf_name(),
            s.hidden,
            s.layers,
            s.attention_heads,
            s.key_value_heads,
            s.intermediate,
            s.vocabulary
        )
    }
}

/// A module path without burn's enum variant segments (`blocks.0.Llama.x` → `blocks.0.x`).
fn strip_variants(path: &str) -> String {
    path.split('.')
        .filter(|seg| !matches!(*seg, "Llama" | "Gpt" | "Rms" | "Layer"))
        .collect::<Vec<_>>()
        .join(".")
}

/// `model.safetensors`, or shard k (1-based in the name) of p.
fn shard_name(stage: u32, stages: u32) -> String {
    if stages <= 1 {
        SINGLE_FILE.to_string()
    } else {
        format!("model-{:05}-of-{stages:05}.safetensors", stage + 1)
    }
}

/// Files of a checkpoint directory that let its fine-tuned copy (merged
/// weights, or an adapter) serve as the base does: transformers' pipeline
/// and servers reading Hugging Face directories take the tokenizer (fast
/// and slow forms), the chat template (in tokenizer_config.json or its own
/// file) and the generation config (stop tokens, sampling defaults) from
/// beside the weights.
pub const SERVING_FILES: [&str; 10] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "tokenizer.model",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
];

/// Whether a file name is a license or its kin (`LICENSE`, `LICENSE.txt`,
/// `LICENCE.md`, `NOTICE`, Llama's `USE_POLICY.md`): the base's terms
/// travel with what is made from it.
fn is_license_file(name: &str) -> bool {
    let upper = name.to_ascii_uppercase();
    ["LICENSE", "LICENCE", "NOTICE", "USE_POLICY"]
        .iter()
        .any(|p| upper.starts_with(p))
}

/// Copies `name` from `from` into `to` (through a temporary name, so a
/// reader never sees half a file) when `from` has it; whether it did.
fn copy_file(from: &Path, to: &Path, name: &str) -> Result<bool, HfError> {
    let source = from.join(name);
    if !source.is_file() {
        return Ok(false);
    }
    let target = to.join(name);
    let tmp = to.join(format!(".{name}.tmp-{}", std::process::id()));
    std::fs::copy(&source, &tmp).map_err(|e| HfError::Io {
        path: source.clone(),
        source: e,
    })?;
    std::fs::rename(&tmp, &target).map_err(|e| HfError::Io {
        path: target.clone(),
        source: e,
    })?;
    Ok(true)
}

/// Copies the [`SERVING_FILES`] and the license files the checkpoint
/// directory `from` has into `to`; returns the names copied.
pub fn copy_serving_files(from: &Path, to: &Path) -> Result<Vec<String>, HfError> {
    let mut names: Vec<String> = SERVING_FILES.iter().map(|n| (*n).to_owned()).collect();
    let listing = std::fs::read_dir(from).map_err(|e| HfError::Io {
        path: from.to_path_buf(),
        source: e,
    })?;
    let mut licenses: Vec<String> = listing
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| is_license_file(n))
        .collect();
    licenses.sort();
    names.extend(licenses);
    let mut copied = Vec::new();
    for name in names {
        if copy_file(from, to, &name)? {
            copied.push(name);
        }
    }
    Ok(copied)
}

/// Writes `model.safetensors.index.json` once every shard is in `out`,
/// from the shards' own headers (so any stage can write it, and the result
/// is the same whichever does).
fn write_index_when_complete(out: &Path, stage: u32, stages: u32) -> Result<(), HfError> {
    let writer = format!("stage{stage}");
    let mut weight_map = BTreeMap::new();
    let mut total_size = 0u64;
    for stage in 0..stages {
        let name = shard_name(stage, stages);
        let path = out.join(&name);
        let Ok(bytes) = std::fs::read(&path) else {
            return Ok(()); // not yet: the stage that writes the last shard writes the index
        };
        let tensors =
            safetensors::SafeTensors::deserialize(&bytes).map_err(|e| HfError::Tensors {
                path: path.clone(),
                problem: e.to_string(),
            })?;
        for (tensor, view) in tensors.tensors() {
            total_size += view.data().len() as u64;
            weight_map.insert(tensor, name.clone());
        }
    }
    let index = serde_json::json!({
        "metadata": {"total_size": total_size},
        "weight_map": weight_map,
    });
    let path = out.join(INDEX_FILE);
    // Named by stage as well as pid: stages of one process (tests) share a
    // pid, and in containers every stage is pid 1. Each renames its own copy
    // over the index; the copies are identical.
    let tmp = out.join(format!(".{INDEX_FILE}.tmp-{writer}-{}", std::process::id()));
    let text = serde_json::to_string_pretty(&index).expect("JSON");
    std::fs::write(&tmp, text).map_err(|source| HfError::Io {
        path: tmp.clone(),
        source,
    })?;
    std::fs::rename(&tmp, &path).map_err(|source| HfError::Io { path, source })
}

/// Module path → checkpoint name for one stage's layer range (saving).
fn save_remapping(layout: &StageLayout) -> KeyRemapper {
    let mut pairs = vec![
        (r"^token\.".to_string(), "model.embed_tokens.".to_string()),
        (r"^head\.norm\.".to_string(), "model.norm.".to_string()),
        (r"^head\.projection\.".to_string(), "lm_head.".to_string()),
    ];
    for (local, layer) in layout.layers.clone().enumerate() {
        pairs.push((
            format!(r"^blocks\.{local}\."),
            format!("model.layers.{layer}."),
        ));
    }
    KeyRemapper::from_patterns(pairs).expect("static patterns")
}

/// Checkpoint name → module path for one stage's layer range.
fn load_remapping(layout: &StageLayout) -> KeyRemapper {
    let mut pairs = vec![
        (r"^model\.embed_tokens\.".to_string(), "token.".to_string()),
        (r"^model\.norm\.".to_string(), "head.norm.".to_string()),
        (r"^lm_head\.".to_string(), "head.projection.".to_string()),
    ];
    for (local, layer) in layout.layers.clone().enumerate() {
        pairs.push((
            format!(r"^model\.layers\.{layer}\."),
            format!("blocks.{local}."),
        ));
    }
    // Another stage's layers must not land on this stage's blocks.
    pairs.push((r"^model\.layers\.".to_string(), "other_stage.".to_string()));
    KeyRemapper::from_patterns(pairs).expect("static patterns")
}

/// Checkpoint name → path in one part of a stage: `pairs` (checkpoint
/// prefix pattern, the part's path) for the part's tensors; every other
/// tensor of the checkpoint is moved out of the way, under `other.`.
fn part_remapping(pairs: &[(&str, &str)]) -> KeyRemapper {
    let mut pairs: Vec<(String, String)> = pairs
        .iter()
        .map(|(from, to)| (from.to_string(), to.to_string()))
        .collect();
    // Applied in order, each to the name the previous ones left: the
    // part's tensors no longer start with either prefix here.
    pairs.push((r"^(model|lm_head)\.".to_string(), "other.$1.".to_string()));
    KeyRemapper::from_patterns(pairs).expect("static patterns")
}

/// Module path → the checkpoint's name, for messages.
fn checkpoint_name(path: &str, layout: &StageLayout) -> String {
    let path = path.replace(".gamma", ".weight");
    if let Some(rest) = path.strip_prefix("token.") {
        return format!("model.embed_tokens.{rest}");
    }
    if let Some(rest) = path.strip_prefix("head.norm.") {
        return format!("model.norm.{rest}");
    }
    if let Some(rest) = path.strip_prefix("head.projection.") {
        return format!("lm_head.{rest}");
    }
    if let Some(rest) = path.strip_prefix("blocks.")
        && let Some((local, rest)) = rest.split_once('.')
        && let Ok(local) = local.parse::<u32>()
    {
        return format!("model.layers.{}.{rest}", layout.layers.start + local);
    }
    path
}

/// Reads `model.safetensors.index.json`'s `weight_map`.
fn read_index(index: &Path, dir: &Path) -> Result<BTreeMap<String, PathBuf>, HfError> {
    let bad = |problem: String| HfError::Index {
        path: index.to_path_buf(),
        problem,
    };
    let text = std::fs::read_to_string(index).map_err(|source| HfError::Io {
        path: index.to_path_buf(),
        source,
    })?;
    let value: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
    let map = value
        .get("weight_map")
        .and_then(serde_json::Value::as_object)
        .ok_or_else(|| bad("no weight_map object".into()))?;
    map.iter()
        .map(|(name, file)| {
            let file = file
                .as_str()
                .filter(|f| !f.contains('/') && f.ends_with(".safetensors"))
                .ok_or_else(|| {
                    bad(format!(
                        "weight_map.{name} must name a .safetensors file in the same directory, not {file}"
                    ))
                })?;
            Ok((name.clone(), dir.join(file)))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_serving_files_and_the_license_travel_with_the_output() {
        let base = std::env::temp_dir().join(format!("headroom-serving-{}", std::process::id()));
        let (from, to) = (base.join("base"), base.join("out"));
        std::fs::create_dir_all(&from).expect("dir");
        std::fs::create_dir_all(&to).expect("dir");
        for name in [
            "tokenizer.json",
            "tokenizer_config.json",
            "chat_template.jinja",
            "generation_config.json",
            "LICENSE.txt",
            "USE_POLICY.md",
            "README.md",
            "model.safetensors",
        ] {
            std::fs::write(from.join(name), name).expect("write");
        }
        let copied = copy_serving_files(&from, &to).expect("copy");
        assert_eq!(
            copied,
            [
                "tokenizer.json",
                "tokenizer_config.json",
                "chat_template.jinja",
                "generation_config.json",
                "LICENSE.txt",
                "USE_POLICY.md"
            ]
        );
        for name in &copied {
            assert_eq!(
                std::fs::read_to_string(to.join(name)).expect("copied"),
                *name
            );
        }
        assert!(!to.join("README.md").exists() && !to.join("model.safetensors").exists());
        let _ = std::fs::remove_dir_all(&base);
    }
}
