//! What a device allows the pool: its granularity, the regular arena's size on it, the
//! `max_reserved` cap resolved against its memory; and the out-of-memory error that names
//! which of them refused a request.
//!
//! Resolved on a device's first growth, not when the pool is built: asking a GPU device for
//! its memory opens it (CUDA retains its primary context, hundreds of MiB), and a pool must
//! not open devices it never allocates on.

use crate::error::{Error, OomCause, Result};
use crate::range;
use crate::stats::PoolStats;
use crate::units::format_size;

use super::{DevicePool, DeviceState, Pool, PoolConfig};

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
        if !(MIN_ARENA_SIZE..=crate::pool::sizes::blocks::MAX_REQUEST_BYTES)
            .contains(&self.arena_size)
        {
            return Err(Error::invalid(format!(
                "arena_size={} ({} bytes): must be at least {} (requests larger than arena_size get an arena each, so a tiny arena_size means one driver allocation per block) and at most {}",
                format_size(self.arena_size),
                self.arena_size,
                format_size(MIN_ARENA_SIZE),
                format_size(crate::pool::sizes::blocks::MAX_REQUEST_BYTES)
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

impl Pool {
    /// `dp`'s limits, asked of the backend once.
    pub(super) fn limits(&self, dp: &DevicePool) -> Result<DeviceLimits> {
        if let Some(l) = dp.limits.get() {
            return Ok(*l);
        }
        let device = dp.device;
        let g = self.backend.granularity(device)?;
        if !g.is_power_of_two() || g < range::GRANULE {
            return Err(Error::Internal(format!(
                "backend granularity {g} is not a power of two >= 512"
            )));
        }
        let total = self.backend.mem_info(device)?.total;
        let arena_bytes = range::round_up_to(self.config.arena_size, g)
            .ok_or_else(|| Error::invalid("arena_size overflows"))?;
        if arena_bytes != self.config.arena_size {
            tracing::info!(
                device,
                arena_size = self.config.arena_size,
                arena_bytes,
                "arena_size rounded up to the device's granularity"
            );
        }
        let cap = self.config.max_reserved.map(|m| m.bytes_of(total));
        if arena_bytes > total {
            tracing::warn!(
                device,
                "arena_size={} is larger than device {device}'s {}: every allocation on it will fail; lower arena_size",
                format_size(arena_bytes),
                format_size(total)
            );
        }
        let limits = DeviceLimits {
            granularity: g,
            arena_bytes,
            total,
            cap,
        };
        Ok(*dp.limits.get_or_init(|| limits))
    }

    /// `dp`'s limits with the cap in force now: [`Pool::set_max_reserved`]'s, else the
    /// configuration's. Also that setting, for the out-of-memory message.
    pub(super) fn limits_now(
        &self,
        dp: &DevicePool,
    ) -> Result<(DeviceLimits, Option<MaxReserved>)> {
        let mut limits = self.limits(dp)?;
        let setting = match *dp.max_reserved.lock() {
            Some(set) => set,
            None => self.config.max_reserved,
        };
        limits.cap = setting.map(|m| m.bytes_of(limits.total));
        Ok((limits, setting))
    }

    /// Set `device`'s cap on reserved bytes from now on (PyTorch's
    /// `set_per_process_memory_fraction`; `None`: no cap): a growth that would pass it fails
    /// as out of memory (after the cached arenas are released and the growth retried). Memory
    /// reserved already stays. Overrides the configuration's `max_reserved` for `device`.
    pub fn set_max_reserved(
        &self,
        device: crate::DeviceId,
        cap: Option<MaxReserved>,
    ) -> Result<()> {
        if let Some(c) = cap {
            c.check()?;
        }
        let dp = self.dev(device)?;
        *dp.max_reserved.lock() = Some(cap);
        Ok(())
    }

    /// The out-of-memory error for a request of `len` bytes that needed `needed` new bytes
    /// and found none (`capped`: the cap refused them): the device's free memory now and the
    /// cause, with `st`'s figures. The caller counts it.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn out_of_memory(
        &self,
        dp: &DevicePool,
        st: &DeviceState,
        limits: &DeviceLimits,
        setting: Option<MaxReserved>,
        needed: u64,
        capped: bool,
        len: u64,
    ) -> Error {
        let free = self
            .backend
            .mem_info(dp.device)
            .map(|m| m.free)
            .unwrap_or(0);
        let stats = st.stats_now();
        Error::OutOfMemory {
            device: dp.device,
            requested: len,
            reserved: st.reserved_now(),
            free,
            cause: limits.oom_cause(setting, needed, capped, &stats, free),
        }
    }

    /// `device`'s cap on reserved bytes in force ([`Self::set_max_reserved`]'s, else the
    /// configuration's).
    pub fn max_reserved(&self, device: crate::DeviceId) -> Result<Option<MaxReserved>> {
        let dp = self.dev(device)?;
        let set = *dp.max_reserved.lock();
        Ok(set.unwrap_or(self.config.max_reserved))
    }
}

impl DeviceLimits {
    /// Whether the reserved bytes plus a new arena of `needed` bytes pass the cap;
    /// `reserved` (which takes the device lock) is asked only when there is a cap.
    pub(super) fn over_cap(&self, reserved: impl FnOnce() -> u64, needed: u64) -> bool {
        self.cap
            .is_some_and(|cap| reserved().saturating_add(needed) > cap)
    }

    /// The cause of an allocation that needs a new arena of `needed` bytes and found no
    /// memory: the cap (`capped`), an arena larger than the device, or a full device.
    pub(super) fn oom_cause(
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
