//! Soak: 10^7 pool operations with sharing between two processes on the sim backend.
//!
//! ```text
//! soak [--ops N] [--sample N] [--seed N]        (producer; default 10^7 ops, sample every 10^6)
//! soak consumer                                 (spawned by the producer)
//! ```
//!
//! The producer owns a sim [`Pool`] and a [`Broker`]; it allocates, frees (deferred while
//! shared), shares and unshares at random, and sends share handles to a consumer process
//! (this binary run again with the `consumer` role) over its stdin. The consumer imports
//! each handle through an [`Importer`] (a real socket round trip and SCM_RIGHTS fd), holds
//! a few imports, and closes them continuously. Every `--sample` producer operations the
//! producer samples its reserved bytes, live exports/shares/leases, and both processes' fd
//! counts (`/proc/self/fd`, `/proc/<consumer>/fd`); at the end it prints the table and
//! checks that none of them grew in the second half of the run beyond the first half's
//! maximum (plus a small slack), then drains everything and checks the sim ledger is clean.
#![allow(clippy::unwrap_used)]

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use gpu_arena::backend::sim::{SimBackend, SimConfig};
use gpu_arena::ipc::{Broker, BrokerConfig, Importer, ShareHandle};
use gpu_arena::{Backend, Pool, PoolConfig, StreamId};

const MIB: u64 = 1 << 20;
/// Imports the consumer keeps open before closing the oldest.
const CONSUMER_HOLD: usize = 4;
/// Handles sent and not yet handled by the consumer.
const MAX_IN_FLIGHT: u64 = 16;

struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) % n
    }
}

fn fds(path: &str) -> u64 {
    std::fs::read_dir(path).map_or(0, |d| d.count() as u64)
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn consumer() -> ExitCode {
    let backend: Arc<dyn Backend> = Arc::new(SimBackend::new(SimConfig::default()).unwrap());
    let importer = Importer::new(backend);
    let mut held: VecDeque<u64> = VecDeque::new();
    let (mut imports, mut refusals, mut closes) = (0u64, 0u64, 0u64);
    let mut out = std::io::stdout().lock();
    for line in std::io::stdin().lock().lines() {
        let line = line.unwrap();
        if line == "END" {
            break;
        }
        let h = ShareHandle::from_bytes(&unhex(&line)).unwrap();
        match importer.import(&h) {
            Ok(p) => {
                imports += 1;
                held.push_back(p);
            }
            // Unshared before we got to it: new imports are refused, as they must be.
            Err(_) => refusals += 1,
        }
        while held.len() > CONSUMER_HOLD {
            importer.close(held.pop_front().unwrap()).unwrap();
            closes += 1;
        }
        writeln!(out, "D").unwrap();
        out.flush().unwrap();
    }
    for p in held.drain(..) {
        importer.close(p).unwrap();
        closes += 1;
    }
    let st = importer.stats();
    writeln!(
        out,
        "DONE imports={imports} refusals={refusals} closes={closes} live={} mapped={} fds={}",
        st.imports_live,
        st.arenas_mapped,
        fds("/proc/self/fd")
    )
    .unwrap();
    ExitCode::SUCCESS
}

/// A bounded quantity: name, how to read it from a sample, allowed slack.
type Check = (&'static str, fn(&Sample) -> u64, u64);

struct Sample {
    ops: u64,
    secs: f64,
    reserved: u64,
    arenas: u64,
    exports: u64,
    shares: u64,
    leases: u64,
    deferred: u64,
    prod_fds: u64,
    cons_fds: u64,
    handled: u64,
}

fn arg(args: &[String], name: &str, default: u64) -> u64 {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map_or(default, |v| v.replace('_', "").parse().unwrap())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("consumer") {
        return consumer();
    }
    let total = arg(&args, "--ops", 10_000_000);
    let every = arg(&args, "--sample", 1_000_000).max(1);
    let mut rng = Rng(arg(&args, "--seed", 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);

    let sim = Arc::new(SimBackend::new(SimConfig::default()).unwrap());
    let pool = Arc::new(
        Pool::new(
            sim.clone(),
            PoolConfig {
                arena_size: 64 * MIB,
                validate: false,
                ..PoolConfig::default()
            },
        )
        .unwrap(),
    );
    let broker = Broker::start(pool.clone(), BrokerConfig::default()).unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .arg("consumer")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let cpid = child.id();
    let cons_fd_dir = format!("/proc/{cpid}/fd");
    let mut to_consumer = std::io::BufWriter::new(child.stdin.take().unwrap());
    let handled = Arc::new(AtomicU64::new(0));
    let reader = {
        let handled = handled.clone();
        let stdout = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            let mut done = String::new();
            for line in BufReader::new(stdout).lines() {
                let line = line.unwrap();
                if line == "D" {
                    handled.fetch_add(1, Ordering::Release);
                } else if line.starts_with("DONE") {
                    done = line;
                }
            }
            done
        })
    };

    let streams = [StreamId(0), StreamId(5), StreamId(9)];
    let mut live: Vec<(u64, u64)> = Vec::new();
    // Each share with the sequence number of its handle sent to the consumer, if sent.
    let mut shares: VecDeque<(ShareHandle, Option<u64>)> = VecDeque::new();
    let (mut sent, mut ops) = (0u64, 0u64);
    let (mut allocs, mut frees, mut shares_made, mut unshares) = (0u64, 0u64, 0u64, 0u64);
    let mut samples: Vec<Sample> = Vec::new();
    let t0 = Instant::now();
    let sample = |ops: u64| {
        let s = pool.stats(0).unwrap();
        Sample {
            ops,
            secs: t0.elapsed().as_secs_f64(),
            reserved: s.reserved_bytes,
            arenas: s.arenas,
            exports: s.exports_live,
            shares: s.shares_live,
            leases: s.imports_live,
            deferred: s.deferred_free_bytes,
            prod_fds: fds("/proc/self/fd"),
            cons_fds: fds(&cons_fd_dir),
            handled: 0,
        }
    };
    while ops < total {
        match rng.below(100) {
            0..=34 if live.len() < 256 => {
                let req = 1 + match rng.below(8) {
                    0 => rng.below(4 * MIB),
                    _ => rng.below(64 << 10),
                };
                let s = streams[rng.below(3) as usize];
                let a = pool.alloc(0, req, s).unwrap();
                if rng.below(16) == 0 {
                    pool.record_stream(a.ptr, streams[rng.below(3) as usize])
                        .unwrap();
                }
                live.push((a.ptr, req.next_multiple_of(512)));
                allocs += 1;
            }
            0..=64 if !live.is_empty() => {
                let (p, _) = live.swap_remove(rng.below(live.len() as u64) as usize);
                pool.free(p).unwrap(); // deferred when shared
                frees += 1;
            }
            65..=84 if !live.is_empty() && shares.len() < 64 => {
                let (p, b) = live[rng.below(live.len() as u64) as usize];
                let h = broker.share(p, 1 + rng.below(b)).unwrap();
                let mut seq = None;
                if sent - handled.load(Ordering::Acquire) < MAX_IN_FLIGHT {
                    writeln!(to_consumer, "{}", hex(&h.to_bytes())).unwrap();
                    to_consumer.flush().unwrap();
                    seq = Some(sent);
                    sent += 1;
                }
                shares.push_back((h, seq));
                shares_made += 1;
            }
            85..=99 if !shares.is_empty() => {
                // The oldest share the consumer is not about to import (a handle it has not
                // handled yet stays shared, so most imports succeed).
                let h = handled.load(Ordering::Acquire);
                let Some(i) = shares.iter().position(|(_, q)| q.is_none_or(|q| q < h)) else {
                    continue;
                };
                let (share, _) = shares.remove(i).unwrap();
                broker.unshare(&share).unwrap();
                unshares += 1;
            }
            _ => continue,
        }
        ops += 1;
        if ops % every == 0 {
            let mut s = sample(ops);
            s.handled = handled.load(Ordering::Acquire);
            samples.push(s);
        }
    }
    let wall = t0.elapsed();

    // Drain: the consumer closes everything and exits; the producer unshares and frees.
    writeln!(to_consumer, "END").unwrap();
    to_consumer.flush().unwrap();
    drop(to_consumer);
    let status = child.wait().unwrap();
    let done = reader.join().unwrap();
    for (h, _) in shares.drain(..) {
        broker.unshare(&h).unwrap();
    }
    for (p, _) in live.drain(..) {
        pool.free(p).unwrap();
    }
    // Leases of a consumer that exited are closed by the broker when its connection ends.
    let t = Instant::now();
    while pool.stats(0).unwrap().imports_live > 0 && t.elapsed().as_secs() < 10 {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    pool.empty_cache(None).unwrap();
    pool.validate(0).unwrap();
    let end = pool.stats(0).unwrap();
    let broker_stats = broker.stats();
    drop(broker);
    let ledger = sim.ledger(0);

    println!(
        "soak: {ops} producer pool operations in {wall:.2?} ({:.0} ops/s)",
        ops as f64 / wall.as_secs_f64()
    );
    println!("producer ops: alloc {allocs}, free {frees}, share {shares_made}, unshare {unshares}; handles sent to the consumer {sent}");
    println!("consumer: {done}; exit {status}");
    println!();
    println!("| ops | s | reserved MiB | arenas | exports live | shares live | leases live | deferred MiB | producer fds | consumer fds | handles handled |");
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for s in &samples {
        println!(
            "| {} | {:.1} | {} | {} | {} | {} | {} | {:.1} | {} | {} | {} |",
            s.ops,
            s.secs,
            s.reserved / MIB,
            s.arenas,
            s.exports,
            s.shares,
            s.leases,
            s.deferred as f64 / MIB as f64,
            s.prod_fds,
            s.cons_fds,
            s.handled
        );
    }
    println!();
    println!(
        "end (after drain + empty_cache): reserved {} B, arenas {}, exports {}, shares {}, leases {}, allocations {}; broker {:?}; sim ledger clean: {}",
        end.reserved_bytes, end.arenas, end.exports_live, end.shares_live, end.imports_live,
        end.allocations, broker_stats, ledger.is_clean()
    );

    // Bounded: the second half never exceeds the first half's maximum (plus slack).
    let mut ok = status.success() && ledger.is_clean() && end.reserved_bytes == 0;
    let half = samples.len() / 2;
    if half > 0 {
        let (first, second) = samples.split_at(half);
        let max = |v: &[Sample], f: fn(&Sample) -> u64| v.iter().map(f).max().unwrap_or(0);
        let checks: [Check; 5] = [
            ("reserved bytes", |s| s.reserved, 2 * 64 * MIB),
            ("producer fds", |s| s.prod_fds, 8),
            ("consumer fds", |s| s.cons_fds, 8),
            ("exports live", |s| s.exports, 8),
            ("leases live", |s| s.leases, CONSUMER_HOLD as u64 + 2),
        ];
        for (name, f, slack) in checks {
            let (a, b) = (max(first, f), max(second, f));
            let bounded = b <= a + slack;
            println!(
                "bounded {name}: first-half max {a}, second-half max {b}: {}",
                if bounded { "ok" } else { "GREW" }
            );
            ok &= bounded;
        }
    }
    if ok {
        println!("soak: PASS");
        ExitCode::SUCCESS
    } else {
        println!("soak: FAIL");
        ExitCode::FAILURE
    }
}
