//! The transfer engine's counters: also the C API's `gpu_arena_xfer_stats_t` (the header is
//! generated from this file, `ffi/cbindgen.toml` renames it), so the layout has one
//! definition. New fields go last.

/// Counters of one engine.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Local registrations now.
    pub registrations: u64,
    /// Remote registrations loaded (imported) now.
    pub remote_loaded: u64,
    /// Requests posted.
    pub posted: u64,
    /// Copies queued.
    pub copies: u64,
    /// Bytes queued.
    pub bytes: u64,
    /// Notifications sent.
    pub notifs_sent: u64,
    /// Notifications received.
    pub notifs_received: u64,
    /// Revocations this engine sent as a producer.
    pub revokes_sent: u64,
    /// Revocations this engine carried out as a consumer.
    pub revoked: u64,
    /// Deregistrations that stopped waiting for consumers (`revoke_timeout`).
    pub revoke_timeouts: u64,
    /// Registrations whose share a sleep of their tag ended (as a producer).
    pub slept: u64,
    /// Remote registrations imported again after their producer woke (as a consumer).
    pub reloaded: u64,
}
