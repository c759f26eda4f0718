#!/usr/bin/env python3
"""The child side of gpu_torch_check.py: each check's workload, run by it in a fresh
interpreter (``python3 tests/gpu/torch_children.py NAME JSON``), which imports torch
(after ``gpu_arena.torch.install()`` where the check needs it) and hands its result back
to the parent with ``result_channel.report`` (a file of its own: stdout and stderr are a
log). The checks and what they prove: gpu_torch_check.py."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import hashlib
import json
import os
import platform
import random
import sys
import time
import traceback

import gpu_common  # noqa: F401  (beside this file: python/ and tests/python/ on sys.path)
from result_channel import report  # tests/python/result_channel.py

MiB, GiB = 1 << 20, 1 << 30


def _setup(mode: str, conf=None):
    """Import torch, with gpu-arena installed first for mode 'arena'. Returns (torch, api)."""
    api = None
    if mode == "arena":
        import gpu_arena
        import gpu_arena.torch as gt

        gt.install(conf or None)
        api = gpu_arena
    elif mode != "default":
        raise ValueError(f"mode {mode!r}")
    import torch

    if torch.cuda.is_initialized():
        raise RuntimeError("CUDA was initialized before the check started")
    return torch, api


def _device_info(torch, api):
    props = torch.cuda.get_device_properties(0)
    info = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": props.name,
        "gpu_total_bytes": int(props.total_memory),
        "python": platform.python_version(),
        "CUDA_MODULE_LOADING": os.environ.get("CUDA_MODULE_LOADING", "(unset)"),
        "has_clearCublasWorkspaces": hasattr(torch._C, "_cuda_clearCublasWorkspaces"),
        "has_sleep": hasattr(torch.cuda, "_sleep"),
    }
    if api is not None:
        info["gpu_arena_lib"] = api.lib_path()
        info["gpu_arena_backend"] = api.backend_name()
    return info


def _arena_ranges(api, dev=0):
    snap = api.snapshot()
    return [
        (int(a["base"]), int(a["bytes"]))
        for d in snap["devices"]
        if d["device"] == dev
        for a in d["arenas"]
    ]


def _inside(ranges, ptr):
    return any(b <= ptr < b + n for b, n in ranges)


def _sha(t) -> str:
    t = t.detach().cpu().contiguous()
    n = t.numel() * t.element_size()
    return hashlib.sha256(ctypes.string_at(t.data_ptr(), n) if n else b"").hexdigest()


def _sdpa_math(torch):
    """Force the math SDPA backend (plain matmuls + softmax: deterministic forward and
    backward); returns (context manager, name)."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel([SDPBackend.MATH]), "math (torch.nn.attention.sdpa_kernel)"
    except Exception:  # noqa: BLE001 - older torch
        return contextlib.nullcontext(), "torch default (sdpa_kernel unavailable)"


def _train(torch, steps, seed=0):
    """Deterministic small-transformer training. Returns (model, losses, sdpa_name)."""
    import torch.nn as nn

    # Every matmul runs under bf16 autocast, so the TF32 switches do not matter (and are
    # left alone: torch >= 2.9 refuses a mix of its legacy and new TF32 APIs).
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(seed)
    d, heads, layers, seq, batch = 512, 8, 4, 256, 16
    layer = nn.TransformerEncoderLayer(
        d, heads, dim_feedforward=4 * d, dropout=0.0, batch_first=True, norm_first=True
    )
    enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
    model = nn.Sequential(enc, nn.Linear(d, d)).cuda()
    g = torch.Generator().manual_seed(seed + 1)  # CPU generator: same data everywhere
    x = torch.randn(batch, seq, d, generator=g).cuda()
    y = torch.randn(batch, seq, d, generator=g).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01, foreach=True)
    ctx, sdpa_name = _sdpa_math(torch)
    losses = []
    with ctx:
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(x)
            loss = torch.nn.functional.mse_loss(out.float(), y)
            loss.backward()
            opt.step()
            losses.append(float(loss.item()))
    torch.cuda.synchronize()
    del opt, x, y, out, loss
    torch.use_deterministic_algorithms(False)
    return model, losses, sdpa_name


def child_transformer(p):
    torch, api = _setup(p["mode"], p.get("conf"))
    t0 = time.perf_counter()
    model, losses, sdpa_name = _train(torch, p["steps"])
    wall = time.perf_counter() - t0
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    res = {
        "info": _device_info(torch, api),
        "losses": losses,
        "digests": {k: _sha(v) for k, v in state.items()},
        "n_params": sum(v.numel() for v in state.values()),
        "train_s": wall,
        "sdpa": sdpa_name,
    }
    torch.save(state, p["save"])
    if api is not None:
        ranges = _arena_ranges(api)
        ptrs = [q.data_ptr() for q in model.parameters()]
        res["params_in_arenas"] = sum(_inside(ranges, q) for q in ptrs)
        res["params_total"] = len(ptrs)
        res["stats"] = api.stats(0)
        api.validate(0)
    return res


def child_compare(p):
    import torch

    a = torch.load(p["a"], map_location="cpu")
    b = torch.load(p["b"], map_location="cpu")
    out = {}
    for k in a:
        if k not in b:
            out[k] = {"missing": True}
            continue
        eq = bool(torch.equal(a[k], b[k]))
        diff = (a[k].double() - b[k].double()).abs()
        out[k] = {
            "equal": eq,
            "max_abs_diff": float(diff.max()) if diff.numel() else 0.0,
            "n_diff": int((diff != 0).sum()),
            "numel": a[k].numel(),
        }
    return out


def _pattern(torch, api, n_tensors, live_max, live_bytes_max, seed, n_streams=4):
    """Allocate/fill/verify/free many tensors of many sizes on several streams."""
    rnd = random.Random(seed)
    max_bytes = 256 * MiB
    slack = 4096
    g = torch.Generator(device="cuda").manual_seed(seed)
    ref = torch.randint(0, 256, (max_bytes + slack,), dtype=torch.uint8, device="cuda", generator=g)
    streams = [torch.cuda.current_stream()] + [torch.cuda.Stream() for _ in range(n_streams - 1)]
    torch.cuda.synchronize()  # ref is ready for every stream
    bad = []
    for s in streams:
        with torch.cuda.stream(s):
            bad.append(torch.zeros((), dtype=torch.int64, device="cuda"))
    torch.cuda.synchronize()

    # Self-test: a single flipped byte must be counted.
    with torch.cuda.stream(streams[1]):
        t = torch.empty(12345, dtype=torch.uint8, device="cuda")
        t.copy_(ref[7 : 7 + 12345])
        t[1000:1001].bitwise_xor_(1)
        selftest = int((t != ref[7 : 7 + 12345]).sum().item())
        del t

    edges = [1, 2, 3, 511, 512, 513, 4095, 4097, 65537, 2 * MiB - 1, 2 * MiB + 1,
             64 * MiB - 1, 64 * MiB + 1, 255 * MiB + 3, max_bytes - 1, max_bytes]
    sizes = list(edges)
    while len(sizes) < n_tensors:
        n = int(2 ** rnd.uniform(0, 28))
        if rnd.random() < 0.8:
            n |= 1
        sizes.append(min(max(n, 1), max_bytes))
    rnd.shuffle(sizes)

    live = []  # [tensor, off, size, stream index, ptr]
    live_bytes = 0
    seen = set()
    c = {"tensors": 0, "bytes_written": 0, "reused": 0, "overlaps": 0, "misaligned_256": 0,
         "not_512_aligned": 0, "cross_stream_verifies": 0, "odd_sizes": 0, "over_64MiB": 0,
         "overlap_examples": []}

    def retire(entry):
        t, off, n, si, _ = entry
        s = streams[si]
        if rnd.random() < 0.25:
            vi = rnd.choice([i for i in range(len(streams)) if i != si])
            v = streams[vi]
            v.wait_stream(s)
            with torch.cuda.stream(v):
                bad[vi].add_((t != ref[off : off + n]).sum())
            t.record_stream(v)
            c["cross_stream_verifies"] += 1
        else:
            with torch.cuda.stream(s):
                bad[si].add_((t != ref[off : off + n]).sum())
        entry[0] = None  # the last reference: freed here (on stream s)
        del t

    for n in sizes:
        si = rnd.randrange(len(streams))
        off = rnd.randrange(slack)
        with torch.cuda.stream(streams[si]):
            t = torch.empty(n, dtype=torch.uint8, device="cuda")
            t.copy_(ref[off : off + n])
        ptr = t.data_ptr()
        for e in live:
            if ptr < e[4] + e[2] and e[4] < ptr + n:
                c["overlaps"] += 1
                if len(c["overlap_examples"]) < 5:
                    c["overlap_examples"].append([hex(ptr), n, hex(e[4]), e[2]])
        c["reused"] += ptr in seen
        seen.add(ptr)
        c["misaligned_256"] += ptr % 256 != 0
        c["not_512_aligned"] += ptr % 512 != 0
        c["odd_sizes"] += n % 2
        c["over_64MiB"] += n > 64 * MiB
        c["tensors"] += 1
        c["bytes_written"] += n
        live.append([t, off, n, si, ptr])
        del t
        live_bytes += n
        while len(live) > live_max or live_bytes > live_bytes_max:
            e = live.pop(rnd.randrange(len(live)))
            live_bytes -= e[2]
            retire(e)
    while live:
        retire(live.pop())
    torch.cuda.synchronize()
    c["mismatched_bytes"] = int(sum(int(b.item()) for b in bad))
    c["selftest_detected"] = selftest
    c["streams"] = len(streams)
    c["distinct_addresses"] = len(seen)
    c["min_size"] = min(sizes)
    c["max_size"] = max(sizes)
    bad = ref = None  # free them (the closure above refers to these names)
    torch.cuda.synchronize()
    return c


def _validate(api):
    """gpu_arena.validate(0) as a report line: "ok", or "FAILED: <why>"."""
    try:
        api.validate(0)
        return "ok"
    except Exception as e:  # noqa: BLE001 - reported
        return f"FAILED: {e}"


def child_pattern(p):
    torch, api = _setup("arena", p.get("conf"))
    t0 = time.perf_counter()
    c = _pattern(torch, api, p["n"], p["live_max"], p["live_bytes_max"], p["seed"])
    c["wall_s"] = time.perf_counter() - t0
    c["stats"] = api.stats(0)
    c["validate"] = _validate(api)
    c["info"] = _device_info(torch, api)
    return c


def child_streams(p):
    torch, api = _setup("arena", p.get("conf"))
    numel, reps = p["numel"], p["reps"]
    default = torch.cuda.current_stream()
    A, B, S = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()
    has_sleep = hasattr(torch.cuda, "_sleep")
    dummy = torch.empty(64 << 20, device="cuda") if not has_sleep else None
    cycles = int(p["cycles"])

    def long_kernel(spin):
        if has_sleep:
            torch.cuda._sleep(spin)
        else:  # fallback: many passes over 256 MiB on the current stream
            for _ in range(400):
                dummy.mul_(1.0)

    def time_sleep(spin):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        A.wait_stream(default)
        with torch.cuda.stream(A):
            e0.record()
            long_kernel(spin)
            e1.record()
        torch.cuda.synchronize()
        return e0.elapsed_time(e1)

    time_sleep(1000)  # warm-up
    sleep_ms = time_sleep(cycles)
    if has_sleep and sleep_ms < 30:  # make sure the kernel outlasts the host's few calls
        cycles = int(cycles * 50.0 / max(sleep_ms, 0.01))
        sleep_ms = time_sleep(cycles)

    def summary(v):
        u = torch.unique(v)
        return [float(x) for x in u[:6].tolist()] + (["..."] if u.numel() > 6 else [])

    cross = {"reps": 0, "same_address": 0, "y_corrupt": 0, "z_corrupt": 0, "corrupt_reps": 0,
             "corrupt_at_same_address": 0, "max_z_alloc_ms": 0.0, "examples": []}
    for r in range(reps):
        X = torch.full((numel,), 1.0, device="cuda")  # on the default stream
        x_ptr = X.data_ptr()
        A.wait_stream(default)
        with torch.cuda.stream(A):
            long_kernel(cycles)
            X.add_(1.0)
            Y = X * 2.0  # expect 4.0; allocated on A
        X.record_stream(A)
        del X  # freed on the default stream while A still reads/writes it
        t0 = time.perf_counter()
        with torch.cuda.stream(B):
            Z = torch.empty(numel, device="cuda")
            z_ptr = Z.data_ptr()
            Z.fill_(7.0)
        cross["max_z_alloc_ms"] = max(cross["max_z_alloc_ms"], (time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        yb, zb = int((Y != 4.0).sum().item()), int((Z != 7.0).sum().item())
        cross["reps"] += 1
        cross["same_address"] += z_ptr == x_ptr
        cross["y_corrupt"] += yb > 0
        cross["z_corrupt"] += zb > 0
        if yb or zb:
            cross["corrupt_reps"] += 1
            cross["corrupt_at_same_address"] += z_ptr == x_ptr
            if len(cross["examples"]) < 3:
                cross["examples"].append({
                    "rep": r, "x_ptr": hex(x_ptr), "z_ptr": hex(z_ptr),
                    "y_bad_elems": yb, "y_values": summary(Y),
                    "z_bad_elems": zb, "z_values": summary(Z), "numel": numel,
                })
        del Y, Z
        torch.cuda.synchronize()

    same = {"reps": 0, "same_address": 0, "corrupt_reps": 0, "examples": []}
    for r in range(reps):
        with torch.cuda.stream(S):
            X = torch.full((numel,), 1.0, device="cuda")
            x_ptr = X.data_ptr()
            long_kernel(cycles)
            X.add_(1.0)
            Y = X * 2.0
            del X  # freed on S; S's later work runs after Y = X * 2
            Z = torch.empty(numel, device="cuda")
            z_ptr = Z.data_ptr()
            Z.fill_(7.0)
        torch.cuda.synchronize()
        yb, zb = int((Y != 4.0).sum().item()), int((Z != 7.0).sum().item())
        same["reps"] += 1
        same["same_address"] += z_ptr == x_ptr
        if yb or zb:
            same["corrupt_reps"] += 1
            if len(same["examples"]) < 3:
                same["examples"].append({"rep": r, "x_ptr": hex(x_ptr), "z_ptr": hex(z_ptr),
                                         "y_values": summary(Y), "z_values": summary(Z)})
        del Y, Z
        torch.cuda.synchronize()

    out = {"cross": cross, "same": same, "sleep_ms": sleep_ms, "cycles": cycles,
           "long_kernel": "torch.cuda._sleep" if has_sleep else "400 x mul_ over 256 MiB",
           "numel": numel, "stats": api.stats(0)}
    out["validate"] = _validate(api)
    out["info"] = _device_info(torch, api)
    return out


def child_memory(p):
    mode = p["mode"]
    torch, api = _setup(mode, p.get("conf"))
    # This is what initializes CUDA (and calls gpu-arena's init hook): nothing allocated yet.
    free0, total = torch.cuda.mem_get_info()
    out = {"mode": mode, "base_free": int(free0), "total": int(total), "runs": []}
    has_clear = hasattr(torch._C, "_cuda_clearCublasWorkspaces")
    out["has_clearCublasWorkspaces"] = has_clear

    def probe():
        if api is not None:
            return api.stats(0)
        return {"torch_memory_reserved": int(torch.cuda.memory_reserved()),
                "torch_memory_allocated": int(torch.cuda.memory_allocated())}

    def workload(probes):
        model, losses, _ = _train(torch, p["steps"], seed=1)
        probes["after_training (model live)"] = probe()
        del model
        _pattern(torch, api, p["n"], 48, 2 * GiB, seed=2)
        probes["after_pattern"] = probe()
        return losses[-1]

    for i in range(2):
        probes = {}
        last_loss = workload(probes)
        run = {"last_loss": last_loss, "probes": probes}
        gc.collect()
        torch.cuda.synchronize()
        if has_clear:
            torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()  # with gpu-arena: the reset hook -> gpu_arena_empty_cache(-1)
        if api is not None:
            run["stats_after_torch_empty_cache"] = api.stats(0)
            api.empty_cache(-1)
            run["stats_after"] = api.stats(0)
            run["used_ranges_after"] = [
                r["len"]
                for d in api.snapshot()["devices"]
                for a in d["arenas"]
                for r in a["ranges"]
                if r["free_tag"] is None
            ]
        else:
            run["torch_memory_reserved_after"] = int(torch.cuda.memory_reserved())
            run["torch_max_memory_reserved"] = int(torch.cuda.max_memory_reserved())
        torch.cuda.synchronize()
        run["free_after"] = int(torch.cuda.mem_get_info()[0])
        out["runs"].append(run)
    if api is not None:
        out["validate"] = _validate(api)
    out["info"] = _device_info(torch, api)
    return out


CHILDREN = {
    "transformer": child_transformer,
    "compare": child_compare,
    "pattern": child_pattern,
    "streams": child_streams,
    "memory": child_memory,
}


def child_main(name: str, params: str) -> int:
    try:
        res = CHILDREN[name](json.loads(params))
    except BaseException:  # noqa: BLE001 - reported to the parent
        res = {"child_error": traceback.format_exc()}
    report(res)
    return 0


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1], sys.argv[2]))
