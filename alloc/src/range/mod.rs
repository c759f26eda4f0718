//! A pure offset sub-allocator: best-fit, split, coalesce, `validate()`.
//!
//! `RangeAllocator` knows nothing of devices. It manages any number of disjoint *regions*
//! of a `u64` offset space (the pool uses one region per arena, at the arena's device
//! address) and hands out ranges inside them. Like VulkanMemoryAllocator's "virtual block",
//! it can be used alone, with no memory behind it.
//!
//! - **Best fit**: the smallest free range that fits; ties go to the lowest offset. The free
//!   index (`free_index.rs`) holds each tag's free ranges by size class (segregated fit, with
//!   a bitmap of the non-empty classes) and by (length, offset) inside a class: a search
//!   looks in the request's class, then takes the first range of the next non-empty one,
//!   O(log n) in the ranges of one class.
//! - **Split**: the allocation takes the front of the chosen range, the rest stays free.
//! - **Coalesce**: a freed range merges with free neighbours *of the same tag* in the same
//!   region. Ranges never merge across regions, even when two regions touch.
//! - **Tags**: every free range carries a `u64` tag and `alloc` asks for a tag. The pool tags
//!   free ranges with the stream they were freed on, so that a range is only reused on a
//!   stream where that is safe; [`RangeAllocator::retag`] moves ranges between tags once an
//!   event says the other stream finished with them.
//! - **Granule**: offsets and lengths are multiples of [`GRANULE`] (512 bytes, as PyTorch's
//!   caching allocator rounds); [`round_up`] rounds a request.
//!
//! **Layout.** Every range, allocated or free, is one entry of a hash map keyed by its start,
//! holding its length, state, the start of the range before it in its region and whether it
//! is the region's last (boundary tags, as in dlmalloc, kept beside the memory since device
//! memory cannot hold them). Neighbours are found by arithmetic and one hash lookup, never by
//! an ordered search: a free costs one to three hash lookups and one to three free-index
//! updates. Ordered walks (snapshots, validation, an interior pointer) follow the chain.
//!
//! [`RangeAllocator::validate`] walks the whole structure and checks every invariant; the
//! pool calls it after every operation in debug builds and the tests after every step.
#![forbid(unsafe_code)]

use std::collections::BTreeMap;

use rustc_hash::FxHashMap;

mod across_tags;
mod beside;
mod class_set;
mod free_index;
mod grow;
mod place;
mod split;
mod validate;

pub use beside::Beside;
use free_index::FreeIndex;

/// Offsets and lengths are multiples of this many bytes.
pub const GRANULE: u64 = 512;

/// Round `bytes` up to a multiple of [`GRANULE`]; `None` on overflow.
pub fn round_up(bytes: u64) -> Option<u64> {
    bytes.checked_add(GRANULE - 1).map(|b| b & !(GRANULE - 1))
}

/// Round `bytes` up to a multiple of `align` (a power of two); `None` on overflow.
pub fn round_up_to(bytes: u64, align: u64) -> Option<u64> {
    debug_assert!(align.is_power_of_two());
    bytes.checked_add(align - 1).map(|b| b & !(align - 1))
}

/// What went wrong in a call to the sub-allocator. Nothing changes when one is returned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RangeError {
    /// Offset or length not a multiple of [`GRANULE`], zero length, or overflow.
    #[error("offset {offset:#x} / length {len} not a non-zero multiple of {GRANULE} bytes")]
    Misaligned {
        /// The offset.
        offset: u64,
        /// The length.
        len: u64,
    },
    /// A new region overlaps an existing one.
    #[error("region [{offset:#x}, +{len}) overlaps an existing region")]
    Overlap {
        /// The offset.
        offset: u64,
        /// The length.
        len: u64,
    },
    /// No region starts at this offset.
    #[error("no region starts at {0:#x}")]
    NoSuchRegion(u64),
    /// The region still has allocations (or is split into differently tagged ranges).
    #[error("region at {0:#x} is not entirely free")]
    RegionInUse(u64),
    /// No allocation starts at this offset (never allocated, or already freed).
    #[error("no allocation starts at {0:#x}")]
    NotAllocated(u64),
    /// A range to place is not inside one free range ([`RangeAllocator::alloc_at`]).
    #[error("[{offset:#x}, +{len}) is not inside one free range")]
    NotFree {
        /// The offset.
        offset: u64,
        /// The length.
        len: u64,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Used,
    Free(u64),
}

/// `Block::prev` of a region's first range.
const NO_PREV: u64 = u64::MAX;

/// One range: allocated or free, with its links to its region neighbours.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Block {
    len: u64,
    state: State,
    /// Start of the range before this one in its region, [`NO_PREV`] for the first.
    prev: u64,
    /// The region's last range (the next range, if any, starts another region).
    last: bool,
}

/// A summary of the allocator's contents, cheap to compute.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct RangeStats {
    /// Number of regions.
    pub regions: u64,
    /// Bytes in all regions.
    pub region_bytes: u64,
    /// Bytes in allocated ranges.
    pub used_bytes: u64,
    /// Number of allocated ranges.
    pub used_ranges: u64,
    /// Number of free ranges.
    pub free_ranges: u64,
}

/// A range as reported by [`RangeAllocator::ranges`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct RangeInfo {
    /// First byte.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
    /// `None` for an allocated range, `Some(tag)` for a free one.
    pub free_tag: Option<u64>,
}

/// Best-fit sub-allocator over disjoint regions of a `u64` offset space. See the module docs.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct RangeAllocator {
    /// Region start -> length.
    regions: BTreeMap<u64, u64>,
    /// Every range, allocated or free, by start; together they tile the regions exactly.
    blocks: FxHashMap<u64, Block>,
    /// Free ranges by tag and size: the best-fit index, with the free bytes per tag.
    free_index: FreeIndex,
    used_bytes: u64,
    used_ranges: u64,
    /// Region end -> the start of the region's last range: growth finds an arena's tail
    /// without walking its ranges ([`RangeAllocator::put`] keeps it).
    last_at_end: FxHashMap<u64, u64>,
}

fn check_granule(offset: u64, len: u64) -> Result<(), RangeError> {
    if len == 0 || offset % GRANULE != 0 || len % GRANULE != 0 || offset.checked_add(len).is_none()
    {
        return Err(RangeError::Misaligned { offset, len });
    }
    Ok(())
}

impl RangeAllocator {
    /// An allocator with no regions.
    pub fn new() -> Self {
        Self::default()
    }

    /// Add the region `[offset, offset + len)`, entirely free under `tag`.
    pub fn add_region(&mut self, offset: u64, len: u64, tag: u64) -> Result<(), RangeError> {
        check_granule(offset, len)?;
        let end = offset + len;
        if let Some((&s, &l)) = self.regions.range(..end).next_back() {
            if s + l > offset {
                return Err(RangeError::Overlap { offset, len });
            }
        }
        self.regions.insert(offset, len);
        self.put(
            offset,
            Block {
                len,
                state: State::Free(tag),
                prev: NO_PREV,
                last: true,
            },
        );
        self.free_index.insert(tag, len, offset);
        Ok(())
    }

    /// Remove a region that is one free range (no allocations, one tag). Returns its length.
    pub fn remove_region(&mut self, offset: u64) -> Result<u64, RangeError> {
        let len = *self
            .regions
            .get(&offset)
            .ok_or(RangeError::NoSuchRegion(offset))?;
        match self.blocks.get(&offset) {
            Some(&Block {
                len: l,
                state: State::Free(tag),
                ..
            }) if l == len => {
                self.blocks.remove(&offset);
                self.free_index.remove(tag, len, offset);
                self.regions.remove(&offset);
                self.last_at_end.remove(&(offset + len));
                Ok(len)
            }
            _ => Err(RangeError::RegionInUse(offset)),
        }
    }

    /// Whether the region starting at `offset` has no allocated range.
    pub fn region_is_unused(&self, offset: u64) -> bool {
        self.regions.contains_key(&offset)
            && self
                .chain(offset)
                .all(|(_, b)| !matches!(b.state, State::Used))
    }

    /// Allocate `len` bytes (a non-zero [`GRANULE`] multiple) from free ranges tagged `tag`:
    /// best fit, lowest offset among equal fits. Returns the offset, or `None` if nothing fits.
    pub fn alloc(&mut self, len: u64, tag: u64) -> Option<u64> {
        if len == 0 || len % GRANULE != 0 {
            return None;
        }
        let (flen, offset) = self.free_index.take_best_fit(tag, len)?;
        self.carve(offset, flen, len, tag)
    }

    /// Allocate `len` bytes at `offset`, the start of a free range of `flen` bytes under
    /// `tag` just taken from the free index; the rest stays free under `tag`.
    fn carve(&mut self, offset: u64, flen: u64, len: u64, tag: u64) -> Option<u64> {
        let b = self.blocks.get_mut(&offset)?;
        b.len = len;
        b.state = State::Used;
        if flen > len {
            // The remainder cannot have a free same-tag neighbour after it: it was part of a
            // coalesced range, so inserting it directly keeps the invariants.
            let last = std::mem::replace(&mut b.last, false);
            let rest = offset + len;
            self.put(
                rest,
                Block {
                    len: flen - len,
                    state: State::Free(tag),
                    prev: offset,
                    last,
                },
            );
            if !last {
                self.set_prev(offset + flen, rest);
            }
            self.free_index.insert(tag, flen - len, rest);
        }
        self.used_bytes += len;
        self.used_ranges += 1;
        Some(offset)
    }

    /// The largest free range under `tag`, in bytes (0 when none).
    pub fn largest_free(&self, tag: u64) -> u64 {
        self.free_index.largest(tag)
    }

    /// Length of the allocated range starting at `offset`, if there is one.
    pub fn allocated_len(&self, offset: u64) -> Option<u64> {
        match self.blocks.get(&offset) {
            Some(Block {
                len,
                state: State::Used,
                ..
            }) => Some(*len),
            _ => None,
        }
    }

    /// The allocated range containing `offset`, as `(start, len)`. A range's own start is
    /// one lookup. An interior offset (a share of a view) runs three searches in lockstep
    /// and stops at the first that lands: the region's ranges in order from its start (few
    /// ranges), granule probes down from `offset` (the first start met is the containing
    /// range's) and up from it (the next range links to the containing one): a short walk
    /// when the region holds few ranges or the containing one is short, a few thousand
    /// lookups at worst for a long range behind many short ones.
    pub fn allocated_containing(&self, offset: u64) -> Option<(u64, u64)> {
        let used = |start: u64, b: &Block| (b.state == State::Used).then_some((start, b.len));
        if let Some(b) = self.blocks.get(&offset) {
            return used(offset, b);
        }
        let (&region, &rlen) = self.regions.range(..=offset).next_back()?;
        let end = region + rlen;
        if offset >= end {
            return None;
        }
        let mut chain = Some(region);
        let mut down = Some(offset & !(GRANULE - 1));
        let mut up = (offset & !(GRANULE - 1)) + GRANULE;
        loop {
            if let Some(at) = chain {
                let b = self.blocks.get(&at)?;
                if offset < at + b.len {
                    return used(at, b);
                }
                chain = (!b.last).then_some(at + b.len);
            }
            if let Some(at) = down {
                if let Some(b) = self.blocks.get(&at) {
                    return used(at, b);
                }
                down = (at > region).then(|| at - GRANULE);
            }
            if up < end {
                if let Some(next) = self.blocks.get(&up) {
                    let b = self.blocks.get(&next.prev)?;
                    return used(next.prev, b);
                }
                up += GRANULE;
            }
            if chain.is_none() && down.is_none() && up >= end {
                return None;
            }
        }
    }

    /// Free the allocation starting at `offset`, tagging the range `tag`, and merge it with
    /// free neighbours of the same tag in its region. Returns the freed length.
    pub fn free(&mut self, offset: u64, tag: u64) -> Result<u64, RangeError> {
        self.free_taking_in(offset, tag, &[])
    }

    /// Free many allocations under one `tag` at once: the same result as freeing them one
    /// by one, cheaper when they are neighbours (a run of adjacent allocations becomes one
    /// free range with one index update). Offsets that are not allocated are skipped and
    /// returned. `offsets` is sorted in place.
    pub fn free_many(&mut self, offsets: &mut [u64], tag: u64) -> Vec<u64> {
        offsets.sort_unstable();
        let mut skipped = Vec::new();
        // The current run: its start, length, the first range's `prev`, the last one's
        // `last`, and whether it joined several ranges.
        let mut run: Option<(u64, u64, u64, bool, bool)> = None;
        for &off in offsets.iter() {
            let b = match self.blocks.get(&off) {
                Some(b) if b.state == State::Used => *b,
                _ => {
                    skipped.push(off);
                    continue;
                }
            };
            self.used_bytes -= b.len;
            self.used_ranges -= 1;
            run = match run {
                // Extend the run when `off` follows it in the same region.
                Some((start, rlen, prev, last, _)) if !last && start + rlen == off => {
                    self.blocks.remove(&off);
                    Some((start, rlen + b.len, prev, b.last, true))
                }
                Some((start, rlen, prev, last, joined)) => {
                    self.insert_free(start, rlen, prev, last, tag, joined);
                    // That merge may have relinked `off` (a free range between them joined).
                    let prev = self.blocks.get(&off).map_or(b.prev, |x| x.prev);
                    Some((off, b.len, prev, b.last, false))
                }
                None => Some((off, b.len, b.prev, b.last, false)),
            };
        }
        if let Some((start, rlen, prev, last, joined)) = run {
            self.insert_free(start, rlen, prev, last, tag, joined);
        }
        skipped
    }

    /// Move every free range tagged `from` to `to`, merging where that joins neighbours.
    /// Returns the number of bytes moved.
    pub fn retag(&mut self, from: u64, to: u64) -> u64 {
        if from == to {
            return 0;
        }
        let moving = self.free_index.ranges_of(from);
        let mut bytes = 0;
        for (off, len) in moving {
            let Some(&b) = self.blocks.get(&off) else {
                continue;
            };
            if b.state == State::Free(from) && b.len == len {
                self.free_index.remove(from, len, off);
                self.insert_free(off, len, b.prev, b.last, to, false);
                bytes += len;
            }
        }
        bytes
    }

    /// Tags that currently have free ranges, with their free bytes, by tag.
    pub fn free_tags(&self) -> Vec<(u64, u64)> {
        let mut out: Vec<(u64, u64)> = self.free_index.tag_bytes().collect();
        out.sort_unstable();
        out
    }

    /// Free bytes under the tags in `tags`, without listing them.
    pub fn free_bytes_in(&self, tags: std::ops::RangeInclusive<u64>) -> u64 {
        self.free_index
            .tag_bytes()
            .filter(|(t, _)| tags.contains(t))
            .map(|(_, b)| b)
            .sum()
    }

    /// Cheap counters.
    pub fn stats(&self) -> RangeStats {
        RangeStats {
            regions: self.regions.len() as u64,
            region_bytes: self.regions.values().sum(),
            used_bytes: self.used_bytes,
            used_ranges: self.used_ranges,
            free_ranges: self.free_index.len(),
        }
    }

    /// Every range of the region starting at `region`, in address order (for snapshots).
    pub fn ranges(&self, region: u64) -> Vec<RangeInfo> {
        if !self.regions.contains_key(&region) {
            return Vec::new();
        }
        self.chain(region)
            .map(|(offset, b)| RangeInfo {
                offset,
                len: b.len,
                free_tag: match b.state {
                    State::Used => None,
                    State::Free(t) => Some(t),
                },
            })
            .collect()
    }

    /// The ranges of the region starting at `region`, in address order, following the
    /// links (stops early if they are broken; `validate` reports that).
    fn chain(&self, region: u64) -> impl Iterator<Item = (u64, Block)> + '_ {
        let mut at = Some(region);
        std::iter::from_fn(move || {
            let start = at?;
            let b = *self.blocks.get(&start)?;
            at = (!b.last).then_some(start + b.len);
            Some((start, b))
        })
    }

    /// Record range `b` at `start` (replacing any range there); the last range of a region
    /// is also recorded by the region's end.
    #[inline]
    fn put(&mut self, start: u64, b: Block) {
        if b.last {
            self.last_at_end.insert(start + b.len, start);
        }
        self.blocks.insert(start, b);
    }

    fn set_prev(&mut self, start: u64, prev: u64) {
        if let Some(n) = self.blocks.get_mut(&start) {
            n.prev = prev;
        }
    }

    /// Make `[offset, offset + len)` one free range under `tag`, merged with free same-tag
    /// neighbours in its region. `prev` and `last` are the links of the span (those of its
    /// first and last range). The span's own entries must be gone except the one at
    /// `offset`, which is replaced; it must not be in the free index. `joined`: the span
    /// was several ranges (the one after it links to the last of them).
    fn insert_free(
        &mut self,
        offset: u64,
        len: u64,
        prev: u64,
        last: bool,
        tag: u64,
        joined: bool,
    ) {
        self.insert_free_taking_in(offset, len, prev, last, tag, joined, &[]);
    }

    /// [`Self::insert_free`], merging also with free neighbours whose tag is in `from`
    /// (retagged `tag`), and with what lies beyond them while it is free under `tag` or one
    /// of `from` (`across_tags.rs`; with `from` empty, one neighbour a side at most: two
    /// free ranges of one tag are never neighbours).
    #[allow(clippy::too_many_arguments)]
    fn insert_free_taking_in(
        &mut self,
        offset: u64,
        len: u64,
        mut prev: u64,
        mut last: bool,
        tag: u64,
        joined: bool,
        from: &[u64],
    ) {
        let merges =
            |state: State| matches!(state, State::Free(t) if t == tag || from.contains(&t));
        let (mut start, mut total) = (offset, len);
        while prev != NO_PREV {
            let Some(&p) = self.blocks.get(&prev) else {
                break;
            };
            let State::Free(t) = p.state else {
                break;
            };
            if !merges(p.state) {
                break;
            }
            self.free_index.remove(t, p.len, prev);
            self.blocks.remove(&start);
            start = prev;
            total += p.len;
            prev = p.prev;
        }
        let mut next_moved = joined || start != offset;
        while !last {
            let next = start + total;
            let Some(&n) = self.blocks.get(&next) else {
                break;
            };
            let State::Free(t) = n.state else {
                break;
            };
            if !merges(n.state) {
                break;
            }
            self.free_index.remove(t, n.len, next);
            self.blocks.remove(&next);
            total += n.len;
            last = n.last;
            next_moved = true;
        }
        self.put(
            start,
            Block {
                len: total,
                state: State::Free(tag),
                prev,
                last,
            },
        );
        if next_moved && !last {
            self.set_prev(start + total, start);
        }
        self.free_index.insert(tag, total, start);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn rounding_table() {
        for (input, want) in [
            (1, 512),
            (511, 512),
            (512, 512),
            (513, 1024),
            (2 * MIB, 2 * MIB),
        ] {
            assert_eq!(round_up(input), Some(want), "round_up({input})");
        }
        assert_eq!(round_up(u64::MAX), None);
        assert_eq!(round_up_to(3 * MIB, 2 * MIB), Some(4 * MIB));
    }

    #[test]
    fn fill_free_all_restores_one_range() {
        let mut r = RangeAllocator::new();
        r.add_region(0, 64 * MIB, 0).unwrap();
        let offs: Vec<u64> = (0..32).map(|_| r.alloc(2 * MIB, 0).unwrap()).collect();
        assert_eq!(r.alloc(512, 0), None, "full");
        for (i, o) in offs.iter().enumerate() {
            assert_eq!(*o, i as u64 * 2 * MIB, "lowest offset first");
        }
        // Free in a scrambled order.
        for i in (0..32).step_by(2).chain((1..32).step_by(2)) {
            r.free(offs[i], 0).unwrap();
            r.validate().unwrap();
        }
        assert_eq!(
            r.ranges(0),
            vec![RangeInfo {
                offset: 0,
                len: 64 * MIB,
                free_tag: Some(0)
            }]
        );
        assert_eq!(r.remove_region(0), Ok(64 * MIB));
        assert_eq!(r.stats(), RangeStats::default());
    }

    #[test]
    fn best_fit_picks_the_smallest_hole() {
        let mut r = RangeAllocator::new();
        r.add_region(0, 16 * MIB, 0).unwrap();
        let a = r.alloc(4 * MIB, 0).unwrap();
        let _b = r.alloc(MIB, 0).unwrap();
        let c = r.alloc(MIB, 0).unwrap();
        let _d = r.alloc(MIB, 0).unwrap();
        r.free(a, 0).unwrap(); // 4 MiB hole at 0
        r.free(c, 0).unwrap(); // 1 MiB hole at 5 MiB; 9 MiB tail at 7 MiB
        assert_eq!(r.alloc(MIB, 0), Some(5 * MIB));
        assert_eq!(r.alloc(3 * MIB, 0), Some(0));
        r.validate().unwrap();
    }

    #[test]
    fn regions_never_merge_even_when_adjacent() {
        let mut r = RangeAllocator::new();
        r.add_region(0, 4 * MIB, 0).unwrap();
        r.add_region(4 * MIB, 4 * MIB, 0).unwrap();
        assert_eq!(r.alloc(6 * MIB, 0), None);
        let a = r.alloc(4 * MIB, 0).unwrap();
        let b = r.alloc(4 * MIB, 0).unwrap();
        r.free(a, 0).unwrap();
        r.free(b, 0).unwrap();
        r.validate().unwrap();
        assert_eq!(r.stats().free_ranges, 2);
        assert_eq!(
            r.add_region(2 * MIB, 4 * MIB, 0),
            Err(RangeError::Overlap {
                offset: 2 * MIB,
                len: 4 * MIB
            })
        );
    }

    #[test]
    fn tags_separate_until_retagged() {
        let mut r = RangeAllocator::new();
        r.add_region(0, 8 * MIB, 0).unwrap();
        let a = r.alloc(4 * MIB, 0).unwrap();
        let b = r.alloc(4 * MIB, 0).unwrap();
        r.free(a, 7).unwrap();
        r.free(b, 9).unwrap();
        assert_eq!(r.alloc(MIB, 0), None, "tag 0 has nothing free");
        assert_eq!(r.free_tags(), vec![(7, 4 * MIB), (9, 4 * MIB)]);
        assert_eq!(r.free_bytes_in(7..=9), 8 * MIB);
        assert_eq!(r.free_bytes_in(8..=u64::MAX), 4 * MIB);
        assert!(r.region_is_unused(0));
        assert_eq!(r.remove_region(0), Err(RangeError::RegionInUse(0)));
        assert_eq!(r.retag(7, 0), 4 * MIB);
        assert_eq!(r.retag(9, 0), 4 * MIB);
        r.validate().unwrap();
        assert_eq!(r.largest_free(0), 8 * MIB);
        assert_eq!(r.remove_region(0), Ok(8 * MIB));
    }

    #[test]
    fn bad_calls_change_nothing() {
        let mut r = RangeAllocator::new();
        assert!(r.add_region(100, 4096, 0).is_err());
        assert!(r.add_region(0, 0, 0).is_err());
        assert!(r.add_region(u64::MAX - 511, 1024, 0).is_err());
        r.add_region(0, 4096, 0).unwrap();
        let a = r.alloc(1024, 0).unwrap();
        let before = r.clone();
        assert_eq!(r.free(a + 512, 0), Err(RangeError::NotAllocated(a + 512)));
        assert_eq!(r, before, "a rejected free changes nothing");
        r.free(a, 0).unwrap();
        assert_eq!(
            r.free(a, 0),
            Err(RangeError::NotAllocated(a)),
            "double free"
        );
        assert_eq!(r.alloc(0, 0), None);
        assert_eq!(r.alloc(100, 0), None);
        assert_eq!(r.remove_region(512), Err(RangeError::NoSuchRegion(512)));
        r.validate().unwrap();
    }

    #[test]
    fn allocated_containing_agrees_with_a_walk_of_the_ranges() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for round in 0..20 {
            let mut r = RangeAllocator::new();
            let regions = [(0, 64 * MIB), (64 * MIB, 16 * MIB), (200 * MIB, 8 * MIB)];
            for &(start, len) in &regions {
                r.add_region(start, len, 0).unwrap();
            }
            let mut live = Vec::new();
            for _ in 0..400 {
                // Mostly short ranges, some long: both kinds of walk get exercised.
                let granules = if rng.gen_bool(0.1) {
                    rng.gen_range(1..8192)
                } else {
                    rng.gen_range(1..16)
                };
                if let Some(off) = r.alloc(granules * GRANULE, 0) {
                    live.push(off);
                }
                if !live.is_empty() && rng.gen_bool(0.3) {
                    let off = live.swap_remove(rng.gen_range(0..live.len()));
                    r.free(off, rng.gen_range(0..2)).unwrap();
                }
            }
            r.validate().unwrap();
            let all: Vec<RangeInfo> = regions.iter().flat_map(|&(s, _)| r.ranges(s)).collect();
            for _ in 0..2000 {
                let offset = rng.gen_range(0..210 * MIB);
                let want = all
                    .iter()
                    .find(|x| x.offset <= offset && offset < x.offset + x.len)
                    .filter(|x| x.free_tag.is_none())
                    .map(|x| (x.offset, x.len));
                assert_eq!(
                    r.allocated_containing(offset),
                    want,
                    "round {round}, offset {offset:#x}"
                );
            }
        }
    }
}
