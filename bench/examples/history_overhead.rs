//! What the allocation history (`alloc/src/history.rs`) costs: alloc+free pairs through a
//! [`Pool`] on the sim backend with recording off and on, alternating in one process
//! (this 2-core machine's absolute times drift; the ratios are the result).
//!
//! ```text
//! cargo run --release -p gpu-arena-bench --example history_overhead -- [--pairs 2000000] [--rounds 5]
//! ```
//!
//! Sizes cycle over 512 B, 4 KiB, 64 KiB, 2 MiB and 3 MiB (cache hits, the common case), one
//! stream. "off" is the state every pool starts in: the only cost is one `bool` check of the
//! device state, under the lock alloc and free already take. Prints ns per pair for each
//! round and the median ratios on/off.
//!
//! Measured on the 2-core dev VM (release, no LTO), 5 rounds of 2 M pairs: off 118 ns/pair,
//! on 163 ns/pair, median on/off 1.42 (three events per pair, ~15 ns each; the precise
//! clock made it 2.6). Off against a build without the hooks (`replay_pool`, main vs this
//! change, interleaved 5 times): 2 MiB pair 103.7-106.1 vs 102.9-112.1 ns, KV replay
//! 77.9-88.0 vs 78.4-90.3 ns/op: within this machine's noise.
#![allow(clippy::unwrap_used)]

use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

use gpu_arena::backend::sim::{SimBackend, SimConfig};
use gpu_arena::{Pool, PoolConfig, StreamId};

const SIZES: [u64; 5] = [512, 4 << 10, 64 << 10, 2 << 20, 3 << 20];

fn pairs(pool: &Pool, n: u64) -> f64 {
    let t0 = Instant::now();
    for i in 0..n {
        let a = pool.alloc(0, SIZES[(i % 5) as usize], StreamId(0)).unwrap();
        pool.free(black_box(a.ptr)).unwrap();
    }
    t0.elapsed().as_nanos() as f64 / n as f64
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let (mut n, mut rounds) = (2_000_000u64, 5usize);
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let v: u64 = args.next().unwrap_or_default().parse().expect("a number");
        match flag.as_str() {
            "--pairs" => n = v,
            "--rounds" => rounds = v as usize,
            _ => panic!("unknown flag {flag} (--pairs, --rounds)"),
        }
    }
    let sim = SimBackend::new(SimConfig {
        capacity: 64 << 30,
        ..SimConfig::default()
    })
    .unwrap();
    let config = PoolConfig {
        validate: false,
        ..PoolConfig::default()
    };
    let pool = Pool::new(Arc::new(sim), config).unwrap();
    pairs(&pool, n / 4); // warm-up: arenas created, caches filled
    let (mut off, mut on, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for r in 0..rounds {
        pool.record_history(false, 0);
        let a = pairs(&pool, n);
        // A ring smaller than the run: the steady state overwrites the oldest events.
        pool.record_history(true, 100_000);
        let b = pairs(&pool, n);
        pool.record_history(false, 0);
        println!(
            "round {r}: off {a:.1} ns/pair, on {b:.1} ns/pair, on/off {:.3}",
            b / a
        );
        off.push(a);
        on.push(b);
        ratios.push(b / a);
    }
    println!(
        "median: off {:.1} ns/pair, on {:.1} ns/pair, ratio on/off {:.3} ({rounds} rounds of {n} pairs)",
        median(off),
        median(on),
        median(ratios)
    );
}
