//! The ordered set of one size class's free ranges in the free index
//! (`range/free_index.rs`): a sorted vector while it holds a few ranges, a B-tree past
//! [`FEW`].
//!
//! Most classes hold a handful of ranges (a huge arena's one free range, the remainder a
//! temporary leaves), and a miss of the caches takes one range out and puts it back: in a
//! vector of a few entries that is a binary search and a short move, against a B-tree's
//! node search and rebalancing (a quarter of such a pair's instructions). A class that
//! fills up (thousands of small free ranges) stays a B-tree until it empties, so no insert
//! or remove moves more than [`FEW`] entries.
#![forbid(unsafe_code)]

use std::collections::BTreeSet;

/// Most entries kept in a sorted vector.
const FEW: usize = 32;

/// (length, offset) pairs, ordered.
#[derive(Debug, Clone)]
pub(super) enum ClassSet {
    Few(Vec<(u64, u64)>),
    Many(BTreeSet<(u64, u64)>),
}

impl Default for ClassSet {
    fn default() -> Self {
        ClassSet::Few(Vec::new())
    }
}

/// Equal when they hold the same entries (whatever their form).
impl PartialEq for ClassSet {
    fn eq(&self, other: &Self) -> bool {
        self.len() == other.len() && self.iter().eq(other.iter())
    }
}

impl Eq for ClassSet {}

impl ClassSet {
    /// Add `v`; whether it was absent.
    pub(super) fn insert(&mut self, v: (u64, u64)) -> bool {
        match self {
            ClassSet::Few(vec) => match vec.binary_search(&v) {
                Ok(_) => false,
                Err(_) if vec.len() >= FEW => {
                    let mut set: BTreeSet<_> = vec.drain(..).collect();
                    set.insert(v);
                    *self = ClassSet::Many(set);
                    true
                }
                Err(i) => {
                    vec.insert(i, v);
                    true
                }
            },
            ClassSet::Many(set) => set.insert(v),
        }
    }

    /// Remove `v`; whether it was there. An emptied B-tree becomes a vector again.
    pub(super) fn remove(&mut self, v: &(u64, u64)) -> bool {
        match self {
            ClassSet::Few(vec) => match vec.binary_search(v) {
                Ok(i) => {
                    vec.remove(i);
                    true
                }
                Err(_) => false,
            },
            ClassSet::Many(set) => {
                let removed = set.remove(v);
                if set.is_empty() {
                    *self = ClassSet::default();
                }
                removed
            }
        }
    }

    pub(super) fn contains(&self, v: &(u64, u64)) -> bool {
        match self {
            ClassSet::Few(vec) => vec.binary_search(v).is_ok(),
            ClassSet::Many(set) => set.contains(v),
        }
    }

    /// The first entry at or after `v`.
    pub(super) fn first_from(&self, v: (u64, u64)) -> Option<(u64, u64)> {
        match self {
            ClassSet::Few(vec) => vec.get(vec.partition_point(|&x| x < v)).copied(),
            ClassSet::Many(set) => set.range(v..).next().copied(),
        }
    }

    pub(super) fn first(&self) -> Option<(u64, u64)> {
        match self {
            ClassSet::Few(vec) => vec.first().copied(),
            ClassSet::Many(set) => set.first().copied(),
        }
    }

    pub(super) fn last(&self) -> Option<(u64, u64)> {
        match self {
            ClassSet::Few(vec) => vec.last().copied(),
            ClassSet::Many(set) => set.last().copied(),
        }
    }

    pub(super) fn len(&self) -> usize {
        match self {
            ClassSet::Few(vec) => vec.len(),
            ClassSet::Many(set) => set.len(),
        }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The entries, in order.
    pub(super) fn iter(&self) -> Iter<'_> {
        match self {
            ClassSet::Few(vec) => Iter::Few(vec.iter()),
            ClassSet::Many(set) => Iter::Many(set.iter()),
        }
    }
}

/// [`ClassSet::iter`]'s iterator.
pub(super) enum Iter<'a> {
    Few(std::slice::Iter<'a, (u64, u64)>),
    Many(std::collections::btree_set::Iter<'a, (u64, u64)>),
}

impl Iterator for Iter<'_> {
    type Item = (u64, u64);

    fn next(&mut self) -> Option<(u64, u64)> {
        match self {
            Iter::Few(it) => it.next().copied(),
            Iter::Many(it) => it.next().copied(),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Against a B-tree: every answer the same, through the switch to a B-tree and back.
        #[test]
        fn matches_a_btree(ops in prop::collection::vec((any::<bool>(), 0u64..80, 0u64..4), 1..600)) {
            let mut set = ClassSet::default();
            let mut model = BTreeSet::new();
            for (insert, len, offset) in ops {
                let v = (len, offset);
                if insert {
                    prop_assert_eq!(set.insert(v), model.insert(v));
                } else {
                    prop_assert_eq!(set.remove(&v), model.remove(&v));
                }
                prop_assert_eq!(set.len(), model.len());
                prop_assert_eq!(set.first(), model.first().copied());
                prop_assert_eq!(set.last(), model.last().copied());
                prop_assert_eq!(set.first_from((len, 2)), model.range((len, 2)..).next().copied());
                prop_assert_eq!(set.contains(&v), model.contains(&v));
                prop_assert!(set.iter().eq(model.iter().copied()));
                if let ClassSet::Few(vec) = &set {
                    prop_assert!(vec.len() <= FEW);
                }
            }
        }
    }

    #[test]
    fn a_full_vector_becomes_a_btree_and_an_empty_btree_a_vector() {
        let mut set = ClassSet::default();
        for i in 0..=FEW as u64 {
            assert!(set.insert((1, i)));
        }
        assert!(matches!(set, ClassSet::Many(_)));
        for i in 0..=FEW as u64 {
            assert!(set.remove(&(1, i)));
        }
        assert!(matches!(set, ClassSet::Few(_)));
        assert!(set.is_empty());
    }
}
