//! The pool's settings ([`PoolConfig`], with the `max_reserved` cap, [`MaxReserved`]) and a
//! device's limits as resolved against them on its first growth (`DeviceLimits`:
//! granularity, the regular arena's size, the cap in bytes), with the cause an out-of-memory
//! error names. Resolving them is `pool/growth/limits.rs`'s.

use crate::error::{Error, OomCause, Result};
use crate::pool::sizes::blocks::MAX_REQUEST_BYTES;
use crate::stats::PoolStats;
use crate::units::format_size;

const MIB: u64 = 1 << 20;

/// Pool settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolConfig {
    /// Size of a regular arena in bytes (at least [`MIN_ARENA_SIZE`]), rounded up to the
    /// backend granularity. Requests larger than this get a dedicated arena. Default 1 GiB, measured on the KV trace
    /// (`bench/results/sim-2026-11-29.md`): reserved/live 1.055 with 17 arenas, against
    /// 1.082 with 279 arenas at 64 MiB, 1.055 with 68 at 256 MiB and 1.117 with 9 at 2 GiB;
    /// each arena is at most one driver export when shared, so fewer is better.
    pub arena_size: u64,
    /// Cap on reserved bytes per device, in bytes or as a fraction of the device's memory
    /// (PyTorch's memory fraction); `None` for no cap. A fraction is resolved on the
    /// device's first growth (`pool/growth/limits.rs`).
    pub max_reserved: Option<MaxReserved>,
    /// Run `validate()` after every operation (default: on in debug builds).
    pub validate: bool,
    /// UNSAFE, for demonstrations only: ignore streams (every free range is reusable by
    /// every stream at once, `record_stream` is ignored). Shows what the stream rules
    /// prevent; never enable it for real work.
    pub unsafe_ignore_streams: bool,
    /// Make every `empty_cache` a [`Pool::trim`](crate::Pool::trim) (`pool/growth/trim.rs`): arenas with survivors are
    /// cut down to the pages the survivors use. Only for programs whose `empty_cache` runs
    /// at idle points (no other thread using gpu-arena memory on the device meanwhile: the
    /// cut arenas' addresses are briefly unmapped). Default off.
    pub trim_on_empty_cache: bool,
    /// Large blocks live in arenas that grow with the work (`pool/growth/grow.rs`): each reserves
    /// the device's address range and maps memory chunk by chunk. Off: every arena is
    /// `arena_size` bytes, mapped whole: the fastest per operation, but a class's last arena
    /// is partly empty (default on since issue #24).
    pub grow_arenas: bool,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            arena_size: 1024 * MIB,
            max_reserved: None,
            validate: cfg!(debug_assertions),
            unsafe_ignore_streams: false,
            trim_on_empty_cache: false,
            grow_arenas: true,
        }
    }
}

/// The smallest `arena_size`: CUDA's allocation granularity. Every request larger than
/// `arena_size` gets an arena of its own, so a smaller value would mean one driver
/// allocation (and one export, when shared) per block.
pub const MIN_ARENA_SIZE: u64 = 2 << 20;

/// A cap on a device's reserved bytes (`max_reserved`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum MaxReserved {
    /// At most this many bytes per device.
    Bytes(u64),
    /// At most this fraction (above 0, at most 1) of each device's total memory as the
    /// backend reports it (`mem_info`), like PyTorch's `set_per_process_memory_fraction`.
    Fraction(f64),
}

// A fraction is checked finite and in (0, 1] (`PoolConfig::check`): never NaN.
impl Eq for MaxReserved {}

impl std::fmt::Display for MaxReserved {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MaxReserved::Bytes(b) => f.write_str(&format_size(*b)),
            MaxReserved::Fraction(x) => write!(f, "{x}"),
        }
    }
}

impl MaxReserved {
    /// Refuse a cap no pool can work with: zero bytes, a fraction outside (0, 1].
    pub fn check(self) -> Result<()> {
        match self {
            MaxReserved::Bytes(0) => Err(Error::invalid(
                "max_reserved=0: the cap must be above 0 (use none for no cap)",
            )),
            MaxReserved::Fraction(f) if !(f > 0.0 && f <= 1.0) => Err(Error::invalid(format!(
                "max_reserved={f}: a fraction of the device must be above 0 and at most 1"
            ))),
            _ => Ok(()),
        }
    }

    /// The cap in bytes on a device of `total` bytes.
    pub fn bytes_of(self, total: u64) -> u64 {
        match self {
            MaxReserved::Bytes(b) => b,
            MaxReserved::Fraction(f) => (total as f64 * f) as u64,
        }
    }
}

impl PoolConfig {
    /// Refuse settings no pool can work with: an `arena_size` below [`MIN_ARENA_SIZE`] or
    /// above the largest request, a zero cap, a fraction outside (0, 1].
    pub fn check(&self) -> Result<()> {
        if !(MIN_ARENA_SIZE..=MAX_REQUEST_BYTES).contains(&self.arena_size) {
            return Err(Error::invalid(format!(
                "arena_size={} ({} bytes): must be at least {} (requests larger than arena_size get an arena each, so a tiny arena_size means one driver allocation per block) and at most {}",
                format_size(self.arena_size),
                self.arena_size,
                format_size(MIN_ARENA_SIZE),
                format_size(MAX_REQUEST_BYTES)
            )));
        }
        self.max_reserved.map_or(Ok(()), MaxReserved::check)
    }
}

/// One device's limits, resolved on its first growth.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DeviceLimits {
    /// The backend's granularity: arena sizes are multiples of it.
    pub(crate) granularity: u64,
    /// A regular arena's size: `arena_size` rounded up to the granularity.
    pub(crate) arena_bytes: u64,
    /// The device's total memory.
    pub(crate) total: u64,
    /// The cap on reserved bytes, `None` for none.
    pub(crate) cap: Option<u64>,
}

impl DeviceLimits {
    /// Whether the reserved bytes plus a new arena of `needed` bytes pass the cap;
    /// `reserved` (which takes the device lock) is asked only when there is a cap.
    pub(crate) fn over_cap(&self, reserved: impl FnOnce() -> u64, needed: u64) -> bool {
        self.cap
            .is_some_and(|cap| reserved().saturating_add(needed) > cap)
    }

    /// The cause of an allocation that needs a new arena of `needed` bytes and found no
    /// memory: the cap (`capped`), an arena larger than the device, or a full device.
    pub(crate) fn oom_cause(
        &self,
        setting: Option<MaxReserved>,
        needed: u64,
        capped: bool,
        stats: &PoolStats,
        free: u64,
    ) -> OomCause {
        let regular_arena = needed == self.arena_bytes;
        match (capped, self.cap) {
            (true, Some(cap)) => OomCause::MaxReserved {
                setting: match setting {
                    Some(MaxReserved::Fraction(f)) => {
                        format!("{f} ({} of {})", format_size(cap), format_size(self.total))
                    }
                    _ => format_size(cap),
                },
                cap,
                reserved: stats.reserved_bytes,
                needed,
                regular_arena,
            },
            _ if needed > self.total && regular_arena => OomCause::ArenaLargerThanDevice {
                arena_size: needed,
                total: self.total,
            },
            _ if needed > self.total => OomCause::RequestLargerThanDevice {
                needed,
                total: self.total,
            },
            _ => OomCause::DeviceFull {
                needed,
                free,
                total: self.total,
                reserved: stats.reserved_bytes,
                cached: stats.reserved_bytes.saturating_sub(stats.allocated_bytes),
            },
        }
    }
}
