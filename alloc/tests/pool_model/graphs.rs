//! Graph pools in the model: a capture's routing context (begin, allocate, end), uses taken
//! and given back (a capture's, or torch's `MemPool`'s without one), `graph_pool_empty_cache`,
//! and checkpoints as PyTorch's cudagraph trees take and restore them
//! (`getCheckpointState` / `setCheckpointPoolState`): a `Checkpoint` step lists a pool's live
//! blocks (`graph_pool_blocks`, checked against the model's) and keeps the list; a `Restore`
//! step makes them the pool's live blocks again (`graph_pool_restore`): all or nothing, then
//! listed exactly as kept (address, request, stream), the blocks it frees plain ones, the
//! blocks it places at their own addresses checked like any new block (no overlap, nothing
//! another graph pool in use holds), never into memory of a sleeping tag.

use gpu_arena::pool::{GraphPoolId, PoolBlock};
use gpu_arena::StreamId;

use super::model::Model;
use super::ops::{Op, SIZES};

impl Model {
    /// A graph pool operation on this device, checked against the model.
    pub(crate) fn graph_op(&mut self, op: &Op) -> Result<(), String> {
        let pool = self.pool.clone();
        match *op {
            Op::GraphRetain(id) => {
                let uses = self.graphs.get(&id).map_or(0, |g| g.uses);
                let after = pool
                    .graph_pool_retain(self.dev, GraphPoolId(id, 0))
                    .map_err(|e| format!("graph_pool_retain: {e}"))?;
                self.graphs.entry(id).or_default().uses = uses + 1;
                if after != uses + 1 {
                    return Err(format!("pool {id}: use count {after}, model {}", uses + 1));
                }
            }
            Op::GraphEmptyCache(id) => {
                // Releases nothing while the pool is in use (and then does not synchronize);
                // otherwise `empty_cache` of the device. The checks after it see the rest.
                let got = pool.graph_pool_empty_cache(self.dev, GraphPoolId(id, 0));
                let in_use = self
                    .graphs
                    .get(&id)
                    .is_some_and(|g| g.uses > 0 || g.open > 0);
                if in_use && got.as_ref().is_ok_and(|&n| n != 0) {
                    return Err(format!(
                        "graph_pool_empty_cache of pool {id} in use released {got:?}"
                    ));
                }
            }
            Op::GraphBegin(id) => {
                if pool.graph_pool_begin(self.dev, GraphPoolId(id, 0)).is_ok() {
                    let g = self.graphs.entry(id).or_default();
                    g.uses += 1;
                    g.open += 1;
                }
            }
            Op::GraphAlloc { pool: id, size } => {
                if !self
                    .graphs
                    .get(&id)
                    .is_some_and(|g| g.uses > 0 || g.open > 0)
                {
                    return Ok(());
                }
                match pool.graph_pool_alloc(self.dev, GraphPoolId(id, 0), SIZES[size], StreamId(1))
                {
                    Ok(a) => {
                        if !self.awake(0) {
                            return Err("graph pool allocation granted while tag 0 sleeps".into());
                        }
                        self.place(a.ptr, SIZES[size], 1, 0, Some(id))?;
                    }
                    Err(e) => {
                        if self.awake(0) && !self.may_refuse(&e) {
                            return Err(format!("graph pool allocation refused: {e}"));
                        }
                    }
                }
            }
            Op::GraphEnd(id) => {
                let open = self.graphs.get(&id).map_or(0, |g| g.open);
                let got = pool.graph_pool_end(self.dev, GraphPoolId(id, 0));
                if open > 0 {
                    got.map_err(|e| format!("graph_pool_end: {e}"))?;
                    let g = self.graphs.get_mut(&id).unwrap();
                    g.open -= 1;
                    if g.uses == 0 && g.open == 0 {
                        self.graphs.remove(&id);
                    }
                } else if got.is_ok() {
                    return Err(format!(
                        "graph_pool_end of pool {id} with no open context granted"
                    ));
                }
            }
            Op::GraphRelease(id) => {
                let uses = self.graphs.get(&id).map_or(0, |g| g.uses);
                let got = pool.graph_pool_release(self.dev, GraphPoolId(id, 0));
                if uses > 0 {
                    let after = got.map_err(|e| format!("graph_pool_release: {e}"))?;
                    let g = self.graphs.get_mut(&id).unwrap();
                    g.uses -= 1;
                    if after != g.uses {
                        return Err(format!("pool {id}: use count {after}, model {}", g.uses));
                    }
                    if g.uses == 0 && g.open == 0 {
                        self.graphs.remove(&id);
                    }
                } else if got.is_ok() {
                    return Err(format!("graph_pool_release of unknown pool {id} granted"));
                }
            }
            Op::Checkpoint(id) => self.checkpoint(id)?,
            Op::Restore(id) => self.restore(id)?,
            _ => unreachable!("not a graph pool operation: {op:?}"),
        }
        Ok(())
    }

    /// The model's live blocks of graph pool `id`, as `graph_pool_blocks` lists them.
    fn graph_blocks(&self, id: u64) -> Vec<PoolBlock> {
        let mut out: Vec<PoolBlock> = self
            .blocks
            .iter()
            .filter(|b| b.graph == Some(id) && !b.freed)
            .map(|b| PoolBlock {
                ptr: b.ptr,
                requested: b.bytes,
                stream: StreamId(b.stream),
            })
            .collect();
        out.sort_unstable();
        out
    }

    /// Whether the pool must still know graph pool `id`: in use, or holding live blocks.
    fn pool_known(&self, id: u64) -> bool {
        self.graphs.contains_key(&id) || self.blocks.iter().any(|b| b.graph == Some(id))
    }

    /// List pool `id`'s live blocks, check them against the model, keep them.
    pub(crate) fn checkpoint(&mut self, id: u64) -> Result<(), String> {
        let want = self.graph_blocks(id);
        match self.pool.graph_pool_blocks(self.dev, GraphPoolId(id, 0)) {
            Ok(got) => {
                if got != want {
                    return Err(format!(
                        "graph pool {id} lists {got:x?}, the model {want:x?}"
                    ));
                }
                self.checkpoints.insert(id, got);
            }
            Err(e) => {
                if self.pool_known(id) {
                    return Err(format!("graph_pool_blocks of pool {id} refused: {e}"));
                }
            }
        }
        Ok(())
    }

    /// Restore pool `id` to its last checkpoint: on success its live blocks are the
    /// checkpoint's, the ones dropped were plain and the ones placed pass every rule of a new
    /// block; on failure nothing changed.
    pub(crate) fn restore(&mut self, id: u64) -> Result<(), String> {
        let Some(checkpoint) = self.checkpoints.get(&id).cloned() else {
            return Ok(());
        };
        let gid = GraphPoolId(id, 0);
        let before = self.graph_blocks(id);
        let got = self.pool.graph_pool_restore(self.dev, gid, &checkpoint);
        let listed = self.pool.graph_pool_blocks(self.dev, gid);
        match got {
            Ok(()) => {
                let after =
                    listed.map_err(|e| format!("graph_pool_blocks after a restore: {e}"))?;
                let mut want = checkpoint.clone();
                want.sort_unstable();
                if after != want {
                    return Err(format!("pool {id} restored to {want:x?} lists {after:x?}"));
                }
                let placed: Vec<PoolBlock> = checkpoint
                    .iter()
                    .filter(|c| !before.contains(c))
                    .copied()
                    .collect();
                if !placed.is_empty() && !self.awake(0) {
                    return Err(format!(
                        "restore of pool {id} placed {placed:x?} while its tag sleeps"
                    ));
                }
                // The blocks the restore freed: plain ones only.
                let dropped: Vec<usize> = (0..self.blocks.len())
                    .filter(|&i| {
                        let b = &self.blocks[i];
                        b.graph == Some(id)
                            && !b.freed
                            && !checkpoint.contains(&PoolBlock {
                                ptr: b.ptr,
                                requested: b.bytes,
                                stream: StreamId(b.stream),
                            })
                    })
                    .collect();
                for &i in &dropped {
                    let b = &self.blocks[i];
                    // (`record_stream` on a block's own stream records nothing.)
                    if !b.shares.is_empty() || b.recorded.iter().any(|&s| s != b.stream) {
                        return Err(format!("restore of pool {id} freed {b:x?}"));
                    }
                }
                for i in dropped.into_iter().rev() {
                    self.release(i);
                }
                for c in placed {
                    self.place(c.ptr, c.requested, c.stream.0, 0, Some(id))?;
                }
            }
            Err(e) => {
                if matches!(e, gpu_arena::Error::Internal(_)) {
                    return Err(format!("restore of pool {id}: internal error {e}"));
                }
                let after = listed.unwrap_or_default();
                if after != before {
                    return Err(format!(
                        "failed restore of pool {id} ({e}) changed its blocks {before:x?} -> {after:x?}"
                    ));
                }
            }
        }
        Ok(())
    }
}
