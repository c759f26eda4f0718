//! A call that synchronizes the device (`empty_cache`, `trim`, `sleep`) checks that no
//! allocations are routed to a graph pool (a capture may be under way: the synchronize would
//! invalidate it), then synchronizes with the device lock released. A capture begun on
//! another thread between the two was invalidated by that synchronize; now
//! `graph_pool_begin` waits until the call is done, as PyTorch's `beginAllocateToPool` waits
//! for the mutex its `emptyCache` holds across the synchronize. Here the other thread's
//! `graph_pool_begin` runs inside the sim's synchronize (`SimBackend::run_during_next`), so
//! the race happens every time.
#![allow(clippy::unwrap_used)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use gpu_arena::backend::sim::{SimBackend, SimCall, SimConfig};
use gpu_arena::{GraphPoolId, Pool, PoolConfig, StreamId};

const MIB: u64 = 1 << 20;
const G: GraphPoolId = GraphPoolId(0, 1);
const S: StreamId = StreamId(7);

/// The other thread's `graph_pool_begin`, handed out of the synchronize it ran in.
type Other = Arc<std::sync::Mutex<Option<std::thread::JoinHandle<gpu_arena::Result<u32>>>>>;

fn pool() -> (Arc<SimBackend>, Arc<Pool>) {
    let sim = Arc::new(SimBackend::new(SimConfig::default()).unwrap());
    let config = PoolConfig {
        validate: true,
        ..PoolConfig::default()
    };
    (sim.clone(), Arc::new(Pool::new(sim, config).unwrap()))
}

/// Inside the next synchronize: another thread calls `graph_pool_begin`; the synchronize
/// goes on only once that call either returned (the race: a capture open during the
/// synchronize) or has been seen waiting for 50 ms. Returns the other thread and whether its
/// begin returned inside the synchronize.
fn begin_during_next_sync(sim: &SimBackend, pool: &Arc<Pool>) -> (Other, Arc<AtomicBool>) {
    let begun_inside = Arc::new(AtomicBool::new(false));
    let other = Arc::new(std::sync::Mutex::new(None));
    let (p, inside, o) = (pool.clone(), begun_inside.clone(), other.clone());
    sim.run_during_next(SimCall::Synchronize, move || {
        let returned = Arc::new(AtomicBool::new(false));
        let r = returned.clone();
        let t = std::thread::spawn(move || {
            let got = p.graph_pool_begin(0, G);
            r.store(true, Ordering::SeqCst);
            got
        });
        let deadline = std::time::Instant::now() + Duration::from_millis(50);
        while !returned.load(Ordering::SeqCst) && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        inside.store(returned.load(Ordering::SeqCst), Ordering::SeqCst);
        *o.lock().unwrap() = Some(t);
    });
    (other, begun_inside)
}

/// What every case checks after the synchronizing call returned: the other thread's begin
/// was not granted inside the synchronize, and is granted now (its context then closes).
fn check_and_close(pool: &Pool, other: &Other, begun_inside: &AtomicBool, what: &str) {
    let t = other
        .lock()
        .unwrap()
        .take()
        .expect("the step ran in a synchronize");
    assert!(
        !begun_inside.load(Ordering::SeqCst),
        "{what}: a graph pool context opened while {what} synchronized the device"
    );
    assert_eq!(t.join().unwrap().unwrap(), 1, "{what}: begun after it");
    pool.graph_pool_end(0, G).unwrap();
    pool.graph_pool_release(0, G).unwrap();
    pool.validate(0).unwrap();
}

#[test]
fn no_capture_begins_while_empty_cache_synchronizes() {
    let (sim, pool) = pool();
    let a = pool.alloc(0, 4 * MIB, S).unwrap();
    pool.free(a.ptr).unwrap();
    let (other, inside) = begin_during_next_sync(&sim, &pool);
    pool.empty_cache(Some(0)).unwrap();
    check_and_close(&pool, &other, &inside, "empty_cache");
    pool.empty_cache(None).unwrap();
    assert!(sim.is_clean(0), "{:?}", sim.ledger(0));
}

#[test]
fn no_capture_begins_while_trim_synchronizes() {
    let (sim, pool) = pool();
    let keep = pool.alloc(0, 64 << 10, S).unwrap();
    let gone = pool.alloc(0, 8 * MIB, S).unwrap();
    pool.free(gone.ptr).unwrap();
    let (other, inside) = begin_during_next_sync(&sim, &pool);
    pool.trim(Some(0)).unwrap();
    check_and_close(&pool, &other, &inside, "trim");
    pool.free(keep.ptr).unwrap();
    pool.empty_cache(None).unwrap();
    assert!(sim.is_clean(0), "{:?}", sim.ledger(0));
}

#[test]
fn no_capture_begins_while_sleep_synchronizes() {
    let (sim, pool) = pool();
    let a = pool.alloc(0, 4 * MIB, S).unwrap();
    let (other, inside) = begin_during_next_sync(&sim, &pool);
    pool.sleep(Some(0), &[0]).unwrap();
    check_and_close(&pool, &other, &inside, "sleep");
    pool.wake(Some(0), None).unwrap();
    pool.free(a.ptr).unwrap();
    pool.empty_cache(None).unwrap();
    assert!(sim.is_clean(0), "{:?}", sim.ledger(0));
}

/// A synchronizing call reached again on its own thread while it runs (an observer's or a
/// hook's callback would be such a caller): `graph_pool_begin` there is refused, not left
/// waiting for itself.
#[test]
fn a_begin_on_the_synchronizing_thread_is_refused_not_deadlocked() {
    let (sim, pool) = pool();
    let a = pool.alloc(0, 4 * MIB, S).unwrap();
    pool.free(a.ptr).unwrap();
    let got = Arc::new(std::sync::Mutex::new(None));
    let (p, g) = (pool.clone(), got.clone());
    sim.run_during_next(SimCall::Synchronize, move || {
        *g.lock().unwrap() = Some(p.graph_pool_begin(0, G));
    });
    pool.empty_cache(Some(0)).unwrap();
    let e = got
        .lock()
        .unwrap()
        .take()
        .expect("the step ran")
        .unwrap_err();
    assert!(e.to_string().contains("synchronizes"), "{e}");
    assert!(
        pool.graph_pool_blocks(0, G).is_err(),
        "nothing changed: no such pool"
    );
    pool.validate(0).unwrap();
}

/// Four threads at once: one opens and closes graph pool contexts (allocating in the pool
/// and freeing while routing), the others run `empty_cache`, `trim`, and sleep / wake of a
/// tag of their own beside general allocations on three streams. While a context is open
/// the device gets no synchronize, no event record and no event query (rule 4 of
/// `pool/graphs/graph_pools.rs`); a synchronizing call is refused while routing, or makes the begin
/// wait; nothing deadlocks, and everything comes back at the end.
#[test]
fn captures_beside_synchronizing_calls_on_other_threads() {
    use gpu_arena::tags;
    const ROUNDS: u32 = 300;
    let (sim, pool) = pool();
    let done = Arc::new(AtomicBool::new(false));
    let counts = || {
        [
            SimCall::Synchronize,
            SimCall::RecordEvent,
            SimCall::EventQuery,
        ]
        .map(|c| sim.calls(c))
    };
    std::thread::scope(|s| {
        /// Stops the other threads when the capture thread ends, panicking or not.
        struct StopOthers<'a>(&'a AtomicBool);
        impl Drop for StopOthers<'_> {
            fn drop(&mut self) {
                self.0.store(true, Ordering::SeqCst);
            }
        }
        let capture = s.spawn(|| {
            let _stop = StopOthers(&done);
            let mut refused = 0u32;
            for round in 0..ROUNDS {
                pool.graph_pool_begin(0, G).unwrap();
                let before = counts();
                let blocks: Vec<_> = (0..3)
                    .map(|i| {
                        let n = [4096, 3 * MIB, 512 << 10][(round as usize + i) % 3];
                        pool.graph_pool_alloc(0, G, n, S).unwrap()
                    })
                    .collect();
                pool.free(blocks[1].ptr).unwrap();
                if pool.empty_cache(Some(0)).is_err() {
                    refused += 1;
                }
                std::thread::yield_now();
                assert_eq!(
                    counts(),
                    before,
                    "round {round}: a synchronize or an event call while routing"
                );
                pool.graph_pool_end(0, G).unwrap();
                for b in [&blocks[0], &blocks[2]] {
                    pool.free(b.ptr).unwrap();
                }
                pool.graph_pool_release(0, G).unwrap();
            }
            refused
        });
        let flag = &done;
        let empties = s.spawn(|| {
            let (mut ok, mut refused) = (0u32, 0u32);
            while !flag.load(Ordering::SeqCst) {
                match pool.empty_cache(Some(0)) {
                    Ok(_) => ok += 1,
                    Err(e) => {
                        assert!(e.to_string().contains("capture"), "{e}");
                        refused += 1;
                    }
                }
                match pool.trim(Some(0)) {
                    Ok(_) => ok += 1,
                    Err(e) => {
                        assert!(e.to_string().contains("capture"), "{e}");
                        refused += 1;
                    }
                }
            }
            (ok, refused)
        });
        let sleeper = s.spawn(|| {
            tags::set_current(Some("capture_race_sleeper")).unwrap();
            let tag = tags::index(Some("capture_race_sleeper")).unwrap();
            let mut slept = 0u32;
            let mut k = 0u64;
            while !flag.load(Ordering::SeqCst) {
                k += 1;
                let stream = StreamId(20 + k % 3);
                let a = pool.alloc(0, 1 + (k * 7919) % (6 * MIB), stream).unwrap();
                if k % 4 == 0 {
                    pool.record_stream(a.ptr, StreamId(20 + (k + 1) % 3))
                        .unwrap();
                }
                pool.free(a.ptr).unwrap();
                if k % 16 == 0 {
                    let keep = pool.alloc(0, 64 << 10, stream).unwrap();
                    if pool.sleep_tags(Some(0), Some(&[tag]), &[tag]).is_ok() {
                        slept += 1;
                        // Refused while a context is open: tried again.
                        while let Err(e) = pool.wake(Some(0), Some(&[tag])) {
                            assert!(e.to_string().contains("capture"), "{e}");
                            std::thread::yield_now();
                        }
                    }
                    pool.free(keep.ptr).unwrap();
                }
            }
            tags::set_current(None).unwrap();
            slept
        });
        let refused_inside = capture.join().unwrap();
        done.store(true, Ordering::SeqCst);
        let (ok, refused) = empties.join().unwrap();
        let slept = sleeper.join().unwrap();
        assert_eq!(
            refused_inside, ROUNDS,
            "empty_cache inside a context is refused"
        );
        assert!(
            ok > 0 || refused > 0,
            "the other threads ran ({ok} / {refused} / {slept})"
        );
    });
    pool.validate(0).unwrap();
    pool.empty_cache(None).unwrap();
    assert_eq!(pool.stats(0).unwrap().reserved_bytes, 0);
    assert!(sim.is_clean(0), "{:?}", sim.ledger(0));
}
