//! Growable arenas on the mock driver: each growth one more allocation mapped right after
//! the arena, the export one fd per chunk, its import mapped back to back and unmapped
//! chunk by chunk, sleep and wake as one allocation, teardown of every chunk and the
//! reservation, growth refused past the reservation with nothing changed, a split (trim)
//! across chunks, and free chunks dropped in place (`empty_cache`).

use super::split::assert_nothing_held;
use super::*;

const G: u64 = 2 * MIB;

/// The mock's live handles, reservations and mappings.
fn held(b: &VmmBackend<Mock>) -> (usize, usize, Vec<(u64, usize)>) {
    let m = b.driver.memory.lock();
    let maps = m.mapped.iter().map(|(&at, &(n, _))| (at, n)).collect();
    (m.live.len(), m.reserved.len(), maps)
}

#[test]
fn a_grown_arena_is_its_chunks_everywhere() {
    let b = backend(Setup::default());
    let a = b.create_growable_arena(0, 2 * G, 16 * G).unwrap();
    assert!(b.can_grow(&a, 14 * G));
    assert!(!b.can_grow(&a, 15 * G), "past the reservation");
    let a = b.grow_arena(&a, G).unwrap();
    let a = b.grow_arena(&a, 3 * G).unwrap();
    assert_eq!(a.bytes, 6 * G);
    let (live, reserved, maps) = held(&b);
    assert_eq!((live, reserved), (3, 1));
    assert_eq!(
        maps,
        [
            (a.base, (2 * G) as usize),
            (a.base + 2 * G, G as usize),
            (a.base + 3 * G, (3 * G) as usize)
        ]
    );
    // Growth past the reservation: refused, nothing changed.
    assert!(b.grow_arena(&a, 11 * G).is_err());
    assert_eq!(held(&b).2.len(), 3);

    // The export is one fd per chunk; an import maps them back to back.
    let export = b.export(&a).unwrap();
    let chunks = export.chunk_fds(a.bytes);
    assert_eq!(
        chunks.iter().map(|c| c.0).collect::<Vec<_>>(),
        [2 * G, G, 3 * G]
    );
    let m = b.import(0, ImportSource::Chunks(&chunks), a.bytes).unwrap();
    let imported: Vec<_> = held(&b)
        .2
        .into_iter()
        .filter(|&(at, _)| at >= m.base && at < m.base + m.bytes)
        .collect();
    assert_eq!(imported.len(), 3);
    // Lengths that do not make the size asked: refused, nothing mapped.
    let before = held(&b);
    assert!(b
        .import(0, ImportSource::Chunks(&chunks), a.bytes + G)
        .is_err());
    assert_eq!(held(&b), before);
    b.unmap_import(m).unwrap();
    drop(chunks);
    b.close_export(&a, export).unwrap();

    // Sleep releases every chunk; wake maps one allocation; it can grow again.
    b.release_physical(&a).unwrap();
    assert_eq!(held(&b), (0, 1, Vec::new()));
    let a = b.restore_physical(&a).unwrap();
    assert_eq!(held(&b).2, [(a.base, (6 * G) as usize)]);
    let export = b.export(&a).unwrap();
    assert_eq!(export.chunk_fds(a.bytes).len(), 1);
    b.close_export(&a, export).unwrap();
    assert!(b.can_grow(&a, G));
    let a = b.grow_arena(&a, G).unwrap();

    // Destroying it releases every chunk and the reservation.
    b.destroy_arena(a).unwrap();
    assert_nothing_held(&b.driver.memory);
}

#[test]
fn a_failed_growth_changes_nothing() {
    let b = backend(Setup::default());
    let a = b.create_growable_arena(0, G, 8 * G).unwrap();
    b.driver.fail_on("map", 0);
    assert!(b.grow_arena(&a, G).is_err());
    assert_eq!(held(&b), (1, 1, vec![(a.base, G as usize)]));
    let a = b.grow_arena(&a, G).unwrap();
    b.destroy_arena(a).unwrap();
    assert_nothing_held(&b.driver.memory);
}

#[test]
fn a_shrink_unmaps_and_releases_the_chunks_past_keep_and_growth_resumes_there() {
    let b = backend(Setup::default());
    let a = b.create_growable_arena(0, 2 * G, 16 * G).unwrap();
    let a = b.grow_arena(&a, G).unwrap();
    let a = b.grow_arena(&a, 3 * G).unwrap();
    // Nothing starts at or past 7 G: nothing goes.
    let (same, n) = b.shrink_arena(&a, 7 * G).unwrap();
    assert_eq!((same.bytes, n), (6 * G, 0));
    // Keep 2.5 G: the chunk at 3 G goes, the one at 2 G (reaching 3 G) stays.
    let (s, n) = b.shrink_arena(&a, 2 * G + G / 2).unwrap();
    assert_eq!((s.base, s.bytes, n), (a.base, 3 * G, 1));
    let stale = s.clone();
    let (live, reserved, maps) = held(&b);
    assert_eq!((live, reserved), (2, 1));
    assert_eq!(
        maps,
        [(a.base, (2 * G) as usize), (a.base + 2 * G, G as usize)]
    );
    // The first chunk never goes.
    let (s, n) = b.shrink_arena(&s, 0).unwrap();
    assert_eq!((s.bytes, n), (2 * G, 1));
    assert!(
        b.can_grow(&s, 14 * G),
        "the reservation is free past the end again"
    );
    let s = b.grow_arena(&s, 4 * G).unwrap();
    assert_eq!(
        held(&b).2,
        [
            (s.base, (2 * G) as usize),
            (s.base + 2 * G, (4 * G) as usize)
        ]
    );
    // The arena as it was before is no arena of this backend any more: refused.
    assert!(b.shrink_arena(&stale, 0).is_err());
    assert_eq!(held(&b).2.len(), 2);
    b.destroy_arena(s).unwrap();
    assert_nothing_held(&b.driver.memory);
}

/// A growable arena of chunks 2 G, G and 3 G (reservation 16 G), granule `i` holding
/// `0x40 + i`.
fn grown_and_filled(b: &VmmBackend<Mock>) -> ArenaMem {
    let a = b.create_growable_arena(0, 2 * G, 16 * G).unwrap();
    let a = b.grow_arena(&a, G).unwrap();
    let a = b.grow_arena(&a, 3 * G).unwrap();
    for i in 0..6u8 {
        b.memcpy_htod(a.base + u64::from(i) * G, &vec![0x40 + i; G as usize])
            .unwrap();
    }
    a
}

/// Windows across the chunk boundaries: granule 1 (first chunk) to 2 (second chunk), and
/// granule 4 (third chunk).
const GROWN_WINDOWS: [(u64, u64); 2] = [(G, 2 * G), (4 * G, G)];

#[test]
fn a_grown_arena_splits_across_its_chunks_and_gives_every_chunk_back() {
    let b = backend(Setup::default());
    let a = grown_and_filled(&b);
    assert!(b.can_split(&a));
    let windows = b.split_arena(&a, &GROWN_WINDOWS).unwrap();
    assert_eq!(windows.len(), 2);
    for (w, &(offset, len)) in windows.iter().zip(&GROWN_WINDOWS) {
        assert_eq!((w.base, w.bytes), (a.base + offset, len));
        for g in 0..len / G {
            let mut back = vec![0u8; G as usize];
            b.memcpy_dtoh(&mut back, w.base + g * G).unwrap();
            let expect = 0x40 + ((offset / G + g) as u8);
            assert!(
                back.iter().all(|&x| x == expect),
                "window {offset:#x} granule {g}"
            );
        }
    }
    // Only the windows' memory is held: the three chunks went, the reservation stays.
    let (live, reserved, maps) = held(&b);
    assert_eq!((live, reserved), (2, 1));
    assert_eq!(
        maps,
        [(a.base + G, (2 * G) as usize), (a.base + 4 * G, G as usize)]
    );
    // The windows are plain arenas: they do not grow, and the old arena is gone.
    assert!(!b.can_grow(&windows[1], G));
    assert!(b.grow_arena(&a, G).is_err());
    for w in windows {
        b.destroy_arena(w).unwrap();
    }
    assert_nothing_held(&b.driver.memory);
}

#[test]
fn a_failed_split_of_a_grown_arena_maps_its_chunks_back() {
    let b = backend(Setup::default());
    let a = grown_and_filled(&b);
    let before = held(&b);
    // Two windows: 2 temporary maps, then the arena's 3 chunks unmapped; the second
    // chunk's unmap fails (the first is mapped back), then the first window's map fails
    // (all three are mapped back).
    for (call, k) in [("unmap", 3), ("map", 2)] {
        b.driver.fail_on(call, k);
        let e = b.split_arena(&a, &GROWN_WINDOWS).unwrap_err();
        assert!(
            b.driver.fail_on.lock().is_empty(),
            "{call} #{k} not reached"
        );
        assert!(e.to_string().contains(call), "{call} #{k}: {e}");
        assert_eq!(held(&b), before, "after a failed {call} #{k}");
        for i in 0..6u8 {
            let mut back = vec![0u8; G as usize];
            b.memcpy_dtoh(&mut back, a.base + u64::from(i) * G).unwrap();
            assert!(
                back.iter().all(|&x| x == 0x40 + i),
                "{call} #{k}: granule {i}"
            );
        }
    }
    // Still whole and grown: it grows again, and is destroyed with every chunk.
    let a = b.grow_arena(&a, G).unwrap();
    b.destroy_arena(a).unwrap();
    assert_nothing_held(&b.driver.memory);
}

#[test]
fn free_chunks_drop_in_place_and_the_runs_kept_are_arenas() {
    let b = backend(Setup::default());
    // Chunks 2 G, G, 3 G and G; the second dropped: runs [0] and [2, 3].
    let a = grown_and_filled(&b);
    let a = b.grow_arena(&a, G).unwrap();
    let spans = b.chunk_spans(&a);
    assert_eq!(spans, [(0, 2 * G), (2 * G, G), (3 * G, 3 * G), (6 * G, G)]);
    b.driver.calls.lock().clear();
    let runs = b.drop_chunks(&a, &[1]).unwrap();
    // Nothing copied or mapped: the chunk's mapping goes, then its allocation.
    let calls = std::mem::take(&mut *b.driver.calls.lock());
    assert_eq!(calls.len(), 2, "{calls:?}");
    assert!(
        matches!(calls[0], Call::Unmap(at) if at == a.base + 2 * G),
        "{calls:?}"
    );
    assert!(matches!(calls[1], Call::Release(_)), "{calls:?}");
    let shape: Vec<_> = runs
        .iter()
        .map(|(m, n)| (m.base - a.base, m.bytes, *n))
        .collect();
    assert_eq!(shape, [(0, 2 * G, 1), (3 * G, 4 * G, 2)]);
    let (live, reserved, maps) = held(&b);
    assert_eq!((live, reserved), (3, 1));
    let expect = [(0, 2 * G), (3 * G, 3 * G), (6 * G, G)];
    let expect: Vec<_> = expect
        .iter()
        .map(|&(o, n)| (a.base + o, n as usize))
        .collect();
    assert_eq!(maps, expect, "the kept chunks, where they were");
    for i in [0u8, 1, 3, 4, 5] {
        let mut back = vec![0u8; G as usize];
        b.memcpy_dtoh(&mut back, a.base + u64::from(i) * G).unwrap();
        assert!(back.iter().all(|&x| x == 0x40 + i), "granule {i}");
    }
    // A run of two chunks is an arena of two chunks: exported as two fds; it cannot grow.
    let (two, _) = runs[1].clone();
    assert_eq!(b.chunk_spans(&two), [(0, 3 * G), (3 * G, G)]);
    let export = b.export(&two).unwrap();
    assert_eq!(export.chunk_fds(two.bytes).len(), 2);
    b.close_export(&two, export).unwrap();
    assert!(!b.can_grow(&two, G));
    // The old arena is gone; bad lists are refused with nothing changed.
    assert!(b.drop_chunks(&a, &[1]).is_err());
    for bad in [&[][..], &[0, 1][..], &[1, 0][..], &[2][..]] {
        assert!(b.drop_chunks(&two, bad).is_err(), "{bad:?}");
    }
    assert_eq!(held(&b).2, expect);
    // Dropped again, then everything destroyed: the reservation goes with the last run.
    let rest = b.drop_chunks(&two, &[0]).unwrap();
    assert_eq!(rest.len(), 1);
    assert_eq!((rest[0].0.base, rest[0].0.bytes), (a.base + 6 * G, G));
    b.destroy_arena(runs[0].0.clone()).unwrap();
    assert_eq!(held(&b).1, 1, "the last run holds the reservation");
    b.destroy_arena(rest[0].0.clone()).unwrap();
    assert_nothing_held(&b.driver.memory);
}

#[test]
fn a_chunk_that_will_not_unmap_stays_in_its_run() {
    let b = backend(Setup::default());
    let a = grown_and_filled(&b);
    // Chunks 0 and 2 asked; chunk 0's unmap fails: it stays, with chunk 1, in one run.
    b.driver.fail_on("unmap", 0);
    let runs = b.drop_chunks(&a, &[0, 2]).unwrap();
    let shape: Vec<_> = runs
        .iter()
        .map(|(m, n)| (m.base - a.base, m.bytes, *n))
        .collect();
    assert_eq!(shape, [(0, 3 * G, 2)]);
    assert_eq!(held(&b).0, 2, "chunk 2's allocation released");
    // Every unmap failing: nothing dropped, the arena unchanged and still whole.
    let (run, _) = runs[0].clone();
    b.driver.fail_on("unmap", 0);
    assert!(b.drop_chunks(&run, &[1]).is_err());
    assert_eq!(b.chunk_spans(&run), [(0, 2 * G), (2 * G, G)]);
    b.destroy_arena(run).unwrap();
    assert_nothing_held(&b.driver.memory);
}
