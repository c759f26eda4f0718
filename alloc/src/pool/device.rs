//! One device's reuse rules, behind its lock: which free range an allocation on a stream
//! may take (own stream, own limbo, any stream), the events that release other streams'
//! ranges (limbo tags), pending `record_stream` frees, arena bookkeeping, and `validate()`.
//! The exact-size cache and the flushes are in `pool/device_cache.rs`; `pool/mod.rs` holds
//! the public API around it.

use rustc_hash::FxHashMap;
use std::collections::HashMap;

use super::share_tables::ShareTables;
use super::{Live, PendingFree, ANY_STREAM, LIMBO_BASE};
use crate::backend::Event;
use crate::backend::{ArenaMem, Backend, DeviceId, StreamId};
use crate::error::{Error, Result};
use crate::history::Action;
use crate::history::History;
use crate::lifetime::{AllocHold, ArenaLifetime};
use crate::pool::front::cache_key::cache_key_parts;
use crate::pool::front::thread_cache::Front;
use crate::pool::front::thread_records::FrontLive;
use crate::pool::sizes::blocks::{block_len, FLUSH_FIRST_ABOVE};
use crate::pool::sizes::classes::{self, Class, GENERAL, SMALL_GROW_FREELY};
use crate::pool::sizes::growth_steps;
use crate::pool::Arena;
use crate::range::RangeAllocator;
use crate::stats::{DeviceMetrics, PoolStats};
use slab::Slab;
use std::sync::Arc;

/// Everything behind one device's lock.
#[derive(Debug, Default)]
pub(crate) struct DeviceState {
    /// One sub-allocator per tag and size class (`pool/classes.rs`, by `Class::index`):
    /// arenas of different tags or classes never share free ranges.
    pub(crate) ranges: Vec<RangeAllocator>,
    /// Tags asleep on this device (bit = tag index): their allocations are refused.
    pub(crate) asleep_tags: u64,
    pub(crate) arenas: Slab<Arena>,
    /// Arena address ranges -> arena key (with the last two answers remembered).
    pub(crate) arena_at: super::arena_index::ArenaIndex,
    pub(crate) allocs: FxHashMap<u64, Live>,
    /// Freed blocks kept whole, by (stream, length): an exact-size reuse on the same stream
    /// costs two hash operations. They stay allocated in `ranges` until flushed (on a miss
    /// that would otherwise grow the pool, and before `empty_cache`).
    pub(super) cache: FxHashMap<(u64, u64), Vec<(u64, usize)>>,
    pub(super) cached_bytes: u64,
    pub(super) pending: Vec<PendingFree>,
    /// Per stream: an event recorded on it, and the limbo tag its free ranges were moved
    /// to when the event was recorded. Those ranges (and only those: later frees may have
    /// later work) go to [`ANY_STREAM`] once the event completed.
    stream_events: HashMap<u64, (Event, u64)>,
    next_limbo: u64,
    pub(crate) stats: PoolStats,
    pub(crate) next_arena_id: u64,
    /// Arenas out of the pool whose destroy failed: retried by `empty_cache` and teardown.
    pub(crate) orphans: super::orphans::Orphans,
    /// Shares and leases (`share_tables.rs`, `share.rs`).
    pub(crate) shares: ShareTables,
    /// The event ring (`crate::history`); off unless `record_history` turned it on.
    pub(crate) history: History,
    /// The thread front (`pool/thread_cache.rs`): thread caches and the plain allocations'
    /// records, outside this lock (the same one as [`DevicePool::front`]).
    pub(crate) front: Arc<Front>,
    /// Host buffers kept for the next sleep's offload (`pool/offload.rs`).
    pub(crate) host_buffers: Vec<crate::backend::HostBuffer>,
    /// Sleeps, wakes and `prepare_offload`s moving host buffers now (`pool/offload.rs`).
    pub(crate) host_buffers_moving: u32,
    /// Graph pools, their use counts and the routing contexts open (`pool/graph_pools.rs`).
    pub(crate) graph_pools: super::graph_pool_ids::GraphPools,
    /// Per class (by `Class::index`): its growing arena's key (`pool/growth.rs`).
    pub(crate) growing: FxHashMap<usize, usize>,
    /// The pool grows its arenas (`PoolConfig::grow_arenas`, `pool/growth.rs`).
    pub(crate) grow_arenas: bool,
}

impl DeviceState {
    /// A device's state with no arena, its thread front `front`.
    pub(super) fn new(front: Arc<Front>, grow_arenas: bool) -> DeviceState {
        DeviceState {
            next_arena_id: 1,
            front,
            grow_arenas,
            ..DeviceState::default()
        }
    }

    /// Bytes the device holds for the pool: its arenas, and those whose destroy failed.
    pub(crate) fn reserved_now(&self) -> u64 {
        self.stats.reserved_bytes + self.orphans.bytes()
    }

    /// After reserved bytes rose (an arena, a chunk, a wake's memory, an orphan the pool did
    /// not count before): the peak follows what [`Self::reserved_now`] reports, orphans in.
    pub(crate) fn raise_reserved_peak(&mut self) {
        let now = self.reserved_now();
        let peak = &mut self.stats.peak_reserved_bytes;
        *peak = (*peak).max(now);
    }

    /// Keep `mem`, whose destroy failed, as an orphan: its bytes count as reserved until a
    /// later destroy succeeds (the peak with them).
    pub(crate) fn keep_orphan(&mut self, mem: ArenaMem) {
        self.orphans.push(mem);
        self.raise_reserved_peak();
    }

    /// Blocks above this many bytes are huge (`Class::of`): `classes::HUGE_MIN`, none when
    /// arenas grow (`classes::NO_HUGE`).
    pub(crate) fn huge_min(&self) -> u64 {
        if self.grow_arenas {
            classes::NO_HUGE
        } else {
            classes::HUGE_MIN
        }
    }

    /// Arena `key` left the pool: it is no class's growing arena any more (the class's next
    /// arena starts at the size of its request, `growth_steps::first_chunk`).
    pub(crate) fn forget_growing(&mut self, key: usize) {
        self.growing.retain(|_, k| *k != key);
    }

    /// Whether `class`'s blocks live in growing arenas.
    pub(crate) fn grows(&self, class: Class) -> bool {
        self.grow_arenas && growth_steps::grows(class)
    }

    /// Whether a miss in `class` should grow it at once (a small class holding less than
    /// [`SMALL_GROW_FREELY`]) rather than flush its cache and settle its streams first.
    pub(crate) fn grows_freely(&self, class: Class) -> bool {
        class.small && self.class_bytes(class) < SMALL_GROW_FREELY
    }

    /// Bytes of the arenas of `class`.
    pub(crate) fn class_bytes(&self, class: Class) -> u64 {
        self.arenas
            .iter()
            .filter(|(_, a)| a.class() == class)
            .map(|(_, a)| a.mem.bytes)
            .sum()
    }

    /// The sub-allocator of `class`, created on first use.
    pub(crate) fn ranges_mut(&mut self, class: Class) -> &mut RangeAllocator {
        let i = class.index();
        if self.ranges.len() <= i {
            self.ranges.resize_with(i + 1, RangeAllocator::default);
        }
        &mut self.ranges[i]
    }

    /// Find a range for `len` bytes usable on `stream`, without creating memory.
    pub(super) fn take_range(
        &mut self,
        len: u64,
        stream: StreamId,
        class: Class,
        backend: &dyn Backend,
        device: DeviceId,
    ) -> Option<u64> {
        let t = class.index();
        // Created on first use.
        self.ranges_mut(class);
        // The stream's own frees first (safe at once, and it keeps shared space for others),
        // then ranges any stream may use; in a growing arena the best fit of them all.
        let found = if self.grows(class) {
            self.best_fit_usable(t, len, stream)
        } else {
            self.ranges[t]
                .alloc(len, stream.0)
                .or_else(|| {
                    self.limbo_of(stream.0)
                        .and_then(|l| self.ranges[t].alloc(len, l))
                })
                .or_else(|| self.ranges[t].alloc(len, ANY_STREAM))
        };
        if found.is_some() {
            return found;
        }
        // Miss: give this class's cached blocks, the device's and the thread caches', back
        // to the ranges, where they coalesce, and retry: the large ones first, then all (see
        // FLUSH_FIRST_ABOVE; small blocks are all below it).
        // A graph pool's blocks are never cached, so a flush cannot help it.
        if self.grows_freely(class) || class.pool != GENERAL {
            return self.settle_unless_routing(backend, device, class, len, stream);
        }
        // With growing arenas the allocating thread's own cache goes first: an arena that
        // grows is full more often than a 1 GiB one, and taking every thread's blocks on each
        // miss turns the other threads' next hits into misses. Other threads' blocks still go
        // back before any growth.
        let passes: &[(u64, bool)] = if class.small {
            &[(0, false)]
        } else if self.grows(class) && self.front.own_contended() {
            // The device lock is contended (`Front::try_free`): the other threads' cached
            // blocks stay theirs (flushing them turns their next hits into misses, each
            // taking the lock); the arena grows instead.
            &[(FLUSH_FIRST_ABOVE, true), (0, true)]
        } else if self.grows(class) {
            &[
                (FLUSH_FIRST_ABOVE, true),
                (0, true),
                (FLUSH_FIRST_ABOVE, false),
                (0, false),
            ]
        } else {
            &[(FLUSH_FIRST_ABOVE, false), (0, false)]
        };
        if let Some(p) = self.room_without_flushing(backend, device, class, len, stream) {
            return Some(p);
        }
        for &(min_len, own_only) in passes {
            if !self.flush_cached_above(min_len, Some(class), own_only) {
                continue;
            }
            let found = if self.grows(class) {
                self.best_fit_usable(t, len, stream)
            } else {
                self.ranges[t]
                    .alloc(len, stream.0)
                    .or_else(|| self.ranges[t].alloc(len, ANY_STREAM))
            };
            if found.is_some() {
                return found;
            }
        }
        // Still a miss: release ranges whose work has completed, this stream's own included:
        // they move to its limbo tag (which it may still use) and, once its event completed,
        // to `ANY_STREAM`, where they merge with neighbouring free ranges of other streams.
        // (Skipping them left small free ranges of two tags side by side, unmergeable.)
        // Only this class's ranges move: small misses are frequent (small arenas are 2 MiB)
        // and moving the large class's ranges on each of them changed its placement (one
        // more 1 GiB arena on the KV trace, and slower).
        self.settle_unless_routing(backend, device, class, len, stream)
    }

    /// The last resort of [`Self::take_range`]: settle `class`'s streams and retry; not
    /// while allocations are routed to a graph pool (no event may be recorded or queried:
    /// `pool/graph_pools.rs`), nor for a small class that grows freely.
    pub(super) fn settle_unless_routing(
        &mut self,
        backend: &dyn Backend,
        device: DeviceId,
        class: Class,
        len: u64,
        stream: StreamId,
    ) -> Option<u64> {
        if self.graph_pools.routing() || (class.pool == GENERAL && self.grows_freely(class)) {
            return None;
        }
        let t = class.index();
        if !self.grows(class) {
            self.settle(backend, device, t, None);
            return self.ranges[t]
                .alloc(len, stream.0)
                .or_else(|| self.ranges[t].alloc(len, ANY_STREAM))
                .or_else(|| {
                    self.limbo_of(stream.0)
                        .and_then(|l| self.ranges[t].alloc(len, l))
                });
        }
        // With growing arenas the allocating stream's own free ranges stay its own: it may
        // use them already, and moving them to a limbo tag would only keep them from
        // merging with its next frees (a program of one stream on a busy GPU, whose events
        // are still pending, reserved 2-9% more that way).
        self.settle(backend, device, t, Some(stream.0));
        if let Some(p) = self.best_fit_usable(t, len, stream) {
            return Some(p);
        }
        // Before the arena grows: the stream's own free ranges take in the space beside them
        // that it may use too (free for any stream; its own frees waiting for their event),
        // so that its pieces between other free space become one range. Free ranges of two
        // tags never merge by themselves: a KV trace of two streams grew its arena by 20%
        // over its live bytes with gigabytes free in such pieces
        // (bench/results/sim-2026-12-02-take-in.md).
        let usable = self.usable_by(stream.0);
        if self.ranges[t].take_in(stream.0, &usable) == 0 {
            return None;
        }
        self.ranges[t].alloc(len, stream.0)
    }

    /// In sub-allocator `t` (a growing class's), the best fit for `len` bytes among the
    /// ranges `stream` may use at once: its own frees, its frees waiting for their event,
    /// and space free for any stream; its own fit is taken at once when at most twice
    /// `len`. Taking its own first, wherever they were, left the better-fitting holes
    /// around them empty: a KV trace of two streams reserved 1.206 of its live bytes that
    /// way, 1.012 with this rule and the take-ins (bench/results/sim-2026-12-02-take-in.md).
    pub(super) fn best_fit_usable(&mut self, t: usize, len: u64, stream: StreamId) -> Option<u64> {
        let [any, limbo] = self.usable_by(stream.0);
        self.ranges[t]
            .alloc_best_of(len, &[stream.0, limbo, any])
            .map(|(p, _)| p)
    }

    /// The tags of free ranges that `stream` may use besides its own: space free for any
    /// stream, and its own frees waiting for their event (any stream's again when it has
    /// none pending).
    fn usable_by(&self, stream: u64) -> [u64; 2] {
        [ANY_STREAM, self.limbo_of(stream).unwrap_or(ANY_STREAM)]
    }

    /// Poll pending frees and per-stream events (recording events where none is pending);
    /// ranges of sub-allocator `class` (a `Class::index`) whose streams are done become
    /// reusable by any stream.
    /// `keep`: a stream whose ranges stay as they are.
    pub(super) fn settle(
        &mut self,
        backend: &dyn Backend,
        device: DeviceId,
        class: usize,
        keep: Option<u64>,
    ) {
        self.poll_pending(backend);
        // Completed events first: an event recorded by another class's settle covers only
        // that class's ranges, and while it is pending its stream gets no other event.
        self.retire_done_events(backend);
        // Streams with free ranges in `class` and no event yet: record one, and move exactly
        // the ranges it covers (those freed so far) to a limbo tag of their own. (A stream's
        // ranges in other classes keep their stream tag until a settle of their class; an
        // event completing frees its limbo ranges wherever they are.)
        let tags = self
            .ranges
            .get(class)
            .map(|r| r.free_tags())
            .unwrap_or_default();
        for (tag, _) in tags {
            if tag >= LIMBO_BASE || self.stream_events.contains_key(&tag) || keep == Some(tag) {
                continue;
            }
            match backend.record_event(device, StreamId(tag)) {
                Ok(ev) => {
                    let limbo = LIMBO_BASE + self.next_limbo;
                    self.next_limbo = (self.next_limbo + 1) % (ANY_STREAM - LIMBO_BASE);
                    self.ranges[class].retag(tag, limbo);
                    self.stream_events.insert(tag, (ev, limbo));
                }
                Err(e) => tracing::warn!(error = %e, "record_event failed"),
            }
        }
        // An idle stream's fresh event completes at once.
        self.retire_done_events(backend);
    }

    /// Events that completed: their limbo ranges are safe for every stream.
    fn retire_done_events(&mut self, backend: &dyn Backend) {
        let done: Vec<u64> = self
            .stream_events
            .iter()
            .filter(|(_, (ev, _))| backend.event_done(ev).unwrap_or(false))
            .map(|(&tag, _)| tag)
            .collect();
        for tag in done {
            if let Some((ev, limbo)) = self.stream_events.remove(&tag) {
                let _ = backend.destroy_event(ev);
                for r in &mut self.ranges {
                    r.retag(limbo, ANY_STREAM);
                }
            }
        }
    }

    /// Free bytes of `class` in limbo tags: freed on some stream, waiting for its event;
    /// none counted for a class that grows without settling (`grows_freely`): waiting for
    /// its events would not make them usable.
    pub(super) fn limbo_bytes(&self, class: Class) -> u64 {
        if self.grows_freely(class) {
            return 0;
        }
        self.ranges
            .get(class.index())
            .map_or(0, |r| r.free_bytes_in(LIMBO_BASE..=ANY_STREAM - 1))
    }

    /// The limbo tag holding `stream`'s own earlier frees (reusable by that stream at once).
    pub(super) fn limbo_of(&self, stream: u64) -> Option<u64> {
        self.stream_events.get(&stream).map(|(_, limbo)| *limbo)
    }

    /// After a device synchronize: every event is complete, so every range is free for any
    /// stream.
    pub(super) fn settle_all(&mut self, backend: &dyn Backend) {
        self.flush_cache();
        for p in std::mem::take(&mut self.pending) {
            for ev in p.events {
                let _ = backend.destroy_event(ev);
            }
            self.finish_pending(p.ptr, p.stream);
        }
        for (_, (ev, _)) in self.stream_events.drain() {
            let _ = backend.destroy_event(ev);
        }
        for r in &mut self.ranges {
            for (tag, _) in r.free_tags() {
                r.retag(tag, ANY_STREAM);
            }
        }
    }

    pub(super) fn poll_pending(&mut self, backend: &dyn Backend) {
        let mut i = 0;
        while i < self.pending.len() {
            let p = &self.pending[i];
            let done = !p.until_synchronize
                && p.events
                    .iter()
                    .all(|e| backend.event_done(e).unwrap_or(false));
            if done {
                let p = self.pending.swap_remove(i);
                for ev in p.events {
                    let _ = backend.destroy_event(ev);
                }
                self.finish_pending(p.ptr, p.stream);
            } else {
                i += 1;
            }
        }
    }

    pub(super) fn finish_pending(&mut self, ptr: u64, stream: StreamId) {
        let bytes = self.allocs.get(&ptr).map_or(0, Live::bytes);
        self.stats.pending_free_bytes -= bytes;
        if let Err(e) = self.release_range(ptr, stream.0) {
            tracing::error!(error = %e, "releasing a pending free failed");
        }
    }

    /// Release an allocation its owner freed while shared, now that its last share or lease
    /// ended: at once under its own stream's tag (consumers synchronize before they close),
    /// or, when `record_stream` added streams, once events recorded on them now complete.
    pub(crate) fn release_deferred(&mut self, ptr: u64, backend: &dyn Backend, device: DeviceId) {
        let Some(live) = self.allocs.get(&ptr) else {
            return;
        };
        let (stream, extra, bytes) = (live.stream, live.extra_streams().to_vec(), live.bytes());
        self.stats.deferred_free_bytes -= bytes;
        if let Err(e) = self.release_freed(ptr, stream, extra, bytes, backend, device) {
            tracing::error!(error = %e, "releasing a deferred free failed");
        }
    }

    /// Move the front's record of `ptr`, if it has one, into the device's map (where shares,
    /// `record_stream` and the stream rules of a non-plain free work on it).
    pub(crate) fn promote(&mut self, ptr: u64) {
        if let Some(rec) = self.front.take_live(ptr) {
            self.insert_promoted(ptr, rec);
        }
    }

    /// [`Self::promote`] every record of the front.
    pub(crate) fn promote_all(&mut self) {
        for (ptr, rec) in self.front.take_all_live() {
            self.insert_promoted(ptr, rec);
        }
    }

    pub(super) fn insert_promoted(&mut self, ptr: u64, rec: FrontLive) {
        let live = self.promoted(rec);
        self.allocs.insert(ptr, live);
    }

    /// The device's record of a record taken out of the front, counted in its arena (as a
    /// record in the device's map is).
    pub(super) fn promoted(&mut self, rec: FrontLive) -> Live {
        if let Some(a) = self.arenas.get_mut(rec.arena) {
            a.live_allocs += 1;
        }
        Live {
            arena: rec.arena,
            requested: rec.requested,
            stream: StreamId(rec.stream),
            extra_streams: None,
            hold: AllocHold::default(),
        }
    }

    /// The device's counters with the front's added: allocated and requested bytes and
    /// their peaks, and the thread caches' allocation and free counts. Read with every
    /// thread cache locked, so consistent.
    pub(crate) fn stats_now(&self) -> PoolStats {
        let mut s = self.stats;
        let registry = self.front.lock_caches();
        let caches = registry.lock();
        for c in &caches {
            s.alloc_count = s.alloc_count.wrapping_add(c.counts.alloc_count);
            s.free_count = s.free_count.wrapping_add(c.counts.free_count);
            s.allocations = s.allocations.wrapping_add(c.counts.allocations());
        }
        [
            s.allocated_bytes,
            s.requested_bytes,
            s.peak_allocated_bytes,
            s.peak_requested_bytes,
        ] = self.front.byte_counts(&caches);
        s.reserved_bytes = self.reserved_now();
        if self.asleep_tags != 0 {
            s.sleep_kept_shared_bytes = self
                .arenas
                .iter()
                .filter(|(_, a)| self.asleep_tags & (1 << a.tag) != 0 && a.sleep.is_none())
                .map(|(_, a)| a.mem.bytes)
                .sum();
        }
        s
    }

    /// Give an allocation's range back to the sub-allocator under `tag` and drop its record.
    pub(crate) fn release_range(&mut self, ptr: u64, tag: u64) -> Result<()> {
        let live = self
            .allocs
            .remove(&ptr)
            .ok_or_else(|| Error::Internal(format!("release of unknown range {ptr:#x}")))?;
        self.release_live(ptr, live, tag)
    }

    /// Give a removed record's range back to the sub-allocator under `tag`.
    pub(super) fn release_live(&mut self, ptr: u64, live: Live, tag: u64) -> Result<()> {
        let class = self.arenas.get(live.arena).map(|a| a.class());
        let t = class.map_or(0, |c| c.index());
        // In a growing arena a stream's free takes in the free space beside it that the
        // stream may use (`usable_by`): one stream's pieces between other free space stay
        // one range, as in one of PyTorch's per-stream segments.
        let take_in = tag < LIMBO_BASE && class.is_some_and(|c| self.grows(c));
        let usable = if take_in {
            self.usable_by(tag)
        } else {
            [tag; 2]
        };
        self.ranges
            .get_mut(t)
            .ok_or(crate::range::RangeError::NotAllocated(ptr))
            .and_then(|r| {
                if take_in {
                    r.free_taking_in(ptr, tag, &usable)
                } else {
                    r.free(ptr, tag)
                }
            })
            .map_err(|e| Error::Internal(format!("range allocator refused a free: {e}")))?;
        if let Some(a) = self.arenas.get_mut(live.arena) {
            a.live_allocs -= 1;
        }
        self.front.sub_bytes(live.bytes(), live.requested);
        self.stats.allocations = self.stats.allocations.wrapping_sub(1);
        if self.history.recording {
            let (len, req, stream) = (live.bytes(), live.requested, live.stream.0);
            self.history
                .record(Action::FreeCompleted, ptr, len, req, stream);
        }
        Ok(())
    }

    /// The live, not yet freed allocation at `ptr`, or a clear error.
    pub(crate) fn check_live(&self, ptr: u64, device: DeviceId) -> Result<Live> {
        match self.allocs.get(&ptr) {
            Some(l) if !l.hold.freed() => Ok(l.clone()),
            Some(_) => Err(Error::UnknownPointer {
                ptr,
                why: "already freed (double free)".into(),
            }),
            None => {
                let why = match self.arena_of(ptr) {
                    Some(_) => format!(
                        "inside an arena of device {device} but not the start of a live allocation (double free, or an interior pointer)"
                    ),
                    None => format!("not allocated by gpu-arena on device {device}"),
                };
                Err(Error::UnknownPointer { ptr, why })
            }
        }
    }

    pub(crate) fn arena_of(&self, ptr: u64) -> Option<usize> {
        self.arena_at.get(ptr)
    }

    /// The sub-allocator of the tag whose arena holds `ptr`.
    pub(crate) fn ranges_of(&self, ptr: u64) -> Option<&RangeAllocator> {
        let a = self.arenas.get(self.arena_of(ptr)?)?;
        self.ranges.get(a.class().index())
    }

    /// Add an arena under `id` (reserved by `pool/observers.rs`).
    pub(super) fn add_arena(
        &mut self,
        mem: ArenaMem,
        id: u64,
        class: Class,
        metrics: &DeviceMetrics,
    ) -> Result<usize> {
        let (base, bytes) = (mem.base, mem.bytes);
        self.ranges_mut(class)
            .add_region(base, bytes, ANY_STREAM)
            .map_err(|e| Error::Internal(format!("backend returned an unusable arena: {e}")))?;
        let key = self.arenas.insert(Arena {
            mem,
            id,
            live_allocs: 0,
            lifetime: ArenaLifetime::default(),
            tag: class.tag,
            small: class.small,
            huge: class.huge,
            graph_pool: class.pool,
            sleep: None,
            chunks: 1,
        });
        self.arena_at.insert(base..base + bytes, key);
        self.stats.reserved_bytes += bytes;
        self.raise_reserved_peak();
        let s = &mut self.stats;
        s.arenas += 1;
        s.backend_creates += 1;
        metrics.creates.increment(1);
        if self.history.recording {
            self.history.record(Action::SegmentAlloc, base, bytes, 0, 0);
        }
        Ok(key)
    }

    /// Take every arena that can go back to the backend: no allocation, no share, no
    /// export, not pinned, and not `busy` (by base: an observer's `on_ready` of it runs).
    /// Called after `settle_all`. Counted here, in the stats and the metrics alike, as
    /// `backend_destroys` (a grown arena's chunks): a destroy that fails is retried from the
    /// orphans without being counted again.
    pub(super) fn take_empty_arenas(
        &mut self,
        busy: impl Fn(u64) -> bool,
        metrics: &DeviceMetrics,
    ) -> Vec<ArenaMem> {
        let keys: Vec<usize> = self
            .arenas
            .iter()
            .filter(|(_, a)| {
                a.live_allocs == 0
                    && a.sleep.is_none()
                    && a.lifetime.destroyable()
                    && !super::graph_pool_ids::keeps_arenas(&self.graph_pools, a.graph_pool)
                    && !busy(a.mem.base)
            })
            .map(|(k, _)| k)
            .collect();
        let mut out = Vec::new();
        for k in keys {
            let (base, t) = (self.arenas[k].mem.base, self.arenas[k].class().index());
            if self.ranges[t].remove_region(base).is_err() {
                continue;
            }
            let a = self.arenas.remove(k);
            self.forget_growing(k);
            self.arena_at.remove(base..base + a.mem.bytes);
            self.stats.reserved_bytes -= a.mem.bytes;
            self.stats.arenas -= 1;
            // Driver allocations, as `backend_creates` counts them: a grown arena's chunks.
            self.stats.backend_destroys += u64::from(a.chunks);
            metrics.destroys.increment(u64::from(a.chunks));
            if self.history.recording {
                self.history
                    .record(Action::SegmentFree, base, a.mem.bytes, 0, 0);
            }
            out.push(a.mem);
        }
        // Released graph pools whose last arena went are forgotten.
        self.forget_unused_pools();
        out
    }

    pub(super) fn validate_or_log(&self) {
        if let Err(e) = self.validate() {
            tracing::error!("pool invariant broken: {e}");
            debug_assert!(false, "pool invariant broken: {e}");
        }
    }

    /// The pool's records agree with the sub-allocator and with each other.
    pub(super) fn validate(&self) -> Result<(), String> {
        let mut rs = crate::range::RangeStats::default();
        for r in &self.ranges {
            r.validate()?;
            let s = r.stats();
            rs.regions += s.regions;
            rs.region_bytes += s.region_bytes;
            rs.used_bytes += s.used_bytes;
        }
        if rs.regions != self.arenas.len() as u64 {
            return Err(format!(
                "{} regions for {} arenas",
                rs.regions,
                self.arenas.len()
            ));
        }
        let all: u64 = self.arenas.iter().map(|(_, a)| a.mem.bytes).sum();
        let asleep: u64 = self
            .arenas
            .iter()
            .filter(|(_, a)| a.sleep.is_some())
            .map(|(_, a)| a.mem.bytes)
            .sum();
        let reserved = all - asleep;
        if reserved != self.stats.reserved_bytes
            || asleep != self.stats.sleeping_bytes
            || rs.region_bytes != all
        {
            return Err(format!(
                "reserved {} and sleeping {} in stats, {reserved} and {asleep} in arenas, {} in regions",
                self.stats.reserved_bytes, self.stats.sleeping_bytes, rs.region_bytes
            ));
        }
        self.check_host_bytes()?;
        // Every block the pool holds allocated in the ranges, each exactly once: live in
        // the device's map or a thread cache's records, or cached by the device or a
        // thread. (With every thread cache locked: no fast path runs meanwhile.)
        let registry = self.front.lock_caches();
        let thread_caches = registry.lock();
        let mut seen: HashMap<u64, &str> = HashMap::new();
        let mut whole = |ptr: u64, len: u64, what: &'static str| -> Result<(), String> {
            if let Some(other) = seen.insert(ptr, what) {
                return Err(format!("block {ptr:#x} is both {other} and {what}"));
            }
            if self.ranges_of(ptr).and_then(|r| r.allocated_len(ptr)) != Some(len) {
                return Err(format!(
                    "{what} block {ptr:#x} is not allocated whole in the ranges"
                ));
            }
            Ok(())
        };
        let (mut used, mut requested) = (0, 0);
        for (&ptr, l) in &self.allocs {
            whole(ptr, l.bytes(), "live")?;
            (used, requested) = (used + l.bytes(), requested + l.requested);
        }
        for (ptr, l) in thread_caches.iter().flat_map(|c| c.records.live()) {
            let len = block_len(l.requested).unwrap_or(0);
            whole(ptr, len, "live in the front")?;
            (used, requested) = (used + len, requested + l.requested);
        }
        // The bytes of the cached blocks (the device's or a thread's), each checked whole.
        let mut cached_in = |blocks: &mut dyn Iterator<Item = (u64, u64)>,
                             what: &'static str|
         -> Result<u64, String> {
            let mut bytes = 0;
            for (ptr, len) in blocks {
                whole(ptr, len, what)?;
                bytes += len;
            }
            Ok(bytes)
        };
        let mut device_blocks = self.cache.iter().flat_map(|(&(_, key), blocks)| {
            let len = cache_key_parts(key).0;
            blocks.iter().map(move |&(ptr, _)| (ptr, len))
        });
        let mut cached = cached_in(&mut device_blocks, "cached")?;
        if cached != self.cached_bytes {
            return Err(format!(
                "cache holds {cached} bytes, counter says {}",
                self.cached_bytes
            ));
        }
        for c in &thread_caches {
            let in_thread = cached_in(&mut c.records.free_blocks(), "cached by a thread")?;
            if in_thread != c.records.free_bytes() {
                return Err(format!(
                    "a thread cache holds {in_thread} bytes, its counter says {}",
                    c.records.free_bytes()
                ));
            }
            cached += in_thread;
        }
        let [allocated_bytes, requested_bytes, ..] = self.front.byte_counts(&thread_caches);
        if requested != requested_bytes {
            return Err(format!(
                "requested {requested_bytes} in stats, {requested} in records"
            ));
        }
        if used + cached != rs.used_bytes || used != allocated_bytes {
            return Err(format!(
                "allocated {allocated_bytes} in stats, {used} in records, {cached} cached, {} in ranges",
                rs.used_bytes
            ));
        }
        // Per arena: live allocations, and the references they hold.
        let mut per_arena: HashMap<usize, (u64, u64)> = HashMap::new();
        for l in self.allocs.values() {
            let n = per_arena.entry(l.arena).or_default();
            n.0 += 1;
            n.1 += u64::from(l.hold.refs());
        }
        for (k, a) in &self.arenas {
            let (live, refs) = per_arena.get(&k).copied().unwrap_or((0, 0));
            if live != a.live_allocs {
                return Err(format!(
                    "arena {} live count {} is wrong",
                    a.id, a.live_allocs
                ));
            }
            if refs != a.lifetime.refs() {
                return Err(format!(
                    "arena {} holds {} references, its allocations {refs}",
                    a.id,
                    a.lifetime.refs()
                ));
            }
        }
        Ok(())
    }
}
