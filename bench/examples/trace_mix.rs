//! What the two KV traces allocate: KV blocks, temporaries by size (their block lengths),
//! those above `CACHE_MAX_BLOCK` (never cached whole), and the distinct (stream, length)
//! keys, to explain a trace's cache misses. And, of the blocks above `GROWING_CACHE_MAX`
//! (never cached in growing arenas), how many are allocated right after a free of the same
//! (stream, length) with no other such block between: what a one-block stash of the last
//! such free could serve without the device lock.
//!
//! ```text
//! cargo run --release -p gpu-arena-bench --example trace_mix
//! ```
#![allow(clippy::unwrap_used)]
use gpu_arena::pool::{block_len, CACHE_MAX_BLOCK, GROWING_CACHE_MAX};
use gpu_arena_bench::trace::{generate, Op, TraceConfig};
use std::collections::{HashMap, HashSet};
fn main() {
    for (name, cfg) in [
        ("repo", TraceConfig::default()),
        ("long", TraceConfig::long_context()),
    ] {
        let t = generate(&cfg);
        let (mut kv, mut temps, mut big, mut frees) = (0u64, 0u64, 0u64, 0u64);
        let mut keys = HashSet::new();
        let mut buckets = [0u64; 8];
        // Blocks above GROWING_CACHE_MAX: allocations, and those right after a free of the
        // same (stream, length).
        let (mut large, mut after_same_free) = (0u64, 0u64);
        let mut last_large_free = None;
        let mut key_of = HashMap::new();
        for op in &t.ops {
            match *op {
                Op::Alloc { id, bytes, stream } => {
                    let len = block_len(bytes).unwrap();
                    keys.insert((stream, len));
                    key_of.insert(id, (stream, len));
                    if len > GROWING_CACHE_MAX {
                        large += 1;
                        if last_large_free.take() == Some((stream, len)) {
                            after_same_free += 1;
                        }
                    }
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
                Op::Free { id } => {
                    frees += 1;
                    let key = key_of.remove(&id).unwrap();
                    if key.1 > GROWING_CACHE_MAX {
                        last_large_free = Some(key);
                    }
                }
            }
        }
        println!("{name}: ops {} kv {kv} temps {temps} >64MiB {big} frees {frees} keys {} steps {} temp buckets <=1M,<=8M,<=32M,<=64M,<=128M,>128M {:?}", t.ops.len(), keys.len(), t.steps, &buckets[..6]);
        println!("{name}: blocks above {} MiB: {large} allocations, {after_same_free} ({:.1}%) right after a free of the same stream and length", GROWING_CACHE_MAX >> 20, 100.0 * after_same_free as f64 / large as f64);
    }
}
