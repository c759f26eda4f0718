//! The process-wide pool: built once by `gpu_arena_init`, or lazily by the first call that
//! needs it (from `gpu_arena_configure`'s settings, else the environment); the exported init
//! calls; and how the other calls reach the pool ([`pool`], [`existing_pool`],
//! [`with_pool`]).

use std::ffi::{c_char, c_int, CStr};
use std::sync::{Arc, OnceLock};

use gpu_arena::{Config, Error, Pool};
use parking_lot::Mutex;

use crate::errors::{
    fail, guard, set_error_code, Outcome, GPU_ARENA_ERR_NOT_INITIALIZED, GPU_ARENA_OK,
};
use crate::logging;

/// The process-wide pool, built once by `gpu_arena_init`.
pub(crate) static POOL: OnceLock<std::result::Result<Arc<Pool>, Error>> = OnceLock::new();

/// The configuration the pool was built with.
pub(crate) static CONFIG: OnceLock<Config> = OnceLock::new();

/// The call that initialized gpu-arena: `gpu_arena_init`, or the first that needed the pool.
static INIT_BY: OnceLock<String> = OnceLock::new();

/// Configuration set by `gpu_arena_configure`, and whether init already took it.
struct PendingConf {
    conf: Option<Config>,
    consumed: bool,
}
static PENDING_CONF: Mutex<PendingConf> = Mutex::new(PendingConf {
    conf: None,
    consumed: false,
});

/// [`guard`] around `f(pool)`, initializing the pool first if needed (lazy init); a failed
/// init is `GPU_ARENA_ERR_NOT_INITIALIZED` for the call.
pub(crate) fn with_pool(call: &str, f: impl FnOnce(&'static Arc<Pool>) -> Outcome) -> c_int {
    guard(call, || f(pool(call)?))
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
