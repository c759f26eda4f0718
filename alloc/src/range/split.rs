//! [`RangeAllocator::split_region`]: a region becomes several smaller ones (trim: an arena
//! whose free pages go back to the driver keeps only the windows around its allocations).

use super::{check_granule, Block, RangeAllocator, RangeError, Region, Slot, State, NIL};

impl RangeAllocator {
    /// Split the region starting at `offset` into the regions `windows` (`(offset, len)`
    /// pairs, absolute, sorted, disjoint, inside the region): every allocated range stays as
    /// it is, free ranges are cut at the windows' edges (keeping their tags) and the free
    /// space outside the windows is dropped. Refused, changing nothing, unless there is at
    /// least one window and every allocated range of the region lies inside one window.
    pub fn split_region(&mut self, offset: u64, windows: &[(u64, u64)]) -> Result<(), RangeError> {
        let len = self
            .regions
            .get(&offset)
            .ok_or(RangeError::NoSuchRegion(offset))?
            .len;
        if windows.is_empty() {
            // Splitting into nothing would drop the region (use `remove_region`).
            return Err(RangeError::Misaligned { offset, len: 0 });
        }
        let mut end = offset;
        for &(w, wlen) in windows {
            check_granule(w, wlen)?;
            if w < end || w + wlen > offset + len {
                return Err(RangeError::Overlap {
                    offset: w,
                    len: wlen,
                });
            }
            end = w + wlen;
        }
        let ranges: Vec<(Slot, Block)> = self.chain_slots(offset).collect();
        let inside = |s: u64, l: u64| windows.iter().any(|&(w, wl)| s >= w && s + l <= w + wl);
        if ranges
            .iter()
            .any(|&(_, b)| b.state == State::Used && !inside(b.start, b.len))
        {
            return Err(RangeError::RegionInUse(offset));
        }
        // Take the region out, then put each window in with its pieces.
        for &(slot, b) in &ranges {
            self.drop_block(slot);
            if let State::Free(tag) = b.state {
                self.free_index.remove(tag, b.len, b.start);
            }
        }
        self.regions.remove(&offset);
        let mut next = 0; // index into `ranges` of the first range that may reach a window
        for &(w, wlen) in windows {
            let wend = w + wlen;
            while next < ranges.len() && ranges[next].1.end() <= w {
                next += 1;
            }
            let mut i = next;
            let mut prev = NIL;
            while i < ranges.len() && ranges[i].1.start < wend {
                let b = ranges[i].1;
                let (ps, pe) = (b.start.max(w), b.end().min(wend));
                let slot = self.new_block(ps, pe - ps, b.state, prev, NIL);
                self.link(prev, slot);
                if let State::Free(tag) = b.state {
                    self.free_index.insert(tag, pe - ps, ps);
                }
                prev = slot;
                i += 1;
            }
            self.regions.insert(
                w,
                Region {
                    len: wlen,
                    last: prev,
                },
            );
        }
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::super::{RangeAllocator, RangeError};

    const MIB: u64 = 1 << 20;

    #[test]
    fn a_split_keeps_allocations_and_the_free_space_inside_the_windows() {
        let mut r = RangeAllocator::new();
        r.add_region(0, 16 * MIB, 0).unwrap();
        let a = r.alloc(MIB, 0).unwrap(); // [0, 1M)
        let b = r.alloc(8 * MIB, 0).unwrap(); // [1M, 9M)
        let c = r.alloc(MIB, 0).unwrap(); // [9M, 10M)
        r.free(b, 5).unwrap();
        r.validate().unwrap();
        // c is outside every window: refused, nothing changed.
        let before = r.clone();
        assert_eq!(
            r.split_region(0, &[(0, 2 * MIB)]),
            Err(RangeError::RegionInUse(0))
        );
        assert_eq!(r, before);
        r.split_region(0, &[(0, 2 * MIB), (8 * MIB, 2 * MIB)])
            .unwrap();
        r.validate().unwrap();
        assert_eq!(r.stats().regions, 2);
        assert_eq!(r.stats().region_bytes, 4 * MIB);
        assert_eq!(r.allocated_len(a), Some(MIB));
        assert_eq!(r.allocated_len(c), Some(MIB));
        // The free pieces kept their tag: [1M, 2M) and [8M, 9M) under tag 5.
        assert_eq!(r.alloc(MIB, 0), None);
        assert_eq!(r.alloc(MIB, 5), Some(MIB));
        assert_eq!(r.alloc(MIB, 5), Some(8 * MIB));
        assert_eq!(r.alloc(MIB, 5), None);
        for p in [a, c, MIB, 8 * MIB] {
            r.free(p, 0).unwrap();
        }
        r.validate().unwrap();
        assert_eq!(r.remove_region(0), Ok(2 * MIB));
        assert_eq!(r.remove_region(8 * MIB), Ok(2 * MIB));
        assert_eq!(r.stats().regions, 0);
    }

    #[test]
    fn bad_windows_are_refused() {
        let mut r = RangeAllocator::new();
        r.add_region(0, 8 * MIB, 0).unwrap();
        let before = r.clone();
        assert!(r.split_region(0, &[(2 * MIB, MIB), (0, MIB)]).is_err());
        assert!(r.split_region(0, &[(6 * MIB, 4 * MIB)]).is_err());
        assert!(r.split_region(MIB, &[(MIB, MIB)]).is_err());
        // No window at all: refused, even for a free region (it would vanish).
        assert!(r.split_region(0, &[]).is_err());
        assert_eq!(r, before);
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(128))]
        /// Random allocations under several tags, some freed; windows = the 64 KiB pages the
        /// live ones touch: the split validates, keeps every live range, leaves one region
        /// per window, and everything frees and removes afterwards.
        #[test]
        fn a_split_at_the_live_pages_keeps_every_allocation(
            ops in proptest::collection::vec((1u64..64, 0u64..3, proptest::bool::ANY), 1..60),
        ) {
            const PAGE: u64 = 64 << 10;
            let mut r = RangeAllocator::new();
            r.add_region(0, 64 * MIB, 0).unwrap();
            let mut live = Vec::new();
            for &(n, tag, keep) in &ops {
                let len = n * 1024;
                let Some(p) = r.alloc(len, 0) else { continue };
                if keep {
                    live.push((p, len));
                } else {
                    r.free(p, tag).unwrap();
                }
            }
            proptest::prop_assume!(!live.is_empty());
            live.sort_unstable();
            let mut windows: Vec<(u64, u64)> = Vec::new();
            for &(p, l) in &live {
                let (s, e) = (p / PAGE * PAGE, (p + l).div_ceil(PAGE) * PAGE);
                match windows.last_mut() {
                    Some(w) if w.0 + w.1 >= s => w.1 = e.max(w.0 + w.1) - w.0,
                    _ => windows.push((s, e - s)),
                }
            }
            r.split_region(0, &windows).unwrap();
            r.validate().unwrap();
            proptest::prop_assert_eq!(r.stats().regions as usize, windows.len());
            proptest::prop_assert_eq!(r.stats().region_bytes, windows.iter().map(|w| w.1).sum::<u64>());
            for &(p, l) in &live {
                proptest::prop_assert_eq!(r.allocated_len(p), Some(l));
            }
            for &(p, _) in &live {
                r.free(p, 9).unwrap();
                r.validate().unwrap();
            }
            for &(off, len) in &windows {
                // A window may hold free pieces under other tags: retag to merge them.
                for (t, _) in r.free_tags() {
                    r.retag(t, 9);
                }
                proptest::prop_assert_eq!(r.remove_region(off), Ok(len));
            }
            r.validate().unwrap();
        }
    }
}
