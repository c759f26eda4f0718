//! The sim's [`Backend::split_arena`](crate::backend::Backend::split_arena): each window gets
//! a memfd of its own holding its bytes, mapped over the window's pages (`MAP_FIXED`: the
//! addresses never change), the pages between windows are unmapped and the arena's memfd is
//! closed, so the ledger holds only the windows. Every step that can fail runs before the
//! first page is replaced; a failed replacement maps the old memfd back.

use std::os::fd::{AsFd, OwnedFd};

use super::state::{ArenaEntry, Owner};
use super::sys::{self, file_info, map_shared, sys_err, unmap};
use super::{SimBackend, SimCall, NAME};
use crate::backend::{check_dropped_chunks, check_split_windows, kept_runs, ArenaMem};
use crate::error::{Error, Result};

impl SimBackend {
    /// See the module docs and the trait's contract.
    pub(super) fn split(&self, arena: &ArenaMem, windows: &[(u64, u64)]) -> Result<Vec<ArenaMem>> {
        self.split_windows(arena, windows, true)
    }

    /// [`Backend::drop_chunks`](crate::backend::Backend::drop_chunks): the runs of kept
    /// chunks become windows as a split's (their bytes copied to memfds of their own, which
    /// on a GPU would be the chunks themselves left in place: no new memory is counted), each
    /// keeping its chunks' lengths.
    ///
    /// Unlike a GPU's, the sim's kept bytes move (copied, then the copy mapped over them):
    /// a host write into a kept chunk between the copy and the remap is lost, where the
    /// trait promises "without moving a byte". The pool synchronizes the device first, so
    /// no GPU work writes meanwhile; a test that writes sim memory from other threads while
    /// `empty_cache` runs must keep those writes out of it (`tests/stress.rs`'s quiet lock).
    /// Keeping the chunks in place needs a memfd per chunk (a chunk is one driver allocation
    /// on a GPU too).
    pub(super) fn drop_chunks(
        &self,
        arena: &ArenaMem,
        doomed: &[usize],
    ) -> Result<Vec<(ArenaMem, usize)>> {
        let lens = self
            .inner
            .lock()
            .arena_mut(arena, "drop_chunks")?
            .chunks
            .clone();
        check_dropped_chunks(lens.len(), doomed)?;
        let runs = kept_runs(lens.len(), doomed);
        let offset = |i: usize| lens[..i].iter().sum::<u64>();
        let windows: Vec<(u64, u64)> = runs
            .iter()
            .map(|&(at, n)| (offset(at), lens[at..at + n].iter().sum()))
            .collect();
        let parts = self.split_windows(arena, &windows, false)?;
        let mut inner = self.inner.lock();
        let mut out = Vec::with_capacity(parts.len());
        for (part, &(at, n)) in parts.into_iter().zip(&runs) {
            if let Some(entry) = inner.arenas.get_mut(&part.handle) {
                entry.chunks = lens[at..at + n].to_vec();
            }
            out.push((part, n));
        }
        Ok(out)
    }

    /// A split; `new_memory`: its windows are new allocations (a trim's: each one a driver
    /// call that may fail, and room on the device), else the chunks kept where they are.
    fn split_windows(
        &self,
        arena: &ArenaMem,
        windows: &[(u64, u64)],
        new_memory: bool,
    ) -> Result<Vec<ArenaMem>> {
        let mut inner = self.inner.lock();
        check_split_windows(arena.bytes, self.config.granularity, windows)?;
        {
            let entry = inner.arena_mut(arena, "split_arena")?;
            if entry.open_exports > 0 || entry.mappings > 0 || entry.pinned {
                return Err(Error::InvalidState(format!(
                    "sim split_arena: arena {} is exported or mapped elsewhere",
                    arena.handle
                )));
            }
            if entry.owner.as_ref().is_none_or(|o| o.memfd.is_none()) {
                return Err(Error::InvalidState(format!(
                    "sim split_arena: arena {} is destroyed or asleep",
                    arena.handle
                )));
            }
        }
        if new_memory {
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
        let (old_fd, whole) = (owner.memfd, owner.region);
        let old_fd = old_fd.ok_or_else(|| Error::Internal("sim split_arena: asleep".into()))?;
        for (i, (&(offset, len), (memfd, _))) in windows.iter().zip(&made).enumerate() {
            if let Err(e) = sys::map_over_at(&whole.part(offset, len), memfd.as_fd(), 0) {
                for &(off, l) in &windows[..i] {
                    if let Err(back) = sys::map_over_at(&whole.part(off, l), old_fd.as_fd(), off) {
                        tracing::error!(error = %back, "sim split_arena: mapping the old pages back failed");
                    }
                }
                entry.owner = Some(Owner {
                    memfd: Some(old_fd),
                    region: whole,
                });
                return Err(e);
            }
        }
        // The pages between (and around) the windows go; the old memfd closes with `old_fd`.
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
        drop(old_fd);
        let device = entry.device;
        inner.retire_if_released(arena.handle);
        let mut out = Vec::with_capacity(windows.len());
        for (&(offset, len), (memfd, key)) in windows.iter().zip(made) {
            let id = inner.take_id();
            inner.by_inode.insert(key, id);
            inner.arenas.insert(
                id,
                ArenaEntry {
                    device,
                    base: arena.base + offset,
                    bytes: len,
                    inode: key,
                    owner: Some(Owner {
                        memfd: Some(memfd),
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
