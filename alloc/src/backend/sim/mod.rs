//! The simulated device: host memory backed by memfd, with the driver's lifetime rules.
//!
//! `SimBackend` is the device that CI, the tests and the default demo run on. It keeps the
//! parts of a real GPU driver that gpu-arena's design depends on and replaces the rest with
//! host memory:
//!
//! - **Memory is real.** An arena is a `memfd` of `bytes` bytes (sized with `ftruncate`,
//!   so pages are only touched when written) mapped `MAP_SHARED` read/write.
//!   [`ArenaMem::base`] is the host address of that mapping, so tests can read and write it.
//! - **A chunk is a memfd, as it is a physical allocation on a GPU.** A growable arena
//!   (`grow.rs`) reserves its address range; each growth makes a new memfd for the new
//!   chunk and maps it right after the last one, so a grown arena is one memfd per chunk,
//!   each mapped from its offset 0 at the chunk's place. [`Backend::drop_chunks`]
//!   (`split.rs`) unmaps the dropped chunks and closes their memfds while the kept chunks'
//!   pages stay mapped where they are, untouched; a trim's [`Backend::split_arena`] gives
//!   each window a new memfd holding a copy of its bytes (new memory on a GPU too). A wake
//!   ([`Backend::restore_physical`]) makes one memfd for the whole arena, as the VMM backend
//!   creates one allocation.
//! - **Exports are real fds.** [`Backend::export`] hands out a `dup` of each chunk's memfd
//!   (with `CLOEXEC`: one fd for an arena of one chunk, one per chunk for a grown one),
//!   which can cross processes over `SCM_RIGHTS`; [`Backend::import`] `mmap`s such fds, in
//!   this process or another one, so a consumer sees the producer's bytes. The inode of
//!   every chunk memfd names its arena, so an import of the backend's own export counts as
//!   that arena's mapping and `close_export` checks that the fds are the arena's.
//! - **The ledger follows the driver, not the kernel.** The kernel frees a memfd when its
//!   last fd and mapping go; the sim additionally keeps a per-device ledger of *held* bytes
//!   that reproduces what we measured on an H200 with the CUDA VMM API (2026-11-29):
//!   1. an exported POSIX fd left open keeps the physical memory after `cuMemRelease`
//!      (8.00 GiB stayed held until `close(fd)`);
//!   2. an importer's mapping keeps the memory after the exporter released it *and* closed
//!      its fd, until the importer unmaps;
//!   3. ROCm 7.2's legacy IPC (`hsa_amd_ipc_memory_create`) pins the allocation for the life
//!      of the process, with no call to undo it.
//!
//!   So an arena's bytes count as held until the owner destroyed it **and** every export fd
//!   it handed out was closed through [`Backend::close_export`] **and** every in-process
//!   mapping of it (an import of its own export) was unmapped. With
//!   [`SimConfig::legacy_pin`] every export is [`ExportKind::Pinning`] and pins its arena:
//!   the bytes stay held for the life of the `SimBackend`, as rule 3 says. `mem_info`
//!   reports `free = capacity - held`, and `create_arena` fails with
//!   [`Error::DriverOutOfMemory`] when the request does not fit, so the pool's
//!   release-and-retry path and leak bugs show up exactly as they would on a GPU.
//! - **What the ledger cannot see.** Each `SimBackend` is one process's view of its devices.
//!   A mapping made by *another* process (or another `SimBackend`) keeps the memfd's pages
//!   alive in the kernel but is not in this ledger; the importing side tracks it as a
//!   *foreign import* (count and bytes), which does not use its capacity. An export whose
//!   [`Export`] is dropped without `close_export` stays counted as open: like a leaked fd on
//!   a real driver, the bytes never come back.
//! - **Streams and events** have no work behind them: an event is complete when recorded,
//!   unless its stream was blocked with [`SimBackend::block_stream`]; then it stays pending
//!   until [`SimBackend::unblock_stream`] or [`Backend::synchronize`] (which completes the
//!   device's pending events but leaves the stream blocked for later ones). Tests use this
//!   to exercise stream-ordered reuse.
//! - **Fault injection**: [`SimBackend::fail_nth`] / [`SimBackend::fail_always`] make calls
//!   fail with [`Error::Backend`] (`message: "injected fault"`) before they touch anything,
//!   and [`SimBackend::calls`] counts the calls of each kind (tests count driver exports).
//!
//! # Failed calls change nothing
//!
//! Every failing call, injected or not, leaves the ledger and the resources as they were.
//! The three calls that take ownership (`destroy_arena`, `unmap_import`, `close_export`)
//! behave like a driver call that failed before doing its work (`cuMemRelease` or
//! `cuMemUnmap` returning an error leaves the handle or mapping valid):
//!
//! - a failed `destroy_arena` leaves the arena live and mapped; [`ArenaMem`] is `Clone`, so
//!   the caller may retry with a copy;
//! - a failed `unmap_import` leaves the mapping mapped and registered; [`Mapping`] is
//!   `Clone`, so the caller may retry;
//! - a failed `close_export` cannot hand the [`Export`] back (it was moved in), so the sim
//!   keeps its fd open and *still counted* as an open export: the sim is deliberately
//!   stricter than `close(2)` (which frees the descriptor even when it fails), modelling the
//!   worst case in which the pool must not assume the memory came back. Such *stranded*
//!   fds are closed (and uncounted) by [`SimBackend::close_stranded_exports`], or closed by
//!   `Drop`. The same applies when `close_export` rejects an export that belongs to one of
//!   this backend's arenas (for example paired with the wrong [`ArenaMem`]); an fd that is
//!   not one of this backend's exports is simply closed.
//!
//! Whatever is still owned when the `SimBackend` is dropped (arena mappings and chunk memfds,
//! imported mappings, stranded export fds) is unmapped and closed, with a `tracing` warning
//! for each device whose ledger is not clean, so the process leaks neither fds nor mappings.
//!
//! # Layout
//!
//! `types` holds the public configuration, call-kind and ledger types; `state` the ledger
//! kept behind one mutex; `sys` every system call (memfd, ftruncate, mmap, munmap, fstat,
//! dup), one small function each, and all of the backend's `unsafe`; `grow` growable arenas
//! (create, grow, shrink, and the chunked exports' close and import); `split` trims and
//! chunk drops; `transfer` streams and copies; `steps` test hooks; this module the rest of
//! the calls. Arena, mapping and event handles come from one counter, so they are unique
//! across kinds and never reused.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use super::{
    ArenaMem, Backend, DeviceId, Event, Export, ExportKind, ExportPayload, HostBuffer,
    ImportSource, Mapping, MemInfo, StreamId,
};
use crate::error::{Error, Result};

mod grow;
mod split;
mod state;
mod steps;
mod sys;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_chunks;
#[cfg(test)]
mod tests_faults;
mod transfer;
mod types;

use state::{awake_owner, EventEntry, Inner};

use sys::{file_info, map_shared, sys_err, unmap};
pub use types::{SimCall, SimConfig, SimLedger};

/// The backend name in errors and [`Backend::name`].
const NAME: &str = "sim";

/// Gives each `SimBackend` a distinct memfd name prefix (tests find their own fds by it).
static NEXT_SERIAL: AtomicU64 = AtomicU64::new(1);

fn injected(call: SimCall) -> Error {
    Error::Backend {
        backend: NAME,
        call: call.name(),
        message: "injected fault".to_owned(),
    }
}

/// The simulated device backend: memfd-backed host memory with the driver's ledger.
///
/// Thread-safe (one mutex inside); share it as `Arc<dyn Backend>`. See the module docs for
/// what it models.
#[derive(Debug)]
pub struct SimBackend {
    config: SimConfig,
    serial: u64,
    inner: Mutex<Inner>,
    /// Steps a test runs inside driver calls (`steps.rs`).
    steps: steps::Steps,
}

impl SimBackend {
    /// A sim with `config.devices` devices; fails with [`Error::InvalidArgument`] when the
    /// configuration is invalid (see [`SimConfig::validate`]).
    pub fn new(config: SimConfig) -> Result<SimBackend> {
        config.validate()?;
        Ok(SimBackend {
            config,
            serial: NEXT_SERIAL.fetch_add(1, Ordering::Relaxed),
            inner: Mutex::new(Inner {
                arenas: BTreeMap::new(),
                by_inode: HashMap::new(),
                imports: BTreeMap::new(),
                events: HashMap::new(),
                blocked: HashSet::new(),
                stranded: Vec::new(),
                next_id: 1,
                faults: Default::default(),
                host_buffers: 0,
                streams: HashMap::new(),
            }),
            steps: steps::Steps::default(),
        })
    }

    /// The configuration it was built with.
    pub fn config(&self) -> &SimConfig {
        &self.config
    }

    /// Make events recorded on `stream` of `device` from now on stay pending, as if the
    /// stream had work queued that does not finish. Events recorded before stay as they are.
    pub fn block_stream(&self, device: DeviceId, stream: StreamId) {
        self.inner.lock().blocked.insert((device, stream));
    }

    /// Let `stream` of `device` finish: every pending event recorded on it completes, and
    /// later events complete at once.
    pub fn unblock_stream(&self, device: DeviceId, stream: StreamId) {
        let mut inner = self.inner.lock();
        inner.blocked.remove(&(device, stream));
        for e in inner.events.values_mut() {
            if e.device == device && e.stream == stream {
                e.done = true;
            }
        }
    }

    /// Number of recorded, not yet destroyed events of `device` that are still pending.
    pub fn pending_events(&self, device: DeviceId) -> usize {
        self.inner
            .lock()
            .events
            .values()
            .filter(|e| e.device == device && !e.done)
            .count()
    }

    /// Make the `n`-th future call of kind `call` fail (`1` = the next one) with
    /// [`Error::Backend`] `{ backend: "sim", call: call.name(), message: "injected fault" }`,
    /// changing nothing. Several can be scheduled; `n == 0` cancels every scheduled
    /// `fail_nth` of that kind.
    pub fn fail_nth(&self, call: SimCall, n: u64) {
        let mut inner = self.inner.lock();
        let plan = &mut inner.faults[call.index()];
        if n == 0 {
            plan.fail_at.clear();
        } else {
            let at = plan.calls.saturating_add(n);
            plan.fail_at.insert(at);
        }
    }

    /// Make every call of kind `call` fail (`true`) or stop doing so (`false`).
    pub fn fail_always(&self, call: SimCall, on: bool) {
        self.inner.lock().faults[call.index()].always = on;
    }

    /// How many calls of kind `call` were made so far, successful or not.
    pub fn calls(&self, call: SimCall) -> u64 {
        self.inner.lock().faults[call.index()].calls
    }

    /// Host buffers from [`Backend::alloc_host`] not yet given back with
    /// [`Backend::free_host`] (sleep's offload buffers).
    pub fn host_buffers(&self) -> u64 {
        self.inner.lock().host_buffers
    }

    /// The ledger of `device` (all zero for a device the sim does not have).
    pub fn ledger(&self, device: DeviceId) -> SimLedger {
        self.inner.lock().ledger(device)
    }

    /// Whether `device` holds nothing, has no open export and no import
    /// ([`SimLedger::is_clean`]).
    pub fn is_clean(&self, device: DeviceId) -> bool {
        self.ledger(device).is_clean()
    }

    /// Close the export fds that failed `close_export` calls left with the backend (see the
    /// module docs), uncounting them from the ledger; returns how many were closed.
    pub fn close_stranded_exports(&self) -> usize {
        let mut inner = self.inner.lock();
        let fds = std::mem::take(&mut inner.stranded);
        let n = fds.len();
        for fd in fds {
            if let Ok(info) = file_info(fd.as_fd()) {
                if let Some(id) = inner.uncount_export(info.key) {
                    inner.retire_if_released(id);
                }
            }
            drop(fd);
        }
        n
    }

    /// The memfd name prefix of this backend's arenas (`/proc/self/fd` and
    /// `/proc/self/maps` show it).
    fn memfd_tag(&self) -> String {
        format!("gpu-arena-sim.b{}.", self.serial)
    }

    fn check_device(&self, device: DeviceId) -> Result<()> {
        match usize::try_from(device) {
            Ok(d) if d < self.config.devices => Ok(()),
            _ => Err(Error::InvalidDevice {
                device,
                count: self.config.devices,
            }),
        }
    }
}

impl Backend for SimBackend {
    fn name(&self) -> &'static str {
        NAME
    }

    fn device_count(&self) -> Result<usize> {
        Ok(self.config.devices)
    }

    fn granularity(&self, device: DeviceId) -> Result<u64> {
        self.check_device(device)?;
        Ok(self.config.granularity)
    }

    fn mem_info(&self, device: DeviceId) -> Result<MemInfo> {
        let mut inner = self.inner.lock();
        inner.enter(SimCall::MemInfo)?;
        self.check_device(device)?;
        let held = inner.held_bytes(device);
        Ok(MemInfo {
            free: self.config.capacity.saturating_sub(held),
            total: self.config.capacity,
        })
    }

    fn create_arena(&self, device: DeviceId, bytes: u64) -> Result<ArenaMem> {
        // A reservation of its own size: no room to grow.
        self.create_in_reservation("create_arena", device, bytes, bytes)
    }

    fn create_growable_arena(
        &self,
        device: DeviceId,
        bytes: u64,
        reserve: u64,
    ) -> Result<ArenaMem> {
        self.create_in_reservation("create_growable_arena", device, bytes, reserve)
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
        let mut inner = self.inner.lock();
        match inner.arena_mut(arena, "chunk_spans") {
            Ok(entry) => entry.chunk_spans(),
            Err(_) => vec![(0, arena.bytes)],
        }
    }

    fn drop_chunks(&self, arena: &ArenaMem, doomed: &[usize]) -> Result<Vec<(ArenaMem, usize)>> {
        SimBackend::drop_chunks(self, arena, doomed)
    }

    fn destroy_arena(&self, arena: ArenaMem) -> Result<()> {
        let mut inner = self.inner.lock();
        inner.enter(SimCall::DestroyArena)?;
        let entry = inner.arena_mut(&arena, "destroy_arena")?;
        let owner = entry.owner.as_ref().ok_or_else(|| {
            Error::invalid(format!(
                "sim destroy_arena: arena {} was already destroyed",
                arena.handle
            ))
        })?;
        unmap(&owner.region)?;
        // Closes the owner's memfds; exports and mappings keep the kernel objects alive.
        entry.owner = None;
        inner.retire_if_released(arena.handle);
        Ok(())
    }

    fn export(&self, arena: &ArenaMem) -> Result<Export> {
        let mut inner = self.inner.lock();
        inner.enter(SimCall::Export)?;
        let legacy_pin = self.config.legacy_pin;
        let entry = inner.arena_mut(arena, "export")?;
        let owner = entry.owner.as_ref().ok_or_else(|| {
            Error::invalid(format!("sim export: arena {} was destroyed", arena.handle))
        })?;
        let payload = match owner.memfds.as_slice() {
            [] => {
                return Err(Error::InvalidState(format!(
                    "sim export: arena {} is asleep (no memory behind it)",
                    arena.handle
                )))
            }
            [memfd] => ExportPayload::Fd(sys::dup_cloexec(memfd.as_fd())?),
            // One fd per chunk, a dup of its memfd: the importer maps each at its place.
            memfds => ExportPayload::Chunks(
                entry
                    .chunks
                    .iter()
                    .zip(memfds)
                    .map(|(&n, memfd)| sys::dup_cloexec(memfd.as_fd()).map(|fd| (n, fd)))
                    .collect::<Result<Vec<_>>>()?,
            ),
        };
        entry.open_exports += match &payload {
            ExportPayload::Chunks(fds) => fds.len(),
            _ => 1,
        };
        let kind = if legacy_pin {
            entry.pinned = true;
            ExportKind::Pinning
        } else {
            ExportKind::Releasable
        };
        Ok(Export { payload, kind })
    }

    fn close_export(&self, arena: &ArenaMem, export: Export) -> Result<()> {
        let mut inner = self.inner.lock();
        let fd = match (inner.enter(SimCall::CloseExport), export.payload) {
            (Err(e), ExportPayload::Fd(fd)) => {
                // Failed before doing anything: the export stays open, kept by the sim.
                inner.stranded.push(fd);
                return Err(e);
            }
            (Err(e), ExportPayload::Chunks(fds)) => {
                inner.stranded.extend(fds.into_iter().map(|(_, fd)| fd));
                return Err(e);
            }
            (Ok(()), ExportPayload::Chunks(fds)) => {
                return Self::close_chunks(&mut inner, arena, fds)
            }
            (Err(e), ExportPayload::Bytes(_)) => return Err(e),
            (Ok(()), ExportPayload::Bytes(_)) => {
                return Err(Error::invalid(
                    "sim close_export: sim exports are fds, this export carries bytes",
                ))
            }
            (Ok(()), ExportPayload::Fd(fd)) => fd,
        };
        let info = match file_info(fd.as_fd()) {
            Ok(info) => info,
            Err(e) => {
                return Err(Error::invalid(format!(
                    "sim close_export: fstat of the export fd failed: {e}"
                )))
            }
        };
        let ours = inner.is_counted_export(info.key);
        let reject = |inner: &mut Inner, fd: OwnedFd, err: Error| {
            if ours {
                inner.stranded.push(fd);
            }
            Err(err)
        };
        let entry = match inner.arena_mut(arena, "close_export") {
            Ok(entry) => entry,
            Err(e) => return reject(&mut inner, fd, e),
        };
        if !entry.keys.contains(&info.key) {
            let err = Error::invalid(format!(
                "sim close_export: the export is not an export of arena {}",
                arena.handle
            ));
            return reject(&mut inner, fd, err);
        }
        if entry.open_exports == 0 {
            let err = Error::InvalidState(format!(
                "sim close_export: arena {} has no open export",
                arena.handle
            ));
            return reject(&mut inner, fd, err);
        }
        entry.open_exports -= 1;
        drop(fd);
        inner.retire_if_released(arena.handle);
        Ok(())
    }

    fn import(&self, device: DeviceId, source: ImportSource<'_>, bytes: u64) -> Result<Mapping> {
        let mut inner = self.inner.lock();
        inner.enter(SimCall::Import)?;
        self.check_device(device)?;
        let fd = match source {
            ImportSource::Fd(fd) => fd,
            ImportSource::Chunks(chunks) => {
                return self.import_chunks(&mut inner, device, chunks, bytes)
            }
            ImportSource::Bytes(_) => return Err(Error::invalid("sim imports fds only")),
        };
        if bytes == 0 {
            return Err(Error::invalid("sim import: 0 bytes"));
        }
        let len = usize::try_from(bytes).map_err(|_| {
            Error::invalid(format!(
                "sim import: {bytes} bytes do not fit the address space"
            ))
        })?;
        let info = file_info(fd)
            .map_err(|e| Error::Ipc(format!("sim import: fstat of the fd failed: {e}")))?;
        if !info.regular {
            return Err(Error::Ipc(
                "sim import: the fd is not a memfd (not a regular file)".to_owned(),
            ));
        }
        if info.size < bytes {
            return Err(Error::invalid(format!(
                "sim import: {bytes} bytes asked but the fd holds only {}",
                info.size
            )));
        }
        let region = map_shared(fd, len)?;
        Ok(inner.record_import(device, bytes, region, Some(info.key)))
    }

    fn unmap_import(&self, mapping: Mapping) -> Result<()> {
        let mut inner = self.inner.lock();
        inner.enter(SimCall::UnmapImport)?;
        let entry = inner.imports.get(&mapping.handle).ok_or_else(|| {
            Error::invalid(format!(
                "sim unmap_import: unknown mapping {} (never imported, or already unmapped)",
                mapping.handle
            ))
        })?;
        if entry.device != mapping.device
            || entry.region.base() != mapping.base
            || entry.bytes != mapping.bytes
        {
            return Err(Error::invalid(format!(
                "sim unmap_import: mapping {} is {} bytes at {:#x} on device {}, not {} \
                 bytes at {:#x} on device {}",
                mapping.handle,
                entry.bytes,
                entry.region.base(),
                entry.device,
                mapping.bytes,
                mapping.base,
                mapping.device
            )));
        }
        unmap(&entry.region)?;
        let arena = inner.imports.remove(&mapping.handle).and_then(|m| m.arena);
        if let Some(id) = arena {
            if let Some(a) = inner.arenas.get_mut(&id) {
                a.mappings = a.mappings.saturating_sub(1);
            }
            inner.retire_if_released(id);
        }
        Ok(())
    }

    fn record_event(&self, device: DeviceId, stream: StreamId) -> Result<Event> {
        let mut inner = self.inner.lock();
        inner.enter(SimCall::RecordEvent)?;
        self.check_device(device)?;
        let done = !inner.blocked.contains(&(device, stream));
        let id = inner.take_id();
        inner.events.insert(
            id,
            EventEntry {
                device,
                stream,
                done,
            },
        );
        Ok(Event { device, raw: id })
    }

    fn event_done(&self, event: &Event) -> Result<bool> {
        let mut inner = self.inner.lock();
        inner.enter(SimCall::EventQuery)?;
        match inner.events.get(&event.raw) {
            Some(e) if e.device == event.device => Ok(e.done),
            _ => Err(Error::invalid(format!(
                "sim event_done: unknown event {} on device {}",
                event.raw, event.device
            ))),
        }
    }

    fn destroy_event(&self, event: Event) -> Result<()> {
        let mut inner = self.inner.lock();
        match inner.events.get(&event.raw) {
            Some(e) if e.device == event.device => {
                inner.events.remove(&event.raw);
                Ok(())
            }
            _ => Err(Error::invalid(format!(
                "sim destroy_event: unknown event {} on device {}",
                event.raw, event.device
            ))),
        }
    }

    fn release_physical(&self, arena: &ArenaMem) -> Result<()> {
        let mut inner = self.inner.lock();
        let entry = inner.arena_mut(arena, "release_physical")?;
        entry.check_unshared("release_physical", arena.handle)?;
        let owner = awake_owner(&mut entry.owner, "release_physical", arena.handle)?;
        sys::reserve_over(&owner.region)?;
        // Closing the memfds frees their pages: the contents are gone. A wake makes one
        // memfd for the whole arena (one chunk), as the VMM backend creates one allocation.
        owner.memfds.clear();
        let keys = std::mem::take(&mut entry.keys);
        entry.chunks = vec![entry.bytes];
        inner.forget_keys(arena.handle, &keys);
        Ok(())
    }

    fn can_split(&self, _arena: &ArenaMem) -> bool {
        // Any arena, grown or not (a window may span chunks: it is copied to a new memfd).
        true
    }

    fn split_arena(&self, arena: &ArenaMem, windows: &[(u64, u64)]) -> Result<Vec<ArenaMem>> {
        self.split(arena, windows)
    }

    fn restore_physical(&self, arena: &ArenaMem) -> Result<ArenaMem> {
        let mut inner = self.inner.lock();
        inner.enter(SimCall::CreateArena)?;
        let held = inner.held_bytes(arena.device);
        let name = self.chunk_memfd_name(arena.handle, 0);
        let entry = inner.arena_mut(arena, "restore_physical")?;
        if !entry.asleep() {
            return Err(Error::InvalidState(format!(
                "sim restore_physical: arena {} is not asleep",
                arena.handle
            )));
        }
        if held.saturating_add(arena.bytes) > self.config.capacity {
            return Err(Error::DriverOutOfMemory {
                backend: NAME,
                call: "restore_physical",
                device: arena.device,
                bytes: arena.bytes,
            });
        }
        // One memfd, one chunk, for the whole arena (what it grew by before it slept is one
        // allocation now, as on the VMM backend); `release_physical` set `chunks` so.
        let memfd = sys::create_memfd(&name, arena.bytes)?;
        let info = file_info(memfd.as_fd()).map_err(|e| sys_err("fstat", e))?;
        if let Some(owner) = entry.owner.as_mut() {
            let place = owner.region.part(0, arena.bytes);
            if let Err(e) = sys::map_over(&place, memfd.as_fd()) {
                // A failed MAP_FIXED may have unmapped the range: reserve it again.
                if let Err(back) = sys::reserve_over(&place) {
                    tracing::warn!(error = %back, "sim restore_physical: reserving the range again failed");
                }
                return Err(e);
            }
            owner.memfds = vec![memfd];
        }
        entry.keys = vec![info.key];
        inner.own_keys(arena.handle, &[info.key]);
        Ok(arena.clone())
    }

    fn alloc_host(&self, device: DeviceId, bytes: u64) -> Result<HostBuffer> {
        let buffer = HostBuffer::heap(device, bytes)?;
        self.inner.lock().host_buffers += 1;
        Ok(buffer)
    }

    fn free_host(&self, buffer: HostBuffer) {
        if buffer.into_pinned().is_some() {
            tracing::error!(
                backend = self.name(),
                "free_host of a pinned buffer this backend did not allocate: leaked"
            );
        }
        let mut inner = self.inner.lock();
        inner.host_buffers = inner.host_buffers.saturating_sub(1);
    }

    fn copy_to_host(&self, device: DeviceId, src: u64, dst: &mut [u8]) -> Result<()> {
        let mut inner = self.inner.lock();
        inner.enter(SimCall::CopyToHost)?;
        inner.check_awake_range(device, src, dst.len() as u64)?;
        sys::read_at(src, dst);
        Ok(())
    }

    fn copy_from_host(&self, device: DeviceId, dst: u64, src: &[u8]) -> Result<()> {
        let mut inner = self.inner.lock();
        inner.enter(SimCall::CopyFromHost)?;
        inner.check_awake_range(device, dst, src.len() as u64)?;
        sys::write_at(dst, src);
        Ok(())
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
        self.copy_now(device, stream, dst, src, bytes)
    }

    fn synchronize(&self, device: DeviceId) -> Result<()> {
        self.run_step(SimCall::Synchronize);
        let mut inner = self.inner.lock();
        inner.enter(SimCall::Synchronize)?;
        self.check_device(device)?;
        for e in inner.events.values_mut().filter(|e| e.device == device) {
            e.done = true;
        }
        Ok(())
    }
}

impl Drop for SimBackend {
    fn drop(&mut self) {
        let inner = self.inner.get_mut();
        for device in 0..self.config.devices {
            let Ok(device) = DeviceId::try_from(device) else {
                continue;
            };
            let ledger = inner.ledger(device);
            if !ledger.is_clean() {
                tracing::warn!(
                    device,
                    ?ledger,
                    "sim backend dropped with device memory still held, exported or imported"
                );
            }
        }
        if !inner.stranded.is_empty() {
            tracing::warn!(
                count = inner.stranded.len(),
                "sim backend dropped: closing export fds left by failed close_export calls"
            );
            inner.stranded.clear();
        }
        for (id, m) in std::mem::take(&mut inner.imports) {
            if let Err(e) = unmap(&m.region) {
                tracing::warn!(mapping = id, error = %e, "sim backend drop: munmap of an import failed");
            }
        }
        for (id, a) in std::mem::take(&mut inner.arenas) {
            if let Some(owner) = a.owner {
                if let Err(e) = unmap(&owner.region) {
                    tracing::warn!(arena = id, error = %e, "sim backend drop: munmap of an arena failed");
                }
                drop(owner.memfds);
            }
        }
        inner.by_inode.clear();
    }
}
