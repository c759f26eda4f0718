#!/usr/bin/env bash
# Build bench/gpu/kv_bench.cpp on the GPU machine (g++, CUDA headers, libcuda, python3 with
# torch; no cargo needed). Prints what it found; fails clearly.
#
# Usage: bash bench/gpu/build.sh [OUTPUT]          (default OUTPUT: .gpu/kv_bench)
# Env:   CXX (g++), PYTHON (python3), CUDA_HOME, KV_BENCH_STD (try this -std first),
#        KV_BENCH_REQUIRE_TORCH=1 (fail instead of building without torch).
#
# Without a usable torch the binary is built with -DKV_BENCH_NO_TORCH (the torch rows say
# "not built") and OUTPUT.no-torch holds the reason; run.sh then exits non-zero.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
out=${1:-$root/.gpu/kv_bench}
mkdir -p "$(dirname "$out")"
rm -f "$out" "$out.no-torch"
CXX=${CXX:-g++}
PY=${PYTHON:-python3}
say() { echo "[build] $*"; }
fail() { echo "[build] ERROR: $*" >&2; exit 1; }

command -v "$CXX" >/dev/null || fail "no C++ compiler ($CXX)"
say "compiler: $(command -v "$CXX"): $("$CXX" --version | head -1)"

# gpu-arena's C header (types only: the library itself is dlopen'ed at run time).
ga_inc=""
for d in "$root/ffi/include" "$root/.gpu"; do
  [ -f "$d/gpu_arena.h" ] && { ga_inc=$d; break; }
done
[ -n "$ga_inc" ] || fail "gpu_arena.h not found in ffi/include or .gpu/"
say "gpu_arena.h: $ga_inc/gpu_arena.h"

# torch: version, C++ ABI, include and lib dirs.
torch_ok=1
torch_why=""
torch_env=$("$PY" - <<'EOF' 2>/tmp/kv_bench_torch_probe.err
import os, shlex
import torch
d = os.path.dirname(torch.__file__)
inc = []
try:
    import torch.utils.cpp_extension as c
    inc = list(c.include_paths())
except Exception:
    pass
if not inc:
    inc = [os.path.join(d, "include"), os.path.join(d, "include", "torch", "csrc", "api", "include")]
abi = 1
try:
    abi = int(torch.compiled_with_cxx11_abi())
except Exception:
    pass
for k, v in [("TORCH_VERSION", torch.__version__), ("TORCH_CUDA", str(torch.version.cuda)),
             ("TORCH_ABI", str(abi)), ("TORCH_LIB", os.path.join(d, "lib")),
             ("TORCH_INC", ":".join(inc))]:
    print(f"{k}={shlex.quote(v)}")
EOF
) || { torch_ok=0; torch_why="python3 -c 'import torch' failed: $(tail -3 /tmp/kv_bench_torch_probe.err | tr '\n' ' ')"; }
TORCH_VERSION=unknown TORCH_CUDA="" TORCH_ABI=1 TORCH_LIB="" TORCH_INC=""
if [ "$torch_ok" = 1 ]; then
  eval "$torch_env"
  say "torch $TORCH_VERSION (CUDA $TORCH_CUDA), cxx11 ABI $TORCH_ABI"
  say "torch lib: $TORCH_LIB"
  say "torch include: $TORCH_INC"
  if [ ! -f "$TORCH_LIB/libc10_cuda.so" ]; then
    torch_ok=0; torch_why="no libc10_cuda.so in $TORCH_LIB (a CPU-only torch?)"
  fi
  found_hdr=0
  IFS=: read -r -a torch_incs <<<"$TORCH_INC"
  for d in "${torch_incs[@]}"; do
    [ -f "$d/c10/cuda/CUDACachingAllocator.h" ] && found_hdr=1
  done
  if [ "$found_hdr" = 0 ]; then
    torch_ok=0; torch_why="c10/cuda/CUDACachingAllocator.h not under $TORCH_INC"
  fi
fi

# CUDA headers: cuda.h (driver API) and cuda_runtime_api.h + crt/ (the c10 headers need them).
site_cuda=$("$PY" - <<'EOF' 2>/dev/null || true
import glob, os, site
roots = []
try:
    roots += site.getsitepackages()
except Exception:
    pass
try:
    import torch
    roots.append(os.path.dirname(os.path.dirname(torch.__file__)))
except Exception:
    pass
seen = set()
for r in roots:
    for d in sorted(glob.glob(os.path.join(r, "nvidia", "*", "include"))) + [os.path.join(r, "nvidia", "cuda_runtime", "include")]:
        if d not in seen and os.path.isdir(d):
            seen.add(d)
            print(d)
EOF
)
nvcc_inc=""
command -v nvcc >/dev/null && nvcc_inc=$(cd "$(dirname "$(command -v nvcc)")/.." && pwd)/include
cuda_inc=""
for d in ${CUDA_HOME:+"$CUDA_HOME/include"} /usr/local/cuda/include ${nvcc_inc:+"$nvcc_inc"} /usr/local/cuda-13*/include $site_cuda; do
  if [ -f "$d/cuda.h" ] && [ -f "$d/cuda_runtime_api.h" ] && [ -f "$d/crt/host_defines.h" ]; then
    cuda_inc=$d; break
  fi
done
[ -n "$cuda_inc" ] || fail "no CUDA include dir with cuda.h, cuda_runtime_api.h and crt/host_defines.h (set CUDA_HOME)"
say "CUDA include: $cuda_inc ($(grep -m1 -E '^#define CUDA_VERSION' "$cuda_inc/cuda.h" || echo 'CUDA_VERSION ?'))"

# libcuda (the driver): the real one, else the toolkit's link stub.
libcuda=$(ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 .*x86-64/ {print $NF; exit}' || true)
if [ -z "$libcuda" ]; then
  for f in /usr/lib/x86_64-linux-gnu/libcuda.so.1 /usr/lib64/libcuda.so.1 /usr/lib/libcuda.so.1 \
           ${CUDA_HOME:+"$CUDA_HOME/lib64/stubs/libcuda.so"} /usr/local/cuda/lib64/stubs/libcuda.so \
           /usr/local/cuda/targets/x86_64-linux/lib/stubs/libcuda.so; do
    [ -f "$f" ] && { libcuda=$f; break; }
  done
fi
[ -n "$libcuda" ] || fail "libcuda.so.1 not found (ldconfig -p, /usr/lib*, CUDA stubs)"
say "libcuda: $libcuda"

src=$here/kv_bench.cpp
common=(-O2 -g -Wall -pthread -I"$ga_inc" -isystem "$cuda_inc")
links=("$libcuda" -ldl -pthread)
log=$(mktemp /tmp/kv_bench_build.XXXXXX.log)

if [ "$torch_ok" = 1 ]; then
  tinc=()
  for d in "${torch_incs[@]}"; do tinc+=(-isystem "$d"); done
  # libcudart as libc10_cuda resolves it (torch's own wheel copy); linked only if needed.
  cudart=$(ldd "$TORCH_LIB/libc10_cuda.so" 2>/dev/null | awk '/libcudart/ {print $3; exit}' || true)
  cudart_args=()
  if [ -n "$cudart" ] && [ -f "$cudart" ]; then
    say "libcudart (from libc10_cuda's deps): $cudart"
    cudart_args=(-Wl,--as-needed "$cudart" -Wl,--no-as-needed -Wl,-rpath,"$(dirname "$cudart")")
  else
    say "libcudart: not resolved by ldd of libc10_cuda.so (not linked directly)"
  fi
  # Let the linker find libc10_cuda's own dependencies where the loader finds them.
  linkdirs=()
  while read -r d; do
    [ -n "$d" ] && linkdirs+=(-Wl,-rpath-link,"$d")
  done < <(ldd "$TORCH_LIB/libc10_cuda.so" 2>/dev/null | awk '/=> \// {print $3}' | xargs -r -n1 dirname | sort -u || true)
  built=0
  for std in ${KV_BENCH_STD:-} c++17 c++20; do
    say "compiling with torch, -std=$std ..."
    if "$CXX" -std="$std" "${common[@]}" "${tinc[@]}" -D_GLIBCXX_USE_CXX11_ABI="$TORCH_ABI" \
        -DKV_TORCH_VERSION="\"$TORCH_VERSION\"" "$src" -o "$out" \
        -L"$TORCH_LIB" -lc10_cuda -lc10 -Wl,-rpath,"$TORCH_LIB" "${linkdirs[@]}" \
        -Wl,--allow-shlib-undefined "${cudart_args[@]}" "${links[@]}" \
        >"$log" 2>&1; then
      built=1; break
    fi
    say "-std=$std failed; last lines of $log:"
    grep -E 'error|undefined' "$log" | head -20 | sed 's/^/    /' || true
    tail -5 "$log" | sed 's/^/    /'
  done
  if [ "$built" = 0 ]; then
    torch_ok=0; torch_why="compiling/linking against torch failed (log: $log)"
  fi
fi

if [ "$torch_ok" = 0 ]; then
  [ "${KV_BENCH_REQUIRE_TORCH:-0}" = 1 ] && fail "torch: $torch_why"
  say "WARNING: building WITHOUT torch: $torch_why"
  "$CXX" -std=c++17 "${common[@]}" -DKV_BENCH_NO_TORCH "$src" -o "$out" "${links[@]}" >"$log" 2>&1 \
    || { cat "$log" >&2; fail "compiling kv_bench without torch failed too"; }
  echo "$torch_why" >"$out.no-torch"
fi
say "built $out$([ "$torch_ok" = 1 ] && echo ' (with torch)' || echo ' (WITHOUT torch)')"
