//! NCCL between the replicas' GPUs, host-staged: the CUDA build's
//! [`Collective`].
//!
//! **Setup.** The replicas first join the TCP [`Ring`] as on the CPU (its
//! handshake turns away stale attempts and replicas that disagree). Rank 0
//! then mints an NCCL unique id (`ncclGetUniqueId`), the 128 bytes go round
//! the ring ([`Ring::broadcast_bytes`]), and every rank joins the
//! communicator on the worker's CUDA device (`ncclCommInitRank`). The ring
//! stays inside [`Nccl`] for the communicator's lifetime. (cubecl's own NCCL
//! support keeps its ids in a process-wide map, so its communicators cannot
//! span processes: hence this module.)
//!
//! **Host-staged.** The trait works on host `&mut [f32]` (the caller reads
//! gradients out of burn tensors and writes the results back), so each call
//! uploads the slice into a device buffer, runs `ncclAllReduce`,
//! `ncclReduceScatter` or `ncclAllGather` (sum, float32) on a stream of its
//! own, waits for it and downloads the result. The buffers are kept and
//! grown as needed: on the device, about twice the largest bucket beside
//! NCCL's own buffers, which the planner does not count yet. What it saves
//! over the ring is the exchange itself (NVLink or PCIe rather than TCP
//! through the host) and the additions (on the GPU); what it does not save
//! is the copies, which moving the collective onto the training tensors
//! would.
//!
//! **Unequal segments.** NCCL's reduce-scatter and all-gather give every
//! rank the same count. With `m` = the largest of `counts`, the device
//! layout gives rank r the `m` elements at `r·m`: segment r is copied to the
//! start of its block and the rest of the block is padding, reduced or
//! gathered like the values and never copied back. The all-reduce needs no
//! segments and runs on the buffer as it is.
//!
//! **One thread.** cudarc's communicator holds a raw pointer, so it is not
//! `Send` and the trait requires it (and the worker forbids `unsafe`): the
//! communicator lives on a thread of its own, and the device buffers go to
//! it and come back with every call. Uploads and downloads happen on the
//! caller's thread, on the same stream.
//!
//! **What NCCL does not check.** The TCP ring checks that every rank makes
//! the same call over the same segments; NCCL does not, and a mismatch hangs
//! (until the ring's I/O timeout here) or mixes up values. The data-parallel
//! code derives the calls from the plan, the same on every replica.
//!
//! **Determinism.** NCCL sums each element once and sends the result on, so
//! the ranks agree bitwise, and the same inputs give the same sums for the
//! same choice of algorithm and ring order (which NCCL makes from the
//! topology). Unlike the TCP ring, a reduce-scatter is not promised to give
//! the bits of the all-reduce, nor two communicators (two pipeline stages'
//! replica groups, which all-reduce the tied embedding) the same order.
//!
//! **Unverified on a GPU.** This compiles in the CUDA build; it has not run
//! on a GPU yet.

use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DriverError};
use cudarc::nccl::result::NcclError;
use cudarc::nccl::{Comm, Id, ReduceOp};

use super::{Collective, CollectiveError, Ring, check_segments, segment_offsets};

/// Bytes of an `ncclUniqueId`.
const ID_BYTES: usize = 128;

/// The NCCL library's version (e.g. 22703 for 2.27.3), or why it cannot be
/// loaded. Probed once: cudarc loads libnccl on first use and panics when
/// it finds none, so the first probe's panic message also reaches stderr.
/// cudarc tries `libnccl.so` and names built from the CUDA major version,
/// not NCCL's own soname `libnccl.so.2`: an image needs the `libnccl.so`
/// link (Debian's libnccl-dev has it; the nvidia-nccl-cu12 wheel does not).
pub fn available() -> Result<i32, String> {
    static PROBE: OnceLock<Result<i32, String>> = OnceLock::new();
    PROBE
        .get_or_init(
            || match std::panic::catch_unwind(cudarc::nccl::result::get_nccl_version) {
                Ok(Ok(version)) => Ok(version),
                Ok(Err(e)) => Err(format!("ncclGetVersion failed: {}", nccl_name(&e))),
                Err(_) => Err(format!(
                    "the NCCL library could not be loaded: cudarc looks for {:?}, and NCCL \
                     installs libnccl.so.2, so one of those names (libnccl.so, a link to it) \
                     must be on the loader's path (LD_LIBRARY_PATH)",
                    cudarc::get_lib_name_candidates("nccl")
                )),
            },
        )
        .clone()
}

/// NCCL's name for an error, e.g. `ncclSystemError`.
fn nccl_name(e: &NcclError) -> String {
    format!("{:?}", e.0)
}

/// One call's work on the NCCL thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    /// In place on the first `len` elements of the send buffer.
    AllReduce { len: usize },
    /// The send buffer's `d × block` elements into `block` of the receive buffer.
    ReduceScatter { block: usize },
    /// `block` elements of the send buffer into `d × block` of the receive buffer.
    AllGather { block: usize },
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::AllReduce { .. } => "ncclAllReduce",
            Op::ReduceScatter { .. } => "ncclReduceScatter",
            Op::AllGather { .. } => "ncclAllGather",
        }
    }
}

/// The device buffers, owned by whichever thread is using them.
#[derive(Debug)]
struct Buffers {
    send: CudaSlice<f32>,
    recv: CudaSlice<f32>,
}

/// What the NCCL thread answers.
#[derive(Debug)]
enum Done {
    /// The communicator is up, or why not.
    Joined(Result<(), String>),
    /// An operation ran (or failed, with NCCL's or CUDA's error).
    Ran(Buffers, Result<(), OpError>),
}

#[derive(Debug)]
enum OpError {
    Nccl(NcclError),
    Cuda(DriverError),
}

/// One rank of an NCCL communicator over the replicas of a stage (see the
/// module documentation).
pub struct Nccl {
    rank: u32,
    size: u32,
    /// The rendezvous that carried the id; kept open with the communicator.
    ring: Ring,
    stream: Arc<CudaStream>,
    /// `None` before the first call (and after a call that never came back).
    buffers: Option<Buffers>,
    jobs: Sender<(Op, Buffers)>,
    done: Receiver<Done>,
    /// The longest wait for the communicator to form and for one call.
    timeout: Duration,
    /// Set by the first failure: every later call returns it.
    broken: Option<CollectiveError>,
}

impl std::fmt::Debug for Nccl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nccl")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("ring", &self.ring)
            .field("timeout", &self.timeout)
            .field("broken", &self.broken)
            .finish_non_exhaustive()
    }
}

impl Nccl {
    /// Forms the NCCL communicator of the ring's replicas on CUDA device
    /// `device_ordinal` (every replica of the ring must call it, right after
    /// establishing the ring). Fails with a [`CollectiveError::Protocol`]
    /// error when libnccl cannot be loaded ([`available`] says so first),
    /// when NCCL or CUDA refuses, and with [`CollectiveError::PeerLost`] when
    /// the id does not arrive or the others do not join within the ring's
    /// I/O timeout.
    pub fn over(mut ring: Ring, device_ordinal: usize) -> Result<Nccl, CollectiveError> {
        let protocol = CollectiveError::Protocol;
        available().map_err(protocol)?;
        let (rank, size) = (ring.rank(), ring.size());
        let timeout = ring.io_timeout();
        let minted = if rank == 0 {
            let id = Id::new().map_err(|e| {
                protocol(format!(
                    "NCCL could not mint a communicator id: {}",
                    nccl_name(&e)
                ))
            })?;
            Some((*id.internal()).map(|c| u8::from_ne_bytes(c.to_ne_bytes())))
        } else {
            None
        };
        let bytes = ring.broadcast_bytes(minted.as_ref().map(|id| &id[..]), ID_BYTES)?;
        let mut internal = [0; ID_BYTES];
        for (c, b) in internal.iter_mut().zip(&bytes) {
            *c = std::ffi::c_char::from_ne_bytes([*b]);
        }
        let id = Id::uninit(internal);

        let cuda = |what: &str, e: DriverError| {
            protocol(format!("CUDA device {device_ordinal}: {what}: {e:?}"))
        };
        let context =
            CudaContext::new(device_ordinal).map_err(|e| cuda("opening the context", e))?;
        let stream = context
            .new_stream()
            .map_err(|e| cuda("creating NCCL's stream", e))?;
        let (jobs, waiting) = channel::<(Op, Buffers)>();
        let (answer, done) = channel();
        let thread_stream = stream.clone();
        std::thread::Builder::new()
            .name("headroom-nccl".into())
            .spawn(move || serve(thread_stream, rank, size, id, &waiting, &answer))
            .map_err(|e| protocol(format!("starting the NCCL thread: {e}")))?;
        let nccl = Nccl {
            rank,
            size,
            ring,
            stream,
            buffers: None,
            jobs,
            done,
            timeout,
            broken: None,
        };
        match nccl.done.recv_timeout(timeout) {
            Ok(Done::Joined(Ok(()))) => Ok(nccl),
            Ok(Done::Joined(Err(e))) => Err(protocol(e)),
            Ok(Done::Ran(..)) => Err(protocol("the NCCL thread answered out of turn".into())),
            Err(RecvTimeoutError::Timeout) => Err(nccl.lost(format!(
                "the NCCL communicator did not form within {timeout:?} (ncclCommInitRank)"
            ))),
            Err(RecvTimeoutError::Disconnected) => Err(protocol(
                "the NCCL thread stopped while joining the communicator".into(),
            )),
        }
    }

    /// A replica that stopped taking part. NCCL does not say which: the
    /// previous one in the ring is named.
    fn lost(&self, detail: String) -> CollectiveError {
        CollectiveError::PeerLost {
            rank: (self.rank + self.size - 1) % self.size,
            detail: format!("{detail} (NCCL does not say which replica)"),
        }
    }

    fn cuda_error(&self, what: &str, e: DriverError) -> CollectiveError {
        CollectiveError::Protocol(format!(
            "CUDA, {what} for NCCL on replica {}: {e:?}",
            self.rank
        ))
    }

    /// Device buffers of at least `send` and `recv` elements.
    fn buffers(&mut self, send: usize, recv: usize) -> Result<Buffers, CollectiveError> {
        let grow = |slice: Option<CudaSlice<f32>>, len: usize| match slice {
            Some(s) if s.len() >= len => Ok(s),
            old => {
                drop(old);
                self.stream.alloc_zeros::<f32>(len.max(1))
            }
        };
        let (send_was, recv_was) = match self.buffers.take() {
            Some(b) => (Some(b.send), Some(b.recv)),
            None => (None, None),
        };
        let allocating = |e| self.cuda_error("allocating the staging buffers", e);
        Ok(Buffers {
            send: grow(send_was, send).map_err(allocating)?,
            recv: grow(recv_was, recv).map_err(allocating)?,
        })
    }

    /// Hands `buffers` to the NCCL thread for `op` and waits for them.
    fn run(&mut self, op: Op, buffers: Buffers) -> Result<Buffers, CollectiveError> {
        if self.jobs.send((op, buffers)).is_err() {
            return Err(CollectiveError::Protocol("the NCCL thread stopped".into()));
        }
        match self.done.recv_timeout(self.timeout) {
            Ok(Done::Ran(buffers, Ok(()))) => Ok(buffers),
            Ok(Done::Ran(_, Err(OpError::Nccl(e)))) => {
                let name = nccl_name(&e);
                let detail = format!("{} failed: {name}", op.name());
                Err(if name == "ncclRemoteError" {
                    self.lost(detail)
                } else {
                    CollectiveError::Protocol(format!("replica {}: {detail}", self.rank))
                })
            }
            Ok(Done::Ran(_, Err(OpError::Cuda(e)))) => Err(self.cuda_error(op.name(), e)),
            Ok(Done::Joined(_)) => Err(CollectiveError::Protocol(
                "the NCCL thread answered out of turn".into(),
            )),
            Err(RecvTimeoutError::Timeout) => Err(self.lost(format!(
                "{} did not finish within {:?}",
                op.name(),
                self.timeout
            ))),
            Err(RecvTimeoutError::Disconnected) => {
                Err(CollectiveError::Protocol("the NCCL thread stopped".into()))
            }
        }
    }

    /// Runs one call, breaking the communicator on any failure but a bad `counts`.
    fn guarded(
        &mut self,
        call: impl FnOnce(&mut Nccl) -> Result<(), CollectiveError>,
    ) -> Result<(), CollectiveError> {
        if let Some(e) = &self.broken {
            return Err(e.clone());
        }
        let result = call(self);
        if let Err(e) = &result
            && !matches!(e, CollectiveError::InvalidSegments(_))
        {
            self.broken = Some(e.clone());
        }
        result
    }

    fn upload(
        &self,
        from: &[f32],
        to: &mut CudaSlice<f32>,
        at: usize,
    ) -> Result<(), CollectiveError> {
        if from.is_empty() {
            return Ok(());
        }
        self.stream
            .memcpy_htod(from, &mut to.slice_mut(at..at + from.len()))
            .map_err(|e| self.cuda_error("uploading", e))
    }

    fn download(
        &self,
        from: &CudaSlice<f32>,
        at: usize,
        to: &mut [f32],
    ) -> Result<(), CollectiveError> {
        if to.is_empty() {
            return Ok(());
        }
        self.stream
            .memcpy_dtoh(&from.slice(at..at + to.len()), to)
            .map_err(|e| self.cuda_error("downloading", e))
    }

    fn synchronize(&self) -> Result<(), CollectiveError> {
        self.stream
            .synchronize()
            .map_err(|e| self.cuda_error("waiting for the copies", e))
    }
}

/// The NCCL thread: joins the communicator, then runs every call it is
/// handed until the [`Nccl`] is dropped.
fn serve(
    stream: Arc<CudaStream>,
    rank: u32,
    size: u32,
    id: Id,
    jobs: &Receiver<(Op, Buffers)>,
    done: &Sender<Done>,
) {
    let joined = stream
        .context()
        .bind_to_thread()
        .map_err(|e| format!("CUDA: binding the context to the NCCL thread: {e:?}"))
        .and_then(|()| {
            Comm::from_rank(stream.clone(), rank as usize, size as usize, id).map_err(|e| {
                format!(
                    "ncclCommInitRank (replica {rank} of {size}) failed: {}",
                    nccl_name(&e)
                )
            })
        });
    let comm = match joined {
        Ok(comm) => {
            let _ = done.send(Done::Joined(Ok(())));
            comm
        }
        Err(e) => {
            let _ = done.send(Done::Joined(Err(e)));
            return;
        }
    };
    let d = size as usize;
    while let Ok((op, mut buffers)) = jobs.recv() {
        let b = &mut buffers;
        let ran = match op {
            Op::AllReduce { len } => {
                comm.all_reduce_in_place(&mut b.send.slice_mut(..len), &ReduceOp::Sum)
            }
            Op::ReduceScatter { block } => comm.reduce_scatter(
                &b.send.slice(..d * block),
                &mut b.recv.slice_mut(..block),
                &ReduceOp::Sum,
            ),
            Op::AllGather { block } => {
                comm.all_gather(&b.send.slice(..block), &mut b.recv.slice_mut(..d * block))
            }
        };
        let result = match ran {
            Ok(_) => stream.synchronize().map_err(OpError::Cuda),
            Err(e) => Err(OpError::Nccl(e)),
        };
        if done.send(Done::Ran(buffers, result)).is_err() {
            return;
        }
    }
}

impl Collective for Nccl {
    fn rank(&self) -> u32 {
        self.rank
    }

    fn size(&self) -> u32 {
        self.size
    }

    /// `ncclAllReduce` in place on the uploaded buffer.
    fn all_reduce_sum(&mut self, data: &mut [f32]) -> Result<(), CollectiveError> {
        self.guarded(|nccl| {
            if data.is_empty() {
                return Ok(());
            }
            let len = data.len();
            let mut buffers = nccl.buffers(len, 0)?;
            nccl.upload(data, &mut buffers.send, 0)?;
            let buffers = nccl.run(Op::AllReduce { len }, buffers)?;
            nccl.download(&buffers.send, 0, data)?;
            nccl.synchronize()?;
            nccl.buffers = Some(buffers);
            Ok(())
        })
    }

    /// Every segment into its padded block, `ncclReduceScatter`, this rank's
    /// block back into its segment.
    fn reduce_scatter_sum(
        &mut self,
        data: &mut [f32],
        counts: &[usize],
    ) -> Result<(), CollectiveError> {
        check_segments(data.len(), counts, self.size)?;
        self.guarded(|nccl| {
            let block = counts.iter().copied().max().unwrap_or(0);
            if block == 0 {
                return Ok(());
            }
            let d = nccl.size as usize;
            let at = segment_offsets(counts);
            let mut buffers = nccl.buffers(d * block, block)?;
            for (r, (&start, &count)) in at.iter().zip(counts).enumerate() {
                nccl.upload(&data[start..start + count], &mut buffers.send, r * block)?;
            }
            let buffers = nccl.run(Op::ReduceScatter { block }, buffers)?;
            let me = nccl.rank as usize;
            nccl.download(&buffers.recv, 0, &mut data[at[me]..at[me] + counts[me]])?;
            nccl.synchronize()?;
            nccl.buffers = Some(buffers);
            Ok(())
        })
    }

    /// This rank's segment into its block, `ncclAllGather`, every other
    /// rank's block back into its segment.
    fn all_gather(&mut self, data: &mut [f32], counts: &[usize]) -> Result<(), CollectiveError> {
        check_segments(data.len(), counts, self.size)?;
        self.guarded(|nccl| {
            let block = counts.iter().copied().max().unwrap_or(0);
            if block == 0 {
                return Ok(());
            }
            let d = nccl.size as usize;
            let me = nccl.rank as usize;
            let at = segment_offsets(counts);
            let mut buffers = nccl.buffers(block, d * block)?;
            nccl.upload(&data[at[me]..at[me] + counts[me]], &mut buffers.send, 0)?;
            let buffers = nccl.run(Op::AllGather { block }, buffers)?;
            for (r, (&start, &count)) in at.iter().zip(counts).enumerate() {
                if r != me {
                    nccl.download(&buffers.recv, r * block, &mut data[start..start + count])?;
                }
            }
            nccl.synchronize()?;
            nccl.buffers = Some(buffers);
            Ok(())
        })
    }
}
