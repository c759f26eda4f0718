//! The host side of sleep: offloaded contents and the host buffers that hold them.
//!
//! Pinning host memory costs far more than copying into it (on the H200, 44 GiB: 19.3 s of
//! sleep against 0.85 s for the copy into buffers already pinned), so buffers are kept: a
//! wake copies the contents back and *keeps* the buffer on its device, and the next sleep
//! takes the smallest kept buffer large enough for a piece of an arena's segments (an arena
//! offloads about the same bytes each cycle). When none is large enough, the largest kept
//! buffer smaller than the need is freed (it was most likely the same piece's, now too
//! small) and a new one allocated, so a device keeps at most one buffer per piece offloaded
//! at once.
//! Kept buffers are freed by [`Pool::release_host_buffers`] (`gpu_arena_sleep_release_host`)
//! and when the pool goes; `empty_cache` leaves them (it is about device memory, and
//! training loops call it often). `PoolStats::offload_host_bytes` counts every buffer a
//! device holds, in use by a sleeping arena or kept.
//!
//! An arena's segments go to host buffers of at most [`OFFLOAD_PIECE`] bytes each
//! ([`pieces`]), so that a sleep pins one piece while it copies the one before (`pool/sleep_wake/pin_ahead.rs`): a grown
//! arena of 69 GiB in one buffer pinned it all before the first byte moved (4.68 s against a
//! raw copy of 1.34 s on the H200, where 1 GiB arenas took 3.26 s).

use crate::backend::{DeviceId, HostBuffer};
use crate::error::{Error, Result};
use crate::pool::state::asleep::{Offload, OffloadPart};
use crate::pool::state::device::DeviceState;
use crate::pool::state::pool::{DevicePool, Pool};

/// Live allocations closer than this are copied as one segment, gap included.
pub const GAP: u64 = 2 << 20;

/// The most bytes of an arena's segments one host buffer holds.
pub const OFFLOAD_PIECE: u64 = 1 << 30;

/// An arena's segments (by address) cut into pieces of at most [`OFFLOAD_PIECE`] bytes, in
/// order: a segment that does not fit in the rest of a piece is split at the piece's end.
pub(crate) fn pieces(segments: &[(u64, u64)]) -> Vec<Vec<(u64, u64)>> {
    let mut out: Vec<Vec<(u64, u64)>> = Vec::new();
    let mut room = 0;
    for &(mut p, mut len) in segments {
        while len > 0 {
            if room == 0 {
                out.push(Vec::new());
                room = OFFLOAD_PIECE;
            }
            let n = len.min(room);
            if let Some(piece) = out.last_mut() {
                piece.push((p, n));
            }
            (p, len, room) = (p + n, len - n, room - n);
        }
    }
    out
}

/// The bytes of one piece's segments.
pub(crate) fn piece_bytes(piece: &[(u64, u64)]) -> u64 {
    piece.iter().map(|s| s.1).sum()
}

impl DeviceState {
    /// The smallest kept buffer of at least `bytes`, taken out of the kept ones.
    fn take_host_buffer(&mut self, bytes: u64) -> Option<HostBuffer> {
        let i = self
            .host_buffers
            .iter()
            .enumerate()
            .filter(|(_, b)| b.len() as u64 >= bytes)
            .min_by_key(|(_, b)| b.len())
            .map(|(i, _)| i)?;
        Some(self.host_buffers.swap_remove(i))
    }

    /// The largest kept buffer smaller than `bytes` (replaced by a larger one), taken out.
    fn take_replaced_host_buffer(&mut self, bytes: u64) -> Option<HostBuffer> {
        let i = self
            .host_buffers
            .iter()
            .enumerate()
            .filter(|(_, b)| (b.len() as u64) < bytes)
            .max_by_key(|(_, b)| b.len())
            .map(|(i, _)| i)?;
        Some(self.host_buffers.swap_remove(i))
    }

    /// The offload segments of the arenas `keys` names (slab keys; `None`: not offloaded),
    /// in that order: their live allocations by address (the records promoted first),
    /// merged across gaps of at most [`GAP`] (copying a small gap costs less than another
    /// call), and their live bytes.
    pub(crate) fn offload_segments(&self, keys: &[Option<usize>]) -> Vec<(Vec<(u64, u64)>, u64)> {
        let index: std::collections::HashMap<usize, usize> = keys
            .iter()
            .enumerate()
            .filter_map(|(i, k)| k.map(|k| (k, i)))
            .collect();
        let mut lives: Vec<(usize, u64, u64)> = self
            .allocs
            .iter()
            .filter_map(|(&p, l)| index.get(&l.arena).map(|&i| (i, p, l.bytes())))
            .collect();
        lives.sort_unstable();
        let mut out: Vec<(Vec<(u64, u64)>, u64)> = vec![(Vec::new(), 0); keys.len()];
        for (i, p, len) in lives {
            let (segments, live) = &mut out[i];
            *live += len;
            match segments.last_mut() {
                Some((start, sl)) if p.saturating_sub(*start + *sl) <= GAP => {
                    *sl = (p + len).max(*start + *sl) - *start;
                }
                _ => segments.push((p, len)),
            }
        }
        out
    }

    /// Keep a buffer for the next sleep (still counted in `offload_host_bytes`).
    pub(crate) fn keep_host_buffer(&mut self, buf: HostBuffer) {
        self.host_buffers.push(buf);
    }

    /// `offload_host_bytes` is what the host buffers hold: those of sleeping arenas and the
    /// kept ones. While a sleep, wake or `prepare_offload` moves buffers (made and not yet
    /// placed, out of an arena being copied back, ...) they are counted but held by
    /// neither: then at most.
    pub(crate) fn check_host_bytes(&self) -> Result<(), String> {
        let held = self.host_bytes_held();
        let counted = self.stats.offload_host_bytes;
        if held > counted || (held != counted && self.host_buffers_moving == 0) {
            return Err(format!(
                "host buffers hold {held} bytes, offload_host_bytes says {counted}"
            ));
        }
        Ok(())
    }

    /// Bytes of every host buffer the device holds: those of sleeping arenas and the kept
    /// ones.
    pub(crate) fn host_bytes_held(&self) -> u64 {
        let asleep: u64 = self
            .arenas
            .iter()
            .filter_map(|(_, a)| a.sleep.as_ref()?.offload_bytes())
            .sum();
        asleep
            + self
                .host_buffers
                .iter()
                .map(|b| b.len() as u64)
                .sum::<u64>()
    }
}

impl Pool {
    /// A host buffer of at least `total` bytes for `dp`'s offload: a kept one when one is
    /// large enough, else a new one (pinned where the backend has it; pageable memory when
    /// pinning fails, with a warning).
    pub(crate) fn host_buffer_for(&self, dp: &DevicePool, total: u64) -> Result<HostBuffer> {
        let device = dp.device;
        if let Some(buf) = dp.state.lock().take_host_buffer(total) {
            return Ok(buf);
        }
        let replaced = dp.state.lock().take_replaced_host_buffer(total);
        if let Some(old) = replaced {
            self.free_host_buffer(dp, old);
        }
        let buf = match self.backend.alloc_host(device, total) {
            Ok(buf) => buf,
            Err(e) => {
                tracing::warn!(device, bytes = total, error = %e, "no pinned host memory for the offload: using pageable memory (slower copies)");
                HostBuffer::heap(device, total)?
            }
        };
        dp.state.lock().stats.offload_host_bytes += buf.len() as u64;
        Ok(buf)
    }

    /// Copy one piece of an arena's segments into `buf` (from [`Pool::host_buffer_for`]). On
    /// failure the buffer is kept for the next sleep.
    pub(crate) fn copy_out(
        &self,
        dp: &DevicePool,
        mut buf: HostBuffer,
        segments: Vec<(u64, u64)>,
    ) -> Result<OffloadPart> {
        let mut off = 0usize;
        for &(p, len) in &segments {
            let n = usize::try_from(len).unwrap_or(usize::MAX);
            let dst = &mut buf.as_mut_slice()[off..off + n];
            if let Err(e) = self.backend.copy_to_host(dp.device, p, dst) {
                dp.state.lock().keep_host_buffer(buf);
                return Err(e);
            }
            off += n;
        }
        Ok(OffloadPart { buf, segments })
    }

    /// Copy offloaded contents back to the device (woken at the same addresses), stopping
    /// at the first copy that fails. Returns the live bytes. The buffers stay with `o`.
    pub(crate) fn copy_back(&self, dp: &DevicePool, o: &Offload) -> Result<u64> {
        for part in &o.parts {
            let mut off = 0usize;
            for &(p, len) in &part.segments {
                let n = usize::try_from(len).unwrap_or(usize::MAX);
                let src = &part.buf.as_slice()[off..off + n];
                self.backend
                    .copy_from_host(dp.device, p, src)
                    .inspect_err(|e| tracing::error!(device = dp.device, ptr = p, error = %e, "copying offloaded memory back failed"))?;
                off += n;
            }
        }
        Ok(o.live)
    }

    /// Keep the buffers of an offload copied back for the next sleep.
    pub(crate) fn keep_offload_buffers(&self, dp: &DevicePool, o: Offload) {
        let mut st = dp.state.lock();
        for buf in o.into_buffers() {
            st.keep_host_buffer(buf);
        }
    }

    /// Free one host buffer of `dp` (no longer kept nor in use).
    fn free_host_buffer(&self, dp: &DevicePool, buf: HostBuffer) {
        let bytes = buf.len() as u64;
        self.backend.free_host(buf);
        let mut st = dp.state.lock();
        st.stats.offload_host_bytes -= bytes;
        dp.metrics.publish(&st.stats_now());
    }

    /// Pin ahead: make the host buffers that a sleep offloading the tags in `offload` (tag
    /// indices) of `device` (every device for `None`) would need now, and keep them, so the
    /// first such sleep copies into memory already pinned (pinning fresh host memory is the
    /// slow part of a first sleep: `backend/vmm/pinned.rs`). Sized from the live
    /// allocations now, as the sleep would (a sleep whose allocations grew since makes what
    /// it lacks then); arenas already asleep are skipped. Returns the bytes of host memory
    /// made. Blocking: run it on a thread of its own to overlap it with other work.
    pub fn prepare_offload(&self, device: Option<DeviceId>, offload: &[u8]) -> Result<u64> {
        let mask = offload.iter().fold(0u64, |m, &t| {
            m | 1u64.checked_shl(u32::from(t)).unwrap_or(0)
        });
        if mask == 0 {
            return Err(Error::invalid("prepare_offload: no tag named"));
        }
        let devices: Vec<&DevicePool> = match device {
            Some(d) => vec![self.dev(d)?],
            None => self.devices.iter().collect(),
        };
        let mut made = 0;
        let _moving = HostBuffersMoving::new(devices.iter().copied());
        for dp in devices {
            let totals: Vec<u64> = {
                let mut st = dp.state.lock();
                st.promote_all();
                let keys: Vec<Option<usize>> = st
                    .arenas
                    .iter()
                    .filter(|(_, a)| a.sleep.is_none() && mask & (1 << a.tag) != 0)
                    .map(|(k, _)| Some(k))
                    .collect();
                st.offload_segments(&keys)
                    .iter()
                    .flat_map(|(segments, _)| pieces(segments))
                    .map(|piece| piece_bytes(&piece))
                    .collect()
            };
            let before = dp.state.lock().stats.offload_host_bytes;
            let mut bufs = Vec::new();
            let mut first_err = None;
            self.with_host_buffers(dp, &totals, |_, b| match b {
                Some(Ok(buf)) => bufs.push(buf),
                Some(Err(e)) => {
                    first_err.get_or_insert(e);
                }
                None => {}
            });
            let mut st = dp.state.lock();
            for buf in bufs {
                st.keep_host_buffer(buf);
            }
            made += st.stats.offload_host_bytes.saturating_sub(before);
            dp.metrics.publish(&st.stats_now());
            drop(st);
            if let Some(e) = first_err {
                return Err(e);
            }
        }
        Ok(made)
    }

    /// Free the host buffers kept for the next sleep on `device` (every device for `None`);
    /// those holding a sleeping arena's contents stay. Returns the bytes freed.
    pub fn release_host_buffers(&self, device: Option<DeviceId>) -> Result<u64> {
        let devices: Vec<&DevicePool> = match device {
            Some(d) => vec![self.dev(d)?],
            None => self.devices.iter().collect(),
        };
        let mut freed = 0;
        let _moving = HostBuffersMoving::new(devices.iter().copied());
        for dp in devices {
            let kept = std::mem::take(&mut dp.state.lock().host_buffers);
            for buf in kept {
                freed += buf.len() as u64;
                self.free_host_buffer(dp, buf);
            }
        }
        Ok(freed)
    }

    /// Free every kept buffer at teardown (the sleeping arenas' go with them).
    pub(crate) fn free_kept_host_buffers(&mut self) {
        for dp in &mut self.devices {
            for buf in std::mem::take(&mut dp.state.get_mut().host_buffers) {
                self.backend.free_host(buf);
            }
        }
    }
}

/// Marks `devices` as moving host buffers (a sleep, wake or `prepare_offload`) until
/// dropped: `DeviceState::check_host_bytes` then checks at most, not equal.
pub(crate) struct HostBuffersMoving<'a>(Vec<&'a DevicePool>);

impl<'a> HostBuffersMoving<'a> {
    pub(crate) fn new(devices: impl IntoIterator<Item = &'a DevicePool>) -> Self {
        let devices: Vec<&DevicePool> = devices.into_iter().collect();
        for dp in &devices {
            dp.state.lock().host_buffers_moving += 1;
        }
        HostBuffersMoving(devices)
    }
}

impl Drop for HostBuffersMoving<'_> {
    fn drop(&mut self) {
        for dp in &self.0 {
            dp.state.lock().host_buffers_moving -= 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn segments_are_cut_into_pieces_at_the_piece_size() {
        const P: u64 = OFFLOAD_PIECE;
        assert!(pieces(&[]).is_empty());
        assert_eq!(pieces(&[(0, 4 * MIB)]), vec![vec![(0, 4 * MIB)]]);
        // Two segments filling a piece exactly, then a third in a piece of its own.
        let half = P / 2;
        assert_eq!(
            pieces(&[(0, half), (P, half), (4 * P, MIB)]),
            vec![vec![(0, half), (P, half)], vec![(4 * P, MIB)]]
        );
        // A segment of 2.5 pieces after 1 MiB: split at each piece's end.
        let got = pieces(&[(0, MIB), (8 * P, 5 * half)]);
        assert_eq!(
            got,
            vec![
                vec![(0, MIB), (8 * P, P - MIB)],
                vec![(9 * P - MIB, P)],
                vec![(10 * P - MIB, half + MIB)],
            ]
        );
        assert!(got.iter().all(|p| piece_bytes(p) <= P));
        assert_eq!(
            got.iter().map(|p| piece_bytes(p)).sum::<u64>(),
            MIB + 5 * half
        );
    }
}
