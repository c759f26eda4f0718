//! The thread front of one device's pool: per-thread caches of exactly-sized freed blocks,
//! each with the records of the plain allocations it handed out, so that an alloc/free pair
//! on one thread takes no device-wide lock and writes no line another thread writes
//! (tcmalloc's thread cache, mimalloc's per-thread heap).
//!
//! - **Thread caches** ([`ThreadCache`]): one per thread and device, owned by the pool's
//!   [`Front`] (its registry) and reached by the thread through a thread-local handle. A
//!   cache holds freed blocks whole, in free lists keyed like the device's exact-size cache
//!   by (stream, length, tag): a block freed on stream S is reused from a cache only by an
//!   allocation on S (whichever thread frees it, the block keeps its stream). A freed block
//!   keeps its record, marked free (`pool/front/thread_records.rs`): a warm pair touches one
//!   record, with no insert or remove. Each cache has its own spin
//!   lock (`pool/front/spin.rs`), which only its thread takes in the common case; flushers (a miss
//!   that would grow the pool, a larger miss taking back a run of blocks:
//!   `pool/front/cached_runs.rs`; `empty_cache`, the OOM retry, `sleep`) and readers
//!   (`validate`, `stats`) take it too, under the device lock.
//! - **Live records**: a plain allocation (no share, no `record_stream`) is recorded in the
//!   cache of the thread that allocated it, not in the device state. Its free on that thread
//!   is one lookup in its own cache. A free on another thread looks through the other
//!   caches (one at a time, under the registry lock) and puts the block into the cache that
//!   held the record: slower, still without the device lock. Any operation that needs more
//!   than the plain record (a share, `record_stream`, a free the front declines, a snapshot,
//!   a sleep) first *promotes* it into the device state's map, under the device lock.
//! - **Counters**: each cache counts its allocations, frees, and allocated and requested
//!   bytes as changes (a block allocated on one thread and freed on another makes one
//!   cache's change "negative": wrapping arithmetic); the device lock's path counts into
//!   the device's counters (its allocations' bytes into the calling thread's cache as
//!   well; its frees' into [`Front`]'s base atomics). `Pool::stats` adds them up with every
//!   cache locked: exact. A cache folds its byte changes into the base when they pass
//!   [`FOLD_BYTES`], and at once when they turn negative, so no shared line is written per
//!   allocation or fast free while a thread's live bytes stay at or above what it last
//!   folded. The peaks are raised with the base plus the calling thread's changes: exact
//!   with one thread; with several threads allocating at once, short of the true peak by
//!   at most what the other threads' caches have not folded ([`FOLD_BYTES`] each), and
//!   never above it: an unfolded change is never negative, so the base never counts bytes
//!   another thread has freed (a thread that folded 64 MiB and then freed 32 MiB without
//!   folding made other threads' peaks 32 MiB too high: `peaks_never_exceed_the_true_peak_
//!   across_threads` in alloc/tests/thread_cache.rs). Every exact read (`stats`,
//!   `validate`) raises them to the exact current value first.
//!
//! **Lock order**: device state, then the registry, then a thread cache (one at a time,
//! except for the readers under the device lock, which lock them all in registry order).
//! The fast path holds only its own cache (never the device lock); every counter and map
//! it changes is changed with that cache locked, so a reader that holds the device lock
//! and every cache lock sees a consistent pool.
//!
//! **Gates**: the fast path is off for a tag that sleeps and while history is recorded (the
//! device lock's path records every event). Both are mirrored here as atomics, set under
//! the device lock *before* the caches are drained, and read under the cache lock: a cache
//! operation either completed before the drain (which then sees it) or sees the gate.
//!
//! **Thread exit**: the thread-local handle marks its cache gone and folds its byte
//! changes; the next operation under the device lock returns the gone caches' blocks to the
//! sub-allocator, moves their live records into the device's map and folds their counts
//! ([`Front::take_gone`]).

use std::cell::RefCell;
use std::ops::Deref;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Weak};

use parking_lot::Mutex;

use super::spin::{SpinGuard, SpinLock};
use super::thread_records::{FreeOutcome, FrontLive, ThreadRecords};
use crate::pool::sizes::blocks::{block_len, CACHE_MAX_BLOCK};
use crate::pool::sizes::classes::Class;
use crate::range::Beside;

/// A byte count as one thread sees it (the base plus its cache's changes), which is below
/// the truth while other threads hold unfolded allocations, and "negative" (wrapped) when
/// the base already counts their frees: then 0, never a wrapped huge value.
#[inline]
fn seen_value(base_plus_change: u64) -> u64 {
    if (base_plus_change as i64) < 0 {
        0
    } else {
        base_plus_change
    }
}

/// A thread cache folds its allocated-bytes change into the device's base once it grows
/// past this many bytes (bounding what a peak seen by another thread may miss), and as soon
/// as it is negative (so that no peak counts bytes already freed).
pub(crate) const FOLD_BYTES: u64 = 64 << 20;

/// `T` on cache lines of its own (128 bytes: the adjacent-line prefetcher pairs lines), so
/// that threads writing neighbouring values do not share a line.
#[repr(align(128))]
#[derive(Debug, Default)]
pub(crate) struct Padded<T>(T);

impl<T> Deref for Padded<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

/// Allocation and free counts kept by a thread cache (added to the device's by `stats`).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
#[repr(C)]
pub(crate) struct Counts {
    pub(crate) alloc_count: u64,
    pub(crate) free_count: u64,
}

impl Counts {
    pub(crate) fn add(&mut self, o: Counts) {
        self.alloc_count = self.alloc_count.wrapping_add(o.alloc_count);
        self.free_count = self.free_count.wrapping_add(o.free_count);
    }

    /// Change in live allocations, wrapping (a block allocated on one thread may be freed on
    /// another, so one cache's share may be "negative").
    pub(crate) fn allocations(&self) -> u64 {
        self.alloc_count.wrapping_sub(self.free_count)
    }
}

/// One thread's cache for one device. `repr(C)`, in this order: behind its lock's flag, what
/// an allocation or a free reads and writes fills two cache lines (the counts, the byte
/// changes and the records' remembered list on the first; the record map and the free lists
/// on the second; `thread_cache_fields_a_fast_operation_touches_fill_two_lines`).
#[derive(Debug, Default)]
#[repr(C)]
pub(crate) struct ThreadCache {
    pub(crate) counts: Counts,
    /// Change in allocated and requested bytes not yet folded into the base (wrapping).
    allocated: u64,
    requested: u64,
    /// The plain allocations this cache handed out (or its thread made under the device
    /// lock) and the blocks freed into it, in one table (`pool/front/thread_records.rs`).
    pub(crate) records: ThreadRecords,
    /// Its thread exited: drained and dropped by the next [`Front::take_gone`].
    gone: bool,
    /// Frees of blocks above `cache_max` still cached after one found the device lock
    /// contended ([`Front::try_free`]).
    large_credit: u32,
}

/// After a free that found the device lock contended, this many more frees of blocks above
/// `cache_max` are cached on the same thread without the lock being contended: the
/// contention that caching removes would otherwise come back with the next free.
const LARGE_CREDIT: u32 = 64;

type CacheSlot = Padded<SpinLock<ThreadCache>>;

/// Allocated and requested bytes of a device (the base: without the thread caches' unfolded
/// changes), and their peaks.
#[derive(Debug, Default)]
struct ByteCounters {
    allocated: AtomicU64,
    requested: AtomicU64,
    peak_allocated: AtomicU64,
    peak_requested: AtomicU64,
}

/// What the fast path reads on every call, written rarely.
#[derive(Debug, Default)]
struct Gates {
    /// Mirror of the device's asleep tags (bit = tag index).
    asleep_tags: AtomicU64,
    /// Mirror of `history.recording`.
    history: AtomicBool,
}

/// What every fast operation reads, on one cache line (56 bytes): written rarely (the
/// gates), or when a thread folds its byte changes (past [`FOLD_BYTES`], or negative) and by
/// the device lock's frees (the bytes).
#[derive(Debug, Default)]
struct Hot {
    /// Unique for the life of the process: thread-local handles name their front by it.
    id: u64,
    gates: Gates,
    bytes: ByteCounters,
    /// Freed blocks up to this many bytes are cached (see [`Front::new`]); up to
    /// [`CACHE_MAX_BLOCK`] while the device lock is contended (see [`Front::try_free`]).
    cache_max: u64,
}

/// The thread front of one device (see the module docs).
#[derive(Debug)]
pub(crate) struct Front {
    hot: Padded<Hot>,
    caches: Mutex<Vec<Arc<CacheSlot>>>,
    /// Hint: thread caches whose thread exited since the last [`Front::take_gone`].
    gone: AtomicUsize,
}

impl Default for Front {
    fn default() -> Self {
        Front::new(CACHE_MAX_BLOCK)
    }
}

impl Front {
    /// A front whose caches keep freed blocks of up to `cache_max` bytes
    /// (`pool/sizes/growth_steps.rs`'s `cache_max`).
    pub(crate) fn new(cache_max: u64) -> Front {
        static NEXT_ID: AtomicU64 = AtomicU64::new(1);
        Front {
            hot: Padded(Hot {
                id: NEXT_ID.fetch_add(1, Relaxed),
                cache_max,
                ..Hot::default()
            }),
            caches: Mutex::default(),
            gone: AtomicUsize::new(0),
        }
    }
}

/// A thread's handle on its cache of one front; dropped at thread exit.
struct CacheHandle {
    front_id: u64,
    front: Weak<Front>,
    slot: Arc<CacheSlot>,
}

impl Drop for CacheHandle {
    fn drop(&mut self) {
        let mut cache = self.slot.lock();
        cache.gone = true;
        if let Some(front) = self.front.upgrade() {
            // Its byte changes at once (the peaks other threads raise count them); its
            // blocks and counts at the next operation under the device lock.
            front.fold(&mut cache);
            front.gone.fetch_add(1, Relaxed);
        }
    }
}

thread_local! {
    /// This thread's caches, one per front (device of a pool) it used.
    static CACHES: RefCell<Vec<CacheHandle>> = const { RefCell::new(Vec::new()) };
}

impl Front {
    /// Run `f` on the calling thread's cache of this front (made on first use). `None`
    /// when `f` declines, or while the thread is exiting (its thread-locals are gone).
    fn with_cache<R>(self: &Arc<Self>, f: impl FnOnce(&mut ThreadCache) -> Option<R>) -> Option<R> {
        CACHES
            .try_with(|cell| {
                let mut handles = cell.try_borrow_mut().ok()?;
                let i = match handles.iter().position(|h| h.front_id == self.hot.id) {
                    Some(i) => i,
                    None => self.add_handle(&mut handles),
                };
                let mut cache = handles[i].slot.lock();
                f(&mut cache)
            })
            .ok()
            .flatten()
    }

    /// The calling thread's first use of this front: make its cache, register it and
    /// return its handle's index. Out of line: the fast path's frame stays small.
    #[cold]
    #[inline(never)]
    fn add_handle(self: &Arc<Self>, handles: &mut Vec<CacheHandle>) -> usize {
        // Handles of dropped pools go first.
        handles.retain(|h| h.front.strong_count() > 0);
        let slot = Arc::new(CacheSlot::default());
        self.caches.lock().push(Arc::clone(&slot));
        handles.push(CacheHandle {
            front_id: self.hot.id,
            front: Arc::downgrade(self),
            slot,
        });
        handles.len() - 1
    }

    fn gated(&self, tag: u8) -> bool {
        self.hot.gates.asleep_tags.load(Relaxed) & (1 << tag) != 0
            || self.hot.gates.history.load(Relaxed)
    }

    /// The fast allocation: a block of `len` bytes and tag `tag` freed on `stream`, from
    /// the calling thread's cache, recorded as live. `None` on a miss.
    pub(crate) fn try_alloc(
        self: &Arc<Self>,
        stream: u64,
        len: u64,
        tag: u8,
        requested: u64,
    ) -> Option<(u64, [u64; 2])> {
        // (Blocks above `cache_max` are only there when a free found the device contended.)
        if len > CACHE_MAX_BLOCK.max(self.hot.cache_max) {
            return None;
        }
        self.with_cache(|cache| {
            if self.gated(tag) {
                return None;
            }
            let (ptr, _) = cache.records.alloc_free(stream, len, tag, requested)?;
            cache.counts.alloc_count += 1;
            cache.allocated = cache.allocated.wrapping_add(len);
            cache.requested = cache.requested.wrapping_add(requested);
            Some((ptr, self.settle_bytes(cache, true)))
        })
    }

    /// The fast free: a plain allocation (its size `requested` when given) into the cache
    /// that recorded it: the calling thread's (one lookup), else another thread's (found
    /// under the registry lock). `None` when it is not the front's to free that way (not
    /// recorded here, a size mismatch, gated, or too large): the caller
    /// takes the device lock's path. Else the allocated and requested bytes as seen.
    ///
    /// `contended()`: whether the device lock is held by another thread right now (asked only
    /// of a block above `cache_max`, so the fast free of a cached size reads no lock). A
    /// block above `cache_max` (with growing arenas: above 2 MiB, which otherwise goes back to
    /// its arena to coalesce) is then cached too, up to [`CACHE_MAX_BLOCK`], so that threads
    /// allocating large blocks at once do not queue on the device lock for every free and
    /// the next allocation of that size (8 threads of mixed sizes with growing arenas took
    /// 5.5 us a pair, 54 ns with 1 GiB arenas). A program of one thread never contends, so
    /// its large blocks coalesce at once as before.
    pub(crate) fn try_free(
        self: &Arc<Self>,
        ptr: u64,
        requested: Option<u64>,
        contended: impl Fn() -> bool,
    ) -> Option<[u64; 2]> {
        let own = self.with_cache(|cache| Some(self.free_into(cache, ptr, requested, &contended)));
        match own {
            Some(FreeStep::Freed(seen)) => return Some(seen),
            Some(FreeStep::Declined) => return None,
            Some(FreeStep::Absent) | None => {}
        }
        for slot in self.caches.lock().iter() {
            match self.free_into(&mut slot.lock(), ptr, requested, &contended) {
                FreeStep::Freed(seen) => return Some(seen),
                FreeStep::Declined => return None,
                FreeStep::Absent => {}
            }
        }
        None
    }

    /// [`Self::try_free`] in the calling thread's cache only (a pool of several devices tries
    /// each device's this way before it looks for the device).
    pub(crate) fn try_free_own(self: &Arc<Self>, ptr: u64) -> Option<[u64; 2]> {
        match self.with_cache(|cache| Some(self.free_into(cache, ptr, None, &|| false)))? {
            FreeStep::Freed(seen) => Some(seen),
            FreeStep::Declined | FreeStep::Absent => None,
        }
    }

    /// Free `ptr` into `cache` if `cache` holds its record and its block is cached
    /// (`contended`: see [`Self::try_free`]).
    fn free_into(
        &self,
        cache: &mut ThreadCache,
        ptr: u64,
        requested: Option<u64>,
        contended: &dyn Fn() -> bool,
    ) -> FreeStep {
        let cache_max = self.hot.cache_max;
        let credit = cache.large_credit;
        let mut contended_now = false;
        // One lookup: the record, which stays where it is (marked free) with the block.
        let step = cache.records.free_live(ptr, |rec| {
            let len = block_len(rec.requested).unwrap_or(u64::MAX);
            let fits = len <= cache_max
                || (len <= CACHE_MAX_BLOCK && {
                    contended_now = contended();
                    contended_now || credit > 0
                });
            let ours = requested.is_none_or(|r| r == rec.requested) && !self.gated(rec.tag) && fits;
            ours.then_some(len)
        });
        let (rec, len) = match step {
            FreeOutcome::Freed(rec, len) => (rec, len),
            FreeOutcome::Declined => return FreeStep::Declined,
            FreeOutcome::Absent => return FreeStep::Absent,
        };
        if len > cache_max {
            cache.large_credit = if contended_now {
                LARGE_CREDIT
            } else {
                credit - 1
            };
        }
        cache.counts.free_count += 1;
        cache.allocated = cache.allocated.wrapping_sub(len);
        cache.requested = cache.requested.wrapping_sub(rec.requested);
        FreeStep::Freed(self.settle_bytes(cache, false))
    }

    /// After a fast operation on `cache`: fold its byte changes into the base if they passed
    /// [`FOLD_BYTES`], raise the peaks (after an allocation), and return the allocated and
    /// requested bytes as this thread sees them (base plus its changes; exact with one
    /// thread).
    fn settle_bytes(&self, cache: &mut ThreadCache, allocated: bool) -> [u64; 2] {
        let b = &self.hot.bytes;
        // The change is negative (wrapped: above FOLD_BYTES as unsigned) or past FOLD_BYTES,
        // or the requested bytes' change is negative.
        if cache.allocated > FOLD_BYTES || (cache.requested as i64) < 0 {
            self.fold(cache);
        }
        let seen = [
            seen_value(b.allocated.load(Relaxed).wrapping_add(cache.allocated)),
            seen_value(b.requested.load(Relaxed).wrapping_add(cache.requested)),
        ];
        if allocated {
            self.raise_peaks(seen);
        }
        seen
    }

    /// Move a cache's byte changes into the base.
    fn fold(&self, cache: &mut ThreadCache) {
        if (cache.allocated, cache.requested) == (0, 0) {
            return;
        }
        let b = &self.hot.bytes;
        b.allocated.fetch_add(cache.allocated, Relaxed);
        b.requested.fetch_add(cache.requested, Relaxed);
        (cache.allocated, cache.requested) = (0, 0);
    }

    fn raise_peaks(&self, [allocated, requested]: [u64; 2]) {
        let b = &self.hot.bytes;
        if allocated > b.peak_allocated.load(Relaxed) {
            b.peak_allocated.fetch_max(allocated, Relaxed);
        }
        if requested > b.peak_requested.load(Relaxed) {
            b.peak_requested.fetch_max(requested, Relaxed);
        }
    }

    /// Record a plain allocation of `len` bytes made under the device lock in the calling
    /// thread's cache and count its bytes there, as a fast allocation does (no shared
    /// write). `false` while the thread exits, or when the cache cannot hold its record: the
    /// caller records it itself, and the bytes go to the base. Also returns the allocated
    /// and requested bytes as this thread sees them.
    pub(crate) fn record_alloc(
        self: &Arc<Self>,
        ptr: u64,
        rec: FrontLive,
        len: u64,
    ) -> (bool, [u64; 2]) {
        let recorded = self.with_cache(|cache| {
            if !cache.records.insert_live(ptr, rec) {
                return None;
            }
            cache.allocated = cache.allocated.wrapping_add(len);
            cache.requested = cache.requested.wrapping_add(rec.requested);
            Some(self.settle_bytes(cache, true))
        });
        if let Some(seen) = recorded {
            return (true, seen);
        }
        (false, self.count_unrecorded(len, rec.requested))
    }

    /// Count an allocation of `len` bytes (`requested` asked for) that the device records
    /// (no thread cache holds its record): the bytes now seen, as `record_alloc` returns.
    pub(crate) fn count_unrecorded(&self, len: u64, requested: u64) -> [u64; 2] {
        let b = &self.hot.bytes;
        let seen = [
            seen_value(b.allocated.fetch_add(len, Relaxed).wrapping_add(len)),
            seen_value(
                b.requested
                    .fetch_add(requested, Relaxed)
                    .wrapping_add(requested),
            ),
        ];
        self.raise_peaks(seen);
        seen
    }

    /// Set the byte peaks to the current values (every cache locked, as for
    /// [`Self::byte_counts`]): PyTorch's `reset_peak_memory_stats`.
    pub(crate) fn reset_peaks(&self, caches: &[SpinGuard<'_, ThreadCache>]) {
        let b = &self.hot.bytes;
        let [allocated, requested, ..] = self.byte_counts(caches);
        b.peak_allocated.store(allocated, Relaxed);
        b.peak_requested.store(requested, Relaxed);
    }

    /// Take the record of `ptr` out of the caches (to promote it): the calling thread's
    /// first, else the others'.
    pub(crate) fn take_live(self: &Arc<Self>, ptr: u64) -> Option<FrontLive> {
        if let Some(rec) = self.with_cache(|cache| cache.records.take_live(ptr)) {
            return Some(rec);
        }
        self.caches
            .lock()
            .iter()
            .find_map(|slot| slot.lock().records.take_live(ptr))
    }

    /// Take every record out of the caches.
    pub(crate) fn take_all_live(&self) -> Vec<(u64, FrontLive)> {
        let mut out = Vec::new();
        for slot in self.caches.lock().iter() {
            slot.lock().records.take_all_live(&mut out);
        }
        out
    }

    /// Lock the registry and every thread cache (in order), for a consistent read or a drain.
    /// The registry stays locked while the result lives: no cache is added meanwhile.
    pub(crate) fn lock_caches(&self) -> LockedCaches<'_> {
        LockedCaches {
            slots: self.caches.lock(),
        }
    }

    /// Whether the calling thread caches blocks above `cache_max` because its frees found
    /// the device lock contended ([`Self::try_free`]).
    pub(crate) fn own_contended(self: &Arc<Self>) -> bool {
        self.with_cache(|cache| Some(cache.large_credit > 0))
            .unwrap_or(false)
    }

    /// The largest block a cache keeps.
    #[inline]
    pub(crate) fn cache_max(&self) -> u64 {
        self.hot.cache_max
    }

    /// Whether a thread whose cache is still in the registry exited (a hint: one read, for
    /// the device lock's path to skip [`Self::take_gone`]).
    #[inline]
    pub(crate) fn any_gone(&self) -> bool {
        self.gone.load(Relaxed) != 0
    }

    /// Remove the caches whose thread exited from the registry: their blocks (by stream and
    /// tag), live records and counts, for the caller to take into the device under its lock.
    /// `huge_min`: the device's `DeviceState::huge_min` (a block's class index).
    pub(crate) fn take_gone(&self, huge_min: u64) -> Gone {
        let mut gone = Gone::default();
        // A load first: the device lock's path calls this every time, and a swap would
        // write the line each time.
        if self.gone.load(Relaxed) == 0 || self.gone.swap(0, Relaxed) == 0 {
            return gone;
        }
        self.caches.lock().retain(|slot| {
            let mut c = slot.lock();
            if !c.gone {
                return true;
            }
            gone.counts.add(c.counts);
            c.counts = Counts::default();
            self.fold(&mut c);
            c.records.drain_free(0, None, huge_min, &mut gone.blocks);
            c.records.take_all_live(&mut gone.live);
            false
        });
        gone
    }

    /// Drain the blocks longer than `min_len` (of `class` only, if given) from every thread
    /// cache, by (stream, class index): each block goes back to the sub-allocator of its
    /// class ([`Class::of`] its tag and length).
    pub(crate) fn drain_above(
        &self,
        min_len: u64,
        class: Option<Class>,
        huge_min: u64,
    ) -> Vec<((u64, usize), Vec<u64>)> {
        let mut blocks = Vec::new();
        for slot in self.caches.lock().iter() {
            slot.lock()
                .records
                .drain_free(min_len, class, huge_min, &mut blocks);
        }
        blocks
    }

    /// [`Self::drain_above`] of the calling thread's cache only.
    pub(crate) fn drain_own_above(
        self: &Arc<Self>,
        min_len: u64,
        class: Option<Class>,
        huge_min: u64,
    ) -> Vec<((u64, usize), Vec<u64>)> {
        self.with_cache(|cache| {
            let mut blocks = Vec::new();
            cache
                .records
                .drain_free(min_len, class, huge_min, &mut blocks);
            Some(blocks)
        })
        .unwrap_or_default()
    }

    /// [`ThreadRecords::take_run`] in the calling thread's cache.
    pub(crate) fn take_own_run(
        self: &Arc<Self>,
        stream: u64,
        class: Class,
        huge_min: u64,
        need: u64,
        beside: impl Fn(u64) -> Option<Beside>,
    ) -> Vec<u64> {
        self.with_cache(|cache| {
            Some(
                cache
                    .records
                    .take_run(stream, class, huge_min, need, beside),
            )
        })
        .unwrap_or_default()
    }

    /// The allocated and requested bytes as the calling thread sees them (the base plus its
    /// cache's changes: exact with one thread), for the gauges.
    pub(crate) fn seen_bytes(self: &Arc<Self>) -> [u64; 2] {
        let own = self.with_cache(|c| Some((c.allocated, c.requested)));
        let (allocated, requested) = own.unwrap_or((0, 0));
        let b = &self.hot.bytes;
        [
            seen_value(b.allocated.load(Relaxed).wrapping_add(allocated)),
            seen_value(b.requested.load(Relaxed).wrapping_add(requested)),
        ]
    }

    /// Count the end of an allocation of `len` bytes, under the device lock.
    pub(crate) fn sub_bytes(&self, len: u64, requested: u64) {
        self.hot.bytes.allocated.fetch_sub(len, Relaxed);
        self.hot.bytes.requested.fetch_sub(requested, Relaxed);
    }

    /// Allocated bytes, requested bytes, and their peaks: exact given every cache locked
    /// ([`LockedCaches::lock`]). The exact values raise the peaks first (so a peak is never
    /// below a value read).
    pub(crate) fn byte_counts(&self, caches: &[SpinGuard<'_, ThreadCache>]) -> [u64; 4] {
        let b = &self.hot.bytes;
        let mut allocated = b.allocated.load(Relaxed);
        let mut requested = b.requested.load(Relaxed);
        for c in caches {
            allocated = allocated.wrapping_add(c.allocated);
            requested = requested.wrapping_add(c.requested);
        }
        self.raise_peaks([allocated, requested]);
        [
            allocated,
            requested,
            b.peak_allocated.load(Relaxed),
            b.peak_requested.load(Relaxed),
        ]
    }

    pub(crate) fn set_asleep_tags(&self, mask: u64) {
        self.hot.gates.asleep_tags.store(mask, Relaxed);
    }

    pub(crate) fn set_history(&self, on: bool) {
        self.hot.gates.history.store(on, Relaxed);
    }
}

/// What a free found in one cache.
enum FreeStep {
    /// Freed into the cache; the allocated and requested bytes as seen.
    Freed([u64; 2]),
    /// Recorded there, but not the front's to free (the device lock's path frees it).
    Declined,
    /// Not recorded there.
    Absent,
}

/// What the caches of exited threads held ([`Front::take_gone`]).
#[derive(Debug, Default)]
pub(crate) struct Gone {
    /// Cached blocks by (stream, class index).
    pub(crate) blocks: Vec<((u64, usize), Vec<u64>)>,
    /// Live records (allocations those threads made, not freed yet).
    pub(crate) live: Vec<(u64, FrontLive)>,
    pub(crate) counts: Counts,
}

/// The registry's caches, for [`LockedCaches::lock`].
pub(crate) struct LockedCaches<'a> {
    slots: parking_lot::MutexGuard<'a, Vec<Arc<CacheSlot>>>,
}

impl LockedCaches<'_> {
    /// Lock every cache, in registry order.
    pub(crate) fn lock(&self) -> Vec<SpinGuard<'_, ThreadCache>> {
        self.slots.iter().map(|s| s.lock()).collect()
    }
}

#[cfg(test)]
#[path = "thread_cache_tests.rs"]
mod tests;
