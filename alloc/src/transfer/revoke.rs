//! Ending registrations and imports: the producer's revocation (unshare, tell each
//! consumer, wait for their leases to end), the consumer's close after its queued copies,
//! and the thread that hears other engines.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::engine::Inner;
use super::state::{wait_events, RemoteState};
use super::wire::Message;
use crate::error::{Error, Result};

impl Inner {
    pub(super) fn deregister(&self, mds: &[u64]) -> Result<()> {
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
    pub(super) fn close_remote(&self, md: u64, revoke: bool) -> Result<()> {
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
    pub(super) fn listen(&self) {
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
