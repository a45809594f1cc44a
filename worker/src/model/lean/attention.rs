//! Causal self-attention in blocks (FlashAttention-2, Dao 2023), written
//! over burn's tensor API on one backend (no autodiff graph): the forward
//! returns the output and each row's logsumexp, the backward recomputes the
//! probabilities block by block from them. No `s × s` tensor outlives one
//! pair of blocks, so what a layer keeps for backward is linear in `s`:
//! q, k, v, the output and one f32 per row per head.
//!
//! Grouped-query attention is done by layout, not by copies: the query heads
//! of a key/value head are stacked as rows (`[b, kv, g·n, d]` against
//! `[b, kv, n, d]`), so k and v are never repeated, and dk, dv sum over the
//! group by the same matmul.
//!
//! Packed documents ([`Segments`]) block attention between the documents
//! of a row: a query sees only keys of its own document. Block pairs no
//! query of any row can see into are skipped as the causal ones are.
//!
//! The [`super`] module wraps these functions in one autodiff op.

use std::ops::Range;
use std::sync::Arc;

use burn::tensor::{Bool, DType, Int, Tensor, TensorData};

use super::exp::exp;

/// A score that removes a key: finite in the scores' dtype, so a row whose
/// first visited block is all masked (possible with a sliding window or
/// packed documents) gives `exp(0)` terms that the next block's larger
/// maximum rescales to exactly zero, instead of NaN. -1e30 is -inf in f16
/// (whose largest finite value is 65504), so f16 scores take f16's lowest.
fn masked(dtype: DType) -> f32 {
    match dtype {
        DType::F16 => -65504.0,
        _ => -1.0e30,
    }
}

/// Which document each token of each batch row belongs to, where a row
/// holds several (packing by documents): a document is a run of equal ids,
/// and a query sees only keys of its own run.
#[derive(Clone, Debug, PartialEq)]
pub struct Segments {
    /// Per row and token (`[b, s]` row-major), the first token of its run.
    starts: Arc<[usize]>,
    rows: usize,
    seq: usize,
}

impl Segments {
    /// `ids`: `[rows, seq]` row-major, a document id per token.
    pub fn new(ids: &[u32], rows: usize, seq: usize) -> Self {
        assert_eq!(ids.len(), rows * seq, "a segment id per token of each row");
        let mut starts = Vec::with_capacity(ids.len());
        for row in ids.chunks(seq.max(1)) {
            let mut start = 0;
            for (t, id) in row.iter().enumerate() {
                if t > 0 && *id != row[t - 1] {
                    start = t;
                }
                starts.push(start);
            }
        }
        Segments {
            starts: starts.into(),
            rows,
            seq,
        }
    }

    /// Rows (the batch).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Tokens per row.
    pub fn seq(&self) -> usize {
        self.seq
    }

    /// The first token of the document token `t` of row `row` is in.
    pub fn start(&self, row: usize, t: usize) -> usize {
        self.starts[row * self.seq + t]
    }
}

/// What shapes one attention call; everything but `scale` is optional.
#[derive(Clone, Debug, PartialEq)]
pub struct AttentionOptions {
    /// Multiplies q·kᵀ (1/√d for Llama; Gemma's `query_pre_attn_scalar`^-½).
    pub scale: f64,
    /// Query and key rows per block: the transient scores of one block pair
    /// are `b · heads · block²` values.
    pub block: usize,
    /// Gemma 2's attention soft-capping: `cap · tanh(scores / cap)`.
    pub softcap: Option<f64>,
    /// Sliding window: a query sees the `window` most recent keys (itself
    /// included); `None` for global attention.
    pub window: Option<usize>,
    /// Packed documents, each query seeing only its own; `None`: a row is
    /// one sequence (then the masks depend on distance alone).
    pub segments: Option<Segments>,
}

impl AttentionOptions {
    /// Global causal attention with the usual 1/√d scale.
    pub fn causal(head_dim: usize, block: usize) -> Self {
        AttentionOptions {
            scale: 1.0 / (head_dim as f64).sqrt(),
            block,
            softcap: None,
            window: None,
            segments: None,
        }
    }

    /// Is key `k` visible from query `q`?
    fn visible(&self, q: usize, k: usize) -> bool {
        k <= q && self.window.is_none_or(|w| q - k < w)
    }

    /// Whether the block pair has any visible key (in some row), and
    /// whether it needs a mask.
    fn pair(&self, q: &Range<usize>, k: &Range<usize>) -> (bool, bool) {
        // The nearest pair is the latest key not after the earliest query
        // it can serve: distance 0 where the ranges overlap.
        let nearest = q.start.saturating_sub(k.end - 1);
        let any = k.start < q.end && self.window.is_none_or(|w| nearest < w);
        let all = self.visible(q.start, k.end - 1) && self.visible(q.end - 1, k.start);
        let Some(segments) = &self.segments else {
            return (any, !all);
        };
        if !any {
            return (false, true);
        }
        // Query `t` sees keys from the later of its document's start and
        // its window's first key, up to itself.
        let first = |row, t: usize| {
            let window_start = self.window.map_or(0, |w| (t + 1).saturating_sub(w));
            segments.start(row, t).max(window_start)
        };
        let any = (0..segments.rows()).any(|row| {
            q.clone()
                .any(|t| first(row, t).max(k.start) <= t.min(k.end - 1))
        });
        let whole =
            (0..segments.rows()).all(|row| q.clone().all(|t| segments.start(row, t) <= k.start));
        (any, !(all && whole))
    }
}

/// The masks of one call's block pairs. Without segments visibility
/// depends only on the distance between query and key, so pairs at the
/// same offset with the same lengths (every diagonal pair but a partial
/// last one) share one mask, built once for the forward or the backward;
/// with segments a mask is its pair's own (keyed by where it starts).
struct Masks<'a> {
    options: &'a AttentionOptions,
    dims: [usize; 3],
    device: burn::tensor::Device,
    built: std::collections::HashMap<(isize, usize, usize, Option<usize>), Tensor<4, Bool>>,
}

impl<'a> Masks<'a> {
    fn new(options: &'a AttentionOptions, dims: [usize; 3], device: burn::tensor::Device) -> Self {
        Masks {
            options,
            dims,
            device,
            built: std::collections::HashMap::new(),
        }
    }

    fn get(&mut self, q: &Range<usize>, k: &Range<usize>) -> Tensor<4, Bool> {
        let absolute = self.options.segments.as_ref().map(|_| q.start);
        let key = (
            q.start as isize - k.start as isize,
            q.len(),
            k.len(),
            absolute,
        );
        let (options, dims, device) = (self.options, self.dims, &self.device);
        self.built
            .entry(key)
            .or_insert_with(|| mask(options, q, k, dims, device))
            .clone()
    }
}

fn blocks(len: usize, block: usize) -> Vec<Range<usize>> {
    let block = block.max(1);
    (0..len.div_ceil(block))
        .map(|i| i * block..((i + 1) * block).min(len))
        .collect()
}

/// `[b, a, s, d]` → `[b, kv, g, s, d]`: query head `j·g + i` is member `i`
/// of key/value head `j`'s group (transformers' `repeat_kv` order).
fn grouped(t: Tensor<4>, kv: usize) -> Tensor<5> {
    let [b, a, s, d] = t.dims();
    t.reshape([b, kv, a / kv, s, d])
}

/// Rows `r` of every group member, stacked: `[b, kv, g·|r|, d]`.
fn rows(t: &Tensor<5>, r: &Range<usize>) -> Tensor<4> {
    let [b, kv, g, _, d] = t.dims();
    t.clone()
        .narrow(3, r.start, r.len())
        .reshape([b, kv, g * r.len(), d])
}

/// The mask of one block pair, `true` where a key is hidden, broadcast to
/// `[b, kv, g·|q|, |k|]`.
fn mask(
    options: &AttentionOptions,
    q: &Range<usize>,
    k: &Range<usize>,
    dims: [usize; 3],
    device: &burn::tensor::Device,
) -> Tensor<4, Bool> {
    let [b, kv, g] = dims;
    if let Some(segments) = &options.segments {
        return segment_mask(options, segments, q, k, dims, device);
    }
    let mut hidden = Vec::with_capacity(g * q.len() * k.len());
    for _ in 0..g {
        for qi in q.clone() {
            hidden.extend(k.clone().map(|ki| !options.visible(qi, ki)));
        }
    }
    Tensor::<2, Bool>::from_data(TensorData::new(hidden, [g * q.len(), k.len()]), device)
        .unsqueeze::<4>()
        .expand([b, kv, g * q.len(), k.len()])
}

/// [`mask`] with segments: a row's own, so built on the device from each
/// query's document start (the host sends `b · |q|` integers, not the
/// `b · |q| · |k|` mask): a key is hidden after its query, before the
/// query's document, or outside its window.
fn segment_mask(
    options: &AttentionOptions,
    segments: &Segments,
    q: &Range<usize>,
    k: &Range<usize>,
    [b, kv, g]: [usize; 3],
    device: &burn::tensor::Device,
) -> Tensor<4, Bool> {
    let (n, m) = (q.len(), k.len());
    let shape = [b, n, m];
    let starts: Vec<i64> = (0..b)
        .flat_map(|row| q.clone().map(move |t| segments.start(row, t) as i64))
        .collect();
    let starts =
        Tensor::<3, Int>::from_data(TensorData::new(starts, [b, n, 1]), device).expand(shape);
    let queries = Tensor::<1, Int>::arange(q.start as i64..q.end as i64, device)
        .reshape([1, n, 1])
        .expand(shape);
    let keys = Tensor::<1, Int>::arange(k.start as i64..k.end as i64, device)
        .reshape([1, 1, m])
        .expand(shape);
    let mut hidden = keys
        .clone()
        .greater(queries.clone())
        .bool_or(keys.clone().lower(starts));
    if let Some(w) = options.window {
        hidden = hidden.bool_or((queries - keys).greater_equal_elem(w as i64));
    }
    // Every group member's rows alike: [b, g·|q|, |k|], then each kv head.
    hidden
        .unsqueeze_dim::<4>(1)
        .expand([b, g, n, m])
        .reshape([b, 1, g * n, m])
        .expand([b, kv, g * n, m])
}

/// Scores of one block pair from queries already multiplied by the scale
/// ([`scaled`]), after soft-capping and masking; with soft-capping also
/// `tanh(scores / cap)`, which the backward needs.
fn scores(
    options: &AttentionOptions,
    qb: Tensor<4>,
    kb: Tensor<4>,
    hidden: Option<Tensor<4, Bool>>,
) -> (Tensor<4>, Option<Tensor<4>>) {
    let s = qb.matmul(kb.transpose());
    let (s, tanh) = match options.softcap {
        Some(cap) => {
            let t = s.div_scalar(cap).tanh();
            (t.clone().mul_scalar(cap), Some(t))
        }
        None => (s, None),
    };
    match hidden {
        Some(hidden) => {
            let value = masked(s.dtype());
            (s.mask_fill(hidden, value), tanh)
        }
        None => (s, tanh),
    }
}

/// `q` times the scale: one pass over `[b, a, s, d]` instead of one over
/// every block pair's scores, forward and backward (d is 64–256 where a
/// block is 256 keys wide). Exact where the scale is a power of two
/// (1/√64, 1/√256), within an ulp of the scores otherwise.
fn scaled(q: Tensor<4>, options: &AttentionOptions) -> Tensor<4> {
    q.mul_scalar(options.scale)
}

/// Forward: `q` [b, a, s, d], `k`, `v` [b, kv, s, d] → the output
/// [b, a, s, d] and each query row's logsumexp, one [b, kv, g·n, 1] tensor
/// per query block.
pub fn forward(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    options: &AttentionOptions,
) -> (Tensor<4>, Vec<Tensor<4>>) {
    let [b, a, s, d] = q.dims();
    let kv = k.dims()[1];
    let g = a / kv;
    let device = q.device();
    let qg = grouped(scaled(q, options), kv);
    let ranges = blocks(s, options.block);
    let mut masks = Masks::new(options, [b, kv, g], device);
    let mut outputs = Vec::with_capacity(ranges.len());
    let mut logsumexp = Vec::with_capacity(ranges.len());
    for qr in &ranges {
        let qb = rows(&qg, qr);
        // Running row maximum, sum of exponentials and weighted values.
        let mut state: Option<(Tensor<4>, Tensor<4>, Tensor<4>)> = None;
        for kr in &ranges {
            let (any, masked) = options.pair(qr, kr);
            if !any {
                continue;
            }
            let hidden = masked.then(|| masks.get(qr, kr));
            let kb = k.clone().narrow(2, kr.start, kr.len());
            let vb = v.clone().narrow(2, kr.start, kr.len());
            let (sc, _) = scores(options, qb.clone(), kb, hidden);
            let block_max = sc.clone().max_dim(3);
            let m = match &state {
                Some((m, _, _)) => m.clone().max_pair(block_max),
                None => block_max,
            };
            let p = exp(sc - m.clone());
            let row_sum = p.clone().sum_dim(3);
            let pv = p.matmul(vb);
            state = Some(match state {
                Some((m_old, l, acc)) => {
                    let alpha = exp(m_old - m.clone());
                    (m, l * alpha.clone() + row_sum, acc * alpha + pv)
                }
                None => (m, row_sum, pv),
            });
        }
        let (m, l, acc) = state.expect("every query sees at least itself");
        outputs.push((acc / l.clone()).reshape([b, kv, g, qr.len(), d]));
        logsumexp.push(m + l.log());
    }
    let output = Tensor::cat(outputs, 3).reshape([b, a, s, d]);
    (output, logsumexp)
}

/// Backward: the gradients of q, k and v from the output's gradient `dout`,
/// recomputing each block pair's probabilities from the saved logsumexp.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    output: Tensor<4>,
    logsumexp: &[Tensor<4>],
    dout: Tensor<4>,
    options: &AttentionOptions,
) -> (Tensor<4>, Tensor<4>, Tensor<4>) {
    let [b, a, s, d] = q.dims();
    let kv = k.dims()[1];
    let g = a / kv;
    let device = q.device();
    let ranges = blocks(s, options.block);
    let mut masks = Masks::new(options, [b, kv, g], device.clone());
    let (qg, og, dog) = (
        grouped(scaled(q, options), kv),
        grouped(output, kv),
        grouped(dout, kv),
    );
    let qbs: Vec<Tensor<4>> = ranges.iter().map(|r| rows(&qg, r)).collect();
    let dobs: Vec<Tensor<4>> = ranges.iter().map(|r| rows(&dog, r)).collect();
    // D_i = rowsum(dO ∘ O).
    let deltas: Vec<Tensor<4>> = ranges
        .iter()
        .zip(&dobs)
        .map(|(r, dob)| (dob.clone() * rows(&og, r)).sum_dim(3))
        .collect();
    let mut dqs: Vec<Option<Tensor<4>>> = vec![None; ranges.len()];
    let mut dks = Vec::with_capacity(ranges.len());
    let mut dvs = Vec::with_capacity(ranges.len());
    for kr in &ranges {
        let kb = k.clone().narrow(2, kr.start, kr.len());
        let vb = v.clone().narrow(2, kr.start, kr.len());
        let mut dk: Option<Tensor<4>> = None;
        let mut dv: Option<Tensor<4>> = None;
        for (i, qr) in ranges.iter().enumerate() {
            let (any, masked) = options.pair(qr, kr);
            if !any {
                continue;
            }
            let hidden = masked.then(|| masks.get(qr, kr));
            let (sc, tanh) = scores(options, qbs[i].clone(), kb.clone(), hidden);
            let p = exp(sc - logsumexp[i].clone()); // [b, kv, g·n, m]
            let pv = p.clone().transpose().matmul(dobs[i].clone());
            dv = Some(match dv {
                Some(dv) => dv + pv,
                None => pv,
            });
            let dp = dobs[i].clone().matmul(vb.clone().transpose());
            let mut ds = p * (dp - deltas[i].clone());
            if let Some(t) = tanh {
                ds = ds * (t.clone() * t).neg().add_scalar(1.0);
            }
            // The scale of d(scores)/dq is applied once to the whole dq
            // below; dk's is in the scaled queries.
            let dq = ds.clone().matmul(kb.clone());
            dqs[i] = Some(match dqs[i].take() {
                Some(acc) => acc + dq,
                None => dq,
            });
            let dkb = ds.transpose().matmul(qbs[i].clone());
            dk = Some(match dk {
                Some(acc) => acc + dkb,
                None => dkb,
            });
        }
        // A key block no query sees (only with a window) has zero gradients.
        let zeros = || Tensor::<4>::zeros([b, kv, kr.len(), d], &device);
        dks.push(dk.unwrap_or_else(zeros));
        dvs.push(dv.unwrap_or_else(zeros));
    }
    let dq = ranges
        .iter()
        .zip(dqs)
        .map(|(r, dq)| {
            dq.expect("every query block sees its own keys")
                .reshape([b, kv, g, r.len(), d])
        })
        .collect();
    (
        Tensor::cat(dq, 3)
            .reshape([b, a, s, d])
            .mul_scalar(options.scale),
        Tensor::cat(dks, 2),
        Tensor::cat(dvs, 2),
    )
}

/// The attention every model used before this op: scores, softmax over
/// `[b, a, s, s]`, weights·v, with k and v repeated per query head. Kept as
/// the reference the tests hold the blocked op to.
pub fn naive(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>, options: &AttentionOptions) -> Tensor<4> {
    let [b, a, s, d] = q.dims();
    let kv = k.dims()[1];
    let device = q.device();
    let repeat = |t: Tensor<4>| {
        if a == kv {
            return t;
        }
        t.unsqueeze_dim::<5>(2)
            .expand([b, kv, a / kv, s, d])
            .reshape([b, a, s, d])
    };
    let (k, v) = (repeat(k), repeat(v));
    let full = 0..s;
    let hidden = mask(options, &full, &full, [b, a, 1], &device);
    let (sc, _) = scores(options, scaled(q, options), k, Some(hidden));
    burn::tensor::activation::softmax(sc, 3).matmul(v)
}
