//! Next-token cross-entropy straight from the final hidden states and the
//! head weight, a chunk of rows at a time (as Liger-Kernel's fused linear
//! cross-entropy and Apple's Cut Cross-Entropy do): the forward keeps one
//! chunk's logits at a time and saves only each row's logsumexp; the
//! backward recomputes each chunk's logits to form `softmax − onehot` and
//! turns it into the gradients of the hidden states and of the head at once.
//! The whole `[rows, vocab]` logits never exist, neither does their gradient.
//!
//! Logits are computed in the model's dtype and reduced in f32. With
//! Gemma's final soft-capping each chunk's logits z become
//! cap · tanh(z / cap) before the softmax, and the backward multiplies
//! their gradient by the derivative, 1 − tanh², from the capped logits.

use std::ops::Range;

use burn::tensor::{FloatDType, IndexingUpdateOp, Int, Tensor};

use super::exp::exp;

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

/// Mean cross-entropy of `hidden` [n, h] under the head `weight` [vocab, h]
/// (its logits soft-capped at `softcap` where given) against `targets`
/// [n], and the per-row logsumexp [n, 1] (f32) the backward needs.
pub fn forward(
    hidden: Tensor<2>,
    weight: Tensor<2>,
    targets: Tensor<1, Int>,
    chunk: usize,
    softcap: Option<f64>,
) -> (Tensor<1>, Tensor<2>) {
    let [n, _] = hidden.dims();
    let weight_t = weight.transpose();
    let mut total: Option<Tensor<1>> = None;
    let mut logsumexp = Vec::new();
    for r in chunks(n, chunk) {
        let z = logits(&hidden, &weight_t, &r, softcap);
        let m = z.clone().max_dim(1);
        let lse = exp(z.clone() - m.clone()).sum_dim(1).log() + m; // [c, 1]
        let t = targets
            .clone()
            .narrow(0, r.start, r.len())
            .reshape([r.len(), 1]);
        let part = (lse.clone() - z.gather(1, t)).sum();
        total = Some(match total {
            Some(total) => total + part,
            None => part,
        });
        logsumexp.push(lse);
    }
    let loss = total.expect("at least one row").div_scalar(n as f64);
    (loss, Tensor::cat(logsumexp, 0))
}

/// Gradients of the hidden states and (when `head_grad`) of the head weight
/// from the loss's gradient `dloss` [1].
#[allow(clippy::too_many_arguments)]
pub fn backward(
    hidden: Tensor<2>,
    weight: Tensor<2>,
    targets: Tensor<1, Int>,
    logsumexp: Tensor<2>,
    dloss: Tensor<1>,
    chunk: usize,
    softcap: Option<f64>,
    head_grad: bool,
) -> (Tensor<2>, Option<Tensor<2>>) {
    let [n, _] = hidden.dims();
    let dtype = FloatDType::from(hidden.dtype());
    // d(mean)/d(row) = dloss / n, broadcast over a chunk.
    let scale = dloss
        .cast(FloatDType::F32)
        .div_scalar(n as f64)
        .reshape([1, 1]);
    let weight_t = weight.clone().transpose();
    let mut dhidden = Vec::new();
    let mut dweight: Option<Tensor<2>> = None;
    for r in chunks(n, chunk) {
        let c = r.len();
        let z = logits(&hidden, &weight_t, &r, softcap);
        // d(cap · tanh(z / cap))/dz = 1 − tanh², from the capped logits.
        let dcap = softcap.map(|cap| z.clone().div_scalar(cap).square().neg().add_scalar(1.0));
        let lse = logsumexp.clone().narrow(0, r.start, c);
        let t = targets.clone().narrow(0, r.start, c).reshape([c, 1]);
        let minus_one = Tensor::<2>::full([c, 1], -1.0, &z.device()).cast(FloatDType::F32);
        // softmax − onehot(target), times the loss's gradient per row.
        let g = exp(z - lse)
            .scatter(1, t, minus_one, IndexingUpdateOp::Add)
            .mul(scale.clone());
        let g = match dcap {
            Some(dcap) => g * dcap,
            None => g,
        }
        .cast(dtype);
        dhidden.push(g.clone().matmul(weight.clone()));
        if head_grad {
            let h = hidden.clone().narrow(0, r.start, c);
            let dw = g.transpose().matmul(h);
            dweight = Some(match dweight {
                Some(acc) => acc + dw,
                None => dw,
            });
        }
    }
    (Tensor::cat(dhidden, 0), dweight)
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
