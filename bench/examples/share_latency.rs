//! Latency of sharing on the sim backend (issue #14): share of a sub-range of an exported
//! arena, import of a share whose arena this consumer already maps, close, unshare, and the
//! batch forms `Importer::import_many` / `close_many` (per share); the
//! broker and the importer run in this process (the broker on its own thread, as in a
//! producer), over the real Unix socket. Handles go through their 128 bytes both ways, as
//! through the C API.
//!
//! ```text
//! cargo run --release -p gpu-arena-bench --example share_latency -- [--blocks 1024] [--rounds 5]
//! ```
//!
//! Prints the median over rounds of the mean ns per operation. This 2-core machine's
//! absolute times drift: compare ratios between builds, run back to back.
//!
//! Measured on the 2-core dev VM (release, 1024 blocks, 5 rounds, quiet machine, before =
//! 409ebb5, interleaved 3 times): share 838-889 -> 551-601 ns; import of a mapped arena
//! 25.6-26.1 -> 10.2-11.2 us (25.0-25.9 with GPU_ARENA_IPC_SPIN_US=0: the gain is the
//! polling); close 22.4-25.0 -> 5.6-6.6 us; unshare unchanged (~0.3 us); import_many
//! 0.83-0.98 us and close_many 0.71-0.73 us per share. `perf`: the CPU time of an import or
//! a close is a few hundred ns; the rest of the wall time was the sleeps and wake-ups of
//! the two threads (`finish_task_switch`, `__skb_wait_for_more_packets`).
//!
//! With the connection mailbox (requests needing no fd in shared memory; compare with
//! `GPU_ARENA_IPC_MAILBOX=0`, same binary, interleaved on the shared 2-core VM): import of a
//! mapped arena 10.3-11.0 -> 3.0-3.3 us and close 5.6-7.1 -> 1.8-2.2 us while each thread
//! had a core; with CPU-bound neighbours taking the cores, import 10.6-11.0 -> 7.9-8.2 us and
//! close unchanged; batches and share/unshare unchanged
//! (bench/results/sim-2026-11-30-mailbox.md).
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Instant;

use gpu_arena::backend::sim::{SimBackend, SimConfig};
use gpu_arena::backend::Backend;
use gpu_arena::ipc::{Broker, BrokerConfig, Importer, ShareHandle};
use gpu_arena::{Pool, PoolConfig, StreamId};

const BLOCK: u64 = 2 << 20;

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map_or(default, |v| v.parse().unwrap())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let blocks = arg("--blocks", 1024);
    let rounds = arg("--rounds", 5);
    let sim = Arc::new(
        SimBackend::new(SimConfig {
            capacity: 64 << 30,
            ..SimConfig::default()
        })
        .unwrap(),
    );
    let pool = Arc::new(
        Pool::new(
            sim.clone(),
            PoolConfig {
                arena_size: (blocks as u64 + 1) * BLOCK,
                ..PoolConfig::default()
            },
        )
        .unwrap(),
    );
    let broker = Broker::start(pool.clone(), BrokerConfig::default()).unwrap();
    let importer = Importer::new(sim.clone() as Arc<dyn Backend>);
    let ptrs: Vec<u64> = (0..=blocks)
        .map(|_| pool.alloc(0, BLOCK, StreamId(0)).unwrap().ptr)
        .collect();
    // The anchor: exports the arena and keeps it mapped on the consumer side.
    let anchor = broker.share(ptrs[blocks], BLOCK).unwrap();
    let anchor_ptr = importer.import(&anchor).unwrap();
    let ptrs = &ptrs[..blocks];

    let names = [
        "share",
        "import",
        "close",
        "unshare",
        "import_many",
        "close_many",
    ];
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); names.len()];
    for _ in 0..rounds {
        let n = blocks as f64;
        let t = Instant::now();
        let handles: Vec<[u8; 128]> = ptrs
            .iter()
            .map(|&p| broker.share(p, BLOCK).unwrap().to_bytes())
            .collect();
        times[0].push(t.elapsed().as_nanos() as f64 / n);

        let t = Instant::now();
        let imported: Vec<u64> = handles
            .iter()
            .map(|b| {
                importer
                    .import(&ShareHandle::from_bytes(b).unwrap())
                    .unwrap()
            })
            .collect();
        times[1].push(t.elapsed().as_nanos() as f64 / n);

        let t = Instant::now();
        for &p in &imported {
            importer.close(p).unwrap();
        }
        times[2].push(t.elapsed().as_nanos() as f64 / n);

        let t = Instant::now();
        let decoded: Vec<ShareHandle> = handles
            .iter()
            .map(|b| ShareHandle::from_bytes(b).unwrap())
            .collect();
        let imported = importer.import_many(&decoded).unwrap();
        times[4].push(t.elapsed().as_nanos() as f64 / n);

        let t = Instant::now();
        importer.close_many(&imported).unwrap();
        times[5].push(t.elapsed().as_nanos() as f64 / n);

        let t = Instant::now();
        for b in &handles {
            broker
                .unshare(&ShareHandle::from_bytes(b).unwrap())
                .unwrap();
        }
        times[3].push(t.elapsed().as_nanos() as f64 / n);
    }
    importer.close(anchor_ptr).unwrap();
    broker.unshare(&anchor).unwrap();
    println!("{blocks} blocks of 2 MiB, {rounds} rounds (median of round means, ns/op)");
    for (name, t) in names.iter().zip(times) {
        println!("{name:>8}: {:>9.0} ns", median(t));
    }
}
