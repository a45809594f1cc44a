//! Next-token cross-entropy straight from the final hidden states and the
//! head weight, a chunk of rows at a time (as Liger-Kernel's fused linear
//! cross-entropy does): one chunk's logits exist at a time, never the whole
//! `[rows, vocab]` logits or their gradient.
//!
//! Where gradients are wanted, the forward also forms each chunk's
//! `softmax − onehot` from the logits it already has and turns it into the
//! gradients of the hidden states and (if trained) of the head at once, as
//! Liger-Kernel does: the backward only scales them by the loss's gradient.
//! Recomputing the logits in backward instead cost a third head matmul (a
//! fourth in a full fine-tune), about a tenth of a LoRA step on a 49k
//! vocabulary. What is kept between the passes is the same size as before:
//! `[rows, hidden]` (the hidden states' gradient instead of the hidden
//! states), and the head's gradient, which backward made first anyway.
//!
//! The caller says which gradient of the loss it will pass back
//! (`grad_scale`: fp16's loss scale over the micro-batches); the forward
//! forms `softmax − onehot` times it, so an fp16 gradient keeps the range
//! the loss scale gives it, and backward multiplies by the ratio of what
//! came back to what was announced (nothing to do when they are equal).
//!
//! Logits are computed in the model's dtype and reduced in f32. With
//! Gemma's final soft-capping each chunk's logits z become
//! cap · tanh(z / cap) before the softmax, and their gradient is multiplied
//! by the derivative, 1 − tanh², from the capped logits.
//!
//! On the CPU in f32 (uncapped) a chunk's logits are reduced row by row in
//! three cache-resident passes (max; exp and sum; scale, in place), where
//! the tensor ops each stream the whole chunk through memory; elsewhere
//! (CUDA, wgpu, half types, soft-capping) the same formulas run as burn's
//! tensor ops.

use std::ops::Range;

use burn::backend::Flex;
use burn::backend::tensor::FloatTensor;
use burn::tensor::{DType, Device, FloatDType, IndexingUpdateOp, Int, Tensor, TensorData};

use super::exp::{exp, exp_f32};
use crate::flex_values::{flex_f32, into_flex, is_flex_f32, values, values_mut};

fn chunks(len: usize, chunk: usize) -> Vec<Range<usize>> {
    let chunk = chunk.max(1);
    (0..len.div_ceil(chunk))
        .map(|i| i * chunk..((i + 1) * chunk).min(len))
        .collect()
}

/// One chunk's logits in f32: `hidden[r] · weightᵀ`, `[|r|, vocab]`,
/// soft-capped at `softcap` where given.
fn logits(
    hidden: &Tensor<2>,
    weight_t: &Tensor<2>,
    r: &Range<usize>,
    softcap: Option<f64>,
) -> Tensor<2> {
    let z = hidden
        .clone()
        .narrow(0, r.start, r.len())
        .matmul(weight_t.clone())
        .cast(FloatDType::F32);
    match softcap {
        Some(cap) => z.div_scalar(cap).tanh().mul_scalar(cap),
        None => z,
    }
}

/// Which gradients the forward forms, and for which gradient of the loss.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Wanted {
    /// The hidden states' gradient.
    pub hidden: bool,
    /// The head weight's gradient.
    pub weight: bool,
    /// The gradient of the loss the backward is expected to receive.
    pub grad_scale: f64,
}

impl Wanted {
    /// The loss alone (no graph: evaluation, a frozen stage).
    pub const NONE: Wanted = Wanted {
        hidden: false,
        weight: false,
        grad_scale: 1.0,
    };

    fn any(&self) -> bool {
        self.hidden || self.weight
    }
}

/// The loss and the gradients [`Wanted`] asked for, at `grad_scale`.
#[derive(Debug)]
pub struct LossAndGradients {
    /// Mean cross-entropy, [1] (f32).
    pub loss: Tensor<1>,
    /// `grad_scale · ∂loss/∂hidden`, [n, h] in the hidden states' dtype.
    pub dhidden: Option<Tensor<2>>,
    /// `grad_scale · ∂loss/∂weight`, [vocab, h] in the weight's dtype.
    pub dweight: Option<Tensor<2>>,
}

/// Mean cross-entropy of `hidden` [n, h] under the head `weight` [vocab, h]
/// (its logits soft-capped at `softcap` where given) against `targets`
/// [n], with the gradients `wanted` asks for.
pub fn forward(
    hidden: Tensor<2>,
    weight: Tensor<2>,
    targets: Tensor<1, Int>,
    chunk: usize,
    softcap: Option<f64>,
    wanted: Wanted,
) -> LossAndGradients {
    let [n, _] = hidden.dims();
    let dtype = FloatDType::from(hidden.dtype());
    let weight_t = weight.clone().transpose();
    // d(mean)/d(row) = 1 / n, times the announced gradient of the loss.
    let row_scale = wanted.grad_scale / n as f64;
    let mut total: Option<Tensor<1>> = None;
    let mut dhidden = Vec::new();
    let mut dweight: Option<Tensor<2>> = None;
    // On the CPU in f32 the head's gradient is one matrix that each chunk's
    // product is added into (`add_head_gradient`).
    let mut flex_dweight = (wanted.weight && softcap.is_none())
        .then(|| flex_f32(&hidden).zip(flex_f32(&weight)))
        .flatten()
        .map(|(hidden, _)| {
            let dweight = Tensor::<2>::zeros(weight.dims(), (&weight.device(), DType::F32));
            (hidden, into_flex(dweight))
        });
    for r in chunks(n, chunk) {
        let c = r.len();
        let z = logits(&hidden, &weight_t, &r, softcap);
        let t = targets.clone().narrow(0, r.start, c);
        let mut kept = None;
        let (part, g) = if softcap.is_none() && is_flex_f32(&z) {
            // On the CPU in f32: the chunk row by row (`flex_rows`).
            let device = z.device();
            let ids: Vec<i64> = t.into_data().iter::<i64>().collect();
            let scale = wanted.any().then_some(row_scale as f32);
            let (loss, g) = flex_rows(into_flex(z), &ids, scale);
            // f32 whatever the device's default float (bf16 on a bf16 device).
            let part = Tensor::<1>::from_data(
                TensorData::new(vec![loss as f32], [1]),
                (&device, DType::F32),
            );
            let g = scale.map(|_| Tensor::<2>::from_primitive::<Flex>(g).cast(dtype));
            (part, g)
        } else {
            let t = t.reshape([c, 1]);
            let m = z.clone().max_dim(1);
            let lse = exp(z.clone() - m.clone()).sum_dim(1).log() + m; // [c, 1]
            let part = (lse.clone() - z.clone().gather(1, t.clone())).sum();
            if !wanted.any() {
                (part, None)
            } else {
                // d(cap · tanh(z / cap))/dz = 1 − tanh², from the capped logits.
                let dcap =
                    softcap.map(|cap| z.clone().div_scalar(cap).square().neg().add_scalar(1.0));
                let minus_one = Tensor::<2>::full([c, 1], -1.0, &z.device()).cast(FloatDType::F32);
                // Where burn's fusion runs the ops (CUDA, wgpu), the logits
                // stay alive until the chunk's gradients are formed, so no op
                // below may write over them: in f16 `exp(z - lse)`, as their
                // last use, ran in place, and the loss read its target logits
                // from the overwritten buffer (a wrong loss, the gradients
                // right; lavapipe's f16 check). flex runs each op at once, and
                // `z - lse` reuses their buffer.
                kept = (z.device() != Device::flex()).then(|| z.clone());
                // softmax − onehot(target), times the gradient a row gets.
                let g = exp(z - lse)
                    .scatter(1, t, minus_one, IndexingUpdateOp::Add)
                    .mul_scalar(row_scale);
                let g = match dcap {
                    Some(dcap) => g * dcap,
                    None => g,
                };
                (part, Some(g.cast(dtype)))
            }
        };
        total = Some(match total {
            Some(total) => total + part,
            None => part,
        });
        if let Some(g) = g {
            if let Some((flex_hidden, acc)) = flex_dweight.as_mut() {
                add_head_gradient(acc, weight.dims(), &g, flex_hidden, &r);
            } else if wanted.weight {
                let h = hidden.clone().narrow(0, r.start, c);
                let dw = g.clone().transpose().matmul(h);
                dweight = Some(match dweight {
                    Some(acc) => acc + dw,
                    None => dw,
                });
            }
            if wanted.hidden {
                dhidden.push(g.matmul(weight.clone()));
            }
        }
        drop(kept);
    }
    LossAndGradients {
        loss: total.expect("at least one row").div_scalar(n as f64),
        dhidden: (!dhidden.is_empty()).then(|| Tensor::cat(dhidden, 0)),
        dweight: flex_dweight
            .map(|(_, dweight)| Tensor::from_primitive::<Flex>(dweight))
            .or(dweight),
    }
}

/// `dweight += gᵀ · hidden[r]` on flex f32, in place: gemm's accumulating
/// product. burn's matmul would write each chunk's product to a fresh
/// `[vocab, h]` matrix (fresh pages: 113 MB a chunk for a 49k vocabulary
/// and h 576) and add it in another pass over both.
fn add_head_gradient(
    dweight: &mut FloatTensor<Flex>,
    [vocab, h]: [usize; 2],
    g: &Tensor<2>,
    hidden: &FloatTensor<Flex>,
    r: &Range<usize>,
) {
    let g = into_flex(g.clone());
    let rows = &values(hidden)[r.start * h..r.end * h];
    headroom_ffi::add_product_f32(
        values_mut(dweight),
        // gᵀ: g is [rows, vocab] row-major.
        headroom_ffi::Strided {
            values: values(&g),
            rows: vocab,
            cols: r.len(),
            row_stride: 1,
            col_stride: vocab,
        },
        headroom_ffi::Strided {
            values: rows,
            rows: r.len(),
            cols: h,
            row_stride: h,
            col_stride: 1,
        },
    );
}

/// Values a row's reductions keep apart (one AVX-512 register of f32):
/// lane-wise they vectorize, where one running value would not (float
/// addition is not reassociated).
const LANES: usize = 16;

/// The loss of each row of the logits `z` [c, vocab] (flex f32, contiguous)
/// against its target, summed; with `scale`, `z` turned in place into the
/// rows' gradient `scale · (softmax(z) − onehot(target))`. Row by row, so
/// that a row stays in cache through its passes (max; exp and sum; scale)
/// where each tensor op would stream the whole chunk through memory.
fn flex_rows(
    mut z: FloatTensor<Flex>,
    targets: &[i64],
    scale: Option<f32>,
) -> (f64, FloatTensor<Flex>) {
    let vocab = z.layout().shape()[1];
    let arch = pulp::Arch::new();
    let mut loss = 0.0f64;
    let rows = values_mut(&mut z).chunks_exact_mut(vocab);
    for (row, &target) in rows.zip(targets) {
        let target = usize::try_from(target)
            .ok()
            .filter(|&t| t < vocab)
            .unwrap_or_else(|| panic!("target {target} is outside the vocabulary of {vocab}"));
        let logit = row[target];
        let (max, sum) = arch.dispatch(
            #[inline(always)]
            || {
                let max = row_max(row);
                for x in row.iter_mut() {
                    *x = exp_f32(*x - max);
                }
                (max, row_sum(row))
            },
        );
        let lse = f64::from(max) + f64::from(sum).ln();
        loss += lse - f64::from(logit);
        if let Some(scale) = scale {
            let k = scale / sum;
            arch.dispatch(
                #[inline(always)]
                || {
                    for x in row.iter_mut() {
                        *x *= k;
                    }
                },
            );
            row[target] -= scale;
        }
    }
    (loss, z)
}

/// The largest value of `row` (NaN ignored: it reaches the loss through
/// the sum).
#[inline(always)]
fn row_max(row: &[f32]) -> f32 {
    let larger = |m: f32, x: f32| if x > m { x } else { m };
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let mut chunks = row.chunks_exact(LANES);
    for c in &mut chunks {
        for (m, &x) in lanes.iter_mut().zip(c) {
            *m = larger(*m, x);
        }
    }
    let rest = chunks.remainder().iter().chain(&lanes);
    rest.fold(f32::NEG_INFINITY, |m, &x| larger(m, x))
}

/// The sum of `row`, in [`LANES`] partial sums.
#[inline(always)]
fn row_sum(row: &[f32]) -> f32 {
    let mut lanes = [0.0f32; LANES];
    let mut chunks = row.chunks_exact(LANES);
    for c in &mut chunks {
        for (s, &x) in lanes.iter_mut().zip(c) {
            *s += x;
        }
    }
    chunks.remainder().iter().chain(&lanes).sum()
}

/// The gradient the forward formed at `grad_scale`, for the loss's gradient
/// `dloss` [1] that came back: unchanged when they are equal (the caller
/// announced it), scaled by their ratio otherwise.
pub fn backward(gradient: Tensor<2>, dloss: &Tensor<1>, grad_scale: f64) -> Tensor<2> {
    // Compared as the f32 the loss's gradient is.
    let came = dloss.clone().into_scalar::<f32>();
    if came == grad_scale as f32 {
        return gradient;
    }
    // In f32: the ratio itself may be out of a half type's range (fp16's
    // loss scale of 65536 over an unannounced 1 is f16's infinity).
    let ratio = f64::from(came) / grad_scale;
    match FloatDType::from(gradient.dtype()) {
        FloatDType::F32 => gradient.mul_scalar(ratio),
        dtype => gradient.cast(FloatDType::F32).mul_scalar(ratio).cast(dtype),
    }
}

/// Today's loss, for the tests: `log_softmax` over the whole logits.
pub fn naive(hidden: Tensor<2>, weight: Tensor<2>, targets: Tensor<1, Int>) -> Tensor<1> {
    naive_capped(hidden, weight, targets, None)
}

/// [`naive`] with the logits soft-capped at `softcap` where given, as
/// transformers' Gemma caps them.
pub fn naive_capped(
    hidden: Tensor<2>,
    weight: Tensor<2>,
    targets: Tensor<1, Int>,
    softcap: Option<f64>,
) -> Tensor<1> {
    let [n, _] = hidden.dims();
    let z = hidden.matmul(weight.transpose());
    let z = match softcap {
        Some(cap) => z.div_scalar(cap).tanh().mul_scalar(cap),
        None => z,
    };
    let logp = burn::tensor::activation::log_softmax(z, 1);
    logp.gather(1, targets.reshape([n, 1])).mean().neg()
}
