//! The two identifiers every layer passes around: a device index and a stream handle.
//!
//! They live here, below both [`crate::backend`] and [`crate::error`], so that neither of
//! those imports the other for them; both re-export them (`gpu_arena::{DeviceId, StreamId}`,
//! `gpu_arena::backend::{DeviceId, StreamId}`).

/// A device index as the C API and PyTorch pass it (`int device`).
pub type DeviceId = i32;

/// A raw stream handle (`cudaStream_t` / `hipStream_t` as an integer). `StreamId(0)` is the
/// legacy default stream.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamId(pub u64);

impl StreamId {
    /// The legacy default stream.
    pub const DEFAULT: StreamId = StreamId(0);
}
