"""The seed, end to end on the GPU: a vLLM-shaped producer (LAYERS x LAYER_GIB KV tensors)
shares its KV cache with NIXL, a consumer process pulls KV blocks and whole layers with NIXL
READ, the producer shuts its engine down in-process, and device free memory is checked
against the baseline with both processes alive; CYCLES times.

Producer flows (--flow):
  arena   gpu_arena.torch.install() + gpu_arena.nixl.attach(agent): one registration per arena;
          shutdown = detach, free, empty_cache.
  naive   PyTorch's allocator, each KV tensor registered with NIXL on its own; shutdown =
          deregister each, free, torch.cuda.empty_cache().
  plugin  gpu_arena.torch.install() and NIXL's backend GPU_ARENA (gpu_arena.nixl_backend) in
          both processes, each KV tensor registered with it (one export per arena); the
          consumer keeps the producer's metadata loaded through the shutdown (deregister
          revokes its mappings), then checks that a READ is refused; no UCX variable matters.
The consumer uses PyTorch's allocator for its destination buffer in the arena and naive flows.

Each cycle reports: data verified, transfer bandwidth of 2 MiB blocks and of whole layers
against a device-to-device copy measured in the same consumer (the copy ceiling; on another
GPU, a peer copy), registrations and their time, which UCX transport moved the bytes (parsed
from UCX_PROTO_INFO=y, not assumed), and "leaked" = baseline free - free after shutdown.
--kill: the consumer is SIGKILLed in the middle of a transfer; the producer then shuts down.
--kill-producer: the producer is SIGKILLed in the middle of the consumer's layer READ; the
consumer finishes it, closes its mappings and measures free memory against the baseline.

Usage (GPU machine, NIXL installed, GPU_ARENA_LIB / PYTHONPATH set as scripts/gpu-check.sh does):
  python3 tests/gpu/gpu_nixl_kv.py --flow arena --out DIR [--layers 32 --layer-gib 1.5]
      [--cycles 10] [--consumer-device 0] [--kill] [--conf legacy_ipc=1]
Environment for the UCX side goes through as it is (UCX_CUDA_IPC_ENABLE_GET_ZCOPY, UCX_TLS...).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

GIB = 1 << 30
MIB = 1 << 20
BLOCK = 2 * MIB


def now():
    return time.perf_counter()


def publish(path, obj):
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.rename(path + ".tmp", path)


def wait_file(path, seconds, alive=None):
    deadline = time.time() + seconds
    while not os.path.exists(path):
        if time.time() > deadline:
            raise SystemExit(f"timed out waiting for {os.path.basename(path)}")
        if alive is not None and alive.poll() is not None:
            raise SystemExit(f"peer exited ({alive.returncode}) before {os.path.basename(path)}")
        time.sleep(0.005)
    with open(path) as f:
        return json.load(f)


def process_memory_mib():
    """Device memory used per process (pid -> MiB), as nvidia-smi attributes it."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=30).stdout
        used = {}
        for line in out.splitlines():
            if "," in line:  # one line per (process, GPU): add a process's GPUs up
                pid, mib = line.split(",")
                used[int(pid)] = used.get(int(pid), 0) + int(mib)
        return used
    except (OSError, ValueError, subprocess.SubprocessError):
        return {}


def nixl_agent_class(flow="arena"):
    """NIXL's agent class; for the plugin flow, agents made with the GPU_ARENA backend
    (NIXL_PLUGIN_DIR set first: NIXL reads it once)."""
    from gpu_arena.nixl import import_nixl

    if flow != "plugin":
        return import_nixl().nixl_agent
    import gpu_arena.nixl_backend as nb

    nb.enable()
    api = import_nixl()
    return lambda name: api.nixl_agent(name, api.nixl_agent_config(backends=["GPU_ARENA"]))


PLUGIN = ["GPU_ARENA"]


# ---------------------------------------------------------------------------------------
# producer
# ---------------------------------------------------------------------------------------
def producer(a):
    import torch

    if a.flow in ("arena", "plugin"):
        import gpu_arena
        import gpu_arena.nixl as gn
        import gpu_arena.torch as gt

        if a.conf:
            gpu_arena.configure(a.conf)
        gt.install()
    torch.cuda.set_device(0)
    torch.empty(1, device="cuda")  # the context (and the allocator) before the baseline
    torch.cuda.synchronize()
    Agent = nixl_agent_class(a.flow)
    # One-time state before the baseline, the same in every flow: the fill kernel's module
    # (CUDA loads modules lazily, into device memory) and a first NIXL agent's.
    warm = torch.empty(MIB, dtype=torch.uint8, device="cuda")
    warm.fill_(1)
    torch.cuda.synchronize()
    del warm
    del_agent = Agent("producer-warmup")
    del del_agent
    if a.flow in ("arena", "plugin"):
        gt.empty_cache()
    else:
        torch.cuda.empty_cache()
    work = a.work
    cycles = []
    publish(f"{work}/producer-up", {})
    # The baseline: both processes up, the consumer's buffers allocated.
    consumer_pid = wait_file(f"{work}/consumer-up", a.timeout)["pid"]
    baseline = torch.cuda.mem_get_info()[0]
    at_baseline = process_memory_mib()
    producer_mib_baseline = at_baseline.get(os.getpid())
    consumer_mib_baseline = at_baseline.get(consumer_pid)
    layer_bytes = int(a.layer_gib * GIB)
    for cycle in range(a.cycles):
        t_start = now()
        agent = Agent(f"producer-{cycle}")
        reg_s, regs, registrations = 0.0, [], 0
        if a.flow == "arena":
            registrar = gn.attach(agent)
        kv = [torch.empty(layer_bytes, dtype=torch.uint8, device="cuda") for _ in range(a.layers)]
        for layer, t in enumerate(kv):
            t.fill_((cycle * 37 + layer) % 251)
        del t
        torch.cuda.synchronize()
        if a.flow == "arena":
            registrations = registrar.registrations
            reg_s = registrar.register_seconds
            ranges = [registrar.ranges(t)[0] for t in kv]
        elif a.flow == "plugin":
            t0 = now()
            regs.append(agent.register_memory([(t.data_ptr(), layer_bytes, 0, "") for t in kv],
                                              "VRAM", backends=PLUGIN))
            reg_s = now() - t0
            registrations = len(kv)
            ranges = [(t.data_ptr(), layer_bytes, 0) for t in kv]
        else:
            for layer in range(len(kv)):
                t0 = now()
                regs.append(agent.register_memory(kv[layer]))
                reg_s += now() - t0
            registrations = len(regs)
            ranges = [(t.data_ptr(), layer_bytes, 0) for t in kv]
        publish(f"{work}/meta-{cycle}", {"ranges": ranges, "metadata": agent.get_agent_metadata().hex(),
                                         "name": f"producer-{cycle}"})
        peer = wait_file(f"{work}/pulled-{cycle}", a.timeout)
        # Engine shutdown, in-process.
        t0 = now()
        exports = gpu_arena.stats(0)["exports_live"] if a.flow == "plugin" else None
        if a.flow == "arena":
            registrar.detach()
            left = registrar.registrations
        else:
            for r in regs:
                agent.deregister_memory(r, backends=PLUGIN) if a.flow == "plugin" else agent.deregister_memory(r)
            left = 0
        del kv
        if a.flow in ("arena", "plugin"):
            gt.empty_cache()
            stats = gpu_arena.stats(0)
        else:
            torch.cuda.empty_cache()
            stats = {"reserved_bytes": torch.cuda.memory_reserved()}
        del agent
        torch.cuda.synchronize()
        shutdown_s = now() - t0
        time.sleep(0.2)  # the driver frees asynchronously on some paths
        free_after = torch.cuda.mem_get_info()[0]
        per_process = process_memory_mib()
        consumer_mib = per_process.get(consumer_pid)
        consumer_growth = (consumer_mib - consumer_mib_baseline) * MIB if consumer_mib and consumer_mib_baseline else 0
        rec = dict(producer_mib_baseline=producer_mib_baseline, producer_mib=per_process.get(os.getpid()),
                   consumer_mib_baseline=consumer_mib_baseline,
                   # What the device lost that is not the consumer's own growth (its UCX
                   # buffers) -- the producer's leak, as far as nvidia-smi can attribute it.
                   leaked_not_consumer_gib=round((baseline - free_after - consumer_growth) / GIB, 3), consumer_mib=consumer_mib,
                   cycle=cycle, registrations=registrations, exports=exports,
                   reg_ms_total=round(reg_s * 1e3, 3),
                   reg_ms_each=round(reg_s * 1e3 / max(registrations, 1), 3),
                   registrations_left=left, reserved_after=stats["reserved_bytes"],
                   leaked_gib=round((baseline - free_after) / GIB, 3),
                   shutdown_s=round(shutdown_s, 3), cycle_s=round(now() - t_start, 2), **peer)
        cycles.append(rec)
        print("CYCLE " + json.dumps(rec), flush=True)
        publish(f"{work}/released-{cycle}", {"leaked_gib": rec["leaked_gib"]})
    publish(f"{work}/producer-result", {"cycles": cycles, "baseline_free": baseline})


# ---------------------------------------------------------------------------------------
# consumer
# ---------------------------------------------------------------------------------------
def consumer(a):
    import torch

    import gpu_arena.nixl as gn

    plugin = a.flow == "plugin"
    dev = a.consumer_device
    if plugin:  # GPU_ARENA registers gpu-arena memory only: the consumer's too
        import gpu_arena
        import gpu_arena.torch as gt

        gt.install()
    torch.cuda.set_device(dev)
    Agent = nixl_agent_class(a.flow)
    layer_bytes = int(a.layer_gib * GIB)
    n_blocks = a.blocks
    dst_layers = torch.empty(2 * layer_bytes, dtype=torch.uint8, device=f"cuda:{dev}")
    dst_blocks = torch.empty(n_blocks * BLOCK, dtype=torch.uint8, device=f"cuda:{dev}")
    agent = Agent("consumer")
    if plugin:
        local_reg = agent.register_memory(
            [(t.data_ptr(), t.numel(), dev, "") for t in (dst_layers, dst_blocks)], "VRAM",
            backends=PLUGIN)
    else:
        local_reg = agent.register_memory([dst_layers, dst_blocks])
    opts = {"backends": PLUGIN} if plugin else {}
    after = []  # per cycle (plugin): what a READ did after the producer's shutdown
    # The copy ceiling, same run: device-to-device on the consumer's GPU, and from GPU 0's
    # memory when the consumer is on another GPU (a peer copy).
    def copy_gbps(dst, src):
        dst.copy_(src)  # warm
        torch.cuda.synchronize()
        t0 = now()
        for _ in range(3):
            dst.copy_(src)
        torch.cuda.synchronize()
        return round(3 * src.numel() / (now() - t0) / 1e9, 1)

    first, second = dst_layers[:layer_bytes], dst_layers[layer_bytes:]
    ceiling = {"copy_gbps": copy_gbps(first, second)}
    if dev != 0:
        src = torch.empty(layer_bytes, dtype=torch.uint8, device="cuda:0")
        ceiling["peer_copy_gbps"] = copy_gbps(first, src)
        del src
        torch.cuda.empty_cache()
    torch.cuda.synchronize()
    baseline_free = torch.cuda.mem_get_info()[0]
    publish(f"{a.work}/consumer-up", dict(ceiling, pid=os.getpid()))
    for cycle in range(a.cycles):
        meta = wait_file(f"{a.work}/meta-{cycle}", a.timeout)
        peer = agent.add_remote_agent(bytes.fromhex(meta["metadata"]))
        ranges = meta["ranges"]
        res = dict(ceiling)

        def read(local_list, remote_list, what):
            local = agent.get_xfer_descs(local_list, "VRAM")
            remote = gn.remote_descs(agent, remote_list, "VRAM")
            h = agent.initialize_xfer("READ", local, remote, peer, **opts)
            t0 = now()
            agent.transfer(h)
            if a.kill and cycle == 0 and what == "layers":
                publish(f"{a.work}/transfer-started", {})
                time.sleep(3600)  # SIGKILLed here
            gn.wait(agent, h, timeout=a.timeout)
            if a.kill_producer and what == "layers":
                # The producer is SIGKILLed while these READs repeat: each must complete.
                publish(f"{a.work}/transfer-started", {})
                for _ in range(400):
                    agent.transfer(h)
                    gn.wait(agent, h, timeout=a.timeout)
            dt = now() - t0
            agent.release_xfer_handle(h)
            return dt

        # 2 MiB blocks: n_blocks spread over every layer.
        per_layer = max(1, n_blocks // len(ranges))
        remote_blocks, expect = [], []
        for li, (addr, length, rdev) in enumerate(ranges):
            step = length // per_layer
            for k in range(per_layer):
                if len(remote_blocks) < n_blocks:
                    remote_blocks.append((addr + k * step - (k * step) % BLOCK, BLOCK, rdev))
                    expect.append((cycle * 37 + li) % 251)
        local_blocks = [(dst_blocks.data_ptr() + i * BLOCK, BLOCK, dev) for i in range(len(remote_blocks))]
        read(local_blocks, remote_blocks, "warm")  # connection and mappings
        dt = read(local_blocks, remote_blocks, "blocks")
        res["blocks"] = len(remote_blocks)
        res["blocks_gbps"] = round(len(remote_blocks) * BLOCK / dt / 1e9, 2)
        view = dst_blocks[: len(remote_blocks) * BLOCK].view(len(remote_blocks), BLOCK)
        want = torch.tensor(expect, dtype=torch.uint8, device=view.device).unsqueeze(1)
        ok_blocks = bool((view == want).all().item())
        # Whole layers: the first two.
        lay = [(addr, length, rdev) for addr, length, rdev in ranges[:2]]
        local_lay = [(dst_layers.data_ptr() + i * layer_bytes, layer_bytes, dev) for i in range(len(lay))]
        dt = read(local_lay, lay, "layers")
        res["layers_gbps"] = round(len(lay) * layer_bytes / dt / 1e9, 2)
        ok_layers = all(bool((dst_layers[i * layer_bytes:(i + 1) * layer_bytes] == (cycle * 37 + i) % 251).all().item())
                        for i in range(len(lay)))
        res["verified"] = ok_blocks and ok_layers
        if a.kill_producer:
            agent.remove_remote_agent(peer)  # unload: the dead producer's mappings close
            agent.deregister_memory(local_reg, **opts)
            del dst_layers, dst_blocks, first, second, view, want
            if plugin:
                gt.empty_cache()
            torch.cuda.empty_cache()
            torch.cuda.synchronize()
            time.sleep(0.2)
            res["free_vs_baseline_gib"] = round((torch.cuda.mem_get_info()[0] - baseline_free) / GIB, 3)
            publish(f"{a.work}/consumer-result", res)
            return
        if plugin:
            # The checks' temporaries (1.5 GiB compares) go back, so that the device's free
            # memory after the producer's shutdown says what the producer and the mappings
            # left, not the consumer's own cache.
            del view, want
            gt.empty_cache()
            # Keep the producer's metadata loaded through its shutdown: its deregistration
            # must take the mappings back.
            publish(f"{a.work}/pulled-{cycle}", res)
            wait_file(f"{a.work}/released-{cycle}", a.timeout)
            imports_left = gpu_arena.imports_live()
            try:
                read(local_blocks[:1], remote_blocks[:1], "after")
                refused = "accepted"
            except Exception as e:  # noqa: BLE001 - NIXL raises its own error types
                refused = f"{type(e).__name__}: {e}: {gpu_arena._lib.last_error()}"
            after.append({"cycle": cycle, "imports_left": imports_left, "read_after": refused})
            agent.remove_remote_agent(peer)
            continue
        agent.remove_remote_agent(peer)
        if a.fresh_agent:
            # Close this consumer's UCX context (and the IPC mappings it cached) before the
            # producer shuts down; the next cycle gets a new agent.
            agent.deregister_memory(local_reg)
            del agent, local_reg
            agent = Agent(f"consumer-{cycle + 1}")
            local_reg = agent.register_memory([dst_layers, dst_blocks])
        publish(f"{a.work}/pulled-{cycle}", res)
        wait_file(f"{a.work}/released-{cycle}", a.timeout)
    agent.deregister_memory(local_reg, **opts)
    publish(f"{a.work}/consumer-result", {"after_shutdown": after})


# ---------------------------------------------------------------------------------------
# orchestration
# ---------------------------------------------------------------------------------------
def proto_tables(text):
    """The UCX_PROTO_INFO tables for operations on cuda memory: [(title, [config, ...])].
    A table is a title (what moves, e.g. "remote memory read by ucp_get* ... into cuda
    memory from cuda") and rows "| range | description | config |"."""
    import re

    tables, title, rows = [], None, []
    for line in text.splitlines():
        if "|" not in line:
            continue
        cells = [c.strip() for c in line[line.index("|"):].strip().strip("|").split("|")]
        if len(cells) == 1:
            if re.search(r"\bby ucp_|memory", cells[0]):
                if title is not None:
                    tables.append((title, rows))
                title, rows = cells[0], []
        elif len(cells) >= 3 and re.match(r"^\d+\.\.", cells[0]) and title is not None:
            rows.append(cells[2])
    if title is not None:
        tables.append((title, rows))
    return [(t, r) for t, r in tables if "cuda" in t and r]


def orchestrate(a):
    os.makedirs(a.out, exist_ok=True)
    label = f"{a.flow}{'-kill' if a.kill else ''}{'-killproducer' if a.kill_producer else ''}{a.tag}"
    work = os.path.join(a.out, f"work-{label}")
    os.makedirs(work, exist_ok=True)
    for f in os.listdir(work):
        os.unlink(os.path.join(work, f))
    env = dict(os.environ, UCX_PROTO_INFO="y", PYTHONUNBUFFERED="1")
    common = ["--work", work, "--flow", a.flow, "--layers", str(a.layers), "--layer-gib", str(a.layer_gib),
              "--cycles", str(a.cycles), "--blocks", str(a.blocks), "--timeout", str(a.timeout),
              "--consumer-device", str(a.consumer_device)] + (["--conf", a.conf] if a.conf else []) + (["--kill"] if a.kill else []) + (["--kill-producer"] if a.kill_producer else []) + (["--fresh-agent"] if a.fresh_agent else [])
    plog = open(os.path.join(a.out, f"{label}.producer.log"), "w")
    clog_path = os.path.join(a.out, f"{label}.consumer.log")
    clog = open(clog_path, "w")
    prod = subprocess.Popen([sys.executable, __file__, "--role", "producer"] + common, env=env, stdout=plog, stderr=subprocess.STDOUT)
    report = {"flow": a.flow, "conf": a.conf, "kill": a.kill, "layers": a.layers, "layer_gib": a.layer_gib,
              "consumer_device": a.consumer_device,
              "ucx_env": {k: v for k, v in os.environ.items() if k.startswith("UCX_")}}
    try:
        wait_file(f"{work}/producer-up", a.timeout, prod)
        cons = subprocess.Popen([sys.executable, __file__, "--role", "consumer"] + common, env=env, stdout=clog, stderr=subprocess.STDOUT)
        if a.kill:
            wait_file(f"{work}/transfer-started", a.timeout, cons)
            time.sleep(0.05)
            cons.send_signal(signal.SIGKILL)
            cons.wait()
            report["consumer_killed"] = True
            # Nothing will say "pulled": tell the producer the consumer is gone.
            publish(f"{work}/pulled-0", {"consumer": "SIGKILLed mid-transfer"})
        if a.kill_producer:
            wait_file(f"{work}/transfer-started", a.timeout, cons)
            time.sleep(0.05)
            prod.send_signal(signal.SIGKILL)
            prod.wait()
            report["producer_killed"] = True
            cons.wait(timeout=a.timeout)
            report["consumer_exit"] = cons.returncode
            res_path = f"{work}/consumer-result"
            report["consumer"] = json.load(open(res_path)) if os.path.exists(res_path) else {"error": "no consumer result"}
        deadline = time.time() + a.timeout * (a.cycles + 2)
        while prod.poll() is None and time.time() < deadline:
            if not a.kill and cons.poll() not in (None, 0):
                break
            time.sleep(0.1)
        res_path = f"{work}/producer-result"
        if not a.kill_producer:
            report.update(json.load(open(res_path)) if os.path.exists(res_path) else {"error": "no producer result"})
        if cons.poll() is None and not a.kill:
            cons.wait(timeout=a.timeout)
        cres = f"{work}/consumer-result"
        if a.flow == "plugin" and not a.kill_producer and os.path.exists(cres):
            report.update(json.load(open(cres)))
    finally:
        for p in (prod, locals().get("cons")):
            if p is not None and p.poll() is None:
                p.kill()
        plog.close()
        clog.close()
    tables = proto_tables(open(clog_path).read())
    report["ucx_tables"] = tables
    # What moved the KV bytes: the protocol tables of READs into cuda memory.
    reads = [cells for title, cells in tables if "remote memory read" in title]
    report["transports"] = sorted({c for cells in reads for c in cells})
    report["cuda_ipc_used"] = bool(reads) and all(any("cuda_ipc" in c for c in cells) for cells in reads)
    cyc = report.get("cycles", [])
    report["summary"] = dict(
        cycles=len(cyc), verified=all(c.get("verified", False) for c in cyc if "verified" in c),
        leaked_gib_max=max((c["leaked_gib"] for c in cyc), default=None),
        leaked_not_consumer_gib=[c.get("leaked_not_consumer_gib") for c in cyc],
        registrations=cyc[0]["registrations"] if cyc else None,
        reg_ms_each=cyc[0]["reg_ms_each"] if cyc else None,
        blocks_gbps=[c.get("blocks_gbps") for c in cyc], layers_gbps=[c.get("layers_gbps") for c in cyc],
        producer_mib=[c.get("producer_mib") for c in cyc], consumer_mib=[c.get("consumer_mib") for c in cyc],
        copy_gbps=cyc[0].get("copy_gbps") if cyc else None, peer_copy_gbps=cyc[0].get("peer_copy_gbps") if cyc else None,
        exports=[c.get("exports") for c in cyc],
        read_after_shutdown=[x["read_after"][:120] for x in report.get("after_shutdown", [])],
        imports_left=[x["imports_left"] for x in report.get("after_shutdown", [])])
    name = f"nixl-{label}.json"
    with open(os.path.join(a.out, name), "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({"flow": a.flow, "tag": a.tag, "cuda_ipc_used": report["cuda_ipc_used"],
                      "transports": report["transports"], **report["summary"]}))
    if a.kill_producer:
        c = report.get("consumer", {})
        print(json.dumps({"flow": a.flow, "tag": a.tag, "producer_killed": True, **c}))
        return 0 if c.get("verified") else 1
    ok = bool(cyc) and (a.kill or report["summary"]["verified"])
    return 0 if ok else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", choices=["producer", "consumer"])
    ap.add_argument("--flow", choices=["arena", "naive", "plugin"], default="arena")
    ap.add_argument("--work")
    ap.add_argument("--out", default="gpu-out/nixl")
    ap.add_argument("--tag", default="")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--layer-gib", type=float, default=1.5)
    ap.add_argument("--cycles", type=int, default=10)
    ap.add_argument("--blocks", type=int, default=512)
    ap.add_argument("--timeout", type=float, default=120)
    ap.add_argument("--consumer-device", type=int, default=0)
    ap.add_argument("--conf", default="")
    ap.add_argument("--kill", action="store_true")
    ap.add_argument("--kill-producer", action="store_true")
    ap.add_argument("--fresh-agent", action="store_true",
                    help="the consumer replaces its NIXL agent after each cycle's pulls")
    a = ap.parse_args()
    if a.kill or a.kill_producer:
        a.cycles = 1
    if a.role == "producer":
        return producer(a)
    if a.role == "consumer":
        return consumer(a)
    return orchestrate(a)


if __name__ == "__main__":
    sys.exit(main())
