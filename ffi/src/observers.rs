//! Arena observers in the C API: register each arena once with a transport (UCX, NIXL) in
//! `on_ready` and deregister it in `on_release`, before its memory goes.
//!
//! The rules are the core crate's (`alloc/src/pool/state/observer_registry.rs`): `on_ready` once per
//! (observer, arena), for every arena that exists when the observer is added (on the
//! calling thread, before `gpu_arena_observe_arenas` returns) and for each new arena after
//! it is mapped and before any memory of it is handed out; `on_release` once, while the
//! arena is still mapped and its export still open, before it goes (`gpu_arena_empty_cache`,
//! the OOM retry, and `gpu_arena_unobserve_arenas`), only after an `on_ready` that returned
//! 0. No gpu-arena lock is held during a callback: it may call any gpu-arena function.

use std::ffi::{c_int, c_void};
use std::sync::Arc;

use gpu_arena::pool::{
    ArenaInfo, ArenaObserver, ObserverError, ObserverId, ARENA_EXPORTED, ARENA_PINNED,
};
use gpu_arena::Error;

use crate::errors::{fail, guard, status, GPU_ARENA_OK};
use crate::init::{existing_pool, pool};

/// `gpu_arena_arena_info_t.flags` bit: the arena has a driver export at the time of the call.
pub const GPU_ARENA_ARENA_EXPORTED: u32 = 1;

/// `gpu_arena_arena_info_t.flags` bit: the arena is pinned by an export that cannot end
/// (recycled, never destroyed while the process runs).
pub const GPU_ARENA_ARENA_PINNED: u32 = 2;

/// One arena, as an observer callback sees it. Valid for the duration of the callback.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
#[allow(non_camel_case_types)]
pub struct gpu_arena_arena_info_t {
    /// Device of the arena.
    pub device: i32,
    /// `GPU_ARENA_ARENA_*` bits: the arena's state at the time of the call (a new arena
    /// has none).
    pub flags: u32,
    /// The arena's id, unique in this process's pool.
    pub arena_id: u64,
    /// Device address of the first byte.
    pub base: *mut c_void,
    /// Size in bytes.
    pub size: usize,
}

/// An arena observer callback. `on_ready`: return 0 to take the arena; nonzero is counted
/// in `gpu_arena_stats_t.observer_errors`, the arena stays usable and this observer gets
/// no `on_release` for it. `on_release`: the return value is ignored.
#[allow(non_camel_case_types)]
pub type gpu_arena_arena_fn =
    Option<unsafe extern "C" fn(arena: *const gpu_arena_arena_info_t, user: *mut c_void) -> c_int>;

/// The C callbacks and their `user` pointer, as an observer of the pool.
struct CObserver {
    on_ready: gpu_arena_arena_fn,
    on_release: gpu_arena_arena_fn,
    /// The caller's pointer, passed back untouched.
    user: *mut c_void,
}

// SAFETY: `user` is the caller's opaque pointer, only ever passed back to the caller's
// callbacks; the header says the callbacks may run on any thread, so the caller makes
// whatever `user` points to safe to use from them.
unsafe impl Send for CObserver {}
// SAFETY: as for Send: gpu-arena never dereferences `user`.
unsafe impl Sync for CObserver {}

impl CObserver {
    /// Call `f` (if set) for `arena`; its return value.
    fn call(&self, f: gpu_arena_arena_fn, arena: &ArenaInfo) -> c_int {
        const { assert!(GPU_ARENA_ARENA_EXPORTED == ARENA_EXPORTED) };
        const { assert!(GPU_ARENA_ARENA_PINNED == ARENA_PINNED) };
        let Some(f) = f else { return 0 };
        let info = gpu_arena_arena_info_t {
            device: arena.device,
            flags: arena.flags,
            arena_id: arena.arena_id,
            base: arena.base as *mut c_void,
            size: usize::try_from(arena.size).unwrap_or(usize::MAX),
        };
        // SAFETY: `f` is the caller's callback of the documented signature; `&info` is a
        // valid gpu_arena_arena_info_t for the duration of the call and `user` is the
        // caller's own pointer.
        unsafe { f(&info, self.user) }
    }
}

impl ArenaObserver for CObserver {
    fn on_ready(&self, arena: &ArenaInfo) -> Result<(), ObserverError> {
        match self.call(self.on_ready, arena) {
            0 => Ok(()),
            rc => Err(format!("on_ready returned {rc}").into()),
        }
    }

    fn on_release(&self, arena: &ArenaInfo) {
        self.call(self.on_release, arena);
    }
}

/// Add an arena observer. `on_ready` runs, before this returns and on this thread, for every
/// arena that exists, then for each new arena after it is mapped and before any memory of
/// it is handed out (on the allocating thread). `on_release` runs once per arena whose
/// `on_ready` returned 0, while the arena is still mapped and its export still open, before
/// it goes (`gpu_arena_empty_cache`, the OOM retry) or when the observer is removed. No
/// gpu-arena lock is held during a callback: it may call any gpu-arena function (malloc,
/// free, stats, empty_cache, observe, unobserve). An `on_ready` whose allocation needs a
/// new arena gets one, nested, once; deeper such an allocation fails with
/// `GPU_ARENA_ERR_INVALID_STATE` instead of recursing. Callbacks may run on any thread, for
/// different arenas at once. Either callback may be NULL, not both; `*out_id` receives the
/// observer's id (never 0).
#[no_mangle]
pub extern "C" fn gpu_arena_observe_arenas(
    on_ready: gpu_arena_arena_fn,
    on_release: gpu_arena_arena_fn,
    user: *mut c_void,
    out_id: *mut u64,
) -> c_int {
    guard("gpu_arena_observe_arenas", || {
        let call = "gpu_arena_observe_arenas";
        if out_id.is_null() {
            return Err(fail(call, Error::invalid("out_id is NULL")));
        }
        if on_ready.is_none() && on_release.is_none() {
            return Err(fail(
                call,
                Error::invalid("on_ready and on_release are both NULL"),
            ));
        }
        let p = pool(call)?;
        let id = p.observe_arenas(Arc::new(CObserver {
            on_ready,
            on_release,
            user,
        }));
        // SAFETY: `out_id` is non-null and, per the header, points to a writable uint64_t.
        unsafe { out_id.write(id.0) };
        Ok(GPU_ARENA_OK)
    })
}

/// Remove an arena observer: its `on_release` runs (on this thread) for every arena whose
/// `on_ready` returned 0, then no callback of it runs after this returns (it waits for
/// callbacks of it running on other threads). An unknown id, or one already removed, is
/// refused with `GPU_ARENA_ERR_INVALID_ARGUMENT` and changes nothing.
#[no_mangle]
pub extern "C" fn gpu_arena_unobserve_arenas(id: u64) -> c_int {
    guard("gpu_arena_unobserve_arenas", || {
        let call = || format!("gpu_arena_unobserve_arenas(id={id})");
        let p = existing_pool(&call())?;
        status(call, p.unobserve_arenas(ObserverId(id)))
    })
}
