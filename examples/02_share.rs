//! Sharing: a producer shares a range, a consumer imports it by the handle's bytes.
//!
//! `cargo run --example 02_share`. Both roles run in this one process here; across
//! processes the 128 handle bytes travel any way you like (a pipe, pickle, HTTP).

use std::sync::Arc;

use gpu_arena::ipc::{Broker, BrokerConfig, Importer, ShareHandle};
use gpu_arena::{Config, Pool, StreamId};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let config = Config::parse("backend=sim")?;
    let pool = Arc::new(Pool::new(config.open_backend()?, config.pool.clone())?);
    let broker = Broker::start(pool.clone(), BrokerConfig::default())?;

    let a = pool.alloc(0, 8 << 20, StreamId(0))?;
    let handle: [u8; 128] = broker.share(a.ptr, a.bytes)?.to_bytes(); // exports the arena once

    // The consumer side.
    let importer = Importer::new(pool.backend().clone());
    let ptr = importer.import(&ShareHandle::from_bytes(&handle)?)?;
    println!("imported {} bytes at {ptr:#x}", a.bytes);
    pool.free(a.ptr)?; // deferred: the consumer still maps it
    importer.close(ptr)?; // last import of the arena: unmapped, broker told
    broker.unshare(&ShareHandle::from_bytes(&handle)?)?; // last share: export closed
    pool.empty_cache(None)?; // arena destroyed
    println!("{:?}", pool.stats(0)?);
    Ok(())
}
