#!/usr/bin/env python3
"""PyTorch-level benchmark: PyTorch's caching allocator against gpu-arena (install()), on the
GPU machine:

    GPU_ARENA_LIB=$PWD/.gpu/libgpu_arena.so PYTHONPATH=$PWD/python \\
        python3 bench/gpu/torch_bench.py --out gpu-out/torch_bench.md

Each run is a subprocess with one allocator (install() must precede CUDA init), alternating
torch, gpu-arena, torch, ... ``--repeats`` times each (default 3); the table gives medians
(and min-max) of:

* ``pairs``: ``torch.empty(size, uint8, device="cuda")`` then ``del`` with a window of 16 live
  tensors, sizes cycling over 512 B ... 64 MiB (512, 4 KiB, 64 KiB, 1 MiB, 2 MiB, the KV
  block sizes 2/4 MiB, 16 MiB, 64 MiB and odd sizes), ``--pairs`` times; ns per pair (no
  kernel runs: this is allocator + tensor overhead);
* ``step``: a training step of a 2-layer transformer encoder (d_model 1024, 16 heads, batch
  8 x 512, bf16 autocast, AdamW), ms per step (median of ``--steps`` after 5 warm-up steps,
  each step synchronized);
* memory: the allocator's reserved bytes (gpu-arena: ``gpu_arena.torch.memory_reserved()``,
  torch: ``torch.cuda.memory_reserved()``) against the truth, the drop in free device memory
  (``torch.cuda.mem_get_info()``, i.e. cuMemGetInfo) since the first reading after CUDA init,
  and the peak allocated bytes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "gpu"))
from gpu_common import child_env, out_path  # noqa: E402  (tests/gpu/gpu_common.py)
from result_channel import NO_RESULT, report, run_reporting  # noqa: E402  (tests/python: a child's own channel)

KIB, MIB = 1 << 10, 1 << 20
SIZES = [512, 4 * KIB, 64 * KIB, MIB, 2 * MIB, 4 * MIB, 16 * MIB, 64 * MIB,
         1000, 300_000, 3 * MIB + 7, 12345]


def child(alloc: str, pairs: int, steps: int) -> dict:
    if alloc == "gpu-arena":
        import gpu_arena.torch as gt

        gt.install()
    import torch

    free0, total = torch.cuda.mem_get_info()
    res = {"alloc": alloc}
    # (a) alloc/free pairs with a small live window.
    window: list = []
    for i in range(2000):  # warm-up: fills the caches of both allocators
        window.append(torch.empty(SIZES[i % len(SIZES)], dtype=torch.uint8, device="cuda"))
        if len(window) > 16:
            window.pop(0)
    window.clear()
    t0 = time.perf_counter_ns()
    for i in range(pairs):
        window.append(torch.empty(SIZES[i % len(SIZES)], dtype=torch.uint8, device="cuda"))
        if len(window) > 16:
            del window[0]
    window.clear()
    res["pair_ns"] = (time.perf_counter_ns() - t0) / pairs
    # (b) training steps.
    torch.manual_seed(0)
    d = 1024
    layer = torch.nn.TransformerEncoderLayer(d, 16, 4 * d, dropout=0.0, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, 2).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(8, 512, d, device="cuda")
    times = []
    for s in range(5 + steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if s >= 5:
            times.append((time.perf_counter() - t0) * 1e3)
    res["step_ms"] = statistics.median(times)
    free1, _ = torch.cuda.mem_get_info()
    if alloc == "gpu-arena":
        import gpu_arena.torch as gt

        res["reserved"] = gt.memory_reserved()
        res["peak_allocated"] = gt.max_memory_allocated()
    else:
        res["reserved"] = torch.cuda.memory_reserved()
        res["peak_allocated"] = torch.cuda.max_memory_allocated()
    res["free_drop"] = free0 - free1
    res["total"] = total
    return res


def run(alloc: str, a) -> dict:
    env = child_env()
    cmd = [sys.executable, __file__, "--child", alloc, "--pairs", str(a.pairs), "--steps", str(a.steps)]
    res, p = run_reporting(cmd, env=env, timeout=600)
    if res is not NO_RESULT:
        return res
    raise RuntimeError(f"{alloc} child failed (rc={p.returncode}):\n{p.stderr[-3000:]}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=out_path("torch_bench.md"),
                    help="markdown table (default $OUT/torch_bench.md, OUT defaulting to gpu-out)")
    ap.add_argument("--child")
    ap.add_argument("--pairs", type=int, default=200_000)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    if a.child:
        report(child(a.child, a.pairs, a.steps))
        return 0
    runs: dict = {"torch": [], "gpu-arena": []}
    for r in range(a.repeats):
        for alloc in ("torch", "gpu-arena"):
            res = run(alloc, a)
            print(f"run {r} {alloc}: {res}", file=sys.stderr, flush=True)
            runs[alloc].append(res)

    def med(alloc, key):
        v = [x[key] for x in runs[alloc]]
        return statistics.median(v), min(v), max(v)

    mib = lambda b: f"{b / MIB:.1f} MiB"  # noqa: E731
    lines = ["# PyTorch-level benchmark: caching allocator vs gpu-arena (bench/gpu/torch_bench.py)",
             "", f"{a.repeats} alternating runs per allocator, medians (min-max). pairs: {a.pairs} "
             f"torch.empty/del with 16 live, sizes {SIZES}; step: 2-layer encoder d1024 bf16, {a.steps} steps.",
             "", "| metric | torch caching allocator | gpu-arena | gpu-arena / torch |", "|---|---|---|---|"]
    for key, name, fmt in (("pair_ns", "empty/del pair (ns)", lambda v: f"{v:.0f}"),
                           ("step_ms", "training step (ms)", lambda v: f"{v:.2f}")):
        t, g = med("torch", key), med("gpu-arena", key)
        lines.append(f"| {name} | {fmt(t[0])} ({fmt(t[1])}-{fmt(t[2])}) | {fmt(g[0])} "
                     f"({fmt(g[1])}-{fmt(g[2])}) | {g[0] / t[0]:.2f} |")
    for key, name in (("reserved", "reserved (allocator's stats)"),
                      ("free_drop", "drop in free device memory (mem_get_info)"),
                      ("peak_allocated", "peak allocated")):
        t, g = med("torch", key)[0], med("gpu-arena", key)[0]
        lines.append(f"| {name} | {mib(t)} | {mib(g)} | {g / t:.2f} |" if t else f"| {name} | 0 | {mib(g)} | - |")
    lines += ["", "reserved vs truth per run (reserved - free drop; the drop also holds CUDA's lazily "
              "loaded kernels and library workspaces outside any allocator):", ""]
    for alloc in runs:
        diffs = [mib(x["reserved"] - x["free_drop"]) for x in runs[alloc]]
        lines.append(f"* {alloc}: {', '.join(diffs)}")
    md = "\n".join(lines) + "\n"
    print(md)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
