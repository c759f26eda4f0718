//! The C program tests: `tests/c/api_test.c` (the whole API), `tests/c/lifecycle_test.c`
//! (calls before init, the lazy init, failed inits) and `tests/c/observers_test.c`, compiled
//! with the system C compiler against `include/gpu_arena.h` and the built `libgpu_arena.so`,
//! then run on the sim backend once per mode (gpu-arena initializes once per process, so "a
//! call before init" and "a failed init" need processes of their own).
//!
//! `cargo test` does not build a cdylib-only crate's library for its integration tests, so
//! this test runs `cargo build --lib` of this package itself, with the profile, target and
//! features this test binary was built with, into the same target directory. That is a
//! no-op when the library is current, and guarantees the C program links today's code.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// How long one run of the C program may take before it is killed as hung.
const RUN_TIMEOUT: Duration = Duration::from_secs(300);

/// Where this test binary lives: `<target dir>/[<triple>/]<profile dir>/deps/<test>`.
struct Layout {
    /// The cargo target directory.
    target_dir: PathBuf,
    /// `Some(triple)` when built with `--target`.
    triple: Option<String>,
    /// `<target dir>/[<triple>/]<profile dir>`: where cargo puts `libgpu_arena.so`.
    profile_dir: PathBuf,
    /// `debug`, `release`, or a custom profile's name.
    profile_name: String,
}

fn layout() -> Layout {
    let exe = std::env::current_exe().expect("current_exe");
    let deps = exe.parent().expect("the test binary is in a directory");
    assert!(
        deps.file_name().is_some_and(|n| n == "deps"),
        "expected the test binary under <target>/<profile>/deps, got {}",
        exe.display()
    );
    let profile_dir = deps.parent().expect("deps/ has a parent").to_path_buf();
    let profile_name = profile_dir
        .file_name()
        .expect("profile dir name")
        .to_string_lossy()
        .into_owned();
    let above = profile_dir.parent().expect("profile dir has a parent");
    // Cargo marks the root of every target directory with CACHEDIR.TAG; with `--target`
    // the profile directory sits one level lower, under the triple.
    let (target_dir, triple) = if above.join("CACHEDIR.TAG").is_file() {
        (above.to_path_buf(), None)
    } else {
        match above.parent() {
            Some(root) if root.join("CACHEDIR.TAG").is_file() => (
                root.to_path_buf(),
                Some(
                    above
                        .file_name()
                        .expect("triple")
                        .to_string_lossy()
                        .into_owned(),
                ),
            ),
            _ => match std::env::var_os("CARGO_TARGET_DIR") {
                Some(dir) => (PathBuf::from(dir), None),
                None => (above.to_path_buf(), None),
            },
        }
    };
    Layout {
        target_dir,
        triple,
        profile_dir,
        profile_name,
    }
}

/// The workspace root (the C sources live in `tests/c/`).
fn workspace_root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("ffi/ is inside the workspace")
}

/// Run `cmd` to completion, failing the test with its output if it fails.
fn run_checked(mut cmd: Command, what: &str) {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("{what}: cannot run {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{cmd:?}\n--- stdout\n{}\n--- stderr\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Build `libgpu_arena.so` as this test binary was built: same target dir, profile, target
/// triple and features. Returns its path.
fn build_cdylib(l: &Layout) -> PathBuf {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| env!("CARGO").into());
    let mut cmd = Command::new(cargo);
    cmd.arg("build")
        .arg("--lib")
        .arg("--manifest-path")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml"))
        .arg("--target-dir")
        .arg(&l.target_dir);
    match l.profile_name.as_str() {
        "debug" => {}
        "release" => {
            cmd.arg("--release");
        }
        other => {
            cmd.args(["--profile", other]);
        }
    }
    if let Some(triple) = &l.triple {
        cmd.args(["--target", triple]);
    }
    // The features this test was compiled with are the package's features of this run.
    let features: Vec<&str> = [
        ("cuda", cfg!(feature = "cuda")),
        ("hip", cfg!(feature = "hip")),
    ]
    .into_iter()
    .filter_map(|(name, on)| on.then_some(name))
    .collect();
    cmd.arg("--no-default-features");
    if !features.is_empty() {
        cmd.arg("--features").arg(features.join(","));
    }
    run_checked(cmd, "building libgpu_arena (cargo build --lib)");
    let lib = l.profile_dir.join(format!(
        "{}gpu_arena{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    ));
    assert!(
        lib.is_file(),
        "cargo build succeeded but {} is missing",
        lib.display()
    );
    lib
}

/// The compiled C programs and the library they link.
struct Built {
    exe: PathBuf,
    /// `tests/c/lifecycle_test.c` (calls before init, the lazy init, failed inits), compiled
    /// the same way.
    lifecycle_exe: PathBuf,
    /// `tests/c/observers_test.c` (arena observers), compiled the same way.
    observers_exe: PathBuf,
    /// `tests/c/graph_pool_test.c` (graph pools, stats resets, segments).
    graph_pool_exe: PathBuf,
    lib: PathBuf,
}

/// Build the library and compile the C programs, once per test process.
fn built() -> &'static Built {
    static BUILT: OnceLock<Built> = OnceLock::new();
    BUILT.get_or_init(|| {
        let l = layout();
        let lib = build_cdylib(&l);
        let lib_dir = lib.parent().expect("lib dir").to_path_buf();
        let out_dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!(
            "c-api-{}{}",
            l.triple
                .as_deref()
                .map(|t| format!("{t}-"))
                .unwrap_or_default(),
            l.profile_name
        ));
        std::fs::create_dir_all(&out_dir).expect("create the C program's directory");
        let exe = compile(&lib_dir, &out_dir, "api_test");
        let lifecycle_exe = compile(&lib_dir, &out_dir, "lifecycle_test");
        let observers_exe = compile(&lib_dir, &out_dir, "observers_test");
        let graph_pool_exe = compile(&lib_dir, &out_dir, "graph_pool_test");
        Built {
            exe,
            lifecycle_exe,
            observers_exe,
            graph_pool_exe,
            lib,
        }
    })
}

/// Compile `tests/c/<name>.c` against the header and the library in `lib_dir`.
fn compile(lib_dir: &Path, out_dir: &Path, name: &str) -> PathBuf {
    let src = workspace_root()
        .join("tests")
        .join("c")
        .join(format!("{name}.c"));
    compile_source(lib_dir, out_dir, name, &src)
}

/// Compile the C program `src` into `out_dir/name` against the header and the library in
/// `lib_dir`.
fn compile_source(lib_dir: &Path, out_dir: &Path, name: &str, src: &Path) -> PathBuf {
    let exe = out_dir.join(name);
    let root = workspace_root();
    let cc = std::env::var_os("CC").unwrap_or_else(|| "cc".into());
    let mut cmd = Command::new(cc);
    cmd.current_dir(root)
        .args([
            "-std=c11",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-pedantic",
            "-O1",
            "-g",
        ])
        .arg("-pthread")
        .arg("-I")
        .arg(root.join("ffi").join("include"))
        .arg(src)
        .arg("-o")
        .arg(&exe)
        .arg("-L")
        .arg(lib_dir)
        .arg("-lgpu_arena")
        .arg(format!("-Wl,-rpath,{}", lib_dir.display()));
    run_checked(cmd, &format!("compiling {}", src.display()));
    exe
}

/// Wait for `child` at most `limit`; kill it past that.
fn wait_with_timeout(child: &mut std::process::Child, limit: Duration) -> Option<ExitStatus> {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().expect("wait for the C program") {
            return Some(status);
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Run `api_test` in `mode` on the sim backend and require exit status 0.
fn run_mode(mode: &str) -> String {
    run_program(&built().exe, mode, &[])
}

/// Run `lifecycle_test` in `mode` on the sim backend and require exit status 0.
fn run_lifecycle(mode: &str) -> String {
    run_lifecycle_with(mode, &[])
}

/// [`run_lifecycle`] with more environment (which may override `GPU_ARENA_BACKEND`); returns
/// the program's stdout and stderr.
fn run_lifecycle_with(mode: &str, env: &[(&str, &str)]) -> String {
    run_program(&built().lifecycle_exe, mode, env)
}

/// Run `cmd` (no stdin) with its stdout and stderr in `log_path`, at most [`RUN_TIMEOUT`];
/// returns its status (`None`: killed after the timeout) and its output.
fn run_logged(mut cmd: Command, log_path: &Path) -> (Option<ExitStatus>, String) {
    let log = File::create(log_path).expect("create the program's log");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("dup the log file"))
        .stderr(log)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {:?}: {e}", cmd.get_program()));
    let status = wait_with_timeout(&mut child, RUN_TIMEOUT);
    (
        status,
        std::fs::read_to_string(log_path).unwrap_or_default(),
    )
}

/// Run `exe` with `mode` on the sim backend (plus `env`) and require exit status 0 and its
/// "checks passed" line; returns the program's stdout and stderr.
fn run_program(exe: &Path, mode: &str, env: &[(&str, &str)]) -> String {
    let b = built();
    let name = exe
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let log_path = exe.with_extension(format!("{mode}.log"));
    let lib_dir = b.lib.parent().expect("lib dir");
    let ld_path = match std::env::var_os("LD_LIBRARY_PATH") {
        Some(old) if !old.is_empty() => {
            let mut p = lib_dir.as_os_str().to_owned();
            p.push(":");
            p.push(old);
            p
        }
        _ => lib_dir.as_os_str().to_owned(),
    };
    let mut cmd = Command::new(exe);
    cmd.arg(mode)
        .env("GPU_ARENA_BACKEND", "sim")
        .env_remove("GPU_ARENA_CONF")
        .env_remove("GPU_ARENA_LOG")
        .envs(env.iter().copied())
        .env("GPU_ARENA_EXPECT_LIB", &b.lib)
        .env("LD_LIBRARY_PATH", ld_path);
    let (status, output) = run_logged(cmd, &log_path);
    match status {
        Some(s) if s.success() => {
            // Shown with `cargo test -- --nocapture`.
            println!("{output}");
            assert!(
                output.contains("checks passed"),
                "{name} {mode} exited 0 without finishing:\n{output}"
            );
            output
        }
        Some(s) => panic!(
            "{name} {mode} failed ({s}); output:\n{output}\n(program: {}, log: {})",
            exe.display(),
            log_path.display()
        ),
        None => panic!(
            "{name} {mode} did not finish in {RUN_TIMEOUT:?} and was killed; output:\n{output}"
        ),
    }
}

/// The whole API on 2 sim devices, then every bad input of the table in api_test.c.
#[test]
fn c_program_api() {
    run_mode("api");
}

/// Before init: the calls that take back a pointer fail and initialize nothing; then the
/// first malloc initializes lazily. At the default log level (warn) nothing is logged.
#[test]
fn c_program_before_init() {
    let out = run_lifecycle("before-init");
    assert!(
        !out.contains(" INFO "),
        "info lines at the default level:\n{out}"
    );
}

/// The first call is `gpu_arena_stats`: it initializes from the environment.
#[test]
fn c_program_lazy_stats() {
    run_lifecycle("lazy-stats");
}

/// Threads race the first malloc: the pool is initialized once (one "gpu-arena
/// initialized" line at `GPU_ARENA_LOG=info`).
#[test]
fn c_program_lazy_race_initializes_once() {
    let out = run_lifecycle_with("lazy-race", &[("GPU_ARENA_LOG", "info")]);
    assert_eq!(
        out.matches("gpu-arena initialized").count(),
        1,
        "initialized once:\n{out}"
    );
}

/// `GPU_ARENA_LOG=debug` shows on stderr why `backend=auto` passed over each GPU backend
/// (without a GPU; on a CUDA machine it says it chose cuda).
#[test]
fn gpu_arena_log_shows_why_auto_passed_over_backends() {
    let out = run_lifecycle_with(
        "lazy-stats-auto",
        &[("GPU_ARENA_LOG", "debug"), ("GPU_ARENA_BACKEND", "auto")],
    );
    assert!(
        out.contains("gpu-arena initialized"),
        "no init line:\n{out}"
    );
    if !out.contains("backend=auto chose cuda") {
        for want in [
            "backend=auto passed over cuda",
            "backend=auto passed over hip; using sim",
        ] {
            assert!(out.contains(want), "no {want:?} on stderr:\n{out}");
        }
    }
}

/// A malformed `GPU_ARENA_CONF`: configure and init fail with the reason, nothing crashes.
#[test]
fn c_program_bad_env() {
    run_lifecycle("bad-env");
}

/// `backend=hip` in a build without HIP: init fails cleanly, every call reports it.
#[test]
fn c_program_bad_backend() {
    run_lifecycle("bad-backend");
}

/// Arena observers from C (`tests/c/observers_test.c`): ready/release rules, bad input,
/// re-entrant callbacks, threads.
#[test]
fn c_program_observers() {
    run_program(&built().observers_exe, "observers", &[]);
}

/// Graph pools from C (`tests/c/graph_pool_test.c`): a capture's routing, checkpoints,
/// segments, uses and release, bad calls, the stats resets.
#[test]
fn c_program_graph_pools() {
    run_program(&built().graph_pool_exe, "graph-pools", &[]);
}

/// The header is valid C++ too (`extern "C"`, no C-only constructs), and declares what a
/// C++ caller links against.
#[test]
fn header_compiles_as_cxx() {
    let cxx = std::env::var_os("CXX").unwrap_or_else(|| "c++".into());
    if Command::new(&cxx).arg("--version").output().is_err() {
        eprintln!("header_compiles_as_cxx: no C++ compiler ({cxx:?}); skipped");
        return;
    }
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("c-api-cxx");
    std::fs::create_dir_all(&dir).expect("create tmp dir");
    let src = dir.join("header.cpp");
    std::fs::write(
        &src,
        "#include \"gpu_arena.h\"\n\
         static_assert(sizeof(gpu_arena_stats_t) % 8 == 0, \"uint64_t fields\");\n\
         int main() {\n\
           gpu_arena_stats_t s{};\n\
           void* p = gpu_arena_malloc(64, 0, nullptr);\n\
           gpu_arena_free(p, 64, 0, nullptr);\n\
           return gpu_arena_stats(0, &s) == GPU_ARENA_OK ? 0 : 1;\n\
         }\n",
    )
    .expect("write header.cpp");
    let mut cmd = Command::new(cxx);
    cmd.args([
        "-std=c++11",
        "-Wall",
        "-Wextra",
        "-Werror",
        "-pedantic",
        "-fsyntax-only",
    ])
    .arg("-I")
    .arg(workspace_root().join("ffi").join("include"))
    .arg(&src);
    run_checked(cmd, "compiling gpu_arena.h as C++");
}

/// `bench/gpu/share_bench.c` (the C share/import latency bench) builds against the header
/// and runs on sim: 64 blocks shared, imported by its forked consumer (which checks their
/// bytes), closed, batch forms, unshared. Nothing about time is asserted (`--no-targets`).
#[test]
fn share_bench_runs_on_sim() {
    let b = built();
    let lib_dir = b.lib.parent().expect("lib dir");
    let out_dir = b.exe.parent().expect("the C programs' directory");
    let src = workspace_root()
        .join("bench")
        .join("gpu")
        .join("share_bench.c");
    let exe = compile_source(lib_dir, out_dir, "share_bench", &src);
    let mut cmd = Command::new(&exe);
    cmd.args(["--sim", "--n", "64", "--no-targets"])
        .env_remove("GPU_ARENA_CONF")
        .env_remove("GPU_ARENA_LOG");
    let (status, output) = run_logged(cmd, &exe.with_extension("log"));
    assert!(
        status.is_some_and(|s| s.success()),
        "share_bench --sim failed ({status:?}):\n{output}"
    );
    for row in [
        "sim backend, N=64",
        "| gpu_arena_share (exported arena) |",
        "| gpu_arena_import (mapped arena) |",
        "| gpu_arena_import_many, per share |",
    ] {
        assert!(output.contains(row), "no `{row}` in:\n{output}");
    }
}
