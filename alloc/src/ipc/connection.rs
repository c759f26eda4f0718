//! The importer's connection to one producer's broker: connecting (the socket must be served
//! by the pid the handle names), a request and its reply ([`round_trip`], [`exchange`]), and
//! closes sent without waiting for their replies ([`send_close`]), whose replies, like those
//! of requests that timed out, are read and discarded with a later request's
//! ([`settle`] reads the rest before the connection is dropped).
//!
//! **Mailbox.** The first request that needs no fd in its reply first asks the broker for
//! the connection's shared-memory mailbox ([`crate::ipc::mailbox`]); from then on such
//! requests go through it when it is free (its last request answered and nothing else
//! unanswered), and the others (and any when it is busy with a request that timed out) over
//! the socket. Each request remembers where it went ([`Channel`]), and its reply is looked
//! for there, in the order the requests were sent; the broker answers them in that order.

use std::collections::VecDeque;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};

use crate::backend::DeviceId;
use crate::error::{Error, Result};
use crate::ipc::handle::ShareHandle;
use crate::ipc::mailbox::{mailbox_enabled, spin_poll, warn_no_mailbox_once, Mailbox};
use crate::ipc::wire::{self, Batch, Op, Received, Reply, Request};

/// A connection to one broker: one request and its reply at a time, under its lock.
pub(super) type Conn = Arc<Mutex<Connection>>;

/// Where a request went, so where its reply comes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Channel {
    Socket,
    /// The mailbox, as request number `.0`.
    Mailbox(u64),
}

/// A request whose reply is not read yet.
#[derive(Debug)]
struct Sent {
    req: Request,
    channel: Channel,
    /// Waited for and given up on (a close sent without waiting is not).
    timed_out: bool,
}

/// The connection's mailbox.
#[derive(Debug)]
enum MailboxUse {
    /// Not asked for yet (asked with the first request that could use it).
    NotAsked,
    /// Refused by the broker, failed, or turned off: the socket carries everything.
    Off,
    /// Mapped; `last_seq` is the number of the latest request published in it.
    On { mailbox: Mailbox, last_seq: u64 },
}

#[derive(Debug)]
pub(super) struct Connection {
    sock: OwnedFd,
    /// Requests whose replies are not read yet (timed out, or closes not waited for),
    /// oldest first. The broker answers every request, in order: their replies, when they
    /// come, precede the next request's and are discarded (with any fd, and any lease they
    /// granted is ended).
    unanswered: VecDeque<Sent>,
    /// Socket packets that came while a mailbox reply was awaited (an honest broker sends
    /// none before the mailbox reply: kept for the next socket reply, in order).
    early: VecDeque<(Vec<u8>, Vec<OwnedFd>)>,
    mailbox: MailboxUse,
}

impl Connection {
    /// A connection over `sock` (made by [`connect`]) with no request unanswered; it asks
    /// for a mailbox unless `GPU_ARENA_IPC_MAILBOX=0`.
    pub(super) fn new(sock: OwnedFd) -> Connection {
        Connection {
            sock,
            unanswered: VecDeque::new(),
            early: VecDeque::new(),
            mailbox: if mailbox_enabled() {
                MailboxUse::NotAsked
            } else {
                MailboxUse::Off
            },
        }
    }

    /// Whether requests go through a mailbox.
    #[cfg(test)]
    pub(super) fn has_mailbox(&self) -> bool {
        matches!(self.mailbox, MailboxUse::On { .. })
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
/// While polling the mailbox, how often the socket is looked at too (a broker that died).
const SOCKET_LOOK_EVERY: Duration = Duration::from_micros(20);

/// What came back for the oldest request not answered.
enum Heard {
    /// Its reply's bytes (and fd).
    Reply(Vec<u8>, Vec<OwnedFd>),
    /// Nothing yet (looking without waiting), or nothing within the reply timeout.
    NotYet,
    /// The producer hung up.
    Closed,
}

/// Hear the reply that comes next on `channel`: wait (up to the reply timeout) if `block`,
/// else only look. Doorbells are skipped.
fn hear(conn: &mut Connection, channel: Channel, block: bool) -> Result<Heard> {
    match channel {
        Channel::Socket => {
            if let Some((bytes, fd)) = conn.early.pop_front() {
                return Ok(Heard::Reply(bytes, fd));
            }
            loop {
                let got = if block {
                    wire::recv_spin(conn.sock.as_fd(), wire::default_spin())?
                } else {
                    wire::try_recv(conn.sock.as_fd())?
                };
                return Ok(match got {
                    Received::Packet(p, _) if wire::is_doorbell(&p) => continue,
                    Received::Packet(p, fds) => Heard::Reply(p, fds),
                    Received::TimedOut => Heard::NotYet,
                    Received::Closed => Heard::Closed,
                });
            }
        }
        Channel::Mailbox(seq) => hear_mailbox(conn, seq, block),
    }
}

/// [`hear`] of the mailbox's reply to request `seq`: poll for the spin time (looking at the
/// socket now and then: a broker that died), then, with the polling flag down and one more
/// look, sleep on the socket until a doorbell (or the reply timeout).
fn hear_mailbox(conn: &mut Connection, seq: u64, block: bool) -> Result<Heard> {
    let MailboxUse::On { mailbox: mb, .. } = &conn.mailbox else {
        return Err(Error::Internal("a mailbox reply without a mailbox".into()));
    };
    let reply = |mb: &Mailbox| -> Result<Option<Heard>> {
        if mb.peer_seq() != seq {
            return Ok(None);
        }
        Ok(Some(Heard::Reply(mb.peer_bytes()?, Vec::new())))
    };
    if let Some(h) = reply(mb)? {
        return Ok(h);
    }
    if !block {
        return Ok(Heard::NotYet);
    }
    let (sock, early) = (&conn.sock, &mut conn.early);
    let polled = spin_poll(
        Instant::now(),
        wire::default_spin(),
        SOCKET_LOOK_EVERY,
        || reply(mb).transpose(),
        || match wire::try_recv(sock.as_fd()) {
            Err(e) => Some(Err(e)),
            Ok(Received::Packet(p, _)) if wire::is_doorbell(&p) => None,
            Ok(Received::Packet(p, fds)) => {
                early.push_back((p, fds));
                None
            }
            Ok(Received::TimedOut) => None,
            Ok(Received::Closed) => Some(Ok(Heard::Closed)),
        },
    );
    if let Some(heard) = polled {
        return heard;
    }
    // Dekker with the broker's `publish`: flag down, one more look, then sleep.
    mb.stop_polling();
    let heard = loop {
        if let Some(h) = reply(mb)? {
            break h;
        }
        match wire::recv(conn.sock.as_fd()) {
            Ok(Received::Packet(p, _)) if wire::is_doorbell(&p) => {}
            Ok(Received::Packet(p, fds)) => conn.early.push_back((p, fds)),
            Ok(Received::TimedOut) => break Heard::NotYet,
            Ok(Received::Closed) => break Heard::Closed,
            Err(e) => {
                mb.start_polling();
                return Err(e);
            }
        }
    };
    mb.start_polling();
    Ok(heard)
}

/// Ask the broker for the connection's mailbox (once; only with nothing unanswered).
/// Whatever goes wrong leaves the socket carrying everything, as before mailboxes.
fn ask_for_mailbox(conn: &mut Connection) {
    if !conn.unanswered.is_empty() || !conn.early.is_empty() {
        return;
    }
    conn.mailbox = MailboxUse::Off;
    let req = Request {
        op: Op::Mailbox,
        ..close_request(0, 0)
    };
    if wire::send(conn.sock.as_fd(), &req.encode(), &[]).is_err() {
        return;
    }
    match hear(conn, Channel::Socket, true) {
        Ok(Heard::Reply(bytes, fd)) => {
            let declined = match (Reply::decode(&bytes), fd.into_iter().next()) {
                (Ok(r), Some(fd)) if r.ok => match Mailbox::open(&fd) {
                    Ok(mailbox) => {
                        conn.mailbox = MailboxUse::On {
                            mailbox,
                            last_seq: 0,
                        };
                        return;
                    }
                    Err(e) => {
                        warn_no_mailbox_once(&e);
                        e.to_string()
                    }
                },
                (Ok(r), _) => r.message,
                (Err(e), _) => e.to_string(),
            };
            tracing::debug!(why = %declined, "no IPC mailbox from the producer: using the socket");
        }
        Ok(Heard::NotYet) => conn.unanswered.push_back(Sent {
            req,
            channel: Channel::Socket,
            timed_out: true,
        }),
        Ok(Heard::Closed) | Err(_) => {}
    }
}

/// Make the mailbox free for a new request: read the replies up to that of its last
/// request, waiting for it if `wait` and that request did not time out already. Returns
/// whether it is free and nothing else is unanswered (a request then may go through it).
fn free_mailbox(conn: &mut Connection, wait: bool) -> Result<bool> {
    let Some(last) = conn
        .unanswered
        .iter()
        .rposition(|s| matches!(s.channel, Channel::Mailbox(_)))
    else {
        return Ok(conn.unanswered.is_empty() && conn.early.is_empty());
    };
    let (Channel::Mailbox(seq), timed_out) = (
        conn.unanswered[last].channel,
        conn.unanswered[last].timed_out,
    ) else {
        return Ok(false);
    };
    let MailboxUse::On { mailbox: mb, .. } = &conn.mailbox else {
        return Ok(false);
    };
    if (timed_out || !wait) && mb.peer_seq() != seq {
        // Still unanswered (after a timeout, or not to be waited for): the socket carries
        // what comes next, and the broker answers the mailbox's request first.
        return Ok(false);
    }
    let mut stale_leases = Vec::new();
    for _ in 0..=last {
        let Some(channel) = conn.unanswered.front().map(|s| s.channel) else {
            break;
        };
        match hear(conn, channel, true)? {
            Heard::Reply(bytes, _) => late_reply(conn, &bytes, &mut stale_leases),
            Heard::NotYet => {
                if let Some(s) = conn.unanswered.get_mut(last) {
                    s.timed_out = true;
                }
                break;
            }
            Heard::Closed => break,
        }
    }
    end_stale(conn, stale_leases);
    Ok(conn.unanswered.is_empty() && conn.early.is_empty())
}

/// Send `packet` (the encoding of `req`, or of a batch `req` stands for): through the
/// mailbox when its reply needs no fd and the mailbox can take it, else over the socket.
/// With `wait_for_mailbox` (the caller waits for this reply anyway, which comes after the
/// earlier one) a mailbox busy with a request sent without waiting is waited for; without
/// (a close not waited for) the socket takes it, so closes stay pipelined when the broker
/// lags behind.
fn post(
    conn: &mut Connection,
    packet: &[u8],
    req: &Request,
    wait_for_mailbox: bool,
) -> Result<Channel> {
    if !req.want_fd && req.op != Op::Mailbox && packet.len() <= wire::MAX_PACKET {
        if matches!(conn.mailbox, MailboxUse::NotAsked) {
            ask_for_mailbox(conn);
        }
        if matches!(conn.mailbox, MailboxUse::On { .. }) && free_mailbox(conn, wait_for_mailbox)? {
            if let MailboxUse::On { mailbox, last_seq } = &mut conn.mailbox {
                *last_seq += 1;
                if mailbox.publish(*last_seq, packet) {
                    wire::ring(conn.sock.as_fd());
                }
                return Ok(Channel::Mailbox(*last_seq));
            }
        }
    }
    wire::send(conn.sock.as_fd(), packet, &[])?;
    Ok(Channel::Socket)
}

/// Send a close without waiting for its reply (the broker answers every request in order;
/// the reply is read with a later one). A close of a lease this importer holds fails only
/// if the producer is gone, which ended the lease already; a refusal is logged when read.
pub(super) fn send_close(conn: &mut Connection, req: &Request) -> Result<()> {
    send_close_packet(conn, &req.encode(), req)
}

/// [`send_close`] of `packet`, which `req` stands for in the queue of unanswered requests.
pub(super) fn send_close_packet(conn: &mut Connection, packet: &[u8], req: &Request) -> Result<()> {
    let channel = post(conn, packet, req, false)?;
    conn.unanswered.push_back(Sent {
        req: req.clone(),
        channel,
        timed_out: false,
    });
    let mut stale_leases = Vec::new();
    // Read what has come back already; wait only past the bound.
    while let Some(head) = conn.unanswered.front().map(|s| s.channel) {
        let block = conn.unanswered.len() > CLOSES_IN_FLIGHT;
        match hear(conn, head, block) {
            Ok(Heard::Reply(bytes, _)) => late_reply(conn, &bytes, &mut stale_leases),
            Ok(Heard::NotYet) if !block => break,
            Ok(Heard::NotYet) => {
                return Err(Error::Ipc(
                    "the producer did not answer in time (the reply timeout passed)".into(),
                ))
            }
            Ok(Heard::Closed) | Err(_) => break,
        }
    }
    end_stale(conn, stale_leases);
    Ok(())
}

/// Read the replies to every request sent on `conn` (before it is dropped).
pub(super) fn settle(conn: &mut Connection) {
    let mut stale_leases = Vec::new();
    while let Some(head) = conn.unanswered.front().map(|s| s.channel) {
        match hear(conn, head, true) {
            Ok(Heard::Reply(bytes, _)) => late_reply(conn, &bytes, &mut stale_leases),
            _ => return,
        }
    }
    end_stale(conn, stale_leases);
}

/// The reply to the oldest request this side did not wait for: discarded (its fds close
/// here); a lease it granted is noted in `stale_leases`, a refused close logged.
fn late_reply(conn: &mut Connection, bytes: &[u8], stale_leases: &mut Vec<(DeviceId, u32)>) {
    let reply = Reply::decode(bytes);
    let Some(Sent { req: late, .. }) = conn.unanswered.pop_front() else {
        tracing::warn!("a reply to no request from the producer; ignored");
        return;
    };
    match (late.op, &reply) {
        (Op::Open, Ok(r)) if r.ok => stale_leases.push((late.device, r.lease_key)),
        (Op::OpenMany, Ok(r)) if r.ok => stale_leases.extend(
            Batch::reply_leases(bytes)
                .into_iter()
                .map(|k| (late.device, k)),
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
pub(super) fn round_trip(conn: &mut Connection, req: &Request) -> Result<(Reply, Vec<OwnedFd>)> {
    let (bytes, fd) = exchange(conn, &req.encode(), req)?;
    Ok((Reply::decode(&bytes)?, fd))
}

/// Send `packet` (the encoding of `req`, or of a batch `req` stands for) and wait for its
/// reply's bytes (and fd), discarding the late replies of requests not waited for.
pub(super) fn exchange(
    conn: &mut Connection,
    packet: &[u8],
    req: &Request,
) -> Result<(Vec<u8>, Vec<OwnedFd>)> {
    let channel = match post(conn, packet, req, true) {
        Ok(c) => c,
        Err(e) => {
            // A broker that refused us (uid check) replied and hung up before our request:
            // its reply is still queued and says why, so read it even when the send failed.
            if conn.unanswered.is_empty() {
                if let Ok(Heard::Reply(bytes, _)) = hear(conn, Channel::Socket, true) {
                    if Reply::decode(&bytes).is_ok() {
                        return Ok((bytes, Vec::new()));
                    }
                }
            }
            return Err(e);
        }
    };
    let mut stale_leases = Vec::new();
    let answer = loop {
        let (head, late) = match conn.unanswered.front() {
            Some(s) => (s.channel, true),
            None => (channel, false),
        };
        match hear(conn, head, true) {
            Err(e) => break Err(e),
            Ok(Heard::Reply(bytes, fd)) => {
                if late {
                    // The reply to a request this side did not wait for: its fds close here.
                    late_reply(conn, &bytes, &mut stale_leases);
                    continue;
                }
                break Ok((bytes, fd));
            }
            Ok(Heard::Closed) => {
                break Err(Error::Ipc(
                    "the producer closed the connection (did it exit?)".into(),
                ))
            }
            Ok(Heard::NotYet) => {
                conn.unanswered.push_back(Sent {
                    req: req.clone(),
                    channel,
                    timed_out: true,
                });
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

    fn open(key: u32) -> Request {
        Request {
            op: Op::Open,
            want_fd: false,
            device: 0,
            key,
            arena_id: 1,
            token: [0; 16],
            generation: 0,
        }
    }

    fn granted(lease_key: u32) -> Reply {
        Reply {
            ok: true,
            pinning: false,
            lease_key,
            arena_bytes: 1 << 20,
            chunks: Vec::new(),
            message: String::new(),
        }
    }

    /// A broker on `theirs` that hands out a mailbox when asked, then answers `n` requests
    /// from either channel (the mailbox looked at first: it holds the older request) with
    /// `answer(i, request)`, or hangs up instead where `answer` says `None`. Returns what
    /// it was asked, and whether through the mailbox.
    fn fake_broker(
        theirs: OwnedFd,
        n: usize,
        answer: impl Fn(usize, &Request) -> Option<Reply> + Send + 'static,
    ) -> std::thread::JoinHandle<Vec<(Op, u32, bool)>> {
        std::thread::spawn(move || {
            let mut mailbox: Option<Mailbox> = None;
            let (mut served, mut seen) = (0u64, Vec::new());
            while seen.len() < n {
                if let Some(mb) = &mailbox {
                    let seq = mb.peer_seq();
                    if seq != served {
                        served = seq;
                        let req = Request::decode(&mb.peer_bytes().unwrap()).unwrap();
                        seen.push((req.op, req.key, true));
                        let Some(reply) = answer(seen.len() - 1, &req) else {
                            break;
                        };
                        if mb.publish(seq, &reply.encode()) {
                            wire::ring(theirs.as_fd());
                        }
                        continue;
                    }
                }
                let bytes = match wire::try_recv(theirs.as_fd()).unwrap() {
                    Received::Packet(p, _) if wire::is_doorbell(&p) => continue,
                    Received::Packet(p, _) => p,
                    Received::TimedOut => {
                        std::thread::sleep(Duration::from_micros(100));
                        continue;
                    }
                    Received::Closed => break,
                };
                let req = Request::decode(&bytes).unwrap();
                if req.op == Op::Mailbox {
                    let (mb, fd) = Mailbox::create().unwrap();
                    mailbox = Some(mb);
                    wire::send(theirs.as_fd(), &granted(1).encode(), &[fd.as_fd()]).unwrap();
                    continue;
                }
                seen.push((req.op, req.key, false));
                let Some(reply) = answer(seen.len() - 1, &req) else {
                    break;
                };
                wire::send(theirs.as_fd(), &reply.encode(), &[]).unwrap();
            }
            seen
        })
    }

    fn pair(reply_timeout: Duration) -> (Connection, OwnedFd) {
        let (ours, theirs) = rustix::net::socketpair(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )
        .unwrap();
        wire::set_recv_timeout(&ours, reply_timeout).unwrap();
        let mut conn = Connection::new(ours);
        // (Whatever the environment says: these tests are about the mailbox.)
        conn.mailbox = MailboxUse::NotAsked;
        (conn, theirs)
    }

    /// A broker that answers the first request only after the consumer gave up on it, and
    /// every later one at once: the late answer must not be taken for the next request's,
    /// and the lease it granted is ended.
    #[test]
    fn a_late_reply_is_discarded_and_its_lease_ended() {
        let (mut conn, theirs) = pair(Duration::from_millis(300));
        conn.mailbox = MailboxUse::Off;
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
                    granted(77)
                } else {
                    Reply::error(format!("answer to request {i}"))
                };
                wire::send(theirs.as_fd(), &reply.encode(), &[]).unwrap();
            }
            seen
        });
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

    /// The mailbox form of the test above: the late reply comes in the mailbox while the
    /// next request, with the mailbox busy, went over the socket.
    #[test]
    fn a_late_mailbox_reply_is_discarded_and_its_lease_ended() {
        let (mut conn, theirs) = pair(Duration::from_millis(300));
        let broker = fake_broker(theirs, 3, |i, _| {
            Some(if i == 0 {
                std::thread::sleep(Duration::from_millis(450));
                granted(77)
            } else {
                Reply::error(format!("answer to request {i}"))
            })
        });
        let first = round_trip(&mut conn, &open(5)).unwrap_err();
        assert!(conn.has_mailbox());
        assert!(first.to_string().contains("did not answer"), "{first}");
        assert_eq!(conn.unanswered.len(), 1);
        let (second, _) = round_trip(&mut conn, &open(6)).unwrap();
        assert_eq!(second.message, "answer to request 1", "took the late reply");
        assert!(conn.unanswered.is_empty());
        drop(conn);
        assert_eq!(
            broker.join().unwrap(),
            vec![
                (Op::Open, 5, true),
                (Op::Open, 6, false),
                (Op::Close, 77, true)
            ],
            "the mailbox was busy for the second; the lease granted late is ended"
        );
    }

    /// A reply slower than the spin: the consumer sleeps on the socket and the broker's
    /// doorbell wakes it; closes sent without waiting are read with the next request.
    #[test]
    fn a_consumer_asleep_on_a_slow_reply_is_woken_by_the_doorbell() {
        let (mut conn, theirs) = pair(Duration::from_secs(20));
        let broker = fake_broker(theirs, 4, |i, req| {
            if i == 0 {
                std::thread::sleep(Duration::from_millis(200));
            }
            Some(if req.op == Op::Open {
                granted(100 + i as u32)
            } else {
                Reply::error("refused close")
            })
        });
        let (r, _) = round_trip(&mut conn, &open(1)).unwrap();
        assert_eq!(r.lease_key, 100);
        send_close(&mut conn, &close_request(0, 100)).unwrap();
        let (r, _) = round_trip(&mut conn, &open(2)).unwrap();
        assert_eq!(
            r.lease_key, 102,
            "the close's reply was not taken for this one"
        );
        send_close(&mut conn, &close_request(0, 102)).unwrap();
        settle(&mut conn);
        assert!(conn.unanswered.is_empty());
        let seen = broker.join().unwrap();
        assert!(
            seen.iter().all(|s| s.2),
            "all through the mailbox: {seen:?}"
        );
    }

    /// A broker that dies while the consumer polls for its reply: the consumer hears the
    /// socket close (it looks at it while polling and sleeps on it after), no timeout.
    #[test]
    fn a_broker_that_dies_while_the_consumer_polls_is_noticed() {
        let (mut conn, theirs) = pair(Duration::from_secs(60));
        let broker = fake_broker(theirs, 1, |_, _| None);
        let e = round_trip(&mut conn, &open(1)).unwrap_err();
        assert!(e.to_string().contains("closed the connection"), "{e}");
        assert_eq!(broker.join().unwrap(), vec![(Op::Open, 1, true)]);
    }
}
