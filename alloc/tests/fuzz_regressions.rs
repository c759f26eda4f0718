//! Regression tests for what the fuzz targets (fuzz/, scripts/fuzz.sh) found.
//!
//! c_api_ops, 2026-11-29, artifact `crash-e0586e9a68391ee1e98829b110fb11ab4ad68d72`
//! (bench/results/fuzz-2026-11-29.md): after about 4.5 million inputs in one process, the
//! clean-up of one input (close every import, unshare every share, free every allocation,
//! empty_cache) left device 1 with one allocation held by a lease (`allocations: 1,
//! imports_live: 1, exports_live: 1, deferred_free_bytes: 2048, shares_live: 0`) although
//! every `gpu_arena_close` had returned 0. The artifact passes in a fresh process: it needs
//! state left by earlier inputs.
//!
//! The cause (fixed in 388c27b, "broker keys a connection's leases by (device, key)"): lease
//! keys are slots of a per-device table, so a device-0 lease and a device-1 lease can have
//! the same key, and the broker kept a connection's leases in a map from key to device.
//! When one connection held both, the second entry replaced the first; the close of the
//! replaced lease was refused ("not held by this connection"), the importer of the time only
//! logged the refusal and returned Ok (c48733a made it an error), and the lease stayed.
//! Whether two live leases of one connection share a key depends on which slots earlier
//! leases freed: the state the artifact needed.
//!
//! - [`c_api_ops_crash_e0586e9a_equal_lease_keys_on_two_devices`] reproduces that failure
//!   from a fresh pool: on 84c665e (before both fixes) every close returns Ok and device 1
//!   is left as in the artifact (`allocations: 1, allocated_bytes: 2048, arenas: 1,
//!   exports_live: 1`, its 4 leases `imports_live: 4`); it passes from 388c27b on.
//! - [`c_api_ops_crash_e0586e9a_ops_replayed`] replays the artifact's own operations (all on
//!   device 1's leases, so no two keys collide) 300 times in one process. It never
//!   reproduced the crash (it passes on 84c665e too): it is a soak of the input's
//!   share/import/close/unshare/free sequence, kept because it is cheap.
#![allow(clippy::unwrap_used)]

use gpu_arena::ipc::{Broker, BrokerConfig, Importer};
use gpu_arena::{Config, Pool, StreamId};
use std::sync::Arc;

/// The fuzz harness's configuration (two small sim devices).
fn harness_pool() -> Arc<Pool> {
    Arc::new(
        Config::parse("backend=sim,sim_devices=2,sim_capacity=64MiB,arena_size=4MiB")
            .unwrap()
            .build_pool()
            .unwrap(),
    )
}

/// What the harness requires after an input's clean-up: nothing left on either device.
fn assert_nothing_left(pool: &Pool, what: &str) {
    pool.empty_cache(None).unwrap();
    for dev in 0..2 {
        let s = pool.stats(dev).unwrap();
        assert_eq!(
            (
                s.allocations,
                s.imports_live,
                s.exports_live,
                s.shares_live,
                s.deferred_free_bytes,
                s.arenas
            ),
            (0, 0, 0, 0, 0, 0),
            "{what}, device {dev}: {s:?}"
        );
        pool.validate(dev).unwrap();
    }
}

#[test]
fn c_api_ops_crash_e0586e9a_equal_lease_keys_on_two_devices() {
    let pool = harness_pool();
    let broker = Broker::start(pool.clone(), BrokerConfig::default()).unwrap();
    let importer = Importer::new(pool.backend().clone());
    // The artifact's 1799-byte allocation on device 1 (a 2048-byte block), and one on
    // device 0. A fresh pool numbers both devices' leases from the same first slot, so the
    // imports below (one connection: one producer) hold device-0 and device-1 leases with
    // equal keys, device 1's taken first.
    let a1 = pool.alloc(1, 1799, StreamId(7)).unwrap();
    let a0 = pool.alloc(0, 28423, StreamId(7)).unwrap();
    let s1 = broker.share(a1.ptr, 1799).unwrap();
    let s0 = broker.share(a0.ptr, 28423).unwrap();
    let mut imports = Vec::new();
    for _ in 0..4 {
        imports.push(importer.import(&s1).unwrap());
        imports.push(importer.import(&s0).unwrap());
    }
    // The harness's clean-up order; every step must succeed.
    for (i, p) in imports.into_iter().enumerate() {
        importer
            .close(p)
            .unwrap_or_else(|e| panic!("close {i}: {e}"));
    }
    broker.unshare(&s1).unwrap();
    broker.unshare(&s0).unwrap();
    pool.free_checked(a1.ptr, 1799, 1).unwrap();
    pool.free_checked(a0.ptr, 28423, 0).unwrap();
    assert_nothing_left(&pool, "after every close returned Ok");
    assert_eq!(importer.stats().imports_live, 0);
}

#[test]
fn c_api_ops_crash_e0586e9a_ops_replayed() {
    let pool = harness_pool();
    let broker = Broker::start(pool.clone(), BrokerConfig::default()).unwrap();
    let importer = Importer::new(pool.backend().clone());
    for round in 0..300 {
        // Malloc(1799, dev 1, stream 7); Share; Malloc(28423, dev 0); Import; Share again;
        // Malloc(28423, dev 0); Import of the second share; Malloc(4883, dev 0, stream 0).
        let a = pool.alloc(1, 1799, StreamId(7)).unwrap();
        let s1 = broker.share(a.ptr, 1799).unwrap();
        let b = pool.alloc(0, 28423, StreamId(7)).unwrap();
        let i1 = importer.import(&s1).unwrap();
        let s2 = broker.share(a.ptr, 1799).unwrap();
        let c = pool.alloc(0, 28423, StreamId(7)).unwrap();
        let i2 = importer.import(&s2).unwrap();
        let d = pool.alloc(0, 4883, StreamId(0)).unwrap();
        // The harness's clean-up order.
        importer.close(i1).unwrap();
        importer.close(i2).unwrap();
        broker.unshare(&s1).unwrap();
        broker.unshare(&s2).unwrap();
        pool.free_checked(a.ptr, 1799, 1).unwrap();
        pool.free_checked(b.ptr, 28423, 0).unwrap();
        pool.free_checked(c.ptr, 28423, 0).unwrap();
        pool.free_checked(d.ptr, 4883, 0).unwrap();
        assert_nothing_left(&pool, &format!("round {round}"));
        assert_eq!(importer.stats().imports_live, 0, "round {round}");
    }
}
