//! The producer's side of ending shares: deregistration, the owner's free (at
//! `empty_cache`), and sleep each end a registration's share and tell every consumer that
//! loaded it (`Revoke`), then wait until their leases ended; a wake shares the slept ones
//! again. The consumer's side is `consumer.rs`.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::engine::Inner;
use super::state::LocalState;
use super::wire::Message;
use crate::error::{Error, Result};
use crate::ids::DeviceId;
use crate::ipc::ShareHandle;

/// A registration whose share is ending: its key, its share, who loaded it.
type Ending = (u64, ShareHandle, Vec<(String, String)>);

impl Inner {
    /// NIXL's deregistration of `mds` (all or none: unknown ids are refused first).
    pub(super) fn deregister(&self, mds: &[u64]) -> Result<()> {
        let ending = {
            let mut st = self.state.lock();
            if let Some(md) = mds.iter().find(|m| !st.locals.contains_key(m)) {
                return Err(Error::invalid(format!(
                    "metadata {md:#x} is not a registration of this agent (deregistered twice?)"
                )));
            }
            mds.iter()
                .filter_map(|md| Self::start_ending(&mut st.locals, *md, LocalState::Revoking))
                .collect::<Vec<_>>()
        };
        self.end_shares(&ending, false);
        let mut st = self.state.lock();
        for md in mds {
            st.locals.remove(md);
        }
        Ok(())
    }

    /// Mark `md` as `to` and take what ending its share needs (`None`: it has no share).
    fn start_ending(
        locals: &mut std::collections::HashMap<u64, super::state::LocalReg>,
        md: u64,
        to: LocalState,
    ) -> Option<Ending> {
        let r = locals.get_mut(&md)?;
        r.state = to;
        let share = r.share.take()?;
        Some((md, share, std::mem::take(&mut r.loaded_by)))
    }

    /// Unshare, tell every consumer, and wait (at most `revoke_timeout`) until the leases
    /// on the shares ended.
    fn end_shares(&self, ending: &[Ending], asleep: bool) {
        let pool = self.broker.pool();
        for (md, share, loaded_by) in ending {
            if let Err(e) = self.broker.unshare(share) {
                tracing::warn!(error = %e, "unshare of a registration failed");
            }
            for (agent, socket) in loaded_by {
                tracing::debug!(agent = %agent, key = md, asleep, "revoking a consumer's import");
                self.tell(
                    socket,
                    &Message::Revoke {
                        from: self.config.agent.clone(),
                        key: *md,
                        asleep,
                    },
                );
                self.counters.revokes_sent.fetch_add(1, Ordering::Relaxed);
            }
        }
        let start = Instant::now();
        let mut pause = Duration::from_micros(50);
        for (md, share, _) in ending {
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
    }

    /// Before `tags` of `device` sleep: end the shares of the registrations in them (they
    /// stay, asleep, and are shared again at the wake).
    pub(super) fn suspend(&self, device: DeviceId, tags: u64) {
        let ending = {
            let mut st = self.state.lock();
            let mds: Vec<u64> = st
                .locals
                .iter()
                .filter(|(_, r)| {
                    r.state == LocalState::Live && r.device == device && tags & (1 << r.tag) != 0
                })
                .map(|(&md, _)| md)
                .collect();
            mds.into_iter()
                .filter_map(|md| Self::start_ending(&mut st.locals, md, LocalState::Asleep))
                .collect::<Vec<_>>()
        };
        if !ending.is_empty() {
            self.counters
                .slept
                .fetch_add(ending.len() as u64, Ordering::Relaxed);
            self.end_shares(&ending, true);
        }
    }

    /// After `tags` of `device` woke: share their registrations again. A consumer asks for
    /// the new share on its next transfer (`Reload`).
    pub(super) fn resume(&self, device: DeviceId, tags: u64) {
        let asleep: Vec<(u64, u64, u64)> = self
            .state
            .lock()
            .locals
            .iter()
            .filter(|(_, r)| {
                r.state == LocalState::Asleep && r.device == device && tags & (1 << r.tag) != 0
            })
            .map(|(&md, r)| (md, r.addr, r.len))
            .collect();
        for (md, addr, len) in asleep {
            match self.broker.share(addr, len) {
                Ok(share) => {
                    let mut st = self.state.lock();
                    if let Some(r) = st.locals.get_mut(&md) {
                        if r.state == LocalState::Asleep {
                            r.state = LocalState::Live;
                            r.share = Some(share);
                            continue;
                        }
                    }
                    drop(st);
                    // Deregistered meanwhile: give the new share up.
                    let _ = self.broker.unshare(&share);
                }
                Err(e) => {
                    tracing::warn!(key = md, error = %e, "sharing a registration again after the wake failed: it stays asleep");
                }
            }
        }
    }

    /// Before `empty_cache` / trim: end the shares of registrations whose owner freed their
    /// memory, so it can go back (NIXL's deregistration then only forgets them).
    pub(super) fn release_freed(&self, device: Option<DeviceId>) {
        let pool = self.broker.pool();
        let candidates: Vec<(u64, u64)> = self
            .state
            .lock()
            .locals
            .iter()
            .filter(|(_, r)| r.state == LocalState::Live && device.is_none_or(|d| d == r.device))
            .map(|(&md, r)| (md, r.addr))
            .collect();
        let freed: Vec<u64> = candidates
            .into_iter()
            .filter(|&(_, addr)| pool.freed_while_shared(addr))
            .map(|(md, _)| md)
            .collect();
        if freed.is_empty() {
            return;
        }
        let ending = {
            let mut st = self.state.lock();
            freed
                .into_iter()
                .filter_map(|md| Self::start_ending(&mut st.locals, md, LocalState::Ended))
                .collect::<Vec<_>>()
        };
        self.end_shares(&ending, false);
    }
}
