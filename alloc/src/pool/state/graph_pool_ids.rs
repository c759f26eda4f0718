//! Graph pools' bookkeeping, pure: PyTorch's pool ids ([`GraphPoolId`]), their slots and
//! use counts, and the routing contexts open on a device ([`GraphPools`], behind the device
//! lock). The rules the pool follows with them are `pool/graphs/graph_pools.rs`'s module docs.

use rustc_hash::FxHashMap;

use crate::backend::StreamId;
use crate::error::{Error, Result};
use crate::pool::sizes::classes::GENERAL;

/// PyTorch's id of a private memory pool (`MempoolId_t`: a pair of 64-bit ids; `(0, 0)`
/// is torch's default pool and is not a graph pool).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GraphPoolId(pub u64, pub u64);

impl std::fmt::Display for GraphPoolId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "({}, {})", self.0, self.1)
    }
}

/// A live block of a graph pool, as listed and restored by checkpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct PoolBlock {
    /// Device address of its first byte.
    pub ptr: u64,
    /// Bytes asked for (the block serves [`block_len`](crate::pool::block_len) of it).
    pub requested: u64,
    /// The stream it was allocated on.
    pub stream: StreamId,
}

/// Graph pools of one device (behind its lock): slots, ids and use counts, and the routing
/// contexts open. Pure bookkeeping: the pool's arenas carry their slot.
#[derive(Debug, Default)]
pub(crate) struct GraphPools {
    /// Slot `i + 1` (slot 0 is the general pool, `classes::GENERAL`).
    slots: Vec<Option<Slot>>,
    by_id: FxHashMap<GraphPoolId, u16>,
    /// Routing contexts open (captures or `use_mem_pool` blocks): no events while above 0.
    routing: u32,
    /// Frees made while routing whose blocks have `record_stream` streams: their events
    /// are recorded when the last context closes.
    pub(crate) deferred: Vec<u64>,
    /// The threads running a call that synchronizes the device (`pool/graphs/graph_pools.rs`,
    /// `SyncHold`): no routing context opens while any does.
    syncing: Vec<std::thread::ThreadId>,
}

#[derive(Debug)]
struct Slot {
    id: GraphPoolId,
    use_count: u32,
    /// Its routing contexts open (begun, not ended): the pool stays known while any is.
    open: u32,
}

/// Most graph pools alive at once on one device.
pub const MAX_GRAPH_POOLS: usize = u16::MAX as usize;

impl GraphPools {
    /// Whether a routing context is open: no event may be recorded or queried.
    #[inline]
    pub(crate) fn routing(&self) -> bool {
        self.routing != 0
    }

    /// Whether a call that synchronizes the device is under way on the calling thread.
    pub(crate) fn syncing_here(&self) -> bool {
        self.syncing.contains(&std::thread::current().id())
    }

    /// Whether a call that synchronizes the device is under way on any thread.
    pub(crate) fn syncing(&self) -> bool {
        !self.syncing.is_empty()
    }

    /// A call that synchronizes the device starts on this thread (not while routing: the
    /// caller checked).
    pub(crate) fn start_sync(&mut self) {
        self.syncing.push(std::thread::current().id());
    }

    /// ... and ends.
    pub(crate) fn end_sync(&mut self) {
        let me = std::thread::current().id();
        if let Some(i) = self.syncing.iter().position(|&t| t == me) {
            self.syncing.swap_remove(i);
        }
    }

    /// The slot of pool `id`, if it exists.
    pub(crate) fn slot(&self, id: GraphPoolId) -> Option<u16> {
        self.by_id.get(&id).copied()
    }

    fn slot_mut(&mut self, slot: u16) -> Option<&mut Slot> {
        self.slots
            .get_mut(usize::from(slot).checked_sub(1)?)?
            .as_mut()
    }

    /// The id of the pool in `slot`.
    pub(crate) fn id_of(&self, slot: u16) -> Option<GraphPoolId> {
        let i = usize::from(slot).checked_sub(1)?;
        self.slots.get(i)?.as_ref().map(|s| s.id)
    }

    /// Whether the pool in `slot` is in use (its arenas must stay whole and mapped).
    pub(crate) fn in_use(&self, slot: u16) -> bool {
        let i = usize::from(slot).wrapping_sub(1);
        self.slots
            .get(i)
            .and_then(Option::as_ref)
            .is_some_and(|s| s.use_count > 0)
    }

    /// The use count of pool `id` (0 when it does not exist).
    pub(crate) fn use_count(&self, id: GraphPoolId) -> u32 {
        self.slot(id)
            .and_then(|slot| self.slots.get(usize::from(slot) - 1)?.as_ref())
            .map_or(0, |s| s.use_count)
    }

    /// Create pool `id` (use count 1) or add a use. Returns the use count after.
    pub(crate) fn retain(&mut self, id: GraphPoolId) -> Result<u32> {
        if id == GraphPoolId(0, 0) {
            return Err(Error::invalid(
                "graph pool (0, 0) is torch's default pool, not a private pool",
            ));
        }
        if let Some(slot) = self.slot(id) {
            let s = self.slot_mut(slot).ok_or_else(|| lost(id))?;
            s.use_count += 1;
            return Ok(s.use_count);
        }
        let i = match self.slots.iter().position(Option::is_none) {
            Some(i) => i,
            None if self.slots.len() < MAX_GRAPH_POOLS => {
                self.slots.push(None);
                self.slots.len() - 1
            }
            None => {
                return Err(Error::InvalidState(format!(
                    "graph pool {id}: {MAX_GRAPH_POOLS} graph pools are alive on this device \
                     already (release some: each graph's reset, or del of its MemPool)"
                )))
            }
        };
        self.slots[i] = Some(Slot {
            id,
            use_count: 1,
            open: 0,
        });
        // i < MAX_GRAPH_POOLS = u16::MAX, so the slot fits.
        let slot = u16::try_from(i + 1).map_err(|_| lost(id))?;
        self.by_id.insert(id, slot);
        Ok(1)
    }

    /// Take a use of pool `id`. Returns the use count after; the pool stays known until
    /// [`Self::forget_unused`] finds it without arenas.
    pub(crate) fn release(&mut self, id: GraphPoolId) -> Result<u32> {
        let slot = self.slot(id).ok_or_else(|| unknown(id))?;
        let s = self.slot_mut(slot).ok_or_else(|| lost(id))?;
        if s.use_count == 0 {
            return Err(Error::InvalidState(format!(
                "graph pool {id} released more often than it was retained"
            )));
        }
        s.use_count -= 1;
        Ok(s.use_count)
    }

    /// Open a routing context of pool `id` (created, or a use added): the use count after.
    pub(crate) fn begin(&mut self, id: GraphPoolId) -> Result<u32> {
        let count = self.retain(id)?;
        let slot = self.slot(id).ok_or_else(|| lost(id))?;
        self.slot_mut(slot).ok_or_else(|| lost(id))?.open += 1;
        self.routing += 1;
        Ok(count)
    }

    /// Close a routing context of pool `id`. Returns whether it was the device's last.
    pub(crate) fn end(&mut self, id: GraphPoolId) -> Result<bool> {
        let slot = self.slot(id).ok_or_else(|| unknown(id))?;
        let s = self.slot_mut(slot).ok_or_else(|| lost(id))?;
        if s.open == 0 {
            return Err(Error::InvalidState(format!(
                "graph pool {id}: end without a matching begin"
            )));
        }
        s.open -= 1;
        self.routing -= 1;
        Ok(self.routing == 0)
    }

    /// Whether no graph pool is known.
    pub(crate) fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }

    /// Forget the pools with no use whose slots `has_arena` says hold no arena.
    pub(crate) fn forget_unused(&mut self, has_arena: impl Fn(u16) -> bool) {
        for i in 0..self.slots.len() {
            let slot = (i + 1) as u16;
            let done = matches!(&self.slots[i], Some(s) if s.use_count == 0 && s.open == 0)
                && !has_arena(slot);
            if let Some(s) = self.slots[i].take_if(|_| done) {
                self.by_id.remove(&s.id);
            }
        }
    }
}

pub(crate) fn unknown(id: GraphPoolId) -> Error {
    Error::invalid(format!(
        "graph pool {id} does not exist on this device (never retained, or released and \
         emptied since)"
    ))
}

pub(crate) fn lost(id: GraphPoolId) -> Error {
    Error::Internal(format!("graph pool {id}: its slot is gone"))
}

/// Whether arenas of `slot` must stay (their pool is in use): `GENERAL` never.
pub(crate) fn keeps_arenas(pools: &GraphPools, slot: u16) -> bool {
    slot != GENERAL && pools.in_use(slot)
}
