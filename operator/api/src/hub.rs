//! The Hugging Face hub's URLs, as the initializer and the plugin build them.

/// Percent-encodes a path segment (all but unreserved characters, and `/`
/// where `keep_slash`): revisions such as `refs/pr/1` are one segment.
pub fn encode_path(s: &str, keep_slash: bool) -> String {
    use std::fmt::Write as _;
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) || (keep_slash && b == b'/') {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_revision_is_one_segment_and_a_file_keeps_its_folders() {
        assert_eq!(encode_path("refs/pr/1", false), "refs%2Fpr%2F1");
        assert_eq!(encode_path("a b/c.json", true), "a%20b/c.json");
    }
}
