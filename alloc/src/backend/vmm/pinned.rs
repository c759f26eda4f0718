//! Pinned host buffers for sleep's offload, made fast: the first sleep of 100 GiB took
//! 37.3 s against a 1.95 s copy, because `cuMemHostAlloc` faults and zeroes every 4 KiB page
//! in one thread (2.3 GB/s measured on the H200, `bench/results/h200-2026-12-01-pin.md`).
//! Here a buffer is anonymous memory advised to use transparent huge pages, faulted in by up
//! to 16 threads at once (41 GB/s there), then page-locked with one `cuMemHostRegister`
//! (38-53 GB/s on faulted huge pages). Where that fails (no register call, a limit), the
//! driver's own `host_alloc` is used as before.

use std::ffi::c_void;

use super::{warn_undo, Driver, VmmBackend};
use crate::error::{Error, Result};
use crate::ids::DeviceId;

/// How a live pinned buffer was made, so it is freed the same way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Pinned {
    /// `Driver::host_alloc` (freed with `host_free`).
    Allocated,
    /// An anonymous mapping of this many bytes, registered (`host_unregister`, `munmap`).
    Registered(usize),
}

/// A live pinned host buffer: the device it was made with and how.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct PinnedHost {
    pub(super) device: DeviceId,
    pub(super) how: Pinned,
}

/// Huge-page size the mapping is rounded to (and each faulting thread's chunk aligned to).
const HUGE: usize = 2 << 20;
/// The most threads that fault a buffer in.
const MAX_FAULT_THREADS: usize = 16;
/// Below this, one thread (threads cost more than they save).
const PARALLEL_FROM: usize = 64 << 20;

/// Touch one byte of every 4 KiB page of `base..base + len` from up to 16 threads, so the
/// kernel faults (and zeroes) the pages in parallel.
fn fault_in(base: usize, len: usize) {
    let threads = if len < PARALLEL_FROM {
        1
    } else {
        std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .clamp(1, MAX_FAULT_THREADS)
    };
    let chunk = len.div_ceil(threads).next_multiple_of(HUGE);
    let touch = |start: usize, end: usize| {
        let mut a = start;
        while a < end {
            // SAFETY: `a` lies inside the caller's fresh private read-write mapping, which no
            // Rust reference covers; a volatile write of zero is what a fresh page holds.
            unsafe { std::ptr::write_volatile(a as *mut u8, 0) };
            a += 4096;
        }
    };
    std::thread::scope(|s| {
        for i in 1..threads {
            let (start, end) = (base + i * chunk, (base + (i + 1) * chunk).min(base + len));
            if start < end {
                s.spawn(move || touch(start, end));
            }
        }
        touch(base, (base + chunk).min(base + len));
    });
}

impl<D: Driver> VmmBackend<D> {
    /// `n` (> 0) bytes of pinned host memory for `device` (made current by the caller).
    pub(super) fn pin_new(&self, device: DeviceId, n: usize) -> Result<(u64, PinnedHost)> {
        match self.map_and_register(n) {
            Ok(p) => Ok(p),
            Err(why) => {
                tracing::debug!(backend = D::NAME, device, bytes = n, why = %why, "pinned host buffer through host_alloc");
                let p = self
                    .driver
                    .host_alloc(n)
                    .map_err(|e| e.into_error(device, n as u64))?;
                Ok((p, PinnedHost { device, how: Pinned::Allocated }))
            }
        }
        .map(|(p, h)| (p, PinnedHost { device, ..h }))
    }

    /// An anonymous huge-page mapping of `n` bytes (rounded up), faulted in in parallel and
    /// registered; or why not (nothing left behind).
    fn map_and_register(&self, n: usize) -> std::result::Result<(u64, PinnedHost), String> {
        let len = n.checked_next_multiple_of(HUGE).ok_or("size overflows")?;
        // Accounted at mmap (no MAP_NORESERVE): a request the host cannot hold fails here,
        // cleanly, rather than in the page faults below.
        // SAFETY: a new private anonymous mapping at an address the kernel picks: it aliases
        // nothing.
        let base = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                len,
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                rustix::mm::MapFlags::PRIVATE,
            )
        }
        .map_err(|e| format!("mmap: {e}"))?;
        // SAFETY: our own mapping just made; advice changes no contents. Failure (no THP
        // in this kernel) only costs speed.
        let _ = unsafe { rustix::mm::madvise(base, len, rustix::mm::Advice::LinuxHugepage) };
        fault_in(base as usize, len);
        // SAFETY: the mapping stays until free (which unregisters first).
        match unsafe { self.driver.host_register(base as u64, len) } {
            Ok(()) => Ok((
                base as u64,
                PinnedHost {
                    device: 0,
                    how: Pinned::Registered(len),
                },
            )),
            Err(e) => {
                // SAFETY: our own mapping, unregistered, used by nothing: unmapped once.
                let _ = unsafe { rustix::mm::munmap(base, len) };
                Err(format!("{}: {}", e.call, e.message))
            }
        }
    }

    /// Free pinned host memory `p`, just taken out of the `host` registry.
    pub(super) fn free_pinned(&self, p: u64, host: PinnedHost) {
        let device = host.device;
        let Ok((_state, _current)) = self.make_current(device) else {
            tracing::warn!(
                backend = D::NAME,
                device,
                ptr = p,
                "freeing pinned host memory failed (no context): leaked"
            );
            return;
        };
        match host.how {
            // SAFETY: `p` came from host_alloc (it was in the registry, now removed, so it
            // is freed once); its buffer was given up, so nothing uses it.
            Pinned::Allocated => warn_undo(device, unsafe { self.driver.host_free(p) }),
            Pinned::Registered(len) => {
                // SAFETY: registered by map_and_register, taken out of the registry (once),
                // its buffer given up: nothing copies to or from it.
                if let Err(e) = unsafe { self.driver.host_unregister(p) } {
                    let e: Error = e.into_error(device, len as u64);
                    tracing::warn!(backend = D::NAME, error = %e, "unregistering a host buffer failed: its mapping is kept (leaked)");
                    return;
                }
                // SAFETY: our own mapping of `len` bytes at `p`, no longer registered or
                // used: unmapped once.
                if let Err(e) = unsafe { rustix::mm::munmap(p as *mut c_void, len) } {
                    tracing::warn!(backend = D::NAME, error = %e, "munmap of a host buffer failed");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fault_in_touches_every_page_of_a_fresh_mapping_from_several_threads() {
        let len = 3 * PARALLEL_FROM / 2 + 4096; // parallel, and not a multiple of a chunk
                                                // SAFETY: a new private anonymous mapping, unmapped below.
        let base = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                len,
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                rustix::mm::MapFlags::PRIVATE,
            )
        }
        .expect("mmap");
        fault_in(base as usize, len);
        // SAFETY: the mapping is `len` readable bytes, faulted in, no other reference.
        let bytes = unsafe { std::slice::from_raw_parts(base as *const u8, len) };
        assert!(bytes.iter().step_by(4096).all(|&b| b == 0));
        let mut resident = vec![0u8; len.div_ceil(4096)];
        // SAFETY: our mapping and a vector of one byte per page, as mincore needs.
        let r = unsafe { libc::mincore(base, len, resident.as_mut_ptr()) };
        assert_eq!(r, 0);
        assert!(
            resident.iter().all(|&p| p & 1 == 1),
            "a page was not faulted in"
        );
        // SAFETY: our mapping, unmapped once.
        unsafe { rustix::mm::munmap(base, len) }.expect("munmap");
    }
}
