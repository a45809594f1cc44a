//! `exp` for the lean ops' hot loops, vectorized on the CPU.
//!
//! flex computes `exp` one element at a time through libm's `expf` (a call
//! per value, and an errno path for every underflow): on the LoRA step of
//! the 135M bench that was 7–8 % of the step, nearly all of it the
//! attention's probabilities (a causal mask underflows half the scores of
//! a diagonal block pair to zero). Here the same function runs over the
//! buffer in place, 16 values at a time on AVX-512 (8 on AVX2), chosen at
//! run time as gemm chooses its kernels (`pulp`). Other backends (CUDA,
//! wgpu) and other dtypes keep burn's own `exp`.
//!
//! The approximation is Cephes' `expf` (range reduction by ln 2 split in
//! two, a degree-6 polynomial on |r| ≤ ln2/2), with the power of two
//! applied in two halves so that results down to the subnormals are right:
//! within 2 ulp of the correctly rounded value over the whole f32 range
//! (`matches_libm_within_two_ulp` checks every 997th f32 in [-104, 89]).

use burn::backend::Flex;
use burn::backend::tensor::FloatTensor;
use burn::tensor::{DType, Tensor};

use crate::flex_values::values_mut;

/// `e^t`, elementwise.
pub fn exp<const D: usize>(t: Tensor<D>) -> Tensor<D> {
    // Autodiff's flex device is another device: only the plain backend's
    // tensors (the lean ops' bodies) are flex primitives.
    if t.dtype() != DType::F32 || t.device() != burn::tensor::Device::flex() {
        return t.exp();
    }
    let flex = t
        .try_into_primitive::<Flex>()
        .expect("a tensor on the flex device is a flex tensor");
    Tensor::from_primitive::<Flex>(flex_exp(flex))
}

/// In place where the buffer is this tensor's alone, else into a copy.
fn flex_exp(mut t: FloatTensor<Flex>) -> FloatTensor<Flex> {
    if !(t.is_unique() && t.layout().contiguous_offsets().is_some()) {
        t = t.to_contiguous();
    }
    exp_in_place(values_mut(&mut t));
    t
}

/// `v[i] = e^v[i]`: +inf above ln(f32::MAX), 0 below the smallest
/// subnormal's log, NaN stays NaN.
pub fn exp_in_place(v: &mut [f32]) {
    pulp::Arch::new().dispatch(
        #[inline(always)]
        || {
            for x in v.iter_mut() {
                *x = exp_f32(*x);
            }
        },
    );
}

/// One value; branch-free so the loop above vectorizes.
#[inline(always)]
pub(super) fn exp_f32(x: f32) -> f32 {
    const HI: f32 = 88.722_84; // ln(f32::MAX) rounded up: e^x is +inf above
    const LO: f32 = -103.972_08; // below, e^x rounds to 0
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4; // 0.693359375: exact in 9 bits, so n·LN2_HI is exact
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 · 2^23: adding it rounds to an integer (round to nearest).
    const ROUND: f32 = 12_582_912.0;
    let c = x.clamp(LO, HI);
    let t = c * LOG2E + ROUND;
    let n = t - ROUND;
    // The same integer from t's bits (its mantissa holds it): a float to
    // int cast would not vectorize (Rust's saturating `as`).
    let n_int = t.to_bits() as i32 - ROUND.to_bits() as i32;
    let r = c - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_2e-4;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5; // Cephes: 5.0000001201e-1, which is 0.5 in f32
    let y = p * r * r + r + 1.0;
    // 2^n in two factors, each a normal float for n in [-150, 128].
    let a = n_int >> 1;
    let scale = |k: i32| f32::from_bits(((k + 127) as u32) << 23);
    let e = y * scale(a) * scale(n_int - a);
    if x.is_nan() {
        x
    } else if x > HI {
        f32::INFINITY
    } else if x < LO {
        0.0
    } else {
        e
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Distance in units in the last place (0 where both are 0 or both inf).
    fn ulps(a: f32, b: f32) -> u32 {
        if a == b {
            return 0;
        }
        (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
    }

    #[test]
    fn matches_libm_within_two_ulp() {
        let (mut worst, mut at) = (0, 0.0f32);
        // Every 997th bit pattern in [-104, 89]: every exponent, many mantissas.
        let values: Vec<f32> = (0..u32::MAX)
            .step_by(997)
            .map(f32::from_bits)
            .filter(|x| (-104.0..=89.0).contains(x))
            .collect();
        let mut out = values.clone();
        exp_in_place(&mut out);
        for (x, e) in values.iter().zip(&out) {
            let want = x.exp();
            let d = ulps(*e, want);
            if d > worst {
                (worst, at) = (d, *x);
            }
        }
        eprintln!("exp: worst {worst} ulp from libm, at {at}");
        assert!(
            worst <= 2,
            "exp({at}) is {worst} ulp from libm over {} values",
            values.len()
        );
    }

    #[test]
    fn edges_are_exact() {
        let mut v = [
            0.0,
            -0.0,
            1.0,
            -1.0e30,
            f32::NEG_INFINITY,
            f32::INFINITY,
            89.0,
            -104.0,
            f32::NAN,
            -87.5,
        ];
        exp_in_place(&mut v);
        assert_eq!(v[0], 1.0);
        assert_eq!(v[1], 1.0);
        assert!(ulps(v[2], std::f32::consts::E) <= 2, "{}", v[2]);
        assert_eq!(v[3], 0.0);
        assert_eq!(v[4], 0.0);
        assert_eq!(v[5], f32::INFINITY);
        assert_eq!(v[6], f32::INFINITY);
        assert_eq!(v[7], 0.0);
        assert!(v[8].is_nan());
        // A subnormal result keeps its value (within 2 ulp).
        assert!(ulps(v[9], (-87.5f32).exp()) <= 2, "{}", v[9]);
    }

    #[test]
    fn a_tensor_on_flex_equals_burns_exp_within_two_ulp() {
        let device = burn::tensor::Device::flex();
        let values: Vec<f32> = (0..1000).map(|i| (i as f32 - 800.0) * 0.11).collect();
        let t = Tensor::<2>::from_data(
            burn::tensor::TensorData::new(values.clone(), [10, 100]),
            &device,
        );
        // A transposed view: not contiguous, so the copy path.
        for t in [t.clone(), t.transpose()] {
            let want = t
                .clone()
                .exp()
                .into_data()
                .iter::<f32>()
                .collect::<Vec<_>>();
            let got = exp(t).into_data().iter::<f32>().collect::<Vec<_>>();
            for (g, w) in got.iter().zip(&want) {
                assert!(ulps(*g, *w) <= 2, "{g} against {w}");
            }
        }
    }
}
