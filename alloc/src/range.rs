//! A pure offset sub-allocator: best-fit, split, coalesce, `validate()`.
//!
//! `RangeAllocator` knows nothing of devices. It manages any number of disjoint *regions*
//! of a `u64` offset space (the pool uses one region per arena, at the arena's device
//! address) and hands out ranges inside them. Like VulkanMemoryAllocator's "virtual block",
//! it can be used alone, with no memory behind it.
//!
//! - **Best fit**: the smallest free range that fits; ties go to the lowest offset. One
//!   `BTreeSet` lookup, so alloc and free are O(log n) in the number of ranges.
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
//! [`RangeAllocator::validate`] walks the whole structure and checks every invariant; the
//! pool calls it after every operation in debug builds and the tests after every step.
#![forbid(unsafe_code)]

use std::collections::{BTreeMap, BTreeSet};

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
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Used,
    Free(u64),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Block {
    len: u64,
    state: State,
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
    /// Every range, allocated or free, by offset; together they tile the regions exactly.
    blocks: BTreeMap<u64, Block>,
    /// Free ranges by (tag, length, offset): the best-fit index.
    free_index: BTreeSet<(u64, u64, u64)>,
    used_bytes: u64,
    used_ranges: u64,
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
        self.insert_free(offset, len, tag);
        Ok(())
    }

    /// Remove a region that is one free range (no allocations, one tag). Returns its length.
    pub fn remove_region(&mut self, offset: u64) -> Result<u64, RangeError> {
        let len = *self
            .regions
            .get(&offset)
            .ok_or(RangeError::NoSuchRegion(offset))?;
        match self.blocks.get(&offset) {
            Some(Block {
                len: l,
                state: State::Free(tag),
            }) if *l == len => {
                let tag = *tag;
                self.remove_free(offset, len, tag);
                self.regions.remove(&offset);
                Ok(len)
            }
            _ => Err(RangeError::RegionInUse(offset)),
        }
    }

    /// Whether the region starting at `offset` has no allocated range.
    pub fn region_is_unused(&self, offset: u64) -> bool {
        let Some(&len) = self.regions.get(&offset) else {
            return false;
        };
        self.blocks
            .range(offset..offset + len)
            .all(|(_, b)| b.state != State::Used)
    }

    /// Allocate `len` bytes (a non-zero [`GRANULE`] multiple) from free ranges tagged `tag`:
    /// best fit, lowest offset among equal fits. Returns the offset, or `None` if nothing fits.
    pub fn alloc(&mut self, len: u64, tag: u64) -> Option<u64> {
        if len == 0 || len % GRANULE != 0 {
            return None;
        }
        let &(_, flen, offset) = self
            .free_index
            .range((tag, len, 0)..=(tag, u64::MAX, u64::MAX))
            .next()?;
        self.free_index.remove(&(tag, flen, offset));
        self.blocks.insert(
            offset,
            Block {
                len,
                state: State::Used,
            },
        );
        if flen > len {
            // The remainder cannot have a free same-tag neighbour after it: it was part of a
            // coalesced range, so inserting it directly keeps the invariants.
            let rest = offset + len;
            self.blocks.insert(
                rest,
                Block {
                    len: flen - len,
                    state: State::Free(tag),
                },
            );
            self.free_index.insert((tag, flen - len, rest));
        }
        self.used_bytes += len;
        self.used_ranges += 1;
        Some(offset)
    }

    /// The largest free range under `tag`, in bytes (0 when none).
    pub fn largest_free(&self, tag: u64) -> u64 {
        self.free_index
            .range((tag, 0, 0)..=(tag, u64::MAX, u64::MAX))
            .next_back()
            .map_or(0, |&(_, len, _)| len)
    }

    /// Length of the allocated range starting at `offset`, if there is one.
    pub fn allocated_len(&self, offset: u64) -> Option<u64> {
        match self.blocks.get(&offset) {
            Some(Block {
                len,
                state: State::Used,
            }) => Some(*len),
            _ => None,
        }
    }

    /// The allocated range containing `offset`, as `(start, len)`.
    pub fn allocated_containing(&self, offset: u64) -> Option<(u64, u64)> {
        let (&start, b) = self.blocks.range(..=offset).next_back()?;
        (b.state == State::Used && offset < start + b.len).then_some((start, b.len))
    }

    /// Free the allocation starting at `offset`, tagging the range `tag`, and merge it with
    /// free neighbours of the same tag in its region. Returns the freed length.
    pub fn free(&mut self, offset: u64, tag: u64) -> Result<u64, RangeError> {
        let len = self
            .allocated_len(offset)
            .ok_or(RangeError::NotAllocated(offset))?;
        self.blocks.remove(&offset);
        self.used_bytes -= len;
        self.used_ranges -= 1;
        self.insert_free(offset, len, tag);
        Ok(len)
    }

    /// Free many allocations under one `tag` at once: the same result as freeing them one
    /// by one, cheaper when they are neighbours (a run of adjacent allocations becomes one
    /// free range with one index update). Offsets that are not allocated are skipped and
    /// returned. `offsets` is sorted in place.
    pub fn free_many(&mut self, offsets: &mut [u64], tag: u64) -> Vec<u64> {
        offsets.sort_unstable();
        let mut skipped = Vec::new();
        let mut run: Option<(u64, u64)> = None; // (start, len) of the current run
        for &off in offsets.iter() {
            let Some(len) = self.allocated_len(off) else {
                skipped.push(off);
                continue;
            };
            self.blocks.remove(&off);
            self.used_bytes -= len;
            self.used_ranges -= 1;
            run = match run {
                // Extend the run unless `off` starts a region (runs never cross regions).
                Some((start, rlen)) if start + rlen == off && !self.regions.contains_key(&off) => {
                    Some((start, rlen + len))
                }
                Some((start, rlen)) => {
                    self.insert_free(start, rlen, tag);
                    Some((off, len))
                }
                None => Some((off, len)),
            };
        }
        if let Some((start, rlen)) = run {
            self.insert_free(start, rlen, tag);
        }
        skipped
    }

    /// Move every free range tagged `from` to `to`, merging where that joins neighbours.
    /// Returns the number of bytes moved.
    pub fn retag(&mut self, from: u64, to: u64) -> u64 {
        if from == to {
            return 0;
        }
        let moving: Vec<(u64, u64)> = self
            .free_index
            .range((from, 0, 0)..=(from, u64::MAX, u64::MAX))
            .map(|&(_, len, off)| (off, len))
            .collect();
        let mut bytes = 0;
        for (off, len) in moving {
            // An earlier merge in this loop may have absorbed this range already.
            if self.free_index.remove(&(from, len, off)) {
                self.blocks.remove(&off);
                self.insert_free(off, len, to);
                bytes += len;
            }
        }
        bytes
    }

    /// Tags that currently have free ranges, with their free bytes.
    pub fn free_tags(&self) -> Vec<(u64, u64)> {
        let mut out: Vec<(u64, u64)> = Vec::new();
        for &(tag, len, _) in &self.free_index {
            match out.last_mut() {
                Some((t, b)) if *t == tag => *b += len,
                _ => out.push((tag, len)),
            }
        }
        out
    }

    /// Cheap counters.
    pub fn stats(&self) -> RangeStats {
        RangeStats {
            regions: self.regions.len() as u64,
            region_bytes: self.regions.values().sum(),
            used_bytes: self.used_bytes,
            used_ranges: self.used_ranges,
            free_ranges: self.free_index.len() as u64,
        }
    }

    /// Every range of the region starting at `region`, in address order (for snapshots).
    pub fn ranges(&self, region: u64) -> Vec<RangeInfo> {
        let Some(&len) = self.regions.get(&region) else {
            return Vec::new();
        };
        self.blocks
            .range(region..region + len)
            .map(|(&offset, b)| RangeInfo {
                offset,
                len: b.len,
                free_tag: match b.state {
                    State::Used => None,
                    State::Free(t) => Some(t),
                },
            })
            .collect()
    }

    /// Insert a free range, merging with same-tag free neighbours inside its region.
    fn insert_free(&mut self, mut offset: u64, mut len: u64, tag: u64) {
        // Merge with the previous block unless `offset` starts a region.
        if !self.regions.contains_key(&offset) {
            if let Some((&p_off, &p)) = self.blocks.range(..offset).next_back() {
                if p.state == State::Free(tag) && p_off + p.len == offset {
                    self.blocks.remove(&p_off);
                    self.free_index.remove(&(tag, p.len, p_off));
                    offset = p_off;
                    len += p.len;
                }
            }
        }
        // Merge with the next block unless it starts a region.
        let end = offset + len;
        if !self.regions.contains_key(&end) {
            if let Some(&n) = self.blocks.get(&end) {
                if n.state == State::Free(tag) {
                    self.blocks.remove(&end);
                    self.free_index.remove(&(tag, n.len, end));
                    len += n.len;
                }
            }
        }
        self.blocks.insert(
            offset,
            Block {
                len,
                state: State::Free(tag),
            },
        );
        self.free_index.insert((tag, len, offset));
    }

    fn remove_free(&mut self, offset: u64, len: u64, tag: u64) {
        self.blocks.remove(&offset);
        self.free_index.remove(&(tag, len, offset));
    }

    /// Check every invariant: regions disjoint and granule-aligned; ranges tile each region
    /// exactly; no two neighbouring free ranges with the same tag inside a region; the free
    /// index holds exactly the free ranges; the counters match. Returns the first violation.
    pub fn validate(&self) -> Result<(), String> {
        let mut prev_end = 0u64;
        let mut blocks = self.blocks.iter().peekable();
        let (mut used, mut used_n, mut free_n) = (0u64, 0u64, 0u64);
        for (&start, &rlen) in &self.regions {
            if start < prev_end {
                return Err(format!("region {start:#x} overlaps the previous one"));
            }
            if start % GRANULE != 0 || rlen % GRANULE != 0 || rlen == 0 {
                return Err(format!("region {start:#x}+{rlen} misaligned"));
            }
            let end = start + rlen;
            let mut at = start;
            let mut prev_free: Option<u64> = None;
            while at < end {
                let Some((&off, b)) = blocks.next() else {
                    return Err(format!("region {start:#x}: no range at {at:#x}"));
                };
                if off != at {
                    return Err(format!(
                        "region {start:#x}: expected range at {at:#x}, found {off:#x}"
                    ));
                }
                if b.len == 0 || b.len % GRANULE != 0 {
                    return Err(format!("range {off:#x} has bad length {}", b.len));
                }
                match b.state {
                    State::Used => {
                        used += b.len;
                        used_n += 1;
                        prev_free = None;
                    }
                    State::Free(tag) => {
                        if prev_free == Some(tag) {
                            return Err(format!(
                                "free range {off:#x} not merged with its same-tag neighbour"
                            ));
                        }
                        if !self.free_index.contains(&(tag, b.len, off)) {
                            return Err(format!("free range {off:#x} missing from the index"));
                        }
                        free_n += 1;
                        prev_free = Some(tag);
                    }
                }
                at = off + b.len;
            }
            if at != end {
                return Err(format!("region {start:#x}: last range runs past the end"));
            }
            prev_end = end;
        }
        if let Some((&off, _)) = blocks.next() {
            return Err(format!("range {off:#x} lies outside every region"));
        }
        if free_n != self.free_index.len() as u64 {
            return Err(format!(
                "free index has {} entries, {free_n} free ranges exist",
                self.free_index.len()
            ));
        }
        if used != self.used_bytes || used_n != self.used_ranges {
            return Err(format!(
                "counters say {} bytes in {} ranges, walk found {used} in {used_n}",
                self.used_bytes, self.used_ranges
            ));
        }
        Ok(())
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
}
