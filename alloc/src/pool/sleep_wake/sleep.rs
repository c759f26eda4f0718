//! Sleep and wake: give a device's memory back to the driver while every address stays
//! reserved, and map new memory at the same addresses later (RLHF: an inference engine
//! sleeps while the trainer uses the GPU, and wakes with its CUDA graphs still valid).
//!
//! **Sleep** (`Pool::sleep`) puts every awake tag of the device to sleep, `Pool::sleep_tags`
//! only the tags it names (the others stay awake and keep allocating). After a device
//! synchronize and settling every pending free, each arena of those tags:
//! - is *kept* (memory and contents untouched) when it is shared, exported, pinned or being
//!   announced to an observer: sleep never breaks a consumer. Its bytes are reported
//!   ([`SleepReport::kept_shared_bytes`], `PoolStats::sleep_kept_shared_bytes` while the
//!   tag sleeps) and logged;
//! - otherwise its observers get `on_release`, the live allocations of a tag in `offload`
//!   are copied into host buffers of up to 1 GiB each (`pool/sleep_wake/offload.rs`'s pieces, made
//!   ahead of the copies by `pool/sleep_wake/pin_ahead.rs`; `Backend::alloc_host`: pinned memory where
//!   the backend has it, so the copies run at link speed; a buffer kept from an earlier
//!   sleep when one is large enough, `pool/sleep_wake/offload.rs`), one copy per segment (live
//!   allocations merged across gaps of at most [`GAP`](super::offload::GAP): copying a small gap is cheaper than
//!   another call), and `Backend::release_physical` gives the memory back (the other tags'
//!   contents are gone). After the wake (or a failed sleep) the buffer is kept for the
//!   next sleep; `Pool::release_host_buffers` frees kept buffers, the pool's drop all.
//!
//! While a tag sleeps its allocations are refused (`Error::InvalidState`, "asleep"), frees
//! work, and new shares of its memory are refused. **Wake** (`Pool::wake`, `pool/sleep_wake/wake.rs`)
//! maps new memory at the same addresses (`Backend::restore_physical`), copies offloaded
//! runs back, announces the arenas to observers (`on_ready`) and lets the tags allocate
//! again; tags wake one by one or all at once; a wake that fails midway is undone. Sleeping
//! while every tag sleeps, naming an asleep tag to offload, or waking an awake tag is an
//! `InvalidState` error that changes nothing.

use super::offload::{piece_bytes, pieces, HostBuffersMoving};
use crate::backend::{ArenaMem, DeviceId};
use crate::error::{Error, Result};
use crate::pool::graphs::sync_hold::SyncHold;
use crate::pool::state::asleep::{Asleep, Offload};
use crate::pool::state::device::DeviceState;
use crate::pool::state::pool::{DevicePool, Pool};
use crate::tags;

/// What a sleep or wake did, summed over the devices it touched.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SleepReport {
    /// Bytes of arenas whose memory went back to the driver (sleep) or came back (wake).
    pub arena_bytes: u64,
    /// Bytes copied to the host (sleep) or back to the device (wake).
    pub copied_bytes: u64,
    /// Sleep: bytes of arenas kept with their memory because they are shared, exported or
    /// pinned (a consumer may use them).
    pub kept_shared_bytes: u64,
    /// Arenas put to sleep or woken.
    pub arenas: u64,
}

/// An arena going to sleep: its key, its memory, the segments `(address, bytes)` to copy
/// and the live bytes in them.
type SleepWork = (usize, ArenaMem, Vec<(u64, u64)>, u64);

/// One piece of a sleep's offload: the index of its arena in the work, its segments, and
/// whether it is the arena's last piece.
type PlannedPiece = (usize, Vec<(u64, u64)>, bool);

pub(crate) fn mask(tags: &[u8]) -> u64 {
    tags.iter().fold(0, |m, &t| m | (1u64 << t))
}

pub(crate) fn names(mask: u64) -> String {
    (0..64u8)
        .filter(|t| mask & (1 << t) != 0)
        .map(tags::name)
        .collect::<Vec<_>>()
        .join(",")
}

impl Pool {
    pub(crate) fn sleep_devices(&self, device: Option<DeviceId>) -> Result<Vec<&DevicePool>> {
        match device {
            Some(d) => Ok(vec![self.dev(d)?]),
            None => Ok(self.devices.iter().collect()),
        }
    }

    /// The tags (bit = tag index) asleep on `device`.
    pub fn asleep_tags(&self, device: DeviceId) -> Result<u64> {
        Ok(self.dev(device)?.state.lock().asleep_tags)
    }

    /// Put every awake tag of `device` (every device for `None`) to sleep, keeping the
    /// contents of the tags in `offload` (tag indices, `crate::tags`) on the host. See the
    /// module docs. The same as [`Pool::sleep_tags`] with no tags named.
    pub fn sleep(&self, device: Option<DeviceId>, offload: &[u8]) -> Result<SleepReport> {
        self.sleep_tags(device, None, offload)
    }

    /// Put the tags in `tags` (tag indices; `None`: every awake tag) of `device` (every
    /// device for `None`) to sleep, keeping the contents of those in `offload` on the host;
    /// the other tags stay awake and keep allocating. An `offload` tag not among `tags`, or
    /// an empty `tags`, is `InvalidArgument`; a named tag already asleep is `InvalidState`
    /// (with every device, a device where every named tag already sleeps is skipped). An
    /// error changes nothing.
    pub fn sleep_tags(
        &self,
        device: Option<DeviceId>,
        sleep_tags: Option<&[u8]>,
        offload: &[u8],
    ) -> Result<SleepReport> {
        let _serial = self.sleep_lock.lock();
        let devices = self.sleep_devices(device)?;
        let _moving = HostBuffersMoving::new(devices.iter().copied());
        let all = if tags::count() >= 64 {
            u64::MAX
        } else {
            (1u64 << tags::count()) - 1
        };
        let want = sleep_tags.map_or(all, mask);
        let offload_mask = mask(offload);
        if want == 0 {
            return Err(Error::invalid("sleep: no tag named to put to sleep"));
        }
        if offload_mask & !want != 0 {
            return Err(Error::invalid(format!(
                "sleep: offload tag(s) {} are not among the tags put to sleep ({})",
                names(offload_mask & !want),
                names(want)
            )));
        }
        // Check every device first: an error changes nothing. With every device (`None`),
        // a device where every tag to sleep sleeps already is skipped.
        let mut awake = Vec::new();
        for dp in devices {
            let asleep = dp.state.lock().asleep_tags;
            let twice = asleep
                & if sleep_tags.is_some() {
                    want
                } else {
                    offload_mask
                };
            if twice != 0 && (want & !asleep != 0 || device.is_some()) {
                return Err(Error::InvalidState(format!(
                    "sleep of device {}: tag(s) {} already asleep (wake them first)",
                    dp.device,
                    names(twice)
                )));
            }
            if want & !asleep != 0 {
                awake.push(dp);
            } else if device.is_some() {
                return Err(Error::InvalidState(format!(
                    "sleep of device {}: every tag is already asleep",
                    dp.device
                )));
            }
        }
        if awake.is_empty() {
            return Err(Error::InvalidState(
                "sleep of every device: every tag to sleep is already asleep".into(),
            ));
        }
        // A capture open on any of them refuses the whole call before anything sleeps (a
        // sleep synchronizes its device), and none begins until the sleep is done.
        let _no_capture = awake
            .iter()
            .map(|dp| SyncHold::take(dp, "sleep"))
            .collect::<Result<Vec<_>>>()?;
        // Holders of shares end the ones in these tags first (pool/sharing/hooks.rs): a shared
        // arena would stay awake.
        for dp in &awake {
            let asleep = dp.state.lock().asleep_tags;
            self.hooks_before_sleep(dp.device, want & !asleep);
        }
        let mut report = SleepReport::default();
        for dp in awake {
            let r = self.sleep_device(dp, want, offload_mask)?;
            report.arena_bytes += r.arena_bytes;
            report.copied_bytes += r.copied_bytes;
            report.kept_shared_bytes += r.kept_shared_bytes;
            report.arenas += r.arenas;
        }
        Ok(report)
    }

    fn sleep_device(&self, dp: &DevicePool, want: u64, offload: u64) -> Result<SleepReport> {
        let device = dp.device;
        // (`sleep` holds the device against captures: `SyncHold`.)
        self.backend.synchronize(device)?;
        let mut report = SleepReport::default();
        let mut calls = Vec::new();
        // (key, arena, runs to copy)
        let mut work: Vec<SleepWork> = Vec::new();
        let sleeping;
        {
            let mut st = dp.state.lock();
            sleeping = want & !st.asleep_tags;
            // The thread caches' gate first, for the tags going to sleep only: settle_all
            // drains every thread cache, and no block of a sleeping tag is handed out or
            // cached by them after that (other tags keep their fast path).
            st.front.set_asleep_tags(st.asleep_tags | sleeping);
            st.settle_all(self.backend.as_ref());
            st.asleep_tags |= sleeping;
            // Every live allocation in the device's map, for the offload below.
            st.promote_all();
            let st = &mut *st;
            for (k, a) in st.arenas.iter_mut() {
                if a.sleep.is_some() || sleeping & (1 << a.tag) == 0 {
                    continue;
                }
                if !a.lifetime.destroyable() {
                    report.kept_shared_bytes += a.mem.bytes;
                    continue;
                }
                let Some(c) = self.observers.claim_sleep((device, a.mem.base)) else {
                    report.kept_shared_bytes += a.mem.bytes;
                    continue;
                };
                calls.extend(c);
                a.sleep = Some(Asleep::default());
                st.stats.reserved_bytes -= a.mem.bytes;
                st.stats.sleeping_bytes += a.mem.bytes;
                work.push((k, a.mem.clone(), Vec::new(), 0));
            }
            // Segments of the offloaded arenas (pool/sleep_wake/offload.rs).
            if offload & sleeping != 0 {
                let keys: Vec<Option<usize>> = work
                    .iter()
                    .map(|w| {
                        st.arenas
                            .get(w.0)
                            .is_some_and(|a| offload & (1 << a.tag) != 0)
                            .then_some(w.0)
                    })
                    .collect();
                for (w, (segments, live)) in work.iter_mut().zip(st.offload_segments(&keys)) {
                    w.2 = segments;
                    w.3 = live;
                }
            }
            dp.metrics.publish(&st.stats_now());
        }
        // Observers first: the arenas are still mapped.
        self.count_failures(self.observers.deliver(calls));
        let mut first_err = None;
        // Host buffers are made ahead of the copies (pool/sleep_wake/pin_ahead.rs), piece by piece in
        // work's order (pool/sleep_wake/offload.rs: a grown arena's offload is many pieces); an arena
        // with nothing to copy has one empty entry. Its memory goes back after its last.
        let mut plan: Vec<PlannedPiece> = Vec::new();
        for (w, (_, _, segments, _)) in work.iter().enumerate() {
            let mut cut = pieces(segments);
            if cut.is_empty() {
                cut.push(Vec::new());
            }
            let n = cut.len();
            plan.extend(cut.into_iter().enumerate().map(|(i, c)| (w, c, i + 1 == n)));
        }
        let totals: Vec<u64> = plan.iter().map(|(_, c, _)| piece_bytes(c)).collect();
        let mut plan = plan.into_iter();
        let mut work = work.into_iter();
        let (mut parts, mut failed) = (Vec::new(), None);
        self.with_host_buffers(dp, &totals, |_, buf| {
            let Some((_, piece, last)) = plan.next() else {
                return;
            };
            match (buf, &failed) {
                (None, _) => {}
                (Some(Ok(b)), None) => match self.copy_out(dp, b, piece) {
                    Ok(part) => parts.push(part),
                    Err(e) => failed = Some(e),
                },
                // A piece after a failed one of the same arena: its buffer is kept.
                (Some(Ok(b)), Some(_)) => dp.state.lock().keep_host_buffer(b),
                (Some(Err(e)), None) => failed = Some(e),
                (Some(Err(_)), Some(_)) => {}
            }
            if !last {
                return;
            }
            let Some((k, mem, _, live)) = work.next() else {
                return;
            };
            let done = std::mem::take(&mut parts);
            let offloaded = match failed.take() {
                Some(e) => {
                    let mut st = dp.state.lock();
                    for part in done {
                        st.keep_host_buffer(part.buf);
                    }
                    Err(e)
                }
                None if done.is_empty() => Ok(None),
                None => Ok(Some(Offload { parts: done, live })),
            };
            let released = offloaded.and_then(|kept| match self.backend.release_physical(&mem) {
                Ok(()) => Ok(kept),
                Err(e) => {
                    if let Some(o) = kept {
                        let mut st = dp.state.lock();
                        for buf in o.into_buffers() {
                            st.keep_host_buffer(buf);
                        }
                    }
                    Err(e)
                }
            });
            let mut st = dp.state.lock();
            match released {
                Ok(kept) => {
                    // Its driver allocations went back (a wake makes one): counted as
                    // `backend_destroys`, as a destroy counts them.
                    let mut released_chunks = 0;
                    if let Some(a) = st.arenas.get_mut(k) {
                        a.sleep = Some(Asleep { offload: kept });
                        released_chunks = u64::from(std::mem::take(&mut a.chunks));
                    } else if let Some(o) = kept {
                        for buf in o.into_buffers() {
                            st.keep_host_buffer(buf);
                        }
                    }
                    st.stats.backend_destroys += released_chunks;
                    dp.metrics.destroys.increment(released_chunks);
                    report.arena_bytes += mem.bytes;
                    report.copied_bytes += live;
                    report.arenas += 1;
                }
                Err(e) => {
                    // Stays awake, with its contents: announced to the observers again.
                    tracing::error!(device, base = mem.base, error = %e, "an arena could not sleep; it stays awake");
                    let id = st.arenas.get_mut(k).map(|a| {
                        a.sleep = None;
                        a.id
                    });
                    st.stats.reserved_bytes += mem.bytes;
                    st.stats.sleeping_bytes -= mem.bytes;
                    drop(st);
                    if let Some(id) = id {
                        self.announce(dp, id, &mem);
                    }
                    first_err.get_or_insert(e);
                }
            }
        });
        tracing::info!(
            device,
            tags = %names(sleeping),
            released_bytes = report.arena_bytes,
            offloaded_bytes = report.copied_bytes,
            kept_shared_bytes = report.kept_shared_bytes,
            "gpu-arena sleep"
        );
        self.settle(dp, &dp.state.lock(), first_err, report)
    }

    /// The end of a sleep or a wake on one device: publish the gauges, validate (when
    /// configured), and return the first error or the report.
    pub(crate) fn settle(
        &self,
        dp: &DevicePool,
        st: &DeviceState,
        first_err: Option<Error>,
        report: SleepReport,
    ) -> Result<SleepReport> {
        dp.metrics.publish(&st.stats_now());
        if self.config.validate {
            st.validate_or_log();
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(report),
        }
    }
}
