//! Regions whose end moves: [`RangeAllocator::grow_region`] (an arena mapped one more chunk
//! past its end) and [`RangeAllocator::shrink_region`] (its free tail given back).

use super::{check_granule, RangeAllocator, RangeError, State, NIL};

impl RangeAllocator {
    /// Add `extra` bytes at the end of the region starting at `offset`, free under `tag`: a
    /// free last range of that tag grows, else the bytes become a range of their own. Refused,
    /// changing nothing, when no region starts there, `extra` is not a non-zero [`super::GRANULE`]
    /// multiple, or the grown region would reach the next region.
    pub fn grow_region(&mut self, offset: u64, extra: u64, tag: u64) -> Result<(), RangeError> {
        let region = *self
            .regions
            .get(&offset)
            .ok_or(RangeError::NoSuchRegion(offset))?;
        let end = offset + region.len;
        check_granule(end, extra)?;
        if let Some((&next, _)) = self.regions.range(end..).next() {
            if next < end + extra {
                return Err(RangeError::Overlap {
                    offset: end,
                    len: extra,
                });
            }
        }
        let last = region.last;
        let b = self.blocks[last];
        let new_last = if b.state == State::Free(tag) {
            self.free_index.remove(tag, b.len, b.start);
            self.blocks[last].len += extra;
            self.free_index.insert(tag, b.len + extra, b.start);
            last
        } else {
            let added = self.new_block(end, extra, State::Free(tag), last, NIL);
            self.blocks[last].next = added;
            self.free_index.insert(tag, extra, end);
            added
        };
        if let Some(r) = self.regions.get_mut(&offset) {
            r.len += extra;
            r.last = new_last;
        }
        Ok(())
    }

    /// The bytes at the end of the region starting at `offset` that one free range covers
    /// (0 when its last range is allocated), with that range's tag.
    pub fn free_tail(&self, offset: u64) -> Option<(u64, u64)> {
        let b = self.blocks.get(self.regions.get(&offset)?.last)?;
        match b.state {
            State::Free(tag) => Some((b.len, tag)),
            State::Used => None,
        }
    }

    /// Cut the region starting at `offset` down to `new_len` bytes (a non-zero
    /// [`super::GRANULE`] multiple below its length): the bytes dropped must lie in its free
    /// last range. Refused, changing nothing, otherwise.
    pub fn shrink_region(&mut self, offset: u64, new_len: u64) -> Result<(), RangeError> {
        let region = *self
            .regions
            .get(&offset)
            .ok_or(RangeError::NoSuchRegion(offset))?;
        check_granule(offset, new_len)?;
        if new_len >= region.len {
            return Err(RangeError::Misaligned {
                offset,
                len: new_len,
            });
        }
        let new_end = offset + new_len;
        let last = region.last;
        let b = self.blocks[last];
        let State::Free(tag) = b.state else {
            return Err(RangeError::RegionInUse(offset));
        };
        if b.start > new_end {
            return Err(RangeError::RegionInUse(offset));
        }
        self.free_index.remove(tag, b.len, b.start);
        let new_last = if b.start == new_end {
            // `new_len` is not zero, so a range comes before this one.
            self.drop_block(last);
            self.blocks[b.prev].next = NIL;
            b.prev
        } else {
            let kept = new_end - b.start;
            self.blocks[last].len = kept;
            self.free_index.insert(tag, kept, b.start);
            last
        };
        self.regions.insert(
            offset,
            super::Region {
                len: new_len,
                last: new_last,
            },
        );
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::super::{RangeAllocator, RangeError};

    const K: u64 = 4096;

    #[test]
    fn growth_extends_a_free_tail_and_adds_after_a_used_one() {
        let mut r = RangeAllocator::new();
        r.add_region(0, 4 * K, 7).unwrap();
        let a = r.alloc(3 * K, 7).unwrap();
        r.grow_region(0, 4 * K, 7).unwrap();
        r.validate().unwrap();
        // The free tail (1 page) and the new 4 pages are one range now.
        assert_eq!(r.largest_free(7), 5 * K);
        assert_eq!(r.free_tail(0), Some((5 * K, 7)));
        let b = r.alloc(5 * K, 7).unwrap();
        assert_eq!(b, a + 3 * K);
        assert_eq!(r.free_tail(0), None);
        r.grow_region(0, 2 * K, 7).unwrap();
        r.validate().unwrap();
        assert_eq!(r.alloc(2 * K, 7), Some(8 * K));
        r.free(b, 7).unwrap();
        r.validate().unwrap();
    }

    #[test]
    fn growth_under_another_tag_does_not_merge() {
        let mut r = RangeAllocator::new();
        r.add_region(0, 4 * K, 1).unwrap();
        r.grow_region(0, 4 * K, 2).unwrap();
        r.validate().unwrap();
        assert_eq!(r.largest_free(1), 4 * K);
        assert_eq!(r.largest_free(2), 4 * K);
    }

    #[test]
    fn growth_and_shrink_refuse_without_change() {
        let mut r = RangeAllocator::new();
        r.add_region(0, 4 * K, 0).unwrap();
        r.add_region(8 * K, 4 * K, 0).unwrap();
        let before = r.clone();
        assert!(matches!(
            r.grow_region(0, 8 * K, 0),
            Err(RangeError::Overlap { .. })
        ));
        assert!(r.grow_region(K, K, 0).is_err());
        assert!(r.grow_region(0, 100, 0).is_err());
        let a = r.alloc(4 * K, 0).unwrap();
        assert_eq!(a, 0);
        assert_eq!(r.shrink_region(0, 2 * K), Err(RangeError::RegionInUse(0)));
        assert!(r.shrink_region(8 * K, 4 * K).is_err());
        r.free(a, 0).unwrap();
        assert_eq!(r, before);
    }

    #[test]
    fn shrink_drops_the_free_tail_only() {
        let mut r = RangeAllocator::new();
        r.add_region(0, 8 * K, 0).unwrap();
        let a = r.alloc(2 * K, 0).unwrap();
        let b = r.alloc(2 * K, 0).unwrap();
        r.free(a, 0).unwrap();
        // Free: [0, 2K) and [4K, 8K).
        assert_eq!(r.shrink_region(0, 2 * K), Err(RangeError::RegionInUse(0)));
        r.shrink_region(0, 6 * K).unwrap();
        r.validate().unwrap();
        assert_eq!(r.free_tail(0), Some((2 * K, 0)));
        r.shrink_region(0, 4 * K).unwrap();
        r.validate().unwrap();
        assert_eq!(r.free_tail(0), None);
        assert_eq!(r.stats().region_bytes, 4 * K);
        r.free(b, 0).unwrap();
        r.validate().unwrap();
        assert_eq!(r.remove_region(0), Ok(4 * K));
    }
}
