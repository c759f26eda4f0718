#!/usr/bin/env python3
"""Section (a') of gpu_ipc_check.py, the cause gpu-arena exists for, in a process of its own
without gpu-arena or torch: the naive CUDA VMM flow through ctypes on libcuda.so.1
(cuMemCreate + map, cuMemExportToShareableHandle, then unmap + release with the fd left
open: the memory stays held until close(fd)).

    python3 tests/gpu/naive_export.py BYTES     # reports its JSON to gpu_ipc_check.py
                                                # (tests/python/result_channel.py)
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
import traceback

MiB = 1 << 20
TOL = 2 * MiB  # how close "back to baseline" must be


def gb(x: float) -> str:
    """As the seed prints it: GiB with one decimal, called GB."""
    return f"{x / 1024**3:.1f} GB"


class CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class CUmemAllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class CUmemAllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int),
                ("location", CUmemLocation), ("win32HandleMetaData", ctypes.c_void_p),
                ("allocFlags", CUmemAllocFlags)]


class CUmemAccessDesc(ctypes.Structure):
    _fields_ = [("location", CUmemLocation), ("flags", ctypes.c_int)]


assert ctypes.sizeof(CUmemAllocationProp) == 32, ctypes.sizeof(CUmemAllocationProp)
assert ctypes.sizeof(CUmemAccessDesc) == 12, ctypes.sizeof(CUmemAccessDesc)

CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0


class Driver:
    """The few CUDA driver calls the naive flow needs, through ctypes."""

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")
        u64, sz, i, vp = ctypes.c_ulonglong, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p
        P = ctypes.POINTER
        self.sigs = {
            "cuInit": [ctypes.c_uint],
            "cuDeviceGet": [P(i), i],
            "cuDevicePrimaryCtxRetain": [P(vp), i],
            "cuDevicePrimaryCtxRelease": [i],
            "cuCtxSetCurrent": [vp],
            "cuMemGetInfo": [P(sz), P(sz)],
            "cuMemGetAllocationGranularity": [P(sz), P(CUmemAllocationProp), i],
            "cuMemCreate": [P(u64), sz, P(CUmemAllocationProp), u64],
            "cuMemAddressReserve": [P(u64), sz, sz, u64, u64],
            "cuMemMap": [u64, sz, sz, u64, u64],
            "cuMemSetAccess": [u64, sz, P(CUmemAccessDesc), sz],
            "cuMemExportToShareableHandle": [vp, u64, i, u64],
            "cuMemUnmap": [u64, sz],
            "cuMemRelease": [u64],
            "cuMemAddressFree": [u64, sz],
        }
        self.names = {}
        for name, argtypes in self.sigs.items():
            fn = None
            for n in (name + "_v2", name):  # the _v2 entry point where the driver has one
                fn = getattr(self.lib, n, None)
                if fn is not None:
                    self.names[name] = n
                    break
            if fn is None:
                raise RuntimeError(f"libcuda.so.1 has no {name}")
            fn.restype = ctypes.c_int
            fn.argtypes = argtypes
            setattr(self, name, self._checked(name, fn))
        self.lib.cuGetErrorString.restype = ctypes.c_int
        self.lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]

    def _checked(self, name, fn):
        def call(*args):
            rc = fn(*args)
            if rc != 0:
                msg = ctypes.c_char_p()
                self.lib.cuGetErrorString(rc, ctypes.byref(msg))
                raise RuntimeError(f"{self.names[name]} failed: {rc} "
                                   f"({(msg.value or b'?').decode()})")
        return call

    def mem_info(self):
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        self.cuMemGetInfo(ctypes.byref(free), ctypes.byref(total))
        return free.value, total.value


def naive_export_leak(nbytes: int, device: int = 0) -> dict:
    d = Driver()
    d.cuInit(0)
    dev = ctypes.c_int()
    d.cuDeviceGet(ctypes.byref(dev), device)
    ctx = ctypes.c_void_p()
    d.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev.value)
    d.cuCtxSetCurrent(ctx)

    prop = CUmemAllocationProp()
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = dev.value
    gran = ctypes.c_size_t()
    d.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(prop),
                                    CU_MEM_ALLOC_GRANULARITY_MINIMUM)
    g = gran.value
    size = (nbytes + g - 1) // g * g
    access = CUmemAccessDesc()
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE
    access.location.id = dev.value
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE

    def create_map(n):
        h = ctypes.c_ulonglong()
        d.cuMemCreate(ctypes.byref(h), n, ctypes.byref(prop), 0)
        va = ctypes.c_ulonglong()
        d.cuMemAddressReserve(ctypes.byref(va), n, g, 0, 0)
        d.cuMemMap(va.value, n, 0, h.value, 0)
        d.cuMemSetAccess(va.value, n, ctypes.byref(access), 1)
        return h.value, va.value

    def unmap_release(h, va, n):
        d.cuMemUnmap(va, n)
        d.cuMemRelease(h)
        d.cuMemAddressFree(va, n)

    def export(h):
        fd = ctypes.c_int(-1)
        t0 = time.perf_counter()
        d.cuMemExportToShareableHandle(ctypes.byref(fd), h,
                                       CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)
        return fd.value, time.perf_counter() - t0

    # Warm the VMM path once (first-use driver structures are not the point).
    h, va = create_map(g)
    fd, _ = export(h)
    unmap_release(h, va, g)
    os.close(fd)

    free0, total = d.mem_info()
    h, va = create_map(size)
    free_alloc, _ = d.mem_info()
    fd, export_s = export(h)
    unmap_release(h, va, size)   # everything released... but the fd
    free_fd_open, _ = d.mem_info()
    os.close(fd)
    t0 = time.monotonic()
    free_closed = d.mem_info()[0]
    while abs(free0 - free_closed) > TOL and time.monotonic() - t0 < 10:
        time.sleep(0.01)
        free_closed = d.mem_info()[0]
    closed_s = time.monotonic() - t0
    d.cuDevicePrimaryCtxRelease(dev.value)
    text = "\n".join([
        f"Before: {gb(free0)} free / {gb(total)} total",
        f"After cuMemCreate+map of {gb(size)}: {gb(free_alloc)} free",
        f"cuMemExportToShareableHandle -> fd {fd}; cuMemUnmap, cuMemRelease, cuMemAddressFree",
        f"After:  {gb(free_fd_open)} free",
        f"Leaked: {(free0 - free_fd_open) / 1024**3:.1f} GB",
        f"close(fd {fd})",
        f"After close(fd): {gb(free_closed)} free",
        f"Leaked: {(free0 - free_closed) / 1024**3:.1f} GB",
    ])
    return {"free0": free0, "total": total, "free_alloc": free_alloc,
            "free_fd_open": free_fd_open, "free_closed": free_closed,
            "export_ms": export_s * 1e3, "closed_seconds": closed_s, "granularity": g,
            "entry_points": d.names, "text": text}


def main() -> int:
    import gpu_common  # noqa: F401  (beside this file: tests/python/ on sys.path)
    from result_channel import report  # a file of its own, not stdout

    try:
        res = naive_export_leak(int(sys.argv[1]))
    except Exception as e:  # noqa: BLE001 - reported by the parent
        traceback.print_exc()
        print(f"naive flow failed: {e}", file=sys.stderr)
        return 1
    print(res["text"], file=sys.stderr)
    report(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
