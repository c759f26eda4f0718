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
//! **Layout.** Every range, allocated or free, is one block of a slab (boundary tags, as in
//! dlmalloc, kept beside the memory since device memory cannot hold them): its start,
//! length, state and the slots of the ranges before and after it in its region. One hash
//! map leads from a range's start to its slot; neighbours are one slot away, never a search.
//! A split keeps the slot for the part after the cut and a merge keeps the last range's
//! slot, so a region's last range keeps its slot until the region grows, shrinks or is
//! split: an allocation is one or two map operations, a free one to four, and each one or
//! two free-index updates (`coalesce.rs`). Ordered walks (snapshots, validation, an interior
//! pointer) follow the links from the region's first range.
//!
//! [`RangeAllocator::validate`] walks the whole structure and checks every invariant; the
//! pool calls it after every operation in debug builds and the tests after every step.
#![forbid(unsafe_code)]

use std::collections::BTreeMap;

use rustc_hash::FxHashMap;
use slab::Slab;

mod across_tags;
mod beside;
mod class_set;
mod coalesce;
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

/// The key of a block in [`RangeAllocator::blocks`].
type Slot = usize;

/// No block: `Block::prev` of a region's first range, `Block::next` of its last.
const NIL: Slot = usize::MAX;

/// One range: allocated or free, with the slots of its region neighbours.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Block {
    start: u64,
    len: u64,
    state: State,
    /// The range before this one in its region, [`NIL`] for the first.
    prev: Slot,
    /// The range after this one in its region, [`NIL`] for the last.
    next: Slot,
}

impl Block {
    fn end(&self) -> u64 {
        self.start + self.len
    }

    fn is_last(&self) -> bool {
        self.next == NIL
    }
}

/// One region: its length and the slot of its last range (growth finds an arena's tail
/// without walking its ranges).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Region {
    len: u64,
    last: Slot,
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
#[derive(Debug, Default, Clone)]
pub struct RangeAllocator {
    /// Region start -> its length and last range.
    regions: BTreeMap<u64, Region>,
    /// Every range, allocated or free; together they tile the regions exactly.
    blocks: Slab<Block>,
    /// Each range's start -> its slot in `blocks`.
    starts: FxHashMap<u64, Slot>,
    /// Free ranges by tag and size: the best-fit index, with the free bytes per tag.
    free_index: FreeIndex,
    used_bytes: u64,
    used_ranges: u64,
}

/// Equal when they hold the same regions and ranges (whatever slots those sit in).
impl PartialEq for RangeAllocator {
    fn eq(&self, other: &Self) -> bool {
        self.stats() == other.stats()
            && self.free_index == other.free_index
            && self.regions.len() == other.regions.len()
            && self
                .regions
                .iter()
                .zip(&other.regions)
                .all(|((a, ra), (b, rb))| {
                    a == b && ra.len == rb.len && self.ranges(*a) == other.ranges(*b)
                })
    }
}

impl Eq for RangeAllocator {}

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
        if let Some((&s, r)) = self.regions.range(..end).next_back() {
            if s + r.len > offset {
                return Err(RangeError::Overlap { offset, len });
            }
        }
        let slot = self.new_block(offset, len, State::Free(tag), NIL, NIL);
        self.regions.insert(offset, Region { len, last: slot });
        self.free_index.insert(tag, len, offset);
        Ok(())
    }

    /// Remove a region that is one free range (no allocations, one tag). Returns its length.
    pub fn remove_region(&mut self, offset: u64) -> Result<u64, RangeError> {
        let region = *self
            .regions
            .get(&offset)
            .ok_or(RangeError::NoSuchRegion(offset))?;
        let slot = region.last;
        match self.blocks.get(slot) {
            Some(&Block {
                start,
                len,
                state: State::Free(tag),
                ..
            }) if start == offset && len == region.len => {
                self.drop_block(slot);
                self.free_index.remove(tag, len, offset);
                self.regions.remove(&offset);
                Ok(len)
            }
            _ => Err(RangeError::RegionInUse(offset)),
        }
    }

    /// Whether the region starting at `offset` has no allocated range.
    pub fn region_is_unused(&self, offset: u64) -> bool {
        self.regions.contains_key(&offset) && self.chain(offset).all(|b| b.state != State::Used)
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
    /// `tag` just taken from the free index; the rest stays free under `tag`, in the free
    /// range's slot (so a region's last range keeps its slot).
    fn carve(&mut self, offset: u64, flen: u64, len: u64, tag: u64) -> Option<u64> {
        let entry = self.starts.get_mut(&offset)?;
        let slot = *entry;
        if flen > len {
            // The remainder cannot have a free same-tag neighbour after it: it was part of a
            // coalesced range, so inserting it directly keeps the invariants.
            let prev = self.blocks[slot].prev;
            let front = self.blocks.insert(Block {
                start: offset,
                len,
                state: State::Used,
                prev,
                next: slot,
            });
            *entry = front;
            if prev != NIL {
                self.blocks[prev].next = front;
            }
            let rest = &mut self.blocks[slot];
            rest.start = offset + len;
            rest.len = flen - len;
            rest.prev = front;
            self.starts.insert(offset + len, slot);
            self.free_index.insert(tag, flen - len, offset + len);
        } else {
            self.blocks[slot].state = State::Used;
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
        self.block_at(offset)
            .filter(|b| b.state == State::Used)
            .map(|b| b.len)
    }

    /// The allocated range containing `offset`, as `(start, len)`. A range's own start is
    /// one lookup. An interior offset (a share of a view) runs three searches in lockstep
    /// and stops at the first that lands: the region's ranges in order from its start (few
    /// ranges), granule probes down from `offset` (the first start met is the containing
    /// range's) and up from it (the next range links to the containing one): a short walk
    /// when the region holds few ranges or the containing one is short, a few thousand
    /// lookups at worst for a long range behind many short ones.
    pub fn allocated_containing(&self, offset: u64) -> Option<(u64, u64)> {
        let used = |b: &Block| (b.state == State::Used).then_some((b.start, b.len));
        if let Some(b) = self.block_at(offset) {
            return used(b);
        }
        let (&region, r) = self.regions.range(..=offset).next_back()?;
        let end = region + r.len;
        if offset >= end {
            return None;
        }
        let mut chain = self.starts.get(&region).copied();
        let mut down = Some(offset & !(GRANULE - 1));
        let mut up = (offset & !(GRANULE - 1)) + GRANULE;
        loop {
            if let Some(at) = chain {
                let b = self.blocks.get(at)?;
                if offset < b.end() {
                    return used(b);
                }
                chain = (!b.is_last()).then_some(b.next);
            }
            if let Some(at) = down {
                if let Some(b) = self.block_at(at) {
                    return used(b);
                }
                down = (at > region).then(|| at - GRANULE);
            }
            if up < end {
                if let Some(next) = self.block_at(up) {
                    return used(self.blocks.get(next.prev)?);
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
    /// free range with one index update). Offsets that are not allocated, and repeats of an
    /// offset, are skipped and returned. `offsets` is sorted in place.
    pub fn free_many(&mut self, offsets: &mut [u64], tag: u64) -> Vec<u64> {
        offsets.sort_unstable();
        let mut skipped = Vec::new();
        // The current run of neighbouring allocations: its first and last slots.
        let mut run: Option<(Slot, Slot)> = None;
        let mut previous = None;
        for &off in offsets.iter() {
            let repeat = previous == Some(off);
            previous = Some(off);
            let slot = match self.starts.get(&off) {
                Some(&s) if self.blocks[s].state == State::Used && !repeat => s,
                _ => {
                    skipped.push(off);
                    continue;
                }
            };
            self.used_bytes -= self.blocks[slot].len;
            self.used_ranges -= 1;
            run = match run {
                // Extend the run when `off` follows it in the same region.
                Some((first, last)) if self.blocks[last].next == slot => Some((first, slot)),
                Some((first, last)) => {
                    let joined = self.join(first, last);
                    self.insert_free(joined, tag, &[]);
                    Some((slot, slot))
                }
                None => Some((slot, slot)),
            };
        }
        if let Some((first, last)) = run {
            let joined = self.join(first, last);
            self.insert_free(joined, tag, &[]);
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
            let Some(&slot) = self.starts.get(&off) else {
                continue;
            };
            let b = self.blocks[slot];
            if b.state == State::Free(from) && b.len == len {
                self.free_index.remove(from, len, off);
                self.insert_free(slot, to, &[]);
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
            region_bytes: self.regions.values().map(|r| r.len).sum(),
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
            .map(|b| RangeInfo {
                offset: b.start,
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
    fn chain(&self, region: u64) -> impl Iterator<Item = Block> + '_ {
        self.chain_slots(region).map(|(_, b)| b)
    }

    /// [`Self::chain`] with each range's slot.
    fn chain_slots(&self, region: u64) -> impl Iterator<Item = (Slot, Block)> + '_ {
        let mut at = self.starts.get(&region).copied().unwrap_or(NIL);
        std::iter::from_fn(move || {
            let slot = at;
            let b = *self.blocks.get(slot)?;
            at = b.next;
            Some((slot, b))
        })
    }

    /// The range starting at `start`, if one does.
    fn block_at(&self, start: u64) -> Option<&Block> {
        self.starts.get(&start).and_then(|&s| self.blocks.get(s))
    }

    /// A new block, recorded by its start.
    fn new_block(&mut self, start: u64, len: u64, state: State, prev: Slot, next: Slot) -> Slot {
        let slot = self.blocks.insert(Block {
            start,
            len,
            state,
            prev,
            next,
        });
        self.starts.insert(start, slot);
        slot
    }

    /// Make the range in `next` follow the one in `prev` (either may be [`NIL`]).
    fn link(&mut self, prev: Slot, next: Slot) {
        if prev != NIL {
            self.blocks[prev].next = next;
        }
        if next != NIL {
            self.blocks[next].prev = prev;
        }
    }

    /// Remove a block and its start's record (its neighbours' links are the caller's).
    fn drop_block(&mut self, slot: Slot) -> Block {
        let b = self.blocks.remove(slot);
        self.starts.remove(&b.start);
        b
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
    fn free_many_skips_what_is_not_allocated_and_repeats() {
        let mut r = RangeAllocator::new();
        r.add_region(0, 16 * MIB, 0).unwrap();
        let offs: Vec<u64> = (0..8).map(|_| r.alloc(MIB, 0).unwrap()).collect();
        r.free(offs[5], 0).unwrap();
        // Neighbours 0-2 (a run), 4 twice, 5 already free, one never allocated.
        let mut batch = vec![
            offs[2],
            offs[4],
            offs[0],
            offs[4],
            offs[1],
            offs[5],
            100 * MIB,
        ];
        let skipped = r.free_many(&mut batch, 0);
        r.validate().unwrap();
        assert_eq!(skipped, vec![offs[4], offs[5], 100 * MIB]);
        assert_eq!(r.stats().used_ranges, 3, "3, 6 and 7 stay allocated");
        assert_eq!(
            r.largest_free(0),
            8 * MIB,
            "the tail and 4-5 are free, 0-2 one range"
        );
        for &o in &[offs[3], offs[6], offs[7]] {
            r.free(o, 0).unwrap();
        }
        r.validate().unwrap();
        assert_eq!(r.remove_region(0), Ok(16 * MIB));
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
