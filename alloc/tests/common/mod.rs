//! Small helpers shared by the integration tests (each test file uses a subset).
#![allow(dead_code)]

use std::time::{Duration, Instant};

/// Open fds of this process.
pub fn fd_count() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .expect("/proc/self/fd")
        .count()
}

/// Poll `cond` every 5 ms until it holds; panics after `limit`. Returns the time it took.
pub fn wait_until(what: &str, limit: Duration, mut cond: impl FnMut() -> bool) -> Duration {
    let t = Instant::now();
    while !cond() {
        assert!(
            t.elapsed() < limit,
            "{what} did not happen within {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    t.elapsed()
}

/// Lower-case hex of `b` (share handles travel to child processes this way).
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The bytes of a hex string made by [`hex`].
pub fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

/// A new SEQPACKET unix socket (the broker protocol's), close-on-exec.
pub fn seqpacket_socket() -> std::os::fd::OwnedFd {
    rustix::net::socket_with(
        rustix::net::AddressFamily::UNIX,
        rustix::net::SocketType::SEQPACKET,
        rustix::net::SocketFlags::CLOEXEC,
        None,
    )
    .expect("socket(AF_UNIX, SOCK_SEQPACKET)")
}

/// A pool over `sim` with `arena_size` arenas, validating itself after every operation.
pub fn validating_pool(
    sim: &std::sync::Arc<gpu_arena::backend::sim::SimBackend>,
    arena_size: u64,
) -> std::sync::Arc<gpu_arena::Pool> {
    let config = gpu_arena::PoolConfig {
        arena_size,
        validate: true,
        ..gpu_arena::PoolConfig::default()
    };
    std::sync::Arc::new(gpu_arena::Pool::new(sim.clone(), config).expect("pool on the sim"))
}
