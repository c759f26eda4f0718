#!/usr/bin/env bash
# Build kv_bench and run it: the KV trace through gpu-arena (C API, cuda backend),
# cuMemAlloc, cuMemAllocAsync and PyTorch's caching allocator, then the pair latencies.
# Run on the GPU machine from anywhere; .gpu/ must hold libgpu_arena.so (scripts/gpu-build.sh
# stages it on a development machine) and the trace (kv_trace_dump writes it).
#
# Usage: bash bench/gpu/run.sh TRACEFILE OUT.md [kv_bench options...]
#   e.g. bash bench/gpu/run.sh .gpu/kv_trace.bin "$OUT/kv_bench.md"
# Env:   GPU_ARENA_LIB (default: <repo>/.gpu/libgpu_arena.so), KV_BENCH_BIN (default:
#        <repo>/.gpu/kv_bench), and build.sh's variables.
# Exit:  kv_bench's status (0 ok, 1 failures, 2 setup error); 3 when the run was fine but
#        torch could not be built in.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
if [ $# -lt 2 ]; then
  echo "usage: bash bench/gpu/run.sh TRACEFILE OUT.md [kv_bench options...]" >&2
  exit 2
fi
trace=$1 out=$2
shift 2
bin=${KV_BENCH_BIN:-$root/.gpu/kv_bench}
export GPU_ARENA_LIB=${GPU_ARENA_LIB:-$root/.gpu/libgpu_arena.so}

[ -f "$trace" ] || { echo "[run] trace $trace not found (make it with kv_trace_dump on a dev machine)" >&2; exit 2; }
[ -f "$GPU_ARENA_LIB" ] || { echo "[run] $GPU_ARENA_LIB not found (scripts/gpu-build.sh stages it in .gpu/)" >&2; exit 2; }
bash "$here/build.sh" "$bin" || { echo "[run] build failed" >&2; exit 2; }

echo "[run] GPU_ARENA_LIB=$GPU_ARENA_LIB"
echo "[run] trace: $trace ($(stat -c %s "$trace") bytes)"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=index,name,driver_version,memory.used,memory.total --format=csv,noheader | sed 's/^/[run] gpu: /'
mkdir -p "$(dirname "$out")"
echo "[run] $bin --trace $trace --out $out $*"
"$bin" --trace "$trace" --out "$out" "$@"
rc=$?
echo "[run] kv_bench exited $rc"
if [ -f "$bin.no-torch" ]; then
  echo "[run] WARNING: kv_bench was built WITHOUT torch: $(cat "$bin.no-torch")" >&2
  [ "$rc" = 0 ] && rc=3
fi
exit "$rc"
