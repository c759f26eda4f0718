//! One arena of a device ([`Arena`]: its memory, id, class, lifetime, sleep), the record of a
//! live allocation in the device's map ([`Live`]), and a free waiting for events on its
//! `record_stream` streams ([`PendingFree`]).

use crate::backend::{ArenaMem, Event, Export, StreamId};
use crate::lifetime::{AllocHold, ArenaLifetime};
use crate::pool::sizes::blocks::block_len;
use crate::pool::sizes::classes::Class;
use crate::pool::state::asleep::Asleep;

/// One arena: a block of device memory from the backend, a region of the range allocator.
#[derive(Debug)]
pub(crate) struct Arena {
    pub(crate) mem: ArenaMem,
    /// Unique for the life of the pool (share handles name arenas by it).
    pub(crate) id: u64,
    /// Live (or freed-but-still-referenced) allocations inside whose records are in the
    /// device's map; those recorded by thread caches are not counted (their ranges, still
    /// allocated in the sub-allocator, keep the arena from being destroyed all the same).
    pub(crate) live_allocs: u64,
    /// Export and sharing state (`crate::lifetime`).
    pub(crate) lifetime: ArenaLifetime<Export>,
    /// Its allocations' tag index (`crate::tags`).
    pub(crate) tag: u8,
    /// Whether it holds small blocks (`pool/sizes/classes.rs`).
    pub(crate) small: bool,
    /// Whether it holds huge blocks (`pool/sizes/classes.rs`).
    pub(crate) huge: bool,
    /// The graph pool whose blocks it holds, for life (`pool/graphs/graph_pools.rs`; the slot,
    /// `classes::GENERAL` for the general pool).
    pub(crate) graph_pool: u16,
    /// While asleep (`pool/sleep_wake/sleep.rs`): the contents kept on the host, if offloaded.
    pub(crate) sleep: Option<Asleep>,
    /// Its physical allocations (1 until it grows, `pool/growth/grow.rs`; 1 again after a wake).
    pub(crate) chunks: u16,
}

impl Arena {
    /// The class whose blocks it holds.
    pub(crate) fn class(&self) -> Class {
        Class {
            pool: self.graph_pool,
            tag: self.tag,
            small: self.small,
            huge: self.huge,
        }
    }
}

/// The record of a live allocation: one entry of the pool's busiest hash map, so kept small
/// (40 bytes): the length is recomputed from the request, the rare extra streams are boxed.
#[derive(Debug, Clone)]
pub(crate) struct Live {
    pub(crate) arena: usize,
    pub(crate) requested: u64,
    pub(crate) stream: StreamId,
    /// Streams added by `record_stream` (rare: `None` until the first).
    pub(crate) extra_streams: Option<Box<[StreamId]>>,
    /// Shares and consumer leases holding it, and whether its owner freed it (changed only
    /// by the arena's [`ArenaLifetime`]).
    pub(crate) hold: AllocHold,
}

impl Live {
    /// Bytes of the range serving it: [`block_len`] of the request, as allocated.
    pub(crate) fn bytes(&self) -> u64 {
        // A request that was allocated has a length: block_len succeeded on it then.
        block_len(self.requested).unwrap_or(0)
    }

    /// Streams added by `record_stream`.
    pub(crate) fn extra_streams(&self) -> &[StreamId] {
        self.extra_streams.as_deref().unwrap_or(&[])
    }
}

/// A freed allocation waiting for events on the streams it was recorded on.
#[derive(Debug)]
pub(crate) struct PendingFree {
    pub(crate) ptr: u64,
    pub(crate) stream: StreamId,
    pub(crate) events: Vec<Event>,
    /// An event could not be recorded: released only after a device synchronize.
    pub(crate) until_synchronize: bool,
}
