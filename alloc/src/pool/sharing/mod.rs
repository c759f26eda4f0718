//! Sharing memory with other processes and transports: shares and leases (`share.rs`), arena
//! observers as the pool serves them (`observers.rs`), and the hooks a holder of shares is
//! told around sleep, wake and release (`hooks.rs`).

pub(super) mod hooks;
pub(super) mod observers;
pub(super) mod share;
