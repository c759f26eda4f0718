"""Two GPUs of one host (nvidia-h200-x2), as a user would try them with gpu-arena.

One process, two devices (gpu_arena.torch.install()):
  - an arena made on cuda:0 BEFORE cuda:1 is first used, then tensors on cuda:1;
  - copies cuda:0 -> cuda:1 and back (`.to()`, `copy_`), bytes checked, both directions;
  - a kernel on cuda:1 reading cuda:0 memory through peer access (torch's add of two
    tensors on different devices is not allowed, so the check is a peer copy inside a
    matmul-sized workload: each element verified);
  - stats per device.
Two processes: a producer on GPU 0 shares a tensor (gpu_arena.share), a consumer whose
current device is GPU 1 opens it, copies it to cuda:1 and back into it (peer copies through
the imported mapping), and the producer sees the consumer's write.

Prints one RESULT line per check and a JSON summary; exit 1 if any check failed.
Usage: python3 tests/gpu/gpu_two_gpus.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time

MIB = 1 << 20


def one_process() -> dict:
    import torch

    import gpu_arena
    import gpu_arena.torch as gt

    gt.install()
    res = {}
    n = 64 * MIB
    a0 = torch.arange(n // 4, dtype=torch.int32, device="cuda:0")  # arena on GPU 0 first
    res["device_count"] = torch.cuda.device_count()
    b1 = torch.full((n // 4,), 7, dtype=torch.int32, device="cuda:1")  # GPU 1 used now
    moved = a0.to("cuda:1")
    res["to_cuda1"] = bool(torch.equal(moved.cpu(), a0.cpu()))
    back = (b1 * 3).to("cuda:0")
    res["to_cuda0"] = bool((back == 21).all().item())
    c0 = torch.empty_like(a0)
    c0.copy_(b1)
    res["copy_1_to_0"] = bool((c0 == 7).all().item())
    d1 = torch.empty_like(b1)
    d1.copy_(a0)
    torch.cuda.synchronize(1)
    res["copy_0_to_1"] = bool(torch.equal(d1.cpu(), a0.cpu()))
    # A big transfer both ways: timing of the peer copy over NVLink.
    big0 = torch.ones(1 << 30, dtype=torch.uint8, device="cuda:0")
    big1 = torch.empty(1 << 30, dtype=torch.uint8, device="cuda:1")
    big1.copy_(big0)
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    t0 = time.perf_counter()
    for _ in range(5):
        big1.copy_(big0)
    torch.cuda.synchronize(1)
    res["peer_copy_gbps"] = round(5 * (1 << 30) / (time.perf_counter() - t0) / 1e9, 1)
    res["big_ok"] = bool((big1 == 1).all().item())
    s0, s1 = gpu_arena.stats(0), gpu_arena.stats(1)
    res["stats"] = {"dev0_reserved": s0["reserved_bytes"], "dev1_reserved": s1["reserved_bytes"],
                    "dev0_arenas": s0["arenas"], "dev1_arenas": s1["arenas"]}
    res["stats_per_device"] = s0["reserved_bytes"] > 0 and s1["reserved_bytes"] > 0
    res["ok"] = all(res[k] for k in ("to_cuda1", "to_cuda0", "copy_1_to_0", "copy_0_to_1",
                                     "big_ok", "stats_per_device"))
    return res


def _producer(q_out, q_in):
    import torch

    import gpu_arena
    import gpu_arena.torch as gt

    gt.install()
    t = torch.arange(16 * MIB // 4, dtype=torch.int32, device="cuda:0")
    torch.cuda.synchronize()
    s = gpu_arena.share(t)
    q_out.put(s.to_bytes())
    q_in.get()  # the consumer wrote -1 into element 0 and closed
    torch.cuda.synchronize()
    q_out.put(int(t[0].item()))
    s.close()


def _consumer(q_in, q_out):
    import torch

    import gpu_arena
    from gpu_arena.tensors import Share

    torch.cuda.set_device(1)
    t = gpu_arena.open(Share.from_bytes(q_in.get()))  # GPU 0's memory, mapped here
    res = {"imported_device": str(t.device)}
    local = t.to("cuda:1")  # a peer copy from the imported mapping
    expect = torch.arange(t.numel(), dtype=torch.int32, device="cuda:1")
    res["read_ok"] = bool(torch.equal(local, expect))
    one = torch.full((1,), -1, dtype=torch.int32, device="cuda:1")
    t[:1].copy_(one)  # a peer copy into the imported mapping
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    gpu_arena.close(t)
    del t
    q_out.put(res)


def two_processes() -> dict:
    ctx = mp.get_context("spawn")
    to_cons, to_prod, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    prod = ctx.Process(target=_producer, args=(to_cons, to_prod))
    prod.start()
    handle = to_cons.get(timeout=120)
    cons_in = ctx.Queue()
    cons = ctx.Process(target=_consumer, args=(cons_in, results))
    cons.start()
    cons_in.put(handle)
    res = results.get(timeout=120)
    cons.join(60)
    to_prod.put("done")
    res["producer_sees_write"] = to_cons.get(timeout=60) == -1
    prod.join(60)
    res["ok"] = bool(res.get("read_ok") and res["producer_sees_write"]
                     and prod.exitcode == 0 and cons.exitcode == 0)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    a = ap.parse_args()
    out = {}
    for name, fn in [("one_process", None), ("two_processes", two_processes)]:
        try:
            if fn is None:
                ctx = mp.get_context("spawn")
                with ctx.Pool(1) as pool:  # fresh process: install() before CUDA init
                    out[name] = pool.apply(one_process)
            else:
                out[name] = fn()
        except Exception as e:  # noqa: BLE001 - reported, and the exit code says it
            out[name] = {"ok": False, "error": repr(e)}
        print("RESULT " + name + " " + json.dumps(out[name]), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if all(v.get("ok") for v in out.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
