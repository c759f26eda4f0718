//! The engine's state behind its one lock: registrations, loaded remote registrations,
//! requests, received notifications and streams; and waiting on the backend's events.

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use super::descs::{Copy, Span};
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
}

#[derive(Debug)]
pub(super) struct LocalReg {
    pub(super) addr: u64,
    pub(super) len: u64,
    pub(super) device: DeviceId,
    pub(super) share: ShareHandle,
    /// Consumers that said they loaded it: (agent, socket).
    pub(super) loaded_by: Vec<(String, String)>,
    /// Being deregistered: consumers that load it now are told to close at once.
    pub(super) revoking: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum RemoteState {
    Live,
    /// Its import is being closed (revocation or unload); transfers are refused.
    Closing,
    /// The producer took it back; the import is closed. Kept so transfers fail clearly.
    Revoked,
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
}

#[derive(Debug)]
pub(super) struct Request {
    pub(super) copies: Vec<Copy>,
    pub(super) remotes: Vec<u64>,
    pub(super) notify_to: Option<String>,
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
            _ => Err(revoked(r)),
        }
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

pub(super) fn revoked(r: &RemoteReg) -> Error {
    Error::InvalidState(format!(
        "agent `{}` took back its registration {} ([{:#x}, +{})): the memory was revoked by its producer; load the agent's metadata again if it registers memory anew",
        r.agent, r.key, r.addr, r.len
    ))
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
