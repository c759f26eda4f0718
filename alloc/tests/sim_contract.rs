//! The backend contract (tests/contract) on the sim backend: runs in CI.
#![allow(clippy::unwrap_used)]

mod contract;

use gpu_arena::backend::sim::{SimBackend, SimConfig};

#[test]
fn sim_meets_the_backend_contract() {
    let sim = SimBackend::new(SimConfig::default()).unwrap();
    let write = |dst: u64, src: &[u8]| {
        // SAFETY: sim device addresses are host addresses of live mappings; the contract
        // only writes inside arenas and imports it holds.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut u8, src.len()) }
    };
    let read = |dst: &mut [u8], src: u64| {
        // SAFETY: as above, reads inside live mappings.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst.as_mut_ptr(), dst.len()) }
    };
    contract::Contract {
        backend: &sim,
        device: 0,
        write: &write,
        read: &read,
    }
    .run_all();
    assert!(sim.is_clean(0), "{:?}", sim.ledger(0));
}
