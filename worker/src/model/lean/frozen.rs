//! `x · W` for a frozen weight stored quantized: the weight is dequantized
//! for the forward's matmul and again for the backward's `dy · Wᵀ`, and
//! never kept dense between them (bitsandbytes' `MatMul4Bit` keeps the
//! quantized state the same way). burn's own `x.matmul(W_q)` dequantizes
//! into a dense tensor that autodiff then keeps until backward: one dense
//! copy of every quantized matrix of every block.
//!
//! An NF4 weight is dequantized a slice of rows at a time
//! ([`Nf4Weight::chunk_rows`]): the forward's output is built slice by
//! slice and the backward's `dx` summed over slices, so the transient is
//! one slice whatever the matrix.

use burn::tensor::{DType, FloatDType, Tensor};

use crate::model::nf4::Nf4Weight;

/// A frozen weight as the module stores it: burn's tensor (a quantized one
/// for int8/int4, `[d_in, d_out]`), or NF4 in the checkpoint's own layout
/// (`[d_out, d_in]`, as bitsandbytes quantizes a torch `Linear`'s weight).
#[derive(Clone, Debug)]
#[allow(clippy::large_enum_variant)] // made per matmul and moved, never stored in bulk
pub enum FrozenWeight {
    Burn(Tensor<2>),
    Nf4(Nf4Weight),
}

impl FrozenWeight {
    pub fn new(stored: Tensor<2>) -> Self {
        FrozenWeight::Burn(stored)
    }

    /// The whole dense weight `[d_in, d_out]` in `dtype`, on the backend
    /// without autodiff (nothing tracks it).
    pub fn dense(&self, dtype: DType) -> Tensor<2> {
        match self {
            FrozenWeight::Burn(stored) => {
                let stored = stored.clone();
                let dense = match stored.dtype() {
                    DType::QFloat(_) => stored.dequantize().inner(),
                    _ => stored.inner(),
                };
                if dense.dtype() == dtype {
                    dense
                } else {
                    dense.cast(FloatDType::from(dtype))
                }
            }
            FrozenWeight::Nf4(w) => w.dense(dtype).transpose(),
        }
    }
}

/// `x` [b, s, d_in] · `W` → [b, s, d_out].
pub fn forward(x: Tensor<3>, weight: &FrozenWeight) -> Tensor<3> {
    let FrozenWeight::Nf4(w) = weight else {
        let w = weight.dense(x.dtype());
        return x.matmul(w.unsqueeze());
    };
    let absmax = w.block_absmax();
    let outputs: Vec<Tensor<3>> = slices(w)
        .map(|rows| {
            let slice = w.dense_rows(rows, &absmax, x.dtype()); // [rows, d_in]
            x.clone().matmul(slice.transpose().unsqueeze())
        })
        .collect();
    Tensor::cat(outputs, 2)
}

/// `dx` = `dy` [b, s, d_out] · `Wᵀ` → [b, s, d_in].
pub fn backward(dy: Tensor<3>, weight: &FrozenWeight) -> Tensor<3> {
    let FrozenWeight::Nf4(w) = weight else {
        let w = weight.dense(dy.dtype());
        return dy.matmul(w.transpose().unsqueeze());
    };
    let absmax = w.block_absmax();
    let [b, s, _] = dy.dims();
    slices(w)
        .map(|rows| {
            let slice = w.dense_rows(rows.clone(), &absmax, dy.dtype()); // [rows, d_in]
            dy.clone()
                .slice([0..b, 0..s, rows])
                .matmul(slice.unsqueeze())
        })
        .reduce(|sum, part| sum + part)
        .expect("a weight has rows")
}

/// The row ranges an NF4 weight is dequantized in.
fn slices(w: &Nf4Weight) -> impl Iterator<Item = std::ops::Range<usize>> + '_ {
    let rows = w.shape()[0];
    let step = w.chunk_rows().max(1);
    (0..rows)
        .step_by(step)
        .map(move |r| r..(r + step).min(rows))
}
