//! Grown arenas give memory back at `empty_cache` (device synchronized, every stream
//! settled, under the device lock): the chunks their free tail covers whole, then the chunks
//! that free any-stream ranges cover whole between live blocks (the arena becomes the runs of
//! its other chunks, `trim.rs`'s windows). Not an arena that is exported, asleep, pinned, or
//! seen by an observer.

use super::trim::Made;
use crate::backend::ArenaMem;
use crate::error::Error;
use crate::history::Action;
use crate::pool::paths::streams::ANY_STREAM;
use crate::pool::state::device::DeviceState;
use crate::pool::state::pool::{DevicePool, Pool};
use crate::range;

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
