//! Every raw CUDA driver call of the CUDA backend: one small function per call.
//!
//! Each wrapper calls one `cudarc::driver::sys` function (libcuda, loaded at run time by
//! cudarc's `dynamic-loading`) and turns its `CUresult` into [`CuError`], which names the call.
//! Wrappers whose arguments the driver cannot check on its own (contexts, events, streams,
//! allocation handles, device address ranges) are `unsafe fn`s with a `# Safety` section; the
//! backend (`super`) proves those preconditions with its registries of live arenas, mappings
//! and events.
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

use std::ffi::{c_void, CStr};
use std::marker::PhantomData;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr;

use cudarc::driver::sys;

use crate::backend::DeviceId;
use crate::error::Error;

/// The backend's name in errors.
pub(super) const BACKEND: &str = "cuda";

/// The symbols the wrappers below make cudarc resolve, exactly as cudarc looks them up.
///
/// Keep in step with the wrappers: [`load_library`] checks them all before the first call.
pub(super) const SYMBOLS: &[&str] = &[
    "cuGetErrorName",
    "cuGetErrorString",
    "cuInit",
    "cuDriverGetVersion",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetAttribute",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxPushCurrent_v2",
    "cuCtxPopCurrent_v2",
    "cuCtxGetCurrent",
    "cuCtxSynchronize",
    "cuMemGetInfo_v2",
    "cuMemGetAllocationGranularity",
    "cuMemCreate",
    "cuMemRelease",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemSetAccess",
    "cuMemExportToShareableHandle",
    "cuMemImportFromShareableHandle",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventDestroy_v2",
    "cuMemcpyHtoD_v2",
    "cuMemcpyDtoH_v2",
    "cuMemsetD8_v2",
];

/// A failed driver call: which call, and the `CUresult` it returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct CuError {
    /// The driver call, e.g. `cuMemCreate`.
    pub(super) call: &'static str,
    /// What it returned.
    pub(super) result: sys::CUresult,
}

impl CuError {
    /// Whether the driver ran out of device memory.
    pub(super) fn is_out_of_memory(&self) -> bool {
        self.result == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY
    }

    /// The driver's own words: `CUDA_ERROR_INVALID_VALUE: invalid argument`.
    pub(super) fn message(&self) -> String {
        let code = self.result as u32;
        match (error_name(self.result), error_string(self.result)) {
            (Some(name), Some(text)) => format!("{name}: {text}"),
            (Some(name), None) => name,
            (None, Some(text)) => format!("CUresult {code}: {text}"),
            (None, None) => format!("CUresult {code}"),
        }
    }

    /// The crate error: [`Error::DriverOutOfMemory`] for `CUDA_ERROR_OUT_OF_MEMORY` (with the
    /// device and the bytes asked for), [`Error::Backend`] otherwise.
    pub(super) fn into_error(self, device: DeviceId, bytes: u64) -> Error {
        if self.is_out_of_memory() {
            Error::DriverOutOfMemory {
                backend: BACKEND,
                call: self.call,
                device,
                bytes,
            }
        } else {
            Error::Backend {
                backend: BACKEND,
                call: self.call,
                message: self.message(),
            }
        }
    }

    /// The error as [`Error::Unavailable`] (set-up failures: `cuInit`, no device...).
    pub(super) fn into_unavailable(self, what: &str) -> Error {
        Error::Unavailable(format!("{what}: {} failed: {}", self.call, self.message()))
    }
}

/// `Ok` for `CUDA_SUCCESS`, else the call's [`CuError`].
fn check(call: &'static str, result: sys::CUresult) -> Result<(), CuError> {
    if result == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(CuError { call, result })
    }
}

/// Why libcuda could not be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum LoadError {
    /// No candidate library name could be opened.
    NotFound(Vec<String>),
    /// cudarc's loader panicked although the presence check passed.
    LoaderPanicked,
    /// The library lacks symbols the backend needs.
    MissingSymbols(Vec<&'static str>),
}

/// Load libcuda (once per process, by cudarc) and check that every symbol in [`SYMBOLS`]
/// resolves. Never panics on a machine without libcuda.
pub(super) fn load_library() -> Result<(), LoadError> {
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
    if r != sys::CUresult::CUDA_SUCCESS || name.is_null() {
        return None;
    }
    // SAFETY: on success the driver points `name` at a static NUL-terminated string.
    Some(
        unsafe { CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned(),
    )
}

/// `cuGetErrorString`.
fn error_string(result: sys::CUresult) -> Option<String> {
    let mut text: *const std::ffi::c_char = ptr::null();
    // SAFETY: the out-pointer is a valid local; cuGetErrorString needs no initialisation.
    let r = unsafe { sys::cuGetErrorString(result, &mut text) };
    if r != sys::CUresult::CUDA_SUCCESS || text.is_null() {
        return None;
    }
    // SAFETY: on success the driver points `text` at a static NUL-terminated string.
    Some(
        unsafe { CStr::from_ptr(text) }
            .to_string_lossy()
            .into_owned(),
    )
}

/// `cuInit(0)`. Call only after [`load_library`] succeeded (as every wrapper below).
pub(super) fn init() -> Result<(), CuError> {
    // SAFETY: cuInit takes only flags (0) and may be called any number of times.
    check("cuInit", unsafe { sys::cuInit(0) })
}

/// `cuDriverGetVersion`: e.g. 13000 for CUDA 13.0.
pub(super) fn driver_version() -> Result<i32, CuError> {
    let mut version = 0;
    // SAFETY: the out-pointer is a valid local.
    check("cuDriverGetVersion", unsafe {
        sys::cuDriverGetVersion(&mut version)
    })?;
    Ok(version)
}

/// `cuDeviceGetCount`.
pub(super) fn device_count() -> Result<i32, CuError> {
    let mut count = 0;
    // SAFETY: the out-pointer is a valid local.
    check("cuDeviceGetCount", unsafe {
        sys::cuDeviceGetCount(&mut count)
    })?;
    Ok(count)
}

/// `cuDeviceGet`: the `CUdevice` of an ordinal.
pub(super) fn device_get(ordinal: DeviceId) -> Result<sys::CUdevice, CuError> {
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
) -> Result<i32, CuError> {
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

impl Context {
    /// The handle as an integer (for logs and tests).
    pub(super) fn as_u64(self) -> u64 {
        self.0 as usize as u64
    }
}

/// `cuDevicePrimaryCtxRetain`: retain (and create if needed) the device's primary context,
/// the one the CUDA runtime and PyTorch use.
pub(super) fn primary_ctx_retain(device: sys::CUdevice) -> Result<Context, CuError> {
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
pub(super) unsafe fn primary_ctx_release(device: sys::CUdevice) -> Result<(), CuError> {
    // SAFETY: the caller gives back a retain it holds (see the function's contract).
    check("cuDevicePrimaryCtxRelease", unsafe {
        sys::cuDevicePrimaryCtxRelease_v2(device)
    })
}

/// `cuCtxGetCurrent`: this thread's current context as an integer (0 = none).
pub(super) fn ctx_get_current() -> Result<u64, CuError> {
    let mut ctx: sys::CUcontext = ptr::null_mut();
    // SAFETY: the out-pointer is a valid local; only reads this thread's context stack.
    check("cuCtxGetCurrent", unsafe { sys::cuCtxGetCurrent(&mut ctx) })?;
    Ok(ctx as usize as u64)
}

/// A context pushed on this thread's context stack (`cuCtxPushCurrent`), popped again
/// (`cuCtxPopCurrent`) when dropped, so the caller's current context is what it was.
#[derive(Debug)]
#[must_use = "the context is popped when the guard drops"]
pub(super) struct CtxGuard {
    /// The context stack is per thread: the guard must drop on the thread that pushed.
    _not_send: PhantomData<*mut ()>,
}

impl CtxGuard {
    /// `cuCtxPushCurrent`.
    ///
    /// # Safety
    /// `ctx` is live: a primary context the backend retained and has not released.
    pub(super) unsafe fn push(ctx: Context) -> Result<CtxGuard, CuError> {
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
            tracing::error!(error = %e.message(), "cuda: cuCtxPopCurrent failed");
        }
    }
}

/// `cuCtxSynchronize` on the current context (push one first).
pub(super) fn ctx_synchronize() -> Result<(), CuError> {
    // SAFETY: no arguments; waits for the current context's work (the driver reports an
    // error when no context is current).
    check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
}

/// `cuMemGetInfo`: (free, total) bytes of the current context's device.
pub(super) fn mem_get_info() -> Result<(u64, u64), CuError> {
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: both out-pointers are valid locals.
    check("cuMemGetInfo", unsafe {
        sys::cuMemGetInfo_v2(&mut free, &mut total)
    })?;
    Ok((free as u64, total as u64))
}

/// The location of memory on device `ordinal`.
fn device_location(ordinal: DeviceId) -> sys::CUmemLocation {
    sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: ordinal,
    }
}

/// The properties of every arena: pinned device memory on `ordinal`, exportable as a POSIX
/// fd, GPUDirect-RDMA capable when the device supports that for VMM memory.
pub(super) fn allocation_prop(ordinal: DeviceId, rdma_capable: bool) -> sys::CUmemAllocationProp {
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes:
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
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

/// `cuMemGetAllocationGranularity` (MINIMUM) for `prop`.
pub(super) fn mem_get_allocation_granularity(
    prop: &sys::CUmemAllocationProp,
) -> Result<u64, CuError> {
    let mut granularity = 0usize;
    // SAFETY: the out-pointer is a valid local and `prop` a valid, initialised struct.
    check("cuMemGetAllocationGranularity", unsafe {
        sys::cuMemGetAllocationGranularity(
            &mut granularity,
            prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )
    })?;
    Ok(granularity as u64)
}

/// `cuMemCreate`: physical memory of `bytes` with `prop`; returns the allocation handle.
pub(super) fn mem_create(bytes: usize, prop: &sys::CUmemAllocationProp) -> Result<u64, CuError> {
    let mut handle: sys::CUmemGenericAllocationHandle = 0;
    // SAFETY: the out-pointer is a valid local and `prop` a valid, initialised struct; the
    // driver checks the size.
    check("cuMemCreate", unsafe {
        sys::cuMemCreate(&mut handle, bytes, prop, 0)
    })?;
    Ok(handle)
}

/// `cuMemRelease`.
///
/// # Safety
/// `handle` is a live allocation handle this process owns (from [`mem_create`] or
/// [`mem_import_fd`]), released once.
pub(super) unsafe fn mem_release(handle: u64) -> Result<(), CuError> {
    // SAFETY: the caller gives back a handle it owns, once.
    check("cuMemRelease", unsafe { sys::cuMemRelease(handle) })
}

/// `cuMemAddressReserve`: `bytes` of device virtual address space aligned to `alignment`.
pub(super) fn mem_address_reserve(bytes: usize, alignment: usize) -> Result<u64, CuError> {
    let mut base: sys::CUdeviceptr = 0;
    // SAFETY: the out-pointer is a valid local; no address hint (0), no flags.
    check("cuMemAddressReserve", unsafe {
        sys::cuMemAddressReserve(&mut base, bytes, alignment, 0, 0)
    })?;
    Ok(base)
}

/// `cuMemAddressFree`.
///
/// # Safety
/// `base..base + bytes` is a whole range this process reserved with [`mem_address_reserve`],
/// nothing is mapped in it any more, and it is freed once.
pub(super) unsafe fn mem_address_free(base: u64, bytes: usize) -> Result<(), CuError> {
    // SAFETY: the caller frees its own, unmapped reservation, once.
    check("cuMemAddressFree", unsafe {
        sys::cuMemAddressFree(base, bytes)
    })
}

/// `cuMemMap`: map the whole of `handle` (offset 0) at `base`.
///
/// # Safety
/// `base..base + bytes` lies in a reservation of this process with nothing mapped there, and
/// `handle` is a live allocation handle.
pub(super) unsafe fn mem_map(base: u64, bytes: usize, handle: u64) -> Result<(), CuError> {
    // SAFETY: the caller guarantees the range and the handle; offset 0, no flags.
    check("cuMemMap", unsafe {
        sys::cuMemMap(base, bytes, 0, handle, 0)
    })
}

/// `cuMemUnmap`.
///
/// # Safety
/// `base..base + bytes` is a whole mapping made with [`mem_map`] that no queued or running
/// device work uses any more (the caller synchronized).
pub(super) unsafe fn mem_unmap(base: u64, bytes: usize) -> Result<(), CuError> {
    // SAFETY: the caller unmaps its own mapping, no longer in use.
    check("cuMemUnmap", unsafe { sys::cuMemUnmap(base, bytes) })
}

/// `cuMemSetAccess`: read-write access from device `ordinal`.
///
/// # Safety
/// `base..base + bytes` is mapped by this process (with [`mem_map`]).
pub(super) unsafe fn mem_set_access(
    base: u64,
    bytes: usize,
    ordinal: DeviceId,
) -> Result<(), CuError> {
    let desc = sys::CUmemAccessDesc {
        location: device_location(ordinal),
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    // SAFETY: the caller guarantees the mapping; `desc` is one valid, initialised descriptor
    // (count 1).
    check("cuMemSetAccess", unsafe {
        sys::cuMemSetAccess(base, bytes, &desc, 1)
    })
}

/// `cuMemExportToShareableHandle` as a POSIX fd, owned by the caller.
///
/// # Safety
/// `handle` is a live allocation handle created exportable as a POSIX fd.
pub(super) unsafe fn mem_export_fd(handle: u64) -> Result<OwnedFd, CuError> {
    let mut fd: std::ffi::c_int = -1;
    // SAFETY: the caller guarantees the handle; for POSIX_FILE_DESCRIPTOR the driver writes
    // one int through the pointer, which points at a valid local int.
    check("cuMemExportToShareableHandle", unsafe {
        sys::cuMemExportToShareableHandle(
            ptr::addr_of_mut!(fd).cast::<c_void>(),
            handle,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        )
    })?;
    if fd < 0 {
        return Err(CuError {
            call: "cuMemExportToShareableHandle",
            result: sys::CUresult::CUDA_ERROR_UNKNOWN,
        });
    }
    // SAFETY: on success the driver returned a new fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `cuMemImportFromShareableHandle` from a POSIX fd (the fd stays the caller's); returns a
/// new allocation handle that this process owns.
pub(super) fn mem_import_fd(fd: BorrowedFd<'_>) -> Result<u64, CuError> {
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

/// A `CUevent` from its integer form.
fn event_ptr(raw: u64) -> sys::CUevent {
    raw as usize as sys::CUevent
}

/// `cuEventCreate` with `CU_EVENT_DISABLE_TIMING`, in the current context (push one first);
/// returns the event as an integer.
pub(super) fn event_create() -> Result<u64, CuError> {
    let mut event: sys::CUevent = ptr::null_mut();
    // SAFETY: the out-pointer is a valid local; the flag is a valid CUevent_flags value.
    check("cuEventCreate", unsafe {
        sys::cuEventCreate(
            &mut event,
            sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32,
        )
    })?;
    Ok(event as usize as u64)
}

/// `cuEventRecord` on `stream` (0 = the legacy default stream of the current context).
///
/// # Safety
/// `event` is live (from [`event_create`], not destroyed) and `stream` is 0, one of the
/// special handles `CU_STREAM_LEGACY` (1) / `CU_STREAM_PER_THREAD` (2), or a live stream of
/// the event's context.
pub(super) unsafe fn event_record(event: u64, stream: u64) -> Result<(), CuError> {
    // SAFETY: the caller guarantees both handles.
    check("cuEventRecord", unsafe {
        sys::cuEventRecord(event_ptr(event), stream as usize as sys::CUstream)
    })
}

/// `cuEventQuery`: `Ok(true)` when done, `Ok(false)` when not ready, else the error.
///
/// # Safety
/// `event` is live (from [`event_create`], not destroyed).
pub(super) unsafe fn event_query(event: u64) -> Result<bool, CuError> {
    // SAFETY: the caller guarantees the event.
    let r = unsafe { sys::cuEventQuery(event_ptr(event)) };
    if r == sys::CUresult::CUDA_ERROR_NOT_READY {
        return Ok(false);
    }
    check("cuEventQuery", r)?;
    Ok(true)
}

/// `cuEventDestroy`.
///
/// # Safety
/// `event` is live (from [`event_create`]) and destroyed once.
pub(super) unsafe fn event_destroy(event: u64) -> Result<(), CuError> {
    // SAFETY: the caller destroys its own live event, once.
    check("cuEventDestroy", unsafe {
        sys::cuEventDestroy_v2(event_ptr(event))
    })
}

/// `cuMemcpyHtoD`: copy `src` to device address `dst` (synchronous for pageable memory).
///
/// # Safety
/// `dst..dst + src.len()` is device memory mapped by this process that nothing else uses
/// concurrently (and not host memory that Rust code owns).
pub(super) unsafe fn memcpy_htod(dst: u64, src: &[u8]) -> Result<(), CuError> {
    // SAFETY: `src` is valid for reads of src.len() bytes; the caller guarantees the
    // destination range.
    check("cuMemcpyHtoD", unsafe {
        sys::cuMemcpyHtoD_v2(dst, src.as_ptr().cast(), src.len())
    })
}

/// `cuMemcpyDtoH`: copy from device address `src` into `dst`.
///
/// # Safety
/// `src..src + dst.len()` is device memory mapped by this process.
pub(super) unsafe fn memcpy_dtoh(dst: &mut [u8], src: u64) -> Result<(), CuError> {
    // SAFETY: `dst` is valid for writes of dst.len() bytes and borrowed mutably for the
    // (synchronous) copy; the caller guarantees the source range.
    check("cuMemcpyDtoH", unsafe {
        sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), src, dst.len())
    })
}

/// `cuMemsetD8`: set `bytes` bytes at device address `dst` to `value`.
///
/// # Safety
/// `dst..dst + bytes` is device memory mapped by this process that nothing else uses
/// concurrently (and not host memory that Rust code owns).
pub(super) unsafe fn memset_d8(dst: u64, value: u8, bytes: usize) -> Result<(), CuError> {
    // SAFETY: the caller guarantees the destination range.
    check("cuMemsetD8", unsafe {
        sys::cuMemsetD8_v2(dst, value, bytes)
    })
}
