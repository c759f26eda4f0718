//! The sim backend's tests, part two: fault injection, events, bad inputs, leaks, threads,
//! the ledger's serialization (part one, with the shared helpers: `tests.rs`).
#![allow(clippy::unwrap_used)]

use super::tests::{
    foreign_memfd, is_invalid, read, sim, sim_with, tagged_fds, tagged_maps, write, MIB,
};
use super::*;
use std::os::fd::AsFd;
use std::sync::Arc;

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
