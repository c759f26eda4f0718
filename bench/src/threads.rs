//! The thread-scaling workloads, shared by the `pool_threads` criterion group and the
//! `thread_scaling` example: each thread on its own stream, against one shared pool.
//!
//! - **2 MiB pairs** ([`pair_2mib`]): alloc then free of one 2 MiB block (the KV block).
//! - **mixed** ([`Mixed`]): the thread keeps [`MIXED_WINDOW`] allocations live and replaces
//!   one per pair (free the oldest, allocate the next size), the sizes cycling through
//!   [`MIXED_SIZES`], 512 B to 16 MiB, in an order that changes every window.

use std::hint::black_box;

use gpu_arena::{Pool, Result, StreamId};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

/// The mixed workload's sizes.
pub const MIXED_SIZES: [u64; 8] = [
    512,
    4 * KIB,
    24 * KIB,
    256 * KIB,
    MIB,
    2 * MIB,
    6 * MIB,
    16 * MIB,
];

/// Live allocations a thread keeps in the mixed workload.
pub const MIXED_WINDOW: usize = 8;

/// One alloc/free pair of 2 MiB on `stream`.
pub fn pair_2mib(pool: &Pool, stream: StreamId) -> Result<()> {
    let a = pool.alloc(0, black_box(2 * MIB), stream)?;
    pool.free(black_box(a.ptr))
}

/// One thread's state in the mixed workload.
#[derive(Debug)]
pub struct Mixed {
    stream: StreamId,
    live: [u64; MIXED_WINDOW],
    step: usize,
}

impl Mixed {
    /// A thread's workload on `stream`, nothing allocated yet.
    pub fn new(stream: StreamId) -> Self {
        Mixed {
            stream,
            live: [0; MIXED_WINDOW],
            step: 0,
        }
    }

    /// One pair: free the allocation made [`MIXED_WINDOW`] pairs ago, allocate the next size.
    pub fn pair(&mut self, pool: &Pool) -> Result<()> {
        let slot = self.step % MIXED_WINDOW;
        if self.live[slot] != 0 {
            pool.free(black_box(self.live[slot]))?;
            self.live[slot] = 0;
        }
        let i = self.step * 3 + self.step / MIXED_WINDOW;
        let bytes = MIXED_SIZES[i % MIXED_SIZES.len()];
        self.live[slot] = pool.alloc(0, black_box(bytes), self.stream)?.ptr;
        self.step += 1;
        Ok(())
    }

    /// Free what is still live.
    pub fn finish(&mut self, pool: &Pool) -> Result<()> {
        for p in &mut self.live {
            if *p != 0 {
                pool.free(*p)?;
                *p = 0;
            }
        }
        Ok(())
    }
}
