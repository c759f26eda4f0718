"""Could a first sleep skip pinning its host buffers? (issue #24, "Sleep's host side")

Sleep's first offload pins fresh host memory (huge pages faulted in by 16 threads, then one
`cuMemHostRegister` a piece): the register is serial in the driver and the pinning, not the
copy, sets the pace (1.65-2.11x the raw pinned copy; h200-2026-12-03-first-sleep-knobs.md).
This measures the other way: copy each piece into a small ring of pinned staging slots and
let T threads move it from there into fresh pageable memory (faulting it in as they write),
so no register is on the path at all; the buffers could be pinned later, off the critical
path, for the next sleeps.

For SIZE GiB, in one process (libcuda through ctypes, no torch), ROUNDS times, in turns:
- `copy`: the raw device-to-host copy into memory already pinned (the reference);
- `ring`: the copy through SLOTS x SLOT_MIB pinned slots (made once, before timing; their
  cost printed apart) on two streams into fresh huge-page memory, T threads moving each
  slot's bytes out; every chunk's first and last bytes checked afterwards;
- `fault`: fresh huge-page memory faulted in by T threads (memset), no copy (what the
  kernel's zeroing alone costs).

Usage (GPU machine): python3 bench/gpu/stage_probe.py [--gib 32] [--slots 4] [--slot-mib 256]
    [--threads 16] [--rounds 2]   Prints a table and one JSON line; writes $OUT/stage_probe.json.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor

GIB = 1 << 30
MIB = 1 << 20
MADV_HUGEPAGE = 14
cu = ctypes.CDLL("libcuda.so.1")
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
u64 = ctypes.c_uint64


def ck(r, what):
    if r != 0:
        raise RuntimeError(f"{what}: CUresult {r}")


def huge_anon(size):
    p = libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if p in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap")
    libc.madvise(p, size, MADV_HUGEPAGE)
    return p


def spans(size, parts, align=2 * MIB):
    """`size` bytes as `parts` (offset, length) spans of `align` multiples."""
    step = (size // parts + align - 1) // align * align
    return [(o, min(step, size - o)) for o in range(0, size, step)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=32)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--slot-mib", type=int, default=256)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    size = int(a.gib * GIB) // (2 * MIB) * (2 * MIB)
    slot = a.slot_mib * MIB

    ck(cu.cuInit(0), "cuInit")
    dev = ctypes.c_int()
    ck(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    ctx = ctypes.c_void_p()
    ck(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "retain")
    ck(cu.cuCtxSetCurrent(ctx), "set current")
    dptr = u64()
    ck(cu.cuMemAlloc_v2(ctypes.byref(dptr), ctypes.c_size_t(size)), "cuMemAlloc")
    # Each chunk's bytes: its index (mod 251) + 1, so a misplaced chunk shows.
    for k, off in enumerate(range(0, size, slot)):
        n = min(slot, size - off)
        ck(cu.cuMemsetD8_v2(u64(dptr.value + off), ctypes.c_ubyte(k % 251 + 1), ctypes.c_size_t(n)), "memset")
    ck(cu.cuCtxSynchronize(), "sync")
    streams = [ctypes.c_void_p() for _ in range(2)]
    for s in streams:
        ck(cu.cuStreamCreate(ctypes.byref(s), 1), "stream")
    pool = ThreadPoolExecutor(a.threads)

    # The reference: pinned memory made before timing.
    pinned = huge_anon(size)
    list(pool.map(lambda sp: ctypes.memset(pinned + sp[0], 0, sp[1]), spans(size, a.threads)))
    ck(cu.cuMemHostRegister_v2(ctypes.c_void_p(pinned), ctypes.c_size_t(size), 1), "register")

    def copy():
        t0 = time.perf_counter()
        ck(cu.cuMemcpyDtoHAsync_v2(ctypes.c_void_p(pinned), dptr, ctypes.c_size_t(size), streams[0]), "DtoH")
        ck(cu.cuStreamSynchronize(streams[0]), "sync")
        return time.perf_counter() - t0

    # The staging slots, made once (a sleep would keep them).
    t0 = time.perf_counter()
    slots = []
    for _ in range(a.slots):
        p = ctypes.c_void_p()
        ck(cu.cuMemHostAlloc(ctypes.byref(p), ctypes.c_size_t(slot), 0), "cuMemHostAlloc")
        slots.append(p.value)
    slot_setup = time.perf_counter() - t0
    events = []
    for _ in range(a.slots):
        e = ctypes.c_void_p()
        ck(cu.cuEventCreate(ctypes.byref(e), 2), "event")  # CU_EVENT_DISABLE_TIMING
        events.append(e)

    def ring():
        dst = huge_anon(size)
        t0 = time.perf_counter()
        busy = [[] for _ in range(a.slots)]  # futures moving each slot's bytes out
        issued = []  # (slot index, offset, length) in order, waiting for their copy
        chunks = [(off, min(slot, size - off)) for off in range(0, size, slot)]

        def drain_oldest():
            i, off, n = issued.pop(0)
            ck(cu.cuEventSynchronize(events[i]), "event sync")
            src = slots[i]
            busy[i] = [pool.submit(ctypes.memmove, dst + off + o, src + o, m)
                       for o, m in spans(n, a.threads)]

        for k, (off, n) in enumerate(chunks):
            i = k % a.slots
            if len(issued) == a.slots:
                drain_oldest()
            for f in busy[i]:
                f.result()
            s = streams[k % 2]
            ck(cu.cuMemcpyDtoHAsync_v2(ctypes.c_void_p(slots[i]), u64(dptr.value + off), ctypes.c_size_t(n), s), "DtoH")
            ck(cu.cuEventRecord(events[i], s), "record")
            issued.append((i, off, n))
        while issued:
            drain_oldest()
        for fs in busy:
            for f in fs:
                f.result()
        dt = time.perf_counter() - t0
        bad = 0
        for k, (off, n) in enumerate(chunks):
            want = k % 251 + 1
            if ctypes.string_at(dst + off, 1)[0] != want or ctypes.string_at(dst + off + n - 1, 1)[0] != want:
                bad += 1
        libc.munmap(dst, size)
        return dt, bad

    def fault():
        dst = huge_anon(size)
        t0 = time.perf_counter()
        list(pool.map(lambda sp: ctypes.memset(dst + sp[0], 0, sp[1]), spans(size, a.threads)))
        dt = time.perf_counter() - t0
        libc.munmap(dst, size)
        return dt

    rows = []
    for r in range(a.rounds):
        c = copy()
        g, bad = ring()
        f = fault()
        rows.append({"round": r + 1, "copy_s": c, "ring_s": g, "ring_bad_chunks": bad, "fault_s": f})

    gb = size / 1e9
    print(f"{size / GIB:.1f} GiB, {a.slots} slots of {a.slot_mib} MiB (made in {slot_setup * 1e3:.1f} ms), {a.threads} threads")
    print("| round | raw pinned copy | through the ring into fresh memory | ring / copy | fault-in alone | chunks wrong |")
    print("|---:|---:|---:|---:|---:|---:|")
    for x in rows:
        print(f"| {x['round']} | {x['copy_s']:.3f} s ({gb / x['copy_s']:.1f} GB/s) | {x['ring_s']:.3f} s ({gb / x['ring_s']:.1f} GB/s) "
              f"| {x['ring_s'] / x['copy_s']:.2f}x | {x['fault_s']:.3f} s ({gb / x['fault_s']:.1f} GB/s) | {x['ring_bad_chunks']} |")
    report = {"gib": size / GIB, "slots": a.slots, "slot_mib": a.slot_mib, "threads": a.threads,
              "slot_setup_s": slot_setup, "rounds": rows}
    print(json.dumps(report))
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "stage_probe.json"), "w") as fh:
            json.dump(report, fh, indent=1)
    cu.cuMemHostUnregister(ctypes.c_void_p(pinned))
    libc.munmap(pinned, size)
    cu.cuMemFree_v2(dptr)
    return 1 if any(x["ring_bad_chunks"] for x in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
