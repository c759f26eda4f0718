//! The C API of gpu-arena: `libgpu_arena.so` and `include/gpu_arena.h`.
//!
//! The first five functions have the signatures PyTorch's `CUDAPluggableAllocator` loads
//! (`alloc`, `free`, and the `init`, `reset`, `record_stream` hooks). Every function body
//! runs inside `catch_unwind` (`guard`, or `with_pool` for the calls that need the pool):
//! nothing crosses the C boundary as a panic. Errors are negative `GPU_ARENA_ERR_*` codes
//! (or NULL from `gpu_arena_malloc`) plus a thread-local message from
//! `gpu_arena_last_error()` that names the call, the value and the reason. A rejected call
//! changes nothing.
//!
//! Life cycle: `gpu_arena_configure` (optional, before first use) → `gpu_arena_init` (PyTorch
//! calls it when the allocator is installed) → allocations → process exit. Configuration is
//! also read from `GPU_ARENA_CONF` / `GPU_ARENA_BACKEND` at init.
//!
//! Lazy init: a call that needs the pool and finds it not initialized initializes it as
//! `gpu_arena_init` would (from `gpu_arena_configure`'s settings, else the environment), once
//! per process even when threads race (`OnceLock`): `gpu_arena_malloc`, `gpu_arena_stats`,
//! `gpu_arena_empty_cache` / `gpu_arena_reset`, `gpu_arena_validate`,
//! `gpu_arena_device_count`, `gpu_arena_snapshot_json`, `gpu_arena_share`,
//! `gpu_arena_import`, `gpu_arena_import_dlpack`, `gpu_arena_observe_arenas`. So a C program, or a framework that never calls init, just allocates.
//! The calls that take back something gpu-arena handed out (`gpu_arena_free(_checked)`,
//! `gpu_arena_record_stream(_checked)`, `gpu_arena_unshare`, `gpu_arena_close`,
//! `gpu_arena_close_dlpack`, `gpu_arena_unobserve_arenas`) do not
//! initialize: before init nothing can be gpu-arena's, and they fail with
//! `GPU_ARENA_ERR_NOT_INITIALIZED`. Neither do the queries `gpu_arena_init_status`,
//! `gpu_arena_backend_name`, `gpu_arena_imports_live` and `gpu_arena_dlpack_imports`. A failed init (lazy or not) is
//! final: every call that needs the pool then fails with `GPU_ARENA_ERR_NOT_INITIALIZED` and
//! the reason, `gpu_arena_init_status` with the failure's own code.
//!
//! Logs: the first init (or `gpu_arena_configure`) installs a stderr subscriber at the level
//! of `GPU_ARENA_LOG` (default `warn`) unless the process already has one (`logging.rs`).

//! Layout: this file only declares the modules and re-exports their items. `init.rs` holds
//! the process-wide pool and its initialization, `alloc_api.rs` the allocator's calls,
//! `errors.rs` the error codes, the last error and `guard` / `fail` / `status`; each
//! `*_api.rs` (and `observers.rs`, `logging.rs`) one part of the API, `dlpack_view.rs` the
//! reading of a DLPack view, `tables.rs` the tables other languages read at run time (the
//! stats fields and their metrics, the configuration keys). cbindgen lists their items in the order the modules are
//! declared here: that order is the header's.

// The exported functions check their pointer arguments themselves and are documented in the
// header; marking them `unsafe` would only change the generated Rust signatures.
#![allow(clippy::not_unsafe_ptr_arg_deref)]

mod init;
#[allow(unused_imports)]
pub use init::*;
mod alloc_api;
#[allow(unused_imports)]
pub use alloc_api::*;
mod errors;
#[allow(unused_imports)]
pub use errors::*;
mod ipc_api;
#[allow(unused_imports)]
pub use ipc_api::*;
mod dlpack_api;
#[allow(unused_imports)]
pub use dlpack_api::*;
mod dlpack_view;
pub use dlpack_view::GPU_ARENA_DLPACK_VIEW_HEAD;
mod torch_api;
#[allow(unused_imports)]
pub use torch_api::*;
mod observers;
#[allow(unused_imports)]
pub use observers::*;
mod sleep_api;
#[allow(unused_imports)]
pub use sleep_api::*;
mod torch_allocator_api;
#[allow(unused_imports)]
pub use torch_allocator_api::*;
mod transfer_api;
#[allow(unused_imports)]
pub use transfer_api::*;
mod tables;
#[allow(unused_imports)]
pub use tables::*;
mod logging;
pub use logging::gpu_arena_set_log_level;
