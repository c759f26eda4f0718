//! Tags, sleep and wake on the sim backend: tags never share an arena; a sleep gives the
//! memory back (sim ledger, `reserved_bytes`) while the addresses stay; a wake maps memory
//! at the same addresses with the offloaded tags' bytes identical; partial wake; allocations
//! refused while asleep; double sleep and waking an awake tag refused with nothing changed;
//! shared arenas kept (share then sleep; sleep then share refused); observers told.
#![allow(clippy::unwrap_used)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use gpu_arena::backend::sim::{SimBackend, SimConfig};
use gpu_arena::pool::ObserverError;
use gpu_arena::{tags, ArenaInfo, ArenaObserver, Error, Pool, StreamId};

mod common;
use common::{alloc_with, fill, read, sim_pool};

const MIB: u64 = 1 << 20;
const S: StreamId = StreamId(0x1000);

fn pool() -> (Arc<SimBackend>, Pool) {
    intern_tags();
    sim_pool(SimConfig::default(), 8 * MIB, true)
}

/// Intern every tag this file names. "Every tag" (a sleep naming none) is every tag interned
/// in the process: a test running beside another must not add one between its sleeps (the
/// second sleep of `sleep_offloads_one_tag_...` then found the new tag awake and slept it
/// instead of refusing; seen once under load).
fn intern_tags() {
    for t in [
        "default",
        "ec_kv",
        "hb_w",
        "hb_x",
        "ob_kv",
        "ob_w",
        "pa_kv",
        "pa_w",
        "sh_kv",
        "sh_w",
        "st_kv",
        "st_w",
        "sw_kv",
        "sw_weights",
        "tw_a",
        "tw_b",
    ] {
        tags::index(Some(t)).unwrap();
    }
}

fn is_asleep_error(e: &Error) -> bool {
    matches!(e, Error::InvalidState(m) if m.contains("asleep"))
}

fn idx(name: &str) -> u8 {
    tags::index(Some(name)).unwrap()
}

#[test]
fn tags_never_share_an_arena() {
    let (_sim, pool) = pool();
    let a = alloc_with(&pool, "tw_a", 2 * MIB, S);
    let b = alloc_with(&pool, "tw_b", 2 * MIB, S);
    let d = alloc_with(&pool, "default", 2 * MIB, S);
    assert_eq!(pool.stats(0).unwrap().arenas, 3);
    let arena = |p: u64| p & !(8 * MIB - 1);
    assert_ne!(arena(a), arena(b));
    // A freed range of one tag is not reused by another.
    pool.free(a).unwrap();
    let b2 = alloc_with(&pool, "tw_b", 2 * MIB, S);
    assert_ne!(b2, a);
    let a2 = alloc_with(&pool, "tw_a", 2 * MIB, S);
    assert_eq!(a2, a, "the tag's own freed block comes back");
    for p in [b, d, b2, a2] {
        pool.free(p).unwrap();
    }
    pool.validate(0).unwrap();
}

#[test]
fn sleep_offloads_one_tag_discards_the_other_and_wakes_at_the_same_addresses() {
    let (sim, pool) = pool();
    let w: Vec<u64> = (0..3)
        .map(|_| alloc_with(&pool, "sw_weights", 2 * MIB, S))
        .collect();
    let kv = alloc_with(&pool, "sw_kv", 4 * MIB, S);
    let kv2 = alloc_with(&pool, "sw_kv", 2 * MIB, S);
    for (i, &p) in w.iter().enumerate() {
        fill(p, (2 * MIB) as usize, i as u8);
    }
    fill(kv, (4 * MIB) as usize, 99);
    let before: Vec<Vec<u8>> = w.iter().map(|&p| read(p, (2 * MIB) as usize)).collect();
    let reserved = pool.stats(0).unwrap().reserved_bytes;
    assert_eq!(reserved, 16 * MIB);

    let r = pool.sleep(Some(0), &[idx("sw_weights")]).unwrap();
    assert_eq!(r.arenas, 2);
    assert_eq!(r.arena_bytes, 16 * MIB);
    assert_eq!(
        r.copied_bytes,
        6 * MIB,
        "only the live runs of the offloaded tag"
    );
    let st = pool.stats(0).unwrap();
    assert_eq!((st.reserved_bytes, st.sleeping_bytes), (0, 16 * MIB));
    assert_eq!(sim.ledger(0).held_bytes, 0, "the memory really went back");
    assert_eq!(sim.ledger(0).sleeping_bytes, 16 * MIB);

    // Asleep: allocations refused, frees allowed, a second sleep refused.
    tags::set_current(Some("sw_kv")).unwrap();
    let e = pool.alloc(0, MIB, S).unwrap_err();
    tags::set_current(None).unwrap();
    assert!(is_asleep_error(&e), "{e}");
    pool.free(kv2).unwrap();
    let e = pool.sleep(Some(0), &[idx("sw_weights")]).unwrap_err();
    assert!(matches!(e, Error::InvalidState(_)), "{e}");
    let e = pool.sleep(Some(0), &[]).unwrap_err();
    assert!(matches!(e, Error::InvalidState(_)), "{e}");
    assert_eq!(pool.stats(0).unwrap(), {
        let mut s = st;
        s.allocations -= 1;
        s.allocated_bytes -= 2 * MIB;
        s.requested_bytes -= 2 * MIB;
        s.free_count += 1;
        s
    });

    // Partial wake: the weights come back, bitwise, at the same addresses.
    let r = pool.wake(Some(0), Some(&[idx("sw_weights")])).unwrap();
    assert_eq!((r.arenas, r.copied_bytes), (1, 6 * MIB));
    for (i, &p) in w.iter().enumerate() {
        assert_eq!(read(p, (2 * MIB) as usize), before[i]);
    }
    assert_eq!(pool.stats(0).unwrap().reserved_bytes, 8 * MIB);
    assert_eq!(sim.ledger(0).held_bytes, 8 * MIB);
    tags::set_current(Some("sw_kv")).unwrap();
    assert!(is_asleep_error(&pool.alloc(0, MIB, S).unwrap_err()));
    tags::set_current(None).unwrap();
    // Waking an awake tag is refused and changes nothing.
    let e = pool.wake(Some(0), Some(&[idx("sw_weights")])).unwrap_err();
    assert!(matches!(e, Error::InvalidState(_)), "{e}");
    assert_eq!(pool.stats(0).unwrap().reserved_bytes, 8 * MIB);

    // Wake the rest: the discarded tag's memory is back (zeroed on sim) at its addresses.
    pool.wake(Some(0), None).unwrap();
    assert_eq!(read(kv, 16), vec![0; 16]);
    fill(kv, (4 * MIB) as usize, 5);
    let kv3 = alloc_with(&pool, "sw_kv", 2 * MIB, S);
    assert_eq!(kv3, kv2, "the freed range is reusable after wake");
    let st = pool.stats(0).unwrap();
    assert_eq!((st.reserved_bytes, st.sleeping_bytes), (16 * MIB, 0));
    assert!(matches!(
        pool.wake(None, None).unwrap_err(),
        Error::InvalidState(_)
    ));
    for p in w.into_iter().chain([kv, kv3]) {
        pool.free(p).unwrap();
    }
    pool.validate(0).unwrap();
    assert_eq!(pool.empty_cache(None).unwrap(), 16 * MIB);
}

#[test]
fn empty_cache_and_drop_leave_sleeping_arenas_alone_and_clean() {
    let (sim, pool) = pool();
    let p = alloc_with(&pool, "ec_kv", 2 * MIB, S);
    pool.free(p).unwrap();
    pool.sleep(None, &[]).unwrap();
    assert_eq!(pool.empty_cache(None).unwrap(), 0, "asleep: not destroyed");
    drop(pool);
    assert!(sim.is_clean(0), "{:?}", sim.ledger(0));
}

#[test]
fn shared_arenas_keep_their_memory_and_sleeping_memory_is_not_shared() {
    let (sim, pool) = pool();
    let shared = alloc_with(&pool, "sh_kv", 2 * MIB, S);
    let other = alloc_with(&pool, "sh_kv", 2 * MIB, S);
    fill(shared, MIB as usize, 7);
    let info = pool.share(shared, 2 * MIB).unwrap();
    let mine = alloc_with(&pool, "sh_w", 2 * MIB, S);
    let r = pool.sleep(Some(0), &[]).unwrap();
    assert_eq!(r.kept_shared_bytes, 8 * MIB);
    assert_eq!(r.arena_bytes, 8 * MIB, "the unshared arena slept");
    assert_eq!(read(shared, MIB as usize), {
        fill(other, 0, 0);
        let mut v = vec![0u8; MIB as usize];
        for (i, b) in v.iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(31).wrapping_add(7);
        }
        v
    });
    let st = pool.stats(0).unwrap();
    assert_eq!((st.reserved_bytes, st.sleeping_bytes), (8 * MIB, 8 * MIB));
    assert_eq!(
        st.sleep_kept_shared_bytes,
        8 * MIB,
        "the kept bytes in the stats"
    );
    assert_eq!(sim.ledger(0).held_bytes, 8 * MIB);
    // New shares of a sleeping tag's memory are refused, kept arena or not.
    for p in [other, mine] {
        let e = pool.share(p, 2 * MIB).unwrap_err();
        assert!(is_asleep_error(&e), "{e}");
    }
    pool.unshare(0, info.share_key, &info.token).unwrap();
    pool.wake(None, None).unwrap();
    assert_eq!(pool.stats(0).unwrap().sleep_kept_shared_bytes, 0);
    let again = pool.share(other, 2 * MIB).unwrap();
    pool.unshare(0, again.share_key, &again.token).unwrap();
    for p in [shared, other, mine] {
        pool.free(p).unwrap();
    }
    pool.validate(0).unwrap();
}

#[derive(Default)]
struct Counter {
    ready: AtomicU64,
    release: AtomicU64,
}

impl ArenaObserver for Counter {
    fn on_ready(&self, _arena: &ArenaInfo) -> Result<(), ObserverError> {
        self.ready.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    fn on_release(&self, _arena: &ArenaInfo) {
        self.release.fetch_add(1, Ordering::SeqCst);
    }
}

#[test]
fn observers_are_told_before_sleep_and_after_wake() {
    let (_sim, pool) = pool();
    let c = Arc::new(Counter::default());
    let id = pool.observe_arenas(c.clone());
    let a = alloc_with(&pool, "ob_w", 2 * MIB, S);
    let b = alloc_with(&pool, "ob_kv", 2 * MIB, S);
    assert_eq!(c.ready.load(Ordering::SeqCst), 2);
    pool.sleep(Some(0), &[idx("ob_w")]).unwrap();
    assert_eq!(c.release.load(Ordering::SeqCst), 2);
    pool.wake(Some(0), Some(&[idx("ob_w")])).unwrap();
    assert_eq!(c.ready.load(Ordering::SeqCst), 3);
    pool.wake(Some(0), None).unwrap();
    assert_eq!(c.ready.load(Ordering::SeqCst), 4);
    pool.free(a).unwrap();
    pool.free(b).unwrap();
    pool.unobserve_arenas(id).unwrap();
    assert_eq!(c.release.load(Ordering::SeqCst), 4);
}

#[test]
fn bad_device_is_refused() {
    let (_sim, pool) = pool();
    assert!(matches!(
        pool.sleep(Some(7), &[]).unwrap_err(),
        Error::InvalidDevice { .. }
    ));
    assert!(matches!(
        pool.wake(Some(-1), None).unwrap_err(),
        Error::InvalidDevice { .. }
    ));
}

#[test]
fn every_device_skips_devices_with_nothing_to_do() {
    intern_tags();
    let (backend, pool) = sim_pool(
        SimConfig {
            devices: 2,
            ..SimConfig::default()
        },
        8 * MIB,
        true,
    );
    let p = pool.alloc(1, MIB, S).unwrap().ptr;
    pool.sleep(Some(1), &[]).unwrap();
    // Device 0 is awake, device 1 asleep: every device wakes what sleeps (device 1 only),
    // and sleeping every device sleeps what is awake.
    pool.wake(None, None).unwrap();
    assert_eq!(pool.asleep_tags(1).unwrap(), 0);
    pool.sleep(Some(0), &[]).unwrap();
    pool.sleep(None, &[]).unwrap();
    assert_eq!(backend.ledger(1).held_bytes, 0);
    // The default tag (the only one used here) sleeps everywhere: nothing to do. (Named:
    // "every tag" also covers tags that other tests of this binary register concurrently.)
    assert!(matches!(
        pool.sleep_tags(None, Some(&[0]), &[]).unwrap_err(),
        Error::InvalidState(_)
    ));
    pool.wake(None, None).unwrap();
    pool.free(p).unwrap();
}

#[test]
fn offload_host_buffers_are_kept_reused_released_and_freed_on_drop() {
    let (sim, pool) = pool();
    // Live, freed gap, live: one segment with the gap; contents intact after the wake.
    let a = alloc_with(&pool, "hb_w", 2 * MIB, S);
    let gap = alloc_with(&pool, "hb_w", 2 * MIB, S);
    let b = alloc_with(&pool, "hb_w", 2 * MIB, S);
    // Another tag: its arena is discarded, no host buffer.
    let _other = alloc_with(&pool, "hb_x", 2 * MIB, S);
    pool.free(gap).unwrap();
    fill(a, MIB as usize, 3);
    fill(b, MIB as usize, 9);
    let (wa, wb) = (read(a, MIB as usize), read(b, MIB as usize));
    let host = |pool: &Pool| pool.stats(0).unwrap().offload_host_bytes;
    let r = pool.sleep(Some(0), &[idx("hb_w")]).unwrap();
    assert_eq!(r.copied_bytes, 4 * MIB, "live bytes, gaps not counted");
    assert_eq!(sim.host_buffers(), 1, "one host buffer per offloaded arena");
    assert_eq!(host(&pool), 6 * MIB, "one segment: a, the gap, b");
    let r = pool.wake(Some(0), None).unwrap();
    assert_eq!(r.copied_bytes, 4 * MIB);
    assert_eq!(read(a, MIB as usize), wa);
    assert_eq!(read(b, MIB as usize), wb);
    assert_eq!(
        sim.host_buffers(),
        1,
        "kept after the wake for the next sleep"
    );
    assert_eq!(host(&pool), 6 * MIB);
    pool.validate(0).unwrap();

    // A smaller offload reuses the kept buffer (a new one would be 2 MiB).
    pool.free(b).unwrap();
    pool.sleep(Some(0), &[idx("hb_w")]).unwrap();
    assert_eq!((sim.host_buffers(), host(&pool)), (1, 6 * MIB), "reused");
    assert_eq!(pool.release_host_buffers(None).unwrap(), 0, "in use: stays");
    pool.wake(Some(0), None).unwrap();
    assert_eq!(read(a, MIB as usize), wa);
    // A larger one replaces it: still one buffer.
    let _c = alloc_with(&pool, "hb_w", 6 * MIB, S);
    pool.sleep(Some(0), &[idx("hb_w")]).unwrap();
    assert_eq!(sim.host_buffers(), 1, "the too-small buffer was replaced");
    assert_eq!(host(&pool), 8 * MIB, "a and c: 2 + 6 MiB");
    pool.wake(Some(0), None).unwrap();
    // empty_cache leaves kept buffers; release_host_buffers frees them.
    pool.empty_cache(None).unwrap();
    assert_eq!(sim.host_buffers(), 1);
    assert_eq!(pool.release_host_buffers(Some(0)).unwrap(), 8 * MIB);
    assert_eq!((sim.host_buffers(), host(&pool)), (0, 0));
    pool.validate(0).unwrap();

    // Asleep when the pool goes: the buffer is freed with it; so is a kept one.
    pool.sleep(Some(0), &[idx("hb_w")]).unwrap();
    assert_eq!(sim.host_buffers(), 1);
    drop(pool);
    assert_eq!(
        sim.host_buffers(),
        0,
        "freed when the pool is dropped while asleep"
    );
    let (sim, pool) = self::pool();
    let p = alloc_with(&pool, "hb_w", 2 * MIB, S);
    pool.sleep(Some(0), &[idx("hb_w")]).unwrap();
    pool.wake(Some(0), None).unwrap();
    assert_eq!(sim.host_buffers(), 1);
    pool.free(p).unwrap();
    drop(pool);
    assert_eq!(
        sim.host_buffers(),
        0,
        "a kept buffer is freed with the pool"
    );
}

#[test]
fn sleep_tags_sleeps_one_tag_while_the_others_allocate() {
    let (sim, pool) = pool();
    let w = alloc_with(&pool, "st_w", 2 * MIB, S);
    let kv = alloc_with(&pool, "st_kv", 2 * MIB, S);
    fill(w, 2 * MIB as usize, 5);
    let want = read(w, 2 * MIB as usize);
    // Refused, nothing changed: an offload tag not put to sleep, an empty list.
    let e = pool
        .sleep_tags(Some(0), Some(&[idx("st_kv")]), &[idx("st_w")])
        .unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument(ref m) if m.contains("st_w")),
        "{e}"
    );
    assert!(matches!(
        pool.sleep_tags(Some(0), Some(&[]), &[]).unwrap_err(),
        Error::InvalidArgument(_)
    ));
    assert_eq!(pool.asleep_tags(0).unwrap(), 0);

    let r = pool
        .sleep_tags(Some(0), Some(&[idx("st_kv")]), &[])
        .unwrap();
    assert_eq!((r.arenas, r.arena_bytes, r.copied_bytes), (1, 8 * MIB, 0));
    assert_eq!(pool.asleep_tags(0).unwrap(), 1 << idx("st_kv"));
    let s = pool.stats(0).unwrap();
    assert_eq!((s.reserved_bytes, s.sleeping_bytes), (8 * MIB, 8 * MIB));
    assert_eq!(sim.ledger(0).held_bytes, 8 * MIB, "the kv arena went back");
    // The awake tags allocate and keep their contents; the sleeping one is refused.
    assert_eq!(read(w, 2 * MIB as usize), want);
    let w2 = alloc_with(&pool, "st_w", 2 * MIB, S);
    let d = alloc_with(&pool, "default", 4096, S);
    tags::set_current(Some("st_kv")).unwrap();
    assert!(is_asleep_error(&pool.alloc(0, MIB, S).unwrap_err()));
    tags::set_current(None).unwrap();
    // Sleeping it again is refused, nothing changes; another tag may sleep on its own.
    let e = pool
        .sleep_tags(Some(0), Some(&[idx("st_kv")]), &[])
        .unwrap_err();
    assert!(
        matches!(e, Error::InvalidState(ref m) if m.contains("st_kv")),
        "{e}"
    );
    pool.sleep_tags(None, Some(&[idx("st_w")]), &[idx("st_w")])
        .unwrap();
    assert_eq!(
        pool.asleep_tags(0).unwrap(),
        (1 << idx("st_kv")) | (1 << idx("st_w"))
    );
    // With every device, a device where every named tag sleeps is skipped: refused here
    // only because no device has one awake.
    assert!(pool.sleep_tags(None, Some(&[idx("st_w")]), &[]).is_err());
    pool.wake(Some(0), None).unwrap();
    assert_eq!(read(w, 2 * MIB as usize), want, "offloaded st_w identical");
    for p in [w, w2, kv, d] {
        pool.free(p).unwrap();
    }
    pool.validate(0).unwrap();
}

#[test]
fn prepare_offload_pins_ahead_so_the_first_sleep_makes_no_buffer() {
    let (sim, pool) = pool();
    // Two arenas of tag pa_w with live data, one of tag pa_kv (not offloaded).
    let w: Vec<u64> = (0..3)
        .map(|_| alloc_with(&pool, "pa_w", 6 * MIB, S))
        .collect();
    let kv = alloc_with(&pool, "pa_kv", 6 * MIB, S);
    for (i, &p) in w.iter().enumerate() {
        fill(p, (6 * MIB) as usize, 10 + i as u8);
    }
    assert!(pool.prepare_offload(Some(0), &[]).is_err(), "no tag named");
    let made = pool.prepare_offload(Some(0), &[idx("pa_w")]).unwrap();
    assert_eq!(
        made,
        18 * MIB,
        "a buffer per offloaded arena, sized to its live data"
    );
    assert_eq!(sim.host_buffers(), 3);
    assert_eq!(pool.stats(0).unwrap().offload_host_bytes, 18 * MIB);
    // The sleep finds them: no new buffer; the wake brings the contents back.
    let before: Vec<Vec<u8>> = w.iter().map(|&p| read(p, (6 * MIB) as usize)).collect();
    pool.sleep(Some(0), &[idx("pa_w")]).unwrap();
    assert_eq!(sim.host_buffers(), 3, "the first sleep made no buffer");
    pool.wake(Some(0), None).unwrap();
    for (p, b) in w.iter().zip(&before) {
        assert!(read(*p, (6 * MIB) as usize) == *b);
    }
    // Again: nothing new to make (the buffers are kept), and asleep arenas are skipped.
    assert_eq!(pool.prepare_offload(None, &[idx("pa_w")]).unwrap(), 0);
    pool.free(kv).unwrap();
    for p in w {
        pool.free(p).unwrap();
    }
    assert_eq!(pool.release_host_buffers(None).unwrap(), 18 * MIB);
    assert_eq!(sim.host_buffers(), 0);
}
