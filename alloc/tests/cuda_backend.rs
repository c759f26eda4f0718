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
use gpu_arena::backend::Backend;
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

contract::backend_contract_tests!(
    CudaBackend,
    #[ignore = "needs a CUDA GPU (run on the H200 with --ignored)"]
);
