//! An arena entering the pool: a freshly created arena gets an id, its observers are told
//! (`on_ready`, with no lock held: `pool/state/observer_registry.rs`), and only then is it
//! added to the device's records and its class's sub-allocator, where allocations can take
//! it. The last step of the allocation path's growth (`alloc.rs`, `Pool::alloc_slow`).

use parking_lot::MutexGuard;

use crate::backend::ArenaMem;
use crate::error::{Error, Result};
use crate::history::Action;
use crate::lifetime::ArenaLifetime;
use crate::pool::paths::streams::ANY_STREAM;
use crate::pool::sizes::classes::Class;
use crate::pool::state::arena::Arena;
use crate::pool::state::device::DeviceState;
use crate::pool::state::observer_registry::{ArenaInfo, Observers, MAX_NESTED_ARENAS, READY_DEPTH};
use crate::pool::state::pool::{DevicePool, Pool};
use crate::stats::DeviceMetrics;

impl Pool {
    /// Register a freshly created arena with the observers, tell them (no lock held), and
    /// add it to the pool once every `on_ready` of it returned. Returns the device lock
    /// (the caller allocates from the arena under it) and the arena's key.
    pub(crate) fn install_arena<'a>(
        &self,
        dp: &'a DevicePool,
        mem: ArenaMem,
        class: Class,
    ) -> Result<(MutexGuard<'a, DeviceState>, usize)> {
        if READY_DEPTH.with(|d| d.get()) > MAX_NESTED_ARENAS {
            let bytes = mem.bytes;
            if let Err(e) = self.backend.destroy_arena(mem.clone()) {
                tracing::error!(error = %e, "destroy_arena failed; will retry");
                dp.state.lock().keep_orphan(mem);
            }
            return Err(Error::InvalidState(format!(
                "an allocation from inside an arena observer's on_ready needs a new arena of \
                 {bytes} bytes, {} levels deep: refused (the arena being readied is not \
                 usable until on_ready returns; an on_ready that always allocates would \
                 recurse without end)",
                MAX_NESTED_ARENAS + 1
            )));
        }
        let id = dp.state.lock().reserve_arena_id();
        let info = ArenaInfo::mapped(dp.device, id, &mem);
        let calls = self.observers.register_arena(info);
        self.count_failures(self.observers.deliver(calls));
        let key = (dp.device, mem.base);
        loop {
            let mut st = dp.state.lock();
            let mut reg = self.observers.reg.lock();
            if !Observers::busy(&reg, key) {
                match st.add_arena(mem.clone(), id, class, &dp.metrics) {
                    Ok(k) => return Ok((st, k)),
                    Err(e) => {
                        // Out of the pool: released to the observers, destroyed by the next
                        // empty_cache.
                        let calls = Observers::claim_release_in(&mut reg, key, 0);
                        st.keep_orphan(mem);
                        drop((reg, st));
                        self.count_failures(self.observers.deliver(calls));
                        return Err(e);
                    }
                }
            }
            drop(st);
            // An observe_arenas that raced with this creation is telling its observer.
            self.observers.changed.wait(&mut reg);
        }
    }
}

impl DeviceState {
    /// A fresh arena id (the arena is added under it once its observers know it).
    pub(crate) fn reserve_arena_id(&mut self) -> u64 {
        let id = self.next_arena_id;
        self.next_arena_id += 1;
        id
    }

    /// Add an arena under `id` (reserved by [`Self::reserve_arena_id`]).
    pub(crate) fn add_arena(
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
}
