//! The share and lease tables of one device, and what the producer hands out for a share
//! ([`ShareInfo`]) or a lease ([`LeaseGrant`]). The decisions about them are
//! [`crate::lifetime`]'s; `pool/sharing/share.rs` performs them.

use std::os::fd::OwnedFd;
use std::sync::OnceLock;

use slab::Slab;

use crate::backend::{DeviceId, ExportKind};
use crate::lifetime::ShareHold;

/// What the producer hands out for one share: enough to build a share handle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShareInfo {
    /// Device of the memory.
    pub device: DeviceId,
    /// Key of the share in the producer's table.
    pub share_key: u32,
    /// Arena id (unique in the producer's pool).
    pub arena_id: u64,
    /// Export generation of the arena: a handle made under an earlier export of the arena
    /// is refused as stale.
    pub generation: u32,
    /// Arena size in bytes (the importer maps the whole arena).
    pub arena_bytes: u64,
    /// Offset of the shared range inside the arena, in bytes.
    pub offset: u64,
    /// Length of the shared range in bytes.
    pub len: u64,
    /// Random 128-bit secret the importer must present.
    pub token: [u8; 16],
}

/// What the broker sends a consumer who opened a lease.
#[derive(Debug)]
pub struct LeaseGrant {
    /// Key of the lease in the producer's table (the consumer closes it by this key).
    pub lease_key: u32,
    /// Duplicates of the export's fds with their lengths (one, or one per chunk of a grown
    /// arena, in address order), to send with SCM_RIGHTS and then drop; empty when the lease
    /// was opened without them (`Pool::open_lease_named`'s `with_fd`).
    pub fds: Vec<(u64, OwnedFd)>,
    /// The share the lease is on.
    pub share: ShareInfo,
    /// Whether the export can be ended.
    pub kind: ExportKind,
}

/// A share in the producer's table ("record" in `pool/` means an allocation's record:
/// `Live` in the device's map, `FrontLive` in a thread cache's).
#[derive(Debug)]
pub(crate) struct ShareEntry {
    pub(crate) info: ShareInfo,
    /// Arena key (slab index) of the share's arena.
    pub(crate) arena: usize,
    /// Start of the allocation the share lies in.
    pub(crate) alloc_ptr: u64,
    /// Leases and revocation (changed only by the arena's lifetime).
    pub(crate) hold: ShareHold,
}

/// A consumer's lease on a share.
#[derive(Debug)]
pub(crate) struct LeaseEntry {
    pub(crate) share_key: u32,
}

/// How many ended shares (unshared, then their last lease closed) are remembered, so that
/// an open of one is refused as unshared rather than as an unknown key (its slot may hold
/// another share by then).
pub(crate) const UNSHARED_REMEMBERED: usize = 4096;

/// Share and lease tables of one device.
#[derive(Debug, Default)]
pub(crate) struct ShareTables {
    pub(crate) shares: Slab<ShareEntry>,
    pub(crate) leases: Slab<LeaseEntry>,
    /// Key and token of the latest shares that ended after an unshare, oldest first (at most
    /// [`UNSHARED_REMEMBERED`]): an open presenting one exactly is told it was unshared.
    /// Only a caller who knows the token learns anything: a wrong token gets the same answer
    /// as an unknown key.
    pub(crate) unshared: std::collections::VecDeque<(u32, [u8; 16])>,
    /// Self-test result: does closing an export release memory on this device?
    pub(crate) probed_kind: OnceLock<ExportKind>,
}

impl ShareTables {
    /// Remove the record of share `key`; remember it when it ended by an unshare.
    pub(crate) fn remove_share(&mut self, key: u32) {
        if let Some(rec) = self.shares.try_remove(key as usize) {
            if rec.hold.revoked() {
                if self.unshared.len() == UNSHARED_REMEMBERED {
                    self.unshared.pop_front();
                }
                self.unshared.push_back((key, rec.info.token));
            }
        }
    }

    /// Whether share `key` with this exact `token` was unshared (and has ended since).
    pub(crate) fn was_unshared(&self, key: u32, token: &[u8; 16]) -> bool {
        self.unshared
            .iter()
            .rev()
            .any(|(k, t)| *k == key && t == token)
    }
}
