//! The secret a job's workers prove their membership with when they connect
//! to each other (pipeline stages, data-parallel replicas).
//!
//! An attempt's key is HMAC-SHA-256(operator key, namespace ‖ job uid ‖
//! attempt): stored nowhere, no API write per job, the same on every
//! operator replica that mounts the same operator key (the chart's Secret),
//! different for every job (a job re-created under the same name has a new
//! uid, so a new key) and for every attempt of it, so a pod of an earlier
//! attempt that is still running, or a key one of its pods leaked, cannot
//! join a later attempt's links. The worker API hands it only to a worker
//! pod its job controls, for that pod's own attempt.

use std::path::Path;

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Bytes of the operator's key and of each job's key.
pub const KEY_BYTES: usize = 32;

/// The operator's own key, from which every job's key is derived.
#[derive(Clone)]
pub struct OperatorKey([u8; KEY_BYTES]);

impl std::fmt::Debug for OperatorKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OperatorKey(..)")
    }
}

#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("reading the peer key file {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error(
        "the peer key file {path} holds {bytes} bytes after trimming; it needs at least {KEY_BYTES} (e.g. 64 random letters and digits)"
    )]
    TooShort { path: String, bytes: usize },
    #[error("no random source for the peer key: {0}")]
    Random(String),
}

impl OperatorKey {
    /// From a file (the chart mounts a Secret): its bytes, trimmed, at least
    /// [`KEY_BYTES`] of them, hashed to [`KEY_BYTES`].
    pub fn from_file(path: &Path) -> Result<Self, KeyError> {
        let raw = std::fs::read(path).map_err(|source| KeyError::Read {
            path: path.display().to_string(),
            source,
        })?;
        let trimmed = raw.trim_ascii();
        if trimmed.len() < KEY_BYTES {
            return Err(KeyError::TooShort {
                path: path.display().to_string(),
                bytes: trimmed.len(),
            });
        }
        let mut mac = key_mac(b"headroom operator key v1");
        mac.update(trimmed);
        Ok(OperatorKey(mac.finalize().into_bytes().into()))
    }

    /// A fresh random key: for one operator process (a second replica, or
    /// the same one restarted, derives different job keys).
    pub fn random() -> Result<Self, KeyError> {
        let mut key = [0u8; KEY_BYTES];
        getrandom::fill(&mut key).map_err(|e| KeyError::Random(e.to_string()))?;
        Ok(OperatorKey(key))
    }

    /// The key of attempt `attempt` of the job `namespace`/`uid`, as 64
    /// lowercase hex digits.
    pub fn attempt_key_hex(&self, namespace: &str, job_uid: &str, attempt: u32) -> String {
        let mut mac = key_mac(&self.0);
        mac.update(b"headroom peer key v2");
        for part in [namespace, job_uid] {
            // Length-prefixed: ("ab", "c") and ("a", "bc") are different jobs.
            mac.update(&(part.len() as u64).to_be_bytes());
            mac.update(part.as_bytes());
        }
        mac.update(&attempt.to_be_bytes());
        mac.finalize()
            .into_bytes()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }
}

fn key_mac(key: &[u8]) -> Hmac<Sha256> {
    // HMAC takes a key of any length.
    #[allow(clippy::expect_used)]
    <Hmac<Sha256> as Mac>::new_from_slice(key).expect("HMAC accepts any key length")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_attempt_of_each_job_has_its_own_key_and_every_replica_derives_the_same() {
        let dir = std::env::temp_dir().join(format!("hr-peer-key-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let file = dir.join("key");
        std::fs::write(
            &file,
            "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ01\n",
        )
        .expect("write");
        let a = OperatorKey::from_file(&file).expect("key");
        let b = OperatorKey::from_file(&file).expect("key");
        let key = a.attempt_key_hex("team-a", "uid-1", 1);
        assert_eq!(key.len(), 64);
        assert!(
            key.bytes()
                .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
        );
        assert_eq!(
            key,
            b.attempt_key_hex("team-a", "uid-1", 1),
            "replicas agree"
        );
        assert_ne!(
            key,
            a.attempt_key_hex("team-a", "uid-2", 1),
            "a re-created job"
        );
        assert_ne!(key, a.attempt_key_hex("team-b", "uid-1", 1));
        assert_ne!(
            key,
            a.attempt_key_hex("team-a", "uid-1", 2),
            "the next attempt"
        );
        assert_ne!(
            a.attempt_key_hex("ab", "c", 1),
            a.attempt_key_hex("a", "bc", 1)
        );
        let other = OperatorKey::random().expect("random");
        assert_ne!(key, other.attempt_key_hex("team-a", "uid-1", 1));
        assert_eq!(format!("{a:?}"), "OperatorKey(..)");

        std::fs::write(&file, "short\n").expect("write");
        let err = OperatorKey::from_file(&file).expect_err("too short");
        assert!(err.to_string().contains("at least 32"), "{err}");
        std::fs::remove_dir_all(&dir).ok();
    }
}
