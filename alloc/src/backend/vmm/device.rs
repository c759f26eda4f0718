//! Per-device state of the VMM core: opening a device on first use, choosing VMM or the
//! legacy IPC path, making it current for a call.

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
        })
    }

    /// First use of a device: check VMM and POSIX-fd support, open it, read the granularity;
    /// the legacy IPC path where asked for or where VMM is missing and the driver has it.
    fn init_device(&self, device: DeviceId) -> Result<DeviceState<D::Device>> {
        if self.legacy_ipc {
            return self.legacy_state(device, "legacy IPC asked for");
        }
        let support = self
            .driver
            .device_support(device)
            .map_err(|e| e.into_error(device, 0))?;
        if support.vmm == Some(false) {
            if D::LEGACY_IPC.is_some() {
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
            Err(e) if e.is_not_supported() && D::LEGACY_IPC.is_some() => {
                // SAFETY: closes the device opened above, which nothing else uses; the legacy
                // state opens it again.
                warn_undo(device, unsafe { self.driver.close_device(opened) });
                return self.legacy_state(device, "granularity query not supported");
            }
            Err(e) => Err(e.into_error(device, 0)),
        };
        let granularity = match granularity {
            Ok(g) => g,
            Err(e) => {
                // SAFETY: closes the device opened above, which nothing else uses.
                warn_undo(device, unsafe { self.driver.close_device(opened) });
                return Err(e);
            }
        };
        tracing::debug!(backend = D::NAME, device, granularity, rdma = support.rdma, opened = ?opened, "device ready");
        Ok(DeviceState {
            device: opened,
            granularity,
            vmm: true,
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
