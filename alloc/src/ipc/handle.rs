//! The share handle: a fixed-size POD (no pointers, no fds) that names one shared range.
//!
//! It travels as 128 bytes (pickle, HTTP, a pipe) and carries everything a consumer needs to
//! reach the producer's broker and ask for the memory: the producer's pid and socket name,
//! the arena (id and export generation), the range (offset and length), the device, and a
//! 128-bit random token the broker checks. Layout (little-endian):
//!
//! | bytes | field |
//! |---|---|
//! | 0..8 | magic `b"GPUARENA"` |
//! | 8..10 | version (1) |
//! | 10..12 | reserved, 0 |
//! | 12..16 | device (i32) |
//! | 16..20 | producer pid |
//! | 20..24 | share key |
//! | 24..32 | arena id |
//! | 32..36 | export generation |
//! | 36..40 | reserved, 0 |
//! | 40..48 | offset in the arena, bytes |
//! | 48..56 | length, bytes |
//! | 56..64 | arena size, bytes |
//! | 64..80 | token |
//! | 80..128 | socket name (abstract namespace), NUL-padded |

use std::sync::Arc;

use crate::backend::DeviceId;
use crate::error::{Error, Result};
use crate::pool::ShareInfo;

/// Size of an encoded handle in bytes.
pub const HANDLE_BYTES: usize = 128;
/// The handle format version this build writes and accepts.
pub const HANDLE_VERSION: u16 = 1;
const MAGIC: &[u8; 8] = b"GPUARENA";
/// Longest socket name a handle carries.
pub const MAX_SOCKET_NAME: usize = 48;

/// A decoded share handle. See the module docs for the byte layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShareHandle {
    /// Producer process id.
    pub producer_pid: u32,
    /// Producer broker's socket name (abstract namespace, without the leading NUL). Shared:
    /// a share or an import copies a pointer, not the name.
    pub socket_name: Arc<str>,
    /// The share as the producer's pool knows it.
    pub info: ShareInfo,
}

/// The share's range is a non-empty part of its arena.
pub(crate) fn check_range(info: &ShareInfo) -> Result<()> {
    let in_bounds = info.len > 0
        && info
            .offset
            .checked_add(info.len)
            .is_some_and(|end| end <= info.arena_bytes);
    if in_bounds {
        Ok(())
    } else {
        Err(Error::Ipc(format!(
            "share handle range [{}, +{}) lies outside its {}-byte arena",
            info.offset, info.len, info.arena_bytes
        )))
    }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut x = [0u8; 4];
    x.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(x)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(x)
}

impl ShareHandle {
    /// Encode as [`HANDLE_BYTES`] bytes.
    pub fn to_bytes(&self) -> [u8; HANDLE_BYTES] {
        let mut b = [0u8; HANDLE_BYTES];
        let i = &self.info;
        b[0..8].copy_from_slice(MAGIC);
        b[8..10].copy_from_slice(&HANDLE_VERSION.to_le_bytes());
        b[12..16].copy_from_slice(&i.device.to_le_bytes());
        b[16..20].copy_from_slice(&self.producer_pid.to_le_bytes());
        b[20..24].copy_from_slice(&i.share_key.to_le_bytes());
        b[24..32].copy_from_slice(&i.arena_id.to_le_bytes());
        b[32..36].copy_from_slice(&i.generation.to_le_bytes());
        b[40..48].copy_from_slice(&i.offset.to_le_bytes());
        b[48..56].copy_from_slice(&i.len.to_le_bytes());
        b[56..64].copy_from_slice(&i.arena_bytes.to_le_bytes());
        b[64..80].copy_from_slice(&i.token);
        let name = self.socket_name.as_bytes();
        let n = name.len().min(MAX_SOCKET_NAME);
        b[80..80 + n].copy_from_slice(&name[..n]);
        b
    }

    /// Decode and validate: magic, version, reserved bytes, range inside the arena, socket
    /// name. Anything wrong is a clear [`Error::Ipc`].
    pub fn from_bytes(bytes: &[u8]) -> Result<ShareHandle> {
        if bytes.len() != HANDLE_BYTES {
            return Err(Error::Ipc(format!(
                "share handle is {} bytes, expected {HANDLE_BYTES}",
                bytes.len()
            )));
        }
        if &bytes[0..8] != MAGIC {
            return Err(Error::Ipc(
                "not a gpu-arena share handle (bad magic)".into(),
            ));
        }
        let version = u16::from_le_bytes([bytes[8], bytes[9]]);
        if version != HANDLE_VERSION {
            return Err(Error::Ipc(format!(
                "share handle version {version}, this gpu-arena speaks version {HANDLE_VERSION}"
            )));
        }
        if bytes[10..12] != [0, 0] || bytes[36..40] != [0; 4] {
            return Err(Error::Ipc(
                "share handle has non-zero reserved bytes".into(),
            ));
        }
        let device = u32_at(bytes, 12) as DeviceId;
        let producer_pid = u32_at(bytes, 16);
        let mut token = [0u8; 16];
        token.copy_from_slice(&bytes[64..80]);
        let info = ShareInfo {
            device,
            share_key: u32_at(bytes, 20),
            arena_id: u64_at(bytes, 24),
            generation: u32_at(bytes, 32),
            offset: u64_at(bytes, 40),
            len: u64_at(bytes, 48),
            arena_bytes: u64_at(bytes, 56),
            token,
        };
        if device < 0 {
            return Err(Error::Ipc(format!("share handle names device {device}")));
        }
        if producer_pid == 0 {
            return Err(Error::Ipc("share handle names no producer".into()));
        }
        check_range(&info)?;
        let raw_name = &bytes[80..128];
        let end = raw_name
            .iter()
            .position(|&c| c == 0)
            .unwrap_or(raw_name.len());
        if end == 0 || raw_name[end..].iter().any(|&c| c != 0) {
            return Err(Error::Ipc(
                "share handle has a malformed socket name".into(),
            ));
        }
        let socket_name = std::str::from_utf8(&raw_name[..end])
            .ok()
            .filter(|s| s.chars().all(|c| c.is_ascii_graphic()))
            .ok_or_else(|| Error::Ipc("share handle socket name is not printable ASCII".into()))?
            .into();
        Ok(ShareHandle {
            producer_pid,
            socket_name,
            info,
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn sample() -> ShareHandle {
        ShareHandle {
            producer_pid: 4242,
            socket_name: "gpu-arena.4242.0123abcd".into(),
            info: ShareInfo {
                device: 1,
                share_key: 7,
                arena_id: 3,
                generation: 2,
                arena_bytes: 1 << 30,
                offset: 2 << 20,
                len: 4096,
                token: [9; 16],
            },
        }
    }

    #[test]
    fn round_trip() {
        let h = sample();
        assert_eq!(ShareHandle::from_bytes(&h.to_bytes()).unwrap(), h);
    }

    #[test]
    fn every_corruption_is_refused() {
        let good = sample().to_bytes();
        type Corrupt = Box<dyn Fn(&mut [u8; HANDLE_BYTES])>;
        let cases: Vec<(&str, Corrupt)> = vec![
            ("magic", Box::new(|b| b[0] = b'X')),
            ("version", Box::new(|b| b[8] = 2)),
            ("reserved", Box::new(|b| b[37] = 1)),
            ("negative device", Box::new(|b| b[15] = 0x80)),
            ("no producer", Box::new(|b| b[16..20].fill(0))),
            ("zero length", Box::new(|b| b[48..56].fill(0))),
            ("past the arena", Box::new(|b| b[47] = 0x7f)),
            ("overflow", Box::new(|b| b[40..56].fill(0xff))),
            ("empty socket name", Box::new(|b| b[80] = 0)),
            ("garbage after name", Box::new(|b| b[127] = b'x')),
            ("unprintable name", Box::new(|b| b[81] = 0x07)),
        ];
        for (what, corrupt) in cases {
            let mut b = good;
            corrupt(&mut b);
            let e = ShareHandle::from_bytes(&b).unwrap_err();
            assert!(matches!(e, Error::Ipc(_)), "{what}: {e}");
        }
        assert!(ShareHandle::from_bytes(&good[..100]).is_err());
    }
}
