//! The producer's broker: a thread on a Unix socket in the abstract namespace that serves
//! consumers' lease requests, sending the arena's export fd with SCM_RIGHTS.
//!
//! - Peers are checked with `SO_PEERCRED`: by default only the broker's own effective uid is
//!   accepted; [`BrokerConfig::allowed_uids`] widens that. A refused peer gets an error reply
//!   and is disconnected.
//! - One thread per connection. A connection's leases end when it closes, so a consumer
//!   that crashes or is killed (SIGKILL) gives its memory back within the time the kernel
//!   takes to close its socket.
//! - A connection that holds no lease and says nothing for [`BrokerConfig::idle_timeout`]
//!   is closed, so a peer that connects and never speaks does not keep a thread forever.
//! - Malformed requests get an error reply; they never take the broker down.
//! - A consumer may ask for a shared-memory mailbox (`ipc/mailbox.rs`): then requests
//!   whose reply carries no fd come through it, decoded and checked exactly as socket
//!   packets are, and the connection's thread polls the mailbox (and, every few
//!   microseconds, the socket) for [`BrokerConfig::spin`] after each request before it
//!   sleeps on the socket, where a doorbell packet wakes it.

use std::collections::{HashMap, HashSet};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};

use crate::backend::DeviceId;
use crate::error::{Error, Result};
use crate::ipc::handle::{ShareHandle, MAX_SOCKET_NAME};
use crate::ipc::mailbox::{
    mailbox_enabled, next_inbound, warn_no_mailbox_once, Inbound, Mailbox, MAILBOX_BYTES,
    MAILBOX_MAGIC,
};
pub use crate::ipc::wire::default_spin;
use crate::ipc::wire::{self, Batch, Op, Reply, Request};
use crate::pool::Pool;

/// Broker settings.
#[derive(Debug, Clone)]
pub struct BrokerConfig {
    /// Uids allowed besides the broker's own effective uid.
    pub allowed_uids: Vec<u32>,
    /// Socket name in the abstract namespace; default `gpu-arena.<pid>.<random>`.
    pub socket_name: Option<String>,
    /// Close connections that hold no lease and send nothing for this long.
    pub idle_timeout: Duration,
    /// Most connections served at once.
    pub max_connections: usize,
    /// After each reply, how long a connection's thread polls for the consumer's next
    /// request before it sleeps (see `wire::recv_spin`): requests in a burst are served
    /// without a wake-up each. Costs up to this much CPU per burst; zero turns it off.
    pub spin: Duration,
    /// Whether consumers get a shared-memory mailbox for their requests when they ask
    /// (default: [`crate::ipc::mailbox_enabled`], on unless `GPU_ARENA_IPC_MAILBOX=0`).
    pub mailbox: bool,
}

impl Default for BrokerConfig {
    fn default() -> Self {
        BrokerConfig {
            allowed_uids: Vec::new(),
            socket_name: None,
            idle_timeout: Duration::from_secs(30),
            max_connections: 1024,
            spin: default_spin(),
            mailbox: mailbox_enabled(),
        }
    }
}

/// Counters of the broker.
#[derive(Debug, Default)]
struct BrokerCounters {
    connections_live: AtomicU64,
    refused_peers: AtomicU64,
    bad_requests: AtomicU64,
    leases_dropped_on_disconnect: AtomicU64,
    mailbox_requests: AtomicU64,
}

/// A snapshot of the broker's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct BrokerStats {
    /// Connections open now.
    pub connections_live: u64,
    /// Peers refused by the uid check.
    pub refused_peers: u64,
    /// Malformed or refused requests.
    pub bad_requests: u64,
    /// Leases closed because their connection ended (crashed or killed consumers).
    pub leases_dropped_on_disconnect: u64,
    /// Requests that came through a mailbox instead of the socket.
    pub mailbox_requests: u64,
}

struct Shared {
    pool: Arc<Pool>,
    config: BrokerConfig,
    own_uid: u32,
    stop: AtomicBool,
    counters: BrokerCounters,
    /// Live connections, so `Drop` can shut them down.
    conns: Mutex<HashMap<u64, Arc<OwnedFd>>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

/// The producer's broker. Dropping it stops the threads and closes every lease.
pub struct Broker {
    shared: Arc<Shared>,
    listener: Arc<OwnedFd>,
    /// The socket name, shared with every handle this broker makes.
    name: Arc<str>,
    pid: u32,
    accept_thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Broker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Broker")
            .field("socket", &self.name)
            .finish()
    }
}

fn random_suffix() -> String {
    let mut b = [0u8; 8];
    let _ = rustix::rand::getrandom(&mut b, rustix::rand::GetRandomFlags::empty());
    b.iter().map(|x| format!("{x:02x}")).collect()
}

impl Broker {
    /// Bind the socket and start serving `pool`'s shares.
    pub fn start(pool: Arc<Pool>, config: BrokerConfig) -> Result<Broker> {
        let pid = rustix::process::getpid().as_raw_nonzero().get() as u32;
        let name = config
            .socket_name
            .clone()
            .unwrap_or_else(|| format!("gpu-arena.{pid}.{}", random_suffix()));
        if name.is_empty()
            || name.len() > MAX_SOCKET_NAME
            || !name.chars().all(|c| c.is_ascii_graphic())
        {
            return Err(Error::invalid(format!(
                "broker socket name `{name}`: 1..{MAX_SOCKET_NAME} printable ASCII characters"
            )));
        }
        let ipc =
            |what: &str, e: rustix::io::Errno| Error::Ipc(format!("broker {what} `{name}`: {e}"));
        let listener = rustix::net::socket_with(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )
        .map_err(|e| ipc("socket", e))?;
        let addr =
            SocketAddrUnix::new_abstract_name(name.as_bytes()).map_err(|e| ipc("address", e))?;
        rustix::net::bind(&listener, &addr).map_err(|e| ipc("bind", e))?;
        rustix::net::listen(&listener, 128).map_err(|e| ipc("listen", e))?;
        let listener = Arc::new(listener);
        let shared = Arc::new(Shared {
            pool,
            config,
            own_uid: rustix::process::geteuid().as_raw(),
            stop: AtomicBool::new(false),
            counters: BrokerCounters::default(),
            conns: Mutex::new(HashMap::new()),
            threads: Mutex::new(Vec::new()),
        });
        let (s, l) = (shared.clone(), listener.clone());
        let accept_thread = std::thread::Builder::new()
            .name("gpu-arena-broker".into())
            .spawn(move || accept_loop(&s, &l))
            .map_err(|e| Error::Ipc(format!("spawning the broker thread failed: {e}")))?;
        tracing::info!(socket = %name, "gpu-arena broker listening");
        Ok(Broker {
            shared,
            listener,
            name: name.into(),
            pid,
            accept_thread: Some(accept_thread),
        })
    }

    /// The socket name (abstract namespace).
    pub fn socket_name(&self) -> &str {
        &self.name
    }

    /// The pool served.
    pub fn pool(&self) -> &Arc<Pool> {
        &self.shared.pool
    }

    /// Share `len` bytes at `ptr` and wrap the grant in a handle naming this broker.
    pub fn share(&self, ptr: u64, len: u64) -> Result<ShareHandle> {
        let info = self.shared.pool.share(ptr, len)?;
        Ok(ShareHandle {
            producer_pid: self.pid,
            socket_name: self.name.clone(),
            info,
        })
    }

    /// Revoke a share made by this broker.
    pub fn unshare(&self, handle: &ShareHandle) -> Result<()> {
        if handle.socket_name != self.name {
            return Err(Error::Ipc(format!(
                "unshare of a handle from another producer (socket `{}`)",
                handle.socket_name
            )));
        }
        self.shared.pool.unshare(
            handle.info.device,
            handle.info.share_key,
            &handle.info.token,
        )
    }

    /// Counters.
    pub fn stats(&self) -> BrokerStats {
        let c = &self.shared.counters;
        BrokerStats {
            connections_live: c.connections_live.load(Ordering::Relaxed),
            refused_peers: c.refused_peers.load(Ordering::Relaxed),
            bad_requests: c.bad_requests.load(Ordering::Relaxed),
            leases_dropped_on_disconnect: c.leases_dropped_on_disconnect.load(Ordering::Relaxed),
            mailbox_requests: c.mailbox_requests.load(Ordering::Relaxed),
        }
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        // Shutting a socket down wakes the thread blocked on it.
        let _ = rustix::net::shutdown(&*self.listener, rustix::net::Shutdown::Both);
        for c in self.shared.conns.lock().values() {
            let _ = rustix::net::shutdown(&**c, rustix::net::Shutdown::Both);
        }
        if let Some(t) = self.accept_thread.take() {
            let _ = t.join();
        }
        let threads = std::mem::take(&mut *self.shared.threads.lock());
        for t in threads {
            let _ = t.join();
        }
    }
}

fn accept_loop(shared: &Arc<Shared>, listener: &OwnedFd) {
    let mut next_id = 0u64;
    loop {
        let conn = match rustix::net::accept_with(listener, SocketFlags::CLOEXEC) {
            Ok(c) => c,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => {
                if !shared.stop.load(Ordering::SeqCst) {
                    tracing::error!(error = %e, "broker accept failed; broker stops");
                }
                return;
            }
        };
        if shared.stop.load(Ordering::SeqCst) {
            return;
        }
        // Reap finished connection threads.
        shared.threads.lock().retain(|t| !t.is_finished());
        let peer_uid = match rustix::net::sockopt::socket_peercred(&conn) {
            Ok(cred) => cred.uid.as_raw(),
            Err(e) => {
                tracing::warn!(error = %e, "SO_PEERCRED failed; connection refused");
                continue;
            }
        };
        let allowed = peer_uid == shared.own_uid || shared.config.allowed_uids.contains(&peer_uid);
        if !allowed {
            shared
                .counters
                .refused_peers
                .fetch_add(1, Ordering::Relaxed);
            let msg = format!(
                "uid {peer_uid} is not allowed by this producer (uid {})",
                shared.own_uid
            );
            refuse(conn, msg);
            continue;
        }
        if shared.conns.lock().len() >= shared.config.max_connections {
            refuse(conn, "too many connections".into());
            continue;
        }
        let conn = Arc::new(conn);
        next_id += 1;
        let id = next_id;
        shared.conns.lock().insert(id, conn.clone());
        shared
            .counters
            .connections_live
            .fetch_add(1, Ordering::Relaxed);
        let s = shared.clone();
        let spawned = std::thread::Builder::new()
            .name("gpu-arena-peer".into())
            .spawn(move || {
                serve(&s, &conn);
                s.conns.lock().remove(&id);
                s.counters.connections_live.fetch_sub(1, Ordering::Relaxed);
            });
        match spawned {
            Ok(t) => shared.threads.lock().push(t),
            Err(e) => {
                tracing::error!(error = %e, "spawning a connection thread failed");
                shared.conns.lock().remove(&id);
                shared
                    .counters
                    .connections_live
                    .fetch_sub(1, Ordering::Relaxed);
            }
        }
    }
}

/// Refusals being answered right now (each on a short-lived thread).
static REFUSING: AtomicU64 = AtomicU64::new(0);
/// Beyond this many at once, refused peers are hung up on without a reason.
const MAX_REFUSING: u64 = 32;

/// Tell a peer why it is refused, then hang up, off the accept thread. The peer's first
/// request is read (briefly waited for) before closing: closing a Unix socket with unread
/// data makes the peer see a reset instead of our reply. Past [`MAX_REFUSING`] concurrent
/// refusals (a flood) the peer is closed at once.
fn refuse(conn: OwnedFd, why: String) {
    if REFUSING.fetch_add(1, Ordering::SeqCst) >= MAX_REFUSING {
        REFUSING.fetch_sub(1, Ordering::SeqCst);
        return;
    }
    let spawned = std::thread::Builder::new()
        .name("gpu-arena-refuse".into())
        .spawn(move || {
            let _ = wire::send(conn.as_fd(), &Reply::error(why).encode(), &[]);
            if wire::set_recv_timeout(&conn, Duration::from_millis(200)).is_ok() {
                let _ = wire::recv(conn.as_fd());
            }
            REFUSING.fetch_sub(1, Ordering::SeqCst);
        });
    if spawned.is_err() {
        REFUSING.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Serve one consumer until it disconnects; then close every lease it still holds.
fn serve(shared: &Shared, conn: &OwnedFd) {
    // Lease keys are numbered per device: key the set by both.
    let mut leases: HashSet<(DeviceId, u32)> = HashSet::new();
    let tick = shared
        .config
        .idle_timeout
        .min(Duration::from_secs(1))
        .max(Duration::from_millis(10));
    if let Err(e) = wire::set_recv_timeout(conn, tick) {
        tracing::warn!(error = %e, "broker connection without receive timeout");
    }
    let mut mailbox: Option<Mailbox> = None;
    // The last mailbox request number answered (the consumer numbers from 1).
    let mut served = 0u64;
    let mut last_heard = Instant::now();
    let mut socket_first = false;
    while !shared.stop.load(Ordering::SeqCst) {
        let inbound = next_inbound(
            conn,
            mailbox.as_ref(),
            served,
            shared.config.spin,
            socket_first,
        );
        socket_first = matches!(&inbound, Inbound::Socket(p) if !wire::is_doorbell(p));
        let packet = match inbound {
            Inbound::Socket(p) => p,
            Inbound::Mailbox(seq) => {
                last_heard = Instant::now();
                served = seq;
                if let Some(mb) = &mailbox {
                    serve_mailbox(shared, conn, mb, seq, &mut leases);
                }
                continue;
            }
            Inbound::Idle => {
                if leases.is_empty() && last_heard.elapsed() >= shared.config.idle_timeout {
                    break;
                }
                continue;
            }
            Inbound::Closed => break,
        };
        last_heard = Instant::now();
        if let Some(mb) = &mailbox {
            // Requests are answered in the order the consumer sent them: one it published
            // in the mailbox before sending this packet goes first.
            let seq = mb.peer_seq();
            if seq != served {
                served = seq;
                serve_mailbox(shared, conn, mb, seq, &mut leases);
            }
        }
        let (bytes, fd) = if wire::is_doorbell(&packet) {
            continue;
        } else if packet.first() == Some(&(Op::Mailbox as u8)) && mailbox.is_none() {
            match Request::decode(&packet) {
                Ok(req) => open_mailbox(shared, &req, &mut mailbox),
                Err(e) => {
                    shared.counters.bad_requests.fetch_add(1, Ordering::Relaxed);
                    (Reply::error(e.to_string()).encode(), Vec::new())
                }
            }
        } else {
            let (bytes, fd, ok) = answer(shared, &packet, &mut leases);
            if !ok {
                shared.counters.bad_requests.fetch_add(1, Ordering::Relaxed);
            }
            (bytes, fd)
        };
        let fds: Vec<_> = fd.iter().map(|f| f.as_fd()).collect();
        if wire::send(conn.as_fd(), &bytes, &fds).is_err() {
            break;
        }
    }
    drop(mailbox);
    let dropped = leases.len() as u64;
    for (device, lease) in leases {
        if let Err(e) = shared.pool.close_lease(device, lease) {
            tracing::error!(error = %e, "closing a lease of a departed consumer failed");
        }
    }
    if dropped > 0 {
        shared
            .counters
            .leases_dropped_on_disconnect
            .fetch_add(dropped, Ordering::Relaxed);
        tracing::info!(
            leases = dropped,
            "consumer disconnected holding leases; dropped them"
        );
    }
}

/// Answer request `seq` of the mailbox in the mailbox, ringing the consumer's doorbell if
/// it may be asleep. The bytes are the consumer's: copied out, bounds-checked, decoded as a
/// socket packet is; a request whose reply would carry an fd is refused (fds travel only
/// over the socket).
fn serve_mailbox(
    shared: &Shared,
    conn: &OwnedFd,
    mb: &Mailbox,
    seq: u64,
    leases: &mut HashSet<(DeviceId, u32)>,
) {
    shared
        .counters
        .mailbox_requests
        .fetch_add(1, Ordering::Relaxed);
    let (bytes, ok) = match mb.peer_bytes() {
        Ok(packet) if Batch::is_batch(&packet) => {
            let (bytes, _no_fd, ok) = answer(shared, &packet, leases);
            (bytes, ok)
        }
        // Decoded once, here, as `answer` would.
        Ok(packet) => match Request::decode(&packet) {
            Ok(req) if req.want_fd || req.op == Op::Mailbox => {
                let why = "a request whose reply carries an fd must come over the socket";
                (Reply::error(why).encode(), false)
            }
            Ok(req) => {
                let (reply, fd) = handle(shared, &req, leases);
                drop(fd); // none: refused above
                (reply.encode(), reply.ok)
            }
            Err(e) => (Reply::error(e.to_string()).encode(), false),
        },
        Err(e) => (Reply::error(e.to_string()).encode(), false),
    };
    if !ok {
        shared.counters.bad_requests.fetch_add(1, Ordering::Relaxed);
    }
    if mb.publish(seq, &bytes) {
        wire::ring(conn.as_fd());
    }
}

/// Decode and serve one request or batch: the reply's bytes, its fd, and whether it
/// succeeded.
fn answer(
    shared: &Shared,
    packet: &[u8],
    leases: &mut HashSet<(DeviceId, u32)>,
) -> (Vec<u8>, Vec<OwnedFd>, bool) {
    if Batch::is_batch(packet) {
        let (ok, bytes) = match Batch::decode(packet) {
            Ok(batch) => handle_batch(shared, batch, leases),
            Err(e) => (false, Reply::error(e.to_string()).encode()),
        };
        (bytes, Vec::new(), ok)
    } else {
        let (reply, fd) = match Request::decode(packet) {
            Ok(req) => handle(shared, &req, leases),
            Err(e) => (Reply::error(e.to_string()), Vec::new()),
        };
        (reply.encode(), fd, reply.ok)
    }
}

/// Answer a consumer's request for a mailbox (op 5, on the socket): the reply carries its
/// fd. A broker with mailboxes off, or one whose memfd fails, declines (the consumer keeps
/// to the socket; not counted as a bad request).
fn open_mailbox(
    shared: &Shared,
    req: &Request,
    mailbox: &mut Option<Mailbox>,
) -> (Vec<u8>, Vec<OwnedFd>) {
    let zero = !req.want_fd
        && req.device == 0
        && req.key == 0
        && req.arena_id == 0
        && req.token == [0; 16]
        && req.generation == 0;
    if !zero {
        shared.counters.bad_requests.fetch_add(1, Ordering::Relaxed);
        return (
            Reply::error("malformed mailbox request").encode(),
            Vec::new(),
        );
    }
    if !shared.config.mailbox {
        return (
            Reply::error("mailboxes are off at this producer").encode(),
            Vec::new(),
        );
    }
    match Mailbox::create() {
        Ok((mb, fd)) => {
            *mailbox = Some(mb);
            let reply = Reply {
                ok: true,
                pinning: false,
                lease_key: (MAILBOX_MAGIC >> 48) as u32,
                arena_bytes: MAILBOX_BYTES as u64,
                chunks: Vec::new(),
                message: String::new(),
            };
            (reply.encode(), vec![fd])
        }
        Err(e) => {
            warn_no_mailbox_once(&e);
            (Reply::error(e.to_string()).encode(), Vec::new())
        }
    }
}

fn handle(
    shared: &Shared,
    req: &Request,
    leases: &mut HashSet<(DeviceId, u32)>,
) -> (Reply, Vec<OwnedFd>) {
    match req.op {
        Op::Open => match shared.pool.open_lease_named(
            req.device,
            req.key,
            &req.token,
            req.arena_id,
            req.generation,
            req.want_fd,
        ) {
            Ok(grant) => {
                leases.insert((req.device, grant.lease_key));
                // One fd: no lengths (it is the arena's); a grown arena's: one per chunk.
                let chunks = if grant.fds.len() > 1 {
                    grant.fds.iter().map(|(n, _)| *n).collect()
                } else {
                    Vec::new()
                };
                let reply = Reply {
                    ok: true,
                    pinning: grant.kind == crate::backend::ExportKind::Pinning,
                    lease_key: grant.lease_key,
                    arena_bytes: grant.share.arena_bytes,
                    chunks,
                    message: String::new(),
                };
                (reply, grant.fds.into_iter().map(|(_, fd)| fd).collect())
            }
            Err(e) => (Reply::error(e.to_string()), Vec::new()),
        },
        Op::OpenMany | Op::CloseMany => (Reply::error("malformed request"), Vec::new()),
        // (Served by `open_mailbox` on the socket; a second one is refused here.)
        Op::Mailbox => (
            Reply::error("malformed mailbox request (this connection has one)"),
            Vec::new(),
        ),
        Op::Close => {
            if !leases.contains(&(req.device, req.key)) {
                return (
                    Reply::error(format!("lease {} is not held by this connection", req.key)),
                    Vec::new(),
                );
            }
            match shared.pool.close_lease(req.device, req.key) {
                Ok(()) => {
                    leases.remove(&(req.device, req.key));
                    (
                        Reply {
                            ok: true,
                            pinning: false,
                            lease_key: req.key,
                            arena_bytes: 0,
                            chunks: Vec::new(),
                            message: String::new(),
                        },
                        Vec::new(),
                    )
                }
                Err(e) => (Reply::error(e.to_string()), Vec::new()),
            }
        }
    }
}

/// Serve a batch (one round trip for many leases; see `wire`'s module docs). Returns whether
/// it succeeded and the reply's bytes. All or nothing: a refused open ends the leases this
/// batch opened; a close of a lease this connection does not hold closes none.
fn handle_batch(
    shared: &Shared,
    batch: Batch,
    leases: &mut HashSet<(DeviceId, u32)>,
) -> (bool, Vec<u8>) {
    match batch {
        Batch::Open { device, shares } => {
            let mut opened: Vec<u32> = Vec::with_capacity(shares.len());
            for (i, (key, generation, arena_id, token)) in shares.iter().enumerate() {
                match shared.pool.open_lease_named(
                    device,
                    *key,
                    token,
                    *arena_id,
                    *generation,
                    false,
                ) {
                    Ok(grant) => opened.push(grant.lease_key),
                    Err(e) => {
                        for lease in opened {
                            let _ = shared.pool.close_lease(device, lease);
                        }
                        let why = format!("batch entry {i}: {e}");
                        return (false, Reply::error(why).encode());
                    }
                }
            }
            leases.extend(opened.iter().map(|&l| (device, l)));
            (true, Batch::open_reply(&opened))
        }
        Batch::Close {
            device,
            leases: keys,
        } => {
            let mut seen = HashSet::with_capacity(keys.len());
            if let Some(k) = keys
                .iter()
                .find(|&&k| !leases.contains(&(device, k)) || !seen.insert(k))
            {
                let why = format!("lease {k} is not held by this connection (or listed twice)");
                return (false, Reply::error(why).encode());
            }
            let mut first_error = None;
            for k in &keys {
                leases.remove(&(device, *k));
                if let Err(e) = shared.pool.close_lease(device, *k) {
                    first_error.get_or_insert_with(|| e.to_string());
                }
            }
            let reply = match first_error {
                None => Reply {
                    ok: true,
                    pinning: false,
                    lease_key: keys.len() as u32,
                    arena_bytes: 0,
                    chunks: Vec::new(),
                    message: String::new(),
                },
                Some(why) => Reply::error(why),
            };
            (reply.ok, reply.encode())
        }
    }
}
