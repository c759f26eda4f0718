//! Sharing, as the pool performs it: `share`, `unshare`, consumer leases, the export
//! self-test and the teardown of exports. Every decision (take or drop a reference, export
//! or wait, close the export, release a deferred free, refuse a revoked or stale share) is
//! [`crate::lifetime::ArenaLifetime`]'s, whose module docs hold the state table; this file
//! looks the records up, makes the driver calls it asks for (exports and closes with the
//! device lock released) and keeps the counters.
//!
//! Pinning is known two ways: the backend says so ([`ExportKind::Pinning`]), or the start-up
//! self-test ([`Pool::export_semantics`]: create, export, close, destroy, compare
//! `mem_info`) finds the driver still holding the memory. The self-test costs one
//! granularity of memory on a pinning driver, once per device per process.

use std::sync::atomic::{AtomicU64, Ordering};

use rustc_hash::FxHashMap;
use slab::Slab;

use crate::backend::{ArenaMem, Backend, DeviceId, Export, ExportKind, ExportPayload};
use crate::error::{Error, Result};
use crate::lifetime::{AllocHold, ArenaLifetime, Ended, ExportStep, LifetimeError};
use crate::pool::state::arena::{Arena, Live};
use crate::pool::state::device::DeviceState;
use crate::pool::state::pool::{DevicePool, Pool};
use crate::pool::state::share_tables::{LeaseEntry, LeaseGrant, ShareEntry, ShareInfo};

/// An export to close once the lock is released, with the memory it exports.
type ToClose = Option<(ArenaMem, Export)>;

/// Bytes of the kernel's CSPRNG fetched per `getrandom` call: 256 tokens.
const TOKEN_BATCH: usize = 4096;

/// Tokens are cut from [`TOKEN_BATCH`] bytes of the kernel's CSPRNG (`getrandom`) at a time,
/// each byte used once: one syscall per 256 shares instead of one per share. The batch is
/// refetched in a forked child (its [`fork_generation`] differs), so parent and child never
/// hand out the same token.
struct TokenBatch {
    /// The [`fork_generation`] the bytes were fetched in.
    generation: u64,
    used: usize,
    bytes: [u8; TOKEN_BATCH],
}

static TOKENS: parking_lot::Mutex<TokenBatch> = parking_lot::const_mutex(TokenBatch {
    generation: 0,
    used: TOKEN_BATCH,
    bytes: [0; TOKEN_BATCH],
});

/// Forks this process went through (as a child): bumped by a `pthread_atfork` child
/// handler, so a share learns it runs in a forked child without a `getpid` syscall.
static FORK_GENERATION: AtomicU64 = AtomicU64::new(0);

extern "C" fn after_fork_in_child() {
    // Async-signal-safe: one atomic add.
    FORK_GENERATION.fetch_add(1, Ordering::Relaxed);
}

/// The fork generation of this process. The handler is registered on the first call, before
/// any token is cut: a fork before that has no batch to duplicate. `None` when it could not
/// be registered: a forked child could then reuse its parent's tokens, so none are cut.
fn fork_generation() -> Option<u64> {
    static REGISTERED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let registered = *REGISTERED.get_or_init(|| {
        // SAFETY: registers a handler that only does an atomic add; no prepare/parent ones.
        unsafe { libc::pthread_atfork(None, None, Some(after_fork_in_child)) == 0 }
    });
    registered.then(|| FORK_GENERATION.load(Ordering::Relaxed))
}

fn random_token() -> Result<[u8; 16]> {
    let generation = fork_generation().ok_or_else(|| {
        Error::Internal("pthread_atfork failed: share tokens cannot be made fork-safe".into())
    })?;
    let mut batch = TOKENS.lock();
    if batch.used + 16 > TOKEN_BATCH || batch.generation != generation {
        let mut filled = 0;
        while filled < TOKEN_BATCH {
            let n = rustix::rand::getrandom(
                &mut batch.bytes[filled..],
                rustix::rand::GetRandomFlags::empty(),
            )
            .map_err(|e| Error::Internal(format!("getrandom failed: {e}")))?;
            filled += n;
        }
        batch.generation = generation;
        batch.used = 0;
    }
    let at = batch.used;
    let mut token = [0u8; 16];
    token.copy_from_slice(&batch.bytes[at..at + 16]);
    // Used bytes are wiped: a later reader of this memory learns no live token.
    batch.bytes[at..at + 16].fill(0);
    batch.used += 16;
    Ok(token)
}

/// A transition the lifetime refused where the pool's records say it must succeed.
fn refused(what: &str, e: LifetimeError) -> Error {
    Error::Internal(format!("{what}: {e}"))
}

/// The lifetime of `arena` and the hold of the allocation at `ptr`, borrowed together.
fn holds<'a>(
    arenas: &'a mut Slab<Arena>,
    allocs: &'a mut FxHashMap<u64, Live>,
    arena: usize,
    ptr: u64,
) -> Result<(&'a mut ArenaLifetime<Export>, &'a mut AllocHold)> {
    let a = arenas
        .get_mut(arena)
        .ok_or_else(|| Error::Internal(format!("arena {arena} of a shared range is gone")))?;
    let live = allocs
        .get_mut(&ptr)
        .ok_or_else(|| Error::Internal(format!("shared allocation {ptr:#x} is gone")))?;
    Ok((&mut a.lifetime, &mut live.hold))
}

impl DeviceState {
    /// Drop one reference on `arena` and on the allocation at `ptr` (a share that could not
    /// be made). Returns the export to close after unlocking.
    fn drop_ref(
        &mut self,
        arena: usize,
        ptr: u64,
        backend: &dyn Backend,
        device: DeviceId,
    ) -> Result<ToClose> {
        let (lt, hold) = holds(&mut self.arenas, &mut self.allocs, arena, ptr)?;
        let ended = lt.drop_ref(hold).map_err(|e| refused("drop_ref", e))?;
        Ok(self.apply_ended(ended, arena, ptr, None, backend, device))
    }

    /// Do what the end of a reference asks, under the lock: remove the share's record,
    /// release the allocation its owner freed, count the export to close (returned, to be
    /// closed after unlocking).
    fn apply_ended(
        &mut self,
        ended: Ended<Export>,
        arena: usize,
        ptr: u64,
        share_key: Option<u32>,
        backend: &dyn Backend,
        device: DeviceId,
    ) -> ToClose {
        if let (true, Some(key)) = (ended.remove_share, share_key) {
            self.shares.remove_share(key);
        }
        if ended.release_freed {
            self.release_deferred(ptr, backend, device);
        }
        let export = ended.close_export?;
        self.stats.exports_live -= 1;
        Some((self.arenas.get(arena)?.mem.clone(), export))
    }

    fn share_record(&self, key: u32, token: &[u8; 16]) -> Result<&ShareEntry> {
        match self.shares.shares.get(key as usize) {
            Some(r) if &r.info.token == token => Ok(r),
            _ if self.shares.was_unshared(key, token) => Err(unshared(key)),
            _ => Err(Error::Ipc(format!(
                "share {key}: no such share (unknown key or wrong token)"
            ))),
        }
    }

    /// Why a handle naming export `generation` of arena `arena_id` found no share, when the
    /// reason is that it is stale: the arena was released, or exported again since.
    fn staleness(&self, arena_id: u64, generation: Option<u32>) -> Option<String> {
        let Some((_, a)) = self.arenas.iter().find(|(_, a)| a.id == arena_id) else {
            return Some(if arena_id != 0 && arena_id < self.next_arena_id {
                format!("the handle is stale: arena {arena_id} was released")
            } else {
                format!("the handle names arena {arena_id}, which this pool never had")
            });
        };
        let e = a.lifetime.check_generation(generation?).err()?;
        Some(format!(
            "the handle is stale: arena {arena_id}: {e} (its shares ended and it was exported again)"
        ))
    }
}

impl Pool {
    /// Share `len` bytes at `ptr` (inside one live allocation) with other processes. The
    /// arena is exported on its first share; later shares reuse the export.
    pub fn share(&self, ptr: u64, len: u64) -> Result<ShareInfo> {
        if len == 0 {
            return Err(Error::invalid("share of 0 bytes"));
        }
        let end = ptr
            .checked_add(len)
            .ok_or_else(|| Error::invalid("share range overflows"))?;
        // Cut before the device lock: its getrandom (once per 256 tokens) runs unlocked.
        let token = random_token()?;
        // The device's lock is taken once: the guard that found the arena is kept.
        let (dp, mut st) = self
            .devices
            .iter()
            .find_map(|dp| {
                let st = dp.state.lock();
                st.arena_of(ptr).is_some().then_some((dp, st))
            })
            .ok_or_else(|| Error::UnknownPointer {
                ptr,
                why: "share of memory gpu-arena did not allocate".into(),
            })?;
        if st.shares.probed_kind.get().is_none() {
            // A device's first share: the export self-test before any arena is looked up or
            // referenced here. Making room for its granule under `max_reserved` may release
            // cached memory, and `empty_cache` cuts grown arenas into new ones.
            drop(st);
            self.export_semantics(dp.device)?;
            st = dp.state.lock();
        }
        let (start, alen) = st
            .ranges_of(ptr)
            .and_then(|r| r.allocated_containing(ptr))
            .ok_or_else(|| Error::UnknownPointer {
                ptr,
                why: "share of a range that is not inside a live allocation".into(),
            })?;
        st.promote(start);
        let live = st.check_live(start, dp.device)?;
        if end > start + alen || end > start + live.requested.max(1).next_multiple_of(512) {
            return Err(Error::invalid(format!(
                "share [{ptr:#x}, +{len}) runs past its allocation [{start:#x}, +{})",
                live.requested
            )));
        }
        let arena = live.arena;
        if let Some(a) = st.arenas.get(arena) {
            if st.asleep_tags & (1 << a.tag) != 0 {
                return Err(Error::InvalidState(format!(
                    "share of {ptr:#x}: its tag {:?} is asleep (wake it first)",
                    crate::tags::name(a.tag)
                )));
            }
        }
        // Take the references first, so a concurrent free defers instead of releasing.
        {
            let st = &mut *st;
            let (lt, hold) = holds(&mut st.arenas, &mut st.allocs, arena, start)?;
            lt.take_ref(hold).map_err(|e| refused("share", e))?;
        }
        let made = self.ensure_exported(dp, &mut st, arena).and_then(|()| {
            st.arenas[arena]
                .lifetime
                .new_share()
                .map_err(|e| refused("share", e))
        });
        let hold = match made {
            Ok(hold) => hold,
            Err(e) => {
                let to_close = st.drop_ref(arena, start, self.backend.as_ref(), dp.device);
                drop(st);
                self.close_exports(
                    dp,
                    to_close.unwrap_or_else(|e| {
                        tracing::error!(error = %e, "dropping the reference of a failed share");
                        None
                    }),
                );
                return Err(e);
            }
        };
        let a = &st.arenas[arena];
        let mut info = ShareInfo {
            device: dp.device,
            share_key: 0,
            arena_id: a.id,
            generation: hold.generation(),
            arena_bytes: a.mem.bytes,
            offset: ptr - a.mem.base,
            len,
            token,
        };
        let entry = st.shares.shares.vacant_entry();
        info.share_key = u32::try_from(entry.key())
            .map_err(|_| Error::Internal("share table overflow".into()))?;
        entry.insert(ShareEntry {
            info,
            arena,
            alloc_ptr: start,
            hold,
        });
        st.stats.shares_live += 1;
        Ok(info)
    }

    /// Export the arena unless it is exported; the lock is released during the driver call.
    fn ensure_exported(
        &self,
        dp: &DevicePool,
        st: &mut parking_lot::MutexGuard<'_, DeviceState>,
        arena: usize,
    ) -> Result<()> {
        // The self-test ran at the start of the share (`Pool::share`), before its arena was
        // looked up: this reads its answer (and would run it, releasing the lock, if not).
        let probed = self.export_semantics_locked(dp, st)?;
        loop {
            let step = st.arenas[arena].lifetime.begin_export();
            match step.map_err(|e| refused("export", e))? {
                ExportStep::Ready => return Ok(()),
                ExportStep::Wait => {
                    parking_lot::MutexGuard::unlocked(st, std::thread::yield_now);
                }
                ExportStep::Export => break,
            }
        }
        let mem = st.arenas[arena].mem.clone();
        let result = parking_lot::MutexGuard::unlocked(st, || self.backend.export(&mem));
        let a = &mut st.arenas[arena];
        let export = match result {
            Ok(export) => export,
            Err(e) => {
                a.lifetime
                    .export_failed()
                    .map_err(|e| refused("export failed", e))?;
                return Err(e);
            }
        };
        let pinning = export.kind == ExportKind::Pinning || probed == ExportKind::Pinning;
        let done = match a.lifetime.finish_export(export, pinning) {
            Ok(done) => done,
            Err(export) => {
                // Never reached (only this thread exports from `Exporting`); never drop an
                // export unclosed.
                parking_lot::MutexGuard::unlocked(st, || {
                    self.close_exports(dp, Some((mem, export)))
                });
                return Err(Error::Internal(
                    "an export finished while not exporting".into(),
                ));
            }
        };
        let bytes = a.mem.bytes;
        if done.newly_pinned {
            st.stats.pinned_bytes += bytes;
            tracing::info!(
                device = dp.device,
                bytes,
                "arena pinned by its export: it will be recycled, never freed"
            );
        }
        st.stats.exports_live += 1;
        st.stats.exports_total += 1;
        dp.metrics.exports.increment(1);
        dp.metrics.publish(&st.stats_now());
        Ok(())
    }

    /// The device's export semantics from the start-up self-test (cached): `Releasable` when
    /// closing an export gives the memory back, `Pinning` when the driver keeps it.
    pub fn export_semantics(&self, device: DeviceId) -> Result<ExportKind> {
        let dp = self.dev(device)?;
        let mut st = dp.state.lock();
        self.export_semantics_locked(dp, &mut st)
    }

    fn export_semantics_locked(
        &self,
        dp: &DevicePool,
        st: &mut parking_lot::MutexGuard<'_, DeviceState>,
    ) -> Result<ExportKind> {
        if let Some(k) = st.shares.probed_kind.get() {
            return Ok(*k);
        }
        let kind = parking_lot::MutexGuard::unlocked(st, || {
            // One self-test at a time per device: two at once (the first shares of a device
            // racing) each saw the other's probe arena still held in `mem_info` and both
            // concluded "pinning", which pinned the arena for good.
            let mut probed = dp.export_probe.lock();
            if let Some(k) = *probed {
                return Ok(k);
            }
            let k = self.probe_export(dp)?;
            *probed = Some(k);
            Ok(k)
        })?;
        tracing::info!(
            device = dp.device,
            backend = self.backend.name(),
            ?kind,
            "export self-test"
        );
        Ok(*st.shares.probed_kind.get_or_init(|| kind))
    }

    /// The self-test, twice when the first run says "pinning": another process allocating
    /// at the same moment must not make gpu-arena stop freeing memory for good.
    fn probe_export(&self, dp: &DevicePool) -> Result<ExportKind> {
        match self.probe_export_once(dp)? {
            ExportKind::Releasable => Ok(ExportKind::Releasable),
            ExportKind::Pinning => self.probe_export_once(dp),
        }
    }

    /// Create, export, close, destroy one granule and compare free memory before and after.
    fn probe_export_once(&self, dp: &DevicePool) -> Result<ExportKind> {
        let device = dp.device;
        let b = self.backend.as_ref();
        // A granule whose destroy fails is kept for the next empty_cache (never lost).
        let destroy = |mem: ArenaMem| -> Result<()> {
            b.destroy_arena(mem.clone())
                .inspect_err(|_| dp.state.lock().keep_orphan(mem))
        };
        let gran = b.granularity(device)?;
        self.room_for_probe(dp, gran)?;
        let before = b.mem_info(device)?.free;
        let mem = b.create_arena(device, gran)?;
        let export = match b.export(&mem) {
            Ok(e) => e,
            Err(e) => {
                let _ = destroy(mem);
                return Err(e);
            }
        };
        let declared = export.kind;
        let closed = b.close_export(&mem, export);
        destroy(mem)?;
        closed?;
        let after = b.mem_info(device)?.free;
        // Another process may allocate meanwhile; half a granule of slack tells "our granule
        // is still held" from noise on an otherwise quiet device.
        if declared == ExportKind::Pinning || after + gran / 2 < before {
            Ok(ExportKind::Pinning)
        } else {
            Ok(ExportKind::Releasable)
        }
    }

    /// Room under `max_reserved` for the self-test's granule, which counts as an arena would
    /// (a destroy that fails keeps it, an orphan in reserved until the next `empty_cache`):
    /// at the cap the cached arenas go first, as for an allocation, else the share that needs
    /// the self-test fails as out of memory and nothing changes.
    fn room_for_probe(&self, dp: &DevicePool, gran: u64) -> Result<()> {
        let (limits, setting) = self.limits_now(dp)?;
        let reserved = || dp.state.lock().reserved_now();
        if !limits.over_cap(reserved, gran) {
            return Ok(());
        }
        if let Err(e) = self.release_cached(dp) {
            tracing::warn!(device = dp.device, error = %e, "releasing cached arenas for the export self-test failed");
        }
        if !limits.over_cap(reserved, gran) {
            return Ok(());
        }
        tracing::warn!(
            device = dp.device,
            "the export self-test before the first share needs one granule under max_reserved"
        );
        let st = dp.state.lock();
        Err(self.out_of_memory(dp, &st, &limits, setting, gran, true, gran))
    }

    /// Revoke a share: no new import of it succeeds. Imports already made stay valid until
    /// their consumers close them; the memory stays reserved until then.
    pub fn unshare(&self, device: DeviceId, share_key: u32, token: &[u8; 16]) -> Result<()> {
        let dp = self.dev(device)?;
        let mut guard = dp.state.lock();
        let st = &mut *guard;
        let already = || Error::Ipc(format!("share {share_key} already unshared"));
        if st.shares.was_unshared(share_key, token) {
            return Err(already());
        }
        let rec = st.share_record(share_key, token)?;
        if rec.hold.revoked() {
            return Err(already());
        }
        let (arena, ptr) = (rec.arena, rec.alloc_ptr);
        let (lt, hold) = holds(&mut st.arenas, &mut st.allocs, arena, ptr)?;
        let rec = &mut st.shares.shares[share_key as usize];
        let ended = lt
            .unshare(&mut rec.hold, hold)
            .map_err(|e| refused("unshare", e))?;
        st.stats.shares_live -= 1;
        self.end_ref(dp, guard, ended, arena, ptr, share_key);
        Ok(())
    }

    /// Leases open on a share now: 0 once an unshared share's last lease closed (the share
    /// has ended). A producer that revoked its consumers' imports waits for this to reach 0.
    ///
    /// # Errors
    /// [`Error::Ipc`] for a share this device never had under that key and token.
    pub fn share_leases(&self, device: DeviceId, share_key: u32, token: &[u8; 16]) -> Result<u64> {
        let st = self.dev(device)?.state.lock();
        if st.shares.was_unshared(share_key, token) {
            return Ok(0);
        }
        Ok(st.share_record(share_key, token)?.hold.leases())
    }

    /// Open a consumer's lease on a share (the broker calls this for an import request).
    pub fn open_lease(
        &self,
        device: DeviceId,
        share_key: u32,
        token: &[u8; 16],
    ) -> Result<LeaseGrant> {
        self.open_lease_in(device, share_key, token, None, true)
    }

    /// Open a lease on the share a handle names, checking the handle's arena id and its
    /// export generation: a handle of a released arena, of another arena or of an earlier
    /// export of this one is refused as stale, and nothing changes. The grant carries a
    /// duplicate of the export fd only `with_fd` (a consumer that maps the arena already needs
    /// none: no `dup` and `close` per import).
    pub fn open_lease_named(
        &self,
        device: DeviceId,
        share_key: u32,
        token: &[u8; 16],
        arena_id: u64,
        generation: u32,
        with_fd: bool,
    ) -> Result<LeaseGrant> {
        let named = Some((arena_id, Some(generation)));
        self.open_lease_in(device, share_key, token, named, with_fd)
    }

    fn open_lease_in(
        &self,
        device: DeviceId,
        share_key: u32,
        token: &[u8; 16],
        named: Option<(u64, Option<u32>)>,
        with_fd: bool,
    ) -> Result<LeaseGrant> {
        let dp = self.dev(device)?;
        let mut guard = dp.state.lock();
        let st = &mut *guard;
        let rec = match st.share_record(share_key, token) {
            Ok(rec) => rec,
            // The true cause first ("was unshared" when the holder of the token was told
            // so), then what became of the arena since.
            Err(Error::Ipc(why)) => {
                let stale = named.and_then(|(id, generation)| st.staleness(id, generation));
                return Err(Error::Ipc(match stale {
                    Some(stale) => format!("{why}; {stale}"),
                    None => why,
                }));
            }
            Err(e) => return Err(e),
        };
        // Unshared comes first: a handle of an unshared share is refused as such, whatever
        // its arena and generation (a consumer racing an unshare learns the true cause).
        if rec.hold.revoked() {
            return Err(unshared(share_key));
        }
        if let Some((id, generation)) = named {
            if rec.info.arena_id != id {
                return Err(Error::Ipc(
                    "share names another arena (stale handle)".into(),
                ));
            }
            let current = rec.hold.generation();
            if let Some(named) = generation.filter(|&g| g != current) {
                let stale = LifetimeError::Stale { named, current };
                return Err(Error::Ipc(format!(
                    "share {share_key}: stale handle: {stale}"
                )));
            }
        }
        let (arena, ptr, info) = (rec.arena, rec.alloc_ptr, rec.info);
        let a = st
            .arenas
            .get(arena)
            .ok_or_else(|| Error::Internal(format!("share {share_key} names a missing arena")))?;
        let export = a.lifetime.check_lease(&rec.hold).map_err(|e| {
            Error::Internal(format!(
                "share {share_key} on an arena that is not exported: {e}"
            ))
        })?;
        let kind = if a.lifetime.pinned() {
            ExportKind::Pinning
        } else {
            export.kind
        };
        let fds = match &export.payload {
            ExportPayload::Bytes(_) => {
                return Err(Error::Ipc(
                    "byte-handle exports are not served by the broker".into(),
                ))
            }
            _ if !with_fd => Vec::new(),
            _ => export
                .chunk_fds(a.mem.bytes)
                .into_iter()
                .map(|(n, fd)| {
                    fd.try_clone_to_owned()
                        .map(|fd| (n, fd))
                        .map_err(|e| Error::Ipc(format!("dup of the export fd failed: {e}")))
                })
                .collect::<Result<Vec<_>>>()?,
        };
        let entry = st.shares.leases.vacant_entry();
        let lease_key = u32::try_from(entry.key())
            .map_err(|_| Error::Internal("lease table overflow".into()))?;
        let (lt, hold) = holds(&mut st.arenas, &mut st.allocs, arena, ptr)?;
        let rec = &mut st.shares.shares[share_key as usize];
        lt.open_lease(&mut rec.hold, hold)
            .map_err(|e| refused("open_lease", e))?;
        entry.insert(LeaseEntry { share_key });
        st.stats.imports_live += 1;
        Ok(LeaseGrant {
            lease_key,
            fds,
            share: info,
            kind,
        })
    }

    /// Close a consumer's lease (the consumer unmapped, or its connection ended).
    pub fn close_lease(&self, device: DeviceId, lease_key: u32) -> Result<()> {
        let dp = self.dev(device)?;
        let mut guard = dp.state.lock();
        let st = &mut *guard;
        let share_key = st
            .shares
            .leases
            .get(lease_key as usize)
            .ok_or_else(|| Error::Ipc(format!("lease {lease_key}: no such lease (closed twice?)")))?
            .share_key;
        let Some(rec) = st.shares.shares.get_mut(share_key as usize) else {
            return Err(Error::Internal(format!(
                "lease {lease_key} names missing share {share_key}"
            )));
        };
        let (arena, ptr) = (rec.arena, rec.alloc_ptr);
        let (lt, hold) = holds(&mut st.arenas, &mut st.allocs, arena, ptr)?;
        let ended = lt
            .close_lease(&mut rec.hold, hold)
            .map_err(|e| refused("close_lease", e))?;
        st.shares.leases.remove(lease_key as usize);
        st.stats.imports_live -= 1;
        self.end_ref(dp, guard, ended, arena, ptr, share_key);
        Ok(())
    }

    /// Do what the end of a share's or lease's reference asks: the records under the lock
    /// (`apply_ended`), then the close of the export, if any, with the lock released.
    fn end_ref(
        &self,
        dp: &DevicePool,
        mut guard: parking_lot::MutexGuard<'_, DeviceState>,
        ended: Ended<Export>,
        arena: usize,
        ptr: u64,
        share_key: u32,
    ) {
        let to_close = guard.apply_ended(
            ended,
            arena,
            ptr,
            Some(share_key),
            self.backend.as_ref(),
            dp.device,
        );
        drop(guard);
        self.close_exports(dp, to_close);
    }

    /// Close an export that `drop_ref` took out, with the lock released. A concurrent
    /// `empty_cache` may destroy the arena first (it is `Private` already): the driver keeps
    /// the memory until this close, so the order "close, then free" still holds for the
    /// memory itself.
    fn close_exports(&self, dp: &DevicePool, export: Option<(ArenaMem, Export)>) {
        let Some((mem, export)) = export else { return };
        if let Err(e) = self.backend.close_export(&mem, export) {
            tracing::error!(error = %e, device = dp.device, "closing an export failed");
        }
        dp.metrics.publish(&dp.state.lock().stats_now());
    }

    /// Close every export and destroy every arena (the pool is going away).
    pub(crate) fn drop_all_arenas(&mut self) {
        for dp in &mut self.devices {
            let st = dp.state.get_mut();
            if st.arenas.is_empty() && st.orphans.is_empty() {
                continue;
            }
            if let Err(e) = self.backend.synchronize(dp.device) {
                tracing::error!(error = %e, "synchronize before teardown failed");
            }
            for (_, a) in std::mem::take(&mut st.arenas) {
                // Observers first: the arena is still mapped and its export still open.
                self.observers
                    .release_at_teardown(dp.device, a.mem.base, &a.lifetime);
                if a.lifetime.pinned() {
                    tracing::warn!(bytes = a.mem.bytes, "pool dropped with a pinned arena: the driver keeps it until the process exits");
                }
                if let Some(asleep) = a.sleep {
                    asleep.free(self.backend.as_ref());
                }
                if let Some(export) = a.lifetime.into_export() {
                    if let Err(e) = self.backend.close_export(&a.mem, export) {
                        tracing::error!(error = %e, "closing an export at teardown failed");
                    }
                }
                if let Err(e) = self.backend.destroy_arena(a.mem) {
                    tracing::error!(error = %e, "destroying an arena at teardown failed");
                }
            }
            for mem in st.orphans.take_all() {
                if let Err(e) = self.backend.destroy_arena(mem) {
                    tracing::error!(error = %e, "destroying an arena at teardown failed (twice)");
                }
            }
        }
    }
}

/// The refusal of an open of share `key`, which its producer unshared (the same words
/// whether its record is still there, waiting for leases, or ended since).
fn unshared(key: u32) -> Error {
    Error::Ipc(format!("share {key} was unshared: no new imports"))
}
