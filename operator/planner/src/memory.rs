//! The memory model: bytes one worker (one pipeline stage on one device) needs.
//!
//! total = (weights + gradients + optimizer state + activations + logits)
//!         × (1 + allocator slack) + fixed backend overhead, × correction.
//!
//! Activations follow Korthikanti et al. 2022 generalised to any element size
//! `e` and dropout-mask size `m` (bytes): per block, per micro-batch of `b`,
//! `s·b·h·(16e + 2m) + a·s²·b·(2e + m)`, which is the published
//! `s·b·h·(34 + 5·a·s/h)` at e = 2, m = 1. With full activation
//! checkpointing a block keeps only its input (`s·b·h·e`) and one block at a
//! time is recomputed in backward, so checkpointing never raises the figure.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::backend::BackendProfile;
use crate::model::ModelShape;
use crate::training::Settings;

/// Bytes by component for one worker. `total` is what is compared with the budget.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MemoryBreakdown {
    /// Parameters, bytes.
    pub weights: u64,
    /// Gradients (and the accumulation buffer when accumulating), bytes.
    pub gradients: u64,
    /// Optimizer state (e.g. AdamW's two moments), bytes.
    pub optimizer_state: u64,
    /// Activations kept for the backward pass of the micro-batches in flight, bytes.
    pub activations: u64,
    /// Logits and their gradient for one micro-batch, bytes.
    pub logits: u64,
    /// The backend's fixed overhead (runtime, context, workspace), bytes.
    pub fixed_overhead: u64,
    /// Allocator fragmentation and caching on top of the above, bytes.
    pub allocator_slack: u64,
    /// Added from the observed/predicted ratio of earlier attempts (0 on a first attempt).
    pub correction: u64,
    /// The predicted peak: the sum of the above, bytes.
    pub total: u64,
}

/// Where a stage sits in the pipeline and how much of the model it holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StagePlacement {
    /// Transformer blocks on this stage.
    pub layers: u32,
    /// Holds the embeddings.
    pub first: bool,
    /// Holds the final norm, output head and loss.
    pub last: bool,
    /// Micro-batches whose activations are alive at once (1F1B: p − k on stage k).
    pub in_flight: u32,
}

impl StagePlacement {
    /// The whole model on one worker.
    pub fn single(layers: u32) -> Self {
        StagePlacement {
            layers,
            first: true,
            last: true,
            in_flight: 1,
        }
    }
}

/// Activation bytes one transformer block keeps for backward, for one micro-batch.
pub fn block_activation_bytes(
    s: u64,
    b: u64,
    h: u64,
    a: u64,
    element_bytes: u64,
    mask_bytes: u64,
    checkpointed: bool,
) -> u64 {
    if checkpointed {
        s * b * h * element_bytes
    } else {
        s * b * h * (16 * element_bytes + 2 * mask_bytes)
            + a * s * s * b * (2 * element_bytes + mask_bytes)
    }
}

/// Predicted memory of one stage (or of the whole model when `stage` is
/// [`StagePlacement::single`]). `correction` ≥ 1 scales the total.
pub fn estimate_stage(
    model: &ModelShape,
    settings: &Settings,
    stage: StagePlacement,
    profile: &BackendProfile,
    correction: f64,
) -> MemoryBreakdown {
    let p = settings.precision;
    let b = u64::from(settings.micro_batch);
    let e = p.activation_bytes();
    let in_flight = u64::from(stage.in_flight.max(1));

    let (params, activations, logits) = match model {
        ModelShape::Transformer(t) => {
            let mut params = u64::from(stage.layers) * t.params_per_layer();
            if stage.first {
                params += t.embedding_params();
            }
            if stage.last {
                params += t.head_params();
                // A tied head on a stage without the embedding needs its own copy.
                if t.tied_embeddings && !stage.first {
                    params += u64::from(t.vocabulary) * u64::from(t.hidden);
                }
            }
            let (s, h, a) = (
                u64::from(t.sequence_length),
                u64::from(t.hidden),
                u64::from(t.heads),
            );
            let m = profile.dropout_mask_bytes;
            let kept = block_activation_bytes(s, b, h, a, e, m, settings.activation_checkpointing);
            let mut act = in_flight * u64::from(stage.layers) * kept;
            if settings.activation_checkpointing && stage.layers > 0 {
                // Backward recomputes one block at a time; its kept input is part of that block's full set.
                act += block_activation_bytes(s, b, h, a, e, m, false) - kept;
            }
            let logits = if stage.last {
                s * b * u64::from(t.vocabulary) * 4 * profile.logit_copies
            } else {
                0
            };
            (params, act, logits)
        }
        ModelShape::Llama(l) => {
            let mut params = u64::from(stage.layers) * l.params_per_layer();
            if stage.first {
                params += l.embedding_params();
            }
            if stage.last {
                params += l.head_params();
                // A tied head on a stage without the embedding needs its own copy.
                if l.tied_embeddings && !stage.first {
                    params += l.embedding_params();
                }
            }
            let ckpt = settings.activation_checkpointing;
            let kept = l.block_activation_bytes(b, e, ckpt);
            let mut act = in_flight * u64::from(stage.layers) * kept;
            if ckpt && stage.layers > 0 {
                act += l.block_activation_bytes(b, e, false) - kept;
            }
            let logits = if stage.last {
                u64::from(l.sequence_length)
                    * b
                    * u64::from(l.vocabulary)
                    * 4
                    * profile.logit_copies
            } else {
                0
            };
            (params, act, logits)
        }
        ModelShape::Generic(g) => {
            // Declared at 32-bit; scale to the element size. Checkpointing is
            // not modelled for an opaque model, so it never lowers the figure.
            (g.parameters, g.activation_bytes_per_sample * b * e / 4, 0)
        }
    };

    let weights = params * p.weight_bytes();
    // Accumulating gradients keeps the running sum beside the current micro-batch's.
    let grad_copies = if settings.gradient_accumulation > 1 {
        2
    } else {
        1
    };
    let gradients = params * p.gradient_bytes() * grad_copies;
    let optimizer_state = params * (p.master_weight_bytes() + settings.optimizer.state_bytes());
    let tensors = weights + gradients + optimizer_state + activations + logits;
    let allocator_slack = (tensors as f64 * profile.allocator_slack).round() as u64;
    let fixed_overhead = profile.fixed_overhead_bytes;
    let uncorrected = tensors + allocator_slack + fixed_overhead;
    let correction = ((correction.max(1.0) - 1.0) * uncorrected as f64).round() as u64;
    MemoryBreakdown {
        weights,
        gradients,
        optimizer_state,
        activations,
        logits,
        fixed_overhead,
        allocator_slack,
        correction,
        total: uncorrected + correction,
    }
}

/// Model-state bytes per data-parallel rank for mixed-precision Adam (K = 12)
/// under ZeRO sharding stage 0–3 over `ranks` (Rajbhandari et al. 2019).
/// The search does not shard yet: the worker trains one rank per pipeline stage.
pub fn zero_model_state_bytes(params: u64, zero_stage: u8, ranks: u64) -> u64 {
    let d = ranks.max(1);
    match zero_stage {
        0 => 16 * params,
        1 => 4 * params + 12 * params / d,
        2 => 2 * params + 14 * params / d,
        _ => 16 * params / d,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::FLEX;
    use crate::model::TransformerShape;
    use crate::training::{Optimizer, Precision};

    #[test]
    fn zero_paper_example() {
        // P = 7.5e9, d = 64: 120 / 31.4 / 16.6 / 1.9 GB (10^9 bytes).
        let gb = |x: u64| x as f64 / 1e9;
        let p = 7_500_000_000;
        assert!((gb(zero_model_state_bytes(p, 0, 64)) - 120.0).abs() < 0.05);
        assert!((gb(zero_model_state_bytes(p, 1, 64)) - 31.4).abs() < 0.05);
        assert!((gb(zero_model_state_bytes(p, 2, 64)) - 16.6).abs() < 0.05);
        assert!((gb(zero_model_state_bytes(p, 3, 64)) - 1.9).abs() < 0.05);
    }

    #[test]
    fn korthikanti_gpt3_layer() {
        // GPT-3 175B block: s = 2048, h = 12288, a = 96, b = 1, 16-bit, 1-byte masks.
        let (s, h, a) = (2048u64, 12288u64, 96u64);
        let published = s * h * (34 + 5 * a * s / h); // sbh(34 + 5as/h) = 2.87e9 bytes
        assert_eq!(block_activation_bytes(s, 1, h, a, 2, 1, false), published);
        assert_eq!(published, 2_868_903_936);
        // Full recomputation keeps 2·s·b·h.
        assert_eq!(block_activation_bytes(s, 1, h, a, 2, 1, true), 2 * s * h);
    }

    fn small() -> ModelShape {
        ModelShape::Transformer(TransformerShape {
            layers: 4,
            hidden: 256,
            heads: 4,
            sequence_length: 128,
            vocabulary: 1000,
            feed_forward: None,
            tied_embeddings: true,
        })
    }

    fn settings(b: u32, ckpt: bool) -> Settings {
        Settings {
            micro_batch: b,
            gradient_accumulation: 1,
            activation_checkpointing: ckpt,
            precision: Precision::Fp32,
            optimizer: Optimizer::Adamw,
        }
    }

    #[test]
    fn breakdown_adds_up() {
        let m = estimate_stage(
            &small(),
            &settings(8, false),
            StagePlacement::single(4),
            &FLEX,
            1.0,
        );
        let sum = m.weights + m.gradients + m.optimizer_state + m.activations + m.logits;
        assert_eq!(
            m.total,
            sum + m.allocator_slack + m.fixed_overhead + m.correction
        );
        assert_eq!(m.weights, small().total_params() * 4);
        assert_eq!(m.correction, 0);
    }

    #[test]
    fn correction_scales_the_total() {
        let base = estimate_stage(
            &small(),
            &settings(8, false),
            StagePlacement::single(4),
            &FLEX,
            1.0,
        );
        let corrected = estimate_stage(
            &small(),
            &settings(8, false),
            StagePlacement::single(4),
            &FLEX,
            1.5,
        );
        let ratio = corrected.total as f64 / base.total as f64;
        assert!((ratio - 1.5).abs() < 1e-6, "{ratio}");
    }

    #[test]
    fn checkpointing_lowers_activations_for_deep_models() {
        let off = estimate_stage(
            &small(),
            &settings(8, false),
            StagePlacement::single(4),
            &FLEX,
            1.0,
        );
        let on = estimate_stage(
            &small(),
            &settings(8, true),
            StagePlacement::single(4),
            &FLEX,
            1.0,
        );
        assert!(on.activations < off.activations);
    }
}
