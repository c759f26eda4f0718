//! Pool hooks: what a holder of shares (the transfer engine, `crate::transfer`) is told
//! around the calls that need its shares gone, so it can end them first (and share again
//! after a wake). A shared arena is kept awake by sleep and kept by `empty_cache` and trim
//! (a consumer may be reading it): a hook is how the one who shared it lets it go.
//!
//! Hooks run on the calling thread with no device lock held (a sleep or a trim holds only
//! the pool's sleep lock), before the call decides anything; they may block for a bounded
//! time (the engine waits for its consumers to close their imports). The pool holds them
//! weakly: a hook whose owner is gone is skipped and forgotten.

use std::sync::{Arc, Weak};

use crate::ids::DeviceId;

/// Told around sleep, wake and release of cached memory. See the module docs.
pub trait PoolHook: Send + Sync {
    /// The tags in `tags` (bit = tag index) of `device` are about to sleep.
    fn before_sleep(&self, device: DeviceId, tags: u64);
    /// The tags in `tags` of `device` woke (their memory is mapped again).
    fn after_wake(&self, device: DeviceId, tags: u64);
    /// `empty_cache` or `trim` of `device` (every device for `None`) is about to release
    /// cached memory: end the shares of allocations their owner freed.
    fn before_release(&self, device: Option<DeviceId>);
}

/// The hooks added so far (by id) and the last id handed out.
#[derive(Default)]
pub(crate) struct HookList {
    pub(crate) last_id: u64,
    pub(crate) hooks: Vec<(u64, Weak<dyn PoolHook>)>,
}

/// The pool's hooks, by id.
#[derive(Default)]
pub(crate) struct Hooks {
    pub(crate) list: parking_lot::Mutex<HookList>,
}

impl std::fmt::Debug for Hooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hooks")
            .field("count", &self.list.lock().hooks.len())
            .finish()
    }
}

impl Hooks {
    /// The live hooks now (dead ones forgotten).
    pub(crate) fn live(&self) -> Vec<Arc<dyn PoolHook>> {
        let mut l = self.list.lock();
        l.hooks.retain(|(_, w)| w.strong_count() > 0);
        l.hooks.iter().filter_map(|(_, w)| w.upgrade()).collect()
    }
}
