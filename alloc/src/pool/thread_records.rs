//! The records of one thread cache (`pool/thread_cache.rs`): every plain allocation it
//! recorded and every block freed into it, in one table, so that a warm alloc/free pair
//! costs two hash operations (an allocator's floor: find the block, find the record).
//!
//! - **Slots**: one per block the cache knows, live or freed, holding its record
//!   ([`FrontLive`]). A freed block keeps its slot (marked free): its next allocation
//!   only marks it live again, with no insert.
//! - **Address map**: block address to slot, the only hash a free does.
//! - **Free lists**: by (stream, [`cache_len`]), each a stack of free slots; a slot
//!   remembers its list once it has been freed into one, so a free pushes without hashing
//!   the key again. The only hash an allocation does is finding its list.
//!
//! A slot leaves the table when its block leaves the cache: drained to the sub-allocator
//! ([`ThreadRecords::drain_free`]), or its record taken by the device
//! ([`ThreadRecords::take_live`], promotion). Lists are never removed while a slot may name
//! them, except by [`ThreadRecords::drain_free`]'s compaction, which renumbers them.

use rustc_hash::FxHashMap;

use super::classes::Class;
use super::device::{cache_key_parts, cache_len};
use super::thread_cache::FrontLive;

/// A slot's list before its block was first freed into the cache.
const NO_LIST: u32 = u32::MAX;

/// More lists than this after a drain: the empty ones are removed (a process that keeps
/// making streams would otherwise keep one empty list per stream and size).
const MAX_LISTS: usize = 256;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Vacant,
    Live,
    Free,
}

#[derive(Debug, Clone, Copy)]
struct Slot {
    ptr: u64,
    rec: FrontLive,
    /// Index of its free list in [`ThreadRecords::lists`], or [`NO_LIST`].
    list: u32,
    state: State,
}

/// Free slots of one (stream, [`cache_len`]).
#[derive(Debug)]
struct FreeList {
    stream: u64,
    key: u64,
    slots: Vec<u32>,
}

/// What [`ThreadRecords::live_slot`] found: a live record's slot.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LiveSlot(u32);

/// One thread cache's records and free blocks (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct ThreadRecords {
    at: FxHashMap<u64, u32>,
    slots: Vec<Slot>,
    vacant: Vec<u32>,
    lists: Vec<FreeList>,
    list_at: FxHashMap<(u64, u64), u32>,
    /// Bytes of the free blocks.
    free_bytes: u64,
}

impl ThreadRecords {
    /// Bytes of the blocks freed into the cache.
    #[inline]
    pub(crate) fn free_bytes(&self) -> u64 {
        self.free_bytes
    }

    /// A free block of `len` bytes and tag `tag` freed on `stream`, marked live as an
    /// allocation of `requested` bytes: its address and arena key. One hash operation.
    #[inline]
    pub(crate) fn alloc_free(
        &mut self,
        stream: u64,
        len: u64,
        tag: u8,
        requested: u64,
    ) -> Option<(u64, usize)> {
        let &list = self.list_at.get(&(stream, cache_len(len, tag)))?;
        let i = self.lists[list as usize].slots.pop()?;
        let slot = &mut self.slots[i as usize];
        debug_assert_eq!(slot.state, State::Free);
        slot.state = State::Live;
        slot.rec.requested = requested;
        self.free_bytes -= len;
        Some((slot.ptr, slot.rec.arena))
    }

    /// Record a live allocation (made under the device lock) at `ptr`.
    pub(crate) fn insert_live(&mut self, ptr: u64, rec: FrontLive) {
        let slot = Slot {
            ptr,
            rec,
            list: NO_LIST,
            state: State::Live,
        };
        let i = match self.vacant.pop() {
            Some(i) => {
                self.slots[i as usize] = slot;
                i
            }
            None => {
                self.slots.push(slot);
                (self.slots.len() - 1) as u32
            }
        };
        if let Some(old) = self.at.insert(ptr, i) {
            // A block is recorded once: the sub-allocator does not hand out a block it
            // still holds allocated for a cache.
            tracing::error!(ptr, "a thread cache recorded a block twice");
            self.vacate(old);
        }
    }

    /// The slot of the live record of `ptr`, if this cache holds one. One hash operation.
    #[inline]
    pub(crate) fn live_slot(&self, ptr: u64) -> Option<(LiveSlot, FrontLive)> {
        let &i = self.at.get(&ptr)?;
        let slot = &self.slots[i as usize];
        (slot.state == State::Live).then_some((LiveSlot(i), slot.rec))
    }

    /// Mark a live slot free, its block (`len` bytes) onto its free list.
    #[inline]
    pub(crate) fn free_slot(&mut self, LiveSlot(i): LiveSlot, len: u64) {
        let slot = &mut self.slots[i as usize];
        slot.state = State::Free;
        let list = if slot.list != NO_LIST {
            slot.list
        } else {
            let (stream, key) = (slot.rec.stream, cache_len(len, slot.rec.tag));
            let next = self.lists.len() as u32;
            let list = *self.list_at.entry((stream, key)).or_insert(next);
            if list == next {
                self.lists.push(FreeList {
                    stream,
                    key,
                    slots: Vec::new(),
                });
            }
            slot.list = list;
            list
        };
        self.lists[list as usize].slots.push(i);
        self.free_bytes += len;
    }

    /// Take the live record of `ptr` out of the table (to promote it).
    pub(crate) fn take_live(&mut self, ptr: u64) -> Option<FrontLive> {
        let &i = self.at.get(&ptr)?;
        let slot = self.slots[i as usize];
        if slot.state != State::Live {
            return None;
        }
        self.at.remove(&ptr);
        self.vacate(i);
        Some(slot.rec)
    }

    /// Take every live record out of the table.
    pub(crate) fn take_all_live(&mut self, out: &mut Vec<(u64, FrontLive)>) {
        for i in 0..self.slots.len() {
            let slot = self.slots[i];
            if slot.state == State::Live {
                self.at.remove(&slot.ptr);
                self.vacate(i as u32);
                out.push((slot.ptr, slot.rec));
            }
        }
    }

    /// The live records, by address.
    pub(crate) fn live(&self) -> impl Iterator<Item = (u64, &FrontLive)> {
        self.slots
            .iter()
            .filter(|s| s.state == State::Live)
            .map(|s| (s.ptr, &s.rec))
    }

    /// The free blocks: address and length.
    pub(crate) fn free_blocks(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.lists.iter().flat_map(move |l| {
            let len = cache_key_parts(l.key).0;
            l.slots
                .iter()
                .map(move |&i| (self.slots[i as usize].ptr, len))
        })
    }

    /// Move the free blocks longer than `min_len` (of `class` only, if given) out of the
    /// table into `out`, by (stream, class index).
    pub(crate) fn drain_free(
        &mut self,
        min_len: u64,
        class: Option<Class>,
        out: &mut Vec<((u64, usize), Vec<u64>)>,
    ) {
        if self.free_bytes == 0 {
            return;
        }
        for l in 0..self.lists.len() {
            let list = &self.lists[l];
            let (len, tag) = cache_key_parts(list.key);
            let of = Class::of(tag as u8, len);
            if list.slots.is_empty() || len <= min_len || class.is_some_and(|c| c != of) {
                continue;
            }
            let stream = list.stream;
            let taken = std::mem::take(&mut self.lists[l].slots);
            self.free_bytes -= len * taken.len() as u64;
            let mut ptrs = Vec::with_capacity(taken.len());
            for i in taken {
                let ptr = self.slots[i as usize].ptr;
                self.at.remove(&ptr);
                self.vacate(i);
                ptrs.push(ptr);
            }
            out.push(((stream, of.index()), ptrs));
        }
        if self.lists.len() > MAX_LISTS {
            self.remove_empty_lists();
        }
    }

    /// Remove the empty free lists, renumbering the rest in the slots that name them (a
    /// live slot whose list went finds it again at its next free).
    fn remove_empty_lists(&mut self) {
        let mut renumber = vec![NO_LIST; self.lists.len()];
        let mut kept = 0u32;
        for (old, l) in self.lists.iter().enumerate() {
            if !l.slots.is_empty() {
                renumber[old] = kept;
                kept += 1;
            }
        }
        self.lists.retain(|l| !l.slots.is_empty());
        self.list_at.clear();
        for (i, l) in self.lists.iter().enumerate() {
            self.list_at.insert((l.stream, l.key), i as u32);
        }
        for slot in &mut self.slots {
            if slot.list != NO_LIST {
                slot.list = renumber[slot.list as usize];
            }
        }
    }

    fn vacate(&mut self, i: u32) {
        let slot = &mut self.slots[i as usize];
        slot.state = State::Vacant;
        slot.list = NO_LIST;
        self.vacant.push(i);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn rec(stream: u64, requested: u64) -> FrontLive {
        FrontLive {
            arena: 1,
            requested,
            stream,
            tag: 0,
        }
    }

    /// A freed block keeps its slot: the next allocation of its size on its stream takes
    /// it; another stream's does not; a freed block has no live record (a second free of
    /// it is not this table's to accept).
    #[test]
    fn a_freed_block_is_reused_on_its_stream_only() {
        let mut t = ThreadRecords::default();
        t.insert_live(0x1000, rec(7, 4096));
        let (slot, r) = t.live_slot(0x1000).unwrap();
        assert_eq!(r, rec(7, 4096));
        t.free_slot(slot, 4096);
        assert_eq!(t.free_bytes(), 4096);
        assert!(t.live_slot(0x1000).is_none());
        assert!(t.take_live(0x1000).is_none());
        assert!(t.alloc_free(8, 4096, 0, 4096).is_none());
        assert_eq!(t.alloc_free(7, 4096, 0, 4000), Some((0x1000, 1)));
        assert_eq!(t.live_slot(0x1000).unwrap().1.requested, 4000);
        assert_eq!(t.free_bytes(), 0);
        assert_eq!(t.take_live(0x1000), Some(rec(7, 4000)));
        assert!(t.live_slot(0x1000).is_none());
    }

    /// Draining takes the free blocks out (the live records stay), and with many lists the
    /// empty ones go while live slots still find their lists.
    #[test]
    fn draining_keeps_live_records_and_lists_consistent() {
        let mut t = ThreadRecords::default();
        let n = (MAX_LISTS + 10) as u64;
        for s in 0..n {
            let ptr = 0x10000 * (s + 1);
            t.insert_live(ptr, rec(s, 4096));
            let (slot, _) = t.live_slot(ptr).unwrap();
            t.free_slot(slot, 4096);
            // Reallocated: live again, its slot naming its list.
            assert_eq!(t.alloc_free(s, 4096, 0, 4096), Some((ptr, 1)));
        }
        // Stream 0's block freed: the one free block.
        let (slot, _) = t.live_slot(0x10000).unwrap();
        t.free_slot(slot, 4096);
        let mut out = Vec::new();
        t.drain_free(0, None, &mut out);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].1, vec![0x10000]);
        assert_eq!(t.free_bytes(), 0);
        assert!(t.lists.is_empty());
        assert_eq!(t.live().count(), n as usize - 1);
        // Each live block frees into (and reallocates from) its own stream's list again.
        for s in 1..n {
            let ptr = 0x10000 * (s + 1);
            let (slot, _) = t.live_slot(ptr).unwrap();
            t.free_slot(slot, 4096);
            assert!(t.alloc_free(s + 1000, 4096, 0, 4096).is_none());
            assert_eq!(t.alloc_free(s, 4096, 0, 4096), Some((ptr, 1)));
        }
        let mut all = Vec::new();
        t.take_all_live(&mut all);
        assert_eq!(all.len(), n as usize - 1);
        assert_eq!(t.live().count(), 0);
        assert!(t.at.is_empty());
    }
}
