//! Sleep and wake: a device's memory given back to the driver while every address stays
//! reserved, and mapped again at the same addresses (`sleep.rs`, whose module docs hold the
//! rules; `wake.rs`); the host side of an offload (`offload.rs`) and its buffers made ahead
//! of the copies (`pin_ahead.rs`).

pub(super) mod offload;
pub(super) mod pin_ahead;
pub(super) mod sleep;
pub(super) mod wake;
