//! Arenas that grow with the work (issue #24): a large or huge class of the general pool
//! keeps one *growing* arena, whose address range is reserved for the whole device
//! (`Backend::create_growable_arena`) and whose physical memory is mapped chunk by chunk as
//! it fills (`Backend::grow_arena`). Its free tail and a new chunk are one free range, so a
//! request that does not fit takes the tail and only the shortfall is mapped: reserved
//! follows live, as with PyTorch's expandable segments, and free ranges coalesce across
//! the whole arena instead of within 1 GiB.
//!
//! An arena stops growing when it is shared (its export is one fd per chunk, made once:
//! no chunk may appear behind it), while an observer watches the device (they are told of
//! arenas, not of growth steps), asleep, at [`crate::backend::MAX_ARENA_CHUNKS`] chunks, or
//! when its reservation is full; the class then starts a new growing arena. Small blocks and
//! graph pools keep arenas of fixed size (`pool/sizes/classes.rs`).
//!
//! How much a growth maps is `pool/sizes/growth_steps.rs`'s; giving grown arenas' free
//! chunks back at `empty_cache` is `shrink.rs`'s.

use crate::backend::{StreamId, MAX_ARENA_CHUNKS};
use crate::error::{Error, Result};
use crate::history::Action;
use crate::pool::paths::streams::ANY_STREAM;
use crate::pool::sizes::classes::Class;
use crate::pool::sizes::growth_steps::growth_step;
use crate::pool::state::config::DeviceLimits;
use crate::pool::state::device::DeviceState;
use crate::pool::state::pool::{DevicePool, Pool};
use crate::range;

impl Pool {
    /// Under the device lock: grow `class`'s growing arena so that a block of `len` fits, and
    /// take it. `Ok(None)` when the class has no arena that may grow by that much (the caller
    /// makes a new one). The driver call runs under the lock: growth is rare, and nothing
    /// else may change the arena meanwhile (an export would miss the new chunk).
    pub(crate) fn grow_in_place(
        &self,
        dp: &DevicePool,
        st: &mut DeviceState,
        class: Class,
        len: u64,
        stream: StreamId,
        limits: &DeviceLimits,
    ) -> Result<Option<u64>> {
        let granularity = limits.granularity;
        let t = class.index();
        let Some(&key) = st.growing.get(&t) else {
            return Ok(None);
        };
        // (A key of an arena since released may name another arena now.)
        let Some(a) = st.arenas.get(key).filter(|a| a.class().index() == t) else {
            st.growing.remove(&t);
            return Ok(None);
        };
        if a.sleep.is_some() || a.lifetime.export_begun() || a.lifetime.pinned() {
            return Ok(None);
        }
        if usize::from(a.chunks) >= MAX_ARENA_CHUNKS {
            // Full: it stays the class's growing arena, so that the next one doubles
            // (`first_chunk`).
            return Ok(None);
        }
        let mem = a.mem.clone();
        // A free tail of any stream's, or of the allocating stream's own, joins the new
        // chunk: the growth maps only the shortfall. A fresh chunk is any stream's (no work
        // used it).
        let (tail, tag) = match st.ranges[t].free_tail(mem.base) {
            Some((bytes, tag)) if tag == ANY_STREAM || tag == stream.0 => (bytes, tag),
            _ => (0, ANY_STREAM),
        };
        let step = growth_step(mem.bytes, tail, len, granularity);
        let exact = range::round_up_to(len.saturating_sub(tail), granularity);
        let (Some(step), Some(exact)) = (step, exact) else {
            return Err(Error::invalid("size overflows"));
        };
        // The step, else (over the cap, or the driver out of memory) just the shortfall.
        let mut grown = None;
        let tries = if step == exact {
            &[step][..]
        } else {
            &[step, exact][..]
        };
        for &extra in tries {
            if limits.over_cap(|| st.reserved_now(), extra) || !self.backend.can_grow(&mem, extra) {
                continue;
            }
            let key_at = (dp.device, mem.base);
            let Some(result) = self
                .observers
                .resize_unobserved(key_at, || self.backend.grow_arena(&mem, extra))
            else {
                return Ok(None);
            };
            match result {
                Err(Error::DriverOutOfMemory { .. }) => grown = Some(None),
                Err(e) => return Err(e),
                Ok(m) => {
                    grown = Some(Some((m, extra)));
                    break;
                }
            }
        }

        let Some(Some((grown, extra))) = grown else {
            return Ok(None);
        };
        st.ranges[t]
            .grow_region(mem.base, extra, tag)
            .map_err(|e| Error::Internal(format!("grown arena's range: {e}")))?;
        st.arena_at.remove(mem.base..mem.base + mem.bytes);
        st.arena_at
            .insert(grown.base..grown.base + grown.bytes, key);
        if let Some(a) = st.arenas.get_mut(key) {
            a.mem = grown;
            a.chunks += 1;
        }
        st.stats.reserved_bytes += extra;
        st.raise_reserved_peak();
        let s = &mut st.stats;
        s.backend_creates += 1;
        s.arena_growths += 1;
        dp.metrics.creates.increment(1);
        if st.history.recording {
            st.history
                .record(Action::SegmentAlloc, mem.base + mem.bytes, extra, 0, 0);
        }
        Ok(st.ranges[t].alloc(len, tag))
    }
}
