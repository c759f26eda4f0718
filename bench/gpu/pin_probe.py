"""How fast host memory can be pinned for sleep's offload, against the copy it serves (issue
#24, "Sleep's host side"): the first sleep of 100 GiB took 37.3 s, the copy alone 1.95 s.
Measures, on one GPU, for SIZE GiB: cuMemHostAlloc; mmap + cuMemHostRegister in one call;
the same split over 1..N threads (each a chunk, the context current in each); with the pages
touched first (MAP_POPULATE); the pinned device-to-host copy; a copy into pageable memory;
and a pipeline where threads pin chunks ahead while the copy runs into the pinned ones.
`--only-driver`: the driver's own pinned memory made from several threads at once
(cuMemHostAlloc of --chunk-mib chunks; cuMemCreate of host-located memory, mapped), each
followed by a copy into it.
`--only-overlap`: whether pinning and copying can run at once: registering fresh faulted
pieces alone, the copy alone, and both at once with synchronous copies, with asynchronous
copies (a stream, synchronized per piece), and faulting (no register) beside the copy.

Usage (GPU machine): python3 bench/gpu/pin_probe.py [--gib 16] [--threads 1,4,8,16]
Prints one JSON line; libcuda only (ctypes), no torch.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import threading
import time

GIB = 1 << 30
cu = ctypes.CDLL("libcuda.so.1")
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
MAP_POPULATE = 0x8000
PORTABLE = 1
u64 = ctypes.c_uint64


def ck(r, what):
    if r != 0:
        raise RuntimeError(f"{what}: CUresult {r}")


ck(cu.cuInit(0), "cuInit")
dev = ctypes.c_int()
ck(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
ctx = ctypes.c_void_p()
ck(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "retain")
ck(cu.cuCtxSetCurrent(ctx), "set current")


def current():
    ck(cu.cuCtxSetCurrent(ctx), "set current")


def anon(size, populate=False):
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (MAP_POPULATE if populate else 0)
    p = libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
    if p in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap")
    return p


def register(p, size, threads):
    chunk = (size // threads + (2 << 20) - 1) // (2 << 20) * (2 << 20)
    errs = []

    def one(i):
        current()
        off = i * chunk
        n = min(chunk, size - off)
        if n > 0:
            r = cu.cuMemHostRegister_v2(ctypes.c_void_p(p + off), ctypes.c_size_t(n), PORTABLE)
            if r:
                errs.append(r)
    ts = [threading.Thread(target=one, args=(i,)) for i in range(threads)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    dt = time.perf_counter() - t0
    if errs:
        raise RuntimeError(f"cuMemHostRegister: {errs[:3]}")
    return dt, chunk


def unregister(p, size, chunk):
    for off in range(0, size, chunk):
        cu.cuMemHostUnregister(ctypes.c_void_p(p + off))


def touch(p, size, threads):
    """Fault `size` bytes at `p` in from `threads` threads (memset of each's chunk)."""
    chunk = (size // threads + (2 << 20) - 1) // (2 << 20) * (2 << 20)

    def one(i):
        off = i * chunk
        n = min(chunk, size - off)
        if n > 0:
            ctypes.memset(ctypes.c_void_p(p + off), 0, n)
    ts = [threading.Thread(target=one, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def dtoh(dst, src, size):
    t0 = time.perf_counter()
    ck(cu.cuMemcpyDtoH_v2(ctypes.c_void_p(dst), u64(src), ctypes.c_size_t(size)), "DtoH")
    return time.perf_counter() - t0


def ahead(a, res, size, d):
    """Sleep's pin-ahead, emulated: buffers of --buf-gib, each made by one of W workers
    (huge-page mmap, faulted by K threads, one register), copied into in order by the main
    thread as they come; for every W x K of --workers / --fault-threads."""
    buf = int(a.buf_gib * GIB)
    n = size // buf
    for w in [int(x) for x in a.workers.split(",")]:
        for k in [int(x) for x in a.fault_threads.split(",")]:
            ptrs = [None] * n
            ready = [threading.Event() for _ in range(n)]
            nxt = [0]
            lock = threading.Lock()

            def worker():
                current()
                while True:
                    with lock:
                        i = nxt[0]
                        nxt[0] += 1
                    if i >= n:
                        return
                    p = anon(buf)
                    libc.madvise(ctypes.c_void_p(p), ctypes.c_size_t(buf), 14)
                    touch(p, buf, k)
                    ck(cu.cuMemHostRegister_v2(ctypes.c_void_p(p), ctypes.c_size_t(buf), PORTABLE), "register")
                    ptrs[i] = p
                    ready[i].set()
            t0 = time.perf_counter()
            ts = [threading.Thread(target=worker) for _ in range(w)]
            for t in ts:
                t.start()
            for i in range(n):
                ready[i].wait()
                if a.async_copy:  # queued on the legacy stream and waited for (the library's way)
                    ck(cu.cuMemcpyDtoHAsync_v2(ctypes.c_void_p(ptrs[i]), u64(d.value + i * buf), ctypes.c_size_t(buf), ctypes.c_void_p(1)), "DtoHAsync")
                    ck(cu.cuStreamSynchronize(ctypes.c_void_p(1)), "sync")
                else:
                    ck(cu.cuMemcpyDtoH_v2(ctypes.c_void_p(ptrs[i]), u64(d.value + i * buf), ctypes.c_size_t(buf)), "DtoH")
            for t in ts:
                t.join()
            res[f"ahead_{w}w_{k}t_s"] = round(time.perf_counter() - t0, 3)
            for p in ptrs:
                cu.cuMemHostUnregister(ctypes.c_void_p(p))
                libc.munmap(ctypes.c_void_p(p), buf)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=16)
    ap.add_argument("--threads", default="1,4,8,16")
    ap.add_argument("--chunk-mib", type=int, default=512)
    ap.add_argument("--huge-pipeline", action="store_true", help="the pipeline on MADV_HUGEPAGE memory")
    ap.add_argument("--skip-basic", action="store_true", help="only the touch and pipeline modes")
    ap.add_argument("--only-ahead", action="store_true", help="only the pin-ahead emulation")
    ap.add_argument("--workers", default="", help="pin-ahead emulation: worker counts, e.g. 1,2,4")
    ap.add_argument("--fault-threads", default="16", help="pin-ahead emulation: faulting threads per buffer")
    ap.add_argument("--buf-gib", type=float, default=1.0)
    ap.add_argument("--async-copy", action="store_true", help="pin-ahead emulation: asynchronous copies")
    ap.add_argument("--only-overlap", action="store_true", help="only the pin/copy overlap modes")
    ap.add_argument("--piece-gib", default="1", help="--only-overlap: piece sizes to register, e.g. 1,4,16")
    ap.add_argument("--only-driver", action="store_true", help="only the driver's pinned memory from threads")
    a = ap.parse_args()
    size = int(a.gib * GIB)
    res = {"gib": a.gib, "cpus": os.cpu_count()}
    d = u64()
    ck(cu.cuMemAlloc_v2(ctypes.byref(d), ctypes.c_size_t(size)), "cuMemAlloc")
    ck(cu.cuMemsetD8_v2(d, 7, ctypes.c_size_t(size)), "memset")
    cu.cuCtxSynchronize()
    if a.only_overlap:
        overlap_modes(a, res, size, d)
        return finish(res, size)
    if a.only_driver:
        driver_modes(a, res, size, d)
        return finish(res, size)
    if a.only_ahead:
        ahead(a, res, size, d)
        # The copy it serves, same run: into memory pinned beforehand.
        p = anon(size)
        libc.madvise(ctypes.c_void_p(p), ctypes.c_size_t(size), 14)
        touch(p, size, 16)
        register(p, size, 1)
        dtoh(p, d.value, size)
        res["copy_pinned_s"] = round(dtoh(p, d.value, size), 3)
        cu.cuMemHostUnregister(ctypes.c_void_p(p))
        libc.munmap(ctypes.c_void_p(p), size)
        print(json.dumps(res))
        return
    if a.skip_basic:
        return rest(a, res, size, d)
    # cuMemHostAlloc: what sleep does today.
    h = ctypes.c_void_p()
    t0 = time.perf_counter()
    ck(cu.cuMemHostAlloc(ctypes.byref(h), ctypes.c_size_t(size), PORTABLE), "cuMemHostAlloc")
    res["hostalloc_s"] = round(time.perf_counter() - t0, 3)
    res["copy_pinned_first_s"] = round(dtoh(h.value, d.value, size), 3)
    res["copy_pinned_s"] = round(dtoh(h.value, d.value, size), 3)
    t0 = time.perf_counter()
    cu.cuMemFreeHost(h)
    res["freehost_s"] = round(time.perf_counter() - t0, 3)
    # Pageable memory, no pinning at all.
    p = anon(size)
    res["copy_pageable_first_s"] = round(dtoh(p, d.value, size), 3)
    res["copy_pageable_s"] = round(dtoh(p, d.value, size), 3)
    libc.munmap(ctypes.c_void_p(p), size)
    # mmap + cuMemHostRegister, 1..N threads; fresh (unfaulted) pages, and prefaulted.
    for populate in (False, True):
        for n in [int(x) for x in a.threads.split(",")]:
            t0 = time.perf_counter()
            p = anon(size, populate)
            mm = time.perf_counter() - t0
            reg, chunk = register(p, size, n)
            key = f"register_{'populated_' if populate else ''}{n}t"
            res[key + "_s"] = round(reg, 3)
            if populate:
                res[key + "_mmap_s"] = round(mm, 3)
            if n == 1 and not populate:
                res["copy_registered_s"] = round(dtoh(p, d.value, size), 3)
            unregister(p, size, chunk)
            libc.munmap(ctypes.c_void_p(p), size)
    return rest(a, res, size, d)


def rest(a, res, size, d):
    # Faulting the pages in from N threads (each touches its chunk), plain or as
    # transparent huge pages (madvise), then one register of the faulted memory.
    for huge in (False, True):
        for n in [int(x) for x in a.threads.split(",")]:
            p = anon(size)
            if huge:
                libc.madvise(ctypes.c_void_p(p), ctypes.c_size_t(size), 14)  # MADV_HUGEPAGE
            t0 = time.perf_counter()
            touch(p, size, n)
            fault = time.perf_counter() - t0
            reg, chunk = register(p, size, 1)
            key = f"{'huge_' if huge else ''}touch_{n}t"
            res[key + "_fault_s"] = round(fault, 3)
            res[key + "_register_s"] = round(reg, 3)
            unregister(p, size, chunk)
            libc.munmap(ctypes.c_void_p(p), size)
    # A pipeline: N threads pin chunks ahead, the main thread copies each pinned chunk.
    chunk = a.chunk_mib << 20
    for n in [int(x) for x in a.threads.split(",") if int(x) > 1]:
        p = anon(size)
        if a.huge_pipeline:
            libc.madvise(ctypes.c_void_p(p), ctypes.c_size_t(size), 14)
        ready = [threading.Event() for _ in range(0, size, chunk)]
        nxt = [0]
        lock = threading.Lock()

        def pinner():
            current()
            while True:
                with lock:
                    i = nxt[0]
                    nxt[0] += 1
                if i >= len(ready):
                    return
                off = i * chunk
                n_ = min(chunk, size - off)
                ctypes.memset(ctypes.c_void_p(p + off), 0, n_)  # fault in (parallel)
                ck(cu.cuMemHostRegister_v2(ctypes.c_void_p(p + off), ctypes.c_size_t(n_), PORTABLE), "register")
                ready[i].set()
        t0 = time.perf_counter()
        ts = [threading.Thread(target=pinner) for _ in range(n)]
        for t in ts:
            t.start()
        for i, ev in enumerate(ready):
            ev.wait()
            off = i * chunk
            ck(cu.cuMemcpyDtoH_v2(ctypes.c_void_p(p + off), u64(d.value + off), ctypes.c_size_t(min(chunk, size - off))), "DtoH")
        for t in ts:
            t.join()
        res[f"pipeline_{n}t_s"] = round(time.perf_counter() - t0, 3)
        unregister(p, size, chunk)
        libc.munmap(ctypes.c_void_p(p), size)
    if a.workers:
        ahead(a, res, size, d)
    cu.cuMemFree_v2(d)
    finish(res, size)


def finish(res, size):
    for k in list(res):
        if k.endswith("_s") and res[k]:
            res[k.replace("_s", "_gbps")] = round(size / res[k] / 1e9, 1)
    print(json.dumps(res))


class Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class AllocProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", AllocFlags)]


class AccessDesc(ctypes.Structure):
    _fields_ = [("location", Location), ("flags", ctypes.c_int)]


def parallel(n, count, fn):
    """Run fn(i) for i in 0..count on n threads (the context current in each); seconds."""
    nxt = [0]
    lock = threading.Lock()
    errs = []

    def one():
        current()
        while True:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= count:
                return
            try:
                fn(i)
            except Exception as e:  # noqa: BLE001 - reported below
                errs.append(repr(e))
    ts = [threading.Thread(target=one) for _ in range(n)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errs:
        raise RuntimeError(errs[0])
    return time.perf_counter() - t0


def driver_modes(a, res, size, d):
    chunk = a.chunk_mib << 20
    count = size // chunk
    threads = [int(x) for x in a.threads.split(",")]
    # cuMemHostAlloc, chunk by chunk from n threads.
    for n in threads:
        ptrs = [0] * count

        def alloc(i):
            h = ctypes.c_void_p()
            ck(cu.cuMemHostAlloc(ctypes.byref(h), ctypes.c_size_t(chunk), PORTABLE), "cuMemHostAlloc")
            ptrs[i] = h.value
        res[f"hostalloc_{n}t_s"] = round(parallel(n, count, alloc), 3)
        t0 = time.perf_counter()
        for i, p in enumerate(ptrs):
            ck(cu.cuMemcpyDtoH_v2(ctypes.c_void_p(p), u64(d.value + i * chunk), ctypes.c_size_t(chunk)), "DtoH")
        res[f"hostalloc_{n}t_copy_s"] = round(time.perf_counter() - t0, 3)
        for p in ptrs:
            cu.cuMemFreeHost(ctypes.c_void_p(p))
    # cuMemCreate of host-located memory (CU_MEM_LOCATION_TYPE_HOST_NUMA, node 0), mapped and
    # made accessible to the device, chunk by chunk from n threads.
    prop = AllocProp()
    prop.type = 1  # PINNED
    prop.location = Location(3, 0)  # HOST_NUMA, node 0
    gran = ctypes.c_size_t()
    r = cu.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(prop), 0)
    res["host_numa_granularity"] = gran.value if r == 0 else f"CUresult {r}"
    if r != 0:
        return
    va = u64()
    ck(cu.cuMemAddressReserve(ctypes.byref(va), ctypes.c_size_t(size), ctypes.c_size_t(0), u64(0), u64(0)), "reserve")
    for n in threads:
        handles = [0] * count

        def create(i):
            h = u64()
            ck(cu.cuMemCreate(ctypes.byref(h), ctypes.c_size_t(chunk), ctypes.byref(prop), u64(0)), "cuMemCreate host")
            handles[i] = h.value
            ck(cu.cuMemMap(u64(va.value + i * chunk), ctypes.c_size_t(chunk), ctypes.c_size_t(0), u64(h.value), u64(0)), "map")
            acc = AccessDesc(Location(1, 0), 3)  # the device, read-write (the copy engine's side)
            ck(cu.cuMemSetAccess(u64(va.value + i * chunk), ctypes.c_size_t(chunk), ctypes.byref(acc), ctypes.c_size_t(1)), "access")
        try:
            res[f"host_numa_{n}t_s"] = round(parallel(n, count, create), 3)
        except RuntimeError as e:
            res[f"host_numa_{n}t_error"] = str(e)
            for i, h in enumerate(handles):
                if h:
                    cu.cuMemUnmap(u64(va.value + i * chunk), ctypes.c_size_t(chunk))
                    cu.cuMemRelease(u64(h))
            break
        t0 = time.perf_counter()
        ck(cu.cuMemcpy(u64(va.value), u64(d.value), ctypes.c_size_t(size)), "copy into host numa")
        res[f"host_numa_{n}t_copy_s"] = round(time.perf_counter() - t0, 3)
        t0 = time.perf_counter()
        for i, h in enumerate(handles):
            cu.cuMemUnmap(u64(va.value + i * chunk), ctypes.c_size_t(chunk))
            cu.cuMemRelease(u64(h))
        res[f"host_numa_{n}t_free_s"] = round(time.perf_counter() - t0, 3)
    cu.cuMemAddressFree(va, ctypes.c_size_t(size))
    # The copy they serve, same run: into huge pages faulted and pinned beforehand.
    p = anon(size)
    libc.madvise(ctypes.c_void_p(p), ctypes.c_size_t(size), 14)
    touch(p, size, 16)
    reg, _ = register(p, size, 1)
    res["huge_16t_register_s"] = round(reg, 3)
    dtoh(p, d.value, size)
    res["copy_pinned_s"] = round(dtoh(p, d.value, size), 3)
    cu.cuMemHostUnregister(ctypes.c_void_p(p))
    libc.munmap(ctypes.c_void_p(p), size)



def overlap_modes(a, res, size, d):
    for g in [float(x) for x in a.piece_gib.split(",")]:
        one_piece_size(res, size, d, int(g * GIB), f"_{g:g}g" if "," in a.piece_gib else "")


def one_piece_size(res, size, d, piece, sfx):
    n = size // piece
    dst = anon(size)  # the copies' destination, pinned once
    libc.madvise(ctypes.c_void_p(dst), ctypes.c_size_t(size), 14)
    touch(dst, size, 16)
    register(dst, size, 1)
    stream = ctypes.c_void_p()
    ck(cu.cuStreamCreate(ctypes.byref(stream), 1), "stream")  # non-blocking

    def fresh(register_too=False):
        p = anon(size)
        libc.madvise(ctypes.c_void_p(p), ctypes.c_size_t(size), 14)
        touch(p, size, 16)
        return p

    def reg_pieces(p):
        current()
        for i in range(n):
            ck(cu.cuMemHostRegister_v2(ctypes.c_void_p(p + i * piece), ctypes.c_size_t(piece), PORTABLE), "register")

    def drop(p):
        for i in range(n):
            cu.cuMemHostUnregister(ctypes.c_void_p(p + i * piece))
        libc.munmap(ctypes.c_void_p(p), size)

    def copy(asynchronous):
        for i in range(n):
            off = i * piece
            if asynchronous:
                ck(cu.cuMemcpyDtoHAsync_v2(ctypes.c_void_p(dst + off), u64(d.value + off), ctypes.c_size_t(piece), stream), "DtoHAsync")
                ck(cu.cuStreamSynchronize(stream), "sync")
            else:
                ck(cu.cuMemcpyDtoH_v2(ctypes.c_void_p(dst + off), u64(d.value + off), ctypes.c_size_t(piece)), "DtoH")

    def timed(fn):
        t0 = time.perf_counter()
        fn()
        return round(time.perf_counter() - t0, 3)

    def both(side, asynchronous):
        th = threading.Thread(target=side)
        t0 = time.perf_counter()
        th.start()
        copy(asynchronous)
        tc = time.perf_counter() - t0
        th.join()
        return round(time.perf_counter() - t0, 3), round(tc, 3)

    copy(False)  # warm
    res["copy_sync" + sfx + "_s"] = timed(lambda: copy(False))
    res["copy_async" + sfx + "_s"] = timed(lambda: copy(True))
    p = fresh()
    res["register_alone" + sfx + "_s"] = timed(lambda: reg_pieces(p))
    drop(p)
    for asynchronous in (False, True):
        p = fresh()
        total, tc = both(lambda: reg_pieces(p), asynchronous)
        k = "async" if asynchronous else "sync"
        res[f"register_beside_copy_{k}{sfx}_s"], res[f"copy_{k}_beside_register{sfx}_s"] = total, tc
        drop(p)
    # Faulting fresh huge pages (16 threads) beside the copy, nothing registered.
    q = anon(size)
    libc.madvise(ctypes.c_void_p(q), ctypes.c_size_t(size), 14)
    t0 = time.perf_counter()
    touch(q, size, 16)
    res["fault_alone" + sfx + "_s"] = round(time.perf_counter() - t0, 3)
    libc.munmap(ctypes.c_void_p(q), size)
    q = anon(size)
    libc.madvise(ctypes.c_void_p(q), ctypes.c_size_t(size), 14)
    res["fault_beside_copy" + sfx + "_s"], res["copy_beside_fault" + sfx + "_s"] = both(lambda: touch(q, size, 16), True)
    libc.munmap(ctypes.c_void_p(q), size)
    cu.cuMemHostUnregister(ctypes.c_void_p(dst))
    libc.munmap(ctypes.c_void_p(dst), size)


if __name__ == "__main__":
    main()
