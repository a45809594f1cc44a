//! A LoRA linear over a dense frozen base as one op: `y = x·W + (s·x·A)·B`
//! on the tokens as rows, with its own backward.
//!
//! Composed from burn's ops (`x·W`, `x·A`, `·s`, `·B`, `+`), the adapter's
//! product is a fresh `[tokens, d_out]` tensor forward that the sum then
//! passes over again, and backward its `dx` is another fresh `[tokens,
//! d_in]` tensor added to the base's `dx`: two fresh tensors and two passes
//! a linear, where the adapter's own products are a few percent of the
//! linear's work (measured: `calibrate --step-breakdown --only linear-ops`,
//! docs/benchmarks.md). On flex in f32 the adapter's product is added into
//! the base's output, and its part of `dx` into the base's `dx`, by gemm's
//! accumulating mode ([`headroom_ffi::add_product_f32`]); elsewhere (CUDA,
//! wgpu, other dtypes) the same formulas run as burn's tensor ops.
//!
//! It keeps what the composition kept: `x`, the `r`-wide `s·x·A`, and
//! references to `W`, `A` and `B`. Backward, for the output's gradient `g`:
//!
//! * `t = s·(g·Bᵀ)` `[tokens, r]`;
//! * `dx = g·Wᵀ + t·Aᵀ`, `dA = xᵀ·t`, `dB = (s·x·A)ᵀ·g`;
//! * `dW = xᵀ·g`, only where the base is trained too.

use burn::tensor::Tensor;

use crate::flex_values::{flex_f32, into_flex, is_flex_f32, values, values_mut};

/// The forward: `x` [n, d_in], `w` [d_in, d_out], `a` [d_in, r], `b`
/// [r, d_out] → (`y` [n, d_out], the kept `s·x·A` [n, r]).
pub fn forward(
    x: Tensor<2>,
    w: Tensor<2>,
    a: Tensor<2>,
    b: Tensor<2>,
    scale: f64,
) -> (Tensor<2>, Tensor<2>) {
    // The scale on the r-wide product, as PEFT's `B(A(x))·s` is computed
    // once over `r` columns (the order the composed path used).
    let xa = x.clone().matmul(a).mul_scalar(scale);
    let y = x.matmul(w);
    let y = add_product(y, &xa, &b, false);
    (y, xa)
}

/// The gradients of `x`, `w`, `a` and `b` under `g` [n, d_out], each only
/// where `need` asks for it (in that order).
pub fn backward(state: Kept, g: Tensor<2>, need: [bool; 4]) -> [Option<Tensor<2>>; 4] {
    let Kept {
        x,
        xa,
        w,
        a,
        b,
        scale,
    } = state;
    let [need_x, need_w, need_a, need_b] = need;
    let t = (need_x || need_a).then(|| g.clone().matmul(b.transpose()).mul_scalar(scale));
    let db = need_b.then(|| xa.transpose().matmul(g.clone()));
    let dw = need_w.then(|| x.clone().transpose().matmul(g.clone()));
    let da = match (&t, need_a) {
        (Some(t), true) => Some(x.transpose().matmul(t.clone())),
        _ => None,
    };
    let dx = match (t, need_x) {
        (Some(t), true) => Some(add_product(g.matmul(w.transpose()), &t, &a, true)),
        _ => None,
    };
    [dx, dw, da, db]
}

/// What the op keeps between forward and backward (the inner backend's
/// tensors: references, not copies).
#[derive(Clone, Debug)]
pub struct Kept {
    pub x: Tensor<2>,
    pub xa: Tensor<2>,
    pub w: Tensor<2>,
    pub a: Tensor<2>,
    pub b: Tensor<2>,
    pub scale: f64,
}

/// `acc + lhs·rhs`, or with `transpose_rhs` `acc + lhs·rhsᵀ`: on flex f32
/// into `acc`'s own buffer (fresh from a matmul, so not shared), elsewhere
/// a product and a sum.
fn add_product(acc: Tensor<2>, lhs: &Tensor<2>, rhs: &Tensor<2>, transpose_rhs: bool) -> Tensor<2> {
    if is_flex_f32(&acc)
        && let (Some(l), Some(r)) = (flex_f32(lhs), flex_f32(rhs))
    {
        let [m, k] = lhs.dims();
        let [rr, rc] = rhs.dims();
        let mut out = into_flex(acc);
        let rhs = if transpose_rhs {
            // rhs is [n, k] row-major: its transpose is k × n with strides (1, k).
            headroom_ffi::Strided {
                values: values(&r),
                rows: rc,
                cols: rr,
                row_stride: 1,
                col_stride: rc,
            }
        } else {
            headroom_ffi::Strided {
                values: values(&r),
                rows: rr,
                cols: rc,
                row_stride: rc,
                col_stride: 1,
            }
        };
        headroom_ffi::add_product_f32(
            values_mut(&mut out),
            headroom_ffi::Strided {
                values: values(&l),
                rows: m,
                cols: k,
                row_stride: k,
                col_stride: 1,
            },
            rhs,
        );
        return Tensor::from_primitive::<burn::backend::Flex>(out);
    }
    let product = if transpose_rhs {
        lhs.clone().matmul(rhs.clone().transpose())
    } else {
        lhs.clone().matmul(rhs.clone())
    };
    acc + product
}
