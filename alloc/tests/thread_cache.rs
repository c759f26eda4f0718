//! The pool's thread front (`pool/front/thread_cache.rs`) on the sim backend: per-thread caches
//! and the live records they keep.
//!
//! - a multi-thread stress: threads on their own and on a shared stream allocate, free
//!   their own allocations and each other's (cross-thread frees), `record_stream` and
//!   `free_checked`, while a checker thread validates, reads stats and empties the cache
//!   concurrently; a ledger of live ranges proves that no block is handed out twice, and at
//!   the end the counters add up and every byte goes back;
//! - a thread's cache comes back when the thread exits (its blocks, its live records);
//! - `empty_cache` drains the caches of live threads; `sleep` drains and gates them;
//! - a block freed on another thread goes back to the cache that recorded it and is reused
//!   on its stream.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier};

use gpu_arena::backend::sim::{SimBackend, SimConfig};
use gpu_arena::pool::CACHE_MAX_BLOCK;
use gpu_arena::{tags, Error, Pool, StreamId};
use parking_lot::Mutex;

mod common;
use common::{sim_pool, stress_ops, Rng};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const THREADS: u64 = 4;
/// Operations per thread in the stress (`GPU_ARENA_STRESS_OPS` overrides it, as for
/// `stress.rs`).
const OPS: u64 = 20_000;

const SHARED_STREAM: StreamId = StreamId(0x5000);

fn pool(validate: bool) -> (Arc<SimBackend>, Pool) {
    sim_pool(SimConfig::default(), 32 * MIB, validate)
}

/// Live ranges handed out, `start -> end`: an allocation that overlaps one is a block
/// handed out twice.
#[derive(Default)]
struct Ledger(Mutex<BTreeMap<u64, u64>>);

impl Ledger {
    fn add(&self, ptr: u64, bytes: u64) {
        let mut m = self.0.lock();
        if let Some((&s, &e)) = m.range(..=ptr).next_back() {
            assert!(
                e <= ptr,
                "[{ptr:#x}, +{bytes}) handed out inside live [{s:#x}, {e:#x})"
            );
        }
        if let Some((&s, _)) = m.range(ptr..).next() {
            assert!(
                s >= ptr + bytes,
                "[{ptr:#x}, +{bytes}) overlaps live {s:#x}"
            );
        }
        m.insert(ptr, ptr + bytes);
    }

    /// Before the pool's free: once freed, another thread may be handed the range.
    fn remove(&self, ptr: u64) {
        assert!(self.0.lock().remove(&ptr).is_some(), "{ptr:#x} not live");
    }
}

/// A few sizes (so that caches hit), some odd ones, some large.
fn size(rng: &mut Rng) -> u64 {
    match rng.below(8) {
        0 => 2 * MIB,
        1 => 1 + rng.below(3 * MIB),
        2 | 3 => [512, 4 * KIB, 24 * KIB, 256 * KIB][rng.below(4) as usize],
        _ => 1 + rng.below(64 * KIB),
    }
}

struct Shared {
    ledger: Ledger,
    /// Allocations handed to other threads to free: (ptr, requested).
    handoff: Mutex<Vec<(u64, u64)>>,
    allocs: AtomicU64,
    frees: AtomicU64,
}

fn free_one(pool: &Pool, sh: &Shared, rng: &mut Rng, ptr: u64, requested: u64) {
    sh.ledger.remove(ptr);
    if rng.below(4) == 0 {
        pool.free_checked(ptr, requested, 0).unwrap();
    } else {
        pool.free(ptr).unwrap();
    }
    sh.frees.fetch_add(1, Ordering::Relaxed);
}

fn worker(pool: &Pool, sh: &Shared, t: u64) {
    let mut rng = Rng(0x9E37_79B9 ^ ((t + 1) * 0x1234_5678_9ABC));
    let own = StreamId(t + 1);
    let mut live: Vec<(u64, u64)> = Vec::new();
    for _ in 0..stress_ops(OPS) {
        match rng.below(10) {
            0..=4 if live.len() < 32 => {
                let stream = if rng.below(4) == 0 {
                    SHARED_STREAM
                } else {
                    own
                };
                let bytes = size(&mut rng);
                let a = pool.alloc(0, bytes, stream).unwrap();
                sh.ledger.add(a.ptr, a.bytes);
                sh.allocs.fetch_add(1, Ordering::Relaxed);
                if rng.below(16) == 0 {
                    // Promoted out of the front; freed under the device lock with an event.
                    let other = StreamId(0x6000 + rng.below(3));
                    pool.record_stream(a.ptr, other).unwrap();
                }
                if rng.below(6) == 0 {
                    sh.handoff.lock().push((a.ptr, bytes));
                } else {
                    live.push((a.ptr, bytes));
                }
            }
            5 => {
                let theirs = sh.handoff.lock().pop();
                if let Some((ptr, requested)) = theirs {
                    free_one(pool, sh, &mut rng, ptr, requested);
                }
            }
            _ if !live.is_empty() => {
                let i = rng.below(live.len() as u64) as usize;
                let (ptr, requested) = live.swap_remove(i);
                free_one(pool, sh, &mut rng, ptr, requested);
            }
            _ => {}
        }
    }
    for (ptr, requested) in live {
        free_one(pool, sh, &mut rng, ptr, requested);
    }
}

/// No block is handed out twice while threads allocate, free each other's blocks, promote
/// some with `record_stream`, and a checker validates, reads stats and empties the cache;
/// at the end the counters add up and every byte goes back.
#[test]
fn threads_hand_out_no_block_twice_and_the_counters_add_up() {
    let (sim, pool) = pool(false);
    let sh = Shared {
        ledger: Ledger::default(),
        handoff: Mutex::new(Vec::new()),
        allocs: AtomicU64::new(0),
        frees: AtomicU64::new(0),
    };
    let done = AtomicBool::new(false);
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..THREADS)
            .map(|t| {
                let (pool, sh) = (&pool, &sh);
                s.spawn(move || worker(pool, sh, t))
            })
            .collect();
        s.spawn(|| {
            let mut round = 0u64;
            while !done.load(Ordering::Relaxed) {
                pool.validate(0).unwrap();
                let st = pool.stats(0).unwrap();
                assert!(st.allocated_bytes <= st.reserved_bytes);
                assert!(st.requested_bytes <= st.allocated_bytes);
                assert!(st.peak_allocated_bytes >= st.allocated_bytes);
                if round % 4 == 0 {
                    pool.empty_cache(Some(0)).unwrap();
                }
                round += 1;
                std::thread::yield_now();
            }
        });
        for w in workers {
            w.join().unwrap();
        }
        done.store(true, Ordering::Relaxed);
    });
    let mut rng = Rng(7);
    for (ptr, requested) in std::mem::take(&mut *sh.handoff.lock()) {
        free_one(&pool, &sh, &mut rng, ptr, requested);
    }
    assert!(sh.ledger.0.lock().is_empty());
    pool.validate(0).unwrap();
    // Frees of record_stream'd blocks wait for events: empty_cache synchronizes.
    pool.empty_cache(None).unwrap();
    let n = sh.allocs.load(Ordering::Relaxed);
    assert_eq!(n, sh.frees.load(Ordering::Relaxed));
    let st = pool.stats(0).unwrap();
    assert_eq!(
        (st.allocations, st.allocated_bytes, st.requested_bytes),
        (0, 0, 0)
    );
    assert_eq!((st.alloc_count, st.free_count), (n, n));
    assert_eq!(st.pending_free_bytes, 0);
    assert_eq!((st.reserved_bytes, st.arenas), (0, 0));
    assert_eq!(sim.ledger(0).held_bytes, 0);
}

/// A thread that exits leaves cached blocks and a live allocation in its cache: the live
/// one can still be freed (by another thread), the counts stay exact, and every block
/// comes back (empty_cache releases every arena).
#[test]
fn an_exited_threads_cache_comes_back() {
    let (sim, pool) = pool(true);
    let kept = std::thread::scope(|s| {
        s.spawn(|| {
            let s1 = StreamId(1);
            let blocks: Vec<u64> = (0..4)
                .map(|_| pool.alloc(0, 2 * MIB, s1).unwrap().ptr)
                .collect();
            for p in blocks {
                pool.free(p).unwrap();
            }
            let kept = pool.alloc(0, MIB, s1).unwrap().ptr;
            let reused = pool.alloc(0, 2 * MIB, s1).unwrap().ptr;
            pool.free(reused).unwrap();
            kept
        })
        .join()
        .unwrap()
    });
    let st = pool.stats(0).unwrap();
    assert_eq!((st.allocations, st.alloc_count, st.free_count), (1, 6, 5));
    assert_eq!(st.allocated_bytes, MIB);
    assert_eq!(st.peak_allocated_bytes, 8 * MIB);
    // An operation under the device lock takes the exited thread's cache back.
    let other = pool.alloc(0, 3 * MIB, StreamId(2)).unwrap().ptr;
    pool.free(kept).unwrap();
    pool.free(other).unwrap();
    let st = pool.stats(0).unwrap();
    assert_eq!((st.allocations, st.alloc_count, st.free_count), (0, 7, 7));
    pool.empty_cache(None).unwrap();
    assert_eq!(pool.stats(0).unwrap().reserved_bytes, 0);
    assert_eq!(sim.ledger(0).held_bytes, 0);
}

/// `empty_cache` drains the cache of a thread that is alive and idle.
#[test]
fn empty_cache_drains_a_live_threads_cache() {
    let (sim, pool) = pool(true);
    let (filled, drained) = (Barrier::new(2), Barrier::new(2));
    std::thread::scope(|s| {
        s.spawn(|| {
            let p = pool.alloc(0, 2 * MIB, StreamId(1)).unwrap().ptr;
            pool.free(p).unwrap();
            filled.wait();
            drained.wait();
            // The cache is empty now: this comes from a fresh arena.
            let q = pool.alloc(0, 2 * MIB, StreamId(1)).unwrap().ptr;
            pool.free(q).unwrap();
        });
        filled.wait();
        assert_eq!(pool.empty_cache(Some(0)).unwrap(), 32 * MIB);
        assert_eq!(sim.ledger(0).held_bytes, 0);
        drained.wait();
    });
    assert_eq!(pool.stats(0).unwrap().backend_creates, 2);
}

/// A sleeping tag's blocks are not handed out from a thread cache, and a wake lets the tag
/// allocate again.
#[test]
fn sleep_drains_and_gates_thread_caches() {
    let (_sim, pool) = pool(true);
    tags::set_current(Some("tc_sleep")).unwrap();
    let p = pool.alloc(0, 2 * MIB, StreamId(1)).unwrap().ptr;
    pool.free(p).unwrap();
    pool.sleep(Some(0), &[]).unwrap();
    let e = pool.alloc(0, 2 * MIB, StreamId(1)).unwrap_err();
    assert!(matches!(e, Error::InvalidState(_)), "{e}");
    pool.wake(Some(0), None).unwrap();
    let q = pool.alloc(0, 2 * MIB, StreamId(1)).unwrap().ptr;
    pool.free(q).unwrap();
    tags::set_current(None).unwrap();
}

/// A block freed on another thread goes to the cache that recorded it and is reused there,
/// on its stream only.
#[test]
fn a_block_freed_on_another_thread_returns_to_its_cache() {
    let (_sim, pool) = pool(true);
    let s1 = StreamId(1);
    let p = pool.alloc(0, 2 * MIB, s1).unwrap().ptr;
    std::thread::scope(|s| {
        s.spawn(|| pool.free(p).unwrap());
    });
    // Another stream does not get it while it waits for no event...
    let q = pool.alloc(0, 2 * MIB, StreamId(2)).unwrap().ptr;
    assert_ne!(q, p);
    // ...its own stream does.
    assert_eq!(pool.alloc(0, 2 * MIB, s1).unwrap().ptr, p);
    pool.free(p).unwrap();
    pool.free(q).unwrap();
    let st = pool.stats(0).unwrap();
    assert_eq!((st.allocations, st.alloc_count, st.free_count), (0, 3, 3));
}

/// With several devices, `free` finds the device of a pointer held by this thread's cache,
/// by another thread's, or by the device's map (after `record_stream`).
#[test]
fn frees_find_their_device_among_several() {
    let (_sim, pool) = sim_pool(
        SimConfig {
            devices: 3,
            ..SimConfig::default()
        },
        32 * MIB,
        true,
    );
    let s = StreamId(1);
    let ptrs: Vec<u64> = (0..3)
        .flat_map(|d| (0..2).map(move |_| d))
        .map(|d| pool.alloc(d, 2 * MIB, s).unwrap().ptr)
        .collect();
    pool.record_stream(ptrs[5], StreamId(2)).unwrap();
    pool.free(ptrs[0]).unwrap();
    pool.free(ptrs[3]).unwrap();
    std::thread::scope(|sc| {
        sc.spawn(|| {
            for &p in &[ptrs[1], ptrs[2], ptrs[4], ptrs[5]] {
                pool.free(p).unwrap();
            }
        });
    });
    assert!(pool.free(ptrs[0]).is_err());
    pool.empty_cache(None).unwrap();
    for d in 0..3 {
        let st = pool.stats(d).unwrap();
        assert_eq!(
            (st.allocations, st.alloc_count, st.free_count),
            (0, 2, 2),
            "device {d}"
        );
        assert_eq!(st.reserved_bytes, 0);
    }
}

/// Frees the thread caches decline (blocks above `CACHE_MAX_BLOCK`) go under the device
/// lock, from this thread and from another, and the pool stays consistent (`validate`
/// after every operation); a double free of a freed block, and a free with the wrong size,
/// are errors that change nothing. A thread cache takes any number of cacheable blocks
/// (it has no byte bound: the flush before growth bounds it).
#[test]
fn frees_past_the_thread_cache_stay_consistent() {
    let (_sim, pool) = pool(true);
    let s = StreamId(1);
    let big = CACHE_MAX_BLOCK + 2 * MIB;
    let ptrs: Vec<u64> = (0..8).map(|_| pool.alloc(0, big, s).unwrap().ptr).collect();
    let (mine, theirs) = ptrs.split_at(4);
    // A wrong size first: refused, the allocation still live.
    assert!(pool.free_checked(mine[0], MIB, 0).is_err());
    for &p in mine {
        pool.free(p).unwrap();
    }
    std::thread::scope(|sc| {
        sc.spawn(|| {
            for &p in theirs {
                pool.free(p).unwrap();
            }
        });
    });
    let before = pool.stats(0).unwrap();
    assert_eq!((before.allocations, before.free_count), (0, 8));
    for &p in [mine[3], theirs[3]].iter() {
        assert!(pool.free(p).is_err());
        assert!(pool.free_checked(p, big, 0).is_err());
    }
    assert_eq!(pool.stats(0).unwrap(), before);
    // Many cacheable blocks all stay in this thread's cache: the next allocations of
    // their size reuse them without growing the pool.
    let small: Vec<u64> = (0..64)
        .map(|_| pool.alloc(0, 2 * MIB, s).unwrap().ptr)
        .collect();
    for &p in &small {
        pool.free(p).unwrap();
    }
    let reserved = pool.stats(0).unwrap().reserved_bytes;
    let again: Vec<u64> = (0..64)
        .map(|_| pool.alloc(0, 2 * MIB, s).unwrap().ptr)
        .collect();
    let mut sorted = (small.clone(), again.clone());
    sorted.0.sort_unstable();
    sorted.1.sort_unstable();
    assert_eq!(sorted.0, sorted.1, "the cached blocks came back");
    assert_eq!(pool.stats(0).unwrap().reserved_bytes, reserved);
    for p in again {
        pool.free(p).unwrap();
    }
    pool.validate(0).unwrap();
    pool.empty_cache(Some(0)).unwrap();
    let st = pool.stats(0).unwrap();
    assert_eq!((st.allocations, st.reserved_bytes), (0, 0));
}

/// A thread cache has no byte bound, so the flush before growth is what bounds it: blocks
/// that a live thread holds in its cache are taken back when another thread would otherwise
/// grow the pool, and that thread's allocations fit in them (no new arena).
#[test]
fn another_threads_cached_blocks_are_used_before_the_pool_grows() {
    let (_sim, pool) = pool(true);
    let s = StreamId(1);
    let n = 64;
    let (freed, done) = (Barrier::new(2), Barrier::new(2));
    std::thread::scope(|sc| {
        sc.spawn(|| {
            let ptrs: Vec<u64> = (0..n)
                .map(|_| pool.alloc(0, 2 * MIB, s).unwrap().ptr)
                .collect();
            for p in ptrs {
                pool.free(p).unwrap();
            }
            freed.wait();
            // Alive (its cache too) until the other thread has allocated.
            done.wait();
        });
        freed.wait();
        let reserved = pool.stats(0).unwrap().reserved_bytes;
        assert!(reserved >= n * 2 * MIB);
        let mine: Vec<u64> = (0..n)
            .map(|_| pool.alloc(0, 2 * MIB, s).unwrap().ptr)
            .collect();
        assert_eq!(
            pool.stats(0).unwrap().reserved_bytes,
            reserved,
            "the pool grew"
        );
        for p in mine {
            pool.free(p).unwrap();
        }
        done.wait();
    });
    pool.validate(0).unwrap();
}

/// The peaks never count bytes another thread has freed: blocks allocated on this thread
/// and freed on another leave that thread's change negative; an allocation here must not
/// see the freed bytes as still allocated (it raised the peak to 22 MiB against a true
/// 20 MiB before negative changes were folded at once).
#[test]
fn peaks_do_not_count_bytes_freed_on_another_thread() {
    let (_sim, pool) = pool(false);
    let s1 = StreamId(1);
    let blocks: Vec<u64> = (0..10)
        .map(|_| pool.alloc(0, 2 * MIB, s1).unwrap().ptr)
        .collect();
    std::thread::scope(|s| {
        s.spawn(|| {
            for &p in &blocks {
                pool.free(p).unwrap();
            }
        });
    });
    let q = pool.alloc(0, 4 * MIB, StreamId(2)).unwrap().ptr;
    let st = pool.stats(0).unwrap();
    assert_eq!(st.allocated_bytes, 4 * MIB);
    assert_eq!(st.peak_allocated_bytes, 20 * MIB, "peak counts freed bytes");
    assert_eq!(st.peak_requested_bytes, 20 * MIB);
    pool.free(q).unwrap();
}

/// With several threads allocating and freeing each other's blocks (one operation at a
/// time, so the true requested bytes are known after each), the peak never exceeds the
/// true peak: a peak raised with bytes another thread already freed would.
#[test]
fn peaks_never_exceed_the_true_peak_across_threads() {
    let (_sim, pool) = pool(false);
    const SIZES: [u64; 8] = [
        512,
        4 * KIB,
        300_000,
        MIB,
        2 * MIB,
        3 * MIB + 7,
        16 * MIB,
        64 * MIB,
    ];
    #[derive(Default)]
    struct Truth {
        live: Vec<(u64, u64, u64)>,
        requested: u64,
        peak_requested: u64,
        allocated: u64,
        peak_allocated: u64,
    }
    let truth = Mutex::new(Truth::default());
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let (pool, truth) = (&pool, &truth);
            s.spawn(move || {
                let mut rng = Rng(0x9e37 + t);
                for i in 0..4000u64 {
                    let mut g = truth.lock();
                    if g.live.len() < 24 && (g.live.is_empty() || rng.next() % 2 == 0) {
                        let n = SIZES[((rng.next() + i) % SIZES.len() as u64) as usize];
                        let a = pool.alloc(0, n, StreamId(1 + t)).unwrap();
                        g.live.push((a.ptr, n, a.bytes));
                        g.requested += n;
                        g.peak_requested = g.peak_requested.max(g.requested);
                        g.allocated += a.bytes;
                        g.peak_allocated = g.peak_allocated.max(g.allocated);
                    } else {
                        let k = (rng.next() % g.live.len() as u64) as usize;
                        let (p, n, bytes) = g.live.swap_remove(k);
                        pool.free(p).unwrap();
                        g.requested -= n;
                        g.allocated -= bytes;
                    }
                }
            });
        }
    });
    let g = truth.lock();
    let st = pool.stats(0).unwrap();
    assert_eq!(
        (st.requested_bytes, st.allocated_bytes),
        (g.requested, g.allocated)
    );
    assert!(
        st.peak_requested_bytes <= g.peak_requested && st.peak_allocated_bytes <= g.peak_allocated,
        "peaks requested {} / allocated {} above the true {} / {}",
        st.peak_requested_bytes,
        st.peak_allocated_bytes,
        g.peak_requested,
        g.peak_allocated
    );
}
