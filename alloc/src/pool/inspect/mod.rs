//! Looking at the pool: the JSON snapshot and PyTorch-shaped views of segments and blocks
//! (`snapshot.rs`), and the history of events (`trace.rs`).

pub(super) mod snapshot;
pub(super) mod trace;
