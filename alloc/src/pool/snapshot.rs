//! The pool's JSON snapshot (`Pool::snapshot_json`): every device's stats, arenas (tag, size
//! class, sleep state, lifetime) and the ranges in each arena, plus the history ring when
//! it records (`pool/trace.rs`).

use super::{trace, Pool};

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
                            "ranges": st.ranges.get(a.class().index()).map(|r| r.ranges(a.mem.base)).unwrap_or_default(),
                        })
                    })
                    .collect();
                let mut d = serde_json::json!({
                    "device": dp.device,
                    "stats": st.stats_now(),
                    "arenas": arenas,
                });
                trace::add_to_snapshot(&st, &mut d);
                d
            })
            .collect();
        serde_json::json!({ "backend": self.backend.name(), "devices": devices }).to_string()
    }
}
