//! Frames between neighbouring stages and the links that carry them.
//!
//! A frame is a fixed header (magic, kind, step, micro-batch, shape, payload
//! length) and a payload: little-endian f32 values for tensors, UTF-8 JSON for
//! the handshake. Every link has a reader thread that moves incoming frames
//! into a queue as they arrive, so a stage's blocking `send` can never wait on
//! a neighbour that is itself blocked sending to us (both sides of a 1F1B
//! steady state send at once). The queue is unbounded but holds at most the
//! micro-batches the schedule keeps in flight.

use std::io::{BufReader, BufWriter, Read, Write};
use std::net::TcpStream;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::time::Duration;

use burn::tensor::{Device, Tensor, TensorData};

use super::PipelineError;
use crate::link_mac::{FrameKeys, FrameMac, TAG_BYTES};

const MAGIC: u32 = 0x4844_524d; // "HDRM"
/// Largest payload accepted (a corrupt header must not allocate the machine away).
const MAX_PAYLOAD: u64 = 16 << 30;
const MAX_RANK: usize = 8;

/// What a frame carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// Handshake: who is calling, for which attempt, from which step.
    Hello = 1,
    /// A stage's output for micro-batch `micro`, sent to the next stage.
    Activation = 2,
    /// The loss gradient with respect to a stage's input, sent to the previous stage.
    Gradient = 3,
    /// The gradient of the tied token embedding, relayed between the first and last stage.
    TiedGradient = 4,
    /// Handshake: the calling stage's proof of the job's peer key
    /// ([`crate::link_auth`]).
    Proof = 5,
    /// A partial sum of the squared gradients, summed from the first stage
    /// to the last (micro 0), and the model's total sent back (micro 1):
    /// clipping by the global norm.
    GradientNorm = 6,
    /// A stage's output for held-out batch `micro` of an evaluation,
    /// sent to the next stage (forward only: no gradient comes back).
    EvalActivation = 7,
}

impl Kind {
    fn from_u8(v: u8) -> Option<Kind> {
        Some(match v {
            1 => Kind::Hello,
            2 => Kind::Activation,
            3 => Kind::Gradient,
            4 => Kind::TiedGradient,
            5 => Kind::Proof,
            6 => Kind::GradientNorm,
            7 => Kind::EvalActivation,
            _ => return None,
        })
    }
}

/// One message between stages.
#[derive(Clone, Debug, PartialEq)]
pub struct Frame {
    pub kind: Kind,
    /// Optimizer step (0-based) the frame belongs to.
    pub step: u64,
    pub micro: u32,
    pub dims: Vec<usize>,
    pub payload: Vec<u8>,
}

impl Frame {
    /// A tensor's values as f32 (the wire type whatever the training dtype).
    pub fn tensor<const D: usize>(kind: Kind, step: u64, micro: u32, t: Tensor<D>) -> Frame {
        let dims = t.dims().to_vec();
        let data = t.into_data().convert::<f32>();
        let payload = data
            .iter::<f32>()
            .flat_map(f32::to_le_bytes)
            .collect::<Vec<u8>>();
        Frame {
            kind,
            step,
            micro,
            dims,
            payload,
        }
    }

    /// One f64, exactly (dims `[1]`, eight bytes).
    pub fn value(kind: Kind, step: u64, micro: u32, v: f64) -> Frame {
        Frame {
            kind,
            step,
            micro,
            dims: vec![1],
            payload: v.to_le_bytes().to_vec(),
        }
    }

    /// The f64 of a [`Frame::value`].
    pub fn into_value(self) -> Result<f64, PipelineError> {
        let bytes: [u8; 8] = self.payload.as_slice().try_into().map_err(|_| {
            PipelineError::Protocol(format!(
                "{:?} frame of {} bytes, expected one f64",
                self.kind,
                self.payload.len()
            ))
        })?;
        Ok(f64::from_le_bytes(bytes))
    }

    /// The payload as a tensor on `device`.
    pub fn into_tensor<const D: usize>(self, device: &Device) -> Result<Tensor<D>, PipelineError> {
        if self.dims.len() != D {
            return Err(PipelineError::Protocol(format!(
                "{:?} frame of rank {}, expected rank {D}",
                self.kind,
                self.dims.len()
            )));
        }
        let values: Vec<f32> = self
            .payload
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        if values.len() != self.dims.iter().product::<usize>() {
            return Err(PipelineError::Protocol(format!(
                "{:?} frame: {} values for shape {:?}",
                self.kind,
                values.len(),
                self.dims
            )));
        }
        Ok(Tensor::from_data(
            TensorData::new(values, self.dims),
            device,
        ))
    }

    /// The header's bytes as they go on the wire (what a frame's MAC
    /// covers besides the payload): a frame read back gives the same.
    pub fn head(&self) -> Vec<u8> {
        let mut head = Vec::with_capacity(22 + 8 * self.dims.len() + 8);
        head.extend_from_slice(&MAGIC.to_le_bytes());
        head.extend_from_slice(&[self.kind as u8, self.dims.len() as u8]);
        head.extend_from_slice(&self.step.to_le_bytes());
        head.extend_from_slice(&self.micro.to_le_bytes());
        for d in &self.dims {
            head.extend_from_slice(&(*d as u64).to_le_bytes());
        }
        head.extend_from_slice(&(self.payload.len() as u64).to_le_bytes());
        head
    }

    pub fn write_to(&self, w: &mut impl Write) -> std::io::Result<()> {
        w.write_all(&self.head())?;
        w.write_all(&self.payload)
    }

    /// Writes the frame and its tag under `mac` ([`crate::link_mac`]).
    pub fn write_sealed(&self, w: &mut impl Write, mac: &mut FrameMac) -> std::io::Result<()> {
        let head = self.head();
        let tag = mac
            .tag(&head, &self.payload)
            .map_err(|e| std::io::Error::other(e.to_string()))?;
        w.write_all(&head)?;
        w.write_all(&self.payload)?;
        w.write_all(&tag)
    }

    /// Reads one frame and its tag, checked under `mac`; `Ok(None)` on a
    /// clean end of stream before a header. A frame whose tag fails is an
    /// error of kind `PermissionDenied` that says so.
    pub fn read_sealed(r: &mut impl Read, mac: &mut FrameMac) -> std::io::Result<Option<Frame>> {
        let Some(frame) = Frame::read_from(r)? else {
            return Ok(None);
        };
        let mut tag = [0u8; TAG_BYTES];
        r.read_exact(&mut tag)?;
        mac.check(&frame.head(), &frame.payload, &tag)
            .map_err(|e| {
                std::io::Error::new(std::io::ErrorKind::PermissionDenied, e.to_string())
            })?;
        Ok(Some(frame))
    }

    /// Reads one frame; `Ok(None)` on a clean end of stream before a header.
    pub fn read_from(r: &mut impl Read) -> std::io::Result<Option<Frame>> {
        Frame::read_capped(r, MAX_PAYLOAD)
    }

    /// [`Frame::read_from`] refusing, before allocating, a payload over
    /// `max` bytes: the handshake reads a caller that has proved nothing yet.
    pub fn read_capped(r: &mut impl Read, max: u64) -> std::io::Result<Option<Frame>> {
        let bad = |m: String| std::io::Error::new(std::io::ErrorKind::InvalidData, m);
        let mut magic = [0u8; 4];
        match r.read_exact(&mut magic) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
            Err(e) => return Err(e),
        }
        if u32::from_le_bytes(magic) != MAGIC {
            return Err(bad("not a Headroom pipeline stream (bad magic)".into()));
        }
        let mut head = [0u8; 2];
        r.read_exact(&mut head)?;
        let kind =
            Kind::from_u8(head[0]).ok_or_else(|| bad(format!("unknown frame kind {}", head[0])))?;
        let rank = usize::from(head[1]);
        if rank > MAX_RANK {
            return Err(bad(format!("frame of rank {rank}")));
        }
        let mut u64b = [0u8; 8];
        let mut u32b = [0u8; 4];
        r.read_exact(&mut u64b)?;
        let step = u64::from_le_bytes(u64b);
        r.read_exact(&mut u32b)?;
        let micro = u32::from_le_bytes(u32b);
        let mut dims = Vec::with_capacity(rank);
        for _ in 0..rank {
            r.read_exact(&mut u64b)?;
            dims.push(u64::from_le_bytes(u64b) as usize);
        }
        r.read_exact(&mut u64b)?;
        let len = u64::from_le_bytes(u64b);
        if len > max.min(MAX_PAYLOAD) {
            return Err(bad(format!("frame payload of {len} bytes")));
        }
        let mut payload = vec![0u8; len as usize];
        r.read_exact(&mut payload)?;
        Ok(Some(Frame {
            kind,
            step,
            micro,
            dims,
            payload,
        }))
    }
}

/// What a training step needs of a neighbouring stage: frames out, and the
/// frame the schedule expects next in. [`Link`] carries them over TCP
/// between pods; [`ChannelLink`] between threads of one process, so a
/// multi-stage step can be tested without sockets.
pub trait StageLink: Send + std::fmt::Debug {
    fn send(&mut self, frame: &Frame) -> Result<(), PipelineError>;

    /// The next frame, which must be `kind` for `step`/`micro`: the schedule
    /// is deterministic, so anything else means the stages disagree.
    fn recv(&mut self, kind: Kind, step: u64, micro: u32) -> Result<Frame, PipelineError>;
}

/// What arrives from a neighbour: a frame, `Ok(None)` once it closed the
/// connection, or the error reading it.
type Incoming = std::io::Result<Option<Frame>>;

/// A connected neighbour: frames out through a buffered writer, frames in
/// through the reader thread's queue.
#[derive(Debug)]
pub struct Link {
    /// The neighbour's stage index.
    pub peer: u32,
    writer: BufWriter<TcpStream>,
    /// Tags what this end sends.
    seal: FrameMac,
    inbox: Receiver<Incoming>,
    timeout: Duration,
}

impl Link {
    /// Starts the reader thread on an established (handshaken) stream,
    /// every frame tagged and checked under the handshake's `keys`.
    pub fn start(
        peer: u32,
        stream: TcpStream,
        keys: FrameKeys,
        timeout: Duration,
    ) -> Result<Link, PipelineError> {
        let lost = |e: std::io::Error| PipelineError::PeerLost {
            stage: peer,
            detail: e.to_string(),
        };
        stream.set_nodelay(true).map_err(lost)?;
        stream.set_read_timeout(None).map_err(lost)?;
        let reader = stream.try_clone().map_err(lost)?;
        let (tx, inbox) = channel();
        let FrameKeys { send, mut recv } = keys;
        std::thread::Builder::new()
            .name(format!("headroom-link-{peer}"))
            .spawn(move || {
                let mut reader = BufReader::with_capacity(1 << 20, reader);
                loop {
                    let read = Frame::read_sealed(&mut reader, &mut recv);
                    if read
                        .as_ref()
                        .is_err_and(|e| e.kind() == std::io::ErrorKind::PermissionDenied)
                    {
                        // Nothing more from this connection is believed:
                        // the neighbour learns at once, not at its timeout.
                        let _ = reader.get_ref().shutdown(std::net::Shutdown::Both);
                    }
                    let more = matches!(read, Ok(Some(_)));
                    if tx.send(read).is_err() || !more {
                        return;
                    }
                }
            })
            .map_err(lost)?;
        Ok(Link {
            peer,
            writer: BufWriter::with_capacity(1 << 20, stream),
            seal: send,
            inbox,
            timeout,
        })
    }
}

impl StageLink for Link {
    fn send(&mut self, frame: &Frame) -> Result<(), PipelineError> {
        frame
            .write_sealed(&mut self.writer, &mut self.seal)
            .and_then(|()| self.writer.flush())
            .map_err(|e| PipelineError::PeerLost {
                stage: self.peer,
                detail: format!("sending {:?}: {e}", frame.kind),
            })
    }

    fn recv(&mut self, kind: Kind, step: u64, micro: u32) -> Result<Frame, PipelineError> {
        receive(&self.inbox, self.peer, self.timeout, kind, step, micro)
    }
}

/// A neighbour in the same process: frames cross an unbounded channel as
/// values (the f32 payloads a [`Link`] writes, so the step computes the
/// same), and are received with the same checks, timeout and errors.
#[derive(Debug)]
pub struct ChannelLink {
    /// The neighbour's stage index.
    pub peer: u32,
    out: Sender<Incoming>,
    inbox: Receiver<Incoming>,
    timeout: Duration,
}

impl ChannelLink {
    /// The two ends of the link between stage `stage` and stage `stage + 1`:
    /// the first stage's link to its next, the second's to its previous.
    pub fn pair(stage: u32, timeout: Duration) -> (ChannelLink, ChannelLink) {
        let (to_second, second_inbox) = channel();
        let (to_first, first_inbox) = channel();
        let end = |peer, out, inbox| ChannelLink {
            peer,
            out,
            inbox,
            timeout,
        };
        (
            end(stage + 1, to_second, first_inbox),
            end(stage, to_first, second_inbox),
        )
    }
}

impl Drop for ChannelLink {
    /// Tells the neighbour, as a TCP peer's end of stream does, so it sees a
    /// lost peer rather than a stopped reader.
    fn drop(&mut self) {
        let _ = self.out.send(Ok(None));
    }
}

impl StageLink for ChannelLink {
    fn send(&mut self, frame: &Frame) -> Result<(), PipelineError> {
        self.out
            .send(Ok(Some(frame.clone())))
            .map_err(|_| PipelineError::PeerLost {
                stage: self.peer,
                detail: format!("sending {:?}: closed the connection", frame.kind),
            })
    }

    fn recv(&mut self, kind: Kind, step: u64, micro: u32) -> Result<Frame, PipelineError> {
        receive(&self.inbox, self.peer, self.timeout, kind, step, micro)
    }
}

/// The next frame from stage `peer`, which must be `kind` for `step`/`micro`.
fn receive(
    inbox: &Receiver<Incoming>,
    peer: u32,
    timeout: Duration,
    kind: Kind,
    step: u64,
    micro: u32,
) -> Result<Frame, PipelineError> {
    let lost = |detail: String| PipelineError::PeerLost {
        stage: peer,
        detail,
    };
    let frame = match inbox.recv_timeout(timeout) {
        Ok(Ok(Some(frame))) => frame,
        Ok(Ok(None)) => return Err(lost("closed the connection".into())),
        Ok(Err(e)) => return Err(lost(e.to_string())),
        Err(RecvTimeoutError::Timeout) => {
            return Err(lost(format!(
                "no {kind:?} for step {step} micro-batch {micro} within {timeout:?}"
            )));
        }
        Err(RecvTimeoutError::Disconnected) => return Err(lost("reader stopped".into())),
    };
    if (frame.kind, frame.step, frame.micro) != (kind, step, micro) {
        return Err(PipelineError::Protocol(format!(
            "stage {peer} sent {:?} for step {} micro-batch {}, expected {kind:?} for step {step} micro-batch {micro}",
            frame.kind, frame.step, frame.micro
        )));
    }
    Ok(frame)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_reject_garbage() {
        let frame = Frame {
            kind: Kind::Gradient,
            step: 7,
            micro: 3,
            dims: vec![2, 1, 2],
            payload: [1.0f32, -2.0, 0.5, 3.25]
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
        };
        let mut bytes = Vec::new();
        frame.write_to(&mut bytes).expect("write");
        let back = Frame::read_from(&mut bytes.as_slice())
            .expect("read")
            .expect("frame");
        assert_eq!(back, frame);
        let t: Tensor<3> = back.into_tensor(&Device::flex()).expect("tensor");
        assert_eq!(t.dims(), [2, 1, 2]);
        assert!(Frame::read_from(&mut &b""[..]).expect("eof").is_none());
        let err = Frame::read_from(&mut &b"GET / HTTP/1.1\r\n"[..]).expect_err("not ours");
        assert!(err.to_string().contains("magic"), "{err}");
        let mut truncated = bytes.clone();
        truncated.truncate(bytes.len() - 3);
        assert!(Frame::read_from(&mut truncated.as_slice()).is_err());
    }

    fn sealed(frames: &[Frame], mac: &mut FrameMac) -> Vec<Vec<u8>> {
        frames
            .iter()
            .map(|f| {
                let mut bytes = Vec::new();
                f.write_sealed(&mut bytes, mac).expect("write");
                bytes
            })
            .collect()
    }

    /// What the receiving end reads from `bytes`, frame by frame, until
    /// the stream ends or a frame is refused.
    fn read_all(bytes: &[u8], mac: &mut FrameMac) -> (usize, Option<std::io::Error>) {
        let mut r = bytes;
        let mut read = 0;
        loop {
            match Frame::read_sealed(&mut r, mac) {
                Ok(Some(_)) => read += 1,
                Ok(None) => return (read, None),
                Err(e) => return (read, Some(e)),
            }
        }
    }

    fn refused(outcome: (usize, Option<std::io::Error>), good: usize) -> bool {
        matches!(outcome, (n, Some(e)) if n == good
            && e.kind() == std::io::ErrorKind::PermissionDenied
            && e.to_string().contains("failed its integrity check"))
    }

    /// After the handshake every frame carries a tag over its bytes and its
    /// place in the stream: a flipped bit (header, payload or tag), a
    /// replayed frame, a dropped one and two swapped are each refused.
    #[test]
    fn sealed_frames_refuse_a_flipped_bit_a_replay_a_drop_and_a_reorder() {
        let frames: Vec<Frame> = (0..3u32)
            .map(|i| {
                Frame::tensor(
                    Kind::Activation,
                    5,
                    i,
                    Tensor::<2>::ones([2, 3], &Device::flex()),
                )
            })
            .collect();
        let (mut connector, mut acceptor) = crate::link_mac::tests::ends();
        let wire = sealed(&frames, &mut connector.send);
        let all = wire.concat();
        let (read, error) = read_all(&all, &mut acceptor.recv);
        assert!(read == 3 && error.is_none(), "{error:?}");
        // A flip in the header's magic, kind, rank or payload length is
        // refused as malformed or short before a tag is read; every other
        // (step, micro-batch, shape, payload, tag) fails the tag.
        let head = frames[0].head().len();
        let checked = |bit: usize| (6 * 8..(head - 8) * 8).contains(&bit) || bit >= head * 8;
        for bit in 0..wire[0].len() * 8 {
            let mut bytes = wire[0].clone();
            bytes[bit / 8] ^= 1 << (bit % 8);
            let outcome = read_all(&bytes, &mut crate::link_mac::tests::ends().1.recv);
            assert!(outcome.0 == 0 && outcome.1.is_some(), "bit {bit}");
            assert!(!checked(bit) || refused(outcome, 0), "bit {bit}");
        }
        let receive = |order: &[usize]| {
            let bytes: Vec<u8> = order.iter().flat_map(|&i| wire[i].clone()).collect();
            read_all(&bytes, &mut crate::link_mac::tests::ends().1.recv)
        };
        assert!(refused(receive(&[0, 1, 1, 2]), 2), "replayed");
        assert!(refused(receive(&[0, 2]), 1), "dropped");
        assert!(refused(receive(&[1, 0, 2]), 0), "reordered");
    }

    /// A frame altered on the way ends the link as a lost peer, with the
    /// reason, and the connection is closed.
    #[test]
    fn a_link_whose_frame_is_altered_on_the_way_ends_as_a_lost_peer() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let mut sender =
            TcpStream::connect(listener.local_addr().expect("address")).expect("connect");
        let (receiver, _) = listener.accept().expect("accept");
        let (mut connector, acceptor) = crate::link_mac::tests::ends();
        let mut link = Link::start(3, receiver, acceptor, Duration::from_secs(5)).expect("link");
        let frame = Frame::tensor(
            Kind::Gradient,
            1,
            0,
            Tensor::<1>::ones([4], &Device::flex()),
        );
        let mut bytes = sealed(&[frame.clone(), frame], &mut connector.send).concat();
        let last = bytes.len() - TAG_BYTES - 1;
        bytes[last] ^= 0x10; // the second frame's last payload byte
        sender.write_all(&bytes).expect("send");
        link.recv(Kind::Gradient, 1, 0)
            .expect("the first frame is intact");
        let err = link.recv(Kind::Gradient, 1, 0).expect_err("altered");
        assert!(
            matches!(&err, PipelineError::PeerLost { stage: 3, detail }
                if detail.contains("frame 1 failed its integrity check")),
            "{err}"
        );
        assert!(crate::link_auth::tests::closed(&sender));
    }

    #[test]
    fn an_in_process_link_checks_and_fails_as_a_tcp_link_does() {
        let (mut first, mut second) = ChannelLink::pair(4, Duration::from_millis(50));
        let frame = Frame::tensor(
            Kind::Activation,
            2,
            1,
            Tensor::<1>::ones([3], &Device::flex()),
        );
        first.send(&frame).expect("send");
        assert_eq!(second.recv(Kind::Activation, 2, 1).expect("recv"), frame);
        second.send(&frame).expect("send back");
        let err = first.recv(Kind::Gradient, 2, 1).expect_err("wrong kind");
        assert!(
            err.to_string()
                .contains("stage 5 sent Activation for step 2 micro-batch 1, expected Gradient"),
            "{err}"
        );
        let err = first.recv(Kind::Gradient, 2, 1).expect_err("nothing sent");
        assert!(
            matches!(&err, PipelineError::PeerLost { stage: 5, detail } if detail.starts_with("no Gradient")),
            "{err}"
        );
        drop(second);
        let err = first.recv(Kind::Gradient, 2, 1).expect_err("gone");
        assert_eq!(
            err,
            PipelineError::PeerLost {
                stage: 5,
                detail: "closed the connection".into()
            }
        );
        assert!(matches!(
            first.send(&frame),
            Err(PipelineError::PeerLost { stage: 5, .. })
        ));
    }
}
