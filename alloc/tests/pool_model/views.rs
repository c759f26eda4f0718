//! The pool's read-only views checked against the model after a `Snapshot` step: the
//! segments (PyTorch's `memory_snapshot`: arenas and their ranges), the JSON snapshot, the
//! peaks.

use std::collections::HashMap;

use super::model::Model;

impl Model {
    /// Segments sorted and disjoint, each tiled by its ranges; every live block of the model
    /// listed as allocated with its length and request; awake and asleep segments adding up
    /// to reserved plus sleeping bytes; the JSON snapshot parses and lists the same arenas.
    pub(crate) fn check_views(&self) -> Result<(), String> {
        let segs = self.pool.segments(self.dev).map_err(|e| e.to_string())?;
        for w in segs.windows(2) {
            if w[0].base + w[0].bytes > w[1].base {
                return Err(format!(
                    "segments overlap: {:#x} and {:#x}",
                    w[0].base, w[1].base
                ));
            }
        }
        let mut allocated = HashMap::new();
        for s in &segs {
            let mut at = s.base;
            for b in &s.blocks {
                if b.ptr != at {
                    return Err(format!(
                        "segment {:#x}: a range at {:#x} where {at:#x} was expected",
                        s.base, b.ptr
                    ));
                }
                at += b.bytes;
                if b.allocated {
                    allocated.insert(b.ptr, (b.bytes, b.requested));
                }
            }
            if at != s.base + s.bytes {
                return Err(format!(
                    "segment {:#x} of {} bytes: its ranges end at {at:#x}",
                    s.base, s.bytes
                ));
            }
        }
        for b in self.blocks.iter().filter(|b| !b.freed) {
            match allocated.get(&b.ptr) {
                Some(&(len, requested)) if len == b.len && requested == b.bytes => {}
                other => {
                    return Err(format!(
                        "live block {:#x} ({} of {} bytes) listed in the segments as {other:?}",
                        b.ptr, b.bytes, b.len
                    ))
                }
            }
        }
        let stats = self.pool.stats(self.dev).map_err(|e| e.to_string())?;
        let total: u64 = segs.iter().map(|s| s.bytes).sum();
        if total != stats.reserved_bytes + stats.sleeping_bytes {
            return Err(format!(
                "segments hold {total} bytes, reserved {} + sleeping {}",
                stats.reserved_bytes, stats.sleeping_bytes
            ));
        }
        let json: serde_json::Value = serde_json::from_str(&self.pool.snapshot_json())
            .map_err(|e| format!("snapshot_json does not parse: {e}"))?;
        let device = &json["devices"][self.dev as usize];
        let arenas = ["arenas", "orphans"]
            .iter()
            .map(|k| device[k].as_array().map_or(usize::MAX / 2, Vec::len))
            .sum::<usize>();
        if arenas != segs.len() {
            return Err(format!(
                "snapshot_json lists {arenas} arenas and orphans of device {}, segments {}",
                self.dev,
                segs.len()
            ));
        }
        Ok(())
    }

    /// After `reset_peak_stats`: the peaks are the current values.
    pub(crate) fn check_reset_peaks(&self) -> Result<(), String> {
        let s = self.pool.stats(self.dev).map_err(|e| e.to_string())?;
        let peaks = (
            s.peak_reserved_bytes,
            s.peak_allocated_bytes,
            s.peak_requested_bytes,
        );
        let now = (s.reserved_bytes, s.allocated_bytes, s.requested_bytes);
        if peaks != now {
            return Err(format!("peaks {peaks:?} after a reset, current {now:?}"));
        }
        Ok(())
    }
}
