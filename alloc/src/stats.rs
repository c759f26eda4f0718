//! Statistics in layers: cheap counters per device ([`PoolStats`]), `metrics` gauges fed
//! from them, and a JSON snapshot of every arena and range (`Pool::snapshot_json`).
//!
//! Metric names: the table in docs/metrics.md, shared with the Python collector
//! (`gpu_arena.prometheus`); `alloc/tests/metrics_names.rs` checks that `DeviceMetrics`
//! registers exactly its rows marked for Rust, with their types and the label `device`.

use crate::backend::DeviceId;

/// Counters of one device's pool. All sizes in bytes.
///
/// The C API's `gpu_arena_stats_t` is this struct: `gpu_arena.h` is generated from this
/// definition (`PoolStats` in alloc/src/stats.rs). New fields go last.
// One definition for Rust, C and Python: cbindgen emits it, renamed, into
// ffi/include/gpu_arena.h (ffi/cbindgen.toml), hence `#[repr(C)]` and `u64` fields only;
// Python's `GpuArenaStats` is checked against the header by tests/python.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct PoolStats {
    /// Bytes in arenas held from the backend.
    pub reserved_bytes: u64,
    /// Bytes in live allocations as served: each request rounded up to its block size
    /// (512 B granules, size classes, 2 MiB multiples above 1 MiB); freed-but-shared ranges
    /// included. Compare `requested_bytes`.
    pub allocated_bytes: u64,
    /// Highest `reserved_bytes` seen.
    pub peak_reserved_bytes: u64,
    /// Highest `allocated_bytes` seen.
    pub peak_allocated_bytes: u64,
    /// Arenas held.
    pub arenas: u64,
    /// Driver allocations created through the backend, ever: arenas, a grown arena's chunks,
    /// a wake's restored memory.
    pub backend_creates: u64,
    /// Driver allocations handed back to the backend, ever: arenas, a grown arena's chunks, a
    /// sleep's released memory.
    pub backend_destroys: u64,
    /// Arenas exported right now.
    pub exports_live: u64,
    /// Driver exports made, ever.
    pub exports_total: u64,
    /// Shares handed out and not yet unshared.
    pub shares_live: u64,
    /// Consumer leases (imports by other processes) on this pool's memory, live now.
    pub imports_live: u64,
    /// Bytes in arenas pinned by a non-releasable export (recycled, never destroyed).
    pub pinned_bytes: u64,
    /// Live allocations.
    pub allocations: u64,
    /// Allocations served, ever.
    pub alloc_count: u64,
    /// Frees, ever.
    pub free_count: u64,
    /// Allocations that failed for lack of memory.
    pub oom_count: u64,
    /// Bytes freed by the producer but still shared (reused once the shares end).
    pub deferred_free_bytes: u64,
    /// Bytes freed with `record_stream` streams, waiting for their events.
    pub pending_free_bytes: u64,
    /// Bytes callers asked for in live allocations, before rounding (PyTorch's
    /// `requested_bytes`): `allocated_bytes - requested_bytes` is what rounding costs.
    /// Counted over the same allocations as `allocated_bytes`.
    pub requested_bytes: u64,
    /// Highest `requested_bytes` seen.
    pub peak_requested_bytes: u64,
    /// Arena observer callbacks that failed: an `on_ready` that returned an error (nonzero
    /// in C) or panicked, or an `on_release` that panicked (`pool/state/observer_registry.rs`).
    pub observer_errors: u64,
    /// Bytes of arenas asleep (`gpu_arena_sleep`): their addresses stay reserved, their
    /// memory went back to the driver (not in `reserved_bytes`).
    pub sleeping_bytes: u64,
    /// Bytes of host memory (pinned where the backend has it) held for sleep offloads: the
    /// contents of sleeping arenas, and buffers kept for the next sleep (reused, so a sleep
    /// need not pin again; `gpu_arena_sleep_release_host` frees the kept ones).
    pub offload_host_bytes: u64,
    /// Bytes of arenas whose tag sleeps but which kept their memory because they are shared,
    /// exported or pinned (a consumer may map them: sleep never breaks one); counted in
    /// `reserved_bytes` too.
    pub sleep_kept_shared_bytes: u64,
    /// Growth steps of growing arenas, ever (`pool/growth/grow.rs`): each mapped one more chunk
    /// (a driver allocation, counted in `backend_creates` too).
    pub arena_growths: u64,
}

/// `metrics` handles for one device, registered once so the hot path does not format labels.
#[derive(Clone)]
#[repr(C)]
pub(crate) struct DeviceMetrics {
    /// First: the two gauges every allocation and free sets (`DevicePool` keeps them on its
    /// first cache line).
    allocated: metrics::Gauge,
    requested: metrics::Gauge,
    reserved: metrics::Gauge,
    arenas: metrics::Gauge,
    pinned: metrics::Gauge,
    exports_live: metrics::Gauge,
    pub(crate) creates: metrics::Counter,
    pub(crate) destroys: metrics::Counter,
    pub(crate) exports: metrics::Counter,
    pub(crate) ooms: metrics::Counter,
}

impl DeviceMetrics {
    pub(crate) fn new(device: DeviceId) -> Self {
        let d = device.to_string();
        DeviceMetrics {
            reserved: metrics::gauge!("gpu_arena_reserved_bytes", "device" => d.clone()),
            allocated: metrics::gauge!("gpu_arena_allocated_bytes", "device" => d.clone()),
            requested: metrics::gauge!("gpu_arena_requested_bytes", "device" => d.clone()),
            arenas: metrics::gauge!("gpu_arena_arenas", "device" => d.clone()),
            pinned: metrics::gauge!("gpu_arena_pinned_bytes", "device" => d.clone()),
            exports_live: metrics::gauge!("gpu_arena_exports_live", "device" => d.clone()),
            creates: metrics::counter!("gpu_arena_backend_creates_total", "device" => d.clone()),
            destroys: metrics::counter!("gpu_arena_backend_destroys_total", "device" => d.clone()),
            exports: metrics::counter!("gpu_arena_exports_total", "device" => d.clone()),
            ooms: metrics::counter!("gpu_arena_oom_total", "device" => d),
        }
    }

    /// Publish the allocated- and requested-bytes gauges (the only ones an allocation or
    /// free from the pool's free ranges changes).
    pub(crate) fn publish_allocated(&self, allocated_bytes: u64, requested_bytes: u64) {
        self.allocated.set(allocated_bytes as f64);
        self.requested.set(requested_bytes as f64);
    }

    /// Publish the gauges from the counters.
    pub(crate) fn publish(&self, s: &PoolStats) {
        self.reserved.set(s.reserved_bytes as f64);
        self.allocated.set(s.allocated_bytes as f64);
        self.requested.set(s.requested_bytes as f64);
        self.arenas.set(s.arenas as f64);
        self.pinned.set(s.pinned_bytes as f64);
        self.exports_live.set(s.exports_live as f64);
    }
}

impl std::fmt::Debug for DeviceMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DeviceMetrics")
    }
}
