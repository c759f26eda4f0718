//! Free ranges across tags. Free ranges of different tags never merge on their own, so one
//! tag's ranges between free space of other tags leave pieces that no request larger than
//! each can use, however much is free around them. [`RangeAllocator::alloc_best_of`]
//! takes the best fit among several tags' ranges; [`RangeAllocator::take_in`] and
//! [`RangeAllocator::free_taking_in`] let a tag's free ranges take in the free ranges of
//! other tags beside them (the pool passes only tags whose ranges that tag's stream may use:
//! space free for any stream, its own frees waiting for their event), so the pieces become
//! one range.

use super::{RangeAllocator, RangeError, State, GRANULE};

impl RangeAllocator {
    /// [`Self::alloc`] from the best fit among the free ranges of all `tags`: the shortest
    /// range, the first tag's among equals. Returns the offset and the tag it came from.
    pub fn alloc_best_of(&mut self, len: u64, tags: &[u64]) -> Option<(u64, u64)> {
        if len == 0 || len % GRANULE != 0 {
            return None;
        }
        let (tag, flen, offset) = self.free_index.take_best_fit_of(tags, len)?;
        self.carve(offset, flen, len, tag).map(|p| (p, tag))
    }

    /// Every free range tagged `tag` takes in the free ranges beside it whose tag is in
    /// `from` (repeatedly: a chain of such ranges becomes one range), retagged `tag`. Returns
    /// the bytes retagged. Allocated ranges and ranges of other tags stay as they are; a
    /// caller passes only tags whose ranges `tag`'s user may use (retagging to `tag` only
    /// narrows who may use them).
    pub fn take_in(&mut self, tag: u64, from: &[u64]) -> u64 {
        let before = self.free_index.tag_bytes_of(tag);
        for (start, len) in self.free_index.ranges_of(tag) {
            // A range merged into an earlier one of the list is gone (that one took its
            // neighbours in).
            let Some(&slot) = self.starts.get(&start) else {
                continue;
            };
            let b = self.blocks[slot];
            if b.state == State::Free(tag) && b.len == len {
                self.free_index.remove(tag, len, start);
                self.insert_free(slot, tag, from);
            }
        }
        self.free_index.tag_bytes_of(tag) - before
    }

    /// [`Self::free`], merging the freed range also with the free ranges beside it whose tag
    /// is in `from`, as [`Self::take_in`] does. Returns the freed length.
    pub fn free_taking_in(
        &mut self,
        offset: u64,
        tag: u64,
        from: &[u64],
    ) -> Result<u64, RangeError> {
        let slot = match self.starts.get(&offset) {
            Some(&s) if self.blocks[s].state == State::Used => s,
            _ => return Err(RangeError::NotAllocated(offset)),
        };
        let len = self.blocks[slot].len;
        self.used_bytes -= len;
        self.used_ranges -= 1;
        self.insert_free(slot, tag, from);
        Ok(len)
    }
}
#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::super::{RangeAllocator, GRANULE};

    const S: u64 = 7;
    const ANY: u64 = u64::MAX;
    const OTHER: u64 = 9;

    /// A region of 8 ranges of `GRANULE * 4`, all allocated, at offsets 0..8.
    fn eight() -> (RangeAllocator, Vec<u64>) {
        let mut r = RangeAllocator::new();
        let unit = GRANULE * 4;
        r.add_region(0, unit * 8, ANY).unwrap();
        let offs: Vec<u64> = (0..8).map(|_| r.alloc(unit, ANY).unwrap()).collect();
        (r, offs)
    }

    #[test]
    fn a_tags_ranges_take_in_their_neighbours_of_the_given_tags_only() {
        let (mut r, o) = eight();
        let unit = GRANULE * 4;
        // [ANY][S][ANY][S][OTHER][S][used][ANY]
        for (i, t) in [
            (0, ANY),
            (1, S),
            (2, ANY),
            (3, S),
            (4, OTHER),
            (5, S),
            (7, ANY),
        ] {
            r.free(o[i], t).unwrap();
        }
        let before_used = r.stats().used_bytes;
        assert_eq!(r.take_in(S, &[ANY]), unit * 2);
        r.validate().unwrap();
        assert_eq!(r.stats().used_bytes, before_used);
        // ranges 0-3 are one S range; OTHER kept apart; 5 stays S alone; 7 stays ANY.
        assert_eq!(r.largest_free(S), unit * 4);
        assert_eq!(r.largest_free(OTHER), unit);
        assert_eq!(r.largest_free(ANY), unit);
        assert_eq!(r.alloc(unit * 4, S), Some(0));
        // Nothing to take in: nothing changes.
        let snapshot = r.clone();
        assert_eq!(r.take_in(S, &[ANY]), 0);
        assert_eq!(r, snapshot);
    }

    #[test]
    fn the_best_fit_of_several_tags_is_taken_the_first_tags_among_equals() {
        let (mut r, o) = eight();
        let unit = GRANULE * 4;
        // [S][used][ANY ANY][used][OTHER][used][used]: S and OTHER one unit, ANY two.
        for (i, t) in [(0, S), (2, ANY), (3, ANY), (5, OTHER)] {
            r.free(o[i], t).unwrap();
        }
        assert_eq!(
            r.alloc_best_of(unit * 2, &[S, OTHER, ANY]),
            Some((o[2], ANY))
        );
        assert_eq!(r.alloc_best_of(unit, &[OTHER, S, ANY]), Some((o[5], OTHER)));
        assert_eq!(r.alloc_best_of(unit, &[S, S, ANY]), Some((o[0], S)));
        assert_eq!(r.alloc_best_of(unit, &[S, OTHER, ANY]), None);
        assert_eq!(r.alloc_best_of(GRANULE - 1, &[S]), None);
        r.validate().unwrap();
    }

    #[test]
    fn the_first_tags_fit_up_to_twice_the_length_ends_the_search() {
        let (mut r, o) = eight();
        let unit = GRANULE * 4;
        // [S S][used][ANY][used][S S S][used]: S fits one unit in 2 or 3, ANY exactly.
        for (i, t) in [(0, S), (1, S), (3, ANY), (5, S), (6, S), (7, S)] {
            r.free(o[i], t).unwrap();
        }
        // S's best fit (2 units) is at most twice 1 unit: taken, though ANY fits exactly.
        assert_eq!(r.alloc_best_of(unit, &[S, ANY]), Some((o[0], S)));
        // S's best fit for 1 unit is now the 1 unit left at o[1]; for S's 3 units against a
        // request of 1 (more than twice) ANY's exact fit wins once o[1] is taken.
        assert_eq!(r.alloc_best_of(unit, &[S, ANY]), Some((o[1], S)));
        assert_eq!(r.alloc_best_of(unit, &[S, ANY]), Some((o[3], ANY)));
        // ANY first: its rule, not S's.
        assert_eq!(r.alloc_best_of(unit, &[ANY, S]), Some((o[5], S)));
        r.validate().unwrap();
    }

    #[test]
    fn several_source_tags_and_a_chain_become_one_range() {
        let (mut r, o) = eight();
        let unit = GRANULE * 4;
        // [OTHER][ANY][S][OTHER][ANY][S][ANY][OTHER]
        for (i, t) in [
            (0, OTHER),
            (1, ANY),
            (2, S),
            (3, OTHER),
            (4, ANY),
            (5, S),
            (6, ANY),
            (7, OTHER),
        ] {
            r.free(o[i], t).unwrap();
        }
        assert_eq!(r.take_in(S, &[ANY, OTHER]), unit * 6);
        r.validate().unwrap();
        assert_eq!(r.largest_free(S), unit * 8);
        assert_eq!(r.free_tags(), vec![(S, unit * 8)]);
    }

    mod property {
        use super::super::super::{RangeAllocator, RangeInfo, GRANULE};
        use proptest::prelude::*;

        const TAGS: [u64; 4] = [1, 2, 3, u64::MAX];

        /// Whether a free range of `tag` lies beside a free range of a tag in `from`.
        fn touching(ranges: &[RangeInfo], tag: u64, from: &[u64]) -> bool {
            ranges
                .windows(2)
                .any(|w| match (w[0].free_tag, w[1].free_tag) {
                    (Some(a), Some(b)) => {
                        (a == tag && from.contains(&b)) || (b == tag && from.contains(&a))
                    }
                    _ => false,
                })
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]
            /// Random blocks freed under random tags, then one tag takes in one or two
            /// others (by `take_in`, or by a last free with `free_taking_in`): the
            /// allocator stays valid, allocated ranges and the free bytes of tags not
            /// named are untouched, what the named tags lose the taker gains, and no free
            /// range of the taker is left beside one of theirs.
            #[test]
            fn taking_in_moves_only_the_named_tags_neighbours(
                blocks in prop::collection::vec((1u64..6, 0usize..5), 2..40),
                taker in 0usize..3,
                from_two in any::<bool>(),
                by_free in any::<bool>(),
            ) {
                let mut r = RangeAllocator::new();
                let total: u64 = blocks.iter().map(|(g, _)| g * GRANULE).sum();
                r.add_region(0, total, u64::MAX).unwrap();
                let offs: Vec<u64> = blocks
                    .iter()
                    .map(|(g, _)| r.alloc(g * GRANULE, u64::MAX).unwrap())
                    .collect();
                let tag = TAGS[taker];
                let from: Vec<u64> = if from_two {
                    vec![u64::MAX, TAGS[(taker + 1) % 3]]
                } else {
                    vec![u64::MAX]
                };
                // Free every block whose pick is not 4 (kept allocated); with `by_free`
                // the last one freed under `tag` goes through `free_taking_in`.
                let freed: Vec<(u64, u64)> = blocks
                    .iter()
                    .zip(&offs)
                    .filter(|((_, pick), _)| *pick < 4)
                    .map(|((_, pick), &off)| (off, TAGS[*pick]))
                    .collect();
                let last_of_tag = freed.iter().rposition(|&(_, t)| t == tag).filter(|_| by_free);
                for (i, &(off, t)) in freed.iter().enumerate() {
                    if Some(i) != last_of_tag {
                        r.free(off, t).unwrap();
                    }
                }
                let before_used = r.stats().used_bytes;
                let mut bytes_before: std::collections::HashMap<u64, u64> =
                    r.free_tags().into_iter().collect();
                match last_of_tag {
                    Some(i) => {
                        let off = freed[i].0;
                        let len = r.allocated_len(off).unwrap();
                        *bytes_before.entry(tag).or_default() += len;
                        prop_assert_eq!(r.free_taking_in(off, tag, &from).unwrap(), len);
                        prop_assert_eq!(r.stats().used_bytes, before_used - len);
                    }
                    None => {
                        r.take_in(tag, &from);
                        prop_assert_eq!(r.stats().used_bytes, before_used);
                    }
                }
                r.validate().map_err(TestCaseError::fail)?;
                let after: std::collections::HashMap<u64, u64> = r.free_tags().into_iter().collect();
                let gained = after.get(&tag).copied().unwrap_or(0)
                    - bytes_before.get(&tag).copied().unwrap_or(0);
                let mut lost = 0;
                for t in TAGS {
                    let (b, a) = (
                        bytes_before.get(&t).copied().unwrap_or(0),
                        after.get(&t).copied().unwrap_or(0),
                    );
                    if from.contains(&t) && t != tag {
                        prop_assert!(a <= b);
                        lost += b - a;
                    } else if t != tag {
                        prop_assert_eq!(a, b, "tag {} not named changed", t);
                    }
                }
                prop_assert_eq!(gained, lost);
                if last_of_tag.is_none() {
                    prop_assert!(!touching(&r.ranges(0), tag, &from));
                }
            }
        }
    }
}
