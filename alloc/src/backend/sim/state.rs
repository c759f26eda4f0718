//! The sim backend's state behind its one mutex: the owned arenas, imports, events, the
//! fault plan and the ledger's counts (`super::SimBackend` performs the calls).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::os::fd::OwnedFd;

use super::injected;
use super::sys::Region;
use super::types::{SimCall, SimLedger};
use crate::backend::{ArenaMem, DeviceId, StreamId};
use crate::error::{Error, Result};

/// The owner's side of a live arena: its chunks' memfds and its mapping at `base`.
#[derive(Debug)]
pub(super) struct Owner {
    /// One memfd per chunk (`ArenaEntry::chunks`), in address order, each mapped from its
    /// offset 0 over its chunk's addresses: a chunk is a memfd of its own, as it is one
    /// physical allocation on a GPU. Empty while the arena sleeps (`release_physical`): its
    /// region is then an inaccessible reservation and its bytes are not held.
    pub(super) memfds: Vec<OwnedFd>,
    /// The arena's address range: its reservation (`ArenaEntry::reserve` bytes), the
    /// chunks mapped over its first `bytes`.
    pub(super) region: Region,
}

/// One arena in the ledger, from `create_arena` until its bytes are released.
#[derive(Debug)]
pub(super) struct ArenaEntry {
    pub(super) device: DeviceId,
    pub(super) base: u64,
    pub(super) bytes: u64,
    /// `(st_dev, st_ino)` of each chunk's memfd, in address order (empty while asleep): how
    /// imports and `close_export` recognise this backend's own exports. Each is a key of
    /// `Inner::by_inode` naming this arena; they stay after the owner destroyed the arena,
    /// while exports or mappings hold its bytes.
    pub(super) keys: Vec<(u64, u64)>,
    /// `None` once the owner destroyed the arena.
    pub(super) owner: Option<Owner>,
    pub(super) open_exports: usize,
    pub(super) mappings: usize,
    pub(super) pinned: bool,
    /// The lengths of its chunks (`grow_arena`), in address order: `[bytes]` until it grows
    /// (and while asleep). Each chunk is a memfd of its own (`Owner::memfds`, `keys`); an
    /// export hands out one fd per chunk, as a driver exports each physical allocation.
    pub(super) chunks: Vec<u64>,
    /// The bytes of its address reservation (`create_growable_arena`; `bytes` for a plain
    /// arena): `owner.region` spans all of it, the first `bytes` mapped.
    pub(super) reserve: u64,
}

impl ArenaEntry {
    /// Whether the owner put the arena to sleep (addresses reserved, no memory held).
    pub(super) fn asleep(&self) -> bool {
        self.owner.as_ref().is_some_and(|o| o.memfds.is_empty())
    }

    /// Whether nothing holds the bytes any more (the entry can leave the ledger).
    pub(super) fn released(&self) -> bool {
        self.owner.is_none() && self.open_exports == 0 && self.mappings == 0 && !self.pinned
    }

    /// Each chunk's `(offset, length)` in the arena, in address order (the first at 0).
    pub(super) fn chunk_spans(&self) -> Vec<(u64, u64)> {
        let mut at = 0;
        self.chunks
            .iter()
            .map(|&len| {
                at += len;
                (at - len, len)
            })
            .collect()
    }

    /// Refused unless nothing but the owner holds the arena (`handle`): no export, no
    /// in-process mapping, no pin (a growth, shrink, split or chunk drop would change what
    /// they name).
    pub(super) fn check_unshared(&self, call: &str, handle: u64) -> Result<()> {
        if self.open_exports > 0 || self.mappings > 0 || self.pinned {
            return Err(Error::InvalidState(format!(
                "sim {call}: arena {handle} is exported or mapped elsewhere"
            )));
        }
        Ok(())
    }

    pub(super) fn check(&self, arena: &ArenaMem, call: &str) -> Result<()> {
        if self.device != arena.device || self.base != arena.base || self.bytes != arena.bytes {
            return Err(Error::invalid(format!(
                "sim {call}: arena {} is {} bytes at {:#x} on device {}, not {} bytes at \
                 {:#x} on device {}",
                arena.handle,
                self.bytes,
                self.base,
                self.device,
                arena.bytes,
                arena.base,
                arena.device
            )));
        }
        Ok(())
    }
}

/// A mapping made by `import`.
#[derive(Debug)]
pub(super) struct ImportEntry {
    pub(super) device: DeviceId,
    pub(super) bytes: u64,
    pub(super) region: Region,
    /// The arena of this backend it maps, or `None` for foreign memory.
    pub(super) arena: Option<u64>,
}

#[derive(Debug)]
pub(super) struct EventEntry {
    pub(super) device: DeviceId,
    pub(super) stream: StreamId,
    pub(super) done: bool,
}

/// Counts and scheduled faults of one [`SimCall`].
#[derive(Debug, Default)]
pub(super) struct FaultPlan {
    pub(super) calls: u64,
    /// Absolute call numbers (1-based) that fail.
    pub(super) fail_at: BTreeSet<u64>,
    pub(super) always: bool,
}

#[derive(Debug)]
pub(super) struct Inner {
    pub(super) arenas: BTreeMap<u64, ArenaEntry>,
    /// The inode key of every chunk memfd of ours (`ArenaEntry::keys`) to its arena's id.
    pub(super) by_inode: HashMap<(u64, u64), u64>,
    pub(super) imports: BTreeMap<u64, ImportEntry>,
    pub(super) events: HashMap<u64, EventEntry>,
    pub(super) blocked: HashSet<(DeviceId, StreamId)>,
    /// Export fds kept by failed `close_export` calls (see the module docs).
    pub(super) stranded: Vec<OwnedFd>,
    /// Next arena, mapping or event id: one counter, so ids are unique across kinds.
    pub(super) next_id: u64,
    pub(super) faults: [FaultPlan; SimCall::ALL.len()],
    /// Host buffers from `alloc_host` not yet given back with `free_host`.
    pub(super) host_buffers: u64,
    /// Live transfer streams (`create_stream`) and their device.
    pub(super) streams: HashMap<u64, DeviceId>,
}

impl Inner {
    /// Count a call and fail it if a fault is scheduled for it.
    pub(super) fn enter(&mut self, call: SimCall) -> Result<()> {
        let plan = &mut self.faults[call.index()];
        plan.calls += 1;
        let n = plan.calls;
        if plan.always || plan.fail_at.remove(&n) {
            return Err(injected(call));
        }
        Ok(())
    }

    /// Record a new import mapping `region` of `bytes` on `device`, of the memfd whose inode
    /// is `key` (counted as a mapping of that arena when it is one of ours).
    pub(super) fn record_import(
        &mut self,
        device: DeviceId,
        bytes: u64,
        region: Region,
        key: Option<(u64, u64)>,
    ) -> crate::backend::Mapping {
        let arena = key
            .and_then(|k| self.by_inode.get(&k).copied())
            .filter(|id| self.arenas.contains_key(id));
        if let Some(entry) = arena.and_then(|id| self.arenas.get_mut(&id)) {
            entry.mappings += 1;
        }
        let id = self.take_id();
        let base = region.base();
        self.imports.insert(
            id,
            ImportEntry {
                device,
                bytes,
                region,
                arena,
            },
        );
        crate::backend::Mapping {
            device,
            base,
            bytes,
            handle: id,
        }
    }

    pub(super) fn take_id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    pub(super) fn held_bytes(&self, device: DeviceId) -> u64 {
        self.arenas
            .values()
            .filter(|a| a.device == device && !a.asleep())
            .map(|a| a.bytes)
            .sum()
    }

    pub(super) fn arena_mut(&mut self, arena: &ArenaMem, call: &str) -> Result<&mut ArenaEntry> {
        let entry = self.arenas.get_mut(&arena.handle).ok_or_else(|| {
            Error::invalid(format!(
                "sim {call}: unknown sim arena {} (never created, or already released)",
                arena.handle
            ))
        })?;
        entry.check(arena, call)?;
        Ok(entry)
    }

    /// Drop the arena's entry if nothing holds its bytes any more.
    pub(super) fn retire_if_released(&mut self, id: u64) {
        if !self.arenas.get(&id).is_some_and(ArenaEntry::released) {
            return;
        }
        if let Some(entry) = self.arenas.remove(&id) {
            self.forget_keys(id, &entry.keys);
        }
    }

    /// Name arena `id` as the owner of the memfds whose inodes are `keys`. A stale key can
    /// only belong to an entry whose memfd the kernel already freed (inode numbers are
    /// reused only then): the arena owns the inode now.
    pub(super) fn own_keys(&mut self, id: u64, keys: &[(u64, u64)]) {
        for &key in keys {
            self.by_inode.insert(key, id);
        }
    }

    /// Forget that arena `id` owns the memfds whose inodes are `keys` (closed, or handed to
    /// another arena; a key naming another arena stays).
    pub(super) fn forget_keys(&mut self, id: u64, keys: &[(u64, u64)]) {
        for key in keys {
            if self.by_inode.get(key) == Some(&id) {
                self.by_inode.remove(key);
            }
        }
    }

    /// Uncount one open export of the arena whose memfd inode is `key`; returns the arena's
    /// id, or `None` when `key` is not a counted export of one of our arenas.
    pub(super) fn uncount_export(&mut self, key: (u64, u64)) -> Option<u64> {
        let id = *self.by_inode.get(&key)?;
        let entry = self.arenas.get_mut(&id)?;
        if entry.open_exports == 0 {
            return None;
        }
        entry.open_exports -= 1;
        Some(id)
    }

    /// Whether `key` is the inode of one of our arenas with a counted open export.
    pub(super) fn is_counted_export(&self, key: (u64, u64)) -> bool {
        self.by_inode
            .get(&key)
            .and_then(|id| self.arenas.get(id))
            .is_some_and(|a| a.open_exports > 0)
    }

    /// `addr..addr + len` lies inside one live, awake arena of `device`.
    pub(super) fn check_awake_range(&self, device: DeviceId, addr: u64, len: u64) -> Result<()> {
        let ok = self.arenas.values().any(|a| {
            a.device == device
                && a.owner.is_some()
                && !a.asleep()
                && addr >= a.base
                && addr
                    .checked_add(len)
                    .is_some_and(|end| end <= a.base + a.bytes)
        });
        if ok {
            Ok(())
        } else {
            Err(Error::UnknownPointer {
                ptr: addr,
                why: format!("{len} bytes from here are not inside a live, awake sim arena of device {device}"),
            })
        }
    }

    /// Whether `addr..addr + len` lies inside one live, awake arena of ours or one import
    /// mapping (of any device): what a transfer copy may touch.
    pub(super) fn check_mapped_range(&self, addr: u64, len: u64) -> Result<()> {
        let inside = |base: u64, bytes: u64| {
            addr >= base && addr.checked_add(len).is_some_and(|end| end <= base + bytes)
        };
        let in_arena = self
            .arenas
            .values()
            .any(|a| a.owner.is_some() && !a.asleep() && inside(a.base, a.bytes));
        let in_import = self
            .imports
            .values()
            .any(|i| inside(i.region.base(), i.bytes));
        if in_arena || in_import {
            return Ok(());
        }
        Err(Error::UnknownPointer {
            ptr: addr,
            why: format!("{len} bytes from here are not inside a live sim arena or import"),
        })
    }

    pub(super) fn ledger(&self, device: DeviceId) -> SimLedger {
        let mut l = SimLedger::default();
        for a in self.arenas.values().filter(|a| a.device == device) {
            if a.asleep() {
                l.sleeping_bytes += a.bytes;
                l.live_arenas += 1;
                continue;
            }
            l.held_bytes += a.bytes;
            if a.owner.is_some() {
                l.live_arenas += 1;
            } else {
                l.destroyed_but_held += 1;
            }
            l.open_exports += a.open_exports;
            l.own_mappings += a.mappings;
            if a.pinned {
                l.pinned_bytes += a.bytes;
            }
        }
        for m in self
            .imports
            .values()
            .filter(|m| m.arena.is_none() && m.device == device)
        {
            l.foreign_imports += 1;
            l.foreign_import_bytes += m.bytes;
        }
        l
    }
}

/// The owner's side of an arena that is live and awake.
pub(super) fn awake_owner<'a>(
    owner: &'a mut Option<Owner>,
    call: &str,
    handle: u64,
) -> Result<&'a mut Owner> {
    match owner {
        Some(o) if !o.memfds.is_empty() => Ok(o),
        _ => Err(Error::InvalidState(format!(
            "sim {call}: arena {handle} is destroyed or asleep"
        ))),
    }
}
