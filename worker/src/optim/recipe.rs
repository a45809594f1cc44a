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
//!   without decay and [`decay_matrices`] multiplies the matrices by
//!   `1 − lr·wd` before the update, as `torch.optim.AdamW` does (its update
//!   does not read the weights, so before or after is the same).

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;

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
                let sum = grad.square().sum().into_scalar::<f32>();
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

/// Decoupled weight decay: every parameter of two or more dimensions that
/// this step updates (has a gradient in `grads`) times `keep` (`1 − lr·wd`);
/// biases and norm weights (one dimension) untouched. Ids and autodiff state
/// are kept, as burn's optimizers keep them.
pub fn decay_matrices(model: TransformerLm, grads: &GradientsParams, keep: f64) -> TransformerLm {
    struct Decay<'a> {
        grads: &'a GradientsParams,
        keep: f32,
    }
    impl ModuleMapper for Decay<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            if D < 2 || self.grads.get::<D>(param.id).is_none() {
                return param;
            }
            let (id, tensor, mapper) = param.consume();
            if !tensor.is_autodiff() {
                return Param::from_mapped_value(id, tensor.mul_scalar(self.keep), mapper);
            }
            let require_grad = tensor.is_require_grad();
            let checkpointing = tensor.gradient_checkpointing_strategy();
            let decayed = tensor.inner().mul_scalar(self.keep);
            let mut value = Tensor::from_inner(decayed);
            if let Some(strategy) = checkpointing {
                value = value.with_gradient_checkpointing_strategy(strategy);
            }
            if require_grad {
                value = value.require_grad();
            }
            Param::from_mapped_value(id, value, mapper)
        }
    }
    if keep == 1.0 {
        return model;
    }
    model.map(&mut Decay {
        grads,
        keep: keep as f32,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clipping_follows_clip_grad_norm() {
        assert_eq!(clip_factor(3.0, 0.0), None, "0 turns it off");
        assert_eq!(clip_factor(0.5, 1.0), None, "below the limit: untouched");
        let f = clip_factor(4.0, 1.0).expect("clipped");
        assert!((f - 1.0 / (4.0 + 1e-6)).abs() < 1e-15);
    }
}
