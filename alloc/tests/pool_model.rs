//! A model-based property test of the whole pool on the sim backend: random sequences of
//! every operation a user can mix — allocations of every class on three streams and three
//! tags, frees, `record_stream`, streams whose work does not finish (events pending), shares,
//! leases and unshares, `empty_cache`, `trim`, sleep and wake of some tags (offloaded or
//! not), graph pools (begin, allocate, end, release; checkpoints taken and restored), bursts of 2 MiB blocks freed together
//! (neighbours cached at once, which a larger miss may take back as a run), `max_reserved`
//! changed at run time, history recording switched on and off, snapshots and peak resets
//! checked against the model — with a fault
//! injected into the next backend call now and then, on growing arenas (the default), with
//! an arena observer, and on fixed ones. A step runs on the test's thread or on one of two
//! helper threads (blocks freed on another thread than the one that allocated them; a
//! helper retired now and then leaves its thread cache behind, `pool_model/helpers.rs`);
//! each case also draws a configuration (`arena_size`, `max_reserved`,
//! `trim_on_empty_cache`). The pool has two sim devices: each step names one, and
//! `empty_cache`, `trim`, sleep, wake and the host buffers' calls sometimes every device. A
//! fourth run gives each device's sequence a thread of its own, both at once.
//! The files: `pool_model/ops.rs` (the operations), `model.rs` (one device's model and its
//! checks), `world.rs` (the pool, the two models, calls on every device, the teardown),
//! `helpers.rs` (the helper threads), `graphs.rs` (graph pools and their checkpoints), `views.rs` (segments, the JSON snapshot and the peaks
//! checked against the model), `observer.rs`.
//!
//! After every operation, whether it succeeded or failed, the pool must agree with the
//! model: `validate` passes; no two live blocks overlap; every awake block (and every range
//! freed while shared) holds the bytes written into it; `allocated_bytes` is the sum of the
//! live blocks; the asleep tags are the model's. A new block must never land on memory that
//! another stream's unfinished work may still use (freed on a stream whose events are
//! pending, or `record_stream`ed on one), on a range still shared, or on a graph pool's
//! memory while that pool is in use. An operation that fails must change nothing the model
//! sees. At the end everything is freed, unshared and woken, and after `empty_cache` the sim
//! devices hold nothing.
//!
//! `GPU_ARENA_MODEL_CASES` sets the number of cases (default 48 per run),
//! `GPU_ARENA_MODEL_STEPS` the longest sequence (default 160).
#![allow(clippy::unwrap_used)]

use proptest::prelude::*;

mod common;
#[path = "pool_model/graphs.rs"]
mod graphs;
#[path = "pool_model/helpers.rs"]
mod helpers;
#[path = "pool_model/model.rs"]
mod model;
#[path = "pool_model/observer.rs"]
mod observer;
#[path = "pool_model/ops.rs"]
mod ops;
#[path = "pool_model/views.rs"]
mod views;
#[path = "pool_model/world.rs"]
mod world;
use world::{conf, step, Conf, Step, World};

fn run(grow: bool, observe: bool, conf: &Conf, steps: &[Step]) -> Result<(), TestCaseError> {
    let mut w = World::new(grow, observe, conf);
    for (n, step) in steps.iter().enumerate() {
        w.apply(step)
            .map_err(|e| TestCaseError::fail(format!("step {n} {step:?}: {e}")))?;
    }
    w.teardown().map_err(TestCaseError::fail)
}

/// Two threads, one device each, at the same time; then the teardown.
fn run_threads(conf: &Conf, steps: [Vec<Step>; 2]) -> Result<(), TestCaseError> {
    let mut w = World::new(true, true, conf);
    w.run_threads(steps).map_err(TestCaseError::fail)?;
    w.teardown().map_err(TestCaseError::fail)
}

/// The longest sequence: `GPU_ARENA_MODEL_STEPS` (default 160).
fn max_steps() -> usize {
    std::env::var("GPU_ARENA_MODEL_STEPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(160)
}

fn cases() -> u32 {
    std::env::var("GPU_ARENA_MODEL_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(48)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn growing_arenas_follow_the_model(conf in conf(), steps in prop::collection::vec(step(), 1..max_steps())) {
        run(true, false, &conf, &steps)?;
    }

    #[test]
    fn growing_arenas_with_an_observer_follow_the_model(conf in conf(), steps in prop::collection::vec(step(), 1..max_steps())) {
        run(true, true, &conf, &steps)?;
    }

    #[test]
    fn two_threads_on_two_devices_follow_the_model(
        conf in conf(),
        a in prop::collection::vec(step(), 1..max_steps()),
        b in prop::collection::vec(step(), 1..max_steps()),
    ) {
        run_threads(&conf, [a, b])?;
    }

    #[test]
    fn fixed_arenas_follow_the_model(conf in conf(), steps in prop::collection::vec(step(), 1..max_steps())) {
        run(false, false, &conf, &steps)?;
    }
}
