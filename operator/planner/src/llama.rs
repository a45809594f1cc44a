//! Llama-family decoder-only models as Hugging Face describes them in
//! `config.json` (`LlamaForCausalLM`, `MistralForCausalLM`,
//! `Qwen2ForCausalLM`, `Qwen3ForCausalLM`): token embedding, `layers`
//! pre-norm blocks of RMSNorm → attention with rotary positions and
//! grouped-query attention (`keyValueHeads` ≤ `attentionHeads`) → RMSNorm →
//! SwiGLU MLP (gate, up, down), a final RMSNorm and an output head, tied to
//! the embedding or not. No learned position embeddings (RoPE has no
//! weights). Qwen3 adds an RMSNorm over each head of q and k.
//! `Phi3ForCausalLM` (Phi-3, Phi-3.5, Phi-4-mini) is the same block with q,
//! k and v in one matrix (`qkv_proj`) and gate and up in another
//! (`gate_up_proj`), RoPE over part of each head (`partial_rotary_factor`)
//! and LongRoPE scaling.
//! `Gemma3ForCausalLM` (text) and `Gemma2ForCausalLM` keep the weights'
//! names but not the function: GeGLU (`gelu_pytorch_tanh`), RMSNorm over
//! `1 + weight`, embeddings scaled by √hidden, a norm after each sublayer
//! as well as before, `query_pre_attn_scalar` in place of head_dim in the
//! attention scale, and sliding-window layers beside global ones
//! ([`GemmaAttention`]); Gemma 3 normalises q and k per head as Qwen3 does,
//! Gemma 2 soft-caps the attention scores and the final logits.
//!
//! Parameter counts follow the Hugging Face modules exactly, so they equal
//! the published counts (tests below, from the models' public config values).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::limits::{self, Bound};
use crate::target_module::TargetModule;

/// Which Hugging Face architecture a config names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum LlamaArchitecture {
    /// `LlamaForCausalLM` (Llama 2, Llama 3.x, and the many models built on it).
    #[serde(rename = "LlamaForCausalLM")]
    Llama,
    /// `MistralForCausalLM`: Llama's blocks (sliding-window attention does not change the weights).
    #[serde(rename = "MistralForCausalLM")]
    Mistral,
    /// `Qwen2ForCausalLM`: Llama's blocks with biases on q, k and v.
    #[serde(rename = "Qwen2ForCausalLM")]
    Qwen2,
    /// `Qwen3ForCausalLM`: Llama's blocks with an RMSNorm over each head of q
    /// and of k (`q_norm`, `k_norm`, before RoPE), an explicit `head_dim`
    /// and no q/k/v biases.
    #[serde(rename = "Qwen3ForCausalLM")]
    Qwen3,
    /// `Phi3ForCausalLM` (Phi-3, Phi-3.5, Phi-4-mini): Llama's blocks with q,
    /// k and v fused into `qkv_proj` and gate and up into `gate_up_proj`,
    /// no biases, and RoPE over `partial_rotary_factor` of each head.
    #[serde(rename = "Phi3ForCausalLM")]
    Phi3,
    /// `Gemma3ForCausalLM` (Gemma 3 1B, and the text part of the larger
    /// ones): Llama's linears with GeGLU, Gemma's RMSNorm (`1 + weight`),
    /// four norms a block, per-head q/k norms and sliding-window layers
    /// with their own RoPE base.
    #[serde(rename = "Gemma3ForCausalLM")]
    Gemma3,
    /// `Gemma2ForCausalLM`: Gemma 3's block without q/k norms, with soft-capped
    /// attention scores and final logits, alternating sliding and global layers.
    #[serde(rename = "Gemma2ForCausalLM")]
    Gemma2,
}

impl LlamaArchitecture {
    pub const ALL: [LlamaArchitecture; 7] = [
        LlamaArchitecture::Llama,
        LlamaArchitecture::Mistral,
        LlamaArchitecture::Qwen2,
        LlamaArchitecture::Qwen3,
        LlamaArchitecture::Phi3,
        LlamaArchitecture::Gemma3,
        LlamaArchitecture::Gemma2,
    ];

    pub fn hf_name(self) -> &'static str {
        match self {
            LlamaArchitecture::Llama => "LlamaForCausalLM",
            LlamaArchitecture::Mistral => "MistralForCausalLM",
            LlamaArchitecture::Qwen2 => "Qwen2ForCausalLM",
            LlamaArchitecture::Qwen3 => "Qwen3ForCausalLM",
            LlamaArchitecture::Phi3 => "Phi3ForCausalLM",
            LlamaArchitecture::Gemma3 => "Gemma3ForCausalLM",
            LlamaArchitecture::Gemma2 => "Gemma2ForCausalLM",
        }
    }

    /// Whether each block normalises q and k per head (`self_attn.q_norm`,
    /// `self_attn.k_norm`, each `head_dim` weights).
    pub fn qk_norm(self) -> bool {
        matches!(self, LlamaArchitecture::Qwen3 | LlamaArchitecture::Gemma3)
    }

    /// Gemma 2 or 3: GeGLU, RMSNorm over `1 + weight`, √hidden-scaled
    /// embeddings and two more norms a block (`pre_feedforward_layernorm`,
    /// `post_feedforward_layernorm`).
    pub fn gemma(self) -> bool {
        matches!(self, LlamaArchitecture::Gemma3 | LlamaArchitecture::Gemma2)
    }

    /// Whether q, k, v and gate, up are fused matrices (`qkv_proj`,
    /// `gate_up_proj`): the same weights as Llama's, in fewer tensors.
    pub fn fused_projections(self) -> bool {
        self == LlamaArchitecture::Phi3
    }

    /// The linear modules of one block, attention's then the MLP's.
    pub fn block_linears(self) -> &'static [TargetModule] {
        use TargetModule::*;
        if self.fused_projections() {
            &[QkvProj, OProj, GateUpProj, DownProj]
        } else {
            &TargetModule::BLOCK_LINEARS
        }
    }

    /// What LoRA may target, as PEFT names the modules: the block linears and `lm_head`.
    pub fn lora_targets(self) -> Vec<TargetModule> {
        let mut all = self.block_linears().to_vec();
        all.push(TargetModule::LmHead);
        all
    }
}

impl TargetModule {
    /// `(d_in, d_out)` of the module's weight in `shape` (as `nn.Linear(d_in, d_out)`).
    pub fn dims(self, shape: &LlamaShape) -> (u64, u64) {
        let h = u64::from(shape.hidden);
        let i = u64::from(shape.intermediate);
        let (q, kv) = (shape.q_dim(), shape.kv_dim());
        match self {
            TargetModule::QProj => (h, q),
            TargetModule::KProj | TargetModule::VProj => (h, kv),
            TargetModule::OProj => (q, h),
            TargetModule::GateProj | TargetModule::UpProj => (h, i),
            TargetModule::DownProj => (i, h),
            TargetModule::LmHead => (h, u64::from(shape.vocabulary)),
            TargetModule::QkvProj => (h, q + 2 * kv),
            TargetModule::GateUpProj => (h, 2 * i),
        }
    }
}

/// The shape of a Llama-family model, plus the training sequence length.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LlamaShape {
    pub architecture: LlamaArchitecture,
    /// Decoder blocks (`num_hidden_layers`).
    pub layers: u32,
    /// Hidden size h (`hidden_size`).
    pub hidden: u32,
    /// SwiGLU inner size (`intermediate_size`).
    pub intermediate: u32,
    /// Query heads (`num_attention_heads`).
    pub attention_heads: u32,
    /// Key/value heads (`num_key_value_heads`; equal to the query heads
    /// without grouped-query attention).
    pub key_value_heads: u32,
    /// Per-head size (`head_dim`; hidden / heads unless the config says otherwise).
    pub head_dim: u32,
    /// Vocabulary size (`vocab_size`).
    pub vocabulary: u32,
    /// Whether the output head is the embedding matrix (`tie_word_embeddings`).
    pub tied_embeddings: bool,
    /// Biases on q, k, v and o (Llama's `attention_bias`); Qwen2 has them on q, k and v only.
    pub attention_bias: bool,
    /// Biases on gate, up and down (Llama's `mlp_bias`).
    pub mlp_bias: bool,
    /// RoPE base (`rope_theta`).
    pub rope_theta: f64,
    /// RMSNorm epsilon (`rms_norm_eps`).
    pub rms_norm_eps: f64,
    /// Llama 3's RoPE frequency scaling (`rope_scaling` with `rope_type: llama3`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_scaling: Option<RopeScaling>,
    /// LongRoPE (`rope_scaling` with `rope_type: longrope`: Phi-3 128k,
    /// Phi-3.5, Phi-4-mini).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub long_rope: Option<LongRope>,
    /// The fraction of each head RoPE rotates (`partial_rotary_factor`;
    /// Phi-4-mini 0.75): its first `head_dim × this` values; all of it when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partial_rotary_factor: Option<f64>,
    /// Gemma 2 and 3's attention and output beyond Llama's; absent for the
    /// other architectures.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gemma: Option<Box<GemmaAttention>>,
    /// Stored dtype of the checkpoint (`torch_dtype`, e.g. `bfloat16`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub torch_dtype: Option<String>,
    /// Tokens per training sample.
    pub sequence_length: u32,
}

/// How one Gemma layer attends (`layer_types`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum LayerAttention {
    /// Each query sees the `slidingWindow` most recent tokens, itself included.
    #[serde(rename = "sliding_attention")]
    Sliding,
    /// Each query sees every earlier token.
    #[serde(rename = "full_attention")]
    Full,
}

/// What Gemma 2 and 3 attend and output with, beyond Llama's blocks. None of
/// it has weights: it changes the function, not the parameter count.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GemmaAttention {
    /// q·kᵀ is scaled by this to the power −½ (`query_pre_attn_scalar`),
    /// not by head_dim's.
    pub query_pre_attn_scalar: f64,
    /// Tokens a sliding layer's query sees, itself included (`sliding_window`).
    pub sliding_window: u32,
    /// Each layer's attention, in order (`layer_types`; older Gemma 3 configs
    /// give `sliding_window_pattern` n instead: every n-th layer global).
    pub layer_types: Vec<LayerAttention>,
    /// RoPE base of the sliding layers (Gemma 3's `rope_local_base_freq`);
    /// the global layers turn with `ropeTheta`. Gemma 2's layers share one base.
    pub local_rope_theta: f64,
    /// Linear RoPE scaling of the global layers (`rope_scaling` of type
    /// `linear`: Gemma 3 4B and larger, factor 8): their frequencies divided by it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub global_rope_factor: Option<f64>,
    /// Gemma 2's attention soft-capping: scores become cap · tanh(scores / cap)
    /// (`attn_logit_softcapping`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attn_logit_softcapping: Option<f64>,
    /// Soft-capping of the output logits, cap · tanh(logits / cap)
    /// (`final_logit_softcapping`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub final_logit_softcapping: Option<f64>,
}

/// `rope_scaling` of `rope_type: llama3` (Llama 3.1, 3.2): the only scaling
/// Headroom's worker implements; other types are refused when read.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RopeScaling {
    /// How much slower the longest wavelengths turn.
    pub factor: f32,
    /// Wavelengths longer than original / low turn `factor` times slower.
    pub low_freq_factor: f32,
    /// Wavelengths shorter than original / high are kept.
    pub high_freq_factor: f32,
    /// The context length the model was pretrained with.
    pub original_max_position_embeddings: f32,
}

/// `rope_scaling` of `rope_type: longrope`, as transformers computes it
/// (`_compute_longrope_parameters`): each rotated pair's inverse frequency
/// is divided by its factor — `shortFactor` for sequences up to
/// `originalMaxPositionEmbeddings`, `longFactor` beyond — and cos and sin
/// are multiplied by `attentionFactor`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LongRope {
    /// One factor per rotated pair, for sequences up to the original length.
    pub short_factor: Vec<f32>,
    /// One factor per rotated pair, for longer sequences.
    pub long_factor: Vec<f32>,
    /// The context length (tokens) the model was pretrained with.
    pub original_max_position_embeddings: u32,
    /// cos and sin are scaled by it: `attention_factor` when the config
    /// gives one, else √(1 + ln factor / ln original) for a factor above 1
    /// (factor: `factor`, or `max_position_embeddings` / original).
    pub attention_factor: f64,
}

/// A `config.json` Headroom cannot plan from, with the key at fault.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("config.json: {key}: {problem}")]
pub struct ConfigError {
    pub key: &'static str,
    pub problem: String,
}

fn bad(key: &'static str, problem: impl Into<String>) -> ConfigError {
    ConfigError {
        key,
        problem: problem.into(),
    }
}

/// What `rope_scaling` asks for beyond the default RoPE.
enum Scaling {
    Llama3(RopeScaling),
    LongRope(LongRope),
}

/// `rope_scaling`, or transformers 5's `rope_parameters`, when not null.
fn rope_dict(v: &Value) -> Option<&Value> {
    v.get("rope_scaling")
        .filter(|s| !s.is_null())
        .or_else(|| v.get("rope_parameters").filter(|s| !s.is_null()))
}

/// Reads `rope_scaling`: absent, null, Llama 3's scaling or LongRoPE
/// (`rotary_dim`: the values of a head RoPE rotates, one factor per pair).
/// transformers 5 writes it as `rope_parameters` (with `rope_type: default`
/// when there is no scaling).
fn rope_scaling(
    v: &Value,
    architecture: LlamaArchitecture,
    rotary_dim: u32,
) -> Result<Option<Scaling>, ConfigError> {
    let Some(s) = rope_dict(v) else {
        return Ok(None);
    };
    let kind = s
        .get("rope_type")
        .or_else(|| s.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("(none)");
    if kind == "default" {
        return Ok(None);
    }
    // transformers' Phi3Config reads the older names "su" and "yarn" as longrope.
    let longrope = kind == "longrope"
        || (architecture == LlamaArchitecture::Phi3 && matches!(kind, "su" | "yarn"));
    if longrope {
        return long_rope(v, s, architecture, rotary_dim).map(|l| Some(Scaling::LongRope(l)));
    }
    if kind != "llama3" {
        return Err(bad(
            "rope_scaling",
            format!(
                "rope_type {kind:?} is not supported; Headroom runs the default RoPE, llama3 and longrope scaling"
            ),
        ));
    }
    let num = |key: &str, default: Option<f64>| -> Result<f32, ConfigError> {
        s.get(key)
            .and_then(Value::as_f64)
            .or(default)
            .filter(|x| x.is_finite() && *x > 0.0)
            .map(|x| x as f32)
            .ok_or_else(|| bad("rope_scaling", format!("{key} must be a positive number")))
    };
    let scaling = RopeScaling {
        factor: num("factor", None)?,
        low_freq_factor: num("low_freq_factor", Some(1.0))?,
        high_freq_factor: num("high_freq_factor", Some(4.0))?,
        original_max_position_embeddings: num("original_max_position_embeddings", Some(8192.0))?,
    };
    if scaling.high_freq_factor <= scaling.low_freq_factor {
        return Err(bad(
            "rope_scaling",
            "high_freq_factor must be greater than low_freq_factor",
        ));
    }
    Ok(Some(Scaling::Llama3(scaling)))
}

/// LongRoPE's parameters from `config` and its rope dictionary `s`, as
/// transformers derives them.
fn long_rope(
    config: &Value,
    s: &Value,
    architecture: LlamaArchitecture,
    rotary_dim: u32,
) -> Result<LongRope, ConfigError> {
    let pairs = rotary_dim as usize / 2;
    let factors = |key: &str| -> Result<Vec<f32>, ConfigError> {
        let values: Option<Vec<f32>> = s.get(key).and_then(Value::as_array).and_then(|list| {
            list.iter()
                .map(|x| x.as_f64().filter(|x| x.is_finite() && *x > 0.0))
                .map(|x| x.map(|x| x as f32))
                .collect()
        });
        let values = values.ok_or_else(|| {
            bad(
                "rope_scaling",
                format!("longrope needs {key}, a list of positive numbers"),
            )
        })?;
        if values.len() != pairs {
            return Err(bad(
                "rope_scaling",
                format!(
                    "{key} has {} factors; longrope needs one per rotated pair of a head, {pairs} (the {rotary_dim} values RoPE rotates)",
                    values.len()
                ),
            ));
        }
        Ok(values)
    };
    let positive = |x: &Value| x.as_f64().filter(|x| x.is_finite() && *x > 0.0);
    // Phi-3 keeps the pretraining length beside rope_scaling, and
    // transformers prefers it there (its default: 4096); other models keep
    // it inside, defaulting to max_position_embeddings.
    let original = if architecture == LlamaArchitecture::Phi3 {
        config
            .get("original_max_position_embeddings")
            .or_else(|| s.get("original_max_position_embeddings"))
            .map_or(Some(4096.0), positive)
    } else {
        s.get("original_max_position_embeddings")
            .or_else(|| config.get("max_position_embeddings"))
            .and_then(positive)
    };
    let original = original.filter(|o| *o >= 2.0).ok_or_else(|| {
        bad(
            "original_max_position_embeddings",
            "longrope needs the pretraining context length, a whole number of at least 2",
        )
    })?;
    let factor = match s.get("factor").filter(|f| !f.is_null()) {
        Some(f) => positive(f)
            .ok_or_else(|| bad("rope_scaling", "factor must be a positive number"))?,
        None => {
            config
                .get("max_position_embeddings")
                .and_then(positive)
                .ok_or_else(|| {
                    bad(
                        "max_position_embeddings",
                        "longrope without a factor needs it (factor = max_position_embeddings / original_max_position_embeddings)",
                    )
                })?
                / original
        }
    };
    let attention_factor = match s.get("attention_factor").filter(|f| !f.is_null()) {
        Some(f) => positive(f)
            .ok_or_else(|| bad("rope_scaling", "attention_factor must be a positive number"))?,
        None if factor <= 1.0 => 1.0,
        None => (1.0 + factor.ln() / original.ln()).sqrt(),
    };
    Ok(LongRope {
        short_factor: factors("short_factor")?,
        long_factor: factors("long_factor")?,
        original_max_position_embeddings: original as u32,
        attention_factor,
    })
}

/// `partial_rotary_factor` (top level, or in transformers 5's
/// `rope_parameters`): `None` when RoPE rotates whole heads. Only Phi-3's
/// attention rotates part of a head; transformers' other models here
/// rotate whole heads, and fail on a smaller factor.
fn partial_rotary_factor(
    v: &Value,
    architecture: LlamaArchitecture,
    head_dim: u32,
) -> Result<Option<f64>, ConfigError> {
    let Some(f) = v
        .get("partial_rotary_factor")
        .or_else(|| rope_dict(v).and_then(|s| s.get("partial_rotary_factor")))
        .filter(|f| !f.is_null())
    else {
        return Ok(None);
    };
    let f = f
        .as_f64()
        .filter(|f| *f > 0.0 && *f <= 1.0)
        .ok_or_else(|| {
            bad(
                "partial_rotary_factor",
                format!("{f} must be a number above 0 and at most 1"),
            )
        })?;
    if f < 1.0 && architecture != LlamaArchitecture::Phi3 {
        return Err(bad(
            "partial_rotary_factor",
            format!(
                "{f}: {} rotates whole heads (1.0); only Phi3ForCausalLM rotates part of each",
                architecture.hf_name()
            ),
        ));
    }
    let rotated = (f64::from(head_dim) * f) as u32;
    if rotated < 2 || !rotated.is_multiple_of(2) {
        return Err(bad(
            "partial_rotary_factor",
            format!(
                "{f} of head_dim {head_dim} rotates {rotated} values; RoPE rotates pairs, so it must be an even number of at least 2"
            ),
        ));
    }
    Ok((f < 1.0).then_some(f))
}

/// Refuses a sliding attention window shorter than the training sequence:
/// the worker attends to every earlier token (plain causal attention), so
/// it would compute another function than the model's. Mistral and Phi-3
/// always slide when `sliding_window` is set; Qwen2 and Qwen3 only with
/// `use_sliding_window`.
fn check_sliding_window(
    v: &Value,
    architecture: LlamaArchitecture,
    sequence_length: u32,
) -> Result<(), ConfigError> {
    let slides = match architecture {
        LlamaArchitecture::Mistral | LlamaArchitecture::Phi3 => true,
        LlamaArchitecture::Qwen2 | LlamaArchitecture::Qwen3 => v
            .get("use_sliding_window")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        // Gemma's sliding layers are run as such (not checked here).
        LlamaArchitecture::Llama | LlamaArchitecture::Gemma3 | LlamaArchitecture::Gemma2 => false,
    };
    let Some(window) = v.get("sliding_window").and_then(Value::as_u64) else {
        return Ok(());
    };
    if slides && u64::from(sequence_length) > window {
        return Err(bad(
            "sliding_window",
            format!(
                "{window}: each token attends to the last {window} tokens only, and Headroom's attention is full causal attention; train with a sequence length of at most {window} tokens (not {sequence_length})"
            ),
        ));
    }
    Ok(())
}

/// `key`'s value when present and not null: a finite positive number.
fn positive_number(v: &Value, key: &'static str) -> Result<Option<f64>, ConfigError> {
    match v.get(key).filter(|x| !x.is_null()) {
        None => Ok(None),
        Some(x) => x
            .as_f64()
            .filter(|x| x.is_finite() && *x > 0.0)
            .map(Some)
            .ok_or_else(|| bad(key, format!("{x} must be a positive number"))),
    }
}

/// A Gemma RoPE dictionary's scaling (`key` names it in messages): none
/// for `default`, the factor for `linear`; other types are refused.
fn gemma_rope_factor(
    rope: Option<&Value>,
    key: &'static str,
    architecture: LlamaArchitecture,
) -> Result<Option<f64>, ConfigError> {
    let Some(rope) = rope.filter(|r| !r.is_null()) else {
        return Ok(None);
    };
    let kind = rope
        .get("rope_type")
        .or_else(|| rope.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    match kind {
        "default" => Ok(None),
        // Gemma 3 scales its global layers only; Gemma 2 has one RoPE for all.
        "linear"
            if architecture == LlamaArchitecture::Gemma3
                && key != "rope_parameters.sliding_attention" =>
        {
            positive_number(rope, "factor")
                .map_err(|e| bad(key, e.problem))?
                .ok_or_else(|| bad(key, "rope_type \"linear\" needs a positive factor"))
                .map(Some)
        }
        other => Err(bad(
            key,
            format!(
                "rope_type {other:?} is not supported for {}; Headroom runs the default RoPE{}",
                architecture.hf_name(),
                if architecture == LlamaArchitecture::Gemma3 {
                    " and linear scaling on the global layers"
                } else {
                    ""
                }
            ),
        )),
    }
}

/// Gemma 2's or 3's attention, and the RoPE base of its global layers, as
/// transformers reads the config (its defaults where a key is absent).
/// Refuses what the worker does not run, naming the key.
fn gemma_attention(
    v: &Value,
    architecture: LlamaArchitecture,
    layers: u32,
) -> Result<(GemmaAttention, f64), ConfigError> {
    let gemma3 = architecture == LlamaArchitecture::Gemma3;
    if v.get("use_bidirectional_attention")
        .and_then(Value::as_bool)
        == Some(true)
    {
        return Err(bad(
            "use_bidirectional_attention",
            "true: Headroom trains causal language models; set it to false or null",
        ));
    }
    let query_pre_attn_scalar = positive_number(v, "query_pre_attn_scalar")?.unwrap_or(256.0);
    let sliding_window = match v.get("sliding_window").filter(|w| !w.is_null()) {
        None => 4096,
        Some(w) => w
            .as_u64()
            .and_then(|w| u32::try_from(w).ok())
            .filter(|w| *w > 0)
            .ok_or_else(|| bad("sliding_window", format!("{w} must be a positive integer")))?,
    };
    let layer_types = gemma_layer_types(v, gemma3, layers)?;
    let (global_theta, local_rope_theta, global_rope_factor) = gemma_rope(v, architecture)?;
    let attn_logit_softcapping = positive_number(v, "attn_logit_softcapping")?;
    if let (true, Some(cap)) = (gemma3, attn_logit_softcapping) {
        return Err(bad(
            "attn_logit_softcapping",
            format!(
                "{cap}: transformers' Gemma3ForCausalLM does not apply it, so a model trained with it would be another function; set it to null"
            ),
        ));
    }
    let final_logit_softcapping = positive_number(v, "final_logit_softcapping")?;
    Ok((
        GemmaAttention {
            query_pre_attn_scalar,
            sliding_window,
            layer_types,
            local_rope_theta,
            global_rope_factor,
            attn_logit_softcapping,
            final_logit_softcapping,
        },
        global_theta,
    ))
}

/// Which of Gemma's `layers` slide and which attend globally: the
/// config's `layer_types`, else transformers' default pattern.
fn gemma_layer_types(
    v: &Value,
    gemma3: bool,
    layers: u32,
) -> Result<Vec<LayerAttention>, ConfigError> {
    let layer_types = match v.get("layer_types").filter(|t| !t.is_null()) {
        Some(list) => {
            let types: Option<Vec<LayerAttention>> = list.as_array().and_then(|a| {
                a.iter()
                    .map(|t| match t.as_str() {
                        Some("sliding_attention") => Some(LayerAttention::Sliding),
                        Some("full_attention") => Some(LayerAttention::Full),
                        _ => None,
                    })
                    .collect()
            });
            let types = types.ok_or_else(|| {
                bad(
                    "layer_types",
                    format!("{list} must list \"sliding_attention\" or \"full_attention\" for each layer"),
                )
            })?;
            if types.len() != layers as usize {
                return Err(bad(
                    "layer_types",
                    format!("{} entries; num_hidden_layers is {layers}", types.len()),
                ));
            }
            types
        }
        None => {
            // transformers' defaults: Gemma 3 every sliding_window_pattern-th
            // layer global (6), Gemma 2 every second.
            let pattern = if gemma3 {
                match v.get("sliding_window_pattern").filter(|p| !p.is_null()) {
                    None => 6,
                    Some(p) => p.as_u64().filter(|p| *p > 0).ok_or_else(|| {
                        bad(
                            "sliding_window_pattern",
                            format!("{p} must be a positive integer"),
                        )
                    })?,
                }
            } else {
                2
            };
            (0..u64::from(layers))
                .map(|i| {
                    if (i + 1) % pattern != 0 {
                        LayerAttention::Sliding
                    } else {
                        LayerAttention::Full
                    }
                })
                .collect()
        }
    };
    Ok(layer_types)
}

/// Gemma's RoPE: `(global base, local base, global linear factor)`, as
/// transformers reads them (its defaults where a key is absent).
fn gemma_rope(
    v: &Value,
    architecture: LlamaArchitecture,
) -> Result<(f64, f64, Option<f64>), ConfigError> {
    let gemma3 = architecture == LlamaArchitecture::Gemma3;
    // transformers' default bases: Gemma 3 global 1e6 and local 1e4, Gemma 2 1e4.
    let default_theta = if gemma3 { 1_000_000.0 } else { 10_000.0 };
    let theta = |rope: Option<&Value>, default: f64| {
        rope.and_then(|r| r.get("rope_theta"))
            .and_then(Value::as_f64)
            .unwrap_or(default)
    };
    let per_type = v
        .get("rope_parameters")
        .filter(|p| p.get("full_attention").is_some() || p.get("sliding_attention").is_some());
    Ok(match per_type {
        // transformers 5 writes one dictionary per layer type.
        Some(p) => {
            let (full, sliding) = (p.get("full_attention"), p.get("sliding_attention"));
            gemma_rope_factor(sliding, "rope_parameters.sliding_attention", architecture)?;
            (
                theta(full, default_theta),
                theta(sliding, 10_000.0),
                gemma_rope_factor(full, "rope_parameters.full_attention", architecture)?,
            )
        }
        None => {
            let global = v
                .get("rope_theta")
                .and_then(Value::as_f64)
                .unwrap_or_else(|| theta(v.get("rope_parameters"), default_theta));
            let local = if gemma3 {
                v.get("rope_local_base_freq")
                    .and_then(Value::as_f64)
                    .unwrap_or(10_000.0)
            } else {
                global
            };
            (
                global,
                local,
                gemma_rope_factor(rope_dict(v), "rope_scaling", architecture)?,
            )
        }
    })
}

/// The Llama-family architecture the config's `architectures` names.
fn config_architecture(v: &Value) -> Result<LlamaArchitecture, ConfigError> {
    let names: Vec<&str> = v
        .get("architectures")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    LlamaArchitecture::ALL
        .into_iter()
        .find(|a| names.contains(&a.hf_name()))
        .ok_or_else(|| {
            bad(
                "architectures",
                format!(
                    "{names:?} is not a Llama-family model Headroom knows; supported: {}",
                    LlamaArchitecture::ALL
                        .map(LlamaArchitecture::hf_name)
                        .join(", ")
                ),
            )
        })
}

/// A required positive integer that fits a `u32`.
/// `key`'s value, a positive integer within `bound` (the bound of the
/// field `as_field` of `spec.model.transformer`).
fn bounded_int(
    v: &Value,
    key: &'static str,
    bound: Bound,
    as_field: &str,
) -> Result<u32, ConfigError> {
    let n = positive_int(v, key)?;
    check_bound(key, n, bound, as_field)?;
    Ok(n)
}

/// Refuses `value` of `key` outside `bound`: a checkpoint is held to the
/// sizes a job's own `spec.model.transformer` may have (`as_field` names
/// the field whose bound it is).
fn check_bound(
    key: &'static str,
    value: u32,
    bound: Bound,
    as_field: &str,
) -> Result<(), ConfigError> {
    if value > bound.max {
        Err(bad(
            key,
            format!(
                "{value} exceeds {}, the largest Headroom plans (the bound of spec.model.transformer.{as_field} too); this is not a model Headroom can train",
                bound.max
            ),
        ))
    } else if value < bound.min {
        Err(bad(
            key,
            format!(
                "{value} is below {}, the smallest Headroom plans (the bound of spec.model.transformer.{as_field} too)",
                bound.min
            ),
        ))
    } else {
        Ok(())
    }
}

fn positive_int(v: &Value, key: &'static str) -> Result<u32, ConfigError> {
    let n = v
        .get(key)
        .ok_or_else(|| bad(key, "missing"))?
        .as_u64()
        .ok_or_else(|| bad(key, "must be a positive integer"))?;
    u32::try_from(n)
        .ok()
        .filter(|n| *n > 0)
        .ok_or_else(|| bad(key, format!("{n} is out of range")))
}

/// `(attention heads, key/value heads, head dimension)` of a model of
/// `hidden` width: the key/value heads default to the attention heads and
/// must divide them; the head dimension defaults to `hidden / heads`.
fn config_heads(v: &Value, hidden: u32) -> Result<(u32, u32, u32), ConfigError> {
    let attention_heads = bounded_int(v, "num_attention_heads", limits::HEADS, "heads")?;
    let key_value_heads = match v.get("num_key_value_heads") {
        None | Some(Value::Null) => attention_heads,
        Some(_) => bounded_int(v, "num_key_value_heads", limits::HEADS, "heads")?,
    };
    if !attention_heads.is_multiple_of(key_value_heads) {
        return Err(bad(
            "num_key_value_heads",
            format!("{key_value_heads} must divide num_attention_heads ({attention_heads})"),
        ));
    }
    let head_dim = match v.get("head_dim") {
        None | Some(Value::Null) => {
            if !hidden.is_multiple_of(attention_heads) {
                return Err(bad(
                    "hidden_size",
                    format!(
                        "{hidden} is not a multiple of num_attention_heads ({attention_heads}) and no head_dim is given"
                    ),
                ));
            }
            hidden / attention_heads
        }
        Some(_) => bounded_int(v, "head_dim", limits::HEAD_DIM, "hidden")?,
    };
    Ok((attention_heads, key_value_heads, head_dim))
}

/// Refuses an MLP activation the worker does not build: SwiGLU's `silu`,
/// or Gemma's GeGLU `gelu_pytorch_tanh`.
fn check_activation(v: &Value, architecture: LlamaArchitecture) -> Result<(), ConfigError> {
    if architecture.gemma() {
        // transformers' Gemma reads hidden_activation (the Hub's configs
        // carry hidden_act beside it).
        let key = if v.get("hidden_activation").is_some_and(|a| !a.is_null()) {
            "hidden_activation"
        } else {
            "hidden_act"
        };
        if let Some(act) = v.get(key).and_then(Value::as_str)
            && act != "gelu_pytorch_tanh"
        {
            return Err(bad(
                key,
                format!("{act:?} is not supported; Gemma's MLP runs \"gelu_pytorch_tanh\""),
            ));
        }
    } else if let Some(act) = v.get("hidden_act").and_then(Value::as_str)
        && act != "silu"
    {
        return Err(bad(
            "hidden_act",
            format!("{act:?} is not supported; Llama-family MLPs use \"silu\""),
        ));
    }
    Ok(())
}

/// How a model encodes positions beyond the default RoPE: Gemma's layers
/// slide (the worker's attention does too) and keep a RoPE dictionary per
/// layer type; the others' RoPE is one, possibly scaled.
struct PositionEncoding {
    rope_scaling: Option<RopeScaling>,
    long_rope: Option<LongRope>,
    gemma: Option<Box<GemmaAttention>>,
    /// Gemma's global layers' RoPE base.
    gemma_theta: Option<f64>,
}

impl PositionEncoding {
    fn read(
        v: &Value,
        architecture: LlamaArchitecture,
        layers: u32,
        sequence_length: u32,
        rotary_dim: u32,
    ) -> Result<Self, ConfigError> {
        let none = PositionEncoding {
            rope_scaling: None,
            long_rope: None,
            gemma: None,
            gemma_theta: None,
        };
        if architecture.gemma() {
            let (gemma, global_theta) = gemma_attention(v, architecture, layers)?;
            return Ok(PositionEncoding {
                gemma: Some(Box::new(gemma)),
                gemma_theta: Some(global_theta),
                ..none
            });
        }
        check_no_softcapping(v, architecture)?;
        check_sliding_window(v, architecture, sequence_length)?;
        Ok(match rope_scaling(v, architecture, rotary_dim)? {
            None => none,
            Some(Scaling::Llama3(s)) => PositionEncoding {
                rope_scaling: Some(s),
                ..none
            },
            Some(Scaling::LongRope(l)) => PositionEncoding {
                long_rope: Some(l),
                ..none
            },
        })
    }
}

/// Refuses Gemma's soft-capping keys on the architectures that do not have it.
fn check_no_softcapping(v: &Value, architecture: LlamaArchitecture) -> Result<(), ConfigError> {
    for key in ["attn_logit_softcapping", "final_logit_softcapping"] {
        if let Some(cap) = v.get(key).filter(|c| !c.is_null()) {
            return Err(bad(
                key,
                format!(
                    "{cap}: {} has no soft-capping; only Gemma2ForCausalLM (and Gemma3ForCausalLM's final logits) do",
                    architecture.hf_name()
                ),
            ));
        }
    }
    Ok(())
}

impl LlamaShape {
    /// Reads a Hugging Face `config.json`; `sequence_length` is the training
    /// sample length (configs give only the maximum, `max_position_embeddings`).
    pub fn from_hf_config(text: &str, sequence_length: u32) -> Result<Self, ConfigError> {
        let v: Value =
            serde_json::from_str(text).map_err(|e| bad("(file)", format!("not JSON: {e}")))?;
        let architecture = config_architecture(&v)?;
        let flag =
            |key: &str, default: bool| v.get(key).and_then(Value::as_bool).unwrap_or(default);
        // Every size is bounded as it is read, before anything is built
        // from it (Gemma's layer list has an entry per layer).
        let hidden = bounded_int(&v, "hidden_size", limits::HIDDEN, "hidden")?;
        let (attention_heads, key_value_heads, head_dim) = config_heads(&v, hidden)?;
        if sequence_length == 0 {
            return Err(bad("(sequence length)", "must be at least 1"));
        }
        check_bound(
            "(sequence length)",
            sequence_length,
            limits::SEQUENCE_LENGTH,
            "sequenceLength",
        )?;
        check_activation(&v, architecture)?;
        // Qwen2 always has q/k/v biases and no `attention_bias` key; Phi-3 none.
        let attention_bias = match architecture {
            LlamaArchitecture::Qwen2 => true,
            LlamaArchitecture::Phi3 => false,
            _ => flag("attention_bias", false),
        };
        let mlp_bias = architecture != LlamaArchitecture::Phi3 && flag("mlp_bias", false);
        let layers = bounded_int(&v, "num_hidden_layers", limits::LAYERS, "layers")?;
        let partial_rotary_factor = partial_rotary_factor(&v, architecture, head_dim)?;
        let rotary_dim =
            partial_rotary_factor.map_or(head_dim, |f| (f64::from(head_dim) * f) as u32);
        let positions =
            PositionEncoding::read(&v, architecture, layers, sequence_length, rotary_dim)?;
        Ok(LlamaShape {
            architecture,
            layers,
            hidden,
            intermediate: bounded_int(
                &v,
                "intermediate_size",
                limits::FEED_FORWARD,
                "feedForward",
            )?,
            attention_heads,
            key_value_heads,
            head_dim,
            vocabulary: bounded_int(&v, "vocab_size", limits::VOCABULARY, "vocabulary")?,
            // transformers' Gemma configs tie unless told otherwise (the
            // Hub's gemma-3-1b config.json does not say).
            tied_embeddings: flag("tie_word_embeddings", architecture.gemma()),
            attention_bias,
            mlp_bias,
            // transformers 5 moved the base into `rope_parameters`; Gemma's
            // global layers' base is read with its other RoPE.
            rope_theta: positions.gemma_theta.unwrap_or_else(|| {
                v.get("rope_theta")
                    .or_else(|| v.get("rope_parameters").and_then(|p| p.get("rope_theta")))
                    .and_then(Value::as_f64)
                    .unwrap_or(10_000.0)
            }),
            rms_norm_eps: v
                .get("rms_norm_eps")
                .and_then(Value::as_f64)
                .unwrap_or(1e-6),
            rope_scaling: positions.rope_scaling,
            long_rope: positions.long_rope,
            partial_rotary_factor,
            gemma: positions.gemma,
            // transformers 5 writes `dtype`, earlier versions `torch_dtype`.
            torch_dtype: v
                .get("torch_dtype")
                .or_else(|| v.get("dtype"))
                .and_then(Value::as_str)
                .map(str::to_string),
            sequence_length,
        })
    }

    /// Checks a shape read elsewhere (the initializer's report of a
    /// checkpoint) as [`Self::from_hf_config`] checks config.json: every
    /// size within the bounds of `spec.model.transformer`, the key/value
    /// heads dividing the attention heads, Gemma's layer list one entry a
    /// layer. The error names the config.json key.
    pub fn check_bounds(&self) -> Result<(), ConfigError> {
        let sizes = [
            ("num_hidden_layers", self.layers, limits::LAYERS, "layers"),
            ("hidden_size", self.hidden, limits::HIDDEN, "hidden"),
            (
                "intermediate_size",
                self.intermediate,
                limits::FEED_FORWARD,
                "feedForward",
            ),
            (
                "num_attention_heads",
                self.attention_heads,
                limits::HEADS,
                "heads",
            ),
            (
                "num_key_value_heads",
                self.key_value_heads,
                limits::HEADS,
                "heads",
            ),
            ("head_dim", self.head_dim, limits::HEAD_DIM, "hidden"),
            (
                "vocab_size",
                self.vocabulary,
                limits::VOCABULARY,
                "vocabulary",
            ),
            (
                "(sequence length)",
                self.sequence_length,
                limits::SEQUENCE_LENGTH,
                "sequenceLength",
            ),
        ];
        for (key, value, bound, as_field) in sizes {
            check_bound(key, value, bound, as_field)?;
        }
        if !self.attention_heads.is_multiple_of(self.key_value_heads) {
            return Err(bad(
                "num_key_value_heads",
                format!(
                    "{} must divide num_attention_heads ({})",
                    self.key_value_heads, self.attention_heads
                ),
            ));
        }
        if let Some(g) = &self.gemma
            && g.layer_types.len() != self.layers as usize
        {
            return Err(bad(
                "layer_types",
                format!(
                    "{} entries; num_hidden_layers is {}",
                    g.layer_types.len(),
                    self.layers
                ),
            ));
        }
        Ok(())
    }

    /// The same model with the sequence length blanked: what a checkpoint's
    /// config.json and a plan must agree on.
    pub fn without_sequence(&self) -> LlamaShape {
        LlamaShape {
            sequence_length: 0,
            ..self.clone()
        }
    }

    /// The values of each head RoPE rotates (head_dim × `partial_rotary_factor`,
    /// rounded down as transformers rounds it).
    pub fn rotary_dim(&self) -> u32 {
        self.partial_rotary_factor
            .map_or(self.head_dim, |f| (f64::from(self.head_dim) * f) as u32)
    }

    /// Width of the query projection's output (heads × head_dim).
    pub fn q_dim(&self) -> u64 {
        u64::from(self.attention_heads) * u64::from(self.head_dim)
    }

    /// Width of the key (and of the value) projection's output.
    pub fn kv_dim(&self) -> u64 {
        u64::from(self.key_value_heads) * u64::from(self.head_dim)
    }

    /// One decoder block: q, k, v, o projections (with their biases where the
    /// architecture has them), gate/up/down, two RMSNorm weight vectors
    /// (Gemma: four), and Qwen3's and Gemma 3's per-head q and k norms
    /// (head_dim each).
    pub fn params_per_layer(&self) -> u64 {
        let h = u64::from(self.hidden);
        let i = u64::from(self.intermediate);
        let (q, kv) = (self.q_dim(), self.kv_dim());
        let mut attention = h * q + 2 * h * kv + q * h;
        if self.attention_bias {
            attention += q + 2 * kv;
            if self.architecture != LlamaArchitecture::Qwen2 {
                attention += h; // o_proj's bias (Llama's attention_bias)
            }
        }
        if self.architecture.qk_norm() {
            attention += 2 * u64::from(self.head_dim);
        }
        let mut mlp = 3 * h * i;
        if self.mlp_bias {
            mlp += 2 * i + h;
        }
        attention + mlp + self.norms_per_layer() * h
    }

    /// Hidden-wide norms a block holds: two, Gemma's four (a norm before and
    /// after each sublayer).
    pub fn norms_per_layer(&self) -> u64 {
        if self.architecture.gemma() { 4 } else { 2 }
    }

    /// The token embedding (first pipeline stage).
    pub fn embedding_params(&self) -> u64 {
        u64::from(self.vocabulary) * u64::from(self.hidden)
    }

    /// The final RMSNorm and, when untied, the output head (last stage).
    pub fn head_params(&self) -> u64 {
        let h = u64::from(self.hidden);
        let head = if self.tied_embeddings {
            0
        } else {
            self.embedding_params()
        };
        h + head
    }

    pub fn total_params(&self) -> u64 {
        u64::from(self.layers) * self.params_per_layer()
            + self.embedding_params()
            + self.head_params()
    }

    /// Activation bytes one block keeps for backward, per micro-batch of `b`
    /// samples at `e` bytes an element (no dropout in these models). Per
    /// token: the first RMSNorm's input and output (2h), q, k, v (q + 2kv),
    /// the attention output (h), the second RMSNorm's input and output (2h),
    /// and SwiGLU's gate, up, SiLU(gate) and product (4i); per head, the
    /// softmax output (s² per sample); with Qwen3's q/k norms, also q and k
    /// before their norm (q + kv). Checkpointed: the block's input only.
    /// A first-principles count (the published way, [`crate::backend::ActivationCount`]);
    /// the worker's backends count what burn keeps instead
    /// ([`Self::burn_block_activation_bytes`]).
    pub fn block_activation_bytes(&self, b: u64, e: u64, checkpointed: bool) -> u64 {
        let s = u64::from(self.sequence_length);
        let h = u64::from(self.hidden);
        if checkpointed {
            return s * b * h * e;
        }
        let mut per_token =
            5 * h + self.q_dim() + 2 * self.kv_dim() + 4 * u64::from(self.intermediate);
        if self.architecture.qk_norm() {
            per_token += self.q_dim() + self.kv_dim();
        }
        if self.architecture.gemma() {
            per_token += gemma_extra_per_token(self);
        }
        s * b * per_token * e + u64::from(self.attention_heads) * s * s * b * e
    }

    /// Activation bytes burn's autodiff keeps for one block of the Headroom
    /// worker's Llama model (`worker/src/model/llama.rs`), per micro-batch of
    /// `b` at `e` bytes an element, counted op by op. Per token:
    /// * each RMSNorm keeps its input (for the square), the normalised
    ///   tensor (for γ) and its output (for the projections): 3h, twice;
    /// * q and k: the rotated tensors the attention op keeps (q + kv; GQA
    ///   reads k where it lies, no copy per query head). RoPE's products
    ///   keep only their constant side, the cos and sin tables (a product
    ///   keeps one operand for the other's gradient, and the tables take
    ///   none), so neither the projection's output nor the rotated-half
    ///   copy is kept;
    /// * v: the op keeps v itself (a view of the projection's output): kv;
    /// * the op's output (for backward's rowsum(dO ∘ O)) and the merged
    ///   heads' contiguous copy the output projection keeps: 2q;
    /// * the gated MLP: gate's and up's outputs (kept by the worker's one
    ///   gating op, which recomputes the sigmoid or tanh in backward) and
    ///   the product (kept by down): 3i;
    /// * Qwen3's per-head q and k norms: each keeps its input (the
    ///   projection's output), the normalised tensor (for γ) and one rms
    ///   per head and token; its output goes to RoPE, which keeps only the
    ///   tables: 2q + 2kv + heads + key-value heads;
    /// * Phi-3's fused `qkv_proj`: v is a view of the fused output, so the
    ///   op's v keeps all of it, q and k too: q + kv more. (The fused
    ///   `gate_up_proj` keeps what gate and up would: 2i as one tensor.)
    ///
    /// * Gemma: its two more norms (`gemma_norms_per_token`).
    ///
    /// Per head and token, the op's logsumexp (one value); no `s × s` map
    /// outlives the op (`worker/src/model/lean/attention.rs`). Per block,
    /// RoPE's cos and sin tables (s × the rotated part of a head each, f32),
    /// which the rotations keep. Checkpointed: the block's input only.
    pub fn burn_block_activation_bytes(&self, b: u64, e: u64, checkpointed: bool) -> u64 {
        let s = u64::from(self.sequence_length);
        let h = u64::from(self.hidden);
        if checkpointed {
            return s * b * h * e;
        }
        let (q, kv, i) = (self.q_dim(), self.kv_dim(), u64::from(self.intermediate));
        let mut per_token = 6 * h + 3 * q + 2 * kv + 3 * i + u64::from(self.attention_heads);
        if self.architecture.qk_norm() {
            per_token +=
                2 * q + 2 * kv + u64::from(self.attention_heads) + u64::from(self.key_value_heads);
        }
        if self.architecture.fused_projections() {
            per_token += q + kv;
        }
        if self.architecture.gemma() {
            per_token += gemma_norms_per_token(self);
        }
        let rope_tables = 2 * s * u64::from(self.rotary_dim()) * 4;
        s * b * per_token * e + rope_tables
    }
}

/// What a Gemma block keeps per token beyond a Llama block of the same
/// shape, counted op by op as autograd keeps it: its two more norms
/// (post-attention on the sublayer's output, pre- and post-feed-forward),
/// each keeping its input, the normalised tensor and its output (3h,
/// twice), and GeGLU's tanh-approximated GELU, which keeps the gate's
/// output, its tanh and 1 + tanh where SiLU keeps the gate's output and its
/// sigmoid (i). The worker's gating op keeps the same two inputs for GeGLU
/// as for SwiGLU, so its count ([`LlamaShape::burn_block_activation_bytes`])
/// takes the norms only. Reasoned from the ops, not calibrated: the
/// calibration covers Llama's blocks.
fn gemma_extra_per_token(l: &LlamaShape) -> u64 {
    gemma_norms_per_token(l) + u64::from(l.intermediate)
}

/// Gemma's two more norms' kept tensors per token (3h, twice).
fn gemma_norms_per_token(l: &LlamaShape) -> u64 {
    6 * u64::from(l.hidden)
}

#[cfg(test)]
mod tests {
    use super::*;

    // Public config.json values (Hugging Face model cards), reduced to the
    // keys that shape the weights.
    const LLAMA_2_7B: &str = r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
        "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 32, "vocab_size": 32000, "tie_word_embeddings": false,
        "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "torch_dtype": "float16",
        "max_position_embeddings": 4096}"#;
    const MISTRAL_7B_V01: &str = r#"{"architectures": ["MistralForCausalLM"], "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "vocab_size": 32000, "tie_word_embeddings": false,
        "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096,
        "torch_dtype": "bfloat16"}"#;
    const LLAMA_32_1B: &str = r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 2048,
        "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
        "tie_word_embeddings": true, "attention_bias": false, "mlp_bias": false,
        "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "torch_dtype": "bfloat16"}"#;
    const QWEN2_05B: &str = r#"{"architectures": ["Qwen2ForCausalLM"], "hidden_size": 896,
        "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
        "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": true,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "torch_dtype": "bfloat16"}"#;

    const QWEN3_06B: &str = r#"{"architectures": ["Qwen3ForCausalLM"], "hidden_size": 1024,
        "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
        "tie_word_embeddings": true, "attention_bias": false, "hidden_act": "silu",
        "rms_norm_eps": 1e-06, "rope_theta": 1000000, "rope_scaling": null,
        "sliding_window": null, "use_sliding_window": false, "torch_dtype": "bfloat16"}"#;
    const QWEN3_8B: &str = r#"{"architectures": ["Qwen3ForCausalLM"], "hidden_size": 4096,
        "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
        "tie_word_embeddings": false, "attention_bias": false, "hidden_act": "silu",
        "rms_norm_eps": 1e-06, "rope_theta": 1000000, "rope_scaling": null,
        "sliding_window": null, "use_sliding_window": false, "torch_dtype": "bfloat16"}"#;

    const PHI3_MINI_4K: &str = r#"{"architectures": ["Phi3ForCausalLM"], "attention_bias": false,
        "hidden_act": "silu", "hidden_size": 3072, "intermediate_size": 8192,
        "max_position_embeddings": 4096, "num_attention_heads": 32, "num_hidden_layers": 32,
        "num_key_value_heads": 32, "original_max_position_embeddings": 4096,
        "rms_norm_eps": 1e-05, "rope_scaling": null, "rope_theta": 10000.0,
        "sliding_window": 2047, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
        "vocab_size": 32064}"#;

    /// Phi-4-mini-instruct's config.json; its 48 short and long factors are
    /// stand-ins (1.0 … and 1.0 + k/10), which change no weight.
    fn phi4_mini() -> String {
        let list = |f: &dyn Fn(usize) -> f64| {
            (0..48)
                .map(|k| f(k).to_string())
                .collect::<Vec<_>>()
                .join(", ")
        };
        format!(
            r#"{{"architectures": ["Phi3ForCausalLM"], "attention_bias": false, "hidden_act": "silu",
            "hidden_size": 3072, "intermediate_size": 8192, "max_position_embeddings": 131072,
            "num_attention_heads": 24, "num_hidden_layers": 32, "num_key_value_heads": 8,
            "original_max_position_embeddings": 4096, "partial_rotary_factor": 0.75,
            "rms_norm_eps": 1e-05, "rope_scaling": {{"long_factor": [{}], "short_factor": [{}],
            "type": "longrope"}}, "rope_theta": 10000.0, "sliding_window": 262144,
            "tie_word_embeddings": true, "torch_dtype": "bfloat16", "vocab_size": 200064}}"#,
            list(&|k| 1.0 + k as f64 / 10.0),
            list(&|_| 1.0)
        )
    }

    /// google/gemma-3-1b-pt's config.json (transformers 4.50), reduced to
    /// the keys that shape the weights and the function.
    const GEMMA3_1B: &str = r#"{"architectures": ["Gemma3ForCausalLM"], "attention_bias": false,
        "attn_logit_softcapping": null, "final_logit_softcapping": null, "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152,
        "intermediate_size": 6912, "max_position_embeddings": 32768, "model_type": "gemma3_text",
        "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
        "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
        "rope_scaling": null, "rope_theta": 1000000, "sliding_window": 512,
        "sliding_window_pattern": 6, "torch_dtype": "bfloat16", "vocab_size": 262144}"#;
    /// google/gemma-2-2b's config.json.
    const GEMMA2_2B: &str = r#"{"architectures": ["Gemma2ForCausalLM"], "attention_bias": false,
        "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "head_dim": 256,
        "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 2304, "intermediate_size": 9216, "max_position_embeddings": 8192,
        "num_attention_heads": 8, "num_hidden_layers": 26, "num_key_value_heads": 4,
        "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
        "sliding_window": 4096, "torch_dtype": "float32", "vocab_size": 256000}"#;

    fn shape(config: &str) -> LlamaShape {
        LlamaShape::from_hf_config(config, 2048).expect("config")
    }

    #[test]
    fn parameter_counts_equal_the_published_ones() {
        // Published totals: Llama-2-7B 6,738,415,616; Mistral-7B-v0.1
        // 7,241,732,096; Llama-3.2-1B 1,235,814,400; Qwen2-0.5B 494,032,768.
        assert_eq!(shape(LLAMA_2_7B).total_params(), 6_738_415_616);
        assert_eq!(shape(MISTRAL_7B_V01).total_params(), 7_241_732_096);
        assert_eq!(shape(LLAMA_32_1B).total_params(), 1_235_814_400);
        assert_eq!(shape(QWEN2_05B).total_params(), 494_032_768);
        // Qwen3-0.6B 596,049,920 (tied; its head_dim 128 is not hidden /
        // heads = 64); Qwen3-8B 8,190,735,360 (untied).
        assert_eq!(shape(QWEN3_06B).total_params(), 596_049_920);
        assert_eq!(shape(QWEN3_8B).total_params(), 8_190_735_360);
        // Phi-3-mini-4k-instruct 3,821,079,552 (untied); Phi-4-mini-instruct
        // 3,836,021,760 (tied). Fused q/k/v and gate/up hold Llama's weights.
        let phi3 = LlamaShape::from_hf_config(PHI3_MINI_4K, 2047).expect("Phi-3-mini");
        assert_eq!(phi3.total_params(), 3_821_079_552);
        assert_eq!(shape(&phi4_mini()).total_params(), 3_836_021_760);
    }

    #[test]
    fn gemma_parameter_counts_equal_the_published_ones() {
        use crate::memory::{StagePlacement, StageTensor, stage_tensors};
        // gemma-3-1b-pt 999,885,952 (tied; q/k norms, four norms a block);
        // gemma-2-2b 2,614,341,888 (tied).
        for (config, published) in [(GEMMA3_1B, 999_885_952), (GEMMA2_2B, 2_614_341_888)] {
            let g = shape(config);
            assert_eq!(g.total_params(), published, "{:?}", g.architecture);
            let total: u64 = stage_tensors(
                &crate::ModelShape::Llama(g.clone()),
                StagePlacement::single(g.layers),
            )
            .iter()
            .map(StageTensor::total_elements)
            .sum();
            assert_eq!(total, published, "the memory model's tensors");
        }
    }

    #[test]
    fn reads_gemma3_sliding_layers_rope_bases_and_scale() {
        let g = shape(GEMMA3_1B);
        assert_eq!(g.architecture, LlamaArchitecture::Gemma3);
        assert!(g.architecture.qk_norm() && g.architecture.gemma() && g.tied_embeddings);
        assert_eq!((g.head_dim, g.q_dim(), g.kv_dim()), (256, 1024, 256));
        assert_eq!(g.rope_theta, 1_000_000.0);
        let a = g.gemma.as_ref().expect("Gemma's attention");
        assert_eq!((a.query_pre_attn_scalar, a.sliding_window), (256.0, 512));
        assert_eq!((a.local_rope_theta, a.global_rope_factor), (10_000.0, None));
        assert_eq!(
            (a.attn_logit_softcapping, a.final_logit_softcapping),
            (None, None)
        );
        // sliding_window_pattern 6: layers 5, 11, 17 and 23 are global.
        let global: Vec<usize> = (0..26)
            .filter(|&i| a.layer_types[i] == LayerAttention::Full)
            .collect();
        assert_eq!(global, [5, 11, 17, 23]);
        // A sequence longer than the window is planned: the worker slides.
        assert!(LlamaShape::from_hf_config(GEMMA3_1B, 4096).is_ok());
        // transformers 5's form: layer_types and a RoPE dictionary per layer
        // type; the 4B text model's linear scaling on the global layers.
        let v5 = GEMMA3_1B
            .replace(
                "\"rope_local_base_freq\": 10000,\n        \"rope_scaling\": null, \"rope_theta\": 1000000,",
                r#""rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},"#,
            )
            .replace(
                "\"sliding_window_pattern\": 6,",
                &format!(
                    "\"layer_types\": [{}],",
                    (0..26)
                        .map(|i| if i % 2 == 1 { "\"full_attention\"" } else { "\"sliding_attention\"" })
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            );
        let v5 = shape(&v5);
        let a5 = v5.gemma.as_ref().expect("Gemma's attention");
        assert_eq!(v5.rope_theta, 1_000_000.0);
        assert_eq!(
            (a5.local_rope_theta, a5.global_rope_factor),
            (10_000.0, Some(8.0))
        );
        assert_eq!(a5.layer_types[1], LayerAttention::Full);
        assert_eq!(a5.layer_types[2], LayerAttention::Sliding);
        assert_eq!(v5.total_params(), 999_885_952);
        // Activations: Gemma keeps more than the same shape as Qwen3: its
        // two more norms in the worker's count (the gating op keeps as much
        // for GeGLU as for SwiGLU), also GeGLU's tanh in the published one.
        let mut qwen = g.clone();
        qwen.architecture = LlamaArchitecture::Qwen3;
        qwen.gemma = None;
        assert_eq!(
            g.burn_block_activation_bytes(1, 4, false)
                - qwen.burn_block_activation_bytes(1, 4, false),
            2048 * (6 * 1152) * 4
        );
        assert_eq!(
            g.block_activation_bytes(1, 4, false) - qwen.block_activation_bytes(1, 4, false),
            2048 * (6 * 1152 + 6912) * 4
        );
    }

    #[test]
    fn gemma2_softcaps_and_alternates() {
        let g = shape(GEMMA2_2B);
        assert_eq!(g.architecture, LlamaArchitecture::Gemma2);
        assert!(!g.architecture.qk_norm() && g.architecture.gemma());
        let a = g.gemma.as_ref().expect("Gemma's attention");
        assert_eq!(
            (a.attn_logit_softcapping, a.final_logit_softcapping),
            (Some(50.0), Some(30.0))
        );
        assert_eq!(
            a.layer_types[..2],
            [LayerAttention::Sliding, LayerAttention::Full]
        );
        assert_eq!((g.rope_theta, a.local_rope_theta), (10_000.0, 10_000.0));
    }

    #[test]
    fn gemma_refusals_name_the_key_and_value() {
        let refused = |config: &str| LlamaShape::from_hf_config(config, 1024).expect_err("refused");
        let yarn = GEMMA3_1B.replace(
            "\"rope_scaling\": null",
            r#""rope_scaling": {"rope_type": "yarn", "factor": 4.0}"#,
        );
        let e = refused(&yarn);
        assert_eq!(e.key, "rope_scaling");
        assert!(
            e.problem.contains("yarn") && e.problem.contains("linear"),
            "{e}"
        );
        let capped = GEMMA3_1B.replace(
            "\"attn_logit_softcapping\": null",
            "\"attn_logit_softcapping\": 50.0",
        );
        let e = refused(&capped);
        assert_eq!(e.key, "attn_logit_softcapping");
        assert!(e.problem.contains("50"), "{e}");
        let llama_capped = LLAMA_2_7B.replace(
            "\"vocab_size\"",
            "\"attn_logit_softcapping\": 30.0, \"vocab_size\"",
        );
        let e = refused(&llama_capped);
        assert_eq!(e.key, "attn_logit_softcapping");
        assert!(
            e.problem.contains("30") && e.problem.contains("LlamaForCausalLM"),
            "{e}"
        );
        let gelu = GEMMA3_1B.replace("gelu_pytorch_tanh", "gelu");
        let e = refused(&gelu);
        assert_eq!(e.key, "hidden_activation");
        assert!(e.problem.contains("\"gelu\""), "{e}");
        let bidirectional = GEMMA3_1B.replace(
            "\"attention_bias\": false,",
            "\"attention_bias\": false, \"use_bidirectional_attention\": true,",
        );
        assert_eq!(refused(&bidirectional).key, "use_bidirectional_attention");
        let short = GEMMA3_1B.replace(
            "\"sliding_window_pattern\": 6,",
            "\"layer_types\": [\"full_attention\"],",
        );
        let e = refused(&short);
        assert_eq!(e.key, "layer_types");
        assert!(e.problem.contains("26"), "{e}");
    }

    #[test]
    fn reads_phi3_fused_projections_partial_rotary_and_longrope() {
        use crate::memory::{StagePlacement, StageTensor, TensorRole, stage_tensors};
        let p = shape(&phi4_mini());
        assert_eq!(p.architecture, LlamaArchitecture::Phi3);
        assert!(!p.attention_bias && !p.mlp_bias && p.tied_embeddings);
        // head_dim 128 (3072 / 24), RoPE over its first 96 values.
        assert_eq!((p.head_dim, p.rotary_dim()), (128, 96));
        let l = p.long_rope.as_ref().expect("longrope");
        assert_eq!(l.original_max_position_embeddings, 4096);
        assert_eq!((l.short_factor.len(), l.long_factor.len()), (48, 48));
        assert_eq!(l.long_factor[1], 1.1);
        // factor 131072 / 4096 = 32: √(1 + ln 32 / ln 4096), transformers' 1.1902380714238083.
        assert!((l.attention_factor - 1.190_238_071_423_808_3).abs() < 1e-12);
        assert!(p.rope_scaling.is_none());
        // Four block linears, fused: q/k/v is 3072 × (3072 + 2 · 1024).
        let tensors = stage_tensors(
            &crate::ModelShape::Llama(p.clone()),
            StagePlacement::single(p.layers),
        );
        let linears: Vec<(TensorRole, u64)> = tensors
            .iter()
            .filter(|t| matches!(t.role, TensorRole::BlockLinear(_)))
            .map(|t| (t.role, t.elements))
            .collect();
        use TargetModule::*;
        assert_eq!(
            linears,
            [
                (TensorRole::BlockLinear(Some(QkvProj)), 3072 * 5120),
                (TensorRole::BlockLinear(Some(OProj)), 3072 * 3072),
                (TensorRole::BlockLinear(Some(GateUpProj)), 3072 * 16384),
                (TensorRole::BlockLinear(Some(DownProj)), 8192 * 3072),
            ]
        );
        let total: u64 = tensors.iter().map(StageTensor::total_elements).sum();
        assert_eq!(total, 3_836_021_760);
        // transformers 5 writes the same under rope_parameters.
        let v5 = phi4_mini()
            .replace("\"rope_scaling\"", "\"rope_parameters\"")
            .replace("\"type\": \"longrope\"", "\"rope_type\": \"longrope\", \"rope_theta\": 10000.0, \"partial_rotary_factor\": 0.75")
            .replace("\"partial_rotary_factor\": 0.75,", "");
        assert_eq!(shape(&v5), p);
    }

    #[test]
    fn phi3_refusals_name_the_key() {
        // Phi-3-mini-4k slides a 2047-token window: a longer sequence would
        // be another function than the worker's full causal attention.
        let e = LlamaShape::from_hf_config(PHI3_MINI_4K, 4096).expect_err("window");
        assert_eq!(e.key, "sliding_window");
        assert!(
            e.problem.contains("2047") && e.problem.contains("4096"),
            "{e}"
        );
        // Qwen3 slides only with use_sliding_window.
        let sliding = QWEN3_06B.replace(
            "\"sliding_window\": null, \"use_sliding_window\": false",
            "\"sliding_window\": 1024, \"use_sliding_window\": true",
        );
        assert_eq!(
            LlamaShape::from_hf_config(&sliding, 2048)
                .expect_err("slides")
                .key,
            "sliding_window"
        );
        assert!(LlamaShape::from_hf_config(&sliding, 1024).is_ok());
        let short = phi4_mini().replacen("1, ", "", 1);
        let e = LlamaShape::from_hf_config(&short, 1024).expect_err("47 long factors");
        assert_eq!(e.key, "rope_scaling");
        assert!(e.problem.contains("48"), "{e}");
        let odd = phi4_mini().replace(
            "\"partial_rotary_factor\": 0.75",
            "\"partial_rotary_factor\": 0.29",
        );
        let e = LlamaShape::from_hf_config(&odd, 1024).expect_err("37 values");
        assert_eq!(e.key, "partial_rotary_factor");
        let partial_llama = LLAMA_2_7B.replace(
            "\"vocab_size\"",
            "\"partial_rotary_factor\": 0.5, \"vocab_size\"",
        );
        let e = LlamaShape::from_hf_config(&partial_llama, 1024)
            .expect_err("Llama rotates whole heads");
        assert_eq!(e.key, "partial_rotary_factor");
    }

    #[test]
    fn the_memory_models_tensors_hold_qwen3s_count() {
        use crate::memory::{StagePlacement, StageTensor, stage_tensors};
        let q = shape(QWEN3_8B);
        let total: u64 = stage_tensors(
            &crate::ModelShape::Llama(q.clone()),
            StagePlacement::single(q.layers),
        )
        .iter()
        .map(StageTensor::total_elements)
        .sum();
        assert_eq!(total, 8_190_735_360);
    }

    #[test]
    fn reads_qwen3_head_dim_and_qk_norms() {
        let q = shape(QWEN3_06B);
        assert_eq!(q.architecture, LlamaArchitecture::Qwen3);
        assert!(q.architecture.qk_norm() && !q.attention_bias);
        // q is 16 × 128 = 2048 wide on a hidden size of 1024.
        assert_eq!((q.head_dim, q.q_dim(), q.kv_dim()), (128, 2048, 1024));
        let mut no_norms = q.clone();
        no_norms.architecture = LlamaArchitecture::Llama;
        assert_eq!(q.params_per_layer() - no_norms.params_per_layer(), 2 * 128);
        assert!(
            q.burn_block_activation_bytes(1, 4, false)
                > no_norms.burn_block_activation_bytes(1, 4, false)
        );
        assert_eq!(
            q.burn_block_activation_bytes(1, 4, true),
            no_norms.burn_block_activation_bytes(1, 4, true)
        );
    }

    #[test]
    fn reads_gqa_tied_heads_biases_and_dtype() {
        let m = shape(MISTRAL_7B_V01);
        assert_eq!((m.key_value_heads, m.kv_dim(), m.head_dim), (8, 1024, 128));
        assert!(!m.tied_embeddings && !m.attention_bias);
        let l = shape(LLAMA_32_1B);
        assert!(l.tied_embeddings);
        assert_eq!(l.rope_theta, 500_000.0);
        assert_eq!(l.torch_dtype.as_deref(), Some("bfloat16"));
        let q = shape(QWEN2_05B);
        assert!(
            q.attention_bias,
            "Qwen2 has q/k/v biases without a config key"
        );
        assert_eq!(q.architecture, LlamaArchitecture::Qwen2);
    }

    #[test]
    fn bad_configs_name_the_key() {
        let gpt2 = r#"{"architectures": ["GPT2LMHeadModel"], "n_embd": 768}"#;
        let e = LlamaShape::from_hf_config(gpt2, 1024).expect_err("not Llama-family");
        assert_eq!(e.key, "architectures");
        assert!(e.problem.contains("LlamaForCausalLM"), "{e}");
        assert!(e.problem.contains("Qwen3ForCausalLM"), "{e}");
        let no_hidden = LLAMA_2_7B.replace("\"hidden_size\": 4096,", "");
        let e = LlamaShape::from_hf_config(&no_hidden, 1024).expect_err("missing");
        assert_eq!((e.key, e.problem.as_str()), ("hidden_size", "missing"));
        let bad_gqa =
            MISTRAL_7B_V01.replace("\"num_key_value_heads\": 8", "\"num_key_value_heads\": 5");
        let e = LlamaShape::from_hf_config(&bad_gqa, 1024).expect_err("5 does not divide 32");
        assert_eq!(e.key, "num_key_value_heads");
    }

    #[test]
    fn reads_llama3_rope_scaling_and_refuses_other_types() {
        let with = |scaling: &str| {
            LLAMA_32_1B.replace(
                "\"rope_theta\": 500000.0,",
                &format!("\"rope_theta\": 500000.0, \"rope_scaling\": {scaling},"),
            )
        };
        // Llama-3.2-1B's published rope_scaling.
        let l = LlamaShape::from_hf_config(
            &with(
                r#"{"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                "original_max_position_embeddings": 8192, "rope_type": "llama3"}"#,
            ),
            2048,
        )
        .expect("llama3 scaling");
        let s = l.rope_scaling.expect("scaling read");
        assert_eq!(
            (s.factor, s.original_max_position_embeddings),
            (32.0, 8192.0)
        );
        let e = LlamaShape::from_hf_config(&with(r#"{"type": "yarn", "factor": 4.0}"#), 2048)
            .expect_err("yarn is not implemented");
        assert_eq!(e.key, "rope_scaling");
        assert!(e.problem.contains("yarn"), "{e}");
        assert!(shape(LLAMA_2_7B).rope_scaling.is_none());
        // transformers 5 writes `dtype` and moves the RoPE base into `rope_parameters`.
        let v5 = LLAMA_2_7B.replace("torch_dtype", "dtype").replace(
            "\"rope_theta\": 10000.0,",
            "\"rope_parameters\": {\"rope_theta\": 20000.0, \"rope_type\": \"default\"},",
        );
        let v5 = shape(&v5);
        assert_eq!(v5.torch_dtype.as_deref(), Some("float16"));
        assert_eq!((v5.rope_theta, v5.rope_scaling), (20_000.0, None));
        let gelu = LLAMA_2_7B.replace("\"vocab_size\"", "\"hidden_act\": \"gelu\", \"vocab_size\"");
        let e = LlamaShape::from_hf_config(&gelu, 16).expect_err("not SwiGLU");
        assert_eq!(e.key, "hidden_act");
    }

    #[test]
    fn gqa_keeps_fewer_activations_than_mha() {
        let mha = shape(LLAMA_2_7B);
        let mut gqa = mha.clone();
        gqa.key_value_heads = 8;
        assert!(gqa.block_activation_bytes(1, 2, false) < mha.block_activation_bytes(1, 2, false));
        assert_eq!(mha.block_activation_bytes(1, 2, true), 2048 * 4096 * 2);
    }

    #[test]
    fn burn_count_of_a_llama_block() {
        // Llama-3.2-1B at s = 2048, b = 1, fp32: h 2048, q 2048, kv 512,
        // i 8192, 32 heads of 64. Per token 6h + 3q + 2kv + 3i and one
        // logsumexp per head; no s² term (the blocked attention op);
        // RoPE's two f32 tables of s × 64.
        let l = shape(LLAMA_32_1B);
        let s = 2048u64;
        let per_token = 6 * 2048 + 3 * 2048 + 2 * 512 + 3 * 8192 + 32;
        assert_eq!(
            l.burn_block_activation_bytes(1, 4, false),
            s * per_token * 4 + 2 * s * 64 * 4
        );
        assert_eq!(l.burn_block_activation_bytes(1, 4, true), s * 2048 * 4);
        // Grouped-query attention keeps k and v at kv width before repeating them.
        let mut mha = l.clone();
        mha.key_value_heads = 32;
        assert!(
            l.burn_block_activation_bytes(1, 4, false)
                < mha.burn_block_activation_bytes(1, 4, false)
        );
    }
}
