//! The transfer engine: registrations, loaded remote registrations, requests, and the
//! thread that hears other engines. See the module docs of [`crate::transfer`] for the rules.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::descs::{plan, Copy, Desc, Op, Span};
use super::socket::Endpoint;
use super::wire::{Message, PublicData, MAX_NAME_BYTES, MAX_NOTIF_BYTES};
use crate::backend::{Backend, Event};
use crate::error::{Error, Result};
use crate::ids::{DeviceId, StreamId};
use crate::ipc::{Broker, Importer, ShareHandle};

/// How an engine is set up.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// The agent's name (NIXL's agent name): how peers address it.
    pub agent: String,
    /// Streams per device that transfers are spread over (at least 1).
    pub streams_per_device: usize,
    /// How long `deregister` waits for consumers to close their imports before it returns
    /// anyway (the memory then comes back when they do, or when they exit).
    pub revoke_timeout: Duration,
    /// Other uids whose engines may message this one (its own uid always may).
    pub allowed_uids: Vec<u32>,
}

impl EngineConfig {
    /// Defaults for agent `agent`: 4 streams per device, a 10 s revocation wait.
    pub fn new(agent: impl Into<String>) -> EngineConfig {
        EngineConfig {
            agent: agent.into(),
            streams_per_device: 4,
            revoke_timeout: Duration::from_secs(10),
            allowed_uids: Vec::new(),
        }
    }
}

/// Where a transfer request stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum XferStatus {
    /// Prepared, not posted (or done and not posted again).
    Idle,
    /// Copies queued, not all complete.
    InProgress,
    /// Every copy completed (and its notification, if any, was sent).
    Done,
}

/// Counters of one engine.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Local registrations now.
    pub registrations: u64,
    /// Remote registrations loaded (imported) now.
    pub remote_loaded: u64,
    /// Requests posted.
    pub posted: u64,
    /// Copies queued.
    pub copies: u64,
    /// Bytes queued.
    pub bytes: u64,
    /// Notifications sent / received.
    pub notifs_sent: u64,
    /// Notifications received.
    pub notifs_received: u64,
    /// Revocations this engine sent as a producer.
    pub revokes_sent: u64,
    /// Revocations this engine carried out as a consumer.
    pub revoked: u64,
    /// Deregistrations that stopped waiting for consumers (`revoke_timeout`).
    pub revoke_timeouts: u64,
}

#[derive(Debug, Default)]
struct Counters {
    posted: AtomicU64,
    copies: AtomicU64,
    bytes: AtomicU64,
    notifs_sent: AtomicU64,
    notifs_received: AtomicU64,
    revokes_sent: AtomicU64,
    revoked: AtomicU64,
    revoke_timeouts: AtomicU64,
}

#[derive(Debug)]
struct LocalReg {
    addr: u64,
    len: u64,
    device: DeviceId,
    share: ShareHandle,
    /// Consumers that said they loaded it: (agent, socket).
    loaded_by: Vec<(String, String)>,
    /// Being deregistered: consumers that load it now are told to close at once.
    revoking: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum RemoteState {
    Live,
    /// Its import is being closed (revocation or unload); transfers are refused.
    Closing,
    /// The producer took it back; the import is closed. Kept so transfers fail clearly.
    Revoked,
}

#[derive(Debug)]
struct RemoteReg {
    agent: String,
    producer_socket: String,
    key: u64,
    addr: u64,
    len: u64,
    local: u64,
    device: DeviceId,
    state: RemoteState,
}

#[derive(Debug)]
struct Request {
    copies: Vec<Copy>,
    remotes: Vec<u64>,
    notify_to: Option<String>,
    in_flight: Option<InFlight>,
}

#[derive(Debug)]
struct InFlight {
    events: Vec<Event>,
    notif: Option<Vec<u8>>,
}

#[derive(Debug, Default)]
struct State {
    next_id: u64,
    locals: HashMap<u64, LocalReg>,
    remotes: HashMap<u64, RemoteReg>,
    peers: HashMap<String, String>,
    requests: HashMap<u64, Request>,
    notifs: Vec<(String, Vec<u8>)>,
    streams: HashMap<DeviceId, Vec<StreamId>>,
    next_stream: usize,
}

/// Metadata ids: local registrations are even, loaded remote ones odd.
fn is_remote(md: u64) -> bool {
    md & 1 == 1
}

impl State {
    fn take_id(&mut self, remote: bool) -> u64 {
        self.next_id += 1;
        (self.next_id << 1) | u64::from(remote)
    }

    fn local_span(&self, md: u64) -> Result<Span> {
        let r = self.locals.get(&md).ok_or_else(|| {
            Error::invalid(format!(
                "metadata {md:#x} is not a registration of this agent"
            ))
        })?;
        if r.revoking {
            return Err(Error::InvalidState(
                "its registration is being deregistered".into(),
            ));
        }
        Ok(Span {
            addr: r.addr,
            len: r.len,
            local: r.addr,
            device: r.device,
        })
    }

    fn remote_span(&self, md: u64, agent: &str) -> Result<Span> {
        let r = self
            .remotes
            .get(&md)
            .filter(|r| r.agent == agent)
            .ok_or_else(|| {
                Error::invalid(format!(
                    "metadata {md:#x} is not loaded from agent `{agent}`"
                ))
            })?;
        match r.state {
            RemoteState::Live => Ok(Span {
                addr: r.addr,
                len: r.len,
                local: r.local,
                device: r.device,
            }),
            _ => Err(revoked(r)),
        }
    }

    /// The streams of `device`, made on first use.
    fn streams_of(
        &mut self,
        backend: &dyn Backend,
        device: DeviceId,
        n: usize,
    ) -> Result<&[StreamId]> {
        let list = self.streams.entry(device).or_default();
        while list.len() < n.max(1) {
            list.push(backend.create_stream(device)?);
        }
        Ok(list)
    }

    /// An event on every stream of the engine: complete when everything queued so far is.
    fn fence(&self, backend: &dyn Backend) -> Result<Vec<Event>> {
        let mut events = Vec::new();
        for (&device, list) in &self.streams {
            for &s in list {
                match backend.record_event(device, s) {
                    Ok(e) => events.push(e),
                    Err(e) => {
                        destroy_events(backend, events);
                        return Err(e);
                    }
                }
            }
        }
        Ok(events)
    }
}

fn revoked(r: &RemoteReg) -> Error {
    Error::InvalidState(format!(
        "agent `{}` took back its registration {} ([{:#x}, +{})): the memory was revoked by its producer; load the agent's metadata again if it registers memory anew",
        r.agent, r.key, r.addr, r.len
    ))
}

fn destroy_events(backend: &dyn Backend, events: Vec<Event>) {
    for e in events {
        if let Err(err) = backend.destroy_event(e) {
            tracing::warn!(error = %err, "destroying a transfer event failed");
        }
    }
}

/// Wait until every event completed, then destroy them.
fn wait_events(backend: &dyn Backend, events: Vec<Event>) -> Result<()> {
    let mut result = Ok(());
    let mut pause = Duration::from_micros(10);
    for e in &events {
        loop {
            match backend.event_done(e) {
                Ok(true) => break,
                Ok(false) => {
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_millis(1));
                }
                Err(err) => {
                    result = Err(err);
                    break;
                }
            }
        }
    }
    destroy_events(backend, events);
    result
}

struct Inner {
    config: EngineConfig,
    broker: Arc<Broker>,
    importer: Arc<Importer>,
    endpoint: Endpoint,
    state: Mutex<State>,
    closed: Condvar,
    stop: AtomicBool,
    counters: Counters,
}

/// A transfer engine: one per NIXL agent and backend instance. See [`crate::transfer`].
pub struct TransferEngine {
    inner: Arc<Inner>,
    listener: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for TransferEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransferEngine")
            .field("agent", &self.inner.config.agent)
            .field("socket", &self.inner.endpoint.name())
            .finish()
    }
}

fn check_name(what: &str, name: &str) -> Result<()> {
    if name.is_empty() || name.len() > MAX_NAME_BYTES || name.contains('\0') {
        return Err(Error::invalid(format!(
            "{what} `{name}`: 1..{MAX_NAME_BYTES} bytes, no NUL"
        )));
    }
    Ok(())
}

impl TransferEngine {
    /// Start an engine for `config.agent`, sharing through `broker` and importing through
    /// `importer` (the process's own: one mapping per producer arena, whoever imports).
    pub fn start(
        broker: Arc<Broker>,
        importer: Arc<Importer>,
        config: EngineConfig,
    ) -> Result<TransferEngine> {
        check_name("agent name", &config.agent)?;
        let pid = rustix::process::getpid().as_raw_nonzero().get();
        let mut rnd = [0u8; 8];
        rustix::rand::getrandom(&mut rnd, rustix::rand::GetRandomFlags::empty())
            .map_err(|e| Error::Ipc(format!("getrandom: {e}")))?;
        let hex: String = rnd.iter().map(|b| format!("{b:02x}")).collect();
        let endpoint = Endpoint::bind(
            &format!("gpu-arena-xfer.{pid}.{hex}"),
            config.allowed_uids.clone(),
        )?;
        let inner = Arc::new(Inner {
            config,
            broker,
            importer,
            endpoint,
            state: Mutex::new(State::default()),
            closed: Condvar::new(),
            stop: AtomicBool::new(false),
            counters: Counters::default(),
        });
        let heard = inner.clone();
        let listener = std::thread::Builder::new()
            .name("gpu-arena-xfer".into())
            .spawn(move || heard.listen())
            .map_err(|e| Error::Ipc(format!("spawning the transfer thread failed: {e}")))?;
        Ok(TransferEngine {
            inner,
            listener: Some(listener),
        })
    }

    /// The agent's name.
    pub fn agent(&self) -> &str {
        &self.inner.config.agent
    }

    /// What peers need to reach this engine (NIXL's `getConnInfo`): its socket name.
    pub fn conn_info(&self) -> &str {
        self.inner.endpoint.name()
    }

    /// Remember how to reach `agent` (NIXL's `loadRemoteConnInfo`).
    pub fn load_conn_info(&self, agent: &str, info: &str) -> Result<()> {
        check_name("agent name", agent)?;
        if !info.starts_with("gpu-arena-xfer.") || info.len() > MAX_NAME_BYTES {
            return Err(Error::invalid(format!(
                "connection info of agent `{agent}` is not a gpu-arena transfer socket: `{info}`"
            )));
        }
        self.inner
            .state
            .lock()
            .peers
            .insert(agent.to_owned(), info.to_owned());
        Ok(())
    }

    /// Forget `agent`'s connection info (NIXL's `disconnect`).
    pub fn forget_agent(&self, agent: &str) {
        self.inner.state.lock().peers.remove(agent);
    }

    /// Register `len` bytes at `addr`, which must lie inside one live gpu-arena allocation:
    /// it is shared (its arena exported once, whoever imports it). Returns its metadata id.
    pub fn register(&self, addr: u64, len: u64) -> Result<u64> {
        let pool = self.inner.broker.pool();
        let (_, _, device) = pool.allocation_containing(addr).map_err(|e| {
            Error::invalid(format!(
                "register [{addr:#x}, +{len}): not gpu-arena memory ({e}); allocate it through gpu-arena (gpu_arena.torch.install(), gpu_arena_malloc)"
            ))
        })?;
        let share = self.inner.broker.share(addr, len)?;
        let mut st = self.inner.state.lock();
        let md = st.take_id(false);
        st.locals.insert(
            md,
            LocalReg {
                addr,
                len,
                device,
                share,
                loaded_by: Vec::new(),
                revoking: false,
            },
        );
        Ok(md)
    }

    /// The public data of a registration (NIXL's `getPublicData`).
    pub fn public_data(&self, md: u64) -> Result<String> {
        let st = self.inner.state.lock();
        let r = st.locals.get(&md).ok_or_else(|| {
            Error::invalid(format!(
                "metadata {md:#x} is not a registration of this agent"
            ))
        })?;
        Ok(PublicData {
            socket: self.conn_info().to_owned(),
            key: md,
            addr: r.addr,
            len: r.len,
            share: r.share.clone(),
        }
        .encode())
    }

    /// End registrations: no new import of them, every consumer that loaded one is told to
    /// close it, and this returns once they all did (their leases ended: closed, or the
    /// consumer died) or `revoke_timeout` passed. Unknown ids are refused before anything
    /// changes.
    pub fn deregister(&self, mds: &[u64]) -> Result<()> {
        self.inner.deregister(mds)
    }

    /// Load a remote registration from its public data (NIXL's `loadRemoteMD`): import its
    /// share (one mapping per producer arena) and tell the producer. Returns its metadata id.
    pub fn load_remote(&self, agent: &str, public: &str) -> Result<u64> {
        check_name("agent name", agent)?;
        let pd = PublicData::decode(public)?;
        let loaded = Message::Loaded {
            from: self.agent().to_owned(),
            reply_to: self.conn_info().to_owned(),
            key: pd.key,
        };
        // Told first, so a deregistration that races with this import revokes it too.
        self.inner.endpoint.send(&pd.socket, &loaded).map_err(|e| {
            Error::Ipc(format!("agent `{agent}` does not answer at its transfer socket ({e}): is it still running?"))
        })?;
        let local = match self.inner.importer.import(&pd.share) {
            Ok(p) => p,
            Err(e) => {
                self.inner.tell(
                    &pd.socket,
                    &Message::Unloaded {
                        from: self.agent().to_owned(),
                        key: pd.key,
                    },
                );
                return Err(e);
            }
        };
        let mut st = self.inner.state.lock();
        let md = st.take_id(true);
        st.remotes.insert(
            md,
            RemoteReg {
                agent: agent.to_owned(),
                producer_socket: pd.socket,
                key: pd.key,
                addr: pd.addr,
                len: pd.len,
                local,
                device: pd.share.info.device,
                state: RemoteState::Live,
            },
        );
        Ok(md)
    }

    /// Close a loaded remote registration (NIXL's `unloadMD`): after the copies queued on
    /// it completed, its import is closed and the producer told. A local id is accepted and
    /// changes nothing (what `loadLocalMD` handed out).
    pub fn unload(&self, md: u64) -> Result<()> {
        if !is_remote(md) {
            return Ok(());
        }
        self.inner.close_remote(md, false)
    }

    /// Check that `md` is a registration of this engine, for transfers within the agent
    /// (NIXL's `loadLocalMD`): the id stands for itself.
    pub fn load_local(&self, md: u64) -> Result<u64> {
        self.inner.state.lock().local_span(md).map(|_| md)
    }

    /// Prepare a transfer between `local` descriptors and `remote` ones of `agent` (this
    /// agent's own name for a transfer within it). Every descriptor is checked now.
    pub fn prepare(&self, op: Op, local: &[Desc], remote: &[Desc], agent: &str) -> Result<u64> {
        let mut st = self.inner.state.lock();
        let own = agent == self.agent();
        let copies = plan(
            op,
            local,
            remote,
            |md| st.local_span(md),
            |md| {
                if own {
                    st.local_span(md)
                } else {
                    st.remote_span(md, agent)
                }
            },
        )?;
        let mut remotes: Vec<u64> = if own {
            Vec::new()
        } else {
            remote.iter().map(|d| d.md).collect()
        };
        remotes.sort_unstable();
        remotes.dedup();
        let notify_to = if own {
            Some(self.conn_info().to_owned())
        } else {
            st.peers.get(agent).cloned().or_else(|| {
                remotes
                    .first()
                    .and_then(|m| st.remotes.get(m))
                    .map(|r| r.producer_socket.clone())
            })
        };
        let id = st.take_id(false);
        st.requests.insert(
            id,
            Request {
                copies,
                remotes,
                notify_to,
                in_flight: None,
            },
        );
        Ok(id)
    }

    /// Post a prepared request: queue its copies over the streams of their devices, and
    /// send `notif` to the peer once they complete. Refused while it is in flight, or when
    /// a remote registration it uses was revoked.
    pub fn post(&self, request: u64, notif: Option<Vec<u8>>) -> Result<XferStatus> {
        self.inner.post(request, notif)
    }

    /// Where a posted request stands; on completion its notification is sent.
    pub fn check(&self, request: u64) -> Result<XferStatus> {
        self.inner.check(request)
    }

    /// Release a request; one in flight is waited for first (a copy cannot be cancelled).
    pub fn release(&self, request: u64) -> Result<()> {
        let req = self
            .inner
            .state
            .lock()
            .requests
            .remove(&request)
            .ok_or_else(|| {
                Error::invalid(format!(
                    "transfer request {request:#x} is not live (released twice?)"
                ))
            })?;
        if let Some(f) = req.in_flight {
            wait_events(self.inner.backend(), f.events)?;
        }
        Ok(())
    }

    /// Send a notification to `agent` (NIXL's `genNotif`).
    pub fn notify(&self, agent: &str, body: &[u8]) -> Result<()> {
        let to = self
            .inner
            .state
            .lock()
            .peers
            .get(agent)
            .cloned()
            .ok_or_else(|| {
                Error::invalid(format!(
                    "no connection info for agent `{agent}`: load its metadata first"
                ))
            })?;
        self.inner.send_notif(&to, body)
    }

    /// The notifications received since the last call, oldest first: (agent, body).
    pub fn take_notifs(&self) -> Vec<(String, Vec<u8>)> {
        std::mem::take(&mut self.inner.state.lock().notifs)
    }

    /// The engine's counters.
    pub fn stats(&self) -> EngineStats {
        let c = &self.inner.counters;
        let st = self.inner.state.lock();
        let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
        EngineStats {
            registrations: st.locals.len() as u64,
            remote_loaded: st
                .remotes
                .values()
                .filter(|r| r.state == RemoteState::Live)
                .count() as u64,
            posted: n(&c.posted),
            copies: n(&c.copies),
            bytes: n(&c.bytes),
            notifs_sent: n(&c.notifs_sent),
            notifs_received: n(&c.notifs_received),
            revokes_sent: n(&c.revokes_sent),
            revoked: n(&c.revoked),
            revoke_timeouts: n(&c.revoke_timeouts),
        }
    }
}

impl Drop for TransferEngine {
    /// Waits for requests in flight, closes every import, ends every registration (telling
    /// consumers), destroys the streams and stops the thread.
    fn drop(&mut self) {
        let inner = &self.inner;
        let (requests, remotes, locals) = {
            let mut st = inner.state.lock();
            let requests: Vec<Request> = st.requests.drain().map(|(_, r)| r).collect();
            let remotes: Vec<u64> = st.remotes.keys().copied().collect();
            let locals: Vec<u64> = st.locals.keys().copied().collect();
            (requests, remotes, locals)
        };
        for r in requests {
            if let Some(f) = r.in_flight {
                if let Err(e) = wait_events(inner.backend(), f.events) {
                    tracing::warn!(error = %e, "waiting for a transfer at engine shutdown failed");
                }
            }
        }
        for md in remotes {
            if let Err(e) = inner.close_remote(md, false) {
                tracing::warn!(error = %e, "closing an import at engine shutdown failed");
            }
        }
        if let Err(e) = inner.deregister(&locals) {
            tracing::warn!(error = %e, "ending registrations at engine shutdown failed");
        }
        inner.stop.store(true, Ordering::SeqCst);
        inner.endpoint.wake();
        if let Some(t) = self.listener.take() {
            let _ = t.join();
        }
        let streams: Vec<(DeviceId, Vec<StreamId>)> = inner.state.lock().streams.drain().collect();
        for (device, list) in streams {
            for s in list {
                if let Err(e) = inner.backend().destroy_stream(device, s) {
                    tracing::warn!(error = %e, "destroying a transfer stream failed");
                }
            }
        }
    }
}

impl Inner {
    fn backend(&self) -> &dyn Backend {
        &**self.broker.pool().backend()
    }

    /// Send, logging a failure (the peer may have exited: nothing to do about it).
    fn tell(&self, to: &str, msg: &Message) {
        if let Err(e) = self.endpoint.send(to, msg) {
            tracing::debug!(error = %e, "transfer message not delivered");
        }
    }

    fn send_notif(&self, to: &str, body: &[u8]) -> Result<()> {
        if body.len() > MAX_NOTIF_BYTES {
            return Err(Error::invalid(format!(
                "notification of {} bytes (at most {MAX_NOTIF_BYTES})",
                body.len()
            )));
        }
        let msg = Message::Notif {
            from: self.config.agent.clone(),
            body: body.to_vec(),
        };
        self.endpoint.send(to, &msg)?;
        self.counters.notifs_sent.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn post(&self, request: u64, notif: Option<Vec<u8>>) -> Result<XferStatus> {
        if notif.as_ref().is_some_and(|b| b.len() > MAX_NOTIF_BYTES) {
            return Err(Error::invalid(format!(
                "notification longer than {MAX_NOTIF_BYTES} bytes"
            )));
        }
        let backend = self.backend();
        let mut guard = self.state.lock();
        let st = &mut *guard;
        let req = st
            .requests
            .get(&request)
            .ok_or_else(|| Error::invalid(format!("transfer request {request:#x} is not live")))?;
        if req.in_flight.is_some() {
            return Err(Error::InvalidState(format!(
                "transfer request {request:#x} is still in flight"
            )));
        }
        for md in &req.remotes {
            match st.remotes.get(md) {
                Some(r) if r.state == RemoteState::Live => {}
                Some(r) => return Err(revoked(r)),
                None => return Err(Error::invalid(format!("metadata {md:#x} was unloaded"))),
            }
        }
        let copies = req.copies.clone();
        let mut used: Vec<(DeviceId, StreamId)> = Vec::new();
        let n = self.config.streams_per_device;
        let mut queued = Ok(());
        for c in &copies {
            let pick = st.next_stream;
            st.next_stream = st.next_stream.wrapping_add(1);
            let stream = match st.streams_of(backend, c.device, n) {
                Ok(list) => list[pick % list.len()],
                Err(e) => {
                    queued = Err(e);
                    break;
                }
            };
            if let Err(e) = backend.copy_async(c.device, stream, c.dst, c.src, c.len) {
                queued = Err(e);
                break;
            }
            if !used.contains(&(c.device, stream)) {
                used.push((c.device, stream));
            }
        }
        let mut events = Vec::with_capacity(used.len());
        for &(device, stream) in &used {
            match backend.record_event(device, stream) {
                Ok(e) => events.push(e),
                Err(e) => {
                    queued = queued.and(Err(e));
                }
            }
        }
        if let Err(e) = queued {
            // What was queued still runs: wait for it before reporting the failure.
            drop(guard);
            let _ = wait_events(backend, events);
            return Err(e);
        }
        self.counters.posted.fetch_add(1, Ordering::Relaxed);
        self.counters
            .copies
            .fetch_add(copies.len() as u64, Ordering::Relaxed);
        let bytes: u64 = copies.iter().map(|c| c.len).sum();
        self.counters.bytes.fetch_add(bytes, Ordering::Relaxed);
        if let Some(req) = st.requests.get_mut(&request) {
            req.in_flight = Some(InFlight { events, notif });
        }
        drop(guard);
        self.check(request)
    }

    fn check(&self, request: u64) -> Result<XferStatus> {
        let backend = self.backend();
        let mut st = self.state.lock();
        let req = st
            .requests
            .get_mut(&request)
            .ok_or_else(|| Error::invalid(format!("transfer request {request:#x} is not live")))?;
        let Some(f) = &req.in_flight else {
            return Ok(XferStatus::Idle);
        };
        for e in &f.events {
            if !backend.event_done(e)? {
                return Ok(XferStatus::InProgress);
            }
        }
        let Some(f) = req.in_flight.take() else {
            return Ok(XferStatus::Idle);
        };
        let to = req.notify_to.clone();
        drop(st);
        destroy_events(backend, f.events);
        if let Some(body) = f.notif {
            let to = to.ok_or_else(|| {
                Error::invalid("no peer to notify: load its connection info first")
            })?;
            self.send_notif(&to, &body)?;
        }
        Ok(XferStatus::Done)
    }

    fn deregister(&self, mds: &[u64]) -> Result<()> {
        let mut revoking = Vec::new();
        {
            let mut st = self.state.lock();
            if let Some(md) = mds.iter().find(|m| !st.locals.contains_key(m)) {
                return Err(Error::invalid(format!(
                    "metadata {md:#x} is not a registration of this agent (deregistered twice?)"
                )));
            }
            for md in mds {
                if let Some(r) = st.locals.get_mut(md) {
                    r.revoking = true;
                    revoking.push((*md, r.share.clone(), std::mem::take(&mut r.loaded_by)));
                }
            }
        }
        let pool = self.broker.pool();
        for (md, share, loaded_by) in &revoking {
            if let Err(e) = self.broker.unshare(share) {
                tracing::warn!(error = %e, "unshare of a registration failed");
            }
            for (agent, socket) in loaded_by {
                tracing::debug!(agent = %agent, key = md, "revoking a consumer's import");
                self.tell(
                    socket,
                    &Message::Revoke {
                        from: self.config.agent.clone(),
                        key: *md,
                    },
                );
                self.counters.revokes_sent.fetch_add(1, Ordering::Relaxed);
            }
        }
        let start = Instant::now();
        let mut pause = Duration::from_micros(50);
        for (md, share, _) in &revoking {
            let info = &share.info;
            loop {
                let leases = pool
                    .share_leases(info.device, info.share_key, &info.token)
                    .unwrap_or(0);
                if leases == 0 {
                    break;
                }
                if start.elapsed() >= self.config.revoke_timeout {
                    self.counters
                        .revoke_timeouts
                        .fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(key = md, leases, "consumers did not close their imports in time: the memory comes back when they do or exit");
                    break;
                }
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(5));
            }
        }
        let mut st = self.state.lock();
        for (md, _, _) in &revoking {
            st.locals.remove(md);
        }
        Ok(())
    }

    /// Close a remote registration's import once the copies queued so far completed.
    /// `revoke`: the producer asked (the entry stays, revoked); else an unload (it goes).
    fn close_remote(&self, md: u64, revoke: bool) -> Result<()> {
        let backend = self.backend();
        let (local, socket, key, fence) = {
            let mut st = self.state.lock();
            loop {
                match st.remotes.get(&md).map(|r| r.state.clone()) {
                    None => {
                        return Err(Error::invalid(format!(
                            "metadata {md:#x} is not loaded (unloaded twice?)"
                        )))
                    }
                    Some(RemoteState::Closing) => self.closed.wait(&mut st),
                    Some(RemoteState::Revoked) => {
                        if !revoke {
                            st.remotes.remove(&md);
                        }
                        return Ok(());
                    }
                    Some(RemoteState::Live) => break,
                }
            }
            let fence = st.fence(backend)?;
            let Some(r) = st.remotes.get_mut(&md) else {
                return Err(Error::Internal(
                    "remote registration vanished under the lock".into(),
                ));
            };
            r.state = RemoteState::Closing;
            (r.local, r.producer_socket.clone(), r.key, fence)
        };
        let waited = wait_events(backend, fence);
        let closed = waited.and_then(|()| self.importer.close(local));
        let mut st = self.state.lock();
        if revoke {
            if let Some(r) = st.remotes.get_mut(&md) {
                r.state = RemoteState::Revoked;
            }
            self.counters.revoked.fetch_add(1, Ordering::Relaxed);
        } else {
            st.remotes.remove(&md);
        }
        drop(st);
        self.closed.notify_all();
        self.tell(
            &socket,
            &Message::Unloaded {
                from: self.config.agent.clone(),
                key,
            },
        );
        closed
    }

    /// The thread that hears other engines.
    fn listen(&self) {
        while !self.stop.load(Ordering::SeqCst) {
            let msg = match self.endpoint.recv() {
                Ok(Some(m)) => m,
                Ok(None) => continue,
                Err(e) => {
                    tracing::error!(error = %e, "transfer socket failed; the engine hears no peer any more");
                    return;
                }
            };
            match msg {
                Message::Notif { from, body } => {
                    self.counters
                        .notifs_received
                        .fetch_add(1, Ordering::Relaxed);
                    self.state.lock().notifs.push((from, body));
                }
                Message::Loaded {
                    from,
                    reply_to,
                    key,
                } => {
                    let mut st = self.state.lock();
                    match st.locals.get_mut(&key) {
                        Some(r) if !r.revoking => r.loaded_by.push((from, reply_to)),
                        _ => {
                            drop(st);
                            self.counters.revokes_sent.fetch_add(1, Ordering::Relaxed);
                            self.tell(
                                &reply_to,
                                &Message::Revoke {
                                    from: self.config.agent.clone(),
                                    key,
                                },
                            );
                        }
                    }
                }
                Message::Unloaded { from, key } => {
                    if let Some(r) = self.state.lock().locals.get_mut(&key) {
                        if let Some(i) = r.loaded_by.iter().position(|(a, _)| *a == from) {
                            r.loaded_by.swap_remove(i);
                        }
                    }
                }
                Message::Revoke { from, key } => {
                    let mds: Vec<u64> = self
                        .state
                        .lock()
                        .remotes
                        .iter()
                        .filter(|(_, r)| {
                            r.agent == from && r.key == key && r.state == RemoteState::Live
                        })
                        .map(|(&md, _)| md)
                        .collect();
                    for md in mds {
                        if let Err(e) = self.close_remote(md, true) {
                            tracing::warn!(error = %e, agent = %from, "closing a revoked import failed");
                        }
                    }
                }
            }
        }
    }
}
