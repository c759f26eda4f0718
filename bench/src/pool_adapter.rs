//! [`PoolAllocator`]: the real [`Pool`] behind the [`TraceAllocator`] interface.

use std::cell::Cell;
use std::sync::Arc;

use gpu_arena::backend::sim::{SimBackend, SimConfig};
use gpu_arena::config::Config;
use gpu_arena::{Backend, DeviceId, Pool, PoolConfig, PoolStats, StreamId};

use crate::replay::TraceAllocator;

/// Replays a trace through one device of a [`Pool`]. Trace streams become [`StreamId`]s.
///
/// [`TraceAllocator::reserved_bytes`] reads the pool's counters (one uncontended lock) and
/// also keeps the largest arena count seen, reported by [`PoolAllocator::peak_arenas`]: the
/// number of driver exports it would take to share everything at the peak.
#[derive(Debug)]
pub struct PoolAllocator {
    pool: Arc<Pool>,
    device: DeviceId,
    peak_arenas: Cell<u64>,
}

impl PoolAllocator {
    /// A new pool over `backend` with `config`, serving `device`.
    pub fn new(
        backend: Arc<dyn Backend>,
        config: PoolConfig,
        device: DeviceId,
    ) -> Result<Self, String> {
        let pool = Pool::new(backend, config).map_err(|e| e.to_string())?;
        Ok(Self::with_pool(Arc::new(pool), device))
    }

    /// A new pool over `backend` configured by `config` (`Config` keys, e.g.
    /// `"grow_arenas=1"`), serving device 0: what the trace tools replay through.
    pub fn from_config(backend: Arc<dyn Backend>, config: &str) -> Result<Self, String> {
        let pool = Config::parse(config).map_err(|e| e.to_string())?.pool;
        Self::new(backend, pool, DeviceId::default())
    }

    /// Wrap an existing pool.
    pub fn with_pool(pool: Arc<Pool>, device: DeviceId) -> Self {
        Self {
            pool,
            device,
            peak_arenas: Cell::new(0),
        }
    }

    /// The pool.
    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }

    /// The pool's counters for this device (zeroes if the device is unknown).
    pub fn stats(&self) -> PoolStats {
        self.pool.stats(self.device).unwrap_or_default()
    }

    /// Most arenas held at once, as sampled by `reserved_bytes` (at least the current count).
    pub fn peak_arenas(&self) -> u64 {
        self.peak_arenas.get().max(self.stats().arenas)
    }
}

impl TraceAllocator for PoolAllocator {
    fn alloc(&mut self, bytes: u64, stream: u64) -> Result<u64, String> {
        self.pool
            .alloc(self.device, bytes, StreamId(stream))
            .map(|a| a.ptr)
            .map_err(|e| e.to_string())
    }

    fn free(&mut self, ptr: u64, _bytes: u64, _stream: u64) -> Result<(), String> {
        self.pool.free(ptr).map_err(|e| e.to_string())
    }

    fn reserved_bytes(&self) -> u64 {
        let s = self.stats();
        if s.arenas > self.peak_arenas.get() {
            self.peak_arenas.set(s.arenas);
        }
        s.reserved_bytes
    }

    fn name(&self) -> String {
        format!(
            "gpu-arena pool ({} arenas)",
            crate::units::fmt_bytes(self.pool.config().arena_size)
        )
    }

    fn peak_reserved_bytes(&self) -> Option<u64> {
        Some(self.stats().peak_reserved_bytes)
    }

    fn notes(&self) -> Vec<(String, String)> {
        let s = self.stats();
        vec![
            ("peak arenas".to_string(), self.peak_arenas().to_string()),
            ("arenas created".to_string(), s.backend_creates.to_string()),
            (
                "arenas destroyed".to_string(),
                s.backend_destroys.to_string(),
            ),
        ]
    }
}

/// The sim device the trace tools replay on: 256 GiB (held bytes are a ledger; memory is
/// only used where written), so no recorded loop runs out of it.
pub fn replay_sim() -> Result<Arc<SimBackend>, String> {
    let config = SimConfig {
        capacity: 256 << 30,
        ..SimConfig::default()
    };
    Ok(Arc::new(
        SimBackend::new(config).map_err(|e| e.to_string())?,
    ))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::replay::replay;
    use crate::replay::tests::FakeBackend;
    use crate::trace::{generate, TraceConfig};

    #[test]
    fn pool_replays_a_small_trace() {
        // The pool validates itself after every op in debug builds: keep the trace small.
        let t = generate(&TraceConfig {
            requests: 25,
            max_running: 8,
            ..TraceConfig::default()
        });
        let mut a = PoolAllocator::new(
            Arc::new(FakeBackend::default()),
            PoolConfig {
                arena_size: 256 << 20,
                ..PoolConfig::default()
            },
            0,
        )
        .unwrap();
        let r = replay(&t, &mut a).unwrap();
        assert_eq!(r.peak_live, t.peak_live_bytes);
        assert!(r.peak_reserved >= r.peak_live);
        assert!(a.peak_arenas() >= 1);
        assert_eq!(a.stats().allocations, 0);
        a.pool().validate(0).unwrap();
    }
}
