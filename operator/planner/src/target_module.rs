//! The Llama-family modules LoRA may adapt, by their Hugging Face / PEFT
//! names: one list that the model shapes ([`crate::llama`]), the adapters
//! ([`crate::adapters`]) and the worker share.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A Llama-family module LoRA may adapt, named as in Hugging Face / PEFT.
/// Which ones a model has depends on its architecture: Phi-3 has qkv_proj
/// and gate_up_proj where the others have q/k/v_proj and gate/up_proj.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum TargetModule {
    QProj,
    KProj,
    VProj,
    OProj,
    GateProj,
    UpProj,
    DownProj,
    LmHead,
    /// Phi-3's q, k and v in one matrix (`self_attn.qkv_proj`).
    QkvProj,
    /// Phi-3's gate and up in one matrix (`mlp.gate_up_proj`).
    GateUpProj,
}

impl TargetModule {
    /// The seven linear modules of a Llama decoder block, attention's then
    /// the MLP's: every architecture's but Phi-3's, which fuses them into
    /// four ([`crate::LlamaArchitecture::block_linears`]).
    pub const BLOCK_LINEARS: [TargetModule; 7] = [
        TargetModule::QProj,
        TargetModule::KProj,
        TargetModule::VProj,
        TargetModule::OProj,
        TargetModule::GateProj,
        TargetModule::UpProj,
        TargetModule::DownProj,
    ];

    /// The modules of Llama's blocks and its head: every architecture's but Phi-3's.
    pub const ALL: [TargetModule; 8] = {
        let [q, k, v, o, gate, up, down] = TargetModule::BLOCK_LINEARS;
        [q, k, v, o, gate, up, down, TargetModule::LmHead]
    };

    /// Every module of every architecture, Llama's then Phi-3's fused ones.
    pub const EVERY: [TargetModule; 10] = {
        let [q, k, v, o, gate, up, down, head] = TargetModule::ALL;
        [
            q,
            k,
            v,
            o,
            gate,
            up,
            down,
            head,
            TargetModule::QkvProj,
            TargetModule::GateUpProj,
        ]
    };

    /// The module PEFT names `name` (`q_proj`, `qkv_proj`, …), of any architecture.
    pub fn from_hf_name(name: &str) -> Option<TargetModule> {
        TargetModule::EVERY
            .into_iter()
            .find(|m| m.hf_name() == name)
    }

    /// Whether the module is in a block's attention (`self_attn.*`) rather than its MLP.
    pub fn in_attention(self) -> bool {
        matches!(
            self,
            TargetModule::QProj
                | TargetModule::KProj
                | TargetModule::VProj
                | TargetModule::OProj
                | TargetModule::QkvProj
        )
    }

    /// The Hugging Face module name (`q_proj`, …, `lm_head`).
    pub fn hf_name(self) -> &'static str {
        match self {
            TargetModule::QProj => "q_proj",
            TargetModule::KProj => "k_proj",
            TargetModule::VProj => "v_proj",
            TargetModule::OProj => "o_proj",
            TargetModule::GateProj => "gate_proj",
            TargetModule::UpProj => "up_proj",
            TargetModule::DownProj => "down_proj",
            TargetModule::LmHead => "lm_head",
            TargetModule::QkvProj => "qkv_proj",
            TargetModule::GateUpProj => "gate_up_proj",
        }
    }

    /// Whether the module sits in every decoder block (all but `lm_head`).
    pub fn per_layer(self) -> bool {
        self != TargetModule::LmHead
    }
}

impl std::fmt::Display for TargetModule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.hf_name())
    }
}
