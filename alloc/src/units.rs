//! Sizes and fractions as configuration values are written, and sizes as messages print them.
//!
//! A size is a number, optionally with a fractional part, and an optional unit (case is
//! ignored, whitespace and `_` are skipped):
//!
//! | unit | value |
//! |---|---|
//! | none, `B` | bytes |
//! | `KiB`, `MiB`, `GiB`, `TiB` (also `Ki`..`Ti`) | 2^10, 2^20, 2^30, 2^40 (binary) |
//! | `K`, `M`, `G`, `T` alone | binary too (as Docker's `-m 1g` and `ulimit`) |
//! | `KB`, `MB`, `GB`, `TB` | 10^3, 10^6, 10^9, 10^12 (decimal, as disks and `nvidia-smi` name them) |
//!
//! `1.5GiB` is 1610612736 bytes; a fraction that does not land on a whole byte is rounded
//! down (`0.1KiB` is 102 bytes). Anything else (a sign, an exponent, an unknown unit, a
//! number that overflows 64 bits) is refused.

/// The reason a value was refused (callers add the key it was given for). This module
/// imports nothing from the crate, so both `config` and `error` can use it.
pub type Result<T> = std::result::Result<T, String>;

/// The accepted forms of a size, for error messages.
pub const SIZE_FORMS: &str = "a byte count (4096) or a number with a unit: KiB/MiB/GiB/TiB or K/M/G/T (binary), KB/MB/GB/TB (decimal), e.g. 1GiB, 1.5GiB, 512MiB, 40GB";

/// Parse a size (the grammar is in the module docs). The error says what is wrong with
/// `text`; callers add the key it was given for.
pub fn parse_size(text: &str) -> Result<u64> {
    let t: String = text
        .chars()
        .filter(|c| !c.is_whitespace() && *c != '_')
        .collect();
    let split = t
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let multiplier: u128 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "ki" | "kib" => 1 << 10,
        "m" | "mi" | "mib" => 1 << 20,
        "g" | "gi" | "gib" => 1 << 30,
        "t" | "ti" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => return Err(format!("`{text}`: unknown unit `{unit}`")),
    };
    let (mantissa, scale) =
        parse_decimal(num).ok_or_else(|| format!("`{text}` is not a number with a unit"))?;
    let bytes = mantissa
        .checked_mul(multiplier)
        .map(|b| b / scale)
        .and_then(|b| u64::try_from(b).ok())
        .ok_or_else(|| format!("`{text}` does not fit in 64 bits"))?;
    Ok(bytes)
}

/// `digits[.digits]` as an exact rational `mantissa / scale` (scale a power of ten), or
/// `None` when it is not such a number (empty, two dots, more than 18 fractional digits).
fn parse_decimal(num: &str) -> Option<(u128, u128)> {
    let (int, frac) = num.split_once('.').unwrap_or((num, ""));
    if int.is_empty() && frac.is_empty() {
        return None;
    }
    if frac.len() > 18 || !(int.bytes().chain(frac.bytes())).all(|b| b.is_ascii_digit()) {
        return None;
    }
    let digits = format!("{int}{frac}");
    let mantissa: u128 = digits.parse().ok()?;
    Some((mantissa, 10u128.pow(frac.len() as u32)))
}

/// A fraction `0 < f <= 1` written as `0.9`, `1` or `90%`; `None` when `text` has neither
/// form (it may still be a size). An out-of-range fraction is an error.
pub fn parse_fraction(text: &str) -> Result<Option<f64>> {
    let t = text.trim();
    let (num, percent) = match t.strip_suffix('%') {
        Some(n) => (n.trim(), true),
        None => (t, false),
    };
    let Some((mantissa, scale)) = parse_decimal(num) else {
        return if percent {
            Err(format!("`{text}` is not a percentage"))
        } else {
            Ok(None)
        };
    };
    let f = mantissa as f64 / scale as f64 / if percent { 100.0 } else { 1.0 };
    if !percent && f > 1.0 {
        // A plain number above 1 is a byte count, not a fraction.
        return Ok(None);
    }
    if f <= 0.0 || f > 1.0 {
        return Err(format!(
            "`{text}`: a fraction of the device must be above 0 and at most 1 (100%)"
        ));
    }
    Ok(Some(f))
}

/// `bytes` for people: `512 B`, `2 MiB`, `3.9 GiB` (binary units, one decimal when not
/// whole).
pub fn format_size(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut unit = 0;
    while unit + 1 < UNITS.len() && bytes >= 1u64 << (10 * (unit + 1)) {
        unit += 1;
    }
    let div = 1u64 << (10 * unit);
    if bytes % div == 0 {
        format!("{} {}", bytes / div, UNITS[unit])
    } else {
        format!("{:.1} {}", bytes as f64 / div as f64, UNITS[unit])
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        for (text, want) in [
            ("4096", 4096),
            ("1GiB", 1 << 30),
            ("1gib", 1 << 30),
            ("256 MiB", 256 << 20),
            ("2M", 2 << 20),
            ("1_024k", 1 << 20),
            ("3TiB", 3 << 40),
            ("1G", 1 << 30),
            ("1Gi", 1 << 30),
            ("1GB", 1_000_000_000),
            ("40GB", 40_000_000_000),
            ("1kb", 1000),
            ("2TB", 2_000_000_000_000),
            ("1.5GiB", 3 << 29),
            ("0.5MiB", 512 << 10),
            ("1.5GB", 1_500_000_000),
            ("0.1KiB", 102),
            ("12B", 12),
            (".5KiB", 512),
            ("2.KiB", 2048),
        ] {
            assert_eq!(parse_size(text).unwrap(), want, "{text}");
        }
        for bad in [
            "",
            "GiB",
            "12XB",
            "-1",
            "+1",
            "1e9",
            "1..5GiB",
            ".",
            "99999999999T",
            "1.5.5G",
            "0x10",
            "1 GiB GiB",
            "1.0000000000000000001G",
        ] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn fractions() {
        for (text, want) in [
            ("0.9", 0.9),
            ("1", 1.0),
            ("1.0", 1.0),
            ("90%", 0.9),
            ("100%", 1.0),
        ] {
            assert_eq!(parse_fraction(text).unwrap(), Some(want), "{text}");
        }
        for size in ["2", "4096", "1GiB", "1.5"] {
            assert_eq!(parse_fraction(size).unwrap(), None, "{size} is no fraction");
        }
        for bad in ["0", "0.0", "0%", "101%", "x%", "-5%"] {
            assert!(parse_fraction(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn formatted() {
        assert_eq!(format_size(0), "0 B");
        assert_eq!(format_size(512), "512 B");
        assert_eq!(format_size(2 << 20), "2 MiB");
        assert_eq!(format_size((39 << 30) / 10), "3.9 GiB");
        assert_eq!(format_size(16 << 30), "16 GiB");
        assert_eq!(format_size(1 << 40), "1 TiB");
    }
}
