#!/usr/bin/env bash
# The test command: every Rust test (unit, property, sim pool and IPC with real processes,
# the C program tests/c/api_test.c against libgpu_arena.so, the header check) and the Python
# package's tests (tests/python). GPU-only tests are #[ignore]d / skipped here;
# scripts/gpu-check.sh runs them, and tests/gpu/, on a GPU.
# Installs what it needs that a Rust toolchain lacks: pytest (tests/python/requirements.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c 'import pytest' 2>/dev/null; then
  python3 -m pip install -q --disable-pip-version-check -r tests/python/requirements.txt
fi
cargo build --workspace --all-targets
cargo test --workspace
cargo build -p gpu-arena-ffi --lib
python3 -m pytest -q -rs tests/python
