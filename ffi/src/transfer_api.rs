//! The C API of the transfer engine (`gpu_arena::transfer`): what the NIXL backend
//! `GPU_ARENA` (`python/gpu_arena/native/nixl/`) calls. An engine is named by a number, so
//! a stale or foreign one is refused with a clear error instead of being dereferenced.

#![allow(non_camel_case_types)]

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::Arc;

use gpu_arena::transfer::{Desc, EngineConfig, EngineStats, Op, TransferEngine, XferStatus};
use gpu_arena::Error;
use parking_lot::Mutex;

use crate::errors::{fail, guard, status, Outcome, GPU_ARENA_OK};
use crate::ipc_api::{broker, importer};

/// One descriptor of a transfer: a range and the metadata id of the registration it lies in.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct gpu_arena_xfer_desc_t {
    /// First byte (a remote descriptor's address is the producer's).
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Metadata id (`gpu_arena_xfer_register_mem`, `_load_remote`, `_load_local`).
    pub md: u64,
}

/// A transfer's direction: remote to local.
pub const GPU_ARENA_XFER_READ: c_int = 0;
/// A transfer's direction: local to remote.
pub const GPU_ARENA_XFER_WRITE: c_int = 1;
/// A request prepared (or completed and not posted again).
pub const GPU_ARENA_XFER_IDLE: c_int = 0;
/// A request whose copies are not all complete.
pub const GPU_ARENA_XFER_IN_PROGRESS: c_int = 1;
/// A request whose copies completed (its notification sent).
pub const GPU_ARENA_XFER_DONE: c_int = 2;

/// Called once per notification by `gpu_arena_xfer_take_notifs`: the sending agent and the
/// body, both as bytes with their lengths (valid during the call only).
pub type gpu_arena_xfer_notif_cb = Option<
    unsafe extern "C" fn(
        ctx: *mut c_void,
        agent: *const c_char,
        agent_len: usize,
        body: *const c_char,
        body_len: usize,
    ),
>;

/// The live engines by id, and the last id handed out.
#[derive(Default)]
struct Engines {
    last_id: u64,
    live: HashMap<u64, Arc<TransferEngine>>,
}

static ENGINES: Mutex<Option<Engines>> = Mutex::new(None);

fn engine(call: &str, id: u64) -> Result<Arc<TransferEngine>, c_int> {
    let engines = ENGINES.lock();
    engines
        .as_ref()
        .and_then(|e| e.live.get(&id).cloned())
        .ok_or_else(|| {
            fail(
                call,
                Error::invalid(format!(
                    "engine {id} is not a live transfer engine (freed already?)"
                )),
            )
        })
}

fn text<'a>(call: &str, what: &str, s: *const c_char) -> Result<&'a str, c_int> {
    if s.is_null() {
        return Err(fail(call, Error::invalid(format!("{what} is NULL"))));
    }
    // SAFETY: non-null, and per the header a NUL-terminated string valid for the call.
    let t = unsafe { CStr::from_ptr(s) };
    t.to_str()
        .map_err(|_| fail(call, Error::invalid(format!("{what} is not UTF-8"))))
}

fn bytes<'a>(call: &str, what: &str, p: *const c_char, len: usize) -> Result<&'a [u8], c_int> {
    if len == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(fail(call, Error::invalid(format!("{what} is NULL"))));
    }
    // SAFETY: non-null, and per the header readable for `len` bytes during the call.
    Ok(unsafe { std::slice::from_raw_parts(p.cast::<u8>(), len) })
}

/// Refuse a NULL out-pointer before anything is done (a call that would act and then find
/// nowhere to put its result must change nothing).
fn need<T>(call: &str, out: *mut T, what: &str) -> Result<(), c_int> {
    if out.is_null() {
        return Err(fail(call, Error::invalid(format!("{what} is NULL"))));
    }
    Ok(())
}

fn out_string(call: &str, out: *mut *mut c_char, s: &str) -> Outcome {
    if out.is_null() {
        return Err(fail(call, Error::invalid("out is NULL")));
    }
    let c = CString::new(s)
        .map_err(|_| fail(call, Error::Internal("a NUL in an engine string".into())))?;
    // SAFETY: `out` is non-null and points to a writable `char*`.
    unsafe { out.write(c.into_raw()) };
    Ok(GPU_ARENA_OK)
}

fn out_u64(call: &str, out: *mut u64, v: u64) -> Outcome {
    if out.is_null() {
        return Err(fail(call, Error::invalid("out is NULL")));
    }
    // SAFETY: `out` is non-null and points to a writable uint64_t.
    unsafe { out.write(v) };
    Ok(GPU_ARENA_OK)
}

fn write_status(call: &str, out: *mut c_int, s: XferStatus) -> Outcome {
    if out.is_null() {
        return Err(fail(call, Error::invalid("out_status is NULL")));
    }
    let v = match s {
        XferStatus::Idle => GPU_ARENA_XFER_IDLE,
        XferStatus::InProgress => GPU_ARENA_XFER_IN_PROGRESS,
        XferStatus::Done => GPU_ARENA_XFER_DONE,
    };
    // SAFETY: `out` is non-null and points to a writable int.
    unsafe { out.write(v) };
    Ok(GPU_ARENA_OK)
}

/// Start a transfer engine for agent `agent` over this process's pool, broker and importer
/// (initialized lazily). `*out` receives its id. Free it with `gpu_arena_xfer_engine_free`.
#[no_mangle]
pub extern "C" fn gpu_arena_xfer_engine_new(agent: *const c_char, out: *mut u64) -> c_int {
    const CALL: &str = "gpu_arena_xfer_engine_new";
    guard(CALL, || {
        let agent = text(CALL, "agent", agent)?;
        if out.is_null() {
            return Err(fail(CALL, Error::invalid("out is NULL")));
        }
        let b = broker(CALL)?.clone();
        let i = importer(CALL)?.clone();
        let mut config = EngineConfig::new(agent);
        config.allowed_uids = crate::init::CONFIG
            .get()
            .map(|c| c.allowed_uids.clone())
            .unwrap_or_default();
        let e = TransferEngine::start(b, i, config)
            .map_err(|e| fail(&format!("{CALL}({agent})"), e))?;
        let mut engines = ENGINES.lock();
        let engines = engines.get_or_insert_with(Engines::default);
        engines.last_id += 1;
        engines.live.insert(engines.last_id, Arc::new(e));
        out_u64(CALL, out, engines.last_id)
    })
}

/// Stop an engine: waits for its requests in flight, closes its imports, ends its
/// registrations (consumers told and waited for, bounded) and stops its thread.
#[no_mangle]
pub extern "C" fn gpu_arena_xfer_engine_free(engine_id: u64) -> c_int {
    const CALL: &str = "gpu_arena_xfer_engine_free";
    guard(CALL, || {
        let e = ENGINES
            .lock()
            .as_mut()
            .and_then(|e| e.live.remove(&engine_id));
        match e {
            Some(e) => {
                drop(e);
                Ok(GPU_ARENA_OK)
            }
            None => Err(fail(
                CALL,
                Error::invalid(format!(
                    "engine {engine_id} is not a live transfer engine (freed twice?)"
                )),
            )),
        }
    })
}

/// The engine's connection info (its socket name) into `*out` (free with
/// `gpu_arena_string_free`).
#[no_mangle]
pub extern "C" fn gpu_arena_xfer_conn_info(engine_id: u64, out: *mut *mut c_char) -> c_int {
    const CALL: &str = "gpu_arena_xfer_conn_info";
    guard(CALL, || {
        out_string(CALL, out, engine(CALL, engine_id)?.conn_info())
    })
}

/// Remember how to reach `agent` (its connection info).
#[no_mangle]
pub extern "C" fn gpu_arena_xfer_load_conn_info(
    engine_id: u64,
    agent: *const c_char,
    info: *const c_char,
) -> c_int {
    const CALL: &str = "gpu_arena_xfer_load_conn_info";
    guard(CALL, || {
        let e = engine(CALL, engine_id)?;
        let (agent, info) = (text(CALL, "agent", agent)?, text(CALL, "info", info)?);
        status(|| format!("{CALL}({agent})"), e.load_conn_info(agent, info))
    })
}

/// Forget `agent`'s connection info.
#[no_mangle]
pub extern "C" fn gpu_arena_xfer_forget_agent(engine_id: u64, agent: *const c_char) -> c_int {
    const CALL: &str = "gpu_arena_xfer_forget_agent";
    guard(CALL, || {
        engine(CALL, engine_id)?.forget_agent(text(CALL, "agent", agent)?);
        Ok(GPU_ARENA_OK)
    })
}

/// Register `len` bytes at `addr` (inside one live gpu-arena allocation); `*out_md`
/// receives its metadata id.
#[no_mangle]
pub extern "C" fn gpu_arena_xfer_register_mem(
    engine_id: u64,
    addr: u64,
    len: u64,
    out_md: *mut u64,
) -> c_int {
    const CALL: &str = "gpu_arena_xfer_register_mem";
    guard(CALL, || {
        need(CALL, out_md, "out_md")?;
        let md = engine(CALL, engine_id)?
            .register(addr, len)
            .map_err(|e| fail(&format!("{CALL}({addr:#x}, {len})"), e))?;
        out_u64(CALL, out_md, md)
    })
}

/// End a registration: no new import, consumers told to close theirs, waited for (bounded).
#[no_mangle]
pub extern "C" fn gpu_arena_xfer_deregister_mem(engine_id: u64, md: u64) -> c_int {
    const CALL: &str = "gpu_arena_xfer_deregister_mem";
    guard(CALL, || {
        status(
            || format!("{CALL}({md:#x})"),
            engine(CALL, engine_id)?.deregister(&[md]),
        )
    })
}

/// A registration's public data (text) into `*out` (free with `gpu_arena_string_free`).
#[no_mangle]
pub extern "C" fn gpu_arena_xfer_public_data(
    engine_id: u64,
    md: u64,
    out: *mut *mut c_char,
) -> c_int {
    const CALL: &str = "gpu_arena_xfer_public_data";
    guard(CALL, || {
        let s = engine(CALL, engine_id)?
            .public_data(md)
            .map_err(|e| fail(CALL, e))?;
        out_string(CALL, out, &s)
    })
}

/// Load `agent`'s registration from its public data (`len` bytes): imports it; `*out_md`
/// receives its metadata id here.
#[no_mangle]
pub extern "C" fn gpu_arena_xfer_load_remote(
    engine_id: u64,
    agent: *const c_char,
    data: *const c_char,
    len: usize,
    out_md: *mut u64,
) -> c_int {
    const CALL: &str = "gpu_arena_xfer_load_remote";
    guard(CALL, || {
        need(CALL, out_md, "out_md")?;
        let e = engine(CALL, engine_id)?;
        let agent = text(CALL, "agent", agent)?;
        let data = std::str::from_utf8(bytes(CALL, "data", data, len)?).map_err(|_| {
            fail(
                CALL,
                Error::invalid("remote metadata is not text: not made by GPU_ARENA"),
            )
        })?;
        let md = e
            .load_remote(agent, data)
            .map_err(|err| fail(&format!("{CALL}({agent})"), err))?;
        out_u64(CALL, out_md, md)
    })
}

/// Check a local registration for transfers within the agent; `*out_md` receives its id.
#[no_mangle]
pub extern "C" fn gpu_arena_xfer_load_local(engine_id: u64, md: u64, out_md: *mut u64) -> c_int {
    const CALL: &str = "gpu_arena_xfer_load_local";
    guard(CALL, || {
        need(CALL, out_md, "out_md")?;
        let m = engine(CALL, engine_id)?
            .load_local(md)
            .map_err(|e| fail(CALL, e))?;
        out_u64(CALL, out_md, m)
    })
}

/// Unload a remote registration (its import closed once its copies completed); a local id
/// is accepted and changes nothing.
#[no_mangle]
pub extern "C" fn gpu_arena_xfer_unload(engine_id: u64, md: u64) -> c_int {
    const CALL: &str = "gpu_arena_xfer_unload";
    guard(CALL, || {
        status(
            || format!("{CALL}({md:#x})"),
            engine(CALL, engine_id)?.unload(md),
        )
    })
}

/// Prepare a transfer of `count` descriptor pairs with `agent` (this agent's own name for a
/// transfer within it); `op` is `GPU_ARENA_XFER_READ` or `_WRITE`. `*out_req` receives the
/// request id. Every descriptor is checked now.
#[no_mangle]
pub extern "C" fn gpu_arena_xfer_prepare(
    engine_id: u64,
    op: c_int,
    local: *const gpu_arena_xfer_desc_t,
    remote: *const gpu_arena_xfer_desc_t,
    count: usize,
    agent: *const c_char,
    out_req: *mut u64,
) -> c_int {
    const CALL: &str = "gpu_arena_xfer_prepare";
    guard(CALL, || {
        need(CALL, out_req, "out_req")?;
        let e = engine(CALL, engine_id)?;
        let op = match op {
            GPU_ARENA_XFER_READ => Op::Read,
            GPU_ARENA_XFER_WRITE => Op::Write,
            _ => {
                return Err(fail(
                    CALL,
                    Error::invalid(format!("op {op}: 0 (READ) or 1 (WRITE)")),
                ))
            }
        };
        let agent = text(CALL, "agent", agent)?;
        let descs = |p: *const gpu_arena_xfer_desc_t, what: &str| -> Result<Vec<Desc>, c_int> {
            if count == 0 {
                return Ok(Vec::new());
            }
            if p.is_null() {
                return Err(fail(CALL, Error::invalid(format!("{what} is NULL"))));
            }
            // SAFETY: non-null, and per the header `count` readable descriptors.
            let raw = unsafe { std::slice::from_raw_parts(p, count) };
            Ok(raw
                .iter()
                .map(|d| Desc {
                    addr: d.addr,
                    len: d.len,
                    md: d.md,
                })
                .collect())
        };
        let (l, r) = (descs(local, "local")?, descs(remote, "remote")?);
        let req = e
            .prepare(op, &l, &r, agent)
            .map_err(|err| fail(&format!("{CALL}({agent})"), err))?;
        out_u64(CALL, out_req, req)
    })
}

/// Post a prepared request; `notif` (`notif_len` bytes, may be NULL for none) goes to the
/// peer when it completes. `*out_status` receives where it stands.
#[no_mangle]
pub extern "C" fn gpu_arena_xfer_post(
    engine_id: u64,
    req: u64,
    notif: *const c_char,
    notif_len: usize,
    out_status: *mut c_int,
) -> c_int {
    const CALL: &str = "gpu_arena_xfer_post";
    guard(CALL, || {
        need(CALL, out_status, "out_status")?;
        let e = engine(CALL, engine_id)?;
        let body = (!notif.is_null())
            .then(|| bytes(CALL, "notif", notif, notif_len))
            .transpose()?;
        let s = e
            .post(req, body.map(<[u8]>::to_vec))
            .map_err(|err| fail(CALL, err))?;
        write_status(CALL, out_status, s)
    })
}

/// Where a request stands into `*out_status` (on completion its notification is sent).
#[no_mangle]
pub extern "C" fn gpu_arena_xfer_check(engine_id: u64, req: u64, out_status: *mut c_int) -> c_int {
    const CALL: &str = "gpu_arena_xfer_check";
    guard(CALL, || {
        need(CALL, out_status, "out_status")?;
        let s = engine(CALL, engine_id)?
            .check(req)
            .map_err(|e| fail(CALL, e))?;
        write_status(CALL, out_status, s)
    })
}

/// Release a request (one in flight is waited for first).
#[no_mangle]
pub extern "C" fn gpu_arena_xfer_release(engine_id: u64, req: u64) -> c_int {
    const CALL: &str = "gpu_arena_xfer_release";
    guard(CALL, || {
        status(|| CALL.into(), engine(CALL, engine_id)?.release(req))
    })
}

/// Send `len` bytes at `msg` to `agent` as a notification.
#[no_mangle]
pub extern "C" fn gpu_arena_xfer_notify(
    engine_id: u64,
    agent: *const c_char,
    msg: *const c_char,
    len: usize,
) -> c_int {
    const CALL: &str = "gpu_arena_xfer_notify";
    guard(CALL, || {
        let e = engine(CALL, engine_id)?;
        let agent = text(CALL, "agent", agent)?;
        status(
            || format!("{CALL}({agent})"),
            e.notify(agent, bytes(CALL, "msg", msg, len)?),
        )
    })
}

/// Hand each notification received since the last call to `cb` (oldest first); returns how
/// many (>= 0) or an error code.
#[no_mangle]
pub extern "C" fn gpu_arena_xfer_take_notifs(
    engine_id: u64,
    cb: gpu_arena_xfer_notif_cb,
    ctx: *mut c_void,
) -> c_int {
    const CALL: &str = "gpu_arena_xfer_take_notifs";
    guard(CALL, || {
        let Some(cb) = cb else {
            return Err(fail(CALL, Error::invalid("cb is NULL")));
        };
        let notifs = engine(CALL, engine_id)?.take_notifs();
        for (agent, body) in &notifs {
            // SAFETY: the caller's callback, given pointers valid for their lengths during
            // the call; no gpu-arena lock is held.
            unsafe {
                cb(
                    ctx,
                    agent.as_ptr().cast(),
                    agent.len(),
                    body.as_ptr().cast(),
                    body.len(),
                )
            };
        }
        Ok(c_int::try_from(notifs.len()).unwrap_or(c_int::MAX))
    })
}

/// The engine's counters into `*out`.
#[no_mangle]
pub extern "C" fn gpu_arena_xfer_stats(engine_id: u64, out: *mut EngineStats) -> c_int {
    const CALL: &str = "gpu_arena_xfer_stats";
    guard(CALL, || {
        if out.is_null() {
            return Err(fail(CALL, Error::invalid("out is NULL")));
        }
        let s = engine(CALL, engine_id)?.stats();
        // SAFETY: `out` is non-null and points to a writable gpu_arena_xfer_stats_t (the
        // header's struct is generated from `EngineStats`: the same layout).
        unsafe { out.write(s) };
        Ok(GPU_ARENA_OK)
    })
}
