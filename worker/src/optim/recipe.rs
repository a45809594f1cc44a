//! The parts of the reference trainers' recipe that burn's optimizers do not
//! apply the way the Hugging Face Trainer does, done on the gradients and
//! weights around `ModuleOptimizer::step`:
//!
//! - gradient clipping by the *global* norm (`torch.nn.utils.clip_grad_norm_`):
//!   burn's `GradientClipping::Norm` clips each tensor by its own norm, and a
//!   worker holds only its stage's (and, with replicas, its share's)
//!   gradients, so the norm is summed here and over the other workers
//!   (`crate::train`) before any gradient is scaled;
//! - decoupled weight decay on matrices only: the Trainer leaves biases and
//!   norm weights out (`get_decay_parameter_names`), which in every
//!   architecture here are exactly the one-dimensional parameters, while
//!   burn's AdamW decays every tensor it steps. The optimizers are built
//!   without decay and [`DecoupledDecay`] multiplies the matrices by
//!   `1 − lr·wd` before the update, as `torch.optim.AdamW` does (its update
//!   does not read the weights, so before or after is the same).

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::{GradientsParams, LearningRate, Optimizer};
use burn::tensor::{Device, Tensor};

use crate::model::TransformerLm;

/// `clip_grad_norm_`'s guard against a zero norm.
pub const CLIP_EPSILON: f64 = 1e-6;

/// The sum of the squares of the gradients in `grads` of `model`'s
/// parameters, but for `skip` (a tensor another worker counts). Each
/// tensor's sum is taken in f32 on its device, as PyTorch's per-tensor norms
/// are, and the sums are added in f64.
pub fn squared_norm(model: &TransformerLm, grads: &GradientsParams, skip: Option<ParamId>) -> f64 {
    struct Sum<'a> {
        grads: &'a GradientsParams,
        skip: Option<ParamId>,
        total: f64,
    }
    impl ModuleVisitor for Sum<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if Some(param.id) == self.skip {
                return;
            }
            if let Some(grad) = self.grads.get::<D>(param.id) {
                // In f32: an fp16 gradient's squares overflow fp16 long
                // before its norm is large.
                let sum = grad
                    .cast(burn::tensor::FloatDType::F32)
                    .square()
                    .sum()
                    .into_scalar::<f32>();
                self.total += f64::from(sum);
            }
        }
    }
    let mut sum = Sum {
        grads,
        skip,
        total: 0.0,
    };
    model.visit(&mut sum);
    sum.total
}

/// The factor `clip_grad_norm_` scales every gradient by for a global norm
/// of `norm` and a limit of `max_norm` (0: no clipping): `max_norm / (norm +
/// 1e-6)`, at most 1.
pub fn clip_factor(norm: f64, max_norm: f64) -> Option<f64> {
    if max_norm <= 0.0 {
        return None;
    }
    let factor = max_norm / (norm + CLIP_EPSILON);
    (factor < 1.0).then_some(factor)
}

/// Multiplies every gradient of `model`'s parameters in `grads` by `factor`.
pub fn scale_gradients(model: &TransformerLm, grads: &mut GradientsParams, factor: f64) {
    struct Scale<'a> {
        grads: &'a mut GradientsParams,
        factor: f64,
    }
    impl ModuleVisitor for Scale<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(grad) = self.grads.remove::<D>(param.id) {
                self.grads
                    .register(param.id, grad.mul_scalar(self.factor as f32));
            }
        }
    }
    model.visit(&mut Scale { grads, factor });
}

/// fp16's dynamic loss scale, as `torch.amp.GradScaler` keeps it: the loss
/// is multiplied by `scale` before backward so small gradients survive
/// fp16; a step whose gradients hold an inf or NaN is skipped and the scale
/// halved; after `GROWTH_INTERVAL` good steps in a row it doubles. Every
/// worker of a step sees the same global norm, so all keep the same scale;
/// checkpoints carry it.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LossScale {
    pub scale: f64,
    /// Good steps since the scale last changed.
    pub good_steps: u32,
}

impl Default for LossScale {
    /// GradScaler's `init_scale`.
    fn default() -> Self {
        LossScale {
            scale: 65536.0,
            good_steps: 0,
        }
    }
}

impl LossScale {
    /// GradScaler's `growth_interval`, `growth_factor` and `backoff_factor`.
    pub const GROWTH_INTERVAL: u32 = 2000;
    pub const GROWTH: f64 = 2.0;
    pub const BACKOFF: f64 = 0.5;

    /// The scale after a step whose gradients were `finite` (or not).
    pub fn after(self, finite: bool) -> LossScale {
        if !finite {
            return LossScale {
                scale: self.scale * Self::BACKOFF,
                good_steps: 0,
            };
        }
        if self.good_steps + 1 >= Self::GROWTH_INTERVAL {
            return LossScale {
                scale: self.scale * Self::GROWTH,
                good_steps: 0,
            };
        }
        LossScale {
            good_steps: self.good_steps + 1,
            ..self
        }
    }
}

/// Decoupled weight decay around any optimizer: before `inner`'s update,
/// a parameter of two or more dimensions is multiplied by `1 − lr·wd`
/// (biases and norm weights, one dimension, are left alone). burn's
/// `ModuleOptimizer` steps only the parameters with a gradient, so frozen
/// weights are never decayed. Inside [`super::Offloaded`] it decays the f32
/// master copy, the weights the update is computed from. The state is
/// `inner`'s, so checkpoints are unchanged.
#[derive(Clone, Debug)]
pub struct DecoupledDecay<O> {
    inner: O,
    weight_decay: f64,
}

impl<O> DecoupledDecay<O> {
    pub fn new(inner: O, weight_decay: f64) -> Self {
        Self {
            inner,
            weight_decay,
        }
    }
}

impl<O: Optimizer> Optimizer for DecoupledDecay<O> {
    type State<const D: usize> = O::State<D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<D>, Option<Self::State<D>>) {
        let tensor = if D >= 2 && self.weight_decay > 0.0 {
            tensor.mul_scalar(1.0 - lr * self.weight_decay)
        } else {
            tensor
        };
        self.inner.step(lr, tensor, grad, state)
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &Device) -> Self::State<D> {
        O::to_device(state, device)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Matrices decay by `1 − lr·wd` before the update, vectors do not:
    /// with a zero gradient, plain SGD leaves only the decay.
    #[test]
    fn decay_touches_matrices_only() {
        let device = Device::flex();
        let sgd = DecoupledDecay::new(burn::optim::SgdConfig::new().build(), 0.1);
        let matrix = Tensor::<2>::ones([2, 3], &device);
        let (decayed, _) = sgd.step(0.5, matrix.clone(), matrix.zeros_like(), None);
        let want = Tensor::<2>::full([2, 3], 0.95, &device);
        decayed
            .to_data()
            .assert_approx_eq::<f32>(&want.to_data(), burn::tensor::Tolerance::absolute(1e-7));
        let vector = Tensor::<1>::ones([3], &device);
        let (kept, _) = sgd.step(0.5, vector.clone(), vector.zeros_like(), None);
        kept.to_data()
            .assert_approx_eq::<f32>(&vector.to_data(), burn::tensor::Tolerance::absolute(0.0));
    }

    #[test]
    fn the_loss_scale_backs_off_and_grows_as_grad_scaler() {
        let start = LossScale::default();
        let skipped = start.after(false);
        assert_eq!((skipped.scale, skipped.good_steps), (32768.0, 0));
        let mut s = skipped;
        for _ in 0..LossScale::GROWTH_INTERVAL - 1 {
            s = s.after(true);
        }
        assert_eq!((s.scale, s.good_steps), (32768.0, 1999));
        let grown = s.after(true);
        assert_eq!((grown.scale, grown.good_steps), (65536.0, 0));
    }

    #[test]
    fn clipping_follows_clip_grad_norm() {
        assert_eq!(clip_factor(3.0, 0.0), None, "0 turns it off");
        assert_eq!(clip_factor(0.5, 1.0), None, "below the limit: untouched");
        let f = clip_factor(4.0, 1.0).expect("clipped");
        assert!((f - 1.0 / (4.0 + 1e-6)).abs() < 1e-15);
    }
}
