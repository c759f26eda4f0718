//! Two sides of a transfer on the sim backend, each with its own sim device, pool, broker,
//! importer and transfer engine (the consumer's imports are foreign mappings, as in another
//! process): what the transfer tests share.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use gpu_arena::backend::sim::{SimBackend, SimConfig};
use gpu_arena::ipc::{Broker, BrokerConfig, Importer};
use gpu_arena::transfer::{EngineConfig, TransferEngine, XferStatus};
use gpu_arena::Pool;

const MIB: u64 = 1 << 20;

pub struct Side {
    pub sim: Arc<SimBackend>,
    pub pool: Arc<Pool>,
    pub engine: TransferEngine,
}

pub fn side(agent: &str) -> Side {
    let sim = Arc::new(SimBackend::new(SimConfig::default()).unwrap());
    let pool = super::validating_pool(&sim, 64 * MIB);
    let broker = Arc::new(Broker::start(pool.clone(), BrokerConfig::default()).unwrap());
    let importer = Arc::new(Importer::new(sim.clone()));
    let mut config = EngineConfig::new(agent);
    config.revoke_timeout = Duration::from_secs(20);
    let engine = TransferEngine::start(broker, importer, config).unwrap();
    Side { sim, pool, engine }
}

/// Post and poll until done.
pub fn run(e: &TransferEngine, req: u64, notif: Option<&[u8]>) {
    let mut status = e.post(req, notif.map(<[u8]>::to_vec)).unwrap();
    while status != XferStatus::Done {
        std::thread::sleep(Duration::from_micros(100));
        status = e.check(req).unwrap();
    }
}
