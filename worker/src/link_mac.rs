//! Integrity of a link's frames after its handshake.
//!
//! The handshake ([`crate::link_auth`]) proves that both ends know the
//! job's key, but proves nothing about the bytes that follow: whoever
//! relays the connection (on the network path) could alter, drop, replay
//! or reorder tensors after it. So the handshake also gives each
//! connection two session keys, one per direction ([`FrameKeys::derive`]):
//! HMAC-SHA-256 of the job's key over a label naming the direction and both
//! ends' fresh nonces, so a key is new for every connection and differs
//! between its two directions (a frame cannot be reflected back to its
//! sender). Every frame after the handshake carries a 16-byte tag under its
//! direction's key ([`FrameMac`]), over its header and payload and over its
//! sequence number on that connection, which both ends count (it is not
//! sent, as in TLS 1.3): an altered frame, a replayed one, one dropped
//! (the next is checked under a number one too small) or two swapped fail
//! the check, and the reader closes the connection with an error that says
//! so. Tensors stay unencrypted: the tag costs a fraction of a pass over
//! them (docs/benchmarks.md, "Link frame MACs").
//!
//! The tag is ChaCha20-Poly1305's (RFC 8439) with the frame's sequence
//! number as the nonce (unique per key: a key lives for one direction of
//! one connection) and the payload as associated data, the header as the
//! (discarded) plaintext: Poly1305 over the frame under a one-time key
//! that ChaCha20 draws from the nonce, a standard one-time MAC used as the
//! AEAD uses it. The receiver computes the same and compares in constant
//! time. Of the MACs already linked into the worker (ring's
//! ChaCha20-Poly1305, AES-256-GCM and HMAC-SHA-256, RustCrypto's
//! HMAC-SHA-256) it was the fastest on the machine measured, about 2.5
//! times the others (`link_mac_bench`, docs/benchmarks.md).

use hmac::{Hmac, Mac};
use ring::aead::{Aad, CHACHA20_POLY1305, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};
use sha2::Sha256;

use crate::link_auth::{LinkKey, NONCE_BYTES, Role};

/// Bytes of a frame's tag.
pub const TAG_BYTES: usize = 16;
/// Largest header a tag covers besides the payload: the pipeline's is at
/// most 4 + 2 + 8 + 4 + 8 × 8 + 8 bytes (rank 8), the ring's 32.
pub const MAX_HEAD_BYTES: usize = 96;

const FRAMES_LABEL: &[u8] = b"headroom-link-v1/frames";
const TO_ACCEPTOR: &[u8] = b"connector-to-acceptor";
const TO_CONNECTOR: &[u8] = b"acceptor-to-connector";

/// One direction of one connection: its key and the sequence number of
/// its next frame.
pub struct FrameMac {
    key: LessSafeKey,
    next: u64,
}

impl std::fmt::Debug for FrameMac {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FrameMac")
            .field("next", &self.next)
            .finish_non_exhaustive()
    }
}

/// Why a frame was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum MacError {
    #[error(
        "frame {0} failed its integrity check: it was altered, replayed, dropped or reordered on the way (or the other end is not this connection's)"
    )]
    Mismatch(u64),
    #[error("a frame header of {0} bytes (at most {MAX_HEAD_BYTES})")]
    HeadTooLong(usize),
    #[error("the link has carried 2^64 frames: reconnect")]
    Exhausted,
}

impl FrameMac {
    /// A direction keyed by `key` (32 bytes), at sequence number 0.
    pub fn new(key: &[u8; 32]) -> FrameMac {
        let unbound = UnboundKey::new(&CHACHA20_POLY1305, key).expect("ChaCha20 takes 32 bytes");
        FrameMac {
            key: LessSafeKey::new(unbound),
            next: 0,
        }
    }

    /// The sequence number of the next frame.
    pub fn next_sequence(&self) -> u64 {
        self.next
    }

    /// The tag of the next frame (`head`, then `payload`), which then
    /// counts as sent.
    pub fn tag(&mut self, head: &[u8], payload: &[u8]) -> Result<[u8; TAG_BYTES], MacError> {
        let tag = self.compute(head, payload)?;
        self.next += 1;
        Ok(tag)
    }

    /// Checks the next frame's `tag` (constant-time); the frame then counts
    /// as received. A frame that fails leaves the count where it was: the
    /// connection is to be closed.
    pub fn check(&mut self, head: &[u8], payload: &[u8], tag: &[u8]) -> Result<(), MacError> {
        let expected = self.compute(head, payload)?;
        let differs = tag.len() != TAG_BYTES
            || expected
                .iter()
                .zip(tag)
                .fold(0u8, |diff, (a, b)| diff | (a ^ b))
                != 0;
        if differs {
            return Err(MacError::Mismatch(self.next));
        }
        self.next += 1;
        Ok(())
    }

    fn compute(&self, head: &[u8], payload: &[u8]) -> Result<[u8; TAG_BYTES], MacError> {
        if head.len() > MAX_HEAD_BYTES {
            return Err(MacError::HeadTooLong(head.len()));
        }
        if self.next == u64::MAX {
            return Err(MacError::Exhausted);
        }
        let mut nonce = [0u8; NONCE_LEN];
        nonce[NONCE_LEN - 8..].copy_from_slice(&self.next.to_be_bytes());
        let mut scratch = [0u8; MAX_HEAD_BYTES];
        let scratch = &mut scratch[..head.len()];
        scratch.copy_from_slice(head);
        let tag = self
            .key
            .seal_in_place_separate_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(payload),
                scratch,
            )
            // Only for inputs beyond ring's bound (256 GiB), beyond any frame.
            .map_err(|_| MacError::Mismatch(self.next))?;
        let mut out = [0u8; TAG_BYTES];
        out.copy_from_slice(tag.as_ref());
        Ok(out)
    }
}

/// A connection's two directions, as one end sees them.
#[derive(Debug)]
pub struct FrameKeys {
    /// What this end sends.
    pub send: FrameMac,
    /// What this end receives.
    pub recv: FrameMac,
}

impl FrameKeys {
    /// The keys of the connection whose handshake had these nonces, for
    /// the end that played `role`.
    pub fn derive(
        key: &LinkKey,
        role: Role,
        connector_nonce: &[u8; NONCE_BYTES],
        acceptor_nonce: &[u8; NONCE_BYTES],
    ) -> FrameKeys {
        let direction = |label: &[u8]| {
            let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(key.as_bytes())
                .expect("HMAC takes a key of any length");
            for part in [FRAMES_LABEL, label, connector_nonce, acceptor_nonce] {
                mac.update(&(part.len() as u64).to_le_bytes());
                mac.update(part);
            }
            let bytes: [u8; 32] = mac.finalize().into_bytes().into();
            FrameMac::new(&bytes)
        };
        let (to_acceptor, to_connector) = (direction(TO_ACCEPTOR), direction(TO_CONNECTOR));
        match role {
            Role::Connect => FrameKeys {
                send: to_acceptor,
                recv: to_connector,
            },
            Role::Accept => FrameKeys {
                send: to_connector,
                recv: to_acceptor,
            },
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::link_auth::tests::test_key;

    /// The connector's and the acceptor's keys of one connection.
    pub(crate) fn ends() -> (FrameKeys, FrameKeys) {
        let (nc, na) = ([1u8; NONCE_BYTES], [2u8; NONCE_BYTES]);
        (
            FrameKeys::derive(&test_key(), Role::Connect, &nc, &na),
            FrameKeys::derive(&test_key(), Role::Accept, &nc, &na),
        )
    }

    #[test]
    fn link_mac_each_frame_checks_once_in_order_and_in_its_direction() {
        let (mut connector, mut acceptor) = ends();
        let frames: Vec<(Vec<u8>, Vec<u8>)> = (0..3u8)
            .map(|i| (vec![i; 32], vec![i.wrapping_mul(7); 1000]))
            .collect();
        let tags: Vec<_> = frames
            .iter()
            .map(|(h, p)| connector.send.tag(h, p).expect("tag"))
            .collect();
        // Out of order: frame 1 where frame 0 is due.
        let mut fresh = ends().1;
        let err = fresh.recv.check(&frames[1].0, &frames[1].1, &tags[1]);
        assert_eq!(err, Err(MacError::Mismatch(0)));
        for ((h, p), tag) in frames.iter().zip(&tags) {
            acceptor.recv.check(h, p, tag).expect("in order");
        }
        // Replayed: frame 2 again, where frame 3 is due.
        let err = acceptor.recv.check(&frames[2].0, &frames[2].1, &tags[2]);
        assert_eq!(err, Err(MacError::Mismatch(3)));
        // Reflected: a frame the connector sent, offered back to it.
        let err = connector.recv.check(&frames[0].0, &frames[0].1, &tags[0]);
        assert_eq!(err, Err(MacError::Mismatch(0)));
        // Another connection (other nonces) shares no key with this one.
        let other = FrameKeys::derive(&test_key(), Role::Accept, &[3; 32], &[2; 32]);
        let mut other = other.recv;
        assert!(other.check(&frames[0].0, &frames[0].1, &tags[0]).is_err());
    }

    #[test]
    fn link_mac_a_flipped_bit_anywhere_fails() {
        let (mut connector, _) = ends();
        let (head, payload) = (vec![5u8; 40], vec![9u8; 64]);
        let tag = connector.send.tag(&head, &payload).expect("tag");
        for at in 0..(head.len() + payload.len() + TAG_BYTES) * 8 {
            let (mut h, mut p, mut t) = (head.clone(), payload.clone(), tag.to_vec());
            let byte = at / 8;
            let bit = 1u8 << (at % 8);
            if byte < h.len() {
                h[byte] ^= bit;
            } else if byte < h.len() + p.len() {
                p[byte - h.len()] ^= bit;
            } else {
                t[byte - h.len() - p.len()] ^= bit;
            }
            let mut receiver = ends().1.recv;
            assert_eq!(
                receiver.check(&h, &p, &t),
                Err(MacError::Mismatch(0)),
                "bit {at}"
            );
            receiver
                .check(&head, &payload, &tag)
                .expect("the frame as sent");
        }
    }
}
