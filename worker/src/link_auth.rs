//! Proving that both ends of a worker-to-worker TCP link belong to the job.
//!
//! Pipeline stages ([`crate::pipeline::connect`]) and data-parallel
//! replicas ([`crate::collective::ring`]) find each other by address and
//! then exchange a hello naming job, attempt, stage and replica. Those
//! names are no secret: anyone in the cluster who knows them could call a
//! stage first during rendezvous and be taken as its neighbour (reading and
//! injecting tensors), or claim a later attempt and make a replica stop. So
//! every handshake also proves, in both directions, knowledge of the job's
//! [`LinkKey`] (32 random bytes the operator derives per job and hands out
//! through its worker API, or `HEADROOM_PEER_KEY` for local runs), and
//! nothing in a hello is acted on before its sender's proof checked out.
//!
//! **The handshake** (three messages over the link's own frame format,
//! whatever [`Wire`] it is):
//!
//! 1. connector → acceptor: `Hello` = nonce_c ‖ hello (JSON);
//! 2. acceptor → connector: `Hello` = nonce_a ‖ proof_a ‖ hello (JSON), where
//!    proof_a = HMAC-SHA-256(key, "headroom-link-v1/accept" ‖ nonce_c ‖
//!    nonce_a ‖ the acceptor's identity);
//! 3. connector → acceptor, once proof_a checked out: `Proof` = proof_c =
//!    HMAC-SHA-256(key, "headroom-link-v1/connect" ‖ nonce_a ‖ nonce_c ‖ the
//!    connector's identity).
//!
//! Nonces are 32 fresh random bytes per connection, so a proof seen on one
//! connection is worth nothing on another; the direction labels differ, so
//! an acceptor's proof cannot be reflected back as a connector's; the
//! identity ([`Identity`]: job, namespace, attempt, stage, replica, counts,
//! resume step, each length-prefixed) is bound into the proof, so a hello
//! cannot be altered (a newer attempt claimed) without the key. Proofs are
//! compared in constant time (`Mac::verify_slice`). Each read is capped at
//! [`MAX_HANDSHAKE_PAYLOAD`] bytes and the whole handshake at a deadline, so
//! a stranger can neither make a worker allocate much nor hold it for ever.
//!
//! **Listening** ([`accept_first`]): a listener runs up to
//! [`MAX_HANDSHAKES`] handshakes at once, each on its own short-lived
//! thread, and takes the first caller whose proof checked out and that the
//! listener wants; every other connection is closed. When all slots are
//! busy, a new caller closes the oldest handshake still under way, so
//! strangers that call and then stall hold a slot only until newer callers
//! arrive: to keep the real neighbour out they must keep calling faster
//! than a handshake completes, not merely wait.
//!
//! **After the handshake** every frame carries a MAC under a key of this
//! connection and direction, derived from the job's key and both nonces,
//! over its sequence number ([`crate::link_mac`]): a relayed connection
//! cannot alter, drop, replay or reorder frames. Tensors are not encrypted:
//! someone on the network path (not merely in the cluster) could read them.

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use headroom_api::{PEER_KEY_ENV, WORKER_API_ENV, WORKER_API_PEER_KEY_PATH};
use hmac::{Hmac, Mac};
use serde::Serialize;
use serde::de::DeserializeOwned;
use sha2::Sha256;

use crate::link_mac::FrameKeys;
use crate::worker_api::{WorkerApi, WorkerApiError};

/// Bytes of a [`LinkKey`].
pub const KEY_BYTES: usize = 32;
/// Bytes of a handshake nonce.
pub const NONCE_BYTES: usize = 32;
/// Bytes of a proof (an HMAC-SHA-256 tag).
pub const PROOF_BYTES: usize = 32;
/// Largest handshake payload a worker reads: a hello is a few hundred bytes
/// of JSON (Kubernetes names are at most 253 characters), and a caller that
/// has proved nothing yet must not make a worker allocate more.
pub const MAX_HANDSHAKE_PAYLOAD: usize = 16 << 10;

const ACCEPT_LABEL: &[u8] = b"headroom-link-v1/accept";
const CONNECT_LABEL: &[u8] = b"headroom-link-v1/connect";

/// The secret a job's workers prove their membership with. Its `Debug`
/// shows no byte of it.
#[derive(Clone)]
pub struct LinkKey([u8; KEY_BYTES]);

impl std::fmt::Debug for LinkKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LinkKey(..)")
    }
}

impl PartialEq for LinkKey {
    // Without an early exit: no comparison of a secret should tell how many
    // leading bytes matched.
    fn eq(&self, other: &Self) -> bool {
        self.0
            .iter()
            .zip(&other.0)
            .fold(0u8, |diff, (a, b)| diff | (a ^ b))
            == 0
    }
}

impl Eq for LinkKey {}

impl LinkKey {
    pub fn from_bytes(bytes: [u8; KEY_BYTES]) -> LinkKey {
        LinkKey(bytes)
    }

    /// 64 hex digits (surrounding whitespace ignored). The error says what
    /// is wrong without repeating the text, which may be most of a secret.
    pub fn from_hex(text: &str) -> Result<LinkKey, &'static str> {
        const WANT: &str = "the peer key must be 64 hex digits (32 bytes)";
        let text = text.trim().as_bytes();
        if text.len() != 2 * KEY_BYTES {
            return Err(WANT);
        }
        let digit = |c: u8| char::from(c).to_digit(16).map(|d| d as u8);
        let mut key = [0u8; KEY_BYTES];
        for (byte, pair) in key.iter_mut().zip(text.chunks_exact(2)) {
            let (Some(hi), Some(lo)) = (digit(pair[0]), digit(pair[1])) else {
                return Err(WANT);
            };
            *byte = hi << 4 | lo;
        }
        Ok(LinkKey(key))
    }

    /// The key's bytes: for the keys derived from it ([`crate::link_mac`]).
    pub(crate) fn as_bytes(&self) -> &[u8; KEY_BYTES] {
        &self.0
    }

    /// The key as 64 lowercase hex digits: for `HEADROOM_PEER_KEY` of the
    /// worker processes a local harness starts.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// A fresh random key: for workers that all run in this process (tests,
    /// benchmarks) or that this process starts.
    pub fn random() -> Result<LinkKey, KeyError> {
        let mut key = [0u8; KEY_BYTES];
        getrandom::fill(&mut key).map_err(|e| KeyError::Random(e.to_string()))?;
        Ok(LinkKey(key))
    }

    /// The key of a run with more than one worker: `env` (the
    /// `HEADROOM_PEER_KEY` override, already parsed) when given, else the
    /// worker API's answer. A worker API that cannot be reached or answers
    /// 5xx (the operator restarting) is asked again until `patience` has
    /// passed; any other refusal ends the wait at once.
    pub fn obtain(
        env: Option<&LinkKey>,
        api: Option<&WorkerApi>,
        patience: Duration,
    ) -> Result<LinkKey, KeyError> {
        if let Some(key) = env {
            return Ok(key.clone());
        }
        let api = api.ok_or(KeyError::Missing)?;
        let until = Instant::now() + patience;
        let mut pause = Duration::from_millis(250);
        loop {
            match api.peer_key() {
                Ok(answer) => return LinkKey::from_hex(&answer.key).map_err(KeyError::Malformed),
                Err(e) if transient(&e) && Instant::now() < until => {
                    tracing::warn!("cannot get the peer key from the worker API yet: {e}");
                    std::thread::sleep(pause.min(until.saturating_duration_since(Instant::now())));
                    pause = (pause * 2).min(Duration::from_secs(5));
                }
                Err(e) => return Err(KeyError::Api(e)),
            }
        }
    }
}

/// Whether asking the worker API again may help.
fn transient(e: &WorkerApiError) -> bool {
    match e {
        WorkerApiError::Transport { .. } => true,
        WorkerApiError::Status { status, .. } => *status >= 500 || *status == 429,
        _ => false,
    }
}

/// Why a worker has no peer key.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error(
        "the workers of a multi-worker run prove their membership with the job's peer key, and there is none: \
         set {PEER_KEY_ENV} (64 hex digits; local runs) or {WORKER_API_ENV} (the operator's worker API, \
         which serves it at {WORKER_API_PEER_KEY_PATH})"
    )]
    Missing,
    #[error("the peer key from the worker API: {0}")]
    Api(#[source] WorkerApiError),
    /// What is wrong with the worker API's key, never the key.
    #[error("the peer key from the worker API: {0}")]
    Malformed(&'static str),
    #[error("no random bytes for a peer key: {0}")]
    Random(String),
}

/// A random nonce, 32 bytes.
fn nonce() -> Result<[u8; NONCE_BYTES], HandshakeError> {
    let mut n = [0u8; NONCE_BYTES];
    getrandom::fill(&mut n).map_err(|e| HandshakeError::Random(e.to_string()))?;
    Ok(n)
}

/// The canonical bytes of a hello's identity fields: a link-kind tag, then
/// each field length-prefixed, so two different hellos never give the same
/// bytes (`"ab" ‖ "c"` is not `"a" ‖ "bc"`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity(Vec<u8>);

impl Identity {
    /// Starts the bytes of a hello of link kind `link` (`pipeline`, `ring`):
    /// a proof for one kind of link is no proof for the other.
    pub fn new(link: &str) -> Identity {
        Identity(Vec::new()).text(link)
    }

    pub fn text(mut self, s: &str) -> Identity {
        put(&mut self.0, s.as_bytes());
        self
    }

    pub fn number(mut self, n: u64) -> Identity {
        put(&mut self.0, &n.to_le_bytes());
        self
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

/// `bytes`, length-prefixed.
fn put(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    out.extend_from_slice(bytes);
}

/// Which end of a connection a proof comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// The listening end (message 2).
    Accept,
    /// The calling end (message 3).
    Connect,
}

/// The MAC over a proof's transcript, ready to finalize or verify. Each
/// end puts the other's nonce first: what it cannot choose.
fn transcript(
    key: &LinkKey,
    role: Role,
    connector_nonce: &[u8; NONCE_BYTES],
    acceptor_nonce: &[u8; NONCE_BYTES],
    identity: &Identity,
) -> Hmac<Sha256> {
    let mut mac =
        <Hmac<Sha256> as Mac>::new_from_slice(&key.0).expect("HMAC takes a key of any length");
    let (label, first, second) = match role {
        Role::Accept => (ACCEPT_LABEL, connector_nonce, acceptor_nonce),
        Role::Connect => (CONNECT_LABEL, acceptor_nonce, connector_nonce),
    };
    let mut head = Vec::with_capacity(8 + label.len());
    put(&mut head, label);
    mac.update(&head);
    mac.update(first);
    mac.update(second);
    let mut id = Vec::with_capacity(8 + identity.0.len());
    put(&mut id, identity.as_bytes());
    mac.update(&id);
    mac
}

/// The proof `role`'s end of a connection sends for `identity`.
pub fn prove(
    key: &LinkKey,
    role: Role,
    connector_nonce: &[u8; NONCE_BYTES],
    acceptor_nonce: &[u8; NONCE_BYTES],
    identity: &Identity,
) -> [u8; PROOF_BYTES] {
    transcript(key, role, connector_nonce, acceptor_nonce, identity)
        .finalize()
        .into_bytes()
        .into()
}

/// Whether `proof` is `role`'s proof for `identity` on this connection
/// (constant-time).
pub fn verify(
    key: &LinkKey,
    role: Role,
    connector_nonce: &[u8; NONCE_BYTES],
    acceptor_nonce: &[u8; NONCE_BYTES],
    identity: &Identity,
    proof: &[u8],
) -> Result<(), HandshakeError> {
    transcript(key, role, connector_nonce, acceptor_nonce, identity)
        .verify_slice(proof)
        .map_err(|_| HandshakeError::BadProof)
}

/// A hello whose identity a proof binds.
pub trait Greeting: Serialize + DeserializeOwned {
    fn identity(&self) -> Identity;
}

/// One handshake message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Message {
    /// Messages 1 and 2: nonce (and proof) and hello.
    Hello,
    /// Message 3: the connector's proof.
    Proof,
}

/// A link's frame format, for the handshake's messages.
pub trait Wire {
    /// Writes one message and flushes it.
    fn send(stream: &TcpStream, message: Message, payload: &[u8]) -> std::io::Result<()>;

    /// Reads one message, which must be `message`, of at most `max` payload
    /// bytes (a larger header is refused before anything is allocated).
    fn recv(r: &mut impl Read, message: Message, max: usize) -> Result<Vec<u8>, HandshakeError>;
}

/// Why a connection did not carry a good handshake.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("closed before the handshake ended")]
    Closed,
    #[error("sent {0} during the handshake")]
    Unexpected(String),
    #[error("handshake: {0}")]
    Malformed(String),
    /// The other end does not know the job's key (or is not of this job).
    #[error("no valid proof of the job's peer key")]
    BadProof,
    #[error("no random bytes for a nonce: {0}")]
    Random(String),
}

impl From<serde_json::Error> for HandshakeError {
    fn from(e: serde_json::Error) -> Self {
        HandshakeError::Malformed(e.to_string())
    }
}

/// Reads from a stream with every read bounded by one deadline for the
/// whole handshake: a socket read timeout alone restarts with every byte,
/// so a caller dripping a byte at a time could hold the worker for ever.
pub struct Deadline<'a> {
    stream: &'a TcpStream,
    until: Instant,
}

impl<'a> Deadline<'a> {
    pub fn new(stream: &'a TcpStream, until: Instant) -> Self {
        Deadline { stream, until }
    }
}

impl std::fmt::Debug for Deadline<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Deadline")
            .field("until", &self.until)
            .finish_non_exhaustive()
    }
}

impl Read for Deadline<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let left = self.until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "the handshake took too long",
            ));
        }
        self.stream.set_read_timeout(Some(left))?;
        // Unbuffered on purpose: bytes after the handshake (the first
        // frames of training) must stay in the socket for the link's reader.
        let mut stream = self.stream;
        stream.read(buf)
    }
}

/// `payload` split into its first `N` bytes and the rest.
fn split<const N: usize>(payload: &[u8]) -> Result<([u8; N], &[u8]), HandshakeError> {
    let (head, rest) = payload
        .split_first_chunk::<N>()
        .ok_or_else(|| HandshakeError::Malformed(format!("{} bytes", payload.len())))?;
    Ok((*head, rest))
}

/// A handshake that checked out: the other end's hello, and the keys of
/// this connection's frames from now on ([`FrameKeys`]).
#[derive(Debug)]
pub struct Handshaken<H> {
    pub hello: H,
    pub keys: FrameKeys,
}

/// The calling end of the handshake: sends `me` and returns the other end's
/// hello, once it has proved the key (and this end has proved it back).
/// The caller decides then whether that is the peer it wanted.
pub fn connect<W: Wire, H: Greeting>(
    stream: &TcpStream,
    until: Instant,
    key: &LinkKey,
    me: &H,
) -> Result<Handshaken<H>, HandshakeError> {
    let nonce_c = nonce()?;
    let hello = serde_json::to_vec(me)?;
    W::send(stream, Message::Hello, &[&nonce_c[..], &hello].concat())?;
    let reply = W::recv(
        &mut Deadline::new(stream, until),
        Message::Hello,
        MAX_HANDSHAKE_PAYLOAD,
    )?;
    let (nonce_a, rest) = split::<NONCE_BYTES>(&reply)?;
    let (proof_a, json) = split::<PROOF_BYTES>(rest)?;
    let other: H = serde_json::from_slice(json)?;
    verify(
        key,
        Role::Accept,
        &nonce_c,
        &nonce_a,
        &other.identity(),
        &proof_a,
    )?;
    let proof_c = prove(key, Role::Connect, &nonce_c, &nonce_a, &me.identity());
    W::send(stream, Message::Proof, &proof_c)?;
    Ok(Handshaken {
        hello: other,
        keys: FrameKeys::derive(key, Role::Connect, &nonce_c, &nonce_a),
    })
}

/// The listening end of the handshake: answers a caller with `me` and this
/// end's proof, and returns the caller's hello only once the caller proved
/// the key. Until then nothing the caller said may be acted on.
pub fn accept<W: Wire, H: Greeting>(
    stream: &TcpStream,
    until: Instant,
    key: &LinkKey,
    me: &H,
) -> Result<Handshaken<H>, HandshakeError> {
    let mut reader = Deadline::new(stream, until);
    let hello = W::recv(&mut reader, Message::Hello, MAX_HANDSHAKE_PAYLOAD)?;
    let (nonce_c, json) = split::<NONCE_BYTES>(&hello)?;
    // Parsed only to bind its identity into the proof we check below.
    let claimed: H = serde_json::from_slice(json)?;
    let nonce_a = nonce()?;
    let proof_a = prove(key, Role::Accept, &nonce_c, &nonce_a, &me.identity());
    let mine = serde_json::to_vec(me)?;
    W::send(
        stream,
        Message::Hello,
        &[&nonce_a[..], &proof_a[..], &mine].concat(),
    )?;
    let proof_c = W::recv(&mut reader, Message::Proof, PROOF_BYTES)?;
    verify(
        key,
        Role::Connect,
        &nonce_c,
        &nonce_a,
        &claimed.identity(),
        &proof_c,
    )?;
    Ok(Handshaken {
        hello: claimed,
        keys: FrameKeys::derive(key, Role::Accept, &nonce_c, &nonce_a),
    })
}

/// Handshakes a listener runs at once ([`accept_first`]).
pub const MAX_HANDSHAKES: usize = 8;
/// Longest pause of [`accept_first`] between looks at its listener.
const POLL: Duration = Duration::from_millis(10);

/// What a listener makes of one caller's handshake ([`accept_first`]).
#[derive(Debug)]
pub enum Verdict<E> {
    /// The peer it waits for: listening ends with this connection.
    Take,
    /// Anyone else (no proof, another attempt): the connection is closed
    /// and listening goes on.
    Drop,
    /// Listening ends with this error.
    Fail(E),
}

/// Why [`accept_first`] returned no connection.
#[derive(Debug)]
pub enum AcceptError<E> {
    /// What the judge said.
    Failed(E),
    /// Nobody it took called before the deadline.
    TimedOut,
    /// `give_up` said so.
    GaveUp,
    /// The listening socket failed.
    Listener(std::io::Error),
}

/// A handshake's outcome, sent from its thread.
struct Finished<H> {
    id: u64,
    from: SocketAddr,
    stream: TcpStream,
    answered: Result<Handshaken<H>, HandshakeError>,
}

/// The handshakes under way, oldest first: each a second handle on its
/// socket, to close it early. Dropping this closes all that are left, so
/// their threads end at once.
#[derive(Debug, Default)]
struct InFlight {
    under_way: VecDeque<(u64, SocketAddr, TcpStream)>,
    next_id: u64,
}

impl InFlight {
    /// Whether handshake `id` was still under way (not closed as the
    /// oldest); it is not any more.
    fn finish(&mut self, id: u64) -> bool {
        let at = self.under_way.iter().position(|(i, _, _)| *i == id);
        at.and_then(|at| self.under_way.remove(at)).is_some()
    }

    /// Answers the caller on `stream` as `me` ([`accept`]) on a thread of
    /// its own, which reports to `tx` when done; when all
    /// [`MAX_HANDSHAKES`] slots are busy, closes the oldest first.
    fn start<W, H>(
        &mut self,
        stream: TcpStream,
        from: SocketAddr,
        key: &LinkKey,
        me: &H,
        handshake_timeout: Duration,
        tx: &mpsc::Sender<Finished<H>>,
    ) where
        W: Wire + 'static,
        H: Greeting + Clone + Send + 'static,
    {
        if self.under_way.len() >= MAX_HANDSHAKES
            && let Some((_, oldest, stream)) = self.under_way.pop_front()
        {
            tracing::warn!(
                %from,
                "{MAX_HANDSHAKES} handshakes under way: closed the oldest, from {oldest}"
            );
            let _ = stream.shutdown(Shutdown::Both);
        }
        let handle = match stream.try_clone() {
            Ok(handle) => handle,
            Err(e) => {
                tracing::warn!(%from, "closed a caller: {e}");
                return;
            }
        };
        let id = self.next_id;
        self.next_id += 1;
        let started = Instant::now();
        let (key, me, tx) = (key.clone(), me.clone(), tx.clone());
        let spawned = std::thread::Builder::new()
            .name("headroom-handshake".into())
            .spawn(move || {
                let answered = stream
                    .set_nonblocking(false)
                    .map_err(HandshakeError::Io)
                    .and_then(|()| accept::<W, H>(&stream, started + handshake_timeout, &key, &me));
                // The listener may have returned already: nobody to tell.
                let _ = tx.send(Finished {
                    id,
                    from,
                    stream,
                    answered,
                });
            });
        match spawned {
            Ok(_) => self.under_way.push_back((id, from, handle)),
            Err(e) => tracing::warn!(%from, "closed a caller: no thread for its handshake: {e}"),
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        for (_, _, stream) in &self.under_way {
            let _ = stream.shutdown(Shutdown::Both);
        }
    }
}

/// The listening end of a link: answers callers on `listener` as `me`
/// ([`accept`]), up to [`MAX_HANDSHAKES`] at once, each with
/// `handshake_timeout` for its reads, and returns the first connection the
/// judge takes. `judge` sees each finished handshake in the order they
/// finish, with the caller's address: a hello (whose proof checked out) or
/// why there is none. Gives up at `until` or as soon as `give_up` says so.
/// Every other connection is closed by the time this returns: one the judge
/// dropped, one still in its handshake, one closed as the oldest when all
/// slots were busy and another caller came (see the module documentation).
pub fn accept_first<W, H, E>(
    listener: &TcpListener,
    key: &LinkKey,
    me: &H,
    until: Instant,
    handshake_timeout: Duration,
    give_up: impl Fn() -> bool,
    mut judge: impl FnMut(SocketAddr, Result<H, HandshakeError>) -> Verdict<E>,
) -> Result<(TcpStream, FrameKeys), AcceptError<E>>
where
    W: Wire + 'static,
    H: Greeting + Clone + Send + 'static,
{
    listener
        .set_nonblocking(true)
        .map_err(AcceptError::Listener)?;
    let (tx, rx) = mpsc::channel::<Finished<H>>();
    let mut in_flight = InFlight::default();
    let mut judge_one = |in_flight: &mut InFlight, done: Finished<H>| {
        // One closed as the oldest: its socket is shut, whatever it says.
        if !in_flight.finish(done.id) {
            return None;
        }
        let (hello, keys) = match done.answered {
            Ok(Handshaken { hello, keys }) => (Ok(hello), Some(keys)),
            Err(e) => (Err(e), None),
        };
        match judge(done.from, hello) {
            // A hello comes only with its keys.
            Verdict::Take => keys.map(|keys| Ok((done.stream, keys))),
            Verdict::Drop => None,
            Verdict::Fail(e) => Some(Err(AcceptError::Failed(e))),
        }
    };
    // Why listening stopped, and until when the handshakes under way may
    // still finish: one that began in time is heard out (each within its own
    // deadline), so a caller of this attempt still learns of a disagreement.
    let mut stopped: Option<(AcceptError<E>, Instant)> = None;
    loop {
        // Finished handshakes first, in the order they finished (and before
        // any is closed as the oldest): the first the judge takes wins.
        while let Ok(done) = rx.try_recv() {
            if let Some(result) = judge_one(&mut in_flight, done) {
                return result;
            }
        }
        if let Some((why, last)) = stopped.take() {
            if in_flight.under_way.is_empty() || Instant::now() >= last {
                return Err(why);
            }
            stopped = Some((why, last));
            if let Ok(done) = rx.recv_timeout(POLL)
                && let Some(result) = judge_one(&mut in_flight, done)
            {
                return result;
            }
            continue;
        }
        let accepted = match listener.accept() {
            Ok(accepted) => Some(accepted),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => None,
            Err(e) => return Err(AcceptError::Listener(e)),
        };
        let why = if give_up() {
            Some(AcceptError::GaveUp)
        } else if Instant::now() >= until {
            Some(AcceptError::TimedOut)
        } else {
            None
        };
        if let Some(why) = why {
            // Each handshake ends by its own deadline; the second more is
            // for its thread to report.
            stopped = Some((
                why,
                Instant::now() + handshake_timeout + Duration::from_secs(1),
            ));
        }
        let Some((stream, from)) = accepted else {
            // Nothing to accept: wait a little, for a handshake to finish.
            if stopped.is_none()
                && let Ok(done) = rx.recv_timeout(POLL)
                && let Some(result) = judge_one(&mut in_flight, done)
            {
                return result;
            }
            continue;
        };
        in_flight.start::<W, H>(stream, from, key, me, handshake_timeout, &tx);
    }
}

/// Writes all of `bytes` to `stream` and flushes: for [`Wire::send`]s.
pub fn write_all(stream: &TcpStream, bytes: &[u8]) -> std::io::Result<()> {
    let mut stream = stream;
    stream.write_all(bytes)?;
    stream.flush()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The key the modules' tests give their workers.
    pub(crate) fn test_key() -> LinkKey {
        LinkKey::from_bytes([7; KEY_BYTES])
    }

    /// A key that is not [`test_key`]: a stranger's guess.
    pub(crate) fn wrong_key() -> LinkKey {
        LinkKey::from_bytes([8; KEY_BYTES])
    }

    fn identity(attempt: u64) -> Identity {
        Identity::new("ring")
            .text("job")
            .text("ns")
            .number(attempt)
            .number(0)
    }

    #[test]
    fn link_auth_a_proof_holds_only_for_its_own_transcript() {
        let key = test_key();
        let (nc, na) = ([1u8; NONCE_BYTES], [2u8; NONCE_BYTES]);
        let id = identity(3);
        let proof = prove(&key, Role::Accept, &nc, &na, &id);
        verify(&key, Role::Accept, &nc, &na, &id, &proof).expect("its own transcript");
        // Another attempt claimed with the same proof.
        assert!(verify(&key, Role::Accept, &nc, &na, &identity(4), &proof).is_err());
        // The nonces swapped.
        assert!(verify(&key, Role::Accept, &na, &nc, &id, &proof).is_err());
        // Reflected: the acceptor's proof offered as a connector's, even
        // with the nonces in the order the connector's proof takes them.
        assert!(verify(&key, Role::Connect, &nc, &na, &id, &proof).is_err());
        assert!(verify(&key, Role::Connect, &na, &nc, &id, &proof).is_err());
        // Another nonce: a proof from an earlier connection.
        assert!(verify(&key, Role::Accept, &[9; NONCE_BYTES], &na, &id, &proof).is_err());
        // Another key.
        assert!(verify(&wrong_key(), Role::Accept, &nc, &na, &id, &proof).is_err());
        // Truncated.
        assert!(verify(&key, Role::Accept, &nc, &na, &id, &proof[..16]).is_err());
        // Another kind of link with the same fields.
        let pipeline = Identity::new("pipeline")
            .text("job")
            .text("ns")
            .number(3)
            .number(0);
        assert!(verify(&key, Role::Accept, &nc, &na, &pipeline, &proof).is_err());
    }

    #[test]
    fn link_auth_identity_fields_are_unambiguous() {
        let a = Identity::new("ring").text("ab").text("c");
        let b = Identity::new("ring").text("a").text("bc");
        assert_ne!(a, b);
        assert_ne!(
            Identity::new("ring").number(1).number(23),
            Identity::new("ring").number(12).number(3)
        );
    }

    #[test]
    fn link_auth_keys_parse_from_hex_and_never_print() {
        let hex = "00112233445566778899aabbccddeeff00112233445566778899AABBCCDDEEFF";
        let key = LinkKey::from_hex(&format!(" {hex}\n")).expect("64 hex digits");
        assert_eq!(key.to_hex(), hex.to_lowercase());
        assert_eq!(format!("{key:?}"), "LinkKey(..)");
        for bad in [
            "",
            "00",
            &hex[1..],
            &format!("{hex}00"),
            &hex.replace('a', "g"),
        ] {
            let err = LinkKey::from_hex(bad).expect_err(bad);
            assert!(err.contains("64 hex digits"), "{err}");
        }
        assert_ne!(LinkKey::random().expect("random"), key);
    }

    #[test]
    fn link_auth_without_a_key_says_both_ways_to_give_one() {
        let err = LinkKey::obtain(None, None, Duration::ZERO).expect_err("none");
        let text = err.to_string();
        assert!(text.contains(PEER_KEY_ENV), "{text}");
        assert!(text.contains(WORKER_API_ENV), "{text}");
        let key = test_key();
        let got = LinkKey::obtain(Some(&key), None, Duration::ZERO).expect("the override");
        assert_eq!(got, key);
    }

    /// A frame format for these tests: kind byte, u32 length, payload.
    #[derive(Debug)]
    struct Plain;

    impl Wire for Plain {
        fn send(stream: &TcpStream, message: Message, payload: &[u8]) -> std::io::Result<()> {
            let kind = u8::from(message == Message::Proof);
            let mut bytes = vec![kind];
            bytes.extend_from_slice(&(payload.len() as u32).to_le_bytes());
            bytes.extend_from_slice(payload);
            write_all(stream, &bytes)
        }

        fn recv(
            r: &mut impl Read,
            message: Message,
            max: usize,
        ) -> Result<Vec<u8>, HandshakeError> {
            let mut head = [0u8; 5];
            r.read_exact(&mut head)?;
            if head[0] != u8::from(message == Message::Proof) {
                return Err(HandshakeError::Unexpected(format!("kind {}", head[0])));
            }
            let len = u32::from_le_bytes([head[1], head[2], head[3], head[4]]) as usize;
            if len > max {
                return Err(HandshakeError::Malformed(format!("{len} bytes")));
            }
            let mut payload = vec![0u8; len];
            r.read_exact(&mut payload)?;
            Ok(payload)
        }
    }

    #[derive(Clone, Debug, PartialEq, Serialize, serde::Deserialize)]
    struct Who {
        name: String,
        attempt: u64,
    }

    impl Greeting for Who {
        fn identity(&self) -> Identity {
            Identity::new("test").text(&self.name).number(self.attempt)
        }
    }

    /// Runs a handshake over loopback: the acceptor's and connector's results.
    fn handshake(
        acceptor_key: LinkKey,
        connector_key: LinkKey,
    ) -> (Result<Who, HandshakeError>, Result<Who, HandshakeError>) {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let address = listener.local_addr().expect("address");
        let until = Instant::now() + Duration::from_secs(5);
        let accepting = std::thread::spawn(move || {
            let (stream, _) = listener.accept().expect("accept");
            let me = Who {
                name: "acceptor".into(),
                attempt: 1,
            };
            accept::<Plain, Who>(&stream, until, &acceptor_key, &me).map(|h| h.hello)
        });
        let stream = TcpStream::connect(address).expect("connect");
        let me = Who {
            name: "connector".into(),
            attempt: 1,
        };
        let connected = connect::<Plain, Who>(&stream, until, &connector_key, &me).map(|h| h.hello);
        drop(stream);
        (accepting.join().expect("acceptor"), connected)
    }

    #[test]
    fn link_auth_handshake_needs_the_same_key_on_both_ends() {
        let (accepted, connected) = handshake(test_key(), test_key());
        assert_eq!(accepted.expect("accepted").name, "connector");
        assert_eq!(connected.expect("connected").name, "acceptor");
        // Either end without the key: the connector refuses the acceptor's
        // proof, and the acceptor never gets one.
        let (accepted, connected) = handshake(test_key(), wrong_key());
        assert!(
            matches!(connected, Err(HandshakeError::BadProof)),
            "{connected:?}"
        );
        assert!(accepted.is_err(), "{accepted:?}");
    }

    /// Whether the other end closed `stream` without sending anything
    /// (more): the pipeline's and the ring's tests use it too.
    pub(crate) fn closed(stream: &TcpStream) -> bool {
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        let mut byte = [0u8; 1];
        match (&*stream).read(&mut byte) {
            Ok(0) => true,
            Ok(_) => false,
            Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
        }
    }

    /// A listener on loopback running [`accept_first`] on its own thread,
    /// with `wait` as deadline and the handshakes' timeout, taking a caller
    /// named `wanted`, failing on one named `fatal` and dropping the others;
    /// its address.
    #[allow(clippy::type_complexity)]
    fn accepting(
        wait: Duration,
    ) -> (
        std::thread::JoinHandle<Result<(TcpStream, FrameKeys), AcceptError<String>>>,
        SocketAddr,
    ) {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let address = listener.local_addr().expect("address");
        let me = Who {
            name: "acceptor".into(),
            attempt: 1,
        };
        let until = Instant::now() + wait;
        let handle = std::thread::spawn(move || {
            accept_first::<Plain, Who, String>(
                &listener,
                &test_key(),
                &me,
                until,
                wait,
                || false,
                |_, answered| match answered {
                    Ok(who) if who.name == "wanted" => Verdict::Take,
                    Ok(who) if who.name == "fatal" => Verdict::Fail(who.name),
                    _ => Verdict::Drop,
                },
            )
        });
        (handle, address)
    }

    /// Calls `address` as `name` with `key`: the acceptor's hello, and the
    /// connection.
    fn call(
        address: SocketAddr,
        name: &str,
        key: &LinkKey,
    ) -> (Result<Who, HandshakeError>, TcpStream) {
        let stream = TcpStream::connect(address).expect("connect");
        let me = Who {
            name: name.into(),
            attempt: 1,
        };
        let until = Instant::now() + Duration::from_secs(5);
        let answered = connect::<Plain, Who>(&stream, until, key, &me).map(|h| h.hello);
        (answered, stream)
    }

    #[test]
    fn link_auth_a_listener_takes_the_first_wanted_caller_past_stalling_strangers() {
        let (acceptor, address) = accepting(Duration::from_secs(10));
        // More strangers than handshakes run at once: silent, or stopping
        // within a frame's header.
        let stallers: Vec<_> = (0..3 * MAX_HANDSHAKES)
            .map(|i| {
                let stream = TcpStream::connect(address).expect("connect");
                if i % 2 == 1 {
                    write_all(&stream, &[0, 16]).expect("send");
                }
                stream
            })
            .collect();
        std::thread::sleep(Duration::from_millis(100));
        let started = Instant::now();
        // Without the key: refused, and the listener goes on.
        let (answered, _stranger) = call(address, "wanted", &wrong_key());
        assert!(
            matches!(answered, Err(HandshakeError::BadProof)),
            "{answered:?}"
        );
        // With the key but not the one wanted: dropped.
        let (answered, other) = call(address, "other", &test_key());
        assert_eq!(answered.expect("proved").name, "acceptor");
        assert!(closed(&other), "an unwanted caller is closed");
        let (answered, wanted) = call(address, "wanted", &test_key());
        assert_eq!(answered.expect("proved").name, "acceptor");
        let taken = acceptor.join().expect("acceptor").expect("taken");
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "{:?}",
            started.elapsed()
        );
        assert_eq!(
            taken.0.peer_addr().expect("peer"),
            wanted.local_addr().expect("local")
        );
        // Every stranger's connection is closed, none left waiting.
        for stream in &stallers {
            assert!(closed(stream), "a staller is closed");
        }
    }

    #[test]
    fn link_auth_a_listener_ends_on_a_fatal_caller_or_at_its_deadline() {
        let (acceptor, address) = accepting(Duration::from_secs(10));
        let (answered, _fatal) = call(address, "fatal", &test_key());
        assert!(answered.is_ok(), "{answered:?}");
        let err = acceptor.join().expect("acceptor").expect_err("fatal");
        assert!(
            matches!(&err, AcceptError::Failed(name) if name == "fatal"),
            "{err:?}"
        );

        // Nobody wanted calls: the deadline, plus at most the handshake
        // under way then (here a staller's, bounded by the same 300 ms).
        let started = Instant::now();
        let (acceptor, address) = accepting(Duration::from_millis(300));
        let _staller = TcpStream::connect(address).expect("connect");
        let err = acceptor.join().expect("acceptor").expect_err("nobody");
        assert!(matches!(err, AcceptError::TimedOut), "{err:?}");
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{:?}",
            started.elapsed()
        );
    }

    #[test]
    fn link_auth_reads_are_capped_and_bounded_in_time() {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let address = listener.local_addr().expect("address");
        let accepting = std::thread::spawn(move || {
            let (stream, _) = listener.accept().expect("accept");
            let me = Who {
                name: "acceptor".into(),
                attempt: 1,
            };
            let until = Instant::now() + Duration::from_millis(300);
            accept::<Plain, Who>(&stream, until, &test_key(), &me)
        });
        // A header announcing 4 GiB, then one byte now and then.
        let mut stream = TcpStream::connect(address).expect("connect");
        stream
            .write_all(&[0, 0xff, 0xff, 0xff, 0xff])
            .expect("write");
        let err = accepting.join().expect("acceptor").expect_err("too large");
        assert!(matches!(err, HandshakeError::Malformed(_)), "{err}");

        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let address = listener.local_addr().expect("address");
        let started = Instant::now();
        let accepting = std::thread::spawn(move || {
            let (stream, _) = listener.accept().expect("accept");
            let me = Who {
                name: "acceptor".into(),
                attempt: 1,
            };
            let until = Instant::now() + Duration::from_millis(500);
            accept::<Plain, Who>(&stream, until, &test_key(), &me)
        });
        let mut stream = TcpStream::connect(address).expect("connect");
        let dripping = std::thread::spawn(move || {
            for b in [0u8, 100, 0, 0, 0, 1, 2, 3] {
                if stream.write_all(&[b]).is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(150));
            }
        });
        let err = accepting.join().expect("acceptor").expect_err("too slow");
        assert!(
            matches!(&err, HandshakeError::Io(e) if matches!(e.kind(), std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock)),
            "{err}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{:?}",
            started.elapsed()
        );
        dripping.join().expect("dripping");
    }
}
