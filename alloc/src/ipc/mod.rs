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
//! ```

pub mod broker;
mod connection;
pub mod handle;
pub mod importer;
mod mailbox;
pub(crate) mod wire;

pub use broker::{Broker, BrokerConfig, BrokerStats};
pub use handle::{ShareHandle, HANDLE_BYTES};
pub use importer::{Importer, ImporterStats};
pub use mailbox::mailbox_enabled;
