//! Graph pools: PyTorch's private memory pools (a CUDA graph's capture, graphs that share a
//! pool, `torch.cuda.MemPool`), by PyTorch's id (`MempoolId_t`, here [`GraphPoolId`]).
//!
//! A graph replays into the addresses its capture was given, with no allocator call: every
//! block the capture allocated, freed or not, is written again on each replay. So:
//!
//! 1. **Routing.** An allocation asked for in a pool ([`Pool::graph_pool_alloc`]; the C++
//!    layer decides, from the stream filters torch hands it) comes from the pool's own
//!    arenas: a class of its own per pool (`Class::pool`; sub-allocators by
//!    `Class::index`), never the general pool's free ranges, exact-size cache or thread
//!    caches. A general allocation never comes from a pool's arena.
//! 2. **A block keeps its pool for life.** Its record is the device's (never a thread
//!    cache's); freed, during the capture or after, its range goes back to its pool's
//!    sub-allocator under its stream's tag (never into a cache), reusable only by later
//!    allocations in that pool: how graphs sharing a pool reuse each other's memory.
//! 3. **Nothing goes early.** While a pool's use count is above 0 its arenas are neither
//!    destroyed (`empty_cache`, the OOM retry) nor trimmed; after the last release its
//!    arenas holding no live block go at the next `empty_cache`, and the pool is forgotten
//!    once it has no arena left (its id may then be used again, afresh).
//! 4. **No events while allocations are routed.** Between [`Pool::graph_pool_begin`] and
//!    [`Pool::graph_pool_end`] a capture may be under way on the device, and querying an
//!    event or synchronizing would invalidate it: while any such context is open the
//!    device records and queries no event (settling skipped, no limbo wait), the OOM retry
//!    does not release (it synchronizes), `empty_cache`, `trim` and `sleep` are refused, and
//!    a free whose block has `record_stream` streams waits in a list until the last
//!    context closes, when its events are recorded.
//! 5. **Pools stay apart**: no free range, cache or thread cache is shared between pools.
//!
//! Sizes: a pool's small blocks come from 2 MiB arenas, its large ones from arenas of
//! [`super::GRAPH_POOL_ARENA`] (or their own size), so a pool per graph does not reserve a
//! GiB each. A pool's blocks carry tag 0 (they sleep with the default tag).
//!
//! Checkpoints (PyTorch's cudagraph trees): [`Pool::graph_pool_blocks`] lists a pool's live
//! blocks, [`Pool::graph_pool_restore`] makes them exactly a given list again, placing
//! blocks at their own addresses (`RangeAllocator::alloc_at`): `checkpoints.rs`.

use crate::backend::{Backend, DeviceId, StreamId};
use crate::error::{Error, Result};
use crate::pool::paths::alloc::Allocation;
use crate::pool::sizes::blocks::request_len;
use crate::pool::sizes::classes::Class;
use crate::pool::state::device::DeviceState;
use crate::pool::state::graph_pool_ids::{unknown, GraphPoolId};
use crate::pool::state::pool::Pool;

impl DeviceState {
    /// The slot of pool `id`, or a clear error.
    pub(crate) fn pool_slot(&self, id: GraphPoolId) -> Result<u16> {
        self.graph_pools.slot(id).ok_or_else(|| unknown(id))
    }

    /// Refuse `what` (which synchronizes the device) while allocations are routed to a
    /// graph pool: a capture may be under way. (A call that synchronizes holds a
    /// [`SyncHold`](super::sync_hold::SyncHold) from this check to its end.)
    pub(crate) fn check_not_routing(&self, device: DeviceId, what: &str) -> Result<()> {
        if self.graph_pools.routing() {
            return Err(Error::InvalidState(format!(
                "{what} on device {device} while a CUDA graph capture or a graph pool context \
                 (torch.cuda.graph, use_mem_pool) is open: it would synchronize the device \
                 and invalidate the capture; nothing was done"
            )));
        }
        Ok(())
    }

    /// Forget the graph pools with no use, no open context and no arena left (one pass over
    /// the arenas; nothing to do without pools).
    pub(crate) fn forget_unused_pools(&mut self) {
        if self.graph_pools.is_empty() {
            return;
        }
        let held: rustc_hash::FxHashSet<u16> =
            self.arenas.iter().map(|(_, a)| a.graph_pool).collect();
        self.graph_pools.forget_unused(|slot| held.contains(&slot));
    }

    /// A free of `ptr` whose block has `record_stream` streams, made while routing: its
    /// events wait for the last context to close. Its record stays (freed) meanwhile.
    pub(crate) fn defer_until_no_capture(&mut self, ptr: u64, bytes: u64) {
        self.stats.pending_free_bytes += bytes;
        self.graph_pools.deferred.push(ptr);
    }

    /// The last routing context closed: the deferred frees get their events.
    fn end_deferred(&mut self, backend: &dyn Backend, device: DeviceId) {
        for ptr in std::mem::take(&mut self.graph_pools.deferred) {
            let Some(live) = self.allocs.get(&ptr) else {
                continue;
            };
            let (stream, extra) = (live.stream, live.extra_streams().to_vec());
            // Counted in pending_free_bytes since it was deferred.
            self.pend_on_streams(ptr, stream, extra, backend, device);
        }
    }
}

impl Pool {
    /// Create graph pool `id` on `device` or add a use of it (PyTorch's
    /// `createOrIncrefPool`). Returns the use count after.
    pub fn graph_pool_retain(&self, device: DeviceId, id: GraphPoolId) -> Result<u32> {
        self.dev(device)?.state.lock().graph_pools.retain(id)
    }

    /// Take a use of graph pool `id` (PyTorch's `releasePool`). Returns the use count
    /// after; at 0 its arenas holding no live block go at the next `empty_cache`.
    pub fn graph_pool_release(&self, device: DeviceId, id: GraphPoolId) -> Result<u32> {
        let mut st = self.dev(device)?.state.lock();
        let count = st.graph_pools.release(id)?;
        if count == 0 {
            st.forget_unused_pools();
        }
        Ok(count)
    }

    /// The use count of graph pool `id` (0 for a pool that does not exist).
    pub fn graph_pool_use_count(&self, device: DeviceId, id: GraphPoolId) -> Result<u32> {
        Ok(self.dev(device)?.state.lock().graph_pools.use_count(id))
    }

    /// Open a routing context for pool `id` (PyTorch's `beginAllocateToPool`): the pool is
    /// created or gets a use, and until [`Self::graph_pool_end`] the device records and
    /// queries no events (module docs, rule 4).
    ///
    /// It waits for a call that synchronizes the device (`empty_cache`, `trim`, `sleep`,
    /// `wake`, the out-of-memory retry) to finish, as PyTorch's `beginAllocateToPool` waits
    /// for the allocator's mutex that its `emptyCache` holds across the synchronize: begun
    /// meanwhile, a capture would be invalidated by that synchronize. Called from such a
    /// call on the same thread (an observer's or a hook's callback), it is refused.
    pub fn graph_pool_begin(&self, device: DeviceId, id: GraphPoolId) -> Result<u32> {
        let dp = self.dev(device)?;
        let mut st = dp.state.lock();
        if st.graph_pools.syncing_here() {
            return Err(Error::InvalidState(format!(
                "graph pool {id}: a routing context cannot open on device {device} from \
                 within a call that synchronizes it on this thread (an observer's or a hook's \
                 callback); nothing changed"
            )));
        }
        while st.graph_pools.syncing() {
            dp.sync_ended.wait(&mut st);
        }
        st.graph_pools.begin(id)
    }

    /// Close a routing context of pool `id` (PyTorch's `endAllocateToPool`; the use stays
    /// until [`Self::graph_pool_release`]). When the last closes, frees deferred meanwhile
    /// get their events.
    pub fn graph_pool_end(&self, device: DeviceId, id: GraphPoolId) -> Result<()> {
        let dp = self.dev(device)?;
        let mut st = dp.state.lock();
        if st.graph_pools.end(id)? {
            st.end_deferred(self.backend.as_ref(), device);
        }
        // Released during its capture: forgotten now, if it holds no arena.
        st.forget_unused_pools();
        Ok(())
    }

    /// Allocate `bytes` on `device` for `stream` from graph pool `id`'s own arenas (module
    /// docs, rules 1 and 2). The pool must exist (retained or begun).
    pub fn graph_pool_alloc(
        &self,
        device: DeviceId,
        id: GraphPoolId,
        bytes: u64,
        stream: StreamId,
    ) -> Result<Allocation> {
        let dp = self.dev(device)?;
        let len = request_len(device, bytes)?;
        let stream = self.stream_of(stream);
        let class = {
            let mut st = dp.state.lock();
            let slot = st.pool_slot(id)?;
            let class = Class::in_graph_pool(slot, len);
            // A pool's blocks carry tag 0: they sleep with the default tag.
            st.check_awake(device, class.tag, bytes)?;
            if let Some(ptr) = st.take_range(len, stream, class, self.backend.as_ref(), device) {
                return Ok(self.finish_alloc(dp, &mut st, ptr, len, bytes, stream));
            }
            class
        };
        self.alloc_slow(dp, len, bytes, stream, class)
    }

    /// Release graph pool `id`'s arenas that hold no live block, if its use count is 0
    /// (PyTorch's `emptyCache(mempool_id)`; with uses left it releases nothing). Like
    /// `empty_cache`, it synchronizes the device and releases the general pool's empty
    /// arenas too. Returns the bytes released.
    pub fn graph_pool_empty_cache(&self, device: DeviceId, id: GraphPoolId) -> Result<u64> {
        let dp = self.dev(device)?;
        {
            let st = dp.state.lock();
            let slot = st.pool_slot(id)?;
            if st.graph_pools.in_use(slot) {
                return Ok(0);
            }
        }
        self.release_cached(dp)
    }
}
