//! The pool's side of `crate::history`: turning recording on and off for every device, and
//! what the JSON snapshot adds for PyTorch-shaped snapshots (each device's live allocations
//! and its event ring).

use crate::pool::state::device::DeviceState;
use crate::pool::state::pool::Pool;

/// Default ring capacity per device (PyTorch's `max_entries` default is also large).
pub const DEFAULT_HISTORY_ENTRIES: usize = 100_000;

impl Pool {
    /// Start (`enabled`, with an empty ring of `max_entries` events per device; 0 means
    /// [`DEFAULT_HISTORY_ENTRIES`]) or stop recording alloc/free/segment events. Stopping
    /// keeps the events for the next snapshot.
    pub fn record_history(&self, enabled: bool, max_entries: usize) {
        let cap = if max_entries == 0 {
            DEFAULT_HISTORY_ENTRIES
        } else {
            max_entries
        };
        for dp in &self.devices {
            let mut st = dp.state.lock();
            st.history.set(enabled, cap);
            st.front.set_history(st.history.recording);
        }
    }

    /// Whether events are being recorded (device 0's setting; every device has the same).
    pub fn history_recording(&self) -> bool {
        self.devices
            .first()
            .is_some_and(|dp| dp.state.lock().history.recording)
    }
}

/// The snapshot's per-device additions: `"allocations"` (every allocation still holding its
/// range, in address order: `addr, bytes, requested, stream, state`, where state is
/// `"active_allocated"`, or `"active_pending_free"` for one its owner freed that still waits
/// for a share or a stream) and `"history"` (`crate::history::History::to_json`).
pub(crate) fn add_to_snapshot(st: &DeviceState, device: &mut serde_json::Value) {
    let mut allocs: Vec<_> = st.allocs.iter().collect();
    allocs.sort_unstable_by_key(|(ptr, _)| **ptr);
    let allocations: Vec<serde_json::Value> = allocs
        .into_iter()
        .map(|(ptr, l)| {
            serde_json::json!({
                "addr": ptr,
                "bytes": l.bytes(),
                "requested": l.requested,
                "stream": l.stream.0,
                "state": if l.hold.freed() { "active_pending_free" } else { "active_allocated" },
            })
        })
        .collect();
    device["allocations"] = allocations.into();
    device["history"] = st.history.to_json();
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::sync::Arc;

    use crate::backend::sim::{SimBackend, SimConfig};
    use crate::{Pool, PoolConfig, StreamId};

    const MIB: u64 = 1 << 20;

    fn pool(capacity: u64) -> Pool {
        let sim = SimBackend::new(SimConfig {
            devices: 1,
            capacity,
            granularity: 2 * MIB,
            legacy_pin: false,
        })
        .unwrap();
        let config = PoolConfig {
            arena_size: 8 * MIB,
            ..PoolConfig::default()
        };
        Pool::new(Arc::new(sim), config).unwrap()
    }

    fn events(p: &Pool) -> Vec<serde_json::Value> {
        let snap: serde_json::Value = serde_json::from_str(&p.snapshot_json()).unwrap();
        snap["devices"][0]["history"]["events"]
            .as_array()
            .unwrap()
            .clone()
    }

    #[test]
    fn records_alloc_free_segment_and_oom_only_when_on() {
        let p = pool(32 * MIB);
        let a = p.alloc(0, 1000, StreamId(0)).unwrap();
        p.free(a.ptr).unwrap();
        assert!(events(&p).is_empty(), "off by default");
        p.record_history(true, 64);
        assert!(p.history_recording());
        let b = p.alloc(0, 3000, StreamId(5)).unwrap();
        let big = p.alloc(0, 16 * MIB, StreamId(0)).unwrap();
        assert!(p.alloc(0, 64 * MIB, StreamId(0)).is_err());
        p.free(b.ptr).unwrap();
        p.free(big.ptr).unwrap();
        p.empty_cache(None).unwrap();
        let ev = events(&p);
        let names: Vec<&str> = ev.iter().map(|e| e["action"].as_str().unwrap()).collect();
        assert_eq!(
            names,
            [
                "alloc",
                "segment_alloc",
                "alloc",
                "oom",
                "free_requested",
                "free_completed",
                "free_requested",
                "free_completed",
                "segment_free",
                "segment_free",
            ]
        );
        assert_eq!(ev[0]["addr"], b.ptr);
        assert_eq!(ev[0]["requested"], 3000);
        assert_eq!(ev[0]["stream"], 5);
        assert_eq!(ev[1]["size"], 16 * MIB);
        assert!(ev[3]["device_free"].is_u64());
        p.record_history(false, 0);
        let c = p.alloc(0, 512, StreamId(0)).unwrap();
        assert_eq!(events(&p).len(), 10, "stopped: kept, no new events");
        let snap: serde_json::Value = serde_json::from_str(&p.snapshot_json()).unwrap();
        let allocs = &snap["devices"][0]["allocations"];
        assert_eq!(allocs[0]["addr"], c.ptr);
        assert_eq!(allocs[0]["state"], "active_allocated");
        assert_eq!(allocs[0]["requested"], 512);
    }
}
