//! One device's stream rules, behind its lock: which free range an allocation on a stream
//! may take (its own frees, its own limbo, any stream's; in a growing arena the best fit of
//! them), the events that make other streams' free ranges usable by every stream (limbo
//! tags), the frees pending on `record_stream` streams, and a freed range given back to its
//! sub-allocator. The exact-size cache and the flushes before a growth are
//! `device_cache.rs`'s.

use std::time::Duration;

use crate::backend::{Backend, DeviceId, StreamId};
use crate::error::{Error, Result};
use crate::history::Action;
use crate::pool::sizes::blocks::FLUSH_FIRST_ABOVE;
use crate::pool::sizes::classes::{Class, GENERAL};
use crate::pool::state::arena::Live;
use crate::pool::state::device::DeviceState;

/// Tag of free ranges that any stream may reuse.
pub const ANY_STREAM: u64 = u64::MAX;

/// Tags from here up (below [`ANY_STREAM`]) are limbo tags: free ranges of a stream that
/// wait for an event. Stream handles are user-space pointers or small constants, far below.
pub(crate) const LIMBO_BASE: u64 = 0xFFFF_0000_0000_0000;

/// How long an allocation that would otherwise grow the pool waits for events that
/// release enough limbo ranges.
pub const LIMBO_WAIT: Duration = Duration::from_micros(100);

impl DeviceState {
    /// Find a range for `len` bytes usable on `stream`, without creating memory.
    pub(crate) fn take_range(
        &mut self,
        len: u64,
        stream: StreamId,
        class: Class,
        backend: &dyn Backend,
        device: DeviceId,
    ) -> Option<u64> {
        let t = class.index();
        // Created on first use.
        self.ranges_mut(class);
        // The stream's own frees first (safe at once, and it keeps shared space for others),
        // then ranges any stream may use; in a growing arena the best fit of them all.
        let found = if self.grows(class) {
            self.best_fit_usable(t, len, stream)
        } else {
            self.ranges[t]
                .alloc(len, stream.0)
                .or_else(|| {
                    self.limbo_of(stream.0)
                        .and_then(|l| self.ranges[t].alloc(len, l))
                })
                .or_else(|| self.ranges[t].alloc(len, ANY_STREAM))
        };
        if found.is_some() {
            return found;
        }
        // Miss: give this class's cached blocks, the device's and the thread caches', back
        // to the ranges, where they coalesce, and retry: the large ones first, then all (see
        // FLUSH_FIRST_ABOVE; small blocks are all below it).
        // A graph pool's blocks are never cached, so a flush cannot help it.
        if self.grows_freely(class) || class.pool != GENERAL {
            return self.settle_unless_routing(backend, device, class, len, stream);
        }
        // With growing arenas the allocating thread's own cache goes first: an arena that
        // grows is full more often than a 1 GiB one, and taking every thread's blocks on each
        // miss turns the other threads' next hits into misses. Other threads' blocks still go
        // back before any growth.
        let passes: &[(u64, bool)] = if class.small {
            &[(0, false)]
        } else if self.grows(class) && self.front.own_contended() {
            // The device lock is contended (`Front::try_free`): the other threads' cached
            // blocks stay theirs (flushing them turns their next hits into misses, each
            // taking the lock); the arena grows instead.
            &[(FLUSH_FIRST_ABOVE, true), (0, true)]
        } else if self.grows(class) {
            &[
                (FLUSH_FIRST_ABOVE, true),
                (0, true),
                (FLUSH_FIRST_ABOVE, false),
                (0, false),
            ]
        } else {
            &[(FLUSH_FIRST_ABOVE, false), (0, false)]
        };
        if let Some(p) = self.room_without_flushing(backend, device, class, len, stream) {
            return Some(p);
        }
        for &(min_len, own_only) in passes {
            if !self.flush_cached_above(min_len, Some(class), own_only) {
                continue;
            }
            let found = if self.grows(class) {
                self.best_fit_usable(t, len, stream)
            } else {
                self.ranges[t]
                    .alloc(len, stream.0)
                    .or_else(|| self.ranges[t].alloc(len, ANY_STREAM))
            };
            if found.is_some() {
                return found;
            }
        }
        // Still a miss: release ranges whose work has completed, this stream's own included:
        // they move to its limbo tag (which it may still use) and, once its event completed,
        // to `ANY_STREAM`, where they merge with neighbouring free ranges of other streams.
        // (Skipping them left small free ranges of two tags side by side, unmergeable.)
        // Only this class's ranges move: small misses are frequent (small arenas are 2 MiB)
        // and moving the large class's ranges on each of them changed its placement (one
        // more 1 GiB arena on the KV trace, and slower).
        self.settle_unless_routing(backend, device, class, len, stream)
    }

    /// The last resort of [`Self::take_range`]: settle `class`'s streams and retry; not
    /// while allocations are routed to a graph pool (no event may be recorded or queried:
    /// `pool/graphs/graph_pools.rs`), nor for a small class that grows freely.
    pub(crate) fn settle_unless_routing(
        &mut self,
        backend: &dyn Backend,
        device: DeviceId,
        class: Class,
        len: u64,
        stream: StreamId,
    ) -> Option<u64> {
        if self.graph_pools.routing() || (class.pool == GENERAL && self.grows_freely(class)) {
            return None;
        }
        let t = class.index();
        if !self.grows(class) {
            self.settle(backend, device, t, None);
            return self.ranges[t]
                .alloc(len, stream.0)
                .or_else(|| self.ranges[t].alloc(len, ANY_STREAM))
                .or_else(|| {
                    self.limbo_of(stream.0)
                        .and_then(|l| self.ranges[t].alloc(len, l))
                });
        }
        // With growing arenas the allocating stream's own free ranges stay its own: it may
        // use them already, and moving them to a limbo tag would only keep them from
        // merging with its next frees (a program of one stream on a busy GPU, whose events
        // are still pending, reserved 2-9% more that way).
        self.settle(backend, device, t, Some(stream.0));
        if let Some(p) = self.best_fit_usable(t, len, stream) {
            return Some(p);
        }
        // Before the arena grows: the stream's own free ranges take in the space beside them
        // that it may use too (free for any stream; its own frees waiting for their event),
        // so that its pieces between other free space become one range. Free ranges of two
        // tags never merge by themselves: a KV trace of two streams grew its arena by 20%
        // over its live bytes with gigabytes free in such pieces
        // (bench/results/sim-2026-12-02-take-in.md).
        let usable = self.usable_by(stream.0);
        if self.ranges[t].take_in(stream.0, &usable) == 0 {
            return None;
        }
        self.ranges[t].alloc(len, stream.0)
    }

    /// In sub-allocator `t` (a growing class's), the best fit for `len` bytes among the
    /// ranges `stream` may use at once: its own frees, its frees waiting for their event,
    /// and space free for any stream; its own fit is taken at once when at most twice
    /// `len`. Taking its own first, wherever they were, left the better-fitting holes
    /// around them empty: a KV trace of two streams reserved 1.206 of its live bytes that
    /// way, 1.012 with this rule and the take-ins (bench/results/sim-2026-12-02-take-in.md).
    pub(crate) fn best_fit_usable(&mut self, t: usize, len: u64, stream: StreamId) -> Option<u64> {
        let [any, limbo] = self.usable_by(stream.0);
        self.ranges[t]
            .alloc_best_of(len, &[stream.0, limbo, any])
            .map(|(p, _)| p)
    }

    /// The tags of free ranges that `stream` may use besides its own: space free for any
    /// stream, and its own frees waiting for their event (any stream's again when it has
    /// none pending).
    fn usable_by(&self, stream: u64) -> [u64; 2] {
        [ANY_STREAM, self.limbo_of(stream).unwrap_or(ANY_STREAM)]
    }

    /// Poll pending frees and per-stream events (recording events where none is pending);
    /// ranges of sub-allocator `class` (a `Class::index`) whose streams are done become
    /// reusable by any stream.
    /// `keep`: a stream whose ranges stay as they are.
    pub(crate) fn settle(
        &mut self,
        backend: &dyn Backend,
        device: DeviceId,
        class: usize,
        keep: Option<u64>,
    ) {
        self.poll_pending(backend);
        // Completed events first: an event recorded by another class's settle covers only
        // that class's ranges, and while it is pending its stream gets no other event.
        self.retire_done_events(backend);
        // Streams with free ranges in `class` and no event yet: record one, and move exactly
        // the ranges it covers (those freed so far) to a limbo tag of their own. (A stream's
        // ranges in other classes keep their stream tag until a settle of their class; an
        // event completing frees its limbo ranges wherever they are.)
        let tags = self
            .ranges
            .get(class)
            .map(|r| r.free_tags())
            .unwrap_or_default();
        for (tag, _) in tags {
            if tag >= LIMBO_BASE || self.stream_events.contains_key(&tag) || keep == Some(tag) {
                continue;
            }
            match backend.record_event(device, StreamId(tag)) {
                Ok(ev) => {
                    let limbo = LIMBO_BASE + self.next_limbo;
                    self.next_limbo = (self.next_limbo + 1) % (ANY_STREAM - LIMBO_BASE);
                    self.ranges[class].retag(tag, limbo);
                    self.stream_events.insert(tag, (ev, limbo));
                }
                Err(e) => tracing::warn!(error = %e, "record_event failed"),
            }
        }
        // An idle stream's fresh event completes at once.
        self.retire_done_events(backend);
    }

    /// Events that completed: their limbo ranges are safe for every stream.
    fn retire_done_events(&mut self, backend: &dyn Backend) {
        let done: Vec<u64> = self
            .stream_events
            .iter()
            .filter(|(_, (ev, _))| backend.event_done(ev).unwrap_or(false))
            .map(|(&tag, _)| tag)
            .collect();
        for tag in done {
            if let Some((ev, limbo)) = self.stream_events.remove(&tag) {
                let _ = backend.destroy_event(ev);
                for r in &mut self.ranges {
                    r.retag(limbo, ANY_STREAM);
                }
            }
        }
    }

    /// Free bytes of `class` in limbo tags: freed on some stream, waiting for its event;
    /// none counted for a class that grows without settling (`grows_freely`): waiting for
    /// its events would not make them usable.
    pub(crate) fn limbo_bytes(&self, class: Class) -> u64 {
        if self.grows_freely(class) {
            return 0;
        }
        self.ranges
            .get(class.index())
            .map_or(0, |r| r.free_bytes_in(LIMBO_BASE..=ANY_STREAM - 1))
    }

    /// The limbo tag holding `stream`'s own earlier frees (reusable by that stream at once).
    pub(crate) fn limbo_of(&self, stream: u64) -> Option<u64> {
        self.stream_events.get(&stream).map(|(_, limbo)| *limbo)
    }

    /// After a device synchronize: every event is complete, so every range is free for any
    /// stream.
    pub(crate) fn settle_all(&mut self, backend: &dyn Backend) {
        self.flush_cache();
        for p in std::mem::take(&mut self.pending) {
            for ev in p.events {
                let _ = backend.destroy_event(ev);
            }
            self.finish_pending(p.ptr, p.stream);
        }
        for (_, (ev, _)) in self.stream_events.drain() {
            let _ = backend.destroy_event(ev);
        }
        for r in &mut self.ranges {
            for (tag, _) in r.free_tags() {
                r.retag(tag, ANY_STREAM);
            }
        }
    }

    pub(crate) fn poll_pending(&mut self, backend: &dyn Backend) {
        let mut i = 0;
        while i < self.pending.len() {
            let p = &self.pending[i];
            let done = !p.until_synchronize
                && p.events
                    .iter()
                    .all(|e| backend.event_done(e).unwrap_or(false));
            if done {
                let p = self.pending.swap_remove(i);
                for ev in p.events {
                    let _ = backend.destroy_event(ev);
                }
                self.finish_pending(p.ptr, p.stream);
            } else {
                i += 1;
            }
        }
    }

    pub(crate) fn finish_pending(&mut self, ptr: u64, stream: StreamId) {
        let bytes = self.allocs.get(&ptr).map_or(0, Live::bytes);
        self.stats.pending_free_bytes -= bytes;
        if let Err(e) = self.release_range(ptr, stream.0) {
            tracing::error!(error = %e, "releasing a pending free failed");
        }
    }

    /// Release an allocation its owner freed while shared, now that its last share or lease
    /// ended: at once under its own stream's tag (consumers synchronize before they close),
    /// or, when `record_stream` added streams, once events recorded on them now complete.
    pub(crate) fn release_deferred(&mut self, ptr: u64, backend: &dyn Backend, device: DeviceId) {
        let Some(live) = self.allocs.get(&ptr) else {
            return;
        };
        let (stream, extra, bytes) = (live.stream, live.extra_streams().to_vec(), live.bytes());
        self.stats.deferred_free_bytes -= bytes;
        if let Err(e) = self.release_freed(ptr, stream, extra, bytes, backend, device) {
            tracing::error!(error = %e, "releasing a deferred free failed");
        }
    }

    /// Give an allocation's range back to the sub-allocator under `tag` and drop its record.
    pub(crate) fn release_range(&mut self, ptr: u64, tag: u64) -> Result<()> {
        let live = self
            .allocs
            .remove(&ptr)
            .ok_or_else(|| Error::Internal(format!("release of unknown range {ptr:#x}")))?;
        self.release_live(ptr, live, tag)
    }

    /// Give a removed record's range back to the sub-allocator under `tag`.
    pub(crate) fn release_live(&mut self, ptr: u64, live: Live, tag: u64) -> Result<()> {
        let class = self.arenas.get(live.arena).map(|a| a.class());
        let t = class.map_or(0, |c| c.index());
        // In a growing arena a stream's free takes in the free space beside it that the
        // stream may use (`usable_by`): one stream's pieces between other free space stay
        // one range, as in one of PyTorch's per-stream segments.
        let take_in = tag < LIMBO_BASE && class.is_some_and(|c| self.grows(c));
        let usable = if take_in {
            self.usable_by(tag)
        } else {
            [tag; 2]
        };
        self.ranges
            .get_mut(t)
            .ok_or(crate::range::RangeError::NotAllocated(ptr))
            .and_then(|r| {
                if take_in {
                    r.free_taking_in(ptr, tag, &usable)
                } else {
                    r.free(ptr, tag)
                }
            })
            .map_err(|e| Error::Internal(format!("range allocator refused a free: {e}")))?;
        if let Some(a) = self.arenas.get_mut(live.arena) {
            a.live_allocs -= 1;
        }
        self.front.sub_bytes(live.bytes(), live.requested);
        self.stats.allocations = self.stats.allocations.wrapping_sub(1);
        if self.history.recording {
            let (len, req, stream) = (live.bytes(), live.requested, live.stream.0);
            self.history
                .record(Action::FreeCompleted, ptr, len, req, stream);
        }
        Ok(())
    }
}
