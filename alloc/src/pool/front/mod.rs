//! The thread front: per-thread caches of freed blocks and the records of the plain
//! allocations they handed out, reached without the device lock (`thread_cache.rs`).

pub(super) mod addr_table;
pub(super) mod cache_key;
pub(super) mod cached_runs;
pub(super) mod spin;
pub(super) mod thread_cache;
pub(super) mod thread_records;
