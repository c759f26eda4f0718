//! A growing arena's miss for a request larger than any cached block gives back only the
//! run of cached blocks that makes room for it (`pool/front/cached_runs.rs`); the other cached
//! blocks stay cached. When no run makes room, every cached block goes back before the arena
//! grows, as before.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use gpu_arena::{Pool, StreamId};

mod common;

const MIB: u64 = 1 << 20;
const S: StreamId = StreamId(7);

/// A validating pool with growing arenas over a 1 GiB sim device.
fn growing_pool() -> Arc<Pool> {
    common::growing_pool(1 << 30, true).1
}

/// 2 MiB blocks on `S` until the large class's arena has no free byte left, in address
/// order.
fn fill_with_blocks(pool: &Pool) -> Vec<u64> {
    let mut ptrs = Vec::new();
    for _ in 0..256 {
        ptrs.push(pool.alloc(0, 2 * MIB, S).unwrap().ptr);
        let s = pool.stats(0).unwrap();
        if ptrs.len() >= 12 && s.reserved_bytes == s.allocated_bytes {
            ptrs.sort_unstable();
            return ptrs;
        }
    }
    panic!("the arena never filled up");
}

/// The blocks of the large arenas that are allocated without a live allocation (held by
/// a cache), and those that are free in the sub-allocator, by address.
fn cached_and_free(pool: &Pool, live: &[u64]) -> (Vec<u64>, Vec<u64>) {
    let mut cached = Vec::new();
    let mut free = Vec::new();
    for seg in pool.segments(0).unwrap().iter().filter(|s| !s.small) {
        for b in &seg.blocks {
            if !b.allocated {
                free.push(b.ptr);
            } else if !live.contains(&b.ptr) {
                cached.push(b.ptr);
            }
        }
    }
    (cached, free)
}

#[test]
fn a_larger_miss_takes_back_only_the_cached_run_that_fits_it() {
    let pool = growing_pool();
    let blocks = fill_with_blocks(&pool);
    let growths = pool.stats(0).unwrap().arena_growths;
    // Cached: three blocks alone between live ones, and a run of two.
    let singles = [blocks[1], blocks[3], blocks[5]];
    let run = [blocks[8], blocks[9]];
    for &p in singles.iter().chain(&run) {
        pool.free(p).unwrap();
    }
    let mut live: Vec<u64> = blocks
        .iter()
        .copied()
        .filter(|p| !singles.contains(p) && !run.contains(p))
        .collect();
    assert_eq!(
        cached_and_free(&pool, &live),
        (
            vec![blocks[1], blocks[3], blocks[5], blocks[8], blocks[9]],
            vec![]
        )
    );

    // 4 MiB fits only where the run lies: it is given back and serves the request.
    let four = pool.alloc(0, 4 * MIB, S).unwrap();
    assert_eq!(four.ptr, run[0]);
    live.push(four.ptr);
    // The blocks alone stay cached; nothing grew.
    assert_eq!(cached_and_free(&pool, &live), (singles.to_vec(), vec![]));
    assert_eq!(pool.stats(0).unwrap().arena_growths, growths);
    // And they serve the next 2 MiB requests.
    let mut again: Vec<u64> = (0..3)
        .map(|_| pool.alloc(0, 2 * MIB, S).unwrap().ptr)
        .collect();
    again.sort_unstable();
    assert_eq!(again, singles);
    pool.validate(0).unwrap();
}

#[test]
fn with_no_fitting_run_every_cached_block_goes_back_before_the_arena_grows() {
    let pool = growing_pool();
    let blocks = fill_with_blocks(&pool);
    let growths = pool.stats(0).unwrap().arena_growths;
    let singles = [blocks[1], blocks[3], blocks[5]];
    for &p in &singles {
        pool.free(p).unwrap();
    }
    let live: Vec<u64> = blocks
        .iter()
        .copied()
        .filter(|p| !singles.contains(p))
        .collect();
    // No run of cached blocks makes 4 MiB: the arena grows, and the cached blocks were
    // given back to the sub-allocator first (free ranges now, not cached).
    let four = pool.alloc(0, 4 * MIB, S).unwrap();
    assert!(!singles.contains(&four.ptr));
    assert!(pool.stats(0).unwrap().arena_growths > growths);
    let (cached, free) = cached_and_free(&pool, &[live, vec![four.ptr]].concat());
    assert!(cached.is_empty(), "{cached:x?}");
    for p in singles {
        assert!(free.contains(&p), "{p:#x} not free: {free:x?}");
    }
    pool.validate(0).unwrap();
}
