//! A connection's shared-memory mailbox: requests that need no fd in their reply (imports of
//! arenas the consumer maps already, closes, batches) and their replies travel through a
//! page shared by the broker and the consumer instead of the socket, so a round trip costs
//! no syscall while both sides poll.
//!
//! The broker creates the mailbox (a sealed memfd: the consumer cannot shrink it under the
//! broker's mapping) when the consumer asks for it with [`Op::Mailbox`](super::wire::Op)
//! and sends its fd in the reply. Layout ([`MAILBOX_BYTES`], every field a little-endian
//! `u64` on its own cache line, then the two buffers, each [`MAX_PACKET`] bytes):
//!
//! ```text
//! 0    magic  (MAILBOX_MAGIC: layout version 1)
//! 64   req_seq           consumer: number of its latest request (1, 2, ...)
//! 128  rep_seq           broker: the req_seq its latest reply answers
//! 192  broker_polling    broker: 1 while it looks at req_seq without sleeping
//! 256  consumer_polling  consumer: 1 unless it is (about to be) asleep on the socket
//! 320  req_len, 384 rep_len
//! 512  request buffer, 512 + MAX_PACKET reply buffer
//! ```
//!
//! **Doorbells.** A side that publishes (a request, a reply) stores the bytes, the length,
//! then the sequence number, then (after a `SeqCst` fence) loads the peer's polling flag:
//! 0 means the peer may be asleep on the socket, and a [`DOORBELL`](super::wire::DOORBELL)
//! packet is sent to wake it. A side that stops polling stores 0 in its flag, fences, and
//! looks at the sequence number once more before it sleeps on the socket. Of the two
//! store-fence-load sequences one sees the other's store (Dekker): a request or a reply is
//! never stranded with its reader asleep. `alloc/tests/loom_mailbox.rs` checks this model.
//!
//! **Trust.** The broker treats the mailbox as the consumer's: lengths are bounds-checked,
//! the bytes are copied out before they are decoded (as a socket packet is), and a
//! sequence number that moves is one more request, answered as any other; a peer can only
//! scribble on its own mailbox. Every access goes through atomics (words of the buffers
//! included), so a peer writing concurrently cannot cause undefined behaviour here.

use std::os::fd::{AsFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{fence, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rustix::fs::{MemfdFlags, SealFlags};
use rustix::mm::{MapFlags, ProtFlags};

use crate::error::{Error, Result};
use crate::ipc::wire::{self, Received, MAX_PACKET};

use layout::{
    BROKER_POLLING, CONSUMER_POLLING, MAGIC, REP_BUF, REP_LEN, REP_SEQ, REQ_BUF, REQ_LEN, REQ_SEQ,
};
pub use layout::{MAILBOX_BYTES, MAILBOX_MAGIC};

/// The mailbox's layout, as a peer process maps it (the table above): the byte offset of
/// every word and buffer. Public so that a test can play a raw peer from the same
/// definition.
pub mod layout {
    use crate::ipc::wire::MAX_PACKET;

    /// The first word of a mailbox: "gpuamb" and the layout version (1).
    pub const MAILBOX_MAGIC: u64 = 0x0001_626d_6175_7067;
    /// Bytes of a mailbox (a multiple of the page size on every Linux target).
    pub const MAILBOX_BYTES: usize = 16 << 10;
    /// The magic word.
    pub const MAGIC: usize = 0;
    /// The consumer's request sequence number.
    pub const REQ_SEQ: usize = 64;
    /// The broker's reply sequence number.
    pub const REP_SEQ: usize = 128;
    /// Nonzero while the broker polls.
    pub const BROKER_POLLING: usize = 192;
    /// Nonzero while the consumer polls.
    pub const CONSUMER_POLLING: usize = 256;
    /// The request's length.
    pub const REQ_LEN: usize = 320;
    /// The reply's length.
    pub const REP_LEN: usize = 384;
    /// The request buffer.
    pub const REQ_BUF: usize = 512;
    /// The reply buffer.
    pub const REP_BUF: usize = REQ_BUF + MAX_PACKET;
}
const _: () = assert!(REP_BUF + MAX_PACKET <= MAILBOX_BYTES && MAX_PACKET % 8 == 0);

/// Whether mailboxes are used: `GPU_ARENA_IPC_MAILBOX` (read once) set to `0`, `off` or
/// `false` turns them off on the side that reads it (the broker then refuses to make one,
/// the importer never asks); everything then goes over the socket.
pub fn mailbox_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        !matches!(
            std::env::var("GPU_ARENA_IPC_MAILBOX")
                .unwrap_or_default()
                .trim()
                .to_ascii_lowercase()
                .as_str(),
            "0" | "off" | "false"
        )
    })
}

/// Warn, once per process, that a mailbox could not be made or mapped (`e` says why): the
/// socket carries that connection's requests.
pub(crate) fn warn_no_mailbox_once(e: &Error) {
    static LOGGED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if !LOGGED.swap(true, Ordering::Relaxed) {
        tracing::warn!(error = %e, "no IPC mailbox: requests go over the socket");
    }
}

/// Which side of the mailbox this process is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    Broker,
    Consumer,
}

impl Side {
    fn own_flag(self) -> usize {
        match self {
            Side::Broker => BROKER_POLLING,
            Side::Consumer => CONSUMER_POLLING,
        }
    }
    fn peer_flag(self) -> usize {
        match self {
            Side::Broker => CONSUMER_POLLING,
            Side::Consumer => BROKER_POLLING,
        }
    }
}

/// One side's mapping of a mailbox; unmapped on drop.
#[derive(Debug)]
pub(crate) struct Mailbox {
    base: NonNull<u8>,
    side: Side,
}

// SAFETY: the mapping is plain shared memory owned by this value; every access to it goes
// through `AtomicU64`s, which may be used from any thread.
unsafe impl Send for Mailbox {}
// SAFETY: as above: `&Mailbox` only hands out atomic views.
unsafe impl Sync for Mailbox {}

impl Drop for Mailbox {
    fn drop(&mut self) {
        // SAFETY: `base` is the start of a MAILBOX_BYTES mapping made in `map` and owned by
        // this value; no reference into it outlives `&self`.
        if let Err(e) = unsafe { rustix::mm::munmap(self.base.as_ptr().cast(), MAILBOX_BYTES) } {
            tracing::error!(error = %e, "unmapping an IPC mailbox failed");
        }
    }
}

impl Mailbox {
    /// The broker's side: a new sealed memfd, mapped, with the magic written; the fd is for
    /// the consumer.
    pub(crate) fn create() -> Result<(Mailbox, OwnedFd)> {
        let fail = |what: &str, e: rustix::io::Errno| {
            Error::Ipc(format!("creating the IPC mailbox ({what}) failed: {e}"))
        };
        let fd = rustix::fs::memfd_create(
            "gpu-arena-ipc-mailbox",
            MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
        )
        .map_err(|e| fail("memfd_create", e))?;
        rustix::fs::ftruncate(&fd, MAILBOX_BYTES as u64).map_err(|e| fail("ftruncate", e))?;
        // A consumer that shrank the file would make the broker's next access fault.
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)
            .map_err(|e| fail("seals", e))?;
        let mailbox = Mailbox::map(&fd, Side::Broker)?;
        mailbox.word(MAGIC).store(MAILBOX_MAGIC, Ordering::Release);
        // Polling until it first sleeps: the first requests need no doorbell.
        mailbox.word(BROKER_POLLING).store(1, Ordering::Release);
        Ok((mailbox, fd))
    }

    /// The consumer's side: map the fd the broker sent and check its size and layout.
    pub(crate) fn open(fd: &OwnedFd) -> Result<Mailbox> {
        let st = rustix::fs::fstat(fd)
            .map_err(|e| Error::Ipc(format!("the producer's IPC mailbox: fstat: {e}")))?;
        if usize::try_from(st.st_size).map_or(true, |n| n < MAILBOX_BYTES) {
            return Err(Error::Ipc(format!(
                "the producer's IPC mailbox is {} bytes, expected {MAILBOX_BYTES}",
                st.st_size
            )));
        }
        let mailbox = Mailbox::map(fd, Side::Consumer)?;
        let magic = mailbox.word(MAGIC).load(Ordering::Acquire);
        if magic != MAILBOX_MAGIC {
            return Err(Error::Ipc(format!(
                "the producer's IPC mailbox has layout {magic:#x}, expected {MAILBOX_MAGIC:#x}"
            )));
        }
        mailbox.word(CONSUMER_POLLING).store(1, Ordering::Release);
        Ok(mailbox)
    }

    fn map(fd: &OwnedFd, side: Side) -> Result<Mailbox> {
        // SAFETY: a fresh shared mapping of MAILBOX_BYTES at an address the kernel picks: it
        // aliases no Rust object. The file is at least that long (checked or set, and sealed
        // by the broker), so no access within it faults.
        let ptr = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                MAILBOX_BYTES,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                fd.as_fd(),
                0,
            )
        }
        .map_err(|e| Error::Ipc(format!("mapping the IPC mailbox failed: {e}")))?;
        let base = NonNull::new(ptr.cast::<u8>())
            .ok_or_else(|| Error::Internal("mmap returned null".into()))?;
        Ok(Mailbox { base, side })
    }

    /// The word at byte `offset` (a multiple of 8 below MAILBOX_BYTES).
    fn word(&self, offset: usize) -> &AtomicU64 {
        debug_assert!(offset % 8 == 0 && offset + 8 <= MAILBOX_BYTES);
        // SAFETY: `offset` is in bounds and 8-aligned (page-aligned base), the mapping lives
        // as long as `self`, and the memory is only ever accessed through atomics (the peer
        // process included), so an `&AtomicU64` view is sound.
        unsafe { &*(self.base.as_ptr().add(offset) as *const AtomicU64) }
    }

    fn write_bytes(&self, buf: usize, bytes: &[u8]) {
        for (i, chunk) in bytes.chunks(8).enumerate() {
            let mut w = [0u8; 8];
            w[..chunk.len()].copy_from_slice(chunk);
            self.word(buf + 8 * i)
                .store(u64::from_le_bytes(w), Ordering::Relaxed);
        }
    }

    /// `len` bytes of buffer `buf`, bounds-checked (the length may come from the peer).
    fn read_bytes(&self, buf: usize, len: u64) -> Result<Vec<u8>> {
        let len = usize::try_from(len)
            .ok()
            .filter(|&n| n <= MAX_PACKET)
            .ok_or_else(|| {
                Error::Ipc(format!(
                    "mailbox packet of {len} bytes (at most {MAX_PACKET})"
                ))
            })?;
        let mut out = Vec::with_capacity(len.next_multiple_of(8));
        for i in 0..len.div_ceil(8) {
            let w = self.word(buf + 8 * i).load(Ordering::Relaxed);
            out.extend_from_slice(&w.to_le_bytes());
        }
        out.truncate(len);
        Ok(out)
    }

    /// Publish `bytes` (at most [`MAX_PACKET`]) under sequence number `seq`: a request on
    /// the consumer's side, a reply on the broker's. Returns whether the peer may be asleep
    /// (its polling flag was 0 after the publication): then it needs a doorbell.
    pub(crate) fn publish(&self, seq: u64, bytes: &[u8]) -> bool {
        debug_assert!(bytes.len() <= MAX_PACKET);
        let (buf, len, seq_at) = match self.side {
            Side::Consumer => (REQ_BUF, REQ_LEN, REQ_SEQ),
            Side::Broker => (REP_BUF, REP_LEN, REP_SEQ),
        };
        let bytes = &bytes[..bytes.len().min(MAX_PACKET)];
        self.write_bytes(buf, bytes);
        self.word(len).store(bytes.len() as u64, Ordering::Relaxed);
        self.word(seq_at).store(seq, Ordering::Release);
        // Dekker with `stop_polling`: our seq store before the peer's flag load.
        fence(Ordering::SeqCst);
        self.word(self.side.peer_flag()).load(Ordering::Relaxed) == 0
    }

    /// The sequence number the peer published last (the broker reads the request number,
    /// the consumer the reply number).
    pub(crate) fn peer_seq(&self) -> u64 {
        let at = match self.side {
            Side::Broker => REQ_SEQ,
            Side::Consumer => REP_SEQ,
        };
        self.word(at).load(Ordering::Acquire)
    }

    /// The bytes the peer published with its latest sequence number (read
    /// [`Mailbox::peer_seq`] first). An out-of-range length is an error.
    pub(crate) fn peer_bytes(&self) -> Result<Vec<u8>> {
        let (buf, len) = match self.side {
            Side::Broker => (REQ_BUF, REQ_LEN),
            Side::Consumer => (REP_BUF, REP_LEN),
        };
        self.read_bytes(buf, self.word(len).load(Ordering::Relaxed))
    }

    /// Say this side polls again (it is awake): the peer need not ring.
    pub(crate) fn start_polling(&self) {
        self.word(self.side.own_flag()).store(1, Ordering::Relaxed);
    }

    /// Say this side is about to sleep on the socket; the caller must look at
    /// [`Mailbox::peer_seq`] once more afterwards, before it sleeps.
    pub(crate) fn stop_polling(&self) {
        self.word(self.side.own_flag()).store(0, Ordering::Relaxed);
        // Dekker with `publish`: our flag store before our next seq load.
        fence(Ordering::SeqCst);
    }

    /// The consumer's side of a test: write raw words as a misbehaving consumer would.
    #[cfg(test)]
    pub(crate) fn scribble(&self, req_seq: u64, req_len: u64, bytes: &[u8]) {
        self.write_bytes(REQ_BUF, &bytes[..bytes.len().min(MAX_PACKET)]);
        self.word(REQ_LEN).store(req_len, Ordering::Relaxed);
        self.word(REQ_SEQ).store(req_seq, Ordering::Release);
    }
}

// The broker's side of waiting (the consumer's is `connection::hear_mailbox`).

/// While polling a mailbox, how many looks at its sequence number between two yields.
const POLLS_PER_YIELD: u32 = 64;

/// Poll a mailbox until `spin` after `start`: `look` [`POLLS_PER_YIELD`] times between two
/// yields, and `socket` too, at most every `socket_every`. The first `Some` either gives, or
/// `None` once the spin time is up (the caller then stops polling and sleeps on the socket).
pub(crate) fn spin_poll<T>(
    start: Instant,
    spin: Duration,
    socket_every: Duration,
    mut look: impl FnMut() -> Option<T>,
    mut socket: impl FnMut() -> Option<T>,
) -> Option<T> {
    let mut socket_looked = start;
    loop {
        for _ in 0..POLLS_PER_YIELD {
            if let Some(got) = look() {
                return Some(got);
            }
            std::hint::spin_loop();
        }
        if start.elapsed() >= spin {
            return None;
        }
        if socket_looked.elapsed() >= socket_every {
            socket_looked = Instant::now();
            if let Some(got) = socket() {
                return Some(got);
            }
        }
        std::thread::yield_now();
    }
}
/// While polling a mailbox, how often the socket is looked at too (requests that need an
/// fd, doorbells, a consumer that hung up).
const SOCKET_LOOK_EVERY: Duration = Duration::from_micros(4);

/// What the connection's thread heard next.
pub(crate) enum Inbound {
    /// A request packet on the socket.
    Socket(Vec<u8>),
    /// A new request number in the mailbox (its bytes are still there).
    Mailbox(u64),
    /// Nothing for a receive timeout (the idle check's tick).
    Idle,
    /// The consumer hung up, or the socket failed.
    Closed,
}

/// Wait for the next request: poll the mailbox (and now and then the socket) for `spin`,
/// then sleep on the socket, which a request or a doorbell wakes. `served` is the last
/// mailbox request number answered; `socket_first`: the last request came over the socket,
/// so the next one may be queued there already (closes sent without waiting come in
/// bursts): look there at once.
pub(crate) fn next_inbound(
    conn: &OwnedFd,
    mailbox: Option<&Mailbox>,
    served: u64,
    spin: Duration,
    socket_first: bool,
) -> Inbound {
    let socket = |got: Result<Received>| match got {
        Ok(Received::Packet(p, fds)) => {
            drop(fds); // consumers send none; close any they did
            Some(Inbound::Socket(p))
        }
        Ok(Received::TimedOut) => None,
        Ok(Received::Closed) | Err(_) => Some(Inbound::Closed),
    };
    let Some(mb) = mailbox else {
        return socket(wire::recv_spin(conn.as_fd(), spin)).unwrap_or(Inbound::Idle);
    };
    let start = Instant::now();
    mb.start_polling();
    // A look at the socket without waiting; doorbells are skipped.
    let look_at_socket = || match socket(wire::try_recv(conn.as_fd())) {
        Some(Inbound::Socket(p)) if wire::is_doorbell(&p) => None,
        got => got,
    };
    if socket_first && mb.peer_seq() == served {
        if let Some(got) = look_at_socket() {
            return got;
        }
    }
    if let Some(got) = spin_poll(
        start,
        spin,
        SOCKET_LOOK_EVERY,
        || {
            Some(mb.peer_seq())
                .filter(|&seq| seq != served)
                .map(Inbound::Mailbox)
        },
        look_at_socket,
    ) {
        return got;
    }
    // Dekker with the consumer's `publish`: flag down, then one more look, then sleep.
    mb.stop_polling();
    loop {
        let seq = mb.peer_seq();
        if seq != served {
            mb.start_polling();
            return Inbound::Mailbox(seq);
        }
        match socket(wire::recv(conn.as_fd())) {
            Some(Inbound::Socket(p)) if wire::is_doorbell(&p) => continue,
            Some(got) => {
                mb.start_polling();
                return got;
            }
            None => return Inbound::Idle,
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_request_and_a_reply_cross_and_lengths_are_checked() {
        let (broker, fd) = Mailbox::create().unwrap();
        let consumer = Mailbox::open(&fd).unwrap();
        // The broker polls from the start; the consumer too.
        assert!(!consumer.publish(1, b"hello mailbox"));
        assert_eq!(broker.peer_seq(), 1);
        assert_eq!(broker.peer_bytes().unwrap(), b"hello mailbox");
        consumer.stop_polling();
        assert!(
            broker.publish(1, &[7; MAX_PACKET]),
            "the consumer sleeps: ring"
        );
        assert_eq!(consumer.peer_seq(), 1);
        assert_eq!(consumer.peer_bytes().unwrap(), vec![7; MAX_PACKET]);
        consumer.scribble(9, MAX_PACKET as u64 + 1, b"x");
        assert_eq!(broker.peer_seq(), 9);
        assert!(broker.peer_bytes().is_err(), "length out of range");
        consumer.scribble(10, u64::MAX, b"");
        assert!(broker.peer_bytes().is_err());
    }

    #[test]
    fn a_shrunk_or_foreign_file_is_refused() {
        let (_broker, fd) = Mailbox::create().unwrap();
        assert!(rustix::fs::ftruncate(&fd, 0).is_err(), "sealed");
        let small = rustix::fs::memfd_create("gpu-arena-test-small", MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&small, 4096).unwrap();
        assert!(Mailbox::open(&small).is_err());
        let zeros = rustix::fs::memfd_create("gpu-arena-test-zeros", MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&zeros, MAILBOX_BYTES as u64).unwrap();
        assert!(Mailbox::open(&zeros).is_err(), "no magic");
    }
}
