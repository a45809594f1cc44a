//! The TCP ring: d replicas in a circle, rank r sending to rank (r + 1) % d
//! and receiving from rank (r − 1 + d) % d.
//!
//! **Why a ring.** Reduce-scatter then all-gather around a ring is the
//! bandwidth-optimal all-reduce (Patarasuk and Yuan, 2009; what NCCL does
//! within a node): each rank sends and receives 2(d − 1)/d of the buffer
//! whatever d, every link is busy in every step, and no rank is a hub.
//!
//! **The schedule.** The buffer is cut into d segments. In ring step k
//! (0-based) rank r sends segment (r − 1 − k) mod d and receives segment
//! (r − 2 − k) mod d, which is what it sends in step k + 1. Steps
//! 0 ..= d − 2 are the reduce-scatter: the received chunk is added to the
//! rank's own values, so after step d − 2 rank r holds the full sum of
//! segment r. Steps d − 1 ..= 2d − 3 are the all-gather: received chunks are
//! copied in and passed on. A segment is sent in chunks (4 MiB by default),
//! and within a step a rank sends up to `LEAD` (2) chunks beyond the one it is
//! waiting for, so sending, receiving and adding overlap.
//!
//! **Why steps do not overlap.** A chunk could go on to the next rank as
//! soon as it has been added, before the step's other chunks; one TCP
//! stream then carries two steps, so a rank must send its whole first
//! segment ahead of everything, and a rank that reaches the call late finds
//! up to its whole buffer queued from its neighbour (an extra copy of the
//! gradients the planner does not budget). Step by step, the frames in
//! flight stay at most d × (LEAD + 3) chunks around the whole ring; the cost
//! is one chunk's latency per step and one more pass over each sent chunk
//! (encoding it from `data` rather than passing the received bytes on).
//! Measured with `allreduce_bench` (2 shared cores, 256 MiB, d = 4): the
//! two orders were within run-to-run noise (660–1260 ms against 750–1010
//! ms), and a replica 1 s late peaked 55–59 MiB above its buffer rather than
//! 246 MiB.
//!
//! **Determinism.** Segment j is summed in one fixed order, starting at rank
//! j + 1 and ending at rank j, and each element's sum is computed once, on
//! rank j; every other rank copies that value. So all ranks hold bitwise the
//! same result, and the same inputs give the same result on every run.
//!
//! **Setup.** Each rank listens (the caller binds the socket), calls the
//! next rank with retries until it answers (pods start in any order) and
//! accepts the previous one. Both ends of a connection exchange a
//! [`RingHello`]: a pod of an older attempt is turned away, a rank of an
//! attempt that has been superseded stops, and replicas that disagree on the
//! replica count or the step they resume from refuse to start.
//!
//! **Authentication.** A hello's names are no secret, and a hello claiming
//! a later attempt stops a replica, so the hellos travel in
//! [`crate::link_auth`]'s mutual challenge–response under the job's
//! [`LinkKey`]: the caller sends a fresh nonce with its hello; the listening
//! rank answers with its own nonce, its hello and an HMAC of both nonces
//! and all its hello's fields; the caller checks that proof and proves the
//! key back over its own hello. Neither end acts on the other's hello (takes
//! it as a neighbour, turns it away as stale, or stops because it is
//! superseded) before the other's proof checked out: a caller without the
//! key is dropped with a warning naming its address, and the rank keeps
//! listening until its deadline. The listening rank runs several
//! handshakes at once ([`link_auth::accept_first`]), so strangers that call
//! and stall cannot hold up the real neighbour either. Handshake frames are capped at
//! [`crate::link_auth::MAX_HANDSHAKE_PAYLOAD`] bytes and their reads at
//! `HANDSHAKE_TIMEOUT` in all.

use std::io::Read;
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::wire::{Frame, Header, Kind, MAX_PAYLOAD, Pool, RingLinks, write_frame};
use super::{Collective, CollectiveError, check_segments, even_segments, segment_offsets};
use crate::link_auth::{
    self, AcceptError, Greeting, HandshakeError, Identity, LinkKey, Message, Verdict, Wire,
};
use crate::link_mac::FrameKeys;

/// Default bytes of a segment sent in one frame: large enough that the
/// per-frame cost (header, wake-ups, syscalls) disappears, small enough
/// that adding one chunk overlaps with receiving the next.
pub const DEFAULT_CHUNK_BYTES: usize = 4 << 20;
/// Chunks a rank may send in a ring step beyond the one it waits to receive:
/// enough to keep its link busy while it adds, few enough that the frames
/// in flight (and so queued in any rank's reader) stay a few chunks.
const LEAD: usize = 2;
/// How long one handshake may take once connected, all reads together.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// First and largest pause between tries to reach the next rank.
const RETRY: Duration = Duration::from_millis(100);
const MAX_RETRY: Duration = Duration::from_secs(2);
/// Longest wait for one TCP connect (the rendezvous deadline bounds the whole).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The handshake both ends of a ring connection send.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RingHello {
    pub job: String,
    pub namespace: String,
    pub attempt: u32,
    /// The pipeline stage whose replicas form this ring (0 without pipelining).
    pub stage: u32,
    /// This replica's rank in the ring, 0-based.
    pub replica: u32,
    /// Replicas in the ring (d).
    pub replicas: u32,
    /// The checkpoint step this replica resumes from (0: a fresh start).
    pub resume_step: u64,
}

impl RingHello {
    /// Whether `other` is a replica of our ring (same job, attempt and stage).
    fn same_ring(&self, other: &RingHello) -> bool {
        self.same_job(other) && other.attempt == self.attempt && other.stage == self.stage
    }

    fn same_job(&self, other: &RingHello) -> bool {
        other.job == self.job && other.namespace == self.namespace
    }

    /// A peer of this attempt that cannot train with us.
    fn agrees(&self, other: &RingHello) -> Result<(), CollectiveError> {
        if other.replicas != self.replicas || other.resume_step != self.resume_step {
            return Err(CollectiveError::Protocol(format!(
                "replica {} (of {}) resumes from step {}, replica {} (of {}) from step {}: \
                 the replicas must agree on their number and start from the same checkpoint",
                self.replica,
                self.replicas,
                self.resume_step,
                other.replica,
                other.replicas,
                other.resume_step
            )));
        }
        Ok(())
    }

    /// The error when `other`, of the same job, belongs to a newer attempt:
    /// this pod is left over from a failed attempt and must not train.
    fn superseded_by(&self, other: &RingHello) -> Option<CollectiveError> {
        (self.same_job(other) && other.attempt > self.attempt).then(|| {
            CollectiveError::Protocol(format!(
                "attempt {} of {}/{} is superseded: replica {} of attempt {} is running",
                self.attempt, self.namespace, self.job, other.replica, other.attempt
            ))
        })
    }
}

impl Greeting for RingHello {
    // Every field: the proof binds the whole hello, so the attempt a hello
    // claims (which can stop a replica) cannot be forged without the key.
    fn identity(&self) -> Identity {
        Identity::new("ring")
            .text(&self.job)
            .text(&self.namespace)
            .number(self.attempt.into())
            .number(self.stage.into())
            .number(self.replica.into())
            .number(self.replicas.into())
            .number(self.resume_step)
    }
}

/// The handshake's messages as ring frames: `Hello` and `Proof`.
#[derive(Debug)]
struct RingWire;

impl RingWire {
    fn kind(message: Message) -> Kind {
        match message {
            Message::Hello => Kind::Hello,
            Message::Proof => Kind::Proof,
        }
    }
}

impl Wire for RingWire {
    fn send(stream: &TcpStream, message: Message, payload: &[u8]) -> std::io::Result<()> {
        let header = Header {
            kind: RingWire::kind(message),
            seq: 0,
            step: 0,
            chunk: 0,
            len: 0,
        };
        write_frame(stream, header, payload)
    }

    fn recv(r: &mut impl Read, message: Message, max: usize) -> Result<Vec<u8>, HandshakeError> {
        let frame = Frame::read_capped(r, &Pool::default(), max)?.ok_or(HandshakeError::Closed)?;
        if frame.header().kind != RingWire::kind(message) {
            return Err(HandshakeError::Unexpected(format!(
                "{:?}",
                frame.header().kind
            )));
        }
        Ok(frame.payload().to_vec())
    }
}

/// How long to wait.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingTimeouts {
    /// For the neighbours to come up and answer the handshake.
    pub rendezvous: Duration,
    /// For each frame during an operation, and for each write that makes no
    /// progress: a neighbour silent this long is lost. Generous, because a
    /// replica may reach the all-reduce much later than its neighbours (a
    /// slow step, a checkpoint being written).
    pub io: Duration,
}

impl Default for RingTimeouts {
    fn default() -> Self {
        RingTimeouts {
            rendezvous: Duration::from_secs(10 * 60),
            io: Duration::from_secs(10 * 60),
        }
    }
}

/// Which part of the ring schedule an operation runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
enum Op {
    AllReduce = 1,
    ReduceScatter = 2,
    AllGather = 3,
}

/// One rank of a TCP ring (see the module documentation). With one replica
/// there are no connections and every call leaves the data as it is.
///
/// Threads: a reader and a writer per ring (d > 1) for the ring's lifetime;
/// the caller's thread does the additions. Memory: besides `data`, chunk
/// buffers (with 4 MiB chunks: up to 8 kept for reuse, 3 on their way to
/// the socket) and the frames queued from the previous rank, which the
/// schedule bounds to the ring's d × (LEAD + 3) = 5d chunks in flight at
/// worst (a rank far behind the others), a chunk or two when the ranks keep
/// pace; with uneven `counts`, add the largest difference between two
/// segments.
#[derive(Debug)]
pub struct Ring {
    rank: u32,
    size: u32,
    links: Option<RingLinks>,
    /// The last operation's sequence number (0 before the first).
    seq: u64,
    chunk_bytes: usize,
    /// How long a neighbour may stay silent ([`RingTimeouts::io`]).
    io_timeout: Duration,
    /// Set by the first failure: the ring's state is then unknown.
    broken: Option<CollectiveError>,
}

impl Ring {
    /// Joins the ring as replica `hello.replica` of `hello.replicas`.
    /// `addresses` holds one `host:port` per replica (this one's included,
    /// unused); `listener` is this replica's socket, already bound, on which
    /// the previous replica calls. Both neighbours must prove `key` (see the
    /// module documentation). Waits up to `timeouts.rendezvous` for the
    /// neighbours.
    pub fn establish(
        hello: &RingHello,
        key: &LinkKey,
        addresses: &[String],
        listener: TcpListener,
        timeouts: RingTimeouts,
    ) -> Result<Ring, CollectiveError> {
        let d = hello.replicas;
        if d == 0 || hello.replica >= d {
            return Err(CollectiveError::Protocol(format!(
                "replica {} of {d}: the rank must be below the number of replicas",
                hello.replica
            )));
        }
        if addresses.len() != d as usize {
            return Err(CollectiveError::Protocol(format!(
                "{} addresses for {d} replicas: give one host:port per replica",
                addresses.len()
            )));
        }
        let mut ring = Ring {
            rank: hello.replica,
            size: d,
            links: None,
            seq: 0,
            chunk_bytes: DEFAULT_CHUNK_BYTES,
            io_timeout: timeouts.io,
            broken: None,
        };
        if d == 1 {
            return Ok(ring);
        }
        let prev = (hello.replica + d - 1) % d;
        let next = (hello.replica + 1) % d;
        let until = Instant::now() + timeouts.rendezvous;
        let stop = Arc::new(AtomicBool::new(false));
        let accepting = {
            let (me, key, stop) = (hello.clone(), key.clone(), stop.clone());
            std::thread::Builder::new()
                .name("headroom-ring-accept".into())
                .spawn(move || accept_prev(&me, &key, prev, &listener, until, &stop))
                .map_err(|e| CollectiveError::PeerLost {
                    rank: prev,
                    detail: format!("starting the accepting thread: {e}"),
                })?
        };
        let connected = connect_next(hello, key, next, &addresses[next as usize], until, &stop);
        if connected.is_err() {
            stop.store(true, Ordering::Relaxed);
        }
        let accepted = accepting
            .join()
            .map_err(|_| CollectiveError::Protocol("the accepting thread panicked".into()))?;
        // The caller's own failure first: it is usually the cause.
        let to_next = connected?;
        let from_prev = accepted?;
        ring.links = Some(RingLinks::start(
            prev,
            from_prev,
            next,
            to_next,
            timeouts.io,
        )?);
        Ok(ring)
    }

    /// `d` sockets listening on loopback ports the OS picks, and their
    /// addresses: all replicas on one machine (tests, benchmarks).
    pub fn bind_loopback(d: u32) -> std::io::Result<(Vec<TcpListener>, Vec<String>)> {
        let listeners = (0..d)
            .map(|_| TcpListener::bind("127.0.0.1:0"))
            .collect::<std::io::Result<Vec<_>>>()?;
        let addresses = listeners
            .iter()
            .map(|l| l.local_addr().map(|a| a.to_string()))
            .collect::<std::io::Result<_>>()?;
        Ok((listeners, addresses))
    }

    /// A whole ring of `d` replicas on loopback, established on `d` threads,
    /// in rank order, under a random key: for tests and benchmarks in one
    /// process.
    pub fn loopback(d: u32, timeouts: RingTimeouts) -> Result<Vec<Ring>, CollectiveError> {
        let key = LinkKey::random().map_err(|e| CollectiveError::Protocol(e.to_string()))?;
        let (listeners, addresses) =
            Ring::bind_loopback(d).map_err(|e| CollectiveError::PeerLost {
                rank: 0,
                detail: format!("binding loopback sockets: {e}"),
            })?;
        let joining: Vec<_> = listeners
            .into_iter()
            .enumerate()
            .map(|(r, listener)| {
                let addresses = addresses.clone();
                let hello = RingHello {
                    job: "loopback".into(),
                    namespace: "local".into(),
                    attempt: 0,
                    stage: 0,
                    replica: r as u32,
                    replicas: d,
                    resume_step: 0,
                };
                let key = key.clone();
                std::thread::spawn(move || {
                    Ring::establish(&hello, &key, &addresses, listener, timeouts)
                })
            })
            .collect();
        joining
            .into_iter()
            .map(|h| {
                h.join()
                    .map_err(|_| CollectiveError::Protocol("a joining thread panicked".into()))?
            })
            .collect()
    }

    /// Bytes of a segment per frame (default [`DEFAULT_CHUNK_BYTES`]; rounded
    /// down to whole f32 values, at least one). Every rank must use the same
    /// value: operations check it.
    pub fn set_chunk_bytes(&mut self, bytes: usize) {
        self.chunk_bytes = bytes.clamp(4, MAX_PAYLOAD) / 4 * 4;
    }

    /// How long a neighbour may stay silent before it counts as lost
    /// ([`RingTimeouts::io`]): what a collective built over this ring waits.
    pub fn io_timeout(&self) -> Duration {
        self.io_timeout
    }

    /// Rank 0's `len` bytes, returned on every rank: passed round the ring
    /// once, rank 0 to 1, 1 to 2, … d − 2 to d − 1, in one frame each.
    /// `root_bytes` must be `Some` of `len` bytes on rank 0 and is ignored
    /// elsewhere; `len` at most one frame (64 MiB). Every rank must call it
    /// at the same point of its sequence of operations with the same `len`:
    /// a rank that receives anything else gets a
    /// [`CollectiveError::Protocol`] error, and the ring is then broken as
    /// after any failed operation. For small things every replica needs
    /// from one of them: the NCCL communicator id.
    pub fn broadcast_bytes(
        &mut self,
        root_bytes: Option<&[u8]>,
        len: usize,
    ) -> Result<Vec<u8>, CollectiveError> {
        if let Some(e) = &self.broken {
            return Err(e.clone());
        }
        if len > MAX_PAYLOAD {
            return Err(CollectiveError::InvalidSegments(format!(
                "a broadcast of {len} bytes: at most {MAX_PAYLOAD} go in one frame"
            )));
        }
        let root = match (self.rank, root_bytes) {
            (0, Some(bytes)) if bytes.len() == len => Some(bytes),
            (0, Some(bytes)) => {
                return Err(CollectiveError::InvalidSegments(format!(
                    "rank 0 broadcasts {} bytes where {len} were announced",
                    bytes.len()
                )));
            }
            (0, None) => {
                return Err(CollectiveError::InvalidSegments(
                    "rank 0 is the broadcast's root: give it the bytes".into(),
                ));
            }
            _ => None,
        };
        let Some(links) = &self.links else {
            // One replica: rank 0, its own bytes.
            return Ok(root.unwrap_or_default().to_vec());
        };
        self.seq += 1;
        let header = Header {
            kind: Kind::Bytes,
            seq: self.seq,
            step: 0,
            chunk: 0,
            len: len as u32,
        };
        let result = pass_on(links, header, root);
        if let Err(e) = &result {
            links.shutdown();
            self.broken = Some(e.clone());
        }
        result
    }

    fn run(&mut self, op: Op, data: &mut [f32], counts: &[usize]) -> Result<(), CollectiveError> {
        if let Some(e) = &self.broken {
            return Err(e.clone());
        }
        check_segments(data.len(), counts, self.size)?;
        let Some(links) = &self.links else {
            return Ok(());
        };
        self.seq += 1;
        let schedule = Schedule {
            op,
            rank: self.rank as usize,
            size: self.size as usize,
            seq: self.seq,
            chunk: self.chunk_bytes / 4,
        };
        let result = schedule.run(links, data, counts);
        if let Err(e) = &result {
            links.shutdown();
            self.broken = Some(e.clone());
        }
        result
    }
}

impl Collective for Ring {
    fn rank(&self) -> u32 {
        self.rank
    }

    fn size(&self) -> u32 {
        self.size
    }

    /// Reduce-scatter and all-gather over [`even_segments`] as one
    /// operation: 2(d − 1) ring steps, one Begin check and one flush.
    fn all_reduce_sum(&mut self, data: &mut [f32]) -> Result<(), CollectiveError> {
        let counts = even_segments(data.len(), self.size);
        self.run(Op::AllReduce, data, &counts)
    }

    fn reduce_scatter_sum(
        &mut self,
        data: &mut [f32],
        counts: &[usize],
    ) -> Result<(), CollectiveError> {
        self.run(Op::ReduceScatter, data, counts)
    }

    fn all_gather(&mut self, data: &mut [f32], counts: &[usize]) -> Result<(), CollectiveError> {
        self.run(Op::AllGather, data, counts)
    }
}

/// One broadcast on one rank: the root's bytes, or the previous rank's,
/// handed on unless the next rank is the root.
fn pass_on(
    links: &RingLinks,
    header: Header,
    root: Option<&[u8]>,
) -> Result<Vec<u8>, CollectiveError> {
    let bytes = match root {
        Some(bytes) => bytes.to_vec(),
        None => {
            let frame = links.recv(header)?;
            let bytes = frame.payload().to_vec();
            links.pool().give(frame.into_buf());
            bytes
        }
    };
    if links.next != 0 {
        links.send(Frame::with_payload(header, &bytes, links.pool()))?;
        links.flush(header.seq)?;
    }
    Ok(bytes)
}

/// One operation on one rank.
struct Schedule {
    op: Op,
    rank: usize,
    size: usize,
    seq: u64,
    /// f32 values per chunk.
    chunk: usize,
}

impl Schedule {
    /// The ring steps this operation runs: the reduce-scatter is steps
    /// 0 .. d − 1, the all-gather d − 1 .. 2(d − 1).
    fn steps(&self) -> std::ops::Range<usize> {
        let d = self.size;
        match self.op {
            Op::AllReduce => 0..2 * (d - 1),
            Op::ReduceScatter => 0..d - 1,
            Op::AllGather => d - 1..2 * (d - 1),
        }
    }

    /// The segment rank `rank` sends in step `step`: (rank − 1 − step) mod d.
    fn sends(&self, rank: usize, step: usize) -> usize {
        let d = self.size;
        (rank + d - 1 + d - step % d) % d
    }

    /// What both neighbours must agree on before any values move.
    fn begin_payload(&self, len: usize, counts: &[usize]) -> Vec<u8> {
        // FNV-1a over the counts: equal buffers cut differently must not pass.
        let digest = counts.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &c| {
            (c as u64)
                .to_le_bytes()
                .iter()
                .fold(h, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
        });
        let mut out = vec![self.op as u8];
        out.extend_from_slice(&(len as u64).to_le_bytes());
        out.extend_from_slice(&digest.to_le_bytes());
        out.extend_from_slice(&(self.chunk as u64).to_le_bytes());
        out
    }

    fn chunk_header(&self, step: usize, chunk: usize, values: usize) -> Header {
        Header {
            kind: Kind::Chunk,
            seq: self.seq,
            step: step as u32,
            chunk: chunk as u32,
            len: (values * 4) as u32,
        }
    }

    fn run(
        &self,
        links: &RingLinks,
        data: &mut [f32],
        counts: &[usize],
    ) -> Result<(), CollectiveError> {
        let steps = self.steps();
        let reduce_until = self.size - 1;
        let offsets = segment_offsets(counts);
        let segment = |s: usize| offsets[s]..offsets[s] + counts[s];

        let begin = Header {
            kind: Kind::Begin,
            seq: self.seq,
            step: steps.start as u32,
            chunk: 0,
            len: 0,
        };
        let ours = self.begin_payload(data.len(), counts);
        links.send(Frame::with_payload(begin, &ours, links.pool()))?;
        for step in steps.clone() {
            let out = segment(self.sends(self.rank, step));
            // What the previous rank sends in this step, we send in the next.
            let into = segment(self.sends(self.rank, step + 1));
            let sending = out.len().div_ceil(self.chunk);
            let mut sent =
                self.send_chunks(links, step, &data[out.clone()], 0, sending.min(LEAD + 1))?;
            if step == steps.start {
                self.check_begin(links, begin, &ours)?;
            }
            for c in 0..into.len().div_ceil(self.chunk) {
                // Keep LEAD chunks ahead of the one we wait for, no more: a
                // rank never sends much beyond what it has received, so the
                // frames in flight around the ring stay a few chunks.
                let upto = sending.min(c + 1 + LEAD);
                sent = self.send_chunks(links, step, &data[out.clone()], sent, upto)?;
                let start = into.start + c * self.chunk;
                let part = &mut data[start..into.end.min(start + self.chunk)];
                let frame = links.recv(self.chunk_header(step, c, part.len()))?;
                if step < reduce_until {
                    add(frame.payload(), part);
                } else {
                    decode(frame.payload(), part);
                }
                links.pool().give(frame.into_buf());
            }
            self.send_chunks(links, step, &data[out], sent, sending)?;
        }
        links.flush(self.seq)
    }

    /// Sends chunks `from .. to` of `segment` in ring step `step`; returns `to`.
    fn send_chunks(
        &self,
        links: &RingLinks,
        step: usize,
        segment: &[f32],
        from: usize,
        to: usize,
    ) -> Result<usize, CollectiveError> {
        for c in from..to {
            let values = &segment[c * self.chunk..segment.len().min((c + 1) * self.chunk)];
            let mut frame = Frame::new(self.chunk_header(step, c, values.len()), links.pool());
            encode(values, frame.payload_mut());
            links.send(frame)?;
        }
        Ok(to.max(from))
    }

    /// The previous rank's Begin must be ours: same operation, length, segments and chunking.
    fn check_begin(
        &self,
        links: &RingLinks,
        begin: Header,
        ours: &[u8],
    ) -> Result<(), CollectiveError> {
        let theirs = links.recv(Header {
            len: ours.len() as u32,
            ..begin
        })?;
        if theirs.payload() != ours {
            return Err(CollectiveError::Protocol(format!(
                "replica {} began {}, replica {} {}: every replica must make the same calls with the same buffer length and counts",
                links.prev,
                describe_begin(theirs.payload()),
                self.rank,
                describe_begin(ours)
            )));
        }
        links.pool().give(theirs.into_buf());
        Ok(())
    }
}

/// A Begin payload for an error message.
fn describe_begin(payload: &[u8]) -> String {
    let word = |i: usize| {
        payload
            .get(i..i + 8)
            .and_then(|b| <[u8; 8]>::try_from(b).ok())
            .map(u64::from_le_bytes)
    };
    let op = match payload.first() {
        Some(1) => "an all-reduce",
        Some(2) => "a reduce-scatter",
        Some(3) => "an all-gather",
        _ => "an unknown operation",
    };
    match (word(1), word(9), word(17)) {
        (Some(len), Some(digest), Some(chunk)) => {
            format!("{op} of {len} values (segments digest {digest:016x}, {chunk} values a chunk)")
        }
        _ => format!("{op} ({} bytes of description)", payload.len()),
    }
}

/// `values` as little-endian bytes into `out` (same length × 4).
fn encode(values: &[f32], out: &mut [u8]) {
    for (o, v) in out.as_chunks_mut::<4>().0.iter_mut().zip(values) {
        *o = v.to_le_bytes();
    }
}

/// `out` from little-endian bytes.
fn decode(bytes: &[u8], out: &mut [f32]) {
    for (o, b) in out.iter_mut().zip(bytes.as_chunks::<4>().0) {
        *o = f32::from_le_bytes(*b);
    }
}

/// Adds the received partial sums (little-endian bytes) to `ours`.
fn add(received: &[u8], ours: &mut [f32]) {
    for (o, b) in ours.iter_mut().zip(received.as_chunks::<4>().0) {
        *o += f32::from_le_bytes(*b);
    }
}

fn accept_prev(
    me: &RingHello,
    key: &LinkKey,
    prev: u32,
    listener: &TcpListener,
    until: Instant,
    stop: &AtomicBool,
) -> Result<(TcpStream, FrameKeys), CollectiveError> {
    let lost = |detail: String| CollectiveError::PeerLost { rank: prev, detail };
    // Our hello goes out to every caller, even one we then turn away, so it
    // learns why; the caller's hello is acted on only once its proof of the
    // key has checked out.
    let judge = |from: SocketAddr, answered: Result<RingHello, HandshakeError>| {
        let other = match answered {
            Ok(other) => other,
            Err(HandshakeError::BadProof) => {
                tracing::warn!(
                    %from,
                    "ring: refused a caller that did not prove the job's peer key"
                );
                return Verdict::Drop;
            }
            Err(e) => {
                tracing::warn!(%from, "ring: bad handshake: {e}");
                return Verdict::Drop;
            }
        };
        // Proved: a newer attempt may stop this one now, and only now.
        if let Some(e) = me.superseded_by(&other) {
            return Verdict::Fail(e);
        }
        if me.same_ring(&other) {
            if let Err(e) = me.agrees(&other) {
                return Verdict::Fail(e);
            }
            if other.replica == prev {
                tracing::info!(%from, replica = prev, "ring: previous replica connected");
                return Verdict::Take;
            }
        }
        tracing::warn!(
            %from,
            "ring: turned away {}/{} attempt {} stage {} replica {} (want attempt {} stage {} replica {prev})",
            other.namespace, other.job, other.attempt, other.stage, other.replica,
            me.attempt, me.stage
        );
        Verdict::Drop
    };
    link_auth::accept_first::<RingWire, _, _>(
        listener,
        key,
        me,
        until,
        HANDSHAKE_TIMEOUT,
        || stop.load(Ordering::Relaxed),
        judge,
    )
    .map_err(|e| match e {
        AcceptError::Failed(e) => e,
        AcceptError::TimedOut => lost("did not connect in time".into()),
        AcceptError::GaveUp => lost("gave up: the connection to the next replica failed".into()),
        AcceptError::Listener(e) => lost(format!("accept: {e}")),
    })
}

fn connect_next(
    me: &RingHello,
    key: &LinkKey,
    next: u32,
    address: &str,
    until: Instant,
    stop: &AtomicBool,
) -> Result<(TcpStream, FrameKeys), CollectiveError> {
    let mut last_error = String::from("not tried");
    let mut pause = RETRY;
    while Instant::now() < until && !stop.load(Ordering::Relaxed) {
        match address.to_socket_addrs() {
            Ok(resolved) => {
                for socket in resolved {
                    match handshake(me, key, next, socket, until) {
                        Ok(linked) => {
                            tracing::info!(%socket, replica = next, "ring: connected to the next replica");
                            return Ok(linked);
                        }
                        Err(Attempt::Fatal(e)) => return Err(e),
                        Err(Attempt::Retry(e)) => last_error = format!("{socket}: {e}"),
                    }
                }
            }
            Err(e) => last_error = format!("{address}: {e}"),
        }
        std::thread::sleep(pause.min(until.saturating_duration_since(Instant::now())));
        pause = (pause * 2).min(MAX_RETRY);
    }
    Err(CollectiveError::PeerLost {
        rank: next,
        detail: format!("did not answer at {address} in time; last: {last_error}"),
    })
}

/// Why one try to reach the next replica failed.
enum Attempt {
    /// Not (yet) there, or someone else: try again until the deadline.
    Retry(String),
    /// The replicas cannot train together.
    Fatal(CollectiveError),
}

fn handshake(
    me: &RingHello,
    key: &LinkKey,
    next: u32,
    socket: SocketAddr,
    until: Instant,
) -> Result<(TcpStream, FrameKeys), Attempt> {
    // Within the rendezvous deadline: a socket that accepts but never
    // answers must not hold the caller past it.
    let left = until
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(50));
    let retry = |e: &dyn std::fmt::Display| Attempt::Retry(e.to_string());
    let stream =
        TcpStream::connect_timeout(&socket, left.min(CONNECT_TIMEOUT)).map_err(|e| retry(&e))?;
    let handshake = Instant::now() + left.min(HANDSHAKE_TIMEOUT);
    // Returns once the other end proved the key (and we proved it back):
    // only then may its hello stop this replica.
    let (other, keys) = match link_auth::connect::<RingWire, RingHello>(&stream, handshake, key, me)
    {
        Ok(linked) => (linked.hello, linked.keys),
        Err(HandshakeError::BadProof) => {
            tracing::warn!(
                %socket,
                "ring: the listener at replica {next}'s address did not prove the job's peer key"
            );
            return Err(retry(&HandshakeError::BadProof));
        }
        Err(e) => return Err(retry(&e)),
    };
    if let Some(e) = me.superseded_by(&other) {
        return Err(Attempt::Fatal(e));
    }
    if me.same_ring(&other) {
        me.agrees(&other).map_err(Attempt::Fatal)?;
        if other.replica != next {
            return Err(Attempt::Fatal(CollectiveError::Protocol(format!(
                "{socket}, the address of replica {next}, answered as replica {}: the replicas' address lists differ",
                other.replica
            ))));
        }
        return Ok((stream, keys));
    }
    Err(Attempt::Retry(format!(
        "{socket} is {}/{} attempt {} stage {} replica {}, not replica {next} of attempt {} stage {}",
        other.namespace, other.job, other.attempt, other.stage, other.replica, me.attempt, me.stage
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::link_auth::tests::{closed, test_key, wrong_key};
    use crate::link_auth::{MAX_HANDSHAKE_PAYLOAD, NONCE_BYTES, PROOF_BYTES, Role};

    const QUICK: RingTimeouts = RingTimeouts {
        rendezvous: Duration::from_secs(10),
        io: Duration::from_secs(10),
    };

    /// Values with varied exponents and signs, different per rank, so the
    /// order of additions shows in the last bits.
    fn values(rank: u32, len: usize, seed: u64) -> Vec<f32> {
        let mut x = seed ^ (u64::from(rank) + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let unit = (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                unit * 2f32.powi((x % 16) as i32 - 8)
            })
            .collect()
    }

    /// Runs `f` on every rank of a loopback ring, each on its own thread,
    /// and returns the rings' results in rank order.
    fn on_ring<T: Send + 'static>(
        d: u32,
        chunk_bytes: usize,
        f: impl Fn(&mut Ring) -> T + Send + Sync + 'static,
    ) -> Vec<T> {
        let rings = Ring::loopback(d, QUICK).expect("ring");
        let f = Arc::new(f);
        let running: Vec<_> = rings
            .into_iter()
            .map(|mut ring| {
                let f = f.clone();
                std::thread::spawn(move || {
                    ring.set_chunk_bytes(chunk_bytes);
                    f(&mut ring)
                })
            })
            .collect();
        running
            .into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect()
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    fn naive_sum(d: u32, len: usize, seed: u64) -> Vec<f64> {
        let mut sum = vec![0f64; len];
        for r in 0..d {
            for (s, v) in sum.iter_mut().zip(values(r, len, seed)) {
                *s += f64::from(v);
            }
        }
        sum
    }

    fn assert_close(got: &[f32], want: &[f64], d: u32) {
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            // d − 1 roundings of values below 2^8 in magnitude.
            let tolerance = 1e-6 * f64::from(d) * (1.0 + w.abs()) + 1e-7 * 256.0 * f64::from(d);
            assert!(
                (f64::from(*g) - w).abs() <= tolerance,
                "element {i}: {g} vs {w}"
            );
        }
    }

    #[test]
    fn all_reduce_is_the_sum_and_bitwise_equal_on_every_rank() {
        for d in 1..=4u32 {
            // Lengths around and below d, and several chunks of 7 values per segment.
            for len in [0usize, 1, 3, 5, 64, 1001] {
                let results = on_ring(d, 28, move |ring| {
                    let mut data = values(ring.rank(), len, 1);
                    ring.all_reduce_sum(&mut data).expect("all-reduce");
                    let mut again = values(ring.rank(), len, 1);
                    ring.all_reduce_sum(&mut again).expect("second all-reduce");
                    (data, again)
                });
                assert_close(&results[0].0, &naive_sum(d, len, 1), d);
                for (r, (data, again)) in results.iter().enumerate() {
                    assert_eq!(
                        bits(data),
                        bits(&results[0].0),
                        "d {d} len {len}: rank {r} differs"
                    );
                    assert_eq!(
                        bits(again),
                        bits(data),
                        "d {d} len {len}: run-to-run differs"
                    );
                }
            }
        }
    }

    #[test]
    fn chunking_does_not_change_the_bits() {
        let len = 777;
        let with = |chunk_bytes| {
            on_ring(3, chunk_bytes, move |ring| {
                let mut data = values(ring.rank(), len, 5);
                ring.all_reduce_sum(&mut data).expect("all-reduce");
                bits(&data)
            })
        };
        assert_eq!(with(4), with(DEFAULT_CHUNK_BYTES));
    }

    #[test]
    fn reduce_scatter_and_all_gather_with_uneven_and_empty_segments() {
        let cases: &[(u32, &[usize])] = &[
            (2, &[0, 9]),
            (2, &[9, 0]),
            (3, &[1, 0, 40]),
            (3, &[0, 0, 0]),
            // A buffer smaller than d.
            (4, &[1, 0, 1, 0]),
            (4, &[0, 0, 2, 0]),
            (4, &[50, 3, 0, 17]),
            // The all-reduce's own cut.
            (3, &[14, 13, 13]),
        ];
        for &(d, counts) in cases {
            let counts = counts.to_vec();
            let len: usize = counts.iter().sum();
            let want = naive_sum(d, len, 2);
            let results = on_ring(d, 12, {
                let counts = counts.clone();
                move |ring| {
                    let mut data = values(ring.rank(), len, 2);
                    ring.reduce_scatter_sum(&mut data, &counts)
                        .expect("reduce-scatter");
                    let scattered = data.clone();
                    ring.all_gather(&mut data, &counts).expect("all-gather");
                    (scattered, data)
                }
            });
            let mut at = 0;
            for (r, &c) in counts.iter().enumerate() {
                let own = at..at + c;
                assert_close(&results[r].0[own.clone()], &want[own.clone()], d);
                // The all-gather only copies: every rank has rank r's bits.
                for (q, (_, gathered)) in results.iter().enumerate() {
                    assert_eq!(
                        bits(&gathered[own.clone()]),
                        bits(&results[r].0[own.clone()]),
                        "d {d} counts {counts:?}: rank {q} segment {r}"
                    );
                }
                at += c;
            }
            // The fused all-reduce gives the same bits as the two halves.
            let fused = on_ring(d, 12, move |ring| {
                let mut data = values(ring.rank(), len, 2);
                ring.all_reduce_sum(&mut data).expect("all-reduce");
                data
            });
            if counts == even_segments(len, d) {
                for data in &fused {
                    assert_eq!(bits(data), bits(&results[0].1), "d {d} counts {counts:?}");
                }
            }
        }
    }

    #[test]
    fn every_rank_gets_rank_0s_bytes_and_the_ring_goes_on() {
        let id: Vec<u8> = (0..128u32).map(|i| (i * 37 % 251) as u8).collect();
        for d in 1..=3u32 {
            let results = on_ring(d, DEFAULT_CHUNK_BYTES, {
                let id = id.clone();
                move |ring| {
                    let root = (ring.rank() == 0).then_some(id.as_slice());
                    let got = ring.broadcast_bytes(root, id.len()).expect("broadcast");
                    // The operations after it still line up.
                    let mut data = vec![ring.rank() as f32 + 1.0; 5];
                    ring.all_reduce_sum(&mut data).expect("all-reduce");
                    let again = ring
                        .broadcast_bytes(root, id.len())
                        .expect("second broadcast");
                    (got, data, again)
                }
            });
            let sum = (1..=d).sum::<u32>() as f32;
            for (r, (got, data, again)) in results.iter().enumerate() {
                assert_eq!(got, &id, "d {d}: rank {r}");
                assert_eq!(again, &id, "d {d}: rank {r}, second time");
                assert_eq!(data, &vec![sum; 5], "d {d}: rank {r}");
            }
        }
    }

    #[test]
    fn a_broadcast_is_refused_without_the_roots_bytes_or_against_another_call() {
        let results = on_ring(3, DEFAULT_CHUNK_BYTES, |ring| {
            let refused = match ring.rank() {
                0 => Some(ring.broadcast_bytes(None, 4).expect_err("no bytes")),
                _ => None,
            };
            if let Some(e) = &refused {
                assert!(matches!(e, CollectiveError::InvalidSegments(_)), "{e}");
            }
            // Nothing was sent: now rank 0 broadcasts while rank 1 all-reduces.
            if ring.rank() == 1 {
                let mut data = vec![1f32; 4];
                ring.all_reduce_sum(&mut data).map(|()| Vec::new())
            } else {
                let root = (ring.rank() == 0).then_some(&[7u8, 7, 7, 7][..]);
                ring.broadcast_bytes(root, 4)
            }
        });
        // Rank 1 reads rank 0's bytes where it waits for a Begin, rank 2
        // rank 1's Begin where it waits for bytes (or the connection rank 1
        // closed on noticing).
        assert!(
            matches!(&results[1], Err(CollectiveError::Protocol(_))),
            "{results:?}"
        );
        assert!(results[2].is_err(), "{results:?}");
    }

    #[test]
    fn a_large_buffer_does_not_deadlock() {
        // 64 MiB a rank: far beyond the sockets' buffers, in 4 MiB chunks.
        let len = 16 << 20;
        let results = on_ring(2, DEFAULT_CHUNK_BYTES, move |ring| {
            let mut data = vec![ring.rank() as f32 + 1.0; len];
            ring.all_reduce_sum(&mut data).expect("all-reduce");
            data.iter().all(|&v| v == 3.0)
        });
        assert_eq!(results, vec![true, true]);
    }

    #[test]
    fn wrong_segments_are_refused_before_sending() {
        let results = on_ring(2, DEFAULT_CHUNK_BYTES, |ring| {
            let mut data = vec![0f32; 4];
            let refused = ring.all_gather(&mut data, &[1, 2]).expect_err("3 ≠ 4");
            assert!(
                matches!(refused, CollectiveError::InvalidSegments(_)),
                "{refused}"
            );
            // Nothing was sent: the ring still works.
            ring.all_gather(&mut data, &[2, 2]).map(|()| data)
        });
        assert!(results.iter().all(Result::is_ok), "{results:?}");
    }

    #[test]
    fn ranks_that_disagree_on_the_segments_get_a_protocol_error() {
        let results = on_ring(3, DEFAULT_CHUNK_BYTES, |ring| {
            let counts = if ring.rank() == 1 {
                [2, 2, 2]
            } else {
                [1, 2, 3]
            };
            let mut data = vec![1f32; 6];
            let first = ring.reduce_scatter_sum(&mut data, &counts);
            // The ring is broken for good after a failure.
            let later = ring.all_reduce_sum(&mut data);
            (first, later)
        });
        // Ranks 1 (called by 0) and 2 (called by 1) see a stranger's Begin;
        // the first to read it shuts its links, so the others may see a
        // closed connection first. But the first failure is a protocol one.
        let protocol = results
            .iter()
            .filter(|(first, _)| matches!(first, Err(CollectiveError::Protocol(_))))
            .count();
        assert!(protocol >= 1, "{results:?}");
        for (first, later) in &results {
            assert!(first.is_err(), "{results:?}");
            assert_eq!(first, later);
        }
    }

    #[test]
    fn a_peer_that_goes_away_mid_operation_is_lost_not_a_hang() {
        let started = Instant::now();
        let mut rings = Ring::loopback(3, QUICK).expect("ring");
        let leaving = rings.pop().expect("rank 2");
        let running: Vec<_> = rings
            .into_iter()
            .map(|mut ring| {
                std::thread::spawn(move || {
                    let mut data = vec![1f32; 3 << 20];
                    ring.all_reduce_sum(&mut data)
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(50));
        drop(leaving);
        let results: Vec<_> = running
            .into_iter()
            .map(|h| h.join().expect("rank"))
            .collect();
        assert!(
            matches!(results[0], Err(CollectiveError::PeerLost { rank: 2, .. })),
            "{results:?}"
        );
        assert!(
            matches!(results[1], Err(CollectiveError::PeerLost { .. })),
            "{results:?}"
        );
        // Well within the 10 s timeout: closed connections are noticed at once.
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
    }

    #[test]
    fn a_silent_peer_is_lost_after_the_timeout() {
        let timeouts = RingTimeouts {
            rendezvous: Duration::from_secs(10),
            io: Duration::from_millis(300),
        };
        let mut rings = Ring::loopback(2, timeouts).expect("ring");
        let _silent = rings.pop().expect("rank 1");
        let mut ring = rings.pop().expect("rank 0");
        let mut data = vec![1f32; 10];
        let err = ring.all_reduce_sum(&mut data).expect_err("nobody answers");
        assert!(
            matches!(err, CollectiveError::PeerLost { rank: 1, .. }),
            "{err}"
        );
        assert!(err.to_string().contains("within"), "{err}");
    }

    fn hello(replica: u32, replicas: u32, attempt: u32, resume_step: u64) -> RingHello {
        RingHello {
            job: "j".into(),
            namespace: "ns".into(),
            attempt,
            stage: 1,
            replica,
            replicas,
            resume_step,
        }
    }

    #[test]
    fn a_replica_of_an_older_attempt_is_turned_away() {
        let (mut listeners, addresses) = Ring::bind_loopback(2).expect("sockets");
        let l1 = listeners.pop().expect("listener 1");
        let l0 = listeners.pop().expect("listener 0");
        let rank0 = {
            let addresses = addresses.clone();
            std::thread::spawn(move || {
                Ring::establish(&hello(0, 2, 2, 0), &test_key(), &addresses, l0, QUICK)
            })
        };
        // A leftover replica 1 of attempt 1 calls replica 0 first.
        let (mut stale_listeners, stale_addresses) = Ring::bind_loopback(2).expect("sockets");
        let stale_addresses = vec![addresses[0].clone(), stale_addresses[1].clone()];
        let stale = Ring::establish(
            &hello(1, 2, 1, 0),
            &test_key(),
            &stale_addresses,
            stale_listeners.pop().expect("stale listener"),
            QUICK,
        )
        .expect_err("attempt 1 is over");
        assert!(matches!(stale, CollectiveError::Protocol(_)), "{stale}");
        assert!(stale.to_string().contains("superseded"), "{stale}");
        // Replica 0 of attempt 2 waited on and rings with the real replica 1.
        let mut ring1 = Ring::establish(&hello(1, 2, 2, 0), &test_key(), &addresses, l1, QUICK)
            .expect("ring 1");
        let mut ring0 = rank0.join().expect("rank 0").expect("ring 0");
        let other = std::thread::spawn(move || {
            let mut data = vec![2f32; 5];
            ring1.all_reduce_sum(&mut data).map(|()| data)
        });
        let mut data = vec![1f32; 5];
        ring0.all_reduce_sum(&mut data).expect("all-reduce");
        assert_eq!(data, vec![3f32; 5]);
        assert_eq!(other.join().expect("rank 1"), Ok(vec![3f32; 5]));
    }

    #[test]
    fn replicas_that_disagree_refuse_to_start() {
        for (h0, h1) in [
            (hello(0, 2, 1, 10), hello(1, 2, 1, 20)),
            (hello(0, 2, 1, 0), hello(1, 3, 1, 0)),
        ] {
            let (mut listeners, addresses) = Ring::bind_loopback(2).expect("sockets");
            let l1 = listeners.pop().expect("listener 1");
            let l0 = listeners.pop().expect("listener 0");
            let a = {
                let addresses = addresses.clone();
                std::thread::spawn(move || Ring::establish(&h0, &test_key(), &addresses, l0, QUICK))
            };
            let mut addresses1 = addresses.clone();
            if h1.replicas == 3 {
                addresses1.push(addresses[0].clone());
            }
            let b = Ring::establish(&h1, &test_key(), &addresses1, l1, QUICK);
            let a = a.join().expect("thread");
            for err in [
                a.expect_err("replica 0 refuses"),
                b.expect_err("replica 1 refuses"),
            ] {
                assert!(matches!(err, CollectiveError::Protocol(_)), "{err}");
                assert!(err.to_string().contains("same checkpoint"), "{err}");
            }
        }
    }

    #[test]
    fn a_missing_neighbour_times_out_as_a_lost_peer() {
        let (mut listeners, addresses) = Ring::bind_loopback(2).expect("sockets");
        let l0 = listeners.remove(0);
        let timeouts = RingTimeouts {
            rendezvous: Duration::from_millis(400),
            io: Duration::from_secs(1),
        };
        // Replica 1's socket exists but nobody answers the handshake.
        let err = Ring::establish(&hello(0, 2, 1, 0), &test_key(), &addresses, l0, timeouts)
            .expect_err("nobody");
        assert!(
            matches!(err, CollectiveError::PeerLost { rank: 1, .. }),
            "{err}"
        );
    }

    /// Replica 0 of attempt 2 joining a 2-replica ring on its own thread,
    /// and the ring's addresses and replica 1's socket.
    fn replica_0_waiting() -> (
        std::thread::JoinHandle<Result<Ring, CollectiveError>>,
        Vec<String>,
        TcpListener,
    ) {
        let (mut listeners, addresses) = Ring::bind_loopback(2).expect("sockets");
        let l1 = listeners.pop().expect("listener 1");
        let l0 = listeners.pop().expect("listener 0");
        let rank0 = {
            let addresses = addresses.clone();
            std::thread::spawn(move || {
                Ring::establish(&hello(0, 2, 2, 0), &test_key(), &addresses, l0, QUICK)
            })
        };
        (rank0, addresses, l1)
    }

    #[test]
    fn a_stranger_claiming_a_later_attempt_without_the_key_does_not_stop_a_replica() {
        let (rank0, addresses, l1) = replica_0_waiting();
        let connect = || TcpStream::connect(&addresses[0]).expect("connect");
        let soon = || Instant::now() + Duration::from_secs(5);
        // A stranger that knows the job's names claims attempt 3.
        let newer = hello(1, 2, 3, 0);

        // With a wrong key it cannot check replica 0's proof, and sends none.
        let stream = connect();
        let err = link_auth::connect::<RingWire, RingHello>(&stream, soon(), &wrong_key(), &newer)
            .expect_err("replica 0 proves another key");
        assert!(matches!(err, HandshakeError::BadProof), "{err}");
        drop(stream);

        // Going on regardless: replica 0's proof reflected back, then a
        // proof made under a wrong key. Both are refused.
        let nonce_c = [3u8; NONCE_BYTES];
        let json = serde_json::to_vec(&newer).expect("json");
        let mut answers = Vec::new();
        for forge in [false, true] {
            let stream = connect();
            RingWire::send(&stream, Message::Hello, &[&nonce_c[..], &json].concat()).expect("send");
            let reply = RingWire::recv(&mut &stream, Message::Hello, MAX_HANDSHAKE_PAYLOAD)
                .expect("replica 0 answers");
            let nonce_a: [u8; NONCE_BYTES] = reply[..NONCE_BYTES].try_into().expect("nonce");
            let proof_a: [u8; PROOF_BYTES] = reply[NONCE_BYTES..NONCE_BYTES + PROOF_BYTES]
                .try_into()
                .expect("proof");
            let proof = if forge {
                link_auth::prove(
                    &wrong_key(),
                    Role::Connect,
                    &nonce_c,
                    &nonce_a,
                    &newer.identity(),
                )
            } else {
                proof_a
            };
            RingWire::send(&stream, Message::Proof, &proof).expect("send");
            assert!(closed(&stream), "forged {forge}: refused");
            answers.push((nonce_a, proof_a));
        }
        // Same nonce from the caller, different answers: nothing to replay.
        assert_ne!(answers[0], answers[1]);

        // Replica 0 did not stop: it rings with the real replica 1.
        let mut ring1 = Ring::establish(&hello(1, 2, 2, 0), &test_key(), &addresses, l1, QUICK)
            .expect("ring 1");
        let mut ring0 = rank0.join().expect("rank 0").expect("ring 0");
        let other = std::thread::spawn(move || {
            let mut data = vec![2f32; 5];
            ring1.all_reduce_sum(&mut data).map(|()| data)
        });
        let mut data = vec![1f32; 5];
        ring0.all_reduce_sum(&mut data).expect("all-reduce");
        assert_eq!(data, vec![3f32; 5]);
        assert_eq!(other.join().expect("rank 1"), Ok(vec![3f32; 5]));
    }

    #[test]
    fn stalling_strangers_do_not_hold_up_the_ring() {
        let (rank0, addresses, l1) = replica_0_waiting();
        // 20 strangers without the key call replica 0 and stall: half of
        // them silent, half after the first bytes of a hello frame.
        let mut partial = Vec::new();
        Frame::with_payload(
            Header {
                kind: Kind::Hello,
                seq: 0,
                step: 0,
                chunk: 0,
                len: 0,
            },
            &[1; 64],
            &Pool::default(),
        )
        .write_to(&mut partial)
        .expect("frame");
        partial.truncate(partial.len() / 2);
        let held: Vec<_> = (0..20)
            .map(|i| {
                let stream = TcpStream::connect(&addresses[0]).expect("connect");
                if i % 2 == 1 {
                    link_auth::write_all(&stream, &partial).expect("send");
                }
                stream
            })
            .collect();
        // Let replica 0 take them all in before the real replica 1 calls.
        std::thread::sleep(Duration::from_millis(200));
        let started = Instant::now();
        let ring1 = Ring::establish(&hello(1, 2, 2, 0), &test_key(), &addresses, l1, QUICK);
        let took = started.elapsed();
        assert!(
            took < Duration::from_secs(3),
            "replica 1 took {took:?} past 20 stalling strangers: {ring1:?}"
        );
        let mut ring1 = ring1.expect("ring 1");
        let mut ring0 = rank0.join().expect("rank 0").expect("ring 0");
        let other = std::thread::spawn(move || {
            let mut data = vec![2f32; 5];
            ring1.all_reduce_sum(&mut data).map(|()| data)
        });
        let mut data = vec![1f32; 5];
        ring0.all_reduce_sum(&mut data).expect("all-reduce");
        assert_eq!(data, vec![3f32; 5]);
        assert_eq!(other.join().expect("rank 1"), Ok(vec![3f32; 5]));
        drop(held);
    }

    #[test]
    fn a_later_attempt_that_proves_the_key_stops_a_replica() {
        let (rank0, addresses, l1) = replica_0_waiting();
        // Replica 0's own call is answered (here, by the test, with the
        // key): what stops replica 0 is the hello it accepts.
        let answering = std::thread::spawn(move || {
            let (stream, _) = l1.accept().expect("accept");
            let until = Instant::now() + Duration::from_secs(5);
            link_auth::accept::<RingWire, RingHello>(
                &stream,
                until,
                &test_key(),
                &hello(1, 2, 2, 0),
            )
            .map(|_| stream)
        });
        let stream = TcpStream::connect(&addresses[0]).expect("connect");
        let until = Instant::now() + Duration::from_secs(5);
        let answered = link_auth::connect::<RingWire, RingHello>(
            &stream,
            until,
            &test_key(),
            &hello(1, 2, 3, 0),
        )
        .expect("replica 0 proves the key");
        assert_eq!(answered.hello, hello(0, 2, 2, 0));
        let err = rank0.join().expect("rank 0").expect_err("superseded");
        assert!(answering.join().expect("answering").is_ok());
        assert!(matches!(err, CollectiveError::Protocol(_)), "{err}");
        assert!(err.to_string().contains("superseded"), "{err}");
    }

    #[test]
    fn an_oversized_or_foreign_hello_is_refused_and_the_ring_still_forms() {
        let (rank0, addresses, l1) = replica_0_waiting();
        let connect = || TcpStream::connect(&addresses[0]).expect("connect");
        // A header announcing a 64 MiB hello: refused before the allocation.
        let stream = connect();
        let mut header = Vec::new();
        Frame::with_payload(
            Header {
                kind: Kind::Hello,
                seq: 0,
                step: 0,
                chunk: 0,
                len: 0,
            },
            &[],
            &Pool::default(),
        )
        .write_to(&mut header)
        .expect("header");
        header[24..28].copy_from_slice(&(MAX_PAYLOAD as u32).to_le_bytes());
        link_auth::write_all(&stream, &header).expect("send");
        assert!(closed(&stream), "an oversized hello is refused");
        // Something that is not a ring at all.
        let stream = connect();
        link_auth::write_all(&stream, b"GET / HTTP/1.1\r\nHost: example\r\n\r\n").expect("send");
        assert!(closed(&stream), "not a ring");
        let ring1 = Ring::establish(&hello(1, 2, 2, 0), &test_key(), &addresses, l1, QUICK);
        assert!(ring1.is_ok(), "{ring1:?}");
        assert!(rank0.join().expect("rank 0").is_ok());
    }
}
