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

    pub fn write_to(&self, w: &mut impl Write) -> std::io::Result<()> {
        w.write_all(&MAGIC.to_le_bytes())?;
        w.write_all(&[self.kind as u8, self.dims.len() as u8])?;
        w.write_all(&self.step.to_le_bytes())?;
        w.write_all(&self.micro.to_le_bytes())?;
        for d in &self.dims {
            w.write_all(&(*d as u64).to_le_bytes())?;
        }
        w.write_all(&(self.payload.len() as u64).to_le_bytes())?;
        w.write_all(&self.payload)
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
    inbox: Receiver<Incoming>,
    timeout: Duration,
}

impl Link {
    /// Starts the reader thread on an established (handshaken) stream.
    pub fn start(peer: u32, stream: TcpStream, timeout: Duration) -> Result<Link, PipelineError> {
        let lost = |e: std::io::Error| PipelineError::PeerLost {
            stage: peer,
            detail: e.to_string(),
        };
        stream.set_nodelay(true).map_err(lost)?;
        stream.set_read_timeout(None).map_err(lost)?;
        let reader = stream.try_clone().map_err(lost)?;
        let (tx, inbox) = channel();
        std::thread::Builder::new()
            .name(format!("headroom-link-{peer}"))
            .spawn(move || {
                let mut reader = BufReader::with_capacity(1 << 20, reader);
                loop {
                    let read = Frame::read_from(&mut reader);
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
            inbox,
            timeout,
        })
    }
}

impl StageLink for Link {
    fn send(&mut self, frame: &Frame) -> Result<(), PipelineError> {
        frame
            .write_to(&mut self.writer)
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
