//! The CUDA backend against a real driver.
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

use std::os::fd::AsFd;
use std::sync::{Mutex, MutexGuard};

use gpu_arena::backend::cuda::CudaBackend;
use gpu_arena::backend::{ArenaMem, Backend, Event, ImportSource, Mapping, StreamId};
use gpu_arena::Error;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
/// "Nothing held": free memory within this of the baseline (GPU.md).
const SLACK: u64 = 2 * MIB;

/// GPU tests compare free memory with a baseline: they run one at a time even without
/// `--test-threads=1`.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn backend() -> CudaBackend {
    CudaBackend::new().expect("needs a CUDA GPU: CudaBackend::new() failed")
}

fn free(b: &CudaBackend) -> u64 {
    b.mem_info(0).expect("mem_info").free
}

/// Free memory is back to `baseline` (within one granularity).
fn assert_back(b: &CudaBackend, baseline: u64, what: &str) {
    let now = free(b);
    assert!(
        now + SLACK >= baseline && now <= baseline + SLACK,
        "{what}: free {now} is not within {SLACK} bytes of the baseline {baseline}"
    );
}

/// At least `bytes` (less slack) are held compared with `baseline`.
fn assert_held(b: &CudaBackend, baseline: u64, bytes: u64, what: &str) {
    let now = free(b);
    assert!(
        now + bytes <= baseline + SLACK,
        "{what}: free {now} should be at least {bytes} bytes below the baseline {baseline}"
    );
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[test]
fn new_errors_instead_of_panicking_without_a_gpu() {
    match CudaBackend::new() {
        Ok(b) => {
            assert!(b.device_count().expect("device_count") > 0);
            assert!(CudaBackend::is_available());
            assert_eq!(b.name(), "cuda");
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
fn reports_driver_and_granularity() {
    let _serial = serial();
    let b = backend();
    let g = b.granularity(0).expect("granularity");
    let info = b.mem_info(0).expect("mem_info");
    eprintln!(
        "driver {}, {} device(s), granularity {g}, free {} / total {}",
        b.driver_version(),
        b.device_count().expect("device_count"),
        info.free,
        info.total
    );
    assert!(g > 0 && g.is_power_of_two());
    assert!(info.total > 0 && info.free <= info.total);
}

#[test]
#[ignore = "needs a CUDA GPU (run on the H200 with --ignored)"]
fn create_destroy_returns_memory() {
    let _serial = serial();
    let b = backend();
    let baseline = free(&b);
    let arena = b.create_arena(0, GIB).expect("create 1 GiB");
    assert_eq!((arena.device, arena.bytes), (0, GIB));
    assert_ne!(arena.base, 0);
    assert_held(&b, baseline, GIB, "after create");
    b.synchronize(0).expect("synchronize");
    b.destroy_arena(arena).expect("destroy");
    assert_back(&b, baseline, "after destroy");

    // Several sizes, one after the other.
    let g = b.granularity(0).expect("granularity");
    let arenas: Vec<ArenaMem> = [1, 2, 7, 64]
        .iter()
        .map(|&k| b.create_arena(0, k * g).expect("create"))
        .collect();
    for a in arenas {
        b.destroy_arena(a).expect("destroy");
    }
    assert_back(&b, baseline, "after several");
}

#[test]
#[ignore = "needs a CUDA GPU (run on the H200 with --ignored)"]
fn write_and_read_through_an_arena() {
    let _serial = serial();
    let b = backend();
    let g = b.granularity(0).expect("granularity");
    let arena = b.create_arena(0, 4 * g).expect("create");
    let data = pattern((4 * g) as usize, 7);
    b.memcpy_htod(arena.base, &data).expect("htod");
    let mut back = vec![0u8; data.len()];
    b.memcpy_dtoh(&mut back, arena.base).expect("dtoh");
    assert!(back == data, "read back differs from what was written");

    // A partial range at an offset, then a memset.
    let off = g + 12345;
    b.memset_d8(arena.base + off, 0xAB, 1000).expect("memset");
    let mut part = vec![0u8; 1002];
    b.memcpy_dtoh(&mut part, arena.base + off - 1)
        .expect("dtoh part");
    assert_eq!(part[0], data[(off - 1) as usize]);
    assert!(part[1..1001].iter().all(|&x| x == 0xAB));
    assert_eq!(part[1001], data[(off + 1000) as usize]);

    b.synchronize(0).expect("synchronize");
    b.destroy_arena(arena).expect("destroy");
}

#[test]
#[ignore = "needs a CUDA GPU (run on the H200 with --ignored)"]
fn open_export_holds_memory_after_destroy_until_closed() {
    let _serial = serial();
    let b = backend();
    let baseline = free(&b);
    let arena = b.create_arena(0, GIB).expect("create 1 GiB");
    let export = b.export(&arena).expect("export");
    assert!(export.fd().is_some());
    assert_eq!(export.kind, gpu_arena::backend::ExportKind::Releasable);
    let keep = arena.clone();
    b.synchronize(0).expect("synchronize");
    b.destroy_arena(arena).expect("destroy");
    assert_held(&b, baseline, GIB, "destroyed, export fd still open");
    b.close_export(&keep, export).expect("close export");
    assert_back(&b, baseline, "after closing the export fd");
}

#[test]
#[ignore = "needs a CUDA GPU (run on the H200 with --ignored)"]
fn in_process_import_sees_the_same_memory() {
    let _serial = serial();
    let b = backend();
    let baseline = free(&b);
    let g = b.granularity(0).expect("granularity");
    let bytes = 8 * g;
    let arena = b.create_arena(0, bytes).expect("create");
    let export = b.export(&arena).expect("export");
    let fd = export.fd().expect("fd export");
    let mapping = b.import(0, ImportSource::Fd(fd), bytes).expect("import");
    assert_eq!((mapping.device, mapping.bytes), (0, bytes));
    assert_ne!(
        mapping.base, arena.base,
        "an import gets its own address range"
    );

    // Through the arena, read through the mapping.
    let data = pattern(bytes as usize, 3);
    b.memcpy_htod(arena.base, &data).expect("htod arena");
    let mut back = vec![0u8; data.len()];
    b.memcpy_dtoh(&mut back, mapping.base)
        .expect("dtoh mapping");
    assert!(
        back == data,
        "the mapping does not see what the arena wrote"
    );

    // Through the mapping, read through the arena.
    b.memset_d8(mapping.base + g, 0x5A, g)
        .expect("memset mapping");
    let mut part = vec![0u8; g as usize];
    b.memcpy_dtoh(&mut part, arena.base + g)
        .expect("dtoh arena");
    assert!(
        part.iter().all(|&x| x == 0x5A),
        "the arena does not see what the mapping wrote"
    );

    b.synchronize(0).expect("synchronize");
    b.unmap_import(mapping).expect("unmap import");
    b.close_export(&arena, export).expect("close");
    b.destroy_arena(arena).expect("destroy");
    assert_back(&b, baseline, "after unmap, close and destroy");
}

#[test]
#[ignore = "needs a CUDA GPU (run on the H200 with --ignored)"]
fn importer_mapping_holds_memory_until_unmapped() {
    let _serial = serial();
    let b = backend();
    let baseline = free(&b);
    let arena = b.create_arena(0, GIB).expect("create 1 GiB");
    b.memset_d8(arena.base, 0x42, MIB).expect("memset");
    let export = b.export(&arena).expect("export");
    let mapping = b
        .import(0, ImportSource::Fd(export.fd().expect("fd")), GIB)
        .expect("import");
    let keep = arena.clone();
    b.synchronize(0).expect("synchronize");
    b.destroy_arena(arena).expect("destroy");
    b.close_export(&keep, export).expect("close");
    assert_held(&b, baseline, GIB, "exporter done, importer still mapped");

    // The mapping still reads the data.
    let mut part = vec![0u8; MIB as usize];
    b.memcpy_dtoh(&mut part, mapping.base)
        .expect("dtoh through the import");
    assert!(part.iter().all(|&x| x == 0x42));

    b.unmap_import(mapping).expect("unmap");
    assert_back(&b, baseline, "after the importer unmapped");
}

#[test]
#[ignore = "needs a CUDA GPU (run on the H200 with --ignored)"]
fn events_complete_after_synchronize() {
    let _serial = serial();
    let b = backend();
    let g = b.granularity(0).expect("granularity");
    let arena = b.create_arena(0, 64 * g).expect("create");
    // Some work on the default stream, then events on the legacy default stream (0), the
    // explicit legacy handle (1) and the per-thread default stream (2).
    b.memset_d8(arena.base, 1, 64 * g).expect("memset");
    let events: Vec<Event> = [0u64, 1, 2]
        .iter()
        .map(|&s| b.record_event(0, StreamId(s)).expect("record"))
        .collect();
    b.synchronize(0).expect("synchronize");
    for e in &events {
        assert!(
            b.event_done(e).expect("query"),
            "event not done after synchronize"
        );
    }
    for e in events {
        b.destroy_event(e).expect("destroy event");
    }
    b.destroy_arena(arena).expect("destroy");
}

#[test]
#[ignore = "needs a CUDA GPU (run on the H200 with --ignored)"]
fn no_context_left_current() {
    let _serial = serial();
    let b = backend();
    let before = b.current_context().expect("cuCtxGetCurrent");
    let same = |what: &str| {
        assert_eq!(
            b.current_context().expect("cuCtxGetCurrent"),
            before,
            "{what} changed the current context"
        );
    };
    let g = b.granularity(0).expect("granularity");
    same("granularity");
    b.mem_info(0).expect("mem_info");
    same("mem_info");
    let arena = b.create_arena(0, 2 * g).expect("create");
    same("create_arena");
    b.memset_d8(arena.base, 9, g).expect("memset");
    same("memset_d8");
    b.memcpy_htod(arena.base, &[1, 2, 3]).expect("htod");
    same("memcpy_htod");
    let mut x = [0u8; 3];
    b.memcpy_dtoh(&mut x, arena.base).expect("dtoh");
    same("memcpy_dtoh");
    assert_eq!(x, [1, 2, 3]);
    let export = b.export(&arena).expect("export");
    same("export");
    let mapping = b
        .import(0, ImportSource::Fd(export.fd().expect("fd")), 2 * g)
        .expect("import");
    same("import");
    let event = b.record_event(0, StreamId::DEFAULT).expect("record");
    same("record_event");
    b.synchronize(0).expect("synchronize");
    same("synchronize");
    assert!(b.event_done(&event).expect("query"));
    same("event_done");
    b.destroy_event(event).expect("destroy event");
    same("destroy_event");
    b.unmap_import(mapping).expect("unmap");
    same("unmap_import");
    b.close_export(&arena, export).expect("close");
    same("close_export");
    b.destroy_arena(arena).expect("destroy");
    same("destroy_arena");
    // Failing calls too.
    assert!(b.create_arena(0, g + 1).is_err());
    same("a failed create_arena");
    let not_cuda = std::fs::File::open("/dev/null").expect("/dev/null");
    assert!(b.import(0, ImportSource::Fd(not_cuda.as_fd()), g).is_err());
    same("a failed driver call (import of /dev/null)");
}

#[test]
#[ignore = "needs a CUDA GPU (run on the H200 with --ignored)"]
fn bad_inputs_are_errors() {
    let _serial = serial();
    let b = backend();
    let baseline = free(&b);
    let g = b.granularity(0).expect("granularity");
    let count = b.device_count().expect("count");

    for bytes in [0, 1, g + 1, g / 2] {
        match b.create_arena(0, bytes) {
            Err(Error::InvalidArgument(_)) => {}
            other => panic!("create_arena({bytes}) should be InvalidArgument, got {other:?}"),
        }
    }
    for device in [-1, count as i32, 1000] {
        match b.create_arena(device, g) {
            Err(Error::InvalidDevice {
                device: d,
                count: c,
            }) => assert_eq!((d, c), (device, count)),
            other => {
                panic!("create_arena on device {device} should be InvalidDevice, got {other:?}")
            }
        }
        assert!(matches!(
            b.mem_info(device),
            Err(Error::InvalidDevice { .. })
        ));
        assert!(matches!(
            b.synchronize(device),
            Err(Error::InvalidDevice { .. })
        ));
        assert!(matches!(
            b.record_event(device, StreamId::DEFAULT),
            Err(Error::InvalidDevice { .. })
        ));
    }

    // Destroy twice.
    let arena = b.create_arena(0, g).expect("create");
    let copy = arena.clone();
    b.destroy_arena(arena).expect("destroy");
    match b.destroy_arena(copy.clone()) {
        Err(Error::UnknownPointer { ptr, .. }) => assert_eq!(ptr, copy.base),
        other => panic!("second destroy should be UnknownPointer, got {other:?}"),
    }
    assert!(b.export(&copy).is_err(), "export of a destroyed arena");
    assert!(
        b.memcpy_htod(copy.base, &[1]).is_err(),
        "copy into a destroyed arena"
    );

    // A forged arena (wrong size) is refused and the real one survives.
    let arena = b.create_arena(0, 2 * g).expect("create");
    let mut forged = arena.clone();
    forged.bytes = g;
    assert!(matches!(
        b.destroy_arena(forged),
        Err(Error::InvalidArgument(_))
    ));
    // Copies past the end are refused.
    assert!(b.memcpy_htod(arena.base + 2 * g - 1, &[1, 2]).is_err());
    b.destroy_arena(arena).expect("destroy the real one");

    // Imports: legacy bytes, bad sizes, a file that is not a CUDA export, unmap twice.
    assert!(matches!(
        b.import(0, ImportSource::Bytes(&[0; 64]), g),
        Err(Error::InvalidArgument(_))
    ));
    let arena = b.create_arena(0, g).expect("create");
    let export = b.export(&arena).expect("export");
    assert!(matches!(
        b.import(0, ImportSource::Fd(export.fd().expect("fd")), g + 1),
        Err(Error::InvalidArgument(_))
    ));
    let mapping = b
        .import(0, ImportSource::Fd(export.fd().expect("fd")), g)
        .expect("import");
    let copy: Mapping = mapping.clone();
    b.unmap_import(mapping).expect("unmap");
    assert!(matches!(
        b.unmap_import(copy),
        Err(Error::UnknownPointer { .. })
    ));
    b.close_export(&arena, export).expect("close");
    b.destroy_arena(arena).expect("destroy");

    let not_cuda = std::fs::File::open("/dev/null").expect("/dev/null");
    match b.import(0, ImportSource::Fd(not_cuda.as_fd()), g) {
        Err(Error::Backend {
            backend,
            call,
            message,
        }) => {
            assert_eq!((backend, call), ("cuda", "cuMemImportFromShareableHandle"));
            assert!(
                message.starts_with("CUDA_ERROR_"),
                "message {message:?} should name the CUresult"
            );
            eprintln!(
                "importing /dev/null: {}",
                Error::Backend {
                    backend,
                    call,
                    message: message.clone()
                }
            );
        }
        other => panic!("importing /dev/null should be a Backend error, got {other:?}"),
    }

    // Events: destroy twice, query after destroy.
    let event = b.record_event(0, StreamId::DEFAULT).expect("record");
    let copy = event.clone();
    b.destroy_event(event).expect("destroy event");
    assert!(b.event_done(&copy).is_err());
    assert!(b.destroy_event(copy).is_err());

    assert_back(&b, baseline, "after the bad inputs");
}

#[test]
#[ignore = "needs a CUDA GPU (run on the H200 with --ignored)"]
fn too_large_an_arena_is_driver_out_of_memory() {
    let _serial = serial();
    let b = backend();
    let baseline = free(&b);
    let g = b.granularity(0).expect("granularity");
    let total = b.mem_info(0).expect("mem_info").total;
    let bytes = (total / g + 1) * g;
    match b.create_arena(0, bytes) {
        Err(Error::DriverOutOfMemory {
            backend,
            call,
            device,
            bytes: asked,
        }) => {
            assert_eq!(
                (backend, call, device, asked),
                ("cuda", "cuMemCreate", 0, bytes)
            );
        }
        other => panic!("create_arena({bytes}) should be DriverOutOfMemory, got {other:?}"),
    }
    assert_back(&b, baseline, "after the failed create");
}

#[test]
#[ignore = "needs a CUDA GPU (run on the H200 with --ignored)"]
fn two_backends_and_drop_clean_up() {
    let baseline = free(&backend());
    let _serial = serial();
    let b = backend();
    let c = backend();
    let g = b.granularity(0).expect("granularity");
    let left_behind = b.create_arena(0, 16 * g).expect("create");
    let _live_event = b.record_event(0, StreamId::DEFAULT).expect("record");
    let other = c.create_arena(0, g).expect("create on the second backend");
    // The second backend does not know the first one's arena.
    assert!(c.destroy_arena(left_behind).is_err());
    drop(b); // destroys what was left behind, releases its context retain
    c.destroy_arena(other).expect("destroy");
    assert_back(&c, baseline, "after dropping a backend with a live arena");
}

#[ignore = "needs a CUDA GPU (run on the H200 with --ignored)"]
#[test]
fn meets_the_backend_contract() {
    let _g = serial();
    let b = backend();
    let write = |dst: u64, src: &[u8]| b.memcpy_htod(dst, src).expect("htod");
    let read = |dst: &mut [u8], src: u64| b.memcpy_dtoh(dst, src).expect("dtoh");
    contract::Contract {
        backend: &b,
        device: 0,
        write: &write,
        read: &read,
    }
    .run_all();
}
