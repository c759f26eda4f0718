//! The producer side of the IPC security tests: a sim pool with a broker, and the lock that
//! keeps those tests from overlapping.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use gpu_arena::backend::sim::{SimBackend, SimConfig};
use gpu_arena::ipc::{Broker, BrokerConfig};
use gpu_arena::{Pool, StreamId};

use super::validating_pool;

pub const MIB: u64 = 1 << 20;
pub const S: StreamId = StreamId(7);

/// Every test here takes this lock: some count the process's fds, and every test opens
/// sockets, so none may overlap another.
pub static SERIAL: parking_lot::Mutex<()> = parking_lot::Mutex::new(());

pub struct Producer {
    pub sim: Arc<SimBackend>,
    pub pool: Arc<Pool>,
    pub broker: Broker,
}

pub fn producer_with(sim: SimConfig, config: BrokerConfig) -> Producer {
    let sim = Arc::new(SimBackend::new(sim).unwrap());
    let pool = validating_pool(&sim, 64 * MIB);
    let broker = Broker::start(pool.clone(), config).unwrap();
    Producer { sim, pool, broker }
}

pub fn producer(config: BrokerConfig) -> Producer {
    producer_with(SimConfig::default(), config)
}

pub fn imports_live(pool: &Pool) -> u64 {
    pool.stats(0).unwrap().imports_live
}
