//! [`RangeAllocator::alloc_at`]: allocate a given range (a graph pool's checkpoint puts its
//! blocks back at their own addresses, `pool/graph_pools.rs`).

use super::{check_granule, Block, RangeAllocator, RangeError, State};

impl RangeAllocator {
    /// Allocate exactly `[offset, offset + len)`, which must lie inside one free range (of
    /// any tag): the parts of that range before and after it stay free under its tag.
    /// Changes nothing on an error.
    pub fn alloc_at(&mut self, offset: u64, len: u64) -> Result<(), RangeError> {
        check_granule(offset, len)?;
        let (start, b) = self
            .free_range_containing(offset)
            .ok_or(RangeError::NotFree { offset, len })?;
        let State::Free(tag) = b.state else {
            return Err(RangeError::NotFree { offset, len });
        };
        let (end, b_end) = (offset + len, start + b.len);
        if end > b_end {
            return Err(RangeError::NotFree { offset, len });
        }
        self.free_index.remove(tag, b.len, start);
        // The part before stays where it was, shortened.
        let mut prev = b.prev;
        if offset > start {
            self.put(
                start,
                Block {
                    len: offset - start,
                    state: State::Free(tag),
                    prev: b.prev,
                    last: false,
                },
            );
            self.free_index.insert(tag, offset - start, start);
            prev = start;
        } else {
            self.blocks.remove(&start);
        }
        let after = b_end - end;
        self.put(
            offset,
            Block {
                len,
                state: State::Used,
                prev,
                last: b.last && after == 0,
            },
        );
        if after > 0 {
            self.put(
                end,
                Block {
                    len: after,
                    state: State::Free(tag),
                    prev: offset,
                    last: b.last,
                },
            );
            self.free_index.insert(tag, after, end);
        }
        // The range after the old free range links to what now ends there.
        if !b.last {
            self.set_prev(b_end, if after > 0 { end } else { offset });
        }
        self.used_bytes += len;
        self.used_ranges += 1;
        Ok(())
    }

    /// The free range containing `offset`: its start and block. A walk of its region's
    /// ranges from the start (graph pools' arenas hold few).
    fn free_range_containing(&self, offset: u64) -> Option<(u64, Block)> {
        let (&region, &rlen) = self.regions.range(..=offset).next_back()?;
        if offset >= region + rlen {
            return None;
        }
        self.chain(region)
            .find(|(at, b)| offset < at + b.len)
            .filter(|(_, b)| matches!(b.state, State::Free(_)))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    const K: u64 = 512;

    #[test]
    fn placed_ranges_split_the_free_range_around_them() {
        let mut r = RangeAllocator::new();
        r.add_region(0, 64 * K, 7).unwrap();
        r.alloc_at(8 * K, 4 * K).unwrap();
        r.validate().unwrap();
        assert_eq!(r.allocated_len(8 * K), Some(4 * K));
        // At the very start and the very end of the region.
        r.alloc_at(0, K).unwrap();
        r.alloc_at(63 * K, K).unwrap();
        r.validate().unwrap();
        assert_eq!(r.stats().used_bytes, 6 * K);
        // The rest is still free under the range's tag, and frees coalesce back.
        assert_eq!(r.largest_free(7), 51 * K);
        for p in [0, 8 * K, 63 * K] {
            r.free(p, 7).unwrap();
        }
        r.validate().unwrap();
        assert_eq!(r.largest_free(7), 64 * K);
    }

    #[test]
    fn a_range_not_wholly_free_is_refused_and_nothing_changes() {
        let mut r = RangeAllocator::new();
        r.add_region(0, 16 * K, 1).unwrap();
        let a = r.alloc(4 * K, 1).unwrap();
        let before = r.clone();
        for (at, len) in [
            (a, K),
            (2 * K, 4 * K),
            (14 * K, 4 * K),
            (100 * K, K),
            (K + 1, K),
        ] {
            assert!(r.alloc_at(at, len).is_err(), "{at} {len}");
            assert_eq!(r, before);
        }
        // Exactly the freed range, in a region of several ranges.
        let b = r.alloc(4 * K, 1).unwrap();
        r.free(a, 2).unwrap();
        r.alloc_at(a, 4 * K).unwrap();
        r.validate().unwrap();
        assert_eq!(
            (r.allocated_len(a), r.allocated_len(b)),
            (Some(4 * K), Some(4 * K))
        );
    }
}
