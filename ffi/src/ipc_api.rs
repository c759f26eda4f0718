//! The IPC part of the C API: share, unshare, import, close.
//!
//! The broker starts on the first `gpu_arena_share` of the process; the importer on the
//! first `gpu_arena_import`. A share handle is 128 plain bytes: copy it anywhere.

use std::ffi::{c_char, c_int, c_void};
use std::sync::{Arc, OnceLock};

use gpu_arena::ipc::{Broker, BrokerConfig, Importer, ShareHandle};
use gpu_arena::Error;

use crate::errors::{fail, guard, status, GPU_ARENA_OK};
use crate::init::{existing_pool, pool};

/// Size of a share handle in bytes.
pub const GPU_ARENA_SHARE_BYTES: usize = 128;

/// A share handle: plain bytes, no pointers, no fds. Send it to the consumer any way you like.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct gpu_arena_share_t {
    /// The encoded handle.
    pub bytes: [u8; GPU_ARENA_SHARE_BYTES],
}

static BROKER: OnceLock<std::result::Result<Arc<Broker>, Error>> = OnceLock::new();
static IMPORTER: OnceLock<Arc<Importer>> = OnceLock::new();

/// The process's broker, started on first use.
pub(crate) fn broker(call: &str) -> std::result::Result<&'static Arc<Broker>, c_int> {
    let p = pool(call)?;
    let b = BROKER.get_or_init(|| {
        let config = BrokerConfig {
            allowed_uids: crate::init::CONFIG
                .get()
                .map(|c| c.allowed_uids.clone())
                .unwrap_or_default(),
            ..BrokerConfig::default()
        };
        Broker::start(p.clone(), config).map(Arc::new)
    });
    b.as_ref().map_err(|e| fail(call, e.clone()))
}

pub(crate) fn importer(call: &str) -> std::result::Result<&'static Arc<Importer>, c_int> {
    let p = pool(call)?;
    Ok(IMPORTER.get_or_init(|| Arc::new(Importer::new(p.backend().clone()))))
}

pub(crate) fn read_handle(
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

/// Most entries of one batch call (`gpu_arena_share_many`, `gpu_arena_import_many`,
/// `gpu_arena_close_many`, `gpu_arena_import_dlpack_many`).
pub const GPU_ARENA_BATCH_MAX: usize = 1_048_576;

pub(crate) fn batch_len(call: &str, n: usize) -> std::result::Result<(), c_int> {
    if n > GPU_ARENA_BATCH_MAX {
        return Err(fail(
            call,
            Error::invalid(format!("{n} entries (at most {GPU_ARENA_BATCH_MAX})")),
        ));
    }
    Ok(())
}

/// Share `n` ranges (`ptrs[i]`, `lens[i]` bytes) in one call: `out[i]` receives each handle.
/// All or nothing: on an error, the shares this call made are revoked again (the return
/// code and the last error say which entry failed and why).
#[no_mangle]
pub extern "C" fn gpu_arena_share_many(
    ptrs: *const *const c_void,
    lens: *const usize,
    n: usize,
    out: *mut gpu_arena_share_t,
) -> c_int {
    const CALL: &str = "gpu_arena_share_many";
    guard(CALL, || {
        batch_len(CALL, n)?;
        if n == 0 {
            return Ok(GPU_ARENA_OK);
        }
        if ptrs.is_null() || lens.is_null() || out.is_null() {
            return Err(fail(CALL, Error::invalid("ptrs, lens or out is NULL")));
        }
        // SAFETY: non-null, and per the header each points to `n` readable (ptrs, lens) or
        // writable (out) elements.
        let (ptrs, lens) = unsafe {
            (
                std::slice::from_raw_parts(ptrs, n),
                std::slice::from_raw_parts(lens, n),
            )
        };
        let b = broker(CALL)?;
        let mut made: Vec<ShareHandle> = Vec::with_capacity(n);
        for (i, (&p, &len)) in ptrs.iter().zip(lens).enumerate() {
            match b.share(p as u64, len as u64) {
                Ok(h) => {
                    // SAFETY: i < n, and `out` points to n writable elements.
                    unsafe {
                        out.add(i).write(gpu_arena_share_t {
                            bytes: h.to_bytes(),
                        })
                    };
                    made.push(h);
                }
                Err(e) => {
                    for h in &made {
                        let _ = b.unshare(h);
                    }
                    return Err(fail(&format!("{CALL}(entry {i}, ptr={p:p}, len={len})"), e));
                }
            }
        }
        Ok(GPU_ARENA_OK)
    })
}

/// Import `n` shares in one call: `out_ptrs[i]` receives each address (as
/// `gpu_arena_import`). Shares of arenas this process maps already cost one round trip per
/// producer and device (per 120 shares). All or nothing: on an error no import is left.
#[no_mangle]
pub extern "C" fn gpu_arena_import_many(
    shares: *const gpu_arena_share_t,
    n: usize,
    out_ptrs: *mut *mut c_void,
) -> c_int {
    const CALL: &str = "gpu_arena_import_many";
    guard(CALL, || {
        batch_len(CALL, n)?;
        if n == 0 {
            return Ok(GPU_ARENA_OK);
        }
        if shares.is_null() || out_ptrs.is_null() {
            return Err(fail(CALL, Error::invalid("shares or out_ptrs is NULL")));
        }
        // SAFETY: non-null, and per the header `shares` holds n readable handles (plain
        // bytes: any bit pattern is valid).
        let raw = unsafe { std::slice::from_raw_parts(shares, n) };
        let handles = raw
            .iter()
            .enumerate()
            .map(|(i, s)| {
                ShareHandle::from_bytes(&s.bytes)
                    .map_err(|e| fail(&format!("{CALL}(entry {i})"), e))
            })
            .collect::<std::result::Result<Vec<_>, c_int>>()?;
        let ptrs = importer(CALL)?
            .import_many(&handles)
            .map_err(|e| fail(CALL, e))?;
        for (i, p) in ptrs.into_iter().enumerate() {
            // SAFETY: i < n, and `out_ptrs` points to n writable `void*`.
            unsafe { out_ptrs.add(i).write(p as *mut c_void) };
        }
        Ok(GPU_ARENA_OK)
    })
}

/// Close `n` imports in one call (as `gpu_arena_close`), one message per producer and
/// device (per 120 imports). Every pointer must be a live import (as often as listed), or
/// none is closed.
#[no_mangle]
pub extern "C" fn gpu_arena_close_many(imported_ptrs: *const *mut c_void, n: usize) -> c_int {
    const CALL: &str = "gpu_arena_close_many";
    guard(CALL, || {
        batch_len(CALL, n)?;
        if n == 0 {
            return Ok(GPU_ARENA_OK);
        }
        if imported_ptrs.is_null() {
            return Err(fail(CALL, Error::invalid("imported_ptrs is NULL")));
        }
        existing_pool(CALL)?;
        // SAFETY: non-null, and per the header it points to n readable pointers.
        let ptrs: Vec<u64> = unsafe { std::slice::from_raw_parts(imported_ptrs, n) }
            .iter()
            .map(|&p| p as u64)
            .collect();
        status(|| CALL.into(), importer(CALL)?.close_many(&ptrs))
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

/// One field of a share handle's bytes (`gpu_arena_share_layout`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct gpu_arena_share_field_t {
    /// The field's name, NUL-terminated: `magic`, `version`, `reserved0`, `device`,
    /// `producer_pid`, `share_key`, `arena_id`, `generation`, `reserved1`, `offset`, `len`,
    /// `arena_bytes`, `token`, `socket_name`.
    pub name: [c_char; 16],
    /// Its first byte in `gpu_arena_share_t.bytes`.
    pub offset: u32,
    /// Its length in bytes (integers are little-endian).
    pub len: u32,
}

/// A share handle's fields, as gpu-arena decodes and validates it
/// (`gpu_arena_share_fields`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct gpu_arena_share_fields_t {
    /// The producer's device.
    pub device: i32,
    /// The producer's process id.
    pub producer_pid: u32,
    /// The share's key in the producer's pool.
    pub share_key: u32,
    /// The arena's export generation.
    pub generation: u32,
    /// The arena's id in the producer's pool.
    pub arena_id: u64,
    /// The shared range's offset in its arena, bytes.
    pub offset: u64,
    /// The shared range's length, bytes.
    pub len: u64,
    /// The arena's size, bytes.
    pub arena_bytes: u64,
    /// The random token the producer's broker checks.
    pub token: [u8; 16],
    /// The producer broker's socket name (abstract namespace), NUL-terminated.
    pub socket_name: [c_char; 64],
}

/// The layout of a share handle's `GPU_ARENA_SHARE_BYTES` bytes: every field in byte order,
/// reserved bytes included (together they cover the handle). The first `min(cap, n)` fields
/// go to `out` (NULL when `cap` is 0); returns `n`, the number of fields. Needs no init.
#[no_mangle]
pub extern "C" fn gpu_arena_share_layout(out: *mut gpu_arena_share_field_t, cap: usize) -> c_int {
    const CALL: &str = "gpu_arena_share_layout";
    // Every field name fits in gpu_arena_share_field_t, the longest socket name in
    // gpu_arena_share_fields_t, each with its NUL.
    const _: () = {
        let fields = &gpu_arena::ipc::handle::layout::FIELDS;
        let mut i = 0;
        while i < fields.len() {
            assert!(fields[i].name.len() < 16);
            i += 1;
        }
        assert!(gpu_arena::ipc::handle::MAX_SOCKET_NAME < 64);
    };
    guard(CALL, || {
        let fields = &gpu_arena::ipc::handle::layout::FIELDS;
        if cap > 0 && out.is_null() {
            return Err(fail(CALL, Error::invalid("out is NULL with cap > 0")));
        }
        for (i, f) in fields.iter().take(cap).enumerate() {
            let mut name = [0 as c_char; 16];
            for (d, &c) in name.iter_mut().zip(f.name.as_bytes()) {
                *d = c as c_char;
            }
            let field = gpu_arena_share_field_t {
                name,
                offset: f.offset as u32,
                len: f.len as u32,
            };
            // SAFETY: `out` is non-null (cap > 0) and points to `cap` writable fields; i < cap.
            unsafe { out.add(i).write(field) };
        }
        Ok(fields.len() as c_int)
    })
}

/// Decode and validate `share` as an import would, without reaching its producer: its fields
/// go to `*out`. `GPU_ARENA_ERR_IPC` for a malformed handle. Needs no init.
#[no_mangle]
pub extern "C" fn gpu_arena_share_fields(
    share: *const gpu_arena_share_t,
    out: *mut gpu_arena_share_fields_t,
) -> c_int {
    const CALL: &str = "gpu_arena_share_fields";
    guard(CALL, || {
        if out.is_null() {
            return Err(fail(CALL, Error::invalid("out is NULL")));
        }
        let h = read_handle(CALL, share)?;
        let mut socket_name = [0 as c_char; 64];
        for (d, &c) in socket_name.iter_mut().zip(h.socket_name.as_bytes()) {
            *d = c as c_char;
        }
        let i = &h.info;
        let fields = gpu_arena_share_fields_t {
            device: i.device,
            producer_pid: h.producer_pid,
            share_key: i.share_key,
            generation: i.generation,
            arena_id: i.arena_id,
            offset: i.offset,
            len: i.len,
            arena_bytes: i.arena_bytes,
            token: i.token,
            socket_name,
        };
        // SAFETY: `out` is non-null and points to a writable gpu_arena_share_fields_t.
        unsafe { out.write(fields) };
        Ok(GPU_ARENA_OK)
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn share_size_matches_the_handle() {
        assert_eq!(super::GPU_ARENA_SHARE_BYTES, gpu_arena::ipc::HANDLE_BYTES);
    }
}
