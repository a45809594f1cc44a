//! Optimizer state kept in host memory, and the step run there: the
//! `offloadOptimizer` rung for GPU workers (ZeRO-Offload's split, one
//! parameter tensor at a time).
//!
//! [`Offloaded`] wraps any per-parameter burn [`Optimizer`]. For each
//! parameter burn's `ModuleOptimizer` hands it the weights and gradient on
//! the training device; it moves both to the host device (flex), runs the
//! wrapped optimizer's update there with state that never leaves the host,
//! and sends the updated weights back. The device then holds weights and
//! gradients only; the host holds the optimizer state and, when the device
//! trains in a half precision, an f32 master copy of the weights (the
//! update is computed in f32 and the device gets it rounded to its dtype,
//! so small updates are not lost to bf16 rounding). Device memory in flight
//! is one parameter's f32 copy at a time.
//!
//! The record is the wrapped optimizer's, leaf for leaf, plus an optional
//! `offload_master` leaf: a checkpoint written with offload resumes without
//! it and the other way round (a retry can turn offload on mid-job).
//!
//! Compact ([`Offloaded::compact`], the plan's `compactHostState`): in a
//! half precision the host keeps, instead of the f32 master, its remainder
//! below the device's weights in bf16 (`offload_master_remainder`): the
//! master is the weights plus the remainder, about 16 significant bits
//! over bf16 weights and 19 over fp16 instead of f32's 24 (the compensated
//! bf16 training of Zamirai et al., 2020, "Revisiting BFloat16 Training").
//! Small updates still accumulate below the weights' rounding; the host
//! keeps 2 bytes a value instead of 4. A checkpoint of either kind resumes
//! in the other (the master is rebuilt from the weights, or split).
//!
//! On a CPU worker the device is the host: offloading has nothing to move,
//! and the planner never asks for it there.
//!
//! The same wrapper with the training device as its `host` is how a bf16 or
//! fp16 stage keeps mixed precision without offload
//! (`crate::train::build_optimizer`): nothing moves, and the f32 master
//! copy and the f32 moments stay on the device beside the half-precision
//! weights, as PyTorch's mixed precision keeps them.

use burn::optim::{LearningRate, Optimizer, RecordState, StateSink, StateSource};
use burn::tensor::{DType, Device, FloatDType, Tensor};

/// `inner`, with its state and its step on `host`.
#[derive(Clone, Debug)]
pub struct Offloaded<O> {
    inner: O,
    host: Device,
    compact: bool,
}

impl<O> Offloaded<O> {
    /// `inner` stepping on the host device `host` (the worker passes `Device::flex()`).
    pub fn new(inner: O, host: Device) -> Self {
        Self {
            inner,
            host,
            compact: false,
        }
    }

    /// Half-precision weights keep a bf16 remainder on the host instead of
    /// an f32 master (see the module docs).
    pub fn compact(mut self, compact: bool) -> Self {
        self.compact = compact;
        self
    }
}

/// One parameter's host-side state: the wrapped optimizer's, and when the
/// device trains in a half precision the f32 master weights, or (compact)
/// the master's bf16 remainder below the weights.
#[derive(Clone, Debug)]
pub struct OffloadedState<S, const D: usize> {
    pub inner: Option<S>,
    pub master: Option<Tensor<D>>,
    pub remainder: Option<Tensor<D>>,
}

const MASTER_LEAF: &str = "offload_master";
const REMAINDER_LEAF: &str = "offload_master_remainder";

impl<S: RecordState + Clone, const D: usize> RecordState for OffloadedState<S, D> {
    fn state_flatten(&self, prefix: &str, out: &mut StateSink) {
        if let Some(inner) = &self.inner {
            inner.state_flatten(prefix, out);
        }
        if let Some(master) = &self.master {
            out.push_tensor(prefix, MASTER_LEAF, master.to_data());
        }
        if let Some(remainder) = &self.remainder {
            out.push_tensor(prefix, REMAINDER_LEAF, remainder.to_data());
        }
    }

    fn state_unflatten(prefix: &str, src: &mut StateSource, device: &Device) -> Option<Self> {
        let master = src
            .take_tensor(prefix, MASTER_LEAF)
            .map(|data| Tensor::from_data(data, device));
        let remainder = src
            .take_tensor(prefix, REMAINDER_LEAF)
            .map(|data| Tensor::from_data(data, device));
        let inner = S::state_unflatten(prefix, src, device);
        (inner.is_some() || master.is_some() || remainder.is_some()).then_some(Self {
            inner,
            master,
            remainder,
        })
    }
}

impl<O: Optimizer> Optimizer for Offloaded<O> {
    type State<const D: usize> = OffloadedState<O::State<D>, D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<D>, Option<Self::State<D>>) {
        let device = tensor.device();
        let dtype = tensor.dtype();
        let half = dtype != DType::F32;
        let (inner, master, remainder) = match state {
            // A state restored from a checkpoint lands on the default
            // device; move it once, later steps find it on the host.
            Some(s) => (
                s.inner.map(|i| O::to_device(i, &self.host)),
                s.master.map(|m| m.to_device(&self.host)),
                s.remainder.map(|r| r.to_device(&self.host)),
            ),
            None => (None, None, None),
        };
        // Cast on the device, where the tensor is, so the host backend only
        // ever sees f32 (and the compact remainder's bf16).
        let weights = match (master.filter(|_| half), remainder.filter(|_| half)) {
            (Some(m), _) => m,
            (None, Some(r)) => tensor
                .cast(FloatDType::F32)
                .to_device(&self.host)
                .add(r.cast(FloatDType::F32)),
            (None, None) => tensor.cast(FloatDType::F32).to_device(&self.host),
        };
        let grad = grad.cast(FloatDType::F32).to_device(&self.host);
        let (updated, inner) = self.inner.step(lr, weights, grad, inner);
        let (on_device, master, remainder) = if half && self.compact {
            // Rounded on the host, so the remainder is below exactly the
            // weights the device gets.
            let rounded = updated.clone().cast(FloatDType::from(dtype));
            let remainder = updated
                .sub(rounded.clone().cast(FloatDType::F32))
                .cast(FloatDType::BF16);
            let on_device = Tensor::from_data(rounded.into_data(), (&device, dtype));
            (on_device, None, Some(remainder))
        } else {
            let on_device = updated
                .clone()
                .to_device(&device)
                .cast(FloatDType::from(dtype));
            (on_device, half.then_some(updated), None)
        };
        let state = (inner.is_some() || master.is_some() || remainder.is_some()).then_some(
            OffloadedState {
                inner,
                master,
                remainder,
            },
        );
        (on_device, state)
    }

    /// The state stays on the host whatever device the parameter is on
    /// (`ModuleOptimizer` asks to move it to the gradient's device before
    /// every step).
    fn to_device<const D: usize>(state: Self::State<D>, _device: &Device) -> Self::State<D> {
        state
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::optim::{AdamWConfig, ModuleOptimizer, SgdConfig};
    use burn::tensor::Distribution;

    fn pair(device: &Device) -> (Tensor<2>, Tensor<2>) {
        crate::model::with_generator(|| {
            let w = Tensor::<2>::random([8, 16], Distribution::Normal(0.0, 1.0), device);
            let g = Tensor::<2>::random([8, 16], Distribution::Normal(0.0, 0.1), device);
            (w, g)
        })
    }

    /// Offloaded AdamW gives burn's AdamW's weights step for step.
    #[test]
    fn offloaded_step_equals_the_wrapped_step() {
        let device = Device::flex();
        let plain = AdamWConfig::new().build();
        let offloaded = Offloaded::new(plain.clone(), Device::flex());
        let (mut w_plain, _) = pair(&device);
        let mut w_off = w_plain.clone();
        let (mut s_plain, mut s_off) = (None, None);
        for _ in 0..3 {
            let (_, g) = pair(&device);
            let (w, s) = plain.step(1e-2, w_plain, g.clone(), s_plain);
            (w_plain, s_plain) = (w, s);
            let (w, s) = offloaded.step(1e-2, w_off, g, s_off);
            (w_off, s_off) = (w, s);
        }
        let s = s_off.expect("adamw keeps state");
        assert!(s.inner.is_some());
        assert!(s.master.is_none(), "f32 weights need no master copy");
        w_plain
            .to_data()
            .assert_approx_eq::<f32>(&w_off.to_data(), burn::tensor::Tolerance::absolute(0.0));
    }

    /// The record is the wrapped optimizer's: a checkpoint of either loads
    /// into the other (offload turned on or off by a retry).
    #[test]
    fn record_is_the_wrapped_optimizers() {
        let device = Device::flex();
        let plain = AdamWConfig::new().build();
        let offloaded = Offloaded::new(plain.clone(), Device::flex());
        let (w, g) = pair(&device);
        let (_, s) = offloaded.step(1e-2, w, g, None);
        let mut sink = StateSink::default();
        s.expect("state").state_flatten("p", &mut sink);
        let mut names: Vec<&str> = sink.tensors.iter().map(|(n, _)| n.as_str()).collect();
        names.sort();
        let (w, g) = pair(&device);
        let (_, plain_state) = plain.step(1e-2, w, g, None);
        let mut plain_sink = StateSink::default();
        plain_state
            .expect("state")
            .state_flatten("p", &mut plain_sink);
        let mut plain_names: Vec<&str> =
            plain_sink.tensors.iter().map(|(n, _)| n.as_str()).collect();
        plain_names.sort();
        assert_eq!(names, plain_names);

        let mut src = StateSource::new(plain_sink.scalars.into_iter().collect());
        for (name, data) in plain_sink.tensors {
            src.insert_tensor(name, data);
        }
        let restored = <OffloadedState<burn::optim::AdamWState<2>, 2>>::state_unflatten(
            "p", &mut src, &device,
        )
        .expect("a plain AdamW record restores as offloaded state");
        assert!(restored.inner.is_some() && restored.master.is_none());
    }

    /// bf16 weights on the device: the host keeps an f32 master copy, the
    /// update is computed in f32 from it, and the device gets it rounded.
    #[test]
    fn half_weights_step_in_f32_on_a_master_copy() {
        let device = Device::flex();
        let adamw = AdamWConfig::new().build();
        let offloaded = Offloaded::new(adamw.clone(), Device::flex());
        let (w, _) = pair(&device);
        let mut on_device = w.cast(FloatDType::BF16);
        let mut reference = on_device.clone().cast(FloatDType::F32);
        let (mut s_ref, mut s_off) = (None, None);
        for _ in 0..3 {
            let (_, g) = pair(&device);
            let g = g.cast(FloatDType::BF16);
            let (r, s) = adamw.step(1e-4, reference, g.clone().cast(FloatDType::F32), s_ref);
            (reference, s_ref) = (r, s);
            let (d, s) = offloaded.step(1e-4, on_device, g, s_off);
            (on_device, s_off) = (d, s);
        }
        assert_eq!(on_device.dtype(), DType::BF16);
        let master = s_off
            .and_then(|s| s.master)
            .expect("a master copy for bf16 weights");
        assert_eq!(master.dtype(), DType::F32);
        let exact = burn::tensor::Tolerance::absolute(0.0);
        master
            .to_data()
            .assert_approx_eq::<f32>(&reference.to_data(), exact);
        on_device
            .cast(FloatDType::F32)
            .to_data()
            .assert_approx_eq::<f32>(
                &reference
                    .cast(FloatDType::BF16)
                    .cast(FloatDType::F32)
                    .to_data(),
                exact,
            );
    }

    /// Compact: bf16 (and fp16) weights keep a bf16 remainder below them
    /// instead of an f32 master. A remainder is at most half a bf16 ulp of its weight
    /// (2^-9 of it) and is itself rounded to 2^-9 of that, so each step may
    /// move the rebuilt master off the f32 one by 2^-18 of the weight:
    /// [`remainder_bound`] over the steps. At a learning rate of 1e-3 each
    /// step is below half a bf16 ulp of most of these weights (N(0, 1)),
    /// so bf16 alone would keep few of them; with the remainder they add
    /// up, and the device's weights are the f32 master's rounding but for
    /// a few values at a rounding boundary.
    #[test]
    fn compact_half_weights_keep_their_small_steps_in_a_remainder() {
        for dtype in [FloatDType::BF16, FloatDType::F16] {
            compact_steps(dtype);
        }
    }

    fn compact_steps(dtype: FloatDType) {
        let device = Device::flex();
        let adamw = AdamWConfig::new().build();
        let full = Offloaded::new(adamw.clone(), Device::flex());
        let compact = Offloaded::new(adamw, Device::flex()).compact(true);
        let (w, _) = pair(&device);
        let start = w.cast(dtype);
        let (mut w_full, mut w_compact) = (start.clone(), start.clone());
        let (mut s_full, mut s_compact) = (None, None);
        for _ in 0..40 {
            let (_, g) = pair(&device);
            let g = g.cast(dtype);
            (w_full, s_full) = full.step(1e-3, w_full, g.clone(), s_full);
            (w_compact, s_compact) = compact.step(1e-3, w_compact, g, s_compact);
        }
        let s = s_compact.expect("state");
        assert!(s.master.is_none(), "no f32 master");
        let remainder = s.remainder.expect("a remainder");
        assert_eq!(remainder.dtype(), DType::BF16);
        assert_eq!(w_compact.dtype(), DType::from(dtype));
        let master = s_full.and_then(|s| s.master).expect("f32 master");
        let rebuilt = w_compact
            .clone()
            .cast(FloatDType::F32)
            .add(remainder.cast(FloatDType::F32));
        let scale = master.clone().abs().max().into_scalar::<f32>();
        let gap = rebuilt.sub(master).abs().max().into_scalar::<f32>() / scale;
        println!("{dtype:?} compact master: largest gap {gap:e} of the largest weight");
        assert!(gap <= remainder_bound(40), "{dtype:?}: gap {gap:e}");
        let moved = |w: &Tensor<2>| {
            w.clone()
                .cast(FloatDType::F32)
                .not_equal(start.clone().cast(FloatDType::F32))
                .int()
                .sum()
                .into_scalar::<i64>()
        };
        let moved_compact = moved(&w_compact);
        let differ = w_compact
            .cast(FloatDType::F32)
            .not_equal(w_full.clone().cast(FloatDType::F32))
            .int()
            .sum()
            .into_scalar::<i64>();
        println!(
            "{dtype:?} moved: {moved_compact} compact, {} with the f32 master; {differ} of 128 differ",
            moved(&w_full)
        );
        assert!(differ <= 4, "{dtype:?}: {differ} weights differ");
        assert!(
            moved_compact > 64 && moved(&w_full) > 64,
            "{dtype:?}: the steps reach the weights"
        );
    }

    /// Either record resumes in the other: the f32 master is split into a
    /// remainder, and a remainder rebuilds the master; the second step's
    /// master is the same either way (within [`remainder_bound`] of two
    /// steps), moments included.
    #[test]
    fn compact_and_full_records_resume_in_each_other() {
        let device = Device::flex();
        let adamw = AdamWConfig::new().build();
        let full = Offloaded::new(adamw.clone(), Device::flex());
        let compact = Offloaded::new(adamw, Device::flex()).compact(true);
        let (w, g) = pair(&device);
        let w = w.cast(FloatDType::BF16);
        let g = g.cast(FloatDType::BF16);
        let (w_full, s_full) = full.step(1e-4, w.clone(), g.clone(), None);
        let (w_compact, s_compact) = compact.step(1e-4, w, g.clone(), None);
        let master = |w: Tensor<2>, s: Option<OffloadedState<_, 2>>| {
            let s = s.expect("state");
            assert!(s.inner.is_some(), "the moments carried over");
            match (s.master, s.remainder) {
                (Some(m), None) => m,
                (None, Some(r)) => w.cast(FloatDType::F32).add(r.cast(FloatDType::F32)),
                other => panic!("one of master and remainder: {other:?}"),
            }
        };
        let (a, sa) = compact.step(1e-4, w_full.clone(), g.clone(), s_full.clone());
        let (b, sb) = full.step(1e-4, w_compact.clone(), g.clone(), s_compact.clone());
        let (c, sc) = full.step(1e-4, w_full, g.clone(), s_full);
        let (d, sd) = compact.step(1e-4, w_compact, g, s_compact);
        let reference = master(c, sc);
        let scale = reference.clone().abs().max().into_scalar::<f32>();
        for (what, w, s) in [
            ("full → compact", a, sa),
            ("compact → full", b, sb),
            ("compact → compact", d, sd),
        ] {
            let gap = master(w, s)
                .sub(reference.clone())
                .abs()
                .max()
                .into_scalar::<f32>()
                / scale;
            println!("{what}: master gap {gap:e}");
            assert!(gap <= remainder_bound(2), "{what}: gap {gap:e}");
        }
    }

    /// The most a compact master may drift from the f32 one in `steps`
    /// steps, relative to the largest weight: 2^-18 a step (see above).
    fn remainder_bound(steps: u32) -> f32 {
        steps as f32 * 2f32.powi(-18)
    }

    /// A stateless optimizer (plain SGD) keeps no tensors on the host either.
    #[test]
    fn stateless_inner_keeps_nothing() {
        let device = Device::flex();
        let offloaded = Offloaded::new(SgdConfig::new().build(), Device::flex());
        let (w, g) = pair(&device);
        let (_, s) = offloaded.step(1e-2, w, g, None);
        let mut sink = StateSink::default();
        if let Some(s) = s {
            assert!(s.master.is_none());
            s.state_flatten("p", &mut sink);
        }
        assert!(
            sink.tensors.is_empty(),
            "no tensors kept: {:?}",
            sink.tensors
        );
        // And it wraps into a whole-module optimizer.
        let _ = ModuleOptimizer::from(offloaded);
    }
}
