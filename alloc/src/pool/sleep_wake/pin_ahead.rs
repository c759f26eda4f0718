//! A sleep's host buffers made ahead of its copies. Making a pinned buffer is the slow part
//! of a first sleep (faulting and page-locking fresh host memory; `backend/vmm/pinned.rs`),
//! and it needs the CPU while the copy needs the copy engine: so while the sleep copies one
//! piece out (an arena's offload comes in pieces of up to 1 GiB, `pool/sleep_wake/offload.rs`),
//! [`PIN_WORKERS`] threads make the next pieces' buffers, each worker a buffer at a time (two
//! at once keep one faulting while the other registers). Buffers are handed to the copies in
//! the pieces' order; a failure is the same error the sequential path gives, at that arena.

use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::{Condvar, Mutex};

use crate::backend::HostBuffer;
use crate::error::Result;
use crate::pool::state::pool::{DevicePool, Pool};

/// Threads making buffers ahead of the copies.
const PIN_WORKERS: usize = 2;

impl Pool {
    /// Call `each(i, buffer)` for every entry of `totals`, in order: `None` for a total of
    /// 0, else the buffer [`Pool::host_buffer_for`] gave (or its error). With two or more
    /// buffers to make, they are made by worker threads ahead of the calls.
    pub(crate) fn with_host_buffers(
        &self,
        dp: &DevicePool,
        totals: &[u64],
        mut each: impl FnMut(usize, Option<Result<HostBuffer>>),
    ) {
        let make = |t: u64| (t > 0).then(|| self.host_buffer_for(dp, t));
        if totals.iter().filter(|&&t| t > 0).count() < 2 {
            for (i, &t) in totals.iter().enumerate() {
                each(i, make(t));
            }
            return;
        }
        let slots: Mutex<Vec<Option<Option<Result<HostBuffer>>>>> =
            Mutex::new((0..totals.len()).map(|_| None).collect());
        let ready = Condvar::new();
        let next = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..PIN_WORKERS {
                s.spawn(|| loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(&t) = totals.get(i) else {
                        return;
                    };
                    let made = make(t);
                    slots.lock()[i] = Some(made);
                    ready.notify_all();
                });
            }
            for i in 0..totals.len() {
                let mut guard = slots.lock();
                let made = loop {
                    if let Some(m) = guard[i].take() {
                        break m;
                    }
                    ready.wait(&mut guard);
                };
                drop(guard);
                each(i, made);
            }
        });
    }
}
