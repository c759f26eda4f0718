#!/usr/bin/env python3
"""What chunked arenas would cost on this GPU: one physical allocation per arena against one
per 2 MiB chunk (issue #12, survivors; docs/ARCHITECTURE.md "Survivors after empty_cache").

An arena backed by one physical allocation cannot give back part of itself (CUDA unmaps and
releases whole allocations only), so a survivor keeps its whole arena. Backing an arena by
2 MiB chunks bounds survivors exactly, but every driver step becomes one per chunk:
creating and mapping it, exporting it (one fd each), and in every consumer importing and
mapping it. This measures those steps for the same bytes both ways, across two processes
(fds sent over a Unix socket with SCM_RIGHTS, 250 per message), with raw driver calls
through ctypes (about 1 us of Python per call is included in every per-chunk figure):

    python3 bench/gpu/chunk_cost.py [--gib 1] [--chunk-mib 2] [--out FILE]

Producer: cuMemCreate + cuMemAddressReserve + cuMemMap + one cuMemSetAccess (create),
cuMemExportToShareableHandle (export), and after the consumer is done cuMemUnmap +
cuMemRelease + cuMemAddressFree (release). Consumer: cuMemImportFromShareableHandle + close
the fd + reserve + map + set access (import), then unmap + release + free (close). Times are
the medians of --rounds rounds. Exit status 1 when a step fails.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import socket
import statistics
import subprocess
import sys
import time

MiB = 1 << 20
POSIX_FD = 1
FDS_PER_MESSAGE = 250


sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "gpu"))
from naive_export import CUmemAccessDesc, CUmemAllocationProp, CUmemLocation  # noqa: E402  (tests/gpu/: one definition)


class Cuda:
    """The few driver calls this needs, each checked."""

    def __init__(self, device: int = 0):
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.device = device
        self.ok(self.lib.cuInit(0), "cuInit")
        ctx = ctypes.c_void_p()
        self.ok(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device), "cuDevicePrimaryCtxRetain")
        self.ok(self.lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    def ok(self, rc: int, what: str) -> None:
        if rc:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(rc, ctypes.byref(name))
            raise RuntimeError(f"{what}: {(name.value or b'?').decode()} ({rc})")

    def create(self, size: int) -> int:
        prop = CUmemAllocationProp()
        prop.type = 1  # CU_MEM_ALLOCATION_TYPE_PINNED
        prop.requestedHandleTypes = POSIX_FD
        prop.location = CUmemLocation(1, self.device)  # CU_MEM_LOCATION_TYPE_DEVICE
        h = ctypes.c_ulonglong()
        self.ok(self.lib.cuMemCreate(ctypes.byref(h), ctypes.c_size_t(size), ctypes.byref(prop),
                                     ctypes.c_ulonglong(0)), "cuMemCreate")
        return h.value

    def reserve(self, size: int) -> int:
        p = ctypes.c_ulonglong()
        self.ok(self.lib.cuMemAddressReserve(ctypes.byref(p), ctypes.c_size_t(size), ctypes.c_size_t(0),
                                             ctypes.c_ulonglong(0), ctypes.c_ulonglong(0)), "cuMemAddressReserve")
        return p.value

    def map(self, ptr: int, size: int, handle: int) -> None:
        self.ok(self.lib.cuMemMap(ctypes.c_ulonglong(ptr), ctypes.c_size_t(size), ctypes.c_size_t(0),
                                  ctypes.c_ulonglong(handle), ctypes.c_ulonglong(0)), "cuMemMap")

    def access(self, ptr: int, size: int) -> None:
        desc = CUmemAccessDesc(CUmemLocation(1, self.device), 3)  # READWRITE
        self.ok(self.lib.cuMemSetAccess(ctypes.c_ulonglong(ptr), ctypes.c_size_t(size), ctypes.byref(desc),
                                        ctypes.c_size_t(1)), "cuMemSetAccess")

    def export(self, handle: int) -> int:
        fd = ctypes.c_int(-1)
        self.ok(self.lib.cuMemExportToShareableHandle(ctypes.byref(fd), ctypes.c_ulonglong(handle), POSIX_FD,
                                                      ctypes.c_ulonglong(0)), "cuMemExportToShareableHandle")
        return fd.value

    def import_fd(self, fd: int) -> int:
        h = ctypes.c_ulonglong()
        self.ok(self.lib.cuMemImportFromShareableHandle(ctypes.byref(h), ctypes.c_void_p(fd), POSIX_FD),
                "cuMemImportFromShareableHandle")
        return h.value

    def unmap_release(self, ptr: int, total: int, handles: list, chunk: int) -> None:
        self.ok(self.lib.cuMemUnmap(ctypes.c_ulonglong(ptr), ctypes.c_size_t(total)), "cuMemUnmap")
        for h in handles:
            self.ok(self.lib.cuMemRelease(ctypes.c_ulonglong(h)), "cuMemRelease")
        self.ok(self.lib.cuMemAddressFree(ctypes.c_ulonglong(ptr), ctypes.c_size_t(total)), "cuMemAddressFree")

    def free_bytes(self) -> int:
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        self.ok(self.lib.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)), "cuMemGetInfo")
        return free.value


def send_fds(sock: socket.socket, fds: list) -> None:
    sock.sendall(len(fds).to_bytes(4, "little"))
    for i in range(0, len(fds), FDS_PER_MESSAGE):
        part = fds[i:i + FDS_PER_MESSAGE]
        socket.send_fds(sock, [len(part).to_bytes(4, "little")], part)


def recv_fds(sock: socket.socket) -> list:
    n = int.from_bytes(_recv_exact(sock, 4), "little")
    fds: list = []
    while len(fds) < n:
        _msg, got, _flags, _addr = socket.recv_fds(sock, 4, FDS_PER_MESSAGE)
        fds.extend(got)
    return fds


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise EOFError("peer closed")
        buf += part
    return buf


def consumer(sock_fd: int, chunk: int) -> int:
    """Import every batch of fds the producer sends, map it, report times, close it."""
    cu = Cuda()
    sock = socket.socket(fileno=sock_fd)
    while True:
        fds = recv_fds(sock)
        if not fds:
            return 0
        size = chunk if len(fds) > 1 else int.from_bytes(_recv_exact(sock, 8), "little")
        total = size * len(fds)
        t0 = time.perf_counter()
        handles = []
        for fd in fds:
            handles.append(cu.import_fd(fd))
            os.close(fd)
        ptr = cu.reserve(total)
        for i, h in enumerate(handles):
            cu.map(ptr + i * size, size, h)
        cu.access(ptr, total)
        t1 = time.perf_counter()
        cu.unmap_release(ptr, total, handles, size)
        t2 = time.perf_counter()
        sock.sendall(json.dumps({"import_s": t1 - t0, "close_s": t2 - t1}).encode().ljust(256))


def producer_round(cu: Cuda, sock: socket.socket, total: int, size: int) -> dict:
    n = total // size
    t0 = time.perf_counter()
    handles = [cu.create(size) for _ in range(n)]
    ptr = cu.reserve(total)
    for i, h in enumerate(handles):
        cu.map(ptr + i * size, size, h)
    cu.access(ptr, total)
    t1 = time.perf_counter()
    fds = [cu.export(h) for h in handles]
    t2 = time.perf_counter()
    send_fds(sock, fds)
    if n == 1:
        sock.sendall(size.to_bytes(8, "little"))
    for fd in fds:
        os.close(fd)  # the consumer has its own copies; ours would keep the memory alive
    reply = json.loads(_recv_exact(sock, 256).decode())
    t3 = time.perf_counter()
    cu.unmap_release(ptr, total, handles, size)
    t4 = time.perf_counter()
    return dict(create_s=t1 - t0, export_s=t2 - t1, send_import_ack_s=t3 - t2, release_s=t4 - t3,
                consumer_import_s=reply["import_s"], consumer_close_s=reply["close_s"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0, help="bytes per arena")
    ap.add_argument("--chunk-mib", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    chunk = args.chunk_mib * MiB
    if args.child is not None:
        return consumer(args.child, chunk)
    total = int(args.gib * 1024) * MiB // chunk * chunk
    cu = Cuda()
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", str(child.fileno()),
                             "--chunk-mib", str(args.chunk_mib)], pass_fds=[child.fileno()])
    child.close()
    base = cu.free_bytes()
    rows = {}
    try:
        for layout, size in (("whole", total), ("chunked", chunk)):
            producer_round(cu, parent, total, size)  # warm-up: the first driver calls load code
            rounds = [producer_round(cu, parent, total, size) for _ in range(args.rounds)]
            rows[layout] = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
            rows[layout]["allocations"] = total // size
        send_fds(parent, [])
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    leaked = base - cu.free_bytes()
    names = [("create_s", "create + reserve + map + access (producer)"),
             ("export_s", "export to fds (producer)"),
             ("consumer_import_s", "import + close fd + reserve + map + access (consumer)"),
             ("send_import_ack_s", "send fds + consumer import + reply (round trip)"),
             ("consumer_close_s", "unmap + release (consumer)"),
             ("release_s", "unmap + release (producer)")]
    w, c = rows["whole"], rows["chunked"]
    md = [f"# Whole arena against {args.chunk_mib} MiB chunks, {total / (1 << 30):.2f} GiB "
          f"({w['allocations']} vs {c['allocations']} physical allocations), medians of {args.rounds}", "",
          "| step | whole (ms) | chunked (ms) | chunked per chunk (us) | chunked / whole |",
          "|---|---:|---:|---:|---:|"]
    for key, label in names:
        md.append(f"| {label} | {w[key] * 1e3:.3f} | {c[key] * 1e3:.3f} | "
                  f"{c[key] / c['allocations'] * 1e6:.2f} | {c[key] / max(w[key], 1e-9):.1f}x |")
    md += ["", f"Device free memory after both layouts against before: {leaked / MiB:+.1f} MiB held; "
               f"consumer exit status {rc}."]
    text = "\n".join(md) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if rc == 0 and abs(leaked) < 64 * MiB else 1


if __name__ == "__main__":
    sys.exit(main())
