#!/usr/bin/env python3
"""The child side of gpu_multi_gpu.py: every piece of GPU work runs in a fresh interpreter,
``python3 tests/gpu/multi_gpu_children.py NAME RESULT_PATH PARAMS_JSON``. A child installs
gpu-arena (``route="native"``; PyTorch's own allocator for the controls) before torch touches
CUDA and hands its result back as JSON in RESULT_PATH (a temporary file renamed into place);
its stdout and stderr are only a log (NCCL, NIXL and torch write there). The processes of one
check meet through small JSON files in a work folder (``publish`` / ``wait_all``); a process
that fails writes ``abort`` there so that its peers stop waiting.

This module holds the shared helpers, ``prep``, ``pools`` (one process, every GPU) and the two
roles of ``import`` (cross-device share / open). ``multi_gpu_dist.py`` holds the DDP and
tensor-parallel ranks, ``multi_gpu_nixl.py`` the prefill / decode roles of the NIXL checks;
their names are dispatched from here. What each check proves: gpu_multi_gpu.py's docstring.
Nothing heavy is imported at the top."""

from __future__ import annotations

import ctypes
import glob
import json
import os
import sys
import time
import traceback

import gpu_common  # noqa: F401  (beside this file: python/ and tests/python/ on sys.path)
from torch_native_common import setup, write_result

MiB, GiB = 1 << 20, 1 << 30


# --------------------------------------------------------------------------------------
# coordination between the processes of one check: JSON files in a work folder
# --------------------------------------------------------------------------------------


def publish(work, name, obj=None):
    write_result(os.path.join(work, name), {} if obj is None else obj)


def wait_all(work, names, timeout):
    """{name: its JSON} once every file in ``names`` exists; raises when a peer aborted or
    after ``timeout`` seconds."""
    deadline = time.time() + timeout
    pending, got = list(names), {}
    abort = os.path.join(work, "abort")
    while True:
        for n in list(pending):
            path = os.path.join(work, n)
            if os.path.exists(path):
                with open(path) as f:
                    got[n] = json.load(f)
                pending.remove(n)
        if not pending:
            return got
        if os.path.exists(abort):
            with open(abort) as f:
                raise RuntimeError(f"a peer aborted: {f.read()[:800]}")
        if time.time() > deadline:
            raise TimeoutError(f"waited {timeout:.0f} s for {pending[:6]}")
        time.sleep(0.005)


# --------------------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------------------


def ordered_pairs(n):
    """Every ordered pair of distinct GPUs; (0, 0) alone on a one-GPU machine."""
    return [(i, j) for i in range(n) for j in range(n) if i != j] or [(0, 0)]


def pattern(torch, n, device, seed):
    """``n`` int32 values on ``device``, a function of (index, seed) only: the same bytes on
    every device, so a copy is verified against a pattern made where it landed."""
    mix = (int(seed) * 2654435761 + 12345) & 0x7FFFFFFF
    return torch.arange(n, dtype=torch.int32, device=device).bitwise_xor_(mix)


def sync(torch, devices):
    for d in sorted(set(devices)):
        torch.cuda.synchronize(d)


def free_mem(torch, dev):
    torch.cuda.synchronize(dev)
    return int(torch.cuda.mem_get_info(dev)[0])


def arena_ranges(ga, dev):
    return [(int(a["base"]), int(a["bytes"])) for d in ga.snapshot()["devices"] if d["device"] == dev
            for a in d["arenas"]]


def inside(ranges, ptr):
    return any(b <= ptr < b + n for b, n in ranges)


def empty_all(torch, ga):
    """Every allocator cache on every device back to the driver."""
    for d in range(torch.cuda.device_count()):
        torch.cuda.synchronize(d)
    if ga is not None:
        import gpu_arena.torch as gt

        gt.empty_cache()
    else:
        torch.cuda.empty_cache()


def reserved(torch, ga, dev):
    return int(ga.stats(dev)["reserved_bytes"]) if ga is not None else int(torch.cuda.memory_reserved(dev))


def find_cudart():
    """(path of libcudart, how it was found) or (None, why not): the one torch loaded (from
    /proc/self/maps, so the same runtime and contexts), else one beside torch or in the
    nvidia wheels, else the loader's."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6 and os.path.basename(parts[-1]).startswith("libcudart.so"):
                    return parts[-1], "loaded by torch (/proc/self/maps)"
    except OSError:
        pass
    import torch

    tdir = os.path.dirname(torch.__file__)
    site = os.path.dirname(tdir)
    for pat in (f"{tdir}/lib/libcudart.so*", f"{site}/nvidia/*/lib/libcudart.so*",
                f"{site}/nvidia/cuda_runtime/lib/libcudart.so*"):
        hits = sorted(glob.glob(pat))
        if hits:
            return hits[-1], f"found by {pat}"
    for name in ("libcudart.so", "libcudart.so.13", "libcudart.so.12"):
        try:
            ctypes.CDLL(name)
            return name, "the dynamic loader's"
        except OSError:
            continue
    return None, "no libcudart.so* loaded by torch, beside it or in the nvidia wheels"


class Cudart:
    """The few CUDA runtime calls the peer-copy baseline needs, through ctypes."""

    def __init__(self, path):
        L = self.lib = ctypes.CDLL(path)
        vp, i, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
        L.cudaMemcpyPeer.argtypes = [vp, i, vp, i, sz]
        L.cudaMalloc.argtypes = [ctypes.POINTER(vp), sz]
        L.cudaFree.argtypes = [vp]
        L.cudaSetDevice.argtypes = [i]
        L.cudaGetDevice.argtypes = [ctypes.POINTER(i)]
        L.cudaGetErrorString.restype = ctypes.c_char_p
        for fn in ("cudaMemcpyPeer", "cudaMalloc", "cudaFree", "cudaSetDevice", "cudaGetDevice"):
            getattr(L, fn).restype = i

    def check(self, rc, what):
        if rc != 0:
            raise RuntimeError(f"{what}: cudaError {rc} ({self.lib.cudaGetErrorString(rc).decode()})")

    def malloc(self, dev, n):
        cur = ctypes.c_int(0)
        self.check(self.lib.cudaGetDevice(ctypes.byref(cur)), "cudaGetDevice")
        self.check(self.lib.cudaSetDevice(dev), "cudaSetDevice")
        p = ctypes.c_void_p(0)
        try:
            self.check(self.lib.cudaMalloc(ctypes.byref(p), n), f"cudaMalloc({n}) on {dev}")
        finally:
            self.lib.cudaSetDevice(cur.value)
        return p.value

    def free(self, ptr):
        self.check(self.lib.cudaFree(ptr), "cudaFree")

    def peer(self, dst, dst_dev, src, src_dev, n):
        self.check(self.lib.cudaMemcpyPeer(dst, dst_dev, src, src_dev, n), "cudaMemcpyPeer")


def bandwidth(torch, fn, nbytes, devs, reps, rounds):
    """GB/s of ``fn`` (one copy of ``nbytes``): the median of ``rounds`` timings of ``reps``
    calls, each round ended by synchronizing ``devs``; one warm-up call first."""
    fn()
    sync(torch, devs)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync(torch, devs)
        times.append(time.perf_counter() - t0)
    times.sort()
    return round(reps * nbytes / times[len(times) // 2] / 1e9, 1)


# --------------------------------------------------------------------------------------
# prep: build the native allocator and the NIXL plugin once; say what the machine has
# --------------------------------------------------------------------------------------


def child_prep(p):
    t0 = time.perf_counter()
    torch, ga = setup("native")
    import gpu_arena.torch as gt

    out = {"install_s": round(time.perf_counter() - t0, 1), "route": gt.route_in_use(),
           "backend": ga.backend_name(), "lib": ga.lib_path(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "python": sys.version.split()[0]}
    n = torch.cuda.device_count()
    out["gpu_arena_device_count"] = ga.device_count()
    out["devices"] = [{"index": d, "name": torch.cuda.get_device_name(d),
                       "total": int(torch.cuda.get_device_properties(d).total_memory),
                       "free": int(torch.cuda.mem_get_info(d)[0])} for d in range(n)]
    out["peer_access"] = [[True if i == j else bool(torch.cuda.can_device_access_peer(i, j))
                           for j in range(n)] for i in range(n)]
    try:
        out["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
    except Exception as e:  # noqa: BLE001 - reported
        out["nccl"] = f"unknown ({type(e).__name__})"
    out["cudart"], out["cudart_how"] = find_cudart()
    out["host_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        import gpu_arena.nixl_backend as nb

        t0 = time.perf_counter()
        out["nixl_plugin_dir"] = str(nb.enable())
        out["nixl_package"] = list(nb.nixl_package()[:2])
        out["nixl_build_s"] = round(time.perf_counter() - t0, 1)
    except Exception as e:  # noqa: BLE001 - the NIXL checks say "not run" with this
        out["nixl_error"] = f"{type(e).__name__}: {e}"
    return out


# --------------------------------------------------------------------------------------
# pools: one process, every GPU (gpu-arena native, or PyTorch's allocator as the control)
# --------------------------------------------------------------------------------------


def child_pools(p):
    mode = p["mode"]
    torch, ga = setup(mode)
    n = torch.cuda.device_count()
    pairs = ordered_pairs(n)
    small, half = p["small_bytes"] // 4, p["small_bytes"] // 8
    reps, rounds = p["reps"], p["rounds"]
    res = {"mode": mode, "devices": n, "pairs": pairs}
    # 1. The GPUs are used one after the other: two tensors (and their arenas) on cuda:d
    #    before cuda:d+1 is touched, so for i < j GPU i's arena predates GPU j's first use.
    first, early, ranges_then = [], [], []
    for d in range(n):
        first.append(pattern(torch, small, d, d))
        early.append(torch.zeros(small, dtype=torch.int32, device=d))
        torch.cuda.synchronize(d)
        if ga is not None:
            ranges_then.append(arena_ranges(ga, d))
    res["first_devices"] = [str(t.device) for t in first]
    if ga is not None:
        import gpu_arena.torch as gt

        res["route"], res["backend"] = gt.route_in_use(), ga.backend_name()
        res["gpu_arena_device_count"] = ga.device_count()
        res["in_own_arenas"] = [inside(ranges_then[d], first[d].data_ptr())
                                and inside(ranges_then[d], early[d].data_ptr()) for d in range(n)]
        res["reserved_per_device"] = [reserved(torch, ga, d) for d in range(n)]
    # 2. Every ordered pair: a memcpy, a copy kernel writing the peer's memory, and a kernel on
    #    GPU j writing into GPU i's early arena; every byte checked where it landed.
    rows = []
    for i, j in pairs:
        r = {"pair": [i, j], "arena_predates_peer": i < j}
        exp = pattern(torch, small, j, i)
        dst = torch.empty(small, dtype=torch.int32, device=j)
        dst.copy_(first[i])  # same dtype, contiguous: cudaMemcpyAsync between the devices
        r["memcpy_ok"] = bool(torch.equal(dst, exp))
        f = torch.empty(small, dtype=torch.float32, device=j)
        f.copy_(first[i])  # a dtype change: torch's copy kernel on GPU i writes GPU j's memory
        sync(torch, (i, j))
        r["kernel_to_peer_ok"] = bool(torch.equal(f, exp.float()))
        early[i][:half].copy_(dst[::2][:half])  # strided source: a kernel on GPU j writes GPU i
        sync(torch, (i, j))
        r["kernel_into_early_arena_ok"] = bool(torch.equal(early[i][:half], pattern(torch, small, i, i)[::2][:half]))
        early[i].zero_()
        rows.append(r)
        del dst, f, exp
    # 3. Bandwidth of every ordered pair, three ways in the same loop: torch's copy_ on this
    #    allocator's memory, cudaMemcpyPeer on the same buffers, cudaMemcpyPeer on cudaMalloc's.
    nb = p["big_bytes"] // 4
    nbytes = nb * 4
    big_src = [pattern(torch, nb, d, 100 + d) for d in range(n)]
    big_dst = [torch.empty(nb, dtype=torch.int32, device=d) for d in range(n)]
    path, how = find_cudart()
    res["cudart"] = {"path": path, "how": how}
    cud, raw, lib = None, {}, None
    if path:
        try:
            lib = Cudart(path)
            for d in range(n):
                raw[d] = (lib.malloc(d, nbytes), lib.malloc(d, nbytes))
            cud = lib
        except Exception as e:  # noqa: BLE001 - reported: the baseline is then the torch child
            res["cudart"]["error"] = f"{type(e).__name__}: {e}"
    for r, (i, j) in zip(rows, pairs):
        r["copy_gbps"] = bandwidth(torch, lambda: big_dst[j].copy_(big_src[i]), nbytes, (i, j), reps, rounds)
        exp = pattern(torch, nb, j, 100 + i)
        r["big_copy_ok"] = bool(torch.equal(big_dst[j], exp))
        if cud is not None:
            big_dst[j].zero_()
            sync(torch, (i, j))
            r["peer_gbps"] = bandwidth(torch, lambda: cud.peer(big_dst[j].data_ptr(), j, big_src[i].data_ptr(), i,
                                                               nbytes), nbytes, (i, j), reps, rounds)
            r["peer_copy_ok"] = bool(torch.equal(big_dst[j], exp))
            r["raw_peer_gbps"] = bandwidth(torch, lambda: cud.peer(raw[j][1], j, raw[i][0], i, nbytes), nbytes,
                                           (i, j), reps, rounds)
        del exp
    for a, b in raw.values():
        lib.free(a)
        lib.free(b)
    big_src = big_dst = None
    empty_all(torch, ga)
    res["rows"] = rows
    # 4. At scale, per device: a fraction of its free memory in 1 GiB tensors, each verified,
    #    then freed: the device's free memory back to what it was.
    for d in range(n):  # the kernels used below, loaded before the baselines
        w = torch.empty(MiB, dtype=torch.uint8, device=d)
        w.fill_(3)
        bool((w == 3).all())
        del w
    empty_all(torch, ga)
    cap = []
    for d in range(n):
        before, res_before = free_mem(torch, d), reserved(torch, ga, d)
        k = int(before * p["capacity_frac"]) // GiB
        ts = []
        for t in range(k):
            x = torch.empty(GiB, dtype=torch.uint8, device=d)
            x.fill_((d * 31 + t) % 251)
            ts.append(x)
        ok = all(bool((x == (d * 31 + t) % 251).all()) for t, x in enumerate(ts))
        during = reserved(torch, ga, d)
        ts = x = None
        empty_all(torch, ga)
        cap.append({"device": d, "gib": k, "verified": ok, "reserved_before": res_before,
                    "reserved_during": during, "reserved_after": reserved(torch, ga, d),
                    "free_before": before, "free_after": free_mem(torch, d)})
    res["capacity"] = cap
    if ga is not None:
        res["validate"] = []
        for d in range(n):
            try:
                ga.validate(d)
                res["validate"].append("ok")
            except Exception as e:  # noqa: BLE001 - reported
                res["validate"].append(f"FAILED: {e}")
        res["stats"] = [ga.stats(d) for d in range(n)]
    return res


# --------------------------------------------------------------------------------------
# import: a producer per GPU shares one tensor per consumer; a consumer per GPU opens them all
# --------------------------------------------------------------------------------------


def _warm_kernels(torch, devices, home):
    """The kernels the import roles run (the same expressions), on every device and every pair
    with ``home``, loaded (and the contexts made) before the baselines are read: CUDA loads
    kernels lazily, into device memory, which would read as a leak."""
    for d in devices:
        a = pattern(torch, 4096, d, 1)
        b = torch.empty(4096, dtype=torch.int32, device=home)
        b.copy_(a)
        f = torch.empty(4096, dtype=torch.float32, device=home)
        f.copy_(a)
        a[:1024].copy_(-5 - torch.arange(1024, dtype=torch.int32, device=home))
        a[1024:2048].copy_((-35 - torch.arange(2048, dtype=torch.int32, device=home))[::2])
        for x in (a, b):
            bool(torch.equal(x[:1024], -5 - torch.arange(1024, dtype=torch.int32, device=x.device)))
            bool(torch.equal(x[:1024], -35 - torch.arange(0, 2048, 2, dtype=torch.int32, device=x.device)))
            bool(torch.equal(x[2048:], pattern(torch, 4096, x.device, 1)[2048:]))
        bool(torch.equal(f, b.float()))
    sync(torch, list(devices) + [home])


def child_import_producer(p):
    torch, ga = setup("native")
    import gpu_arena.torch as gt

    i, n, work, tmo = p["dev"], p["n"], p["work"], p["timeout"]
    torch.cuda.set_device(i)
    _warm_kernels(torch, [i], i)
    gt.empty_cache()
    publish(work, f"up-p{i}", {"pid": os.getpid()})
    ups = wait_all(work, [f"up-{r}{d}" for r in "pc" for d in range(n)], tmo)
    base = free_mem(torch, i)
    m_all = p["bytes"] // 4
    m = m_all // 8
    tensors = {j: pattern(torch, m_all, i, 1000 * i + j) for j in range(n)}
    torch.cuda.synchronize(i)
    shares = {j: ga.share(t) for j, t in tensors.items()}
    st = ga.stats(i)
    publish(work, f"share-{i}", {"shares": {str(j): s.to_base64() for j, s in shares.items()},
                                 "exports_live": st["exports_live"]})
    done = wait_all(work, [f"done-c{j}" for j in range(n)], tmo)
    seen = {}
    for j, t in tensors.items():
        tag = 1 + 1000 * i + j
        w1 = -tag - torch.arange(m, dtype=torch.int32, device=i)
        w2 = -7 * tag - torch.arange(0, 2 * m, 2, dtype=torch.int32, device=i)
        seen[str(j)] = {"memcpy_write": bool(torch.equal(t[:m], w1)),
                        "kernel_write": bool(torch.equal(t[m:2 * m], w2)),
                        "rest_intact": bool(torch.equal(t[2 * m:], pattern(torch, m_all, i, 1000 * i + j)[2 * m:]))}
    exports = st["exports_live"]
    for s in shares.values():
        s.close()
    tensors = t = w1 = w2 = None
    gt.empty_cache()
    time.sleep(0.2)  # the driver frees asynchronously on some paths
    gt.empty_cache()
    after = ga.stats(i)
    alive = [_alive(v["pid"]) for k, v in ups.items() if k.startswith("up-c")]
    out = {"dev": i, "base_free": base, "free_after": free_mem(torch, i), "exports_live": exports,
           "reserved_after": after["reserved_bytes"], "exports_after": after["exports_live"],
           "seen": seen, "consumers_alive_at_measure": all(alive),
           "consumer_imports_live": {k: v.get("imports_live") for k, v in done.items()}}
    publish(work, f"prod-done-{i}", {})
    return out


def _alive(pid):
    try:
        os.kill(int(pid), 0)
        return True
    except (OSError, ValueError):
        return False


def child_import_consumer(p):
    torch, ga = setup("native")
    import gpu_arena.torch as gt
    from gpu_arena.tensors import Share

    j, n, work, tmo = p["dev"], p["n"], p["work"], p["timeout"]
    torch.cuda.set_device(j)
    _warm_kernels(torch, range(n), j)
    gt.empty_cache()
    publish(work, f"up-c{j}", {"pid": os.getpid()})
    wait_all(work, [f"up-{r}{d}" for r in "pc" for d in range(n)], tmo)
    metas = wait_all(work, [f"share-{i}" for i in range(n)], tmo)
    m_all = p["bytes"] // 4
    m = m_all // 8
    rows = {}
    for i in range(n):
        s = Share.from_base64(metas[f"share-{i}"]["shares"][str(j)])
        t0 = time.perf_counter()
        t = ga.open(s)
        open_ms = (time.perf_counter() - t0) * 1e3
        r = {"open_ms": round(open_ms, 3), "device": str(t.device), "on_producer_device": t.device.index == i}
        exp = pattern(torch, m_all, j, 1000 * i + j)
        local = torch.empty_like(exp)
        local.copy_(t)  # a copy from the imported mapping into this GPU's memory
        r["read_ok"] = bool(torch.equal(local, exp))
        f = torch.empty(m_all, dtype=torch.float32, device=j)
        f.copy_(t)  # a kernel on GPU i reads the mapping and writes GPU j's memory
        sync(torch, (i, j))
        r["kernel_read_ok"] = bool(torch.equal(f, exp.float()))
        tag = 1 + 1000 * i + j
        t[:m].copy_(-tag - torch.arange(m, dtype=torch.int32, device=j))  # GPU j's bytes into the mapping
        src2 = -7 * tag - torch.arange(2 * m, dtype=torch.int32, device=j)
        t[m:2 * m].copy_(src2[::2])  # strided: a kernel on GPU j writes the mapping on GPU i
        sync(torch, (i, j))
        r["closed"] = ga.close(t)
        t = local = f = exp = src2 = None
        rows[str(i)] = r
    gt.empty_cache()
    live = ga.imports_live()
    publish(work, f"done-c{j}", {"imports_live": live})
    wait_all(work, [f"prod-done-{i}" for i in range(n)], tmo)  # alive while the producers measure
    return {"dev": j, "rows": rows, "imports_live_after_close": live}


# --------------------------------------------------------------------------------------


def _table():
    t = {"prep": child_prep, "pools": child_pools, "import_producer": child_import_producer,
         "import_consumer": child_import_consumer}
    import multi_gpu_dist
    import multi_gpu_nixl

    t.update(multi_gpu_dist.CHILDREN)
    t.update(multi_gpu_nixl.CHILDREN)
    return t


def main(argv):
    name, result_path, params = argv[1], argv[2], json.loads(argv[3])
    try:
        res = _table()[name](params)
    except BaseException:  # noqa: BLE001 - reported to the parent, and the peers told
        res = {"child_error": traceback.format_exc()}
        if params.get("work"):
            try:
                publish(params["work"], "abort", {"who": f"{name} {params.get('dev', '')} pid {os.getpid()}",
                                                   "error": res["child_error"][-600:]})
            except OSError:
                pass
    write_result(result_path, res)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown (NCCL, NIXL): its frees are not under test here


if __name__ == "__main__":
    main(sys.argv)
