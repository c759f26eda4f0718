//! [`ExpandableModel`]: PyTorch's caching allocator with `expandable_segments:True`, modelled
//! for trace replays, so that gpu-arena's reserved bytes can be set beside PyTorch's on the
//! *same* allocation sequence, and their difference traced op by op
//! (`examples/lockstep.rs`).
//!
//! What it models (torch 2.x `c10/cuda/CUDACachingAllocator.cpp`):
//! - requests round up to 512 bytes; up to 1 MiB they go to the small pool, above it to the
//!   large pool;
//! - each (pool, stream) has one expandable segment: a virtual range mapped from its start in
//!   pages of 2 MiB (small pool, `kSmallBuffer`) or 20 MiB (large pool, `kLargeBuffer`);
//! - best fit among the free blocks of the request's (pool, stream), ties to the lowest
//!   address, except that a free block at the mapped end ranks by the size it can expand to
//!   (`get_free_block`): it is taken only when no other block fits;
//! - a block splits when the rest is at least 512 bytes, in both pools (`should_split` with
//!   expandable segments);
//! - no fit: the segment maps the pages that the request needs beyond its free last block
//!   (which joins the new pages);
//! - a free coalesces with free neighbours at once; nothing is unmapped (only `empty_cache`
//!   and an out-of-memory retry do that, and the recorded loops call neither).
//!
//! Not modelled: `record_stream` events (the recorded loops use one stream) and the
//! `max_split_size` / `garbage_collection` options (off by default). Checked against the
//! H200: on the traces of `bench/traces/` it gives PyTorch's measured peak to the MiB on all
//! six loops (`bench/results/sim-2026-12-02-expandable-model.md`).

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::replay::TraceAllocator;

const MIB: u64 = 1 << 20;
/// PyTorch's small/large boundary (`kSmallSize`).
const SMALL_SIZE: u64 = MIB;
/// Page of the small pool's segments (`kSmallBuffer`).
const SMALL_PAGE: u64 = 2 * MIB;
/// Page of the large pool's segments (`kLargeBuffer`).
const LARGE_PAGE: u64 = 20 * MIB;
/// Rounding of every request (`kMinBlockSize`).
const MIN_BLOCK: u64 = 512;
/// Segments lie this far apart in the model's address space.
const SEGMENT_SPAN: u64 = 1 << 44;

/// One expandable segment: its blocks by address (`(bytes, free)`), its free blocks by
/// `(bytes, address)` and how much of it is mapped.
#[derive(Debug, Default)]
struct Segment {
    base: u64,
    mapped: u64,
    blocks: BTreeMap<u64, (u64, bool)>,
    free: BTreeSet<(u64, u64)>,
}

impl Segment {
    fn set_free(&mut self, at: u64, bytes: u64) {
        self.blocks.insert(at, (bytes, true));
        self.free.insert((bytes, at));
    }

    fn unset_free(&mut self, at: u64) -> u64 {
        let (bytes, _) = self.blocks.remove(&at).unwrap_or((0, false));
        self.free.remove(&(bytes, at));
        bytes
    }
}

/// PyTorch's allocator with expandable segments, modelled (see the module docs).
#[derive(Debug, Default)]
pub struct ExpandableModel {
    /// By (small pool, stream).
    segments: HashMap<(bool, u64), Segment>,
    /// Live blocks: address -> segment key.
    live: HashMap<u64, (bool, u64)>,
    reserved: u64,
    peak: u64,
}

impl ExpandableModel {
    /// An empty model.
    pub fn new() -> Self {
        Self::default()
    }

    /// Peak of the mapped bytes so far.
    pub fn peak(&self) -> u64 {
        self.peak
    }
}

impl TraceAllocator for ExpandableModel {
    fn alloc(&mut self, bytes: u64, stream: u64) -> Result<u64, String> {
        let size = bytes.max(1).div_ceil(MIN_BLOCK) * MIN_BLOCK;
        let small = size <= SMALL_SIZE;
        let page = if small { SMALL_PAGE } else { LARGE_PAGE };
        let n = self.segments.len() as u64;
        let seg = self
            .segments
            .entry((small, stream))
            .or_insert_with(|| Segment {
                base: (n + 1) * SEGMENT_SPAN,
                ..Segment::default()
            });
        // Best fit, except that a free block at the mapped end counts as large as it can
        // expand to: the next fitting block is taken if there is one (`get_free_block`).
        let end = seg.base + seg.mapped;
        let mut fits = seg.free.range((size, 0)..);
        let found = match fits.next().copied() {
            Some((b, a)) if a + b == end => fits.next().copied().or(Some((b, a))),
            other => other,
        };
        let (block, at) = match found {
            Some(f) => f,
            None => {
                // The free block ending at the mapped end, if any, joins the new pages.
                let last = seg
                    .blocks
                    .range(..end)
                    .next_back()
                    .filter(|(&a, &(b, free))| free && a + b == end)
                    .map(|(&a, &(b, _))| (a, b));
                let have = last.map_or(0, |l| l.1);
                let pages = (size - have).div_ceil(page) * page;
                seg.mapped += pages;
                self.reserved += pages;
                self.peak = self.peak.max(self.reserved);
                let (at, old) = last.unwrap_or((end, 0));
                if old > 0 {
                    seg.unset_free(at);
                }
                seg.set_free(at, old + pages);
                (old + pages, at)
            }
        };
        seg.unset_free(at);
        let rest = block - size;
        // With expandable segments both pools split off any remainder of 512 bytes or more
        // (`should_split`).
        if rest >= MIN_BLOCK {
            seg.blocks.insert(at, (size, false));
            seg.set_free(at + size, rest);
        } else {
            seg.blocks.insert(at, (block, false));
        }
        self.live.insert(at, (small, stream));
        Ok(at)
    }

    fn free(&mut self, ptr: u64, _bytes: u64, _stream: u64) -> Result<(), String> {
        let key = self
            .live
            .remove(&ptr)
            .ok_or_else(|| format!("free of {ptr:#x}, not live"))?;
        let seg = self
            .segments
            .get_mut(&key)
            .ok_or_else(|| format!("free of {ptr:#x}: no segment"))?;
        let (mut bytes, _) = seg.blocks.remove(&ptr).unwrap_or((0, false));
        let mut at = ptr;
        if let Some(&(next, true)) = seg.blocks.get(&(at + bytes)) {
            seg.unset_free(at + bytes);
            bytes += next;
        }
        let prev = seg.blocks.range(..at).next_back().map(|(&a, &v)| (a, v));
        if let Some((p, (pb, true))) = prev {
            if p + pb == at {
                seg.unset_free(p);
                at = p;
                bytes += pb;
            }
        }
        seg.set_free(at, bytes);
        Ok(())
    }

    fn reserved_bytes(&self) -> u64 {
        self.reserved
    }

    fn name(&self) -> String {
        "PyTorch expandable segments (model)".into()
    }

    fn peak_reserved_bytes(&self) -> Option<u64> {
        Some(self.peak)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn large_blocks_map_20_mib_pages_split_coalesce_and_spare_the_tail() {
        let mut m = ExpandableModel::new();
        let half = MIB / 2;
        let a = m.alloc(3 * MIB, 0).unwrap();
        assert_eq!(m.reserved_bytes(), 20 * MIB);
        // The free tail is the only fit: taken, the 1 MiB left split off.
        let b = m.alloc(16 * MIB, 0).unwrap();
        assert_eq!(b, a + 3 * MIB);
        // 1.5 MiB does not fit the 1 MiB tail: one more page, joined with it.
        let c = m.alloc(3 * half, 0).unwrap();
        assert_eq!((c, m.reserved_bytes()), (a + 19 * MIB, 40 * MIB));
        m.free(a, 0, 0).unwrap();
        // Best fit: the 3 MiB hole at the start, not the 19.5 MiB tail.
        let d = m.alloc(2 * MIB, 0).unwrap();
        assert_eq!(d, a);
        let x = m.alloc(29 * half, 0).unwrap();
        assert_eq!(x, c + 3 * half, "the tail, the only fit");
        // b freed merges with the 1 MiB hole before it (17 MiB); the tail has 5 MiB. A
        // 4 MiB request fits the tail best, but the tail is spared.
        m.free(b, 0, 0).unwrap();
        let y = m.alloc(4 * MIB, 0).unwrap();
        assert_eq!((y, m.reserved_bytes()), (a + 2 * MIB, 40 * MIB));
        // A small request has a segment of its own, in 2 MiB pages.
        m.alloc(4096, 0).unwrap();
        assert_eq!(m.reserved_bytes(), 42 * MIB);
        assert_eq!(m.peak_reserved_bytes(), Some(42 * MIB));
        assert!(m.free(12345, 0, 0).is_err());
    }
}
