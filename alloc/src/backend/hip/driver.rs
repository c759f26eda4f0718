//! Every raw HIP runtime call of the HIP backend: one small function per call.
//!
//! Each wrapper calls one `hip_sys::hiprt` function (libamdhip64, linked at build time by
//! hip-sys's build script) and turns its `hipError_t` into a [`DriverError`] that names the
//! call and carries the runtime's own words. Most wrappers are the methods of [`HipDriver`]'s
//! [`Driver`] implementation, the legacy IPC calls (`hipMalloc`, `hipIpc*`) included; the trait
//! states their `# Safety` contracts once and the VMM core (`backend::vmm`) proves them.
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
//!   backend probes VMM support with `hipMemGetAllocationGranularity` instead (see `backend::vmm`).
//! - `hipError_t` is a Rust `enum` of the 5.4 codes. A newer runtime could return a code the
//!   enum lacks (ROCm 6 added texture/graph codes), which would be an invalid enum value in
//!   Rust. None of the calls below returns such a code for what we ask of them (the same
//!   position as the cuda backend's `CUresult`); every result goes straight through [`check`],
//!   which only compares it with `hipSuccess`.
//! - The special stream `hipStreamPerThread` (`(hipStream_t)2`) is a C macro, absent from the
//!   bindings; it is passed through as the integer 2 like any stream handle.

use std::ffi::{c_int, c_void};
use std::marker::PhantomData;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr;

use hip_sys::hiprt as sys;

use crate::backend::vmm::{
    driver_string, DeviceSupport, Driver, DriverError, DriverResult, Failure, LegacyIpc,
    StartFailures,
};
use crate::ids::DeviceId;

/// The backend's name in errors.
pub(super) const NAME: &str = "hip";

/// The size of a legacy IPC handle (`hipIpcMemHandle_t`, `HIP_IPC_HANDLE_SIZE`).
const IPC_HANDLE_BYTES: usize = 64;

/// `hipRuntimeGetVersion` from which the bindings' device-attribute numbering (ROCm 5.4) is
/// trusted for `hipDeviceAttributeVirtualMemoryManagementSupported`.
const MIN_RUNTIME_FOR_VMM_ATTRIBUTE: i32 = 50_400_000;

/// `Ok` for `hipSuccess`, else the call's [`DriverError`] with the runtime's own words
/// (`hipErrorInvalidValue: invalid argument`).
fn check(call: &'static str, result: sys::hipError_t) -> DriverResult<()> {
    use sys::hipError_t as E;
    let failure = match result {
        E::hipSuccess => return Ok(()),
        E::hipErrorOutOfMemory => Failure::OutOfMemory,
        E::hipErrorNotSupported => Failure::NotSupported,
        _ => Failure::Other,
    };
    let code = format!("hipError_t {}", result as i32);
    let words = (error_name(result), error_string(result));
    Err(DriverError::in_words(NAME, call, failure, code, words))
}

/// `hipGetErrorName`.
fn error_name(result: sys::hipError_t) -> Option<String> {
    // SAFETY: takes the code by value and returns a pointer to a static NUL-terminated string
    // (or null), which driver_string reads.
    unsafe { driver_string(sys::hipGetErrorName(result)) }
}

/// `hipGetErrorString`.
fn error_string(result: sys::hipError_t) -> Option<String> {
    // SAFETY: as for hipGetErrorName.
    unsafe { driver_string(sys::hipGetErrorString(result)) }
}

/// `hipDeviceGetAttribute`.
fn device_attribute(ordinal: DeviceId, attribute: sys::hipDeviceAttribute_t) -> DriverResult<i32> {
    let mut value = 0;
    // SAFETY: the out-pointer is a valid local; the runtime checks device and attribute.
    check("hipDeviceGetAttribute", unsafe {
        sys::hipDeviceGetAttribute(&mut value, attribute, ordinal)
    })?;
    Ok(value)
}

/// `hipGetDevice`: this thread's current device.
fn get_device() -> DriverResult<DeviceId> {
    let mut device = 0;
    // SAFETY: the out-pointer is a valid local; only reads this thread's current device.
    check("hipGetDevice", unsafe { sys::hipGetDevice(&mut device) })?;
    Ok(device)
}

/// `hipSetDevice`: make `ordinal` this thread's current device.
fn set_device(ordinal: DeviceId) -> DriverResult<()> {
    // SAFETY: only changes this thread's current device; the runtime checks the ordinal.
    check("hipSetDevice", unsafe { sys::hipSetDevice(ordinal) })
}

/// The device made current with `hipSetDevice`, the caller's device restored when dropped, so
/// the calling thread's current device after a backend call is what it was before.
#[derive(Debug)]
#[must_use = "the caller's device is restored when the guard drops"]
pub struct DeviceGuard {
    /// The device that was current before, restored on drop (None: it already was `ordinal`).
    previous: Option<DeviceId>,
    /// The current device is per thread: the guard must drop on the thread that set it.
    _not_send: PhantomData<*mut ()>,
}

impl DeviceGuard {
    /// `hipGetDevice` then `hipSetDevice(ordinal)` when it differs.
    fn set(ordinal: DeviceId) -> DriverResult<DeviceGuard> {
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
                tracing::error!(device = previous, error = %e.message, "hip: restoring the caller's device failed");
            }
        }
    }
}

/// The HIP runtime (libamdhip64), initialised by `HipBackend::new`.
#[derive(Debug)]
pub struct HipDriver {
    /// `hipRuntimeGetVersion` (e.g. 50221153 for ROCm 5.2).
    version: i32,
}

/// What the HIP driver keeps per open device: its index (HIP has no context to retain).
#[derive(Debug, Clone, Copy)]
pub struct HipDevice {
    /// The device index.
    ordinal: DeviceId,
}

/// `major.minor.patch` of a HIP version number.
fn version_text(v: i32) -> String {
    format!("{}.{}.{}", v / 10_000_000, v / 100_000 % 100, v % 100_000)
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
fn allocation_prop(ordinal: DeviceId) -> sys::hipMemAllocationProp {
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

/// An allocation handle (`hipMemGenericAllocationHandle_t`, a pointer) from its integer form.
fn handle_ptr(handle: u64) -> sys::hipMemGenericAllocationHandle_t {
    handle as usize as sys::hipMemGenericAllocationHandle_t
}

/// A device address from its integer form.
fn dptr(address: u64) -> *mut c_void {
    address as usize as *mut c_void
}

/// A `hipEvent_t` from its integer form.
fn event_ptr(raw: u64) -> sys::hipEvent_t {
    raw as usize as sys::hipEvent_t
}

impl Driver for HipDriver {
    type Device = HipDevice;
    type Current = DeviceGuard;

    const NAME: &'static str = NAME;
    const VENDOR: &'static str = "HIP";
    /// `hipMalloc` arenas with `hipIpcGetMemHandle` exports; 2 MiB arenas, the VMM minimum
    /// granularity of current AMD GPUs, so arena sizes are the same on both paths.
    const LEGACY_IPC: Option<LegacyIpc> = Some(LegacyIpc {
        handle_bytes: IPC_HANDLE_BYTES,
        handle_name: "hipIpc",
        granularity: 2 << 20,
        fallback: true,
    });

    const START_FAILURES: StartFailures = StartFailures {
        init: "no HIP device",
        version: "could not read the HIP runtime version",
        count: "no HIP device",
    };

    /// `hipInit(0)`. Without an AMD GPU ROCm 5.2 answers `hipErrorInvalidDevice`.
    fn init() -> DriverResult<()> {
        // SAFETY: hipInit takes only flags (0) and may be called any number of times.
        check("hipInit", unsafe { sys::hipInit(0) })
    }

    fn started(version: i32) -> HipDriver {
        HipDriver { version }
    }

    /// `hipRuntimeGetVersion`: e.g. 50221153 for ROCm 5.2 (major * 10^7 + minor * 10^5 +
    /// patch).
    fn read_version() -> DriverResult<i32> {
        let mut version = 0;
        // SAFETY: the out-pointer is a valid local.
        let r = unsafe { sys::hipRuntimeGetVersion(&mut version) };
        check("hipRuntimeGetVersion", r).map(|()| version)
    }

    fn version(&self) -> i32 {
        self.version
    }

    /// `hipGetDeviceCount` (`hipErrorNoDevice` without a GPU).
    fn count_devices() -> DriverResult<i32> {
        let mut count = 0;
        // SAFETY: the out-pointer is a valid local.
        let r = unsafe { sys::hipGetDeviceCount(&mut count) };
        check("hipGetDeviceCount", r).map(|()| count)
    }

    /// `hipGetDevice`: the current device's index.
    fn current_on_thread(&self) -> DriverResult<u64> {
        get_device().map(|device| device as u64)
    }

    fn version_text(&self) -> String {
        format!("HIP runtime {}", version_text(self.version))
    }

    /// `hipDeviceGetAttribute(hipDeviceAttributeVirtualMemoryManagementSupported)` on a
    /// runtime whose attribute numbering the bindings match; otherwise unknown (the
    /// granularity query decides). POSIX-fd export and RDMA are not queried; FABRIC handles
    /// are not used (the bindings predate them).
    fn device_support(&self, ordinal: DeviceId) -> DriverResult<DeviceSupport> {
        let vmm = if self.version >= MIN_RUNTIME_FOR_VMM_ATTRIBUTE {
            let attribute =
                sys::hipDeviceAttribute_t::hipDeviceAttributeVirtualMemoryManagementSupported;
            Some(device_attribute(ordinal, attribute)? != 0)
        } else {
            None
        };
        Ok(DeviceSupport {
            vmm,
            posix_fd: None,
            rdma: false,
            fabric: false,
        })
    }

    /// Nothing to open: HIP makes a device current by its index.
    fn open_device(&self, ordinal: DeviceId, _rdma: bool) -> DriverResult<HipDevice> {
        Ok(HipDevice { ordinal })
    }

    unsafe fn close_device(&self, _device: HipDevice) -> DriverResult<()> {
        Ok(())
    }

    unsafe fn make_current(&self, device: &HipDevice) -> DriverResult<DeviceGuard> {
        DeviceGuard::set(device.ordinal)
    }

    /// `hipMemGetAllocationGranularity` (minimum); `hipErrorNotSupported` without VMM.
    fn granularity(&self, device: &HipDevice) -> DriverResult<u64> {
        let prop = allocation_prop(device.ordinal);
        let flags = sys::hipMemAllocationGranularity_flags::hipMemAllocationGranularityMinimum;
        let mut granularity = 0usize;
        // SAFETY: the out-pointer is a valid local and `prop` a valid, initialised struct.
        check("hipMemGetAllocationGranularity", unsafe {
            sys::hipMemGetAllocationGranularity(&mut granularity, &prop, flags)
        })?;
        Ok(granularity as u64)
    }

    /// `hipMemGetInfo` of the current device.
    fn mem_info(&self) -> DriverResult<(u64, u64)> {
        let mut free_total = (0usize, 0usize);
        // SAFETY: both out-pointers are valid locals.
        let r = unsafe { sys::hipMemGetInfo(&mut free_total.0, &mut free_total.1) };
        check("hipMemGetInfo", r).map(|()| (free_total.0 as u64, free_total.1 as u64))
    }

    /// `hipDeviceSynchronize` on the current device.
    fn synchronize(&self) -> DriverResult<()> {
        // SAFETY: no arguments; waits for the current device's work.
        check("hipDeviceSynchronize", unsafe {
            sys::hipDeviceSynchronize()
        })
    }

    /// `hipMemCreate` (POSIX fd; `fabric` is never set: HIP reports no FABRIC support).
    fn mem_create(&self, device: &HipDevice, bytes: usize, _fabric: bool) -> DriverResult<u64> {
        let prop = allocation_prop(device.ordinal);
        let mut handle: sys::hipMemGenericAllocationHandle_t = ptr::null_mut();
        // SAFETY: the out-pointer is a valid local and `prop` a valid, initialised struct; the
        // runtime checks the size.
        let r = unsafe { sys::hipMemCreate(&mut handle, bytes, &prop, 0) };
        check("hipMemCreate", r).map(|()| handle as usize as u64)
    }

    unsafe fn mem_release(&self, handle: u64) -> DriverResult<()> {
        // SAFETY: the caller gives back a handle it owns, once.
        check("hipMemRelease", unsafe {
            sys::hipMemRelease(handle_ptr(handle))
        })
    }

    /// `hipMemAddressReserve` (no address hint, no flags).
    fn address_reserve(&self, bytes: usize, alignment: usize) -> DriverResult<u64> {
        let mut base: *mut c_void = ptr::null_mut();
        let hint = ptr::null_mut();
        // SAFETY: the out-pointer is a valid local; no address hint (null), no flags.
        let r = unsafe { sys::hipMemAddressReserve(&mut base, bytes, alignment, hint, 0) };
        check("hipMemAddressReserve", r).map(|()| base as usize as u64)
    }

    unsafe fn address_free(&self, base: u64, bytes: usize) -> DriverResult<()> {
        // SAFETY: the caller frees its own, unmapped reservation, once.
        let r = unsafe { sys::hipMemAddressFree(dptr(base), bytes) };
        check("hipMemAddressFree", r)
    }

    unsafe fn map(&self, base: u64, bytes: usize, handle: u64) -> DriverResult<()> {
        // SAFETY: the caller guarantees the range and the handle; offset 0, no flags.
        let r = unsafe { sys::hipMemMap(dptr(base), bytes, 0, handle_ptr(handle), 0) };
        check("hipMemMap", r)
    }

    unsafe fn unmap(&self, base: u64, bytes: usize) -> DriverResult<()> {
        // SAFETY: the caller unmaps its own mapping, no longer in use.
        let r = unsafe { sys::hipMemUnmap(dptr(base), bytes) };
        check("hipMemUnmap", r)
    }

    /// `hipMemSetAccess` with one read-write descriptor per device.
    unsafe fn set_access(&self, base: u64, bytes: usize, devices: &[DeviceId]) -> DriverResult<()> {
        let descs: Vec<sys::hipMemAccessDesc> = devices
            .iter()
            .map(|&ordinal| sys::hipMemAccessDesc {
                location: device_location(ordinal),
                flags: sys::hipMemAccessFlags::hipMemAccessFlagsProtReadWrite,
            })
            .collect();
        // SAFETY: the caller guarantees the mapping; `descs` holds descs.len() valid,
        // initialised descriptors and outlives the call.
        let r = unsafe { sys::hipMemSetAccess(dptr(base), bytes, descs.as_ptr(), descs.len()) };
        check("hipMemSetAccess", r)
    }

    /// `hipDeviceCanAccessPeer(&can, peer, owner)`: whether `peer` can access `owner`'s memory.
    fn can_access_peer(&self, owner: DeviceId, peer: DeviceId) -> DriverResult<bool> {
        let mut can: c_int = 0;
        // SAFETY: the out-pointer is a valid local; the runtime checks both ordinals.
        check("hipDeviceCanAccessPeer", unsafe {
            sys::hipDeviceCanAccessPeer(&mut can, peer, owner)
        })?;
        Ok(can != 0)
    }

    unsafe fn export_fd(&self, handle: u64) -> DriverResult<OwnedFd> {
        let kind = sys::hipMemAllocationHandleType::hipMemHandleTypePosixFileDescriptor;
        let mut fd: c_int = -1;
        let out = ptr::addr_of_mut!(fd).cast::<c_void>();
        // SAFETY: the caller guarantees the handle; for a POSIX fd handle type the runtime
        // writes one int through `out`, which points at a valid local int.
        let r = unsafe { sys::hipMemExportToShareableHandle(out, handle_ptr(handle), kind, 0) };
        // A negative fd on success would be a runtime bug: report it as hipErrorUnknown.
        let r = if r == sys::hipError_t::hipSuccess && fd < 0 {
            sys::hipError_t::hipErrorUnknown
        } else {
            r
        };
        check("hipMemExportToShareableHandle", r)?;
        // SAFETY: on success the runtime returned a new fd that nothing else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    fn import_fd(&self, fd: BorrowedFd<'_>) -> DriverResult<u64> {
        let kind = sys::hipMemAllocationHandleType::hipMemHandleTypePosixFileDescriptor;
        let mut handle: sys::hipMemGenericAllocationHandle_t = ptr::null_mut();
        // As in CUDA (and PyTorch's hipified expandable segments), the "OS handle" of a POSIX
        // fd is the fd's value cast to a pointer.
        let os_handle = fd.as_raw_fd() as isize as *mut c_void;
        // SAFETY: the out-pointer is a valid local; the fd is open for the call (borrowed), the
        // runtime only reads it and checks that it is a HIP shareable handle.
        let r = unsafe { sys::hipMemImportFromShareableHandle(&mut handle, os_handle, kind) };
        check("hipMemImportFromShareableHandle", r).map(|()| handle as usize as u64)
    }

    /// `hipMalloc` on the current device.
    fn legacy_alloc(&self, bytes: usize) -> DriverResult<u64> {
        let mut base: *mut c_void = ptr::null_mut();
        // SAFETY: the out-pointer is a valid local; the runtime checks the size.
        check("hipMalloc", unsafe { sys::hipMalloc(&mut base, bytes) })?;
        Ok(base as usize as u64)
    }

    /// `hipFree`.
    unsafe fn legacy_free(&self, base: u64) -> DriverResult<()> {
        // SAFETY: the caller frees its own allocation, once, no longer in use.
        check("hipFree", unsafe { sys::hipFree(dptr(base)) })
    }

    /// `hipIpcGetMemHandle`: 64 bytes.
    unsafe fn ipc_get_handle(&self, base: u64) -> DriverResult<Vec<u8>> {
        let mut handle = sys::hipIpcMemHandle_t {
            reserved: [0; IPC_HANDLE_BYTES],
        };
        // SAFETY: the out-pointer is a valid local handle; the caller guarantees the allocation.
        check("hipIpcGetMemHandle", unsafe {
            sys::hipIpcGetMemHandle(&mut handle, dptr(base))
        })?;
        Ok(handle.reserved.iter().map(|&b| b as u8).collect())
    }

    /// `hipIpcOpenMemHandle` with `hipIpcMemLazyEnablePeerAccess`.
    fn ipc_open_handle(&self, bytes: &[u8]) -> DriverResult<u64> {
        let mut handle = sys::hipIpcMemHandle_t {
            reserved: [0; IPC_HANDLE_BYTES],
        };
        for (dst, &src) in handle.reserved.iter_mut().zip(bytes.iter()) {
            *dst = src as std::ffi::c_char;
        }
        let mut base: *mut c_void = ptr::null_mut();
        // SAFETY: the out-pointer is a valid local; the handle is passed by value and the
        // runtime checks that it names an exported allocation.
        check("hipIpcOpenMemHandle", unsafe {
            sys::hipIpcOpenMemHandle(&mut base, handle, sys::hipIpcMemLazyEnablePeerAccess)
        })?;
        Ok(base as usize as u64)
    }

    /// `hipIpcCloseMemHandle`.
    unsafe fn ipc_close_handle(&self, base: u64) -> DriverResult<()> {
        // SAFETY: the caller closes its own opened handle, once, no longer in use.
        check("hipIpcCloseMemHandle", unsafe {
            sys::hipIpcCloseMemHandle(dptr(base))
        })
    }

    /// `hipEventCreateWithFlags(hipEventDisableTiming)` on the current device.
    fn event_create(&self) -> DriverResult<u64> {
        let mut event: sys::hipEvent_t = ptr::null_mut();
        // SAFETY: the out-pointer is a valid local; the flag is a valid event flag.
        let r = unsafe { sys::hipEventCreateWithFlags(&mut event, sys::hipEventDisableTiming) };
        check("hipEventCreateWithFlags", r).map(|()| event as usize as u64)
    }

    /// `hipEventRecord`; the special stream is `hipStreamPerThread` (2), a C macro absent
    /// from the bindings, passed through as the integer it is.
    unsafe fn event_record(&self, event: u64, stream: u64) -> DriverResult<()> {
        // SAFETY: the caller guarantees both handles.
        let r =
            unsafe { sys::hipEventRecord(event_ptr(event), stream as usize as sys::hipStream_t) };
        check("hipEventRecord", r)
    }

    unsafe fn event_query(&self, event: u64) -> DriverResult<bool> {
        // SAFETY: the caller guarantees the event.
        let r = unsafe { sys::hipEventQuery(event_ptr(event)) };
        let done = r != sys::hipError_t::hipErrorNotReady;
        let r = if done { r } else { sys::hipError_t::hipSuccess };
        check("hipEventQuery", r).map(|()| done)
    }

    unsafe fn event_destroy(&self, event: u64) -> DriverResult<()> {
        // SAFETY: the caller destroys its own live event, once.
        let r = unsafe { sys::hipEventDestroy(event_ptr(event)) };
        check("hipEventDestroy", r)
    }

    /// `hipMemcpyHtoD` (the source may be reused or freed once it returns).
    unsafe fn memcpy_htod(&self, dst: u64, src: &[u8]) -> DriverResult<()> {
        let from = src.as_ptr().cast_mut().cast();
        // SAFETY: `src` is valid for reads of src.len() bytes (the runtime only reads through
        // the `*mut` the binding declares); the caller guarantees the destination range.
        let r = unsafe { sys::hipMemcpyHtoD(dptr(dst), from, src.len()) };
        check("hipMemcpyHtoD", r)
    }

    unsafe fn memcpy_dtoh(&self, dst: &mut [u8], src: u64) -> DriverResult<()> {
        let len = dst.len();
        // SAFETY: `dst` is valid for writes of its len() bytes and borrowed mutably for the
        // (synchronous) copy; the caller guarantees the source range.
        let r = unsafe { sys::hipMemcpyDtoH(dst.as_mut_ptr().cast(), dptr(src), len) };
        check("hipMemcpyDtoH", r)
    }

    /// `hipMemcpyDtoD` (device to device: it may return before the copy is done, the caller
    /// synchronizes).
    unsafe fn memcpy_dtod(&self, dst: u64, src: u64, bytes: usize) -> DriverResult<()> {
        // SAFETY: the caller guarantees both device ranges (mapped, accessible, disjoint).
        let r = unsafe { sys::hipMemcpyDtoD(dptr(dst), dptr(src), bytes) };
        check("hipMemcpyDtoD", r)
    }

    unsafe fn memset_d8(&self, dst: u64, value: u8, bytes: usize) -> DriverResult<()> {
        // SAFETY: the caller guarantees the destination range.
        let r = unsafe { sys::hipMemsetD8(dptr(dst), value, bytes) };
        check("hipMemsetD8", r)
    }

    /// `hipStreamCreateWithFlags(hipStreamNonBlocking)` on the current device.
    fn stream_create(&self) -> DriverResult<u64> {
        let mut stream: sys::hipStream_t = ptr::null_mut();
        // SAFETY: the out-pointer is a valid local; the flag is a valid stream flag.
        let r = unsafe { sys::hipStreamCreateWithFlags(&mut stream, sys::hipStreamNonBlocking) };
        check("hipStreamCreateWithFlags", r).map(|()| stream as usize as u64)
    }

    unsafe fn stream_destroy(&self, stream: u64) -> DriverResult<()> {
        // SAFETY: the caller destroys its own live stream, once.
        let r = unsafe { sys::hipStreamDestroy(stream as usize as sys::hipStream_t) };
        check("hipStreamDestroy", r)
    }

    /// `hipMemcpyDtoDAsync` on `stream`.
    unsafe fn memcpy_dtod_async(
        &self,
        dst: u64,
        src: u64,
        bytes: usize,
        stream: u64,
    ) -> DriverResult<()> {
        // SAFETY: the caller guarantees both device ranges and the stream.
        let r = unsafe {
            sys::hipMemcpyDtoDAsync(
                dptr(dst),
                dptr(src),
                bytes,
                stream as usize as sys::hipStream_t,
            )
        };
        check("hipMemcpyDtoDAsync", r)
    }

    /// `hipHostMalloc` (`hipHostMallocPortable`).
    fn host_alloc(&self, bytes: usize) -> DriverResult<u64> {
        let mut p: *mut c_void = ptr::null_mut();
        // SAFETY: `p` is a valid out-pointer; the runtime page-locks `bytes` new bytes,
        // portable to every device.
        let r = unsafe { sys::hipHostMalloc(&mut p, bytes, sys::hipHostMallocPortable) };
        check("hipHostMalloc", r)?;
        Ok(p as u64)
    }

    /// `hipHostRegister` (`hipHostRegisterPortable`).
    unsafe fn host_register(&self, ptr: u64, bytes: usize) -> DriverResult<()> {
        // SAFETY: the caller guarantees the range stays mapped until it is unregistered.
        let r = unsafe {
            sys::hipHostRegister(ptr as *mut c_void, bytes, sys::hipHostRegisterPortable)
        };
        check("hipHostRegister", r)
    }

    /// `hipHostUnregister`.
    unsafe fn host_unregister(&self, ptr: u64) -> DriverResult<()> {
        // SAFETY: the caller unregisters its own registration, unused, once.
        let r = unsafe { sys::hipHostUnregister(ptr as *mut c_void) };
        check("hipHostUnregister", r)
    }

    /// `hipHostFree`.
    unsafe fn host_free(&self, ptr: u64) -> DriverResult<()> {
        // SAFETY: the caller frees its own memory from hipHostMalloc, unused, once.
        let r = unsafe { sys::hipHostFree(ptr as *mut c_void) };
        check("hipHostFree", r)
    }
}
