//! Issue #24's bound on the recorded PyTorch loops, kept: replayed on the sim backend,
//! gpu-arena with growing arenas reserves about what PyTorch with expandable segments
//! reserves on the *same* allocation sequence ([`ExpandableModel`], which gives PyTorch's
//! H200 peaks to the MiB on all six loops). On the traces of `bench/traces/`: 18 and 22 MiB
//! less on the medium loops, 22 and 6 MiB more on the large ones (0.06% and 0.01%), 4 and
//! 32 MiB more on the small ones (1.1% and 5.7%: blocks up to 2 MiB are cached whole;
//! `bench/results/sim-2026-12-02-expandable-model.md` says what closing that costs). On the
//! two generated KV traces within 1% (the first 0.23% above: its last growth step; the
//! second 1.5% below; before growing arenas took the best fit of every range a stream may
//! use, the second reserved 17% more than the model: `bench/results/sim-2026-12-02-take-in.md`).
#![allow(clippy::unwrap_used)]

use gpu_arena_bench::pool_adapter::replay_sim;
use gpu_arena_bench::torch_trace::read_file;
use gpu_arena_bench::{replay, ExpandableModel, PoolAllocator};

const MIB: u64 = 1 << 20;

/// Loops of at least this much peak: within [`LARGE_SLACK`] of the model.
const LARGE_LOOP: u64 = 1 << 30;
/// Parts of the model's peak a large loop may exceed it by (1/1000).
const LARGE_SLACK: u64 = 1000;
/// Parts of the model's peak a small loop may exceed it by (1/16).
const SMALL_SLACK: u64 = 16;
/// Parts of the model's peak a KV trace may exceed it by (1/100).
const KV_SLACK: u64 = 100;

/// Peak reserved bytes of gpu-arena with growing arenas and of the model on `trace`.
fn peaks(trace: &gpu_arena_bench::Trace) -> (u64, u64) {
    let sim = replay_sim().unwrap();
    let mut pool = PoolAllocator::from_config(sim, "grow_arenas=1,validate=0").unwrap();
    let ours = replay(trace, &mut pool).unwrap().peak_reserved;
    let model = replay(trace, &mut ExpandableModel::new())
        .unwrap()
        .peak_reserved;
    (ours, model)
}

#[test]
fn growing_arenas_reserve_within_a_percent_of_expandable_segments_on_the_kv_traces() {
    for name in ["kv:default", "kv:long"] {
        let (ours, model) = peaks(&read_file(name).unwrap());
        assert!(
            ours <= model + model / KV_SLACK,
            "{name}: {} MiB against {} MiB",
            ours / MIB,
            model / MIB
        );
    }
}

#[test]
fn growing_arenas_reserve_about_what_expandable_segments_do_on_every_recorded_loop() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/traces");
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with(".trace.gz"))
        .collect();
    files.sort();
    assert_eq!(files.len(), 6, "{files:?}");
    let mut report = Vec::new();
    for f in &files {
        let (ours, model) = peaks(&read_file(&f.to_string_lossy()).unwrap());
        report.push(format!(
            "{}: {} MiB against {} MiB",
            f.file_name().unwrap().to_string_lossy(),
            ours / MIB,
            model / MIB
        ));
        let slack = if model >= LARGE_LOOP {
            LARGE_SLACK
        } else {
            SMALL_SLACK
        };
        assert!(ours <= model + model / slack, "{report:?}");
    }
}
