//! The CUDA backend against a real driver: the backend contract (tests/contract), whose
//! bodies sim runs in CI, here on a CUDA GPU.
//!
//! One test runs everywhere: without libcuda or a GPU, `CudaBackend::new()` returns an error
//! instead of panicking. Every other test needs a CUDA GPU and is ignored by default; run them
//! one at a time (they compare device free memory with a baseline):
//!
//! ```text
//! cargo test -p gpu-arena --test cuda_backend -- --ignored --test-threads=1
//! ./cuda_backend-<hash> --ignored --test-threads=1      # prebuilt binary on the GPU machine
//! ```
#![cfg(feature = "cuda")]

mod contract;

use gpu_arena::backend::cuda::CudaBackend;
use gpu_arena::backend::vmm::FabricHandles;
use gpu_arena::backend::{Backend, ExportKind, ExportPayload, ImportSource};
use gpu_arena::Error;

#[test]
fn new_errors_instead_of_panicking_without_a_gpu() {
    match CudaBackend::new() {
        Ok(b) => {
            assert!(b.device_count().expect("device_count") > 0);
            assert!(CudaBackend::is_available());
            assert_eq!(b.name(), "cuda");
            eprintln!("driver {}", b.driver_version());
        }
        Err(e) => {
            assert!(
                matches!(e, Error::Unavailable(_)),
                "expected Unavailable, got {e:?}"
            );
            assert!(!CudaBackend::is_available());
            eprintln!("no CUDA here, as expected on CI: {e}");
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU (run on the H200 with --ignored)"]
fn legacy_export_is_pinning_bytes() {
    let _serial = contract::serial();
    let b = CudaBackend::new()
        .expect("needs a CUDA GPU")
        .with_legacy_ipc(true);
    assert!(b.uses_legacy_ipc(0).expect("legacy?"));
    let g = b.granularity(0).expect("granularity");
    assert_eq!(g, 2 << 20);
    let arena = b.create_arena(0, 4 * g).expect("create (cuMemAlloc)");
    assert_eq!(arena.handle, 0);
    b.memcpy_htod(arena.base, &[7; 4096]).expect("write");
    let mut back = [0u8; 4096];
    b.memcpy_dtoh(&mut back, arena.base).expect("read");
    assert!(back.iter().all(|&x| x == 7));
    let export = b.export(&arena).expect("export (cuIpcGetMemHandle)");
    assert_eq!(export.kind, ExportKind::Pinning);
    match &export.payload {
        ExportPayload::Bytes(bytes) => assert_eq!(bytes.len(), 64),
        ExportPayload::Fd(_) => panic!("a legacy export should be bytes"),
    }
    // A handle of the wrong size is refused before the driver sees it.
    assert!(matches!(
        b.import(0, ImportSource::Bytes(&[0; 63]), 4 * g),
        Err(Error::InvalidArgument(_))
    ));
    // Legacy arenas cannot sleep: a clear error, the arena untouched.
    let e = b.release_physical(&arena).expect_err("legacy sleep");
    assert!(e.to_string().contains("cannot sleep"), "{e}");
    b.close_export(&arena, export).expect("close");
    b.synchronize(0).expect("synchronize");
    b.destroy_arena(arena).expect("destroy (cuMemFree)");
}

#[test]
#[ignore = "needs a CUDA GPU (run on the H200 with --ignored)"]
fn fabric_handles_1_creates_or_says_why_not() {
    let _serial = contract::serial();
    let b = CudaBackend::new()
        .expect("needs a CUDA GPU")
        .with_fabric_handles(FabricHandles::On);
    match b.granularity(0).and_then(|g| b.create_arena(0, g)) {
        Ok(arena) => {
            eprintln!("FABRIC handles permitted here");
            b.destroy_arena(arena).expect("destroy");
        }
        Err(e) => {
            let why = e.to_string();
            assert!(
                why.contains("FABRIC")
                    || why.contains("NOT_PERMITTED")
                    || why.contains("NOT_SUPPORTED"),
                "{why}"
            );
            eprintln!("FABRIC handles not available here: {why}");
            // auto falls back and creates.
            let b = CudaBackend::new().expect("new");
            let g = b.granularity(0).expect("granularity");
            let arena = b.create_arena(0, g).expect("auto falls back to POSIX fds");
            b.destroy_arena(arena).expect("destroy");
        }
    }
}

contract::backend_contract_tests!(
    CudaBackend,
    #[ignore = "needs a CUDA GPU (run on the H200 with --ignored)"]
);
