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

/// How many tensors of each group each replica owns under [`shard_owners`],
/// without a value per tensor: `groups` are `(elements, count)` with
/// distinct sizes, largest first (the order the greedy takes them in);
/// the answer has a row per group, a count per replica. Equal tensors
/// come to the greedy one after another, and the first `k` it places
/// take the `k` smallest of every rank's next loads `load + j × elements`
/// (ties to the lower rank), so a group is placed by a search over that
/// threshold: the planner's estimate of a stage of a thousand layers
/// costs what a stage of two does.
pub fn shard_counts(groups: &[(u64, u64)], replicas: u32) -> Vec<Vec<u64>> {
    let mut loads = vec![0u64; replicas.max(1) as usize];
    groups
        .iter()
        .map(|&(elements, count)| {
            let counts = group_counts(&loads, elements, count);
            for (load, c) in loads.iter_mut().zip(&counts) {
                *load += c * elements;
            }
            counts
        })
        .collect()
}

/// `k` tensors of `size` elements placed greedily on ranks with `loads`:
/// each rank's count.
fn group_counts(loads: &[u64], size: u64, k: u64) -> Vec<u64> {
    let mut counts = vec![0u64; loads.len()];
    let least = loads.iter().copied().min().unwrap_or(0);
    if size == 0 || k == 0 {
        // Nothing changes the loads: every one goes to the first least loaded rank.
        if let Some(r) = loads.iter().position(|&l| l == least) {
            counts[r] = k;
        }
        return counts;
    }
    // Slots of a rank below `t`: its loads load + j·size < t.
    let below = |t: u64| -> u64 {
        loads
            .iter()
            .map(|&l| if t > l { (t - l).div_ceil(size) } else { 0 })
            .sum()
    };
    // The smallest t with at least k slots at or below it (the least
    // loaded rank alone has k by least + (k − 1)·size).
    let (mut lo, mut hi) = (least, least + (k - 1) * size);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if below(mid + 1) >= k {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    let mut left = k - below(lo);
    for (count, &l) in counts.iter_mut().zip(loads) {
        *count = if lo > l { (lo - l).div_ceil(size) } else { 0 };
        // The slots at exactly the threshold, lower ranks first.
        if left > 0 && lo >= l && (lo - l) % size == 0 {
            *count += 1;
            left -= 1;
        }
    }
    counts
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

    proptest::proptest! {
        /// The grouped count is the greedy's, tensor for tensor.
        #[test]
        fn shard_counts_are_the_greedys(
            groups in proptest::collection::vec((0u64..40, 0u64..30), 0..6),
            replicas in 1u32..10,
        ) {
            let mut groups: Vec<(u64, u64)> = groups;
            groups.sort_by_key(|g| std::cmp::Reverse(g.0));
            groups.dedup_by_key(|g| g.0);
            let sizes: Vec<u64> = groups
                .iter()
                .flat_map(|&(e, c)| std::iter::repeat_n(e, c as usize))
                .collect();
            let owners = shard_owners(&sizes, replicas);
            let mut expected = vec![vec![0u64; replicas as usize]; groups.len()];
            let mut i = 0;
            for (g, &(_, c)) in groups.iter().enumerate() {
                for _ in 0..c {
                    expected[g][owners[i] as usize] += 1;
                    i += 1;
                }
            }
            proptest::prop_assert_eq!(shard_counts(&groups, replicas), expected);
        }
    }

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
