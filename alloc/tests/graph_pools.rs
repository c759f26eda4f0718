//! Graph pools (PyTorch's private pools for CUDA graphs) over the sim backend: routing, a
//! block's pool for life, nothing released while a pool is in use, no events while
//! allocations are routed, checkpoints restored at the same addresses, bad input; and a
//! property test that no block of a pool in use is ever handed to another allocation.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use gpu_arena::backend::sim::{SimBackend, SimCall, SimConfig};
use gpu_arena::{GraphPoolId, Pool, PoolBlock, PoolConfig, StreamId};
use proptest::prelude::*;

const MIB: u64 = 1 << 20;
const CAPTURE: StreamId = StreamId(0xC0);
const S1: StreamId = StreamId(0x1000);
const S2: StreamId = StreamId(0x2000);
const G1: GraphPoolId = GraphPoolId(0, 1);
const G2: GraphPoolId = GraphPoolId(0, 2);

fn pool() -> (Arc<SimBackend>, Pool) {
    let backend = Arc::new(SimBackend::new(SimConfig::default()).unwrap());
    let config = PoolConfig {
        arena_size: 64 * MIB,
        validate: true,
        ..PoolConfig::default()
    };
    (backend.clone(), Pool::new(backend, config).unwrap())
}

fn overlaps(a: (u64, u64), b: (u64, u64)) -> bool {
    a.0 < b.0 + b.1 && b.0 < a.0 + a.1
}

/// The case, on sim: two graphs sharing a pool, their temporaries freed during
/// capture; afterwards 32 ordinary allocations (of the graphs' sizes, on the capture
/// stream too) never land on anything the graphs were given.
#[test]
fn allocations_after_capture_never_land_on_a_graph_s_memory() {
    let (_sim, pool) = pool();
    // Memory the general pool already holds, freed on the capture stream: the capture must
    // not take it, and must not give it back into the pool either.
    let warm: Vec<_> = (0..8)
        .map(|_| pool.alloc(0, 4 * MIB, CAPTURE).unwrap())
        .collect();
    for a in &warm {
        pool.free(a.ptr).unwrap();
    }
    let mut graph_ranges = Vec::new();
    let mut outputs = Vec::new();
    for (g, sizes) in [
        (G1, [4 * MIB, 1024 * 4 * 256, 4 * MIB]),
        (G1, [2 * MIB, 512 * 1024, 2 * MIB]),
    ] {
        pool.graph_pool_begin(0, g).unwrap();
        let input = pool.graph_pool_alloc(0, g, sizes[0], CAPTURE).unwrap();
        let hidden = pool.graph_pool_alloc(0, g, sizes[1], CAPTURE).unwrap();
        let out = pool.graph_pool_alloc(0, g, sizes[2], CAPTURE).unwrap();
        for a in [input, hidden, out] {
            assert!(
                warm.iter()
                    .all(|w| !overlaps((w.ptr, w.bytes), (a.ptr, a.bytes))),
                "a graph pool took the general pool's memory"
            );
            graph_ranges.push((a.ptr, a.bytes));
        }
        pool.free(hidden.ptr).unwrap();
        pool.free(input.ptr).unwrap();
        outputs.push(out);
        pool.graph_pool_end(0, g).unwrap();
    }
    assert_eq!(pool.graph_pool_use_count(0, G1).unwrap(), 2);
    for stream in [CAPTURE, S1] {
        for size in [4 * MIB, 2 * MIB, 1024 * 1024, 512 * 1024, 256 * 4096] {
            for _ in 0..32 {
                let a = pool.alloc(0, size, stream).unwrap();
                for &r in &graph_ranges {
                    assert!(
                        !overlaps(r, (a.ptr, a.bytes)),
                        "{a:?} overlaps a graph's {r:x?}"
                    );
                }
            }
        }
    }
    pool.validate(0).unwrap();
}

#[test]
fn graphs_sharing_a_pool_reuse_each_other_s_freed_memory() {
    let (_sim, pool) = pool();
    pool.graph_pool_begin(0, G1).unwrap();
    let t = pool.graph_pool_alloc(0, G1, 8 * MIB, CAPTURE).unwrap();
    pool.free(t.ptr).unwrap();
    pool.graph_pool_end(0, G1).unwrap();
    // A second graph captured into the same pool on the same stream takes it again.
    pool.graph_pool_begin(0, G1).unwrap();
    let u = pool.graph_pool_alloc(0, G1, 8 * MIB, CAPTURE).unwrap();
    assert_eq!(u.ptr, t.ptr);
    // Another pool never does.
    pool.graph_pool_begin(0, G2).unwrap();
    let v = pool.graph_pool_alloc(0, G2, 8 * MIB, CAPTURE).unwrap();
    assert!(!overlaps((v.ptr, v.bytes), (u.ptr, u.bytes)));
    pool.graph_pool_end(0, G2).unwrap();
    pool.graph_pool_end(0, G1).unwrap();
    // Freed blocks of a pool are never cached for the general pool.
    pool.free(u.ptr).unwrap();
    let w = pool.alloc(0, 8 * MIB, CAPTURE).unwrap();
    assert!(!overlaps((w.ptr, w.bytes), (u.ptr, u.bytes)));
}

#[test]
fn no_event_or_synchronize_while_allocations_are_routed() {
    let (sim, pool) = pool();
    // Free ranges of other streams that a miss would otherwise settle with events.
    for s in [S1, S2] {
        let a = pool.alloc(0, 6 * MIB, s).unwrap();
        pool.free(a.ptr).unwrap();
    }
    let shared_stream = pool.alloc(0, 3 * MIB, S1).unwrap();
    pool.record_stream(shared_stream.ptr, S2).unwrap();
    let calls = |sim: &SimBackend| {
        [
            SimCall::RecordEvent,
            SimCall::EventQuery,
            SimCall::Synchronize,
        ]
        .map(|c| sim.calls(c))
    };
    let before = calls(&sim);
    pool.graph_pool_begin(0, G1).unwrap();
    // Misses in the pool and in the general pool, on a stream with no free range of its
    // own, and a free that would need events.
    for _ in 0..40 {
        pool.graph_pool_alloc(0, G1, 6 * MIB, CAPTURE).unwrap();
        pool.alloc(0, 6 * MIB, StreamId(0x3000)).unwrap();
    }
    pool.free(shared_stream.ptr).unwrap();
    assert!(pool
        .empty_cache(Some(0))
        .unwrap_err()
        .to_string()
        .contains("capture"));
    assert!(pool.trim(Some(0)).is_err());
    assert!(pool.sleep(Some(0), &[]).is_err());
    assert_eq!(
        calls(&sim),
        before,
        "an event or synchronize call while routing"
    );
    assert!(
        pool.stats(0).unwrap().pending_free_bytes > 0,
        "the free waits"
    );
    pool.graph_pool_end(0, G1).unwrap();
    // Closed: the deferred free got its event, and settles as usual.
    assert!(sim.calls(SimCall::RecordEvent) > before[0]);
    pool.empty_cache(Some(0)).unwrap();
    assert_eq!(pool.stats(0).unwrap().pending_free_bytes, 0);
    pool.validate(0).unwrap();
}

#[test]
fn a_pool_s_arenas_stay_while_in_use_and_go_after_its_last_release() {
    let (sim, pool) = pool();
    pool.graph_pool_retain(0, G1).unwrap();
    pool.graph_pool_begin(0, G1).unwrap();
    let kept = pool.graph_pool_alloc(0, G1, 4 * MIB, CAPTURE).unwrap();
    let temp = pool.graph_pool_alloc(0, G1, 40 * MIB, CAPTURE).unwrap();
    pool.free(temp.ptr).unwrap();
    pool.graph_pool_end(0, G1).unwrap();
    let held = sim.ledger(0).held_bytes;
    assert_eq!(
        held,
        40 * MIB + 32 * MIB,
        "a 32 MiB pool arena and one of its own"
    );
    pool.empty_cache(Some(0)).unwrap();
    pool.trim(Some(0)).unwrap();
    assert_eq!(sim.ledger(0).held_bytes, held, "a pool in use lost memory");
    assert_eq!(pool.graph_pool_release(0, G1).unwrap(), 1);
    assert_eq!(pool.graph_pool_release(0, G1).unwrap(), 0);
    // The arena of the freed temporary goes; the one holding a live block stays.
    pool.empty_cache(Some(0)).unwrap();
    let after = sim.ledger(0).held_bytes;
    assert!(after < held && after >= 4 * MIB, "{after} of {held}");
    assert_eq!(pool.graph_pool_blocks(0, G1).unwrap().len(), 1);
    // The last block freed: everything goes, and the pool is forgotten.
    pool.free(kept.ptr).unwrap();
    pool.empty_cache(Some(0)).unwrap();
    assert_eq!(sim.ledger(0).held_bytes, 0);
    assert_eq!(pool.graph_pool_use_count(0, G1).unwrap(), 0);
    assert!(pool.graph_pool_blocks(0, G1).is_err());
    // The id may be used again, afresh.
    assert_eq!(pool.graph_pool_retain(0, G1).unwrap(), 1);
}

#[test]
fn a_checkpoint_restores_blocks_at_their_own_addresses() {
    let (_sim, pool) = pool();
    pool.graph_pool_begin(0, G1).unwrap();
    let blocks: Vec<_> = [4 * MIB, 2 * MIB, 100_000, 6 * MIB]
        .iter()
        .map(|&n| pool.graph_pool_alloc(0, G1, n, CAPTURE).unwrap())
        .collect();
    pool.graph_pool_end(0, G1).unwrap();
    let checkpoint = pool.graph_pool_blocks(0, G1).unwrap();
    assert_eq!(checkpoint.len(), 4);
    // Later work: two blocks freed, one new allocation (in a freed block's place).
    pool.free(blocks[1].ptr).unwrap();
    pool.free(blocks[2].ptr).unwrap();
    pool.graph_pool_begin(0, G1).unwrap();
    let later = pool.graph_pool_alloc(0, G1, 2 * MIB, CAPTURE).unwrap();
    pool.graph_pool_end(0, G1).unwrap();
    pool.graph_pool_restore(0, G1, &checkpoint).unwrap();
    assert_eq!(pool.graph_pool_blocks(0, G1).unwrap(), checkpoint);
    pool.validate(0).unwrap();
    // The restored blocks are ordinary pool blocks: freed, they go back to the pool.
    pool.free(blocks[2].ptr).unwrap();
    if later.ptr != blocks[1].ptr {
        assert!(pool.free(later.ptr).is_err(), "the restore freed it");
    }
    // Bad checkpoints change nothing.
    let now = pool.graph_pool_blocks(0, G1).unwrap();
    let general = pool.alloc(0, 4 * MIB, S1).unwrap();
    let outside = PoolBlock {
        ptr: general.ptr,
        requested: 4 * MIB,
        stream: S1,
    };
    assert!(pool.graph_pool_restore(0, G1, &[outside]).is_err());
    let overlapping = PoolBlock {
        ptr: blocks[0].ptr + 2 * MIB,
        requested: 4 * MIB,
        stream: CAPTURE,
    };
    let mut bad = now.clone();
    bad.push(overlapping);
    assert!(pool.graph_pool_restore(0, G1, &bad).is_err());
    assert_eq!(pool.graph_pool_blocks(0, G1).unwrap(), now);
    pool.validate(0).unwrap();
}

/// A block live at a checkpoint's address with the same length but another request is the
/// checkpoint's block after the restore, not the one that was there: the pool
/// then lists exactly the checkpoint (found by the model test, `pool_model/graphs.rs`:
/// the restore kept the block of 2 MiB asked for where the checkpoint had one of 1 MiB + 512).
#[test]
fn a_restore_gives_a_block_of_the_same_length_the_checkpoints_request() {
    let (_sim, pool) = pool();
    pool.graph_pool_begin(0, G1).unwrap();
    let first = pool.graph_pool_alloc(0, G1, MIB + 512, CAPTURE).unwrap();
    pool.graph_pool_end(0, G1).unwrap();
    let checkpoint = pool.graph_pool_blocks(0, G1).unwrap();
    let requested_then = pool.stats(0).unwrap().requested_bytes;
    pool.free(first.ptr).unwrap();
    pool.graph_pool_begin(0, G1).unwrap();
    let later = pool.graph_pool_alloc(0, G1, 2 * MIB, CAPTURE).unwrap();
    pool.graph_pool_end(0, G1).unwrap();
    assert_eq!(
        later.ptr, first.ptr,
        "the same range, a block of the same length"
    );
    pool.graph_pool_restore(0, G1, &checkpoint).unwrap();
    assert_eq!(pool.graph_pool_blocks(0, G1).unwrap(), checkpoint);
    assert_eq!(pool.stats(0).unwrap().requested_bytes, requested_then);
    pool.validate(0).unwrap();
    // Restoring it again changes nothing.
    pool.graph_pool_restore(0, G1, &checkpoint).unwrap();
    assert_eq!(pool.graph_pool_blocks(0, G1).unwrap(), checkpoint);
    pool.free(first.ptr).unwrap();
    pool.graph_pool_release(0, G1).unwrap();
}

#[test]
fn bad_pool_calls_get_clear_errors_and_change_nothing() {
    let (_sim, pool) = pool();
    let default = GraphPoolId(0, 0);
    assert!(pool.graph_pool_begin(0, default).is_err());
    assert!(pool.graph_pool_release(0, G1).is_err(), "unknown pool");
    assert!(pool.graph_pool_end(0, G1).is_err(), "unknown pool");
    assert!(pool.graph_pool_alloc(0, G1, 512, CAPTURE).is_err());
    assert!(
        pool.graph_pool_alloc(7, G1, 512, CAPTURE).is_err(),
        "bad device"
    );
    pool.graph_pool_retain(0, G1).unwrap();
    assert!(pool.graph_pool_end(0, G1).is_err(), "end without begin");
    assert!(
        pool.graph_pool_alloc(0, G1, 0, CAPTURE).is_err(),
        "zero bytes"
    );
    assert_eq!(pool.graph_pool_release(0, G1).unwrap(), 0);
    assert!(pool.graph_pool_release(0, G1).is_err(), "released twice");
    // Nothing was routed: empty_cache works.
    pool.empty_cache(Some(0)).unwrap();
    pool.validate(0).unwrap();
}

#[derive(Debug, Clone)]
enum Op {
    General(u8, u64),
    InPool(u8, u8, u64),
    Free(usize),
    Begin(u8),
    End,
    Release(u8),
    EmptyCache,
}

fn op() -> impl Strategy<Value = Op> {
    let size = prop_oneof![1u64..4096, 4096u64..(2 * MIB), (2 * MIB)..(40 * MIB)];
    prop_oneof![
        4 => (0u8..2, size.clone()).prop_map(|(s, n)| Op::General(s, n)),
        4 => (0u8..2, 0u8..2, size).prop_map(|(p, s, n)| Op::InPool(p, s, n)),
        5 => any::<usize>().prop_map(Op::Free),
        1 => (0u8..2).prop_map(Op::Begin),
        1 => Just(Op::End),
        1 => (0u8..2).prop_map(Op::Release),
        1 => Just(Op::EmptyCache),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Whatever the sequence: no allocation outside a pool, and no allocation of another
    /// pool, ever overlaps a range a pool in use was given (its graphs write every such
    /// range on each replay, freed or not).
    #[test]
    fn no_block_of_a_pool_in_use_is_handed_to_another_allocation(
        ops in proptest::collection::vec(op(), 1..120),
    ) {
        let (_sim, pool) = pool();
        let ids = [G1, G2];
        let streams = [CAPTURE, S1];
        // Per pool: its use count in the model, the ranges ever given to it.
        let mut uses = [0u32; 2];
        let mut given: [Vec<(u64, u64)>; 2] = [Vec::new(), Vec::new()];
        let mut open: Vec<u8> = Vec::new();
        let mut live: Vec<u64> = Vec::new();
        for op in ops {
            match op {
                Op::General(s, n) => {
                    let a = pool.alloc(0, n, streams[usize::from(s)]).unwrap();
                    for p in 0..2 {
                        if uses[p] > 0 {
                            for &r in &given[p] {
                                prop_assert!(!overlaps(r, (a.ptr, a.bytes)), "general {a:?} on pool {p}'s {r:x?}");
                            }
                        }
                    }
                    live.push(a.ptr);
                }
                Op::InPool(p, s, n) => {
                    let p = usize::from(p);
                    if uses[p] == 0 {
                        continue;
                    }
                    let a = pool.graph_pool_alloc(0, ids[p], n, streams[usize::from(s)]).unwrap();
                    let q = 1 - p;
                    if uses[q] > 0 {
                        for &r in &given[q] {
                            prop_assert!(!overlaps(r, (a.ptr, a.bytes)), "pool {p}'s {a:?} on pool {q}'s {r:x?}");
                        }
                    }
                    given[p].push((a.ptr, a.bytes));
                    live.push(a.ptr);
                }
                Op::Free(i) => {
                    if !live.is_empty() {
                        let ptr = live.swap_remove(i % live.len());
                        pool.free(ptr).unwrap();
                    }
                }
                Op::Begin(p) => {
                    pool.graph_pool_begin(0, ids[usize::from(p)]).unwrap();
                    uses[usize::from(p)] += 1;
                    open.push(p);
                }
                Op::End => {
                    if let Some(p) = open.pop() {
                        pool.graph_pool_end(0, ids[usize::from(p)]).unwrap();
                    }
                }
                Op::Release(p) => {
                    let p = usize::from(p);
                    // A pool whose context is open keeps that use.
                    let held_open = open.iter().filter(|&&o| usize::from(o) == p).count() as u32;
                    if uses[p] > held_open {
                        prop_assert_eq!(pool.graph_pool_release(0, ids[p]).unwrap(), uses[p] - 1);
                        uses[p] -= 1;
                        if uses[p] == 0 {
                            given[p].clear();
                        }
                    }
                }
                Op::EmptyCache => {
                    let r = pool.empty_cache(Some(0));
                    prop_assert_eq!(r.is_ok(), open.is_empty());
                }
            }
            for p in 0..2 {
                prop_assert_eq!(pool.graph_pool_use_count(0, ids[p]).unwrap(), uses[p]);
            }
        }
        pool.validate(0).unwrap();
    }
}

#[test]
fn a_pool_sleeps_and_wakes_with_the_default_tag() {
    let (sim, pool) = pool();
    pool.graph_pool_begin(0, G1).unwrap();
    let a = pool.graph_pool_alloc(0, G1, 4 * MIB, CAPTURE).unwrap();
    pool.graph_pool_end(0, G1).unwrap();
    // SAFETY: sim device pointers are host addresses of live mappings of `bytes` bytes.
    unsafe { std::ptr::write_bytes(a.ptr as *mut u8, 0x5A, a.bytes as usize) };
    pool.sleep(Some(0), &[0]).unwrap();
    assert_eq!(
        sim.ledger(0).held_bytes,
        0,
        "the pool's memory went with the default tag"
    );
    let e = pool.graph_pool_alloc(0, G1, 512, CAPTURE).unwrap_err();
    assert!(e.to_string().contains("asleep"), "{e}");
    pool.wake(Some(0), None).unwrap();
    // SAFETY: as above; woken at the same address with its contents.
    assert_eq!(unsafe { *((a.ptr + a.bytes - 1) as *const u8) }, 0x5A);
    let b = pool.graph_pool_alloc(0, G1, 512, CAPTURE).unwrap();
    pool.free(b.ptr).unwrap();
    pool.free(a.ptr).unwrap();
    pool.validate(0).unwrap();
}

/// A checkpoint restore places no block while the pool's tag sleeps (its memory is not
/// there; found by the model test, `pool_model/graphs.rs`): refused, nothing changed;
/// after the wake the same restore succeeds.
#[test]
fn a_restore_places_nothing_while_the_pool_sleeps() {
    let (sim, pool) = pool();
    pool.graph_pool_begin(0, G1).unwrap();
    let a = pool.graph_pool_alloc(0, G1, 4 * MIB, CAPTURE).unwrap();
    let b = pool.graph_pool_alloc(0, G1, 512, CAPTURE).unwrap();
    pool.graph_pool_end(0, G1).unwrap();
    let checkpoint = pool.graph_pool_blocks(0, G1).unwrap();
    pool.free(b.ptr).unwrap();
    pool.sleep(Some(0), &[0]).unwrap();
    let before = pool.graph_pool_blocks(0, G1).unwrap();
    let e = pool.graph_pool_restore(0, G1, &checkpoint).unwrap_err();
    assert!(e.to_string().contains("asleep"), "{e}");
    assert_eq!(pool.graph_pool_blocks(0, G1).unwrap(), before);
    assert_eq!(sim.ledger(0).held_bytes, 0);
    pool.validate(0).unwrap();
    pool.wake(Some(0), None).unwrap();
    pool.graph_pool_restore(0, G1, &checkpoint).unwrap();
    assert_eq!(pool.graph_pool_blocks(0, G1).unwrap(), checkpoint);
    pool.free(b.ptr).unwrap();
    pool.free(a.ptr).unwrap();
    pool.validate(0).unwrap();
}

/// A pool released down to 0 while its capture is still open (torch ends before it
/// releases, but a caller may not): the pool stays known until the context ends, so the end
/// is accepted and the device leaves its no-event state.
#[test]
fn a_pool_released_during_its_capture_stays_until_the_capture_ends() {
    let (sim, pool) = pool();
    pool.graph_pool_begin(0, G1).unwrap();
    assert_eq!(pool.graph_pool_release(0, G1).unwrap(), 0);
    assert_eq!(pool.graph_pool_use_count(0, G1).unwrap(), 0);
    assert!(pool.empty_cache(Some(0)).is_err(), "still routing");
    pool.graph_pool_end(0, G1).unwrap();
    assert!(pool.graph_pool_end(0, G1).is_err(), "one end per begin");
    pool.empty_cache(Some(0)).unwrap();
    assert!(
        pool.graph_pool_blocks(0, G1).is_err(),
        "forgotten once nothing holds it"
    );
    assert_eq!(sim.ledger(0).held_bytes, 0);
}

/// Found by `pool_model.rs`: a sleep of every device with a capture open on one of them
/// put the others to sleep before refusing ("nothing was done"); and a wake ran inside a
/// capture (its copies back would invalidate it). Both are refused before anything changes.
#[test]
fn sleep_and_wake_are_refused_while_a_capture_is_open_and_change_nothing() {
    let sim = Arc::new(
        SimBackend::new(SimConfig {
            devices: 2,
            ..SimConfig::default()
        })
        .unwrap(),
    );
    let pool = Pool::new(sim.clone(), PoolConfig::default()).unwrap();
    let blocks: Vec<u64> = (0..2)
        .map(|d| pool.alloc(d, 4 * MIB, S1).unwrap().ptr)
        .collect();
    pool.graph_pool_begin(1, G1).unwrap();
    let e = pool.sleep(None, &[0]).unwrap_err();
    assert!(e.to_string().contains("nothing was done"), "{e}");
    for d in 0..2 {
        assert_eq!(pool.asleep_tags(d).unwrap(), 0, "device {d} went to sleep");
    }
    pool.graph_pool_end(1, G1).unwrap();
    pool.sleep(None, &[0]).unwrap();
    pool.graph_pool_begin(1, G1).unwrap();
    let e = pool.wake(None, None).unwrap_err();
    assert!(e.to_string().contains("wake on device 1"), "{e}");
    for d in 0..2 {
        // (Every tag interned in the process sleeps; the default tag is bit 0.)
        assert_eq!(pool.asleep_tags(d).unwrap() & 1, 1, "device {d} woke");
    }
    pool.graph_pool_end(1, G1).unwrap();
    pool.wake(None, None).unwrap();
    pool.graph_pool_release(1, G1).unwrap();
    for (d, p) in blocks.into_iter().enumerate() {
        pool.free(p).unwrap();
        pool.validate(d as i32).unwrap();
    }
    pool.empty_cache(None).unwrap();
    assert!(sim.is_clean(0) && sim.is_clean(1));
}
