#!/usr/bin/env python3
"""Share / import latency against PyTorch's CUDA IPC (issue #14), in one run, as a
markdown table with the targets and PASS/FAIL.

    GPU_ARENA_LIB=.gpu/libgpu_arena.so PYTHONPATH=python \\
        python3 bench/gpu/share_latency.py --out bench/results/h200-share-latency.md
    python3 bench/gpu/share_latency.py --sim     # the sim backend (no GPU), see --sim

N blocks (default 2048) of 2 MiB. Every arena is exported and mapped by the consumer
before timing starts (an anchor share of each block is made and imported first), so the
figures are those of a share of an already exported arena and an import of a share whose
arena the consumer maps already. Per-call medians, in microseconds:

* C API via ctypes (each call includes ~0.3-1 us of ctypes overhead; bench/gpu/share_bench.c
  measures the C API from C, without it): ``gpu_arena_share``,
  ``gpu_arena_import``, ``gpu_arena_close``, ``gpu_arena_unshare``, and the batch forms
  ``gpu_arena_share_many`` / ``gpu_arena_import_many`` / ``gpu_arena_close_many`` (the
  batch time divided by N);
* Python: ``gpu_arena.share(tensor)``, ``gpu_arena.open(share)``, ``gpu_arena.close(t)``
  of 2 MiB tensors allocated through ``gpu_arena.torch.install()``;
* PyTorch: ``torch.multiprocessing.reductions.reduce_tensor`` of 2 MiB tensors of its own
  caching allocator and ``rebuild_cuda_tensor`` (the function reduce_tensor returns) in
  the consumer, in a separate pair of processes (PyTorch's CUDA IPC needs its allocator).

GPU_ARENA_IPC_SPIN_US (default 50) is how long each side polls for the other's message
before sleeping; ``--spin-us`` sets it for the gpu-arena processes. Requests that need no
fd go through each connection's shared-memory mailbox unless GPU_ARENA_IPC_MAILBOX=0 is in
the environment (run once with it, once without, to compare). Runs in well under 2
minutes. Exit status 1 when a target fails.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import pickle
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "gpu"))
import gpu_common  # noqa: E402,F401  (tests/gpu/gpu_common.py: python/ and tests/python/ on sys.path)
from result_channel import ReplyPipe, reply_stream  # noqa: E402  (tests/python)

MiB = 1 << 20
BLOCK = 2 * MiB


def log(msg: str) -> None:
    print(f"[share_latency {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def med_us(ns) -> float:
    return statistics.median(ns) / 1e3 if ns else float("nan")


def timed(fn, *args):
    t = time.perf_counter_ns()
    r = fn(*args)
    return time.perf_counter_ns() - t, r


# -------------------------------------------------------------------------------- pipes


class Peer:
    """A child process of this script in `role`, spoken to with pickles: requests on its
    stdin, answers on a reply pipe of its own (its stdout and stderr are the log)."""

    def __init__(self, role: str, args, env_extra=None):
        env = dict(os.environ)
        env.update(env_extra or {})
        cmd = [sys.executable, os.path.abspath(__file__), "--role", role, "--n", str(args.n)]
        if args.sim:
            cmd.append("--sim")
        self.replies = ReplyPipe(binary=True)
        env.update(self.replies.env)
        try:
            self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=sys.stderr, env=env,
                                      pass_fds=(self.replies.fd,))
        finally:
            self.replies.started()

    def call(self, op: str, **kw):
        pickle.dump((op, kw), self.p.stdin)
        self.p.stdin.flush()
        ok, value = pickle.load(self.replies.reader)
        if not ok:
            raise RuntimeError(f"{op}: {value}")
        return value

    def exit(self):
        try:
            self.call("exit")
        finally:
            self.p.wait(timeout=60)


def serve(handler) -> None:
    inp, out = sys.stdin.buffer, reply_stream(binary=True)
    sys.stdout = sys.stderr  # prints go to stderr, with the log
    while True:
        op, kw = pickle.load(inp)
        try:
            value = (True, handler(op, **kw))
        except Exception as e:  # noqa: BLE001 - reported to the driver
            value = (False, f"{type(e).__name__}: {e}")
        pickle.dump(value, out)
        out.flush()
        if op == "exit":
            return


# -------------------------------------------------------------------------------- gpu-arena


def setup_gpu_arena(sim: bool, n: int):
    import gpu_arena

    if sim:
        gpu_arena.configure(f"backend=sim,arena_size=1GiB,sim_capacity={max(4, (3 * n * BLOCK) >> 30)}GiB")
        gpu_arena.init()
        try:  # the Python rows with CPU tensors over sim memory (host memory)
            import torch
        except ImportError:
            torch = None
        return gpu_arena, torch
    import torch

    import gpu_arena.torch as gat

    gat.install()
    torch.cuda.init()
    return gpu_arena, torch


def gpu_arena_consumer(args) -> None:
    gpu_arena, torch = setup_gpu_arena(args.sim, args.n)
    from gpu_arena import _lib
    from gpu_arena._lib import GpuArenaShare

    lib = _lib.lib()
    anchors = []
    tensors = []

    def import_one(b: bytes) -> int:
        s = GpuArenaShare.from_buffer_copy(b)
        out = ctypes.c_void_p()
        _lib.check(lib.gpu_arena_import(ctypes.byref(s), ctypes.byref(out)), "gpu_arena_import")
        return int(out.value)

    def handler(op, **kw):
        if op == "anchors":  # map every arena; kept to the end
            anchors.extend(import_one(b) for b in kw["handles"])
            return len(anchors)
        if op == "c_single":
            structs = [GpuArenaShare.from_buffer_copy(b) for b in kw["handles"]]
            imp, close, ptrs = [], [], []
            # The ctypes arguments are made before the clock starts: the timed region is
            # the foreign call.
            for s in structs:
                out = ctypes.c_void_p()
                s_ref, out_ref = ctypes.byref(s), ctypes.byref(out)
                t = time.perf_counter_ns()
                rc = lib.gpu_arena_import(s_ref, out_ref)
                imp.append(time.perf_counter_ns() - t)
                _lib.check(rc, "gpu_arena_import")
                ptrs.append(out.value)
            for p in ptrs:
                vp = ctypes.c_void_p(p)
                t = time.perf_counter_ns()
                rc = lib.gpu_arena_close(vp)
                close.append(time.perf_counter_ns() - t)
                _lib.check(rc, "gpu_arena_close")
            return {"import": imp, "close": close}
        if op == "c_batch":
            n = len(kw["handles"])
            arr = (GpuArenaShare * n)(*[GpuArenaShare.from_buffer_copy(b) for b in kw["handles"]])
            out = (ctypes.c_void_p * n)()
            t = time.perf_counter_ns()
            rc = lib.gpu_arena_import_many(arr, n, out)
            imp = time.perf_counter_ns() - t
            _lib.check(rc, "gpu_arena_import_many")
            t = time.perf_counter_ns()
            rc = lib.gpu_arena_close_many(out, n)
            close = time.perf_counter_ns() - t
            _lib.check(rc, "gpu_arena_close_many")
            return {"import_many": imp / n, "close_many": close / n}
        if op == "py_anchors":
            tensors.extend(gpu_arena.open(gpu_arena.Share.from_bytes(b)) for b in kw["shares"])
            return len(tensors)
        if op == "py_single":
            shares = [gpu_arena.Share.from_bytes(b) for b in kw["shares"]]
            opn, cls, ts = [], [], []
            for s in shares:
                dt, t = timed(gpu_arena.open, s)
                opn.append(dt)
                ts.append(t)
            for t in ts:
                dt, _ = timed(gpu_arena.close, t)
                cls.append(dt)
            return {"open": opn, "close": cls}
        if op == "exit":
            for t in tensors:
                gpu_arena.close(t)
            for p in anchors:
                lib.gpu_arena_close(ctypes.c_void_p(p))
            return None
        raise ValueError(op)

    serve(handler)


def run_gpu_arena(args, rows: dict) -> None:
    env = {"GPU_ARENA_IPC_SPIN_US": str(args.spin_us)} if args.spin_us is not None else {}
    if args.spin_us is not None:
        os.environ["GPU_ARENA_IPC_SPIN_US"] = str(args.spin_us)
    gpu_arena, torch = setup_gpu_arena(args.sim, args.n)
    from gpu_arena import _lib
    from gpu_arena._lib import GpuArenaShare

    lib = _lib.lib()
    n = args.n
    consumer = Peer("gpu-arena-consumer", args, env)
    ptrs = [gpu_arena.malloc(BLOCK) for _ in range(n)]
    anchors = [gpu_arena.share_ptr(p, BLOCK) for p in ptrs]  # exports every arena
    consumer.call("anchors", handles=[bytes(h) for h in anchors])
    log(f"C API: {n} blocks, arenas exported and mapped")

    share_ns, handles = [], []
    for p in ptrs:
        # The ctypes arguments are made before the clock starts (as in the consumer).
        out = GpuArenaShare()
        vp, out_ref = ctypes.c_void_p(p), ctypes.byref(out)
        t = time.perf_counter_ns()
        rc = lib.gpu_arena_share(vp, BLOCK, out_ref)
        share_ns.append(time.perf_counter_ns() - t)
        _lib.check(rc, "gpu_arena_share")
        handles.append(out)
    single = consumer.call("c_single", handles=[bytes(h) for h in handles])

    arr = (GpuArenaShare * n)()
    t = time.perf_counter_ns()
    rc = lib.gpu_arena_share_many((ctypes.c_void_p * n)(*ptrs), (ctypes.c_size_t * n)(*([BLOCK] * n)),
                                  n, arr)
    share_many = (time.perf_counter_ns() - t) / n
    _lib.check(rc, "gpu_arena_share_many")
    batch = consumer.call("c_batch", handles=[bytes(h) for h in arr])

    unshare_ns = []
    for h in list(handles) + list(arr):
        h_ref = ctypes.byref(h)
        t = time.perf_counter_ns()
        rc = lib.gpu_arena_unshare(h_ref)
        unshare_ns.append(time.perf_counter_ns() - t)
        _lib.check(rc, "gpu_arena_unshare")

    rows["C API via ctypes: share (exported arena)"] = (med_us(share_ns), 2.0, "reduce")
    rows["C API via ctypes: share_many, per share"] = (share_many / 1e3, 2.0, "reduce")
    rows["C API via ctypes: import (mapped arena)"] = (med_us(single["import"]), 5.0, "rebuild")
    rows["C API via ctypes: import_many, per share"] = (batch["import_many"] / 1e3, 5.0, "rebuild")
    rows["C API via ctypes: close"] = (med_us(single["close"]), None, None)
    rows["C API via ctypes: close_many, per import"] = (batch["close_many"] / 1e3, None, None)
    rows["C API via ctypes: unshare"] = (med_us(unshare_ns), None, None)

    sim_blocks = []

    def new_block():
        if not args.sim:
            return torch.empty(BLOCK, dtype=torch.uint8, device="cuda")
        p = gpu_arena.malloc(BLOCK)
        sim_blocks.append(p)
        return torch.frombuffer((ctypes.c_uint8 * BLOCK).from_address(p), dtype=torch.uint8)

    if torch is not None:
        ts = [new_block() for _ in range(n)]
        anchors_py = [gpu_arena.share(t) for t in ts]
        consumer.call("py_anchors", shares=[s.to_bytes() for s in anchors_py])
        log("Python: tensors shared and opened once (arenas exported and mapped)")
        sh_ns, shares = [], []
        for t in ts:
            dt, s = timed(gpu_arena.share, t)
            sh_ns.append(dt)
            shares.append(s)
        py = consumer.call("py_single", shares=[s.to_bytes() for s in shares])
        for s in shares + anchors_py:
            s.close()
        rows["Python share(tensor)"] = (med_us(sh_ns), 20.0, "reduce")
        rows["Python open(share)"] = (med_us(py["open"]), 20.0, "rebuild")
        rows["Python close(tensor)"] = (med_us(py["close"]), None, None)
    consumer.exit()
    for p, h in zip(ptrs, anchors):
        gpu_arena.unshare(h)
    ts = None
    for p in ptrs + sim_blocks:
        gpu_arena.free(p, BLOCK)


# -------------------------------------------------------------------------------- PyTorch


def torch_producer(args) -> None:
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    torch.cuda.init()
    ts = []

    def handler(op, **kw):
        if op == "reduce":
            ts.extend(torch.empty(BLOCK, dtype=torch.uint8, device="cuda") for _ in range(kw["n"]))
            torch.cuda.synchronize()
            ns, out = [], []
            for t in ts:
                dt, (fn, fargs) = timed(reduce_tensor, t)
                ns.append(dt)
                out.append(fargs)
            return {"reduce": ns, "args": out}
        if op == "exit":
            return None
        raise ValueError(op)

    serve(handler)


def torch_consumer(args) -> None:
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    torch.cuda.init()
    kept = []

    def handler(op, **kw):
        if op == "rebuild":
            ns, dl = [], []
            for a in kw["args"]:
                dt, t = timed(rebuild_cuda_tensor, *a)
                ns.append(dt)
                kept.append(t)
            torch.cuda.synchronize()
            while kept:
                t0 = time.perf_counter_ns()
                del kept[-1]
                dl.append(time.perf_counter_ns() - t0)
            return {"rebuild": ns, "del": dl}
        if op == "exit":
            return None
        raise ValueError(op)

    serve(handler)


def run_torch(args, rows: dict) -> None:
    prod = Peer("torch-producer", args)
    cons = Peer("torch-consumer", args)
    r = prod.call("reduce", n=args.n)
    c = cons.call("rebuild", args=r["args"])
    cons.exit()
    prod.exit()
    rows["PyTorch reduce_tensor"] = (med_us(r["reduce"]), None, None)
    rows["PyTorch rebuild_cuda_tensor"] = (med_us(c["rebuild"]), None, None)
    rows["PyTorch del (rebuilt tensor)"] = (med_us(c["del"]), None, None)


# -------------------------------------------------------------------------------- report


def report(args, rows: dict) -> tuple:
    torch_ref = {"reduce": rows.get("PyTorch reduce_tensor", (None,))[0],
                 "rebuild": rows.get("PyTorch rebuild_cuda_tensor", (None,))[0]}
    lines = [f"# gpu-arena share latency ({'sim' if args.sim else 'GPU'}), "
             f"{time.strftime('%Y-%m-%d %H:%M:%S')}", "",
             f"{args.n} blocks of 2 MiB; medians per call (batch rows: batch time / N); "
             f"GPU_ARENA_IPC_SPIN_US={os.environ.get('GPU_ARENA_IPC_SPIN_US', '50 (default)')}, "
             f"GPU_ARENA_IPC_MAILBOX={os.environ.get('GPU_ARENA_IPC_MAILBOX', '1 (default)')}.",
             "", "| call | median us | target | vs PyTorch | result |", "|---|---:|---|---|---|"]
    failed = 0
    for name, (us, target, ref) in rows.items():
        verdicts = []
        tgt = f"<= {target:g} us" if target is not None else ""
        vs = ""
        if target is not None:
            verdicts.append(us <= target)
        if ref and torch_ref.get(ref) is not None:
            vs = f"< {torch_ref[ref]:.1f} us ({ref})"
            verdicts.append(us < torch_ref[ref])
        res = "" if not verdicts else ("PASS" if all(verdicts) else "FAIL")
        failed += res == "FAIL"
        lines.append(f"| {name} | {us:.2f} | {tgt} | {vs} | {res} |")
    return "\n".join(lines) + "\n", failed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=2048, help="blocks of 2 MiB (default 2048)")
    ap.add_argument("--sim", action="store_true",
                    help="sim backend: the C API, and the Python rows with CPU tensors when torch "
                         "is installed (no PyTorch baseline: its IPC needs CUDA)")
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch baseline")
    ap.add_argument("--spin-us", type=int, default=None, help="GPU_ARENA_IPC_SPIN_US for gpu-arena")
    ap.add_argument("--out", help="write the markdown table here too")
    ap.add_argument("--role", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "gpu-arena-consumer":
        gpu_arena_consumer(args)
        return 0
    if args.role == "torch-producer":
        torch_producer(args)
        return 0
    if args.role == "torch-consumer":
        torch_consumer(args)
        return 0
    t0 = time.monotonic()
    rows: dict = {}
    if not args.sim and not args.no_torch:
        run_torch(args, rows)  # first: its processes never load gpu-arena
    run_gpu_arena(args, rows)
    text, failed = report(args, rows)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    log(f"done in {time.monotonic() - t0:.1f} s; {failed} target(s) failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
