//! The per-device pool: arenas, size rounding, stream-ordered reuse, trim, OOM retry.
//!
//! One [`Pool`] serves every device of one backend; each device has its own lock, its own
//! arenas and its own [`RangeAllocator`](crate::range::RangeAllocator) whose regions are the arenas, placed at their
//! device addresses (so an allocation's offset *is* its pointer).
//!
//! **Sizes** ([`block_len`]). Requests round up to 512 bytes; from 4 KiB to 1 MiB to
//! quarter-octave classes (at most 25% more, few distinct sizes: the exact-size cache then
//! serves most temporaries); above 1 MiB ([`LARGE_MIN`]) to 2 MiB multiples, so the holes
//! large blocks leave fit other large blocks. Small blocks (up to [`LARGE_MIN`]) come from
//! 2 MiB small arenas ([`SMALL_ARENA`]), large ones up to `arena_size` from shared arenas of
//! `arena_size` bytes, huge ones (above [`HUGE_MIN`]) from shared arenas of their own class,
//! and a request larger than `arena_size` gets an arena of its own, rounded up to the
//! backend's granularity: small, large and huge blocks never share an arena, so after
//! `empty_cache` a small survivor keeps at most 2 MiB, and large temporaries do not need
//! fresh arenas among the holes of KV blocks (`pool/sizes/classes.rs`). The default arena
//! size is chosen by measurement (see [`PoolConfig::arena_size`]).
//!
//! **Streams.** Free ranges are tagged with the stream they were freed on. An allocation on
//! stream S takes, best fit, a range tagged S (reuse at once is safe: S's later work runs
//! after S's earlier work), else a range tagged [`ANY_STREAM`] (safe for every stream); in a
//! growing arena the best fit of both (`pool/growth/grow.rs`), and S's frees there take in the
//! free space beside them that S may use.
//! When neither fits, the pool records an event on each other stream that holds free ranges
//! and, once it completed, retags that stream's ranges to `ANY_STREAM`. Recording the event
//! when it is needed rather than at every free is safe (it covers all earlier work on that
//! stream) and keeps the hot path free of driver calls. `record_stream(ptr, T)` adds T to
//! an allocation: at free, an event is recorded on every such T and the range is released
//! only when all of them completed (as PyTorch's caching allocator does).
//!
//! **Cache.** A plain free (not shared, no other stream) of a block up to
//! [`CACHE_MAX_BLOCK`] (with growing arenas one 2 MiB page: `growth_steps::GROWING_CACHE_MAX`;
//! up to [`CACHE_MAX_BLOCK`] again while the freeing thread finds the device lock contended,
//! `thread_cache::LARGE_CREDIT`) keeps it whole: in the freeing thread's cache (or the cache that
//! recorded the allocation), else in the device's exact-size cache (bounded at a quarter of
//! the reserved bytes), each keyed by (stream, length): the next request of that length on
//! that stream takes it with two hash operations and no sub-allocator call. A thread cache
//! has no bound of its own: the flush below (before any growth) bounds it, and a bound cut
//! the second KV trace's cache off while a long sequence's thousands of KV blocks came
//! back (bench/results/sim-2026-11-30-nobound.md). The key's
//! length fixes the block's size class, so a cache hit (a thread's or the device's) stays
//! in its class. On a miss that would otherwise grow the pool, the device's cached blocks
//! of the missing class and the threads' cached blocks of every class go back to their
//! class's sub-allocator, where they coalesce: those above [`FLUSH_FIRST_ABOVE`] first,
//! then the rest (why the threads' of every class: `DeviceState::flush_cached_above`); a
//! small class below [`SMALL_GROW_FREELY`] grows instead of flushing.
//! `empty_cache`, the OOM retry and sleep flush every class.
//!
//! **Out of memory.** When the backend refuses memory, the pool synchronizes the device,
//! releases every completed free, destroys its empty cached arenas and retries once; then it
//! returns [`Error::OutOfMemory`](crate::Error::OutOfMemory) and stays valid.
//!
//! **Threads and locks.** Each device has one `parking_lot::Mutex` (its `DeviceState`) and
//! a thread front (`pool/front/thread_cache.rs`): every thread has its own cache of freed blocks
//! per device, keyed like the exact-size cache by (stream, length, tag), behind a spin lock
//! that only that thread takes in the common case. An allocation that hits it, and the free
//! of a plain allocation (its record kept in the cache that made it), take no device lock
//! and write no line another thread writes; a free on another thread finds the record's
//! cache under the front's registry lock and puts the block back there (it keeps its
//! stream). Everything else takes the device lock, where the allocation's record is first
//! promoted into the device's map (`record_stream`, shares, a free the front declines,
//! snapshots, sleep). A miss that would grow the pool, `empty_cache`, the OOM retry and
//! `sleep` drain every thread's cache under the device lock, each block back to its class's
//! sub-allocator (the class derived from its tag and length); sleep (of the tags it puts to sleep), trim (every tag, while it runs) and history recording gate the fast path
//! first. Lock order: device, registry, thread caches. Arena creation
//! and destruction (the slow driver calls) run with the device lock released; event
//! record/query run under it, on the miss path only, never under a cache lock.
//!
//! **Layout.** One folder a concern, each `mod.rs` only declaring its files: `sizes/` (pure
//! size rules), `front/` (the thread front), `state/` (what the pool holds), `paths/` (the
//! allocation and free paths), `graphs/` (graph pools), then `growth/` (growing, limits,
//! `empty_cache`, trim), `sleep_wake/`, `sharing/` (shares, observers, hooks) and `inspect/`
//! (snapshot, history). A folder imports only from folders before it in that list; every
//! file is listed in docs/ARCHITECTURE.md.

mod front;
mod graphs;
mod growth;
mod inspect;
mod paths;
mod sharing;
mod sizes;
mod sleep_wake;
mod state;

pub use growth::trim::TrimReport;
pub use inspect::snapshot::{BlockInfo, SegmentInfo};
pub use inspect::trace::DEFAULT_HISTORY_ENTRIES;
pub use paths::alloc::Allocation;
pub use paths::streams::{ANY_STREAM, LIMBO_WAIT};
pub use sizes::blocks::{
    block_len, CACHE_MAX_BLOCK, FLUSH_FIRST_ABOVE, LARGE_MIN, LARGE_ROUND, MAX_REQUEST_BYTES,
    SMALL_EXACT,
};
pub use sizes::classes::{GRAPH_POOL_ARENA, HUGE_MIN, SMALL_ARENA, SMALL_GROW_FREELY};
pub use sizes::growth_steps::GROWING_CACHE_MAX;
pub use sleep_wake::offload::OFFLOAD_PIECE;
pub use sleep_wake::sleep::SleepReport;
pub use state::config::{MaxReserved, PoolConfig, MIN_ARENA_SIZE};
pub use state::graph_pool_ids::{GraphPoolId, PoolBlock};
pub use state::observer_registry::{
    ArenaInfo, ArenaObserver, ObserverError, ObserverId, ARENA_EXPORTED, ARENA_PINNED,
    MAX_NESTED_ARENAS,
};
pub use state::pool::Pool;
pub use state::pool_hook::PoolHook;
pub use state::share_tables::{LeaseGrant, ShareInfo};
