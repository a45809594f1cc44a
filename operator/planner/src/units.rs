//! Byte units and human-readable formatting. GiB = 2^30, GB = 10^9: we print GiB.

pub const KIB: u64 = 1 << 10;
pub const MIB: u64 = 1 << 20;
pub const GIB: u64 = 1 << 30;

/// Formats a count in words, e.g. `70.6 billion`, `4.2 million`, `350 thousand`:
/// never a bare `B`/`M` suffix, which reads as bytes beside the memory figures.
pub fn format_count(n: u64) -> String {
    let x = n as f64;
    if n >= 1_000_000_000_000 {
        format!("{:.1} trillion", x / 1e12)
    } else if n >= 1_000_000_000 {
        format!("{:.1} billion", x / 1e9)
    } else if n >= 1_000_000 {
        format!("{:.1} million", x / 1e6)
    } else if n >= 10_000 {
        format!("{:.0} thousand", x / 1e3)
    } else {
        n.to_string()
    }
}

/// Formats bytes with binary units, e.g. `31.2 GiB`, `512.0 MiB`.
pub fn format_bytes(bytes: u64) -> String {
    let b = bytes as f64;
    if bytes >= GIB {
        format!("{:.1} GiB", b / GIB as f64)
    } else if bytes >= MIB {
        format!("{:.1} MiB", b / MIB as f64)
    } else if bytes >= KIB {
        format!("{:.1} KiB", b / KIB as f64)
    } else {
        format!("{bytes} B")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_read_as_counts_not_bytes() {
        assert_eq!(format_count(1_000_000_000_000), "1.0 trillion");
        assert_eq!(format_count(6_738_415_616), "6.7 billion");
        assert_eq!(format_count(354_823_168), "354.8 million");
        assert_eq!(format_count(350_000), "350 thousand");
        assert_eq!(format_count(512), "512");
    }

    #[test]
    fn formats_binary_units() {
        assert_eq!(format_bytes(0), "0 B");
        assert_eq!(format_bytes(1536), "1.5 KiB");
        assert_eq!(format_bytes(512 * MIB), "512.0 MiB");
        assert_eq!(format_bytes(80 * GIB), "80.0 GiB");
    }
}
