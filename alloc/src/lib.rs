//! A GPU memory pool for LLM serving engines whose memory, once shared with another
//! process, still comes back when everyone is done with it.
//!
//! gpu-arena carves arenas from the driver (VMM: `cuMemCreate` + map; by default each grows
//! chunk by chunk with the work under one reserved address range, `grow_arenas=0` for fixed
//! 1 GiB ones) and sub-allocates them, stream-ordered, with per-thread caches. It exports an
//! arena at most once, on its first share, hands out 128-byte share handles for sub-ranges
//! that any process can import, and frees the arena when the last share and the last
//! consumer are done (a consumer that dies drops its leases with its socket). The same pool
//! serves PyTorch (`libgpu_arena.so` and the `gpu_arena` Python package), C, and Rust through
//! this crate.
//!
//! # Main types
//!
//! - [`Config`]: the `key=value,...` configuration (the keys: [`config::KEY_TABLE`]) and the
//!   backend choice; [`Config::build_pool`] opens the backend and builds the pool.
//! - [`Pool`]: per-device pools. [`Pool::alloc`] / [`Pool::free`] (an [`Allocation`] on a
//!   [`StreamId`]), [`Pool::record_stream`], [`Pool::empty_cache`], [`Pool::stats`]
//!   ([`PoolStats`]), tags with sleep and wake, graph pools ([`GraphPoolId`]), arena
//!   observers ([`ArenaObserver`]).
//! - [`ipc`]: sharing across processes: the producer's [`ipc::Broker`], the consumer's
//!   [`ipc::Importer`], and the [`ipc::ShareHandle`] that travels between them.
//! - [`Backend`]: the driver seam. [`backend::sim`] (host memory with the drivers'
//!   semantics: tests, CI), `cuda` (feature `cuda`, libcuda loaded at run time) and `hip`
//!   (feature `hip`).
//! - [`range`] (the pure best-fit sub-allocator) and [`lifetime`] (the pure
//!   export/share/lease state machine): the two layers under the pool.
//!
//! # Example
//!
//! On the sim backend: allocate, share, import (here in the same process), give it all back.
//!
//! ```
//! use std::sync::Arc;
//! use gpu_arena::ipc::{Broker, BrokerConfig, Importer, ShareHandle};
//! use gpu_arena::{Config, StreamId};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let pool = Arc::new(Config::parse("backend=sim,arena_size=64MiB")?.build_pool()?);
//! let a = pool.alloc(0, 2 << 20, StreamId(0))?; // device 0, 2 MiB, default stream
//!
//! let broker = Broker::start(pool.clone(), BrokerConfig::default())?;
//! let handle = broker.share(a.ptr, a.bytes)?;
//! let bytes: [u8; 128] = handle.to_bytes(); // send it to the consumer any way bytes travel
//!
//! let importer = Importer::new(pool.backend().clone()); // in the consumer process
//! let ptr = importer.import(&ShareHandle::from_bytes(&bytes)?)?;
//! importer.close(ptr)?;
//!
//! broker.unshare(&handle)?;
//! pool.free(a.ptr)?;
//! pool.empty_cache(None)?;
//! assert_eq!(pool.stats(0)?.reserved_bytes, 0); // the arena went back to the driver
//! # Ok(())
//! # }
//! ```
//!
//! # More
//!
//! In the repository: `README.md` (the front page, quick starts), the guides in `docs/`
//! (`pytorch.md`, `rust.md`, `c-api.md`, `configuration.md`, `nixl.md`, `sleep-wake.md`,
//! `rocm.md`), `docs/ARCHITECTURE.md` (the layers, the stream rules, IPC, which file holds what),
//! `docs/STATUS.md` (measured figures and the issues' status), `examples/` and `bench/`.
#![deny(unsafe_op_in_unsafe_fn)]

pub mod backend;
pub mod config;
pub mod error;
pub mod history;
mod ids;
pub mod ipc;
pub mod lifetime;
pub mod pool;
pub mod range;
pub mod stats;
pub mod tags;
pub mod transfer;
pub mod units;

pub use backend::Backend;
pub use config::{BackendChoice, Config};
pub use error::{Error, Result};
pub use ids::{DeviceId, StreamId};
pub use pool::{
    Allocation, ArenaInfo, ArenaObserver, BlockInfo, GraphPoolId, LeaseGrant, ObserverId, Pool,
    PoolBlock, PoolConfig, SegmentInfo, ShareInfo, TrimReport,
};
pub use stats::PoolStats;

/// README.md's Rust code blocks, compiled and run as doctests (the crate's front page is its
/// own; the README's example stays checked).
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct ReadmeDoctests;
