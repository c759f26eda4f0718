#!/usr/bin/env bash
# Build the Python wheel into DIR: the gpu_arena package with libgpu_arena.so inside it,
# built from ffi/ by maturin through pip (the same build as `pip install ./python`; see
# python/pyproject.toml). The wheel is py3-none-linux_x86_64: one for every Python 3, on any
# glibc at least as new as the build machine's newest symbol (2.34 from Debian 12).
# Usage: bash scripts/build-wheel.sh DIR [--dev]
#   (default) cargo's release profile (fat LTO), what users and the GPU machine get;
#   --dev     the dev profile (unoptimized, invariant checks on by default, seconds to build):
#             what scripts/test.sh tests.
# Needs Rust, Python 3 and pip (maturin and cffi come from PyPI into pip's build env).
# Prints the wheel's path last.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/build-wheel.sh DIR [--dev]}
settings=()
case ${2:-} in
  "") ;;
  --dev) settings=(--config-settings "build-args=--profile dev") ;;
  *) echo "unknown option: $2 (usage: scripts/build-wheel.sh DIR [--dev])" >&2; exit 2 ;;
esac
mkdir -p "$out"
rm -f "$out"/gpu_arena-*.whl
python3 -m pip wheel --no-deps --disable-pip-version-check -q "${settings[@]}" -w "$out" ./python
ls "$out"/gpu_arena-*.whl
