//! Checkpoints of a graph pool (PyTorch's cudagraph trees): [`Pool::graph_pool_blocks`]
//! lists a pool's live blocks, [`Pool::graph_pool_restore`] makes them exactly a given list
//! again, placing blocks at their own addresses (`RangeAllocator::alloc_at`), all or nothing:
//! planned on copies of the pool's sub-allocators first. The rules of graph pools are
//! `graph_pools.rs`'s module docs.

use rustc_hash::FxHashMap;

use crate::backend::{DeviceId, StreamId};
use crate::error::{Error, Result};
use crate::history::Action;
use crate::lifetime::AllocHold;
use crate::pool::sizes::blocks::request_len;
use crate::pool::sizes::classes::Class;
use crate::pool::state::arena::Live;
use crate::pool::state::device::DeviceState;
use crate::pool::state::graph_pool_ids::{GraphPoolId, PoolBlock};
use crate::pool::state::pool::{DevicePool, Pool};

impl Pool {
    /// The live blocks of graph pool `id`, sorted by address (PyTorch's checkpoint state and
    /// `checkPoolLiveAllocations`).
    pub fn graph_pool_blocks(&self, device: DeviceId, id: GraphPoolId) -> Result<Vec<PoolBlock>> {
        let st = self.dev(device)?.state.lock();
        let slot = st.pool_slot(id)?;
        Ok(st.pool_blocks(slot))
    }

    /// Make graph pool `id`'s live blocks exactly `blocks` (PyTorch's
    /// `setCheckpointPoolState`): live blocks not listed (by address, request and stream) are
    /// freed, listed blocks not live are allocated at their own addresses; then
    /// [`Self::graph_pool_blocks`] lists exactly `blocks`. All or nothing: on an
    /// error nothing changed. A block to free must be plain (not shared, no
    /// `record_stream`); a block to place must lie in a free range of the pool's arenas, of
    /// a tag that is awake.
    pub fn graph_pool_restore(
        &self,
        device: DeviceId,
        id: GraphPoolId,
        blocks: &[PoolBlock],
    ) -> Result<()> {
        let dp = self.dev(device)?;
        let mut st = dp.state.lock();
        let slot = st.pool_slot(id)?;
        let plan = st.restore_plan(device, slot, id, blocks)?;
        st.apply_restore(dp, &plan)?;
        if self.config.validate {
            st.validate_or_log();
        }
        dp.metrics.publish(&st.stats_now());
        Ok(())
    }
}

/// What a restore does: blocks to free, and blocks to place (address, length, request).
struct RestorePlan {
    free: Vec<(u64, StreamId)>,
    place: Vec<PoolBlock>,
}

impl DeviceState {
    /// The live blocks of pool `slot`, sorted by address.
    fn pool_blocks(&self, slot: u16) -> Vec<PoolBlock> {
        let mut out: Vec<PoolBlock> = self
            .allocs
            .iter()
            .filter(|(_, l)| !l.hold.freed())
            .filter(|(_, l)| {
                self.arenas
                    .get(l.arena)
                    .is_some_and(|a| a.graph_pool == slot)
            })
            .map(|(&ptr, l)| PoolBlock {
                ptr,
                requested: l.requested,
                stream: l.stream,
            })
            .collect();
        out.sort_unstable();
        out
    }

    /// Check a restore of pool `slot` to `blocks` and plan it, changing nothing.
    fn restore_plan(
        &self,
        device: DeviceId,
        slot: u16,
        id: GraphPoolId,
        blocks: &[PoolBlock],
    ) -> Result<RestorePlan> {
        let now = self.pool_blocks(slot);
        // A live block stays only when it is the listed one (address, request and stream):
        // one of the same length but another request or stream is freed and placed again,
        // so that the pool's blocks are then exactly the checkpoint's.
        let mut free = Vec::new();
        for b in now.iter().filter(|b| !blocks.contains(b)) {
            let live = &self.allocs[&b.ptr];
            if !live.hold.is_plain() || live.extra_streams.is_some() {
                return Err(Error::InvalidState(format!(
                    "graph pool {id}: restoring a checkpoint would free {:#x}, which is \
                     shared or has record_stream streams; nothing changed",
                    b.ptr
                )));
            }
            free.push((b.ptr, b.stream));
        }
        let place: Vec<PoolBlock> = blocks
            .iter()
            .filter(|t| !now.contains(t))
            .copied()
            .collect();
        // Placement, tried on copies of the pool's sub-allocators.
        let mut trial: FxHashMap<usize, crate::range::RangeAllocator> = FxHashMap::default();
        for &(ptr, stream) in &free {
            let t = self.class_index_at(ptr, id)?;
            let r = trial.entry(t).or_insert_with(|| self.ranges[t].clone());
            r.free(ptr, stream.0)
                .map_err(|e| Error::Internal(format!("graph pool {id}: restore: {e}")))?;
        }
        for b in &place {
            let bytes = request_len(device, b.requested)?;
            let a = self
                .arena_of(b.ptr)
                .and_then(|k| self.arenas.get(k))
                .filter(|a| a.graph_pool == slot)
                .ok_or_else(|| {
                    Error::invalid(format!(
                        "graph pool {id}: checkpoint block {:#x} is not in an arena of the pool",
                        b.ptr
                    ))
                })?;
            if a.class() != Class::in_graph_pool(slot, bytes) {
                return Err(Error::invalid(format!(
                    "graph pool {id}: checkpoint block {:#x} of {} bytes lies in an arena of \
                     another size class",
                    b.ptr, b.requested
                )));
            }
            // Its memory is not there while its tag sleeps: placed, the block would point
            // at nothing until the wake (as an allocation of the tag is refused then).
            self.check_awake(device, a.tag, b.requested)?;
            let t = a.class().index();
            let r = trial.entry(t).or_insert_with(|| self.ranges[t].clone());
            r.alloc_at(b.ptr, bytes).map_err(|e| {
                Error::InvalidState(format!(
                    "graph pool {id}: checkpoint block {:#x} ({bytes} bytes) cannot be placed \
                     again: {e}; nothing changed",
                    b.ptr
                ))
            })?;
        }
        Ok(RestorePlan { free, place })
    }

    /// The sub-allocator index of the arena holding `ptr`.
    fn class_index_at(&self, ptr: u64, id: GraphPoolId) -> Result<usize> {
        self.arena_of(ptr)
            .and_then(|k| self.arenas.get(k))
            .map(|a| a.class().index())
            .ok_or_else(|| Error::Internal(format!("graph pool {id}: block {ptr:#x} has no arena")))
    }

    /// Carry out a checked [`RestorePlan`] (every step succeeded on copies).
    fn apply_restore(&mut self, dp: &DevicePool, plan: &RestorePlan) -> Result<()> {
        for &(ptr, stream) in &plan.free {
            self.stats.free_count = self.stats.free_count.wrapping_add(1);
            self.release_range(ptr, stream.0)?;
        }
        for b in &plan.place {
            let bytes = request_len(dp.device, b.requested)?;
            let arena = self
                .arena_of(b.ptr)
                .ok_or_else(|| Error::Internal(format!("restore: {:#x} lost its arena", b.ptr)))?;
            let t = self.arenas[arena].class().index();
            self.ranges[t]
                .alloc_at(b.ptr, bytes)
                .map_err(|e| Error::Internal(format!("restore: placement checked, then: {e}")))?;
            self.arenas[arena].live_allocs += 1;
            self.allocs.insert(
                b.ptr,
                Live {
                    arena,
                    requested: b.requested,
                    stream: b.stream,
                    extra_streams: None,
                    hold: AllocHold::default(),
                },
            );
            let seen = self.front.count_unrecorded(bytes, b.requested);
            dp.metrics.publish_allocated(seen[0], seen[1]);
            self.stats.allocations = self.stats.allocations.wrapping_add(1);
            self.stats.alloc_count = self.stats.alloc_count.wrapping_add(1);
            if self.history.recording {
                self.history
                    .record(Action::Alloc, b.ptr, bytes, b.requested, b.stream.0);
            }
        }
        Ok(())
    }
}
