//! The backend contract: what every [`Backend`] must do, written once and run against each
//! (sim in CI; cuda and hip on their GPUs, `#[ignore]`d elsewhere). Memory is checked through
//! the backend's own copy functions, and "held" through `mem_info`, within one granule.

use gpu_arena::backend::{Backend, DeviceId, ExportKind, ImportSource, StreamId};

/// A backend under test and how to reach its memory from the host.
pub struct Contract<'a> {
    /// The backend.
    pub backend: &'a dyn Backend,
    /// The device to test on.
    pub device: DeviceId,
    /// Host -> device copy.
    pub write: &'a dyn Fn(u64, &[u8]),
    /// Device -> host copy.
    pub read: &'a dyn Fn(&mut [u8], u64),
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

impl Contract<'_> {
    fn free(&self) -> u64 {
        self.backend.mem_info(self.device).expect("mem_info").free
    }

    fn slack(&self) -> u64 {
        self.backend.granularity(self.device).expect("granularity")
    }

    /// Every check, in order.
    pub fn run_all(&self) {
        self.create_write_read_destroy();
        self.export_holds_memory_until_closed();
        self.import_sees_the_same_memory_and_holds_it_until_unmapped();
        self.events_complete_after_synchronize();
        self.bad_inputs_are_errors();
    }

    /// An arena of a few granules: write, read back, destroy, memory back.
    pub fn create_write_read_destroy(&self) {
        let b = self.backend;
        let bytes = 4 * self.slack();
        let before = self.free();
        let arena = b.create_arena(self.device, bytes).expect("create_arena");
        assert_eq!(arena.bytes, bytes);
        assert!(
            self.free() + bytes - self.slack() <= before,
            "creating holds memory"
        );
        let data = pattern(bytes as usize, 7);
        (self.write)(arena.base, &data);
        let mut back = vec![0u8; bytes as usize];
        (self.read)(&mut back, arena.base);
        assert!(back == data, "read back what was written");
        b.destroy_arena(arena).expect("destroy_arena");
        assert!(
            self.free() + self.slack() >= before,
            "destroy gives the memory back"
        );
    }

    /// An export fd left open keeps the memory after destroy; closing it releases it.
    pub fn export_holds_memory_until_closed(&self) {
        let b = self.backend;
        let bytes = 32 * self.slack();
        let before = self.free();
        let arena = b.create_arena(self.device, bytes).expect("create_arena");
        let export = b.export(&arena).expect("export");
        assert_eq!(export.kind, ExportKind::Releasable);
        assert!(export.fd().is_some(), "VMM exports are fds");
        let mem = arena.clone();
        b.destroy_arena(arena).expect("destroy_arena");
        assert!(
            self.free() + bytes / 2 <= before,
            "the open export holds the memory"
        );
        b.close_export(&mem, export).expect("close_export");
        assert!(
            self.free() + self.slack() >= before,
            "closing the export releases it"
        );
    }

    /// Importing one's own export maps the same memory; the mapping holds it after the
    /// owner destroyed the arena and closed the export, until unmapped.
    pub fn import_sees_the_same_memory_and_holds_it_until_unmapped(&self) {
        let b = self.backend;
        let bytes = 8 * self.slack();
        let before = self.free();
        let arena = b.create_arena(self.device, bytes).expect("create_arena");
        let data = pattern(bytes as usize, 3);
        (self.write)(arena.base, &data);
        let export = b.export(&arena).expect("export");
        let fd = export.fd().expect("fd");
        let mapping = b
            .import(self.device, ImportSource::Fd(fd), bytes)
            .expect("import");
        assert_ne!(mapping.base, arena.base, "a second mapping");
        let mut back = vec![0u8; bytes as usize];
        (self.read)(&mut back, mapping.base);
        assert!(back == data, "the import sees the owner's bytes");
        (self.write)(mapping.base + 1, &[0xEE]);
        let mut one = [0u8; 1];
        (self.read)(&mut one, arena.base + 1);
        assert_eq!(one[0], 0xEE, "the owner sees the importer's write");
        let mem = arena.clone();
        b.destroy_arena(arena).expect("destroy_arena");
        b.close_export(&mem, export).expect("close_export");
        assert!(
            self.free() + bytes / 2 <= before,
            "the mapping holds the memory"
        );
        (self.read)(&mut one, mapping.base + 1);
        assert_eq!(one[0], 0xEE, "still readable through the mapping");
        b.unmap_import(mapping).expect("unmap_import");
        assert!(
            self.free() + self.slack() >= before,
            "unmapping releases it"
        );
    }

    /// An event recorded on a stream is complete after a synchronize.
    pub fn events_complete_after_synchronize(&self) {
        let b = self.backend;
        let ev = b
            .record_event(self.device, StreamId::DEFAULT)
            .expect("record_event");
        b.synchronize(self.device).expect("synchronize");
        assert!(b.event_done(&ev).expect("event_done"));
        b.destroy_event(ev).expect("destroy_event");
    }

    /// Sizes that are not granule multiples and devices out of range are errors.
    pub fn bad_inputs_are_errors(&self) {
        let b = self.backend;
        let before = self.free();
        assert!(
            b.create_arena(self.device, self.slack() + 1).is_err(),
            "not a granule multiple"
        );
        assert!(b.create_arena(self.device, 0).is_err(), "zero bytes");
        let count = b.device_count().expect("device_count") as DeviceId;
        assert!(
            b.create_arena(count, self.slack()).is_err(),
            "device out of range"
        );
        assert!(b.create_arena(-1, self.slack()).is_err(), "negative device");
        assert!(
            self.free() + self.slack() >= before,
            "refused calls hold nothing"
        );
    }
}
