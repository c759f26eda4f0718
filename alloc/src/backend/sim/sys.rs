//! Every system call of the sim, one small function each: memfd, ftruncate, mmap, munmap,
//! fstat, dup. The only `unsafe` code of the backend lives here.

use std::ffi::c_void;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::fs::{FileType, MemfdFlags};
use rustix::mm::{MapFlags, ProtFlags};

use super::NAME;
use crate::error::{Error, Result};

/// A live `mmap` made by [`map_shared`]. Only this module creates one (its fields are
/// private), and every `Region` is unmapped at most once: the backend drops it from its
/// state right after a successful [`unmap`].
#[derive(Debug)]
pub(super) struct Region {
    addr: usize,
    len: usize,
}

impl Region {
    /// The address of the first byte.
    pub(super) fn base(&self) -> u64 {
        self.addr as u64
    }

    /// Its length in bytes.
    pub(super) fn len(&self) -> u64 {
        self.len as u64
    }

    /// The part `offset..offset + len` of this region, as a region of its own (a chunk of a
    /// grown arena, a window of a split arena, a run of kept chunks, the mapped part of a
    /// growable arena's reservation). The caller never unmaps both the whole and a part:
    /// after a split or a chunk drop only the parts are kept, disjoint (see [`unmap`]).
    pub(super) fn part(&self, offset: u64, len: u64) -> Region {
        Region {
            addr: self.addr + offset as usize,
            len: len as usize,
        }
    }
}

/// A failed system call as [`Error::Backend`].
pub(super) fn sys_err(call: &'static str, err: rustix::io::Errno) -> Error {
    Error::Backend {
        backend: NAME,
        call,
        message: err.to_string(),
    }
}

/// `mmap(NULL, len, READ | WRITE, MAP_SHARED, fd, 0)`.
pub(super) fn map_shared(fd: BorrowedFd<'_>, len: usize) -> Result<Region> {
    // SAFETY: with a null address hint the kernel picks a range that no existing mapping
    // uses, so no memory the process relies on is replaced; `fd` is open for the whole
    // call; the new range is reached only through raw addresses, never Rust references.
    let ptr = unsafe {
        rustix::mm::mmap(
            std::ptr::null_mut(),
            len,
            ProtFlags::READ | ProtFlags::WRITE,
            MapFlags::SHARED,
            fd,
            0,
        )
    }
    .map_err(|e| sys_err("mmap", e))?;
    Ok(Region {
        addr: ptr as usize,
        len,
    })
}

/// An inaccessible anonymous reservation of `len` bytes
/// (`mmap(NULL, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE)`): the address
/// range of a growable arena or of a grown arena's import, mapped over part by part.
pub(super) fn reserve(len: usize) -> Result<Region> {
    // SAFETY: with a null address hint the kernel picks a range no existing mapping uses; the
    // reservation is inaccessible and reached only through raw addresses.
    let ptr = unsafe {
        rustix::mm::mmap_anonymous(
            std::ptr::null_mut(),
            len,
            ProtFlags::empty(),
            MapFlags::PRIVATE | MapFlags::NORESERVE,
        )
    }
    .map_err(|e| sys_err("mmap", e))?;
    Ok(Region {
        addr: ptr as usize,
        len,
    })
}

/// `munmap` a region made by [`map_shared`] or [`reserve`]. The caller removes the region from the state
/// after this succeeds, so it is never unmapped twice.
pub(super) fn unmap(region: &Region) -> Result<()> {
    // SAFETY: `region` came from `map_shared` or `reserve` (only this module builds one), or
    // is a part of one, and is still mapped: a region leaves the backend's state right
    // after its one successful unmap, and a part unmapped on its own (a split's gap, a
    // dropped chunk) belongs to no region kept. The sim never creates Rust references into
    // it; callers hold only the raw address (`ArenaMem::base`, `Mapping::base`), whose
    // validity the Backend contract ends with this very call (`destroy_arena`,
    // `unmap_import`, `drop_chunks` for the chunks dropped) or with the backend's drop.
    unsafe { rustix::mm::munmap(region.addr as *mut c_void, region.len) }
        .map_err(|e| sys_err("munmap", e))
}

/// What `fstat` says about an fd: its inode key `(st_dev, st_ino)`, size, whether it is a
/// regular file (a memfd is one).
pub(super) struct FileInfo {
    /// `(st_dev, st_ino)`: identifies the memfd across fds, dups and processes.
    pub(super) key: (u64, u64),
    /// `st_size` in bytes.
    pub(super) size: u64,
    /// Whether it is a regular file (memfds are).
    pub(super) regular: bool,
}

/// `fstat(fd)`, reduced to what the sim needs.
pub(super) fn file_info(fd: BorrowedFd<'_>) -> rustix::io::Result<FileInfo> {
    let st = rustix::fs::fstat(fd)?;
    Ok(FileInfo {
        key: (st.st_dev, st.st_ino),
        size: u64::try_from(st.st_size).unwrap_or(0),
        regular: FileType::from_raw_mode(st.st_mode) == FileType::RegularFile,
    })
}

/// `memfd_create(name, MFD_CLOEXEC)` + `ftruncate(bytes)`: a memfd whose pages are only
/// allocated when written.
pub(super) fn create_memfd(name: &str, bytes: u64) -> Result<OwnedFd> {
    let memfd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC)
        .map_err(|e| sys_err("memfd_create", e))?;
    rustix::fs::ftruncate(&memfd, bytes).map_err(|e| sys_err("ftruncate", e))?;
    Ok(memfd)
}

/// `fcntl(fd, F_DUPFD_CLOEXEC, 0)`: a new fd for the same open file.
pub(super) fn dup_cloexec(fd: BorrowedFd<'_>) -> Result<OwnedFd> {
    rustix::io::fcntl_dupfd_cloexec(fd.as_fd(), 0).map_err(|e| sys_err("fcntl_dupfd_cloexec", e))
}

/// Replace the pages of `region` with an inaccessible anonymous reservation
/// (`mmap(addr, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE)`):
/// the memfd's pages are no longer mapped there, the addresses stay taken.
pub(super) fn reserve_over(region: &Region) -> Result<()> {
    // SAFETY: `region` is a live mapping of this module (see `unmap`); MAP_FIXED replaces
    // exactly its pages and nothing else. The Backend contract ends the validity of the
    // arena's addresses for the caller until `map_over` maps memory there again.
    unsafe {
        rustix::mm::mmap_anonymous(
            region.addr as *mut c_void,
            region.len,
            ProtFlags::empty(),
            MapFlags::PRIVATE | MapFlags::FIXED | MapFlags::NORESERVE,
        )
    }
    .map(|_| ())
    .map_err(|e| sys_err("mmap", e))
}

/// Map `fd` read-write and shared over `region`'s addresses (`MAP_FIXED`, replacing the
/// reservation [`reserve_over`] left).
pub(super) fn map_over(region: &Region, fd: BorrowedFd<'_>) -> Result<()> {
    map_over_at(region, fd, 0)
}

/// Map `fd` from byte `offset` read-write and shared over `region`'s addresses (`MAP_FIXED`):
/// replaces a reservation (a new or grown chunk's place, a wake), or, in a split, the pages
/// of the arena being split with a window's new memfd holding the same bytes (and the old
/// chunks' memfds back on failure).
pub(super) fn map_over_at(region: &Region, fd: BorrowedFd<'_>, offset: u64) -> Result<()> {
    // SAFETY: `region` is one of this module's regions (or a part of one): MAP_FIXED replaces
    // exactly its pages, which either nothing reads (an inaccessible reservation) or hold the
    // same bytes before and after (a split, during which the Backend contract keeps every
    // user away from the arena).
    unsafe {
        rustix::mm::mmap(
            region.addr as *mut c_void,
            region.len,
            ProtFlags::READ | ProtFlags::WRITE,
            MapFlags::SHARED | MapFlags::FIXED,
            fd,
            offset,
        )
    }
    .map(|_| ())
    .map_err(|e| sys_err("mmap", e))
}

/// Copy `len` bytes from the sim mapping at `src` to the one at `dst` (a split's copy).
/// The caller checked both ranges: each lies inside one live mapping of this module, and
/// they do not overlap (different mappings).
pub(super) fn copy_between(dst: u64, src: u64, len: u64) {
    // SAFETY: the caller's check above; nothing else reaches either mapping during the call
    // (a split holds the backend's lock, and the Backend contract keeps users away).
    unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, len as usize) }
}

/// Copy `dst.len()` bytes from address `src`. The caller checked that `src..src + len` lies
/// inside one live, mapped arena region of the sim.
pub(super) fn read_at(src: u64, dst: &mut [u8]) {
    // SAFETY: the caller's check: the source is mapped read-write memory of a live region,
    // which cannot overlap `dst` (a Rust-owned buffer, never a sim mapping).
    unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst.as_mut_ptr(), dst.len()) }
}

/// Copy `src` to address `dst`. The caller checked that `dst..dst + len` lies inside one
/// live, mapped arena region of the sim.
pub(super) fn write_at(dst: u64, src: &[u8]) {
    // SAFETY: as in `read_at`, in the other direction.
    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut u8, src.len()) }
}
