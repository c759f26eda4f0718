//! The HIP backend against the real libamdhip64: the backend contract (tests/contract), whose
//! bodies sim runs in CI, here on an AMD GPU, and the legacy IPC path.
//!
//! Two tests run everywhere the `hip` feature builds (libamdhip64 loaded, as in CI): without
//! an AMD GPU, `HipBackend::new()` returns `Error::Unavailable` ("no HIP device") instead of
//! panicking, and `backend=auto` falls back to sim. Every other test needs an AMD GPU and is
//! ignored by default; run them one at a time (they compare device free memory with a
//! baseline). None of them has been run on an AMD GPU yet (docs/rocm.md):
//!
//! ```text
//! HIP_PATH=/opt/rocm cargo test -p gpu-arena --features hip --test hip_backend -- --ignored --test-threads=1
//! ```
#![cfg(feature = "hip")]

mod contract;

use gpu_arena::backend::hip::HipBackend;
use gpu_arena::backend::{Backend, ExportKind, ExportPayload, ImportSource};
use gpu_arena::{Config, Error};

#[test]
fn new_errors_instead_of_panicking_without_a_gpu() {
    match HipBackend::new() {
        Ok(b) => {
            assert!(b.device_count().expect("device_count") > 0);
            assert!(HipBackend::is_available());
            assert_eq!(b.name(), "hip");
            eprintln!("an AMD GPU is here: HIP runtime {}", b.driver_version());
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
fn legacy_export_is_pinning_bytes() {
    let _serial = contract::serial();
    let b = HipBackend::new()
        .expect("needs an AMD GPU")
        .with_legacy_ipc(true);
    assert!(b.uses_legacy_ipc(0).expect("legacy?"));
    let g = b.granularity(0).expect("granularity");
    let arena = b.create_arena(0, 4 * g).expect("create");
    let export = b.export(&arena).expect("export");
    assert_eq!(export.kind, ExportKind::Pinning);
    match &export.payload {
        ExportPayload::Bytes(bytes) => assert_eq!(bytes.len(), 64),
        ExportPayload::Fd(_) | ExportPayload::Chunks(_) => {
            panic!("a legacy export should be bytes")
        }
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

contract::backend_contract_tests!(HipBackend, #[ignore = "needs an AMD GPU"]);
