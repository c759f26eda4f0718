//! Arena observers: code told once when each arena appears and once before it goes, so that
//! it can register the arena with a transport (UCX, NIXL, an RDMA NIC) and deregister it
//! before the memory is freed.
//!
//! # What is called, and when
//!
//! - `on_ready(arena)` runs once per (observer, arena): for every arena that exists when the
//!   observer is added (from [`Pool::observe_arenas`](crate::Pool::observe_arenas), on the calling thread), and for each
//!   new arena after the backend created and mapped it and **before any memory of it is
//!   handed out** (on the thread whose allocation created it).
//! - `on_release(arena)` runs at most once per (observer, arena), only after that
//!   observer's `on_ready` for it returned `Ok`, and while the arena is still mapped and
//!   valid: before its export (if any) is closed and before the backend destroys it. An
//!   arena goes away in `empty_cache` (and the OOM retry, which calls it), at pool drop
//!   (pinned and still-exported arenas too, before their export is closed), and when its
//!   observer is removed ([`Pool::unobserve_arenas`](crate::Pool::unobserve_arenas) calls `on_release` for every arena
//!   that observer saw, then never calls it again). An arena whose last share ended stays
//!   in the pool (its range is reused) until one of those: that is when it is released.
//! - An `on_ready` that fails (`Err`, a panic, or a nonzero return in C) is logged and
//!   counted in [`PoolStats::observer_errors`](crate::PoolStats::observer_errors) of the
//!   arena's device; the arena stays usable, and that observer gets **no** `on_release`
//!   for it (it never took it). A panicking `on_release` is logged and counted too.
//!
//! # Locks, and what a callback may call
//!
//! No gpu-arena lock is held while a callback runs: neither a device lock nor this
//! registry's. A callback may call back into the pool: stats, alloc, free, share,
//! empty_cache, observe and unobserve (itself included). Two rules make that safe:
//!
//! - a new arena enters the pool (where allocations can take it) only once every `on_ready`
//!   of it, from any thread, has returned: the creating thread waits for deliveries made
//!   by an `observe_arenas` that raced with it;
//! - `empty_cache` leaves an arena alone while an `on_ready` of it runs (a later
//!   `empty_cache` releases it), so a callback calling `empty_cache` never waits on itself.
//!
//! An `on_ready` may allocate. An allocation that needs a new arena creates it and runs its
//! `on_ready` nested (the arena being readied is not usable yet); one level of that is
//! allowed ([`MAX_NESTED_ARENAS`]), deeper such an allocation fails with
//! [`Error::InvalidState`], so an `on_ready` that always allocates cannot recurse without
//! end (its nested arena's `on_ready` fails and is counted; the outer allocation is served).
//!
//! `unobserve_arenas` returns only when no callback of that observer runs on another thread;
//! calls from that observer's own callbacks on the calling thread are not waited for.
//! Hence a callback must not unobserve a *different* observer while that observer's
//! callback waits on it (a cycle of the caller's making).
//!
//! # Ordering, with threads
//!
//! Adding an observer and registering a new arena are ordered by one registry lock: an
//! arena registered before the observer is in the observer's snapshot (delivered by
//! `observe_arenas`); one registered after it gets the observer from the creating thread.
//! So each (observer, arena) gets exactly one `on_ready`, and at most one `on_release`,
//! claimed under the same lock by exactly one of: the release of the arena, `unobserve`,
//! or the thread whose `on_ready` finished after either had started (it then calls
//! `on_release` at once). Callbacks of one observer may run concurrently on several threads
//! (for different arenas).
//!
//! The same two calls, [`Observers::claim_release`] under the device lock and
//! [`Observers::deliver`] after unlocking, serve any future path that unmaps an arena (a
//! "sleep" would release its arenas this way and register them anew on wake).

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::thread::ThreadId;

use parking_lot::{Condvar, Mutex};

use crate::backend::{ArenaMem, DeviceId};
use crate::error::{Error, Result};
use crate::lifetime::ArenaLifetime;

/// [`ArenaInfo::flags`] bit: the arena has a driver export at the time of the call.
pub const ARENA_EXPORTED: u32 = 1;
/// [`ArenaInfo::flags`] bit: the arena is pinned by an export that cannot end (recycled,
/// never destroyed before the pool goes).
pub const ARENA_PINNED: u32 = 2;

/// One arena, as an observer sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArenaInfo {
    /// Device of the arena.
    pub device: DeviceId,
    /// [`ARENA_EXPORTED`], [`ARENA_PINNED`]: the state at the time of the call
    /// (informational; a new arena has none).
    pub flags: u32,
    /// The arena's id, unique in the pool (share handles name arenas by it).
    pub arena_id: u64,
    /// Device address of the first byte.
    pub base: u64,
    /// Size in bytes.
    pub size: u64,
}

impl ArenaInfo {
    /// An arena `id` of `device` mapped at `mem`, as observers see it when it is new or
    /// mapped again (no flags yet).
    pub(crate) fn mapped(device: DeviceId, id: u64, mem: &ArenaMem) -> ArenaInfo {
        ArenaInfo {
            device,
            flags: 0,
            arena_id: id,
            base: mem.base,
            size: mem.bytes,
        }
    }
}

/// Why an observer refused an arena.
pub type ObserverError = Box<dyn std::error::Error + Send + Sync>;

/// Told when each arena of a pool appears and before it goes (module docs: when, which
/// thread, what a callback may call).
pub trait ArenaObserver: Send + Sync {
    /// The arena exists and is mapped; no memory of a new arena has been handed out yet.
    /// An `Err` is logged and counted (`observer_errors`); the arena stays usable and this
    /// observer gets no `on_release` for it.
    fn on_ready(&self, arena: &ArenaInfo) -> std::result::Result<(), ObserverError>;
    /// The arena is still mapped and valid, and is about to go (or this observer is being
    /// removed). Called once, only after `on_ready` for it returned `Ok`.
    fn on_release(&self, arena: &ArenaInfo);
}

/// The id of an observer, from [`Pool::observe_arenas`](crate::Pool::observe_arenas). Never 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObserverId(pub u64);

/// An arena in the registry: device and base address (unique while it is mapped).
pub(crate) type ArenaKey = (DeviceId, u64);

struct ObserverEntry {
    observer: Arc<dyn ArenaObserver>,
    /// Being unobserved: no new call of it starts.
    removing: bool,
    /// One entry per callback of it running now, by thread.
    in_flight: Vec<ThreadId>,
    /// `unobserve_arenas` returned while one of its own callbacks ran on its thread: the
    /// entry goes with that callback's end (a delivered `on_ready` still gets its release).
    unobserved: bool,
}

struct ArenaEntry {
    info: ArenaInfo,
    /// Observers whose `on_ready` returned `Ok`: each is owed one `on_release`.
    ready: Vec<u64>,
    /// Observers whose `on_ready` of it runs now.
    delivering: Vec<u64>,
}

#[derive(Default)]
pub(crate) struct Registry {
    next_id: u64,
    observers: BTreeMap<u64, ObserverEntry>,
    arenas: HashMap<ArenaKey, ArenaEntry>,
}

/// Which callback a [`Call`] makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Ready,
    Release,
}

/// A callback claimed under the registry lock (and counted in flight), to make after it.
pub(crate) struct Call {
    id: u64,
    observer: Arc<dyn ArenaObserver>,
    pub(crate) info: ArenaInfo,
    kind: Kind,
}

impl Registry {
    /// Claim a call of observer `id` on this thread: it counts as in flight until `done`.
    fn claim(&mut self, id: u64, info: ArenaInfo, kind: Kind) -> Option<Call> {
        let o = self.observers.get_mut(&id)?;
        o.in_flight.push(std::thread::current().id());
        Some(Call {
            id,
            observer: o.observer.clone(),
            info,
            kind,
        })
    }

    /// A claimed call returned. The last call of an observer being removed removes it.
    fn done(&mut self, id: u64) {
        let me = std::thread::current().id();
        if let Some(o) = self.observers.get_mut(&id) {
            if let Some(i) = o.in_flight.iter().position(|t| *t == me) {
                o.in_flight.swap_remove(i);
            }
            if o.removing && o.in_flight.is_empty() && o.unobserved {
                self.observers.remove(&id);
            }
        }
    }

    fn live_observers(&self) -> Vec<u64> {
        self.observers
            .iter()
            .filter(|(_, o)| !o.removing)
            .map(|(&id, _)| id)
            .collect()
    }
}

/// The observers of a pool and the arenas they are told about (one per [`Pool`](crate::Pool)).
#[derive(Default)]
pub(crate) struct Observers {
    pub(crate) reg: Mutex<Registry>,
    /// Signalled whenever a call returns.
    pub(crate) changed: Condvar,
}

impl fmt::Debug for Observers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let reg = self.reg.lock();
        f.debug_struct("Observers")
            .field("observers", &reg.observers.len())
            .field("arenas", &reg.arenas.len())
            .finish()
    }
}

/// The flags of an arena's lifetime.
pub(crate) fn flags_of(lifetime: &ArenaLifetime<crate::backend::Export>) -> u32 {
    let mut f = 0;
    if lifetime.export().is_some() {
        f |= ARENA_EXPORTED;
    }
    if lifetime.pinned() {
        f |= ARENA_PINNED;
    }
    f
}

/// How many new arenas a thread may create from inside `on_ready` callbacks, nested: an
/// `on_ready` that allocates may need a new arena (the one it readies is not usable yet),
/// whose `on_ready` allocates in turn; past this depth such an allocation fails instead of
/// recursing without end.
pub const MAX_NESTED_ARENAS: u32 = 1;

thread_local! {
    /// `on_ready` callbacks running on this thread, nested.
    pub(crate) static READY_DEPTH: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Whether a call succeeded: `on_ready` returned `Ok`, `on_release` did not panic.
fn run(call: &Call) -> bool {
    let info = &call.info;
    let outcome = catch_unwind(AssertUnwindSafe(|| match call.kind {
        Kind::Ready => {
            READY_DEPTH.with(|d| d.set(d.get() + 1));
            let r = call.observer.on_ready(info);
            READY_DEPTH.with(|d| d.set(d.get() - 1));
            r
        }
        Kind::Release => {
            call.observer.on_release(info);
            Ok(())
        }
    }));
    if outcome.is_err() && call.kind == Kind::Ready {
        READY_DEPTH.with(|d| d.set(d.get().saturating_sub(1)));
    }
    let why = match outcome {
        Ok(Ok(())) => return true,
        Ok(Err(e)) => e.to_string(),
        Err(_) => "it panicked".to_string(),
    };
    tracing::warn!(
        observer = call.id,
        device = info.device,
        arena = info.arena_id,
        base = info.base,
        callback = if call.kind == Kind::Ready {
            "on_ready"
        } else {
            "on_release"
        },
        "arena observer failed: {why}{}",
        if call.kind == Kind::Ready {
            " (the arena stays usable; this observer gets no on_release for it)"
        } else {
            ""
        }
    );
    false
}

impl Observers {
    /// Register a new arena (not yet in the pool) and claim `on_ready` of every observer.
    pub(crate) fn register_arena(&self, info: ArenaInfo) -> Vec<Call> {
        let mut reg = self.reg.lock();
        let ids = reg.live_observers();
        let calls: Vec<Call> = ids
            .into_iter()
            .filter_map(|id| reg.claim(id, info, Kind::Ready))
            .collect();
        reg.arenas.insert(
            (info.device, info.base),
            ArenaEntry {
                info,
                ready: Vec::new(),
                delivering: calls.iter().map(|c| c.id).collect(),
            },
        );
        calls
    }

    /// Sleep (`pool/sleep_wake/sleep.rs`), under the device lock: unless an `on_ready` of the arena at
    /// `key` runs now (then `None`: the arena stays awake), remove it from the registry and
    /// claim its observers' `on_release`, delivered after unlocking.
    pub(crate) fn claim_sleep(&self, key: ArenaKey) -> Option<Vec<Call>> {
        let mut reg = self.reg.lock();
        if Self::busy(&reg, key) {
            return None;
        }
        Some(Self::claim_release_in(&mut reg, key, 0))
    }

    /// Wake (`pool/sleep_wake/sleep.rs`): register an arena mapped again and claim `on_ready` of
    /// every observer.
    pub(crate) fn announce(&self, info: ArenaInfo) -> Vec<Call> {
        self.register_arena(info)
    }

    /// A growth step, or a shrink, of the arena at `key` (`pool/growth/grow.rs`, `shrink.rs`, under the device
    /// lock): made by `resize` with the registry locked, so no observer can come and be told
    /// of the arena meanwhile; `None` (nothing done) while any observer is registered (they
    /// are told of arenas, not of size changes) or a call about the arena is under way. On
    /// success the registry records the new size, which a later observer is told.
    pub(crate) fn resize_unobserved(
        &self,
        key: ArenaKey,
        resize: impl FnOnce() -> Result<ArenaMem>,
    ) -> Option<Result<ArenaMem>> {
        let mut reg = self.reg.lock();
        if !Self::unobserved(&reg, key) {
            return None;
        }
        let resized = resize();
        if let (Ok(mem), Some(a)) = (&resized, reg.arenas.get_mut(&key)) {
            a.info.size = mem.bytes;
        }
        Some(resized)
    }

    /// An arena at `key` replaced by arenas of its own memory (`pool/growth/shrink.rs`: a grown
    /// arena's free chunks dropped, under the device lock): made by `replace` with the
    /// registry locked, so no observer can come meanwhile; `None` (nothing done) while any
    /// observer is registered (they would be owed an `on_release` of the arena and an
    /// `on_ready` of each part) or a call about the arena is under way. On success the
    /// registry holds the parts instead (`replace` returns them with their ids).
    pub(crate) fn replace_unobserved(
        &self,
        key: ArenaKey,
        replace: impl FnOnce() -> Result<Vec<(u64, ArenaMem)>>,
    ) -> Option<Result<Vec<(u64, ArenaMem)>>> {
        let mut reg = self.reg.lock();
        if !Self::unobserved(&reg, key) {
            return None;
        }
        let parts = replace();
        if let Ok(parts) = &parts {
            reg.arenas.remove(&key);
            for (id, mem) in parts {
                let info = ArenaInfo::mapped(mem.device, *id, mem);
                let entry = ArenaEntry {
                    info,
                    ready: Vec::new(),
                    delivering: Vec::new(),
                };
                reg.arenas.insert((mem.device, mem.base), entry);
            }
        }
        Some(parts)
    }

    /// Whether no observer is registered and no call about the arena at `key` is owed or
    /// under way (it may change shape untold).
    fn unobserved(reg: &Registry, key: ArenaKey) -> bool {
        reg.observers.is_empty()
            && reg
                .arenas
                .get(&key)
                .is_some_and(|a| a.ready.is_empty() && a.delivering.is_empty())
    }

    /// Whether an `on_ready` of the arena at `key` runs now (it must not be released).
    pub(crate) fn busy(reg: &Registry, key: ArenaKey) -> bool {
        reg.arenas
            .get(&key)
            .is_some_and(|a| !a.delivering.is_empty())
    }

    /// Remove the arena at `key` from the registry and claim the `on_release` owed to each
    /// observer that took it. Call with the device lock held (or exclusive access), so
    /// that the arena leaves the pool and the registry at once; deliver after unlocking.
    pub(crate) fn claim_release(&self, key: ArenaKey, flags: u32) -> Vec<Call> {
        let mut reg = self.reg.lock();
        Self::claim_release_in(&mut reg, key, flags)
    }

    pub(crate) fn claim_release_in(reg: &mut Registry, key: ArenaKey, flags: u32) -> Vec<Call> {
        let Some(a) = reg.arenas.remove(&key) else {
            return Vec::new();
        };
        debug_assert!(a.delivering.is_empty(), "released during its on_ready");
        let info = ArenaInfo { flags, ..a.info };
        a.ready
            .into_iter()
            .filter_map(|id| reg.claim(id, info, Kind::Release))
            .collect()
    }

    /// Make claimed calls, no lock held. Returns the failures per device.
    pub(crate) fn deliver(&self, calls: Vec<Call>) -> Vec<DeviceId> {
        let mut failed = Vec::new();
        for call in calls {
            let ok = run(&call);
            if !ok {
                failed.push(call.info.device);
            }
            let mut reg = self.reg.lock();
            let mut release_now = None;
            if call.kind == Kind::Ready {
                let key = (call.info.device, call.info.base);
                let removing = reg.observers.get(&call.id).is_none_or(|o| o.removing);
                match reg.arenas.get_mut(&key) {
                    Some(a) => {
                        a.delivering.retain(|&id| id != call.id);
                        if ok && !removing {
                            a.ready.push(call.id);
                        } else if ok {
                            release_now = Some(a.info);
                        }
                    }
                    // Never released while delivering; if it were, it is owed a release.
                    None if ok => release_now = Some(call.info),
                    None => {}
                }
            }
            // Claimed before this call counts as done, so that the observer is still there.
            let release = release_now.and_then(|info| reg.claim(call.id, info, Kind::Release));
            reg.done(call.id);
            drop(reg);
            self.changed.notify_all();
            if let Some(r) = release {
                failed.extend(self.deliver(vec![r]));
            }
        }
        failed
    }

    /// Add an observer: claim `on_ready` of every registered arena.
    pub(crate) fn add(&self, observer: Arc<dyn ArenaObserver>) -> (ObserverId, Vec<Call>) {
        let mut reg = self.reg.lock();
        reg.next_id += 1;
        let id = reg.next_id;
        reg.observers.insert(
            id,
            ObserverEntry {
                observer,
                removing: false,
                in_flight: Vec::new(),
                unobserved: false,
            },
        );
        let mut calls = Vec::new();
        let reg = &mut *reg;
        for a in reg.arenas.values_mut() {
            a.delivering.push(id);
            if let Some(o) = reg.observers.get_mut(&id) {
                o.in_flight.push(std::thread::current().id());
                calls.push(Call {
                    id,
                    observer: o.observer.clone(),
                    info: a.info,
                    kind: Kind::Ready,
                });
            }
        }
        (ObserverId(id), calls)
    }

    /// Start removing an observer: claim the `on_release` of every arena it took.
    pub(crate) fn start_remove(&self, id: ObserverId) -> Result<Vec<Call>> {
        let mut reg = self.reg.lock();
        match reg.observers.get_mut(&id.0) {
            Some(o) if !o.removing => o.removing = true,
            Some(_) => {
                return Err(Error::invalid(format!(
                    "arena observer {} is being unobserved by another call",
                    id.0
                )))
            }
            None => {
                return Err(Error::invalid(format!(
                    "arena observer {} is not registered (never observed, or already unobserved)",
                    id.0
                )))
            }
        }
        let mut owed = Vec::new();
        for a in reg.arenas.values_mut() {
            if let Some(i) = a.ready.iter().position(|&o| o == id.0) {
                a.ready.swap_remove(i);
                owed.push(a.info);
            }
        }
        Ok(owed
            .into_iter()
            .filter_map(|info| reg.claim(id.0, info, Kind::Release))
            .collect())
    }

    /// At teardown (exclusive access): tell the observers the arena at `base` goes, before
    /// its export is closed and it is destroyed (failures are logged by `run`).
    pub(crate) fn release_at_teardown(
        &self,
        device: DeviceId,
        base: u64,
        lifetime: &ArenaLifetime<crate::backend::Export>,
    ) {
        let calls = self.claim_release((device, base), flags_of(lifetime));
        self.deliver(calls);
    }

    /// Finish removing an observer: wait until no callback of it runs on another thread.
    pub(crate) fn finish_remove(&self, id: ObserverId) {
        let me = std::thread::current().id();
        let mut reg = self.reg.lock();
        while reg
            .observers
            .get(&id.0)
            .is_some_and(|o| o.in_flight.iter().any(|t| *t != me))
        {
            self.changed.wait(&mut reg);
        }
        match reg.observers.get_mut(&id.0) {
            // Its own callback on this thread is still running: `done` removes it.
            Some(o) if !o.in_flight.is_empty() => o.unobserved = true,
            _ => {
                reg.observers.remove(&id.0);
            }
        }
    }
}
