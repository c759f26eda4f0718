//! The CUDA backend against a real driver: the backend contract (tests/contract), whose
//! bodies sim runs in CI, here on a CUDA GPU.
//!
//! One test runs everywhere: without libcuda or a GPU, `CudaBackend::new()` returns an error
//! instead of panicking. Every other test needs a CUDA GPU and is ignored by default; run them
//! one at a time (they compare device free memory with a baseline):
//!
//! ```text
//! cargo test -p gpu-arena --test cuda_backend -- --ignored --test-threads=1
//! ./cuda_backend-<hash> --ignored --test-threads=1      # prebuilt binary on the GPU machine
//! ```
#![cfg(feature = "cuda")]

mod contract;

use std::sync::Arc;

use gpu_arena::backend::cuda::CudaBackend;
use gpu_arena::backend::vmm::FabricHandles;
use gpu_arena::backend::{Backend, ExportKind, ExportPayload, ImportSource};
use gpu_arena::Error;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

#[test]
fn new_errors_instead_of_panicking_without_a_gpu() {
    match CudaBackend::new() {
        Ok(b) => {
            assert!(b.device_count().expect("device_count") > 0);
            assert!(CudaBackend::is_available());
            assert_eq!(b.name(), "cuda");
            eprintln!("driver {}", b.driver_version());
        }
        Err(e) => {
            assert!(
                matches!(e, Error::Unavailable(_)),
                "expected Unavailable, got {e:?}"
            );
            assert!(!CudaBackend::is_available());
            eprintln!("no CUDA here, as expected on CI: {e}");
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU (run on the H200 with --ignored)"]
fn legacy_export_is_pinning_bytes() {
    let _serial = contract::serial();
    let b = CudaBackend::new()
        .expect("needs a CUDA GPU")
        .with_legacy_ipc(true);
    assert!(b.uses_legacy_ipc(0).expect("legacy?"));
    let g = b.granularity(0).expect("granularity");
    assert_eq!(g, 2 << 20);
    let arena = b.create_arena(0, 4 * g).expect("create (cuMemAlloc)");
    assert_eq!(arena.handle, 0);
    b.memcpy_htod(arena.base, &[7; 4096]).expect("write");
    let mut back = [0u8; 4096];
    b.memcpy_dtoh(&mut back, arena.base).expect("read");
    assert!(back.iter().all(|&x| x == 7));
    let export = b.export(&arena).expect("export (cuIpcGetMemHandle)");
    assert_eq!(export.kind, ExportKind::Pinning);
    match &export.payload {
        ExportPayload::Bytes(bytes) => assert_eq!(bytes.len(), 64),
        ExportPayload::Fd(_) | ExportPayload::Chunks(_) => {
            panic!("a legacy export should be bytes")
        }
    }
    // A handle of the wrong size is refused before the driver sees it.
    assert!(matches!(
        b.import(0, ImportSource::Bytes(&[0; 63]), 4 * g),
        Err(Error::InvalidArgument(_))
    ));
    // Legacy arenas cannot sleep: a clear error, the arena untouched.
    let e = b.release_physical(&arena).expect_err("legacy sleep");
    assert!(e.to_string().contains("cannot sleep"), "{e}");
    b.close_export(&arena, export).expect("close");
    b.synchronize(0).expect("synchronize");
    b.destroy_arena(arena).expect("destroy (cuMemFree)");
}

#[test]
#[ignore = "needs a CUDA GPU (run on the H200 with --ignored)"]
fn fabric_handles_1_creates_or_says_why_not() {
    let _serial = contract::serial();
    let b = CudaBackend::new()
        .expect("needs a CUDA GPU")
        .with_fabric_handles(FabricHandles::On);
    match b.granularity(0).and_then(|g| b.create_arena(0, g)) {
        Ok(arena) => {
            eprintln!("FABRIC handles permitted here");
            b.destroy_arena(arena).expect("destroy");
        }
        Err(e) => {
            let why = e.to_string();
            assert!(
                why.contains("FABRIC")
                    || why.contains("NOT_PERMITTED")
                    || why.contains("NOT_SUPPORTED"),
                "{why}"
            );
            eprintln!("FABRIC handles not available here: {why}");
            // auto falls back and creates.
            let b = CudaBackend::new().expect("new");
            let g = b.granularity(0).expect("granularity");
            let arena = b.create_arena(0, g).expect("auto falls back to POSIX fds");
            b.destroy_arena(arena).expect("destroy");
        }
    }
}

/// Free bytes on device 0.
fn free(b: &CudaBackend) -> u64 {
    b.mem_info(0).expect("mem_info").free
}

/// `got` is within `slack` bytes of `expect`.
fn assert_near(got: u64, expect: u64, slack: u64, what: &str) {
    assert!(
        got + slack >= expect && got <= expect + slack,
        "{what}: {got} bytes, expected {expect} within {slack}"
    );
}

/// Trim on a real driver: a 1 GiB arena split into three 2 MiB windows far apart keeps their
/// bytes at the same addresses and gives the rest back (cuMemcpyDtoD through a temporary
/// mapping, then the windows remapped); a window exports, imports, sleeps and wakes like an
/// arena; destroying the windows gives everything back (the reservation with the last).
#[test]
#[ignore = "needs a CUDA GPU (run on the H200 with --ignored)"]
fn split_arena_keeps_three_windows_and_gives_the_rest_back() {
    let _serial = contract::serial();
    let b = CudaBackend::new().expect("needs a CUDA GPU");
    let g = b.granularity(0).expect("granularity");
    let page = (2 * MIB).max(g);
    let slack = 2 * g;
    let baseline = free(&b);
    let arena = b.create_arena(0, GIB).expect("create 1 GiB");
    let offsets = [3 * page, GIB / 2, GIB - page];
    let pattern = |i: usize| -> Vec<u8> {
        (0..page as usize)
            .map(|j| (j as u8).wrapping_mul(31).wrapping_add(0x40 + i as u8))
            .collect()
    };
    for (i, &offset) in offsets.iter().enumerate() {
        b.copy_from_host(0, arena.base + offset, &pattern(i))
            .expect("write a page");
    }
    b.synchronize(0).expect("synchronize");
    let before = free(&b);

    let windows: Vec<(u64, u64)> = offsets.iter().map(|&o| (o, page)).collect();
    let split = b.split_arena(&arena, &windows).expect("split_arena");
    let after = free(&b);
    eprintln!(
        "split: free {before} -> {after} (+{} MiB)",
        after.saturating_sub(before) / MIB
    );
    assert_near(
        after.saturating_sub(before),
        GIB - 3 * page,
        slack,
        "freed by the split",
    );
    assert_eq!(split.len(), 3);
    for (i, (w, &offset)) in split.iter().zip(&offsets).enumerate() {
        assert_eq!((w.device, w.base, w.bytes), (0, arena.base + offset, page));
        let mut back = vec![0u8; page as usize];
        b.copy_to_host(0, w.base, &mut back).expect("read a window");
        assert!(back == pattern(i), "window {i} lost its contents");
    }
    // Between the windows nothing is mapped any more.
    let mut gap = [0u8; 64];
    assert!(matches!(
        b.copy_to_host(0, arena.base, &mut gap),
        Err(Error::UnknownPointer { .. })
    ));

    // Export a window and import it: the import sees its bytes.
    let export = b.export(&split[1]).expect("export a window");
    let fd = export.fd().expect("an fd export");
    let mapping = b
        .import(0, ImportSource::Fd(fd), page)
        .expect("import the window");
    let mut back = vec![0u8; page as usize];
    b.copy_to_host(0, mapping.base, &mut back)
        .expect("read the import");
    assert!(back == pattern(1), "the import does not see the window");
    b.synchronize(0).expect("synchronize");
    b.unmap_import(mapping).expect("unmap the import");
    b.close_export(&split[1], export).expect("close the export");

    // Sleep and wake a window at the same addresses.
    let held = free(&b);
    b.release_physical(&split[2]).expect("sleep a window");
    assert_near(
        free(&b).saturating_sub(held),
        page,
        slack,
        "freed by the sleep",
    );
    let woken = b.restore_physical(&split[2]).expect("wake a window");
    assert_eq!((woken.base, woken.bytes), (split[2].base, page));
    b.copy_from_host(0, woken.base, &pattern(7))
        .expect("write the woken window");
    b.copy_to_host(0, woken.base, &mut back)
        .expect("read the woken window");
    assert!(back == pattern(7));

    let mut split = split;
    split[2] = woken;
    b.synchronize(0).expect("synchronize");
    for w in split {
        b.destroy_arena(w).expect("destroy a window");
    }
    assert_near(
        free(&b),
        baseline,
        slack,
        "free after the windows were destroyed",
    );
}

/// A growable arena on a real driver: it grows in place by two chunks (each a physical
/// allocation mapped right after the arena), a range across the chunks keeps its bytes, the
/// export is one fd per chunk and an import maps them back to back (seeing the bytes), the
/// arena sleeps and wakes as one allocation, and destroying it gives everything back.
#[test]
#[ignore = "needs a CUDA GPU (run on the H200 with --ignored)"]
fn growable_arena_grows_exports_its_chunks_shrinks_and_gives_everything_back() {
    let _serial = contract::serial();
    let b = CudaBackend::new().expect("needs a CUDA GPU");
    let g = b.granularity(0).expect("granularity");
    let slack = 2 * g;
    let baseline = free(&b);
    let arena = b
        .create_growable_arena(0, 8 * g, 64 * GIB)
        .expect("create growable");
    assert!(b.can_grow(&arena, 4 * g));
    let grown = b.grow_arena(&arena, 4 * g).expect("grow once");
    let grown = b.grow_arena(&grown, 20 * g).expect("grow twice");
    assert_eq!((grown.base, grown.bytes), (arena.base, 32 * g));
    assert_near(
        baseline.saturating_sub(free(&b)),
        32 * g,
        slack,
        "held after growth",
    );
    // A range across all three chunks.
    let at = arena.base + 6 * g;
    let pattern: Vec<u8> = (0..(8 * g) as usize)
        .map(|j| (j as u8).wrapping_mul(13).wrapping_add(5))
        .collect();
    b.copy_from_host(0, at, &pattern)
        .expect("write across chunks");
    let mut back = vec![0u8; pattern.len()];
    b.copy_to_host(0, at, &mut back)
        .expect("read across chunks");
    assert!(back == pattern);
    // Export: one fd per chunk; an import maps them back to back.
    let export = b.export(&grown).expect("export");
    let chunks = export.chunk_fds(grown.bytes);
    let lens: Vec<u64> = chunks.iter().map(|(n, _)| *n).collect();
    assert_eq!(lens, [8 * g, 4 * g, 20 * g]);
    let mapping = b
        .import(0, ImportSource::Chunks(&chunks), grown.bytes)
        .expect("import the chunks");
    let mut seen = vec![0u8; pattern.len()];
    b.copy_to_host(0, mapping.base + 6 * g, &mut seen)
        .expect("read the import");
    assert!(seen == pattern, "the import does not see the arena's bytes");
    b.synchronize(0).expect("synchronize");
    b.unmap_import(mapping).expect("unmap the import");
    drop(chunks);
    b.close_export(&grown, export).expect("close the export");
    // Shrink (empty_cache's free tail): the chunk starting at 12 g goes, the bytes before
    // it stay.
    let held = free(&b);
    let (shrunk, released) = b.shrink_arena(&grown, 10 * g).expect("shrink");
    assert_eq!(
        (shrunk.base, shrunk.bytes, released),
        (arena.base, 12 * g, 1)
    );
    assert_near(
        free(&b).saturating_sub(held),
        20 * g,
        slack,
        "freed by the shrink",
    );
    let mut kept = vec![0u8; (6 * g) as usize];
    b.copy_to_host(0, at, &mut kept)
        .expect("read what the shrink kept");
    assert!(kept[..] == pattern[..kept.len()]);
    // Sleep and wake: one allocation again.
    let held = free(&b);
    b.release_physical(&shrunk).expect("sleep");
    assert_near(
        free(&b).saturating_sub(held),
        12 * g,
        slack,
        "freed by the sleep",
    );
    let woken = b.restore_physical(&shrunk).expect("wake");
    let export = b.export(&woken).expect("export after the wake");
    assert_eq!(
        export.chunk_fds(woken.bytes).len(),
        1,
        "woken as one allocation"
    );
    b.close_export(&woken, export).expect("close");
    assert!(b.can_grow(&woken, g), "a woken arena can grow again");
    b.synchronize(0).expect("synchronize");
    b.destroy_arena(woken).expect("destroy");
    assert_near(free(&b), baseline, slack, "free after destroy");
}

/// Trim of a grown arena on the GPU: windows across its chunk boundaries keep their bytes at
/// their addresses (the copy out reads across chunks), every chunk goes back, and the
/// windows' teardown frees the reservation.
#[test]
#[ignore = "needs a CUDA GPU (run on the H200 with --ignored)"]
fn grown_arena_splits_across_its_chunks_and_gives_the_rest_back() {
    let _serial = contract::serial();
    let b = CudaBackend::new().expect("needs a CUDA GPU");
    let g = b.granularity(0).expect("granularity");
    let slack = 2 * g;
    let baseline = free(&b);
    let arena = b
        .create_growable_arena(0, 8 * g, 64 * GIB)
        .expect("create growable");
    let grown = b.grow_arena(&arena, 4 * g).expect("grow once");
    let grown = b.grow_arena(&grown, 20 * g).expect("grow twice");
    // Chunks [0, 8 g), [8 g, 12 g), [12 g, 32 g); windows [6 g, 14 g) (across both
    // boundaries) and [20 g, 22 g).
    let windows = [(6 * g, 8 * g), (20 * g, 2 * g)];
    let patterns: Vec<Vec<u8>> = windows
        .iter()
        .enumerate()
        .map(|(i, &(_, len))| {
            (0..len as usize)
                .map(|j| (j as u8).wrapping_mul(31).wrapping_add(i as u8 * 7 + 1))
                .collect()
        })
        .collect();
    for (&(off, _), p) in windows.iter().zip(&patterns) {
        b.copy_from_host(0, grown.base + off, p).expect("write");
    }
    assert!(b.can_split(&grown));
    b.synchronize(0).expect("synchronize");
    let held = free(&b);
    let parts = b
        .split_arena(&grown, &windows)
        .expect("split a grown arena");
    assert_eq!(parts.len(), 2);
    assert_near(
        free(&b).saturating_sub(held),
        22 * g,
        slack,
        "freed by the split",
    );
    for ((part, &(off, len)), p) in parts.iter().zip(&windows).zip(&patterns) {
        assert_eq!((part.base, part.bytes), (grown.base + off, len));
        let mut back = vec![0u8; len as usize];
        b.copy_to_host(0, part.base, &mut back)
            .expect("read a window");
        assert!(back == *p, "window at {off:#x} lost its bytes");
    }
    b.synchronize(0).expect("synchronize");
    for part in parts {
        b.destroy_arena(part).expect("destroy a window");
    }
    assert_near(free(&b), baseline, slack, "free after the windows");
}

/// `empty_cache` of a pool with growing arenas gives back the free chunks between live
/// blocks without moving them: seven 16 MiB blocks (one chunk each), two kept, the driver's
/// free memory up by the other five and the survivors' bytes where they were.
#[test]
#[ignore = "needs a CUDA GPU (run on the H200 with --ignored)"]
fn empty_cache_gives_back_the_free_chunks_between_survivors() {
    let _serial = contract::serial();
    let b = Arc::new(CudaBackend::new().expect("needs a CUDA GPU"));
    let g = b.granularity(0).expect("granularity");
    let baseline = free(&b);
    let config = gpu_arena::PoolConfig {
        grow_arenas: true,
        validate: true,
        ..gpu_arena::PoolConfig::default()
    };
    let pool = gpu_arena::Pool::new(b.clone(), config).expect("pool");
    let stream = gpu_arena::StreamId(0);
    let mib16 = 16 << 20;
    let blocks: Vec<_> = (0..7)
        .map(|_| pool.alloc(0, mib16, stream).expect("alloc"))
        .collect();
    let keep = [1usize, 5];
    let pattern = |i: usize| -> Vec<u8> {
        (0..mib16 as usize)
            .map(|j| (j as u8).wrapping_mul(13).wrapping_add(i as u8))
            .collect()
    };
    for (i, a) in blocks.iter().enumerate() {
        if keep.contains(&i) {
            b.copy_from_host(0, a.ptr, &pattern(i)).expect("write");
        } else {
            pool.free(a.ptr).expect("free");
        }
    }
    b.synchronize(0).expect("synchronize");
    let held = free(&b);
    let released = pool.empty_cache(None).expect("empty_cache");
    assert_eq!(released, 5 * mib16, "the five free chunks");
    assert_near(
        free(&b).saturating_sub(held),
        5 * mib16,
        2 * g,
        "freed by empty_cache",
    );
    let s = pool.stats(0).expect("stats");
    assert_eq!((s.reserved_bytes, s.arenas), (2 * mib16, 2), "{s:?}");
    for &i in &keep {
        let mut back = vec![0u8; mib16 as usize];
        b.copy_to_host(0, blocks[i].ptr, &mut back).expect("read");
        assert!(back == pattern(i), "survivor {i} lost its bytes");
    }
    pool.validate(0).expect("validate");
    for &i in &keep {
        pool.free(blocks[i].ptr).expect("free a survivor");
    }
    pool.empty_cache(None).expect("empty_cache");
    drop(pool);
    assert_near(free(&b), baseline, 2 * g, "free after the pool");
}

contract::backend_contract_tests!(
    CudaBackend,
    #[ignore = "needs a CUDA GPU (run on the H200 with --ignored)"]
);
