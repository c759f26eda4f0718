//! The operations the model test draws, their sizes and streams, and the bytes it writes
//! into blocks to see that they stay.

use gpu_arena::backend::sim::SimCall;
use proptest::prelude::*;

use super::common::{fill, read};

pub const KIB: u64 = 1 << 10;
pub const MIB: u64 = 1 << 20;
/// Requested sizes: small blocks, KV-sized pages, odd large ones, a few big ones.
#[rustfmt::skip]
pub const SIZES: [u64; 12] = [
    512, 3 * KIB, 100 * KIB, MIB, MIB + 512, 2 * MIB, 2 * MIB, 3 * MIB + 4 * KIB, 6 * MIB,
    9 * MIB, 24 * MIB, 40 * MIB,
];
pub const STREAMS: u64 = 3;
/// The bytes of a block checked: its first and last `CANARY` bytes.
pub const CANARY: usize = 64;
/// Backend calls a fault may be injected into.
pub const FAULTS: [SimCall; 9] = [
    SimCall::CreateArena,
    SimCall::DestroyArena,
    SimCall::Export,
    SimCall::RecordEvent,
    SimCall::EventQuery,
    SimCall::Synchronize,
    SimCall::CopyToHost,
    SimCall::CopyFromHost,
    // empty_cache's chunk drop of a grown arena (its failure leaves the arena whole).
    SimCall::DropChunks,
];

#[derive(Debug, Clone)]
pub enum Op {
    Alloc {
        size: usize,
        stream: u64,
        tag: usize,
    },
    Free(usize),
    /// A call with bad input on block `i`: refused, nothing changes (kinds in `Model`).
    Bad {
        kind: u8,
        i: usize,
    },
    RecordStream(usize, u64),
    Block(u64),
    Unblock(u64),
    Share(usize),
    Unshare(usize),
    Lease(usize),
    CloseLease(usize),
    EmptyCache,
    Trim,
    /// `prepare_offload` of the tags (pins host buffers ahead of a sleep).
    PrepareOffload(u8),
    ReleaseHostBuffers,
    Sleep {
        tags: u8,
        offload: u8,
    },
    Wake {
        tags: u8,
    },
    GraphBegin(u64),
    GraphAlloc {
        pool: u64,
        size: usize,
    },
    GraphEnd(u64),
    GraphRelease(u64),
    /// A use of a graph pool taken without a capture (torch's `MemPool`).
    GraphRetain(u64),
    /// `graph_pool_empty_cache`: nothing while the pool is in use, else `empty_cache`.
    GraphEmptyCache(u64),
    /// A graph pool's live blocks listed and kept (`pool_model/graphs.rs`).
    Checkpoint(u64),
    /// A graph pool restored to its last checkpoint.
    Restore(u64),
    /// Fail the `n`-th backend call of this kind during the next operation.
    Fault {
        call: usize,
        n: u64,
    },
    /// `n` blocks of 2 MiB on `stream`, then all of them freed in turn: neighbours cached
    /// together, which a larger miss of a growing arena may take back as a run.
    Burst {
        n: usize,
        stream: u64,
    },
    /// Helper thread `k` exits (its thread cache left behind) and a fresh one takes its
    /// place (`pool_model/helpers.rs`).
    RetireThread(usize),
    /// `set_max_reserved` of the device at run time (MiB; `None`: no cap), as torch's
    /// `set_per_process_memory_fraction`: what is reserved stays, nothing grows past it.
    SetCap(Option<u64>),
    /// `record_history` on or off (every device; the thread caches are bypassed while on).
    History(bool),
    /// The read-only views checked against the model (`pool_model/views.rs`).
    Snapshot,
    /// `reset_peak_stats`: the peaks become the current values.
    ResetPeaks,
    /// The lookups by address of a byte `at` into block `i` (`pool_model/views.rs`).
    Lookup {
        i: usize,
        at: u64,
    },
    /// `reset_accumulated_stats`: the counts of events become 0.
    ResetCounts,
}

/// The index in [`SIZES`] of a 2 MiB block.
pub const TWO_MIB: usize = 5;

pub fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        10 => (0..SIZES.len(), 1..=STREAMS, 0..3usize)
            .prop_map(|(size, stream, tag)| Op::Alloc { size, stream, tag }),
        7 => any::<usize>().prop_map(Op::Free),
        2 => (0..6u8, any::<usize>()).prop_map(|(kind, i)| Op::Bad { kind, i }),
        1 => (any::<usize>(), 1..=STREAMS).prop_map(|(i, s)| Op::RecordStream(i, s)),
        1 => (1..=STREAMS).prop_map(Op::Block),
        1 => (1..=STREAMS).prop_map(Op::Unblock),
        1 => any::<usize>().prop_map(Op::Share),
        1 => any::<usize>().prop_map(Op::Unshare),
        1 => any::<usize>().prop_map(Op::Lease),
        1 => any::<usize>().prop_map(Op::CloseLease),
        1 => Just(Op::EmptyCache),
        1 => Just(Op::Trim),
        1 => (1..8u8).prop_map(Op::PrepareOffload),
        1 => Just(Op::ReleaseHostBuffers),
        1 => (1..8u8, 0..8u8).prop_map(|(tags, offload)| Op::Sleep { tags, offload: offload & tags }),
        1 => (0..8u8).prop_map(|tags| Op::Wake { tags }),
        1 => (1..3u64).prop_map(Op::GraphBegin),
        2 => (1..3u64, 0..SIZES.len()).prop_map(|(pool, size)| Op::GraphAlloc { pool, size }),
        1 => (1..3u64).prop_map(Op::GraphEnd),
        1 => (1..3u64).prop_map(Op::GraphRelease),
        1 => (1..3u64).prop_map(Op::GraphRetain),
        1 => (1..3u64).prop_map(Op::GraphEmptyCache),
        1 => (1..3u64).prop_map(Op::Checkpoint),
        1 => (1..3u64).prop_map(Op::Restore),
        1 => (0..FAULTS.len(), 1..3u64).prop_map(|(call, n)| Op::Fault { call, n }),
        1 => (2..12usize, 1..=STREAMS).prop_map(|(n, stream)| Op::Burst { n, stream }),
        1 => (0..2usize).prop_map(Op::RetireThread),
        1 => prop::option::weighted(0.7, prop::sample::select(vec![32u64, 96, 192]))
            .prop_map(Op::SetCap),
        1 => any::<bool>().prop_map(Op::History),
        1 => Just(Op::Snapshot),
        1 => Just(Op::ResetPeaks),
        2 => (any::<usize>(), any::<u64>()).prop_map(|(i, at)| Op::Lookup { i, at }),
        1 => Just(Op::ResetCounts),
    ]
}

pub fn overlaps(a: (u64, u64), b: (u64, u64)) -> bool {
    a.0 < b.0 + b.1 && b.0 < a.0 + a.1
}

pub fn canary(ptr: u64, len: u64, seed: u8) {
    let n = CANARY.min(len as usize);
    fill(ptr, n, seed);
    fill(ptr + len - n as u64, n, seed ^ 0x5a);
}

pub fn canary_ok(ptr: u64, len: u64, seed: u8) -> bool {
    let n = CANARY.min(len as usize);
    let mut head = vec![0u8; n];
    let mut tail = vec![0u8; n];
    for i in 0..n {
        head[i] = (i as u8).wrapping_mul(31).wrapping_add(seed);
        tail[i] = (i as u8).wrapping_mul(31).wrapping_add(seed ^ 0x5a);
    }
    read(ptr, n) == head && read(ptr + len - n as u64, n) == tail
}
