//! The allocation and free paths, one file a step: the calls (`alloc.rs`, `free.rs`), the
//! device's exact-size cache (`device_cache.rs`), which free range a stream may take and how
//! freed ranges come back (`streams.rs`), and an arena entering the pool (`new_arena.rs`).
//! Growing an arena, the limits and the out-of-memory retry are `pool/growth/`'s.

pub(super) mod alloc;
pub(super) mod device_cache;
pub(super) mod free;
pub(super) mod new_arena;
pub(super) mod streams;
