//! Who can reach VMM memory, and how arenas are created: peer access, FABRIC handles, and the
//! map + set-access steps every arena, re-created arena and import mapping goes through.
//!
//! - **Peers.** VMM memory is reachable only from the devices `cuMemSetAccess` names. On a
//!   device's first use the core asks the driver, for every other device, whether that device
//!   can access this one's memory ([`Driver::can_access_peer`]) and keeps the answer as a
//!   bitmask ([`Peers`]). Every mapping (an arena when created, an arena re-created on wake,
//!   an import) is then made read-write for its own device and all those peers in one
//!   [`Driver::set_access`] call, so memory created before a second device is first used is
//!   reachable from it too (PyTorch `.to("cuda:1")`, a kernel on one GPU reading another's
//!   tensor). A driver that cannot answer means no peers. A grant naming peers that the
//!   driver refuses (not for lack of memory) is retried for the owner alone, and that
//!   device's peers are not named again (warned once): the GPU stays usable.
//! - **FABRIC handles** ([`FabricHandles`], config key `fabric_handles`). Where the device
//!   reports FABRIC support ([`DeviceSupport::fabric`]), arenas are created exportable as
//!   FABRIC handles as well as POSIX fds, so UCX's cuda_ipc transport (NIXL) can open them.
//!   In `auto` mode a create the driver refuses as not permitted or not supported (no IMEX
//!   channel) is retried POSIX-only, and the device stays POSIX-only from then on (logged
//!   once at info); `1` makes that refusal an error. Our own exports stay POSIX fds.

use std::sync::atomic::Ordering;

use super::device::{DeviceState, Peers};
use super::{to_usize, warn_undo, Driver, DriverError, DriverResult, Failure, VmmBackend};
use crate::error::{Error, Result};
use crate::ids::DeviceId;

/// Whether VMM arenas are created with FABRIC handles too (config key `fabric_handles`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FabricHandles {
    /// Where the device reports FABRIC support; POSIX-only from the first refusal on (the
    /// default).
    #[default]
    Auto,
    /// Never (POSIX fds only).
    Off,
    /// Always: a device without FABRIC support, or a create the driver refuses, is an error.
    On,
}

impl std::str::FromStr for FabricHandles {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(FabricHandles::Auto),
            "0" | "false" | "no" | "off" => Ok(FabricHandles::Off),
            "1" | "true" | "yes" | "on" => Ok(FabricHandles::On),
            other => Err(Error::invalid(format!(
                "fabric_handles=`{other}`: expected auto, 0 or 1"
            ))),
        }
    }
}

impl<D: Driver> VmmBackend<D> {
    /// Use the legacy IPC path (plain device memory: `cuMemAlloc`, `hipMalloc`; 64-byte IPC
    /// handle exports of kind [`ExportKind::Pinning`]) on every device, even where VMM works:
    /// for consumers that only open `cuIpc*`/`hipIpc*` handles (UCX's cuda_ipc transport on
    /// hosts without FABRIC handles). Sleep/wake is unavailable for such arenas. Ignored for a
    /// driver without a legacy path. Takes effect for devices not used yet (call it right
    /// after `new`).
    ///
    /// [`ExportKind::Pinning`]: crate::backend::ExportKind::Pinning
    #[must_use]
    pub fn with_legacy_ipc(mut self, legacy: bool) -> Self {
        self.legacy_ipc = legacy && D::LEGACY_IPC.is_some();
        self
    }

    /// Whether VMM arenas get FABRIC handles too (see [`FabricHandles`]). Takes effect for
    /// devices not used yet (call it right after `new`).
    #[must_use]
    pub fn with_fabric_handles(mut self, mode: FabricHandles) -> Self {
        self.fabric_mode = mode;
        self
    }

    /// The devices that can access `device`'s memory (asked once, on the device's first use).
    /// A driver that cannot say means none; another failed query leaves that device out.
    pub(super) fn find_peers(&self, device: DeviceId) -> Peers {
        let mut peers = 0u64;
        for peer in (0..self.device_count.min(64)).filter_map(|p| DeviceId::try_from(p).ok()) {
            if peer == device {
                continue;
            }
            match self.driver.can_access_peer(device, peer) {
                Ok(true) => peers |= 1u64 << peer,
                Ok(false) => {}
                Err(e) if e.is_not_supported() => return Peers(0),
                Err(e) => {
                    tracing::warn!(backend = D::NAME, device, peer, call = e.call, error = %e.message, "peer access query failed: not a peer");
                }
            }
        }
        if self.device_count > 64 {
            tracing::warn!(
                backend = D::NAME,
                device,
                "devices beyond the 64th are never given access"
            );
        }
        Peers(peers)
    }

    /// Whether `device`'s arenas start out with FABRIC handles: the device's support and the
    /// mode. [`FabricHandles::On`] without support is [`Error::Unavailable`].
    pub(super) fn start_fabric(&self, device: DeviceId, supported: bool) -> Result<bool> {
        match (self.fabric_mode, supported) {
            (FabricHandles::Off, _) => Ok(false),
            (_, true) => Ok(true),
            (FabricHandles::Auto, false) => Ok(false),
            (FabricHandles::On, false) => Err(Error::Unavailable(format!(
                "fabric_handles=1: {} device {device} does not support FABRIC handles",
                D::VENDOR
            ))),
        }
    }

    /// Whether `device`'s arenas are created with FABRIC handles now.
    pub(super) fn uses_fabric(&self, device: DeviceId) -> bool {
        usize::try_from(device)
            .ok()
            .and_then(|i| self.fabric.get(i))
            .is_some_and(|f| f.load(Ordering::Relaxed))
    }

    /// Physical memory for an arena of `n` bytes on `device` (made current by the caller):
    /// with FABRIC handles where the device uses them; in `auto` mode a refusal of those
    /// makes the device POSIX-only from then on (logged once) and is retried without.
    pub(super) fn create_physical(
        &self,
        state: &DeviceState<D::Device>,
        device: DeviceId,
        n: usize,
    ) -> DriverResult<u64> {
        let fabric = self.uses_fabric(device);
        let first = self.driver.mem_create(&state.device, n, fabric);
        match first {
            Err(e)
                if fabric
                    && self.fabric_mode == FabricHandles::Auto
                    && matches!(e.failure, Failure::NotPermitted | Failure::NotSupported) =>
            {
                self.fabric_refused(device, &e);
                self.driver.mem_create(&state.device, n, false)
            }
            other => other,
        }
    }

    /// Make `device` POSIX-only after the driver refused a FABRIC create (logged once).
    fn fabric_refused(&self, device: DeviceId, e: &DriverError) {
        let slot = usize::try_from(device)
            .ok()
            .and_then(|i| self.fabric.get(i));
        if slot.is_some_and(|f| f.swap(false, Ordering::Relaxed)) {
            tracing::info!(
                backend = D::NAME,
                device,
                call = e.call,
                error = %e.message,
                "FABRIC handles refused (no IMEX channel?): this device's arenas are POSIX-fd only from now on; UCX cuda_ipc cannot open them (legacy_ipc=1 makes arenas it can)"
            );
        }
    }

    /// The devices a mapping on `device` is made accessible from: the device, then its peers
    /// (unless a grant naming them was refused before).
    fn access_list(&self, state: &DeviceState<D::Device>, device: DeviceId) -> Vec<DeviceId> {
        let granted = usize::try_from(device)
            .ok()
            .and_then(|i| self.peer_grants.get(i))
            .is_some_and(|g| g.load(Ordering::Relaxed));
        if granted {
            state.peers.access_list(device)
        } else {
            vec![device]
        }
    }

    /// Read-write access to the fresh mapping `base..base + n` for `device` and its peers. A
    /// refused grant that names peers (not out of memory) is retried for the owner alone, and
    /// the device's peers are not named again (warned once).
    pub(super) fn grant_access(
        &self,
        state: &DeviceState<D::Device>,
        device: DeviceId,
        base: u64,
        n: usize,
    ) -> DriverResult<()> {
        let d = &self.driver;
        let devices = self.access_list(state, device);
        // SAFETY: `base..base + n` is mapped (the caller's contract).
        let granted = unsafe { d.set_access(base, n, &devices) };
        match granted {
            Err(e) if devices.len() > 1 && e.failure != Failure::OutOfMemory => {
                let slot = usize::try_from(device)
                    .ok()
                    .and_then(|i| self.peer_grants.get(i));
                if slot.is_some_and(|g| g.swap(false, Ordering::Relaxed)) {
                    tracing::warn!(backend = D::NAME, device, peers = ?&devices[1..], call = e.call, error = %e.message, "granting peer access refused: this device's memory is accessible from itself only from now on");
                }
                // SAFETY: as above.
                unsafe { d.set_access(base, n, &[device]) }
            }
            other => other,
        }
    }

    /// Map `handle` at `base..base + n` (nothing mapped there) and make it read-write for
    /// `device` and its peers. On failure the mapping is undone (the reservation and the
    /// handle stay the caller's). Call with the device made current.
    pub(super) fn map_access(
        &self,
        state: &DeviceState<D::Device>,
        device: DeviceId,
        base: u64,
        n: usize,
        handle: u64,
    ) -> DriverResult<()> {
        let d = &self.driver;
        // SAFETY: the caller's reservation with nothing mapped at `base..base + n`; `handle`
        // is a live allocation handle (the caller's contract).
        unsafe { d.map(base, n, handle) }?;
        if let Err(e) = self.grant_access(state, device, base, n) {
            // SAFETY: our own fresh mapping, never used by device work.
            warn_undo(device, unsafe { d.unmap(base, n) });
            return Err(e);
        }
        Ok(())
    }

    /// Reserve an address range for `n` bytes, map `handle` there and make it read-write for
    /// `device` and its peers. On failure everything this did is undone (the handle stays the
    /// caller's). Call with the device made current.
    pub(super) fn reserve_map_access(
        &self,
        state: &DeviceState<D::Device>,
        device: DeviceId,
        handle: u64,
        n: usize,
    ) -> DriverResult<u64> {
        let d = &self.driver;
        let base = d.address_reserve(n, to_usize(state.granularity).unwrap_or(0))?;
        if let Err(e) = self.map_access(state, device, base, n, handle) {
            // SAFETY: our own reservation, nothing mapped in it (map_access undid its
            // mapping), freed once.
            warn_undo(device, unsafe { d.address_free(base, n) });
            return Err(e);
        }
        Ok(base)
    }

    /// Import a VMM fd: import, map (read-write for `device` and its peers), release the
    /// import's handle. Call with the device made current.
    pub(super) fn import_fd(
        &self,
        state: &DeviceState<D::Device>,
        device: DeviceId,
        fd: std::os::fd::BorrowedFd<'_>,
        bytes: u64,
        n: usize,
    ) -> Result<u64> {
        let d = &self.driver;
        let handle = d.import_fd(fd).map_err(|e| e.into_error(device, bytes))?;
        let mapped = self.reserve_map_access(state, device, handle, n);
        // The mapping (if any) holds the memory now: give the import's handle back at once.
        // SAFETY: the handle just imported, released once.
        let released = unsafe { d.mem_release(handle) };
        match (mapped, released) {
            (Ok(base), Ok(())) => Ok(base),
            (Err(e), released) => {
                warn_undo(device, released);
                Err(e.into_error(device, bytes))
            }
            (Ok(base), Err(e)) => {
                // SAFETY: our own fresh mapping, never used by device work.
                warn_undo(device, unsafe { d.unmap(base, n) });
                // SAFETY: our own reservation, now unmapped, freed once.
                warn_undo(device, unsafe { d.address_free(base, n) });
                Err(e.into_error(device, bytes))
            }
        }
    }
}
