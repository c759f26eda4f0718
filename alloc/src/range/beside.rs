//! [`RangeAllocator::beside`]: what lies on either side of an allocation in its region (the
//! pool's flush looks for cached blocks that would join free space: `pool/front/cached_runs.rs`).

use super::{RangeAllocator, State, NIL};

/// The ranges on either side of an allocation, in its region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Beside {
    /// The allocation's length.
    pub len: u64,
    /// The start of the range before it; `None` for a region's first range.
    pub before: Option<u64>,
    /// The length of the range before it when that range is free under the tag asked
    /// about (it would merge with the allocation once freed under that tag), else 0.
    pub free_before: u64,
    /// The start of the range after it; `None` for a region's last range.
    pub after: Option<u64>,
    /// As `free_before`, for the range after it.
    pub free_after: u64,
}

impl RangeAllocator {
    /// The allocation starting at `offset` and its neighbours, with the lengths of those
    /// that are free under `tag`. `None` when no allocation starts at `offset`.
    pub fn beside(&self, offset: u64, tag: u64) -> Option<Beside> {
        let b = self.block_at(offset)?;
        if b.state != State::Used {
            return None;
        }
        // (start, length free under `tag`) of the range in `slot`.
        let side = |slot| {
            (slot != NIL).then(|| {
                let n = &self.blocks[slot];
                (
                    n.start,
                    if n.state == State::Free(tag) {
                        n.len
                    } else {
                        0
                    },
                )
            })
        };
        let (before, after) = (side(b.prev), side(b.next));
        Some(Beside {
            len: b.len,
            before: before.map(|s| s.0),
            free_before: before.map_or(0, |s| s.1),
            after: after.map(|s| s.0),
            free_after: after.map_or(0, |s| s.1),
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::super::{RangeAllocator, GRANULE};
    use super::Beside;

    #[test]
    fn beside_names_the_neighbours_and_the_free_ones_of_the_tag() {
        let mut r = RangeAllocator::new();
        let u = GRANULE * 4;
        r.add_region(0, u * 6, 1).unwrap();
        let offs: Vec<u64> = (0..6).map(|_| r.alloc(u, 1).unwrap()).collect();
        r.free(offs[0], 1).unwrap();
        r.free(offs[2], 2).unwrap();
        // Second range: a free range of tag 1 before it, one of tag 2 after it.
        let b = r.beside(offs[1], 1).unwrap();
        let want = Beside {
            len: u,
            before: Some(0),
            free_before: u,
            after: Some(offs[2]),
            free_after: 0,
        };
        assert_eq!(b, want);
        assert_eq!(r.beside(offs[1], 2).unwrap().free_after, u);
        // The region's last range has nothing after it; a free range is no allocation.
        let last = r.beside(offs[5], 1).unwrap();
        assert_eq!((last.after, last.free_after), (None, 0));
        assert_eq!(r.beside(offs[0], 1), None);
        assert_eq!(r.beside(u * 100, 1), None);
    }
}
