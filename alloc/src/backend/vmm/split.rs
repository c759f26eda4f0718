//! Trim in the VMM core: [`Backend::split_arena`](crate::backend::Backend::split_arena).
//!
//! An arena is one physical allocation mapped over its own address reservation, and the
//! driver frees a physical allocation only whole. To give back the parts of an arena that no
//! live block uses, each *window* (a run of granularity pages the pool keeps) gets a new
//! physical allocation with the window's contents, mapped at the same addresses, and the old
//! allocation is released:
//!
//! 1. create one allocation per window and map them, side by side, in one temporary
//!    reservation (read-write for the device and its peers);
//! 2. copy each window there (device to device) and synchronize;
//! 3. unmap the old allocation, unmap the new ones from the temporary range and map each at
//!    its window;
//! 4. release the old allocation and the temporary range.
//!
//! Until step 3 unmaps the old allocation a failure only undoes what this call made; after
//! it, a failure maps the old allocation back over the whole arena (its contents are intact:
//! it is released only in step 4). Nothing may touch the arena's memory during the call (the
//! caller's contract): between the unmap and the new mappings the addresses are unmapped.
//!
//! The arena's reservation must be freed with the original base and size (CUDA's
//! `cuMemAddressFree`), so [`Reservations`] counts the live windows of each split
//! reservation and `teardown` frees it with the last one. A window is an arena like any
//! other (destroy, export, sleep and wake, split again).

use std::collections::HashMap;

use super::registry::{Region, RegionKind};
use super::{to_usize, warn_undo, Driver, VmmBackend};
use crate::backend::{check_split_windows, ArenaMem};
use crate::error::{Error, Result};
use crate::ids::DeviceId;

/// The reservations that were split into windows.
#[derive(Debug, Default)]
pub(super) struct Reservations {
    /// Base of a live window -> base of its reservation.
    reservation_of: HashMap<u64, u64>,
    /// Base of a split reservation -> (its bytes, its live windows).
    live: HashMap<u64, (u64, usize)>,
}

impl Reservations {
    /// Record that the region at `base` (`bytes` long, itself a window or a whole
    /// reservation) was split into `windows` (their bases).
    fn record_split(&mut self, base: u64, bytes: u64, windows: &[u64]) {
        let reservation = self.reservation_of.remove(&base).unwrap_or(base);
        let entry = self.live.entry(reservation).or_insert((bytes, 1));
        // The split region itself stops counting; each window counts.
        entry.1 = entry.1 - 1 + windows.len();
        for &w in windows {
            self.reservation_of.insert(w, reservation);
        }
    }

    /// The region at `base` (`bytes` long) is gone: the reservation to free now, if any
    /// (its own, or its split reservation when it was the last live window of it).
    pub(super) fn release(&mut self, base: u64, bytes: u64) -> Option<(u64, u64)> {
        let Some(reservation) = self.reservation_of.remove(&base) else {
            return Some((base, bytes));
        };
        let entry = self.live.get_mut(&reservation)?;
        entry.1 -= 1;
        if entry.1 > 0 {
            return None;
        }
        let (rbytes, _) = self.live.remove(&reservation)?;
        Some((reservation, rbytes))
    }
}

impl<D: Driver> VmmBackend<D> {
    /// [`Backend::split_arena`](crate::backend::Backend::split_arena) (see the module docs).
    pub(super) fn split(&self, arena: &ArenaMem, windows: &[(u64, u64)]) -> Result<Vec<ArenaMem>> {
        let state = self.state(arena.device)?;
        check_split_windows(arena.bytes, state.granularity, windows)?;
        let expect = Self::arena_region(arena);
        let RegionKind::Arena { handle: old } = expect.kind else {
            return Err(Error::Unavailable(format!(
                "{}: a legacy IPC arena cannot be split (its memory and addresses are one)",
                D::NAME
            )));
        };
        // Out of the registry for the driver calls (as in sleep): copies, exports and a
        // second split find no live arena there meanwhile.
        self.take_exact_region(arena.base, expect, || {
            format!(
                "{}: split_arena of {:#x}: not a live, awake arena of this backend",
                D::NAME,
                arena.base
            )
        })?;
        let made = self
            .make_current(arena.device)
            .and_then(|(_, _current)| self.rebuild_windows(&state, arena, old, windows));
        let handles = match made {
            Ok(handles) => handles,
            Err(e) => {
                self.regions.write().insert(arena.base, expect);
                return Err(e);
            }
        };
        let out: Vec<ArenaMem> = windows
            .iter()
            .zip(handles)
            .map(|(&(offset, len), handle)| ArenaMem {
                device: arena.device,
                base: arena.base + offset,
                bytes: len,
                handle,
            })
            .collect();
        let bases: Vec<u64> = out.iter().map(|w| w.base).collect();
        self.reservations
            .lock()
            .record_split(arena.base, arena.bytes, &bases);
        let mut regions = self.regions.write();
        for w in &out {
            regions.insert(
                w.base,
                Region {
                    device: w.device,
                    bytes: w.bytes,
                    kind: RegionKind::Arena { handle: w.handle },
                },
            );
        }
        drop(regions);
        tracing::debug!(
            backend = D::NAME,
            device = arena.device,
            base = arena.base,
            bytes = arena.bytes,
            windows = out.len(),
            kept = out.iter().map(|w| w.bytes).sum::<u64>(),
            "arena split"
        );
        Ok(out)
    }

    /// Steps 1-4 of the module docs, with the device current; returns the windows' handles.
    fn rebuild_windows(
        &self,
        state: &super::DeviceState<D::Device>,
        arena: &ArenaMem,
        old: u64,
        windows: &[(u64, u64)],
    ) -> Result<Vec<u64>> {
        let device = arena.device;
        let d = &self.driver;
        let total: u64 = windows.iter().map(|w| w.1).sum();
        let whole = to_usize(arena.bytes)?;
        let temp_n = to_usize(total)?;
        // 1. New allocations, mapped side by side in a temporary range.
        let mut handles = Vec::with_capacity(windows.len());
        for &(_, len) in windows {
            let created = to_usize(len).and_then(|n| {
                self.create_physical(state, device, n)
                    .map_err(|e| e.into_error(device, len))
            });
            match created {
                Ok(h) => handles.push(h),
                Err(e) => {
                    self.release_handles(device, &handles);
                    return Err(e);
                }
            }
        }
        let temp = match d.address_reserve(temp_n, to_usize(state.granularity).unwrap_or(0)) {
            Ok(t) => t,
            Err(e) => {
                self.release_handles(device, &handles);
                return Err(e.into_error(device, total));
            }
        };
        let mut at = temp;
        let mut mapped = Vec::with_capacity(windows.len());
        for (&(offset, len), &h) in windows.iter().zip(&handles) {
            let n = to_usize(len)?;
            let step = self.map_access(state, device, at, n, h).and_then(|()| {
                mapped.push((at, n));
                // SAFETY: `at..at + n` was just mapped (ours alone); the source is the
                // arena's live mapping, out of the registry, which nothing touches during the
                // call (the caller's contract); the two do not overlap (distinct reservations).
                unsafe { d.memcpy_dtod(at, arena.base + offset, n) }
            });
            if let Err(e) = step {
                self.undo_temp(device, &mapped, temp, temp_n, &handles);
                return Err(e.into_error(device, len));
            }
            at += len;
        }
        // 2. The copies are done before the old memory goes.
        if let Err(e) = d.synchronize() {
            self.undo_temp(device, &mapped, temp, temp_n, &handles);
            return Err(e.into_error(device, 0));
        }
        // 3. Old memory out, new memory in at the windows.
        // SAFETY: the arena's whole mapping, out of the registry; the caller synchronized
        // and nothing uses it during the call.
        if let Err(e) = unsafe { d.unmap(arena.base, whole) } {
            self.undo_temp(device, &mapped, temp, temp_n, &handles);
            return Err(e.into_error(device, 0));
        }
        for &(at, n) in &mapped {
            // SAFETY: a temporary mapping made above, unmapped once (the copies are done).
            warn_undo(device, unsafe { d.unmap(at, n) });
        }
        let mut placed: Vec<(u64, usize)> = Vec::with_capacity(windows.len());
        for (&(offset, len), &h) in windows.iter().zip(&handles) {
            let (base, n) = (arena.base + offset, to_usize(len)?);
            if let Err(e) = self.map_access(state, device, base, n, h) {
                // Put the old memory back: its contents were never touched.
                for &(b, n) in &placed {
                    // SAFETY: a window mapped just above, unmapped once.
                    warn_undo(device, unsafe { d.unmap(b, n) });
                }
                if let Err(back) = self.map_access(state, device, arena.base, whole, old) {
                    tracing::error!(backend = D::NAME, device, base = arena.base, error = %back.message,
                        "split_arena could not map the arena's memory back: its addresses are unmapped");
                }
                self.release_handles(device, &handles);
                // SAFETY: the temporary reservation, nothing mapped in it any more, freed once.
                warn_undo(device, unsafe { d.address_free(temp, temp_n) });
                return Err(e.into_error(device, len));
            }
            placed.push((base, n));
        }
        // 4. The old allocation and the temporary range go.
        // SAFETY: the arena's old handle, unmapped above, released once (no region records it).
        warn_undo(device, unsafe { d.mem_release(old) });
        // SAFETY: the temporary reservation, nothing mapped in it any more, freed once.
        warn_undo(device, unsafe { d.address_free(temp, temp_n) });
        Ok(handles)
    }

    /// Undo step 1: unmap the temporary mappings, free the range, release the new handles.
    fn undo_temp(
        &self,
        device: DeviceId,
        mapped: &[(u64, usize)],
        temp: u64,
        temp_n: usize,
        handles: &[u64],
    ) {
        let d = &self.driver;
        for &(at, n) in mapped {
            // SAFETY: a temporary mapping of this call, unmapped once.
            warn_undo(device, unsafe { d.unmap(at, n) });
        }
        // SAFETY: the temporary reservation of this call, nothing mapped in it, freed once.
        warn_undo(device, unsafe { d.address_free(temp, temp_n) });
        self.release_handles(device, handles);
    }

    /// Release handles this call created (none of them mapped).
    fn release_handles(&self, device: DeviceId, handles: &[u64]) {
        for &h in handles {
            // SAFETY: a handle created by this call, not mapped anywhere, released once.
            warn_undo(device, unsafe { self.driver.mem_release(h) });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_split_reservation_is_freed_with_its_last_window() {
        let mut r = Reservations::default();
        assert_eq!(
            r.release(10, 5),
            Some((10, 5)),
            "an unsplit arena frees its own"
        );
        r.record_split(100, 50, &[100, 120, 140]);
        // A window split again: its reservation is still the first one.
        r.record_split(120, 10, &[120, 125]);
        assert_eq!(r.release(100, 5), None);
        assert_eq!(r.release(140, 5), None);
        assert_eq!(r.release(125, 5), None);
        assert_eq!(r.release(120, 5), Some((100, 50)));
        assert!(r.live.is_empty() && r.reservation_of.is_empty());
    }
}
