//! The consumer's importer: one connection per producer, one mapping per arena, a lease per
//! import.
//!
//! `import(handle)` connects to the producer's broker (or reuses the connection), checks
//! that the socket is served by the pid the handle names, opens a lease, and maps the
//! arena's export once: later imports of shares in the same arena reuse the mapping (no
//! driver call, no fd). `close(ptr)` ends the lease; when the last lease on an arena ends,
//! the arena is unmapped and the broker told. A producer that died leaves the mappings
//! valid (the mapping holds the memory): closing them still succeeds and releases it.
//!
//! **Locks.** The importer's state (connections, mappings, imports) has one lock, held only
//! for bookkeeping and the driver's map / unmap; each connection has its own lock, held for
//! one request and its reply. A producer that is slow to answer (up to the 10 s reply
//! timeout) therefore delays only imports and closes of its own shares. An arena is held by
//! its live imports *and* its imports in flight, so a concurrent last close never unmaps
//! an arena an import is about to use; two first imports of one arena may both ask for the
//! fd, and the second to come back drops its copy.

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Mutex, MutexGuard};

use crate::backend::{Backend, DeviceId, ImportSource, Mapping};
use crate::error::{Error, Result};
use crate::ipc::connection::{
    close_lease_quietly, close_request, connect, exchange, round_trip, send_close,
    send_close_packet, settle, Conn, Connection,
};
use crate::ipc::handle::ShareHandle;
use crate::ipc::wire::{Batch, Op, Reply, Request, MAX_BATCH};

/// How long a consumer waits for a producer's reply.
const REPLY_TIMEOUT: Duration = Duration::from_secs(10);

/// (producer pid, socket name): one broker.
type ProducerKey = (u32, Arc<str>);
/// (producer, device, arena id): one mapped arena.
type ArenaKey = (ProducerKey, DeviceId, u64);

#[derive(Debug)]
struct MappedArena {
    /// `None` until the first import's fd came back and was mapped.
    mapping: Option<Mapping>,
    /// Live imports plus imports in flight: the arena is unmapped when this reaches 0.
    holders: u64,
}

#[derive(Debug, Clone)]
struct ImportRecord {
    arena: ArenaKey,
    lease_key: u32,
    device: DeviceId,
    len: u64,
}

#[derive(Debug, Default)]
struct ImporterState {
    conns: HashMap<ProducerKey, Conn>,
    arenas: HashMap<ArenaKey, MappedArena>,
    /// Imported pointer -> its imports (the same range can be imported more than once).
    imports: HashMap<u64, Vec<ImportRecord>>,
    /// Mappings whose unmap failed: retried at the next close and at teardown.
    stranded: Vec<Mapping>,
}

/// Counters of an importer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct ImporterStats {
    /// Live imports (leases held).
    pub imports_live: u64,
    /// Arenas mapped.
    pub arenas_mapped: u64,
    /// Producers connected.
    pub producers: u64,
}

/// The consumer side of sharing.
#[derive(Debug)]
pub struct Importer {
    backend: Arc<dyn Backend>,
    state: Mutex<ImporterState>,
    reply_timeout: Duration,
}

impl Importer {
    /// An importer mapping through `backend`, waiting up to 10 s for a producer's reply.
    pub fn new(backend: Arc<dyn Backend>) -> Importer {
        Importer::with_reply_timeout(backend, REPLY_TIMEOUT)
    }

    /// An importer that waits up to `reply_timeout` for each reply of a producer.
    pub fn with_reply_timeout(backend: Arc<dyn Backend>, reply_timeout: Duration) -> Importer {
        Importer {
            backend,
            state: Mutex::new(ImporterState::default()),
            reply_timeout,
        }
    }

    /// Import a share: returns the address of its first byte in this process.
    pub fn import(&self, handle: &ShareHandle) -> Result<u64> {
        let info = &handle.info;
        let count = self.backend.device_count()?;
        if usize::try_from(info.device).map_or(true, |d| d >= count) {
            return Err(Error::InvalidDevice {
                device: info.device,
                count,
            });
        }
        // The fields are public: a handle built in code skips from_bytes's checks.
        crate::ipc::handle::check_range(info)?;
        let producer: ProducerKey = (handle.producer_pid, handle.socket_name.clone());
        let arena_key: ArenaKey = (producer.clone(), info.device, info.arena_id);
        let (conn, want_fd) = self.reserve(handle, &arena_key)?;
        let req = Request {
            op: Op::Open,
            want_fd,
            device: info.device,
            key: info.share_key,
            arena_id: info.arena_id,
            token: info.token,
            generation: info.generation,
        };
        let answer = round_trip(&mut conn.lock(), &req);
        let mut st = self.state.lock();
        // A failed import lets go of the arena and of the lease it was granted, if any (after
        // the state lock: that is a round trip).
        let fail = |mut st: MutexGuard<'_, ImporterState>, lease: Option<u32>, e: Error| {
            // Don't let an unmap error hide the import's own error.
            let _ = self.release_arena(&mut st, &arena_key);
            // Dropping the connection ends every lease on it at the broker: only when no
            // import of this producer is live or in flight (their memory must stay reserved
            // there). A broker that refused a new peer (uid, connection cap) hung up: with
            // no other import on it, that socket goes too and the next import reconnects.
            let unused = !st.arenas.keys().any(|k| k.0 == producer);
            if unused
                && st
                    .conns
                    .get(&producer)
                    .is_some_and(|c| Arc::ptr_eq(c, &conn))
            {
                st.conns.remove(&producer);
            }
            drop(st);
            if let Some(lease) = lease {
                close_lease_quietly(&conn, info.device, lease);
            }
            Err(e)
        };
        let (reply, fd) = match answer {
            Ok(r) => r,
            Err(e) => return fail(st, None, e),
        };
        if !reply.ok {
            let e = Error::Ipc(format!(
                "producer pid {} refused the import: {}",
                handle.producer_pid, reply.message
            ));
            return fail(st, None, e);
        }
        if reply.arena_bytes != info.arena_bytes {
            let e = Error::Ipc(format!(
                "producer says the arena is {} bytes, the handle says {}",
                reply.arena_bytes, info.arena_bytes
            ));
            return fail(st, Some(reply.lease_key), e);
        }
        let mapped = st
            .arenas
            .get(&arena_key)
            .is_some_and(|a| a.mapping.is_some());
        if !mapped {
            // This import asked for the fd (an arena is unmapped only with no holders): one,
            // or one per chunk of a grown arena with the chunks' lengths in the reply.
            if fd.is_empty() || (fd.len() > 1 && fd.len() != reply.chunks.len()) {
                let e = Error::Ipc(format!(
                    "producer sent {} fds for {} chunks",
                    fd.len(),
                    reply.chunks.len()
                ));
                return fail(st, Some(reply.lease_key), e);
            }
            // The mapping holds the memory; the fds are closed when `fd` drops below.
            let chunks: Vec<(u64, std::os::fd::BorrowedFd<'_>)> = reply
                .chunks
                .iter()
                .zip(&fd)
                .map(|(n, f)| (*n, f.as_fd()))
                .collect();
            let source = if fd.len() == 1 {
                ImportSource::Fd(fd[0].as_fd())
            } else {
                ImportSource::Chunks(&chunks)
            };
            let mapping = self.backend.import(info.device, source, info.arena_bytes);
            match (mapping, st.arenas.get_mut(&arena_key)) {
                (Ok(m), Some(a)) => a.mapping = Some(m),
                (Ok(m), None) => {
                    let _ = self.backend.unmap_import(m);
                    let e = Error::Internal("arena record vanished while held".into());
                    return fail(st, Some(reply.lease_key), e);
                }
                (Err(e), _) => return fail(st, Some(reply.lease_key), e),
            }
        }
        // (An fd that a concurrent import's mapping made unnecessary is closed here.)
        let Some(base) = st
            .arenas
            .get(&arena_key)
            .and_then(|a| a.mapping.as_ref())
            .map(|m| m.base)
        else {
            let e = Error::Internal("mapping vanished while held".into());
            return fail(st, Some(reply.lease_key), e);
        };
        let ptr = base + info.offset;
        st.imports.entry(ptr).or_default().push(ImportRecord {
            arena: arena_key,
            lease_key: reply.lease_key,
            device: info.device,
            len: info.len,
        });
        Ok(ptr)
    }

    /// Hold the arena `key` for an import and take the connection to its producer, in one
    /// critical section: a connection is dropped only when no arena of its producer has a
    /// holder, so it cannot go between the two. A missing connection is made outside the
    /// lock. Returns the connection and whether the arena still needs its fd (a concurrent
    /// last close then leaves a mapped arena alone).
    fn reserve(&self, handle: &ShareHandle, key: &ArenaKey) -> Result<(Conn, bool)> {
        let mut made: Option<OwnedFd> = None;
        loop {
            let mut st = self.state.lock();
            let conn = match (st.conns.get(&key.0).cloned(), made.take()) {
                // (A socket made meanwhile by this call is closed unused.)
                (Some(conn), _) => conn,
                (None, Some(sock)) => {
                    let conn = Arc::new(Mutex::new(Connection::new(sock)));
                    st.conns.insert(key.0.clone(), conn.clone());
                    conn
                }
                (None, None) => {
                    drop(st);
                    made = Some(connect(handle, self.reply_timeout)?);
                    continue;
                }
            };
            let slot = st.arenas.entry(key.clone()).or_insert(MappedArena {
                mapping: None,
                holders: 0,
            });
            slot.holders += 1;
            return Ok((conn, slot.mapping.is_none()));
        }
    }

    /// One holder of `key` is gone: the last one unmaps the arena.
    fn release_arena(&self, st: &mut ImporterState, key: &ArenaKey) -> Option<Error> {
        let a = st.arenas.get_mut(key)?;
        a.holders -= 1;
        if a.holders > 0 {
            return None;
        }
        let mapping = st.arenas.remove(key)?.mapping?;
        // Unmapping waits for nothing: the consumer owns the ordering of its work.
        match self.backend.unmap_import(mapping.clone()) {
            Ok(()) => None,
            Err(e) => {
                st.stranded.push(mapping);
                Some(e)
            }
        }
    }

    /// Close one import of `ptr`. The last import of an arena unmaps it.
    pub fn close(&self, ptr: u64) -> Result<()> {
        let rec = {
            let mut st = self.state.lock();
            for m in std::mem::take(&mut st.stranded) {
                if self.backend.unmap_import(m.clone()).is_err() {
                    st.stranded.push(m);
                }
            }
            let rec = match st.imports.get_mut(&ptr) {
                Some(list) => list.pop(),
                None => None,
            }
            .ok_or_else(|| Error::UnknownPointer {
                ptr,
                why: "not an imported pointer (never imported, or already closed)".into(),
            })?;
            if st.imports.get(&ptr).is_some_and(Vec::is_empty) {
                st.imports.remove(&ptr);
            }
            let conn = st.conns.get(&rec.arena.0).cloned();
            // The last import of an arena unmaps it before the broker hears of the close:
            // a producer that sees the lease end (a revocation waits for that) knows this
            // mapping no longer holds its memory.
            let unmap_error = self.release_arena(&mut st, &rec.arena);
            (rec, conn, unmap_error)
        };
        let (rec, conn, unmap_error) = rec;
        let producer = rec.arena.0.clone();
        // Tell the broker (without the state lock); a dead producer is fine (its side is
        // gone already).
        let req = Request {
            arena_id: rec.arena.2,
            ..close_request(rec.device, rec.lease_key)
        };
        if let Some(conn) = &conn {
            if let Err(e) = send_close(&mut conn.lock(), &req) {
                tracing::debug!(error = %e, "producer unreachable at close");
            }
        }
        let mut st = self.state.lock();
        // Once no import of this producer is live or in flight, the connection goes (a
        // producer that exited or hung up released its side already).
        let still_used = st.arenas.keys().any(|k| k.0 == producer);
        let same = |c: &Conn| conn.as_ref().is_some_and(|mine| Arc::ptr_eq(c, mine));
        let listed = st.conns.get(&producer).is_some_and(same);
        let last = !still_used && listed;
        if last {
            st.conns.remove(&producer);
        }
        drop(st);
        // The connection goes: hear the replies to its closes first, so the broker ends
        // those leases as closes, not as a departed consumer's. That is this close's job
        // when it was the last, and also when another thread's last close took the
        // connection out while this one was on its way: that close settled before this
        // one was sent, and nobody else would wait for its reply.
        if let (true, Some(conn)) = (last || !listed, &conn) {
            settle(&mut conn.lock());
        }
        match unmap_error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Import many shares with one round trip per producer and device (per 120 shares):
    /// the addresses, in order. A share whose arena this importer does not map yet is
    /// imported alone first (its fd must travel). All or nothing: on an error, the imports
    /// this call made are closed again.
    pub fn import_many(&self, handles: &[ShareHandle]) -> Result<Vec<u64>> {
        let mut out: Vec<Option<u64>> = vec![None; handles.len()];
        let result = self.import_many_into(handles, &mut out);
        if result.is_err() {
            let done: Vec<u64> = out.iter().flatten().copied().collect();
            let _ = self.close_many(&done);
        }
        result.map(|()| out.into_iter().flatten().collect())
    }

    fn import_many_into(&self, handles: &[ShareHandle], out: &mut [Option<u64>]) -> Result<()> {
        let count = self.backend.device_count()?;
        for h in handles {
            if usize::try_from(h.info.device).map_or(true, |d| d >= count) {
                return Err(Error::InvalidDevice {
                    device: h.info.device,
                    count,
                });
            }
            crate::ipc::handle::check_range(&h.info)?;
        }
        // Group the shares of mapped arenas by (producer, device), holding each arena.
        type Group = (Conn, Vec<(usize, ArenaKey, u64)>);
        let mut groups: HashMap<(ProducerKey, DeviceId), Group> = HashMap::new();
        for (i, h) in handles.iter().enumerate() {
            let producer: ProducerKey = (h.producer_pid, h.socket_name.clone());
            let key: ArenaKey = (producer.clone(), h.info.device, h.info.arena_id);
            let held = {
                let mut st = self.state.lock();
                let conn = st.conns.get(&producer).cloned();
                match (conn, st.arenas.get_mut(&key)) {
                    (Some(conn), Some(a)) if a.mapping.is_some() => {
                        a.holders += 1;
                        Some(conn)
                    }
                    _ => None,
                }
            };
            match held {
                Some(conn) => {
                    groups
                        .entry((producer, h.info.device))
                        .or_insert_with(|| (conn, Vec::new()))
                        .1
                        .push((i, key, h.info.offset));
                }
                None => match self.import(h) {
                    Ok(ptr) => out[i] = Some(ptr),
                    Err(e) => {
                        // Let go of the arenas held for the batch so far.
                        let mut st = self.state.lock();
                        for (_, members) in groups.values() {
                            for (_, key, _) in members {
                                let _ = self.release_arena(&mut st, key);
                            }
                        }
                        return Err(e);
                    }
                },
            }
        }
        let mut failure = None;
        for ((producer, device), (conn, members)) in groups {
            for chunk in members.chunks(MAX_BATCH) {
                if failure.is_some() {
                    let mut st = self.state.lock();
                    for (_, key, _) in chunk {
                        let _ = self.release_arena(&mut st, key);
                    }
                    continue;
                }
                let batch = Batch::Open {
                    device,
                    shares: chunk
                        .iter()
                        .map(|&(i, _, _)| {
                            let info = &handles[i].info;
                            (info.share_key, info.generation, info.arena_id, info.token)
                        })
                        .collect(),
                };
                let stands_for = Request {
                    op: Op::OpenMany,
                    key: chunk.len() as u32,
                    ..close_request(device, 0)
                };
                let answer = exchange(&mut conn.lock(), &batch.encode(), &stands_for);
                let leases = answer.and_then(|(bytes, _)| {
                    let reply = Reply::decode(&bytes)?;
                    if !reply.ok {
                        return Err(Error::Ipc(format!(
                            "producer pid {} refused the imports: {}",
                            producer.0, reply.message
                        )));
                    }
                    let keys = Batch::reply_leases(&bytes);
                    if keys.len() != chunk.len() {
                        let close = Batch::Close {
                            device,
                            leases: keys,
                        };
                        let _ = send_close_packet(
                            &mut conn.lock(),
                            &close.encode(),
                            &Request {
                                op: Op::CloseMany,
                                ..close_request(device, 0)
                            },
                        );
                        return Err(Error::Ipc(
                            "producer granted a wrong number of leases".into(),
                        ));
                    }
                    Ok(keys)
                });
                let mut st = self.state.lock();
                match leases {
                    Ok(keys) => {
                        for (&(i, ref key, offset), lease_key) in chunk.iter().zip(keys) {
                            // Held since the grouping: the mapping is there.
                            let base = st
                                .arenas
                                .get(key)
                                .and_then(|a| a.mapping.as_ref())
                                .map(|m| m.base);
                            let Some(base) = base else {
                                failure.get_or_insert_with(|| {
                                    Error::Internal("mapping vanished while held".into())
                                });
                                continue;
                            };
                            let ptr = base + offset;
                            st.imports.entry(ptr).or_default().push(ImportRecord {
                                arena: key.clone(),
                                lease_key,
                                device,
                                len: handles[i].info.len,
                            });
                            out[i] = Some(ptr);
                        }
                    }
                    Err(e) => {
                        for (_, key, _) in chunk {
                            let _ = self.release_arena(&mut st, key);
                        }
                        failure = Some(e);
                    }
                }
            }
        }
        match failure {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Close many imports with one message per producer and device (per 120 imports),
    /// not waiting for the producer's replies (as [`Importer::close`]). Every pointer must be
    /// imported (as often as it is listed), or nothing is closed.
    pub fn close_many(&self, ptrs: &[u64]) -> Result<()> {
        let mut groups: HashMap<(ProducerKey, DeviceId), Vec<ImportRecord>> = HashMap::new();
        let mut conns: HashMap<ProducerKey, Option<Conn>> = HashMap::new();
        {
            let mut st = self.state.lock();
            let mut wanted: HashMap<u64, usize> = HashMap::new();
            for &p in ptrs {
                *wanted.entry(p).or_default() += 1;
            }
            for (&ptr, &n) in &wanted {
                if st.imports.get(&ptr).map_or(0, Vec::len) < n {
                    return Err(Error::UnknownPointer {
                        ptr,
                        why: "not an imported pointer (never imported, or already closed)".into(),
                    });
                }
            }
            for &ptr in ptrs {
                let Some(rec) = st.imports.get_mut(&ptr).and_then(Vec::pop) else {
                    continue;
                };
                if st.imports.get(&ptr).is_some_and(Vec::is_empty) {
                    st.imports.remove(&ptr);
                }
                let producer = rec.arena.0.clone();
                let conn = st.conns.get(&producer).cloned();
                conns.entry(producer.clone()).or_insert(conn);
                groups.entry((producer, rec.device)).or_default().push(rec);
            }
        }
        for ((producer, device), recs) in &groups {
            let Some(Some(conn)) = conns.get(producer) else {
                continue;
            };
            for chunk in recs.chunks(MAX_BATCH) {
                let close = Batch::Close {
                    device: *device,
                    leases: chunk.iter().map(|r| r.lease_key).collect(),
                };
                let stands_for = Request {
                    op: Op::CloseMany,
                    key: chunk.len() as u32,
                    ..close_request(*device, 0)
                };
                if let Err(e) = send_close_packet(&mut conn.lock(), &close.encode(), &stands_for) {
                    tracing::debug!(error = %e, "producer unreachable at close");
                }
            }
        }
        let mut st = self.state.lock();
        let mut unmap_error = None;
        for rec in groups.values().flatten() {
            if let Some(e) = self.release_arena(&mut st, &rec.arena) {
                unmap_error.get_or_insert(e);
            }
        }
        let mut settle_these = Vec::new();
        for (producer, conn) in conns {
            let Some(conn) = conn else { continue };
            let still_used = st.arenas.keys().any(|k| k.0 == producer);
            if !still_used
                && st
                    .conns
                    .get(&producer)
                    .is_some_and(|c| Arc::ptr_eq(c, &conn))
            {
                st.conns.remove(&producer);
                settle_these.push(conn);
            }
        }
        drop(st);
        for conn in settle_these {
            settle(&mut conn.lock());
        }
        match unmap_error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// The length of the most recent import of `ptr`, if it is imported.
    pub fn imported_len(&self, ptr: u64) -> Option<u64> {
        self.state.lock().imports.get(&ptr)?.last().map(|r| r.len)
    }

    /// Counters.
    pub fn stats(&self) -> ImporterStats {
        let st = self.state.lock();
        ImporterStats {
            imports_live: st.imports.values().map(|v| v.len() as u64).sum(),
            arenas_mapped: st.arenas.values().filter(|a| a.mapping.is_some()).count() as u64,
            producers: st.conns.len() as u64,
        }
    }
}

impl Drop for Importer {
    fn drop(&mut self) {
        let st = self.state.get_mut();
        if !st.imports.is_empty() {
            tracing::warn!(
                imports = st.imports.len(),
                "importer dropped with live imports: unmapping them"
            );
        }
        let stranded = std::mem::take(&mut st.stranded);
        for mapping in st
            .arenas
            .drain()
            .filter_map(|(_, a)| a.mapping)
            .chain(stranded)
        {
            if let Err(e) = self.backend.unmap_import(mapping) {
                tracing::error!(error = %e, "unmapping an import at teardown failed");
            }
        }
    }
}
