//! Parameter-efficient fine-tuning: LoRA adapters on a frozen base, and the
//! base's storage format (QLoRA quantizes it).
//!
//! The vocabulary is PEFT's (and Kubeflow Trainer v2's `LoraConfig`): rank,
//! alpha, dropout and target modules named like the Hugging Face modules
//! (`q_proj` … `down_proj`, `lm_head`; Phi-3's fused `qkv_proj` and
//! `gate_up_proj`), each architecture its own set
//! ([`crate::LlamaArchitecture::lora_targets`]). A targeted `d_in × d_out`
//! matrix gets two trainable factors, `A: d_in × r` and `B: r × d_out`, so
//! `r·(d_in + d_out)` trainable parameters; every base parameter is frozen
//! (no gradient, no optimizer state). The counts equal PEFT's
//! `print_trainable_parameters()` for the same config (tests below).
//!
//! What a job trains is the user's choice and never changed by a retry
//! (full fine-tuning and LoRA give different things); how the frozen base is
//! stored ([`BaseFormat`]) is a setting a retry may make stricter.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::llama::{LlamaArchitecture, LlamaShape};
use crate::target_module::TargetModule;

/// LoRA adapters as PEFT configures them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LoraConfig {
    /// Rank r of the low-rank update (PEFT `r`).
    pub rank: u32,
    /// Scaling numerator: the update is scaled by alpha / r (PEFT `lora_alpha`).
    pub alpha: f64,
    /// Dropout on the adapter's input (PEFT `lora_dropout`).
    #[serde(default)]
    pub dropout: f64,
    /// Modules that get adapters (PEFT `target_modules`).
    pub target_modules: Vec<TargetModule>,
    /// Elements per quantization block of a quantized base (QLoRA); each
    /// block stores one scale.
    #[serde(default = "default_block_size")]
    pub block_size: u32,
}

pub fn default_block_size() -> u32 {
    64
}

impl LoraConfig {
    pub fn targets(&self, module: TargetModule) -> bool {
        self.target_modules.contains(&module)
    }

    /// The targets `architecture` has no module for, as the message a user
    /// sees (naming the architecture's modules); `None` when all are its.
    pub fn foreign_targets(&self, architecture: LlamaArchitecture) -> Option<String> {
        let valid = architecture.lora_targets();
        let foreign: Vec<&str> = self
            .target_modules
            .iter()
            .filter(|m| !valid.contains(m))
            .map(|m| m.hf_name())
            .collect();
        if foreign.is_empty() {
            return None;
        }
        Some(format!(
            "{} {} of {}; its modules are {}",
            foreign.join(", "),
            if foreign.len() == 1 {
                "is not a module"
            } else {
                "are not modules"
            },
            architecture.hf_name(),
            valid
                .iter()
                .map(|m| m.hf_name())
                .collect::<Vec<_>>()
                .join(", ")
        ))
    }

    /// Trainable adapter parameters of one decoder block.
    pub fn params_per_layer(&self, shape: &LlamaShape) -> u64 {
        self.target_modules
            .iter()
            .filter(|m| m.per_layer())
            .map(|m| self.factor_params(*m, shape))
            .sum()
    }

    /// Trainable adapter parameters of the output head (last stage), 0 unless
    /// `lm_head` is targeted.
    pub fn head_params(&self, shape: &LlamaShape) -> u64 {
        if self.targets(TargetModule::LmHead) {
            self.factor_params(TargetModule::LmHead, shape)
        } else {
            0
        }
    }

    /// Trainable parameters of the whole model: PEFT's "trainable params".
    pub fn trainable_params(&self, shape: &LlamaShape) -> u64 {
        u64::from(shape.layers) * self.params_per_layer(shape) + self.head_params(shape)
    }

    /// `r·(d_in + d_out)`: the two factors of one adapted matrix.
    pub fn factor_params(&self, module: TargetModule, shape: &LlamaShape) -> u64 {
        let (d_in, d_out) = module.dims(shape);
        u64::from(self.rank) * (d_in + d_out)
    }
}

/// How the frozen base weights are stored. Full fine-tuning and LoRA keep
/// them dense at the training precision; QLoRA quantizes them block-wise.
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    JsonSchema,
)]
#[serde(rename_all = "camelCase")]
pub enum BaseFormat {
    /// At the training precision.
    #[default]
    Dense,
    /// 8-bit integers with one scale per block.
    Int8,
    /// 4-bit integers with one scale per block.
    Int4,
    /// 4-bit NormalFloat with double-quantized block scales, as
    /// bitsandbytes stores QLoRA's base (`bnb_4bit_quant_type="nf4"`,
    /// `bnb_4bit_use_double_quant=True`): 16 values fitted to a normal
    /// distribution, one 8-bit absmax per 64 values, one f32 per 256 of
    /// those — about 4.127 bits a value.
    Nf4,
}

impl BaseFormat {
    pub fn is_quantized(self) -> bool {
        self != BaseFormat::Dense
    }

    /// Bits of one stored value.
    pub fn bits(self) -> Option<u32> {
        match self {
            BaseFormat::Dense => None,
            BaseFormat::Int8 => Some(8),
            BaseFormat::Int4 | BaseFormat::Nf4 => Some(4),
        }
    }

    /// The next stricter format (seed 002's order, dense → int8 → 4-bit,
    /// with NF4 as the 4-bit step: it stores a value in fewer bits than
    /// int4's f32 block scales, and closer to a normally distributed weight).
    pub fn stricter(self) -> Option<BaseFormat> {
        match self {
            BaseFormat::Dense => Some(BaseFormat::Int8),
            BaseFormat::Int8 | BaseFormat::Int4 => Some(BaseFormat::Nf4),
            BaseFormat::Nf4 => None,
        }
    }
}

impl std::fmt::Display for BaseFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            BaseFormat::Dense => "dense",
            BaseFormat::Int8 => "int8",
            BaseFormat::Int4 => "int4",
            BaseFormat::Nf4 => "nf4",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llama_2_7b() -> LlamaShape {
        LlamaShape::from_hf_config(
            r#"{"architectures":["LlamaForCausalLM"],"hidden_size":4096,"intermediate_size":11008,
               "num_hidden_layers":32,"num_attention_heads":32,"num_key_value_heads":32,
               "vocab_size":32000,"rms_norm_eps":1e-5,"rope_theta":10000.0,
               "tie_word_embeddings":false,"torch_dtype":"float16"}"#,
            4096,
        )
        .expect("valid test config")
    }

    fn lora(rank: u32, targets: &[TargetModule]) -> LoraConfig {
        LoraConfig {
            rank,
            alpha: 16.0,
            dropout: 0.05,
            target_modules: targets.to_vec(),
            block_size: default_block_size(),
        }
    }

    #[test]
    fn llama_2_7b_r8_on_q_and_v_trains_peft_s_4_194_304() {
        // PEFT's README / print_trainable_parameters() for Llama-2-7B,
        // r = 8, target_modules = ["q_proj", "v_proj"]:
        // "trainable params: 4,194,304 || all params: 6,742,609,920".
        let l = lora(8, &[TargetModule::QProj, TargetModule::VProj]);
        let shape = llama_2_7b();
        assert_eq!(l.trainable_params(&shape), 4_194_304);
        assert_eq!(
            shape.total_params() + l.trainable_params(&shape),
            6_742_609_920
        );
    }

    #[test]
    fn llama_2_7b_r16_on_all_linear_layers_trains_39_976_960() {
        // QLoRA paper setting (all linear layers of the blocks), r = 16:
        // 32 · 16 · (4·(4096+4096) + 2·(4096+11008) + (11008+4096)) = 39,976,960,
        // PEFT's count for target_modules = "all-linear" on Llama-2-7B.
        let l = lora(16, &TargetModule::BLOCK_LINEARS);
        assert_eq!(l.trainable_params(&llama_2_7b()), 39_976_960);
    }

    #[test]
    fn phi_4_mini_r16_on_its_fused_linears_trains_pefts_23_068_672() {
        // PEFT 0.21.2's get_nb_trainable_parameters() for Phi-4-mini (built
        // on the meta device from its config), r = 16, target_modules =
        // ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]: 23,068,672
        // of 3,859,090,432.
        let factors = vec!["1.0"; 48].join(", ");
        let shape = LlamaShape::from_hf_config(
            &format!(
                r#"{{"architectures":["Phi3ForCausalLM"],"hidden_size":3072,"intermediate_size":8192,
                   "num_hidden_layers":32,"num_attention_heads":24,"num_key_value_heads":8,
                   "vocab_size":200064,"tie_word_embeddings":true,"partial_rotary_factor":0.75,
                   "max_position_embeddings":131072,"original_max_position_embeddings":4096,
                   "rope_scaling":{{"type":"longrope","short_factor":[{factors}],"long_factor":[{factors}]}}}}"#
            ),
            1024,
        )
        .expect("valid test config");
        let l = lora(
            16,
            &[
                TargetModule::QkvProj,
                TargetModule::OProj,
                TargetModule::GateUpProj,
                TargetModule::DownProj,
            ],
        );
        assert_eq!(l.foreign_targets(shape.architecture), None);
        assert_eq!(l.trainable_params(&shape), 23_068_672);
        assert_eq!(
            shape.total_params() + l.trainable_params(&shape),
            3_859_090_432
        );
    }

    #[test]
    fn targets_an_architecture_lacks_are_named_with_its_modules() {
        use crate::LlamaArchitecture::{Llama, Phi3};
        let qv = lora(8, &[TargetModule::QProj, TargetModule::VProj]);
        let e = qv.foreign_targets(Phi3).expect("Phi-3 fuses q, k and v");
        assert_eq!(
            e,
            "q_proj, v_proj are not modules of Phi3ForCausalLM; its modules are qkv_proj, o_proj, gate_up_proj, down_proj, lm_head"
        );
        assert_eq!(qv.foreign_targets(Llama), None);
        let fused = lora(8, &[TargetModule::QkvProj]);
        assert!(
            fused
                .foreign_targets(Llama)
                .expect("Llama has no qkv_proj")
                .starts_with(
                    "qkv_proj is not a module of LlamaForCausalLM; its modules are q_proj, k_proj"
                )
        );
        assert_eq!(
            TargetModule::from_hf_name("gate_up_proj"),
            Some(TargetModule::GateUpProj)
        );
    }

    #[test]
    fn gqa_shrinks_k_and_v_adapters() {
        // Llama-3.2-1B: h 2048, 8 of 32 heads for k/v (kv_dim 512), 16 layers.
        let shape = LlamaShape::from_hf_config(
            r#"{"architectures":["LlamaForCausalLM"],"hidden_size":2048,"intermediate_size":8192,
               "num_hidden_layers":16,"num_attention_heads":32,"num_key_value_heads":8,
               "vocab_size":128256,"rms_norm_eps":1e-5,"rope_theta":500000.0,
               "tie_word_embeddings":true,"head_dim":64}"#,
            2048,
        )
        .expect("valid test config");
        let l = lora(8, &[TargetModule::KProj]);
        assert_eq!(l.trainable_params(&shape), 16 * 8 * (2048 + 512));
    }

    #[test]
    fn base_formats_climb_dense_int8_int4() {
        assert_eq!(BaseFormat::Dense.stricter(), Some(BaseFormat::Int8));
        assert_eq!(BaseFormat::Int8.stricter(), Some(BaseFormat::Nf4));
        assert_eq!(BaseFormat::Int4.stricter(), Some(BaseFormat::Nf4));
        assert_eq!(BaseFormat::Nf4.stricter(), None);
    }
}
