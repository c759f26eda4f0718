//! Size classes: small blocks (up to [`LARGE_MIN`], PyTorch's small/large boundary), large
//! blocks and huge blocks (above [`HUGE_MIN`]) never share an arena, so a few small tensors
//! cannot pin a large arena, and large temporaries do not have to find room in the holes
//! that KV blocks leave.
//!
//! Each (tag, class) has its own sub-allocator ([`Class::index`] into
//! `DeviceState::ranges`) and its own arenas:
//! - **small** arenas are [`SMALL_ARENA`] bytes, rounded up to the backend granularity
//!   (PyTorch's small segment): after `empty_cache` (or `trim`) a small survivor keeps at
//!   most its own 2 MiB arena, and small blocks allocated together share arenas (600 live
//!   4 KiB blocks hold 4 MiB). Shared, small blocks cost one export per 2 MiB arena they
//!   touch (like PyTorch's one IPC handle per segment);
//! - **large** arenas are `arena_size` bytes (a block larger than that gets its own). A
//!   large survivor keeps its whole arena after a plain `empty_cache` (safe with work in
//!   flight): an arena is one physical allocation and one export when shared. `trim`
//!   (`pool/growth/trim.rs`, at an idle point) cuts such an arena down to the 2 MiB pages its
//!   survivors touch, each run of pages an arena of its own: large blocks are 2 MiB
//!   multiples at 2 MiB offsets, so they then keep exactly their bytes. The choices, and
//!   the bounds they give, are in docs/ARCHITECTURE.md ("Survivors after empty_cache").
//!
//! - **huge** arenas (blocks above [`HUGE_MIN`]) are `arena_size` bytes too (or the block's
//!   own size when larger), holding only huge blocks. Among 2 MiB KV blocks, a freed 256 MiB
//!   temporary's range was soon split by KV blocks and the next one needed a fresh arena:
//!   the second KV trace (`TraceConfig::long_context`) reserved 1.34x its live bytes on sim,
//!   1.03x with this class (PyTorch: 1.08 on the H200). A huge-class miss takes back only
//!   huge blocks from the thread caches (see `DeviceState::flush_cached_above`).
//!
//! A miss in one class flushes and settles only that class's cached blocks and free ranges:
//! small misses are frequent (a 2 MiB arena fills quickly), and moving the large class's
//! ranges on each of them changed its placement (one more 1 GiB arena on the KV trace). A
//! small class below [`SMALL_GROW_FREELY`] grows instead of flushing at all.

use super::blocks::LARGE_MIN;
use crate::range;

const MIB: u64 = 1 << 20;

/// Bytes of a small arena (rounded up to the backend's granularity).
pub const SMALL_ARENA: u64 = 2 * MIB;

/// Until a (device, tag)'s small arenas hold this many bytes, a small miss grows the class
/// by a new small arena rather than flushing the class's cached blocks and settling its
/// streams. Small misses are frequent in 2 MiB arenas, and each flush turned the cache's
/// next hits into sub-allocator calls: the KV replay ran about 20% slower; with this it
/// runs as before for 18 MiB more at peak (bench/results/sim-2026-11-30-small-survivors.md).
/// `empty_cache` still flushes everything and releases every empty small arena.
pub const SMALL_GROW_FREELY: u64 = 32 * MIB;

/// A sub-allocator: a graph pool (or the general pool), a tag and a size class.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Class {
    /// The graph pool's slot (`pool/graphs/graph_pools.rs`), [`GENERAL`] for the general pool.
    pub(crate) pool: u16,
    /// The tag index (`crate::tags`); always 0 in a graph pool.
    pub(crate) tag: u8,
    /// Blocks up to [`LARGE_MIN`] bytes.
    pub(crate) small: bool,
    /// Blocks above [`HUGE_MIN`] bytes.
    pub(crate) huge: bool,
}

/// With arenas that grow (`pool/growth/grow.rs`) no block is huge: one growing arena holds
/// large and huge blocks alike, and a huge temporary's range coalesces with its neighbours
/// (the recorded PyTorch loops reserved 1.03 of live that way, 1.08-1.15 with the huge
/// class apart: `bench/results/sim-2026-12-02-growth.md`).
pub const NO_HUGE: u64 = u64::MAX;

/// Blocks above this many bytes are *huge*: arenas of their own class. 64 MiB on the
/// measurements (bench/results/sim-2026-11-30-huge-class.md): from 8 to 32 MiB the repo's
/// KV trace grew one more 1 GiB arena; 128 MiB let the second trace grow in its third replay.
pub const HUGE_MIN: u64 = 64 * MIB;

impl Class {
    /// The class serving a block of `len` bytes (a [`block_len`](super::blocks::block_len)) with tag `tag`,
    /// blocks above `huge_min` being huge (`DeviceState::huge_min`: [`HUGE_MIN`] with arenas
    /// of fixed size, none when they grow).
    #[inline]
    pub(crate) fn of(tag: u8, len: u64, huge_min: u64) -> Class {
        Class {
            pool: GENERAL,
            tag,
            small: len <= LARGE_MIN,
            huge: len > huge_min,
        }
    }

    /// The class serving a block of `len` bytes in graph pool `slot` (not [`GENERAL`]).
    pub(crate) fn in_graph_pool(slot: u16, len: u64) -> Class {
        Class {
            pool: slot,
            ..Class::of(0, len, HUGE_MIN)
        }
    }

    /// Its index in `DeviceState::ranges`: the general pool's (tag, class) first, then
    /// three per graph pool slot (whose blocks carry tag 0).
    #[inline]
    pub(crate) fn index(self) -> usize {
        let row = if self.pool == GENERAL {
            usize::from(self.tag)
        } else {
            crate::tags::MAX_TAGS + usize::from(self.pool) - 1
        };
        row * 3 + usize::from(self.small) + 2 * usize::from(self.huge)
    }
}

/// `Class::pool` of the general pool (every allocation outside a graph pool).
pub(crate) const GENERAL: u16 = 0;

/// Bytes of a graph pool's arena for large blocks up to half of it (larger blocks get an
/// arena of their own size). A graph pool holds one capture's (or a few captures')
/// temporaries and outputs, and many pools may live at once (one per graph unless they
/// share): a regular `arena_size` arena each would reserve a GiB per graph. PyTorch's
/// private pools use 20 MiB segments for blocks up to 10 MiB.
pub const GRAPH_POOL_ARENA: u64 = 32 * MIB;

/// The size of the arena to create for a block of `len` bytes of `class`: a small arena,
/// an arena of its own for a block larger than `arena_bytes`, else a regular arena of
/// `arena_bytes` (in a graph pool: [`GRAPH_POOL_ARENA`], or the block's own size above
/// half of it). A multiple of `granularity`; `None` on overflow.
pub(crate) fn arena_bytes_for(
    class: Class,
    len: u64,
    arena_bytes: u64,
    granularity: u64,
) -> Option<u64> {
    if class.small {
        range::round_up_to(SMALL_ARENA, granularity)
    } else if class.pool != GENERAL && len <= GRAPH_POOL_ARENA / 2 {
        // Never smaller than the block (an `arena_size` below it would be).
        range::round_up_to(GRAPH_POOL_ARENA.min(arena_bytes).max(len), granularity)
    } else if class.pool != GENERAL || len > arena_bytes {
        range::round_up_to(len, granularity)
    } else {
        Some(arena_bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_split_at_large_min() {
        assert!(Class::of(3, 512, HUGE_MIN).small);
        assert!(Class::of(3, LARGE_MIN, HUGE_MIN).small);
        assert!(!Class::of(3, LARGE_MIN + 2 * MIB, HUGE_MIN).small);
        assert_ne!(
            Class::of(3, 512, HUGE_MIN).index(),
            Class::of(3, 4 * MIB, HUGE_MIN).index()
        );
        assert_ne!(
            Class::of(3, 512, HUGE_MIN).index(),
            Class::of(4, 512, HUGE_MIN).index()
        );
    }

    #[test]
    fn graph_pools_have_sub_allocators_of_their_own() {
        let general: Vec<usize> = (0..crate::tags::MAX_TAGS as u8)
            .flat_map(|t| [512, 4 * MIB, 128 * MIB].map(|l| Class::of(t, l, HUGE_MIN).index()))
            .collect();
        let mut seen = std::collections::HashSet::new();
        for slot in 1..=4u16 {
            for len in [512, 4 * MIB, 128 * MIB] {
                let i = Class::in_graph_pool(slot, len).index();
                assert!(
                    !general.contains(&i),
                    "slot {slot} len {len} shares index {i}"
                );
                assert!(seen.insert(i), "two graph pool classes share index {i}");
            }
        }
    }

    #[test]
    fn graph_pool_arenas_are_small_or_the_block_s_own() {
        let g = 2 * MIB;
        let pool = |len| arena_bytes_for(Class::in_graph_pool(1, len), len, 1024 * MIB, g);
        assert_eq!(pool(4 * MIB), Some(GRAPH_POOL_ARENA));
        assert_eq!(pool(20 * MIB), Some(20 * MIB));
        assert_eq!(pool(512), Some(SMALL_ARENA));
        let general = arena_bytes_for(Class::of(0, 4 * MIB, HUGE_MIN), 4 * MIB, 1024 * MIB, g);
        assert_eq!(general, Some(1024 * MIB));
        // An `arena_size` below the block (found by pool_model.rs: 8 MiB arenas, a 10 MiB
        // block of a graph pool: "fresh arena cannot fit", an internal error).
        let small = |len| arena_bytes_for(Class::in_graph_pool(1, len), len, 8 * MIB, g);
        assert_eq!(small(4 * MIB), Some(8 * MIB));
        assert_eq!(small(10 * MIB), Some(10 * MIB));
    }
}
