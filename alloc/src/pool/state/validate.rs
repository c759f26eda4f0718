//! `validate()`: the pool's records agree with the sub-allocators and with each other (every
//! block the pool holds allocated whole, exactly once: live in the device's map or a thread
//! cache's records, or cached; the counters; each arena's live allocations and
//! references). Run after every operation when `PoolConfig::validate` is on.

use std::collections::HashMap;

use crate::pool::front::cache_key::cache_key_parts;
use crate::pool::sizes::blocks::block_len;
use crate::pool::state::device::DeviceState;

impl DeviceState {
    pub(crate) fn validate_or_log(&self) {
        if let Err(e) = self.validate() {
            tracing::error!("pool invariant broken: {e}");
            debug_assert!(false, "pool invariant broken: {e}");
        }
    }

    /// The pool's records agree with the sub-allocator and with each other.
    pub(crate) fn validate(&self) -> Result<(), String> {
        let mut rs = crate::range::RangeStats::default();
        for r in &self.ranges {
            r.validate()?;
            let s = r.stats();
            rs.regions += s.regions;
            rs.region_bytes += s.region_bytes;
            rs.used_bytes += s.used_bytes;
        }
        if rs.regions != self.arenas.len() as u64 {
            return Err(format!(
                "{} regions for {} arenas",
                rs.regions,
                self.arenas.len()
            ));
        }
        let all: u64 = self.arenas.iter().map(|(_, a)| a.mem.bytes).sum();
        let asleep: u64 = self
            .arenas
            .iter()
            .filter(|(_, a)| a.sleep.is_some())
            .map(|(_, a)| a.mem.bytes)
            .sum();
        let reserved = all - asleep;
        if reserved != self.stats.reserved_bytes
            || asleep != self.stats.sleeping_bytes
            || rs.region_bytes != all
        {
            return Err(format!(
                "reserved {} and sleeping {} in stats, {reserved} and {asleep} in arenas, {} in regions",
                self.stats.reserved_bytes, self.stats.sleeping_bytes, rs.region_bytes
            ));
        }
        self.check_host_bytes()?;
        // Every block the pool holds allocated in the ranges, each exactly once: live in
        // the device's map or a thread cache's records, or cached by the device or a
        // thread. (With every thread cache locked: no fast path runs meanwhile.)
        let registry = self.front.lock_caches();
        let thread_caches = registry.lock();
        let mut seen: HashMap<u64, &str> = HashMap::new();
        let mut whole = |ptr: u64, len: u64, what: &'static str| -> Result<(), String> {
            if let Some(other) = seen.insert(ptr, what) {
                return Err(format!("block {ptr:#x} is both {other} and {what}"));
            }
            if self.ranges_of(ptr).and_then(|r| r.allocated_len(ptr)) != Some(len) {
                return Err(format!(
                    "{what} block {ptr:#x} is not allocated whole in the ranges"
                ));
            }
            Ok(())
        };
        let (mut used, mut requested) = (0, 0);
        for (&ptr, l) in &self.allocs {
            whole(ptr, l.bytes(), "live")?;
            (used, requested) = (used + l.bytes(), requested + l.requested);
        }
        for (ptr, l) in thread_caches.iter().flat_map(|c| c.records.live()) {
            let len = block_len(l.requested).unwrap_or(0);
            whole(ptr, len, "live in the front")?;
            (used, requested) = (used + len, requested + l.requested);
        }
        // The bytes of the cached blocks (the device's or a thread's), each checked whole.
        let mut cached_in = |blocks: &mut dyn Iterator<Item = (u64, u64)>,
                             what: &'static str|
         -> Result<u64, String> {
            let mut bytes = 0;
            for (ptr, len) in blocks {
                whole(ptr, len, what)?;
                bytes += len;
            }
            Ok(bytes)
        };
        let mut device_blocks = self.cache.iter().flat_map(|(&(_, key), blocks)| {
            let len = cache_key_parts(key).0;
            blocks.iter().map(move |&(ptr, _)| (ptr, len))
        });
        let mut cached = cached_in(&mut device_blocks, "cached")?;
        if cached != self.cached_bytes {
            return Err(format!(
                "cache holds {cached} bytes, counter says {}",
                self.cached_bytes
            ));
        }
        for c in &thread_caches {
            let in_thread = cached_in(&mut c.records.free_blocks(), "cached by a thread")?;
            if in_thread != c.records.free_bytes() {
                return Err(format!(
                    "a thread cache holds {in_thread} bytes, its counter says {}",
                    c.records.free_bytes()
                ));
            }
            cached += in_thread;
        }
        let [allocated_bytes, requested_bytes, ..] = self.front.byte_counts(&thread_caches);
        if requested != requested_bytes {
            return Err(format!(
                "requested {requested_bytes} in stats, {requested} in records"
            ));
        }
        if used + cached != rs.used_bytes || used != allocated_bytes {
            return Err(format!(
                "allocated {allocated_bytes} in stats, {used} in records, {cached} cached, {} in ranges",
                rs.used_bytes
            ));
        }
        // Per arena: live allocations, and the references they hold.
        let mut per_arena: HashMap<usize, (u64, u64)> = HashMap::new();
        for l in self.allocs.values() {
            let n = per_arena.entry(l.arena).or_default();
            n.0 += 1;
            n.1 += u64::from(l.hold.refs());
        }
        for (k, a) in &self.arenas {
            let (live, refs) = per_arena.get(&k).copied().unwrap_or((0, 0));
            if live != a.live_allocs {
                return Err(format!(
                    "arena {} live count {} is wrong",
                    a.id, a.live_allocs
                ));
            }
            if refs != a.lifetime.refs() {
                return Err(format!(
                    "arena {} holds {} references, its allocations {refs}",
                    a.id,
                    a.lifetime.refs()
                ));
            }
        }
        Ok(())
    }
}
