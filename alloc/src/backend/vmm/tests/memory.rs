//! The mock driver's model of device memory (`tests.rs`): handles with their bytes,
//! reservations and mappings; copies may span mappings that lie back to back.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use super::{DriverResult, Failure, Mock};

/// The mock's model of device memory.
#[derive(Debug, Default)]
pub(super) struct Memory {
    /// The bytes of every handle created (kept after release: a mapping may still use them).
    pub(super) bytes: HashMap<u64, Vec<u8>>,
    /// Handles not released yet.
    pub(super) live: BTreeSet<u64>,
    /// Reservations: base -> size.
    pub(super) reserved: BTreeMap<u64, usize>,
    /// Mappings: base -> (size, handle).
    pub(super) mapped: BTreeMap<u64, (usize, u64)>,
}

impl Memory {
    /// The handle and offset in it of the mapped range `addr..addr + len`.
    pub(super) fn at(&self, addr: u64, len: usize) -> DriverResult<(u64, usize)> {
        match self.mapped.range(..=addr).next_back() {
            Some((&base, &(size, handle))) if addr + len as u64 <= base + size as u64 => {
                Ok((handle, (addr - base) as usize))
            }
            _ => Err(Mock::fail("copy", Failure::Other)),
        }
    }
    /// The bytes at `addr..addr + len`, which may span mappings that lie back to back (a
    /// grown arena's chunks), as a copy through one reservation does on a GPU.
    pub(super) fn read(&self, addr: u64, len: usize) -> DriverResult<Vec<u8>> {
        let mut out = Vec::with_capacity(len);
        for (handle, offset, n) in self.pieces(addr, len)? {
            let bytes = self
                .bytes
                .get(&handle)
                .ok_or(Mock::fail("copy", Failure::Other))?;
            out.extend_from_slice(&bytes[offset..offset + n]);
        }
        Ok(out)
    }
    pub(super) fn write(&mut self, addr: u64, src: &[u8]) -> DriverResult<()> {
        let mut done = 0;
        for (handle, offset, n) in self.pieces(addr, src.len())? {
            let bytes = self
                .bytes
                .get_mut(&handle)
                .ok_or(Mock::fail("copy", Failure::Other))?;
            bytes[offset..offset + n].copy_from_slice(&src[done..done + n]);
            done += n;
        }
        Ok(())
    }
    /// `addr..addr + len` as `(handle, offset, bytes)` pieces of consecutive mappings.
    fn pieces(&self, addr: u64, len: usize) -> DriverResult<Vec<(u64, usize, usize)>> {
        let mut out = Vec::new();
        let (mut at, end) = (addr, addr + len as u64);
        while at < end || out.is_empty() {
            let (handle, offset) = self.at(at, 1)?;
            let (&base, &(size, _)) = self
                .mapped
                .range(..=at)
                .next_back()
                .ok_or(Mock::fail("copy", Failure::Other))?;
            let n = (end.min(base + size as u64) - at) as usize;
            out.push((handle, offset, n));
            at += n as u64;
            if n == 0 {
                break;
            }
        }
        Ok(out)
    }
}
