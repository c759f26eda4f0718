//! Allocation history: a fixed-capacity ring of small plain records per device (PyTorch's
//! `_record_memory_history` for gpu-arena), read back through the JSON snapshot.
//!
//! **Cost when off.** Each device's ring lives in its `DeviceState`, behind the device lock.
//! The path under that lock checks one `bool` field of that state ([`History::recording`]);
//! the thread caches' path (`pool/front/thread_cache.rs`), which takes no device lock, reads a
//! relaxed atomic mirror of it and, while recording is on, leaves every operation to the
//! device lock's path (so every event is recorded). No allocation when off. When on, an
//! event is one coarse clock read, one thread-local read and a 48-byte copy into the ring
//! (`bench/examples/history_overhead.rs` measures both).
//!
//! **Events** ([`Action`]): `alloc` (size = the block length, requested = the asked-for
//! bytes), `free_requested` (the owner freed it), `free_completed` (its range became
//! reusable: at once for a plain free, later for a free that waited on a share or on
//! `record_stream` streams), `segment_alloc`/`segment_free` (an arena created/destroyed),
//! `oom` (an allocation that failed for lack of memory; `addr` is unused, the device's free
//! bytes are kept instead). Names and meanings are those of PyTorch's trace entries.
//!
//! **Context.** Each event carries the calling thread's context id ([`set_context`]), 0 when
//! none. gpu-arena cannot see the caller's stack: the Python side sets an id for a labelled
//! region (`gpu_arena.torch.annotate`) and maps ids to frames when it builds a snapshot.
//!
//! **Ring.** When full, the oldest event is overwritten and counted in
//! [`Ring::dropped`]. Enabling recording starts an empty ring; disabling stops recording
//! and keeps the ring, so a snapshot taken after stopping still has the events.

use std::cell::Cell;

use rustix::time::{clock_gettime, ClockId};

/// What happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// An allocation was handed out.
    Alloc,
    /// The owner freed an allocation.
    FreeRequested,
    /// A freed allocation's range became reusable.
    FreeCompleted,
    /// An arena was created through the backend.
    SegmentAlloc,
    /// An arena went back to the backend.
    SegmentFree,
    /// An allocation failed for lack of memory.
    Oom,
}

impl Action {
    /// PyTorch's name of the action (`torch.cuda.memory._snapshot()["device_traces"]`).
    pub fn name(self) -> &'static str {
        match self {
            Action::Alloc => "alloc",
            Action::FreeRequested => "free_requested",
            Action::FreeCompleted => "free_completed",
            Action::SegmentAlloc => "segment_alloc",
            Action::SegmentFree => "segment_free",
            Action::Oom => "oom",
        }
    }
}

/// One recorded event: plain data, 48 bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Event {
    /// Device address (for `oom`: the device's free bytes at the time).
    pub addr: u64,
    /// Bytes: the block length for alloc/free events, the arena's for segment events, the
    /// rounded request for `oom`.
    pub size: u64,
    /// The caller's requested bytes (alloc/free events), else 0.
    pub requested: u64,
    /// The stream handle (0 for the default stream, and for segment events).
    pub stream: u64,
    /// Wall-clock time, nanoseconds since the Unix epoch (coarse: one kernel tick).
    pub time_ns: u64,
    /// The recording thread's context id ([`set_context`]), 0 for none.
    pub context: u32,
    /// What happened.
    pub action: Action,
}

impl Event {
    /// The event as a JSON object: PyTorch's trace entry fields (`action, addr, size,
    /// stream, time_us`; `device_free` instead of `addr` for `oom`) plus `requested`,
    /// `time_ns` and `context`.
    pub fn to_json(&self) -> serde_json::Value {
        let mut v = serde_json::json!({
            "action": self.action.name(),
            "size": self.size,
            "requested": self.requested,
            "stream": self.stream,
            "time_ns": self.time_ns,
            "time_us": self.time_ns / 1000,
            "context": self.context,
        });
        let key = if self.action == Action::Oom {
            "device_free"
        } else {
            "addr"
        };
        v[key] = self.addr.into();
        v
    }
}

/// A fixed-capacity ring of events, oldest overwritten first.
#[derive(Debug, Clone, Default)]
pub struct Ring {
    buf: Vec<Event>,
    cap: usize,
    /// Where the next event goes once the ring is full.
    head: usize,
    dropped: u64,
}

impl Ring {
    /// An empty ring of at most `cap` events (at least 1). Memory grows with use, up to
    /// `cap` events.
    pub fn new(cap: usize) -> Ring {
        Ring {
            buf: Vec::new(),
            cap: cap.max(1),
            head: 0,
            dropped: 0,
        }
    }

    /// Append, overwriting the oldest event when full.
    pub fn push(&mut self, e: Event) {
        if self.buf.len() < self.cap {
            self.buf.push(e);
        } else {
            self.buf[self.head] = e;
            self.head = (self.head + 1) % self.cap;
            self.dropped += 1;
        }
    }

    /// The events, oldest first.
    pub fn iter(&self) -> impl Iterator<Item = &Event> + '_ {
        let (newer, older) = self.buf.split_at(self.head);
        older.iter().chain(newer)
    }

    /// Events held.
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    /// Whether no event is held.
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    /// The capacity.
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Events overwritten because the ring was full.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }
}

/// One device's history: whether it records, and its ring.
#[derive(Debug, Clone, Default)]
pub struct History {
    /// Checked on every alloc and free (under the device lock): the only cost when off.
    pub recording: bool,
    ring: Ring,
}

impl History {
    /// Start recording into a fresh, empty ring of `cap` events (`false`: stop recording,
    /// keep the ring).
    pub fn set(&mut self, enabled: bool, cap: usize) {
        if enabled {
            self.ring = Ring::new(cap);
        }
        self.recording = enabled;
    }

    /// Record an event stamped now, with the calling thread's context. Call only when
    /// [`History::recording`] (the caller checks, so the off path costs one branch).
    #[cold]
    pub fn record(&mut self, action: Action, addr: u64, size: u64, requested: u64, stream: u64) {
        self.ring.push(Event {
            addr,
            size,
            requested,
            stream,
            time_ns: now_ns(),
            context: context(),
            action,
        });
    }

    /// The ring.
    pub fn ring(&self) -> &Ring {
        &self.ring
    }

    /// `{"recording", "capacity", "dropped", "events": [...]}`, events oldest first.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "recording": self.recording,
            "capacity": self.ring.capacity(),
            "dropped": self.ring.dropped(),
            "events": self.ring.iter().map(Event::to_json).collect::<Vec<_>>(),
        })
    }
}

/// Wall-clock nanoseconds from the kernel's coarse clock (`CLOCK_REALTIME_COARSE`: a few ns
/// to read, resolution one kernel tick, 1-4 ms). The precise clock costs 50-70 ns per read
/// on a VM, most of an event's cost; the viewers order events by their position in the
/// ring, not by time.
fn now_ns() -> u64 {
    let t = clock_gettime(ClockId::RealtimeCoarse);
    u64::try_from(t.tv_sec)
        .unwrap_or(0)
        .saturating_mul(1_000_000_000)
        .saturating_add(u64::try_from(t.tv_nsec).unwrap_or(0))
}

thread_local! {
    static CONTEXT: Cell<u32> = const { Cell::new(0) };
}

/// Set the calling thread's context id (0: none), stored with every event it records from
/// now on; returns the previous id.
pub fn set_context(id: u32) -> u32 {
    CONTEXT.try_with(|c| c.replace(id)).unwrap_or(0)
}

/// The calling thread's context id.
pub fn context() -> u32 {
    CONTEXT.try_with(Cell::get).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(addr: u64) -> Event {
        Event {
            addr,
            size: 512,
            requested: 500,
            stream: 0,
            time_ns: 1,
            context: 0,
            action: Action::Alloc,
        }
    }

    #[test]
    fn ring_keeps_the_newest_in_order() {
        let mut r = Ring::new(3);
        assert!(r.is_empty());
        for a in 0..5 {
            r.push(ev(a));
        }
        let addrs: Vec<u64> = r.iter().map(|e| e.addr).collect();
        assert_eq!(addrs, vec![2, 3, 4]);
        assert_eq!((r.len(), r.capacity(), r.dropped()), (3, 3, 2));
        let mut r = Ring::new(0);
        r.push(ev(7));
        r.push(ev(8));
        assert_eq!(r.iter().map(|e| e.addr).collect::<Vec<_>>(), vec![8]);
    }

    #[test]
    fn history_records_only_when_on_and_keeps_events_after_stop() {
        let mut h = History::default();
        assert!(!h.recording);
        h.set(true, 10);
        let prev = set_context(42);
        h.record(Action::Alloc, 0x1000, 512, 500, 7);
        set_context(prev);
        h.record(Action::Oom, 123, 1 << 30, 1 << 30, 0);
        h.set(false, 0);
        assert_eq!(h.ring().len(), 2);
        let j = h.to_json();
        assert_eq!(j["recording"], false);
        assert_eq!(j["events"][0]["action"], "alloc");
        assert_eq!(j["events"][0]["addr"], 0x1000);
        assert_eq!(j["events"][0]["context"], 42);
        assert_eq!(j["events"][1]["action"], "oom");
        assert_eq!(j["events"][1]["device_free"], 123);
        assert!(j["events"][1].get("addr").is_none());
        h.set(true, 4);
        assert!(h.ring().is_empty());
    }

    #[test]
    fn event_is_small() {
        assert!(std::mem::size_of::<Event>() <= 48);
    }
}
