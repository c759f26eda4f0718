//! The whole KV-cache comparison, shared by the criterion bench and the `kv_replay` binary:
//! replay one trace through the pool (cold, then warm), the two baselines, and a sweep of
//! arena sizes; render the summary as markdown.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpu_arena::{Backend, DeviceId, PoolConfig};

use crate::pool_adapter::PoolAllocator;
use crate::replay::{replay, FirstFitArena, PerAllocationBackend, ReplayResult, TraceAllocator};
use crate::report::{replay_table, sweep_table, SweepRow};
use crate::trace::{generate, Trace, TraceConfig};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// The arena sizes the sweep tries by default: 64 MiB, 256 MiB, 1 GiB, 2 GiB.
pub const DEFAULT_SWEEP: [u64; 4] = [64 * MIB, 256 * MIB, GIB, 2 * GIB];

/// What to run.
#[derive(Debug, Clone, PartialEq)]
pub struct SuiteConfig {
    /// The trace.
    pub trace: TraceConfig,
    /// The pool's arena size for the main table (default: [`PoolConfig`]'s default).
    pub arena_size: u64,
    /// Size of the first-fit baseline's arena; `None` searches: the smallest of peak live x
    /// 1.00, 1.01, 1.02, ... that the trace fits in (first fit fragments, so peak live alone
    /// may not be enough). That is the best a user who knew the trace could do.
    pub first_fit_bytes: Option<u64>,
    /// Run the per-allocation baseline (one backend arena per allocation).
    pub per_allocation: bool,
    /// Arena sizes for the sweep (empty: no sweep).
    pub sweep: Vec<u64>,
    /// Device to allocate on.
    pub device: DeviceId,
    /// Print progress to stderr.
    pub verbose: bool,
    /// The pools grow their arenas (`PoolConfig::grow_arenas`).
    pub grow_arenas: bool,
}

impl Default for SuiteConfig {
    fn default() -> Self {
        Self {
            trace: TraceConfig::default(),
            arena_size: PoolConfig::default().arena_size,
            first_fit_bytes: None,
            per_allocation: true,
            sweep: DEFAULT_SWEEP.to_vec(),
            device: 0,
            verbose: false,
            grow_arenas: false,
        }
    }
}

/// What the suite measured.
#[derive(Debug, Clone, PartialEq)]
pub struct SuiteReport {
    /// Backend name.
    pub backend: String,
    /// The trace's config.
    pub trace_config: TraceConfig,
    /// [`Trace::describe`] of the trace.
    pub trace_description: String,
    /// Time to generate the trace.
    pub generate_time: Duration,
    /// One result per allocator: pool cold, pool warm, first-fit, per-allocation.
    pub results: Vec<ReplayResult>,
    /// Index in `results` of the reference (the pool, cold) for the ns/op ratio.
    pub reference: usize,
    /// The arena-size sweep.
    pub sweep: Vec<SweepRow>,
}

impl SuiteReport {
    /// The summary as markdown: the main table, then the sweep.
    pub fn markdown(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "# gpu-arena KV-cache trace replay\n");
        let _ = writeln!(
            s,
            "backend `{}`; trace seed {:#x}, {} requests, max_running {}: {} (generated in {:.2?}).\n",
            self.backend,
            self.trace_config.seed,
            self.trace_config.requests,
            self.trace_config.max_running,
            self.trace_description,
            self.generate_time
        );
        s.push_str(&replay_table(&self.results, self.reference));
        s.push_str(
            "\nOne replay each, cold unless marked warm (warm = the same pool replaying the trace \
             a second time). ns/op is the wall time of the whole op loop (reserved bytes sampled \
             after every op included) over allocs + frees. The first-fit arena is created before \
             the clock starts. ns/op ÷ pool divides by the cold pool's ns/op.\n",
        );
        if !self.sweep.is_empty() {
            s.push_str("\n## Arena size (cold pool, same trace)\n\n");
            s.push_str(&sweep_table(&self.sweep));
        }
        s
    }
}

fn log(cfg: &SuiteConfig, msg: impl AsRef<str>) {
    if cfg.verbose {
        eprintln!("[kv-bench] {}", msg.as_ref());
    }
}

fn pool_config(arena_size: u64, grow_arenas: bool) -> PoolConfig {
    PoolConfig {
        arena_size,
        grow_arenas,
        // Per-op validation would measure validate(), not the pool.
        validate: false,
        ..PoolConfig::default()
    }
}

fn replay_logged(
    cfg: &SuiteConfig,
    trace: &Trace,
    a: &mut dyn TraceAllocator,
) -> Result<ReplayResult, String> {
    let r = replay(trace, a)?;
    log(
        cfg,
        format!(
            "{}: {:.0} ns/op, reserved/live {:.3}",
            r.allocator, r.ns_per_op, r.ratio_reserved_to_live
        ),
    );
    Ok(r)
}

/// Replay the trace through the first-fit baseline, searching for an arena size that fits
/// when `cfg.first_fit_bytes` is `None`.
fn first_fit(
    backend: &Arc<dyn Backend>,
    cfg: &SuiteConfig,
    trace: &Trace,
) -> Result<ReplayResult, String> {
    if let Some(bytes) = cfg.first_fit_bytes {
        let mut a = FirstFitArena::new(backend.clone(), cfg.device, bytes)?;
        return replay_logged(cfg, trace, &mut a);
    }
    // Failing tries stop at the first op that does not fit, so they are cheap.
    let mut last_err = String::new();
    for tries in 1..=100u32 {
        let factor = 1.0 + 0.01 * f64::from(tries - 1);
        let bytes = (trace.peak_live_bytes as f64 * factor) as u64;
        let mut a = FirstFitArena::new(backend.clone(), cfg.device, bytes)?;
        match replay(trace, &mut a) {
            Ok(mut r) => {
                log(
                    cfg,
                    format!(
                        "{}: {:.0} ns/op, reserved/live {:.3} (after {tries} sizes)",
                        r.allocator, r.ns_per_op, r.ratio_reserved_to_live
                    ),
                );
                r.notes.push((
                    "sized to fit".to_string(),
                    format!("smallest 1% step over peak live, try {tries}"),
                ));
                return Ok(r);
            }
            Err(e) => last_err = e,
        }
    }
    Err(format!("first-fit never fit the trace: {last_err}"))
}

/// Generate the trace and run everything on `backend`.
pub fn run_suite(backend: Arc<dyn Backend>, cfg: &SuiteConfig) -> Result<SuiteReport, String> {
    let t0 = Instant::now();
    let trace = generate(&cfg.trace);
    let generate_time = t0.elapsed();
    log(
        cfg,
        format!("trace: {} in {generate_time:.2?}", trace.describe()),
    );

    let mut results = Vec::new();
    {
        let mut pool = PoolAllocator::new(
            backend.clone(),
            pool_config(cfg.arena_size, cfg.grow_arenas),
            cfg.device,
        )?;
        results.push(replay_logged(cfg, &trace, &mut pool)?);
        let mut warm = replay_logged(cfg, &trace, &mut pool)?;
        warm.allocator.push_str(", warm");
        results.push(warm);
    }
    results.push(first_fit(&backend, cfg, &trace)?);
    if cfg.per_allocation {
        let mut a = PerAllocationBackend::new(backend.clone(), cfg.device)?;
        results.push(replay_logged(cfg, &trace, &mut a)?);
    }

    let mut sweep = Vec::new();
    for &size in &cfg.sweep {
        let mut pool = PoolAllocator::new(
            backend.clone(),
            pool_config(size, cfg.grow_arenas),
            cfg.device,
        )?;
        let result = replay_logged(cfg, &trace, &mut pool)?;
        sweep.push(SweepRow {
            arena_size: size,
            result,
            peak_arenas: pool.peak_arenas(),
            arenas_created: pool.stats().backend_creates,
        });
    }

    Ok(SuiteReport {
        backend: backend.name().to_string(),
        trace_config: cfg.trace.clone(),
        trace_description: trace.describe(),
        generate_time,
        results,
        reference: 0,
        sweep,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::replay::tests::FakeBackend;

    #[test]
    fn small_suite_renders_both_tables() {
        let cfg = SuiteConfig {
            trace: TraceConfig {
                requests: 40,
                max_running: 8,
                ..TraceConfig::default()
            },
            sweep: vec![64 * MIB, 256 * MIB],
            ..SuiteConfig::default()
        };
        let rep = run_suite(Arc::new(FakeBackend::default()), &cfg).unwrap();
        assert_eq!(rep.results.len(), 4);
        assert_eq!(rep.sweep.len(), 2);
        let md = rep.markdown();
        assert!(md.contains("| allocator |"), "{md}");
        assert!(md.contains("| 64 MiB |"), "{md}");
        assert!(md.contains("per-allocation"), "{md}");
        assert!(md.contains(", warm"), "{md}");
    }

    #[test]
    fn small_suite_on_the_sim_backend_leaves_it_clean() {
        use gpu_arena::backend::sim::{SimBackend, SimConfig};
        let sim = Arc::new(
            SimBackend::new(SimConfig {
                capacity: 64 * GIB,
                ..SimConfig::default()
            })
            .unwrap(),
        );
        let cfg = SuiteConfig {
            trace: TraceConfig {
                requests: 30,
                max_running: 8,
                ..TraceConfig::default()
            },
            sweep: vec![256 * MIB],
            ..SuiteConfig::default()
        };
        let rep = run_suite(sim.clone(), &cfg).unwrap();
        for r in &rep.results {
            assert!(r.ratio_reserved_to_live >= 1.0, "{r:?}");
        }
        // Every allocator was dropped: the sim holds nothing.
        assert!(sim.is_clean(0), "{:?}", sim.ledger(0));
    }
}
