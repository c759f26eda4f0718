//! KV-cache allocation benchmarks on the sim backend.
//!
//! 1. **Summary** (the main output): replay the full default trace (~400k ops) once through
//!    the pool (cold, then warm), the first-fit baseline and the per-allocation baseline,
//!    then through pools of 64 MiB, 256 MiB, 1 GiB and 2 GiB arenas; print the markdown
//!    tables and write them to `target/kv_cache_summary.md` (or `$KV_BENCH_SUMMARY`).
//!    `KV_BENCH_SKIP_SUMMARY=1` skips it; under `--test` a small trace is used.
//! 2. Criterion groups: `pair` (steady-state alloc+free of 2 MiB and 4 KiB on one stream,
//!    per allocator), `replay` (a shorter trace, cold allocator each iteration, only the
//!    replay loop timed), `pool_threads` (N = 1, 2, 4, 8 threads, each on its own stream,
//!    against one shared pool, doing 2 MiB alloc+free pairs or mixed-size pairs
//!    (`gpu_arena_bench::threads`); time is per pair per thread, throughput counts all
//!    threads' pairs: the aggregate). `cargo run --release -p gpu-arena-bench --example
//!    thread_scaling` prints the same workloads as a table with the ratio to one thread.
#![allow(clippy::unwrap_used, missing_docs)]

use std::hint::black_box;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput};
use gpu_arena::backend::sim::{SimBackend, SimConfig};
use gpu_arena::{Backend, Pool, PoolConfig, StreamId};
use gpu_arena_bench::replay::{replay, FirstFitArena, PerAllocationBackend, TraceAllocator};
use gpu_arena_bench::report::write_summary;
use gpu_arena_bench::suite::{run_suite, SuiteConfig};
use gpu_arena_bench::threads::{pair_2mib, Mixed};
use gpu_arena_bench::trace::{generate, TraceConfig};
use gpu_arena_bench::PoolAllocator;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

fn sim() -> Arc<dyn Backend> {
    Arc::new(
        SimBackend::new(SimConfig {
            capacity: 256 * GIB,
            ..SimConfig::default()
        })
        .unwrap(),
    )
}

fn pool_config() -> PoolConfig {
    PoolConfig {
        validate: false,
        ..PoolConfig::default()
    }
}

fn test_mode() -> bool {
    std::env::args().any(|a| a == "--test")
}

fn summary() {
    if std::env::var_os("KV_BENCH_SKIP_SUMMARY").is_some() {
        return;
    }
    let mut cfg = SuiteConfig {
        verbose: true,
        ..SuiteConfig::default()
    };
    if test_mode() {
        cfg.trace = TraceConfig {
            requests: 40,
            max_running: 8,
            ..TraceConfig::default()
        };
    }
    let report = run_suite(sim(), &cfg).unwrap();
    let md = report.markdown();
    println!("\n{md}");
    let path = write_summary(&md).unwrap();
    println!("summary written to {}\n", path.display());
}

/// Makes a fresh allocator on its own sim backend.
type MakeAllocator = Box<dyn Fn() -> Box<dyn TraceAllocator>>;

/// Allocators by name.
fn allocators() -> Vec<(&'static str, MakeAllocator)> {
    vec![
        (
            "pool",
            Box::new(|| {
                Box::new(PoolAllocator::new(sim(), pool_config(), 0).unwrap())
                    as Box<dyn TraceAllocator>
            }),
        ),
        (
            "first_fit",
            Box::new(|| Box::new(FirstFitArena::new(sim(), 0, 64 * GIB).unwrap()) as _),
        ),
        (
            "per_allocation",
            Box::new(|| Box::new(PerAllocationBackend::new(sim(), 0).unwrap()) as _),
        ),
    ]
}

fn bench_pairs(c: &mut Criterion) {
    let mut g = c.benchmark_group("pair");
    for (name, make) in allocators() {
        for (label, size) in [("2MiB", 2 * MIB), ("4KiB", 4 * KIB)] {
            let mut a = make();
            // A live neighbour keeps the arena in use, as in a running engine.
            let anchor = a.alloc(4 * KIB, 1).unwrap();
            g.throughput(Throughput::Elements(1));
            g.bench_function(BenchmarkId::new(name, label), |b| {
                b.iter(|| {
                    let p = a.alloc(black_box(size), 1).unwrap();
                    a.free(black_box(p), size, 1).unwrap();
                })
            });
            a.free(anchor, 4 * KIB, 1).unwrap();
        }
    }
    g.finish();
}

fn bench_replay(c: &mut Criterion) {
    let trace = generate(&TraceConfig {
        requests: if test_mode() { 20 } else { 200 },
        max_running: 64,
        ..TraceConfig::default()
    });
    let mut g = c.benchmark_group("replay");
    g.sample_size(10);
    g.throughput(Throughput::Elements(trace.ops.len() as u64));
    for (name, make) in allocators() {
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let mut a = make();
                    total += replay(&trace, a.as_mut()).unwrap().elapsed;
                }
                total
            })
        });
    }
    g.finish();
}

fn bench_threads(c: &mut Criterion) {
    let mut g = c.benchmark_group("pool_threads");
    for mixed in [false, true] {
        let name = if mixed {
            "alloc_free_mixed"
        } else {
            "alloc_free_2MiB"
        };
        for threads in [1u64, 2, 4, 8] {
            let pool = Pool::new(sim(), pool_config()).unwrap();
            g.throughput(Throughput::Elements(threads));
            g.bench_function(BenchmarkId::new(name, threads), |b| {
                b.iter_custom(|iters| {
                    let barrier = Barrier::new(threads as usize + 1);
                    std::thread::scope(|s| {
                        let workers: Vec<_> = (0..threads)
                            .map(|t| {
                                let (pool, barrier) = (&pool, &barrier);
                                s.spawn(move || {
                                    let stream = StreamId(t + 1);
                                    let mut work = Mixed::new(stream);
                                    barrier.wait();
                                    for _ in 0..iters {
                                        if mixed {
                                            work.pair(pool).unwrap();
                                        } else {
                                            pair_2mib(pool, stream).unwrap();
                                        }
                                    }
                                    work.finish(pool).unwrap();
                                })
                            })
                            .collect();
                        barrier.wait();
                        let start = Instant::now();
                        for w in workers {
                            w.join().unwrap();
                        }
                        start.elapsed()
                    })
                })
            });
        }
    }
    g.finish();
}

fn main() {
    summary();
    let mut c = Criterion::default().configure_from_args();
    bench_pairs(&mut c);
    bench_replay(&mut c);
    bench_threads(&mut c);
    c.final_summary();
}
