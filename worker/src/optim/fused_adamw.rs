//! burn's AdamW, one pass over each parameter on the CPU.
//!
//! burn's `AdamW` composes its update from tensor ops; on flex each op is
//! a pass over the parameter with a fresh output, fourteen a parameter a
//! step, which made a full fine-tune's optimizer step 832 ms against
//! PyTorch's 560 on the 135M bench (docs/benchmarks.md). Here the same
//! arithmetic, in the same order and in f32, so the result is burn's bit
//! for bit, runs as one loop that reads the gradient and updates the
//! parameter and both moments where they lie (PyTorch's `fused=True`).
//! The state is burn's `AdamWState`, so checkpoints are unchanged. On CUDA
//! and wgpu (whose fusion joins the ops already), for other dtypes and for
//! moments that are not flex f32, it is burn's `AdamW`.

use burn::backend::Flex;
use burn::backend::tensor::FloatTensor;
use burn::optim::{AdamW, AdamWConfig, AdamWState, AdaptiveMomentumState, LearningRate, Optimizer};
use burn::tensor::{DType, Device, Tensor, TensorData};

use crate::flex_values::{values, values_mut};

/// AdamW as burn's `AdamW` with these settings computes it.
#[derive(Clone)]
pub struct FusedAdamW {
    burn: AdamW,
    beta_1: f32,
    beta_2: f32,
    epsilon: f32,
    weight_decay: f32,
}

impl std::fmt::Debug for FusedAdamW {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FusedAdamW")
            .field("beta_1", &self.beta_1)
            .field("beta_2", &self.beta_2)
            .field("epsilon", &self.epsilon)
            .field("weight_decay", &self.weight_decay)
            .finish()
    }
}

impl FusedAdamW {
    pub fn new(beta_1: f32, beta_2: f32, epsilon: f32, weight_decay: f32) -> Self {
        FusedAdamW {
            burn: AdamWConfig::new()
                .with_beta_1(beta_1)
                .with_beta_2(beta_2)
                .with_epsilon(epsilon)
                .with_weight_decay(weight_decay)
                .build(),
            beta_1,
            beta_2,
            epsilon,
            weight_decay,
        }
    }
}

/// Whether `t` is f32 on the plain flex device (not flex under autodiff,
/// as a pipeline stage's tensors can be).
fn on_flex<const D: usize>(t: &Tensor<D>) -> bool {
    t.dtype() == DType::F32
        && t.device() == Device::flex()
        && t.clone().try_into_primitive::<Flex>().is_ok()
}

/// Whether [`FusedAdamW`] steps these in one pass (else burn's `AdamW`).
fn fuses<const D: usize>(
    tensor: &Tensor<D>,
    grad: &Tensor<D>,
    state: Option<&AdamWState<D>>,
) -> bool {
    on_flex(tensor)
        && on_flex(grad)
        && state.is_none_or(|s| {
            on_flex(&s.momentum.moment_1)
                && on_flex(&s.momentum.moment_2)
                && s.momentum.max_moment_2.is_none()
        })
}

fn primitive<const D: usize>(t: Tensor<D>) -> FloatTensor<Flex> {
    t.try_into_primitive::<Flex>()
        .expect("a tensor on the flex device is a flex tensor")
        .to_contiguous()
}

impl Optimizer for FusedAdamW {
    type State<const D: usize> = AdamWState<D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<D>, Option<Self::State<D>>) {
        if !fuses(&tensor, &grad, state.as_ref()) {
            return self.burn.step(lr, tensor, grad, state);
        }
        let shape = tensor.shape();
        let (time, m, v) = match state {
            Some(s) => (
                s.momentum.time + 1,
                primitive(s.momentum.moment_1),
                primitive(s.momentum.moment_2),
            ),
            None => {
                let zeros = || {
                    FloatTensor::<Flex>::from_data(TensorData::new(
                        vec![0f32; shape.num_elements()],
                        shape.clone(),
                    ))
                };
                (1, zeros(), zeros())
            }
        };
        let (mut p, g, mut m, mut v) = (primitive(tensor), primitive(grad), m, v);
        let t = time as i32;
        let step = Step {
            first: time == 1,
            beta_1: self.beta_1,
            beta_2: self.beta_2,
            factor_1: 1.0 - self.beta_1,
            factor_2: 1.0 - self.beta_2,
            correction_1: 1f32 - self.beta_1.powi(t),
            correction_2: 1f32 - self.beta_2.powi(t),
            epsilon: self.epsilon,
            // burn's scalars are the f64 it is given, cast to the element.
            keep: (1.0 - lr * f64::from(self.weight_decay)) as f32,
            decays: lr * f64::from(self.weight_decay) != 0.0,
            lr: lr as f32,
        };
        step.apply(
            values_mut(&mut p),
            values(&g),
            values_mut(&mut m),
            values_mut(&mut v),
        );
        let float =
            |t: FloatTensor<Flex>| Tensor::<D>::from_primitive::<Flex>(t).reshape(shape.clone());
        let state = AdamWState {
            momentum: AdaptiveMomentumState {
                time,
                moment_1: float(m),
                moment_2: float(v),
                max_moment_2: None,
            },
        };
        (float(p), Some(state))
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &Device) -> Self::State<D> {
        AdamW::to_device(state, device)
    }
}

/// One step's constants.
struct Step {
    /// No moments yet: burn starts them from the gradient alone.
    first: bool,
    beta_1: f32,
    beta_2: f32,
    factor_1: f32,
    factor_2: f32,
    correction_1: f32,
    correction_2: f32,
    epsilon: f32,
    keep: f32,
    decays: bool,
    lr: f32,
}

impl Step {
    /// burn's `AdamW::step`, value by value, each operation where burn does
    /// it: `m ← m·β₁ + g·(1−β₁)`, `v ← v·β₂ + g²·(1−β₂)` (the first step
    /// `g·(1−β₁)` and `g²·(1−β₂)`),
    /// `p ← p·(1−lr·wd) − (m/c₁ ÷ (√(v/c₂) + ε))·lr`.
    fn apply(&self, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
        assert!(p.len() == g.len() && p.len() == m.len() && p.len() == v.len());
        pulp::Arch::new().dispatch(
            #[inline(always)]
            || {
                for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
                    if self.first {
                        *m = g * self.factor_1;
                        *v = (g * g) * self.factor_2;
                    } else {
                        *m = *m * self.beta_1 + g * self.factor_1;
                        *v = *v * self.beta_2 + (g * g) * self.factor_2;
                    }
                    let delta =
                        (*m / self.correction_1) / ((*v / self.correction_2).sqrt() + self.epsilon);
                    let decayed = if self.decays { *p * self.keep } else { *p };
                    *p = decayed - delta * self.lr;
                }
            },
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::Distribution;

    fn draw<const D: usize>(dims: [usize; D], seed: u64) -> Tensor<D> {
        crate::model::with_generator(|| {
            Device::flex().seed(seed);
            Tensor::random(dims, Distribution::Normal(0.0, 1.0), &Device::flex())
        })
    }

    fn bits<const D: usize>(t: &Tensor<D>) -> Vec<u32> {
        t.to_data().iter::<f32>().map(f32::to_bits).collect()
    }

    /// Bit for bit burn's AdamW over several steps, with and without weight
    /// decay, the first step from no state included.
    #[test]
    fn equals_burns_adamw_bit_for_bit() {
        for weight_decay in [0.0, 0.01] {
            let fused = FusedAdamW::new(0.9, 0.95, 1e-8, weight_decay);
            let burn = fused.burn.clone();
            let (mut a, mut b) = (draw([37, 29], 1), draw([37, 29], 1));
            let (mut sa, mut sb) = (None, None);
            for step in 0..4u64 {
                let grad = draw([37, 29], 10 + step).mul_scalar(10f64.powi(step as i32 - 2));
                let lr = 1e-3 * (step + 1) as f64;
                assert!(
                    fuses(&a, &grad, sa.as_ref()),
                    "the one-pass path, step {step}"
                );
                (a, sa) = fused.step(lr, a, grad.clone(), sa);
                (b, sb) = burn.step(lr, b, grad, sb);
                let (ma, mb) = (
                    &sa.as_ref().expect("a state").momentum,
                    &sb.as_ref().expect("a state").momentum,
                );
                assert_eq!(ma.time, mb.time);
                assert_eq!(bits(&ma.moment_1), bits(&mb.moment_1), "m, step {step}");
                assert_eq!(bits(&ma.moment_2), bits(&mb.moment_2), "v, step {step}");
                assert_eq!(
                    bits(&a),
                    bits(&b),
                    "parameter, step {step}, decay {weight_decay}"
                );
            }
        }
    }
}
