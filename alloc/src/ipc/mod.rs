//! Sharing across processes: the producer's [`Broker`], the consumer's [`Importer`], and the
//! [`ShareHandle`] that travels between them.
//!
//! ```text
//! producer                                  consumer
//! Pool::share (export once per arena)
//! Broker::share -> ShareHandle --bytes-->   ShareHandle::from_bytes
//!                                           Importer::import: connect (SO_PEERCRED both ways),
//!        broker thread <--- open(token) --- present the token,
//!        lease + export fd ---SCM_RIGHTS--> map the arena once, return base + offset
//!        close lease  <---- close --------- Importer::close: last import unmaps
//!        (connection closed = every lease of that peer closed: crash, SIGKILL)
//!        mailbox memfd ------SCM_RIGHTS--> (asked for with the first request needing no fd)
//!        broker thread <== open / close / batch in shared memory (no fd in the reply) ==
//!                      == reply in shared memory ==>   (doorbell packets wake a sleeper)
//! ```
//!
//! Requests whose reply carries no fd (imports of arenas the consumer maps already, closes,
//! batches) travel through the connection's shared-memory mailbox (`ipc/mailbox.rs`); the socket
//! keeps the fds, the peer credentials, death detection and the doorbells that wake a side
//! asleep. `GPU_ARENA_IPC_MAILBOX=0` keeps everything on the socket.

pub mod broker;
mod connection;
pub mod handle;
pub mod importer;
pub(crate) mod mailbox;
pub(crate) mod wire;

pub use broker::{Broker, BrokerConfig, BrokerStats};
pub use handle::{ShareHandle, HANDLE_BYTES};
pub use importer::{Importer, ImporterStats};
pub use mailbox::layout as mailbox_layout;
pub use mailbox::mailbox_enabled;
