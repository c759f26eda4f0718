//! Security tests of the IPC broker on the sim backend: socket naming, garbage on the wire,
//! silent peers, the connection cap, handle and wire version skew, forged tokens, and the uid
//! allow-list.
//!
//! Access control, as it stands: the broker's socket lives in Linux's *abstract* namespace
//! (`@gpu-arena.<pid>.<random>`). An abstract socket has no filesystem node, so there is no
//! file mode, owner or directory permission to set or check: any process in the same network
//! namespace can `connect()`. The only gate is the broker's `SO_PEERCRED` check on every
//! accepted connection (own effective uid, plus `BrokerConfig::allowed_uids`), and after that
//! the 128-bit token of each share. On the consumer side, `SO_PEERCRED` checks the socket is
//! served by the pid the handle names (so a squatter on the name is refused).
//!
//! The complements in `ipc_sim.rs` (one forged token, pid 1, an unknown socket, handle
//! version 9, a uid-65534 consumer refused) are not repeated here.
//!
//! Child processes are this test binary run again with `GPU_ARENA_SEC_CHILD` set.
#![allow(clippy::unwrap_used)]

mod common;
use common::{fd_count, hex, unhex, wait_until};

use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpu_arena::backend::sim::{SimBackend, SimConfig};
use gpu_arena::backend::Backend;
use gpu_arena::ipc::{Broker, BrokerConfig, Importer, ShareHandle, HANDLE_BYTES};
use gpu_arena::{Error, Pool, PoolConfig, StreamId};
use rand::{Rng, SeedableRng};
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags, SocketAddrUnix,
};

const MIB: u64 = 1 << 20;
const S: StreamId = StreamId(7);

/// Every test here takes this lock: some count the process's fds, and every test opens
/// sockets, so none may overlap another.
static SERIAL: parking_lot::Mutex<()> = parking_lot::Mutex::new(());

struct Producer {
    sim: Arc<SimBackend>,
    pool: Arc<Pool>,
    broker: Broker,
}

fn producer_with(sim: SimConfig, config: BrokerConfig) -> Producer {
    let sim = Arc::new(SimBackend::new(sim).unwrap());
    let pool = common::validating_pool(&sim, 64 * MIB);
    let broker = Broker::start(pool.clone(), config).unwrap();
    Producer { sim, pool, broker }
}

fn producer(config: BrokerConfig) -> Producer {
    producer_with(SimConfig::default(), config)
}

/// A producer capped at one connection, a share of 1 MiB, and the raw peer holding the
/// one slot.
fn full_producer() -> (Producer, ShareHandle, OwnedFd) {
    let p = producer(BrokerConfig {
        max_connections: 1,
        ..BrokerConfig::default()
    });
    let a = p.pool.alloc(0, MIB, S).unwrap();
    let h = p.broker.share(a.ptr, MIB).unwrap();
    let first = raw_connect(p.broker.socket_name());
    wait_until("one connection", Duration::from_secs(1), || {
        p.broker.stats().connections_live == 1
    });
    (p, h, first)
}

fn imports_live(pool: &Pool) -> u64 {
    pool.stats(0).unwrap().imports_live
}

// ---------------------------------------------------------------------------------------
// A raw consumer speaking the private wire protocol (see alloc/src/ipc/wire.rs):
// request, 44 bytes: op u8 | want_fd u8 | 0 0 | device i32 | key u32 | 0 u32 | arena_id u64
// | token [16] | generation u32; reply: ok u8 | pinning u8 | 0 0 | lease_key u32 | arena_bytes u64 | message.
// ---------------------------------------------------------------------------------------

const OPEN: u8 = 1;
const CLOSE: u8 = 2;

fn request(
    op: u8,
    want_fd: bool,
    device: i32,
    key: u32,
    arena_id: u64,
    token: &[u8; 16],
    generation: u32,
) -> Vec<u8> {
    let mut b = vec![0u8; 44];
    b[0] = op;
    b[1] = u8::from(want_fd);
    b[4..8].copy_from_slice(&device.to_le_bytes());
    b[8..12].copy_from_slice(&key.to_le_bytes());
    b[16..24].copy_from_slice(&arena_id.to_le_bytes());
    b[24..40].copy_from_slice(token);
    b[40..44].copy_from_slice(&generation.to_le_bytes());
    b
}

fn open_req(h: &ShareHandle, want_fd: bool) -> Vec<u8> {
    request(
        OPEN,
        want_fd,
        h.info.device,
        h.info.share_key,
        h.info.arena_id,
        &h.info.token,
        h.info.generation,
    )
}

fn close_req(device: i32, lease: u32) -> Vec<u8> {
    request(CLOSE, false, device, lease, 0, &[0; 16], 0)
}

#[derive(Debug)]
struct RawReply {
    ok: bool,
    lease_key: u32,
    message: String,
    fds: Vec<OwnedFd>,
}

#[derive(Debug)]
enum Got {
    Reply(RawReply),
    Closed,
    TimedOut,
}

impl Got {
    #[track_caller]
    fn reply(self) -> RawReply {
        match self {
            Got::Reply(r) => r,
            other => panic!("expected a reply, got {other:?}"),
        }
    }
}

fn raw_connect(name: &str) -> OwnedFd {
    let s = common::seqpacket_socket();
    rustix::net::connect(
        &s,
        &SocketAddrUnix::new_abstract_name(name.as_bytes()).unwrap(),
    )
    .unwrap();
    rustix::net::sockopt::set_socket_timeout(
        &s,
        rustix::net::sockopt::Timeout::Recv,
        Some(Duration::from_secs(5)),
    )
    .unwrap();
    s
}

fn raw_send(s: &OwnedFd, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> rustix::io::Result<usize> {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(16))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() {
        assert!(control.push(SendAncillaryMessage::ScmRights(fds)));
    }
    rustix::net::sendmsg(s, &[IoSlice::new(bytes)], &mut control, SendFlags::NOSIGNAL)
}

fn raw_recv(s: &OwnedFd) -> Got {
    let mut buf = [0u8; 1024];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(4))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let msg = loop {
        match rustix::net::recvmsg(
            s,
            &mut [IoSliceMut::new(&mut buf)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        ) {
            Ok(m) => break m,
            Err(rustix::io::Errno::INTR) => continue,
            Err(rustix::io::Errno::AGAIN) => return Got::TimedOut,
            Err(rustix::io::Errno::CONNRESET) => return Got::Closed,
            Err(e) => panic!("recvmsg: {e}"),
        }
    };
    let mut fds = Vec::new();
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(r) = m {
            fds.extend(r);
        }
    }
    if msg.bytes == 0 {
        return Got::Closed;
    }
    let b = &buf[..msg.bytes];
    assert!(b.len() >= 16, "short reply {b:?}");
    Got::Reply(RawReply {
        ok: b[0] == 1,
        lease_key: u32::from_le_bytes([b[4], b[5], b[6], b[7]]),
        message: String::from_utf8_lossy(&b[16..]).into_owned(),
        fds,
    })
}

fn round_trip(s: &OwnedFd, bytes: &[u8]) -> RawReply {
    raw_send(s, bytes, &[]).unwrap();
    raw_recv(s).reply()
}

/// An fd whose closing we can observe: send `probe.0`, drop ours; `closed_everywhere` reads
/// EOF on the other end once every copy (the broker's included) is closed.
fn probe() -> (UnixStream, UnixStream) {
    UnixStream::pair().unwrap()
}

fn closed_everywhere(mut other_end: UnixStream) -> bool {
    other_end
        .set_read_timeout(Some(Duration::from_secs(2)))
        .unwrap();
    let mut b = [0u8; 1];
    matches!(other_end.read(&mut b), Ok(0))
}

// ---------------------------------------------------------------------------------------
// (1) Socket naming and modes.
// ---------------------------------------------------------------------------------------

/// Socket paths of the Unix sockets the kernel knows (`/proc/net/unix`, last column;
/// abstract names start with `@`).
fn unix_socket_paths() -> Vec<String> {
    std::fs::read_to_string("/proc/net/unix")
        .unwrap()
        .lines()
        .skip(1)
        .filter_map(|l| {
            let cols: Vec<&str> = l.split_whitespace().collect();
            (cols.len() >= 8).then(|| cols[7].to_string())
        })
        .collect()
}

fn no_file_named(name: &str) {
    let mut dirs = vec![
        std::env::temp_dir(),
        std::env::current_dir().unwrap(),
        "/tmp".into(),
        "/dev/shm".into(),
        "/run".into(),
    ];
    if let Ok(xdg) = std::env::var("XDG_RUNTIME_DIR") {
        dirs.push(xdg.into());
    }
    for d in dirs {
        assert!(!d.join(name).exists(), "{} exists", d.join(name).display());
        if let Ok(entries) = std::fs::read_dir(&d) {
            for e in entries.flatten() {
                let f = e.file_name().to_string_lossy().into_owned();
                assert!(
                    !f.contains(name),
                    "{}/{f} looks like the broker's",
                    d.display()
                );
            }
        }
    }
}

#[test]
fn socket_is_abstract_no_filesystem_node_and_no_file_mode() {
    let _g = SERIAL.lock();
    for custom in [
        None,
        Some(format!("gpu-arena-sec.{}.custom", std::process::id())),
    ] {
        let p = producer(BrokerConfig {
            socket_name: custom.clone(),
            ..BrokerConfig::default()
        });
        let name = p.broker.socket_name().to_string();
        if let Some(c) = &custom {
            assert_eq!(&name, c);
        } else {
            let pid = std::process::id();
            assert!(name.starts_with(&format!("gpu-arena.{pid}.")), "{name}");
            assert_eq!(
                name.len(),
                format!("gpu-arena.{pid}.").len() + 16,
                "64 random bits"
            );
        }
        let paths = unix_socket_paths();
        assert!(
            paths.iter().any(|p| p == &format!("@{name}")),
            "the kernel lists `@{name}` as an abstract socket"
        );
        assert!(
            !paths
                .iter()
                .any(|p| !p.starts_with('@') && p.contains(&name)),
            "no filesystem socket carries the name"
        );
        no_file_named(&name);
        // No file means no mode: the only gate is SO_PEERCRED (and the tokens). A raw
        // connect needs no permission at all; the broker accepts it because we share its uid.
        let raw = raw_connect(&name);
        wait_until("raw peer accepted", Duration::from_secs(2), || {
            p.broker.stats().connections_live == 1
        });
        drop(raw);
        drop(p);
        // Nothing to unlink either: dropping the broker frees the name at once.
        assert!(!unix_socket_paths().iter().any(|p| p.contains(&name)));
        no_file_named(&name);
        if let Some(c) = custom {
            let again = producer(BrokerConfig {
                socket_name: Some(c),
                ..BrokerConfig::default()
            });
            drop(again);
        }
    }
}

#[test]
fn default_socket_names_are_unpredictable() {
    let _g = SERIAL.lock();
    let a = producer(BrokerConfig::default());
    let b = producer(BrokerConfig::default());
    assert_ne!(a.broker.socket_name(), b.broker.socket_name());
}

#[test]
fn invalid_socket_names_are_refused_with_a_clear_error() {
    let _g = SERIAL.lock();
    let sim = Arc::new(SimBackend::new(SimConfig::default()).unwrap());
    let pool = Arc::new(Pool::new(sim, PoolConfig::default()).unwrap());
    let too_long = "x".repeat(49);
    let cases: [(&str, &str); 8] = [
        ("empty", ""),
        ("49 characters", &too_long),
        ("space", "gpu arena"),
        ("tab", "gpu\tarena"),
        ("NUL", "gpu\0arena"),
        ("bell", "gpu\x07arena"),
        ("newline", "gpu-arena\n"),
        ("non-ASCII", "gpu-aréna"),
    ];
    for (what, name) in cases {
        let e = Broker::start(
            pool.clone(),
            BrokerConfig {
                socket_name: Some(name.into()),
                ..BrokerConfig::default()
            },
        )
        .unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{what}: {e}");
        assert!(
            e.to_string().contains("broker socket name")
                && e.to_string().contains("printable ASCII"),
            "{what}: {e}"
        );
    }
    // The longest accepted name is 48 characters (what a handle carries).
    let longest = format!("{:x<48}", format!("gpu-arena-sec.{}.", std::process::id()));
    let b = Broker::start(
        pool.clone(),
        BrokerConfig {
            socket_name: Some(longest.clone()),
            ..BrokerConfig::default()
        },
    )
    .unwrap();
    // A name already bound (squatted, or a second broker) is refused, not shared.
    let e = Broker::start(
        pool.clone(),
        BrokerConfig {
            socket_name: Some(longest.clone()),
            ..BrokerConfig::default()
        },
    )
    .unwrap_err();
    assert!(matches!(e, Error::Ipc(_)), "{e}");
    assert!(
        e.to_string().contains("bind") && e.to_string().contains(&longest),
        "{e}"
    );
    drop(b);
}

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
    for op in [0u8, 5, 0x7f, 0xff] {
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
// (3) Silent peers and idle timeouts.
// ---------------------------------------------------------------------------------------

#[test]
fn a_silent_peer_is_disconnected_after_the_idle_timeout_but_a_lease_holder_is_not() {
    let _g = SERIAL.lock();
    let p = producer(BrokerConfig {
        idle_timeout: Duration::from_millis(200),
        ..BrokerConfig::default()
    });
    let a = p.pool.alloc(0, MIB, S).unwrap();
    let h = p.broker.share(a.ptr, MIB).unwrap();
    // A consumer that holds a lease and then says nothing for many idle timeouts.
    let holder = Importer::new(p.sim.clone() as Arc<dyn Backend>);
    let hp = holder.import(&h).unwrap();
    // A raw peer that opens and closes a lease, then idles: it becomes eligible.
    let was_holder = raw_connect(p.broker.socket_name());
    let r = round_trip(&was_holder, &open_req(&h, false));
    assert!(r.ok);
    // A peer that connects and never speaks.
    let silent = raw_connect(p.broker.socket_name());
    wait_until("three connections", Duration::from_secs(1), || {
        p.broker.stats().connections_live == 3
    });
    std::thread::sleep(Duration::from_millis(600));
    assert_eq!(
        p.broker.stats().connections_live,
        2,
        "only the silent peer is gone after 600 ms"
    );
    assert!(
        matches!(raw_recv(&silent), Got::Closed),
        "the broker hung up"
    );
    // The raw lease holder is still served; once its lease is closed it idles out.
    let c = round_trip(&was_holder, &close_req(0, r.lease_key));
    assert!(c.ok, "{}", c.message);
    let took = wait_until(
        "the former lease holder idles out",
        Duration::from_secs(1),
        || p.broker.stats().connections_live == 1,
    );
    eprintln!("idle peer closed {took:?} after its last lease");
    assert!(matches!(raw_recv(&was_holder), Got::Closed));
    std::thread::sleep(Duration::from_millis(400));
    assert_eq!(p.broker.stats().connections_live, 1, "the holder stays");
    holder.close(hp).unwrap();
    assert_eq!(imports_live(&p.pool), 0);
    assert_eq!(p.broker.stats().leases_dropped_on_disconnect, 0);
    drop((silent, was_holder));
    // No thread stuck: the broker stops promptly.
    let t = Instant::now();
    let Producer { broker, pool, .. } = p;
    drop(broker);
    assert!(
        t.elapsed() < Duration::from_secs(1),
        "drop took {:?}",
        t.elapsed()
    );
    pool.free(a.ptr).unwrap();
}

#[test]
fn broker_drop_is_prompt_with_silent_peers_and_a_lease_holder_connected() {
    let _g = SERIAL.lock();
    // The default idle timeout (30 s): nothing times out by itself during this test.
    let p = producer(BrokerConfig::default());
    let a = p.pool.alloc(0, MIB, S).unwrap();
    let h = p.broker.share(a.ptr, MIB).unwrap();
    let holder = raw_connect(p.broker.socket_name());
    assert!(round_trip(&holder, &open_req(&h, false)).ok);
    let silent: Vec<OwnedFd> = (0..20)
        .map(|_| raw_connect(p.broker.socket_name()))
        .collect();
    wait_until("21 connections", Duration::from_secs(2), || {
        p.broker.stats().connections_live == 21
    });
    let Producer { broker, pool, .. } = p;
    let t = Instant::now();
    drop(broker);
    let took = t.elapsed();
    assert!(took < Duration::from_secs(1), "drop took {took:?}");
    assert_eq!(imports_live(&pool), 0, "the lease was closed at drop");
    for s in &silent {
        assert!(matches!(raw_recv(s), Got::Closed));
    }
    assert!(matches!(raw_recv(&holder), Got::Closed));
    pool.free(a.ptr).unwrap();
    pool.validate(0).unwrap();
}

// ---------------------------------------------------------------------------------------
// (4) The connection cap.
// ---------------------------------------------------------------------------------------

#[test]
fn beyond_max_connections_new_peers_are_told_and_closed_existing_ones_work() {
    let _g = SERIAL.lock();
    let p = producer(BrokerConfig {
        max_connections: 2,
        ..BrokerConfig::default()
    });
    let a = p.pool.alloc(0, MIB, S).unwrap();
    let h = p.broker.share(a.ptr, MIB).unwrap();
    let c1 = raw_connect(p.broker.socket_name());
    let c2 = raw_connect(p.broker.socket_name());
    wait_until("two connections", Duration::from_secs(1), || {
        p.broker.stats().connections_live == 2
    });
    // A raw third peer: the refusal arrives unasked, then the hang-up.
    let c3 = raw_connect(p.broker.socket_name());
    let r = raw_recv(&c3).reply();
    assert!(!r.ok);
    assert_eq!(r.message, "too many connections");
    assert!(matches!(raw_recv(&c3), Got::Closed));
    // An importer beyond the cap gets the reason.
    let late = Importer::new(p.sim.clone() as Arc<dyn Backend>);
    let e = late.import(&h).unwrap_err();
    assert!(e.to_string().contains("too many connections"), "{e}");
    assert_eq!(late.stats().imports_live, 0);
    assert_eq!(p.broker.stats().connections_live, 2);
    assert_eq!(imports_live(&p.pool), 0);
    // The two served peers still work.
    for c in [&c1, &c2] {
        let r = round_trip(c, &open_req(&h, false));
        assert!(r.ok, "{}", r.message);
        assert!(round_trip(c, &close_req(0, r.lease_key)).ok);
    }
    // A freed slot is taken by the next peer.
    drop(c2);
    wait_until("one connection", Duration::from_secs(1), || {
        p.broker.stats().connections_live == 1
    });
    let fresh = Importer::new(p.sim.clone() as Arc<dyn Backend>);
    let ptr = fresh.import(&h).unwrap();
    fresh.close(ptr).unwrap();
    assert_eq!(
        p.broker.stats().refused_peers,
        0,
        "refused_peers counts uid refusals only"
    );
    drop((c1, c3));
    p.pool.validate(0).unwrap();
}

/// An importer refused (cap or uid) keeps the connection the broker hung up on: its next
/// import fails on that dead socket instead of connecting again.
#[test]
fn an_importer_refused_at_the_cap_imports_once_a_slot_is_free() {
    let _g = SERIAL.lock();
    let (p, h, first) = full_producer();
    let importer = Importer::new(p.sim.clone() as Arc<dyn Backend>);
    let e = importer.import(&h).unwrap_err();
    assert!(e.to_string().contains("too many connections"), "{e}");
    drop(first);
    wait_until("the slot is free", Duration::from_secs(1), || {
        p.broker.stats().connections_live == 0
    });
    let ptr = importer.import(&h).unwrap();
    importer.close(ptr).unwrap();
}

#[test]
fn silent_refused_peers_do_not_stall_the_accept_loop() {
    let _g = SERIAL.lock();
    let (p, h, first) = full_producer();
    // Twenty peers connect beyond the cap and never speak.
    let flood: Vec<OwnedFd> = (0..20)
        .map(|_| raw_connect(p.broker.socket_name()))
        .collect();
    // The next peer should be told promptly (here: refused; a uid flood would delay an
    // admitted peer the same way, up to the importer's 10 s reply timeout with 50 peers).
    let importer = Importer::new(p.sim.clone() as Arc<dyn Backend>);
    let t = Instant::now();
    let e = importer.import(&h).unwrap_err();
    let took = t.elapsed();
    drop((flood, first));
    assert!(e.to_string().contains("too many connections"), "{e}");
    assert!(
        took < Duration::from_secs(1),
        "the 21st peer waited {took:?} for its answer behind 20 silent refused peers"
    );
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
    gone.socket_name = format!("gpu-arena.{}.0000000000000000", std::process::id());
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
        w.socket_name = name;
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
    let mut op5 = open_req(&h, true);
    op5[0] = 5;
    let r = round_trip(&raw, &op5);
    assert!(!r.ok && r.message.contains("unknown request op 5"), "{r:?}");
    assert_eq!(imports_live(&p.pool), 0);
    assert_eq!(p.broker.stats().bad_requests, 4);
}

// ---------------------------------------------------------------------------------------
// (6) Tokens.
// ---------------------------------------------------------------------------------------

#[test]
fn a_thousand_forged_tokens_are_refused_and_open_nothing() {
    let _g = SERIAL.lock();
    let p = producer(BrokerConfig::default());
    let a = p.pool.alloc(0, 4 * MIB, S).unwrap();
    let h = p.broker.share(a.ptr, MIB).unwrap();
    let importer = Importer::new(p.sim.clone() as Arc<dyn Backend>);
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x70_6b_65_6e);
    let mut refused = 0u64;
    for _ in 0..1000 {
        let mut f = h.clone();
        rng.fill(&mut f.info.token);
        if f.info.token == h.info.token {
            continue;
        }
        let e = importer.import(&f).unwrap_err();
        assert!(e.to_string().contains("wrong token"), "{e}");
        refused += 1;
    }
    // Every single-bit corruption of the real token, over the raw wire.
    let raw = raw_connect(p.broker.socket_name());
    for bit in 0..128 {
        let mut t = h.info.token;
        t[bit / 8] ^= 1 << (bit % 8);
        let r = round_trip(
            &raw,
            &request(
                OPEN,
                true,
                0,
                h.info.share_key,
                h.info.arena_id,
                &t,
                h.info.generation,
            ),
        );
        assert!(!r.ok && r.fds.is_empty(), "bit {bit}: {r:?}");
        refused += 1;
    }
    // All-zero and all-one tokens; the right token on other share keys.
    for t in [[0u8; 16], [0xff; 16]] {
        assert!(
            !round_trip(
                &raw,
                &request(
                    OPEN,
                    true,
                    0,
                    h.info.share_key,
                    h.info.arena_id,
                    &t,
                    h.info.generation
                )
            )
            .ok
        );
        refused += 1;
    }
    for key in (0..64).chain([u32::MAX]).filter(|&k| k != h.info.share_key) {
        let r = round_trip(
            &raw,
            &request(
                OPEN,
                true,
                0,
                key,
                h.info.arena_id,
                &h.info.token,
                h.info.generation,
            ),
        );
        assert!(!r.ok, "key {key}");
        refused += 1;
    }
    assert_eq!(imports_live(&p.pool), 0, "no forged token opened a lease");
    assert_eq!(importer.stats().imports_live, 0);
    assert_eq!(importer.stats().arenas_mapped, 0);
    assert_eq!(p.broker.stats().bad_requests, refused);
    // A revoked share's slot reused by a new share: the old handle's token does not open it.
    p.broker.unshare(&h).unwrap();
    let h2 = p.broker.share(a.ptr + MIB, MIB).unwrap();
    if h2.info.share_key == h.info.share_key {
        let e = importer.import(&h).unwrap_err();
        assert!(e.to_string().contains("wrong token"), "{e}");
    }
    assert_eq!(imports_live(&p.pool), 0);
    // The genuine token still opens.
    let ptr = importer.import(&h2).unwrap();
    assert_eq!(imports_live(&p.pool), 1);
    importer.close(ptr).unwrap();
    assert_eq!(imports_live(&p.pool), 0);
}

// ---------------------------------------------------------------------------------------
// (7) The uid allow-list.
// ---------------------------------------------------------------------------------------

/// The child role: import the handle given on stdin, read its first byte, close, report.
/// Does nothing in a normal test run.
#[test]
fn child() {
    let Ok(role) = std::env::var("GPU_ARENA_SEC_CHILD") else {
        return;
    };
    assert_eq!(role, "import-once");
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    let h = ShareHandle::from_bytes(&unhex(line.trim())).unwrap();
    let backend = Arc::new(SimBackend::new(SimConfig::default()).unwrap());
    let importer = Importer::new(backend.clone());
    match importer.import(&h) {
        Ok(p) => {
            // SAFETY: the import maps the whole arena; p is the first byte of the share.
            let byte = unsafe { *(p as *const u8) };
            importer.close(p).unwrap();
            println!("IMPORTED byte={byte:#x} clean={}", backend.is_clean(0));
        }
        Err(e) => println!("REFUSED {e}"),
    }
    std::io::stdout().flush().unwrap();
}

fn run_as_nobody(exe: &std::path::Path, dir: &std::path::Path, h: &ShareHandle) -> String {
    let out = common::run_child_as_nobody(
        exe,
        dir,
        ("GPU_ARENA_SEC_CHILD", "import-once"),
        &hex(&h.to_bytes()),
    );
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "child failed: {stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
        .lines()
        .find_map(|l| {
            l.find("IMPORTED")
                .or_else(|| l.find("REFUSED"))
                .map(|at| l[at..].to_string())
        })
        .unwrap_or_else(|| panic!("no verdict in child output: {stdout}"))
}

#[test]
fn uid_allow_list_refuses_nobody_by_default_and_admits_it_when_listed() {
    let _g = SERIAL.lock();
    if !rustix::process::geteuid().is_root() {
        eprintln!("not root: cannot start a consumer under another uid; covered where tests run as root (CI)");
        return;
    }
    let (dir, exe) = common::exe_copy_for_nobody("ipc_security");

    let verdicts: Vec<(Vec<u32>, String, u64, u64)> = [vec![], vec![1000, 65534]]
        .into_iter()
        .map(|allowed| {
            let p = producer(BrokerConfig {
                allowed_uids: allowed.clone(),
                ..BrokerConfig::default()
            });
            let a = p.pool.alloc(0, MIB, S).unwrap();
            let bytes = usize::try_from(a.bytes).unwrap();
            // SAFETY: sim pointers are live host mappings of the allocation's size.
            unsafe { std::ptr::write_bytes(a.ptr as *mut u8, 0x3C, bytes) };
            let h = p.broker.share(a.ptr, MIB).unwrap();
            let verdict = run_as_nobody(&exe, &dir, &h);
            wait_until(
                "the child's connection closed",
                Duration::from_secs(2),
                || p.broker.stats().connections_live == 0,
            );
            let refused = p.broker.stats().refused_peers;
            let live = imports_live(&p.pool);
            p.broker.unshare(&h).unwrap();
            p.pool.free(a.ptr).unwrap();
            (allowed, verdict, refused, live)
        })
        .collect();
    let _ = std::fs::remove_dir_all(&dir);
    let (_, v, refused, live) = &verdicts[0];
    assert!(v.starts_with("REFUSED"), "{v}");
    assert!(
        v.contains("uid 65534 is not allowed by this producer (uid 0)"),
        "{v}"
    );
    assert_eq!((*refused, *live), (1, 0));
    let (_, v, refused, live) = &verdicts[1];
    assert_eq!(v, "IMPORTED byte=0x3c clean=true", "listed uid admitted");
    assert_eq!((*refused, *live), (0, 0));
}

// ---------------------------------------------------------------------------------------
// (batches) Ops 3 (open many) and 4 (close many): header `op | 0 0 0 | device i32 |
// count u32 | 0 ...` (44 bytes), then 32-byte open entries `key | generation | arena_id |
// token` or 4-byte lease keys.
// ---------------------------------------------------------------------------------------

fn batch_open(device: i32, hs: &[&ShareHandle]) -> Vec<u8> {
    let mut b = vec![0u8; 44];
    b[0] = 3;
    b[4..8].copy_from_slice(&device.to_le_bytes());
    b[8..12].copy_from_slice(&(hs.len() as u32).to_le_bytes());
    for h in hs {
        b.extend_from_slice(&h.info.share_key.to_le_bytes());
        b.extend_from_slice(&h.info.generation.to_le_bytes());
        b.extend_from_slice(&h.info.arena_id.to_le_bytes());
        b.extend_from_slice(&h.info.token);
    }
    b
}

fn batch_close(device: i32, leases: &[u32]) -> Vec<u8> {
    let mut b = vec![0u8; 44];
    b[0] = 4;
    b[4..8].copy_from_slice(&device.to_le_bytes());
    b[8..12].copy_from_slice(&(leases.len() as u32).to_le_bytes());
    for l in leases {
        b.extend_from_slice(&l.to_le_bytes());
    }
    b
}

fn lease_keys(r: &RawReply) -> Vec<u32> {
    r.message
        .as_bytes()
        .chunks_exact(4)
        .map(|k| u32::from_le_bytes([k[0], k[1], k[2], k[3]]))
        .collect()
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
    // (its only share ended with the unshare: the record is gone)
    assert!(e.to_string().contains("no such share"), "{e}");
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
