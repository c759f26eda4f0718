//! Security tests of the IPC broker's peers on the sim backend: socket naming, silent peers,
//! the connection cap, forged tokens, and the uid allow-list. Malformed traffic (garbage on
//! the wire, version skew, batches) is in `ipc_wire.rs`; both use the raw consumer of
//! `common/raw_wire.rs`.
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
use common::broker_fixture::*;
use common::raw_wire::*;
use common::{hex, unhex, wait_until};

use std::io::Write;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpu_arena::backend::sim::{SimBackend, SimConfig};
use gpu_arena::backend::Backend;
use gpu_arena::ipc::{Broker, BrokerConfig, Importer, ShareHandle};
use gpu_arena::{Error, Pool, PoolConfig};
use rand::{Rng, SeedableRng};

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
        let r = round_trip(&raw, &open_req_as(&h, h.info.share_key, &t));
        assert!(!r.ok && r.fds.is_empty(), "bit {bit}: {r:?}");
        refused += 1;
    }
    // All-zero and all-one tokens; the right token on other share keys.
    for t in [[0u8; 16], [0xff; 16]] {
        assert!(!round_trip(&raw, &open_req_as(&h, h.info.share_key, &t)).ok);
        refused += 1;
    }
    for key in (0..64).chain([u32::MAX]).filter(|&k| k != h.info.share_key) {
        let r = round_trip(&raw, &open_req_as(&h, key, &h.info.token));
        assert!(!r.ok, "key {key}");
        refused += 1;
    }
    assert_eq!(imports_live(&p.pool), 0, "no forged token opened a lease");
    assert_eq!(importer.stats().imports_live, 0);
    assert_eq!(importer.stats().arenas_mapped, 0);
    assert_eq!(p.broker.stats().bad_requests, refused);
    // A revoked share's slot reused by a new share: the old handle's token does not open it,
    // and its holder (who knows the token) is told the true cause.
    p.broker.unshare(&h).unwrap();
    let h2 = p.broker.share(a.ptr + MIB, MIB).unwrap();
    if h2.info.share_key == h.info.share_key {
        let e = importer.import(&h).unwrap_err();
        assert!(e.to_string().contains("was unshared"), "{e}");
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
