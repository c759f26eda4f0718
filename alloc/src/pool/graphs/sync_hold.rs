//! [`SyncHold`]: a call that synchronizes a device (`empty_cache`, `trim`, `sleep`, `wake`)
//! holds it from its check that no allocation is routed to a graph pool until it ends, so
//! that no capture begins meanwhile (`graph_pools.rs`, rule 4).

use crate::error::Result;
use crate::pool::state::pool::DevicePool;

/// A call that synchronizes a device is under way on this thread (`empty_cache`, `trim`,
/// `sleep`, `wake`): taken where the call checks that no allocations are routed to a graph
/// pool, dropped when it is done. While one is held, [`Pool::graph_pool_begin`] waits: the
/// check alone, its lock released before the driver's synchronize, left a window in which
/// another thread could begin a capture that the synchronize then invalidated.
pub(crate) struct SyncHold<'a> {
    dp: &'a DevicePool,
}

impl<'a> SyncHold<'a> {
    /// Check that `dp` routes no allocation to a graph pool (else `what` is refused) and
    /// hold it so until the returned hold drops.
    pub(crate) fn take(dp: &'a DevicePool, what: &str) -> Result<Self> {
        let mut st = dp.state.lock();
        st.check_not_routing(dp.device, what)?;
        st.graph_pools.start_sync();
        Ok(SyncHold { dp })
    }
}

impl Drop for SyncHold<'_> {
    fn drop(&mut self) {
        self.dp.state.lock().graph_pools.end_sync();
        self.dp.sync_ended.notify_all();
    }
}
