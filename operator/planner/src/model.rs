//! What is being trained: a decoder-only transformer's shape, or a generic
//! model known only by its parameter count and activation size.
//!
//! These types are also the `spec.model` of the custom resource, so their
//! schema carries the bounds and CEL rules the API server enforces.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::limits;

/// The model to train. Exactly one variant; serialised as `{transformer: {...}}`
/// or `{generic: {...}}`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum ModelShape {
    /// A GPT-style decoder-only transformer (the shape the Headroom worker builds).
    Transformer(TransformerShape),
    /// A Llama-family model (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2, Gemma 3) as its Hugging Face
    /// `config.json` describes it. Planned; the worker does not build it yet.
    Llama(crate::llama::LlamaShape),
    /// Any other model, described by its parameter count and activation bytes.
    Generic(GenericModel),
}

/// A decoder-only transformer: token + learned position embeddings, `layers`
/// pre-norm blocks (attention + feed-forward), a final layer norm and an
/// output head (tied to the token embedding unless `tiedEmbeddings: false`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "self.hidden % self.heads == 0",
     "message": "model.transformer.hidden must be a multiple of model.transformer.heads (e.g. hidden 768 with 12 heads)"}
]))]
pub struct TransformerShape {
    /// Transformer blocks (L).
    #[schemars(range(min = limits::LAYERS.min, max = limits::LAYERS.max))]
    pub layers: u32,
    /// Hidden size (h).
    #[schemars(range(min = limits::HIDDEN.min, max = limits::HIDDEN.max))]
    pub hidden: u32,
    /// Attention heads (a); `hidden` must be a multiple of it.
    #[schemars(range(min = limits::HEADS.min, max = limits::HEADS.max))]
    pub heads: u32,
    /// Tokens per sample (s).
    #[schemars(range(min = limits::SEQUENCE_LENGTH.min, max = limits::SEQUENCE_LENGTH.max))]
    pub sequence_length: u32,
    /// Vocabulary size (v).
    #[schemars(range(min = limits::VOCABULARY.min, max = limits::VOCABULARY.max))]
    pub vocabulary: u32,
    /// Feed-forward inner size; defaults to 4 × hidden.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = limits::FEED_FORWARD.min, max = limits::FEED_FORWARD.max))]
    pub feed_forward: Option<u32>,
    /// Whether the output head shares the token embedding matrix.
    #[serde(default = "default_true")]
    pub tied_embeddings: bool,
}

/// A model known only by totals. It cannot be split into pipeline stages.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GenericModel {
    /// Trainable parameters.
    #[schemars(range(min = 1))]
    pub parameters: u64,
    /// Activation bytes kept for backward per training sample at 32-bit
    /// precision without checkpointing (measure once, e.g. from a profiler).
    #[schemars(range(min = 0))]
    pub activation_bytes_per_sample: u64,
}

fn default_true() -> bool {
    true
}

impl TransformerShape {
    /// Feed-forward inner size (f).
    pub fn ffn(&self) -> u64 {
        self.feed_forward
            .map_or(4 * u64::from(self.hidden), u64::from)
    }

    /// Parameters of one block: attention 4h² + 4h, feed-forward 2hf + f + h,
    /// two layer norms 4h. With f = 4h this is the familiar 12h² + 13h.
    pub fn params_per_layer(&self) -> u64 {
        let h = u64::from(self.hidden);
        let f = self.ffn();
        4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h
    }

    /// Token embedding v·h plus learned positions s·h (first pipeline stage).
    pub fn embedding_params(&self) -> u64 {
        let h = u64::from(self.hidden);
        (u64::from(self.vocabulary) + u64::from(self.sequence_length)) * h
    }

    /// Final layer norm 2h plus the output head v·h when it is not tied.
    pub fn head_params(&self) -> u64 {
        let h = u64::from(self.hidden);
        let head = if self.tied_embeddings {
            0
        } else {
            u64::from(self.vocabulary) * h
        };
        2 * h + head
    }

    /// Total trainable parameters on a single device.
    pub fn total_params(&self) -> u64 {
        u64::from(self.layers) * self.params_per_layer()
            + self.embedding_params()
            + self.head_params()
    }
}

impl ModelShape {
    /// Total trainable parameters.
    pub fn total_params(&self) -> u64 {
        match self {
            ModelShape::Transformer(t) => t.total_params(),
            ModelShape::Llama(l) => l.total_params(),
            ModelShape::Generic(g) => g.parameters,
        }
    }

    /// Layers that can be spread over pipeline stages (1 for a generic model).
    pub fn splittable_layers(&self) -> u32 {
        match self {
            ModelShape::Transformer(t) => t.layers,
            ModelShape::Llama(l) => l.layers,
            ModelShape::Generic(_) => 1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn gpt2_small() -> TransformerShape {
        TransformerShape {
            layers: 12,
            hidden: 768,
            heads: 12,
            sequence_length: 1024,
            vocabulary: 50257,
            feed_forward: None,
            tied_embeddings: true,
        }
    }

    #[test]
    fn gpt2_small_has_124m_parameters() {
        // GPT-2 small is published as 124M parameters (tied head, 1024 positions).
        let p = gpt2_small().total_params();
        assert!((124_000_000..125_000_000).contains(&p), "{p}");
    }

    #[test]
    fn layer_formula_matches_12h2_plus_13h() {
        let t = gpt2_small();
        let h = 768u64;
        assert_eq!(t.params_per_layer(), 12 * h * h + 13 * h);
    }

    #[test]
    fn untied_head_adds_vocab_by_hidden() {
        let mut t = gpt2_small();
        let tied = t.total_params();
        t.tied_embeddings = false;
        assert_eq!(t.total_params() - tied, 50257 * 768);
    }
}
