//! The sizes a transformer may have: the CRD's schema holds
//! `spec.model.transformer` to them, and a checkpoint's shape (its
//! config.json, or the initializer's report of it) is held to the same
//! before it is planned. Within them the planner's counts stay small
//! enough to compute exactly; beyond them a single config.json could ask
//! it for any amount of memory and time.

/// An inclusive range of a shape's size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bound {
    pub min: u32,
    pub max: u32,
}

impl Bound {
    /// Whether `value` lies within the bound.
    pub fn holds(self, value: u32) -> bool {
        (self.min..=self.max).contains(&value)
    }
}

/// Transformer blocks (`layers`, config.json's `num_hidden_layers`).
pub const LAYERS: Bound = Bound { min: 1, max: 1024 };
/// Hidden size (`hidden`, `hidden_size`).
pub const HIDDEN: Bound = Bound { min: 8, max: 65536 };
/// Attention heads (`heads`, `num_attention_heads`; also `num_key_value_heads`).
pub const HEADS: Bound = Bound { min: 1, max: 1024 };
/// Tokens per sample (`sequenceLength`).
pub const SEQUENCE_LENGTH: Bound = Bound {
    min: 1,
    max: 1_048_576,
};
/// Vocabulary size (`vocabulary`, `vocab_size`).
pub const VOCABULARY: Bound = Bound {
    min: 2,
    max: 4_194_304,
};
/// Feed-forward inner size (`feedForward`, `intermediate_size`).
pub const FEED_FORWARD: Bound = Bound {
    min: 1,
    max: 1_048_576,
};
/// Per-head size (config.json's `head_dim`): a transformer's is
/// hidden / heads, so at most the largest hidden size.
pub const HEAD_DIM: Bound = Bound {
    min: 1,
    max: HIDDEN.max,
};
