//! The sim's public configuration, call kinds and ledger types.

#[cfg(doc)]
use super::SimBackend;
use crate::backend::DeviceId;
#[cfg(doc)]
use crate::backend::{Backend, ExportKind};
use crate::error::{Error, Result};

/// Configuration of a [`SimBackend`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct SimConfig {
    /// Number of simulated devices (at least 1). Default 1.
    pub devices: usize,
    /// Capacity of each device in bytes (a non-zero multiple of `granularity`). Default
    /// 16 GiB. Only memory that is written uses host RAM.
    pub capacity: u64,
    /// Allocation granularity in bytes (a power of two, at least 4096). Default 2 MiB, as
    /// on the H200.
    pub granularity: u64,
    /// Model ROCm 7.2's legacy IPC: every export is [`ExportKind::Pinning`] and pins its
    /// arena's bytes for the life of the backend. Default false.
    pub legacy_pin: bool,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            devices: 1,
            capacity: 16 << 30,
            granularity: 2 << 20,
            legacy_pin: false,
        }
    }
}

impl SimConfig {
    /// Check the configuration: at least one device (and no more than a `DeviceId` can
    /// name), granularity a power of two >= 4096, capacity a non-zero multiple of it.
    pub fn validate(&self) -> Result<()> {
        if self.devices == 0 {
            return Err(Error::invalid("sim: devices must be at least 1"));
        }
        if DeviceId::try_from(self.devices).is_err() {
            return Err(Error::invalid(format!(
                "sim: {} devices is more than a device id can name",
                self.devices
            )));
        }
        if !self.granularity.is_power_of_two() || self.granularity < 4096 {
            return Err(Error::invalid(format!(
                "sim: granularity {} is not a power of two >= 4096",
                self.granularity
            )));
        }
        if self.capacity == 0 || self.capacity % self.granularity != 0 {
            return Err(Error::invalid(format!(
                "sim: capacity {} is not a non-zero multiple of the granularity {}",
                self.capacity, self.granularity
            )));
        }
        Ok(())
    }
}

/// The kinds of sim calls that can be counted ([`SimBackend::calls`]) and made to fail
/// ([`SimBackend::fail_nth`], [`SimBackend::fail_always`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub enum SimCall {
    /// [`Backend::create_arena`].
    CreateArena,
    /// [`Backend::destroy_arena`].
    DestroyArena,
    /// [`Backend::export`].
    Export,
    /// [`Backend::close_export`].
    CloseExport,
    /// [`Backend::import`].
    Import,
    /// [`Backend::unmap_import`].
    UnmapImport,
    /// [`Backend::record_event`].
    RecordEvent,
    /// [`Backend::event_done`].
    EventQuery,
    /// [`Backend::synchronize`].
    Synchronize,
    /// [`Backend::mem_info`].
    MemInfo,
    /// [`Backend::copy_to_host`] (sleep's offload).
    CopyToHost,
    /// [`Backend::copy_from_host`] (wake's copy back).
    CopyFromHost,
    /// [`Backend::drop_chunks`] (`empty_cache`'s free chunks of a grown arena).
    DropChunks,
}

impl SimCall {
    /// Every kind, in declaration order.
    pub const ALL: [SimCall; 13] = [
        SimCall::CreateArena,
        SimCall::DestroyArena,
        SimCall::Export,
        SimCall::CloseExport,
        SimCall::Import,
        SimCall::UnmapImport,
        SimCall::RecordEvent,
        SimCall::EventQuery,
        SimCall::Synchronize,
        SimCall::MemInfo,
        SimCall::CopyToHost,
        SimCall::CopyFromHost,
        SimCall::DropChunks,
    ];

    /// The call's name as it appears in the `call` field of [`Error::Backend`]: the
    /// [`Backend`] method's name (`create_arena`, `event_done`, ...).
    pub fn name(self) -> &'static str {
        match self {
            SimCall::CreateArena => "create_arena",
            SimCall::DestroyArena => "destroy_arena",
            SimCall::Export => "export",
            SimCall::CloseExport => "close_export",
            SimCall::Import => "import",
            SimCall::UnmapImport => "unmap_import",
            SimCall::RecordEvent => "record_event",
            SimCall::EventQuery => "event_done",
            SimCall::Synchronize => "synchronize",
            SimCall::MemInfo => "mem_info",
            SimCall::CopyToHost => "copy_to_host",
            SimCall::CopyFromHost => "copy_from_host",
            SimCall::DropChunks => "drop_chunks",
        }
    }

    pub(super) fn index(self) -> usize {
        self as usize
    }
}

/// One device's ledger, for tests and diagnostics ([`SimBackend::ledger`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct SimLedger {
    /// Bytes held on the device: live arenas, destroyed arenas still held by an open export
    /// or an in-process mapping, and pinned arenas. `mem_info.free = capacity - held_bytes`.
    pub held_bytes: u64,
    /// Arenas created and not yet destroyed.
    pub live_arenas: usize,
    /// Arenas destroyed by their owner whose bytes are still held (open exports, mappings
    /// or a pin).
    pub destroyed_but_held: usize,
    /// Exports handed out for this device's arenas and not yet closed (including stranded
    /// ones, see [`SimBackend::close_stranded_exports`]).
    pub open_exports: usize,
    /// In-process mappings (imports of this backend's own exports) of this device's arenas.
    pub own_mappings: usize,
    /// Imports mapped on this device of memory this backend does not own (another
    /// process's or another backend's memfd). They do not use the device's capacity.
    pub foreign_imports: usize,
    /// Bytes of those foreign imports.
    pub foreign_import_bytes: u64,
    /// Bytes of arenas pinned by a [`ExportKind::Pinning`] export: held for good.
    pub pinned_bytes: u64,
    /// Bytes of arenas asleep (`release_physical`): addresses reserved, no memory held
    /// (not in `held_bytes`; their arenas count in `live_arenas`).
    pub sleeping_bytes: u64,
}

impl SimLedger {
    /// Nothing held, nothing open, nothing imported.
    pub fn is_clean(&self) -> bool {
        self.held_bytes == 0
            && self.live_arenas == 0
            && self.destroyed_but_held == 0
            && self.open_exports == 0
            && self.own_mappings == 0
            && self.foreign_imports == 0
    }
}
