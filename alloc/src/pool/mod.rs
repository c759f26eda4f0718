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
//! fresh arenas among the holes of KV blocks (`pool/classes.rs`). The default arena
//! size is chosen by measurement (see [`PoolConfig::arena_size`]).
//!
//! **Streams.** Free ranges are tagged with the stream they were freed on. An allocation on
//! stream S takes, best fit, a range tagged S (reuse at once is safe: S's later work runs
//! after S's earlier work), else a range tagged [`ANY_STREAM`] (safe for every stream); in a
//! growing arena the best fit of both (`pool/growth.rs`), and S's frees there take in the
//! free space beside them that S may use.
//! When neither fits, the pool records an event on each other stream that holds free ranges
//! and, once it completed, retags that stream's ranges to `ANY_STREAM`. Recording the event
//! when it is needed rather than at every free is safe (it covers all earlier work on that
//! stream) and keeps the hot path free of driver calls. `record_stream(ptr, T)` adds T to
//! an allocation: at free, an event is recorded on every such T and the range is released
//! only when all of them completed (as PyTorch's caching allocator does).
//!
//! **Cache.** A plain free (not shared, no other stream) of a block up to
//! [`CACHE_MAX_BLOCK`] (with growing arenas one 2 MiB page: `growth::GROWING_CACHE_MAX`;
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
//! returns [`Error::OutOfMemory`] and stays valid.
//!
//! **Threads and locks.** Each device has one `parking_lot::Mutex` (its `DeviceState`) and
//! a thread front (`pool/thread_cache.rs`): every thread has its own cache of freed blocks
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

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use parking_lot::Mutex;

use crate::backend::{ArenaMem, Backend, DeviceId, Event, Export, StreamId};
use crate::error::{Error, Result};
use crate::lifetime::{AllocHold, ArenaLifetime};
use crate::stats::{DeviceMetrics, PoolStats};
use front::thread_cache::Front;
use graph_pools::SyncHold;
use sizes::classes::Class;

mod alloc;
mod arena_index;
mod device;
mod device_cache;
pub(crate) use device::DeviceState;
mod free;
mod front;
mod graph_pool_ids;
mod graph_pools;
mod growth;
mod hooks;
mod limits;
mod observers;
mod offload;
mod orphans;
mod pin_ahead;
mod share;
mod share_tables;
mod sizes;
mod sleep;
mod snapshot;
mod trace;
mod trim;
mod wake;

pub use graph_pools::{GraphPoolId, PoolBlock};
pub use hooks::PoolHook;
pub use limits::{MaxReserved, MIN_ARENA_SIZE};
pub use observers::{
    ArenaInfo, ArenaObserver, ObserverError, ObserverId, ARENA_EXPORTED, ARENA_PINNED,
    MAX_NESTED_ARENAS,
};
pub use offload::OFFLOAD_PIECE;
pub use share_tables::{LeaseGrant, ShareInfo};
pub use sizes::blocks::{
    block_len, CACHE_MAX_BLOCK, FLUSH_FIRST_ABOVE, LARGE_MIN, LARGE_ROUND, MAX_REQUEST_BYTES,
    SMALL_EXACT,
};
pub use sizes::classes::{GRAPH_POOL_ARENA, HUGE_MIN, SMALL_ARENA, SMALL_GROW_FREELY};
pub use sizes::growth_steps::GROWING_CACHE_MAX;
pub use sleep::SleepReport;
pub use snapshot::{BlockInfo, SegmentInfo};
pub use trace::DEFAULT_HISTORY_ENTRIES;
pub use trim::TrimReport;

/// Tag of free ranges that any stream may reuse.
pub const ANY_STREAM: u64 = u64::MAX;

/// Tags from here up (below [`ANY_STREAM`]) are limbo tags: free ranges of a stream that
/// wait for an event. Stream handles are user-space pointers or small constants, far below.
const LIMBO_BASE: u64 = 0xFFFF_0000_0000_0000;

/// How long an allocation that would otherwise grow the pool waits for events that
/// release enough limbo ranges.
pub const LIMBO_WAIT: Duration = Duration::from_micros(100);

const MIB: u64 = 1 << 20;

/// Pool settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolConfig {
    /// Size of a regular arena in bytes (at least [`MIN_ARENA_SIZE`]), rounded up to the
    /// backend granularity. Requests larger than this get a dedicated arena. Default 1 GiB, measured on the KV trace
    /// (`bench/results/sim-2026-11-29.md`): reserved/live 1.055 with 17 arenas, against
    /// 1.082 with 279 arenas at 64 MiB, 1.055 with 68 at 256 MiB and 1.117 with 9 at 2 GiB;
    /// each arena is at most one driver export when shared, so fewer is better.
    pub arena_size: u64,
    /// Cap on reserved bytes per device, in bytes or as a fraction of the device's memory
    /// (PyTorch's memory fraction); `None` for no cap. A fraction is resolved on the
    /// device's first growth (`pool/limits.rs`).
    pub max_reserved: Option<MaxReserved>,
    /// Run `validate()` after every operation (default: on in debug builds).
    pub validate: bool,
    /// UNSAFE, for demonstrations only: ignore streams (every free range is reusable by
    /// every stream at once, `record_stream` is ignored). Shows what the stream rules
    /// prevent; never enable it for real work.
    pub unsafe_ignore_streams: bool,
    /// Make every `empty_cache` a [`Pool::trim`] (`pool/trim.rs`): arenas with survivors are
    /// cut down to the pages the survivors use. Only for programs whose `empty_cache` runs
    /// at idle points (no other thread using gpu-arena memory on the device meanwhile: the
    /// cut arenas' addresses are briefly unmapped). Default off.
    pub trim_on_empty_cache: bool,
    /// Large blocks live in arenas that grow with the work (`pool/growth.rs`): each reserves
    /// the device's address range and maps memory chunk by chunk. Off: every arena is
    /// `arena_size` bytes, mapped whole: the fastest per operation, but a class's last arena
    /// is partly empty (default on since issue #24).
    pub grow_arenas: bool,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            arena_size: 1024 * MIB,
            max_reserved: None,
            validate: cfg!(debug_assertions),
            unsafe_ignore_streams: false,
            trim_on_empty_cache: false,
            grow_arenas: true,
        }
    }
}

/// The tag a plain free uses: the allocation's own stream.
fn live_tag(live: &Live) -> u64 {
    live.stream.0
}

/// A live allocation, as handed to the caller. Plain data: free it with [`Pool::free`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allocation {
    /// Device address of the first byte.
    pub ptr: u64,
    /// Usable size in bytes (the request rounded up by [`block_len`]).
    pub bytes: u64,
    /// Device.
    pub device: DeviceId,
}

/// One arena: a block of device memory from the backend, a region of the range allocator.
#[derive(Debug)]
pub(crate) struct Arena {
    pub(crate) mem: ArenaMem,
    /// Unique for the life of the pool (share handles name arenas by it).
    pub(crate) id: u64,
    /// Live (or freed-but-still-referenced) allocations inside whose records are in the
    /// device's map; those recorded by thread caches are not counted (their ranges, still
    /// allocated in the sub-allocator, keep the arena from being destroyed all the same).
    pub(crate) live_allocs: u64,
    /// Export and sharing state (`crate::lifetime`).
    pub(crate) lifetime: ArenaLifetime<Export>,
    /// Its allocations' tag index (`crate::tags`).
    pub(crate) tag: u8,
    /// Whether it holds small blocks (`pool/classes.rs`).
    pub(crate) small: bool,
    /// Whether it holds huge blocks (`pool/classes.rs`).
    pub(crate) huge: bool,
    /// The graph pool whose blocks it holds, for life (`pool/graph_pools.rs`; the slot,
    /// `classes::GENERAL` for the general pool).
    pub(crate) graph_pool: u16,
    /// While asleep (`pool/sleep.rs`): the contents kept on the host, if offloaded.
    pub(crate) sleep: Option<sleep::Asleep>,
    /// Its physical allocations (1 until it grows, `pool/growth.rs`; 1 again after a wake).
    pub(crate) chunks: u16,
}

impl Arena {
    /// The class whose blocks it holds.
    pub(crate) fn class(&self) -> Class {
        Class {
            pool: self.graph_pool,
            tag: self.tag,
            small: self.small,
            huge: self.huge,
        }
    }
}

/// The record of a live allocation: one entry of the pool's busiest hash map, so kept small
/// (40 bytes): the length is recomputed from the request, the rare extra streams are boxed.
#[derive(Debug, Clone)]
pub(crate) struct Live {
    pub(crate) arena: usize,
    pub(crate) requested: u64,
    pub(crate) stream: StreamId,
    /// Streams added by `record_stream` (rare: `None` until the first).
    pub(crate) extra_streams: Option<Box<[StreamId]>>,
    /// Shares and consumer leases holding it, and whether its owner freed it (changed only
    /// by the arena's [`ArenaLifetime`]).
    pub(crate) hold: AllocHold,
}

impl Live {
    /// Bytes of the range serving it: [`block_len`] of the request, as allocated.
    pub(crate) fn bytes(&self) -> u64 {
        // A request that was allocated has a length: block_len succeeded on it then.
        block_len(self.requested).unwrap_or(0)
    }

    /// Streams added by `record_stream`.
    pub(crate) fn extra_streams(&self) -> &[StreamId] {
        self.extra_streams.as_deref().unwrap_or(&[])
    }
}

/// A freed allocation waiting for events on the streams it was recorded on.
#[derive(Debug)]
struct PendingFree {
    ptr: u64,
    stream: StreamId,
    events: Vec<Event>,
    /// An event could not be recorded: released only after a device synchronize.
    until_synchronize: bool,
}

/// One device's pool. `repr(C)` on a line of its own: what a fast allocation or free reads
/// (the front, the allocated and requested gauges) is its first cache line.
#[derive(Debug)]
#[repr(C, align(64))]
pub(crate) struct DevicePool {
    /// The thread front, reached without the lock.
    pub(crate) front: Arc<Front>,
    pub(crate) metrics: DeviceMetrics,
    pub(crate) device: DeviceId,
    limits: OnceLock<limits::DeviceLimits>,
    pub(crate) state: Mutex<DeviceState>,
    /// Serialises the export self-test (`pool/share.rs`), run with the device lock released.
    pub(crate) export_probe: Mutex<Option<crate::backend::ExportKind>>,
    /// The cap set at run time (`Pool::set_max_reserved`; `None`: the configuration's).
    pub(crate) max_reserved: Mutex<Option<Option<MaxReserved>>>,
    /// Signalled (with `state`) when a call that synchronizes the device ends: a
    /// `graph_pool_begin` waits on it (`pool/graph_pools.rs`, `SyncHold`).
    pub(crate) sync_ended: parking_lot::Condvar,
}

/// A pool allocator over one backend, for every device it has. `Sync`: share it by
/// reference or `Arc` between threads.
#[derive(Debug)]
pub struct Pool {
    pub(crate) backend: Arc<dyn Backend>,
    pub(crate) config: PoolConfig,
    pub(crate) devices: Vec<DevicePool>,
    /// Arena observers and the arenas they are told about (`pool/observers.rs`).
    pub(crate) observers: observers::Observers,
    /// Serialises sleeps and wakes (`pool/sleep.rs`).
    sleep_lock: Mutex<()>,
    /// Told around sleep, wake and release of cached memory (`pool/hooks.rs`).
    pub(crate) hooks: hooks::Hooks,
}

impl Pool {
    /// A pool over `backend`, one per device the backend reports.
    pub fn new(backend: Arc<dyn Backend>, config: PoolConfig) -> Result<Pool> {
        config.check()?;
        let count = backend.device_count()?;
        let devices = (0..count)
            .map(|d| {
                let device = d as DeviceId;
                let front = Arc::new(Front::new(sizes::growth_steps::cache_max(
                    config.grow_arenas,
                )));
                DevicePool {
                    device,
                    limits: OnceLock::new(),
                    state: Mutex::new(DeviceState::new(Arc::clone(&front), config.grow_arenas)),
                    front,
                    export_probe: Mutex::new(None),
                    max_reserved: Mutex::new(None),
                    sync_ended: parking_lot::Condvar::new(),
                    metrics: DeviceMetrics::new(device),
                }
            })
            .collect();
        Ok(Pool {
            backend,
            config,
            devices,
            observers: observers::Observers::default(),
            sleep_lock: Mutex::new(()),
            hooks: hooks::Hooks::default(),
        })
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// The configuration.
    pub fn config(&self) -> &PoolConfig {
        &self.config
    }

    /// Number of devices.
    pub fn device_count(&self) -> usize {
        self.devices.len()
    }

    pub(crate) fn dev(&self, device: DeviceId) -> Result<&DevicePool> {
        // A match, not `ok_or`: that builds (and drops) the error on every call.
        match usize::try_from(device)
            .ok()
            .and_then(|d| self.devices.get(d))
        {
            Some(dp) => Ok(dp),
            None => Err(Error::InvalidDevice {
                device,
                count: self.devices.len(),
            }),
        }
    }

    /// Synchronize `device` (or every device for `None`) and destroy every arena with no live
    /// allocation and no share. Pinned arenas stay (recycled). Returns bytes released.
    pub fn empty_cache(&self, device: Option<DeviceId>) -> Result<u64> {
        self.hooks_before_release(device);
        if self.config.trim_on_empty_cache {
            return self
                .trim(device)
                .map(|r| r.emptied_bytes + r.released_bytes);
        }
        let mut released = 0;
        match device {
            Some(d) => released += self.release_cached(self.dev(d)?)?,
            None => {
                for dp in &self.devices {
                    released += self.release_cached(dp)?;
                }
            }
        }
        Ok(released)
    }

    /// Synchronize, release completed frees, destroy empty unshared arenas, give back grown
    /// arenas' free tails and their other free chunks.
    fn release_cached(&self, dp: &DevicePool) -> Result<u64> {
        let _no_capture = SyncHold::take(dp, "empty_cache")?;
        {
            let st = dp.state.lock();
            if st.arenas.is_empty() && st.orphans.is_empty() {
                return Ok(0);
            }
        }
        self.backend.synchronize(dp.device)?;
        let (doomed, releases, shrunk) = {
            let mut st = dp.state.lock();
            st.settle_all(self.backend.as_ref());
            let mut doomed = st.orphans.take_all();
            let (empty, releases) = self.take_empty_observed(dp, &mut st);
            doomed.extend(empty);
            let shrunk = self.shrink_free_tails(dp, &mut st) + self.drop_free_chunks(dp, &mut st);
            (doomed, releases, shrunk)
        };
        // Observers' on_release, with the lock released, before the arenas are destroyed.
        self.count_failures(self.observers.deliver(releases));
        let mut released = shrunk;
        let mut first_err = None;
        for mem in doomed {
            let bytes = mem.bytes;
            // (Counted as `backend_destroys` when taken: `DeviceState::take_empty_arenas`.)
            match self.backend.destroy_arena(mem.clone()) {
                Ok(()) => released += bytes,
                Err(e) => {
                    // Kept, and tried again by the next empty_cache and at teardown.
                    tracing::error!(error = %e, "destroy_arena failed; will retry");
                    dp.state.lock().keep_orphan(mem);
                    first_err.get_or_insert(e);
                }
            }
        }
        let st = dp.state.lock();
        dp.metrics.publish(&st.stats_now());
        if self.config.validate {
            st.validate_or_log();
        }
        drop(st);
        match first_err {
            Some(e) => Err(e),
            None => Ok(released),
        }
    }

    /// Counters of one device.
    pub fn stats(&self, device: DeviceId) -> Result<PoolStats> {
        Ok(self.dev(device)?.state.lock().stats_now())
    }

    /// Set the peaks of one device's counters (reserved, allocated and requested bytes) to
    /// their current values (PyTorch's `reset_peak_memory_stats`).
    pub fn reset_peak_stats(&self, device: DeviceId) -> Result<()> {
        let mut st = self.dev(device)?.state.lock();
        st.stats.peak_reserved_bytes = st.reserved_now();
        let registry = st.front.lock_caches();
        st.front.reset_peaks(&registry.lock());
        Ok(())
    }

    /// Zero one device's counts of events (PyTorch's `reset_accumulated_memory_stats`):
    /// allocations and frees served, arenas created and destroyed, out-of-memory failures,
    /// exports made. Current values and peaks stay.
    pub fn reset_accumulated_stats(&self, device: DeviceId) -> Result<()> {
        let mut st = self.dev(device)?.state.lock();
        st.promote_all();
        st.reset_accumulated();
        Ok(())
    }

    /// Check every invariant of one device's pool (the sub-allocator's, and that the pool's
    /// records agree with it). Returns the first violation.
    pub fn validate(&self, device: DeviceId) -> Result<()> {
        self.dev(device)?
            .state
            .lock()
            .validate()
            .map_err(Error::Internal)
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        for dp in &mut self.devices {
            let st = dp.state.get_mut();
            st.promote_all();
            if !st.allocs.is_empty() {
                tracing::warn!(
                    device = dp.device,
                    allocations = st.allocs.len(),
                    bytes = st.stats_now().allocated_bytes,
                    "pool dropped with live allocations: their memory is released with the pool"
                );
            }
        }
        self.free_kept_host_buffers();
        self.drop_all_arenas();
    }
}
