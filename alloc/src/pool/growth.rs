//! Arenas that grow with the work (issue #24): a large or huge class of the general pool
//! keeps one *growing* arena, whose address range is reserved for the whole device
//! (`Backend::create_growable_arena`) and whose physical memory is mapped chunk by chunk as
//! it fills (`Backend::grow_arena`). Its free tail and a new chunk are one free range, so a
//! request that does not fit takes the tail and only the shortfall is mapped: reserved
//! follows live, as with PyTorch's expandable segments, and free ranges coalesce across
//! the whole arena instead of within 1 GiB.
//!
//!
//! An arena stops growing when it is shared (its export is one fd per chunk, made once:
//! no chunk may appear behind it), while an observer watches the device (they are told of
//! arenas, not of growth steps), asleep, at [`crate::backend::MAX_ARENA_CHUNKS`] chunks, or
//! when its reservation is full; the class then starts a new growing arena. Small blocks and
//! graph pools keep arenas of fixed size (`pool/classes.rs`).

use super::trim::Made;
use crate::backend::{ArenaMem, StreamId, MAX_ARENA_CHUNKS};
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

impl Pool {
    /// At `empty_cache`, with the device synchronized and every stream settled (under the
    /// device lock): give back each grown arena's chunks that its free tail covers whole, so
    /// that what `empty_cache` leaves of a grown arena is what its live blocks reach (PyTorch's
    /// expandable segments unmap their free tail pages the same way). Not an arena that is
    /// exported (its export covers every chunk), asleep, pinned, or seen by an observer
    /// (they are told of arenas, not of their sizes changing). Returns the bytes released.
    pub(crate) fn shrink_free_tails(&self, dp: &DevicePool, st: &mut DeviceState) -> u64 {
        let mut released = 0;
        for (key, mem, t) in grown_arenas_to_cut(st) {
            let keep = match st.ranges.get(t).and_then(|r| r.free_tail(mem.base)) {
                Some((tail, ANY_STREAM)) if tail > 0 => mem.bytes - tail,
                _ => continue,
            };
            let mut chunks = 0;
            let shrunk = self.observers.resize_unobserved((dp.device, mem.base), || {
                let (m, n) = self.backend.shrink_arena(&mem, keep)?;
                chunks = n;
                Ok(m)
            });
            let shrunk = match shrunk {
                None => continue,
                Some(Err(e)) => {
                    tracing::warn!(error = %e, base = mem.base, "shrinking a grown arena failed");
                    continue;
                }
                Some(Ok(m)) if m.bytes < mem.bytes => m,
                Some(Ok(_)) => continue,
            };
            if let Err(e) = st.ranges[t].shrink_region(mem.base, shrunk.bytes) {
                tracing::error!(error = %e, base = mem.base, "a shrunk arena's range");
            }
            st.arena_at.remove(mem.base..mem.base + mem.bytes);
            st.arena_at
                .insert(shrunk.base..shrunk.base + shrunk.bytes, key);
            let gone = mem.bytes - shrunk.bytes;
            if st.history.recording {
                st.history
                    .record(Action::SegmentFree, shrunk.base + shrunk.bytes, gone, 0, 0);
            }
            if let Some(a) = st.arenas.get_mut(key) {
                a.mem = shrunk;
                a.chunks = a
                    .chunks
                    .saturating_sub(u16::try_from(chunks).unwrap_or(u16::MAX));
            }
            st.stats.reserved_bytes -= gone;
            st.stats.backend_destroys += chunks as u64;
            dp.metrics.destroys.increment(chunks as u64);
            released += gone;
        }
        released
    }
}

impl Pool {
    /// At `empty_cache`, after [`Pool::shrink_free_tails`] (device synchronized, every stream
    /// settled, under the device lock): give
    /// back each grown arena's chunks that free any-stream ranges cover whole, between live
    /// blocks too, without moving a byte: the arena becomes the runs of its other chunks
    /// (`Backend::drop_chunks`), arenas of their own in its reservation, so reserved follows
    /// what live blocks touch chunk by chunk without a trim's idle point. Not an arena that is
    /// exported, asleep, pinned, or seen by an observer (as `shrink_free_tails`). Returns the
    /// bytes released.
    pub(crate) fn drop_free_chunks(&self, dp: &DevicePool, st: &mut DeviceState) -> u64 {
        let mut released = 0;
        for (key, mem, t) in grown_arenas_to_cut(st) {
            let spans = self.backend.chunk_spans(&mem);
            let doomed = free_chunks(&st.ranges[t].ranges(mem.base), mem.base, &spans);
            if doomed.is_empty() || doomed.len() >= spans.len() {
                continue;
            }
            // The runs' allocations are found in the device's map: the thread caches' live
            // records go there first (only when an arena is cut: a free of a promoted block
            // takes the device lock once).
            st.promote_all();
            let replaced = self
                .observers
                .replace_unobserved((dp.device, mem.base), || {
                    let parts = self.backend.drop_chunks(&mem, &doomed)?;
                    let kept: u64 = parts.iter().map(|(p, _)| p.bytes).sum();
                    let kept_chunks: usize = parts.iter().map(|(_, n)| n).sum();
                    let dropped = spans.len().saturating_sub(kept_chunks) as u64;
                    let made = Made::ChunksKept { dropped };
                    let out = st.replace_by_windows(key, parts, &dp.metrics, made)?;
                    released += mem.bytes - kept;
                    Ok(out)
                });
            if let Some(Err(e)) = replaced {
                if !matches!(e, Error::Unavailable(_)) {
                    tracing::error!(device = dp.device, base = mem.base, error = %e,
                        "dropping a grown arena's free chunks failed; it stays whole");
                }
            }
        }
        released
    }
}

/// The grown arenas whose chunks `empty_cache` may give back (not exported: the export
/// covers every chunk; not referenced by a share being made, which holds the arena's key;
/// not asleep or pinned): key, memory and size class of each.
fn grown_arenas_to_cut(st: &DeviceState) -> Vec<(usize, ArenaMem, usize)> {
    st.arenas
        .iter()
        .filter(|(_, a)| {
            a.chunks > 1
                && a.sleep.is_none()
                && !a.lifetime.export_begun()
                && a.lifetime.refs() == 0
                && !a.lifetime.pinned()
        })
        .map(|(k, a)| (k, a.mem.clone(), a.class().index()))
        .collect()
}

/// The chunks of an arena at `base` (indices into `spans`, its chunks' `(offset, bytes)`)
/// that free any-stream ranges cover whole (`ranges`: its region's, in address order).
fn free_chunks(ranges: &[range::RangeInfo], base: u64, spans: &[(u64, u64)]) -> Vec<usize> {
    let mut out = Vec::new();
    let mut r = 0;
    for (i, &(offset, bytes)) in spans.iter().enumerate() {
        let (start, end) = (base + offset, base + offset + bytes);
        while r < ranges.len() && ranges[r].offset + ranges[r].len <= start {
            r += 1;
        }
        let free = ranges[r..]
            .iter()
            .take_while(|x| x.offset < end)
            .all(|x| x.free_tag == Some(ANY_STREAM));
        if free {
            out.push(i);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn a_chunk_is_free_when_free_any_stream_ranges_cover_it_whole() {
        let r = |offset, len, free_tag| range::RangeInfo {
            offset,
            len,
            free_tag,
        };
        let base = 1 << 40;
        let spans = [
            (0, 4 * MIB),
            (4 * MIB, 4 * MIB),
            (8 * MIB, 8 * MIB),
            (16 * MIB, 4 * MIB),
        ];
        let ranges = [
            r(base, MIB, None),
            r(base + MIB, 7 * MIB, Some(ANY_STREAM)),
            r(base + 8 * MIB, 2 * MIB, Some(ANY_STREAM)),
            r(base + 10 * MIB, 6 * MIB, Some(ANY_STREAM)),
            r(base + 16 * MIB, 2 * MIB, Some(7)),
            r(base + 18 * MIB, 2 * MIB, Some(ANY_STREAM)),
        ];
        // Chunk 0 holds a live block, chunk 3 a range still tied to stream 7.
        assert_eq!(free_chunks(&ranges, base, &spans), vec![1, 2]);
        assert_eq!(
            free_chunks(&ranges[..1], base, &spans[..1]),
            Vec::<usize>::new()
        );
    }
}
