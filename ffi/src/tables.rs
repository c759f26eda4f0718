//! Facts other languages read at run time instead of copying them: the fields of
//! `gpu_arena_stats_t` with their metrics (`gpu_arena_stats_fields`, from
//! `gpu_arena::stats::STAT_FIELDS`) and the configuration keys (`gpu_arena_config_keys`, from
//! `gpu_arena::config::KEY_TABLE`). The share handle's layout is served the same way, by
//! `gpu_arena_share_layout` (ipc_api.rs).
//!
//! The strings are built once per process and never freed: the pointers handed out stay
//! valid for the life of the library.

use std::ffi::{c_char, c_int, CString};
use std::sync::OnceLock;

use gpu_arena::config::KEY_TABLE;
use gpu_arena::stats::STAT_FIELDS;
use gpu_arena::Error;

use crate::errors::{fail, guard};

/// One field of `gpu_arena_stats_t` and the metric that exposes it
/// (`gpu_arena_stats_fields`). The strings are static: never free them.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct gpu_arena_stats_field_t {
    /// The field's name, as in `gpu_arena_stats_t` (and the key of Python's
    /// `gpu_arena.stats()`).
    pub name: *const c_char,
    /// Its first byte in `gpu_arena_stats_t`; every field is a `uint64_t`.
    pub offset: u32,
    /// Its length in bytes: 8.
    pub len: u32,
    /// The metric that exposes it, e.g. `gpu_arena_reserved_bytes`.
    pub metric: *const c_char,
    /// The metric's Prometheus type: `gauge` or `counter` (a counter's name ends in `_total`).
    pub kind: *const c_char,
    /// What it counts, one sentence (the metric's help text).
    pub help: *const c_char,
}

/// One configuration key (`gpu_arena_config_keys`), as `gpu_arena_configure` and
/// `GPU_ARENA_CONF` take it. The strings are static (Markdown): never free them.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct gpu_arena_config_key_t {
    /// The key, e.g. `arena_size`.
    pub name: *const c_char,
    /// The values it takes.
    pub values: *const c_char,
    /// Its default.
    pub default_value: *const c_char,
    /// What it does.
    pub help: *const c_char,
}

/// The NUL-terminated copies of a row's four strings.
type RowStrings = [CString; 4];

/// `rows` as NUL-terminated strings. The tables' strings are literals without NUL:
/// `unwrap_or_default` never applies.
fn c_strings<'a>(rows: impl Iterator<Item = [&'a str; 4]>) -> Vec<RowStrings> {
    let c = |s: &str| CString::new(s).unwrap_or_default();
    rows.map(|r| r.map(c)).collect()
}

/// The strings of every row of `STAT_FIELDS` (name, metric, kind, help), built on first use.
fn stat_strings() -> &'static [RowStrings] {
    static STRINGS: OnceLock<Vec<RowStrings>> = OnceLock::new();
    STRINGS.get_or_init(|| {
        c_strings(
            STAT_FIELDS
                .iter()
                .map(|f| [f.name, f.metric, f.kind.as_str(), f.help]),
        )
    })
}

/// The strings of every row of `KEY_TABLE` (name, values, default, help), built on first use.
fn key_strings() -> &'static [RowStrings] {
    static STRINGS: OnceLock<Vec<RowStrings>> = OnceLock::new();
    STRINGS.get_or_init(|| {
        c_strings(
            KEY_TABLE
                .iter()
                .map(|k| [k.name, k.values, k.default, k.help]),
        )
    })
}

/// The fields of `gpu_arena_stats_t`, in order, each with the metric that exposes it: the
/// first `min(cap, n)` go to `out` (NULL when `cap` is 0); returns `n`, the number of fields
/// (`sizeof(gpu_arena_stats_t)` is `8 * n`). Needs no init.
#[no_mangle]
pub extern "C" fn gpu_arena_stats_fields(out: *mut gpu_arena_stats_field_t, cap: usize) -> c_int {
    const CALL: &str = "gpu_arena_stats_fields";
    guard(CALL, || {
        if cap > 0 && out.is_null() {
            return Err(fail(CALL, Error::invalid("out is NULL with cap > 0")));
        }
        for (i, (f, s)) in STAT_FIELDS.iter().zip(stat_strings()).take(cap).enumerate() {
            let field = gpu_arena_stats_field_t {
                name: s[0].as_ptr(),
                offset: f.offset as u32,
                len: 8,
                metric: s[1].as_ptr(),
                kind: s[2].as_ptr(),
                help: s[3].as_ptr(),
            };
            // SAFETY: `out` is non-null (cap > 0) and points to `cap` writable fields; i < cap.
            unsafe { out.add(i).write(field) };
        }
        Ok(STAT_FIELDS.len() as c_int)
    })
}

/// The configuration keys `gpu_arena_configure` takes, in order: the first `min(cap, n)` go
/// to `out` (NULL when `cap` is 0); returns `n`, the number of keys. Needs no init.
#[no_mangle]
pub extern "C" fn gpu_arena_config_keys(out: *mut gpu_arena_config_key_t, cap: usize) -> c_int {
    const CALL: &str = "gpu_arena_config_keys";
    guard(CALL, || {
        if cap > 0 && out.is_null() {
            return Err(fail(CALL, Error::invalid("out is NULL with cap > 0")));
        }
        for (i, s) in key_strings().iter().take(cap).enumerate() {
            let key = gpu_arena_config_key_t {
                name: s[0].as_ptr(),
                values: s[1].as_ptr(),
                default_value: s[2].as_ptr(),
                help: s[3].as_ptr(),
            };
            // SAFETY: `out` is non-null (cap > 0) and points to `cap` writable keys; i < cap.
            unsafe { out.add(i).write(key) };
        }
        Ok(KEY_TABLE.len() as c_int)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serves_every_field_in_order() {
        let n = gpu_arena_stats_fields(std::ptr::null_mut(), 0);
        assert_eq!(n as usize * 8, std::mem::size_of::<gpu_arena::PoolStats>());
        let empty = gpu_arena_stats_field_t {
            name: std::ptr::null(),
            offset: 0,
            len: 0,
            metric: std::ptr::null(),
            kind: std::ptr::null(),
            help: std::ptr::null(),
        };
        let mut out = vec![empty; n as usize];
        assert_eq!(gpu_arena_stats_fields(out.as_mut_ptr(), out.len()), n);
        let text = |p: *const c_char| {
            // SAFETY: the pointers come from `stat_strings`, NUL-terminated and static.
            unsafe { std::ffi::CStr::from_ptr(p) }
                .to_str()
                .map(str::to_string)
        };
        for (i, (f, row)) in out.iter().zip(STAT_FIELDS).enumerate() {
            assert_eq!((f.offset as usize, f.len), (i * 8, 8));
            assert_eq!(text(f.name), Ok(row.name.to_string()));
            assert_eq!(text(f.metric), Ok(row.metric.to_string()));
            assert_eq!(text(f.kind), Ok(row.kind.as_str().to_string()));
            assert_eq!(text(f.help), Ok(row.help.to_string()));
        }
        assert_eq!(
            gpu_arena_stats_fields(std::ptr::null_mut(), 1),
            crate::errors::GPU_ARENA_ERR_INVALID_ARGUMENT
        );
    }

    #[test]
    fn serves_every_config_key() {
        let n = gpu_arena_config_keys(std::ptr::null_mut(), 0);
        assert_eq!(n as usize, KEY_TABLE.len());
        let null = std::ptr::null();
        let empty = gpu_arena_config_key_t {
            name: null,
            values: null,
            default_value: null,
            help: null,
        };
        // A short buffer gets the first keys, and the count of all.
        let mut out = vec![empty; 2];
        assert_eq!(gpu_arena_config_keys(out.as_mut_ptr(), out.len()), n);
        // SAFETY: the pointers come from `key_strings`, NUL-terminated and static.
        let text = |p: *const c_char| unsafe { std::ffi::CStr::from_ptr(p) }.to_str();
        for (k, row) in out.iter().zip(&KEY_TABLE) {
            assert_eq!(text(k.name), Ok(row.name));
            assert_eq!(text(k.values), Ok(row.values));
            assert_eq!(text(k.default_value), Ok(row.default));
            assert_eq!(text(k.help), Ok(row.help));
        }
    }
}
