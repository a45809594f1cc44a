//! Checks a checkpoint directory and a data file against each other before
//! any training pod is planned, so a mistake is one clear message from the
//! initializer rather than a crash minutes into a many-pod job.
//!
//! The weights are checked from their safetensors headers alone (the 8-byte
//! length and the JSON after it; the tensor data is never read, so a 100 GB
//! checkpoint costs a few reads): the tensor names are exactly the ones
//! `config.json` implies, each has the shape it implies, all share one float
//! dtype, and the parameters add up to the planner's count for the shape.
//! The data is read, tokenized with the checkpoint's tokenizer and packed as
//! training will, and must give at least one sample.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use headroom_api::{DataFacts, DataFormat, ModelFacts, Packing, TrainOn};
use headroom_planner::{LlamaArchitecture, LlamaShape};
use safetensors::tensor::{Dtype, Metadata};

use super::InitError;
use crate::model::StageLayout;
use crate::model::hf::HfCheckpoint;
use crate::model::safetensors_reads::{HeaderError, read_header as read_header_of};
use crate::text::{DataLocation, Example, Format, load_packed, read_examples};

/// How many offending names or shapes a message lists.
const LIST_AT_MOST: usize = 4;

/// One tensor as a header describes it.
#[derive(Clone, Debug)]
struct Found {
    dtype: Dtype,
    shape: Vec<usize>,
    file: PathBuf,
}

/// Checks the checkpoint in `dir` (see the module documentation) and
/// describes it.
pub fn inspect_model(dir: &Path, sequence_length: u32) -> Result<ModelFacts, InitError> {
    let checkpoint =
        HfCheckpoint::open(dir, sequence_length).map_err(|e| InitError::Invalid(e.to_string()))?;
    let shape = &checkpoint.shape;
    let layout = StageLayout::whole(&shape.clone().into());
    let expected = checkpoint.stage_tensor_names(&layout);
    let (found, bytes) = read_headers(dir, &checkpoint)?;
    check_names(dir, shape, &expected, &found)?;
    check_shapes(dir, shape, &expected, &found)?;
    let dtype = common_dtype(dir, &expected, &found)?;
    let parameters: u64 = expected
        .iter()
        .filter_map(|n| found.get(n))
        .map(|t| t.shape.iter().map(|&d| d as u64).product::<u64>())
        .sum();
    if parameters != shape.total_params() {
        return Err(InitError::Invalid(format!(
            "{}: the safetensors files hold {parameters} parameters but config.json implies {} ({})",
            dir.display(),
            shape.total_params(),
            describe(shape)
        )));
    }
    Ok(ModelFacts {
        shape: shape.clone(),
        parameters,
        bytes,
        dtype,
    })
}

/// Every tensor the weight files' headers describe, by name, and the files'
/// total size; a tensor in two files, or in another file than the index
/// says, is an error.
fn read_headers(
    dir: &Path,
    checkpoint: &HfCheckpoint,
) -> Result<(BTreeMap<String, Found>, u64), InitError> {
    let mut found: BTreeMap<String, Found> = BTreeMap::new();
    let mut bytes = 0;
    for file in checkpoint.weight_files() {
        let (metadata, len) = read_header(&file)?;
        bytes += len;
        for (name, info) in metadata.tensors() {
            if let Some(other) = found.get(&name) {
                return Err(InitError::Invalid(format!(
                    "{name} is in both {} and {}",
                    other.file.display(),
                    file.display()
                )));
            }
            if let Some(listed) = checkpoint.indexed_file(&name)
                && listed != file
            {
                return Err(InitError::Invalid(format!(
                    "{}: model.safetensors.index.json places {name} in {} but it is in {}",
                    dir.display(),
                    listed.display(),
                    file.display()
                )));
            }
            found.insert(
                name,
                Found {
                    dtype: info.dtype,
                    shape: info.shape.clone(),
                    file: file.clone(),
                },
            );
        }
    }

    Ok((found, bytes))
}

/// The tensor names are exactly the ones `config.json` implies, besides
/// the extras some exports carry ([`tolerated_extra`], with a warning).
fn check_names(
    dir: &Path,
    shape: &LlamaShape,
    expected: &[String],
    found: &BTreeMap<String, Found>,
) -> Result<(), InitError> {
    let wanted: BTreeSet<&str> = expected.iter().map(String::as_str).collect();
    let missing: Vec<&str> = expected
        .iter()
        .map(String::as_str)
        .filter(|n| !found.contains_key(*n))
        .collect();
    let mut unexpected = Vec::new();
    for name in found.keys() {
        if wanted.contains(name.as_str()) {
            continue;
        }
        if tolerated_extra(name, shape) {
            tracing::warn!(tensor = %name, "ignoring a tensor training does not use");
        } else {
            unexpected.push(name.as_str());
        }
    }
    if !missing.is_empty() || !unexpected.is_empty() {
        let mut problems = Vec::new();
        if !missing.is_empty() {
            problems.push(format!(
                "missing {}: {}",
                missing.len(),
                first_few(&missing)
            ));
        }
        if !unexpected.is_empty() {
            problems.push(format!(
                "unexpected {}: {}",
                unexpected.len(),
                first_few(&unexpected)
            ));
        }
        return Err(InitError::Invalid(format!(
            "{}: the safetensors tensors do not match config.json ({}): {}",
            dir.display(),
            describe(shape),
            problems.join("; ")
        )));
    }

    Ok(())
}

/// Each expected tensor has the shape `config.json` implies.
fn check_shapes(
    dir: &Path,
    shape: &LlamaShape,
    expected: &[String],
    found: &BTreeMap<String, Found>,
) -> Result<(), InitError> {
    let mut mismatches = Vec::new();
    for name in expected {
        let Some(tensor) = found.get(name) else {
            continue;
        };
        if let Some((want, why)) = expected_shape(name, shape)
            && tensor.shape != want
        {
            mismatches.push(format!(
                "{name} is {:?} in {} but config.json implies {want:?} ({why})",
                tensor.shape,
                file_name(&tensor.file)
            ));
        }
    }
    if !mismatches.is_empty() {
        let more = mismatches.len().saturating_sub(LIST_AT_MOST);
        mismatches.truncate(LIST_AT_MOST);
        return Err(InitError::Invalid(format!(
            "{}: tensor shapes disagree with config.json: {}{}",
            dir.display(),
            mismatches.join("; "),
            if more > 0 {
                format!("; and {more} more")
            } else {
                String::new()
            }
        )));
    }

    Ok(())
}

/// The one float dtype every expected tensor is stored in (`F32` when
/// there is none to look at).
fn common_dtype(
    dir: &Path,
    expected: &[String],
    found: &BTreeMap<String, Found>,
) -> Result<String, InitError> {
    let mut dtype: Option<(Dtype, &str)> = None;
    for name in expected {
        let Some(tensor) = found.get(name) else {
            continue;
        };
        if !matches!(tensor.dtype, Dtype::F32 | Dtype::F16 | Dtype::BF16) {
            return Err(InitError::Invalid(format!(
                "{name} is stored as {} in {}; Headroom trains F32, F16 or BF16 checkpoints (not quantized ones)",
                tensor.dtype,
                file_name(&tensor.file)
            )));
        }
        match dtype {
            None => dtype = Some((tensor.dtype, name)),
            Some((first, first_name)) if first != tensor.dtype => {
                return Err(InitError::Invalid(format!(
                    "{}: the weights mix dtypes: {first_name} is {first} but {name} is {}",
                    dir.display(),
                    tensor.dtype
                )));
            }
            Some(_) => {}
        }
    }
    Ok(dtype.map_or_else(|| "F32".to_string(), |(d, _)| d.to_string()))
}

/// Reads the data as training will (the checkpoint's tokenizer, chat
/// template and end-of-sequence token, packed into
/// `sequence_length + 1`-token samples with their loss masks, as
/// `packing` says, so the samples counted are those training sees) and checks
/// every token id fits the model's vocabulary.
pub fn inspect_data(
    model_dir: &Path,
    data: impl Into<DataLocation>,
    format: &DataFormat,
    train_on: TrainOn,
    packing: Packing,
    sequence_length: u32,
    vocabulary: u32,
) -> Result<DataFacts, InitError> {
    let format = Format::from(format);
    let data = data.into();
    let examples =
        read_examples(data.clone(), &format).map_err(|e| InitError::Invalid(e.to_string()))?;
    if examples
        .iter()
        .all(|e| matches!(&e.example, Example::Text(t) if t.trim().is_empty()))
    {
        return Err(InitError::Invalid(format!(
            "{data}: no text to train on (the data is empty{})",
            match &format {
                Format::Jsonl { field } | Format::Parquet { field } =>
                    format!(" or every `{field}` is blank"),
                Format::PlainText => String::new(),
            }
        )));
    }
    let packed = load_packed(
        model_dir,
        data.clone(),
        &format,
        train_on,
        packing,
        sequence_length as usize,
    )
    .map_err(InitError::Invalid)?;
    if let Some(id) = packed.samples.iter().flatten().copied().max()
        && id >= vocabulary
    {
        return Err(InitError::Invalid(format!(
            "{}: the tokenizer gives token id {id}, beyond config.json's vocab_size {vocabulary}",
            model_dir.join("tokenizer.json").display()
        )));
    }
    if packed.masked_targets == packed.targets {
        return Err(InitError::Invalid(format!(
            "{data}: data.trainOn leaves no token of any sample to train on (every target is masked): check the rows' roles or use trainOn: all"
        )));
    }
    Ok(DataFacts {
        documents: packed.documents as u64,
        tokens: packed.tokens as u64,
        samples: packed.samples.len() as u64,
        masked_per_mille: per_mille(packed.masked_targets, packed.targets),
        longer_than_sample: packed.longer_than_sample,
    })
}

/// `part` of `whole` in thousandths, rounded to nearest.
fn per_mille(part: u64, whole: u64) -> u32 {
    if whole == 0 {
        return 0;
    }
    ((u128::from(part) * 1000 + u128::from(whole) / 2) / u128::from(whole)) as u32
}

/// A safetensors file's header, read without its tensor data, and the
/// file's length (which the header must account for exactly).
fn read_header(path: &Path) -> Result<(Metadata, u64), InitError> {
    let unreadable = |e: std::io::Error| {
        let message = format!("{}: {e}", path.display());
        if e.kind() == std::io::ErrorKind::NotFound {
            InitError::Invalid(message)
        } else {
            InitError::Io(message)
        }
    };
    let bad = |problem: String| {
        InitError::Invalid(format!(
            "{}: not a complete safetensors file: {problem}",
            path.display()
        ))
    };
    let file = std::fs::File::open(path).map_err(unreadable)?;
    let len = file.metadata().map_err(unreadable)?.len();
    let (metadata, n) = read_header_of(&file, len).map_err(|e| match e {
        HeaderError::Io(e) => unreadable(e),
        HeaderError::Bad(problem) => bad(problem),
    })?;
    let data = metadata
        .tensors()
        .values()
        .map(|info| info.data_offsets.1 as u64)
        .max()
        .unwrap_or(0);
    if 8 + n + data != len {
        return Err(bad(format!(
            "the header describes {} bytes but the file has {len} (truncated?)",
            8 + n + data
        )));
    }
    Ok((metadata, len))
}

/// Tensors some exports carry that training has no use for: older Llama
/// checkpoints' RoPE buffers, and a tied model's copy of its embedding.
fn tolerated_extra(name: &str, shape: &LlamaShape) -> bool {
    name.ends_with(".self_attn.rotary_emb.inv_freq")
        || (name == "lm_head.weight" && shape.tied_embeddings)
}

/// The shape config.json implies for a checkpoint tensor, and why.
fn expected_shape(name: &str, s: &LlamaShape) -> Option<(Vec<usize>, String)> {
    let (h, i, v) = (
        s.hidden as usize,
        s.intermediate as usize,
        s.vocabulary as usize,
    );
    let (q, kv) = (s.q_dim() as usize, s.kv_dim() as usize);
    let heads = format!(
        "num_attention_heads {} × head_dim {}",
        s.attention_heads, s.head_dim
    );
    let kv_heads = format!(
        "num_key_value_heads {} × head_dim {}",
        s.key_value_heads, s.head_dim
    );
    let hidden = format!("hidden_size {h}");
    let inter = format!("intermediate_size {i}");
    let pair = |a: &str, b: &str| format!("{a}, {b}");
    let found = match name {
        "model.embed_tokens.weight" | "lm_head.weight" => {
            (vec![v, h], pair(&format!("vocab_size {v}"), &hidden))
        }
        "model.norm.weight" => (vec![h], hidden),
        _ => {
            let rest = name.strip_prefix("model.layers.")?;
            let (_, tensor) = rest.split_once('.')?;
            match tensor {
                "self_attn.q_proj.weight" => (vec![q, h], pair(&heads, &hidden)),
                "self_attn.q_proj.bias" => (vec![q], heads),
                "self_attn.k_proj.weight" | "self_attn.v_proj.weight" => {
                    (vec![kv, h], pair(&kv_heads, &hidden))
                }
                "self_attn.k_proj.bias" | "self_attn.v_proj.bias" => (vec![kv], kv_heads),
                "self_attn.o_proj.weight" => (vec![h, q], pair(&hidden, &heads)),
                "self_attn.o_proj.bias" => (vec![h], hidden),
                "self_attn.qkv_proj.weight" => (
                    vec![q + 2 * kv, h],
                    pair(&format!("{heads} + 2 × {kv_heads}"), &hidden),
                ),
                "mlp.gate_up_proj.weight" => {
                    (vec![2 * i, h], pair(&format!("2 × {inter}"), &hidden))
                }
                "self_attn.q_norm.weight" | "self_attn.k_norm.weight" => (
                    vec![s.head_dim as usize],
                    format!("head_dim {}", s.head_dim),
                ),
                "mlp.gate_proj.weight" | "mlp.up_proj.weight" => {
                    (vec![i, h], pair(&inter, &hidden))
                }
                "mlp.gate_proj.bias" | "mlp.up_proj.bias" => (vec![i], inter),
                "mlp.down_proj.weight" => (vec![h, i], pair(&hidden, &inter)),
                "mlp.down_proj.bias"
                | "input_layernorm.weight"
                | "post_attention_layernorm.weight"
                | "pre_feedforward_layernorm.weight"
                | "post_feedforward_layernorm.weight" => (vec![h], hidden),
                _ => return None,
            }
        }
    };
    Some(found)
}

fn describe(s: &LlamaShape) -> String {
    format!(
        "{} with {} layers, hidden {}, {} heads / {} key-value heads of {}, vocabulary {}{}",
        s.architecture.hf_name(),
        s.layers,
        s.hidden,
        s.attention_heads,
        s.key_value_heads,
        s.head_dim,
        s.vocabulary,
        if s.tied_embeddings {
            ", tied embeddings"
        } else {
            ""
        }
    ) + match s.architecture {
        LlamaArchitecture::Qwen2 => ", q/k/v biases",
        LlamaArchitecture::Qwen3 => ", q/k norms",
        LlamaArchitecture::Phi3 => ", fused qkv_proj and gate_up_proj",
        LlamaArchitecture::Gemma3 => ", q/k norms, four norms a block",
        LlamaArchitecture::Gemma2 => ", four norms a block",
        _ => "",
    }
}

fn first_few(names: &[&str]) -> String {
    let mut listed = names
        .iter()
        .take(LIST_AT_MOST)
        .copied()
        .collect::<Vec<_>>()
        .join(", ");
    if names.len() > LIST_AT_MOST {
        listed.push_str(", …");
    }
    listed
}

fn file_name(path: &Path) -> String {
    path.file_name().map_or_else(
        || path.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama/tiny-llama")
    }

    #[test]
    fn the_fixture_checks_out() {
        let facts = inspect_model(&fixture(), 32).expect("tiny-llama is valid");
        assert_eq!(facts.parameters, 214_592);
        assert_eq!(facts.dtype, "F32");
        assert_eq!(facts.shape.key_value_heads, 2);
        assert!(facts.bytes > 4 * 214_592, "{}", facts.bytes);
    }

    /// transformers-made checkpoints of every family: biases (Qwen2),
    /// untied heads, BF16 storage, q/k norms and a head_dim that is not
    /// hidden / heads (Qwen3), fused projections (Phi-3), four norms a block
    /// (Gemma) all check out with the planner's count.
    #[test]
    fn every_family_of_fixture_checks_out() {
        let root = fixture().join("..");
        for (name, dtype) in [
            ("llama-gqa-tied", "F32"),
            ("llama-mha-untied", "F32"),
            ("mistral-gqa-bf16", "BF16"),
            ("qwen2-gqa-bias", "F32"),
            ("qwen3-gqa-tied", "F32"),
            ("phi3-gqa-longrope-tied", "F32"),
            ("phi3-mha-longrope-short", "F32"),
            ("gemma3-gqa-tied", "F32"),
            ("gemma2-softcap", "F32"),
        ] {
            let facts =
                inspect_model(&root.join(name), 16).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(facts.dtype, dtype, "{name}");
            assert_eq!(facts.parameters, facts.shape.total_params(), "{name}");
        }
    }

    #[test]
    fn a_truncated_file_is_named() {
        let dir = std::env::temp_dir().join(format!("headroom-inspect-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("tmp");
        let bytes = std::fs::read(fixture().join("model.safetensors")).expect("fixture");
        let path = dir.join("model.safetensors");
        std::fs::write(&path, &bytes[..bytes.len() / 2]).expect("write");
        let e = read_header(&path).expect_err("truncated");
        assert!(
            e.to_string().contains("model.safetensors") && e.to_string().contains("truncated"),
            "{e}"
        );
        std::fs::write(&path, b"abc").expect("write");
        assert!(read_header(&path).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
