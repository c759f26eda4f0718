//! Regions whose end moves: [`RangeAllocator::grow_region`] (an arena mapped one more chunk
//! past its end) and [`RangeAllocator::shrink_region`] (its free tail given back).

use super::{check_granule, Block, RangeAllocator, RangeError, State, NO_PREV};

impl RangeAllocator {
    /// The start of the last range of the region starting at `region`.
    fn last_range(&self, region: u64) -> Option<u64> {
        let len = self.regions.get(&region)?;
        self.last_at_end.get(&(region + len)).copied()
    }

    /// Add `extra` bytes at the end of the region starting at `offset`, free under `tag`: a
    /// free last range of that tag grows, else the bytes become a range of their own. Refused,
    /// changing nothing, when no region starts there, `extra` is not a non-zero [`super::GRANULE`]
    /// multiple, or the grown region would reach the next region.
    pub fn grow_region(&mut self, offset: u64, extra: u64, tag: u64) -> Result<(), RangeError> {
        let len = *self
            .regions
            .get(&offset)
            .ok_or(RangeError::NoSuchRegion(offset))?;
        let end = offset + len;
        check_granule(end, extra)?;
        if let Some((&next, _)) = self.regions.range(end..).next() {
            if next < end + extra {
                return Err(RangeError::Overlap {
                    offset: end,
                    len: extra,
                });
            }
        }
        let last = self
            .last_range(offset)
            .ok_or(RangeError::NoSuchRegion(offset))?;
        let b = self.blocks[&last];
        self.regions.insert(offset, len + extra);
        self.last_at_end.remove(&end);
        if b.state == State::Free(tag) {
            self.free_index.remove(tag, b.len, last);
            self.put(
                last,
                Block {
                    len: b.len + extra,
                    ..b
                },
            );
            self.free_index.insert(tag, b.len + extra, last);
        } else {
            self.put(last, Block { last: false, ..b });
            self.put(
                end,
                Block {
                    len: extra,
                    state: State::Free(tag),
                    prev: last,
                    last: true,
                },
            );
            self.free_index.insert(tag, extra, end);
        }
        Ok(())
    }

    /// The bytes at the end of the region starting at `offset` that one free range covers
    /// (0 when its last range is allocated), with that range's tag.
    pub fn free_tail(&self, offset: u64) -> Option<(u64, u64)> {
        let last = self.last_range(offset)?;
        match self.blocks[&last].state {
            State::Free(tag) => Some((self.blocks[&last].len, tag)),
            State::Used => None,
        }
    }

    /// Cut the region starting at `offset` down to `new_len` bytes (a non-zero
    /// [`super::GRANULE`] multiple below its length): the bytes dropped must lie in its free
    /// last range. Refused, changing nothing, otherwise.
    pub fn shrink_region(&mut self, offset: u64, new_len: u64) -> Result<(), RangeError> {
        let len = *self
            .regions
            .get(&offset)
            .ok_or(RangeError::NoSuchRegion(offset))?;
        check_granule(offset, new_len)?;
        if new_len >= len {
            return Err(RangeError::Misaligned {
                offset,
                len: new_len,
            });
        }
        let new_end = offset + new_len;
        let last = self
            .last_range(offset)
            .ok_or(RangeError::NoSuchRegion(offset))?;
        let b = self.blocks[&last];
        let State::Free(tag) = b.state else {
            return Err(RangeError::RegionInUse(offset));
        };
        if last > new_end {
            return Err(RangeError::RegionInUse(offset));
        }
        self.free_index.remove(tag, b.len, last);
        self.last_at_end.remove(&(offset + len));
        if last == new_end {
            self.blocks.remove(&last);
            if b.prev != NO_PREV {
                if let Some(p) = self.blocks.get_mut(&b.prev) {
                    p.last = true;
                }
                self.last_at_end.insert(new_end, b.prev);
            }
        } else {
            let kept = new_end - last;
            self.put(last, Block { len: kept, ..b });
            self.free_index.insert(tag, kept, last);
        }
        self.regions.insert(offset, new_len);
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
