//! The transfer engine leaves nothing behind, and keeps many requests in flight at once: a
//! producer and a consumer on the sim (see `common/transfer_fixture.rs`) that start, move
//! bytes and stop leave the process's fd count, the sims' streams and events, and the
//! devices' memory as they found them. One test at a time (fd counts are per process).
#![allow(clippy::unwrap_used)]

mod common;
use common::transfer_fixture::{side, Side};
use common::{fd_count, fill, read, wait_until};

use std::time::Duration;

use gpu_arena::transfer::{Desc, Op, XferStatus};
use gpu_arena::StreamId;

const MIB: u64 = 1 << 20;
const S: StreamId = StreamId(0);

static SERIAL: parking_lot::Mutex<()> = parking_lot::Mutex::new(());

/// A producer's 8 MiB registration loaded by a consumer with 8 MiB of its own.
fn loaded() -> (Side, Side, [u64; 5]) {
    let (p, c) = (side("prefill"), side("decode"));
    let pp = p.pool.alloc(0, 8 * MIB, S).unwrap().ptr;
    let cp = c.pool.alloc(0, 8 * MIB, S).unwrap().ptr;
    fill(pp, (8 * MIB) as usize, 9);
    let pmd = p.engine.register(pp, 8 * MIB).unwrap();
    let cmd = c.engine.register(cp, 8 * MIB).unwrap();
    c.engine
        .load_conn_info("prefill", p.engine.conn_info())
        .unwrap();
    let rmd = c
        .engine
        .load_remote("prefill", &p.engine.public_data(pmd).unwrap())
        .unwrap();
    (p, c, [pp, cp, pmd, cmd, rmd])
}

#[test]
fn many_requests_in_flight_at_once_each_complete_and_notify() {
    let _serial = SERIAL.lock();
    let (p, c, [pp, cp, _, cmd, rmd]) = loaded();
    p.engine
        .load_conn_info("decode", c.engine.conn_info())
        .unwrap();
    // Eight requests of 1 MiB each, all posted before any is checked.
    let reqs: Vec<u64> = (0..8u64)
        .map(|i| {
            let local = [Desc {
                addr: cp + i * MIB,
                len: MIB,
                md: cmd,
            }];
            let remote = [Desc {
                addr: pp + (7 - i) * MIB,
                len: MIB,
                md: rmd,
            }];
            c.engine
                .prepare(Op::Read, &local, &remote, "prefill")
                .unwrap()
        })
        .collect();
    for (i, &r) in reqs.iter().enumerate() {
        c.engine
            .post(r, Some(format!("r{i}").into_bytes()))
            .unwrap();
    }
    // (A request whose post saw it complete is Idle afterwards: done, not in flight.)
    for &r in &reqs {
        wait_until("a request", Duration::from_secs(10), || {
            c.engine.check(r).unwrap() != XferStatus::InProgress
        });
    }
    for i in 0..8u64 {
        assert!(read(cp + i * MIB, MIB as usize) == read(pp + (7 - i) * MIB, MIB as usize));
    }
    let mut got = Vec::new();
    wait_until("8 notifications", Duration::from_secs(10), || {
        got.extend(p.engine.take_notifs());
        got.len() == 8
    });
    assert_eq!(c.engine.stats().posted, 8);
    for r in reqs {
        c.engine.release(r).unwrap();
    }
}

#[test]
fn an_engine_that_moved_bytes_and_stopped_leaves_nothing_behind() {
    let _serial = SERIAL.lock();
    // A first pair warms what a process keeps once (the sims' first fds, thread pools).
    drop(loaded());
    let fds = fd_count();
    let (p, c, [pp, cp, pmd, cmd, rmd]) = loaded();
    let req = c
        .engine
        .prepare(
            Op::Read,
            &[Desc {
                addr: cp,
                len: 8 * MIB,
                md: cmd,
            }],
            &[Desc {
                addr: pp,
                len: 8 * MIB,
                md: rmd,
            }],
            "prefill",
        )
        .unwrap();
    c.engine.post(req, None).unwrap();
    wait_until("the READ", Duration::from_secs(10), || {
        c.engine.check(req).unwrap() != XferStatus::InProgress
    });
    assert_eq!(c.sim.pending_events(0), 0, "no event left behind");
    // NIXL's shutdown order: release, unload, deregister; then the engines go.
    c.engine.release(req).unwrap();
    c.engine.unload(rmd).unwrap();
    c.engine.deregister(&[cmd]).unwrap();
    p.engine.deregister(&[pmd]).unwrap();
    let (psim, csim) = (p.sim.clone(), c.sim.clone());
    for (s, ptr) in [(p, pp), (c, cp)] {
        s.pool.free(ptr).unwrap();
        s.pool.empty_cache(None).unwrap();
        drop(s);
    }
    for sim in [psim, csim] {
        assert_eq!(sim.ledger(0).held_bytes, 0);
        assert_eq!(sim.ledger(0).foreign_imports, 0);
    }
    wait_until("the fds closed", Duration::from_secs(10), || {
        fd_count() == fds
    });
}
