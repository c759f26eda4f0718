"""What the GPU scripts share (the checks in tests/gpu/, the measurements in bench/gpu/): the
checkout's paths, the checkout's ``python/`` and ``tests/python/`` on ``sys.path`` (so
``import gpu_arena`` works without PYTHONPATH and ``import result_channel``, the children's
own channel back, works at all), the environment of a child that must load the checkout's
package, and where reports go.

A script in tests/gpu/ imports it by name (a script's own folder is first on its path); one in
bench/gpu/ puts tests/gpu/ there first::

    import gpu_common  # noqa: F401  (tests/gpu/)

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "gpu"))
    import gpu_common  # noqa: E402  (bench/gpu/)

Stdlib only, and it imports neither gpu_arena nor torch: a script that must install gpu-arena
before torch touches CUDA can import it first.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # tests/gpu/ -> the repository root
PYDIR = ROOT / "python"  # the package, gpu_arena
TESTS_PYTHON = ROOT / "tests" / "python"  # result_channel.py
TESTS_GPU = ROOT / "tests" / "gpu"  # this file, naive_export.py

# A child that loads gpu-arena must configure it itself (its own backend, conf, torch's
# allocator settings): none of the caller's.
DROP_ENV = ("GPU_ARENA_BACKEND", "GPU_ARENA_CONF", "PYTORCH_CUDA_ALLOC_CONF")
# ... except this one: gpu-arena configuration keys that every child of a GPU check (and the
# GPU tests of tests/python) gets as its GPU_ARENA_CONF, so that a whole check runs on them
# (scripts/gpu-check.sh's *_grow steps: grow_arenas=1).
CHECK_CONF = "GPU_ARENA_CHECK_CONF"

if PYDIR.is_dir() and str(PYDIR) not in sys.path:
    sys.path.insert(0, str(PYDIR))
if str(TESTS_PYTHON) not in sys.path:
    sys.path.insert(0, str(TESTS_PYTHON))


def child_env(drop=DROP_ENV) -> dict:
    """os.environ for a child process: the checkout's python/ first on PYTHONPATH (before the
    caller's), the variables in `drop` removed; GPU_ARENA_CONF set to GPU_ARENA_CHECK_CONF
    when that is set (the configuration a whole check runs on, e.g. grow_arenas=1)."""
    env = dict(os.environ)
    for k in drop:
        env.pop(k, None)
    if env.get(CHECK_CONF):
        env["GPU_ARENA_CONF"] = env[CHECK_CONF]
    if PYDIR.is_dir():
        env["PYTHONPATH"] = str(PYDIR) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def out_path(*parts: str) -> str:
    """A path under $OUT, the folder scripts/gpu-check.sh gives every step (gpu-out when OUT
    is not set, as there)."""
    return os.path.join(os.environ.get("OUT", "gpu-out"), *parts)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a child's MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
