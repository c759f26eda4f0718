//! Wake (`Pool::wake`): sleeping arenas get memory again at the same addresses, their
//! offloaded contents are copied back, observers are told (`on_ready`), and the tags
//! allocate again (`pool/sleep_wake/sleep.rs` for sleep).
//!
//! **All or nothing.** First every arena the call wakes, on every device it touches, gets
//! its memory (`Backend::restore_physical`), then its offloaded contents are copied back;
//! only when all have both are the arenas recorded awake and announced. When the driver
//! refuses one (typically out of memory: the trainer still holds the GPU) or a copy back
//! fails, the arenas this call already restored give their memory back
//! (`Backend::release_physical`) and stay asleep with their offloaded contents, so nothing
//! changed and the wake can be tried again: out of memory is [`Error::OutOfMemory`] with
//! [`OomCause::Wake`] (what the wake needed, what is free, what went back to sleep), another
//! failure is returned as the backend said it. A wake that would pass `max_reserved` is
//! refused the same way before anything is restored ([`OomCause::MaxReserved`]), and so is
//! a wake of a device with a graph pool context open (a capture: the copies back would
//! invalidate it; `InvalidState`). (Should giving memory back fail as well, that arena is
//! woken after all, contents copied back, and stays awake while its tag sleeps; logged.)

use super::offload::HostBuffersMoving;
use super::sleep::{mask, names, SleepReport};
use crate::backend::{ArenaMem, DeviceId};
use crate::error::{Error, OomCause, Result};
use crate::pool::graphs::sync_hold::SyncHold;
use crate::pool::state::asleep::Offload;
use crate::pool::state::observer_registry::ArenaInfo;
use crate::pool::state::pool::{DevicePool, Pool};

/// A sleeping arena the wake restores: (index of its device in the plan, arena key, arena
/// id, its memory).
type WakeWork = (usize, usize, u64, ArenaMem);

impl Pool {
    /// Tell every observer of an arena mapped again (no lock held).
    pub(crate) fn announce(&self, dp: &DevicePool, id: u64, mem: &ArenaMem) {
        let calls = self
            .observers
            .announce(ArenaInfo::mapped(dp.device, id, mem));
        self.count_failures(self.observers.deliver(calls));
    }

    /// Wake `tags` (tag indices; `None`: every sleeping tag) on `device` (every device for
    /// `None`): new memory at the same addresses, offloaded contents copied back. All or
    /// nothing (see the module docs).
    pub fn wake(&self, device: Option<DeviceId>, wake_tags: Option<&[u8]>) -> Result<SleepReport> {
        let _serial = self.sleep_lock.lock();
        let devices = self.sleep_devices(device)?;
        let _moving = HostBuffersMoving::new(devices.iter().copied());
        // One device: every named tag (or something) must be asleep there. Every device
        // (`None`): each device wakes what of it sleeps there, and every named tag (or
        // something) must be asleep on some device. Checked first: an error changes nothing.
        let asleep_any = devices
            .iter()
            .fold(0u64, |m, dp| m | dp.state.lock().asleep_tags);
        let named = wake_tags.map_or(asleep_any, mask);
        if named == 0 || named & !asleep_any != 0 {
            let which = match device {
                Some(d) => format!("device {d}"),
                None => "every device".to_string(),
            };
            return Err(Error::InvalidState(format!(
                "wake of {which}: {} not asleep",
                if named == 0 {
                    "nothing is".to_string()
                } else {
                    format!("tag(s) {} are", names(named & !asleep_any))
                }
            )));
        }
        // The plan: per device, the tags it wakes; the sleeping arenas of those tags.
        let mut plan: Vec<(&DevicePool, u64)> = Vec::new();
        let mut work: Vec<WakeWork> = Vec::new();
        for dp in devices {
            let st = dp.state.lock();
            let want = named & st.asleep_tags;
            if want == 0 {
                continue;
            }
            work.extend(
                st.arenas
                    .iter()
                    .filter(|(_, a)| a.sleep.is_some() && want & (1 << a.tag) != 0)
                    .map(|(k, a)| (plan.len(), k, a.id, a.mem.clone())),
            );
            plan.push((dp, want));
        }
        // The cap on reserved bytes (`max_reserved`) holds for a wake as for any growth, and
        // no wake runs inside a capture (its copies back would invalidate it): refused
        // before anything is restored.
        let mut no_capture = Vec::with_capacity(plan.len());
        for (d, &(dp, _)) in plan.iter().enumerate() {
            // (Held until the wake is done: no capture begins meanwhile.)
            no_capture.push(SyncHold::take(dp, "wake")?);
            let needed: u64 = work.iter().filter(|w| w.0 == d).map(|w| w.3.bytes).sum();
            let (limits, setting) = self.limits_now(dp)?;
            let stats = dp.state.lock().stats_now();
            if limits.over_cap(|| stats.reserved_bytes, needed) {
                let free = self.backend.mem_info(dp.device).map_or(0, |m| m.free);
                return Err(Error::OutOfMemory {
                    device: dp.device,
                    requested: needed,
                    reserved: stats.reserved_bytes,
                    free,
                    cause: limits.oom_cause(setting, needed, true, &stats, free),
                });
            }
        }
        // Memory for every arena first, or for none.
        let mut restored: Vec<WakeWork> = Vec::with_capacity(work.len());
        for (i, &(d, k, id, ref mem)) in work.iter().enumerate() {
            match self.backend.restore_physical(mem) {
                Ok(new) => restored.push((d, k, id, new)),
                Err(e) => {
                    let (dp, want) = plan[d];
                    let needed: u64 = work.iter().filter(|w| w.0 == d).map(|w| w.3.bytes).sum();
                    tracing::error!(device = dp.device, base = mem.base, error = %e, arenas_woken = i, "an arena could not wake: the wake is undone");
                    let undone = self.undo_wake(&plan, restored);
                    return Err(self.wake_error(dp, want, needed, undone, e));
                }
            }
        }
        // Contents back before anything is committed: a copy that fails undoes the wake as a
        // refused restore does (each offload goes back to its sleeping arena).
        let mut offloads: Vec<Option<Offload>> = Vec::with_capacity(restored.len());
        for &(d, k, _, _) in &restored {
            let dp = plan[d].0;
            let offload = take_offload(dp, k);
            let copied = offload.as_ref().map_or(Ok(0), |o| self.copy_back(dp, o));
            offloads.push(offload);
            if let Err(e) = copied {
                for (&(d, k, ..), o) in restored.iter().zip(offloads) {
                    if let Some(o) = o {
                        put_offload(plan[d].0, k, o);
                    }
                }
                tracing::error!(device = dp.device, error = %e, "copying an arena's contents back failed: the wake is undone");
                self.undo_wake(&plan, restored);
                return Err(e);
            }
        }
        let mut woken: Vec<(WakeWork, Option<Offload>)> =
            restored.into_iter().zip(offloads).collect();
        let mut report = SleepReport::default();
        for (d, &(dp, want)) in plan.iter().enumerate() {
            let mut dev_report = SleepReport::default();
            for ((_, k, id, new), offload) in woken.iter_mut().filter(|(w, _)| w.0 == d) {
                dev_report.copied_bytes += self.commit_wake(dp, *k, *id, new, offload.take());
                dev_report.arena_bytes += new.bytes;
                dev_report.arenas += 1;
            }
            let mut st = dp.state.lock();
            st.asleep_tags &= !want;
            // The thread caches serve these tags again.
            st.front.set_asleep_tags(st.asleep_tags);
            tracing::info!(
                device = dp.device,
                tags = %names(want),
                restored_bytes = dev_report.arena_bytes,
                copied_back_bytes = dev_report.copied_bytes,
                "gpu-arena wake"
            );
            let r = self.settle(dp, &st, None, dev_report)?;
            report.arena_bytes += r.arena_bytes;
            report.copied_bytes += r.copied_bytes;
            report.arenas += r.arenas;
        }
        // Holders of shares share these tags' memory again (pool/sharing/hooks.rs).
        for &(dp, want) in &plan {
            self.hooks_after_wake(dp.device, want);
        }
        Ok(report)
    }

    /// An arena has its memory again (`new`) and its contents copied back from `offload`:
    /// record it awake, keep the offload's host buffers for the next sleep, tell the
    /// observers. Returns the live bytes copied back.
    fn commit_wake(
        &self,
        dp: &DevicePool,
        k: usize,
        id: u64,
        new: &ArenaMem,
        offload: Option<Offload>,
    ) -> u64 {
        {
            let mut st = dp.state.lock();
            if let Some(a) = st.arenas.get_mut(k) {
                a.mem = new.clone();
                a.chunks = 1;
                a.sleep = None;
            }
            // One driver allocation made (the sleep counted the ones it gave back).
            st.stats.backend_creates += 1;
            dp.metrics.creates.increment(1);
            st.stats.reserved_bytes += new.bytes;
            st.raise_reserved_peak();
            st.stats.sleeping_bytes -= new.bytes;
        }
        let copied = offload.map_or(0, |o| {
            let live = o.live;
            self.keep_offload_buffers(dp, o);
            live
        });
        self.announce(dp, id, new);
        copied
    }

    /// Give back the memory of the arenas a failed wake already restored: they stay asleep,
    /// contents still offloaded. Returns the bytes put back to sleep.
    fn undo_wake(&self, plan: &[(&DevicePool, u64)], restored: Vec<WakeWork>) -> u64 {
        let mut undone = 0;
        for (d, k, id, new) in restored {
            let dp = plan[d].0;
            match self.backend.release_physical(&new) {
                Ok(()) => {
                    let mut st = dp.state.lock();
                    if let Some(a) = st.arenas.get_mut(k) {
                        a.mem = new.clone();
                    }
                    // Made and given back again: asleep, it holds no driver allocation.
                    st.stats.backend_creates += 1;
                    st.stats.backend_destroys += 1;
                    dp.metrics.creates.increment(1);
                    dp.metrics.destroys.increment(1);
                    undone += new.bytes;
                }
                Err(e) => {
                    // Mapped and cannot be given back: wake it after all (its tag sleeps).
                    tracing::error!(device = dp.device, base = new.base, error = %e, "undoing a wake: the arena could not give its memory back; it stays awake while its tag sleeps");
                    let offload = take_offload(dp, k);
                    if let Some(Err(e)) = offload.as_ref().map(|o| self.copy_back(dp, o)) {
                        tracing::error!(device = dp.device, error = %e, "copying back failed too");
                    }
                    self.commit_wake(dp, k, id, &new, offload);
                }
            }
        }
        undone
    }

    /// The error of a wake undone because `e` refused an arena on `dp`.
    fn wake_error(&self, dp: &DevicePool, want: u64, needed: u64, undone: u64, e: Error) -> Error {
        if !matches!(e, Error::DriverOutOfMemory { .. }) {
            return e;
        }
        let device = dp.device;
        let info = self.backend.mem_info(device).ok();
        let st = dp.state.lock();
        dp.metrics.publish(&st.stats_now());
        Error::OutOfMemory {
            device,
            requested: needed,
            reserved: st.stats.reserved_bytes,
            free: info.map_or(0, |m| m.free),
            cause: OomCause::Wake {
                needed,
                undone,
                free: info.map_or(0, |m| m.free),
                total: info.map_or(0, |m| m.total),
                tags: names(want),
            },
        }
    }
}

/// Take the offload out of sleeping arena `k` of `dp` (its contents on the host), if any.
fn take_offload(dp: &DevicePool, k: usize) -> Option<Offload> {
    let mut st = dp.state.lock();
    st.arenas
        .get_mut(k)
        .and_then(|a| a.sleep.as_mut())
        .and_then(|s| s.offload.take())
}

/// Give sleeping arena `k` of `dp` its offload back (a wake undone).
fn put_offload(dp: &DevicePool, k: usize, offload: Offload) {
    let mut st = dp.state.lock();
    if let Some(sleep) = st.arenas.get_mut(k).and_then(|a| a.sleep.as_mut()) {
        sleep.offload = Some(offload);
    }
}
