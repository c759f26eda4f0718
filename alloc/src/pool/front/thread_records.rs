//! The records of one thread cache (`pool/front/thread_cache.rs`): every plain allocation it
//! recorded and every block freed into it, in one map, so that a warm alloc/free pair
//! touches one record, with no insert or remove.
//!
//! - **Records**: block address to its record ([`FrontLive`], packed in 24 bytes), live or
//!   free, in an [`AddrTable`] (`pool/front/addr_table.rs`: the address's hash names the slot,
//!   which holds the key and the record, 32 bytes). A freed block keeps its record (marked
//!   free): its next allocation only marks it live again. A free is one lookup, and the
//!   lookup is the one cold memory access (a table of slots beside the map cost a second
//!   one, and the KV trace, whose frees come in no particular order, ran no faster for it).
//! - **Free lists**: by (stream, [`cache_len`]), each a stack of free blocks' addresses;
//!   a record remembers its list once its block has been freed into one, so a free pushes
//!   without hashing the key. An allocation finds its list (a small, hot map), pops an
//!   address and marks that record live.
//!
//! A record leaves the map when its block leaves the cache: drained to the sub-allocator
//! ([`ThreadRecords::drain_free`]), or taken by the device ([`ThreadRecords::take_live`],
//! promotion). Lists are not removed while a record may name them, except by
//! [`ThreadRecords::drain_free`]'s compaction, which renumbers them.

use rustc_hash::FxHashMap;

use super::addr_table::{AddrTable, NO_KEY};
use super::cache_key::{cache_key_parts, cache_len};
use super::cached_runs::fitting_run;
use crate::pool::sizes::classes::Class;
use crate::range::Beside;

/// A record's list before its block was first freed into the cache.
const NO_LIST: u16 = u16::MAX;

/// More lists than this after a drain: the empty ones are removed (a process that keeps
/// making streams would otherwise keep one empty list per stream and size).
const MAX_LISTS: usize = 256;

/// A plain live allocation recorded in a thread cache: no share, no extra stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FrontLive {
    /// Arena key (slab index) of its arena.
    pub(crate) arena: usize,
    pub(crate) requested: u64,
    pub(crate) stream: u64,
    /// Tag index of its arena.
    pub(crate) tag: u8,
}

/// A [`FrontLive`] and its cache state, packed in 24 bytes (a slot of the records' table
/// is 32). A block whose arena key does not fit `u32` is not recorded here (the device's
/// own records take it), nor freed into a list past the `u16` range (4 billion arenas, or
/// 65,535 lists between two drains: no process gets there).
#[derive(Debug, Clone, Copy, Default)]
struct Record {
    requested: u64,
    stream: u64,
    arena: u32,
    /// Index of its free list in [`ThreadRecords::lists`], or [`NO_LIST`].
    list: u16,
    tag: u8,
    /// Its block is on that free list (else it is live).
    free: bool,
}

impl Record {
    fn live(&self) -> FrontLive {
        FrontLive {
            arena: self.arena as usize,
            requested: self.requested,
            stream: self.stream,
            tag: self.tag,
        }
    }
}

/// Free blocks of one (stream, [`cache_len`]), by address.
#[derive(Debug)]
struct FreeList {
    stream: u64,
    key: u64,
    ptrs: Vec<u64>,
}

impl FreeList {
    /// The size class of its blocks.
    fn class(&self, huge_min: u64) -> Class {
        let (len, tag) = cache_key_parts(self.key);
        Class::of(tag as u8, len, huge_min)
    }
}

/// What [`ThreadRecords::free_live`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FreeOutcome {
    /// No live record of the block here.
    Absent,
    /// Recorded here, but the caller's check declined it: nothing changed.
    Declined,
    /// Freed into its list: the record, and the block's length.
    Freed(FrontLive, u64),
}

/// One thread cache's records and free blocks (see the module docs).
/// `repr(C)`, the fields a warm allocation or free touches first, in the order
/// `ThreadCache` (`pool/front/thread_cache.rs`) lays them out on cache lines.
#[derive(Debug)]
#[repr(C)]
pub(crate) struct ThreadRecords {
    /// The list the last allocation found: (stream, key, index), or [`NO_MEMO`]. A thread
    /// mostly allocates one size on one stream (KV blocks), and this skips the hash.
    memo: (u64, u64, u16),
    at: AddrTable<Record>,
    lists: Vec<FreeList>,
    /// Bytes of the free blocks.
    free_bytes: u64,
    list_at: FxHashMap<(u64, u64), u16>,
}

/// No list remembered (no key has every low bit set: a tag index is below 256).
const NO_MEMO: (u64, u64, u16) = (u64::MAX, u64::MAX, NO_LIST);

impl Default for ThreadRecords {
    fn default() -> Self {
        Self {
            memo: NO_MEMO,
            at: AddrTable::default(),
            lists: Vec::new(),
            free_bytes: 0,
            list_at: FxHashMap::default(),
        }
    }
}

impl ThreadRecords {
    /// Bytes of the blocks freed into the cache.
    #[inline]
    pub(crate) fn free_bytes(&self) -> u64 {
        self.free_bytes
    }

    /// A free block of `len` bytes and tag `tag` freed on `stream`, marked live as an
    /// allocation of `requested` bytes: its address and arena key.
    #[inline]
    pub(crate) fn alloc_free(
        &mut self,
        stream: u64,
        len: u64,
        tag: u8,
        requested: u64,
    ) -> Option<(u64, usize)> {
        let key = cache_len(len, tag);
        let list = match self.memo {
            (s, k, list) if (s, k) == (stream, key) => list,
            _ => {
                let &list = self.list_at.get(&(stream, key))?;
                self.memo = (stream, key, list);
                list
            }
        };
        let ptr = self.lists[list as usize].ptrs.pop()?;
        self.free_bytes -= len;
        let Some(r) = self.at.get_mut(ptr) else {
            // Every listed block has its record: a block without one is dropped from the
            // cache (still allocated in the ranges: found by `validate`).
            tracing::error!(ptr, "a thread cache listed a block without its record");
            return None;
        };
        r.free = false;
        r.requested = requested;
        Some((ptr, r.arena as usize))
    }

    /// Record a live allocation (made under the device lock) at `ptr`. `false` (nothing
    /// recorded) when its record does not fit here: the caller records it itself.
    pub(crate) fn insert_live(&mut self, ptr: u64, rec: FrontLive) -> bool {
        let Ok(arena) = u32::try_from(rec.arena) else {
            return false;
        };
        if ptr == NO_KEY {
            return false;
        }
        let record = Record {
            requested: rec.requested,
            stream: rec.stream,
            arena,
            list: NO_LIST,
            tag: rec.tag,
            free: false,
        };
        if self.at.insert(ptr, record).is_some() {
            // A block is recorded once: the sub-allocator does not hand out a block it
            // still holds allocated for a cache.
            tracing::error!(ptr, "a thread cache recorded a block twice");
        }
        true
    }

    /// Free the live record of `ptr` into its free list if `accept` (given the record)
    /// returns the block's length. One hash lookup.
    #[inline]
    pub(crate) fn free_live(
        &mut self,
        ptr: u64,
        accept: impl FnOnce(&FrontLive) -> Option<u64>,
    ) -> FreeOutcome {
        let Some(r) = self.at.get_mut(ptr) else {
            return FreeOutcome::Absent;
        };
        if r.free {
            return FreeOutcome::Absent;
        }
        let rec = r.live();
        let Some(len) = accept(&rec) else {
            return FreeOutcome::Declined;
        };
        if r.list == NO_LIST {
            let (stream, key) = (r.stream, cache_len(len, r.tag));
            r.list = match self.list_at.get(&(stream, key)) {
                Some(&list) => list,
                None => {
                    // A new list, unless its index would be the "no list" mark.
                    let next = match u16::try_from(self.lists.len()) {
                        Ok(next) if next != NO_LIST => next,
                        _ => return FreeOutcome::Declined,
                    };
                    self.list_at.insert((stream, key), next);
                    self.lists.push(FreeList {
                        stream,
                        key,
                        ptrs: Vec::new(),
                    });
                    next
                }
            };
        }
        r.free = true;
        self.lists[r.list as usize].ptrs.push(ptr);
        self.free_bytes += len;
        FreeOutcome::Freed(rec, len)
    }

    /// Take the live record of `ptr` out of the map (to promote it). One lookup.
    pub(crate) fn take_live(&mut self, ptr: u64) -> Option<FrontLive> {
        self.at.remove_if(ptr, |r| !r.free).map(|r| r.live())
    }

    /// Take every live record out of the map.
    pub(crate) fn take_all_live(&mut self, out: &mut Vec<(u64, FrontLive)>) {
        self.at.retain(|ptr, r| {
            if !r.free {
                out.push((ptr, r.live()));
            }
            r.free
        });
    }

    /// The live records, by address.
    pub(crate) fn live(&self) -> impl Iterator<Item = (u64, FrontLive)> + '_ {
        self.at
            .iter()
            .filter(|(_, r)| !r.free)
            .map(|(ptr, r)| (ptr, r.live()))
    }

    /// The free blocks: address and length.
    pub(crate) fn free_blocks(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.lists.iter().flat_map(|l| {
            let len = cache_key_parts(l.key).0;
            l.ptrs.iter().map(move |&ptr| (ptr, len))
        })
    }

    /// Move the free blocks longer than `min_len` (of `class` only, if given) out of the
    /// cache into `out`, by (stream, class index).
    pub(crate) fn drain_free(
        &mut self,
        min_len: u64,
        class: Option<Class>,
        huge_min: u64,
        out: &mut Vec<((u64, usize), Vec<u64>)>,
    ) {
        if self.free_bytes == 0 {
            return;
        }
        for list in &mut self.lists {
            let len = cache_key_parts(list.key).0;
            if list.ptrs.is_empty() || len <= min_len {
                continue;
            }
            let of = list.class(huge_min);
            if class.is_some_and(|c| c != of) {
                continue;
            }
            // The list keeps its capacity: its blocks come back after the flush.
            let keep = Vec::with_capacity(list.ptrs.len());
            let ptrs = std::mem::replace(&mut list.ptrs, keep);
            self.free_bytes -= len * ptrs.len() as u64;
            for &ptr in &ptrs {
                self.at.remove(ptr);
            }
            out.push(((list.stream, of.index()), ptrs));
        }
        if self.lists.len() > MAX_LISTS {
            self.remove_empty_lists();
        }
        self.at.shrink_if_sparse();
    }

    /// Take out of the cache the run of free blocks freed on `stream` (of `class`) that
    /// [`fitting_run`] picks for a request of `need` bytes, `beside` being the
    /// sub-allocator's view of a block (`pool/front/cached_runs.rs`). Returns their addresses, in
    /// address order; nothing when no run fits.
    pub(crate) fn take_run(
        &mut self,
        stream: u64,
        class: Class,
        huge_min: u64,
        need: u64,
        beside: impl Fn(u64) -> Option<Beside>,
    ) -> Vec<u64> {
        if self.free_bytes == 0 {
            return Vec::new();
        }
        let in_scope: Vec<u16> = (0..self.lists.len())
            .filter(|&i| {
                let l = &self.lists[i];
                l.stream == stream && !l.ptrs.is_empty() && l.class(huge_min) == class
            })
            .filter_map(|i| u16::try_from(i).ok())
            .collect();
        if in_scope.is_empty() {
            return Vec::new();
        }
        let at = &self.at;
        let is_cached = |ptr: u64| {
            at.get(ptr)
                .is_some_and(|r| r.free && in_scope.contains(&r.list))
        };
        // The most recently freed first.
        let candidates = in_scope
            .iter()
            .flat_map(|&i| self.lists[i as usize].ptrs.iter().rev().copied());
        let run = fitting_run(candidates, need, is_cached, beside);
        if run.is_empty() {
            return run;
        }
        for &i in &in_scope {
            let list = &mut self.lists[i as usize];
            let len = cache_key_parts(list.key).0;
            let before = list.ptrs.len();
            list.ptrs.retain(|p| run.binary_search(p).is_err());
            self.free_bytes -= len * (before - list.ptrs.len()) as u64;
        }
        for &ptr in &run {
            self.at.remove(ptr);
        }
        self.at.shrink_if_sparse();
        run
    }

    /// Remove the empty free lists, renumbering the rest in the records that name them (a
    /// live record whose list went finds it again at its next free).
    fn remove_empty_lists(&mut self) {
        let mut renumber = vec![NO_LIST; self.lists.len()];
        let mut kept = 0u16;
        for (old, l) in self.lists.iter().enumerate() {
            if !l.ptrs.is_empty() {
                renumber[old] = kept;
                kept += 1;
            }
        }
        self.lists.retain(|l| !l.ptrs.is_empty());
        self.list_at.clear();
        self.memo = NO_MEMO;
        for (i, l) in self.lists.iter().enumerate() {
            self.list_at.insert((l.stream, l.key), i as u16);
        }
        for r in self.at.values_mut() {
            if r.list != NO_LIST {
                r.list = renumber[r.list as usize];
            }
        }
    }
}

/// Where [`ThreadRecords`]'s remembered list ends, and where the fields a warm operation
/// touches after it (the record map, the free lists, the free bytes) end, in bytes from its
/// start (`thread_cache.rs` checks how they fall on cache lines).
#[cfg(test)]
pub(crate) fn hot_field_ends() -> (usize, usize) {
    use std::mem::{offset_of, size_of};
    let memo_end = offset_of!(ThreadRecords, memo) + size_of::<(u64, u64, u16)>();
    let hot_end = [
        offset_of!(ThreadRecords, at) + size_of::<AddrTable<Record>>(),
        offset_of!(ThreadRecords, lists) + size_of::<Vec<FreeList>>(),
        offset_of!(ThreadRecords, free_bytes) + size_of::<u64>(),
    ]
    .into_iter()
    .max()
    .unwrap_or(usize::MAX);
    (memo_end, hot_end)
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

    /// Free `ptr` (a 4 KiB block) accepting it.
    fn free(t: &mut ThreadRecords, ptr: u64) -> FreeOutcome {
        t.free_live(ptr, |_| Some(4096))
    }

    /// A freed block keeps its record: the next allocation of its size on its stream takes
    /// it; another stream's does not; a freed block has no live record (a second free of
    /// it is not this table's to accept); a declined free changes nothing.
    #[test]
    fn a_freed_block_is_reused_on_its_stream_only() {
        let mut t = ThreadRecords::default();
        t.insert_live(0x1000, rec(7, 4096));
        assert_eq!(t.free_live(0x1000, |_| None), FreeOutcome::Declined);
        assert_eq!(t.live().count(), 1);
        assert_eq!(free(&mut t, 0x1000), FreeOutcome::Freed(rec(7, 4096), 4096));
        assert_eq!(t.free_bytes(), 4096);
        assert_eq!(free(&mut t, 0x1000), FreeOutcome::Absent);
        assert_eq!(free(&mut t, 0x2000), FreeOutcome::Absent);
        assert!(t.take_live(0x1000).is_none());
        assert!(t.alloc_free(8, 4096, 0, 4096).is_none());
        assert_eq!(t.alloc_free(7, 4096, 0, 4000), Some((0x1000, 1)));
        assert_eq!(t.free_bytes(), 0);
        assert_eq!(t.take_live(0x1000), Some(rec(7, 4000)));
        assert_eq!(free(&mut t, 0x1000), FreeOutcome::Absent);
    }

    /// A record that does not fit the packed form is not taken: an arena key past `u32`
    /// (the caller records the block itself), or a free that would need a list index past
    /// the `u16` range (declined: the block goes to the device, its record stays live).
    #[test]
    fn records_that_do_not_fit_are_left_to_the_device() {
        let mut t = ThreadRecords::default();
        let far = FrontLive {
            arena: u32::MAX as usize + 1,
            ..rec(7, 4096)
        };
        assert!(!t.insert_live(0x1000, far));
        assert!(!t.insert_live(0, rec(7, 4096)), "the null address");
        assert_eq!(t.live().count(), 0);
        // One list per stream, up to the last index below the "no list" mark.
        for s in 0..u64::from(NO_LIST) {
            let ptr = 0x10_0000 * (s + 1);
            assert!(t.insert_live(ptr, rec(s, 4096)));
            assert!(matches!(free(&mut t, ptr), FreeOutcome::Freed(..)));
        }
        assert_eq!(t.lists.len(), usize::from(NO_LIST));
        let ptr = 0x10_0000 * (u64::from(NO_LIST) + 1);
        assert!(t.insert_live(ptr, rec(1 << 40, 4096)));
        assert_eq!(free(&mut t, ptr), FreeOutcome::Declined);
        assert_eq!(t.lists.len(), usize::from(NO_LIST));
        assert_eq!(t.take_live(ptr), Some(rec(1 << 40, 4096)), "still live");
        // A stream that has a list still frees into it.
        assert!(t.insert_live(ptr, rec(3, 4096)));
        assert!(matches!(free(&mut t, ptr), FreeOutcome::Freed(..)));
        assert_eq!(t.alloc_free(3, 4096, 0, 4096).map(|(p, _)| p), Some(ptr));
    }

    /// Draining takes the free blocks out (the live records stay), and with many lists the
    /// empty ones go while live records still find their lists.
    #[test]
    fn draining_keeps_live_records_and_lists_consistent() {
        let mut t = ThreadRecords::default();
        let n = (MAX_LISTS + 10) as u64;
        for s in 0..n {
            let ptr = 0x10000 * (s + 1);
            t.insert_live(ptr, rec(s, 4096));
            assert!(matches!(free(&mut t, ptr), FreeOutcome::Freed(..)));
            // Reallocated: live again, its record naming its list.
            assert_eq!(t.alloc_free(s, 4096, 0, 4096), Some((ptr, 1)));
        }
        // Stream 0's block freed: the one free block.
        assert!(matches!(free(&mut t, 0x10000), FreeOutcome::Freed(..)));
        let mut out = Vec::new();
        t.drain_free(0, None, crate::pool::sizes::classes::HUGE_MIN, &mut out);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].1, vec![0x10000]);
        assert_eq!(t.free_bytes(), 0);
        assert!(t.lists.is_empty());
        assert_eq!(t.live().count(), n as usize - 1);
        // Each live block frees into (and reallocates from) its own stream's list again.
        for s in 1..n {
            let ptr = 0x10000 * (s + 1);
            assert!(matches!(free(&mut t, ptr), FreeOutcome::Freed(..)));
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
