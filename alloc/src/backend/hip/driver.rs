//! Every raw HIP runtime call of the HIP backend: one small function per call.
//!
//! Each wrapper calls one `hip_sys::hiprt` function (libamdhip64, linked at build time by
//! hip-sys's build script) and turns its `hipError_t` into [`HipError`], which names the call.
//! Wrappers whose arguments the runtime cannot check on its own (events, streams, allocation
//! handles, device address ranges) are `unsafe fn`s with a `# Safety` section; the backend
//! (`super`) proves those preconditions with its registries of live arenas, mappings and
//! events.
//!
//! # Linking and ROCm versions
//! hip-sys 0.1.2 (hip-runtime-sys 0.1.2) ships bindings pre-generated from the ROCm 5.4
//! headers and links `libamdhip64` directly (no run-time loading): a binary built with the
//! `hip` feature needs libamdhip64 at load time, and must be rebuilt against the ROCm it runs
//! on (the soname changes: `.so.5` for ROCm 5, `.so.6`, `.so.7`). Every function used below is
//! exported by ROCm 5.2's libamdhip64 (Debian bookworm's `libamdhip64-5`, checked with `nm -D`):
//! the VMM calls since `hip_5.1`, the rest since `hip_4.2`.
//!
//! What the bindings do *not* cover for every ROCm version, and how it is handled:
//! - `hipDeviceAttributeVirtualMemoryManagementSupported` (89 in the 5.4 headers the bindings
//!   come from) does not exist in ROCm 5.2's headers: on a runtime older than 5.4 the value 89
//!   may mean another attribute. [`MIN_RUNTIME_FOR_VMM_ATTRIBUTE`] gates the query; below it the
//!   backend probes VMM support with `hipMemGetAllocationGranularity` instead (see `super`).
//! - `hipError_t` is a Rust `enum` of the 5.4 codes. A newer runtime could return a code the
//!   enum lacks (ROCm 6 added texture/graph codes), which would be an invalid enum value in
//!   Rust. None of the calls below returns such a code for what we ask of them (the same
//!   position as the cuda backend's `CUresult`); every result goes straight through [`check`],
//!   which only compares it with `hipSuccess`.
//! - The special stream `hipStreamPerThread` (`(hipStream_t)2`) is a C macro, absent from the
//!   bindings; it is passed through as the integer 2 like any stream handle.

use std::ffi::{c_int, c_void, CStr};
use std::marker::PhantomData;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr;

use hip_sys::hiprt as sys;

use crate::backend::DeviceId;
use crate::error::Error;

/// The backend's name in errors.
pub(super) const BACKEND: &str = "hip";

/// The size of a legacy IPC handle (`hipIpcMemHandle_t`, `HIP_IPC_HANDLE_SIZE`).
pub(super) const IPC_HANDLE_BYTES: usize = 64;

/// `hipRuntimeGetVersion` from which the bindings' device-attribute numbering (ROCm 5.4) is
/// trusted for `hipDeviceAttributeVirtualMemoryManagementSupported`.
pub(super) const MIN_RUNTIME_FOR_VMM_ATTRIBUTE: i32 = 50_400_000;

/// A failed runtime call: which call, and the `hipError_t` it returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct HipError {
    /// The runtime call, e.g. `hipMemCreate`.
    pub(super) call: &'static str,
    /// What it returned.
    pub(super) result: sys::hipError_t,
}

impl HipError {
    /// Whether the runtime ran out of device memory.
    pub(super) fn is_out_of_memory(&self) -> bool {
        self.result == sys::hipError_t::hipErrorOutOfMemory
    }

    /// Whether the runtime said the operation is not supported.
    pub(super) fn is_not_supported(&self) -> bool {
        self.result == sys::hipError_t::hipErrorNotSupported
    }

    /// The runtime's own words: `hipErrorInvalidValue: invalid argument`.
    pub(super) fn message(&self) -> String {
        let code = self.result as i32;
        match (error_name(self.result), error_string(self.result)) {
            (Some(name), Some(text)) if name != text => format!("{name}: {text}"),
            (Some(name), _) => name,
            (None, Some(text)) => format!("hipError_t {code}: {text}"),
            (None, None) => format!("hipError_t {code}"),
        }
    }

    /// The crate error: [`Error::DriverOutOfMemory`] for `hipErrorOutOfMemory` (with the
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

    /// The error as [`Error::Unavailable`] (set-up failures: `hipInit`, no device...).
    pub(super) fn into_unavailable(self, what: &str) -> Error {
        Error::Unavailable(format!("{what}: {} failed: {}", self.call, self.message()))
    }
}

/// `Ok` for `hipSuccess`, else the call's [`HipError`].
fn check(call: &'static str, result: sys::hipError_t) -> Result<(), HipError> {
    if result == sys::hipError_t::hipSuccess {
        Ok(())
    } else {
        Err(HipError { call, result })
    }
}

/// `hipGetErrorName`.
fn error_name(result: sys::hipError_t) -> Option<String> {
    // SAFETY: takes the code by value and returns a pointer to a static string (or null).
    let name = unsafe { sys::hipGetErrorName(result) };
    if name.is_null() {
        return None;
    }
    // SAFETY: a non-null result points at a static NUL-terminated string.
    Some(
        unsafe { CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned(),
    )
}

/// `hipGetErrorString`.
fn error_string(result: sys::hipError_t) -> Option<String> {
    // SAFETY: takes the code by value and returns a pointer to a static string (or null).
    let text = unsafe { sys::hipGetErrorString(result) };
    if text.is_null() {
        return None;
    }
    // SAFETY: a non-null result points at a static NUL-terminated string.
    Some(
        unsafe { CStr::from_ptr(text) }
            .to_string_lossy()
            .into_owned(),
    )
}

/// `hipInit(0)`. Without an AMD GPU ROCm 5.2 answers `hipErrorInvalidDevice`.
pub(super) fn init() -> Result<(), HipError> {
    // SAFETY: hipInit takes only flags (0) and may be called any number of times.
    check("hipInit", unsafe { sys::hipInit(0) })
}

/// `hipRuntimeGetVersion`: e.g. 50221153 for ROCm 5.2 (major * 10^7 + minor * 10^5 + patch).
pub(super) fn runtime_version() -> Result<i32, HipError> {
    let mut version = 0;
    // SAFETY: the out-pointer is a valid local.
    check("hipRuntimeGetVersion", unsafe {
        sys::hipRuntimeGetVersion(&mut version)
    })?;
    Ok(version)
}

/// `hipGetDeviceCount`.
pub(super) fn device_count() -> Result<i32, HipError> {
    let mut count = 0;
    // SAFETY: the out-pointer is a valid local.
    check("hipGetDeviceCount", unsafe {
        sys::hipGetDeviceCount(&mut count)
    })?;
    Ok(count)
}

/// `hipDeviceGetAttribute`.
pub(super) fn device_attribute(
    ordinal: DeviceId,
    attribute: sys::hipDeviceAttribute_t,
) -> Result<i32, HipError> {
    let mut value = 0;
    // SAFETY: the out-pointer is a valid local; the runtime checks device and attribute.
    check("hipDeviceGetAttribute", unsafe {
        sys::hipDeviceGetAttribute(&mut value, attribute, ordinal)
    })?;
    Ok(value)
}

/// `hipGetDevice`: this thread's current device.
pub(super) fn get_device() -> Result<DeviceId, HipError> {
    let mut device = 0;
    // SAFETY: the out-pointer is a valid local; only reads this thread's current device.
    check("hipGetDevice", unsafe { sys::hipGetDevice(&mut device) })?;
    Ok(device)
}

/// `hipSetDevice`: make `ordinal` this thread's current device.
pub(super) fn set_device(ordinal: DeviceId) -> Result<(), HipError> {
    // SAFETY: only changes this thread's current device; the runtime checks the ordinal.
    check("hipSetDevice", unsafe { sys::hipSetDevice(ordinal) })
}

/// The device made current with `hipSetDevice`, the caller's device restored when dropped, so
/// the calling thread's current device after a backend call is what it was before.
#[derive(Debug)]
#[must_use = "the caller's device is restored when the guard drops"]
pub(super) struct DeviceGuard {
    /// The device that was current before, restored on drop (None: it already was `ordinal`).
    previous: Option<DeviceId>,
    /// The current device is per thread: the guard must drop on the thread that set it.
    _not_send: PhantomData<*mut ()>,
}

impl DeviceGuard {
    /// `hipGetDevice` then `hipSetDevice(ordinal)` when it differs.
    pub(super) fn set(ordinal: DeviceId) -> Result<DeviceGuard, HipError> {
        let previous = get_device()?;
        if previous == ordinal {
            return Ok(DeviceGuard {
                previous: None,
                _not_send: PhantomData,
            });
        }
        set_device(ordinal)?;
        Ok(DeviceGuard {
            previous: Some(previous),
            _not_send: PhantomData,
        })
    }
}

impl Drop for DeviceGuard {
    fn drop(&mut self) {
        if let Some(previous) = self.previous {
            if let Err(e) = set_device(previous) {
                tracing::error!(device = previous, error = %e.message(), "hip: restoring the caller's device failed");
            }
        }
    }
}

/// `hipDeviceSynchronize` on the current device (set one first).
pub(super) fn device_synchronize() -> Result<(), HipError> {
    // SAFETY: no arguments; waits for the current device's work.
    check("hipDeviceSynchronize", unsafe {
        sys::hipDeviceSynchronize()
    })
}

/// `hipMemGetInfo`: (free, total) bytes of the current device.
pub(super) fn mem_get_info() -> Result<(u64, u64), HipError> {
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: both out-pointers are valid locals.
    check("hipMemGetInfo", unsafe {
        sys::hipMemGetInfo(&mut free, &mut total)
    })?;
    Ok((free as u64, total as u64))
}

/// The location of memory on device `ordinal`.
fn device_location(ordinal: DeviceId) -> sys::hipMemLocation {
    sys::hipMemLocation {
        type_: sys::hipMemLocationType::hipMemLocationTypeDevice,
        id: ordinal,
    }
}

/// The properties of every VMM arena: pinned device memory on `ordinal`, exportable as a
/// POSIX fd.
pub(super) fn allocation_prop(ordinal: DeviceId) -> sys::hipMemAllocationProp {
    sys::hipMemAllocationProp {
        type_: sys::hipMemAllocationType::hipMemAllocationTypePinned,
        requestedHandleType: sys::hipMemAllocationHandleType::hipMemHandleTypePosixFileDescriptor,
        location: device_location(ordinal),
        win32HandleMetaData: ptr::null_mut(),
        allocFlags: sys::hipMemAllocationProp__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
        },
    }
}

/// `hipMemGetAllocationGranularity` (minimum) for `prop`.
pub(super) fn mem_get_allocation_granularity(
    prop: &sys::hipMemAllocationProp,
) -> Result<u64, HipError> {
    let mut granularity = 0usize;
    // SAFETY: the out-pointer is a valid local and `prop` a valid, initialised struct.
    check("hipMemGetAllocationGranularity", unsafe {
        sys::hipMemGetAllocationGranularity(
            &mut granularity,
            prop,
            sys::hipMemAllocationGranularity_flags::hipMemAllocationGranularityMinimum,
        )
    })?;
    Ok(granularity as u64)
}

/// An allocation handle (`hipMemGenericAllocationHandle_t`, a pointer) from its integer form.
fn handle_ptr(handle: u64) -> sys::hipMemGenericAllocationHandle_t {
    handle as usize as sys::hipMemGenericAllocationHandle_t
}

/// A device address from its integer form.
fn dptr(address: u64) -> *mut c_void {
    address as usize as *mut c_void
}

/// `hipMemCreate`: physical memory of `bytes` with `prop`; returns the allocation handle.
pub(super) fn mem_create(bytes: usize, prop: &sys::hipMemAllocationProp) -> Result<u64, HipError> {
    let mut handle: sys::hipMemGenericAllocationHandle_t = ptr::null_mut();
    // SAFETY: the out-pointer is a valid local and `prop` a valid, initialised struct; the
    // runtime checks the size.
    check("hipMemCreate", unsafe {
        sys::hipMemCreate(&mut handle, bytes, prop, 0)
    })?;
    Ok(handle as usize as u64)
}

/// `hipMemRelease`.
///
/// # Safety
/// `handle` is a live allocation handle this process owns (from [`mem_create`] or
/// [`mem_import_fd`]), released once.
pub(super) unsafe fn mem_release(handle: u64) -> Result<(), HipError> {
    // SAFETY: the caller gives back a handle it owns, once.
    check("hipMemRelease", unsafe {
        sys::hipMemRelease(handle_ptr(handle))
    })
}

/// `hipMemAddressReserve`: `bytes` of device virtual address space aligned to `alignment`.
pub(super) fn mem_address_reserve(bytes: usize, alignment: usize) -> Result<u64, HipError> {
    let mut base: *mut c_void = ptr::null_mut();
    // SAFETY: the out-pointer is a valid local; no address hint (null), no flags.
    check("hipMemAddressReserve", unsafe {
        sys::hipMemAddressReserve(&mut base, bytes, alignment, ptr::null_mut(), 0)
    })?;
    Ok(base as usize as u64)
}

/// `hipMemAddressFree`.
///
/// # Safety
/// `base..base + bytes` is a whole range this process reserved with [`mem_address_reserve`],
/// nothing is mapped in it any more, and it is freed once.
pub(super) unsafe fn mem_address_free(base: u64, bytes: usize) -> Result<(), HipError> {
    // SAFETY: the caller frees its own, unmapped reservation, once.
    check("hipMemAddressFree", unsafe {
        sys::hipMemAddressFree(dptr(base), bytes)
    })
}

/// `hipMemMap`: map the whole of `handle` (offset 0) at `base`.
///
/// # Safety
/// `base..base + bytes` lies in a reservation of this process with nothing mapped there, and
/// `handle` is a live allocation handle.
pub(super) unsafe fn mem_map(base: u64, bytes: usize, handle: u64) -> Result<(), HipError> {
    // SAFETY: the caller guarantees the range and the handle; offset 0, no flags.
    check("hipMemMap", unsafe {
        sys::hipMemMap(dptr(base), bytes, 0, handle_ptr(handle), 0)
    })
}

/// `hipMemUnmap`.
///
/// # Safety
/// `base..base + bytes` is a whole mapping made with [`mem_map`] that no queued or running
/// device work uses any more (the caller synchronized).
pub(super) unsafe fn mem_unmap(base: u64, bytes: usize) -> Result<(), HipError> {
    // SAFETY: the caller unmaps its own mapping, no longer in use.
    check("hipMemUnmap", unsafe {
        sys::hipMemUnmap(dptr(base), bytes)
    })
}

/// `hipMemSetAccess`: read-write access from device `ordinal`.
///
/// # Safety
/// `base..base + bytes` is mapped by this process (with [`mem_map`]).
pub(super) unsafe fn mem_set_access(
    base: u64,
    bytes: usize,
    ordinal: DeviceId,
) -> Result<(), HipError> {
    let desc = sys::hipMemAccessDesc {
        location: device_location(ordinal),
        flags: sys::hipMemAccessFlags::hipMemAccessFlagsProtReadWrite,
    };
    // SAFETY: the caller guarantees the mapping; `desc` is one valid, initialised descriptor
    // (count 1).
    check("hipMemSetAccess", unsafe {
        sys::hipMemSetAccess(dptr(base), bytes, &desc, 1)
    })
}

/// `hipMemExportToShareableHandle` as a POSIX fd, owned by the caller.
///
/// # Safety
/// `handle` is a live allocation handle created exportable as a POSIX fd.
pub(super) unsafe fn mem_export_fd(handle: u64) -> Result<OwnedFd, HipError> {
    let mut fd: c_int = -1;
    // SAFETY: the caller guarantees the handle; for hipMemHandleTypePosixFileDescriptor the
    // runtime writes one int through the pointer, which points at a valid local int.
    check("hipMemExportToShareableHandle", unsafe {
        sys::hipMemExportToShareableHandle(
            ptr::addr_of_mut!(fd).cast::<c_void>(),
            handle_ptr(handle),
            sys::hipMemAllocationHandleType::hipMemHandleTypePosixFileDescriptor,
            0,
        )
    })?;
    if fd < 0 {
        return Err(HipError {
            call: "hipMemExportToShareableHandle",
            result: sys::hipError_t::hipErrorUnknown,
        });
    }
    // SAFETY: on success the runtime returned a new fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `hipMemImportFromShareableHandle` from a POSIX fd (the fd stays the caller's); returns a
/// new allocation handle that this process owns.
pub(super) fn mem_import_fd(fd: BorrowedFd<'_>) -> Result<u64, HipError> {
    let mut handle: sys::hipMemGenericAllocationHandle_t = ptr::null_mut();
    // As in CUDA (and PyTorch's hipified expandable segments), the "OS handle" of a POSIX fd
    // is the fd's value cast to a pointer.
    let os_handle = fd.as_raw_fd() as isize as *mut c_void;
    // SAFETY: the out-pointer is a valid local; the fd is open for the call (borrowed), the
    // runtime only reads it and checks that it is a HIP shareable handle.
    check("hipMemImportFromShareableHandle", unsafe {
        sys::hipMemImportFromShareableHandle(
            &mut handle,
            os_handle,
            sys::hipMemAllocationHandleType::hipMemHandleTypePosixFileDescriptor,
        )
    })?;
    Ok(handle as usize as u64)
}

/// `hipMalloc` on the current device (legacy-IPC arenas): returns the device address.
pub(super) fn malloc(bytes: usize) -> Result<u64, HipError> {
    let mut base: *mut c_void = ptr::null_mut();
    // SAFETY: the out-pointer is a valid local; the runtime checks the size.
    check("hipMalloc", unsafe { sys::hipMalloc(&mut base, bytes) })?;
    Ok(base as usize as u64)
}

/// `hipFree`.
///
/// # Safety
/// `base` came from [`malloc`], no queued or running device work uses it (the caller
/// synchronized), no importer of ours still has it open, and it is freed once.
pub(super) unsafe fn free(base: u64) -> Result<(), HipError> {
    // SAFETY: the caller frees its own allocation, once, no longer in use.
    check("hipFree", unsafe { sys::hipFree(dptr(base)) })
}

/// `hipIpcGetMemHandle`: the 64-byte legacy IPC handle of a `hipMalloc` allocation.
///
/// # Safety
/// `base` is the start of a live allocation from [`malloc`].
pub(super) unsafe fn ipc_get_mem_handle(base: u64) -> Result<Vec<u8>, HipError> {
    let mut handle = sys::hipIpcMemHandle_t {
        reserved: [0; IPC_HANDLE_BYTES],
    };
    // SAFETY: the out-pointer is a valid local handle; the caller guarantees the allocation.
    check("hipIpcGetMemHandle", unsafe {
        sys::hipIpcGetMemHandle(&mut handle, dptr(base))
    })?;
    Ok(handle.reserved.iter().map(|&b| b as u8).collect())
}

/// `hipIpcOpenMemHandle` (with `hipIpcMemLazyEnablePeerAccess`) on the current device:
/// returns the address of the opened memory in this process.
pub(super) fn ipc_open_mem_handle(bytes: &[u8; IPC_HANDLE_BYTES]) -> Result<u64, HipError> {
    let mut handle = sys::hipIpcMemHandle_t {
        reserved: [0; IPC_HANDLE_BYTES],
    };
    for (dst, &src) in handle.reserved.iter_mut().zip(bytes.iter()) {
        *dst = src as std::ffi::c_char;
    }
    let mut base: *mut c_void = ptr::null_mut();
    // SAFETY: the out-pointer is a valid local; the handle is passed by value and the runtime
    // checks that it names an exported allocation.
    check("hipIpcOpenMemHandle", unsafe {
        sys::hipIpcOpenMemHandle(&mut base, handle, sys::hipIpcMemLazyEnablePeerAccess)
    })?;
    Ok(base as usize as u64)
}

/// `hipIpcCloseMemHandle`.
///
/// # Safety
/// `base` came from [`ipc_open_mem_handle`], no queued or running device work uses it, and it
/// is closed once.
pub(super) unsafe fn ipc_close_mem_handle(base: u64) -> Result<(), HipError> {
    // SAFETY: the caller closes its own opened handle, once, no longer in use.
    check("hipIpcCloseMemHandle", unsafe {
        sys::hipIpcCloseMemHandle(dptr(base))
    })
}

/// A `hipEvent_t` from its integer form.
fn event_ptr(raw: u64) -> sys::hipEvent_t {
    raw as usize as sys::hipEvent_t
}

/// `hipEventCreateWithFlags(hipEventDisableTiming)` on the current device (set one first);
/// returns the event as an integer.
pub(super) fn event_create() -> Result<u64, HipError> {
    let mut event: sys::hipEvent_t = ptr::null_mut();
    // SAFETY: the out-pointer is a valid local; the flag is a valid event flag.
    check("hipEventCreateWithFlags", unsafe {
        sys::hipEventCreateWithFlags(&mut event, sys::hipEventDisableTiming)
    })?;
    Ok(event as usize as u64)
}

/// `hipEventRecord` on `stream` (0 = the null stream of the current device).
///
/// # Safety
/// `event` is live (from [`event_create`], not destroyed) and `stream` is 0,
/// `hipStreamPerThread` (2) or a live stream of the event's device.
pub(super) unsafe fn event_record(event: u64, stream: u64) -> Result<(), HipError> {
    // SAFETY: the caller guarantees both handles.
    check("hipEventRecord", unsafe {
        sys::hipEventRecord(event_ptr(event), stream as usize as sys::hipStream_t)
    })
}

/// `hipEventQuery`: `Ok(true)` when done, `Ok(false)` when not ready, else the error.
///
/// # Safety
/// `event` is live (from [`event_create`], not destroyed).
pub(super) unsafe fn event_query(event: u64) -> Result<bool, HipError> {
    // SAFETY: the caller guarantees the event.
    let r = unsafe { sys::hipEventQuery(event_ptr(event)) };
    if r == sys::hipError_t::hipErrorNotReady {
        return Ok(false);
    }
    check("hipEventQuery", r)?;
    Ok(true)
}

/// `hipEventDestroy`.
///
/// # Safety
/// `event` is live (from [`event_create`]) and destroyed once.
pub(super) unsafe fn event_destroy(event: u64) -> Result<(), HipError> {
    // SAFETY: the caller destroys its own live event, once.
    check("hipEventDestroy", unsafe {
        sys::hipEventDestroy(event_ptr(event))
    })
}

/// `hipMemcpyHtoD`: copy `src` to device address `dst` (synchronous for pageable memory).
///
/// # Safety
/// `dst..dst + src.len()` is device memory mapped by this process that nothing else uses
/// concurrently (and not host memory that Rust code owns).
pub(super) unsafe fn memcpy_htod(dst: u64, src: &[u8]) -> Result<(), HipError> {
    // SAFETY: `src` is valid for reads of src.len() bytes (the runtime only reads through the
    // `*mut` the binding declares); the caller guarantees the destination range.
    check("hipMemcpyHtoD", unsafe {
        sys::hipMemcpyHtoD(dptr(dst), src.as_ptr().cast_mut().cast(), src.len())
    })
}

/// `hipMemcpyDtoH`: copy from device address `src` into `dst`.
///
/// # Safety
/// `src..src + dst.len()` is device memory mapped by this process.
pub(super) unsafe fn memcpy_dtoh(dst: &mut [u8], src: u64) -> Result<(), HipError> {
    // SAFETY: `dst` is valid for writes of dst.len() bytes and borrowed mutably for the
    // (synchronous) copy; the caller guarantees the source range.
    check("hipMemcpyDtoH", unsafe {
        sys::hipMemcpyDtoH(dst.as_mut_ptr().cast(), dptr(src), dst.len())
    })
}

/// `hipMemsetD8`: set `bytes` bytes at device address `dst` to `value`.
///
/// # Safety
/// `dst..dst + bytes` is device memory mapped by this process that nothing else uses
/// concurrently (and not host memory that Rust code owns).
pub(super) unsafe fn memset_d8(dst: u64, value: u8, bytes: usize) -> Result<(), HipError> {
    // SAFETY: the caller guarantees the destination range.
    check("hipMemsetD8", unsafe {
        sys::hipMemsetD8(dptr(dst), value, bytes)
    })
}
