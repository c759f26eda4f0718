#!/usr/bin/env python3
"""The wheel scripts/gpu-build.sh staged (.gpu/gpu_arena-*.whl, built on the development
machine) on the GPU machine's Python: installed with pip, it imports from the install, loads
its packaged library without GPU_ARENA_LIB, and serves a CUDA tensor through PyTorch.

    python3 -m pip install --no-deps --target .gpu/site .gpu/gpu_arena-*.whl
    env -u GPU_ARENA_LIB PYTHONPATH=.gpu/site python3 tests/gpu/gpu_wheel_check.py

(scripts/gpu-check.sh's `wheel` step). Exit status 1 when a check fails.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import gpu_arena
import gpu_arena.torch as gt
from gpu_arena import _lib

checks = {
    "GPU_ARENA_LIB unset": "GPU_ARENA_LIB" not in os.environ,
    "package not from the checkout's python/": "python/gpu_arena" not in Path(gpu_arena.__file__).as_posix(),
    "library is the packaged one": gpu_arena.lib_path() == str(_lib.packaged_path().resolve()),
}
gt.install("arena_size=256MiB")
import torch  # noqa: E402  (after install())

x = torch.ones(64 << 20, dtype=torch.uint8, device="cuda")
checks["tensor served by gpu-arena"] = gpu_arena.stats(x.device.index)["allocated_bytes"] >= x.numel()
checks["tensor reads back"] = int(x.sum().item()) == x.numel()
del x
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, package {gpu_arena.__file__}, "
      f"library {gpu_arena.lib_path()}")
for name, ok in checks.items():
    print(f"{'ok  ' if ok else 'FAIL'} {name}")
sys.exit(0 if all(checks.values()) else 1)
