//! Property test of [`gpu_arena::lifetime::ArenaLifetime`] (the real type) against a simple
//! model: random sequences of shares (exports that succeed, fail or pin), unshares, leases,
//! frees, re-allocations and destroys, on one arena with a few allocations. After every step:
//! references match the model and are never negative, at most one export is open and only
//! while `Exported`, an export is closed only at the last reference and never when pinned,
//! a pinned arena is never destroyable, a freed allocation is released exactly once (at its
//! last reference), the generation counts the exports, stale generations are refused.
#![allow(clippy::unwrap_used)]

use gpu_arena::lifetime::{
    AllocHold, ArenaLifetime, ExportState, ExportStep, FreeStep, LifetimeError, ShareHold,
};
use proptest::prelude::*;

const ALLOCS: usize = 3;

#[derive(Debug, Clone)]
enum Op {
    Share {
        alloc: usize,
        ok: bool,
        pinning: bool,
    },
    Unshare(usize),
    OpenLease(usize),
    CloseLease(usize),
    Free(usize),
    Realloc(usize),
    Destroy,
    Generation(u32),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..ALLOCS, prop::bool::weighted(0.85), prop::bool::weighted(0.1))
            .prop_map(|(alloc, ok, pinning)| Op::Share { alloc, ok, pinning }),
        3 => (0..8usize).prop_map(Op::Unshare),
        3 => (0..8usize).prop_map(Op::OpenLease),
        3 => (0..8usize).prop_map(Op::CloseLease),
        2 => (0..ALLOCS).prop_map(Op::Free),
        1 => (0..ALLOCS).prop_map(Op::Realloc),
        1 => Just(Op::Destroy),
        1 => (0..4u32).prop_map(Op::Generation),
    ]
}

/// The simple model: counters only.
#[derive(Debug, Default)]
struct Model {
    refs: [u64; ALLOCS],
    freed: [bool; ALLOCS],
    /// Released ranges per allocation (each allocation slot may be re-allocated after).
    released: [u32; ALLOCS],
    /// The allocation slot holds a live (or freed-but-held) allocation.
    present: [bool; ALLOCS],
    /// (alloc, revoked, leases, generation) per share; `None` once removed.
    shares: Vec<Option<(usize, bool, u64, u32)>>,
    /// Open leases: the share each is on.
    leases: Vec<usize>,
    /// The open export's id.
    open: Option<u32>,
    pinned: bool,
    generation: u32,
    next_export: u32,
    closed: Vec<u32>,
}

struct Real {
    lt: ArenaLifetime<u32>,
    holds: [AllocHold; ALLOCS],
    shares: Vec<Option<ShareHold>>,
}

fn arena_refs(m: &Model) -> u64 {
    m.refs.iter().sum()
}

/// A reference ended: do what the lifetime says, check it against the model.
fn ended(m: &mut Model, alloc: usize, e: gpu_arena::lifetime::Ended<u32>, remove_share: bool) {
    assert_eq!(e.remove_share, remove_share, "share removal");
    m.refs[alloc] -= 1;
    let release = m.refs[alloc] == 0 && m.freed[alloc];
    assert_eq!(e.release_freed, release, "deferred free of {alloc}");
    if release {
        m.released[alloc] += 1;
        m.present[alloc] = false;
    }
    let last = arena_refs(m) == 0;
    match e.close_export {
        Some(id) => {
            assert!(last && !m.pinned, "export closed with refs or pinned");
            assert_eq!(
                Some(id),
                m.open.take(),
                "closed another export than the open one"
            );
            assert!(!m.closed.contains(&id), "export {id} closed twice");
            m.closed.push(id);
        }
        None => assert!(
            !(last && !m.pinned && m.open.is_some()),
            "last ref kept the export"
        ),
    }
}

fn step(m: &mut Model, r: &mut Real, op: &Op) {
    match *op {
        Op::Share { alloc, ok, pinning } => {
            if !m.present[alloc] {
                return; // no live allocation there: the pool refuses before the lifetime
            }
            let took = r.lt.take_ref(&mut r.holds[alloc]);
            if m.freed[alloc] {
                assert_eq!(took, Err(LifetimeError::Freed));
                return;
            }
            took.unwrap();
            m.refs[alloc] += 1;
            let step = r.lt.begin_export().unwrap();
            let expect = if m.open.is_some() {
                ExportStep::Ready
            } else {
                ExportStep::Export
            };
            assert_eq!(step, expect);
            if step == ExportStep::Export {
                assert_eq!(
                    r.lt.begin_export(),
                    Ok(ExportStep::Wait),
                    "one export at a time"
                );
                if !ok {
                    r.lt.export_failed().unwrap();
                    let e = r.lt.drop_ref(&mut r.holds[alloc]).unwrap();
                    ended(m, alloc, e, false);
                    return;
                }
                let id = m.next_export;
                m.next_export += 1;
                let done = r.lt.finish_export(id, pinning).unwrap();
                assert_eq!(
                    r.lt.finish_export(999, false),
                    Err(999),
                    "second export refused"
                );
                m.generation += 1;
                assert_eq!(done.generation, m.generation);
                assert_eq!(done.newly_pinned, pinning && !m.pinned);
                m.pinned |= pinning;
                m.open = Some(id);
            }
            let hold = r.lt.new_share().unwrap();
            assert_eq!(hold.generation(), m.generation);
            r.shares.push(Some(hold));
            m.shares.push(Some((alloc, false, 0, m.generation)));
        }
        Op::Unshare(i) => {
            let Some((alloc, revoked, leases, _)) = m.shares.get(i).copied().flatten() else {
                return;
            };
            let hold = r.shares[i].as_mut().unwrap();
            let res = r.lt.unshare(hold, &mut r.holds[alloc]);
            if revoked {
                assert_eq!(res, Err(LifetimeError::Revoked));
                return;
            }
            let remove = leases == 0;
            ended(m, alloc, res.unwrap(), remove);
            m.shares[i] = (!remove).then_some((alloc, true, leases, 0));
            if remove {
                r.shares[i] = None;
            }
        }
        Op::OpenLease(i) => {
            let Some((alloc, revoked, leases, g)) = m.shares.get(i).copied().flatten() else {
                return;
            };
            let hold = r.shares[i].as_mut().unwrap();
            match r.lt.check_lease(hold) {
                Ok(&id) => {
                    assert!(!revoked);
                    assert_eq!(Some(id), m.open, "a lease gets the share's export");
                }
                Err(e) => {
                    assert!(revoked, "lease refused on a live share: {e}");
                    assert_eq!(
                        r.lt.open_lease(hold, &mut r.holds[alloc]),
                        Err(LifetimeError::Revoked)
                    );
                    return;
                }
            }
            r.lt.open_lease(hold, &mut r.holds[alloc]).unwrap();
            m.refs[alloc] += 1;
            m.shares[i] = Some((alloc, revoked, leases + 1, g));
            m.leases.push(i);
        }
        Op::CloseLease(j) => {
            if j >= m.leases.len() {
                return;
            }
            let i = m.leases.swap_remove(j);
            let (alloc, revoked, leases, g) = m.shares[i].unwrap();
            let hold = r.shares[i].as_mut().unwrap();
            let e = r.lt.close_lease(hold, &mut r.holds[alloc]).unwrap();
            let remove = revoked && leases == 1;
            ended(m, alloc, e, remove);
            m.shares[i] = (!remove).then_some((alloc, revoked, leases - 1, g));
            if remove {
                r.shares[i] = None;
            }
        }
        Op::Free(a) => {
            if !m.present[a] {
                return;
            }
            let res = r.lt.free(&mut r.holds[a]);
            if m.freed[a] {
                assert_eq!(res, Err(LifetimeError::DoubleFree));
                return;
            }
            m.freed[a] = true;
            if m.refs[a] > 0 {
                assert_eq!(res, Ok(FreeStep::Deferred));
            } else {
                assert_eq!(res, Ok(FreeStep::Now));
                m.released[a] += 1;
                m.present[a] = false;
            }
        }
        Op::Realloc(a) => {
            if !m.present[a] {
                assert_eq!(m.refs[a], 0);
                assert!(r.holds[a].refs() == 0, "a released allocation still held");
                r.holds[a] = AllocHold::default();
                m.present[a] = true;
                m.freed[a] = false;
                m.released[a] = 0;
            }
        }
        Op::Destroy => {
            let expect = arena_refs(m) == 0 && !m.pinned && m.open.is_none();
            assert_eq!(r.lt.destroyable(), expect);
            if expect && !m.present.iter().any(|&p| p) {
                // The pool destroys it: a new arena takes its place.
                *r = Real {
                    lt: ArenaLifetime::new(),
                    holds: Default::default(),
                    shares: Vec::new(),
                };
                *m = Model::default();
            }
        }
        Op::Generation(g) => {
            let res = r.lt.check_generation(g);
            assert_eq!(res.is_ok(), g == m.generation, "{res:?}");
        }
    }
}

fn check(m: &Model, r: &Real) {
    assert_eq!(r.lt.refs(), arena_refs(m), "arena refs");
    for a in 0..ALLOCS {
        assert_eq!(u64::from(r.holds[a].refs()), m.refs[a], "refs of {a}");
        assert!(m.released[a] <= 1, "allocation {a} released twice");
    }
    assert_eq!(r.lt.pinned(), m.pinned);
    assert_eq!(r.lt.generation(), m.generation);
    assert_eq!(r.lt.export().copied(), m.open, "the open export");
    assert!(!matches!(r.lt.state(), ExportState::Exporting));
    assert!(
        !(m.pinned && r.lt.destroyable()),
        "a pinned arena is destroyable"
    );
    if m.open.is_none() {
        assert!(!m.pinned, "a pinning export was closed");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]
    #[test]
    fn lifetime_matches_the_model(ops in prop::collection::vec(op(), 1..80)) {
        let mut m = Model { present: [true; ALLOCS], ..Model::default() };
        let mut r = Real { lt: ArenaLifetime::new(), holds: Default::default(), shares: Vec::new() };
        for op in &ops {
            step(&mut m, &mut r, op);
            check(&m, &r);
        }
        // Drain: close every lease, unshare every share, free every allocation.
        while !m.leases.is_empty() {
            step(&mut m, &mut r, &Op::CloseLease(0));
            check(&m, &r);
        }
        for i in 0..m.shares.len() {
            step(&mut m, &mut r, &Op::Unshare(i));
            check(&m, &r);
        }
        for a in 0..ALLOCS {
            step(&mut m, &mut r, &Op::Free(a));
            check(&m, &r);
            prop_assert!(!m.present[a] && m.released[a] <= 1);
        }
        prop_assert_eq!(r.lt.refs(), 0);
        prop_assert_eq!(r.lt.destroyable(), !m.pinned, "unpinned: destroyable once all is done");
    }
}
