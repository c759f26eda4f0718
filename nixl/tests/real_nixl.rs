//! The registrar over the real NIXL library: nixl-sys built with `stub-api` resolves NIXL at
//! run time (`dlopen("libnixl_capi.so")`), which the pip wheel carries (`nixl-cu12`, loads
//! without a GPU). CI runs this with the wheel's library folder on `LD_LIBRARY_PATH` and
//! `GPU_ARENA_REQUIRE_NIXL=1` (`.ci/run`): there a missing library fails the test; elsewhere
//! it says so and returns.
#![cfg(feature = "nixl")]
#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use gpu_arena::backend::sim::{SimBackend, SimConfig};
use gpu_arena::{Pool, PoolConfig, StreamId};
use gpu_arena_nixl::{ArenaRegistrar, NixlTransport};

const MIB: u64 = 1 << 20;
const S: StreamId = StreamId(0x2000);

/// Whether libnixl_capi.so loads in this process (nixl-sys aborts when it does not).
fn nixl_loads() -> bool {
    let name = c"libnixl_capi.so";
    // SAFETY: a NUL-terminated name; the handle is only checked, then kept (NIXL stays
    // loaded for nixl-sys, which opens it by the same name).
    let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    !handle.is_null()
}

#[test]
fn every_arena_is_registered_with_a_real_nixl_agent_and_deregistered_before_it_goes() {
    if !nixl_loads() {
        assert!(
            std::env::var("GPU_ARENA_REQUIRE_NIXL").as_deref() != Ok("1"),
            "libnixl_capi.so does not load: put the nixl-cu12 wheel's .nixl_cu12.mesonpy.libs on LD_LIBRARY_PATH"
        );
        eprintln!("NIXL is not installed here: not run (CI runs it)");
        return;
    }
    // Fixed 8 MiB arenas, then growing ones (the default: an observed growing class makes
    // new arenas of doubling sizes instead of growing one in place).
    for grow in [false, true] {
        registers_every_arena(grow);
    }
}

/// Blocks of 2 MiB and one of 20 MiB under a registrar over a real NIXL agent: one
/// registration per arena, each arena deregistered before it goes.
fn registers_every_arena(grow: bool) {
    let agent = nixl_sys::Agent::new(&format!("gpu-arena-registrar-test-{grow}")).unwrap();
    let plugins = agent.get_available_plugins().unwrap();
    let names: Vec<String> = (0..plugins.len().unwrap())
        .map(|i| plugins.get(i).unwrap().to_string())
        .collect();
    assert!(names.iter().any(|n| n == "UCX"), "plugins: {names:?}");
    let (_mems, params) = agent.get_plugin_params("UCX").unwrap();
    agent.create_backend("UCX", &params).unwrap();

    let sim = Arc::new(SimBackend::new(SimConfig::default()).unwrap());
    let config = PoolConfig {
        arena_size: 8 * MIB,
        grow_arenas: grow,
        ..PoolConfig::default()
    };
    let pool = Pool::new(sim, config).unwrap();
    let reg = Arc::new(ArenaRegistrar::new(NixlTransport::for_backend(
        agent, "sim",
    )));
    let id = pool.observe_arenas(reg.clone());
    let arenas = || pool.stats(0).unwrap().arenas as usize;
    let blocks: Vec<_> = (0..4).map(|_| pool.alloc(0, 2 * MIB, S).unwrap()).collect();
    assert_eq!(
        reg.registered().len(),
        arenas(),
        "one NIXL registration per arena"
    );
    if !grow {
        assert_eq!(arenas(), 1, "4 blocks, one 8 MiB arena");
    }
    let big = pool.alloc(0, 20 * MIB, S).unwrap();
    let with_big = arenas();
    assert_eq!(reg.registered().len(), with_big);
    pool.free(big.ptr).unwrap();
    pool.empty_cache(None).unwrap();
    assert!(arenas() < with_big, "the 20 MiB block's arena went");
    assert_eq!(
        reg.registered().len(),
        arenas(),
        "deregistered before the arena went"
    );
    for b in blocks {
        pool.free(b.ptr).unwrap();
    }
    pool.unobserve_arenas(id).unwrap();
    assert!(reg.registered().is_empty());
    assert_eq!(
        pool.stats(0).unwrap().observer_errors,
        0,
        "NIXL refused nothing"
    );
}
