#!/usr/bin/env python3
"""Trim on a real GPU (issue #12, "a few small tensors must not pin gigabytes"), as a
markdown report.

    GPU_ARENA_LIB=.gpu/libgpu_arena.so PYTHONPATH=python \\
        python3 tests/gpu/gpu_trim.py --out DIR [--big-gib 40]

Under ``gpu_arena.torch.install()``:
  (a) the issue's pattern: 1,500 tensors of 4 MiB with 600 of 4 KiB among them (allocated
      in turn), each filled with its own value; every 4 KiB one and every 100th 4 MiB one
      survive, the rest are freed. A CUDA graph captured before the trim reads one survivor
      and writes another. Then ``empty_cache`` (reserved and the device's free memory,
      ``torch.cuda.mem_get_info``, after it) and ``trim`` (the same after it): reserved must
      be at most 2x the live bytes + 8 MiB, the device's free memory must grow by what
      reserved lost (within 64 MiB), every survivor must keep its address and its values, and
      the graph's replay must write what it wrote before. Freeing the survivors and
      ``empty_cache`` must bring reserved to 0 and free memory back to where it started;
  (b) timing: --big-gib of 2 MiB blocks (the KV-cache shape), one block in 64 kept at random
      places: ``trim``'s time against the bytes it gave back and the windows it made.

The report goes to stdout and DIR/trim.md (plus DIR/trim.json). Exit status 1 when a check
fails.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import gpu_common  # noqa: F401  (beside this file: python/ and tests/python/ on sys.path)

GiB, MiB = 1 << 30, 1 << 20
T0 = time.time()


def log(msg: str) -> None:
    print(f"[gpu_trim +{time.time() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def mib(n: float) -> str:
    return f"{n / MiB:.1f} MiB"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--big-gib", type=float, default=40)
    ap.add_argument("--conf", default=None, help="gpu_arena.configure string")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    import torch
    import gpu_arena
    from gpu_arena import torch as gt

    gt.install(args.conf)
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(0)
    failures: list[str] = []
    report: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    rows: list[tuple[str, str]] = []

    def free_now() -> int:
        torch.cuda.synchronize()
        return torch.cuda.mem_get_info()[0]

    def check(ok: bool, what: str) -> None:
        if not ok:
            failures.append(what)
            log(f"FAIL: {what}")

    def empty_then_trim():
        """empty_cache, then a timed trim: stats and free memory after each, the trim's time."""
        gt.empty_cache()
        st_e, free_e = gpu_arena.stats(0), free_now()
        t = time.perf_counter()
        gt.trim()
        trim_s = time.perf_counter() - t
        return st_e, free_e, trim_s, gpu_arena.stats(0), free_now()

    free0 = free_now()
    log(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, free {mib(free0)}")

    # ---- (a) the pattern ------------------------------------------------------------
    big_n, small_n = 1500, 600
    tensors = []
    for i in range(big_n):
        tensors.append(("big", i, torch.full((MiB,), float(i), device=dev)))  # 4 MiB of f32
        if i % 5 < 2 and len([t for t in tensors if t[0] == "small"]) < small_n:
            tensors.append(("small", i, torch.full((1024,), float(-i), device=dev)))  # 4 KiB
    survivors = [t for t in tensors if t[0] == "small" or t[1] % 100 == 0]
    ptrs = [t[2].data_ptr() for t in survivors]
    # The graph reads the first large survivor and writes the second one.
    src = [t for t in survivors if t[0] == "big"][0][2]
    dst = [t for t in survivors if t[0] == "big"][1][2]
    expect = {id(t[2]): float(t[1]) if t[0] == "big" else float(-t[1]) for t in survivors}
    del tensors
    torch.cuda.synchronize()

    def step() -> None:
        torch.mul(src, 2.0, out=dst)

    graph_note = "captured"
    graph = None
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            step()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
    except Exception as e:  # noqa: BLE001 (reported; the eager step still checks the data)
        graph, graph_note = None, f"capture failed: {type(e).__name__}: {e}"
        log(graph_note)
    report["graph"] = graph_note
    dst.fill_(expect[id(dst)])  # undo the warm-up step: every survivor holds its own value
    torch.cuda.synchronize()
    live = sum(t[2].numel() * 4 for t in survivors)

    st_e, free_e, trim_s, st_t, free_t = empty_then_trim()
    log(f"live {mib(live)}: after empty_cache reserved {mib(st_e['reserved_bytes'])}, after trim "
        f"{mib(st_t['reserved_bytes'])} ({trim_s * 1e3:.1f} ms), free +{mib(free_t - free_e)}")
    check(st_t["reserved_bytes"] <= 2 * live + 8 * MiB,
          f"reserved after trim {mib(st_t['reserved_bytes'])} > 2 x live {mib(live)} + 8 MiB")
    returned = st_e["reserved_bytes"] - st_t["reserved_bytes"]
    check(abs((free_t - free_e) - returned) <= 64 * MiB,
          f"device free memory grew by {mib(free_t - free_e)}, reserved fell by {mib(returned)}")
    check([t[2].data_ptr() for t in survivors] == ptrs, "a survivor moved")
    bad = [t for t in survivors if not bool((t[2] == expect[id(t[2])]).all())]
    check(not bad, f"{len(bad)} survivors changed by the trim")
    if graph is not None:
        graph.replay()
    else:
        step()
    torch.cuda.synchronize()
    check(bool((dst == 2.0 * expect[id(src)]).all()), "the graph's replay after trim wrote something else")
    more = [torch.ones(MiB, device=dev) for _ in range(8)]
    check(all(bool((m == 1).all()) for m in more), "allocations after trim")
    rows += [
        ("survivors", f"{len(survivors)} ({len([t for t in survivors if t[0] == 'big'])} x 4 MiB, "
                      f"{len([t for t in survivors if t[0] == 'small'])} x 4 KiB), live {mib(live)}"),
        ("reserved after empty_cache", mib(st_e["reserved_bytes"])),
        ("reserved after trim", mib(st_t["reserved_bytes"])),
        ("device free memory gained by trim", mib(free_t - free_e)),
        ("trim time", f"{trim_s * 1e3:.1f} ms"),
        ("CUDA graph", graph_note),
    ]
    report["pattern"] = dict(live=live, reserved_empty_cache=st_e["reserved_bytes"],
                             reserved_trim=st_t["reserved_bytes"], free_gain=free_t - free_e, trim_s=trim_s)
    del graph, more, survivors, src, dst, expect
    torch.cuda.synchronize()
    gt.empty_cache()
    st_0 = gpu_arena.stats(0)
    free_end = free_now()
    check(st_0["reserved_bytes"] == 0, f"reserved {mib(st_0['reserved_bytes'])} after freeing everything")
    # What trim kept comes back when the survivors go (the start's figure also moves with
    # the CUDA context's own memory: kernels loaded on first use, the graph).
    check(abs((free_end - free_t) - st_t["reserved_bytes"]) <= 64 * MiB,
          f"freeing the survivors gave back {mib(free_end - free_t)}, trim kept {mib(st_t['reserved_bytes'])}")
    rows.append(("after freeing the survivors", f"reserved {mib(st_0['reserved_bytes'])}, free memory "
                                                f"+{mib(free_end - free_t)} (the context's own: "
                                                f"{mib(free0 - free_end)} since the start)"))

    # ---- (b) timing at scale ----------------------------------------------------------------
    big = int(min(args.big_gib * GiB, free_now() * 0.8)) // (2 * MiB)
    blocks = [torch.empty(MiB // 2, dtype=torch.float32, device=dev) for _ in range(big)]
    rng = random.Random(7)
    keep = sorted(rng.sample(range(big), max(1, big // 64)))
    kept = [blocks[i] for i in keep]
    for j, k in enumerate(kept):
        k.fill_(float(j))
    del blocks
    torch.cuda.synchronize()
    st_e, free_e, trim_s, st_t, free_t = empty_then_trim()
    same = all(bool((k == float(j)).all()) for j, k in enumerate(kept))
    check(same, "a 2 MiB survivor changed in the timed trim")
    returned = st_e["reserved_bytes"] - st_t["reserved_bytes"]
    log(f"timed: {big} blocks of 2 MiB, {len(kept)} kept: trim {trim_s:.3f} s, returned {mib(returned)}, "
        f"arenas {st_e['arenas']} -> {st_t['arenas']}")
    rows += [
        ("timed: blocks / kept", f"{big} x 2 MiB / {len(kept)}"),
        ("timed: reserved after empty_cache", mib(st_e["reserved_bytes"])),
        ("timed: reserved after trim", mib(st_t["reserved_bytes"])),
        ("timed: arenas before / after", f"{st_e['arenas']} / {st_t['arenas']}"),
        ("timed: trim time", f"{trim_s:.3f} s ({trim_s * 1e3 / max(1, st_t['arenas']):.2f} ms per window)"),
        ("timed: device free memory gained", mib(free_t - free_e)),
    ]
    report["timed"] = dict(blocks=big, kept=len(kept), trim_s=trim_s, reserved_empty_cache=st_e["reserved_bytes"],
                           reserved_trim=st_t["reserved_bytes"], arenas_before=st_e["arenas"],
                           arenas_after=st_t["arenas"], free_gain=free_t - free_e)
    del kept
    gt.empty_cache()

    lines = [f"# gpu-arena trim (GPU), {time.strftime('%Y-%m-%d %H:%M:%S')}", "",
             f"{report['device']}, torch {report['torch']}", "", "| what | value |", "|---|---|"]
    lines += [f"| {a} | {b} |" for a, b in rows]
    lines += ["", "Result: " + ("PASS" if not failures else "FAIL: " + "; ".join(failures))]
    text = "\n".join(lines) + "\n"
    print(text)
    with open(os.path.join(args.out, "trim.md"), "w") as f:
        f.write(text)
    report["failures"] = failures
    with open(os.path.join(args.out, "trim.json"), "w") as f:
        json.dump(report, f, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
