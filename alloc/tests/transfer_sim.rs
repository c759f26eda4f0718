//! The transfer engine on the sim backend: a producer and a consumer, each with its own sim
//! device, pool, broker and importer (the consumer's imports are foreign mappings, as in
//! another process). READ and WRITE with bytes verified, notifications, bad descriptors,
//! and revocation: the producer takes its memory back while the consumer lives.
#![allow(clippy::unwrap_used)]

mod common;
use common::transfer_fixture::{run, side, Side};
use common::{fill, read, wait_until};

use std::time::Duration;

use gpu_arena::transfer::{Desc, Op, TransferEngine};
use gpu_arena::StreamId;

const MIB: u64 = 1 << 20;
const S: StreamId = StreamId(0);

/// The consumer's side of a revocation, which finishes after the producer saw the lease
/// end (the consumer counts and unmaps after its close went out): `revoked` closes counted
/// and no mapping left, waited for.
fn consumer_closed(c: &Side, revoked: u64) {
    wait_until("the consumer's close", Duration::from_secs(10), || {
        c.engine.stats().revoked == revoked && c.sim.ledger(0).foreign_imports == 0
    });
}

fn notifs_of(e: &TransferEngine, want: usize) -> Vec<(String, Vec<u8>)> {
    let mut got = Vec::new();
    wait_until("notifications", Duration::from_secs(10), || {
        got.extend(e.take_notifs());
        got.len() >= want
    });
    got
}

/// A producer with a 4 MiB registration full of a pattern, a consumer with a 4 MiB
/// registration of its own that loaded the producer's.
struct Pair {
    p: Side,
    c: Side,
    p_ptr: u64,
    c_ptr: u64,
    p_md: u64,
    c_md: u64,
    remote_md: u64,
}

fn pair() -> Pair {
    pair_tagged(None)
}

/// [`pair`], the producer's registration under `tag` when given (so it can sleep alone).
fn pair_tagged(tag: Option<&str>) -> Pair {
    let p = side("prefill");
    let c = side("decode");
    let p_ptr = match tag {
        Some(tag) => common::alloc_with(&p.pool, tag, 4 * MIB, S),
        None => p.pool.alloc(0, 4 * MIB, S).unwrap().ptr,
    };
    let c_ptr = c.pool.alloc(0, 4 * MIB, S).unwrap().ptr;
    fill(p_ptr, (4 * MIB) as usize, 3);
    fill(c_ptr, (4 * MIB) as usize, 200);
    let p_md = p.engine.register(p_ptr, 4 * MIB).unwrap();
    let c_md = c.engine.register(c_ptr, 4 * MIB).unwrap();
    c.engine
        .load_conn_info("prefill", p.engine.conn_info())
        .unwrap();
    p.engine
        .load_conn_info("decode", c.engine.conn_info())
        .unwrap();
    let public = p.engine.public_data(p_md).unwrap();
    let remote_md = c.engine.load_remote("prefill", &public).unwrap();
    Pair {
        p,
        c,
        p_ptr,
        c_ptr,
        p_md,
        c_md,
        remote_md,
    }
}

#[test]
fn read_and_write_move_the_bytes_and_notify() {
    let x = pair();
    let (c, p) = (&x.c.engine, &x.p.engine);
    // READ the producer's second MiB into the consumer's first, in 4 descriptors.
    let local: Vec<Desc> = (0..4)
        .map(|i| Desc {
            addr: x.c_ptr + i * 256 * 1024,
            len: 256 * 1024,
            md: x.c_md,
        })
        .collect();
    let remote: Vec<Desc> = (0..4)
        .map(|i| Desc {
            addr: x.p_ptr + MIB + i * 256 * 1024,
            len: 256 * 1024,
            md: x.remote_md,
        })
        .collect();
    let req = c.prepare(Op::Read, &local, &remote, "prefill").unwrap();
    run(c, req, Some(b"read-1"));
    assert_eq!(
        read(x.c_ptr, MIB as usize),
        read(x.p_ptr + MIB, MIB as usize)
    );
    // WRITE the consumer's last MiB over the producer's first.
    let local = [Desc {
        addr: x.c_ptr + 3 * MIB,
        len: MIB,
        md: x.c_md,
    }];
    let remote = [Desc {
        addr: x.p_ptr,
        len: MIB,
        md: x.remote_md,
    }];
    let w = c.prepare(Op::Write, &local, &remote, "prefill").unwrap();
    run(c, w, Some(b"write-1"));
    assert_eq!(
        read(x.p_ptr, MIB as usize),
        read(x.c_ptr + 3 * MIB, MIB as usize)
    );
    // A request posts again once done.
    fill(x.c_ptr + 3 * MIB, MIB as usize, 77);
    run(c, w, None);
    assert_eq!(
        read(x.p_ptr, MIB as usize),
        read(x.c_ptr + 3 * MIB, MIB as usize)
    );
    c.notify("prefill", b"standalone").unwrap();
    let got = notifs_of(p, 3);
    let bodies: Vec<&[u8]> = got.iter().map(|(_, b)| b.as_slice()).collect();
    assert_eq!(bodies, [&b"read-1"[..], b"write-1", b"standalone"]);
    assert!(got.iter().all(|(a, _)| a == "decode"));
    let s = c.stats();
    assert_eq!((s.posted, s.copies, s.bytes), (3, 6, 3 * MIB));
    for r in [req, w] {
        c.release(r).unwrap();
    }
    assert!(c.release(w).is_err(), "released twice");
}

#[test]
fn bad_descriptors_and_metadata_are_refused() {
    let x = pair();
    let c = &x.c.engine;
    let local = [Desc {
        addr: x.c_ptr,
        len: MIB,
        md: x.c_md,
    }];
    let past = [Desc {
        addr: x.p_ptr + 3 * MIB + 1,
        len: MIB,
        md: x.remote_md,
    }];
    let e = c
        .prepare(Op::Read, &local, &past, "prefill")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("descriptor 0 (remote)") && e.contains("outside its registration"),
        "{e}"
    );
    let other_agent = c
        .prepare(
            Op::Read,
            &local,
            &[Desc {
                addr: x.p_ptr,
                len: MIB,
                md: x.remote_md,
            }],
            "someone",
        )
        .unwrap_err();
    assert!(
        other_agent
            .to_string()
            .contains("not loaded from agent `someone`"),
        "{other_agent}"
    );
    let not_local = [Desc {
        addr: x.c_ptr,
        len: MIB,
        md: x.remote_md,
    }];
    assert!(c.prepare(Op::Read, &not_local, &past, "prefill").is_err());
    // Memory gpu-arena did not allocate, and garbage metadata.
    let host = vec![0u8; 4096];
    let e = c
        .register(host.as_ptr() as u64, 4096)
        .unwrap_err()
        .to_string();
    assert!(e.contains("not gpu-arena memory"), "{e}");
    assert!(c
        .load_remote("prefill", "gpu-arena-xfer/1;x;1;2;3;00")
        .is_err());
    assert!(c
        .load_remote("prefill", "hello")
        .unwrap_err()
        .to_string()
        .contains("not a gpu-arena registration"));
    assert!(c.load_conn_info("prefill", "tcp://1.2.3.4").is_err());
    assert!(c.notify("nobody", b"x").is_err());
    assert!(c.deregister(&[12345]).is_err());
    assert!(c.unload(12345 | 1).is_err());
    // Nothing changed: the good transfer still works.
    let req = c
        .prepare(
            Op::Read,
            &local,
            &[Desc {
                addr: x.p_ptr,
                len: MIB,
                md: x.remote_md,
            }],
            "prefill",
        )
        .unwrap();
    run(c, req, None);
    assert_eq!(read(x.c_ptr, MIB as usize), read(x.p_ptr, MIB as usize));
}

#[test]
fn the_producer_takes_its_memory_back_while_the_consumer_lives() {
    let x = pair();
    let (c, p) = (&x.c.engine, &x.p.engine);
    let local = [Desc {
        addr: x.c_ptr,
        len: MIB,
        md: x.c_md,
    }];
    let remote = [Desc {
        addr: x.p_ptr,
        len: MIB,
        md: x.remote_md,
    }];
    let req = c.prepare(Op::Read, &local, &remote, "prefill").unwrap();
    run(c, req, None);
    assert_eq!(x.c.sim.ledger(0).foreign_imports, 1);
    let baseline_held = 0;
    // The producer's shutdown: deregister (the consumer closes its import), free, empty.
    p.deregister(&[x.p_md]).unwrap();
    assert_eq!(p.stats().revoke_timeouts, 0);
    consumer_closed(&x.c, 1);
    x.p.pool.free(x.p_ptr).unwrap();
    x.p.pool.empty_cache(None).unwrap();
    assert_eq!(
        x.p.sim.ledger(0).held_bytes,
        baseline_held,
        "the producer's memory is back"
    );
    // The consumer lives on; a transfer on the revoked registration fails clearly.
    let e = c.post(req, None).unwrap_err().to_string();
    assert!(e.contains("revoked"), "{e}");
    let e = c
        .prepare(Op::Read, &local, &remote, "prefill")
        .unwrap_err()
        .to_string();
    assert!(e.contains("revoked"), "{e}");
    c.release(req).unwrap();
    c.unload(x.remote_md).unwrap();
    // Its own memory is its own.
    c.deregister(&[x.c_md]).unwrap();
    x.c.pool.free(x.c_ptr).unwrap();
    x.c.pool.empty_cache(None).unwrap();
    assert_eq!(x.c.sim.ledger(0).held_bytes, 0);
}

#[test]
fn an_unload_closes_the_import_and_the_producer_forgets_the_consumer() {
    let x = pair();
    let (c, p) = (&x.c.engine, &x.p.engine);
    c.unload(x.remote_md).unwrap();
    assert_eq!(x.c.sim.ledger(0).foreign_imports, 0);
    assert!(c.unload(x.remote_md).is_err(), "unloaded twice");
    // Deregistering now waits for nobody.
    wait_until("the lease closed", Duration::from_secs(10), || {
        x.p.pool.stats(0).unwrap().imports_live == 0
    });
    let t = std::time::Instant::now();
    p.deregister(&[x.p_md]).unwrap();
    assert!(t.elapsed() < Duration::from_secs(5));
    assert_eq!(p.stats().revoke_timeouts, 0);
    x.p.pool.free(x.p_ptr).unwrap();
    x.p.pool.empty_cache(None).unwrap();
    assert_eq!(x.p.sim.ledger(0).held_bytes, 0);
}

#[test]
fn a_registered_kv_cache_sleeps_and_wakes_and_transfers_resume_without_new_metadata() {
    let x = pair_tagged(Some("xfer_kv"));
    let (c, p) = (&x.c.engine, &x.p.engine);
    let kv = gpu_arena::tags::lookup("xfer_kv").unwrap();
    let local = [Desc {
        addr: x.c_ptr,
        len: 4 * MIB,
        md: x.c_md,
    }];
    let remote = [Desc {
        addr: x.p_ptr,
        len: 4 * MIB,
        md: x.remote_md,
    }];
    let req = c.prepare(Op::Read, &local, &remote, "prefill").unwrap();
    run(c, req, None);
    let before = read(x.c_ptr, (4 * MIB) as usize);
    assert_eq!(before, read(x.p_ptr, (4 * MIB) as usize));
    // Sleep the tag with its contents offloaded: the registration's share ends first (the
    // consumer closes its mapping), so the arena really sleeps.
    let report = x.p.pool.sleep_tags(Some(0), Some(&[kv]), &[kv]).unwrap();
    assert_eq!(
        report.kept_shared_bytes, 0,
        "a registration kept its arena awake"
    );
    assert!(report.arena_bytes >= 4 * MIB);
    assert_eq!(p.stats().slept, 1);
    consumer_closed(&x.c, 1);
    // A transfer while it sleeps fails clearly, and changes nothing.
    let e = c.post(req, None).unwrap_err().to_string();
    assert!(e.contains("asleep"), "{e}");
    assert!(p
        .public_data(x.p_md)
        .unwrap_err()
        .to_string()
        .contains("asleep"));
    // Wake: the same request works again, with no metadata exchanged.
    x.p.pool.wake(Some(0), Some(&[kv])).unwrap();
    fill(x.c_ptr, (4 * MIB) as usize, 0);
    run(c, req, None);
    assert_eq!(
        read(x.c_ptr, (4 * MIB) as usize),
        before,
        "offloaded contents after the wake"
    );
    assert_eq!(c.stats().reloaded, 1);
    // And a new request too; then the usual shutdown gives everything back.
    let again = c.prepare(Op::Read, &local, &remote, "prefill").unwrap();
    run(c, again, None);
    for r in [req, again] {
        c.release(r).unwrap();
    }
    p.deregister(&[x.p_md]).unwrap();
    x.p.pool.free(x.p_ptr).unwrap();
    x.p.pool.empty_cache(None).unwrap();
    assert_eq!(x.p.sim.ledger(0).held_bytes, 0);
}

#[test]
fn the_owners_free_and_empty_cache_take_a_registration_back() {
    let x = pair();
    let (c, p) = (&x.c.engine, &x.p.engine);
    let local = [Desc {
        addr: x.c_ptr,
        len: MIB,
        md: x.c_md,
    }];
    let remote = [Desc {
        addr: x.p_ptr,
        len: MIB,
        md: x.remote_md,
    }];
    let req = c.prepare(Op::Read, &local, &remote, "prefill").unwrap();
    run(c, req, None);
    // The owner frees the registered memory without deregistering (deferred: shared), then
    // empties the cache: the consumer is told, closes, and the memory goes back.
    x.p.pool.free(x.p_ptr).unwrap();
    assert!(x.p.pool.freed_while_shared(x.p_ptr));
    x.p.pool.empty_cache(None).unwrap();
    consumer_closed(&x.c, 1);
    assert_eq!(
        x.p.sim.ledger(0).held_bytes,
        0,
        "the producer's memory is back"
    );
    let e = c.post(req, None).unwrap_err().to_string();
    assert!(e.contains("revoked"), "{e}");
    // NIXL's deregistration afterwards only forgets it.
    p.deregister(&[x.p_md]).unwrap();
    assert!(p.deregister(&[x.p_md]).is_err());
}

#[test]
fn the_owners_free_and_a_trim_take_a_registration_back() {
    let x = pair();
    let (c, p) = (&x.c.engine, &x.p.engine);
    let local = [Desc {
        addr: x.c_ptr,
        len: MIB,
        md: x.c_md,
    }];
    let remote = [Desc {
        addr: x.p_ptr,
        len: MIB,
        md: x.remote_md,
    }];
    let req = c.prepare(Op::Read, &local, &remote, "prefill").unwrap();
    run(c, req, None);
    x.p.pool.free(x.p_ptr).unwrap();
    x.p.pool.trim(None).unwrap();
    consumer_closed(&x.c, 1);
    assert_eq!(
        x.p.sim.ledger(0).held_bytes,
        0,
        "the producer's memory is back"
    );
    assert!(c
        .post(req, None)
        .unwrap_err()
        .to_string()
        .contains("revoked"));
    p.deregister(&[x.p_md]).unwrap();
}

#[test]
fn posts_racing_a_revocation_never_copy_through_a_closed_mapping() {
    for _ in 0..20 {
        let x = pair();
        let (c, p) = (&x.c.engine, &x.p.engine);
        let local = [Desc {
            addr: x.c_ptr,
            len: MIB,
            md: x.c_md,
        }];
        let remote = [Desc {
            addr: x.p_ptr,
            len: MIB,
            md: x.remote_md,
        }];
        let req = c.prepare(Op::Read, &local, &remote, "prefill").unwrap();
        std::thread::scope(|s| {
            let poster = s.spawn(|| {
                // Post until refused: every refusal must be the revocation's, never a copy
                // into memory that is no longer mapped (UnknownPointer from the backend).
                loop {
                    match c.post(req, None) {
                        Ok(_) => {}
                        Err(e) => {
                            let e = e.to_string();
                            assert!(e.contains("revoked") || e.contains("being closed"), "{e}");
                            return;
                        }
                    }
                }
            });
            p.deregister(&[x.p_md]).unwrap();
            poster.join().unwrap();
        });
        consumer_closed(&x.c, 1);
        x.p.pool.free(x.p_ptr).unwrap();
        x.p.pool.empty_cache(None).unwrap();
        assert_eq!(x.p.sim.ledger(0).held_bytes, 0);
    }
}
