//! The pool ([`Pool`]: one backend, every device it has) and one device's pool
//! ([`DevicePool`]: its thread front, its lock around [`DeviceState`], its gauges): building
//! them, their counters, `validate`, and the teardown. What the calls do is in the folders
//! beside this one (`pool/mod.rs` lists them).

use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use crate::backend::{Backend, DeviceId};
use crate::error::{Error, Result};
use crate::pool::front::thread_cache::Front;
use crate::pool::sizes::growth_steps;
use crate::pool::state::config::{DeviceLimits, MaxReserved, PoolConfig};
use crate::pool::state::device::DeviceState;
use crate::pool::state::observer_registry::Observers;
use crate::pool::state::pool_hook::Hooks;
use crate::stats::{DeviceMetrics, PoolStats};

/// One device's pool. `repr(C)` on a line of its own: what a fast allocation or free reads
/// (the front, the allocated and requested gauges) is its first cache line.
#[derive(Debug)]
#[repr(C, align(64))]
pub(crate) struct DevicePool {
    /// The thread front, reached without the lock.
    pub(crate) front: Arc<Front>,
    pub(crate) metrics: DeviceMetrics,
    pub(crate) device: DeviceId,
    /// Resolved on its first growth (`pool/growth/limits.rs`).
    pub(crate) limits: OnceLock<DeviceLimits>,
    pub(crate) state: Mutex<DeviceState>,
    /// Serialises the export self-test (`pool/sharing/share.rs`), run with the device lock released.
    pub(crate) export_probe: Mutex<Option<crate::backend::ExportKind>>,
    /// The cap set at run time (`Pool::set_max_reserved`; `None`: the configuration's).
    pub(crate) max_reserved: Mutex<Option<Option<MaxReserved>>>,
    /// Signalled (with `state`) when a call that synchronizes the device ends: a
    /// `graph_pool_begin` waits on it (`pool/graphs/graph_pools.rs`, `SyncHold`).
    pub(crate) sync_ended: parking_lot::Condvar,
}

/// A pool allocator over one backend, for every device it has. `Sync`: share it by
/// reference or `Arc` between threads.
#[derive(Debug)]
pub struct Pool {
    pub(crate) backend: Arc<dyn Backend>,
    pub(crate) config: PoolConfig,
    pub(crate) devices: Vec<DevicePool>,
    /// Arena observers and the arenas they are told about (`pool/state/observer_registry.rs`).
    pub(crate) observers: Observers,
    /// Serialises sleeps and wakes (`pool/sleep_wake/sleep.rs`).
    pub(crate) sleep_lock: Mutex<()>,
    /// Told around sleep, wake and release of cached memory (`pool/state/pool_hook.rs`).
    pub(crate) hooks: Hooks,
}

impl Pool {
    /// A pool over `backend`, one per device the backend reports.
    pub fn new(backend: Arc<dyn Backend>, config: PoolConfig) -> Result<Pool> {
        config.check()?;
        let count = backend.device_count()?;
        let devices = (0..count)
            .map(|d| {
                let device = d as DeviceId;
                let front = Arc::new(Front::new(growth_steps::cache_max(config.grow_arenas)));
                DevicePool {
                    device,
                    limits: OnceLock::new(),
                    state: Mutex::new(DeviceState::new(Arc::clone(&front), config.grow_arenas)),
                    front,
                    export_probe: Mutex::new(None),
                    max_reserved: Mutex::new(None),
                    sync_ended: parking_lot::Condvar::new(),
                    metrics: DeviceMetrics::new(device),
                }
            })
            .collect();
        Ok(Pool {
            backend,
            config,
            devices,
            observers: Observers::default(),
            sleep_lock: Mutex::new(()),
            hooks: Hooks::default(),
        })
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// The configuration.
    pub fn config(&self) -> &PoolConfig {
        &self.config
    }

    /// Number of devices.
    pub fn device_count(&self) -> usize {
        self.devices.len()
    }

    pub(crate) fn dev(&self, device: DeviceId) -> Result<&DevicePool> {
        // A match, not `ok_or`: that builds (and drops) the error on every call.
        match usize::try_from(device)
            .ok()
            .and_then(|d| self.devices.get(d))
        {
            Some(dp) => Ok(dp),
            None => Err(Error::InvalidDevice {
                device,
                count: self.devices.len(),
            }),
        }
    }

    /// Counters of one device.
    pub fn stats(&self, device: DeviceId) -> Result<PoolStats> {
        Ok(self.dev(device)?.state.lock().stats_now())
    }

    /// Set the peaks of one device's counters (reserved, allocated and requested bytes) to
    /// their current values (PyTorch's `reset_peak_memory_stats`).
    pub fn reset_peak_stats(&self, device: DeviceId) -> Result<()> {
        let mut st = self.dev(device)?.state.lock();
        st.stats.peak_reserved_bytes = st.reserved_now();
        let registry = st.front.lock_caches();
        st.front.reset_peaks(&registry.lock());
        Ok(())
    }

    /// Zero one device's counts of events (PyTorch's `reset_accumulated_memory_stats`):
    /// allocations and frees served, arenas created and destroyed, out-of-memory failures,
    /// exports made. Current values and peaks stay.
    pub fn reset_accumulated_stats(&self, device: DeviceId) -> Result<()> {
        let mut st = self.dev(device)?.state.lock();
        st.promote_all();
        st.reset_accumulated();
        Ok(())
    }

    /// Check every invariant of one device's pool (the sub-allocator's, and that the pool's
    /// records agree with it). Returns the first violation.
    pub fn validate(&self, device: DeviceId) -> Result<()> {
        self.dev(device)?
            .state
            .lock()
            .validate()
            .map_err(Error::Internal)
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        for dp in &mut self.devices {
            let st = dp.state.get_mut();
            st.promote_all();
            if !st.allocs.is_empty() {
                tracing::warn!(
                    device = dp.device,
                    allocations = st.allocs.len(),
                    bytes = st.stats_now().allocated_bytes,
                    "pool dropped with live allocations: their memory is released with the pool"
                );
            }
        }
        self.free_kept_host_buffers();
        self.drop_all_arenas();
    }
}
