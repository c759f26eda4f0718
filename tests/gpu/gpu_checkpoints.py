#!/usr/bin/env python3
"""Graph pool checkpoints through torch.compile's CUDA graph trees, on the GPU.

    GPU_ARENA_LIB=.gpu/libgpu_arena.so python3 tests/gpu/gpu_checkpoints.py [--iters 12]

cudagraph trees restore the allocator's state of a graph pool (``setCheckpointPoolState``)
when, after replaying a node, they record or warm up a child that was not the path taken
before. Here a compiled ``f`` is followed by one of two compiled children (``g`` or ``h``,
taking turns) in every step, so the tree branches under ``f`` and the checkpoint path runs.
Each allocator runs in a fresh process (gpu-arena's native allocator, then torch's own as the
control); a child writes its result as JSON to a file of its own (its stdout and stderr are
only a log). Checked: gpu-arena's run restores checkpoints (counted by wrapping
``torch._C._cuda_setCheckpointPoolState``, which cudagraph trees call) as often as torch's
own allocator does, at least once; every step's output equals eager within 1e-3; once the
outputs and the compiled functions are gone and the trees reset, ``memory_allocated`` is back
at its value before the steps (with both allocators). Writes ``$OUT/checkpoints.md`` (and the children's JSON beside it).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import traceback

import gpu_common
from torch_native_common import ieee_fp32, info, maxdiff, setup, write_result


def child(route: str, iters: int, path: str) -> None:
    torch, ga = setup(route)
    prec = ieee_fp32(torch)
    calls = {"restores": 0}
    real = torch._C._cuda_setCheckpointPoolState

    def counting(*args, **kwargs):
        calls["restores"] += 1
        return real(*args, **kwargs)

    torch._C._cuda_setCheckpointPoolState = counting
    gen = torch.Generator(device="cuda").manual_seed(0)
    w1 = torch.randn(512, 512, device="cuda", generator=gen) / 16
    w2 = torch.randn(512, 1024, device="cuda", generator=gen) / 16

    def f(x):
        return torch.relu(x @ w1) + 1.0

    def g(y):
        return torch.sin(y @ w2)

    def h(y):
        return (y * 2.0) @ w1 - y

    compiled = [torch.compile(fn, mode="reduce-overhead") for fn in (f, g, h)]
    mark = torch.compiler.cudagraph_mark_step_begin
    with torch.no_grad():  # cuBLAS's workspace is allocated at the first matmul, and kept
        g(f(torch.zeros(256, 512, device="cuda")))
        h(f(torch.zeros(256, 512, device="cuda")))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    diffs = []
    with torch.no_grad():
        for i in range(iters):
            mark()
            x = torch.randn(256, 512, device="cuda", generator=gen)
            y = compiled[0](x)
            k = 1 + i % 2
            z = compiled[k](y)
            want = (g, h)[k - 1](f(x))
            diffs.append(maxdiff(z, want))
            del x, y, z, want
    torch.cuda.synchronize()
    del compiled
    torch._dynamo.reset()
    # The trees keep their graphs and their pools' blocks until they are reset.
    from torch._inductor import cudagraph_trees

    cudagraph_trees.reset_cudagraph_trees()
    gc.collect()
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated()
    out = {"info": info(torch, ga, route), "precision": prec, "restores": calls["restores"],
           "max_abs_diff": max(diffs), "match": all(d <= 1e-3 for d in diffs),
           "allocated_before": before, "allocated_after": after}
    write_result(path, out)


def run_child(route: str, iters: int, out_dir: str) -> dict:
    path = os.path.join(out_dir, f"checkpoints-{route}.json")
    if os.path.exists(path):
        os.remove(path)
    log = os.path.join(out_dir, f"checkpoints-{route}.log")
    with open(log, "w") as lf:
        rc = subprocess.call([sys.executable, __file__, "--child", route, "--iters", str(iters),
                              "--result", path], env=gpu_common.child_env(), stdout=lf,
                             stderr=subprocess.STDOUT, timeout=600)
    if rc != 0 or not os.path.exists(path):
        return {"error": f"child {route} exited {rc} (log: {log})"}
    with open(path) as f:
        return json.load(f)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--child")
    ap.add_argument("--result")
    args = ap.parse_args()
    if args.child:
        try:
            child(args.child, args.iters, args.result)
        except Exception:  # noqa: BLE001 - the parent reports a child without a result
            traceback.print_exc()
            return 1
        return 0
    out_dir = gpu_common.out_path()
    os.makedirs(out_dir, exist_ok=True)
    res = {route: run_child(route, args.iters, out_dir) for route in ("native", "torch")}
    nat, ref = res["native"], res["torch"]
    checks = []
    for route, r in res.items():
        if "error" in r:
            checks.append((False, f"{route}: {r['error']}"))
    if not any("error" in r for r in res.values()):
        checks += [
            (nat["info"].get("served_by_gpu_arena", False), "gpu-arena's native allocator served the run"),
            (nat["restores"] >= 1 and nat["restores"] == ref["restores"],
             f"checkpoints restored: gpu-arena {nat['restores']}, torch's allocator {ref['restores']}"),
            (nat["match"], f"{args.iters} steps equal eager within 1e-3 (max |diff| {nat['max_abs_diff']:.2e}; "
                           f"torch's allocator {ref['max_abs_diff']:.2e})"),
            (nat["allocated_after"] == nat["allocated_before"]
             and ref["allocated_after"] == ref["allocated_before"],
             f"memory_allocated back: {nat['allocated_before']} -> {nat['allocated_after']} "
             f"(torch's allocator {ref['allocated_before']} -> {ref['allocated_after']})"),
        ]
    ok = all(c for c, _ in checks)
    lines = ["# Graph pool checkpoints through cudagraph trees (gpu_checkpoints.py)", ""]
    lines += [f"- {'PASS' if c else 'FAIL'}: {what}" for c, what in checks]
    lines += ["", f"torch {nat.get('info', {}).get('torch', '?')}, {nat.get('info', {}).get('gpu', '?')}",
              "", "**ALL PASSED**" if ok else "**FAILED**"]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, "checkpoints.md"), "w") as f:
        f.write(text)
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
