//! Block sizes: the length of the range serving a request ([`block_len`], 512-byte granules,
//! quarter-octave classes up to [`LARGE_MIN`], [`LARGE_ROUND`] multiples above), and the
//! block sizes the exact-size caches keep whole ([`CACHE_MAX_BLOCK`]) and give back first
//! on a miss ([`FLUSH_FIRST_ABOVE`]). The rules they serve are `pool/mod.rs`'s module docs.

use crate::backend::DeviceId;
use crate::error::{Error, Result};
use crate::range;

/// Requests above this many bytes are rejected as absurd (256 TiB).
pub const MAX_REQUEST_BYTES: u64 = 1 << 48;

const MIB: u64 = 1 << 20;

/// Requests above this many bytes are *large* (PyTorch's small/large pool boundary).
pub const LARGE_MIN: u64 = MIB;

/// Large requests are rounded up to a multiple of this many bytes.
pub const LARGE_ROUND: u64 = 2 * MIB;

/// The length of the range serving a request of `bytes`: 512-byte granules, and
/// [`LARGE_ROUND`] multiples above [`LARGE_MIN`], so that large blocks tile the arenas in
/// 2 MiB units and every gap they leave fits another large block (odd-sized large blocks
/// left sub-2 MiB holes between KV blocks that no KV block could use). `None` on overflow.
pub fn block_len(bytes: u64) -> Option<u64> {
    let len = range::round_up(bytes)?;
    if len > LARGE_MIN {
        range::round_up_to(len, LARGE_ROUND)
    } else if len > SMALL_EXACT {
        // Quarter-octave size classes: at most 25% rounding, few distinct sizes, so a freed
        // block of the class serves the next request of it from the exact-size cache.
        let step = (1u64 << (63 - len.leading_zeros())) / 4;
        range::round_up_to(len, step)
    } else {
        Some(len)
    }
}

/// The block length serving a request of `bytes` on `device`, or a clear error.
pub(crate) fn request_len(device: DeviceId, bytes: u64) -> Result<u64> {
    if bytes == 0 || bytes > MAX_REQUEST_BYTES {
        return Err(Error::invalid(format!(
            "alloc of {bytes} bytes on device {device}: size must be between 1 and {MAX_REQUEST_BYTES}"
        )));
    }
    block_len(bytes).ok_or_else(|| Error::invalid("size overflows"))
}

/// Requests up to this many bytes round to 512 only; between it and [`LARGE_MIN`] they
/// round to quarter-octave classes.
pub const SMALL_EXACT: u64 = 4096;

/// Freed blocks up to this size are kept whole for exact-size reuse on their stream.
pub const CACHE_MAX_BLOCK: u64 = 64 * MIB;

/// On a miss, cached blocks longer than this go back to the sub-allocator first, and the
/// rest only if that was not enough. Large blocks are few and rarely reused at their exact
/// size, and held whole they keep the contiguous space a differently sized large request
/// needs; the many small ones (KV blocks) are the cache's hits. Flushing everything on
/// every such miss turned the next thousand hits into sub-allocator calls and, on the KV
/// trace, made a second replay grow an 18th 1 GiB arena; not caching large blocks at all
/// let small allocations carve up the holes they leave, which with 64 or 256 MiB arenas
/// cost up to 1.8x reserved/live (`bench/results/sim-2026-11-29.md`).
pub const FLUSH_FIRST_ABOVE: u64 = 8 * MIB;
