//! A linear layer's forward that keeps what LoRA and QLoRA need and no
//! more: `x·W + s·(x·A)·B (+ bias)`, the base and the adapter apart.
//!
//! burn's `Linear::forward` on an adapted weight composes the dense
//! `W + s·A·B` (dequantized first for QLoRA) and its matmul keeps that
//! dense matrix until backward, one per adapted or quantized matrix per
//! block. Here a dense frozen `W` is read where it lies (autodiff keeps a
//! reference to the parameter, not a copy); a quantized one goes through
//! [`super::frozen_matmul`]; the adapter path keeps `x` and the `r`-wide
//! `x·A`, as PEFT's does.

use burn::nn::Linear;
use burn::tensor::{DType, Tensor};

use super::{FrozenWeight, frozen_matmul};

/// `x` [b, s, d_in] → [b, s, d_out] through `linear`, adapted or not.
pub fn forward(linear: &Linear, x: Tensor<3>) -> Tensor<3> {
    let adapter = linear.weight.adapter();
    let base = linear.weight.base();
    let quantized = matches!(base.dtype(), DType::QFloat(_));
    if (adapter.is_none() && !quantized) || super::naive_ops() {
        return linear.forward(x);
    }
    let y = if quantized {
        frozen_matmul(x.clone(), FrozenWeight::new(base))
    } else {
        x.clone().matmul(base.unsqueeze())
    };
    let y = match adapter {
        Some(adapter) => {
            let delta = x
                .matmul(adapter.a.val().unsqueeze())
                .matmul(adapter.b.val().unsqueeze())
                .mul_scalar(adapter.scale);
            y + delta
        }
        None => y,
    };
    match &linear.bias {
        Some(bias) => y + bias.val().unsqueeze(),
        None => y,
    }
}
