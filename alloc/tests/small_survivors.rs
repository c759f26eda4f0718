//! What survivors keep after `empty_cache` (`alloc/src/pool/sizes/classes.rs`): small blocks
//! (up to 1 MiB) live in 2 MiB arenas of their own, so a few small tensors no longer pin a
//! 1 GiB arena; a large survivor keeps its arena (docs/ARCHITECTURE.md, "Survivors after
//! empty_cache") until `trim` cuts it down to the survivor's own pages.
#![allow(clippy::unwrap_used)]

use std::collections::HashSet;
use std::sync::Arc;

use gpu_arena::backend::sim::{SimBackend, SimConfig};
use gpu_arena::pool::{LARGE_MIN, SMALL_ARENA};
use gpu_arena::{Pool, StreamId};
use proptest::prelude::*;

mod common;
use common::sim_pool;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const S: StreamId = StreamId(0x1000);

fn pool(arena_size: u64, validate: bool) -> (Arc<SimBackend>, Pool) {
    sim_pool(
        SimConfig {
            capacity: 64 * GIB,
            ..SimConfig::default()
        },
        arena_size,
        validate,
    )
}

/// Each arena of device 0 as (base, bytes, small, live allocations), from the snapshot.
fn arenas(pool: &Pool) -> Vec<(u64, u64, bool, u64)> {
    let v: serde_json::Value = serde_json::from_str(&pool.snapshot_json()).unwrap();
    v["devices"][0]["arenas"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            (
                a["base"].as_u64().unwrap(),
                a["bytes"].as_u64().unwrap(),
                a["small"].as_bool().unwrap(),
                a["live_allocations"].as_u64().unwrap(),
            )
        })
        .collect()
}

/// The pattern: 600 live 4 KiB allocations scattered among 1,500 freed 4 MiB ones
/// kept 1,024 MiB reserved after empty_cache; now the small ones share two 2 MiB arenas.
#[test]
fn six_hundred_small_survivors_among_freed_large_blocks_keep_4_mib() {
    let (sim, pool) = pool(GIB, false);
    let (mut small, mut large) = (Vec::new(), Vec::new());
    for i in 0..2100u32 {
        // Two small among every seven: scattered through the allocation order.
        if i % 7 < 2 {
            small.push(pool.alloc(0, 4 * KIB, S).unwrap());
        } else {
            large.push(pool.alloc(0, 4 * MIB, S).unwrap());
        }
    }
    assert_eq!((small.len(), large.len()), (600, 1500));
    for a in &large {
        pool.free(a.ptr).unwrap();
    }
    pool.empty_cache(None).unwrap();
    pool.validate(0).unwrap();
    let s = pool.stats(0).unwrap();
    let live = s.allocated_bytes;
    assert_eq!(live, 600 * 4 * KIB);
    assert_eq!(s.reserved_bytes, 4 * MIB, "two 2 MiB small arenas");
    assert!(s.reserved_bytes <= 2 * live + SMALL_ARENA);
    assert_eq!(sim.ledger(0).held_bytes, 4 * MIB);
    for a in &small {
        pool.free(a.ptr).unwrap();
    }
    pool.empty_cache(None).unwrap();
    assert!(sim.is_clean(0));
}

/// Small blocks of mixed sizes, every tenth kept: each arena left holds a survivor, every
/// one is a 2 MiB small arena, and reserved is at most 2 MiB per survivor.
#[test]
fn scattered_small_survivors_keep_only_their_2_mib_arenas() {
    let (_sim, pool) = pool(GIB, true);
    let sizes = [512, 4 * KIB, 48 * KIB, 300 * KIB, MIB];
    let blocks: Vec<_> = (0..400usize)
        .map(|i| pool.alloc(0, sizes[i % sizes.len()], S).unwrap())
        .collect();
    // One large block among them: freed, its arena goes.
    let big = pool.alloc(0, 64 * MIB, S).unwrap();
    pool.free(big.ptr).unwrap();
    let mut kept = Vec::new();
    for (i, b) in blocks.iter().enumerate() {
        if i % 10 == 0 {
            kept.push(*b);
        } else {
            pool.free(b.ptr).unwrap();
        }
    }
    let before = pool.stats(0).unwrap().reserved_bytes;
    let released = pool.empty_cache(None).unwrap();
    assert!(
        released > GIB,
        "the large arena and empty small arenas went"
    );
    let left = arenas(&pool);
    assert!(left
        .iter()
        .all(|&(_, bytes, small, live)| small && bytes == SMALL_ARENA && live > 0));
    let s = pool.stats(0).unwrap();
    assert_eq!(s.reserved_bytes, before - released);
    assert_eq!(s.reserved_bytes, SMALL_ARENA * left.len() as u64);
    assert!(s.reserved_bytes <= SMALL_ARENA * kept.len() as u64);
    for b in kept {
        pool.free(b.ptr).unwrap();
    }
    pool.empty_cache(None).unwrap();
    assert_eq!(pool.stats(0).unwrap().reserved_bytes, 0);
}

/// Each class settles its own streams: an event a small-class miss recorded for a stream
/// (pending while the stream is busy) does not keep that stream's freed large range from
/// serving another stream once the work is done, and small and large misses never flush or
/// settle each other's blocks.
#[test]
fn a_small_class_settle_does_not_strand_another_streams_large_range() {
    const S2: StreamId = StreamId(0x2000);
    let (sim, pool) = pool(64 * MIB, true);
    // Past SMALL_GROW_FREELY, so that a small miss settles instead of growing.
    let n = (gpu_arena::pool::SMALL_GROW_FREELY / MIB) as usize + 8;
    let small: Vec<_> = (0..n).map(|_| pool.alloc(0, MIB, S).unwrap()).collect();
    let large = pool.alloc(0, 40 * MIB, S).unwrap();
    for a in small.iter().chain([&large]) {
        pool.free(a.ptr).unwrap();
    }
    sim.block_stream(0, S);
    let creates = pool.stats(0).unwrap().backend_creates;
    // S2's small request: S's ranges wait for S's event (pending): a new small arena.
    let b = pool.alloc(0, MIB, S2).unwrap();
    assert!(
        sim.pending_events(0) >= 1,
        "an event was recorded on the busy stream"
    );
    assert_eq!(pool.stats(0).unwrap().backend_creates, creates + 1);
    sim.unblock_stream(0, S);
    // S's work is done: its freed large range serves S2 without a new arena.
    let l = pool.alloc(0, 40 * MIB, S2).unwrap();
    assert_eq!(l.ptr, large.ptr, "the large range S freed");
    assert_eq!(pool.stats(0).unwrap().backend_creates, creates + 1);
    pool.free(b.ptr).unwrap();
    pool.free(l.ptr).unwrap();
    pool.empty_cache(None).unwrap();
    assert!(sim.is_clean(0));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Any allocation sequence (512 B to 40 MiB, 64 MiB arenas) and any survivors: after
    /// empty_cache every arena left holds a survivor, small and large blocks never share an
    /// arena, and reserved is at most 2 MiB per small survivor plus one arena (`arena_size`,
    /// or its own size when larger) per large survivor: the bound the pool guarantees.
    /// Reserved is then at most 2 x live + 2 MiB whenever the small survivors are packed
    /// (allocated together), which the first test checks.
    #[test]
    fn survivors_keep_at_most_their_own_arenas(
        ops in proptest::collection::vec((0u64..6, 1u64..=100, any::<bool>()), 1..120),
    ) {
        let arena_size = 64 * MIB;
        let (sim, pool) = pool(arena_size, true);
        let mut survivors = Vec::new();
        for (kind, x, keep) in ops {
            let bytes = match kind {
                0 => 512 * x,                   // up to 50 KiB
                1 | 2 => 10 * KIB * x,          // up to 1000 KiB
                3 => LARGE_MIN + 1 + 100 * KIB * x,
                4 => 400 * KIB * x,             // up to 40 MiB: either class
                _ => MIB * (x % 40 + 1),
            };
            let a = pool.alloc(0, bytes, S).unwrap();
            if keep {
                survivors.push(a);
            } else {
                pool.free(a.ptr).unwrap();
            }
        }
        pool.empty_cache(None).unwrap();
        let left = arenas(&pool);
        let live_in: HashSet<u64> = left.iter().filter(|a| a.3 > 0).map(|a| a.0).collect();
        prop_assert_eq!(live_in.len(), left.len(), "an arena without survivors was kept");
        let mut bound = 0;
        for a in &survivors {
            let (_, bytes, small, _) = *left
                .iter()
                .find(|(base, bytes, _, _)| (*base..base + bytes).contains(&a.ptr))
                .unwrap();
            prop_assert_eq!(small, a.bytes <= LARGE_MIN, "block of {} in the wrong class", a.bytes);
            prop_assert!(!small || bytes == SMALL_ARENA);
            bound += if small { SMALL_ARENA } else { arena_size.max(a.bytes) };
        }
        let s = pool.stats(0).unwrap();
        prop_assert!(s.reserved_bytes <= bound, "{} reserved, bound {}", s.reserved_bytes, bound);
        prop_assert_eq!(s.reserved_bytes, left.iter().map(|a| a.1).sum::<u64>());
        // trim (pool/growth/trim.rs) then gives the exact bound: a large survivor keeps its own
        // bytes (2 MiB multiples at 2 MiB offsets), a small one its 2 MiB small arena.
        let small_arenas: HashSet<u64> = left.iter().filter(|a| a.2).map(|a| a.0).collect();
        let large_live: u64 = survivors.iter().filter(|a| a.bytes > LARGE_MIN).map(|a| a.bytes).sum();
        pool.trim(None).unwrap();
        let t = pool.stats(0).unwrap();
        prop_assert_eq!(t.reserved_bytes, large_live + SMALL_ARENA * small_arenas.len() as u64);
        prop_assert!(t.reserved_bytes <= 2 * t.allocated_bytes + SMALL_ARENA * small_arenas.len() as u64);
        prop_assert_eq!(sim.ledger(0).held_bytes, t.reserved_bytes);
        for a in survivors {
            pool.free(a.ptr).unwrap();
        }
        pool.empty_cache(None).unwrap();
        prop_assert!(sim.is_clean(0));
    }
}
