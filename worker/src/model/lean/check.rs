//! The lean ops against the ops they replace, on any device: what
//! `calibrate --backend cuda --ops-check` runs on a GPU, and what a unit
//! test runs on flex so the code a GPU run depends on is exercised here.
//!
//! Each comparison runs the lean op and the naive one (burn's own softmax,
//! `log_softmax`, a dense dequantized weight) on the device under test, in
//! the device's float dtype, on the same inputs; and, where the inputs can
//! be made identical on the host, the naive op in f32 on flex as the
//! reference. Bf16 cannot match f32 to 1e-5, so the question a GPU run
//! answers is: is the lean op as close to the f32 reference as the naive op
//! it replaces (same device, same dtype)?

use burn::tensor::{Device, Int, Tensor, TensorData};

use super::attention::{self, AttentionOptions};
use super::{GateActivation, attend, cross_entropy, fused_cross_entropy, gated};
use crate::model::with_generator;
use crate::seeded::standard_normal;

/// One quantity (an output or a gradient) of one op.
#[derive(Clone, Debug)]
pub struct Comparison {
    pub case: String,
    pub quantity: &'static str,
    /// Largest |lean − naive| over the largest |naive|, both on the device.
    pub lean_vs_naive: f32,
    /// The lean op against the f32 reference on flex (None where the
    /// inputs cannot be made identical on the host: the NF4 linear's
    /// weight is drawn on the device).
    pub lean_vs_reference: Option<f32>,
    /// The naive op against the same reference.
    pub naive_vs_reference: Option<f32>,
}

impl Comparison {
    /// Whether the lean op is as accurate as the op it replaces: within
    /// twice the naive op's error against the f32 reference plus `tolerance`
    /// (the dtype's rounding), or, without a reference, within `tolerance`
    /// of the naive op.
    pub fn holds(&self, tolerance: f32) -> bool {
        match (self.lean_vs_reference, self.naive_vs_reference) {
            (Some(lean), Some(naive)) => lean <= 2.0 * naive + tolerance,
            _ => self.lean_vs_naive <= tolerance,
        }
    }
}

/// The shapes the comparisons use: small ones for a CPU unit test, larger
/// ones (several attention blocks of 128 rows, a vocabulary of thousands)
/// for a GPU.
#[derive(Clone, Copy, Debug)]
pub struct Shapes {
    /// (batch, query heads, key/value heads, sequence, head dim) and block rows.
    pub attention: ((usize, usize, usize, usize, usize), usize),
    /// Rows, hidden size, vocabulary, chunk rows.
    pub loss: (usize, usize, usize, usize),
    /// d_in, d_out, tokens; rows per dequantized slice.
    pub nf4: (usize, usize, usize, usize),
    /// The gated MLP activation's [b, s, i].
    pub gated: [usize; 3],
    /// The adapted linear's tokens, d_in, d_out and rank.
    pub adapted: (usize, usize, usize, usize),
}

impl Shapes {
    pub fn small() -> Self {
        Shapes {
            attention: ((2, 4, 2, 37, 8), 8),
            loss: (13, 6, 17, 5),
            nf4: (128, 12, 10, 3),
            gated: [2, 7, 19],
            adapted: (37, 24, 40, 4),
        }
    }

    pub fn gpu() -> Self {
        Shapes {
            attention: ((2, 8, 2, 384, 64), 128),
            loss: (1024, 256, 5003, 256),
            nf4: (1024, 256, 128, 64),
            gated: [2, 384, 1536],
            adapted: (768, 576, 1536, 16),
        }
    }
}

/// Every comparison on `device` (an autodiff device).
pub fn compare_on(device: &Device, shapes: Shapes) -> Vec<Comparison> {
    let reference = Device::flex().autodiff();
    let mut out = Vec::new();
    let ((b, a, kv, s, d), block) = shapes.attention;
    let causal = AttentionOptions::causal(d, block);
    let mut gemma = causal.clone();
    gemma.softcap = Some(30.0);
    gemma.window = Some(s / 3 + 1);
    // Packed documents: each row cut in its own places (a short document,
    // boundaries inside blocks and on one).
    let ids: Vec<u32> = (0..b * s)
        .map(|i| {
            let (row, t) = (i / s, i % s);
            let cuts = [3 + row, s / 3, s / 2 + row * 7, s - s / 5];
            cuts.iter().filter(|&&c| t >= c).count() as u32
        })
        .collect();
    let documents = AttentionOptions {
        segments: Some(attention::Segments::new(&ids, b, s)),
        ..causal.clone()
    };
    for (name, options) in [
        ("causal", causal),
        ("soft-capped, windowed", gemma),
        ("packed documents", documents),
    ] {
        let run = |dev: &Device, lean: bool| {
            attention_grads(dev, (b, a, kv, s, d), options.clone(), lean)
        };
        out.extend(compare(
            format!("attention {name}, b {b}, heads {a}/{kv}, s {s}, d {d}, block {block}"),
            &["output", "dq", "dk", "dv"],
            run(device, true),
            run(device, false),
            Some(run(&reference, false)),
        ));
    }
    let (n, h, vocab, chunk) = shapes.loss;
    let run = |dev: &Device, chunk: Option<usize>| loss_grads(dev, n, h, vocab, chunk);
    out.extend(compare(
        format!("cross-entropy, {n} rows, h {h}, vocab {vocab}, chunk {chunk}"),
        &["loss", "dhidden", "dweight"],
        run(device, Some(chunk)),
        run(device, None),
        Some(run(&reference, None)),
    ));
    let (d_in, d_out, tokens, rows) = shapes.nf4;
    out.extend(compare(
        format!("NF4 LoRA linear, {d_in} → {d_out}, {tokens} tokens, {rows} rows per slice"),
        &["output", "dx", "dB"],
        nf4_linear_grads(device, (d_in, d_out, tokens, rows), true),
        nf4_linear_grads(device, (d_in, d_out, tokens, rows), false),
        None,
    ));
    let dims = shapes.gated;
    for (name, activation) in [
        ("SwiGLU", GateActivation::Silu),
        ("GeGLU", GateActivation::GeluTanh),
    ] {
        let run = |dev: &Device, lean: bool| gated_grads(dev, dims, activation, lean);
        out.extend(compare(
            format!("gated MLP {name}, {dims:?}"),
            &["output", "dgate", "dup"],
            run(device, true),
            run(device, false),
            Some(run(&reference, false)),
        ));
    }
    let dims = shapes.adapted;
    let run = |dev: &Device, lean: bool| adapted_grads(dev, dims, lean);
    let (n, d_in, d_out, r) = dims;
    out.extend(compare(
        format!("adapted linear x·W + (s·x·A)·B, {n} tokens, {d_in} → {d_out}, r {r}"),
        &["output", "dx", "dW", "dA", "dB"],
        run(device, true),
        run(device, false),
        Some(run(&reference, false)),
    ));
    out
}

fn compare<const N: usize>(
    case: String,
    names: &[&'static str; N],
    lean: [Vec<f32>; N],
    naive: [Vec<f32>; N],
    reference: Option<[Vec<f32>; N]>,
) -> Vec<Comparison> {
    (0..N)
        .map(|i| Comparison {
            case: case.clone(),
            quantity: names[i],
            lean_vs_naive: max_relative(&lean[i], &naive[i]),
            lean_vs_reference: reference.as_ref().map(|r| max_relative(&lean[i], &r[i])),
            naive_vs_reference: reference.as_ref().map(|r| max_relative(&naive[i], &r[i])),
        })
        .collect()
}

/// Largest |a − b| relative to the largest |b|; infinite where one side has
/// a NaN or an infinity the other has not (`f32::max` skips NaN, so a NaN
/// gradient would otherwise read as exact agreement).
pub fn max_relative(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    if a.iter().zip(b).any(|(x, y)| x.is_finite() != y.is_finite()) {
        return f32::INFINITY;
    }
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-12);
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

/// A tensor of standard-normal values drawn on the host from `seed`, so
/// every device (and dtype) starts from the same numbers, on `device` in
/// its float dtype.
fn seeded<const D: usize>(seed: u64, dims: [usize; D], device: &Device) -> Tensor<D> {
    let n = dims.iter().product();
    Tensor::from_data(TensorData::new(standard_normal(n, seed), dims), device)
}

pub(super) fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data().iter::<f32>().collect()
}

/// Output and the gradients of q, k, v under a seeded upstream gradient.
pub(super) fn attention_grads(
    device: &Device,
    (b, a, kv, s, d): (usize, usize, usize, usize, usize),
    options: AttentionOptions,
    lean: bool,
) -> [Vec<f32>; 4] {
    let q = seeded(1, [b, a, s, d], device).require_grad();
    let k = seeded(2, [b, kv, s, d], device).require_grad();
    let v = seeded(3, [b, kv, s, d], device).require_grad();
    let upstream = seeded(4, [b, a, s, d], device);
    let out = if lean {
        attend(q.clone(), k.clone(), v.clone(), options)
    } else {
        attention::naive(q.clone(), k.clone(), v.clone(), &options)
    };
    let grads = (out.clone() * upstream).sum().backward();
    let grad = |t: &Tensor<4>| values(t.grad(&grads).expect("gradient"));
    [values(out), grad(&q), grad(&k), grad(&v)]
}

/// The loss and the gradients of the hidden states and the head.
pub(super) fn loss_grads(
    device: &Device,
    n: usize,
    h: usize,
    vocab: usize,
    chunk: Option<usize>,
) -> [Vec<f32>; 3] {
    let hidden = seeded(11, [n, h], device).require_grad();
    let weight = seeded(12, [vocab, h], device).require_grad();
    let targets: Vec<i64> = (0..n as i64)
        .map(|i| (i * 7919 + 3) % vocab as i64)
        .collect();
    let targets = Tensor::<1, Int>::from_data(TensorData::new(targets, [n]), device);
    let loss = match chunk {
        Some(chunk) => fused_cross_entropy(hidden.clone(), weight.clone(), targets, chunk),
        None => cross_entropy::naive(hidden.clone(), weight.clone(), targets),
    };
    let grads = loss.clone().mul_scalar(3.0).backward();
    [
        values(loss),
        values(hidden.grad(&grads).expect("dhidden")),
        values(weight.grad(&grads).expect("dweight")),
    ]
}

/// Output and the gradients of gate and up through the gated activation:
/// the lean op, or burn's own ops (`silu(gate) · up`, `gelu_approximate`).
/// The gate's values spread over ±6 (both tails of σ and tanh).
pub(super) fn gated_grads(
    device: &Device,
    dims: [usize; 3],
    activation: GateActivation,
    lean: bool,
) -> [Vec<f32>; 3] {
    let gate = seeded(31, dims, device).mul_scalar(2.0).require_grad();
    let up = seeded(32, dims, device).require_grad();
    let upstream = seeded(33, dims, device);
    let out = if lean {
        super::gated(gate.clone(), up.clone(), activation)
    } else {
        gated::naive(gate.clone(), up.clone(), activation)
    };
    let grads = (out.clone() * upstream).sum().backward();
    [
        values(out),
        values(gate.grad(&grads).expect("dgate")),
        values(up.grad(&grads).expect("dup")),
    ]
}

/// The output and the gradients of x, W, A and B of `x·W + (s·x·A)·B`:
/// the one op ([`super::adapted_matmul`]) or burn's ops composed. Every
/// input tracked and B not zero, so every gradient is.
pub(super) fn adapted_grads(
    device: &Device,
    (n, d_in, d_out, r): (usize, usize, usize, usize),
    lean: bool,
) -> [Vec<f32>; 5] {
    let scale = 2.0;
    let x = seeded(41, [n, d_in], device).require_grad();
    let w = seeded(42, [d_in, d_out], device).require_grad();
    let a = seeded(43, [d_in, r], device).require_grad();
    let b = seeded(44, [r, d_out], device).require_grad();
    let upstream = seeded(45, [n, d_out], device);
    let out = if lean {
        super::adapted_matmul(x.clone(), w.clone(), a.clone(), b.clone(), scale)
    } else {
        x.clone().matmul(w.clone())
            + x.clone()
                .matmul(a.clone())
                .mul_scalar(scale)
                .matmul(b.clone())
    };
    let grads = (out.clone() * upstream).sum().backward();
    let grad = |t: &Tensor<2>| values(t.grad(&grads).expect("a gradient"));
    [values(out), grad(&x), grad(&w), grad(&a), grad(&b)]
}

/// Output and the gradients of x and B through a LoRA linear on an NF4
/// base: the lean op (dequantized `rows` rows at a time on the device,
/// forward and backward) or the dense `x · (W' + s·A·B) + bias`, `W'` the
/// host's dequantization of the same NF4 weight.
pub(super) fn nf4_linear_grads(
    device: &Device,
    (d_in, d_out, tokens, rows): (usize, usize, usize, usize),
    lean: bool,
) -> [Vec<f32>; 3] {
    use crate::model::nf4::{Nf4Tensor, Nf4Weight};
    use burn::module::{Lora, Module};
    use burn::nn::LinearConfig;
    let linear = with_generator(|| {
        device.seed(6);
        let linear = LinearConfig::new(d_in, d_out)
            .with_bias(true)
            .init(device)
            .apply_lora(Lora::new(4, 8.0));
        // burn initialises lazily: draw everything here, under the lock.
        let _ = linear.bias.as_ref().map(|b| b.val());
        let _ = linear.weight.base();
        linear
    });
    // B starts at zero, as PEFT's does: the output and dx are the base's,
    // dB carries the adapter path.
    let adapter = linear.weight.adapter().expect("adapter");
    let x = seeded(21, [1, tokens, d_in], device).require_grad();
    let upstream = seeded(22, [1, tokens, d_out], device);
    // As bitsandbytes quantizes a torch Linear's [d_out, d_in] weight.
    let torch_layout = values(linear.weight.base().transpose());
    let host = Nf4Tensor::quantize(&torch_layout, [d_out, d_in]);
    let weight = Nf4Weight::upload(&host, device).with_chunk_values(rows * d_in);
    assert_eq!(weight.chunk_rows(), rows.min(d_out));
    let b = adapter.b.val();
    let out = if lean {
        super::linear::forward(&linear, Some(&weight), x.clone(), None)
    } else {
        let dense =
            Tensor::<2>::from_data(TensorData::new(host.dequantize(), [d_out, d_in]), device)
                .transpose();
        let w = dense + adapter.delta();
        x.clone().matmul(w.unsqueeze()) + linear.bias.as_ref().expect("bias").val().unsqueeze()
    };
    let grads = (out.clone() * upstream).sum().backward();
    [
        values(out),
        values(x.grad(&grads).expect("dx")),
        values(b.grad(&grads).expect("dB")),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn on_flex_the_lean_ops_match_the_naive_ones_and_the_reference() {
        let device = Device::flex().autodiff();
        let rows = compare_on(&device, Shapes::small());
        assert_eq!(rows.len(), 4 + 4 + 4 + 3 + 3 + 3 + 3 + 5);
        for r in &rows {
            // f32 on both sides, sums in another order: the model::lean
            // tests measured ≤ 4.2e-7 on these shapes.
            assert!(r.lean_vs_naive < 1e-5, "{r:?}");
            assert!(r.holds(1e-5), "{r:?}");
            // flex naive is the reference itself (the same op twice: 0 here;
            // the bound allows a parallel reduction that sums in another order).
            assert!(r.naive_vs_reference.is_none_or(|e| e < 1e-6), "{r:?}");
        }
    }

    #[test]
    fn a_nan_or_an_infinity_on_one_side_is_no_agreement() {
        assert_eq!(max_relative(&[1.0, 2.0], &[1.0, 2.0]), 0.0);
        assert_eq!(max_relative(&[f32::NAN, 2.0], &[1.0, 2.0]), f32::INFINITY);
        assert_eq!(max_relative(&[1.0, 2.0], &[1.0, f32::NAN]), f32::INFINITY);
        assert_eq!(
            max_relative(&[f32::INFINITY, 2.0], &[1.0, 2.0]),
            f32::INFINITY
        );
        assert!((max_relative(&[1.0, 2.5], &[1.0, 2.0]) - 0.25).abs() < 1e-7);
    }
}
