#!/usr/bin/env python3
"""A gpu-arena process (producer or consumer) for tests/gpu/gpu_ipc_check.py, driven over a pipe.

    python3 tests/gpu/gpu_ipc_consumer.py --mode torch [--conf "arena_size=64MiB"]
    python3 tests/gpu/gpu_ipc_consumer.py --mode sim   [--conf "..."]

``torch`` mode installs gpu-arena as PyTorch's allocator first thing (before CUDA is
initialized), warms up every kernel the check uses (so lazily loaded kernel modules do not
show up as memory drift later), and works on CUDA tensors with gpu_arena.share / open.
``sim`` mode needs neither torch nor a GPU: the sim backend, gpu_arena.malloc'd buffers
written and read with ctypes, the same share/open plumbing through the low-level API. It
exists to test the check's process plumbing anywhere.

Protocol: the answers go to the driver's reply pipe (tests/python/result_channel.py), one
JSON line each; stdout and stderr are a log (libraries write there too). After start-up the
process answers ``{"ready": pid, ...}``. Then it reads one JSON request per stdin line,
``{"op": NAME, "args": {...}}``, and answers ``{"ok": RESULT}`` or ``{"error": TEXT}``.
"""

from __future__ import annotations

import argparse
import array
import ctypes
import gc
import json
import os
import struct
import sys
import time
import traceback

import gpu_common  # noqa: F401  (beside this file: python/ and tests/python/ on sys.path)

import gpu_arena
from result_channel import reply_stream  # tests/python

_replies = None


def emit(obj) -> None:
    """One answer on the reply pipe (line buffered: written at once)."""
    global _replies
    if _replies is None:
        _replies = reply_stream()
    _replies.write(json.dumps(obj) + "\n")


def now() -> float:
    """CLOCK_MONOTONIC seconds: comparable across the processes of one machine."""
    return time.monotonic()


class Common:
    """Ops shared by both modes: raw pointer blocks (gpu_arena.malloc) and raw imports."""

    def __init__(self):
        self.blocks = []        # (ptr, nbytes) from gpu_arena.malloc
        self.block_handles = []  # ShareHandle of each block
        self.raw_imports = []   # pointers from gpu_arena.import_handle

    def stats(self):
        return gpu_arena.stats(0)

    def imports_live(self):
        return gpu_arena.imports_live()

    def wait_imports_zero(self, timeout=5.0):
        """Producer: poll until the broker dropped every consumer lease."""
        t0 = now()
        while gpu_arena.stats(0)["imports_live"] != 0:
            if now() - t0 > timeout:
                raise TimeoutError(f"imports_live still {gpu_arena.stats(0)['imports_live']}")
            time.sleep(0.002)
        return now() - t0

    def blocks_alloc(self, count, nbytes):
        s0 = gpu_arena.stats(0)
        t0 = now()
        for _ in range(count):
            self.blocks.append((gpu_arena.malloc(nbytes), nbytes))
        dt = now() - t0
        s1 = gpu_arena.stats(0)
        return {"seconds": dt, "arenas_new": s1["arenas"] - s0["arenas"],
                "arenas": s1["arenas"], "backend_creates": s1["backend_creates"] - s0["backend_creates"]}

    def blocks_share(self):
        s0 = gpu_arena.stats(0)
        times = []
        for ptr, n in self.blocks:
            t0 = now()
            self.block_handles.append(gpu_arena.share_ptr(ptr, n))
            times.append(now() - t0)
        s1 = gpu_arena.stats(0)
        arena_ids = {h.arena_id for h in self.block_handles}
        return {"handles": [h.hex() for h in self.block_handles], "times": times,
                "exports_delta": s1["exports_total"] - s0["exports_total"],
                "exports_live": s1["exports_live"], "arenas_shared": len(arena_ids),
                "arenas": s1["arenas"], "shares_live": s1["shares_live"]}

    def blocks_unshare_free(self):
        for h in self.block_handles:
            gpu_arena.unshare(h)
        for ptr, n in self.blocks:
            gpu_arena.free(ptr, n)
        self.block_handles, self.blocks = [], []
        return None

    def import_raw(self, handles):
        times = []
        for hx in handles:
            t0 = now()
            self.raw_imports.append(gpu_arena.import_handle(bytes.fromhex(hx)))
            times.append(now() - t0)
        return {"times": times, "imports_live": gpu_arena.imports_live()}

    def close_raw(self):
        t0 = now()
        for p in self.raw_imports:
            gpu_arena.close_import(p)
        self.raw_imports = []
        return {"seconds": now() - t0, "imports_live": gpu_arena.imports_live()}

    def sleep(self, seconds):
        time.sleep(seconds)


class TorchOps(Common):
    def __init__(self, conf):
        super().__init__()
        import gpu_arena.torch as gat

        gat.install(conf)              # before anything initializes CUDA
        import torch

        self.torch = torch
        self.tensors = {}   # producer's tensors by name
        self.shares = {}    # name -> [Share]
        self.opened = {}    # consumer's tensors by name
        torch.cuda.init()
        self.device = torch.device("cuda", torch.cuda.current_device())
        self._warmup()

    def _warmup(self):
        torch = self.torch
        for dt in (torch.float32, torch.bfloat16):
            x = torch.zeros(1 << 20, dtype=dt, device=self.device)
            y = torch.empty((2, 64, 16, 8, 128), dtype=dt, device=self.device)
            y.zero_()
            for t in (x, y):
                flat = t.view(-1)
                flat[::1024] = 2.0
                flat[1] = 5.0
                float(flat[1].item())
                float(t.sum(dtype=torch.float32).item())
                float(flat[::1024].sum(dtype=torch.float32).item())
            del x, y, t, flat
        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.empty_cache()
        gpu_arena.empty_cache()

    def info(self):
        torch = self.torch
        return {"pid": os.getpid(), "mode": "torch", "backend": gpu_arena.backend_name(),
                "torch": torch.__version__, "cuda": torch.version.cuda,
                "device": torch.cuda.get_device_name(self.device), "lib": gpu_arena.lib_path()}

    def mem(self):
        self.torch.cuda.synchronize()
        free, total = self.torch.cuda.mem_get_info(self.device)
        return [int(free), int(total)]

    def alloc(self, names, shape, dtype, mark_stride, mark_values, zero=True):
        torch = self.torch
        t0 = now()
        for name, value in zip(names, mark_values):
            t = (torch.zeros if zero else torch.empty)(shape, dtype=getattr(torch, dtype),
                                                       device=self.device)
            if not zero:
                t.zero_()
            t.view(-1)[::mark_stride] = value
            self.tensors[name] = t
        torch.cuda.synchronize()
        return {"seconds": now() - t0}

    def share(self, names):
        out = []
        for name in names:
            t0 = now()
            s = gpu_arena.share(self.tensors[name])
            t1 = now()
            self.shares.setdefault(name, []).append(s)
            out.append({"b64": s.to_base64(), "t0": t0, "dt": t1 - t0,
                        "arena": s.handle.arena_id, "offset": s.handle.offset})
        return out

    def unshare(self, names):
        for name in names:
            for s in self.shares.pop(name, []):
                s.close()

    def free(self, names):
        for name in names:
            self.tensors.pop(name, None)
        gc.collect()

    def empty_cache(self):
        torch = self.torch
        torch.cuda.synchronize()
        torch.cuda.empty_cache()       # runs gpu-arena's reset hook
        left = gpu_arena.stats(0)["reserved_bytes"]
        gpu_arena.empty_cache()
        return {"reserved_after_torch_empty_cache": left,
                "reserved": gpu_arena.stats(0)["reserved_bytes"]}

    def _sums(self, t, mark_stride):
        torch = self.torch
        flat = t.view(-1)
        total = float(t.sum(dtype=torch.float32).item())
        marks = float(flat[::mark_stride].sum(dtype=torch.float32).item())
        return {"total": total, "marks": marks, "count": int(flat[::mark_stride].numel())}

    def open(self, items, mark_stride=None, pickled=False):
        out = []
        for it in items:
            share = gpu_arena.Share.from_base64(it["b64"])
            if pickled:  # the pickle path (what torch.multiprocessing queues do)
                import pickle

                share = pickle.loads(pickle.dumps(share))
            t0 = now()
            t = gpu_arena.open(share)
            t1 = now()
            self.opened[it["name"]] = t
            r = {"dt": t1 - t0, "t_end": t1, "shape": list(t.shape), "dtype": str(t.dtype)}
            if mark_stride:
                r.update(self._sums(t, mark_stride))
            out.append(r)
        return out

    def checksum(self, names, mark_stride):
        return [self._sums(self.opened[n], mark_stride) for n in names]

    def write(self, name, index, value):
        self.opened[name].view(-1)[index] = value
        self.torch.cuda.synchronize()

    def read(self, name, index):
        v = self.tensors[name].view(-1)[index]
        return float(v.item())

    def close(self, names, how="explicit"):
        t0 = now()
        for name in names:
            t = self.opened.pop(name)
            if how == "explicit":
                gpu_arena.close(t)
            del t
        gc.collect()
        return {"seconds": now() - t0, "imports_live": gpu_arena.imports_live()}


class SimOps(Common):
    """The same ops over the sim backend: buffers are gpu_arena.malloc'd host memory."""

    SIZES = {"float32": 4, "bfloat16": 2}

    def __init__(self, conf):
        super().__init__()
        gpu_arena.configure(conf)
        gpu_arena.init()
        self.capacity = 64 << 30
        for kv in conf.split(","):
            k, _, v = kv.partition("=")
            if k.strip() == "sim_capacity" and v.strip().endswith("GiB"):
                self.capacity = int(v.strip()[:-3]) << 30
        self.tensors = {}   # name -> (ptr, nbytes, dtype)
        self.shares = {}
        self.opened = {}    # name -> (ptr, nbytes, dtype)

    def info(self):
        return {"pid": os.getpid(), "mode": "sim", "backend": gpu_arena.backend_name(),
                "lib": gpu_arena.lib_path()}

    def mem(self):
        # A stand-in: this process's capacity minus what its pool holds.
        return [self.capacity - gpu_arena.stats(0)["reserved_bytes"], self.capacity]

    @staticmethod
    def _numel(shape):
        n = 1
        for s in shape:
            n *= s
        return n

    def _put(self, ptr, dtype, index, value):
        if dtype == "float32":
            ctypes.c_float.from_address(ptr + 4 * index).value = value
        else:
            bits = struct.unpack("<I", struct.pack("<f", value))[0] >> 16
            ctypes.c_uint16.from_address(ptr + 2 * index).value = bits

    def _get(self, ptr, dtype, index):
        if dtype == "float32":
            return ctypes.c_float.from_address(ptr + 4 * index).value
        bits = ctypes.c_uint16.from_address(ptr + 2 * index).value
        return struct.unpack("<f", struct.pack("<I", bits << 16))[0]

    def alloc(self, names, shape, dtype, mark_stride, mark_values, zero=True):
        t0 = now()
        size = self.SIZES[dtype]
        numel = self._numel(shape)
        for name, value in zip(names, mark_values):
            nbytes = numel * size
            p = gpu_arena.malloc(nbytes)
            ctypes.memset(p, 0, nbytes)
            for i in range(0, numel, mark_stride):
                self._put(p, dtype, i, value)
            self.tensors[name] = (p, nbytes, dtype)
        return {"seconds": now() - t0}

    def share(self, names):
        out = []
        for name in names:
            p, nbytes, dtype = self.tensors[name]
            t0 = now()
            h = gpu_arena.share_ptr(p, nbytes)
            s = gpu_arena.Share(h, dtype, (nbytes // self.SIZES[dtype],), (1,), 0, h.device,
                                nbytes, "cpu")
            s._owner = True
            t1 = now()
            self.shares.setdefault(name, []).append(s)
            out.append({"b64": s.to_base64(), "t0": t0, "dt": t1 - t0,
                        "arena": h.arena_id, "offset": h.offset})
        return out

    def unshare(self, names):
        for name in names:
            for s in self.shares.pop(name, []):
                s.close()

    def free(self, names):
        for name in names:
            p, nbytes, _ = self.tensors.pop(name)
            gpu_arena.free(p, nbytes)

    def empty_cache(self):
        gpu_arena.empty_cache()
        r = gpu_arena.stats(0)["reserved_bytes"]
        return {"reserved_after_torch_empty_cache": r, "reserved": r}

    def _sums(self, rec, mark_stride):
        p, nbytes, dtype = rec
        numel = nbytes // self.SIZES[dtype]
        marks = [self._get(p, dtype, i) for i in range(0, numel, mark_stride)]
        if dtype == "float32":
            total = sum(array.array("f", ctypes.string_at(p, nbytes)))
        else:  # the neighbours of every mark must be zero
            total = sum(marks) + sum(self._get(p, dtype, i + 1)
                                     for i in range(0, numel - 1, mark_stride))
        return {"total": float(total), "marks": float(sum(marks)), "count": len(marks)}

    def open(self, items, mark_stride=None, pickled=False):
        out = []
        for it in items:
            share = gpu_arena.Share.from_base64(it["b64"])
            if pickled:
                import pickle

                share = pickle.loads(pickle.dumps(share))
            t0 = now()
            p = gpu_arena.import_handle(share.handle)
            t1 = now()
            rec = (p, share.nbytes, share.dtype)
            self.opened[it["name"]] = rec
            r = {"dt": t1 - t0, "t_end": t1, "shape": list(share.shape), "dtype": share.dtype}
            if mark_stride:
                r.update(self._sums(rec, mark_stride))
            out.append(r)
        return out

    def checksum(self, names, mark_stride):
        return [self._sums(self.opened[n], mark_stride) for n in names]

    def write(self, name, index, value):
        p, _, dtype = self.opened[name]
        self._put(p, dtype, index, value)

    def read(self, name, index):
        p, _, dtype = self.tensors[name]
        return self._get(p, dtype, index)

    def close(self, names, how="explicit"):
        t0 = now()
        for name in names:
            p, _, _ = self.opened.pop(name)
            gpu_arena.close_import(p)
        return {"seconds": now() - t0, "imports_live": gpu_arena.imports_live()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("torch", "sim"), default="torch")
    ap.add_argument("--conf", default=None)
    a = ap.parse_args()
    try:
        if a.mode == "torch":
            ops = TorchOps(a.conf)
        else:
            ops = SimOps(a.conf or "backend=sim,sim_capacity=64GiB")
    except BaseException as e:  # noqa: BLE001 - reported to the driver
        emit({"error": f"start-up failed: {type(e).__name__}: {e}",
              "trace": traceback.format_exc()})
        raise SystemExit(1)
    emit({"ready": os.getpid(), "info": ops.info()})
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        req = json.loads(line)
        op = req["op"]
        if op == "exit":
            emit({"ok": None})
            break
        try:
            emit({"ok": getattr(ops, op)(**req.get("args", {}))})
        except BaseException as e:  # noqa: BLE001 - reported to the driver
            emit({"error": f"{op}: {type(e).__name__}: {e}", "trace": traceback.format_exc()})
    sys.stdout.flush()


if __name__ == "__main__":
    main()
