//! A [`Trace`] as a flat binary file, for replayers that are not Rust (`bench/gpu/kv_bench.cpp`
//! replays it through gpu-arena's C API, the CUDA driver and PyTorch on a GPU machine).
//!
//! Layout, all integers little-endian:
//!
//! ```text
//! header (64 bytes)
//!   0  [u8; 8]  magic "KVTRACE1"
//!   8  u64      op count
//!  16  u64      peak live bytes (largest sum of requested bytes live at once)
//!  24  u64      peak live allocations
//!  32  u64      allocations (ids are 0..allocations, allocated in id order)
//!  40  u64      streams (stream indices are 0..streams)
//!  48  u64      seed of the generated trace
//!  56  u64      requests of the generated trace
//! ops (24 bytes each, op count of them)
//!   0  u8       kind: 0 alloc, 1 free
//!   1  [u8; 3]  zero
//!   4  u32      allocation id
//!   8  u64      bytes (a free repeats its allocation's bytes)
//!  16  u64      stream index (a free repeats its allocation's stream)
//! ```
//!
//! Stream indices are dense: the trace's distinct stream ids, in increasing order, become
//! `0..streams` (the default trace's streams 1 and 2 become 0 and 1). A free carries its
//! allocation's size and stream so that a replayer needs no table of its own for them (the
//! C API's free takes the size). [`read`] checks everything: magic, length, kinds, padding,
//! dense ids, that each free names a live allocation with the same bytes and stream, that
//! nothing is live at the end, and the header's peaks.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::Path;

use crate::trace::{Op, Trace};

/// The file's first eight bytes.
pub const MAGIC: [u8; 8] = *b"KVTRACE1";
/// Bytes of the header.
pub const HEADER_BYTES: usize = 64;
/// Bytes of one op.
pub const OP_BYTES: usize = 24;
/// Kind byte of an allocation.
pub const KIND_ALLOC: u8 = 0;
/// Kind byte of a free.
pub const KIND_FREE: u8 = 1;

/// The header of a trace file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Header {
    /// Number of ops that follow the header.
    pub op_count: u64,
    /// Largest sum of requested bytes live at once.
    pub peak_live_bytes: u64,
    /// Largest number of allocations live at once.
    pub peak_live_allocs: u64,
    /// Number of allocations (ids `0..allocs`).
    pub allocs: u64,
    /// Number of streams (indices `0..streams`).
    pub streams: u64,
    /// Seed the trace was generated with.
    pub seed: u64,
    /// Requests the trace was generated with.
    pub requests: u64,
}

/// One op as stored: an allocation or a free, with the allocation's size and stream index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileOp {
    /// [`KIND_ALLOC`] or [`KIND_FREE`].
    pub kind: u8,
    /// Allocation id.
    pub id: u32,
    /// Requested bytes of the allocation.
    pub bytes: u64,
    /// Dense stream index of the allocation.
    pub stream: u64,
}

/// A trace file read back: its header and its ops.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceFile {
    /// The header.
    pub header: Header,
    /// The ops, in order.
    pub ops: Vec<FileOp>,
}

/// The trace's distinct stream ids in increasing order (index = dense stream index).
pub fn stream_table(trace: &Trace) -> Vec<u64> {
    let mut m = BTreeMap::new();
    for op in &trace.ops {
        if let Op::Alloc { stream, .. } = *op {
            m.insert(stream, ());
        }
    }
    m.into_keys().collect()
}

/// The ops of `trace` as stored in a file (frees carry their allocation's bytes and stream).
pub fn file_ops(trace: &Trace) -> Result<Vec<FileOp>, String> {
    let table = stream_table(trace);
    let index: BTreeMap<u64, u64> = table
        .iter()
        .enumerate()
        .map(|(i, s)| (*s, i as u64))
        .collect();
    let mut allocs: Vec<(u64, u64)> = vec![(0, 0); trace.allocs as usize];
    let mut out = Vec::with_capacity(trace.ops.len());
    for (i, op) in trace.ops.iter().enumerate() {
        match *op {
            Op::Alloc { id, bytes, stream } => {
                let s = index[&stream];
                let slot = allocs
                    .get_mut(id as usize)
                    .ok_or_else(|| format!("op {i}: id {id} >= allocs {}", trace.allocs))?;
                *slot = (bytes, s);
                out.push(FileOp {
                    kind: KIND_ALLOC,
                    id,
                    bytes,
                    stream: s,
                });
            }
            Op::Free { id } => {
                let (bytes, stream) = *allocs
                    .get(id as usize)
                    .ok_or_else(|| format!("op {i}: free of id {id} >= allocs {}", trace.allocs))?;
                out.push(FileOp {
                    kind: KIND_FREE,
                    id,
                    bytes,
                    stream,
                });
            }
        }
    }
    Ok(out)
}

/// Write `trace` (generated with `seed` and `requests`) to `w` in the file format.
pub fn write<W: Write>(w: &mut W, trace: &Trace, seed: u64, requests: u64) -> Result<(), String> {
    trace.validate()?;
    let ops = file_ops(trace)?;
    let header = Header {
        op_count: ops.len() as u64,
        peak_live_bytes: trace.peak_live_bytes,
        peak_live_allocs: trace.peak_live_allocs,
        allocs: u64::from(trace.allocs),
        streams: stream_table(trace).len() as u64,
        seed,
        requests,
    };
    write_parts(w, &header, &ops)
}

/// Write a header and ops as they are (no checks: for tests of the reader).
pub fn write_parts<W: Write>(w: &mut W, header: &Header, ops: &[FileOp]) -> Result<(), String> {
    let mut buf = Vec::with_capacity(HEADER_BYTES + ops.len() * OP_BYTES);
    buf.extend_from_slice(&MAGIC);
    for v in [
        header.op_count,
        header.peak_live_bytes,
        header.peak_live_allocs,
        header.allocs,
        header.streams,
        header.seed,
        header.requests,
    ] {
        buf.extend_from_slice(&v.to_le_bytes());
    }
    for op in ops {
        buf.push(op.kind);
        buf.extend_from_slice(&[0u8; 3]);
        buf.extend_from_slice(&op.id.to_le_bytes());
        buf.extend_from_slice(&op.bytes.to_le_bytes());
        buf.extend_from_slice(&op.stream.to_le_bytes());
    }
    w.write_all(&buf).map_err(|e| format!("writing trace: {e}"))
}

fn le_u64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

fn le_u32(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}

/// Parse and check a whole trace file held in memory.
pub fn parse(bytes: &[u8]) -> Result<TraceFile, String> {
    if bytes.len() < HEADER_BYTES {
        return Err(format!(
            "{} bytes: shorter than the {HEADER_BYTES}-byte header",
            bytes.len()
        ));
    }
    if bytes[..8] != MAGIC {
        return Err(format!(
            "bad magic {:?} (expected \"KVTRACE1\")",
            String::from_utf8_lossy(&bytes[..8])
        ));
    }
    let header = Header {
        op_count: le_u64(bytes, 8),
        peak_live_bytes: le_u64(bytes, 16),
        peak_live_allocs: le_u64(bytes, 24),
        allocs: le_u64(bytes, 32),
        streams: le_u64(bytes, 40),
        seed: le_u64(bytes, 48),
        requests: le_u64(bytes, 56),
    };
    let body = header
        .op_count
        .checked_mul(OP_BYTES as u64)
        .and_then(|b| b.checked_add(HEADER_BYTES as u64))
        .ok_or_else(|| format!("op count {} overflows", header.op_count))?;
    if body != bytes.len() as u64 {
        return Err(format!(
            "{} bytes, but the header's {} ops need {body}",
            bytes.len(),
            header.op_count
        ));
    }
    if header.allocs > u64::from(u32::MAX) + 1 {
        return Err(format!("{} allocations: ids are u32", header.allocs));
    }
    let mut ops = Vec::with_capacity(header.op_count as usize);
    // (bytes, stream, live) per allocation id.
    let mut allocs: Vec<(u64, u64, bool)> = vec![(0, 0, false); header.allocs as usize];
    let mut next_id = 0u64;
    let (mut live_bytes, mut live_allocs) = (0u64, 0u64);
    let (mut peak_bytes, mut peak_allocs) = (0u64, 0u64);
    for (i, rec) in bytes[HEADER_BYTES..].chunks_exact(OP_BYTES).enumerate() {
        let op = FileOp {
            kind: rec[0],
            id: le_u32(rec, 4),
            bytes: le_u64(rec, 8),
            stream: le_u64(rec, 16),
        };
        if rec[1..4] != [0, 0, 0] {
            return Err(format!("op {i}: padding is not zero"));
        }
        if op.stream >= header.streams {
            return Err(format!(
                "op {i}: stream {} >= streams {}",
                op.stream, header.streams
            ));
        }
        let slot = allocs
            .get_mut(op.id as usize)
            .ok_or_else(|| format!("op {i}: id {} >= allocs {}", op.id, header.allocs))?;
        match op.kind {
            KIND_ALLOC => {
                if u64::from(op.id) != next_id {
                    return Err(format!("op {i}: alloc id {}, expected {next_id}", op.id));
                }
                if op.bytes == 0 {
                    return Err(format!("op {i}: zero-byte alloc"));
                }
                *slot = (op.bytes, op.stream, true);
                next_id += 1;
                live_bytes += op.bytes;
                live_allocs += 1;
                peak_bytes = peak_bytes.max(live_bytes);
                peak_allocs = peak_allocs.max(live_allocs);
            }
            KIND_FREE => {
                let (b, s, live) = *slot;
                if !live {
                    return Err(format!("op {i}: free of id {}, which is not live", op.id));
                }
                if (b, s) != (op.bytes, op.stream) {
                    return Err(format!(
                        "op {i}: free of id {} says {} bytes on stream {}, the alloc said {b} on {s}",
                        op.id, op.bytes, op.stream
                    ));
                }
                slot.2 = false;
                live_bytes -= b;
                live_allocs -= 1;
            }
            k => return Err(format!("op {i}: kind {k} (0 alloc, 1 free)")),
        }
        ops.push(op);
    }
    if next_id != header.allocs {
        return Err(format!(
            "{next_id} allocations in the ops, header says {}",
            header.allocs
        ));
    }
    if live_allocs != 0 {
        return Err(format!("{live_allocs} allocations still live at the end"));
    }
    if (peak_bytes, peak_allocs) != (header.peak_live_bytes, header.peak_live_allocs) {
        return Err(format!(
            "peak live {peak_bytes} bytes in {peak_allocs} allocations, header says {} in {}",
            header.peak_live_bytes, header.peak_live_allocs
        ));
    }
    Ok(TraceFile { header, ops })
}

/// Read and check a trace file from `r`.
pub fn read<R: Read>(r: &mut R) -> Result<TraceFile, String> {
    let mut bytes = Vec::new();
    r.read_to_end(&mut bytes)
        .map_err(|e| format!("reading trace: {e}"))?;
    parse(&bytes)
}

/// Write `trace` to the file at `path` (created or truncated).
pub fn write_file(path: &Path, trace: &Trace, seed: u64, requests: u64) -> Result<(), String> {
    let mut buf = Vec::new();
    write(&mut buf, trace, seed, requests)?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    std::fs::write(path, &buf).map_err(|e| format!("{}: {e}", path.display()))
}

/// Read and check the trace file at `path`.
pub fn read_file(path: &Path) -> Result<TraceFile, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    parse(&bytes).map_err(|e| format!("{}: {e}", path.display()))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::trace::{generate, TraceConfig};

    fn small() -> (TraceConfig, Trace) {
        let cfg = TraceConfig {
            requests: 120,
            max_running: 32,
            ..TraceConfig::default()
        };
        let t = generate(&cfg);
        (cfg, t)
    }

    fn encode(t: &Trace, cfg: &TraceConfig) -> Vec<u8> {
        let mut buf = Vec::new();
        write(&mut buf, t, cfg.seed, u64::from(cfg.requests)).unwrap();
        buf
    }

    #[test]
    fn round_trip() {
        let (cfg, t) = small();
        let buf = encode(&t, &cfg);
        assert_eq!(buf.len(), HEADER_BYTES + t.ops.len() * OP_BYTES);
        assert_eq!(&buf[..8], b"KVTRACE1");
        let f = read(&mut buf.as_slice()).unwrap();
        assert_eq!(
            f.header,
            Header {
                op_count: t.ops.len() as u64,
                peak_live_bytes: t.peak_live_bytes,
                peak_live_allocs: t.peak_live_allocs,
                allocs: u64::from(t.allocs),
                streams: 2,
                seed: cfg.seed,
                requests: u64::from(cfg.requests),
            }
        );
        assert_eq!(f.ops.len(), t.ops.len());
        // Every op is the trace's, streams 1 and 2 as indices 0 and 1, frees with the
        // allocation's bytes and stream.
        let mut sizes = std::collections::HashMap::new();
        for (a, b) in t.ops.iter().zip(&f.ops) {
            match *a {
                Op::Alloc { id, bytes, stream } => {
                    assert_eq!(
                        *b,
                        FileOp {
                            kind: KIND_ALLOC,
                            id,
                            bytes,
                            stream: stream - 1
                        }
                    );
                    sizes.insert(id, (bytes, stream - 1));
                }
                Op::Free { id } => {
                    let (bytes, stream) = sizes[&id];
                    assert_eq!(
                        *b,
                        FileOp {
                            kind: KIND_FREE,
                            id,
                            bytes,
                            stream
                        }
                    );
                }
            }
        }
        // Writing what was read gives the same bytes.
        let mut again = Vec::new();
        write_parts(&mut again, &f.header, &f.ops).unwrap();
        assert_eq!(again, buf);
    }

    #[test]
    fn round_trip_through_a_file() {
        let (cfg, t) = small();
        let dir = std::env::temp_dir().join(format!("kvtrace-test-{}", std::process::id()));
        let path = dir.join("t.bin");
        write_file(&path, &t, cfg.seed, u64::from(cfg.requests)).unwrap();
        let f = read_file(&path).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(f.ops, file_ops(&t).unwrap());
        assert_eq!(f.header.peak_live_bytes, t.peak_live_bytes);
    }

    #[test]
    fn byte_layout_of_one_op() {
        let header = Header {
            op_count: 2,
            peak_live_bytes: 0x0102_0304_0506_0708,
            peak_live_allocs: 1,
            allocs: 1,
            streams: 3,
            seed: 9,
            requests: 10,
        };
        let ops = [
            FileOp {
                kind: KIND_ALLOC,
                id: 0,
                bytes: 0x0102_0304_0506_0708,
                stream: 2,
            },
            FileOp {
                kind: KIND_FREE,
                id: 0,
                bytes: 0x0102_0304_0506_0708,
                stream: 2,
            },
        ];
        let mut buf = Vec::new();
        write_parts(&mut buf, &header, &ops).unwrap();
        assert_eq!(buf.len(), 64 + 48);
        assert_eq!(&buf[8..16], &2u64.to_le_bytes());
        assert_eq!(&buf[16..24], &[8, 7, 6, 5, 4, 3, 2, 1]);
        assert_eq!(&buf[40..48], &3u64.to_le_bytes());
        assert_eq!(
            &buf[64..88],
            &[0, 0, 0, 0, 0, 0, 0, 0, 8, 7, 6, 5, 4, 3, 2, 1, 2, 0, 0, 0, 0, 0, 0, 0]
        );
        assert_eq!(buf[88], 1);
        assert_eq!(parse(&buf).unwrap().ops, ops);
    }

    #[test]
    fn bad_files_are_refused() {
        let (cfg, t) = small();
        let good = encode(&t, &cfg);
        assert!(parse(&good[..10]).is_err(), "short");
        let mut b = good.clone();
        b[0] = b'X';
        assert!(parse(&b).unwrap_err().contains("magic"));
        assert!(parse(&good[..good.len() - 1]).is_err(), "truncated op");
        // A kind byte of 2.
        let mut b = good.clone();
        b[HEADER_BYTES] = 2;
        assert!(parse(&b).unwrap_err().contains("kind"));
        // Non-zero padding.
        let mut b = good.clone();
        b[HEADER_BYTES + 1] = 1;
        assert!(parse(&b).unwrap_err().contains("padding"));
        // A wrong peak in the header.
        let mut b = good.clone();
        b[16] ^= 1;
        assert!(parse(&b).unwrap_err().contains("peak"));
        // A free whose size differs from its allocation's.
        let f = parse(&good).unwrap();
        let mut ops = f.ops.clone();
        let i = ops.iter().position(|o| o.kind == KIND_FREE).unwrap();
        ops[i].bytes += 1;
        let mut b = Vec::new();
        write_parts(&mut b, &f.header, &ops).unwrap();
        assert!(parse(&b).unwrap_err().contains("alloc said"));
        // A double free.
        let mut ops = f.ops.clone();
        ops[i + 1] = ops[i];
        let mut b = Vec::new();
        write_parts(&mut b, &f.header, &ops).unwrap();
        assert!(parse(&b).is_err());
    }
}
