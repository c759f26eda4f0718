//! [`RangeAllocator::validate`]: every invariant of the sub-allocator, checked.

use rustc_hash::FxHashMap;

use super::{RangeAllocator, State, GRANULE, NIL};

impl RangeAllocator {
    /// Check every invariant: regions disjoint and granule-aligned; ranges tile each region
    /// exactly and their links, slots and start records agree; no two neighbouring free
    /// ranges with the same tag inside a region; the free index and the per-tag bytes hold
    /// exactly the free ranges; the counters match. Returns the first violation.
    pub fn validate(&self) -> Result<(), String> {
        let mut prev_end = 0u64;
        let (mut used, mut used_n, mut free_n, mut seen) = (0u64, 0u64, 0u64, 0usize);
        let mut tag_bytes: FxHashMap<u64, u64> = FxHashMap::default();
        for (&start, region) in &self.regions {
            let rlen = region.len;
            if start < prev_end {
                return Err(format!("region {start:#x} overlaps the previous one"));
            }
            if start % GRANULE != 0 || rlen % GRANULE != 0 || rlen == 0 {
                return Err(format!("region {start:#x}+{rlen} misaligned"));
            }
            let end = start + rlen;
            let mut at = start;
            let mut prev = NIL;
            let mut prev_free: Option<u64> = None;
            let Some(&first) = self.starts.get(&start) else {
                return Err(format!("region {start:#x}: no range at its start"));
            };
            let mut slot = first;
            loop {
                let Some(&b) = self.blocks.get(slot) else {
                    return Err(format!(
                        "region {start:#x}: no range in slot {slot} at {at:#x}"
                    ));
                };
                seen += 1;
                if b.start != at || self.starts.get(&at) != Some(&slot) {
                    return Err(format!("range {at:#x}: its start or its record is wrong"));
                }
                if b.len == 0 || b.len % GRANULE != 0 || at + b.len > end {
                    return Err(format!("range {at:#x} has bad length {}", b.len));
                }
                if b.prev != prev {
                    return Err(format!(
                        "range {at:#x} links back to slot {}, not {prev}",
                        b.prev
                    ));
                }
                if b.is_last() != (at + b.len == end) {
                    return Err(format!("range {at:#x}: wrong last-in-region link"));
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
                                "free range {at:#x} not merged with its same-tag neighbour"
                            ));
                        }
                        if !self.free_index.contains(tag, b.len, at) {
                            return Err(format!("free range {at:#x} missing from the index"));
                        }
                        *tag_bytes.entry(tag).or_insert(0) += b.len;
                        free_n += 1;
                        prev_free = Some(tag);
                    }
                }
                if b.is_last() {
                    if region.last != slot {
                        return Err(format!("region {start:#x}: its last range is not recorded"));
                    }
                    break;
                }
                prev = slot;
                slot = b.next;
                at += b.len;
            }
            prev_end = end;
        }
        if self.starts.len() != self.blocks.len() {
            return Err(format!(
                "{} starts recorded for {} ranges",
                self.starts.len(),
                self.blocks.len()
            ));
        }
        if seen != self.blocks.len() {
            return Err(format!(
                "{} ranges recorded, {seen} reachable from the regions",
                self.blocks.len()
            ));
        }
        self.free_index.validate()?;
        if free_n != self.free_index.len() {
            return Err(format!(
                "free index has {} entries, {free_n} free ranges exist",
                self.free_index.len()
            ));
        }
        if tag_bytes != self.free_index.tag_bytes().collect::<FxHashMap<u64, u64>>() {
            return Err("free bytes per tag disagree with the free ranges".into());
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
