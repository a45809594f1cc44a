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
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
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
}

impl Kind {
    fn from_u8(v: u8) -> Option<Kind> {
        Some(match v {
            1 => Kind::Hello,
            2 => Kind::Activation,
            3 => Kind::Gradient,
            4 => Kind::TiedGradient,
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
        if len > MAX_PAYLOAD {
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

/// A connected neighbour: frames out through a buffered writer, frames in
/// through the reader thread's queue.
#[derive(Debug)]
pub struct Link {
    /// The neighbour's stage index.
    pub peer: u32,
    writer: BufWriter<TcpStream>,
    /// The reader thread's frames; `Ok(None)` once the neighbour closed the connection.
    inbox: Receiver<std::io::Result<Option<Frame>>>,
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

    pub fn send(&mut self, frame: &Frame) -> Result<(), PipelineError> {
        frame
            .write_to(&mut self.writer)
            .and_then(|()| self.writer.flush())
            .map_err(|e| PipelineError::PeerLost {
                stage: self.peer,
                detail: format!("sending {:?}: {e}", frame.kind),
            })
    }

    /// The next frame, which must be `kind` for `step`/`micro`: the schedule
    /// is deterministic, so anything else means the stages disagree.
    pub fn recv(&self, kind: Kind, step: u64, micro: u32) -> Result<Frame, PipelineError> {
        let frame = match self.inbox.recv_timeout(self.timeout) {
            Ok(Ok(Some(frame))) => frame,
            Ok(Ok(None)) => {
                return Err(PipelineError::PeerLost {
                    stage: self.peer,
                    detail: "closed the connection".into(),
                });
            }
            Ok(Err(e)) => {
                return Err(PipelineError::PeerLost {
                    stage: self.peer,
                    detail: e.to_string(),
                });
            }
            Err(RecvTimeoutError::Timeout) => {
                return Err(PipelineError::PeerLost {
                    stage: self.peer,
                    detail: format!(
                        "no {kind:?} for step {step} micro-batch {micro} within {:?}",
                        self.timeout
                    ),
                });
            }
            Err(RecvTimeoutError::Disconnected) => {
                return Err(PipelineError::PeerLost {
                    stage: self.peer,
                    detail: "reader stopped".into(),
                });
            }
        };
        if (frame.kind, frame.step, frame.micro) != (kind, step, micro) {
            return Err(PipelineError::Protocol(format!(
                "stage {} sent {:?} for step {} micro-batch {}, expected {kind:?} for step {step} micro-batch {micro}",
                self.peer, frame.kind, frame.step, frame.micro
            )));
        }
        Ok(frame)
    }
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
}
