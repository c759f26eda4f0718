//! What the VMM core records about the address ranges it handed out, and the reservations
//! of split arenas (`split_arena`), freed with their last window.

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

/// The address reservation of an arena that was split (`split_arena`): it stays reserved
/// while any of its windows lives, and is freed whole with the last one (CUDA's
/// `cuMemAddressFree` takes only the base and size `cuMemAddressReserve` returned).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct SplitReservation {
    /// The reservation's size in bytes (its base is the key).
    pub(super) bytes: u64,
    /// How many live regions (windows, awake or asleep) lie in it.
    pub(super) windows: usize,
}

/// Reservations of split arenas by base address. A region whose base lies inside one of
/// them is a window of it; any other arena region is its own reservation.
pub(super) type SplitReservations = BTreeMap<u64, SplitReservation>;

/// The base of the split reservation holding `addr`, if any.
pub(super) fn split_reservation_of(splits: &SplitReservations, addr: u64) -> Option<u64> {
    match splits.range(..=addr).next_back() {
        Some((&base, r)) if addr - base < r.bytes => Some(base),
        _ => None,
    }
}

/// Record that the arena at `base..base + bytes` became `windows` (> 0) windows: a new
/// split reservation, or more windows in the one it already lies in (a window split again).
pub(super) fn record_split(splits: &mut SplitReservations, base: u64, bytes: u64, windows: usize) {
    match split_reservation_of(splits, base).and_then(|r| splits.get_mut(&r)) {
        Some(r) => r.windows += windows.saturating_sub(1),
        None => {
            splits.insert(base, SplitReservation { bytes, windows });
        }
    }
}

/// The region at `base..base + bytes` is gone (nothing mapped there any more): the address
/// range to free now. An ordinary arena or import frees its own range; a window frees its
/// split reservation only if it was the last window in it (`None` otherwise).
pub(super) fn range_to_free(
    splits: &mut SplitReservations,
    base: u64,
    bytes: u64,
) -> Option<(u64, u64)> {
    let Some(reservation) = split_reservation_of(splits, base) else {
        return Some((base, bytes));
    };
    let r = splits.get_mut(&reservation)?;
    r.windows = r.windows.saturating_sub(1);
    if r.windows > 0 {
        return None;
    }
    let bytes = r.bytes;
    splits.remove(&reservation);
    Some((reservation, bytes))
}
