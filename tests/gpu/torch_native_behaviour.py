"""The ``behaviour`` child of gpu_torch_native.py (run through torch_native_children.py):
what PyTorch users rely on, under gpu-arena's native allocator: OOM then recovery,
``record_stream`` across streams, ``empty_cache``, the memory fraction, non-blocking copies
with pinned memory, ``make_graphed_callables`` and a capturable optimizer in a CUDA graph.
Stdlib imports only at the top (torch comes in through ``setup``)."""

from __future__ import annotations

import copy
import traceback

from torch_native_common import GiB, MiB, TOL, info, maxdiff, setup


# --------------------------------------------------------------------------------------
# behaviour: what users rely on
# --------------------------------------------------------------------------------------


def _oom(torch, ga, total):
    r = {}
    try:
        x = torch.empty(2 * total, dtype=torch.uint8, device="cuda")
        del x
        r["raised"] = None
    except Exception as e:  # noqa: BLE001 - the point
        msg = str(e)
        r["raised"] = type(e).__name__
        r["is_OutOfMemoryError"] = isinstance(e, getattr(torch, "OutOfMemoryError", ()))
        r["message_ok"] = msg.startswith("CUDA out of memory. Tried to allocate")
        r["message"] = msg[:400]
    held, n = [], 0
    try:  # exhaust the device in 16 GiB pieces, then give them back
        while len(held) < 12:
            held.append(torch.empty(16 * GiB, dtype=torch.uint8, device="cuda"))
        r["exhaust"] = "no OOM after 12 x 16 GiB"
    except Exception as e:  # noqa: BLE001
        r["exhaust"] = f"{type(e).__name__} after {len(held)} x 16 GiB"
        r["exhaust_oom"] = isinstance(e, getattr(torch, "OutOfMemoryError", ()))
    n = len(held)
    del held
    torch.cuda.empty_cache()
    a = torch.ones(512, 512, device="cuda")
    b = torch.full((16 * GiB // 4,), 3.0, device="cuda")
    r["recovered"] = bool(((a @ a) == 512).all()) and float(b[-1]) == 3.0
    r["pieces_before_oom"] = n
    r["num_ooms"] = torch.cuda.memory_stats().get("num_ooms")
    r["gpu_arena_oom_count"] = ga.stats(0)["oom_count"]
    del a, b
    torch.cuda.empty_cache()
    return r


def _record_stream(torch, reps=5):
    A, B = torch.cuda.Stream(), torch.cuda.Stream()
    numel = 4 * MiB
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    torch.cuda._sleep(10_000_000)
    e1.record()
    torch.cuda.synchronize()
    cycles = int(10_000_000 * 50.0 / max(e0.elapsed_time(e1), 0.01))  # ~50 ms
    corrupt = same = 0
    for _ in range(reps):
        X = torch.full((numel,), 1.0, device="cuda")
        xp = X.data_ptr()
        A.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(A):
            torch.cuda._sleep(cycles)
            X.add_(1.0)
            Y = X * 2.0
        X.record_stream(A)
        del X
        with torch.cuda.stream(B):
            Z = torch.empty(numel, device="cuda")
            same += Z.data_ptr() == xp
            Z.fill_(7.0)
        torch.cuda.synchronize()
        corrupt += bool((Y != 4.0).any()) or bool((Z != 7.0).any())
        del Y, Z
    return {"reps": reps, "corrupted": corrupt, "z_at_x_address": same, "sleep_cycles": cycles}


def _empty_cache(torch):
    torch.cuda.empty_cache()
    xs = [torch.empty(GiB, dtype=torch.uint8, device="cuda") for _ in range(4)]
    torch.cuda.synchronize()
    free_held = torch.cuda.mem_get_info()[0]
    del xs
    free_cached = torch.cuda.mem_get_info()[0]
    torch.cuda.empty_cache()
    free_after = torch.cuda.mem_get_info()[0]
    return {"given_back": int(free_after - free_held), "back_before_empty_cache":
            int(free_cached - free_held), "ok": free_after - free_held >= 4 * GiB - TOL,
            "reserved_after": int(torch.cuda.memory_reserved())}


def _fraction(torch, total):
    r = {}
    torch.cuda.set_per_process_memory_fraction(0.5)
    get = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    r["get"] = get() if get else "torch.cuda.get_per_process_memory_fraction missing"
    try:
        x = torch.empty(int(0.75 * total), dtype=torch.uint8, device="cuda")
        del x
        r["above_fraction"] = "allocated (fraction not enforced)"
    except Exception as e:  # noqa: BLE001 - reported
        r["above_fraction"] = f"raised {type(e).__name__}"
    torch.cuda.set_per_process_memory_fraction(1.0)
    torch.cuda.empty_cache()
    return r


def _pinned(torch):
    n = 32 * MiB
    h = torch.arange(n, dtype=torch.int32).pin_memory()
    h2 = torch.empty(n, dtype=torch.int32).pin_memory()
    d = torch.empty(n, dtype=torch.int32, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        d.copy_(h, non_blocking=True)
        d.mul_(3)
        h2.copy_(d, non_blocking=True)
    s.synchronize()
    ok_side = bool(torch.equal(h2, h * 3))
    d2 = h.to("cuda", non_blocking=True)
    h3 = torch.empty(n, dtype=torch.int32).pin_memory()
    h3.copy_(d2.add_(1), non_blocking=True)
    torch.cuda.current_stream().synchronize()
    return {"pinned": bool(h.is_pinned()), "side_stream_ok": ok_side,
            "default_stream_ok": bool(torch.equal(h3, h + 1)), "bytes": 4 * n}


def _graphed_callables(torch):
    nn, F = torch.nn, torch.nn.functional
    torch.manual_seed(0)
    mod = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)).cuda()
    ref = copy.deepcopy(mod)
    graphed = torch.cuda.make_graphed_callables(mod, (torch.randn(32, 64, device="cuda"),))
    gen = torch.Generator(device="cuda").manual_seed(5)
    od = gd = 0.0
    for _ in range(3):
        x = torch.randn(32, 64, device="cuda", generator=gen)
        for m in (graphed, ref):
            for q in m.parameters():
                q.grad = None
        yg = graphed(x)
        F.mse_loss(yg, torch.zeros_like(yg)).backward()
        ye = ref(x)
        F.mse_loss(ye, torch.zeros_like(ye)).backward()
        od = max(od, maxdiff(yg, ye))
        gd = max(gd, max(maxdiff(a.grad, b.grad) for a, b in zip(mod.parameters(), ref.parameters())))
    return {"out_max_abs_diff": od, "grad_max_abs_diff": gd, "ok": od <= 1e-5 and gd <= 1e-5}


def _capturable_adam(torch, replays=10):
    nn, F = torch.nn, torch.nn.functional
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 1)).cuda()
    ref = copy.deepcopy(model)
    init = [q.detach().clone() for q in model.parameters()]
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, capturable=True)
    opt_ref = torch.optim.Adam(ref.parameters(), lr=1e-2, capturable=True)
    gen = torch.Generator(device="cuda").manual_seed(7)
    sx, sy = torch.randn(64, 64, device="cuda", generator=gen), torch.randn(64, 1, device="cuda", generator=gen)
    batches = [(torch.randn(64, 64, device="cuda", generator=gen), torch.randn(64, 1, device="cuda", generator=gen))
               for _ in range(replays)]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            F.mse_loss(model(sx), sy).backward()
            opt.step()
    torch.cuda.current_stream().wait_stream(s)
    for _ in range(3):  # the same warm-up steps, eagerly
        opt_ref.zero_grad(set_to_none=True)
        F.mse_loss(ref(sx), sy).backward()
        opt_ref.step()
    g = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(g):
        sloss = F.mse_loss(model(sx), sy)
        sloss.backward()
        opt.step()
    ld = 0.0
    for x, y in batches:
        sx.copy_(x)
        sy.copy_(y)
        g.replay()
        opt_ref.zero_grad(set_to_none=True)
        le = F.mse_loss(ref(x), y)
        le.backward()
        opt_ref.step()
        ld = max(ld, abs(float(sloss) - float(le)))
    pd = max(maxdiff(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    moved = max(maxdiff(a, b) for a, b in zip(model.parameters(), init))
    return {"replays": replays, "loss_max_abs_diff": ld, "param_max_abs_diff": pd,
            "params_moved": moved, "ok": pd <= 1e-4 and ld <= 1e-4 and moved > 0}


def child_behaviour(p):
    torch, ga = setup("native")
    free0, total = torch.cuda.mem_get_info()
    out = {"total": int(total)}
    for name, fn in (("oom", lambda: _oom(torch, ga, total)),
                     ("record_stream", lambda: _record_stream(torch)),
                     ("empty_cache", lambda: _empty_cache(torch)),
                     ("fraction", lambda: _fraction(torch, total)),
                     ("pinned", lambda: _pinned(torch)),
                     ("graphed_callables", lambda: _graphed_callables(torch)),
                     ("capturable_adam", lambda: _capturable_adam(torch))):
        try:
            out[name] = fn()
        except Exception:  # noqa: BLE001 - one failing part must not hide the others
            out[name] = {"error": traceback.format_exc()[-3000:]}
    out["info"] = info(torch, ga, "native")
    return out
