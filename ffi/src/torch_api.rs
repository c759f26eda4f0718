//! The C API's PyTorch helpers: an allocation function that raises instead of returning
//! NULL (for `change_current_allocator`), the message it raises with, and the allocation
//! history (`gpu_arena.torch.record_memory_history` / `memory_snapshot`).
//!
//! **Why a C++ shim.** PyTorch's `CUDAPluggableAllocator` never checks the pointer its
//! `alloc` function returns: NULL becomes a tensor at address 0 and the next kernel fails
//! with `cudaErrorIllegalAddress`. A C++ exception thrown by `alloc` does reach Python
//! (nothing on that path is `noexcept`; PyTorch turns it into `RuntimeError`). Rust cannot
//! throw a C++ exception, and a Rust panic must not cross `extern "C"`. So
//! `src/oom_shim.cpp` (built by `build.rs`) calls the plain `gpu_arena_malloc` (which never
//! unwinds), and on NULL with `size > 0` throws `std::runtime_error` on its own side, with
//! the message of [`gpu_arena_alloc_error_message`].
//!
//! The exported symbol is [`gpu_arena_torch_malloc`], a Rust function of ABI `"C-unwind"`
//! that only calls the C++ function: rustc exports only Rust-defined symbols from a cdylib
//! (its version script hides the C++ object's), and `"C-unwind"` is what makes a foreign
//! exception passing through this frame defined behaviour (the frame owns nothing to drop).
//! It needs `panic = "unwind"` (the workspace's setting): with `panic = "abort"` a C++
//! exception reaching a Rust frame aborts.

use std::ffi::{c_char, c_int, c_void, CString};

use gpu_arena::history;
use gpu_arena::units::format_size;

use crate::errors::{guard, GPU_ARENA_ERR_OUT_OF_MEMORY, GPU_ARENA_OK, LAST_CODE, LAST_ERROR};
use crate::init::{with_pool, POOL};

extern "C-unwind" {
    /// `src/oom_shim.cpp`: `gpu_arena_malloc`, throwing `std::runtime_error` on failure.
    fn gpu_arena_torch_malloc_cxx(
        size: libc::ssize_t,
        device: c_int,
        stream: *mut c_void,
    ) -> *mut c_void;
}

/// `gpu_arena_malloc` that throws a C++ `std::runtime_error` instead of returning NULL when
/// `size > 0` (PyTorch's `change_current_allocator` route, where NULL would crash the GPU).
/// The message starts with "CUDA out of memory." for lack of memory (what vLLM and other
/// tools match), and names the size, the device, gpu-arena's reserved and allocated bytes
/// and the cause (`gpu_arena_alloc_error_message`). Other failures throw with their own
/// message. `size == 0` returns NULL. Only C++ callers can catch the exception: call
/// `gpu_arena_malloc` from C.
#[no_mangle]
pub extern "C-unwind" fn gpu_arena_torch_malloc(
    size: libc::ssize_t,
    device: c_int,
    stream: *mut c_void,
) -> *mut c_void {
    // SAFETY: a C++ function with exactly this signature (src/oom_shim.cpp); it takes no
    // pointer it dereferences (`stream` is passed through as a handle). It may unwind with a
    // C++ exception, which this "C-unwind" frame lets through to the caller.
    unsafe { gpu_arena_torch_malloc_cxx(size, device, stream) }
}

/// The message for the calling thread's failed `gpu_arena_malloc(size, device)`, built from
/// its last error (read first, and left as it was). For lack of memory:
/// `"CUDA out of memory. Tried to allocate 400.00 GiB (429496729600 bytes) on device 0
/// with gpu-arena (reserved by gpu-arena: ..., allocated: ...). Cause: <last error>"`;
/// otherwise `"gpu-arena: allocation of N bytes on device D failed: <last error>"`.
/// Free it with `gpu_arena_string_free`. NULL only if the message cannot be built.
#[no_mangle]
pub extern "C" fn gpu_arena_alloc_error_message(size: libc::ssize_t, device: c_int) -> *mut c_char {
    let code = LAST_CODE.try_with(|c| c.get()).unwrap_or(0);
    let cause = LAST_ERROR
        .try_with(|e| e.borrow().to_string_lossy().into_owned())
        .unwrap_or_default();
    let text = std::panic::catch_unwind(|| {
        let bytes = u64::try_from(size).unwrap_or(0);
        if code != GPU_ARENA_ERR_OUT_OF_MEMORY {
            return format!(
                "gpu-arena: allocation of {size} bytes on device {device} failed: {cause}"
            );
        }
        let held = match POOL.get() {
            Some(Ok(p)) => p.stats(device).ok(),
            _ => None,
        };
        let pool = held.map_or_else(String::new, |s| {
            format!(
                " (reserved by gpu-arena: {}, allocated: {}, in {} arenas)",
                format_size(s.reserved_bytes),
                format_size(s.allocated_bytes),
                s.arenas
            )
        });
        format!(
            "CUDA out of memory. Tried to allocate {} ({bytes} bytes) on device {device} with \
             gpu-arena{pool}. gpu-arena already released its cached arenas and retried. \
             Cause: {cause}",
            format_size(bytes)
        )
    });
    match text.map(|t| CString::new(t.replace('\0', "\\0"))) {
        Ok(Ok(s)) => s.into_raw(),
        _ => std::ptr::null_mut(),
    }
}

/// Start (`enabled != 0`) or stop (`0`) recording alloc/free/segment/oom events for every
/// device, into a fresh ring of `max_entries` events per device (0: 100000; the oldest are
/// overwritten). Stopping keeps the events. They appear in `gpu_arena_snapshot_json()`
/// under each device's `"history"`. Costs nothing measurable when off.
#[no_mangle]
pub extern "C" fn gpu_arena_record_history(enabled: c_int, max_entries: usize) -> c_int {
    with_pool("gpu_arena_record_history", |p| {
        p.record_history(enabled != 0, max_entries);
        Ok(GPU_ARENA_OK)
    })
}

/// Set the calling thread's history context id (0: none), stored with every event the
/// thread records from now on (e.g. an index into a table of labels and stacks kept by the
/// caller). Returns the previous id. Never fails, needs no init.
#[no_mangle]
pub extern "C" fn gpu_arena_set_history_context(id: u32) -> u32 {
    let mut prev = 0;
    guard("gpu_arena_set_history_context", || {
        prev = history::set_context(id);
        Ok(GPU_ARENA_OK)
    });
    prev
}
