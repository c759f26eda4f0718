//! What the two KV traces allocate: KV blocks, temporaries by size (their block lengths),
//! those above `CACHE_MAX_BLOCK` (never cached whole), and the distinct (stream, length)
//! keys, to explain a trace's cache misses.
//!
//! ```text
//! cargo run --release -p gpu-arena-bench --example trace_mix
//! ```
#![allow(clippy::unwrap_used)]
use gpu_arena::pool::{block_len, CACHE_MAX_BLOCK};
use gpu_arena_bench::trace::{generate, Op, TraceConfig};
use std::collections::HashSet;
fn main() {
    for (name, cfg) in [
        ("repo", TraceConfig::default()),
        ("long", TraceConfig::long_context()),
    ] {
        let t = generate(&cfg);
        let (mut kv, mut temps, mut big, mut frees) = (0u64, 0u64, 0u64, 0u64);
        let mut keys = HashSet::new();
        let mut buckets = [0u64; 8];
        for op in &t.ops {
            match *op {
                Op::Alloc { bytes, stream, .. } => {
                    let len = block_len(bytes).unwrap();
                    keys.insert((stream, len));
                    if bytes == cfg.block_bytes {
                        kv += 1
                    } else {
                        temps += 1;
                        let b = match len {
                            l if l <= 1 << 20 => 0,
                            l if l <= 8 << 20 => 1,
                            l if l <= 32 << 20 => 2,
                            l if l <= 64 << 20 => 3,
                            l if l <= 128 << 20 => 4,
                            _ => 5,
                        };
                        buckets[b] += 1;
                    }
                    if len > CACHE_MAX_BLOCK {
                        big += 1
                    }
                }
                Op::Free { .. } => frees += 1,
            }
        }
        println!("{name}: ops {} kv {kv} temps {temps} >64MiB {big} frees {frees} keys {} steps {} temp buckets <=1M,<=8M,<=32M,<=64M,<=128M,>128M {:?}", t.ops.len(), keys.len(), t.steps, &buckets[..6]);
    }
}
