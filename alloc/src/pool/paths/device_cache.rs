//! The device's exact-size cache of freed blocks, and flushing the caches (the device's and
//! the threads') back to the sub-allocator, where their blocks coalesce: on a miss that would
//! otherwise grow the pool (`DeviceState::take_range`), at `empty_cache`, sleep and trim.
//! Blocks of threads that exited come back here too.

use rustc_hash::FxHashMap;

use crate::backend::{Backend, DeviceId, StreamId};
use crate::history::Action;
use crate::pool::front::cache_key::{cache_key_parts, cache_len};
use crate::pool::sizes::classes::Class;
use crate::pool::sizes::growth_steps::GROWING_CACHE_MAX;
use crate::pool::state::arena::Live;
use crate::pool::state::device::DeviceState;

impl DeviceState {
    /// A block of exactly `len` bytes freed on `stream` with tag `tag`, from the device's
    /// exact-size cache: its address and arena key.
    pub(crate) fn take_cached(&mut self, stream: u64, len: u64, tag: u8) -> Option<(u64, usize)> {
        let key = (stream, cache_len(len, tag));
        let (ptr, arena) = self.cache.get_mut(&key).and_then(Vec::pop)?;
        self.cached_bytes -= len;
        Some((ptr, arena))
    }

    /// Put a freed allocation (no shares, no other streams; its record already removed)
    /// into the exact-size cache.
    pub(crate) fn cache_live(&mut self, ptr: u64, live: Live) {
        if let Some(a) = self.arenas.get_mut(live.arena) {
            a.live_allocs -= 1;
        }
        let bytes = live.bytes();
        self.front.sub_bytes(bytes, live.requested);
        self.stats.allocations = self.stats.allocations.wrapping_sub(1);
        if self.history.recording {
            let (req, stream) = (live.requested, live.stream.0);
            self.history
                .record(Action::FreeCompleted, ptr, bytes, req, stream);
        }
        self.cached_bytes += bytes;
        let tag = self.arenas.get(live.arena).map_or(0, |a| a.tag);
        self.cache
            .entry((live.stream.0, cache_len(bytes, tag)))
            .or_default()
            .push((ptr, live.arena));
    }

    /// Return every cached block to the sub-allocator, tagged with its stream.
    pub(crate) fn flush_cache(&mut self) {
        self.flush_cached_above(0, None, false);
    }

    /// Return the cached blocks longer than `min_len`, the device's (of `class` only, if
    /// given: another class's blocks lie in other arenas and cannot make room) and the
    /// thread caches' (every class; only the calling thread's with `own_only`), to the
    /// sub-allocator of their class, tagged with their streams. Returns whether any block
    /// went back.
    pub(crate) fn flush_cached_above(
        &mut self,
        min_len: u64,
        class: Option<Class>,
        own_only: bool,
    ) -> bool {
        // Per (stream, class), in one sorted pass: neighbouring cached blocks (a finished
        // sequence's KV blocks often are, whichever cache held them) merge before touching
        // the free index. The thread caches give back every class's blocks, not only
        // `class`'s: draining them by class kept small blocks in the threads' caches across
        // large misses, and the KV trace with 256 MiB arenas then reached its final
        // 17,430 MiB one replay later (growing in the fourth replay; bench/tests/kv_memory.rs).
        // Each block still goes to its own class's sub-allocator.
        let mut by_stream: FxHashMap<(u64, usize), Vec<u64>> = FxHashMap::default();
        // A huge class's miss takes back only huge blocks: no other class can make room for
        // it, and its misses are frequent enough that draining the KV blocks cached by the
        // threads each time slowed the second trace's warm replay by a third.
        let thread_class = class.filter(|c| c.huge);
        let drained = if own_only {
            self.front
                .drain_own_above(min_len, thread_class, self.huge_min())
        } else {
            self.front
                .drain_above(min_len, thread_class, self.huge_min())
        };
        for (key, ptrs) in drained {
            by_stream.entry(key).or_default().extend(ptrs);
        }
        let huge_min = self.huge_min();
        let cached_bytes = &mut self.cached_bytes;
        if *cached_bytes != 0 {
            self.cache.retain(|&(stream, key), blocks| {
                let (len, tag) = cache_key_parts(key);
                let of = Class::of(tag as u8, len, huge_min);
                if len <= min_len || class.is_some_and(|c| c != of) {
                    return true;
                }
                *cached_bytes -= len * blocks.len() as u64;
                by_stream
                    .entry((stream, of.index()))
                    .or_default()
                    .extend(blocks.drain(..).map(|(ptr, _)| ptr));
                false
            });
        }
        let any = !by_stream.is_empty();
        self.free_blocks(by_stream);
        any
    }

    /// A growing class's miss for a request larger than any cached block
    /// ([`GROWING_CACHE_MAX`]), before every cached block is given back: the run of the
    /// calling thread's cached blocks that makes room for it (`pool/front/cached_runs.rs`), then
    /// the streams' settled ranges and take-ins (`DeviceState::settle_unless_routing`). On
    /// the second KV trace giving back every cached block made room for no such request by
    /// itself, and each block came back through the device lock on its next allocation
    /// (bench/results/sim-2026-12-03-cached-runs.md). `None` for other classes and sizes,
    /// and when neither made room.
    pub(crate) fn room_without_flushing(
        &mut self,
        backend: &dyn Backend,
        device: DeviceId,
        class: Class,
        len: u64,
        stream: StreamId,
    ) -> Option<u64> {
        if !self.grows(class) || len <= GROWING_CACHE_MAX {
            return None;
        }
        if self.flush_run_for(len, stream.0, class) {
            if let Some(p) = self.best_fit_usable(class.index(), len, stream) {
                return Some(p);
            }
        }
        self.settle_unless_routing(backend, device, class, len, stream)
    }

    /// Give back only the run of the calling thread's cached blocks, freed on `stream`, of
    /// growing `class`, that makes room for `len` bytes with the free space beside it
    /// (`pool/front/cached_runs.rs`). Returns whether any block went back.
    fn flush_run_for(&mut self, len: u64, stream: u64, class: Class) -> bool {
        let t = class.index();
        let huge_min = self.huge_min();
        let Some(ranges) = self.ranges.get(t) else {
            return false;
        };
        let run = self
            .front
            .take_own_run(stream, class, huge_min, len, |p| ranges.beside(p, stream));
        if run.is_empty() {
            return false;
        }
        self.free_blocks([((stream, t), run)]);
        true
    }

    /// Give cached blocks, by (stream, class index), back to their class's sub-allocator.
    fn free_blocks(&mut self, blocks: impl IntoIterator<Item = ((u64, usize), Vec<u64>)>) {
        for ((stream, class), mut ptrs) in blocks {
            let Some(ranges) = self.ranges.get_mut(class) else {
                tracing::error!(class, "flushing cached blocks of an unknown class");
                continue;
            };
            for ptr in ranges.free_many(&mut ptrs, stream) {
                tracing::error!(ptr, "flushing a cached block failed: not allocated");
            }
        }
    }

    /// Return the blocks of thread caches whose thread exited and fold in their counts.
    pub(crate) fn reclaim_gone_caches(&mut self) {
        if !self.front.any_gone() {
            return;
        }
        let gone = self.front.take_gone(self.huge_min());
        let counts = gone.counts;
        self.free_blocks(gone.blocks);
        // Allocations of exited threads: recorded in the device's map from now on.
        for (ptr, rec) in gone.live {
            self.insert_promoted(ptr, rec);
        }
        let s = &mut self.stats;
        s.alloc_count = s.alloc_count.wrapping_add(counts.alloc_count);
        s.free_count = s.free_count.wrapping_add(counts.free_count);
        s.allocations = s.allocations.wrapping_add(counts.allocations());
    }
}
