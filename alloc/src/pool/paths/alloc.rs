//! The allocation path: the thread front's hit; under the device lock the awake check (here),
//! the device's exact-size cache (`device_cache.rs`) and a free range the stream may use
//! (`streams.rs`); then growth: the device's limits and a growing arena mapping more
//! (`pool/growth/`), else a new arena entering the pool (`new_arena.rs`), and on the
//! driver's out of memory `empty_cache` and one more try. The free path is `free.rs`; the
//! rules both follow are in `pool/mod.rs`'s module docs. Graph pools
//! (`pool/graphs/graph_pools.rs`) enter at [`Pool::alloc_slow`]'s locked half with a class of
//! their own and skip the caches.

use std::time::Instant;

use crate::backend::{DeviceId, StreamId};
use crate::error::{Error, Result};
use crate::history::Action;
use crate::pool::front::thread_records::FrontLive;
use crate::pool::paths::streams::{ANY_STREAM, LIMBO_WAIT};
use crate::pool::sizes::blocks::{block_len, request_len};
use crate::pool::sizes::classes::{self, Class, GENERAL};
use crate::pool::sizes::growth_steps;
use crate::pool::state::device::DeviceState;
use crate::pool::state::pool::{DevicePool, Pool};
use crate::tags;

/// A live allocation, as handed to the caller. Plain data: free it with [`Pool::free`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allocation {
    /// Device address of the first byte.
    pub ptr: u64,
    /// Usable size in bytes (the request rounded up by [`block_len`]).
    pub bytes: u64,
    /// Device.
    pub device: DeviceId,
}

impl Pool {
    /// Allocate `bytes` on `device` for use on `stream`.
    pub fn alloc(&self, device: DeviceId, bytes: u64, stream: StreamId) -> Result<Allocation> {
        let dp = self.dev(device)?;
        let len = request_len(device, bytes)?;
        let stream = self.stream_of(stream);
        let tag = crate::tags::current();
        // Fast path: a block freed on this stream, from this thread's cache, no device lock.
        if let Some((ptr, [allocated_bytes, requested_bytes])) =
            dp.front.try_alloc(stream.0, len, tag, bytes)
        {
            dp.metrics
                .publish_allocated(allocated_bytes, requested_bytes);
            if self.config.validate {
                dp.state.lock().validate_or_log();
            }
            return Ok(Allocation {
                ptr,
                bytes: len,
                device,
            });
        }
        self.alloc_locked(dp, len, bytes, stream, tag)
    }

    /// The stream an allocation is recorded on (every stream's when streams are ignored).
    pub(crate) fn stream_of(&self, stream: StreamId) -> StreamId {
        if self.config.unsafe_ignore_streams {
            StreamId(ANY_STREAM)
        } else {
            stream
        }
    }

    /// A thread cache miss: an exact-size block from the device's cache, else a best-fit
    /// range (under the lock, no driver call), else [`Self::alloc_slow`]. Out of line, so
    /// the fast path's frame stays small.
    #[cold]
    #[inline(never)]
    fn alloc_locked(
        &self,
        dp: &DevicePool,
        len: u64,
        bytes: u64,
        stream: StreamId,
        tag: u8,
    ) -> Result<Allocation> {
        let device = dp.device;
        let class = {
            let mut st = dp.state.lock();
            st.check_awake(device, tag, bytes)?;
            st.reclaim_gone_caches();
            if let Some((ptr, arena)) = st.take_cached(stream.0, len, tag) {
                return Ok(self.finish_alloc_in(dp, &mut st, ptr, arena, len, bytes, stream));
            }
            let class = Class::of(tag, len, st.huge_min());
            if let Some(ptr) = st.take_range(len, stream, class, self.backend.as_ref(), device) {
                return Ok(self.finish_alloc(dp, &mut st, ptr, len, bytes, stream));
            }
            class
        };
        self.alloc_slow(dp, len, bytes, stream, class)
    }

    /// A range of `class` (retried under the lock), else a new arena for it; on the
    /// driver's out of memory, the cached arenas released and one more try.
    pub(crate) fn alloc_slow(
        &self,
        dp: &DevicePool,
        len: u64,
        requested: u64,
        stream: StreamId,
        class: Class,
    ) -> Result<Allocation> {
        let device = dp.device;
        let (limits, cap_setting) = self.limits_now(dp)?;
        let (growing, class_bytes) = {
            let st = dp.state.lock();
            let growing = st.grows(class);
            // The class's arenas double only while its growing arena cannot grow.
            let doubling = growing && st.growing.contains_key(&class.index());
            (growing, if doubling { st.class_bytes(class) } else { 0 })
        };
        let arena_bytes = if growing {
            growth_steps::first_chunk(class_bytes, len, limits.granularity)
        } else {
            classes::arena_bytes_for(class, len, limits.arena_bytes, limits.granularity)
        }
        .ok_or_else(|| Error::invalid("size overflows"))?;
        let mut retried = false;
        loop {
            // Recycled (pinned) arenas and any range freed meanwhile come first. Ranges that
            // wait only for a just-recorded event (limbo) are worth a short wait: an event
            // on an idle stream completes within microseconds, creating an arena costs
            // hundreds and grows the pool for good. Not while a graph pool routes
            // allocations: no event is queried then (`pool/graphs/graph_pools.rs`).
            let deadline = Instant::now() + LIMBO_WAIT;
            let routing = loop {
                let mut st = dp.state.lock();
                st.check_awake(device, class.tag, requested)?;
                if let Some(ptr) = st.take_range(len, stream, class, self.backend.as_ref(), device)
                {
                    return Ok(self.finish_alloc(dp, &mut st, ptr, len, requested, stream));
                }
                let routing = st.graph_pools.routing();
                if routing || st.limbo_bytes(class) < len || Instant::now() >= deadline {
                    if growing {
                        if let Some(ptr) =
                            self.grow_in_place(dp, &mut st, class, len, stream, &limits)?
                        {
                            return Ok(self.finish_alloc(dp, &mut st, ptr, len, requested, stream));
                        }
                    }
                    break routing;
                }
                drop(st);
                std::thread::yield_now();
            };
            let capped = limits.over_cap(|| dp.state.lock().reserved_now(), arena_bytes);
            // An arena larger than the device fails at once, without a driver call.
            let created = if capped || arena_bytes > limits.total {
                Err(Error::DriverOutOfMemory {
                    backend: self.backend.name(),
                    call: if capped { "max_reserved" } else { "arena_size" },
                    device,
                    bytes: arena_bytes,
                })
            } else if growing {
                let reserve = limits.total.next_multiple_of(limits.granularity);
                self.backend
                    .create_growable_arena(device, arena_bytes, reserve.max(arena_bytes))
            } else {
                self.backend.create_arena(device, arena_bytes)
            };
            match created {
                Ok(mem) => {
                    // Observers' on_ready runs before the arena enters the pool.
                    let (mut st, key) = self.install_arena(dp, mem, class)?;
                    if growing {
                        st.growing.insert(class.index(), key);
                    }
                    dp.metrics.publish(&st.stats_now());
                    let ptr = st.ranges_mut(class).alloc(len, ANY_STREAM).ok_or_else(|| {
                        Error::Internal(format!("fresh arena {key} cannot fit {len} bytes"))
                    })?;
                    return Ok(self.finish_alloc(dp, &mut st, ptr, len, requested, stream));
                }
                // The retry synchronizes the device: never while a capture may be under way.
                Err(Error::DriverOutOfMemory { .. }) if !retried && !routing => {
                    retried = true;
                    tracing::debug!(
                        device,
                        len,
                        "out of memory: releasing cached arenas and retrying"
                    );
                    // A destroy that fails there keeps its arena (an orphan, retried later):
                    // the retry then says out of memory, not what the destroy said.
                    if let Err(e) = self.release_cached(dp) {
                        tracing::warn!(device, error = %e, "releasing cached arenas before the retry failed");
                    }
                }
                Err(Error::DriverOutOfMemory { .. }) => {
                    let mut st = dp.state.lock();
                    st.stats.oom_count += 1;
                    dp.metrics.ooms.increment(1);
                    let oom =
                        self.out_of_memory(dp, &st, &limits, cap_setting, arena_bytes, capped, len);
                    // (The history's OOM event carries the device's free bytes.)
                    if let Error::OutOfMemory { free, .. } = oom {
                        if st.history.recording {
                            st.history
                                .record(Action::Oom, free, len, requested, stream.0);
                        }
                    }
                    return Err(oom);
                }
                Err(e) => return Err(e),
            }
        }
    }

    pub(crate) fn finish_alloc(
        &self,
        dp: &DevicePool,
        st: &mut DeviceState,
        ptr: u64,
        len: u64,
        requested: u64,
        stream: StreamId,
    ) -> Allocation {
        let arena = st.arena_of(ptr).unwrap_or(usize::MAX);
        self.finish_alloc_in(dp, st, ptr, arena, len, requested, stream)
    }

    #[allow(clippy::too_many_arguments)]
    fn finish_alloc_in(
        &self,
        dp: &DevicePool,
        st: &mut DeviceState,
        ptr: u64,
        arena: usize,
        len: u64,
        requested: u64,
        stream: StreamId,
    ) -> Allocation {
        debug_assert_eq!(block_len(requested), Some(len));
        let (tag, graph_pool) = st
            .arenas
            .get(arena)
            .map_or((0, GENERAL), |a| (a.tag, a.graph_pool));
        let rec = FrontLive {
            arena,
            requested,
            stream: stream.0,
            tag,
        };
        // A plain allocation: recorded in the front, where its free needs no device lock.
        // A graph pool's block is recorded by the device (its free takes the pool's rules).
        let [allocated_bytes, requested_bytes] = if graph_pool == GENERAL {
            let (recorded, seen) = st.front.record_alloc(ptr, rec, len);
            if !recorded {
                st.insert_promoted(ptr, rec);
            }
            seen
        } else {
            st.insert_promoted(ptr, rec);
            st.front.count_unrecorded(len, requested)
        };
        let s = &mut st.stats;
        s.allocations = s.allocations.wrapping_add(1);
        s.alloc_count = s.alloc_count.wrapping_add(1);
        dp.metrics
            .publish_allocated(allocated_bytes, requested_bytes);
        if st.history.recording {
            st.history
                .record(Action::Alloc, ptr, len, requested, stream.0);
        }
        if self.config.validate {
            st.validate_or_log();
        }
        Allocation {
            ptr,
            bytes: len,
            device: dp.device,
        }
    }
}

impl DeviceState {
    /// Refuse an allocation of `bytes` with tag `tag` while that tag sleeps.
    #[inline]
    pub(crate) fn check_awake(&self, device: DeviceId, tag: u8, bytes: u64) -> Result<()> {
        if self.asleep_tags & (1 << tag) != 0 {
            return Err(asleep_error(device, tag, bytes));
        }
        Ok(())
    }
}

/// The error of an allocation with a tag that sleeps.
fn asleep_error(device: DeviceId, tag: u8, bytes: u64) -> Error {
    Error::InvalidState(format!(
        "alloc of {bytes} bytes with tag {:?} on device {device}: the tag is asleep \
         (gpu_arena_wake it first)",
        tags::name(tag)
    ))
}
