#!/usr/bin/env python3
"""Per-call cost of the Python ``gpu_arena.share`` / ``open`` / ``close`` on the sim backend
(one process: it shares and opens its own blocks), the way bench/gpu/share_latency.py
measures them on a GPU: ``--n`` anchors opened and held first, then ``--n`` fresh shares
opened one by one (held), then closed. Needs torch (CPU is enough); ``--profile`` prints a
cProfile of the open() loop.

    GPU_ARENA_LIB=target/release/libgpu_arena.so PYTHONPATH=python \\
        python3 scripts/py_share_bench.py [--n 2048] [--profile]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time

BLOCK = 1 << 16


def med_us(ns) -> float:
    return statistics.median(ns) / 1e3


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    import gpu_arena

    gpu_arena.configure("backend=sim,arena_size=64MiB,sim_capacity=4GiB")
    gpu_arena.init()
    n = args.n
    ptrs = [gpu_arena.malloc(BLOCK) for _ in range(n)]

    def share_of(p):
        h = gpu_arena.share_ptr(p, BLOCK)
        return gpu_arena.Share(h, "uint8", (BLOCK,), (1,), 0, h.device, BLOCK, "cpu")

    # share(tensor): CPU tensors over the sim backend's (host) memory, shared once first so
    # that every arena is exported, as on the GPU.
    import torch

    blocks = [torch.frombuffer((ctypes.c_uint8 * BLOCK).from_address(p), dtype=torch.uint8)
              for p in ptrs]
    first = [gpu_arena.share(b) for b in blocks]
    shr = []
    for b in blocks:
        t = time.perf_counter_ns()
        s = gpu_arena.share(b)
        shr.append(time.perf_counter_ns() - t)
        s.close()
    for s in first:
        s.close()
    anchors = [share_of(p) for p in ptrs]
    held = [gpu_arena.open(s) for s in anchors]  # arenas mapped, registry as big as on GPU
    shares = [share_of(p) for p in ptrs]
    # The library's part of open(): a bare import (ctypes, no Python wrapping), then close.
    lib = gpu_arena._lib.lib()
    structs = [gpu_arena._lib.GpuArenaShare.from_buffer_copy(s.handle) for s in shares]
    out = ctypes.c_void_p()
    imp = []
    for st in structs:
        t = time.perf_counter_ns()
        lib.gpu_arena_import(ctypes.byref(st), ctypes.byref(out))
        imp.append(time.perf_counter_ns() - t)
        lib.gpu_arena_close(out)
    opn, cls, ts = [], [], []
    prof = None
    if args.profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    for s in shares:
        t = time.perf_counter_ns()
        x = gpu_arena.open(s)
        opn.append(time.perf_counter_ns() - t)
        ts.append(x)
    if prof is not None:
        prof.disable()
    for x in ts:
        t = time.perf_counter_ns()
        gpu_arena.close(x)
        cls.append(time.perf_counter_ns() - t)
    ts.clear()
    if prof is not None:
        import pstats

        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    print(f"share(tensor) {med_us(shr):8.2f} us median")
    print(f"C import      {med_us(imp):8.2f} us median (the library's part of open)")
    print(f"open(share)   {med_us(opn):8.2f} us median (n={n})")
    print(f"close(tensor) {med_us(cls):8.2f} us median")
    for x in held:
        gpu_arena.close(x)
    held.clear()
    for s in shares + anchors:
        s.close()
    for p in ptrs:
        gpu_arena.free(p, BLOCK)
    return 0


if __name__ == "__main__":
    sys.exit(main())
