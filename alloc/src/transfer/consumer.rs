//! The consumer's side: importing a producer's registration (and again after the
//! producer's sleep: `Reload`), closing an import once the copies queued on it completed
//! (unload, revocation, the producer's sleep), and the thread that hears other engines.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::engine::Inner;
use super::state::{not_live, wait_events, Close, LocalState, RemoteState};
use super::wire::{Message, PublicData};
use crate::error::{Error, Result};

/// How long a transfer waits for the producer's answer to a `Reload`.
const RELOAD_WAIT: Duration = Duration::from_secs(5);

impl Inner {
    /// Import the share of `pd` (the producer told first, so a deregistration racing with
    /// the import revokes it too). Returns the local address of the registered range.
    pub(super) fn import_share(&self, agent: &str, pd: &PublicData) -> Result<u64> {
        let loaded = Message::Loaded {
            from: self.config.agent.clone(),
            reply_to: self.endpoint.name().to_owned(),
            key: pd.key,
        };
        self.endpoint.send(&pd.socket, &loaded).map_err(|e| {
            Error::Ipc(format!(
                "agent `{agent}` does not answer at its transfer socket ({e}): is it still running?"
            ))
        })?;
        self.importer.import(&pd.share).inspect_err(|_| {
            let key = pd.key;
            let from = self.config.agent.clone();
            self.tell(&pd.socket, &Message::Unloaded { from, key });
        })
    }

    /// Close a remote registration's import once the copies queued so far completed.
    pub(super) fn close_remote(&self, md: u64, why: Close) -> Result<()> {
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
                    Some(RemoteState::Revoked | RemoteState::Suspended) => {
                        match why {
                            Close::Unload => {
                                st.remotes.remove(&md);
                            }
                            Close::Revoke => {
                                if let Some(r) = st.remotes.get_mut(&md) {
                                    r.state = RemoteState::Revoked;
                                }
                            }
                            Close::Suspend => {}
                        }
                        return Ok(());
                    }
                    Some(RemoteState::Live) => break,
                }
            }
            let Some(r) = st.remotes.get_mut(&md) else {
                return Err(Error::Internal(
                    "remote registration vanished under the lock".into(),
                ));
            };
            r.state = RemoteState::Closing;
            // Posts that passed their check before the mark queue their copies without the
            // lock: wait until they have, so the fence below comes after their copies.
            while st.remotes.get(&md).is_some_and(|r| r.users > 0) {
                self.closed.wait(&mut st);
            }
            let fence = match st.fence(backend) {
                Ok(f) => f,
                Err(e) => {
                    // Not closed: usable again as it was.
                    if let Some(r) = st.remotes.get_mut(&md) {
                        r.state = RemoteState::Live;
                    }
                    drop(st);
                    self.closed.notify_all();
                    return Err(e);
                }
            };
            let Some(r) = st.remotes.get(&md) else {
                return Err(Error::Internal(
                    "remote registration vanished under the lock".into(),
                ));
            };
            (r.local, r.producer_socket.clone(), r.key, fence)
        };
        let waited = wait_events(backend, fence);
        let closed = waited.and_then(|()| self.importer.close(local));
        let mut st = self.state.lock();
        match why {
            Close::Unload => {
                st.remotes.remove(&md);
            }
            Close::Revoke | Close::Suspend => {
                if let Some(r) = st.remotes.get_mut(&md) {
                    r.state = if why == Close::Revoke {
                        RemoteState::Revoked
                    } else {
                        RemoteState::Suspended
                    };
                }
                self.counters.revoked.fetch_add(1, Ordering::Relaxed);
            }
        }
        drop(st);
        self.closed.notify_all();
        let from = self.config.agent.clone();
        self.tell(&socket, &Message::Unloaded { from, key });
        closed
    }

    /// Import again the registrations among `mds` that are suspended (their producer slept):
    /// ask the producer for each (`Reload`), import the new share. Fails clearly while the
    /// producer still sleeps, or when it took the registration back.
    pub(super) fn reload(&self, mds: &[u64]) -> Result<()> {
        for &md in mds {
            let (agent, socket, key) = {
                let mut st = self.state.lock();
                loop {
                    match st.remotes.get(&md).map(|r| r.state.clone()) {
                        Some(RemoteState::Closing) => self.closed.wait(&mut st),
                        Some(RemoteState::Suspended) => break,
                        _ => return Ok(()), // live again, revoked or gone: post says which
                    }
                }
                let Some(r) = st.remotes.get_mut(&md) else {
                    return Ok(());
                };
                r.state = RemoteState::Closing;
                let ask = (r.agent.clone(), r.producer_socket.clone(), r.key);
                st.reloads.remove(&(ask.0.clone(), ask.2));
                ask
            };
            let answer = self.ask_reload(&agent, &socket, key);
            let imported = answer.and_then(|pd| {
                let pd = pd.ok_or_else(|| Error::InvalidState(String::new()))?;
                Ok((self.import_share(&agent, &pd)?, pd))
            });
            let mut st = self.state.lock();
            let result = match (imported, st.remotes.get_mut(&md)) {
                (Ok((local, pd)), Some(r)) => {
                    r.local = local;
                    r.device = pd.share.info.device;
                    r.state = RemoteState::Live;
                    self.counters.reloaded.fetch_add(1, Ordering::Relaxed);
                    Ok(())
                }
                (Ok(_), None) => Ok(()),
                (Err(e), Some(r)) => {
                    r.state = RemoteState::Suspended;
                    Err(match e {
                        Error::InvalidState(m) if m.is_empty() => not_live(r),
                        e => e,
                    })
                }
                (Err(e), None) => Err(e),
            };
            drop(st);
            self.closed.notify_all();
            result?;
        }
        Ok(())
    }

    /// Send `Reload` and wait for the answer: `Some(public data)`, `None` while asleep.
    fn ask_reload(&self, agent: &str, socket: &str, key: u64) -> Result<Option<PublicData>> {
        let ask = Message::Reload {
            from: self.config.agent.clone(),
            reply_to: self.endpoint.name().to_owned(),
            key,
        };
        self.endpoint.send(socket, &ask).map_err(|e| {
            Error::Ipc(format!(
                "agent `{agent}` does not answer at its transfer socket ({e}): is it still running?"
            ))
        })?;
        let deadline = Instant::now() + RELOAD_WAIT;
        let mut st = self.state.lock();
        loop {
            if let Some(public) = st.reloads.remove(&(agent.to_owned(), key)) {
                return if public.is_empty() {
                    Ok(None)
                } else {
                    PublicData::decode(&public).map(Some)
                };
            }
            if self.closed.wait_until(&mut st, deadline).timed_out() {
                return Err(Error::Ipc(format!(
                    "agent `{agent}` did not answer a reload of its registration {key} within {RELOAD_WAIT:?}"
                )));
            }
        }
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
            self.heard(msg);
        }
    }

    fn heard(&self, msg: Message) {
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
                let state = st.locals.get(&key).map(|r| r.state);
                match (state, st.locals.get_mut(&key)) {
                    (Some(LocalState::Live), Some(r)) => r.loaded_by.push((from, reply_to)),
                    _ => {
                        drop(st);
                        let asleep = state == Some(LocalState::Asleep);
                        self.counters.revokes_sent.fetch_add(1, Ordering::Relaxed);
                        let from = self.config.agent.clone();
                        self.tell(&reply_to, &Message::Revoke { from, key, asleep });
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
            Message::Revoke { from, key, asleep } => {
                let mds: Vec<u64> = self
                    .state
                    .lock()
                    .remotes
                    .iter()
                    .filter(|(_, r)| r.agent == from && r.key == key)
                    .map(|(&md, _)| md)
                    .collect();
                let why = if asleep {
                    Close::Suspend
                } else {
                    Close::Revoke
                };
                for md in mds {
                    if let Err(e) = self.close_remote(md, why) {
                        tracing::warn!(error = %e, agent = %from, "closing a revoked import failed");
                    }
                }
            }
            Message::Reload {
                from,
                reply_to,
                key,
            } => {
                let public = self.public_of(key);
                let me = self.config.agent.clone();
                match public {
                    Some(public) => self.tell(
                        &reply_to,
                        &Message::Reloaded {
                            from: me,
                            key,
                            public,
                        },
                    ),
                    None => {
                        tracing::debug!(agent = %from, key, "reload of a registration that ended");
                        self.tell(
                            &reply_to,
                            &Message::Revoke {
                                from: me,
                                key,
                                asleep: false,
                            },
                        );
                    }
                }
            }
            Message::Reloaded { from, key, public } => {
                self.state.lock().reloads.insert((from, key), public);
                self.closed.notify_all();
            }
        }
    }

    /// A registration's public data now: `Some("")` while it sleeps, `None` once it ended.
    pub(super) fn public_of(&self, key: u64) -> Option<String> {
        let st = self.state.lock();
        let r = st.locals.get(&key)?;
        match (r.state, &r.share) {
            (LocalState::Live, Some(share)) => Some(
                PublicData {
                    socket: self.endpoint.name().to_owned(),
                    key,
                    addr: r.addr,
                    len: r.len,
                    share: share.clone(),
                }
                .encode(),
            ),
            (LocalState::Asleep, _) => Some(String::new()),
            _ => None,
        }
    }
}
