//! The backend contract (tests/contract) on the sim backend: runs in CI.
#![allow(clippy::unwrap_used)]

mod contract;

use gpu_arena::backend::sim::{SimBackend, SimConfig};

impl contract::Subject for SimBackend {
    fn open() -> Self {
        SimBackend::new(SimConfig::default()).unwrap()
    }
    fn write(&self, dst: u64, src: &[u8]) -> gpu_arena::Result<()> {
        // SAFETY: sim device addresses are host addresses of live mappings; the contract only
        // copies inside arenas and imports it holds on sim (Facts::checked_copies is false).
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut u8, src.len()) };
        Ok(())
    }
    fn read(&self, dst: &mut [u8], src: u64) -> gpu_arena::Result<()> {
        // SAFETY: as above, reads inside live mappings.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }
    fn fill(&self, dst: u64, value: u8, bytes: u64) -> gpu_arena::Result<()> {
        // SAFETY: as above, writes inside live mappings.
        unsafe { std::ptr::write_bytes(dst as *mut u8, value, bytes as usize) };
        Ok(())
    }
    fn current_on_thread(&self) -> Option<u64> {
        None
    }
    fn legacy_ipc(&self) -> bool {
        self.config().legacy_pin
    }
    fn assert_clean(&self) {
        assert!(self.is_clean(0), "{:?}", self.ledger(0));
    }
}

contract::backend_contract_tests!(SimBackend);
