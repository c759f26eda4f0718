//! The HIP backend: arenas on the HIP runtime's virtual memory management (VMM) API, with
//! the legacy `hipIpc*` path where VMM is not available or asked for.
//!
//! Every raw runtime call lives in `driver` (hip-sys, libamdhip64 linked at build time: see
//! `driver`'s documentation for the ROCm versions and what the bindings lack); this module
//! builds [`HipBackend`] on those wrappers.
//!
//! # Start-up
//! [`HipBackend::new`] runs `hipInit` and counts devices. A machine without an AMD GPU gets
//! [`Error::Unavailable`] ("no HIP device: ..."), never a panic: ROCm 5.2's `hipInit` answers
//! `hipErrorInvalidDevice` there, `hipGetDeviceCount` `hipErrorNoDevice`.
//!
//! # Devices
//! HIP has no context stack to push: every call that needs a device makes it current with
//! `hipSetDevice` and restores the caller's device (`hipGetDevice`) when done (an RAII guard),
//! so the calling thread's current device after a call is what it was before.
//!
//! # Memory and exports
//! Per device, on first use, the backend picks one of two paths:
//!
//! - **VMM (the default)**: an arena is `hipMemCreate` (pinned, on the device, exportable as a
//!   POSIX fd) + `hipMemAddressReserve` + `hipMemMap` + `hipMemSetAccess`; exports are
//!   `hipMemExportToShareableHandle` fds ([`ExportKind::Releasable`]); imports are
//!   `hipMemImportFromShareableHandle` + map, their handle released at once.
//! - **Legacy IPC**: an arena is `hipMalloc`; exports are the 64-byte `hipIpcGetMemHandle`
//!   ([`ExportPayload::Bytes`], [`ExportKind::Pinning`]: ROCm 7.2.x keeps such memory for the
//!   life of the exporting process, so the pool recycles these arenas instead of freeing
//!   them; its start-up self-test detects pinning at run time anyway); imports are
//!   `hipIpcOpenMemHandle`, closed with `hipIpcCloseMemHandle`.
//!
//! The legacy path is used when [`HipBackend::with_legacy_ipc`]`(true)` asks for it (for peers
//! that only speak `hipIpc*` handles), or when the device lacks VMM: on ROCm >= 5.4
//! `hipDeviceAttributeVirtualMemoryManagementSupported` is 0, or `hipMemGetAllocationGranularity`
//! answers `hipErrorNotSupported` (the only check on ROCm < 5.4, whose headers lack the
//! attribute). The choice is logged. Imports accept both kinds of handle on either path.
//!
//! # Registries
//! As in the cuda backend, every live arena, import mapping and event is recorded, and each
//! call checks its argument against these records before the runtime sees it. A [`StreamId`]
//! is the caller's `hipStream_t`: 0 (the null stream), 2 (`hipStreamPerThread`) or a live
//! stream of the device.

mod driver;

use std::collections::{BTreeMap, HashMap};
use std::sync::OnceLock;

use hip_sys::hiprt as sys;
use parking_lot::{Mutex, RwLock};

use crate::backend::{
    ArenaMem, Backend, DeviceId, Event, Export, ExportKind, ExportPayload, ImportSource, Mapping,
    MemInfo, StreamId,
};
use crate::error::{Error, Result};

use driver::{DeviceGuard, HipError, BACKEND, IPC_HANDLE_BYTES};

/// Arena granularity on the legacy path: `hipMalloc` has none of its own; 2 MiB is the VMM
/// minimum granularity of current AMD GPUs and keeps arena sizes the same on both paths.
const LEGACY_GRANULARITY: u64 = 2 << 20;

/// What the backend caches per device once it first used it.
#[derive(Debug, Clone, Copy)]
struct DeviceState {
    /// Arena granularity (VMM minimum, or [`LEGACY_GRANULARITY`]).
    granularity: u64,
    /// Whether arenas use VMM (else `hipMalloc` + legacy IPC).
    vmm: bool,
}

/// What a live address range of the backend is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RegionKind {
    /// A VMM arena created here; the allocation handle it owns.
    Arena { handle: u64 },
    /// A `hipMalloc` arena (legacy IPC path).
    MallocArena,
    /// A VMM import mapping (its allocation handle was released right after mapping).
    Import,
    /// A legacy import opened with `hipIpcOpenMemHandle`.
    IpcImport,
}

/// A live, mapped address range: an arena or an import.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Region {
    device: DeviceId,
    bytes: u64,
    kind: RegionKind,
}

/// The HIP backend (see the module documentation).
#[derive(Debug)]
pub struct HipBackend {
    /// Devices the runtime reported at start.
    device_count: usize,
    /// `hipRuntimeGetVersion` (e.g. 50221153 for ROCm 5.2).
    runtime_version: i32,
    /// Use `hipMalloc` + `hipIpc*` handles on every device, even where VMM works.
    legacy_ipc: bool,
    /// Per device, filled on first use.
    devices: Vec<OnceLock<DeviceState>>,
    /// Serialises the first use of a device.
    init_lock: Mutex<()>,
    /// Live arenas and import mappings by base address. Calls that use a range hold the read
    /// lock for their runtime call; destroy/unmap remove the range under the write lock first.
    regions: RwLock<BTreeMap<u64, Region>>,
    /// Live events (as integers) and their device; same locking as `regions`.
    events: RwLock<HashMap<u64, DeviceId>>,
}

/// A `u64` byte count as the runtime's `size_t`.
fn to_usize(bytes: u64) -> Result<usize> {
    usize::try_from(bytes).map_err(|_| Error::invalid(format!("{bytes} bytes do not fit in usize")))
}

impl HipBackend {
    /// Initialise the HIP runtime and count devices. Arenas use VMM where the device has it
    /// (see [`HipBackend::with_legacy_ipc`]).
    ///
    /// # Errors
    /// [`Error::Unavailable`] ("no HIP device: ...") when `hipInit` fails (no AMD GPU or
    /// driver: ROCm 5.2 answers `hipErrorInvalidDevice`), when devices cannot be counted, or
    /// when there is none.
    pub fn new() -> Result<HipBackend> {
        driver::init().map_err(|e| e.into_unavailable("no HIP device"))?;
        let runtime_version = driver::runtime_version()
            .map_err(|e| e.into_unavailable("could not read the HIP runtime version"))?;
        let count = driver::device_count().map_err(|e| e.into_unavailable("no HIP device"))?;
        let device_count = usize::try_from(count).unwrap_or(0);
        if device_count == 0 {
            return Err(Error::Unavailable(format!(
                "no HIP device (HIP runtime {})",
                Self::version_text(runtime_version)
            )));
        }
        tracing::debug!(device_count, runtime_version, "hip backend ready");
        Ok(HipBackend {
            device_count,
            runtime_version,
            legacy_ipc: false,
            devices: (0..device_count).map(|_| OnceLock::new()).collect(),
            init_lock: Mutex::new(()),
            regions: RwLock::new(BTreeMap::new()),
            events: RwLock::new(HashMap::new()),
        })
    }

    /// Use the legacy IPC path (`hipMalloc` arenas, 64-byte `hipIpcGetMemHandle` exports of
    /// kind [`ExportKind::Pinning`]) on every device, even where VMM works: for consumers that
    /// only open `hipIpc*` handles. Takes effect for devices not used yet (call it right after
    /// [`HipBackend::new`]).
    #[must_use]
    pub fn with_legacy_ipc(mut self, legacy: bool) -> HipBackend {
        self.legacy_ipc = legacy;
        self
    }

    /// Whether [`HipBackend::new`] would succeed. Never panics.
    pub fn is_available() -> bool {
        HipBackend::new().is_ok()
    }

    /// The HIP runtime version as `hipRuntimeGetVersion` reports it (50221153 = ROCm 5.2).
    pub fn runtime_version(&self) -> i32 {
        self.runtime_version
    }

    /// Whether arenas on `device` use the legacy IPC path (initialises the device).
    ///
    /// # Errors
    /// [`Error::InvalidDevice`], or a runtime error from the device's first use.
    pub fn uses_legacy_ipc(&self, device: DeviceId) -> Result<bool> {
        Ok(!self.state(device)?.vmm)
    }

    /// The calling thread's current HIP device: for tests that check the backend leaves the
    /// caller's device alone.
    ///
    /// # Errors
    /// [`Error::Backend`] if `hipGetDevice` fails.
    pub fn current_device(&self) -> Result<DeviceId> {
        driver::get_device().map_err(|e| e.into_error(-1, 0))
    }

    /// `major.minor.patch` of a HIP version number.
    fn version_text(v: i32) -> String {
        format!("{}.{}.{}", v / 10_000_000, v / 100_000 % 100, v % 100_000)
    }

    /// Copy `src` to device address `dst` (blocking). For tests and benches.
    ///
    /// `dst..dst + src.len()` must lie inside one live arena or import mapping.
    ///
    /// # Errors
    /// [`Error::UnknownPointer`] outside a live range, [`Error::Backend`] if the copy fails.
    pub fn memcpy_htod(&self, dst: u64, src: &[u8]) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        let regions = self.regions.read();
        let device = Self::range_device(&regions, dst, src.len() as u64)?;
        let _device = DeviceGuard::set(device).map_err(|e| e.into_error(device, 0))?;
        // SAFETY: the range lies in a live arena or mapping of this backend (checked above),
        // kept mapped by the read lock we hold for the copy; device memory is never host memory.
        unsafe { driver::memcpy_htod(dst, src) }.map_err(|e| e.into_error(device, 0))
    }

    /// Copy from device address `src` into `dst` (blocking). For tests and benches.
    ///
    /// # Errors
    /// [`Error::UnknownPointer`] outside a live range, [`Error::Backend`] if the copy fails.
    pub fn memcpy_dtoh(&self, dst: &mut [u8], src: u64) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        let regions = self.regions.read();
        let device = Self::range_device(&regions, src, dst.len() as u64)?;
        let _device = DeviceGuard::set(device).map_err(|e| e.into_error(device, 0))?;
        // SAFETY: the range lies in a live arena or mapping of this backend (checked above),
        // kept mapped by the read lock we hold for the copy.
        unsafe { driver::memcpy_dtoh(dst, src) }.map_err(|e| e.into_error(device, 0))
    }

    /// Set `bytes` bytes at device address `dst` to `value` (null stream). For tests.
    ///
    /// # Errors
    /// [`Error::UnknownPointer`] outside a live range, [`Error::Backend`] if the call fails.
    pub fn memset_d8(&self, dst: u64, value: u8, bytes: u64) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        let n = to_usize(bytes)?;
        let regions = self.regions.read();
        let device = Self::range_device(&regions, dst, bytes)?;
        let _device = DeviceGuard::set(device).map_err(|e| e.into_error(device, 0))?;
        // SAFETY: the range lies in a live arena or mapping of this backend (checked above),
        // kept mapped by the read lock we hold for the call.
        unsafe { driver::memset_d8(dst, value, n) }.map_err(|e| e.into_error(device, 0))
    }

    /// The device of the live region holding `addr..addr + len`.
    fn range_device(regions: &BTreeMap<u64, Region>, addr: u64, len: u64) -> Result<DeviceId> {
        let end = addr.checked_add(len).ok_or_else(|| Error::UnknownPointer {
            ptr: addr,
            why: format!("range of {len} bytes overflows"),
        })?;
        match regions.range(..=addr).next_back() {
            Some((&base, region)) if end <= base.saturating_add(region.bytes) => Ok(region.device),
            _ => Err(Error::UnknownPointer {
                ptr: addr,
                why: format!(
                    "{len} bytes from here are not inside a live arena or import of the hip backend"
                ),
            }),
        }
    }

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

    /// The device's cached state, choosing VMM or legacy IPC on first use.
    fn state(&self, device: DeviceId) -> Result<DeviceState> {
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

    /// First use of a device: VMM if it has it and legacy IPC was not asked for.
    fn init_device(&self, device: DeviceId) -> Result<DeviceState> {
        let legacy = DeviceState {
            granularity: LEGACY_GRANULARITY,
            vmm: false,
        };
        if self.legacy_ipc {
            tracing::info!(
                device,
                "hip: legacy IPC asked for: hipMalloc arenas, pinning hipIpc exports"
            );
            return Ok(legacy);
        }
        if self.runtime_version >= driver::MIN_RUNTIME_FOR_VMM_ATTRIBUTE {
            let supported = driver::device_attribute(
                device,
                sys::hipDeviceAttribute_t::hipDeviceAttributeVirtualMemoryManagementSupported,
            )
            .map_err(|e| e.into_error(device, 0))?;
            if supported == 0 {
                tracing::info!(
                    device,
                    "hip: device lacks VMM: legacy IPC (hipMalloc arenas, pinning hipIpc exports)"
                );
                return Ok(legacy);
            }
        }
        let prop = driver::allocation_prop(device);
        match driver::mem_get_allocation_granularity(&prop) {
            Ok(g) if g > 0 => Ok(DeviceState {
                granularity: g,
                vmm: true,
            }),
            Ok(_) => Err(Error::Internal(format!(
                "HIP device {device} reported granularity 0"
            ))),
            Err(e) if e.is_not_supported() => {
                tracing::info!(
                    device,
                    runtime = %Self::version_text(self.runtime_version),
                    "hip: hipMemGetAllocationGranularity not supported: legacy IPC (hipMalloc arenas, pinning hipIpc exports)"
                );
                Ok(legacy)
            }
            Err(e) => Err(e.into_error(device, 0)),
        }
    }

    /// The device's state with the device made current for the caller's runtime calls.
    fn set(&self, device: DeviceId) -> Result<(DeviceState, DeviceGuard)> {
        let state = self.state(device)?;
        let guard = DeviceGuard::set(device).map_err(|e| e.into_error(device, 0))?;
        Ok((state, guard))
    }

    /// Check an arena size against the device's granularity.
    fn check_size(state: &DeviceState, device: DeviceId, bytes: u64) -> Result<usize> {
        if bytes == 0 || bytes % state.granularity != 0 {
            return Err(Error::invalid(format!(
                "{bytes} bytes is not a positive multiple of device {device}'s granularity ({} bytes)",
                state.granularity
            )));
        }
        to_usize(bytes)
    }

    /// Reserve an address range for `n` bytes, map `handle` there and make it read-write for
    /// `device`. On failure everything this did is undone (the handle stays the caller's).
    fn reserve_map_access(
        state: &DeviceState,
        device: DeviceId,
        handle: u64,
        n: usize,
    ) -> Result<u64, HipError> {
        let base = driver::mem_address_reserve(n, to_usize(state.granularity).unwrap_or(0))?;
        // SAFETY: `base..base + n` is the reservation just made, with nothing mapped; `handle`
        // is a live allocation handle (the caller's contract).
        if let Err(e) = unsafe { driver::mem_map(base, n, handle) } {
            // SAFETY: our own reservation, nothing mapped in it, freed once.
            Self::warn_undo(device, unsafe { driver::mem_address_free(base, n) });
            return Err(e);
        }
        // SAFETY: `base..base + n` was just mapped.
        if let Err(e) = unsafe { driver::mem_set_access(base, n, device) } {
            // SAFETY: our own fresh mapping, never used by device work.
            Self::warn_undo(device, unsafe { driver::mem_unmap(base, n) });
            // SAFETY: our own reservation, now unmapped, freed once.
            Self::warn_undo(device, unsafe { driver::mem_address_free(base, n) });
            return Err(e);
        }
        Ok(base)
    }

    /// Log a failure while undoing a half-done operation (the first error is what we return).
    fn warn_undo(device: DeviceId, result: Result<(), HipError>) {
        if let Err(e) = result {
            tracing::warn!(device, call = e.call, error = %e.message(), "hip: undo step failed");
        }
    }

    /// Whether `kind` is an arena (as opposed to an import).
    fn is_arena(kind: RegionKind) -> bool {
        matches!(kind, RegionKind::Arena { .. } | RegionKind::MallocArena)
    }

    /// The region an [`ArenaMem`] describes.
    fn arena_region(arena: &ArenaMem) -> Region {
        Region {
            device: arena.device,
            bytes: arena.bytes,
            kind: if arena.handle == 0 {
                RegionKind::MallocArena
            } else {
                RegionKind::Arena {
                    handle: arena.handle,
                }
            },
        }
    }

    /// Remove a live region, checking the caller's view of it.
    fn take_region(
        &self,
        base: u64,
        expect: impl Fn(&Region) -> bool,
        what: &str,
    ) -> Result<Region> {
        let mut regions = self.regions.write();
        match regions.get(&base).copied() {
            Some(region) if expect(&region) => {
                regions.remove(&base);
                Ok(region)
            }
            Some(region) => Err(Error::invalid(format!(
                "{what} at {base:#x} does not match the backend's record (device {}, {} bytes, {:?})",
                region.device, region.bytes, region.kind
            ))),
            None => Err(Error::UnknownPointer {
                ptr: base,
                why: format!("not a live {what} of the hip backend (already destroyed?)"),
            }),
        }
    }

    /// Tear down one region (the caller removed it from the registry and synchronized).
    fn teardown(&self, base: u64, region: Region) -> Result<()> {
        let device = region.device;
        let set = to_usize(region.bytes).and_then(|n| {
            DeviceGuard::set(device)
                .map(|guard| (n, guard))
                .map_err(|e| e.into_error(device, 0))
        });
        let (n, _device) = match set {
            Ok(set) => set,
            Err(e) => {
                self.regions.write().insert(base, region);
                return Err(e);
            }
        };
        let result = match region.kind {
            RegionKind::Arena { .. } | RegionKind::Import => {
                // SAFETY: a whole mapping of ours, just removed from the registry (nobody else
                // can reach it through the backend); the caller synchronized the device.
                if let Err(e) = unsafe { driver::mem_unmap(base, n) } {
                    self.regions.write().insert(base, region);
                    return Err(e.into_error(device, 0));
                }
                // SAFETY: our own reservation, now unmapped, freed once.
                let freed = unsafe { driver::mem_address_free(base, n) };
                let released = match region.kind {
                    // SAFETY: the arena's own handle, released once (its record is gone).
                    RegionKind::Arena { handle } => unsafe { driver::mem_release(handle) },
                    _ => Ok(()),
                };
                freed.and(released)
            }
            // SAFETY: our own hipMalloc allocation, just removed from the registry, freed once;
            // the caller synchronized.
            RegionKind::MallocArena => unsafe { driver::free(base) },
            // SAFETY: our own opened IPC handle, just removed from the registry, closed once.
            RegionKind::IpcImport => unsafe { driver::ipc_close_mem_handle(base) },
        };
        result.map_err(|e| e.into_error(device, 0))
    }

    /// Import a VMM fd: import, map, release the import's handle.
    fn import_fd(
        state: &DeviceState,
        device: DeviceId,
        fd: std::os::fd::BorrowedFd<'_>,
        bytes: u64,
        n: usize,
    ) -> Result<u64> {
        let handle = driver::mem_import_fd(fd).map_err(|e| e.into_error(device, bytes))?;
        let mapped = Self::reserve_map_access(state, device, handle, n);
        // The mapping (if any) holds the memory now: give the import's handle back at once.
        // SAFETY: the handle just imported, released once.
        let released = unsafe { driver::mem_release(handle) };
        match (mapped, released) {
            (Ok(base), Ok(())) => Ok(base),
            (Err(e), released) => {
                Self::warn_undo(device, released);
                Err(e.into_error(device, bytes))
            }
            (Ok(base), Err(e)) => {
                // SAFETY: our own fresh mapping, never used by device work.
                Self::warn_undo(device, unsafe { driver::mem_unmap(base, n) });
                // SAFETY: our own reservation, now unmapped, freed once.
                Self::warn_undo(device, unsafe { driver::mem_address_free(base, n) });
                Err(e.into_error(device, bytes))
            }
        }
    }
}

impl Backend for HipBackend {
    fn name(&self) -> &'static str {
        BACKEND
    }

    fn device_count(&self) -> Result<usize> {
        Ok(self.device_count)
    }

    fn granularity(&self, device: DeviceId) -> Result<u64> {
        Ok(self.state(device)?.granularity)
    }

    fn mem_info(&self, device: DeviceId) -> Result<MemInfo> {
        let (_state, _device) = self.set(device)?;
        let (free, total) = driver::mem_get_info().map_err(|e| e.into_error(device, 0))?;
        Ok(MemInfo { free, total })
    }

    fn create_arena(&self, device: DeviceId, bytes: u64) -> Result<ArenaMem> {
        let state = self.state(device)?;
        let n = Self::check_size(&state, device, bytes)?;
        let (_, current) = self.set(device)?;
        let (base, handle, kind) = if state.vmm {
            let prop = driver::allocation_prop(device);
            let handle = driver::mem_create(n, &prop).map_err(|e| e.into_error(device, bytes))?;
            let base = match Self::reserve_map_access(&state, device, handle, n) {
                Ok(base) => base,
                Err(e) => {
                    // SAFETY: the handle just created, unmapped, released once.
                    Self::warn_undo(device, unsafe { driver::mem_release(handle) });
                    return Err(e.into_error(device, bytes));
                }
            };
            (base, handle, RegionKind::Arena { handle })
        } else {
            let base = driver::malloc(n).map_err(|e| e.into_error(device, bytes))?;
            (base, 0, RegionKind::MallocArena)
        };
        drop(current);
        self.regions.write().insert(
            base,
            Region {
                device,
                bytes,
                kind,
            },
        );
        tracing::debug!(device, base, bytes, vmm = state.vmm, "hip: arena created");
        Ok(ArenaMem {
            device,
            base,
            bytes,
            handle,
        })
    }

    fn destroy_arena(&self, arena: ArenaMem) -> Result<()> {
        let expect = Self::arena_region(&arena);
        let region = self.take_region(arena.base, |r| *r == expect, "arena")?;
        self.teardown(arena.base, region)?;
        tracing::debug!(
            device = arena.device,
            base = arena.base,
            bytes = arena.bytes,
            "hip: arena destroyed"
        );
        Ok(())
    }

    fn export(&self, arena: &ArenaMem) -> Result<Export> {
        let regions = self.regions.read();
        let expect = Self::arena_region(arena);
        if regions.get(&arena.base) != Some(&expect) {
            return Err(Error::UnknownPointer {
                ptr: arena.base,
                why: "not a live arena of the hip backend".into(),
            });
        }
        let (_state, _device) = self.set(arena.device)?;
        match expect.kind {
            RegionKind::Arena { handle } => {
                // SAFETY: the handle of a live arena (checked above; the read lock keeps it
                // live), created with a POSIX fd handle type requested.
                let fd = unsafe { driver::mem_export_fd(handle) }
                    .map_err(|e| e.into_error(arena.device, 0))?;
                Ok(Export {
                    payload: ExportPayload::Fd(fd),
                    kind: ExportKind::Releasable,
                })
            }
            _ => {
                // SAFETY: the base of a live hipMalloc arena (checked above; the read lock
                // keeps it live).
                let bytes = unsafe { driver::ipc_get_mem_handle(arena.base) }
                    .map_err(|e| e.into_error(arena.device, 0))?;
                Ok(Export {
                    payload: ExportPayload::Bytes(bytes),
                    kind: ExportKind::Pinning,
                })
            }
        }
    }

    fn close_export(&self, _arena: &ArenaMem, export: Export) -> Result<()> {
        match export.payload {
            // Dropping the OwnedFd closes it: the runtime's reference ends with the fd.
            ExportPayload::Fd(fd) => {
                drop(fd);
                Ok(())
            }
            // A hipIpc handle has nothing to close on the exporting side: the memory stays
            // pinned where the runtime pins it (ExportKind::Pinning).
            ExportPayload::Bytes(bytes) => {
                drop(bytes);
                Ok(())
            }
        }
    }

    fn import(&self, device: DeviceId, source: ImportSource<'_>, bytes: u64) -> Result<Mapping> {
        let state = self.state(device)?;
        let n = Self::check_size(&state, device, bytes)?;
        let (base, kind) = match source {
            ImportSource::Fd(fd) => {
                if !state.vmm {
                    return Err(Error::invalid(format!(
                        "HIP device {device} uses legacy IPC: it cannot import VMM fds"
                    )));
                }
                let (_, _current) = self.set(device)?;
                let base = Self::import_fd(&state, device, fd, bytes, n)?;
                (base, RegionKind::Import)
            }
            ImportSource::Bytes(handle) => {
                let handle: &[u8; IPC_HANDLE_BYTES] = handle.try_into().map_err(|_| {
                    Error::invalid(format!(
                        "a hipIpc handle is {IPC_HANDLE_BYTES} bytes, got {}",
                        handle.len()
                    ))
                })?;
                let (_, _current) = self.set(device)?;
                let base =
                    driver::ipc_open_mem_handle(handle).map_err(|e| e.into_error(device, bytes))?;
                (base, RegionKind::IpcImport)
            }
        };
        self.regions.write().insert(
            base,
            Region {
                device,
                bytes,
                kind,
            },
        );
        tracing::debug!(device, base, bytes, ?kind, "hip: import mapped");
        Ok(Mapping {
            device,
            base,
            bytes,
            handle: 0,
        })
    }

    fn unmap_import(&self, mapping: Mapping) -> Result<()> {
        let region = self.take_region(
            mapping.base,
            |r| r.device == mapping.device && r.bytes == mapping.bytes && !Self::is_arena(r.kind),
            "import mapping",
        )?;
        self.teardown(mapping.base, region)?;
        tracing::debug!(
            device = mapping.device,
            base = mapping.base,
            "hip: import unmapped"
        );
        Ok(())
    }

    fn record_event(&self, device: DeviceId, stream: StreamId) -> Result<Event> {
        let (_state, _device) = self.set(device)?;
        let raw = driver::event_create().map_err(|e| e.into_error(device, 0))?;
        // SAFETY: `raw` was just created; the stream is the caller's (see the module docs).
        if let Err(e) = unsafe { driver::event_record(raw, stream.0) } {
            // SAFETY: the event just created, destroyed once.
            Self::warn_undo(device, unsafe { driver::event_destroy(raw) });
            return Err(e.into_error(device, 0));
        }
        self.events.write().insert(raw, device);
        Ok(Event { device, raw })
    }

    fn event_done(&self, event: &Event) -> Result<bool> {
        let events = self.events.read();
        if events.get(&event.raw) != Some(&event.device) {
            return Err(Error::invalid(format!(
                "event {:#x} on device {} is not a live event of the hip backend",
                event.raw, event.device
            )));
        }
        let (_state, _device) = self.set(event.device)?;
        // SAFETY: a live event (checked above; the read lock keeps it from being destroyed).
        unsafe { driver::event_query(event.raw) }.map_err(|e| e.into_error(event.device, 0))
    }

    fn destroy_event(&self, event: Event) -> Result<()> {
        {
            let mut events = self.events.write();
            if events.get(&event.raw) != Some(&event.device) {
                return Err(Error::invalid(format!(
                    "event {:#x} on device {} is not a live event of the hip backend (destroyed twice?)",
                    event.raw, event.device
                )));
            }
            events.remove(&event.raw);
        }
        let (_state, _device) = self.set(event.device)?;
        // SAFETY: a live event, just removed from the registry, destroyed once.
        unsafe { driver::event_destroy(event.raw) }.map_err(|e| e.into_error(event.device, 0))
    }

    fn synchronize(&self, device: DeviceId) -> Result<()> {
        let (_state, _device) = self.set(device)?;
        driver::device_synchronize().map_err(|e| e.into_error(device, 0))
    }
}

impl Drop for HipBackend {
    /// Destroys what the owner left behind (with a warning: the pool should have done it).
    fn drop(&mut self) {
        let events: Vec<(u64, DeviceId)> = self.events.get_mut().drain().collect();
        let regions: Vec<(u64, Region)> =
            std::mem::take(self.regions.get_mut()).into_iter().collect();
        if !events.is_empty() || !regions.is_empty() {
            tracing::warn!(
                events = events.len(),
                regions = regions.len(),
                "hip backend dropped with live events/arenas/imports: destroying them"
            );
        }
        for (raw, device) in events {
            if let Ok(_device) = DeviceGuard::set(device) {
                // SAFETY: a live event of ours, taken out of the registry, destroyed once.
                Self::warn_undo(device, unsafe { driver::event_destroy(raw) });
            }
        }
        let mut synced = Vec::new();
        for (base, region) in regions {
            if !synced.contains(&region.device) {
                if let Err(e) = self.synchronize(region.device) {
                    tracing::warn!(device = region.device, error = %e, "hip: synchronize before teardown failed");
                }
                synced.push(region.device);
            }
            if let Err(e) = self.teardown(base, region) {
                tracing::warn!(device = region.device, base, error = %e, "hip: teardown in drop failed");
            }
        }
    }
}
