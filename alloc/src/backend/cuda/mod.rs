//! The CUDA backend: arenas on the CUDA driver's virtual memory management (VMM) API.
//!
//! Every raw driver call lives in `driver` (cudarc `driver::sys`, libcuda loaded at run
//! time); this module builds [`CudaBackend`] on those wrappers.
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
//! The backend lives with PyTorch's device and context: it never creates contexts and never
//! leaves one current. Each device's *primary* context (the one the CUDA runtime uses) is
//! retained lazily on the first call for that device and released when the backend drops.
//! Every call that needs a context pushes that primary context and pops it again when done
//! (an RAII guard), so the calling thread's current context after a call is what it was
//! before. Per device the backend caches the `CUdevice`, the retained context and the VMM
//! allocation granularity (MINIMUM, for the exact properties arenas use).
//!
//! # Registries
//! The backend records every live arena, import mapping and event it handed out. The
//! [`Backend`] methods are safe functions taking plain integers, so each call checks its
//! argument against these records before the driver sees it: destroying an arena twice,
//! querying a destroyed event or copying outside a live arena is an error, not undefined
//! behaviour. Streams are the exception: a [`StreamId`] is the caller's `CUstream` and must be
//! 0 (the legacy default stream), 1/2 (`CU_STREAM_LEGACY`/`CU_STREAM_PER_THREAD`) or a live
//! stream of the device's primary context.
//!
//! # Memory
//! An arena is `cuMemCreate` (pinned, on the device, exportable as a POSIX fd, and
//! GPUDirect-RDMA capable where the device supports that for VMM memory, as PyTorch's
//! expandable segments do) + `cuMemAddressReserve` + `cuMemMap` + `cuMemSetAccess`.
//! Exports are `cuMemExportToShareableHandle` fds ([`ExportKind::Releasable`]): an open fd
//! keeps the physical memory held after the arena is destroyed, until it is closed. Imports
//! map the whole shared allocation and release their handle at once, so the mapping alone
//! holds the memory until [`Backend::unmap_import`].

mod driver;

use std::collections::{BTreeMap, HashMap};
use std::sync::OnceLock;

use cudarc::driver::sys;
use parking_lot::{Mutex, RwLock};

use crate::backend::{
    ArenaMem, Backend, DeviceId, Event, Export, ExportKind, ExportPayload, ImportSource, Mapping,
    MemInfo, StreamId,
};
use crate::error::{Error, Result};

use driver::{Context, CtxGuard, CuError, LoadError, BACKEND};

/// What the backend caches per device once it first used it.
#[derive(Debug, Clone, Copy)]
struct DeviceState {
    /// The driver's device handle.
    cu_device: sys::CUdevice,
    /// The device's primary context, retained by this backend.
    ctx: Context,
    /// VMM allocation granularity (MINIMUM) for the arena properties.
    granularity: u64,
    /// Whether arenas are created GPUDirect-RDMA capable.
    rdma_capable: bool,
}

/// What a live address range of the backend is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RegionKind {
    /// An arena created here; the allocation handle it owns.
    Arena { handle: u64 },
    /// An imported mapping (its allocation handle was released right after mapping).
    Import,
}

/// A live, mapped address range: an arena or an import.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Region {
    device: DeviceId,
    bytes: u64,
    kind: RegionKind,
}

/// The CUDA backend (see the module documentation).
#[derive(Debug)]
pub struct CudaBackend {
    /// Devices the driver reported at start.
    device_count: usize,
    /// `cuDriverGetVersion` (e.g. 13000).
    driver_version: i32,
    /// Per device, filled on first use.
    devices: Vec<OnceLock<DeviceState>>,
    /// Serialises the first use of a device (retaining its primary context once).
    init_lock: Mutex<()>,
    /// Live arenas and import mappings by base address. Calls that use a range hold the read
    /// lock for their driver call; destroy/unmap remove the range under the write lock first.
    regions: RwLock<BTreeMap<u64, Region>>,
    /// Live events (as integers) and their device; same locking as `regions`.
    events: RwLock<HashMap<u64, DeviceId>>,
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

/// A `u64` byte count as the driver's `size_t`.
fn to_usize(bytes: u64) -> Result<usize> {
    usize::try_from(bytes).map_err(|_| Error::invalid(format!("{bytes} bytes do not fit in usize")))
}

impl CudaBackend {
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
        let driver_version = driver::driver_version()
            .map_err(|e| e.into_unavailable("could not read the CUDA driver version"))?;
        let count = driver::device_count()
            .map_err(|e| e.into_unavailable("could not count CUDA devices"))?;
        let device_count = usize::try_from(count).unwrap_or(0);
        if device_count == 0 {
            return Err(Error::Unavailable(format!(
                "no CUDA device (driver {}.{})",
                driver_version / 1000,
                driver_version % 1000 / 10
            )));
        }
        tracing::debug!(device_count, driver_version, "cuda backend ready");
        Ok(CudaBackend {
            device_count,
            driver_version,
            devices: (0..device_count).map(|_| OnceLock::new()).collect(),
            init_lock: Mutex::new(()),
            regions: RwLock::new(BTreeMap::new()),
            events: RwLock::new(HashMap::new()),
        })
    }

    /// Whether [`CudaBackend::new`] would succeed: libcuda loads, the driver initialises and
    /// there is at least one device. Never panics.
    pub fn is_available() -> bool {
        CudaBackend::new().is_ok()
    }

    /// The driver's CUDA version as `cuDriverGetVersion` reports it (13000 = CUDA 13.0).
    pub fn driver_version(&self) -> i32 {
        self.driver_version
    }

    /// The calling thread's current CUDA context as an integer (0 = none): for tests that
    /// check the backend leaves the caller's context alone.
    ///
    /// # Errors
    /// [`Error::Backend`] if `cuCtxGetCurrent` fails.
    pub fn current_context(&self) -> Result<u64> {
        driver::ctx_get_current().map_err(|e| e.into_error(-1, 0))
    }

    /// Copy `src` to device address `dst` (blocking). For tests and benches.
    ///
    /// `dst..dst + src.len()` must lie inside one live arena or import mapping of this
    /// backend; the copy runs on the legacy default stream with that device's context pushed.
    ///
    /// # Errors
    /// [`Error::UnknownPointer`] outside a live range, [`Error::Backend`] if the copy fails.
    pub fn memcpy_htod(&self, dst: u64, src: &[u8]) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        let regions = self.regions.read();
        let device = Self::range_device(&regions, dst, src.len() as u64)?;
        let state = self.state(device)?;
        // SAFETY: the primary context is retained while the backend lives.
        let _ctx = unsafe { CtxGuard::push(state.ctx) }.map_err(|e| e.into_error(device, 0))?;
        // SAFETY: the range lies in a live arena or mapping of this backend (checked above),
        // kept mapped by the read lock we hold for the copy; device memory is never host memory.
        unsafe { driver::memcpy_htod(dst, src) }.map_err(|e| e.into_error(device, 0))
    }

    /// Copy from device address `src` into `dst` (blocking). For tests and benches.
    ///
    /// `src..src + dst.len()` must lie inside one live arena or import mapping.
    ///
    /// # Errors
    /// [`Error::UnknownPointer`] outside a live range, [`Error::Backend`] if the copy fails.
    pub fn memcpy_dtoh(&self, dst: &mut [u8], src: u64) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        let regions = self.regions.read();
        let device = Self::range_device(&regions, src, dst.len() as u64)?;
        let state = self.state(device)?;
        // SAFETY: the primary context is retained while the backend lives.
        let _ctx = unsafe { CtxGuard::push(state.ctx) }.map_err(|e| e.into_error(device, 0))?;
        // SAFETY: the range lies in a live arena or mapping of this backend (checked above),
        // kept mapped by the read lock we hold for the copy.
        unsafe { driver::memcpy_dtoh(dst, src) }.map_err(|e| e.into_error(device, 0))
    }

    /// Set `bytes` bytes at device address `dst` to `value` (on the legacy default stream:
    /// ordered before later copies and default-stream work). For tests and benches.
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
        let state = self.state(device)?;
        // SAFETY: the primary context is retained while the backend lives.
        let _ctx = unsafe { CtxGuard::push(state.ctx) }.map_err(|e| e.into_error(device, 0))?;
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
                why: format!("{len} bytes from here are not inside a live arena or import of the cuda backend"),
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

    /// The device's cached state, retaining its primary context on first use.
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
        let state = Self::init_device(device)?;
        Ok(*slot.get_or_init(|| state))
    }

    /// First use of a device: check VMM and POSIX-fd support, retain the primary context,
    /// read the granularity.
    fn init_device(device: DeviceId) -> Result<DeviceState> {
        let cu_device = driver::device_get(device).map_err(|e| e.into_error(device, 0))?;
        let attribute = |attribute| {
            driver::device_attribute(cu_device, attribute).map_err(|e| e.into_error(device, 0))
        };
        use sys::CUdevice_attribute as A;
        if attribute(A::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)? == 0 {
            return Err(Error::Unavailable(format!(
                "CUDA device {device} does not support virtual memory management (cuMemCreate/cuMemMap)"
            )));
        }
        if attribute(A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED)? == 0 {
            return Err(Error::Unavailable(format!(
                "CUDA device {device} cannot export memory as POSIX file descriptors"
            )));
        }
        // As PyTorch's expandable segments: RDMA-capable arenas where the device allows it (for
        // UCX/NIXL transfers); an older driver that does not know the attribute means no.
        let rdma_capable =
            attribute(A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED)
                .is_ok_and(|flag| flag != 0);
        let ctx = driver::primary_ctx_retain(cu_device).map_err(|e| e.into_error(device, 0))?;
        let granularity = {
            // SAFETY: `ctx` was just retained.
            let guard = unsafe { CtxGuard::push(ctx) };
            let prop = driver::allocation_prop(device, rdma_capable);
            let granularity =
                guard.and_then(|_guard| driver::mem_get_allocation_granularity(&prop));
            match granularity {
                Ok(g) if g > 0 => Ok(g),
                Ok(_) => Err(Error::Internal(format!(
                    "CUDA device {device} reported granularity 0"
                ))),
                Err(e) => Err(e.into_error(device, 0)),
            }
        };
        let granularity = match granularity {
            Ok(g) => g,
            Err(e) => {
                // SAFETY: gives back the retain taken above, which nothing else uses.
                if let Err(release) = unsafe { driver::primary_ctx_release(cu_device) } {
                    tracing::warn!(device, error = %release.message(), "cuda: releasing the primary context failed");
                }
                return Err(e);
            }
        };
        tracing::debug!(
            device,
            granularity,
            rdma_capable,
            ctx = ctx.as_u64(),
            "cuda device ready"
        );
        Ok(DeviceState {
            cu_device,
            ctx,
            granularity,
            rdma_capable,
        })
    }

    /// Push the device's primary context (retaining it on first use).
    fn push(&self, device: DeviceId) -> Result<(DeviceState, CtxGuard)> {
        let state = self.state(device)?;
        // SAFETY: the primary context is retained while the backend lives.
        let guard = unsafe { CtxGuard::push(state.ctx) }.map_err(|e| e.into_error(device, 0))?;
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

    /// Reserve an address range for `bytes`, map `handle` there and make it read-write for
    /// `device`. On failure everything this did is undone (the handle stays the caller's).
    /// Call with the device's context pushed.
    fn reserve_map_access(
        state: &DeviceState,
        device: DeviceId,
        handle: u64,
        n: usize,
    ) -> Result<u64, CuError> {
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
    fn warn_undo(device: DeviceId, result: Result<(), CuError>) {
        if let Err(e) = result {
            tracing::warn!(device, call = e.call, error = %e.message(), "cuda: undo step failed");
        }
    }

    /// Remove a live region of the given kind, checking the caller's view of it.
    fn take_region(&self, base: u64, expect: Region, what: &str) -> Result<Region> {
        let mut regions = self.regions.write();
        match regions.get(&base) {
            Some(region) if *region == expect => {
                regions.remove(&base);
                Ok(expect)
            }
            Some(region) => Err(Error::invalid(format!(
                "{what} at {base:#x} does not match the backend's record (device {}, {} bytes, {:?})",
                region.device, region.bytes, region.kind
            ))),
            None => Err(Error::UnknownPointer {
                ptr: base,
                why: format!("not a live {what} of the cuda backend (already destroyed?)"),
            }),
        }
    }

    /// Tear down one region (the caller removed it from the registry and synchronized).
    fn teardown(&self, base: u64, region: Region) -> Result<()> {
        let device = region.device;
        let pushed =
            to_usize(region.bytes).and_then(|n| self.push(device).map(|(_state, ctx)| (n, ctx)));
        let (n, _ctx) = match pushed {
            Ok(pushed) => pushed,
            Err(e) => {
                self.regions.write().insert(base, region);
                return Err(e);
            }
        };
        // SAFETY: a whole mapping of ours, just removed from the registry (nobody else can
        // reach it through the backend); the caller synchronized the device.
        if let Err(e) = unsafe { driver::mem_unmap(base, n) } {
            self.regions.write().insert(base, region);
            return Err(e.into_error(device, 0));
        }
        // SAFETY: our own reservation, now unmapped, freed once.
        let freed = unsafe { driver::mem_address_free(base, n) };
        let released = match region.kind {
            // SAFETY: the arena's own handle, released once (its record is gone).
            RegionKind::Arena { handle } => unsafe { driver::mem_release(handle) },
            RegionKind::Import => Ok(()),
        };
        freed.and(released).map_err(|e| e.into_error(device, 0))
    }
}

impl Backend for CudaBackend {
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
        let (_state, _ctx) = self.push(device)?;
        let (free, total) = driver::mem_get_info().map_err(|e| e.into_error(device, 0))?;
        Ok(MemInfo { free, total })
    }

    fn create_arena(&self, device: DeviceId, bytes: u64) -> Result<ArenaMem> {
        let state = self.state(device)?;
        let n = Self::check_size(&state, device, bytes)?;
        let (_, ctx) = self.push(device)?;
        let prop = driver::allocation_prop(device, state.rdma_capable);
        let handle = driver::mem_create(n, &prop).map_err(|e| e.into_error(device, bytes))?;
        let base = match Self::reserve_map_access(&state, device, handle, n) {
            Ok(base) => base,
            Err(e) => {
                // SAFETY: the handle just created, unmapped, released once.
                Self::warn_undo(device, unsafe { driver::mem_release(handle) });
                return Err(e.into_error(device, bytes));
            }
        };
        drop(ctx);
        self.regions.write().insert(
            base,
            Region {
                device,
                bytes,
                kind: RegionKind::Arena { handle },
            },
        );
        tracing::debug!(device, base, bytes, "cuda: arena created");
        Ok(ArenaMem {
            device,
            base,
            bytes,
            handle,
        })
    }

    fn destroy_arena(&self, arena: ArenaMem) -> Result<()> {
        let expect = Region {
            device: arena.device,
            bytes: arena.bytes,
            kind: RegionKind::Arena {
                handle: arena.handle,
            },
        };
        let region = self.take_region(arena.base, expect, "arena")?;
        self.teardown(arena.base, region)?;
        tracing::debug!(
            device = arena.device,
            base = arena.base,
            bytes = arena.bytes,
            "cuda: arena destroyed"
        );
        Ok(())
    }

    fn export(&self, arena: &ArenaMem) -> Result<Export> {
        let regions = self.regions.read();
        let expect = Region {
            device: arena.device,
            bytes: arena.bytes,
            kind: RegionKind::Arena {
                handle: arena.handle,
            },
        };
        if regions.get(&arena.base) != Some(&expect) {
            return Err(Error::UnknownPointer {
                ptr: arena.base,
                why: "not a live arena of the cuda backend".into(),
            });
        }
        let (_state, _ctx) = self.push(arena.device)?;
        // SAFETY: the handle of a live arena (checked above; the read lock keeps it live),
        // created with POSIX_FILE_DESCRIPTOR requested.
        let fd = unsafe { driver::mem_export_fd(arena.handle) }
            .map_err(|e| e.into_error(arena.device, 0))?;
        Ok(Export {
            payload: ExportPayload::Fd(fd),
            kind: ExportKind::Releasable,
        })
    }

    fn close_export(&self, _arena: &ArenaMem, export: Export) -> Result<()> {
        match export.payload {
            // Dropping the OwnedFd closes it: the driver's reference ends with the fd.
            ExportPayload::Fd(fd) => {
                drop(fd);
                Ok(())
            }
            ExportPayload::Bytes(_) => Err(Error::invalid(
                "the cuda backend only makes fd exports; this one holds bytes",
            )),
        }
    }

    fn import(&self, device: DeviceId, source: ImportSource<'_>, bytes: u64) -> Result<Mapping> {
        let state = self.state(device)?;
        let n = Self::check_size(&state, device, bytes)?;
        let fd = match source {
            ImportSource::Fd(fd) => fd,
            ImportSource::Bytes(_) => {
                return Err(Error::invalid(
                    "the cuda backend imports POSIX fds only (legacy cuIpc byte handles are not supported yet)",
                ))
            }
        };
        let (_, ctx) = self.push(device)?;
        let handle = driver::mem_import_fd(fd).map_err(|e| e.into_error(device, bytes))?;
        let mapped = Self::reserve_map_access(&state, device, handle, n);
        // The mapping (if any) holds the memory now: give the import's handle back at once.
        // SAFETY: the handle just imported, released once.
        let released = unsafe { driver::mem_release(handle) };
        let base = match (mapped, released) {
            (Ok(base), Ok(())) => base,
            (Err(e), released) => {
                Self::warn_undo(device, released);
                return Err(e.into_error(device, bytes));
            }
            (Ok(base), Err(e)) => {
                // SAFETY: our own fresh mapping, never used by device work.
                Self::warn_undo(device, unsafe { driver::mem_unmap(base, n) });
                // SAFETY: our own reservation, now unmapped, freed once.
                Self::warn_undo(device, unsafe { driver::mem_address_free(base, n) });
                return Err(e.into_error(device, bytes));
            }
        };
        drop(ctx);
        self.regions.write().insert(
            base,
            Region {
                device,
                bytes,
                kind: RegionKind::Import,
            },
        );
        tracing::debug!(device, base, bytes, "cuda: import mapped");
        Ok(Mapping {
            device,
            base,
            bytes,
            handle: 0,
        })
    }

    fn unmap_import(&self, mapping: Mapping) -> Result<()> {
        let expect = Region {
            device: mapping.device,
            bytes: mapping.bytes,
            kind: RegionKind::Import,
        };
        let region = self.take_region(mapping.base, expect, "import mapping")?;
        self.teardown(mapping.base, region)?;
        tracing::debug!(
            device = mapping.device,
            base = mapping.base,
            "cuda: import unmapped"
        );
        Ok(())
    }

    fn record_event(&self, device: DeviceId, stream: StreamId) -> Result<Event> {
        let (_state, _ctx) = self.push(device)?;
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
                "event {:#x} on device {} is not a live event of the cuda backend",
                event.raw, event.device
            )));
        }
        let (_state, _ctx) = self.push(event.device)?;
        // SAFETY: a live event (checked above; the read lock keeps it from being destroyed).
        unsafe { driver::event_query(event.raw) }.map_err(|e| e.into_error(event.device, 0))
    }

    fn destroy_event(&self, event: Event) -> Result<()> {
        {
            let mut events = self.events.write();
            if events.get(&event.raw) != Some(&event.device) {
                return Err(Error::invalid(format!(
                    "event {:#x} on device {} is not a live event of the cuda backend (destroyed twice?)",
                    event.raw, event.device
                )));
            }
            events.remove(&event.raw);
        }
        let (_state, _ctx) = self.push(event.device)?;
        // SAFETY: a live event, just removed from the registry, destroyed once.
        unsafe { driver::event_destroy(event.raw) }.map_err(|e| e.into_error(event.device, 0))
    }

    fn synchronize(&self, device: DeviceId) -> Result<()> {
        let (_state, _ctx) = self.push(device)?;
        driver::ctx_synchronize().map_err(|e| e.into_error(device, 0))
    }
}

impl Drop for CudaBackend {
    /// Destroys what the owner left behind (with a warning: the pool should have done it),
    /// then gives back every primary context the backend retained.
    fn drop(&mut self) {
        let events: Vec<(u64, DeviceId)> = self.events.get_mut().drain().collect();
        let regions: Vec<(u64, Region)> =
            std::mem::take(self.regions.get_mut()).into_iter().collect();
        if !events.is_empty() || !regions.is_empty() {
            tracing::warn!(
                events = events.len(),
                regions = regions.len(),
                "cuda backend dropped with live events/arenas/imports: destroying them"
            );
        }
        for (raw, device) in events {
            if let Ok((_state, _ctx)) = self.push(device) {
                // SAFETY: a live event of ours, taken out of the registry, destroyed once.
                Self::warn_undo(device, unsafe { driver::event_destroy(raw) });
            }
        }
        let mut synced = Vec::new();
        for (base, region) in regions {
            if !synced.contains(&region.device) {
                if let Err(e) = self.synchronize(region.device) {
                    tracing::warn!(device = region.device, error = %e, "cuda: synchronize before teardown failed");
                }
                synced.push(region.device);
            }
            if let Err(e) = self.teardown(base, region) {
                tracing::warn!(device = region.device, base, error = %e, "cuda: teardown in drop failed");
            }
        }
        for slot in &mut self.devices {
            if let Some(state) = slot.take() {
                // SAFETY: gives back the one retain this backend took for the device; the
                // state was taken out of its slot, so nothing uses the context afterwards.
                if let Err(e) = unsafe { driver::primary_ctx_release(state.cu_device) } {
                    tracing::warn!(error = %e.message(), "cuda: releasing a primary context failed");
                }
            }
        }
    }
}
