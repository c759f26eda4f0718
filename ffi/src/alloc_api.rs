//! The calls PyTorch's pluggable allocator loads and the pool's basic calls: malloc, free,
//! `record_stream`, reset and `empty_cache`, stats, validate, the device count, the backend's
//! name, the JSON snapshot, and freeing a string gpu-arena returned.

use std::ffi::{c_char, c_int, c_void, CString};
use std::panic::catch_unwind;
use std::sync::Arc;

use gpu_arena::{Error, Pool, PoolStats, StreamId};

use crate::errors::{fail, guard, status, GPU_ARENA_OK};
use crate::init::{existing_pool, pool, with_pool, POOL};

/// The size as u64, or the error recorded under the call's name (built only on error: the
/// hot path formats nothing).
fn check_size(call: impl Fn() -> String, size: isize) -> std::result::Result<u64, c_int> {
    u64::try_from(size)
        .map_err(|_| fail(&call(), Error::invalid(format!("size {size} is negative"))))
}

/// The pool, fast when initialized, else `lazy` (`pool` or `existing_pool`); the call's
/// name is built only then.
fn pool_for(
    call: impl Fn() -> String,
    lazy: fn(&str) -> std::result::Result<&'static Arc<Pool>, c_int>,
) -> std::result::Result<&'static Arc<Pool>, c_int> {
    match POOL.get() {
        Some(Ok(p)) => Ok(p),
        _ => lazy(&call()),
    }
}

/// Allocate `size` bytes on `device` for use on `stream` (PyTorch's pluggable `alloc`).
/// Returns NULL on failure (see `gpu_arena_last_error()`); `size == 0` returns NULL and is
/// not an error. Initializes gpu-arena on first use (see `gpu_arena_init`).
#[no_mangle]
pub extern "C" fn gpu_arena_malloc(
    size: libc::ssize_t,
    device: c_int,
    stream: *mut c_void,
) -> *mut c_void {
    let mut out: *mut c_void = std::ptr::null_mut();
    guard("gpu_arena_malloc", || {
        let call = || format!("gpu_arena_malloc(size={size}, device={device})");
        let size = check_size(call, size)?;
        if size == 0 {
            return Ok(GPU_ARENA_OK);
        }
        let a = pool_for(call, pool)?
            .alloc(device, size, StreamId(stream as u64))
            .map_err(|e| fail(&call(), e))?;
        out = a.ptr as *mut c_void;
        Ok(GPU_ARENA_OK)
    });
    out
}

/// Free a pointer from `gpu_arena_malloc` (PyTorch's pluggable `free`). `size` and `device`
/// must be those of the allocation; a mismatch, an unknown pointer or a double free is
/// refused (see `gpu_arena_last_error()`) and changes nothing. Freeing NULL does nothing.
#[no_mangle]
pub extern "C" fn gpu_arena_free(
    ptr: *mut c_void,
    size: libc::ssize_t,
    device: c_int,
    stream: *mut c_void,
) {
    let _ = stream;
    gpu_arena_free_checked(ptr, size, device);
}

/// `gpu_arena_free` returning its status: 0, or a negative error code.
#[no_mangle]
pub extern "C" fn gpu_arena_free_checked(
    ptr: *mut c_void,
    size: libc::ssize_t,
    device: c_int,
) -> c_int {
    guard("gpu_arena_free", || {
        if ptr.is_null() {
            return Ok(GPU_ARENA_OK);
        }
        let call = || format!("gpu_arena_free(ptr={ptr:p}, size={size}, device={device})");
        let size = check_size(call, size)?;
        status(
            call,
            pool_for(call, existing_pool)?.free_checked(ptr as u64, size, device),
        )
    })
}

/// Mark `ptr` as used on `stream` too (PyTorch's `record_stream` hook): after free, its
/// memory is reused only once the work queued on `stream` has completed.
#[no_mangle]
pub extern "C" fn gpu_arena_record_stream(ptr: *mut c_void, stream: *mut c_void) {
    gpu_arena_record_stream_checked(ptr, stream);
}

/// `gpu_arena_record_stream` returning its status.
#[no_mangle]
pub extern "C" fn gpu_arena_record_stream_checked(ptr: *mut c_void, stream: *mut c_void) -> c_int {
    const CALL: &str = "gpu_arena_record_stream";
    guard(CALL, || {
        status(
            || format!("{CALL}(ptr={ptr:p})"),
            existing_pool(CALL)?.record_stream(ptr as u64, StreamId(stream as u64)),
        )
    })
}

/// PyTorch's `reset` hook (`torch.cuda.empty_cache()`): release every unused arena of every
/// device.
#[no_mangle]
pub extern "C" fn gpu_arena_reset() {
    gpu_arena_empty_cache(-1);
}

/// Synchronize and destroy every arena of `device` (-1: all devices) that holds no live
/// allocation and no share. Pinned arenas stay (recycled). Initializes lazily.
#[no_mangle]
pub extern "C" fn gpu_arena_empty_cache(device: c_int) -> c_int {
    with_pool("gpu_arena_empty_cache", |p| {
        let which = match device {
            -1 => None,
            d => Some(d),
        };
        status(
            || format!("gpu_arena_empty_cache(device={device})"),
            p.empty_cache(which).map(drop),
        )
    })
}

/// Fill `*out` with the counters of `device`. Initializes lazily (then all counters are 0).
#[no_mangle]
pub extern "C" fn gpu_arena_stats(device: c_int, out: *mut PoolStats) -> c_int {
    guard("gpu_arena_stats", || {
        // The NULL check first: a bad argument is reported before a missing init.
        if out.is_null() {
            return Err(fail("gpu_arena_stats", Error::invalid("out is NULL")));
        }
        let s = pool("gpu_arena_stats")?
            .stats(device)
            .map_err(|e| fail(&format!("gpu_arena_stats(device={device})"), e))?;
        // SAFETY: `out` is non-null and, per the header, points to a writable
        // gpu_arena_stats_t (generated from `PoolStats`: the same layout).
        unsafe { out.write(s) };
        Ok(GPU_ARENA_OK)
    })
}

/// Check every invariant of `device`'s pool; 0 when they all hold. Initializes lazily.
#[no_mangle]
pub extern "C" fn gpu_arena_validate(device: c_int) -> c_int {
    with_pool("gpu_arena_validate", |p| {
        status(
            || format!("gpu_arena_validate(device={device})"),
            p.validate(device),
        )
    })
}

/// Number of devices of the backend, or a negative error code. Initializes lazily.
#[no_mangle]
pub extern "C" fn gpu_arena_device_count() -> c_int {
    with_pool("gpu_arena_device_count", |p| {
        Ok(c_int::try_from(p.device_count()).unwrap_or(c_int::MAX))
    })
}

/// The backend's name (`"sim"`, `"cuda"`, `"hip"`), or `""` before init (it does not
/// initialize). Never NULL.
#[no_mangle]
pub extern "C" fn gpu_arena_backend_name() -> *const c_char {
    let name = catch_unwind(|| match POOL.get() {
        Some(Ok(p)) => match p.backend().name() {
            "sim" => c"sim",
            "cuda" => c"cuda",
            "hip" => c"hip",
            _ => c"other",
        },
        _ => c"",
    });
    name.unwrap_or(c"other").as_ptr()
}

/// A JSON snapshot of every arena and range. Free it with `gpu_arena_string_free`.
/// NULL on error. Initializes lazily.
#[no_mangle]
pub extern "C" fn gpu_arena_snapshot_json() -> *mut c_char {
    let mut out = std::ptr::null_mut();
    with_pool("gpu_arena_snapshot_json", |p| {
        let s = CString::new(p.snapshot_json()).map_err(|_| {
            fail(
                "gpu_arena_snapshot_json",
                Error::Internal("NUL in JSON".into()),
            )
        })?;
        out = s.into_raw();
        Ok(GPU_ARENA_OK)
    });
    out
}

/// Free a string returned by gpu-arena. NULL does nothing.
#[no_mangle]
pub extern "C" fn gpu_arena_string_free(s: *mut c_char) {
    if s.is_null() {
        return;
    }
    let _ = catch_unwind(|| {
        // SAFETY: non-null strings passed here come from `CString::into_raw` in this library
        // (the header says so); ownership returns to Rust exactly once.
        drop(unsafe { CString::from_raw(s) });
    });
}
