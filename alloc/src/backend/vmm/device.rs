//! Per-device state of the VMM core: opening a device on first use, choosing VMM or the
//! legacy IPC path, finding its peers and whether it uses FABRIC handles, making it current
//! for a call.

use std::sync::atomic::Ordering;

use super::{to_usize, warn_undo, Driver, VmmBackend};
use crate::error::{Error, Result};
use crate::ids::DeviceId;

/// What the backend caches per device once it first used it.
#[derive(Debug, Clone, Copy)]
pub(super) struct DeviceState<Dev> {
    /// The driver's open device.
    pub(super) device: Dev,
    /// Arena granularity in bytes (VMM minimum, or the legacy path's).
    pub(super) granularity: u64,
    /// Whether arenas use VMM (else the legacy IPC path).
    pub(super) vmm: bool,
    /// The other devices that can access this one's memory: every VMM mapping on this device
    /// is made accessible from them too (none on the legacy path).
    pub(super) peers: Peers,
}

/// The devices that can access a device's memory, besides itself: bit `p` for device `p`
/// (devices 0..64; a device beyond that is never made a peer). Found by `find_peers`
/// (access.rs) on the device's first use.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Peers(pub(super) u64);

impl Peers {
    /// The peers' ordinals, lowest first.
    pub(super) fn iter(self) -> impl Iterator<Item = DeviceId> {
        (0..64).filter(move |p| self.0 & (1u64 << p) != 0)
    }

    /// `device` first, then its peers: the devices a mapping on `device` is made accessible
    /// from.
    pub(super) fn access_list(self, device: DeviceId) -> Vec<DeviceId> {
        std::iter::once(device)
            .chain(self.iter().filter(|&p| p != device))
            .collect()
    }
}

impl<D: Driver> VmmBackend<D> {
    /// Check a device index.
    fn index(&self, device: DeviceId) -> Result<usize> {
        usize::try_from(device)
            .ok()
            .filter(|&i| i < self.device_count)
            .ok_or(Error::InvalidDevice {
                device,
                count: self.device_count,
            })
    }

    /// The device's cached state, opening the device on first use.
    pub(super) fn state(&self, device: DeviceId) -> Result<DeviceState<D::Device>> {
        let index = self.index(device)?;
        let slot = self
            .devices
            .get(index)
            .ok_or_else(|| Error::Internal(format!("no device slot {index}")))?;
        if let Some(state) = slot.get() {
            return Ok(*state);
        }
        let _init = self.init_lock.lock();
        if let Some(state) = slot.get() {
            return Ok(*state);
        }
        let state = self.init_device(device)?;
        Ok(*slot.get_or_init(|| state))
    }

    /// The legacy IPC state of a device (`why` is logged), where the driver has that path.
    fn legacy_state(&self, device: DeviceId, why: &str) -> Result<DeviceState<D::Device>> {
        let legacy = D::LEGACY_IPC.ok_or_else(|| {
            Error::Internal(format!("the {} backend has no legacy IPC path", D::NAME))
        })?;
        tracing::info!(
            backend = D::NAME,
            device,
            version = %self.driver.version_text(),
            "{why}: legacy IPC ({}-handle arenas, pinning exports)",
            legacy.handle_name
        );
        Ok(DeviceState {
            device: self
                .driver
                .open_device(device, false)
                .map_err(|e| e.into_error(device, 0))?,
            granularity: legacy.granularity,
            vmm: false,
            peers: Peers::default(),
        })
    }

    /// First use of a device: check VMM and POSIX-fd support, open it, read the granularity,
    /// find its peers and whether it uses FABRIC handles; the legacy IPC path where asked for
    /// or where VMM is missing and the driver falls back to it ([`super::LegacyIpc::fallback`]).
    fn init_device(&self, device: DeviceId) -> Result<DeviceState<D::Device>> {
        if self.legacy_ipc {
            return self.legacy_state(device, "legacy IPC asked for");
        }
        let support = self
            .driver
            .device_support(device)
            .map_err(|e| e.into_error(device, 0))?;
        let fallback = D::LEGACY_IPC.is_some_and(|l| l.fallback);
        if support.vmm == Some(false) {
            if fallback {
                return self.legacy_state(device, "device lacks VMM");
            }
            return Err(Error::Unavailable(format!(
                "{} device {device} does not support virtual memory management (VMM)",
                D::VENDOR
            )));
        }
        if support.posix_fd == Some(false) {
            return Err(Error::Unavailable(format!(
                "{} device {device} cannot export memory as POSIX file descriptors",
                D::VENDOR
            )));
        }
        let opened = self
            .driver
            .open_device(device, support.rdma)
            .map_err(|e| e.into_error(device, 0))?;
        let granularity = {
            // SAFETY: `opened` was just opened.
            let current = unsafe { self.driver.make_current(&opened) };
            current.and_then(|_current| self.driver.granularity(&opened))
        };
        let granularity = match granularity {
            Ok(g) if g > 0 => Ok(g),
            Ok(_) => Err(Error::Internal(format!(
                "{} device {device} reported granularity 0",
                D::VENDOR
            ))),
            Err(e) if e.is_not_supported() && fallback => {
                // SAFETY: closes the device opened above, which nothing else uses; the legacy
                // state opens it again.
                warn_undo(device, unsafe { self.driver.close_device(opened) });
                return self.legacy_state(device, "granularity query not supported");
            }
            Err(e) => Err(e.into_error(device, 0)),
        };
        let granularity = granularity.and_then(|g| {
            let fabric = self.start_fabric(device, support.fabric)?;
            if let Some(slot) = usize::try_from(device)
                .ok()
                .and_then(|i| self.fabric.get(i))
            {
                slot.store(fabric, Ordering::Relaxed);
            }
            Ok(g)
        });
        let granularity = match granularity {
            Ok(g) => g,
            Err(e) => {
                // SAFETY: closes the device opened above, which nothing else uses.
                warn_undo(device, unsafe { self.driver.close_device(opened) });
                return Err(e);
            }
        };
        let peers = self.find_peers(device);
        let peer_list: Vec<DeviceId> = peers.iter().collect();
        tracing::debug!(backend = D::NAME, device, granularity, rdma = support.rdma, fabric = self.uses_fabric(device), peers = ?peer_list, opened = ?opened, "device ready");
        Ok(DeviceState {
            device: opened,
            granularity,
            vmm: true,
            peers,
        })
    }

    /// The device's state with the device made current for the caller's driver calls.
    pub(super) fn make_current(
        &self,
        device: DeviceId,
    ) -> Result<(DeviceState<D::Device>, D::Current)> {
        let state = self.state(device)?;
        // SAFETY: an open device stays open while the backend lives (closed only in Drop).
        let current = unsafe { self.driver.make_current(&state.device) }
            .map_err(|e| e.into_error(device, 0))?;
        Ok((state, current))
    }

    /// Check an arena size against the device's granularity.
    pub(super) fn check_size(
        state: &DeviceState<D::Device>,
        device: DeviceId,
        bytes: u64,
    ) -> Result<usize> {
        if bytes == 0 || bytes % state.granularity != 0 {
            return Err(Error::invalid(format!(
                "{bytes} bytes is not a positive multiple of device {device}'s granularity ({} bytes)",
                state.granularity
            )));
        }
        to_usize(bytes)
    }
}
