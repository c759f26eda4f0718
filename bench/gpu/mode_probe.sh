#!/usr/bin/env bash
# Why one process runs the same allocator ~1.5x faster than the next (issue #14's margin):
# the same work in fresh processes pinned to one CPU, with address-space randomization on
# (as usual) and off (`setarch -R`), and off with the stack moved by environment padding
# (`PAD`, 0..3840 bytes in 256-byte steps; a stack-versus-heap alignment test). One line per
# process. Two probes:
#   kv    the KV replay through the C API (cuda backend; .gpu/kv_bench from bench/gpu/build.sh)
#   pairs the sim backend's loops on the host CPU, no GPU (.gpu/bin/{pair_cost,capi_pairs,
#         replay_pool}, staged by scripts/gpu-build.sh): a Pool pair, a C API pair, a replay
# Usage (GPU machine, repository root): bash bench/gpu/mode_probe.sh kv|pairs [N] [CPU]
set -uo pipefail
probe=${1:?kv or pairs} n=${2:-6} cpu=${3:-2}
export GPU_ARENA_LIB=${GPU_ARENA_LIB:-$PWD/.gpu/libgpu_arena.so}
lscpu | grep -E "Model name|^CPU\(s\)|Thread|NUMA node[0-9]" | head -6
echo "THP: $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null)"
kv() { # label, prefix...
  local label=$1; shift
  local f; f=$(mktemp)
  "$@" taskset -c "$cpu" .gpu/kv_bench --trace .gpu/kv_trace.bin --out "$f" \
    --skip torch,cumemalloc,async --no-scaling --no-pairs >/dev/null 2>&1
  echo "$label | cold, warm ns/op: $(grep -m1 '^| gpu-arena (C API' "$f" | awk -F'|' '{print $3 "," $4}')"
  rm -f "$f"
}
pairs() { # label, prefix...
  local label=$1; shift
  local a b c
  a=$("$@" taskset -c "$cpu" .gpu/bin/pair_cost --pairs 3000000 --which pool | tail -1 | awk '{print $(NF-1)}')
  b=$(GPU_ARENA_BACKEND=sim "$@" taskset -c "$cpu" .gpu/bin/capi_pairs 3000000 | tail -1 | awk '{print $(NF-3)}')
  c=$("$@" taskset -c "$cpu" .gpu/bin/replay_pool --replays 2 --pairs 0 | tail -1 | awk '{print $3}')
  echo "$label | Pool pair $a ns | C API pair $b ns | replay warm $c ns/op"
}
for i in $(seq 1 "$n"); do "$probe" "aslr $i" env; done
for pad in $(seq 0 256 3840); do
  "$probe" "norand pad=$pad" setarch -R env "PAD=$(head -c "$pad" /dev/zero | tr '\0' x)"
done
