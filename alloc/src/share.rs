//! The export/share lifetime state machine of an arena: exports, shares, leases, deferred
//! frees. Everything that decides when an export is made, when it is closed and when the
//! arena may go back to the driver lives in this file.
//!
//! Terms: a **share** is the producer's grant of a sub-range of one live allocation to other
//! processes (a [`ShareInfo`], sent as a handle). A **lease** is one consumer's import of a
//! share, opened at the broker. Both hold a reference on the arena and on the allocation.
//!
//! | state | event | action | next state |
//! |---|---|---|---|
//! | `Private` | first share | take a ref, mark `Exporting`, export with the lock released | `Exported` |
//! | `Exporting` | another share | wait for the export to finish | `Exported` |
//! | `Exported` | share / lease opened | take a ref | `Exported` |
//! | `Exported` | unshare / lease closed, refs > 0 | drop a ref | `Exported` |
//! | `Exported` (releasable) | last ref dropped | close the export (after unlocking) | `Private` |
//! | `Exported` (pinning) | last ref dropped | keep the export: it cannot end | `Exported`, pinned |
//! | `Private`, no allocations, not pinned | `empty_cache` | synchronize, destroy | (gone) |
//! | pinned | `empty_cache` | keep; its ranges serve later allocations first | pinned |
//!
//! Rules (ARCHITECTURE.md): an arena is exported at most once at a time, lazily, on its first
//! share; every share and every lease holds a reference; the owner's free of a referenced
//! allocation is deferred until the last reference ends (torch's "limbo"); the export is
//! closed *before* the arena may be destroyed; a pinning export is never destroyed but
//! recycled.
//!
//! Pinning is known two ways: the backend says so ([`ExportKind::Pinning`]), or the start-up
//! self-test ([`Pool::export_semantics`]: create, export, close, destroy, compare
//! `mem_info`) finds the driver still holding the memory. The self-test costs one
//! granularity of memory on a pinning driver, once per device per process.

use std::os::fd::OwnedFd;
use std::sync::OnceLock;

use slab::Slab;

use crate::backend::{ArenaMem, Backend, DeviceId, Export, ExportKind, ExportPayload};
use crate::error::{Error, Result};
use crate::pool::{DevicePool, DeviceState, Pool};

/// Export state of one arena.
#[derive(Debug, Default)]
pub(crate) enum ExportState {
    /// Not exported.
    #[default]
    Private,
    /// A thread is exporting it with the lock released.
    Exporting,
    /// Exported; the export is closed when the last reference ends (unless pinning).
    Exported(Export),
}

/// The sharing state of one arena.
#[derive(Debug, Default)]
pub(crate) struct ArenaLifetime {
    state: ExportState,
    /// Shares plus leases holding the arena.
    refs: u64,
    /// A pinning export was made: never destroy, recycle.
    pinned: bool,
    /// Exports made of this arena (the current one's number is the handle's generation).
    generation: u32,
}

impl ArenaLifetime {
    /// Whether the arena may go back to the backend (given it has no allocations).
    pub(crate) fn destroyable(&self) -> bool {
        self.refs == 0 && !self.pinned && matches!(self.state, ExportState::Private)
    }

    /// For snapshots.
    pub(crate) fn describe(&self) -> serde_json::Value {
        let state = match &self.state {
            ExportState::Private => "private",
            ExportState::Exporting => "exporting",
            ExportState::Exported(_) => "exported",
        };
        serde_json::json!({ "state": state, "refs": self.refs, "pinned": self.pinned,
                            "generation": self.generation })
    }
}

/// What the producer hands out for one share: enough to build a share handle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShareInfo {
    /// Device of the memory.
    pub device: DeviceId,
    /// Key of the share in the producer's table.
    pub share_key: u32,
    /// Arena id (unique in the producer's pool).
    pub arena_id: u64,
    /// Export generation of the arena.
    pub generation: u32,
    /// Arena size in bytes (the importer maps the whole arena).
    pub arena_bytes: u64,
    /// Offset of the shared range inside the arena, in bytes.
    pub offset: u64,
    /// Length of the shared range in bytes.
    pub len: u64,
    /// Random 128-bit secret the importer must present.
    pub token: [u8; 16],
}

/// What the broker sends a consumer who opened a lease.
#[derive(Debug)]
pub struct LeaseGrant {
    /// Key of the lease in the producer's table (the consumer closes it by this key).
    pub lease_key: u32,
    /// A duplicate of the export fd, to send with SCM_RIGHTS and then drop.
    pub fd: OwnedFd,
    /// The share the lease is on.
    pub share: ShareInfo,
    /// Whether the export can be ended.
    pub kind: ExportKind,
}

/// A share in the producer's table.
#[derive(Debug)]
pub(crate) struct ShareRecord {
    info: ShareInfo,
    arena: usize,
    /// Start of the allocation the share lies in.
    alloc_ptr: u64,
    revoked: bool,
    leases: u64,
}

/// A consumer's lease on a share.
#[derive(Debug)]
pub(crate) struct LeaseRecord {
    share_key: u32,
}

/// Share and lease tables of one device.
#[derive(Debug, Default)]
pub(crate) struct ShareTables {
    pub(crate) shares: Slab<ShareRecord>,
    pub(crate) leases: Slab<LeaseRecord>,
    /// Self-test result: does closing an export release memory on this device?
    pub(crate) probed_kind: OnceLock<ExportKind>,
}

fn random_token() -> Result<[u8; 16]> {
    let mut token = [0u8; 16];
    let mut filled = 0;
    while filled < token.len() {
        let n =
            rustix::rand::getrandom(&mut token[filled..], rustix::rand::GetRandomFlags::empty())
                .map_err(|e| Error::Internal(format!("getrandom failed: {e}")))?;
        filled += n;
    }
    Ok(token)
}

impl DeviceState {
    /// Drop one reference on `arena` and on the allocation at `alloc_ptr`. A freed
    /// allocation whose last reference ends goes back to the sub-allocator. Returns the
    /// export to close (after unlocking) when the arena's last reference ended.
    fn drop_ref(
        &mut self,
        arena: usize,
        alloc_ptr: u64,
        backend: &dyn Backend,
        device: DeviceId,
    ) -> Option<(ArenaMem, Export)> {
        if let Some(live) = self.allocs.get_mut(&alloc_ptr) {
            live.refs -= 1;
            if live.refs == 0 && live.freed {
                self.release_deferred(alloc_ptr, backend, device);
            }
        }
        let a = self.arenas.get_mut(arena)?;
        a.lifetime.refs -= 1;
        if a.lifetime.refs > 0 || a.lifetime.pinned {
            return None;
        }
        match std::mem::take(&mut a.lifetime.state) {
            ExportState::Exported(export) => {
                self.stats.exports_live -= 1;
                Some((a.mem.clone(), export))
            }
            other => {
                a.lifetime.state = other;
                None
            }
        }
    }

    fn share_record(&self, key: u32, token: &[u8; 16]) -> Result<&ShareRecord> {
        match self.shares.shares.get(key as usize) {
            Some(r) if &r.info.token == token => Ok(r),
            _ => Err(Error::Ipc(format!(
                "share {key}: no such share (unknown key or wrong token)"
            ))),
        }
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
        let dp = self
            .devices
            .iter()
            .find(|dp| dp.state.lock().arena_of(ptr).is_some())
            .ok_or_else(|| Error::UnknownPointer {
                ptr,
                why: "share of memory gpu-arena did not allocate".into(),
            })?;
        let mut st = dp.state.lock();
        let (start, alen) =
            st.ranges
                .allocated_containing(ptr)
                .ok_or_else(|| Error::UnknownPointer {
                    ptr,
                    why: "share of a range that is not inside a live allocation".into(),
                })?;
        let live = st.check_live(start, dp.device)?;
        if end > start + alen || end > start + live.requested.max(1).next_multiple_of(512) {
            return Err(Error::invalid(format!(
                "share [{ptr:#x}, +{len}) runs past its allocation [{start:#x}, +{})",
                live.requested
            )));
        }
        let arena = live.arena;
        // Take the references first, so a concurrent free defers instead of releasing.
        if let Some(l) = st.allocs.get_mut(&start) {
            l.refs += 1;
        }
        st.arenas[arena].lifetime.refs += 1;
        if let Err(e) = self.ensure_exported(dp, &mut st, arena) {
            let export = st.drop_ref(arena, start, self.backend.as_ref(), dp.device);
            drop(st);
            self.close_exports(dp, export);
            return Err(e);
        }
        let a = &st.arenas[arena];
        let mut info = ShareInfo {
            device: dp.device,
            share_key: 0,
            arena_id: a.id,
            generation: a.lifetime.generation,
            arena_bytes: a.mem.bytes,
            offset: ptr - a.mem.base,
            len,
            token: random_token()?,
        };
        let entry = st.shares.shares.vacant_entry();
        info.share_key = u32::try_from(entry.key())
            .map_err(|_| Error::Internal("share table overflow".into()))?;
        entry.insert(ShareRecord {
            info,
            arena,
            alloc_ptr: start,
            revoked: false,
            leases: 0,
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
        // The self-test may release the lock (on a device's first share): run it before
        // looking at the state, so the Private -> Exporting step below stays atomic.
        let probed = self.export_semantics_locked(dp, st)?;
        loop {
            match st.arenas[arena].lifetime.state {
                ExportState::Exported(_) => return Ok(()),
                ExportState::Exporting => {
                    parking_lot::MutexGuard::unlocked(st, std::thread::yield_now);
                }
                ExportState::Private => break,
            }
        }
        st.arenas[arena].lifetime.state = ExportState::Exporting;
        let mem = st.arenas[arena].mem.clone();
        let result = parking_lot::MutexGuard::unlocked(st, || self.backend.export(&mem));
        let a = &mut st.arenas[arena];
        match result {
            Ok(export) => {
                let pinning = export.kind == ExportKind::Pinning || probed == ExportKind::Pinning;
                a.lifetime.generation += 1;
                a.lifetime.state = ExportState::Exported(export);
                let bytes = a.mem.bytes;
                if pinning && !a.lifetime.pinned {
                    a.lifetime.pinned = true;
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
                dp.metrics.publish(&st.stats);
                Ok(())
            }
            Err(e) => {
                a.lifetime.state = ExportState::Private;
                Err(e)
            }
        }
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
        let kind = parking_lot::MutexGuard::unlocked(st, || self.probe_export(dp))?;
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
                .inspect_err(|_| dp.state.lock().orphans.push(mem))
        };
        let gran = b.granularity(device)?;
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

    /// Revoke a share: no new import of it succeeds. Imports already made stay valid until
    /// their consumers close them; the memory stays reserved until then.
    pub fn unshare(&self, device: DeviceId, share_key: u32, token: &[u8; 16]) -> Result<()> {
        let dp = self.dev(device)?;
        let mut st = dp.state.lock();
        let rec = st.share_record(share_key, token)?;
        if rec.revoked {
            return Err(Error::Ipc(format!("share {share_key} already unshared")));
        }
        let (arena, alloc_ptr, leases) = (rec.arena, rec.alloc_ptr, rec.leases);
        if leases == 0 {
            st.shares.shares.remove(share_key as usize);
        } else if let Some(r) = st.shares.shares.get_mut(share_key as usize) {
            r.revoked = true;
        }
        st.stats.shares_live -= 1;
        let export = st.drop_ref(arena, alloc_ptr, self.backend.as_ref(), dp.device);
        drop(st);
        self.close_exports(dp, export);
        Ok(())
    }

    /// Open a consumer's lease on a share (the broker calls this for an import request).
    pub fn open_lease(
        &self,
        device: DeviceId,
        share_key: u32,
        token: &[u8; 16],
    ) -> Result<LeaseGrant> {
        let dp = self.dev(device)?;
        let mut st = dp.state.lock();
        let rec = st.share_record(share_key, token)?;
        if rec.revoked {
            return Err(Error::Ipc(format!(
                "share {share_key} was unshared: no new imports"
            )));
        }
        let (arena, alloc_ptr, info) = (rec.arena, rec.alloc_ptr, rec.info);
        let a = &st.arenas[arena];
        let ExportState::Exported(export) = &a.lifetime.state else {
            return Err(Error::Internal(format!(
                "share {share_key} on an arena that is not exported"
            )));
        };
        let kind = if a.lifetime.pinned {
            ExportKind::Pinning
        } else {
            export.kind
        };
        let fd = match &export.payload {
            ExportPayload::Fd(fd) => fd
                .try_clone()
                .map_err(|e| Error::Ipc(format!("dup of the export fd failed: {e}")))?,
            ExportPayload::Bytes(_) => {
                return Err(Error::Ipc(
                    "byte-handle exports are not served by the broker".into(),
                ))
            }
        };
        let lease_key = u32::try_from(st.shares.leases.insert(LeaseRecord { share_key }))
            .map_err(|_| Error::Internal("lease table overflow".into()))?;
        if let Some(r) = st.shares.shares.get_mut(share_key as usize) {
            r.leases += 1;
        }
        if let Some(l) = st.allocs.get_mut(&alloc_ptr) {
            l.refs += 1;
        }
        st.arenas[arena].lifetime.refs += 1;
        st.stats.imports_live += 1;
        Ok(LeaseGrant {
            lease_key,
            fd,
            share: info,
            kind,
        })
    }

    /// Close a consumer's lease (the consumer unmapped, or its connection ended).
    pub fn close_lease(&self, device: DeviceId, lease_key: u32) -> Result<()> {
        let dp = self.dev(device)?;
        let mut st = dp.state.lock();
        let share_key = st
            .shares
            .leases
            .try_remove(lease_key as usize)
            .ok_or_else(|| Error::Ipc(format!("lease {lease_key}: no such lease (closed twice?)")))?
            .share_key;
        let Some(rec) = st.shares.shares.get_mut(share_key as usize) else {
            return Err(Error::Internal(format!(
                "lease {lease_key} names missing share {share_key}"
            )));
        };
        rec.leases -= 1;
        let (arena, alloc_ptr) = (rec.arena, rec.alloc_ptr);
        if rec.revoked && rec.leases == 0 {
            st.shares.shares.remove(share_key as usize);
        }
        st.stats.imports_live -= 1;
        let export = st.drop_ref(arena, alloc_ptr, self.backend.as_ref(), dp.device);
        drop(st);
        self.close_exports(dp, export);
        Ok(())
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
        dp.metrics.publish(&dp.state.lock().stats);
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
                if a.lifetime.pinned {
                    tracing::warn!(bytes = a.mem.bytes, "pool dropped with a pinned arena: the driver keeps it until the process exits");
                }
                if let ExportState::Exported(export) = a.lifetime.state {
                    if let Err(e) = self.backend.close_export(&a.mem, export) {
                        tracing::error!(error = %e, "closing an export at teardown failed");
                    }
                }
                if let Err(e) = self.backend.destroy_arena(a.mem) {
                    tracing::error!(error = %e, "destroying an arena at teardown failed");
                }
            }
            for mem in std::mem::take(&mut st.orphans) {
                if let Err(e) = self.backend.destroy_arena(mem) {
                    tracing::error!(error = %e, "destroying an arena at teardown failed (twice)");
                }
            }
        }
    }
}
