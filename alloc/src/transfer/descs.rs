//! Descriptor checks and address translation, pure: which copies a transfer request makes,
//! or why it is refused. The engine (`engine.rs`) holds the registrations; this module only
//! reads them.

use crate::error::{Error, Result};
use crate::ids::DeviceId;

/// One descriptor of a transfer as NIXL passes it: a range and the metadata (a local
/// registration or a loaded remote one) it lies in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(C)]
pub struct Desc {
    /// First byte (in the owner's address space: a remote descriptor's address is the
    /// producer's).
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// The metadata id the backend handed out for the registration it lies in.
    pub md: u64,
}

/// What a metadata id names, as the translation needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    /// Start of the registered range in its owner's address space.
    pub addr: u64,
    /// Its length.
    pub len: u64,
    /// Where `addr` is mapped in this process.
    pub local: u64,
    /// The device the memory is on (local) or mapped for (an import).
    pub device: DeviceId,
}

/// The direction of a transfer, from the initiator's side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Remote to local.
    Read,
    /// Local to remote.
    Write,
}

/// One copy of a request, in this process's addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Copy {
    /// Destination address.
    pub dst: u64,
    /// Source address.
    pub src: u64,
    /// Bytes.
    pub len: u64,
    /// The device whose stream runs it (the local descriptor's).
    pub device: DeviceId,
}

/// The copies of a request: descriptor `i` of `local` pairs with descriptor `i` of `remote`
/// (same length); `lookup_local` / `lookup_remote` resolve a metadata id (`None`: unknown,
/// or an error naming why it cannot be used). Refused, with the index of the first bad
/// descriptor, when the lists differ in length, a length differs or is 0, or a range runs
/// outside its registration.
pub fn plan(
    op: Op,
    local: &[Desc],
    remote: &[Desc],
    mut lookup_local: impl FnMut(u64) -> Result<Span>,
    mut lookup_remote: impl FnMut(u64) -> Result<Span>,
) -> Result<Vec<Copy>> {
    if local.len() != remote.len() {
        return Err(Error::invalid(format!(
            "transfer: {} local descriptors but {} remote ones",
            local.len(),
            remote.len()
        )));
    }
    let mut copies = Vec::with_capacity(local.len());
    for (i, (l, r)) in local.iter().zip(remote).enumerate() {
        if l.len != r.len || l.len == 0 {
            return Err(Error::invalid(format!(
                "transfer descriptor {i}: local length {} and remote length {} (must be equal and non-zero)",
                l.len, r.len
            )));
        }
        let ls = lookup_local(l.md).map_err(|e| at(i, "local", e))?;
        let rs = lookup_remote(r.md).map_err(|e| at(i, "remote", e))?;
        let lp = inside(&ls, l).map_err(|e| at(i, "local", e))?;
        let rp = inside(&rs, r).map_err(|e| at(i, "remote", e))?;
        let (dst, src) = match op {
            Op::Read => (lp, rp),
            Op::Write => (rp, lp),
        };
        copies.push(Copy {
            dst,
            src,
            len: l.len,
            device: ls.device,
        });
    }
    Ok(copies)
}

/// `d`'s address in this process, if `d` lies inside `span`.
fn inside(span: &Span, d: &Desc) -> Result<u64> {
    let end = d.addr.checked_add(d.len);
    let fits = d.addr >= span.addr && end.is_some_and(|e| e <= span.addr + span.len);
    if !fits {
        return Err(Error::invalid(format!(
            "[{:#x}, +{}) runs outside its registration [{:#x}, +{})",
            d.addr, d.len, span.addr, span.len
        )));
    }
    Ok(span.local + (d.addr - span.addr))
}

/// `e` about descriptor `i`: the same kind (a revoked registration stays a state error).
fn at(i: usize, side: &str, e: Error) -> Error {
    let words = format!("transfer descriptor {i} ({side}): {e}");
    match e {
        Error::InvalidState(_) => Error::InvalidState(words),
        _ => Error::InvalidArgument(words),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn span(addr: u64, len: u64, local: u64) -> Result<Span> {
        Ok(Span {
            addr,
            len,
            local,
            device: 0,
        })
    }

    #[test]
    fn read_and_write_translate_remote_addresses() {
        let local = [Desc {
            addr: 0x1000,
            len: 16,
            md: 1,
        }];
        let remote = [Desc {
            addr: 0x9010,
            len: 16,
            md: 2,
        }];
        let lookup_l = |_| span(0x1000, 64, 0x1000);
        let lookup_r = |_| span(0x9000, 64, 0x5000);
        let read = plan(Op::Read, &local, &remote, lookup_l, lookup_r).unwrap();
        assert_eq!(
            (read[0].dst, read[0].src, read[0].len),
            (0x1000, 0x5010, 16)
        );
        let write = plan(Op::Write, &local, &remote, lookup_l, lookup_r).unwrap();
        assert_eq!((write[0].dst, write[0].src), (0x5010, 0x1000));
    }

    #[test]
    fn bad_descriptors_are_refused_with_their_index() {
        let ok = Desc {
            addr: 0x9000,
            len: 8,
            md: 2,
        };
        let lookup_l = |_| span(0x1000, 64, 0x1000);
        let lookup_r = |_| span(0x9000, 64, 0x5000);
        let local = [
            Desc {
                addr: 0x1000,
                len: 8,
                md: 1,
            },
            Desc {
                addr: 0x1000,
                len: 8,
                md: 1,
            },
        ];
        let past_end = Desc {
            addr: 0x9000 + 60,
            len: 8,
            md: 2,
        };
        let before = Desc {
            addr: 0x8ff8,
            len: 8,
            md: 2,
        };
        let overflow = Desc {
            addr: u64::MAX - 2,
            len: 8,
            md: 2,
        };
        for bad in [past_end, before, overflow] {
            let e = plan(Op::Read, &local, &[ok, bad], lookup_l, lookup_r).unwrap_err();
            assert!(e.to_string().contains("descriptor 1 (remote)"), "{e}");
        }
        let e = plan(Op::Read, &local, &[ok], lookup_l, lookup_r).unwrap_err();
        assert!(e.to_string().contains("2 local descriptors but 1"), "{e}");
        let short = Desc {
            addr: 0x9000,
            len: 4,
            md: 2,
        };
        assert!(plan(Op::Read, &local, &[ok, short], lookup_l, lookup_r).is_err());
        let unknown = |_| Err(Error::invalid("no such metadata"));
        let e = plan(Op::Read, &local, &[ok, ok], lookup_l, unknown).unwrap_err();
        assert!(
            e.to_string()
                .contains("descriptor 0 (remote): invalid argument: no such metadata")
                || e.to_string().contains("no such metadata"),
            "{e}"
        );
    }
}
