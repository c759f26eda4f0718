#!/usr/bin/env bash
# Build bench/gpu/share_bench.c (plain C: a C compiler, the header, libgpu_arena.so; no
# cargo) and run it: share / import latency of the C API measured in C (issue #14).
# On the GPU machine .gpu/ holds libgpu_arena.so (scripts/gpu-build.sh stages it); on a dev
# machine pass GPU_ARENA_LIB=target/release/libgpu_arena.so and --sim.
#
# Usage: bash bench/gpu/share_bench.sh [share_bench options: --sim --n N --out FILE.md]
#   e.g. bash bench/gpu/share_bench.sh --out "$OUT/share_bench.md"
# Env:   GPU_ARENA_LIB (default <repo>/.gpu/libgpu_arena.so), CC (cc),
#        SHARE_BENCH_BIN (default: next to the library, share_bench).
# Exit:  share_bench's status (0 targets met, 1 a target failed, 2 error); 2 on build errors.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
lib=${GPU_ARENA_LIB:-$root/.gpu/libgpu_arena.so}
[ -f "$lib" ] || { echo "[share_bench] $lib not found (scripts/gpu-build.sh stages it in .gpu/)" >&2; exit 2; }
libdir=$(cd "$(dirname "$lib")" && pwd)
inc=$root/ffi/include
[ -f "$inc/gpu_arena.h" ] || inc=$root/.gpu
bin=${SHARE_BENCH_BIN:-$libdir/share_bench}
# Link the very file named: a copy or link named libgpu_arena.so in its directory.
[ "$(basename "$lib")" = libgpu_arena.so ] || { echo "[share_bench] GPU_ARENA_LIB must name libgpu_arena.so" >&2; exit 2; }
"${CC:-cc}" -O2 -std=c11 -Wall -Wextra -pthread -I "$inc" "$here/share_bench.c" -o "$bin" \
  -L "$libdir" -lgpu_arena -Wl,-rpath,"$libdir" || { echo "[share_bench] build failed" >&2; exit 2; }
echo "[share_bench] built $bin against $lib"
"$bin" "$@"
