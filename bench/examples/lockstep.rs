//! gpu-arena and the model of PyTorch's expandable segments (`ExpandableModel`) replaying one
//! recorded trace in lockstep: every op that changes either's reserved bytes, until they
//! part, shows where one maps more than the other (how the small training loop's difference
//! was found: `bench/results/sim-2026-12-02-expandable-model.md`).
//!
//! ```text
//! cargo run --release -p gpu-arena-bench --example lockstep -- CONFIG FILE [MAX_LINES] [grows]
//! ```
//! e.g. `-- grow_arenas=1 bench/traces/small_train.trace.gz 60`; with `grows`, only the ops
//! where gpu-arena's reserved bytes rise (`-- grow_arenas=1 kv:long 200 grows`).
#![allow(clippy::unwrap_used)]

use gpu_arena_bench::pool_adapter::replay_sim;
use gpu_arena_bench::replay::TraceAllocator;
use gpu_arena_bench::torch_trace::read_file;
use gpu_arena_bench::{ExpandableModel, Op, PoolAllocator};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (Some(config), Some(path)) = (args.first(), args.get(1)) else {
        eprintln!("usage: lockstep CONFIG FILE [MAX_LINES]");
        std::process::exit(2);
    };
    let max_lines: usize = args.get(2).map_or(60, |n| n.parse().unwrap());
    let ours_growing_only = args.get(3).is_some_and(|a| a == "grows");
    let trace = read_file(path).unwrap();
    let mut pool = PoolAllocator::from_config(replay_sim().unwrap(), config).unwrap();
    let mut model = ExpandableModel::new();
    // id -> (gpu-arena's address, the model's, bytes, stream)
    let mut slots = vec![(0u64, 0u64, 0u64, 0u64); trace.allocs as usize];
    let (mut shown, mut live) = (0, 0u64);
    for (i, op) in trace.ops.iter().enumerate() {
        let before = (pool.reserved_bytes(), model.reserved_bytes());
        match *op {
            Op::Alloc { id, bytes, stream } => {
                let ours = pool.alloc(bytes, stream).unwrap();
                let theirs = model.alloc(bytes, stream).unwrap();
                slots[id as usize] = (ours, theirs, bytes, stream);
                live += bytes;
            }
            Op::Free { id } => {
                let (ours, theirs, bytes, stream) = std::mem::take(&mut slots[id as usize]);
                pool.free(ours, bytes, stream).unwrap();
                model.free(theirs, bytes, stream).unwrap();
                live -= bytes;
            }
        }
        let after = (pool.reserved_bytes(), model.reserved_bytes());
        let shown_op = if ours_growing_only {
            after.0 > before.0
        } else {
            after != before
        };
        if shown_op && shown < max_lines {
            shown += 1;
            println!(
                "op {i} {op:?}: gpu-arena {} -> {} MiB, model {} -> {} MiB, live {:.1} MiB",
                before.0 >> 20,
                after.0 >> 20,
                before.1 >> 20,
                after.1 >> 20,
                live as f64 / (1u64 << 20) as f64
            );
        }
    }
}
