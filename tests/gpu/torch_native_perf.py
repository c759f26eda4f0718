"""gpu_torch_native.py's perf child: allocation pairs through torch's own entry points, timed in
one process per allocator. From Python: ``torch.empty((n,), dtype=uint8, device="cuda")`` + ``del``.
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


def rounds_of(fn, rounds):
    vals = [fn() for _ in range(rounds)]
    return {"median_ns": statistics.median(vals), "rounds": vals}


def child_perf(p):
    """p: route, sizes, rounds, py_n, cxx_n, cxx_lib, cpu (pin to that CPU when given)."""
    import ctypes

    if p.get("cpu") is not None:
        os.sched_setaffinity(0, {p["cpu"]})
    torch, ga = setup(p["route"])
    torch.cuda.init()
    torch.empty(1, device="cuda")
    out = {"python": {}, "cxx": {}, "cxx_floor": {}, "cxx_allocator": {}}
    empty, u8, dev = torch.empty, torch.uint8, torch.device("cuda")
    for nbytes in p["sizes"]:
        for _ in range(200):
            x = empty((nbytes,), dtype=u8, device=dev)
            del x

        def py_round():
            t0 = time.perf_counter_ns()
            for _ in range(p["py_n"]):
                x = empty((nbytes,), dtype=u8, device=dev)
                del x
            return (time.perf_counter_ns() - t0) / p["py_n"]

        out["python"][str(nbytes)] = rounds_of(py_round, p["rounds"])
    if p.get("cxx_lib"):
        lib = ctypes.CDLL(p["cxx_lib"])
        for fn in (lib.pairs_ns, lib.allocator_pairs_ns):
            fn.restype, fn.argtypes = ctypes.c_double, [ctypes.c_long, ctypes.c_long]
        n = p["cxx_n"]
        out["cxx_floor"]["0"] = rounds_of(lambda: lib.pairs_ns(n, 0), p["rounds"])
        for nbytes in p["sizes"]:
            out["cxx"][str(nbytes)] = rounds_of(lambda: lib.pairs_ns(n, nbytes), p["rounds"])
            out["cxx_allocator"][str(nbytes)] = rounds_of(
                lambda: lib.allocator_pairs_ns(n, nbytes), p["rounds"])
    torch.cuda.synchronize()
    out["info"] = info(torch, ga, p["route"])
    return out
