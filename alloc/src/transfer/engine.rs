//! The transfer engine: registrations, loaded remote registrations, requests, and the
//! thread that hears other engines. See the module docs of [`crate::transfer`] for the rules.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

use super::descs::{Desc, Op};
use super::socket::Endpoint;
use super::state::{
    is_remote, wait_events, Close, Counters, LocalReg, LocalState, RemoteReg, RemoteState, Request,
    State,
};
use super::stats::EngineStats;
use super::wire::{Message, PublicData, MAX_NAME_BYTES, MAX_NOTIF_BYTES};
use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::ids::{DeviceId, StreamId};
use crate::ipc::{Broker, Importer};
use crate::pool::PoolHook;

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

pub(super) struct Inner {
    pub(super) config: EngineConfig,
    pub(super) broker: Arc<Broker>,
    pub(super) importer: Arc<Importer>,
    pub(super) endpoint: Endpoint,
    pub(super) state: Mutex<State>,
    pub(super) closed: Condvar,
    pub(super) stop: AtomicBool,
    pub(super) counters: Counters,
}

/// A transfer engine: one per NIXL agent and backend instance. See [`crate::transfer`].
pub struct TransferEngine {
    inner: Arc<Inner>,
    listener: Option<JoinHandle<()>>,
    /// What the pool tells around sleep, wake and `empty_cache` (held weakly there).
    _hook: Arc<dyn PoolHook>,
    hook_id: u64,
}

/// The engine as a pool hook: sleep ends the shares of a tag's registrations, wake shares
/// them again, `empty_cache` ends those whose memory its owner freed.
struct EngineHook {
    inner: Weak<Inner>,
}

impl PoolHook for EngineHook {
    fn before_sleep(&self, device: DeviceId, tags: u64) {
        if let Some(i) = self.inner.upgrade() {
            i.suspend(device, tags);
        }
    }

    fn after_wake(&self, device: DeviceId, tags: u64) {
        if let Some(i) = self.inner.upgrade() {
            i.resume(device, tags);
        }
    }

    fn before_release(&self, device: Option<DeviceId>) {
        if let Some(i) = self.inner.upgrade() {
            i.release_freed(device);
        }
    }
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
        let hook: Arc<dyn PoolHook> = Arc::new(EngineHook {
            inner: Arc::downgrade(&inner),
        });
        let hook_id = inner.broker.pool().add_hook(Arc::downgrade(&hook));
        Ok(TransferEngine {
            inner,
            listener: Some(listener),
            _hook: hook,
            hook_id,
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
        let tag = pool.tag_of(addr).unwrap_or(0);
        let share = self.inner.broker.share(addr, len)?;
        let mut st = self.inner.state.lock();
        let md = st.take_id(false);
        st.locals.insert(
            md,
            LocalReg {
                addr,
                len,
                device,
                tag,
                share: Some(share),
                loaded_by: Vec::new(),
                state: LocalState::Live,
            },
        );
        Ok(md)
    }

    /// The public data of a registration (NIXL's `getPublicData`). Refused while its tag
    /// sleeps (its share is renewed at the wake).
    pub fn public_data(&self, md: u64) -> Result<String> {
        match self.inner.public_of(md) {
            Some(p) if !p.is_empty() => Ok(p),
            Some(_) => Err(Error::InvalidState(format!(
                "registration {md:#x} is asleep (its tag sleeps): its public data exists again after the wake"
            ))),
            None => Err(Error::invalid(format!(
                "metadata {md:#x} is not a live registration of this agent"
            ))),
        }
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
        let local = self.inner.import_share(agent, &pd)?;
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
                users: 0,
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
        self.inner.close_remote(md, Close::Unload)
    }

    /// Check that `md` is a registration of this engine, for transfers within the agent
    /// (NIXL's `loadLocalMD`): the id stands for itself.
    pub fn load_local(&self, md: u64) -> Result<u64> {
        self.inner.state.lock().local_span(md).map(|_| md)
    }

    /// Prepare a transfer between `local` descriptors and `remote` ones of `agent` (this
    /// agent's own name for a transfer within it). Every descriptor is checked now (and
    /// again at each post).
    pub fn prepare(&self, op: Op, local: &[Desc], remote: &[Desc], agent: &str) -> Result<u64> {
        self.inner.prepare(op, local, remote, agent)
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
            slept: n(&c.slept),
            reloaded: n(&c.reloaded),
        }
    }
}

impl Drop for TransferEngine {
    /// Waits for requests in flight, closes every import, ends every registration (telling
    /// consumers), destroys the streams and stops the thread.
    fn drop(&mut self) {
        let inner = &self.inner;
        inner.broker.pool().remove_hook(self.hook_id);
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
            if let Err(e) = inner.close_remote(md, Close::Unload) {
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
    pub(super) fn backend(&self) -> &dyn Backend {
        &**self.broker.pool().backend()
    }

    /// Send, logging a failure (the peer may have exited: nothing to do about it).
    pub(super) fn tell(&self, to: &str, msg: &Message) {
        if let Err(e) = self.endpoint.send(to, msg) {
            tracing::debug!(error = %e, "transfer message not delivered");
        }
    }

    pub(super) fn send_notif(&self, to: &str, body: &[u8]) -> Result<()> {
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
}
