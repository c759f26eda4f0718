//! The broker's wire protocol: fixed-layout messages over a `SOCK_SEQPACKET` Unix socket
//! (message boundaries kept by the kernel), the export fd riding along with SCM_RIGHTS.
//!
//! Request (consumer → broker), 44 bytes: `op u8 | want_fd u8 | 0 0 | device i32 |
//! key u32 | 0 u32 | arena_id u64 | token [16] | generation u32`. `op` 1 = open a lease on
//! share `key`; `generation` is the export generation the handle names, checked by the broker
//! (a stale handle is refused with a clear error). `op` 2 = close lease `key`; its
//! `arena_id`, `token` and `generation` are 0.
//!
//! Reply (broker → consumer): `ok u8 | pinning u8 | chunks u16 | lease_key u32 | arena_bytes
//! u64 | chunk lengths (u64 each) | message (UTF-8, rest of the packet)`, plus the export's fd
//! for an open with `want_fd`: one, or one per chunk of a grown arena (`chunks` of them, at
//! most [`MAX_FDS`], their lengths in address order; `chunks` is 0 with one fd).
//!
//! Batches (one round trip for many leases, never an fd): a 44-byte header `op u8 | 0 | 0 0 |
//! device i32 | count u32 | 0 ...` (count 1..=[`MAX_BATCH`]) and `count` entries. `op` 3 =
//! open leases on shares of `device`, entries of 32 bytes `key u32 | generation u32 |
//! arena_id u64 | token [16]`: all or nothing (a refused entry ends the leases the batch
//! opened; the reply says which entry and why); the reply's message bytes are then the
//! lease keys, `u32` each, in order. `op` 4 = close leases, entries `lease_key u32`: all must
//! be held by this connection, or none is closed.
//!
//! Mailbox (see `ipc::mailbox`): `op` 5 (every other field 0) asks for the connection's
//! shared-memory mailbox; the reply carries its memfd, `lease_key` = the layout version,
//! `arena_bytes` = its size. A broker without mailboxes (an older one, or one with
//! `GPU_ARENA_IPC_MAILBOX=0`) answers with an error, and the consumer keeps to the socket.
//! Requests and replies in the mailbox are the bytes described above. A [`DOORBELL`] packet
//! (8 bytes, never a request nor a reply) only wakes a peer asleep on the socket: the news
//! is in the mailbox.

use std::io::IoSliceMut;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

use crate::backend::DeviceId;
use crate::error::{Error, Result};

/// Largest packet either side sends.
pub(crate) const MAX_PACKET: usize = 4096;
/// Most entries in one batch request.
pub(crate) const MAX_BATCH: usize = 120;
/// Bytes of one entry of an open batch.
const OPEN_ENTRY: usize = 32;
pub(crate) const REQUEST_BYTES: usize = 44;

/// Request kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    Open = 1,
    Close = 2,
    /// A [`Batch::Open`] (its own encoding; never a [`Request`] on the wire).
    OpenMany = 3,
    /// A [`Batch::Close`] (likewise).
    CloseMany = 4,
    /// Ask for the connection's mailbox (its fd comes with the reply).
    Mailbox = 5,
}

/// The doorbell packet: "look at the mailbox". Shorter than any request or reply.
pub(crate) const DOORBELL: [u8; 8] = *b"gpuaring";

/// Whether `packet` is a [`DOORBELL`].
pub(crate) fn is_doorbell(packet: &[u8]) -> bool {
    packet == DOORBELL
}

/// Ring the peer's doorbell without blocking: a full socket queue already holds unread
/// packets (doorbells or replies), so the peer wakes anyway. Errors are the caller's
/// concern only as a dead peer, which the socket reports again at the next receive.
pub(crate) fn ring(sock: BorrowedFd<'_>) {
    let _ = rustix::net::send(sock, &DOORBELL, SendFlags::NOSIGNAL | SendFlags::DONTWAIT);
}

/// A consumer's request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Request {
    pub op: Op,
    pub want_fd: bool,
    pub device: DeviceId,
    /// Share key for `Open`, lease key for `Close`.
    pub key: u32,
    pub arena_id: u64,
    pub token: [u8; 16],
    /// The export generation the handle names (`Open`; 0 for `Close`).
    pub generation: u32,
}

impl Request {
    pub(crate) fn encode(&self) -> [u8; REQUEST_BYTES] {
        let mut b = [0u8; REQUEST_BYTES];
        b[0] = self.op as u8;
        b[1] = u8::from(self.want_fd);
        b[4..8].copy_from_slice(&self.device.to_le_bytes());
        b[8..12].copy_from_slice(&self.key.to_le_bytes());
        b[16..24].copy_from_slice(&self.arena_id.to_le_bytes());
        b[24..40].copy_from_slice(&self.token);
        b[40..44].copy_from_slice(&self.generation.to_le_bytes());
        b
    }

    pub(crate) fn decode(b: &[u8]) -> Result<Request> {
        if b.len() != REQUEST_BYTES {
            return Err(Error::Ipc(format!(
                "request of {} bytes, expected {REQUEST_BYTES}",
                b.len()
            )));
        }
        let op = match b[0] {
            1 => Op::Open,
            2 => Op::Close,
            5 => Op::Mailbox,
            x => return Err(Error::Ipc(format!("unknown request op {x}"))),
        };
        if b[1] > 1 || b[2..4] != [0, 0] || b[12..16] != [0; 4] {
            return Err(Error::Ipc("malformed request".into()));
        }
        let mut token = [0u8; 16];
        token.copy_from_slice(&b[24..40]);
        let mut a8 = [0u8; 8];
        a8.copy_from_slice(&b[16..24]);
        Ok(Request {
            op,
            want_fd: b[1] == 1,
            device: i32::from_le_bytes([b[4], b[5], b[6], b[7]]),
            key: u32::from_le_bytes([b[8], b[9], b[10], b[11]]),
            arena_id: u64::from_le_bytes(a8),
            token,
            generation: u32::from_le_bytes([b[40], b[41], b[42], b[43]]),
        })
    }
}

/// A batch request (ops 3 and 4; see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Batch {
    /// Open a lease on each share: (key, generation, arena id, token).
    Open {
        device: DeviceId,
        shares: Vec<(u32, u32, u64, [u8; 16])>,
    },
    /// Close each lease.
    Close { device: DeviceId, leases: Vec<u32> },
}

impl Batch {
    pub(crate) fn is_batch(packet: &[u8]) -> bool {
        matches!(packet.first(), Some(3 | 4))
    }

    pub(crate) fn len(&self) -> usize {
        match self {
            Batch::Open { shares, .. } => shares.len(),
            Batch::Close { leases, .. } => leases.len(),
        }
    }

    pub(crate) fn encode(&self) -> Vec<u8> {
        let (op, device, entry) = match self {
            Batch::Open { device, .. } => (3u8, *device, OPEN_ENTRY),
            Batch::Close { device, .. } => (4u8, *device, 4),
        };
        let n = self.len();
        let mut b = Vec::with_capacity(REQUEST_BYTES + n * entry);
        b.resize(REQUEST_BYTES, 0);
        b[0] = op;
        b[4..8].copy_from_slice(&device.to_le_bytes());
        b[8..12].copy_from_slice(&(n as u32).to_le_bytes());
        match self {
            Batch::Open { shares, .. } => {
                for (key, generation, arena_id, token) in shares {
                    b.extend_from_slice(&key.to_le_bytes());
                    b.extend_from_slice(&generation.to_le_bytes());
                    b.extend_from_slice(&arena_id.to_le_bytes());
                    b.extend_from_slice(token);
                }
            }
            Batch::Close { leases, .. } => {
                for l in leases {
                    b.extend_from_slice(&l.to_le_bytes());
                }
            }
        }
        b
    }

    /// The reply to a granted open batch: a [`Reply`] whose `lease_key` is the count, then
    /// the lease keys, `u32` each, in the entries' order.
    pub(crate) fn open_reply(leases: &[u32]) -> Vec<u8> {
        let mut bytes = Reply {
            ok: true,
            pinning: false,
            lease_key: leases.len() as u32,
            arena_bytes: 0,
            chunks: Vec::new(),
            message: String::new(),
        }
        .encode();
        for l in leases {
            bytes.extend_from_slice(&l.to_le_bytes());
        }
        bytes
    }

    /// The lease keys of a granted open batch's reply (see [`Batch::open_reply`]).
    pub(crate) fn reply_leases(reply: &[u8]) -> Vec<u32> {
        reply
            .get(16..)
            .unwrap_or_default()
            .chunks_exact(4)
            .map(|k| u32::from_le_bytes([k[0], k[1], k[2], k[3]]))
            .collect()
    }

    pub(crate) fn decode(b: &[u8]) -> Result<Batch> {
        let bad = || Error::Ipc("malformed batch request".into());
        if b.len() < REQUEST_BYTES
            || b[1..4] != [0, 0, 0]
            || b[12..REQUEST_BYTES].iter().any(|&x| x != 0)
        {
            return Err(bad());
        }
        let device = i32::from_le_bytes([b[4], b[5], b[6], b[7]]);
        let n = u32::from_le_bytes([b[8], b[9], b[10], b[11]]) as usize;
        let entry = if b[0] == 3 { OPEN_ENTRY } else { 4 };
        if !(1..=MAX_BATCH).contains(&n) || b.len() != REQUEST_BYTES + n * entry {
            return Err(Error::Ipc(format!(
                "batch request of {} bytes does not hold 1..={MAX_BATCH} entries",
                b.len()
            )));
        }
        let body = &b[REQUEST_BYTES..];
        let u32_at =
            |at: usize| u32::from_le_bytes([body[at], body[at + 1], body[at + 2], body[at + 3]]);
        match b[0] {
            3 => Ok(Batch::Open {
                device,
                shares: body
                    .chunks_exact(OPEN_ENTRY)
                    .map(|e| {
                        let mut a8 = [0u8; 8];
                        a8.copy_from_slice(&e[8..16]);
                        let mut token = [0u8; 16];
                        token.copy_from_slice(&e[16..32]);
                        (
                            u32::from_le_bytes([e[0], e[1], e[2], e[3]]),
                            u32::from_le_bytes([e[4], e[5], e[6], e[7]]),
                            u64::from_le_bytes(a8),
                            token,
                        )
                    })
                    .collect(),
            }),
            4 => Ok(Batch::Close {
                device,
                leases: (0..n).map(|i| u32_at(4 * i)).collect(),
            }),
            _ => Err(bad()),
        }
    }
}

/// The broker's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Reply {
    pub ok: bool,
    pub pinning: bool,
    pub lease_key: u32,
    pub arena_bytes: u64,
    /// The lengths of the fds sent with the reply, one per chunk of a grown arena, in
    /// address order (empty when one fd, or none, comes with it).
    pub chunks: Vec<u64>,
    pub message: String,
}

impl Reply {
    pub(crate) fn error(message: impl Into<String>) -> Reply {
        Reply {
            ok: false,
            pinning: false,
            lease_key: 0,
            arena_bytes: 0,
            chunks: Vec::new(),
            message: message.into(),
        }
    }

    /// Layout: `ok`, `pinning`, the chunk count (u16), the lease key (u32), the arena's
    /// bytes (u64), the chunks' lengths (u64 each), then the message (cut to fit a packet).
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut b = vec![0u8; 16];
        b[0] = u8::from(self.ok);
        b[1] = u8::from(self.pinning);
        let chunks = &self.chunks[..self.chunks.len().min(MAX_FDS)];
        b[2..4].copy_from_slice(&(chunks.len() as u16).to_le_bytes());
        b[4..8].copy_from_slice(&self.lease_key.to_le_bytes());
        b[8..16].copy_from_slice(&self.arena_bytes.to_le_bytes());
        for c in chunks {
            b.extend_from_slice(&c.to_le_bytes());
        }
        let msg = self.message.as_bytes();
        let mut n = msg.len().min(MAX_PACKET.saturating_sub(b.len()));
        while n > 0 && !self.message.is_char_boundary(n) {
            n -= 1;
        }
        b.extend_from_slice(&msg[..n]);
        b
    }

    pub(crate) fn decode(b: &[u8]) -> Result<Reply> {
        let malformed = || Error::Ipc("malformed reply from the producer".into());
        if b.len() < 16 || b[0] > 1 || b[1] > 1 {
            return Err(malformed());
        }
        let count = usize::from(u16::from_le_bytes([b[2], b[3]]));
        let end = 16 + 8 * count;
        if count > MAX_FDS || b.len() < end {
            return Err(malformed());
        }
        let u64_at = |at: usize| {
            let mut a8 = [0u8; 8];
            a8.copy_from_slice(&b[at..at + 8]);
            u64::from_le_bytes(a8)
        };
        Ok(Reply {
            ok: b[0] == 1,
            pinning: b[1] == 1,
            lease_key: u32::from_le_bytes([b[4], b[5], b[6], b[7]]),
            arena_bytes: u64_at(8),
            chunks: (0..count).map(|i| u64_at(16 + 8 * i)).collect(),
            message: String::from_utf8_lossy(&b[end..]).into_owned(),
        })
    }
}

/// Most fds one packet carries: a grown arena's export, one per chunk.
pub(crate) const MAX_FDS: usize = crate::backend::MAX_ARENA_CHUNKS;

/// Send one packet, with `fds` attached (at most [`MAX_FDS`]). Never raises SIGPIPE.
pub(crate) fn send(sock: BorrowedFd<'_>, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> Result<()> {
    if fds.len() > MAX_FDS {
        return Err(Error::Internal(format!(
            "{} fds do not fit one packet",
            fds.len()
        )));
    }
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(Error::Internal("SCM_RIGHTS buffer too small".into()));
    }
    let sent = rustix::net::sendmsg(
        sock,
        &[std::io::IoSlice::new(bytes)],
        &mut control,
        SendFlags::NOSIGNAL,
    )
    .map_err(|e| Error::Ipc(format!("send failed: {e}")))?;
    if sent != bytes.len() {
        return Err(Error::Ipc(format!(
            "short send: {sent} of {} bytes",
            bytes.len()
        )));
    }
    Ok(())
}

/// What `recv` got.
pub(crate) enum Received {
    /// A packet and the fds that came with it.
    Packet(Vec<u8>, Vec<OwnedFd>),
    /// The peer closed the connection.
    Closed,
    /// The receive timeout passed with nothing received.
    TimedOut,
}

/// Receive one packet (and any fds, which are owned by the caller from here on).
pub(crate) fn recv(sock: BorrowedFd<'_>) -> Result<Received> {
    recv_flags(sock, RecvFlags::empty())
}

/// How long a side polls for the other's next packet before it sleeps (`recv_spin`): the
/// broker's default `spin` setting (its wait for a connection's next request) and the
/// importer's wait for a reply. `GPU_ARENA_IPC_SPIN_US` microseconds (read once; 0 turns
/// polling off), 50 by default. Polling pays off with a core free for each side (a GPU host);
/// on a machine with fewer cores than busy threads it only takes the peer's time slice. Here,
/// beside the polling, since both sides use it (`ipc::broker` re-exports it).
pub fn default_spin() -> std::time::Duration {
    static SPIN: std::sync::OnceLock<std::time::Duration> = std::sync::OnceLock::new();
    *SPIN.get_or_init(|| {
        let us = std::env::var("GPU_ARENA_IPC_SPIN_US")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(50);
        std::time::Duration::from_micros(us)
    })
}

/// Like [`recv`], but poll without sleeping for up to `spin` first: a peer that answers
/// within microseconds is heard without the two context switches of a sleep and a wake-up
/// (most of a round trip's cost). Past `spin`, it blocks as [`recv`] does.
pub(crate) fn recv_spin(sock: BorrowedFd<'_>, spin: std::time::Duration) -> Result<Received> {
    if !spin.is_zero() {
        let start = std::time::Instant::now();
        loop {
            match recv_flags(sock, RecvFlags::DONTWAIT)? {
                Received::TimedOut if start.elapsed() < spin => std::thread::yield_now(),
                Received::TimedOut => break,
                got => return Ok(got),
            }
        }
    }
    recv(sock)
}

/// Receive one packet if one is queued now; [`Received::TimedOut`] if none is.
pub(crate) fn try_recv(sock: BorrowedFd<'_>) -> Result<Received> {
    recv_flags(sock, RecvFlags::DONTWAIT)
}

fn recv_flags(sock: BorrowedFd<'_>, flags: RecvFlags) -> Result<Received> {
    let mut buf = [0u8; MAX_PACKET];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let msg = loop {
        match rustix::net::recvmsg(
            sock,
            &mut [IoSliceMut::new(&mut buf)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC | flags,
        ) {
            Ok(m) => break m,
            Err(rustix::io::Errno::INTR) => continue,
            Err(rustix::io::Errno::AGAIN) => return Ok(Received::TimedOut),
            Err(rustix::io::Errno::CONNRESET) => return Ok(Received::Closed),
            Err(e) => return Err(Error::Ipc(format!("receive failed: {e}"))),
        }
    };
    let mut fds = Vec::new();
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(rights) = m {
            fds.extend(rights);
        }
    }
    if msg.bytes == 0 && fds.is_empty() {
        return Ok(Received::Closed);
    }
    if msg.flags.contains(rustix::net::ReturnFlags::TRUNC) {
        return Err(Error::Ipc("oversized packet".into()));
    }
    Ok(Received::Packet(buf[..msg.bytes].to_vec(), fds))
}

/// Set the socket's receive timeout.
pub(crate) fn set_recv_timeout(sock: impl AsFd, timeout: std::time::Duration) -> Result<()> {
    rustix::net::sockopt::set_socket_timeout(
        &sock,
        rustix::net::sockopt::Timeout::Recv,
        Some(timeout),
    )
    .map_err(|e| Error::Ipc(format!("setting the receive timeout failed: {e}")))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn request_and_reply_round_trip() {
        let r = Request {
            op: Op::Open,
            want_fd: true,
            device: 3,
            key: 99,
            arena_id: 12,
            token: [7; 16],
            generation: 0x0102_0304,
        };
        assert_eq!(Request::decode(&r.encode()).unwrap(), r);
        assert!(Request::decode(&r.encode()[..40]).is_err());
        let mut bad = r.encode();
        bad[0] = 9;
        assert!(Request::decode(&bad).is_err());
        assert!(Request::decode(&bad[..10]).is_err());
        let rep = Reply {
            ok: true,
            pinning: false,
            lease_key: 5,
            arena_bytes: 1 << 30,
            chunks: Vec::new(),
            message: "fine".into(),
        };
        assert_eq!(Reply::decode(&rep.encode()).unwrap(), rep);
        assert!(Reply::decode(&[2; 16]).is_err());
    }

    #[test]
    fn batches_round_trip_and_bad_ones_are_refused() {
        let open = Batch::Open {
            device: 1,
            shares: vec![(3, 4, 5, [6; 16]), (7, 8, 9, [10; 16])],
        };
        let close = Batch::Close {
            device: 0,
            leases: vec![1, 2, 3],
        };
        for b in [&open, &close] {
            let bytes = b.encode();
            assert!(Batch::is_batch(&bytes));
            assert_eq!(&Batch::decode(&bytes).unwrap(), b);
            assert!(Batch::decode(&bytes[..bytes.len() - 1]).is_err(), "short");
            let mut more = bytes.clone();
            more[8] += 1;
            assert!(Batch::decode(&more).is_err(), "count past the entries");
            let mut zero = bytes.clone();
            zero[8..12].fill(0);
            zero.truncate(REQUEST_BYTES);
            assert!(Batch::decode(&zero).is_err(), "empty batch");
            let mut reserved = bytes.clone();
            reserved[20] = 1;
            assert!(Batch::decode(&reserved).is_err(), "reserved byte");
        }
        let huge = Batch::Close {
            device: 0,
            leases: vec![1; MAX_BATCH + 1],
        };
        assert!(Batch::decode(&huge.encode()).is_err(), "too many entries");
        assert!(!Batch::is_batch(&[1, 0]));
        let granted = Batch::open_reply(&[5, 6]);
        assert_eq!(Reply::decode(&granted).unwrap().lease_key, 2);
        assert_eq!(Batch::reply_leases(&granted), [5, 6]);
    }
}
