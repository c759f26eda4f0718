//! The C API that gpu-arena's PyTorch allocator (`python/gpu_arena/native/`) maps torch's
//! calls onto: graph pools (PyTorch's private pools for CUDA graphs and `MemPool`,
//! `alloc/src/pool/graphs/graph_pools.rs`), the stats resets, the segments view for snapshots, the
//! memory fraction, a free by pointer alone and the allocation containing a pointer.

use std::ffi::{c_int, c_void};

use gpu_arena::pool::MaxReserved;
use gpu_arena::{Error, GraphPoolId, PoolBlock, StreamId};

use crate::errors::{fail, guard, status, GPU_ARENA_OK};
use crate::init::{existing_pool, pool, with_pool};

/// A live block of a graph pool (`gpu_arena_graph_pool_blocks`,
/// `gpu_arena_graph_pool_restore`). Sizes in bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
#[allow(non_camel_case_types)]
pub struct gpu_arena_pool_block_t {
    /// Device address of the block.
    pub ptr: u64,
    /// Bytes asked for.
    pub requested: u64,
    /// Bytes the block serves (the request rounded up; ignored by restore).
    pub bytes: u64,
    /// The stream it was allocated on.
    pub stream: *mut c_void,
}

/// One arena as a segment of PyTorch's snapshot (`gpu_arena_segments`). Sizes in bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
#[allow(non_camel_case_types)]
pub struct gpu_arena_segment_t {
    /// Device address of its first byte.
    pub address: u64,
    /// Bytes.
    pub bytes: u64,
    /// The graph pool holding it (`in_graph_pool`), else 0, 0.
    pub pool_id0: u64,
    /// Second half of the graph pool's id.
    pub pool_id1: u64,
    /// Index of its first block in the blocks array.
    pub first_block: u64,
    /// Number of its blocks.
    pub block_count: u64,
    /// 1 when it holds small blocks (PyTorch's small pool).
    pub small: u8,
    /// 1 when it belongs to a graph pool.
    pub in_graph_pool: u8,
}

/// A range of a segment (`gpu_arena_segments`). Sizes in bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
#[allow(non_camel_case_types)]
pub struct gpu_arena_segment_block_t {
    /// Device address of its first byte.
    pub address: u64,
    /// Bytes.
    pub bytes: u64,
    /// Bytes asked for (0 for a free range).
    pub requested: u64,
    /// 1 when allocated.
    pub allocated: u8,
}

/// Record the failure of `call` on graph pool `(id0, id1)` of `device`; its error code.
fn pool_fail(call: &str, device: c_int, id0: u64, id1: u64, e: Error) -> c_int {
    fail(&format!("{call}(device={device}, pool=({id0}, {id1}))"), e)
}

/// A count or use count as the C `int` result.
fn count(n: u32) -> c_int {
    c_int::try_from(n).unwrap_or(c_int::MAX)
}

/// Create graph pool `(id0, id1)` on `device` or add a use of it (PyTorch's
/// `createOrIncrefPool`). Returns the use count after (>= 1), or a negative error code
/// (`(0, 0)`, torch's default pool, is refused).
#[no_mangle]
pub extern "C" fn gpu_arena_graph_pool_retain(device: c_int, id0: u64, id1: u64) -> c_int {
    const CALL: &str = "gpu_arena_graph_pool_retain";
    with_pool(CALL, |p| {
        p.graph_pool_retain(device, GraphPoolId(id0, id1))
            .map(count)
            .map_err(|e| pool_fail(CALL, device, id0, id1, e))
    })
}

/// Take a use of graph pool `(id0, id1)` (PyTorch's `releasePool`). Returns the use count
/// after (>= 0; at 0 its arenas holding no live block go at the next empty_cache), or a
/// negative error code (an unknown pool, or more releases than uses).
#[no_mangle]
pub extern "C" fn gpu_arena_graph_pool_release(device: c_int, id0: u64, id1: u64) -> c_int {
    const CALL: &str = "gpu_arena_graph_pool_release";
    with_pool(CALL, |p| {
        p.graph_pool_release(device, GraphPoolId(id0, id1))
            .map(count)
            .map_err(|e| pool_fail(CALL, device, id0, id1, e))
    })
}

/// The use count of graph pool `(id0, id1)`: 0 for a pool that does not exist.
#[no_mangle]
pub extern "C" fn gpu_arena_graph_pool_use_count(device: c_int, id0: u64, id1: u64) -> c_int {
    const CALL: &str = "gpu_arena_graph_pool_use_count";
    with_pool(CALL, |p| {
        p.graph_pool_use_count(device, GraphPoolId(id0, id1))
            .map(count)
            .map_err(|e| fail(CALL, e))
    })
}

/// Open a routing context for graph pool `(id0, id1)` (PyTorch's `beginAllocateToPool`):
/// creates the pool or adds a use; until the matching `gpu_arena_graph_pool_end`, gpu-arena
/// records and queries no event on `device` and refuses empty_cache, trim and sleep there
/// (a capture may be under way). Returns the use count after, or a negative error code.
#[no_mangle]
pub extern "C" fn gpu_arena_graph_pool_begin(device: c_int, id0: u64, id1: u64) -> c_int {
    const CALL: &str = "gpu_arena_graph_pool_begin";
    with_pool(CALL, |p| {
        p.graph_pool_begin(device, GraphPoolId(id0, id1))
            .map(count)
            .map_err(|e| pool_fail(CALL, device, id0, id1, e))
    })
}

/// Close a routing context of graph pool `(id0, id1)` (PyTorch's `endAllocateToPool`; the
/// use stays until `gpu_arena_graph_pool_release`). 0 or a negative error code.
#[no_mangle]
pub extern "C" fn gpu_arena_graph_pool_end(device: c_int, id0: u64, id1: u64) -> c_int {
    const CALL: &str = "gpu_arena_graph_pool_end";
    with_pool(CALL, |p| {
        p.graph_pool_end(device, GraphPoolId(id0, id1))
            .map(|()| GPU_ARENA_OK)
            .map_err(|e| pool_fail(CALL, device, id0, id1, e))
    })
}

/// Allocate `size` bytes on `device` for `stream` from graph pool `(id0, id1)`: the pool's
/// own memory, never the general pool's. Free it with `gpu_arena_free` like any block: it
/// goes back to its pool. NULL on failure (`gpu_arena_last_error_code()`:
/// `GPU_ARENA_ERR_OUT_OF_MEMORY` for lack of memory); `size == 0` returns NULL, no error.
#[no_mangle]
pub extern "C" fn gpu_arena_graph_pool_malloc(
    device: c_int,
    id0: u64,
    id1: u64,
    size: usize,
    stream: *mut c_void,
) -> *mut c_void {
    let mut out: *mut c_void = std::ptr::null_mut();
    guard("gpu_arena_graph_pool_malloc", || {
        let call = || {
            format!(
                "gpu_arena_graph_pool_malloc(device={device}, pool=({id0}, {id1}), size={size})"
            )
        };
        if size == 0 {
            return Ok(GPU_ARENA_OK);
        }
        let a = pool(&call())?
            .graph_pool_alloc(
                device,
                GraphPoolId(id0, id1),
                size as u64,
                StreamId(stream as u64),
            )
            .map_err(|e| fail(&call(), e))?;
        out = a.ptr as *mut c_void;
        Ok(GPU_ARENA_OK)
    });
    out
}

/// The live blocks of graph pool `(id0, id1)`, sorted by address: returns their number `n`
/// (also when above `cap`) and writes the first `min(n, cap)` to `out` (NULL when `cap` is
/// 0). A negative error code for an unknown pool.
#[no_mangle]
pub extern "C" fn gpu_arena_graph_pool_blocks(
    device: c_int,
    id0: u64,
    id1: u64,
    out: *mut gpu_arena_pool_block_t,
    cap: usize,
) -> libc::ssize_t {
    const CALL: &str = "gpu_arena_graph_pool_blocks";
    let mut n: libc::ssize_t = 0;
    let rc = guard(CALL, || {
        if out.is_null() && cap > 0 {
            return Err(fail(CALL, Error::invalid("out is NULL")));
        }
        let blocks = existing_pool(CALL)?
            .graph_pool_blocks(device, GraphPoolId(id0, id1))
            .map_err(|e| pool_fail(CALL, device, id0, id1, e))?;
        for (i, b) in blocks.iter().take(cap).enumerate() {
            let c = gpu_arena_pool_block_t {
                ptr: b.ptr,
                requested: b.requested,
                bytes: gpu_arena::pool::block_len(b.requested).unwrap_or(0),
                stream: b.stream.0 as *mut c_void,
            };
            // SAFETY: `out` holds `cap` entries (the header's contract) and i < cap.
            unsafe { out.add(i).write(c) };
        }
        n = libc::ssize_t::try_from(blocks.len()).unwrap_or(libc::ssize_t::MAX);
        Ok(GPU_ARENA_OK)
    });
    if rc < 0 {
        rc as libc::ssize_t
    } else {
        n
    }
}

/// Make graph pool `(id0, id1)`'s live blocks exactly the `n` blocks at `blocks` (by address,
/// request and stream; PyTorch's `setCheckpointPoolState`): live blocks not listed are freed,
/// listed blocks not live are allocated again at their own addresses (refused while their
/// tag sleeps). All or nothing: on an error nothing changed. 0 or a negative error code.
#[no_mangle]
pub extern "C" fn gpu_arena_graph_pool_restore(
    device: c_int,
    id0: u64,
    id1: u64,
    blocks: *const gpu_arena_pool_block_t,
    n: usize,
) -> c_int {
    const CALL: &str = "gpu_arena_graph_pool_restore";
    guard(CALL, || {
        if blocks.is_null() && n > 0 {
            return Err(fail(CALL, Error::invalid("blocks is NULL")));
        }
        let list: Vec<PoolBlock> = if n == 0 {
            Vec::new()
        } else {
            // SAFETY: `blocks` points to `n` readable entries (the header's contract).
            unsafe { std::slice::from_raw_parts(blocks, n) }
                .iter()
                .map(|b| PoolBlock {
                    ptr: b.ptr,
                    requested: b.requested,
                    stream: StreamId(b.stream as u64),
                })
                .collect()
        };
        existing_pool(CALL)?
            .graph_pool_restore(device, GraphPoolId(id0, id1), &list)
            .map(|()| GPU_ARENA_OK)
            .map_err(|e| pool_fail(CALL, device, id0, id1, e))
    })
}

/// Release graph pool `(id0, id1)`'s arenas that hold no live block if its use count is 0
/// (PyTorch's `emptyCache(mempool_id)`); like `gpu_arena_empty_cache` it synchronizes the
/// device and releases the general pool's empty arenas too. 0 or a negative error code.
#[no_mangle]
pub extern "C" fn gpu_arena_graph_pool_empty_cache(device: c_int, id0: u64, id1: u64) -> c_int {
    const CALL: &str = "gpu_arena_graph_pool_empty_cache";
    with_pool(CALL, |p| {
        p.graph_pool_empty_cache(device, GraphPoolId(id0, id1))
            .map(|_| GPU_ARENA_OK)
            .map_err(|e| pool_fail(CALL, device, id0, id1, e))
    })
}

/// Set the peaks of `device`'s counters (reserved, allocated, requested bytes) to their
/// current values (PyTorch's `reset_peak_memory_stats`). 0 or a negative error code.
#[no_mangle]
pub extern "C" fn gpu_arena_reset_peak_stats(device: c_int) -> c_int {
    const CALL: &str = "gpu_arena_reset_peak_stats";
    with_pool(CALL, |p| {
        p.reset_peak_stats(device)
            .map(|()| GPU_ARENA_OK)
            .map_err(|e| fail(CALL, e))
    })
}

/// Zero `device`'s counts of events: allocations and frees served, arenas created and
/// destroyed, out-of-memory failures, exports made (PyTorch's
/// `reset_accumulated_memory_stats`). 0 or a negative error code.
#[no_mangle]
pub extern "C" fn gpu_arena_reset_accumulated_stats(device: c_int) -> c_int {
    const CALL: &str = "gpu_arena_reset_accumulated_stats";
    with_pool(CALL, |p| {
        p.reset_accumulated_stats(device)
            .map(|()| GPU_ARENA_OK)
            .map_err(|e| fail(CALL, e))
    })
}

/// Every arena of `device` as a segment with its ranges, in address order (PyTorch's
/// snapshot): returns the number of segments (also when above `seg_cap`), writes the first
/// `min(n, seg_cap)` to `segs`, the total number of blocks to `*n_blocks`, and the blocks to
/// `blocks` while they fit `block_cap` (a segment's `first_block` and `block_count` index
/// them). Call again with larger arrays when either count is above its capacity. A negative
/// error code on failure.
#[no_mangle]
pub extern "C" fn gpu_arena_segments(
    device: c_int,
    segs: *mut gpu_arena_segment_t,
    seg_cap: usize,
    blocks: *mut gpu_arena_segment_block_t,
    block_cap: usize,
    n_blocks: *mut usize,
) -> libc::ssize_t {
    const CALL: &str = "gpu_arena_segments";
    let mut n: libc::ssize_t = 0;
    let rc = with_pool(CALL, |p| {
        if (segs.is_null() && seg_cap > 0) || (blocks.is_null() && block_cap > 0) {
            return Err(fail(
                CALL,
                Error::invalid("an array is NULL with a capacity above 0"),
            ));
        }
        let all = p.segments(device).map_err(|e| fail(CALL, e))?;
        let mut next = 0usize;
        for (i, s) in all.iter().enumerate() {
            if i < seg_cap {
                let (id0, id1) = s.graph_pool.map_or((0, 0), |g| (g.0, g.1));
                let c = gpu_arena_segment_t {
                    address: s.base,
                    bytes: s.bytes,
                    pool_id0: id0,
                    pool_id1: id1,
                    first_block: next as u64,
                    block_count: s.blocks.len() as u64,
                    small: u8::from(s.small),
                    in_graph_pool: u8::from(s.graph_pool.is_some()),
                };
                // SAFETY: `segs` holds `seg_cap` entries (the header's contract), i < seg_cap.
                unsafe { segs.add(i).write(c) };
            }
            for b in &s.blocks {
                if next < block_cap {
                    let c = gpu_arena_segment_block_t {
                        address: b.ptr,
                        bytes: b.bytes,
                        requested: b.requested,
                        allocated: u8::from(b.allocated),
                    };
                    // SAFETY: `blocks` holds `block_cap` entries, next < block_cap.
                    unsafe { blocks.add(next).write(c) };
                }
                next += 1;
            }
        }
        if !n_blocks.is_null() {
            // SAFETY: non-null, a writable `size_t` (the header's contract).
            unsafe { n_blocks.write(next) };
        }
        n = libc::ssize_t::try_from(all.len()).unwrap_or(libc::ssize_t::MAX);
        Ok(GPU_ARENA_OK)
    });
    if rc < 0 {
        rc as libc::ssize_t
    } else {
        n
    }
}

/// Free `ptr` without its size or device (PyTorch's deleters know only the pointer): the
/// checks of `gpu_arena_free_checked` but the size's. Freeing NULL does nothing. 0 or a
/// negative error code (an unknown pointer or a double free changes nothing).
#[no_mangle]
pub extern "C" fn gpu_arena_free_unsized(ptr: *mut c_void) -> c_int {
    const CALL: &str = "gpu_arena_free_unsized";
    guard(CALL, || {
        if ptr.is_null() {
            return Ok(GPU_ARENA_OK);
        }
        status(
            || format!("{CALL}(ptr={ptr:p})"),
            existing_pool(CALL)?.free(ptr as u64),
        )
    })
}

/// The live allocation containing `ptr` (its first byte or any byte inside): its start in
/// `*base`, the bytes asked for in `*requested` and its device in `*device` (each out
/// pointer may be NULL). 0, or a negative error code (`GPU_ARENA_ERR_UNKNOWN_POINTER` when
/// no live allocation contains it).
#[no_mangle]
pub extern "C" fn gpu_arena_allocation_of(
    ptr: *const c_void,
    base: *mut *mut c_void,
    requested: *mut usize,
    device: *mut c_int,
) -> c_int {
    const CALL: &str = "gpu_arena_allocation_of";
    guard(CALL, || {
        let (start, req, dev) = existing_pool(CALL)?
            .allocation_containing(ptr as u64)
            .map_err(|e| fail(&format!("{CALL}(ptr={ptr:p})"), e))?;
        // SAFETY: each out pointer is NULL or a writable object of its type (the header's
        // contract); NULL ones are skipped.
        unsafe {
            if !base.is_null() {
                base.write(start as *mut c_void);
            }
            if !requested.is_null() {
                requested.write(req as usize);
            }
            if !device.is_null() {
                device.write(dev);
            }
        }
        Ok(GPU_ARENA_OK)
    })
}

/// Cap `device`'s reserved bytes at `fraction` of its memory from now on (PyTorch's
/// `set_per_process_memory_fraction`): a growth past it fails as out of memory. `fraction`
/// in [0, 1]; 1 lifts the configuration's cap too, 0 allows no growth. Memory reserved
/// already stays. 0 or a negative error code (a bad fraction changes nothing).
#[no_mangle]
pub extern "C" fn gpu_arena_set_memory_fraction(device: c_int, fraction: f64) -> c_int {
    const CALL: &str = "gpu_arena_set_memory_fraction";
    with_pool(CALL, |p| {
        // 0 (PyTorch allows it): no growth at all; a cap of 0 bytes is refused as a setting.
        let f = if fraction == 0.0 {
            f64::MIN_POSITIVE
        } else {
            fraction
        };
        let cap = (f != 1.0).then_some(MaxReserved::Fraction(f));
        p.set_max_reserved(device, cap)
            .map(|()| GPU_ARENA_OK)
            .map_err(|e| fail(&format!("{CALL}(device={device}, fraction={fraction})"), e))
    })
}
