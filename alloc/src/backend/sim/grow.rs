//! Growable arenas on the sim ([`Backend::create_growable_arena`], [`Backend::grow_arena`],
//! [`Backend::shrink_arena`]): the arena's address range is an inaccessible reservation of
//! `reserve` bytes, and each chunk is a memfd of its own mapped (from its offset 0) over its
//! part of the range, as each chunk is a physical allocation of its own on a GPU. The first
//! chunk is the memfd `create_arena` made; a growth makes a new memfd for the new chunk and
//! maps it right after the last one (the old memfds are left alone); a shrink maps the
//! reservation back over the chunks it releases and closes their memfds. An export hands
//! out one fd per chunk memfd, and an import maps each at its chunk's place.
//!
//! [`Backend::create_growable_arena`]: crate::backend::Backend::create_growable_arena
//! [`Backend::grow_arena`]: crate::backend::Backend::grow_arena
//! [`Backend::shrink_arena`]: crate::backend::Backend::shrink_arena

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use super::state::{awake_owner, ArenaEntry, Inner, Owner};
use super::sys::{self, file_info, sys_err};
use super::{SimBackend, SimCall, NAME};
use crate::backend::{ArenaMem, DeviceId, Mapping};
use crate::error::{Error, Result};

impl SimBackend {
    /// Check that `bytes` is a non-zero granularity multiple (`what` names it in the error).
    pub(super) fn check_granular(&self, call: &str, what: &str, bytes: u64) -> Result<()> {
        let g = self.config.granularity;
        if bytes == 0 || bytes % g != 0 {
            return Err(Error::invalid(format!(
                "sim {call}: {what} of {bytes} bytes is not a non-zero multiple of the granularity {g}"
            )));
        }
        Ok(())
    }

    /// An arena of `bytes` mapped at the start of a reservation of `reserve` bytes
    /// ([`crate::backend::Backend::create_growable_arena`]; `create_arena` is the same with
    /// `reserve == bytes`); `call` names it in errors. Every fallible step runs before
    /// anything is recorded.
    pub(super) fn create_in_reservation(
        &self,
        call: &str,
        device: DeviceId,
        bytes: u64,
        reserve: u64,
    ) -> Result<ArenaMem> {
        let mut inner = self.inner.lock();
        inner.enter(SimCall::CreateArena)?;
        self.check_device(device)?;
        self.check_granular(call, "an arena", bytes)?;
        self.check_granular(call, "a reservation", reserve)?;
        if reserve < bytes {
            return Err(Error::invalid(format!(
                "sim {call}: a reservation of {reserve} bytes cannot hold {bytes}"
            )));
        }
        if inner.held_bytes(device).saturating_add(bytes) > self.config.capacity {
            return Err(Error::DriverOutOfMemory {
                backend: NAME,
                call: "create_arena",
                device,
                bytes,
            });
        }
        let len = usize::try_from(reserve).map_err(|_| {
            Error::invalid(format!(
                "sim {call}: {reserve} bytes do not fit the address space"
            ))
        })?;
        let id = inner.next_id;
        let memfd = sys::create_memfd(&self.chunk_memfd_name(id, 0), bytes)?;
        let info = file_info(memfd.as_fd()).map_err(|e| sys_err("fstat", e))?;
        let region = sys::reserve(len)?;
        if let Err(e) = sys::map_over_at(&region.part(0, bytes), memfd.as_fd(), 0) {
            if let Err(u) = sys::unmap(&region) {
                tracing::warn!(error = %u, call, "sim: unmapping the reservation failed");
            }
            return Err(e);
        }
        let base = region.base();
        inner.take_id();
        inner.own_keys(id, &[info.key]);
        inner.arenas.insert(
            id,
            ArenaEntry {
                device,
                base,
                bytes,
                keys: vec![info.key],
                owner: Some(Owner {
                    memfds: vec![memfd],
                    region,
                }),
                open_exports: 0,
                mappings: 0,
                pinned: false,
                chunks: vec![bytes],
                reserve,
            },
        );
        Ok(ArenaMem {
            device,
            base,
            bytes,
            handle: id,
        })
    }

    /// See [`crate::backend::Backend::can_grow`].
    pub(super) fn growable(&self, arena: &ArenaMem, extra: u64) -> bool {
        let inner = self.inner.lock();
        inner.arenas.get(&arena.handle).is_some_and(|e| {
            e.check(arena, "can_grow").is_ok()
                && e.open_exports == 0
                && e.mappings == 0
                && !e.pinned
                && !e.asleep()
                && e.owner.is_some()
                && e.reserve - e.bytes >= extra
        })
    }

    /// See [`crate::backend::Backend::grow_arena`]: a new memfd of `extra` bytes, mapped
    /// over the reservation right after the last chunk. Every fallible step runs before
    /// anything is recorded; a failed mapping puts the reservation back.
    pub(super) fn grow(&self, arena: &ArenaMem, extra: u64) -> Result<ArenaMem> {
        let mut inner = self.inner.lock();
        inner.enter(SimCall::CreateArena)?;
        self.check_granular("grow_arena", "a growth", extra)?;
        let held = inner.held_bytes(arena.device);
        let entry = inner.arena_mut(arena, "grow_arena")?;
        entry.check_unshared("grow_arena", arena.handle)?;
        if entry.reserve - entry.bytes < extra {
            return Err(Error::invalid(format!(
                "sim grow_arena: arena {} has {} bytes of its reservation left, not {extra}",
                arena.handle,
                entry.reserve - entry.bytes
            )));
        }
        let owner = awake_owner(&mut entry.owner, "grow_arena", arena.handle)?;
        if held.saturating_add(extra) > self.config.capacity {
            return Err(Error::DriverOutOfMemory {
                backend: NAME,
                call: "grow_arena",
                device: arena.device,
                bytes: extra,
            });
        }
        let old = entry.bytes;
        let name = self.chunk_memfd_name(arena.handle, entry.chunks.len());
        let memfd = sys::create_memfd(&name, extra)?;
        let info = file_info(memfd.as_fd()).map_err(|e| sys_err("fstat", e))?;
        let place = owner.region.part(old, extra);
        if let Err(e) = sys::map_over_at(&place, memfd.as_fd(), 0) {
            // A failed MAP_FIXED may have unmapped the range: reserve it again.
            if let Err(back) = sys::reserve_over(&place) {
                tracing::warn!(error = %back, "sim grow_arena: reserving the range again failed");
            }
            return Err(e);
        }
        owner.memfds.push(memfd);
        entry.keys.push(info.key);
        entry.chunks.push(extra);
        entry.bytes = old + extra;
        inner.own_keys(arena.handle, &[info.key]);
        Ok(ArenaMem {
            bytes: old + extra,
            ..arena.clone()
        })
    }

    /// See [`crate::backend::Backend::shrink_arena`]: the chunks after the first that start
    /// at or past `keep` go back to an inaccessible reservation and their memfds close.
    pub(super) fn shrink(&self, arena: &ArenaMem, keep: u64) -> Result<(ArenaMem, usize)> {
        let mut inner = self.inner.lock();
        inner.enter(SimCall::DestroyArena)?;
        let entry = inner.arena_mut(arena, "shrink_arena")?;
        entry.check_unshared("shrink_arena", arena.handle)?;
        let spans = entry.chunk_spans();
        let owner = awake_owner(&mut entry.owner, "shrink_arena", arena.handle)?;
        // Keep the chunks before the first later one that starts at or past `keep`.
        let kept = spans
            .iter()
            .skip(1)
            .position(|&(start, _)| start >= keep)
            .map_or(spans.len(), |p| p + 1);
        let released = spans.len() - kept;
        if released == 0 {
            return Ok((arena.clone(), 0));
        }
        let end = spans[kept].0;
        sys::reserve_over(&owner.region.part(end, entry.bytes - end))?;
        // Nothing maps the released chunks now: closing their memfds frees them.
        owner.memfds.truncate(kept);
        let gone = entry.keys.split_off(kept);
        entry.chunks.truncate(kept);
        entry.bytes = end;
        inner.forget_keys(arena.handle, &gone);
        Ok((
            ArenaMem {
                bytes: end,
                ..arena.clone()
            },
            released,
        ))
    }

    /// The name of chunk `chunk`'s memfd of arena `arena` (`/proc/self/fd` shows it).
    pub(super) fn chunk_memfd_name(&self, arena: u64, chunk: usize) -> String {
        format!("{}a{arena}c{chunk}", self.memfd_tag())
    }

    /// `close_export` of a grown arena's export: every fd must be one of this arena's
    /// counted exports; then they all close. Otherwise nothing changes (fds of ours stay
    /// counted and are kept, as the module docs say of a refused close).
    pub(super) fn close_chunks(
        inner: &mut Inner,
        arena: &ArenaMem,
        fds: Vec<(u64, OwnedFd)>,
    ) -> Result<()> {
        let keys: Vec<Option<(u64, u64)>> = fds
            .iter()
            .map(|(_, fd)| file_info(fd.as_fd()).ok().map(|i| i.key))
            .collect();
        let refused = match inner.arena_mut(arena, "close_export") {
            Err(e) => Some(e),
            Ok(entry)
                if !keys
                    .iter()
                    .all(|k| k.is_some_and(|k| entry.keys.contains(&k))) =>
            {
                Some(Error::invalid(format!(
                    "sim close_export: the export is not an export of arena {}",
                    arena.handle
                )))
            }
            Ok(entry) if entry.open_exports < fds.len() => Some(Error::InvalidState(format!(
                "sim close_export: arena {} has {} open exports, not {}",
                arena.handle,
                entry.open_exports,
                fds.len()
            ))),
            Ok(entry) => {
                entry.open_exports -= fds.len();
                None
            }
        };
        if let Some(e) = refused {
            for ((_, fd), key) in fds.into_iter().zip(keys) {
                if key.is_some_and(|k| inner.is_counted_export(k)) {
                    inner.stranded.push(fd);
                }
            }
            return Err(e);
        }
        drop(fds);
        inner.retire_if_released(arena.handle);
        Ok(())
    }

    /// `import` of a grown arena's chunks: one reservation for them all, each chunk's fd
    /// (its own memfd) mapped from its offset 0 at the chunk's place. The mapping counts for
    /// the arena of the first chunk's memfd when it is one of ours.
    pub(super) fn import_chunks(
        &self,
        inner: &mut Inner,
        device: DeviceId,
        chunks: &[(u64, BorrowedFd<'_>)],
        bytes: u64,
    ) -> Result<Mapping> {
        let total = chunks.iter().try_fold(0u64, |t, (n, _)| t.checked_add(*n));
        if bytes == 0 || chunks.is_empty() || total != Some(bytes) {
            return Err(Error::invalid(format!(
                "sim import: {} chunks of {total:?} bytes in all do not make the {bytes} bytes asked",
                chunks.len()
            )));
        }
        let mut key = None;
        for (i, &(n, fd)) in chunks.iter().enumerate() {
            let info = file_info(fd).map_err(|e| {
                Error::Ipc(format!("sim import: fstat of a chunk's fd failed: {e}"))
            })?;
            if !info.regular || info.size < n {
                return Err(Error::Ipc(format!(
                    "sim import: chunk {i}'s fd does not hold its {n} bytes (a {} of {} bytes)",
                    if info.regular { "memfd" } else { "non-file" },
                    info.size
                )));
            }
            key.get_or_insert(info.key);
        }
        let len = usize::try_from(bytes)
            .map_err(|_| Error::invalid(format!("sim import: {bytes} bytes do not fit")))?;
        let region = sys::reserve(len)?;
        let mut at = 0u64;
        for &(n, fd) in chunks {
            if let Err(e) = sys::map_over_at(&region.part(at, n), fd, 0) {
                if let Err(u) = sys::unmap(&region) {
                    tracing::warn!(error = %u, "sim import: unmapping a half-mapped import failed");
                }
                return Err(e);
            }
            at += n;
        }
        Ok(inner.record_import(device, bytes, region, key))
    }
}
