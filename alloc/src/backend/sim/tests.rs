//! Unit tests of the simulated device.
//!
//! Leak checks count only the fds and mappings whose memfd name carries the backend's own
//! tag (`/proc/self/fd` links and `/proc/self/maps` lines show the memfd name), so tests
//! running in parallel threads, which open fds of their own, cannot disturb them.
#![allow(clippy::unwrap_used)]

use std::io::Write as _;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::sync::Arc;

use rustix::fs::MemfdFlags;

use super::*;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// Two devices of `capacity` bytes, 2 MiB granularity.
fn sim_with(capacity: u64, legacy_pin: bool) -> SimBackend {
    SimBackend::new(SimConfig {
        devices: 2,
        capacity,
        granularity: 2 * MIB,
        legacy_pin,
    })
    .unwrap()
}

fn sim() -> SimBackend {
    sim_with(64 * MIB, false)
}

fn write(addr: u64, off: u64, data: &[u8]) {
    // SAFETY: every caller passes the base of a live mapping at least `off + data.len()`
    // bytes long that no other thread accesses at the same time.
    unsafe {
        std::ptr::copy_nonoverlapping(data.as_ptr(), (addr + off) as usize as *mut u8, data.len())
    }
}

fn read(addr: u64, off: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    // SAFETY: as in `write`: a live mapping of at least `off + len` bytes.
    unsafe {
        std::ptr::copy_nonoverlapping((addr + off) as usize as *const u8, out.as_mut_ptr(), len)
    }
    out
}

/// Open fds of this process whose target names `tag`.
fn tagged_fds(tag: &str) -> usize {
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

/// Mappings of this process whose file names `tag`.
fn tagged_maps(tag: &str) -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter(|l| l.contains(tag))
        .count()
}

fn foreign_memfd(name: &str, bytes: u64, data: &[u8]) -> std::fs::File {
    let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC).unwrap();
    rustix::fs::ftruncate(&fd, bytes).unwrap();
    let mut f = std::fs::File::from(fd);
    f.write_all(data).unwrap();
    f
}

fn is_invalid<T: std::fmt::Debug>(r: Result<T>) -> bool {
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

fn injected_err(call: &'static str) -> Error {
    Error::Backend {
        backend: "sim",
        call,
        message: "injected fault".to_owned(),
    }
}

#[test]
fn fault_injection_fails_exactly_the_nth_call() {
    let s = sim();
    s.fail_nth(SimCall::CreateArena, 2);
    let a = s.create_arena(0, 2 * MIB).unwrap();
    let before = s.ledger(0);
    assert_eq!(
        s.create_arena(0, 2 * MIB),
        Err(injected_err("create_arena"))
    );
    assert_eq!(s.ledger(0), before);
    let b = s.create_arena(0, 2 * MIB).unwrap();
    assert_eq!(s.calls(SimCall::CreateArena), 3);

    // export
    s.fail_nth(SimCall::Export, 1);
    assert_eq!(s.export(&a).unwrap_err(), injected_err("export"));
    assert_eq!(s.ledger(0).open_exports, 0);
    let ex = s.export(&a).unwrap();
    assert_eq!(s.calls(SimCall::Export), 2);

    // close_export: the export stays open (stranded with the sim) until it is retried.
    let tag = s.memfd_tag();
    assert_eq!(tagged_fds(&tag), 3);
    s.fail_nth(SimCall::CloseExport, 1);
    let before = s.ledger(0);
    assert_eq!(s.close_export(&a, ex), Err(injected_err("close_export")));
    assert_eq!(s.ledger(0), before);
    assert_eq!(tagged_fds(&tag), 3, "the stranded export fd is still open");
    assert_eq!(s.close_stranded_exports(), 1);
    assert_eq!(s.ledger(0).open_exports, 0);
    assert_eq!(tagged_fds(&tag), 2);

    // destroy_arena: the arena stays live and mapped; a retry with a copy works.
    s.fail_nth(SimCall::DestroyArena, 1);
    let before = s.ledger(0);
    assert_eq!(
        s.destroy_arena(a.clone()),
        Err(injected_err("destroy_arena"))
    );
    assert_eq!(s.ledger(0), before);
    write(a.base, 0, b"still mapped");
    s.destroy_arena(a).unwrap();

    // import and unmap_import
    let ex = s.export(&b).unwrap();
    s.fail_nth(SimCall::Import, 1);
    let src = ImportSource::Fd(ex.fd().unwrap());
    assert_eq!(s.import(0, src, 2 * MIB), Err(injected_err("import")));
    assert_eq!(s.ledger(0).own_mappings, 0);
    let m = s.import(0, src, 2 * MIB).unwrap();
    s.fail_nth(SimCall::UnmapImport, 1);
    assert_eq!(s.unmap_import(m.clone()), Err(injected_err("unmap_import")));
    assert_eq!(s.ledger(0).own_mappings, 1);
    write(m.base, 0, b"still mapped");
    s.unmap_import(m).unwrap();
    s.close_export(&b, ex).unwrap();
    s.destroy_arena(b).unwrap();
    assert!(s.is_clean(0));

    // fail_always and call counts
    s.fail_always(SimCall::MemInfo, true);
    assert_eq!(s.mem_info(0), Err(injected_err("mem_info")));
    assert_eq!(s.mem_info(0), Err(injected_err("mem_info")));
    s.fail_always(SimCall::MemInfo, false);
    assert!(s.mem_info(0).is_ok());
    assert_eq!(s.calls(SimCall::MemInfo), 3);

    // events
    s.fail_nth(SimCall::RecordEvent, 1);
    assert_eq!(
        s.record_event(0, StreamId(7)),
        Err(injected_err("record_event"))
    );
    s.block_stream(0, StreamId(7));
    let e = s.record_event(0, StreamId(7)).unwrap();
    assert_eq!(s.pending_events(0), 1);
    s.fail_nth(SimCall::Synchronize, 1);
    assert_eq!(s.synchronize(0), Err(injected_err("synchronize")));
    assert_eq!(
        s.pending_events(0),
        1,
        "a failed synchronize completes nothing"
    );
    s.fail_nth(SimCall::EventQuery, 1);
    assert_eq!(s.event_done(&e), Err(injected_err("event_done")));
    assert_eq!(s.event_done(&e), Ok(false));
    s.synchronize(0).unwrap();
    assert_eq!(s.event_done(&e), Ok(true));
    s.destroy_event(e).unwrap();

    // n == 0 cancels; several faults can be scheduled at once.
    s.fail_nth(SimCall::CreateArena, 1);
    s.fail_nth(SimCall::CreateArena, 0);
    let c = s.create_arena(0, 2 * MIB).unwrap();
    s.fail_nth(SimCall::Export, 1);
    s.fail_nth(SimCall::Export, 3);
    let results: Vec<bool> = (0..4).map(|_| s.export(&c).is_ok()).collect();
    assert_eq!(results, [false, true, false, true]);
    assert_eq!(s.ledger(0).open_exports, 2);
    // Dropping an Export without close_export leaks it, as a leaked fd would.
    assert_eq!(s.calls(SimCall::Export), 7);
    s.destroy_arena(c).unwrap();
    assert_eq!(s.ledger(0).destroyed_but_held, 1);
    for call in SimCall::ALL {
        assert!(!call.name().is_empty());
    }
}

#[test]
fn events_pending_complete_synchronize() {
    let s = sim();
    let e1 = s.record_event(0, StreamId::DEFAULT).unwrap();
    assert_eq!(s.event_done(&e1), Ok(true));
    s.block_stream(0, StreamId(5));
    let e2 = s.record_event(0, StreamId(5)).unwrap();
    let e3 = s.record_event(0, StreamId(5)).unwrap();
    let e4 = s.record_event(0, StreamId(6)).unwrap();
    let e5 = s.record_event(1, StreamId(5)).unwrap();
    assert_eq!(s.event_done(&e2), Ok(false));
    assert_eq!(s.event_done(&e3), Ok(false));
    assert_eq!(s.event_done(&e4), Ok(true), "other streams are not blocked");
    assert_eq!(
        s.event_done(&e5),
        Ok(true),
        "nor the same stream id on another device"
    );
    assert_eq!((s.pending_events(0), s.pending_events(1)), (2, 0));
    let ids: HashSet<u64> = [&e1, &e2, &e3, &e4, &e5].iter().map(|e| e.raw).collect();
    assert_eq!(ids.len(), 5);

    s.synchronize(0).unwrap();
    assert_eq!((s.event_done(&e2), s.event_done(&e3)), (Ok(true), Ok(true)));
    let e6 = s.record_event(0, StreamId(5)).unwrap();
    assert_eq!(s.event_done(&e6), Ok(false), "the stream stays blocked");
    s.synchronize(1).unwrap();
    assert_eq!(s.event_done(&e6), Ok(false), "another device's synchronize");
    s.unblock_stream(0, StreamId(5));
    assert_eq!(s.event_done(&e6), Ok(true));
    let e7 = s.record_event(0, StreamId(5)).unwrap();
    assert_eq!(s.event_done(&e7), Ok(true));

    for e in [e2, e3, e4, e5, e6, e7] {
        s.destroy_event(e).unwrap();
    }
    s.destroy_event(e1.clone()).unwrap();
    assert!(is_invalid(s.destroy_event(e1.clone())));
    assert!(is_invalid(s.event_done(&e1)));
    assert!(matches!(
        s.record_event(2, StreamId::DEFAULT),
        Err(Error::InvalidDevice {
            device: 2,
            count: 2
        })
    ));
    // An event presented with the wrong device is unknown.
    let e = s.record_event(0, StreamId::DEFAULT).unwrap();
    let wrong = Event {
        device: 1,
        ..e.clone()
    };
    assert!(is_invalid(s.event_done(&wrong)));
    assert!(is_invalid(s.destroy_event(wrong)));
    s.destroy_event(e).unwrap();
    assert_eq!(s.pending_events(0), 0);
}

#[test]
fn bad_inputs_give_errors_and_change_nothing() {
    let s = sim();
    assert!(is_invalid(s.create_arena(0, 0)));
    assert!(is_invalid(s.create_arena(0, MIB)));
    assert!(is_invalid(s.create_arena(0, 3 * MIB)));
    let bad_dev = |device| Err::<(), _>(Error::InvalidDevice { device, count: 2 });
    assert_eq!(s.create_arena(2, 2 * MIB).map(drop), bad_dev(2));
    assert_eq!(s.create_arena(-1, 2 * MIB).map(drop), bad_dev(-1));
    assert_eq!(s.mem_info(5).map(drop), bad_dev(5));
    assert_eq!(s.synchronize(-3), bad_dev(-3));
    assert!(s.is_clean(0));

    let a = s.create_arena(0, 2 * MIB).unwrap();
    let b = s.create_arena(0, 2 * MIB).unwrap();
    let before = s.ledger(0);
    let unknown = ArenaMem {
        handle: 9999,
        ..a.clone()
    };
    assert!(is_invalid(s.destroy_arena(unknown.clone())));
    assert!(is_invalid(s.destroy_arena(ArenaMem {
        base: a.base + 4096,
        ..a.clone()
    })));
    assert!(is_invalid(s.destroy_arena(ArenaMem {
        bytes: 4 * MIB,
        ..a.clone()
    })));
    assert!(is_invalid(s.destroy_arena(ArenaMem {
        device: 1,
        ..a.clone()
    })));
    assert!(is_invalid(s.export(&unknown)));
    assert_eq!(s.ledger(0), before);

    // Imports
    let ex = s.export(&a).unwrap();
    let src = ImportSource::Fd(ex.fd().unwrap());
    assert_eq!(
        s.import(0, ImportSource::Bytes(b"legacy"), 2 * MIB),
        Err(Error::InvalidArgument("sim imports fds only".to_owned()))
    );
    let null = std::fs::File::open("/dev/null").unwrap();
    assert!(matches!(
        s.import(0, ImportSource::Fd(null.as_fd()), 2 * MIB),
        Err(Error::Ipc(_))
    ));
    assert!(is_invalid(s.import(0, src, 0)));
    assert!(is_invalid(s.import(0, src, 4 * MIB)));
    assert_eq!(s.import(2, src, 2 * MIB).map(drop), bad_dev(2));
    assert!(is_invalid(s.unmap_import(Mapping {
        device: 0,
        base: a.base,
        bytes: 2 * MIB,
        handle: 4242
    })));
    let m = s.import(0, src, 2 * MIB).unwrap();
    assert!(is_invalid(s.unmap_import(Mapping {
        bytes: 4096,
        ..m.clone()
    })));
    s.unmap_import(m).unwrap();

    // close_export with the wrong arena: rejected, the export stays counted (stranded).
    assert!(is_invalid(s.close_export(&b, ex)));
    assert_eq!(s.ledger(0).open_exports, 1);
    assert_eq!(s.close_stranded_exports(), 1);
    assert_eq!(s.ledger(0).open_exports, 0);
    // close_export of an unknown arena, or of something that is not an export of ours.
    let foreign = foreign_memfd("gpu-arena-sim-test-not-ours", 4096, b"");
    let not_ours = Export {
        payload: ExportPayload::Fd(foreign.into()),
        kind: ExportKind::Releasable,
    };
    assert!(is_invalid(s.close_export(&unknown, not_ours)));
    let bytes = Export {
        payload: ExportPayload::Bytes(vec![1, 2, 3]),
        kind: ExportKind::Releasable,
    };
    assert!(is_invalid(s.close_export(&a, bytes)));
    assert_eq!(s.close_stranded_exports(), 0);
    // An fd of the right arena that was never counted as an export.
    let ex = s.export(&a).unwrap();
    let copy = Export {
        payload: ExportPayload::Fd(rustix::io::fcntl_dupfd_cloexec(ex.fd().unwrap(), 0).unwrap()),
        kind: ExportKind::Releasable,
    };
    s.close_export(&a, ex).unwrap();
    assert!(matches!(
        s.close_export(&a, copy),
        Err(Error::InvalidState(_))
    ));
    assert_eq!(s.ledger(0), before);

    s.destroy_arena(a.clone()).unwrap();
    s.destroy_arena(b).unwrap();
    assert!(is_invalid(s.destroy_arena(a)));
    assert!(s.is_clean(0));
}

#[test]
fn no_fd_or_mapping_leaks() {
    let s = sim();
    let tag = s.memfd_tag();
    assert_eq!((tagged_fds(&tag), tagged_maps(&tag)), (0, 0));
    let a = s.create_arena(0, 4 * MIB).unwrap();
    assert_eq!((tagged_fds(&tag), tagged_maps(&tag)), (1, 1));
    let ex = s.export(&a).unwrap();
    assert_eq!(tagged_fds(&tag), 2);
    let m = s
        .import(0, ImportSource::Fd(ex.fd().unwrap()), a.bytes)
        .unwrap();
    assert_eq!(tagged_maps(&tag), 2);
    s.close_export(&a, ex).unwrap();
    assert_eq!(tagged_fds(&tag), 1);
    s.destroy_arena(a).unwrap();
    assert_eq!((tagged_fds(&tag), tagged_maps(&tag)), (0, 1));
    s.unmap_import(m).unwrap();
    assert_eq!((tagged_fds(&tag), tagged_maps(&tag)), (0, 0));
    assert!(s.is_clean(0));

    // Drop unmaps and closes whatever the backend still owns.
    let s = sim();
    let tag = s.memfd_tag();
    let a = s.create_arena(0, 2 * MIB).unwrap();
    let b = s.create_arena(1, 2 * MIB).unwrap();
    let ex = s.export(&b).unwrap();
    let _m = s
        .import(0, ImportSource::Fd(ex.fd().unwrap()), 2 * MIB)
        .unwrap();
    s.fail_nth(SimCall::CloseExport, 1);
    let ex_a = s.export(&a).unwrap();
    assert!(s.close_export(&a, ex_a).is_err());
    assert_eq!((tagged_fds(&tag), tagged_maps(&tag)), (4, 3));
    drop(s);
    assert_eq!(
        (tagged_fds(&tag), tagged_maps(&tag)),
        (1, 0),
        "only the export the test still owns is left"
    );
    drop(ex);
    assert_eq!(tagged_fds(&tag), 0);
}

#[test]
fn shared_across_threads() {
    let s = sim_with(64 * MIB, false);
    let tag = s.memfd_tag();
    let backend: Arc<dyn Backend> = Arc::new(s);
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let b = Arc::clone(&backend);
            std::thread::spawn(move || {
                for i in 0..25u8 {
                    let a = b.create_arena(t % 2, 2 * MIB).unwrap();
                    write(a.base, 0, &[i, t as u8]);
                    let ex = b.export(&a).unwrap();
                    let m = b
                        .import(t % 2, ImportSource::Fd(ex.fd().unwrap()), a.bytes)
                        .unwrap();
                    b.close_export(&a, ex).unwrap();
                    b.destroy_arena(a).unwrap();
                    assert_eq!(read(m.base, 0, 2), [i, t as u8]);
                    b.unmap_import(m).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(backend.mem_info(0).unwrap().free, 64 * MIB);
    assert_eq!(backend.mem_info(1).unwrap().free, 64 * MIB);
    assert_eq!((tagged_fds(&tag), tagged_maps(&tag)), (0, 0));
}

#[test]
fn ledger_serializes() {
    let s = sim();
    let a = s.create_arena(0, 2 * MIB).unwrap();
    let json = serde_json::to_string(&s.ledger(0)).unwrap();
    assert!(json.contains(r#""held_bytes":2097152"#), "{json}");
    assert!(json.contains(r#""live_arenas":1"#), "{json}");
    s.destroy_arena(a).unwrap();
    assert_eq!(
        s.ledger(7),
        SimLedger::default(),
        "a device the sim lacks is empty"
    );
}
