//! The sim's [`Backend::split_arena`] (a trim) and [`Backend::drop_chunks`] (`empty_cache`'s
//! free chunks of a grown arena).
//!
//! - **split_arena** gives each window new memory, as on a GPU: a memfd of its own holding a
//!   copy of the window's bytes, mapped over the window's pages (`MAP_FIXED`: the addresses
//!   never change); the pages between windows are unmapped and every chunk memfd of the
//!   arena is closed, so the ledger holds only the windows. Every step that can fail runs
//!   before the first page is replaced; a failed replacement maps the old chunks back.
//! - **drop_chunks** moves nothing: each chunk is a memfd of its own (`grow.rs`), so the
//!   dropped chunks' pages are unmapped and their memfds closed, and the kept chunks stay
//!   mapped where they are, their pages untouched (a write into them from another thread
//!   meanwhile is kept). Each run of kept chunks becomes an arena of its own owning its
//!   chunks' memfds.
//!
//! [`Backend::split_arena`]: crate::backend::Backend::split_arena
//! [`Backend::drop_chunks`]: crate::backend::Backend::drop_chunks

use std::os::fd::{AsFd, OwnedFd};

use super::state::{awake_owner, ArenaEntry, Owner};
use super::sys::{self, file_info, map_shared, sys_err, unmap, Region};
use super::{SimBackend, SimCall, NAME};
use crate::backend::{check_dropped_chunks, check_split_windows, kept_runs, ArenaMem};
use crate::error::{Error, Result};

impl SimBackend {
    /// [`Backend::drop_chunks`](crate::backend::Backend::drop_chunks) (see the module docs).
    /// Every check runs before the first page is unmapped; a chunk whose unmapping fails
    /// stays, in its run (logged), and when none could be unmapped nothing changed.
    pub(super) fn drop_chunks(
        &self,
        arena: &ArenaMem,
        doomed: &[usize],
    ) -> Result<Vec<(ArenaMem, usize)>> {
        let mut inner = self.inner.lock();
        inner.enter(SimCall::DropChunks)?;
        let entry = inner.arena_mut(arena, "drop_chunks")?;
        check_dropped_chunks(entry.chunks.len(), doomed)?;
        entry.check_unshared("drop_chunks", arena.handle)?;
        let spans = entry.chunk_spans();
        let owner = awake_owner(&mut entry.owner, "drop_chunks", arena.handle)?;
        let mut dropped = Vec::with_capacity(doomed.len());
        let mut first_err = None;
        for &i in doomed {
            // The chunk's own mapping of its own memfd: no other chunk's page is touched.
            let (at, n) = spans[i];
            match unmap(&owner.region.part(at, n)) {
                Ok(()) => dropped.push(i),
                Err(e) => {
                    tracing::warn!(arena = arena.handle, chunk = i, error = %e,
                        "sim drop_chunks: unmapping a chunk failed; the arena keeps it");
                    first_err.get_or_insert(e);
                }
            }
        }
        if dropped.is_empty() {
            return Err(first_err
                .unwrap_or_else(|| Error::Internal("sim drop_chunks: nothing dropped".into())));
        }
        // A growable arena's reservation past its end goes too: the runs cannot grow.
        if owner.region.len() > entry.bytes {
            let tail = owner
                .region
                .part(entry.bytes, owner.region.len() - entry.bytes);
            if let Err(e) = unmap(&tail) {
                tracing::warn!(error = %e, "sim drop_chunks: unmapping a reservation's tail failed");
            }
        }
        let Some(ArenaEntry {
            device,
            keys,
            chunks,
            owner: Some(owner),
            ..
        }) = inner.arenas.remove(&arena.handle)
        else {
            return Err(Error::Internal(
                "sim drop_chunks: the arena vanished".into(),
            ));
        };
        inner.forget_keys(arena.handle, &keys);
        // The dropped chunks' memfds close as the iterator passes them (nothing maps them
        // any more: their memory is freed); each run takes its own.
        let mut memfds = owner.memfds.into_iter();
        let mut next = 0;
        let mut out = Vec::new();
        for (at, n) in kept_runs(chunks.len(), &dropped) {
            memfds.by_ref().take(at - next).for_each(drop);
            let run_memfds: Vec<OwnedFd> = memfds.by_ref().take(n).collect();
            next = at + n;
            let (offset, bytes) = (spans[at].0, chunks[at..at + n].iter().sum::<u64>());
            let id = inner.take_id();
            inner.own_keys(id, &keys[at..at + n]);
            inner.arenas.insert(
                id,
                ArenaEntry {
                    device,
                    base: arena.base + offset,
                    bytes,
                    keys: keys[at..at + n].to_vec(),
                    owner: Some(Owner {
                        memfds: run_memfds,
                        region: owner.region.part(offset, bytes),
                    }),
                    open_exports: 0,
                    mappings: 0,
                    pinned: false,
                    chunks: chunks[at..at + n].to_vec(),
                    reserve: bytes,
                },
            );
            let part = ArenaMem {
                device,
                base: arena.base + offset,
                bytes,
                handle: id,
            };
            out.push((part, n));
        }
        Ok(out)
    }

    /// [`Backend::split_arena`](crate::backend::Backend::split_arena) (see the module docs):
    /// its windows are new allocations, each a driver call that may fail, and room on the
    /// device.
    pub(super) fn split(&self, arena: &ArenaMem, windows: &[(u64, u64)]) -> Result<Vec<ArenaMem>> {
        let mut inner = self.inner.lock();
        check_split_windows(arena.bytes, self.config.granularity, windows)?;
        {
            let entry = inner.arena_mut(arena, "split_arena")?;
            entry.check_unshared("split_arena", arena.handle)?;
            awake_owner(&mut entry.owner, "split_arena", arena.handle)?;
        }
        for _ in windows {
            inner.enter(SimCall::CreateArena)?;
        }
        let kept: u64 = windows.iter().map(|w| w.1).sum();
        if inner.held_bytes(arena.device).saturating_add(kept) > self.config.capacity {
            return Err(Error::DriverOutOfMemory {
                backend: NAME,
                call: "split_arena",
                device: arena.device,
                bytes: kept,
            });
        }
        // The new memfds with the windows' bytes (nothing replaced yet: errors drop them).
        let mut made: Vec<(OwnedFd, (u64, u64))> = Vec::with_capacity(windows.len());
        for (i, &(offset, len)) in windows.iter().enumerate() {
            let name = format!("{}a{}w{i}", self.memfd_tag(), arena.handle);
            let memfd = sys::create_memfd(&name, len)?;
            let temp = map_shared(memfd.as_fd(), len as usize)?;
            sys::copy_between(temp.base(), arena.base + offset, len);
            unmap(&temp)?;
            let info = file_info(memfd.as_fd()).map_err(|e| sys_err("fstat", e))?;
            made.push((memfd, info.key));
        }
        let entry = inner.arena_mut(arena, "split_arena")?;
        let Some(owner) = entry.owner.take() else {
            return Err(Error::Internal("sim split_arena: owner vanished".into()));
        };
        let (old_memfds, whole) = (owner.memfds, owner.region);
        let spans = entry.chunk_spans();
        for (i, (&(offset, len), (memfd, _))) in windows.iter().zip(&made).enumerate() {
            if let Err(e) = sys::map_over_at(&whole.part(offset, len), memfd.as_fd(), 0) {
                // The windows replaced so far, and this one (a failed MAP_FIXED may have
                // unmapped it), get the old chunks' pages back.
                for &(off, l) in &windows[..=i] {
                    if let Err(back) = map_chunks_back(&whole, &spans, &old_memfds, off, l) {
                        tracing::error!(error = %back, "sim split_arena: mapping the old pages back failed");
                    }
                }
                entry.owner = Some(Owner {
                    memfds: old_memfds,
                    region: whole,
                });
                return Err(e);
            }
        }
        // The pages between (and around) the windows go; the old memfds close with
        // `old_memfds`.
        let mut at = 0;
        for &(offset, len) in windows.iter().chain([&(arena.bytes, 0)]) {
            if offset > at {
                if let Err(e) = unmap(&whole.part(at, offset - at)) {
                    tracing::warn!(error = %e, "sim split_arena: unmapping a gap failed");
                }
            }
            at = offset + len;
        }
        // A growable arena's reservation past its end goes too.
        if whole.len() > arena.bytes {
            if let Err(e) = unmap(&whole.part(arena.bytes, whole.len() - arena.bytes)) {
                tracing::warn!(error = %e, "sim split_arena: unmapping a reservation's tail failed");
            }
        }
        drop(old_memfds);
        let device = entry.device;
        inner.retire_if_released(arena.handle);
        let mut out = Vec::with_capacity(windows.len());
        for (&(offset, len), (memfd, key)) in windows.iter().zip(made) {
            let id = inner.take_id();
            inner.own_keys(id, &[key]);
            inner.arenas.insert(
                id,
                ArenaEntry {
                    device,
                    base: arena.base + offset,
                    bytes: len,
                    keys: vec![key],
                    owner: Some(Owner {
                        memfds: vec![memfd],
                        region: whole.part(offset, len),
                    }),
                    open_exports: 0,
                    mappings: 0,
                    pinned: false,
                    chunks: vec![len],
                    reserve: len,
                },
            );
            out.push(ArenaMem {
                device,
                base: arena.base + offset,
                bytes: len,
                handle: id,
            });
        }
        Ok(out)
    }
}

/// Map the arena's chunk memfds (`memfds`, at `spans`: `ArenaEntry::chunk_spans`) back over
/// the part `offset..offset + len` of its range `whole`, each piece from its offset in its
/// chunk (a failed split's undo).
fn map_chunks_back(
    whole: &Region,
    spans: &[(u64, u64)],
    memfds: &[OwnedFd],
    offset: u64,
    len: u64,
) -> Result<()> {
    for (&(start, n), memfd) in spans.iter().zip(memfds) {
        let (lo, hi) = (offset.max(start), (offset + len).min(start + n));
        if lo < hi {
            sys::map_over_at(&whole.part(lo, hi - lo), memfd.as_fd(), lo - start)?;
        }
    }
    Ok(())
}
