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

use gpu_arena::Error;
use parking_lot::Mutex;

use crate::ipc_api::{importer, read_handle};
use crate::{
    existing_pool, fail, gpu_arena_share_t, guard, restore_last_error, saved_last_error,
    GPU_ARENA_OK,
};

/// Entries of the view array `gpu_arena_import_dlpack` reads before the shape and strides.
pub const GPU_ARENA_DLPACK_VIEW_HEAD: usize = 8;

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
struct DlDataType {
    code: u8,
    bits: u8,
    lanes: u16,
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
    share: [u8; crate::GPU_ARENA_SHARE_BYTES],
}

/// id -> open import, in the order they were made. An entry leaves when its deleter runs.
static REGISTRY: Mutex<BTreeMap<u64, Entry>> = Mutex::new(BTreeMap::new());
static NEXT_ID: AtomicU64 = AtomicU64::new(1);
/// Set by `gpu_arena_dlpack_exiting`: deleters free their memory and close nothing.
static EXITING: AtomicBool = AtomicBool::new(false);

/// The caller's view, read from the `int64_t` array (layout in `gpu_arena_import_dlpack`).
struct View {
    nbytes: u64,
    dtype: DlDataType,
    itemsize: u64,
    device_type: i32,
    device_id: i32,
    flat: bool,
    storage_offset: i64,
    /// The `ndim` sizes, then the `ndim` strides: the layout of `Managed::dims` (a view
    /// kept as it is becomes the tensor's dims without another copy).
    dims: Vec<i64>,
}

impl View {
    fn shape(&self) -> &[i64] {
        &self.dims[..self.dims.len() / 2]
    }

    fn strides(&self) -> &[i64] {
        &self.dims[self.dims.len() / 2..]
    }
}

fn read_view(view: *const i64, len: usize) -> Result<View, Error> {
    if view.is_null() {
        return Err(Error::invalid("view is NULL"));
    }
    if len < GPU_ARENA_DLPACK_VIEW_HEAD {
        return Err(Error::invalid(format!(
            "view has {len} entries, fewer than its {GPU_ARENA_DLPACK_VIEW_HEAD}-entry head"
        )));
    }
    // SAFETY: non-null, and per the header it points to `len` readable int64_t; read
    // unaligned (a caller may pass the bytes of a packed buffer).
    let at = |i: usize| unsafe { view.add(i).read_unaligned() };
    let ndim = at(7);
    if !(0..=64).contains(&ndim) || len as i64 != GPU_ARENA_DLPACK_VIEW_HEAD as i64 + 2 * ndim {
        return Err(Error::invalid(format!(
            "view of {len} entries with ndim {ndim} (expected {GPU_ARENA_DLPACK_VIEW_HEAD} + 2 * ndim, ndim <= 64)"
        )));
    }
    let n = ndim as usize;
    let dims: Vec<i64> = (0..2 * n)
        .map(|i| at(GPU_ARENA_DLPACK_VIEW_HEAD + i))
        .collect();
    let dtype = at(1);
    // The highest DLPack type code (`kDLFloat4_e2m1fn`, DLPack 1.1). (A local item:
    // cbindgen warns about a private one at module level.)
    const DL_MAX_TYPE_CODE: i64 = 17;
    if !(0..1 << 32).contains(&dtype) || (dtype & 0xff) > DL_MAX_TYPE_CODE {
        return Err(Error::invalid(format!(
            "dtype {dtype:#x} is no DLPack dtype (code <= {DL_MAX_TYPE_CODE} | bits << 8 | lanes << 16)"
        )));
    }
    let v = View {
        nbytes: u64::try_from(at(0)).map_err(|_| Error::invalid("negative nbytes"))?,
        dtype: DlDataType {
            code: (dtype & 0xff) as u8,
            bits: ((dtype >> 8) & 0xff) as u8,
            lanes: ((dtype >> 16) & 0xffff) as u16,
        },
        itemsize: u64::try_from(at(2)).unwrap_or(0),
        device_type: i32::try_from(at(3))
            .map_err(|_| Error::invalid("device_type out of range"))?,
        device_id: i32::try_from(at(4)).map_err(|_| Error::invalid("device_id out of range"))?,
        flat: at(5) != 0,
        storage_offset: at(6),
        dims,
    };
    if v.itemsize == 0
        || v.dtype.lanes == 0
        || u64::from(v.dtype.bits) * u64::from(v.dtype.lanes) != 8 * v.itemsize
    {
        return Err(Error::invalid(format!(
            "dtype (code {}, bits {}, lanes {}) and itemsize {} disagree",
            v.dtype.code, v.dtype.bits, v.dtype.lanes, v.itemsize
        )));
    }
    if v.shape().iter().any(|&d| d < 0) || v.storage_offset < 0 {
        return Err(Error::invalid(format!(
            "negative size in shape {:?} or storage offset {}",
            v.shape(),
            v.storage_offset
        )));
    }
    if !fits(&v) {
        return Err(Error::invalid(format!(
            "a view (storage offset {}, shape {:?}, strides {:?}) of {}-byte elements reaches outside the {}-byte storage",
            v.storage_offset,
            v.shape(),
            v.strides(),
            v.itemsize,
            v.nbytes
        )));
    }
    Ok(v)
}

/// Whether every element the view reaches (from its storage offset, with its sizes and
/// strides, negative strides included) lies inside the `nbytes` of storage: the tensor a
/// caller builds from it (flat: with `as_strided`) then reads nothing outside the mapping.
/// An empty view reaches nothing. Any overflow is "no".
fn fits(v: &View) -> bool {
    if v.shape().contains(&0) {
        return true;
    }
    let (mut lo, mut hi) = (v.storage_offset, v.storage_offset);
    for (&d, &s) in v.shape().iter().zip(v.strides()) {
        let Some(reach) = (d - 1).checked_mul(s) else {
            return false;
        };
        let end = if reach < 0 { &mut lo } else { &mut hi };
        match end.checked_add(reach) {
            Some(x) => *end = x,
            None => return false,
        }
    }
    let bytes = u64::try_from(hi)
        .ok()
        .and_then(|h| h.checked_add(1))
        .and_then(|n| n.checked_mul(v.itemsize));
    lo >= 0 && bytes.is_some_and(|b| b <= v.nbytes)
}

/// Whether the view, at storage offset 0, spans exactly `nbytes`: then a tensor built from
/// its shape and strides has the whole share as its storage (what PyTorch's `from_dlpack`
/// gives a storage: the bytes its sizes and strides reach).
fn spans_whole(v: &View) -> bool {
    if v.storage_offset != 0 || v.shape().contains(&0) {
        return false;
    }
    let mut last: i64 = 0;
    for (&d, &s) in v.shape().iter().zip(v.strides()) {
        match (d - 1).checked_mul(s).and_then(|x| last.checked_add(x)) {
            Some(x) if s >= 0 => last = x,
            _ => return false,
        }
    }
    u64::try_from(last)
        .ok()
        .and_then(|n| n.checked_add(1))
        .and_then(|n| n.checked_mul(v.itemsize))
        == Some(v.nbytes)
}

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
        let v = read_view(view, view_len).map_err(|e| fail(CALL, e))?;
        if v.nbytes != h.info.len {
            return Err(fail(
                CALL,
                Error::invalid(format!(
                    "the share says {} bytes, its handle {}",
                    v.nbytes, h.info.len
                )),
            ));
        }
        // The import maps the share on the handle's device: a device tensor claiming
        // another would be used there (a fault, or another device's memory). (DLPack's
        // kDLCPU: the sim backend's memory is host memory. A local item: cbindgen warns
        // about a private one at module level.)
        const DL_CPU: i32 = 1;
        if v.device_type != DL_CPU && v.device_id != h.info.device {
            return Err(fail(
                CALL,
                Error::invalid(format!(
                    "device_id {} (device_type {}) is not the share's device {}",
                    v.device_id, v.device_type, h.info.device
                )),
            ));
        }
        let flat = v.flat || !spans_whole(&v);
        if flat && v.nbytes % v.itemsize != 0 {
            return Err(fail(
                CALL,
                Error::invalid(format!(
                    "a storage of {} bytes is no whole number of {}-byte elements",
                    v.nbytes, v.itemsize
                )),
            ));
        }
        let dims: Box<[i64]> = if flat {
            Box::new([(v.nbytes / v.itemsize) as i64, 1])
        } else {
            v.dims.into_boxed_slice()
        };
        let ndim = dims.len() / 2;
        let importer = importer(CALL)?;
        // Everything that can fail before the import: after it nothing can (short of an
        // allocation failure, which aborts), so no error path has to close it again.
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
        let base = m.dims.as_mut_ptr();
        m.dl.dl_tensor.shape = base;
        // SAFETY: `dims` holds 2 * ndim entries: the strides start at ndim (one past the
        // end when ndim == 0, a valid pointer that is never read).
        m.dl.dl_tensor.strides = unsafe { base.add(ndim) };
        let ptr = importer.import(&h).map_err(|e| {
            let call = format!(
                "{CALL}(producer pid {}, share {})",
                h.producer_pid, h.info.share_key
            );
            fail(&call, e)
        })?;
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        m.id = id;
        m.dl.dl_tensor.data = ptr as *mut c_void;
        let raw = Box::into_raw(m);
        // SAFETY: `raw` is the live allocation just leaked; the context points to itself.
        unsafe { (*raw).dl.manager_ctx = raw.cast() };
        REGISTRY.lock().insert(
            id,
            Entry {
                managed: raw as usize,
                ptr,
                nbytes: v.nbytes,
                device: h.info.device,
                closed: false,
                share: h.to_bytes(),
            },
        );
        // SAFETY: `out` is non-null and points to a writable gpu_arena_dlpack_t.
        unsafe {
            out.write(gpu_arena_dlpack_t {
                managed: raw.cast(),
                id,
                flat: i32::from(flat),
                ndim: ndim as i32,
            })
        };
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
    use super::*;

    fn view(nbytes: i64, itemsize: i64, offset: i64, shape: &[i64], strides: &[i64]) -> Vec<i64> {
        let bits = 8 * itemsize;
        let mut v = vec![nbytes, 2 | bits << 8 | 1 << 16, itemsize, 1, 0, 0, offset];
        v.push(shape.len() as i64);
        v.extend_from_slice(shape);
        v.extend_from_slice(strides);
        v
    }

    fn read(v: &[i64]) -> Result<View, Error> {
        read_view(v.as_ptr(), v.len())
    }

    #[test]
    fn a_view_over_its_whole_storage_needs_no_strides_afterwards() {
        let whole = read(&view(4096, 4, 0, &[32, 32], &[32, 1])).unwrap();
        assert!(spans_whole(&whole));
        let transposed = read(&view(4096, 4, 0, &[32, 32], &[1, 32])).unwrap();
        assert!(spans_whole(&transposed));
        let scalar = read(&view(4, 4, 0, &[], &[])).unwrap();
        assert!(spans_whole(&scalar));
        for (offset, shape, strides) in [
            (1, &[1023][..], &[1][..]), // a storage offset
            (0, &[1023], &[1]),         // stops short of the end
            (0, &[32, 16], &[32, 1]),   // a slice of the columns
            (0, &[0, 32], &[32, 1]),    // empty
            (1023, &[1024], &[-1]),     // negative stride
        ] {
            let v = read(&view(4096, 4, offset, shape, strides)).unwrap();
            assert!(!spans_whole(&v), "{offset} {shape:?} {strides:?}");
        }
        // Views read_view refuses: spans_whole says no without overflowing either.
        for (shape, strides) in [
            (vec![1024], vec![-1]),
            (vec![2, i64::MAX], vec![1, i64::MAX]),
            (vec![2], vec![i64::MAX]),
        ] {
            let mut v = read(&view(4096, 4, 0, &[1], &[1])).unwrap();
            v.dims = [shape, strides].concat();
            assert!(!spans_whole(&v), "{:?} {:?}", v.shape(), v.strides());
        }
    }

    #[test]
    fn bad_views_are_refused() {
        let good = view(4096, 4, 0, &[1024], &[1]);
        assert!(read(&good).is_ok());
        assert!(read_view(std::ptr::null(), 10).is_err());
        assert!(read(&good[..GPU_ARENA_DLPACK_VIEW_HEAD - 1]).is_err());
        assert!(
            read(&good[..good.len() - 1]).is_err(),
            "ndim disagrees with the length"
        );
        let mut wrong_bits = good.clone();
        wrong_bits[2] = 2;
        assert!(read(&wrong_bits).is_err(), "32-bit dtype with 2-byte items");
        assert!(read(&view(4096, 4, 0, &[-1], &[1])).is_err());
        assert!(read(&view(4096, 4, -1, &[1], &[1])).is_err());
        assert!(read(&view(-1, 4, 0, &[1], &[1])).is_err());
        let mut ndim_65 = view(4096, 4, 0, &[1; 65], &[1; 65]);
        assert!(read(&ndim_65).is_err(), "ndim 65");
        ndim_65[7] = -1;
        assert!(read(&ndim_65).is_err(), "negative ndim");
        for dtype in [18 | 32 << 8 | 1 << 16, -1, 1 << 32 | 2 | 32 << 8 | 1 << 16] {
            let mut unknown = good.clone();
            unknown[1] = dtype;
            assert!(read(&unknown).is_err(), "dtype {dtype:#x}");
        }
    }

    #[test]
    fn a_view_reaching_outside_its_storage_is_refused() {
        for (offset, shape, strides) in [
            (0, &[1024][..], &[1][..]), // exactly the storage
            (1023, &[1024], &[-1]),     // backwards, exactly the storage
            (4095, &[0, 8], &[1, 1]),   // empty: reaches nothing
            (1000, &[2, 12], &[12, 1]), // the last 24 elements
            (0, &[4, 4], &[0, 0]),      // broadcast
        ] {
            let v = view(4096, 4, offset, shape, strides);
            assert!(read(&v).is_ok(), "{offset} {shape:?} {strides:?}");
        }
        for (offset, shape, strides) in [
            (0, &[1025][..], &[1][..]),          // one element past the end
            (1, &[1024], &[1]),                  // the offset pushes it out
            (0, &[1024], &[-1]),                 // backwards from 0: before the start
            (0, &[32, 33], &[32, 1]),            // the last row runs over
            (0, &[2], &[i64::MAX]),              // overflows
            (0, &[3, 2], &[i64::MAX / 2, 1]),    // overflows when summed
            (i64::MAX, &[1], &[1]),              // (offset + 1) * itemsize overflows
            (0, &[2, 2], &[i64::MIN, i64::MIN]), // negative overflow
        ] {
            let v = view(4096, 4, offset, shape, strides);
            assert!(read(&v).is_err(), "{offset} {shape:?} {strides:?}");
        }
    }
}
