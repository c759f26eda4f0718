//! Trim (`alloc/src/pool/growth/trim.rs`): after `empty_cache`, arenas with survivors are split
//! down to the granularity pages the survivors use; addresses and contents are unchanged,
//! shared and asleep arenas are left whole, a failed split changes nothing.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use gpu_arena::backend::sim::{SimBackend, SimCall, SimConfig};
use gpu_arena::pool::{ArenaInfo, ArenaObserver, ObserverError};
use gpu_arena::{Allocation, Pool, StreamId};
use proptest::prelude::*;

mod common;
use common::sim_pool;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const PAGE: u64 = 2 * MIB;
const S: StreamId = StreamId(0x1000);

fn pool(arena_size: u64) -> (Arc<SimBackend>, Pool) {
    sim_pool(
        SimConfig {
            capacity: 64 * GIB,
            ..SimConfig::default()
        },
        arena_size,
        true,
    )
}

/// Fill the first and last 64 bytes of `a` with a byte derived from `seed`.
fn stamp(a: &Allocation, seed: u64) {
    let v = [(seed % 251) as u8 + 1; 64];
    for at in [a.ptr, a.ptr + a.bytes - 64] {
        // SAFETY: sim addresses are host memory; `a` is live and at least 512 bytes long.
        unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), at as *mut u8, 64) }
    }
}

fn stamped(a: &Allocation, seed: u64) -> bool {
    let want = (seed % 251) as u8 + 1;
    [a.ptr, a.ptr + a.bytes - 64].iter().all(|&at| {
        let mut got = [0u8; 64];
        // SAFETY: as in `stamp`.
        unsafe { std::ptr::copy_nonoverlapping(at as *const u8, got.as_mut_ptr(), 64) }
        got.iter().all(|&b| b == want)
    })
}

/// The arenas' bases of device 0, from the snapshot.
fn arena_bases(pool: &Pool) -> Vec<u64> {
    let v: serde_json::Value = serde_json::from_str(&pool.snapshot_json()).unwrap();
    v["devices"][0]["arenas"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["base"].as_u64().unwrap())
        .collect()
}

/// The 2 MiB pages of their arenas (whose bases are `bases`: sim arenas are host mappings,
/// page-aligned only) the survivors' blocks touch.
fn pages(bases: &[u64], survivors: &[Allocation]) -> u64 {
    let mut set = BTreeSet::new();
    for a in survivors {
        let base = *bases.iter().filter(|&&b| b <= a.ptr).max().unwrap();
        for p in (a.ptr - base) / PAGE..(a.ptr - base + a.bytes).div_ceil(PAGE) {
            set.insert((base, p));
        }
    }
    set.len() as u64 * PAGE
}

/// The pattern, with large survivors too: 1,500 blocks of 4 MiB and 600 of 4 KiB;
/// every small one and every 100th large one survive. empty_cache keeps the 1 GiB arenas of
/// the large survivors; trim brings reserved to the survivors' pages, within 2x live.
#[test]
fn trim_brings_scattered_large_survivors_down_to_their_pages() {
    let (sim, pool) = pool(GIB);
    let mut all = Vec::new();
    for i in 0..2100u64 {
        let small = i % 7 < 2;
        let a = pool
            .alloc(0, if small { 4 * KIB } else { 4 * MIB }, S)
            .unwrap();
        all.push((i, small, a));
    }
    let mut survivors = Vec::new();
    let mut large_seen = 0;
    for &(i, small, a) in &all {
        let keep = small || {
            large_seen += 1;
            large_seen % 100 == 1
        };
        if keep {
            stamp(&a, i);
            survivors.push((i, a));
        } else {
            pool.free(a.ptr).unwrap();
        }
    }
    pool.empty_cache(None).unwrap();
    let live = pool.stats(0).unwrap().allocated_bytes;
    let before = pool.stats(0).unwrap().reserved_bytes;
    assert!(
        before >= GIB,
        "a large survivor keeps its arena after empty_cache"
    );
    let bases = arena_bases(&pool);
    let r = pool.trim(None).unwrap();
    let s = pool.stats(0).unwrap();
    let kept: Vec<Allocation> = survivors.iter().map(|s| s.1).collect();
    assert_eq!(s.reserved_bytes, pages(&bases, &kept), "{r:?}");
    assert!(
        s.reserved_bytes <= 2 * live + 8 * MIB,
        "{} live {live}",
        s.reserved_bytes
    );
    assert_eq!(r.released_bytes, before - s.reserved_bytes);
    assert_eq!(sim.ledger(0).held_bytes, s.reserved_bytes);
    assert!(
        survivors.iter().all(|(i, a)| stamped(a, *i)),
        "contents kept"
    );
    pool.validate(0).unwrap();
    // The pool goes on: new blocks, frees, and nothing held once everything is freed.
    let more: Vec<_> = (0..50)
        .map(|_| pool.alloc(0, 4 * MIB, S).unwrap())
        .collect();
    for (i, a) in more.iter().enumerate() {
        stamp(a, i as u64);
    }
    for (i, a) in &survivors {
        assert!(stamped(a, *i));
        pool.free(a.ptr).unwrap();
    }
    for a in more {
        pool.free(a.ptr).unwrap();
    }
    pool.empty_cache(None).unwrap();
    assert_eq!(pool.stats(0).unwrap().reserved_bytes, 0);
    assert!(sim.is_clean(0));
}

/// A shared arena is left whole; a survivor in a window can be shared (one export for its
/// window) after the trim.
#[test]
fn shared_arenas_stay_whole_and_windows_can_be_shared() {
    let (sim, pool) = pool(64 * MIB);
    // Two full 64 MiB arenas of 8 MiB blocks: the first one's survivor is shared.
    let blocks: Vec<_> = (0..16)
        .map(|_| pool.alloc(0, 8 * MIB, S).unwrap())
        .collect();
    let (a, d) = (blocks[0], blocks[8]);
    let info = pool.share(a.ptr, 4 * MIB).unwrap();
    for b in &blocks {
        if b.ptr != a.ptr && b.ptr != d.ptr {
            pool.free(b.ptr).unwrap();
        }
    }
    let r = pool.trim(None).unwrap();
    assert_eq!(r.kept_shared_bytes, 64 * MIB, "{r:?}");
    assert_eq!((r.split_arenas, r.windows), (1, 1), "{r:?}");
    assert_eq!(pool.stats(0).unwrap().reserved_bytes, 64 * MIB + 8 * MIB);
    stamp(&d, 9);
    let exports = pool.stats(0).unwrap().exports_total;
    let shared = pool.share(d.ptr, d.bytes).unwrap();
    assert_eq!(shared.arena_bytes, 8 * MIB, "the window is its own arena");
    assert_eq!(pool.stats(0).unwrap().exports_total, exports + 1);
    assert!(stamped(&d, 9));
    pool.unshare(0, shared.share_key, &shared.token).unwrap();
    pool.unshare(0, info.share_key, &info.token).unwrap();
    pool.free(a.ptr).unwrap();
    pool.free(d.ptr).unwrap();
    pool.empty_cache(None).unwrap();
    assert_eq!(pool.stats(0).unwrap().reserved_bytes, 0);
    assert!(sim.is_clean(0));
}

/// Asleep arenas are left alone; a failed split leaves the arena whole with its contents.
#[test]
fn asleep_arenas_and_failed_splits_change_nothing() {
    let (sim, pool) = pool(256 * MIB);
    let a = pool.alloc(0, 8 * MIB, S).unwrap();
    let b = pool.alloc(0, 40 * MIB, S).unwrap(); // the same (large-class) arena
    pool.free(b.ptr).unwrap();
    stamp(&a, 3);
    pool.sleep(None, &[]).unwrap();
    let r = pool.trim(None).unwrap();
    assert_eq!(
        (r.split_arenas, r.kept_other_bytes),
        (0, 256 * MIB),
        "{r:?}"
    );
    pool.wake(None, None).unwrap();
    stamp(&a, 4);
    sim.fail_nth(SimCall::CreateArena, 1);
    let r = pool.trim(None).unwrap();
    assert_eq!(
        (r.split_arenas, r.kept_other_bytes),
        (0, 256 * MIB),
        "{r:?}"
    );
    assert_eq!(pool.stats(0).unwrap().reserved_bytes, 256 * MIB);
    assert!(stamped(&a, 4));
    pool.validate(0).unwrap();
    let r = pool.trim(None).unwrap();
    assert_eq!((r.split_arenas, r.released_bytes), (1, 248 * MIB), "{r:?}");
    assert!(stamped(&a, 4));
    pool.free(a.ptr).unwrap();
    pool.empty_cache(None).unwrap();
    assert!(sim.is_clean(0));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// Any allocation sequence (512 B to 40 MiB, 64 MiB arenas) and any survivors: after a
    /// trim, reserved is exactly the 2 MiB pages the survivors' blocks touch, every survivor
    /// keeps its bytes, and freeing them all leaves nothing held.
    #[test]
    fn after_a_trim_reserved_is_the_survivors_pages(
        ops in proptest::collection::vec((0u64..5, 1u64..=100, any::<bool>()), 1..100),
    ) {
        let (sim, pool) = pool(64 * MIB);
        let mut survivors = Vec::new();
        for (n, (kind, x, keep)) in ops.into_iter().enumerate() {
            let bytes = match kind {
                0 => 512 * x,
                1 => 10 * KIB * x,
                2 => MIB + 100 * KIB * x,
                3 => 400 * KIB * x,
                _ => MIB * (x % 40 + 1),
            };
            let a = pool.alloc(0, bytes, S).unwrap();
            if keep {
                stamp(&a, n as u64);
                survivors.push((n as u64, a));
            } else {
                pool.free(a.ptr).unwrap();
            }
        }
        pool.empty_cache(None).unwrap();
        let bases = arena_bases(&pool);
        pool.trim(None).unwrap();
        let kept: Vec<Allocation> = survivors.iter().map(|s| s.1).collect();
        prop_assert_eq!(pool.stats(0).unwrap().reserved_bytes, pages(&bases, &kept));
        prop_assert_eq!(sim.ledger(0).held_bytes, pages(&bases, &kept));
        prop_assert!(survivors.iter().all(|(i, a)| stamped(a, *i)));
        for (_, a) in &survivors {
            pool.free(a.ptr).unwrap();
        }
        pool.empty_cache(None).unwrap();
        prop_assert!(sim.is_clean(0));
    }
}

/// An observer that keeps the set of arenas it was told about (on_ready adds, on_release
/// removes), and can run an action from its first `on_release`.
#[derive(Default)]
struct Watcher {
    live: Mutex<BTreeMap<u64, (u64, u64)>>,
    readies: AtomicU64,
    releases: AtomicU64,
    on_first_release: Mutex<Option<Box<dyn FnOnce() + Send>>>,
}

impl ArenaObserver for Watcher {
    fn on_ready(&self, a: &ArenaInfo) -> Result<(), ObserverError> {
        self.readies.fetch_add(1, Ordering::SeqCst);
        let old = self
            .live
            .lock()
            .unwrap()
            .insert(a.base, (a.arena_id, a.size));
        assert!(
            old.is_none(),
            "on_ready twice for the arena at {:#x}",
            a.base
        );
        Ok(())
    }
    fn on_release(&self, a: &ArenaInfo) {
        self.releases.fetch_add(1, Ordering::SeqCst);
        let old = self.live.lock().unwrap().remove(&a.base);
        assert_eq!(
            old,
            Some((a.arena_id, a.size)),
            "on_release of an arena not ready"
        );
        let action = self.on_first_release.lock().unwrap().take();
        if let Some(f) = action {
            f();
        }
    }
}

/// The observers' view of the arenas matches the pool's: `(base, size)` of each.
fn watched(w: &Watcher) -> Vec<(u64, u64)> {
    w.live
        .lock()
        .unwrap()
        .iter()
        .map(|(&b, &(_, s))| (b, s))
        .collect()
}

fn pool_arenas(pool: &Pool) -> Vec<(u64, u64)> {
    let v: serde_json::Value = serde_json::from_str(&pool.snapshot_json()).unwrap();
    let mut out: Vec<(u64, u64)> = v["devices"][0]["arenas"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| (a["base"].as_u64().unwrap(), a["bytes"].as_u64().unwrap()))
        .collect();
    out.sort_unstable();
    out
}

/// Observers: a split arena gets `on_release` before its windows get `on_ready`, and their
/// view of the arenas is the pool's afterwards (and after unobserving, empty).
#[test]
fn observers_see_the_windows_replace_the_arena() {
    let (sim, pool) = pool(64 * MIB);
    let w = Arc::new(Watcher::default());
    let id = pool.observe_arenas(w.clone());
    let blocks: Vec<_> = (0..8).map(|_| pool.alloc(0, 8 * MIB, S).unwrap()).collect();
    for b in &blocks[1..7] {
        pool.free(b.ptr).unwrap();
    }
    assert_eq!(watched(&w), pool_arenas(&pool));
    let r = pool.trim(None).unwrap();
    assert_eq!((r.split_arenas, r.windows), (1, 2), "{r:?}");
    assert_eq!(watched(&w), pool_arenas(&pool));
    assert_eq!(watched(&w).iter().map(|a| a.1).sum::<u64>(), 16 * MIB);
    pool.unobserve_arenas(id).unwrap();
    assert!(watched(&w).is_empty());
    for b in [blocks[0], blocks[7]] {
        pool.free(b.ptr).unwrap();
    }
    pool.empty_cache(None).unwrap();
    pool.validate(0).unwrap();
    assert!(sim.is_clean(0));
}

/// While the split arenas' `on_release` run (the device lock released), the pool is used:
/// here the observer frees the only survivor and empties the cache, so the arena is gone
/// before the split. Trim must neither split it nor announce it again to observers.
#[test]
fn an_arena_destroyed_during_on_release_is_not_announced_again() {
    let (sim, pool) = pool(64 * MIB);
    let pool = Arc::new(pool);
    let w = Arc::new(Watcher::default());
    pool.observe_arenas(w.clone());
    let a = pool.alloc(0, 8 * MIB, S).unwrap();
    let b = pool.alloc(0, 8 * MIB, S).unwrap();
    pool.free(b.ptr).unwrap();
    let weak = Arc::downgrade(&pool);
    *w.on_first_release.lock().unwrap() = Some(Box::new(move || {
        let pool = weak.upgrade().unwrap();
        pool.free(a.ptr).unwrap();
        pool.empty_cache(None).unwrap();
    }));
    let r = pool.trim(None).unwrap();
    assert_eq!(r.split_arenas, 0, "{r:?}");
    assert_eq!(pool.stats(0).unwrap().reserved_bytes, 0);
    assert_eq!(
        watched(&w),
        pool_arenas(&pool),
        "no arena the pool does not hold"
    );
    pool.validate(0).unwrap();
    assert!(sim.is_clean(0));
}

/// While the split arenas' `on_release` run, a new block is allocated in the arena (from
/// this thread's front): the split sees it and keeps its page, with its contents.
#[test]
fn a_block_allocated_during_on_release_is_kept() {
    let (sim, pool) = pool(64 * MIB);
    let pool = Arc::new(pool);
    let w = Arc::new(Watcher::default());
    pool.observe_arenas(w.clone());
    let blocks: Vec<_> = (0..8).map(|_| pool.alloc(0, 8 * MIB, S).unwrap()).collect();
    for b in &blocks[1..] {
        pool.free(b.ptr).unwrap();
    }
    let late = Arc::new(Mutex::new(None));
    let (weak, slot) = (Arc::downgrade(&pool), late.clone());
    *w.on_first_release.lock().unwrap() = Some(Box::new(move || {
        let pool = weak.upgrade().unwrap();
        let c = pool.alloc(0, 4 * MIB, S).unwrap();
        stamp(&c, 77);
        *slot.lock().unwrap() = Some(c);
    }));
    stamp(&blocks[0], 5);
    let r = pool.trim(None).unwrap();
    let c = late.lock().unwrap().take().unwrap();
    assert_eq!(r.split_arenas, 1, "{r:?}");
    assert!(stamped(&blocks[0], 5) && stamped(&c, 77));
    let s = pool.stats(0).unwrap();
    assert_eq!(s.reserved_bytes, 8 * MIB + 4 * MIB, "{r:?}");
    assert_eq!(watched(&w), pool_arenas(&pool));
    pool.validate(0).unwrap();
    for p in [blocks[0].ptr, c.ptr] {
        pool.free(p).unwrap();
    }
    pool.empty_cache(None).unwrap();
    assert!(sim.is_clean(0));
}

/// Survivors recorded by another thread's cache, a block cached by it, then a trim: the
/// thread keeps allocating and freeing afterwards and the pool's records stay consistent.
#[test]
fn survivors_of_another_threads_cache_are_moved_with_their_arena() {
    let (sim, pool) = pool(64 * MIB);
    let pool = Arc::new(pool);
    let (to_thread, rx) = std::sync::mpsc::channel::<u32>();
    let (tx, from_thread) = std::sync::mpsc::channel::<Vec<Allocation>>();
    let p = pool.clone();
    let worker = std::thread::spawn(move || {
        let blocks: Vec<_> = (0..16).map(|_| p.alloc(0, 4 * MIB, S).unwrap()).collect();
        for (i, b) in blocks.iter().enumerate() {
            if i % 5 != 0 {
                p.free(b.ptr).unwrap(); // into this thread's cache
            } else {
                stamp(b, i as u64);
            }
        }
        let kept: Vec<_> = blocks.into_iter().step_by(5).collect();
        tx.send(kept.clone()).unwrap();
        rx.recv().unwrap(); // the main thread trims meanwhile
        let again: Vec<_> = (0..8).map(|_| p.alloc(0, 4 * MIB, S).unwrap()).collect();
        p.validate(0).unwrap();
        for (i, b) in kept.iter().enumerate() {
            assert!(stamped(b, 5 * i as u64));
            p.free(b.ptr).unwrap();
        }
        for b in again {
            p.free(b.ptr).unwrap();
        }
        p.validate(0).unwrap();
    });
    let kept = from_thread.recv().unwrap();
    let r = pool.trim(None).unwrap();
    assert_eq!(r.split_arenas, 1, "{r:?}");
    let s = pool.stats(0).unwrap();
    assert_eq!(s.reserved_bytes, kept.len() as u64 * 4 * MIB, "{r:?}");
    pool.validate(0).unwrap();
    to_thread.send(0).unwrap();
    worker.join().unwrap();
    pool.empty_cache(None).unwrap();
    assert_eq!(pool.stats(0).unwrap().reserved_bytes, 0);
    assert!(sim.is_clean(0));
}

/// Trim, then sleep (offloading the survivors) and wake: the windows sleep and wake like
/// any arena, contents and addresses kept.
#[test]
fn windows_sleep_and_wake_after_a_trim() {
    let (sim, pool) = pool(64 * MIB);
    let blocks: Vec<_> = (0..8).map(|_| pool.alloc(0, 8 * MIB, S).unwrap()).collect();
    for b in &blocks[1..7] {
        pool.free(b.ptr).unwrap();
    }
    stamp(&blocks[0], 1);
    stamp(&blocks[7], 2);
    let r = pool.trim(None).unwrap();
    assert_eq!(r.windows, 2, "{r:?}");
    let tag = 0u8;
    let slept = pool.sleep(None, &[tag]).unwrap();
    assert_eq!(slept.arena_bytes, 16 * MIB, "{slept:?}");
    assert_eq!(sim.ledger(0).sleeping_bytes, 16 * MIB);
    assert_eq!(sim.ledger(0).held_bytes, 0);
    pool.wake(None, None).unwrap();
    assert!(stamped(&blocks[0], 1) && stamped(&blocks[7], 2));
    pool.validate(0).unwrap();
    for b in [blocks[0], blocks[7]] {
        pool.free(b.ptr).unwrap();
    }
    pool.empty_cache(None).unwrap();
    assert!(sim.is_clean(0));
}

/// A survivor in a window is shared through the broker and imported (in process): one
/// export, of its window only, and the importer sees its bytes; everything returns.
#[test]
fn a_window_is_shared_and_imported_with_one_export_of_its_own() {
    use gpu_arena::backend::Backend;
    use gpu_arena::ipc::{Broker, BrokerConfig, Importer, ShareHandle};
    let sim = Arc::new(SimBackend::new(SimConfig::default()).unwrap());
    let pool = common::validating_pool(&sim, 64 * MIB);
    let broker = Broker::start(pool.clone(), BrokerConfig::default()).unwrap();
    let blocks: Vec<_> = (0..8).map(|_| pool.alloc(0, 8 * MIB, S).unwrap()).collect();
    for b in &blocks[..7] {
        pool.free(b.ptr).unwrap();
    }
    let d = blocks[7];
    stamp(&d, 42);
    let r = pool.trim(None).unwrap();
    assert_eq!((r.split_arenas, r.released_bytes), (1, 56 * MIB), "{r:?}");
    let exports = pool.stats(0).unwrap().exports_total;
    let h = broker.share(d.ptr, d.bytes).unwrap();
    let h = ShareHandle::from_bytes(&h.to_bytes()).unwrap();
    let importer = Importer::new(sim.clone() as Arc<dyn Backend>);
    let p = importer.import(&h).unwrap();
    // (The sim also counts the pool's one-time export self-test.)
    assert_eq!(
        pool.stats(0).unwrap().exports_total,
        exports + 1,
        "one export"
    );
    assert_eq!(sim.ledger(0).open_exports, 1);
    assert_eq!(importer.imported_len(p), Some(d.bytes));
    let seen = Allocation { ptr: p, ..d };
    assert!(stamped(&seen, 42), "the importer sees the survivor's bytes");
    assert_eq!(
        sim.ledger(0).held_bytes,
        8 * MIB,
        "the export holds the window only"
    );
    importer.close(p).unwrap();
    broker.unshare(&h).unwrap();
    pool.free(d.ptr).unwrap();
    pool.empty_cache(None).unwrap();
    drop(broker);
    assert_eq!(pool.stats(0).unwrap().reserved_bytes, 0);
    assert!(sim.is_clean(0), "{:?}", sim.ledger(0));
}

/// The sim without `split_arena` (the trait's default: `Unavailable`), as a backend that
/// cannot split (legacy IPC arenas) behaves.
#[derive(Debug)]
struct NoSplit(Arc<SimBackend>);

mod no_split {
    use super::NoSplit;
    use gpu_arena::backend::{
        ArenaMem, Backend, DeviceId, Event, Export, ImportSource, Mapping, MemInfo, StreamId,
    };
    use gpu_arena::Result;

    impl Backend for NoSplit {
        fn name(&self) -> &'static str {
            "nosplit"
        }
        fn device_count(&self) -> Result<usize> {
            self.0.device_count()
        }
        fn granularity(&self, d: DeviceId) -> Result<u64> {
            self.0.granularity(d)
        }
        fn mem_info(&self, d: DeviceId) -> Result<MemInfo> {
            self.0.mem_info(d)
        }
        fn create_arena(&self, d: DeviceId, bytes: u64) -> Result<ArenaMem> {
            self.0.create_arena(d, bytes)
        }
        fn destroy_arena(&self, a: ArenaMem) -> Result<()> {
            self.0.destroy_arena(a)
        }
        fn export(&self, a: &ArenaMem) -> Result<Export> {
            self.0.export(a)
        }
        fn close_export(&self, a: &ArenaMem, e: Export) -> Result<()> {
            self.0.close_export(a, e)
        }
        fn import(&self, d: DeviceId, s: ImportSource<'_>, bytes: u64) -> Result<Mapping> {
            self.0.import(d, s, bytes)
        }
        fn unmap_import(&self, m: Mapping) -> Result<()> {
            self.0.unmap_import(m)
        }
        fn record_event(&self, d: DeviceId, s: StreamId) -> Result<Event> {
            self.0.record_event(d, s)
        }
        fn event_done(&self, e: &Event) -> Result<bool> {
            self.0.event_done(e)
        }
        fn destroy_event(&self, e: Event) -> Result<()> {
            self.0.destroy_event(e)
        }
        fn synchronize(&self, d: DeviceId) -> Result<()> {
            self.0.synchronize(d)
        }
    }
}

/// A backend that cannot split: trim does what empty_cache does, reports the arenas with
/// survivors as kept, returns no error, and observers hear only of the emptied arena.
#[test]
fn a_backend_without_split_keeps_arenas_whole_without_an_error() {
    let sim = Arc::new(SimBackend::new(SimConfig::default()).unwrap());
    let config = gpu_arena::PoolConfig {
        arena_size: 64 * MIB,
        grow_arenas: false,
        validate: true,
        ..Default::default()
    };
    let pool = Pool::new(Arc::new(NoSplit(sim.clone())), config).unwrap();
    let w = Arc::new(Watcher::default());
    let id = pool.observe_arenas(w.clone());
    // Two arenas: one emptied, one with a survivor.
    let blocks: Vec<_> = (0..16)
        .map(|_| pool.alloc(0, 8 * MIB, S).unwrap())
        .collect();
    for b in &blocks[1..] {
        pool.free(b.ptr).unwrap();
    }
    stamp(&blocks[0], 8);
    let r = pool.trim(None).unwrap();
    assert_eq!(
        (
            r.emptied_bytes,
            r.split_arenas,
            r.released_bytes,
            r.kept_other_bytes
        ),
        (64 * MIB, 0, 0, 64 * MIB),
        "{r:?}"
    );
    assert_eq!(pool.stats(0).unwrap().reserved_bytes, 64 * MIB);
    assert!(stamped(&blocks[0], 8));
    assert_eq!(watched(&w), pool_arenas(&pool));
    // Only the emptied arena was released: the one the backend cannot split was left alone
    // (no on_release / on_ready churn for a transport).
    assert_eq!(
        (
            w.releases.load(Ordering::SeqCst),
            w.readies.load(Ordering::SeqCst)
        ),
        (1, 2)
    );
    pool.validate(0).unwrap();
    pool.unobserve_arenas(id).unwrap();
    pool.free(blocks[0].ptr).unwrap();
    pool.empty_cache(None).unwrap();
    assert!(sim.is_clean(0));
}

/// `trim_on_empty_cache=1`: every `empty_cache` trims.
#[test]
fn trim_on_empty_cache_makes_empty_cache_trim() {
    let cfg =
        gpu_arena::Config::parse("backend=sim,arena_size=64MiB,trim_on_empty_cache=1,validate=1")
            .unwrap();
    assert!(cfg.pool.trim_on_empty_cache);
    let sim = Arc::new(SimBackend::new(SimConfig::default()).unwrap());
    let pool = Pool::new(sim.clone(), cfg.pool).unwrap();
    let blocks: Vec<_> = (0..8).map(|_| pool.alloc(0, 8 * MIB, S).unwrap()).collect();
    for b in &blocks[1..] {
        pool.free(b.ptr).unwrap();
    }
    assert_eq!(pool.empty_cache(None).unwrap(), 56 * MIB);
    assert_eq!(pool.stats(0).unwrap().reserved_bytes, 8 * MIB);
    pool.free(blocks[0].ptr).unwrap();
    pool.empty_cache(None).unwrap();
    assert!(sim.is_clean(0));
}
