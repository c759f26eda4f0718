//! The pool's JSON snapshot (`Pool::snapshot_json`): every device's stats, arenas (tag, size
//! class, sleep state, lifetime) and the ranges in each arena, the arenas whose destroy
//! failed (orphans, still held), plus the history ring when it records (`pool/inspect/trace.rs`).

use super::trace;
use crate::pool::state::graph_pool_ids::GraphPoolId;
use crate::pool::state::pool::Pool;

impl Pool {
    /// A JSON snapshot of every device: stats, arenas, and the ranges in each arena.
    pub fn snapshot_json(&self) -> String {
        let devices: Vec<serde_json::Value> = self
            .devices
            .iter()
            .map(|dp| {
                let mut st = dp.state.lock();
                // The plain allocations' records move into the device's map, to be listed.
                st.promote_all();
                let arenas: Vec<serde_json::Value> = st
                    .arenas
                    .iter()
                    .map(|(_, a)| {
                        serde_json::json!({
                            "id": a.id,
                            "base": a.mem.base,
                            "bytes": a.mem.bytes,
                            "live_allocations": a.live_allocs,
                            "lifetime": {
                                "state": a.lifetime.state_name(),
                                "refs": a.lifetime.refs(),
                                "pinned": a.lifetime.pinned(),
                                "generation": a.lifetime.generation(),
                            },
                            "tag": crate::tags::name(a.tag),
                            "asleep": a.sleep.is_some(),
                            "small": a.small,
                            "graph_pool": st.graph_pools.id_of(a.graph_pool).map(|id| [id.0, id.1]),
                            "ranges": st.ranges.get(a.class().index()).map(|r| r.ranges(a.mem.base)).unwrap_or_default(),
                        })
                    })
                    .collect();
                let orphans: Vec<serde_json::Value> = st
                    .orphans
                    .iter()
                    .map(|m| serde_json::json!({ "base": m.base, "bytes": m.bytes }))
                    .collect();
                let mut d = serde_json::json!({
                    "device": dp.device,
                    "stats": st.stats_now(),
                    "arenas": arenas,
                    "orphans": orphans,
                });
                trace::add_to_snapshot(&st, &mut d);
                d
            })
            .collect();
        serde_json::json!({ "backend": self.backend.name(), "devices": devices }).to_string()
    }
}

/// One arena as PyTorch's snapshot shows a segment (`Pool::segments`), or an arena whose
/// destroy failed (held by the device, one free range).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentInfo {
    /// Device address of its first byte.
    pub base: u64,
    /// Bytes.
    pub bytes: u64,
    /// Whether it holds small blocks (PyTorch's small pool).
    pub small: bool,
    /// The graph pool whose blocks it holds (`None`: the general pool).
    pub graph_pool: Option<GraphPoolId>,
    /// Its ranges in address order: allocated ones first met with their request (0 when
    /// not known: a freed-but-shared range), free ones with `requested` 0.
    pub blocks: Vec<BlockInfo>,
}

/// A range of a [`SegmentInfo`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockInfo {
    /// Device address of its first byte.
    pub ptr: u64,
    /// Bytes.
    pub bytes: u64,
    /// Bytes asked for (0 for a free range).
    pub requested: u64,
    /// Allocated (live, or freed and waiting for its shares or streams).
    pub allocated: bool,
}

impl Pool {
    /// Every arena of `device` with its ranges, in address order (what PyTorch's
    /// `torch.cuda.memory._snapshot()` lists as segments and blocks).
    pub fn segments(
        &self,
        device: crate::backend::DeviceId,
    ) -> crate::error::Result<Vec<SegmentInfo>> {
        let mut st = self.dev(device)?.state.lock();
        st.promote_all();
        let mut out: Vec<SegmentInfo> = st
            .arenas
            .iter()
            .map(|(_, a)| {
                let ranges = st
                    .ranges
                    .get(a.class().index())
                    .map(|r| r.ranges(a.mem.base))
                    .unwrap_or_default();
                SegmentInfo {
                    base: a.mem.base,
                    bytes: a.mem.bytes,
                    small: a.small,
                    graph_pool: st.graph_pools.id_of(a.graph_pool),
                    blocks: ranges
                        .iter()
                        .map(|r| BlockInfo {
                            ptr: r.offset,
                            bytes: r.len,
                            requested: if r.free_tag.is_none() {
                                st.allocs.get(&r.offset).map_or(0, |l| l.requested)
                            } else {
                                0
                            },
                            allocated: r.free_tag.is_none(),
                        })
                        .collect(),
                }
            })
            .collect();
        // Arenas whose destroy failed: the device holds them (they count in
        // `reserved_bytes`), with nothing in them.
        out.extend(st.orphans.iter().map(|m| SegmentInfo {
            base: m.base,
            bytes: m.bytes,
            small: false,
            graph_pool: None,
            blocks: vec![BlockInfo {
                ptr: m.base,
                bytes: m.bytes,
                requested: 0,
                allocated: false,
            }],
        }));
        out.sort_unstable_by_key(|s| s.base);
        Ok(out)
    }
}

impl Pool {
    /// The live allocation containing `ptr` (its start or any byte inside): its start,
    /// requested bytes and device (PyTorch's `getBaseAllocation`, and the block a tensor view
    /// shares). An error when no live allocation contains it.
    pub fn allocation_containing(
        &self,
        ptr: u64,
    ) -> crate::error::Result<(u64, u64, crate::backend::DeviceId)> {
        for dp in &self.devices {
            let mut st = dp.state.lock();
            if st.arena_of(ptr).is_none() {
                continue;
            }
            let start = st.ranges_of(ptr).and_then(|r| r.allocated_containing(ptr));
            if let Some((start, _)) = start {
                st.promote(start);
                if let Ok(live) = st.check_live(start, dp.device) {
                    return Ok((start, live.requested, dp.device));
                }
            }
            break;
        }
        Err(crate::error::Error::UnknownPointer {
            ptr,
            why: "not inside a live allocation of gpu-arena".into(),
        })
    }
}
