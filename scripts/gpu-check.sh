#!/usr/bin/env bash
# Run on the GPU machine from the repo root, after scripts/gpu-build.sh staged .gpu/. It runs
# the GPU-only tests: the cuda backend's, tests/python with torch, the tests/gpu/ checks, and the
# measurements (bench/gpu/: kv_bench, share_bench and the Python ones, e.g. `kv_repeat`).
# Every step's full log goes to $OUT (or ./gpu-out); a short table is printed last.
# Usage: bash scripts/gpu-check.sh [step ...]   (default: all steps)
# Any tests/gpu/gpu_NAME.py is a step NAME (e.g. `trim`, `multi_gpu`: issue #27's checks on every
# GPU of the host), any bench/gpu/NAME.py too; `torch_perf` is issue #23's pairs with the KV
# repeats in one call, `torch_grow` the torch checks on growing arenas.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
export GPU_ARENA_LIB=$PWD/.gpu/libgpu_arena.so PYTHONUNBUFFERED=1 RUST_BACKTRACE=1
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(info backend torch torch_native checkpoints torch_check kvbench kv_repeat ipc share_bench wheel)
declare -A status
run() { # name, command...
  local name=$1; shift
  echo "=== $name: $*" | tee -a "$OUT/summary.log"
  local t0=$SECONDS
  ( "$@" ) >"$OUT/$name.log" 2>&1; local rc=$?
  status[$name]="rc=$rc $((SECONDS - t0))s"
  tail -n 5 "$OUT/$name.log" | sed 's/^/    /'
}
for s in "${steps[@]}"; do case $s in
  info) run info bash -c 'nvidia-smi; python3 -c "import torch; print(torch.__version__, torch.version.cuda)"; date -u' ;;
  backend) run backend .gpu/bin/cuda_backend --ignored --test-threads=1 --nocapture ;;
  torch) run torch python3 -m pytest -q -rs tests/python ;;
  # The torch checks on growing arenas (issue #24): every child gets GPU_ARENA_CONF=grow_arenas=1
  # (the default since 9173c80; the *grow* steps still say it, as their results were taken).
  torch_grow) run torch_grow env GPU_ARENA_CHECK_CONF=grow_arenas=1 bash -c 'python3 -m pytest -q -rs tests/python/test_torch_gpu.py tests/python/test_ipc_torch_gpu.py &&
    python3 tests/gpu/gpu_torch_native.py --only graphs,compile,stats,mp,behaviour --graph-runs 4' ;;
  torch_check) run torch_check python3 tests/gpu/gpu_torch_check.py ;;
  # Issue #23's pair figures and the KV traces' ratio in the same run (one call).
  torch_perf) run torch_perf bash -c 'python3 tests/gpu/gpu_torch_native.py --only perf &&
    python3 bench/gpu/kv_repeat.py --runs 5 && mkdir -p "$OUT/long" && OUT="$OUT/long" python3 bench/gpu/kv_repeat.py --runs 5 --trace .gpu/kv_trace_long.bin' ;;
  kvbench) run kvbench bash bench/gpu/run.sh .gpu/kv_trace.bin "$OUT/kv_bench.md" ;;
  # Arenas that grow (issue #24): the KV trace beside PyTorch, then beside PyTorch with
  # expandable segments, the second trace, share/open latency, and the reserved table.
  kvgrow) run kvgrow bash bench/gpu/run.sh .gpu/kv_trace.bin "$OUT/kv_grow.md" --arena-conf backend=cuda,grow_arenas=1 ;;
  kvgrow_expandable) run kvgrow_expandable env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
    bash bench/gpu/run.sh .gpu/kv_trace.bin "$OUT/kv_grow_expandable.md" --arena-conf backend=cuda,grow_arenas=1 --no-pairs --no-scaling ;;
  kvgrow_long) run kvgrow_long bash bench/gpu/run.sh .gpu/kv_trace_long.bin "$OUT/kv_grow_long.md" --arena-conf backend=cuda,grow_arenas=1 --no-pairs --no-scaling ;;
  kvgrow_long_expandable) run kvgrow_long_expandable env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
    bash bench/gpu/run.sh .gpu/kv_trace_long.bin "$OUT/kv_grow_long_expandable.md" --arena-conf backend=cuda,grow_arenas=1 --no-pairs --no-scaling ;;
  kv_repeat_grow) run kv_repeat_grow python3 bench/gpu/kv_repeat.py --runs 5 --arena-conf backend=cuda,grow_arenas=1 ;;
  scaling_grow) run scaling_grow bash bench/gpu/run.sh .gpu/kv_trace.bin "$OUT/scaling_grow.md" --arena-conf backend=cuda,grow_arenas=1 --no-replay --skip cumemalloc,async ;;
  share_grow) run share_grow env GPU_ARENA_CONF=grow_arenas=1 bash bench/gpu/share_bench.sh --out "$OUT/share_grow.md" ;;
  reserved) run reserved python3 bench/gpu/torch_reserved.py --modes torch,torch-expandable,gpu-arena-grow \
    --workloads small_train,small_generate,medium_train,medium_generate --out "$OUT/reserved-sm.md" ;;
  reserved_large) run reserved_large bash -c "python3 bench/gpu/torch_reserved.py --modes torch,torch-expandable,gpu-arena-grow --workloads large_train --out '$OUT/reserved-lt.md' &&
    python3 bench/gpu/torch_reserved.py --modes torch,torch-expandable,gpu-arena-grow --workloads large_generate --scale 0.25 --out '$OUT/reserved-lg.md'" ;;
  reserved_traces) run reserved_traces python3 bench/gpu/torch_reserved.py --modes torch,torch-expandable,gpu-arena-grow \
    --workloads small_train,small_generate --trace-dir "$OUT/traces" --trace-modes torch,torch-expandable,gpu-arena-grow \
    --out "$OUT/reserved-traces.md" ;;
  # Issue #24's trade-off in one call each: the reserved table with fixed and growing arenas
  # beside PyTorch and expandable segments; the two KV traces' speed, fixed and growing taking turns.
  tradeoff_reserved) run tradeoff_reserved bash -c "python3 bench/gpu/torch_reserved.py --modes torch,torch-expandable,gpu-arena-grow,gpu-arena-fixed \
      --workloads small_train,small_generate,medium_train,medium_generate,large_train --out '$OUT/tradeoff-reserved.md' &&
    python3 bench/gpu/torch_reserved.py --modes torch,torch-expandable,gpu-arena-grow,gpu-arena-fixed --workloads large_generate --scale 0.25 \
      --out '$OUT/tradeoff-reserved-lg.md'" ;;
  # (KV_ROUNDS rounds, default 2, of KV_RUNS processes per mode and trace, default 5.)
  tradeoff_kv) run tradeoff_kv bash -c 'for r in $(seq "${KV_ROUNDS:-2}"); do for t in kv_trace kv_trace_long; do for g in 0 1; do
      OUT="$0/kv-$t-grow$g-r$r" python3 bench/gpu/kv_repeat.py --runs "${KV_RUNS:-5}" --trace ".gpu/$t.bin" \
        --arena-conf "backend=cuda,grow_arenas=$g" || exit 1; done; done; done' "$OUT" ;;
  scaling_sim) run scaling_sim bash -c '.gpu/bin/thread_scaling --threads 1,2,4,8 --workloads 2MiB,mixed --pairs 500000 --grow &&
    .gpu/bin/thread_scaling --threads 1,2,4,8 --workloads 2MiB,mixed --pairs 500000' ;;
  kvsim) run kvsim .gpu/bin/kv_replay --backend sim --no-per-allocation --no-sweep ;;
  kv) run kv .gpu/bin/kv_replay --backend cuda --no-per-allocation ;;
  ipc) run ipc python3 tests/gpu/gpu_ipc_check.py ;;
  # Issue #47: weight sync through torch.multiprocessing and weight_sync's buckets beside
  # PyTorch's CUDA IPC (with and without ipc_collect), then the 70B-shaped sync in 1 GiB
  # buckets beside torch's reduce_tensor / rebuild_cuda_tensor; the faults: weight_sync_faults.
  weight_sync) run weight_sync python3 bench/gpu/weight_sync.py --all --paths queue,bucket \
    --allocs torch,torch_collect,gpu_arena_torch_ipc,gpu_arena --out-dir "$OUT/weight_sync" ;;
  # The receiver acking before it drops (the sender's drop may come first: torch's limbo).
  weight_sync_ackfirst) run weight_sync_ackfirst python3 bench/gpu/weight_sync.py --all --modes fresh --ack-first \
    --allocs torch,gpu_arena_torch_ipc,gpu_arena --out-dir "$OUT/weight_sync_ackfirst" ;;
  weight_sync_70b) run weight_sync_70b python3 bench/gpu/weight_sync.py --all --shape 70b --modes inplace \
    --paths reduce,bucket --allocs torch,gpu_arena --syncs 20 --bucket-mib 1024 --out-dir "$OUT/weight_sync_70b" ;;
  share_bench) run share_bench bash bench/gpu/share_bench.sh --out "$OUT/share_bench.md" ;;
  wheel) run wheel bash -c 'rm -rf .gpu/site && python3 -m pip install -q --no-deps --target .gpu/site .gpu/gpu_arena-*.whl &&
    env -u GPU_ARENA_LIB PYTHONPATH=.gpu/site python3 tests/gpu/gpu_wheel_check.py' ;;
  *) if [ -f "tests/gpu/gpu_$s.py" ]; then run "$s" python3 "tests/gpu/gpu_$s.py"  # a check (trim, ...)
     elif [ -f "bench/gpu/$s.py" ]; then run "$s" python3 "bench/gpu/$s.py"; fi ;;  # a measurement (kv_repeat, ...)
esac; done
echo; echo "step | status"; for k in "${!status[@]}"; do echo "$k | ${status[$k]}"; done | sort
# The device tool brings back at most 8 files of $OUT, 2 folders down: every report and log in
# one archive too, named to sort first (`tar xzf 0-reports.tgz` where they come back).
tar czf "/tmp/gpu-reports.$$.tgz" -C "$OUT" --exclude=./0-reports.tgz . &&
  mv "/tmp/gpu-reports.$$.tgz" "$OUT/0-reports.tgz"
