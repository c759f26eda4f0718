"""The OOM shims without a GPU or torch.

* ``tests/c/oom_shim_test.cpp`` (C++: ctypes cannot catch a C++ exception) calls
  ``gpu_arena_torch_malloc`` on the sim backend past a ``max_reserved`` cap, catches the
  ``std::runtime_error``, checks its message, then allocates normally.
* The ``torch.OutOfMemoryError`` shim's build pipeline (gpu_arena/torch_oom.py) against a
  stub "torch" (a c10/util/Exception.h defining the two macros, an empty libc10.so):
  compiled once, cached under $GPU_ARENA_CACHE, reused, bound to the loaded library, and a
  clear ShimBuildError without headers or compiler. The real headers are checked on the GPU
  machine (tests/gpu/gpu_torch_oom.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import REPO_DIR, result_of, run_python

CXX = shutil.which(os.environ.get("CXX", "c++"))
needs_cxx = pytest.mark.skipif(CXX is None, reason="no C++ compiler")


def _lib_path() -> Path:
    from gpu_arena import _lib

    return Path(_lib.find_library())


@needs_cxx
def test_cpp_program_catches_the_oom(tmp_path):
    lib = _lib_path()
    exe = tmp_path / "oom_shim_test"
    subprocess.run(
        [CXX, "-std=c++17", "-Wall", "-Wextra", "-Werror", "-I", str(REPO_DIR / "ffi" / "include"),
         str(REPO_DIR / "tests" / "c" / "oom_shim_test.cpp"), "-o", str(exe),
         "-L", str(lib.parent), "-l:" + lib.name, f"-Wl,-rpath,{lib.parent}"],
        check=True, capture_output=True, text=True,
    )
    env = {k: v for k, v in os.environ.items() if k not in ("GPU_ARENA_CONF", "GPU_ARENA_BACKEND")}
    proc = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120, env=env)
    # Its exit status is the verdict (every check, the message's text included, is inside
    # it); stdout and stderr are its log, for the failure message.
    assert proc.returncode == 0, proc.stdout + proc.stderr


STUB_HEADER = r"""
#pragma once
#include <stdexcept>
#include <string>
namespace c10 {
struct Error : std::runtime_error { using std::runtime_error::runtime_error; };
struct OutOfMemoryError : Error { using Error::Error; };
}
#define TORCH_CHECK_WITH(cls, cond, msg) if (!(cond)) throw ::c10::cls(msg)
#define TORCH_CHECK(cond, msg) if (!(cond)) throw ::c10::Error(msg)
"""


def _stub_torch(root: Path) -> Path:
    pkg = root / "torch"
    (pkg / "include" / "c10" / "util").mkdir(parents=True)
    (pkg / "include" / "c10" / "util" / "Exception.h").write_text(STUB_HEADER)
    (pkg / "lib").mkdir()
    empty = root / "empty.cpp"
    empty.write_text("extern \"C\" int c10_stub() { return 0; }\n")
    subprocess.run([CXX, "-shared", "-fPIC", str(empty), "-o", str(pkg / "lib" / "libc10.so")],
                   check=True)
    (pkg / "__init__.py").write_text(
        "__version__ = '0.0-stub'\n"
        "class version:\n    git_version = 'stub'\n"
        "class _C:\n    _GLIBCXX_USE_CXX11_ABI = True\n"
    )
    return pkg


@needs_cxx
def test_c10_shim_builds_once_caches_and_binds(tmp_path):
    _stub_torch(tmp_path)
    cache = tmp_path / "cache"
    code = """
import ctypes, os, sys
from result_channel import report
sys.path.insert(0, sys.argv[1] if len(sys.argv) > 1 else os.environ["STUB_ROOT"])
import torch, gpu_arena
from gpu_arena import torch_oom
gpu_arena.configure("backend=sim")
gpu_arena.init()
p1 = torch_oom.build(torch)
m1 = p1.stat().st_mtime_ns
p2 = torch_oom.build(torch)
torch_oom.bind(p2)
shim = ctypes.CDLL(str(p2))
shim.gpu_arena_c10_malloc.restype = ctypes.c_void_p
shim.gpu_arena_c10_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
shim.gpu_arena_c10_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
ptr = shim.gpu_arena_c10_malloc(4096, 0, None)
live = gpu_arena.stats()["allocations"]
shim.gpu_arena_c10_free(ptr, 4096, 0, None)
report({"same": str(p1) == str(p2), "mtime_same": m1 == p2.stat().st_mtime_ns,
    "files": sorted(os.listdir(torch_oom.cache_dir())), "ptr": bool(ptr), "live": live,
    "after": gpu_arena.stats()["allocations"]})
"""
    r = result_of(run_python(code, env={"GPU_ARENA_CACHE": str(cache), "STUB_ROOT": str(tmp_path)}))
    assert r["same"] and r["mtime_same"]
    assert len(r["files"]) == 1 and r["files"][0].startswith("oom_shim_c10-")
    assert r["files"][0].endswith(".so")  # no temporary left behind
    assert r["ptr"] and r["live"] == 1 and r["after"] == 0


@needs_cxx
def test_c10_shim_missing_headers_or_compiler(tmp_path):
    pkg = _stub_torch(tmp_path)
    code = """
import os, sys
from result_channel import report
sys.path.insert(0, os.environ["STUB_ROOT"])
import torch
from gpu_arena import torch_oom
out = {}
os.environ["GPU_ARENA_CXX"] = "no-such-compiler-xyz"
try:
    torch_oom.build(torch)
except torch_oom.ShimBuildError as e:
    out["nocxx"] = str(e)
os.environ.pop("GPU_ARENA_CXX")
os.remove(os.path.join(os.environ["STUB_ROOT"], "torch/include/c10/util/Exception.h"))
try:
    torch_oom.build(torch)
except torch_oom.ShimBuildError as e:
    out["noheaders"] = str(e)
report(out)
"""
    r = result_of(run_python(code, env={"GPU_ARENA_CACHE": str(tmp_path / "c"),
                                        "STUB_ROOT": str(tmp_path)}))
    assert "no C++ compiler (GPU_ARENA_CXX=no-such-compiler-xyz is not on PATH" in r["nocxx"]
    assert "no PyTorch C++ headers" in r["noheaders"] and str(pkg / "include") in r["noheaders"]
