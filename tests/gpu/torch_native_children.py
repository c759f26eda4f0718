#!/usr/bin/env python3
"""The child side of gpu_torch_native.py: each workload runs in a fresh interpreter,
``python3 tests/gpu/torch_native_children.py NAME RESULT_PATH PARAMS_JSON``. A child installs
gpu-arena (``route="native"``, or ``"pluggable"`` / torch's own allocator for the controls)
before torch touches CUDA, and hands its result back as JSON in RESULT_PATH (a temporary file
renamed into place): its stdout and stderr are only a log. What each workload proves:
gpu_torch_native.py's docstring. This module imports nothing heavy at the top: spawned
receivers (torch.multiprocessing) import it as their __main__ before they install gpu-arena."""

from __future__ import annotations

import copy
import gc
import json
import mmap
import os
import random
import signal
import struct
import sys
import time
import traceback

from torch_native_behaviour import child_behaviour
from torch_native_perf import build_cxx, child_perf

from torch_native_common import MiB, TOL, ieee_fp32, info, maxdiff, setup, write_result


# --------------------------------------------------------------------------------------
# graphs: issue 23's two-graph case
# --------------------------------------------------------------------------------------


def child_graphs(p):
    torch, ga = setup(p["route"])
    ieee_fp32(torch)
    nn = torch.nn
    torch.manual_seed(p.get("seed", 0))
    mlp1 = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)).cuda()
    mlp2 = nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 512)).cuda()
    x = torch.randn(256, 1024, device="cuda")
    with torch.no_grad():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                mlp2(mlp1(x))
        torch.cuda.current_stream().wait_stream(s)
        g1 = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g1):
            y1 = mlp1(x)
        g2 = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g2, pool=g1.pool()):
            y2 = mlp2(y1)
        torch.cuda.synchronize()
        ts = []
        for i in range(32):
            t = torch.empty(256, 4096, device="cuda")
            t.fill_(1000.0 + i)
            ts.append(t)
        torch.cuda.synchronize()
        for _ in range(10):
            g1.replay()
            g2.replay()
        torch.cuda.synchronize()
        bad = {i: int((t != 1000.0 + i).sum()) for i, t in enumerate(ts)}
        overwritten = {i: n for i, n in bad.items() if n}
        e1 = mlp1(x)
        e2 = mlp2(e1)
        torch.cuda.synchronize()
        out = {"overwritten": len(overwritten), "overwritten_elems": overwritten,
               "y1_max_abs_diff": maxdiff(y1, e1), "y2_max_abs_diff": maxdiff(y2, e2),
               "bitwise_equal": bool(torch.equal(y1, e1) and torch.equal(y2, e2)),
               "outputs_match": bool(torch.allclose(y1, e1, rtol=1e-4, atol=1e-4)
                                     and torch.allclose(y2, e2, rtol=1e-4, atol=1e-4)),
               "pool": str(g1.pool())}
    out["info"] = info(torch, ga, p["route"])
    return out


# --------------------------------------------------------------------------------------
# compile: torch.compile(mode="reduce-overhead"), and a vLLM-shaped piecewise capture
# --------------------------------------------------------------------------------------


def count_captures(torch):
    """Counts every CUDA graph capture (cudagraph trees and torch.cuda.graph both go through
    torch.cuda.CUDAGraph.capture_begin)."""
    n = [0]
    orig = torch.cuda.CUDAGraph.capture_begin

    def capture_begin(self, *a, **k):
        n[0] += 1
        return orig(self, *a, **k)

    torch.cuda.CUDAGraph.capture_begin = capture_begin
    return n


def child_compile(p):
    torch, ga = setup("native")
    prec = ieee_fp32(torch)
    nn, F = torch.nn, torch.nn.functional
    caps = count_captures(torch)
    mlp = p["model"] == "mlp"

    def make():
        torch.manual_seed(0)
        if mlp:
            return nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)).cuda()
        return nn.TransformerEncoderLayer(512, 8, dim_feedforward=2048, dropout=0.0,
                                          batch_first=True).cuda()

    shape = (256, 1024) if mlp else (8, 128, 512)
    gen = torch.Generator(device="cuda").manual_seed(1)
    steps = p.get("steps", 8)
    xs = [torch.randn(shape, device="cuda", generator=gen) for _ in range(steps)]
    ys = [torch.randn(shape, device="cuda", generator=gen) for _ in range(steps)]
    base = make()
    mark = getattr(torch.compiler, "cudagraph_mark_step_begin", lambda: None)
    out = {"model": p["model"], "precision": prec}

    # inference
    t0, c0 = time.perf_counter(), caps[0]
    model, ref = copy.deepcopy(base).eval(), copy.deepcopy(base).eval()
    cm = torch.compile(model, mode="reduce-overhead")
    diffs, close = [], []
    with torch.no_grad():
        for x in xs:
            mark()
            y = cm(x).clone()
            e = ref(x)
            diffs.append(maxdiff(y, e))
            close.append(bool(torch.allclose(y, e, rtol=1e-3, atol=1e-3)))
    out["inference"] = {"captures": caps[0] - c0, "max_abs_diff": max(diffs),
                        "match": all(close), "calls": len(xs),
                        "seconds": time.perf_counter() - t0}

    # training: forward + backward + SGD step, compiled against eager from the same weights
    t0, c0 = time.perf_counter(), caps[0]
    model, ref = copy.deepcopy(base).train(), copy.deepcopy(base).train()
    cm = torch.compile(model, mode="reduce-overhead")
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=1e-2, momentum=0.9)
    losses = []
    for x, y in zip(xs, ys):
        mark()
        loss = F.mse_loss(cm(x), y)
        loss.backward()
        lc = float(loss.item())
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_r = F.mse_loss(ref(x), y)
        loss_r.backward()
        opt_ref.step()
        opt_ref.zero_grad(set_to_none=True)
        losses.append([lc, float(loss_r.item())])
    torch.cuda.synchronize()
    pd = max(maxdiff(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    pclose = all(bool(torch.allclose(a, b, rtol=1e-3, atol=1e-3))
                 for a, b in zip(model.parameters(), ref.parameters()))
    lclose = all(abs(a - b) <= 1e-3 * max(1.0, abs(b)) for a, b in losses)
    out["training"] = {"captures": caps[0] - c0, "losses": losses, "losses_match": lclose,
                       "param_max_abs_diff": pd, "params_match": pclose, "steps": len(xs),
                       "loss_went_down": losses[-1][0] < losses[0][0],
                       "seconds": time.perf_counter() - t0}
    try:
        from torch._dynamo.utils import counters

        out["inductor_counters"] = {k: int(v) for k, v in counters["inductor"].items()}
    except Exception as e:  # noqa: BLE001 - informational
        out["inductor_counters"] = {"error": str(e)}
    out["info"] = info(torch, ga, "native")
    return out


def child_piecewise(p):
    torch, ga = setup("native")
    ieee_fp32(torch)
    nn = torch.nn
    caps = count_captures(torch)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512)).cuda().eval()
    sizes = [8, 4, 2, 1]  # captured largest first, as vLLM does
    handle = torch.cuda.graph_pool_handle()
    static_in = {bs: torch.zeros(bs, 512, device="cuda") for bs in sizes}
    static_out, graphs = {}, {}
    with torch.no_grad():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for bs in sizes:
                for _ in range(2):
                    model(static_in[bs])
        torch.cuda.current_stream().wait_stream(s)
        for bs in sizes:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=handle):
                static_out[bs] = model(static_in[bs])
            graphs[bs] = g
        torch.cuda.synchronize()
        news, k = [], 0  # new tensors of the sizes the graphs' intermediates had
        for bs in sizes:
            for cols in (2048, 512):
                for _ in range(8):
                    t = torch.empty(bs, cols, device="cuda")
                    t.fill_(5000.0 + k)
                    news.append((k, t))
                    k += 1
        gen = torch.Generator(device="cuda").manual_seed(3)
        res = {}
        for bs in sorted(sizes):
            for _ in range(3):
                inp = torch.randn(bs, 512, device="cuda", generator=gen)
                static_in[bs].copy_(inp)
                graphs[bs].replay()
                got = static_out[bs].clone()
                ref = model(inp)
                d = maxdiff(got, ref)
                ok = bool(torch.allclose(got, ref, rtol=1e-4, atol=1e-4))
                prev = res.get(bs, {"max_abs_diff": 0.0, "match": True})
                res[bs] = {"max_abs_diff": max(prev["max_abs_diff"], d), "match": prev["match"] and ok}
        torch.cuda.synchronize()
        bad = [k for k, t in news if bool((t != 5000.0 + k).any())]
    return {"captures": caps[0], "graphs": len(graphs), "pool": str(handle),
            "per_batch": {str(k): v for k, v in res.items()}, "new_tensors": len(news),
            "new_tensors_overwritten": bad, "info": info(torch, ga, "native")}


# --------------------------------------------------------------------------------------
# stats: torch.cuda.memory_stats and friends against gpu-arena and cudaMemGetInfo
# --------------------------------------------------------------------------------------


def child_stats(p):
    torch, ga = setup("native")
    free_install, total = torch.cuda.mem_get_info()  # initializes CUDA
    w = torch.ones(1 << 20, device="cuda")  # load the fill/sum kernels before the baseline
    float(w.sum())
    del w
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # the baseline with nothing cached
    out = {"free_after_install": int(free_install), "total": int(total)}
    ms0, st0, free0 = torch.cuda.memory_stats(), ga.stats(0), torch.cuda.mem_get_info()[0]
    sizes = [64 * MiB] * 8 + [4 * MiB] * 64 + [MiB] * 255 + [MiB - 4096] * 1  # ~1 GiB
    pieces = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes]
    torch.cuda.synchronize()
    ms1, st1, free1 = torch.cuda.memory_stats(), ga.stats(0), torch.cuda.mem_get_info()[0]
    keys = ("allocated_bytes.all.current", "reserved_bytes.all.current",
            "allocated_bytes.all.peak", "reserved_bytes.all.peak", "allocation.all.current",
            "segment.all.current", "num_ooms", "requested_bytes.all.current")
    out["torch_stats"] = {k: ms1.get(k) for k in keys}
    out["reserved_before"] = int(st0["reserved_bytes"])
    out["gpu_arena_stats"] = {k: st1[k] for k in ("allocated_bytes", "reserved_bytes",
                                                   "allocations", "arenas", "requested_bytes")}
    out["requested_total"] = sum(sizes)
    out["allocated_equal"] = ms1.get("allocated_bytes.all.current") == st1["allocated_bytes"]
    out["reserved_equal"] = ms1.get("reserved_bytes.all.current") == st1["reserved_bytes"]
    out["memory_allocated_equal"] = torch.cuda.memory_allocated() == st1["allocated_bytes"]
    out["memory_reserved_equal"] = torch.cuda.memory_reserved() == st1["reserved_bytes"]
    out["reserved_growth"] = int(ms1["reserved_bytes.all.current"] - ms0["reserved_bytes.all.current"])
    out["free_drop"] = int(free0 - free1)
    out["growth_vs_drop"] = out["reserved_growth"] - out["free_drop"]
    out["n_keys"] = len(ms1)

    big = torch.empty(512 * MiB, dtype=torch.uint8, device="cuda")
    del big
    cur, peak = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
    out["peak_before_reset"], out["current_before_reset"] = int(peak), int(cur)
    out["peak_covers_big"] = peak >= cur + 512 * MiB
    torch.cuda.reset_peak_memory_stats()
    out["peak_after_reset"] = int(torch.cuda.max_memory_allocated())
    out["current_after_reset"] = int(torch.cuda.memory_allocated())
    out["peak_reset_ok"] = out["peak_after_reset"] == out["current_after_reset"]
    out["max_reserved_after_reset"] = int(torch.cuda.max_memory_reserved())
    out["reserved_after_reset"] = int(torch.cuda.memory_reserved())
    for name, fn in (("reset_accumulated_memory_stats", torch.cuda.reset_accumulated_memory_stats),
                     ("memory_summary", torch.cuda.memory_summary)):
        try:
            r = fn()
            out[name] = "ok" + (f" ({len(r)} chars)" if isinstance(r, str) else "")
        except Exception as e:  # noqa: BLE001 - reported
            out[name] = f"{type(e).__name__}: {e}"

    snap = torch.cuda.memory._snapshot()
    segs = snap.get("segments", [])
    blocks = [b for s in segs for b in s.get("blocks", [])]
    active = [b for b in blocks if b.get("state") == "active_allocated"]
    out["snapshot"] = {"segments": len(segs), "blocks": len(blocks), "active_blocks": len(active),
                       "active_bytes": sum(b["size"] for b in active),
                       "segment_bytes": sum(s["total_size"] for s in segs),
                       "keys": sorted(snap)}
    try:
        from torch.cuda import _memory_viz as viz

        fn = getattr(viz, "segment_plot", None) or viz.trace_plot
        html = fn(snap)
        with open(p["html"], "w") as f:
            f.write(html)
        out["viz"] = f"ok: {fn.__name__} -> {os.path.basename(p['html'])} ({len(html)} chars)"
        try:
            out["segsum_tail"] = viz.segsum(snap)[-600:]
        except Exception as e:  # noqa: BLE001 - reported
            out["segsum_tail"] = f"segsum failed: {type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001 - reported
        out["viz"] = f"failed: {type(e).__name__}: {e}"
    try:  # torch's history API: gpu-arena switches its own history with it
        torch.cuda.memory._record_memory_history(max_entries=1000)
        tmp = torch.empty(MiB, device="cuda")
        del tmp
        s2 = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        out["history"] = f"ok: {sum(len(t) for t in s2.get('device_traces', []))} trace entries"
    except Exception as e:  # noqa: BLE001 - reported
        out["history"] = f"{type(e).__name__}: {e}"
    del pieces
    out["info"] = info(torch, ga, "native")
    return out


# --------------------------------------------------------------------------------------
# mp: CUDA tensors through torch.multiprocessing
# --------------------------------------------------------------------------------------


def _receiver(q_in, q_out):
    """A spawned consumer: installs gpu-arena native first, then serves q_in's messages."""
    try:
        import gpu_arena
        import gpu_arena.torch as gt

        gt.install(route="native")
        import torch

        held = []
        while True:
            msg = q_in.get()
            if msg is None:
                break
            kind, i, t = msg[0], msg[1], msg[2]
            if kind == "rw":
                got = float(t.double().sum())
                t.mul_(2.0)
                torch.cuda.synchronize()
                q_out.put(("rw", i, got, t.data_ptr()))
            elif kind == "sum":
                q_out.put(("sum", i, float(t.double().sum())))
            elif kind == "hold":
                held.append(t)
                q_out.put(("held", i, float(t[:1].item())))
            del msg, t
        torch.cuda.synchronize()
        q_out.put(("bye", 0, gpu_arena.stats(0)))
    except BaseException:  # noqa: BLE001 - reported to the producer
        q_out.put(("error", 0, traceback.format_exc()))


def _reply(q, proc, want, timeout):
    deadline = time.time() + timeout
    while True:
        try:
            msg = q.get(timeout=1.0)
        except Exception:  # noqa: BLE001 - queue.Empty
            if not proc.is_alive():
                raise RuntimeError(f"receiver exited (code {proc.exitcode}) before '{want}'")
            if time.time() > deadline:
                raise TimeoutError(f"no '{want}' from the receiver in {timeout}s")
            continue
        if msg[0] == "error":
            raise RuntimeError("receiver failed:\n" + msg[2])
        if msg[0] != want:
            raise RuntimeError(f"receiver answered {msg[0]!r}, expected {want!r}")
        return msg


def _pattern_sum(n, v):
    q, r = divmod(n, 1024)
    return float(q * (1023 * 1024 // 2) + r * (r - 1) // 2 + v * n)


def _release_counters(captured):
    """Do what the SIGKILLed receiver's deleters never did: decrement torch's CUDA IPC ref
    counters of the storages it held (an int64 at 64 + 8 * offset of the producer's
    /dev/shm/torch_* file, RefcountedMapAllocator's header being 64 bytes)."""
    done, problems = 0, []
    for handle, off in captured:
        name = handle.decode() if isinstance(handle, bytes) else str(handle)
        try:
            with open("/dev/shm/" + name.lstrip("/"), "r+b") as f:
                mm = mmap.mmap(f.fileno(), 0)
                pos = 64 + 8 * int(off)
                val = struct.unpack_from("<q", mm, pos)[0] if pos + 8 <= len(mm) else None
                if val == 1:
                    struct.pack_into("<q", mm, pos, 0)
                    done += 1
                else:
                    problems.append(f"{name}@{off}: counter {val}, expected 1")
                mm.close()
        except OSError as e:
            problems.append(f"{name}: {e}")
    return done, problems


def child_mp(p):
    torch, ga = setup("native")
    import torch.multiprocessing as tmp

    free_install, total = torch.cuda.mem_get_info()  # initializes CUDA: the baseline
    out = {"free_after_install": int(free_install), "total": int(total)}
    # Load this process's kernels before the warm baseline (CUDA loads them lazily).
    w = (torch.arange(4096, device="cuda", dtype=torch.int32) % 1024).float().add_(1.0)
    float(w.double().sum())
    w.mul_(2.0)
    bool((w == w).all())
    w = torch.full((4096,), 1.0, device="cuda") + 0.5
    del w
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free_warm = torch.cuda.mem_get_info()[0]
    out["free_warm"] = int(free_warm)
    ctx = tmp.get_context("spawn")

    def settle(limit_s):
        t0 = time.time()
        while True:
            gc.collect()
            torch.cuda.ipc_collect()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            free = torch.cuda.mem_get_info()[0]
            if abs(free_warm - free) <= TOL or time.time() - t0 > limit_s:
                return {"free": int(free), "gap_vs_warm": int(free_warm - free),
                        "gap_vs_install": int(free_install - free),
                        "seconds": round(time.time() - t0, 2), "stats": ga.stats(0)}
            time.sleep(0.25)

    q_in, q_out = ctx.Queue(), ctx.Queue()
    r = ctx.Process(target=_receiver, args=(q_in, q_out), daemon=True)
    r.start()
    # 1. read and write one tensor
    n = 1 << 20
    t = torch.arange(n, device="cuda", dtype=torch.float32) + 0.5
    expect = float(t.double().sum())
    torch.cuda.synchronize()
    q_in.put(("rw", 0, t))
    _, _, got, _ = _reply(q_out, r, "rw", 180)
    torch.cuda.synchronize()
    want = (torch.arange(n, device="cuda", dtype=torch.float32) + 0.5) * 2.0
    out["rw"] = {"checksum_sent": expect, "checksum_read": got, "read_ok": got == expect,
                 "write_seen": bool(torch.equal(t, want))}
    del t, want
    # 2. N tensors of mixed sizes (4 KiB .. 8 MiB); every 10th sent as a view
    rng = random.Random(1234)
    N = int(p.get("n", 1000))
    sizes = [max(4096, int(2 ** rng.uniform(12, 23)) // 4 * 4) for _ in range(N)]
    keep, expects = [], []
    t0 = time.perf_counter()
    for i, nb in enumerate(sizes):
        ne, v = nb // 4, float(i % 251 + 1)
        t = (torch.arange(ne, device="cuda", dtype=torch.int32) % 1024).float().add_(v)
        full = _pattern_sum(ne, v)
        if i % 10 == 9:
            q_in.put(("sum", i, t[7:]))
            expects.append(full - (21 + 7 * v))
        else:
            q_in.put(("sum", i, t))
            expects.append(full)
        keep.append(t)
    del t
    got = {}
    for _ in range(N):
        _, i, s = _reply(q_out, r, "sum", 180)
        got[i] = s
    wall = time.perf_counter() - t0
    bad = [i for i in range(N) if got.get(i) != expects[i]]
    out["many"] = {"n": N, "bytes": sum(sizes), "min": min(sizes), "max": max(sizes),
                   "acked": len(got), "wrong": len(bad), "wrong_first": bad[:10],
                   "seconds": round(wall, 2), "stats_while_shared": ga.stats(0)}
    del keep
    q_in.put(None)
    _, _, rstats = _reply(q_out, r, "bye", 60)
    r.join(30)
    out["receiver_stats"] = rstats
    out["after_normal"] = settle(10)
    # 3. a receiver holding tensors is SIGKILLed
    captured = []
    orig_share = torch.UntypedStorage._share_cuda_

    def recording(self, *a, **k):
        res = orig_share(self, *a, **k)
        captured.append((res[4], res[5]))
        return res

    torch.UntypedStorage._share_cuda_ = recording
    q2_in, q2_out = ctx.Queue(), ctx.Queue()
    r2 = ctx.Process(target=_receiver, args=(q2_in, q2_out), daemon=True)
    r2.start()
    held = [torch.full((8 * MiB,), float(i + 1), device="cuda") for i in range(16)]  # 16 x 32 MiB
    torch.cuda.synchronize()
    for i, t in enumerate(held):
        q2_in.put(("hold", i, t))
    vals = [_reply(q2_out, r2, "held", 180)[2] for _ in held]
    out["kill"] = {"held_tensors": len(held), "held_bytes": 16 * 32 * MiB,
                   "values_ok": sorted(vals) == [float(i + 1) for i in range(16)],
                   "stats_before_kill": ga.stats(0)}
    os.kill(r2.pid, signal.SIGKILL)
    r2.join(30)
    out["kill"]["exitcode"] = r2.exitcode
    torch.UntypedStorage._share_cuda_ = orig_share
    del held, t
    out["kill"]["after_drop"] = settle(5)  # torch's IPC limbo still holds the storages
    done, problems = _release_counters(captured)
    out["kill"]["counters_released"], out["kill"]["counter_problems"] = done, problems[:5]
    out["kill"]["after_release"] = settle(20)
    out["info"] = info(torch, ga, "native")
    for q in (q_in, q_out, q2_in, q2_out):
        q.cancel_join_thread()
    return out


def child_prep(p):
    """Build (and cache) the native allocator and the C++ pairs library; say what torch has."""
    t0 = time.perf_counter()
    torch, ga = setup("native")
    out = {"native_install_s": round(time.perf_counter() - t0, 1)}
    from gpu_arena import torch_native as tn

    path, why = tn.build(torch)
    out["native_so"], out["native_build_error"] = str(path), why
    out["cxx"] = tn.compiler()
    t0 = time.perf_counter()
    try:
        out["cxx_lib"] = build_cxx(torch, p["cxx_out"])
    except Exception as e:  # noqa: BLE001 - reported; perf runs without the C++ part
        out["cxx_lib"], out["cxx_error"] = None, f"{type(e).__name__}: {e}"
    out["cxx_build_s"] = round(time.perf_counter() - t0, 1)
    out["apis"] = {name: hasattr(obj, attr) for name, obj, attr in (
        ("torch.cuda.get_per_process_memory_fraction", torch.cuda, "get_per_process_memory_fraction"),
        ("torch.cuda.graph_pool_handle", torch.cuda, "graph_pool_handle"),
        ("torch.cuda.make_graphed_callables", torch.cuda, "make_graphed_callables"),
        ("torch.compiler.cudagraph_mark_step_begin", torch.compiler, "cudagraph_mark_step_begin"),
        ("torch.cuda._sleep", torch.cuda, "_sleep"),
        ("torch.OutOfMemoryError", torch, "OutOfMemoryError"))}
    out["info"] = info(torch, ga, "native")
    return out


CHILDREN = {"prep": child_prep, "graphs": child_graphs, "compile": child_compile,
            "piecewise": child_piecewise, "stats": child_stats, "mp": child_mp,
            "perf": child_perf, "behaviour": child_behaviour}


def main(argv):
    name, result_path, params = argv[1], argv[2], json.loads(argv[3])
    try:
        res = CHILDREN[name](params)
    except BaseException:  # noqa: BLE001 - reported to the parent
        res = {"child_error": traceback.format_exc()}
    write_result(result_path, res)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown: its frees are not under test here


if __name__ == "__main__":
    main(sys.argv)
