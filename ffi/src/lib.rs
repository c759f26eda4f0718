//! The C API of gpu-arena: `libgpu_arena.so` and `include/gpu_arena.h`.
//!
//! The first five functions have the signatures PyTorch's `CUDAPluggableAllocator` loads
//! (`alloc`, `free`, and the `init`, `reset`, `record_stream` hooks). Every function body
//! runs inside `catch_unwind`: nothing crosses the C boundary as a panic. Errors are
//! negative `GPU_ARENA_ERR_*` codes (or NULL from `gpu_arena_malloc`) plus a thread-local
//! message from `gpu_arena_last_error()` that names the call, the value and the reason.
//! A rejected call changes nothing.
//!
//! Life cycle: `gpu_arena_configure` (optional, before first use) → `gpu_arena_init` (PyTorch
//! calls it when the allocator is installed) → allocations → process exit. Configuration is
//! also read from `GPU_ARENA_CONF` / `GPU_ARENA_BACKEND` at init.

// The exported functions check their pointer arguments themselves and are documented in the
// header; marking them `unsafe` would only change the generated Rust signatures.
#![allow(clippy::not_unsafe_ptr_arg_deref)]

use std::cell::RefCell;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, OnceLock};

use gpu_arena::{Config, Error, Pool, PoolStats, StreamId};
use parking_lot::Mutex;

mod ipc_api;
#[allow(unused_imports)]
pub use ipc_api::*;

/// Success.
pub const GPU_ARENA_OK: c_int = 0;
/// A bad argument: size, pointer, configuration string, NULL out-parameter.
pub const GPU_ARENA_ERR_INVALID_ARGUMENT: c_int = -1;
/// Out of device memory (after releasing cached arenas and retrying).
pub const GPU_ARENA_ERR_OUT_OF_MEMORY: c_int = -2;
/// A pointer gpu-arena did not allocate, or already freed.
pub const GPU_ARENA_ERR_UNKNOWN_POINTER: c_int = -3;
/// A driver call failed.
pub const GPU_ARENA_ERR_BACKEND: c_int = -4;
/// Device index out of range.
pub const GPU_ARENA_ERR_INVALID_DEVICE: c_int = -5;
/// Called before `gpu_arena_init`, or init failed.
pub const GPU_ARENA_ERR_NOT_INITIALIZED: c_int = -6;
/// Not valid now (e.g. configure after first use).
pub const GPU_ARENA_ERR_INVALID_STATE: c_int = -7;
/// The requested backend is not available here.
pub const GPU_ARENA_ERR_UNAVAILABLE: c_int = -8;
/// Sharing/import failure: bad handle, wrong token, dead peer.
pub const GPU_ARENA_ERR_IPC: c_int = -9;
/// A gpu-arena bug (an invariant broke, or a panic was caught).
pub const GPU_ARENA_ERR_INTERNAL: c_int = -10;

/// The process-wide pool, built once by `gpu_arena_init`.
static POOL: OnceLock<std::result::Result<Arc<Pool>, Error>> = OnceLock::new();

/// The configuration the pool was built with.
pub(crate) static CONFIG: OnceLock<Config> = OnceLock::new();

/// Configuration set by `gpu_arena_configure`, and whether init already took it.
struct PendingConf {
    conf: Option<Config>,
    consumed: bool,
}
static PENDING_CONF: Mutex<PendingConf> = Mutex::new(PendingConf {
    conf: None,
    consumed: false,
});

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
    static LAST_CODE: std::cell::Cell<c_int> = const { std::cell::Cell::new(0) };
}

pub(crate) fn set_error_code(msg: String, code: c_int) {
    let c = CString::new(msg.replace('\0', "\\0")).unwrap_or_default();
    LAST_ERROR.with(|e| *e.borrow_mut() = c);
    LAST_CODE.with(|c| c.set(code));
}

pub(crate) fn set_error(msg: String) {
    set_error_code(msg, GPU_ARENA_ERR_INTERNAL);
}

pub(crate) fn code_of(e: &Error) -> c_int {
    match e {
        Error::InvalidArgument(_) => GPU_ARENA_ERR_INVALID_ARGUMENT,
        Error::OutOfMemory { .. } | Error::DriverOutOfMemory { .. } => GPU_ARENA_ERR_OUT_OF_MEMORY,
        Error::UnknownPointer { .. } => GPU_ARENA_ERR_UNKNOWN_POINTER,
        Error::InvalidDevice { .. } => GPU_ARENA_ERR_INVALID_DEVICE,
        Error::Backend { .. } => GPU_ARENA_ERR_BACKEND,
        Error::Unavailable(_) => GPU_ARENA_ERR_UNAVAILABLE,
        Error::InvalidState(_) => GPU_ARENA_ERR_INVALID_STATE,
        Error::Ipc(_) => GPU_ARENA_ERR_IPC,
        Error::Internal(_) => GPU_ARENA_ERR_INTERNAL,
        #[allow(unreachable_patterns)]
        _ => GPU_ARENA_ERR_INTERNAL,
    }
}

/// Record `call: error` as the last error and return its code.
pub(crate) fn fail(call: &str, e: Error) -> c_int {
    let code = code_of(&e);
    set_error_code(format!("{call}: {e}"), code);
    code
}

/// Run `f` with panics caught: a panic becomes `GPU_ARENA_ERR_INTERNAL`.
pub(crate) fn guard(call: &str, f: impl FnOnce() -> c_int) -> c_int {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(code) => code,
        Err(_) => {
            set_error(format!("{call}: internal panic caught (a gpu-arena bug)"));
            GPU_ARENA_ERR_INTERNAL
        }
    }
}

/// The pool, or the reason there is none.
pub(crate) fn pool(call: &str) -> std::result::Result<&'static Arc<Pool>, c_int> {
    match POOL.get() {
        Some(Ok(p)) => Ok(p),
        Some(Err(e)) => {
            set_error_code(
                format!("{call}: gpu-arena failed to initialize: {e}"),
                GPU_ARENA_ERR_NOT_INITIALIZED,
            );
            Err(GPU_ARENA_ERR_NOT_INITIALIZED)
        }
        None => {
            set_error_code(
                format!("{call}: called before gpu_arena_init (install the allocator first)"),
                GPU_ARENA_ERR_NOT_INITIALIZED,
            );
            Err(GPU_ARENA_ERR_NOT_INITIALIZED)
        }
    }
}

fn init_pool() -> &'static std::result::Result<Arc<Pool>, Error> {
    POOL.get_or_init(|| {
        let conf = {
            let mut pending = PENDING_CONF.lock();
            pending.consumed = true;
            match pending.conf.take() {
                Some(c) => Ok(c),
                None => Config::from_env(),
            }
        };
        let pool = conf.and_then(|c| {
            let pool = c.build_pool().map(Arc::new);
            let _ = CONFIG.set(c);
            pool
        });
        match &pool {
            Ok(p) => tracing::info!(
                backend = p.backend().name(),
                devices = p.device_count(),
                "gpu-arena initialized"
            ),
            Err(e) => tracing::error!(error = %e, "gpu-arena failed to initialize"),
        }
        pool
    })
}

/// Initialize gpu-arena (PyTorch's `set_init_fn` hook). `device_count` is the caller's
/// device count, checked against the backend's. Safe to call more than once. Check
/// `gpu_arena_init_status()` for the outcome.
#[no_mangle]
pub extern "C" fn gpu_arena_init(device_count: c_int) {
    guard("gpu_arena_init", || {
        let code = match init_pool() {
            Ok(p) => {
                if device_count >= 0 && device_count as usize > p.device_count() {
                    tracing::warn!(
                        device_count,
                        backend_devices = p.device_count(),
                        "gpu_arena_init: the caller sees more devices than the backend"
                    );
                }
                GPU_ARENA_OK
            }
            Err(e) => fail("gpu_arena_init", e.clone()),
        };
        code
    });
}

/// 0 when gpu-arena is initialized and usable, else the error code of the failed (or
/// missing) init, with `gpu_arena_last_error()` saying why.
#[no_mangle]
pub extern "C" fn gpu_arena_init_status() -> c_int {
    guard("gpu_arena_init_status", || match POOL.get() {
        Some(Ok(_)) => GPU_ARENA_OK,
        // The failed init's own code (e.g. GPU_ARENA_ERR_UNAVAILABLE), with its message.
        Some(Err(e)) => fail(
            "gpu_arena_init_status: gpu-arena failed to initialize",
            e.clone(),
        ),
        None => match pool("gpu_arena_init_status") {
            Ok(_) => GPU_ARENA_OK,
            Err(c) => c,
        },
    })
}

/// Configure before first use, e.g. `"backend=sim,arena_size=1GiB"`. Keys: see the README.
/// After `gpu_arena_init` it fails with `GPU_ARENA_ERR_INVALID_STATE`.
#[no_mangle]
pub extern "C" fn gpu_arena_configure(conf: *const c_char) -> c_int {
    guard("gpu_arena_configure", || {
        if conf.is_null() {
            return fail("gpu_arena_configure", Error::invalid("conf is NULL"));
        }
        if POOL.get().is_some() {
            return fail(
                "gpu_arena_configure",
                Error::InvalidState(
                    "configure after first use (gpu_arena_init already ran)".into(),
                ),
            );
        }
        // SAFETY: `conf` is non-null and, per the header, a NUL-terminated string that
        // stays valid for the duration of this call.
        let text = unsafe { CStr::from_ptr(conf) };
        let Ok(text) = text.to_str() else {
            return fail("gpu_arena_configure", Error::invalid("conf is not UTF-8"));
        };
        let mut pending = PENDING_CONF.lock();
        if pending.consumed {
            return fail(
                "gpu_arena_configure",
                Error::InvalidState(
                    "configure after first use (gpu_arena_init already ran)".into(),
                ),
            );
        }
        let mut c = match pending.conf.clone() {
            Some(c) => c,
            None => match Config::from_env() {
                Ok(c) => c,
                Err(e) => return fail("gpu_arena_configure", e),
            },
        };
        match c.apply(text) {
            Ok(()) => {
                pending.conf = Some(c);
                GPU_ARENA_OK
            }
            Err(e) => fail(
                "gpu_arena_configure",
                Error::invalid(format!("`{text}`: {e}")),
            ),
        }
    })
}

/// The size as u64, or the error recorded under the call's name (built only on error: the
/// hot path formats nothing).
fn check_size(call: impl Fn() -> String, size: isize) -> std::result::Result<u64, c_int> {
    u64::try_from(size)
        .map_err(|_| fail(&call(), Error::invalid(format!("size {size} is negative"))))
}

/// The pool, fast when initialized; the call's name is built only on error.
fn pool_for(call: impl Fn() -> String) -> std::result::Result<&'static Arc<Pool>, c_int> {
    match POOL.get() {
        Some(Ok(p)) => Ok(p),
        _ => pool(&call()),
    }
}

/// Allocate `size` bytes on `device` for use on `stream` (PyTorch's pluggable `alloc`).
/// Returns NULL on failure (see `gpu_arena_last_error()`); `size == 0` returns NULL and is
/// not an error.
#[no_mangle]
pub extern "C" fn gpu_arena_malloc(
    size: libc::ssize_t,
    device: c_int,
    stream: *mut c_void,
) -> *mut c_void {
    let mut out: *mut c_void = std::ptr::null_mut();
    guard("gpu_arena_malloc", || {
        let call = || format!("gpu_arena_malloc(size={size}, device={device})");
        let size = match check_size(call, size) {
            Ok(0) => return GPU_ARENA_OK,
            Ok(s) => s,
            Err(c) => return c,
        };
        let p = match pool_for(call) {
            Ok(p) => p,
            Err(c) => return c,
        };
        match p.alloc(device, size, StreamId(stream as u64)) {
            Ok(a) => {
                out = a.ptr as *mut c_void;
                GPU_ARENA_OK
            }
            Err(e) => fail(&call(), e),
        }
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
            return GPU_ARENA_OK;
        }
        let call = || format!("gpu_arena_free(ptr={ptr:p}, size={size}, device={device})");
        let size = match check_size(call, size) {
            Ok(s) => s,
            Err(c) => return c,
        };
        let p = match pool_for(call) {
            Ok(p) => p,
            Err(c) => return c,
        };
        match p.free_checked(ptr as u64, size, device) {
            Ok(()) => GPU_ARENA_OK,
            Err(e) => fail(&call(), e),
        }
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
    guard("gpu_arena_record_stream", || {
        let p = match pool("gpu_arena_record_stream") {
            Ok(p) => p,
            Err(c) => return c,
        };
        match p.record_stream(ptr as u64, StreamId(stream as u64)) {
            Ok(()) => GPU_ARENA_OK,
            Err(e) => fail(&format!("gpu_arena_record_stream(ptr={ptr:p})"), e),
        }
    })
}

/// PyTorch's `reset` hook (`torch.cuda.empty_cache()`): release every unused arena of every
/// device.
#[no_mangle]
pub extern "C" fn gpu_arena_reset() {
    gpu_arena_empty_cache(-1);
}

/// Synchronize and destroy every arena of `device` (-1: all devices) that holds no live
/// allocation and no share. Pinned arenas stay (recycled).
#[no_mangle]
pub extern "C" fn gpu_arena_empty_cache(device: c_int) -> c_int {
    guard("gpu_arena_empty_cache", || {
        let p = match pool("gpu_arena_empty_cache") {
            Ok(p) => p,
            Err(c) => return c,
        };
        let which = match device {
            -1 => None,
            d => Some(d),
        };
        match p.empty_cache(which) {
            Ok(_) => GPU_ARENA_OK,
            Err(e) => fail(&format!("gpu_arena_empty_cache(device={device})"), e),
        }
    })
}

/// Fill `*out` with the counters of `device`.
#[no_mangle]
pub extern "C" fn gpu_arena_stats(device: c_int, out: *mut PoolStats) -> c_int {
    guard("gpu_arena_stats", || {
        if out.is_null() {
            return fail("gpu_arena_stats", Error::invalid("out is NULL"));
        }
        let p = match pool("gpu_arena_stats") {
            Ok(p) => p,
            Err(c) => return c,
        };
        match p.stats(device) {
            Ok(s) => {
                // SAFETY: `out` is non-null and, per the header, points to a writable
                // gpu_arena_stats_t (generated from `PoolStats`: the same layout).
                unsafe { out.write(s) };
                GPU_ARENA_OK
            }
            Err(e) => fail(&format!("gpu_arena_stats(device={device})"), e),
        }
    })
}

/// Check every invariant of `device`'s pool; 0 when they all hold.
#[no_mangle]
pub extern "C" fn gpu_arena_validate(device: c_int) -> c_int {
    guard("gpu_arena_validate", || {
        let p = match pool("gpu_arena_validate") {
            Ok(p) => p,
            Err(c) => return c,
        };
        match p.validate(device) {
            Ok(()) => GPU_ARENA_OK,
            Err(e) => fail(&format!("gpu_arena_validate(device={device})"), e),
        }
    })
}

/// Number of devices of the backend, or a negative error code.
#[no_mangle]
pub extern "C" fn gpu_arena_device_count() -> c_int {
    guard("gpu_arena_device_count", || {
        match pool("gpu_arena_device_count") {
            Ok(p) => c_int::try_from(p.device_count()).unwrap_or(c_int::MAX),
            Err(c) => c,
        }
    })
}

/// The backend's name (`"sim"`, `"cuda"`, `"hip"`), or `""` before init. Never NULL.
#[no_mangle]
pub extern "C" fn gpu_arena_backend_name() -> *const c_char {
    match POOL.get() {
        Some(Ok(p)) => match p.backend().name() {
            "sim" => c"sim".as_ptr(),
            "cuda" => c"cuda".as_ptr(),
            "hip" => c"hip".as_ptr(),
            _ => c"other".as_ptr(),
        },
        _ => c"".as_ptr(),
    }
}

/// A JSON snapshot of every arena and range. Free it with `gpu_arena_string_free`.
/// NULL on error.
#[no_mangle]
pub extern "C" fn gpu_arena_snapshot_json() -> *mut c_char {
    let mut out = std::ptr::null_mut();
    guard("gpu_arena_snapshot_json", || {
        let p = match pool("gpu_arena_snapshot_json") {
            Ok(p) => p,
            Err(c) => return c,
        };
        match CString::new(p.snapshot_json()) {
            Ok(s) => {
                out = s.into_raw();
                GPU_ARENA_OK
            }
            Err(_) => fail(
                "gpu_arena_snapshot_json",
                Error::Internal("NUL in JSON".into()),
            ),
        }
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

/// The code of the calling thread's last error (0 if none): useful after a NULL return.
#[no_mangle]
pub extern "C" fn gpu_arena_last_error_code() -> c_int {
    LAST_CODE.with(|c| c.get())
}

/// The calling thread's last error message ("" if none). Never NULL; valid until the next
/// gpu-arena call on this thread.
#[no_mangle]
pub extern "C" fn gpu_arena_last_error() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}
