#!/usr/bin/env bash
# Run on the GPU machine (repo root, .gpu/ staged by scripts/gpu-build.sh and
# scripts/nixl-wheel.sh): install the carried NIXL wheel and run tests/gpu/gpu_nixl_kv.py for
# each scenario named (default: naive nocache vmm legacy legacy_nocache kill). Logs and JSON under $OUT/nixl; each
# scenario's one-line JSON summary is printed and appended to $OUT/nixl/summary.jsonl.
#   vmm        gpu-arena's default VMM arenas                     (2 cycles)
#   legacy     gpu-arena with legacy_ipc=1 (cuIpc-capable arenas) (10 cycles)
#   naive      PyTorch's allocator, one registration per tensor   (3 cycles)
#   nocache    naive with UCX_CUDA_IPC_CACHE=n                    (3 cycles)
#   legacy_nocache  legacy with UCX_CUDA_IPC_CACHE=n in the consumer (10 cycles)
#   fresh      legacy, the consumer replaces its NIXL agent after each cycle (3 cycles)
#   kill       legacy, the consumer SIGKILLed mid-transfer
#   peer       legacy, the consumer on GPU 1 (two GPUs)           (3 cycles)
#   peer_nocache  peer with UCX_CUDA_IPC_CACHE=n                   (10 cycles)
#   peer_kill  peer, the consumer SIGKILLed mid-transfer
#   plugin     NIXL's backend GPU_ARENA on default (VMM) arenas, no UCX variable (10 cycles)
#   plugin_kill          plugin, the consumer SIGKILLed mid-transfer
#   plugin_killproducer  plugin, the producer SIGKILLed during the consumer's READs
#   plugin_sleep  a registered KV cache sleeps and wakes between READs (gpu_nixl_sleep.py)
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT/nixl"
site=/tmp/nixl-site
[ -d "$site" ] || python3 -m pip install -q --no-deps --no-index --target "$site" .gpu/wheels/nixl_cu13-*.whl
export PYTHONPATH=$site:$PWD/python GPU_ARENA_LIB=$PWD/.gpu/libgpu_arena.so PYTHONUNBUFFERED=1
# One H200 has no NVLink peer: UCX then turns cuda_ipc GET off ("auto"); the consumer READs.
export UCX_CUDA_IPC_ENABLE_GET_ZCOPY=${UCX_CUDA_IPC_ENABLE_GET_ZCOPY:-y}
kv() { timeout "${T:-400}" python3 tests/gpu/gpu_nixl_kv.py --out "$OUT/nixl" "$@" 2>&1 | tail -1 | tee -a "$OUT/nixl/summary.jsonl"; }
steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(naive nocache vmm legacy legacy_nocache kill)
for s in "${steps[@]}"; do case $s in
  vmm) kv --flow arena --cycles 2 --blocks 128 --tag=-vmm ;;
  legacy) kv --flow arena --conf legacy_ipc=1 --cycles 10 --tag=-legacy ;;
  naive) kv --flow naive --cycles 3 --tag=-naive ;;
  nocache) UCX_CUDA_IPC_CACHE=n kv --flow naive --cycles 3 --tag=-naive-nocache ;;
  legacy_nocache) UCX_CUDA_IPC_CACHE=n kv --flow arena --conf legacy_ipc=1 --cycles 10 --tag=-legacy-nocache ;;
  fresh) kv --flow arena --conf legacy_ipc=1 --cycles 3 --fresh-agent --tag=-legacy-fresh ;;
  kill) kv --flow arena --conf legacy_ipc=1 --kill --tag=-legacy ;;
  peer) kv --flow arena --conf legacy_ipc=1 --cycles 3 --consumer-device 1 --tag=-legacy-peer ;;
  peer_nocache) UCX_CUDA_IPC_CACHE=n kv --flow arena --conf legacy_ipc=1 --cycles 10 --consumer-device 1 --tag=-legacy-peer-nocache ;;
  peer_kill) kv --flow arena --conf legacy_ipc=1 --kill --consumer-device 1 --tag=-legacy-peer ;;
  peer_vmm) kv --flow arena --cycles 2 --blocks 128 --consumer-device 1 --tag=-vmm-peer ;;
  plugin)
    (unset UCX_CUDA_IPC_ENABLE_GET_ZCOPY; kv --flow plugin --cycles 10 --tag=-plugin) ;;
  plugin_kill) kv --flow plugin --kill --tag=-plugin ;;
  plugin_killproducer) kv --flow plugin --kill-producer --tag=-plugin ;;
  peer_plugin) kv --flow plugin --cycles 3 --consumer-device 1 --tag=-plugin-peer ;;
  plugin_sleep) timeout "${T:-400}" python3 tests/gpu/gpu_nixl_sleep.py --out "$OUT/nixl" 2>&1 | tail -1 | tee -a "$OUT/nixl/summary.jsonl" ;;
  *) echo "unknown scenario $s" ;;
esac; done
