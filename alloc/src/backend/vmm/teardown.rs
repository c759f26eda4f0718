//! Tearing down what the VMM core handed out: one region at a time (destroy, unmap an
//! import, [`Drop`]), freeing address ranges (a split arena's reservation with its last
//! window), and the backend's [`Drop`], which destroys whatever the owner left behind.

use super::registry::{self, Region, RegionKind};
use super::{to_usize, warn_undo, Driver, DriverResult, VmmBackend};
use crate::backend::Backend;
use crate::error::Result;
use crate::ids::DeviceId;

impl<D: Driver> VmmBackend<D> {
    /// Tear down one region (the caller removed it from the registry and synchronized). On an
    /// error before the memory was touched the region goes back into the registry.
    pub(super) fn teardown(&self, base: u64, region: Region) -> Result<()> {
        let device = region.device;
        // (A size the driver can take: checked before anything changes.)
        let current = to_usize(region.bytes)
            .and_then(|_| self.make_current(device).map(|(_state, current)| current));
        let _current = match current {
            Ok(current) => current,
            Err(e) => {
                self.regions.write().insert(base, region);
                return Err(e);
            }
        };
        let d = &self.driver;
        let result = match region.kind {
            RegionKind::Arena { .. } | RegionKind::Import => {
                let first = match region.kind {
                    RegionKind::Arena { handle } => handle,
                    _ => 0,
                };
                // Every mapping of the region (one per chunk of a grown arena or its import),
                // just removed from the registry (nobody else can reach it through the
                // backend); the caller synchronized the device.
                let layout = self.chunk_layout(base, region.bytes, first);
                if let Err(e) = self.unmap_chunks(base, &layout) {
                    self.regions.write().insert(base, region);
                    return Err(e.into_error(device, 0));
                }
                let freed = self.free_range(base, region.bytes);
                let released = match region.kind {
                    // SAFETY: the arena's own handle, released once (its record is gone).
                    RegionKind::Arena { handle } => unsafe { d.mem_release(handle) },
                    _ => Ok(()),
                };
                if region.kind != RegionKind::Import {
                    self.release_extra_chunks(device, base);
                }
                self.forget_chunks(base);
                freed.and(released)
            }
            // SAFETY: our own legacy allocation, just removed from the registry, freed once;
            // the caller synchronized.
            RegionKind::LegacyArena => unsafe { d.legacy_free(base) },
            // Asleep: nothing mapped there.
            RegionKind::Asleep => {
                self.forget_chunks(base);
                self.free_range(base, region.bytes)
            }
            // SAFETY: our own opened IPC handle, just removed from the registry, closed once.
            RegionKind::LegacyImport => unsafe { d.ipc_close_handle(base) },
        };
        result.map_err(|e| e.into_error(device, 0))
    }

    /// Free the address range of a region just torn down (nothing mapped at `base..base +
    /// bytes` any more): its own reservation, or for a window of a split arena the whole
    /// reservation once it was the last window there (nothing otherwise).
    fn free_range(&self, base: u64, bytes: u64) -> DriverResult<()> {
        let range = registry::range_to_free(&mut self.splits.lock(), base, bytes);
        let Some((reservation, bytes)) = range else {
            return Ok(());
        };
        // Every size recorded here was an arena's, checked by to_usize when it was created.
        let n = usize::try_from(bytes).unwrap_or(usize::MAX);
        // SAFETY: our own whole reservation (the region's own, or the split reservation its
        // last window just left), nothing mapped in it any more, freed once (its record is
        // gone).
        unsafe { self.driver.address_free(reservation, n) }
    }
}

impl<D: Driver> Drop for VmmBackend<D> {
    /// Destroys what the owner left behind (with a warning: the pool should have done it),
    /// then closes every device the backend opened (CUDA: gives back the primary contexts).
    fn drop(&mut self) {
        let events: Vec<(u64, DeviceId)> = self.events.get_mut().drain().collect();
        let regions: Vec<(u64, Region)> =
            std::mem::take(self.regions.get_mut()).into_iter().collect();
        if !events.is_empty() || !regions.is_empty() {
            tracing::warn!(
                backend = D::NAME,
                events = events.len(),
                regions = regions.len(),
                "backend dropped with live events/arenas/imports: destroying them"
            );
        }
        for (raw, device) in events {
            if let Ok((_state, _current)) = self.make_current(device) {
                // SAFETY: a live event of ours, taken out of the registry, destroyed once.
                warn_undo(device, unsafe { self.driver.event_destroy(raw) });
            }
        }
        for (raw, device) in self.streams.get_mut().drain().collect::<Vec<_>>() {
            tracing::warn!(
                backend = D::NAME,
                device,
                "backend dropped with a live transfer stream: destroying it"
            );
            if let Ok((_state, _current)) = self.make_current(device) {
                // SAFETY: a live stream of ours, taken out of the registry, destroyed once.
                warn_undo(device, unsafe { self.driver.stream_destroy(raw) });
            }
        }
        let mut synced = Vec::new();
        for (base, region) in regions {
            if !synced.contains(&region.device) {
                if let Err(e) = self.synchronize(region.device) {
                    tracing::warn!(backend = D::NAME, device = region.device, error = %e, "synchronize before teardown failed");
                }
                synced.push(region.device);
            }
            if let Err(e) = self.teardown(base, region) {
                tracing::warn!(backend = D::NAME, device = region.device, base, error = %e, "teardown in drop failed");
            }
        }
        let splits = self.splits.get_mut();
        if !splits.is_empty() {
            tracing::warn!(
                backend = D::NAME,
                reservations = splits.len(),
                "split reservations left after teardown (a window's teardown failed): leaked"
            );
        }
        let host: Vec<(u64, super::pinned::PinnedHost)> = self.host.get_mut().drain().collect();
        if !host.is_empty() {
            tracing::warn!(
                backend = D::NAME,
                buffers = host.len(),
                "backend dropped with live pinned host buffers: freeing them"
            );
        }
        for (p, h) in host {
            self.free_pinned(p, h);
        }
        for slot in &mut self.devices {
            if let Some(state) = slot.take() {
                // SAFETY: closes the device this backend opened; the state was taken out of
                // its slot, so nothing uses it afterwards.
                if let Err(e) = unsafe { self.driver.close_device(state.device) } {
                    tracing::warn!(backend = D::NAME, error = %e.message, "closing a device failed");
                }
            }
        }
    }
}
