//! Stress: 8 threads x N mixed operations on one sim [`Pool`] — alloc, free, record_stream
//! on several streams, share / unshare, open_lease / close_lease (through the pool's API,
//! as the broker calls it, on this thread's and other threads' shares), occasional
//! empty_cache and trim, and in [`stress_sleep_and_wake_beside_mixed_ops`] each thread's tag
//! put to sleep and woken — then `validate()`, and after closing everything and
//! `empty_cache` every byte is back and the sim ledger is clean. Every block carries a
//! canary (its first bytes, written at allocation, checked before its free: two live blocks
//! that overlap overwrite each other's), and without sleepers threads hand blocks to each
//! other (a free on another thread than the allocating one, whose cache holds the record).
//! A trim runs alone (its contract: nothing touches gpu-arena memory until it returns); an
//! empty_cache runs beside the other threads' canary writes (its chunk drop moves no byte).
//!
//! N is [`DEFAULT_OPS`] per thread (fast in debug CI) or `GPU_ARENA_STRESS_OPS`; the
//! `#[ignore]`d [`stress_8_threads_million_ops`] runs 10^6 per thread (issue 6):
//! `cargo test --release -p gpu-arena --test stress -- --ignored`.
#![allow(clippy::unwrap_used)]

use std::sync::{Arc, Barrier};
use std::time::Instant;

use gpu_arena::backend::sim::{SimBackend, SimConfig};
use gpu_arena::{tags, Pool, PoolConfig, ShareInfo, StreamId};

mod common;
use common::{fill, read, stress_ops, Rng};

const MIB: u64 = 1 << 20;
const THREADS: usize = 8;
const DEFAULT_OPS: u64 = 100_000;
/// Most live allocations one thread keeps.
const MAX_LIVE: usize = 48;
/// Bytes of a block's canary (fewer when the request is smaller).
const CANARY: usize = 64;

/// What the threads share: shares to lease, blocks handed from one thread to another, and
/// the lock a trim takes alone (canaries are written and read under its read side).
#[derive(Default)]
struct Boards {
    shares: parking_lot::Mutex<Vec<ShareInfo>>,
    handoff: parking_lot::Mutex<Vec<Held>>,
    quiet: parking_lot::RwLock<()>,
}

/// A live block: its address, the bytes a share may cover (the request rounded to 512) and
/// its canary's seed.
#[derive(Clone, Copy)]
struct Held {
    ptr: u64,
    bytes: u64,
    seed: u8,
}

impl Held {
    fn canary_len(&self) -> usize {
        CANARY.min(self.bytes as usize)
    }

    fn write_canary(&self, boards: &Boards) {
        let _q = boards.quiet.read();
        fill(self.ptr, self.canary_len(), self.seed);
    }

    fn assert_canary(&self, boards: &Boards, pool: &Pool) {
        let mut want = vec![0u8; self.canary_len()];
        fill(want.as_mut_ptr() as u64, want.len(), self.seed);
        let q = boards.quiet.read();
        let found = read(self.ptr, want.len());
        if found == want {
            return;
        }
        drop(q);
        // What the pool says about the block, for the report: its own checks, and the
        // arena and ranges around the block.
        let validated = pool.validate(0);
        let around: Vec<String> = pool
            .segments(0)
            .unwrap_or_default()
            .iter()
            .filter(|s| s.base <= self.ptr && self.ptr < s.base + s.bytes)
            .map(|s| {
                let blocks: Vec<String> = s
                    .blocks
                    .iter()
                    .filter(|b| b.ptr < self.ptr + self.bytes && self.ptr < b.ptr + b.bytes)
                    .map(|b| format!("{:#x}+{} allocated {}", b.ptr, b.bytes, b.allocated))
                    .collect();
                format!("arena {:#x}+{}: {blocks:?}", s.base, s.bytes)
            })
            .collect();
        panic!(
            "block {:#x} ({} bytes)'s canary changed: another live block overlaps it \
             (first bytes {:02x?}, want {:02x?}); validate: {validated:?}; {around:?}",
            self.ptr,
            self.bytes,
            &found[..found.len().min(16)],
            &want[..want.len().min(16)]
        );
    }
}

#[derive(Default, Debug, Clone, Copy)]
struct Counts {
    allocs: u64,
    frees: u64,
    handoffs: u64,
    records: u64,
    shares: u64,
    unshares: u64,
    leases: u64,
    lease_refusals: u64,
    closes: u64,
    empties: u64,
    trims: u64,
    sleeps: u64,
}

fn pool() -> (Arc<SimBackend>, Arc<Pool>) {
    let sim = Arc::new(SimBackend::new(SimConfig::default()).unwrap());
    let pool = Pool::new(
        sim.clone(),
        PoolConfig {
            arena_size: 64 * MIB,
            // validate() after every op would serialize the threads on an O(n) walk; it
            // runs at the end (and the pool's own debug checks stay in the sub-allocator).
            validate: false,
            ..PoolConfig::default()
        },
    )
    .unwrap();
    (sim, Arc::new(pool))
}

fn size(rng: &mut Rng) -> u64 {
    match rng.below(16) {
        0 => 1 + rng.below(6 * MIB),  // large: its own 2 MiB multiples
        1..=4 => 1 + rng.below(MIB),  // quarter-octave classes
        _ => 1 + rng.below(16 << 10), // small
    }
}

/// One thread's work. Shares made here go to `board` so other threads lease them. With
/// `sleeper`, the thread allocates with a tag of its own and now and then puts it to sleep
/// (offloaded), finds an allocation with it refused, wakes it and checks a canary's bytes.
fn worker(pool: &Pool, boards: &Boards, seed: u64, ops: u64, sleeper: bool) -> Counts {
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let mut c = Counts::default();
    let own = sleeper.then(|| {
        let name = format!("stress_sleeper_{seed}");
        tags::set_current(Some(&name)).unwrap();
        let tag = tags::index(Some(&name)).unwrap();
        let canary = pool.alloc(0, 64 << 10, StreamId(0)).unwrap();
        let q = boards.quiet.read();
        fill(canary.ptr, 64 << 10, seed as u8);
        drop(q);
        (tag, canary.ptr)
    });
    let streams = [
        StreamId(0),
        StreamId(11 + seed),
        StreamId(100),
        StreamId(200),
    ];
    let mut live: Vec<Held> = Vec::new();
    let mut shares: Vec<ShareInfo> = Vec::new();
    let mut leases: Vec<u32> = Vec::new();
    for _ in 0..ops {
        match rng.below(100) {
            0..=29 if live.len() < MAX_LIVE => {
                let s = streams[rng.below(4) as usize];
                let req = size(&mut rng);
                let a = pool.alloc(0, req, s).unwrap();
                // A share may cover the request rounded to 512 bytes.
                let held = Held {
                    ptr: a.ptr,
                    bytes: req.next_multiple_of(512),
                    seed: rng.next() as u8,
                };
                held.write_canary(boards);
                live.push(held);
                c.allocs += 1;
            }
            0..=41 if !live.is_empty() => {
                // Free: plain, recorded or still shared (deferred) alike.
                let held = live.swap_remove(rng.below(live.len() as u64) as usize);
                held.assert_canary(boards, pool);
                pool.free(held.ptr).unwrap();
                c.frees += 1;
            }
            42..=44 if !sleeper => {
                // A block to another thread, or one from another thread to this one.
                let mut handoff = boards.handoff.lock();
                if handoff.len() < 64 && !live.is_empty() && rng.below(2) == 0 {
                    handoff.push(live.swap_remove(rng.below(live.len() as u64) as usize));
                } else if let Some(held) = handoff.pop() {
                    live.push(held);
                    c.handoffs += 1;
                }
            }
            45..=54 if !live.is_empty() => {
                let p = live[rng.below(live.len() as u64) as usize].ptr;
                pool.record_stream(p, streams[rng.below(4) as usize])
                    .unwrap();
                c.records += 1;
            }
            55..=66 if !live.is_empty() && shares.len() < 32 => {
                let Held {
                    ptr: p, bytes: b, ..
                } = live[rng.below(live.len() as u64) as usize];
                let off = rng.below(b / 512) * 512;
                let len = 1 + rng.below(b - off);
                let info = pool.share(p + off, len).unwrap();
                shares.push(info);
                let mut board = boards.shares.lock();
                if board.len() < 256 {
                    board.push(info);
                }
                c.shares += 1;
            }
            67..=77 if !shares.is_empty() => {
                let info = shares.swap_remove(rng.below(shares.len() as u64) as usize);
                pool.unshare(0, info.share_key, &info.token).unwrap();
                c.unshares += 1;
            }
            78..=88 if leases.len() < 64 => {
                // A lease on anyone's share: it may be unshared meanwhile (refused), or its
                // key reused by a newer share (the token tells them apart).
                let info = {
                    let board = boards.shares.lock();
                    if board.is_empty() {
                        continue;
                    }
                    board[rng.below(board.len() as u64) as usize]
                };
                match pool.open_lease(0, info.share_key, &info.token) {
                    Ok(g) => {
                        assert_eq!(g.share, info);
                        leases.push(g.lease_key);
                        c.leases += 1;
                    }
                    Err(_) => {
                        c.lease_refusals += 1;
                        boards.shares.lock().retain(|b| *b != info);
                    }
                }
            }
            89..=98 if !leases.is_empty() => {
                let l = leases.swap_remove(rng.below(leases.len() as u64) as usize);
                pool.close_lease(0, l).unwrap();
                c.closes += 1;
            }
            98 if own.is_some() && rng.below(10) == 0 => {
                let (tag, canary) = own.unwrap_or_default();
                pool.sleep_tags(Some(0), Some(&[tag]), &[tag]).unwrap();
                assert!(
                    pool.alloc(0, 4096, streams[0]).is_err(),
                    "allocated while asleep"
                );
                pool.wake(Some(0), Some(&[tag])).unwrap();
                let mut want = vec![0u8; 64 << 10];
                fill(want.as_mut_ptr() as u64, want.len(), seed as u8);
                let _q = boards.quiet.read();
                assert!(read(canary, want.len()) == want, "the canary changed");
                c.sleeps += 1;
            }
            99 if rng.below(20) == 0 => {
                // Now and then a trim or an empty_cache while the other threads allocate,
                // free, share and write their canaries (the pool calls wait for the device
                // lock). A trim splits arenas with survivors: each kept window gets new
                // memory holding a copy of its bytes (on a GPU too; the sim's is
                // `backend/sim/split.rs`), so it runs alone, no canary touched meanwhile:
                // one written between the copy and the remap would be lost. An empty_cache
                // needs no such care: it drops a grown arena's free chunks and leaves the
                // kept chunks mapped where they are, pages untouched (a memfd per sim chunk,
                // as `backend/vmm/chunk_drop.rs` keeps each physical allocation); when the
                // sim copied kept runs, this test failed 1 run in 15 under load with
                // empty_cache outside the lock (a live block read back as zeros).
                if rng.below(4) == 0 {
                    let _alone = boards.quiet.write();
                    pool.trim(Some(0)).unwrap();
                    c.trims += 1;
                } else {
                    pool.empty_cache(Some(0)).unwrap();
                    c.empties += 1;
                }
            }
            _ => {}
        }
    }
    for l in leases {
        pool.close_lease(0, l).unwrap();
    }
    for info in shares {
        pool.unshare(0, info.share_key, &info.token).unwrap();
    }
    for held in live {
        held.assert_canary(boards, pool);
        pool.free(held.ptr).unwrap();
    }
    if let Some((_, canary)) = own {
        pool.free(canary).unwrap();
        tags::set_current(None).unwrap();
    }
    c
}

fn run(ops_per_thread: u64, sleepers: bool) {
    let (sim, pool) = pool();
    // Run the export self-test once before the threads start (racing first shares are
    // their own test: first_shares_race_the_export_self_test below).
    pool.export_semantics(0).unwrap();
    let boards = Arc::new(Boards::default());
    let barrier = Arc::new(Barrier::new(THREADS));
    let t0 = Instant::now();
    let handles: Vec<_> = (0..THREADS as u64)
        .map(|i| {
            let (pool, boards, barrier) = (pool.clone(), boards.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                worker(&pool, &boards, i + 1, ops_per_thread, sleepers)
            })
        })
        .collect();
    let mut total = Counts::default();
    for h in handles {
        let c = h.join().unwrap();
        total.allocs += c.allocs;
        total.frees += c.frees;
        total.handoffs += c.handoffs;
        total.records += c.records;
        total.shares += c.shares;
        total.unshares += c.unshares;
        total.leases += c.leases;
        total.lease_refusals += c.lease_refusals;
        total.closes += c.closes;
        total.empties += c.empties;
        total.trims += c.trims;
        total.sleeps += c.sleeps;
    }
    let elapsed = t0.elapsed();
    // Blocks left on the handoff board: freed here, a thread that made none of them.
    for held in boards.handoff.lock().drain(..) {
        held.assert_canary(&boards, &pool);
        pool.free(held.ptr).unwrap();
    }
    pool.validate(0).unwrap();
    let s = pool.stats(0).unwrap();
    eprintln!(
        "stress: {THREADS} threads x {ops_per_thread} ops in {elapsed:.2?}; {total:?}; peak reserved {} MiB",
        s.peak_reserved_bytes / MIB
    );
    assert_eq!(
        (
            s.shares_live,
            s.imports_live,
            s.exports_live,
            s.deferred_free_bytes
        ),
        (0, 0, 0, 0),
        "{s:?}"
    );
    assert!(total.shares > 0 && total.leases > 0 && total.records > 0);
    assert_eq!(total.sleeps > 0, sleepers, "{total:?}");
    assert_eq!(total.handoffs > 0, !sleepers, "{total:?}");
    // Frees recorded on other streams wait for events until the synchronize of empty_cache.
    pool.empty_cache(None).unwrap();
    pool.validate(0).unwrap();
    let s = pool.stats(0).unwrap();
    assert_eq!(
        (
            s.allocations,
            s.allocated_bytes,
            s.pending_free_bytes,
            s.reserved_bytes,
            s.arenas
        ),
        (0, 0, 0, 0, 0),
        "{s:?}"
    );
    let ledger = sim.ledger(0);
    assert!(ledger.is_clean(), "{ledger:?}");
}

#[test]
fn stress_8_threads_mixed_ops() {
    run(stress_ops(DEFAULT_OPS), false);
}

/// The same with every thread on a tag of its own, put to sleep and woken now and then while
/// the others work.
#[test]
fn stress_sleep_and_wake_beside_mixed_ops() {
    run(stress_ops(DEFAULT_OPS) / 4, true);
}

/// Issue 6's figure: 8 threads x 10^6 operations. Run in release.
#[test]
#[ignore = "long: cargo test --release -p gpu-arena --test stress -- --ignored"]
fn stress_8_threads_million_ops() {
    run(stress_ops(1_000_000), false);
}

/// The first shares of a device race: the export self-test runs inside the first one with
/// the lock released. Each thread shares the same allocation once; afterwards exactly one
/// export must be live, and all must close.
fn first_shares_race_once() {
    let (sim, pool) = pool();
    let a = pool.alloc(0, MIB, StreamId(0)).unwrap();
    let barrier = Arc::new(Barrier::new(THREADS));
    let infos: Vec<ShareInfo> = (0..THREADS)
        .map(|_| {
            let (pool, barrier) = (pool.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                pool.share(a.ptr, 4096).unwrap()
            })
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|h| h.join().unwrap())
        .collect();
    let s = pool.stats(0).unwrap();
    assert_eq!(s.exports_live, 1, "two exports made of one arena: {s:?}");
    for i in &infos {
        pool.unshare(0, i.share_key, &i.token).unwrap();
    }
    pool.free(a.ptr).unwrap();
    pool.empty_cache(None).unwrap();
    let ledger = sim.ledger(0);
    assert!(
        ledger.is_clean(),
        "an export was dropped without close: {ledger:?}"
    );
}

/// Regression test for the race the loom model found in `ensure_exported` (see
/// loom_lifetime.rs), fixed by running the self-test before the state check.
#[test]
fn first_shares_race_the_export_self_test() {
    for _ in 0..200 {
        first_shares_race_once();
    }
}
