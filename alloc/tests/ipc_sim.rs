//! Sharing on the sim backend, with real processes: export once per arena, leases, deferred
//! frees, SIGKILLed consumers and producers, bad handles, legacy pinning.
//!
//! Child processes are this test binary run again with `GPU_ARENA_CHILD` set: the `child`
//! test below then plays the consumer or producer role and talks over stdin/stdout.
#![allow(clippy::unwrap_used)]

mod common;
use common::{fd_count, hex, unhex, wait_until};

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use gpu_arena::backend::sim::{SimBackend, SimCall, SimConfig};
use gpu_arena::backend::{Backend, ExportKind};
use gpu_arena::ipc::{Broker, BrokerConfig, Importer, ShareHandle};
use gpu_arena::{Error, Pool, PoolConfig, StreamId};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const S: StreamId = StreamId(7);

/// fd counts are per process: tests that count them must not overlap.
static SERIAL: parking_lot::Mutex<()> = parking_lot::Mutex::new(());

fn producer(sim: SimConfig, arena_size: u64) -> (Arc<SimBackend>, Arc<Pool>, Broker) {
    let backend = Arc::new(SimBackend::new(sim).unwrap());
    let pool = common::validating_pool(&backend, arena_size);
    let broker = Broker::start(pool.clone(), BrokerConfig::default()).unwrap();
    (backend, pool, broker)
}

fn spawn_child(role: &str) -> (Child, BufReader<std::process::ChildStdout>) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child", "--nocapture", "--test-threads=1"])
        .env("GPU_ARENA_CHILD", role)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let out = BufReader::new(child.stdout.take().unwrap());
    (child, out)
}

fn read_line_starting(out: &mut BufReader<std::process::ChildStdout>, prefix: &str) -> String {
    let mut line = String::new();
    loop {
        line.clear();
        assert!(
            out.read_line(&mut line).unwrap() > 0,
            "child exited before `{prefix}`"
        );
        // libtest prints "test child ... " without a newline before the child's own lines.
        if let Some(at) = line.find(prefix) {
            return line[at + prefix.len()..].trim().to_string();
        }
    }
}

/// The child roles. Does nothing in a normal test run.
#[test]
fn child() {
    let Ok(role) = std::env::var("GPU_ARENA_CHILD") else {
        return;
    };
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    match role.as_str() {
        // Import every handle given on stdin, check the producer's bytes, write ours, say
        // READY, then close all (or wait to be killed) and report the fd count.
        "consumer" | "consumer-hold" => {
            let backend = Arc::new(SimBackend::new(SimConfig::default()).unwrap());
            let importer = Importer::new(backend.clone());
            let fds_before = fd_count();
            let handles: Vec<ShareHandle> = lines
                .next()
                .unwrap()
                .unwrap()
                .split(',')
                .map(|h| ShareHandle::from_bytes(&unhex(h)).unwrap())
                .collect();
            let mut ptrs = Vec::new();
            for (i, h) in handles.iter().enumerate() {
                let p = importer.import(h).unwrap();
                // SAFETY: the import maps the whole arena; [p, p + len) lies inside it.
                unsafe {
                    assert_eq!(*(p as *const u8), (i % 251) as u8, "producer's byte");
                    *((p + 1) as *mut u8) = 0xC0;
                }
                ptrs.push(p);
            }
            let st = importer.stats();
            println!(
                "READY imports={} arenas={}",
                st.imports_live, st.arenas_mapped
            );
            if role == "consumer-hold" {
                std::thread::sleep(Duration::from_secs(600));
            }
            for p in ptrs {
                importer.close(p).unwrap();
            }
            assert!(matches!(
                importer.close(12345),
                Err(Error::UnknownPointer { .. })
            ));
            println!(
                "CLOSED fds_before={fds_before} fds_after={} clean={}",
                fd_count(),
                backend.is_clean(0)
            );
        }
        // Allocate, fill, share and print the handle; then wait to be killed.
        "producer" => {
            let (_b, pool, broker) = producer(SimConfig::default(), 64 * MIB);
            let a = pool.alloc(0, 4 * MIB, S).unwrap();
            // SAFETY: sim pointers are live host mappings of the allocation's size.
            unsafe { std::ptr::write_bytes(a.ptr as *mut u8, 0x5A, a.bytes as usize) };
            let h = broker.share(a.ptr, a.bytes).unwrap();
            println!("HANDLE {}", hex(&h.to_bytes()));
            std::thread::sleep(Duration::from_secs(600));
        }
        other => panic!("unknown child role {other}"),
    }
}

#[test]
fn share_import_write_read_in_process_then_everything_returns() {
    let _g = SERIAL.lock();
    let (sim, pool, broker) = producer(SimConfig::default(), 64 * MIB);
    let fds = fd_count();
    let a = pool.alloc(0, 8 * MIB, S).unwrap();
    // SAFETY: sim pointers are live host mappings of the allocation's size.
    unsafe { std::ptr::write_bytes(a.ptr as *mut u8, 0x11, a.bytes as usize) };
    let h = broker.share(a.ptr + MIB, 2 * MIB).unwrap();
    let h = ShareHandle::from_bytes(&h.to_bytes()).unwrap();
    let importer = Importer::new(sim.clone() as Arc<dyn Backend>);
    let p = importer.import(&h).unwrap();
    assert_ne!(p, a.ptr + MIB, "a second mapping of the same memory");
    // SAFETY: p maps [a.ptr + 1 MiB, +2 MiB) of the producer's allocation.
    unsafe {
        assert_eq!(*(p as *const u8), 0x11);
        *(p as *mut u8) = 0x22;
        assert_eq!(
            *((a.ptr + MIB) as *const u8),
            0x22,
            "the consumer's write is visible"
        );
    }
    let s = pool.stats(0).unwrap();
    assert_eq!((s.exports_live, s.shares_live, s.imports_live), (1, 1, 1));
    // The producer frees while shared: deferred.
    pool.free(a.ptr).unwrap();
    assert_eq!(pool.stats(0).unwrap().deferred_free_bytes, 8 * MIB);
    broker.unshare(&h).unwrap();
    assert!(importer.import(&h).is_err(), "import after unshare");
    // SAFETY: still mapped: the lease holds the memory.
    unsafe { assert_eq!(*(p as *const u8), 0x22) };
    importer.close(p).unwrap();
    assert!(
        matches!(importer.close(p), Err(Error::UnknownPointer { .. })),
        "double close"
    );
    let s = pool.stats(0).unwrap();
    assert_eq!(
        (
            s.exports_live,
            s.shares_live,
            s.imports_live,
            s.deferred_free_bytes
        ),
        (0, 0, 0, 0)
    );
    pool.empty_cache(None).unwrap();
    pool.validate(0).unwrap();
    wait_until("broker connection closed", Duration::from_secs(2), || {
        broker.stats().connections_live == 0
    });
    assert_eq!(fd_count(), fds, "no fd leaked");
    assert!(sim.is_clean(0), "{:?}", sim.ledger(0));
}

/// 10,000 small blocks (48 KiB, below `LARGE_MIN`): small blocks live in 2 MiB arenas of
/// their own (42 blocks each), one export per arena touched, never one per block.
#[test]
fn exports_equal_arenas_10000_small_blocks_in_239_arenas() {
    let _g = SERIAL.lock();
    let backend = Arc::new(SimBackend::new(SimConfig::default()).unwrap());
    let config = PoolConfig {
        arena_size: 100 * MIB,
        validate: false, // a full walk after each of 20,000 operations would dominate
        ..PoolConfig::default()
    };
    let pool = Arc::new(Pool::new(backend.clone(), config).unwrap());
    let broker = Broker::start(pool.clone(), BrokerConfig::default()).unwrap();
    let sim = backend;
    let blocks: Vec<_> = (0..10_000)
        .map(|_| pool.alloc(0, 48 * 1024, S).unwrap())
        .collect();
    assert_eq!(
        pool.stats(0).unwrap().arenas,
        239,
        "10,000 x 48 KiB fill 239 2 MiB small arenas (42 blocks each)"
    );
    let exports_before = sim.calls(SimCall::Export);
    let handles: Vec<_> = blocks
        .iter()
        .map(|b| broker.share(b.ptr, b.bytes).unwrap())
        .collect();
    let s = pool.stats(0).unwrap();
    assert_eq!(
        (s.exports_total, s.exports_live, s.shares_live),
        (239, 239, 10_000)
    );
    // One more driver export is the once-per-device self-test (export, close, destroy).
    assert_eq!(sim.calls(SimCall::Export) - exports_before, 240);
    for h in &handles {
        broker.unshare(h).unwrap();
    }
    for b in &blocks {
        pool.free(b.ptr).unwrap();
    }
    assert_eq!(pool.stats(0).unwrap().exports_live, 0);
    pool.empty_cache(None).unwrap();
    assert!(sim.is_clean(0));
}

#[test]
fn consumer_process_reads_writes_and_closes_cleanly() {
    let _g = SERIAL.lock();
    let (sim, pool, broker) = producer(SimConfig::default(), 64 * MIB);
    let a = pool.alloc(0, 16 * MIB, S).unwrap();
    let hs: Vec<String> = (0..10)
        .map(|i| {
            let p = a.ptr + i * MIB;
            // SAFETY: inside the allocation.
            unsafe { *(p as *mut u8) = (i % 251) as u8 };
            hex(&broker.share(p, MIB).unwrap().to_bytes())
        })
        .collect();
    let (mut child, mut out) = spawn_child("consumer");
    writeln!(child.stdin.as_mut().unwrap(), "{}", hs.join(",")).unwrap();
    assert_eq!(
        read_line_starting(&mut out, "READY"),
        "imports=10 arenas=1",
        "one mapping for the arena"
    );
    let closed = read_line_starting(&mut out, "CLOSED");
    assert!(child.wait().unwrap().success());
    let f: Vec<&str> = closed.split(' ').collect();
    assert_eq!(
        f[0].replace("fds_before=", ""),
        f[1].replace("fds_after=", ""),
        "consumer fds: {closed}"
    );
    assert_eq!(f[2], "clean=true");
    for i in 0..10 {
        // SAFETY: inside the allocation.
        let byte = unsafe { *((a.ptr + i * MIB + 1) as *const u8) };
        assert_eq!(byte, 0xC0, "the consumer's write");
    }
    assert_eq!(pool.stats(0).unwrap().imports_live, 0);
    drop(broker);
    pool.free(a.ptr).unwrap();
    drop(pool);
    assert!(sim.is_clean(0));
}

#[test]
fn sigkilled_consumer_holding_100_shares_gives_everything_back_within_1s() {
    let _g = SERIAL.lock();
    let (sim, pool, broker) = producer(SimConfig::default(), 256 * MIB);
    let fds = fd_count();
    let a = pool.alloc(0, 200 * MIB, S).unwrap();
    let handles: Vec<ShareHandle> = (0..100u64)
        .map(|i| {
            let p = a.ptr + i * 2 * MIB;
            // SAFETY: inside the allocation.
            unsafe { *(p as *mut u8) = (i % 251) as u8 };
            broker.share(p, 2 * MIB).unwrap()
        })
        .collect();
    let (mut child, mut out) = spawn_child("consumer-hold");
    let line: Vec<String> = handles.iter().map(|h| hex(&h.to_bytes())).collect();
    writeln!(child.stdin.as_mut().unwrap(), "{}", line.join(",")).unwrap();
    assert_eq!(
        read_line_starting(&mut out, "READY"),
        "imports=100 arenas=1"
    );
    assert_eq!(pool.stats(0).unwrap().imports_live, 100);
    // The producer revokes and frees while the consumer still maps everything.
    for h in &handles {
        broker.unshare(h).unwrap();
    }
    pool.free(a.ptr).unwrap();
    let s = pool.stats(0).unwrap();
    assert_eq!(
        (s.exports_live, s.deferred_free_bytes),
        (1, 200 * MIB),
        "held by the leases"
    );
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    drop((child, out)); // the test's own pipes to the child
    let took = wait_until(
        "leases dropped and export closed",
        Duration::from_secs(1),
        || {
            let s = pool.stats(0).unwrap();
            s.imports_live == 0 && s.exports_live == 0 && s.deferred_free_bytes == 0
        },
    );
    eprintln!("leases dropped and export closed {took:?} after SIGKILL");
    wait_until("connection gone", Duration::from_secs(1), || {
        broker.stats().connections_live == 0
    });
    assert_eq!(broker.stats().leases_dropped_on_disconnect, 100);
    let reserved = pool.stats(0).unwrap().reserved_bytes;
    assert!(reserved >= 200 * MIB);
    assert_eq!(
        pool.empty_cache(None).unwrap(),
        reserved,
        "the arena is destroyed"
    );
    wait_until("connection gone", Duration::from_secs(1), || {
        broker.stats().connections_live == 0
    });
    assert_eq!(fd_count(), fds, "producer fds back to baseline");
    assert!(sim.is_clean(0), "{:?}", sim.ledger(0));
}

#[test]
fn sigkilled_producer_leaves_the_consumer_mapping_valid_and_closable() {
    let _g = SERIAL.lock();
    let backend = Arc::new(SimBackend::new(SimConfig::default()).unwrap());
    let importer = Importer::new(backend.clone());
    let fds = fd_count();
    let (mut child, mut out) = spawn_child("producer");
    let h = ShareHandle::from_bytes(&unhex(&read_line_starting(&mut out, "HANDLE"))).unwrap();
    let p = importer.import(&h).unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    drop((child, out)); // the test's own pipes to the child
                        // SAFETY: the mapping outlives the producer.
    unsafe {
        assert_eq!(*(p as *const u8), 0x5A);
        assert_eq!(*((p + 4 * MIB - 1) as *const u8), 0x5A);
    }
    importer.close(p).unwrap();
    assert_eq!(importer.stats(), Default::default());
    assert!(backend.is_clean(0), "{:?}", backend.ledger(0));
    assert_eq!(fd_count(), fds);
    let e = importer.import(&h).unwrap_err();
    assert!(e.to_string().contains("unreachable"), "{e}");
}

#[test]
fn bad_handles_and_bad_shares_get_clear_errors() {
    let _g = SERIAL.lock();
    let (sim, pool, broker) = producer(SimConfig::default(), 64 * MIB);
    let importer = Importer::new(sim.clone() as Arc<dyn Backend>);
    let a = pool.alloc(0, 4 * MIB, S).unwrap();
    let h = broker.share(a.ptr, 4 * MIB).unwrap();
    // Forged token.
    let mut forged = h.clone();
    forged.info.token[0] ^= 1;
    let e = importer.import(&forged).unwrap_err();
    assert!(e.to_string().contains("wrong token"), "{e}");
    // Out of bounds.
    assert!(broker.share(a.ptr, 4 * MIB + 512).is_err());
    assert!(broker.share(a.ptr + 4 * MIB, 512).is_err());
    assert!(broker.share(0x1000, 512).is_err());
    assert!(broker.share(a.ptr, 0).is_err());
    // Unknown producer.
    let mut elsewhere = h.clone();
    elsewhere.socket_name = "gpu-arena.nobody.here".into();
    let e = importer.import(&elsewhere).unwrap_err();
    assert!(e.to_string().contains("unreachable"), "{e}");
    // A socket served by another pid than the handle says.
    let mut wrong_pid = h.clone();
    wrong_pid.producer_pid = 1;
    let e = importer.import(&wrong_pid).unwrap_err();
    assert!(e.to_string().contains("served by pid"), "{e}");
    // Version skew and garbage.
    let mut bytes = h.to_bytes();
    bytes[8] = 9;
    assert!(ShareHandle::from_bytes(&bytes)
        .unwrap_err()
        .to_string()
        .contains("version"));
    // Import after unshare; unshare twice.
    broker.unshare(&h).unwrap();
    let e = importer.import(&h).unwrap_err();
    assert!(e.to_string().contains("was unshared"), "{e}");
    assert!(broker
        .unshare(&h)
        .unwrap_err()
        .to_string()
        .contains("already unshared"));
    // Its slot taken by a new share, the old handle is still refused as unshared (the true
    // cause), and a forged token learns nothing.
    let h2 = broker.share(a.ptr, 512).unwrap();
    assert_eq!(h2.info.share_key, h.info.share_key, "the slot is reused");
    let e = importer.import(&h).unwrap_err();
    assert!(e.to_string().contains("was unshared"), "{e}");
    let mut forged = h.clone();
    forged.info.token[0] ^= 1;
    let e = importer.import(&forged).unwrap_err();
    assert!(
        e.to_string()
            .contains("no such share (unknown key or wrong token)"),
        "{e}"
    );
    broker.unshare(&h2).unwrap();
    assert_eq!(pool.stats(0).unwrap().exports_live, 0);
    pool.free(a.ptr).unwrap();
    pool.validate(0).unwrap();
}

#[test]
fn peer_of_another_uid_is_refused() {
    let _g = SERIAL.lock();
    if !rustix::process::geteuid().is_root() {
        eprintln!("not root: cannot start a consumer under another uid; covered where tests run as root (CI)");
        return;
    }
    let (_sim, pool, broker) = producer(SimConfig::default(), 64 * MIB);
    let a = pool.alloc(0, MIB, S).unwrap();
    let h = broker.share(a.ptr, MIB).unwrap();
    let (dir, exe) = common::exe_copy_for_nobody("ipc_sim");
    let out = common::run_child_as_nobody(
        &exe,
        &dir,
        ("GPU_ARENA_CHILD", "consumer"),
        &hex(&h.to_bytes()),
    );
    let _ = std::fs::remove_dir_all(&dir);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("uid 65534 is not allowed"),
        "child stderr: {stderr}"
    );
    assert_eq!(broker.stats().refused_peers, 1);
    assert_eq!(pool.stats(0).unwrap().imports_live, 0);
}

#[test]
fn legacy_pin_arenas_are_recycled_while_naive_export_per_allocation_grows() {
    let _g = SERIAL.lock();
    let capacity = 64 * GIB;
    let sim = SimConfig {
        capacity,
        legacy_pin: true,
        ..SimConfig::default()
    };
    // gpu-arena: 10 cycles of "KV cache of half the capacity, share it, free it, empty_cache",
    // in fixed 1 GiB arenas and in growing ones (the default).
    for grow in [false, true] {
        pinned_arenas_are_recycled(&sim, grow);
    }
    // The naive flow: one export per allocation, never ended (it cannot be), then free.
    let naive = SimBackend::new(sim).unwrap();
    let mut naive_held = Vec::new();
    let mut oom_at = None;
    for cycle in 0..10 {
        let mut ok = true;
        for _ in 0..(capacity / 2 / (256 * MIB)) {
            match naive.create_arena(0, 256 * MIB) {
                Ok(mem) => {
                    let e = naive.export(&mem).unwrap();
                    naive.close_export(&mem, e).unwrap();
                    naive.destroy_arena(mem).unwrap();
                }
                Err(_) => {
                    ok = false;
                    break;
                }
            }
        }
        naive_held.push(naive.ledger(0).held_bytes);
        if !ok {
            oom_at = Some(cycle + 1);
            break;
        }
    }
    eprintln!(
        "naive held per cycle (GiB): {:?}, out of memory in cycle {oom_at:?}",
        naive_held.iter().map(|h| h / GIB).collect::<Vec<_>>()
    );
    assert!(naive_held[1] > naive_held[0], "naive grows every cycle");
    assert_eq!(oom_at, Some(3), "and runs out of memory in cycle 3");
}

/// 10 cycles of "KV cache of half the capacity, share it, free it, empty_cache" on a device
/// whose exports pin (`sim`): the pinned arenas are recycled, so what the device holds stops
/// growing after the first cycle. In growing arenas when `grow`, else fixed 1 GiB ones.
fn pinned_arenas_are_recycled(sim: &SimConfig, grow: bool) {
    let capacity = sim.capacity;
    let backend = Arc::new(SimBackend::new(sim.clone()).unwrap());
    let config = PoolConfig {
        arena_size: GIB,
        validate: true,
        grow_arenas: grow,
        ..PoolConfig::default()
    };
    let pool = Arc::new(Pool::new(backend.clone(), config).unwrap());
    let broker = Broker::start(pool.clone(), BrokerConfig::default()).unwrap();
    assert_eq!(
        pool.export_semantics(0).unwrap(),
        ExportKind::Pinning,
        "the self-test detects pinning"
    );
    let mut held = Vec::new();
    for _cycle in 0..10 {
        let blocks: Vec<_> = (0..(capacity / 2 / (256 * MIB)))
            .map(|_| pool.alloc(0, 256 * MIB, S).unwrap())
            .collect();
        let hs: Vec<_> = blocks
            .iter()
            .map(|b| broker.share(b.ptr, b.bytes).unwrap())
            .collect();
        for h in &hs {
            broker.unshare(h).unwrap();
        }
        for b in &blocks {
            pool.free(b.ptr).unwrap();
        }
        pool.empty_cache(None).unwrap();
        held.push(backend.ledger(0).held_bytes);
    }
    eprintln!(
        "gpu-arena (grow_arenas={grow}) held per cycle (GiB): {:?}",
        held.iter().map(|h| h / GIB).collect::<Vec<_>>()
    );
    assert_eq!(
        held[9], held[0],
        "no growth after cycle 1 (grow_arenas={grow})"
    );
    assert_eq!(pool.stats(0).unwrap().pinned_bytes, capacity / 2);
}

/// A "producer" socket that accepts connections and never answers (a hung producer).
fn silent_broker(name: &str) -> std::os::fd::OwnedFd {
    let s = common::seqpacket_socket();
    let addr = rustix::net::SocketAddrUnix::new_abstract_name(name.as_bytes()).unwrap();
    rustix::net::bind(&s, &addr).unwrap();
    rustix::net::listen(&s, 8).unwrap();
    s
}

#[test]
fn a_producer_that_never_answers_delays_only_its_own_imports() {
    // Serialized with the others: its sockets would move their process-wide fd counts.
    let _g = SERIAL.lock();
    let (sim, pool, broker) = producer(SimConfig::default(), 64 * MIB);
    let importer = Arc::new(Importer::new(sim.clone() as Arc<dyn Backend>));
    let a = pool.alloc(0, 4 * MIB, S).unwrap();
    let h = broker.share(a.ptr, 4 * MIB).unwrap();
    // The same handle, pointed at a socket of this process that never replies.
    let hung_name = format!("gpu-arena.test-hung.{}", std::process::id());
    let _hung = silent_broker(&hung_name);
    let mut hung = h.clone();
    hung.socket_name = hung_name.into();
    let stuck = {
        let importer = importer.clone();
        std::thread::spawn(move || {
            let t = std::time::Instant::now();
            (importer.import(&hung), t.elapsed())
        })
    };
    std::thread::sleep(Duration::from_millis(200)); // the stuck import waits for its reply
    let t = std::time::Instant::now();
    let p = importer.import(&h).unwrap();
    importer.close(p).unwrap();
    let took = t.elapsed();
    assert!(
        took < Duration::from_secs(2),
        "an import and close from a healthy producer took {took:?} behind a hung one"
    );
    let (stuck_result, waited) = stuck.join().unwrap();
    let e = stuck_result.unwrap_err();
    assert!(e.to_string().contains("did not answer"), "{e}");
    assert!(waited >= Duration::from_secs(5), "gave up after {waited:?}");
    // Nothing is left of either: no import, no mapping, no connection.
    let st = importer.stats();
    assert_eq!((st.imports_live, st.arenas_mapped, st.producers), (0, 0, 0));
    broker.unshare(&h).unwrap();
    pool.free(a.ptr).unwrap();
    pool.validate(0).unwrap();
}

#[test]
fn concurrent_imports_and_closes_of_one_arena_map_it_once_and_leave_nothing() {
    let _g = SERIAL.lock();
    let (sim, pool, broker) = producer(SimConfig::default(), 64 * MIB);
    let fds = fd_count();
    let importer = Arc::new(Importer::new(sim.clone() as Arc<dyn Backend>));
    // Eight 2 MiB allocations in one (large) arena, each filled with its index.
    let allocs: Vec<_> = (0..8u8)
        .map(|i| {
            let a = pool.alloc(0, 2 * MIB, S).unwrap();
            // SAFETY: sim pointers are live host mappings of the allocation's size.
            unsafe { std::ptr::write_bytes(a.ptr as *mut u8, i, a.bytes as usize) };
            a
        })
        .collect();
    let handles: Vec<_> = allocs
        .iter()
        .map(|a| broker.share(a.ptr, MIB).unwrap())
        .collect();
    let threads: Vec<_> = handles
        .iter()
        .enumerate()
        .map(|(i, h)| {
            let (importer, h) = (importer.clone(), h.clone());
            std::thread::spawn(move || {
                for _ in 0..200 {
                    let p = importer.import(&h).unwrap();
                    // SAFETY: p maps the 1 MiB allocation `i`, filled with `i`.
                    let v = unsafe { *((p + MIB - 1) as *const u8) };
                    assert_eq!(v, i as u8, "import of share {i} reads another range");
                    assert!(importer.stats().arenas_mapped <= 1, "arena mapped twice");
                    importer.close(p).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let st = importer.stats();
    assert_eq!((st.imports_live, st.arenas_mapped, st.producers), (0, 0, 0));
    for h in &handles {
        broker.unshare(h).unwrap();
    }
    for a in &allocs {
        pool.free(a.ptr).unwrap();
    }
    assert_eq!(pool.stats(0).unwrap().imports_live, 0);
    pool.empty_cache(None).unwrap();
    wait_until("broker connection closed", Duration::from_secs(2), || {
        broker.stats().connections_live == 0
    });
    assert_eq!(fd_count(), fds, "no fd leaked");
    assert!(sim.is_clean(0), "{:?}", sim.ledger(0));
}
