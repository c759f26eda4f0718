//! Replay allocation traces recorded from PyTorch programs (`bench/gpu/torch_reserved.py
//! --trace-dir`) through the pool on the sim backend and print peak reserved against peak
//! live bytes: how much a training or generation loop would reserve, without a GPU; beside
//! it what PyTorch with expandable segments reserves on the same sequence
//! ([`gpu_arena_bench::ExpandableModel`]).
//!
//! ```text
//! torch_trace_replay [--config KEY=VALUE,...] [--busy] FILE...
//! ```
//!
//! A `FILE` ending in `.gz` is read through `gzip -dc`; `kv:default` and `kv:long` name the
//! generated KV-cache traces. `--busy` keeps every event recorded
//! on the trace's streams pending (a GPU that is behind the host: what settling leaves). `--config` takes gpu-arena's
//! configuration string (`arena_size=256M`, ...). Exit status 1 when a trace cannot be read
//! or replayed.
#![allow(clippy::unwrap_used)]

use gpu_arena_bench::pool_adapter::replay_sim;
use gpu_arena_bench::torch_trace::read_file;
use gpu_arena_bench::{replay, ExpandableModel, PoolAllocator};
use std::process::ExitCode;

const MIB: f64 = (1u64 << 20) as f64;

fn replay_one(path: &str, config: &str, busy: bool) -> Result<String, String> {
    let trace = read_file(path)?;
    let sim = replay_sim()?;
    if busy {
        // Events recorded on the trace's streams stay pending, as on a GPU that is behind.
        for op in &trace.ops {
            if let gpu_arena_bench::Op::Alloc { stream, .. } = op {
                sim.block_stream(0, gpu_arena::StreamId(*stream));
            }
        }
    }
    let mut pool = PoolAllocator::from_config(sim, config)?;
    let r = replay(&trace, &mut pool).map_err(|e| format!("{path}: {e}"))?;
    let model = replay(&trace, &mut ExpandableModel::new()).map_err(|e| format!("{path}: {e}"))?;
    let name = std::path::Path::new(path)
        .file_name()
        .map_or(path.to_owned(), |n| n.to_string_lossy().into_owned());
    Ok(format!(
        "| {name} | {} | {:.0} | {:.0} | {:.3} | {} | {:.0} ({:.3}) | {:+.0} |",
        trace.ops.len(),
        r.peak_reserved as f64 / MIB,
        r.peak_live as f64 / MIB,
        r.ratio_reserved_to_live,
        pool.peak_arenas(),
        model.peak_reserved as f64 / MIB,
        model.ratio_reserved_to_live,
        (r.peak_reserved as f64 - model.peak_reserved as f64) / MIB,
    ))
}

fn main() -> ExitCode {
    let mut config = String::new();
    let mut busy = false;
    let mut files = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--config" => config = args.next().unwrap_or_default(),
            "--busy" => busy = true,
            "-h" | "--help" => {
                println!("usage: torch_trace_replay [--config KEY=VALUE,...] [--busy] FILE...");
                return ExitCode::SUCCESS;
            }
            _ => files.push(a),
        }
    }
    if files.is_empty() {
        eprintln!("usage: torch_trace_replay [--config KEY=VALUE,...] [--busy] FILE...");
        return ExitCode::FAILURE;
    }
    println!("config: {config:?}\n");
    println!("| trace | ops | peak reserved MiB | peak live MiB | reserved/live | peak arenas | expandable segments (model) MiB | difference MiB |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    let mut failed = false;
    for f in &files {
        match replay_one(f, &config, busy) {
            Ok(row) => println!("{row}"),
            Err(e) => {
                eprintln!("{e}");
                failed = true;
            }
        }
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
