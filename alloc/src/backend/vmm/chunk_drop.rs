//! [`Backend::drop_chunks`] on the VMM core: a grown arena gives back whole chunks without
//! moving a byte (`empty_cache`'s free chunks between live ones). Each dropped chunk is one
//! mapping and one physical allocation of its own, so it is unmapped and released; the
//! chunks kept stay mapped where they are, and each run of them becomes an arena in the old
//! reservation (`registry::SplitReservations`, as a trim's windows: freed with the last).
//!
//! Nothing is copied and no kept mapping changes, so device work may run on the kept chunks
//! meanwhile. A chunk whose unmapping fails stays, in its run; nothing needs undoing.
//!
//! [`Backend::drop_chunks`]: crate::backend::Backend::drop_chunks

use super::grow::Chunks;
use super::registry::{self, RegionKind};
use super::{warn_undo, Driver, VmmBackend};
use crate::backend::{check_dropped_chunks, kept_runs, ArenaMem};
use crate::error::{Error, Result};

impl<D: Driver> VmmBackend<D> {
    /// [`crate::backend::Backend::chunk_spans`].
    pub(super) fn spans(&self, arena: &ArenaMem) -> Vec<(u64, u64)> {
        self.chunk_layout(arena.base, arena.bytes, arena.handle)
            .into_iter()
            .map(|(offset, bytes, _)| (offset, bytes))
            .collect()
    }

    /// [`crate::backend::Backend::drop_chunks`] (see the module documentation).
    pub(super) fn drop_arena_chunks(
        &self,
        arena: &ArenaMem,
        doomed: &[usize],
    ) -> Result<Vec<(ArenaMem, usize)>> {
        let device = arena.device;
        let expect = Self::arena_region(arena);
        let RegionKind::Arena { handle: first } = expect.kind else {
            return Err(Error::Unavailable(format!(
                "{}: a legacy IPC arena has no chunks to drop",
                D::NAME
            )));
        };
        let layout = self.chunk_layout(arena.base, arena.bytes, first);
        check_dropped_chunks(layout.len(), doomed)?;
        self.take_exact_region(arena.base, expect, || {
            format!(
                "{}: drop_chunks of {:#x}: not a live, awake arena of this backend",
                D::NAME,
                arena.base
            )
        })?;
        let current = self.make_current(device);
        let mut dropped = Vec::with_capacity(doomed.len());
        if current.is_ok() {
            for &i in doomed {
                let (offset, bytes, _) = layout[i];
                let n = usize::try_from(bytes).unwrap_or(usize::MAX);
                // SAFETY: one whole mapping of the arena (chunk `i`), out of the registry; the
                // caller synchronized and uses none of its bytes (the trait's contract).
                match unsafe { self.driver.unmap(arena.base + offset, n) } {
                    Ok(()) => dropped.push(i),
                    Err(e) => {
                        tracing::warn!(backend = D::NAME, device, call = e.call, error = %e.message,
                            "unmapping a grown arena's free chunk failed; the arena keeps it");
                    }
                }
            }
        }
        if dropped.is_empty() {
            self.regions.write().insert(arena.base, expect);
            return match current {
                Err(e) => Err(e),
                Ok(_) => Err(Error::Unavailable(format!(
                    "{}: drop_chunks of {:#x}: no chunk could be unmapped",
                    D::NAME,
                    arena.base
                ))),
            };
        }
        for &i in &dropped {
            // SAFETY: the chunk's own handle, unmapped just above, released once (the
            // arena's chunk records are replaced below).
            warn_undo(device, unsafe { self.driver.mem_release(layout[i].2) });
        }
        let runs = kept_runs(layout.len(), &dropped);
        registry::record_split(&mut self.splits.lock(), arena.base, arena.bytes, runs.len());
        let mut out = Vec::with_capacity(runs.len());
        let mut chunks = self.chunks.lock();
        chunks.remove(&arena.base);
        for &(at, n) in &runs {
            let (offset, _, handle) = layout[at];
            let run = &layout[at..at + n];
            let bytes: u64 = run.iter().map(|c| c.1).sum();
            let mem = ArenaMem {
                device,
                base: arena.base + offset,
                bytes,
                handle,
            };
            if n > 1 {
                // Its other chunks, from its own base; no room to grow (`reserve` 0).
                let extra = run[1..]
                    .iter()
                    .map(|&(o, b, h)| (o - offset, b, h))
                    .collect();
                chunks.insert(mem.base, Chunks { reserve: 0, extra });
            }
            out.push((mem, n));
        }
        drop(chunks);
        for (mem, _) in &out {
            let kind = RegionKind::Arena { handle: mem.handle };
            self.insert_region(mem.base, device, mem.bytes, kind);
        }
        tracing::debug!(
            backend = D::NAME,
            device,
            base = arena.base,
            bytes = arena.bytes,
            dropped = dropped.len(),
            runs = out.len(),
            "grown arena's free chunks dropped"
        );
        Ok(out)
    }
}
