//! The Backend trait: physical device memory, its mapping, exports, imports, events.
//!
//! The pool above knows only this trait, never a driver type. Two implementations:
//!
//! - [`sim`]: host memory backed by memfd, with an exact ledger of what is held, fault
//!   injection and a `legacy_pin` mode; CI and laptops use it.
//! - [`vmm::VmmBackend`]: the VMM core, one implementation for every GPU vendor (registries of
//!   live arenas, mappings and events, per-device state, teardown, copies, `Drop`), built on a
//!   vendor's [`vmm::Driver`] primitives. `cuda` (feature `cuda`: cudarc, libcuda loaded at
//!   run time) and `hip` (feature `hip`: hip-sys, libamdhip64 linked) hold only those
//!   primitives and their start-up; `cuda::CudaBackend` is `VmmBackend<CudaDriver>`,
//!   `hip::HipBackend` is `VmmBackend<HipDriver>`.
//!
//! Every raw driver call stays in one module per vendor (`sim::sys`, `cuda::driver`,
//! `hip::driver`), one small function per call returning a `Result`, each `unsafe` block with
//! a `// SAFETY:` line.
//!
//! Addresses are plain `u64` device virtual addresses. On `sim` they are host addresses of
//! memfd mappings (so tests can read and write them); on `cuda` they are `CUdeviceptr`s.

use std::fmt;
use std::os::fd::{BorrowedFd, OwnedFd};

use crate::error::{Error, Result};
pub use crate::ids::{DeviceId, StreamId};

pub mod host;
pub mod sim;
pub mod vmm;

pub use host::HostBuffer;

#[cfg(feature = "cuda")]
pub mod cuda;

#[cfg(feature = "hip")]
pub mod hip;

/// One block of physical device memory, mapped at `base` for `bytes` bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArenaMem {
    /// Device the memory lives on.
    pub device: DeviceId,
    /// Device virtual address of the first byte.
    pub base: u64,
    /// Size in bytes (a multiple of the backend's granularity).
    pub bytes: u64,
    /// The backend's own handle (a `CUmemGenericAllocationHandle`, a sim arena id, ...).
    pub handle: u64,
}

/// The most physical allocations (chunks) one arena is grown to ([`Backend::grow_arena`]):
/// its export, one fd per chunk, travels in one message (the kernel passes at most 253 fds
/// per `SCM_RIGHTS` message).
pub const MAX_ARENA_CHUNKS: usize = 250;

/// Whether an export can be ended.
#[derive(Copy, Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub enum ExportKind {
    /// Closing the export (the fd) ends it: the memory can be freed afterwards.
    Releasable,
    /// The export pins the memory for the life of the process (ROCm 7.2 legacy IPC, sim
    /// `legacy_pin`): the arena must never be handed back to the driver, only recycled.
    Pinning,
}

/// What an export hands to other processes.
#[derive(Debug)]
pub enum ExportPayload {
    /// A POSIX file descriptor (CUDA/HIP VMM, sim memfd). Sent with SCM_RIGHTS.
    Fd(OwnedFd),
    /// An opaque byte handle (legacy `cuIpcGetMemHandle` / `hipIpcGetMemHandle`).
    Bytes(Vec<u8>),
    /// A grown arena ([`Backend::grow_arena`]): one fd per physical allocation (chunk), in
    /// address order, each with its length. All of them travel in one SCM_RIGHTS message.
    Chunks(Vec<(u64, OwnedFd)>),
}

/// A live export of one arena.
#[derive(Debug)]
pub struct Export {
    /// The handle the importer needs.
    pub payload: ExportPayload,
    /// Whether closing the export ends it.
    pub kind: ExportKind,
}

impl Export {
    /// The export's fd, when it is fd-based.
    pub fn fd(&self) -> Option<BorrowedFd<'_>> {
        use std::os::fd::AsFd;
        match &self.payload {
            ExportPayload::Fd(fd) => Some(fd.as_fd()),
            ExportPayload::Bytes(_) | ExportPayload::Chunks(_) => None,
        }
    }

    /// The export's fds with their lengths, in address order: one for an ungrown arena (its
    /// length `arena_bytes`), one per chunk for a grown one; none for a legacy handle.
    pub fn chunk_fds(&self, arena_bytes: u64) -> Vec<(u64, BorrowedFd<'_>)> {
        use std::os::fd::AsFd;
        match &self.payload {
            ExportPayload::Fd(fd) => vec![(arena_bytes, fd.as_fd())],
            ExportPayload::Chunks(chunks) => {
                chunks.iter().map(|(n, fd)| (*n, fd.as_fd())).collect()
            }
            ExportPayload::Bytes(_) => Vec::new(),
        }
    }
}

/// What a consumer imports: a borrowed fd received over SCM_RIGHTS, or legacy bytes.
#[derive(Debug, Clone, Copy)]
pub enum ImportSource<'a> {
    /// A shareable-handle fd (the importer does not take ownership).
    Fd(BorrowedFd<'a>),
    /// A legacy IPC handle.
    Bytes(&'a [u8]),
    /// A grown arena's chunks (length, fd), in address order: mapped back to back.
    Chunks(&'a [(u64, BorrowedFd<'a>)]),
}

/// An imported arena, mapped into this process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mapping {
    /// Device the mapping is accessible from.
    pub device: DeviceId,
    /// Address of the first byte of the imported arena in this process.
    pub base: u64,
    /// Size in bytes.
    pub bytes: u64,
    /// The backend's own handle for the mapping.
    pub handle: u64,
}

/// A recorded event: completes when all work enqueued on its stream before it has finished.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// Device of the stream.
    pub device: DeviceId,
    /// The backend's handle (`CUevent` as an integer, sim event id).
    pub raw: u64,
}

/// Free and total device memory in bytes, as the driver reports them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct MemInfo {
    /// Free bytes on the device.
    pub free: u64,
    /// Total bytes on the device.
    pub total: u64,
}

/// The length of a copy of `bytes` from `src` to `dst` as a `usize` (`None`: nothing to
/// copy), or why it is refused: a size past `usize`, or ranges that overlap
/// ([`Backend::copy_async`]'s contract, before any range is looked up).
pub(crate) fn check_copy(dst: u64, src: u64, bytes: u64) -> Result<Option<usize>> {
    if bytes == 0 {
        return Ok(None);
    }
    let n = usize::try_from(bytes)
        .map_err(|_| Error::invalid(format!("{bytes} bytes do not fit in usize")))?;
    if src < dst.saturating_add(bytes) && dst < src.saturating_add(bytes) {
        return Err(Error::invalid(format!(
            "copy of {bytes} bytes from {src:#x} to {dst:#x}: the ranges overlap"
        )));
    }
    Ok(Some(n))
}

/// Check the windows of a split of an arena of `bytes` bytes (see the trait's contract).
pub(crate) fn check_split_windows(
    bytes: u64,
    granularity: u64,
    windows: &[(u64, u64)],
) -> Result<()> {
    if windows.is_empty() {
        return Err(Error::invalid("split_arena: no windows"));
    }
    let mut end = 0;
    for (i, &(offset, len)) in windows.iter().enumerate() {
        let aligned = offset % granularity == 0 && len % granularity == 0 && len > 0;
        let inside = offset.checked_add(len).is_some_and(|e| e <= bytes);
        if !aligned || !inside || (i > 0 && offset < end) {
            return Err(Error::invalid(format!(
                "split_arena: window {i} (+{offset:#x}, {len} bytes) is not a non-empty run of \
                 {granularity}-byte pages inside the {bytes}-byte arena after the previous window"
            )));
        }
        end = offset + len;
    }
    Ok(())
}

/// Check `doomed` (chunk indices of an arena of `chunks` chunks: sorted, unique, in range,
/// not all of them, at least one) for [`Backend::drop_chunks`].
pub(crate) fn check_dropped_chunks(chunks: usize, doomed: &[usize]) -> Result<()> {
    let sorted = doomed.windows(2).all(|w| w[0] < w[1]);
    if doomed.is_empty() || doomed.len() >= chunks || !sorted || doomed.iter().any(|&i| i >= chunks)
    {
        return Err(Error::invalid(format!(
            "drop_chunks: {doomed:?} is not a sorted, non-empty strict subset of the arena's \
             {chunks} chunks"
        )));
    }
    Ok(())
}

/// The runs of consecutive chunks not in `dropped` (sorted): `(first index, count)` each.
pub(crate) fn kept_runs(chunks: usize, dropped: &[usize]) -> Vec<(usize, usize)> {
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for i in (0..chunks).filter(|i| dropped.binary_search(i).is_err()) {
        match runs.last_mut() {
            Some((first, n)) if *first + *n == i => *n += 1,
            _ => runs.push((i, 1)),
        }
    }
    runs
}

/// Physical device memory and its mapping, exports, imports, events, device info.
///
/// Implementations are thread-safe; the pool never holds its own locks across these calls
/// where it can avoid it.
pub trait Backend: Send + Sync + fmt::Debug {
    /// Short name: `sim`, `cuda`, `hip`.
    fn name(&self) -> &'static str;
    /// Number of devices.
    fn device_count(&self) -> Result<usize>;
    /// Allocation granularity in bytes: arena sizes are multiples of it.
    fn granularity(&self, device: DeviceId) -> Result<u64>;
    /// Free and total bytes on the device.
    fn mem_info(&self, device: DeviceId) -> Result<MemInfo>;
    /// Create physical memory of `bytes` (a granularity multiple), exportable, mapped and
    /// accessible from `device`.
    fn create_arena(&self, device: DeviceId, bytes: u64) -> Result<ArenaMem>;
    /// Create an arena of `bytes` at the start of a new address reservation of `reserve`
    /// bytes (both granularity multiples, `bytes <= reserve`), so that it can grow in place
    /// ([`Backend::grow_arena`]). A backend that cannot grow arenas creates a plain one.
    fn create_growable_arena(
        &self,
        device: DeviceId,
        bytes: u64,
        reserve: u64,
    ) -> Result<ArenaMem> {
        let _ = reserve;
        self.create_arena(device, bytes)
    }
    /// Whether `arena` can grow by `extra` bytes: made by [`Backend::create_growable_arena`]
    /// with that much of its reservation left, awake, not exported.
    fn can_grow(&self, arena: &ArenaMem, extra: u64) -> bool {
        let _ = (arena, extra);
        false
    }
    /// Map `extra` more bytes (a granularity multiple) right after the arena's end: one more
    /// physical allocation (a *chunk*), mapped and accessible like the first. Returns the
    /// arena grown (same base and handle, `bytes + extra`). On error nothing changed. The
    /// arena has no export while it grows (the pool grows only arenas it has not shared).
    fn grow_arena(&self, arena: &ArenaMem, extra: u64) -> Result<ArenaMem> {
        let _ = extra;
        Err(Error::Unavailable(format!(
            "the {} backend cannot grow an arena (arena of {} bytes at {:#x})",
            self.name(),
            arena.bytes,
            arena.base
        )))
    }
    /// Give back the chunks of a grown arena ([`Backend::grow_arena`]) that lie wholly at or
    /// past `keep` bytes from its base (never its first): each is unmapped and released.
    /// Returns the arena shrunk (same base and handle, ending where its last kept chunk
    /// ends) and how many chunks went. The caller synchronized the device, uses none of
    /// those bytes, and has no export of the arena. A backend that cannot grow arenas gives
    /// nothing back.
    fn shrink_arena(&self, arena: &ArenaMem, keep: u64) -> Result<(ArenaMem, usize)> {
        let _ = keep;
        Ok((arena.clone(), 0))
    }
    /// The chunks of an arena, `(offset, bytes)` from its base in address order: one chunk
    /// covering it unless it grew ([`Backend::grow_arena`]).
    fn chunk_spans(&self, arena: &ArenaMem) -> Vec<(u64, u64)> {
        vec![(0, arena.bytes)]
    }
    /// Give back the chunks of a grown arena whose indices (in [`Backend::chunk_spans`]
    /// order) are in `doomed` (sorted, unique, not every chunk), without moving a byte: each
    /// is unmapped and released; the chunks kept stay mapped where they are, and each run
    /// of them becomes an arena of its own (its first chunk's handle, the run's other
    /// chunks its chunks; they cannot grow) in the old reservation, which is freed with the
    /// last of them. Returns the runs in address order with their chunk counts; afterwards
    /// only they may be named. A chunk whose unmapping fails stays, in its run (logged).
    /// The caller synchronized the device, uses no byte of the dropped chunks and has no
    /// export of the arena. On error nothing changed.
    fn drop_chunks(&self, arena: &ArenaMem, doomed: &[usize]) -> Result<Vec<(ArenaMem, usize)>> {
        let _ = doomed;
        Err(Error::Unavailable(format!(
            "the {} backend cannot drop an arena's chunks (arena of {} bytes at {:#x})",
            self.name(),
            arena.bytes,
            arena.base
        )))
    }
    /// Unmap and release an arena. The caller synchronized the device and closed every
    /// export first. Memory stays held by the driver while exports or importers hold it.
    fn destroy_arena(&self, arena: ArenaMem) -> Result<()>;
    /// Export the arena for other processes (once per arena at a time; the pool ensures it).
    fn export(&self, arena: &ArenaMem) -> Result<Export>;
    /// End an export: close its fd. For [`ExportKind::Pinning`] exports this closes what can
    /// be closed; the memory stays pinned.
    fn close_export(&self, arena: &ArenaMem, export: Export) -> Result<()>;
    /// Import another process's export of `bytes` bytes and map it on `device`. The source fd
    /// stays owned by the caller (close it after this returns).
    fn import(&self, device: DeviceId, source: ImportSource<'_>, bytes: u64) -> Result<Mapping>;
    /// Unmap an import. Once every mapping and export is gone the memory is freed.
    fn unmap_import(&self, mapping: Mapping) -> Result<()>;
    /// Record an event on `stream` (timing disabled).
    fn record_event(&self, device: DeviceId, stream: StreamId) -> Result<Event>;
    /// Whether the event completed (non-blocking).
    fn event_done(&self, event: &Event) -> Result<bool>;
    /// Destroy an event.
    fn destroy_event(&self, event: Event) -> Result<()>;
    /// Wait for all work on the device to finish.
    fn synchronize(&self, device: DeviceId) -> Result<()>;

    /// Sleep: give the arena's physical memory back to the driver (unmap, release the
    /// handle) and keep its address range reserved, so [`Backend::restore_physical`] maps
    /// new memory at the same addresses. Contents are lost. The caller synchronized the
    /// device, and the arena has no export and no import. Until restored, only
    /// `restore_physical` and `destroy_arena` (which then frees the reservation) may name it.
    fn release_physical(&self, arena: &ArenaMem) -> Result<()> {
        Err(Error::Unavailable(format!(
            "the {} backend cannot release an arena's memory while keeping its addresses \
             (arena of {} bytes at {:#x})",
            self.name(),
            arena.bytes,
            arena.base
        )))
    }

    /// Wake: create physical memory for an arena that [`Backend::release_physical`] put to
    /// sleep and map it, read-write, at the arena's addresses. Returns the arena with its new
    /// handle (base and size unchanged). Contents are undefined (zero on sim).
    fn restore_physical(&self, arena: &ArenaMem) -> Result<ArenaMem> {
        Err(Error::Unavailable(format!(
            "the {} backend cannot restore an arena's memory (arena at {:#x})",
            self.name(),
            arena.base
        )))
    }

    /// Whether [`Backend::split_arena`] can split this arena at all (a backend or an arena
    /// kind without it says no up front, so a trim leaves the arena alone: no observer is
    /// told it goes and comes back).
    fn can_split(&self, arena: &ArenaMem) -> bool {
        let _ = arena;
        false
    }

    /// Trim: give each window of `windows` (`(offset, len)` pairs relative to `arena.base`:
    /// granularity multiples, sorted, disjoint, inside the arena, at least one) physical
    /// memory of its own holding the window's current contents, and give the rest of the
    /// arena's physical memory back to the driver. Addresses do not change. Returns one
    /// arena per window, in order (`base = arena.base + offset`, `bytes = len`, new
    /// handles); afterwards `arena` no longer exists and only the windows may be named
    /// (each one destroyed, slept, restored or exported on its own; the address reservation
    /// is freed with the last of them). The caller synchronized the device, the arena has
    /// no export and no import, and nothing touches its memory until this returns. On error
    /// nothing changed: `arena` is as it was, contents included, except in one double
    /// failure of the VMM core (mapping a window failed, then mapping the old memory back
    /// failed too): the arena is then asleep, as after [`Backend::release_physical`], its
    /// contents lost, and the error says so.
    fn split_arena(&self, arena: &ArenaMem, windows: &[(u64, u64)]) -> Result<Vec<ArenaMem>> {
        let _ = windows;
        Err(Error::Unavailable(format!(
            "the {} backend cannot split an arena (arena of {} bytes at {:#x})",
            self.name(),
            arena.bytes,
            arena.base
        )))
    }

    /// Host memory of `bytes` bytes for copies with `device`: pinned (page-locked) where the
    /// backend has it, so copies run at link speed; heap memory otherwise (the default).
    /// Give it back with [`Backend::free_host`].
    fn alloc_host(&self, device: DeviceId, bytes: u64) -> Result<HostBuffer> {
        HostBuffer::heap(device, bytes)
    }

    /// Free a buffer from [`Backend::alloc_host`] of this backend (failures are logged).
    fn free_host(&self, buffer: HostBuffer) {
        if buffer.into_pinned().is_some() {
            tracing::error!(
                backend = self.name(),
                "free_host of a pinned buffer this backend did not allocate: leaked"
            );
        }
    }

    /// A new stream of `device` for transfers ([`Backend::copy_async`]): non-blocking, so its
    /// copies run beside the default stream's work. Give it back with
    /// [`Backend::destroy_stream`].
    fn create_stream(&self, device: DeviceId) -> Result<StreamId> {
        let _ = device;
        Err(Error::Unavailable(format!(
            "the {} backend has no transfer streams",
            self.name()
        )))
    }

    /// Destroy a stream from [`Backend::create_stream`] (copies queued on it still complete).
    fn destroy_stream(&self, device: DeviceId, stream: StreamId) -> Result<()> {
        let _ = (device, stream);
        Err(Error::Unavailable(format!(
            "the {} backend has no transfer streams",
            self.name()
        )))
    }

    /// Queue a copy of `bytes` bytes from `src` to `dst` on `stream` of `device` (one from
    /// [`Backend::create_stream`]) and return; an event recorded on the stream afterwards
    /// completes when the copy has. Each range must lie inside one live arena or import
    /// mapping of this backend ([`Error::UnknownPointer`] otherwise, nothing queued), and
    /// both must stay mapped until the copy completes: the caller waits for its event
    /// before it unmaps or destroys either.
    fn copy_async(
        &self,
        device: DeviceId,
        stream: StreamId,
        dst: u64,
        src: u64,
        bytes: u64,
    ) -> Result<()> {
        let _ = (device, stream, dst, src, bytes);
        Err(Error::Unavailable(format!(
            "the {} backend has no device-to-device copy",
            self.name()
        )))
    }

    /// Copy `dst.len()` bytes from device address `src` (inside one live arena) to host
    /// memory, blocking.
    fn copy_to_host(&self, device: DeviceId, src: u64, dst: &mut [u8]) -> Result<()> {
        let _ = (device, src, dst);
        Err(Error::Unavailable(format!(
            "the {} backend has no device-to-host copy",
            self.name()
        )))
    }

    /// Copy host bytes `src` to device address `dst` (inside one live arena), blocking.
    fn copy_from_host(&self, device: DeviceId, dst: u64, src: &[u8]) -> Result<()> {
        let _ = (device, dst, src);
        Err(Error::Unavailable(format!(
            "the {} backend has no host-to-device copy",
            self.name()
        )))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn windows_are_checked() {
        let g = 2 << 20;
        assert!(check_split_windows(8 * g, g, &[]).is_err());
        assert!(check_split_windows(8 * g, g, &[(0, g), (g, 2 * g), (6 * g, 2 * g)]).is_ok());
        assert!(
            check_split_windows(8 * g, g, &[(g, g), (0, g)]).is_err(),
            "unsorted"
        );
        assert!(
            check_split_windows(8 * g, g, &[(0, 2 * g), (g, g)]).is_err(),
            "overlapping"
        );
        assert!(
            check_split_windows(8 * g, g, &[(7 * g, 2 * g)]).is_err(),
            "outside"
        );
        assert!(
            check_split_windows(8 * g, g, &[(1, g)]).is_err(),
            "unaligned"
        );
        assert!(check_split_windows(8 * g, g, &[(0, 0)]).is_err(), "empty");
    }
}
