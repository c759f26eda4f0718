//! How much memory a growing arena maps (`pool/growth/`: arenas that grow with the work,
//! issue #24), and which blocks are cached whole when arenas grow: pure functions of sizes.
//!
//! How much a growth maps ([`growth_step`], chosen by replaying the recorded PyTorch loops
//! and the KV traces, `bench/results/sim-2026-12-02-growth.md`): a request of at least
//! [`EXACT_GROWTH_MIN`] maps exactly its shortfall (training's activations: reserved stays
//! at live); while the arena holds less than [`GROWTH_FINE_BELOW`] a smaller request maps
//! at most [`GROWTH_SMALL_STEP`] beyond its shortfall (a small program reserves what it uses
//! and a few pages); past that a smaller
//! request maps at least a quarter of what the arena already holds (KV blocks: about a
//! hundred chunks for tens of GiB, not thousands; each chunk is a driver allocation of
//! about 50 us, and one fd when the arena is shared).

use super::blocks::CACHE_MAX_BLOCK;
use super::classes::{Class, GENERAL};
use crate::range;

const MIB: u64 = 1 << 20;

/// Requests of at least this many bytes grow an arena by exactly their shortfall.
pub const EXACT_GROWTH_MIN: u64 = 8 * MIB;

/// With growing arenas, freed blocks up to [`GROWING_CACHE_MAX`] are cached whole for
/// exact-size reuse (the thread caches and the device's); larger ones go straight back to
/// their arena's free ranges, where they coalesce at once, as in PyTorch.
pub fn cache_max(grow_arenas: bool) -> u64 {
    if grow_arenas {
        GROWING_CACHE_MAX
    } else {
        CACHE_MAX_BLOCK
    }
}

/// The largest block cached with growing arenas: one 2 MiB page (a KV block; every small
/// block). Cached, larger temporaries held the room that other sizes then missed: the KV
/// trace's cold replay missed 639 times with 64 MiB (each miss flushing every cache and
/// settling the streams: 1.9x the time of 1 GiB arenas on sim), 190 times with 8 MiB and
/// none warm; and the small training and generation loops kept holes between cached blocks
/// (1.32 / 1.39 of live with 8 MiB, 1.12 / 1.21 with 2 MiB on sim; 1.36 / 1.39 on the H200
/// with 8 MiB). The KV trace runs as fast with 2 MiB as with 8. At most one cached block
/// per length and stream above 2 MiB was tried: 1.22 / 1.21 on the small loops, 1.03 on
/// medium training (bench/results/sim-2026-12-02-growth.md).
pub const GROWING_CACHE_MAX: u64 = 2 * MIB;

/// A smaller request grows an arena by at least its mapped bytes over this, once it holds
/// [`GROWTH_FINE_BELOW`].
pub const GROWTH_DIVISOR: u64 = 4;

/// Until an arena holds this many bytes a smaller request maps its shortfall, or what the
/// arena holds up to [`GROWTH_SMALL_STEP`]: a small program reserves its live bytes plus at
/// most that step (and the 2 MiB rounding of its large blocks).
pub const GROWTH_FINE_BELOW: u64 = 64 * MIB;

/// The most a smaller request maps beyond its shortfall while the arena holds less than
/// [`GROWTH_FINE_BELOW`]: 2 MiB KV blocks reach 64 MiB in 9 growths, not 31 (each a driver
/// allocation, and a file descriptor when the arena is shared).
pub const GROWTH_SMALL_STEP: u64 = 8 * MIB;

/// The most one growth maps for a small request (its shortfall may be more).
pub const GROWTH_MAX_STEP: u64 = 1024 * MIB;

/// Bytes to map for a request of `len` that finds `tail` free bytes at the end of an arena
/// holding `mapped` bytes (0 for a new arena): a multiple of `granularity` that covers the
/// shortfall. `None` on overflow.
pub fn growth_step(mapped: u64, tail: u64, len: u64, granularity: u64) -> Option<u64> {
    let short = len.saturating_sub(tail).max(1);
    let step = if len >= EXACT_GROWTH_MIN {
        short
    } else if mapped < GROWTH_FINE_BELOW {
        short.max(mapped.min(GROWTH_SMALL_STEP))
    } else {
        short.max((mapped / GROWTH_DIVISOR).min(GROWTH_MAX_STEP))
    };
    range::round_up_to(step, granularity)
}

/// Bytes of a new growing arena's first chunk for a request of `len` when the class's
/// arenas hold `class_bytes`: the request (exactly) for the class's first arena, and after
/// its growing arena went (`empty_cache`, `trim`: pass 0); while the class's growing arena
/// cannot grow (shared, observed, full), at least what the class holds, up to
/// [`GROWTH_MAX_STEP`], so that a program sharing block after block makes arenas of doubling
/// sizes (a dozen for 2 GiB of 2 MiB blocks), not one arena and one export per block.
pub fn first_chunk(class_bytes: u64, len: u64, granularity: u64) -> Option<u64> {
    let step = growth_step(0, 0, len, granularity)?;
    range::round_up_to(step.max(class_bytes.min(GROWTH_MAX_STEP)), granularity)
}

/// Whether blocks of `class` live in growing arenas (when the pool grows arenas at all).
pub(crate) fn grows(class: Class) -> bool {
    !class.small && class.pool == GENERAL
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_requests_map_their_shortfall_small_ones_a_quarter() {
        let g = 2 * MIB;
        // A 32 MiB request with 10 MiB free at the end maps 22 MiB.
        assert_eq!(
            growth_step(1024 * MIB, 10 * MIB, 32 * MIB, g),
            Some(22 * MIB)
        );
        // A 2 MiB KV block in an arena of 4 GiB maps 1 GiB; in a new arena 2 MiB; in a
        // small one what it holds, up to 8 MiB.
        assert_eq!(growth_step(4096 * MIB, 0, 2 * MIB, g), Some(1024 * MIB));
        assert_eq!(growth_step(0, 0, 2 * MIB, g), Some(2 * MIB));
        assert_eq!(growth_step(4 * MIB, 0, 2 * MIB, g), Some(4 * MIB));
        assert_eq!(growth_step(62 * MIB, 0, 2 * MIB, g), Some(8 * MIB));
        assert_eq!(growth_step(62 * MIB, 0, 6 * MIB, g), Some(8 * MIB));
        assert_eq!(growth_step(400 * MIB, MIB, 2 * MIB, g), Some(100 * MIB));
        // Always a granularity multiple covering the shortfall.
        assert_eq!(growth_step(0, 0, 9 * MIB + 1, g), Some(10 * MIB));
        assert_eq!(growth_step(0, 0, 1, g), Some(2 * MIB));
    }

    #[test]
    fn arenas_after_the_first_double_up_to_the_largest_step() {
        let g = 2 * MIB;
        assert_eq!(first_chunk(0, 2 * MIB, g), Some(2 * MIB));
        assert_eq!(first_chunk(6 * MIB, 2 * MIB, g), Some(6 * MIB));
        assert_eq!(first_chunk(6 * MIB, 40 * MIB, g), Some(40 * MIB));
        assert_eq!(first_chunk(64 << 30, 2 * MIB, g), Some(GROWTH_MAX_STEP));
    }
}
