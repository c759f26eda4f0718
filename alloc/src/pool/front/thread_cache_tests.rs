//! Tests of the thread front (`pool/front/thread_cache.rs`): its layout and its caches through a pool.

#![allow(clippy::unwrap_used)]
use std::sync::Arc;

use crate::backend::sim::{SimBackend, SimConfig};
use crate::{Pool, PoolConfig, StreamId};

const MIB: u64 = 1 << 20;

fn pool() -> Pool {
    let sim = Arc::new(SimBackend::new(SimConfig::default()).unwrap());
    let config = PoolConfig {
        arena_size: 64 * MIB,
        validate: true,
        ..PoolConfig::default()
    };
    Pool::new(sim, config).unwrap()
}

/// The fields a warm allocation or free touches lie on the cache slot's first two cache
/// lines, the lock's flag and the counts with the records' remembered list on the
/// first, the record map, the free lists and the free bytes on the second.
#[test]
fn thread_cache_fields_a_fast_operation_touches_fill_two_lines() {
    use super::{CacheSlot, ThreadCache};
    use std::mem::{offset_of, size_of};
    assert_eq!(std::mem::align_of::<CacheSlot>(), 128);
    // The value behind the flag (a `repr(C)` lock: flag, then value).
    let value = super::super::spin::value_offset::<ThreadCache>();
    assert!(value <= 8, "lock value at {value}");
    let records = value + offset_of!(ThreadCache, records);
    let (memo_end, hot_end) = super::super::thread_records::hot_field_ends();
    assert!(value + offset_of!(ThreadCache, requested) + size_of::<u64>() <= records);
    assert!(
        records + memo_end <= 64,
        "first line ends at {}",
        records + memo_end
    );
    assert!(
        records + hot_end <= 128,
        "second line ends at {}",
        records + hot_end
    );
}

/// A device's front and its allocated and requested gauges (the first two of its
/// metrics) lie on the device pool's first cache line.
#[test]
fn device_pool_fields_a_fast_operation_reads_share_a_line() {
    use std::mem::{align_of, offset_of, size_of};
    type DevicePool = crate::pool::state::pool::DevicePool;
    assert_eq!(align_of::<DevicePool>(), 64);
    assert_eq!(offset_of!(DevicePool, front), 0);
    assert!(offset_of!(DevicePool, metrics) + 2 * size_of::<metrics::Gauge>() <= 64);
}

/// After the first pair, a pair on the same stream is served by the thread cache: the
/// device's own counters do not move.
#[test]
fn a_warm_pair_stays_in_the_thread_cache() {
    let pool = pool();
    let s = StreamId(7);
    let a = pool.alloc(0, 2 * MIB, s).unwrap();
    pool.free(a.ptr).unwrap();
    let central = pool.devices[0].state.lock().stats;
    for _ in 0..3 {
        let b = pool.alloc(0, 2 * MIB, s).unwrap();
        assert_eq!(b.ptr, a.ptr);
        pool.free(b.ptr).unwrap();
    }
    assert_eq!(pool.devices[0].state.lock().stats, central);
    let stats = pool.stats(0).unwrap();
    assert_eq!(
        (stats.alloc_count, stats.free_count, stats.allocations),
        (4, 4, 0)
    );
    assert_eq!(stats.peak_allocated_bytes, 2 * MIB);
}

/// Threads on their own streams stay in their caches: once each thread's block has a
/// place (the first pairs may take the device lock more than once each: a miss that
/// would grow an arena first takes back the thread caches' blocks), the device lock's
/// path allocates nothing.
#[test]
fn concurrent_warm_pairs_take_no_device_lock() {
    use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
    const MAX_WARM_ROUNDS: usize = 64;
    let pool = pool();
    // Room for more than the four blocks, as a program's arena has: with exactly four
    // blocks' worth, a miss that settles hands a thread's range to another stream, and
    // the threads can keep taking each other's ranges (noted in docs/STATUS.md).
    let room = pool.alloc(0, 32 * MIB, StreamId(9)).unwrap();
    pool.free(room.ptr).unwrap();
    // No thread exits before all finished their pairs: an exited thread's cache counts
    // are folded into the device's by the next operation under the device lock (another
    // thread's first allocation, on a loaded machine), which read as device-lock pairs.
    let (round, done) = (std::sync::Barrier::new(5), std::sync::Barrier::new(5));
    let warm = AtomicBool::new(false);
    let central = || pool.devices[0].state.lock().stats.alloc_count;
    let (warmed, rounds) = std::thread::scope(|s| {
        for t in 0..4u64 {
            let (pool, round, done, warm) = (&pool, &round, &done, &warm);
            s.spawn(move || {
                // Warm-up rounds until one takes no device-lock allocation.
                loop {
                    let a = pool.alloc(0, 2 * MIB, StreamId(t + 1)).unwrap();
                    pool.free(a.ptr).unwrap();
                    round.wait();
                    round.wait();
                    if warm.load(Relaxed) {
                        break;
                    }
                }
                for _ in 0..2000 {
                    let a = pool.alloc(0, 2 * MIB, StreamId(t + 1)).unwrap();
                    pool.free(a.ptr).unwrap();
                }
                done.wait();
            });
        }
        let (mut before, mut rounds) = (central(), 0);
        loop {
            round.wait();
            rounds += 1;
            let now = central();
            let settled = now == before && rounds > 1;
            warm.store(settled || rounds >= MAX_WARM_ROUNDS, Relaxed);
            before = now;
            round.wait();
            if settled || rounds >= MAX_WARM_ROUNDS {
                break;
            }
        }
        done.wait();
        (before, rounds)
    });
    assert!(rounds < MAX_WARM_ROUNDS, "warm-up never settled");
    assert_eq!(central(), warmed);
    let stats = pool.stats(0).unwrap();
    let pairs = 4 * (2000 + rounds as u64) + 1;
    assert_eq!((stats.alloc_count, stats.free_count), (pairs, pairs));
}

/// Small and large blocks cached by a thread go back to their own class's sub-allocator
/// when a miss drains the thread caches, and `empty_cache` then releases every arena
/// (`validate` runs after each operation: a block given to the wrong class's ranges
/// would fail it).
#[test]
fn drained_blocks_go_back_to_their_class() {
    let pool = pool();
    let s = StreamId(3);
    let small = pool.alloc(0, 64 << 10, s).unwrap();
    let large = pool.alloc(0, 4 * MIB, s).unwrap();
    pool.free(small.ptr).unwrap();
    pool.free(large.ptr).unwrap();
    // An exact-size hit stays in its class.
    let again = pool.alloc(0, 64 << 10, s).unwrap();
    assert_eq!(again.ptr, small.ptr);
    pool.free(again.ptr).unwrap();
    // A large miss: the cached blocks go back to their ranges before the pool grows.
    let big = pool.alloc(0, 62 * MIB, s).unwrap();
    pool.free(big.ptr).unwrap();
    pool.validate(0).unwrap();
    pool.empty_cache(Some(0)).unwrap();
    let st = pool.stats(0).unwrap();
    assert_eq!((st.reserved_bytes, st.allocations), (0, 0));
}

/// Sleeping one tag gates only that tag's fast path: another tag's warm pairs stay in
/// the thread cache.
#[test]
fn sleeping_one_tag_keeps_the_others_fast_path() {
    let pool = pool();
    let s = StreamId(5);
    crate::tags::set_current(Some("tc_gate_a")).unwrap();
    let a = pool.alloc(0, 2 * MIB, s).unwrap();
    pool.free(a.ptr).unwrap();
    crate::tags::set_current(Some("tc_gate_b")).unwrap();
    let b = pool.alloc(0, 64 << 10, s).unwrap();
    pool.free(b.ptr).unwrap();
    let ta = crate::tags::lookup("tc_gate_a").unwrap();
    pool.sleep_tags(Some(0), Some(&[ta]), &[]).unwrap();
    // Tag b: one pair under the device lock (sleep drained the caches), then the
    // thread cache serves it.
    let b = pool.alloc(0, 64 << 10, s).unwrap();
    pool.free(b.ptr).unwrap();
    let central = pool.devices[0].state.lock().stats;
    for _ in 0..3 {
        let c = pool.alloc(0, 64 << 10, s).unwrap();
        assert_eq!(c.ptr, b.ptr);
        pool.free(c.ptr).unwrap();
    }
    assert_eq!(pool.devices[0].state.lock().stats, central);
    // Tag a sleeps: refused, from the cache too.
    crate::tags::set_current(Some("tc_gate_a")).unwrap();
    assert!(pool.alloc(0, 2 * MIB, s).is_err());
    pool.wake(Some(0), None).unwrap();
    let a = pool.alloc(0, 2 * MIB, s).unwrap();
    pool.free(a.ptr).unwrap();
    crate::tags::set_current(None).unwrap();
    pool.validate(0).unwrap();
}

/// With growing arenas a block above 2 MiB goes back to its arena on free, unless the free
/// finds the device lock contended: then it is cached, and so are the next
/// `LARGE_CREDIT` frees of such blocks on that thread.
#[test]
fn large_blocks_of_a_growing_pool_are_cached_only_after_contention() {
    let sim = Arc::new(SimBackend::new(SimConfig::default()).unwrap());
    let sim_backend: Arc<dyn crate::Backend> = sim.clone();
    let config = PoolConfig {
        grow_arenas: true,
        validate: true,
        ..PoolConfig::default()
    };
    let pool = Pool::new(sim_backend, config).unwrap();
    let dp = &pool.devices[0];
    let s = StreamId(3);
    let len = 16 * MIB;
    let a = pool.alloc(0, len, s).unwrap();
    assert!(
        dp.front.try_free(a.ptr, None, || false).is_none(),
        "uncontended: declined"
    );
    pool.free(a.ptr).unwrap();
    let b = pool.alloc(0, len, s).unwrap();
    assert!(
        dp.front.try_free(b.ptr, None, || true).is_some(),
        "contended: cached"
    );
    let mut held = b.ptr;
    for _ in 0..super::LARGE_CREDIT {
        let (ptr, _) = dp.front.try_alloc(s.0, len, 0, len).expect("a hit");
        assert_eq!(ptr, held);
        held = ptr;
        pool.free(ptr).unwrap();
    }
    let (last, _) = dp
        .front
        .try_alloc(s.0, len, 0, len)
        .expect("the last credit's block");
    assert!(
        dp.front.try_free(last, None, || false).is_none(),
        "credits spent"
    );
    pool.free(last).unwrap();
    assert!(
        dp.front.try_alloc(s.0, len, 0, len).is_none(),
        "back in its arena"
    );
    pool.validate(0).unwrap();
    pool.empty_cache(None).unwrap();
    assert!(sim.is_clean(0), "{:?}", sim.ledger(0));
}
