//! The C API of gpu-arena: `libgpu_arena.so` and `include/gpu_arena.h`.
//!
//! The first five functions have the signatures PyTorch's `CUDAPluggableAllocator` loads
//! (`alloc`, `free`, and the `init`, `reset`, `record_stream` hooks). Every function body
//! runs inside `catch_unwind` (`guard`, or `with_pool` for the calls that need the pool):
//! nothing crosses the C boundary as a panic. Errors are negative `GPU_ARENA_ERR_*` codes
//! (or NULL from `gpu_arena_malloc`) plus a thread-local message from
//! `gpu_arena_last_error()` that names the call, the value and the reason. A rejected call
//! changes nothing.
//!
//! Life cycle: `gpu_arena_configure` (optional, before first use) → `gpu_arena_init` (PyTorch
//! calls it when the allocator is installed) → allocations → process exit. Configuration is
//! also read from `GPU_ARENA_CONF` / `GPU_ARENA_BACKEND` at init.
//!
//! Lazy init: a call that needs the pool and finds it not initialized initializes it as
//! `gpu_arena_init` would (from `gpu_arena_configure`'s settings, else the environment), once
//! per process even when threads race (`OnceLock`): `gpu_arena_malloc`, `gpu_arena_stats`,
//! `gpu_arena_empty_cache` / `gpu_arena_reset`, `gpu_arena_validate`,
//! `gpu_arena_device_count`, `gpu_arena_snapshot_json`, `gpu_arena_share`,
//! `gpu_arena_import`, `gpu_arena_import_dlpack`, `gpu_arena_observe_arenas`. So a C program, or a framework that never calls init, just allocates.
//! The calls that take back something gpu-arena handed out (`gpu_arena_free(_checked)`,
//! `gpu_arena_record_stream(_checked)`, `gpu_arena_unshare`, `gpu_arena_close`,
//! `gpu_arena_close_dlpack`, `gpu_arena_unobserve_arenas`) do not
//! initialize: before init nothing can be gpu-arena's, and they fail with
//! `GPU_ARENA_ERR_NOT_INITIALIZED`. Neither do the queries `gpu_arena_init_status`,
//! `gpu_arena_backend_name`, `gpu_arena_imports_live` and `gpu_arena_dlpack_imports`. A failed init (lazy or not) is
//! final: every call that needs the pool then fails with `GPU_ARENA_ERR_NOT_INITIALIZED` and
//! the reason, `gpu_arena_init_status` with the failure's own code.
//!
//! Logs: the first init (or `gpu_arena_configure`) installs a stderr subscriber at the level
//! of `GPU_ARENA_LOG` (default `warn`) unless the process already has one (`logging.rs`).

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
mod dlpack_api;
#[allow(unused_imports)]
pub use dlpack_api::*;
mod torch_api;
#[allow(unused_imports)]
pub use torch_api::*;
mod observers;
#[allow(unused_imports)]
pub use observers::*;
mod sleep_api;
#[allow(unused_imports)]
pub use sleep_api::*;
mod torch_allocator_api;
#[allow(unused_imports)]
pub use torch_allocator_api::*;
mod transfer_api;
#[allow(unused_imports)]
pub use transfer_api::*;

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
/// gpu-arena failed to initialize (the message says why), or a call that takes back a
/// pointer or share came before anything was initialized.
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

/// The call that initialized gpu-arena: `gpu_arena_init`, or the first that needed the pool.
static INIT_BY: OnceLock<String> = OnceLock::new();

mod logging;
pub use logging::gpu_arena_set_log_level;

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
    let _ = LAST_ERROR.try_with(|e| *e.borrow_mut() = c);
    let _ = LAST_CODE.try_with(|c| c.set(code));
}

/// The calling thread's last error (message, code), for code that must not change it (a
/// DLPack deleter runs in the middle of whatever its thread was doing); put it back with
/// [`restore_last_error`].
pub(crate) fn saved_last_error() -> (CString, c_int) {
    let msg = LAST_ERROR
        .try_with(|e| e.borrow().clone())
        .unwrap_or_default();
    (msg, gpu_arena_last_error_code())
}

pub(crate) fn restore_last_error((msg, code): (CString, c_int)) {
    let _ = LAST_ERROR.try_with(|e| *e.borrow_mut() = msg);
    let _ = LAST_CODE.try_with(|c| c.set(code));
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

/// What an exported function's body returns: `Ok(value)` (`GPU_ARENA_OK`, or a count), or
/// `Err(code)` with the error already recorded (by [`fail`] or [`pool`]), so that `?` ends a
/// call early.
pub(crate) type Outcome = std::result::Result<c_int, c_int>;

/// Run the body of an exported function with panics caught: the value of `Ok`, the code of
/// `Err`, and a panic becomes `GPU_ARENA_ERR_INTERNAL`. Every `extern "C"` body that can
/// fail runs inside it (directly, or through [`with_pool`]).
pub(crate) fn guard(call: &str, f: impl FnOnce() -> Outcome) -> c_int {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(value)) => value,
        Ok(Err(code)) => code,
        Err(_) => {
            set_error(format!("{call}: internal panic caught (a gpu-arena bug)"));
            GPU_ARENA_ERR_INTERNAL
        }
    }
}

/// [`guard`] around `f(pool)`, initializing the pool first if needed (lazy init); a failed
/// init is `GPU_ARENA_ERR_NOT_INITIALIZED` for the call.
pub(crate) fn with_pool(call: &str, f: impl FnOnce(&'static Arc<Pool>) -> Outcome) -> c_int {
    guard(call, || f(pool(call)?))
}

/// `Ok(GPU_ARENA_OK)`, or the error recorded under the call's name (built only on error).
pub(crate) fn status(call: impl FnOnce() -> String, r: Result<(), Error>) -> Outcome {
    r.map(|()| GPU_ARENA_OK).map_err(|e| fail(&call(), e))
}

/// The pool, initializing it first if needed (lazy init), or the reason there is none.
pub(crate) fn pool(call: &str) -> std::result::Result<&'static Arc<Pool>, c_int> {
    match POOL.get() {
        Some(Ok(p)) => Ok(p),
        _ => initialized(call, init_pool(call)),
    }
}

/// The pool if it is initialized, without initializing it: for the calls that take back
/// something gpu-arena handed out, which cannot exist before init.
pub(crate) fn existing_pool(call: &str) -> std::result::Result<&'static Arc<Pool>, c_int> {
    match POOL.get() {
        Some(r) => initialized(call, r),
        None => {
            set_error_code(
                format!("{call}: gpu-arena is not initialized yet, so nothing is its to take back (gpu_arena_init, or the first gpu_arena_malloc, initializes it)"),
                GPU_ARENA_ERR_NOT_INITIALIZED,
            );
            Err(GPU_ARENA_ERR_NOT_INITIALIZED)
        }
    }
}

fn initialized(
    call: &str,
    r: &'static std::result::Result<Arc<Pool>, Error>,
) -> std::result::Result<&'static Arc<Pool>, c_int> {
    r.as_ref().map_err(|e| {
        set_error_code(
            format!("{call}: gpu-arena failed to initialize: {e}"),
            GPU_ARENA_ERR_NOT_INITIALIZED,
        );
        GPU_ARENA_ERR_NOT_INITIALIZED
    })
}

/// Initialize once per process (threads racing here wait for the first), on behalf of `call`.
fn init_pool(call: &str) -> &'static std::result::Result<Arc<Pool>, Error> {
    POOL.get_or_init(|| {
        logging::init();
        let by = call.split('(').next().unwrap_or(call);
        let _ = INIT_BY.set(by.to_string());
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
                by,
                "gpu-arena initialized"
            ),
            Err(e) => tracing::error!(error = %e, "gpu-arena failed to initialize"),
        }
        pool
    })
}

/// Initialize gpu-arena (PyTorch's `set_init_fn` hook): backend and devices from
/// `gpu_arena_configure`'s settings, else `GPU_ARENA_CONF` / `GPU_ARENA_BACKEND`.
/// `device_count` is the caller's device count, checked against the backend's. Safe to call
/// more than once, and optional: `gpu_arena_malloc`, `gpu_arena_stats`,
/// `gpu_arena_empty_cache`, `gpu_arena_validate`, `gpu_arena_device_count`,
/// `gpu_arena_snapshot_json`, `gpu_arena_share`, `gpu_arena_import` and
/// `gpu_arena_import_dlpack` initialize the same way on first use (once, even when threads race). Check `gpu_arena_init_status()` for
/// the outcome.
#[no_mangle]
pub extern "C" fn gpu_arena_init(device_count: c_int) {
    guard("gpu_arena_init", || {
        let p = init_pool("gpu_arena_init")
            .as_ref()
            .map_err(|e| fail("gpu_arena_init", e.clone()))?;
        if device_count >= 0 && device_count as usize > p.device_count() {
            tracing::warn!(
                device_count,
                backend_devices = p.device_count(),
                "gpu_arena_init: the caller sees more devices than the backend"
            );
        }
        Ok(GPU_ARENA_OK)
    });
}

/// 0 when gpu-arena is initialized and usable, else the error code of the failed init (or
/// `GPU_ARENA_ERR_NOT_INITIALIZED` when nothing initialized it yet; this call does not),
/// with `gpu_arena_last_error()` saying why.
#[no_mangle]
pub extern "C" fn gpu_arena_init_status() -> c_int {
    guard("gpu_arena_init_status", || match POOL.get() {
        // The failed init's own code (e.g. GPU_ARENA_ERR_UNAVAILABLE), with its message.
        Some(Err(e)) => Err(fail(
            "gpu_arena_init_status: gpu-arena failed to initialize",
            e.clone(),
        )),
        Some(Ok(_)) => Ok(GPU_ARENA_OK),
        None => {
            set_error_code(
                "gpu_arena_init_status: not initialized yet (gpu_arena_init, or the first call that needs the pool, initializes it)".into(),
                GPU_ARENA_ERR_NOT_INITIALIZED,
            );
            Err(GPU_ARENA_ERR_NOT_INITIALIZED)
        }
    })
}

/// Configure before first use, e.g. `"backend=sim,arena_size=1GiB"`. Keys: see
/// docs/configuration.md. Once gpu-arena is initialized (by `gpu_arena_init` or lazily, by
/// the first call that needs it) it fails with `GPU_ARENA_ERR_INVALID_STATE`.
#[no_mangle]
pub extern "C" fn gpu_arena_configure(conf: *const c_char) -> c_int {
    guard("gpu_arena_configure", || {
        logging::init();
        let refuse = |e: Error| Err(fail("gpu_arena_configure", e));
        let after_init = || {
            let by = INIT_BY.get().map_or("gpu_arena_init", String::as_str);
            Error::InvalidState(format!(
                "configure after first use (gpu-arena was already initialized by {by})"
            ))
        };
        if conf.is_null() {
            return refuse(Error::invalid("conf is NULL"));
        }
        if POOL.get().is_some() {
            return refuse(after_init());
        }
        // SAFETY: `conf` is non-null and, per the header, a NUL-terminated string that
        // stays valid for the duration of this call.
        let text = unsafe { CStr::from_ptr(conf) };
        let Ok(text) = text.to_str() else {
            return refuse(Error::invalid("conf is not UTF-8"));
        };
        let mut pending = PENDING_CONF.lock();
        if pending.consumed {
            return refuse(after_init());
        }
        let mut c = match pending.conf.clone() {
            Some(c) => c,
            None => match Config::from_env() {
                Ok(c) => c,
                Err(e) => return refuse(e),
            },
        };
        match c.apply(text) {
            Ok(()) => {
                pending.conf = Some(c);
                Ok(GPU_ARENA_OK)
            }
            Err(e) => refuse(Error::invalid(format!("`{text}`: {e}"))),
        }
    })
}

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

/// The code of the calling thread's last error (0 if none): useful after a NULL return.
#[no_mangle]
pub extern "C" fn gpu_arena_last_error_code() -> c_int {
    LAST_CODE
        .try_with(|c| c.get())
        .unwrap_or(GPU_ARENA_ERR_INTERNAL)
}

/// The calling thread's last error message ("" if none). Never NULL; valid until the next
/// gpu-arena call on this thread.
#[no_mangle]
pub extern "C" fn gpu_arena_last_error() -> *const c_char {
    // `try_with`: no panic even during thread-local teardown.
    LAST_ERROR
        .try_with(|e| e.borrow().as_ptr())
        .unwrap_or(c"".as_ptr())
}
