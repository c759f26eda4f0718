//! `empty_cache`: synchronize the device, release every completed free, take the arenas that
//! can go back to the backend (no live block, no share or export, not pinned, asleep, kept
//! by a graph pool in use, or being announced to an observer), tell their observers
//! (`on_release`), destroy them, and give back grown arenas' free chunks
//! (`shrink.rs`). The out-of-memory retry of the allocation path runs it too; an arena whose
//! destroy fails is kept as an orphan (`pool/state/orphans.rs`) and tried again.

use crate::backend::{ArenaMem, DeviceId};
use crate::error::Result;
use crate::history::Action;
use crate::pool::graphs::sync_hold::SyncHold;
use crate::pool::state::device::DeviceState;
use crate::pool::state::graph_pool_ids;
use crate::pool::state::observer_registry::{Call, Observers};
use crate::pool::state::pool::{DevicePool, Pool};
use crate::stats::DeviceMetrics;

impl Pool {
    /// Synchronize `device` (or every device for `None`) and destroy every arena with no live
    /// allocation and no share. Pinned arenas stay (recycled). Returns bytes released.
    pub fn empty_cache(&self, device: Option<DeviceId>) -> Result<u64> {
        self.hooks_before_release(device);
        if self.config.trim_on_empty_cache {
            return self
                .trim(device)
                .map(|r| r.emptied_bytes + r.released_bytes);
        }
        let mut released = 0;
        match device {
            Some(d) => released += self.release_cached(self.dev(d)?)?,
            None => {
                for dp in &self.devices {
                    released += self.release_cached(dp)?;
                }
            }
        }
        Ok(released)
    }

    /// Synchronize, release completed frees, destroy empty unshared arenas, give back grown
    /// arenas' free tails and their other free chunks.
    pub(crate) fn release_cached(&self, dp: &DevicePool) -> Result<u64> {
        let _no_capture = SyncHold::take(dp, "empty_cache")?;
        {
            let st = dp.state.lock();
            if st.arenas.is_empty() && st.orphans.is_empty() {
                return Ok(0);
            }
        }
        self.backend.synchronize(dp.device)?;
        let (doomed, releases, shrunk) = {
            let mut st = dp.state.lock();
            st.settle_all(self.backend.as_ref());
            let mut doomed = st.orphans.take_all();
            let (empty, releases) = self.take_empty_observed(dp, &mut st);
            doomed.extend(empty);
            let shrunk = self.shrink_free_tails(dp, &mut st) + self.drop_free_chunks(dp, &mut st);
            (doomed, releases, shrunk)
        };
        // Observers' on_release, with the lock released, before the arenas are destroyed.
        self.count_failures(self.observers.deliver(releases));
        let mut released = shrunk;
        let mut first_err = None;
        for mem in doomed {
            let bytes = mem.bytes;
            // (Counted as `backend_destroys` when taken: `DeviceState::take_empty_arenas`.)
            match self.backend.destroy_arena(mem.clone()) {
                Ok(()) => released += bytes,
                Err(e) => {
                    // Kept, and tried again by the next empty_cache and at teardown.
                    tracing::error!(error = %e, "destroy_arena failed; will retry");
                    dp.state.lock().keep_orphan(mem);
                    first_err.get_or_insert(e);
                }
            }
        }
        let st = dp.state.lock();
        dp.metrics.publish(&st.stats_now());
        if self.config.validate {
            st.validate_or_log();
        }
        drop(st);
        match first_err {
            Some(e) => Err(e),
            None => Ok(released),
        }
    }

    /// Under the device lock: take the arenas that can go back to the backend (none whose
    /// `on_ready` runs now) and claim their observers' `on_release`.
    pub(crate) fn take_empty_observed(
        &self,
        dp: &DevicePool,
        st: &mut DeviceState,
    ) -> (Vec<ArenaMem>, Vec<Call>) {
        let mut reg = self.observers.reg.lock();
        let taken =
            st.take_empty_arenas(|base| Observers::busy(&reg, (dp.device, base)), &dp.metrics);
        let calls = taken
            .iter()
            .flat_map(|m| Observers::claim_release_in(&mut reg, (dp.device, m.base), 0))
            .collect();
        (taken, calls)
    }
}

impl DeviceState {
    /// Take every arena that can go back to the backend: no allocation, no share, no
    /// export, not pinned, and not `busy` (by base: an observer's `on_ready` of it runs).
    /// Called after `settle_all`. Counted here, in the stats and the metrics alike, as
    /// `backend_destroys` (a grown arena's chunks): a destroy that fails is retried from the
    /// orphans without being counted again.
    pub(crate) fn take_empty_arenas(
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
                    && !graph_pool_ids::keeps_arenas(&self.graph_pools, a.graph_pool)
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
}
