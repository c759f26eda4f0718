//! Sizes and times as people read them (`2 MiB`, `59 ns`): used by the trace, the
//! allocators' names and the report alike, so it depends on none of them.

/// `bytes` in binary units (`2 MiB`, `1.5 GiB`): the core's one formatter.
pub use gpu_arena::units::format_size as fmt_bytes;

/// Nanoseconds with a sensible precision.
pub fn fmt_ns(ns: f64) -> String {
    if ns >= 100_000.0 {
        format!("{:.1} µs", ns / 1000.0)
    } else if ns >= 100.0 {
        format!("{ns:.0} ns")
    } else {
        format!("{ns:.1} ns")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_format() {
        assert_eq!(fmt_bytes(512), "512 B");
        assert_eq!(fmt_bytes(2 << 20), "2 MiB");
        assert_eq!(fmt_bytes(3 << 29), "1.5 GiB");
    }

    #[test]
    fn ns_format() {
        assert_eq!(fmt_ns(59.0), "59.0 ns");
        assert_eq!(fmt_ns(462.0), "462 ns");
        assert_eq!(fmt_ns(57_000_000.0), "57000.0 µs");
    }
}
