//! LoRA adapters in PEFT's format, in and out: `adapter_config.json` and
//! `adapter_model.safetensors`, which `PeftModel.from_pretrained(base, dir)`
//! loads.
//!
//! Names and layout: the factors of `model.layers.3.self_attn.q_proj` are
//! `base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`
//! [r, d_in] and `….lora_B.weight` [d_out, r] (`lm_head`'s are
//! `base_model.model.lm_head.lora_{A,B}.weight`). PEFT's are torch `Linear`
//! weights ([out, in]), burn's factors are `A` [d_in, r] and `B` [r, d_out],
//! so each is transposed on the way in and out. Both scale the product by
//! `lora_alpha / r`.
//!
//! A pipeline writes one adapter: each stage writes its factors to
//! `.adapter-parts/stage-<k>-of-<p>.safetensors` under the output, and the
//! stage that finds every part in place writes `adapter_model.safetensors`
//! from them (as the sharded full-model output writes its index, see
//! [`super::hf`]), so the result is complete once the last stage is done,
//! whichever that is.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::{Tensor, TensorData};
use headroom_planner::{LoraConfig, TargetModule};
use safetensors::{Dtype, SafeTensors, serialize_to_file, tensor::TensorView};

use super::hf::HfError;
use super::lora::stage_adapters;
use super::{StageLayout, TransformerLm};

pub const ADAPTER_FILE: &str = "adapter_model.safetensors";
pub const CONFIG_FILE: &str = "adapter_config.json";
const PARTS_DIR: &str = ".adapter-parts";
/// PEFT's prefix for the wrapped causal LM's tensors.
const PREFIX: &str = "base_model.model.";

/// The factor names of an adapted module (`model.layers.0.self_attn.q_proj` or `lm_head`).
pub fn factor_names(hf_path: &str) -> [String; 2] {
    [
        format!("{PREFIX}{hf_path}.lora_A.weight"),
        format!("{PREFIX}{hf_path}.lora_B.weight"),
    ]
}

/// What an adapter names as its base: PEFT's `base_model_name_or_path`
/// (a hub repo id, or a directory) and `revision` (the hub revision).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BaseModel {
    pub name_or_path: String,
    pub revision: Option<String>,
}

/// `adapter_config.json` for `config`, as PEFT writes the fields it reads
/// (the rest take PEFT's defaults).
pub fn config_json(config: &LoraConfig, base_model: &BaseModel) -> serde_json::Value {
    serde_json::json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": config.rank,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout,
        "target_modules": config.target_modules.iter().map(|m| m.hf_name()).collect::<Vec<_>>(),
        "bias": "none",
        "fan_in_fan_out": false,
        "use_rslora": false,
        "use_dora": false,
        "init_lora_weights": true,
        "inference_mode": true,
        "modules_to_save": null,
        "base_model_name_or_path": base_model.name_or_path,
        "revision": base_model.revision,
    })
}

/// Reads a PEFT `adapter_config.json` into the planner's [`LoraConfig`];
/// refuses what the worker cannot compute the same way.
pub fn read_config(dir: &Path) -> Result<LoraConfig, HfError> {
    let path = dir.join(CONFIG_FILE);
    let bad = |problem: String| HfError::Index {
        path: path.clone(),
        problem,
    };
    let text = std::fs::read_to_string(&path).map_err(|source| HfError::Io {
        path: path.clone(),
        source,
    })?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
    if v["peft_type"] != "LORA" {
        return Err(bad(format!(
            "peft_type {}, expected \"LORA\"",
            v["peft_type"]
        )));
    }
    for (flag, what) in [
        ("use_rslora", "rank-stabilised scaling"),
        ("use_dora", "DoRA"),
        ("fan_in_fan_out", "fan_in_fan_out weights"),
    ] {
        if v[flag].as_bool() == Some(true) {
            return Err(bad(format!(
                "{flag}: {what} is not supported; only plain LoRA"
            )));
        }
    }
    let rank = v["r"]
        .as_u64()
        .and_then(|r| u32::try_from(r).ok())
        .ok_or_else(|| bad(format!("r must be a positive integer, not {}", v["r"])))?;
    let alpha = v["lora_alpha"].as_f64().ok_or_else(|| {
        bad(format!(
            "lora_alpha must be a number, not {}",
            v["lora_alpha"]
        ))
    })?;
    let names: Vec<&str> = match &v["target_modules"] {
        serde_json::Value::Array(a) => a.iter().filter_map(|m| m.as_str()).collect(),
        serde_json::Value::String(s) => vec![s.as_str()],
        other => {
            return Err(bad(format!(
                "target_modules must be a list of names, not {other}"
            )));
        }
    };
    let mut target_modules = Vec::new();
    for name in names {
        let module = TargetModule::from_hf_name(name).ok_or_else(|| {
            bad(format!(
                "target_modules: {name} is not one of {}",
                TargetModule::EVERY.map(TargetModule::hf_name).join(", ")
            ))
        })?;
        target_modules.push(module);
    }
    target_modules.sort();
    Ok(LoraConfig {
        rank,
        alpha,
        dropout: v["lora_dropout"].as_f64().unwrap_or(0.0),
        target_modules,
        block_size: headroom_planner::adapters::default_block_size(),
    })
}

fn tensor_error(path: &Path, problem: impl std::fmt::Display) -> HfError {
    HfError::Tensors {
        path: path.to_path_buf(),
        problem: problem.to_string(),
    }
}

/// The stage's factors under PEFT's names, transposed to PEFT's layout, as f32.
fn stage_tensors(
    model: &TransformerLm,
    layout: &StageLayout,
) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let mut tensors = Vec::new();
    for adapted in stage_adapters(model, layout) {
        let [a_name, b_name] = factor_names(&adapted.hf_path);
        for (name, factor) in [(a_name, &adapted.adapter.a), (b_name, &adapted.adapter.b)] {
            let t = factor.val().transpose();
            let dims = t.dims().to_vec();
            let values = t.into_data().iter::<f32>().collect::<Vec<f32>>();
            tensors.push((name, dims, values));
        }
    }
    tensors
}

fn write_safetensors(
    path: &Path,
    tensors: &[(String, Vec<usize>, Vec<f32>)],
) -> Result<(), HfError> {
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, _, v)| v.iter().flat_map(|x| x.to_le_bytes()).collect())
        .collect();
    let views = tensors
        .iter()
        .zip(&bytes)
        .map(|((name, dims, _), b)| {
            TensorView::new(Dtype::F32, dims.clone(), b)
                .map(|view| (name.clone(), view))
                .map_err(|e| tensor_error(path, e))
        })
        .collect::<Result<Vec<_>, _>>()?;
    // transformers/PEFT read a file without it, but refuse some paths that lack it.
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    serialize_to_file(views, Some(metadata), path).map_err(|e| tensor_error(path, e))
}

/// Tensors by name: shape and f32 values.
type NamedTensors = BTreeMap<String, (Vec<usize>, Vec<f32>)>;

fn read_safetensors(path: &Path) -> Result<NamedTensors, HfError> {
    let bytes = std::fs::read(path).map_err(|source| HfError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let file = SafeTensors::deserialize(&bytes).map_err(|e| tensor_error(path, e))?;
    let mut tensors = BTreeMap::new();
    for (name, view) in file.tensors() {
        let values: Vec<f32> = match view.dtype() {
            Dtype::F32 => view
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            Dtype::BF16 => view
                .data()
                .chunks_exact(2)
                .map(|c| f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16))
                .collect(),
            Dtype::F16 => view
                .data()
                .chunks_exact(2)
                .map(|c| burn::tensor::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            other => {
                return Err(tensor_error(
                    path,
                    format!("{name}: dtype {other:?}; adapters are stored as F32, BF16 or F16"),
                ));
            }
        };
        tensors.insert(name, (view.shape().to_vec(), values));
    }
    Ok(tensors)
}

fn rename_into_place(tmp: &Path, to: &Path) -> Result<(), HfError> {
    use std::os::unix::fs::PermissionsExt;
    // Written owner-only; the output is for whoever reads the volume next.
    std::fs::set_permissions(tmp, std::fs::Permissions::from_mode(0o644))
        .and_then(|()| std::fs::rename(tmp, to))
        .map_err(|source| HfError::Io {
            path: to.to_path_buf(),
            source,
        })
}

fn part_name(stage: u32, stages: u32) -> String {
    format!("stage-{:05}-of-{stages:05}.safetensors", stage + 1)
}

/// Writes stage `stage` of `stages`' adapters into `out` as PEFT's
/// `adapter_model.safetensors` and `adapter_config.json` (see the module
/// docs for how a pipeline's stages make one adapter). `base_model` goes
/// into `base_model_name_or_path` and `revision`. Returns the adapter file (which another
/// stage may complete).
pub fn save_stage(
    model: &TransformerLm,
    layout: &StageLayout,
    config: &LoraConfig,
    stage: u32,
    stages: u32,
    out: &Path,
    base_model: &BaseModel,
) -> Result<PathBuf, HfError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| HfError::Io { path, source }
    };
    std::fs::create_dir_all(out).map_err(io(out))?;
    let writer = format!("stage{stage}-{}", std::process::id());
    let tensors = stage_tensors(model, layout);
    let adapter = out.join(ADAPTER_FILE);
    let all = if stages <= 1 {
        Some(tensors)
    } else {
        let parts = out.join(PARTS_DIR);
        std::fs::create_dir_all(&parts).map_err(io(&parts))?;
        let part = parts.join(part_name(stage, stages));
        let tmp = parts.join(format!(".{}.tmp-{writer}", part_name(stage, stages)));
        write_safetensors(&tmp, &tensors)?;
        rename_into_place(&tmp, &part)?;
        gather_parts(&parts, stages)?
    };
    if let Some(all) = all {
        let tmp = out.join(format!(".{ADAPTER_FILE}.tmp-{writer}"));
        write_safetensors(&tmp, &all)?;
        rename_into_place(&tmp, &adapter)?;
        let config_path = out.join(CONFIG_FILE);
        let tmp = out.join(format!(".{CONFIG_FILE}.tmp-{writer}"));
        let text = serde_json::to_string_pretty(&config_json(config, base_model)).expect("JSON");
        std::fs::write(&tmp, text).map_err(io(&tmp))?;
        rename_into_place(&tmp, &config_path)?;
    }
    Ok(adapter)
}

/// Every stage's part, once all are in place (`None` before).
#[allow(clippy::type_complexity)]
fn gather_parts(
    parts: &Path,
    stages: u32,
) -> Result<Option<Vec<(String, Vec<usize>, Vec<f32>)>>, HfError> {
    let mut all = Vec::new();
    for stage in 0..stages {
        let path = parts.join(part_name(stage, stages));
        if !path.exists() {
            return Ok(None); // not yet: the stage that writes the last part writes the adapter
        }
        all.extend(
            read_safetensors(&path)?
                .into_iter()
                .map(|(name, (dims, values))| (name, dims, values)),
        );
    }
    all.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(Some(all))
}

/// Replaces the factors of a stage with attached adapters by those of the
/// PEFT adapter in `dir` (the layers this stage holds; `lm_head`'s on the
/// last stage). `config` is the stage's; the file's `r`, `lora_alpha` and
/// targets must match it, and every factor the stage holds must be in the file.
pub fn load_stage(
    model: TransformerLm,
    layout: &StageLayout,
    config: &LoraConfig,
    dir: &Path,
) -> Result<TransformerLm, HfError> {
    let saved = read_config(dir)?;
    let mut wanted = config.target_modules.clone();
    wanted.sort();
    if saved.rank != config.rank || saved.alpha != config.alpha || saved.target_modules != wanted {
        return Err(HfError::Index {
            path: dir.join(CONFIG_FILE),
            problem: format!(
                "r {} / lora_alpha {} / target_modules {:?}, but the job's adapters are r {} / alpha {} / {:?}",
                saved.rank, saved.alpha, saved.target_modules, config.rank, config.alpha, wanted
            ),
        });
    }
    let path = dir.join(ADAPTER_FILE);
    let mut file = read_safetensors(&path)?;
    let mut values = BTreeMap::new();
    for adapted in stage_adapters(&model, layout) {
        let names = factor_names(&adapted.hf_path);
        for (name, factor) in names.iter().zip([&adapted.adapter.a, &adapted.adapter.b]) {
            let (dims, data) = file
                .remove(name)
                .ok_or_else(|| tensor_error(&path, format!("no tensor {name}")))?;
            // PEFT's [out, in] is the transpose of burn's factor.
            let ours = factor.val().dims();
            if dims != [ours[1], ours[0]] {
                return Err(tensor_error(
                    &path,
                    format!(
                        "{name}: shape {dims:?}, expected [{}, {}]",
                        ours[1], ours[0]
                    ),
                ));
            }
            // Transposed here, on the host, so the parameter is laid out
            // as the trained one was: a transposed view would take other
            // matmul kernels, and the logits would differ in their last bits.
            let (rows, cols) = (dims[0], dims[1]);
            let ours_layout: Vec<f32> = (0..cols)
                .flat_map(|c| data.iter().skip(c).step_by(cols).take(rows).copied())
                .collect();
            values.insert(factor.id.val(), TensorData::new(ours_layout, [cols, rows]));
        }
    }
    Ok(model.map(&mut Replace(values)))
}

/// Sets the factors named by ParamId to new values (in burn's layout),
/// keeping each parameter's id and gradient requirement.
struct Replace(BTreeMap<u64, TensorData>);

impl ModuleMapper for Replace {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let Some(data) = self.0.remove(&param.id.val()) else {
            return param;
        };
        param.map(|old| {
            let device = old.device();
            let value = Tensor::<D>::from_data(data, &device).cast(old.dtype());
            if old.is_require_grad() {
                value.require_grad()
            } else {
                value
            }
        })
    }
}
