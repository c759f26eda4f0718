//! The C API's errors: the `GPU_ARENA_*` codes, the calling thread's last error (its message
//! and code, `gpu_arena_last_error` / `gpu_arena_last_error_code`), and how an exported
//! function's body reports one: [`guard`] (panics caught), [`fail`] and [`status`] (the
//! error recorded under the call's name), [`Outcome`].

use std::cell::RefCell;
use std::ffi::{c_char, c_int, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use gpu_arena::Error;

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

thread_local! {
    pub(crate) static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
    pub(crate) static LAST_CODE: std::cell::Cell<c_int> = const { std::cell::Cell::new(0) };
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
/// `Err(code)` with the error already recorded (by [`fail`] or [`pool`](crate::init::pool)), so that `?` ends a
/// call early.
pub(crate) type Outcome = std::result::Result<c_int, c_int>;

/// Run the body of an exported function with panics caught: the value of `Ok`, the code of
/// `Err`, and a panic becomes `GPU_ARENA_ERR_INTERNAL`. Every `extern "C"` body that can
/// fail runs inside it (directly, or through [`with_pool`](crate::init::with_pool)).
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

/// `Ok(GPU_ARENA_OK)`, or the error recorded under the call's name (built only on error).
pub(crate) fn status(call: impl FnOnce() -> String, r: Result<(), Error>) -> Outcome {
    r.map(|()| GPU_ARENA_OK).map_err(|e| fail(&call(), e))
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
