//! Finding the neighbouring stages and the handshake.
//!
//! Stage k listens (except the first) and connects to stage k+1 (except the
//! last). Both ends of a connection exchange a [`Hello`] naming job,
//! attempt, stage and the step they resume from: a pod of an older attempt
//! that is still shutting down is turned away, and stages that would resume
//! from different checkpoints stop before training a single step.
//!
//! **Authentication.** The names in a hello are no secret, so the hellos
//! travel in [`crate::link_auth`]'s mutual challenge–response: the caller
//! sends a fresh nonce with its hello, the listening stage answers with its
//! own nonce, its hello and an HMAC of both nonces and its hello's fields
//! under the job's [`LinkKey`], and the caller, once that proof checks out,
//! proves the key back over its own hello. The listening stage acts on a
//! hello only after that last proof: a caller without the key is dropped
//! (with a warning naming its address) and the stage keeps listening until
//! its deadline, so a stranger that calls first cannot take a stage's place
//! or see a tensor. The listening stage runs several handshakes at once
//! ([`link_auth::accept_first`]), so strangers that call and stall cannot
//! hold up the real neighbour either. The handshake's frames are capped at
//! [`crate::link_auth::MAX_HANDSHAKE_PAYLOAD`] bytes and its reads at
//! `HANDSHAKE_TIMEOUT` in all.
//!
//! In a cluster a stage asks the operator's worker API for its neighbour's
//! pod IP ([`crate::worker_api`]; the worker has no Kubernetes API rights of
//! its own), falling back to the neighbour's DNS name under the job's
//! headless Service (`s<k>.<service>`), which needs cluster DNS. Pod IPs
//! come first because a DNS record appears only once the pod is ready and
//! negative answers are cached.

use std::io::Read;
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use headroom_api::WORKER_API_ENV;
use serde::{Deserialize, Serialize};

use super::wire::{Frame, Kind, Link, StageLink};
use super::{Links, PipelineError};
use crate::link_auth::{
    self, AcceptError, Greeting, HandshakeError, Identity, LinkKey, Message, Verdict, Wire,
};
use crate::link_mac::FrameKeys;
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

impl Greeting for Hello {
    // Every field: the proof binds the whole hello, so not even the resume
    // step can be changed on the way without the key.
    fn identity(&self) -> Identity {
        Identity::new("pipeline")
            .text(&self.job)
            .text(&self.namespace)
            .number(self.attempt.into())
            .number(self.stage.into())
            .number(self.stages.into())
            .number(self.resume_step)
    }
}

impl Hello {
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

/// The handshake's messages as pipeline frames: `Hello` and `Proof`.
#[derive(Debug)]
struct PipelineWire;

impl PipelineWire {
    fn kind(message: Message) -> Kind {
        match message {
            Message::Hello => Kind::Hello,
            Message::Proof => Kind::Proof,
        }
    }
}

impl Wire for PipelineWire {
    fn send(stream: &TcpStream, message: Message, payload: &[u8]) -> std::io::Result<()> {
        let frame = Frame {
            kind: PipelineWire::kind(message),
            step: 0,
            micro: 0,
            dims: vec![],
            payload: payload.to_vec(),
        };
        let mut bytes = Vec::with_capacity(payload.len() + 32);
        frame.write_to(&mut bytes)?;
        link_auth::write_all(stream, &bytes)
    }

    fn recv(r: &mut impl Read, message: Message, max: usize) -> Result<Vec<u8>, HandshakeError> {
        let frame = Frame::read_capped(r, max as u64)?.ok_or(HandshakeError::Closed)?;
        if frame.kind != PipelineWire::kind(message) {
            return Err(HandshakeError::Unexpected(format!("{:?}", frame.kind)));
        }
        Ok(frame.payload)
    }
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

/// How long one handshake may take once connected, all reads together.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// First and largest pause between tries to reach the next stage (each try
/// may ask the worker API for the pod's IP).
const RETRY: Duration = Duration::from_millis(250);
const MAX_RETRY: Duration = Duration::from_secs(2);

/// Connects this stage to its neighbours. `listener` (bound by the caller,
/// required unless this is the first stage) takes the previous stage's
/// call; the next stage is called through `peers`. Both ends of every link
/// prove `key` to each other (see the module documentation). Waits up to
/// `deadline` for the neighbours to come up; `io_timeout` then bounds every
/// wait for a frame during training.
pub fn establish(
    me: &Hello,
    key: &LinkKey,
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
        let (me, key) = (me.clone(), key.clone());
        Some(
            std::thread::Builder::new()
                .name("headroom-accept".into())
                .spawn(move || accept_prev(&me, &key, &listener, until))
                .map_err(|e| PipelineError::Protocol(e.to_string()))?,
        )
    } else {
        None
    };
    let next = if me.stage + 1 < me.stages {
        Some(connect_next(me, key, peers, until)?)
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
    let link = |peer: u32, (s, keys): (TcpStream, FrameKeys)| {
        Link::start(peer, s, keys, io_timeout).map(|l| Box::new(l) as Box<dyn StageLink>)
    };
    Ok(Links {
        prev: prev.map(|s| link(me.stage - 1, s)).transpose()?,
        next: next.map(|s| link(me.stage + 1, s)).transpose()?,
    })
}

fn accept_prev(
    me: &Hello,
    key: &LinkKey,
    listener: &TcpListener,
    until: Instant,
) -> Result<(TcpStream, FrameKeys), PipelineError> {
    let want = me.stage - 1;
    let lost = |detail: String| PipelineError::PeerLost {
        stage: want,
        detail,
    };
    // Our hello and proof go out before the caller's proof is checked, so a
    // caller of this attempt learns of a disagreement too; the caller's
    // hello counts only once its proof has checked out.
    let judge = |from: SocketAddr, answered: Result<Hello, HandshakeError>| match answered {
        Ok(other) if me.is_peer(&other, want) => match me.agrees(&other) {
            Ok(()) => {
                tracing::info!(%from, stage = want, "pipeline: previous stage connected");
                Verdict::Take
            }
            Err(e) => Verdict::Fail(e),
        },
        Ok(other) => {
            tracing::warn!(
                %from,
                "pipeline: turned away {}/{} attempt {} stage {} (want attempt {} stage {want})",
                other.namespace, other.job, other.attempt, other.stage, me.attempt
            );
            Verdict::Drop
        }
        Err(HandshakeError::BadProof) => {
            tracing::warn!(
                %from,
                "pipeline: refused a caller that did not prove the job's peer key"
            );
            Verdict::Drop
        }
        Err(e) => {
            tracing::warn!(%from, "pipeline: bad handshake: {e}");
            Verdict::Drop
        }
    };
    link_auth::accept_first::<PipelineWire, _, _>(
        listener,
        key,
        me,
        until,
        HANDSHAKE_TIMEOUT,
        || false,
        judge,
    )
    .map_err(|e| match e {
        AcceptError::Failed(e) => e,
        AcceptError::TimedOut | AcceptError::GaveUp => lost("did not connect in time".into()),
        AcceptError::Listener(e) => lost(format!("accept: {e}")),
    })
}

fn connect_next(
    me: &Hello,
    key: &LinkKey,
    peers: &Peers,
    until: Instant,
) -> Result<(TcpStream, FrameKeys), PipelineError> {
    let want = me.stage + 1;
    let mut last_error = String::from("not tried");
    let mut pause = RETRY;
    while Instant::now() < until {
        match peers.resolve(want) {
            Ok(addresses) => {
                for address in addresses {
                    match handshake(me, key, address, want, until) {
                        Ok(Some(linked)) => {
                            tracing::info!(%address, stage = want, "pipeline: connected to the next stage");
                            return Ok(linked);
                        }
                        Ok(None) => {
                            last_error = format!("{address} is not stage {want} of this attempt")
                        }
                        Err(Attempt::Fatal(e)) => return Err(e),
                        Err(Attempt::Retry(HandshakeError::BadProof)) => {
                            tracing::warn!(
                                %address,
                                "pipeline: the listener at stage {want}'s address did not prove the job's peer key"
                            );
                            last_error = format!("{address}: {}", HandshakeError::BadProof);
                        }
                        Err(Attempt::Retry(e)) => last_error = format!("{address}: {e}"),
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

/// Why one try to reach the next stage failed.
enum Attempt {
    /// Not (yet) a good connection: try again until the deadline.
    Retry(HandshakeError),
    Fatal(PipelineError),
}

fn handshake(
    me: &Hello,
    key: &LinkKey,
    address: SocketAddr,
    want: u32,
    until: Instant,
) -> Result<Option<(TcpStream, FrameKeys)>, Attempt> {
    let retry = |e: std::io::Error| Attempt::Retry(HandshakeError::Io(e));
    let wait = until
        .saturating_duration_since(Instant::now())
        .clamp(Duration::from_millis(100), HANDSHAKE_TIMEOUT);
    let stream = TcpStream::connect_timeout(&address, wait).map_err(retry)?;
    // The other end has proved the key when this returns (and we have
    // proved it back): only now does its hello count.
    let other = link_auth::connect::<PipelineWire, Hello>(&stream, Instant::now() + wait, key, me)
        .map_err(Attempt::Retry)?;
    if !me.is_peer(&other.hello, want) {
        return Ok(None);
    }
    me.agrees(&other.hello).map_err(Attempt::Fatal)?;
    Ok(Some((stream, other.keys)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::link_auth::tests::{closed, test_key, wrong_key};
    use crate::link_auth::{MAX_HANDSHAKE_PAYLOAD, NONCE_BYTES, PROOF_BYTES, Role};

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
                        &test_key(),
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
                    &test_key(),
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
            &test_key(),
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
            &test_key(),
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

    /// A stranger's first message: `nonce` and a hello with the names of
    /// stage 0; stage 1's answer, split into its nonce and proof.
    fn rogue_hello(
        stream: &TcpStream,
        nonce: [u8; NONCE_BYTES],
        me: &Hello,
    ) -> ([u8; NONCE_BYTES], [u8; PROOF_BYTES]) {
        let json = serde_json::to_vec(me).expect("json");
        PipelineWire::send(stream, Message::Hello, &[&nonce[..], &json].concat()).expect("send");
        let reply = PipelineWire::recv(&mut &*stream, Message::Hello, MAX_HANDSHAKE_PAYLOAD)
            .expect("stage 1 answers with its hello and proof");
        let nonce_a = reply[..NONCE_BYTES].try_into().expect("nonce");
        let proof_a = reply[NONCE_BYTES..NONCE_BYTES + PROOF_BYTES]
            .try_into()
            .expect("proof");
        (nonce_a, proof_a)
    }

    #[test]
    fn a_stranger_without_the_key_is_refused_and_the_real_stage_still_connects() {
        let (mut ls, peers) = listeners(2);
        let l1 = ls.pop().expect("listener");
        let two = |k: u32| Hello {
            stages: 2,
            ..hello(k, 3, 0)
        };
        let stage1 = std::thread::spawn({
            let peers = peers.clone();
            move || {
                establish(
                    &two(1),
                    &test_key(),
                    Some(l1),
                    &peers,
                    Duration::from_secs(20),
                    Duration::from_secs(10),
                )
            }
        });
        let address = peers.resolve(1).expect("address")[0];
        let connect = || TcpStream::connect(address).expect("connect");
        let soon = || Instant::now() + Duration::from_secs(5);

        // The job's names and a wrong key: stage 1's proof does not check
        // out under it, so the stranger cannot even take stage 1 for real.
        let stream = connect();
        let err = link_auth::connect::<PipelineWire, Hello>(&stream, soon(), &wrong_key(), &two(0))
            .expect_err("stage 1 proves another key");
        assert!(matches!(err, HandshakeError::BadProof), "{err}");
        drop(stream);

        // Stage 1's proof reflected back as the caller's: refused.
        let stream = connect();
        let nonce_c = [5u8; NONCE_BYTES];
        let (nonce_a, proof_a) = rogue_hello(&stream, nonce_c, &two(0));
        PipelineWire::send(&stream, Message::Proof, &proof_a).expect("send");
        assert!(closed(&stream), "a reflected proof is refused");

        // The proof stage 1 gave on that connection, replayed with the same
        // nonce on a new one: stage 1's nonce differs, so it is worth nothing.
        let stream = connect();
        let (nonce_a2, _) = rogue_hello(&stream, nonce_c, &two(0));
        assert_ne!(nonce_a, nonce_a2, "a fresh nonce per connection");
        PipelineWire::send(&stream, Message::Proof, &proof_a).expect("send");
        assert!(closed(&stream), "a replayed proof is refused");

        // A proof made with a wrong key.
        let stream = connect();
        let (nonce_a, _) = rogue_hello(&stream, nonce_c, &two(0));
        let forged = link_auth::prove(
            &wrong_key(),
            Role::Connect,
            &nonce_c,
            &nonce_a,
            &two(0).identity(),
        );
        PipelineWire::send(&stream, Message::Proof, &forged).expect("send");
        assert!(closed(&stream), "a proof under another key is refused");

        // A hello announcing 8 GiB: refused before anything is allocated.
        let stream = connect();
        let mut header = Vec::new();
        Frame {
            kind: Kind::Hello,
            step: 0,
            micro: 0,
            dims: vec![],
            payload: vec![],
        }
        .write_to(&mut header)
        .expect("header");
        let at = header.len() - 8;
        header[at..].copy_from_slice(&(8u64 << 30).to_le_bytes());
        link_auth::write_all(&stream, &header).expect("send");
        assert!(closed(&stream), "an oversized hello is refused");

        // The real stage 0 still connects, and the link carries frames.
        let mut links0 = establish(
            &two(0),
            &test_key(),
            None,
            &peers,
            Duration::from_secs(10),
            Duration::from_secs(10),
        )
        .expect("stage 0");
        let mut links1 = stage1.join().expect("thread").expect("stage 1");
        let frame = Frame {
            kind: Kind::Activation,
            step: 0,
            micro: 0,
            dims: vec![1],
            payload: vec![0, 0, 128, 63],
        };
        links0.to_next().expect("next").send(&frame).expect("send");
        let got = links1
            .to_prev()
            .expect("prev")
            .recv(Kind::Activation, 0, 0)
            .expect("recv");
        assert_eq!(got, frame);
    }

    /// `n` strangers without the key calling `address`: each connects and
    /// then stalls, half of them silent, half after the first bytes of a
    /// hello frame. The sockets stay open as long as the result lives.
    fn stallers(address: SocketAddr, n: usize) -> Vec<TcpStream> {
        let mut partial = Vec::new();
        Frame {
            kind: Kind::Hello,
            step: 0,
            micro: 0,
            dims: vec![],
            payload: vec![1; 64],
        }
        .write_to(&mut partial)
        .expect("frame");
        partial.truncate(partial.len() / 2);
        (0..n)
            .map(|i| {
                let stream = TcpStream::connect(address).expect("connect");
                if i % 2 == 1 {
                    link_auth::write_all(&stream, &partial).expect("send");
                }
                stream
            })
            .collect()
    }

    #[test]
    fn stalling_strangers_do_not_hold_up_the_real_stage() {
        let (mut ls, peers) = listeners(2);
        let l1 = ls.pop().expect("listener");
        let two = |k: u32| Hello {
            stages: 2,
            ..hello(k, 1, 0)
        };
        let stage1 = std::thread::spawn({
            let peers = peers.clone();
            move || {
                establish(
                    &two(1),
                    &test_key(),
                    Some(l1),
                    &peers,
                    Duration::from_secs(20),
                    Duration::from_secs(10),
                )
            }
        });
        let address = peers.resolve(1).expect("address")[0];
        let held = stallers(address, 20);
        // Let stage 1 take them all in before the real stage calls.
        std::thread::sleep(Duration::from_millis(200));
        let started = Instant::now();
        let links0 = establish(
            &two(0),
            &test_key(),
            None,
            &peers,
            Duration::from_secs(15),
            Duration::from_secs(10),
        );
        let took = started.elapsed();
        assert!(
            took < Duration::from_secs(3),
            "the real stage took {took:?} past 20 stalling strangers: {links0:?}"
        );
        let mut links0 = links0.expect("stage 0");
        let mut links1 = stage1.join().expect("thread").expect("stage 1");
        let frame = Frame {
            kind: Kind::Activation,
            step: 0,
            micro: 0,
            dims: vec![1],
            payload: vec![0, 0, 128, 63],
        };
        links0.to_next().expect("next").send(&frame).expect("send");
        let got = links1
            .to_prev()
            .expect("prev")
            .recv(Kind::Activation, 0, 0)
            .expect("recv");
        assert_eq!(got, frame);
        drop(held);
    }

    #[test]
    fn stages_with_different_keys_never_connect() {
        let (mut ls, peers) = listeners(2);
        let l1 = ls.pop().expect("listener");
        let two = |k: u32| Hello {
            stages: 2,
            ..hello(k, 1, 0)
        };
        let stage1 = std::thread::spawn({
            let peers = peers.clone();
            move || {
                establish(
                    &two(1),
                    &wrong_key(),
                    Some(l1),
                    &peers,
                    Duration::from_millis(800),
                    Duration::from_secs(1),
                )
            }
        });
        let err = establish(
            &two(0),
            &test_key(),
            None,
            &peers,
            Duration::from_millis(800),
            Duration::from_secs(1),
        )
        .expect_err("stage 1 cannot prove our key");
        assert!(
            matches!(&err, PipelineError::PeerLost { stage: 1, detail } if detail.contains("peer key")),
            "{err}"
        );
        let err = stage1.join().expect("thread").expect_err("nor we its");
        assert!(
            matches!(err, PipelineError::PeerLost { stage: 0, .. }),
            "{err}"
        );
    }
}
