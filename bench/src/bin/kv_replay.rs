//! Replay the KV-cache trace through the pool and the baselines and print the summary.
//!
//! ```text
//! kv_replay [--backend sim|cuda] [--seed N] [--requests N] [--arena-size BYTES]
//!           [--first-fit-size BYTES] [--no-per-allocation] [--no-sweep] [--grow] [--quiet]
//! ```
//!
//! Sizes accept a suffix: `64M`, `1G`, `2GiB`. The summary is printed and written to
//! `target/kv_cache_summary.md` (or `$KV_BENCH_SUMMARY`). On `cuda` the trace's streams 1
//! and 2 are the driver's `CU_STREAM_LEGACY` and `CU_STREAM_PER_THREAD` handles, and device 0
//! is used; the sim device has 256 GiB of (ledger) capacity, touched only where written.
#![allow(clippy::unwrap_used)]

use std::process::ExitCode;
use std::sync::Arc;

use gpu_arena::backend::sim::{SimBackend, SimConfig};
use gpu_arena::Backend;
use gpu_arena_bench::report::write_summary;
use gpu_arena_bench::suite::{run_suite, SuiteConfig};

const USAGE: &str = "usage: kv_replay [--backend sim|cuda] [--seed N] [--requests N] \
[--arena-size BYTES] [--first-fit-size BYTES] [--no-per-allocation] [--no-sweep] [--grow] [--quiet]";

/// Sim capacity: held bytes are a ledger, memory is only used where written.
const SIM_CAPACITY: u64 = 256 << 30;

fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num.parse().map_err(|_| format!("bad size {s:?}"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        _ => return Err(format!("bad size unit in {s:?}")),
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("size {s:?} overflows"))
}

fn backend(name: &str) -> Result<Arc<dyn Backend>, String> {
    match name {
        "sim" => SimBackend::new(SimConfig {
            capacity: SIM_CAPACITY,
            ..SimConfig::default()
        })
        .map(|b| Arc::new(b) as Arc<dyn Backend>)
        .map_err(|e| e.to_string()),
        "cuda" => cuda_backend(),
        other => Err(format!("unknown backend {other:?} (sim or cuda)")),
    }
}

/// The CUDA backend. The trace's streams 1 and 2 are `CU_STREAM_LEGACY` and
/// `CU_STREAM_PER_THREAD`, which the backend accepts as streams.
fn cuda_backend() -> Result<Arc<dyn Backend>, String> {
    gpu_arena::backend::cuda::CudaBackend::new()
        .map(|b| Arc::new(b) as Arc<dyn Backend>)
        .map_err(|e| e.to_string())
}

fn run() -> Result<(), String> {
    let mut cfg = SuiteConfig {
        verbose: true,
        ..SuiteConfig::default()
    };
    let mut backend_name = "sim".to_string();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = |flag: &str| {
            args.next()
                .ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))
        };
        match arg.as_str() {
            "--backend" => backend_name = value("--backend")?,
            "--seed" => {
                cfg.trace.seed = value("--seed")?
                    .parse()
                    .map_err(|e| format!("--seed: {e}"))?
            }
            "--requests" => {
                cfg.trace.requests = value("--requests")?
                    .parse()
                    .map_err(|e| format!("--requests: {e}"))?
            }
            "--arena-size" => cfg.arena_size = parse_bytes(&value("--arena-size")?)?,
            "--first-fit-size" => {
                cfg.first_fit_bytes = Some(parse_bytes(&value("--first-fit-size")?)?)
            }
            "--no-per-allocation" => cfg.per_allocation = false,
            "--no-sweep" => cfg.sweep.clear(),
            "--grow" => cfg.grow_arenas = true,
            "--quiet" => cfg.verbose = false,
            "-h" | "--help" => {
                println!("{USAGE}");
                return Ok(());
            }
            other => return Err(format!("unknown argument {other:?}\n{USAGE}")),
        }
    }
    let backend = backend(&backend_name)?;
    let report = run_suite(backend, &cfg)?;
    let md = report.markdown();
    println!("{md}");
    let path = write_summary(&md)?;
    eprintln!("[kv-bench] summary written to {}", path.display());
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kv_replay: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::parse_bytes;

    #[test]
    fn sizes() {
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert_eq!(parse_bytes("64M"), Ok(64 << 20));
        assert_eq!(parse_bytes("2GiB"), Ok(2 << 30));
        assert!(parse_bytes("1X").is_err());
        assert!(parse_bytes("").is_err());
    }
}
