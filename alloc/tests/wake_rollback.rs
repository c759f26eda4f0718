//! A wake that fails midway is undone (`alloc/src/pool/sleep_wake/wake.rs`): the arenas it had already
//! woken go back to sleep with their offloaded contents, nothing changes, and the error says
//! what the wake needed; a later wake, with memory free, restores everything bitwise.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use gpu_arena::backend::sim::{SimBackend, SimCall, SimConfig};
use gpu_arena::error::OomCause;
use gpu_arena::{tags, Error, Pool, PoolStats, StreamId};

mod common;
use common::{alloc_with, fill, read, sim_pool};

const MIB: u64 = 1 << 20;
const S: StreamId = StreamId(0x1000);

fn pool(capacity: u64) -> (Arc<SimBackend>, Pool) {
    sim_pool(
        SimConfig {
            capacity,
            ..SimConfig::default()
        },
        8 * MIB,
        true,
    )
}

/// Two 8 MiB arenas of tag `wr_w` (filled, offloaded) asleep; returns their blocks and
/// contents.
fn two_asleep(pool: &Pool) -> Vec<(u64, Vec<u8>)> {
    let blocks: Vec<(u64, Vec<u8>)> = (0..2u8)
        .map(|i| {
            let p = alloc_with(pool, "wr_w", 6 * MIB, S);
            fill(p, (6 * MIB) as usize, i);
            (p, read(p, (6 * MIB) as usize))
        })
        .collect();
    let w = tags::index(Some("wr_w")).unwrap();
    let r = pool.sleep_tags(Some(0), Some(&[w]), &[w]).unwrap();
    assert_eq!((r.arenas, r.copied_bytes), (2, 12 * MIB));
    blocks
}

/// A wake undone changed nothing: reserved, sleeping and host bytes as `before`.
fn assert_memory_unchanged(before: &PoolStats, after: &PoolStats) {
    let bytes = |s: &PoolStats| (s.reserved_bytes, s.sleeping_bytes, s.offload_host_bytes);
    assert_eq!(bytes(after), bytes(before));
}

/// Every block holds the bytes it held before its sleep, and the pool validates.
fn assert_bytes_back(pool: &Pool, blocks: &[(u64, Vec<u8>)]) {
    for (p, want) in blocks {
        assert_eq!(&read(*p, want.len()), want);
    }
    pool.validate(0).unwrap();
}

#[test]
fn a_wake_out_of_memory_midway_is_undone_and_says_so() {
    let (sim, pool) = pool(32 * MIB);
    let blocks = two_asleep(&pool);
    // The trainer takes the memory meanwhile: three of the four 8 MiB free.
    let trainer: Vec<u64> = (0..3)
        .map(|_| alloc_with(&pool, "wr_t", 6 * MIB, S))
        .collect();
    let before = pool.stats(0).unwrap();
    assert_eq!(
        (before.reserved_bytes, before.sleeping_bytes),
        (24 * MIB, 16 * MIB)
    );
    let e = pool.wake(Some(0), None).unwrap_err();
    match &e {
        Error::OutOfMemory {
            cause: OomCause::Wake { needed, undone, .. },
            ..
        } => assert_eq!((*needed, *undone), (16 * MIB, 8 * MIB)),
        other => panic!("not a wake OOM: {other}"),
    }
    let m = e.to_string();
    for want in [
        "wr_w",
        "16 MiB",
        "went back to sleep",
        "nothing changed",
        "wake again",
    ] {
        assert!(m.contains(want), "{m:?} lacks {want:?}");
    }
    // Nothing changed: still asleep, stats and the driver's ledger as before.
    let w = tags::index(Some("wr_w")).unwrap();
    assert_eq!(pool.asleep_tags(0).unwrap(), 1 << w);
    assert_memory_unchanged(&before, &pool.stats(0).unwrap());
    assert_eq!(sim.ledger(0).held_bytes, 24 * MIB);
    pool.validate(0).unwrap();
    // The trainer gives memory back: the wake succeeds, contents bitwise identical.
    for p in trainer {
        pool.free(p).unwrap();
    }
    pool.empty_cache(None).unwrap();
    let r = pool.wake(Some(0), None).unwrap();
    assert_eq!((r.arenas, r.copied_bytes), (2, 12 * MIB));
    assert_bytes_back(&pool, &blocks);
}

#[test]
fn an_injected_driver_failure_midway_is_undone_with_its_error() {
    let (sim, pool) = pool(1 << 30);
    let blocks = two_asleep(&pool);
    let before = pool.stats(0).unwrap();
    // restore_physical of the second arena fails (it counts as a create).
    sim.fail_nth(SimCall::CreateArena, 2);
    let e = pool.wake(None, None).unwrap_err();
    assert!(
        matches!(e, Error::Backend { ref message, .. } if message.contains("injected")),
        "{e}"
    );
    let after = pool.stats(0).unwrap();
    assert_eq!(
        (after.reserved_bytes, after.sleeping_bytes),
        (before.reserved_bytes, before.sleeping_bytes)
    );
    assert_eq!(
        sim.ledger(0).held_bytes,
        0,
        "the first arena's memory went back"
    );
    pool.validate(0).unwrap();
    pool.wake(None, None).unwrap();
    for (p, want) in &blocks {
        assert_eq!(&read(*p, want.len()), want);
    }
    assert_eq!(pool.asleep_tags(0).unwrap(), 0);
}

#[test]
fn a_wake_of_every_device_is_undone_on_every_device() {
    let (sim, pool) = sim_pool(
        SimConfig {
            devices: 2,
            ..SimConfig::default()
        },
        8 * MIB,
        true,
    );
    tags::set_current(Some("wr_d")).unwrap();
    let blocks: Vec<(u64, Vec<u8>)> = (0..2u8)
        .map(|d| {
            let p = pool.alloc(i32::from(d), 4 * MIB, S).unwrap().ptr;
            fill(p, (4 * MIB) as usize, d);
            (p, read(p, (4 * MIB) as usize))
        })
        .collect();
    tags::set_current(None).unwrap();
    let w = tags::index(Some("wr_d")).unwrap();
    pool.sleep_tags(None, Some(&[w]), &[w]).unwrap();
    // Device 0's arena is restored first, device 1's fails: device 0 goes back to sleep.
    sim.fail_nth(SimCall::CreateArena, 2);
    assert!(pool.wake(None, None).is_err());
    for d in 0..2 {
        assert_eq!(pool.asleep_tags(d).unwrap(), 1 << w, "device {d}");
        assert_eq!(sim.ledger(d).held_bytes, 0, "device {d}");
        pool.validate(d).unwrap();
    }
    pool.wake(None, None).unwrap();
    for (p, want) in &blocks {
        assert_eq!(&read(*p, want.len()), want);
    }
}

#[test]
fn a_copy_back_that_fails_undoes_the_wake_too() {
    // Found by `pool_model.rs`: the copy back ran after the arenas were recorded awake, so a
    // failed copy returned an error with the tag awake and its contents partly lost.
    let (sim, pool) = pool(1 << 30);
    let blocks = two_asleep(&pool);
    let w = tags::index(Some("wr_w")).unwrap();
    let before = pool.stats(0).unwrap();
    // The second arena's copy back fails.
    sim.fail_nth(SimCall::CopyFromHost, 2);
    let e = pool.wake(Some(0), None).unwrap_err();
    assert!(
        matches!(e, Error::Backend { ref message, .. } if message.contains("injected")),
        "{e}"
    );
    assert_eq!(pool.asleep_tags(0).unwrap(), 1 << w, "the tag still sleeps");
    assert_memory_unchanged(&before, &pool.stats(0).unwrap());
    assert_eq!(sim.ledger(0).held_bytes, 0, "both arenas' memory went back");
    tags::set_current(Some("wr_w")).unwrap();
    assert!(pool.alloc(0, MIB, S).is_err(), "allocations still refused");
    tags::set_current(None).unwrap();
    pool.validate(0).unwrap();
    // Tried again: everything back, bitwise.
    let r = pool.wake(Some(0), None).unwrap();
    assert_eq!((r.arenas, r.copied_bytes), (2, 12 * MIB));
    assert_bytes_back(&pool, &blocks);
}

#[test]
fn a_wake_past_max_reserved_is_refused_and_changes_nothing() {
    // Found by `pool_model.rs`: a wake restored its arenas past the cap that every other
    // growth honours.
    let sim = Arc::new(SimBackend::new(SimConfig::default()).unwrap());
    let pool = Pool::new(
        sim.clone(),
        gpu_arena::PoolConfig {
            arena_size: 8 * MIB,
            max_reserved: Some(gpu_arena::pool::MaxReserved::Bytes(24 * MIB)),
            grow_arenas: false,
            ..gpu_arena::PoolConfig::default()
        },
    )
    .unwrap();
    let blocks = two_asleep(&pool);
    // Another tag takes the room meanwhile: 16 of the 24 MiB.
    let other: Vec<u64> = (0..2)
        .map(|_| alloc_with(&pool, "wr_cap", 6 * MIB, S))
        .collect();
    let before = pool.stats(0).unwrap();
    let e = pool.wake(Some(0), None).unwrap_err();
    match &e {
        Error::OutOfMemory {
            cause: OomCause::MaxReserved { needed, .. },
            ..
        } => assert_eq!(*needed, 16 * MIB),
        other => panic!("not a max_reserved refusal: {other}"),
    }
    assert!(e.to_string().contains("max_reserved"), "{e}");
    let w = tags::index(Some("wr_w")).unwrap();
    assert_eq!(pool.asleep_tags(0).unwrap(), 1 << w);
    let after = pool.stats(0).unwrap();
    assert_eq!(
        (after.reserved_bytes, after.sleeping_bytes),
        (before.reserved_bytes, before.sleeping_bytes)
    );
    assert!(after.reserved_bytes <= 24 * MIB);
    // Room again: the wake restores everything, bitwise.
    for p in other {
        pool.free(p).unwrap();
    }
    pool.empty_cache(None).unwrap();
    pool.wake(Some(0), None).unwrap();
    assert_bytes_back(&pool, &blocks);
}

#[test]
fn validate_beside_sleeps_and_wakes_sees_no_broken_invariant() {
    // While a sleep, wake, `prepare_offload` or `release_host_buffers` moves host buffers,
    // they are counted but in neither an arena nor the kept list: a `validate` from
    // another thread meanwhile reported a broken invariant (a panic in debug builds).
    let (_sim, pool) = pool(1 << 30);
    let pool = Arc::new(pool);
    let w = tags::index(Some("wr_v")).unwrap();
    let blocks: Vec<u64> = (0..8)
        .map(|_| alloc_with(&pool, "wr_v", 6 * MIB, S))
        .collect();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let checker = {
        let (pool, stop) = (pool.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut n = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                if let Err(e) = pool.validate(0) {
                    return Err(format!("validate #{n} beside a wake: {e}"));
                }
                n += 1;
            }
            Ok(n)
        })
    };
    for i in 0..20 {
        pool.sleep_tags(Some(0), Some(&[w]), &[w]).unwrap();
        pool.wake(Some(0), Some(&[w])).unwrap();
        if i % 5 == 4 {
            pool.release_host_buffers(Some(0)).unwrap();
            pool.prepare_offload(Some(0), &[w]).unwrap();
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let checks = checker.join().unwrap().unwrap();
    assert!(checks > 0);
    for p in blocks {
        pool.free(p).unwrap();
    }
}
