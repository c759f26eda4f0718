//! A **loom test** of the thread front's handoffs (`pool/front/thread_cache.rs`): a thread's
//! cache, the live records in it, a free on another thread into that cache, and a sleep
//! (or any flush) that drains the caches under the device lock.
//!
//! Loom explores only code written against its own primitives, and the pool's caches sit
//! behind spin locks and thread-locals, so the pool's *sequencing* is reproduced here, as
//! `loom_lifetime.rs` does for shares: the device lock and the cache lock are loom mutexes
//! (the cache's spin lock has the same acquire/release semantics), the asleep gate is a
//! relaxed atomic as in `Front::gated`, and each step takes the locks in the pool's order
//! (device, then cache) at the same points:
//!
//! | step here | real code |
//! |---|---|
//! | [`Model::fast_alloc`] | `Front::try_alloc`: under the cache lock, the gate, then pop a block and mark its record live (`pool/front/thread_records.rs`: a freed block keeps its record's slot) |
//! | [`Model::slow_alloc`] | `Pool::alloc` under the device lock: the asleep check, a block from the device, recorded in the calling thread's cache (`Front::record_alloc`) |
//! | [`Model::fast_free`] | `Front::try_free` / `free_into`: under the lock of the cache holding the record, the gate, then the block into that cache |
//! | [`Model::slow_free`] | `free_on` under the device lock: `promote` (record out of the cache), the block back to the device |
//! | [`Model::sleep`] | `sleep_device`: the gate set, `settle_all` draining every cache (`flush_cached_above`), `asleep_tags` set |
//!
//! Checked in every interleaving: no block is handed out from a cache after a sleep drained
//! that cache (the gate is set before the drain and read under the cache lock); every block
//! is in exactly one place at the end (device, a cache's blocks, a live record), none lost
//! or duplicated by a cross-thread free racing the drain. [`a_gate_set_after_the_drain_is_caught`]
//! shows that loom finds the bug of setting the gate after draining.
#![allow(clippy::unwrap_used)]

use loom::sync::atomic::{AtomicBool, Ordering::Relaxed};
use loom::sync::{Arc, Mutex};
use loom::thread;

/// Blocks in the model (block ids).
const BLOCKS: [u32; 3] = [0, 1, 2];

/// One thread's cache: freed blocks, and the records of the live allocations it made.
#[derive(Default)]
struct Cache {
    blocks: Vec<u32>,
    live: Vec<u32>,
    /// Model only: a sleep drained this cache (set under its lock).
    drained_for_sleep: bool,
}

#[derive(Default)]
struct Device {
    /// Free blocks the device holds (its cache and sub-allocator).
    free: Vec<u32>,
    /// Records promoted into the device's map.
    live: Vec<u32>,
    asleep: bool,
}

/// Where the sleeper sets the gate relative to draining the caches.
#[derive(Clone, Copy, PartialEq, Eq)]
enum GateOrder {
    /// As `sleep_device` does: gate, then drain.
    BeforeDrain,
    /// The bug: drain, then gate.
    AfterDrain,
}

struct Model {
    device: Mutex<Device>,
    /// `Front::gates.asleep_tags` (one tag).
    gate: AtomicBool,
    /// The owner thread's cache (the only thread that allocates).
    cache: Mutex<Cache>,
    order: GateOrder,
}

impl Model {
    fn fast_alloc(&self) -> Option<u32> {
        let mut c = self.cache.lock().unwrap();
        if self.gate.load(Relaxed) {
            return None;
        }
        let b = c.blocks.pop()?;
        assert!(
            !c.drained_for_sleep,
            "block {b} handed out from a cache after a sleep drained it"
        );
        c.live.push(b);
        Some(b)
    }

    fn slow_alloc(&self) -> Option<u32> {
        let mut d = self.device.lock().unwrap();
        if d.asleep {
            return None;
        }
        let b = d.free.pop()?;
        self.cache.lock().unwrap().live.push(b);
        Some(b)
    }

    fn alloc(&self) -> Option<u32> {
        self.fast_alloc().or_else(|| self.slow_alloc())
    }

    /// `true` when the block went into the cache holding its record.
    fn fast_free(&self, b: u32) -> bool {
        let mut c = self.cache.lock().unwrap();
        let Some(i) = c.live.iter().position(|&x| x == b) else {
            return false;
        };
        if self.gate.load(Relaxed) {
            return false;
        }
        c.live.swap_remove(i);
        c.blocks.push(b);
        true
    }

    fn slow_free(&self, b: u32) {
        let mut d = self.device.lock().unwrap();
        {
            // promote
            let mut c = self.cache.lock().unwrap();
            if let Some(i) = c.live.iter().position(|&x| x == b) {
                c.live.swap_remove(i);
                d.live.push(b);
            }
        }
        let i = d
            .live
            .iter()
            .position(|&x| x == b)
            .expect("freed block is live");
        d.live.swap_remove(i);
        d.free.push(b);
    }

    fn free(&self, b: u32) {
        if !self.fast_free(b) {
            self.slow_free(b);
        }
    }

    fn sleep(&self) {
        let mut d = self.device.lock().unwrap();
        if self.order == GateOrder::BeforeDrain {
            self.gate.store(true, Relaxed);
        }
        {
            let mut c = self.cache.lock().unwrap();
            let drained: Vec<u32> = c.blocks.drain(..).collect();
            d.free.extend(drained);
            c.drained_for_sleep = true;
        }
        if self.order == GateOrder::AfterDrain {
            self.gate.store(true, Relaxed);
        }
        d.asleep = true;
    }

    /// Every block in exactly one place.
    fn check_conservation(&self) {
        let d = self.device.lock().unwrap();
        let c = self.cache.lock().unwrap();
        let mut all: Vec<u32> = d
            .free
            .iter()
            .chain(&d.live)
            .chain(&c.blocks)
            .chain(&c.live)
            .copied()
            .collect();
        all.sort_unstable();
        assert_eq!(all, BLOCKS, "a block was lost or duplicated");
    }
}

/// The owner allocates, frees and allocates again (the second from its cache); another
/// thread frees a block the owner allocated earlier; a sleeper drains and gates.
fn scenario(order: GateOrder) {
    let mut b = loom::model::Builder::new();
    // Exhaustive (None) takes ~50 s in a debug build; 3 preemptions reach the races above.
    b.preemption_bound = Some(3);
    b.check(move || {
        let m = Arc::new(Model {
            device: Mutex::new(Device {
                free: vec![0, 2],
                ..Device::default()
            }),
            gate: AtomicBool::new(false),
            // Block 1: allocated by the owner before the threads start, freed by `other`.
            cache: Mutex::new(Cache {
                live: vec![1],
                ..Cache::default()
            }),
            order,
        });
        let owner = {
            let m = m.clone();
            thread::spawn(move || {
                if let Some(a) = m.alloc() {
                    m.free(a);
                }
                if let Some(a) = m.alloc() {
                    m.free(a);
                }
            })
        };
        let other = {
            let m = m.clone();
            thread::spawn(move || m.free(1))
        };
        m.sleep();
        owner.join().unwrap();
        other.join().unwrap();
        m.check_conservation();
    });
}

#[test]
fn no_block_leaves_a_drained_cache_and_none_is_lost() {
    scenario(GateOrder::BeforeDrain);
}

#[test]
#[should_panic(expected = "handed out from a cache after a sleep drained it")]
fn a_gate_set_after_the_drain_is_caught() {
    scenario(GateOrder::AfterDrain);
}
