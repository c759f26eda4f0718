//! The model of one device: its blocks, what fences their memory, its graph pools and
//! asleep tags; each operation on the device against the pool, and the checks after it.

use std::collections::BTreeMap;
use std::sync::Arc;

use gpu_arena::backend::sim::{SimBackend, SimCall};
use gpu_arena::pool::{block_len, GraphPoolId, MaxReserved, PoolBlock};
use gpu_arena::{tags, Pool, ShareInfo, StreamId};

use super::observer::Registrar;
use super::ops::{canary, canary_ok, overlaps, Op, MIB, SIZES, STREAMS, TWO_MIB};

#[derive(Debug, Clone)]
pub(crate) struct Block {
    pub(crate) ptr: u64,
    /// Bytes asked for, and the block's length.
    pub(crate) bytes: u64,
    pub(crate) len: u64,
    pub(crate) stream: u64,
    pub(crate) tag: u8,
    pub(crate) seed: u8,
    /// Streams it was `record_stream`ed on.
    pub(crate) recorded: Vec<u64>,
    pub(crate) graph: Option<u64>,
    /// Shares of it (by key) and their open leases.
    pub(crate) shares: Vec<(ShareInfo, Vec<u32>)>,
    /// Freed by its owner while shared: the range waits for its shares.
    pub(crate) freed: bool,
}

/// Memory a new block of another stream must not take: freed while `guards` (streams with
/// unfinished work) were blocked.
#[derive(Debug)]
pub(crate) struct Fence {
    pub(crate) ptr: u64,
    pub(crate) len: u64,
    pub(crate) guards: Vec<u64>,
}

/// A graph pool in use.
#[derive(Debug, Default)]
pub(crate) struct GraphUse {
    pub(crate) uses: u32,
    /// Open routing contexts (captures).
    pub(crate) open: u32,
    /// The ranges it held: no other allocation may take them while it is in use.
    pub(crate) ranges: Vec<(u64, u64)>,
}

/// What the model knows of one device of the pool (the test runs two).
pub(crate) struct Model {
    pub(crate) dev: i32,
    pub(crate) sim: Arc<SimBackend>,
    pub(crate) pool: Arc<Pool>,
    pub(crate) tags: [u8; 3],
    pub(crate) blocks: Vec<Block>,
    pub(crate) fences: Vec<Fence>,
    pub(crate) blocked: [bool; STREAMS as usize + 1],
    /// Asleep tags (bit = tag index) and which of them were offloaded.
    pub(crate) asleep: u64,
    pub(crate) offloaded: u64,
    pub(crate) graphs: BTreeMap<u64, GraphUse>,
    /// The last checkpoint of each graph pool (`pool_model/graphs.rs`).
    pub(crate) checkpoints: BTreeMap<u64, Vec<PoolBlock>>,
    /// Faults scheduled for the next operation: the call and which of its calls fails.
    pub(crate) faults: Vec<(SimCall, u64)>,
    /// The sim's synchronize calls when the operation began.
    pub(crate) syncs_before: u64,
    pub(crate) next_seed: u8,
    /// An arena observer, when the case runs with one (growing arenas then grow by new
    /// arenas, each told to it before use).
    pub(crate) observer: Option<Arc<Registrar>>,
    /// `max_reserved` in bytes, if set.
    pub(crate) cap: Option<u64>,
    /// The device's reserved bytes when the operation began: an operation may leave them
    /// above a cap lowered at run time, never raise them past it.
    pub(crate) reserved_before: u64,
}

impl Model {
    pub(crate) fn new(
        sim: Arc<SimBackend>,
        pool: Arc<Pool>,
        dev: i32,
        tags: [u8; 3],
        observer: Option<Arc<Registrar>>,
        cap: Option<u64>,
    ) -> Model {
        Model {
            dev,
            sim,
            pool,
            tags,
            blocks: Vec::new(),
            fences: Vec::new(),
            blocked: [false; STREAMS as usize + 1],
            asleep: 0,
            offloaded: 0,
            graphs: BTreeMap::new(),
            checkpoints: BTreeMap::new(),
            faults: Vec::new(),
            syncs_before: 0,
            observer,
            cap,
            reserved_before: 0,
            next_seed: 1 + 100 * dev as u8,
        }
    }

    pub(crate) fn tag_mask(&self, sel: u8) -> Vec<u8> {
        (0..3)
            .filter(|i| sel & (1 << i) != 0)
            .map(|i| self.tags[i])
            .collect()
    }

    /// A synchronize that succeeded since the operation began finished every stream's work
    /// queued before it: the fences go (a pool synchronizes before it reuses memory that way,
    /// e.g. out of memory: cached arenas released, then a new one made).
    pub(crate) fn settle_fences(&mut self) {
        let mut synced = self.sim.calls(SimCall::Synchronize) - self.syncs_before;
        // A call made to fail counts as a call too.
        let mut failing: Vec<u64> = self
            .faults
            .iter()
            .filter(|(c, _)| *c == SimCall::Synchronize)
            .map(|&(_, n)| n)
            .collect();
        failing.sort_unstable();
        failing.dedup();
        synced -= failing.iter().filter(|&&n| synced >= n).count() as u64;
        if synced > 0 {
            self.fences.clear();
        }
    }

    /// Whether a call may refuse with `e`: the device is out of memory, or a fault was
    /// injected into this operation's backend calls. Never an internal error.
    pub(crate) fn may_refuse(&self, e: &gpu_arena::Error) -> bool {
        may_refuse(e, !self.faults.is_empty())
    }

    /// Whether a graph pool routing context (a capture) is open.
    pub(crate) fn routing(&self) -> bool {
        self.graphs.values().any(|g| g.open > 0)
    }

    pub(crate) fn awake(&self, tag: u8) -> bool {
        self.asleep & (1u64 << tag) == 0
    }

    pub(crate) fn seed(&mut self) -> u8 {
        self.next_seed = self.next_seed.wrapping_add(37) | 1;
        self.next_seed
    }

    /// A new block at `ptr` for `stream` (in graph pool `graph`): checked against every
    /// rule before it joins the model.
    pub(crate) fn place(
        &mut self,
        ptr: u64,
        bytes: u64,
        stream: u64,
        tag: u8,
        graph: Option<u64>,
    ) -> Result<(), String> {
        let len = block_len(bytes).unwrap();
        let r = (ptr, len);
        self.settle_fences();
        if let Some(b) = self.blocks.iter().find(|b| overlaps(r, (b.ptr, b.len))) {
            return Err(format!("new block {r:x?} overlaps {b:x?}"));
        }
        for f in &self.fences {
            if overlaps(r, (f.ptr, f.len)) && f.guards.iter().any(|&g| g != stream) {
                return Err(format!(
                    "new block {r:x?} on stream {stream} takes memory freed while streams {:?} had unfinished work: {f:x?}",
                    f.guards
                ));
            }
        }
        for (&id, g) in &self.graphs {
            let (uses, open, ranges) = (g.uses, g.open, &g.ranges);
            if (uses > 0 || open > 0) && graph != Some(id) && ranges.iter().any(|&g| overlaps(r, g))
            {
                return Err(format!("new block {r:x?} (pool {graph:?}) lands on graph pool {id}'s memory while in use"));
            }
        }
        if let Some(id) = graph {
            if let Some(g) = self.graphs.get_mut(&id) {
                g.ranges.push(r);
            }
        }
        let seed = self.seed();
        canary(ptr, len, seed);
        self.blocks.push(Block {
            ptr,
            bytes,
            len,
            stream,
            tag,
            seed,
            recorded: Vec::new(),
            graph,
            shares: Vec::new(),
            freed: false,
        });
        Ok(())
    }

    /// The range of block `i` goes back to the pool: fenced while a stream that used it is
    /// blocked (graph pools' blocks are guarded by the pool's use count instead).
    pub(crate) fn release(&mut self, i: usize) {
        let b = self.blocks.remove(i);
        if b.graph.is_some() {
            return;
        }
        let guards: Vec<u64> = std::iter::once(b.stream)
            .chain(b.recorded.iter().copied())
            .filter(|&s| self.blocked[s as usize])
            .collect();
        if !guards.is_empty() {
            self.fences.push(Fence {
                ptr: b.ptr,
                len: b.len,
                guards,
            });
        }
    }

    pub(crate) fn live(&self, i: usize) -> Option<usize> {
        let live: Vec<usize> = (0..self.blocks.len())
            .filter(|&j| !self.blocks[j].freed)
            .collect();
        if live.is_empty() {
            None
        } else {
            Some(live[i % live.len()])
        }
    }

    pub(crate) fn shared(&self, i: usize) -> Option<(usize, usize)> {
        let all: Vec<(usize, usize)> = self
            .blocks
            .iter()
            .enumerate()
            .flat_map(|(b, blk)| (0..blk.shares.len()).map(move |s| (b, s)))
            .collect();
        (!all.is_empty()).then(|| all[i % all.len()])
    }

    /// Free live block `i` through `Pool::free`, as a user would.
    fn free_block(&mut self, i: usize) -> Result<(), String> {
        let ptr = self.blocks[i].ptr;
        if self.pool.free(ptr).is_ok() {
            if self.blocks[i].shares.is_empty() {
                self.release(i);
            } else {
                self.blocks[i].freed = true;
            }
        } else if self.faults.is_empty() {
            return Err(format!("free of live block {ptr:#x} refused"));
        }
        Ok(())
    }

    pub(crate) fn apply_call(&mut self, op: &Op) -> Result<(), String> {
        let pool = &self.pool;
        match *op {
            Op::Alloc { size, stream, tag } => {
                let tag = self.tags[tag];
                tags::set_current_index(tag);
                let got = pool.alloc(self.dev, SIZES[size], StreamId(stream));
                tags::set_current_index(0);
                match got {
                    Ok(a) => {
                        if !self.awake(tag) {
                            return Err(format!("allocation of asleep tag {tag} granted"));
                        }
                        self.place(a.ptr, SIZES[size], stream, tag, None)?;
                    }
                    Err(e) => {
                        if self.awake(tag) && !self.may_refuse(&e) {
                            return Err(format!("allocation refused: {e}"));
                        }
                    }
                }
            }
            Op::Free(i) => {
                let Some(i) = self.live(i) else { return Ok(()) };
                self.free_block(i)?;
            }
            Op::Burst { n, stream } => {
                let first = self.blocks.len();
                for _ in 0..n {
                    self.apply_call(&Op::Alloc {
                        size: TWO_MIB,
                        stream,
                        tag: 0,
                    })?;
                }
                let placed: Vec<u64> = self.blocks[first..].iter().map(|b| b.ptr).collect();
                for ptr in placed {
                    if let Some(i) = self.blocks.iter().position(|b| b.ptr == ptr && !b.freed) {
                        self.free_block(i)?;
                    }
                }
            }
            Op::RetireThread(_) => unreachable!("a step of the world, not of one device"),
            Op::SetCap(mib) => {
                let cap = mib.map(|m| m * MIB);
                pool.set_max_reserved(self.dev, cap.map(MaxReserved::Bytes))
                    .map_err(|e| format!("set_max_reserved({cap:?}) refused: {e}"))?;
                self.cap = cap;
            }
            Op::History(on) => pool.record_history(on, 0),
            Op::Snapshot => self.check_views()?,
            Op::Lookup { i, at } => self.check_lookup(i, at)?,
            Op::ResetCounts => {
                pool.reset_accumulated_stats(self.dev)
                    .map_err(|e| format!("reset_accumulated_stats: {e}"))?;
                self.check_reset_counts()?;
            }
            Op::GraphBegin(_)
            | Op::GraphAlloc { .. }
            | Op::GraphEnd(_)
            | Op::GraphRelease(_)
            | Op::GraphRetain(_)
            | Op::GraphEmptyCache(_)
            | Op::Checkpoint(_)
            | Op::Restore(_) => self.graph_op(op)?,
            Op::ResetPeaks => {
                pool.reset_peak_stats(self.dev)
                    .map_err(|e| format!("reset_peak_stats: {e}"))?;
                self.check_reset_peaks()?;
            }
            Op::Bad { kind, i } => self.bad_call(kind, i)?,
            Op::RecordStream(i, s) => {
                let Some(i) = self.live(i) else { return Ok(()) };
                if pool.record_stream(self.blocks[i].ptr, StreamId(s)).is_ok() {
                    self.blocks[i].recorded.push(s);
                }
            }
            Op::Block(s) => {
                self.sim.block_stream(self.dev, StreamId(s));
                self.blocked[s as usize] = true;
            }
            Op::Unblock(s) => {
                self.sim.unblock_stream(self.dev, StreamId(s));
                self.blocked[s as usize] = false;
                for f in &mut self.fences {
                    f.guards.retain(|&g| g != s);
                }
                self.fences.retain(|f| !f.guards.is_empty());
            }
            Op::Share(i) => {
                let Some(i) = self.live(i) else { return Ok(()) };
                let b = &self.blocks[i];
                match pool.share(b.ptr, b.bytes) {
                    Ok(info) => {
                        if !self.awake(b.tag) {
                            return Err(format!("share of asleep tag {} granted", b.tag));
                        }
                        self.blocks[i].shares.push((info, Vec::new()));
                    }
                    Err(e) => {
                        if self.awake(b.tag) && !self.may_refuse(&e) {
                            return Err(format!("share refused: {e}"));
                        }
                    }
                }
            }
            Op::Unshare(i) => {
                let Some((b, s)) = self.shared(i) else {
                    return Ok(());
                };
                let (info, leases) = self.blocks[b].shares[s].clone();
                for l in leases {
                    pool.close_lease(self.dev, l)
                        .map_err(|e| format!("close_lease: {e}"))?;
                }
                match pool.unshare(self.dev, info.share_key, &info.token) {
                    Ok(()) => {
                        self.blocks[b].shares.remove(s);
                    }
                    Err(e) => {
                        self.blocks[b].shares[s].1.clear();
                        if self.faults.is_empty() {
                            return Err(format!("unshare: {e}"));
                        }
                    }
                }
                if self.blocks[b].freed && self.blocks[b].shares.is_empty() {
                    self.release(b);
                }
            }
            Op::Lease(i) => {
                let Some((b, s)) = self.shared(i) else {
                    return Ok(());
                };
                let info = &self.blocks[b].shares[s].0;
                if let Ok(grant) = pool.open_lease(self.dev, info.share_key, &info.token) {
                    self.blocks[b].shares[s].1.push(grant.lease_key);
                }
            }
            Op::CloseLease(i) => {
                let Some((b, s)) = self.shared(i) else {
                    return Ok(());
                };
                if let Some(l) = self.blocks[b].shares[s].1.pop() {
                    pool.close_lease(self.dev, l)
                        .map_err(|e| format!("close_lease: {e}"))?;
                }
            }
            Op::EmptyCache => {
                let _ = pool.empty_cache(Some(self.dev));
            }
            Op::Trim => {
                let _ = pool.trim(Some(self.dev));
            }
            Op::PrepareOffload(sel) => {
                let tags = self.tag_mask(sel);
                if let Err(e) = pool.prepare_offload(Some(self.dev), &tags) {
                    if !self.may_refuse(&e) {
                        return Err(format!("prepare_offload refused: {e}"));
                    }
                }
            }
            Op::ReleaseHostBuffers => {
                pool.release_host_buffers(Some(self.dev))
                    .map_err(|e| format!("release_host_buffers: {e}"))?;
            }
            Op::Sleep { tags: sel, offload } => {
                let names = self.tag_mask(sel);
                let keep = self.tag_mask(offload);
                let before = self.asleep;
                let got = pool.sleep_tags(Some(self.dev), Some(&names), &keep);
                let now = pool.asleep_tags(self.dev).map_err(|e| e.to_string())?;
                if self.routing() {
                    // It would synchronize inside a capture: refused, nothing done.
                    if got.is_ok() || now != before {
                        return Err("sleep while a graph pool context is open not refused".into());
                    }
                    return Ok(());
                }
                let want: u64 = names.iter().map(|&t| 1u64 << t).sum();
                let keep_mask: u64 = keep.iter().map(|&t| 1u64 << t).sum();
                match got {
                    Ok(_) => {
                        if before & want != 0 {
                            return Err(format!(
                                "sleep of asleep tags {:#b} granted",
                                before & want
                            ));
                        }
                        if now != before | want {
                            return Err(format!(
                                "asleep {now:#b} after sleeping {want:#b} from {before:#b}"
                            ));
                        }
                    }
                    Err(e) => {
                        if before & want == 0 && !self.may_refuse(&e) {
                            return Err(format!("sleep refused: {e}"));
                        }
                        // Documented: a sleep that fails midway leaves its tags marked asleep
                        // (their arenas whole); anything else must be as before.
                        if now != before && now != before | want {
                            return Err(format!(
                                "failed sleep left asleep {now:#b} (before {before:#b})"
                            ));
                        }
                    }
                }
                self.offloaded |= (now & !before) & keep_mask;
                self.offloaded &= now;
                // Tags asleep without offload lose their contents (kept arenas aside).
                self.asleep = now;
            }
            Op::Wake { tags: sel } => {
                let names = self.tag_mask(sel);
                let before = self.asleep;
                let got = if names.is_empty() {
                    pool.wake(Some(self.dev), None)
                } else {
                    pool.wake(Some(self.dev), Some(&names))
                };
                let now = pool.asleep_tags(self.dev).map_err(|e| e.to_string())?;
                if self.routing() && now != before {
                    return Err("a wake ran while a graph pool context is open".into());
                }
                match got {
                    Ok(_) => {}
                    Err(e) => {
                        if now != before {
                            return Err(format!(
                                "failed wake changed asleep tags {before:#b} -> {now:#b}: {e}"
                            ));
                        }
                    }
                }
                self.woken(before, now);
            }
            Op::Fault { .. } => unreachable!(),
        }
        Ok(())
    }

    /// A call with bad input, which must be refused (and, by the checks after it, change
    /// nothing): a free of a block's interior, of memory freed before (not live again), of a
    /// block with the wrong size; `record_stream` of no allocation; a share past the block's
    /// end; an unshare with a wrong token.
    pub(crate) fn bad_call(&mut self, kind: u8, i: usize) -> Result<(), String> {
        let pool = &self.pool;
        let Some(i) = self.live(i) else { return Ok(()) };
        let b = self.blocks[i].clone();
        let live_at = |p: u64| self.blocks.iter().any(|x| x.ptr <= p && p < x.ptr + x.len);
        let (what, got) = match kind {
            0 if b.len > 512 => ("free of a block's interior", pool.free(b.ptr + 512)),
            1 => {
                // An address far below every sim mapping (the other device's blocks are not
                // this model's to know).
                let p = 0x1000_0000 + (i as u64 % 4096) * 512;
                if live_at(p) {
                    return Ok(());
                }
                ("free of no allocation", pool.free(p))
            }
            2 => (
                "free with the wrong size",
                pool.free_checked(b.ptr, b.bytes + 4096, self.dev),
            ),
            3 => (
                "record_stream of no allocation",
                pool.record_stream(0x1000, StreamId(1)),
            ),
            4 => (
                "share past the block's end",
                pool.share(b.ptr, b.len + 1).map(|_| ()),
            ),
            5 => match b.shares.first() {
                Some((info, _)) => {
                    let mut token = info.token;
                    token[0] ^= 1;
                    (
                        "unshare with a wrong token",
                        pool.unshare(self.dev, info.share_key, &token),
                    )
                }
                None => return Ok(()),
            },
            _ => return Ok(()),
        };
        match got {
            Ok(()) => Err(format!("{what} on {b:x?} granted")),
            Err(gpu_arena::Error::Internal(e)) => Err(format!("{what}: internal error {e}")),
            Err(_) => Ok(()),
        }
    }

    /// What must hold after every operation.
    pub(crate) fn check(&self, op: &Op) -> Result<(), String> {
        self.pool
            .validate(self.dev)
            .map_err(|e| format!("validate after {op:?}: {e}"))?;
        let mut sorted: Vec<&Block> = self.blocks.iter().collect();
        sorted.sort_by_key(|b| b.ptr);
        for w in sorted.windows(2) {
            if w[0].ptr + w[0].len > w[1].ptr {
                return Err(format!("blocks overlap: {:x?} and {:x?}", w[0], w[1]));
            }
        }
        for b in &self.blocks {
            if self.awake(b.tag) && !canary_ok(b.ptr, b.len, b.seed) {
                return Err(format!("bytes of {b:x?} changed (after {op:?})"));
            }
        }
        if let Some(obs) = &self.observer {
            if let Some(e) = obs.broken() {
                return Err(format!("observer: {e} (after {op:?})"));
            }
            // Every awake block's memory was told to the observer before use, and stays
            // registered while it is there.
            if let Some(b) = self
                .blocks
                .iter()
                .find(|b| self.awake(b.tag) && !obs.covers(b.ptr, b.len))
            {
                return Err(format!(
                    "{b:x?} is in no arena told to the observer (after {op:?})"
                ));
            }
        }
        // Freed blocks still shared count as allocated (`deferred_free_bytes`), and so do
        // blocks freed with `record_stream` streams until their events are seen
        // (`pending_free_bytes`).
        let held: u64 = self.blocks.iter().map(|b| b.len).sum();
        let deferred: u64 = self.blocks.iter().filter(|b| b.freed).map(|b| b.len).sum();
        let stats = self.pool.stats(self.dev).map_err(|e| e.to_string())?;
        if stats.peak_reserved_bytes < stats.reserved_bytes
            || stats.peak_allocated_bytes < stats.allocated_bytes
        {
            return Err(format!(
                "peaks below the current values after {op:?}: {stats:?}"
            ));
        }
        if let Some(cap) = self.cap {
            if stats.reserved_bytes > cap.max(self.reserved_before) {
                return Err(format!(
                    "reserved {} past max_reserved {cap} (and {} before) after {op:?}",
                    stats.reserved_bytes, self.reserved_before
                ));
            }
        }
        // What the pool says it holds is what the device holds, awake and asleep.
        let ledger = self.sim.ledger(self.dev);
        if (stats.reserved_bytes, stats.sleeping_bytes)
            != (ledger.held_bytes, ledger.sleeping_bytes)
        {
            return Err(format!(
                "reserved {} / sleeping {} against the device's held {} / sleeping {} after {op:?}",
                stats.reserved_bytes,
                stats.sleeping_bytes,
                ledger.held_bytes,
                ledger.sleeping_bytes
            ));
        }
        if stats.allocated_bytes - stats.pending_free_bytes != held
            || stats.deferred_free_bytes != deferred
        {
            return Err(format!(
                "allocated {} (pending {}, deferred {}) against the model's {held} (deferred {deferred}) after {op:?}",
                stats.allocated_bytes, stats.pending_free_bytes, stats.deferred_free_bytes
            ));
        }
        Ok(())
    }

    /// A wake took this device's asleep tags from `before` to `now`: the blocks of tags woken
    /// without an offload hold whatever the new memory holds (written again here).
    pub(crate) fn woken(&mut self, before: u64, now: u64) {
        let woke = before & !now;
        for b in &mut self.blocks {
            let bit = 1u64 << b.tag;
            if woke & bit != 0 && self.offloaded & bit == 0 {
                canary(b.ptr, b.len, b.seed);
            }
        }
        self.offloaded &= now;
        self.asleep = now;
    }

    /// Close every graph pool context and use, close every lease, unshare and free every
    /// block of this device (frees work while a tag sleeps).
    pub(crate) fn free_all(&mut self) -> Result<(), String> {
        for (&id, &GraphUse { uses, open, .. }) in &self.graphs {
            for _ in 0..open {
                self.pool
                    .graph_pool_end(self.dev, GraphPoolId(id, 0))
                    .map_err(|e| e.to_string())?;
            }
            for _ in 0..uses {
                self.pool
                    .graph_pool_release(self.dev, GraphPoolId(id, 0))
                    .map_err(|e| e.to_string())?;
            }
        }
        for b in std::mem::take(&mut self.blocks) {
            for (info, leases) in &b.shares {
                for &l in leases {
                    self.pool
                        .close_lease(self.dev, l)
                        .map_err(|e| format!("final close_lease: {e}"))?;
                }
                self.pool
                    .unshare(self.dev, info.share_key, &info.token)
                    .map_err(|e| format!("final unshare: {e}"))?;
            }
            if !b.freed {
                self.pool
                    .free(b.ptr)
                    .map_err(|e| format!("final free of {b:x?}: {e}"))?;
            }
        }
        Ok(())
    }
}

/// Whether a call may refuse with `e`: out of memory, or anything but an internal error
/// when a fault was injected into the step's backend calls (`faulted`).
pub(crate) fn may_refuse(e: &gpu_arena::Error, faulted: bool) -> bool {
    use gpu_arena::Error;
    match e {
        Error::Internal(_) => false,
        Error::OutOfMemory { .. } | Error::DriverOutOfMemory { .. } => true,
        _ => faulted,
    }
}
