//! AdamW with 8-bit moments, the block-wise scheme of bitsandbytes'
//! `AdamW8bit`: both moments of a parameter with at least
//! `min_8bit_elements` elements (bitsandbytes' `min_8bit_size`, 4096) are
//! kept as one `u8` code per element plus one f32 absmax per block of 256
//! ([`crate::optim::blockwise`]); smaller parameters (norms, biases) keep f32
//! moments. A step dequantizes, updates the moments in f32, applies the
//! update, and quantizes the new moments again. The update itself — bias
//! correction, ε outside the square root, decoupled weight decay — is burn's
//! `AdamW`, line for line, so with f32 moments the two agree exactly.
//!
//! It is a burn [`Optimizer`]: per-parameter state, so burn's
//! `ModuleOptimizer` gives it gradient clipping, any module, and the
//! optimizer record (codes saved as `u8`) that checkpoints save and resume.

use burn::config::Config;
use burn::optim::grad_clipping::GradientClippingConfig;
use burn::optim::{LearningRate, ModuleOptimizer, Optimizer, RecordState, StateSink, StateSource};
use burn::tensor::{Device, Int, IntDType, Tensor};

use super::blockwise::{BLOCK, DynamicMap, Quantized, padded};

/// [`AdamW8bit`]'s configuration; the defaults are burn's `AdamWConfig`'s
/// plus bitsandbytes' 8-bit threshold.
#[derive(Config, Debug)]
pub struct AdamW8bitConfig {
    #[config(default = 0.9)]
    pub beta_1: f32,
    #[config(default = 0.999)]
    pub beta_2: f32,
    /// Added to √v̂ (burn's default, not bitsandbytes' 1e-8).
    #[config(default = 1e-5)]
    pub epsilon: f32,
    /// Decoupled: each step multiplies the weights by `1 − lr × weight_decay`.
    #[config(default = 1e-4)]
    pub weight_decay: f32,
    /// Parameters with fewer elements keep f32 moments (bitsandbytes'
    /// `min_8bit_size`; the planner's `OPTIMIZER_8BIT_MIN_ELEMENTS`).
    #[config(default = 4096)]
    pub min_8bit_elements: usize,
    /// Blocks of a large parameter stepped at once (see [`AdamW8bit`]'s
    /// step): bounds the step's f32 and index temporaries to this many
    /// blocks instead of the whole parameter (the planner's
    /// `OPTIMIZER_8BIT_STEP_CHUNK_ELEMENTS`).
    #[config(default = 1024)]
    pub step_chunk_blocks: usize,
    pub grad_clipping: Option<GradientClippingConfig>,
}

impl AdamW8bitConfig {
    /// The bare per-parameter optimizer.
    pub fn build(&self) -> AdamW8bit {
        AdamW8bit {
            beta_1: self.beta_1,
            beta_2: self.beta_2,
            epsilon: self.epsilon,
            weight_decay: self.weight_decay,
            min_8bit_elements: self.min_8bit_elements,
            step_chunk_blocks: self.step_chunk_blocks.max(1),
            first_map: DynamicMap::signed(),
            second_map: DynamicMap::unsigned(),
        }
    }

    /// The whole-module optimizer, with the configured gradient clipping.
    pub fn init(&self) -> ModuleOptimizer {
        let mut optimizer = ModuleOptimizer::from(self.build());
        if let Some(clipping) = &self.grad_clipping {
            optimizer = optimizer.with_grad_clipping(clipping.init());
        }
        optimizer
    }
}

/// AdamW whose moments are stored in 8 bits (see the module docs).
#[derive(Clone, Debug)]
pub struct AdamW8bit {
    beta_1: f32,
    beta_2: f32,
    epsilon: f32,
    weight_decay: f32,
    min_8bit_elements: usize,
    step_chunk_blocks: usize,
    first_map: DynamicMap,
    second_map: DynamicMap,
}

/// One parameter's moments.
// The quantized variant carries two code tensors and their scales; one
// value exists per parameter, so boxing it would save nothing worth a
// pointer chase in every step.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug)]
pub enum Moments<const D: usize> {
    /// f32, the parameter's shape (parameters under `min_8bit_elements`).
    Full { first: Tensor<D>, second: Tensor<D> },
    /// Block-quantized: the first moment with the signed map, the second
    /// with the unsigned one, both over the flattened, zero-padded parameter.
    Blockwise { first: Quantized, second: Quantized },
}

/// One parameter's state: the steps taken and the moments.
#[derive(Clone, Debug)]
pub struct AdamW8bitState<const D: usize> {
    pub time: usize,
    pub moments: Moments<D>,
}

impl<const D: usize> AdamW8bitState<D> {
    /// Bytes the moments hold (codes, block scales or f32 tensors).
    pub fn bytes(&self) -> usize {
        match &self.moments {
            Moments::Full { first, second } => [first, second]
                .iter()
                .map(|t| t.shape().num_elements() * t.dtype().size())
                .sum(),
            Moments::Blockwise { first, second } => first.bytes() + second.bytes(),
        }
    }
}

impl AdamW8bit {
    /// Burn's `AdamW` moment update: `m ← β₁m + (1−β₁)g`, `v ← β₂v + (1−β₂)g²`.
    fn moments<const N: usize>(
        &self,
        grad: Tensor<N>,
        previous: Option<(Tensor<N>, Tensor<N>)>,
    ) -> (Tensor<N>, Tensor<N>) {
        let first = grad.clone().mul_scalar(1.0 - self.beta_1);
        let second = grad.square().mul_scalar(1.0 - self.beta_2);
        match previous {
            Some((m, v)) => (
                m.mul_scalar(self.beta_1).add(first),
                v.mul_scalar(self.beta_2).add(second),
            ),
            None => (first, second),
        }
    }

    /// Burn's `AdamW` direction: `m̂ / (√v̂ + ε)` with bias-corrected moments.
    fn direction<const N: usize>(&self, m: Tensor<N>, v: Tensor<N>, time: usize) -> Tensor<N> {
        let time = time as i32;
        let m = m.div_scalar(1f32 - self.beta_1.powi(time));
        let v = v.div_scalar(1f32 - self.beta_2.powi(time));
        m.div(v.sqrt().add_scalar(self.epsilon))
    }
}

impl Optimizer for AdamW8bit {
    type State<const D: usize> = AdamW8bitState<D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<D>, Option<Self::State<D>>) {
        let time = state.as_ref().map_or(1, |s| s.time + 1);
        let elements = tensor.shape().num_elements();
        let (direction, moments) = if elements < self.min_8bit_elements {
            let previous = state.map(|s| match s.moments {
                Moments::Full { first, second } => (first, second),
                Moments::Blockwise { .. } => unreachable!("a small parameter's moments are f32"),
            });
            let (m, v) = self.moments(grad, previous);
            let direction = self.direction(m.clone(), v.clone(), time);
            (
                direction,
                Moments::Full {
                    first: m,
                    second: v,
                },
            )
        } else {
            let shape = tensor.shape();
            let previous = state.map(|s| match s.moments {
                Moments::Blockwise { first, second } => (first, second),
                Moments::Full { .. } => unreachable!("a large parameter's moments are 8-bit"),
            });
            // Padding is zero in the gradient, so zero in both moments and the direction.
            let grad = padded(grad);
            // A slice of whole blocks at a time: every operation is per
            // element or per block, so the result is the whole tensor's, bit
            // for bit, while the f32 moments, the direction's intermediates
            // and quantize's i64 indices (tens of bytes an element in all)
            // exist for one slice only, not for a whole embedding at once
            // (a 2 × 768 model with a 16k vocabulary, 12.6M elements in its
            // embedding, was killed at its first 8-bit step otherwise).
            let blocks = Quantized::blocks(elements);
            let mut directions = vec![];
            let (mut firsts, mut seconds) = (vec![], vec![]);
            for from in (0..blocks).step_by(self.step_chunk_blocks) {
                let to = (from + self.step_chunk_blocks).min(blocks);
                let g = grad.clone().slice(from * BLOCK..to * BLOCK);
                let previous = previous.as_ref().map(|(m, v)| {
                    (
                        m.blocks_range(from, to).dequantize(&self.first_map),
                        v.blocks_range(from, to).dequantize(&self.second_map),
                    )
                });
                let (m, v) = self.moments(g, previous);
                directions.push(self.direction(m.clone(), v.clone(), time));
                firsts.push(Quantized::quantize(m, &self.first_map));
                seconds.push(Quantized::quantize(v, &self.second_map));
            }
            let direction = Tensor::cat(directions, 0).slice(0..elements).reshape(shape);
            let moments = Moments::Blockwise {
                first: Quantized::cat(firsts),
                second: Quantized::cat(seconds),
            };
            (direction, moments)
        };
        // Burn's AdamW: decoupled weight decay, then the step.
        let decay_rate = lr * f64::from(self.weight_decay);
        let decayed = if decay_rate == 0.0 {
            tensor
        } else {
            tensor.mul_scalar(1.0 - decay_rate)
        };
        let updated = decayed - direction.mul_scalar(lr);
        (updated, Some(AdamW8bitState { time, moments }))
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &Device) -> Self::State<D> {
        let moments = match state.moments {
            Moments::Full { first, second } => Moments::Full {
                first: first.to_device(device),
                second: second.to_device(device),
            },
            Moments::Blockwise { first, second } => Moments::Blockwise {
                first: first.to_device(device),
                second: second.to_device(device),
            },
        };
        AdamW8bitState {
            time: state.time,
            moments,
        }
    }
}

/// Record leaves: `time`; `first`/`second` (f32) or
/// `first_codes`/`first_absmax`/`second_codes`/`second_absmax` (u8 codes, f32 scales).
impl<const D: usize> RecordState for AdamW8bitState<D> {
    fn state_flatten(&self, prefix: &str, out: &mut StateSink) {
        out.push_scalar(prefix, "time", burn_pack::Scalar::from(self.time));
        match &self.moments {
            Moments::Full { first, second } => {
                out.push_tensor(prefix, "first", first.to_data());
                out.push_tensor(prefix, "second", second.to_data());
            }
            Moments::Blockwise { first, second } => {
                out.push_tensor(prefix, "first_codes", first.codes.to_data());
                out.push_tensor(prefix, "first_absmax", first.absmax.to_data());
                out.push_tensor(prefix, "second_codes", second.codes.to_data());
                out.push_tensor(prefix, "second_absmax", second.absmax.to_data());
            }
        }
    }

    fn state_unflatten(prefix: &str, src: &mut StateSource, device: &Device) -> Option<Self> {
        let time = usize::try_from(src.take_scalar(prefix, "time")?).ok()?;
        let codes = |data| Tensor::<1, Int>::from_data(data, device).cast(IntDType::U8);
        let moments = match src.take_tensor(prefix, "first_codes") {
            Some(first_codes) => Moments::Blockwise {
                first: Quantized {
                    codes: codes(first_codes),
                    absmax: Tensor::from_data(src.take_tensor(prefix, "first_absmax")?, device),
                },
                second: Quantized {
                    codes: codes(src.take_tensor(prefix, "second_codes")?),
                    absmax: Tensor::from_data(src.take_tensor(prefix, "second_absmax")?, device),
                },
            },
            None => Moments::Full {
                first: Tensor::from_data(src.take_tensor(prefix, "first")?, device),
                second: Tensor::from_data(src.take_tensor(prefix, "second")?, device),
            },
        };
        Some(AdamW8bitState { time, moments })
    }
}
