//! A raw consumer speaking the broker's private wire protocol (see alloc/src/ipc/wire.rs),
//! for the IPC security tests: requests built byte by byte, single and batched, sent with or
//! without fds, and replies read back as they come.
//!
//! Request, 44 bytes: op u8 | want_fd u8 | 0 0 | device i32 | key u32 | 0 u32 | arena_id u64
//! | token [16] | generation u32; reply: ok u8 | pinning u8 | 0 0 | lease_key u32 |
//! arena_bytes u64 | message.
#![allow(clippy::unwrap_used)]

use std::io::{IoSlice, IoSliceMut, Read};
use std::mem::MaybeUninit;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use gpu_arena::ipc::ShareHandle;
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags, SocketAddrUnix,
};

use super::seqpacket_socket;
pub const OPEN: u8 = 1;
pub const CLOSE: u8 = 2;

pub fn request(
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

pub fn open_req(h: &ShareHandle, want_fd: bool) -> Vec<u8> {
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

/// An open of `h` (with its fd) that presents share `key` and `token` instead of its own.
pub fn open_req_as(h: &ShareHandle, key: u32, token: &[u8; 16]) -> Vec<u8> {
    request(
        OPEN,
        true,
        h.info.device,
        key,
        h.info.arena_id,
        token,
        h.info.generation,
    )
}

pub fn close_req(device: i32, lease: u32) -> Vec<u8> {
    request(CLOSE, false, device, lease, 0, &[0; 16], 0)
}

#[derive(Debug)]
pub struct RawReply {
    pub ok: bool,
    pub lease_key: u32,
    pub message: String,
    pub fds: Vec<OwnedFd>,
}

#[derive(Debug)]
pub enum Got {
    Reply(RawReply),
    Closed,
    TimedOut,
}

impl Got {
    #[track_caller]
    pub fn reply(self) -> RawReply {
        match self {
            Got::Reply(r) => r,
            other => panic!("expected a reply, got {other:?}"),
        }
    }
}

pub fn raw_connect(name: &str) -> OwnedFd {
    let s = seqpacket_socket();
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

pub fn raw_send(s: &OwnedFd, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> rustix::io::Result<usize> {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(16))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() {
        assert!(control.push(SendAncillaryMessage::ScmRights(fds)));
    }
    rustix::net::sendmsg(s, &[IoSlice::new(bytes)], &mut control, SendFlags::NOSIGNAL)
}

pub fn raw_recv(s: &OwnedFd) -> Got {
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

pub fn round_trip(s: &OwnedFd, bytes: &[u8]) -> RawReply {
    raw_send(s, bytes, &[]).unwrap();
    raw_recv(s).reply()
}

/// An fd whose closing we can observe: send `probe.0`, drop ours; `closed_everywhere` reads
/// EOF on the other end once every copy (the broker's included) is closed.
pub fn probe() -> (UnixStream, UnixStream) {
    UnixStream::pair().unwrap()
}

pub fn closed_everywhere(mut other_end: UnixStream) -> bool {
    other_end
        .set_read_timeout(Some(Duration::from_secs(2)))
        .unwrap();
    let mut b = [0u8; 1];
    matches!(other_end.read(&mut b), Ok(0))
}

// ---------------------------------------------------------------------------------------
// (batches) Ops 3 (open many) and 4 (close many): header `op | 0 0 0 | device i32 |
// count u32 | 0 ...` (44 bytes), then 32-byte open entries `key | generation | arena_id |
// token` or 4-byte lease keys.
// ---------------------------------------------------------------------------------------

pub fn batch_open(device: i32, hs: &[&ShareHandle]) -> Vec<u8> {
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

pub fn batch_close(device: i32, leases: &[u32]) -> Vec<u8> {
    let mut b = vec![0u8; 44];
    b[0] = 4;
    b[4..8].copy_from_slice(&device.to_le_bytes());
    b[8..12].copy_from_slice(&(leases.len() as u32).to_le_bytes());
    for l in leases {
        b.extend_from_slice(&l.to_le_bytes());
    }
    b
}

pub fn lease_keys(r: &RawReply) -> Vec<u32> {
    r.message
        .as_bytes()
        .chunks_exact(4)
        .map(|k| u32::from_le_bytes([k[0], k[1], k[2], k[3]]))
        .collect()
}
