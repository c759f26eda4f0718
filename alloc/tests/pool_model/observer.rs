//! An arena observer for the model test: it keeps what it was told is mapped, and checks
//! that it is told once per arena, in order: no two registrations overlap, and a release
//! names a registration. Every fifth `on_ready` fails: the arena stays usable and this
//! observer must get no `on_release` for it.

use std::collections::BTreeMap;

use gpu_arena::pool::ObserverError;
use gpu_arena::{ArenaInfo, ArenaObserver};
use parking_lot::Mutex;

#[derive(Default)]
pub struct Registrar {
    /// Registered arenas: base -> size.
    ranges: Mutex<BTreeMap<u64, u64>>,
    /// Arenas whose `on_ready` this observer failed: base -> size.
    refused: Mutex<BTreeMap<u64, u64>>,
    readies: std::sync::atomic::AtomicU64,
    /// The first broken rule seen in a callback (a callback cannot fail the test itself).
    broken: Mutex<Option<String>>,
}

impl Registrar {
    fn broke(&self, what: String) {
        self.broken.lock().get_or_insert(what);
    }

    /// The first broken rule, if any.
    pub fn broken(&self) -> Option<String> {
        self.broken.lock().clone()
    }

    /// Whether `[ptr, ptr + len)` lies inside one arena this observer was told of (its
    /// `on_ready` returned `Ok`, or this observer refused it).
    pub fn covers(&self, ptr: u64, len: u64) -> bool {
        let inside = |map: &BTreeMap<u64, u64>| {
            map.range(..=ptr)
                .next_back()
                .is_some_and(|(&base, &size)| ptr + len <= base + size)
        };
        inside(&self.ranges.lock()) || inside(&self.refused.lock())
    }

    /// Registered arenas now.
    pub fn registered(&self) -> usize {
        self.ranges.lock().len()
    }
}

impl ArenaObserver for Registrar {
    fn on_ready(&self, a: &ArenaInfo) -> Result<(), ObserverError> {
        let mut ranges = self.ranges.lock();
        let clash = ranges
            .range(..a.base + a.size)
            .next_back()
            .filter(|(&base, &size)| base + size > a.base);
        if let Some((&base, &size)) = clash {
            drop(ranges);
            self.broke(format!(
                "on_ready of {:#x} +{} overlaps the registered {base:#x} +{size}",
                a.base, a.size
            ));
            return Ok(());
        }
        // A new arena here: the refused arenas whose memory it now covers went (an observer
        // is told nothing when a refused arena goes, so their entries stay until then; one
        // left inside a new arena's range would hide the new one from `covers`).
        {
            let mut refused = self.refused.lock();
            let gone: Vec<u64> = refused
                .range(..a.base + a.size)
                .filter(|(&base, &size)| base + size > a.base)
                .map(|(&base, _)| base)
                .collect();
            for base in gone {
                refused.remove(&base);
            }
        }
        let n = self
            .readies
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if n % 5 == 4 {
            self.refused.lock().insert(a.base, a.size);
            return Err(format!("refused arena {:#x} (the model's fifth on_ready)", a.base).into());
        }
        ranges.insert(a.base, a.size);
        Ok(())
    }

    fn on_release(&self, a: &ArenaInfo) {
        if self.refused.lock().contains_key(&a.base) && !self.ranges.lock().contains_key(&a.base) {
            self.broke(format!(
                "on_release of {:#x}, whose on_ready this observer failed",
                a.base
            ));
            return;
        }
        let removed = self.ranges.lock().remove(&a.base);
        if removed != Some(a.size) {
            self.broke(format!(
                "on_release of {:#x} +{}: registered as {removed:?}",
                a.base, a.size
            ));
        }
    }
}
