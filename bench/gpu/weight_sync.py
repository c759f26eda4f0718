"""Weight sync between two processes on one GPU, as a colocated RLHF trainer pushes its
weights into an inference process each step (issue #47): PyTorch's caching allocator and
gpu-arena, the same loop, each configuration in fresh processes.

The trainer holds ``--tensors`` bf16 tensors of ``--mib`` MiB (or the 70B-shaped mix,
``--shape 70b``); each of ``--syncs`` syncs sends them to a receiver it spawned, which checks
every element, copies them into its own weights, drops what it received and acks. Then the
receiver exits, the trainer drops its tensors and empties its cache, and both report what
they still hold.

  --mode inplace   the same tensors, updated in place before each sync
  --mode fresh     new tensors every sync (FSDP-gathered parameters), the old ones dropped
                   after the ack

  --path queue     a torch.multiprocessing Queue of the tensor list (torch's CUDA IPC
                   reductions, or gpu-arena's where ``install()`` registered them)
  --path reduce    reduce_tensor() per tensor in the trainer, rebuild in the receiver, as
                   frameworks do by hand (verl, OpenRLHF)
  --path bucket    gpu_arena.weight_sync: one message per bucket (gpu-arena only), received by a
                   weight_sync.Receiver (imports kept between syncs, pruned after each)

  --alloc torch | torch_collect (torch.cuda.ipc_collect() after each sync) | gpu_arena |
          gpu_arena_torch_ipc (gpu-arena's allocator, torch's own CUDA IPC reductions)

Each run writes JSON (``--out``): per-sync times and the trainer's memory after every sync,
the phases (pickling in the trainer; receive, check and copy, drop in the receiver), and the
teardown figures: device memory in use against the baseline taken with the trainer's CUDA
context only, reserved and allocated bytes, and for gpu-arena shares, exports and imports in
both processes. ``--all`` runs every configuration of the table in fresh processes and
prints it; a failed check (bad data, memory held after teardown) makes the exit status 1.

  python bench/gpu/weight_sync.py --all --out-dir $OUT/weight_sync
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "gpu"))
import gpu_common  # noqa: E402  (the checkout's python/ on the path, child_env)

MIB = 1 << 20


def shapes(args) -> list:
    """Element counts of the trainer's tensors (bf16)."""
    if args.shape == "70b":
        # A 70B-shaped mix (a Llama-70B's 80 layers, narrowed to ~16.7 GiB): per layer q, k,
        # v, o, gate, up, down and two norms; embeddings and head: 723 tensors of 8 KiB to
        # 263 MiB.
        hidden, kv, inter, vocab, layers = 4096, 512, 5376, 32064, 80
        per_layer = [hidden * hidden, kv * hidden, kv * hidden, hidden * hidden,
                     inter * hidden, inter * hidden, hidden * inter, hidden, hidden]
        out = [vocab * hidden]
        for _ in range(layers):
            out += per_layer
        out += [hidden, vocab * hidden]
        return out
    return [args.mib * MIB // 2] * args.tensors


def install(alloc: str):
    if alloc.startswith("gpu_arena"):
        import gpu_arena.torch

        gpu_arena.torch.install()
    import torch

    if alloc == "gpu_arena_torch_ipc":
        # gpu-arena's allocator with torch's own CUDA IPC reductions put back (what
        # install() did before it registered its own): the "before".
        from gpu_arena import torch_ipc

        torch_ipc.unregister(torch)
    return torch


def arena_stats() -> dict:
    import gpu_arena

    s = gpu_arena.stats()
    keys = ("reserved_bytes", "allocated_bytes", "shares_live", "exports_live")
    out = {k: int(s[k]) for k in keys if k in s}
    out["imports_live"] = int(gpu_arena.imports_live())
    return out


# --- where the time goes ----------------------------------------------------------------


class TimedPickler:
    """multiprocessing.queues' pickler with its dumps (the sender's feeder thread: torch's or
    gpu-arena's reductions, i.e. the shares) and loads (the receiver: the rebuilds, i.e. the
    imports) timed; the seconds of each accumulate until taken."""

    def __init__(self):
        from multiprocessing.reduction import ForkingPickler

        self._pickler = ForkingPickler
        self.dumps_s = self.loads_s = 0.0

    def dumps(self, obj, protocol=None):
        t = time.perf_counter()
        try:
            return self._pickler.dumps(obj, protocol)
        finally:
            self.dumps_s += time.perf_counter() - t

    def loads(self, data, *args, **kw):
        t = time.perf_counter()
        try:
            return self._pickler.loads(data, *args, **kw)
        finally:
            self.loads_s += time.perf_counter() - t

    def take(self, what: str) -> float:
        v = getattr(self, what)
        setattr(self, what, 0.0)
        return v


def timed_queues() -> TimedPickler:
    import multiprocessing.queues as mq

    t = TimedPickler()
    mq._ForkingPickler = t
    return t


# --- the receiver ------------------------------------------------------------------------


def receiver_main(alloc, path, numels, q, acks, result_path, ack_first=False):
    torch = install(alloc)
    dev = torch.device("cuda", 0)
    torch.cuda.init()
    weights = [torch.empty(n, dtype=torch.bfloat16, device=dev) for n in numels]
    torch.cuda.synchronize()
    rx = None
    if path == "bucket":
        from gpu_arena import weight_sync

        rx = weight_sync.Receiver()  # keeps the imports between syncs; pruned after each
    timer = timed_queues()
    acks.put(("ready", None))
    phases = {"wait_s": [], "unpickle_s": [], "rebuild_s": [], "check_copy_s": [], "drop_s": []}
    bad_total = 0
    while True:
        t0 = time.perf_counter()
        msg = q.get()
        if msg is None:
            break
        value, first, last, payload = msg
        tr = time.perf_counter()
        if path == "reduce":
            got = [fn(*a) for fn, a in payload]
        elif path == "bucket":
            got = rx.receive(payload)
        else:
            got = payload
        t1 = time.perf_counter()
        unpickle = timer.take("loads_s")
        bad = torch.zeros((), dtype=torch.int64, device=dev)
        for i in range(len(got)):
            bad += (got[i] != float((value + first + i) % 200)).sum()
            weights[first + i].copy_(got[i])
        bad = int(bad.item())
        t2 = time.perf_counter()
        if ack_first:  # the sender may drop its tensors before this process drops its own
            acks.put(("ack", bad))
        del got, payload, msg
        if rx is not None and last:
            rx.prune()  # the sync's buckets are in: imports no bucket used go
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        bad_total += bad
        phases["wait_s"].append(tr - t0 - unpickle)
        phases["unpickle_s"].append(unpickle)
        phases["rebuild_s"].append(t1 - tr)
        phases["check_copy_s"].append(t2 - t1)
        phases["drop_s"].append(t3 - t2)
        if not ack_first:
            acks.put(("ack", bad))
    out = {"bad": bad_total, "phases": phases}
    if rx is not None:
        rx.close()
    del weights
    gc.collect()
    torch.cuda.empty_cache()
    if alloc.startswith("gpu_arena"):
        out["final"] = arena_stats()
    with open(result_path, "w") as f:
        json.dump(out, f)


# --- the trainer -------------------------------------------------------------------------


def split(numels, bucket_mib: int) -> list:
    """(first, end) index ranges of the messages: buckets of at most bucket_mib MiB (a larger
    tensor alone), or one message when bucket_mib is 0."""
    if bucket_mib <= 0:
        return [(0, len(numels))]
    out, lo, size = [], 0, 0
    for i, n in enumerate(numels):
        if i > lo and size + 2 * n > bucket_mib * MIB:
            out.append((lo, i))
            lo, size = i, 0
        size += 2 * n
    out.append((lo, len(numels)))
    return out



def device_used(torch) -> int:
    free, total = torch.cuda.mem_get_info(0)
    return total - free


def held(torch, baseline: int, alloc: str) -> dict:
    """The trainer's memory now: device bytes in use over the baseline, torch's reserved and
    allocated bytes, and gpu-arena's shares, exports and imports."""
    m = {"device_used_mib": (device_used(torch) - baseline) / MIB,
         "reserved_mib": torch.cuda.memory_reserved(0) / MIB,
         "allocated_mib": torch.cuda.memory_allocated(0) / MIB}
    if alloc.startswith("gpu_arena"):
        m.update(arena_stats())
    return m


def trainer(args) -> dict:
    torch = install(args.alloc)
    import torch.multiprocessing as tmp

    dev = torch.device("cuda", 0)
    torch.cuda.init()
    torch.zeros(1, device=dev)  # the context and torch's own first block
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    baseline = device_used(torch)
    numels = shapes(args)
    ctx = tmp.get_context("spawn")
    q, acks = ctx.Queue(), ctx.Queue()
    timer = timed_queues()
    recv_result = args.out + ".receiver.json"
    child = ctx.Process(target=receiver_main,
                        args=(args.alloc, args.path, numels, q, acks, recv_result, args.ack_first))
    child.start()
    assert acks.get(timeout=300)[0] == "ready"
    reducer = None
    if args.path == "reduce":
        from torch.multiprocessing.reductions import reduce_tensor as reducer
    send = None
    if args.path == "bucket":
        from gpu_arena import weight_sync

        send = weight_sync.send
    params = None
    sync_s, pickle_s, dumps_s, mem = [], [], [], []
    messages = split(numels, args.bucket_mib)
    bad = 0
    for k in range(args.syncs):
        value = k * 7
        if args.mode == "fresh" or params is None:
            new = [torch.full((n,), float((value + i) % 200), dtype=torch.bfloat16, device=dev)
                   for i, n in enumerate(numels)]
            params = new  # the old list (if any) is dropped here, after its ack
            del new
        else:
            for i in range(len(params)):
                params[i].fill_(float((value + i) % 200))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        pickling = 0.0
        for lo, hi in messages:
            m0 = time.perf_counter()
            part = params[lo:hi]
            if args.path == "reduce":
                payload = [reducer(t) for t in part]
            elif args.path == "bucket":
                payload = send(part)
            else:
                payload = part
            pickling += time.perf_counter() - m0
            q.put((value, lo, hi == len(params), payload))
            del payload, part
            kind, b = acks.get(timeout=300)
            bad += b
        t2 = time.perf_counter()
        sync_s.append(t2 - t0)
        pickle_s.append(pickling)
        dumps_s.append(timer.take("dumps_s"))
        if args.alloc == "torch_collect":
            torch.cuda.ipc_collect()
        mem.append(held(torch, baseline, args.alloc))
    q.put(None)
    child.join(300)
    receiver = json.load(open(recv_result)) if os.path.exists(recv_result) else {}
    del params
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    teardown = held(torch, baseline, args.alloc)
    # What torch's IPC limbo held: the same figures after torch.cuda.ipc_collect().
    torch.cuda.ipc_collect()
    torch.cuda.empty_cache()
    collected = held(torch, baseline, args.alloc)
    return {"alloc": args.alloc, "mode": args.mode, "path": args.path, "shape": args.shape,
            "tensors": len(numels), "bytes": 2 * sum(numels), "syncs": args.syncs,
            "messages": len(messages),
            "sync_s": sync_s, "pickle_s": pickle_s, "dumps_s": dumps_s, "median_sync_ms": 1e3 * statistics.median(sync_s),
            "bad_elements": bad + receiver.get("bad", 0), "receiver_exit": child.exitcode,
            "receiver": receiver, "memory": mem, "teardown": teardown, "after_ipc_collect": collected,
            "device": torch.cuda.get_device_name(0)}


# --- the table ---------------------------------------------------------------------------


def configs(args):
    paths = args.paths.split(",")
    for mode in args.modes.split(","):
        for path in paths:
            allocs = ["gpu_arena"] if path == "bucket" else args.allocs.split(",")
            for alloc in allocs:
                yield alloc, mode, path


def held_ok(r) -> bool:
    t = r["teardown"]
    if r["alloc"] != "gpu_arena":
        return True  # also the "before" (torch's reductions over gpu-arena)  # PyTorch's limbo is reported, not judged
    fin = r["receiver"].get("final", {})
    return (t["device_used_mib"] <= 2 and t.get("shares_live", 0) == 0
            and t.get("exports_live", 0) == 0 and t.get("imports_live", 0) == 0
            and fin.get("imports_live", 1) == 0 and fin.get("shares_live", 1) == 0
            and fin.get("exports_live", 1) == 0)


def run_all(args) -> int:
    os.makedirs(args.out_dir, exist_ok=True)
    rows, failed = [], False
    for alloc, mode, path in configs(args):
        tag = "-ackfirst" if args.ack_first else ""
        out = os.path.join(args.out_dir, f"{args.shape}-{mode}-{path}-{alloc}-b{args.bucket_mib}{tag}.json")
        cmd = [sys.executable, __file__, "--alloc", alloc, "--mode", mode, "--path", path,
               "--shape", args.shape, "--tensors", str(args.tensors), "--mib", str(args.mib),
               "--syncs", str(args.syncs), "--bucket-mib", str(args.bucket_mib), "--out", out]
        if args.ack_first:
            cmd.append("--ack-first")
        log = open(out + ".log", "w")
        rc = subprocess.call(cmd, env=gpu_common.child_env(), stdout=log, stderr=subprocess.STDOUT)
        if rc != 0 or not os.path.exists(out):
            rows.append((alloc, mode, path, "FAILED rc=%d (see %s.log)" % (rc, out)))
            failed = True
            continue
        r = json.load(open(out))
        t = r["teardown"]
        ok = r["bad_elements"] == 0 and r["receiver_exit"] == 0 and held_ok(r)
        failed |= not ok
        after = [m["device_used_mib"] for m in r["memory"]]
        rows.append((alloc, mode, path,
                     f"sync median {r['median_sync_ms']:.1f} ms (min {1e3 * min(r['sync_s']):.1f}, "
                     f"max {1e3 * max(r['sync_s']):.1f}); device in use after syncs "
                     f"{min(after):.0f}-{max(after):.0f} MiB; after teardown "
                     f"{t['device_used_mib']:.0f} MiB, reserved {t['reserved_mib']:.0f}, "
                     f"allocated {t['allocated_mib']:.0f}"
                     + (f", shares {t.get('shares_live')}, exports {t.get('exports_live')}, "
                        f"imports {t.get('imports_live')} / receiver "
                        f"{r['receiver'].get('final')}" if alloc.startswith("gpu_arena") else "")
                     + f"; after ipc_collect {r['after_ipc_collect']['device_used_mib']:.0f} MiB"
                     + "; phases (median ms): send " + f"{1e3 * statistics.median(r['pickle_s']):.2f}"
                     + f", dumps {1e3 * statistics.median(r['dumps_s']):.2f}, "
                     + ", ".join(f"{k[:-2]} {1e3 * statistics.median(v):.2f}"
                                 for k, v in r["receiver"].get("phases", {}).items())
                     + ("" if ok else "  FAIL")))
    for row in rows:
        print(" | ".join(row))
    return 1 if failed else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--alloc", default="gpu_arena", choices=("torch", "torch_collect", "gpu_arena", "gpu_arena_torch_ipc"))
    p.add_argument("--mode", default="fresh", choices=("inplace", "fresh"))
    p.add_argument("--path", default="queue", choices=("queue", "reduce", "bucket"))
    p.add_argument("--shape", default="flat", choices=("flat", "70b"))
    p.add_argument("--tensors", type=int, default=64)
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--syncs", type=int, default=30)
    p.add_argument("--ack-first", action="store_true",
                   help="the receiver acks before it drops what it received (the sender's "
                        "drop may come first: torch's limbo)")
    p.add_argument("--bucket-mib", type=int, default=0,
                   help="messages of at most this many MiB (0: the whole list as one)")
    p.add_argument("--out")
    p.add_argument("--all", action="store_true", help="every configuration (the default without --out)")
    p.add_argument("--out-dir", default=gpu_common.out_path("weight_sync"))
    p.add_argument("--modes", default="inplace,fresh")
    p.add_argument("--paths", default="queue")
    p.add_argument("--allocs", default="torch,torch_collect,gpu_arena")
    args = p.parse_args()
    if args.all or not args.out:
        return run_all(args)
    r = trainer(args)
    with open(args.out, "w") as f:
        json.dump(r, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
