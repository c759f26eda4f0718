//! [`Transport`] over a NIXL agent (nixl-sys).

use gpu_arena::pool::ObserverError;
use gpu_arena::ArenaInfo;
use nixl_sys::{Agent, MemType, MemoryRegion, NixlDescriptor, RegistrationHandle};

use crate::Transport;

/// Registers arenas with a NIXL agent as one memory region each.
pub struct NixlTransport {
    agent: Agent,
    mem_type: MemType,
}

impl NixlTransport {
    /// Over `agent`, registering arenas as `mem_type`.
    pub fn new(agent: Agent, mem_type: MemType) -> Self {
        NixlTransport { agent, mem_type }
    }

    /// Over `agent`, with the memory type of a gpu-arena backend by name: VRAM for `cuda`
    /// and `hip`, DRAM for `sim` (host memory).
    pub fn for_backend(agent: Agent, backend: &str) -> Self {
        let mem_type = match backend {
            "sim" => MemType::Dram,
            _ => MemType::Vram,
        };
        Self::new(agent, mem_type)
    }

    /// The agent.
    pub fn agent(&self) -> &Agent {
        &self.agent
    }
}

/// One arena as a NIXL memory region.
#[derive(Debug)]
struct ArenaRegion {
    base: usize,
    size: usize,
    device: u64,
    mem_type: MemType,
}

impl MemoryRegion for ArenaRegion {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.base as *const u8
    }

    fn size(&self) -> usize {
        self.size
    }
}

impl NixlDescriptor for ArenaRegion {
    fn mem_type(&self) -> MemType {
        self.mem_type
    }

    fn device_id(&self) -> u64 {
        self.device
    }
}

impl Transport for NixlTransport {
    type Registration = RegistrationHandle;

    fn register(&self, arena: &ArenaInfo) -> Result<RegistrationHandle, ObserverError> {
        let region = ArenaRegion {
            base: usize::try_from(arena.base)?,
            size: usize::try_from(arena.size)?,
            device: u64::try_from(arena.device)?,
            mem_type: self.mem_type,
        };
        Ok(self.agent.register_memory(&region, None)?)
    }

    fn deregister(&self, arena: &ArenaInfo, mut registration: RegistrationHandle) {
        if let Err(e) = registration.deregister() {
            eprintln!(
                "gpu-arena-nixl: deregistering arena {} (device {}) failed: {e}",
                arena.arena_id, arena.device
            );
        }
    }
}
