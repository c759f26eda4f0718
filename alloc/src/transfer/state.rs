//! The engine's state behind its one lock: registrations, loaded remote registrations,
//! requests, received notifications and streams; and waiting on the backend's events.

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use super::descs::{plan, Copy, Desc, Op, Span};
use crate::backend::{Backend, Event};
use crate::error::{Error, Result};
use crate::ids::{DeviceId, StreamId};
use crate::ipc::ShareHandle;

#[derive(Debug, Default)]
pub(super) struct Counters {
    pub(super) posted: AtomicU64,
    pub(super) copies: AtomicU64,
    pub(super) bytes: AtomicU64,
    pub(super) notifs_sent: AtomicU64,
    pub(super) notifs_received: AtomicU64,
    pub(super) revokes_sent: AtomicU64,
    pub(super) revoked: AtomicU64,
    pub(super) revoke_timeouts: AtomicU64,
    pub(super) slept: AtomicU64,
    pub(super) reloaded: AtomicU64,
}

/// Where a local registration stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum LocalState {
    /// Shared: consumers may load it.
    Live,
    /// Its tag sleeps (or is going to): not shared; shared again after the wake.
    Asleep,
    /// Ending (deregistration, or its owner freed it): consumers told to close.
    Revoking,
    /// Its owner freed it and `empty_cache` ended it; NIXL's deregistration removes it.
    Ended,
}

#[derive(Debug)]
pub(super) struct LocalReg {
    pub(super) addr: u64,
    pub(super) len: u64,
    pub(super) device: DeviceId,
    /// The tag of its arena (sleep ends and wake renews the share of a tag's registrations).
    pub(super) tag: u8,
    /// Its share while `Live`.
    pub(super) share: Option<ShareHandle>,
    /// Consumers that said they loaded it: (agent, socket).
    pub(super) loaded_by: Vec<(String, String)>,
    pub(super) state: LocalState,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum RemoteState {
    Live,
    /// Its import is being closed (revocation or unload), or opened again (a reload after
    /// the producer's wake); transfers wait for the outcome.
    Closing,
    /// The producer's memory sleeps: the import is closed; the next transfer asks the
    /// producer for the registration again (`Reload`) and imports it anew.
    Suspended,
    /// The producer took it back; the import is closed. Kept so transfers fail clearly.
    Revoked,
}

/// Why an import closes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Close {
    /// NIXL's unload: the registration goes.
    Unload,
    /// The producer took it back: it stays, revoked, so transfers fail clearly.
    Revoke,
    /// The producer's memory sleeps: it stays, suspended, reloaded on the next transfer.
    Suspend,
}

#[derive(Debug)]
pub(super) struct RemoteReg {
    pub(super) agent: String,
    pub(super) producer_socket: String,
    pub(super) key: u64,
    pub(super) addr: u64,
    pub(super) len: u64,
    pub(super) local: u64,
    pub(super) device: DeviceId,
    pub(super) state: RemoteState,
    /// Posts queueing copies on it now (a close waits for 0 before it fences the streams).
    pub(super) users: u32,
}

/// A transfer request: its descriptors, planned into copies at each post (a remote
/// registration reloaded after a wake is mapped at a new address).
#[derive(Debug)]
pub(super) struct Request {
    pub(super) op: Op,
    pub(super) local: Vec<Desc>,
    pub(super) remote: Vec<Desc>,
    /// The peer agent (this agent's own name for a transfer within it).
    pub(super) agent: String,
    /// The remote registrations it uses (none within the agent).
    pub(super) remotes: Vec<u64>,
    pub(super) notify_to: Option<String>,
    /// Its copies are being queued (the lock is not held meanwhile: `Inner::post`).
    pub(super) posting: bool,
    pub(super) in_flight: Option<InFlight>,
}

#[derive(Debug)]
pub(super) struct InFlight {
    pub(super) events: Vec<Event>,
    pub(super) notif: Option<Vec<u8>>,
}

#[derive(Debug, Default)]
pub(super) struct State {
    pub(super) next_id: u64,
    pub(super) locals: HashMap<u64, LocalReg>,
    pub(super) remotes: HashMap<u64, RemoteReg>,
    pub(super) peers: HashMap<String, String>,
    pub(super) requests: HashMap<u64, Request>,
    pub(super) notifs: Vec<(String, Vec<u8>)>,
    /// Answers to `Reload` by (producer agent, key): its public data, or "" while asleep.
    pub(super) reloads: HashMap<(String, u64), String>,
    pub(super) streams: HashMap<DeviceId, Vec<StreamId>>,
    pub(super) next_stream: usize,
}

/// Metadata ids: local registrations are even, loaded remote ones odd.
pub(super) fn is_remote(md: u64) -> bool {
    md & 1 == 1
}

impl State {
    pub(super) fn take_id(&mut self, remote: bool) -> u64 {
        self.next_id += 1;
        (self.next_id << 1) | u64::from(remote)
    }

    pub(super) fn local_span(&self, md: u64) -> Result<Span> {
        let r = self.locals.get(&md).ok_or_else(|| {
            Error::invalid(format!(
                "metadata {md:#x} is not a registration of this agent"
            ))
        })?;
        match r.state {
            LocalState::Live => {}
            LocalState::Asleep => {
                return Err(Error::InvalidState(format!(
                    "its registration [{:#x}, +{}) is asleep (its tag sleeps): wake it first",
                    r.addr, r.len
                )))
            }
            LocalState::Revoking | LocalState::Ended => {
                return Err(Error::InvalidState(format!(
                "its registration [{:#x}, +{}) is being ended (deregistered, or its memory freed)",
                r.addr, r.len
            )))
            }
        }
        Ok(Span {
            addr: r.addr,
            len: r.len,
            local: r.addr,
            device: r.device,
        })
    }

    pub(super) fn remote_span(&self, md: u64, agent: &str) -> Result<Span> {
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
            _ => Err(not_live(r)),
        }
    }

    /// The copies of `req` now (its registrations looked up again: a reload maps anew).
    pub(super) fn plan_request(&self, req: &Request, own_agent: &str) -> Result<Vec<Copy>> {
        let own = req.agent == own_agent;
        plan(
            req.op,
            &req.local,
            &req.remote,
            |md| self.local_span(md),
            |md| {
                if own {
                    self.local_span(md)
                } else {
                    self.remote_span(md, &req.agent)
                }
            },
        )
    }

    /// The remote registrations among `mds` whose producer's memory slept (they need a
    /// reload before a transfer).
    pub(super) fn suspended(&self, mds: &[u64]) -> Vec<u64> {
        mds.iter()
            .copied()
            .filter(|m| {
                self.remotes
                    .get(m)
                    .is_some_and(|r| r.state == RemoteState::Suspended)
            })
            .collect()
    }

    /// The streams of `device`, made on first use.
    pub(super) fn streams_of(
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
    pub(super) fn fence(&self, backend: &dyn Backend) -> Result<Vec<Event>> {
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

/// Why a remote registration cannot be used now, in words.
pub(super) fn not_live(r: &RemoteReg) -> Error {
    let what = format!(
        "agent `{}`'s registration {} ([{:#x}, +{}))",
        r.agent, r.key, r.addr, r.len
    );
    Error::InvalidState(match r.state {
        RemoteState::Suspended => format!(
            "{what} is asleep: its producer's memory sleeps (sleep mode); transfer after it wakes (no metadata to reload: it is asked for again)"
        ),
        RemoteState::Closing => format!("{what} is being closed or reloaded"),
        _ => format!(
            "{what} was revoked by its producer (it deregistered or freed it); load the agent's metadata again if it registers memory anew"
        ),
    })
}

pub(super) fn destroy_events(backend: &dyn Backend, events: Vec<Event>) {
    for e in events {
        if let Err(err) = backend.destroy_event(e) {
            tracing::warn!(error = %err, "destroying a transfer event failed");
        }
    }
}

/// Wait until every event completed, then destroy them.
pub(super) fn wait_events(backend: &dyn Backend, events: Vec<Event>) -> Result<()> {
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
