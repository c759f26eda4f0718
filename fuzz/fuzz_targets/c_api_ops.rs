//! Byte stream -> a sequence of C API calls on the sim backend: malloc of random and bogus
//! sizes (negative, huge), free with the right or a wrong size / device / pointer,
//! record_stream, share, unshare, import, close, empty_cache, trim, stats, validate, snapshot.
//!
//! The calls go to the real exported `gpu_arena_*` functions (ffi/src/lib.rs compiled as an
//! rlib by fuzz/capi). The pool is initialised once per process; each input cleans up what it
//! made (close imports, unshare, free), so every input starts from an empty pool. Checked:
//! no call returns GPU_ARENA_ERR_INTERNAL (a caught panic or broken invariant), no panic,
//! gpu_arena_validate passes on every device after every call, and after the clean-up no
//! allocation, share or import is left.
#![no_main]

use std::ffi::{c_int, c_void, CStr};
use std::sync::Once;

use arbitrary::Arbitrary;
use gpu_arena::PoolStats; // gpu_arena_stats_t in C
use gpu_arena_capi::*;
use libfuzzer_sys::fuzz_target;

const DEVICES: c_int = 2;
/// Fixed 4 MiB arenas.
const CONF: &CStr = c"backend=sim,sim_devices=2,sim_capacity=64MiB,arena_size=4MiB,grow_arenas=0";
/// With `GPU_ARENA_FUZZ_GROW=1`: arenas that grow, the default (growth, chunked exports,
/// `empty_cache`'s shrink and `trim`'s split of grown arenas under the same calls).
const CONF_GROW: &CStr =
    c"backend=sim,sim_devices=2,sim_capacity=64MiB,arena_size=4MiB,grow_arenas=1";

#[derive(Arbitrary, Debug)]
enum Size {
    Small(u16),
    Medium(u32),
    Raw(isize),
    Zero,
}

impl Size {
    fn get(&self) -> isize {
        match *self {
            Size::Small(s) => s as isize,
            Size::Medium(s) => (s % (24 << 20)) as isize,
            Size::Raw(s) => s,
            Size::Zero => 0,
        }
    }
}

#[derive(Arbitrary, Debug)]
enum Dev {
    Zero,
    One,
    Raw(i32),
}

impl Dev {
    fn get(&self) -> c_int {
        match *self {
            Dev::Zero => 0,
            Dev::One => 1,
            Dev::Raw(d) => d,
        }
    }
}

/// Which pointer a free / record_stream / share gets.
#[derive(Arbitrary, Debug)]
enum Ptr {
    Live(u8),
    /// A live allocation's pointer plus an offset (interior, past the end, before it).
    Near(u8, i32),
    /// A pointer freed earlier in this input.
    Freed(u8),
    Raw(usize),
    Null,
}

#[derive(Arbitrary, Debug)]
enum FreeSize {
    Right,
    Rounded,
    Plus(u16),
    Raw(isize),
}

#[derive(Arbitrary, Debug)]
enum ShareRange {
    Whole,
    Sub { off: u32, len: u32 },
    Raw { off: i64, len: usize },
}

#[derive(Arbitrary, Debug)]
enum HandleSel {
    Made(u8),
    /// A handle made here with one byte changed.
    Corrupt(u8, u8, u8),
    Bytes(Vec<u8>),
    Null,
}

#[derive(Arbitrary, Debug)]
enum Op {
    Malloc {
        size: Size,
        dev: Dev,
        stream: u8,
    },
    Free {
        ptr: Ptr,
        size: FreeSize,
        dev: Option<Dev>,
        stream: u8,
    },
    RecordStream {
        ptr: Ptr,
        stream: u8,
    },
    Share {
        ptr: Ptr,
        range: ShareRange,
        null_out: bool,
    },
    Unshare(HandleSel),
    Import {
        handle: HandleSel,
        null_out: bool,
    },
    Close {
        which: u8,
        raw: Option<usize>,
    },
    EmptyCache(Dev),
    /// `gpu_arena_trim` (the sim is always idle, as its contract asks).
    Trim {
        dev: Dev,
        null_out: bool,
    },
    Stats {
        dev: Dev,
        null_out: bool,
    },
    Validate(Dev),
    Snapshot,
}

struct Live {
    ptr: usize,
    size: isize,
    dev: c_int,
}

#[derive(Default)]
struct State {
    live: Vec<Live>,
    freed: Vec<usize>,
    shares: Vec<gpu_arena_share_t>,
    imports: Vec<usize>,
}

fn stream(s: u8) -> *mut c_void {
    match s % 8 {
        0..=3 => (s % 4) as usize as *mut c_void,
        4 => 0x7f00_dead_beef_usize as *mut c_void,
        5 => usize::MAX as *mut c_void,
        _ => ((s as usize) << 12) as *mut c_void,
    }
}

fn last_error() -> String {
    // SAFETY: gpu_arena_last_error never returns NULL and the string lives until the next
    // call on this thread.
    unsafe { CStr::from_ptr(gpu_arena_last_error()) }
        .to_string_lossy()
        .into_owned()
}

/// A return code: anything but an internal error is acceptable for fuzzed arguments.
fn ok_or_clean_error(call: &str, op: &Op, rc: c_int) {
    assert!(
        rc == GPU_ARENA_OK || (rc < 0 && rc != GPU_ARENA_ERR_INTERNAL && rc >= -9),
        "{call} returned {rc} for {op:?}: {}",
        last_error()
    );
}

fn validate_all(op: &Op) {
    for d in 0..DEVICES {
        let rc = gpu_arena_validate(d);
        assert_eq!(
            rc,
            GPU_ARENA_OK,
            "validate({d}) after {op:?}: {}",
            last_error()
        );
    }
}

/// What the pool still holds on any device, or None when it is empty.
fn leftovers() -> Option<String> {
    for d in 0..DEVICES {
        let mut s = PoolStats::default();
        assert_eq!(gpu_arena_stats(d, &mut s), GPU_ARENA_OK);
        if s.allocations != 0
            || s.allocated_bytes != 0
            || s.shares_live != 0
            || s.imports_live != 0
            || s.deferred_free_bytes != 0
            || s.pending_free_bytes != 0
            || s.arenas != 0
        {
            return Some(format!("device {d}: {s:?}"));
        }
    }
    None
}

fn init() {
    static INIT: Once = Once::new();
    INIT.call_once(|| {
        use tracing_subscriber::prelude::*;
        let filter = tracing_subscriber::filter::Targets::new()
            .with_default(tracing::Level::WARN)
            .with_target("gpu_arena::ipc::importer", tracing::Level::DEBUG);
        tracing_subscriber::registry()
            .with(tracing_subscriber::fmt::layer().with_writer(std::io::stderr))
            .with(filter)
            .init();
        let conf = if std::env::var("GPU_ARENA_FUZZ_GROW").as_deref() == Ok("1") {
            CONF_GROW
        } else {
            CONF
        };
        assert_eq!(
            gpu_arena_configure(conf.as_ptr()),
            GPU_ARENA_OK,
            "{}",
            last_error()
        );
        gpu_arena_init(DEVICES);
        assert_eq!(gpu_arena_init_status(), GPU_ARENA_OK, "{}", last_error());
        assert_eq!(gpu_arena_device_count(), DEVICES);
    });
}

impl State {
    fn ptr(&self, p: &Ptr) -> *mut c_void {
        let u = match *p {
            Ptr::Live(i) if !self.live.is_empty() => self.live[i as usize % self.live.len()].ptr,
            Ptr::Near(i, d) if !self.live.is_empty() => self.live[i as usize % self.live.len()]
                .ptr
                .wrapping_add_signed(d as isize),
            Ptr::Freed(i) if !self.freed.is_empty() => self.freed[i as usize % self.freed.len()],
            Ptr::Raw(u) => u,
            _ => 0,
        };
        u as *mut c_void
    }

    fn handle(&self, h: &HandleSel) -> Option<gpu_arena_share_t> {
        match h {
            HandleSel::Made(i) if !self.shares.is_empty() => {
                Some(self.shares[*i as usize % self.shares.len()])
            }
            HandleSel::Corrupt(i, at, x) if !self.shares.is_empty() => {
                let mut s = self.shares[*i as usize % self.shares.len()];
                s.bytes[*at as usize % GPU_ARENA_SHARE_BYTES] ^= x | 1;
                Some(s)
            }
            HandleSel::Bytes(b) => {
                let mut s = gpu_arena_share_t {
                    bytes: [0; GPU_ARENA_SHARE_BYTES],
                };
                let n = b.len().min(GPU_ARENA_SHARE_BYTES);
                s.bytes[..n].copy_from_slice(&b[..n]);
                Some(s)
            }
            _ => None,
        }
    }

    fn run(&mut self, op: &Op) {
        match op {
            Op::Malloc {
                size,
                dev,
                stream: s,
            } => {
                let (size, dev) = (size.get(), dev.get());
                let p = gpu_arena_malloc(size, dev, stream(*s));
                if p.is_null() {
                    let code = gpu_arena_last_error_code();
                    if size != 0 {
                        ok_or_clean_error("malloc", op, code);
                        assert!(code < 0, "malloc returned NULL with code {code} for {op:?}");
                    }
                    if (0..DEVICES).contains(&dev) && size > 0 && size <= 4 << 20 {
                        // Small requests on a real device fail only for lack of memory.
                        assert_eq!(
                            code,
                            GPU_ARENA_ERR_OUT_OF_MEMORY,
                            "{op:?}: {}",
                            last_error()
                        );
                    }
                } else {
                    assert!(
                        size > 0 && (0..DEVICES).contains(&dev),
                        "malloc accepted {op:?}"
                    );
                    assert!(
                        self.live.iter().all(|l| l.ptr != p as usize),
                        "malloc returned a live pointer twice"
                    );
                    self.live.push(Live {
                        ptr: p as usize,
                        size,
                        dev,
                    });
                }
            }
            Op::Free {
                ptr,
                size,
                dev,
                stream: s,
            } => {
                let p = self.ptr(ptr);
                let target = self.live.iter().position(|l| l.ptr == p as usize);
                let (right_size, right_dev) = target
                    .map(|i| (self.live[i].size, self.live[i].dev))
                    .unwrap_or((0, 0));
                let sz = match *size {
                    FreeSize::Right => right_size,
                    FreeSize::Rounded => (right_size + 511) & !511,
                    FreeSize::Plus(x) => right_size.wrapping_add(x as isize),
                    FreeSize::Raw(x) => x,
                };
                let d = dev.as_ref().map_or(right_dev, Dev::get);
                if let (FreeSize::Right, None) = (size, dev) {
                    // The plain pluggable-allocator entry point.
                    gpu_arena_free(p, sz, d, stream(*s));
                    if let Some(i) = target {
                        let l = self.live.swap_remove(i);
                        self.freed.push(l.ptr);
                    }
                    return;
                }
                let rc = gpu_arena_free_checked(p, sz, d);
                ok_or_clean_error("free", op, rc);
                if p.is_null() {
                    assert_eq!(rc, GPU_ARENA_OK);
                } else if target.is_none() {
                    assert_ne!(
                        rc, GPU_ARENA_OK,
                        "free of a non-live pointer accepted: {op:?}"
                    );
                }
                if rc == GPU_ARENA_OK {
                    if let Some(i) = target {
                        let l = self.live.swap_remove(i);
                        self.freed.push(l.ptr);
                    }
                }
            }
            Op::RecordStream { ptr, stream: s } => {
                let p = self.ptr(ptr);
                let rc = gpu_arena_record_stream_checked(p, stream(*s));
                ok_or_clean_error("record_stream", op, rc);
                let live = self.live.iter().any(|l| l.ptr == p as usize);
                assert_eq!(
                    rc == GPU_ARENA_OK,
                    live,
                    "record_stream {op:?}: {}",
                    last_error()
                );
            }
            Op::Share {
                ptr,
                range,
                null_out,
            } => {
                let p = self.ptr(ptr);
                let whole = self
                    .live
                    .iter()
                    .find(|l| l.ptr == p as usize)
                    .map_or(512, |l| l.size as usize);
                let (p, len) = match *range {
                    ShareRange::Whole => (p, whole),
                    ShareRange::Sub { off, len } => (
                        (p as usize).wrapping_add(off as usize % whole) as *mut c_void,
                        len as usize % (whole + 1),
                    ),
                    ShareRange::Raw { off, len } => (
                        (p as usize).wrapping_add_signed(off as isize) as *mut c_void,
                        len,
                    ),
                };
                let mut out = gpu_arena_share_t {
                    bytes: [0; GPU_ARENA_SHARE_BYTES],
                };
                let outp = if *null_out {
                    std::ptr::null_mut()
                } else {
                    &mut out as *mut _
                };
                let rc = gpu_arena_share(p, len, outp);
                ok_or_clean_error("share", op, rc);
                if rc == GPU_ARENA_OK {
                    assert!(!*null_out);
                    self.shares.push(out);
                }
            }
            Op::Unshare(h) => {
                let hs = self.handle(h);
                let hp = hs.as_ref().map_or(std::ptr::null(), |s| s as *const _);
                let rc = gpu_arena_unshare(hp);
                ok_or_clean_error("unshare", op, rc);
            }
            Op::Import { handle, null_out } => {
                let hs = self.handle(handle);
                let hp = hs.as_ref().map_or(std::ptr::null(), |s| s as *const _);
                let mut out: *mut c_void = std::ptr::null_mut();
                let outp = if *null_out {
                    std::ptr::null_mut()
                } else {
                    &mut out as *mut _
                };
                let rc = gpu_arena_import(hp, outp);
                ok_or_clean_error("import", op, rc);
                if rc == GPU_ARENA_OK {
                    assert!(!out.is_null());
                    self.imports.push(out as usize);
                }
            }
            Op::Close { which, raw } => {
                let p = match raw {
                    Some(r) => *r,
                    None if !self.imports.is_empty() => {
                        self.imports[*which as usize % self.imports.len()]
                    }
                    None => 0,
                };
                let rc = gpu_arena_close(p as *mut c_void);
                ok_or_clean_error("close", op, rc);
                if rc == GPU_ARENA_OK {
                    let i = self.imports.iter().position(|&x| x == p);
                    let i = i.expect("close accepted a pointer that is not an open import");
                    self.imports.swap_remove(i);
                }
            }
            Op::EmptyCache(d) => {
                let rc = gpu_arena_empty_cache(d.get());
                ok_or_clean_error("empty_cache", op, rc);
            }
            Op::Trim { dev, null_out } => {
                let mut released = 0u64;
                let out = if *null_out {
                    std::ptr::null_mut()
                } else {
                    &mut released as *mut u64
                };
                let rc = gpu_arena_trim(dev.get(), out);
                ok_or_clean_error("trim", op, rc);
            }
            Op::Stats { dev, null_out } => {
                let mut s = PoolStats::default();
                let outp = if *null_out {
                    std::ptr::null_mut()
                } else {
                    &mut s as *mut _
                };
                let rc = gpu_arena_stats(dev.get(), outp);
                ok_or_clean_error("stats", op, rc);
                if rc == GPU_ARENA_OK {
                    let mine = self.live.iter().filter(|l| l.dev == dev.get()).count() as u64;
                    assert!(
                        s.allocations >= mine,
                        "stats: {} allocations, {mine} live",
                        s.allocations
                    );
                    assert!(
                        s.allocated_bytes <= s.reserved_bytes,
                        "allocated > reserved"
                    );
                }
            }
            Op::Validate(d) => {
                let rc = gpu_arena_validate(d.get());
                ok_or_clean_error("validate", op, rc);
            }
            Op::Snapshot => {
                let s = gpu_arena_snapshot_json();
                assert!(!s.is_null(), "snapshot: {}", last_error());
                gpu_arena_string_free(s);
            }
        }
    }

    /// Undo everything this input made, then check the pool is empty again.
    fn clean_up(&mut self) {
        for p in self.imports.drain(..) {
            assert_eq!(
                gpu_arena_close(p as *mut c_void),
                GPU_ARENA_OK,
                "{}",
                last_error()
            );
        }
        for s in self.shares.drain(..) {
            // Already unshared (by the input) is fine.
            let rc = gpu_arena_unshare(&s);
            assert!(
                rc == GPU_ARENA_OK || rc == GPU_ARENA_ERR_IPC,
                "unshare: {}",
                last_error()
            );
        }
        for l in self.live.drain(..) {
            let rc = gpu_arena_free_checked(l.ptr as *mut c_void, l.size, l.dev);
            assert_eq!(rc, GPU_ARENA_OK, "free at clean-up: {}", last_error());
        }
        assert_eq!(gpu_arena_empty_cache(-1), GPU_ARENA_OK, "{}", last_error());
        if let Some(first) = leftovers() {
            // Tell a late (asynchronous) release from a real leak before failing.
            let t = std::time::Instant::now();
            let mut now = Some(first.clone());
            while now.is_some() && t.elapsed() < std::time::Duration::from_secs(2) {
                std::thread::sleep(std::time::Duration::from_millis(10));
                gpu_arena_empty_cache(-1);
                now = leftovers();
            }
            panic!(
                "left after clean-up: {first}; importer imports_live {}; 2 s later: {}",
                gpu_arena_imports_live(),
                now.as_deref().unwrap_or("released (asynchronously)")
            );
        }
        assert_eq!(gpu_arena_imports_live(), 0);
        validate_all(&Op::Snapshot);
    }
}

fuzz_target!(|ops: Vec<Op>| {
    init();
    let mut st = State::default();
    let trace = std::env::var_os("FUZZ_TRACE").is_some();
    for op in ops.iter().take(64) {
        st.run(op);
        if trace {
            eprintln!(
                "{op:?} -> code {} {} | live {:x?} shares {} imports {:x?}",
                gpu_arena_last_error_code(),
                last_error(),
                st.live.iter().map(|l| l.ptr).collect::<Vec<_>>(),
                st.shares.len(),
                st.imports
            );
        }
        validate_all(op);
    }
    st.clean_up();
});
