//! [`RangeAllocator::alloc_at`]: allocate a given range (a graph pool's checkpoint puts its
//! blocks back at their own addresses, `pool/graphs/graph_pools.rs`).

use super::{check_granule, Block, RangeAllocator, RangeError, Slot, State, NIL};

impl RangeAllocator {
    /// Allocate exactly `[offset, offset + len)`, which must lie inside one free range (of
    /// any tag): the parts of that range before and after it stay free under its tag.
    /// Changes nothing on an error.
    pub fn alloc_at(&mut self, offset: u64, len: u64) -> Result<(), RangeError> {
        check_granule(offset, len)?;
        let (slot, b) = self
            .free_range_containing(offset)
            .ok_or(RangeError::NotFree { offset, len })?;
        let State::Free(tag) = b.state else {
            return Err(RangeError::NotFree { offset, len });
        };
        let end = offset + len;
        if end > b.end() {
            return Err(RangeError::NotFree { offset, len });
        }
        self.free_index.remove(tag, b.len, b.start);
        let mut pieces = Vec::with_capacity(3);
        if offset > b.start {
            pieces.push((b.start, offset - b.start, State::Free(tag)));
        }
        pieces.push((offset, len, State::Used));
        if end < b.end() {
            pieces.push((end, b.end() - end, State::Free(tag)));
        }
        self.cut(slot, &pieces);
        for &(start, len, state) in &pieces {
            if state == State::Free(tag) {
                self.free_index.insert(tag, len, start);
            }
        }
        self.used_bytes += len;
        self.used_ranges += 1;
        Ok(())
    }

    /// Cut the range in `slot` into `pieces` (`(start, len, state)`, in order, tiling it):
    /// the last piece keeps the slot, the others get slots of their own before it. The free
    /// index is the caller's.
    fn cut(&mut self, slot: Slot, pieces: &[(u64, u64, State)]) {
        let Some((&(start, len, state), before)) = pieces.split_last() else {
            return;
        };
        let b = self.blocks[slot];
        self.starts.remove(&b.start);
        let mut prev = b.prev;
        for &(s, l, st) in before {
            let p = self.new_block(s, l, st, prev, NIL);
            self.link(prev, p);
            prev = p;
        }
        self.blocks[slot] = Block {
            start,
            len,
            state,
            prev,
            next: b.next,
        };
        self.starts.insert(start, slot);
        self.link(prev, slot);
    }

    /// The free range containing `offset`: its slot and block. A walk of its region's
    /// ranges from the start (graph pools' arenas hold few).
    fn free_range_containing(&self, offset: u64) -> Option<(Slot, Block)> {
        let (&region, r) = self.regions.range(..=offset).next_back()?;
        if offset >= region + r.len {
            return None;
        }
        self.chain_slots(region)
            .find(|(_, b)| offset < b.end())
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
