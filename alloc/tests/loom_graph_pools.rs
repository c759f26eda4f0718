//! A **loom test** of graph pools' sequencing (`pool/graphs/graph_pools.rs`) against another
//! thread's allocations: a capture thread opens a routing context, allocates and frees in
//! its pool and frees a `record_stream` block, while another thread allocates and frees in
//! the general pool (its thread cache, then the device lock), frees its own `record_stream`
//! block and calls `empty_cache`.
//!
//! As in `loom_thread_cache.rs`, the pool's sequencing is reproduced with loom's primitives:
//! the device lock and the thread cache's lock are loom mutexes taken in the pool's order
//! (device, then cache), at the same points as the real code:
//!
//! | step here | real code |
//! |---|---|
//! | [`Model::begin`] / [`Model::end`] | `Pool::graph_pool_begin` / `graph_pool_end` under the device lock; the last end records the deferred frees' events (`end_deferred`) |
//! | [`Model::pool_alloc`] | `Pool::graph_pool_alloc`: the pool's own ranges under the device lock, never a cache |
//! | [`Model::free_slow`] | `free_locked`: a pool block back to its pool (never cached); a `record_stream` block deferred while routing, else its events recorded |
//! | [`Model::general_alloc`] / [`Model::free_fast`] | the thread front (`Front::try_alloc` / `try_free`): only general blocks are ever in a cache |
//! | [`Model::empty_cache`] | `release_cached`: refused while routing (it synchronizes), else a pool in use keeps its arenas |
//!
//! Checked in every interleaving: no event is recorded and no synchronize runs while a
//! routing context is open; no pool block is ever in a thread cache or handed to a general
//! allocation; a pool in use never loses its memory; every block ends in exactly one place
//! and no deferred free is left once the contexts closed. [`a_free_that_ignores_routing_is_caught`]
//! shows that loom finds a free path that records events without looking at the routing.
#![allow(clippy::unwrap_used)]

use loom::sync::{Arc, Mutex};
use loom::thread;

/// General blocks (the other thread's) and pool blocks (the capture's).
const GENERAL: [u32; 2] = [0, 1];
const POOL: [u32; 2] = [100, 101];
/// Blocks with `record_stream` streams: one per thread.
const STREAMED_GENERAL: u32 = 10;
const STREAMED_CAPTURE: u32 = 11;

fn is_pool(b: u32) -> bool {
    POOL.contains(&b)
}

#[derive(Default)]
struct Device {
    general_free: Vec<u32>,
    pool_free: Vec<u32>,
    /// Records in the device's map.
    live: Vec<u32>,
    routing: u32,
    pool_uses: u32,
    /// The pool exists (created by the first begin).
    created: bool,
    /// Frees waiting for the last context to close.
    deferred: Vec<u32>,
    /// Frees whose events were recorded.
    pending: Vec<u32>,
    /// Whether the pool's memory went back (only allowed once its use count is 0).
    pool_released: bool,
}

#[derive(Default)]
struct Cache {
    blocks: Vec<u32>,
    live: Vec<u32>,
}

/// Whether the free path looks at the routing before recording events.
#[derive(Clone, Copy, PartialEq, Eq)]
enum FreePath {
    /// As `free_locked` does.
    DefersWhileRouting,
    /// The bug: events recorded whatever the routing.
    IgnoresRouting,
}

struct Model {
    device: Mutex<Device>,
    cache: Mutex<Cache>,
    path: FreePath,
}

impl Model {
    fn record_event(d: &Device, b: u32) {
        assert_eq!(
            d.routing, 0,
            "an event recorded for block {b} while a capture may be under way"
        );
    }

    fn begin(&self) {
        let mut d = self.device.lock().unwrap();
        d.routing += 1;
        d.pool_uses += 1;
        d.created = true;
    }

    fn end(&self) {
        let mut d = self.device.lock().unwrap();
        d.routing -= 1;
        if d.routing == 0 {
            for b in std::mem::take(&mut d.deferred) {
                Self::record_event(&d, b);
                d.pending.push(b);
            }
        }
    }

    fn release(&self) {
        let mut d = self.device.lock().unwrap();
        d.pool_uses -= 1;
    }

    fn pool_alloc(&self) -> u32 {
        let mut d = self.device.lock().unwrap();
        assert!(!d.pool_released, "allocation in a pool whose memory went");
        let b = d.pool_free.pop().expect("the pool has a free block");
        d.live.push(b);
        b
    }

    fn general_alloc(&self) -> Option<u32> {
        {
            let mut c = self.cache.lock().unwrap();
            if let Some(b) = c.blocks.pop() {
                assert!(!is_pool(b), "pool block {b} handed out by a thread cache");
                c.live.push(b);
                return Some(b);
            }
        }
        let mut d = self.device.lock().unwrap();
        let b = d.general_free.pop()?;
        assert!(!is_pool(b), "pool block {b} in the general free list");
        self.cache.lock().unwrap().live.push(b);
        Some(b)
    }

    /// A plain general block into the cache holding its record.
    fn free_fast(&self, b: u32) -> bool {
        let mut c = self.cache.lock().unwrap();
        let Some(i) = c.live.iter().position(|&x| x == b) else {
            return false;
        };
        c.live.swap_remove(i);
        c.blocks.push(b);
        true
    }

    fn free_slow(&self, b: u32) {
        let mut d = self.device.lock().unwrap();
        let i = d
            .live
            .iter()
            .position(|&x| x == b)
            .expect("freed block is live");
        d.live.swap_remove(i);
        if b == STREAMED_GENERAL || b == STREAMED_CAPTURE {
            if self.path == FreePath::DefersWhileRouting && d.routing > 0 {
                d.deferred.push(b);
            } else {
                Self::record_event(&d, b);
                d.pending.push(b);
            }
        } else if is_pool(b) {
            d.pool_free.push(b);
        } else {
            d.general_free.push(b);
        }
    }

    fn empty_cache(&self) {
        let mut d = self.device.lock().unwrap();
        if d.routing > 0 {
            return; // refused: it would synchronize during a capture
        }
        // The synchronize completes every pending free.
        let done = std::mem::take(&mut d.pending);
        for b in done {
            if b == STREAMED_CAPTURE {
                d.pool_free.push(b);
            } else {
                d.general_free.push(b);
            }
        }
        if d.created && d.pool_uses == 0 && d.live.iter().all(|&b| !is_pool(b)) {
            d.pool_released = true;
        }
    }
}

fn scenario(path: FreePath) {
    loom::model(move || {
        let m = Arc::new(Model {
            device: Mutex::new(Device {
                general_free: GENERAL.to_vec(),
                pool_free: POOL.to_vec(),
                live: vec![STREAMED_GENERAL, STREAMED_CAPTURE],
                ..Device::default()
            }),
            cache: Mutex::new(Cache::default()),
            path,
        });
        let capture = {
            let m = Arc::clone(&m);
            thread::spawn(move || {
                m.begin();
                let a = m.pool_alloc();
                m.free_slow(a);
                m.free_slow(STREAMED_CAPTURE);
                let b = m.pool_alloc();
                m.end();
                b
            })
        };
        // The other thread: general work and a record_stream free, racing the capture.
        let g = m.general_alloc().expect("a general block");
        assert!(m.free_fast(g));
        m.free_slow(STREAMED_GENERAL);
        m.empty_cache();
        let again = m.general_alloc().expect("a general block");
        let kept = capture.join().unwrap();
        assert!(!is_pool(again));
        // The capture's output is still live: the pool keeps its memory.
        m.empty_cache();
        assert!(!m.device.lock().unwrap().pool_released);
        let d = m.device.lock().unwrap();
        assert!(
            d.deferred.is_empty(),
            "a deferred free outlived the contexts"
        );
        assert!(d.live.contains(&kept));
        drop(d);
        m.release();
        m.free_slow(kept);
        m.empty_cache();
        let d = m.device.lock().unwrap();
        assert!(
            d.pool_released,
            "a released pool with no live block keeps its memory"
        );
        let c = m.cache.lock().unwrap();
        let mut all: Vec<u32> = d
            .general_free
            .iter()
            .chain(&d.pool_free)
            .chain(&d.live)
            .chain(&d.pending)
            .chain(&c.blocks)
            .chain(&c.live)
            .copied()
            .collect();
        all.sort_unstable();
        let mut want: Vec<u32> = GENERAL
            .iter()
            .chain(&POOL)
            .chain(&[STREAMED_GENERAL, STREAMED_CAPTURE])
            .copied()
            .collect();
        want.sort_unstable();
        assert_eq!(all, want, "a block lost or duplicated");
    });
}

#[test]
fn no_event_while_routing_and_no_pool_block_leaves_its_pool() {
    scenario(FreePath::DefersWhileRouting);
}

#[test]
#[should_panic(expected = "while a capture may be under way")]
fn a_free_that_ignores_routing_is_caught() {
    scenario(FreePath::IgnoresRouting);
}
