//! Graph pool checkpoints, as PyTorch's cudagraph trees take and restore them
//! (`getCheckpointState` / `setCheckpointPoolState`): a `Checkpoint` step lists a pool's live
//! blocks (`graph_pool_blocks`, checked against the model's) and keeps the list; a `Restore`
//! step makes them the pool's live blocks again (`graph_pool_restore`): all or nothing, the
//! blocks it frees plain ones, the blocks it places at their own addresses checked like any
//! new block (no overlap, nothing another graph pool in use holds), never into memory of a
//! sleeping tag.

use gpu_arena::pool::{GraphPoolId, PoolBlock};
use gpu_arena::StreamId;

use super::model::Model;

impl Model {
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
