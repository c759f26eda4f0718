//! The one error type of the crate.

use crate::ids::DeviceId;
use crate::units::format_size as size;

/// Everything that can go wrong in gpu-arena.
///
/// Out-of-memory is its own variant so callers can retry or shrink; broken invariants are
/// [`Error::Internal`] (a bug in gpu-arena), never a panic.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum Error {
    /// The device (or the simulated capacity, or the pool's `max_reserved` cap) has no room
    /// for the request, even after the pool released its cached, empty arenas and retried.
    /// The message names the cause and the setting that changes it ([`OomCause`]).
    #[error("out of memory on device {device}: {requested} bytes requested; {}", .cause.describe(*.device))]
    OutOfMemory {
        /// The device.
        device: DeviceId,
        /// Requested size in bytes (after rounding).
        requested: u64,
        /// Bytes the pool holds in arenas on that device.
        reserved: u64,
        /// Free bytes the backend reported after the retry.
        free: u64,
        /// Why, with the figures of that cause.
        cause: OomCause,
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

/// Why an allocation found no memory: each cause names the setting or the action that
/// changes it (the texts are [`OomCause::describe`]'s).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OomCause {
    /// Growing the pool would pass the `max_reserved` cap.
    MaxReserved {
        /// The cap as configured, e.g. `4 GiB` or `0.9 (14.4 GiB of 16 GiB)`.
        setting: String,
        /// The cap in bytes on this device.
        cap: u64,
        /// Bytes reserved on the device after trimming.
        reserved: u64,
        /// Bytes the new arena needs.
        needed: u64,
        /// The new arena is a regular one (`arena_size`), not one of the request's own.
        regular_arena: bool,
    },
    /// A regular arena (`arena_size`) is larger than the whole device.
    ArenaLargerThanDevice {
        /// The regular arena's size in bytes (`arena_size` rounded to the granularity).
        arena_size: u64,
        /// The device's total memory.
        total: u64,
    },
    /// The request's own arena is larger than the whole device.
    RequestLargerThanDevice {
        /// The arena the request needs.
        needed: u64,
        /// The device's total memory.
        total: u64,
    },
    /// The device has no room left for a new arena.
    DeviceFull {
        /// Bytes the new arena needs.
        needed: u64,
        /// Free bytes on the device after trimming.
        free: u64,
        /// The device's total memory.
        total: u64,
        /// Bytes the pool reserves on the device after trimming.
        reserved: u64,
        /// Of those, bytes in no live allocation (free ranges of arenas still in use).
        cached: u64,
    },
    /// A wake (`gpu_arena_wake`) found no memory for a sleeping arena: everything that
    /// wake had already woken went back to sleep, and nothing changed.
    Wake {
        /// Bytes of the sleeping arenas the wake needed on the device.
        needed: u64,
        /// Of those, bytes it had already woken and put back to sleep.
        undone: u64,
        /// Free bytes on the device when the driver refused.
        free: u64,
        /// The device's total memory.
        total: u64,
        /// The tags it was waking, comma-separated.
        tags: String,
    },
}

impl OomCause {
    /// The cause in words, with the setting or the action that changes it.
    pub fn describe(&self, device: DeviceId) -> String {
        match *self {
            OomCause::MaxReserved {
                ref setting,
                cap,
                reserved,
                needed,
                regular_arena,
            } => {
                let mut s = format!(
                    "max_reserved={setting} cap: {} reserved, the request needs {} more; raise max_reserved",
                    size(reserved),
                    size(needed)
                );
                if needed > cap {
                    s += &if regular_arena {
                        format!(
                            " or lower arena_size (one {} arena alone exceeds the cap)",
                            size(needed)
                        )
                    } else {
                        " (the request alone exceeds the cap)".to_string()
                    };
                }
                s
            }
            OomCause::ArenaLargerThanDevice { arena_size, total } => format!(
                "arena_size={} is larger than device {device}'s {}; lower arena_size",
                size(arena_size),
                size(total)
            ),
            OomCause::RequestLargerThanDevice { needed, total } => format!(
                "the request needs a {} arena, more than device {device}'s {} in total",
                size(needed),
                size(total)
            ),
            OomCause::DeviceFull {
                needed,
                free,
                total,
                reserved,
                cached,
            } => {
                let others = total.saturating_sub(free).saturating_sub(reserved);
                format!(
                    "device {device} is full: {} free of {}, a new arena needs {}; gpu-arena holds {} reserved, {} of it cached (free ranges in arenas still in use, after trimming), others hold {}; free tensors or lower the device's other usage",
                    size(free),
                    size(total),
                    size(needed),
                    size(reserved),
                    size(cached),
                    size(others)
                )
            }
            OomCause::Wake {
                needed,
                undone,
                free,
                total,
                ref tags,
            } => format!(
                "waking tag(s) {tags} needs {} on device {device} and the driver refused ({} free of {}); the {} this wake had already woken went back to sleep, so nothing changed and the tags still sleep; free device memory (another process's, or empty_cache of what is awake) and wake again, or wake fewer tags",
                size(needed),
                size(free),
                size(total),
                size(undone)
            ),
        }
    }
}
