//! The HIP backend: the VMM core ([`crate::backend::vmm`]) on the HIP runtime, with the
//! legacy `hipIpc*` path where VMM is not available or asked for.
//!
//! [`HipBackend`] is [`VmmBackend`]`<`[`HipDriver`]`>`: registries, per-device state,
//! teardown, copies and `Drop` are the core's; every raw runtime call lives in `driver`
//! (hip-sys, libamdhip64 linked at build time: see `driver`'s documentation for the ROCm
//! versions and what the bindings lack). This module adds what is HIP's alone: start-up, the
//! legacy-IPC switch, and the current-device query the tests use.
//!
//! # Start-up
//! [`HipBackend::new`] runs `hipInit` and counts devices. A machine without an AMD GPU gets
//! [`Error::Unavailable`] ("no HIP device: ..."), never a panic: ROCm 5.2's `hipInit` answers
//! `hipErrorInvalidDevice` there, `hipGetDeviceCount` `hipErrorNoDevice`.
//!
//! # Devices
//! HIP has no context stack to push: every call that needs a device makes it current with
//! `hipSetDevice` and restores the caller's device (`hipGetDevice`) when done.
//!
//! # Memory and exports
//! Per device, on first use, the core picks one of two paths:
//!
//! - **VMM (the default)**: `hipMemCreate` + `hipMemAddressReserve` + `hipMemMap` +
//!   `hipMemSetAccess`; exports are `hipMemExportToShareableHandle` fds
//!   ([`ExportKind::Releasable`]); imports `hipMemImportFromShareableHandle` + map.
//! - **Legacy IPC**: an arena is `hipMalloc`; exports are the 64-byte `hipIpcGetMemHandle`
//!   ([`ExportKind::Pinning`]: ROCm 7.2.x keeps such memory for the life of the exporting
//!   process, so the pool recycles these arenas; its start-up self-test detects pinning at
//!   run time anyway); imports are `hipIpcOpenMemHandle`, closed with `hipIpcCloseMemHandle`.
//!
//! The legacy path is used when [`HipBackend::with_legacy_ipc`]`(true)` asks for it (for peers
//! that only speak `hipIpc*` handles), or when the device lacks VMM: on ROCm >= 5.4
//! `hipDeviceAttributeVirtualMemoryManagementSupported` is 0, or `hipMemGetAllocationGranularity`
//! answers `hipErrorNotSupported` (the only check on ROCm < 5.4, whose headers lack the
//! attribute). The choice is logged. Imports accept both kinds of handle on either path.
//!
//! # Streams
//! A [`crate::backend::StreamId`] is the caller's `hipStream_t`: 0 (the null stream), 2
//! (`hipStreamPerThread`) or a live stream of the device.
//!
//! [`ExportKind::Releasable`]: crate::backend::ExportKind::Releasable
//! [`ExportKind::Pinning`]: crate::backend::ExportKind::Pinning

mod driver;

use crate::backend::vmm::VmmBackend;
#[cfg(doc)]
use crate::error::Error;
use crate::error::Result;
use crate::ids::DeviceId;

pub use driver::{DeviceGuard, HipDevice, HipDriver};

/// The HIP backend (see the module documentation).
pub type HipBackend = VmmBackend<HipDriver>;

impl VmmBackend<HipDriver> {
    /// Initialise the HIP runtime and count devices. Arenas use VMM where the device has it
    /// (see [`HipBackend::with_legacy_ipc`]).
    ///
    /// # Errors
    /// [`Error::Unavailable`] ("no HIP device: ...") when `hipInit` fails (no AMD GPU or
    /// driver: ROCm 5.2 answers `hipErrorInvalidDevice`), when devices cannot be counted, or
    /// when there is none.
    pub fn new() -> Result<HipBackend> {
        driver::init().map_err(|e| e.into_unavailable("no HIP device"))?;
        let version = driver::runtime_version()
            .map_err(|e| e.into_unavailable("could not read the HIP runtime version"))?;
        let count = driver::device_count().map_err(|e| e.into_unavailable("no HIP device"))?;
        VmmBackend::start(HipDriver { version }, count)
    }

    /// Use the legacy IPC path (`hipMalloc` arenas, 64-byte `hipIpcGetMemHandle` exports of
    /// kind [`ExportKind::Pinning`]) on every device, even where VMM works: for consumers that
    /// only open `hipIpc*` handles. Takes effect for devices not used yet (call it right after
    /// [`HipBackend::new`]).
    ///
    /// [`ExportKind::Pinning`]: crate::backend::ExportKind::Pinning
    #[must_use]
    pub fn with_legacy_ipc(mut self, legacy: bool) -> HipBackend {
        self.set_legacy_ipc(legacy);
        self
    }

    /// Whether [`HipBackend::new`] would succeed. Never panics.
    pub fn is_available() -> bool {
        HipBackend::new().is_ok()
    }

    /// The HIP runtime version as `hipRuntimeGetVersion` reports it (50221153 = ROCm 5.2).
    pub fn runtime_version(&self) -> i32 {
        self.driver().version
    }

    /// The calling thread's current HIP device: for tests that check the backend leaves the
    /// caller's device alone.
    ///
    /// # Errors
    /// [`Error::Backend`] if `hipGetDevice` fails.
    pub fn current_device(&self) -> Result<DeviceId> {
        driver::get_device().map_err(|e| e.into_error(-1, 0))
    }
}
