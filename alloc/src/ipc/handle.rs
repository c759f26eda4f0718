//! The share handle: a fixed-size POD (no pointers, no fds) that names one shared range.
//!
//! It travels as 128 bytes (pickle, HTTP, a pipe) and carries everything a consumer needs to
//! reach the producer's broker and ask for the memory: the producer's pid and socket name,
//! the arena (id and export generation), the range (offset and length), the device, and a
//! 128-bit random token the broker checks. Layout (little-endian; [`layout::FIELDS`] is the
//! definition, checked against this table by a test; the C API hands it out as
//! `gpu_arena_share_layout`, which the Python package's decoder is tested against):
//!
//! | bytes | field | |
//! |---|---|---|
//! | 0..8 | `magic` | `b"GPUARENA"` |
//! | 8..10 | `version` | 1 |
//! | 10..12 | `reserved0` | 0 |
//! | 12..16 | `device` | i32 |
//! | 16..20 | `producer_pid` | u32 |
//! | 20..24 | `share_key` | u32 |
//! | 24..32 | `arena_id` | u64 |
//! | 32..36 | `generation` | u32, the arena's export generation |
//! | 36..40 | `reserved1` | 0 |
//! | 40..48 | `offset` | u64, the range's offset in the arena, bytes |
//! | 48..56 | `len` | u64, the range's length, bytes |
//! | 56..64 | `arena_bytes` | u64, the arena's size |
//! | 64..80 | `token` | 16 random bytes |
//! | 80..128 | `socket_name` | the broker's socket (abstract namespace), NUL-padded |

use std::sync::Arc;

use crate::backend::DeviceId;
use crate::error::{Error, Result};
use crate::pool::ShareInfo;

/// Size of an encoded handle in bytes.
pub const HANDLE_BYTES: usize = 128;
/// The handle format version this build writes and accepts.
pub const HANDLE_VERSION: u16 = 1;
/// The first bytes of every handle.
pub const HANDLE_MAGIC: &[u8; 8] = b"GPUARENA";
/// Longest socket name a handle carries.
pub const MAX_SOCKET_NAME: usize = layout::SOCKET_NAME.len;

/// The encoded handle's fields: name, first byte and length of each, in byte order, reserved
/// bytes included. The one definition of the layout: the encoder and decoder below use it,
/// the C API hands it out (`gpu_arena_share_layout`), and the module docs' table and the
/// Python decoder are tested against it.
pub mod layout {
    use std::ops::Range;

    /// One field of an encoded handle.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct Field {
        /// Its name (that of the decoded value where there is one: `len`, `arena_bytes`...).
        pub name: &'static str,
        /// Its first byte.
        pub offset: usize,
        /// Its length in bytes.
        pub len: usize,
    }

    impl Field {
        const fn new(name: &'static str, offset: usize, len: usize) -> Field {
            Field { name, offset, len }
        }

        /// Its bytes' range in the handle.
        pub const fn range(&self) -> Range<usize> {
            self.offset..self.offset + self.len
        }
    }

    /// [`super::HANDLE_MAGIC`].
    pub const MAGIC: Field = Field::new("magic", 0, 8);
    /// [`super::HANDLE_VERSION`], u16.
    pub const VERSION: Field = Field::new("version", 8, 2);
    /// Zero.
    pub const RESERVED0: Field = Field::new("reserved0", 10, 2);
    /// The producer's device, i32.
    pub const DEVICE: Field = Field::new("device", 12, 4);
    /// The producer's process id, u32.
    pub const PRODUCER_PID: Field = Field::new("producer_pid", 16, 4);
    /// The share's key in the producer's pool, u32.
    pub const SHARE_KEY: Field = Field::new("share_key", 20, 4);
    /// The arena's id, u64.
    pub const ARENA_ID: Field = Field::new("arena_id", 24, 8);
    /// The arena's export generation, u32.
    pub const GENERATION: Field = Field::new("generation", 32, 4);
    /// Zero.
    pub const RESERVED1: Field = Field::new("reserved1", 36, 4);
    /// The range's offset in its arena, u64.
    pub const OFFSET: Field = Field::new("offset", 40, 8);
    /// The range's length, u64.
    pub const LEN: Field = Field::new("len", 48, 8);
    /// The arena's size, u64.
    pub const ARENA_BYTES: Field = Field::new("arena_bytes", 56, 8);
    /// The random token the broker checks.
    pub const TOKEN: Field = Field::new("token", 64, 16);
    /// The broker's socket name, NUL-padded.
    pub const SOCKET_NAME: Field = Field::new("socket_name", 80, 48);

    /// Every field, in byte order.
    pub const FIELDS: [Field; 14] = [
        MAGIC,
        VERSION,
        RESERVED0,
        DEVICE,
        PRODUCER_PID,
        SHARE_KEY,
        ARENA_ID,
        GENERATION,
        RESERVED1,
        OFFSET,
        LEN,
        ARENA_BYTES,
        TOKEN,
        SOCKET_NAME,
    ];

    // The fields follow each other and cover the handle exactly.
    const _: () = {
        let mut at = 0;
        let mut i = 0;
        while i < FIELDS.len() {
            assert!(FIELDS[i].offset == at);
            at += FIELDS[i].len;
            i += 1;
        }
        assert!(at == super::HANDLE_BYTES);
    };
}

use layout::{
    ARENA_BYTES, ARENA_ID, DEVICE, GENERATION, LEN, MAGIC, OFFSET, PRODUCER_PID, RESERVED0,
    RESERVED1, SHARE_KEY, SOCKET_NAME, TOKEN, VERSION,
};

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

fn u32_at(b: &[u8], field: layout::Field) -> u32 {
    let mut x = [0u8; 4];
    x.copy_from_slice(&b[field.range()]);
    u32::from_le_bytes(x)
}

fn u64_at(b: &[u8], field: layout::Field) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[field.range()]);
    u64::from_le_bytes(x)
}

impl ShareHandle {
    /// Encode as [`HANDLE_BYTES`] bytes.
    pub fn to_bytes(&self) -> [u8; HANDLE_BYTES] {
        let mut b = [0u8; HANDLE_BYTES];
        let i = &self.info;
        b[MAGIC.range()].copy_from_slice(HANDLE_MAGIC);
        b[VERSION.range()].copy_from_slice(&HANDLE_VERSION.to_le_bytes());
        b[DEVICE.range()].copy_from_slice(&i.device.to_le_bytes());
        b[PRODUCER_PID.range()].copy_from_slice(&self.producer_pid.to_le_bytes());
        b[SHARE_KEY.range()].copy_from_slice(&i.share_key.to_le_bytes());
        b[ARENA_ID.range()].copy_from_slice(&i.arena_id.to_le_bytes());
        b[GENERATION.range()].copy_from_slice(&i.generation.to_le_bytes());
        b[OFFSET.range()].copy_from_slice(&i.offset.to_le_bytes());
        b[LEN.range()].copy_from_slice(&i.len.to_le_bytes());
        b[ARENA_BYTES.range()].copy_from_slice(&i.arena_bytes.to_le_bytes());
        b[TOKEN.range()].copy_from_slice(&i.token);
        let name = self.socket_name.as_bytes();
        let n = name.len().min(MAX_SOCKET_NAME);
        b[SOCKET_NAME.offset..SOCKET_NAME.offset + n].copy_from_slice(&name[..n]);
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
        if &bytes[MAGIC.range()] != HANDLE_MAGIC {
            return Err(Error::Ipc(
                "not a gpu-arena share handle (bad magic)".into(),
            ));
        }
        let version = u16::from_le_bytes([bytes[VERSION.offset], bytes[VERSION.offset + 1]]);
        if version != HANDLE_VERSION {
            return Err(Error::Ipc(format!(
                "share handle version {version}, this gpu-arena speaks version {HANDLE_VERSION}"
            )));
        }
        if bytes[RESERVED0.range()].iter().any(|&c| c != 0)
            || bytes[RESERVED1.range()].iter().any(|&c| c != 0)
        {
            return Err(Error::Ipc(
                "share handle has non-zero reserved bytes".into(),
            ));
        }
        let device = u32_at(bytes, DEVICE) as DeviceId;
        let producer_pid = u32_at(bytes, PRODUCER_PID);
        let mut token = [0u8; 16];
        token.copy_from_slice(&bytes[TOKEN.range()]);
        let info = ShareInfo {
            device,
            share_key: u32_at(bytes, SHARE_KEY),
            arena_id: u64_at(bytes, ARENA_ID),
            generation: u32_at(bytes, GENERATION),
            offset: u64_at(bytes, OFFSET),
            len: u64_at(bytes, LEN),
            arena_bytes: u64_at(bytes, ARENA_BYTES),
            token,
        };
        if device < 0 {
            return Err(Error::Ipc(format!("share handle names device {device}")));
        }
        if producer_pid == 0 {
            return Err(Error::Ipc("share handle names no producer".into()));
        }
        check_range(&info)?;
        let raw_name = &bytes[SOCKET_NAME.range()];
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
    fn the_module_docs_table_is_the_layout() {
        let source = include_str!("handle.rs");
        let rows: Vec<(usize, usize, &str)> = source
            .lines()
            .filter_map(|l| {
                let mut cells = l.strip_prefix("//! | ")?.split(" | ");
                let (from, to) = cells.next()?.split_once("..")?;
                let name = cells.next()?.trim_matches('`');
                Some((from.parse().ok()?, to.parse().ok()?, name))
            })
            .collect();
        let fields: Vec<(usize, usize, &str)> = layout::FIELDS
            .iter()
            .map(|f| (f.offset, f.offset + f.len, f.name))
            .collect();
        assert_eq!(rows, fields);
    }

    #[test]
    fn every_field_is_where_the_layout_says() {
        let h = sample();
        let b = h.to_bytes();
        let at = |f: layout::Field| &b[f.range()];
        let i = &h.info;
        assert_eq!(at(MAGIC), HANDLE_MAGIC);
        assert_eq!(at(VERSION), HANDLE_VERSION.to_le_bytes());
        assert_eq!(at(DEVICE), i.device.to_le_bytes());
        assert_eq!(at(PRODUCER_PID), h.producer_pid.to_le_bytes());
        assert_eq!(at(SHARE_KEY), i.share_key.to_le_bytes());
        assert_eq!(at(ARENA_ID), i.arena_id.to_le_bytes());
        assert_eq!(at(GENERATION), i.generation.to_le_bytes());
        assert_eq!(at(OFFSET), i.offset.to_le_bytes());
        assert_eq!(at(LEN), i.len.to_le_bytes());
        assert_eq!(at(ARENA_BYTES), i.arena_bytes.to_le_bytes());
        assert_eq!(at(TOKEN), i.token);
        assert!(at(RESERVED0).iter().chain(at(RESERVED1)).all(|&c| c == 0));
        let name = at(SOCKET_NAME);
        assert_eq!(&name[..h.socket_name.len()], h.socket_name.as_bytes());
        assert!(name[h.socket_name.len()..].iter().all(|&c| c == 0));
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
