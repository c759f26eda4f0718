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

    /// The lookups by address (`allocation_containing`, `freed_while_shared`, `tag_of`) of
    /// a byte `at` into block `i`: its start, request and device while live; not live, and
    /// freed while shared, once its owner freed it while shared; its tag. Just past its end,
    /// where no live block of the model lies, no live allocation of this device is found.
    pub(crate) fn check_lookup(&self, i: usize, at: u64) -> Result<(), String> {
        if self.blocks.is_empty() {
            return Ok(());
        }
        let b = &self.blocks[i % self.blocks.len()];
        let addr = b.ptr + at % b.len;
        let got = self.pool.allocation_containing(addr);
        let freed = self.pool.freed_while_shared(addr);
        if b.freed {
            if got.is_ok() || !freed {
                return Err(format!(
                    "{addr:#x} in {b:x?}, freed while shared: found {got:x?}, freed_while_shared {freed}"
                ));
            }
        } else if freed || !matches!(got, Ok(g) if g == (b.ptr, b.bytes, self.dev)) {
            return Err(format!(
                "{addr:#x} in live {b:x?}: found {got:x?}, freed_while_shared {freed}"
            ));
        }
        let tag = self.pool.tag_of(addr);
        if tag != Some(b.tag) {
            return Err(format!("{addr:#x} in {b:x?}: tag_of says {tag:?}"));
        }
        let past = b.ptr + b.len;
        let inside = |o: &super::model::Block| o.ptr <= past && past < o.ptr + o.len;
        if !self.blocks.iter().any(|o| !o.freed && inside(o)) {
            if let Ok(found) = self.pool.allocation_containing(past) {
                if found.2 == self.dev {
                    return Err(format!(
                        "{past:#x}, just past {b:x?} and in no live block, found in {found:x?}"
                    ));
                }
            }
        }
        Ok(())
    }

    /// After `reset_accumulated_stats`: the counts of events are 0 (the thread caches' too).
    pub(crate) fn check_reset_counts(&self) -> Result<(), String> {
        let s = self.pool.stats(self.dev).map_err(|e| e.to_string())?;
        let counts = (s.alloc_count, s.free_count, s.oom_count);
        if counts != (0, 0, 0) {
            return Err(format!("counts {counts:?} after a reset"));
        }
        Ok(())
    }
}
