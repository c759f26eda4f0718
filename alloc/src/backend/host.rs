//! Host memory for copies to and from a device: [`HostBuffer`].
//!
//! Sleep offloads device memory into these buffers. A backend with pinned (page-locked) host
//! memory hands out pinned buffers ([`crate::backend::Backend::alloc_host`]), which the
//! driver copies at full link speed (DMA, no staging through a bounce buffer); the others
//! hand out plain heap buffers. Give a buffer back with
//! [`crate::backend::Backend::free_host`] of the backend that made it: a pinned buffer
//! dropped any other way is leaked (with a warning), since only its driver can free it.

use std::alloc::Layout;
use std::fmt;
use std::ptr::NonNull;

use crate::error::{Error, Result};
use crate::ids::DeviceId;

/// A buffer of host memory, owned: heap memory, or pinned memory of a backend.
pub struct HostBuffer {
    device: DeviceId,
    ptr: NonNull<u8>,
    len: usize,
    pinned: bool,
}

// SAFETY: the buffer owns its memory exclusively (no aliasing pointer is kept anywhere);
// reads and writes go through `&self`/`&mut self` borrows.
unsafe impl Send for HostBuffer {}
// SAFETY: as for Send: shared access is read-only through `&self`.
unsafe impl Sync for HostBuffer {}

impl fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostBuffer")
            .field("device", &self.device)
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .field("pinned", &self.pinned)
            .finish()
    }
}

impl HostBuffer {
    /// `bytes` zeroed bytes of heap memory (pages are zeroed lazily by the OS), for copies
    /// with `device`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `bytes` does not fit in memory's address space,
    /// [`Error::Unavailable`] when the allocation fails.
    pub fn heap(device: DeviceId, bytes: u64) -> Result<HostBuffer> {
        let len = usize::try_from(bytes)
            .map_err(|_| Error::invalid(format!("{bytes} bytes do not fit in usize")))?;
        let ptr = if len == 0 {
            NonNull::dangling()
        } else {
            let layout = Layout::array::<u8>(len)
                .map_err(|_| Error::invalid(format!("a host buffer of {len} bytes")))?;
            // SAFETY: `layout` has a non-zero size.
            NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) }).ok_or_else(|| {
                Error::Unavailable(format!("allocating {len} bytes of host memory failed"))
            })?
        };
        Ok(HostBuffer {
            device,
            ptr,
            len,
            pinned: false,
        })
    }

    /// Wrap pinned memory a backend's driver allocated.
    ///
    /// # Safety
    /// `ptr..ptr + len` is host memory readable and writable by this process, initialised
    /// (e.g. fresh zero pages), owned by nothing else, and stays valid until the backend
    /// frees it after [`HostBuffer::into_pinned`].
    pub(crate) unsafe fn from_pinned(device: DeviceId, ptr: u64, len: usize) -> HostBuffer {
        HostBuffer {
            device,
            ptr: NonNull::new(ptr as *mut u8).unwrap_or(NonNull::dangling()),
            len,
            pinned: true,
        }
    }

    /// The device the buffer was allocated for.
    pub fn device(&self) -> DeviceId {
        self.device
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the memory is pinned (page-locked by a driver).
    pub fn is_pinned(&self) -> bool {
        self.pinned
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the buffer owns `len` initialised bytes at `ptr` (see the constructors).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in as_slice, borrowed mutably through `&mut self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// For the backend freeing it: the pinned memory's address (the buffer gives it up), or
    /// `None` for heap memory (freed here).
    pub(crate) fn into_pinned(self) -> Option<u64> {
        let me = std::mem::ManuallyDrop::new(self);
        if me.pinned {
            Some(me.ptr.as_ptr() as u64)
        } else {
            me.free_heap();
            None
        }
    }

    fn free_heap(&self) {
        if self.len != 0 {
            if let Ok(layout) = Layout::array::<u8>(self.len) {
                // SAFETY: allocated in `heap` with this layout, freed once (the buffer is
                // being dropped or was taken out of a ManuallyDrop).
                unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) }
            }
        }
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        if self.pinned {
            tracing::warn!(
                device = self.device,
                bytes = self.len,
                "a pinned host buffer was dropped without Backend::free_host: leaked"
            );
        } else {
            self.free_heap();
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn heap_buffers_read_write_and_free() {
        let mut b = HostBuffer::heap(0, 4096).unwrap();
        assert!(!b.is_pinned());
        assert!(b.as_slice().iter().all(|&x| x == 0));
        b.as_mut_slice()[4095] = 7;
        assert_eq!(b.as_slice()[4095], 7);
        assert_eq!(b.into_pinned(), None);
        let e = HostBuffer::heap(0, 0).unwrap();
        assert!(e.is_empty());
        drop(e);
    }
}
