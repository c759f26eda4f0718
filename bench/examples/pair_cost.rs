//! Where an alloc+free pair's time goes (issue #14): the pool's warm pair against the floor
//! of what any allocator with a pointer-keyed record must do (one hash insert and one hash
//! remove of a 40-byte record, one free-list pop and one push), in one process.
//!
//! ```text
//! cargo run --release -p gpu-arena-bench --example pair_cost -- [--pairs 2000000] [--which both|pool|floor|miss]
//! valgrind --tool=callgrind --collect-atstart=no --toggle-collect='*pool_pairs*' \
//!     target/release/examples/pair_cost --pairs 200000 --which pool --capacity-gib 16
//! ```
//!
//! (`--capacity-gib`: the sim device's size, 64 by default; under valgrind 16, since a
//! growing arena reserves address space for the whole device and valgrind's is smaller.)
//!
//! The pool's pairs are 2 MiB on one stream (the thread cache's hit path after the first
//! pair), through `Pool::alloc` / `Pool::free` on the sim backend. `--which` runs one side
//! alone (for callgrind); `--which miss` runs pairs that miss every cache (blocks above
//! 64 MiB: the sub-allocator's best fit and coalescing under the device lock). The figures
//! and the callgrind breakdown are in `bench/results/sim-2026-11-30-pair-cost.md`,
//! `bench/results/sim-2026-12-01-miss-path.md` and `bench/gpu/README.md`.
#![allow(clippy::unwrap_used)]

use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

use gpu_arena::backend::sim::{SimBackend, SimConfig};
use gpu_arena::{Pool, PoolConfig, StreamId};
use rustc_hash::FxHashMap;

const BLOCK: u64 = 2 << 20;

/// A record the size of the pool's live record (`Live`, 40 bytes).
#[derive(Clone, Copy)]
struct Record {
    _words: [u64; 5],
}

#[inline(never)]
fn pool_pairs(pool: &Pool, n: u64) -> f64 {
    let t0 = Instant::now();
    for _ in 0..n {
        let a = pool.alloc(0, BLOCK, StreamId(7)).unwrap();
        pool.free(black_box(a.ptr)).unwrap();
    }
    t0.elapsed().as_nanos() as f64 / n as f64
}

/// Pairs that miss the caches: blocks above `CACHE_MAX_BLOCK` (never cached), sizes cycling
/// through four lengths on one stream, so each allocation is a best fit in the huge class's
/// free ranges and each free coalesces (the second KV trace's temporaries above 64 MiB).
#[inline(never)]
fn miss_pairs(pool: &Pool, n: u64) -> f64 {
    const MISS_LENS: [u64; 4] = [66 << 20, 130 << 20, 200 << 20, 98 << 20];
    let t0 = Instant::now();
    for i in 0..n {
        let a = pool
            .alloc(0, MISS_LENS[i as usize % 4], StreamId(7))
            .unwrap();
        pool.free(black_box(a.ptr)).unwrap();
    }
    t0.elapsed().as_nanos() as f64 / n as f64
}

#[inline(never)]
fn floor_pairs(n: u64) -> f64 {
    let mut live: FxHashMap<u64, Record> = FxHashMap::default();
    live.reserve(1024);
    let mut free: Vec<u64> = (0..64).map(|i| 0x7f00_0000_0000 + i * BLOCK).collect();
    let t0 = Instant::now();
    for i in 0..n {
        let ptr = free.pop().unwrap();
        live.insert(ptr, black_box(Record { _words: [i; 5] }));
        let rec = live.remove(black_box(&ptr)).unwrap();
        black_box(rec);
        free.push(ptr);
    }
    t0.elapsed().as_nanos() as f64 / n as f64
}

fn main() {
    let (mut n, mut which, mut capacity_gib) = (2_000_000u64, "both".to_string(), 64u64);
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let v = args.next().unwrap_or_default();
        match flag.as_str() {
            "--pairs" => n = v.parse().expect("a number"),
            "--which" => which = v,
            "--capacity-gib" => capacity_gib = v.parse().expect("a number"),
            _ => panic!("unknown flag {flag} (--pairs, --which, --capacity-gib)"),
        }
    }
    let sim = SimBackend::new(SimConfig {
        capacity: capacity_gib << 30,
        ..SimConfig::default()
    })
    .unwrap();
    let pool = Pool::new(
        Arc::new(sim),
        PoolConfig {
            validate: false,
            ..PoolConfig::default()
        },
    )
    .unwrap();
    pool_pairs(&pool, 1000); // the arena, the thread cache
    if which == "miss" {
        miss_pairs(&pool, 1000); // the huge class's arena
        for round in 0..3 {
            println!("round {round}: miss pair {:.1} ns", miss_pairs(&pool, n));
        }
        return;
    }
    for round in 0..3 {
        let p = (which != "floor").then(|| pool_pairs(&pool, n));
        let f = (which != "pool").then(|| floor_pairs(n));
        match (p, f) {
            (Some(p), Some(f)) => println!(
                "round {round}: pool pair {p:.1} ns, floor {f:.1} ns, pool/floor {:.2}",
                p / f
            ),
            (Some(p), None) => println!("round {round}: pool pair {p:.1} ns"),
            (None, Some(f)) => println!("round {round}: floor {f:.1} ns"),
            (None, None) => {}
        }
    }
}
