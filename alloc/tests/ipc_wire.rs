//! Malformed traffic on the IPC broker's wire, on the sim backend: garbage on the socket,
//! leases on two devices, a peer that never reads, handle and wire version skew, and the
//! batched ops (open many, close many) raw and through the importer.
//!
//! The peer-level checks (socket naming, silent peers, the connection cap, forged tokens, the
//! uid allow-list) are in `ipc_security.rs`.
#![allow(clippy::unwrap_used)]

mod common;
use common::broker_fixture::*;
use common::raw_wire::*;
use common::{fd_count, wait_until};

use std::io::IoSlice;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpu_arena::backend::sim::{SimBackend, SimConfig};
use gpu_arena::backend::Backend;
use gpu_arena::ipc::{BrokerConfig, Importer, ShareHandle, HANDLE_BYTES};
use gpu_arena::Error;
use rand::{Rng, SeedableRng};
use rustix::net::{SendAncillaryBuffer, SendFlags};

// ---------------------------------------------------------------------------------------
// (2) Garbage on the socket.
// ---------------------------------------------------------------------------------------

#[test]
fn garbage_on_the_socket_gets_error_replies_and_other_peers_are_unaffected() {
    let _g = SERIAL.lock();
    let p = producer(BrokerConfig::default());
    let fds = fd_count();
    let a = p.pool.alloc(0, 4 * MIB, S).unwrap();
    let h = p.broker.share(a.ptr, 2 * MIB).unwrap();
    // A well-behaved consumer holds a lease throughout.
    let good = Importer::new(p.sim.clone() as Arc<dyn Backend>);
    let gp = good.import(&h).unwrap();
    assert_eq!(imports_live(&p.pool), 1);

    let raw = raw_connect(p.broker.socket_name());
    let mut expected_bad = 0u64;
    let mut expect_error = |bytes: &[u8], fds: &[BorrowedFd<'_>], needle: &str| {
        raw_send(&raw, bytes, fds).unwrap();
        let r = raw_recv(&raw).reply();
        assert!(!r.ok, "accepted {bytes:?}");
        assert!(r.fds.is_empty());
        assert!(
            r.message.contains(needle),
            "`{}` lacks `{needle}`",
            r.message
        );
        expected_bad += 1;
    };
    // Random bytes of random lengths.
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x5ec);
    for _ in 0..300 {
        let n = rng.gen_range(1..=512);
        let mut b = vec![0u8; n];
        rng.fill(&mut b[..]);
        if n == 44 {
            b[0] = rng.gen_range(3..=255); // a random 44-byte packet with op 1 or 2 is not garbage
        }
        expect_error(&b, &[], "");
    }
    // Wrong lengths around the right one, up to the largest packet.
    let valid = open_req(&h, false);
    for n in [1usize, 16, 39, 40, 43, 45, 52, 511, 512] {
        let mut b = valid.clone();
        b.resize(n, 0);
        expect_error(&b, &[], &format!("request of {n} bytes"));
    }
    // Unknown ops.
    for op in [0u8, 6, 0x7f, 0xff] {
        let mut b = valid.clone();
        b[0] = op;
        expect_error(&b, &[], &format!("unknown request op {op}"));
    }
    // Malformed flags and reserved bytes.
    for (at, v) in [(1usize, 2u8), (2, 1), (3, 0xff), (12, 1), (15, 0x80)] {
        let mut b = valid.clone();
        b[at] = v;
        expect_error(&b, &[], "malformed");
    }
    // Devices that do not exist.
    for dev in [-1i32, 1, i32::MAX, i32::MIN] {
        let b = request(
            OPEN,
            true,
            dev,
            h.info.share_key,
            h.info.arena_id,
            &h.info.token,
            h.info.generation,
        );
        expect_error(&b, &[], "");
    }
    // Closing leases this connection does not hold (the good consumer's among them).
    for lease in [0u32, 1, 2, 7, u32::MAX] {
        expect_error(&close_req(0, lease), &[], "not held by this connection");
    }
    assert_eq!(
        imports_live(&p.pool),
        1,
        "the good consumer's lease survived"
    );
    // A stale arena id with the right token.
    let b = request(
        OPEN,
        false,
        0,
        h.info.share_key,
        h.info.arena_id + 1,
        &h.info.token,
        h.info.generation,
    );
    expect_error(&b, &[], "another arena");
    assert_eq!(imports_live(&p.pool), 1, "the stale open left no lease");
    // Garbage with fds attached: an error reply, and the broker closes every fd it got,
    // including those beyond the two its control buffer has room for.
    let probes: Vec<(UnixStream, UnixStream)> = (0..6).map(|_| probe()).collect();
    let (one, rest) = probes.split_at(1);
    expect_error(b"garbage", &[one[0].0.as_fd()], "request of 7 bytes");
    let many: Vec<BorrowedFd<'_>> = rest.iter().map(|p| p.0.as_fd()).collect();
    expect_error(&[0xAB; 44], &many, "unknown request op");
    for (i, (ours, theirs)) in probes.into_iter().enumerate() {
        drop(ours);
        assert!(
            closed_everywhere(theirs),
            "fd {i} sent to the broker was kept"
        );
    }
    // A valid open with an fd attached is served; the fd is dropped.
    let (ours, theirs) = probe();
    raw_send(&raw, &valid, &[ours.as_fd()]).unwrap();
    let r = raw_recv(&raw).reply();
    assert!(r.ok, "{}", r.message);
    drop(ours);
    assert!(closed_everywhere(theirs));
    assert_eq!(imports_live(&p.pool), 2);
    // The same connection, after all that, still works: close the lease it opened.
    let c = round_trip(&raw, &close_req(0, r.lease_key));
    assert!(c.ok, "{}", c.message);
    let c = round_trip(&raw, &close_req(0, r.lease_key));
    assert!(!c.ok, "a second close of the same lease");
    expected_bad += 1;
    assert_eq!(p.broker.stats().bad_requests, expected_bad);
    assert_eq!(p.broker.stats().connections_live, 2);

    // An oversized packet: the broker drops the connection (no reply), releasing its leases.
    let big = raw_connect(p.broker.socket_name());
    let r = round_trip(&big, &valid);
    assert!(r.ok);
    assert_eq!(imports_live(&p.pool), 2);
    raw_send(&big, &[0u8; 8192], &[]).unwrap();
    assert!(matches!(raw_recv(&big), Got::Closed));
    wait_until(
        "oversized peer's lease dropped",
        Duration::from_secs(2),
        || imports_live(&p.pool) == 1,
    );
    // An empty packet reads as end-of-stream: the broker hangs up.
    let empty = raw_connect(p.broker.socket_name());
    raw_send(&empty, &[], &[]).unwrap();
    assert!(matches!(raw_recv(&empty), Got::Closed));
    drop((big, empty));
    // Neither counted as a bad request (there was no request to answer).
    assert_eq!(p.broker.stats().bad_requests, expected_bad);

    // The broker survived: a new consumer imports and closes; the old one closes.
    let other = Importer::new(p.sim.clone() as Arc<dyn Backend>);
    let op = other.import(&h).unwrap();
    assert_eq!(imports_live(&p.pool), 2);
    other.close(op).unwrap();
    good.close(gp).unwrap();
    assert_eq!(imports_live(&p.pool), 0);
    drop(raw);
    wait_until("all connections closed", Duration::from_secs(2), || {
        p.broker.stats().connections_live == 0
    });
    p.broker.unshare(&h).unwrap();
    p.pool.free(a.ptr).unwrap();
    p.pool.validate(0).unwrap();
    drop((good, other));
    p.pool.empty_cache(None).unwrap();
    assert_eq!(fd_count(), fds, "no fd leaked");
    assert!(p.sim.is_clean(0), "{:?}", p.sim.ledger(0));
}

/// The broker's lease table per connection is keyed by lease key alone, but lease keys are
/// per device: two leases on two devices can share a key.
#[test]
fn leases_on_two_devices_with_the_same_key_are_both_dropped_on_disconnect() {
    let _g = SERIAL.lock();
    let p = producer_with(
        SimConfig {
            devices: 2,
            ..SimConfig::default()
        },
        BrokerConfig::default(),
    );
    let a0 = p.pool.alloc(0, MIB, S).unwrap();
    let a1 = p.pool.alloc(1, MIB, S).unwrap();
    let h0 = p.broker.share(a0.ptr, MIB).unwrap();
    let h1 = p.broker.share(a1.ptr, MIB).unwrap();
    let raw = raw_connect(p.broker.socket_name());
    let r0 = round_trip(&raw, &open_req(&h0, false));
    let r1 = round_trip(&raw, &open_req(&h1, false));
    assert!(r0.ok && r1.ok);
    assert_eq!(r0.lease_key, r1.lease_key, "the same key on both devices");
    drop(raw);
    wait_until("every lease dropped", Duration::from_secs(2), || {
        p.pool.stats(0).unwrap().imports_live == 0 && p.pool.stats(1).unwrap().imports_live == 0
    });
    assert_eq!(p.broker.stats().leases_dropped_on_disconnect, 2);
}

/// A peer that floods requests and never reads the replies must not keep `Broker::drop`
/// waiting.
#[test]
fn a_peer_that_never_reads_replies_does_not_block_broker_drop() {
    let _g = SERIAL.lock();
    let p = producer(BrokerConfig::default());
    let raw = raw_connect(p.broker.socket_name());
    // Fill both directions: send (without waiting) until the broker's thread is blocked
    // writing replies we never read and our own send buffer is full.
    let junk = [0xEEu8; 40];
    let mut sent = 0u32;
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(2) {
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        match rustix::net::sendmsg(
            &raw,
            &[IoSlice::new(&junk)],
            &mut control,
            SendFlags::NOSIGNAL | SendFlags::DONTWAIT,
        ) {
            Ok(_) => sent += 1,
            Err(rustix::io::Errno::AGAIN) => {
                std::thread::sleep(Duration::from_millis(50));
                if rustix::net::sendmsg(
                    &raw,
                    &[IoSlice::new(&junk)],
                    &mut SendAncillaryBuffer::new(&mut space),
                    SendFlags::NOSIGNAL | SendFlags::DONTWAIT,
                )
                .is_err()
                {
                    break;
                }
                sent += 1;
            }
            Err(e) => panic!("send: {e}"),
        }
    }
    eprintln!("{sent} unread requests queued");
    let (tx, rx) = std::sync::mpsc::channel();
    let Producer { broker, .. } = p;
    std::thread::spawn(move || {
        let t = Instant::now();
        drop(broker);
        let _ = tx.send(t.elapsed());
    });
    let took = rx
        .recv_timeout(Duration::from_secs(3))
        .expect("Broker::drop hung on a peer that does not read");
    eprintln!("broker dropped in {took:?}");
    drop(raw);
}

// ---------------------------------------------------------------------------------------
// (5) Version skew on the wire and in handles.
// ---------------------------------------------------------------------------------------

#[test]
fn handle_version_skew_and_handles_pointing_elsewhere_are_refused() {
    let _g = SERIAL.lock();
    let p = producer(BrokerConfig::default());
    let a = p.pool.alloc(0, 4 * MIB, S).unwrap();
    let h = p.broker.share(a.ptr, MIB).unwrap();
    let bytes = h.to_bytes();
    // Versions other than 1, including 0 and the one right after.
    for v in [0u16, 2, 0x0100, u16::MAX] {
        let mut b = bytes;
        b[8..10].copy_from_slice(&v.to_le_bytes());
        let e = ShareHandle::from_bytes(&b).unwrap_err();
        assert!(
            e.to_string().contains(&format!(
                "share handle version {v}, this gpu-arena speaks version 1"
            )),
            "{e}"
        );
    }
    // A longer (or shorter) future handle is refused on its size.
    let mut longer = bytes.to_vec();
    longer.extend_from_slice(&[0; 32]);
    assert!(ShareHandle::from_bytes(&longer)
        .unwrap_err()
        .to_string()
        .contains(&format!(
            "{} bytes, expected {HANDLE_BYTES}",
            HANDLE_BYTES + 32
        )));
    assert!(ShareHandle::from_bytes(&[]).is_err());

    let importer = Importer::new(p.sim.clone() as Arc<dyn Backend>);
    // A name that is not bound, in the broker's own naming scheme (a producer that exited).
    let mut gone = h.clone();
    gone.socket_name = format!("gpu-arena.{}.0000000000000000", std::process::id()).into();
    let e = importer.import(&gone).unwrap_err();
    assert!(e.to_string().contains("unreachable"), "{e}");
    // The right socket, a pid that is not ours (a live process, and one that cannot exist).
    for pid in [std::process::id() + 1, u32::MAX] {
        let mut w = h.clone();
        w.producer_pid = pid;
        let e = importer.import(&w).unwrap_err();
        assert!(e.to_string().contains("served by pid"), "{pid}: {e}");
    }
    // Built in code (public fields), skipping `from_bytes`: a socket name too long for an
    // abstract address, and one with a NUL.
    for name in ["x".repeat(200), "gpu\0arena".to_string()] {
        let mut w = h.clone();
        w.socket_name = name.into();
        assert!(importer.import(&w).is_err());
    }
    // A stale handle: the right token, another arena id.
    let mut stale = h.clone();
    stale.info.arena_id += 1;
    let e = importer.import(&stale).unwrap_err();
    assert!(e.to_string().contains("another arena"), "{e}");
    // The arena size the handle claims disagrees with the producer's.
    let mut size = h.clone();
    size.info.arena_bytes *= 2;
    let e = importer.import(&size).unwrap_err();
    assert!(e.to_string().contains("producer says the arena is"), "{e}");
    // A device the consumer has, the producer does not.
    let two = Arc::new(
        SimBackend::new(SimConfig {
            devices: 2,
            ..SimConfig::default()
        })
        .unwrap(),
    );
    let importer2 = Importer::new(two.clone() as Arc<dyn Backend>);
    let mut dev = h.clone();
    dev.info.device = 1;
    assert!(importer2.import(&dev).is_err());
    // A device the consumer does not have: refused before connecting.
    let mut dev = h.clone();
    dev.info.device = 5;
    assert!(matches!(
        importer.import(&dev),
        Err(Error::InvalidDevice { device: 5, .. })
    ));
    assert_eq!(imports_live(&p.pool), 0, "none of these opened a lease");
    assert_eq!(importer.stats().imports_live, 0);
    assert_eq!(importer2.stats().imports_live, 0);
    // The genuine handle still works.
    let ptr = importer.import(&h).unwrap();
    importer.close(ptr).unwrap();
    drop((importer, importer2));
    assert!(two.is_clean(0) && two.is_clean(1));
}

#[test]
fn importer_refuses_an_out_of_range_handle_built_in_code() {
    let _g = SERIAL.lock();
    let p = producer(BrokerConfig::default());
    let a = p.pool.alloc(0, 4 * MIB, S).unwrap();
    let h = p.broker.share(a.ptr, MIB).unwrap();
    let importer = Importer::new(p.sim.clone() as Arc<dyn Backend>);
    let mut w = h.clone();
    w.info.offset = w.info.arena_bytes + 4096; // past the end of the mapping
    let r = importer.import(&w);
    let e = match r {
        Ok(ptr) => {
            importer.close(ptr).unwrap();
            panic!("imported {ptr:#x}, outside the arena's mapping");
        }
        Err(e) => e,
    };
    assert!(matches!(e, Error::Ipc(_)), "{e}");
    assert_eq!(imports_live(&p.pool), 0);
}

#[test]
fn wire_requests_from_another_version_are_refused_and_leave_no_lease() {
    let _g = SERIAL.lock();
    let p = producer(BrokerConfig::default());
    let a = p.pool.alloc(0, MIB, S).unwrap();
    let h = p.broker.share(a.ptr, MIB).unwrap();
    let raw = raw_connect(p.broker.socket_name());
    // The request carries no version: its size and its zero fields are the check. A request
    // of a hypothetical next version (a new field in the reserved word, or a longer packet,
    // or a new op) is refused, not half-understood.
    let mut v2 = open_req(&h, true);
    v2[12] = 2;
    let r = round_trip(&raw, &v2);
    assert!(
        !r.ok && r.fds.is_empty() && r.message.contains("malformed"),
        "{r:?}"
    );
    let mut longer = open_req(&h, true);
    longer.extend_from_slice(&[0; 8]);
    let r = round_trip(&raw, &longer);
    assert!(!r.ok && r.message.contains("request of 52 bytes"), "{r:?}");
    // (ops 3 and 4 are batches: their own format, refused here as malformed)
    let mut op3 = open_req(&h, true);
    op3[0] = 3;
    let r = round_trip(&raw, &op3);
    assert!(!r.ok && r.message.contains("malformed batch"), "{r:?}");
    // (op 5 asks for the mailbox, every other field 0: refused here as malformed)
    let mut op5 = open_req(&h, true);
    op5[0] = 5;
    let r = round_trip(&raw, &op5);
    assert!(
        !r.ok && r.fds.is_empty() && r.message.contains("malformed mailbox request"),
        "{r:?}"
    );
    let mut op6 = open_req(&h, true);
    op6[0] = 6;
    let r = round_trip(&raw, &op6);
    assert!(!r.ok && r.message.contains("unknown request op 6"), "{r:?}");
    assert_eq!(imports_live(&p.pool), 0);
    assert_eq!(p.broker.stats().bad_requests, 5);
}

#[test]
fn batches_are_all_or_nothing_checked_per_connection_and_dropped_with_it() {
    let _g = SERIAL.lock();
    let p = producer(BrokerConfig::default());
    let a = p.pool.alloc(0, 4 * MIB, S).unwrap();
    let h1 = p.broker.share(a.ptr, MIB).unwrap();
    let h2 = p.broker.share(a.ptr + MIB, MIB).unwrap();
    let raw = raw_connect(p.broker.socket_name());

    let r = round_trip(&raw, &batch_open(0, &[&h1, &h2]));
    assert!(r.ok && r.fds.is_empty(), "{r:?}");
    assert_eq!(r.lease_key, 2);
    let leases = lease_keys(&r);
    assert_eq!(leases.len(), 2);
    assert_eq!(imports_live(&p.pool), 2);

    // A wrong token in any entry refuses the whole batch, and opens nothing.
    let mut forged = h2.clone();
    forged.info.token[0] ^= 1;
    let r = round_trip(&raw, &batch_open(0, &[&h1, &forged]));
    assert!(!r.ok && r.message.contains("batch entry 1"), "{r:?}");
    assert_eq!(imports_live(&p.pool), 2);

    // Another connection cannot close these leases, in a batch or not.
    let other = raw_connect(p.broker.socket_name());
    let r = round_trip(&other, &batch_close(0, &leases));
    assert!(
        !r.ok && r.message.contains("not held by this connection"),
        "{r:?}"
    );
    // Nor can this one list a lease twice, or one it does not hold: nothing is closed.
    let r = round_trip(&raw, &batch_close(0, &[leases[0], leases[0]]));
    assert!(!r.ok, "{r:?}");
    let r = round_trip(&raw, &batch_close(0, &[leases[0], 999]));
    assert!(!r.ok, "{r:?}");
    assert_eq!(imports_live(&p.pool), 2);

    // Malformed batches.
    let good = batch_close(0, &leases);
    let mut cases: Vec<Vec<u8>> = Vec::new();
    let mut b = good.clone();
    b.pop();
    cases.push(b); // short
    let mut b = good.clone();
    b[8] = 3;
    cases.push(b); // count past the entries
    cases.push(batch_close(0, &[])); // empty
    cases.push(batch_close(0, &[1; 121])); // too many
    let mut b = good.clone();
    b[1] = 1;
    cases.push(b); // want_fd in a batch
    let mut b = good.clone();
    b[30] = 1;
    cases.push(b); // reserved
    cases.push(batch_open(5, &[&h1])); // no such device
    for bad in cases {
        let r = round_trip(&raw, &bad);
        assert!(!r.ok, "accepted {bad:?}");
    }
    assert_eq!(imports_live(&p.pool), 2);

    // Unshare stops new imports in a batch too.
    p.broker.unshare(&h1).unwrap();
    let r = round_trip(&raw, &batch_open(0, &[&h2, &h1]));
    assert!(!r.ok && r.message.contains("unshared"), "{r:?}");
    assert_eq!(imports_live(&p.pool), 2);

    // The owner's free waits for the leases; a batch close ends them.
    p.pool.free(a.ptr).unwrap();
    let r = round_trip(&raw, &batch_close(0, &leases));
    assert!(r.ok, "{r:?}");
    assert_eq!(imports_live(&p.pool), 0);

    // Leases opened in a batch end with their connection.
    let b = p.pool.alloc(0, 4 * MIB, S).unwrap();
    let h3 = p.broker.share(b.ptr, MIB).unwrap();
    let h4 = p.broker.share(b.ptr + MIB, MIB).unwrap();
    let r = round_trip(&raw, &batch_open(0, &[&h3, &h4, &h3]));
    assert!(r.ok, "{r:?}");
    assert_eq!(imports_live(&p.pool), 3);
    drop(raw);
    wait_until("leases dropped", Duration::from_secs(5), || {
        imports_live(&p.pool) == 0
    });
}

#[test]
fn import_many_and_close_many_through_the_importer() {
    let _g = SERIAL.lock();
    let p = producer(BrokerConfig::default());
    let a = p.pool.alloc(0, 8 * MIB, S).unwrap();
    let hs: Vec<ShareHandle> = (0..8)
        .map(|i| p.broker.share(a.ptr + i * MIB, MIB).unwrap())
        .collect();
    let imp = Importer::new(p.sim.clone() as Arc<dyn Backend>);
    // The first share maps the arena (alone, with its fd); the rest go in one batch.
    let ptrs = imp.import_many(&hs).unwrap();
    assert_eq!(ptrs.len(), 8);
    for (i, w) in ptrs.windows(2).enumerate() {
        assert_eq!(w[1] - w[0], MIB, "share {i}");
    }
    assert_eq!(imports_live(&p.pool), 8);
    assert_eq!(imp.stats().arenas_mapped, 1);
    assert_eq!(imp.imported_len(ptrs[3]), Some(MIB));

    // An unknown pointer refuses the whole close; nothing is closed.
    let e = imp.close_many(&[ptrs[0], 12345]).unwrap_err();
    assert!(matches!(e, Error::UnknownPointer { .. }), "{e}");
    let e = imp.close_many(&[ptrs[0], ptrs[0]]).unwrap_err();
    assert!(
        matches!(e, Error::UnknownPointer { .. }),
        "closing one import twice: {e}"
    );
    assert_eq!(imp.stats().imports_live, 8);

    // A revoked share in a batch: all or nothing.
    p.broker.unshare(&hs[7]).unwrap();
    let e = imp.import_many(&hs[4..]).unwrap_err();
    assert!(e.to_string().contains("unshared"), "{e}");
    assert_eq!(imp.stats().imports_live, 8);

    // A refused share of an arena not mapped yet, after shares of a mapped one: the
    // arenas held for the batch are let go, nothing is left imported or mapped.
    let other = p.pool.alloc(0, 64 * MIB, S).unwrap();
    let ho = p.broker.share(other.ptr, MIB).unwrap();
    p.broker.unshare(&ho).unwrap();
    let e = imp
        .import_many(&[hs[0].clone(), hs[1].clone(), ho])
        .unwrap_err();
    // (its only share ended with the unshare: the record is gone, the cause is kept)
    assert!(e.to_string().contains("was unshared"), "{e}");
    assert_eq!(imp.stats().imports_live, 8);
    assert_eq!(imp.stats().arenas_mapped, 1);

    // A bad handle (range past its arena) is refused before anything is sent.
    let mut bad = hs[1].clone();
    bad.info.offset = bad.info.arena_bytes;
    assert!(imp.import_many(&[hs[0].clone(), bad]).is_err());
    assert_eq!(imp.stats().imports_live, 8);

    imp.close_many(&ptrs[..4]).unwrap();
    imp.close(ptrs[4]).unwrap();
    imp.close_many(&ptrs[5..]).unwrap();
    assert_eq!(imp.stats().imports_live, 0);
    assert_eq!(imp.stats().arenas_mapped, 0);
    assert_eq!(imp.stats().producers, 0);
    wait_until("leases closed", Duration::from_secs(5), || {
        imports_live(&p.pool) == 0
    });
    assert_eq!(p.broker.stats().leases_dropped_on_disconnect, 0);
    assert!(imp.import_many(&[]).unwrap().is_empty());
    imp.close_many(&[]).unwrap();
}
