//! Every raw CUDA driver call of the CUDA backend: one small function per call.
//!
//! Each wrapper calls one `cudarc::driver::sys` function (libcuda, loaded at run time by
//! cudarc's `dynamic-loading`) and turns its `CUresult` into a [`DriverError`] that names the
//! call and carries the driver's own words. Most wrappers are the methods of [`CudaDriver`]'s
//! [`Driver`] implementation, whose `# Safety` contracts the trait states once and the VMM core
//! (`backend::vmm`) proves with its registries; the rest serve loading, contexts and tests.
//!
//! # Loading
//! cudarc panics when libcuda is missing (`culib()`) or when a symbol is missing (the first
//! call of that function: cudarc resolves every symbol lazily, one `OnceLock` per function).
//! [`load_library`] avoids both panics: it asks `is_culib_present()` first, then resolves up
//! front every symbol in [`SYMBOLS`] (the exact, versioned names cudarc's wrappers look up,
//! e.g. `cuMemGetInfo_v2`), and reports what is missing as an error instead.
//!
//! # CUresult values
//! cudarc declares `CUresult` as a Rust `enum` generated from one toolkit's headers. A driver
//! newer than those headers may return a code the enum lacks (CUDA 13.0 added
//! `CUDA_ERROR_CALL_REQUIRES_NEWER_DRIVER = 36` over 12.8), which would be an invalid enum
//! value in Rust. None of the calls below can return such a code for what we ask of them, and
//! every result goes straight through [`check`], which only compares it with
//! `CUDA_SUCCESS`; binding the newest toolkit the driver supports keeps the enum complete.

use std::ffi::c_void;
use std::marker::PhantomData;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr;

use cudarc::driver::sys;

use crate::backend::vmm::{
    driver_string, DeviceSupport, Driver, DriverError, DriverResult, Failure, LegacyIpc,
    StartFailures,
};
use crate::error::{Error, Result};
use crate::ids::DeviceId;

/// The backend's name in errors.
pub(super) const NAME: &str = "cuda";

use super::symbols::SYMBOLS;

/// The size of a legacy IPC handle (`CUipcMemHandle`, `CU_IPC_HANDLE_SIZE`).
const IPC_HANDLE_BYTES: usize = 64;

/// `Ok` for `CUDA_SUCCESS`, else the call's [`DriverError`] with the driver's own words.
fn check(call: &'static str, result: sys::CUresult) -> DriverResult<()> {
    match result {
        sys::CUresult::CUDA_SUCCESS => Ok(()),
        sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => Err(failed(call, Failure::OutOfMemory, result)),
        sys::CUresult::CUDA_ERROR_NOT_PERMITTED => Err(failed(call, Failure::NotPermitted, result)),
        sys::CUresult::CUDA_ERROR_NOT_SUPPORTED => Err(failed(call, Failure::NotSupported, result)),
        _ => Err(failed(call, Failure::Other, result)),
    }
}

/// The [`DriverError`] for `result`: `CUDA_ERROR_INVALID_VALUE: invalid argument`.
fn failed(call: &'static str, failure: Failure, result: sys::CUresult) -> DriverError {
    let code = format!("CUresult {}", result as u32);
    let words = (error_name(result), error_string(result));
    DriverError::in_words(NAME, call, failure, code, words)
}

/// Why libcuda could not be used.
#[derive(Debug, Clone, PartialEq, Eq)]
enum LoadError {
    /// No candidate library name could be opened.
    NotFound(Vec<String>),
    /// cudarc's loader panicked although the presence check passed.
    LoaderPanicked,
    /// The library lacks symbols the backend needs.
    MissingSymbols(Vec<&'static str>),
}

/// Load libcuda (once per process, by cudarc) and check that every symbol in [`SYMBOLS`]
/// resolves. Never panics on a machine without libcuda.
fn load_library() -> Result<(), LoadError> {
    // SAFETY: is_culib_present only dlopen()s candidate library names and closes them again;
    // running a found libcuda's initialisers is what loading the driver means.
    if !unsafe { sys::is_culib_present() } {
        let mut tried = cudarc::get_lib_name_candidates("cuda");
        let mut seen = std::collections::HashSet::new();
        tried.retain(|name| seen.insert(name.clone()));
        return Err(LoadError::NotFound(tried));
    }
    let lib = std::panic::catch_unwind(|| {
        // SAFETY: the library is present (checked above), so culib() opens it instead of
        // panicking; should it panic anyway, catch_unwind turns that into an error.
        unsafe { sys::culib() }
    })
    .map_err(|_| LoadError::LoaderPanicked)?;
    let missing: Vec<&'static str> = SYMBOLS
        .iter()
        .copied()
        .filter(|name| {
            // SAFETY: only asks dlsym whether the symbol exists; the pointer is neither called
            // nor dereferenced, and the Symbol is dropped at once.
            unsafe { lib.get::<*const c_void>(name.as_bytes()) }.is_err()
        })
        .collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(LoadError::MissingSymbols(missing))
    }
}

/// `cuGetErrorName`.
fn error_name(result: sys::CUresult) -> Option<String> {
    let mut name: *const std::ffi::c_char = ptr::null();
    // SAFETY: the out-pointer is a valid local; cuGetErrorName needs no initialisation.
    let r = unsafe { sys::cuGetErrorName(result, &mut name) };
    // SAFETY: on success the driver points `name` at a static NUL-terminated string.
    (r == sys::CUresult::CUDA_SUCCESS).then(|| unsafe { driver_string(name) })?
}

/// `cuGetErrorString`.
fn error_string(result: sys::CUresult) -> Option<String> {
    let mut text: *const std::ffi::c_char = ptr::null();
    // SAFETY: the out-pointer is a valid local; cuGetErrorString needs no initialisation.
    let r = unsafe { sys::cuGetErrorString(result, &mut text) };
    // SAFETY: on success the driver points `text` at a static NUL-terminated string.
    (r == sys::CUresult::CUDA_SUCCESS).then(|| unsafe { driver_string(text) })?
}

/// `cuDeviceGet`: the `CUdevice` of an ordinal.
pub(super) fn device_get(ordinal: DeviceId) -> DriverResult<sys::CUdevice> {
    let mut device: sys::CUdevice = 0;
    // SAFETY: the out-pointer is a valid local; the driver checks the ordinal.
    check("cuDeviceGet", unsafe {
        sys::cuDeviceGet(&mut device, ordinal)
    })?;
    Ok(device)
}

/// `cuDeviceGetAttribute`.
pub(super) fn device_attribute(
    device: sys::CUdevice,
    attribute: sys::CUdevice_attribute,
) -> DriverResult<i32> {
    let mut value = 0;
    // SAFETY: the out-pointer is a valid local; the driver checks device and attribute.
    check("cuDeviceGetAttribute", unsafe {
        sys::cuDeviceGetAttribute(&mut value, attribute, device)
    })?;
    Ok(value)
}

/// A `CUcontext` (here always a device's primary context, retained by the backend).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Context(sys::CUcontext);

// SAFETY: a CUcontext is an opaque driver handle that the driver lets any thread use (push,
// pop, release); Rust never dereferences it.
unsafe impl Send for Context {}
// SAFETY: as for Send: shared references only copy the handle value to pass it to the driver.
unsafe impl Sync for Context {}

/// `cuDevicePrimaryCtxRetain`: retain (and create if needed) the device's primary context,
/// the one the CUDA runtime and PyTorch use.
pub(super) fn primary_ctx_retain(device: sys::CUdevice) -> DriverResult<Context> {
    let mut ctx: sys::CUcontext = ptr::null_mut();
    // SAFETY: the out-pointer is a valid local; the driver checks the device.
    check("cuDevicePrimaryCtxRetain", unsafe {
        sys::cuDevicePrimaryCtxRetain(&mut ctx, device)
    })?;
    Ok(Context(ctx))
}

/// `cuDevicePrimaryCtxRelease`.
///
/// # Safety
/// The caller holds a retain of this device's primary context from [`primary_ctx_retain`]
/// and gives exactly that one back: it does not use the context afterwards.
pub(super) unsafe fn primary_ctx_release(device: sys::CUdevice) -> DriverResult<()> {
    // SAFETY: the caller gives back a retain it holds (see the function's contract).
    check("cuDevicePrimaryCtxRelease", unsafe {
        sys::cuDevicePrimaryCtxRelease_v2(device)
    })
}

/// `cuCtxGetCurrent`: this thread's current context as an integer (0 = none).
fn ctx_get_current() -> DriverResult<u64> {
    let mut ctx: sys::CUcontext = ptr::null_mut();
    // SAFETY: the out-pointer is a valid local; only reads this thread's context stack.
    check("cuCtxGetCurrent", unsafe { sys::cuCtxGetCurrent(&mut ctx) })?;
    Ok(ctx as usize as u64)
}

/// A context pushed on this thread's context stack (`cuCtxPushCurrent`), popped again
/// (`cuCtxPopCurrent`) when dropped, so the caller's current context is what it was.
#[derive(Debug)]
#[must_use = "the context is popped when the guard drops"]
pub struct CtxGuard {
    /// The context stack is per thread: the guard must drop on the thread that pushed.
    _not_send: PhantomData<*mut ()>,
}

impl CtxGuard {
    /// `cuCtxPushCurrent`.
    ///
    /// # Safety
    /// `ctx` is live: a primary context the backend retained and has not released.
    pub(super) unsafe fn push(ctx: Context) -> DriverResult<CtxGuard> {
        // SAFETY: the caller guarantees `ctx` is live; pushing only changes this thread's
        // context stack, and the guard's Drop pops it on the same thread (the guard is !Send).
        check("cuCtxPushCurrent", unsafe {
            sys::cuCtxPushCurrent_v2(ctx.0)
        })?;
        Ok(CtxGuard {
            _not_send: PhantomData,
        })
    }
}

impl Drop for CtxGuard {
    fn drop(&mut self) {
        let mut popped: sys::CUcontext = ptr::null_mut();
        // SAFETY: pops the context push() put on this thread's stack (the guard is !Send and
        // wrappers never leave other contexts pushed); the out-pointer is a valid local.
        let r = unsafe { sys::cuCtxPopCurrent_v2(&mut popped) };
        if let Err(e) = check("cuCtxPopCurrent", r) {
            tracing::error!(error = %e.message, "cuda: cuCtxPopCurrent failed");
        }
    }
}

/// The CUDA driver (libcuda through cudarc), loaded and initialised by `CudaBackend::new`.
#[derive(Debug)]
pub struct CudaDriver {
    /// `cuDriverGetVersion` (e.g. 13000).
    version: i32,
}

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

/// What the CUDA driver keeps per open device.
#[derive(Debug, Clone, Copy)]
pub struct CudaDevice {
    /// The device index.
    ordinal: DeviceId,
    /// The driver's device handle.
    cu_device: sys::CUdevice,
    /// The device's primary context, retained by the backend.
    ctx: Context,
    /// Whether arenas are created GPUDirect-RDMA capable.
    rdma_capable: bool,
}

/// The location of memory on device `ordinal`.
fn device_location(ordinal: DeviceId) -> sys::CUmemLocation {
    sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: ordinal,
    }
}

/// The handle types an arena is created exportable as: a POSIX fd, and a FABRIC handle too
/// when `fabric` is set (the enum is a bit set: `POSIX_FILE_DESCRIPTOR | FABRIC` = 1 | 8).
fn handle_types(fabric: bool) -> sys::CUmemAllocationHandleType {
    use sys::CUmemAllocationHandleType as H;
    let posix = H::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR.0;
    if fabric {
        H(posix | H::CU_MEM_HANDLE_TYPE_FABRIC.0)
    } else {
        H(posix)
    }
}

/// The properties of every arena: pinned device memory on `ordinal`, exportable as a POSIX
/// fd (and a FABRIC handle when `fabric` is set), GPUDirect-RDMA capable when the device
/// supports that for VMM memory (as PyTorch's expandable segments do, for UCX/NIXL transfers).
fn allocation_prop(
    ordinal: DeviceId,
    rdma_capable: bool,
    fabric: bool,
) -> sys::CUmemAllocationProp {
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: handle_types(fabric),
        location: device_location(ordinal),
        win32HandleMetaData: ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: u8::from(rdma_capable),
            usage: 0,
            reserved: [0; 4],
        },
    }
}

/// A `CUevent` from its integer form.
/// `CU_STREAM_LEGACY`, the stream the synchronous copies are ordered on.
const LEGACY: sys::CUstream = 1 as sys::CUstream;

/// The host copies queue on the legacy default stream (ordered as `cuMemcpyDtoH` /
/// `cuMemcpyHtoD` are) and then wait for it: a synchronous copy held the driver for its whole
/// length, so that a sleep's pinning of its next host buffer (`cuMemHostRegister`, on a
/// worker thread) waited for each copy and the two never overlapped (the H200 probe:
/// register + copy 0.68-0.77 s with synchronous copies, 0.38-0.70 s asynchronous, for a
/// 0.43 s register and a 0.31 s copy; `bench/results/h200-2026-12-02-pin-overlap.md`).
fn wait_on_legacy(call: &'static str, queued: sys::CUresult) -> DriverResult<()> {
    check(call, queued)?;
    // SAFETY: the legacy default stream of the current context (made current by the caller).
    check("cuStreamSynchronize", unsafe {
        sys::cuStreamSynchronize(LEGACY)
    })
}

fn event_ptr(raw: u64) -> sys::CUevent {
    raw as usize as sys::CUevent
}

impl Driver for CudaDriver {
    const NAME: &'static str = NAME;
    const VENDOR: &'static str = "CUDA";
    /// `cuMemAlloc` arenas shared with 64-byte `cuIpcGetMemHandle` handles, only when asked
    /// for (`with_legacy_ipc`, config `legacy_ipc=1`): no fallback for a device without VMM.
    const LEGACY_IPC: Option<LegacyIpc> = Some(LegacyIpc {
        handle_bytes: IPC_HANDLE_BYTES,
        handle_name: "cuIpc",
        granularity: 2 << 20,
        fallback: false,
    });
    const START_FAILURES: StartFailures = StartFailures {
        init: "the CUDA driver did not initialise",
        version: "could not read the CUDA driver version",
        count: "could not count CUDA devices",
    };

    /// Load libcuda through cudarc (see the module documentation: never panics).
    fn load() -> Result<()> {
        load_library().map_err(load_error)
    }

    /// `cuInit(0)`; every other call comes after it.
    fn init() -> DriverResult<()> {
        // SAFETY: load() succeeded (the library and every symbol are there); cuInit takes only
        // flags (0) and may be called any number of times.
        check("cuInit", unsafe { sys::cuInit(0) })
    }

    /// `cuDriverGetVersion`: e.g. 13000 for CUDA 13.0.
    fn read_version() -> DriverResult<i32> {
        let mut version = 0;
        // SAFETY: the out-pointer is a valid local.
        let r = unsafe { sys::cuDriverGetVersion(&mut version) };
        check("cuDriverGetVersion", r).map(|()| version)
    }

    /// `cuDeviceGetCount`.
    fn count_devices() -> DriverResult<i32> {
        let mut count = 0;
        // SAFETY: the out-pointer is a valid local.
        let r = unsafe { sys::cuDeviceGetCount(&mut count) };
        check("cuDeviceGetCount", r).map(|()| count)
    }

    fn started(version: i32) -> CudaDriver {
        CudaDriver { version }
    }

    fn version(&self) -> i32 {
        self.version
    }

    fn current_on_thread(&self) -> DriverResult<u64> {
        ctx_get_current()
    }

    /// The device handle, its retained primary context, the RDMA flag.
    type Device = CudaDevice;
    /// The primary context pushed, popped when dropped.
    type Current = CtxGuard;

    fn version_text(&self) -> String {
        format!(
            "driver {}.{}",
            self.version / 1000,
            self.version % 1000 / 10
        )
    }

    /// `cuDeviceGet` + `cuDeviceGetAttribute` for VMM, POSIX-fd handles, RDMA on VMM memory
    /// and FABRIC handles (an older driver that does not know the RDMA or FABRIC attribute
    /// means no).
    fn device_support(&self, ordinal: DeviceId) -> DriverResult<DeviceSupport> {
        use sys::CUdevice_attribute as A;
        let device = device_get(ordinal)?;
        let flag = |attribute| device_attribute(device, attribute).map(|value| value != 0);
        Ok(DeviceSupport {
            vmm: Some(flag(
                A::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
            )?),
            posix_fd: Some(flag(
                A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
            )?),
            rdma: flag(A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED)
                .unwrap_or(false),
            fabric: flag(A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED).unwrap_or(false),
        })
    }

    /// `cuDeviceGet` + `cuDevicePrimaryCtxRetain`.
    fn open_device(&self, ordinal: DeviceId, rdma: bool) -> DriverResult<CudaDevice> {
        let cu_device = device_get(ordinal)?;
        Ok(CudaDevice {
            ordinal,
            cu_device,
            ctx: primary_ctx_retain(cu_device)?,
            rdma_capable: rdma,
        })
    }

    unsafe fn close_device(&self, device: CudaDevice) -> DriverResult<()> {
        // SAFETY: gives back the one retain open_device took (the trait's contract).
        unsafe { primary_ctx_release(device.cu_device) }
    }

    unsafe fn make_current(&self, device: &CudaDevice) -> DriverResult<CtxGuard> {
        // SAFETY: an open device's primary context is retained (the trait's contract).
        unsafe { CtxGuard::push(device.ctx) }
    }

    /// `cuMemGetAllocationGranularity` (MINIMUM) for the arena properties (POSIX fd: the
    /// FABRIC handle type does not change the granularity of device memory).
    fn granularity(&self, device: &CudaDevice) -> DriverResult<u64> {
        let prop = allocation_prop(device.ordinal, device.rdma_capable, false);
        let mut granularity = 0usize;
        // SAFETY: the out-pointer is a valid local and `prop` a valid, initialised struct.
        check("cuMemGetAllocationGranularity", unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut granularity,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        })?;
        Ok(granularity as u64)
    }

    /// `cuMemGetInfo` of the current context's device.
    fn mem_info(&self) -> DriverResult<(u64, u64)> {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: both out-pointers are valid locals.
        check("cuMemGetInfo", unsafe {
            sys::cuMemGetInfo_v2(&mut free, &mut total)
        })?;
        Ok((free as u64, total as u64))
    }

    /// `cuCtxSynchronize` on the current context.
    fn synchronize(&self) -> DriverResult<()> {
        // SAFETY: no arguments; waits for the current context's work (the driver reports an
        // error when no context is current).
        check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
    }

    /// `cuMemCreate` (POSIX fd, or POSIX fd | FABRIC).
    fn mem_create(&self, device: &CudaDevice, bytes: usize, fabric: bool) -> DriverResult<u64> {
        let prop = allocation_prop(device.ordinal, device.rdma_capable, fabric);
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: the out-pointer is a valid local and `prop` a valid, initialised struct; the
        // driver checks the size.
        check("cuMemCreate", unsafe {
            sys::cuMemCreate(&mut handle, bytes, &prop, 0)
        })?;
        Ok(handle)
    }

    unsafe fn mem_release(&self, handle: u64) -> DriverResult<()> {
        // SAFETY: the caller gives back a handle it owns, once.
        check("cuMemRelease", unsafe { sys::cuMemRelease(handle) })
    }

    /// `cuMemAddressReserve` (no address hint, no flags).
    fn address_reserve(&self, bytes: usize, alignment: usize) -> DriverResult<u64> {
        let mut base: sys::CUdeviceptr = 0;
        // SAFETY: the out-pointer is a valid local; no address hint (0), no flags.
        check("cuMemAddressReserve", unsafe {
            sys::cuMemAddressReserve(&mut base, bytes, alignment, 0, 0)
        })?;
        Ok(base)
    }

    unsafe fn address_free(&self, base: u64, bytes: usize) -> DriverResult<()> {
        // SAFETY: the caller frees its own, unmapped reservation, once.
        check("cuMemAddressFree", unsafe {
            sys::cuMemAddressFree(base, bytes)
        })
    }

    unsafe fn map(&self, base: u64, bytes: usize, handle: u64) -> DriverResult<()> {
        // SAFETY: the caller guarantees the range and the handle; offset 0, no flags.
        check("cuMemMap", unsafe {
            sys::cuMemMap(base, bytes, 0, handle, 0)
        })
    }

    unsafe fn unmap(&self, base: u64, bytes: usize) -> DriverResult<()> {
        // SAFETY: the caller unmaps its own mapping, no longer in use.
        check("cuMemUnmap", unsafe { sys::cuMemUnmap(base, bytes) })
    }

    /// `cuMemSetAccess` with one read-write descriptor per device.
    unsafe fn set_access(&self, base: u64, bytes: usize, devices: &[DeviceId]) -> DriverResult<()> {
        let descs: Vec<sys::CUmemAccessDesc> = devices
            .iter()
            .map(|&ordinal| sys::CUmemAccessDesc {
                location: device_location(ordinal),
                flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            })
            .collect();
        // SAFETY: the caller guarantees the mapping; `descs` holds descs.len() valid,
        // initialised descriptors and outlives the call.
        check("cuMemSetAccess", unsafe {
            sys::cuMemSetAccess(base, bytes, descs.as_ptr(), descs.len())
        })
    }

    /// `cuDeviceCanAccessPeer(&can, peer, owner)`: whether `peer` can access `owner`'s memory.
    fn can_access_peer(&self, owner: DeviceId, peer: DeviceId) -> DriverResult<bool> {
        let (owner, peer) = (device_get(owner)?, device_get(peer)?);
        let mut can: std::ffi::c_int = 0;
        // SAFETY: the out-pointer is a valid local; both devices came from cuDeviceGet.
        check("cuDeviceCanAccessPeer", unsafe {
            sys::cuDeviceCanAccessPeer(&mut can, peer, owner)
        })?;
        Ok(can != 0)
    }

    unsafe fn export_fd(&self, handle: u64) -> DriverResult<OwnedFd> {
        const CALL: &str = "cuMemExportToShareableHandle";
        let mut fd: std::ffi::c_int = -1;
        // SAFETY: the caller guarantees the handle; for POSIX_FILE_DESCRIPTOR the driver writes
        // one int through the pointer, which points at a valid local int.
        check(CALL, unsafe {
            sys::cuMemExportToShareableHandle(
                ptr::addr_of_mut!(fd).cast::<c_void>(),
                handle,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        })?;
        if fd < 0 {
            return Err(failed(
                CALL,
                Failure::Other,
                sys::CUresult::CUDA_ERROR_UNKNOWN,
            ));
        }
        // SAFETY: on success the driver returned a new fd that nothing else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    fn import_fd(&self, fd: BorrowedFd<'_>) -> DriverResult<u64> {
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // For POSIX_FILE_DESCRIPTOR the "OS handle" is the fd's value cast to a pointer.
        let os_handle = fd.as_raw_fd() as isize as *mut c_void;
        // SAFETY: the out-pointer is a valid local; the fd is open for the call (borrowed), the
        // driver only reads it (dup semantics) and checks that it is a CUDA shareable handle.
        check("cuMemImportFromShareableHandle", unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut handle,
                os_handle,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        })?;
        Ok(handle)
    }

    /// `cuMemAlloc` in the current context (the device's primary context).
    fn legacy_alloc(&self, bytes: usize) -> DriverResult<u64> {
        let mut base: sys::CUdeviceptr = 0;
        // SAFETY: the out-pointer is a valid local; the driver checks the size.
        check("cuMemAlloc", unsafe {
            sys::cuMemAlloc_v2(&mut base, bytes)
        })?;
        Ok(base)
    }

    /// `cuMemFree`.
    unsafe fn legacy_free(&self, base: u64) -> DriverResult<()> {
        // SAFETY: the caller frees its own allocation, once, no longer in use.
        check("cuMemFree", unsafe { sys::cuMemFree_v2(base) })
    }

    /// `cuIpcGetMemHandle`: 64 bytes.
    unsafe fn ipc_get_handle(&self, base: u64) -> DriverResult<Vec<u8>> {
        let mut handle = sys::CUipcMemHandle {
            reserved: [0; IPC_HANDLE_BYTES],
        };
        // SAFETY: the out-pointer is a valid local handle; the caller guarantees the allocation.
        check("cuIpcGetMemHandle", unsafe {
            sys::cuIpcGetMemHandle(&mut handle, base)
        })?;
        Ok(handle.reserved.iter().map(|&b| b as u8).collect())
    }

    /// `cuIpcOpenMemHandle` with `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`, in the current context.
    fn ipc_open_handle(&self, bytes: &[u8]) -> DriverResult<u64> {
        let mut handle = sys::CUipcMemHandle {
            reserved: [0; IPC_HANDLE_BYTES],
        };
        for (dst, &src) in handle.reserved.iter_mut().zip(bytes.iter()) {
            *dst = src as std::ffi::c_char;
        }
        let mut base: sys::CUdeviceptr = 0;
        let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as std::ffi::c_uint;
        // SAFETY: the out-pointer is a valid local; the handle is passed by value and the
        // driver checks that it names an exported allocation.
        check("cuIpcOpenMemHandle", unsafe {
            sys::cuIpcOpenMemHandle_v2(&mut base, handle, flags)
        })?;
        Ok(base)
    }

    /// `cuIpcCloseMemHandle`.
    unsafe fn ipc_close_handle(&self, base: u64) -> DriverResult<()> {
        // SAFETY: the caller closes its own opened handle, once, no longer in use.
        check("cuIpcCloseMemHandle", unsafe {
            sys::cuIpcCloseMemHandle(base)
        })
    }

    /// `cuEventCreate` with `CU_EVENT_DISABLE_TIMING`, in the current context.
    fn event_create(&self) -> DriverResult<u64> {
        let mut event: sys::CUevent = ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: the out-pointer is a valid local; the flag is a valid CUevent_flags value.
        check("cuEventCreate", unsafe {
            sys::cuEventCreate(&mut event, flags)
        })?;
        Ok(event as usize as u64)
    }

    /// `cuEventRecord`; the special streams are `CU_STREAM_LEGACY` (1) and
    /// `CU_STREAM_PER_THREAD` (2).
    unsafe fn event_record(&self, event: u64, stream: u64) -> DriverResult<()> {
        let stream = stream as usize as sys::CUstream;
        // SAFETY: the caller guarantees both handles.
        check("cuEventRecord", unsafe {
            sys::cuEventRecord(event_ptr(event), stream)
        })
    }

    unsafe fn event_query(&self, event: u64) -> DriverResult<bool> {
        // SAFETY: the caller guarantees the event.
        match unsafe { sys::cuEventQuery(event_ptr(event)) } {
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            r => check("cuEventQuery", r).map(|()| true),
        }
    }

    unsafe fn event_destroy(&self, event: u64) -> DriverResult<()> {
        // SAFETY: the caller destroys its own live event, once.
        check("cuEventDestroy", unsafe {
            sys::cuEventDestroy_v2(event_ptr(event))
        })
    }

    /// A copy from the host, done when it returns (the source may be reused or freed then);
    /// see `wait_on_legacy`.
    unsafe fn memcpy_htod(&self, dst: u64, src: &[u8]) -> DriverResult<()> {
        // SAFETY: `src` is valid for reads of src.len() bytes until the wait below returns;
        // the caller guarantees the destination range.
        let queued =
            unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.as_ptr().cast(), src.len(), LEGACY) };
        wait_on_legacy("cuMemcpyHtoDAsync", queued)
    }

    /// A copy to the host, done when it returns; see `wait_on_legacy`.
    unsafe fn memcpy_dtoh(&self, dst: &mut [u8], src: u64) -> DriverResult<()> {
        // SAFETY: `dst` is valid for writes of dst.len() bytes and borrowed mutably until the
        // wait below returns; the caller guarantees the source range.
        let queued =
            unsafe { sys::cuMemcpyDtoHAsync_v2(dst.as_mut_ptr().cast(), src, dst.len(), LEGACY) };
        wait_on_legacy("cuMemcpyDtoHAsync", queued)
    }

    /// `cuMemcpyDtoD` (device to device: no host synchronisation, the caller synchronizes).
    unsafe fn memcpy_dtod(&self, dst: u64, src: u64, bytes: usize) -> DriverResult<()> {
        // SAFETY: the caller guarantees both device ranges (mapped, accessible, disjoint).
        check("cuMemcpyDtoD", unsafe {
            sys::cuMemcpyDtoD_v2(dst, src, bytes)
        })
    }

    unsafe fn memset_d8(&self, dst: u64, value: u8, bytes: usize) -> DriverResult<()> {
        // SAFETY: the caller guarantees the destination range.
        check("cuMemsetD8", unsafe {
            sys::cuMemsetD8_v2(dst, value, bytes)
        })
    }

    /// `cuStreamCreate(CU_STREAM_NON_BLOCKING)` in the current context.
    fn stream_create(&self) -> DriverResult<u64> {
        let mut stream: sys::CUstream = ptr::null_mut();
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        // SAFETY: the out-pointer is a valid local; the flag is a valid CUstream_flags value.
        check("cuStreamCreate", unsafe {
            sys::cuStreamCreate(&mut stream, flags)
        })?;
        Ok(stream as usize as u64)
    }

    unsafe fn stream_destroy(&self, stream: u64) -> DriverResult<()> {
        // SAFETY: the caller destroys its own live stream, once.
        check("cuStreamDestroy", unsafe {
            sys::cuStreamDestroy_v2(stream as usize as sys::CUstream)
        })
    }

    /// `cuMemcpyDtoDAsync` on `stream`.
    unsafe fn memcpy_dtod_async(
        &self,
        dst: u64,
        src: u64,
        bytes: usize,
        stream: u64,
    ) -> DriverResult<()> {
        // SAFETY: the caller guarantees both device ranges and the stream.
        check("cuMemcpyDtoDAsync", unsafe {
            sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, stream as usize as sys::CUstream)
        })
    }

    /// `cuMemHostAlloc` (`CU_MEMHOSTALLOC_PORTABLE`).
    fn host_alloc(&self, bytes: usize) -> DriverResult<u64> {
        let mut p: *mut c_void = ptr::null_mut();
        // SAFETY: `p` is a valid out-pointer; the driver page-locks `bytes` new bytes for the
        // current context (made current by the caller), portable to every context.
        check("cuMemHostAlloc", unsafe {
            sys::cuMemHostAlloc(&mut p, bytes, sys::CU_MEMHOSTALLOC_PORTABLE)
        })?;
        Ok(p as u64)
    }

    /// `cuMemHostRegister` (`CU_MEMHOSTREGISTER_PORTABLE`).
    unsafe fn host_register(&self, ptr: u64, bytes: usize) -> DriverResult<()> {
        // SAFETY: the caller guarantees the range stays mapped until it is unregistered.
        check("cuMemHostRegister", unsafe {
            sys::cuMemHostRegister_v2(ptr as *mut c_void, bytes, sys::CU_MEMHOSTREGISTER_PORTABLE)
        })
    }

    /// `cuMemHostUnregister`.
    unsafe fn host_unregister(&self, ptr: u64) -> DriverResult<()> {
        // SAFETY: the caller unregisters its own registration, unused, once.
        check("cuMemHostUnregister", unsafe {
            sys::cuMemHostUnregister(ptr as *mut c_void)
        })
    }

    /// `cuMemFreeHost`.
    unsafe fn host_free(&self, ptr: u64) -> DriverResult<()> {
        // SAFETY: the caller frees its own memory from cuMemHostAlloc, unused, once.
        check("cuMemFreeHost", unsafe {
            sys::cuMemFreeHost(ptr as *mut c_void)
        })
    }
}

#[cfg(test)]
mod tests {
    /// Every `sys::cu*` function this file calls is in [`super::SYMBOLS`], so a libcuda that
    /// lacks one is refused at load instead of panicking in cudarc at the first call.
    #[test]
    fn every_called_symbol_is_checked_at_load() {
        let source = include_str!("driver.rs");
        let mut missing = Vec::new();
        for (i, _) in source.match_indices("sys::cu") {
            let name: String = source[i + 5..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            let called = source[i + 5 + name.len()..].starts_with('(');
            if called && name != "culib" && !super::SYMBOLS.contains(&name.as_str()) {
                missing.push(name);
            }
        }
        assert!(missing.is_empty(), "not in SYMBOLS: {missing:?}");
    }
}
