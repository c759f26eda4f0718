//! What the pool holds, one file a record: the pool and its devices (`pool.rs`), what is
//! behind a device's lock (`device.rs`), arenas and live allocations (`arena.rs`), the
//! settings and a device's limits (`config.rs`), and the records each part of the pool keeps
//! there (shares, graph pools, observers, hooks, a sleeping arena's contents, failed
//! destroys, the arenas' address index). Nothing here calls into the rest of the pool.

pub(super) mod arena;
pub(super) mod arena_index;
pub(super) mod asleep;
pub(super) mod config;
pub(super) mod device;
pub(super) mod graph_pool_ids;
pub(super) mod observer_registry;
pub(super) mod orphans;
pub(super) mod pool;
pub(super) mod pool_hook;
pub(super) mod share_tables;
pub(super) mod validate;
