"""gpu_arena.share / open / close with PyTorch on the sim backend: CPU tensors over sim
memory (host memory), so the whole tensor-level path (Share pickling and bytes, DLPack
wrapping, views, explicit close, close on garbage collection, torch.multiprocessing) runs
without a GPU. Needs torch (CPU is enough); skipped without it. Every test runs in a fresh
interpreter (gpu-arena's init is process-global).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from conftest import result_of, run_python

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None, reason="torch is not installed")

ENV = {"GPU_ARENA_BACKEND": "sim", "GPU_ARENA_TESTS": str(Path(__file__).resolve().parent)}

PRELUDE = r'''
import ctypes, gc, json, os, pickle, subprocess, sys
import torch
import gpu_arena
from result_channel import report
gpu_arena.configure("backend=sim,arena_size=64MiB")
gpu_arena.init()

def gpu_arena_tensor(n, dtype=torch.float32):
    """A CPU tensor over a gpu-arena (sim) allocation of n elements."""
    nbytes = n * torch.tensor([], dtype=dtype).element_size()
    p = gpu_arena.malloc(nbytes)
    buf = (ctypes.c_uint8 * nbytes).from_address(p)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype), p, nbytes
'''


def run(code: str, timeout: float = 120):
    return result_of(run_python(PRELUDE + code, env=ENV, timeout=timeout))


def test_open_views_gc_and_explicit_close_in_process():
    r = run(r'''
out = {}
base, p, nbytes = gpu_arena_tensor(1 << 18)
base.copy_(torch.arange(1 << 18, dtype=torch.float32))
v = base.view(512, 512)[3:7, 100:110]            # a strided view with a storage offset
s = gpu_arena.share(v)
out["owner"] = s.owner
out["meta"] = [s.dtype, list(s.shape), list(s.stride), s.storage_offset, s.nbytes]
for how, s2 in (("pickle", pickle.loads(pickle.dumps(s))),
                ("bytes", gpu_arena.Share.from_bytes(s.to_bytes()))):
    t = gpu_arena.open(s2)
    out[how + "_equal"] = torch.equal(t, v)
    out[how + "_meta"] = [list(t.shape), list(t.stride()), t.storage_offset()]
    out[how + "_other_mapping"] = t.untyped_storage().data_ptr() != p
    out[how + "_storage"] = t.untyped_storage().nbytes()
    del t; gc.collect()
# Writes go both ways.
t = gpu_arena.open(s)
t[0, 0] = -1.0
base[3 * 512 + 101] = -2.0
out["writes"] = [v[0, 0].item(), t[0, 1].item()]
# A view keeps the import; the last tensor's collection closes it.
w = t[1:2]
del t; gc.collect()
out["live_with_view"] = gpu_arena.imports_live()
del w; gc.collect()
out["live_after_gc"] = gpu_arena.imports_live()
# Explicit close, then idempotent; close through a view of another open.
t = gpu_arena.open(s)
out["close"] = [gpu_arena.close(t), gpu_arena.close(t), gpu_arena.imports_live()]
del t; gc.collect()
t = gpu_arena.open(s); u = t[2]
out["close_view"] = [gpu_arena.close(u), gpu_arena.imports_live()]
del t, u; gc.collect()
# Closing a consumer's copy of the Share closes this process's imports of it.
c = pickle.loads(pickle.dumps(s))
t1 = gpu_arena.open(c); t2 = gpu_arena.open(c)
out["share_close"] = [gpu_arena.imports_live(), gpu_arena.close(c), gpu_arena.imports_live()]
del t1, t2; gc.collect()
out["stats_imports"] = gpu_arena.stats()["imports_live"]
s.close(); s.close()
out["closed"] = s.closed
try:
    gpu_arena.open(s)
except gpu_arena.IpcError as e:
    out["after_unshare"] = e.code
del v, base
gpu_arena.free(p, nbytes)
gpu_arena.empty_cache()
st = gpu_arena.stats()
out["end"] = [st["reserved_bytes"], st["shares_live"], st["exports_live"]]
report(out)
''')
    assert r["owner"] is True
    assert r["meta"] == ["float32", [4, 10], [512, 1], 3 * 512 + 100, 4 << 18]
    for how in ("pickle", "bytes"):
        assert r[how + "_equal"] is True
        assert r[how + "_meta"] == [[4, 10], [512, 1], 3 * 512 + 100]
        assert r[how + "_other_mapping"] is True
        assert r[how + "_storage"] == 4 << 18, "the whole storage is shared"
    assert r["writes"] == [-1.0, -2.0]
    assert r["live_with_view"] == 1
    assert r["live_after_gc"] == 0
    assert r["close"] == [1, 0, 0]
    assert r["close_view"] == [1, 0]
    assert r["share_close"] == [2, 2, 0]
    assert r["stats_imports"] == 0
    assert r["closed"] is True
    assert r["after_unshare"] == -9
    assert r["end"] == [0, 0, 0]


def test_dtypes_and_errors():
    r = run(r'''
out = {}
for name in ("bfloat16", "float16", "int8", "int64", "bool", "complex64"):
    dt = getattr(torch, name)
    base, p, nbytes = gpu_arena_tensor(4096, dt)
    base.copy_(torch.arange(4096).to(dt))
    s = gpu_arena.share(base[17:])
    t = gpu_arena.open(gpu_arena.Share.from_bytes(s.to_bytes()))
    out[name] = [t.dtype == dt, torch.equal(t, base[17:])]
    del t; gc.collect()
    s.close(); del base; gpu_arena.free(p, nbytes)
try:
    gpu_arena.share(torch.zeros(10))                  # torch's memory, not gpu-arena's
except gpu_arena.UnknownPointerError as e:
    out["foreign"] = e.code
try:
    gpu_arena.share([1, 2])
except TypeError:
    out["not_tensor"] = True
try:
    gpu_arena.close(torch.zeros(3))
except ValueError:
    out["close_foreign"] = True
try:
    gpu_arena.close("x")
except TypeError:
    out["close_type"] = True
base, p, nbytes = gpu_arena_tensor(1024)
s = gpu_arena.share(base)
bad = gpu_arena.Share(s.handle, "not_a_dtype", s.shape, s.stride, 0, 0, s.nbytes)
try:
    gpu_arena.open(bad)
except ValueError:
    out["bad_dtype"] = True
bad = gpu_arena.Share(s.handle, "float32", (2048,), (1,), 0, 0, s.nbytes)   # past the storage
try:
    gpu_arena.open(bad)
except gpu_arena.InvalidArgumentError as e:      # refused by the library, before the import
    out["bad_view"] = ["reaches outside" in str(e), gpu_arena.imports_live()]
s.close(); del base; gpu_arena.free(p, nbytes); gpu_arena.empty_cache()
out["reserved"] = gpu_arena.stats()["reserved_bytes"]
report(out)
''')
    for name in ("bfloat16", "float16", "int8", "int64", "bool", "complex64"):
        assert r[name] == [True, True], name
    assert r["foreign"] == -3
    assert r["not_tensor"] and r["close_foreign"] and r["close_type"] and r["bad_dtype"]
    assert r["bad_view"] == [True, 0], "a view past the storage imports nothing"
    assert r["reserved"] == 0


def test_torch_multiprocessing_spawn_pickles_the_share():
    r = run(r'''
import torch.multiprocessing as mp
sys.path.insert(0, os.environ["GPU_ARENA_TESTS"])
import ipc_torch_helpers
if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=ipc_torch_helpers.consumer, args=(q_in, q_out))
    proc.start()
    out = {}
    base, p, nbytes = gpu_arena_tensor(64)
    base.copy_(torch.arange(64, dtype=torch.float32))
    for how in ("close", "gc"):
        s = gpu_arena.share(base[8:12])
        q_in.put((s, how))
        values, live_open, live_after = q_out.get(timeout=60)
        out[how] = [values, live_open, live_after, base[8:12].tolist()]
        base[8:12] = torch.arange(8, 12, dtype=torch.float32)
        s.close()
    q_in.put(None)
    proc.join(60)
    out["exitcode"] = proc.exitcode
    out["imports_live"] = gpu_arena.stats()["imports_live"]
    report(out)
''')
    for how in ("close", "gc"):
        values, live_open, live_after, seen = r[how]
        assert values == [8.0, 9.0, 10.0, 11.0]
        assert (live_open, live_after) == (1, 0), how
        assert seen == [-7.0] * 4, "the consumer's writes reach the producer"
    assert r["exitcode"] == 0
    assert r["imports_live"] == 0


def test_imports_closed_from_other_threads_and_by_the_cycle_collector():
    r = run(r'''
import threading
out = {}
base, p, nbytes = gpu_arena_tensor(1 << 16)
s = gpu_arena.share(base)
# Tensors freed on another thread: torch runs the deleter there.
ts = [gpu_arena.open(s) for _ in range(20)]
out["opened"] = gpu_arena.imports_live()
th = threading.Thread(target=lambda: ts.clear())
th.start(); th.join()
out["after_thread_free"] = gpu_arena.imports_live()
# Tensors in reference cycles: closed when the cycle collector frees them.
class Holder:
    pass
for _ in range(10):
    h = Holder(); h.me = h; h.t = gpu_arena.open(s)
del h
out["in_cycles"] = gpu_arena.imports_live()
gc.collect()
out["after_collect"] = gpu_arena.imports_live()
# Threads opening, closing and dropping at once.
errors = []
def churn(i):
    try:
        for k in range(50):
            t = gpu_arena.open(s)
            assert t.numel() == 1 << 16
            if (k + i) % 2:
                gpu_arena.close(t)
            del t
    except Exception as e:
        errors.append(repr(e))
threads = [threading.Thread(target=churn, args=(i,)) for i in range(4)]
for t in threads: t.start()
for t in threads: t.join()
gc.collect()
out["churn"] = [errors, gpu_arena.imports_live(), len(gpu_arena.ipc.open_imports())]
s.close(); del base; gpu_arena.free(p, nbytes); gpu_arena.empty_cache()
out["reserved"] = gpu_arena.stats()["reserved_bytes"]
report(out)
''')
    assert r["opened"] == 20
    assert r["after_thread_free"] == 0
    assert r["in_cycles"] == 10 and r["after_collect"] == 0
    assert r["churn"] == [[], 0, 0]
    assert r["reserved"] == 0


def test_open_builds_the_view_in_the_library():
    # gpu_arena_import_dlpack builds the DLPack tensor with the view's dtype, shape and
    # strides when the view spans its whole storage from offset 0 (no as_strided), else the
    # whole storage 1-D (then as_strided); torch dtypes without a DLPack dtype come as bytes.
    r = run(r'''
from gpu_arena import _dlpack, _imports
out = {}
base, p, nbytes = gpu_arena_tensor(1 << 12)
base.copy_(torch.arange(1 << 12, dtype=torch.float32))
for name, v in (("whole", base.view(64, 64)), ("transposed", base.view(64, 64).t()),
                ("offset", base.view(64, 64)[1:]), ("short", base[:100])):
    s = gpu_arena.share(v)
    t = gpu_arena.open(gpu_arena.Share.from_bytes(s.to_bytes()))
    out[name] = [torch.equal(t, v), list(t.stride()), t.storage_offset(),
                 t.untyped_storage().nbytes(), t.untyped_storage().data_ptr() == _imports.records()[-1].ptr]
    out[name + "_listed"] = [len(gpu_arena.ipc.open_imports()), gpu_arena.ipc.open_imports()[0]["nbytes"]]
    out[name + "_close"] = [gpu_arena.close(t), gpu_arena.close(t), gpu_arena.imports_live()]
    del t; gc.collect()
    s.close()
out["records_after"] = len(_imports.records())
# A dtype torch has no DLPack dtype for: bytes, then a view.
s = gpu_arena.share(base.view(64, 64)[2:])
c = gpu_arena.Share.from_bytes(s.to_bytes())
_dlpack._specs[torch.float32] = _dlpack.DtypeSpec(torch.float32, 1 | 8 << 8 | 1 << 16, 1, True)
gpu_arena.tensors._specs.clear()
t = gpu_arena.open(c)
out["bytes_then_view"] = [t.dtype == torch.float32, torch.equal(t, base.view(64, 64)[2:])]
del t; gc.collect()
_dlpack._specs.clear(); gpu_arena.tensors._specs.clear()
# torch refusing the capsule: the import is closed, nothing leaks.
real = _dlpack._from_capsule
def refuse(torch_):
    def f(capsule):
        raise RuntimeError("refused")
    return f
_dlpack._from_capsule = refuse
try:
    gpu_arena.open(c)
except RuntimeError:
    out["refused"] = [gpu_arena.imports_live(), len(_imports.records())]
_dlpack._from_capsule = real
# A share whose nbytes disagrees with its handle: a ValueError, nothing imported.
bad = gpu_arena.Share(s.handle, "float32", (4,), (1,), 0, 0, s.nbytes + 4)
try:
    gpu_arena.open(bad)
except ValueError as e:
    out["bad_nbytes"] = ["the share says" in str(e), gpu_arena.imports_live()]
# A storage that is no whole number of elements (1001 bytes as float32).
b8, p8, n8 = gpu_arena_tensor(1001, torch.uint8)
s8 = gpu_arena.share(b8)
bad = gpu_arena.Share(s8.handle, "float32", (1,), (1,), 1, 0, n8)
try:
    gpu_arena.open(bad)
except ValueError as e:
    out["odd_storage"] = ["whole number" in str(e), gpu_arena.imports_live()]
s8.close(); del b8; gpu_arena.free(p8, n8)
s.close(); del base; gpu_arena.free(p, nbytes); gpu_arena.empty_cache()
out["reserved"] = gpu_arena.stats()["reserved_bytes"]
report(out)
''')
    n = 4 << 12
    assert r["whole"] == [True, [64, 1], 0, n, True]
    assert r["transposed"] == [True, [1, 64], 0, n, True]
    assert r["offset"] == [True, [64, 1], 64, n, True]
    assert r["short"] == [True, [1], 0, n, True]
    for name in ("whole", "transposed", "offset", "short"):
        assert r[name + "_listed"] == [1, n], name
        assert r[name + "_close"] == [1, 0, 0], name
    assert r["records_after"] == 0
    assert r["bytes_then_view"] == [True, True]
    assert r["refused"] == [0, 0]
    assert r["bad_nbytes"] == [True, 0]
    assert r["odd_storage"] == [True, 0]
    assert r["reserved"] == 0


def test_import_dlpack_refuses_bad_input_and_release_checks_its_pointer():
    # The C calls under open(), driven directly: a bad view (reaching outside the share, an
    # unknown dtype code) is refused before the import (nothing imported, nothing listed);
    # gpu_arena_release_dlpack refuses a pointer that is not a live managed tensor of the
    # library (a bogus one, or one released already) without reading it.
    r = run(r'''
import struct, threading
from gpu_arena import _imports, _lib
from gpu_arena.pointers import _ipc_fn
out = {}
base, p, nbytes = gpu_arena_tensor(1024)
s = gpu_arena.share(base)
imp, release = _ipc_fn("gpu_arena_import_dlpack"), _ipc_fn("gpu_arena_release_dlpack")
F32 = 2 | 32 << 8 | 1 << 16
HEAD = _lib.GPU_ARENA_DLPACK_VIEW_HEAD
def call(dtype, offset, shape, stride, flat=0, itemsize=4, device=(1, 0)):
    view = struct.pack(f"={HEAD + 2 * len(shape)}q", nbytes, dtype, itemsize, *device, flat,
                       offset, len(shape), *shape, *stride)
    o = _lib.GpuArenaDlpack()
    rc = imp(s.handle, view, HEAD + 2 * len(shape), ctypes.byref(o))
    return rc, o
state = lambda: [gpu_arena.imports_live(), len(_imports.records())]
for name, args in (("past_end", (F32, 0, [1025], [1])), ("offset_out", (F32, 1, [1024], [1])),
                   ("flat_past_end", (F32, 0, [2048], [1], 1)),
                   ("negative_reach", (F32, 0, [1024], [-1])),
                   ("overflow", (F32, 0, [2], [2**63 - 1])),
                   ("unknown_code", (99 | 32 << 8 | 1 << 16, 0, [1024], [1])),
                   ("other_device", (F32, 0, [1024], [1], 0, 4, (2, 3)))):
    rc, o = call(*args)
    out[name] = [rc, "dlpack" in gpu_arena.last_error()] + state()
# A managed tensor no consumer took: released once; a second release, or a bogus pointer,
# is refused (UNKNOWN_POINTER) and changes nothing.
rc, o = call(F32, 0, [1024], [1])
out["imported"] = [rc, o.flat, o.ndim] + state()
rc2, o2 = call(F32, 0, [32, 32], [32, 1])
out["bogus"] = [release(12345), release(o.managed + 8)] + state()
out["release"] = [release(o.managed)] + state()
out["again"] = [release(o.managed)] + state()
# Released after an explicit close: closes nothing twice.
out["close_then_release"] = [_ipc_fn("gpu_arena_close_dlpack")(o2.id), release(o2.managed)] + state()
# close() racing the deleter on another thread: each import closed exactly once.
ts = [gpu_arena.open(gpu_arena.Share.from_bytes(s.to_bytes())) for _ in range(200)]
ids = [t._gpu_arena_import for t in ts]
def drop():
    while ts:
        ts.pop()
th = threading.Thread(target=drop)
th.start()
closed = sum(_imports.close(i) for i in ids)
th.join(); gc.collect()
out["race"] = [closed <= 200] + state()
s.close(); del base; gpu_arena.free(p, nbytes); gpu_arena.empty_cache()
out["reserved"] = gpu_arena.stats()["reserved_bytes"]
report(out)
''')
    invalid, unknown = -1, -3
    for name in ("past_end", "offset_out", "flat_past_end", "negative_reach", "overflow",
                 "unknown_code", "other_device"):
        assert r[name] == [invalid, True, 0, 0], name
    assert r["imported"] == [0, 0, 1, 1, 1]
    assert r["bogus"] == [unknown, unknown, 2, 2]
    assert r["release"] == [0, 1, 1]
    assert r["again"] == [unknown, 1, 1]
    assert r["close_then_release"] == [1, 0, 0, 0]
    assert r["race"] == [True, 0, 0]
    assert r["reserved"] == 0
