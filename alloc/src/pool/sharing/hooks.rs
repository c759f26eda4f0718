//! Pool hooks, as the pool calls them: adding and removing a hook, telling the live ones
//! around sleep, wake and release, and the two queries a holder of shares asks (whether its
//! allocation was freed meanwhile, the tag of an address). The hook trait and the list are
//! `pool/state/pool_hook.rs`'s, whose module docs say what a hook is for.

use std::sync::Weak;

use crate::ids::DeviceId;
use crate::pool::state::pool::Pool;
use crate::pool::state::pool_hook::PoolHook;

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
