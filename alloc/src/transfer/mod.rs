//! KV transfer between processes over gpu-arena's own sharing: the engine behind the NIXL
//! backend `GPU_ARENA` (`python/gpu_arena/native/nixl/`), usable from Rust as it is.
//!
//! ```text
//! producer engine                               consumer engine
//! register(addr,len): share (export once/arena)
//! public_data ------------- NIXL metadata ----> load_remote: Loaded -> producer,
//!                                                 import the share (one mapping per arena)
//!                                               prepare/post: copies on the consumer's
//!                                                 streams, one event per stream used
//!            <------------ Notif (on completion) check: Done
//! deregister: unshare, Revoke -> each consumer  (thread) wait for queued copies, close the
//!   wait until their leases end <-------------    import, Unloaded -> producer; later
//!   (closed, consumer dead, or timeout)           transfers on it fail: "revoked"
//! ```
//!
//! Rules:
//! - A registration is a share of a range inside one live gpu-arena allocation; memory
//!   gpu-arena did not allocate is refused. Registrations cost no driver call beyond the
//!   arena's one export.
//! - A transfer's descriptors are checked at `prepare` against their registrations (a range
//!   outside one is refused, with its index) and again at `post` (a revoked or unloaded
//!   remote registration is refused); the backend checks every copy's ranges against its
//!   live arenas and mappings too.
//! - Copies run on the engine's own non-blocking streams (`streams_per_device` per device,
//!   round robin); completion is one event per stream used. A transfer's notification is
//!   sent when `check` first sees it complete.
//! - Revocation: `deregister` stops new imports, tells every consumer that loaded the
//!   registration, and waits (at most `revoke_timeout`) until their leases ended. A consumer
//!   closes the import only after every copy it queued so far completed: it marks the
//!   registration closing under the state lock (no later post passes its check), waits for
//!   the posts that passed it to finish queueing (they queue without the lock, the
//!   registration marked in use), then records an event on each of its streams. A dead consumer's leases end with its connection (the
//!   broker's crash reclaim).
//! - Messages between engines travel on abstract datagram sockets; senders are checked by
//!   their kernel-attested uid.

mod consumer;
mod descs;
mod engine;
mod requests;
mod revoke;
mod socket;
mod state;
mod stats;
pub mod wire;

pub use descs::{plan, Copy, Desc, Op, Span};
pub use engine::{EngineConfig, TransferEngine, XferStatus};
pub use stats::EngineStats;
