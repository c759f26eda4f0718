//! Byte stream -> a sequence of `RangeAllocator` operations (add/remove region, alloc with
//! tags, free of live and bogus offsets, retag, region splits, regions growing and shrinking
//! at their end, and the read-only queries), checked against a
//! simple model after every step: `validate()` passes, live ranges never overlap and lie in
//! a region, counters match, and every call's result agrees with what the model allows.
#![no_main]

use std::collections::BTreeMap;

use arbitrary::Arbitrary;
use gpu_arena::range::{RangeAllocator, RangeError, GRANULE};
use libfuzzer_sys::fuzz_target;

/// Region slots sit this far apart; a region may be up to two slots long, so adds overlap.
const SLOT: u64 = 256 * GRANULE;

#[derive(Arbitrary, Debug)]
enum Off {
    /// A slot start, plus a number of granules (aligned).
    Slot { slot: u8, granules: u8 },
    /// Anything at all (misaligned, near u64::MAX, ...).
    Raw(u64),
}

impl Off {
    fn get(&self) -> u64 {
        match *self {
            Off::Slot { slot, granules } => (slot % 16) as u64 * SLOT + granules as u64 * GRANULE,
            Off::Raw(x) => x,
        }
    }
}

#[derive(Arbitrary, Debug)]
enum Len {
    Granules(u16),
    Raw(u64),
}

impl Len {
    fn get(&self) -> u64 {
        match *self {
            Len::Granules(g) => (g % 600) as u64 * GRANULE,
            Len::Raw(x) => x,
        }
    }
}

#[derive(Arbitrary, Debug)]
enum Op {
    AddRegion {
        at: Off,
        len: Len,
        tag: u8,
    },
    RemoveRegion {
        at: Off,
    },
    RemoveRegionPick {
        pick: u8,
    },
    Alloc {
        len: Len,
        tag: u8,
    },
    /// Free a live allocation picked by index.
    FreeLive {
        pick: u16,
        tag: u8,
    },
    /// Free an offset near a live allocation (inside it, just past it) or anywhere.
    FreeBogus {
        pick: u16,
        delta: i16,
        at: Off,
        tag: u8,
    },
    Retag {
        from: u8,
        to: u8,
    },
    Query {
        at: Off,
        tag: u8,
    },
    /// Split a region picked by index at its live ranges rounded out to pages of
    /// `1 + page % 8` granules (trim); `drop_one`: leave one live range's window out (refused).
    SplitRegion {
        pick: u8,
        page: u8,
        drop_one: bool,
    },
    /// Grow a region picked by index by `len` at its end (a growing arena's new chunk).
    GrowRegion {
        pick: u8,
        len: Len,
        tag: u8,
    },
    /// Cut a region picked by index down to `keep` granules (its free tail given back).
    ShrinkRegion {
        pick: u8,
        keep: u16,
    },
}

fn tag(t: u8) -> u64 {
    // Mostly a few small tags (so merges and retags meet), sometimes huge ones.
    match t {
        0..=251 => (t % 4) as u64,
        252 => u64::MAX,
        253 => u64::MAX - 1,
        _ => 1 << 63,
    }
}

struct Model {
    regions: BTreeMap<u64, u64>,
    live: BTreeMap<u64, u64>,
}

impl Model {
    fn region_of(&self, off: u64, len: u64) -> Option<u64> {
        let (&s, &l) = self.regions.range(..=off).next_back()?;
        (off + len <= s + l).then_some(s)
    }

    fn overlaps_region(&self, off: u64, len: u64) -> bool {
        let end = off + len;
        self.regions.iter().any(|(&s, &l)| s < end && off < s + l)
    }

    fn overlaps_live(&self, off: u64, len: u64) -> bool {
        let end = off + len;
        self.live.iter().any(|(&s, &l)| s < end && off < s + l)
    }
}

fn aligned(offset: u64, len: u64) -> bool {
    len != 0
        && offset.is_multiple_of(GRANULE)
        && len.is_multiple_of(GRANULE)
        && offset.checked_add(len).is_some()
}

fuzz_target!(|ops: Vec<Op>| {
    let mut r = RangeAllocator::new();
    let mut m = Model {
        regions: BTreeMap::new(),
        live: BTreeMap::new(),
    };
    for op in ops.iter().take(512) {
        step(&mut r, &mut m, op);
        if let Err(e) = r.validate() {
            panic!("validate() failed after {op:?}: {e}");
        }
        let s = r.stats();
        assert_eq!(
            s.used_ranges,
            m.live.len() as u64,
            "used_ranges after {op:?}"
        );
        assert_eq!(
            s.used_bytes,
            m.live.values().sum::<u64>(),
            "used_bytes after {op:?}"
        );
        assert_eq!(s.regions, m.regions.len() as u64, "regions after {op:?}");
        assert_eq!(
            s.region_bytes,
            m.regions.values().sum::<u64>(),
            "region_bytes"
        );
    }
    // Teardown: free everything, retag every tag to 0: each region is one free range again
    // and can be removed.
    let live: Vec<u64> = m.live.keys().copied().collect();
    for off in live {
        r.free(off, 0).expect("free of a live range at teardown");
    }
    for (t, _) in r.free_tags() {
        r.retag(t, 0);
    }
    r.validate().expect("validate at teardown");
    let regions: Vec<(u64, u64)> = m.regions.iter().map(|(&s, &l)| (s, l)).collect();
    for (s, l) in regions {
        assert_eq!(
            r.remove_region(s),
            Ok(l),
            "region {s:#x} not whole after teardown"
        );
    }
    assert_eq!(
        r,
        RangeAllocator::new(),
        "empty allocator differs from a new one"
    );
});

fn pick_region(m: &Model, pick: u8) -> Option<(u64, u64)> {
    let n = m.regions.len();
    (n > 0).then(|| {
        let (&s, &l) = m.regions.iter().nth(pick as usize % n).unwrap();
        (s, l)
    })
}

fn step(r: &mut RangeAllocator, m: &mut Model, op: &Op) {
    match op {
        Op::GrowRegion { pick, len, tag: t } => {
            let Some((s, l)) = pick_region(m, *pick) else {
                return;
            };
            let extra = len.get();
            let before = r.clone();
            let res = r.grow_region(s, extra, tag(*t));
            let fits = aligned(s + l, extra) && !m.overlaps_region(s + l, extra);
            assert_eq!(res.is_ok(), fits, "grow_region({s:#x}, {extra}): {res:?}");
            if fits {
                m.regions.insert(s, l + extra);
            } else {
                assert_eq!(*r, before, "a refused grow_region changed something");
            }
        }
        Op::ShrinkRegion { pick, keep } => {
            let Some((s, l)) = pick_region(m, *pick) else {
                return;
            };
            let new_len = *keep as u64 % (l / GRANULE + 1) * GRANULE;
            let before = r.clone();
            let res = r.shrink_region(s, new_len);
            let tail_free = !m.overlaps_live(s + new_len, l - new_len);
            if new_len == 0 || new_len >= l || !tail_free {
                assert!(res.is_err(), "shrink_region({s:#x}, {new_len}) allowed");
            }
            match res {
                Ok(()) => {
                    m.regions.insert(s, new_len);
                }
                Err(_) => assert_eq!(*r, before, "a refused shrink_region changed something"),
            }
        }
        Op::AddRegion { at, len, tag: t } => {
            let (off, len) = (at.get(), len.get());
            let before = r.clone();
            let res = r.add_region(off, len, tag(*t));
            if !aligned(off, len) {
                assert_eq!(res, Err(RangeError::Misaligned { offset: off, len }));
            } else if m.overlaps_region(off, len) {
                assert_eq!(res, Err(RangeError::Overlap { offset: off, len }));
            } else {
                assert_eq!(res, Ok(()), "add_region({off:#x}, {len}) refused");
                m.regions.insert(off, len);
            }
            if res.is_err() {
                assert_eq!(*r, before, "a refused add_region changed something");
            }
        }
        Op::RemoveRegion { at } => remove_region(r, m, at.get()),
        Op::RemoveRegionPick { pick } => {
            if !m.regions.is_empty() {
                let k = *m
                    .regions
                    .keys()
                    .nth(*pick as usize % m.regions.len())
                    .unwrap();
                remove_region(r, m, k);
            }
        }
        Op::Alloc { len, tag: t } => {
            let len = len.get();
            let t = tag(*t);
            let largest = r.largest_free(t);
            let before = r.clone();
            match r.alloc(len, t) {
                Some(off) => {
                    assert!(aligned(off, len), "alloc({len}) gave {off:#x}");
                    assert!(
                        len <= largest,
                        "alloc({len}) succeeded, largest_free was {largest}"
                    );
                    assert!(
                        m.region_of(off, len).is_some(),
                        "alloc outside every region"
                    );
                    assert!(!m.overlaps_live(off, len), "alloc {off:#x}+{len} overlaps");
                    assert_eq!(r.allocated_len(off), Some(len));
                    assert_eq!(r.allocated_containing(off + len - 1), Some((off, len)));
                    m.live.insert(off, len);
                }
                None => {
                    assert!(
                        len == 0 || !len.is_multiple_of(GRANULE) || len > largest,
                        "alloc({len}, tag {t}) refused with largest_free {largest}"
                    );
                    assert_eq!(*r, before, "a refused alloc changed something");
                }
            }
        }
        Op::FreeLive { pick, tag: t } => {
            if m.live.is_empty() {
                return;
            }
            let (&off, &len) = m.live.iter().nth(*pick as usize % m.live.len()).unwrap();
            assert_eq!(r.free(off, tag(*t)), Ok(len));
            m.live.remove(&off);
            assert_eq!(r.allocated_len(off), None);
        }
        Op::FreeBogus {
            pick,
            delta,
            at,
            tag: t,
        } => {
            let off = if m.live.is_empty() || *pick % 4 == 0 {
                at.get()
            } else {
                let (&o, _) = m.live.iter().nth(*pick as usize % m.live.len()).unwrap();
                o.wrapping_add_signed(*delta as i64 * 64)
            };
            let before = r.clone();
            match m.live.get(&off).copied() {
                Some(len) => {
                    assert_eq!(r.free(off, tag(*t)), Ok(len));
                    m.live.remove(&off);
                }
                None => {
                    assert_eq!(r.free(off, tag(*t)), Err(RangeError::NotAllocated(off)));
                    assert_eq!(*r, before, "a refused free changed something");
                }
            }
        }
        Op::Retag { from, to } => {
            let (from, to) = (tag(*from), tag(*to));
            let free_from: u64 = r
                .free_tags()
                .iter()
                .filter(|(t, _)| *t == from)
                .map(|(_, b)| b)
                .sum();
            let moved = r.retag(from, to);
            if from == to {
                assert_eq!(moved, 0);
            } else {
                assert_eq!(moved, free_from, "retag moved a different byte count");
                assert_eq!(r.largest_free(from), 0, "retag left ranges under {from}");
            }
        }
        Op::SplitRegion {
            pick,
            page,
            drop_one,
        } => {
            if m.regions.is_empty() {
                return;
            }
            let (&off, &len) = m
                .regions
                .iter()
                .nth(*pick as usize % m.regions.len())
                .unwrap();
            let page = (1 + *page as u64 % 8) * GRANULE;
            let mut windows: Vec<(u64, u64)> = Vec::new();
            for (&s, &l) in m.live.range(off..off + len) {
                let start = off + (s - off) / page * page;
                let end = (off + (s - off + l).div_ceil(page) * page).min(off + len);
                match windows.last_mut() {
                    Some((ws, wl)) if start <= *ws + *wl => *wl = end.max(*ws + *wl) - *ws,
                    _ => windows.push((start, end - start)),
                }
            }
            if *drop_one && !windows.is_empty() {
                windows.remove(0);
            }
            let covered = |s: u64, l: u64| windows.iter().any(|&(w, wl)| s >= w && s + l <= w + wl);
            let ok =
                !windows.is_empty() && m.live.range(off..off + len).all(|(&s, &l)| covered(s, l));
            let before = r.clone();
            let res = r.split_region(off, &windows);
            if ok {
                assert_eq!(res, Ok(()), "split_region({off:#x}, {windows:?}) refused");
                m.regions.remove(&off);
                m.regions.extend(windows.iter().copied());
            } else {
                assert!(
                    res.is_err(),
                    "split_region({off:#x}, {windows:?}) left a live range out"
                );
                assert_eq!(*r, before, "a refused split_region changed something");
            }
        }
        Op::Query { at, tag: t } => {
            let off = at.get();
            let want = m.live.get(&off).copied();
            assert_eq!(r.allocated_len(off), want);
            let containing = m
                .live
                .range(..=off)
                .next_back()
                .filter(|(&s, &l)| off < s + l)
                .map(|(&s, &l)| (s, l));
            assert_eq!(r.allocated_containing(off), containing);
            if m.regions.contains_key(&off) {
                let unused = m.live.range(off..off + m.regions[&off]).next().is_none();
                assert_eq!(r.region_is_unused(off), unused);
                let ranges = r.ranges(off);
                let total: u64 = ranges.iter().map(|x| x.len).sum();
                assert_eq!(total, m.regions[&off], "ranges() do not tile the region");
            } else {
                assert!(!r.region_is_unused(off));
                assert!(r.ranges(off).is_empty());
            }
            let _ = r.largest_free(tag(*t));
        }
    }
}

fn remove_region(r: &mut RangeAllocator, m: &mut Model, off: u64) {
    let before = r.clone();
    match m.regions.get(&off).copied() {
        None => assert_eq!(r.remove_region(off), Err(RangeError::NoSuchRegion(off))),
        Some(len) => {
            let has_live = m.live.range(off..off + len).next().is_some();
            match r.remove_region(off) {
                Ok(l) => {
                    assert!(!has_live, "removed region {off:#x} with live allocations");
                    assert_eq!(l, len);
                    m.regions.remove(&off);
                }
                Err(e) => {
                    assert_eq!(e, RangeError::RegionInUse(off));
                    // Allowed without allocations only when its free ranges carry two tags.
                    if !has_live {
                        assert!(r.ranges(off).len() > 1, "whole free region refused");
                    }
                }
            }
        }
    }
    if m.regions.contains_key(&off) {
        // Refused: nothing changed.
        assert_eq!(*r, before, "a refused remove_region changed something");
    }
}
