//! Kubernetes resource quantities ("4Gi", "512M", "1.5e9") as bytes.

/// Parses a memory quantity into bytes. Fractions round up (a limit is a ceiling).
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let bytes = parse_value(text)?.ceil();
    if bytes > u64::MAX as f64 {
        return Err(format!("{text:?} is too large"));
    }
    Ok(bytes as u64)
}

/// Parses a CPU quantity ("2", "500m", "1.5") into cores; must be above zero.
pub fn parse_cores(text: &str) -> Result<f64, String> {
    let negative = text.trim().starts_with('-');
    let cores = parse_value(text.trim().trim_start_matches('-'))
        .map_err(|_| format!("{text:?} is not a CPU quantity; use e.g. 1, 2 or 500m"))?;
    if negative || cores <= 0.0 {
        return Err(format!("{text:?} must be above zero, e.g. 1 or 500m"));
    }
    Ok(cores)
}

/// A quantity's value in base units (bytes, cores), unrounded.
fn parse_value(text: &str) -> Result<f64, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| c.is_ascii_alphabetic() && c != 'e' && c != 'E')
        .unwrap_or(t.len());
    let (number, suffix) = t.split_at(split);
    let multiplier: f64 = match suffix {
        "" => 1.0,
        "Ki" => 1024f64,
        "Mi" => 1024f64.powi(2),
        "Gi" => 1024f64.powi(3),
        "Ti" => 1024f64.powi(4),
        "Pi" => 1024f64.powi(5),
        "Ei" => 1024f64.powi(6),
        "k" => 1e3,
        "M" => 1e6,
        "G" => 1e9,
        "T" => 1e12,
        "P" => 1e15,
        "E" => 1e18,
        "m" => 1e-3,
        _ => {
            return Err(format!(
                "{text:?} has an unknown suffix {suffix:?}; use e.g. 512Mi or 4Gi"
            ));
        }
    };
    let value: f64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a quantity; use e.g. 512Mi or 4Gi"))?;
    if !value.is_finite() || value < 0.0 {
        return Err(format!("{text:?} must be a non-negative quantity"));
    }
    Ok(value * multiplier)
}

#[cfg(test)]
mod tests {
    use super::{parse_bytes, parse_cores};

    #[test]
    fn parses_binary_decimal_and_exponent_forms() {
        assert_eq!(parse_bytes("4Gi"), Ok(4 << 30));
        assert_eq!(parse_bytes("512Mi"), Ok(512 << 20));
        assert_eq!(parse_bytes("1G"), Ok(1_000_000_000));
        assert_eq!(parse_bytes("1.5e9"), Ok(1_500_000_000));
        assert_eq!(parse_bytes("1024"), Ok(1024));
        assert_eq!(parse_bytes("1500m"), Ok(2));
    }

    #[test]
    fn rejects_nonsense_with_a_hint() {
        let err = parse_bytes("4GB").expect_err("GB is not a Kubernetes suffix");
        assert!(err.contains("4Gi"), "{err}");
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("-1Gi").is_err());
    }

    #[test]
    fn cores_are_positive_cpu_quantities() {
        assert_eq!(parse_cores("2"), Ok(2.0));
        assert_eq!(parse_cores("500m"), Ok(0.5));
        for bad in ["lots", "-1", "0", "0m", "1Gx"] {
            assert!(parse_cores(bad).is_err(), "{bad}");
        }
    }
}
