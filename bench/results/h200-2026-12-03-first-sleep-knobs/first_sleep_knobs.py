#!/usr/bin/env python3
"""Issue #24, "Sleep's host side": the first sleep's pinning, tried several ways in one process.

    GPU_ARENA_LIB=.gpu/libgpu_arena.so PYTHONPATH=python python3 bench/gpu/first_sleep_knobs.py \
        [--gib N] [--rounds 2] [--configs "w2t16:4k,w2t16:2m,..."] --out DIR

For each config (pin workers W, fault threads T, touch mode: a byte per 4 KiB page, a byte
per 2 MiB huge page, or madvise(MADV_POPULATE_WRITE)), with fresh host buffers each time:
`sleep_prepare` alone (pinning only), then released; a first sleep (pin + copy), its wake
(tensors checked), released. The raw pinned D2H copy of the same bytes is timed in the same
process before and after. Configs run in alternating order over the rounds. Prints JSON and
a markdown table; the host's THP settings and /proc/vmstat thp counters with it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import gpu_common  # noqa: F401

GiB = 1 << 30


def read(path):
    try:
        return open(path).read().strip()
    except OSError as e:
        return f"? ({e})"


def thp_counters():
    out = {}
    for line in read("/proc/vmstat").splitlines():
        k, _, v = line.partition(" ")
        if k.startswith("thp_fault") or k.startswith("compact_stall"):
            out[k] = int(v)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=int, default=0, help="0: 55%% of the host, at most 85%% of device free")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--configs", default="w2t16:4k,w2t16:2m,w2t16:populate,w2t8:2m,w3t8:2m,w2t12:2m")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    import torch
    import gpu_arena
    import gpu_arena.torch as gt
    gt.install()
    dev = torch.device("cuda", 0)
    free_b, _ = torch.cuda.mem_get_info()
    host_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB
    n = a.gib or int(min(free_b * 0.85 / GiB, host_gib * 0.55))
    with gt.use_tag("big_w"):
        bigs = [torch.empty(GiB // 2, dtype=torch.bfloat16, device=dev).fill_(1.5) for _ in range(n)]
    torch.cuda.synchronize()

    def raw_copy():
        pinned = [torch.empty(GiB // 2, dtype=torch.bfloat16, pin_memory=True) for _ in range(n)]
        for b, p in zip(bigs, pinned):  # warm
            p.copy_(b, non_blocking=True)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for b, p in zip(bigs, pinned):
            p.copy_(b, non_blocking=True)
        torch.cuda.synchronize()
        d = time.perf_counter() - t
        del pinned
        torch._C._host_emptyCache()
        return d

    res = dict(gib=n, thp_enabled=read("/sys/kernel/mm/transparent_hugepage/enabled"),
               thp_defrag=read("/sys/kernel/mm/transparent_hugepage/defrag"),
               kernel=os.uname().release, cpus=os.cpu_count(), thp_before=thp_counters(),
               raw=[raw_copy()], trials=[])
    configs = a.configs.split(",")
    for r in range(a.rounds):
        order = configs if r % 2 == 0 else configs[::-1]
        for c in order:
            wt, mode = c.split(":")
            w, t = wt[1:].split("t")
            os.environ["GPU_ARENA_PIN_WORKERS"] = w
            os.environ["GPU_ARENA_PIN_FAULT_THREADS"] = t
            os.environ["GPU_ARENA_PIN_TOUCH"] = mode
            th0 = thp_counters()
            t0 = time.perf_counter()
            gpu_arena.sleep_prepare("big_w")
            prep = time.perf_counter() - t0
            gpu_arena.sleep_release_host()
            t0 = time.perf_counter()
            gt.sleep(offload_tags="big_w")
            first = time.perf_counter() - t0
            gt.wake()
            ok = all(bool((b == 1.5).all()) for b in bigs[:3] + bigs[-2:])
            gpu_arena.sleep_release_host()
            th1 = thp_counters()
            tr = dict(config=c, round=r, prepare_s=round(prep, 3), first_sleep_s=round(first, 3), ok=ok,
                      thp_delta={k: th1[k] - th0.get(k, 0) for k in th1 if th1[k] != th0.get(k, 0)})
            res["trials"].append(tr)
            print(json.dumps(tr), file=sys.stderr, flush=True)
    res["raw"].append(raw_copy())
    raw = min(res["raw"])
    md = [f"# First sleep's pinning, {n} GiB; raw pinned copy {res['raw'][0]:.3f} / {res['raw'][1]:.3f} s",
          "", f"THP enabled: `{res['thp_enabled']}`, defrag: `{res['thp_defrag']}`; kernel {res['kernel']}, {res['cpus']} CPUs", "",
          "| config | round | sleep_prepare s (x raw) | first sleep s (x raw) | ok | thp |", "|---|---:|---:|---:|---|---|"]
    for tr in res["trials"]:
        md.append(f"| {tr['config']} | {tr['round']} | {tr['prepare_s']:.3f} ({tr['prepare_s'] / raw:.2f}x) | "
                  f"{tr['first_sleep_s']:.3f} ({tr['first_sleep_s'] / raw:.2f}x) | {tr['ok']} | {tr['thp_delta']} |")
    open(os.path.join(a.out, "first_sleep_knobs.json"), "w").write(json.dumps(res, indent=1))
    open(os.path.join(a.out, "first_sleep_knobs.md"), "w").write("\n".join(md) + "\n")
    print("\n".join(md))
    return 0 if all(t["ok"] for t in res["trials"]) else 1


if __name__ == "__main__":
    sys.exit(main())
