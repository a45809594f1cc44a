//! Answers about bearer tokens (a review's acceptance or refusal),
//! remembered for a while by the token's SHA-256, so that a caller who
//! repeats a token costs the API server nothing until the answer expires,
//! and the operator's memory holds no replayable credential. The worker
//! API's identities and /metrics' access checks keep theirs here.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

/// Entries kept per cache at most; beyond it the expired ones are dropped, then all.
const MAX_ENTRIES: usize = 20_000;

/// SHA-256 of a token: what the caches are keyed by.
pub type TokenHash = [u8; 32];

/// A cache of answers per token hash, each good until its own deadline.
#[derive(Debug)]
pub struct Remembered<T> {
    entries: Mutex<HashMap<TokenHash, (T, Instant)>>,
}

impl<T: Clone> Default for Remembered<T> {
    fn default() -> Self {
        Remembered::new()
    }
}

impl<T: Clone> Remembered<T> {
    pub fn new() -> Self {
        Remembered {
            entries: Mutex::new(HashMap::new()),
        }
    }

    pub fn get(&self, key: &TokenHash) -> Option<T> {
        let entries = self.entries.lock().ok()?;
        let (value, until) = entries.get(key)?;
        (Instant::now() < *until).then(|| value.clone())
    }

    pub fn put(&self, key: TokenHash, value: T, ttl: Duration) {
        if let Ok(mut entries) = self.entries.lock() {
            if entries.len() >= MAX_ENTRIES {
                let now = Instant::now();
                entries.retain(|_, (_, until)| now < *until);
                if entries.len() >= MAX_ENTRIES {
                    entries.clear();
                }
            }
            entries.insert(key, (value, Instant::now() + ttl));
        }
    }

    pub fn forget(&self, key: &TokenHash) {
        if let Ok(mut entries) = self.entries.lock() {
            entries.remove(key);
        }
    }
}

/// What a cache is keyed by: SHA-256 of `token`.
pub fn token_hash(token: &str) -> TokenHash {
    Sha256::digest(token.as_bytes()).into()
}

/// The bearer token of a request's `Authorization` header, if it has one.
pub fn bearer_token(headers: &axum::http::HeaderMap) -> Option<&str> {
    headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
        .filter(|t| !t.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remembered_answers_end_at_their_own_deadline() {
        let cache = Remembered::new();
        cache.put([1; 32], "long", Duration::from_secs(60));
        cache.put([2; 32], "gone", Duration::ZERO);
        assert_eq!(cache.get(&[1; 32]), Some("long"));
        assert_eq!(cache.get(&[2; 32]), None);
        cache.forget(&[1; 32]);
        assert_eq!(cache.get(&[1; 32]), None);
    }
}
