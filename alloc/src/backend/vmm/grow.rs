//! Growable arenas on the VMM core ([`Backend::create_growable_arena`],
//! [`Backend::grow_arena`]) and the imports of grown arenas.
//!
//! A growable arena reserves `reserve` bytes of address space and maps its first physical
//! allocation at the start; a growth creates one more physical allocation (a *chunk*) and
//! maps it right after the arena's end (access: the device and its peers, as every VMM
//! mapping). The registry keeps one region for the whole mapped arena (its handle is the
//! first chunk's); [`Chunks`] records the reservation and the chunks after the first, so that
//! teardown, sleep and exports reach every physical allocation. The reservation is recorded
//! as a split reservation with one window (`registry::SplitReservations`), so it is freed
//! whole with the arena, or with the last window of a later split.
//!
//! A grown arena's export is one fd per chunk ([`ExportPayload::Chunks`]); its import maps
//! them back to back in one reservation and keeps their lengths here, so that the import is
//! unmapped chunk by chunk (CUDA unmaps whole mappings only).
//!
//! [`Backend::create_growable_arena`]: crate::backend::Backend::create_growable_arena
//! [`Backend::grow_arena`]: crate::backend::Backend::grow_arena
//! [`ExportPayload::Chunks`]: crate::backend::ExportPayload::Chunks

use std::os::fd::BorrowedFd;

use super::registry::{self, RegionKind};
use super::{to_usize, warn_undo, Driver, DriverResult, VmmBackend};
use crate::backend::{ArenaMem, Backend, Export, ExportKind, ExportPayload};
use crate::error::{Error, Result};
use crate::ids::DeviceId;

/// What the registry's one region of a growable arena or a chunked import does not say.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct Chunks {
    /// The arena's address reservation in bytes (0 for an import: its reservation is its
    /// size).
    pub(super) reserve: u64,
    /// The chunks after the first: offset from the base, bytes, allocation handle (0 for an
    /// import's, released right after mapping).
    pub(super) extra: Vec<(u64, u64, u64)>,
}

impl<D: Driver> VmmBackend<D> {
    /// See [`crate::backend::Backend::create_growable_arena`].
    pub(super) fn create_growable(
        &self,
        device: DeviceId,
        bytes: u64,
        reserve: u64,
    ) -> Result<ArenaMem> {
        let state = self.state(device)?;
        if !state.vmm {
            // A legacy arena is one allocation with its addresses: it cannot grow.
            return Backend::create_arena(self, device, bytes);
        }
        let n = Self::check_size(&state, device, bytes)?;
        let r = Self::check_size(&state, device, reserve)?;
        if r < n {
            return Err(Error::invalid(format!(
                "a reservation of {reserve} bytes cannot hold an arena of {bytes}"
            )));
        }
        let (_, _current) = self.make_current(device)?;
        let d = &self.driver;
        let handle = self
            .create_physical(&state, device, n)
            .map_err(|e| e.into_error(device, bytes))?;
        let reserved = d.address_reserve(r, to_usize(state.granularity).unwrap_or(0));
        let mapped = reserved.and_then(|base| {
            self.map_access(&state, device, base, n, handle)
                .map(|()| base)
                .inspect_err(|_| {
                    // SAFETY: our own reservation, nothing mapped in it, freed once.
                    warn_undo(device, unsafe { d.address_free(base, r) });
                })
        });
        let base = match mapped {
            Ok(base) => base,
            Err(e) => {
                // SAFETY: the handle just created, unmapped, released once.
                warn_undo(device, unsafe { d.mem_release(handle) });
                return Err(e.into_error(device, bytes));
            }
        };
        registry::record_split(&mut self.splits.lock(), base, reserve, 1);
        self.chunks.lock().insert(
            base,
            Chunks {
                reserve,
                extra: Vec::new(),
            },
        );
        self.insert_region(base, device, bytes, RegionKind::Arena { handle });
        Ok(ArenaMem {
            device,
            base,
            bytes,
            handle,
        })
    }

    /// See [`crate::backend::Backend::can_grow`].
    pub(super) fn growable(&self, arena: &ArenaMem, extra: u64) -> bool {
        let awake = self.regions.read().get(&arena.base) == Some(&Self::arena_region(arena));
        awake
            && matches!(Self::arena_region(arena).kind, RegionKind::Arena { .. })
            && self
                .chunks
                .lock()
                .get(&arena.base)
                .is_some_and(|c| c.reserve.saturating_sub(arena.bytes) >= extra)
    }

    /// See [`crate::backend::Backend::grow_arena`].
    pub(super) fn grow(&self, arena: &ArenaMem, extra: u64) -> Result<ArenaMem> {
        let state = self.state(arena.device)?;
        let device = arena.device;
        let n = Self::check_size(&state, device, extra)?;
        if !self.growable(arena, extra) {
            return Err(Error::invalid(format!(
                "{}: arena at {:#x} cannot grow by {extra} bytes (not a live, awake growable \
                 arena of this backend with that much of its reservation left)",
                D::NAME,
                arena.base
            )));
        }
        let (_, _current) = self.make_current(device)?;
        let d = &self.driver;
        let handle = self
            .create_physical(&state, device, n)
            .map_err(|e| e.into_error(device, extra))?;
        let at = arena.base + arena.bytes;
        // `at..at + n` lies in the arena's reservation past its mapped end (checked above:
        // the pool grows an arena from one thread at a time, under its device lock).
        if let Err(e) = self.map_access(&state, device, at, n, handle) {
            // SAFETY: the handle just created, unmapped (map_access undid it), released once.
            warn_undo(device, unsafe { d.mem_release(handle) });
            return Err(e.into_error(device, extra));
        }
        let grown = ArenaMem {
            bytes: arena.bytes + extra,
            ..arena.clone()
        };
        if let Some(c) = self.chunks.lock().get_mut(&arena.base) {
            c.extra.push((arena.bytes, extra, handle));
        }
        self.regions
            .write()
            .insert(arena.base, Self::arena_region(&grown));
        tracing::debug!(
            backend = D::NAME,
            device,
            base = arena.base,
            bytes = grown.bytes,
            extra,
            "arena grown"
        );
        Ok(grown)
    }

    /// See [`crate::backend::Backend::shrink_arena`]: the chunks after the first that start
    /// at or past `keep` are unmapped and released, from the last back; the registry then
    /// records the arena's new end. A failed unmap stops there: the chunks still mapped stay
    /// the arena's, and the arena returned ends after them.
    pub(super) fn shrink(&self, arena: &ArenaMem, keep: u64) -> Result<(ArenaMem, usize)> {
        let device = arena.device;
        let awake = self.regions.read().get(&arena.base) == Some(&Self::arena_region(arena));
        if !awake {
            return Err(Error::invalid(format!(
                "{}: arena at {:#x} of {} bytes is not a live, awake arena of this backend",
                D::NAME,
                arena.base,
                arena.bytes
            )));
        }
        let doomed: Vec<(u64, u64, u64)> = match self.chunks.lock().get(&arena.base) {
            Some(c) => c
                .extra
                .iter()
                .copied()
                .filter(|&(off, _, _)| off >= keep)
                .collect(),
            None => Vec::new(),
        };
        if doomed.is_empty() {
            return Ok((arena.clone(), 0));
        }
        let (_, _current) = self.make_current(device)?;
        let mut end = arena.bytes;
        let mut released = 0;
        for &(offset, bytes, handle) in doomed.iter().rev() {
            let n = usize::try_from(bytes).unwrap_or(usize::MAX);
            // SAFETY: one whole mapping of the arena (a chunk past `keep`), which the caller
            // synchronized and no longer uses.
            if let Err(e) = unsafe { self.driver.unmap(arena.base + offset, n) } {
                tracing::warn!(backend = D::NAME, device, call = e.call, error = %e.message,
                    "unmapping a grown arena's chunk failed; the arena keeps it");
                break;
            }
            // SAFETY: the chunk's own handle, just unmapped, released once (its record goes
            // below).
            warn_undo(device, unsafe { self.driver.mem_release(handle) });
            end = offset;
            released += 1;
        }
        if let Some(c) = self.chunks.lock().get_mut(&arena.base) {
            c.extra.retain(|&(off, _, _)| off < end);
        }
        let shrunk = ArenaMem {
            bytes: end,
            ..arena.clone()
        };
        self.regions
            .write()
            .insert(arena.base, Self::arena_region(&shrunk));
        tracing::debug!(
            backend = D::NAME,
            device,
            base = arena.base,
            bytes = end,
            released,
            "arena shrunk"
        );
        Ok((shrunk, released))
    }

    /// The chunks of the region at `base` of `bytes`: `(offset, bytes, handle)` in address
    /// order, the first with `first` as its handle.
    pub(super) fn chunk_layout(&self, base: u64, bytes: u64, first: u64) -> Vec<(u64, u64, u64)> {
        let chunks = self.chunks.lock();
        let extra = chunks.get(&base).map_or(&[][..], |c| &c.extra[..]);
        let first_len = extra.first().map_or(bytes, |&(off, _, _)| off);
        std::iter::once((0, first_len, first))
            .chain(extra.iter().copied())
            .collect()
    }

    /// Unmap every chunk of the region at `base` (one call per mapping). The caller took
    /// the region out of the registry and synchronized. Stops at the first failure.
    pub(super) fn unmap_chunks(&self, base: u64, layout: &[(u64, u64, u64)]) -> DriverResult<()> {
        for &(offset, bytes, _) in layout {
            let n = usize::try_from(bytes).unwrap_or(usize::MAX);
            // SAFETY: one whole mapping of the region (its layout), out of the registry.
            unsafe { self.driver.unmap(base + offset, n) }?;
        }
        Ok(())
    }

    /// Release the allocation handles of a grown arena's chunks after the first (unmapped),
    /// and forget its chunks after the first (a sleeping arena wakes as one allocation).
    pub(super) fn release_extra_chunks(&self, device: DeviceId, base: u64) {
        let extra = self
            .chunks
            .lock()
            .get_mut(&base)
            .map(|c| std::mem::take(&mut c.extra))
            .unwrap_or_default();
        for (_, _, handle) in extra {
            // SAFETY: a chunk's own handle, unmapped by the caller, released once (its
            // record was just taken).
            warn_undo(device, unsafe { self.driver.mem_release(handle) });
        }
    }

    /// The export of a grown arena: one fd per chunk. The caller holds the registry's read
    /// lock (the arena is live) and made the device current.
    pub(super) fn export_chunks(&self, arena: &ArenaMem, first: u64) -> Result<Option<Export>> {
        let layout = self.chunk_layout(arena.base, arena.bytes, first);
        if layout.len() < 2 {
            return Ok(None);
        }
        let mut fds = Vec::with_capacity(layout.len());
        for (_, bytes, handle) in layout {
            // SAFETY: a live chunk handle of a live arena (the caller's read lock), created
            // exportable as a POSIX fd.
            let fd = unsafe { self.driver.export_fd(handle) }
                .map_err(|e| e.into_error(arena.device, 0))?;
            fds.push((bytes, fd));
        }
        Ok(Some(Export {
            payload: ExportPayload::Chunks(fds),
            kind: ExportKind::Releasable,
        }))
    }

    /// Import a grown arena's chunks: each imported, mapped back to back in one reservation
    /// and its handle released; access granted to the whole. Call with the device current.
    pub(super) fn import_chunks(
        &self,
        device: DeviceId,
        chunks: &[(u64, BorrowedFd<'_>)],
        bytes: u64,
    ) -> Result<u64> {
        let state = self.state(device)?;
        let n = Self::check_size(&state, device, bytes)?;
        let total = chunks.iter().try_fold(0u64, |t, (c, _)| t.checked_add(*c));
        if chunks.is_empty() || total != Some(bytes) {
            return Err(Error::invalid(format!(
                "import: {} chunks of {total:?} bytes do not make the {bytes} bytes asked",
                chunks.len()
            )));
        }
        let d = &self.driver;
        let base = d
            .address_reserve(n, to_usize(state.granularity).unwrap_or(0))
            .map_err(|e| e.into_error(device, bytes))?;
        let mut layout: Vec<(u64, u64, u64)> = Vec::with_capacity(chunks.len());
        let mut at = 0u64;
        let mut failed = None;
        for &(len, fd) in chunks {
            let mapped = Self::check_size(&state, device, len).and_then(|cn| {
                let handle = d.import_fd(fd).map_err(|e| e.into_error(device, len))?;
                // SAFETY: our reservation, nothing mapped at `base + at..` yet; a live handle.
                let m = unsafe { d.map(base + at, cn, handle) };
                // SAFETY: the handle just imported, released once (the mapping holds it).
                warn_undo(device, unsafe { d.mem_release(handle) });
                m.map_err(|e| e.into_error(device, len))
            });
            if let Err(e) = mapped {
                failed = Some(e);
                break;
            }
            layout.push((at, len, 0));
            at += len;
        }
        let failed = failed.or_else(|| {
            self.grant_access(&state, device, base, n)
                .err()
                .map(|e| e.into_error(device, bytes))
        });
        if let Some(e) = failed {
            warn_undo(device, self.unmap_chunks(base, &layout));
            // SAFETY: our own reservation, every mapping in it undone, freed once.
            warn_undo(device, unsafe { d.address_free(base, n) });
            return Err(e);
        }
        layout.remove(0);
        self.chunks.lock().insert(
            base,
            Chunks {
                reserve: 0,
                extra: layout,
            },
        );
        Ok(base)
    }

    /// Forget the chunks of a region torn down (its memory already unmapped and released).
    pub(super) fn forget_chunks(&self, base: u64) {
        self.chunks.lock().remove(&base);
    }
}
