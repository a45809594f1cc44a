//! The lean ops against the plain ones they replace (burn's own softmax,
//! matmul and log_softmax, differentiated by burn's autodiff): values and
//! gradients, on the autodiff device the trainer uses.

use burn::tensor::{Distribution, Int, Tensor, TensorData};

use super::attention::{AttentionOptions, Segments};
use super::check::{
    adapted_grads, attention_grads, loss_grads, max_relative, nf4_linear_grads, values,
};
use super::{attend, fused_cross_entropy};
use crate::model::with_generator;

fn device() -> burn::tensor::Device {
    burn::tensor::Device::flex().autodiff()
}

fn random<const D: usize>(dims: [usize; D]) -> Tensor<D> {
    with_generator(|| draw(dims))
}

/// A draw from burn's generator; the caller holds the generator's lock.
fn draw<const D: usize>(dims: [usize; D]) -> Tensor<D> {
    Tensor::random(dims, Distribution::Normal(0.0, 1.0), &device())
}

fn assert_attention_matches(dims: (usize, usize, usize, usize, usize), options: AttentionOptions) {
    // The same seed draws the same inputs for both runs.
    let lean = attention_grads(&device(), dims, options.clone(), true);
    let naive = attention_grads(&device(), dims, options.clone(), false);
    for (name, (l, n)) in ["output", "dq", "dk", "dv"]
        .iter()
        .zip(lean.iter().zip(&naive))
    {
        let err = max_relative(l, n);
        // f32 sums in another order: measured ≤ 4.2e-7 on these shapes (AMD
        // EPYC, no AVX-512); the bound leaves 20× for other SIMD widths.
        assert!(err < 1e-5, "{name}: {err:e} for {dims:?} {options:?}");
    }
}

#[test]
fn blocked_attention_equals_the_naive_one() {
    // Several blocks, a partial last one, GQA (4 query heads on 2 kv heads).
    assert_attention_matches((2, 4, 2, 37, 8), AttentionOptions::causal(8, 8));
    // One block covering the sequence, multi-head.
    assert_attention_matches((1, 3, 3, 16, 4), AttentionOptions::causal(4, 64));
    // Block of one row.
    assert_attention_matches((1, 2, 1, 5, 4), AttentionOptions::causal(4, 1));
}

#[test]
fn soft_capping_and_sliding_windows_are_options() {
    let mut capped = AttentionOptions::causal(8, 8);
    capped.softcap = Some(2.0);
    capped.scale = 0.5;
    assert_attention_matches((1, 4, 2, 29, 8), capped);
    let mut windowed = AttentionOptions::causal(8, 8);
    windowed.window = Some(5);
    assert_attention_matches((1, 4, 2, 29, 8), windowed.clone());
    // A window shorter than a block, and whole key blocks out of sight.
    windowed.window = Some(3);
    windowed.block = 4;
    assert_attention_matches((2, 2, 2, 21, 4), windowed);
}

#[test]
fn blocked_attention_is_causal() {
    let (q, k, v) = (
        random([1, 2, 9, 4]),
        random([1, 2, 9, 4]),
        random([1, 2, 9, 4]),
    );
    let mut v2 = values(v.clone());
    // Change the last position's value only.
    for h in 0..2 {
        for j in 0..4 {
            v2[h * 9 * 4 + 8 * 4 + j] += 1.0;
        }
    }
    let v2 = Tensor::<4>::from_data(TensorData::new(v2, [1, 2, 9, 4]), &device());
    let options = AttentionOptions::causal(4, 4);
    let a = values(attend(q.clone(), k.clone(), v, options.clone()));
    let b = values(attend(q, k, v2, options));
    for h in 0..2 {
        for p in 0..8 {
            for j in 0..4 {
                let i = h * 36 + p * 4 + j;
                assert_eq!(a[i], b[i], "position {p} saw the last value");
            }
        }
    }
}

/// Segment ids `[rows, seq]` for documents ending before each of a row's `cuts`.
fn segment_ids(rows: &[&[usize]], seq: usize) -> Vec<u32> {
    rows.iter()
        .flat_map(|cuts| (0..seq).map(|t| cuts.iter().filter(|&&c| t >= c).count() as u32))
        .collect()
}

#[test]
fn blocked_attention_with_documents_equals_the_naive_one() {
    // Measured ≤ 2.8e-7 against naive (values and gradients).
    // Rows cut in different places: boundaries inside blocks, on a block's
    // edge, a one-token document, and (row 1, block 4) block pairs no
    // query of either row sees into, which are skipped.
    let ids = segment_ids(&[&[10, 16, 17, 30], &[5, 8, 20, 24]], 37);
    let segments = Segments::new(&ids, 2, 37);
    for block in [4, 8, 64] {
        let options = AttentionOptions {
            segments: Some(segments.clone()),
            ..AttentionOptions::causal(8, block)
        };
        assert_attention_matches((2, 4, 2, 37, 8), options.clone());
        // With Gemma's soft-capping and a window shorter than a document.
        let gemma = AttentionOptions {
            softcap: Some(2.0),
            window: Some(6),
            ..options
        };
        assert_attention_matches((2, 4, 2, 37, 8), gemma);
    }
}

#[test]
fn a_row_of_documents_attends_as_each_document_alone() {
    let (a, kv, s, d) = (4, 2, 29, 8);
    let cuts = [7, 8, 20];
    let ids = segment_ids(&[&cuts], s);
    let (q, k, v) =
        with_generator(|| (draw([1, a, s, d]), draw([1, kv, s, d]), draw([1, kv, s, d])));
    let packed = AttentionOptions {
        segments: Some(Segments::new(&ids, 1, s)),
        ..AttentionOptions::causal(d, 8)
    };
    let lean = values(attend(q.clone(), k.clone(), v.clone(), packed.clone()));
    let naive = values(super::attention::naive(
        q.clone(),
        k.clone(),
        v.clone(),
        &packed,
    ));
    let bounds: Vec<usize> = [0].into_iter().chain(cuts).chain([s]).collect();
    let mut worst = 0f32;
    for doc in bounds.windows(2) {
        let (start, len) = (doc[0], doc[1] - doc[0]);
        let part = |t: &Tensor<4>| t.clone().narrow(2, start, len);
        let alone = values(attend(
            part(&q),
            part(&k),
            part(&v),
            AttentionOptions::causal(d, 8),
        ));
        for h in 0..a {
            for t in 0..len {
                for j in 0..d {
                    let packed_at = (h * s + start + t) * d + j;
                    let alone_at = (h * len + t) * d + j;
                    for (name, got) in [("blocked", &lean), ("naive", &naive)] {
                        let (x, y) = (got[packed_at], alone[alone_at]);
                        worst = worst.max((x - y).abs() / (1.0 + y.abs()));
                        // f32 sums in another order (blocks of other bounds):
                        // measured ≤ 1.8e-7.
                        assert!(
                            (x - y).abs() <= 1e-5 * (1.0 + y.abs()),
                            "{name}: head {h}, token {t} of the document at {start}: {x} vs {y}"
                        );
                    }
                }
            }
        }
    }
    eprintln!("documents attended apart vs alone: worst {worst:e}");
}

#[test]
fn chunked_cross_entropy_equals_log_softmax() {
    for chunk in [1, 5, 13, 64] {
        let lean = loss_grads(&device(), 13, 6, 17, Some(chunk));
        let naive = loss_grads(&device(), 13, 6, 17, None);
        for (name, (l, n)) in ["loss", "dhidden", "dweight"]
            .iter()
            .zip(lean.iter().zip(&naive))
        {
            let err = max_relative(l, n);
            assert!(err < 1e-5, "{name} at chunk {chunk}: {err:e}");
        }
    }
}

/// Gemma's final soft-capping: the chunked loss and its gradients against
/// log_softmax over cap · tanh(logits / cap), differentiated by burn.
#[test]
fn chunked_cross_entropy_soft_caps_like_log_softmax() {
    use super::{cross_entropy, fused_cross_entropy_capped};
    let (n, h, vocab) = (13, 6, 17);
    let run = |chunk: Option<usize>, cap: f64| {
        let (hidden, weight) = with_generator(|| {
            device().seed(21);
            (
                draw([n, h]).mul_scalar(3.0).require_grad(),
                draw([vocab, h]).require_grad(),
            )
        });
        let targets: Vec<i64> = (0..n as i64).map(|i| (i * 7 + 3) % vocab as i64).collect();
        let targets = Tensor::<1, Int>::from_data(TensorData::new(targets, [n]), &device());
        let loss = match chunk {
            Some(chunk) => fused_cross_entropy_capped(
                hidden.clone(),
                weight.clone(),
                targets,
                chunk,
                Some(cap),
                1.0,
            ),
            None => cross_entropy::naive_capped(hidden.clone(), weight.clone(), targets, Some(cap)),
        };
        let grads = loss.clone().mul_scalar(3.0).backward();
        [
            values(loss),
            values(hidden.grad(&grads).expect("dhidden")),
            values(weight.grad(&grads).expect("dweight")),
        ]
    };
    // A cap of 2 bends these logits (|z| up to ~10); 1e4 leaves them as they are.
    for cap in [2.0, 1e4] {
        let naive = run(None, cap);
        for chunk in [1, 5, 64] {
            let lean = run(Some(chunk), cap);
            for (name, (l, n)) in ["loss", "dhidden", "dweight"]
                .iter()
                .zip(lean.iter().zip(&naive))
            {
                let err = max_relative(l, n);
                assert!(err < 1e-5, "{name} at chunk {chunk}, cap {cap}: {err:e}");
            }
        }
    }
    // The cap of 2 changes the loss of the same inputs.
    assert!((run(None, 2.0)[0][0] - run(None, 1e4)[0][0]).abs() > 1e-3);
}

/// The loss's gradients are formed in its forward at the loss's gradient
/// the caller announces (fp16's loss scale): announced, f16 gradients keep
/// the range the scale gives them; unannounced (formed at 1, scaled in
/// backward) the head's gradient falls into f16's subnormals. Only the
/// head rows no target names are compared: the target rows dwarf them.
#[test]
fn an_announced_loss_scale_keeps_f16_gradients_in_range() {
    use super::{cross_entropy, fused_cross_entropy_capped};
    use burn::tensor::FloatDType;
    let (n, h, vocab, scale) = (512, 8, 4096, 65536.0);
    let (hidden, weight) = with_generator(|| {
        device().seed(31);
        (
            draw([n, h]).mul_scalar(0.1),
            draw([vocab, h]).mul_scalar(0.1),
        )
    });
    let targets = Tensor::<1, Int>::zeros([n], &device());
    let untargeted = |dweight: Tensor<2>| values(dweight.narrow(0, 1, vocab - 1));
    let reference = {
        let weight = weight.clone().require_grad();
        let loss = cross_entropy::naive(hidden.clone(), weight.clone(), targets.clone());
        untargeted(
            weight
                .grad(&loss.mul_scalar(scale).backward())
                .expect("dweight"),
        )
    };
    let in_f16 = |announced: f64| {
        let weight = weight.clone().cast(FloatDType::F16).require_grad();
        let hidden = hidden.clone().cast(FloatDType::F16);
        let loss = fused_cross_entropy_capped(
            hidden,
            weight.clone(),
            targets.clone(),
            64,
            None,
            announced,
        );
        let dweight = weight
            .grad(&loss.mul_scalar(scale).backward())
            .expect("dweight");
        untargeted(dweight.cast(FloatDType::F32))
    };
    let announced = max_relative(&in_f16(scale), &reference);
    let unannounced = max_relative(&in_f16(1.0), &reference);
    eprintln!("f16 head gradient vs f32: announced {announced:e}, unannounced {unannounced:e}");
    assert!(announced < 1e-2, "announced: {announced:e}");
    assert!(
        unannounced > 10.0 * announced,
        "unannounced: {unannounced:e}"
    );
}

/// In f16, a row whose first visited block is all masked (a sliding
/// window, packed documents) stays finite: the masking score must be one
/// f16 holds (-1e30 is its -inf, and -inf − -inf is NaN). Forward and
/// backward on flex in f16 against the same op in f32.
#[test]
fn masked_blocks_stay_finite_in_f16() {
    use burn::tensor::FloatDType;
    let (b, a, kv, s, d) = (1, 2, 1, 24, 8);
    let ids: Vec<u32> = (0..s)
        .map(|t| u32::from(t >= 5) + u32::from(t >= 13))
        .collect();
    let causal = AttentionOptions::causal(d, 4);
    let windowed = AttentionOptions {
        window: Some(2),
        ..causal.clone()
    };
    let packed = AttentionOptions {
        segments: Some(Segments::new(&ids, b, s)),
        ..causal
    };
    let (q, k, v) = with_generator(|| {
        device().seed(41);
        (draw([b, a, s, d]), draw([b, kv, s, d]), draw([b, kv, s, d]))
    });
    for (name, options) in [("windowed", windowed), ("packed", packed)] {
        let run = |dtype: FloatDType| {
            let [q, k, v] = [&q, &k, &v].map(|t| t.clone().cast(dtype).require_grad());
            let out = attend(q.clone(), k.clone(), v.clone(), options.clone());
            let grads = out.clone().sum().backward();
            let grad = |t: &Tensor<4>| values(t.grad(&grads).expect("grad").cast(FloatDType::F32));
            [
                values(out.cast(FloatDType::F32)),
                grad(&q),
                grad(&k),
                grad(&v),
            ]
        };
        let (half, full) = (run(FloatDType::F16), run(FloatDType::F32));
        for (what, (h, f)) in ["output", "dq", "dk", "dv"]
            .iter()
            .zip(half.iter().zip(&full))
        {
            let err = max_relative(h, f);
            // f16 rounds at 4.9e-4; sums of a few dozen terms.
            assert!(err < 2e-2, "{name} {what} in f16 vs f32: {err:e}");
        }
    }
}

#[test]
fn a_frozen_head_gets_no_gradient() {
    let hidden = random([4, 3]).require_grad();
    let weight = random([5, 3]);
    let targets = Tensor::<1, Int>::from_data(TensorData::new(vec![0i64, 1, 2, 4], [4]), &device());
    let loss = fused_cross_entropy(hidden.clone(), weight.clone(), targets, 2);
    let grads = loss.backward();
    assert!(hidden.grad(&grads).is_some());
    assert!(weight.grad(&grads).is_none());
}

/// Output and the gradients of x, A and B through an adapted linear.
fn adapted_linear_grads(quantized: bool, lean: bool) -> [Vec<f32>; 4] {
    use burn::module::{Lora, Module, QLora, Quantizer};
    use burn::nn::LinearConfig;
    use burn::tensor::quantization::{Calibration, QuantScheme, QuantValue, ScaleDtype};
    let (linear, x, upstream) = with_generator(|| {
        device().seed(5);
        let linear = LinearConfig::new(16, 12).with_bias(true).init(&device());
        let lora = Lora::new(4, 8.0);
        let linear = if quantized {
            let scheme = QuantScheme::default()
                .with_value(QuantValue::Q8S)
                .per_block([4], ScaleDtype::F32);
            linear.apply_qlora(QLora::new(
                lora,
                Quantizer::new(Calibration::MinMax, scheme),
            ))
        } else {
            linear.apply_lora(lora)
        };
        // burn initialises lazily: draw the bias here, under the lock.
        let _ = linear.bias.as_ref().map(|b| b.val());
        let x = Tensor::<3>::random([2, 5, 16], Distribution::Normal(0.0, 1.0), &device());
        let upstream = Tensor::<3>::random([2, 5, 12], Distribution::Normal(0.0, 1.0), &device());
        (linear, x, upstream)
    });
    // B starts at zero (so dA is zero on both sides here; the training
    // tests move B and compare whole runs against PEFT).
    let adapter = linear.weight.adapter().expect("adapter");
    let (a, b) = (adapter.a.val(), adapter.b.val());
    assert!(a.is_require_grad() && b.is_require_grad());
    let x = x.require_grad();
    let out = if lean {
        super::linear::forward(&linear, None, x.clone(), None)
    } else {
        linear.forward(x.clone())
    };
    let grads = (out.clone() * upstream).sum().backward();
    let (ga, gb) = (
        values(a.grad(&grads).expect("dA")),
        values(b.grad(&grads).expect("dB")),
    );
    [values(out), values(x.grad(&grads).expect("dx")), ga, gb]
}

#[test]
fn an_adapted_linear_equals_burns_composed_weight() {
    for quantized in [false, true] {
        let lean = adapted_linear_grads(quantized, true);
        let composed = adapted_linear_grads(quantized, false);
        for (name, (l, c)) in ["output", "dx", "dA", "dB"]
            .iter()
            .zip(lean.iter().zip(&composed))
        {
            let err = max_relative(l, c);
            assert!(err < 1e-5, "{name} (quantized {quantized}): {err:e}");
        }
    }
}

#[test]
fn an_nf4_linear_equals_the_dense_dequantized_weight() {
    // 3 rows per dequantized slice: several slices of a 12-row weight.
    let lean = nf4_linear_grads(&device(), (128, 12, 10, 3), true);
    let dense = nf4_linear_grads(&device(), (128, 12, 10, 3), false);
    for (name, (l, d)) in ["output", "dx", "dB"].iter().zip(lean.iter().zip(&dense)) {
        let err = max_relative(l, d);
        assert!(err < 1e-5, "{name}: {err:e}");
    }
}

#[test]
fn the_adapted_op_equals_its_composition() {
    let dims = super::check::Shapes::small().adapted;
    let lean = adapted_grads(&device(), dims, true);
    let composed = adapted_grads(&device(), dims, false);
    for (name, (l, c)) in ["output", "dx", "dW", "dA", "dB"]
        .iter()
        .zip(lean.iter().zip(&composed))
    {
        let err = max_relative(l, c);
        // The same products; only where a sum is added differs.
        assert!(err < 1e-5, "{name}: {err:e}");
        assert!(l.iter().any(|v| *v != 0.0), "{name} is all zeros");
    }
}

#[test]
fn a_frozen_base_gets_no_gradient_from_the_adapted_op() {
    let (x, w, a, b) = with_generator(|| {
        device().seed(12);
        (draw([6, 8]), draw([8, 5]), draw([8, 2]), draw([2, 5]))
    });
    let (x, a, b) = (x.require_grad(), a.require_grad(), b.require_grad());
    let out = super::adapted_matmul(x.clone(), w.clone(), a.clone(), b.clone(), 0.5);
    let grads = out.sum().backward();
    assert!(w.grad(&grads).is_none());
    assert!(x.grad(&grads).is_some() && a.grad(&grads).is_some() && b.grad(&grads).is_some());
}
