//! Statistics in layers: cheap counters per device ([`PoolStats`]), `metrics` gauges fed
//! from them, and a JSON snapshot of every arena and range (`Pool::snapshot_json`).
//!
//! [`STAT_FIELDS`] is the one table of the counters and the metrics that expose them (name,
//! offset, metric name, type, help), beside the struct: the C API serves it
//! (`gpu_arena_stats_fields`), the Python package builds `gpu_arena.stats()` and its
//! Prometheus collector (`gpu_arena.prometheus`) from it, docs/metrics.md is generated from it
//! (`alloc/tests/generated_docs.rs`), and `alloc/tests/metrics_names.rs` checks that
//! `DeviceMetrics` registers exactly its rows marked for the `metrics` facade. A new counter is
//! a field of [`PoolStats`] and its row in [`STAT_FIELDS`] (the build fails without the row).

use crate::backend::DeviceId;

/// Counters of one device's pool. All sizes in bytes.
///
/// The C API's `gpu_arena_stats_t` is this struct: `gpu_arena.h` is generated from this
/// definition (`PoolStats` in alloc/src/stats.rs). New fields go last.
// One definition for Rust, C and Python: cbindgen emits it, renamed, into
// ffi/include/gpu_arena.h (ffi/cbindgen.toml), hence `#[repr(C)]` and `u64` fields only;
// every field has its row in STAT_FIELDS below, which the library serves to Python.
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

/// How a [`PoolStats`] field is exposed as a metric.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricKind {
    /// A value that goes up and down (Prometheus `gauge`).
    Gauge,
    /// A count that only grows while the process lives (Prometheus `counter`; the name ends
    /// in `_total`).
    Counter,
}

impl MetricKind {
    /// Its Prometheus type: `"gauge"` or `"counter"`.
    pub const fn as_str(self) -> &'static str {
        match self {
            MetricKind::Gauge => "gauge",
            MetricKind::Counter => "counter",
        }
    }
}

/// One field of [`PoolStats`] and the metric that exposes it: a row of [`STAT_FIELDS`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StatField {
    /// The field's name (the key of Python's `gpu_arena.stats()`).
    pub name: &'static str,
    /// Its first byte in [`PoolStats`] (every field is a `u64`).
    pub offset: usize,
    /// The metric's name (`gpu_arena_...`; counters end in `_total`).
    pub metric: &'static str,
    /// The metric's type.
    pub kind: MetricKind,
    /// Whether the pool publishes it through the `metrics` facade (`DeviceMetrics`); the
    /// Python collector exposes every row.
    pub facade: bool,
    /// What it counts, one sentence: the metric's help text.
    pub help: &'static str,
}

/// A row of [`STAT_FIELDS`]: `field, metric, Gauge|Counter, facade, help`.
macro_rules! row {
    ($field:ident, $metric:literal, $kind:ident, $facade:literal, $help:literal) => {
        StatField {
            name: stringify!($field),
            offset: std::mem::offset_of!(PoolStats, $field),
            metric: $metric,
            kind: MetricKind::$kind,
            facade: $facade,
            help: $help,
        }
    };
}

/// Every field of [`PoolStats`], in its order, with its metric: the one table (see the
/// module docs for who reads it). A field without its row fails the build.
pub const STAT_FIELDS: &[StatField] = checked(&[
    row!(reserved_bytes, "gpu_arena_reserved_bytes", Gauge, true,
        "Bytes in arenas held from the backend."),
    row!(allocated_bytes, "gpu_arena_allocated_bytes", Gauge, true,
        "Bytes in live allocations as served, each request rounded up to its block size (freed-but-shared ranges included)."),
    row!(peak_reserved_bytes, "gpu_arena_peak_reserved_bytes", Gauge, false,
        "Highest reserved bytes seen."),
    row!(peak_allocated_bytes, "gpu_arena_peak_allocated_bytes", Gauge, false,
        "Highest allocated bytes seen."),
    row!(arenas, "gpu_arena_arenas", Gauge, true,
        "Arenas held."),
    row!(backend_creates, "gpu_arena_backend_creates_total", Counter, true,
        "Driver allocations created through the backend (arenas, a grown arena's chunks, a wake's memory)."),
    row!(backend_destroys, "gpu_arena_backend_destroys_total", Counter, true,
        "Driver allocations handed back to the backend (arenas, a grown arena's chunks, a sleep's memory)."),
    row!(exports_live, "gpu_arena_exports_live", Gauge, true,
        "Arenas exported right now."),
    row!(exports_total, "gpu_arena_exports_total", Counter, true,
        "Driver exports made."),
    row!(shares_live, "gpu_arena_shares_live", Gauge, false,
        "Shares handed out and not yet unshared."),
    row!(imports_live, "gpu_arena_imports_live", Gauge, false,
        "Consumer leases (imports by other processes) on this pool's memory, live now."),
    row!(pinned_bytes, "gpu_arena_pinned_bytes", Gauge, true,
        "Bytes in arenas pinned by a non-releasable export (recycled, never destroyed)."),
    row!(allocations, "gpu_arena_allocations_live", Gauge, false,
        "Live allocations."),
    row!(alloc_count, "gpu_arena_allocations_total", Counter, false,
        "Allocations served."),
    row!(free_count, "gpu_arena_frees_total", Counter, false,
        "Frees."),
    row!(oom_count, "gpu_arena_oom_total", Counter, true,
        "Allocations that failed for lack of memory."),
    row!(deferred_free_bytes, "gpu_arena_deferred_free_bytes", Gauge, false,
        "Bytes freed by the producer but still shared (reused once the shares end)."),
    row!(pending_free_bytes, "gpu_arena_pending_free_bytes", Gauge, false,
        "Bytes freed with record_stream streams, waiting for their events."),
    row!(requested_bytes, "gpu_arena_requested_bytes", Gauge, true,
        "Bytes callers asked for in live allocations, before rounding."),
    row!(peak_requested_bytes, "gpu_arena_peak_requested_bytes", Gauge, false,
        "Highest requested bytes seen."),
    row!(observer_errors, "gpu_arena_observer_errors_total", Counter, false,
        "Arena observer callbacks that failed (an on_ready that refused or panicked, an on_release that panicked)."),
    row!(sleeping_bytes, "gpu_arena_sleeping_bytes", Gauge, false,
        "Bytes of arenas asleep (`gpu_arena_sleep`): addresses reserved, memory given back to the driver."),
    row!(offload_host_bytes, "gpu_arena_offload_host_bytes", Gauge, false,
        "Bytes of host memory held for sleep offloads: sleeping arenas' contents and buffers kept for the next sleep (`gpu_arena_sleep_release_host` frees those)."),
    row!(sleep_kept_shared_bytes, "gpu_arena_sleep_kept_shared_bytes", Gauge, false,
        "Bytes of arenas whose tag sleeps but which kept their memory because another process may map them (shared, exported or pinned)."),
    row!(arena_growths, "gpu_arena_arena_growths_total", Counter, false,
        "Growth steps of growing arenas (`grow_arenas=1`): each mapped one more chunk."),
]);

/// `table`, checked at compile time: it is the struct, one row per field in order (all `u64`,
/// so the rows' offsets step by 8 and cover the struct), and its metric names follow the
/// Prometheus conventions.
const fn checked(table: &'static [StatField]) -> &'static [StatField] {
    assert!(
        table.len() * 8 == std::mem::size_of::<PoolStats>(),
        "every PoolStats field needs its row in STAT_FIELDS"
    );
    let mut i = 0;
    while i < table.len() {
        let f = &table[i];
        assert!(
            f.offset == i * 8,
            "STAT_FIELDS rows follow PoolStats' field order"
        );
        assert!(
            ends_with(f.metric, "_total") == matches!(f.kind, MetricKind::Counter),
            "counters, and only they, end in _total"
        );
        i += 1;
    }
    table
}

/// `text.ends_with(suffix)`, in a const context.
const fn ends_with(text: &str, suffix: &str) -> bool {
    let (t, s) = (text.as_bytes(), suffix.as_bytes());
    if s.len() > t.len() {
        return false;
    }
    let mut i = 0;
    while i < s.len() {
        if t[t.len() - s.len() + i] != s[i] {
            return false;
        }
        i += 1;
    }
    true
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
