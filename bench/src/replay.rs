//! Replaying a [`Trace`] against an allocator, and the two baselines a user would otherwise
//! write over a [`Backend`].
//!
//! [`replay`] times the whole op sequence (one `Instant` around the loop) and samples
//! [`TraceAllocator::reserved_bytes`] after every op for the peak; implementations keep that
//! call a counter read. The sampling cost is inside the timed loop, so it is part of every
//! allocator's ns/op alike; [`ReplayResult::sample_ns`] says how much of it that is.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpu_arena::backend::ArenaMem;
use gpu_arena::{Backend, DeviceId};

use crate::trace::{Op, Trace};

/// An allocator a trace can be replayed against. Pointers are device addresses.
pub trait TraceAllocator {
    /// Allocate `bytes` for use on `stream`; returns the address.
    fn alloc(&mut self, bytes: u64, stream: u64) -> Result<u64, String>;
    /// Free what `alloc` returned (`bytes` and `stream` as passed to `alloc`).
    fn free(&mut self, ptr: u64, bytes: u64, stream: u64) -> Result<(), String>;
    /// Bytes currently held from the backend (cheap: called after every op).
    fn reserved_bytes(&self) -> u64;
    /// Name for reports.
    fn name(&self) -> String;
    /// The allocator's own peak of reserved bytes, when it keeps one. [`replay`] reports the
    /// larger of this and its own samples.
    fn peak_reserved_bytes(&self) -> Option<u64> {
        None
    }
    /// Extra facts for reports (e.g. number of arenas), as `(label, value)` pairs.
    fn notes(&self) -> Vec<(String, String)> {
        Vec::new()
    }
}

/// What one replay measured.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplayResult {
    /// The allocator's name.
    pub allocator: String,
    /// Operations replayed (allocs + frees).
    pub ops: usize,
    /// Wall time of the replay loop.
    pub elapsed: Duration,
    /// `elapsed / ops` in nanoseconds.
    pub ns_per_op: f64,
    /// Largest reserved bytes seen (sampled after every op).
    pub peak_reserved: u64,
    /// Largest sum of requested bytes live at once.
    pub peak_live: u64,
    /// `peak_reserved / peak_live`.
    pub ratio_reserved_to_live: f64,
    /// Cost of one [`TraceAllocator::reserved_bytes`] call in ns, measured after the replay
    /// (the part of `ns_per_op` that is sampling, not allocating).
    pub sample_ns: f64,
    /// The allocator's [`TraceAllocator::notes`] after the replay.
    pub notes: Vec<(String, String)>,
}

/// Replay every op of `trace` against `alloc`. Stops at the first failing op: the error names
/// the op, and everything still live is freed first (best effort) so the allocator can be
/// reused or dropped cleanly.
pub fn replay(trace: &Trace, alloc: &mut dyn TraceAllocator) -> Result<ReplayResult, String> {
    // id -> (ptr, bytes, stream); allocated before the clock starts.
    let mut slots: Vec<(u64, u64, u64)> = vec![(0, 0, 0); trace.allocs as usize];
    let mut live = 0u64;
    let mut peak_live = 0u64;
    let mut peak_reserved = alloc.reserved_bytes();
    let mut failure: Option<String> = None;

    let start = Instant::now();
    for (i, op) in trace.ops.iter().enumerate() {
        let step = match *op {
            Op::Alloc { id, bytes, stream } => match slots.get_mut(id as usize) {
                Some(slot) => alloc.alloc(bytes, stream).map(|ptr| {
                    *slot = (ptr, bytes, stream);
                    live += bytes;
                    peak_live = peak_live.max(live);
                }),
                None => Err(format!("id {id} outside the trace's {} ids", trace.allocs)),
            },
            Op::Free { id } => match slots.get_mut(id as usize) {
                Some(slot) if slot.1 != 0 => {
                    let (ptr, bytes, stream) = std::mem::take(slot);
                    live -= bytes;
                    alloc.free(ptr, bytes, stream)
                }
                _ => Err(format!("free of id {id}, which is not live")),
            },
        };
        if let Err(e) = step {
            failure = Some(format!("{}: op {i} ({op:?}) failed: {e}", alloc.name()));
            break;
        }
        peak_reserved = peak_reserved.max(alloc.reserved_bytes());
    }
    let elapsed = start.elapsed();

    if let Some(e) = failure {
        for &(ptr, bytes, stream) in slots.iter().filter(|s| s.1 != 0) {
            let _ = alloc.free(ptr, bytes, stream);
        }
        return Err(e);
    }
    let sample_ns = sample_cost_ns(alloc);
    if let Some(p) = alloc.peak_reserved_bytes() {
        peak_reserved = peak_reserved.max(p);
    }
    let ops = trace.ops.len();
    Ok(ReplayResult {
        allocator: alloc.name(),
        ops,
        elapsed,
        ns_per_op: elapsed.as_nanos() as f64 / ops.max(1) as f64,
        peak_reserved,
        peak_live,
        ratio_reserved_to_live: if peak_live == 0 {
            0.0
        } else {
            peak_reserved as f64 / peak_live as f64
        },
        sample_ns,
        notes: alloc.notes(),
    })
}

/// Time `reserved_bytes()` on the allocator's current state: ns per call.
fn sample_cost_ns(alloc: &dyn TraceAllocator) -> f64 {
    const CALLS: u32 = 20_000;
    let start = Instant::now();
    let mut sink = 0u64;
    for _ in 0..CALLS {
        sink = sink.wrapping_add(std::hint::black_box(alloc).reserved_bytes());
    }
    std::hint::black_box(sink);
    start.elapsed().as_nanos() as f64 / f64::from(CALLS)
}

fn round_up(bytes: u64, align: u64) -> Result<u64, String> {
    let align = align.max(1);
    bytes
        .checked_add(align - 1)
        .map(|b| b / align * align)
        .ok_or_else(|| format!("{bytes} bytes overflows when rounded to {align}"))
}

/// Baseline (a): one backend arena per allocation — `create_arena` (rounded up to the
/// granularity) on alloc, `destroy_arena` on free. What vLLM's `CuMemAllocator` does.
#[derive(Debug)]
pub struct PerAllocationBackend {
    backend: Arc<dyn Backend>,
    device: DeviceId,
    granularity: u64,
    arenas: HashMap<u64, ArenaMem>,
    reserved: u64,
    peak_reserved: u64,
}

impl PerAllocationBackend {
    /// A baseline allocating on `device` of `backend`.
    pub fn new(backend: Arc<dyn Backend>, device: DeviceId) -> Result<Self, String> {
        let granularity = backend.granularity(device).map_err(|e| e.to_string())?;
        Ok(Self {
            backend,
            device,
            granularity,
            arenas: HashMap::new(),
            reserved: 0,
            peak_reserved: 0,
        })
    }
}

impl TraceAllocator for PerAllocationBackend {
    fn alloc(&mut self, bytes: u64, _stream: u64) -> Result<u64, String> {
        let size = round_up(bytes.max(1), self.granularity)?;
        let arena = self
            .backend
            .create_arena(self.device, size)
            .map_err(|e| e.to_string())?;
        let ptr = arena.base;
        self.reserved += arena.bytes;
        self.peak_reserved = self.peak_reserved.max(self.reserved);
        self.arenas.insert(ptr, arena);
        Ok(ptr)
    }

    fn free(&mut self, ptr: u64, _bytes: u64, _stream: u64) -> Result<(), String> {
        let arena = self
            .arenas
            .remove(&ptr)
            .ok_or_else(|| format!("free of unknown pointer {ptr:#x}"))?;
        self.reserved -= arena.bytes;
        self.backend.destroy_arena(arena).map_err(|e| e.to_string())
    }

    fn reserved_bytes(&self) -> u64 {
        self.reserved
    }

    fn name(&self) -> String {
        "per-allocation arena".to_string()
    }

    fn peak_reserved_bytes(&self) -> Option<u64> {
        Some(self.peak_reserved)
    }

    fn notes(&self) -> Vec<(String, String)> {
        vec![("live arenas".to_string(), self.arenas.len().to_string())]
    }
}

impl Drop for PerAllocationBackend {
    fn drop(&mut self) {
        for (_, arena) in self.arenas.drain() {
            let _ = self.backend.destroy_arena(arena);
        }
    }
}

/// Baseline (b): one big arena created up front and a plain first-fit free list over it —
/// free ranges in a `BTreeMap` by offset, a linear scan for the first that fits, coalescing
/// with both neighbours on free. Sizes are rounded to 512 bytes (as the pool rounds). No
/// streams: it is the naive thing, written plainly.
#[derive(Debug)]
pub struct FirstFitArena {
    backend: Arc<dyn Backend>,
    arena: Option<ArenaMem>,
    /// Free ranges: offset -> length.
    free: BTreeMap<u64, u64>,
    /// Allocated ranges: offset -> length.
    used: HashMap<u64, u64>,
    /// Longest the free list has been.
    peak_free_ranges: usize,
}

/// Granule of [`FirstFitArena`] sizes.
const FIRST_FIT_ALIGN: u64 = 512;

impl FirstFitArena {
    /// Create one arena of at least `arena_bytes` (rounded up to the granularity) on
    /// `device`.
    pub fn new(
        backend: Arc<dyn Backend>,
        device: DeviceId,
        arena_bytes: u64,
    ) -> Result<Self, String> {
        let g = backend.granularity(device).map_err(|e| e.to_string())?;
        let size = round_up(arena_bytes.max(1), g)?;
        let arena = backend
            .create_arena(device, size)
            .map_err(|e| e.to_string())?;
        let mut free = BTreeMap::new();
        free.insert(0, arena.bytes);
        Ok(Self {
            backend,
            arena: Some(arena),
            free,
            used: HashMap::new(),
            peak_free_ranges: 1,
        })
    }

    /// Size of the arena in bytes.
    pub fn arena_bytes(&self) -> u64 {
        self.arena.as_ref().map_or(0, |a| a.bytes)
    }

    /// Number of free ranges (the list the scan walks).
    pub fn free_ranges(&self) -> usize {
        self.free.len()
    }
}

impl TraceAllocator for FirstFitArena {
    fn alloc(&mut self, bytes: u64, _stream: u64) -> Result<u64, String> {
        let base = self.arena.as_ref().map_or(0, |a| a.base);
        let need = round_up(bytes.max(1), FIRST_FIT_ALIGN)?;
        let Some((&off, &len)) = self.free.iter().find(|(_, &len)| len >= need) else {
            return Err(format!(
                "first-fit arena of {} bytes has no free range of {need} bytes ({} free ranges)",
                self.arena_bytes(),
                self.free.len()
            ));
        };
        self.free.remove(&off);
        if len > need {
            self.free.insert(off + need, len - need);
        }
        self.peak_free_ranges = self.peak_free_ranges.max(self.free.len());
        self.used.insert(off, need);
        Ok(base + off)
    }

    fn free(&mut self, ptr: u64, _bytes: u64, _stream: u64) -> Result<(), String> {
        let base = self.arena.as_ref().map_or(0, |a| a.base);
        let mut off = ptr.wrapping_sub(base);
        let mut len = self
            .used
            .remove(&off)
            .ok_or_else(|| format!("free of unknown pointer {ptr:#x}"))?;
        if let Some((&p_off, &p_len)) = self.free.range(..off).next_back() {
            if p_off + p_len == off {
                self.free.remove(&p_off);
                off = p_off;
                len += p_len;
            }
        }
        if let Some(n_len) = self.free.remove(&(off + len)) {
            len += n_len;
        }
        self.free.insert(off, len);
        self.peak_free_ranges = self.peak_free_ranges.max(self.free.len());
        Ok(())
    }

    fn reserved_bytes(&self) -> u64 {
        self.arena_bytes()
    }

    fn name(&self) -> String {
        format!(
            "first-fit, one {} arena",
            crate::units::fmt_bytes(self.arena_bytes())
        )
    }

    fn notes(&self) -> Vec<(String, String)> {
        vec![(
            "longest free list".to_string(),
            self.peak_free_ranges.to_string(),
        )]
    }
}

impl Drop for FirstFitArena {
    fn drop(&mut self) {
        if let Some(arena) = self.arena.take() {
            let _ = self.backend.destroy_arena(arena);
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
pub(crate) mod tests {
    use super::*;
    use crate::trace::{generate, TraceConfig};
    use gpu_arena::backend::{Event, Export, ImportSource, Mapping, MemInfo, StreamId};
    use gpu_arena::{Error, Result};
    use std::sync::atomic::{AtomicU64, Ordering};

    const MIB: u64 = 1 << 20;

    /// A backend with no memory behind it: addresses from a counter, 2 MiB granularity.
    #[derive(Debug, Default)]
    pub(crate) struct FakeBackend {
        next: AtomicU64,
        held: AtomicU64,
    }

    fn unsupported(call: &'static str) -> Error {
        Error::Backend {
            backend: "fake",
            call,
            message: "not supported".into(),
        }
    }

    impl Backend for FakeBackend {
        fn name(&self) -> &'static str {
            "fake"
        }
        fn device_count(&self) -> Result<usize> {
            Ok(1)
        }
        fn granularity(&self, _: DeviceId) -> Result<u64> {
            Ok(2 * MIB)
        }
        fn mem_info(&self, _: DeviceId) -> Result<MemInfo> {
            Ok(MemInfo {
                free: u64::MAX / 2,
                total: u64::MAX / 2,
            })
        }
        fn create_arena(&self, device: DeviceId, bytes: u64) -> Result<ArenaMem> {
            assert_eq!(bytes % (2 * MIB), 0);
            let base = (1 << 40) + self.next.fetch_add(bytes + 2 * MIB, Ordering::Relaxed);
            self.held.fetch_add(bytes, Ordering::Relaxed);
            Ok(ArenaMem {
                device,
                base,
                bytes,
                handle: base,
            })
        }
        fn destroy_arena(&self, arena: ArenaMem) -> Result<()> {
            self.held.fetch_sub(arena.bytes, Ordering::Relaxed);
            Ok(())
        }
        fn export(&self, _: &ArenaMem) -> Result<Export> {
            Err(unsupported("export"))
        }
        fn close_export(&self, _: &ArenaMem, _: Export) -> Result<()> {
            Err(unsupported("close_export"))
        }
        fn import(&self, _: DeviceId, _: ImportSource<'_>, _: u64) -> Result<Mapping> {
            Err(unsupported("import"))
        }
        fn unmap_import(&self, _: Mapping) -> Result<()> {
            Err(unsupported("unmap_import"))
        }
        fn record_event(&self, device: DeviceId, _: StreamId) -> Result<Event> {
            Ok(Event { device, raw: 0 })
        }
        fn event_done(&self, _: &Event) -> Result<bool> {
            Ok(true)
        }
        fn destroy_event(&self, _: Event) -> Result<()> {
            Ok(())
        }
        fn synchronize(&self, _: DeviceId) -> Result<()> {
            Ok(())
        }
    }

    fn small_trace() -> Trace {
        generate(&TraceConfig {
            requests: 100,
            max_running: 16,
            ..TraceConfig::default()
        })
    }

    #[test]
    fn per_allocation_replays_and_gives_everything_back() {
        let fake = Arc::new(FakeBackend::default());
        let t = small_trace();
        {
            let mut a = PerAllocationBackend::new(fake.clone(), 0).unwrap();
            let r = replay(&t, &mut a).unwrap();
            assert_eq!(r.ops, t.len());
            assert_eq!(r.peak_live, t.peak_live_bytes);
            assert!(r.peak_reserved >= r.peak_live);
            assert!(r.ratio_reserved_to_live >= 1.0);
            assert_eq!(a.reserved_bytes(), 0);
        }
        assert_eq!(fake.held.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn first_fit_replays_and_reuses() {
        let fake = Arc::new(FakeBackend::default());
        let t = small_trace();
        let mut a = FirstFitArena::new(fake.clone(), 0, t.peak_live_bytes * 2).unwrap();
        let r = replay(&t, &mut a).unwrap();
        assert_eq!(r.peak_reserved, a.arena_bytes());
        assert_eq!(a.free_ranges(), 1, "everything coalesced back");
        drop(a);
        assert_eq!(fake.held.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn first_fit_is_first_fit_and_coalesces() {
        let fake = Arc::new(FakeBackend::default());
        let mut a = FirstFitArena::new(fake, 0, 8 * MIB).unwrap();
        let p0 = a.alloc(MIB, 1).unwrap();
        let p1 = a.alloc(100, 1).unwrap();
        let p2 = a.alloc(MIB, 1).unwrap();
        assert_eq!(p1, p0 + MIB);
        assert_eq!(p2, p1 + 512);
        a.free(p0, MIB, 1).unwrap();
        // First fit: the hole at 0 comes first even though the tail is larger.
        assert_eq!(a.alloc(4096, 1).unwrap(), p0);
        a.free(p0, 4096, 1).unwrap();
        a.free(p2, MIB, 1).unwrap();
        assert_eq!(a.free_ranges(), 2);
        a.free(p1, 100, 1).unwrap();
        assert_eq!(a.free_ranges(), 1);
        assert!(a.free(p1, 100, 1).is_err(), "double free");
        assert!(a.alloc(9 * MIB, 1).is_err());
    }

    #[test]
    fn a_failing_replay_names_the_op_and_cleans_up() {
        let fake = Arc::new(FakeBackend::default());
        let t = small_trace();
        let mut a = FirstFitArena::new(fake, 0, 64 * MIB).unwrap();
        let e = replay(&t, &mut a).unwrap_err();
        assert!(e.contains("op "), "{e}");
        assert_eq!(
            a.free_ranges(),
            1,
            "live allocations freed after the failure"
        );
    }
}
