//! Gradients kept in host memory as backward produces them: the
//! `offloadGradients` rung (DeepSpeed ZeRO-Offload's gradient path), with
//! the optimizer state and step already on the host ([`super::Offloaded`]).
//!
//! The checkpointed backward (`crate::train`) hands each block's gradients
//! to [`HostGradients::accumulate`] as soon as the block's recomputation has
//! produced them: each tensor is copied to the host in the precision it was
//! computed in (bf16/fp16 on the wire on a GPU) and summed there in f32
//! across the step's micro-batches, so the device holds no gradient beyond
//! the block in flight. The head's and the embedding's gradients take the
//! same path, so a step's gradients are all on one device, the host; the
//! tied-embedding exchange between stages, the replicas' reduce-scatter and
//! the clipping then run on the host sums as they run on device gradients
//! without the rung.
//!
//! The update goes one block at a time ([`HostGradients::part_on_device`]):
//! burn's `ModuleOptimizer` steps a parameter on its gradient's device (it
//! moves the weight to the gradient otherwise), so a block's sums go back to
//! the device in the training precision, [`super::Offloaded`] takes each
//! tensor to the host in f32 for its update and returns the weights in the
//! training precision. The device holds one block's gradients during the
//! step; the price is one more copy of each gradient each way, which a
//! step reading the host sums directly would save (it needs the optimizer
//! state outside burn's `ModuleOptimizer`).
//!
//! Compact ([`HostGradients::compact`], the plan's `compactHostState`): the
//! sums stay in the precision the gradients arrive in (bf16/fp16), added as
//! the device accumulator adds them without the offload, at 2 bytes a value
//! instead of 4; fp16's overflow shows as a non-finite norm, which the loss
//! scale's skipped step handles.
//!
//! On a CPU worker the host is the device: the copies move nothing across a
//! bus, and the sums are the device accumulator's, addition for addition
//! (`tests/gradient_offload.rs`).

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{DType, Device, Tensor};

/// A step's gradient sums in host memory (f32), by parameter.
pub struct HostGradients {
    host: Device,
    /// Sums in the gradients' own dtype instead of f32.
    compact: bool,
    sums: GradientsParams,
    /// The device and dtype the gradients were computed on and in: where
    /// and how the step sends them back ([`Self::part_on_device`]).
    origin: Option<(Device, DType)>,
}

impl std::fmt::Debug for HostGradients {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostGradients")
            .field("host", &self.host)
            .field("tensors", &self.sums.len())
            .field("origin", &self.origin)
            .finish()
    }
}

impl HostGradients {
    /// Sums on `host` (the worker passes `Device::flex()`).
    pub fn new(host: Device) -> Self {
        HostGradients {
            host,
            compact: false,
            sums: GradientsParams::new(),
            origin: None,
        }
    }

    /// Sums kept in the precision the gradients arrive in (see the module docs).
    pub fn compact(mut self, compact: bool) -> Self {
        self.compact = compact;
        self
    }

    /// Moves the gradients of `module`'s parameters out of `grads` (device
    /// tensors, as backward made them) into the host sums, one tensor at a
    /// time, each added after the sum so far (as burn's
    /// `GradientsAccumulator` adds). Gradients of other parameters in
    /// `grads` are dropped.
    pub fn accumulate<M: Module>(&mut self, module: &M, grads: GradientsParams) {
        struct Move<'a> {
            from: GradientsParams,
            into: &'a mut HostGradients,
        }
        impl ModuleVisitor for Move<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                let Some(grad) = self.from.remove::<D>(param.id) else {
                    return;
                };
                let into = &mut *self.into;
                into.origin
                    .get_or_insert_with(|| (grad.device(), grad.dtype()));
                let grad = if into.compact {
                    let dtype = grad.dtype();
                    Tensor::from_data(grad.into_data(), (&into.host, dtype))
                } else {
                    to_host(grad, &into.host)
                };
                let sum = match into.sums.remove::<D>(param.id) {
                    Some(sum) => sum.add(grad),
                    None => grad,
                };
                into.sums.register(param.id, sum);
            }
        }
        module.visit(&mut Move {
            from: grads,
            into: self,
        });
    }

    /// The step's sums (host tensors, f32 unless compact), leaving none behind, and
    /// the device and dtype they came from (`None` when nothing was added).
    pub fn take(&mut self) -> (GradientsParams, Option<(Device, DType)>) {
        (
            std::mem::replace(&mut self.sums, GradientsParams::new()),
            self.origin.take(),
        )
    }

    /// Removes the gradients of `part`'s parameters from `grads` (host sums)
    /// and returns them on `device` in `dtype`, the training precision: what
    /// burn's optimizer steps that part with.
    pub fn part_on_device<M: Module>(
        grads: &mut GradientsParams,
        part: &M,
        (device, dtype): &(Device, DType),
    ) -> GradientsParams {
        struct Take<'a> {
            from: &'a mut GradientsParams,
            into: GradientsParams,
            device: &'a Device,
            dtype: DType,
        }
        impl ModuleVisitor for Take<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                if let Some(grad) = self.from.remove::<D>(param.id) {
                    // Rounded to the training precision on the host, so
                    // that is what crosses the bus.
                    let grad = Tensor::<D>::from_data(grad.into_data(), (self.device, self.dtype));
                    self.into.register(param.id, grad);
                }
            }
        }
        let mut take = Take {
            from: grads,
            into: GradientsParams::new(),
            device,
            dtype: *dtype,
        };
        part.visit(&mut take);
        take.into
    }
}

/// `tensor` as an f32 tensor on `host`: its data read from its device in
/// its own dtype, widened on the host.
pub fn to_host<const D: usize>(tensor: Tensor<D>, host: &Device) -> Tensor<D> {
    Tensor::from_data(tensor.into_data(), (host, DType::F32))
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::nn::{Linear, LinearConfig};
    use burn::optim::GradientsAccumulator;
    use burn::tensor::Distribution;

    fn grads(layer: &Linear, device: &Device) -> GradientsParams {
        let x = Tensor::<2>::random([3, 4], Distribution::Normal(0.0, 1.0), device);
        GradientsParams::from_grads(layer.forward(x).sum().backward(), layer)
    }

    /// Three micro-batches summed on the host give the device
    /// accumulator's sums bit for bit, and go back to the device whole.
    #[test]
    fn host_sums_equal_the_device_accumulators() {
        let device = Device::flex().autodiff();
        let layer = crate::model::with_generator(|| LinearConfig::new(4, 5).init(&device));
        let mut on_device = GradientsAccumulator::<Linear>::new();
        let mut on_host = HostGradients::new(Device::flex());
        for _ in 0..3 {
            let g = crate::model::with_generator(|| grads(&layer, &device));
            let mut twin = GradientsParams::new();
            let id = layer.weight.id;
            twin.register::<2>(id, g.get::<2>(id).expect("weight grad"));
            let bias = layer.bias.as_ref().expect("bias").id;
            twin.register::<1>(bias, g.get::<1>(bias).expect("bias grad"));
            on_device.accumulate(&layer, g);
            on_host.accumulate(&layer, twin);
        }
        let expected = on_device.grads();
        let (mut sums, origin) = on_host.take();
        let origin = origin.expect("gradients were added");
        let back = HostGradients::part_on_device(&mut sums, &layer, &origin);
        assert!(sums.is_empty(), "every sum went back");
        let id = layer.weight.id;
        let exact = burn::tensor::Tolerance::absolute(0.0);
        expected
            .get::<2>(id)
            .expect("device sum")
            .into_data()
            .assert_approx_eq::<f32>(&back.get::<2>(id).expect("host sum").into_data(), exact);
    }

    /// Compact: bf16 gradients are summed in bf16, as the device
    /// accumulator sums them, bit for bit; the default widens them to f32.
    #[test]
    fn compact_sums_stay_in_the_gradients_precision() {
        use burn::tensor::FloatDType;
        let device = Device::flex().autodiff();
        let layer = crate::model::with_generator(|| LinearConfig::new(4, 5).init(&device));
        let id = layer.weight.id;
        let mut on_device = GradientsAccumulator::<Linear>::new();
        let mut compact = HostGradients::new(Device::flex()).compact(true);
        let mut wide = HostGradients::new(Device::flex());
        let mut exact_f32 = None::<Tensor<2>>;
        for _ in 0..5 {
            let g = crate::model::with_generator(|| grads(&layer, &device))
                .get::<2>(id)
                .expect("weight grad")
                .cast(FloatDType::BF16);
            exact_f32 = Some(match exact_f32 {
                Some(sum) => sum.add(g.clone().cast(FloatDType::F32)),
                None => g.clone().cast(FloatDType::F32),
            });
            for into in [&mut compact, &mut wide] {
                let mut one = GradientsParams::new();
                one.register::<2>(id, g.clone());
                into.accumulate(&layer, one);
            }
            let mut one = GradientsParams::new();
            one.register::<2>(id, g);
            on_device.accumulate(&layer, one);
        }
        let device_sum = on_device.grads().get::<2>(id).expect("device sum");
        let (sums, origin) = compact.take();
        assert_eq!(origin.map(|o| o.1), Some(DType::BF16));
        let compact_sum = sums.get::<2>(id).expect("compact sum");
        assert_eq!(compact_sum.dtype(), DType::BF16, "2 bytes a value");
        let exact = burn::tensor::Tolerance::absolute(0.0);
        device_sum
            .cast(FloatDType::F32)
            .into_data()
            .assert_approx_eq::<f32>(&compact_sum.cast(FloatDType::F32).into_data(), exact);
        let (sums, _) = wide.take();
        let wide_sum = sums.get::<2>(id).expect("f32 sum");
        assert_eq!(wide_sum.dtype(), DType::F32);
        wide_sum
            .into_data()
            .assert_approx_eq::<f32>(&exact_f32.expect("summed").into_data(), exact);
    }
}
