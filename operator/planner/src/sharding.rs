//! ZeRO-1 over d data-parallel replicas: which replica keeps, and updates,
//! each trained tensor's optimizer state.
//!
//! The worker shards whole tensors, not slices of one flat buffer as
//! DeepSpeed does: burn's optimizers keep their state per parameter tensor,
//! so a replica that owns a tensor steps it with the unchanged optimizer and
//! the others never allocate its state. The price is balance: the largest
//! share is at least the largest tensor (an embedding table), so the
//! planner budgets the largest share this function gives, not 1/d of the
//! total. The planner and the worker call the same function on the same
//! tensor sizes, so the two cannot drift.
//!
//! Communication is what ZeRO-1 costs nothing extra for: the summed
//! gradients are reduce-scattered (each replica receives the sum of the
//! tensors it owns) and the updated weights all-gathered, together the bytes
//! of one all-reduce. The worker moves them in buckets
//! ([`BackendProfile::collective_bucket_bytes`](crate::backend::BackendProfile::collective_bucket_bytes))
//! through the ring in chunks of an eighth of a bucket, so the transient a
//! replica holds beside its model states is bounded
//! ([`collective_buffer_bytes`]) whatever the model's size.

/// Chunk the ring moves at once for a bucket of `bucket_bytes`: an eighth,
/// so that the ring's queues stay a few buckets' worth.
pub fn ring_chunk_bytes(bucket_bytes: u64) -> u64 {
    (bucket_bytes / 8).max(4096)
}

/// What a replica holds for the collective beside its model states, bytes:
/// the bucket itself, and the ring's chunks in flight (the worker's TCP
/// ring keeps up to 8 spare chunk buffers and 3 queued to its socket, and
/// up to 5 per replica queued from its predecessor:
/// `worker/src/collective/ring.rs`).
pub fn collective_buffer_bytes(bucket_bytes: u64, replicas: u32) -> u64 {
    if replicas <= 1 {
        return 0;
    }
    bucket_bytes + (11 + 5 * u64::from(replicas)) * ring_chunk_bytes(bucket_bytes)
}

/// The replica that owns each tensor of `sizes` (elements), for `replicas`
/// ranks: longest-processing-time greedy (largest tensor first to the least
/// loaded rank; ties to the earlier tensor and the lower rank), which keeps
/// the largest share within 4/3 of the best possible. Deterministic: the
/// same sizes give the same owners on every replica.
pub fn shard_owners(sizes: &[u64], replicas: u32) -> Vec<u32> {
    let d = replicas.max(1) as usize;
    let mut order: Vec<usize> = (0..sizes.len()).collect();
    // Stable: equal sizes keep their module order.
    order.sort_by(|&a, &b| sizes[b].cmp(&sizes[a]));
    let mut loads = vec![0u64; d];
    let mut owners = vec![0u32; sizes.len()];
    for i in order {
        let (rank, _) = loads
            .iter()
            .enumerate()
            .min_by_key(|&(r, load)| (*load, r))
            .expect("at least one replica");
        loads[rank] += sizes[i];
        owners[i] = rank as u32;
    }
    owners
}

/// What each replica owns under [`shard_owners`], in elements.
pub fn shard_loads(sizes: &[u64], replicas: u32) -> Vec<u64> {
    let mut loads = vec![0u64; replicas.max(1) as usize];
    for (size, owner) in sizes.iter().zip(shard_owners(sizes, replicas)) {
        loads[owner as usize] += size;
    }
    loads
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_replica_owns_everything() {
        assert_eq!(shard_owners(&[5, 3, 9], 1), [0, 0, 0]);
        assert_eq!(shard_loads(&[5, 3, 9], 1), [17]);
    }

    #[test]
    fn largest_first_to_the_least_loaded() {
        // 9 → r0; 5 → r1; 4 → r1 (5 < 9); 3 → r0 (9 = 9, the lower rank).
        let sizes = [4, 9, 3, 5];
        assert_eq!(shard_owners(&sizes, 2), [1, 0, 0, 1]);
        assert_eq!(shard_loads(&sizes, 2), [12, 9]);
    }

    #[test]
    fn shares_are_balanced_within_the_largest_tensor() {
        // A Llama-like stage: one large embedding and many equal block linears.
        let mut sizes = vec![32_000 * 512];
        sizes.extend(std::iter::repeat_n(512 * 512, 56));
        sizes.extend(std::iter::repeat_n(512 * 1376, 24));
        let total: u64 = sizes.iter().sum();
        for d in [2, 3, 4, 8] {
            let loads = shard_loads(&sizes, d);
            assert_eq!(loads.iter().sum::<u64>(), total);
            let max = *loads.iter().max().expect("loads");
            let ideal = total.div_ceil(u64::from(d));
            let largest = *sizes.iter().max().expect("sizes");
            assert!(max <= ideal.max(largest) + largest, "d {d}: {loads:?}");
        }
    }

    #[test]
    fn more_replicas_than_tensors_leave_some_empty() {
        assert_eq!(shard_loads(&[7, 7], 4), [7, 7, 0, 0]);
        assert_eq!(shard_loads(&[], 3), [0, 0, 0]);
    }
}
