//! Allocation tags: every allocation carries one (default `"default"`), set per thread.
//!
//! A tag names a group of allocations that sleep and wake together (`Pool::sleep`,
//! `Pool::wake`): allocations of different tags never share an arena. The hot path sees only
//! a small index ([`current`], a thread-local `u8`); names are interned once, process-wide,
//! in a table of at most [`MAX_TAGS`] entries (index 0 is `"default"`).
//!
//! A name is 1 to [`MAX_TAG_LEN`] bytes of `[A-Za-z0-9_.-]`; `None` or `""` means
//! `"default"`.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::OnceLock;

use parking_lot::RwLock;

use crate::error::{Error, Result};

/// Most distinct tags a process may use (the pool keeps a bit mask of sleeping tags).
pub const MAX_TAGS: usize = 64;

/// Longest tag name in bytes.
pub const MAX_TAG_LEN: usize = 63;

/// The name of tag index 0.
pub const DEFAULT_TAG: &str = "default";

fn names() -> &'static RwLock<Vec<String>> {
    static NAMES: OnceLock<RwLock<Vec<String>>> = OnceLock::new();
    NAMES.get_or_init(|| RwLock::new(vec![DEFAULT_TAG.to_string()]))
}

thread_local! {
    static CURRENT: Cell<u8> = const { Cell::new(0) };
}

/// Set once any thread sets a tag other than the default: until then every thread's tag is
/// 0 and [`current`] reads this flag instead of the thread-local (in a shared library a
/// thread-local read is a `__tls_get_addr` call, on every allocation of the C API).
/// Relaxed is enough: a thread that set its own tag sees its own store.
static ANY_TAG_SET: AtomicBool = AtomicBool::new(false);

fn set_this_thread(tag: u8) {
    if tag != 0 {
        ANY_TAG_SET.store(true, Relaxed);
    }
    CURRENT.with(|c| c.set(tag));
}

/// Check a tag name: 1 to [`MAX_TAG_LEN`] bytes of `[A-Za-z0-9_.-]`.
pub fn check_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= MAX_TAG_LEN
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(Error::invalid(format!(
            "bad tag {name:?}: a tag is 1 to {MAX_TAG_LEN} bytes of [A-Za-z0-9_.-]"
        )))
    }
}

/// The index of tag `name` (`None` or `""`: the default tag), interned on first use.
pub fn index(name: Option<&str>) -> Result<u8> {
    let name = match name {
        None | Some("") => return Ok(0),
        Some(n) => n,
    };
    check_name(name)?;
    if let Some(i) = names().read().iter().position(|n| n == name) {
        return Ok(i as u8);
    }
    let mut w = names().write();
    if let Some(i) = w.iter().position(|n| n == name) {
        return Ok(i as u8);
    }
    if w.len() >= MAX_TAGS {
        return Err(Error::invalid(format!(
            "tag {name:?}: this process already uses the most tags there may be ({MAX_TAGS})"
        )));
    }
    w.push(name.to_string());
    Ok((w.len() - 1) as u8)
}

/// The index of `name` if it was ever used (no interning).
pub fn lookup(name: &str) -> Option<u8> {
    let name = if name.is_empty() { DEFAULT_TAG } else { name };
    names()
        .read()
        .iter()
        .position(|n| n == name)
        .map(|i| i as u8)
}

/// The name of tag index `tag`.
pub fn name(tag: u8) -> String {
    names()
        .read()
        .get(usize::from(tag))
        .cloned()
        .unwrap_or_else(|| format!("tag#{tag}"))
}

/// Number of tags interned so far.
pub fn count() -> usize {
    names().read().len()
}

/// Set this thread's current tag (`None` or `""`: the default tag). On a bad name nothing
/// changes.
pub fn set_current(name: Option<&str>) -> Result<()> {
    set_this_thread(index(name)?);
    Ok(())
}

/// Set this thread's current tag by index (as returned by [`current`]).
pub fn set_current_index(tag: u8) {
    set_this_thread(tag);
}

/// This thread's current tag index.
#[inline]
pub fn current() -> u8 {
    if !ANY_TAG_SET.load(Relaxed) {
        return 0;
    }
    CURRENT.with(Cell::get)
}

/// Parse a comma-separated list of tag names (spaces around names ignored, empty entries
/// skipped), interning each. `None` or `""`: the empty list.
pub fn parse_list(list: Option<&str>) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    for part in list.unwrap_or("").split(',') {
        let part = part.trim();
        if part.is_empty() {
            continue;
        }
        let i = index(Some(part))?;
        if !out.contains(&i) {
            out.push(i);
        }
    }
    Ok(out)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked_and_interned() {
        assert_eq!(index(None).unwrap(), 0);
        assert_eq!(index(Some("")).unwrap(), 0);
        assert_eq!(index(Some("default")).unwrap(), 0);
        let a = index(Some("kv_cache")).unwrap();
        assert_eq!(index(Some("kv_cache")).unwrap(), a);
        assert_eq!(name(a), "kv_cache");
        for bad in ["a b", "x/y", &"a".repeat(64), "é"] {
            assert!(index(Some(bad)).is_err(), "{bad}");
        }
        assert!(index(Some(&"a".repeat(63))).is_ok());
        assert_eq!(parse_list(Some(" kv_cache, ,default")).unwrap(), vec![a, 0]);
        assert!(parse_list(Some("ok,bad tag")).is_err());
        set_current(Some("kv_cache")).unwrap();
        assert_eq!(current(), a);
        assert!(set_current(Some("bad tag")).is_err());
        assert_eq!(current(), a);
        set_current(None).unwrap();
        assert_eq!(current(), 0);
    }
}
