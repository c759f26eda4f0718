//! The sub-allocator's free index: every free range by tag, then by size class (segregated
//! fit, as in TLSF), with a bitmap of each tag's non-empty classes.
//!
//! A class covers a contiguous interval of lengths: one class per length below
//! [`SUBS`] granules, then [`SUBS`] classes per power of two (lengths are in granules).
//! Classes grow with the length, so a range in a higher class is longer than every range in
//! a lower one. Inside a class the ranges are ordered by (length, offset).
//!
//! [`FreeIndex::take_best_fit`] therefore makes the same choice as one ordered set of
//! (tag, length, offset): the smallest free range of the tag that fits, the lowest offset
//! among equal lengths. It looks in the request's own class first (an ordered search in a
//! set holding only that class's ranges), then takes the first range of the next non-empty
//! class, found in the bitmap.
#![forbid(unsafe_code)]

use std::collections::hash_map::Entry;
use std::collections::VecDeque;

use rustc_hash::FxHashMap;

use super::class_set::ClassSet;
use super::GRANULE;

/// log2 of the number of classes per power of two of a length in granules.
const SUB_BITS: u32 = 2;
/// Classes per power of two; lengths below this many granules have a class each.
const SUBS: usize = 1 << SUB_BITS;
/// Number of classes: a length below 2^64 bytes is below 2^55 granules.
const CLASSES: usize = (55 - SUB_BITS as usize + 1) * SUBS;
/// Words of a tag's bitmap of non-empty classes.
const WORDS: usize = CLASSES.div_ceil(64);

/// The class of ranges of `len` bytes (a non-zero multiple of [`GRANULE`]).
fn class_of(len: u64) -> usize {
    let granules = len / GRANULE;
    if granules < SUBS as u64 {
        return granules as usize;
    }
    let log2 = 63 - granules.leading_zeros();
    let sub = (granules >> (log2 - SUB_BITS)) as usize & (SUBS - 1);
    (log2 - SUB_BITS + 1) as usize * SUBS + sub
}

/// Emptied [`TagRanges`] kept for the next new tag: a stream's tag comes and goes with its
/// frees, and a new one would allocate its classes (and their nodes) again. Also how many
/// emptied tags stay in the index as they are (the latest ones): a stream whose one free
/// range is taken mostly frees another soon (a miss of the caches takes it and gives it
/// back), and moving the tag out and in again cost 12% of such a pair.
const SPARE_TAGS: usize = 4;

/// One tag's free ranges.
#[derive(Debug, Clone)]
struct TagRanges {
    /// Their bytes (0 in a spare or an emptied tag).
    bytes: u64,
    /// Bit `c` set when class `c` holds a range.
    nonempty: [u64; WORDS],
    /// (length, offset) by class (`range/class_set.rs`: a sorted vector while it is short).
    classes: Box<[ClassSet]>,
    /// In [`FreeIndex::emptied`] (a flag: the queue is not searched on each emptying).
    queued: bool,
}

/// Equal when they hold the same ranges (queued or not).
impl PartialEq for TagRanges {
    fn eq(&self, other: &Self) -> bool {
        (self.bytes, self.nonempty) == (other.bytes, other.nonempty)
            && self.classes == other.classes
    }
}

impl Eq for TagRanges {}

impl TagRanges {
    fn new() -> Self {
        Self {
            bytes: 0,
            nonempty: [0; WORDS],
            classes: (0..CLASSES).map(|_| ClassSet::default()).collect(),
            queued: false,
        }
    }

    /// The highest non-empty class.
    fn last_nonempty(&self) -> Option<usize> {
        let word = self.nonempty.iter().rposition(|&w| w != 0)?;
        Some(word * 64 + 63 - self.nonempty[word].leading_zeros() as usize)
    }

    /// The first non-empty class from `from` up.
    fn nonempty_from(&self, from: usize) -> Option<usize> {
        let mut word = from / 64;
        if word >= WORDS {
            return None;
        }
        let mut bits = self.nonempty[word] & (u64::MAX << (from % 64));
        loop {
            if bits != 0 {
                return Some(word * 64 + bits.trailing_zeros() as usize);
            }
            word += 1;
            bits = *self.nonempty.get(word)?;
        }
    }

    fn set_nonempty(&mut self, class: usize, nonempty: bool) {
        let bit = 1u64 << (class % 64);
        if nonempty {
            self.nonempty[class / 64] |= bit;
        } else {
            self.nonempty[class / 64] &= !bit;
        }
    }

    /// Whether it has just lost its last range and is not queued yet (it is, from now:
    /// the caller queues it with [`FreeIndex::emptied`]).
    fn newly_emptied(&mut self) -> bool {
        if self.bytes != 0 || self.queued {
            return false;
        }
        self.queued = true;
        true
    }

    /// Remove `(len, offset)` from `class`; whether it was there.
    fn remove(&mut self, class: usize, len: u64, offset: u64) -> bool {
        let Some(set) = self.classes.get_mut(class) else {
            return false;
        };
        if !set.remove(&(len, offset)) {
            return false;
        }
        self.bytes -= len;
        if set.is_empty() {
            self.set_nonempty(class, false);
        }
        true
    }
}

/// Free ranges by tag and size class. See the module docs.
#[derive(Debug, Clone, Default)]
pub(super) struct FreeIndex {
    /// Tags with free ranges.
    tags: FxHashMap<u64, TagRanges>,
    /// Number of ranges in the index.
    ranges: u64,
    /// Emptied tags' structures, for reuse (at most [`SPARE_TAGS`]).
    spare: Vec<TagRanges>,
    /// Tags that emptied and stay in `tags`, the oldest first, each once (at most
    /// [`SPARE_TAGS`]; one refilled since is skipped when its turn to leave comes).
    emptied: VecDeque<u64>,
}

/// Equal when they hold the same ranges (whatever their spares and emptied tags).
impl PartialEq for FreeIndex {
    fn eq(&self, other: &Self) -> bool {
        self.ranges == other.ranges
            && self.holding().count() == other.holding().count()
            && self
                .holding()
                .all(|(tag, t)| other.tags.get(&tag) == Some(t))
    }
}

impl Eq for FreeIndex {}

impl FreeIndex {
    /// Add the free range `[offset, offset + len)` under `tag`.
    pub(super) fn insert(&mut self, tag: u64, len: u64, offset: u64) {
        let spare = &mut self.spare;
        let t = self
            .tags
            .entry(tag)
            .or_insert_with(|| spare.pop().unwrap_or_else(TagRanges::new));
        let class = class_of(len);
        if t.classes[class].insert((len, offset)) {
            t.bytes += len;
            t.set_nonempty(class, true);
            self.ranges += 1;
        }
    }

    /// Remove the free range `[offset, offset + len)` of `tag`; whether it was there.
    pub(super) fn remove(&mut self, tag: u64, len: u64, offset: u64) -> bool {
        let Some(t) = self.tags.get_mut(&tag) else {
            return false;
        };
        if !t.remove(class_of(len), len, offset) {
            return false;
        }
        if t.newly_emptied() {
            self.emptied(tag);
        }
        self.ranges -= 1;
        true
    }

    /// `tag` (just marked queued) has no free range left: it stays, and the oldest emptied
    /// tag past [`SPARE_TAGS`] leaves (its structure kept as a spare), if it is still empty.
    /// A tag emptied again before its turn keeps its place (the caller skips queued tags).
    fn emptied(&mut self, tag: u64) {
        self.emptied.push_back(tag);
        if self.emptied.len() <= SPARE_TAGS {
            return;
        }
        let Some(oldest) = self.emptied.pop_front() else {
            return;
        };
        let Entry::Occupied(mut e) = self.tags.entry(oldest) else {
            return;
        };
        e.get_mut().queued = false;
        if e.get().bytes == 0 {
            let t = e.remove();
            if self.spare.len() < SPARE_TAGS {
                self.spare.push(t);
            }
        }
    }

    /// The smallest free range of `tag` at least `len` bytes long, the lowest offset among
    /// equal lengths, as `(length, offset, size class)`.
    fn find_best_fit(&self, tag: u64, len: u64) -> Option<(u64, u64, usize)> {
        let t = self.tags.get(&tag)?;
        let own = class_of(len);
        match t.classes.get(own).and_then(|set| set.first_from((len, 0))) {
            Some((flen, offset)) => Some((flen, offset, own)),
            None => {
                let class = t.nonempty_from(own + 1)?;
                let (flen, offset) = t.classes[class].first()?;
                Some((flen, offset, class))
            }
        }
    }

    /// Of the free ranges of `tags`, remove and return the smallest at least `len` bytes
    /// long as `(tag, length, offset)`: the first tag's among equal lengths, the lowest
    /// offset within a tag. A fit of exactly `len` ends the search, and so does a fit of the
    /// first tag at most twice `len` long: the first tag is the caller's own (a stream's
    /// frees), and taking the other tags' space whenever it fits better made two streams
    /// take each other's room in turn (each miss settling the other stream: the second KV
    /// trace's warm replay ran 1.3x the instructions), and reserved more
    /// (`bench/results/sim-2026-12-02-take-in.md`).
    pub(super) fn take_best_fit_of(&mut self, tags: &[u64], len: u64) -> Option<(u64, u64, u64)> {
        let mut best: Option<(u64, u64, u64, usize)> = None;
        for (i, &tag) in tags.iter().enumerate() {
            if tags[..i].contains(&tag) {
                continue;
            }
            if let Some((flen, offset, class)) = self.find_best_fit(tag, len) {
                if best.is_none_or(|(_, l, ..)| flen < l) {
                    best = Some((tag, flen, offset, class));
                    if flen == len || (i == 0 && flen / 2 <= len) {
                        break;
                    }
                }
            }
        }
        let (tag, flen, offset, class) = best?;
        self.take(tag, flen, offset, class);
        Some((tag, flen, offset))
    }

    /// Remove and return, as `(length, offset)`, the smallest free range of `tag` at least
    /// `len` bytes long, the lowest offset among equal lengths.
    pub(super) fn take_best_fit(&mut self, tag: u64, len: u64) -> Option<(u64, u64)> {
        let (flen, offset, class) = self.find_best_fit(tag, len)?;
        self.take(tag, flen, offset, class);
        Some((flen, offset))
    }

    /// Remove a range [`Self::find_best_fit`] found.
    fn take(&mut self, tag: u64, flen: u64, offset: u64, class: usize) {
        let Some(t) = self.tags.get_mut(&tag) else {
            return;
        };
        t.remove(class, flen, offset);
        if t.newly_emptied() {
            self.emptied(tag);
        }
        self.ranges -= 1;
    }

    /// The length of the longest free range of `tag` (0 when none).
    pub(super) fn largest(&self, tag: u64) -> u64 {
        self.tags
            .get(&tag)
            .and_then(|t| t.classes[t.last_nonempty()?].last())
            .map_or(0, |(len, _)| len)
    }

    /// The free ranges of `tag` as `(offset, length)`, by length then offset.
    pub(super) fn ranges_of(&self, tag: u64) -> Vec<(u64, u64)> {
        self.tags.get(&tag).map_or_else(Vec::new, |t| {
            t.classes
                .iter()
                .flat_map(ClassSet::iter)
                .map(|(len, offset)| (offset, len))
                .collect()
        })
    }

    /// Whether `[offset, offset + len)` is in the index under `tag`.
    pub(super) fn contains(&self, tag: u64, len: u64, offset: u64) -> bool {
        self.tags
            .get(&tag)
            .and_then(|t| t.classes.get(class_of(len)))
            .is_some_and(|set| set.contains(&(len, offset)))
    }

    /// Number of free ranges.
    pub(super) fn len(&self) -> u64 {
        self.ranges
    }

    /// The free bytes of `tag`.
    pub(super) fn tag_bytes_of(&self, tag: u64) -> u64 {
        self.tags.get(&tag).map_or(0, |t| t.bytes)
    }

    /// Tags with free ranges and their free bytes, in no order.
    pub(super) fn tag_bytes(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.holding().map(|(tag, t)| (tag, t.bytes))
    }

    /// The tags that hold free ranges (not the emptied ones still kept), in no order.
    fn holding(&self) -> impl Iterator<Item = (u64, &TagRanges)> + '_ {
        self.tags
            .iter()
            .filter(|(_, t)| t.bytes > 0)
            .map(|(&tag, t)| (tag, t))
    }

    /// Check the index's own invariants: every range in its class, the bitmaps, the bytes
    /// and the count agree with the sets, no tag without ranges but the emptied ones (at
    /// most [`SPARE_TAGS`]), the spares empty.
    pub(super) fn validate(&self) -> Result<(), String> {
        let mut ranges = 0u64;
        for (&tag, t) in &self.tags {
            let mut bytes = 0u64;
            for (class, set) in t.classes.iter().enumerate() {
                let bit = (t.nonempty[class / 64] >> (class % 64)) & 1 == 1;
                if bit == set.is_empty() {
                    return Err(format!("tag {tag:#x}: class {class}'s bit is wrong"));
                }
                for (len, offset) in set.iter() {
                    if class_of(len) != class {
                        return Err(format!("free range {offset:#x}+{len} in class {class}"));
                    }
                    bytes += len;
                    ranges += 1;
                }
            }
            let bits: u32 = t.nonempty.iter().map(|w| w.count_ones()).sum();
            let sets = t.classes.iter().filter(|s| !s.is_empty()).count();
            if bits as usize != sets {
                return Err(format!("tag {tag:#x}: bits set for absent classes"));
            }
            if bytes != t.bytes {
                return Err(format!(
                    "tag {tag:#x}: {} bytes recorded, {bytes} found",
                    t.bytes
                ));
            }
            if t.queued != self.emptied.contains(&tag) {
                return Err(format!("tag {tag:#x}: its queued flag is wrong"));
            }
            if bytes == 0 && !t.queued {
                return Err(format!(
                    "tag {tag:#x} has no range and is not an emptied one"
                ));
            }
        }
        if self.emptied.len() > SPARE_TAGS {
            return Err(format!("{} emptied tags kept", self.emptied.len()));
        }
        if self.spare.len() > SPARE_TAGS
            || self.spare.iter().any(|t| {
                t.bytes != 0
                    || t.queued
                    || t.nonempty != [0; WORDS]
                    || t.classes.iter().any(|s| !s.is_empty())
            })
        {
            return Err("a spare tag structure is not empty".into());
        }
        if ranges != self.ranges {
            return Err(format!(
                "{} free ranges counted, {ranges} found",
                self.ranges
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    #[test]
    fn classes_are_contiguous_and_grow_with_the_length() {
        let mut prev = class_of(GRANULE);
        for granules in 2..100_000u64 {
            let c = class_of(granules * GRANULE);
            assert!(
                c == prev || c == prev + 1,
                "{granules} granules: {prev} -> {c}"
            );
            prev = c;
        }
        assert_eq!(class_of(!(GRANULE - 1)), CLASSES - 1);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert { tag: u64, granules: u64, slot: u64 },
        Remove { pick: usize },
        Take { tag: u64, granules: u64 },
    }

    /// More tags than [`SPARE_TAGS`]: emptied tags leave the index, and come back.
    const TAGS: u64 = SPARE_TAGS as u64 + 4;

    fn granules() -> impl Strategy<Value = u64> {
        prop_oneof![1u64..40, 1u64..5000, (1u64..1 << 20).prop_map(|g| g << 20)]
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0u64..TAGS, granules(), 0u64..64).prop_map(|(tag, granules, slot)| Op::Insert { tag, granules, slot }),
            2 => any::<usize>().prop_map(|pick| Op::Remove { pick }),
            4 => (0u64..TAGS, granules()).prop_map(|(tag, granules)| Op::Take { tag, granules }),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]
        /// The index against one ordered set of (tag, length, offset), the reference for
        /// best fit: the first entry from (tag, len, 0) on, if it has the same tag.
        #[test]
        fn best_fit_matches_an_ordered_set(ops in prop::collection::vec(op(), 1..300)) {
            let mut index = FreeIndex::default();
            let mut model: BTreeSet<(u64, u64, u64)> = BTreeSet::new();
            let mut inserted = 0u64;
            for op in ops {
                match op {
                    Op::Insert { tag, granules, slot } => {
                        // Distinct offsets (ranges never share a start); many equal lengths.
                        let offset = (slot << 50) | (inserted * GRANULE);
                        inserted += 1;
                        let len = granules * GRANULE;
                        index.insert(tag, len, offset);
                        model.insert((tag, len, offset));
                    }
                    Op::Remove { pick } => {
                        if let Some(&(tag, len, offset)) = model.iter().nth(pick % model.len().max(1)) {
                            prop_assert!(index.remove(tag, len, offset));
                            prop_assert!(!index.remove(tag, len, offset));
                            model.remove(&(tag, len, offset));
                        }
                    }
                    Op::Take { tag, granules } => {
                        let len = granules * GRANULE;
                        let want = model
                            .range((tag, len, 0)..=(tag, u64::MAX, u64::MAX))
                            .next()
                            .copied();
                        if let Some(entry) = want {
                            model.remove(&entry);
                        }
                        prop_assert_eq!(
                            index.take_best_fit(tag, len),
                            want.map(|(_, len, offset)| (len, offset))
                        );
                    }
                }
                index.validate().map_err(TestCaseError::fail)?;
                prop_assert_eq!(index.len(), model.len() as u64);
                for tag in 0..TAGS {
                    let of_tag: Vec<(u64, u64)> = model
                        .range((tag, 0, 0)..=(tag, u64::MAX, u64::MAX))
                        .map(|&(_, len, offset)| (offset, len))
                        .collect();
                    prop_assert_eq!(index.largest(tag), of_tag.last().map_or(0, |r| r.1));
                    prop_assert_eq!(
                        index.tag_bytes().find(|t| t.0 == tag).map(|t| t.1),
                        Some(of_tag.iter().map(|r| r.1).sum::<u64>()).filter(|&b| b > 0)
                    );
                    prop_assert_eq!(index.ranges_of(tag), of_tag);
                }
            }
            // Emptied the same way or not, equal contents compare equal.
            let mut rebuilt = FreeIndex::default();
            for &(tag, len, offset) in &model {
                rebuilt.insert(tag, len, offset);
            }
            prop_assert_eq!(&index, &rebuilt);
        }
    }
}
