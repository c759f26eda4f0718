//! The VMM core: one [`Backend`] for every vendor whose driver has a virtual memory
//! management API (CUDA's `cuMem*`, HIP's `hipMem*`), built on that vendor's [`Driver`].
//!
//! # Layering
//! ```text
//! VmmBackend<D>     this module: the Backend methods; vmm::registry: what is live;
//!                   vmm::teardown: teardown, Drop; vmm::copies; vmm::device: per-device
//!                   state; vmm::access: peers, FABRIC handles, map + set access;
//!                   vmm::split: split_arena (trim)
//!   D: Driver       vmm::driver: the primitives, one per driver operation
//!     cuda::driver  CudaDriver: every raw libcuda call (cudarc driver::sys), legacy cuIpc too
//!     hip::driver   HipDriver: every raw libamdhip64 call (hip-sys), the legacy IPC path too
//! ```
//! All logic lives here: which primitives run in which order, what is undone when one fails,
//! what is checked before the driver sees an argument. A vendor's folder holds only its raw
//! calls (the [`Driver`] implementation) and what is its own alone: how the library is loaded
//! and initialised, and test helpers such as the current context. `cuda::CudaBackend`
//! is `VmmBackend<CudaDriver>`, `hip::HipBackend` is `VmmBackend<HipDriver>`.
//!
//! # Devices
//! The backend lives with PyTorch's device and context: every call that needs a device makes
//! it current through [`Driver::make_current`] (CUDA pushes the device's primary context, HIP
//! sets the device) and the returned guard restores the caller's state when the call is done,
//! so the calling thread's current context or device after a call is what it was before. On
//! the first call for a device the backend opens it ([`Driver::open_device`]: CUDA retains
//! the primary context) and caches it with the arena granularity; [`Drop`] closes it again.
//!
//! # Memory and exports
//! Per device, on first use, the backend picks one of two paths:
//!
//! - **VMM (the default)**: an arena is create (pinned, on the device, exportable as a POSIX
//!   fd, and as a FABRIC handle too where permitted: see below; RDMA-capable where the device
//!   supports it) + reserve + map + set access. Exports are fds ([`ExportKind::Releasable`]):
//!   an open fd keeps the physical memory held after the arena is destroyed, until it is
//!   closed. Imports map the whole shared allocation and release their handle at once, so
//!   the mapping alone holds the memory until [`Backend::unmap_import`].
//! - **Legacy IPC**, only for a driver with [`Driver::LEGACY_IPC`] (CUDA: `cuMemAlloc` +
//!   `cuIpc*`; HIP: `hipMalloc` + `hipIpc*`): an arena is plain device memory; exports are
//!   64-byte handles ([`ExportPayload::Bytes`], [`ExportKind::Pinning`]); imports open such a
//!   handle (with lazy peer access). Pinning because the exporter can never end an export:
//!   both vendors document freeing exported memory before every importer closed it as
//!   undefined behaviour, and ROCm 7.2.x keeps such memory for the life of the exporting
//!   process; so the pool recycles these arenas and never frees them while the process
//!   lives (its start-up probe, `pool/sharing/share.rs`, checks the kind at run time anyway). Used
//!   when asked for ([`VmmBackend::with_legacy_ipc`], config key `legacy_ipc=1`: what UCX's
//!   cuda_ipc transport opens on hosts without FABRIC handles), or, where the driver falls
//!   back on its own ([`LegacyIpc::fallback`]: HIP), when the device lacks VMM (the driver
//!   says so, or the granularity query answers "not supported"). Otherwise a device without
//!   VMM or POSIX-fd export is [`Error::Unavailable`]. Legacy arenas cannot sleep: memory and
//!   address are one, so `release_physical` is [`Error::Unavailable`] and the pool keeps the
//!   arena awake (and reports the error).
//!
//! # Trim
//! [`Backend::split_arena`] (`vmm/split.rs`, where the order is documented) gives each
//! window of a live, awake VMM arena an allocation of its own holding its bytes (copied
//! device to device through one temporary mapping, [`Driver::memcpy_dtod`]) and the rest of
//! the arena's memory back to the driver, at the same addresses; on error the arena is as it
//! was. Each window is then an arena of its own (destroy, export, sleep, wake, split again).
//! The arena's address reservation is freed whole with its last window (CUDA frees a
//! reservation only with the base and size it was reserved with): the registry counts the
//! live windows of every split reservation. Legacy arenas cannot be split.
//!
//! # Peer access
//! VMM memory is reachable only from the devices set access names. On a device's first use
//! the backend asks the driver which other devices can access its memory
//! ([`Driver::can_access_peer`]: `cuDeviceCanAccessPeer`, `hipDeviceCanAccessPeer`; a driver
//! that cannot say means none) and keeps the set (logged at debug). Every VMM mapping (an
//! arena when created, an arena re-created on wake, an import) is made read-write for its
//! own device and all of those peers in one [`Driver::set_access`] call, so an arena made
//! before a second device is first used is reachable from it too; an import on device D of
//! another process's arena is accessible from D and D's peers. Should the driver refuse a
//! grant that names peers (anything but out of memory), the backend warns once, grants the
//! owner alone and stops naming that device's peers: the GPU stays usable, peer access is
//! lost for it. Legacy arenas get no access
//! list (the driver's own peer rules apply; imports open with lazy peer access).
//!
//! # FABRIC handles
//! Where the device reports FABRIC support ([`DeviceSupport::fabric`], CUDA only), VMM arenas
//! are created with POSIX-fd *and* FABRIC handle types, so UCX's cuda_ipc transport (NIXL)
//! can export them; our own exports stay POSIX fds. Config key `fabric_handles`
//! ([`FabricHandles`]): `auto` (the default) retries a create the driver refuses as not
//! permitted or not supported (a host without an IMEX channel) POSIX-only, and keeps that
//! device POSIX-only from then on (logged once, at info); `1` makes the refusal (or a device
//! without support) an error; `0` never asks.
//!
//! # Registries
//! The backend records every live arena, import mapping and event it handed out. The
//! [`Backend`] methods are safe functions taking plain integers, so each call checks its
//! argument against these records before the driver sees it: destroying an arena twice,
//! querying a destroyed event or copying outside a live arena is an error, not undefined
//! behaviour. Split reservations are recorded with their live windows (see Trim). Streams are the exception: a [`StreamId`] is the caller's stream handle and must
//! be 0, one of the vendor's special handles, or a live stream of the device.

mod access;
mod chunk_drop;
mod copies;
mod device;
pub mod driver;
mod grow;
mod pinned;
mod registry;
mod split;
mod teardown;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::AtomicBool;
use std::sync::OnceLock;

use parking_lot::{Mutex, RwLock};

use crate::backend::{
    ArenaMem, Backend, Event, Export, ExportKind, ExportPayload, HostBuffer, ImportSource, Mapping,
    MemInfo,
};
use crate::error::{Error, Result};
use crate::ids::{DeviceId, StreamId};

pub use access::FabricHandles;
use device::DeviceState;
pub use driver::{
    driver_string, DeviceSupport, Driver, DriverError, DriverResult, Failure, LegacyIpc,
    StartFailures,
};
use grow::Chunks;
use registry::{Region, RegionKind, Regions, SplitReservations};

/// A [`Backend`] on one vendor's VMM driver (see the module documentation).
#[derive(Debug)]
pub struct VmmBackend<D: Driver> {
    /// The vendor's primitives.
    driver: D,
    /// Devices the driver reported at start.
    device_count: usize,
    /// Use the legacy IPC path on every device, even where VMM works.
    legacy_ipc: bool,
    /// Whether VMM arenas get FABRIC handles too (config key `fabric_handles`).
    fabric_mode: FabricHandles,
    /// Per device: whether its arenas are created with FABRIC handles now (set on first use,
    /// cleared for good when the driver refuses them in `auto` mode).
    fabric: Vec<AtomicBool>,
    /// Per device: whether mappings are still made accessible from its peers (cleared for
    /// good when the driver refuses a grant that names them; the owner alone is retried).
    peer_grants: Vec<AtomicBool>,
    /// Per device, filled on first use.
    devices: Vec<OnceLock<DeviceState<D::Device>>>,
    /// Serialises the first use of a device (opening it once).
    init_lock: Mutex<()>,
    /// Live arenas and import mappings by base address. Calls that use a range hold the read
    /// lock for their driver call; destroy, unmap, sleep and wake take the region out under
    /// the write lock first and make their driver calls without it.
    regions: RwLock<Regions>,
    /// Reservations of split arenas, freed with their last window (`split_arena`). Locked
    /// alone, never while waiting for `regions`.
    splits: Mutex<SplitReservations>,
    /// Growable arenas' reservations and the chunks of grown arenas and their imports after
    /// the first, by base (`grow.rs`). Locked alone, never while waiting for `regions`.
    chunks: Mutex<BTreeMap<u64, Chunks>>,
    /// Live events (as integers) and their device; same locking as `regions`.
    events: RwLock<HashMap<u64, DeviceId>>,
    /// Live pinned host buffers by address: the device they were made with, and how.
    host: Mutex<HashMap<u64, pinned::PinnedHost>>,
    /// Live transfer streams (as integers) and their device.
    streams: Mutex<HashMap<u64, DeviceId>>,
}

/// A `u64` byte count as the driver's `size_t`.
fn to_usize(bytes: u64) -> Result<usize> {
    usize::try_from(bytes).map_err(|_| Error::invalid(format!("{bytes} bytes do not fit in usize")))
}

/// Log a failure while undoing a half-done operation (the first error is what we return).
fn warn_undo(device: DeviceId, result: DriverResult<()>) {
    if let Err(e) = result {
        tracing::warn!(backend = e.backend, device, call = e.call, error = %e.message, "undo step failed");
    }
}

impl<D: Driver> VmmBackend<D> {
    /// Load and initialise the driver and count devices. Opens no device yet: that happens
    /// on the first call for each (CUDA retains its primary context then).
    ///
    /// # Errors
    /// [`Error::Unavailable`] when the library is missing or lacks a needed symbol, when the
    /// driver does not initialise (no usable driver or device), or when there is no device
    /// ("no CUDA device (driver 13.0)", "no HIP device (HIP runtime 5.2.21153)").
    pub fn new() -> Result<Self> {
        let words = D::START_FAILURES;
        D::load()?;
        D::init().map_err(|e| e.into_unavailable(words.init))?;
        let version = D::read_version().map_err(|e| e.into_unavailable(words.version))?;
        let count = D::count_devices().map_err(|e| e.into_unavailable(words.count))?;
        let driver = D::started(version);
        let device_count = usize::try_from(count).unwrap_or(0);
        if device_count == 0 {
            return Err(Error::Unavailable(format!(
                "no {} device ({})",
                D::VENDOR,
                driver.version_text()
            )));
        }
        tracing::debug!(backend = D::NAME, device_count, version = %driver.version_text(), "backend ready");
        Ok(VmmBackend {
            driver,
            device_count,
            legacy_ipc: false,
            fabric_mode: FabricHandles::Auto,
            fabric: (0..device_count).map(|_| AtomicBool::new(false)).collect(),
            peer_grants: (0..device_count).map(|_| AtomicBool::new(true)).collect(),
            devices: (0..device_count).map(|_| OnceLock::new()).collect(),
            init_lock: Mutex::new(()),
            regions: RwLock::new(BTreeMap::new()),
            splits: Mutex::new(BTreeMap::new()),
            chunks: Mutex::new(BTreeMap::new()),
            events: RwLock::new(HashMap::new()),
            host: Mutex::new(HashMap::new()),
            streams: Mutex::new(HashMap::new()),
        })
    }

    /// Whether [`VmmBackend::new`] would succeed: the library loads, the driver initialises
    /// and there is at least one device. Never panics.
    pub fn is_available() -> bool {
        Self::new().is_ok()
    }

    /// The driver's version number as the vendor reports it: `cuDriverGetVersion` (13000 =
    /// CUDA 13.0), `hipRuntimeGetVersion` (50221153 = ROCm 5.2).
    pub fn driver_version(&self) -> i32 {
        self.driver.version()
    }

    /// The calling thread's current CUDA context (0 = none) or HIP device, as an integer: for
    /// tests that check the backend leaves the caller's context or device alone.
    ///
    /// # Errors
    /// [`Error::Backend`] if the driver's query (`cuCtxGetCurrent`, `hipGetDevice`) fails.
    pub fn current_on_thread(&self) -> Result<u64> {
        self.driver
            .current_on_thread()
            .map_err(|e| e.into_error(-1, 0))
    }

    /// Whether arenas on `device` use the legacy IPC path (initialises the device).
    ///
    /// # Errors
    /// [`Error::InvalidDevice`], or a driver error from the device's first use.
    pub fn uses_legacy_ipc(&self, device: DeviceId) -> Result<bool> {
        Ok(!self.state(device)?.vmm)
    }

    /// The region an [`ArenaMem`] describes (handle 0: a legacy arena).
    fn arena_region(arena: &ArenaMem) -> Region {
        Region {
            device: arena.device,
            bytes: arena.bytes,
            kind: if arena.handle == 0 {
                RegionKind::LegacyArena
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
        registry::take_region(&mut self.regions.write(), D::NAME, base, expect, what)
    }

    /// Remove the region at `base` if it is exactly `expect` (sleep and wake, which find
    /// an arena in the state they need or refuse: `InvalidState` with `why()`).
    fn take_exact_region(
        &self,
        base: u64,
        expect: Region,
        why: impl FnOnce() -> String,
    ) -> Result<()> {
        let mut regions = self.regions.write();
        if regions.get(&base) != Some(&expect) {
            return Err(Error::InvalidState(why()));
        }
        regions.remove(&base);
        Ok(())
    }

    /// Record a new live region: an arena just created or an import just mapped.
    fn insert_region(&self, base: u64, device: DeviceId, bytes: u64, kind: RegionKind) {
        let what = if kind.is_arena() {
            "arena created"
        } else {
            "import mapped"
        };
        tracing::debug!(backend = D::NAME, device, base, bytes, ?kind, "{what}");
        self.regions.write().insert(
            base,
            Region {
                device,
                bytes,
                kind,
            },
        );
    }

    /// Check that `event` is live; `twice` words the error for a second destroy.
    fn check_event(events: &HashMap<u64, DeviceId>, event: &Event, twice: &str) -> Result<()> {
        if events.get(&event.raw) == Some(&event.device) {
            return Ok(());
        }
        Err(Error::invalid(format!(
            "event {:#x} on device {} is not a live event of the {} backend{twice}",
            event.raw,
            event.device,
            D::NAME
        )))
    }
}

impl<D: Driver> Backend for VmmBackend<D> {
    fn name(&self) -> &'static str {
        D::NAME
    }

    fn device_count(&self) -> Result<usize> {
        Ok(self.device_count)
    }

    fn granularity(&self, device: DeviceId) -> Result<u64> {
        Ok(self.state(device)?.granularity)
    }

    fn mem_info(&self, device: DeviceId) -> Result<MemInfo> {
        let (_state, _current) = self.make_current(device)?;
        let (free, total) = self
            .driver
            .mem_info()
            .map_err(|e| e.into_error(device, 0))?;
        Ok(MemInfo { free, total })
    }

    fn create_arena(&self, device: DeviceId, bytes: u64) -> Result<ArenaMem> {
        let state = self.state(device)?;
        let n = Self::check_size(&state, device, bytes)?;
        let (_, current) = self.make_current(device)?;
        let d = &self.driver;
        let (base, handle, kind) = if state.vmm {
            let handle = self
                .create_physical(&state, device, n)
                .map_err(|e| e.into_error(device, bytes))?;
            let base = match self.reserve_map_access(&state, device, handle, n) {
                Ok(base) => base,
                Err(e) => {
                    // SAFETY: the handle just created, unmapped, released once.
                    warn_undo(device, unsafe { d.mem_release(handle) });
                    return Err(e.into_error(device, bytes));
                }
            };
            (base, handle, RegionKind::Arena { handle })
        } else {
            let base = d.legacy_alloc(n).map_err(|e| e.into_error(device, bytes))?;
            (base, 0, RegionKind::LegacyArena)
        };
        drop(current);
        self.insert_region(base, device, bytes, kind);
        Ok(ArenaMem {
            device,
            base,
            bytes,
            handle,
        })
    }

    fn create_growable_arena(
        &self,
        device: DeviceId,
        bytes: u64,
        reserve: u64,
    ) -> Result<ArenaMem> {
        self.create_growable(device, bytes, reserve)
    }

    fn can_grow(&self, arena: &ArenaMem, extra: u64) -> bool {
        self.growable(arena, extra)
    }

    fn grow_arena(&self, arena: &ArenaMem, extra: u64) -> Result<ArenaMem> {
        self.grow(arena, extra)
    }

    fn shrink_arena(&self, arena: &ArenaMem, keep: u64) -> Result<(ArenaMem, usize)> {
        self.shrink(arena, keep)
    }

    fn chunk_spans(&self, arena: &ArenaMem) -> Vec<(u64, u64)> {
        self.spans(arena)
    }

    fn drop_chunks(&self, arena: &ArenaMem, doomed: &[usize]) -> Result<Vec<(ArenaMem, usize)>> {
        self.drop_arena_chunks(arena, doomed)
    }

    fn destroy_arena(&self, arena: ArenaMem) -> Result<()> {
        let expect = Self::arena_region(&arena);
        let asleep = Region {
            kind: RegionKind::Asleep,
            ..expect
        };
        let region = self.take_region(arena.base, |r| *r == expect || *r == asleep, "arena")?;
        self.teardown(arena.base, region)?;
        tracing::debug!(
            backend = D::NAME,
            device = arena.device,
            base = arena.base,
            bytes = arena.bytes,
            "arena destroyed"
        );
        Ok(())
    }

    fn export(&self, arena: &ArenaMem) -> Result<Export> {
        let regions = self.regions.read();
        let expect = Self::arena_region(arena);
        if regions.get(&arena.base) != Some(&expect) {
            return Err(Error::UnknownPointer {
                ptr: arena.base,
                why: format!("not a live arena of the {} backend", D::NAME),
            });
        }
        let (_state, _current) = self.make_current(arena.device)?;
        let failed = |e: DriverError| e.into_error(arena.device, 0);
        match expect.kind {
            RegionKind::Arena { handle } => {
                if let Some(chunks) = self.export_chunks(arena, handle)? {
                    return Ok(chunks);
                }
                // SAFETY: the handle of a live arena (checked above; the read lock keeps it
                // live), created exportable as a POSIX fd.
                let fd = unsafe { self.driver.export_fd(handle) }.map_err(failed)?;
                Ok(Export {
                    payload: ExportPayload::Fd(fd),
                    kind: ExportKind::Releasable,
                })
            }
            _ => {
                // SAFETY: the base of a live legacy arena (checked above; the read lock keeps
                // it live).
                let bytes = unsafe { self.driver.ipc_get_handle(arena.base) }.map_err(failed)?;
                Ok(Export {
                    payload: ExportPayload::Bytes(bytes),
                    kind: ExportKind::Pinning,
                })
            }
        }
    }

    fn close_export(&self, _arena: &ArenaMem, export: Export) -> Result<()> {
        match export.payload {
            // Dropping the OwnedFd closes it: the driver's reference ends with the fd.
            ExportPayload::Fd(fd) => {
                drop(fd);
                Ok(())
            }
            ExportPayload::Chunks(fds) => {
                drop(fds);
                Ok(())
            }
            // A legacy IPC handle has nothing to close on the exporting side: the memory stays
            // pinned where the driver pins it (ExportKind::Pinning).
            ExportPayload::Bytes(bytes) if D::LEGACY_IPC.is_some() => {
                drop(bytes);
                Ok(())
            }
            ExportPayload::Bytes(_) => Err(Error::invalid(format!(
                "the {} backend only makes fd exports; this one holds bytes",
                D::NAME
            ))),
        }
    }

    fn import(&self, device: DeviceId, source: ImportSource<'_>, bytes: u64) -> Result<Mapping> {
        let state = self.state(device)?;
        let n = Self::check_size(&state, device, bytes)?;
        let (base, kind) = match source {
            ImportSource::Fd(fd) => {
                if !state.vmm {
                    return Err(Error::invalid(format!(
                        "{} device {device} uses legacy IPC: it cannot import VMM fds",
                        D::VENDOR
                    )));
                }
                let (_, _current) = self.make_current(device)?;
                let base = self.import_fd(&state, device, fd, bytes, n)?;
                (base, RegionKind::Import)
            }
            ImportSource::Chunks(chunks) => {
                if !state.vmm {
                    return Err(Error::invalid(format!(
                        "{} device {device} uses legacy IPC: it cannot import VMM fds",
                        D::VENDOR
                    )));
                }
                let (_, _current) = self.make_current(device)?;
                (
                    self.import_chunks(device, chunks, bytes)?,
                    RegionKind::Import,
                )
            }
            ImportSource::Bytes(handle) => {
                let legacy = D::LEGACY_IPC.ok_or_else(|| {
                    Error::invalid(format!(
                        "the {} backend imports POSIX fds only (legacy IPC byte handles are not supported yet)",
                        D::NAME
                    ))
                })?;
                if handle.len() != legacy.handle_bytes {
                    return Err(Error::invalid(format!(
                        "a {} handle is {} bytes, got {}",
                        legacy.handle_name,
                        legacy.handle_bytes,
                        handle.len()
                    )));
                }
                let (_, _current) = self.make_current(device)?;
                let base = self
                    .driver
                    .ipc_open_handle(handle)
                    .map_err(|e| e.into_error(device, bytes))?;
                (base, RegionKind::LegacyImport)
            }
        };
        self.insert_region(base, device, bytes, kind);
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
            |r| r.device == mapping.device && r.bytes == mapping.bytes && !r.kind.is_arena(),
            "import mapping",
        )?;
        self.teardown(mapping.base, region)?;
        tracing::debug!(
            backend = D::NAME,
            device = mapping.device,
            base = mapping.base,
            "import unmapped"
        );
        Ok(())
    }

    fn record_event(&self, device: DeviceId, stream: StreamId) -> Result<Event> {
        let (_state, _current) = self.make_current(device)?;
        let d = &self.driver;
        let raw = d.event_create().map_err(|e| e.into_error(device, 0))?;
        // SAFETY: `raw` was just created; the stream is the caller's (see the module docs).
        if let Err(e) = unsafe { d.event_record(raw, stream.0) } {
            // SAFETY: the event just created, destroyed once.
            warn_undo(device, unsafe { d.event_destroy(raw) });
            return Err(e.into_error(device, 0));
        }
        self.events.write().insert(raw, device);
        Ok(Event { device, raw })
    }

    fn event_done(&self, event: &Event) -> Result<bool> {
        let events = self.events.read();
        Self::check_event(&events, event, "")?;
        let (_state, _current) = self.make_current(event.device)?;
        // SAFETY: a live event (checked above; the read lock keeps it from being destroyed).
        unsafe { self.driver.event_query(event.raw) }.map_err(|e| e.into_error(event.device, 0))
    }

    fn destroy_event(&self, event: Event) -> Result<()> {
        {
            let mut events = self.events.write();
            Self::check_event(&events, &event, " (destroyed twice?)")?;
            events.remove(&event.raw);
        }
        let (_state, _current) = self.make_current(event.device)?;
        // SAFETY: a live event, just removed from the registry, destroyed once.
        unsafe { self.driver.event_destroy(event.raw) }.map_err(|e| e.into_error(event.device, 0))
    }

    fn release_physical(&self, arena: &ArenaMem) -> Result<()> {
        let expect = Self::arena_region(arena);
        let RegionKind::Arena { handle } = expect.kind else {
            return Err(Error::Unavailable(format!(
                "{}: a legacy IPC arena (legacy_ipc=1, or a device without VMM) cannot sleep: its memory and addresses are one (it stays awake)",
                D::NAME
            )));
        };
        // (A size the driver can take: checked before anything changes.)
        to_usize(arena.bytes)?;
        // The region leaves the registry for the driver calls (as in `teardown`): copies
        // (which hold the read lock across theirs) are done with it once we had the write
        // lock, and later ones, or a second release, find no live arena there.
        self.take_exact_region(arena.base, expect, || {
            format!(
                "{}: release_physical of {:#x}: not a live, awake arena of this backend",
                D::NAME,
                arena.base
            )
        })?;
        let d = &self.driver;
        let layout = self.chunk_layout(arena.base, arena.bytes, handle);
        let current = self.make_current(arena.device).and_then(|current| {
            // Every mapping of ours, registered as awake and now out of the registry (no copy
            // can reach it); the caller synchronized the device and no export or import
            // uses it.
            self.unmap_chunks(arena.base, &layout)
                .map_err(|e| e.into_error(arena.device, 0))?;
            Ok(current)
        });
        let (_state, _current) = match current {
            Ok(current) => current,
            Err(e) => {
                self.regions.write().insert(arena.base, expect);
                return Err(e);
            }
        };
        self.regions.write().insert(
            arena.base,
            Region {
                kind: RegionKind::Asleep,
                ..expect
            },
        );
        // SAFETY: the arena's own handle, now unmapped, released once (the region no
        // longer records it).
        if let Err(e) = unsafe { d.mem_release(handle) } {
            tracing::warn!(backend = D::NAME, error = %e.message, "mem_release of a sleeping arena failed");
        }
        self.release_extra_chunks(arena.device, arena.base);
        Ok(())
    }

    fn restore_physical(&self, arena: &ArenaMem) -> Result<ArenaMem> {
        let state = self.state(arena.device)?;
        let n = to_usize(arena.bytes)?;
        let asleep = Region {
            device: arena.device,
            bytes: arena.bytes,
            kind: RegionKind::Asleep,
        };
        // Out of the registry for the driver calls (as in `release_physical`): a second
        // restore, a release or a destroy of it meanwhile finds no arena there.
        self.take_exact_region(arena.base, asleep, || {
            format!(
                "{}: restore_physical of {:#x}: not a sleeping arena of this backend",
                D::NAME,
                arena.base
            )
        })?;
        let d = &self.driver;
        let device = arena.device;
        let mapped = self.make_current(device).and_then(|(_, _current)| {
            let handle = self
                .create_physical(&state, device, n)
                .map_err(|e| e.into_error(device, arena.bytes))?;
            // `base..base + n` is our reservation with nothing mapped (asleep); `handle` was
            // just created. Access: the device and its peers, as when the arena was first
            // created.
            if let Err(e) = self.map_access(&state, device, arena.base, n, handle) {
                // SAFETY: the handle just created, unmapped (map_access undid its mapping),
                // released once.
                warn_undo(device, unsafe { d.mem_release(handle) });
                return Err(e.into_error(device, arena.bytes));
            }
            Ok(handle)
        });
        let handle = match mapped {
            Ok(handle) => handle,
            Err(e) => {
                self.regions.write().insert(arena.base, asleep);
                return Err(e);
            }
        };
        self.regions.write().insert(
            arena.base,
            Region {
                kind: RegionKind::Arena { handle },
                ..asleep
            },
        );
        Ok(ArenaMem {
            handle,
            ..arena.clone()
        })
    }

    fn can_split(&self, arena: &ArenaMem) -> bool {
        // A legacy IPC arena (`cuMemAlloc` / `hipMalloc`, handle 0) is one allocation with
        // its addresses: it cannot be re-backed. A grown arena splits like any other (its
        // chunks are unmapped and released one by one).
        matches!(Self::arena_region(arena).kind, RegionKind::Arena { .. })
    }

    fn split_arena(&self, arena: &ArenaMem, windows: &[(u64, u64)]) -> Result<Vec<ArenaMem>> {
        self.split(arena, windows)
    }

    fn alloc_host(&self, device: DeviceId, bytes: u64) -> Result<HostBuffer> {
        let n = to_usize(bytes)?;
        if n == 0 {
            return HostBuffer::heap(device, 0);
        }
        let (_state, _current) = self.make_current(device)?;
        let (p, host) = self.pin_new(device, n)?;
        self.host.lock().insert(p, host);
        // SAFETY: `p..p + n` is pinned host memory just made (zero pages), owned by nothing
        // else; it stays valid until free_host (or Drop) frees it.
        Ok(unsafe { HostBuffer::from_pinned(device, p, n) })
    }

    fn free_host(&self, buffer: HostBuffer) {
        let Some(p) = buffer.into_pinned() else {
            return;
        };
        let Some(host) = self.host.lock().remove(&p) else {
            tracing::error!(
                backend = D::NAME,
                ptr = p,
                "free_host of a buffer this backend did not allocate: leaked"
            );
            return;
        };
        self.free_pinned(p, host);
    }

    fn copy_to_host(&self, _device: DeviceId, src: u64, dst: &mut [u8]) -> Result<()> {
        self.memcpy_dtoh(dst, src)
    }

    fn copy_from_host(&self, _device: DeviceId, dst: u64, src: &[u8]) -> Result<()> {
        self.memcpy_htod(dst, src)
    }

    fn create_stream(&self, device: DeviceId) -> Result<StreamId> {
        self.new_stream(device)
    }

    fn destroy_stream(&self, device: DeviceId, stream: StreamId) -> Result<()> {
        self.end_stream(device, stream)
    }

    fn copy_async(
        &self,
        device: DeviceId,
        stream: StreamId,
        dst: u64,
        src: u64,
        bytes: u64,
    ) -> Result<()> {
        self.queue_copy(device, stream, dst, src, bytes)
    }

    fn synchronize(&self, device: DeviceId) -> Result<()> {
        let (_state, _current) = self.make_current(device)?;
        self.driver
            .synchronize()
            .map_err(|e| e.into_error(device, 0))
    }
}
