//! The HIP backend: the VMM core ([`crate::backend::vmm`]) on the HIP runtime, with the
//! legacy `hipIpc*` path where VMM is not available or asked for.
//!
//! [`HipBackend`] is [`VmmBackend`]`<`[`HipDriver`]`>`: registries, per-device state,
//! teardown, copies and `Drop` are the core's; every raw runtime call lives in `driver`
//! (hip-sys, libamdhip64 linked at build time: see `driver`'s documentation for the ROCm
//! versions and what the bindings lack). This module adds what is HIP's alone: start-up
//! and the current-device query the tests use.
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
//! The legacy path is used when `HipBackend::with_legacy_ipc(true)` (the core's, shared with
//! CUDA; config key `legacy_ipc=1`) asks for it (for peers
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

pub use driver::{DeviceGuard, HipDevice, HipDriver};

/// The HIP backend (see the module documentation): `HipBackend::new()` runs `hipInit` and
/// counts devices; `driver_version()` is `hipRuntimeGetVersion`; `current_on_thread()` is
/// `hipGetDevice`.
pub type HipBackend = VmmBackend<HipDriver>;
