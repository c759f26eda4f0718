//! The IPC part of the C API: share, unshare, import, close.
//!
//! The broker starts on the first `gpu_arena_share` of the process; the importer on the
//! first `gpu_arena_import`. A share handle is 128 plain bytes: copy it anywhere.

use std::ffi::{c_int, c_void};
use std::sync::OnceLock;

use gpu_arena::ipc::{Broker, BrokerConfig, Importer, ShareHandle};
use gpu_arena::Error;

use crate::{existing_pool, fail, guard, pool, status, GPU_ARENA_OK};

/// Size of a share handle in bytes.
pub const GPU_ARENA_SHARE_BYTES: usize = 128;

/// A share handle: plain bytes, no pointers, no fds. Send it to the consumer any way you like.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct gpu_arena_share_t {
    /// The encoded handle.
    pub bytes: [u8; GPU_ARENA_SHARE_BYTES],
}

static BROKER: OnceLock<std::result::Result<Broker, Error>> = OnceLock::new();
static IMPORTER: OnceLock<Importer> = OnceLock::new();

fn broker(call: &str) -> std::result::Result<&'static Broker, c_int> {
    let p = pool(call)?;
    let b = BROKER.get_or_init(|| {
        let config = BrokerConfig {
            allowed_uids: crate::CONFIG
                .get()
                .map(|c| c.allowed_uids.clone())
                .unwrap_or_default(),
            ..BrokerConfig::default()
        };
        Broker::start(p.clone(), config)
    });
    b.as_ref().map_err(|e| fail(call, e.clone()))
}

fn importer(call: &str) -> std::result::Result<&'static Importer, c_int> {
    let p = pool(call)?;
    Ok(IMPORTER.get_or_init(|| Importer::new(p.backend().clone())))
}

fn read_handle(
    call: &str,
    share: *const gpu_arena_share_t,
) -> std::result::Result<ShareHandle, c_int> {
    if share.is_null() {
        return Err(fail(call, Error::invalid("share is NULL")));
    }
    // SAFETY: non-null, and per the header it points to a readable gpu_arena_share_t (plain
    // bytes: any bit pattern is a valid value).
    let bytes = unsafe { (*share).bytes };
    ShareHandle::from_bytes(&bytes).map_err(|e| fail(call, e))
}

/// Share `len` bytes at `ptr` (inside one live gpu-arena allocation) with other processes.
/// The arena is exported on its first share; the handle goes to `*out`. Initializes lazily.
#[no_mangle]
pub extern "C" fn gpu_arena_share(
    ptr: *const c_void,
    len: usize,
    out: *mut gpu_arena_share_t,
) -> c_int {
    guard("gpu_arena_share", || {
        // Formatted only on failure: a share is a few hundred nanoseconds.
        let call = || format!("gpu_arena_share(ptr={ptr:p}, len={len})");
        if out.is_null() {
            return Err(fail(&call(), Error::invalid("out is NULL")));
        }
        let h = broker("gpu_arena_share")?
            .share(ptr as u64, len as u64)
            .map_err(|e| fail(&call(), e))?;
        // SAFETY: `out` is non-null and points to a writable gpu_arena_share_t.
        unsafe {
            out.write(gpu_arena_share_t {
                bytes: h.to_bytes(),
            })
        };
        Ok(GPU_ARENA_OK)
    })
}

/// Revoke a share made by this process: no new import succeeds. Imports already made stay
/// valid until their consumers close them; the memory is reused only after that.
#[no_mangle]
pub extern "C" fn gpu_arena_unshare(share: *const gpu_arena_share_t) -> c_int {
    const CALL: &str = "gpu_arena_unshare";
    guard(CALL, || {
        let h = read_handle(CALL, share)?;
        existing_pool(CALL)?;
        status(|| CALL.into(), broker(CALL)?.unshare(&h))
    })
}

/// Import a share made by another process (or this one): `*out_ptr` receives the address
/// of its first byte, valid until `gpu_arena_close`. Initializes lazily (a consumer need not
/// call `gpu_arena_init`).
#[no_mangle]
pub extern "C" fn gpu_arena_import(
    share: *const gpu_arena_share_t,
    out_ptr: *mut *mut c_void,
) -> c_int {
    const CALL: &str = "gpu_arena_import";
    guard(CALL, || {
        if out_ptr.is_null() {
            return Err(fail(CALL, Error::invalid("out_ptr is NULL")));
        }
        let h = read_handle(CALL, share)?;
        let p = importer(CALL)?.import(&h).map_err(|e| {
            let call = format!(
                "{CALL}(producer pid {}, share {})",
                h.producer_pid, h.info.share_key
            );
            fail(&call, e)
        })?;
        // SAFETY: `out_ptr` is non-null and points to a writable `void*`.
        unsafe { out_ptr.write(p as *mut c_void) };
        Ok(GPU_ARENA_OK)
    })
}

/// Close an import. The last import of an arena unmaps it; the producer is told (a producer
/// that exited is fine).
#[no_mangle]
pub extern "C" fn gpu_arena_close(imported_ptr: *mut c_void) -> c_int {
    guard("gpu_arena_close", || {
        existing_pool("gpu_arena_close")?;
        status(
            || format!("gpu_arena_close(ptr={imported_ptr:p})"),
            importer("gpu_arena_close")?.close(imported_ptr as u64),
        )
    })
}

/// Imports live in this process (as a consumer).
#[no_mangle]
pub extern "C" fn gpu_arena_imports_live() -> c_int {
    guard("gpu_arena_imports_live", || {
        Ok(IMPORTER.get().map_or(0, |i| {
            c_int::try_from(i.stats().imports_live).unwrap_or(c_int::MAX)
        }))
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn share_size_matches_the_handle() {
        assert_eq!(super::GPU_ARENA_SHARE_BYTES, gpu_arena::ipc::HANDLE_BYTES);
    }
}
