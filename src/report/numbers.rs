//! How numbers read to a person: precision fit to size, binary byte units, ratios. Shared by
//! the data model's display helpers and every text exporter; imports nothing of kvx.

/// A float with precision fit to its size: `0.123`, `12.35`, `123.5`, `12346`.
pub fn fmt_f(v: f64) -> String {
    if !v.is_finite() {
        return "-".into();
    }
    let a = v.abs();
    if a == 0.0 {
        "0".into()
    } else if a < 1.0 {
        format!("{v:.3}")
    } else if a < 100.0 {
        format!("{v:.2}")
    } else if a < 10_000.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.0}")
    }
}

/// Bytes in binary units: `512 B`, `4.00 KiB`, `1.50 GiB`.
pub fn fmt_bytes(v: f64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    if !v.is_finite() {
        return "-".into();
    }
    let mut x = v;
    let mut i = 0;
    while x.abs() >= 1024.0 && i < UNITS.len() - 1 {
        x /= 1024.0;
        i += 1;
    }
    if i == 0 { format!("{x:.0} B") } else { format!("{x:.2} {}", UNITS[i]) }
}

/// Bytes in binary units, whole where they are: 8192 -> `8 KiB`, 12800 -> `12.5 KiB` (the
/// plan views: `kvx topo`, `kvx plan`, `kvx layout`).
pub fn bytes_text(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if (v.fract()).abs() < 1e-9 { format!("{v:.0} {}", UNITS[u]) } else { format!("{v:.1} {}", UNITS[u]) }
}

/// A ratio as `0.853x`.
pub fn fmt_ratio(v: f64) -> String {
    if v.is_finite() { format!("{v:.3}x") } else { "-".into() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn number_formats() {
        assert_eq!(fmt_f(0.0), "0");
        assert_eq!(fmt_f(0.12345), "0.123");
        assert_eq!(fmt_f(12.345), "12.35");
        assert_eq!(fmt_f(123.45), "123.5");
        assert_eq!(fmt_f(123456.7), "123457");
        assert_eq!(fmt_f(f64::NAN), "-");
        assert_eq!(fmt_bytes(512.0), "512 B");
        assert_eq!(fmt_bytes(4096.0), "4.00 KiB");
        assert_eq!(fmt_bytes(1.5 * 1024.0 * 1024.0 * 1024.0), "1.50 GiB");
        assert_eq!(fmt_ratio(0.8534), "0.853x");
    }
}
