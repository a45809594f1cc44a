//! Finding the neighbouring stages and the handshake.
//!
//! Stage k listens (except the first) and connects to stage k+1 (except the
//! last). Both ends of a connection exchange a [`Hello`] naming job,
//! attempt, stage and the step they resume from: a pod of an older attempt
//! that is still shutting down is turned away, and stages that would resume
//! from different checkpoints stop before training a single step.
//!
//! In a cluster a stage asks the operator's worker API for its neighbour's
//! pod IP ([`crate::worker_api`]; the worker has no Kubernetes API rights of
//! its own), falling back to the neighbour's DNS name under the job's
//! headless Service (`s<k>.<service>`), which needs cluster DNS. Pod IPs
//! come first because a DNS record appears only once the pod is ready and
//! negative answers are cached.

use std::io::{BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use headroom_api::WORKER_API_ENV;
use serde::{Deserialize, Serialize};

use super::wire::{Frame, Kind, Link, StageLink};
use super::{Links, PipelineError};
use crate::worker_api::{WorkerApi, WorkerApiError};

/// The handshake both ends of a link send.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Hello {
    pub job: String,
    pub namespace: String,
    pub attempt: u32,
    pub stage: u32,
    pub stages: u32,
    /// The checkpoint step this stage resumes from (0: a fresh start).
    pub resume_step: u64,
}

impl Hello {
    fn frame(&self) -> Frame {
        Frame {
            kind: Kind::Hello,
            step: self.resume_step,
            micro: self.stage,
            dims: vec![],
            payload: serde_json::to_vec(self).unwrap_or_default(),
        }
    }

    fn read(stream: &TcpStream) -> Result<Hello, HelloError> {
        let mut reader = BufReader::new(stream);
        let frame = Frame::read_from(&mut reader)?.ok_or(HelloError::Closed)?;
        if frame.kind != Kind::Hello {
            return Err(HelloError::Unexpected(frame.kind));
        }
        Ok(serde_json::from_slice(&frame.payload)?)
    }

    /// Whether `other` is stage `stage` of the same attempt.
    fn is_peer(&self, other: &Hello, stage: u32) -> bool {
        other.job == self.job
            && other.namespace == self.namespace
            && other.attempt == self.attempt
            && other.stage == stage
    }

    /// A peer of this attempt that cannot train with us.
    fn agrees(&self, other: &Hello) -> Result<(), PipelineError> {
        if other.stages != self.stages || other.resume_step != self.resume_step {
            return Err(PipelineError::Protocol(format!(
                "stage {} ({} stages) resumes from step {}, stage {} ({} stages) from step {}: the stages must start from the same checkpoint",
                self.stage,
                self.stages,
                self.resume_step,
                other.stage,
                other.stages,
                other.resume_step
            )));
        }
        Ok(())
    }
}

/// Why a connection did not carry a good handshake.
#[derive(Debug, thiserror::Error)]
enum HelloError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("closed before the handshake")]
    Closed,
    #[error("sent {0:?} before the handshake")]
    Unexpected(Kind),
    #[error("handshake: {0}")]
    Malformed(#[from] serde_json::Error),
}

/// Why a stage's address is not known (yet).
#[derive(Debug, thiserror::Error)]
enum ResolveError {
    #[error("no address for stage {0}")]
    NoAddress(u32),
    #[error("{0}")]
    Lookup(#[source] std::io::Error),
    #[error("no pod for stage {0}")]
    NoPod(u32),
    #[error("pod {pod} has IP {ip}: {source}")]
    BadPodIp {
        pod: String,
        ip: String,
        source: std::net::AddrParseError,
    },
    #[error("no DNS name for stage {0}")]
    NoDnsName(u32),
    /// Neither the worker API nor DNS knows the neighbour.
    #[error("{api}; DNS {host}: {source}")]
    Unknown {
        api: PodIpMissing,
        host: String,
        source: std::io::Error,
    },
}

/// Why the worker API did not give a pod's IP.
#[derive(Debug, thiserror::Error)]
enum PodIpMissing {
    #[error("pod {0} has no IP yet")]
    NotYet(String),
    #[error("pod {0}: no worker API ({WORKER_API_ENV} not set)")]
    NoWorkerApi(String),
    #[error("pod {pod}: {source}")]
    Lookup { pod: String, source: WorkerApiError },
}

/// How to reach the other stages.
#[derive(Clone, Debug)]
pub enum Peers {
    /// One `host:port` per stage (tests and local runs).
    Static(Vec<String>),
    /// In a cluster: the stages' pod names and DNS names, and the port all listen on.
    Pods {
        pods: Vec<String>,
        dns: Vec<String>,
        port: u16,
        /// Asked for the pods' IPs; `None`: DNS only.
        api: Option<WorkerApi>,
    },
}

impl Peers {
    /// `n` sockets listening on loopback ports the OS picks, and the peers
    /// addressing them: all stages on one machine (tests, benchmarks).
    pub fn loopback(n: u32) -> std::io::Result<(Vec<TcpListener>, Peers)> {
        let listeners = (0..n)
            .map(|_| TcpListener::bind("127.0.0.1:0"))
            .collect::<std::io::Result<Vec<_>>>()?;
        let addresses = listeners
            .iter()
            .map(|l| l.local_addr().map(|a| a.to_string()))
            .collect::<std::io::Result<_>>()?;
        Ok((listeners, Peers::Static(addresses)))
    }

    fn resolve(&self, stage: u32) -> Result<Vec<SocketAddr>, ResolveError> {
        let k = stage as usize;
        match self {
            Peers::Static(addresses) => addresses
                .get(k)
                .ok_or(ResolveError::NoAddress(stage))?
                .to_socket_addrs()
                .map(Iterator::collect)
                .map_err(ResolveError::Lookup),
            Peers::Pods {
                pods,
                dns,
                port,
                api,
            } => {
                let name = pods.get(k).ok_or(ResolveError::NoPod(stage))?;
                let Some(worker_api) = api else {
                    return dns_lookup(dns, stage, *port, PodIpMissing::NoWorkerApi(name.clone()));
                };
                let api = match worker_api.pod_ip(name) {
                    Ok(Some(ip)) => {
                        return format!("{ip}:{port}")
                            .parse::<SocketAddr>()
                            .map(|a| vec![a])
                            .map_err(|source| ResolveError::BadPodIp {
                                pod: name.clone(),
                                ip,
                                source,
                            });
                    }
                    Ok(None) => PodIpMissing::NotYet(name.clone()),
                    Err(source) => PodIpMissing::Lookup {
                        pod: name.clone(),
                        source,
                    },
                };
                dns_lookup(dns, stage, *port, api)
            }
        }
    }
}

/// Stage `stage`'s DNS name, resolved; `api` says why its pod IP is not known.
fn dns_lookup(
    dns: &[String],
    stage: u32,
    port: u16,
    api: PodIpMissing,
) -> Result<Vec<SocketAddr>, ResolveError> {
    let host = dns
        .get(stage as usize)
        .ok_or(ResolveError::NoDnsName(stage))?;
    (host.as_str(), port)
        .to_socket_addrs()
        .map(Iterator::collect)
        .map_err(|source| ResolveError::Unknown {
            api,
            host: host.clone(),
            source,
        })
}

const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// First and largest pause between tries to reach the next stage (each try
/// may ask the worker API for the pod's IP).
const RETRY: Duration = Duration::from_millis(250);
const MAX_RETRY: Duration = Duration::from_secs(2);

/// Connects this stage to its neighbours. `listener` (bound by the caller,
/// required unless this is the first stage) takes the previous stage's
/// call; the next stage is called through `peers`. Waits up to `deadline`
/// for the neighbours to come up; `io_timeout` then bounds every wait for a
/// frame during training.
pub fn establish(
    me: &Hello,
    listener: Option<TcpListener>,
    peers: &Peers,
    deadline: Duration,
    io_timeout: Duration,
) -> Result<Links, PipelineError> {
    if me.stages <= 1 {
        return Ok(Links::default());
    }
    let until = Instant::now() + deadline;
    let accepting = if me.stage > 0 {
        let listener = listener.ok_or_else(|| {
            PipelineError::Protocol(format!("stage {} needs a listening socket", me.stage))
        })?;
        let me = me.clone();
        Some(
            std::thread::Builder::new()
                .name("headroom-accept".into())
                .spawn(move || accept_prev(&me, &listener, until))
                .map_err(|e| PipelineError::Protocol(e.to_string()))?,
        )
    } else {
        None
    };
    let next = if me.stage + 1 < me.stages {
        Some(connect_next(me, peers, until)?)
    } else {
        None
    };
    let prev = match accepting {
        Some(handle) => Some(
            handle
                .join()
                .map_err(|_| PipelineError::Protocol("the accepting thread panicked".into()))??,
        ),
        None => None,
    };
    let link = |peer: u32, s: TcpStream| {
        Link::start(peer, s, io_timeout).map(|l| Box::new(l) as Box<dyn StageLink>)
    };
    Ok(Links {
        prev: prev.map(|s| link(me.stage - 1, s)).transpose()?,
        next: next.map(|s| link(me.stage + 1, s)).transpose()?,
    })
}

fn accept_prev(
    me: &Hello,
    listener: &TcpListener,
    until: Instant,
) -> Result<TcpStream, PipelineError> {
    let want = me.stage - 1;
    let lost = |detail: String| PipelineError::PeerLost {
        stage: want,
        detail,
    };
    listener
        .set_nonblocking(true)
        .map_err(|e| lost(e.to_string()))?;
    loop {
        match listener.accept() {
            Ok((mut stream, from)) => {
                stream
                    .set_nonblocking(false)
                    .map_err(|e| lost(e.to_string()))?;
                stream
                    .set_read_timeout(Some(HANDSHAKE_TIMEOUT))
                    .map_err(|e| lost(e.to_string()))?;
                match Hello::read(&stream) {
                    Ok(other) if me.is_peer(&other, want) => {
                        // Answer first, so the caller learns of a disagreement too.
                        me.frame()
                            .write_to(&mut stream)
                            .and_then(|()| stream.flush())
                            .map_err(|e| lost(e.to_string()))?;
                        me.agrees(&other)?;
                        tracing::info!(%from, stage = want, "pipeline: previous stage connected");
                        return Ok(stream);
                    }
                    Ok(other) => tracing::warn!(
                        %from,
                        "pipeline: turned away {}/{} attempt {} stage {} (want attempt {} stage {want})",
                        other.namespace, other.job, other.attempt, other.stage, me.attempt
                    ),
                    Err(e) => tracing::warn!(%from, "pipeline: bad handshake: {e}"),
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= until {
                    return Err(lost("did not connect in time".into()));
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(lost(format!("accept: {e}"))),
        }
    }
}

fn connect_next(me: &Hello, peers: &Peers, until: Instant) -> Result<TcpStream, PipelineError> {
    let want = me.stage + 1;
    let mut last_error = String::from("not tried");
    let mut pause = RETRY;
    while Instant::now() < until {
        match peers.resolve(want) {
            Ok(addresses) => {
                for address in addresses {
                    match handshake(me, address, want, until) {
                        Ok(Some(stream)) => {
                            tracing::info!(%address, stage = want, "pipeline: connected to the next stage");
                            return Ok(stream);
                        }
                        Ok(None) => {
                            last_error = format!("{address} is not stage {want} of this attempt")
                        }
                        Err(HandshakeError::Fatal(e)) => return Err(e),
                        Err(HandshakeError::Retry(e)) => last_error = format!("{address}: {e}"),
                    }
                }
            }
            Err(e) => last_error = e.to_string(),
        }
        std::thread::sleep(pause.min(until.saturating_duration_since(Instant::now())));
        pause = (pause * 2).min(MAX_RETRY);
    }
    Err(PipelineError::PeerLost {
        stage: want,
        detail: format!("could not connect in time: {last_error}"),
    })
}

enum HandshakeError {
    /// Not (yet) a good connection: try again until the deadline.
    Retry(HelloError),
    Fatal(PipelineError),
}

fn handshake(
    me: &Hello,
    address: SocketAddr,
    want: u32,
    until: Instant,
) -> Result<Option<TcpStream>, HandshakeError> {
    let retry = |e: std::io::Error| HandshakeError::Retry(HelloError::Io(e));
    let wait = until
        .saturating_duration_since(Instant::now())
        .clamp(Duration::from_millis(100), HANDSHAKE_TIMEOUT);
    let mut stream = TcpStream::connect_timeout(&address, wait).map_err(retry)?;
    stream.set_read_timeout(Some(wait)).map_err(retry)?;
    me.frame()
        .write_to(&mut stream)
        .and_then(|()| stream.flush())
        .map_err(retry)?;
    let other = Hello::read(&stream).map_err(HandshakeError::Retry)?;
    if !me.is_peer(&other, want) {
        return Ok(None);
    }
    me.agrees(&other).map_err(HandshakeError::Fatal)?;
    Ok(Some(stream))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello(stage: u32, attempt: u32, resume_step: u64) -> Hello {
        Hello {
            job: "j".into(),
            namespace: "ns".into(),
            attempt,
            stage,
            stages: 3,
            resume_step,
        }
    }

    fn listeners(n: u32) -> (Vec<TcpListener>, Peers) {
        Peers::loopback(n).expect("loopback sockets")
    }

    #[test]
    fn three_stages_connect_in_a_chain_and_pass_frames() {
        let (ls, peers) = listeners(3);
        let handles: Vec<_> = ls
            .into_iter()
            .enumerate()
            .map(|(k, l)| {
                let peers = peers.clone();
                std::thread::spawn(move || {
                    establish(
                        &hello(k as u32, 2, 40),
                        Some(l),
                        &peers,
                        Duration::from_secs(10),
                        Duration::from_secs(10),
                    )
                })
            })
            .collect();
        let mut links: Vec<Links> = handles
            .into_iter()
            .map(|h| h.join().expect("thread").expect("links"))
            .collect();
        assert!(links[0].prev.is_none() && links[2].next.is_none());
        let frame = Frame {
            kind: Kind::Activation,
            step: 40,
            micro: 1,
            dims: vec![1],
            payload: vec![0, 0, 128, 63],
        };
        links[0]
            .to_next()
            .expect("next")
            .send(&frame)
            .expect("send");
        let got = links[1]
            .to_prev()
            .expect("prev")
            .recv(Kind::Activation, 40, 1)
            .expect("recv");
        assert_eq!(got, frame);
        // The schedule is deterministic: an unexpected frame is a protocol error.
        links[2]
            .to_prev()
            .expect("prev")
            .send(&frame)
            .expect("send back");
        let err = links[1]
            .to_next()
            .expect("next")
            .recv(Kind::Gradient, 40, 1)
            .expect_err("wrong kind");
        assert!(matches!(err, PipelineError::Protocol(_)), "{err}");
        // A stage that goes away is a lost peer, not a hang.
        drop(links.pop());
        let err = links[1]
            .to_next()
            .expect("next")
            .recv(Kind::Gradient, 40, 2)
            .expect_err("gone");
        assert!(
            matches!(err, PipelineError::PeerLost { stage: 2, .. }),
            "{err}"
        );
    }

    #[test]
    fn stages_resuming_from_different_steps_refuse_to_start() {
        let (mut ls, peers) = listeners(2);
        let l1 = ls.pop().expect("listener");
        let a = std::thread::spawn({
            let peers = peers.clone();
            move || {
                let mut me = hello(0, 1, 10);
                me.stages = 2;
                establish(
                    &me,
                    None,
                    &peers,
                    Duration::from_secs(5),
                    Duration::from_secs(5),
                )
            }
        });
        let mut me = hello(1, 1, 20);
        me.stages = 2;
        let b = establish(
            &me,
            Some(l1),
            &peers,
            Duration::from_secs(5),
            Duration::from_secs(5),
        );
        let a = a.join().expect("thread");
        for err in [
            a.expect_err("stage 0 refuses"),
            b.expect_err("stage 1 refuses"),
        ] {
            assert!(err.to_string().contains("same checkpoint"), "{err}");
        }
    }

    #[test]
    fn a_missing_neighbour_times_out_as_a_lost_peer() {
        let (_ls, peers) = listeners(2);
        let mut me = hello(0, 1, 0);
        me.stages = 2;
        // Stage 1's socket exists but nobody answers the handshake.
        let err = establish(
            &me,
            None,
            &peers,
            Duration::from_millis(600),
            Duration::from_secs(1),
        )
        .expect_err("nobody");
        assert!(
            matches!(err, PipelineError::PeerLost { stage: 1, .. }),
            "{err}"
        );
    }
}
