//! Unit tests of the simulated device.
//!
//! Leak checks count only the fds and mappings whose memfd name carries the backend's own
//! tag (`/proc/self/fd` links and `/proc/self/maps` lines show the memfd name), so tests
//! running in parallel threads, which open fds of their own, cannot disturb them.
#![allow(clippy::unwrap_used)]

use std::io::Write as _;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};

use rustix::fs::MemfdFlags;

use super::*;

pub(super) const MIB: u64 = 1 << 20;
pub(super) const GIB: u64 = 1 << 30;

/// Two devices of `capacity` bytes, 2 MiB granularity.
pub(super) fn sim_with(capacity: u64, legacy_pin: bool) -> SimBackend {
    SimBackend::new(SimConfig {
        devices: 2,
        capacity,
        granularity: 2 * MIB,
        legacy_pin,
    })
    .unwrap()
}

pub(super) fn sim() -> SimBackend {
    sim_with(64 * MIB, false)
}

pub(super) fn write(addr: u64, off: u64, data: &[u8]) {
    // SAFETY: every caller passes the base of a live mapping at least `off + data.len()`
    // bytes long that no other thread accesses at the same time.
    unsafe {
        std::ptr::copy_nonoverlapping(data.as_ptr(), (addr + off) as usize as *mut u8, data.len())
    }
}

pub(super) fn read(addr: u64, off: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    // SAFETY: as in `write`: a live mapping of at least `off + len` bytes.
    unsafe {
        std::ptr::copy_nonoverlapping((addr + off) as usize as *const u8, out.as_mut_ptr(), len)
    }
    out
}

/// Open fds of this process whose target names `tag`.
pub(super) fn tagged_fds(tag: &str) -> usize {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| {
            std::fs::read_link(e.path())
                .map(|p| p.to_string_lossy().contains(tag))
                .unwrap_or(false)
        })
        .count()
}

/// Every arena of `s` destroyed (`parts` first): the ledger of device 0 is clean and no
/// memfd of `s` (named by `s.memfd_tag()`) is open or mapped.
pub(super) fn destroy_and_assert_clean(s: &SimBackend, parts: Vec<(ArenaMem, usize)>) {
    for (p, _) in parts {
        s.destroy_arena(p).unwrap();
    }
    assert!(s.is_clean(0), "{:?}", s.ledger(0));
    let tag = s.memfd_tag();
    assert_eq!((tagged_fds(&tag), tagged_maps(&tag)), (0, 0));
}

/// Mappings of this process whose file names `tag`.
pub(super) fn tagged_maps(tag: &str) -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter(|l| l.contains(tag))
        .count()
}

pub(super) fn foreign_memfd(name: &str, bytes: u64, data: &[u8]) -> std::fs::File {
    let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC).unwrap();
    rustix::fs::ftruncate(&fd, bytes).unwrap();
    let mut f = std::fs::File::from(fd);
    f.write_all(data).unwrap();
    f
}

pub(super) fn is_invalid<T: std::fmt::Debug>(r: Result<T>) -> bool {
    matches!(r, Err(Error::InvalidArgument(_)))
}

#[test]
fn config_defaults_and_validation() {
    let c = SimConfig::default();
    assert_eq!(
        (c.devices, c.capacity, c.granularity, c.legacy_pin),
        (1, 16 * GIB, 2 * MIB, false)
    );
    let s = SimBackend::new(c.clone()).unwrap();
    assert_eq!(s.name(), "sim");
    assert_eq!(s.device_count().unwrap(), 1);
    assert_eq!(s.granularity(0).unwrap(), 2 * MIB);
    assert_eq!(
        s.granularity(1),
        Err(Error::InvalidDevice {
            device: 1,
            count: 1
        })
    );
    assert_eq!(
        s.mem_info(0).unwrap(),
        MemInfo {
            free: 16 * GIB,
            total: 16 * GIB
        }
    );
    let bad = [
        SimConfig { devices: 0, ..c },
        SimConfig {
            granularity: 0,
            ..c
        },
        SimConfig {
            granularity: 1000,
            ..c
        },
        SimConfig {
            granularity: 2048,
            ..c
        },
        SimConfig {
            granularity: 3 * 4096,
            ..c
        },
        SimConfig { capacity: 0, ..c },
        SimConfig {
            capacity: 3 * MIB,
            ..c
        },
    ];
    for cfg in bad {
        assert!(is_invalid(SimBackend::new(cfg.clone())), "{cfg:?} accepted");
    }
    let small = SimConfig {
        devices: 3,
        capacity: 4096,
        granularity: 4096,
        legacy_pin: false,
    };
    assert_eq!(SimBackend::new(small).unwrap().device_count().unwrap(), 3);
    let json: SimConfig = serde_json::from_str(r#"{"devices": 2}"#).unwrap();
    assert_eq!(json, SimConfig { devices: 2, ..c });
}

#[test]
fn create_write_read_destroy() {
    let s = sim();
    let a = s.create_arena(0, 2 * MIB).unwrap();
    let b = s.create_arena(1, 4 * MIB).unwrap();
    assert_ne!(a.handle, b.handle);
    assert_eq!(
        (a.device, a.bytes, b.device, b.bytes),
        (0, 2 * MIB, 1, 4 * MIB)
    );
    assert!(a.base != 0 && a.base % 4096 == 0);
    assert_eq!(read(a.base, 0, 16), vec![0; 16], "fresh memory reads zero");
    write(a.base, 0, b"hello");
    write(a.base, 2 * MIB - 5, b"world");
    write(b.base, 0, b"other");
    assert_eq!(read(a.base, 0, 5), b"hello");
    assert_eq!(read(a.base, 2 * MIB - 5, 5), b"world");
    assert_eq!(read(b.base, 0, 5), b"other");
    assert_eq!(
        s.ledger(0),
        SimLedger {
            held_bytes: 2 * MIB,
            live_arenas: 1,
            ..SimLedger::default()
        }
    );
    assert_eq!(s.ledger(1).held_bytes, 4 * MIB);
    assert_eq!(s.mem_info(1).unwrap().free, 60 * MIB);
    s.destroy_arena(a).unwrap();
    s.destroy_arena(b.clone()).unwrap();
    assert!(s.is_clean(0) && s.is_clean(1));
    assert_eq!(s.mem_info(1).unwrap().free, 64 * MIB);
    let c = s.create_arena(0, 2 * MIB).unwrap();
    assert!(c.handle > b.handle, "handles are never reused");
    s.destroy_arena(c).unwrap();
    assert_eq!(s.calls(SimCall::CreateArena), 3);
    assert_eq!(s.calls(SimCall::DestroyArena), 3);
}

#[test]
fn capacity_and_oom() {
    let s = sim_with(8 * MIB, false);
    let a = s.create_arena(0, 6 * MIB).unwrap();
    assert_eq!(
        s.create_arena(0, 4 * MIB),
        Err(Error::DriverOutOfMemory {
            backend: "sim",
            call: "create_arena",
            device: 0,
            bytes: 4 * MIB
        })
    );
    assert_eq!(
        s.ledger(0).live_arenas,
        1,
        "a refused create changes nothing"
    );
    // Devices have separate capacities.
    let d1 = s.create_arena(1, 8 * MIB).unwrap();
    // Exactly full is fine.
    let b = s.create_arena(0, 2 * MIB).unwrap();
    assert_eq!(s.mem_info(0).unwrap().free, 0);
    // A huge request is refused, not overflowed.
    let huge = 1u64 << 62;
    assert!(matches!(
        s.create_arena(0, huge),
        Err(Error::DriverOutOfMemory { bytes, .. }) if bytes == huge
    ));
    for arena in [a, b, d1] {
        s.destroy_arena(arena).unwrap();
    }
    let all = s.create_arena(0, 8 * MIB).unwrap();
    s.destroy_arena(all).unwrap();
    assert!(s.is_clean(0) && s.is_clean(1));
}

#[test]
fn held_until_every_export_is_closed() {
    let s = sim_with(8 * MIB, false);
    let a = s.create_arena(0, 8 * MIB).unwrap();
    let ex1 = s.export(&a).unwrap();
    let ex2 = s.export(&a).unwrap();
    assert_eq!(ex1.kind, ExportKind::Releasable);
    assert!(ex1.fd().is_some());
    assert_eq!(s.calls(SimCall::Export), 2);
    assert_eq!(s.ledger(0).open_exports, 2);

    s.destroy_arena(a.clone()).unwrap();
    let held = SimLedger {
        held_bytes: 8 * MIB,
        destroyed_but_held: 1,
        open_exports: 2,
        ..SimLedger::default()
    };
    assert_eq!(s.ledger(0), held);
    assert_eq!(s.mem_info(0).unwrap().free, 0);
    assert!(matches!(
        s.create_arena(0, 2 * MIB),
        Err(Error::DriverOutOfMemory { .. })
    ));
    // A second destroy and an export of the destroyed arena fail and change nothing.
    assert!(is_invalid(s.destroy_arena(a.clone())));
    assert!(is_invalid(s.export(&a)));
    assert_eq!(s.ledger(0), held);

    s.close_export(&a, ex1).unwrap();
    assert_eq!(s.ledger(0).held_bytes, 8 * MIB, "one export is still open");
    s.close_export(&a, ex2).unwrap();
    assert!(s.is_clean(0));
    assert_eq!(s.mem_info(0).unwrap().free, 8 * MIB);
    // The arena is gone for good.
    assert!(is_invalid(s.destroy_arena(a)));

    // Closing first, destroying later releases at the destroy.
    let b = s.create_arena(0, 2 * MIB).unwrap();
    let ex = s.export(&b).unwrap();
    s.close_export(&b, ex).unwrap();
    assert_eq!(s.ledger(0).live_arenas, 1);
    s.destroy_arena(b).unwrap();
    assert!(s.is_clean(0));
}

#[test]
fn held_until_the_last_mapping_is_gone() {
    let s = sim_with(8 * MIB, false);
    let a = s.create_arena(0, 4 * MIB).unwrap();
    let ex = s.export(&a).unwrap();
    let m = s
        .import(0, ImportSource::Fd(ex.fd().unwrap()), a.bytes)
        .unwrap();
    // A second mapping, on the other device (peer access), of the same arena.
    let m1 = s
        .import(1, ImportSource::Fd(ex.fd().unwrap()), 2 * MIB)
        .unwrap();
    assert_ne!(m.base, a.base);
    assert_eq!((m.device, m.bytes, m1.device), (0, 4 * MIB, 1));
    // The importer closes its fd right after importing, as the CUDA path does.
    s.close_export(&a, ex).unwrap();
    assert_eq!(
        s.ledger(0),
        SimLedger {
            held_bytes: 4 * MIB,
            live_arenas: 1,
            own_mappings: 2,
            ..SimLedger::default()
        },
        "own imports count against the arena's device, not twice"
    );
    assert!(s.is_clean(1));

    write(a.base, 100, b"through the arena");
    assert_eq!(read(m.base, 100, 17), b"through the arena");
    assert_eq!(read(m1.base, 100, 17), b"through the arena");
    write(m.base, 4 * MIB - 3, b"end");
    assert_eq!(read(a.base, 4 * MIB - 3, 3), b"end");

    s.destroy_arena(a.clone()).unwrap();
    assert_eq!(
        s.ledger(0),
        SimLedger {
            held_bytes: 4 * MIB,
            destroyed_but_held: 1,
            own_mappings: 2,
            ..SimLedger::default()
        }
    );
    assert_eq!(s.mem_info(0).unwrap().free, 4 * MIB);
    assert_eq!(
        read(m.base, 100, 17),
        b"through the arena",
        "the mapping keeps the memory"
    );
    s.unmap_import(m.clone()).unwrap();
    assert_eq!(s.ledger(0).held_bytes, 4 * MIB, "one mapping is left");
    s.unmap_import(m1).unwrap();
    assert!(s.is_clean(0) && s.is_clean(1));
    assert!(is_invalid(s.unmap_import(m)));
}

#[test]
fn legacy_pin_holds_bytes_forever() {
    let s = sim_with(8 * MIB, true);
    let a = s.create_arena(0, 4 * MIB).unwrap();
    let ex = s.export(&a).unwrap();
    assert_eq!(ex.kind, ExportKind::Pinning);
    assert_eq!(s.ledger(0).pinned_bytes, 4 * MIB);
    let m = s
        .import(0, ImportSource::Fd(ex.fd().unwrap()), a.bytes)
        .unwrap();
    s.close_export(&a, ex).unwrap();
    s.unmap_import(m).unwrap();
    s.destroy_arena(a.clone()).unwrap();
    let pinned = SimLedger {
        held_bytes: 4 * MIB,
        destroyed_but_held: 1,
        pinned_bytes: 4 * MIB,
        ..SimLedger::default()
    };
    assert_eq!(s.ledger(0), pinned);
    assert!(!s.is_clean(0));
    assert_eq!(s.mem_info(0).unwrap().free, 4 * MIB);
    assert!(matches!(
        s.create_arena(0, 6 * MIB),
        Err(Error::DriverOutOfMemory { .. })
    ));
    // An arena that was never exported is released as usual.
    let b = s.create_arena(0, 4 * MIB).unwrap();
    s.destroy_arena(b).unwrap();
    assert_eq!(s.ledger(0), pinned);
    // The pinned arena cannot be destroyed again either.
    assert!(is_invalid(s.destroy_arena(a)));
    assert_eq!(s.ledger(0), pinned);
}

#[test]
fn import_of_foreign_memory() {
    let s = sim();
    let f = foreign_memfd(
        "gpu-arena-sim-test-foreign",
        2 * MIB,
        b"from another process",
    );
    let m = s.import(1, ImportSource::Fd(f.as_fd()), 2 * MIB).unwrap();
    drop(f); // the importer closes the fd; the mapping keeps the memory
    assert_eq!(read(m.base, 0, 20), b"from another process");
    write(m.base, 2 * MIB - 1, b"!");
    assert_eq!(
        s.ledger(1),
        SimLedger {
            foreign_imports: 1,
            foreign_import_bytes: 2 * MIB,
            ..SimLedger::default()
        }
    );
    assert!(s.is_clean(0));
    assert!(!s.is_clean(1));
    assert_eq!(
        s.mem_info(1).unwrap().free,
        64 * MIB,
        "foreign imports use no capacity"
    );
    s.unmap_import(m).unwrap();
    assert!(s.is_clean(1));

    // Another backend's export is foreign too: the producer's ledger cannot see the
    // consumer, yet the kernel keeps the bytes while the consumer maps them.
    let producer = sim();
    let consumer = sim();
    let a = producer.create_arena(0, 2 * MIB).unwrap();
    write(a.base, 0, b"kv");
    let ex = producer.export(&a).unwrap();
    let m = consumer
        .import(0, ImportSource::Fd(ex.fd().unwrap()), 2 * MIB)
        .unwrap();
    producer.close_export(&a, ex).unwrap();
    producer.destroy_arena(a).unwrap();
    assert!(producer.is_clean(0));
    assert_eq!(read(m.base, 0, 2), b"kv");
    assert_eq!(consumer.ledger(0).foreign_imports, 1);
    consumer.unmap_import(m).unwrap();
    assert!(consumer.is_clean(0));
}

const CHILD_FD: &str = "GPU_ARENA_SIM_TEST_CHILD_FD";

/// The consumer half of `import_in_another_process`; does nothing when run on its own.
#[test]
fn cross_process_child() {
    let Ok(raw) = std::env::var(CHILD_FD) else {
        return;
    };
    let raw: i32 = raw.parse().unwrap();
    // SAFETY: the parent passed the number of an fd this process inherited; nothing in the
    // child closes it, so it stays open for the borrow.
    let fd = unsafe { BorrowedFd::borrow_raw(raw) };
    let s = sim();
    let m = s.import(0, ImportSource::Fd(fd), 2 * MIB).unwrap();
    assert_eq!(read(m.base, 0, 8), b"producer");
    write(m.base, 4096, b"consumer");
    assert_eq!(s.ledger(0).foreign_imports, 1);
    s.unmap_import(m).unwrap();
    assert!(s.is_clean(0));
}

#[test]
fn import_in_another_process() {
    let s = sim();
    let a = s.create_arena(0, 2 * MIB).unwrap();
    write(a.base, 0, b"producer");
    let ex = s.export(&a).unwrap();
    // A copy without CLOEXEC, so that the child inherits it (SCM_RIGHTS is the ipc
    // module's business; the fd is the same either way).
    let inheritable = rustix::io::dup(ex.fd().unwrap()).unwrap();
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "backend::sim::tests::cross_process_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_FD, inheritable.as_raw_fd().to_string())
        .output()
        .unwrap();
    drop(inheritable);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "child failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(read(a.base, 4096, 8), b"consumer");
    s.close_export(&a, ex).unwrap();
    s.destroy_arena(a).unwrap();
    assert!(s.is_clean(0));
}

#[test]
fn a_split_keeps_the_windows_bytes_at_their_addresses_and_releases_the_rest() {
    let b = sim();
    let tag = b.memfd_tag();
    let a = b.create_arena(0, 16 * MIB).unwrap();
    for page in 0..8u8 {
        write(a.base, u64::from(page) * 2 * MIB + 7, &[page + 1; 64]);
    }
    // A failure before anything is replaced changes nothing.
    assert!(b
        .split_arena(&a, &[(2 * MIB, 2 * MIB), (0, 2 * MIB)])
        .is_err());
    b.fail_nth(SimCall::CreateArena, 2);
    assert!(b
        .split_arena(&a, &[(0, 2 * MIB), (8 * MIB, 4 * MIB)])
        .is_err());
    assert_eq!(b.ledger(0).held_bytes, 16 * MIB);
    assert_eq!(read(a.base, 8 * MIB + 7, 64), [5; 64]);

    let ws = b
        .split_arena(&a, &[(0, 2 * MIB), (8 * MIB, 4 * MIB)])
        .unwrap();
    assert_eq!(b.ledger(0).held_bytes, 6 * MIB);
    assert_eq!(b.ledger(0).live_arenas, 2);
    assert_eq!((ws[0].base, ws[1].base), (a.base, a.base + 8 * MIB));
    assert_eq!(read(a.base, 7, 64), [1; 64]);
    assert_eq!(read(a.base, 8 * MIB + 7, 64), [5; 64]);
    assert_eq!(read(a.base, 10 * MIB + 7, 64), [6; 64]);
    assert!(
        b.destroy_arena(a.clone()).is_err(),
        "the split arena is gone"
    );
    // A window is an arena: export and import it, sleep and wake it, split it again.
    let export = b.export(&ws[1]).unwrap();
    let m = b
        .import(0, ImportSource::Fd(export.fd().unwrap()), ws[1].bytes)
        .unwrap();
    assert_eq!(read(m.base, 2 * MIB + 7, 64), [6; 64]);
    b.unmap_import(m).unwrap();
    b.close_export(&ws[1], export).unwrap();
    let parts = b.split_arena(&ws[1], &[(2 * MIB, 2 * MIB)]).unwrap();
    assert_eq!(read(parts[0].base, 7, 64), [6; 64]);
    b.release_physical(&ws[0]).unwrap();
    let w0 = b.restore_physical(&ws[0]).unwrap();
    assert_eq!(b.ledger(0).held_bytes, 4 * MIB);
    b.destroy_arena(w0).unwrap();
    b.destroy_arena(parts[0].clone()).unwrap();
    assert_eq!(b.ledger(0).held_bytes, 0);
    assert_eq!((tagged_fds(&tag), tagged_maps(&tag)), (0, 0));
}

#[test]
fn a_split_is_refused_for_an_exported_asleep_or_too_large_arena_changing_nothing() {
    // 16 MiB capacity: a 12 MiB arena leaves no room for a 6 MiB window beside it.
    let b = sim_with(16 * MIB, false);
    let a = b.create_arena(0, 12 * MIB).unwrap();
    write(a.base, 7, &[9; 64]);
    let export = b.export(&a).unwrap();
    assert!(matches!(
        b.split_arena(&a, &[(0, 2 * MIB)]),
        Err(Error::InvalidState(_))
    ));
    b.close_export(&a, export).unwrap();
    assert!(matches!(
        b.split_arena(&a, &[(0, 6 * MIB)]),
        Err(Error::DriverOutOfMemory { .. })
    ));
    assert_eq!(b.ledger(0).held_bytes, 12 * MIB);
    assert_eq!(read(a.base, 7, 64), [9; 64]);
    b.release_physical(&a).unwrap();
    assert!(matches!(
        b.split_arena(&a, &[(0, 2 * MIB)]),
        Err(Error::InvalidState(_))
    ));
    let a = b.restore_physical(&a).unwrap();
    // It still splits afterwards (room for one 2 MiB window).
    let ws = b.split_arena(&a, &[(0, 2 * MIB)]).unwrap();
    assert_eq!(b.ledger(0).held_bytes, 2 * MIB);
    destroy_and_assert_clean(&b, vec![(ws[0].clone(), 1)]);
}
