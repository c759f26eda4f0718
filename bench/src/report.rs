//! Markdown tables of replay results, and where the summary file goes.

use std::fmt::Write as _;
use std::path::PathBuf;

use crate::replay::ReplayResult;
use crate::units::{fmt_bytes, fmt_ns};

/// The main table: one row per allocator, with each row's ns/op divided by the ns/op of
/// `results[reference]` (the pool) in the last column.
pub fn replay_table(results: &[ReplayResult], reference: usize) -> String {
    let base = results.get(reference).map_or(0.0, |r| r.ns_per_op);
    let mut s = String::new();
    s.push_str("| allocator | ns/op | of which sampling | peak reserved | peak live | reserved/live | ns/op ÷ pool | notes |\n");
    s.push_str("|---|---:|---:|---:|---:|---:|---:|---|\n");
    for r in results {
        let ratio = if base > 0.0 {
            format!("{:.2}x", r.ns_per_op / base)
        } else {
            "-".to_string()
        };
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {:.3} | {} | {} |",
            r.allocator,
            fmt_ns(r.ns_per_op),
            fmt_ns(r.sample_ns),
            fmt_bytes(r.peak_reserved),
            fmt_bytes(r.peak_live),
            r.ratio_reserved_to_live,
            ratio,
            fmt_notes(&r.notes)
        );
    }
    s
}

/// One row of the arena-size sweep.
#[derive(Debug, Clone, PartialEq)]
pub struct SweepRow {
    /// The pool's `arena_size`.
    pub arena_size: u64,
    /// The replay.
    pub result: ReplayResult,
    /// Most arenas held at once (= driver exports needed to share everything at the peak).
    pub peak_arenas: u64,
    /// Arenas created through the backend during the replay (driver create calls).
    pub arenas_created: u64,
}

/// The arena-size sweep table.
pub fn sweep_table(rows: &[SweepRow]) -> String {
    let mut s = String::new();
    s.push_str(
        "| arena size | ns/op | peak reserved | reserved/live | peak arenas (= exports to share all) | arenas created |\n",
    );
    s.push_str("|---:|---:|---:|---:|---:|---:|\n");
    for r in rows {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {:.3} | {} | {} |",
            fmt_bytes(r.arena_size),
            fmt_ns(r.result.ns_per_op),
            fmt_bytes(r.result.peak_reserved),
            r.result.ratio_reserved_to_live,
            r.peak_arenas,
            r.arenas_created
        );
    }
    s
}

fn fmt_notes(notes: &[(String, String)]) -> String {
    notes
        .iter()
        .map(|(k, v)| format!("{k}: {v}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Where the summary goes: `$KV_BENCH_SUMMARY`, else `kv_cache_summary.md` in
/// `$CARGO_TARGET_DIR`, else in the workspace's `target/`.
pub fn summary_path() -> PathBuf {
    if let Some(p) = std::env::var_os("KV_BENCH_SUMMARY") {
        return PathBuf::from(p);
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let manifest = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
            manifest.parent().unwrap_or(manifest).join("target")
        });
    target.join("kv_cache_summary.md")
}

/// Write `markdown` to [`summary_path`], creating its directory. Returns the path.
pub fn write_summary(markdown: &str) -> Result<PathBuf, String> {
    let path = summary_path();
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    std::fs::write(&path, markdown).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn table_has_the_ratio_to_the_reference() {
        let r = |name: &str, ns: f64| ReplayResult {
            allocator: name.to_string(),
            ops: 10,
            elapsed: Duration::from_nanos(ns as u64 * 10),
            ns_per_op: ns,
            peak_reserved: 4 << 20,
            peak_live: 2 << 20,
            ratio_reserved_to_live: 2.0,
            sample_ns: 1.5,
            notes: vec![("k".into(), "v".into())],
        };
        let t = replay_table(&[r("pool", 100.0), r("slow", 2500.0)], 0);
        assert!(
            t.contains("| pool | 100 ns | 1.5 ns | 4 MiB | 2 MiB | 2.000 | 1.00x | k: v |"),
            "{t}"
        );
        assert!(t.contains("| slow | 2500 ns |"), "{t}");
        assert!(t.contains("25.00x"), "{t}");
    }
}
