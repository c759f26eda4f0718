//! Write the KV-cache trace (the one `kv_replay` replays) to a binary file for
//! `bench/gpu/kv_bench.cpp`; the format is in `gpu_arena_bench::trace_file`.
//!
//! ```text
//! kv_trace_dump [--profile default|long] [--seed N] [--requests N] [--out PATH]
//! ```
//! (default out: target/kv_trace.bin; `long` is `TraceConfig::long_context`, the second
//! trace: longer prompts, wider batches, mixed activation sizes).
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use gpu_arena_bench::trace::{generate, TraceConfig};
use gpu_arena_bench::trace_file::{read_file, write_file};
use gpu_arena_bench::units::fmt_bytes;

const USAGE: &str =
    "usage: kv_trace_dump [--profile default|long] [--seed N] [--requests N] [--out PATH]";

fn run() -> Result<(), String> {
    let mut cfg = TraceConfig::default();
    let mut out = PathBuf::from("target/kv_trace.bin");
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = |flag: &str| {
            args.next()
                .ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))
        };
        match arg.as_str() {
            "--profile" => {
                let seed_or_requests_given = cfg != TraceConfig::default();
                if seed_or_requests_given {
                    return Err(format!("--profile must come first\n{USAGE}"));
                }
                cfg = match value("--profile")?.as_str() {
                    "default" => TraceConfig::default(),
                    "long" => TraceConfig::long_context(),
                    other => return Err(format!("--profile {other:?}: default or long\n{USAGE}")),
                }
            }
            "--seed" => {
                let v = value("--seed")?;
                cfg.seed = match v.strip_prefix("0x") {
                    Some(hex) => u64::from_str_radix(hex, 16),
                    None => v.parse(),
                }
                .map_err(|e| format!("--seed: {e}"))?
            }
            "--requests" => {
                cfg.requests = value("--requests")?
                    .parse()
                    .map_err(|e| format!("--requests: {e}"))?
            }
            "--out" => out = PathBuf::from(value("--out")?),
            "-h" | "--help" => {
                println!("{USAGE}");
                return Ok(());
            }
            other => return Err(format!("unknown argument {other:?}\n{USAGE}")),
        }
    }
    let t0 = Instant::now();
    let trace = generate(&cfg);
    let gen = t0.elapsed();
    write_file(&out, &trace, cfg.seed, u64::from(cfg.requests))?;
    // Read it back: what the GPU replays is checked here, where the trace was made.
    let f = read_file(&out)?;
    let bytes = std::fs::metadata(&out)
        .map_err(|e| format!("{}: {e}", out.display()))?
        .len();
    println!(
        "trace seed {:#x}, {} requests: {} (generated in {gen:.2?})",
        cfg.seed,
        cfg.requests,
        trace.describe()
    );
    println!(
        "wrote {} ({} ops, {} streams, peak live {}, {})",
        out.display(),
        f.header.op_count,
        f.header.streams,
        fmt_bytes(f.header.peak_live_bytes),
        fmt_bytes(bytes)
    );
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kv_trace_dump: {e}");
            ExitCode::FAILURE
        }
    }
}
