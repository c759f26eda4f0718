"""The ranks of gpu_multi_gpu.py's one-process-per-GPU checks, run through
multi_gpu_children.py (``python3 tests/gpu/multi_gpu_children.py ddp|tp RESULT PARAMS``) with
torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT, and
NCCL_NVLS_ENABLE=0) set by the parent; rank r uses GPU r, backend nccl.

ddp  DistributedDataParallel training (deterministic), then an all_reduce loop, under gpu-arena
     (``mode="arena"``: install(route="native") in every rank) or PyTorch's allocator.
tp   A tensor-parallel-shaped decode loop under gpu-arena: weights sharded over every GPU (tag
     ``weights``), a KV cache per GPU (tag ``kv_cache``), one decode step captured as a CUDA
     graph (all_reduces inside, or piecewise graphs with eager all_reduces between them), then
     every rank sleeps and wakes at once.
What each proves: gpu_multi_gpu.py's docstring."""

from __future__ import annotations

import hashlib
import json
import os
import time

from multi_gpu_children import free_mem
from torch_native_common import setup

MiB, GiB = 1 << 20, 1 << 30


def _init(mode):
    """gpu-arena installed first (mode "arena") or not, GPU `rank` current, NCCL initialized."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch, ga = setup("native" if mode == "arena" else "torch")
    import torch.distributed as dist

    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    t0 = time.perf_counter()
    try:
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
    except TypeError:  # a torch without device_id
        dist.init_process_group("nccl", rank=rank, world_size=world)
    return torch, ga, dist, rank, world, dev, round(time.perf_counter() - t0, 2)


def _common_info(torch, ga, rank):
    d = {"rank": rank, "pid": os.getpid(), "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE"),
         "torch": torch.__version__, "gpu": torch.cuda.get_device_name(rank)}
    try:
        d["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
    except Exception:  # noqa: BLE001 - reported as missing
        d["nccl"] = None
    if ga is not None:
        import gpu_arena.torch as gt

        st = ga.stats(rank)
        d.update(route=gt.route_in_use(), backend=ga.backend_name(), alloc_count=st["alloc_count"],
                 peak_reserved=st["peak_reserved_bytes"])
    return d


# --------------------------------------------------------------------------------------
# ddp
# --------------------------------------------------------------------------------------


def child_ddp(p):
    torch, ga, dist, rank, world, dev, init_s = _init(p["mode"])
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch_children import _sdpa_math, _sha

    nn = torch.nn
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)  # the same initial weights in every rank (DDP broadcasts rank 0's too)
    d_model = 512
    layer = nn.TransformerEncoderLayer(d_model, 8, dim_feedforward=4 * d_model, dropout=0.0,
                                       batch_first=True, norm_first=True)
    model = nn.Sequential(nn.TransformerEncoder(layer, 4, enable_nested_tensor=False),
                          nn.Linear(d_model, d_model)).to(dev)
    ddp = DDP(model, device_ids=[rank])
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data (CPU: the same everywhere)
    x = torch.randn(16, 256, d_model, generator=g).to(dev)
    y = torch.randn(16, 256, d_model, generator=g).to(dev)
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-4, weight_decay=0.01, foreach=True)
    ctx, sdpa = _sdpa_math(torch)
    losses, global_losses = [], []
    t0 = time.perf_counter()
    with ctx:
        for _ in range(p["steps"]):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = ddp(x)
            loss = nn.functional.mse_loss(out.float(), y)
            loss.backward()
            opt.step()
            losses.append(float(loss.item()))
            gl = loss.detach().clone()
            dist.all_reduce(gl)
            global_losses.append(float(gl.item()))
    torch.cuda.synchronize()
    train_s = time.perf_counter() - t0
    digests = {k: _sha(v) for k, v in model.state_dict().items()}
    del opt, x, y, out, loss, gl
    torch.use_deterministic_algorithms(False)
    c = torch.full((1024,), float(rank + 1), device=dev)
    dist.all_reduce(c)
    sum_ok = bool((c == world * (world + 1) / 2).all().item())
    timing = {}
    for size in p["sizes"]:
        t = torch.zeros(size // 4, dtype=torch.float32, device=dev)
        iters = max(5, min(50, (1 << 31) // size))
        for _ in range(5):
            dist.all_reduce(t)
        rounds = []
        for _ in range(p["rounds"]):
            dist.barrier()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(iters):
                dist.all_reduce(t)
            torch.cuda.synchronize()
            rounds.append((time.perf_counter() - t0) / iters)
        timing[str(size)] = {"iters": iters, "s_per_op": rounds}
        del t
    res = {"init_s": init_s, "losses": losses, "global_losses": global_losses, "digests": digests,
           "digest": hashlib.sha256(json.dumps(digests, sort_keys=True).encode()).hexdigest(),
           "sum_ok": sum_ok, "timing": timing, "train_s": round(train_s, 2), "sdpa": sdpa,
           "info": _common_info(torch, ga, rank), "world": world}
    dist.barrier()
    dist.destroy_process_group()
    return res


# --------------------------------------------------------------------------------------
# tp
# --------------------------------------------------------------------------------------


def child_tp(p):
    torch, ga, dist, rank, world, dev, init_s = _init("arena")
    import gpu_arena.torch as gt
    from torch_children import _sha

    gloo = dist.new_group(backend="gloo")  # host-side barriers and gathers

    def barrier():
        dist.barrier(group=gloo)

    def gather(obj):
        out = [None] * world
        dist.all_gather_object(out, obj, group=gloo)
        return out

    bf16 = torch.bfloat16
    L, H, B, W, T, d = p["layers"], p["hidden"], p["batch"], p["window"], p["steps"], p["head_dim"]
    hl = max(1, p["heads"] // world)  # heads on this rank
    hd = hl * d
    fl = max(128, p["ffn"] // world // 128 * 128)  # this rank's slice of the MLP
    gen = torch.Generator(device=dev).manual_seed(1234 + rank)
    base_free = free_mem(torch, rank)
    with gt.use_tag("weights"):
        wqkv = [torch.empty(H, 3 * hd, dtype=bf16, device=dev).normal_(0, H ** -0.5, generator=gen) for _ in range(L)]
        wo = [torch.empty(hd, H, dtype=bf16, device=dev).normal_(0, hd ** -0.5 / world, generator=gen) for _ in range(L)]
        wup = [torch.empty(H, fl, dtype=bf16, device=dev).normal_(0, H ** -0.5, generator=gen) for _ in range(L)]
        wdn = [torch.empty(fl, H, dtype=bf16, device=dev).normal_(0, fl ** -0.5 / world, generator=gen) for _ in range(L)]
    weights = wqkv + wo + wup + wdn
    w_bytes = sum(w.numel() * 2 for w in weights)
    slots = max(B * W, int(p["kv_bytes"]) // (L * 2 * hd * 2))
    with gt.use_tag("kv_cache"):
        kv = [torch.zeros(2, slots, hl, d, dtype=bf16, device=dev) for _ in range(L)]
    kv_bytes = sum(t.numel() * 2 for t in kv)
    x0 = torch.randn(B, H, generator=torch.Generator().manual_seed(7)).to(bf16).to(dev)  # same in every rank
    x = torch.empty(B, H, dtype=bf16, device=dev)
    part = torch.empty(B, H, dtype=bf16, device=dev)
    out = torch.empty(B, dtype=torch.float32, device=dev)
    pos = torch.zeros((), dtype=torch.long, device=dev)
    slot_base = torch.arange(B, device=dev) * W
    t_idx = torch.arange(W, device=dev)
    scale = d ** -0.5

    def rms(v):
        vf = v.float()
        return (vf * torch.rsqrt(vf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(bf16)

    def seg_attn(l):
        def f():
            if l:
                x.add_(part)
            q, k, v = (rms(x) @ wqkv[l]).view(B, 3, hl, d).unbind(1)
            slot = slot_base + pos
            kv[l][0].index_copy_(0, slot, k)
            kv[l][1].index_copy_(0, slot, v)
            K, V = kv[l][0][:B * W].view(B, W, hl, d), kv[l][1][:B * W].view(B, W, hl, d)
            s = torch.einsum("bhd,bwhd->bhw", q, K).float() * scale
            s.masked_fill_(t_idx > pos, float("-inf"))
            o = torch.einsum("bhw,bwhd->bhd", torch.softmax(s, -1).to(bf16), V).reshape(B, hd)
            torch.matmul(o, wo[l], out=part)
        return f

    def seg_mlp(l):
        def f():
            x.add_(part)
            torch.matmul(torch.nn.functional.gelu(rms(x) @ wup[l]), wdn[l], out=part)
        return f

    def seg_final():
        x.add_(part)
        torch.sum(x.float(), dim=1, out=out)
        pos.add_(1)

    segments = [f for l in range(L) for f in (seg_attn(l), seg_mlp(l))] + [seg_final]

    def step_eager():
        for k, f in enumerate(segments):
            f()
            if k < len(segments) - 1:
                dist.all_reduce(part)  # the partial sums of the sharded matmuls

    def reset():
        x.copy_(x0)
        pos.zero_()
        for t in kv:
            t[:, :B * W].zero_()

    def run(step):
        reset()
        outs = []
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(T):
            step()
            outs.append(out.clone())
        torch.cuda.synchronize()
        return torch.stack(outs), (time.perf_counter() - t0) / T

    o_eager, eager_s = run(step_eager)
    # Warm-up on a side stream (as before any capture), then the capture.
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            reset()
            step_eager()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    barrier()
    time.sleep(0.2)  # NCCL's watchdog done with the warm-up's work before a capture begins
    mode, capture_error, graphs = p["graph"], None, []
    if mode == "full":
        try:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, capture_error_mode="thread_local"):
                step_eager()
            graphs = [g]
        except Exception as e:  # noqa: BLE001 - reported; the parent may retry piecewise
            capture_error = f"{type(e).__name__}: {e}"
    if gather(capture_error is None) != [True] * world:
        return {"capture_failed": True, "capture_error": capture_error, "graph": mode}
    if mode == "piecewise":
        pool = torch.cuda.graph_pool_handle()
        for f in segments:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool, capture_error_mode="thread_local"):
                f()
            graphs.append(g)

    def step_graph():
        for k, g in enumerate(graphs):
            g.replay()
            if mode == "piecewise" and k < len(graphs) - 1:
                dist.all_reduce(part)

    o_graph, graph_s = run(step_graph)
    ranks_digests = gather(_sha(o_graph))

    def checksums():  # two sums over each weight's bits, on its GPU
        sums = torch.stack([w.view(torch.int16).sum(dtype=torch.int64) for w in weights]
                           + [w.view(torch.int16)[::7].pow(2).sum(dtype=torch.int64) for w in weights])
        return sums.cpu().tolist()

    sums_before, ptrs_before = checksums(), [w.data_ptr() for w in weights + kv]
    # Every rank sleeps at once: weights offloaded to the host, the KV cache discarded.
    barrier()
    free_before = free_mem(torch, rank)
    t0 = time.perf_counter()
    gt.sleep(offload_tags=["weights"], device=rank, tags=["weights", "kv_cache"])
    sleep_s = time.perf_counter() - t0
    free_asleep = free_mem(torch, rank)
    st_asleep = ga.stats(rank)
    asleep_at = time.time()
    barrier()  # every rank asleep here
    wake_at = time.time()
    t0 = time.perf_counter()
    gt.wake(device=rank)
    wake_s = time.perf_counter() - t0
    free_awake = free_mem(torch, rank)
    st_awake = ga.stats(rank)
    # The pinned host buffers stay for the next sleep (their registration holds some device
    # memory for the mappings); an engine that will not sleep again frees them.
    ga.sleep_release_host(rank)
    free_released = free_mem(torch, rank)
    sums_after, ptrs_after = checksums(), [w.data_ptr() for w in weights + kv]
    o_wake, _ = run(step_graph)  # the KV cache is zeroed by reset(): an engine re-initialises it
    res = {"init_s": init_s, "graph": mode, "graphs": len(graphs), "capture_error": capture_error,
           "layers": L, "hidden": H, "heads_local": hl, "ffn_local": fl, "batch": B, "window": W, "steps": T,
           "kv_slots": slots, "weights_bytes": w_bytes, "kv_bytes": kv_bytes, "base_free": base_free,
           "graph_vs_eager_max_abs": float((o_graph - o_eager).abs().max()),
           "graph_vs_eager_close": bool(torch.allclose(o_graph, o_eager, rtol=2e-2, atol=2e-2)),
           "graph_vs_eager_bitwise": bool(torch.equal(o_graph, o_eager)),
           "finite": bool(torch.isfinite(o_graph).all()),
           "ranks_identical": len(set(ranks_digests)) == 1, "eager_step_ms": round(eager_s * 1e3, 3),
           "graph_step_ms": round(graph_s * 1e3, 3), "free_before_sleep": free_before,
           "free_asleep": free_asleep, "free_awake": free_awake, "freed_by_sleep": free_asleep - free_before,
           "free_host_released": free_released,
           "sleeping_bytes": st_asleep["sleeping_bytes"], "sleeping_after_wake": st_awake["sleeping_bytes"],
           "sleep_s": round(sleep_s, 3), "wake_s": round(wake_s, 3), "asleep_at": asleep_at, "wake_at": wake_at,
           "weights_same": sums_before == sums_after, "addresses_same": ptrs_before == ptrs_after,
           "replay_after_wake_bitwise": bool(torch.equal(o_wake, o_graph)),
           "info": _common_info(torch, ga, rank), "world": world}
    barrier()
    graphs.clear()
    dist.destroy_process_group()
    return res


CHILDREN = {"ddp": child_ddp, "tp": child_tp}
