#!/usr/bin/env bash
# The native torch allocator (python/gpu_arena/native/allocator.cpp) checked without a GPU:
#  1. compiled (-Wall -Wextra -Werror, -c: no linking) against the headers of each torch
#     version given, with gpu_arena.h's struct layouts checked (python -m
#     gpu_arena.torch_native check);
#  2. tests/torch_native/harness.cpp built with the first version's headers, linked to its
#     libc10 / libc10_cuda and run over gpu-arena's sim backend (target/debug/libgpu_arena.so,
#     built if missing): allocation, graph pools and checkpoints, stats, OOM, IPC handles, and the lifetime of
#     memory sent to a second process (tests/torch_native/ipc_lifetime.cpp).
# Wheels come from PyPI with pip (torch ~0.5-1 GB each, nvidia-cuda-runtime and -crt for the
# CUDA headers), kept in target/torch-native-check/ (only include/ and the two c10 libraries
# are extracted). Not part of .ci/run: about 2 GB of downloads for the default versions.
# Usage: bash scripts/check-torch-native.sh [TORCH_VERSION...]   (default: 2.11.0 2.8.0 2.15.0)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(2.11.0 2.8.0 2.15.0)
work=$root/target/torch-native-check
mkdir -p "$work"
PY=${PYTHON:-python3}
CXX=${CXX:-c++}
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --only-binary=:all: --no-deps -q)

extract() {  # wheel, dest, then path prefixes to extract
  "$PY" - "$@" <<'EOF'
import sys, zipfile
whl, dest, *prefixes = sys.argv[1:]
z = zipfile.ZipFile(whl)
z.extractall(dest, [n for n in z.namelist() if n.startswith(tuple(prefixes))])
EOF
}

# CUDA 13 headers: the runtime's and crt/ (what c10's CUDA headers include).
cuda=$work/cuda
if [ ! -f "$cuda/nvidia/cu13/include/crt/host_config.h" ]; then
  rm -rf "$work/cuda-whl" && mkdir -p "$work/cuda-whl"
  "$PY" -m pip download "${plat[@]}" -d "$work/cuda-whl" "nvidia-cuda-runtime==13.0.96" \
    "nvidia-cuda-crt==13.0.88"
  for w in "$work"/cuda-whl/*.whl; do extract "$w" "$cuda" nvidia/; done
  rm -rf "$work/cuda-whl"
fi
cuda_inc=$cuda/nvidia/cu13/include
cuda_lib=$cuda/nvidia/cu13/lib
[ -e "$cuda_lib/libcudart.so" ] || ln -s libcudart.so.13 "$cuda_lib/libcudart.so"

incs=()
for v in "${versions[@]}"; do
  d=$work/torch-$v
  if [ ! -f "$d/torch/include/c10/cuda/CUDACachingAllocator.h" ]; then
    rm -rf "$work/torch-whl" && mkdir -p "$work/torch-whl"
    "$PY" -m pip download "${plat[@]}" --python-version 3.12 -d "$work/torch-whl" "torch==$v"
    extract "$work"/torch-whl/torch-*.whl "$d" torch/include/ torch/lib/libc10.so \
      torch/lib/libc10_cuda.so
    rm -rf "$work/torch-whl"
  fi
  incs+=(--torch-include "$d/torch/include")
done

echo "== headers: ${versions[*]}"
(cd python && CXX=$CXX "$PY" -m gpu_arena.torch_native check --cuda-include "$cuda_inc" \
  --gpu-arena-header "$root/ffi/include" "${incs[@]}")

echo "== harness (torch ${versions[0]}, sim backend)"
lib=$root/target/debug/libgpu_arena.so
[ -f "$lib" ] || cargo build -p gpu-arena-ffi
t=$work/torch-${versions[0]}/torch
abi=$("$PY" - "$t/lib/libc10.so" <<'EOF'
import sys
# The new C++ ABI's std::string is std::__cxx11::basic_string: in libc10's symbol names.
print(1 if b"__cxx11" in open(sys.argv[1], "rb").read() else 0)
EOF
)
std=c++17
grep -q "strong_ordering" "$t/include/c10/util/intrusive_ptr.h" && std=c++20
"$CXX" -std=$std -O1 -g -rdynamic -Wall -Wextra -Werror -D_GLIBCXX_USE_CXX11_ABI="$abi" \
  -I "$root/python/gpu_arena/native" -isystem "$t/include" \
  -isystem "$t/include/torch/csrc/api/include" -isystem "$cuda_inc" \
  tests/torch_native/harness.cpp tests/torch_native/ipc_lifetime.cpp \
  python/gpu_arena/native/allocator.cpp -o "$work/harness" \
  -L "$t/lib" -lc10 -lc10_cuda -L "$cuda_lib" -lcudart -ldl \
  -Wl,-rpath,"$t/lib:$cuda_lib" 2> >(grep -v "needed by" >&2)
env -u GPU_ARENA_BACKEND GPU_ARENA_LOG=warn "$work/harness" "$lib"
