//! The CUDA backend: the VMM core ([`crate::backend::vmm`]) on the CUDA driver.
//!
//! [`CudaBackend`] is [`VmmBackend`]`<`[`CudaDriver`]`>`: registries, per-device state,
//! teardown, copies and `Drop` are the core's; every raw driver call lives in `driver` (cudarc
//! `driver::sys`, libcuda loaded at run time). This module adds what is CUDA's alone: loading
//! the library, and the context query the tests use.
//!
//! # Loading
//! [`CudaBackend::new`] loads libcuda through cudarc after checking it is there (cudarc
//! panics otherwise), checks that every symbol the backend uses resolves (cudarc would panic
//! at the first call of a missing one), then runs `cuInit` and counts devices. A machine
//! without the driver or a GPU gets [`Error::Unavailable`], never a panic, so the crate
//! builds and its non-GPU tests run anywhere. [`CudaBackend::is_available`] asks the same
//! without keeping anything.
//!
//! # Contexts
//! The backend never creates contexts and never leaves one current. Each device's *primary*
//! context (the one the CUDA runtime and PyTorch use) is retained on the first call for that
//! device and released when the backend drops. Every call that needs a context pushes that
//! primary context and pops it again when done. Per device the backend caches the `CUdevice`,
//! the retained context and the VMM allocation granularity (MINIMUM, for the exact properties
//! arenas use).
//!
//! # Streams
//! A [`crate::backend::StreamId`] is the caller's `CUstream`: 0 (the legacy default stream),
//! 1/2 (`CU_STREAM_LEGACY`/`CU_STREAM_PER_THREAD`) or a live stream of the device's primary
//! context.
//!
//! # Memory
//! An arena is `cuMemCreate` (pinned, on the device, exportable as a POSIX fd, and as a
//! FABRIC handle too where the device reports `CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED`
//! and the driver permits it (config `fabric_handles`), and GPUDirect-RDMA capable where the
//! device supports that for VMM memory, as PyTorch's expandable segments do) +
//! `cuMemAddressReserve` + `cuMemMap` + `cuMemSetAccess` (the device and every device that
//! `cuDeviceCanAccessPeer` says can reach it). Exports are `cuMemExportToShareableHandle`
//! fds; imports `cuMemImportFromShareableHandle`.
//!
//! Asked for (`CudaBackend::new()?.with_legacy_ipc(true)`, config `legacy_ipc=1`), arenas are
//! `cuMemAlloc` instead (2 MiB granularity), exported as 64-byte `cuIpcGetMemHandle` handles
//! of kind `Pinning` (CUDA documents `cuMemFree` of exported memory before every importer's
//! `cuIpcCloseMemHandle` as undefined behaviour, so such arenas are recycled, never freed),
//! imported with `cuIpcOpenMemHandle` (lazy peer access), closed with `cuIpcCloseMemHandle`.
//! That is what UCX's cuda_ipc transport opens on hosts without FABRIC handles (no IMEX
//! channel); these arenas cannot sleep. Unlike HIP, a device without VMM does not fall back
//! to this path on its own.

mod driver;
mod symbols;

use crate::backend::vmm::VmmBackend;
#[cfg(doc)]
use crate::error::Error;

pub use driver::{CtxGuard, CudaDevice, CudaDriver};

/// The CUDA backend (see the module documentation): `CudaBackend::new()` loads libcuda,
/// initialises the driver and counts devices; `driver_version()` is `cuDriverGetVersion`;
/// `current_on_thread()` is `cuCtxGetCurrent`.
pub type CudaBackend = VmmBackend<CudaDriver>;
