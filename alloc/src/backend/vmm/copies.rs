//! Memory the VMM core reaches on the host's behalf: the test/bench copies into live arenas
//! and mappings (range-checked against the registry), the transfer streams and their
//! asynchronous device-to-device copies.

use super::{registry, to_usize, Driver, DriverResult, VmmBackend};
use crate::error::{Error, Result};
use crate::ids::{DeviceId, StreamId};

impl<D: Driver> VmmBackend<D> {
    /// Copy `src` to device address `dst` (blocking). For tests and benches.
    ///
    /// `dst..dst + src.len()` must lie inside one live arena or import mapping of this
    /// backend; the copy runs on the default stream with that device made current.
    ///
    /// # Errors
    /// [`Error::UnknownPointer`] outside a live range, [`Error::Backend`] if the copy fails.
    pub fn memcpy_htod(&self, dst: u64, src: &[u8]) -> Result<()> {
        // SAFETY: in_live_range calls this only for a range inside a live arena or mapping,
        // kept mapped while it runs; device memory is never host memory that Rust owns.
        self.in_live_range(dst, src.len() as u64, |d| unsafe {
            d.memcpy_htod(dst, src)
        })
    }

    /// Copy from device address `src` into `dst` (blocking). For tests and benches.
    ///
    /// `src..src + dst.len()` must lie inside one live arena or import mapping.
    ///
    /// # Errors
    /// [`Error::UnknownPointer`] outside a live range, [`Error::Backend`] if the copy fails.
    pub fn memcpy_dtoh(&self, dst: &mut [u8], src: u64) -> Result<()> {
        let len = dst.len() as u64;
        // SAFETY: as in memcpy_htod: a live range, kept mapped while the copy runs.
        self.in_live_range(src, len, |d| unsafe { d.memcpy_dtoh(dst, src) })
    }

    /// Set `bytes` bytes at device address `dst` to `value` (on the default stream: ordered
    /// before later copies and default-stream work). For tests and benches.
    ///
    /// # Errors
    /// [`Error::UnknownPointer`] outside a live range, [`Error::Backend`] if the call fails.
    pub fn memset_d8(&self, dst: u64, value: u8, bytes: u64) -> Result<()> {
        let n = to_usize(bytes)?;
        // SAFETY: as in memcpy_htod: a live range, kept mapped while the call runs.
        self.in_live_range(dst, bytes, |d| unsafe { d.memset_d8(dst, value, n) })
    }

    /// Run `call` on `addr..addr + len` (nothing for an empty range) after checking that the
    /// range lies inside one live arena or mapping, with its device made current and the
    /// registry's read lock held (so the range stays mapped) until `call` returns.
    fn in_live_range(
        &self,
        addr: u64,
        len: u64,
        call: impl FnOnce(&D) -> DriverResult<()>,
    ) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let regions = self.regions.read();
        let device = registry::range_device(&regions, D::NAME, addr, len)?;
        let (_state, _current) = self.make_current(device)?;
        call(&self.driver).map_err(|e| e.into_error(device, 0))
    }

    /// A new non-blocking stream of `device`, recorded as live.
    pub(super) fn new_stream(&self, device: DeviceId) -> Result<StreamId> {
        let (_state, _current) = self.make_current(device)?;
        let raw = self
            .driver
            .stream_create()
            .map_err(|e| e.into_error(device, 0))?;
        self.streams.lock().insert(raw, device);
        Ok(StreamId(raw))
    }

    /// Destroy a live stream of ours on `device`.
    pub(super) fn end_stream(&self, device: DeviceId, stream: StreamId) -> Result<()> {
        if self.streams.lock().remove(&stream.0) != Some(device) {
            return Err(Error::invalid(format!(
                "stream {:#x} is not a live transfer stream of device {device} of the {} backend (destroyed twice?)",
                stream.0,
                D::NAME
            )));
        }
        let (_state, _current) = self.make_current(device)?;
        // SAFETY: a live stream of ours, just taken out of the registry: destroyed once.
        unsafe { self.driver.stream_destroy(stream.0) }.map_err(|e| e.into_error(device, 0))
    }

    /// Queue `src..+bytes` to `dst..+bytes` on a live stream of `device`, both ranges
    /// checked against the registry.
    pub(super) fn queue_copy(
        &self,
        device: DeviceId,
        stream: StreamId,
        dst: u64,
        src: u64,
        bytes: u64,
    ) -> Result<()> {
        let Some(n) = crate::backend::check_copy(dst, src, bytes)? else {
            return Ok(());
        };
        if self.streams.lock().get(&stream.0) != Some(&device) {
            return Err(Error::invalid(format!(
                "stream {:#x} is not a live transfer stream of device {device}",
                stream.0
            )));
        }
        let regions = self.regions.read();
        registry::range_device(&regions, D::NAME, src, bytes)?;
        registry::range_device(&regions, D::NAME, dst, bytes)?;
        let (_state, _current) = self.make_current(device)?;
        // SAFETY: both ranges lie inside live arenas or mappings (checked above under the
        // read lock) and do not overlap; the caller keeps them mapped until the copy's event
        // completes (Backend::copy_async); the stream is live on this device (checked).
        unsafe { self.driver.memcpy_dtod_async(dst, src, n, stream.0) }
            .map_err(|e| e.into_error(device, bytes))
    }
}
