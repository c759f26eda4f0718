//! The main demo: a vLLM-like KV-cache workload through gpu-arena, then sharing and teardown.
//!
//! `cargo run --release --example kv_cache_demo` — runs on the default backend (`auto`:
//! CUDA where a GPU is present, else the simulated device), needs no GPU.
//!
//! 1. Replays a seeded KV trace (2 MiB blocks as sequences grow, temporaries per step)
//!    through the pool: ns per operation, peak reserved / peak live. It is the README
//!    headline's setup (`TraceConfig::default()`: 2240 requests, a 16 GiB KV budget, the
//!    default growing arenas: 1.039 on sim and on the H200; `GPU_ARENA_CONF=grow_arenas=0`
//!    for fixed 1 GiB arenas: 1.056) whenever the device has room for it; the sim device
//!    gets 64 GiB of capacity for it (a ledger: only memory that is written uses RAM) unless
//!    `GPU_ARENA_CONF` sets `sim_capacity`. On a smaller device the budget shrinks to half
//!    its free memory and the demo says so.
//! 2. Shares every live KV block (as a prefill/decode split would): one driver export per
//!    arena, not per block.
//! 3. Tears down: unshare, free, `empty_cache`; the device's free memory returns to the
//!    baseline taken before the first allocation.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use gpu_arena::ipc::{Broker, BrokerConfig};
use gpu_arena::{Config, StreamId};
use gpu_arena_bench::{generate, Op, TraceConfig};

fn gib(b: u64) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

fn main() {
    if let Err(e) = run() {
        eprintln!("kv_cache_demo: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let mut config = Config::from_env()?;
    let conf = std::env::var("GPU_ARENA_CONF").unwrap_or_default();
    if !conf.contains("sim_capacity") {
        config.sim.capacity = 64 << 30;
    }
    let backend = config.open_backend()?;
    let device = 0;
    let baseline = backend.mem_info(device)?;
    let pool = Arc::new(gpu_arena::Pool::new(backend.clone(), config.pool.clone())?);
    println!(
        "gpu-arena demo on backend `{}`: device {device} has {:.2} GiB free of {:.2} GiB",
        backend.name(),
        gib(baseline.free),
        gib(baseline.total)
    );

    // 1. The KV trace: the headline's (16 GiB KV budget) when the device has room for it
    // and its temporaries, else half the free memory.
    let mut tc = TraceConfig::default();
    let headline = baseline.free >= tc.kv_budget_bytes + (4 << 30);
    if !headline {
        tc.kv_budget_bytes = baseline.free / 2;
    }
    let trace = generate(&tc);
    let config = pool.config();
    let arenas = if config.grow_arenas {
        "growing arenas".to_string()
    } else {
        format!("fixed arenas of {:.2} GiB", gib(config.arena_size))
    };
    println!(
        "KV trace: seed {:#x}, {} requests, KV budget {:.2} GiB, {arenas}{}",
        tc.seed,
        tc.requests,
        gib(tc.kv_budget_bytes),
        if headline && config.grow_arenas {
            " (the README headline's setup)"
        } else {
            ""
        }
    );
    let mut live: HashMap<u32, u64> = HashMap::new();
    let t = Instant::now();
    for op in &trace.ops {
        match *op {
            Op::Alloc { id, bytes, stream } => {
                let a = pool.alloc(device, bytes, StreamId(stream))?;
                live.insert(id, a.ptr);
            }
            Op::Free { id } => {
                if let Some(ptr) = live.remove(&id) {
                    pool.free(ptr)?;
                }
            }
        }
    }
    let ns = t.elapsed().as_nanos() as f64 / trace.ops.len() as f64;
    let s = pool.stats(device)?;
    println!("\n| what | value |\n|---|---|");
    println!("| trace operations | {} |", trace.ops.len());
    println!("| ns per operation | {ns:.0} |");
    println!("| peak live | {:.2} GiB |", gib(trace.peak_live_bytes));
    println!("| peak reserved | {:.2} GiB |", gib(s.peak_reserved_bytes));
    println!(
        "| peak reserved / peak live | {:.3} |",
        s.peak_reserved_bytes as f64 / trace.peak_live_bytes as f64
    );
    println!("| arenas created | {} |", s.backend_creates);
    // With fixed arenas reserved is a whole number of them: the least it can be for this peak.
    let note = (!headline || !config.grow_arenas).then(|| {
        let arena = config.arena_size;
        let floor = trace.peak_live_bytes.div_ceil(arena) * arena;
        let mut note =
            String::from("\nNot the README's setup (16 GiB KV budget, growing arenas: 1.039)");
        if !config.grow_arenas {
            note += &format!(
                ": reserved is a whole number of {:.2} GiB arenas, so this {:.2} GiB peak \
                 cannot read below {:.3}",
                gib(arena),
                gib(trace.peak_live_bytes),
                floor as f64 / trace.peak_live_bytes as f64
            );
        }
        note + "."
    });

    // 2. Share what is still live, block by block.
    let keep: Vec<_> = (0..2000)
        .map(|_| pool.alloc(device, 2 << 20, StreamId(1)))
        .collect::<Result<_, _>>()?;
    let broker = Broker::start(pool.clone(), BrokerConfig::default())?;
    let handles: Vec<_> = keep
        .iter()
        .map(|a| broker.share(a.ptr, a.bytes))
        .collect::<Result<_, _>>()?;
    let s = pool.stats(device)?;
    println!("| KV blocks shared | {} |", handles.len());
    println!(
        "| driver exports for them | {} (arenas: {}) |",
        s.exports_total, s.arenas
    );

    // 3. Teardown.
    for h in &handles {
        broker.unshare(h)?;
    }
    for a in keep {
        pool.free(a.ptr)?;
    }
    for ptr in live.into_values() {
        pool.free(ptr)?;
    }
    pool.empty_cache(None)?;
    let after = backend.mem_info(device)?;
    let s = pool.stats(device)?;
    println!("| arenas after empty_cache | {} |", s.arenas);
    println!(
        "| free memory vs baseline | {:+.1} MiB |",
        (after.free as f64 - baseline.free as f64) / (1u64 << 20) as f64
    );
    if let Some(note) = note {
        println!("{note}");
    }
    pool.validate(device)?;
    Ok(())
}
