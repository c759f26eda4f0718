//! The sim's transfer streams and copies: a stream is a number, a copy happens at once (its
//! event, recorded afterwards, is complete unless the stream was blocked).

use super::SimBackend;
use crate::backend::{DeviceId, StreamId};
use crate::error::{Error, Result};

impl SimBackend {
    /// A new transfer stream of `device`.
    pub(super) fn new_stream(&self, device: DeviceId) -> Result<StreamId> {
        self.check_device(device)?;
        let mut inner = self.inner.lock();
        let id = inner.take_id();
        inner.streams.insert(id, device);
        Ok(StreamId(id))
    }

    /// Forget a transfer stream of `device`.
    pub(super) fn end_stream(&self, device: DeviceId, stream: StreamId) -> Result<()> {
        if self.inner.lock().streams.remove(&stream.0) == Some(device) {
            return Ok(());
        }
        Err(Error::invalid(format!(
            "stream {:#x} is not a live sim transfer stream of device {device} (destroyed twice?)",
            stream.0
        )))
    }

    /// Copy `bytes` bytes from `src` to `dst` now, both ranges inside live arenas or imports.
    pub(super) fn copy_now(
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
        let inner = self.inner.lock();
        if inner.streams.get(&stream.0) != Some(&device) {
            return Err(Error::invalid(format!(
                "stream {:#x} is not a live sim transfer stream of device {device}",
                stream.0
            )));
        }
        inner.check_mapped_range(src, bytes)?;
        inner.check_mapped_range(dst, bytes)?;
        // SAFETY: both ranges lie inside live MAP_SHARED read-write mappings of this backend
        // (checked under the lock, which keeps them mapped: unmap and destroy take it), and
        // they do not overlap; no Rust reference points into sim memory.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, n) };
        Ok(())
    }
}
