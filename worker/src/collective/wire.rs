//! Frames between ring neighbours and the two threads that move them.
//!
//! A frame is a 32-byte header (magic, kind, operation sequence number,
//! ring step, chunk index, payload length) followed by its payload: f32
//! values, little-endian, for a chunk of a segment; nonces, proofs and JSON
//! for the handshake; raw bytes for a broadcast.
//! Header and payload live in one buffer, so a frame goes out in one `write`
//! and comes in without a copy between the socket and the caller.
//!
//! Every rank sends to its next neighbour and receives from its previous one
//! at the same time, and a ring has no rank that could go first: with
//! blocking sends alone, d ranks each writing a segment larger than the
//! kernel's socket buffers would wait on each other for ever. So each link
//! has a reader thread that always drains the socket into a queue, and the
//! sending side a writer thread, so the caller's thread adds chunk c while
//! the next chunks are on their way in and out. The queue is unbounded, but
//! the ring's schedule bounds it: a rank sends at most a couple of chunks
//! beyond what it has received, so only a few chunks per rank are ever in
//! flight.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::mpsc::{
    Receiver, RecvTimeoutError, SyncSender, TryRecvError, channel, sync_channel,
};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use super::CollectiveError;
use crate::link_mac::{FrameKeys, FrameMac, TAG_BYTES};

const MAGIC: u32 = 0x4844_5243; // "HDRC"
/// Header bytes in front of every payload.
pub const HEADER: usize = 32;
/// Largest payload a reader accepts, in bytes (a corrupt or foreign header
/// must not allocate the machine away; chunks are at most this).
pub const MAX_PAYLOAD: usize = 64 << 20;
/// Frames the caller may queue for the writer beyond the one being written:
/// enough to keep the socket busy while the caller adds the next chunk.
const OUTBOX: usize = 2;
/// Spare buffers kept for reuse (each up to a chunk plus header).
const POOL: usize = 8;

/// What a frame carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// Handshake: who is calling, for which attempt, from which step.
    Hello = 1,
    /// The start of an operation: what it is and over which segments, so
    /// ranks that disagree stop before summing anything.
    Begin = 2,
    /// Part of a segment in one ring step.
    Chunk = 3,
    /// Rank 0's bytes passed round the ring once (`Ring::broadcast_bytes`:
    /// the NCCL communicator id).
    Bytes = 4,
    /// Handshake: the calling rank's proof of the job's peer key
    /// ([`crate::link_auth`]).
    Proof = 5,
}

impl Kind {
    fn from_u8(v: u8) -> Option<Kind> {
        Some(match v {
            1 => Kind::Hello,
            2 => Kind::Begin,
            3 => Kind::Chunk,
            4 => Kind::Bytes,
            5 => Kind::Proof,
            _ => return None,
        })
    }
}

/// A frame's header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub kind: Kind,
    /// The operation's sequence number on this ring (1 for the first).
    pub seq: u64,
    /// The ring step, 0 ..= 2(d − 1) − 1 (reduce-scatter steps first).
    pub step: u32,
    /// The chunk's index within its segment.
    pub chunk: u32,
    /// Payload bytes.
    pub len: u32,
}

impl Header {
    fn encode(&self) -> [u8; HEADER] {
        let mut out = [0u8; HEADER];
        out[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        out[4] = self.kind as u8;
        out[8..16].copy_from_slice(&self.seq.to_le_bytes());
        out[16..20].copy_from_slice(&self.step.to_le_bytes());
        out[20..24].copy_from_slice(&self.chunk.to_le_bytes());
        out[24..28].copy_from_slice(&self.len.to_le_bytes());
        out
    }

    fn decode(bytes: &[u8; HEADER]) -> std::io::Result<Header> {
        let bad = |m: String| std::io::Error::new(std::io::ErrorKind::InvalidData, m);
        let u32_at =
            |i: usize| u32::from_le_bytes([bytes[i], bytes[i + 1], bytes[i + 2], bytes[i + 3]]);
        if u32_at(0) != MAGIC {
            return Err(bad("not a Headroom collective stream (bad magic)".into()));
        }
        let kind = Kind::from_u8(bytes[4])
            .ok_or_else(|| bad(format!("unknown frame kind {}", bytes[4])))?;
        let mut seq = [0u8; 8];
        seq.copy_from_slice(&bytes[8..16]);
        let header = Header {
            kind,
            seq: u64::from_le_bytes(seq),
            step: u32_at(16),
            chunk: u32_at(20),
            len: u32_at(24),
        };
        if header.len as usize > MAX_PAYLOAD {
            return Err(bad(format!("frame payload of {} bytes", header.len)));
        }
        Ok(header)
    }
}

/// Buffers handed back by the writer and by the caller (once it has added a
/// received chunk) for the reader and the caller to fill again: a ring moves
/// hundreds of chunks per operation, all of one size.
#[derive(Clone, Debug, Default)]
pub struct Pool(Arc<Mutex<Vec<Vec<u8>>>>);

impl Pool {
    fn take(&self, len: usize) -> Vec<u8> {
        let spare = self.0.lock().unwrap_or_else(PoisonError::into_inner).pop();
        let mut buf = spare.unwrap_or_default();
        // Only what grows is zero-filled: a reused chunk buffer costs nothing here.
        buf.resize(len, 0);
        buf
    }

    pub fn give(&self, buf: Vec<u8>) {
        let mut spare = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if spare.len() < POOL {
            spare.push(buf);
        }
    }
}

/// A header and its payload in one buffer.
#[derive(Debug)]
pub struct Frame {
    header: Header,
    buf: Vec<u8>,
}

impl Frame {
    /// A frame with a zeroed (or stale) payload of `header.len` bytes to fill.
    pub fn new(header: Header, pool: &Pool) -> Frame {
        let mut buf = pool.take(HEADER + header.len as usize);
        buf[..HEADER].copy_from_slice(&header.encode());
        Frame { header, buf }
    }

    pub fn with_payload(header: Header, payload: &[u8], pool: &Pool) -> Frame {
        let mut frame = Frame::new(
            Header {
                len: payload.len() as u32,
                ..header
            },
            pool,
        );
        frame.payload_mut().copy_from_slice(payload);
        frame
    }

    pub fn header(&self) -> Header {
        self.header
    }

    pub fn payload(&self) -> &[u8] {
        &self.buf[HEADER..]
    }

    pub fn payload_mut(&mut self) -> &mut [u8] {
        &mut self.buf[HEADER..]
    }

    pub fn into_buf(self) -> Vec<u8> {
        self.buf
    }

    pub fn write_to(&self, w: &mut impl Write) -> std::io::Result<()> {
        w.write_all(&self.buf)
    }

    /// Writes the frame and its tag under `mac` ([`crate::link_mac`]).
    pub fn write_sealed(&self, w: &mut impl Write, mac: &mut FrameMac) -> std::io::Result<()> {
        let (head, payload) = self.buf.split_at(HEADER);
        let tag = mac
            .tag(head, payload)
            .map_err(|e| std::io::Error::other(e.to_string()))?;
        w.write_all(&self.buf)?;
        w.write_all(&tag)
    }

    /// Reads one frame and its tag, checked under `mac`; `Ok(None)` on a
    /// clean end of stream before a header. A frame whose tag fails is an
    /// error of kind `PermissionDenied` that says so.
    pub fn read_sealed(
        r: &mut impl Read,
        pool: &Pool,
        mac: &mut FrameMac,
    ) -> std::io::Result<Option<Frame>> {
        let Some(frame) = Frame::read_from(r, pool)? else {
            return Ok(None);
        };
        let mut tag = [0u8; TAG_BYTES];
        r.read_exact(&mut tag)?;
        let (head, payload) = frame.buf.split_at(HEADER);
        mac.check(head, payload, &tag).map_err(|e| {
            std::io::Error::new(std::io::ErrorKind::PermissionDenied, e.to_string())
        })?;
        Ok(Some(frame))
    }

    /// Reads one frame; `Ok(None)` on a clean end of stream before a header.
    pub fn read_from(r: &mut impl Read, pool: &Pool) -> std::io::Result<Option<Frame>> {
        Frame::read_capped(r, pool, MAX_PAYLOAD)
    }

    /// [`Frame::read_from`] refusing, before allocating, a payload over
    /// `max` bytes: the handshake reads a caller that has proved nothing yet.
    pub fn read_capped(
        r: &mut impl Read,
        pool: &Pool,
        max: usize,
    ) -> std::io::Result<Option<Frame>> {
        let mut head = [0u8; HEADER];
        match r.read_exact(&mut head) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
            Err(e) => return Err(e),
        }
        let header = Header::decode(&head)?;
        if header.len as usize > max {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("{:?} frame payload of {} bytes", header.kind, header.len),
            ));
        }
        let mut buf = pool.take(HEADER + header.len as usize);
        buf[..HEADER].copy_from_slice(&head);
        r.read_exact(&mut buf[HEADER..])?;
        Ok(Some(Frame { header, buf }))
    }
}

/// What the reader thread hands over.
#[derive(Debug)]
enum Incoming {
    Frame(Frame),
    /// The neighbour closed the connection.
    Closed,
    Failed(std::io::Error),
}

/// What the caller hands the writer thread.
#[derive(Debug)]
enum Outgoing {
    Frame(Frame),
    /// Report when everything queued so far has been written (operation `seq`).
    Flush(u64),
}

/// A rank's two ring connections, handshaken: frames to the next rank go
/// through the writer thread, frames from the previous one come from the
/// reader thread's queue.
#[derive(Debug)]
pub struct RingLinks {
    /// The previous rank (we receive from it).
    pub prev: u32,
    /// The next rank (we send to it).
    pub next: u32,
    from_prev: TcpStream,
    to_next: TcpStream,
    inbox: Receiver<Incoming>,
    outbox: SyncSender<Outgoing>,
    /// The writer's answers to `Flush`, or why it stopped.
    written: Receiver<Result<u64, std::io::Error>>,
    pool: Pool,
    timeout: Duration,
}

impl RingLinks {
    /// Starts the reader and writer threads on handshaken streams, each
    /// with its handshake's keys: frames from the previous rank are checked
    /// under its connection's, frames to the next tagged under its own.
    /// `timeout` bounds every wait for a frame and every write that makes
    /// no progress.
    pub fn start(
        prev: u32,
        (from_prev, from_prev_keys): (TcpStream, FrameKeys),
        next: u32,
        (to_next, to_next_keys): (TcpStream, FrameKeys),
        timeout: Duration,
    ) -> Result<RingLinks, CollectiveError> {
        let mut check = from_prev_keys.recv;
        let mut seal = to_next_keys.send;
        let pool = Pool::default();
        let lost = |rank: u32| {
            move |e: std::io::Error| CollectiveError::PeerLost {
                rank,
                detail: e.to_string(),
            }
        };
        from_prev.set_read_timeout(None).map_err(lost(prev))?;
        to_next.set_nodelay(true).map_err(lost(next))?;
        // A write that makes no progress for this long means the next rank
        // stopped reading; without it the writer could block for ever.
        to_next
            .set_write_timeout(Some(timeout))
            .map_err(lost(next))?;

        let (incoming, inbox) = channel();
        let mut reader = from_prev.try_clone().map_err(lost(prev))?;
        let reader_pool = pool.clone();
        std::thread::Builder::new()
            .name(format!("headroom-ring-from-{prev}"))
            .spawn(move || {
                loop {
                    let message = match Frame::read_sealed(&mut reader, &reader_pool, &mut check) {
                        Ok(Some(frame)) => Incoming::Frame(frame),
                        Ok(None) => Incoming::Closed,
                        Err(e) => {
                            if e.kind() == std::io::ErrorKind::PermissionDenied {
                                // Nothing more from this connection is
                                // believed: the previous rank learns at once.
                                let _ = reader.shutdown(Shutdown::Both);
                            }
                            Incoming::Failed(e)
                        }
                    };
                    let more = matches!(message, Incoming::Frame(_));
                    if incoming.send(message).is_err() || !more {
                        return;
                    }
                }
            })
            .map_err(lost(prev))?;

        let (outbox, outgoing) = sync_channel::<Outgoing>(OUTBOX);
        let (done, written) = channel();
        let mut writer = to_next.try_clone().map_err(lost(next))?;
        let writer_pool = pool.clone();
        std::thread::Builder::new()
            .name(format!("headroom-ring-to-{next}"))
            .spawn(move || {
                // Ends when the caller drops the outbox (the ring is dropped).
                while let Ok(message) = outgoing.recv() {
                    let result = match message {
                        Outgoing::Frame(frame) => {
                            let result = frame.write_sealed(&mut writer, &mut seal);
                            writer_pool.give(frame.into_buf());
                            match result {
                                Ok(()) => continue,
                                Err(e) => Err(e),
                            }
                        }
                        Outgoing::Flush(seq) => writer.flush().map(|()| seq),
                    };
                    let failed = result.is_err();
                    if done.send(result).is_err() || failed {
                        return;
                    }
                }
            })
            .map_err(lost(next))?;

        Ok(RingLinks {
            prev,
            next,
            from_prev,
            to_next,
            inbox,
            outbox,
            written,
            pool,
            timeout,
        })
    }

    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// Queues a frame for the next rank; blocks while the writer is
    /// `OUTBOX` frames behind.
    pub fn send(&self, frame: Frame) -> Result<(), CollectiveError> {
        let header = frame.header();
        self.outbox
            .send(Outgoing::Frame(frame))
            .map_err(|_| self.writer_stopped(header))
    }

    /// Waits until everything queued for operation `seq` is written to the
    /// socket (handed to the kernel, not necessarily read by the next rank).
    pub fn flush(&self, seq: u64) -> Result<(), CollectiveError> {
        let lost = |detail: String| CollectiveError::PeerLost {
            rank: self.next,
            detail,
        };
        self.outbox
            .send(Outgoing::Flush(seq))
            .map_err(|_| lost(self.writer_error()))?;
        match self.written.recv_timeout(self.timeout) {
            Ok(Ok(done)) if done == seq => Ok(()),
            Ok(Ok(done)) => Err(CollectiveError::Protocol(format!(
                "the writer finished operation {done} while operation {seq} was waiting"
            ))),
            Ok(Err(e)) => Err(lost(format!("sending operation {seq}: {e}"))),
            Err(RecvTimeoutError::Timeout) => Err(lost(format!(
                "did not take operation {seq}'s last frames within {:?}",
                self.timeout
            ))),
            Err(RecvTimeoutError::Disconnected) => Err(lost("the writer stopped".into())),
        }
    }

    /// The next frame from the previous rank, which must have `want`'s kind,
    /// operation, step, chunk and length: the schedule is deterministic, so
    /// anything else means the ranks disagree.
    pub fn recv(&self, want: Header) -> Result<Frame, CollectiveError> {
        let lost = |detail: String| CollectiveError::PeerLost {
            rank: self.prev,
            detail,
        };
        let frame = match self.inbox.recv_timeout(self.timeout) {
            Ok(Incoming::Frame(frame)) => frame,
            Ok(Incoming::Closed) => return Err(lost("closed the connection".into())),
            Ok(Incoming::Failed(e)) if e.kind() == std::io::ErrorKind::InvalidData => {
                return Err(CollectiveError::Protocol(format!(
                    "replica {}: {e}",
                    self.prev
                )));
            }
            Ok(Incoming::Failed(e)) => return Err(lost(e.to_string())),
            Err(RecvTimeoutError::Timeout) => {
                return Err(lost(format!(
                    "nothing for operation {} step {} chunk {} within {:?}",
                    want.seq, want.step, want.chunk, self.timeout
                )));
            }
            Err(RecvTimeoutError::Disconnected) => return Err(lost("the reader stopped".into())),
        };
        if frame.header() != want {
            return Err(CollectiveError::Protocol(format!(
                "replica {} sent {:?}, expected {want:?}: the replicas disagree on the sequence of operations or their segments",
                self.prev,
                frame.header()
            )));
        }
        Ok(frame)
    }

    /// Closes both connections now, so the neighbours learn of a failure
    /// at once rather than after their timeout, and the threads end.
    pub fn shutdown(&self) {
        // Errors mean the socket is already closed, which is the point.
        let _ = self.from_prev.shutdown(Shutdown::Both);
        let _ = self.to_next.shutdown(Shutdown::Both);
    }

    fn writer_stopped(&self, header: Header) -> CollectiveError {
        CollectiveError::PeerLost {
            rank: self.next,
            detail: format!(
                "sending operation {} step {} chunk {}: {}",
                header.seq,
                header.step,
                header.chunk,
                self.writer_error()
            ),
        }
    }

    /// Why the writer thread ended, if it said.
    fn writer_error(&self) -> String {
        match self.written.try_recv() {
            Ok(Err(e)) => e.to_string(),
            Ok(Ok(_)) | Err(TryRecvError::Empty | TryRecvError::Disconnected) => {
                "the writer stopped".into()
            }
        }
    }
}

impl Drop for RingLinks {
    fn drop(&mut self) {
        // Every operation flushed its frames before returning, so nothing
        // queued is lost: the next rank reads what we wrote, then the end of
        // the stream. Shutting down wakes the reader thread blocked in `read`.
        self.shutdown();
    }
}

/// Writes one frame directly (the handshake, before the threads start).
pub fn write_frame(stream: &TcpStream, header: Header, payload: &[u8]) -> std::io::Result<()> {
    let pool = Pool::default();
    let mut stream = stream;
    Frame::with_payload(header, payload, &pool).write_to(&mut stream)?;
    stream.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_reject_garbage() {
        let pool = Pool::default();
        let header = Header {
            kind: Kind::Chunk,
            seq: 9,
            step: 3,
            chunk: 2,
            len: 0,
        };
        let payload: Vec<u8> = [1.0f32, -2.5]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let frame = Frame::with_payload(header, &payload, &pool);
        assert_eq!(frame.header().len, 8);
        let mut bytes = Vec::new();
        frame.write_to(&mut bytes).expect("write");
        assert_eq!(bytes.len(), HEADER + 8);
        let back = Frame::read_from(&mut bytes.as_slice(), &pool)
            .expect("read")
            .expect("frame");
        assert_eq!(back.header(), frame.header());
        assert_eq!(back.payload(), payload.as_slice());

        assert!(
            Frame::read_from(&mut &b""[..], &pool)
                .expect("eof")
                .is_none()
        );
        let err = Frame::read_from(&mut &b"GET / HTTP/1.1\r\nHost: x\r\n\r\n12345"[..], &pool)
            .expect_err("not ours");
        assert!(err.to_string().contains("magic"), "{err}");
        let mut huge = header.encode();
        huge[24..28].copy_from_slice(&u32::MAX.to_le_bytes());
        let err = Frame::read_from(&mut &huge[..], &pool).expect_err("too large");
        assert!(err.to_string().contains("payload"), "{err}");
        let mut truncated = bytes.clone();
        truncated.truncate(bytes.len() - 3);
        assert!(Frame::read_from(&mut truncated.as_slice(), &pool).is_err());
    }

    fn chunk(seq: u64, chunk: u32) -> Header {
        Header {
            kind: Kind::Chunk,
            seq,
            step: 0,
            chunk,
            len: 0,
        }
    }

    /// Frames `0..n` of a ring connection as its sender writes them.
    fn sealed(n: u32) -> Vec<Vec<u8>> {
        let pool = Pool::default();
        let mut mac = crate::link_mac::tests::ends().0.send;
        (0..n)
            .map(|c| {
                let payload: Vec<u8> = (0..64).map(|b| b as u8 ^ c as u8).collect();
                let mut bytes = Vec::new();
                Frame::with_payload(chunk(1, c), &payload, &pool)
                    .write_sealed(&mut bytes, &mut mac)
                    .expect("write");
                bytes
            })
            .collect()
    }

    /// How many frames the receiving end reads from `bytes`, and whether
    /// it then refused one for its tag.
    fn receive(bytes: &[u8]) -> (usize, bool) {
        let (pool, mut r) = (Pool::default(), bytes);
        let mut mac = crate::link_mac::tests::ends().1.recv;
        let mut read = 0;
        loop {
            match Frame::read_sealed(&mut r, &pool, &mut mac) {
                Ok(Some(_)) => read += 1,
                Ok(None) => return (read, false),
                Err(e) => {
                    let tag = e.kind() == std::io::ErrorKind::PermissionDenied
                        && e.to_string().contains("failed its integrity check");
                    return (read, tag);
                }
            }
        }
    }

    /// A flipped bit in the sequence number, step, chunk, payload or tag,
    /// a replayed frame, a dropped one and two swapped are each refused
    /// (the magic, kind and length are checked before the tag is read).
    #[test]
    fn sealed_frames_refuse_a_flipped_bit_a_replay_a_drop_and_a_reorder() {
        let wire = sealed(3);
        assert_eq!(receive(&wire.concat()), (3, false));
        for bit in 8 * 8..wire[0].len() * 8 {
            if (24 * 8..28 * 8).contains(&bit) {
                continue; // the length: a short or long read, not a tag
            }
            let mut bytes = wire[0].clone();
            bytes[bit / 8] ^= 1 << (bit % 8);
            assert_eq!(receive(&bytes), (0, true), "bit {bit}");
        }
        let order = |frames: &[usize]| -> Vec<u8> {
            frames.iter().flat_map(|&i| wire[i].clone()).collect()
        };
        assert_eq!(receive(&order(&[0, 1, 1, 2])), (2, true), "replayed");
        assert_eq!(receive(&order(&[0, 2])), (1, true), "dropped");
        assert_eq!(receive(&order(&[1, 0, 2])), (0, true), "reordered");
    }

    /// A rank whose previous neighbour's frame was altered on the way sees
    /// that neighbour lost, with the reason, and the connection is closed.
    #[test]
    fn a_ring_link_whose_frame_is_altered_on_the_way_ends_as_a_lost_peer() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let address = listener.local_addr().expect("address");
        let mut prev = TcpStream::connect(address).expect("connect");
        let (from_prev, _) = listener.accept().expect("accept");
        let _next = TcpStream::connect(address).expect("connect");
        let (to_next, _) = listener.accept().expect("accept");
        let (_, acceptor) = crate::link_mac::tests::ends();
        let (_, unused) = crate::link_mac::tests::ends();
        let links = RingLinks::start(
            1,
            (from_prev, acceptor),
            2,
            (to_next, unused),
            Duration::from_secs(5),
        )
        .expect("links");
        let mut bytes = sealed(2).concat();
        bytes[HEADER + 3] ^= 1; // in the first frame's payload
        prev.write_all(&bytes).expect("send");
        let err = links.recv(chunk(1, 0)).expect_err("altered");
        assert!(
            matches!(&err, CollectiveError::PeerLost { rank: 1, detail }
                if detail.contains("frame 0 failed its integrity check")),
            "{err}"
        );
        assert!(crate::link_auth::tests::closed(&prev));
    }
}
