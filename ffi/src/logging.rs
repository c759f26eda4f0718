//! Logs of the C library: gpu-arena logs with `tracing`, and the core crate leaves the
//! subscriber to the application; a C program or Python has none, so the first init (or
//! `gpu_arena_configure`) installs one that writes to stderr at the level of
//! `GPU_ARENA_LOG` (`off`, `error`, `warn`, `info`, `debug`, `trace`; default `warn`),
//! read once. A process that already set a global `tracing` subscriber keeps it.
//! `gpu_arena_set_log_level` changes the level later.

use std::ffi::{c_char, c_int, CStr};
use std::sync::OnceLock;

use gpu_arena::Error;
use tracing_subscriber::filter::LevelFilter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::{fmt, reload, Registry};

use crate::errors::{fail, guard, GPU_ARENA_OK};

/// The level of the installed subscriber, `None` when the process had its own.
static LEVEL: OnceLock<Option<reload::Handle<LevelFilter, Registry>>> = OnceLock::new();

/// A level by name, or what the names are.
fn parse_level(text: &str) -> Result<LevelFilter, &'static str> {
    match text.trim().to_ascii_lowercase().as_str() {
        "off" => Ok(LevelFilter::OFF),
        "error" => Ok(LevelFilter::ERROR),
        "warn" | "warning" => Ok(LevelFilter::WARN),
        "info" => Ok(LevelFilter::INFO),
        "debug" => Ok(LevelFilter::DEBUG),
        "trace" => Ok(LevelFilter::TRACE),
        _ => Err("expected off, error, warn, info, debug or trace"),
    }
}

/// Install the stderr subscriber once (first use of the C API).
pub(crate) fn init() {
    LEVEL.get_or_init(install);
}

fn install() -> Option<reload::Handle<LevelFilter, Registry>> {
    let env = std::env::var("GPU_ARENA_LOG").ok();
    let level = env.as_deref().map(parse_level);
    let (filter, handle) =
        reload::Layer::new(level.and_then(Result::ok).unwrap_or(LevelFilter::WARN));
    let subscriber = tracing_subscriber::registry()
        .with(filter)
        .with(fmt::layer().with_writer(std::io::stderr).with_ansi(false));
    if tracing::subscriber::set_global_default(subscriber).is_err() {
        // The application has its own subscriber: gpu-arena's logs go there.
        return None;
    }
    if let (Some(text), Some(Err(forms))) = (&env, level) {
        tracing::warn!("GPU_ARENA_LOG=`{text}`: {forms}; logging at warn");
    }
    Some(handle)
}

/// Set the level of gpu-arena's stderr log: `"off"`, `"error"`, `"warn"`, `"info"`,
/// `"debug"` or `"trace"` (`GPU_ARENA_LOG` sets the first one). Fails with
/// `GPU_ARENA_ERR_INVALID_STATE` when the process installed its own `tracing` subscriber
/// (gpu-arena's logs then go there, at its levels).
#[no_mangle]
pub extern "C" fn gpu_arena_set_log_level(level: *const c_char) -> c_int {
    const CALL: &str = "gpu_arena_set_log_level";
    guard(CALL, || {
        if level.is_null() {
            return Err(fail(CALL, Error::invalid("level is NULL")));
        }
        // SAFETY: `level` is non-null and, per the header, a NUL-terminated string valid for
        // the duration of this call.
        let text = unsafe { CStr::from_ptr(level) }.to_string_lossy();
        let filter = parse_level(&text)
            .map_err(|forms| fail(CALL, Error::invalid(format!("level `{text}`: {forms}"))))?;
        init();
        match LEVEL.get() {
            Some(Some(handle)) => handle.reload(filter).map_err(|e| {
                fail(
                    CALL,
                    Error::Internal(format!("cannot change the level: {e}")),
                )
            })?,
            _ => {
                return Err(fail(
                    CALL,
                    Error::InvalidState(
                        "the process installed its own tracing subscriber: gpu-arena logs to it"
                            .into(),
                    ),
                ))
            }
        }
        Ok(GPU_ARENA_OK)
    })
}
