//! A linear layer's forward that keeps what LoRA and QLoRA need and no
//! more: `x·W + s·(x·A)·B (+ bias)`, the base and the adapter apart.
//!
//! burn's `Linear::forward` on an adapted weight composes the dense
//! `W + s·A·B` (dequantized first for QLoRA) and its matmul keeps that
//! dense matrix until backward, one per adapted or quantized matrix per
//! block. Here a dense frozen `W` is read where it lies (autodiff keeps a
//! reference to the parameter, not a copy), with its adapter as one op
//! ([`super::adapted_matmul`]) unless dropout gives the adapter an input
//! of its own; a quantized one goes through [`super::frozen_matmul`]; the
//! adapter path keeps `x` and the `r`-wide `x·A`, as PEFT's does.
//!
//! Every product with a trained weight runs on the tokens as rows
//! ([`on_rows`]): `[b·s, d_in]·[d_in, d_out]`. burn's matmul of a `[b, s,
//! d_in]` input against the weight broadcasts the weight over the batch,
//! and autodiff's backward of it makes the weight's gradient per batch
//! element, `[b, d_in, d_out]`, before summing it: a transient of `b`
//! weights, which at micro-batch 32 outgrew a block's activations several
//! times (a 2 × 1024 GPT measured 1233 MiB against 903 predicted,
//! docs/benchmarks.md). As rows, the gradient is one `[d_in, d_out]`
//! product.

use burn::nn::Linear;
use burn::tensor::{DType, Distribution, FloatDType, Tensor};

use super::{FrozenWeight, frozen_matmul};
use crate::model::nf4::Nf4Weight;

/// Dropout on an adapter's input (PEFT's `lora_dropout`): `(x·mask /
/// (1 − p))·A·B`, the base matmul untouched. The mask is drawn from burn's
/// generator seeded with a key of the step, the micro-batch, the layer and
/// the module ([`Self::part`]), never from the generator's running state,
/// so a checkpointed block recomputed in backward drops exactly what its
/// first forward dropped.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdapterDropout {
    p: f64,
    seed: u64,
}

impl AdapterDropout {
    /// Dropout with probability `p` under `seed`; `None` for `p = 0`.
    pub fn new(p: f64, seed: u64) -> Option<Self> {
        (p > 0.0).then_some(AdapterDropout { p, seed })
    }

    /// The key of part `index` of what this one covers (a step's micro-batch,
    /// a block of it, a module of that).
    pub fn part(self, index: u64) -> Self {
        let mix = crate::data::splitmix;
        AdapterDropout {
            p: self.p,
            seed: mix(self.seed ^ mix(index)),
        }
    }

    fn apply(self, x: Tensor<3>) -> Tensor<3> {
        let keep = 1.0 - self.p;
        let device = x.device();
        let mask = crate::model::with_generator(|| {
            device.seed(self.seed);
            Tensor::<3>::random(x.shape(), Distribution::Bernoulli(keep), &device)
        });
        let mask = if mask.dtype() == x.dtype() {
            mask
        } else {
            mask.cast(FloatDType::from(x.dtype()))
        };
        x * mask.div_scalar(keep)
    }
}

/// `x` [b, s, d_in] → [b, s, d_out] through `linear`, adapted or not. An
/// NF4 base (`nf4`) stands in for the linear's weight, which is then an
/// empty placeholder (see [`crate::model::lora`]). `dropout` applies to
/// the adapter's input only, and only in training.
pub fn forward(
    linear: &Linear,
    nf4: Option<&Nf4Weight>,
    x: Tensor<3>,
    dropout: Option<AdapterDropout>,
) -> Tensor<3> {
    let adapter = linear.weight.adapter();
    let base = match nf4 {
        Some(w) => FrozenWeight::Nf4(w.clone()),
        None => FrozenWeight::Burn(linear.weight.base()),
    };
    let frozen = match &base {
        FrozenWeight::Burn(w) => matches!(w.dtype(), DType::QFloat(_)),
        FrozenWeight::Nf4(_) => true,
    };
    // The naive A/B baseline is burn's own composition; burn has no NF4
    // base to compose, so an NF4 linear runs the lean path in both arms.
    let naive = super::naive_ops() && nf4.is_none() && dropout.is_none();
    if naive || (adapter.is_none() && !frozen) {
        return on_rows(x, |x| linear.forward(x));
    }
    let y = match (base, adapter, dropout) {
        // A dense base with its adapter and no dropout: one op, the
        // adapter's products added into the base's (`super::adapted`).
        (FrozenWeight::Burn(w), Some(adapter), None) if !frozen => {
            let y = on_rows(x, |x| {
                super::adapted_matmul(x, w, adapter.a.val(), adapter.b.val(), adapter.scale)
            });
            return with_bias(linear, y);
        }
        (FrozenWeight::Burn(w), _, _) if !frozen => on_rows(x.clone(), |x| x.matmul(w)),
        (base, _, _) => frozen_matmul(x.clone(), base),
    };
    let y = match adapter {
        Some(adapter) => {
            let x = match dropout {
                Some(d) => d.apply(x),
                None => x,
            };
            // The scale on the r-wide `x·A`, not on the `d_out`-wide
            // product: PEFT's `B(A(x))·s` in one pass over `r` columns
            // instead of one over `d_out` forward and another backward
            // (measured: `calibrate --step-breakdown --only linear-ops`).
            let delta = on_rows(x, |x| {
                x.matmul(adapter.a.val())
                    .mul_scalar(adapter.scale)
                    .matmul(adapter.b.val())
            });
            y + delta
        }
        None => y,
    };
    with_bias(linear, y)
}

/// `f` applied to `x`'s tokens as rows: `[b, s, d]` → `[b·s, d]` → `f` →
/// `[b, s, d_out]` (a reshape of a contiguous tensor: no copy, and none
/// kept for backward). See the module docs for why.
pub fn on_rows(x: Tensor<3>, f: impl FnOnce(Tensor<2>) -> Tensor<2>) -> Tensor<3> {
    let [b, s, d] = x.dims();
    let y = f(x.reshape([b * s, d]));
    let out = y.dims()[1];
    y.reshape([b, s, out])
}

fn with_bias(linear: &Linear, y: Tensor<3>) -> Tensor<3> {
    match &linear.bias {
        Some(bias) => y + bias.val().unsqueeze(),
        None => y,
    }
}
