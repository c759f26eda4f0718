//! The pool over the sim backend: sizes, stream-ordered reuse, record_stream, OOM retry,
//! empty_cache, bad input, several devices.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use gpu_arena::backend::sim::{SimBackend, SimCall, SimConfig};
use gpu_arena::error::OomCause;
use gpu_arena::pool::MaxReserved;
use gpu_arena::{Error, Pool, PoolConfig, StreamId};

mod common;
use common::{fill, read};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const S1: StreamId = StreamId(0x1000);
const S2: StreamId = StreamId(0x2000);

fn pool_with(sim: SimConfig, arena_size: u64) -> (Arc<SimBackend>, Pool) {
    let backend = Arc::new(SimBackend::new(sim).unwrap());
    let pool = Pool::new(
        backend.clone(),
        PoolConfig {
            arena_size,
            grow_arenas: false,
            validate: true,
            ..PoolConfig::default()
        },
    )
    .unwrap();
    (backend, pool)
}

fn pool() -> (Arc<SimBackend>, Pool) {
    pool_with(SimConfig::default(), 64 * MIB)
}

#[test]
fn alloc_write_read_free_and_empty_cache() {
    let (sim, pool) = pool();
    let a = pool.alloc(0, 1000, S1).unwrap();
    assert_eq!(a.bytes, 1024, "rounded to 512");
    assert_eq!(a.ptr % 512, 0);
    let b = pool.alloc(0, 3 * MIB, S1).unwrap();
    // SAFETY: sim device pointers are host addresses of live mappings of `bytes` bytes.
    unsafe {
        std::ptr::write_bytes(b.ptr as *mut u8, 0xAB, b.bytes as usize);
        assert_eq!(*((b.ptr + b.bytes - 1) as *const u8), 0xAB);
    }
    let s = pool.stats(0).unwrap();
    assert_eq!(s.arenas, 2, "a small arena and a large one");
    assert_eq!(s.reserved_bytes, 2 * MIB + 64 * MIB);
    assert_eq!(b.bytes, 4 * MIB, "above 1 MiB: rounded to 2 MiB");
    assert_eq!(s.allocated_bytes, 1024 + 4 * MIB);
    pool.free(a.ptr).unwrap();
    pool.free(b.ptr).unwrap();
    pool.validate(0).unwrap();
    assert_eq!(pool.stats(0).unwrap().allocated_bytes, 0);
    assert_eq!(
        sim.ledger(0).held_bytes,
        66 * MIB,
        "cached until empty_cache"
    );
    assert_eq!(pool.empty_cache(None).unwrap(), 66 * MIB);
    assert!(sim.is_clean(0), "{:?}", sim.ledger(0));
    let s = pool.stats(0).unwrap();
    assert_eq!((s.arenas, s.backend_creates, s.backend_destroys), (0, 2, 2));
}

#[test]
fn large_requests_get_a_dedicated_arena_rounded_to_granularity() {
    let (_sim, pool) = pool();
    let a = pool.alloc(0, 100 * MIB + 1, S1).unwrap();
    let s = pool.stats(0).unwrap();
    assert_eq!(s.reserved_bytes, 102 * MIB, "rounded up to 2 MiB granules");
    assert_eq!(s.arenas, 1);
    pool.free(a.ptr).unwrap();
    // The freed dedicated arena serves later huge requests (above HUGE_MIN) until
    // empty_cache; a large one that is not huge gets an arena of its class instead.
    let b = pool.alloc(0, 80 * MIB, S1).unwrap();
    assert_eq!(b.ptr, a.ptr);
    assert_eq!(pool.stats(0).unwrap().arenas, 1);
    let c = pool.alloc(0, 10 * MIB, S1).unwrap();
    assert!(
        c.ptr < a.ptr || c.ptr >= a.ptr + 102 * MIB,
        "not in the huge arena"
    );
    assert_eq!(pool.stats(0).unwrap().arenas, 2);
}

#[test]
fn same_stream_reuses_at_once_other_stream_waits_for_the_event() {
    let (sim, pool) = pool();
    let a = pool.alloc(0, 8 * MIB, S1).unwrap();
    let filler = pool.alloc(0, 56 * MIB, S1).unwrap(); // the arena is now full
    sim.block_stream(0, S1); // work on S1 has not finished
    pool.free(a.ptr).unwrap();
    let again = pool.alloc(0, 8 * MIB, S1).unwrap();
    assert_eq!(again.ptr, a.ptr, "same stream: reused at once");
    pool.free(again.ptr).unwrap();
    let other = pool.alloc(0, 64 * MIB, S2).unwrap();
    assert_ne!(other.ptr, a.ptr, "S1 still busy: S2 must not get its block");
    assert_eq!(pool.stats(0).unwrap().arenas, 2);
    sim.unblock_stream(0, S1);
    let later = pool.alloc(0, 8 * MIB, S2).unwrap();
    assert_eq!(later.ptr, a.ptr, "S1's event completed: S2 may reuse");
    for p in [filler.ptr, other.ptr, later.ptr] {
        pool.free(p).unwrap();
    }
    pool.validate(0).unwrap();
}

#[test]
fn record_stream_delays_reuse_until_that_stream_is_done() {
    let (sim, pool) = pool();
    let a = pool.alloc(0, 8 * MIB, S1).unwrap();
    let _filler = pool.alloc(0, 56 * MIB, S1).unwrap();
    pool.record_stream(a.ptr, S2).unwrap();
    sim.block_stream(0, S2);
    pool.free(a.ptr).unwrap();
    assert_eq!(pool.stats(0).unwrap().pending_free_bytes, 8 * MIB);
    let b = pool.alloc(0, 64 * MIB, S1).unwrap();
    assert_ne!(
        b.ptr, a.ptr,
        "S2 may still use it: not even S1 may reuse it"
    );
    sim.unblock_stream(0, S2);
    let c = pool.alloc(0, 8 * MIB, S1).unwrap();
    assert_eq!(c.ptr, a.ptr, "released once S2's event completed");
    assert_eq!(pool.stats(0).unwrap().pending_free_bytes, 0);
    assert!(pool.record_stream(0xdead_0000, S2).is_err());
}

#[test]
fn out_of_memory_releases_cached_arenas_retries_then_fails_cleanly() {
    let sim = SimConfig {
        capacity: 4 * GIB,
        ..SimConfig::default()
    };
    let (backend, pool) = pool_with(sim, GIB);
    let blocks: Vec<_> = (0..4).map(|_| pool.alloc(0, GIB, S1).unwrap()).collect();
    for b in &blocks {
        pool.free(b.ptr).unwrap();
    }
    // Four cached 1 GiB arenas fill the device; a 2 GiB request needs two of them released.
    let big = pool.alloc(0, 2 * GIB, S1).unwrap();
    assert_eq!(pool.stats(0).unwrap().backend_destroys, 4);
    let e = pool.alloc(0, 3 * GIB, S1).unwrap_err();
    assert!(matches!(e, Error::OutOfMemory { device: 0, .. }), "{e}");
    assert!(e.to_string().contains("out of memory"), "{e}");
    assert_eq!(pool.stats(0).unwrap().oom_count, 1);
    pool.validate(0).unwrap();
    pool.free(big.ptr).unwrap();
    pool.empty_cache(Some(0)).unwrap();
    assert!(backend.is_clean(0));
}

/// `e` is an out-of-memory error of the cause `is` accepts, and its message has every `wants`.
fn assert_oom(e: &Error, is: fn(&OomCause) -> bool, wants: &[&str]) {
    assert!(
        matches!(e, Error::OutOfMemory { cause, .. } if is(cause)),
        "{e}"
    );
    let m = e.to_string();
    for want in wants {
        assert!(m.contains(want), "{m:?} lacks {want:?}");
    }
}

fn capped_pool(sim: SimConfig, arena_size: u64, cap: MaxReserved) -> Pool {
    let backend = Arc::new(SimBackend::new(sim).unwrap());
    Pool::new(
        backend,
        PoolConfig {
            arena_size,
            grow_arenas: false,
            max_reserved: Some(cap),
            validate: true,
            ..PoolConfig::default()
        },
    )
    .unwrap()
}

/// A pool of fixed 64 MiB arenas on `sim`, capped at `cap`.
fn fixed_pool(sim: Arc<SimBackend>, cap: Option<MaxReserved>) -> Pool {
    Pool::new(
        sim,
        PoolConfig {
            arena_size: 64 * MIB,
            max_reserved: cap,
            grow_arenas: false,
            validate: true,
            ..PoolConfig::default()
        },
    )
    .unwrap()
}

#[test]
fn max_reserved_caps_the_pool_and_says_so() {
    let pool = capped_pool(
        SimConfig::default(),
        64 * MIB,
        MaxReserved::Bytes(128 * MIB),
    );
    let _a = pool.alloc(0, 64 * MIB, S1).unwrap();
    let _b = pool.alloc(0, 64 * MIB, S1).unwrap();
    assert_oom(
        &pool.alloc(0, 2 * MIB, S1).unwrap_err(),
        |c| matches!(c, OomCause::MaxReserved { .. }),
        &[
            "out of memory on device 0",
            "max_reserved=128 MiB cap",
            "128 MiB reserved",
            "needs 64 MiB more",
            "raise max_reserved",
        ],
    );
    assert_eq!(pool.stats(0).unwrap().oom_count, 1);
}

/// Found by `pool_model.rs`: an arena whose destroy failed is still held by the device,
/// and the cap counted it out: the next arena passed `max_reserved`.
#[test]
fn max_reserved_counts_an_arena_whose_destroy_failed() {
    let sim = Arc::new(SimBackend::new(SimConfig::default()).unwrap());
    let pool = fixed_pool(sim.clone(), Some(MaxReserved::Bytes(128 * MIB)));
    let a = pool.alloc(0, 64 * MIB, S1).unwrap();
    pool.free(a.ptr).unwrap();
    sim.fail_nth(SimCall::DestroyArena, 1);
    assert!(pool.empty_cache(None).is_err());
    let _b = pool.alloc(0, 64 * MIB, S1).unwrap();
    assert_eq!(sim.ledger(0).held_bytes, 128 * MIB);
    // (The out-of-memory retry tries the orphan's destroy again: it fails again here.)
    sim.fail_always(SimCall::DestroyArena, true);
    assert_oom(
        &pool.alloc(0, 64 * MIB, S1).unwrap_err(),
        |c| matches!(c, OomCause::MaxReserved { .. }),
        &["128 MiB reserved"],
    );
    assert!(sim.ledger(0).held_bytes <= 128 * MIB);
    // A retry that works gives the orphan back: room for one more arena.
    sim.fail_always(SimCall::DestroyArena, false);
    pool.empty_cache(None).unwrap();
    let _c = pool.alloc(0, 64 * MIB, S1).unwrap();
}

/// Found by `pool_model.rs`: the export self-test before a device's first share creates one
/// granule, which passed `max_reserved` at the cap (and stayed past it when its destroy
/// failed). It counts as an arena now: the cached arenas make room for it, else the share
/// fails as out of memory and changes nothing.
#[test]
fn the_export_self_test_stays_under_max_reserved() {
    let sim = Arc::new(SimBackend::new(SimConfig::default()).unwrap());
    let pool = fixed_pool(sim.clone(), Some(MaxReserved::Bytes(128 * MIB)));
    let a = pool.alloc(0, 64 * MIB, S1).unwrap();
    let b = pool.alloc(0, 64 * MIB, S1).unwrap();
    // At the cap with nothing cached: refused, nothing shared, nothing held past the cap.
    assert_oom(
        &pool.share(a.ptr, a.bytes).unwrap_err(),
        |c| matches!(c, OomCause::MaxReserved { .. }),
        &["max_reserved=128 MiB cap"],
    );
    assert_eq!(pool.stats(0).unwrap().shares_live, 0);
    assert_eq!(sim.ledger(0).held_bytes, 128 * MIB);
    // With a cached arena: it goes and the self-test runs; its granule's destroy failing,
    // the share fails with the driver's error and the granule is kept (an orphan, inside
    // the cap); the next share runs the self-test again and is granted.
    pool.free(b.ptr).unwrap();
    sim.fail_nth(SimCall::DestroyArena, 2);
    let e = pool.share(a.ptr, a.bytes).unwrap_err();
    assert!(
        matches!(
            e,
            Error::Backend {
                call: "destroy_arena",
                ..
            }
        ),
        "{e}"
    );
    assert_eq!(sim.ledger(0).held_bytes, 66 * MIB);
    let info = pool.share(a.ptr, a.bytes).unwrap();
    assert!(pool.stats(0).unwrap().reserved_bytes <= 128 * MIB);
    assert!(sim.ledger(0).held_bytes <= 128 * MIB);
    pool.unshare(0, info.share_key, &info.token).unwrap();
    pool.free(a.ptr).unwrap();
    pool.empty_cache(None).unwrap();
    assert!(sim.is_clean(0), "{:?}", sim.ledger(0));
}

/// Found by `pool_model.rs` after the fix above: the room the self-test made at the cap came
/// from `empty_cache` cutting a grown arena's free chunks, and it cut the arena of the block
/// being shared, whose key the share already held ("export of an arena no share holds").
/// The self-test now runs before the share looks anything up, and an arena a share
/// references is never cut.
#[test]
fn a_first_share_at_the_cap_makes_room_without_losing_its_arena() {
    let sim = Arc::new(SimBackend::new(SimConfig::default()).unwrap());
    let pool = Pool::new(
        sim.clone(),
        PoolConfig {
            max_reserved: Some(MaxReserved::Bytes(96 * MIB)),
            grow_arenas: true,
            validate: true,
            ..PoolConfig::default()
        },
    )
    .unwrap();
    // One growing arena of three chunks (40 + 24 + 32 MiB: requests of 8 MiB and more grow
    // it by exactly their shortfall), at the cap; the middle one freed whole.
    let a = pool.alloc(0, 40 * MIB, S1).unwrap();
    let b = pool.alloc(0, 24 * MIB, S1).unwrap();
    let c = pool.alloc(0, 32 * MIB, S1).unwrap();
    assert_eq!(pool.stats(0).unwrap().reserved_bytes, 96 * MIB);
    fill(a.ptr, 4096, 7);
    pool.free(b.ptr).unwrap();
    let info = pool.share(a.ptr, a.bytes).unwrap();
    let s = pool.stats(0).unwrap();
    assert_eq!(s.reserved_bytes, 72 * MIB, "the free chunk went: {s:?}");
    assert_eq!(s.shares_live, 1);
    assert!(sim.ledger(0).held_bytes <= 96 * MIB);
    let mut want = vec![0u8; 4096];
    fill(want.as_mut_ptr() as u64, 4096, 7);
    assert!(read(a.ptr, 4096) == want, "the shared block kept its bytes");
    pool.validate(0).unwrap();
    pool.unshare(0, info.share_key, &info.token).unwrap();
    pool.free(a.ptr).unwrap();
    pool.free(c.ptr).unwrap();
    pool.empty_cache(None).unwrap();
    assert!(sim.is_clean(0), "{:?}", sim.ledger(0));
}

/// Found by `pool_model.rs`: `reserved_bytes` counts an arena whose destroy failed (the
/// device still holds it), and the peak did not: after one more arena the peak was below the
/// current value, and `reset_peak_stats` set it below too; nor did the segments.
#[test]
fn the_reserved_peak_counts_an_arena_whose_destroy_failed() {
    let sim = Arc::new(SimBackend::new(SimConfig::default()).unwrap());
    let pool = fixed_pool(sim.clone(), None);
    let a = pool.alloc(0, 64 * MIB, S1).unwrap();
    pool.free(a.ptr).unwrap();
    sim.fail_nth(SimCall::DestroyArena, 1);
    assert!(pool.empty_cache(None).is_err());
    let _b = pool.alloc(0, 64 * MIB, S1).unwrap();
    let s = pool.stats(0).unwrap();
    assert_eq!(s.reserved_bytes, 128 * MIB);
    assert_eq!(s.peak_reserved_bytes, 128 * MIB, "{s:?}");
    pool.reset_peak_stats(0).unwrap();
    assert_eq!(pool.stats(0).unwrap().peak_reserved_bytes, 128 * MIB);
    // The segments (PyTorch's snapshot) list it too: they add up to what is reserved.
    let segs = pool.segments(0).unwrap();
    assert_eq!(segs.iter().map(|s| s.bytes).sum::<u64>(), 128 * MIB);
    assert!(segs
        .iter()
        .any(|s| s.blocks.len() == 1 && !s.blocks[0].allocated));
}

#[test]
fn max_reserved_fraction_is_resolved_against_the_device() {
    // 0.25 of a 1 GiB device: 256 MiB, four 64 MiB arenas.
    let sim = SimConfig {
        capacity: GIB,
        ..SimConfig::default()
    };
    let pool = capped_pool(sim, 64 * MIB, MaxReserved::Fraction(0.25));
    let blocks: Vec<_> = (0..4)
        .map(|_| pool.alloc(0, 64 * MIB, S1).unwrap())
        .collect();
    let m = pool.alloc(0, 64 * MIB, S1).unwrap_err().to_string();
    assert!(
        m.contains("max_reserved=0.25 (256 MiB of 1 GiB) cap") && m.contains("raise max_reserved"),
        "{m}"
    );
    assert_eq!(pool.stats(0).unwrap().reserved_bytes, 256 * MIB);
    // An arena larger than the cap: the message says which knob to lower.
    let small = capped_pool(SimConfig::default(), GIB, MaxReserved::Bytes(512 * MIB));
    let m = small.alloc(0, 2 * MIB, S1).unwrap_err().to_string();
    assert!(
        m.contains("lower arena_size") && m.contains("raise max_reserved"),
        "{m}"
    );
    drop(blocks);
}

/// PyTorch's `set_per_process_memory_fraction`: a cap set at run time holds from the next
/// growth, overrides the configuration's, and can be lifted; bad caps change nothing.
#[test]
fn a_cap_set_at_run_time_holds_from_the_next_growth() {
    let sim = SimConfig {
        capacity: GIB,
        ..SimConfig::default()
    };
    let (_sim, pool) = pool_with(sim, 64 * MIB);
    let a = pool.alloc(0, 64 * MIB, S1).unwrap();
    assert_eq!(pool.max_reserved(0).unwrap(), None);
    pool.set_max_reserved(0, Some(MaxReserved::Fraction(0.125)))
        .unwrap();
    assert_eq!(
        pool.max_reserved(0).unwrap(),
        Some(MaxReserved::Fraction(0.125))
    );
    let b = pool.alloc(0, 64 * MIB, S1).unwrap();
    let m = pool.alloc(0, 64 * MIB, S1).unwrap_err().to_string();
    assert!(
        m.contains("max_reserved=0.125 (128 MiB of 1 GiB) cap"),
        "{m}"
    );
    for bad in [
        MaxReserved::Fraction(0.0),
        MaxReserved::Fraction(1.5),
        MaxReserved::Bytes(0),
    ] {
        assert!(pool.set_max_reserved(0, Some(bad)).is_err());
    }
    assert!(pool.set_max_reserved(9, None).is_err(), "bad device");
    assert_eq!(
        pool.max_reserved(0).unwrap(),
        Some(MaxReserved::Fraction(0.125))
    );
    pool.set_max_reserved(0, None).unwrap();
    let c = pool.alloc(0, 64 * MIB, S1).unwrap();
    for x in [a, b, c] {
        pool.free(x.ptr).unwrap();
    }
}

#[test]
fn arena_larger_than_the_device_names_arena_size() {
    let sim = SimConfig {
        capacity: GIB,
        ..SimConfig::default()
    };
    let (backend, pool) = pool_with(sim, 4 * GIB);
    assert_oom(
        &pool.alloc(0, 2 * MIB, S1).unwrap_err(),
        |c| matches!(c, OomCause::ArenaLargerThanDevice { .. }),
        &["arena_size=4 GiB is larger than device 0's 1 GiB; lower arena_size"],
    );
    assert_eq!(
        backend.ledger(0).held_bytes,
        0,
        "no driver allocation tried"
    );
    // A request larger than the device (its own arena): said as such.
    let (_b, pool) = pool_with(
        SimConfig {
            capacity: GIB,
            ..SimConfig::default()
        },
        64 * MIB,
    );
    let m = pool.alloc(0, 2 * GIB, S1).unwrap_err().to_string();
    assert!(
        m.contains("needs a 2 GiB arena, more than device 0's 1 GiB"),
        "{m}"
    );
}

#[test]
fn a_full_device_says_what_is_held_and_by_whom() {
    let sim = SimConfig {
        capacity: GIB,
        ..SimConfig::default()
    };
    let (_backend, pool) = pool_with(sim, 256 * MIB);
    // Four arenas fill the device, each with a 200 MiB block and 56 MiB free.
    let blocks: Vec<_> = (0..4)
        .map(|_| pool.alloc(0, 200 * MIB, S1).unwrap())
        .collect();
    assert_oom(
        &pool.alloc(0, 200 * MIB, S1).unwrap_err(),
        |c| matches!(c, OomCause::DeviceFull { .. }),
        &[
            "device 0 is full: 0 B free of 1 GiB",
            "a new arena needs 256 MiB",
            "gpu-arena holds 1 GiB reserved",
            "224 MiB of it cached",
            "others hold 0 B",
            "free tensors",
        ],
    );
    drop(blocks);
}

#[test]
fn requested_bytes_count_what_callers_asked_for() {
    let (_sim, pool) = pool();
    let a = pool.alloc(0, 1000, S1).unwrap();
    let b = pool.alloc(0, 3 * MIB + 1, S1).unwrap();
    let s = pool.stats(0).unwrap();
    assert_eq!(s.requested_bytes, 1000 + 3 * MIB + 1);
    assert_eq!(s.allocated_bytes, 1024 + 4 * MIB, "rounded sizes");
    pool.free(a.ptr).unwrap();
    let s = pool.stats(0).unwrap();
    assert_eq!(s.requested_bytes, 3 * MIB + 1);
    assert_eq!(s.peak_requested_bytes, 1000 + 3 * MIB + 1);
    pool.free(b.ptr).unwrap();
    let s = pool.stats(0).unwrap();
    assert_eq!((s.requested_bytes, s.allocated_bytes), (0, 0));
    pool.validate(0).unwrap();
}

#[test]
fn arena_size_below_the_minimum_is_refused() {
    let backend = Arc::new(SimBackend::new(SimConfig::default()).unwrap());
    for tiny in [1, 4096, MIB] {
        let e = Pool::new(
            backend.clone(),
            PoolConfig {
                arena_size: tiny,
                grow_arenas: false,
                ..PoolConfig::default()
            },
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("arena_size") && e.contains("at least 2 MiB"),
            "{e}"
        );
    }
}

#[test]
fn bad_input_is_refused_and_changes_nothing() {
    let (_sim, pool) = pool();
    let a = pool.alloc(0, 4096, S1).unwrap();
    let before = pool.snapshot_json();
    let cases: Vec<(&str, Error)> = vec![
        ("unknown pointer", pool.free(0x1234_5000).unwrap_err()),
        ("interior pointer", pool.free(a.ptr + 512).unwrap_err()),
        ("wrong size", pool.free_checked(a.ptr, 4095, 0).unwrap_err()),
        (
            "wrong device",
            pool.free_checked(a.ptr, 4096, 1).unwrap_err(),
        ),
        ("zero size", pool.alloc(0, 0, S1).unwrap_err()),
        ("absurd size", pool.alloc(0, u64::MAX, S1).unwrap_err()),
        ("device out of range", pool.alloc(7, 4096, S1).unwrap_err()),
        ("negative device", pool.alloc(-1, 4096, S1).unwrap_err()),
    ];
    for (what, e) in &cases {
        assert!(!e.to_string().is_empty(), "{what}");
    }
    assert!(matches!(cases[0].1, Error::UnknownPointer { .. }));
    assert!(
        cases[1].1.to_string().contains("not the start"),
        "{}",
        cases[1].1
    );
    assert!(matches!(cases[2].1, Error::InvalidArgument(_)));
    assert!(matches!(cases[3].1, Error::InvalidDevice { .. }));
    assert!(matches!(
        cases[6].1,
        Error::InvalidDevice {
            device: 7,
            count: 1
        }
    ));
    assert_eq!(
        pool.snapshot_json(),
        before,
        "refused calls changed nothing"
    );
    pool.free(a.ptr).unwrap();
    let e = pool.free(a.ptr).unwrap_err();
    assert!(
        matches!(e, Error::UnknownPointer { .. }),
        "double free: {e}"
    );
    pool.validate(0).unwrap();
}

#[test]
fn devices_are_independent() {
    let sim = SimConfig {
        devices: 3,
        ..SimConfig::default()
    };
    let (backend, pool) = pool_with(sim, 64 * MIB);
    assert_eq!(pool.device_count(), 3);
    let a = pool.alloc(2, MIB, S1).unwrap();
    assert_eq!(a.device, 2);
    assert_eq!(pool.stats(0).unwrap().arenas, 0);
    assert_eq!(pool.stats(2).unwrap().arenas, 1);
    assert_eq!(backend.ledger(2).live_arenas, 1);
    assert!(pool.free_checked(a.ptr, MIB, 1).is_err(), "wrong device");
    pool.free(a.ptr).unwrap();
    pool.empty_cache(Some(2)).unwrap();
    assert!(backend.is_clean(2));
}

#[test]
fn backend_failures_surface_and_leave_the_pool_valid() {
    let (sim, pool) = pool();
    sim.fail_nth(SimCall::CreateArena, 1);
    let e = pool.alloc(0, MIB, S1).unwrap_err();
    assert!(matches!(e, Error::Backend { .. }), "{e}");
    pool.validate(0).unwrap();
    let a = pool.alloc(0, MIB, S1).unwrap();
    pool.free(a.ptr).unwrap();
    sim.fail_nth(SimCall::Synchronize, 1);
    assert!(pool.empty_cache(None).is_err());
    pool.validate(0).unwrap();
    assert_eq!(pool.empty_cache(None).unwrap(), 2 * MIB, "one small arena");
    assert!(sim.is_clean(0));
}

#[test]
fn snapshot_is_json_with_arenas_and_ranges() {
    let (_sim, pool) = pool();
    let _a = pool.alloc(0, 2 * MIB, S1).unwrap();
    let _b = pool.alloc(0, 4096, S1).unwrap();
    let v: serde_json::Value = serde_json::from_str(&pool.snapshot_json()).unwrap();
    assert_eq!(v["backend"], "sim");
    let arenas = v["devices"][0]["arenas"].as_array().unwrap();
    let large = arenas.iter().find(|a| a["small"] == false).unwrap();
    assert_eq!(large["bytes"], 64 * MIB);
    assert_eq!(large["ranges"].as_array().unwrap().len(), 2);
    let small = arenas.iter().find(|a| a["small"] == true).unwrap();
    assert_eq!(small["bytes"], 2 * MIB);
}

#[test]
fn many_threads_share_one_pool() {
    let backend = Arc::new(SimBackend::new(SimConfig::default()).unwrap());
    let config = PoolConfig {
        arena_size: 256 * MIB,
        grow_arenas: false,
        validate: false, // a full walk per operation would dominate; checked at the end
        ..PoolConfig::default()
    };
    let pool = Pool::new(backend, config).unwrap();
    std::thread::scope(|s| {
        for t in 0..8u64 {
            let pool = &pool;
            s.spawn(move || {
                let stream = StreamId(0x100 + t);
                let mut live = Vec::new();
                for i in 0..1000u64 {
                    let size = 512 * (1 + (i * 7919 + t * 104_729) % 4096);
                    live.push(pool.alloc(0, size, stream).unwrap().ptr);
                    if i % 3 != 0 {
                        let idx = (i as usize * 31) % live.len();
                        pool.free(live.swap_remove(idx)).unwrap();
                    }
                }
                for p in live {
                    pool.free(p).unwrap();
                }
            });
        }
    });
    pool.validate(0).unwrap();
    assert_eq!(pool.stats(0).unwrap().allocated_bytes, 0);
}

#[test]
fn an_event_releases_only_the_frees_made_before_it_was_recorded() {
    let (sim, pool) = pool();
    let a = pool.alloc(0, 8 * MIB, S1).unwrap();
    let b = pool.alloc(0, 8 * MIB, S1).unwrap();
    let _fill1 = pool.alloc(0, 48 * MIB, S1).unwrap(); // arena 1 full
    sim.block_stream(0, S1);
    pool.free(a.ptr).unwrap(); // S1 still works on `a`
    let x = pool.alloc(0, 8 * MIB, S2).unwrap(); // miss: an event E1 is recorded on S1
    assert_ne!(x.ptr, a.ptr);
    let _fill2 = pool.alloc(0, 56 * MIB, S2).unwrap(); // arena 2 full
    sim.unblock_stream(0, S1); // E1 completes: `a` is free for everyone
    sim.block_stream(0, S1); // S1 gets new work, on `b`
    pool.free(b.ptr).unwrap(); // freed after E1 was recorded: E1 says nothing about it
    let y = pool.alloc(0, 8 * MIB, S2).unwrap();
    assert_eq!(y.ptr, a.ptr, "covered by E1");
    let z = pool.alloc(0, 8 * MIB, S2).unwrap();
    assert_ne!(
        z.ptr, b.ptr,
        "S1 may still be using `b`: E1 must not release it"
    );
    let again = pool.alloc(0, 8 * MIB, S1).unwrap();
    assert_eq!(again.ptr, b.ptr, "but S1 itself may reuse it at once");
    pool.validate(0).unwrap();
}

#[test]
fn large_requests_round_to_2_mib_so_their_holes_fit_each_other() {
    // One 8 MiB arena, filled exactly: [kv1 2 MiB][temp 4 MiB][kv2 2 MiB].
    let (_sim, pool) = pool_with(SimConfig::default(), 8 * MIB);
    assert_eq!(gpu_arena::pool::block_len(MIB), Some(MIB), "1 MiB is small");
    assert_eq!(gpu_arena::pool::block_len(MIB + 1), Some(2 * MIB));
    assert_eq!(gpu_arena::pool::block_len(5 * MIB - 7), Some(6 * MIB));
    // KV blocks around an odd-sized temporary: once it is freed, its hole takes KV blocks
    // exactly, with no sliver left over.
    let kv1 = pool.alloc(0, 2 * MIB, S1).unwrap();
    let temp = pool.alloc(0, 3 * MIB + 4096, S1).unwrap();
    assert_eq!(temp.bytes, 4 * MIB);
    let kv2 = pool.alloc(0, 2 * MIB, S1).unwrap();
    assert_eq!(kv2.ptr, temp.ptr + 4 * MIB);
    pool.free(temp.ptr).unwrap();
    let a = pool.alloc(0, 2 * MIB, S1).unwrap();
    let b = pool.alloc(0, 2 * MIB, S1).unwrap();
    let mut got = [a.ptr, b.ptr];
    got.sort_unstable();
    assert_eq!(
        got,
        [temp.ptr, temp.ptr + 2 * MIB],
        "the hole holds two blocks"
    );
    for p in [kv1.ptr, kv2.ptr, a.ptr, b.ptr] {
        pool.free(p).unwrap();
    }
    pool.validate(0).unwrap();
}

#[test]
fn a_miss_merges_the_streams_own_free_ranges_with_other_streams() {
    // Arena of 8 MiB: [S1 4 MiB][S2 4 MiB]. Freed on different streams, the two halves
    // carry different tags; an 8 MiB request on S1 must find them merged after the settle
    // (the sim's events complete at once), not grow the pool.
    let (_sim, pool) = pool_with(SimConfig::default(), 8 * MIB);
    let a = pool.alloc(0, 4 * MIB, S1).unwrap();
    let b = pool.alloc(0, 4 * MIB, S2).unwrap();
    // Too big for the exact-size cache's share: free straight to the ranges.
    pool.free(a.ptr).unwrap();
    pool.free(b.ptr).unwrap();
    let c = pool.alloc(0, 8 * MIB, S1).unwrap();
    let s = pool.stats(0).unwrap();
    assert_eq!(s.arenas, 1, "no growth: the S1 and S2 halves merged");
    assert_eq!(c.ptr, a.ptr.min(b.ptr));
    pool.free(c.ptr).unwrap();
    pool.validate(0).unwrap();
}

#[test]
fn block_sizes_follow_the_documented_classes() {
    use gpu_arena::pool::block_len;
    for (req, want) in [
        (1, 512),
        (4096, 4096),
        (4097, 5120), // quarter-octave classes above 4 KiB: 4 KiB + 1 KiB steps
        (5000, 5120),
        (100_000, 114_688), // 64 KiB + 3 x 16 KiB
        (MIB, MIB),         // 1 MiB is still "small"
        (MIB + 1, 2 * MIB), // large: 2 MiB multiples
        (3 * MIB, 4 * MIB),
        (64 * MIB - 1, 64 * MIB),
    ] {
        assert_eq!(block_len(req), Some(want), "block_len({req})");
    }
    for req in [1u64, 777, 5000, 70_001, 900_000, 3 << 20] {
        let len = block_len(req).unwrap();
        assert!(len >= req && len % 512 == 0);
        assert!(
            len <= req + req / 4 + 512 || len - req < 2 * MIB,
            "waste bounded for {req}"
        );
    }
    assert_eq!(block_len(u64::MAX), None);
}

#[test]
fn a_shared_then_freed_block_still_waits_for_its_recorded_streams() {
    let (sim, pool) = pool();
    let a = pool.alloc(0, 8 * MIB, S1).unwrap();
    let _fill = pool.alloc(0, 56 * MIB, S1).unwrap();
    let share = pool.share(a.ptr, a.bytes).unwrap();
    pool.record_stream(a.ptr, S2).unwrap();
    sim.block_stream(0, S2); // S2 still works on `a`
    pool.free(a.ptr).unwrap(); // deferred: still shared
    assert_eq!(pool.stats(0).unwrap().deferred_free_bytes, 8 * MIB);
    pool.unshare(0, share.share_key, &share.token).unwrap(); // last reference: release now...
    let s = pool.stats(0).unwrap();
    assert_eq!(
        (s.deferred_free_bytes, s.pending_free_bytes),
        (0, 8 * MIB),
        "...after S2"
    );
    let b = pool.alloc(0, 8 * MIB, S1).unwrap();
    assert_ne!(b.ptr, a.ptr, "S2 may still be using it");
    sim.unblock_stream(0, S2);
    let _fill2 = pool.alloc(0, 56 * MIB, S1).unwrap(); // the second arena is full now
    let c = pool.alloc(0, 8 * MIB, S1).unwrap();
    assert_eq!(c.ptr, a.ptr, "released once S2's event completed");
    pool.validate(0).unwrap();
}
