//! The lifetime of a shared arena, as a pure state machine: exports, references (shares
//! and consumer leases), pinning, deferred frees. Every decision about when an arena is
//! exported, when its export is closed, when a freed allocation goes back and whether the
//! arena may be destroyed is taken here; the pool holds one [`ArenaLifetime`] per arena and
//! performs the driver calls it asks for. Like `range/`, this module knows no driver,
//! device or pointer: the export payload is a type parameter `E` (the pool's `Export`, an
//! integer in the tests), and transitions return what the caller must do.
//!
//! Terms: a **share** is the producer's grant of a sub-range of one live allocation to other
//! processes; a **lease** is one consumer's import of a share. Both hold one reference on
//! the arena and one on the allocation. The caller stores the per-allocation part
//! ([`AllocHold`]) and the per-share part ([`ShareHold`]); only the methods of
//! [`ArenaLifetime`] change them.
//!
//! # States and transitions
//!
//! The export state is `Private`, `Exporting` or `Exported(E)`; `refs` counts shares plus
//! leases; `pinned` is set by a pinning export and never cleared; `generation` counts the
//! exports made (a share handle carries the one it was made under).
//!
//! | state | event (method) | result: what the caller does | next state |
//! |---|---|---|---|
//! | any | new share on a live allocation ([`take_ref`](ArenaLifetime::take_ref)) | refs + 1 on arena and allocation; refused if the owner freed it | same |
//! | `Private`, refs > 0 | [`begin_export`](ArenaLifetime::begin_export) | [`ExportStep::Export`]: export with the lock released | `Exporting` |
//! | `Exporting` | `begin_export` | [`ExportStep::Wait`]: unlock, yield, ask again | `Exporting` |
//! | `Exported` | `begin_export` | [`ExportStep::Ready`]: reuse the export | `Exported` |
//! | any, refs = 0 | `begin_export` | refused: only a referenced arena is exported | same |
//! | `Exporting` | export made ([`finish_export`](ArenaLifetime::finish_export)) | generation + 1; pinned if the export pins | `Exported` |
//! | not `Exporting` | `finish_export` | refused, the export handed back to be closed (never dropped) | same |
//! | `Exporting` | export failed ([`export_failed`](ArenaLifetime::export_failed)) | drop the share's ref | `Private` |
//! | `Exported` | record the share ([`new_share`](ArenaLifetime::new_share)) | a [`ShareHold`] of this generation | `Exported` |
//! | `Exported` | lease on a share that is not revoked ([`check_lease`](ArenaLifetime::check_lease), then [`open_lease`](ArenaLifetime::open_lease)) | hand the consumer the export; refs + 1 | `Exported` |
//! | any | [`unshare`](ArenaLifetime::unshare) / [`close_lease`](ArenaLifetime::close_lease) / [`drop_ref`](ArenaLifetime::drop_ref), refs stay > 0 | refs - 1; remove a revoked share at its last lease | same |
//! | `Exported`, not pinned | the last ref ends | [`Ended::close_export`]: close it after unlocking | `Private` |
//! | `Exported`, pinned | the last ref ends | nothing: a pinning export cannot end | `Exported` |
//! | any | an allocation's last ref ends after its owner freed it | [`Ended::release_freed`]: the deferred free happens now (once) | same |
//! | any | owner frees an allocation ([`free`](ArenaLifetime::free)) | [`FreeStep::Deferred`] while referenced, else [`FreeStep::Now`]; a second free is refused | same |
//! | `Private`, refs = 0, not pinned | [`destroyable`](ArenaLifetime::destroyable) | with no allocation left, the arena may go back to the driver | (gone) |
//! | pinned | `destroyable` is false | recycled: its ranges serve later allocations | pinned |
//!
//! While `Exporting` or `Exported` ([`export_begun`](ArenaLifetime::export_begun)) the
//! arena's memory stays as it is: it does not grow and `empty_cache` cuts none of its chunks
//! (an export covers every chunk the arena had when it began).
//!
//! Rules that follow: an arena is exported at most once at a time (a second `begin_export`
//! waits, a second `finish_export` is refused); its export is closed only when no share or
//! lease holds it, and before it may be destroyed; a pinned arena is never destroyed; a
//! freed allocation goes back exactly once, at its last reference; references never go
//! negative (dropping one that is not held is refused, and nothing changes).
//!
//! A handle's generation is checked with [`check_generation`](ArenaLifetime::check_generation):
//! a handle made under an earlier export of this arena is stale.
#![forbid(unsafe_code)]

use std::fmt;

/// The export state of one arena.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum ExportState<E> {
    /// Not exported.
    #[default]
    Private,
    /// A thread is exporting it with the lock released.
    Exporting,
    /// Exported; the export is closed when the last reference ends (unless pinned).
    Exported(E),
}

/// The per-allocation part of the lifetime, stored in the caller's allocation record.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AllocHold {
    /// Shares and leases holding the allocation.
    refs: u32,
    /// Freed by its owner (deferred while referenced, or waiting for other streams).
    freed: bool,
}

impl AllocHold {
    /// Shares and leases holding the allocation.
    pub fn refs(&self) -> u32 {
        self.refs
    }

    /// Whether its owner freed it.
    pub fn freed(&self) -> bool {
        self.freed
    }

    /// Not freed and not referenced: a free needs no lifetime step (the pool's fast path).
    #[inline]
    pub fn is_plain(&self) -> bool {
        self.refs == 0 && !self.freed
    }
}

/// The per-share part of the lifetime, stored in the caller's share record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShareHold {
    /// The export generation the share was made under.
    generation: u32,
    /// Leases open on it.
    leases: u64,
    /// Unshared: no new lease; the record stays while leases remain.
    revoked: bool,
}

impl ShareHold {
    /// The export generation the share was made under.
    pub fn generation(&self) -> u32 {
        self.generation
    }

    /// Leases open on it.
    pub fn leases(&self) -> u64 {
        self.leases
    }

    /// Whether it was unshared.
    pub fn revoked(&self) -> bool {
        self.revoked
    }
}

/// What [`ArenaLifetime::begin_export`] asks the caller to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExportStep {
    /// The arena is exported: use that export.
    Ready,
    /// Another thread is exporting: release the lock, yield, ask again.
    Wait,
    /// Export the arena (with the lock released), then call `finish_export` or
    /// `export_failed`.
    Export,
}

/// What [`ArenaLifetime::free`] asks the caller to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FreeStep {
    /// Not referenced: release the range now (or once its other streams are done).
    Now,
    /// Still shared or leased: keep the range; a later `Ended::release_freed` releases it.
    Deferred,
}

/// A successful [`ArenaLifetime::finish_export`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exported {
    /// The new export generation.
    pub generation: u32,
    /// This export pinned the arena (it was not pinned before).
    pub newly_pinned: bool,
}

/// What the caller must do after a reference ended, in this order.
#[derive(Debug, PartialEq, Eq)]
#[must_use]
pub struct Ended<E> {
    /// The share is unshared and has no lease left: remove its record.
    pub remove_share: bool,
    /// The allocation was freed by its owner and this was its last reference: release it
    /// now (this is reported exactly once per allocation).
    pub release_freed: bool,
    /// The arena's last reference ended: close this export, with the lock released.
    pub close_export: Option<E>,
}

/// A transition the state machine refuses; nothing was changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LifetimeError {
    /// A new share of an allocation its owner freed.
    Freed,
    /// A second free of one allocation.
    DoubleFree,
    /// A reference dropped that is not held (arena or allocation).
    NotHeld,
    /// `begin_export` on an arena no share holds.
    NotReferenced,
    /// `export_failed` while not exporting.
    NotExporting,
    /// A share or lease on an arena that is not exported.
    NotExported,
    /// Unshare of an unshared share, or a lease on one.
    Revoked,
    /// A lease closed on a share with no lease open.
    NoLease,
    /// A share made under another export generation than the arena's.
    Stale {
        /// The generation the handle or share names.
        named: u32,
        /// The arena's current (or last) export generation.
        current: u32,
    },
}

impl fmt::Display for LifetimeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LifetimeError::Freed => write!(f, "the allocation was freed"),
            LifetimeError::DoubleFree => write!(f, "already freed (double free)"),
            LifetimeError::NotHeld => write!(f, "a reference dropped that is not held"),
            LifetimeError::NotReferenced => write!(f, "export of an arena no share holds"),
            LifetimeError::NotExporting => write!(f, "export ended while not exporting"),
            LifetimeError::NotExported => write!(f, "the arena is not exported"),
            LifetimeError::Revoked => write!(f, "the share was unshared"),
            LifetimeError::NoLease => write!(f, "no lease open on the share"),
            LifetimeError::Stale { named, current } => write!(
                f,
                "made under export generation {named}, the arena is at generation {current}"
            ),
        }
    }
}

impl std::error::Error for LifetimeError {}

/// The sharing state of one arena. See the module docs for the transition table.
#[derive(Debug)]
pub struct ArenaLifetime<E> {
    state: ExportState<E>,
    /// Shares plus leases holding the arena.
    refs: u64,
    /// A pinning export was made: never destroy, recycle.
    pinned: bool,
    /// Exports made of this arena.
    generation: u32,
}

impl<E> Default for ArenaLifetime<E> {
    fn default() -> Self {
        Self::new()
    }
}

impl<E> ArenaLifetime<E> {
    /// A fresh arena: private, unreferenced, not pinned, generation 0.
    pub const fn new() -> Self {
        ArenaLifetime {
            state: ExportState::Private,
            refs: 0,
            pinned: false,
            generation: 0,
        }
    }

    /// The export state.
    pub fn state(&self) -> &ExportState<E> {
        &self.state
    }

    /// The state's name, for snapshots: `private`, `exporting` or `exported`.
    pub fn state_name(&self) -> &'static str {
        match self.state {
            ExportState::Private => "private",
            ExportState::Exporting => "exporting",
            ExportState::Exported(_) => "exported",
        }
    }

    /// Whether an export exists or is being made (with the lock released): the arena must
    /// keep its memory as it is, since an export covers every chunk it had when it began.
    pub fn export_begun(&self) -> bool {
        !matches!(self.state, ExportState::Private)
    }

    /// The current export, if any.
    pub fn export(&self) -> Option<&E> {
        match &self.state {
            ExportState::Exported(e) => Some(e),
            _ => None,
        }
    }

    /// Shares plus leases holding the arena.
    pub fn refs(&self) -> u64 {
        self.refs
    }

    /// Whether a pinning export was made (the arena is never destroyed).
    pub fn pinned(&self) -> bool {
        self.pinned
    }

    /// Exports made so far; the current export's number while exported.
    pub fn generation(&self) -> u32 {
        self.generation
    }

    /// Whether the arena may go back to the driver (given it has no allocations): no
    /// reference, no export, not pinned.
    pub fn destroyable(&self) -> bool {
        self.refs == 0 && !self.pinned && matches!(self.state, ExportState::Private)
    }

    /// Take a reference on the arena and on `alloc` for a new share. Refused when the owner
    /// freed the allocation.
    pub fn take_ref(&mut self, alloc: &mut AllocHold) -> Result<(), LifetimeError> {
        if alloc.freed {
            return Err(LifetimeError::Freed);
        }
        alloc.refs += 1;
        self.refs += 1;
        Ok(())
    }

    /// Start exporting, unless exported or being exported. Only a referenced arena is
    /// exported (the share takes its reference first).
    pub fn begin_export(&mut self) -> Result<ExportStep, LifetimeError> {
        if self.refs == 0 {
            return Err(LifetimeError::NotReferenced);
        }
        Ok(match self.state {
            ExportState::Exported(_) => ExportStep::Ready,
            ExportState::Exporting => ExportStep::Wait,
            ExportState::Private => {
                self.state = ExportState::Exporting;
                ExportStep::Export
            }
        })
    }

    /// The export started by `begin_export` was made. `pinning`: it cannot be ended (the
    /// arena becomes pinned). Outside `Exporting` the export is refused and handed back, so
    /// the caller closes it instead of dropping it.
    pub fn finish_export(&mut self, export: E, pinning: bool) -> Result<Exported, E> {
        if !matches!(self.state, ExportState::Exporting) {
            return Err(export);
        }
        self.state = ExportState::Exported(export);
        self.generation = self.generation.wrapping_add(1);
        let newly_pinned = pinning && !self.pinned;
        self.pinned |= pinning;
        Ok(Exported {
            generation: self.generation,
            newly_pinned,
        })
    }

    /// The export started by `begin_export` failed: back to `Private` (the caller then drops
    /// the share's reference).
    pub fn export_failed(&mut self) -> Result<(), LifetimeError> {
        if !matches!(self.state, ExportState::Exporting) {
            return Err(LifetimeError::NotExporting);
        }
        self.state = ExportState::Private;
        Ok(())
    }

    /// The hold of a share being recorded (after `take_ref` and an export).
    pub fn new_share(&self) -> Result<ShareHold, LifetimeError> {
        if self.export().is_none() {
            return Err(LifetimeError::NotExported);
        }
        Ok(ShareHold {
            generation: self.generation,
            leases: 0,
            revoked: false,
        })
    }

    /// A handle naming export `generation` of this arena is current, or stale.
    pub fn check_generation(&self, generation: u32) -> Result<(), LifetimeError> {
        if generation == self.generation {
            Ok(())
        } else {
            Err(LifetimeError::Stale {
                named: generation,
                current: self.generation,
            })
        }
    }

    /// The export a new lease on `share` receives, changing nothing: refused when the share
    /// was unshared, or the arena is not exported under the share's generation.
    pub fn check_lease(&self, share: &ShareHold) -> Result<&E, LifetimeError> {
        if share.revoked {
            return Err(LifetimeError::Revoked);
        }
        let export = self.export().ok_or(LifetimeError::NotExported)?;
        self.check_generation(share.generation)?;
        Ok(export)
    }

    /// Open a lease on `share` (of allocation `alloc`): one more reference on the arena and
    /// the allocation. Refused as `check_lease` refuses, or when `alloc` is not held (a live
    /// share always holds it).
    pub fn open_lease(
        &mut self,
        share: &mut ShareHold,
        alloc: &mut AllocHold,
    ) -> Result<(), LifetimeError> {
        self.check_lease(share)?;
        if alloc.refs == 0 {
            return Err(LifetimeError::NotHeld);
        }
        share.leases += 1;
        alloc.refs += 1;
        self.refs += 1;
        Ok(())
    }

    /// Revoke `share`: no new lease; its reference ends (the record stays while leases
    /// remain).
    pub fn unshare(
        &mut self,
        share: &mut ShareHold,
        alloc: &mut AllocHold,
    ) -> Result<Ended<E>, LifetimeError> {
        if share.revoked {
            return Err(LifetimeError::Revoked);
        }
        let mut ended = self.drop_ref(alloc)?;
        share.revoked = true;
        ended.remove_share = share.leases == 0;
        Ok(ended)
    }

    /// Close a lease on `share`: its reference ends; an unshared share goes with its last
    /// lease.
    pub fn close_lease(
        &mut self,
        share: &mut ShareHold,
        alloc: &mut AllocHold,
    ) -> Result<Ended<E>, LifetimeError> {
        if share.leases == 0 {
            return Err(LifetimeError::NoLease);
        }
        let mut ended = self.drop_ref(alloc)?;
        share.leases -= 1;
        ended.remove_share = share.revoked && share.leases == 0;
        Ok(ended)
    }

    /// Drop one reference on the arena and on `alloc` (a share that failed to be made).
    /// Reports the deferred free to perform and the export to close, if this ended them.
    pub fn drop_ref(&mut self, alloc: &mut AllocHold) -> Result<Ended<E>, LifetimeError> {
        if self.refs == 0 || alloc.refs == 0 {
            return Err(LifetimeError::NotHeld);
        }
        alloc.refs -= 1;
        self.refs -= 1;
        let release_freed = alloc.refs == 0 && alloc.freed;
        let close_export = if self.refs == 0 && !self.pinned {
            match std::mem::take(&mut self.state) {
                ExportState::Exported(e) => Some(e),
                other => {
                    self.state = other;
                    None
                }
            }
        } else {
            None
        };
        Ok(Ended {
            remove_share: false,
            release_freed,
            close_export,
        })
    }

    /// The owner frees `alloc`: deferred while shares or leases hold it. A second free is
    /// refused.
    pub fn free(&self, alloc: &mut AllocHold) -> Result<FreeStep, LifetimeError> {
        if alloc.freed {
            return Err(LifetimeError::DoubleFree);
        }
        alloc.freed = true;
        Ok(if alloc.refs > 0 {
            FreeStep::Deferred
        } else {
            FreeStep::Now
        })
    }

    /// The export still open, for teardown (the pool is going away): close it, then destroy.
    pub fn into_export(self) -> Option<E> {
        match self.state {
            ExportState::Exported(e) => Some(e),
            _ => None,
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn first_share_exports_later_shares_reuse_last_ref_closes() {
        let mut lt = ArenaLifetime::<u8>::new();
        let mut a = AllocHold::default();
        assert_eq!(lt.begin_export(), Err(LifetimeError::NotReferenced));
        lt.take_ref(&mut a).unwrap();
        assert_eq!(lt.begin_export(), Ok(ExportStep::Export));
        assert_eq!(lt.begin_export(), Ok(ExportStep::Wait));
        assert_eq!(lt.finish_export(7, false).unwrap().generation, 1);
        assert_eq!(
            lt.finish_export(8, false),
            Err(8),
            "a second export is refused"
        );
        let mut s1 = lt.new_share().unwrap();
        lt.take_ref(&mut a).unwrap();
        assert_eq!(lt.begin_export(), Ok(ExportStep::Ready));
        let mut s2 = lt.new_share().unwrap();
        assert_eq!(lt.check_lease(&s1), Ok(&7));
        lt.open_lease(&mut s1, &mut a).unwrap();
        assert_eq!((lt.refs(), a.refs()), (3, 3));
        let e = lt.unshare(&mut s1, &mut a).unwrap();
        assert!(
            !e.remove_share && e.close_export.is_none(),
            "a lease remains"
        );
        assert_eq!(lt.check_lease(&s1), Err(LifetimeError::Revoked));
        assert_eq!(lt.unshare(&mut s1, &mut a), Err(LifetimeError::Revoked));
        assert_eq!(lt.free(&mut a), Ok(FreeStep::Deferred));
        assert_eq!(lt.free(&mut a), Err(LifetimeError::DoubleFree));
        let e = lt.unshare(&mut s2, &mut a).unwrap();
        assert!(e.remove_share && !e.release_freed && e.close_export.is_none());
        assert!(!lt.destroyable());
        let e = lt.close_lease(&mut s1, &mut a).unwrap();
        assert_eq!(
            e,
            Ended {
                remove_share: true,
                release_freed: true,
                close_export: Some(7)
            }
        );
        assert!(lt.destroyable());
        assert_eq!(lt.drop_ref(&mut a), Err(LifetimeError::NotHeld));
        assert_eq!(lt.check_generation(1), Ok(()));
    }

    #[test]
    fn pinning_export_never_closes_and_blocks_destroy() {
        let mut lt = ArenaLifetime::<u8>::new();
        let mut a = AllocHold::default();
        lt.take_ref(&mut a).unwrap();
        assert_eq!(lt.begin_export(), Ok(ExportStep::Export));
        assert!(lt.finish_export(1, true).unwrap().newly_pinned);
        let e = lt.drop_ref(&mut a).unwrap();
        assert_eq!(e.close_export, None);
        assert!(lt.pinned() && !lt.destroyable());
        lt.take_ref(&mut a).unwrap();
        assert_eq!(
            lt.begin_export(),
            Ok(ExportStep::Ready),
            "the pinned export is reused"
        );
        assert_eq!(lt.into_export(), Some(1));
    }

    #[test]
    fn failed_export_goes_back_to_private_and_a_reexport_is_a_new_generation() {
        let mut lt = ArenaLifetime::<u8>::new();
        let mut a = AllocHold::default();
        lt.take_ref(&mut a).unwrap();
        assert!(!lt.export_begun());
        assert_eq!(lt.begin_export(), Ok(ExportStep::Export));
        assert!(
            lt.export_begun() && lt.export().is_none(),
            "exporting, lock released"
        );
        lt.export_failed().unwrap();
        assert!(!lt.export_begun());
        assert_eq!(lt.export_failed(), Err(LifetimeError::NotExporting));
        assert_eq!(lt.new_share(), Err(LifetimeError::NotExported));
        assert_eq!(lt.begin_export(), Ok(ExportStep::Export));
        lt.finish_export(1, false).unwrap();
        let s = lt.new_share().unwrap();
        assert_eq!(lt.drop_ref(&mut a).unwrap().close_export, Some(1));
        assert_eq!(lt.check_lease(&s), Err(LifetimeError::NotExported));
        lt.take_ref(&mut a).unwrap();
        assert_eq!(lt.begin_export(), Ok(ExportStep::Export));
        assert_eq!(lt.finish_export(2, false).unwrap().generation, 2);
        assert_eq!(
            lt.check_lease(&s),
            Err(LifetimeError::Stale {
                named: 1,
                current: 2
            })
        );
        assert_eq!(lt.free(&mut a), Ok(FreeStep::Deferred));
        assert_eq!(lt.take_ref(&mut a), Err(LifetimeError::Freed));
    }
}
