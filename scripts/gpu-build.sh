#!/usr/bin/env bash
# Build everything the GPU check needs on a development machine (cargo lives here, not on
# the GPU machine) and stage it, stripped, in .gpu/ (git-ignored; carried to the GPU): the
# Python wheel (scripts/build-wheel.sh, release) and its library as .gpu/libgpu_arena.so, the
# bench binaries, the GPU test executables, the header and the KV trace.
# Usage: scripts/gpu-build.sh && then on the GPU machine: bash scripts/gpu-check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -p gpu-arena-bench --bins --example pair_cost --example replay_pool \
  --example thread_scaling
cargo test --release --no-run -p gpu-arena --test cuda_backend --test pool_sim --test ipc_sim 2>&1 \
  | tee /tmp/gpu-build.log
# Everything but the NIXL wheel (scripts/nixl-wheel.sh: a download, kept between builds).
mkdir -p .gpu && find .gpu -mindepth 1 -maxdepth 1 ! -name wheels -exec rm -rf {} + && mkdir -p .gpu/bin
ls .gpu/wheels/nixl_*.whl >/dev/null 2>&1 || bash scripts/nixl-wheel.sh .gpu/wheels >/dev/null
# The wheel (pip install .gpu/gpu_arena-*.whl); the library in it is the one .gpu/ uses, so
# the fat-LTO link runs once.
wheel=$(bash scripts/build-wheel.sh .gpu | tail -1)
python3 -c 'import sys, zipfile; sys.stdout.buffer.write(zipfile.ZipFile(sys.argv[1]).read("gpu_arena/_native/lib_native.so"))' \
  "$wheel" >.gpu/libgpu_arena.so
for b in kv_replay kv_trace_dump; do cp "target/release/$b" .gpu/bin/; done
# The sim-backend pair loops for bench/gpu/mode_probe.sh and the thread scaling with its
# reserved bytes (CPU only: the host's 16 cores).
for b in pair_cost replay_pool thread_scaling; do cp "target/release/examples/$b" .gpu/bin/; done
cc -O2 -Iffi/include bench/capi/capi_pairs.c -L.gpu -lgpu_arena -Wl,-rpath,'$ORIGIN/..' \
  -o .gpu/bin/capi_pairs
for t in cuda_backend pool_sim ipc_sim; do
  exe=$(grep -oE "target/release/deps/${t}-[0-9a-f]+" /tmp/gpu-build.log | tail -1)
  cp "$exe" ".gpu/bin/$t"
done
for f in .gpu/libgpu_arena.so .gpu/bin/*; do strip "$f"; done
cp ffi/include/gpu_arena.h .gpu/ 2>/dev/null || true
# The seeded KV trace for bench/gpu/kv_bench.cpp (built on the GPU machine).
target/release/kv_trace_dump --out .gpu/kv_trace.bin
# The second trace (longer prompts, wider batches, mixed activation sizes).
target/release/kv_trace_dump --profile long --out .gpu/kv_trace_long.bin
du -sh .gpu
