//! A gated MLP's activation as one op: SwiGLU's `silu(gate) · up` and
//! GeGLU's `gelu_tanh(gate) · up`.
//!
//! Composed from burn's ops, autodiff keeps four `[tokens, intermediate]`
//! tensors per block for this line: SiLU's product keeps the gate's output
//! and its sigmoid, the gating product keeps SiLU's output and up's output
//! (GeGLU's tanh-approximated GELU keeps more). Both derivatives need only
//! the two inputs, so this op keeps `gate` and `up` and recomputes the
//! sigmoid (or tanh) in backward: two tensors a block fewer, and one fresh
//! output forward instead of three.
//!
//! On flex in f32 the forward and the backward are each one pass over the
//! buffers with the vectorized [`super::exp`] (burn's sigmoid calls libm's
//! `expf` per value); elsewhere (CUDA, wgpu, other dtypes) the same
//! formulas run as burn's tensor ops on the inner backend.

use burn::backend::Flex;
use burn::backend::tensor::FloatTensor;
use burn::tensor::Tensor;
use burn::tensor::activation::{gelu_approximate, sigmoid, silu};

use super::exp::exp_f32;
use crate::flex_values::{flex_f32, values};

/// The gate's activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GateActivation {
    /// SwiGLU (Llama, Mistral, Qwen, Phi-3): `x · σ(x)`.
    Silu,
    /// GeGLU (Gemma's `gelu_pytorch_tanh`):
    /// `x/2 · (1 + tanh(√(2/π) · (x + 0.044715 x³)))`.
    GeluTanh,
}

/// √(2/π), as burn and PyTorch compute it.
const SQRT_2_OVER_PI: f32 =
    (std::f64::consts::FRAC_2_SQRT_PI * std::f64::consts::FRAC_1_SQRT_2) as f32;
const GELU_CUBIC: f32 = 0.044715;

/// `activation(gate) · up`, the forward alone.
pub fn forward<const D: usize>(
    gate: Tensor<D>,
    up: Tensor<D>,
    activation: GateActivation,
) -> Tensor<D> {
    if let (Some(g), Some(u)) = (flex_f32(&gate), flex_f32(&up)) {
        return Tensor::from_primitive::<Flex>(flex_forward(g, u, activation));
    }
    match activation {
        GateActivation::Silu => gate.clone() * sigmoid(gate) * up,
        GateActivation::GeluTanh => gate.clone() * gelu_sigmoid(gate) * up,
    }
}

/// The gradients of `gate` and `up` under `dy`, each only where asked for.
pub fn backward<const D: usize>(
    gate: Tensor<D>,
    up: Tensor<D>,
    dy: Tensor<D>,
    activation: GateActivation,
    need: (bool, bool),
) -> (Option<Tensor<D>>, Option<Tensor<D>>) {
    if let (Some(g), Some(u), Some(dy)) = (flex_f32(&gate), flex_f32(&up), flex_f32(&dy)) {
        let (dg, du) = flex_backward(g, u, dy, activation, need);
        return (
            dg.map(Tensor::from_primitive::<Flex>),
            du.map(Tensor::from_primitive::<Flex>),
        );
    }
    // act(g) and act'(g), from the same sigmoid or tanh.
    let (act, slope) = match activation {
        GateActivation::Silu => {
            let s = sigmoid(gate.clone());
            // σ + x·σ·(1 − σ)
            let slope = s.clone() * ((s.clone().neg() + 1.0) * gate.clone() + 1.0);
            (gate * s, slope)
        }
        GateActivation::GeluTanh => {
            let p = gelu_sigmoid(gate.clone());
            let x2 = gate.clone() * gate.clone();
            // p + 2x · p · (1 − p) · √(2/π) · (1 + 3·0.044715·x²)
            let inner = (x2 * (3.0 * GELU_CUBIC) + 1.0) * (2.0 * SQRT_2_OVER_PI);
            let slope = p.clone() + gate.clone() * p.clone() * (p.clone().neg() + 1.0) * inner;
            (gate * p, slope)
        }
    };
    let dg = need.0.then(|| dy.clone() * up * slope);
    let du = need.1.then(|| dy * act);
    (dg, du)
}

/// burn's own ops, as the model composed them before this op: the A/B
/// reference (`HEADROOM_NAIVE_OPS`) and the tests'.
pub fn naive<const D: usize>(
    gate: Tensor<D>,
    up: Tensor<D>,
    activation: GateActivation,
) -> Tensor<D> {
    match activation {
        GateActivation::Silu => silu(gate) * up,
        GateActivation::GeluTanh => gelu_approximate(gate) * up,
    }
}

/// `(1 + tanh z)/2` as `σ(2z)`, `z = √(2/π) · (x + 0.044715 x³)`: the
/// same value without `1 + tanh z` cancelling in the negative tail (where
/// it would leave the gradient 0 from x ≈ −5 on), and `1 − tanh² z` is
/// `4 σ(2z)(1 − σ(2z))`.
fn gelu_sigmoid<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    sigmoid((x.clone() + x.powf_scalar(3.0) * GELU_CUBIC).mul_scalar(2.0 * SQRT_2_OVER_PI))
}

/// A new f32 tensor of `shape` whose values `fill` writes.
fn new_tensor(shape: &burn::tensor::Shape, fill: impl FnOnce(&mut [f32])) -> FloatTensor<Flex> {
    let mut out = vec![0f32; shape.num_elements()];
    fill(&mut out);
    FloatTensor::<Flex>::from_data(burn::tensor::TensorData::new(out, shape.clone()))
}

/// An activation's value and derivative for the flex passes, as types so
/// each pass is compiled (and vectorized) for one activation.
trait Gate {
    fn act(x: f32) -> f32;
    fn slope(x: f32) -> f32;
}

struct SiluGate;
struct GeluTanhGate;

impl Gate for SiluGate {
    #[inline(always)]
    fn act(x: f32) -> f32 {
        x / (1.0 + exp_f32(-x))
    }
    #[inline(always)]
    fn slope(x: f32) -> f32 {
        let s = 1.0 / (1.0 + exp_f32(-x));
        s * (1.0 + x * (1.0 - s))
    }
}

impl Gate for GeluTanhGate {
    #[inline(always)]
    fn act(x: f32) -> f32 {
        x * gelu_p(x)
    }
    #[inline(always)]
    fn slope(x: f32) -> f32 {
        let p = gelu_p(x);
        let inner = (2.0 * SQRT_2_OVER_PI) * (1.0 + 3.0 * GELU_CUBIC * x * x);
        p + x * p * (1.0 - p) * inner
    }
}

fn flex_forward(
    gate: FloatTensor<Flex>,
    up: FloatTensor<Flex>,
    activation: GateActivation,
) -> FloatTensor<Flex> {
    match activation {
        GateActivation::Silu => flex_forward_with::<SiluGate>(gate, up),
        GateActivation::GeluTanh => flex_forward_with::<GeluTanhGate>(gate, up),
    }
}

fn flex_forward_with<G: Gate>(gate: FloatTensor<Flex>, up: FloatTensor<Flex>) -> FloatTensor<Flex> {
    let (g, u) = (values(&gate), values(&up));
    new_tensor(gate.layout().shape(), |out| {
        pulp::Arch::new().dispatch(
            #[inline(always)]
            || {
                for ((o, &x), &u) in out.iter_mut().zip(g).zip(u) {
                    *o = G::act(x) * u;
                }
            },
        )
    })
}

fn flex_backward(
    gate: FloatTensor<Flex>,
    up: FloatTensor<Flex>,
    dy: FloatTensor<Flex>,
    activation: GateActivation,
    need: (bool, bool),
) -> (Option<FloatTensor<Flex>>, Option<FloatTensor<Flex>>) {
    match activation {
        GateActivation::Silu => flex_backward_with::<SiluGate>(gate, up, dy, need),
        GateActivation::GeluTanh => flex_backward_with::<GeluTanhGate>(gate, up, dy, need),
    }
}

fn flex_backward_with<G: Gate>(
    gate: FloatTensor<Flex>,
    up: FloatTensor<Flex>,
    mut dy: FloatTensor<Flex>,
    (need_gate, need_up): (bool, bool),
) -> (Option<FloatTensor<Flex>>, Option<FloatTensor<Flex>>) {
    let (g, u) = (values(&gate), values(&up));
    let shape = gate.layout().shape().clone();
    let arch = pulp::Arch::new();
    // dup = dy · act(g), first: dgate may overwrite dy.
    let du = need_up.then(|| {
        let d = values(&dy);
        new_tensor(&shape, |out| {
            arch.dispatch(
                #[inline(always)]
                || {
                    for ((o, &x), &d) in out.iter_mut().zip(g).zip(d) {
                        *o = G::act(x) * d;
                    }
                },
            )
        })
    });
    // dgate = dy · up · act'(g): into dy's own buffer where dy holds the only
    // reference to it (the usual case: the gradient flowing back), else new.
    let dg = need_gate.then(|| match dy.layout().contiguous_offsets() {
        Some((start, end)) if dy.is_unique() => {
            let d = &mut dy.storage_mut::<f32>()[start..end];
            arch.dispatch(
                #[inline(always)]
                || {
                    for ((o, &x), &u) in d.iter_mut().zip(g).zip(u) {
                        *o *= u * G::slope(x);
                    }
                },
            );
            dy
        }
        _ => {
            let d = values(&dy);
            new_tensor(&shape, |out| {
                arch.dispatch(
                    #[inline(always)]
                    || {
                        for (((o, &x), &u), &d) in out.iter_mut().zip(g).zip(u).zip(d) {
                            *o = d * u * G::slope(x);
                        }
                    },
                )
            })
        }
    });
    (dg, du)
}

/// `(1 + tanh z)/2 = σ(2z) = 1 / (1 + e^{−2z})`, `z = √(2/π) · (x +
/// 0.044715 x³)` (see [`gelu_sigmoid`]): exact limits (0 where `e^{−2z}`
/// overflows, 1 where it underflows) and no cancellation in either tail.
#[inline(always)]
fn gelu_p(x: f32) -> f32 {
    let z = SQRT_2_OVER_PI * (x + GELU_CUBIC * x * x * x);
    1.0 / (1.0 + exp_f32(-2.0 * z))
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{DType, Device, TensorData};

    fn grid() -> Vec<f32> {
        // Both tails (σ and tanh saturating, exp overflowing), and near 0.
        (0..4001)
            .map(|i| (i as f32 - 2000.0) * 0.011)
            .chain([-120.0, 95.0, 0.0, -1e-6, 3e-5])
            .collect()
    }

    fn tensor(values: Vec<f32>, device: &Device) -> Tensor<1> {
        let n = values.len();
        Tensor::from_data(TensorData::new(values, [n]), device)
    }

    /// The flex passes against the composed formulas (which run on flex
    /// too when the inputs are not plain flex f32: here through f64).
    #[test]
    fn flex_passes_equal_the_composed_formulas() {
        let flex = Device::flex();
        let g = grid();
        let n = g.len();
        let u: Vec<f32> = (0..n)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.03)
            .collect();
        let dy: Vec<f32> = (0..n)
            .map(|i| ((i * 53 % 97) as f32 - 48.0) * 0.02)
            .collect();
        for activation in [GateActivation::Silu, GateActivation::GeluTanh] {
            let run = |dtype: DType| {
                let t = |v: &Vec<f32>| tensor(v.clone(), &flex).cast(dtype);
                let out = forward(t(&g), t(&u), activation);
                let (dg, du) = backward(t(&g), t(&u), t(&dy), activation, (true, true));
                [out, dg.expect("asked for"), du.expect("asked for")].map(|x| {
                    x.cast(DType::F32)
                        .into_data()
                        .iter::<f32>()
                        .collect::<Vec<_>>()
                })
            };
            let (fast, reference) = (run(DType::F32), run(DType::F64));
            for (name, (f, r)) in ["out", "dgate", "dup"]
                .iter()
                .zip(fast.iter().zip(&reference))
            {
                for (i, (a, b)) in f.iter().zip(r).enumerate() {
                    // Relative to the value, with an absolute floor of a
                    // few f32 ulp of the operands' scale.
                    let err = (a - b).abs();
                    assert!(
                        err <= 4e-6 * b.abs() + 1e-6,
                        "{activation:?} {name} at x = {}: {a} against {b}",
                        g[i]
                    );
                }
            }
        }
    }
}
