//! Trim: `empty_cache`, then give back the pages of arenas that survivors do not use.
//!
//! `empty_cache` releases only arenas with no live block: an arena is one physical
//! allocation, and one 4 MiB survivor keeps its whole 1 GiB arena. [`Pool::trim`] goes
//! further at an idle point: for each arena with survivors, the *windows* (runs of
//! granularity pages covering its allocated ranges, neighbouring pages merged) get physical
//! memory of their own with the same contents at the same addresses and the rest goes back
//! to the driver (`Backend::split_arena`). Each window becomes an arena of its own (its own
//! id, sub-allocator region, export when shared, observers' `on_ready`), so a later share of
//! a survivor still costs one export per arena it touches, and the free space inside a
//! window stays allocatable.
//!
//! The contract is sleep's: the call synchronizes the device, and nothing may use the
//! device's gpu-arena memory until it returns (between the driver's unmap of an arena and
//! the mapping of its windows the addresses are unmapped; a kernel touching them would
//! fault). The device lock is held across the backend calls of one device: other threads'
//! allocations on it wait, and the device's thread caches are gated for every tag while
//! the trim runs (as sleep gates its tags), so every allocation and free takes the device
//! lock's path and no block can hide in a thread cache, with its arena's key, from the
//! split. The observers' `on_release` of the arenas to split run with the lock released
//! (before the split, as sleep's do); the pool may be used meanwhile, so the device is
//! synchronized again and each arena's windows are computed afresh under the lock (an
//! arena destroyed meanwhile is skipped, and not announced again). Arenas that are shared, exported, pinned, asleep or being
//! announced to an observer are left whole and reported.
//!
//! After a trim, reserved memory is the granularity pages the survivors touch (plus the
//! arenas left whole): for blocks of the large classes, which are granularity multiples at
//! granularity offsets in their arenas, exactly their bytes; a small survivor keeps at most
//! its 2 MiB small arena (`pool/sizes/classes.rs`).

use crate::backend::{ArenaMem, DeviceId};
use crate::error::{Error, Result};
use crate::history::Action;
use crate::pool::graphs::sync_hold::SyncHold;
use crate::pool::state::arena::Arena;
use crate::pool::state::device::DeviceState;
use crate::pool::state::graph_pool_ids;
use crate::pool::state::observer_registry::Call;
use crate::pool::state::pool::{DevicePool, Pool};

/// What a trim did, summed over the devices it touched.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TrimReport {
    /// Bytes `empty_cache` released (arenas with no live block).
    pub emptied_bytes: u64,
    /// Bytes of survivors' arenas given back by splitting them.
    pub released_bytes: u64,
    /// Arenas split.
    pub split_arenas: u64,
    /// Windows (arenas) they became.
    pub windows: u64,
    /// Bytes of arenas left whole because they are shared, exported or pinned.
    pub kept_shared_bytes: u64,
    /// Bytes of arenas left whole for another reason: asleep, an observer's `on_ready`
    /// running, a backend that cannot split, a failed split (logged).
    pub kept_other_bytes: u64,
}

/// An arena to split: its key, its memory and its windows (relative to its base).
type TrimWork = (usize, ArenaMem, Vec<(u64, u64)>);

impl Pool {
    /// `empty_cache`, then split every arena with survivors down to the pages they use, on
    /// `device` (every device for `None`). See the module docs for the contract: the device
    /// must be idle (for gpu-arena memory) until this returns.
    pub fn trim(&self, device: Option<DeviceId>) -> Result<TrimReport> {
        if !self.config.trim_on_empty_cache {
            // (empty_cache told them already when it calls trim)
            self.hooks_before_release(device);
        }
        let _serial = self.sleep_lock.lock();
        let mut report = TrimReport::default();
        for dp in self.sleep_devices(device)? {
            // No capture begins until the trim's second synchronize is done.
            let _no_capture = SyncHold::take(dp, "trim")?;
            let emptied = self.release_cached(dp)?;
            // The thread caches' gate, for every tag, as long as the trim runs: a fast free
            // would put a block (with its arena's key) into a thread cache between the
            // drain (`settle_all`) and `promote_all`, where the split would not see it and
            // its record would keep the replaced arena's key; gated, frees and allocations
            // take the device lock's path.
            dp.state.lock().front.set_asleep_tags(u64::MAX);
            let r = self.trim_device(dp, emptied);
            {
                let st = dp.state.lock();
                st.front.set_asleep_tags(st.asleep_tags);
            }
            let r = r?;
            report.emptied_bytes += r.emptied_bytes;
            report.released_bytes += r.released_bytes;
            report.split_arenas += r.split_arenas;
            report.windows += r.windows;
            report.kept_shared_bytes += r.kept_shared_bytes;
            report.kept_other_bytes += r.kept_other_bytes;
        }
        Ok(report)
    }

    /// Trim one device after its `empty_cache` (which released `emptied` bytes).
    fn trim_device(&self, dp: &DevicePool, emptied: u64) -> Result<TrimReport> {
        let device = dp.device;
        // `release_cached` just synchronized the device (or found no arena to trim).
        let granularity = self.backend.granularity(device)?;
        let mut report = TrimReport {
            emptied_bytes: emptied,
            ..TrimReport::default()
        };
        // 1. Under the lock: the arenas worth splitting, and their observers' on_release.
        let (work, releases) = {
            let mut st = dp.state.lock();
            st.settle_all(self.backend.as_ref());
            st.promote_all();
            self.plan(dp, &mut st, granularity, &mut report)
        };
        if work.is_empty() {
            log_trim(device, &report);
            return Ok(report);
        }
        self.count_failures(self.observers.deliver(releases));
        // The callbacks ran with the lock released: work may have been queued since (the
        // settle below treats every event as complete).
        if let Err(e) = self.backend.synchronize(device) {
            // Nothing split: the released arenas still in the pool are announced again.
            for (key, mem, _) in &work {
                let id = dp
                    .state
                    .lock()
                    .arenas
                    .get(*key)
                    .filter(|a| a.mem == *mem)
                    .map(|a| a.id);
                if let Some(id) = id {
                    self.announce(dp, id, mem);
                }
            }
            return Err(e);
        }
        // 2. Split, under the lock (nothing else may allocate from these arenas meanwhile).
        let mut announce: Vec<(u64, ArenaMem)> = Vec::new();
        let mut first_err = None;
        {
            let mut st = dp.state.lock();
            st.settle_all(self.backend.as_ref());
            st.promote_all();
            for (key, mem, _) in work {
                // While the lock was released the arena may have gone (its survivors freed
                // and an empty_cache run: its slot may even hold another arena now; it was
                // out of the observers' registry, so it was destroyed without a call) or
                // its allocations changed.
                let Some(a) = st.arenas.get(key).filter(|a| a.mem == mem) else {
                    continue;
                };
                let id = a.id;
                let windows = windows_of(&st, a, granularity)
                    .filter(|_| a.lifetime.destroyable() && a.sleep.is_none());
                let Some(windows) = windows else {
                    report.kept_other_bytes += mem.bytes;
                    announce.push((id, mem));
                    continue;
                };
                match self.backend.split_arena(&mem, &windows) {
                    Ok(parts) => {
                        let kept: u64 = parts.iter().map(|w| w.bytes).sum();
                        report.released_bytes += mem.bytes - kept;
                        report.split_arenas += 1;
                        report.windows += parts.len() as u64;
                        let parts = parts.into_iter().map(|w| (w, 1)).collect();
                        match st.replace_by_windows(key, parts, &dp.metrics, Made::NewMemory) {
                            Ok(windows) => announce.extend(windows),
                            // A bug (the windows come from the sub-allocator itself):
                            // reported after the other arenas are done and announced.
                            Err(e) => {
                                tracing::error!(device, base = mem.base, error = %e, "trim: the pool could not record the windows");
                                first_err.get_or_insert(e);
                            }
                        }
                    }
                    Err(e) => {
                        if !matches!(e, Error::Unavailable(_)) {
                            tracing::error!(device, base = mem.base, error = %e, "trim: an arena could not be split; it stays whole");
                        }
                        report.kept_other_bytes += mem.bytes;
                        announce.push((id, mem));
                    }
                }
            }
            dp.metrics.publish(&st.stats_now());
            if self.config.validate {
                st.validate_or_log();
            }
        }
        // 3. Observers: each window (or an arena left whole) is announced as mapped.
        for (id, mem) in &announce {
            self.announce(dp, *id, mem);
        }
        log_trim(device, &report);
        match first_err {
            Some(e) => Err(e),
            None => Ok(report),
        }
    }

    /// The arenas to split (claiming their observers' `on_release`), counting the others.
    fn plan(
        &self,
        dp: &DevicePool,
        st: &mut DeviceState,
        granularity: u64,
        report: &mut TrimReport,
    ) -> (Vec<TrimWork>, Vec<Call>) {
        let mut work = Vec::new();
        let mut calls = Vec::new();
        for (k, a) in st.arenas.iter() {
            if !a.lifetime.destroyable() {
                report.kept_shared_bytes += a.mem.bytes;
                continue;
            }
            // A graph pool in use: its free ranges hold what its graphs write on replay.
            if a.sleep.is_some()
                || !self.backend.can_split(&a.mem)
                || graph_pool_ids::keeps_arenas(&st.graph_pools, a.graph_pool)
            {
                report.kept_other_bytes += a.mem.bytes;
                continue;
            }
            let Some(windows) = windows_of(st, a, granularity) else {
                continue;
            };
            let Some(c) = self.observers.claim_sleep((dp.device, a.mem.base)) else {
                report.kept_other_bytes += a.mem.bytes;
                continue;
            };
            calls.extend(c);
            work.push((k, a.mem.clone(), windows));
        }
        (work, calls)
    }
}

/// The one line a trim logs per device.
fn log_trim(device: DeviceId, report: &TrimReport) {
    tracing::info!(
        device,
        emptied_bytes = report.emptied_bytes,
        released_bytes = report.released_bytes,
        split_arenas = report.split_arenas,
        windows = report.windows,
        kept_shared_bytes = report.kept_shared_bytes,
        kept_other_bytes = report.kept_other_bytes,
        "gpu-arena trim"
    );
}

/// The windows of `a` (relative to its base): its allocated ranges rounded out to
/// `granularity` pages, neighbouring and overlapping pages merged. `None` when the arena
/// has no allocation (empty_cache's to release) or the windows would cover all of it.
fn windows_of(st: &DeviceState, a: &Arena, granularity: u64) -> Option<Vec<(u64, u64)>> {
    let ranges = st.ranges.get(a.class().index())?.ranges(a.mem.base);
    let mut windows: Vec<(u64, u64)> = Vec::new();
    for r in ranges.iter().filter(|r| r.free_tag.is_none()) {
        let start = (r.offset - a.mem.base) / granularity * granularity;
        let end = (r.offset - a.mem.base + r.len).next_multiple_of(granularity);
        match windows.last_mut() {
            Some((s, l)) if start <= *s + *l => *l = end.max(*s + *l) - *s,
            _ => windows.push((start, end - start)),
        }
    }
    let kept: u64 = windows.iter().map(|w| w.1).sum();
    (!windows.is_empty() && kept < a.mem.bytes).then_some(windows)
}

/// How the windows of [`DeviceState::replace_by_windows`] were made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Made {
    /// A trim's: each window a new allocation, the arena's memory released.
    NewMemory,
    /// `empty_cache`'s: a grown arena's chunks kept in place, this many others released.
    ChunksKept { dropped: u64 },
}

impl DeviceState {
    /// Replace arena `key` by its windows `parts` (just split by the backend; each with its
    /// number of chunks): new arena records and ids, sub-allocator regions, address lookup,
    /// each allocation's arena, the stats. Returns the windows with their ids, to announce
    /// to observers.
    pub(crate) fn replace_by_windows(
        &mut self,
        key: usize,
        parts: Vec<(ArenaMem, usize)>,
        metrics: &crate::stats::DeviceMetrics,
        made: Made,
    ) -> Result<Vec<(u64, ArenaMem)>> {
        let old = self.arenas.remove(key);
        self.forget_growing(key);
        let (base, bytes) = (old.mem.base, old.mem.bytes);
        let class = old.class();
        let abs: Vec<(u64, u64)> = parts.iter().map(|(w, _)| (w.base, w.bytes)).collect();
        self.ranges_mut(class)
            .split_region(base, &abs)
            .map_err(|e| {
                Error::Internal(format!("trim: the sub-allocator refused the windows: {e}"))
            })?;
        self.arena_at.remove(base..base + bytes);
        let mut keys = Vec::with_capacity(parts.len());
        let mut out = Vec::with_capacity(parts.len());
        for (w, chunks) in parts {
            let id = self.reserve_arena_id();
            let k = self.arenas.insert(Arena {
                mem: w.clone(),
                id,
                live_allocs: 0,
                lifetime: Default::default(),
                tag: old.tag,
                small: old.small,
                huge: old.huge,
                graph_pool: old.graph_pool,
                sleep: None,
                chunks: u16::try_from(chunks).unwrap_or(u16::MAX),
            });
            self.arena_at.insert(w.base..w.base + w.bytes, k);
            keys.push((w.base, w.bytes, k));
            out.push((id, w));
        }
        // Each window's allocations are its region's allocated ranges (every live record is
        // in the device's map: `promote_all` ran under this lock): no walk of the other
        // arenas' allocations.
        for &(wbase, _, k) in &keys {
            let mut live_allocs = 0;
            for r in self.ranges[class.index()].ranges(wbase) {
                if let (None, Some(live)) = (r.free_tag, self.allocs.get_mut(&r.offset)) {
                    live.arena = k;
                    live_allocs += 1;
                }
            }
            if let Some(a) = self.arenas.get_mut(k) {
                a.live_allocs = live_allocs;
            }
        }
        let kept: u64 = out.iter().map(|(_, w)| w.bytes).sum();
        let s = &mut self.stats;
        s.reserved_bytes -= bytes - kept;
        s.arenas += out.len() as u64 - 1;
        let (creates, destroys) = match made {
            Made::NewMemory => (out.len() as u64, u64::from(old.chunks)),
            Made::ChunksKept { dropped } => (0, dropped),
        };
        s.backend_creates += creates;
        s.backend_destroys += destroys;
        metrics.creates.increment(creates);
        metrics.destroys.increment(destroys);
        if self.history.recording {
            self.history.record(Action::SegmentFree, base, bytes, 0, 0);
            for (_, w) in &out {
                self.history
                    .record(Action::SegmentAlloc, w.base, w.bytes, 0, 0);
            }
        }
        Ok(out)
    }
}
