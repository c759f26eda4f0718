#!/usr/bin/env python3
"""Does gpu-arena as torch's allocator change NCCL's per-op time? World size 1, one GPU.

issue #27's ddp check compares all_reduce time per op under gpu-arena and PyTorch's
allocator. On one H200 (2026-12-04) the gpu-arena process was 1.4-1.6x slower in two calls
of five and within noise or faster in the other three, where a world of 1 makes the op
launch-bound (~15 us at 1 MiB and at 64 MiB alike). This runs the same loop in ``--pairs``
pairs of fresh processes, the two allocators taking turns (ABBA...), every process pinned to
the same CPU (``--cpu``), and with ``--avoid-record-streams`` also with
TORCH_NCCL_AVOID_RECORD_STREAMS=1; each gpu-arena process also reports what the allocator
saw during the timed loop (allocations, frees, record_stream calls), so a per-op call into
gpu-arena from c10d would show.

    python3 bench/gpu/allreduce_probe.py [--pairs 4] [--cpu 3] [--iters 200] [--out FILE]

Needs GPU_ARENA_LIB / PYTHONPATH as the other GPU checks (tests/gpu/). Prints a table; the
raw figures go to --out (JSON). A child's result travels in a file of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "gpu"))
from gpu_common import free_port  # noqa: E402  (tests/gpu/gpu_common.py)

SIZES = (1 << 20, 64 << 20)


def child(mode: str, iters: int, result: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "gpu"))
    from torch_native_common import setup  # noqa: E402  (tests/gpu/)

    torch, ga = setup("native" if mode == "arena" else "torch")
    import time

    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    out = {"mode": mode, "avoid_record_streams": os.environ.get("TORCH_NCCL_AVOID_RECORD_STREAMS"),
           "us_per_op": {}, "arena_calls": {}}
    for size in SIZES:
        t = torch.zeros(size // 4, dtype=torch.float32, device="cuda")
        for _ in range(20):
            dist.all_reduce(t)
        torch.cuda.synchronize()
        before = ga.stats(0) if ga else None
        rounds = []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(iters):
                dist.all_reduce(t)
            torch.cuda.synchronize()
            rounds.append((time.perf_counter() - t0) / iters * 1e6)
        out["us_per_op"][str(size)] = rounds
        if ga:
            after = ga.stats(0)
            out["arena_calls"][str(size)] = {k: after[k] - before[k] for k in after
                                             if isinstance(after[k], int) and k.endswith("_count")}
        del t
    dist.destroy_process_group()
    Path(result).write_text(json.dumps(out))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--cpu", type=int, default=3)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--avoid-record-streams", action="store_true")
    ap.add_argument("--out", default="")
    ap.add_argument("--child", nargs=3, metavar=("MODE", "ITERS", "RESULT"))
    a = ap.parse_args()
    if a.child:
        child(a.child[0], int(a.child[1]), a.child[2])
        return 0
    variants = [None, "1"] if a.avoid_record_streams else [None]
    runs, failed = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for avoid in variants:
            for i in range(a.pairs):
                order = ("arena", "torch") if i % 2 == 0 else ("torch", "arena")
                for mode in order:
                    result = Path(tmp) / f"r{len(runs)}.json"
                    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                               NCCL_NVLS_ENABLE="0")
                    if avoid:
                        env["TORCH_NCCL_AVOID_RECORD_STREAMS"] = avoid
                    else:
                        env.pop("TORCH_NCCL_AVOID_RECORD_STREAMS", None)
                    cmd = ["taskset", "-c", str(a.cpu), sys.executable, __file__, "--child", mode,
                           str(a.iters), str(result)]
                    try:
                        rc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL, timeout=300).returncode
                    except subprocess.TimeoutExpired:
                        rc = "timeout (300 s)"
                    if rc != 0 or not result.exists():
                        failed += 1
                        runs.append({"mode": mode, "avoid_record_streams": avoid, "rc": rc})
                        continue
                    runs.append(json.loads(result.read_text()))
    print("| # | allocator | AVOID_RECORD_STREAMS | 1 MiB us/op (median of 5) | 64 MiB us/op | gpu-arena calls in the 64 MiB loop |")
    print("|---:|---|---|---:|---:|---|")
    for i, r in enumerate(runs):
        if "us_per_op" not in r:
            print(f"| {i} | {r['mode']} | {r['avoid_record_streams']} | failed rc={r['rc']} | | |")
            continue
        m = {s: statistics.median(v) for s, v in r["us_per_op"].items()}
        calls = r["arena_calls"].get(str(SIZES[1]), "")
        print(f"| {i} | {r['mode']} | {r['avoid_record_streams'] or 'unset'} | {m[str(SIZES[0])]:.1f} | "
              f"{m[str(SIZES[1])]:.1f} | {calls} |")
    for avoid in variants:
        for size in SIZES:
            by = {mode: [statistics.median(r["us_per_op"][str(size)]) for r in runs
                         if r.get("mode") == mode and r.get("avoid_record_streams") == avoid and "us_per_op" in r]
                  for mode in ("arena", "torch")}
            if by["arena"] and by["torch"]:
                ratio = statistics.median(by["arena"]) / statistics.median(by["torch"])
                print(f"AVOID_RECORD_STREAMS={avoid or 'unset'} {size >> 20} MiB: gpu-arena / PyTorch median "
                      f"of process medians {ratio:.3f}x (gpu-arena {sorted(round(x, 1) for x in by['arena'])}, "
                      f"PyTorch {sorted(round(x, 1) for x in by['torch'])})")
    if a.out:
        Path(a.out).write_text(json.dumps(runs, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
