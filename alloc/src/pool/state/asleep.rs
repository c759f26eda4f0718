//! What a sleeping arena keeps ([`Asleep`]): its offloaded contents ([`Offload`]), pieces of
//! its live segments in host buffers. Sleep and wake, and the host buffers' life, are
//! `pool/sleep_wake/`'s.

use crate::backend::{Backend, HostBuffer};

/// An arena's sleep: the contents kept on the host (offloaded tags; `pool/sleep_wake/offload.rs`).
#[derive(Debug, Default)]
pub(crate) struct Asleep {
    pub(crate) offload: Option<Offload>,
}

impl Asleep {
    /// Give the host buffers back (pool teardown of a sleeping arena).
    pub(crate) fn free(self, backend: &dyn Backend) {
        for buf in self.offload.into_iter().flat_map(Offload::into_buffers) {
            backend.free_host(buf);
        }
    }

    /// Bytes of its host buffers, if it has any.
    pub(crate) fn offload_bytes(&self) -> Option<u64> {
        self.offload.as_ref().map(Offload::host_bytes)
    }
}

/// An arena's offloaded contents: its pieces, and the live bytes among them (what the
/// reports count).
#[derive(Debug)]
pub(crate) struct Offload {
    pub(crate) parts: Vec<OffloadPart>,
    pub(crate) live: u64,
}

/// One piece of an arena's offload: segments `(address, bytes)`, packed one after another
/// in `buf`.
#[derive(Debug)]
pub(crate) struct OffloadPart {
    pub(crate) buf: HostBuffer,
    pub(crate) segments: Vec<(u64, u64)>,
}

impl Offload {
    /// Bytes of its host buffers.
    pub(crate) fn host_bytes(&self) -> u64 {
        self.parts.iter().map(|p| p.buf.len() as u64).sum()
    }

    /// Its host buffers, given up.
    pub(crate) fn into_buffers(self) -> impl Iterator<Item = HostBuffer> {
        self.parts.into_iter().map(|p| p.buf)
    }
}
