//! A **loom model** of the connection mailbox's doorbell handshake
//! (alloc/src/ipc/mailbox.rs: `Mailbox::publish`, the broker's `next_inbound`; the consumer's
//! `hear_mailbox` in connection.rs),
//! abstracted to what decides whether a message can be stranded: the two sequence numbers,
//! the two polling flags, and the socket as one channel each way that carries doorbells.
//!
//! | here | real code |
//! |---|---|
//! | [`publish`] | `Mailbox::publish`: bytes, length, seq store (Release), `fence(SeqCst)`, load of the peer's flag; 0 = send a doorbell (`wire::ring`) |
//! | the polling phase of [`wait`] | the spin loops: look at the peer's seq, now and then `try_recv` on the socket (a doorbell read there is dropped) |
//! | the sleeping phase of [`wait`] | `Mailbox::stop_polling` (flag 0, `fence(SeqCst)`), one more look, then a blocking receive; after each doorbell another look; flag back to 1 once awake |
//!
//! The consumer sends [`ROUNDS`] requests, each waiting for its reply; the broker answers
//! each. Loom runs every interleaving with up to [`PREEMPTIONS`] preemptions (and the
//! weak-memory outcomes it models for fences; unbounded, the search takes minutes):
//! a request or a reply stranded with its reader asleep is a deadlock (both threads blocked
//! on their channels), which loom reports as a failure. The variants without the second look
//! or without the fences show that the model can fail: each leaves a message stranded.
#![allow(clippy::unwrap_used)]

use loom::sync::atomic::{fence, AtomicU64, Ordering};
use loom::sync::mpsc::{channel, Receiver, Sender};
use loom::sync::Arc;
use loom::thread;

/// Requests the consumer sends (and replies the broker sends).
const ROUNDS: u64 = 2;
/// Loom's preemption bound: 3 explores in seconds and finds both broken variants.
const PREEMPTIONS: Option<usize> = Some(3);

/// What the real code does, or one of the mistakes it avoids.
#[derive(Clone, Copy)]
struct Protocol {
    /// `fence(SeqCst)` between a store and the load that must see the peer's store.
    fences: bool,
    /// One more look at the peer's seq after lowering the flag, before sleeping.
    look_again: bool,
}

const REAL: Protocol = Protocol {
    fences: true,
    look_again: true,
};

struct Shared {
    req_seq: AtomicU64,
    rep_seq: AtomicU64,
    broker_polling: AtomicU64,
    consumer_polling: AtomicU64,
}

/// Publish `seq` in `seq_word`; ring the peer if its flag is down.
fn publish(
    p: Protocol,
    seq_word: &AtomicU64,
    peer_flag: &AtomicU64,
    seq: u64,
    doorbell: &Sender<()>,
) {
    seq_word.store(seq, Ordering::Release);
    if p.fences {
        fence(Ordering::SeqCst);
    }
    if peer_flag.load(Ordering::Relaxed) == 0 {
        doorbell.send(()).unwrap();
    }
}

/// Wait until `seq_word` differs from `seen`: poll once (and look at the socket once), then
/// lower `own_flag`, look again, and sleep on the doorbells. Returns the new value.
fn wait(
    p: Protocol,
    seq_word: &AtomicU64,
    own_flag: &AtomicU64,
    seen: u64,
    doorbells: &Receiver<()>,
) -> u64 {
    own_flag.store(1, Ordering::Relaxed);
    let v = seq_word.load(Ordering::Acquire);
    if v != seen {
        return v;
    }
    let _ = doorbells.try_recv(); // a doorbell read while polling is dropped
    own_flag.store(0, Ordering::Relaxed);
    if p.fences {
        fence(Ordering::SeqCst);
    }
    let mut look = p.look_again;
    loop {
        if look {
            let v = seq_word.load(Ordering::Acquire);
            if v != seen {
                own_flag.store(1, Ordering::Relaxed);
                return v;
            }
        }
        look = true;
        doorbells.recv().unwrap();
    }
}

fn handshake(p: Protocol) {
    let shared = Arc::new(Shared {
        req_seq: AtomicU64::new(0),
        rep_seq: AtomicU64::new(0),
        // Both start polling, as `Mailbox::create` / `Mailbox::open` leave them.
        broker_polling: AtomicU64::new(1),
        consumer_polling: AtomicU64::new(1),
    });
    let (to_broker, broker_doorbells) = channel::<()>();
    let (to_consumer, consumer_doorbells) = channel::<()>();
    let broker = {
        let s = shared.clone();
        thread::spawn(move || {
            let mut served = 0;
            for _ in 0..ROUNDS {
                served = wait(p, &s.req_seq, &s.broker_polling, served, &broker_doorbells);
                publish(p, &s.rep_seq, &s.consumer_polling, served, &to_consumer);
            }
            // (Its sender lives to the end: a consumer left asleep is a deadlock.)
            drop(to_consumer);
            (served, broker_doorbells)
        })
    };
    let s = &shared;
    for seq in 1..=ROUNDS {
        publish(p, &s.req_seq, &s.broker_polling, seq, &to_broker);
        let mut answered = seq - 1;
        while answered != seq {
            answered = wait(
                p,
                &s.rep_seq,
                &s.consumer_polling,
                answered,
                &consumer_doorbells,
            );
        }
    }
    let (served, broker_doorbells) = broker.join().unwrap();
    assert_eq!(served, ROUNDS);
    // Doorbells that found their reader awake already are read by nobody: drop them.
    while broker_doorbells.try_recv().is_ok() {}
    while consumer_doorbells.try_recv().is_ok() {}
    drop(to_broker);
}

fn explore(p: Protocol) {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = PREEMPTIONS;
    b.check(move || handshake(p));
}

#[test]
fn no_request_or_reply_is_ever_stranded() {
    explore(REAL);
}

/// The broken variants, each in a child process (this test binary again): loom reports a
/// stranded message as a deadlock, which aborts the process (its blocked threads cannot
/// unwind), so the child's failure and its message are what is checked.
#[test]
fn without_the_second_look_or_the_fences_a_message_is_stranded() {
    const TEST: &str = "without_the_second_look_or_the_fences_a_message_is_stranded";
    if let Ok(variant) = std::env::var("GPU_ARENA_LOOM_MAILBOX_VARIANT") {
        explore(Protocol {
            look_again: variant != "no-second-look",
            fences: variant != "no-fences",
        });
        return;
    }
    for variant in ["no-second-look", "no-fences"] {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", TEST, "--nocapture", "--test-threads=1"])
            .env("GPU_ARENA_LOOM_MAILBOX_VARIANT", variant)
            .env("RUST_BACKTRACE", "0")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{variant}: loom found nothing");
        assert!(stderr.contains("deadlock"), "{variant}: {stderr}");
    }
}
