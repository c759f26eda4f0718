//! The HIP backend against the real libamdhip64.
//!
//! Two tests run everywhere the `hip` feature builds (libamdhip64 loaded, as in CI): without
//! an AMD GPU, `HipBackend::new()` returns `Error::Unavailable` ("no HIP device") instead of
//! panicking, and `backend=auto` falls back to sim. Every other test needs an AMD GPU and is
//! ignored by default; run them one at a time (they compare device free memory with a
//! baseline). None of them has been run on an AMD GPU yet (README, "ROCm"):
//!
//! ```text
//! HIP_PATH=/opt/rocm cargo test -p gpu-arena --features hip --test hip_backend -- --ignored --test-threads=1
//! ```
#![cfg(feature = "hip")]
// create/destroy, write/read, "an open export holds memory", in-process import and "the
// importer's mapping holds memory" are the shared backend contract (tests/contract),
// run by `meets_the_backend_contract` below.

mod contract;

use std::os::fd::AsFd;
use std::sync::{Mutex, MutexGuard};

use gpu_arena::backend::hip::HipBackend;
use gpu_arena::backend::{
    Backend, Event, ExportKind, ExportPayload, ImportSource, Mapping, StreamId,
};
use gpu_arena::{Config, Error};

/// GPU tests compare free memory with a baseline: they run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn backend() -> HipBackend {
    HipBackend::new().expect("needs an AMD GPU: HipBackend::new() failed")
}

#[test]
fn new_errors_instead_of_panicking_without_a_gpu() {
    match HipBackend::new() {
        Ok(b) => {
            assert!(b.device_count().expect("device_count") > 0);
            assert!(HipBackend::is_available());
            assert_eq!(b.name(), "hip");
            eprintln!("an AMD GPU is here: HIP runtime {}", b.runtime_version());
        }
        Err(e) => {
            match &e {
                Error::Unavailable(why) => assert!(
                    why.contains("no HIP device"),
                    "the reason should say \"no HIP device\": {why}"
                ),
                other => panic!("expected Unavailable, got {other:?}"),
            }
            assert!(!HipBackend::is_available());
            eprintln!("no AMD GPU here, as expected on CI: {e}");
        }
    }
}

#[test]
fn auto_falls_back_to_sim_without_a_gpu() {
    let config = Config::parse("backend=auto").expect("parse");
    let backend = config
        .open_backend()
        .expect("backend=auto always opens something");
    if HipBackend::is_available() {
        assert_ne!(
            backend.name(),
            "sim",
            "a GPU is here: auto should not pick sim"
        );
    } else if backend.name() != "cuda" {
        assert_eq!(backend.name(), "sim");
    }
    // backend=hip itself reports the reason instead of falling back.
    let hip = Config::parse("backend=hip").expect("parse").open_backend();
    if !HipBackend::is_available() {
        match hip {
            Err(Error::Unavailable(why)) => assert!(why.contains("no HIP device"), "{why}"),
            other => panic!("backend=hip without a GPU should be Unavailable, got {other:?}"),
        }
    }
}

#[test]
#[ignore = "needs an AMD GPU"]
fn reports_runtime_and_granularity() {
    let _serial = serial();
    let b = backend();
    let g = b.granularity(0).expect("granularity");
    let info = b.mem_info(0).expect("mem_info");
    eprintln!(
        "runtime {}, {} device(s), granularity {g}, legacy IPC {}, free {} / total {}",
        b.runtime_version(),
        b.device_count().expect("device_count"),
        b.uses_legacy_ipc(0).expect("legacy?"),
        info.free,
        info.total
    );
    assert!(g > 0 && g.is_power_of_two());
    assert!(info.total > 0 && info.free <= info.total);
}

#[test]
#[ignore = "needs an AMD GPU"]
fn legacy_export_is_pinning_bytes() {
    let _serial = serial();
    let b = backend().with_legacy_ipc(true);
    assert!(b.uses_legacy_ipc(0).expect("legacy?"));
    let g = b.granularity(0).expect("granularity");
    let arena = b.create_arena(0, 4 * g).expect("create");
    let export = b.export(&arena).expect("export");
    assert_eq!(export.kind, ExportKind::Pinning);
    match &export.payload {
        ExportPayload::Bytes(bytes) => assert_eq!(bytes.len(), 64),
        ExportPayload::Fd(_) => panic!("a legacy export should be bytes"),
    }
    assert!(export.fd().is_none());
    // A handle of the wrong size is refused before the runtime sees it.
    assert!(matches!(
        b.import(0, ImportSource::Bytes(&[0; 63]), 4 * g),
        Err(Error::InvalidArgument(_))
    ));
    b.close_export(&arena, export).expect("close");
    b.synchronize(0).expect("synchronize");
    b.destroy_arena(arena).expect("destroy");
}

#[test]
#[ignore = "needs an AMD GPU"]
fn events_complete_after_synchronize() {
    let _serial = serial();
    let b = backend();
    let g = b.granularity(0).expect("granularity");
    let arena = b.create_arena(0, 64 * g).expect("create");
    b.memset_d8(arena.base, 1, 64 * g).expect("memset");
    // The null stream (0) and hipStreamPerThread (2).
    let events: Vec<Event> = [0u64, 2]
        .iter()
        .map(|&s| b.record_event(0, StreamId(s)).expect("record"))
        .collect();
    b.synchronize(0).expect("synchronize");
    for e in &events {
        assert!(
            b.event_done(e).expect("query"),
            "event not done after synchronize"
        );
    }
    for e in events {
        b.destroy_event(e).expect("destroy event");
    }
    b.destroy_arena(arena).expect("destroy");
}

#[test]
#[ignore = "needs an AMD GPU"]
fn caller_device_left_unchanged() {
    let _serial = serial();
    let b = backend();
    let before = b.current_device().expect("hipGetDevice");
    let same = |what: &str| {
        assert_eq!(
            b.current_device().expect("hipGetDevice"),
            before,
            "{what} changed the current device"
        );
    };
    let last = b.device_count().expect("count") as i32 - 1;
    let g = b.granularity(last).expect("granularity");
    same("granularity");
    b.mem_info(last).expect("mem_info");
    same("mem_info");
    let arena = b.create_arena(last, 2 * g).expect("create");
    same("create_arena");
    let event = b.record_event(last, StreamId::DEFAULT).expect("record");
    same("record_event");
    b.synchronize(last).expect("synchronize");
    same("synchronize");
    assert!(b.event_done(&event).expect("query"));
    b.destroy_event(event).expect("destroy event");
    same("destroy_event");
    b.destroy_arena(arena).expect("destroy");
    same("destroy_arena");
}

#[test]
#[ignore = "needs an AMD GPU"]
fn bad_inputs_are_errors() {
    let _serial = serial();
    let b = backend();
    let g = b.granularity(0).expect("granularity");
    let count = b.device_count().expect("count");
    for bytes in [0, 1, g + 1, g / 2] {
        assert!(
            matches!(b.create_arena(0, bytes), Err(Error::InvalidArgument(_))),
            "create_arena({bytes})"
        );
    }
    for device in [-1, count as i32, 1000] {
        assert!(matches!(
            b.create_arena(device, g),
            Err(Error::InvalidDevice { .. })
        ));
        assert!(matches!(
            b.synchronize(device),
            Err(Error::InvalidDevice { .. })
        ));
    }
    let arena = b.create_arena(0, g).expect("create");
    let copy = arena.clone();
    b.destroy_arena(arena).expect("destroy");
    assert!(matches!(
        b.destroy_arena(copy.clone()),
        Err(Error::UnknownPointer { .. })
    ));
    assert!(b.export(&copy).is_err(), "export of a destroyed arena");

    if !b.uses_legacy_ipc(0).expect("legacy?") {
        let arena = b.create_arena(0, g).expect("create");
        let export = b.export(&arena).expect("export");
        let mapping = b
            .import(0, ImportSource::Fd(export.fd().expect("fd")), g)
            .expect("import");
        let copy: Mapping = mapping.clone();
        b.unmap_import(mapping).expect("unmap");
        assert!(matches!(
            b.unmap_import(copy),
            Err(Error::UnknownPointer { .. })
        ));
        b.close_export(&arena, export).expect("close");
        b.destroy_arena(arena).expect("destroy");
        let not_hip = std::fs::File::open("/dev/null").expect("/dev/null");
        match b.import(0, ImportSource::Fd(not_hip.as_fd()), g) {
            Err(Error::Backend { backend, call, .. }) => {
                assert_eq!((backend, call), ("hip", "hipMemImportFromShareableHandle"));
            }
            other => panic!("importing /dev/null should be a Backend error, got {other:?}"),
        }
    }

    let event = b.record_event(0, StreamId::DEFAULT).expect("record");
    let copy = event.clone();
    b.destroy_event(event).expect("destroy event");
    assert!(b.event_done(&copy).is_err());
    assert!(b.destroy_event(copy).is_err());
}

#[ignore = "needs an AMD GPU"]
#[test]
fn meets_the_backend_contract() {
    let _g = serial();
    let b = backend();
    let write = |dst: u64, src: &[u8]| b.memcpy_htod(dst, src).expect("htod");
    let read = |dst: &mut [u8], src: u64| b.memcpy_dtoh(dst, src).expect("dtoh");
    contract::Contract {
        backend: &b,
        device: 0,
        write: &write,
        read: &read,
    }
    .run_all();
}
