//! The sim backend's tests, part three: grown arenas, one memfd per chunk (`grow.rs`), and
//! `drop_chunks` leaving the kept chunks' pages where they are (`split.rs`). Shared helpers:
//! `tests.rs`.
#![allow(clippy::unwrap_used)]

use std::fs::{File, OpenOptions};
use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;

use super::sys::{self, Region};
use super::tests::{
    destroy_and_assert_clean, is_invalid, read, sim, sim_with, tagged_fds, tagged_maps, write, MIB,
};
use super::*;

/// What `/proc/self/maps` says is mapped at `addr`: the inode of the file (0 for anonymous
/// memory) and the file offset at `addr`; `None` when nothing is mapped there.
fn backing(addr: u64) -> Option<(u64, u64)> {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    maps.lines().find_map(|line| {
        let mut fields = line.split_whitespace();
        let (lo, hi) = fields.next()?.split_once('-')?;
        let (lo, hi) = (
            u64::from_str_radix(lo, 16).ok()?,
            u64::from_str_radix(hi, 16).ok()?,
        );
        let offset = u64::from_str_radix(fields.nth(1)?, 16).ok()?;
        let inode = fields.nth(1)?.parse().ok()?;
        // `then`, not `then_some`: `addr - lo` underflows on the lines below `addr`.
        (lo <= addr && addr < hi).then(|| (inode, offset + (addr - lo)))
    })
}

/// A second mapping of the memfd of ours that backs the arena's address `addr` (opened
/// again through `/proc/self/fd`): it sees the very pages mapped at `addr`, as long as they
/// stay that memfd's.
struct View {
    _file: File,
    region: Region,
    /// The memfd's inode.
    inode: u64,
    /// The file offset that `addr` maps.
    offset: u64,
}

impl View {
    fn of(addr: u64, tag: &str) -> View {
        let (inode, offset) = backing(addr).unwrap();
        let file = std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| {
                std::fs::read_link(e.path()).is_ok_and(|p| p.to_string_lossy().contains(tag))
            })
            .filter_map(|e| {
                OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open(e.path())
                    .ok()
            })
            .find(|f| f.metadata().is_ok_and(|m| m.ino() == inode))
            .unwrap();
        let len = file.metadata().unwrap().len();
        let region = sys::map_shared(file.as_fd(), len as usize).unwrap();
        View {
            _file: file,
            region,
            inode,
            offset,
        }
    }

    /// `len` bytes at `off` from the address the view was taken at.
    fn read(&self, off: u64, len: usize) -> Vec<u8> {
        read(self.region.base(), self.offset + off, len)
    }
}

impl Drop for View {
    fn drop(&mut self) {
        sys::unmap(&self.region).unwrap();
    }
}

/// A growable arena of `first` bytes (reservation `reserve`) grown by each of `growths`,
/// with chunk `i`'s first and last 64 bytes set to `i + 1` and `i + 101`.
fn grown(s: &SimBackend, first: u64, reserve: u64, growths: &[u64]) -> ArenaMem {
    let mut a = s.create_growable_arena(0, first, reserve).unwrap();
    for &extra in growths {
        a = s.grow_arena(&a, extra).unwrap();
    }
    for (i, (at, n)) in s.chunk_spans(&a).into_iter().enumerate() {
        write(a.base, at, &[i as u8 + 1; 64]);
        write(a.base, at + n - 64, &[i as u8 + 101; 64]);
    }
    a
}

/// Whether chunk `i` of a `grown` arena, `(at, n)` from `base`, still holds its pattern.
fn holds_pattern(base: u64, i: usize, at: u64, n: u64) -> bool {
    read(base, at, 64) == [i as u8 + 1; 64] && read(base, at + n - 64, 64) == [i as u8 + 101; 64]
}

#[test]
fn dropping_a_middle_chunk_leaves_the_kept_chunks_pages_where_they_are() {
    let s = sim();
    let tag = s.memfd_tag();
    let a = grown(&s, 4 * MIB, 16 * MIB, &[2 * MIB, 4 * MIB]);
    let spans = [(0, 4 * MIB), (4 * MIB, 2 * MIB), (6 * MIB, 4 * MIB)];
    assert_eq!(s.chunk_spans(&a), spans);
    // Second views of the pages behind the kept chunks, taken before the drop.
    let views = [View::of(a.base, &tag), View::of(a.base + 6 * MIB, &tag)];
    let dropped_inode = backing(a.base + 4 * MIB).unwrap().0;

    let parts = s.drop_chunks(&a, &[1]).unwrap();
    let got: Vec<(u64, u64, usize)> = parts.iter().map(|(p, n)| (p.base, p.bytes, *n)).collect();
    assert_eq!(got, [(a.base, 4 * MIB, 1), (a.base + 6 * MIB, 4 * MIB, 1)]);
    for i in [0, 2] {
        let (at, n) = spans[i];
        assert!(holds_pattern(a.base, i, at, n), "chunk {i} kept its bytes");
    }
    // The same pages: each kept address is still backed by the memfd (and offset) it was,
    // and a write through the arena's addresses after the drop shows in the views taken
    // before it (a copy mapped over them would leave the views on the old pages).
    for (view, at) in views.iter().zip([0, 6 * MIB]) {
        assert_eq!(
            backing(a.base + at),
            Some((view.inode, view.offset)),
            "the kept chunk at +{at:#x} is mapped from the same memfd"
        );
        write(a.base, at + 100, b"written after the drop");
        assert_eq!(view.read(100, 22), b"written after the drop");
    }
    assert_ne!(
        backing(a.base + 4 * MIB).map(|b| b.0),
        Some(dropped_inode),
        "the dropped chunk is unmapped"
    );
    assert!(s.destroy_arena(a).is_err(), "only the runs may be named");
    drop(views);
    destroy_and_assert_clean(&s, parts);
}

#[test]
fn dropping_chunks_frees_exactly_them_and_each_run_exports_one_fd_per_chunk() {
    let s = sim();
    let tag = s.memfd_tag();
    let a = grown(&s, 2 * MIB, 20 * MIB, &[2 * MIB, 2 * MIB, 4 * MIB]);
    let spans = s.chunk_spans(&a);
    assert_eq!(spans.len(), 4);
    assert_eq!(s.ledger(0).held_bytes, 10 * MIB);
    assert_eq!(
        (tagged_fds(&tag), tagged_maps(&tag)),
        (4, 4),
        "a memfd per chunk"
    );

    let parts = s.drop_chunks(&a, &[1]).unwrap();
    let ledger = s.ledger(0);
    assert_eq!(ledger.held_bytes, 8 * MIB, "exactly the dropped chunk went");
    assert_eq!(ledger.live_arenas, 2);
    assert_eq!((tagged_fds(&tag), tagged_maps(&tag)), (3, 3));
    let (run, n) = &parts[1];
    assert_eq!((run.base, run.bytes, *n), (a.base + 4 * MIB, 6 * MIB, 2));
    assert_eq!(s.chunk_spans(run), [(0, 2 * MIB), (2 * MIB, 4 * MIB)]);
    assert!(!s.can_grow(run, 2 * MIB), "a run cannot grow");

    // The run's export: one fd per kept chunk, each its own memfd of the chunk's length;
    // an in-process import sees the bytes and counts as a mapping of the run.
    let export = s.export(run).unwrap();
    let fds = export.chunk_fds(run.bytes);
    assert_eq!(
        fds.iter().map(|(n, _)| *n).collect::<Vec<_>>(),
        [2 * MIB, 4 * MIB]
    );
    let stats: Vec<_> = fds
        .iter()
        .map(|(_, fd)| rustix::fs::fstat(fd).unwrap())
        .collect();
    assert_ne!(stats[0].st_ino, stats[1].st_ino);
    assert_eq!((stats[0].st_size, stats[1].st_size), (2 << 20, 4 << 20));
    assert_eq!(s.ledger(0).open_exports, 2);
    let m = s.import(0, ImportSource::Chunks(&fds), run.bytes).unwrap();
    assert_eq!(s.ledger(0).own_mappings, 1);
    for (i, &(at, n)) in spans.iter().enumerate().skip(2) {
        assert!(
            holds_pattern(m.base, i, at - 4 * MIB, n),
            "chunk {i} imported"
        );
    }
    assert!(matches!(
        s.drop_chunks(run, &[0]),
        Err(Error::InvalidState(_))
    ));
    s.unmap_import(m).unwrap();
    // Closing it as the other run's export is refused: the fds are not that arena's.
    let other = &parts[0].0;
    assert!(is_invalid(s.close_export(other, export)));
    assert_eq!(
        s.ledger(0).open_exports,
        2,
        "kept by the sim, still counted"
    );
    assert_eq!(s.close_stranded_exports(), 2);
    assert_eq!(s.ledger(0).open_exports, 0);
    let export = s.export(run).unwrap();
    s.close_export(run, export).unwrap();

    destroy_and_assert_clean(&s, parts);
}

#[test]
fn a_failed_grow_or_drop_chunks_changes_nothing() {
    // 12 MiB of capacity: room for 10 MiB of arena, not 14.
    let s = sim_with(12 * MIB, false);
    let tag = s.memfd_tag();
    let a = grown(&s, 4 * MIB, 16 * MIB, &[2 * MIB]);
    let state = |a: &ArenaMem| {
        (
            s.ledger(0),
            s.chunk_spans(a),
            tagged_fds(&tag),
            tagged_maps(&tag),
        )
    };
    let before = state(&a);

    s.fail_nth(SimCall::CreateArena, 1);
    assert_eq!(
        s.grow_arena(&a, 2 * MIB),
        Err(injected(SimCall::CreateArena))
    );
    assert!(matches!(
        s.grow_arena(&a, 8 * MIB),
        Err(Error::DriverOutOfMemory { .. })
    ));
    assert!(
        is_invalid(s.grow_arena(&a, 12 * MIB)),
        "past the reservation"
    );
    assert_eq!(state(&a), before);

    s.fail_nth(SimCall::DropChunks, 1);
    assert_eq!(s.drop_chunks(&a, &[1]), Err(injected(SimCall::DropChunks)));
    let bad: [&[usize]; 4] = [&[], &[0, 1], &[2], &[1, 1]];
    for doomed in bad {
        assert!(is_invalid(s.drop_chunks(&a, doomed)), "{doomed:?}");
    }
    let export = s.export(&a).unwrap();
    assert!(matches!(
        s.drop_chunks(&a, &[1]),
        Err(Error::InvalidState(_))
    ));
    s.close_export(&a, export).unwrap();
    assert_eq!(state(&a), before);
    for (i, (at, n)) in s.chunk_spans(&a).into_iter().enumerate() {
        assert!(holds_pattern(a.base, i, at, n), "chunk {i} kept its bytes");
    }

    // Both still work afterwards.
    let a = s.grow_arena(&a, 4 * MIB).unwrap();
    assert_eq!(s.ledger(0).held_bytes, 10 * MIB);
    let parts = s.drop_chunks(&a, &[1]).unwrap();
    assert_eq!(s.ledger(0).held_bytes, 8 * MIB);
    assert!(holds_pattern(a.base, 0, 0, 4 * MIB));
    destroy_and_assert_clean(&s, parts);
}

#[test]
fn shrink_sleep_and_wake_keep_one_memfd_per_chunk() {
    let s = sim();
    let tag = s.memfd_tag();
    let a = grown(&s, 2 * MIB, 16 * MIB, &[2 * MIB, 4 * MIB]);
    assert_eq!(tagged_fds(&tag), 3);
    let inode_of_first = backing(a.base).unwrap().0;

    // A shrink closes the released chunks' memfds; the first stays as it was.
    let (a, released) = s.shrink_arena(&a, 2 * MIB).unwrap();
    assert_eq!((a.bytes, released), (2 * MIB, 2));
    assert_eq!(s.ledger(0).held_bytes, 2 * MIB);
    assert_eq!((tagged_fds(&tag), tagged_maps(&tag)), (1, 1));
    assert_eq!(backing(a.base).unwrap().0, inode_of_first);
    assert!(holds_pattern(a.base, 0, 0, 2 * MIB));
    let a = s.grow_arena(&a, 6 * MIB).unwrap();
    assert_eq!(tagged_fds(&tag), 2);

    // Sleep closes every chunk's memfd; a wake makes one memfd, one chunk, for all of it.
    s.release_physical(&a).unwrap();
    assert_eq!((tagged_fds(&tag), tagged_maps(&tag)), (0, 0));
    assert_eq!(s.ledger(0).sleeping_bytes, 8 * MIB);
    let a = s.restore_physical(&a).unwrap();
    assert_eq!((tagged_fds(&tag), tagged_maps(&tag)), (1, 1));
    assert_eq!(s.chunk_spans(&a), [(0, 8 * MIB)]);
    assert_eq!(s.ledger(0).held_bytes, 8 * MIB);
    let export = s.export(&a).unwrap();
    assert!(export.fd().is_some(), "one chunk: one fd");
    let m = s
        .import(0, ImportSource::Fd(export.fd().unwrap()), a.bytes)
        .unwrap();
    write(a.base, 6 * MIB, b"awake");
    assert_eq!(read(m.base, 6 * MIB, 5), b"awake");
    s.unmap_import(m).unwrap();
    s.close_export(&a, export).unwrap();
    // It grows again after the wake.
    let a = s.grow_arena(&a, 2 * MIB).unwrap();
    assert_eq!(s.chunk_spans(&a).len(), 2);
    destroy_and_assert_clean(&s, vec![(a, 1)]);
}
