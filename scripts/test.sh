#!/usr/bin/env bash
# The test command: every Rust test (unit, property, sim pool and IPC with real processes,
# the C programs tests/c/*_test.c against libgpu_arena.so, the header check) and the Python
# package's tests (tests/python) against the installed wheel: the wheel is built
# (scripts/build-wheel.sh --dev), installed with tests/python/requirements.txt (pinned) into
# a fresh venv (target/test-venv) with NIXL (tests/python/requirements-nixl.txt), and pytest runs there with GPU_ARENA_LIB unset, python/
# off the path, GPU_ARENA_REQUIRE_NIXL=1 (test_nixl_sim.py fails, not skips, without NIXL) and GPU_ARENA_EXPECT_INSTALLED=1 (test_install.py checks the package and its
# library come from the venv). GPU-only tests are #[ignore]d / skipped here;
# scripts/gpu-check.sh runs them, and tests/gpu/, on a GPU.
# Needs Rust and Python 3 with pip and venv; fetches from PyPI what the wheel build and the
# tests need.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --workspace --all-targets
cargo test --workspace
wheel=$(bash scripts/build-wheel.sh target/wheels --dev | tail -1)
venv=target/test-venv
rm -rf "$venv"
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check "$wheel" -r tests/python/requirements.txt
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps -r tests/python/requirements-nixl.txt
env -u GPU_ARENA_LIB -u PYTHONPATH GPU_ARENA_EXPECT_INSTALLED=1 GPU_ARENA_REQUIRE_NIXL=1 \
  "$venv/bin/python" -m pytest -q -rs tests/python
