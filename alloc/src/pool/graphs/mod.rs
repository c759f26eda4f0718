//! Graph pools: PyTorch's private memory pools (`graph_pools.rs`, whose module docs hold the
//! rules), their checkpoints (`checkpoints.rs`), and the hold a call that synchronizes the
//! device takes so that no capture begins meanwhile (`sync_hold.rs`).

pub(super) mod checkpoints;
pub(super) mod graph_pools;
pub(super) mod sync_hold;
