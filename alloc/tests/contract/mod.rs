//! The backend contract: what every [`Backend`] must do, written once and run against each.
//!
//! Each entry file (`sim_contract.rs`, `cuda_backend.rs`, `hip_backend.rs`) implements
//! [`Subject`] for its backend and expands [`backend_contract_tests!`], which makes one
//! `#[test]` per body below (`#[ignore]`d where the backend needs a GPU). Sim runs in CI; cuda
//! runs on the H200 (`scripts/gpu-check.sh` step `backend`); hip on an AMD GPU. Memory is
//! checked through the backend's own copy functions, and "held" through `mem_info`, within
//! one granule (GPU.md: "nothing held"). What differs between backends (driver call names,
//! special streams) is in [`Facts`], one table for all of them.
#![allow(dead_code)]

use std::os::fd::AsFd;
use std::sync::{Mutex, MutexGuard};

use gpu_arena::backend::vmm::{Driver, VmmBackend};
use gpu_arena::backend::{ArenaMem, Backend, DeviceId, Event, ExportKind, ImportSource, Mapping};
use gpu_arena::{Error, StreamId};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// A backend under test and how to reach its memory from the host.
pub trait Subject: Backend + Sized {
    /// A fresh backend (panics with the reason when there is none).
    fn open() -> Self;
    /// Host -> device copy, checked by the backend where it checks (sim does not).
    fn write(&self, dst: u64, src: &[u8]) -> gpu_arena::Result<()>;
    /// Device -> host copy.
    fn read(&self, dst: &mut [u8], src: u64) -> gpu_arena::Result<()>;
    /// Set `bytes` bytes at `dst` to `value` (on the default stream).
    fn fill(&self, dst: u64, value: u8, bytes: u64) -> gpu_arena::Result<()>;
    /// The calling thread's current context or device, where the backend has one.
    fn current_on_thread(&self) -> Option<u64>;
    /// Whether device 0's arenas use a legacy IPC path (byte exports).
    fn legacy_ipc(&self) -> bool;
    /// Check that the backend holds nothing any more, where it can tell (sim's ledger).
    fn assert_clean(&self) {}
}

impl<D: Driver> Subject for VmmBackend<D> {
    fn open() -> Self {
        VmmBackend::new().expect("needs a GPU of this backend: new() failed")
    }
    fn write(&self, dst: u64, src: &[u8]) -> gpu_arena::Result<()> {
        self.memcpy_htod(dst, src)
    }
    fn read(&self, dst: &mut [u8], src: u64) -> gpu_arena::Result<()> {
        self.memcpy_dtoh(dst, src)
    }
    fn fill(&self, dst: u64, value: u8, bytes: u64) -> gpu_arena::Result<()> {
        self.memset_d8(dst, value, bytes)
    }
    fn current_on_thread(&self) -> Option<u64> {
        Some(VmmBackend::current_on_thread(self).expect("current context/device"))
    }
    fn legacy_ipc(&self) -> bool {
        self.uses_legacy_ipc(0).expect("legacy?")
    }
}

/// What differs between backends, by [`Backend::name`].
pub struct Facts {
    /// Streams to record events on: the default stream and the backend's special handles.
    pub streams: &'static [u64],
    /// The call that creates an arena's memory (in `DriverOutOfMemory`).
    pub create_call: &'static str,
    /// Importing a file that is no export: the failing call and how its message starts.
    pub bad_import: Option<(&'static str, &'static str)>,
    /// Whether copies are range-checked (sim's test copies are plain host memcpys).
    pub checked_copies: bool,
    /// Whether stale or forged records get the VMM core's error kinds: `UnknownPointer` for
    /// an address it does not know, `InvalidArgument` for a record that does not match (sim
    /// answers `InvalidArgument` for both).
    pub registry_errors: bool,
    /// Whether importing 64 bytes of zeros is refused as an invalid argument (the backend has
    /// no byte-handle imports) rather than handed to the driver.
    pub refuses_byte_imports: bool,
}

/// The facts of backend `name`.
pub fn facts(name: &str) -> Facts {
    match name {
        "cuda" => Facts {
            // The legacy default stream (0), CU_STREAM_LEGACY (1), CU_STREAM_PER_THREAD (2).
            streams: &[0, 1, 2],
            create_call: "cuMemCreate",
            bad_import: Some(("cuMemImportFromShareableHandle", "CUDA_ERROR_")),
            checked_copies: true,
            registry_errors: true,
            // CUDA has the legacy cuIpc path: 64 bytes go to cuIpcOpenMemHandle.
            refuses_byte_imports: false,
        },
        "hip" => Facts {
            // The null stream (0) and hipStreamPerThread (2).
            streams: &[0, 2],
            create_call: "hipMemCreate",
            bad_import: Some(("hipMemImportFromShareableHandle", "hipError")),
            checked_copies: true,
            registry_errors: true,
            refuses_byte_imports: false,
        },
        _ => Facts {
            streams: &[0, 1, 2],
            create_call: "create_arena",
            bad_import: None,
            checked_copies: false,
            registry_errors: false,
            refuses_byte_imports: true,
        },
    }
}

/// GPU tests compare free memory with a baseline: they run one at a time even without
/// `--test-threads=1`.
static SERIAL: Mutex<()> = Mutex::new(());

pub fn serial() -> MutexGuard<'static, ()> {
    SERIAL
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn free(b: &impl Backend) -> u64 {
    b.mem_info(0).expect("mem_info").free
}

fn granule(b: &impl Backend) -> u64 {
    b.granularity(0).expect("granularity")
}

/// Free memory is back to `baseline` (within one granularity), and the backend holds nothing
/// where it can tell.
fn assert_back<B: Subject>(b: &B, baseline: u64, what: &str) {
    b.assert_clean();
    let (now, slack) = (free(b), granule(b));
    assert!(
        now + slack >= baseline && now <= baseline + slack,
        "{what}: free {now} is not within {slack} bytes of the baseline {baseline}"
    );
}

/// At least `bytes` (less one granule) are held compared with `baseline`.
fn assert_held(b: &impl Backend, baseline: u64, bytes: u64, what: &str) {
    let (now, slack) = (free(b), granule(b));
    assert!(
        now + bytes <= baseline + slack,
        "{what}: free {now} should be at least {bytes} bytes below the baseline {baseline}"
    );
}

/// One `#[test]` per contract body for backend type `$backend`, each with the attributes
/// given (`#[ignore = "..."]` for GPU backends), on a fresh backend, one test at a time.
macro_rules! backend_contract_tests {
    ($backend:ty $(, #[$attr:meta])*) => {
        $crate::contract::backend_contract_tests!(@each $backend, [$(#[$attr])*],
            reports_driver_and_granularity,
            create_destroy_returns_memory,
            write_and_read_through_an_arena,
            open_export_holds_memory_after_destroy_until_closed,
            in_process_import_sees_the_same_memory,
            copies_on_a_transfer_stream_between_an_arena_and_an_import,
            importer_mapping_holds_memory_until_unmapped,
            events_complete_after_synchronize,
            caller_context_or_device_left_unchanged,
            bad_inputs_are_errors,
            too_large_an_arena_is_driver_out_of_memory,
            two_backends_and_drop_clean_up,
            meets_the_backend_contract);
    };
    (@each $backend:ty, $attrs:tt, $($name:ident),*) => {
        $($crate::contract::backend_contract_tests!(@one $backend, $attrs, $name);)*
    };
    (@one $backend:ty, [$(#[$attr:meta])*], $name:ident) => {
        #[test]
        $(#[$attr])*
        fn $name() {
            let _serial = $crate::contract::serial();
            $crate::contract::$name(&<$backend as $crate::contract::Subject>::open());
        }
    };
}
pub(crate) use backend_contract_tests;

/// Granularity and memory info are sane.
pub fn reports_driver_and_granularity<B: Subject>(b: &B) {
    let g = granule(b);
    let info = b.mem_info(0).expect("mem_info");
    eprintln!(
        "{}: {} device(s), granularity {g}, legacy IPC {}, free {} / total {}",
        b.name(),
        b.device_count().expect("device_count"),
        b.legacy_ipc(),
        info.free,
        info.total
    );
    assert!(g > 0 && g.is_power_of_two());
    assert!(info.total > 0 && info.free <= info.total);
}

/// A 1 GiB arena holds its memory until destroyed; so do several sizes one after the other.
pub fn create_destroy_returns_memory<B: Subject>(b: &B) {
    let baseline = free(b);
    let arena = b.create_arena(0, GIB).expect("create 1 GiB");
    assert_eq!((arena.device, arena.bytes), (0, GIB));
    assert_ne!(arena.base, 0);
    assert_held(b, baseline, GIB, "after create");
    b.synchronize(0).expect("synchronize");
    b.destroy_arena(arena).expect("destroy");
    assert_back(b, baseline, "after destroy");

    let g = granule(b);
    let arenas: Vec<ArenaMem> = [1, 2, 7, 64]
        .iter()
        .map(|&k| b.create_arena(0, k * g).expect("create"))
        .collect();
    for a in arenas {
        b.destroy_arena(a).expect("destroy");
    }
    assert_back(b, baseline, "after several");
}

/// Bytes written read back, at offsets too, and a memset lands exactly where asked.
pub fn write_and_read_through_an_arena<B: Subject>(b: &B) {
    let g = granule(b);
    let arena = b.create_arena(0, 4 * g).expect("create");
    let data = pattern((4 * g) as usize, 7);
    b.write(arena.base, &data).expect("htod");
    let mut back = vec![0u8; data.len()];
    b.read(&mut back, arena.base).expect("dtoh");
    assert!(back == data, "read back differs from what was written");

    // A partial range at an offset, then a memset.
    let off = g + 12345;
    b.fill(arena.base + off, 0xAB, 1000).expect("memset");
    let mut part = vec![0u8; 1002];
    b.read(&mut part, arena.base + off - 1).expect("dtoh part");
    assert_eq!(part[0], data[(off - 1) as usize]);
    assert!(part[1..1001].iter().all(|&x| x == 0xAB));
    assert_eq!(part[1001], data[(off + 1000) as usize]);

    b.synchronize(0).expect("synchronize");
    b.destroy_arena(arena).expect("destroy");
    b.assert_clean();
}

/// An export fd left open keeps 1 GiB after destroy; closing it releases it.
pub fn open_export_holds_memory_after_destroy_until_closed<B: Subject>(b: &B) {
    let baseline = free(b);
    let arena = b.create_arena(0, GIB).expect("create 1 GiB");
    let export = b.export(&arena).expect("export");
    assert!(export.fd().is_some());
    assert_eq!(export.kind, ExportKind::Releasable);
    let keep = arena.clone();
    b.synchronize(0).expect("synchronize");
    b.destroy_arena(arena).expect("destroy");
    assert_held(b, baseline, GIB, "destroyed, export fd still open");
    b.close_export(&keep, export).expect("close export");
    assert_back(b, baseline, "after closing the export fd");
}

/// Importing one's own export maps the same memory at another address, both ways.
pub fn in_process_import_sees_the_same_memory<B: Subject>(b: &B) {
    let baseline = free(b);
    let g = granule(b);
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
    b.write(arena.base, &data).expect("htod arena");
    let mut back = vec![0u8; data.len()];
    b.read(&mut back, mapping.base).expect("dtoh mapping");
    assert!(
        back == data,
        "the mapping does not see what the arena wrote"
    );

    // Through the mapping, read through the arena.
    b.fill(mapping.base + g, 0x5A, g).expect("memset mapping");
    let mut part = vec![0u8; g as usize];
    b.read(&mut part, arena.base + g).expect("dtoh arena");
    assert!(
        part.iter().all(|&x| x == 0x5A),
        "the arena does not see what the mapping wrote"
    );

    b.synchronize(0).expect("synchronize");
    b.unmap_import(mapping).expect("unmap import");
    b.close_export(&arena, export).expect("close");
    b.destroy_arena(arena).expect("destroy");
    assert_back(b, baseline, "after unmap, close and destroy");
}

/// A transfer stream's copies move bytes between an arena and an import of another arena
/// (both directions, many queued), complete by an event, and ranges outside any live arena
/// or mapping are refused with nothing queued.
pub fn copies_on_a_transfer_stream_between_an_arena_and_an_import<B: Subject>(b: &B) {
    let baseline = free(b);
    let g = granule(b);
    let bytes = 8 * g;
    let (src, dst) = (
        b.create_arena(0, bytes).expect("create"),
        b.create_arena(0, bytes).expect("create"),
    );
    let export = b.export(&src).expect("export");
    let mapping = b
        .import(0, ImportSource::Fd(export.fd().expect("fd export")), bytes)
        .expect("import");
    let data = pattern(bytes as usize, 9);
    b.write(src.base, &data).expect("htod");
    b.synchronize(0).expect("synchronize");
    let stream = b.create_stream(0).expect("create_stream");
    // READ: the import into the local arena, in 8 copies on the stream.
    for i in 0..8 {
        b.copy_async(0, stream, dst.base + i * g, mapping.base + i * g, g)
            .expect("copy_async");
    }
    let event = b.record_event(0, stream).expect("event");
    while !b.event_done(&event).expect("event_done") {
        std::thread::yield_now();
    }
    b.destroy_event(event).expect("destroy_event");
    let mut back = vec![0u8; data.len()];
    b.read(&mut back, dst.base).expect("dtoh");
    assert!(back == data, "the copies did not move the import's bytes");
    // WRITE: the local arena into the import: the owner sees it.
    b.fill(dst.base, 0x3C, g).expect("memset");
    b.synchronize(0).expect("synchronize");
    b.copy_async(0, stream, mapping.base, dst.base, g)
        .expect("copy_async back");
    b.synchronize(0).expect("synchronize");
    let mut part = vec![0u8; g as usize];
    b.read(&mut part, src.base).expect("dtoh owner");
    assert!(
        part.iter().all(|&x| x == 0x3C),
        "the owner does not see the write"
    );
    // Outside any live range, overlapping, or an unknown stream: refused.
    let host = [0u8; 64];
    for (dst_addr, src_addr) in [
        (host.as_ptr() as u64, src.base),
        (dst.base, host.as_ptr() as u64),
    ] {
        assert!(matches!(
            b.copy_async(0, stream, dst_addr, src_addr, 64),
            Err(Error::UnknownPointer { .. })
        ));
    }
    assert!(
        b.copy_async(0, stream, dst.base + bytes - 32, dst.base, 64)
            .is_err(),
        "past the end"
    );
    assert!(
        b.copy_async(0, stream, dst.base + 16, dst.base, 64)
            .is_err(),
        "overlapping"
    );
    assert!(b
        .copy_async(0, gpu_arena::StreamId(12345), dst.base, src.base, 64)
        .is_err());
    b.destroy_stream(0, stream).expect("destroy_stream");
    assert!(b.destroy_stream(0, stream).is_err(), "destroyed twice");
    b.synchronize(0).expect("synchronize");
    b.unmap_import(mapping).expect("unmap");
    b.close_export(&src, export).expect("close");
    b.destroy_arena(src).expect("destroy");
    b.destroy_arena(dst).expect("destroy");
    assert_back(b, baseline, "after the transfer test");
}

/// The importer's mapping holds 1 GiB after the owner destroyed and closed, until unmapped.
pub fn importer_mapping_holds_memory_until_unmapped<B: Subject>(b: &B) {
    let baseline = free(b);
    let arena = b.create_arena(0, GIB).expect("create 1 GiB");
    b.fill(arena.base, 0x42, MIB).expect("memset");
    let export = b.export(&arena).expect("export");
    let mapping = b
        .import(0, ImportSource::Fd(export.fd().expect("fd")), GIB)
        .expect("import");
    let keep = arena.clone();
    b.synchronize(0).expect("synchronize");
    b.destroy_arena(arena).expect("destroy");
    b.close_export(&keep, export).expect("close");
    assert_held(b, baseline, GIB, "exporter done, importer still mapped");

    // The mapping still reads the data.
    let mut part = vec![0u8; MIB as usize];
    b.read(&mut part, mapping.base)
        .expect("dtoh through the import");
    assert!(part.iter().all(|&x| x == 0x42));

    b.unmap_import(mapping).expect("unmap");
    assert_back(b, baseline, "after the importer unmapped");
}

/// Events on the default stream and the backend's special streams are done after a
/// synchronize.
pub fn events_complete_after_synchronize<B: Subject>(b: &B) {
    let g = granule(b);
    let arena = b.create_arena(0, 64 * g).expect("create");
    b.fill(arena.base, 1, 64 * g).expect("memset");
    let events: Vec<Event> = facts(b.name())
        .streams
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
    b.assert_clean();
}

/// No call, failed ones included, changes the calling thread's current context (CUDA) or
/// device (HIP); on the last device too, which the backend must make current and undo.
pub fn caller_context_or_device_left_unchanged<B: Subject>(b: &B) {
    let Some(before) = b.current_on_thread() else {
        return; // sim has no current context or device
    };
    let same = |what: &str| {
        assert_eq!(
            b.current_on_thread(),
            Some(before),
            "{what} changed the current context/device"
        );
    };
    let g = b.granularity(0).expect("granularity");
    same("granularity");
    b.mem_info(0).expect("mem_info");
    same("mem_info");
    let arena = b.create_arena(0, 2 * g).expect("create");
    same("create_arena");
    b.fill(arena.base, 9, g).expect("memset");
    same("memset_d8");
    b.write(arena.base, &[1, 2, 3]).expect("htod");
    same("memcpy_htod");
    let mut x = [0u8; 3];
    b.read(&mut x, arena.base).expect("dtoh");
    same("memcpy_dtoh");
    assert_eq!(x, [1, 2, 3]);
    let export = b.export(&arena).expect("export");
    same("export");
    let fd = export.fd();
    let mapping = fd.map(|fd| b.import(0, ImportSource::Fd(fd), 2 * g).expect("import"));
    same("import");
    let event = b.record_event(0, StreamId::DEFAULT).expect("record");
    same("record_event");
    b.synchronize(0).expect("synchronize");
    same("synchronize");
    assert!(b.event_done(&event).expect("query"));
    same("event_done");
    b.destroy_event(event).expect("destroy event");
    same("destroy_event");
    if let Some(mapping) = mapping {
        b.unmap_import(mapping).expect("unmap");
        same("unmap_import");
    }
    b.close_export(&arena, export).expect("close");
    same("close_export");
    b.destroy_arena(arena).expect("destroy");
    same("destroy_arena");
    // Failing calls too.
    assert!(b.create_arena(0, g + 1).is_err());
    same("a failed create_arena");
    if !b.legacy_ipc() {
        let not_an_export = std::fs::File::open("/dev/null").expect("/dev/null");
        let imported = b.import(0, ImportSource::Fd(not_an_export.as_fd()), g);
        assert!(imported.is_err());
        same("a failed driver call (import of /dev/null)");
    }
    // The last device (another one where there are several).
    let last = b.device_count().expect("count") as DeviceId - 1;
    let g = b.granularity(last).expect("granularity");
    b.mem_info(last).expect("mem_info");
    let arena = b.create_arena(last, 2 * g).expect("create");
    let event = b.record_event(last, StreamId::DEFAULT).expect("record");
    b.synchronize(last).expect("synchronize");
    assert!(b.event_done(&event).expect("query"));
    b.destroy_event(event).expect("destroy event");
    b.destroy_arena(arena).expect("destroy");
    same("calls on the last device");
}

/// Bad sizes and devices, double destroys, forged records, stray copies and foreign files
/// are errors of the right kind, and leave nothing held.
pub fn bad_inputs_are_errors<B: Subject>(b: &B) {
    let facts = facts(b.name());
    let baseline = free(b);
    let g = granule(b);
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
        Err(_) if !facts.registry_errors => {}
        other => panic!("second destroy should be UnknownPointer, got {other:?}"),
    }
    assert!(b.export(&copy).is_err(), "export of a destroyed arena");
    if facts.checked_copies {
        assert!(
            b.write(copy.base, &[1]).is_err(),
            "copy into a destroyed arena"
        );
    }

    // A forged arena (wrong size) is refused and the real one survives.
    let arena = b.create_arena(0, 2 * g).expect("create");
    let mut forged = arena.clone();
    forged.bytes = g;
    assert!(matches!(
        b.destroy_arena(forged),
        Err(Error::InvalidArgument(_))
    ));
    if facts.checked_copies {
        // Copies past the end are refused.
        assert!(b.write(arena.base + 2 * g - 1, &[1, 2]).is_err());
    }
    b.destroy_arena(arena).expect("destroy the real one");

    // Imports: legacy bytes, bad sizes, a file that is not an export, unmap twice.
    if facts.refuses_byte_imports {
        assert!(matches!(
            b.import(0, ImportSource::Bytes(&[0; 64]), g),
            Err(Error::InvalidArgument(_))
        ));
    }
    if !b.legacy_ipc() {
        fd_import_errors(b, &facts, g);
    }

    // Events: destroy twice, query after destroy.
    let event = b.record_event(0, StreamId::DEFAULT).expect("record");
    let copy = event.clone();
    b.destroy_event(event).expect("destroy event");
    assert!(b.event_done(&copy).is_err());
    assert!(b.destroy_event(copy).is_err());

    assert_back(b, baseline, "after the bad inputs");
}

/// The fd-import part of [`bad_inputs_are_errors`] (VMM paths only).
fn fd_import_errors<B: Subject>(b: &B, facts: &Facts, g: u64) {
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
    match b.unmap_import(copy) {
        Err(Error::UnknownPointer { .. }) => {}
        Err(_) if !facts.registry_errors => {}
        other => panic!("second unmap should be UnknownPointer, got {other:?}"),
    }
    b.close_export(&arena, export).expect("close");
    b.destroy_arena(arena).expect("destroy");

    let Some((bad_call, message_start)) = facts.bad_import else {
        return;
    };
    let not_an_export = std::fs::File::open("/dev/null").expect("/dev/null");
    match b.import(0, ImportSource::Fd(not_an_export.as_fd()), g) {
        Err(Error::Backend {
            backend,
            call,
            message,
        }) => {
            assert_eq!((backend, call), (b.name(), bad_call));
            assert!(
                message.starts_with(message_start),
                "message {message:?} should name the driver's error code"
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
}

/// More than the device has is `DriverOutOfMemory` naming the create call, holding nothing.
pub fn too_large_an_arena_is_driver_out_of_memory<B: Subject>(b: &B) {
    let baseline = free(b);
    let g = granule(b);
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
                (b.name(), facts(b.name()).create_call, 0, bytes)
            );
        }
        other => panic!("create_arena({bytes}) should be DriverOutOfMemory, got {other:?}"),
    }
    assert_back(b, baseline, "after the failed create");
}

/// Two backends do not know each other's arenas; dropping one destroys what it left behind.
pub fn two_backends_and_drop_clean_up<B: Subject>(b: &B) {
    let baseline = free(b);
    let first = B::open();
    let c = B::open();
    let g = granule(&first);
    let left_behind = first.create_arena(0, 16 * g).expect("create");
    let _live_event = first.record_event(0, StreamId::DEFAULT).expect("record");
    let other = c.create_arena(0, g).expect("create on the second backend");
    // The second backend does not know the first one's arena.
    assert!(c.destroy_arena(left_behind).is_err());
    drop(first); // destroys what was left behind (CUDA: releases its context retain)
    c.destroy_arena(other).expect("destroy");
    assert_back(&c, baseline, "after dropping a backend with a live arena");
}

/// Every body above in turn, on one backend.
pub fn meets_the_backend_contract<B: Subject>(b: &B) {
    reports_driver_and_granularity(b);
    create_destroy_returns_memory(b);
    write_and_read_through_an_arena(b);
    open_export_holds_memory_after_destroy_until_closed(b);
    in_process_import_sees_the_same_memory(b);
    importer_mapping_holds_memory_until_unmapped(b);
    events_complete_after_synchronize(b);
    caller_context_or_device_left_unchanged(b);
    bad_inputs_are_errors(b);
    too_large_an_arena_is_driver_out_of_memory(b);
    two_backends_and_drop_clean_up(b);
}
