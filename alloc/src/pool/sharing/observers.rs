//! Arena observers, as the pool serves them: adding and removing an observer, and counting
//! the callbacks that failed. The registry and its rules (what is called, and when) are
//! `pool/state/observer_registry.rs`'s; an arena entering the pool is told to them by
//! `pool/paths/new_arena.rs`, one leaving by `empty_cache` (`pool/growth/empty_cache.rs`).

use std::sync::Arc;

use crate::backend::DeviceId;
use crate::error::Result;
use crate::pool::state::observer_registry::{flags_of, ArenaObserver, ObserverId};
use crate::pool::state::pool::Pool;

impl Pool {
    /// Add an arena observer: its `on_ready` runs now, on this thread, for every arena the
    /// pool holds, then for every new arena before memory of it is handed out; its
    /// `on_release` before each arena it took goes (module docs of `pool/state/observer_registry.rs`).
    pub fn observe_arenas(&self, observer: Arc<dyn ArenaObserver>) -> ObserverId {
        let (id, mut calls) = self.observers.add(observer);
        for c in &mut calls {
            c.info.flags = self.arena_flags(c.info.device, c.info.base);
        }
        self.count_failures(self.observers.deliver(calls));
        id
    }

    /// Remove an arena observer: its `on_release` runs for every arena it took (on this
    /// thread), and no callback of it runs after this returns (calls from its own callback
    /// on this thread aside). An unknown or already removed id is refused
    /// ([`Error::InvalidArgument`](crate::Error::InvalidArgument)) and changes nothing.
    pub fn unobserve_arenas(&self, id: ObserverId) -> Result<()> {
        let calls = self.observers.start_remove(id)?;
        self.count_failures(self.observers.deliver(calls));
        self.observers.finish_remove(id);
        Ok(())
    }

    /// The flags of the arena at `base` now (0 when it is not in the pool yet).
    fn arena_flags(&self, device: DeviceId, base: u64) -> u32 {
        let Ok(dp) = self.dev(device) else { return 0 };
        let st = dp.state.lock();
        st.arena_of(base)
            .and_then(|k| st.arenas.get(k))
            .map_or(0, |a| flags_of(&a.lifetime))
    }

    /// Count failed callbacks in their devices' stats.
    pub(crate) fn count_failures(&self, devices: Vec<DeviceId>) {
        for d in devices {
            if let Ok(dp) = self.dev(d) {
                dp.state.lock().stats.observer_errors += 1;
            }
        }
    }
}
