//! The pool of two sim devices and a [`Model`] of each: a step goes to one device's model,
//! or to the pool for every device at once; faults and synchronizes are counted here.

use std::sync::Arc;

use gpu_arena::backend::sim::{SimBackend, SimCall, SimConfig};
use gpu_arena::pool::MaxReserved;
use gpu_arena::{tags, Pool, PoolConfig, StreamId};
use proptest::prelude::*;

use super::helpers::Helper;
use super::model::{may_refuse, Model};
use super::observer::Registrar;
use super::ops::{op, Op, FAULTS, MIB, STREAMS};

/// The configuration a case runs with, besides growing or fixed arenas.
#[derive(Debug, Clone)]
pub(crate) struct Conf {
    /// Fixed arenas' size (small ones: more arenas, dedicated arenas for large blocks).
    pub(crate) arena_mib: u64,
    /// `max_reserved`: allocations past it are refused as out of memory.
    pub(crate) cap_mib: Option<u64>,
    /// Every `empty_cache` is a `trim` (the sim is always at an idle point).
    pub(crate) trim_on_empty_cache: bool,
}

pub(crate) fn conf() -> impl Strategy<Value = Conf> {
    (
        prop::sample::select(vec![8u64, 64]),
        prop::option::weighted(0.3, prop::sample::select(vec![96u64, 256])),
        prop::bool::weighted(0.3),
    )
        .prop_map(|(arena_mib, cap_mib, trim_on_empty_cache)| Conf {
            arena_mib,
            cap_mib,
            trim_on_empty_cache,
        })
}

/// Devices of the sim: every operation names one, a few name every device.
pub(crate) const DEVICES: i32 = 2;

/// The pool, its sim backend and one [`Model`] per device.
pub(crate) struct World {
    pub(crate) sim: Arc<SimBackend>,
    pub(crate) pool: Arc<Pool>,
    pub(crate) tags: [u8; 3],
    pub(crate) observer: Option<Arc<Registrar>>,
    pub(crate) cap: Option<u64>,
    pub(crate) models: Vec<Model>,
    pub(crate) faults: Vec<(SimCall, u64)>,
    /// Threads a step may run on besides the test's own (`Step::thread`).
    helpers: Vec<Helper>,
}

/// Helper threads of a world.
const HELPERS: usize = 2;

/// One step: an operation on device `dev`, or on every device (`every`) for the calls
/// that take one (`empty_cache`, `trim`, sleep, wake, the host buffers'), run on the
/// test's thread (`thread` 0) or on helper thread `thread - 1`.
#[derive(Debug, Clone)]
pub(crate) struct Step {
    pub(crate) dev: i32,
    pub(crate) every: bool,
    pub(crate) thread: usize,
    pub(crate) op: Op,
}

pub(crate) fn step() -> impl Strategy<Value = Step> {
    let thread = prop_oneof![6 => Just(0usize), 2 => Just(1), 2 => Just(2)];
    (0..DEVICES, prop::bool::weighted(0.2), thread, op()).prop_map(|(dev, every, thread, op)| {
        Step {
            dev,
            every,
            thread,
            op,
        }
    })
}

impl World {
    pub(crate) fn new(grow: bool, observe: bool, conf: &Conf) -> World {
        let sim = Arc::new(
            SimBackend::new(SimConfig {
                devices: DEVICES as usize,
                capacity: 512 * MIB,
                ..SimConfig::default()
            })
            .unwrap(),
        );
        let pool = Arc::new(
            Pool::new(
                sim.clone(),
                PoolConfig {
                    grow_arenas: grow,
                    arena_size: conf.arena_mib * MIB,
                    max_reserved: conf.cap_mib.map(|m| MaxReserved::Bytes(m * MIB)),
                    trim_on_empty_cache: conf.trim_on_empty_cache,
                    validate: false,
                    ..PoolConfig::default()
                },
            )
            .unwrap(),
        );
        let observer = observe.then(|| {
            let r = Arc::new(Registrar::default());
            pool.observe_arenas(r.clone());
            r
        });
        let mut w = World {
            sim,
            pool,
            tags: [
                0,
                tags::index(Some("model_weights")).unwrap(),
                tags::index(Some("model_kv")).unwrap(),
            ],
            observer,
            cap: conf.cap_mib.map(|m| m * MIB),
            models: Vec::new(),
            faults: Vec::new(),
            helpers: (0..HELPERS).map(|_| Helper::start()).collect(),
        };
        w.models = (0..DEVICES)
            .map(|d| {
                let (sim, pool, obs) = (w.sim.clone(), w.pool.clone(), w.observer.clone());
                Model::new(sim, pool, d, w.tags, obs, w.cap)
            })
            .collect();
        w
    }

    /// Run one step; `Err` when the pool broke a rule (a refused call is not one).
    pub(crate) fn apply(&mut self, step: &Step) -> Result<(), String> {
        let op = &step.op;
        if let Op::Fault { call, n } = *op {
            self.faults.push((FAULTS[call], n));
            self.sim.fail_nth(FAULTS[call], n);
            return Ok(());
        }
        if let Op::RetireThread(k) = *op {
            let helper = &mut self.helpers[k % HELPERS];
            helper.retire();
            *helper = Helper::start();
            return Ok(());
        }
        let syncs = self.sim.calls(SimCall::Synchronize);
        for m in &mut self.models {
            m.faults.clone_from(&self.faults);
            m.syncs_before = syncs;
            m.reserved_before = self
                .pool
                .stats(m.dev)
                .map_err(|e| e.to_string())?
                .reserved_bytes;
        }
        let every = step.every
            && matches!(
                op,
                Op::EmptyCache
                    | Op::Trim
                    | Op::PrepareOffload(_)
                    | Op::ReleaseHostBuffers
                    | Op::Sleep { .. }
                    | Op::Wake { .. }
            );
        let result = if every {
            self.every_device(op)
        } else {
            self.on_thread(step.thread, step.dev as usize, op)
        };
        // A synchronize runs on the devices the call touched.
        for m in &mut self.models {
            if every || m.dev == step.dev {
                m.settle_fences();
            }
        }
        for (call, _) in std::mem::take(&mut self.faults) {
            self.sim.fail_nth(call, 0);
        }
        result?;
        for m in &self.models {
            m.check(op).map_err(|e| format!("device {}: {e}", m.dev))?;
        }
        Ok(())
    }

    /// `op` on device `d`'s model, run on the test's thread (`thread` 0) or a helper's.
    fn on_thread(&mut self, thread: usize, d: usize, op: &Op) -> Result<(), String> {
        let Some(helper) = thread.checked_sub(1).map(|k| &self.helpers[k % HELPERS]) else {
            return self.models[d].apply_call(op);
        };
        let mut m = self.models.remove(d);
        let op = op.clone();
        let (m, r) = helper.run(move || {
            let r = m.apply_call(&op);
            (m, r)
        });
        self.models.insert(d, m);
        r
    }

    /// The calls that take `None` for every device.
    pub(crate) fn every_device(&mut self, op: &Op) -> Result<(), String> {
        let pool = self.pool.clone();
        let faults = !self.faults.is_empty();
        match *op {
            Op::EmptyCache => {
                let _ = pool.empty_cache(None);
            }
            Op::Trim => {
                let _ = pool.trim(None);
            }
            Op::PrepareOffload(sel) => {
                let tags = self.models[0].tag_mask(sel);
                if let Err(e) = pool.prepare_offload(None, &tags) {
                    if !may_refuse(&e, faults) {
                        return Err(format!("prepare_offload(every device) refused: {e}"));
                    }
                }
            }
            Op::ReleaseHostBuffers => {
                pool.release_host_buffers(None)
                    .map_err(|e| format!("release_host_buffers(every device): {e}"))?;
            }
            Op::Sleep { tags: sel, offload } => {
                let names = self.models[0].tag_mask(sel);
                let keep = self.models[0].tag_mask(offload);
                let want: u64 = names.iter().map(|&t| 1u64 << t).sum();
                let keep_mask: u64 = keep.iter().map(|&t| 1u64 << t).sum();
                let got = pool.sleep_tags(None, Some(&names), &keep);
                // Only devices that would sleep are checked for an open capture.
                let routing = self
                    .models
                    .iter()
                    .any(|m| m.routing() && m.asleep & want != want);
                // A device where every named tag sleeps already is skipped; one where only
                // some do refuses the call.
                let partly = self
                    .models
                    .iter()
                    .any(|m| m.asleep & want != 0 && m.asleep & want != want);
                let all_asleep = self.models.iter().all(|m| m.asleep & want == want);
                for m in &mut self.models {
                    let before = m.asleep;
                    let now = pool.asleep_tags(m.dev).map_err(|e| e.to_string())?;
                    let ok = match &got {
                        Ok(_) if routing || partly || all_asleep => false,
                        Ok(_) => now == before | want,
                        Err(_) if routing => now == before,
                        Err(e) => {
                            (partly || all_asleep || may_refuse(e, faults))
                                && (now == before || now == before | want)
                        }
                    };
                    if !ok {
                        return Err(format!(
                            "sleep of every device ({got:?}): device {} asleep {now:#b} from {before:#b}, tags {want:#b}",
                            m.dev
                        ));
                    }
                    m.offloaded |= (now & !before) & keep_mask;
                    m.offloaded &= now;
                    m.asleep = now;
                }
            }
            Op::Wake { tags: sel } => {
                let names = self.models[0].tag_mask(sel);
                let got = if names.is_empty() {
                    pool.wake(None, None)
                } else {
                    pool.wake(None, Some(&names))
                };
                for m in &mut self.models {
                    let before = m.asleep;
                    let now = pool.asleep_tags(m.dev).map_err(|e| e.to_string())?;
                    if now != before && m.routing() {
                        return Err(format!(
                            "a wake of every device ran on device {} while a graph pool context is open there",
                            m.dev
                        ));
                    }
                    if got.is_err() && now != before {
                        return Err(format!(
                            "failed wake of every device changed device {}'s asleep tags {before:#b} -> {now:#b}",
                            m.dev
                        ));
                    }
                    m.woken(before, now);
                }
            }
            _ => unreachable!("not an every-device call: {op:?}"),
        }
        Ok(())
    }

    /// Each device's model on a thread of its own, running `steps[d]` on device `d` at the
    /// same time as the other (faults left out: a scheduled fault could hit the other
    /// thread's call; calls on every device left out). Each step is checked against its
    /// device's model as it runs alone; a synchronize seen on either device clears the
    /// fences of both (looser, never a false alarm).
    pub(crate) fn run_threads(&mut self, steps: [Vec<Step>; 2]) -> Result<(), String> {
        let models = std::mem::take(&mut self.models);
        let results: Vec<(Model, Result<(), String>)> = std::thread::scope(|scope| {
            let handles: Vec<_> = models
                .into_iter()
                .zip(steps)
                .map(|(mut m, steps)| {
                    scope.spawn(move || {
                        for (n, step) in steps.iter().enumerate() {
                            if matches!(step.op, Op::Fault { .. } | Op::RetireThread(_)) {
                                continue;
                            }
                            m.syncs_before = m.sim.calls(SimCall::Synchronize);
                            m.reserved_before = m.pool.stats(m.dev).unwrap().reserved_bytes;
                            let r = m.apply_call(&step.op);
                            m.settle_fences();
                            if let Err(e) = r.and_then(|()| m.check(&step.op)) {
                                let e = format!("device {} step {n} {:?}: {e}", m.dev, step.op);
                                return (m, Err(e));
                            }
                        }
                        (m, Ok(()))
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let mut first_err = Ok(());
        for (m, r) in results {
            self.models.push(m);
            if first_err.is_ok() {
                first_err = r;
            }
        }
        first_err
    }

    /// Free and unshare everything, wake every tag, unblock every stream, end every graph
    /// pool: the sim devices must then hold nothing after `empty_cache`.
    pub(crate) fn teardown(mut self) -> Result<(), String> {
        // The helpers' caches are left behind, as a thread's at its exit.
        for h in &mut self.helpers {
            h.retire();
        }
        for (call, _) in std::mem::take(&mut self.faults) {
            self.sim.fail_nth(call, 0);
        }
        for d in 0..DEVICES {
            for s in 1..=STREAMS {
                self.sim.unblock_stream(d, StreamId(s));
            }
        }
        self.sim.close_stranded_exports();
        // No cap for the teardown: a cap set at run time may leave no room for the wakes.
        for m in &mut self.models {
            self.pool
                .set_max_reserved(m.dev, None)
                .map_err(|e| e.to_string())?;
            m.cap = None;
            m.free_all()?;
        }
        // What is awake went back first, so that the wakes find room.
        self.pool
            .empty_cache(None)
            .map_err(|e| format!("final empty_cache: {e}"))?;
        // One tag at a time: each tag's arenas fit under `max_reserved` (they were all awake
        // at once when it went to sleep), all of them together need not.
        for m in &self.models {
            for tag in self.tags {
                if m.asleep & (1 << tag) == 0 {
                    continue;
                }
                self.pool
                    .wake(Some(m.dev), Some(&[tag]))
                    .map_err(|e| format!("final wake of tag {tag} on device {}: {e}", m.dev))?;
                self.pool
                    .empty_cache(None)
                    .map_err(|e| format!("final empty_cache after the wake: {e}"))?;
            }
        }
        self.pool
            .release_host_buffers(None)
            .map_err(|e| e.to_string())?;
        for d in 0..DEVICES {
            self.pool.validate(d).map_err(|e| e.to_string())?;
            if !self.sim.is_clean(d) {
                return Err(format!(
                    "device {d} not clean at the end: {:?}",
                    self.sim.ledger(d)
                ));
            }
        }
        if let Some(obs) = &self.observer {
            if let Some(e) = obs.broken() {
                return Err(format!("observer at the end: {e}"));
            }
            if obs.registered() != 0 {
                return Err(format!(
                    "{} arenas still registered with the observer when none is left",
                    obs.registered()
                ));
            }
        }
        if self.sim.host_buffers() != 0 {
            return Err(format!("{} host buffers left", self.sim.host_buffers()));
        }
        Ok(())
    }
}
