//! Trim: [`Backend::split_arena`] on the VMM core. An arena with a few survivors keeps only
//! the *windows* around them: each window gets physical memory of its own holding its
//! contents, the rest of the arena's memory goes back to the driver, addresses never change.
//!
//! # Order (on error nothing changed)
//! 1. Check the windows and the arena (a live, awake VMM arena of this backend); take its
//!    region out of the registry for the driver calls (as sleep and wake do).
//! 2. Create one physical allocation per window (like an arena's: FABRIC where the device
//!    uses it, RDMA-capable where the device is).
//! 3. Reserve one temporary range for the sum of the windows, map the new handles there
//!    (access: the device and its peers, as every VMM mapping), copy each window device to
//!    device into it, synchronize, unmap the temporary mappings and free the range. Until
//!    here the arena was not touched: a failure releases the new handles and puts the
//!    arena's region back.
//! 4. Unmap the arena's old memory (each of its mappings: one, or one per chunk of a grown
//!    arena) and map each new handle at its window's address (same access). A failure
//!    unmaps the windows mapped so far, maps the old handles back at their offsets (the
//!    contents intact: they were never released) and releases the new handles. Should that
//!    map back fail too, the arena is recorded asleep (its reservation kept, nothing mapped,
//!    the old handles released: `restore_physical` or `destroy_arena` may follow) and the
//!    error says so ("the arena is asleep").
//! 5. Release the old handles; record the windows as arenas of their own (a grown arena's
//!    chunk records go: its windows are plain arenas in its reservation).
//!
//! # Reservations
//! The arena's address reservation stays reserved until its last window is torn down
//! (`registry::SplitReservations`: base, size, live windows), then it is freed whole with
//! the base and size it was reserved with. A window is an arena like any other (destroy,
//! export, sleep, wake, copies, split again: its windows count in the same reservation).
//!
//! [`Backend::split_arena`]: crate::backend::Backend::split_arena

use super::device::DeviceState;
use super::registry::{self, Region, RegionKind};
use super::{to_usize, warn_undo, Driver, DriverError, DriverResult, VmmBackend};
use crate::backend::{check_split_windows, ArenaMem};
use crate::error::{Error, Result};
use crate::ids::DeviceId;

/// A window of the arena being split: where it lies and its size for the driver.
#[derive(Debug, Clone, Copy)]
struct Window {
    /// Offset from the arena's base.
    offset: u64,
    /// Size in bytes.
    bytes: u64,
    /// `bytes` as the driver's `size_t`.
    n: usize,
}

/// How a split failed: the error, and whether the arena kept its memory (it always does,
/// unless mapping its old memory back failed too).
struct SplitFailed {
    error: Error,
    arena_intact: bool,
}

impl SplitFailed {
    fn intact(error: Error) -> SplitFailed {
        SplitFailed {
            error,
            arena_intact: true,
        }
    }
}

/// Check `windows` against an arena of `bytes` on a device of `granularity`
/// ([`check_split_windows`]) and size them for the driver.
fn check_windows(granularity: u64, bytes: u64, windows: &[(u64, u64)]) -> Result<Vec<Window>> {
    check_split_windows(bytes, granularity, windows)?;
    windows
        .iter()
        .map(|&(offset, len)| {
            Ok(Window {
                offset,
                bytes: len,
                n: to_usize(len)?,
            })
        })
        .collect()
}

impl<D: Driver> VmmBackend<D> {
    /// [`crate::backend::Backend::split_arena`] (see the module documentation).
    pub(super) fn split(&self, arena: &ArenaMem, windows: &[(u64, u64)]) -> Result<Vec<ArenaMem>> {
        let state = self.state(arena.device)?;
        let expect = Self::arena_region(arena);
        let RegionKind::Arena { handle: old } = expect.kind else {
            return Err(Error::Unavailable(format!(
                "{}: a legacy IPC arena cannot be split: its memory and addresses are one",
                D::NAME
            )));
        };
        let checked = check_windows(state.granularity, arena.bytes, windows)?;
        // A grown arena's chunks, each a mapping and an allocation of its own.
        let chunks = self.chunk_layout(arena.base, arena.bytes, old);
        self.take_exact_region(arena.base, expect, || {
            format!(
                "{}: split_arena of {:#x}: not a live, awake arena of this backend",
                D::NAME,
                arena.base
            )
        })?;
        let moved = self
            .make_current(arena.device)
            .map_err(SplitFailed::intact)
            .and_then(|(_, _current)| {
                let handles = self.move_windows(&state, arena, &chunks, &checked)?;
                for &(_, _, handle) in &chunks {
                    // SAFETY: an old chunk's handle, unmapped everywhere (the arena's mappings
                    // are gone), released once: the arena's region is out of the registry
                    // for good and its chunk records go below.
                    if let Err(e) = unsafe { self.driver.mem_release(handle) } {
                        tracing::warn!(backend = D::NAME, error = %e.message, "mem_release of a split arena's old memory failed");
                    }
                }
                Ok(handles)
            });
        let handles = match moved {
            Ok(handles) => handles,
            Err(failed) => {
                let kind = if failed.arena_intact {
                    expect.kind
                } else {
                    // Its chunks were released: it wakes as one allocation.
                    if let Some(c) = self.chunks.lock().get_mut(&arena.base) {
                        c.extra.clear();
                    }
                    RegionKind::Asleep
                };
                self.regions
                    .write()
                    .insert(arena.base, Region { kind, ..expect });
                return Err(failed.error);
            }
        };
        registry::record_split(
            &mut self.splits.lock(),
            arena.base,
            arena.bytes,
            checked.len(),
        );
        // A growable arena is gone: its windows are plain arenas in its reservation.
        self.forget_chunks(arena.base);
        let split: Vec<ArenaMem> = checked
            .iter()
            .zip(handles)
            .map(|(w, handle)| ArenaMem {
                device: arena.device,
                base: arena.base + w.offset,
                bytes: w.bytes,
                handle,
            })
            .collect();
        for window in &split {
            self.insert_region(
                window.base,
                window.device,
                window.bytes,
                RegionKind::Arena {
                    handle: window.handle,
                },
            );
        }
        tracing::debug!(
            backend = D::NAME,
            device = arena.device,
            base = arena.base,
            bytes = arena.bytes,
            windows = split.len(),
            "arena split"
        );
        Ok(split)
    }

    /// Steps 2 to 4 of the module documentation, with the device made current and the
    /// arena's region out of the registry: the new handles, in window order. `chunks`: the
    /// arena's mappings, `(offset, bytes, handle)` (one unless it grew).
    fn move_windows(
        &self,
        state: &DeviceState<D::Device>,
        arena: &ArenaMem,
        chunks: &[(u64, u64, u64)],
        windows: &[Window],
    ) -> std::result::Result<Vec<u64>, SplitFailed> {
        let device = arena.device;
        let d = &self.driver;
        let failed = |e: DriverError, bytes: u64| SplitFailed::intact(e.into_error(device, bytes));
        let mut handles = Vec::with_capacity(windows.len());
        for w in windows {
            match self.create_physical(state, device, w.n) {
                Ok(handle) => handles.push(handle),
                Err(e) => {
                    self.release_all(device, &handles);
                    return Err(failed(e, w.bytes));
                }
            }
        }
        if let Err(e) = self.copy_windows(state, arena, windows, &handles) {
            self.release_all(device, &handles);
            return Err(failed(e, 0));
        }
        // The arena's mappings go, chunk by chunk (CUDA unmaps whole mappings only); a
        // failure maps back the ones already gone.
        for (i, &(offset, bytes, _)) in chunks.iter().enumerate() {
            let n = usize::try_from(bytes).unwrap_or(usize::MAX);
            // SAFETY: one whole mapping of the arena, out of the registry; the caller
            // synchronized and nothing touches the arena (the trait's contract), and the
            // copies out of it were synchronized by copy_windows.
            let unmapped = unsafe { d.unmap(arena.base + offset, n) };
            let Err(e) = unmapped else {
                continue;
            };
            self.release_all(device, &handles);
            return Err(match self.map_chunks(state, arena, &chunks[..i]) {
                Ok(()) => failed(e, 0),
                Err(lost) => self.lost(arena, chunks, e, &lost),
            });
        }
        for (i, (w, &handle)) in windows.iter().zip(&handles).enumerate() {
            let at = arena.base + w.offset;
            // The arena's reservation, nothing mapped at the window (the old mappings are
            // gone, windows are disjoint); `handle` was created above.
            let Err(e) = self.map_access(state, device, at, w.n, handle) else {
                continue;
            };
            for done in &windows[..i] {
                // SAFETY: a window mapped just above, never used by device work.
                warn_undo(device, unsafe { d.unmap(arena.base + done.offset, done.n) });
            }
            self.release_all(device, &handles);
            // The arena's reservation is empty again; its chunks were never released.
            return Err(match self.map_chunks(state, arena, chunks) {
                Ok(()) => failed(e, 0),
                Err(lost) => self.lost(arena, chunks, e, &lost),
            });
        }
        Ok(handles)
    }

    /// Map an arena's `chunks` back at their offsets (nothing mapped there); on failure
    /// the ones mapped here are unmapped again.
    fn map_chunks(
        &self,
        state: &DeviceState<D::Device>,
        arena: &ArenaMem,
        chunks: &[(u64, u64, u64)],
    ) -> DriverResult<()> {
        for (i, &(offset, bytes, handle)) in chunks.iter().enumerate() {
            let n = usize::try_from(bytes).unwrap_or(usize::MAX);
            if let Err(e) = self.map_access(state, arena.device, arena.base + offset, n, handle) {
                for &(off, b, _) in &chunks[..i] {
                    // SAFETY: a mapping made just above, never used by device work.
                    warn_undo(arena.device, unsafe {
                        self.driver
                            .unmap(arena.base + off, usize::try_from(b).unwrap_or(usize::MAX))
                    });
                }
                return Err(e);
            }
        }
        Ok(())
    }

    /// A split failed (`e`) and mapping the arena's memory back failed too (`lost`): its
    /// chunks are released and the arena is left asleep, its contents lost.
    fn lost(
        &self,
        arena: &ArenaMem,
        chunks: &[(u64, u64, u64)],
        e: DriverError,
        lost: &DriverError,
    ) -> SplitFailed {
        let device = arena.device;
        tracing::error!(backend = D::NAME, device, base = arena.base, call = lost.call, error = %lost.message, "split_arena: mapping the arena's memory back failed: it is asleep now, its contents lost");
        for &(_, _, handle) in chunks {
            // SAFETY: a chunk's handle, mapped nowhere now, released once (the region is
            // recorded as asleep, owning no handle).
            warn_undo(device, unsafe { self.driver.mem_release(handle) });
        }
        let mut e = e;
        e.message = format!(
            "{}; mapping the arena's memory back failed too ({}: {}): the arena is asleep, its contents lost",
            e.message, lost.call, lost.message
        );
        SplitFailed {
            error: e.into_error(device, 0),
            arena_intact: false,
        }
    }

    /// Step 3: copy every window of the arena into its new handle through one temporary
    /// range, synchronize, and leave nothing mapped or reserved (also on error).
    fn copy_windows(
        &self,
        state: &DeviceState<D::Device>,
        arena: &ArenaMem,
        windows: &[Window],
        handles: &[u64],
    ) -> DriverResult<()> {
        let device = arena.device;
        let d = &self.driver;
        let total: usize = windows.iter().map(|w| w.n).sum();
        let granularity = to_usize(state.granularity).unwrap_or(0);
        let temporary = d.address_reserve(total, granularity)?;
        let mut mapped: Vec<(u64, usize)> = Vec::with_capacity(windows.len());
        let mut copy = || -> DriverResult<()> {
            let mut at = temporary;
            for (w, &handle) in windows.iter().zip(handles) {
                // Our temporary reservation, nothing mapped at `at` yet; a live new handle.
                self.map_access(state, device, at, w.n, handle)?;
                mapped.push((at, w.n));
                // SAFETY: the arena's window (mapped, accessible from the device, nothing
                // else touches it) into the new mapping just made, disjoint ranges.
                unsafe { d.memcpy_dtod(at, arena.base + w.offset, w.n) }?;
                at += w.bytes;
            }
            d.synchronize()
        };
        let copied = copy();
        let mut unmapped = Ok(());
        for &(at, len) in &mapped {
            // SAFETY: a temporary mapping made above; the copies into it were synchronized
            // (or failed).
            let result = unsafe { d.unmap(at, len) };
            if unmapped.is_ok() {
                unmapped = result;
            } else {
                warn_undo(device, result);
            }
        }
        if let Err(e) = unmapped {
            tracing::warn!(
                backend = D::NAME,
                device,
                base = temporary,
                "a temporary mapping of split_arena stayed: its range is leaked"
            );
            return copied.and(Err(e));
        }
        // SAFETY: the temporary reservation, nothing mapped in it any more, freed once.
        let freed = unsafe { d.address_free(temporary, total) };
        copied.and(freed)
    }

    /// Release new handles of a failed split (none mapped any more).
    fn release_all(&self, device: DeviceId, handles: &[u64]) {
        for &handle in handles {
            // SAFETY: a handle created by this split, unmapped, released once.
            warn_undo(device, unsafe { self.driver.mem_release(handle) });
        }
    }
}
