//! Which cached blocks a miss in a growing arena gives back (`DeviceState::take_range`).
//!
//! A thread cache keeps freed KV-sized blocks whole (`growth_steps::GROWING_CACHE_MAX`). When a
//! larger request finds no free range that fits, giving every cached block back to the
//! sub-allocator makes room where cached blocks lie next to each other or to free space,
//! but it also empties the cache: on the second KV trace most blocks a flush gave back lay
//! between live blocks, where they could make no room, and every one of them then came back
//! through the device lock on its next allocation (61,000 such allocations over two
//! replays; bench/results/sim-2026-12-03-cached-runs.md). So first, only the *run* of
//! cached blocks (address neighbours in the calling thread's cache, freed on the
//! allocating stream) that makes room for the request with the free space beside it is
//! given back: the best fit among the runs, and of it only the blocks that reach the
//! request from its freer side. Only when no run fits does the flush of every cached block
//! follow, before the arena grows, as before.

use crate::range::Beside;

/// A run of cached blocks: its blocks' starts and lengths in address order, and the free
/// bytes (of the allocating stream's tag) before and after it.
struct Run {
    blocks: Vec<(u64, u64)>,
    free_before: u64,
    free_after: u64,
}

impl Run {
    fn total(&self) -> u64 {
        self.free_before + self.free_after + self.blocks.iter().map(|b| b.1).sum::<u64>()
    }
}

/// Blocks [`fitting_run`] looks at, at most: a miss's search stays bounded however many
/// blocks the cache holds (the most recently freed ones come first; a search that finds
/// nothing is followed by the flush of every cached block, unless the streams' settled
/// ranges made room).
pub(crate) const SEARCH_BUDGET: usize = 4096;

/// The cached blocks to give back so that a request of `need` bytes fits: `cached` lists
/// the candidate blocks (in any order), `is_cached` says whether a block start is one of
/// them, `beside` what lies around an allocated block (the sub-allocator's view, with the
/// free lengths of the tag the blocks will be freed under). Returns the blocks, in address
/// order, or nothing when no run fits. Only a run's first block walks it, and at most
/// [`SEARCH_BUDGET`] blocks are looked at.
pub(crate) fn fitting_run(
    cached: impl IntoIterator<Item = u64>,
    need: u64,
    is_cached: impl Fn(u64) -> bool,
    beside: impl Fn(u64) -> Option<Beside>,
) -> Vec<u64> {
    let mut best: Option<(u64, Run)> = None;
    let looked = std::cell::Cell::new(0usize);
    let beside = |ptr: u64| {
        looked.set(looked.get() + 1);
        beside(ptr)
    };
    for start in cached {
        if looked.get() >= SEARCH_BUDGET {
            break;
        }
        let Some(first) = beside(start) else {
            continue;
        };
        if first.before.is_some_and(&is_cached) {
            continue; // not a run's first block
        }
        let mut run = Run {
            blocks: vec![(start, first.len)],
            free_before: first.free_before,
            free_after: 0,
        };
        let mut cur = first;
        loop {
            match cur.after.filter(|&next| is_cached(next)).and_then(&beside) {
                Some(next) => {
                    let at = cur.after.unwrap_or_default();
                    run.blocks.push((at, next.len));
                    cur = next;
                }
                None => {
                    run.free_after = cur.free_after;
                    break;
                }
            }
        }
        let total = run.total();
        if total >= need && best.as_ref().is_none_or(|(t, _)| total < *t) {
            best = Some((total, run));
        }
    }
    let Some((_, run)) = best else {
        return Vec::new();
    };
    // The fewest blocks (at least one) that reach `need` from the freer side; the whole run
    // when only both sides together do.
    let (mut blocks, mut got) = (run.blocks, run.free_before);
    if run.free_after > run.free_before {
        blocks.reverse();
        got = run.free_after;
    }
    let mut out = Vec::new();
    for &(ptr, len) in &blocks {
        // At least one block: free space alone that fits would not have missed.
        if got >= need && !out.is_empty() {
            break;
        }
        got += len;
        out.push(ptr);
    }
    if got < need {
        out = blocks.iter().map(|b| b.0).collect();
    }
    out.sort_unstable();
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::collections::BTreeMap;

    use proptest::prelude::*;

    use super::*;

    const B: u64 = 2 << 20;

    /// A region laid out as `layout` ('c' a cached block, 'l' a live one, 'f' a free range
    /// of the tag, 'o' a free range of another tag; each `B` long): `fitting_run` for `need`
    /// over it, as block indexes.
    fn pick(layout: &str, need: u64) -> Vec<u64> {
        let kinds: Vec<char> = layout.chars().collect();
        let at = |i: usize| i as u64 * B;
        let beside = |ptr: u64| {
            let i = (ptr / B) as usize;
            if !matches!(kinds.get(i), Some('c' | 'l')) {
                return None;
            }
            let free = |j: usize| if kinds[j] == 'f' { B } else { 0 };
            Some(Beside {
                len: B,
                before: (i > 0).then(|| at(i - 1)),
                free_before: if i > 0 { free(i - 1) } else { 0 },
                after: (i + 1 < kinds.len()).then(|| at(i + 1)),
                free_after: if i + 1 < kinds.len() { free(i + 1) } else { 0 },
            })
        };
        let cached: BTreeMap<u64, ()> = kinds
            .iter()
            .enumerate()
            .filter(|(_, k)| **k == 'c')
            .map(|(i, _)| (at(i), ()))
            .collect();
        // Candidates in an order other than the address order.
        let order: Vec<u64> = cached.keys().rev().copied().collect();
        fitting_run(order, need, |p| cached.contains_key(&p), beside)
            .into_iter()
            .map(|p| p / B)
            .collect()
    }

    #[test]
    fn the_best_fitting_run_is_given_back_and_only_what_reaches_the_request() {
        // Runs: [1] (alone between live blocks), [3,4,5] (free after), [9,10] (free before).
        let layout = "lclcccflfccl";
        // 3 blocks: [9,10] with the free range before it makes exactly 3.
        assert_eq!(pick(layout, 3 * B), vec![9, 10]);
        // 2 blocks: [9,10]'s free range and one block reach it (total 3 is the best fit).
        assert_eq!(pick(layout, 2 * B), vec![9]);
        // 4 blocks: only [3,4,5] with its free range: all of it.
        assert_eq!(pick(layout, 4 * B), vec![3, 4, 5]);
        // 5 blocks: no run reaches it.
        assert!(pick(layout, 5 * B).is_empty());
    }

    #[test]
    fn free_space_of_another_tag_and_live_blocks_do_not_count() {
        assert!(pick("ocol", 2 * B).is_empty());
        assert_eq!(pick("lccl", 2 * B), vec![1, 2]);
        // Free on both sides: both needed, so the whole run.
        assert_eq!(pick("fccf", 4 * B), vec![1, 2]);
        // From the freer side only.
        assert_eq!(pick("fcccl", 2 * B), vec![1]);
        assert_eq!(pick("lcccf", 2 * B), vec![3]);
    }

    /// A region of ranges `(kind, units)`: 'c' cached, 'l' live, 'f' free under the tag
    /// (never two side by side, as in the sub-allocator), 'o' free under another tag; each
    /// `units * B` long. Returns `fitting_run`'s pick as range indexes.
    fn pick_in(layout: &[(char, u64)], need: u64) -> Vec<usize> {
        let starts: Vec<u64> = layout
            .iter()
            .scan(0u64, |at, &(_, units)| {
                let s = *at;
                *at += units * B;
                Some(s)
            })
            .collect();
        let index = |ptr: u64| starts.binary_search(&ptr).ok();
        let len = |i: usize| layout[i].1 * B;
        let free = |i: usize| if layout[i].0 == 'f' { len(i) } else { 0 };
        let beside = |ptr: u64| {
            let i = index(ptr)?;
            if !matches!(layout[i].0, 'c' | 'l') {
                return None;
            }
            let n = layout.len();
            Some(Beside {
                len: len(i),
                before: (i > 0).then(|| starts[i - 1]),
                free_before: if i > 0 { free(i - 1) } else { 0 },
                after: (i + 1 < n).then(|| starts[i + 1]),
                free_after: if i + 1 < n { free(i + 1) } else { 0 },
            })
        };
        let is_cached = |ptr: u64| index(ptr).is_some_and(|i| layout[i].0 == 'c');
        let cached: Vec<u64> = (0..layout.len())
            .filter(|&i| layout[i].0 == 'c')
            .map(|i| starts[i])
            .collect();
        fitting_run(cached, need, is_cached, beside)
            .into_iter()
            .map(|p| index(p).unwrap())
            .collect()
    }

    fn layouts() -> impl Strategy<Value = Vec<(char, u64)>> {
        prop::collection::vec(
            (prop::sample::select(vec!['c', 'c', 'l', 'f', 'o']), 1u64..4),
            1..40,
        )
        .prop_map(|mut v| {
            for i in 1..v.len() {
                if v[i].0 == 'f' && v[i - 1].0 == 'f' {
                    v[i].0 = 'l';
                }
            }
            v
        })
    }

    proptest! {
        /// Against every maximal run of cached blocks: nothing is picked only when no run
        /// with the free ranges of the tag beside it reaches the request; else the pick is
        /// a contiguous part of the best fitting run, which with the free range beside the
        /// part (where the part reaches the run's end) reaches it.
        #[test]
        fn the_pick_is_part_of_the_best_fitting_run_and_reaches_the_request(
            layout in layouts(),
            need_units in 1u64..12,
        ) {
            let need = need_units * B;
            let n = layout.len();
            let free = |i: usize| if layout[i].0 == 'f' { layout[i].1 * B } else { 0 };
            // Maximal runs: (first, last, total with the free ranges beside).
            let mut runs = Vec::new();
            let mut i = 0;
            while i < n {
                if layout[i].0 != 'c' {
                    i += 1;
                    continue;
                }
                let first = i;
                while i + 1 < n && layout[i + 1].0 == 'c' {
                    i += 1;
                }
                let blocks: u64 = (first..=i).map(|k| layout[k].1 * B).sum();
                let before = if first > 0 { free(first - 1) } else { 0 };
                let after = if i + 1 < n { free(i + 1) } else { 0 };
                runs.push((first, i, blocks + before + after));
                i += 1;
            }
            let best = runs.iter().filter(|r| r.2 >= need).map(|r| r.2).min();
            let picked = pick_in(&layout, need);
            match best {
                None => prop_assert!(picked.is_empty(), "{picked:?}"),
                Some(best) => {
                    prop_assert!(!picked.is_empty());
                    let (lo, hi) = (picked[0], picked[picked.len() - 1]);
                    prop_assert_eq!(picked.clone(), (lo..=hi).collect::<Vec<_>>());
                    let run = runs.iter().find(|r| r.0 <= lo && hi <= r.1).unwrap();
                    prop_assert_eq!(run.2, best);
                    let mut got: u64 = picked.iter().map(|&k| layout[k].1 * B).sum();
                    if lo == run.0 && lo > 0 {
                        got += free(lo - 1);
                    }
                    if hi == run.1 && hi + 1 < n {
                        got += free(hi + 1);
                    }
                    prop_assert!(got >= need, "{got} < {need}");
                }
            }
        }
    }
}
