//! Unit tests of the VMM core's own logic on a recording mock [`Driver`] (no GPU): which
//! devices every mapping is made accessible from (peers), FABRIC handles and their fallback,
//! the undo order when a step fails, and the legacy IPC path (exports, imports, sleep).
//!
//! The mock hands out fake addresses and handles and records every call. It keeps a small
//! model of device memory ([`Memory`]: live handles with their bytes, reservations, mappings)
//! and refuses what the real drivers refuse (freeing part of a reservation, mapping over a
//! mapping, unmapping part of one, releasing a handle twice), so copies move real bytes and
//! leaks show. Its set-up (device count, peers, what fails) is per test thread, read by the
//! static start-up calls and copied into the driver by [`Driver::started`]; one call can be
//! made to fail on its k-th use, once ([`Mock::fail_on`]; several such failures count alone). Split tests: `tests/split.rs`; the memory model: `tests/memory.rs`.
#![allow(clippy::unwrap_used)]

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use super::*;
use memory::Memory;

const MIB: u64 = 1 << 20;

/// What the mock driver does.
#[derive(Debug, Clone)]
struct Setup {
    devices: i32,
    /// `(owner, peer)`: `peer` can access `owner`'s memory.
    peers: Vec<(DeviceId, DeviceId)>,
    /// The peer query fails like this for every pair.
    peer_query: Option<Failure>,
    vmm: bool,
    fabric_supported: bool,
    /// A create with FABRIC handles fails like this.
    fabric_refused: Option<Failure>,
    fail_set_access: bool,
    /// Set access fails when it names more than one device.
    refuse_peer_grants: bool,
}

impl Default for Setup {
    fn default() -> Setup {
        Setup {
            devices: 3,
            peers: Vec::new(),
            peer_query: None,
            vmm: true,
            fabric_supported: false,
            fabric_refused: None,
            fail_set_access: false,
            refuse_peer_grants: false,
        }
    }
}

thread_local! {
    static SETUP: RefCell<Setup> = RefCell::new(Setup::default());
    /// The memory model of the last mock started on this thread (tests read it after the
    /// backend dropped).
    static MEMORY: RefCell<Arc<Mutex<Memory>>> = RefCell::default();
}

/// One recorded driver call.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Call {
    Create { device: DeviceId, fabric: bool },
    Release(u64),
    Reserve(u64),
    AddressFree(u64),
    Map(u64, u64),
    Unmap(u64),
    SetAccess(u64, Vec<DeviceId>),
    ImportFd(u64),
    LegacyAlloc(u64),
    LegacyFree(u64),
    IpcOpen(u64),
    IpcClose(u64),
    CopyDtoD { dst: u64, src: u64 },
    Synchronize,
}

#[derive(Debug)]
struct Mock {
    setup: Setup,
    /// Starts as `setup.fail_set_access`; tests switch it.
    fail_set_access: AtomicBool,
    calls: Mutex<Vec<Call>>,
    next: AtomicU64,
    memory: Arc<Mutex<Memory>>,
    /// `(call, k)`: the call of that name fails on its k-th use from now (0: the next one),
    /// once; each entry counts on its own.
    fail_on: Mutex<Vec<(&'static str, usize)>>,
}

impl Mock {
    fn fresh(&self) -> u64 {
        self.next.fetch_add(64 * MIB, Ordering::Relaxed)
    }
    fn record(&self, call: Call) {
        self.calls.lock().push(call);
    }
    /// Make the `k`-th use from now (0: the next one) of driver call `call` fail, once.
    fn fail_on(&self, call: &'static str, k: usize) {
        self.fail_on.lock().push((call, k));
    }
    /// Fail here if [`Mock::fail_on`] says so.
    fn injected(&self, call: &'static str) -> DriverResult<()> {
        let mut fail_on = self.fail_on.lock();
        let mut fail = false;
        fail_on.retain_mut(|(name, k)| {
            if *name != call {
                return true;
            }
            if *k == 0 {
                fail = true;
                return false;
            }
            *k -= 1;
            true
        });
        if fail {
            return Err(Mock::fail(call, Failure::Other));
        }
        Ok(())
    }
    /// A refusal of the memory model.
    fn refuse(call: &'static str, why: &str) -> DriverError {
        DriverError {
            backend: "mock",
            call,
            failure: Failure::Other,
            message: why.to_string(),
        }
    }
    fn fail(call: &'static str, failure: Failure) -> DriverError {
        DriverError {
            backend: "mock",
            call,
            failure,
            message: format!("{call} refused ({failure:?})"),
        }
    }
}

impl Driver for Mock {
    type Device = DeviceId;
    type Current = ();
    const NAME: &'static str = "mock";
    const VENDOR: &'static str = "Mock";
    const LEGACY_IPC: Option<LegacyIpc> = Some(LegacyIpc {
        handle_bytes: 64,
        handle_name: "mockIpc",
        granularity: 2 << 20,
        fallback: false,
    });
    const START_FAILURES: StartFailures = StartFailures {
        init: "init",
        version: "version",
        count: "count",
    };

    fn init() -> DriverResult<()> {
        Ok(())
    }
    fn read_version() -> DriverResult<i32> {
        Ok(1)
    }
    fn count_devices() -> DriverResult<i32> {
        Ok(SETUP.with(|s| s.borrow().devices))
    }
    fn started(_version: i32) -> Mock {
        let setup = SETUP.with(|s| s.borrow().clone());
        Mock {
            fail_set_access: AtomicBool::new(setup.fail_set_access),
            setup,
            calls: Mutex::new(Vec::new()),
            next: AtomicU64::new(0x1000_0000),
            memory: MEMORY.with(|m| {
                let memory = Arc::new(Mutex::new(Memory::default()));
                *m.borrow_mut() = Arc::clone(&memory);
                memory
            }),
            fail_on: Mutex::new(Vec::new()),
        }
    }
    fn version(&self) -> i32 {
        1
    }
    fn version_text(&self) -> String {
        "mock 1".into()
    }
    fn current_on_thread(&self) -> DriverResult<u64> {
        Ok(0)
    }
    fn device_support(&self, _ordinal: DeviceId) -> DriverResult<DeviceSupport> {
        Ok(DeviceSupport {
            vmm: Some(self.setup.vmm),
            posix_fd: Some(true),
            rdma: false,
            fabric: self.setup.fabric_supported,
        })
    }
    fn open_device(&self, ordinal: DeviceId, _rdma: bool) -> DriverResult<DeviceId> {
        Ok(ordinal)
    }
    unsafe fn close_device(&self, _device: DeviceId) -> DriverResult<()> {
        Ok(())
    }
    unsafe fn make_current(&self, _device: &DeviceId) -> DriverResult<()> {
        Ok(())
    }
    fn granularity(&self, _device: &DeviceId) -> DriverResult<u64> {
        Ok(2 * MIB)
    }
    fn mem_info(&self) -> DriverResult<(u64, u64)> {
        Ok((1 << 30, 1 << 30))
    }
    fn synchronize(&self) -> DriverResult<()> {
        self.record(Call::Synchronize);
        self.injected("synchronize")
    }
    fn mem_create(&self, device: &DeviceId, bytes: usize, fabric: bool) -> DriverResult<u64> {
        self.record(Call::Create {
            device: *device,
            fabric,
        });
        self.injected("mem_create")?;
        match self.setup.fabric_refused {
            Some(failure) if fabric => Err(Mock::fail("mem_create", failure)),
            _ => {
                let handle = self.fresh();
                let mut memory = self.memory.lock();
                memory.bytes.insert(handle, vec![0; bytes]);
                memory.live.insert(handle);
                Ok(handle)
            }
        }
    }
    unsafe fn mem_release(&self, handle: u64) -> DriverResult<()> {
        self.record(Call::Release(handle));
        if !self.memory.lock().live.remove(&handle) {
            return Err(Mock::refuse("mem_release", "not a live handle"));
        }
        Ok(())
    }
    fn address_reserve(&self, bytes: usize, _alignment: usize) -> DriverResult<u64> {
        assert!(
            bytes as u64 <= 64 * MIB,
            "the mock's address steps are 64 MiB"
        );
        self.injected("address_reserve")?;
        let base = self.fresh();
        self.record(Call::Reserve(base));
        self.memory.lock().reserved.insert(base, bytes);
        Ok(base)
    }
    unsafe fn address_free(&self, base: u64, bytes: usize) -> DriverResult<()> {
        self.record(Call::AddressFree(base));
        self.injected("address_free")?;
        let mut memory = self.memory.lock();
        if memory.reserved.get(&base) != Some(&bytes) {
            return Err(Mock::refuse("address_free", "not a whole reservation"));
        }
        let end = base + bytes as u64;
        if memory.mapped.range(base..end).next().is_some() {
            return Err(Mock::refuse(
                "address_free",
                "something is still mapped there",
            ));
        }
        memory.reserved.remove(&base);
        Ok(())
    }
    unsafe fn map(&self, base: u64, bytes: usize, handle: u64) -> DriverResult<()> {
        self.record(Call::Map(base, handle));
        self.injected("map")?;
        let mut memory = self.memory.lock();
        let end = base + bytes as u64;
        let reserved = memory.reserved.range(..=base).next_back();
        if reserved.is_none_or(|(&r, &size)| end > r + size as u64) {
            return Err(Mock::refuse("map", "not inside a reservation"));
        }
        let before = memory.mapped.range(..end).next_back();
        if before.is_some_and(|(&m, &(size, _))| m + size as u64 > base) {
            return Err(Mock::refuse("map", "overlaps a mapping"));
        }
        if !memory.live.contains(&handle) {
            return Err(Mock::refuse("map", "not a live handle"));
        }
        memory.mapped.insert(base, (bytes, handle));
        Ok(())
    }
    unsafe fn unmap(&self, base: u64, bytes: usize) -> DriverResult<()> {
        self.record(Call::Unmap(base));
        self.injected("unmap")?;
        let mut memory = self.memory.lock();
        if memory.mapped.get(&base).map(|m| m.0) != Some(bytes) {
            return Err(Mock::refuse("unmap", "not a whole mapping"));
        }
        memory.mapped.remove(&base);
        Ok(())
    }
    unsafe fn set_access(
        &self,
        base: u64,
        _bytes: usize,
        devices: &[DeviceId],
    ) -> DriverResult<()> {
        self.record(Call::SetAccess(base, devices.to_vec()));
        self.injected("set_access")?;
        let refused = self.setup.refuse_peer_grants && devices.len() > 1;
        if refused || self.fail_set_access.load(Ordering::Relaxed) {
            return Err(Mock::fail("set_access", Failure::Other));
        }
        Ok(())
    }
    fn can_access_peer(&self, owner: DeviceId, peer: DeviceId) -> DriverResult<bool> {
        if let Some(failure) = self.setup.peer_query {
            return Err(Mock::fail("can_access_peer", failure));
        }
        Ok(self.setup.peers.contains(&(owner, peer)))
    }
    unsafe fn export_fd(&self, _handle: u64) -> DriverResult<OwnedFd> {
        let file = std::fs::File::open("/dev/null").unwrap();
        Ok(OwnedFd::from(file))
    }
    fn import_fd(&self, _fd: BorrowedFd<'_>) -> DriverResult<u64> {
        let handle = self.fresh();
        self.record(Call::ImportFd(handle));
        self.memory.lock().live.insert(handle);
        Ok(handle)
    }
    fn legacy_alloc(&self, _bytes: usize) -> DriverResult<u64> {
        let base = self.fresh();
        self.record(Call::LegacyAlloc(base));
        Ok(base)
    }
    unsafe fn legacy_free(&self, base: u64) -> DriverResult<()> {
        self.record(Call::LegacyFree(base));
        Ok(())
    }
    unsafe fn ipc_get_handle(&self, base: u64) -> DriverResult<Vec<u8>> {
        let mut handle = vec![0u8; 64];
        handle[..8].copy_from_slice(&base.to_le_bytes());
        Ok(handle)
    }
    fn ipc_open_handle(&self, _handle: &[u8]) -> DriverResult<u64> {
        let base = self.fresh();
        self.record(Call::IpcOpen(base));
        Ok(base)
    }
    unsafe fn ipc_close_handle(&self, base: u64) -> DriverResult<()> {
        self.record(Call::IpcClose(base));
        Ok(())
    }
    fn event_create(&self) -> DriverResult<u64> {
        Ok(self.fresh())
    }
    unsafe fn event_record(&self, _event: u64, _stream: u64) -> DriverResult<()> {
        Ok(())
    }
    unsafe fn event_query(&self, _event: u64) -> DriverResult<bool> {
        Ok(true)
    }
    unsafe fn event_destroy(&self, _event: u64) -> DriverResult<()> {
        Ok(())
    }
    unsafe fn memcpy_htod(&self, dst: u64, src: &[u8]) -> DriverResult<()> {
        self.memory.lock().write(dst, src)
    }
    unsafe fn memcpy_dtoh(&self, dst: &mut [u8], src: u64) -> DriverResult<()> {
        dst.copy_from_slice(&self.memory.lock().read(src, dst.len())?);
        Ok(())
    }
    unsafe fn memcpy_dtod(&self, dst: u64, src: u64, bytes: usize) -> DriverResult<()> {
        self.record(Call::CopyDtoD { dst, src });
        self.injected("memcpy_dtod")?;
        let mut memory = self.memory.lock();
        let data = memory.read(src, bytes)?;
        memory.write(dst, &data)
    }
    unsafe fn memset_d8(&self, _dst: u64, _value: u8, _bytes: usize) -> DriverResult<()> {
        Ok(())
    }
    fn stream_create(&self) -> DriverResult<u64> {
        Ok(self.fresh())
    }
    unsafe fn stream_destroy(&self, _stream: u64) -> DriverResult<()> {
        Ok(())
    }
    unsafe fn memcpy_dtod_async(
        &self,
        dst: u64,
        src: u64,
        bytes: usize,
        _stream: u64,
    ) -> DriverResult<()> {
        // SAFETY: the same contract as memcpy_dtod; the mock copies at once.
        unsafe { self.memcpy_dtod(dst, src, bytes) }
    }
}

/// A backend on the mock with `setup`.
fn backend(setup: Setup) -> VmmBackend<Mock> {
    SETUP.with(|s| *s.borrow_mut() = setup);
    VmmBackend::<Mock>::new().unwrap()
}

/// The calls recorded so far, cleared.
fn take_calls(b: &VmmBackend<Mock>) -> Vec<Call> {
    std::mem::take(&mut *b.driver.calls.lock())
}

/// The device lists of the set-access calls among `calls`, in order.
fn access_lists(calls: &[Call]) -> Vec<Vec<DeviceId>> {
    calls
        .iter()
        .filter_map(|c| match c {
            Call::SetAccess(_, devices) => Some(devices.clone()),
            _ => None,
        })
        .collect()
}

#[test]
fn every_mapping_is_accessible_from_the_device_and_its_peers() {
    // 0 and 1 see each other; 2 sees 0's memory only; nobody sees 2's.
    let b = backend(Setup {
        peers: vec![(0, 1), (1, 0), (0, 2)],
        ..Setup::default()
    });
    assert_eq!(b.state(0).unwrap().peers.iter().collect::<Vec<_>>(), [1, 2]);
    assert_eq!(b.state(1).unwrap().peers.iter().collect::<Vec<_>>(), [0]);
    assert!(b.state(2).unwrap().peers.iter().next().is_none());

    // Created on device 0 before device 1 or 2 did anything else: access for all three, in
    // one call, owner first.
    let a0 = b.create_arena(0, 4 * MIB).unwrap();
    let a2 = b.create_arena(2, 2 * MIB).unwrap();
    let calls = take_calls(&b);
    assert_eq!(access_lists(&calls), [vec![0, 1, 2], vec![2]]);
    assert!(calls.contains(&Call::SetAccess(a0.base, vec![0, 1, 2])));

    // An import on device 1 (of any arena's fd): device 1 and its peer 0.
    let export = b.export(&a0).unwrap();
    let ExportPayload::Fd(fd) = &export.payload else {
        panic!("VMM exports are fds");
    };
    let m = b.import(1, ImportSource::Fd(fd.as_fd()), 4 * MIB).unwrap();
    assert_eq!(access_lists(&take_calls(&b)), [vec![1, 0]]);

    // Re-created on wake: the same devices again.
    b.release_physical(&a0).unwrap();
    take_calls(&b);
    let a0 = b.restore_physical(&a0).unwrap();
    let calls = take_calls(&b);
    assert_eq!(access_lists(&calls), [vec![0, 1, 2]]);
    assert!(matches!(calls[0], Call::Create { device: 0, .. }));

    b.close_export(&a0, export).unwrap();
    b.unmap_import(m).unwrap();
    b.destroy_arena(a0).unwrap();
    b.destroy_arena(a2).unwrap();
}

#[test]
fn a_driver_without_a_peer_query_means_no_peers() {
    for failure in [Failure::NotSupported, Failure::Other] {
        let b = backend(Setup {
            peers: vec![(0, 1), (1, 0)],
            peer_query: Some(failure),
            ..Setup::default()
        });
        let a = b.create_arena(0, 2 * MIB).unwrap();
        assert_eq!(access_lists(&take_calls(&b)), [vec![0]], "{failure:?}");
        b.destroy_arena(a).unwrap();
    }
}

#[test]
fn a_failed_set_access_is_undone_in_order() {
    let b = backend(Setup {
        peers: vec![(0, 1)],
        fail_set_access: true,
        ..Setup::default()
    });
    // Create: create, reserve, map, set access (fails, and again for the owner alone), then
    // unmap, free the range, release.
    let e = b.create_arena(0, 2 * MIB).unwrap_err();
    assert!(e.to_string().contains("set_access"), "{e}");
    let calls = take_calls(&b);
    let (handle, base) = match calls[..] {
        [Call::Create { .. }, Call::Reserve(base), Call::Map(mapped, handle), ..] => {
            assert_eq!(mapped, base);
            (handle, base)
        }
        _ => panic!("{calls:?}"),
    };
    assert_eq!(
        calls[3..],
        [
            Call::SetAccess(base, vec![0, 1]),
            Call::SetAccess(base, vec![0]),
            Call::Unmap(base),
            Call::AddressFree(base),
            Call::Release(handle),
        ]
    );
    assert!(b.regions.read().is_empty());
    // Without peers: one grant, the same undo.
    let b = backend(Setup {
        fail_set_access: true,
        ..Setup::default()
    });
    assert!(b.create_arena(2, 2 * MIB).is_err());
    let calls = take_calls(&b);
    assert_eq!(access_lists(&calls), [vec![2]]);
    assert!(matches!(
        calls[4..],
        [Call::Unmap(_), Call::AddressFree(_), Call::Release(_)]
    ));
}

#[test]
fn a_refused_peer_grant_keeps_the_device_usable_without_peers() {
    let b = backend(Setup {
        peers: vec![(0, 1), (1, 0)],
        refuse_peer_grants: true,
        ..Setup::default()
    });
    let a = b.create_arena(0, 2 * MIB).unwrap();
    let c = b.create_arena(0, 2 * MIB).unwrap();
    // The first grant names the peer, is refused, and the owner alone is granted; later
    // mappings on that device name the owner only.
    assert_eq!(
        access_lists(&take_calls(&b)),
        [vec![0, 1], vec![0], vec![0]]
    );
    // Device 1 tries its own peers once.
    let d = b.create_arena(1, 2 * MIB).unwrap();
    assert_eq!(access_lists(&take_calls(&b)), [vec![1, 0], vec![1]]);
    for arena in [a, c, d] {
        b.destroy_arena(arena).unwrap();
    }
}

#[test]
fn a_failed_set_access_on_wake_keeps_the_arena_asleep() {
    let b = backend(Setup {
        peers: vec![(0, 1)],
        ..Setup::default()
    });
    let a = b.create_arena(0, 2 * MIB).unwrap();
    b.release_physical(&a).unwrap();
    take_calls(&b);
    // From now on set access fails.
    b.driver.fail_set_access.store(true, Ordering::Relaxed);
    assert!(b.restore_physical(&a).is_err());
    let calls = take_calls(&b);
    let handle = match calls[..] {
        [Call::Create { .. }, Call::Map(base, handle), ..] if base == a.base => handle,
        _ => panic!("{calls:?}"),
    };
    assert_eq!(
        calls[2..],
        [
            Call::SetAccess(a.base, vec![0, 1]),
            Call::SetAccess(a.base, vec![0]),
            Call::Unmap(a.base),
            Call::Release(handle),
        ]
    );
    // Still asleep: it can be destroyed (its range freed) but not slept again.
    assert!(b.release_physical(&a).is_err());
    b.destroy_arena(a.clone()).unwrap();
    assert_eq!(take_calls(&b), [Call::AddressFree(a.base)]);
}

/// The `fabric` flags of the creates among `calls`.
fn creates(calls: &[Call]) -> Vec<bool> {
    calls
        .iter()
        .filter_map(|c| match c {
            Call::Create { fabric, .. } => Some(*fabric),
            _ => None,
        })
        .collect()
}

#[test]
fn fabric_handles_where_supported_and_permitted() {
    // Supported and permitted: every create asks for FABRIC (auto and 1), none with 0.
    for (mode, fabric) in [
        (FabricHandles::Auto, true),
        (FabricHandles::On, true),
        (FabricHandles::Off, false),
    ] {
        let b = backend(Setup {
            fabric_supported: true,
            ..Setup::default()
        })
        .with_fabric_handles(mode);
        let a = b.create_arena(0, 2 * MIB).unwrap();
        b.release_physical(&a).unwrap();
        let a = b.restore_physical(&a).unwrap();
        assert_eq!(creates(&take_calls(&b)), [fabric, fabric], "{mode:?}");
        b.destroy_arena(a).unwrap();
    }
    // Not supported: auto creates POSIX-only; 1 refuses the device.
    let b = backend(Setup::default());
    let a = b.create_arena(0, 2 * MIB).unwrap();
    assert_eq!(creates(&take_calls(&b)), [false]);
    b.destroy_arena(a).unwrap();
    let b = backend(Setup::default()).with_fabric_handles(FabricHandles::On);
    let e = b.create_arena(0, 2 * MIB).unwrap_err();
    assert!(
        matches!(e, Error::Unavailable(_)) && e.to_string().contains("FABRIC"),
        "{e}"
    );
}

#[test]
fn a_refused_fabric_create_falls_back_for_good_in_auto_mode() {
    for failure in [Failure::NotPermitted, Failure::NotSupported] {
        let b = backend(Setup {
            fabric_supported: true,
            fabric_refused: Some(failure),
            ..Setup::default()
        });
        let a = b.create_arena(0, 2 * MIB).unwrap();
        let c = b.create_arena(0, 2 * MIB).unwrap();
        // The first create asks, is refused and retries POSIX-only; later ones do not ask.
        assert_eq!(
            creates(&take_calls(&b)),
            [true, false, false],
            "{failure:?}"
        );
        // Device 1 asks for itself.
        let d = b.create_arena(1, 2 * MIB).unwrap();
        assert_eq!(creates(&take_calls(&b)), [true, false], "{failure:?}");
        for arena in [a, c, d] {
            b.destroy_arena(arena).unwrap();
        }
    }
    // Another failure is not a refusal: reported, and the device keeps asking.
    let b = backend(Setup {
        fabric_supported: true,
        fabric_refused: Some(Failure::Other),
        ..Setup::default()
    });
    assert!(b.create_arena(0, 2 * MIB).is_err());
    assert_eq!(creates(&take_calls(&b)), [true]);
    // fabric_handles=1: a refusal is an error, nothing left behind.
    let b = backend(Setup {
        fabric_supported: true,
        fabric_refused: Some(Failure::NotPermitted),
        ..Setup::default()
    })
    .with_fabric_handles(FabricHandles::On);
    let e = b.create_arena(0, 2 * MIB).unwrap_err();
    assert!(e.to_string().contains("mem_create"), "{e}");
    assert_eq!(
        take_calls(&b),
        [Call::Create {
            device: 0,
            fabric: true
        }]
    );
    assert!(b.regions.read().is_empty());
}

#[test]
fn legacy_ipc_arenas_share_byte_handles_pin_and_cannot_sleep() {
    let b = backend(Setup {
        peers: vec![(0, 1), (1, 0)],
        ..Setup::default()
    })
    .with_legacy_ipc(true);
    assert!(b.uses_legacy_ipc(0).unwrap());
    assert!(b.state(0).unwrap().peers.iter().next().is_none());
    // A size that is not a multiple of the legacy granularity is refused.
    assert!(b.create_arena(0, MIB).is_err());
    let a = b.create_arena(0, 4 * MIB).unwrap();
    assert_eq!(a.handle, 0);
    assert_eq!(take_calls(&b), [Call::LegacyAlloc(a.base)]);

    let export = b.export(&a).unwrap();
    assert_eq!(export.kind, ExportKind::Pinning);
    let ExportPayload::Bytes(handle) = &export.payload else {
        panic!("legacy exports are bytes");
    };
    assert_eq!(handle.len(), 64);
    let wrong = b.import(1, ImportSource::Bytes(&handle[..63]), 4 * MIB);
    assert!(wrong.unwrap_err().to_string().contains("mockIpc"));
    let m = b.import(1, ImportSource::Bytes(handle), 4 * MIB).unwrap();
    // No fds on the legacy path.
    let fd = std::fs::File::open("/dev/null").unwrap();
    assert!(b.import(1, ImportSource::Fd(fd.as_fd()), 4 * MIB).is_err());

    // Sleep: a clear error, the arena untouched.
    let e = b.release_physical(&a).unwrap_err();
    assert!(matches!(e, Error::Unavailable(_)), "{e}");
    assert!(e.to_string().contains("cannot sleep"), "{e}");

    b.unmap_import(m.clone()).unwrap();
    b.close_export(&a, export).unwrap();
    b.destroy_arena(a.clone()).unwrap();
    assert_eq!(
        take_calls(&b),
        [
            Call::IpcOpen(m.base),
            Call::IpcClose(m.base),
            Call::LegacyFree(a.base)
        ]
    );
}

#[test]
fn legacy_ipc_is_no_fallback_where_the_driver_says_so() {
    // LegacyIpc::fallback is false (CUDA): a device without VMM is unavailable, not legacy.
    let b = backend(Setup {
        vmm: false,
        ..Setup::default()
    });
    assert!(matches!(
        b.create_arena(0, 2 * MIB),
        Err(Error::Unavailable(_))
    ));
    // Asked for, it is used.
    let b = backend(Setup {
        vmm: false,
        ..Setup::default()
    })
    .with_legacy_ipc(true);
    let a = b.create_arena(0, 2 * MIB).unwrap();
    b.destroy_arena(a).unwrap();
}

mod grow;
mod memory;
mod split;
