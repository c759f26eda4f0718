"""gpu_torch_native.py's perf child: allocation pairs through torch's own entry points, torch's
caching allocator and gpu-arena's native one taking turns in one process. From Python: ``torch.empty((n,), dtype=uint8, device="cuda")`` + ``del``.
From C++ (a tiny library built against the installed torch, called through ctypes):
``at::empty({n}, kByte, kCUDA)`` + destruction, the same with n = 0 (every step of at::empty
but the allocator's work: torch's caching allocator and gpu-arena both return a null pointer
for 0 bytes without allocating, so this is the floor no allocator can go under), and
``CUDACachingAllocator::get()->allocate(n)`` + the DataPtr's destruction (the allocator's own
pair, what is installed, without the tensor around it). Stdlib only at the top."""

from __future__ import annotations

import os
import statistics
import time

from torch_native_common import info, setup

CXX_SOURCE = r"""
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/TensorOptions.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <chrono>

template <class Pair>
static double per_pair_ns(long n, Pair pair) {
  for (int i = 0; i < 256; ++i) pair();
  const auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < n; ++i) pair();
  const auto t1 = std::chrono::steady_clock::now();
  return std::chrono::duration<double, std::nano>(t1 - t0).count() / static_cast<double>(n);
}

// at::empty + destruction (bytes = 0: the floor, everything but the allocator's work).
extern "C" __attribute__((visibility("default"))) double pairs_ns(long n, long bytes) {
  const auto opts = at::TensorOptions().dtype(at::kByte).device(at::kCUDA);
  return per_pair_ns(n, [&] { at::Tensor t = at::empty({bytes}, opts); });
}

// The installed CUDA allocator's allocate + the DataPtr's deleter, no tensor around it.
extern "C" __attribute__((visibility("default"))) double allocator_pairs_ns(long n, long bytes) {
  c10::Allocator* a = c10::cuda::CUDACachingAllocator::get();
  return per_pair_ns(n, [&] { c10::DataPtr p = a->allocate(static_cast<size_t>(bytes)); });
}

// Both allocators in one process, taking turns (the machine's speed changes within a second:
// a turn of each under the same conditions). capture_torch() before gpu-arena is installed
// keeps torch's own caching allocator, capture_arena() after it keeps gpu-arena's and
// initializes torch's (torch's lazy CUDA init only initializes the installed one). at::empty
// takes its allocator from CUDACachingAllocator::get(), so use_allocator() decides which
// one serves the pairs that follow; a DataPtr's deleter belongs to the allocator that made it.
namespace cca = c10::cuda::CUDACachingAllocator;
static cca::CUDAAllocator* g_torch = nullptr;
static cca::CUDAAllocator* g_arena = nullptr;
extern "C" __attribute__((visibility("default"))) void capture_torch() { g_torch = cca::get(); }
extern "C" __attribute__((visibility("default"))) int capture_arena(int devices) {
  g_arena = cca::get();
  if (g_torch == nullptr || g_arena == g_torch) return -1;
  g_torch->init(devices);
  return 0;
}
extern "C" __attribute__((visibility("default"))) void use_allocator(int arena) {
  cca::allocator.store(arena ? g_arena : g_torch);
}
"""


def build_cxx(torch, out_path):
    """Compile CXX_SOURCE against the installed torch with torch_native's helpers."""
    import subprocess

    from gpu_arena import torch_native as tn

    inc, libdirs = tn.torch_dirs(torch)
    cuda_inc, _ = tn.find_cuda_includes(torch)
    libdir = next((d for d in libdirs if any(d.glob("libtorch_cpu.*"))), libdirs[0])
    cxx = tn.compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler")
    flags = [f for f in tn.compile_flags(inc, cuda_inc, tn.cxx_std(tn.torch_version(torch)),
                                         tn.abi_flag(torch)) if f != "-Werror"]
    src = out_path + ".cpp"
    with open(src, "w") as f:
        f.write(CXX_SOURCE)
    cmd = [cxx, "-O2", *flags, src, "-shared", "-o", out_path, "-L", str(libdir), "-lc10",
           "-lc10_cuda", "-ltorch_cpu", f"-Wl,-rpath,{libdir}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return out_path


def take_turns(lib, fn, nbytes, turns, with_floor):
    """`turns` turns of each allocator timing fn(nbytes) (and fn(0) right after when
    `with_floor`: the floor in the same turn), torch's and gpu-arena's alternating, which one
    goes first alternating too; a first turn of each warms up and is dropped."""
    t = {"torch": [], "native": [], "torch_floor": [], "native_floor": []}
    for w in range(turns + 1):
        for arena in ((0, 1) if w % 2 == 0 else (1, 0)):
            lib.use_allocator(arena)
            v = fn(nbytes)
            f = fn(0) if with_floor else None
            if w > 0:
                who = "native" if arena else "torch"
                t[who].append(v)
                if with_floor:
                    t[who + "_floor"].append(f)
    lib.use_allocator(1)
    med = statistics.median
    out = {"torch_ns": med(t["torch"]), "native_ns": med(t["native"]),
           "ratio": med(b / a for a, b in zip(t["torch"], t["native"])), "turns": t}
    if with_floor:
        out["torch_floor_ns"], out["native_floor_ns"] = med(t["torch_floor"]), med(t["native_floor"])
        # Of torch's pair, the share that is not the allocator's work (turn by turn).
        out["floor_share"] = med(f / a for f, a in zip(t["torch_floor"], t["torch"]))
        # The allocator's work alone: pair - floor, gpu-arena's over torch's (turn by turn).
        out["above_floor_ratio"] = med((b - fb) / (a - fa) for a, fa, b, fb in zip(
            t["torch"], t["torch_floor"], t["native"], t["native_floor"]) if a > fa)
    return out


def child_perf(p):
    """Both allocators in one process, taking turns: p: sizes, turns, py_n, cxx_n, cxx_lib, cpu.
    Per size and entry point, `turns` windows of each allocator, torch's and gpu-arena's
    alternating (which goes first alternates too)."""
    import ctypes

    if p.get("cpu") is not None:
        os.sched_setaffinity(0, {p["cpu"]})
    import torch  # CUDA not initialized: torch's own allocator is still the current one

    if torch.cuda.is_initialized():
        raise RuntimeError("CUDA was initialized before the check started")
    lib = ctypes.CDLL(p["cxx_lib"])
    for fn in (lib.pairs_ns, lib.allocator_pairs_ns):
        fn.restype, fn.argtypes = ctypes.c_double, [ctypes.c_long, ctypes.c_long]
    lib.capture_torch()
    import gpu_arena
    import gpu_arena.torch as gt

    gt.install(route="native")
    if gt.route_in_use() != "native":
        raise RuntimeError(f"install(route='native') gave {gt.route_in_use()!r}")
    torch.cuda.init()
    if lib.capture_arena(torch.cuda.device_count()) != 0:
        raise RuntimeError("capture_arena: gpu-arena is not the installed allocator")
    empty, u8, dev = torch.empty, torch.uint8, torch.device("cuda")
    n = p["cxx_n"]

    def py_pairs(nbytes):
        t0 = time.perf_counter_ns()
        for _ in range(p["py_n"]):
            x = empty((nbytes,), dtype=u8, device=dev)
            del x
        return (time.perf_counter_ns() - t0) / p["py_n"]

    entries = {"python": py_pairs, "cxx": lambda b: lib.pairs_ns(n, b),
               "cxx_allocator": lambda b: lib.allocator_pairs_ns(n, b)}
    out = {k: {} for k in entries}
    for kind in entries:
        for nbytes in p["sizes"]:
            out[kind][str(nbytes)] = take_turns(lib, entries[kind], nbytes, p["turns"],
                                                with_floor=kind == "cxx")
    torch.cuda.synchronize()
    st = gpu_arena.stats(0)
    out["served_by_gpu_arena"] = st["alloc_count"]
    out["info"] = info(torch, gpu_arena, "native")
    return out
