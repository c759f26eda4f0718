"""The prefill and decode roles of gpu_multi_gpu.py's NIXL checks (``nixl``, ``seed``), run
through multi_gpu_children.py (``python3 tests/gpu/multi_gpu_children.py prefill|decode RESULT
PARAMS``): one prefill process per GPU i (the producer) and one decode process per GPU j (the
consumer), both with gpu_arena.torch.install() and NIXL's backend GPU_ARENA
(gpu_arena.nixl_backend; the agent helper of gpu_nixl_kv.py's plugin flow). gpu_nixl_kv.py's
producer always sits on GPU 0, so these are the same flow with a device per role.

Cycle c has a shift k: decode j reads from prefill (j - k) % N (k = 0 on one GPU: the pair
(0, 0)). The cycles run in lock step over files in the work folder:
  1. prefill i: LAYERS x LAYER_BYTES of KV on GPU i, filled, registered with GPU_ARENA -> meta-i-c
  2. decode j: the same-run copies (GPU j device copy; GPU i -> GPU j peer copy of its own
     buffer on GPU i), then NIXL READs of 2 MiB blocks over every layer and of two whole
     layers, every byte verified, temporaries freed -> pulled-j-c
  3. prefill i (every decode done): deregister (revocation: each consumer finishes its copies
     and closes its mappings), free, empty_cache; free memory of GPU i against its baseline
     with every decode alive -> released-i-c
  4. decode j (every prefill released): the mappings it had (imports_live), a READ after the
     revocation (must be refused), free memory of GPU j against its baseline with every
     prefill alive -> checked-j-c
A warm cycle with tiny layers runs first; the baselines are read after it, by every process
before any allocates cycle 0's KV."""

from __future__ import annotations

import os
import time

from multi_gpu_children import _alive, free_mem, publish, wait_all
from torch_native_common import setup

MiB, GiB = 1 << 20, 1 << 30
BLOCK = 2 * MiB
PLUGIN = ["GPU_ARENA"]


def _cycles(p):
    """[(id, shift, layers, layer_bytes, blocks)]: the warm cycle, then the measured ones."""
    out = [("w", p["shifts"][0], 2, 8 * MiB, 4)]
    return out + [(c, k, p["layers"], p["layer_bytes"], p["blocks"]) for c, k in enumerate(p["shifts"])]


def _value(cid, dev, layer):
    return (250 if cid == "w" else (cid * 37 + dev * 11 + layer) % 250)


def _start(p):
    torch, ga = setup("native")
    import gpu_arena.torch as gt
    from gpu_nixl_kv import nixl_agent_class

    dev = p["dev"]
    torch.cuda.set_device(dev)
    torch.empty(1, device=f"cuda:{dev}")
    return torch, ga, gt, nixl_agent_class("plugin"), dev


def child_prefill(p):
    torch, ga, gt, Agent, i = _start(p)
    n, work, tmo = p["n"], p["work"], p["timeout"]
    w = torch.empty(MiB, dtype=torch.uint8, device=f"cuda:{i}")
    w.fill_(1)  # the fill kernel loaded before the baseline
    del w
    warm_agent = Agent(f"prefill-{i}-warmup")
    del warm_agent
    gt.empty_cache()
    publish(work, f"up-p{i}", {"pid": os.getpid()})
    ups = wait_all(work, [f"up-{r}{d}" for r in "pd" for d in range(n)], tmo)
    peers = [v["pid"] for k, v in ups.items() if k.startswith("up-d")]
    base, recs = None, []
    for cid, k, layers, lbytes, _blocks in _cycles(p):
        if cid == 0:  # every process reads its baseline before anyone allocates cycle 0
            base = free_mem(torch, i)
            publish(work, f"base-p{i}", {})
            wait_all(work, [f"base-{r}{d}" for r in "pd" for d in range(n)], tmo)
        t_start = time.perf_counter()
        agent = Agent(f"prefill-{i}-{cid}")
        kv = [torch.empty(lbytes, dtype=torch.uint8, device=f"cuda:{i}") for _ in range(layers)]
        for layer, t in enumerate(kv):
            t.fill_(_value(cid, i, layer))
        t = None
        torch.cuda.synchronize(i)
        t0 = time.perf_counter()
        reg = agent.register_memory([(t.data_ptr(), lbytes, i, "") for t in kv], "VRAM", backends=PLUGIN)
        reg_s = time.perf_counter() - t0
        exports = ga.stats(i)["exports_live"]
        publish(work, f"meta-{i}-{cid}", {"ranges": [(t.data_ptr(), lbytes, i) for t in kv],
                                           "metadata": agent.get_agent_metadata().hex()})
        wait_all(work, [f"pulled-{j}-{cid}" for j in range(n)], tmo)
        t0 = time.perf_counter()
        agent.deregister_memory(reg, backends=PLUGIN)  # revocation: every consumer closes its mappings
        revoke_s = time.perf_counter() - t0
        kv = None
        gt.empty_cache()
        del agent
        torch.cuda.synchronize(i)
        time.sleep(0.2)  # the driver frees asynchronously on some paths
        free_after = free_mem(torch, i)
        st = ga.stats(i)
        rec = {"cycle": cid, "shift": k, "consumer": (i + k) % n, "layers": layers, "layer_bytes": lbytes,
               "exports": exports, "reg_ms": round(reg_s * 1e3, 3), "revoke_ms": round(revoke_s * 1e3, 3),
               "reserved_after": st["reserved_bytes"], "exports_after": st["exports_live"],
               "decoders_alive": all(_alive(pid) for pid in peers), "cycle_s": round(time.perf_counter() - t_start, 2)}
        if cid != "w":
            rec["leaked"] = base - free_after
        recs.append(rec)
        publish(work, f"released-{i}-{cid}", {})
        wait_all(work, [f"checked-{j}-{cid}" for j in range(n)], tmo)
    return {"dev": i, "base_free": base, "cycles": recs}


def child_decode(p):
    torch, ga, gt, Agent, j = _start(p)
    from gpu_arena.nixl import remote_descs, wait

    n, work, tmo = p["n"], p["work"], p["timeout"]
    cycles = _cycles(p)
    lb_max = max(c[3] for c in cycles)
    nblk = max(c[4] for c in cycles)
    dj = f"cuda:{j}"
    dst_layers = torch.empty(2 * lb_max, dtype=torch.uint8, device=dj)
    dst_blocks = torch.empty(nblk * BLOCK, dtype=torch.uint8, device=dj)
    # The peer-copy baseline's sources: this process's own memory on each GPU it reads from.
    src = {i: torch.empty(lb_max, dtype=torch.uint8, device=f"cuda:{i}")
           for i in sorted({(j - c[1]) % n for c in cycles})}
    agent = Agent(f"decode-{j}")
    own = agent.register_memory([(dst_layers.data_ptr(), dst_layers.numel(), j, ""),
                                 (dst_blocks.data_ptr(), dst_blocks.numel(), j, "")], "VRAM", backends=PLUGIN)
    for i, s in src.items():  # the copies and checks below, loaded before the baseline
        dst_layers[:MiB].copy_(s[:MiB])
        dst_layers[MiB:2 * MiB].copy_(dst_layers[:MiB])
        v = dst_blocks[:4 * BLOCK].view(4, BLOCK)
        bool((v == torch.tensor([1, 2, 3, 4], dtype=torch.uint8, device=dj).unsqueeze(1)).all())
        bool((dst_layers[:MiB] == 3).all())
    torch.cuda.synchronize()
    publish(work, f"up-d{j}", {"pid": os.getpid()})
    ups = wait_all(work, [f"up-{r}{d}" for r in "pd" for d in range(n)], tmo)
    producers = [v["pid"] for k, v in ups.items() if k.startswith("up-p")]

    def copy_gbps(dst, s):
        dst.copy_(s)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(3):
            dst.copy_(s)
        torch.cuda.synchronize()
        return round(3 * s.numel() / (time.perf_counter() - t0) / 1e9, 1)

    def read(local, remote, peer):
        h = agent.initialize_xfer("READ", agent.get_xfer_descs(local, "VRAM"), remote_descs(agent, remote, "VRAM"),
                                  peer, backends=PLUGIN)
        t0 = time.perf_counter()
        agent.transfer(h)
        wait(agent, h, timeout=tmo)
        dt = time.perf_counter() - t0
        agent.release_xfer_handle(h)
        return dt

    base, recs = None, []
    for cid, k, layers, lbytes, blocks in cycles:
        if cid == 0:
            base = free_mem(torch, j)
            publish(work, f"base-d{j}", {})
            wait_all(work, [f"base-{r}{d}" for r in "pd" for d in range(n)], tmo)
        i = (j - k) % n
        meta = wait_all(work, [f"meta-{i}-{cid}"], tmo)[f"meta-{i}-{cid}"]
        peer = agent.add_remote_agent(bytes.fromhex(meta["metadata"]))
        ranges = meta["ranges"]
        r = {"cycle": cid, "producer": i, "consumer": j,
             "copy_gbps": copy_gbps(dst_layers[:lbytes], dst_layers[lbytes:2 * lbytes]),
             "peer_copy_gbps": copy_gbps(dst_layers[:lbytes], src[i][:lbytes])}
        per_layer = max(1, blocks // len(ranges))
        rblocks, expect = [], []
        for li, (addr, length, rdev) in enumerate(ranges):
            step = length // per_layer
            for q in range(per_layer):
                if len(rblocks) < blocks:
                    rblocks.append((addr + q * step - (q * step) % BLOCK, BLOCK, rdev))
                    expect.append(_value(cid, i, li))
        lblocks = [(dst_blocks.data_ptr() + q * BLOCK, BLOCK, j) for q in range(len(rblocks))]
        read(lblocks, rblocks, peer)  # connection and mappings
        r["blocks"] = len(rblocks)
        r["blocks_gbps"] = round(len(rblocks) * BLOCK / read(lblocks, rblocks, peer) / 1e9, 1)
        view = dst_blocks[:len(rblocks) * BLOCK].view(len(rblocks), BLOCK)
        want = torch.tensor(expect, dtype=torch.uint8, device=dj).unsqueeze(1)
        ok_blocks = bool((view == want).all())
        lay = [tuple(x) for x in ranges[:2]]
        llay = [(dst_layers.data_ptr() + q * lbytes, lbytes, j) for q in range(len(lay))]
        r["layers_read"] = len(lay)
        r["layers_gbps"] = round(len(lay) * lbytes / read(llay, lay, peer) / 1e9, 1)
        ok_layers = all(bool((dst_layers[q * lbytes:(q + 1) * lbytes] == _value(cid, i, q)).all())
                        for q in range(len(lay)))
        r["verified"] = ok_blocks and ok_layers
        r["imports_while_registered"] = ga.imports_live()
        view = want = None
        gt.empty_cache()  # the checks' temporaries back before anyone measures
        publish(work, f"pulled-{j}-{cid}", {})
        wait_all(work, [f"released-{q}-{cid}" for q in range(n)], tmo)
        r["imports_after_revocation"] = ga.imports_live()
        try:
            read(lblocks[:1], rblocks[:1], peer)
            r["read_after_revocation"] = "accepted"
        except Exception as e:  # noqa: BLE001 - NIXL raises its own types
            r["read_after_revocation"] = f"refused: {type(e).__name__}: {str(e)[:200]}"
        agent.remove_remote_agent(peer)
        time.sleep(0.05)
        if cid != "w":
            r["leaked"] = base - free_mem(torch, j)
        r["prefills_alive"] = all(_alive(pid) for pid in producers)
        recs.append(r)
        publish(work, f"checked-{j}-{cid}", {})
    agent.deregister_memory(own, backends=PLUGIN)
    return {"dev": j, "base_free": base, "cycles": recs}


CHILDREN = {"prefill": child_prefill, "decode": child_decode}
