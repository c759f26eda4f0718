//! KV-cache allocation benchmarks for gpu-arena.
//!
//! - [`trace`]: a seeded, deterministic, vLLM-like KV-cache allocation trace.
//! - [`replay`](mod@replay): replaying a trace through any [`replay::TraceAllocator`], and the two
//!   baselines a user would otherwise write over a [`gpu_arena::Backend`]: one arena per
//!   allocation ([`replay::PerAllocationBackend`]) and one big first-fit arena
//!   ([`replay::FirstFitArena`]).
//! - [`pool_adapter`]: the real [`gpu_arena::Pool`] as a [`replay::TraceAllocator`].
//! - [`suite`]: the whole comparison (and the arena-size sweep) as the criterion bench
//!   `kv_cache` and the `kv_replay` binary run it; [`report`] renders it as markdown.
//! - [`units`]: sizes and times as text, for all of the above.
//! - [`threads`]: the thread-scaling workloads (2 MiB pairs, mixed sizes).
//! - [`torch_trace`]: allocation traces recorded from PyTorch programs, read as a [`Trace`].
//!
//! Imports go one way, each module importing only modules listed before it: `units`,
//! `trace`, `trace_file`, `replay`, `pool_adapter`, `report`, `suite`.

pub mod expandable_model;
pub mod pool_adapter;
pub mod replay;
pub mod report;
pub mod suite;
pub mod threads;
pub mod torch_trace;
pub mod trace;
pub mod trace_file;
pub mod units;

pub use expandable_model::ExpandableModel;
pub use pool_adapter::PoolAllocator;
pub use replay::{replay, FirstFitArena, PerAllocationBackend, ReplayResult, TraceAllocator};
pub use suite::{run_suite, SuiteConfig, SuiteReport};
pub use trace::{generate, Op, Trace, TraceConfig};
