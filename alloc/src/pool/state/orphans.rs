//! Arenas out of the pool whose destroy failed (a driver error): kept with their bytes,
//! retried by the next `empty_cache` and at teardown. The device still holds them, so
//! their bytes count in `reserved_bytes` until a destroy succeeds (`DeviceState::stats_now`).

use crate::backend::ArenaMem;

#[derive(Debug, Default)]
pub(crate) struct Orphans {
    mems: Vec<ArenaMem>,
    bytes: u64,
}

impl Orphans {
    /// Keep `mem`, whose destroy failed, for a later try.
    pub(crate) fn push(&mut self, mem: ArenaMem) {
        self.bytes += mem.bytes;
        self.mems.push(mem);
    }

    /// Take every orphan to try its destroy again (one that fails again comes back with
    /// [`Self::push`]).
    pub(crate) fn take_all(&mut self) -> Vec<ArenaMem> {
        self.bytes = 0;
        std::mem::take(&mut self.mems)
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.mems.is_empty()
    }

    /// Bytes the device still holds for them.
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Their memory.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &ArenaMem> {
        self.mems.iter()
    }
}
