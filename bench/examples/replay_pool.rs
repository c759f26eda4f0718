//! The KV trace straight through a [`Pool`] on the sim backend, replayed several times on
//! one pool, no sampling: the quick loop used to compare allocator changes (run two builds
//! interleaved and compare ratios; this 2-core machine's absolute times drift).
//!
//! ```text
//! cargo run --release -p gpu-arena-bench --example replay_pool -- \
//!     [--replays 3] [--arena-mib 1024] [--seed N] [--pairs 1000000] [--long 1] [--grow 1]
//!     [--capacity-gib 256]
//! (`--long 1`: the second trace, `TraceConfig::long_context`; `--grow 1`: growing arenas, each
//! reserving the sim device's capacity: under valgrind give a smaller one, e.g. 32.)
//! ```
//!
//! Prints the 2 MiB alloc+free pair time, then per replay ns/op, peak reserved and arenas.
//! Instructions per op: callgrind with `--toggle-collect='*replay_ops*'` (divide by the
//! replays times the trace's ops).
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Instant;

use gpu_arena::backend::sim::{SimBackend, SimCall, SimConfig};
use gpu_arena::{Pool, PoolConfig, StreamId};
use gpu_arena_bench::trace::{generate, Op, TraceConfig};

fn main() {
    let (mut replays, mut arena_mib, mut pairs) = (3usize, 1024u64, 1_000_000u64);
    let mut seed = None;
    let mut long = false;
    let mut grow = false;
    let mut capacity_gib = 256u64;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().unwrap_or_default();
        let n: u64 = value
            .parse()
            .unwrap_or_else(|_| panic!("{flag} needs a number"));
        match flag.as_str() {
            "--replays" => replays = n as usize,
            "--arena-mib" => arena_mib = n,
            "--seed" => seed = Some(n),
            "--long" => long = n != 0,
            "--grow" => grow = n != 0,
            "--capacity-gib" => capacity_gib = n,
            "--pairs" => pairs = n,
            other => panic!("unknown flag {other}"),
        }
    }
    let base = if long {
        TraceConfig::long_context()
    } else {
        TraceConfig::default()
    };
    let trace = generate(&TraceConfig {
        seed: seed.unwrap_or(base.seed),
        ..base
    });
    let backend = SimBackend::new(SimConfig {
        capacity: capacity_gib << 30,
        ..SimConfig::default()
    })
    .unwrap();
    let config = PoolConfig {
        validate: false,
        arena_size: arena_mib << 20,
        grow_arenas: grow,
        ..PoolConfig::default()
    };
    let backend = Arc::new(backend);
    let pool = Pool::new(Arc::clone(&backend) as Arc<_>, config).unwrap();
    // Driver calls per replay: on a GPU an event record or query costs about a
    // microsecond, which instruction counts on sim do not show.
    let driver_calls = || {
        [
            SimCall::RecordEvent,
            SimCall::EventQuery,
            SimCall::CreateArena,
            SimCall::Synchronize,
        ]
        .map(|c| backend.calls(c))
    };
    let t = Instant::now();
    for _ in 0..pairs {
        let a = pool.alloc(0, 2 << 20, StreamId(1)).unwrap();
        pool.free(a.ptr).unwrap();
    }
    if pairs > 0 {
        let ns = t.elapsed().as_nanos() as f64 / pairs as f64;
        println!("2 MiB alloc+free pair: {ns:.1} ns");
    }
    let mut ptrs = vec![0u64; trace.allocs as usize];
    for r in 0..replays {
        let calls_before = driver_calls();
        let t = Instant::now();
        replay_ops(&pool, &trace.ops, &mut ptrs);
        let ns = t.elapsed().as_nanos() as f64 / trace.ops.len() as f64;
        let s = pool.stats(0).unwrap();
        let after = driver_calls();
        let [records, queries, creates, syncs]: [u64; 4] =
            std::array::from_fn(|i| after[i] - calls_before[i]);
        println!(
            "replay {r}: {ns:.1} ns/op, peak reserved {} MiB, arenas {}, driver calls: \
             {records} event records, {queries} event queries, {creates} arenas created, \
             {syncs} synchronizes",
            s.peak_reserved_bytes >> 20,
            s.arenas
        );
    }
}

/// One replay of `ops` (its own function, for callgrind:
/// `valgrind --tool=callgrind --collect-atstart=no --toggle-collect='*replay_ops*' ...`).
#[inline(never)]
fn replay_ops(pool: &Pool, ops: &[Op], ptrs: &mut [u64]) {
    for op in ops {
        match *op {
            Op::Alloc { id, bytes, stream } => {
                ptrs[id as usize] = pool.alloc(0, bytes, StreamId(stream)).unwrap().ptr;
            }
            Op::Free { id } => pool.free(ptrs[id as usize]).unwrap(),
        }
    }
}
