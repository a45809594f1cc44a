//! Llama-family decoder-only models as Hugging Face describes them in
//! `config.json` (`LlamaForCausalLM`, `MistralForCausalLM`,
//! `Qwen2ForCausalLM`): token embedding, `layers` pre-norm blocks of
//! RMSNorm → attention with rotary positions and grouped-query attention
//! (`keyValueHeads` ≤ `attentionHeads`) → RMSNorm → SwiGLU MLP
//! (gate, up, down), a final RMSNorm and an output head, tied to the
//! embedding or not. No learned position embeddings (RoPE has no weights).
//!
//! Parameter counts follow the Hugging Face modules exactly, so they equal
//! the published counts (tests below, from the models' public config values).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

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
}

impl LlamaArchitecture {
    pub const ALL: [LlamaArchitecture; 3] = [
        LlamaArchitecture::Llama,
        LlamaArchitecture::Mistral,
        LlamaArchitecture::Qwen2,
    ];

    pub fn hf_name(self) -> &'static str {
        match self {
            LlamaArchitecture::Llama => "LlamaForCausalLM",
            LlamaArchitecture::Mistral => "MistralForCausalLM",
            LlamaArchitecture::Qwen2 => "Qwen2ForCausalLM",
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
    /// Stored dtype of the checkpoint (`torch_dtype`, e.g. `bfloat16`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub torch_dtype: Option<String>,
    /// Tokens per training sample.
    pub sequence_length: u32,
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

/// Reads `rope_scaling`: absent, null, or Llama 3's scaling.
/// transformers 5 writes it as `rope_parameters` (with `rope_type: default`
/// when there is no scaling).
fn rope_scaling(v: &Value) -> Result<Option<RopeScaling>, ConfigError> {
    let Some(s) = v
        .get("rope_scaling")
        .filter(|s| !s.is_null())
        .or_else(|| v.get("rope_parameters").filter(|s| !s.is_null()))
    else {
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
    if kind != "llama3" {
        return Err(bad(
            "rope_scaling",
            format!(
                "rope_type {kind:?} is not supported; Headroom runs the default RoPE and llama3 scaling"
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
    Ok(Some(scaling))
}

impl LlamaShape {
    /// Reads a Hugging Face `config.json`; `sequence_length` is the training
    /// sample length (configs give only the maximum, `max_position_embeddings`).
    pub fn from_hf_config(text: &str, sequence_length: u32) -> Result<Self, ConfigError> {
        let v: Value =
            serde_json::from_str(text).map_err(|e| bad("(file)", format!("not JSON: {e}")))?;
        let names: Vec<&str> = v
            .get("architectures")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let architecture = LlamaArchitecture::ALL
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
            })?;
        let int = |key: &'static str| -> Result<u32, ConfigError> {
            let n = v
                .get(key)
                .ok_or_else(|| bad(key, "missing"))?
                .as_u64()
                .ok_or_else(|| bad(key, "must be a positive integer"))?;
            u32::try_from(n)
                .ok()
                .filter(|n| *n > 0)
                .ok_or_else(|| bad(key, format!("{n} is out of range")))
        };
        let flag =
            |key: &str, default: bool| v.get(key).and_then(Value::as_bool).unwrap_or(default);
        let hidden = int("hidden_size")?;
        let attention_heads = int("num_attention_heads")?;
        let key_value_heads = match v.get("num_key_value_heads") {
            None | Some(Value::Null) => attention_heads,
            Some(_) => int("num_key_value_heads")?,
        };
        if attention_heads % key_value_heads != 0 {
            return Err(bad(
                "num_key_value_heads",
                format!("{key_value_heads} must divide num_attention_heads ({attention_heads})"),
            ));
        }
        let head_dim = match v.get("head_dim") {
            None | Some(Value::Null) => {
                if hidden % attention_heads != 0 {
                    return Err(bad(
                        "hidden_size",
                        format!(
                            "{hidden} is not a multiple of num_attention_heads ({attention_heads}) and no head_dim is given"
                        ),
                    ));
                }
                hidden / attention_heads
            }
            Some(_) => int("head_dim")?,
        };
        if sequence_length == 0 {
            return Err(bad("(sequence length)", "must be at least 1"));
        }
        // The MLP is SwiGLU: SiLU is the only gate activation the worker builds.
        if let Some(act) = v.get("hidden_act").and_then(Value::as_str)
            && act != "silu"
        {
            return Err(bad(
                "hidden_act",
                format!("{act:?} is not supported; Llama-family MLPs use \"silu\""),
            ));
        }
        // Qwen2 always has q/k/v biases and no `attention_bias` key.
        let attention_bias = match architecture {
            LlamaArchitecture::Qwen2 => true,
            _ => flag("attention_bias", false),
        };
        Ok(LlamaShape {
            architecture,
            layers: int("num_hidden_layers")?,
            hidden,
            intermediate: int("intermediate_size")?,
            attention_heads,
            key_value_heads,
            head_dim,
            vocabulary: int("vocab_size")?,
            tied_embeddings: flag("tie_word_embeddings", false),
            attention_bias,
            mlp_bias: flag("mlp_bias", false),
            // transformers 5 moved the base into `rope_parameters`.
            rope_theta: v
                .get("rope_theta")
                .or_else(|| v.get("rope_parameters").and_then(|p| p.get("rope_theta")))
                .and_then(Value::as_f64)
                .unwrap_or(10_000.0),
            rms_norm_eps: v
                .get("rms_norm_eps")
                .and_then(Value::as_f64)
                .unwrap_or(1e-6),
            rope_scaling: rope_scaling(&v)?,
            // transformers 5 writes `dtype`, earlier versions `torch_dtype`.
            torch_dtype: v
                .get("torch_dtype")
                .or_else(|| v.get("dtype"))
                .and_then(Value::as_str)
                .map(str::to_string),
            sequence_length,
        })
    }

    /// The same model with the sequence length blanked: what a checkpoint's
    /// config.json and a plan must agree on.
    pub fn without_sequence(&self) -> LlamaShape {
        LlamaShape {
            sequence_length: 0,
            ..self.clone()
        }
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
    /// architecture has them), gate/up/down, and two RMSNorm weight vectors.
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
        let mut mlp = 3 * h * i;
        if self.mlp_bias {
            mlp += 2 * i + h;
        }
        attention + mlp + 2 * h
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
    /// softmax output (s² per sample). Checkpointed: the block's input only.
    /// A first-principles count, to be calibrated against the worker once it
    /// builds these models (issue 11).
    pub fn block_activation_bytes(&self, b: u64, e: u64, checkpointed: bool) -> u64 {
        let s = u64::from(self.sequence_length);
        let h = u64::from(self.hidden);
        if checkpointed {
            return s * b * h * e;
        }
        let per_token = 5 * h + self.q_dim() + 2 * self.kv_dim() + 4 * u64::from(self.intermediate);
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
    /// * SwiGLU: gate's output and its sigmoid (kept by SiLU's product),
    ///   SiLU's output and up's output (kept by the gating product) and the
    ///   product (kept by down): 5i.
    ///
    /// Per head and token, the op's logsumexp (one value); no `s × s` map
    /// outlives the op (`worker/src/model/lean/attention.rs`). Per block,
    /// RoPE's cos and sin tables (s × head_dim each, f32), which the
    /// rotations keep. Checkpointed: the block's input only.
    pub fn burn_block_activation_bytes(&self, b: u64, e: u64, checkpointed: bool) -> u64 {
        let s = u64::from(self.sequence_length);
        let h = u64::from(self.hidden);
        if checkpointed {
            return s * b * h * e;
        }
        let (q, kv, i) = (self.q_dim(), self.kv_dim(), u64::from(self.intermediate));
        let per_token = 6 * h + 3 * q + 2 * kv + 5 * i + u64::from(self.attention_heads);
        let rope_tables = 2 * s * u64::from(self.head_dim) * 4;
        s * b * per_token * e + rope_tables
    }
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
        // i 8192, 32 heads of 64. Per token 6h + 3q + 2kv + 5i and one
        // logsumexp per head; no s² term (the blocked attention op);
        // RoPE's two f32 tables of s × 64.
        let l = shape(LLAMA_32_1B);
        let s = 2048u64;
        let per_token = 6 * 2048 + 3 * 2048 + 2 * 512 + 5 * 8192 + 32;
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
