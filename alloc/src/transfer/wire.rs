//! The messages transfer engines send each other over their datagram sockets, and the
//! public data of a registration. Both are plain bytes with one layout each, encoded and
//! decoded here and nowhere else.
//!
//! A message is `MAGIC` (4 bytes), a kind byte, then its fields: `u64` little endian and
//! strings as a `u32` length and UTF-8 bytes (a notification's body as bytes).

use crate::error::{Error, Result};
use crate::ipc::{ShareHandle, HANDLE_BYTES};

/// The first bytes of every message.
const MAGIC: [u8; 4] = *b"GAX1";

/// The longest notification body (bytes): a datagram must fit the socket's buffer.
pub const MAX_NOTIF_BYTES: usize = 32 * 1024;

/// The longest agent or socket name (bytes).
pub const MAX_NAME_BYTES: usize = 256;

/// One message between engines.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    /// A notification for the receiving agent (`genNotif`, or a transfer's completion).
    Notif {
        /// The agent that sent it.
        from: String,
        /// Its body, as the sender gave it.
        body: Vec<u8>,
    },
    /// A consumer imported registration `key` of the receiving producer; tell it at
    /// `reply_to` when the registration goes.
    Loaded {
        /// The consumer agent.
        from: String,
        /// The consumer's socket name.
        reply_to: String,
        /// The producer's registration key.
        key: u64,
    },
    /// A consumer closed its import of registration `key` (unload, or a revocation done).
    Unloaded {
        /// The consumer agent.
        from: String,
        /// The producer's registration key.
        key: u64,
    },
    /// The producer takes registration `key` back: finish what uses it, close the import.
    /// `asleep`: only while its memory sleeps (ask for it again with `Reload` after).
    Revoke {
        /// The producer agent.
        from: String,
        /// The producer's registration key.
        key: u64,
        /// The memory goes to sleep (not away).
        asleep: bool,
    },
    /// A consumer asks for registration `key` again (after a sleep): answer at `reply_to`.
    Reload {
        /// The consumer agent.
        from: String,
        /// The consumer's socket name.
        reply_to: String,
        /// The producer's registration key.
        key: u64,
    },
    /// The answer to `Reload`: the registration's public data, "" while it sleeps.
    Reloaded {
        /// The producer agent.
        from: String,
        /// The producer's registration key.
        key: u64,
        /// [`PublicData::encode`]'s text, or "" while asleep.
        public: String,
    },
}

const NOTIF: u8 = 1;
const LOADED: u8 = 2;
const UNLOADED: u8 = 3;
const REVOKE: u8 = 4;
const RELOAD: u8 = 5;
const RELOADED: u8 = 6;

/// The longest public data (bytes): a share handle in hex and a few numbers.
const MAX_PUBLIC_BYTES: usize = 1024;

impl Message {
    /// The bytes of this message.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = MAGIC.to_vec();
        match self {
            Message::Notif { from, body } => {
                out.push(NOTIF);
                put_bytes(&mut out, from.as_bytes());
                put_bytes(&mut out, body);
            }
            Message::Loaded {
                from,
                reply_to,
                key,
            } => {
                out.push(LOADED);
                put_bytes(&mut out, from.as_bytes());
                put_bytes(&mut out, reply_to.as_bytes());
                out.extend_from_slice(&key.to_le_bytes());
            }
            Message::Unloaded { from, key } => {
                out.push(UNLOADED);
                put_bytes(&mut out, from.as_bytes());
                out.extend_from_slice(&key.to_le_bytes());
            }
            Message::Revoke { from, key, asleep } => {
                out.push(REVOKE);
                put_bytes(&mut out, from.as_bytes());
                out.extend_from_slice(&key.to_le_bytes());
                out.push(u8::from(*asleep));
            }
            Message::Reload {
                from,
                reply_to,
                key,
            } => {
                out.push(RELOAD);
                put_bytes(&mut out, from.as_bytes());
                put_bytes(&mut out, reply_to.as_bytes());
                out.extend_from_slice(&key.to_le_bytes());
            }
            Message::Reloaded { from, key, public } => {
                out.push(RELOADED);
                put_bytes(&mut out, from.as_bytes());
                out.extend_from_slice(&key.to_le_bytes());
                put_bytes(&mut out, public.as_bytes());
            }
        }
        out
    }

    /// Decode a message; anything malformed is an error, never a panic.
    pub fn decode(bytes: &[u8]) -> Result<Message> {
        let mut r = Reader { bytes, at: 0 };
        if r.take(4)? != MAGIC {
            return Err(bad("not a gpu-arena transfer message (wrong magic)"));
        }
        let kind = r.take(1)?[0];
        let msg = match kind {
            NOTIF => Message::Notif {
                from: r.name()?,
                body: r.field(MAX_NOTIF_BYTES)?.to_vec(),
            },
            LOADED => Message::Loaded {
                from: r.name()?,
                reply_to: r.name()?,
                key: r.u64()?,
            },
            UNLOADED => Message::Unloaded {
                from: r.name()?,
                key: r.u64()?,
            },
            REVOKE => Message::Revoke {
                from: r.name()?,
                key: r.u64()?,
                asleep: match r.take(1)?[0] {
                    0 => false,
                    1 => true,
                    _ => return Err(bad("a flag that is neither 0 nor 1")),
                },
            },
            RELOAD => Message::Reload {
                from: r.name()?,
                reply_to: r.name()?,
                key: r.u64()?,
            },
            RELOADED => Message::Reloaded {
                from: r.name()?,
                key: r.u64()?,
                public: String::from_utf8(r.field(MAX_PUBLIC_BYTES)?.to_vec())
                    .map_err(|_| bad("public data that is not UTF-8"))?,
            },
            k => return Err(bad(&format!("unknown message kind {k}"))),
        };
        if r.at != bytes.len() {
            return Err(bad("trailing bytes after the message"));
        }
        Ok(msg)
    }
}

/// What a producer publishes for one registration (NIXL's `getPublicData`): the consumer
/// imports the share and tells the producer at `socket` that it did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublicData {
    /// The producer's engine socket name.
    pub socket: String,
    /// The producer's registration key.
    pub key: u64,
    /// The registered range's address in the producer.
    pub addr: u64,
    /// Its length in bytes.
    pub len: u64,
    /// The share of that range.
    pub share: ShareHandle,
}

/// The prefix of public data as text.
const PUBLIC_PREFIX: &str = "gpu-arena-xfer/1";

impl PublicData {
    /// As text (NIXL passes metadata as strings): fields separated by `;`, the share
    /// handle in hex.
    pub fn encode(&self) -> String {
        let hex: String = self
            .share
            .to_bytes()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        format!(
            "{PUBLIC_PREFIX};{};{};{};{};{hex}",
            self.socket, self.key, self.addr, self.len
        )
    }

    /// Parse [`PublicData::encode`]'s text; anything else is a clear error.
    pub fn decode(text: &str) -> Result<PublicData> {
        let bad_md = |why: &str| {
            Error::invalid(format!(
                "remote metadata is not a gpu-arena registration ({why}); was it made by the GPU_ARENA backend of a matching version?"
            ))
        };
        let parts: Vec<&str> = text.split(';').collect();
        let [prefix, socket, key, addr, len, hex] = parts[..] else {
            return Err(bad_md("wrong number of fields"));
        };
        if prefix != PUBLIC_PREFIX {
            return Err(bad_md("wrong prefix"));
        }
        if socket.is_empty() || socket.len() > MAX_NAME_BYTES {
            return Err(bad_md("bad socket name"));
        }
        let num = |s: &str| s.parse::<u64>().map_err(|_| bad_md("bad number"));
        // ASCII first: the pairs below are sliced by byte (a multi-byte character would
        // split; found by the transfer_wire fuzz target).
        if hex.len() != 2 * HANDLE_BYTES || !hex.is_ascii() {
            return Err(bad_md("bad share handle length or characters"));
        }
        let mut raw = [0u8; HANDLE_BYTES];
        for (i, b) in raw.iter_mut().enumerate() {
            *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16)
                .map_err(|_| bad_md("bad share handle hex"))?;
        }
        let share = ShareHandle::from_bytes(&raw)?;
        let (addr, len) = (num(addr)?, num(len)?);
        if len == 0 || addr.checked_add(len).is_none() || len != share.info.len {
            return Err(bad_md("range does not match its share"));
        }
        Ok(PublicData {
            socket: socket.to_owned(),
            key: num(key)?,
            addr,
            len,
            share,
        })
    }
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    // Lengths are bounded by MAX_NOTIF_BYTES / MAX_NAME_BYTES before anything is encoded.
    out.extend_from_slice(&(b.len() as u32).to_le_bytes());
    out.extend_from_slice(b);
}

fn bad(why: &str) -> Error {
    Error::Ipc(format!("transfer message: {why}"))
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.bytes.len());
        let end = end.ok_or_else(|| bad("truncated"))?;
        let out = &self.bytes[self.at..end];
        self.at = end;
        Ok(out)
    }

    fn u64(&mut self) -> Result<u64> {
        let mut x = [0u8; 8];
        x.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(x))
    }

    fn field(&mut self, max: usize) -> Result<&'a [u8]> {
        let mut n = [0u8; 4];
        n.copy_from_slice(self.take(4)?);
        let n = u32::from_le_bytes(n) as usize;
        if n > max {
            return Err(bad(&format!("a field of {n} bytes (at most {max})")));
        }
        self.take(n)
    }

    fn name(&mut self) -> Result<String> {
        let b = self.field(MAX_NAME_BYTES)?;
        String::from_utf8(b.to_vec()).map_err(|_| bad("a name that is not UTF-8"))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_and_garbage_is_refused() {
        let all = [
            Message::Notif {
                from: "decode-0".into(),
                body: b"req-17 done\0\xff".to_vec(),
            },
            Message::Loaded {
                from: "decode-0".into(),
                reply_to: "gpu-arena-xfer.1.ab".into(),
                key: 7,
            },
            Message::Unloaded {
                from: "d".into(),
                key: u64::MAX,
            },
            Message::Revoke {
                from: "prefill".into(),
                key: 0,
                asleep: true,
            },
            Message::Reload {
                from: "decode".into(),
                reply_to: "gpu-arena-xfer.2.cd".into(),
                key: 9,
            },
            Message::Reloaded {
                from: "prefill".into(),
                key: 9,
                public: String::new(),
            },
        ];
        for m in &all {
            let b = m.encode();
            assert_eq!(&Message::decode(&b).unwrap(), m);
            for cut in 0..b.len() {
                assert!(Message::decode(&b[..cut]).is_err(), "{m:?} cut at {cut}");
            }
            let mut longer = b.clone();
            longer.push(0);
            assert!(Message::decode(&longer).is_err());
        }
        let mut huge = MAGIC.to_vec();
        huge.push(NOTIF);
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(Message::decode(&huge).is_err());
        assert!(Message::decode(b"GAX1\x09").is_err());
    }

    #[test]
    fn public_data_with_a_multibyte_character_in_its_handle_is_refused() {
        // The transfer_wire fuzz target's crash-8e4b1e61: a 'Ⱦ' (2 bytes) where the hex of
        // the share handle goes, at an odd byte offset.
        let mut hex = "A".repeat(5) + "\u{23e}";
        hex.push_str(&"A".repeat(2 * HANDLE_BYTES - hex.len()));
        assert_eq!(hex.len(), 2 * HANDLE_BYTES);
        let text = format!("{PUBLIC_PREFIX};sock;1;4096;4096;{hex}");
        let e = PublicData::decode(&text).unwrap_err();
        assert!(e.to_string().contains("share handle"), "{e}");
    }
}
