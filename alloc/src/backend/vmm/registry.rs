//! What the VMM core records about the address ranges it handed out.

use std::collections::BTreeMap;

use crate::error::{Error, Result};
use crate::ids::DeviceId;

/// What a live address range of the backend is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum RegionKind {
    /// A VMM arena created here; the allocation handle it owns.
    Arena {
        /// The allocation handle.
        handle: u64,
    },
    /// An arena of the legacy IPC path (`hipMalloc`).
    LegacyArena,
    /// A VMM arena asleep (`release_physical`): its address range stays reserved, nothing
    /// is mapped there and it owns no allocation handle.
    Asleep,
    /// A VMM import mapping (its allocation handle was released right after mapping).
    Import,
    /// A legacy import opened from an IPC handle.
    LegacyImport,
}

impl RegionKind {
    /// Whether this is an arena (as opposed to an import).
    pub(super) fn is_arena(self) -> bool {
        matches!(
            self,
            RegionKind::Arena { .. } | RegionKind::LegacyArena | RegionKind::Asleep
        )
    }
}

/// A live, mapped address range: an arena or an import.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Region {
    /// The device it lives on (arena) or is mapped for (import).
    pub(super) device: DeviceId,
    /// Its size in bytes.
    pub(super) bytes: u64,
    /// What it is.
    pub(super) kind: RegionKind,
}

/// Live arenas and import mappings by base address.
pub(super) type Regions = BTreeMap<u64, Region>;

/// The device of the live region holding `addr..addr + len`.
pub(super) fn range_device(
    regions: &Regions,
    backend: &str,
    addr: u64,
    len: u64,
) -> Result<DeviceId> {
    let end = addr.checked_add(len).ok_or_else(|| Error::UnknownPointer {
        ptr: addr,
        why: format!("range of {len} bytes overflows"),
    })?;
    match regions.range(..=addr).next_back() {
        Some((&base, region))
            if end <= base.saturating_add(region.bytes) && region.kind != RegionKind::Asleep =>
        {
            Ok(region.device)
        }
        _ => Err(Error::UnknownPointer {
            ptr: addr,
            why: format!(
                "{len} bytes from here are not inside a live arena or import of the {backend} backend"
            ),
        }),
    }
}

/// Remove the live region at `base` if `expect` accepts it; `what` names it in errors.
pub(super) fn take_region(
    regions: &mut Regions,
    backend: &str,
    base: u64,
    expect: impl Fn(&Region) -> bool,
    what: &str,
) -> Result<Region> {
    match regions.get(&base).copied() {
        Some(region) if expect(&region) => {
            regions.remove(&base);
            Ok(region)
        }
        Some(region) => Err(Error::invalid(format!(
            "{what} at {base:#x} does not match the backend's record (device {}, {} bytes, {:?})",
            region.device, region.bytes, region.kind
        ))),
        None => Err(Error::UnknownPointer {
            ptr: base,
            why: format!("not a live {what} of the {backend} backend (already destroyed?)"),
        }),
    }
}
