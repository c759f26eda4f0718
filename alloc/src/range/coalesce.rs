//! Merging neighbouring ranges: [`RangeAllocator::join`] makes a run of linked ranges one
//! range, [`RangeAllocator::insert_free`] frees a range and merges it with its free
//! neighbours of the same tag (or of the tags it may take in, `across_tags.rs`).
//!
//! A merged range keeps the slot of the last range it joined, so a region's last range keeps
//! its slot (`Region::last`) through every free.

use super::{Block, RangeAllocator, Slot, State, NIL};

impl RangeAllocator {
    /// Make the ranges from slot `first` to slot `last` (linked, `first` not after `last`)
    /// one range in `last`'s slot, keeping `last`'s state; the others' slots and starts go.
    /// Returns `last`.
    pub(super) fn join(&mut self, first: Slot, last: Slot) -> Slot {
        if first == last {
            return last;
        }
        let (start, prev) = (self.blocks[first].start, self.blocks[first].prev);
        let mut len = 0;
        let mut at = first;
        while at != last {
            let b = self.blocks.remove(at);
            if at != first {
                self.starts.remove(&b.start);
            }
            len += b.len;
            at = b.next;
        }
        let old_start = self.blocks[last].start;
        self.starts.remove(&old_start);
        if let Some(s) = self.starts.get_mut(&start) {
            *s = last;
        }
        let b = &mut self.blocks[last];
        b.start = start;
        b.len += len;
        b.prev = prev;
        if prev != NIL {
            self.blocks[prev].next = last;
        }
        last
    }

    /// Make the range in `slot` free under `tag`, merged with its free neighbours of the same
    /// tag and with those whose tag is in `from` (retagged `tag`), and with what lies beyond
    /// them while it is free under `tag` or one of `from` (with `from` empty, one neighbour a
    /// side at most: two free ranges of one tag are never neighbours). The range must not be
    /// in the free index. Returns the merged range's slot.
    pub(super) fn insert_free(&mut self, slot: Slot, tag: u64, from: &[u64]) -> Slot {
        let first = self.reach(slot, tag, from, |b| b.prev);
        let last = self.reach(slot, tag, from, |b| b.next);
        let merged = self.join(first, last);
        let b = &mut self.blocks[merged];
        b.state = State::Free(tag);
        let (len, start) = (b.len, b.start);
        self.free_index.insert(tag, len, start);
        merged
    }

    /// The farthest range from `slot`, stepping to a neighbour with `step` (`prev` or
    /// `next`), through ranges that [`Self::takes_in`] takes in (they leave the free index).
    fn reach(&mut self, slot: Slot, tag: u64, from: &[u64], step: impl Fn(&Block) -> Slot) -> Slot {
        let mut at = slot;
        loop {
            let n = step(&self.blocks[at]);
            if n == NIL || !self.takes_in(n, tag, from) {
                return at;
            }
            at = n;
        }
    }

    /// Whether the range in `slot` is free under `tag` or one of `from`; if so it leaves the
    /// free index (a merge takes it in).
    fn takes_in(&mut self, slot: Slot, tag: u64, from: &[u64]) -> bool {
        let b = &self.blocks[slot];
        match b.state {
            State::Free(t) if t == tag || from.contains(&t) => {
                let (len, start) = (b.len, b.start);
                self.free_index.remove(t, len, start);
                true
            }
            _ => false,
        }
    }
}
