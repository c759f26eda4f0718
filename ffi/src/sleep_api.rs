//! The C API's tags, sleep and wake (`gpu_arena::tags`, `alloc/src/pool/sleep_wake/sleep.rs`).

use std::ffi::{c_char, c_int, CStr};

use gpu_arena::{tags, Error};

use crate::errors::{fail, guard, GPU_ARENA_OK};
use crate::init::with_pool;

/// `None` for NULL; the string, or an error naming `what`, otherwise.
fn opt_str<'a>(call: &str, what: &str, s: *const c_char) -> Result<Option<&'a str>, c_int> {
    if s.is_null() {
        return Ok(None);
    }
    // SAFETY: non-null, and per the header a NUL-terminated string valid for the call.
    let text = unsafe { CStr::from_ptr(s) };
    text.to_str()
        .map(Some)
        .map_err(|_| fail(call, Error::invalid(format!("{what} is not UTF-8"))))
}

/// The tag indices of a comma-separated list (NULL or "": none), or an error naming `what`.
fn tag_list(call: &str, what: &str, s: *const c_char) -> Result<Vec<u8>, c_int> {
    tags::parse_list(opt_str(call, what, s)?).map_err(|e| fail(call, e))
}

/// `None` for -1 (every device), else the device.
fn device_arg(device: c_int) -> Option<c_int> {
    (device != -1).then_some(device)
}

/// Set this thread's allocation tag: every later allocation of this thread carries it. NULL
/// or "" means "default". A tag is at most 63 bytes of `[A-Za-z0-9_.-]` (else
/// `GPU_ARENA_ERR_INVALID_ARGUMENT`, and nothing changes); a process uses at most 64 tags.
/// Allocations of different tags never share an arena, so each tag sleeps on its own.
#[no_mangle]
pub extern "C" fn gpu_arena_set_tag(tag: *const c_char) -> c_int {
    guard("gpu_arena_set_tag", || {
        let call = "gpu_arena_set_tag";
        let name = opt_str(call, "tag", tag)?;
        tags::set_current(name).map_err(|e| fail(call, e))?;
        Ok(GPU_ARENA_OK)
    })
}

/// Put every awake tag of `device` (-1: every device) to sleep: the contents of the tags
/// named in `offload_tags` (comma-separated; NULL or "": none) are copied to host memory,
/// everything else is discarded; the memory goes back to the driver while every address
/// stays reserved. Waits for the device's pending work first. An arena that is shared with
/// or imported by another process keeps its memory (and contents). While a tag sleeps its
/// allocations fail with `GPU_ARENA_ERR_INVALID_STATE`, frees work, new shares of its memory
/// are refused. Naming an already sleeping tag in `offload_tags`, or a device where every
/// tag already sleeps, is `GPU_ARENA_ERR_INVALID_STATE` and changes nothing (with -1,
/// devices where every tag sleeps are skipped; the error is when no device has an awake
/// tag).
#[no_mangle]
pub extern "C" fn gpu_arena_sleep(device: c_int, offload_tags: *const c_char) -> c_int {
    let call = format!("gpu_arena_sleep(device={device})");
    with_pool("gpu_arena_sleep", |p| {
        let offload = tag_list(&call, "offload_tags", offload_tags)?;
        p.sleep(device_arg(device), &offload)
            .map_err(|e| fail(&call, e))?;
        Ok(GPU_ARENA_OK)
    })
}

/// Put only the tags named in `tags` (comma-separated; NULL or "": every awake tag, as
/// `gpu_arena_sleep`) of `device` (-1: every device) to sleep; the other tags stay awake and
/// keep allocating. The contents of the tags in `offload_tags` (each one of `tags`) are
/// copied to host memory, the rest is discarded, as `gpu_arena_sleep` does. An offload tag
/// not among `tags` is `GPU_ARENA_ERR_INVALID_ARGUMENT`; a named tag that already sleeps is
/// `GPU_ARENA_ERR_INVALID_STATE` (with -1, devices where every named tag sleeps are
/// skipped). An error changes nothing.
#[no_mangle]
pub extern "C" fn gpu_arena_sleep_tags(
    device: c_int,
    tags: *const c_char,
    offload_tags: *const c_char,
) -> c_int {
    let call = format!("gpu_arena_sleep_tags(device={device})");
    with_pool("gpu_arena_sleep_tags", |p| {
        let named = tag_list(&call, "tags", tags)?;
        let offload = tag_list(&call, "offload_tags", offload_tags)?;
        let want = (!named.is_empty()).then_some(named.as_slice());
        p.sleep_tags(device_arg(device), want, &offload)
            .map_err(|e| fail(&call, e))?;
        Ok(GPU_ARENA_OK)
    })
}

/// Wake the tags named in `tags` (comma-separated; NULL or "": every sleeping tag) on
/// `device` (-1: every device): memory is mapped again at the same addresses and offloaded
/// contents are copied back. Waking a tag that is awake (with -1: asleep on no device),
/// waking when nothing sleeps, or waking a device while a CUDA graph capture (a graph pool
/// context) is open on it, is `GPU_ARENA_ERR_INVALID_STATE` and changes nothing. A wake
/// is all or nothing: when the driver refuses memory midway, what this call already woke
/// goes back to sleep (contents kept on the host) and nothing changes;
/// `GPU_ARENA_ERR_OUT_OF_MEMORY` says what the wake needed and what is free. A wake that
/// would pass `max_reserved` is refused the same way before anything is mapped. A copy back
/// that fails undoes the wake too (the driver's error).
#[no_mangle]
pub extern "C" fn gpu_arena_wake(device: c_int, tags: *const c_char) -> c_int {
    let call = format!("gpu_arena_wake(device={device})");
    with_pool("gpu_arena_wake", |p| {
        let named = tag_list(&call, "tags", tags)?;
        let want = (!named.is_empty()).then_some(named.as_slice());
        p.wake(device_arg(device), want)
            .map_err(|e| fail(&call, e))?;
        Ok(GPU_ARENA_OK)
    })
}

/// Pin ahead: make now the host buffers a sleep offloading `offload_tags` (comma-separated,
/// at least one) of `device` (-1: every device) would need, and keep them, so that the first
/// such sleep copies into memory already pinned (pinning fresh host memory is most of a first
/// sleep's time). Sized from the live allocations now; arenas asleep are skipped.
/// `*pinned_bytes` (when not NULL) receives the bytes of host memory made. Blocking: call it
/// from a thread of its own to overlap it with other work. `gpu_arena_sleep_release_host`
/// frees what it made.
#[no_mangle]
pub extern "C" fn gpu_arena_sleep_prepare(
    device: c_int,
    offload_tags: *const c_char,
    pinned_bytes: *mut u64,
) -> c_int {
    let call = format!("gpu_arena_sleep_prepare(device={device})");
    with_pool("gpu_arena_sleep_prepare", |p| {
        let offload = tag_list(&call, "offload_tags", offload_tags)?;
        let made = p
            .prepare_offload(device_arg(device), &offload)
            .map_err(|e| fail(&call, e))?;
        if !pinned_bytes.is_null() {
            // SAFETY: non-null, and per the header a writable uint64_t.
            unsafe { pinned_bytes.write(made) };
        }
        Ok(GPU_ARENA_OK)
    })
}

/// Free the host buffers gpu-arena keeps for the next sleep on `device` (-1: every device).
/// A wake keeps the (pinned) buffer that held an arena's offloaded contents, so the next
/// sleep copies into memory already pinned instead of pinning again
/// (`gpu_arena_stats_t.offload_host_bytes` counts them); this gives that host memory back.
/// Buffers holding a sleeping arena's contents stay. `empty_cache` does not free them.
#[no_mangle]
pub extern "C" fn gpu_arena_sleep_release_host(device: c_int) -> c_int {
    let call = format!("gpu_arena_sleep_release_host(device={device})");
    with_pool("gpu_arena_sleep_release_host", |p| {
        p.release_host_buffers(device_arg(device))
            .map_err(|e| fail(&call, e))?;
        Ok(GPU_ARENA_OK)
    })
}

/// Trim `device` (-1: every device): `gpu_arena_empty_cache`, then every arena that still
/// holds live blocks is cut down to the granularity pages (2 MiB) those blocks use: the
/// pages keep their contents and addresses, the rest of the arena's memory goes back to the
/// driver. Afterwards reserved memory is the pages the survivors touch (plus arenas left
/// whole: shared with or imported by another process, pinned, asleep). `*released_bytes`
/// (when not NULL) receives the bytes given back, `empty_cache`'s included.
///
/// Call it at an idle point, as `gpu_arena_sleep`: it waits for the device's pending work,
/// and nothing may use the device's gpu-arena memory (no kernel, copy or launch from another
/// thread) until it returns, because each cut arena's addresses are briefly unmapped. Other
/// threads' allocations on the device wait for it. CUDA graphs captured before stay valid
/// (same addresses). A cut that the driver refuses (out of memory: the pages kept are
/// allocated before the old memory is freed) leaves that arena whole and is logged.
#[no_mangle]
pub extern "C" fn gpu_arena_trim(device: c_int, released_bytes: *mut u64) -> c_int {
    let call = format!("gpu_arena_trim(device={device})");
    with_pool("gpu_arena_trim", |p| {
        let r = p.trim(device_arg(device)).map_err(|e| fail(&call, e))?;
        if !released_bytes.is_null() {
            // SAFETY: non-null, and per the header a writable uint64_t.
            unsafe { released_bytes.write(r.emptied_bytes + r.released_bytes) };
        }
        Ok(GPU_ARENA_OK)
    })
}
