//! The pool's memory from the device and back: a growing arena mapping more (`grow.rs`),
//! what a device allows (`limits.rs`: granularity, arena size, the `max_reserved` cap, the
//! out-of-memory error), `empty_cache` (`empty_cache.rs`), grown arenas giving chunks back
//! (`shrink.rs`), and `trim` (`trim.rs`).

pub(super) mod empty_cache;
pub(super) mod grow;
pub(super) mod limits;
pub(super) mod shrink;
pub(super) mod trim;
