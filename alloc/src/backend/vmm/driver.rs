//! The primitives a vendor's driver provides to the VMM core: [`Driver`].
//!
//! One method per driver operation (create physical memory, reserve address space, map, set
//! access, unmap, release, export to an fd, import from an fd, the legacy IPC calls, events,
//! synchronize, memory info, granularity, copies host-device and device-device), each returning [`DriverResult`]. A method
//! whose arguments the driver cannot check on its own (contexts, events, streams, allocation
//! handles, address ranges) is an `unsafe fn` with a `# Safety` section here, once for every
//! vendor; the core (`super`) proves those preconditions with its registries of live arenas,
//! mappings and events. The implementations hold no state beyond what the driver needs and
//! make no decisions: what to call, in which order, and how to undo it is the core's.

use std::ffi::{c_char, CStr};
use std::fmt;
use std::os::fd::{BorrowedFd, OwnedFd};

use crate::error::{Error, Result};
use crate::ids::DeviceId;

/// How a failed driver call is to be treated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// The driver ran out of device memory: the pool may release cached arenas and retry.
    OutOfMemory,
    /// The driver does not support the operation (HIP without VMM, a primitive a vendor lacks).
    NotSupported,
    /// The driver refused the operation as not permitted (CUDA `CUDA_ERROR_NOT_PERMITTED`:
    /// e.g. FABRIC handles on a host without an IMEX channel).
    NotPermitted,
    /// Anything else.
    Other,
}

/// A failed driver call: the backend, the call, what kind of failure, the driver's own words.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DriverError {
    /// The backend's name (`cuda`, `hip`).
    pub backend: &'static str,
    /// The driver call, e.g. `cuMemCreate`.
    pub call: &'static str,
    /// How to treat it.
    pub failure: Failure,
    /// The driver's description, e.g. `CUDA_ERROR_INVALID_VALUE: invalid argument`.
    pub message: String,
}

/// The result of a driver primitive.
pub type DriverResult<T> = Result<T, DriverError>;

impl DriverError {
    /// A failed call in the driver's words: `name: text` (`name` alone where both say the
    /// same), else what the driver has after `code` (e.g. `CUresult 999`).
    pub fn in_words(
        backend: &'static str,
        call: &'static str,
        failure: Failure,
        code: String,
        (name, text): (Option<String>, Option<String>),
    ) -> DriverError {
        let message = match (name, text) {
            (Some(name), Some(text)) if name != text => format!("{name}: {text}"),
            (Some(name), _) => name,
            (None, Some(text)) => format!("{code}: {text}"),
            (None, None) => code,
        };
        DriverError {
            backend,
            call,
            failure,
            message,
        }
    }

    /// A primitive the vendor does not have (the trait's default for the legacy IPC calls).
    pub fn not_supported(backend: &'static str, call: &'static str) -> DriverError {
        DriverError {
            backend,
            call,
            failure: Failure::NotSupported,
            message: format!("the {backend} backend has no {call}"),
        }
    }

    /// Whether the driver said the operation is not supported.
    pub fn is_not_supported(&self) -> bool {
        self.failure == Failure::NotSupported
    }

    /// The crate error: [`Error::DriverOutOfMemory`] when the driver ran out of memory (with
    /// the device and the bytes asked for), [`Error::Backend`] otherwise.
    pub fn into_error(self, device: DeviceId, bytes: u64) -> Error {
        match self.failure {
            Failure::OutOfMemory => Error::DriverOutOfMemory {
                backend: self.backend,
                call: self.call,
                device,
                bytes,
            },
            Failure::NotSupported | Failure::NotPermitted | Failure::Other => Error::Backend {
                backend: self.backend,
                call: self.call,
                message: self.message,
            },
        }
    }

    /// The error as [`Error::Unavailable`] (set-up failures: driver init, no device...).
    pub fn into_unavailable(self, what: &str) -> Error {
        Error::Unavailable(format!("{what}: {} failed: {}", self.call, self.message))
    }
}

/// A string the driver returned (an error name or description), `None` for null.
///
/// # Safety
/// `text` is null or points at a NUL-terminated string that stays valid for the call (the
/// drivers' error strings are static).
pub unsafe fn driver_string(text: *const c_char) -> Option<String> {
    if text.is_null() {
        return None;
    }
    // SAFETY: non-null, NUL-terminated and valid (the caller's contract).
    let text = unsafe { CStr::from_ptr(text) };
    Some(text.to_string_lossy().into_owned())
}

/// What to say when starting a driver fails, step by step (each followed by the call and
/// the driver's words).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StartFailures {
    /// [`Driver::init`] failed: `the CUDA driver did not initialise`, `no HIP device`.
    pub init: &'static str,
    /// [`Driver::read_version`] failed.
    pub version: &'static str,
    /// [`Driver::count_devices`] failed.
    pub count: &'static str,
}

/// What a device supports, as far as the driver can say before it is used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceSupport {
    /// Virtual memory management (create/reserve/map); `None` when the driver cannot say (the
    /// granularity query decides then).
    pub vmm: Option<bool>,
    /// Exporting VMM memory as POSIX fds; `None` when the driver cannot say.
    pub posix_fd: Option<bool>,
    /// GPUDirect RDMA on VMM memory (arenas are created RDMA-capable where it is there).
    pub rdma: bool,
    /// FABRIC shareable handles on VMM memory (CUDA `CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_
    /// SUPPORTED`): arenas are then created exportable as FABRIC handles too, where the driver
    /// permits it (see [`super::FabricHandles`]).
    pub fabric: bool,
}

/// The legacy IPC path of a vendor that has one (HIP: `hipMalloc` arenas, CUDA: `cuMemAlloc`
/// arenas; byte handles).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LegacyIpc {
    /// The size of a handle in bytes (`HIP_IPC_HANDLE_SIZE`, `CU_IPC_HANDLE_SIZE`: 64).
    pub handle_bytes: usize,
    /// What a handle is called in errors (`hipIpc`, `cuIpc`).
    pub handle_name: &'static str,
    /// Arena granularity in bytes on that path (its allocator has none of its own).
    pub granularity: u64,
    /// Whether a device without VMM falls back to this path on its own (HIP); else (CUDA) the
    /// path is used only when asked for and a device without VMM is unavailable.
    pub fallback: bool,
}

/// One vendor's driver: the raw calls the VMM core ([`super::VmmBackend`]) is built on.
///
/// The device an operation works on is made current by the core first ([`Driver::make_current`])
/// wherever the vendor needs a current device or context; primitives without a device argument
/// work on the current one.
pub trait Driver: Send + Sync + fmt::Debug + Sized + 'static {
    /// What the driver keeps per device once it is open (a device handle, a retained context).
    type Device: Copy + Send + Sync + fmt::Debug;
    /// The device made current on this thread; the caller's state is restored when it drops.
    type Current;

    /// The backend's short name in errors and logs: `cuda`, `hip`.
    const NAME: &'static str;
    /// The vendor's name in messages: `CUDA`, `HIP`.
    const VENDOR: &'static str;
    /// The legacy IPC path, where the vendor has one.
    const LEGACY_IPC: Option<LegacyIpc>;

    /// What to say when a start-up step fails.
    const START_FAILURES: StartFailures;

    /// Load the driver library where it is loaded at run time, checking it has every symbol
    /// the primitives use. The default (a library linked at build time) has nothing to do.
    ///
    /// # Errors
    /// [`Error::Unavailable`] saying what is missing.
    fn load() -> Result<()> {
        Ok(())
    }
    /// Initialise the driver (after [`Driver::load`]).
    fn init() -> DriverResult<()>;
    /// The driver's version number (`cuDriverGetVersion`, `hipRuntimeGetVersion`).
    fn read_version() -> DriverResult<i32>;
    /// How many devices the driver sees.
    fn count_devices() -> DriverResult<i32>;
    /// The driver, started, with its version number.
    fn started(version: i32) -> Self;
    /// The version number [`Driver::started`] got.
    fn version(&self) -> i32;
    /// The driver's version in words, e.g. `driver 13.0` or `HIP runtime 5.2.21153`.
    fn version_text(&self) -> String;
    /// The calling thread's current context (CUDA) or device (HIP) as an integer: for tests
    /// that check the backend leaves the caller's state alone.
    fn current_on_thread(&self) -> DriverResult<u64>;

    /// What device `ordinal` supports.
    fn device_support(&self, ordinal: DeviceId) -> DriverResult<DeviceSupport>;
    /// Open device `ordinal` for use (CUDA retains its primary context); arenas are created
    /// RDMA-capable when `rdma` is set.
    fn open_device(&self, ordinal: DeviceId, rdma: bool) -> DriverResult<Self::Device>;
    /// Give back what [`Driver::open_device`] took.
    ///
    /// # Safety
    /// `device` came from [`Driver::open_device`], is closed once, and is not used afterwards.
    unsafe fn close_device(&self, device: Self::Device) -> DriverResult<()>;
    /// Make `device` current on this thread until the returned value drops.
    ///
    /// # Safety
    /// `device` is open (from [`Driver::open_device`], not closed).
    unsafe fn make_current(&self, device: &Self::Device) -> DriverResult<Self::Current>;
    /// The minimum VMM allocation granularity in bytes for this device's arenas.
    fn granularity(&self, device: &Self::Device) -> DriverResult<u64>;
    /// (free, total) bytes of the current device.
    fn mem_info(&self) -> DriverResult<(u64, u64)>;
    /// Wait for all work of the current device.
    fn synchronize(&self) -> DriverResult<()>;

    /// Physical memory of `bytes` on `device`, exportable as a POSIX fd (and as a FABRIC
    /// handle too when `fabric` is set: the core sets it only where
    /// [`DeviceSupport::fabric`] said so); the allocation handle.
    fn mem_create(&self, device: &Self::Device, bytes: usize, fabric: bool) -> DriverResult<u64>;
    /// Release an allocation handle.
    ///
    /// # Safety
    /// `handle` is a live allocation handle this process owns (from [`Driver::mem_create`] or
    /// [`Driver::import_fd`]), released once.
    unsafe fn mem_release(&self, handle: u64) -> DriverResult<()>;
    /// Reserve `bytes` of device virtual address space aligned to `alignment`.
    fn address_reserve(&self, bytes: usize, alignment: usize) -> DriverResult<u64>;
    /// Free a reservation.
    ///
    /// # Safety
    /// `base..base + bytes` is a whole range reserved with [`Driver::address_reserve`], nothing
    /// is mapped in it any more, and it is freed once.
    unsafe fn address_free(&self, base: u64, bytes: usize) -> DriverResult<()>;
    /// Map the whole of `handle` (offset 0) at `base`.
    ///
    /// # Safety
    /// `base..base + bytes` lies in a reservation of this process with nothing mapped there,
    /// and `handle` is a live allocation handle.
    unsafe fn map(&self, base: u64, bytes: usize, handle: u64) -> DriverResult<()>;
    /// Unmap a mapping.
    ///
    /// # Safety
    /// `base..base + bytes` is a whole mapping made with [`Driver::map`] that no queued or
    /// running device work uses any more (the caller synchronized).
    unsafe fn unmap(&self, base: u64, bytes: usize) -> DriverResult<()>;
    /// Read-write access to a mapping from every device in `devices` (one driver call with one
    /// descriptor per device; the core passes the owner first, then its peers).
    ///
    /// # Safety
    /// `base..base + bytes` is mapped by this process (with [`Driver::map`]).
    unsafe fn set_access(&self, base: u64, bytes: usize, devices: &[DeviceId]) -> DriverResult<()>;
    /// Whether device `peer` can access memory on device `owner` (`cuDeviceCanAccessPeer`,
    /// `hipDeviceCanAccessPeer`). The default: not supported, which the core takes as "no
    /// peers".
    fn can_access_peer(&self, owner: DeviceId, peer: DeviceId) -> DriverResult<bool> {
        let _ = (owner, peer);
        Err(DriverError::not_supported(Self::NAME, "can_access_peer"))
    }
    /// Export an allocation handle as a POSIX fd, owned by the caller.
    ///
    /// # Safety
    /// `handle` is a live allocation handle from [`Driver::mem_create`].
    unsafe fn export_fd(&self, handle: u64) -> DriverResult<OwnedFd>;
    /// Import a POSIX fd (it stays the caller's); a new allocation handle this process owns.
    fn import_fd(&self, fd: BorrowedFd<'_>) -> DriverResult<u64>;

    /// Legacy path: plain device memory of `bytes` on the current device; its address.
    fn legacy_alloc(&self, bytes: usize) -> DriverResult<u64> {
        let _ = bytes;
        Err(DriverError::not_supported(Self::NAME, "legacy_alloc"))
    }
    /// Legacy path: free memory from [`Driver::legacy_alloc`].
    ///
    /// # Safety
    /// `base` came from [`Driver::legacy_alloc`], no device work uses it (the caller
    /// synchronized), and it is freed once.
    unsafe fn legacy_free(&self, base: u64) -> DriverResult<()> {
        let _ = base;
        Err(DriverError::not_supported(Self::NAME, "legacy_free"))
    }
    /// Legacy path: the IPC handle of an allocation ([`LegacyIpc::handle_bytes`] bytes).
    ///
    /// # Safety
    /// `base` is the start of a live allocation from [`Driver::legacy_alloc`].
    unsafe fn ipc_get_handle(&self, base: u64) -> DriverResult<Vec<u8>> {
        let _ = base;
        Err(DriverError::not_supported(Self::NAME, "ipc_get_handle"))
    }
    /// Legacy path: open another process's IPC handle (of [`LegacyIpc::handle_bytes`] bytes,
    /// checked by the caller) on the current device; the address of the opened memory.
    fn ipc_open_handle(&self, handle: &[u8]) -> DriverResult<u64> {
        let _ = handle;
        Err(DriverError::not_supported(Self::NAME, "ipc_open_handle"))
    }
    /// Legacy path: close memory opened with [`Driver::ipc_open_handle`].
    ///
    /// # Safety
    /// `base` came from [`Driver::ipc_open_handle`], no device work uses it, closed once.
    unsafe fn ipc_close_handle(&self, base: u64) -> DriverResult<()> {
        let _ = base;
        Err(DriverError::not_supported(Self::NAME, "ipc_close_handle"))
    }

    /// An event with timing disabled on the current device, as an integer.
    fn event_create(&self) -> DriverResult<u64>;
    /// Record `event` on `stream` (0 = the default stream of the current device).
    ///
    /// # Safety
    /// `event` is live (from [`Driver::event_create`], not destroyed) and `stream` is 0, one of
    /// the vendor's special stream handles, or a live stream of the event's device.
    unsafe fn event_record(&self, event: u64, stream: u64) -> DriverResult<()>;
    /// `Ok(true)` when the event completed, `Ok(false)` when not yet.
    ///
    /// # Safety
    /// `event` is live (from [`Driver::event_create`], not destroyed).
    unsafe fn event_query(&self, event: u64) -> DriverResult<bool>;
    /// Destroy an event.
    ///
    /// # Safety
    /// `event` is live (from [`Driver::event_create`]) and destroyed once.
    unsafe fn event_destroy(&self, event: u64) -> DriverResult<()>;

    /// Copy `src` to device address `dst` (blocking).
    ///
    /// # Safety
    /// `dst..dst + src.len()` is device memory mapped by this process that nothing else uses
    /// concurrently (and not host memory that Rust code owns).
    unsafe fn memcpy_htod(&self, dst: u64, src: &[u8]) -> DriverResult<()>;
    /// Copy from device address `src` into `dst` (blocking).
    ///
    /// # Safety
    /// `src..src + dst.len()` is device memory mapped by this process.
    unsafe fn memcpy_dtoh(&self, dst: &mut [u8], src: u64) -> DriverResult<()>;
    /// Copy `bytes` bytes from device address `src` to device address `dst` on the default
    /// stream of the current device (the core's `split_arena` moves a window's contents to
    /// its new memory). It may return before the copy is done: the caller synchronizes
    /// ([`Driver::synchronize`]) before relying on it.
    ///
    /// # Safety
    /// `src..src + bytes` and `dst..dst + bytes` are device memory mapped by this process,
    /// readable and writable from the current device, not overlapping, and nothing else uses
    /// `dst..dst + bytes` concurrently.
    unsafe fn memcpy_dtod(&self, dst: u64, src: u64, bytes: usize) -> DriverResult<()>;
    /// Set `bytes` bytes at device address `dst` to `value` (default stream).
    ///
    /// # Safety
    /// `dst..dst + bytes` is device memory mapped by this process that nothing else uses
    /// concurrently (and not host memory that Rust code owns).
    unsafe fn memset_d8(&self, dst: u64, value: u8, bytes: usize) -> DriverResult<()>;

    /// A new non-blocking stream of the current device, as an integer (transfers: copies that
    /// run beside the default stream's work).
    fn stream_create(&self) -> DriverResult<u64> {
        Err(DriverError::not_supported(Self::NAME, "stream_create"))
    }
    /// Destroy a stream (work queued on it still completes).
    ///
    /// # Safety
    /// `stream` came from [`Driver::stream_create`] and is destroyed once.
    unsafe fn stream_destroy(&self, stream: u64) -> DriverResult<()> {
        let _ = stream;
        Err(DriverError::not_supported(Self::NAME, "stream_destroy"))
    }
    /// Queue a copy of `bytes` bytes from device address `src` to `dst` on `stream`; it
    /// returns at once (an event recorded after it tells completion).
    ///
    /// # Safety
    /// Both ranges are device memory mapped by this process, readable and writable from the
    /// current device, not overlapping, and stay mapped until the copy completes; `stream`
    /// is 0, a special stream, or a live stream of the current device.
    unsafe fn memcpy_dtod_async(
        &self,
        dst: u64,
        src: u64,
        bytes: usize,
        stream: u64,
    ) -> DriverResult<()> {
        let _ = (dst, src, bytes, stream);
        Err(DriverError::not_supported(Self::NAME, "memcpy_dtod_async"))
    }

    /// `bytes` (> 0) bytes of pinned (page-locked) host memory, portable (fast copies with
    /// every device of the process), as an address. Call with a device made current.
    fn host_alloc(&self, bytes: usize) -> DriverResult<u64> {
        let _ = bytes;
        Err(DriverError::not_supported(Self::NAME, "host_alloc"))
    }
    /// Page-lock `bytes` bytes of ordinary host memory at `ptr` (portable), for fast copies
    /// with every device of the process. Call with a device made current.
    ///
    /// # Safety
    /// `ptr..ptr + bytes` is mapped host memory that stays mapped until
    /// [`Driver::host_unregister`].
    unsafe fn host_register(&self, ptr: u64, bytes: usize) -> DriverResult<()> {
        let _ = (ptr, bytes);
        Err(DriverError::not_supported(Self::NAME, "host_register"))
    }
    /// Undo [`Driver::host_register`]. Call with a device made current.
    ///
    /// # Safety
    /// `ptr` was registered and nothing copies to or from it any more; once.
    unsafe fn host_unregister(&self, ptr: u64) -> DriverResult<()> {
        let _ = ptr;
        Err(DriverError::not_supported(Self::NAME, "host_unregister"))
    }
    /// Free pinned host memory. Call with a device made current.
    ///
    /// # Safety
    /// `ptr` came from [`Driver::host_alloc`], nothing uses it any more, and it is freed once.
    unsafe fn host_free(&self, ptr: u64) -> DriverResult<()> {
        let _ = ptr;
        Err(DriverError::not_supported(Self::NAME, "host_free"))
    }
}
