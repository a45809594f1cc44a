//! 4-bit NormalFloat (NF4) weights with double quantization, bit for bit as
//! bitsandbytes makes them (QLoRA's frozen base weights).
//!
//! # Format
//!
//! A tensor is flattened (row-major) and cut into blocks of [`BLOCK`] = 64
//! values; the last block may be partial. Per block:
//! * `absmax` = the largest |value|;
//! * each value becomes the 4-bit index of the nearest of the 16 [`NF4_CODE`]
//!   values to `value / absmax` (decision thresholds [`NF4_THRESHOLDS`]; a value
//!   exactly on a threshold takes the lower code);
//! * two indices per byte, the FIRST value in the HIGH nibble; an odd count is
//!   padded with the code of 0.0 (`0b0111`) in the last low nibble.
//!
//! Double quantization (bitsandbytes' `compress_statistics=True`): the f32
//! absmax values are replaced by
//! * `offset` = their mean (one f32),
//! * one byte per block: the index of the nearest value of bitsandbytes' signed
//!   8-bit dynamic map ([`dynamic_map`]) to `(absmax - offset) / nested_absmax`,
//!   over blocks of [`NESTED_BLOCK`] = 256 absmax values,
//! * `nested_absmax` = max |absmax - offset| per nested block (one f32).
//!
//! Dequantization: `absmax' = map[code] * nested_absmax + offset`, then
//! `value = NF4_CODE[nibble] * absmax'` (float32 multiplies and adds, in that
//! order). Memory: 4 bits + 8/64 + 32/(64·256) bits ≈ **4.127 bits per value**
//! (plus one f32 offset per tensor; the 16- and 256-value maps are shared
//! constants, which bitsandbytes also stores per tensor as `quant_map` and
//! `nested_quant_map`).
//!
//! # What mirrors what (bitsandbytes 0.50.2, torch 2.15)
//!
//! * [`Nf4Tensor::quantize`] = `bitsandbytes.functional.quantize_4bit(A,
//!   blocksize=64, compress_statistics=True, quant_type="nf4")` with
//!   bitsandbytes' pure-torch reference kernels (`backends/default/ops.py`):
//!   - 4-bit step: `bitsandbytes::quantize_4bit` "default" kernel: full blocks
//!     are scaled by `x * (1 / max(absmax, 1e-38))`, the trailing partial block
//!     by `x / max(absmax, 1e-38)` (and stores the clamped absmax, so an
//!     all-zero tail keeps absmax 1e-38 while an all-zero full block keeps 0),
//!     clamped to [-1, 1], then `torch.bucketize` on the f32 midpoints of the
//!     NF4 values (ties to the lower code; the CUDA kernel's `dQuantizeNF4`
//!     decision tree has the same rule, with 4 of its 15 thresholds one f32
//!     ulp away, see [`NF4_THRESHOLDS`]);
//!   - `offset = absmax.mean()`: torch's CPU float sum (`SumKernel.cpp`,
//!     `cascade_sum`, 8-lane vectors as in its AVX2 build) divided by the count;
//!   - nested step: `quantize_blockwise(absmax - offset, blocksize=256)` with the
//!     `bitsandbytes::quantize_blockwise` "default" kernel (same scaling and
//!     clamps, bucketize on the f32 midpoints of the dynamic map);
//!   - the map: `functional.create_dynamic_map(signed=True)` as torch builds it
//!     (`torch.linspace`'s CPU kernel computes `start + step * i` as one fused
//!     multiply-add; the map here reproduces it bit for bit).
//! * [`Nf4Tensor::dequantize`] = `functional.dequantize_4bit` (every backend:
//!   `dequantize_blockwise` of the absmax codes, `+= offset`, then the NF4
//!   lookup times the block's absmax).
//!
//! The tests compare against a fixture made by bitsandbytes itself
//! (`worker/tests/fixtures/nf4/make_fixture.py`).
//!
//! Known differences between bitsandbytes' own backends (not reproducible by
//! any one implementation):
//! * its native CPU library (0.50+) rounds the nested 8-bit step through a
//!   65,536-entry lookup table, which picks a neighbouring map value for
//!   roughly 0.2 % of nested codes on random weights; decoding such a tensor
//!   here is still exact (decoding is the same everywhere);
//! * from reading `csrc/kernels.cu` (no GPU run): CUDA's 8-bit `dQuantize`
//!   sends an exact tie between two map values to the even index; CUDA scales
//!   the trailing partial block by the reciprocal too; an all-zero 64-block
//!   scales to NaN there, hence code `0b0000` (-1.0) instead of `0b0111` (0.0),
//!   which matters once the block's absmax is double-quantized to non-zero;
//!   CUDA and the native CPU library code an all-zero nested block as 0, not
//!   127 (both decode to 0);
//! * `absmax.mean()` follows torch's reduction order, which depends on torch's
//!   SIMD width (8 lanes here, as AVX2; AVX-512 builds would sum in 16 lanes),
//!   on the thread count above 32,768 absmax values (2 Mi weights), and is a
//!   different reduction on CUDA: the offset may then differ by an ulp.

use std::sync::OnceLock;

use burn::tensor::{DType, Device, FloatDType, Int, Tensor, TensorData};
use headroom_planner::TargetModule;

/// Values per 4-bit block (bitsandbytes' `blocksize=64`).
pub const BLOCK: usize = 64;

/// Absmax values per nested 8-bit block (`quantize_blockwise(..., blocksize=256)`).
pub const NESTED_BLOCK: usize = 256;

/// bitsandbytes' 16 NF4 values (`functional.get_4bit_type("nf4")`), index 0..15.
#[allow(clippy::excessive_precision)] // bitsandbytes' digits, verbatim
pub const NF4_CODE: [f32; 16] = [
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
];

/// The 15 decision thresholds between neighbouring [`NF4_CODE`] values: their
/// f32 midpoints `(code[i] + code[i + 1]) / 2`, the bucketize boundaries of
/// bitsandbytes' torch kernels (`_get_4bit_quantize_bounds`). A scaled value
/// `x` gets code `i` = the number of thresholds `< x`, so a value on a
/// threshold takes the lower code. The CUDA kernel's `dQuantizeNF4` tree
/// (`csrc/kernels.cu`) uses the same rule with decimal literals of these
/// midpoints that round, as f32, one ulp away at thresholds 0, 8, 12 and 14
/// (a test pins this): only a value within that ulp is coded differently there.
pub const NF4_THRESHOLDS: [f32; 15] = {
    let mut t = [0.0f32; 15];
    let mut i = 0;
    while i < 15 {
        t[i] = (NF4_CODE[i] + NF4_CODE[i + 1]) / 2.0;
        i += 1;
    }
    t
};

/// bitsandbytes' floor on a block's absmax before dividing by it
/// (`absmax.clamp(min=1e-38)` in the default kernels).
const ABSMAX_FLOOR: f32 = 1e-38;

/// bitsandbytes' signed 8-bit dynamic map, ascending (code `k` stands for
/// `dynamic_map()[k]`): `functional.create_dynamic_map(signed=True,
/// max_exponent_bits=7, total_bits=8)`. For exponent `i` in 0..7 the means of
/// neighbouring points of `torch.linspace(0.1, 1, 2^i + 1)` (float32) times
/// `10^(i - 6)`, both signs, then 0 and 1, sorted: 127 negative values down to
/// -0.99297, 0 (index 127) and 128 positive values up to 1.
pub fn dynamic_map() -> &'static [f32; 256] {
    static MAP: OnceLock<[f32; 256]> = OnceLock::new();
    MAP.get_or_init(|| {
        // `10 ** (i - 6)` as Python floats, cast to float32 by the tensor multiply.
        const SCALES: [f64; 7] = [1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0];
        let mut data = Vec::with_capacity(256);
        for (i, scale) in SCALES.iter().enumerate() {
            let scale = *scale as f32;
            let boundaries = torch_linspace(0.1, 1.0, (1 << i) + 1);
            let means: Vec<f32> = boundaries.windows(2).map(|w| (w[0] + w[1]) / 2.0).collect();
            data.extend(means.iter().map(|m| scale * m));
            data.extend(means.iter().map(|m| -scale * m));
        }
        data.push(0.0);
        data.push(1.0);
        data.sort_by(f32::total_cmp);
        let mut map = [0.0; 256];
        map.copy_from_slice(&data);
        map
    })
}

/// `(map[k] + map[k + 1]) / 2` in f32: the nested step's bucketize boundaries.
fn dynamic_midpoints() -> &'static [f32; 255] {
    static MIDPOINTS: OnceLock<[f32; 255]> = OnceLock::new();
    MIDPOINTS.get_or_init(|| {
        let map = dynamic_map();
        let mut midpoints = [0.0; 255];
        for (k, m) in midpoints.iter_mut().enumerate() {
            *m = (map[k] + map[k + 1]) / 2.0;
        }
        midpoints
    })
}

/// `torch.linspace(start, end, steps, dtype=torch.float32)` on the CPU
/// (`aten/src/ATen/native/cpu/RangeFactoriesKernel.cpp`): the first half counts
/// up from `start`, the rest down from `end`; `start + step * i` is one fused
/// multiply-add in torch's build, so it is here.
fn torch_linspace(start: f64, end: f64, steps: usize) -> Vec<f32> {
    let (start, end) = (start as f32, end as f32);
    let step = (end - start) / (steps - 1) as f32;
    let halfway = steps / 2;
    (0..steps)
        .map(|i| {
            if i < halfway {
                step.mul_add(i as f32, start)
            } else {
                (-step).mul_add((steps - 1 - i) as f32, end)
            }
        })
        .collect()
}

/// `torch.bucketize(x, bounds)` (right=False) on sorted bounds: the number of
/// bounds strictly below `x`, so a value on a bound takes the lower bucket.
fn bucketize(x: f32, bounds: &[f32]) -> u8 {
    bounds.partition_point(|b| *b < x) as u8
}

/// bitsandbytes' blockwise absmax quantization as its default (pure-torch)
/// kernels do it: per block of `block` values the absmax, the scaled values
/// (full blocks `x * (1 / max(absmax, 1e-38))`, the trailing partial block
/// `x / max(absmax, 1e-38)`, which is also the absmax it keeps), clamped to
/// [-1, 1] and bucketized on `bounds`. Returns the codes and the absmax values.
fn quantize_blockwise(values: &[f32], block: usize, bounds: &[f32]) -> (Vec<u8>, Vec<f32>) {
    let mut codes = Vec::with_capacity(values.len());
    let mut absmax = Vec::with_capacity(values.len().div_ceil(block));
    for chunk in values.chunks(block) {
        let max = chunk.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        if chunk.len() == block {
            let reciprocal = 1.0 / max.max(ABSMAX_FLOOR);
            codes.extend(
                chunk
                    .iter()
                    .map(|x| bucketize((x * reciprocal).clamp(-1.0, 1.0), bounds)),
            );
            absmax.push(max);
        } else {
            let divisor = max.max(ABSMAX_FLOOR);
            codes.extend(
                chunk
                    .iter()
                    .map(|x| bucketize((x / divisor).clamp(-1.0, 1.0), bounds)),
            );
            absmax.push(divisor);
        }
    }
    (codes, absmax)
}

/// `x.mean()` of a contiguous float32 tensor as torch computes it on the CPU:
/// its cascade sum (`aten/src/ATen/native/cpu/SumKernel.cpp`) with 8-lane
/// vectors (the AVX2 build), divided by the count in float32. Exactly torch's
/// result below 32,768 values (above, torch splits the sum across threads);
/// an accurate sum in any case.
fn torch_mean(x: &[f32]) -> f32 {
    torch_sum(x) / x.len() as f32
}

fn torch_sum(x: &[f32]) -> f32 {
    const LANES: usize = 8;
    if x.len() < LANES {
        // Too short for one vector: the same cascade over scalars.
        let items: Vec<[f32; 1]> = x.iter().map(|v| [*v]).collect();
        return cascade_row_sum(&items)[0];
    }
    let vectors: Vec<[f32; LANES]> = x
        .chunks_exact(LANES)
        .map(|c| {
            let mut v = [0.0; LANES];
            v.copy_from_slice(c);
            v
        })
        .collect();
    let lanes = cascade_row_sum(&vectors);
    let mut total = 0.0f32;
    for v in &x[vectors.len() * LANES..] {
        total += v;
    }
    for lane in lanes {
        total += lane;
    }
    total
}

fn add_into<const L: usize>(acc: &mut [f32; L], item: &[f32; L]) {
    for (a, b) in acc.iter_mut().zip(item) {
        *a += b;
    }
}

/// torch's `row_sum`: the items as rows of 4 (instruction-level parallelism),
/// summed by `multi_row_sum`, the leftover items into the first partial sum,
/// then the four partial sums in order.
fn cascade_row_sum<const L: usize>(items: &[[f32; L]]) -> [f32; L] {
    const ILP: usize = 4;
    let rows = items.len() / ILP;
    let partial = multi_row_sum(&items[..rows * ILP]);
    let mut sum = partial[0];
    for item in &items[rows * ILP..] {
        add_into(&mut sum, item);
    }
    for p in &partial[1..] {
        add_into(&mut sum, p);
    }
    sum
}

/// torch's `multi_row_sum` with 4 columns: four accumulation levels, each
/// taking `2^level_power` sums of the level below, so only sums of similar
/// size meet.
fn multi_row_sum<const L: usize>(items: &[[f32; L]]) -> [[f32; L]; 4] {
    const LEVELS: usize = 4;
    const COLUMNS: usize = 4;
    let size = items.len() / COLUMNS;
    let ceil_log2 = if size <= 2 {
        1
    } else {
        (usize::BITS - (size - 1).leading_zeros()) as usize
    };
    let level_power = (ceil_log2 / LEVELS).max(4);
    let level_step = 1usize << level_power;
    let level_mask = level_step - 1;
    let mut acc = [[[0.0f32; L]; COLUMNS]; LEVELS];
    let mut i = 0;
    while i + level_step <= size {
        for _ in 0..level_step {
            for k in 0..COLUMNS {
                add_into(&mut acc[0][k], &items[i * COLUMNS + k]);
            }
            i += 1;
        }
        for j in 1..LEVELS {
            let lower = acc[j - 1];
            for (upper, lower) in acc[j].iter_mut().zip(&lower) {
                add_into(upper, lower);
            }
            acc[j - 1] = [[0.0; L]; COLUMNS];
            if i & (level_mask << (j * level_power)) != 0 {
                break;
            }
        }
    }
    while i < size {
        for k in 0..COLUMNS {
            add_into(&mut acc[0][k], &items[i * COLUMNS + k]);
        }
        i += 1;
    }
    for j in 1..LEVELS {
        let upper = acc[j];
        for (total, upper) in acc[0].iter_mut().zip(&upper) {
            add_into(total, upper);
        }
    }
    acc[0]
}

/// A 2-D float tensor stored as NF4 with double-quantized block scales (see
/// the module documentation for the format).
#[derive(Clone, Debug, PartialEq)]
pub struct Nf4Tensor {
    shape: [usize; 2],
    /// Two 4-bit NF4 indices per byte, the earlier value in the high nibble
    /// (bitsandbytes' `weight`, uint8), `ceil(n / 2)` bytes.
    packed: Vec<u8>,
    /// Each 64-block's absmax as an 8-bit dynamic-map index (bitsandbytes'
    /// `weight.absmax` of a double-quantized tensor).
    absmax_codes: Vec<u8>,
    /// One f32 scale per 256 absmax codes (`weight.nested_absmax`).
    nested_absmax: Vec<f32>,
    /// The mean of the absmax values, subtracted before their quantization
    /// (`nested_offset` in bitsandbytes' quant state).
    offset: f32,
    /// Values per 4-bit block: [`BLOCK`].
    block: usize,
    /// Absmax values per nested block: [`NESTED_BLOCK`].
    nested_block: usize,
}

impl Nf4Tensor {
    /// Quantizes row-major `values` of `shape` exactly as bitsandbytes'
    /// `quantize_4bit(..., blocksize=64, compress_statistics=True,
    /// quant_type="nf4")` does (blocks run over the flattened tensor).
    ///
    /// # Panics
    /// If `values.len()` is not `shape[0] * shape[1]`, or the tensor is empty.
    pub fn quantize(values: &[f32], shape: [usize; 2]) -> Nf4Tensor {
        assert_eq!(
            values.len(),
            shape[0] * shape[1],
            "NF4 quantize: {} values for shape {shape:?}",
            values.len()
        );
        assert!(!values.is_empty(), "NF4 quantize: empty tensor");
        let (codes, absmax) = quantize_blockwise(values, BLOCK, &NF4_THRESHOLDS);
        // An odd count is padded with a scaled 0.0 before packing.
        let pad = bucketize(0.0, &NF4_THRESHOLDS);
        let packed = codes
            .chunks(2)
            .map(|pair| (pair[0] << 4) | pair.get(1).copied().unwrap_or(pad))
            .collect();

        let offset = torch_mean(&absmax);
        let centred: Vec<f32> = absmax.iter().map(|a| a - offset).collect();
        let (absmax_codes, nested_absmax) =
            quantize_blockwise(&centred, NESTED_BLOCK, dynamic_midpoints());
        Nf4Tensor {
            shape,
            packed,
            absmax_codes,
            nested_absmax,
            offset,
            block: BLOCK,
            nested_block: NESTED_BLOCK,
        }
    }

    /// The dequantized absmax of each 64-block: `map[code] * nested_absmax +
    /// offset` (bitsandbytes' `dequantize_blockwise`, then `+= offset`).
    pub fn block_absmax(&self) -> Vec<f32> {
        let map = dynamic_map();
        self.absmax_codes
            .iter()
            .enumerate()
            .map(|(i, code)| {
                let scaled = map[*code as usize] * self.nested_absmax[i / self.nested_block];
                scaled + self.offset
            })
            .collect()
    }

    /// The float values, row-major (bitsandbytes' `dequantize_4bit`).
    pub fn dequantize(&self) -> Vec<f32> {
        let absmax = self.block_absmax();
        let n = self.len();
        let mut out = Vec::with_capacity(n);
        for (j, byte) in self.packed.iter().enumerate() {
            let scale = absmax[2 * j / self.block];
            out.push(NF4_CODE[(byte >> 4) as usize] * scale);
            if 2 * j + 1 < n {
                out.push(NF4_CODE[(byte & 0x0f) as usize] * scale);
            }
        }
        out
    }

    /// The dequantized values as a dense f32 tensor of [`Self::shape`] on `device`.
    pub fn to_tensor(&self, device: &Device) -> Tensor<2> {
        Tensor::from_data(TensorData::new(self.dequantize(), self.shape), device)
    }

    /// Bytes this tensor holds: packed codes, absmax codes, nested scales and
    /// the offset (the shared maps not counted). See [`Self::bytes_for`].
    pub fn bytes(&self) -> usize {
        self.packed.len() + self.absmax_codes.len() + 4 * self.nested_absmax.len() + 4
    }

    /// [`Self::bytes`] of an NF4 tensor of `shape`, without quantizing one:
    /// ≈ 4.127 bits per value.
    pub fn bytes_for(shape: [usize; 2]) -> usize {
        let n = shape[0] * shape[1];
        let blocks = n.div_ceil(BLOCK);
        n.div_ceil(2) + blocks + 4 * blocks.div_ceil(NESTED_BLOCK) + 4
    }

    pub fn shape(&self) -> [usize; 2] {
        self.shape
    }

    /// Number of values.
    pub fn len(&self) -> usize {
        self.shape[0] * self.shape[1]
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn packed(&self) -> &[u8] {
        &self.packed
    }

    pub fn absmax_codes(&self) -> &[u8] {
        &self.absmax_codes
    }

    pub fn nested_absmax(&self) -> &[f32] {
        &self.nested_absmax
    }

    pub fn offset(&self) -> f32 {
        self.offset
    }

    pub fn block(&self) -> usize {
        self.block
    }

    pub fn nested_block(&self) -> usize {
        self.nested_block
    }
}

/// Values dequantized at once by [`Nf4Weight::dense_rows`]'s callers: a
/// matrix larger than this is dequantized a slice of rows at a time, so the
/// transient of a quantized matmul is bounded whatever the matrix (the
/// planner counts the same chunk).
pub const DEQUANT_CHUNK_VALUES: usize = headroom_planner::NF4_DEQUANT_CHUNK_VALUES as usize;

/// An [`Nf4Tensor`] on a device: the packed codes and the absmax codes as
/// `u8` integer tensors, the nested scales as f32 — the same ≈ 4.127 bits per
/// value — dequantized by tensor ops ([`Self::dense_rows`]; on flex by one
/// loop over the codes), so it runs wherever burn does (flex, CUDA) and
/// never needs the host copy again.
#[derive(Clone, Debug)]
pub struct Nf4Weight {
    shape: [usize; 2],
    packed: Tensor<1, Int>,
    absmax_codes: Tensor<1, Int>,
    nested_absmax: Tensor<1>,
    offset: f32,
    /// Values per dequantized slice: [`DEQUANT_CHUNK_VALUES`], smaller in tests.
    chunk_values: usize,
}

impl Nf4Weight {
    /// Copies `tensor` to `device` (its plain backend: nothing here is
    /// ever differentiated).
    ///
    /// The codes are `u8` where the device has 8-bit integers (flex, CUDA,
    /// Vulkan through SPIR-V), `i32` where it has none: WGSL has no `u8`, and
    /// cubecl's WGSL compiler emits one for a `u8` tensor's kernels, which
    /// naga rejects ("no definition in scope for identifier: u8"). The `i32`
    /// codes hold four times the bytes [`Self::bytes`] counts.
    pub fn upload(tensor: &Nf4Tensor, device: &Device) -> Self {
        let device = device.clone().inner();
        let codes = if device.supports_dtype(DType::U8) {
            DType::U8
        } else {
            DType::I32
        };
        let bytes = |v: &[u8]| {
            Tensor::<1, Int>::from_data(TensorData::new(v.to_vec(), [v.len()]), (&device, codes))
        };
        Nf4Weight {
            shape: tensor.shape,
            packed: bytes(&tensor.packed),
            absmax_codes: bytes(&tensor.absmax_codes),
            nested_absmax: Tensor::from_data(
                TensorData::new(tensor.nested_absmax.clone(), [tensor.nested_absmax.len()]),
                (&device, DType::F32),
            ),
            offset: tensor.offset,
            chunk_values: DEQUANT_CHUNK_VALUES,
        }
    }

    /// The same weight dequantized about `values` at a time (tests of the
    /// slicing on small matrices).
    pub fn with_chunk_values(self, values: usize) -> Self {
        Nf4Weight {
            chunk_values: values.max(1),
            ..self
        }
    }

    /// `[rows, cols]` as quantized.
    pub fn shape(&self) -> [usize; 2] {
        self.shape
    }

    /// Bytes it holds on the device (as [`Nf4Tensor::bytes`]).
    pub fn bytes(&self) -> usize {
        Nf4Tensor::bytes_for(self.shape)
    }

    /// Rows per dequantized slice: about [`DEQUANT_CHUNK_VALUES`] values, and
    /// a whole number of 64-blocks (so a slice starts on a block and on a byte).
    pub fn chunk_rows(&self) -> usize {
        let [rows, cols] = self.shape;
        let step = BLOCK / gcd(cols, BLOCK);
        let wanted = (self.chunk_values / cols.max(1)).max(1);
        (wanted.div_ceil(step) * step).min(rows)
    }

    /// Every 64-block's absmax, f32 (`map[code] · nested + offset`, the
    /// host's [`Nf4Tensor::block_absmax`] bit for bit).
    pub fn block_absmax(&self) -> Tensor<1> {
        let device = self.packed.device();
        let map = Tensor::<1>::from_data(
            TensorData::new(dynamic_map().to_vec(), [256]),
            (&device, DType::F32),
        );
        let blocks = self.absmax_codes.dims()[0];
        let nested = self.nested_absmax.dims()[0];
        let scale = self
            .nested_absmax
            .clone()
            .reshape([nested, 1])
            .expand([nested, NESTED_BLOCK])
            .reshape([nested * NESTED_BLOCK])
            .slice(0..blocks);
        (map.select(0, self.absmax_codes.clone()) * scale).add_scalar(self.offset)
    }

    /// Rows `rows` of the dequantized tensor, `[rows.len(), cols]` in
    /// `dtype` (bitsandbytes' `dequantize_4bit` in f32, then cast). `absmax`
    /// is [`Self::block_absmax`], computed once per matmul.
    ///
    /// `rows.start` must be a multiple of [`Self::chunk_rows`].
    pub fn dense_rows(
        &self,
        rows: std::ops::Range<usize>,
        absmax: &Tensor<1>,
        dtype: DType,
    ) -> Tensor<2> {
        let dense = self
            .flex_dense_rows(&rows, absmax)
            .unwrap_or_else(|| self.dense_rows_by_ops(rows, absmax));
        if dtype == DType::F32 {
            dense
        } else {
            dense.cast(FloatDType::from(dtype))
        }
    }

    /// [`Self::dense_rows`] in f32 on flex with `u8` codes, as one loop over
    /// the codes: the same products (a code's value times its block's
    /// absmax, in f32) where the tensor ops made half a dozen fresh tensors
    /// a slice (the nibbles, their stack, the values, the product, the
    /// padding); a third of a QLoRA step on the CPU went there. `None`
    /// elsewhere.
    fn flex_dense_rows(
        &self,
        rows: &std::ops::Range<usize>,
        absmax: &Tensor<1>,
    ) -> Option<Tensor<2>> {
        use burn::backend::Flex;
        let scale = crate::flex_values::flex_f32(absmax)?;
        let packed = self.packed.clone().try_into_primitive::<Flex>().ok()?;
        if packed.dtype() != DType::U8 {
            return None;
        }
        let (start, end) = packed.layout().contiguous_offsets()?;
        let codes = &packed.storage::<u8>()[start..end];
        let scale = crate::flex_values::values(&scale);
        let cols = self.shape[1];
        let (first, last) = (rows.start * cols, rows.end * cols);
        debug_assert_eq!(first % BLOCK, 0, "a slice starts on a 64-block");
        let mut dense = Vec::with_capacity((last - first).next_multiple_of(BLOCK));
        let bytes = &codes[first / 2..last.div_ceil(2)];
        for (block, pairs) in bytes.chunks(BLOCK / 2).enumerate() {
            let s = scale[first / BLOCK + block];
            for byte in pairs {
                // The earlier value of a pair is the high nibble.
                dense.push(NF4_CODE[usize::from(byte >> 4)] * s);
                dense.push(NF4_CODE[usize::from(byte & 0x0f)] * s);
            }
        }
        dense.truncate(last - first);
        Some(Tensor::from_data(
            TensorData::new(dense, [rows.len(), cols]),
            (&self.packed.device(), DType::F32),
        ))
    }

    /// [`Self::dense_rows`] in f32 by burn's tensor ops (any device).
    fn dense_rows_by_ops(&self, rows: std::ops::Range<usize>, absmax: &Tensor<1>) -> Tensor<2> {
        let cols = self.shape[1];
        let (first, last) = (rows.start * cols, rows.end * cols);
        debug_assert_eq!(first % BLOCK, 0, "a slice starts on a 64-block");
        let device = self.packed.device();
        let packed = self.packed.clone().slice(first / 2..last.div_ceil(2));
        let bytes = packed.dims()[0];
        let high = packed.clone().div_scalar(16);
        let low = packed.remainder_scalar(16);
        // The earlier value of a pair is the high nibble.
        let codes = Tensor::stack::<2>(vec![high, low], 1).reshape([2 * bytes]);
        let code_values = Tensor::<1>::from_data(
            TensorData::new(NF4_CODE.to_vec(), [16]),
            (&device, DType::F32),
        );
        let blocks = (2 * bytes).div_ceil(BLOCK);
        let mut values = code_values.select(0, codes);
        if 2 * bytes < blocks * BLOCK {
            // The tensor's last, partial block.
            values = Tensor::cat(
                vec![
                    values,
                    Tensor::zeros([blocks * BLOCK - 2 * bytes], (&device, DType::F32)),
                ],
                0,
            );
        }
        let scale = absmax.clone().slice(first / BLOCK..first / BLOCK + blocks);
        (values.reshape([blocks, BLOCK]) * scale.reshape([blocks, 1]))
            .reshape([blocks * BLOCK])
            .slice(0..last - first)
            .reshape([rows.len(), cols])
    }

    /// The whole tensor dense, `[rows, cols]` in `dtype`.
    pub fn dense(&self, dtype: DType) -> Tensor<2> {
        self.dense_rows(0..self.shape[0], &self.block_absmax(), dtype)
    }
}

/// A decoder block's NF4 base weights by module: what stands in for its
/// linears' weights under QLoRA with `baseFormat: nf4` (empty otherwise).
/// The linears keep their adapters and an empty placeholder base.
#[derive(Clone, Debug, Default)]
pub struct Nf4Bases(std::collections::BTreeMap<TargetModule, Nf4Weight>);

impl Nf4Bases {
    pub fn get(&self, module: TargetModule) -> Option<&Nf4Weight> {
        self.0.get(&module)
    }

    pub fn insert(&mut self, module: TargetModule, weight: Nf4Weight) {
        self.0.insert(module, weight);
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::seeded::standard_normal;
    use serde_json::Value;

    const FIXTURE: &str = include_str!("../../tests/fixtures/nf4/fixture.json");

    fn fixture() -> Value {
        serde_json::from_str(FIXTURE).expect("nf4 fixture is JSON")
    }

    fn case<'a>(fixture: &'a Value, name: &str) -> &'a Value {
        fixture["cases"]
            .as_array()
            .expect("cases")
            .iter()
            .find(|c| c["name"] == name)
            .unwrap_or_else(|| panic!("no case {name}"))
    }

    fn hex_bytes(v: &Value) -> Vec<u8> {
        let s = v.as_str().expect("hex string");
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex digit"))
            .collect()
    }

    fn hex_f32(v: &Value) -> Vec<f32> {
        hex_bytes(v)
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    }

    fn u64_of(v: &Value) -> u64 {
        v.as_u64().expect("unsigned integer")
    }

    fn crc_f32(values: &[f32]) -> u32 {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        crc32fast::hash(&bytes)
    }

    fn shape_of(case: &Value) -> [usize; 2] {
        let s = case["shape"].as_array().expect("shape");
        [u64_of(&s[0]) as usize, u64_of(&s[1]) as usize]
    }

    /// Distance in float32 steps (ulps) between two finite floats.
    fn ulps(a: f32, b: f32) -> u32 {
        let key = |x: f32| {
            let bits = x.to_bits() as i32;
            if bits < 0 {
                i32::MIN.wrapping_sub(bits)
            } else {
                bits
            }
        };
        key(a).wrapping_sub(key(b)).unsigned_abs()
    }

    fn assert_bits_eq(what: &str, got: &[f32], want: &[f32]) {
        assert_eq!(got.len(), want.len(), "{what}: length");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert_eq!(
                g.to_bits(),
                w.to_bits(),
                "{what}[{i}]: {g:e} vs bitsandbytes {w:e}"
            );
        }
    }

    /// The `generated` cases' input, as make_fixture.py's `generated_case`:
    /// splitmix64, Irwin-Hall sum of four 24-bit uniforms, per-row scale.
    fn generated_input(rows: usize, cols: usize, seed: u64) -> Vec<f32> {
        let mut state = seed;
        let mut out = Vec::with_capacity(rows * cols);
        for r in 0..rows {
            let e = (r % 7) as i32 - 3;
            let pow2 = if e >= 0 {
                (1u32 << e) as f32
            } else {
                1.0 / (1u32 << -e) as f32
            };
            let scale = pow2 * (8 + (r % 5) as u32) as f32 / 8.0;
            for _ in 0..cols {
                let mut s: i64 = 0;
                for _ in 0..4 {
                    state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
                    let mut z = state;
                    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                    z ^= z >> 31;
                    s += (z >> 40) as i64;
                }
                s -= 1 << 25;
                out.push((s as f32 * (1.0 / 16_777_216.0)) * scale);
            }
        }
        out
    }

    fn input_of(fixture: &Value, case: &Value) -> Vec<f32> {
        if case.get("input_f32le").is_some() {
            return hex_f32(&case["input_f32le"]);
        }
        let [rows, cols] = shape_of(case);
        generated_input(rows, cols, u64_of(&fixture["generated_seed"]))
    }

    #[test]
    fn code_and_thresholds_are_bitsandbytes() {
        let fixture = fixture();
        assert_bits_eq("NF4 code", &NF4_CODE, &hex_f32(&fixture["nf4_code_f32le"]));
        // The CUDA kernel's literals (`dQuantizeNF4`), as f32: the midpoints
        // except for one ulp at four thresholds.
        #[allow(clippy::excessive_precision)]
        const CUDA_TREE: [f32; 15] = [
            -0.8480964004993439,
            -0.6106329262256622,
            -0.4599952697753906,
            -0.33967943489551544,
            -0.23460740596055984,
            -0.13791173323988914,
            -0.045525018125772476,
            0.03979014977812767,
            0.1202552504837513,
            0.2035212516784668,
            0.2920137718319893,
            0.3893125355243683,
            0.5016634166240692,
            0.6427869200706482,
            0.8614784181118011,
        ];
        let off_by_one: Vec<usize> = (0..15)
            .filter(|i| NF4_THRESHOLDS[*i] != CUDA_TREE[*i])
            .collect();
        assert_eq!(off_by_one, [0, 8, 12, 14]);
        for i in off_by_one {
            assert_eq!(ulps(NF4_THRESHOLDS[i], CUDA_TREE[i]), 1, "threshold {i}");
        }
        // On a threshold: the lower code; one float above: the upper one.
        for (i, t) in NF4_THRESHOLDS.iter().enumerate() {
            assert_eq!(bucketize(*t, &NF4_THRESHOLDS) as usize, i);
            assert_eq!(bucketize(t.next_up(), &NF4_THRESHOLDS) as usize, i + 1);
        }
        assert_eq!(bucketize(0.0, &NF4_THRESHOLDS), 7);
    }

    #[test]
    fn dynamic_map_is_the_one_bitsandbytes_used() {
        let fixture = fixture();
        assert_bits_eq(
            "dynamic map",
            dynamic_map(),
            &hex_f32(&fixture["dynamic_map_f32le"]),
        );
        let map = dynamic_map();
        assert_eq!(map[127], 0.0);
        assert_eq!(map[255], 1.0);
        assert_eq!(map.iter().filter(|v| **v < 0.0).count(), 127);
    }

    /// Every stored output of every case, bit for bit against bitsandbytes'
    /// reference pipeline.
    #[test]
    fn quantize_matches_bitsandbytes_bit_for_bit() {
        let fixture = fixture();
        let cases = fixture["cases"].as_array().expect("cases");
        assert_eq!(u64_of(&fixture["blocksize"]) as usize, BLOCK);
        assert_eq!(u64_of(&fixture["nested_blocksize"]) as usize, NESTED_BLOCK);
        for case in cases {
            let name = case["name"].as_str().expect("name");
            let shape = shape_of(case);
            let input = input_of(&fixture, case);
            let reference = &case["reference"];
            let q = Nf4Tensor::quantize(&input, shape);

            assert_eq!(
                q.offset.to_bits() as u64,
                u64_of(&reference["offset_bits"]),
                "{name}: offset {:e} vs {:?}",
                q.offset,
                reference["offset"]
            );
            assert_bits_eq(
                &format!("{name}: nested absmax"),
                &q.nested_absmax,
                &hex_f32(&reference["nested_absmax_f32le"]),
            );
            if reference.get("packed_u8").is_some() {
                let want = hex_bytes(&reference["packed_u8"]);
                for (i, (g, w)) in q.packed.iter().zip(&want).enumerate() {
                    assert_eq!(g, w, "{name}: packed byte {i}");
                }
                assert_eq!(q.packed.len(), want.len(), "{name}: packed length");
                assert_eq!(
                    q.absmax_codes,
                    hex_bytes(&reference["absmax_codes_u8"]),
                    "{name}: absmax codes"
                );
                assert_bits_eq(
                    &format!("{name}: dequantized absmax"),
                    &q.block_absmax(),
                    &hex_f32(&reference["dequantized_absmax_f32le"]),
                );
            }
            assert_eq!(
                crc32fast::hash(&q.packed) as u64,
                u64_of(&reference["packed_crc32"]),
                "{name}: packed crc"
            );
            assert_eq!(
                crc32fast::hash(&q.absmax_codes) as u64,
                u64_of(&reference["absmax_codes_crc32"]),
                "{name}: absmax codes crc"
            );
            assert_eq!(
                crc_f32(&q.block_absmax()) as u64,
                u64_of(&reference["dequantized_absmax_crc32"]),
                "{name}: dequantized absmax crc"
            );

            let dequantized = q.dequantize();
            assert_eq!(dequantized.len(), input.len());
            if reference.get("dequantized_f32le").is_some() {
                let want = hex_f32(&reference["dequantized_f32le"]);
                let max_ulps = dequantized
                    .iter()
                    .zip(&want)
                    .map(|(g, w)| ulps(*g, *w))
                    .max();
                println!("{name}: dequantized max difference {max_ulps:?} ulp");
                assert_bits_eq(&format!("{name}: dequantized"), &dequantized, &want);
            }
            assert_eq!(
                crc_f32(&dequantized) as u64,
                u64_of(&reference["dequantized_crc32"]),
                "{name}: dequantized crc"
            );
        }
    }

    /// The raw (pre-double-quantization) absmax and torch's mean of them.
    #[test]
    fn absmax_and_offset_follow_torch() {
        let fixture = fixture();
        for name in ["edge", "tiny", "generated"] {
            let case = case(&fixture, name);
            let input = input_of(&fixture, case);
            let (_, absmax) = quantize_blockwise(&input, BLOCK, &NF4_THRESHOLDS);
            assert_bits_eq(
                &format!("{name}: absmax"),
                &absmax,
                &hex_f32(&case["reference"]["absmax_f32le"]),
            );
            assert_eq!(
                torch_mean(&absmax).to_bits() as u64,
                u64_of(&case["reference"]["offset_bits"]),
                "{name}"
            );
        }
        // The all-zero 45-value tail of `tiny` keeps bitsandbytes' clamp as absmax.
        let tiny = case(&fixture, "tiny");
        let absmax = hex_f32(&tiny["reference"]["absmax_f32le"]);
        assert_eq!(absmax.last().copied(), Some(ABSMAX_FLOOR));
    }

    /// Tensors whose nested codes came from bitsandbytes' native CPU path (a
    /// lookup-table rounding) decode here exactly as bitsandbytes decodes them.
    #[test]
    fn dequantize_matches_bitsandbytes_public_cpu_path() {
        let fixture = fixture();
        let cases = fixture["cases"].as_array().expect("cases");
        for case in cases {
            let name = case["name"].as_str().expect("name");
            let public = &case["public_cpu"];
            let mut q = Nf4Tensor::quantize(&input_of(&fixture, case), shape_of(case));
            let reference_codes = q.absmax_codes.clone();
            q.absmax_codes = hex_bytes(&public["absmax_codes_u8"]);
            let differing = reference_codes
                .iter()
                .zip(&q.absmax_codes)
                .filter(|(a, b)| a != b)
                .count();
            assert_eq!(
                differing as u64,
                u64_of(&public["nested_code_diffs_vs_reference"]),
                "{name}"
            );
            println!(
                "{name}: bitsandbytes' native CPU nested codes differing from the reference: {differing} of {}",
                q.absmax_codes.len()
            );
            assert_eq!(
                crc32fast::hash(&q.absmax_codes) as u64,
                u64_of(&public["absmax_codes_crc32"]),
                "{name}"
            );
            let dequantized = q.dequantize();
            if let Some(want) = public.get("dequantized_f32le") {
                assert_bits_eq(
                    &format!("{name}: public dequantized"),
                    &dequantized,
                    &hex_f32(want),
                );
            }
            assert_eq!(
                crc_f32(&dequantized) as u64,
                u64_of(&public["dequantized_crc32"]),
                "{name}"
            );
        }
    }

    #[test]
    fn torch_sum_matches_torch() {
        let fixture = fixture();
        let check = &fixture["torch_sum_check"];
        let [rows, cols] = shape_of(check);
        let x = generated_input(rows, cols, u64_of(&fixture["generated_seed"]));
        assert_eq!(torch_sum(&x).to_bits() as u64, u64_of(&check["sum_bits"]));
    }

    #[test]
    fn torch_sum_is_a_cascade_sum() {
        // Exact where every order is exact; and short inputs take the scalar path.
        let ones = vec![1.0f32; 100_000];
        assert_eq!(torch_sum(&ones), 100_000.0);
        assert_eq!(torch_sum(&[0.5, 0.25, 2.0]), 2.75);
        assert_eq!(torch_sum(&[]), 0.0);
        // 2^24 and 4095 ones: a running f32 sum gives 2^24 (every 1 is lost),
        // the exact sum is 2^24 + 4095; torch 2.15 (`torch.ones(4096)` with
        // `x[0] = 2**24`, `.sum()`) gives 16781296 = 2^24 + 4080: the lane
        // holding 2^24 loses its other 15 ones, the other lanes keep theirs.
        let mut x = vec![1.0f32; 4096];
        x[0] = 16_777_216.0;
        assert_eq!(torch_sum(&x), 16_781_296.0);
    }

    /// Round trip on normal weights: each value is off by at most half the
    /// widest NF4 gap (between -1 and -0.696: 0.1519) times its block's
    /// absmax, plus the double quantization's error in that absmax.
    #[test]
    fn round_trip_error_is_within_nf4_resolution() {
        const HALF_WIDEST_GAP: f32 = (NF4_CODE[1] - NF4_CODE[0]) / 2.0;
        let shape = [256, 1024];
        let values: Vec<f32> = standard_normal(shape[0] * shape[1], 7)
            .into_iter()
            .map(|v| v * 0.02)
            .collect();
        let q = Nf4Tensor::quantize(&values, shape);
        let out = q.dequantize();
        let (_, exact_absmax) = quantize_blockwise(&values, BLOCK, &NF4_THRESHOLDS);
        let absmax = q.block_absmax();
        let (mut worst_block, mut worst_absmax, mut sq_err, mut sq) =
            (0.0f32, 0.0f32, 0.0f64, 0.0f64);
        for (b, (x, y)) in values.chunks(BLOCK).zip(out.chunks(BLOCK)).enumerate() {
            let a = exact_absmax[b];
            let absmax_err = (absmax[b] - a).abs();
            worst_absmax = worst_absmax.max(absmax_err / a);
            let mut block_err = 0.0f32;
            for (x, y) in x.iter().zip(y) {
                let err = (x - y).abs();
                assert!(
                    err <= HALF_WIDEST_GAP * a + absmax_err + 1e-7 * a,
                    "block {b}: |{x} - {y}| over the NF4 bound (absmax {a}, absmax error {absmax_err})"
                );
                block_err = block_err.max(err);
                sq_err += (err as f64).powi(2);
                sq += (*x as f64).powi(2);
            }
            worst_block = worst_block.max(block_err / a);
        }
        println!(
            "NF4 round trip on N(0, 0.02) {shape:?}: max |error| / block absmax {worst_block:.4} (bound {HALF_WIDEST_GAP:.4} + absmax error), \
             max double-quantization relative absmax error {worst_absmax:.2e}, relative RMS error {:.4}",
            (sq_err / sq).sqrt()
        );
        assert!(worst_block <= HALF_WIDEST_GAP + worst_absmax + 1e-6);
        assert!(
            worst_absmax < 0.01,
            "double quantization error {worst_absmax}"
        );
    }

    #[test]
    fn about_4_127_bits_per_value() {
        let bits = |shape: [usize; 2]| {
            Nf4Tensor::bytes_for(shape) as f64 * 8.0 / (shape[0] * shape[1]) as f64
        };
        let big = bits([4096, 4096]);
        assert_eq!(
            Nf4Tensor::bytes_for([4096, 4096]),
            8_388_608 + 262_144 + 4 * 1024 + 4
        );
        assert!((big - 4.127).abs() < 1e-3, "{big}");
        let shape = [1024, 1024];
        let q = Nf4Tensor::quantize(&standard_normal(shape[0] * shape[1], 3), shape);
        assert_eq!(q.bytes(), Nf4Tensor::bytes_for(shape));
        let measured = q.bytes() as f64 * 8.0 / q.len() as f64;
        println!("NF4 bits per value: {big:.5} (4096x4096), {measured:.5} (1024x1024, quantized)");
        assert!((measured - 4.127).abs() < 1e-3, "{measured}");
        // Odd counts round the packed bytes up.
        assert_eq!(Nf4Tensor::bytes_for([7, 43]), 151 + 5 + 4 + 4);
    }

    #[test]
    fn to_tensor_is_the_dequantized_dense_tensor() {
        let shape = [3, 200];
        let values = standard_normal(600, 11);
        let q = Nf4Tensor::quantize(&values, shape);
        let t = q.to_tensor(&Device::flex());
        assert_eq!(t.dims(), shape);
        let dense: Vec<f32> = t.into_data().iter::<f32>().collect();
        assert_bits_eq("to_tensor", &dense, &q.dequantize());
    }

    /// The device copy decodes to the host's values bit for bit, whole and
    /// a slice of rows at a time, partial last block and odd count included.
    #[test]
    fn the_device_copy_dequantizes_as_the_host_does() {
        let device = Device::flex();
        for (shape, chunk) in [
            ([48, 128], 1 << 22),
            ([48, 128], 640),
            ([7, 43], 100),
            ([300, 64], 64 * 256 + 1),
        ] {
            let values = standard_normal(shape[0] * shape[1], 3);
            let host = Nf4Tensor::quantize(&values, shape);
            let w = Nf4Weight::upload(&host, &device).with_chunk_values(chunk);
            assert_eq!(w.bytes(), host.bytes());
            let absmax: Vec<f32> = w.block_absmax().into_data().iter::<f32>().collect();
            assert_bits_eq("block absmax", &absmax, &host.block_absmax());
            let whole: Vec<f32> = w.dense(DType::F32).into_data().iter::<f32>().collect();
            assert_bits_eq("whole", &whole, &host.dequantize());
            let step = w.chunk_rows();
            assert!(step >= 1 && ((step * shape[1]).is_multiple_of(BLOCK) || step == shape[0]));
            let absmax = w.block_absmax();
            // flex's own loop (what `dense_rows` runs here) and the tensor
            // ops every other device runs.
            let (mut sliced, mut by_ops) = (Vec::new(), Vec::new());
            for start in (0..shape[0]).step_by(step) {
                let rows = start..(start + step).min(shape[0]);
                let part = w.dense_rows(rows.clone(), &absmax, DType::F32);
                assert_eq!(part.dims(), [rows.len(), shape[1]]);
                assert!(w.flex_dense_rows(&rows, &absmax).is_some());
                sliced.extend(part.into_data().iter::<f32>());
                let part = w.dense_rows_by_ops(rows.clone(), &absmax);
                assert_eq!(part.dims(), [rows.len(), shape[1]]);
                by_ops.extend(part.into_data().iter::<f32>());
            }
            assert_bits_eq("sliced", &sliced, &host.dequantize());
            assert_bits_eq("sliced by tensor ops", &by_ops, &host.dequantize());
        }
    }

    #[test]
    fn nibble_order_and_zero_block() {
        // [-1, 1, 0, ...]: first value in the high nibble; an all-zero block
        // codes 0.0 (index 7); the odd count pads the last low nibble with 7.
        let mut values = vec![0.0f32; 129];
        values[0] = -1.0;
        values[1] = 1.0;
        let q = Nf4Tensor::quantize(&values, [1, 129]);
        assert_eq!(q.packed[0], 0x0f);
        assert_eq!(q.packed[1], 0x77);
        assert!(q.packed[32..].iter().all(|b| *b == 0x77));
        assert_eq!(q.packed.len(), 65);
        assert!(q.dequantize()[2..].iter().all(|v| *v == 0.0));
    }
}
