//! The registrar over a fake transport on the sim backend: one registration per arena,
//! descriptors of allocations and shares, deregistration before the arena goes.
#![allow(clippy::unwrap_used)]

use std::sync::{Arc, Mutex};

use gpu_arena::backend::sim::{SimBackend, SimConfig};
use gpu_arena::pool::ObserverError;
use gpu_arena::{ArenaInfo, Pool, PoolConfig, StreamId};
use gpu_arena_nixl::{ArenaRegistrar, Transport};

const MIB: u64 = 1 << 20;
const S: StreamId = StreamId(0x1000);

/// Records registrations; deregistration reads the arena's first byte (still mapped).
#[derive(Default)]
struct Fake {
    log: Mutex<Vec<(char, u64)>>,
}

impl Transport for Fake {
    type Registration = u64;

    fn register(&self, arena: &ArenaInfo) -> Result<u64, ObserverError> {
        self.log.lock().unwrap().push(('+', arena.arena_id));
        Ok(arena.arena_id)
    }

    fn deregister(&self, arena: &ArenaInfo, registration: u64) {
        assert_eq!(registration, arena.arena_id);
        // SAFETY: sim arenas are host mappings, still mapped during on_release.
        let _ = unsafe { std::ptr::read_volatile(arena.base as *const u8) };
        self.log.lock().unwrap().push(('-', arena.arena_id));
    }
}

#[test]
fn one_registration_per_arena_and_descriptors() {
    let sim = Arc::new(SimBackend::new(SimConfig::default()).unwrap());
    let config = PoolConfig {
        arena_size: 8 * MIB,
        // One fixed 8 MiB arena (an observed growing class makes arenas of doubling sizes:
        // `alloc/tests/growth.rs`).
        grow_arenas: false,
        ..PoolConfig::default()
    };
    let pool = Pool::new(sim.clone(), config).unwrap();
    let reg = Arc::new(ArenaRegistrar::new(Fake::default()));
    let id = pool.observe_arenas(reg.clone());
    // Large blocks (small ones, up to 1 MiB, have 2 MiB arenas of their own).
    let blocks: Vec<_> = (0..4).map(|_| pool.alloc(0, 2 * MIB, S).unwrap()).collect();
    assert_eq!(
        reg.registered().len(),
        1,
        "4 blocks, one arena, one registration"
    );
    let d = reg.descriptor(0, blocks[1].ptr, blocks[1].bytes).unwrap();
    assert_eq!(
        (d.arena_id, d.addr(), d.len),
        (1, blocks[1].ptr, blocks[1].bytes)
    );
    assert!(
        reg.descriptor(1, blocks[1].ptr, 1).is_none(),
        "another device"
    );
    assert!(
        reg.descriptor(0, blocks[1].ptr, 9 * MIB).is_none(),
        "past the arena"
    );
    let share = pool.share(blocks[2].ptr + 512, 1024).unwrap();
    let s = reg.share_descriptor(&share).unwrap();
    assert_eq!((s.addr(), s.len), (blocks[2].ptr + 512, 1024));
    pool.unshare(0, share.share_key, &share.token).unwrap();
    let big = pool.alloc(0, 20 * MIB, S).unwrap();
    assert_eq!(reg.registered().len(), 2);
    pool.free(big.ptr).unwrap();
    pool.empty_cache(None).unwrap();
    assert_eq!(
        reg.registered().len(),
        1,
        "the empty arena deregistered before it went"
    );
    for b in blocks {
        pool.free(b.ptr).unwrap();
    }
    pool.unobserve_arenas(id).unwrap();
    assert!(reg.registered().is_empty());
    let log = reg.transport().log.lock().unwrap().clone();
    assert_eq!(log, vec![('+', 1), ('+', 2), ('-', 2), ('-', 1)]);
}
