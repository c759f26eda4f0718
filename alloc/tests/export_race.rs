//! An export runs with the device lock released (`Pool::share`, the `Exporting` state of
//! `lifetime.rs`), and it covers every chunk of the arena as it was when the export began:
//! nothing may change the arena's chunks meanwhile. Found by `stress.rs` (8 threads mixing
//! shares and allocations): another thread grew the arena being exported, and the export
//! was refused ("arena 4 is 16777216 bytes ..., not 8388608 bytes"). Here a backend runs the
//! other thread's step inside `export`, so the race happens every time: an allocation that
//! would grow the arena, and an `empty_cache` that would give back one of its free chunks.
#![allow(clippy::unwrap_used)]

use std::sync::{Arc, Mutex};

use gpu_arena::backend::sim::{SimBackend, SimConfig};
use gpu_arena::backend::{
    ArenaMem, Backend, DeviceId, Event, Export, ImportSource, Mapping, MemInfo, StreamId,
};
use gpu_arena::{Pool, PoolConfig, Result};

mod common;
use common::{fill, read};

const MIB: u64 = 1 << 20;
const S: StreamId = StreamId(7);

type Step = Box<dyn FnOnce() + Send>;

/// The sim, running a step (once) at the start of its next `export`.
#[derive(Debug)]
struct DuringExport {
    sim: Arc<SimBackend>,
    step: Mutex<Option<StepBox>>,
}

struct StepBox(Step);

impl std::fmt::Debug for StepBox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StepBox")
    }
}

impl Backend for DuringExport {
    fn name(&self) -> &'static str {
        "during-export"
    }
    fn device_count(&self) -> Result<usize> {
        self.sim.device_count()
    }
    fn granularity(&self, d: DeviceId) -> Result<u64> {
        self.sim.granularity(d)
    }
    fn mem_info(&self, d: DeviceId) -> Result<MemInfo> {
        self.sim.mem_info(d)
    }
    fn create_arena(&self, d: DeviceId, bytes: u64) -> Result<ArenaMem> {
        self.sim.create_arena(d, bytes)
    }
    fn create_growable_arena(&self, d: DeviceId, bytes: u64, reserve: u64) -> Result<ArenaMem> {
        self.sim.create_growable_arena(d, bytes, reserve)
    }
    fn can_grow(&self, a: &ArenaMem, extra: u64) -> bool {
        self.sim.can_grow(a, extra)
    }
    fn grow_arena(&self, a: &ArenaMem, extra: u64) -> Result<ArenaMem> {
        self.sim.grow_arena(a, extra)
    }
    fn shrink_arena(&self, a: &ArenaMem, keep: u64) -> Result<(ArenaMem, usize)> {
        self.sim.shrink_arena(a, keep)
    }
    fn chunk_spans(&self, a: &ArenaMem) -> Vec<(u64, u64)> {
        self.sim.chunk_spans(a)
    }
    fn drop_chunks(&self, a: &ArenaMem, doomed: &[usize]) -> Result<Vec<(ArenaMem, usize)>> {
        self.sim.drop_chunks(a, doomed)
    }
    fn destroy_arena(&self, a: ArenaMem) -> Result<()> {
        self.sim.destroy_arena(a)
    }
    fn export(&self, a: &ArenaMem) -> Result<Export> {
        let step = self.step.lock().unwrap().take();
        if let Some(StepBox(step)) = step {
            step();
        }
        self.sim.export(a)
    }
    fn close_export(&self, a: &ArenaMem, e: Export) -> Result<()> {
        self.sim.close_export(a, e)
    }
    fn import(&self, d: DeviceId, s: ImportSource<'_>, bytes: u64) -> Result<Mapping> {
        self.sim.import(d, s, bytes)
    }
    fn unmap_import(&self, m: Mapping) -> Result<()> {
        self.sim.unmap_import(m)
    }
    fn record_event(&self, d: DeviceId, s: StreamId) -> Result<Event> {
        self.sim.record_event(d, s)
    }
    fn event_done(&self, e: &Event) -> Result<bool> {
        self.sim.event_done(e)
    }
    fn destroy_event(&self, e: Event) -> Result<()> {
        self.sim.destroy_event(e)
    }
    fn synchronize(&self, d: DeviceId) -> Result<()> {
        self.sim.synchronize(d)
    }
}

/// A validating pool (growing arenas, the default) over the wrapped sim.
fn pool() -> (Arc<SimBackend>, Arc<DuringExport>, Arc<Pool>) {
    let sim = Arc::new(SimBackend::new(SimConfig::default()).unwrap());
    let backend = Arc::new(DuringExport {
        sim: sim.clone(),
        step: Mutex::default(),
    });
    let config = PoolConfig {
        validate: true,
        ..PoolConfig::default()
    };
    let pool = Arc::new(Pool::new(backend.clone(), config).unwrap());
    (sim, backend, pool)
}

/// Run `step` inside the next export of an arena. (A device's first share runs the export
/// self-test first, with an export of its own: a small block is shared once before, and its
/// arena given back.)
/// Whether the `n` bytes at `ptr` hold what `fill(.., n, seed)` wrote.
fn holds(ptr: u64, n: usize, seed: u8) -> bool {
    let mut want = vec![0u8; n];
    fill(want.as_mut_ptr() as u64, n, seed);
    read(ptr, n) == want
}

fn run_during_export(pool: &Pool, backend: &DuringExport, step: impl FnOnce() + Send + 'static) {
    let small = pool.alloc(0, 4096, S).unwrap();
    let info = pool.share(small.ptr, 4096).unwrap();
    pool.unshare(info.device, info.share_key, &info.token)
        .unwrap();
    pool.free(small.ptr).unwrap();
    pool.empty_cache(None).unwrap();
    *backend.step.lock().unwrap() = Some(StepBox(Box::new(step)));
}

/// The arena being exported does not grow: a request it cannot hold goes to a new arena,
/// the export succeeds, and the shared block keeps its bytes.
#[test]
fn an_arena_being_exported_does_not_grow() {
    let (sim, backend, pool) = pool();
    let a = pool.alloc(0, 16 * MIB, S).unwrap();
    fill(a.ptr, (16 * MIB) as usize, 5);
    let grown_before = pool.stats(0).unwrap().arena_growths;
    let other = Arc::new(Mutex::new(None));
    let (p, o) = (pool.clone(), other.clone());
    run_during_export(&pool, &backend, move || {
        *o.lock().unwrap() = Some(p.alloc(0, 16 * MIB, S).unwrap());
    });
    let info = pool.share(a.ptr, 16 * MIB).unwrap();
    let b = other.lock().unwrap().take().expect("the step ran");
    let s = pool.stats(0).unwrap();
    assert_eq!(s.arena_growths, grown_before, "{s:?}");
    assert_eq!(s.arenas, 2, "{s:?}");
    assert!(b.ptr < a.ptr || b.ptr >= a.ptr + 16 * MIB);
    assert!(holds(a.ptr, (16 * MIB) as usize, 5));
    pool.unshare(info.device, info.share_key, &info.token)
        .unwrap();
    pool.free(a.ptr).unwrap();
    pool.free(b.ptr).unwrap();
    pool.empty_cache(None).unwrap();
    assert!(sim.is_clean(0), "{:?}", sim.ledger(0));
}

/// `empty_cache` leaves the chunks of an arena being exported: the free chunk between two
/// live blocks stays until the export is gone.
#[test]
fn empty_cache_leaves_an_arena_being_exported_whole() {
    let (sim, backend, pool) = pool();
    let blocks: Vec<_> = (0..3)
        .map(|_| pool.alloc(0, 20 * MIB, S).unwrap())
        .collect();
    assert_eq!(pool.stats(0).unwrap().arenas, 1);
    fill(blocks[0].ptr, 4096, 9);
    let released = Arc::new(Mutex::new(None));
    let (p, r) = (pool.clone(), released.clone());
    run_during_export(&pool, &backend, move || {
        *r.lock().unwrap() = Some(p.empty_cache(None).unwrap());
    });
    pool.free(blocks[1].ptr).unwrap();
    let reserved = pool.stats(0).unwrap().reserved_bytes;
    assert_eq!(reserved, 60 * MIB);
    let info = pool.share(blocks[0].ptr, 4096).unwrap();
    assert_eq!(released.lock().unwrap().take(), Some(0), "the step ran");
    assert_eq!(pool.stats(0).unwrap().reserved_bytes, reserved);
    assert!(holds(blocks[0].ptr, 4096, 9));
    pool.unshare(info.device, info.share_key, &info.token)
        .unwrap();
    for b in [&blocks[0], &blocks[2]] {
        pool.free(b.ptr).unwrap();
    }
    pool.empty_cache(None).unwrap();
    assert_eq!(pool.stats(0).unwrap().reserved_bytes, 0);
    assert!(sim.is_clean(0), "{:?}", sim.ledger(0));
}
