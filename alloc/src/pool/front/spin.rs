//! A small spin lock for the thread front's caches (`pool/front/thread_cache.rs`):
//! each is almost always taken by one thread, for a few hash operations, so the lock's own
//! cost is what matters. Taking it is one atomic swap, releasing it one plain store (a
//! `parking_lot` mutex pays a compare-and-swap for each). When it is held (a flusher
//! draining a cache, a free on another thread looking for its record), the waiter spins
//! briefly and then
//! yields, so a holder preempted on a busy machine is not spun against for a time slice.

use std::cell::UnsafeCell;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, Ordering};

/// Spins before each yield while the lock is held.
const SPINS: u32 = 64;

/// A value behind a spin lock. `repr(C)`: the flag first, then the value, so that a value
/// laid out for cache lines stays so behind the flag.
#[derive(Default)]
#[repr(C)]
pub(crate) struct SpinLock<T> {
    locked: AtomicBool,
    value: UnsafeCell<T>,
}

// SAFETY: the value is reached only through a `SpinGuard`, and at most one guard exists at
// a time (the `locked` flag, taken with Acquire and released with Release, orders the
// accesses), so sharing the lock between threads shares `T` as a `Mutex` would.
unsafe impl<T: Send> Sync for SpinLock<T> {}

impl<T> SpinLock<T> {
    /// Take the lock, spinning (then yielding) while another thread holds it.
    #[inline]
    pub(crate) fn lock(&self) -> SpinGuard<'_, T> {
        if self.locked.swap(true, Ordering::Acquire) {
            self.lock_contended();
        }
        SpinGuard { lock: self }
    }

    #[cold]
    fn lock_contended(&self) {
        loop {
            for _ in 0..SPINS {
                if !self.locked.load(Ordering::Relaxed)
                    && !self.locked.swap(true, Ordering::Acquire)
                {
                    return;
                }
                std::hint::spin_loop();
            }
            std::thread::yield_now();
        }
    }
}

/// Where a lock's value starts, in bytes from the lock's start (for layout checks).
#[cfg(test)]
pub(crate) fn value_offset<T>() -> usize {
    std::mem::offset_of!(SpinLock<T>, value)
}

impl<T> std::fmt::Debug for SpinLock<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SpinLock")
    }
}

/// Access to a [`SpinLock`]'s value; releases the lock when dropped.
pub(crate) struct SpinGuard<'a, T> {
    lock: &'a SpinLock<T>,
}

impl<T> Deref for SpinGuard<'_, T> {
    type Target = T;
    #[inline]
    fn deref(&self) -> &T {
        // SAFETY: this guard holds the lock: no other reference to the value exists.
        unsafe { &*self.lock.value.get() }
    }
}

impl<T> DerefMut for SpinGuard<'_, T> {
    #[inline]
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: this guard holds the lock, and `&mut self` makes this the only reference.
        unsafe { &mut *self.lock.value.get() }
    }
}

impl<T> Drop for SpinGuard<'_, T> {
    #[inline]
    fn drop(&mut self) {
        self.lock.locked.store(false, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::SpinLock;

    /// Threads adding under the lock lose no update.
    #[test]
    fn increments_under_contention_are_not_lost() {
        let lock = SpinLock::<u64>::default();
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..10_000 {
                        *lock.lock() += 1;
                    }
                });
            }
        });
        assert_eq!(*lock.lock(), 40_000);
    }
}
