//! `split_arena` on the mock driver: contents kept, the rest given back, the call order,
//! reservations freed with the last window, windows as arenas (sleep, wake, export, split
//! again, drop), every failure point undone, bad windows refused.

use super::*;
use crate::backend::vmm::registry::SplitReservation;

const G: u64 = 2 * MIB;

/// A 16 MiB arena on device 0 with a distinct byte in every granule (granule `i` holds
/// `0x10 + i`).
fn filled_arena(b: &VmmBackend<Mock>) -> ArenaMem {
    let a = b.create_arena(0, 8 * G).unwrap();
    for i in 0..8u8 {
        let data = vec![0x10 + i; G as usize];
        b.memcpy_htod(a.base + u64::from(i) * G, &data).unwrap();
    }
    a
}

/// The bytes at `addr..addr + len` through the backend's (range-checked) copy.
fn read(b: &VmmBackend<Mock>, addr: u64, len: u64) -> Vec<u8> {
    let mut back = vec![0u8; len as usize];
    b.memcpy_dtoh(&mut back, addr).unwrap();
    back
}

/// Check that every granule of `window` (at `offset` in the filled arena) holds its byte.
fn assert_contents(b: &VmmBackend<Mock>, window: &ArenaMem, offset: u64) {
    for g in 0..window.bytes / G {
        let expect = 0x10 + ((offset / G + g) as u8);
        let back = read(b, window.base + g * G, G);
        assert!(
            back.iter().all(|&x| x == expect),
            "window at offset {offset:#x}, granule {g}"
        );
    }
}

/// Live handles, reservations (base -> size) and mappings (base -> (size, handle)).
type MemoryView = (
    BTreeSet<u64>,
    BTreeMap<u64, usize>,
    BTreeMap<u64, (usize, u64)>,
);

/// The live handles, reservations and mappings of the mock.
fn memory_view(b: &VmmBackend<Mock>) -> MemoryView {
    let m = b.driver.memory.lock();
    (m.live.clone(), m.reserved.clone(), m.mapped.clone())
}

/// Assert the memory model holds nothing (after everything was destroyed or dropped).
pub(super) fn assert_nothing_held(memory: &Mutex<Memory>) {
    let m = memory.lock();
    assert!(m.live.is_empty(), "live handles: {:?}", m.live);
    assert!(m.reserved.is_empty(), "reservations: {:?}", m.reserved);
    assert!(m.mapped.is_empty(), "mappings: {:?}", m.mapped);
}

const WINDOWS: [(u64, u64); 3] = [(G, G), (4 * G, 2 * G), (7 * G, G)];

/// Destroy every window, then check the driver holds nothing.
fn destroy_all(b: &VmmBackend<Mock>, windows: Vec<ArenaMem>) {
    for w in windows {
        b.destroy_arena(w).unwrap();
    }
    assert_nothing_held(&b.driver.memory);
}

#[test]
fn split_keeps_the_windows_contents_and_gives_the_rest_back() {
    let b = backend(Setup {
        peers: vec![(0, 1)],
        ..Setup::default()
    });
    let a = filled_arena(&b);
    take_calls(&b);
    let windows = b.split_arena(&a, &WINDOWS).unwrap();
    let calls = take_calls(&b);

    // Same addresses, the windows' sizes, new handles.
    assert_eq!(windows.len(), 3);
    for (w, &(offset, len)) in windows.iter().zip(&WINDOWS) {
        assert_eq!((w.device, w.base, w.bytes), (0, a.base + offset, len));
        assert_ne!(w.handle, a.handle);
        assert_contents(&b, w, offset);
    }
    // Only the windows are mapped, each to its own handle; the old handle is released; the
    // arena's reservation stays, the temporary one is gone.
    let (live, reserved, mapped) = memory_view(&b);
    let handles: BTreeSet<u64> = windows.iter().map(|w| w.handle).collect();
    assert_eq!(live, handles);
    assert_eq!(
        reserved.into_iter().collect::<Vec<_>>(),
        [(a.base, 8 * G as usize)]
    );
    let expect: BTreeMap<u64, (usize, u64)> = windows
        .iter()
        .map(|w| (w.base, (w.bytes as usize, w.handle)))
        .collect();
    assert_eq!(mapped, expect);
    // Between windows: no live arena any more.
    let mut gap = [0u8; 16];
    assert!(matches!(
        b.memcpy_dtoh(&mut gap, a.base),
        Err(Error::UnknownPointer { .. })
    ));
    assert!(
        b.memcpy_dtoh(&mut gap, a.base + 2 * G - 8).is_err(),
        "across a window's end"
    );

    // The order: create, copy through one temporary range (access for the peers too),
    // synchronize, free it; then unmap the old memory, map the windows, release the old.
    let [Call::Create { .. }, Call::Create { .. }, Call::Create { .. }, Call::Reserve(tmp), ..] =
        calls[..]
    else {
        panic!("{calls:?}");
    };
    let mut expect = Vec::new();
    let mut at = tmp;
    for (w, &(offset, len)) in windows.iter().zip(&WINDOWS) {
        expect.push(Call::Map(at, w.handle));
        expect.push(Call::SetAccess(at, vec![0, 1]));
        expect.push(Call::CopyDtoD {
            dst: at,
            src: a.base + offset,
        });
        at += len;
    }
    expect.push(Call::Synchronize);
    expect.extend([
        Call::Unmap(tmp),
        Call::Unmap(tmp + G),
        Call::Unmap(tmp + 3 * G),
    ]);
    expect.push(Call::AddressFree(tmp));
    expect.push(Call::Unmap(a.base));
    for w in &windows {
        expect.push(Call::Map(w.base, w.handle));
        expect.push(Call::SetAccess(w.base, vec![0, 1]));
    }
    expect.push(Call::Release(a.handle));
    assert_eq!(calls[4..], expect[..]);

    // The old record is gone: it cannot be destroyed or split again.
    assert!(b.destroy_arena(a.clone()).is_err());
    assert!(matches!(
        b.split_arena(&a, &WINDOWS),
        Err(Error::InvalidState(_))
    ));
    destroy_all(&b, windows);
}

#[test]
fn the_reservation_is_freed_with_the_last_window() {
    let b = backend(Setup::default());
    let a = filled_arena(&b);
    let mut windows = b.split_arena(&a, &WINDOWS).unwrap();
    let split = |b: &VmmBackend<Mock>| b.splits.lock().get(&a.base).copied();
    assert_eq!(
        split(&b),
        Some(SplitReservation {
            bytes: 8 * G,
            windows: 3
        })
    );
    take_calls(&b);
    let last = windows.remove(0);
    for w in windows {
        let (base, handle) = (w.base, w.handle);
        b.destroy_arena(w).unwrap();
        assert_eq!(take_calls(&b), [Call::Unmap(base), Call::Release(handle)]);
    }
    assert_eq!(
        split(&b),
        Some(SplitReservation {
            bytes: 8 * G,
            windows: 1
        })
    );
    assert!(b.driver.memory.lock().reserved.contains_key(&a.base));
    let (base, handle) = (last.base, last.handle);
    b.destroy_arena(last).unwrap();
    // The whole reservation, with the base and size it was reserved with.
    assert_eq!(
        take_calls(&b),
        [
            Call::Unmap(base),
            Call::AddressFree(a.base),
            Call::Release(handle)
        ]
    );
    assert!(b.splits.lock().is_empty());
    assert_nothing_held(&b.driver.memory);
}

#[test]
fn a_window_sleeps_wakes_exports_and_splits_again() {
    let b = backend(Setup::default());
    let a = filled_arena(&b);
    let [w0, w1, w2]: [ArenaMem; 3] = b.split_arena(&a, &WINDOWS).unwrap().try_into().unwrap();

    // Export and import a window: the import sees its bytes.
    let export = b.export(&w1).unwrap();
    let m = b
        .import(0, ImportSource::Fd(export.fd().unwrap()), w1.bytes)
        .unwrap();
    b.close_export(&w1, export).unwrap();
    b.unmap_import(m).unwrap();

    // Sleep and wake a window at the same addresses; its neighbours keep their bytes.
    b.release_physical(&w0).unwrap();
    assert!(b.memcpy_dtoh(&mut [0u8; 8], w0.base).is_err(), "asleep");
    let w0 = b.restore_physical(&w0).unwrap();
    assert_eq!(w0.base, a.base + G);
    b.memcpy_htod(w0.base, &[9; 8]).unwrap();
    assert_contents(&b, &w2, 7 * G);

    // Split the 4 MiB window again: its second granule alone stays.
    let [w1b]: [ArenaMem; 1] = b.split_arena(&w1, &[(G, G)]).unwrap().try_into().unwrap();
    assert_eq!((w1b.base, w1b.bytes), (w1.base + G, G));
    assert_contents(&b, &w1b, 5 * G);
    assert_eq!(b.splits.lock().get(&a.base).map(|r| r.windows), Some(3));

    // A sleeping window is torn down too: destroy it asleep, then drop the backend with the
    // other two still live: nothing is left.
    b.release_physical(&w0).unwrap();
    b.destroy_arena(w0).unwrap();
    assert!(b.driver.memory.lock().reserved.contains_key(&a.base));
    let memory = Arc::clone(&b.driver.memory);
    drop(b);
    assert_nothing_held(&memory);
}

/// What a failed split must leave exactly as it was.
#[derive(Debug, PartialEq)]
struct Snapshot {
    regions: Vec<(u64, Region)>,
    splits: Vec<(u64, SplitReservation)>,
    memory: MemoryView,
    contents: Vec<u8>,
}

fn snapshot(b: &VmmBackend<Mock>, a: &ArenaMem) -> Snapshot {
    Snapshot {
        regions: b.regions.read().iter().map(|(k, v)| (*k, *v)).collect(),
        splits: b.splits.lock().iter().map(|(k, v)| (*k, *v)).collect(),
        memory: memory_view(b),
        contents: read(b, a.base, a.bytes),
    }
}

#[test]
fn every_failed_step_leaves_the_arena_as_it_was() {
    let b = backend(Setup::default());
    let a = filled_arena(&b);
    let before = snapshot(&b, &a);
    // Three windows: 3 creates, 1 reserve, 6 maps and set-accesses (3 temporary, 3 at the
    // windows), 3 copies, 1 synchronize, 4 unmaps (3 temporary, then the old memory), 1
    // free of the temporary range.
    let points = [
        ("mem_create", 0..3),
        ("address_reserve", 0..1),
        ("map", 0..6),
        ("set_access", 0..6),
        ("memcpy_dtod", 0..3),
        ("synchronize", 0..1),
        ("unmap", 3..4),
        // A temporary mapping that does not unmap, a temporary range that is not freed:
        // the arena is as it was, the temporary range is leaked (nothing else can be done).
        ("unmap", 0..3),
        ("address_free", 0..1),
    ];
    for (call, uses) in points {
        for k in uses {
            b.driver.fail_on(call, k);
            let e = b.split_arena(&a, &WINDOWS).unwrap_err();
            assert!(
                b.driver.fail_on.lock().is_empty(),
                "{call} #{k} was not reached"
            );
            assert!(e.to_string().contains(call), "{call} #{k}: {e}");
            let after = snapshot(&b, &a);
            let leaky = matches!((call, k), ("unmap", 0..3) | ("address_free", _));
            if leaky {
                assert_eq!(after.regions, before.regions, "{call} #{k}");
                assert_eq!(after.splits, before.splits, "{call} #{k}");
                assert_eq!(after.contents, before.contents, "{call} #{k}");
                assert_eq!(after.memory.2.get(&a.base), before.memory.2.get(&a.base));
                assert!(after.memory.0.contains(&a.handle));
                // Forget the leaked temporary range so the next points compare exactly.
                let mut m = b.driver.memory.lock();
                m.mapped
                    .retain(|base, _| before.memory.2.contains_key(base));
                m.reserved
                    .retain(|base, _| before.memory.1.contains_key(base));
                m.live.retain(|h| before.memory.0.contains(h));
            } else {
                assert_eq!(after, before, "after a failed {call} #{k}");
            }
        }
    }
    // Still a whole arena: it splits, and everything is freed afterwards.
    destroy_all(&b, b.split_arena(&a, &WINDOWS).unwrap());
}

#[test]
fn an_arena_whose_memory_cannot_be_mapped_back_is_left_asleep() {
    let b = backend(Setup::default());
    let a = filled_arena(&b);
    // The first window's map fails (after the old memory was unmapped), and so does mapping
    // the old memory back: the arena is recorded asleep, its reservation kept, nothing held.
    b.driver.fail_on("map", 3);
    b.driver.fail_on("map", 4);
    let e = b.split_arena(&a, &WINDOWS).unwrap_err();
    assert!(e.to_string().contains("map"), "{e}");
    assert!(
        b.driver.fail_on.lock().is_empty(),
        "the map back was not tried"
    );
    let (live, reserved, mapped) = memory_view(&b);
    assert!(live.is_empty() && mapped.is_empty(), "{live:?} {mapped:?}");
    assert_eq!(
        reserved.into_iter().collect::<Vec<_>>(),
        [(a.base, 8 * G as usize)]
    );
    assert_eq!(
        b.regions.read().get(&a.base).map(|r| r.kind),
        Some(RegionKind::Asleep)
    );
    // It wakes like any sleeping arena, or is destroyed: its reservation freed.
    let a = b.restore_physical(&a).unwrap();
    b.release_physical(&a).unwrap();
    b.destroy_arena(a).unwrap();
    assert_nothing_held(&b.driver.memory);
}

#[test]
fn bad_windows_and_arenas_are_refused_and_change_nothing() {
    let b = backend(Setup::default());
    let a = filled_arena(&b);
    let before = snapshot(&b, &a);
    take_calls(&b);
    let bad: [&[(u64, u64)]; 8] = [
        &[],
        &[(MIB, G)],
        &[(0, 0)],
        &[(0, G + MIB)],
        &[(7 * G, 2 * G)],
        &[(u64::MAX - G + 1, G)],
        &[(0, 2 * G), (G, G)],
        &[(4 * G, G), (0, G)],
    ];
    for windows in bad {
        let e = b.split_arena(&a, windows).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{windows:?}: {e}");
    }
    // A record that does not match, an unknown arena: InvalidState.
    let wrong_handle = ArenaMem {
        handle: a.handle + 1,
        ..a.clone()
    };
    let wrong_size = ArenaMem {
        bytes: 4 * G,
        ..a.clone()
    };
    let unknown = ArenaMem {
        base: a.base + 64 * MIB,
        ..a.clone()
    };
    for arena in [wrong_handle, wrong_size, unknown] {
        let e = b.split_arena(&arena, &[(0, G)]).unwrap_err();
        assert!(matches!(e, Error::InvalidState(_)), "{arena:?}: {e}");
    }
    assert_eq!(take_calls(&b), []);
    assert_eq!(snapshot(&b, &a), before);

    // Asleep: InvalidState, still asleep.
    b.release_physical(&a).unwrap();
    let e = b.split_arena(&a, &[(0, G)]).unwrap_err();
    assert!(matches!(e, Error::InvalidState(_)), "{e}");
    let a = b.restore_physical(&a).unwrap();
    b.destroy_arena(a).unwrap();

    // An import is not an arena; a legacy arena cannot be split.
    let c = b.create_arena(0, 2 * G).unwrap();
    let export = b.export(&c).unwrap();
    let m = b
        .import(0, ImportSource::Fd(export.fd().unwrap()), 2 * G)
        .unwrap();
    let as_arena = ArenaMem {
        device: 0,
        base: m.base,
        bytes: m.bytes,
        handle: c.handle,
    };
    assert!(matches!(
        b.split_arena(&as_arena, &[(0, G)]),
        Err(Error::InvalidState(_))
    ));
    b.unmap_import(m).unwrap();
    b.close_export(&c, export).unwrap();
    b.destroy_arena(c).unwrap();
    let f = filled_arena(&b);
    assert!(b.can_split(&f));
    b.destroy_arena(f).unwrap();
    let legacy = backend(Setup::default()).with_legacy_ipc(true);
    let l = legacy.create_arena(0, 2 * G).unwrap();
    assert!(!legacy.can_split(&l), "a legacy arena says so up front");
    let e = legacy.split_arena(&l, &[(0, G)]).unwrap_err();
    assert!(matches!(e, Error::Unavailable(_)), "{e}");
    legacy.destroy_arena(l).unwrap();
}
