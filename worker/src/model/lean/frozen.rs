//! `x · W` for a frozen weight stored quantized: the weight is dequantized
//! for the forward's matmul and again for the backward's `dy · Wᵀ`, and
//! never kept dense between them (bitsandbytes' `MatMul4Bit` keeps the
//! quantized state the same way). burn's own `x.matmul(W_q)` dequantizes
//! into a dense tensor that autodiff then keeps until backward: one dense
//! copy of every quantized matrix of every block.

use burn::tensor::{DType, FloatDType, Tensor};

/// A frozen weight `[d_in, d_out]` as the module stores it (burn's quantized
/// tensor); [`FrozenWeight::dense`] makes the transient dense copy.
#[derive(Clone, Debug)]
pub struct FrozenWeight {
    stored: Tensor<2>,
}

impl FrozenWeight {
    pub fn new(stored: Tensor<2>) -> Self {
        FrozenWeight { stored }
    }

    /// The dense weight in `dtype`, on the backend without autodiff
    /// (nothing tracks it).
    pub fn dense(&self, dtype: DType) -> Tensor<2> {
        let stored = self.stored.clone();
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
}

/// `x` [b, s, d_in] · `W` → [b, s, d_out].
pub fn forward(x: Tensor<3>, weight: &FrozenWeight) -> Tensor<3> {
    let w = weight.dense(x.dtype());
    x.matmul(w.unsqueeze())
}

/// `dx` = `dy` [b, s, d_out] · `Wᵀ` → [b, s, d_in].
pub fn backward(dy: Tensor<3>, weight: &FrozenWeight) -> Tensor<3> {
    let w = weight.dense(dy.dtype());
    dy.matmul(w.transpose().unsqueeze())
}
