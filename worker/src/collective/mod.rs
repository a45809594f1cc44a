//! Collective communication between data-parallel replicas: the sums and
//! gathers that keep d copies of a pipeline stage training one model.
//!
//! Replicas of the same stage hold the same parameters and see different
//! micro-batches, so after every backward pass their gradients must be
//! summed ([`Collective::all_reduce_sum`]), or, when the optimizer state is
//! sharded, summed into one shard per replica
//! ([`Collective::reduce_scatter_sum`]) and the updated shards shared again
//! ([`Collective::all_gather`]).
//!
//! **Why an interface.** On the CPU the replicas talk over TCP
//! ([`ring::Ring`]); on GPUs the same three calls belong to NCCL, which does
//! the same ring (or tree) between the devices over NVLink or PCIe and adds
//! on the GPU (`nccl::Nccl`, the CUDA build only). Training code calls the
//! trait only, and [`Single`] lets a plan with one replica run the same code
//! path.
//!
//! **Why f32 only.** Gradients and weights cross the wire as f32 whatever the
//! training dtype (as pipeline activations do): the caller converts, and the
//! sum is never done in a narrower type than the optimizer's.
//!
//! Segments: the two sharded calls cut the flat buffer into
//! [`Collective::size`] consecutive segments, `counts[r]` elements each
//! (zero allowed), segment r belonging to rank r; [`even_segments`] gives
//! the near-equal cut the all-reduce uses.
//!
//! * [`ring`] — the TCP ring: rendezvous, handshake, the pipelined
//!   reduce-scatter/all-gather
//! * `wire` — its frames and the reader/writer threads that carry them
//! * `nccl` (feature `cuda`) — NCCL over the GPUs, its communicator id
//!   handed round the TCP ring. Host-staged: the trait's buffers are host
//!   slices (the training code reads gradients out of its tensors into
//!   them), so each call copies to the device and back; NCCL still saves
//!   the TCP exchange and does the additions on the GPU. Unequal segments
//!   are padded to the largest, as NCCL wants one count per rank.

#[cfg(feature = "cuda")]
pub mod nccl;
pub mod ring;
mod wire;

pub use ring::{DEFAULT_CHUNK_BYTES, Ring, RingHello, RingTimeouts};

/// Why a collective operation failed. After any error other than
/// [`CollectiveError::InvalidSegments`] the communicator is unusable (frames
/// may be half way round the ring): every later call returns the same error.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CollectiveError {
    /// A neighbour closed the connection, stopped answering within the
    /// timeout or never came up: usually the consequence of a failure
    /// elsewhere, which the operator reads from that replica's pod.
    #[error("replica {rank}: {detail}")]
    PeerLost { rank: u32, detail: String },
    /// The replicas disagree (attempt, job, replica count, resume step,
    /// operation or segment sizes): a bug or a stale pod, never transient.
    #[error("collective protocol: {0}")]
    Protocol(String),
    /// The caller's `counts` do not describe `data` (nothing was sent).
    #[error("collective segments: {0}")]
    InvalidSegments(String),
}

/// Sums and gathers over the replicas of one pipeline stage.
///
/// Every rank must make the same calls in the same order with the same
/// buffer length and `counts`; a mismatch is a [`CollectiveError::Protocol`]
/// error on the ranks that notice it. Calls block until this rank's part is
/// done (its results complete, everything it owes its neighbours handed to
/// the kernel).
pub trait Collective: Send {
    /// This replica's index, 0-based.
    fn rank(&self) -> u32;
    /// The number of replicas d.
    fn size(&self) -> u32;

    /// In place: every rank ends with the element-wise sum over all ranks,
    /// bitwise identical on every rank and the same across runs for the same
    /// inputs. The default is a reduce-scatter then an all-gather over
    /// [`even_segments`]; an implementation may fuse them.
    fn all_reduce_sum(&mut self, data: &mut [f32]) -> Result<(), CollectiveError> {
        let counts = even_segments(data.len(), self.size());
        self.reduce_scatter_sum(data, &counts)?;
        self.all_gather(data, &counts)
    }

    /// `data` is the whole flat buffer on every rank, cut into `size()`
    /// consecutive segments of `counts[r]` elements (summing to
    /// `data.len()`). Afterwards segment `rank()` holds the element-wise sum
    /// of that segment over all ranks (bitwise what the all-reduce gives);
    /// the other segments are unspecified.
    fn reduce_scatter_sum(
        &mut self,
        data: &mut [f32],
        counts: &[usize],
    ) -> Result<(), CollectiveError>;

    /// The same segments; each rank's own segment is authoritative.
    /// Afterwards every rank holds every rank's segment.
    fn all_gather(&mut self, data: &mut [f32], counts: &[usize]) -> Result<(), CollectiveError>;
}

/// `len` elements cut into `parts` consecutive segments whose sizes differ
/// by at most one (the first `len % parts` get the extra element).
pub fn even_segments(len: usize, parts: u32) -> Vec<usize> {
    let parts = parts.max(1) as usize;
    let (base, extra) = (len / parts, len % parts);
    (0..parts).map(|r| base + usize::from(r < extra)).collect()
}

/// Where each of the consecutive segments of `counts` starts.
pub(crate) fn segment_offsets(counts: &[usize]) -> Vec<usize> {
    counts
        .iter()
        .scan(0, |at, &c| {
            let start = *at;
            *at += c;
            Some(start)
        })
        .collect()
}

/// Checks that `counts` cuts a buffer of `len` elements into `size` segments.
pub(crate) fn check_segments(
    len: usize,
    counts: &[usize],
    size: u32,
) -> Result<(), CollectiveError> {
    if counts.len() != size as usize {
        return Err(CollectiveError::InvalidSegments(format!(
            "counts has {} segments for {size} replicas: give one count per replica",
            counts.len()
        )));
    }
    let total = counts.iter().try_fold(0usize, |sum, &c| sum.checked_add(c));
    if total != Some(len) {
        return Err(CollectiveError::InvalidSegments(format!(
            "counts {counts:?} sum to {}, the buffer holds {len} elements: they must be equal",
            total.map_or_else(|| "more than usize::MAX".to_string(), |t| t.to_string())
        )));
    }
    Ok(())
}

/// One replica: nothing to talk to, every call leaves `data` as it is (the
/// sum over one rank is the rank's own values).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Single;

impl Collective for Single {
    fn rank(&self) -> u32 {
        0
    }

    fn size(&self) -> u32 {
        1
    }

    fn all_reduce_sum(&mut self, _data: &mut [f32]) -> Result<(), CollectiveError> {
        Ok(())
    }

    fn reduce_scatter_sum(
        &mut self,
        data: &mut [f32],
        counts: &[usize],
    ) -> Result<(), CollectiveError> {
        check_segments(data.len(), counts, 1)
    }

    fn all_gather(&mut self, data: &mut [f32], counts: &[usize]) -> Result<(), CollectiveError> {
        check_segments(data.len(), counts, 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn even_segments_cover_the_buffer() {
        assert_eq!(even_segments(10, 4), vec![3, 3, 2, 2]);
        assert_eq!(even_segments(2, 4), vec![1, 1, 0, 0]);
        assert_eq!(even_segments(0, 3), vec![0, 0, 0]);
        assert_eq!(even_segments(7, 1), vec![7]);
    }

    #[test]
    fn single_is_the_identity_and_checks_segments() {
        let mut c = Single;
        let mut data = vec![1.5f32, -2.0, 3.0];
        c.all_reduce_sum(&mut data).expect("all-reduce");
        c.reduce_scatter_sum(&mut data, &[3])
            .expect("reduce-scatter");
        c.all_gather(&mut data, &[3]).expect("all-gather");
        assert_eq!(data, vec![1.5, -2.0, 3.0]);
        let err = c.all_gather(&mut data, &[2]).expect_err("short counts");
        assert!(matches!(err, CollectiveError::InvalidSegments(_)), "{err}");
        let err = c.all_gather(&mut data, &[1, 2]).expect_err("two segments");
        assert!(
            err.to_string().contains("2 segments for 1 replicas"),
            "{err}"
        );
    }
}
