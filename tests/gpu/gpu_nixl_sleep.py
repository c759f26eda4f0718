"""A registered KV cache that sleeps and wakes between NIXL transfers (backend GPU_ARENA), on
the GPU: a producer process allocates LAYERS x LAYER_GIB KV tensors under tag ``kv``, fills
them and registers them with NIXL's GPU_ARENA; a consumer process READs two whole layers and
2 MiB blocks and verifies them; the producer puts ``kv`` to sleep with its contents offloaded
(its registrations' shares end first: the consumer's mappings close and the arenas really
sleep), the consumer's READ is refused while it sleeps, the producer wakes, and the
consumer's READ works again with no metadata exchanged (it asks the producer for the
registration again) and verifies; CYCLES times, then the usual shutdown.

Usage (GPU machine, NIXL installed, GPU_ARENA_LIB / PYTHONPATH as scripts/gpu-nixl.sh sets):
  python3 tests/gpu/gpu_nixl_sleep.py [--layers 8 --layer-gib 1.5 --cycles 3] --out DIR
Prints one JSON line (also DIR/nixl-sleep.json).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import gpu_common  # noqa: F401  (the checkout's python/ on the path)

GIB, MIB, BLOCK = 1 << 30, 1 << 20, 2 << 20
PLUGIN = ["GPU_ARENA"]


def publish(work, name, obj):
    path = os.path.join(work, name)
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.rename(path + ".tmp", path)


def wait_file(work, name, seconds=300):
    path = os.path.join(work, name)
    deadline = time.time() + seconds
    while not os.path.exists(path):
        if time.time() > deadline:
            raise SystemExit(f"timed out waiting for {name}")
        time.sleep(0.005)
    with open(path) as f:
        return json.load(f)


def agent(name):
    import gpu_arena.nixl_backend as nb
    from gpu_arena.nixl import import_nixl

    nb.enable()
    api = import_nixl()
    return api.nixl_agent(name, api.nixl_agent_config(backends=PLUGIN))


def producer(a):
    import gpu_arena
    import gpu_arena.torch as gt

    gt.install()
    import torch

    torch.empty(1, device="cuda")
    ag = agent("producer")
    layer = int(a.layer_gib * GIB)
    gpu_arena.set_tag("kv")
    kv = [torch.empty(layer, dtype=torch.uint8, device="cuda") for _ in range(a.layers)]
    gpu_arena.set_tag(None)
    for i, t in enumerate(kv):
        t.fill_((i * 29 + 7) % 251)
    del t  # the loop's last tensor: it would outlive `del kv`
    torch.cuda.synchronize()
    reg = ag.register_memory([(t.data_ptr(), layer, 0, "") for t in kv], "VRAM", backends=PLUGIN)
    publish(a.work, "meta", {"ranges": [(t.data_ptr(), layer, 0) for t in kv],
                             "metadata": ag.get_agent_metadata().hex()})
    cycles = []
    for c in range(a.cycles):
        wait_file(a.work, f"read-{c}")
        free0 = torch.cuda.mem_get_info()[0]
        t0 = time.perf_counter()
        gt.sleep(offload_tags=["kv"], tags=["kv"])
        sleep_s = time.perf_counter() - t0
        free_asleep = torch.cuda.mem_get_info()[0]
        publish(a.work, f"asleep-{c}", {})
        wait_file(a.work, f"tried-{c}")
        t0 = time.perf_counter()
        gt.wake(["kv"])
        wake_s = time.perf_counter() - t0
        cycles.append(dict(cycle=c, sleep_s=round(sleep_s, 3), wake_s=round(wake_s, 3),
                           freed_gib=round((free_asleep - free0) / GIB, 3)))
        publish(a.work, f"awake-{c}", {})
    wait_file(a.work, "consumer-done")
    ag.deregister_memory(reg, backends=PLUGIN)
    del kv
    gt.empty_cache()
    publish(a.work, "producer-result", {"cycles": cycles, "reserved_after": gpu_arena.stats(0)["reserved_bytes"]})


def consumer(a):
    import gpu_arena
    import gpu_arena.torch as gt

    gt.install()
    import torch
    from gpu_arena.nixl import remote_descs, wait

    ag = agent("consumer")
    layer = int(a.layer_gib * GIB)
    dst = torch.empty(2 * layer + 64 * BLOCK, dtype=torch.uint8, device="cuda")
    own = ag.register_memory([(dst.data_ptr(), dst.numel(), 0, "")], "VRAM", backends=PLUGIN)
    meta = wait_file(a.work, "meta")
    peer = ag.add_remote_agent(bytes.fromhex(meta["metadata"]))
    ranges = meta["ranges"]
    base = dst.data_ptr()
    remote = [tuple(r) for r in ranges[:2]] + [(ranges[i % len(ranges)][0] + (i // len(ranges)) * BLOCK, BLOCK, 0)
                                               for i in range(64)]
    local = [(base, layer, 0), (base + layer, layer, 0)] + [(base + 2 * layer + i * BLOCK, BLOCK, 0) for i in range(64)]
    expect = [(i * 29 + 7) % 251 for i in range(len(ranges))]

    def read():
        h = ag.initialize_xfer("READ", ag.get_xfer_descs(local, "VRAM"), remote_descs(ag, remote, "VRAM"), peer,
                               backends=PLUGIN)
        t0 = time.perf_counter()
        ag.transfer(h)
        wait(ag, h, timeout=120)
        dt = time.perf_counter() - t0
        ag.release_xfer_handle(h)
        dst_cpu_ok = all(bool((dst[i * layer:(i + 1) * layer] == expect[i]).all()) for i in range(2))
        blocks = dst[2 * layer:].view(64, BLOCK)
        want = torch.tensor([expect[i % len(ranges)] for i in range(64)], dtype=torch.uint8, device="cuda")
        ok = dst_cpu_ok and bool((blocks == want.unsqueeze(1)).all())
        dst.zero_()
        torch.cuda.synchronize()
        return ok, round((2 * layer + 64 * BLOCK) / dt / 1e9, 1)

    results = []
    for c in range(a.cycles):
        ok, gbps = read()
        publish(a.work, f"read-{c}", {})
        wait_file(a.work, f"asleep-{c}")
        try:
            read()
            asleep = "accepted"
        except Exception as e:  # noqa: BLE001 - NIXL raises its own types
            asleep = f"{type(e).__name__}: {gpu_arena._lib.last_error()}"
        imports_asleep = gpu_arena.imports_live()
        publish(a.work, f"tried-{c}", {})
        wait_file(a.work, f"awake-{c}")
        ok_after, gbps_after = read()
        results.append(dict(cycle=c, verified_before=ok, gbps_before=gbps, read_asleep=asleep[:200],
                            imports_while_asleep=imports_asleep, verified_after_wake=ok_after,
                            gbps_after=gbps_after))
    publish(a.work, "consumer-done", {})
    ag.remove_remote_agent(peer)
    ag.deregister_memory(own, backends=PLUGIN)
    publish(a.work, "consumer-result", {"cycles": results})


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", choices=["producer", "consumer"])
    ap.add_argument("--work")
    ap.add_argument("--out", default=gpu_common.out_path("nixl"))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--layer-gib", type=float, default=1.5)
    ap.add_argument("--cycles", type=int, default=3)
    a = ap.parse_args()
    if a.role == "producer":
        return producer(a)
    if a.role == "consumer":
        return consumer(a)
    os.makedirs(a.out, exist_ok=True)
    work = os.path.join(a.out, "work-sleep")
    os.makedirs(work, exist_ok=True)
    for f in os.listdir(work):
        os.unlink(os.path.join(work, f))
    args = ["--work", work, "--layers", str(a.layers), "--layer-gib", str(a.layer_gib), "--cycles", str(a.cycles)]
    logs = [open(os.path.join(a.out, f"sleep.{r}.log"), "w") for r in ("producer", "consumer")]
    procs = [subprocess.Popen([sys.executable, __file__, "--role", r] + args, env=gpu_common.child_env(),
                              stdout=log, stderr=subprocess.STDOUT) for r, log in zip(("producer", "consumer"), logs)]
    rc = [p.wait(timeout=600) for p in procs]
    res = {"exit": rc, "layers": a.layers, "layer_gib": a.layer_gib}
    for name in ("producer-result", "consumer-result"):
        path = os.path.join(work, name)
        res[name.split("-")[0]] = json.load(open(path)) if os.path.exists(path) else None
    with open(os.path.join(a.out, "nixl-sleep.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res))
    cons = (res.get("consumer") or {}).get("cycles", [])
    ok = rc == [0, 0] and cons and all(c["verified_before"] and c["verified_after_wake"] and c["read_asleep"] != "accepted"
                                       for c in cons)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
