//! What a device allows the pool: its granularity, the regular arena's size on it, the
//! `max_reserved` cap resolved against its memory; and the out-of-memory error that names
//! which of them refused a request.
//!
//! Resolved on a device's first growth, not when the pool is built: asking a GPU device for
//! its memory opens it (CUDA retains its primary context, hundreds of MiB), and a pool must
//! not open devices it never allocates on.

use crate::error::{Error, Result};
use crate::pool::state::config::{DeviceLimits, MaxReserved};
use crate::pool::state::device::DeviceState;
use crate::pool::state::pool::{DevicePool, Pool};
use crate::range;
use crate::units::format_size;

impl Pool {
    /// `dp`'s limits, asked of the backend once.
    pub(crate) fn limits(&self, dp: &DevicePool) -> Result<DeviceLimits> {
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
    pub(crate) fn limits_now(
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
    pub(crate) fn out_of_memory(
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
