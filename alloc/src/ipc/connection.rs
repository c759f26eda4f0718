//! The importer's connection to one producer's broker: connecting (the socket must be served
//! by the pid the handle names), a request and its reply ([`round_trip`], [`exchange`]), and
//! closes sent without waiting for their replies ([`send_close`]), whose replies, like those
//! of requests that timed out, are read and discarded with a later request's
//! ([`settle`] reads the rest before the connection is dropped).

use std::collections::VecDeque;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};

use crate::backend::DeviceId;
use crate::error::{Error, Result};
use crate::ipc::broker::default_spin;
use crate::ipc::handle::ShareHandle;
use crate::ipc::wire::{self, Op, Received, Reply, Request};

/// A connection to one broker: one request and its reply at a time, under its lock.
pub(super) type Conn = Arc<Mutex<Connection>>;

#[derive(Debug)]
pub(super) struct Connection {
    sock: OwnedFd,
    /// Requests whose replies this side stopped waiting for (timed out), oldest first. The
    /// broker answers every request, in order: their replies, when they come, precede the
    /// next request's and are discarded (with any fd, and any lease they granted is ended).
    unanswered: VecDeque<Request>,
}

impl Connection {
    /// A connection over `sock` (made by [`connect`]) with no request unanswered.
    pub(super) fn new(sock: OwnedFd) -> Connection {
        Connection {
            sock,
            unanswered: VecDeque::new(),
        }
    }
}

/// Connect to the producer's broker and check the socket belongs to the pid in the handle.
pub(super) fn connect(handle: &ShareHandle, reply_timeout: Duration) -> Result<OwnedFd> {
    let unreachable = |e: &dyn std::fmt::Display| {
        Error::Ipc(format!(
            "producer pid {} (socket `{}`) unreachable: {e}",
            handle.producer_pid, handle.socket_name
        ))
    };
    let sock = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )
    .map_err(|e| unreachable(&e))?;
    let addr = SocketAddrUnix::new_abstract_name(handle.socket_name.as_bytes())
        .map_err(|e| unreachable(&e))?;
    rustix::net::connect(&sock, &addr).map_err(|e| unreachable(&e))?;
    let cred = rustix::net::sockopt::socket_peercred(&sock).map_err(|e| unreachable(&e))?;
    let pid = cred.pid.as_raw_nonzero().get() as u32;
    if pid != handle.producer_pid {
        return Err(Error::Ipc(format!(
            "socket `{}` is served by pid {pid}, the handle names pid {}: refusing",
            handle.socket_name, handle.producer_pid
        )));
    }
    wire::set_recv_timeout(&sock, reply_timeout)?;
    Ok(sock)
}

/// End a lease this importer will not use (an import that failed after the broker granted
/// it); errors are ignored: the broker drops it with the connection anyway.
pub(super) fn close_lease_quietly(conn: &Conn, device: DeviceId, lease: u32) {
    let _ = round_trip(&mut conn.lock(), &close_request(device, lease));
}

/// The request that ends lease `lease` on `device`.
pub(super) fn close_request(device: DeviceId, lease: u32) -> Request {
    Request {
        op: Op::Close,
        want_fd: false,
        device,
        key: lease,
        arena_id: 0,
        token: [0; 16],
        generation: 0,
    }
}

/// Most closes whose replies are not read yet, per connection. The kernel queues few
/// packets per Unix socket (`net.unix.max_dgram_qlen`, 10 by default): past that the broker
/// would block on its reply while this side blocks on its next request.
const CLOSES_IN_FLIGHT: usize = 4;

/// Send a close without waiting for its reply (the broker answers every request in order;
/// the reply is read with a later one). A close of a lease this importer holds fails only
/// if the producer is gone, which ended the lease already; a refusal is logged when read.
pub(super) fn send_close(conn: &mut Connection, req: &Request) -> Result<()> {
    send_close_packet(conn, &req.encode(), req)
}

/// [`send_close`] of `packet`, which `req` stands for in the queue of unanswered requests.
pub(super) fn send_close_packet(conn: &mut Connection, packet: &[u8], req: &Request) -> Result<()> {
    wire::send(conn.sock.as_fd(), packet, None)?;
    conn.unanswered.push_back(req.clone());
    let mut stale_leases = Vec::new();
    // Read what has come back already; wait only past the bound.
    while !conn.unanswered.is_empty() {
        let got = if conn.unanswered.len() > CLOSES_IN_FLIGHT {
            wire::recv_spin(conn.sock.as_fd(), default_spin())
        } else {
            wire::try_recv(conn.sock.as_fd())
        };
        match got {
            Ok(Received::Packet(bytes, _)) => late_reply(conn, &bytes, &mut stale_leases),
            Ok(Received::TimedOut) if conn.unanswered.len() <= CLOSES_IN_FLIGHT => break,
            Ok(Received::TimedOut) => {
                return Err(Error::Ipc(
                    "the producer did not answer in time (the reply timeout passed)".into(),
                ))
            }
            Ok(Received::Closed) | Err(_) => break,
        }
    }
    end_stale(conn, stale_leases);
    Ok(())
}

/// Read the replies to every request sent on `conn` (before it is dropped).
pub(super) fn settle(conn: &mut Connection) {
    let mut stale_leases = Vec::new();
    while !conn.unanswered.is_empty() {
        match wire::recv_spin(conn.sock.as_fd(), default_spin()) {
            Ok(Received::Packet(bytes, _)) => late_reply(conn, &bytes, &mut stale_leases),
            _ => return,
        }
    }
    end_stale(conn, stale_leases);
}

/// The reply to the oldest request this side did not wait for: discarded (its fds close
/// here); a lease it granted is noted in `stale_leases`, a refused close logged.
fn late_reply(conn: &mut Connection, bytes: &[u8], stale_leases: &mut Vec<(DeviceId, u32)>) {
    let reply = Reply::decode(bytes);
    let Some(late) = conn.unanswered.pop_front() else {
        tracing::warn!("a reply to no request from the producer; ignored");
        return;
    };
    match (late.op, &reply) {
        (Op::Open, Ok(r)) if r.ok => stale_leases.push((late.device, r.lease_key)),
        (Op::OpenMany, Ok(r)) if r.ok => stale_leases.extend(
            bytes[16..]
                .chunks_exact(4)
                .map(|k| (late.device, u32::from_le_bytes([k[0], k[1], k[2], k[3]]))),
        ),
        (Op::Close | Op::CloseMany, Ok(r)) if !r.ok => {
            tracing::warn!(message = %r.message, lease = late.key, "producer refused a lease close");
        }
        _ => tracing::debug!(op = ?late.op, "discarded a late reply"),
    }
}

/// End leases granted to requests that timed out: nobody uses them.
fn end_stale(conn: &mut Connection, stale_leases: Vec<(DeviceId, u32)>) {
    for (device, lease) in stale_leases {
        let _ = round_trip(conn, &close_request(device, lease));
    }
}

/// Send a request and wait for its reply (and fd), discarding the late replies of requests
/// that timed out before it and of closes sent without waiting.
pub(super) fn round_trip(conn: &mut Connection, req: &Request) -> Result<(Reply, Option<OwnedFd>)> {
    let (bytes, fd) = exchange(conn, &req.encode(), req)?;
    Ok((Reply::decode(&bytes)?, fd))
}

/// Send `packet` (the encoding of `req`, or of a batch `req` stands for) and wait for its
/// reply's bytes (and fd), discarding the late replies of requests not waited for.
pub(super) fn exchange(
    conn: &mut Connection,
    packet: &[u8],
    req: &Request,
) -> Result<(Vec<u8>, Option<OwnedFd>)> {
    let sent = wire::send(conn.sock.as_fd(), packet, None);
    let mut stale_leases = Vec::new();
    let answer = loop {
        let received = wire::recv_spin(conn.sock.as_fd(), default_spin());
        if let Err(e) = sent {
            // A broker that refused us (uid check) replied and hung up before our request:
            // its reply is still queued and says why, so read it even when the send failed.
            if conn.unanswered.is_empty() {
                if let Ok(Received::Packet(bytes, _)) = received {
                    if Reply::decode(&bytes).is_ok() {
                        break Ok((bytes, None));
                    }
                }
            }
            break Err(e);
        }
        match received? {
            Received::Packet(bytes, fds) => {
                if !conn.unanswered.is_empty() {
                    // The reply to a request this side did not wait for: its fds close here.
                    late_reply(conn, &bytes, &mut stale_leases);
                    continue;
                }
                break Ok((bytes, fds.into_iter().next()));
            }
            Received::Closed => {
                break Err(Error::Ipc(
                    "the producer closed the connection (did it exit?)".into(),
                ))
            }
            Received::TimedOut => {
                conn.unanswered.push_back(req.clone());
                break Err(Error::Ipc(
                    "the producer did not answer in time (the reply timeout passed)".into(),
                ));
            }
        }
    };
    end_stale(conn, stale_leases);
    answer
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// A broker that answers the first request only after the consumer gave up on it, and
    /// every later one at once: the late answer must not be taken for the next request's,
    /// and the lease it granted is ended.
    #[test]
    fn a_late_reply_is_discarded_and_its_lease_ended() {
        let (ours, theirs) = rustix::net::socketpair(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )
        .unwrap();
        let broker = std::thread::spawn(move || {
            let mut seen = Vec::new();
            for i in 0..3 {
                let Ok(Received::Packet(bytes, _)) = wire::recv(theirs.as_fd()) else {
                    break;
                };
                let req = Request::decode(&bytes).unwrap();
                seen.push((req.op, req.key));
                let reply = if i == 0 {
                    std::thread::sleep(Duration::from_millis(450));
                    Reply {
                        ok: true,
                        pinning: false,
                        lease_key: 77,
                        arena_bytes: 1 << 20,
                        message: String::new(),
                    }
                } else {
                    Reply::error(format!("answer to request {i}"))
                };
                wire::send(theirs.as_fd(), &reply.encode(), None).unwrap();
            }
            seen
        });
        wire::set_recv_timeout(&ours, Duration::from_millis(300)).unwrap();
        let mut conn = Connection {
            sock: ours,
            unanswered: VecDeque::new(),
        };
        let open = |key| Request {
            op: Op::Open,
            want_fd: false,
            device: 0,
            key,
            arena_id: 1,
            token: [0; 16],
            generation: 0,
        };
        let first = round_trip(&mut conn, &open(5)).unwrap_err();
        assert!(first.to_string().contains("did not answer"), "{first}");
        assert_eq!(conn.unanswered.len(), 1);
        let (second, _) = round_trip(&mut conn, &open(6)).unwrap();
        assert_eq!(second.message, "answer to request 1", "took the late reply");
        assert!(conn.unanswered.is_empty());
        drop(conn);
        let seen = broker.join().unwrap();
        assert_eq!(
            seen,
            vec![(Op::Open, 5), (Op::Open, 6), (Op::Close, 77)],
            "the lease granted late is ended"
        );
    }
}
