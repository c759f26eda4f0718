//! Register every arena of a gpu-arena [`Pool`](gpu_arena::Pool) once with a transport, and
//! deregister it before its memory goes: an [`ArenaObserver`] over a [`Transport`].
//!
//! A transfer of an allocation or a share is then described by (the arena's registration,
//! offset, length) ([`ArenaRegistrar::descriptor`], [`ArenaRegistrar::share_descriptor`]):
//! one registration per arena (an observed class of the default growing arenas makes arenas
//! of doubling sizes up to 1 GiB: about a dozen for the first 2 GiB, then one per GiB; fixed
//! arenas: one per `arena_size`), none per allocation, and nothing registered outlives the memory (the ROCm IPC pin of a KV cache
//! registered with UCX, which then cannot be released, is what this prevents).
//!
//! ```ignore
//! let agent = nixl_sys::Agent::new("producer")?;
//! let registrar = Arc::new(ArenaRegistrar::new(NixlTransport::for_backend(agent, pool.backend().name())));
//! let id = pool.observe_arenas(registrar.clone());
//! let desc = registrar.descriptor(0, ptr, len).expect("inside a registered arena");
//! ```
//!
//! With the cargo feature `nixl` (`stub-api` to build without the NIXL library),
//! [`NixlTransport`] registers each arena with a NIXL agent: VRAM on cuda and hip, DRAM on
//! the sim backend (host memory).

use std::collections::BTreeMap;
use std::sync::Mutex;

use gpu_arena::pool::ObserverError;
use gpu_arena::{ArenaInfo, ArenaObserver, DeviceId, ShareInfo};

#[cfg(feature = "nixl")]
mod nixl;
#[cfg(feature = "nixl")]
pub use nixl::NixlTransport;

/// Where arenas are registered: a NIXL agent, a UCX context, an RDMA NIC.
pub trait Transport: Send + Sync {
    /// What a registration leaves to deregister it with.
    type Registration: Send;
    /// Register a whole arena (called from `on_ready`: it is mapped, nothing of it handed
    /// out yet). An error leaves it unregistered (counted in the pool's `observer_errors`).
    fn register(&self, arena: &ArenaInfo) -> Result<Self::Registration, ObserverError>;
    /// Deregister it (called from `on_release`: still mapped, about to go).
    fn deregister(&self, arena: &ArenaInfo, registration: Self::Registration);
}

/// A transfer descriptor: a byte range inside one registered arena.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct XferDesc {
    /// Device of the arena.
    pub device: DeviceId,
    /// The arena (its registration).
    pub arena_id: u64,
    /// Base address of the arena, as registered.
    pub arena_base: u64,
    /// Offset of the range inside the arena.
    pub offset: u64,
    /// Length of the range.
    pub len: u64,
}

impl XferDesc {
    /// Address of the first byte of the range.
    pub fn addr(&self) -> u64 {
        self.arena_base + self.offset
    }
}

/// Registered arenas by (device, base), with their registrations.
type Registered<R> = BTreeMap<(DeviceId, u64), (ArenaInfo, R)>;

/// Registers each arena once with `T` (an [`ArenaObserver`]: give it to
/// `Pool::observe_arenas`).
pub struct ArenaRegistrar<T: Transport> {
    transport: T,
    /// Registered arenas by (device, base).
    arenas: Mutex<Registered<T::Registration>>,
}

impl<T: Transport> ArenaRegistrar<T> {
    /// A registrar over `transport`, with nothing registered yet.
    pub fn new(transport: T) -> Self {
        ArenaRegistrar {
            transport,
            arenas: Mutex::new(BTreeMap::new()),
        }
    }

    /// The transport.
    pub fn transport(&self) -> &T {
        &self.transport
    }

    fn arenas(&self) -> std::sync::MutexGuard<'_, Registered<T::Registration>> {
        // A poisoned map is still consistent (every change is one insert or remove).
        self.arenas.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The arenas registered now.
    pub fn registered(&self) -> Vec<ArenaInfo> {
        self.arenas().values().map(|(a, _)| *a).collect()
    }

    /// The descriptor of `[ptr, ptr + len)` on `device`, or `None` unless it lies inside one
    /// registered arena.
    pub fn descriptor(&self, device: DeviceId, ptr: u64, len: u64) -> Option<XferDesc> {
        let end = ptr.checked_add(len)?;
        let arenas = self.arenas();
        let (_, (a, _)) = arenas.range(..=(device, ptr)).next_back()?;
        (a.device == device && end <= a.base + a.size).then_some(XferDesc {
            device,
            arena_id: a.arena_id,
            arena_base: a.base,
            offset: ptr - a.base,
            len,
        })
    }

    /// The descriptor of a share (its arena, offset and length), or `None` unless its arena
    /// is registered.
    pub fn share_descriptor(&self, share: &ShareInfo) -> Option<XferDesc> {
        let arenas = self.arenas();
        let (a, _) = arenas
            .values()
            .find(|(a, _)| a.device == share.device && a.arena_id == share.arena_id)?;
        (share.offset + share.len <= a.size).then_some(XferDesc {
            device: a.device,
            arena_id: a.arena_id,
            arena_base: a.base,
            offset: share.offset,
            len: share.len,
        })
    }
}

impl<T: Transport> ArenaObserver for ArenaRegistrar<T> {
    fn on_ready(&self, arena: &ArenaInfo) -> Result<(), ObserverError> {
        let registration = self.transport.register(arena)?;
        self.arenas()
            .insert((arena.device, arena.base), (*arena, registration));
        Ok(())
    }

    fn on_release(&self, arena: &ArenaInfo) {
        let entry = self.arenas().remove(&(arena.device, arena.base));
        if let Some((a, registration)) = entry {
            self.transport.deregister(&a, registration);
        }
    }
}
