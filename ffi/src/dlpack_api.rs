//! Import a share straight into a DLPack tensor: `gpu_arena_import_dlpack` imports the
//! share and returns a ready `DLManagedTensor` (dtype, shape, strides from the caller's
//! view), whose deleter closes the import when the consumer (PyTorch's `from_dlpack`, or
//! any DLPack consumer) frees the last tensor over it. `gpu_arena.open()` is built on it:
//! one C call and one capsule per open, instead of building the DLPack structures with
//! ctypes and a Python deleter.
//!
//! Every such import has an id (never reused in the process) in a registry here, so that it
//! can be closed early (`gpu_arena_close_dlpack`, after which its deleter only frees) and
//! listed (`gpu_arena_dlpack_imports`). Deleters run on whatever thread frees the tensor;
//! they catch panics, log a failed close and leave the thread's last error alone (a
//! deleter has no caller to tell). The registry's lock is never held across a driver call
//! or a message to a producer.

use std::collections::BTreeMap;
use std::ffi::{c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use gpu_arena::ipc::ShareHandle;
use gpu_arena::Error;
use parking_lot::Mutex;

use crate::dlpack_view::{read_view, spans_whole, DlDataType};
use crate::errors::{fail, guard, restore_last_error, saved_last_error, GPU_ARENA_OK};
use crate::init::existing_pool;
use crate::ipc_api::{batch_len, gpu_arena_share_t, importer, read_handle};

/// What `gpu_arena_import_dlpack` hands back.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct gpu_arena_dlpack_t {
    /// A `DLManagedTensor*` (DLPack's ABI, the `"dltensor"` capsule of PyTorch and
    /// NumPy). Hand it to exactly one consumer, which calls its deleter once; one that
    /// refuses it goes back through `gpu_arena_release_dlpack`.
    pub managed: *mut c_void,
    /// The import's id (> 0, never reused in the process), for `gpu_arena_close_dlpack`.
    pub id: u64,
    /// 0: the tensor has the view's dtype, shape and strides and its storage is the whole
    /// share. 1: it is the whole share as a 1-D tensor of the view's dtype (`nbytes /
    /// itemsize` elements); the caller applies shape, strides and storage offset itself
    /// (PyTorch: `as_strided`).
    pub flat: i32,
    /// Dimensions of the tensor built (1 when `flat`).
    pub ndim: i32,
}

/// One open import made by `gpu_arena_import_dlpack`, as `gpu_arena_dlpack_imports` lists it.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct gpu_arena_dlpack_import_t {
    /// The import's id.
    pub id: u64,
    /// Address of the shared range's first byte in this process.
    pub ptr: *mut c_void,
    /// Length of the shared range in bytes.
    pub nbytes: u64,
    /// The producer's device.
    pub device: i32,
    /// 1 once closed (by `gpu_arena_close_dlpack`) while its tensor is still alive.
    pub closed: i32,
    /// The share it imports.
    pub share: gpu_arena_share_t,
}

// DLPack's ABI (dlpack.h, v0.x: what "dltensor" capsules hold). Private: the header hands
// the managed tensor out as `void*`, so C callers use their own dlpack.h.
#[repr(C)]
struct DlDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
struct DlTensor {
    data: *mut c_void,
    device: DlDevice,
    ndim: i32,
    dtype: DlDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
struct DlManagedTensor {
    dl_tensor: DlTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensor)>,
}

/// The allocation behind a `DLManagedTensor*` handed out: the tensor first (the pointer to
/// one is the pointer to the other), then the shape and strides it points to.
#[repr(C)]
struct Managed {
    dl: DlManagedTensor,
    id: u64,
    dims: Box<[i64]>,
}

struct Entry {
    /// The `DLManagedTensor*` handed out, so `gpu_arena_release_dlpack` can check a pointer
    /// is one of ours before it reads through it.
    managed: usize,
    ptr: u64,
    nbytes: u64,
    device: i32,
    closed: bool,
    share: [u8; crate::ipc_api::GPU_ARENA_SHARE_BYTES],
}

/// id -> open import, in the order they were made. An entry leaves when its deleter runs.
static REGISTRY: Mutex<BTreeMap<u64, Entry>> = Mutex::new(BTreeMap::new());
static NEXT_ID: AtomicU64 = AtomicU64::new(1);
/// Set by `gpu_arena_dlpack_exiting`: deleters free their memory and close nothing.
static EXITING: AtomicBool = AtomicBool::new(false);

/// Close entry `id` once: 1 if this call closed it, 0 if it was closed already. Synchronizes
/// the device first when `sync`.
fn close_id(call: &str, id: u64, sync: bool) -> Result<c_int, c_int> {
    let (ptr, device) = {
        let mut reg = REGISTRY.lock();
        let Some(e) = reg.get_mut(&id) else {
            return Err(fail(
                call,
                Error::UnknownPointer {
                    ptr: id,
                    why: "no open gpu_arena_import_dlpack import has this id".into(),
                },
            ));
        };
        if e.closed {
            return Ok(0);
        }
        e.closed = true;
        (e.ptr, e.device)
    };
    close_import(call, ptr, device, sync).map(|()| 1)
}

fn close_import(call: &str, ptr: u64, device: i32, sync: bool) -> Result<(), c_int> {
    let pool = existing_pool(call)?;
    if sync {
        if let Err(e) = pool.backend().synchronize(device) {
            tracing::warn!(
                "{call}: synchronizing device {device} before closing import {ptr:#x} failed: {e}"
            );
        }
    }
    importer(call)?
        .close(ptr)
        .map_err(|e| fail(&format!("{call}(ptr={ptr:#x})"), e))
}

/// The DLPack deleter of every tensor handed out: closes the import unless it was closed,
/// then frees. (Defined inside a function: cbindgen would take an `extern "C"` item for an
/// export.)
fn deleter() -> unsafe extern "C" fn(*mut DlManagedTensor) {
    unsafe extern "C" fn dl_deleter(m: *mut DlManagedTensor) {
        let _ = catch_unwind(AssertUnwindSafe(|| {
            if m.is_null() {
                return;
            }
            // SAFETY: every DLManagedTensor with this deleter is a `Box<Managed>` leaked by
            // gpu_arena_import_dlpack (Managed starts with it, #[repr(C)]), and DLPack's
            // contract is one deleter call per tensor: this takes it back once.
            let managed = unsafe { Box::from_raw(m.cast::<Managed>()) };
            let entry = REGISTRY.lock().remove(&managed.id);
            if let Some(e) = entry {
                if !e.closed && !EXITING.load(Ordering::Relaxed) {
                    // A deleter has no caller to tell: a failure is logged, and the thread's
                    // last error (of whatever call it was in the middle of) stays as it was.
                    let saved = saved_last_error();
                    let call = "gpu-arena DLPack deleter";
                    if close_import(call, e.ptr, e.device, true).is_err() {
                        tracing::warn!("{}", saved_last_error().0.to_string_lossy());
                    }
                    restore_last_error(saved);
                }
            }
            drop(managed);
        }));
    }
    dl_deleter
}

/// A tensor built over a checked view of a decoded share, waiting for its import: what
/// `gpu_arena_import_dlpack` and each entry of `gpu_arena_import_dlpack_many` check and
/// build before importing anything.
struct Prepared {
    /// The tensor, complete but for its data pointer and id.
    managed: Box<Managed>,
    /// Its registry entry, complete but for `managed` and `ptr`.
    entry: Entry,
    flat: bool,
}

/// Check `view` (`view_len` entries) against the share `h` and build the tensor over it,
/// without importing: every error an import's caller can cause comes from here.
fn prepare(h: &ShareHandle, view: *const i64, view_len: usize) -> Result<Prepared, Error> {
    let v = read_view(view, view_len)?;
    if v.nbytes != h.info.len {
        return Err(Error::invalid(format!(
            "the share says {} bytes, its handle {}",
            v.nbytes, h.info.len
        )));
    }
    // The import maps the share on the handle's device: a device tensor claiming another
    // would be used there (a fault, or another device's memory). (DLPack's kDLCPU: the sim
    // backend's memory is host memory. A local item: cbindgen warns about a private one at
    // module level.)
    const DL_CPU: i32 = 1;
    if v.device_type != DL_CPU && v.device_id != h.info.device {
        return Err(Error::invalid(format!(
            "device_id {} (device_type {}) is not the share's device {}",
            v.device_id, v.device_type, h.info.device
        )));
    }
    let flat = v.flat || !spans_whole(&v);
    if flat && v.nbytes % v.itemsize != 0 {
        return Err(Error::invalid(format!(
            "a storage of {} bytes is no whole number of {}-byte elements",
            v.nbytes, v.itemsize
        )));
    }
    let dims: Box<[i64]> = if flat {
        Box::new([(v.nbytes / v.itemsize) as i64, 1])
    } else {
        v.dims.into_boxed_slice()
    };
    let ndim = dims.len() / 2;
    let mut m = Box::new(Managed {
        dl: DlManagedTensor {
            dl_tensor: DlTensor {
                data: std::ptr::null_mut(),
                device: DlDevice {
                    device_type: v.device_type,
                    device_id: v.device_id,
                },
                ndim: ndim as i32,
                dtype: v.dtype,
                shape: std::ptr::null_mut(),
                strides: std::ptr::null_mut(),
                byte_offset: 0,
            },
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(deleter()),
        },
        id: 0,
        dims,
    });
    // Pointers into the dims' own heap allocation: moving the Box leaves them valid.
    let base = m.dims.as_mut_ptr();
    m.dl.dl_tensor.shape = base;
    // SAFETY: `dims` holds 2 * ndim entries: the strides start at ndim (one past the end
    // when ndim == 0, a valid pointer that is never read).
    m.dl.dl_tensor.strides = unsafe { base.add(ndim) };
    Ok(Prepared {
        managed: m,
        entry: Entry {
            managed: 0,
            ptr: 0,
            nbytes: v.nbytes,
            device: h.info.device,
            closed: false,
            share: h.to_bytes(),
        },
        flat,
    })
}

/// Hand out a prepared tensor over its import at `ptr`: a new id, the data pointer, and its
/// entry in `reg` (the registry, locked by the caller). Cannot fail: after the import
/// nothing may, so that no error path has to close it again.
fn publish(reg: &mut BTreeMap<u64, Entry>, p: Prepared, ptr: u64) -> gpu_arena_dlpack_t {
    let Prepared {
        mut managed,
        mut entry,
        flat,
    } = p;
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    managed.id = id;
    managed.dl.dl_tensor.data = ptr as *mut c_void;
    let ndim = managed.dl.dl_tensor.ndim;
    let raw = Box::into_raw(managed);
    // SAFETY: `raw` is the live allocation just leaked; the context points to itself.
    unsafe { (*raw).dl.manager_ctx = raw.cast() };
    entry.managed = raw as usize;
    entry.ptr = ptr;
    reg.insert(id, entry);
    gpu_arena_dlpack_t {
        managed: raw.cast(),
        id,
        flat: i32::from(flat),
        ndim,
    }
}

/// Import `share` (as `gpu_arena_import`) and build a DLPack tensor over it: `out->managed`
/// is a `DLManagedTensor*` whose deleter closes the import (synchronizing the device first)
/// unless `gpu_arena_close_dlpack` closed it already.
///
/// `view` holds `view_len` int64_t: `nbytes` (the shared storage's size: must equal the
/// handle's length), `dtype` (DLPack code | bits << 8 | lanes << 16), `itemsize` (bytes per
/// element), `device_type` and `device_id` (DLPack's: 1 CPU, 2 CUDA, 10 ROCm), `flat` (1:
/// always the 1-D whole-storage tensor), `storage_offset` (elements), `ndim`, then `ndim`
/// sizes and `ndim` strides (elements): `view_len == GPU_ARENA_DLPACK_VIEW_HEAD + 2 * ndim`.
/// When the view starts at offset 0 and spans exactly `nbytes`, the tensor has its shape
/// and strides (`out->flat == 0`); otherwise it is the whole storage, 1-D (`out->flat ==
/// 1`, `nbytes` must be a multiple of `itemsize`). A device tensor (`device_type` not 1) must
/// be on the share's device (`device_id`). Refused (`GPU_ARENA_ERR_INVALID_ARGUMENT`):
/// a view whose elements (from `storage_offset`, with its sizes and strides, negative ones
/// included) reach outside the `nbytes`, a dtype code DLPack does not define (above 17), a
/// dtype whose bits * lanes is not 8 * `itemsize`, `ndim` outside 0..=64. Everything is
/// checked before the import: a rejected call imports nothing. Initializes lazily.
#[no_mangle]
pub extern "C" fn gpu_arena_import_dlpack(
    share: *const gpu_arena_share_t,
    view: *const i64,
    view_len: usize,
    out: *mut gpu_arena_dlpack_t,
) -> c_int {
    const CALL: &str = "gpu_arena_import_dlpack";
    guard(CALL, || {
        if out.is_null() {
            return Err(fail(CALL, Error::invalid("out is NULL")));
        }
        let h = read_handle(CALL, share)?;
        let p = prepare(&h, view, view_len).map_err(|e| fail(CALL, e))?;
        let ptr = importer(CALL)?.import(&h).map_err(|e| {
            let call = format!(
                "{CALL}(producer pid {}, share {})",
                h.producer_pid, h.info.share_key
            );
            fail(&call, e)
        })?;
        let t = publish(&mut REGISTRY.lock(), p, ptr);
        // SAFETY: `out` is non-null and points to a writable gpu_arena_dlpack_t.
        unsafe { out.write(t) };
        Ok(GPU_ARENA_OK)
    })
}

/// Import `n` shares in one call and build a DLPack tensor over each, as `n` calls of
/// `gpu_arena_import_dlpack` would (the same checks, tensors, ids and listing), with the
/// imports made as `gpu_arena_import_many` makes them: one round trip per producer and
/// device (per 120 shares) for shares of arenas this process maps already.
///
/// `shares` holds the `n` handles. `views` holds the `n` views back to back, each laid out
/// as `gpu_arena_import_dlpack`'s `view`: entry `i`'s is the `view_lens[i]` int64_t that
/// start after those of entries `0..i` (`view_lens` holds `n` lengths). `out[i]` receives
/// entry `i`'s tensor; each tensor's deleter closes its own import (synchronizing the
/// device first), and `gpu_arena_close_dlpack` closes one early by its `out[i].id`.
///
/// All or nothing: every entry is checked before anything is imported, and when an entry
/// is refused (the last error names it, `(entry i)`) or an import fails, nothing is
/// imported, nothing is listed and `out` is not written. `n == 0` does nothing (any pointer
/// may then be NULL); with `n > 0` a NULL pointer is refused, as is `n` above
/// `GPU_ARENA_BATCH_MAX`. Initializes lazily.
#[no_mangle]
pub extern "C" fn gpu_arena_import_dlpack_many(
    shares: *const gpu_arena_share_t,
    n: usize,
    views: *const i64,
    view_lens: *const usize,
    out: *mut gpu_arena_dlpack_t,
) -> c_int {
    const CALL: &str = "gpu_arena_import_dlpack_many";
    guard(CALL, || {
        batch_len(CALL, n)?;
        if n == 0 {
            return Ok(GPU_ARENA_OK);
        }
        if shares.is_null() || views.is_null() || view_lens.is_null() || out.is_null() {
            return Err(fail(
                CALL,
                Error::invalid("shares, views, view_lens or out is NULL"),
            ));
        }
        // SAFETY: non-null, and per the header `shares` holds n readable handles (plain
        // bytes: any bit pattern is valid) and `view_lens` n readable lengths.
        let (raw, lens) = unsafe {
            (
                std::slice::from_raw_parts(shares, n),
                std::slice::from_raw_parts(view_lens, n),
            )
        };
        let mut handles = Vec::with_capacity(n);
        let mut prepared = Vec::with_capacity(n);
        // Where entry i's view starts in `views`. An entry's length is checked (against
        // its own ndim) before the next entry's start is computed from it.
        let mut start = 0usize;
        for (i, (s, &len)) in raw.iter().zip(lens).enumerate() {
            let entry = |e| fail(&format!("{CALL}(entry {i})"), e);
            let h = ShareHandle::from_bytes(&s.bytes).map_err(entry)?;
            prepared.push(prepare(&h, views.wrapping_add(start), len).map_err(entry)?);
            handles.push(h);
            start += len;
        }
        let importer = importer(CALL)?;
        let ptrs = importer.import_many(&handles).map_err(|e| fail(CALL, e))?;
        if ptrs.len() != n {
            let _ = importer.close_many(&ptrs);
            let why = format!("{} imports for {n} shares", ptrs.len());
            return Err(fail(CALL, Error::Internal(why)));
        }
        let mut reg = REGISTRY.lock();
        for (i, (p, ptr)) in prepared.into_iter().zip(ptrs).enumerate() {
            let t = publish(&mut reg, p, ptr);
            // SAFETY: i < n, and `out` points to n writable gpu_arena_dlpack_t.
            unsafe { out.add(i).write(t) };
        }
        Ok(GPU_ARENA_OK)
    })
}

/// Close the import `id` of `gpu_arena_import_dlpack` now, synchronizing its device first
/// (the tensor over it must not be used afterwards; its deleter then only frees). Returns 1
/// if this call closed it, 0 if it was closed already, `GPU_ARENA_ERR_UNKNOWN_POINTER` when
/// no live import has this id (its tensor was freed).
#[no_mangle]
pub extern "C" fn gpu_arena_close_dlpack(id: u64) -> c_int {
    const CALL: &str = "gpu_arena_close_dlpack";
    guard(CALL, || {
        existing_pool(CALL)?;
        close_id(CALL, id, true)
    })
}

/// Hand back a managed tensor of `gpu_arena_import_dlpack` that no consumer took: closes
/// its import (without synchronizing: nothing used it) and frees it, as its deleter would.
/// NULL does nothing. A pointer that is not a live managed tensor of this library (never
/// one, or released or deleted already) is refused with `GPU_ARENA_ERR_UNKNOWN_POINTER`
/// and not read.
#[no_mangle]
pub extern "C" fn gpu_arena_release_dlpack(managed: *mut c_void) -> c_int {
    const CALL: &str = "gpu_arena_release_dlpack";
    guard(CALL, || {
        if managed.is_null() {
            return Ok(GPU_ARENA_OK);
        }
        // Found by address, without reading through `managed`; the import is closed with
        // the lock released (a driver call, and a message to the producer).
        let to_close = {
            let mut reg = REGISTRY.lock();
            let Some(e) = reg.values_mut().find(|e| e.managed == managed as usize) else {
                return Err(fail(
                    CALL,
                    Error::UnknownPointer {
                        ptr: managed as u64,
                        why: "not a live DLManagedTensor of gpu_arena_import_dlpack".into(),
                    },
                ));
            };
            let close = !e.closed && !EXITING.load(Ordering::Relaxed);
            e.closed = true;
            close.then_some((e.ptr, e.device))
        };
        let closed = match to_close {
            Some((ptr, device)) => close_import(CALL, ptr, device, false),
            None => Ok(()),
        };
        // SAFETY: the registry holds `managed`, so it is a live Managed whose deleter is
        // ours and that no consumer took (per the header); the deleter takes it back once.
        unsafe { deleter()(managed.cast()) };
        closed.map(|()| GPU_ARENA_OK)
    })
}

/// The live imports of `gpu_arena_import_dlpack` (those whose tensor was not freed yet,
/// closed or not), oldest first: the first `cap` go to `out` (NULL when `cap == 0`).
/// Returns how many there are (capped at INT_MAX).
#[no_mangle]
pub extern "C" fn gpu_arena_dlpack_imports(
    out: *mut gpu_arena_dlpack_import_t,
    cap: usize,
) -> c_int {
    const CALL: &str = "gpu_arena_dlpack_imports";
    guard(CALL, || {
        if out.is_null() && cap > 0 {
            return Err(fail(CALL, Error::invalid("out is NULL")));
        }
        let reg = REGISTRY.lock();
        for (i, (&id, e)) in reg.iter().take(cap).enumerate() {
            // SAFETY: i < cap, and `out` points to `cap` writable entries.
            unsafe {
                out.add(i).write(gpu_arena_dlpack_import_t {
                    id,
                    ptr: e.ptr as *mut c_void,
                    nbytes: e.nbytes,
                    device: e.device,
                    closed: i32::from(e.closed),
                    share: gpu_arena_share_t { bytes: e.share },
                })
            };
        }
        Ok(c_int::try_from(reg.len()).unwrap_or(c_int::MAX))
    })
}

/// The process is ending: from now on the deleters of `gpu_arena_import_dlpack`'s tensors
/// free their memory and close nothing (the process's exit closes its imports; a language
/// runtime tearing down may free tensors when talking to a producer no longer works).
#[no_mangle]
pub extern "C" fn gpu_arena_dlpack_exiting() {
    EXITING.store(true, Ordering::Relaxed);
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    //! `gpu_arena_import_dlpack_many` across real processes on the sim backend: this test
    //! shares, a child process running the ignored consumer test of this binary imports
    //! (gpu-arena initializes once per process; sim memory is host memory both can read).

    use std::ffi::CStr;
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant};

    use super::*;
    use crate::dlpack_view::tests::view;
    use crate::errors::{
        gpu_arena_last_error, GPU_ARENA_ERR_INVALID_ARGUMENT as INVALID, GPU_ARENA_ERR_IPC,
    };
    use crate::init::gpu_arena_configure as configure;
    use crate::ipc_api::{gpu_arena_close, gpu_arena_import, gpu_arena_imports_live as live};

    /// The share handles, hex, from the producer to the consumer.
    const SHARES_ENV: &str = "GPU_ARENA_TEST_DLPACK_MANY_SHARES";
    /// N shares of ELEMS float32 each, share i from element i * ELEMS of one allocation.
    const N: usize = 5;
    const ELEMS: usize = 1024;
    const NBYTES: i64 = 4 * ELEMS as i64;
    const NONE: gpu_arena_dlpack_t = gpu_arena_dlpack_t {
        managed: std::ptr::null_mut(),
        id: 0,
        flat: -1,
        ndim: -1,
    };

    fn last_error() -> String {
        // SAFETY: never NULL, valid until the next gpu-arena call on this thread: copied.
        let e = unsafe { CStr::from_ptr(gpu_arena_last_error()) };
        e.to_string_lossy().into_owned()
    }

    fn listed() -> Vec<gpu_arena_dlpack_import_t> {
        let n = gpu_arena_dlpack_imports(std::ptr::null_mut(), 0) as usize;
        let mut out = Vec::with_capacity(n);
        assert_eq!(gpu_arena_dlpack_imports(out.as_mut_ptr(), n), n as c_int);
        // SAFETY: the call wrote the first n entries (nothing imports concurrently here).
        unsafe { out.set_len(n) };
        out
    }

    /// The tensor of a live `managed` this library handed out.
    fn tensor(t: &gpu_arena_dlpack_t) -> &DlTensor {
        // SAFETY: a live DLManagedTensor of this library, not deleted yet.
        unsafe { &(*t.managed.cast::<DlManagedTensor>()).dl_tensor }
    }

    fn delete(t: &gpu_arena_dlpack_t) {
        let m = t.managed.cast::<DlManagedTensor>();
        // SAFETY: a live DLManagedTensor of this library, deleted once, as a consumer does.
        unsafe { ((*m).deleter.unwrap())(m) };
    }

    /// One batched call over `shares` and `views` (their lengths the view_lens).
    fn many(shares: &[gpu_arena_share_t], views: &[Vec<i64>]) -> (c_int, Vec<gpu_arena_dlpack_t>) {
        let lens: Vec<usize> = views.iter().map(Vec::len).collect();
        let (flat, n) = (views.concat(), shares.len());
        let mut out = vec![NONE; n];
        let (sp, op) = (shares.as_ptr(), out.as_mut_ptr());
        let rc = gpu_arena_import_dlpack_many(sp, n, flat.as_ptr(), lens.as_ptr(), op);
        (rc, out)
    }

    #[test]
    fn import_dlpack_many_in_another_process() {
        assert_eq!(configure(c"backend=sim".as_ptr()), GPU_ARENA_OK);
        let bytes = (N * ELEMS * 4) as libc::ssize_t;
        let base = crate::alloc_api::gpu_arena_malloc(bytes, 0, std::ptr::null_mut()).cast::<f32>();
        assert!(!base.is_null(), "{}", last_error());
        let (mut shares, mut hex) = (Vec::new(), String::new());
        for i in 0..N * ELEMS {
            // SAFETY: sim memory is host memory, and `base` holds N * ELEMS float32.
            unsafe { base.add(i).write(i as f32) };
        }
        for i in 0..N {
            let mut s = gpu_arena_share_t { bytes: [0; 128] };
            // SAFETY: in bounds: share i is elements i * ELEMS .. (i + 1) * ELEMS.
            let at = unsafe { base.add(i * ELEMS) };
            let rc = crate::ipc_api::gpu_arena_share(at.cast(), NBYTES as usize, &mut s);
            assert_eq!(rc, GPU_ARENA_OK, "{}", last_error());
            hex.extend(s.bytes.iter().map(|b| format!("{b:02x}")));
            shares.push(s);
        }
        let name = "dlpack_api::tests::consumer_of_import_dlpack_many";
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([name, "--exact", "--ignored", "--nocapture"])
            .env(SHARES_ENV, hex)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let start = Instant::now();
        while child.try_wait().unwrap().is_none() && start.elapsed() < Duration::from_secs(120) {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill(); // Hung: the status below says so.
        let out = child.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&[out.stdout, out.stderr].concat()).into_owned();
        assert!(out.status.success(), "the consumer failed:\n{text}");
        assert!(text.contains("consumer done"), "it did not run:\n{text}");
        let unshared = shares
            .iter()
            .all(|s| crate::ipc_api::gpu_arena_unshare(s) == 0);
        assert!(unshared, "{}", last_error());
        let rc = crate::alloc_api::gpu_arena_free_checked(base.cast(), bytes, 0);
        assert_eq!(rc, GPU_ARENA_OK, "{}", last_error());
    }

    /// The consumer half of `import_dlpack_many_in_another_process`, which runs it in a
    /// child process with the shares in its environment.
    #[test]
    #[ignore = "run by import_dlpack_many_in_another_process in a child process"]
    fn consumer_of_import_dlpack_many() {
        let Ok(hex) = std::env::var(SHARES_ENV) else {
            return eprintln!("{SHARES_ENV} unset: its producer's test runs it");
        };
        assert_eq!(configure(c"backend=sim".as_ptr()), GPU_ARENA_OK);
        let byte = |i: usize| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap();
        let shares: Vec<gpu_arena_share_t> = (0..N)
            .map(|s| gpu_arena_share_t {
                bytes: std::array::from_fn(|b| byte(128 * s + b)),
            })
            .collect();
        // Whole 1-D, 2-D, transposed, offset (flat), flagged flat.
        let mut good = vec![
            view(NBYTES, 4, 0, &[1024], &[1]),
            view(NBYTES, 4, 0, &[32, 32], &[32, 1]),
            view(NBYTES, 4, 0, &[32, 32], &[1, 32]),
            view(NBYTES, 4, 32, &[31, 32], &[32, 1]),
            view(NBYTES, 4, 0, &[1024], &[1]),
        ];
        good[4][5] = 1;

        // A refused entry: named; nothing imported, listed or written.
        let refused = |s: &[gpu_arena_share_t], v: &[Vec<i64>], code: c_int, says: &str| {
            let (rc, out) = many(s, v);
            let e = last_error();
            assert!(
                rc == code && e.contains(says),
                "want {code} `{says}`: {rc} {e}"
            );
            assert!(e.starts_with("gpu_arena_import_dlpack_many"), "{e}");
            assert!(out.iter().all(|o| o.managed.is_null()), "{e}");
            assert_eq!((live(), listed().len()), (0, 0), "{e}");
        };
        let with = |k: usize, v: Vec<i64>| {
            let mut all = good.clone();
            all[k] = v;
            all
        };
        let past_end = with(3, view(NBYTES, 4, 0, &[1025], &[1]));
        refused(&shares, &past_end, INVALID, "(entry 3)");
        let short = with(1, good[1][..good[1].len() - 1].to_vec());
        refused(&shares, &short, INVALID, "(entry 1)");
        let too_long = with(4, view(2 * NBYTES, 4, 0, &[1024], &[1]));
        refused(&shares, &too_long, INVALID, "(entry 4)");
        let mut other_device = good[2].clone();
        (other_device[3], other_device[4]) = (2, 1);
        refused(&shares, &with(2, other_device), INVALID, "(entry 2)");
        let mut bad = shares.clone();
        bad[0].bytes[0] ^= 0xff;
        refused(&bad, &good, GPU_ARENA_ERR_IPC, "(entry 0)");
        // Refused by the producer at the import (a batch after entry 0 mapped the arena).
        let mut h = ShareHandle::from_bytes(&shares[2].bytes).unwrap();
        h.info.token[0] ^= 1;
        bad = shares.clone();
        bad[2].bytes = h.to_bytes();
        refused(&bad, &good, GPU_ARENA_ERR_IPC, "refused the import");
        let mut o = NONE;
        let (s, v, l, o) = (shares.as_ptr(), good[0].as_ptr(), &good[0].len(), &mut o);
        for rc in [
            gpu_arena_import_dlpack_many(std::ptr::null(), 1, v, l, o),
            gpu_arena_import_dlpack_many(s, 1, std::ptr::null(), l, o),
            gpu_arena_import_dlpack_many(s, 1, v, std::ptr::null(), o),
            gpu_arena_import_dlpack_many(s, 1, v, l, std::ptr::null_mut()),
            gpu_arena_import_dlpack_many(s, crate::ipc_api::GPU_ARENA_BATCH_MAX + 1, v, l, o),
        ] {
            assert_eq!(rc, INVALID, "{}", last_error());
        }
        let (z, zm) = (std::ptr::null(), std::ptr::null_mut());
        let rc = gpu_arena_import_dlpack_many(z, 0, z.cast(), z.cast(), zm);
        assert_eq!((rc, live()), (GPU_ARENA_OK, 0), "n == 0");

        // The batch gives the tensors of single calls, over gpu_arena_import's addresses.
        let (rc, out) = many(&shares, &good);
        assert_eq!((rc, live()), (GPU_ARENA_OK, N as c_int), "{}", last_error());
        let list = listed();
        assert_eq!(list.len(), N);
        for (i, (t, l)) in out.iter().zip(&list).enumerate() {
            let d = tensor(t);
            assert_eq!(
                (l.id, l.ptr, l.nbytes, l.closed),
                (t.id, d.data, NBYTES as u64, 0)
            );
            assert_eq!(
                (l.share.bytes, t.flat, t.ndim),
                (shares[i].bytes, [0, 0, 0, 1, 1][i], [1, 2, 2, 1, 1][i])
            );
            let mut p = std::ptr::null_mut();
            assert_eq!(gpu_arena_import(&shares[i], &mut p), GPU_ARENA_OK);
            assert_eq!((p, gpu_arena_close(p)), (d.data, GPU_ARENA_OK), "entry {i}");
            let mut one = NONE;
            let rc = gpu_arena_import_dlpack(&shares[i], good[i].as_ptr(), good[i].len(), &mut one);
            assert_eq!(rc, GPU_ARENA_OK, "{}", last_error());
            let summary = |d: &DlTensor| {
                // SAFETY: `shape` and `strides` are ndim entries each, back to back.
                let dims = unsafe { std::slice::from_raw_parts(d.shape, 2 * d.ndim as usize) };
                let dt = (d.dtype.code, d.dtype.bits, d.dtype.lanes);
                (
                    d.data,
                    d.device.device_type,
                    d.device.device_id,
                    dt,
                    dims.to_vec(),
                )
            };
            assert_eq!(
                (one.flat, one.ndim, summary(tensor(&one))),
                (t.flat, t.ndim, summary(d))
            );
            assert_eq!(summary(d).3, (2, 32, 1));
            assert_eq!(gpu_arena_release_dlpack(one.managed), GPU_ARENA_OK);
            // SAFETY: the import maps NBYTES readable bytes at `data`.
            let xs = unsafe { std::slice::from_raw_parts(d.data.cast::<f32>(), ELEMS) };
            let want: Vec<f32> = (0..ELEMS).map(|k| (i * ELEMS + k) as f32).collect();
            assert_eq!(xs, want, "entry {i}: the producer's bytes");
        }
        assert_eq!(live(), N as c_int);

        // Each deleter closes its own import; one closed early only frees.
        delete(&out[1]);
        assert_eq!(live(), N as c_int - 1);
        assert!(listed().iter().all(|l| l.id != out[1].id));
        assert_eq!(
            (gpu_arena_close_dlpack(out[3].id), live()),
            (1, N as c_int - 2)
        );
        delete(&out[3]);
        assert_eq!((live(), listed().len()), (N as c_int - 2, N - 2));
        [&out[0], &out[2], &out[4]].into_iter().for_each(delete);
        assert_eq!((live(), listed().len()), (0, 0));

        // More than one round trip's 120 shares: the same ranges imported again and again.
        let m = 250;
        let s: Vec<gpu_arena_share_t> = (0..m).map(|i| shares[i % N]).collect();
        let v: Vec<Vec<i64>> = (0..m).map(|i| good[i % N].clone()).collect();
        let (rc, out) = many(&s, &v);
        assert_eq!((rc, live(), listed().len()), (GPU_ARENA_OK, m as c_int, m));
        assert!(out.windows(2).all(|w| w[0].id < w[1].id));
        out.iter().for_each(delete);
        assert_eq!((live(), listed().len()), (0, 0));
        println!("consumer done");
    }
}
