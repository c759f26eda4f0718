//! Small helpers shared by the integration tests (each test file uses a subset).
#![allow(dead_code)]

pub mod broker_fixture;
pub mod raw_wire;
pub mod transfer_fixture;

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

/// A pool over `sim` with fixed arenas of `arena_size` bytes (not the default growing ones:
/// the tests using it count and cut whole arenas), validating itself after every operation
/// when `validate`.
pub fn pool_on(
    sim: &std::sync::Arc<gpu_arena::backend::sim::SimBackend>,
    arena_size: u64,
    validate: bool,
) -> gpu_arena::Pool {
    let config = gpu_arena::PoolConfig {
        arena_size,
        validate,
        grow_arenas: false,
        ..gpu_arena::PoolConfig::default()
    };
    gpu_arena::Pool::new(sim.clone(), config).expect("pool on the sim")
}

/// A pool over `sim` with fixed `arena_size` arenas, validating itself after every operation.
pub fn validating_pool(
    sim: &std::sync::Arc<gpu_arena::backend::sim::SimBackend>,
    arena_size: u64,
) -> std::sync::Arc<gpu_arena::Pool> {
    std::sync::Arc::new(pool_on(sim, arena_size, true))
}

/// A new sim backend made from `config`, and a pool over it (see [`pool_on`]).
pub fn sim_pool(
    config: gpu_arena::backend::sim::SimConfig,
    arena_size: u64,
    validate: bool,
) -> (
    std::sync::Arc<gpu_arena::backend::sim::SimBackend>,
    gpu_arena::Pool,
) {
    let sim =
        std::sync::Arc::new(gpu_arena::backend::sim::SimBackend::new(config).expect("sim backend"));
    let pool = pool_on(&sim, arena_size, validate);
    (sim, pool)
}

/// A pool with growing arenas (the default) over a new sim device of `capacity` bytes,
/// validating itself after every operation when `validate`.
pub fn growing_pool(
    capacity: u64,
    validate: bool,
) -> (
    std::sync::Arc<gpu_arena::backend::sim::SimBackend>,
    std::sync::Arc<gpu_arena::Pool>,
) {
    let sim = std::sync::Arc::new(
        gpu_arena::backend::sim::SimBackend::new(gpu_arena::backend::sim::SimConfig {
            capacity,
            ..gpu_arena::backend::sim::SimConfig::default()
        })
        .expect("sim backend"),
    );
    let config = gpu_arena::PoolConfig {
        grow_arenas: true,
        validate,
        ..gpu_arena::PoolConfig::default()
    };
    let pool = gpu_arena::Pool::new(sim.clone(), config).expect("pool on the sim");
    (sim, std::sync::Arc::new(pool))
}

/// The device address of `bytes` allocated on device 0, stream `stream`, under tag `tag`.
pub fn alloc_with(
    pool: &gpu_arena::Pool,
    tag: &str,
    bytes: u64,
    stream: gpu_arena::StreamId,
) -> u64 {
    gpu_arena::tags::set_current(Some(tag)).expect("set tag");
    let a = pool.alloc(0, bytes, stream).expect("alloc");
    gpu_arena::tags::set_current(None).expect("clear tag");
    a.ptr
}

/// Fill `len` bytes of sim device memory at `ptr` with a pattern that depends on `seed`.
pub fn fill(ptr: u64, len: usize, seed: u8) {
    // SAFETY: sim device addresses are host mappings of at least `len` bytes from `ptr`.
    let s = unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, len) };
    for (i, b) in s.iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(31).wrapping_add(seed);
    }
}

/// A copy of `len` bytes of sim device memory at `ptr`.
pub fn read(ptr: u64, len: usize) -> Vec<u8> {
    // SAFETY: as in `fill`.
    unsafe { std::slice::from_raw_parts(ptr as *const u8, len) }.to_vec()
}

/// xorshift64*: a deterministic random stream, no dependency (seed it non-zero).
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Operations per thread of a stress test: `GPU_ARENA_STRESS_OPS`, else `default`.
pub fn stress_ops(default: u64) -> u64 {
    std::env::var("GPU_ARENA_STRESS_OPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A copy of this test binary, named `name`, in a new world-readable temporary directory
/// (the checkout may sit where uid 65534 cannot enter, e.g. /root). Returns (dir, exe).
pub fn exe_copy_for_nobody(name: &str) -> (std::path::PathBuf, std::path::PathBuf) {
    use std::os::unix::fs::PermissionsExt;
    let dir = std::env::temp_dir().join(format!("gpu-arena-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temporary directory");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let exe = dir.join(name);
    std::fs::copy(std::env::current_exe().expect("current exe"), &exe).expect("copy");
    std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    (dir, exe)
}

/// Run test `child` of `exe` as uid/gid 65534 (nobody), with `env` set and `line` on its
/// stdin, and wait for it.
pub fn run_child_as_nobody(
    exe: &std::path::Path,
    dir: &std::path::Path,
    env: (&str, &str),
    line: &str,
) -> std::process::Output {
    use std::io::Write;
    use std::os::unix::process::CommandExt;
    use std::process::{Command, Stdio};
    let mut child = Command::new(exe)
        .args(["--exact", "child", "--nocapture", "--test-threads=1"])
        .env(env.0, env.1)
        .current_dir(dir)
        .uid(65534)
        .gid(65534)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn the child as nobody");
    let stdin = child.stdin.as_mut().expect("child stdin");
    writeln!(stdin, "{line}").expect("write to the child");
    child.wait_with_output().expect("child output")
}

/// The environment variable naming a child's role ([`spawn_reporting_child`]).
pub const CHILD_ROLE: &str = "GPU_ARENA_CHILD";
/// The environment variable naming the file a child reports on.
const CHILD_REPORT: &str = "GPU_ARENA_CHILD_REPORT";

/// This test binary run again as a child in `role` (its test named `child` reads the role
/// from [`CHILD_ROLE`]), stdin piped, stdout and stderr left to libtest: the child reports
/// on a file of its own ([`child_report`]), read by [`wait_report`] once it exited.
pub fn spawn_reporting_child(role: &str) -> (std::process::Child, std::path::PathBuf) {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let report =
        std::env::temp_dir().join(format!("gpu-arena-child-{}-{n}.report", std::process::id()));
    let _ = std::fs::remove_file(&report);
    let child = std::process::Command::new(std::env::current_exe().expect("test binary"))
        .args(["--exact", "child", "--test-threads=1"])
        .env(CHILD_ROLE, role)
        .env(CHILD_REPORT, &report)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("spawn the child");
    (child, report)
}

/// In a child: write its report (once, at the end) to its own file.
pub fn child_report(text: &str) {
    let path = std::env::var_os(CHILD_REPORT).expect("a reporting child");
    std::fs::write(path, text).expect("write the child's report");
}

/// Wait for `child` to exit successfully and return what it reported (the file removed).
pub fn wait_report(mut child: std::process::Child, report: &std::path::Path) -> String {
    let status = child.wait().expect("wait for the child");
    let text = std::fs::read_to_string(report).unwrap_or_default();
    let _ = std::fs::remove_file(report);
    assert!(
        status.success(),
        "child failed ({status}); it reported {text:?}"
    );
    text
}
