#!/usr/bin/env bash
# The test command: every Rust test (unit, property, sim pool and IPC with real processes,
# the C program against libgpu_arena.so, the header check) and the Python package's tests.
# GPU-only tests are #[ignore]d / skipped here; scripts/gpu-check.sh runs them on a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --workspace --all-targets
cargo test --workspace
cargo build -p gpu-arena-ffi --lib
(cd python && python3 -m pytest -q -rs tests)
