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
use crate::pool::Pool;

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
struct HookList {
    last_id: u64,
    hooks: Vec<(u64, Weak<dyn PoolHook>)>,
}

/// The pool's hooks, by id.
#[derive(Default)]
pub(crate) struct Hooks {
    list: parking_lot::Mutex<HookList>,
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

impl Pool {
    /// Add a hook (held weakly: it lives as long as its owner keeps the `Arc`). Returns its
    /// id for [`Pool::remove_hook`].
    pub fn add_hook(&self, hook: Weak<dyn PoolHook>) -> u64 {
        let mut l = self.hooks.list.lock();
        l.last_id += 1;
        let id = l.last_id;
        l.hooks.push((id, hook));
        id
    }

    /// Remove a hook; an unknown id does nothing.
    pub fn remove_hook(&self, id: u64) {
        self.hooks.list.lock().hooks.retain(|(i, _)| *i != id);
    }

    /// Whether the owner freed the allocation holding `ptr` while shares or leases kept it
    /// (its free is deferred): what a hook's `before_release` ends shares of. `false` for a
    /// live allocation and for memory that is not an allocation.
    pub fn freed_while_shared(&self, ptr: u64) -> bool {
        self.devices.iter().any(|dp| {
            let mut st = dp.state.lock();
            if st.arena_of(ptr).is_none() {
                return false;
            }
            let start = st.ranges_of(ptr).and_then(|r| r.allocated_containing(ptr));
            let Some((start, _)) = start else {
                return false;
            };
            st.promote(start);
            st.allocs.get(&start).is_some_and(|l| l.hold.freed())
        })
    }

    pub(crate) fn hooks_before_sleep(&self, device: DeviceId, tags: u64) {
        for h in self.hooks.live() {
            h.before_sleep(device, tags);
        }
    }

    pub(crate) fn hooks_after_wake(&self, device: DeviceId, tags: u64) {
        for h in self.hooks.live() {
            h.after_wake(device, tags);
        }
    }

    pub(crate) fn hooks_before_release(&self, device: Option<DeviceId>) {
        for h in self.hooks.live() {
            h.before_release(device);
        }
    }

    /// The tag (index) of the arena holding `ptr`, if gpu-arena allocated it.
    pub fn tag_of(&self, ptr: u64) -> Option<u8> {
        self.devices.iter().find_map(|dp| {
            let st = dp.state.lock();
            st.arena_of(ptr)
                .and_then(|k| st.arenas.get(k))
                .map(|a| a.tag)
        })
    }
}
