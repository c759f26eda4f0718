//! The `metrics` facade's names are `STAT_FIELDS`' (alloc/src/stats.rs, the one table of the
//! metrics, from which docs/metrics.md is generated and which the library serves to the Python
//! collector, gpu_arena.prometheus): a pool registers exactly the rows marked for the facade,
//! with their types and the label `device`, and every row names a `PoolStats` field.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use gpu_arena::backend::sim::{SimBackend, SimCall, SimConfig};
use gpu_arena::stats::STAT_FIELDS;
use gpu_arena::{Pool, PoolConfig, PoolStats, StreamId};
use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};

/// One registration: (name, type, labels).
type Registration = (String, &'static str, Vec<(String, String)>);

/// Records what is registered.
#[derive(Default)]
struct Registrations(Mutex<BTreeSet<Registration>>);

impl Registrations {
    fn add(&self, key: &Key, kind: &'static str) {
        let labels = key
            .labels()
            .map(|l| (l.key().to_string(), l.value().to_string()))
            .collect();
        self.0
            .lock()
            .unwrap()
            .insert((key.name().to_string(), kind, labels));
    }
}

impl Recorder for Registrations {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        self.add(key, "counter");
        Counter::noop()
    }
    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        self.add(key, "gauge");
        Gauge::noop()
    }
    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        self.add(key, "histogram");
        Histogram::noop()
    }
}

#[test]
fn pool_registers_the_tables_rust_rows() {
    let rec = Registrations::default();
    let backend = Arc::new(SimBackend::new(SimConfig::default()).unwrap());
    let pool =
        metrics::with_local_recorder(&rec, || Pool::new(backend, PoolConfig::default()).unwrap());
    let registered = rec.0.lock().unwrap().clone();
    let expected: BTreeSet<_> = STAT_FIELDS
        .iter()
        .filter(|f| f.facade)
        .map(|f| {
            let device = vec![("device".to_string(), "0".to_string())];
            (f.metric.to_string(), f.kind.as_str(), device)
        })
        .collect();
    assert_eq!(registered, expected);
    drop(pool);
}

#[test]
fn every_row_is_a_pool_stats_field_and_every_field_a_row() {
    // The serialized struct's fields (serde_json sorts them), against the table's.
    let value = serde_json::to_value(PoolStats::default()).unwrap();
    let fields: BTreeSet<String> = value.as_object().unwrap().keys().cloned().collect();
    let named: BTreeSet<String> = STAT_FIELDS.iter().map(|f| f.name.to_string()).collect();
    assert_eq!(named.len(), STAT_FIELDS.len(), "a field named twice");
    assert_eq!(named, fields);
    let metrics: BTreeSet<&str> = STAT_FIELDS.iter().map(|f| f.metric).collect();
    assert_eq!(metrics.len(), STAT_FIELDS.len(), "a metric named twice");
    for f in STAT_FIELDS {
        assert!(f.metric.starts_with("gpu_arena_"), "{}", f.metric);
        assert_eq!(
            f.name.ends_with("_bytes"),
            f.metric.ends_with("_bytes"),
            "{}",
            f.metric
        );
    }
    // (The offsets are `offset_of!` of the named field, and stats.rs checks at compile time
    // that the rows follow the struct's order and cover it.)
}

/// Keeps every counter's value, by name.
#[derive(Default)]
struct Counts(Mutex<BTreeMap<String, Arc<AtomicU64>>>);

impl Counts {
    fn get(&self, name: &str) -> u64 {
        self.0.lock().unwrap()[name].load(Ordering::Relaxed)
    }
}

impl Recorder for Counts {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        let mut map = self.0.lock().unwrap();
        let c = map.entry(key.name().to_string()).or_default();
        Counter::from_arc(Arc::clone(c))
    }
    fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::noop()
    }
    fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::noop()
    }
}

/// The create and destroy counters have one source: the metrics say what the stats say,
/// for a grown arena (its chunks are driver allocations) whose destroy failed once and was
/// retried by the next `empty_cache` (counted once, when the pool gave the arena up).
#[test]
fn driver_allocation_counters_agree_with_the_stats_across_a_failed_destroy() {
    const MIB: u64 = 1 << 20;
    let counts = Counts::default();
    let sim = Arc::new(SimBackend::new(SimConfig::default()).unwrap());
    let pool = metrics::with_local_recorder(&counts, || {
        Pool::new(sim.clone(), PoolConfig::default()).unwrap()
    });
    // Three requests of 20 MiB: one growing arena of three chunks.
    let blocks: Vec<_> = (0..3)
        .map(|_| pool.alloc(0, 20 * MIB, StreamId(1)).unwrap())
        .collect();
    for b in &blocks {
        pool.free(b.ptr).unwrap();
    }
    let s = pool.stats(0).unwrap();
    assert_eq!(
        (s.arenas, s.arena_growths, s.backend_creates),
        (1, 2, 3),
        "{s:?}"
    );
    sim.fail_nth(SimCall::DestroyArena, 1);
    assert!(pool.empty_cache(None).is_err());
    // The device still holds the arena whose destroy failed: it stays in reserved_bytes
    // (found by pool_model.rs: reserved had dropped to 0 while the device held 60 MiB).
    assert_eq!(
        pool.stats(0).unwrap().reserved_bytes,
        sim.ledger(0).held_bytes
    );
    assert_eq!(sim.ledger(0).held_bytes, 60 * MIB);
    pool.empty_cache(None).unwrap();
    assert_eq!(pool.stats(0).unwrap().reserved_bytes, 0);
    assert!(sim.is_clean(0), "{:?}", sim.ledger(0));
    let s = pool.stats(0).unwrap();
    assert_eq!((s.backend_creates, s.backend_destroys), (3, 3), "{s:?}");
    assert_eq!(
        counts.get("gpu_arena_backend_creates_total"),
        s.backend_creates
    );
    assert_eq!(
        counts.get("gpu_arena_backend_destroys_total"),
        s.backend_destroys
    );
}
