//! Where a trace's bytes lie at its peak: replay recorded PyTorch traces (`bench/traces/`)
//! through the pool on the sim backend and, at the highest reserved bytes, split the arenas
//! into small and large ones with their reserved, allocated (thread-cached blocks included:
//! they are allocated ranges) and requested bytes.
//!
//! ```text
//! cargo run --release -p gpu-arena-bench --example peak_breakdown -- CONFIG FILE...
//! ```
//! e.g. `-- grow_arenas=1 bench/traces/small_train.trace.gz` (CONFIG: gpu-arena's
//! configuration string, `""` for the defaults).
#![allow(clippy::unwrap_used)]

use gpu_arena::DeviceId;
use gpu_arena_bench::pool_adapter::replay_sim;
use gpu_arena_bench::replay::TraceAllocator;
use gpu_arena_bench::torch_trace::read_file;
use gpu_arena_bench::{Op, PoolAllocator};

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 20) as f64
}

/// Reserved, allocated and requested bytes and the arena count of the small or the large
/// arenas now.
fn split(pool: &PoolAllocator, small: bool) -> [u64; 4] {
    let mut out = [0u64; 4];
    for s in pool.pool().segments(DeviceId::default()).unwrap() {
        if s.small != small {
            continue;
        }
        let allocated = s.blocks.iter().filter(|b| b.allocated);
        out[0] += s.bytes;
        out[1] += allocated.clone().map(|b| b.bytes).sum::<u64>();
        out[2] += allocated.map(|b| b.requested).sum::<u64>();
        out[3] += 1;
    }
    out
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some((config, files)) = args.split_first() else {
        eprintln!("usage: peak_breakdown CONFIG FILE...");
        std::process::exit(2);
    };
    for path in files {
        let trace = read_file(path).unwrap();
        let mut pool = PoolAllocator::from_config(replay_sim().unwrap(), config).unwrap();
        let mut slots = vec![(0u64, 0u64, 0u64); trace.allocs as usize];
        let (mut peak, mut live, mut at_peak) = (0u64, 0u64, String::new());
        for op in &trace.ops {
            match *op {
                Op::Alloc { id, bytes, stream } => {
                    let ptr = pool.alloc(bytes, stream).unwrap();
                    slots[id as usize] = (ptr, bytes, stream);
                    live += bytes;
                }
                Op::Free { id } => {
                    let (ptr, bytes, stream) = std::mem::take(&mut slots[id as usize]);
                    live -= bytes;
                    pool.free(ptr, bytes, stream).unwrap();
                }
            }
            let reserved = pool.reserved_bytes();
            if reserved > peak {
                peak = reserved;
                let [sr, sa, sq, sn] = split(&pool, true);
                let [lr, la, lq, ln] = split(&pool, false);
                at_peak = format!(
                    "reserved {:.1} MiB, live {:.1} | small: {sn} arenas, {:.1} reserved, {:.1} \
                     allocated, {:.1} requested | large: {ln} arenas, {:.1} reserved, {:.1} \
                     allocated, {:.1} requested",
                    mib(reserved),
                    mib(live),
                    mib(sr),
                    mib(sa),
                    mib(sq),
                    mib(lr),
                    mib(la),
                    mib(lq)
                );
            }
        }
        println!("{path}: {at_peak}");
    }
}
