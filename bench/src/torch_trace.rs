//! Allocation traces recorded from PyTorch programs (`bench/gpu/torch_reserved.py
//! --trace-dir`), read into a [`Trace`] so that the pool can replay a training or generation
//! loop's allocations on the sim backend (`torch_trace_replay`).
//!
//! The text format (one event per line, after a `#` header line):
//!
//! ```text
//! a <id> <bytes> <stream>     an allocation of <bytes> requested on stream index <stream>
//! f <id>                      its free (PyTorch's `free_completed`)
//! ```
//!
//! Ids name live allocations (an id may come back after its free: it is then a new
//! allocation). Allocations still live at the end are freed at the end, in id order, so the
//! trace ends empty as [`Trace::validate`] wants.

use std::collections::HashMap;

use crate::trace::{generate, Op, Trace, TraceConfig};

/// Read and parse a trace file (`.gz` through `gzip -dc`); errors name the file. The names
/// `kv:default` and `kv:long` give the generated KV-cache traces instead (`kv_replay`'s and
/// its second, [`TraceConfig::long_context`]), so that every tool reading recorded loops
/// replays them too.
pub fn read_file(path: &str) -> Result<Trace, String> {
    match path {
        "kv:default" => return Ok(generate(&TraceConfig::default())),
        "kv:long" => return Ok(generate(&TraceConfig::long_context())),
        _ => {}
    }
    let text = if path.ends_with(".gz") {
        let out = std::process::Command::new("gzip")
            .args(["-dc", path])
            .output()
            .map_err(|e| format!("{path}: gzip: {e}"))?;
        if !out.status.success() {
            return Err(format!("{path}: gzip -dc failed"));
        }
        String::from_utf8(out.stdout).map_err(|e| format!("{path}: {e}"))?
    } else {
        std::fs::read_to_string(path).map_err(|e| format!("{path}: {e}"))?
    };
    parse(&text).map_err(|e| format!("{path}: {e}"))
}

/// Parse the text of a recorded trace. Errors name the line.
pub fn parse(text: &str) -> Result<Trace, String> {
    let mut ops = Vec::new();
    // Recorded id -> (dense allocation id, bytes).
    let mut live: HashMap<u64, (u32, u64)> = HashMap::new();
    let mut next: u32 = 0;
    let mut total = 0u64;
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let bad = || format!("line {}: cannot read {line:?}", n + 1);
        let mut words = line.split_ascii_whitespace();
        let kind = words.next().ok_or_else(bad)?;
        let id: u64 = words.next().and_then(|w| w.parse().ok()).ok_or_else(bad)?;
        match kind {
            "a" => {
                let bytes: u64 = words.next().and_then(|w| w.parse().ok()).ok_or_else(bad)?;
                let stream: u64 = words.next().and_then(|w| w.parse().ok()).ok_or_else(bad)?;
                if bytes == 0 {
                    return Err(format!("line {}: an allocation of 0 bytes", n + 1));
                }
                if live.insert(id, (next, bytes)).is_some() {
                    return Err(format!("line {}: id {id} allocated twice", n + 1));
                }
                ops.push(Op::Alloc {
                    id: next,
                    bytes,
                    stream,
                });
                total += bytes;
                next = next
                    .checked_add(1)
                    .ok_or_else(|| "too many allocations".to_owned())?;
            }
            "f" => {
                let (dense, _) = live
                    .remove(&id)
                    .ok_or_else(|| format!("line {}: free of id {id}, which is not live", n + 1))?;
                ops.push(Op::Free { id: dense });
            }
            _ => return Err(bad()),
        }
    }
    let mut rest: Vec<u32> = live.into_values().map(|(dense, _)| dense).collect();
    rest.sort_unstable();
    ops.extend(rest.into_iter().map(|id| Op::Free { id }));
    let mut trace = Trace {
        ops,
        peak_live_bytes: 0,
        peak_live_allocs: 0,
        allocs: next,
        total_alloc_bytes: total,
        steps: 0,
        preemptions: 0,
        kv_block_allocs: 0,
    };
    let (bytes, allocs) = trace.recompute_peaks();
    trace.peak_live_bytes = bytes;
    trace.peak_live_allocs = allocs;
    trace.validate()?;
    Ok(trace)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::parse;
    use crate::trace::Op;

    #[test]
    fn ids_come_back_and_the_rest_is_freed_at_the_end() {
        let t = parse("# header\na 5 100 0\na 6 200 1\nf 5\na 5 300 0\n").unwrap();
        assert_eq!(t.allocs, 3);
        assert_eq!(t.peak_live_bytes, 500);
        assert_eq!(t.ops.len(), 6);
        assert_eq!(
            t.ops[3],
            Op::Alloc {
                id: 2,
                bytes: 300,
                stream: 0
            }
        );
        assert!(matches!(t.ops[5], Op::Free { id: 2 }));
    }

    #[test]
    fn bad_lines_are_refused_by_number() {
        assert!(parse("f 1\n").unwrap_err().contains("line 1"));
        assert!(parse("a 1 10 0\na 1 10 0\n")
            .unwrap_err()
            .contains("line 2"));
        assert!(parse("a x 10 0\n").is_err());
        assert!(parse("a 1 0 0\n").is_err());
    }
}
