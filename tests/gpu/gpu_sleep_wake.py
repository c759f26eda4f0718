#!/usr/bin/env python3
"""Sleep and wake of a vLLM-shaped engine on a real GPU (issue #12), as a markdown report.

    GPU_ARENA_LIB=.gpu/libgpu_arena.so PYTHONPATH=python \\
        python3 tests/gpu/gpu_sleep_wake.py --out DIR [--weights-gib 8 --kv-gib 40 \\
        --cycles 10 --big-gib 100]

Under ``gpu_arena.torch.install()``:
  (a) an engine: ``weights`` tag (bf16 parameters, --weights-gib) and ``kv_cache`` tag
      (--kv-gib), a CUDA graph captured over a small forward that reads a weight and
      writes the KV cache; then --cycles of sleep(offload_tags="weights") / wake(), with
      the device's free memory (``torch.cuda.mem_get_info``) after each step, the weights
      compared bitwise to a CPU copy, and the graph's replay output compared bitwise to the
      reference (the graph is replayed at the same addresses, so they must hold);
  (b) timing: sleep (offload) and wake (copy back) of --big-gib (or as much as fits) of
      weights, twice (the first sleep pins its host buffers, the second reuses the ones the
      first wake kept), against the raw copy cost (``tensor.to("cpu", non_blocking=True)``
      into pinned memory, and back) and the map cost (sleep/wake of the same bytes
      discarded, no copy), all in the same run.

The report goes to stdout and DIR/sleep_wake.md (plus DIR/sleep_wake.json). Exit status 1
when a check fails. Meant to run in well under 3 minutes on an H200.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import gpu_common  # noqa: F401  (beside this file: python/ and tests/python/ on sys.path)

GiB, MiB = 1 << 30, 1 << 20
T0 = time.time()


def log(msg: str) -> None:
    print(f"[gpu_sleep_wake +{time.time() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--weights-gib", type=float, default=8)
    ap.add_argument("--kv-gib", type=float, default=40)
    ap.add_argument("--cycles", type=int, default=10)
    ap.add_argument("--big-gib", type=float, default=100)
    ap.add_argument("--conf", default=None, help="gpu_arena.configure string")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    import torch
    import gpu_arena
    from gpu_arena import torch as gt

    gt.install(args.conf)
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(0)
    free0, total = torch.cuda.mem_get_info()
    log(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, free {gib(free0)} of {gib(total)}")
    failures: list[str] = []
    rows: list[dict] = []
    report: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}

    def free_now() -> int:
        torch.cuda.synchronize()
        return torch.cuda.mem_get_info()[0]

    def check(ok: bool, what: str) -> None:
        if not ok:
            failures.append(what)
            log(f"FAIL: {what}")

    # ---- (a) the engine ------------------------------------------------------------------
    hidden = 4096
    chunk = 1 * GiB  # one weight tensor per GiB
    n_w = max(1, int(args.weights_gib * GiB // chunk))
    n_kv = max(1, int(args.kv_gib * GiB // chunk))
    gen = torch.Generator(device=dev).manual_seed(12)
    with gt.use_tag("weights"):
        weights = [torch.empty(chunk // 2, dtype=torch.bfloat16, device=dev) for _ in range(n_w)]
        for w in weights:
            w.normal_(generator=gen)
        w0 = weights[0][: hidden * hidden].view(hidden, hidden)
    with gt.use_tag("kv_cache"):
        kv = [torch.zeros(chunk // 2, dtype=torch.bfloat16, device=dev) for _ in range(n_kv)]
    torch.cuda.synchronize()
    log(f"engine: {n_w} GiB weights, {n_kv} GiB KV cache")
    cpu_weights = [w.to("cpu") for w in weights]
    w_ptrs = [w.data_ptr() for w in weights]
    kv_ptrs = [t.data_ptr() for t in kv]

    # Static graph buffers (default tag: discarded by sleep, refilled after wake).
    batch = 16
    x_cpu = torch.randn(batch, hidden, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    x = x_cpu.to(dev)
    y = torch.empty(batch, hidden, dtype=torch.bfloat16, device=dev)
    out = torch.empty(batch, dtype=torch.float32, device=dev)
    kv_slot = kv[0][: batch * hidden]

    def forward() -> None:
        torch.matmul(x, w0, out=y)
        kv_slot.copy_(y.view(-1))
        torch.sum(y.float(), dim=1, out=out)

    graph = None
    graph_note = "captured"
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                forward()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            forward()
        graph.replay()
    except Exception as e:  # noqa: BLE001 (reported; the rest still runs eagerly)
        graph = None
        graph_note = f"capture failed, eager forward used: {type(e).__name__}: {e}"
        log(graph_note)
        forward()
    torch.cuda.synchronize()
    ref_out = out.clone().cpu()
    ref_y = y.clone().cpu()
    report["graph"] = graph_note

    def replay() -> None:
        x.copy_(x_cpu.to(dev, non_blocking=False))
        if graph is not None:
            graph.replay()
        else:
            forward()
        torch.cuda.synchronize()

    rows.append(dict(step="start", free=free_now()))
    sleep_s, wake_s = [], []
    for c in range(args.cycles):
        t = time.perf_counter()
        gt.sleep(offload_tags="weights")
        sleep_s.append(time.perf_counter() - t)
        st = gpu_arena.stats(0)
        rows.append(dict(step=f"cycle {c + 1} asleep", free=free_now(),
                         reserved=st["reserved_bytes"], sleeping=st["sleeping_bytes"]))
        t = time.perf_counter()
        gt.wake()
        wake_s.append(time.perf_counter() - t)
        st = gpu_arena.stats(0)
        same_w = all(torch.equal(w.to("cpu"), cw) for w, cw in zip(weights, cpu_weights)) if c in (0, args.cycles - 1) \
            else all(w.data_ptr() == p for w, p in zip(weights, w_ptrs))
        replay()
        same_out = torch.equal(out.cpu(), ref_out) and torch.equal(kv_slot.view(batch, hidden).cpu(), ref_y)
        rows.append(dict(step=f"cycle {c + 1} awake", free=free_now(), reserved=st["reserved_bytes"],
                         sleeping=st["sleeping_bytes"], weights_identical=same_w, replay_identical=same_out))
        check(same_w, f"cycle {c + 1}: weights differ after wake")
        check(same_out, f"cycle {c + 1}: graph replay output differs after wake")
        check([t.data_ptr() for t in kv] == kv_ptrs, f"cycle {c + 1}: KV addresses moved")
        log(f"cycle {c + 1}: sleep {sleep_s[-1]:.3f}s wake {wake_s[-1]:.3f}s free asleep "
            f"{gib(rows[-2]['free'])} awake {gib(rows[-1]['free'])}")
    engine_bytes = (n_w + n_kv) * GiB
    asleep_free = [r["free"] for r in rows if r["step"].endswith("asleep")]
    awake_free = [r["free"] for r in rows if r["step"].endswith("awake")]
    check(min(asleep_free) - rows[0]["free"] >= 0.9 * engine_bytes,
          "sleep did not give back at least 90% of the engine's bytes")
    check(max(awake_free) - min(awake_free) <= 1 * GiB, "free memory after wake drifts over cycles")
    report["engine"] = dict(weights_gib=n_w, kv_gib=n_kv, sleep_s=sleep_s, wake_s=wake_s)

    # Tear the engine down before the big measurement.
    del graph
    del weights, kv, w0, kv_slot, x, y, out, cpu_weights
    getattr(torch._C, "_host_emptyCache", lambda: None)()
    torch.cuda.synchronize()
    gt.empty_cache()
    kept_engine = gpu_arena.stats(0)["offload_host_bytes"]
    check(kept_engine >= n_w * GiB, "the weights' host buffers were not kept after the wakes")
    gpu_arena.sleep_release_host()
    check(gpu_arena.stats(0)["offload_host_bytes"] == 0, "sleep_release_host left host buffers")

    # ---- (b) timing at scale --------------------------------------------------------------
    free_b = free_now()
    big = min(int(args.big_gib * GiB), int(free_b * 0.85)) // GiB * GiB
    host_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB
    # The raw pinned copy is freed (and PyTorch's pinned cache emptied) before the offload pins
    # its own buffers, so the host holds one copy at a time, plus slack for everything else.
    big = min(big, int(host_gib * 0.55) * GiB)
    n_big = big // GiB
    log(f"timing with {n_big} GiB (device free {gib(free_b)}, host {host_gib:.0f} GiB)")
    with gt.use_tag("big_w"):
        bigs = [torch.empty(GiB // 2, dtype=torch.bfloat16, device=dev).fill_(1.5) for _ in range(n_big)]
    torch.cuda.synchronize()
    # Raw copy cost: D2H into pinned memory and back, the same bytes.
    pinned = [torch.empty(GiB // 2, dtype=torch.bfloat16, pin_memory=True) for _ in range(n_big)]
    t = time.perf_counter()
    for b, p in zip(bigs, pinned):
        p.copy_(b, non_blocking=True)
    torch.cuda.synchronize()
    d2h = time.perf_counter() - t
    t = time.perf_counter()
    for b, p in zip(bigs, pinned):
        b.copy_(p, non_blocking=True)
    torch.cuda.synchronize()
    h2d = time.perf_counter() - t
    del pinned
    # PyTorch caches pinned host memory: give it back before the offload needs the host.
    getattr(torch._C, "_host_emptyCache", lambda: None)()
    # Offloaded sleep / wake.
    t = time.perf_counter()
    gt.sleep(offload_tags="big_w")
    s_off = time.perf_counter() - t
    t = time.perf_counter()
    gt.wake()
    w_off = time.perf_counter() - t
    ok = all(bool((b == 1.5).all()) for b in bigs[:4] + bigs[-2:])
    check(ok, "big offloaded tensors differ after wake")
    # Again: the host buffers the wake kept are reused (no pinning).
    t = time.perf_counter()
    gt.sleep(offload_tags="big_w")
    s_off2 = time.perf_counter() - t
    t = time.perf_counter()
    gt.wake()
    w_off2 = time.perf_counter() - t
    ok = all(bool((b == 1.5).all()) for b in bigs[:4] + bigs[-2:])
    check(ok, "big offloaded tensors differ after the second wake")
    gpu_arena.sleep_release_host()
    # Pinned ahead (gpu_arena.sleep_prepare), then the first sleep after it: no pinning in it.
    t = time.perf_counter()
    gpu_arena.sleep_prepare("big_w")
    prep = time.perf_counter() - t
    t = time.perf_counter()
    gt.sleep(offload_tags="big_w")
    s_prep = time.perf_counter() - t
    gt.wake()
    ok = all(bool((b == 1.5).all()) for b in bigs[:4] + bigs[-2:])
    check(ok, "big offloaded tensors differ after the wake of the prepared sleep")
    gpu_arena.sleep_release_host()
    # Map cost: the same bytes discarded (no copy).
    t = time.perf_counter()
    gt.sleep(offload_tags=None)
    s_map = time.perf_counter() - t
    t = time.perf_counter()
    gt.wake()
    w_map = time.perf_counter() - t
    del bigs
    torch.cuda.synchronize()
    gt.empty_cache()
    timing = dict(gib=n_big, d2h_s=d2h, h2d_s=h2d, sleep_offload_s=s_off, wake_offload_s=w_off,
                  sleep_offload_kept_s=s_off2, wake_offload_kept_s=w_off2,
                  sleep_prepare_s=prep, sleep_offload_prepared_s=s_prep,
                  sleep_discard_s=s_map, wake_discard_s=w_map, engine_kept_host_bytes=kept_engine)
    report["timing"] = timing
    report["rows"] = rows
    report["failures"] = failures

    # ---- report -----------------------------------------------------------------------------
    md = [f"# gpu-arena sleep / wake on {report['device']} (torch {report['torch']})", ""]
    md += [f"Engine: {n_w} GiB weights (`weights`, offloaded) + {n_kv} GiB KV (`kv_cache`, discarded); "
           f"CUDA graph: {graph_note}.", ""]
    md += ["| step | device free | reserved | sleeping | weights identical | replay identical |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['step']} | {gib(r['free'])} | {gib(r.get('reserved', 0))} | {gib(r.get('sleeping', 0))} "
                  f"| {r.get('weights_identical', '')} | {r.get('replay_identical', '')} |")
    md += ["", f"Engine sleep: median {sorted(sleep_s)[len(sleep_s) // 2]:.3f}s, wake: median "
           f"{sorted(wake_s)[len(wake_s) // 2]:.3f}s ({args.cycles} cycles).", ""]
    rate = lambda s: f"{n_big / s:.1f} GiB/s" if s > 0 else "-"  # noqa: E731
    md += [f"## Timing, {n_big} GiB", "",
           "| operation | seconds | rate |", "|---|---|---|",
           f"| raw D2H copy into pinned memory (`copy_(non_blocking)`) | {d2h:.3f} | {rate(d2h)} |",
           f"| raw H2D copy from pinned memory | {h2d:.3f} | {rate(h2d)} |",
           f"| sleep, offloaded, first (pin host buffers + copy out + unmap/release) | {s_off:.3f} | {rate(s_off)} |",
           f"| wake, offloaded, first (create/map + copy back) | {w_off:.3f} | {rate(w_off)} |",
           f"| sleep, offloaded, again (kept host buffers: copy out + unmap/release) | {s_off2:.3f} | {rate(s_off2)} |",
           f"| wake, offloaded, again (create/map + copy back) | {w_off2:.3f} | {rate(w_off2)} |",
           f"| `sleep_prepare` (pin ahead, host buffers made before the sleep) | {prep:.3f} | {rate(prep)} |",
           f"| sleep, offloaded, first after `sleep_prepare` (copy out + unmap/release) | {s_prep:.3f} | {rate(s_prep)} |",
           f"| sleep, discarded (unmap/release only: map cost) | {s_map:.3f} | {rate(s_map)} |",
           f"| wake, discarded (create/map/access only: map cost) | {w_map:.3f} | {rate(w_map)} |",
           "", "Offload buffers are pinned host memory, one per arena: the first sleep "
           "allocates them (inside its timed row), the wake keeps them, the second sleep "
           "reuses them; compare the offloaded rows with the raw pinned copies. The engine's "
           f"kept host buffers after its cycles: {gib(kept_engine)} (freed by "
           "`gpu_arena.sleep_release_host()` before this measurement).", ""]
    md += ["## Result", "", "PASS" if not failures else "FAIL: " + "; ".join(failures), ""]
    text = "\n".join(md)
    print(text)
    with open(os.path.join(args.out, "sleep_wake.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "sleep_wake.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    log(f"done in {time.time() - T0:.0f}s")
    return 1 if failures else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        sys.exit(1)
