//! The `metrics` facade's names are docs/metrics.md's table (the one table shared with the
//! Python collector, gpu_arena.prometheus): a pool registers exactly the rows marked "yes"
//! under "Rust", with their types and the label `device`, and every row names a `PoolStats`
//! field.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use gpu_arena::backend::sim::{SimBackend, SimConfig};
use gpu_arena::{Pool, PoolConfig, PoolStats};
use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};

/// A row of the table: (name, type, field, rust).
type Row = (String, String, String, bool);

fn table() -> Vec<Row> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../docs/metrics.md");
    let text = std::fs::read_to_string(&path).unwrap();
    let rows: Vec<Row> = text
        .lines()
        .filter(|l| l.starts_with("| `gpu_arena_"))
        .map(|l| {
            let cells: Vec<&str> = l.trim_matches('|').split(" | ").map(str::trim).collect();
            assert_eq!(cells.len(), 5, "{l}");
            let unquote = |s: &str| s.trim_matches('`').to_string();
            (
                unquote(cells[0]),
                cells[1].to_string(),
                unquote(cells[2]),
                cells[3] == "yes",
            )
        })
        .collect();
    assert!(!rows.is_empty(), "no rows in {}", path.display());
    rows
}

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
    let expected: BTreeSet<_> = table()
        .into_iter()
        .filter(|r| r.3)
        .map(|(name, kind, _, _)| {
            let kind: &'static str = match kind.as_str() {
                "gauge" => "gauge",
                "counter" => "counter",
                other => panic!("{name}: type {other}"),
            };
            (name, kind, vec![("device".to_string(), "0".to_string())])
        })
        .collect();
    assert_eq!(registered, expected);
    drop(pool);
}

#[test]
fn every_row_is_a_pool_stats_field_and_every_field_a_row() {
    let value = serde_json::to_value(PoolStats::default()).unwrap();
    let fields: BTreeSet<String> = value.as_object().unwrap().keys().cloned().collect();
    let rows: Vec<Row> = table();
    let named: BTreeSet<String> = rows.iter().map(|r| r.2.clone()).collect();
    assert_eq!(named.len(), rows.len(), "a field named twice");
    assert_eq!(named, fields);
    for (name, kind, _, _) in &rows {
        assert_eq!(name.ends_with("_total"), kind == "counter", "{name}");
    }
}
