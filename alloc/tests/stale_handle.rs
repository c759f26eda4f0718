//! A share handle names an arena and the export generation it was made under: a handle of an
//! earlier export of the arena, or of a released arena, is refused with a clear error and
//! changes nothing (sim backend, broker and importer in this process).
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;

use gpu_arena::backend::sim::{SimBackend, SimConfig};
use gpu_arena::backend::Backend;
use gpu_arena::ipc::{Broker, BrokerConfig, Importer};
use gpu_arena::StreamId;

const MIB: u64 = 1 << 20;
const S: StreamId = StreamId(7);

#[test]
fn handles_of_an_earlier_export_or_a_released_arena_are_refused_and_change_nothing() {
    let backend = Arc::new(SimBackend::new(SimConfig::default()).unwrap());
    let pool = common::validating_pool(&backend, 64 * MIB);
    let broker = Broker::start(pool.clone(), BrokerConfig::default()).unwrap();
    let importer = Importer::new(backend.clone() as Arc<dyn Backend>);
    let a = pool.alloc(0, 4 * MIB, S).unwrap();

    // Export 1 of the arena ends with its last share; export 2 serves a new share.
    let h1 = broker.share(a.ptr, MIB).unwrap();
    assert_eq!(h1.info.generation, 1);
    broker.unshare(&h1).unwrap();
    let h2 = broker.share(a.ptr, MIB).unwrap();
    assert_eq!(
        (h2.info.arena_id, h2.info.generation),
        (h1.info.arena_id, 2)
    );
    let before = pool.stats(0).unwrap();
    let e = importer.import(&h1).unwrap_err().to_string();
    assert!(
        e.contains("was unshared")
            && e.contains("stale")
            && e.contains("generation 1")
            && e.contains("generation 2"),
        "{e}"
    );
    // A handle naming the live share but an older generation (built in code).
    let mut old = h2.clone();
    old.info.generation = 1;
    let e = importer.import(&old).unwrap_err().to_string();
    assert!(
        e.contains("stale handle") && e.contains("generation 1"),
        "{e}"
    );
    assert_eq!(
        pool.stats(0).unwrap(),
        before,
        "a refused handle changes nothing"
    );
    assert_eq!(importer.stats().imports_live, 0);
    // The current handle still imports.
    let p = importer.import(&h2).unwrap();
    importer.close(p).unwrap();
    broker.unshare(&h2).unwrap();

    // The arena is released; a new arena (a new id) serves the next allocation.
    pool.free(a.ptr).unwrap();
    pool.empty_cache(None).unwrap();
    assert_eq!(pool.stats(0).unwrap().arenas, 0);
    let b = pool.alloc(0, 4 * MIB, S).unwrap();
    let h3 = broker.share(b.ptr, MIB).unwrap();
    assert_ne!(h3.info.arena_id, h2.info.arena_id);
    let before = pool.stats(0).unwrap();
    let e = importer.import(&h2).unwrap_err().to_string();
    assert!(
        e.contains("was unshared") && e.contains("stale") && e.contains("was released"),
        "{e}"
    );
    assert_eq!(
        pool.stats(0).unwrap(),
        before,
        "a refused handle changes nothing"
    );
    let p = importer.import(&h3).unwrap();
    importer.close(p).unwrap();
    broker.unshare(&h3).unwrap();
    pool.free(b.ptr).unwrap();
    pool.validate(0).unwrap();
}
