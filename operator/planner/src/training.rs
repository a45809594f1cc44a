//! Numerics and batch settings: what a plan tells a worker to do.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::adapters::BaseFormat;

/// Training precision. `bf16`/`fp16` mean mixed precision: 16-bit weights,
/// gradients and activations with 32-bit master weights in the optimizer.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
#[serde(rename_all = "camelCase")]
pub enum Precision {
    Fp32,
    Bf16,
    Fp16,
}

/// Optimizer. `adamw8bit` keeps both moments in 8 bits (bitsandbytes style).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum Optimizer {
    Adamw,
    Adam,
    SgdMomentum,
    Sgd,
    Adamw8bit,
}

/// 8-bit optimizer state as bitsandbytes keeps it (`Adam8bit`, block-wise):
/// each moment in one byte per element with one f32 absmax per block of
/// this many elements. Shared by the planner's count and the worker's
/// optimizer, so the two cannot drift.
pub const OPTIMIZER_8BIT_BLOCK: u64 = 256;
/// Tensors with fewer elements than this keep 32-bit state (bitsandbytes'
/// `min_8bit_size`): norms and biases, whose state is tiny anyway.
pub const OPTIMIZER_8BIT_MIN_ELEMENTS: u64 = 4096;

impl Precision {
    /// Bytes per weight element held by the model.
    pub fn weight_bytes(self) -> u64 {
        match self {
            Precision::Fp32 => 4,
            Precision::Bf16 | Precision::Fp16 => 2,
        }
    }

    /// Bytes per gradient element.
    pub fn gradient_bytes(self) -> u64 {
        self.weight_bytes()
    }

    /// Bytes per activation element.
    pub fn activation_bytes(self) -> u64 {
        self.weight_bytes()
    }

    /// Extra optimizer bytes per parameter for the fp32 master copy (mixed precision only).
    pub fn master_weight_bytes(self) -> u64 {
        match self {
            Precision::Fp32 => 0,
            Precision::Bf16 | Precision::Fp16 => 4,
        }
    }

    /// The next lower precision a retry may move to, if any. bf16 is preferred
    /// over fp16 because it needs no loss scaling.
    pub fn lower(self) -> Option<Precision> {
        match self {
            Precision::Fp32 => Some(Precision::Bf16),
            Precision::Bf16 | Precision::Fp16 => None,
        }
    }
}

impl Optimizer {
    /// Optimizer state bytes per parameter, excluding any master weights.
    pub fn state_bytes(self) -> u64 {
        match self {
            Optimizer::Adamw | Optimizer::Adam => 8,
            Optimizer::SgdMomentum => 4,
            Optimizer::Sgd => 0,
            Optimizer::Adamw8bit => 2,
        }
    }

    /// Optimizer state bytes of one tensor of `elements` parameters,
    /// excluding master weights. 8-bit AdamW counts exactly what the
    /// block-wise 8-bit state keeps: both moments at one byte an element plus
    /// one f32 absmax per moment and [`OPTIMIZER_8BIT_BLOCK`] elements; a
    /// tensor below [`OPTIMIZER_8BIT_MIN_ELEMENTS`] keeps 32-bit moments.
    pub fn tensor_state_bytes(self, elements: u64) -> u64 {
        match self {
            Optimizer::Adamw8bit if elements >= OPTIMIZER_8BIT_MIN_ELEMENTS => {
                2 * elements + 2 * 4 * elements.div_ceil(OPTIMIZER_8BIT_BLOCK)
            }
            Optimizer::Adamw8bit => 8 * elements,
            _ => self.state_bytes() * elements,
        }
    }

    /// A cheaper-state variant with the same update rule family, if any.
    /// Switching Adam to SGD would change the training itself, so it is not offered.
    pub fn cheaper(self) -> Option<Optimizer> {
        match self {
            Optimizer::Adamw | Optimizer::Adam => Some(Optimizer::Adamw8bit),
            Optimizer::SgdMomentum | Optimizer::Sgd | Optimizer::Adamw8bit => None,
        }
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
            Precision::Fp16 => "fp16",
        })
    }
}

impl std::fmt::Display for Optimizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Optimizer::Adamw => "adamw",
            Optimizer::Adam => "adam",
            Optimizer::SgdMomentum => "sgdMomentum",
            Optimizer::Sgd => "sgd",
            Optimizer::Adamw8bit => "adamw8bit",
        })
    }
}

/// The per-worker training settings a plan fixes.
/// Invariant: `micro_batch × gradient_accumulation = global batch` (one data-parallel rank).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Settings {
    /// Samples per forward/backward pass.
    pub micro_batch: u32,
    /// Micro-batches whose gradients are summed before each optimizer step.
    pub gradient_accumulation: u32,
    /// Keep only each block's input and recompute the rest in backward.
    pub activation_checkpointing: bool,
    pub precision: Precision,
    pub optimizer: Optimizer,
    /// How the frozen base weights are stored (LoRA: dense; QLoRA: int8 or
    /// int4). Always dense for full fine-tuning.
    #[serde(default)]
    pub base_format: BaseFormat,
    /// Keep the optimizer state (and its step) in host memory instead of
    /// on the GPU; never on CPU workers, whose state is on the host already.
    #[serde(default)]
    pub offload_optimizer: bool,
    /// With activation checkpointing on a GPU: keep each block's checkpointed
    /// input in host memory between its forward and its recomputation
    /// instead of on the device (what Unsloth's offloaded gradient
    /// checkpointing does). Never on CPU workers, whose device is the host.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub offload_activations: bool,
    /// LoRA jobs on a GPU: keep the frozen token embedding in host memory
    /// and look the micro-batch's tokens up there, uploading only their
    /// rows (Unsloth's `offload_embedding`). A tied embedding is the head's
    /// weight and stays on the device whatever this says. Never on CPU
    /// workers, whose device is the host.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub offload_embedding: bool,
    /// With activation checkpointing and the optimizer offloaded, on a GPU:
    /// each block's gradient leaves the device as its backward produces it
    /// and is accumulated in fp32 in host memory, where the optimizer state
    /// and the step live (DeepSpeed's ZeRO-Offload, torchtune's optimizer in
    /// backward); the device keeps no gradient beyond the block in flight.
    /// Never on CPU workers, whose device is the host.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub offload_gradients: bool,
    /// With the optimizer offloaded and a half-precision stage: the host
    /// keeps 2 bytes a trained value where it kept 4, twice. The fp32
    /// master weights become the part below the device's bf16/fp16 copy,
    /// stored in bf16 (the master is that copy plus this remainder: about
    /// 16 significant bits over bf16 weights, 19 over fp16, against fp32's
    /// 24; Kahan-compensated bf16 training's idea), and offloaded gradients
    /// are summed in the training precision, as the device accumulator sums
    /// them without the offload. The search turns it on only where the
    /// node's host memory cannot hold the full state.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub compact_host_state: bool,
}

impl Default for Settings {
    /// What a plan without any rung runs: one sample a pass, no
    /// accumulation, no checkpointing, fp32 AdamW (a job's default
    /// numerics), a dense base and nothing offloaded.
    fn default() -> Self {
        Settings {
            micro_batch: 1,
            gradient_accumulation: 1,
            activation_checkpointing: false,
            precision: Precision::Fp32,
            optimizer: Optimizer::Adamw,
            base_format: BaseFormat::Dense,
            offload_optimizer: false,
            offload_activations: false,
            offload_embedding: false,
            offload_gradients: false,
            compact_host_state: false,
        }
    }
}

impl Settings {
    /// Samples per optimizer step.
    pub fn global_batch(&self) -> u64 {
        u64::from(self.micro_batch) * u64::from(self.gradient_accumulation)
    }
}

impl std::fmt::Display for Settings {
    /// `micro-batch 16 × 2, checkpointing on, fp32, adamw` (× accumulation).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ckpt = if self.activation_checkpointing {
            "on"
        } else {
            "off"
        };
        write!(
            f,
            "micro-batch {} × {}, checkpointing {ckpt}, {}, {}",
            self.micro_batch, self.gradient_accumulation, self.precision, self.optimizer
        )?;
        if self.base_format.is_quantized() {
            write!(f, ", {} base", self.base_format)?;
        }
        if self.offload_optimizer {
            f.write_str(", optimizer offloaded")?;
        }
        if self.offload_activations {
            f.write_str(", checkpoints offloaded")?;
        }
        if self.offload_embedding {
            f.write_str(", embedding offloaded")?;
        }
        if self.offload_gradients {
            f.write_str(", gradients offloaded")?;
        }
        if self.compact_host_state {
            f.write_str(", host state compact")?;
        }
        Ok(())
    }
}

/// Divisors of `n` in descending order (micro-batch candidates that keep the global batch exact).
pub fn divisors_desc(n: u32) -> Vec<u32> {
    let mut small = Vec::new();
    let mut large = Vec::new();
    let mut i = 1u32;
    while u64::from(i) * u64::from(i) <= u64::from(n) {
        if n.is_multiple_of(i) {
            small.push(i);
            if i != n / i {
                large.push(n / i);
            }
        }
        i += 1;
    }
    large.extend(small.into_iter().rev());
    large
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_paper_mixed_precision_adam_is_16_bytes_per_param() {
        let p = Precision::Bf16;
        let o = Optimizer::Adam;
        let per_param =
            p.weight_bytes() + p.gradient_bytes() + p.master_weight_bytes() + o.state_bytes();
        assert_eq!(per_param, 16); // 2 + 2 + K=12
    }

    #[test]
    fn fp32_adam_is_16_bytes_per_param() {
        let p = Precision::Fp32;
        assert_eq!(
            p.weight_bytes() + p.gradient_bytes() + Optimizer::Adamw.state_bytes(),
            16
        );
    }

    #[test]
    fn eight_bit_adamw_counts_blocks_and_keeps_small_tensors_at_32_bits() {
        let o = Optimizer::Adamw8bit;
        // 4096 elements: 2 bytes each plus 16 blocks × 2 absmax × 4 bytes.
        assert_eq!(o.tensor_state_bytes(4096), 2 * 4096 + 16 * 8);
        // A partial block still has its absmax.
        assert_eq!(o.tensor_state_bytes(4097), 2 * 4097 + 17 * 8);
        // Below the minimum (a norm weight of h = 3072): 32-bit moments.
        assert_eq!(o.tensor_state_bytes(3072), 8 * 3072);
        assert_eq!(Optimizer::Adamw.tensor_state_bytes(10), 80);
    }

    #[test]
    fn divisors_are_descending_and_complete() {
        assert_eq!(divisors_desc(12), vec![12, 6, 4, 3, 2, 1]);
        assert_eq!(divisors_desc(1), vec![1]);
        assert_eq!(divisors_desc(16), vec![16, 8, 4, 2, 1]);
    }
}
