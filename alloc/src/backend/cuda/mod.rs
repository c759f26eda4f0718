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
//! An arena is `cuMemCreate` (pinned, on the device, exportable as a POSIX fd, and
//! GPUDirect-RDMA capable where the device supports that for VMM memory, as PyTorch's
//! expandable segments do) + `cuMemAddressReserve` + `cuMemMap` + `cuMemSetAccess`.
//! Exports are `cuMemExportToShareableHandle` fds; imports `cuMemImportFromShareableHandle`.
//! There is no legacy IPC path: byte handles are refused.

mod driver;

use crate::backend::vmm::VmmBackend;
use crate::error::{Error, Result};

use driver::LoadError;
pub use driver::{CtxGuard, CudaDevice, CudaDriver};

/// The CUDA backend (see the module documentation).
pub type CudaBackend = VmmBackend<CudaDriver>;

/// The error for a failed library load.
fn load_error(e: LoadError) -> Error {
    match e {
        LoadError::NotFound(tried) => Error::Unavailable(format!(
            "libcuda not found (tried {}): is the NVIDIA driver installed and on the loader path?",
            tried.join(", ")
        )),
        LoadError::LoaderPanicked => {
            Error::Unavailable("libcuda could not be loaded (cudarc's loader panicked)".into())
        }
        LoadError::MissingSymbols(missing) => Error::Unavailable(format!(
            "libcuda lacks driver symbols the cuda backend needs (driver too old?): {}",
            missing.join(", ")
        )),
    }
}

impl VmmBackend<CudaDriver> {
    /// Load libcuda, initialise the driver and count devices.
    ///
    /// Retains no context yet: that happens on the first call for each device.
    ///
    /// # Errors
    /// [`Error::Unavailable`] when libcuda is missing or lacks a needed symbol, when `cuInit`
    /// fails (no usable driver or device), or when there is no device.
    pub fn new() -> Result<CudaBackend> {
        driver::load_library().map_err(load_error)?;
        driver::init().map_err(|e| e.into_unavailable("the CUDA driver did not initialise"))?;
        let version = driver::driver_version()
            .map_err(|e| e.into_unavailable("could not read the CUDA driver version"))?;
        let count = driver::device_count()
            .map_err(|e| e.into_unavailable("could not count CUDA devices"))?;
        VmmBackend::start(CudaDriver { version }, count)
    }

    /// Whether [`CudaBackend::new`] would succeed: libcuda loads, the driver initialises and
    /// there is at least one device. Never panics.
    pub fn is_available() -> bool {
        CudaBackend::new().is_ok()
    }

    /// The driver's CUDA version as `cuDriverGetVersion` reports it (13000 = CUDA 13.0).
    pub fn driver_version(&self) -> i32 {
        self.driver().version
    }

    /// The calling thread's current CUDA context as an integer (0 = none): for tests that
    /// check the backend leaves the caller's context alone.
    ///
    /// # Errors
    /// [`Error::Backend`] if `cuCtxGetCurrent` fails.
    pub fn current_context(&self) -> Result<u64> {
        driver::ctx_get_current().map_err(|e| e.into_error(-1, 0))
    }
}
