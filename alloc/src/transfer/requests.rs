//! Posting and checking transfer requests: copies spread over the engine's streams, one
//! event per stream used, the notification sent on completion.

use std::sync::atomic::Ordering;

use super::descs::{Copy, Desc, Op};
use super::engine::{Inner, XferStatus};
use super::state::{destroy_events, not_live, wait_events, InFlight, RemoteState, Request};
use super::wire::MAX_NOTIF_BYTES;
use crate::error::{Error, Result};
use crate::ids::{DeviceId, StreamId};

impl Inner {
    /// Check a transfer's descriptors against their registrations (reloading those whose
    /// producer slept and woke) and keep it as a request.
    pub(super) fn prepare(
        &self,
        op: Op,
        local: &[Desc],
        remote: &[Desc],
        agent: &str,
    ) -> Result<u64> {
        let own = agent == self.config.agent;
        let mut remotes: Vec<u64> = if own {
            Vec::new()
        } else {
            remote.iter().map(|d| d.md).collect()
        };
        remotes.sort_unstable();
        remotes.dedup();
        let suspended = self.state.lock().suspended(&remotes);
        self.reload(&suspended)?;
        let mut st = self.state.lock();
        let req = Request {
            op,
            local: local.to_vec(),
            remote: remote.to_vec(),
            agent: agent.to_owned(),
            notify_to: None,
            remotes,
            posting: false,
            in_flight: None,
        };
        st.plan_request(&req, &self.config.agent)?;
        let notify_to = if own {
            Some(self.endpoint.name().to_owned())
        } else {
            st.peers.get(agent).cloned().or_else(|| {
                req.remotes
                    .first()
                    .and_then(|m| st.remotes.get(m))
                    .map(|r| r.producer_socket.clone())
            })
        };
        let id = st.take_id(false);
        st.requests.insert(id, Request { notify_to, ..req });
        Ok(id)
    }

    pub(super) fn post(&self, request: u64, notif: Option<Vec<u8>>) -> Result<XferStatus> {
        if notif.as_ref().is_some_and(|b| b.len() > MAX_NOTIF_BYTES) {
            return Err(Error::invalid(format!(
                "notification longer than {MAX_NOTIF_BYTES} bytes"
            )));
        }
        let backend = self.backend();
        let remotes = {
            let st = self.state.lock();
            let req = st.requests.get(&request).ok_or_else(|| {
                Error::invalid(format!("transfer request {request:#x} is not live"))
            })?;
            st.suspended(&req.remotes)
        };
        // Registrations whose producer slept and woke are asked for again (no lock held).
        self.reload(&remotes)?;
        // Under the lock: check, plan, pick streams, and mark the request posting and its
        // remote registrations in use (a close waits for that mark to go before it fences
        // the streams: no copy can be queued on a mapping after it). The driver calls that
        // queue the copies run without the lock.
        let (copies, remotes) = {
            let mut guard = self.state.lock();
            let st = &mut *guard;
            let req = st.requests.get(&request).ok_or_else(|| {
                Error::invalid(format!("transfer request {request:#x} is not live"))
            })?;
            if req.in_flight.is_some() || req.posting {
                return Err(Error::InvalidState(format!(
                    "transfer request {request:#x} is still in flight"
                )));
            }
            for md in &req.remotes {
                match st.remotes.get(md) {
                    Some(r) if r.state == RemoteState::Live => {}
                    Some(r) => return Err(not_live(r)),
                    None => return Err(Error::invalid(format!("metadata {md:#x} was unloaded"))),
                }
            }
            let planned = st.plan_request(req, &self.config.agent)?;
            let remotes = req.remotes.clone();
            let n = self.config.streams_per_device;
            let mut copies: Vec<(Copy, StreamId)> = Vec::with_capacity(planned.len());
            for c in planned {
                let pick = st.next_stream;
                st.next_stream = st.next_stream.wrapping_add(1);
                // Made on the device's first transfer (a driver call, once).
                let list = st.streams_of(backend, c.device, n)?;
                copies.push((c, list[pick % list.len()]));
            }
            for md in &remotes {
                if let Some(r) = st.remotes.get_mut(md) {
                    r.users += 1;
                }
            }
            if let Some(req) = st.requests.get_mut(&request) {
                req.posting = true;
            }
            (copies, remotes)
        };
        let mut used: Vec<(DeviceId, StreamId)> = Vec::new();
        let mut queued = Ok(());
        for (c, stream) in &copies {
            if let Err(e) = backend.copy_async(c.device, *stream, c.dst, c.src, c.len) {
                queued = Err(e);
                break;
            }
            if !used.contains(&(c.device, *stream)) {
                used.push((c.device, *stream));
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
        let kept = {
            let mut st = self.state.lock();
            for md in &remotes {
                if let Some(r) = st.remotes.get_mut(md) {
                    r.users -= 1;
                }
            }
            match (st.requests.get_mut(&request), &queued) {
                (Some(req), Ok(())) => {
                    req.posting = false;
                    req.in_flight = Some(InFlight {
                        events: std::mem::take(&mut events),
                        notif,
                    });
                    true
                }
                (Some(req), Err(_)) => {
                    req.posting = false;
                    false
                }
                (None, _) => false, // released meanwhile
            }
        };
        self.closed.notify_all();
        if !kept {
            // What was queued still runs: wait for it before reporting.
            let _ = wait_events(backend, events);
        }
        queued?;
        self.counters.posted.fetch_add(1, Ordering::Relaxed);
        self.counters
            .copies
            .fetch_add(copies.len() as u64, Ordering::Relaxed);
        let bytes: u64 = copies.iter().map(|(c, _)| c.len).sum();
        self.counters.bytes.fetch_add(bytes, Ordering::Relaxed);
        if !kept {
            return Ok(XferStatus::Done);
        }
        self.check(request)
    }

    pub(super) fn check(&self, request: u64) -> Result<XferStatus> {
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
}
