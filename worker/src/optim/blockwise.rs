//! Block-wise 8-bit quantization with bitsandbytes' dynamic ("dynamic tree")
//! maps: a tensor is cut into blocks of [`BLOCK`] elements, each block is
//! scaled by its absolute maximum (one f32), and every scaled element is
//! stored as the index (one byte) of the nearest of 256 map values.
//!
//! The maps are bitsandbytes' `functional.create_dynamic_map(signed,
//! max_exponent_bits=7, total_bits=8)` (bitsandbytes-foundation/bitsandbytes,
//! `bitsandbytes/functional.py`): for exponent `i` in 0..7, the midpoints of
//! `linspace(0.1, 1, k + 1)` scaled by `10^(i - 6)`, with `k = 2^i` values
//! per sign (signed) or `k = 2^(i+1)` (unsigned), then 0 and 1.0, sorted.
//! Adam8bit quantizes its first moment with the signed map and its second
//! with the unsigned one (`optim/optimizer.py`, `Optimizer2State.init_state`:
//! `qmap1 = "dynamic"`, `qmap2 = "udynamic"`, `absmax` per block of 256).
//!
//! Everything here is tensor operations on the parameter's device: the codes
//! stay there as a `u8` tensor.

use burn::tensor::{Device, FloatDType, Int, IntDType, Tensor, TensorData};

/// Elements per quantization block (bitsandbytes' block-wise optimizers: 256).
pub const BLOCK: usize = 256;

/// One of bitsandbytes' 256-value dynamic maps, ascending.
#[derive(Clone, Debug, PartialEq)]
pub struct DynamicMap {
    values: Vec<f32>,
    /// `(values[k] + values[k + 1]) / 2` for k in 0..255: an element goes to
    /// the code of the nearest value, i.e. to the number of midpoints below it.
    midpoints: Vec<f32>,
}

impl DynamicMap {
    /// The signed map (first moment): 127 negative values down to −0.99297,
    /// 0, and 128 positive values up to 1.0.
    pub fn signed() -> Self {
        Self::new(true)
    }

    /// The unsigned map (second moment): 0, then 255 values up to 1.0.
    pub fn unsigned() -> Self {
        Self::new(false)
    }

    fn new(signed: bool) -> Self {
        const MAX_EXPONENT_BITS: i32 = 7;
        let mut values = Vec::with_capacity(256);
        for i in 0..MAX_EXPONENT_BITS {
            let items = if signed {
                1usize << i
            } else {
                1usize << (i + 1)
            };
            let scale = 10f64.powi(i - (MAX_EXPONENT_BITS - 1));
            // linspace(0.1, 1, items + 1), then the mean of neighbouring boundaries.
            let boundary = |j: usize| 0.1 + 0.9 * j as f64 / items as f64;
            for j in 0..items {
                let mean = (boundary(j) + boundary(j + 1)) / 2.0;
                values.push((scale * mean) as f32);
                if signed {
                    values.push((-scale * mean) as f32);
                }
            }
        }
        // `additional_items` is 2^(7 - 7) - 1 = 0 for 8 bits: nothing more.
        values.push(0.0);
        values.push(1.0);
        assert_eq!(values.len(), 256, "a dynamic map has 256 values");
        values.sort_by(f32::total_cmp);
        let midpoints = values.windows(2).map(|w| (w[0] + w[1]) / 2.0).collect();
        DynamicMap { values, midpoints }
    }

    /// The 256 values, ascending (code `k` stands for `values()[k]`).
    pub fn values(&self) -> &[f32] {
        &self.values
    }

    fn values_on(&self, device: &Device) -> Tensor<1> {
        Tensor::from_data(TensorData::new(self.values.clone(), [256]), device)
    }

    fn midpoints_on(&self, device: &Device) -> Tensor<1> {
        Tensor::from_data(TensorData::new(self.midpoints.clone(), [255]), device)
    }
}

/// A block-quantized vector: one `u8` code per element and one f32 absolute
/// maximum per block of [`BLOCK`] elements (1 + 4/256 bytes per element).
#[derive(Clone, Debug)]
pub struct Quantized {
    /// Codes, dtype `u8`, `blocks × BLOCK` long (the last block zero-padded).
    pub codes: Tensor<1, Int>,
    /// Each block's absolute maximum, `blocks` long.
    pub absmax: Tensor<1>,
}

impl Quantized {
    /// Blocks needed for `elements` elements.
    pub fn blocks(elements: usize) -> usize {
        elements.div_ceil(BLOCK)
    }

    /// Quantizes `x` (length a multiple of [`BLOCK`]) with `map`: per block,
    /// `x / absmax` rounded to the nearest map value (ties to the lower one).
    pub fn quantize(x: Tensor<1>, map: &DynamicMap) -> Self {
        let [len] = x.dims();
        assert_eq!(len % BLOCK, 0, "quantize takes whole blocks");
        let blocks = len / BLOCK;
        let device = x.device();
        let x = x.reshape([blocks, BLOCK]);
        let absmax = x.clone().abs().max_dim(1);
        // An all-zero block keeps absmax 0 and codes for 0 (divide by 1 instead).
        let divisor = absmax
            .clone()
            .mask_fill(absmax.clone().equal_elem(0.0), 1.0);
        let normalized = (x / divisor).reshape([len]);
        // Count the midpoints below each element by bit descent over the 255
        // sorted midpoints: 8 gathers instead of a 255-wide comparison.
        // In x's dtype: the map is made in the device's default one, and the
        // optimizer steps f32 moments also where the model trains in bf16.
        let midpoints = map
            .midpoints_on(&device)
            .cast(FloatDType::from(normalized.dtype()));
        let mut index = Tensor::<1, Int>::zeros([len], &device);
        for step in [128, 64, 32, 16, 8, 4, 2, 1] {
            let probe = midpoints
                .clone()
                .select(0, index.clone().add_scalar(step - 1));
            let below = probe.lower(normalized.clone());
            index = index + below.int().mul_scalar(step);
        }
        Quantized {
            codes: index.cast(IntDType::U8),
            absmax: absmax.reshape([blocks]),
        }
    }

    /// The values the codes stand for, `blocks × BLOCK` long.
    pub fn dequantize(&self, map: &DynamicMap) -> Tensor<1> {
        let [len] = self.codes.dims();
        let blocks = len / BLOCK;
        let device = self.codes.device();
        let values = map
            .values_on(&device)
            .cast(FloatDType::from(self.absmax.dtype()))
            .select(0, self.codes.clone().cast(IntDType::I32));
        (values.reshape([blocks, BLOCK]) * self.absmax.clone().reshape([blocks, 1])).reshape([len])
    }

    /// Blocks `from..to` of these codes (a view: no values change).
    pub fn blocks_range(&self, from: usize, to: usize) -> Quantized {
        Quantized {
            codes: self.codes.clone().slice(from * BLOCK..to * BLOCK),
            absmax: self.absmax.clone().slice(from..to),
        }
    }

    /// Consecutive block ranges joined back into one tensor's codes.
    pub fn cat(parts: Vec<Quantized>) -> Quantized {
        let (codes, absmax): (Vec<_>, Vec<_>) =
            parts.into_iter().map(|q| (q.codes, q.absmax)).unzip();
        Quantized {
            codes: Tensor::cat(codes, 0),
            absmax: Tensor::cat(absmax, 0),
        }
    }

    /// Bytes held: one per code plus four per block scale.
    pub fn bytes(&self) -> usize {
        self.codes.shape().num_elements() * self.codes.dtype().size()
            + self.absmax.shape().num_elements() * self.absmax.dtype().size()
    }

    pub fn to_device(self, device: &Device) -> Self {
        Quantized {
            codes: self.codes.to_device(device),
            absmax: self.absmax.to_device(device),
        }
    }
}

/// `x` flattened and zero-padded to whole blocks.
pub fn padded<const D: usize>(x: Tensor<D>) -> Tensor<1> {
    let elements = x.shape().num_elements();
    let len = Quantized::blocks(elements) * BLOCK;
    let flat = x.reshape([elements]);
    if len == elements {
        return flat;
    }
    let device = flat.device();
    Tensor::cat(vec![flat, Tensor::zeros([len - elements], &device)], 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::DType;

    fn device() -> Device {
        Device::flex()
    }

    fn vector(values: Vec<f32>) -> Tensor<1> {
        let len = values.len();
        Tensor::from_data(TensorData::new(values, [len]), &device())
    }

    fn floats(t: Tensor<1>) -> Vec<f32> {
        t.into_data().iter::<f32>().collect()
    }

    #[test]
    fn maps_are_bitsandbytes_dynamic_maps() {
        let signed = DynamicMap::signed();
        let v = signed.values();
        assert_eq!(v.len(), 256);
        assert!(v.windows(2).all(|w| w[0] <= w[1]), "ascending");
        assert_eq!(v[255], 1.0);
        // The largest negative magnitude: -(1 - 0.9/128), the last midpoint of
        // linspace(0.1, 1, 65).
        assert!((v[0] + (1.0 - 0.9 / 128.0)).abs() < 1e-6, "{}", v[0]);
        assert_eq!(v.iter().filter(|x| **x == 0.0).count(), 1);
        assert_eq!(v.iter().filter(|x| **x < 0.0).count(), 127);
        // The smallest magnitude: 1e-6 × (0.1 + 1) / 2.
        let smallest = v
            .iter()
            .filter(|x| **x > 0.0)
            .fold(f32::MAX, |a, b| a.min(*b));
        assert!((smallest - 0.55e-6).abs() < 1e-12, "{smallest}");

        let unsigned = DynamicMap::unsigned();
        let u = unsigned.values();
        assert_eq!(u[0], 0.0);
        assert_eq!(u[255], 1.0);
        assert!(u.iter().all(|x| *x >= 0.0));
        assert!(u.windows(2).all(|w| w[0] < w[1]), "distinct and ascending");
        // 2 + 4 + … + 128 = 254 values, the last exponent's top midpoint 1 - 0.9/256.
        assert!((u[254] - (1.0 - 0.9 / 256.0)).abs() < 1e-6, "{}", u[254]);
    }

    /// A round trip returns, per element, the map value nearest to
    /// `x / absmax` (checked by brute force) times the block's absmax. Over
    /// the whole map that is within half the widest gap of the block maximum
    /// (`abs`: the top decade's 0.9/64 signed, 0.9/128 unsigned, halved), and
    /// for elements within the top decade (≥ 10 % of the maximum) within
    /// `rel` of the element.
    fn check_round_trip(x: Vec<f32>, map: &DynamicMap, abs: f32, rel: f32) {
        let len = x.len();
        let q = Quantized::quantize(vector(x.clone()), map);
        assert_eq!(q.codes.dtype(), DType::U8, "codes are stored as u8");
        assert_eq!(q.bytes(), len + 4 * (len / BLOCK));
        let back = floats(q.dequantize(map));
        let values = map.values();
        for (block, (xs, ys)) in x.chunks(BLOCK).zip(back.chunks(BLOCK)).enumerate() {
            let absmax = xs.iter().fold(0f32, |a, b| a.max(b.abs()));
            for (x, y) in xs.iter().zip(ys) {
                let n = x / absmax;
                let nearest = values.iter().fold(f32::MAX, |best, v| {
                    if (v - n).abs() < (best - n).abs() {
                        *v
                    } else {
                        best
                    }
                });
                // Slack for the f32 rounding of the midpoints (a tie may go either way).
                let bound = ((nearest - n).abs() + 1e-7 * n.abs().max(1e-6)) * absmax;
                let error = (x - y).abs();
                assert!(
                    error <= bound,
                    "block {block}: {x} came back as {y}, not the nearest code (error {bound})"
                );
                assert!(error <= absmax * abs, "{x} came back as {y}");
                if x.abs() >= absmax * 0.1 {
                    assert!(error <= x.abs() * rel, "{x} came back as {y}");
                }
            }
        }
    }

    fn pseudo_random(len: usize, seed: u32) -> Vec<f32> {
        // xorshift32, mapped to roughly normal values by summing uniforms.
        let mut s = seed.max(1);
        let mut uniform = move || {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            s as f32 / u32::MAX as f32
        };
        (0..len)
            .map(|_| (0..4).map(|_| uniform()).sum::<f32>() - 2.0)
            .collect()
    }

    #[test]
    fn signed_round_trip_error_is_bounded() {
        let mut x = pseudo_random(8 * BLOCK, 7);
        // A block of tiny values and one spanning decades.
        x[BLOCK..2 * BLOCK].iter_mut().for_each(|v| *v *= 1e-6);
        x[2 * BLOCK..3 * BLOCK]
            .iter_mut()
            .enumerate()
            .for_each(|(i, v)| *v *= 10f32.powi(-((i % 7) as i32)));
        check_round_trip(x, &DynamicMap::signed(), 0.9 / 64.0 / 2.0 + 1e-6, 0.071);
    }

    #[test]
    fn unsigned_round_trip_error_is_bounded() {
        let x = pseudo_random(8 * BLOCK, 11)
            .into_iter()
            .enumerate()
            .map(|(i, v)| v * v * 10f32.powi(-((i % 5) as i32)))
            .collect();
        check_round_trip(x, &DynamicMap::unsigned(), 0.9 / 128.0 / 2.0 + 1e-6, 0.036);
    }

    #[test]
    fn zero_blocks_and_exact_map_values_survive() {
        let map = DynamicMap::signed();
        // Block 0: zeros; block 1: the map values themselves, times 3.
        let mut x = vec![0.0; BLOCK];
        x.extend(map.values().iter().map(|v| v * 3.0));
        let q = Quantized::quantize(vector(x.clone()), &map);
        let back = floats(q.dequantize(&map));
        assert!(back[..BLOCK].iter().all(|v| *v == 0.0));
        for (x, y) in x[BLOCK..].iter().zip(&back[BLOCK..]) {
            assert!((x - y).abs() <= x.abs() * 1e-6, "{x} vs {y}");
        }
        let codes: Vec<u8> = q.codes.into_data().iter::<u8>().collect();
        assert_eq!(&codes[BLOCK..], (0..=255u8).collect::<Vec<_>>().as_slice());
    }

    #[test]
    fn padding_fills_whole_blocks() {
        let x = Tensor::<2>::ones([3, 100], &device());
        let p = padded(x);
        assert_eq!(p.dims(), [2 * BLOCK]);
        let v = floats(p);
        assert!(v[..300].iter().all(|x| *x == 1.0) && v[300..].iter().all(|x| *x == 0.0));
    }
}
