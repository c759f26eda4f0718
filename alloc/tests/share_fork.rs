//! Share tokens after `fork`: a forked child must not hand out the tokens its parent will
//! (the token batch is refetched in the child, found by a `pthread_atfork` child handler
//! rather than a `getpid` per share). One test in its own binary: the fork happens while
//! no other test thread can hold the token lock.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use gpu_arena::backend::sim::{SimBackend, SimConfig};
use gpu_arena::{Pool, PoolConfig, StreamId};

const MIB: u64 = 1 << 20;

#[test]
fn a_forked_child_cuts_other_tokens_than_its_parent() {
    let backend = Arc::new(SimBackend::new(SimConfig::default()).unwrap());
    let pool = Pool::new(
        backend,
        PoolConfig {
            arena_size: 64 * MIB,
            ..PoolConfig::default()
        },
    )
    .unwrap();
    let a = pool.alloc(0, 2 * MIB, StreamId(0x1000)).unwrap();
    let first = pool.share(a.ptr, a.bytes).unwrap(); // the batch is filled here
    let mut fds = [0i32; 2];
    // SAFETY: `fds` is a valid array of two ints for pipe(2) to fill.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0, "pipe");
    // SAFETY: the child only shares, writes 16 bytes and _exits; this test binary runs one
    // test, so no other thread holds a lock the child needs.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        let code = match pool.share(a.ptr, a.bytes) {
            Ok(s) => {
                // SAFETY: writes the 16 token bytes to the pipe's write end.
                let n = unsafe { libc::write(fds[1], s.token.as_ptr().cast(), 16) };
                i32::from(n != 16)
            }
            Err(_) => 2,
        };
        // SAFETY: ends the child without running the parent's destructors or test harness.
        unsafe { libc::_exit(code) };
    }
    let parent_next = pool.share(a.ptr, a.bytes).unwrap();
    let mut child_token = [0u8; 16];
    // SAFETY: reads at most 16 bytes into `child_token`.
    let n = unsafe { libc::read(fds[0], child_token.as_mut_ptr().cast(), 16) };
    let mut status = 0;
    // SAFETY: waits for the child forked above.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    // SAFETY: closes the pipe's two fds, opened above and used no more.
    unsafe {
        libc::close(fds[0]);
        libc::close(fds[1]);
    }
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "child status {status}"
    );
    assert_eq!(n, 16, "the child's token");
    assert_ne!(
        child_token, parent_next.token,
        "child and parent cut the same token"
    );
    assert_ne!(child_token, first.token);
    assert_ne!(first.token, parent_next.token);
}
