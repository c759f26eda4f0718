//! Which arena holds an address: the arenas' address ranges (`rangemap`), with the last two
//! answers remembered. A miss of the thread caches looks up the arena of the range it took;
//! consecutive misses mostly land in the arena of the one before or the one before that (KV
//! blocks in one arena, temporaries in another), and the remembered ranges answer those
//! without the ordered search.

use std::cell::Cell;
use std::ops::Range;

use rangemap::RangeMap;

/// No range remembered.
const NONE: (u64, u64, usize) = (0, 0, usize::MAX);

/// Arena address ranges to arena keys (see the module docs).
#[derive(Debug)]
pub(crate) struct ArenaIndex {
    map: RangeMap<u64, usize>,
    /// The last two ranges found, the latest first: (start, end, key), or [`NONE`] (an
    /// empty range).
    last: Cell<[(u64, u64, usize); 2]>,
}

impl Default for ArenaIndex {
    fn default() -> Self {
        Self {
            map: RangeMap::new(),
            last: Cell::new([NONE; 2]),
        }
    }
}

impl ArenaIndex {
    /// The key of the arena whose range holds `ptr`.
    #[inline]
    pub(crate) fn get(&self, ptr: u64) -> Option<usize> {
        let [a, b] = self.last.get();
        if (a.0..a.1).contains(&ptr) {
            return Some(a.2);
        }
        if (b.0..b.1).contains(&ptr) {
            self.last.set([b, a]);
            return Some(b.2);
        }
        let (range, &key) = self.map.get_key_value(&ptr)?;
        self.last.set([(range.start, range.end, key), a]);
        Some(key)
    }

    /// Record the arena `key` at `range`.
    pub(crate) fn insert(&mut self, range: Range<u64>, key: usize) {
        self.last.set([NONE; 2]);
        self.map.insert(range, key);
    }

    /// Forget the addresses of `range`.
    pub(crate) fn remove(&mut self, range: Range<u64>) {
        self.last.set([NONE; 2]);
        self.map.remove(range);
    }
}

#[cfg(test)]
mod tests {
    use super::ArenaIndex;

    /// The remembered range never answers for an address whose arena went or changed.
    #[test]
    fn a_removed_or_replaced_range_is_not_remembered() {
        let mut ix = ArenaIndex::default();
        ix.insert(0x1000..0x3000, 1);
        ix.insert(0x3000..0x4000, 2);
        assert_eq!(ix.get(0x1800), Some(1));
        assert_eq!(ix.get(0x2fff), Some(1));
        assert_eq!(ix.get(0x3000), Some(2));
        assert_eq!(ix.get(0x4000), None);
        assert_eq!(ix.get(0x1800), Some(1));
        // Both remembered, in either order.
        assert_eq!(ix.get(0x3800), Some(2));
        assert_eq!(ix.get(0x1000), Some(1));
        assert_eq!(ix.get(0x3fff), Some(2));
        ix.remove(0x1000..0x3000);
        assert_eq!(ix.get(0x1800), None);
        // Split in two, as a trim does: each half answers with its own key.
        ix.insert(0x1000..0x2000, 3);
        ix.insert(0x2000..0x3000, 4);
        assert_eq!(ix.get(0x1fff), Some(3));
        assert_eq!(ix.get(0x2000), Some(4));
        ix.remove(0x2000..0x3000);
        assert_eq!(ix.get(0x2000), None);
        assert_eq!(ix.get(0x1000), Some(3));
        assert_eq!(ix.get(0x3000), Some(2));
    }
}
