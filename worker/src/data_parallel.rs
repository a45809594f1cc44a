//! Data parallelism with ZeRO-1: d replicas of a pipeline stage train the
//! same model on different shares of every global batch, average their
//! gradients each optimizer step, and each keeps (and updates) the optimizer
//! state of its share of the trained tensors only.
//!
//! **One step.** After a replica's micro-batches (and the tied-embedding
//! exchange of its pipeline), [`Replicas::reduce_gradients`] reduce-scatters
//! the summed gradients so that each replica holds the sum over replicas of
//! the tensors it owns, divides it by d and drops every other gradient:
//! burn's optimizers then step, and allocate state for, the owned tensors
//! only. After the optimizer step, [`Replicas::gather_parameters`]
//! all-gathers the updated owned tensors into every replica's model, so all
//! replicas start the next step from bitwise the same weights.
//!
//! **Ownership** ([`Shards`]) is `headroom_planner::sharding::shard_owners`
//! on the element counts of the stage's trained tensors (every parameter in
//! full fine-tuning, the LoRA factors with adapters) in module visit order:
//! the function the planner budgets the largest share with.
//!
//! **Buckets.** Gradients and weights go through the collective in buckets
//! of at most `BackendProfile::collective_bucket_bytes` of f32. A bucket is
//! laid out owner by owner: segment r (`counts[r]` elements) continues rank
//! r's *stream*, the concatenation of the tensors r owns in visit order, so a
//! tensor may span buckets. The bucket is shared among the ranks that still
//! have elements left, fairly (the smallest remainders first, the rest split
//! evenly), so buckets stay full while the loads differ. Besides the model
//! states a replica holds the bucket, the pieces being copied in or out of
//! it, and the ring's chunks in flight (an eighth of a bucket each): what
//! the planner counts as `collective_buffers`
//! (`headroom_planner::sharding::collective_buffer_bytes`).
//! Pieces are read with zero-copy slices and written back with
//! `slice_assign` on a uniquely held tensor, which the CPU backend does in
//! place.
//!
//! **The tied embedding of a multi-stage plan.** The first stage's token
//! embedding and the last stage's copy of it must stay bitwise equal, but
//! the two stages have different rings and different owners for it, and a
//! ring reduce-scatter adds the replicas' values in an order that starts at
//! the owner: with three or more replicas the two copies would differ in the
//! last bit. That one tensor is all-reduced instead (over even segments of
//! buckets that are the same on both stages, so the same order), its owner
//! steps it as usual, and both stages' owners compute the same update.
//!
//! **ParamIds.** burn draws a parameter's id at random when it is created,
//! and the optimizer state and the checkpoint files are keyed by it; the
//! replicas' ids must agree for one replica's checkpoint shard to be read by
//! another. [`stable_param_ids`] names every parameter after its part and
//! position (a resumed model takes the checkpoint's ids, which are then the
//! same on every replica too).
//!
//! d = 1 runs through the same calls with [`crate::collective::Single`] and
//! they return at once, so a single replica trains bit for bit as before.

use std::collections::{BTreeSet, HashMap};

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{Tensor, TensorData};
use headroom_planner::sharding::shard_owners;

use crate::collective::{Collective, CollectiveError};
use crate::model::lora::adapter_ids;
use crate::model::{Part, StageLayout, TransformerLm};

/// One tensor the stage trains.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TrainedTensor {
    pub id: ParamId,
    /// Its number of dimensions (how to fetch its gradient).
    pub rank: usize,
    pub elements: usize,
    /// The replica that keeps its optimizer state and updates it.
    pub owner: u32,
}

/// The stage's trained tensors in module visit order, each with its owner.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shards {
    pub tensors: Vec<TrainedTensor>,
    pub replicas: u32,
    /// Index in `tensors` of the tensor all-reduced rather than
    /// reduce-scattered (the tied embedding of a multi-stage plan).
    all_reduced: Option<usize>,
}

impl Shards {
    /// The tensors `model` trains (its LoRA factors when `adapters`, else
    /// every parameter), owned as the planner assumes for `replicas`.
    pub fn of(model: &TransformerLm, adapters: bool, replicas: u32) -> Self {
        struct All(Vec<(ParamId, usize, usize)>);
        impl ModuleVisitor for All {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                self.0
                    .push((param.id, D, param.lazy_shape().num_elements()));
            }
        }
        let mut all = All(Vec::new());
        model.visit(&mut all);
        let wanted: Option<BTreeSet<ParamId>> =
            adapters.then(|| adapter_ids(model).into_iter().collect());
        let mut seen = BTreeSet::new();
        let trained: Vec<(ParamId, usize, usize)> = all
            .0
            .into_iter()
            .filter(|(id, _, _)| wanted.as_ref().is_none_or(|w| w.contains(id)))
            .filter(|(id, _, _)| seen.insert(*id))
            .collect();
        let sizes: Vec<u64> = trained.iter().map(|t| t.2 as u64).collect();
        let owners = shard_owners(&sizes, replicas);
        Shards {
            tensors: trained
                .into_iter()
                .zip(owners)
                .map(|((id, rank, elements), owner)| TrainedTensor {
                    id,
                    rank,
                    elements,
                    owner,
                })
                .collect(),
            replicas: replicas.max(1),
            all_reduced: None,
        }
    }

    /// Sums `id`'s gradient with an all-reduce instead (see the module docs).
    pub fn all_reducing(mut self, id: ParamId) -> Self {
        self.all_reduced = self.tensors.iter().position(|t| t.id == id);
        self
    }

    /// The ParamIds `rank` owns.
    pub fn owned(&self, rank: u32) -> BTreeSet<u64> {
        self.tensors
            .iter()
            .filter(|t| t.owner == rank)
            .map(|t| t.id.val())
            .collect()
    }

    /// Elements each replica owns.
    pub fn loads(&self) -> Vec<usize> {
        let mut loads = vec![0; self.replicas as usize];
        for t in &self.tensors {
            loads[t.owner as usize] += t.elements;
        }
        loads
    }

    /// The buckets of at most `capacity` elements that carry the tensors
    /// (all but the all-reduced one when `skip_all_reduced`), owner by owner.
    pub fn buckets(&self, capacity: usize, skip_all_reduced: bool) -> Vec<Bucket> {
        let d = self.replicas as usize;
        let capacity = capacity.max(1);
        let streams: Vec<Vec<usize>> = (0..d)
            .map(|r| {
                (0..self.tensors.len())
                    .filter(|&i| self.tensors[i].owner as usize == r)
                    .filter(|&i| !(skip_all_reduced && self.all_reduced == Some(i)))
                    .collect()
            })
            .collect();
        let mut remaining: Vec<usize> = streams
            .iter()
            .map(|s| s.iter().map(|&i| self.tensors[i].elements).sum())
            .collect();
        // Where each stream is: the tensor (index into the stream) and the element in it.
        let mut cursor = vec![(0usize, 0usize); d];
        let mut buckets = Vec::new();
        while remaining.iter().any(|&n| n > 0) {
            let counts = fair_counts(&remaining, capacity);
            let mut pieces = vec![Vec::new(); d];
            for r in 0..d {
                let mut want = counts[r];
                while want > 0 {
                    let (k, start) = cursor[r];
                    let tensor = streams[r][k];
                    let len = want.min(self.tensors[tensor].elements - start);
                    pieces[r].push(Piece { tensor, start, len });
                    want -= len;
                    cursor[r] = if start + len == self.tensors[tensor].elements {
                        (k + 1, 0)
                    } else {
                        (k, start + len)
                    };
                }
                remaining[r] -= counts[r];
            }
            buckets.push(Bucket { counts, pieces });
        }
        buckets
    }
}

/// `capacity` elements shared among ranks with `remaining` elements left:
/// the smallest remainders take what they need, the rest split evenly.
fn fair_counts(remaining: &[usize], capacity: usize) -> Vec<usize> {
    let mut counts = vec![0; remaining.len()];
    let mut order: Vec<usize> = (0..remaining.len()).filter(|&r| remaining[r] > 0).collect();
    order.sort_by_key(|&r| (remaining[r], r));
    let mut left = capacity;
    let mut ranks = order.len();
    for r in order {
        let take = remaining[r].min(left.div_ceil(ranks));
        counts[r] = take;
        left -= take;
        ranks -= 1;
    }
    counts
}

/// A run of consecutive elements of one tensor in a bucket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    /// Index into [`Shards::tensors`].
    pub tensor: usize,
    /// First element (of the flattened tensor).
    pub start: usize,
    pub len: usize,
}

/// One collective call's buffer: segment r is `counts[r]` elements, rank r's
/// `pieces[r]` in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bucket {
    pub counts: Vec<usize>,
    pub pieces: Vec<Vec<Piece>>,
}

impl Bucket {
    fn len(&self) -> usize {
        self.counts.iter().sum()
    }

    /// Where segment `rank` starts.
    fn offset(&self, rank: usize) -> usize {
        self.counts[..rank].iter().sum()
    }
}

/// This worker's place among the replicas of its stage, and how it talks to
/// them for one step: the caller's collective, in buckets.
pub struct Replicas<'a> {
    collective: &'a mut dyn Collective,
    /// f32 values per bucket.
    bucket_elements: usize,
}

impl std::fmt::Debug for Replicas<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replicas")
            .field("rank", &self.rank())
            .field("size", &self.size())
            .field("bucket_elements", &self.bucket_elements)
            .finish()
    }
}

impl<'a> Replicas<'a> {
    /// Replicas talking through `collective` in buckets of `bucket_bytes`
    /// (f32 bytes: `BackendProfile::collective_bucket_bytes`; every replica
    /// must use the same).
    pub fn new(collective: &'a mut dyn Collective, bucket_bytes: u64) -> Self {
        Replicas {
            collective,
            bucket_elements: usize::try_from(bucket_bytes / 4)
                .unwrap_or(usize::MAX)
                .max(1),
        }
    }

    pub fn rank(&self) -> u32 {
        self.collective.rank()
    }

    pub fn size(&self) -> u32 {
        self.collective.size()
    }

    /// `value` summed over the replicas. It travels as two f32 (the value
    /// rounded, and what the rounding lost), so the sum keeps about 48 bits.
    pub fn sum(&mut self, value: f64) -> Result<f64, CollectiveError> {
        if self.size() <= 1 {
            return Ok(value);
        }
        let high = value as f32;
        let mut buffer = [high, (value - f64::from(high)) as f32];
        self.collective.all_reduce_sum(&mut buffer)?;
        Ok(f64::from(buffer[0]) + f64::from(buffer[1]))
    }

    /// The mean over every replica's `losses` (each replica's micro-batch
    /// losses; empty on stages that compute none, which is all replicas of
    /// the stage alike). One replica: the mean of its own, as before.
    pub fn mean_loss(&mut self, losses: &[f64]) -> Result<Option<f64>, CollectiveError> {
        if losses.is_empty() {
            return Ok(None);
        }
        let sum: f64 = losses.iter().sum();
        let d = self.size() as usize;
        if d <= 1 {
            return Ok(Some(sum / losses.len() as f64));
        }
        // Each rank's sum as two f32 (high and low part) and its count,
        // gathered: every rank then adds the same f64 values in rank order.
        let high = sum as f32;
        let low = (sum - f64::from(high)) as f32;
        let me = self.rank() as usize;
        let mut buffer = vec![0f32; 3 * d];
        buffer[3 * me..3 * me + 3].copy_from_slice(&[high, low, losses.len() as f32]);
        self.collective.all_gather(&mut buffer, &vec![3; d])?;
        let (mut total, mut count) = (0f64, 0f64);
        for rank in buffer.chunks_exact(3) {
            total += f64::from(rank[0]) + f64::from(rank[1]);
            count += f64::from(rank[2]);
        }
        Ok(Some(total / count))
    }

    /// Turns this replica's summed gradients into the mean over replicas of
    /// the tensors it owns, and removes the others. One replica: unchanged.
    pub fn reduce_gradients(
        &mut self,
        grads: &mut GradientsParams,
        shards: &Shards,
    ) -> Result<(), CollectiveError> {
        let d = self.size();
        if d <= 1 {
            return Ok(());
        }
        let me = self.rank();
        let scale = d as f32;
        // Every replica runs the same graph: a tensor without a gradient here
        // has none anywhere. It travels as zeros and is not stepped.
        let present: Vec<bool> = shards.tensors.iter().map(|t| has_grad(grads, t)).collect();
        if let Some(i) = shards.all_reduced {
            let t = &shards.tensors[i];
            let mut buffer = Vec::new();
            for start in (0..t.elements).step_by(self.bucket_elements) {
                let len = self.bucket_elements.min(t.elements - start);
                buffer.clear();
                buffer.resize(len, 0.0);
                if present[i] {
                    read_grad(grads, t, start, &mut buffer);
                }
                self.collective.all_reduce_sum(&mut buffer)?;
                if present[i] && t.owner == me {
                    buffer.iter_mut().for_each(|v| *v /= scale);
                    write_grad(grads, t, start, &buffer);
                }
            }
            if t.owner != me {
                remove_grad(grads, t);
            }
        }
        let mut buffer = Vec::new();
        for bucket in shards.buckets(self.bucket_elements, true) {
            buffer.clear();
            buffer.resize(bucket.len(), 0.0);
            let mut at = 0;
            for piece in bucket.pieces.iter().flatten() {
                let t = &shards.tensors[piece.tensor];
                if present[piece.tensor] {
                    read_grad(grads, t, piece.start, &mut buffer[at..at + piece.len]);
                }
                at += piece.len;
                // Sent in full: the gradient of a tensor another replica owns goes.
                if t.owner != me && piece.start + piece.len == t.elements {
                    remove_grad(grads, t);
                }
            }
            self.collective
                .reduce_scatter_sum(&mut buffer, &bucket.counts)?;
            let mut at = bucket.offset(me as usize);
            for piece in &bucket.pieces[me as usize] {
                let values = &mut buffer[at..at + piece.len];
                at += piece.len;
                if present[piece.tensor] {
                    values.iter_mut().for_each(|v| *v /= scale);
                    write_grad(grads, &shards.tensors[piece.tensor], piece.start, values);
                }
            }
        }
        Ok(())
    }

    /// Shares the tensors this replica updated with the others and writes
    /// theirs into `model`. Returns the model in every case: after an
    /// error it holds this replica's update and some of the others'.
    pub fn gather_parameters(
        &mut self,
        mut model: TransformerLm,
        shards: &Shards,
    ) -> (TransformerLm, Result<(), CollectiveError>) {
        let d = self.size();
        if d <= 1 {
            return (model, Ok(()));
        }
        let me = self.rank() as usize;
        let owned = flat_params(&model, &shards.owned(me as u32));
        let mut buffer = Vec::new();
        for bucket in shards.buckets(self.bucket_elements, false) {
            buffer.clear();
            buffer.resize(bucket.len(), 0.0);
            let mut at = bucket.offset(me);
            for piece in &bucket.pieces[me] {
                let t = &shards.tensors[piece.tensor];
                let param = owned
                    .get(&t.id.val())
                    .expect("an owned parameter of the model");
                copy_into(
                    param.clone().slice(piece.start..piece.start + piece.len),
                    &mut buffer[at..at + piece.len],
                );
                at += piece.len;
            }
            if let Err(e) = self.collective.all_gather(&mut buffer, &bucket.counts) {
                return (model, Err(e));
            }
            let mut writes: HashMap<u64, Vec<(usize, Vec<f32>)>> = HashMap::new();
            let mut at = 0;
            for (rank, pieces) in bucket.pieces.iter().enumerate() {
                for piece in pieces {
                    if rank != me {
                        writes
                            .entry(shards.tensors[piece.tensor].id.val())
                            .or_default()
                            .push((piece.start, buffer[at..at + piece.len].to_vec()));
                    }
                    at += piece.len;
                }
            }
            if !writes.is_empty() {
                model = model.map(&mut WritePieces(writes));
            }
        }
        (model, Ok(()))
    }
}

/// Calls `$f::<D>(args)` for a tensor of `$rank` dimensions.
macro_rules! by_rank {
    ($rank:expr, $f:ident($($arg:expr),*)) => {
        match $rank {
            1 => $f::<1>($($arg),*),
            2 => $f::<2>($($arg),*),
            3 => $f::<3>($($arg),*),
            4 => $f::<4>($($arg),*),
            other => panic!("a trained tensor of {other} dimensions (1 to 4 are handled)"),
        }
    };
}

fn has_grad(grads: &GradientsParams, t: &TrainedTensor) -> bool {
    fn has<const D: usize>(grads: &GradientsParams, id: ParamId) -> bool {
        grads.get::<D>(id).is_some()
    }
    by_rank!(t.rank, has(grads, t.id))
}

fn remove_grad(grads: &mut GradientsParams, t: &TrainedTensor) {
    fn remove<const D: usize>(grads: &mut GradientsParams, id: ParamId) {
        let _ = grads.remove::<D>(id);
    }
    by_rank!(t.rank, remove(grads, t.id))
}

/// Copies elements `start..start + out.len()` of `t`'s gradient into `out`.
fn read_grad(grads: &GradientsParams, t: &TrainedTensor, start: usize, out: &mut [f32]) {
    fn read<const D: usize>(
        grads: &GradientsParams,
        t: &TrainedTensor,
        start: usize,
        out: &mut [f32],
    ) {
        let grad: Tensor<D> = grads.get(t.id).expect("a gradient checked present");
        copy_into(
            grad.reshape([t.elements]).slice(start..start + out.len()),
            out,
        );
    }
    by_rank!(t.rank, read(grads, t, start, out))
}

/// Overwrites elements `start..start + values.len()` of `t`'s gradient.
fn write_grad(grads: &mut GradientsParams, t: &TrainedTensor, start: usize, values: &[f32]) {
    fn write<const D: usize>(
        grads: &mut GradientsParams,
        t: &TrainedTensor,
        start: usize,
        values: &[f32],
    ) {
        let grad: Tensor<D> = grads.remove(t.id).expect("a gradient checked present");
        grads.register(t.id, assign(grad, start, values.to_vec()));
    }
    by_rank!(t.rank, write(grads, t, start, values))
}

/// `tensor` with elements `start..` (flattened) replaced by `values`: in
/// place when the caller held the only reference.
fn assign<const D: usize>(tensor: Tensor<D>, start: usize, values: Vec<f32>) -> Tensor<D> {
    let dims = tensor.dims();
    let elements: usize = dims.iter().product();
    let flat = tensor.reshape([elements]);
    let device = flat.device();
    let len = values.len();
    let piece = Tensor::<1>::from_data(TensorData::new(values, [len]), &device).cast(flat.dtype());
    flat.slice_assign(start..start + len, piece).reshape(dims)
}

/// A 1-D tensor's values into `out` (same length), as f32.
fn copy_into(tensor: Tensor<1>, out: &mut [f32]) {
    let data = tensor.into_data().convert::<f32>();
    out.copy_from_slice(data.as_slice::<f32>().expect("f32 values"));
}

/// The parameters of `model` in `ids`, flattened (sharing their storage).
fn flat_params(model: &TransformerLm, ids: &BTreeSet<u64>) -> HashMap<u64, Tensor<1>> {
    struct Flat<'a> {
        ids: &'a BTreeSet<u64>,
        found: HashMap<u64, Tensor<1>>,
    }
    impl ModuleVisitor for Flat<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if self.ids.contains(&param.id.val()) {
                let value = param.val();
                let elements = value.shape().num_elements();
                self.found
                    .insert(param.id.val(), value.inner().reshape([elements]));
            }
        }
    }
    let mut flat = Flat {
        ids,
        found: HashMap::new(),
    };
    model.visit(&mut flat);
    flat.found
}

/// Writes pieces into the parameters they belong to, keeping each
/// parameter's id and autodiff state (as burn's optimizers do).
struct WritePieces(HashMap<u64, Vec<(usize, Vec<f32>)>>);

impl ModuleMapper for WritePieces {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let Some(pieces) = self.0.remove(&param.id.val()) else {
            return param;
        };
        let (id, tensor, mapper) = param.consume();
        let autodiff = tensor.is_autodiff();
        let require_grad = tensor.is_require_grad();
        let checkpointing = tensor.gradient_checkpointing_strategy();
        let mut value = tensor.inner();
        for (start, values) in pieces {
            value = assign(value, start, values);
        }
        if autodiff {
            value = Tensor::from_inner(value);
            if let Some(strategy) = checkpointing {
                value = value.with_gradient_checkpointing_strategy(strategy);
            }
            if require_grad {
                value = value.require_grad();
            }
        }
        Param::from_mapped_value(id, value, mapper)
    }
}

/// Names every parameter of `model` after its part and its position in it,
/// so that every replica (and every attempt) of a stage gives a parameter
/// the same id. A tied head's copy of the token embedding gets the first
/// stage's ids, as a checkpoint gives it.
pub fn stable_param_ids(model: TransformerLm, layout: &StageLayout) -> TransformerLm {
    struct Rename {
        part: u64,
        next: u64,
    }
    impl ModuleMapper for Rename {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let id = ParamId::from(crate::data::splitmix(
                PARAM_ID_SALT ^ (self.part << 20) ^ self.next,
            ));
            self.next += 1;
            let (_, tensor, mapper) = param.consume();
            Param::from_mapped_value(id, tensor, mapper)
        }
    }
    let code = |part: Part| match part {
        Part::Token => 1,
        Part::Position => 2,
        Part::Head => 3,
        Part::Block(i) => 16 + u64::from(i),
    };
    let rename = |part: Part| Rename {
        part: code(part),
        next: 0,
    };
    let mut model = model;
    model.token = model.token.take().map(|m| m.map(&mut rename(Part::Token)));
    model.position = model
        .position
        .take()
        .map(|m| m.map(&mut rename(Part::Position)));
    model.blocks = std::mem::take(&mut model.blocks)
        .into_iter()
        .zip(layout.layers.clone())
        .map(|(block, layer)| block.map(&mut rename(Part::Block(layer))))
        .collect();
    model.head = model.head.take().map(|m| m.map(&mut rename(Part::Head)));
    model
}

/// Keeps stable ids apart from any other use of `splitmix` on small numbers.
const PARAM_ID_SALT: u64 = 0x6865_6164_726f_6f6d; // "headroom"

#[cfg(test)]
mod tests {
    use super::*;

    fn shards(sizes: &[usize], replicas: u32) -> Shards {
        let owners = shard_owners(
            &sizes.iter().map(|&s| s as u64).collect::<Vec<_>>(),
            replicas,
        );
        Shards {
            tensors: sizes
                .iter()
                .zip(owners)
                .enumerate()
                .map(|(i, (&elements, owner))| TrainedTensor {
                    id: ParamId::from(i as u64),
                    rank: 1,
                    elements,
                    owner,
                })
                .collect(),
            replicas,
            all_reduced: None,
        }
    }

    #[test]
    fn fair_counts_fill_the_bucket() {
        assert_eq!(fair_counts(&[100, 100], 10), [5, 5]);
        assert_eq!(fair_counts(&[2, 100], 10), [2, 8]);
        assert_eq!(fair_counts(&[0, 100, 3], 10), [0, 7, 3]);
        assert_eq!(fair_counts(&[1, 1, 1], 2), [1, 1, 0]);
        assert_eq!(fair_counts(&[4, 4], 100), [4, 4]);
    }

    #[test]
    fn buckets_cover_every_stream_once_within_the_capacity() {
        let sizes = [7, 30, 3, 12, 5, 1];
        for d in [1, 2, 3, 4, 8] {
            let s = shards(&sizes, d);
            for capacity in [1, 4, 9, 64] {
                let buckets = s.buckets(capacity, false);
                let mut seen = vec![Vec::new(); sizes.len()];
                for b in &buckets {
                    assert!(b.len() <= capacity && b.len() > 0, "{b:?}");
                    for (r, pieces) in b.pieces.iter().enumerate() {
                        assert_eq!(pieces.iter().map(|p| p.len).sum::<usize>(), b.counts[r]);
                        for p in pieces {
                            assert_eq!(s.tensors[p.tensor].owner as usize, r, "owner by owner");
                            seen[p.tensor].push((p.start, p.len));
                        }
                    }
                }
                for (i, pieces) in seen.iter().enumerate() {
                    let mut next = 0;
                    for &(start, len) in pieces {
                        assert_eq!(start, next, "tensor {i} in order, no gap: {pieces:?}");
                        next += len;
                    }
                    assert_eq!(next, sizes[i], "tensor {i} complete");
                }
                let total: usize = sizes.iter().sum();
                assert!(buckets.len() >= total.div_ceil(capacity));
            }
        }
    }

    #[test]
    fn skipping_the_all_reduced_tensor() {
        let s = shards(&[8, 8, 8], 2).all_reducing(ParamId::from(1));
        let carried: usize = s
            .buckets(5, true)
            .iter()
            .flat_map(|b| b.pieces.iter().flatten())
            .map(|p| {
                assert_ne!(p.tensor, 1);
                p.len
            })
            .sum();
        assert_eq!(carried, 16);
        assert_eq!(s.owned(0).len() + s.owned(1).len(), 3);
        assert_eq!(s.loads().iter().sum::<usize>(), 24);
    }
}
