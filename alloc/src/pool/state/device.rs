//! Everything behind one device's lock ([`DeviceState`]): its sub-allocators (one per size
//! class, `pool/sizes/classes.rs`), arenas, the device's records of live allocations, its
//! exact-size cache, pending frees and stream events, shares, graph pools, history and the
//! counters; the records moving in from the thread front, the counters as reported, and
//! lookups by address. The rules that change it are the allocation and free paths'
//! (`pool/paths/`) and the features' (the folders beside them).

use std::collections::HashMap;
use std::sync::Arc;

use rustc_hash::FxHashMap;
use slab::Slab;

use crate::backend::{ArenaMem, DeviceId, Event, HostBuffer, StreamId};
use crate::error::{Error, Result};
use crate::history::History;
use crate::lifetime::AllocHold;
use crate::pool::front::thread_cache::Front;
use crate::pool::front::thread_records::FrontLive;
use crate::pool::sizes::classes::{self, Class, SMALL_GROW_FREELY};
use crate::pool::sizes::growth_steps;
use crate::pool::state::arena::{Arena, Live, PendingFree};
use crate::pool::state::arena_index::ArenaIndex;
use crate::pool::state::graph_pool_ids::GraphPools;
use crate::pool::state::orphans::Orphans;
use crate::pool::state::share_tables::ShareTables;
use crate::range::RangeAllocator;
use crate::stats::PoolStats;

/// Everything behind one device's lock.
#[derive(Debug, Default)]
pub(crate) struct DeviceState {
    /// One sub-allocator per tag and size class (`pool/sizes/classes.rs`, by `Class::index`):
    /// arenas of different tags or classes never share free ranges.
    pub(crate) ranges: Vec<RangeAllocator>,
    /// Tags asleep on this device (bit = tag index): their allocations are refused.
    pub(crate) asleep_tags: u64,
    pub(crate) arenas: Slab<Arena>,
    /// Arena address ranges -> arena key (with the last two answers remembered).
    pub(crate) arena_at: ArenaIndex,
    pub(crate) allocs: FxHashMap<u64, Live>,
    /// Freed blocks kept whole, by (stream, length): an exact-size reuse on the same stream
    /// costs two hash operations. They stay allocated in `ranges` until flushed (on a miss
    /// that would otherwise grow the pool, and before `empty_cache`).
    pub(crate) cache: FxHashMap<(u64, u64), Vec<(u64, usize)>>,
    pub(crate) cached_bytes: u64,
    pub(crate) pending: Vec<PendingFree>,
    /// Per stream: an event recorded on it, and the limbo tag its free ranges were moved
    /// to when the event was recorded. Those ranges (and only those: later frees may have
    /// later work) go to `ANY_STREAM` once the event completed (`pool/paths/streams.rs`).
    pub(crate) stream_events: HashMap<u64, (Event, u64)>,
    /// The next limbo tag, as an offset from `LIMBO_BASE`.
    pub(crate) next_limbo: u64,
    pub(crate) stats: PoolStats,
    pub(crate) next_arena_id: u64,
    /// Arenas out of the pool whose destroy failed: retried by `empty_cache` and teardown.
    pub(crate) orphans: Orphans,
    /// Shares and leases (`pool/state/share_tables.rs`, `pool/sharing/share.rs`).
    pub(crate) shares: ShareTables,
    /// The event ring (`crate::history`); off unless `record_history` turned it on.
    pub(crate) history: History,
    /// The thread front (`pool/front/thread_cache.rs`): thread caches and the plain allocations'
    /// records, outside this lock (the same one as `DevicePool::front`).
    pub(crate) front: Arc<Front>,
    /// Host buffers kept for the next sleep's offload (`pool/sleep_wake/offload.rs`).
    pub(crate) host_buffers: Vec<HostBuffer>,
    /// Sleeps, wakes and `prepare_offload`s moving host buffers now (`pool/sleep_wake/offload.rs`).
    pub(crate) host_buffers_moving: u32,
    /// Graph pools, their use counts and the routing contexts open (`pool/graphs/graph_pools.rs`).
    pub(crate) graph_pools: GraphPools,
    /// Per class (by `Class::index`): its growing arena's key (`pool/growth/grow.rs`).
    pub(crate) growing: FxHashMap<usize, usize>,
    /// The pool grows its arenas (`PoolConfig::grow_arenas`, `pool/growth/grow.rs`).
    pub(crate) grow_arenas: bool,
}

impl DeviceState {
    /// A device's state with no arena, its thread front `front`.
    pub(crate) fn new(front: Arc<Front>, grow_arenas: bool) -> DeviceState {
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

    pub(crate) fn insert_promoted(&mut self, ptr: u64, rec: FrontLive) {
        let live = self.promoted(rec);
        self.allocs.insert(ptr, live);
    }

    /// The device's record of a record taken out of the front, counted in its arena (as a
    /// record in the device's map is).
    pub(crate) fn promoted(&mut self, rec: FrontLive) -> Live {
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

    /// Zero the counts of events (allocations and frees served, arenas created and
    /// destroyed, OOMs, exports made): the thread caches' unfolded counts are subtracted
    /// from the device's base, so the sums `stats_now` reports start at 0.
    pub(crate) fn reset_accumulated(&mut self) {
        let registry = self.front.lock_caches();
        let caches = registry.lock();
        let (mut allocs, mut frees) = (0u64, 0u64);
        for c in &caches {
            allocs = allocs.wrapping_add(c.counts.alloc_count);
            frees = frees.wrapping_add(c.counts.free_count);
        }
        drop(caches);
        drop(registry);
        let s = &mut self.stats;
        s.alloc_count = 0u64.wrapping_sub(allocs);
        s.free_count = 0u64.wrapping_sub(frees);
        s.oom_count = 0;
        s.backend_creates = 0;
        s.backend_destroys = 0;
        s.exports_total = 0;
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
}
