//! Property test: the sub-allocator against a simple model.
//!
//! Random sequences of region adds/removes, allocs with tags, frees and retags. After every
//! step: `validate()` passes, no two live ranges overlap, every range lies inside a region
//! and is granule-aligned, and the allocator's used bytes equal the model's. At the end,
//! freeing everything and retagging to one tag leaves each region as one free range at its
//! start, so every region can be removed.
#![allow(clippy::unwrap_used)]

use gpu_arena::range::{RangeAllocator, RangeInfo, GRANULE};
use proptest::prelude::*;
use std::collections::BTreeMap;

#[derive(Debug, Clone)]
enum Op {
    AddRegion {
        slot: u8,
        granules: u16,
    },
    RemoveRegion {
        slot: u8,
    },
    Alloc {
        granules: u16,
        tag: u8,
    },
    Free {
        pick: u16,
        tag: u8,
    },
    FreeMany {
        picks: Vec<u16>,
        bogus: bool,
        tag: u8,
    },
    Retag {
        from: u8,
        to: u8,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        1 => (0u8..6, 1u16..2048).prop_map(|(slot, granules)| Op::AddRegion { slot, granules }),
        1 => (0u8..6).prop_map(|slot| Op::RemoveRegion { slot }),
        8 => (1u16..600, 0u8..3).prop_map(|(granules, tag)| Op::Alloc { granules, tag }),
        6 => (any::<u16>(), 0u8..3).prop_map(|(pick, tag)| Op::Free { pick, tag }),
        2 => (prop::collection::vec(any::<u16>(), 0..12), any::<bool>(), 0u8..3)
            .prop_map(|(picks, bogus, tag)| Op::FreeMany { picks, bogus, tag }),
        1 => (0u8..3, 0u8..3).prop_map(|(from, to)| Op::Retag { from, to }),
    ]
}

/// Region slots sit 2048 granules apart, so a full-size region touches the next slot's
/// region but never overlaps it.
const SLOT: u64 = 2048 * GRANULE;

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]
    #[test]
    fn allocator_matches_model(ops in prop::collection::vec(op(), 1..400)) {
        let mut r = RangeAllocator::new();
        let mut regions: BTreeMap<u64, u64> = BTreeMap::new();
        let mut live: BTreeMap<u64, u64> = BTreeMap::new();
        for op in ops {
            match op {
                Op::AddRegion { slot, granules } => {
                    let start = slot as u64 * SLOT;
                    let len = granules as u64 * GRANULE;
                    let res = r.add_region(start, len, 0);
                    prop_assert_eq!(res.is_ok(), !regions.contains_key(&start));
                    if res.is_ok() { regions.insert(start, len); }
                }
                Op::RemoveRegion { slot } => {
                    let start = slot as u64 * SLOT;
                    let before = r.clone();
                    match r.remove_region(start) {
                        Ok(len) => {
                            prop_assert_eq!(regions.remove(&start), Some(len));
                            prop_assert!(live.range(start..start + len).next().is_none());
                        }
                        Err(_) => prop_assert_eq!(&r, &before),
                    }
                }
                Op::Alloc { granules, tag } => {
                    let len = granules as u64 * GRANULE;
                    let fits = r.largest_free(tag as u64) >= len;
                    match r.alloc(len, tag as u64) {
                        Some(off) => {
                            prop_assert!(fits);
                            prop_assert_eq!(off % GRANULE, 0);
                            let (&rs, &rl) = regions.range(..=off).next_back().unwrap();
                            prop_assert!(off + len <= rs + rl, "inside its region");
                            if let Some((&o, &l)) = live.range(..off + len).next_back() {
                                prop_assert!(o + l <= off, "overlaps {:#x}+{}", o, l);
                            }
                            live.insert(off, len);
                        }
                        None => prop_assert!(!fits),
                    }
                }
                Op::Free { pick, tag } => {
                    if live.is_empty() {
                        prop_assert!(r.free(0, 0).is_err());
                    } else {
                        let (&off, &len) = live.iter().nth(pick as usize % live.len()).unwrap();
                        prop_assert_eq!(r.free(off, tag as u64), Ok(len));
                        live.remove(&off);
                        prop_assert!(r.free(off, tag as u64).is_err(), "double free");
                    }
                }
                Op::FreeMany { picks, bogus, tag } => {
                    // Against the one-by-one result on a copy.
                    let keys: Vec<u64> = live.keys().copied().collect();
                    let mut chosen: Vec<u64> = if keys.is_empty() { Vec::new() } else {
                        picks.iter().map(|p| keys[*p as usize % keys.len()]).collect()
                    };
                    chosen.sort_unstable();
                    chosen.dedup();
                    if bogus { chosen.push(GRANULE * 3 + 7 * SLOT); }
                    let mut one_by_one = r.clone();
                    for &o in &chosen { let _ = one_by_one.free(o, tag as u64); }
                    let mut offs = chosen.clone();
                    let skipped = r.free_many(&mut offs, tag as u64);
                    prop_assert_eq!(&r, &one_by_one);
                    for o in &chosen {
                        if live.remove(o).is_none() { prop_assert!(skipped.contains(o)); }
                    }
                }
                Op::Retag { from, to } => { r.retag(from as u64, to as u64); }
            }
            r.validate().map_err(TestCaseError::fail)?;
            prop_assert_eq!(r.stats().used_bytes, live.values().sum::<u64>());
        }
        for (off, _) in std::mem::take(&mut live) { r.free(off, 1).unwrap(); }
        r.retag(1, 0);
        r.retag(2, 0);
        r.validate().map_err(TestCaseError::fail)?;
        for (&start, &len) in &regions {
            prop_assert_eq!(r.ranges(start), vec![RangeInfo { offset: start, len, free_tag: Some(0) }]);
            prop_assert_eq!(r.remove_region(start), Ok(len));
        }
    }
}
