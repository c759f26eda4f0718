//! Free and `record_stream`: the thread front's fast free first (`pool/front/thread_cache.rs`),
//! else, under the device lock, the allocation's record promoted from the front and the
//! stream rules applied (the exact-size cache, pending frees that wait for events on
//! `record_stream` streams, deferred frees of shared ranges). `DeviceState::release_freed`
//! is the one rule for a freed range, here and when a shared range's last share ends.

use std::collections::hash_map::Entry;

use crate::backend::{Backend, DeviceId, StreamId};
use crate::error::{Error, Result};
use crate::history::Action;
use crate::lifetime::FreeStep;
use crate::pool::sizes::classes::GENERAL;
use crate::pool::state::arena::{Live, PendingFree};
use crate::pool::state::device::DeviceState;
use crate::pool::state::pool::{DevicePool, Pool};

impl Pool {
    /// Free an allocation. A range still shared with other processes is kept until its
    /// shares end; a range recorded on other streams is kept until their work completes.
    pub fn free(&self, ptr: u64) -> Result<()> {
        if self.devices.len() > 1 {
            // The calling thread's own cache of each device first: no device lock.
            for dp in &self.devices {
                if let Some(seen) = dp.front.try_free_own(ptr) {
                    self.after_fast_free(dp, seen);
                    return Ok(());
                }
            }
        }
        let dp = self.device_of(ptr)?;
        self.free_on(dp, ptr, None)
    }

    /// Free with the caller's view of the allocation checked first (the C API passes the
    /// size it asked for and the device): a mismatch is an error and changes nothing.
    pub fn free_checked(&self, ptr: u64, requested: u64, device: DeviceId) -> Result<()> {
        let dp = self.dev(device)?;
        self.free_on(dp, ptr, Some(requested))
    }

    /// After a free by the thread front: the gauges, and `validate` when configured.
    fn after_fast_free(&self, dp: &DevicePool, [allocated_bytes, requested_bytes]: [u64; 2]) {
        dp.metrics
            .publish_allocated(allocated_bytes, requested_bytes);
        if self.config.validate {
            dp.state.lock().validate_or_log();
        }
    }

    /// The device whose arenas contain `ptr` (the free path then says precisely what is
    /// wrong with it).
    fn device_of(&self, ptr: u64) -> Result<&DevicePool> {
        if let [only] = self.devices.as_slice() {
            return Ok(only);
        }
        // Every allocation, plain or not, lies inside an arena of its device.
        for dp in &self.devices {
            let st = dp.state.lock();
            if st.allocs.contains_key(&ptr) || st.arena_of(ptr).is_some() {
                return Ok(dp);
            }
        }
        Err(Error::UnknownPointer {
            ptr,
            why: "not inside any arena of gpu-arena (never allocated here)".into(),
        })
    }

    fn free_on(&self, dp: &DevicePool, ptr: u64, requested: Option<u64>) -> Result<()> {
        // Fast path: a plain allocation into this thread's cache, no device lock.
        if let Some(seen) = dp.front.try_free(ptr, requested, || dp.state.is_locked()) {
            self.after_fast_free(dp, seen);
            return Ok(());
        }
        self.free_locked(dp, ptr, requested)
    }

    /// A free the thread front declined, under the device lock. Out of line, so the fast
    /// path's frame stays small.
    #[cold]
    #[inline(never)]
    fn free_locked(&self, dp: &DevicePool, ptr: u64, requested: Option<u64>) -> Result<()> {
        let mut st = dp.state.lock();
        st.reclaim_gone_caches();
        // A record of the front (plain by definition; the fast path declined it: a
        // gate, a large block) is freed at once, not through the device's map.
        let plain = match st.front.take_live(ptr) {
            Some(rec) if requested.is_none_or(|r| r == rec.requested) => Some(st.promoted(rec)),
            Some(rec) => {
                st.insert_promoted(ptr, rec);
                None
            }
            None => {
                // Not shared, no other streams, size as recorded: one hash lookup, which
                // removes the record.
                match st.allocs.entry(ptr) {
                    Entry::Occupied(e)
                        if e.get().hold.is_plain()
                            && e.get().extra_streams.is_none()
                            && requested.is_none_or(|r| r == e.get().requested) =>
                    {
                        Some(e.remove())
                    }
                    _ => None,
                }
            }
        };
        if let Some(live) = plain {
            st.stats.free_count = st.stats.free_count.wrapping_add(1);
            let bytes = live.bytes();
            if st.history.recording {
                let (req, s) = (live.requested, live.stream.0);
                st.history.record(Action::FreeRequested, ptr, bytes, req, s);
            }
            // A graph pool's block goes back to its pool's sub-allocator, never to a cache
            // (pool/graphs/graph_pools.rs, rule 2).
            let general = st
                .arenas
                .get(live.arena)
                .is_some_and(|a| a.graph_pool == GENERAL);
            let cacheable = general
                && bytes <= st.front.cache_max()
                && st.cached_bytes + bytes <= st.stats.reserved_bytes / 4;
            if cacheable {
                st.cache_live(ptr, live);
            } else {
                let tag = live_tag(&live);
                st.release_live(ptr, live, tag)?;
            }
            let [allocated_bytes, requested_bytes] = dp.front.seen_bytes();
            dp.metrics
                .publish_allocated(allocated_bytes, requested_bytes);
            if self.config.validate {
                st.validate_or_log();
            }
            return Ok(());
        }
        let live = st.check_live(ptr, dp.device)?;
        if let Some(req) = requested {
            if req != live.requested {
                return Err(Error::invalid(format!(
                    "free of {ptr:#x} with size {req}: it was allocated with size {}",
                    live.requested
                )));
            }
        }
        let (stream, extra) = (live.stream, live.extra_streams().to_vec());
        let step = {
            let st = &mut *st;
            let lifetime = st.arenas.get(live.arena).map(|a| &a.lifetime);
            match (lifetime, st.allocs.get_mut(&ptr)) {
                (Some(lt), Some(l)) => lt.free(&mut l.hold).map_err(|e| Error::UnknownPointer {
                    ptr,
                    why: e.to_string(),
                })?,
                _ => {
                    return Err(Error::Internal(format!(
                        "free of {ptr:#x}: record or arena gone"
                    )))
                }
            }
        };
        st.stats.free_count = st.stats.free_count.wrapping_add(1);
        if st.history.recording {
            let (len, req) = (live.bytes(), live.requested);
            st.history
                .record(Action::FreeRequested, ptr, len, req, stream.0);
        }
        if step == FreeStep::Deferred {
            // Still shared: the range waits for its last reference (pool/sharing/share.rs releases
            // it when the lifetime says so).
            st.stats.deferred_free_bytes += live.bytes();
        } else {
            // At once, or after events on its other streams (an event that cannot be
            // recorded makes it wait for a device synchronize: the free itself is done), or
            // after the capture (pool/graphs/graph_pools.rs, rule 4).
            let backend = self.backend.as_ref();
            st.release_freed(ptr, stream, extra, live.bytes(), backend, dp.device)?;
        }
        dp.metrics.publish(&st.stats_now());
        if self.config.validate {
            st.validate_or_log();
        }
        Ok(())
    }

    /// Mark `ptr` as used on `stream` too: its range is not reused after free until the
    /// work enqueued on `stream` before the free has completed.
    pub fn record_stream(&self, ptr: u64, stream: StreamId) -> Result<()> {
        let dp = self.device_of(ptr)?;
        let mut st = dp.state.lock();
        st.promote(ptr);
        let live = st
            .allocs
            .get_mut(&ptr)
            .filter(|l| !l.hold.freed())
            .ok_or_else(|| Error::UnknownPointer {
                ptr,
                why: "record_stream on a pointer that is not a live allocation".into(),
            })?;
        if live.stream != stream
            && !live.extra_streams().contains(&stream)
            && !self.config.unsafe_ignore_streams
        {
            let mut extra = live.extra_streams.take().map(Vec::from).unwrap_or_default();
            extra.push(stream);
            live.extra_streams = Some(extra.into_boxed_slice());
        }
        Ok(())
    }
}

impl DeviceState {
    /// Give back the range of an allocation its owner freed (of `bytes`, used on the
    /// `record_stream` streams `extra` besides `stream`): at once under its stream's tag when
    /// there are none; else once events recorded now on them complete (counted in
    /// `pending_free_bytes` meanwhile), or, while a graph pool routes allocations and no
    /// event may be recorded, when the last routing context closes.
    pub(crate) fn release_freed(
        &mut self,
        ptr: u64,
        stream: StreamId,
        extra: Vec<StreamId>,
        bytes: u64,
        backend: &dyn Backend,
        device: DeviceId,
    ) -> Result<()> {
        if extra.is_empty() {
            return self.release_range(ptr, stream.0);
        }
        if self.graph_pools.routing() {
            self.defer_until_no_capture(ptr, bytes);
            return Ok(());
        }
        self.stats.pending_free_bytes += bytes;
        self.pend_on_streams(ptr, stream, extra, backend, device);
        Ok(())
    }

    /// Queue a freed allocation (counted in `pending_free_bytes` already) until events
    /// recorded now on each of its `record_stream` streams complete; one that cannot be
    /// recorded makes it wait for a device synchronize instead.
    pub(crate) fn pend_on_streams(
        &mut self,
        ptr: u64,
        stream: StreamId,
        extra: Vec<StreamId>,
        backend: &dyn Backend,
        device: DeviceId,
    ) {
        let mut events = Vec::with_capacity(extra.len());
        let mut until_synchronize = false;
        for s in extra {
            match backend.record_event(device, s) {
                Ok(e) => events.push(e),
                Err(e) => {
                    tracing::warn!(error = %e, "record_event failed: the range waits for a synchronize");
                    until_synchronize = true;
                }
            }
        }
        self.pending.push(PendingFree {
            ptr,
            stream,
            events,
            until_synchronize,
        });
    }
}

/// The tag a plain free uses: the allocation's own stream.
fn live_tag(live: &Live) -> u64 {
    live.stream.0
}
