//! The one error type of the crate.

use crate::ids::DeviceId;

/// Everything that can go wrong in gpu-arena.
///
/// Out-of-memory is its own variant so callers can retry or shrink; broken invariants are
/// [`Error::Internal`] (a bug in gpu-arena), never a panic.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum Error {
    /// The device (or the simulated capacity) has no room for the request, even after the
    /// pool released its cached, empty arenas and retried.
    #[error("out of memory on device {device}: {requested} bytes requested, {reserved} bytes reserved by the pool, {free} bytes free on the device")]
    OutOfMemory {
        /// The device.
        device: DeviceId,
        /// Requested size in bytes (after rounding).
        requested: u64,
        /// Bytes the pool holds in arenas on that device.
        reserved: u64,
        /// Free bytes the backend reported after the retry.
        free: u64,
    },
    /// A caller passed a value that cannot be right (size, device, configuration, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A pointer that gpu-arena did not hand out, or already took back.
    #[error("unknown pointer {ptr:#x}: {why}")]
    UnknownPointer {
        /// The pointer value.
        ptr: u64,
        /// Why it was rejected (never allocated, already freed, not the start of a block...).
        why: String,
    },
    /// The device index is outside `0..device_count`.
    #[error("device {device} out of range: the backend has {count} device(s)")]
    InvalidDevice {
        /// The device asked for.
        device: DeviceId,
        /// Number of devices the backend reported.
        count: usize,
    },
    /// A driver (or simulated driver) call failed.
    #[error("{backend} backend: {call} failed: {message}")]
    Backend {
        /// Backend name (`sim`, `cuda`, `hip`).
        backend: &'static str,
        /// The driver call, e.g. `cuMemCreate`.
        call: &'static str,
        /// The driver's own description of the error.
        message: String,
    },
    /// The driver (or the sim's capacity) refused memory: the pool answers this by releasing
    /// cached arenas and retrying once, then reports [`Error::OutOfMemory`].
    #[error("{backend} backend: {call} out of device memory ({bytes} bytes on device {device})")]
    DriverOutOfMemory {
        /// Backend name.
        backend: &'static str,
        /// The driver call.
        call: &'static str,
        /// The device.
        device: DeviceId,
        /// Bytes asked of the driver.
        bytes: u64,
    },
    /// No usable device or driver for the requested backend.
    #[error("backend unavailable: {0}")]
    Unavailable(String),
    /// The operation is not valid in the current state (configure after first use, ...).
    #[error("invalid state: {0}")]
    InvalidState(String),
    /// Sharing and import errors: bad handle, wrong token, unknown producer, dead peer.
    #[error("ipc: {0}")]
    Ipc(String),
    /// An invariant of gpu-arena itself broke: a bug. The pool stays usable where it can.
    #[error("internal error (a gpu-arena bug): {0}")]
    Internal(String),
}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// Shorthand for [`Error::InvalidArgument`].
    pub fn invalid(msg: impl Into<String>) -> Self {
        Error::InvalidArgument(msg.into())
    }
}
