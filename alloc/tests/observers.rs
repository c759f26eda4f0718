//! Arena observers on the sim backend: `on_ready` for existing and new arenas (before any
//! memory of a new one is handed out), `on_release` while the arena is still mapped (and its
//! export still open), on empty_cache, after the last share of a freed arena, at pool drop
//! and on unobserve; failures counted; callbacks calling back into the pool; and a thread
//! race of observe/unobserve against arena creation and release.
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use gpu_arena::backend::sim::{SimBackend, SimConfig};
use gpu_arena::pool::{ObserverError, ARENA_EXPORTED, ARENA_PINNED};
use gpu_arena::{ArenaInfo, ArenaObserver, Error, ObserverId, Pool, PoolConfig, StreamId};

const MIB: u64 = 1 << 20;
const S: StreamId = StreamId(0x1000);

fn pool_with(sim: SimConfig, arena_size: u64, validate: bool) -> (Arc<SimBackend>, Arc<Pool>) {
    let backend = Arc::new(SimBackend::new(sim).unwrap());
    let config = PoolConfig {
        arena_size,
        grow_arenas: false,
        validate,
        ..PoolConfig::default()
    };
    (
        backend.clone(),
        Arc::new(Pool::new(backend, config).unwrap()),
    )
}

fn pool() -> (Arc<SimBackend>, Arc<Pool>) {
    pool_with(SimConfig::default(), 8 * MIB, true)
}

/// Where an (observer, arena) pair is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Seen {
    Ready,
    Failed,
    Released,
}

type Hook = Box<dyn Fn(&ArenaInfo) + Send + Sync>;

/// Records every call and every broken rule (a panic here would be caught and counted as
/// an observer error, so violations are collected and asserted on by the test).
#[derive(Default)]
struct Recorder {
    /// Per arena id: where it is.
    arenas: Mutex<HashMap<u64, Seen>>,
    /// Calls in order: ('r' | 'x', info).
    log: Mutex<Vec<(char, ArenaInfo)>>,
    violations: Mutex<Vec<String>>,
    /// Refuse every on_ready.
    refuse: AtomicBool,
    /// Set once unobserve returned: any later call is a violation.
    closed: AtomicBool,
    on_ready_hook: OnceLock<Hook>,
    on_release_hook: OnceLock<Hook>,
}

impl Recorder {
    fn violation(&self, v: String) {
        self.violations.lock().unwrap().push(v);
    }

    fn state(&self, id: u64) -> Option<Seen> {
        self.arenas.lock().unwrap().get(&id).copied()
    }

    fn count(&self, kind: char) -> usize {
        self.log
            .lock()
            .unwrap()
            .iter()
            .filter(|(k, _)| *k == kind)
            .count()
    }

    /// Whether `ptr` lies in an arena this observer took and was not told is gone.
    fn covers(&self, ptr: u64) -> bool {
        let arenas = self.arenas.lock().unwrap();
        self.log.lock().unwrap().iter().any(|(k, a)| {
            *k == 'r'
                && arenas.get(&a.arena_id) == Some(&Seen::Ready)
                && (a.base..a.base + a.size).contains(&ptr)
        })
    }

    fn assert_clean(&self) {
        let v = self.violations.lock().unwrap();
        assert!(v.is_empty(), "observer rules broken: {v:#?}");
    }
}

impl ArenaObserver for Recorder {
    fn on_ready(&self, arena: &ArenaInfo) -> Result<(), ObserverError> {
        if self.closed.load(Ordering::SeqCst) {
            self.violation(format!("on_ready after unobserve: {arena:?}"));
        }
        let refuse = self.refuse.load(Ordering::SeqCst);
        let prev = self.arenas.lock().unwrap().insert(
            arena.arena_id,
            if refuse { Seen::Failed } else { Seen::Ready },
        );
        if prev.is_some() {
            self.violation(format!("second on_ready ({prev:?} before): {arena:?}"));
        }
        self.log.lock().unwrap().push(('r', *arena));
        if let Some(h) = self.on_ready_hook.get() {
            h(arena);
        }
        if refuse {
            return Err("refused by the test".into());
        }
        Ok(())
    }

    fn on_release(&self, arena: &ArenaInfo) {
        if self.closed.load(Ordering::SeqCst) {
            self.violation(format!("on_release after unobserve: {arena:?}"));
        }
        let prev = self
            .arenas
            .lock()
            .unwrap()
            .insert(arena.arena_id, Seen::Released);
        if prev != Some(Seen::Ready) {
            self.violation(format!("on_release in state {prev:?}: {arena:?}"));
        }
        if let Some(h) = self.on_release_hook.get() {
            h(arena);
        }
        self.log.lock().unwrap().push(('x', *arena));
    }
}

fn observe(pool: &Pool, r: &Arc<Recorder>) -> ObserverId {
    pool.observe_arenas(r.clone())
}

fn unobserve(pool: &Pool, r: &Recorder, id: ObserverId) {
    pool.unobserve_arenas(id).unwrap();
    r.closed.store(true, Ordering::SeqCst);
}

#[test]
fn ready_for_existing_and_new_arenas_before_their_memory_is_handed_out() {
    let (_sim, pool) = pool();
    let a = pool.alloc(0, 2 * MIB, S).unwrap();
    let r = Arc::new(Recorder::default());
    // Inside on_ready of a new arena, no allocation of it may exist yet.
    let weak: Weak<Pool> = Arc::downgrade(&pool);
    let seen_allocs = Arc::new(AtomicU64::new(u64::MAX));
    let seen = seen_allocs.clone();
    let _ = r.on_ready_hook.set(Box::new(move |info| {
        if info.arena_id == 2 {
            let p = weak.upgrade().unwrap();
            seen.store(p.stats(0).unwrap().allocations, Ordering::SeqCst);
        }
    }));
    let id = observe(&pool, &r);
    assert_eq!(r.count('r'), 1, "the existing arena, from observe_arenas");
    let first = r.log.lock().unwrap()[0].1;
    assert_eq!((first.device, first.arena_id, first.size), (0, 1, 8 * MIB));
    assert!((first.base..first.base + first.size).contains(&a.ptr));
    assert_eq!(first.flags, 0);
    // A request larger than an arena gets a dedicated one: ready before it is handed out.
    let big = pool.alloc(0, 20 * MIB, S).unwrap();
    assert_eq!(r.count('r'), 2);
    assert!(r.covers(big.ptr));
    assert_eq!(
        seen_allocs.load(Ordering::SeqCst),
        1,
        "on_ready of the new arena ran while only the first allocation existed"
    );
    assert_eq!(r.count('x'), 0);
    pool.free(a.ptr).unwrap();
    pool.free(big.ptr).unwrap();
    unobserve(&pool, &r, id);
    assert_eq!(r.count('x'), 2, "unobserve releases every arena it saw");
    r.assert_clean();
    assert_eq!(pool.stats(0).unwrap().observer_errors, 0);
}

#[test]
fn release_on_empty_cache_while_the_arena_is_still_mapped() {
    let (sim, pool) = pool();
    let r = Arc::new(Recorder::default());
    let id = observe(&pool, &r);
    let a = pool.alloc(0, 2 * MIB, S).unwrap();
    // SAFETY: sim device pointers are host addresses of live mappings of `bytes` bytes.
    unsafe { std::ptr::write_bytes(a.ptr as *mut u8, 0x5A, a.bytes as usize) };
    pool.free(a.ptr).unwrap();
    let read = Arc::new(AtomicU64::new(0));
    let (read2, sim2) = (read.clone(), sim.clone());
    let _ = r.on_release_hook.set(Box::new(move |info| {
        assert_eq!(sim2.ledger(0).live_arenas, 1, "not destroyed yet");
        // SAFETY: the arena is still mapped during on_release (the rule under test).
        let byte = unsafe { *(info.base as *const u8) };
        read2.store(u64::from(byte), Ordering::SeqCst);
    }));
    assert_eq!(pool.empty_cache(None).unwrap(), 8 * MIB);
    assert_eq!(r.count('x'), 1);
    assert_eq!(read.load(Ordering::SeqCst), 0x5A);
    assert!(sim.is_clean(0), "{:?}", sim.ledger(0));
    unobserve(&pool, &r, id);
    assert_eq!(r.count('x'), 1, "nothing left to release");
    r.assert_clean();
}

#[test]
fn release_after_the_last_share_of_a_freed_arena() {
    let (sim, pool) = pool();
    let r = Arc::new(Recorder::default());
    let id = observe(&pool, &r);
    let a = pool.alloc(0, 2 * MIB, S).unwrap();
    let share = pool.share(a.ptr, a.bytes).unwrap();
    assert_eq!(sim.ledger(0).open_exports, 1);
    pool.free(a.ptr).unwrap(); // deferred: still shared
    pool.empty_cache(None).unwrap();
    assert_eq!(r.count('x'), 0, "a shared arena stays");
    pool.unshare(0, share.share_key, &share.token).unwrap();
    assert_eq!(
        sim.ledger(0).open_exports,
        0,
        "the last share closed the export"
    );
    assert_eq!(
        r.count('x'),
        0,
        "the arena stays in the pool until released"
    );
    pool.empty_cache(None).unwrap();
    assert_eq!(r.count('x'), 1);
    assert_eq!(r.log.lock().unwrap()[1].1.flags, 0);
    assert!(sim.is_clean(0), "{:?}", sim.ledger(0));
    unobserve(&pool, &r, id);
    r.assert_clean();
}

#[test]
fn release_at_pool_drop_before_the_export_is_closed() {
    let (sim, pool) = pool();
    let r = Arc::new(Recorder::default());
    observe(&pool, &r);
    let a = pool.alloc(0, 2 * MIB, S).unwrap();
    pool.share(a.ptr, a.bytes).unwrap();
    let sim2 = sim.clone();
    let export_open = Arc::new(AtomicBool::new(false));
    let open2 = export_open.clone();
    let _ = r.on_release_hook.set(Box::new(move |info| {
        let l = sim2.ledger(0);
        open2.store(
            l.open_exports == 1 && l.live_arenas == 1 && info.flags & ARENA_EXPORTED != 0,
            Ordering::SeqCst,
        );
        // SAFETY: still mapped during on_release.
        let _ = unsafe { *(info.base as *const u8) };
    }));
    drop(pool);
    assert_eq!(r.count('x'), 1);
    assert!(
        export_open.load(Ordering::SeqCst),
        "on_release ran with the export open and the arena alive"
    );
    assert!(sim.is_clean(0), "{:?}", sim.ledger(0));
    r.assert_clean();
}

#[test]
fn a_pinned_arena_is_released_on_unobserve_and_drop() {
    let sim = SimConfig {
        legacy_pin: true,
        ..SimConfig::default()
    };
    let (_sim, pool) = pool_with(sim, 8 * MIB, true);
    let a = pool.alloc(0, 2 * MIB, S).unwrap();
    let share = pool.share(a.ptr, a.bytes).unwrap();
    pool.unshare(0, share.share_key, &share.token).unwrap();
    pool.free(a.ptr).unwrap();
    let r = Arc::new(Recorder::default());
    let id = observe(&pool, &r);
    assert_eq!(
        r.log.lock().unwrap()[0].1.flags,
        ARENA_EXPORTED | ARENA_PINNED
    );
    pool.empty_cache(None).unwrap();
    assert_eq!(r.count('x'), 0, "pinned: recycled, never released");
    unobserve(&pool, &r, id);
    assert_eq!(r.count('x'), 1);
    let r2 = Arc::new(Recorder::default());
    observe(&pool, &r2);
    drop(pool);
    assert_eq!((r2.count('r'), r2.count('x')), (1, 1));
    r.assert_clean();
    r2.assert_clean();
}

#[test]
fn a_failed_on_ready_is_counted_and_the_arena_stays_usable() {
    let (_sim, pool) = pool();
    let bad = Arc::new(Recorder::default());
    bad.refuse.store(true, Ordering::SeqCst);
    let good = Arc::new(Recorder::default());
    let bad_id = observe(&pool, &bad);
    let good_id = observe(&pool, &good);
    let a = pool.alloc(0, 2 * MIB, S).unwrap();
    assert_eq!(pool.stats(0).unwrap().observer_errors, 1);
    // SAFETY: a live sim allocation: the arena is usable.
    unsafe { std::ptr::write_bytes(a.ptr as *mut u8, 1, a.bytes as usize) };
    assert_eq!(bad.state(1), Some(Seen::Failed));
    assert_eq!(good.state(1), Some(Seen::Ready));
    pool.free(a.ptr).unwrap();
    pool.empty_cache(None).unwrap();
    assert_eq!(
        bad.count('x'),
        0,
        "no on_release for an arena whose on_ready failed"
    );
    assert_eq!(good.count('x'), 1);
    unobserve(&pool, &bad, bad_id);
    unobserve(&pool, &good, good_id);
    bad.assert_clean();
    good.assert_clean();
}

/// Panics in on_ready and on_release are caught, logged and counted.
struct Panicker;

impl ArenaObserver for Panicker {
    fn on_ready(&self, _: &ArenaInfo) -> Result<(), ObserverError> {
        panic!("on_ready panics (test)");
    }
    fn on_release(&self, _: &ArenaInfo) {
        panic!("on_release panics (test)");
    }
}

/// Takes every arena, panics on release.
struct PanicOnRelease;

impl ArenaObserver for PanicOnRelease {
    fn on_ready(&self, _: &ArenaInfo) -> Result<(), ObserverError> {
        Ok(())
    }
    fn on_release(&self, _: &ArenaInfo) {
        panic!("on_release panics (test)");
    }
}

#[test]
fn panics_in_observers_are_caught_and_counted() {
    let (_sim, pool) = pool();
    let p = pool.observe_arenas(Arc::new(Panicker));
    let q = pool.observe_arenas(Arc::new(PanicOnRelease));
    let a = pool.alloc(0, 2 * MIB, S).unwrap();
    assert_eq!(pool.stats(0).unwrap().observer_errors, 1, "on_ready panic");
    pool.free(a.ptr).unwrap();
    pool.empty_cache(None).unwrap();
    assert_eq!(
        pool.stats(0).unwrap().observer_errors,
        2,
        "PanicOnRelease's on_release panic (Panicker took nothing)"
    );
    pool.unobserve_arenas(p).unwrap();
    pool.unobserve_arenas(q).unwrap();
    pool.validate(0).unwrap();
}

#[test]
fn unobserve_twice_or_unknown_is_refused_and_changes_nothing() {
    let (_sim, pool) = pool();
    let a = pool.alloc(0, 2 * MIB, S).unwrap();
    let r = Arc::new(Recorder::default());
    let id = observe(&pool, &r);
    let other = Arc::new(Recorder::default());
    let other_id = observe(&pool, &other);
    unobserve(&pool, &r, id);
    let before = pool.stats(0).unwrap();
    for bad in [id, ObserverId(0), ObserverId(999)] {
        match pool.unobserve_arenas(bad) {
            Err(Error::InvalidArgument(m)) => assert!(m.contains("not registered"), "{m}"),
            other => panic!("unobserve of {bad:?}: {other:?}"),
        }
    }
    assert_eq!(pool.stats(0).unwrap(), before);
    assert_eq!(other.count('x'), 0, "the other observer is untouched");
    pool.free(a.ptr).unwrap();
    pool.empty_cache(None).unwrap();
    assert_eq!(other.count('x'), 1);
    unobserve(&pool, &other, other_id);
    r.assert_clean();
    other.assert_clean();
}

#[test]
fn callbacks_may_call_back_into_the_pool() {
    let (_sim, pool) = pool();
    let existing = pool.alloc(0, 2 * MIB, S).unwrap();
    pool.free(existing.ptr).unwrap(); // the arena is empty: empty_cache could release it
    let r = Arc::new(Recorder::default());
    let weak = Arc::downgrade(&pool);
    let nested = Arc::new(Recorder::default());
    let nested_id = Arc::new(Mutex::new(None));
    let (nested2, nested_id2) = (nested.clone(), nested_id.clone());
    let first = AtomicBool::new(true);
    let _ = r.on_ready_hook.set(Box::new(move |_| {
        // Once (an allocation from on_ready of a new arena needs yet another arena).
        if !first.swap(false, Ordering::SeqCst) {
            return;
        }
        let p = weak.upgrade().unwrap();
        p.stats(0).unwrap();
        // Inside on_ready: alloc, free, empty_cache (which must leave the arena being
        // readied alone), observe another observer.
        let b = p.alloc(0, 2 * MIB, StreamId(0x2000)).unwrap();
        p.free(b.ptr).unwrap();
        p.empty_cache(None).unwrap();
        *nested_id2.lock().unwrap() = Some(p.observe_arenas(nested2.clone()));
    }));
    let id = observe(&pool, &r);
    assert_eq!(r.count('r'), 1);
    assert_eq!(r.count('x'), 0, "the arena being readied was not released");
    assert_eq!(nested.count('r'), 1, "the nested observe saw the arena");
    let weak = Arc::downgrade(&pool);
    let _ = r.on_release_hook.set(Box::new(move |_| {
        // Inside on_release: stats, and an allocation (a new arena: this one is leaving).
        let p = weak.upgrade().unwrap();
        p.stats(0).unwrap();
        let a = p.alloc(0, 2 * MIB, S).unwrap();
        p.free(a.ptr).unwrap();
    }));
    pool.empty_cache(None).unwrap();
    pool.unobserve_arenas(id).unwrap();
    r.closed.store(true, Ordering::SeqCst);
    let nid = nested_id.lock().unwrap().unwrap();
    unobserve(&pool, &nested, nid);
    r.assert_clean();
    nested.assert_clean();
    assert_eq!(r.count('r'), r.count('x'), "every ready released");
    assert_eq!(nested.count('r'), nested.count('x'));
    assert_eq!(pool.stats(0).unwrap().observer_errors, 0);
    pool.validate(0).unwrap();
}

/// Observes itself out from inside its own on_ready.
struct SelfRemover {
    pool: Weak<Pool>,
    id: Mutex<Option<ObserverId>>,
    calls: AtomicU64,
}

impl ArenaObserver for SelfRemover {
    fn on_ready(&self, _: &ArenaInfo) -> Result<(), ObserverError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        if let (Some(p), Some(id)) = (self.pool.upgrade(), self.id.lock().unwrap().take()) {
            p.unobserve_arenas(id).map_err(|e| e.to_string())?;
        }
        Ok(())
    }
    fn on_release(&self, _: &ArenaInfo) {
        self.calls.fetch_add(1, Ordering::SeqCst);
    }
}

#[test]
fn an_observer_may_unobserve_itself_from_its_callback() {
    let (_sim, pool) = pool();
    let o = Arc::new(SelfRemover {
        pool: Arc::downgrade(&pool),
        id: Mutex::new(None),
        calls: AtomicU64::new(0),
    });
    let id = pool.observe_arenas(o.clone());
    *o.id.lock().unwrap() = Some(id);
    let a = pool.alloc(0, 2 * MIB, S).unwrap(); // on_ready unobserves: then its own release
    assert_eq!(
        o.calls.load(Ordering::SeqCst),
        2,
        "ready, then release at once"
    );
    pool.free(a.ptr).unwrap();
    pool.empty_cache(None).unwrap();
    assert_eq!(o.calls.load(Ordering::SeqCst), 2, "no call after unobserve");
    assert!(pool.unobserve_arenas(id).is_err());
}

/// Observers come and go on two threads while three threads allocate (arenas created, some
/// dedicated), free and empty the cache. Every observer must see exactly one ready and at
/// most one release per arena, release only after ready, none after unobserve returned, and
/// one release per ready in total; a long-lived observer must have taken the arena of every
/// allocation before the allocation was handed out.
#[test]
fn observers_race_with_arena_creation_and_release() {
    let (sim, pool) = pool_with(
        SimConfig {
            capacity: 4 << 30,
            ..SimConfig::default()
        },
        4 * MIB,
        false,
    );
    let guard = Arc::new(Recorder::default());
    let guard_id = observe(&pool, &guard);
    let refused = Arc::new(AtomicU64::new(0));
    let taken = Arc::new(AtomicU64::new(0));
    // The racing observers start once arenas are being made, and the allocating threads
    // go on until the observers are done: on a busy machine either side could otherwise
    // finish before the other started.
    let allocating = AtomicBool::new(false);
    let observers_done = AtomicU64::new(0);
    std::thread::scope(|s| {
        for t in 0..3u64 {
            let (pool, guard) = (&pool, &guard);
            let (allocating, observers_done) = (&allocating, &observers_done);
            s.spawn(move || {
                let stream = StreamId(0x1000 * (t + 1));
                let mut live = Vec::new();
                let mut i = 0u64;
                while i < 400 || (observers_done.load(Ordering::SeqCst) < 2 && i < 200_000) {
                    i += 1;
                    let size = match (i * 7 + t) % 11 {
                        0 => 6 * MIB, // dedicated arena
                        1..=4 => 2 * MIB,
                        _ => 64 * 1024,
                    };
                    let a = pool.alloc(0, size, stream).unwrap();
                    assert!(
                        guard.covers(a.ptr),
                        "allocation {:#x} handed out before its arena's on_ready",
                        a.ptr
                    );
                    live.push(a.ptr);
                    allocating.store(true, Ordering::SeqCst);
                    if live.len() > 6 {
                        pool.free(live.remove(0)).unwrap();
                    }
                    if i % 25 == 24 {
                        for p in live.drain(..) {
                            pool.free(p).unwrap();
                        }
                        pool.empty_cache(None).unwrap();
                    }
                }
                for p in live {
                    pool.free(p).unwrap();
                }
            });
        }
        for t in 0..2u64 {
            let (pool, refused, taken) = (&pool, &refused, &taken);
            let (allocating, observers_done) = (&allocating, &observers_done);
            s.spawn(move || {
                while !allocating.load(Ordering::SeqCst) {
                    std::thread::yield_now();
                }
                for i in 0..150u64 {
                    let r = Arc::new(Recorder::default());
                    let refuse = (i + t) % 5 == 0;
                    r.refuse.store(refuse, Ordering::SeqCst);
                    let id = observe(pool, &r);
                    for _ in 0..(i % 3) {
                        std::thread::yield_now();
                    }
                    unobserve(pool, &r, id);
                    r.assert_clean();
                    let arenas = r.arenas.lock().unwrap();
                    taken.fetch_add(arenas.len() as u64, Ordering::SeqCst);
                    if refuse {
                        refused.fetch_add(arenas.len() as u64, Ordering::SeqCst);
                    }
                    assert!(
                        arenas
                            .values()
                            .all(|s| *s == Seen::Released || *s == Seen::Failed),
                        "every arena taken was released by unobserve: {arenas:?}"
                    );
                    assert_eq!(
                        r.count('x'),
                        r.count('r') - if refuse { r.count('r') } else { 0 }
                    );
                }
                observers_done.fetch_add(1, Ordering::SeqCst);
            });
        }
    });
    pool.empty_cache(None).unwrap();
    unobserve(&pool, &guard, guard_id);
    guard.assert_clean();
    assert_eq!(guard.count('r'), guard.count('x'));
    assert!(guard.count('r') > 3, "arenas were created and released");
    eprintln!(
        "race: {} arenas, {} taken by the racing observers ({} refused)",
        guard.count('r'),
        taken.load(Ordering::SeqCst),
        refused.load(Ordering::SeqCst)
    );
    assert!(
        taken.load(Ordering::SeqCst) > 0,
        "the racing observers saw arenas"
    );
    assert_eq!(
        pool.stats(0).unwrap().observer_errors,
        refused.load(Ordering::SeqCst),
        "every refused on_ready counted, nothing else"
    );
    pool.validate(0).unwrap();
    assert!(sim.is_clean(0), "{:?}", sim.ledger(0));
}

/// Allocates from every on_ready.
struct Allocator {
    pool: Weak<Pool>,
    results: Mutex<Vec<Result<(), String>>>,
}

impl ArenaObserver for Allocator {
    fn on_ready(&self, _: &ArenaInfo) -> Result<(), ObserverError> {
        let p = self.pool.upgrade().unwrap();
        let r = p.alloc(0, 4096, S).map_err(|e| e.to_string());
        self.results
            .lock()
            .unwrap()
            .push(r.as_ref().map(|_| ()).map_err(Clone::clone));
        p.free(r?.ptr)?;
        Ok(())
    }
    fn on_release(&self, _: &ArenaInfo) {}
}

#[test]
fn an_on_ready_that_always_allocates_does_not_recurse_without_end() {
    let (sim, pool) = pool();
    let o = Arc::new(Allocator {
        pool: Arc::downgrade(&pool),
        results: Mutex::new(Vec::new()),
    });
    let id = pool.observe_arenas(o.clone());
    // The pool is empty: A's on_ready allocates -> arena B (nested) -> B's on_ready
    // allocates -> a third arena would be needed: refused; B stays usable and serves A's.
    let a = pool.alloc(0, 2 * MIB, S).unwrap();
    let results = o.results.lock().unwrap().clone();
    assert_eq!(results.len(), 2, "{results:?}");
    assert!(
        results[0].as_ref().is_err_and(|e| e.contains("on_ready")),
        "{results:?}"
    );
    assert!(results[1].is_ok(), "{results:?}");
    let s = pool.stats(0).unwrap();
    assert_eq!((s.arenas, s.observer_errors), (2, 1));
    pool.free(a.ptr).unwrap();
    pool.unobserve_arenas(id).unwrap();
    pool.empty_cache(None).unwrap();
    assert!(sim.is_clean(0), "{:?}", sim.ledger(0));
}
