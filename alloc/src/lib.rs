#![doc = include_str!("../../README.md")]
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
