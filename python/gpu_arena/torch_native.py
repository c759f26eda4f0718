"""gpu-arena as PyTorch's own CUDA allocator: the builder and installer of the C++ subclass of
``c10::cuda::CUDACachingAllocator::CUDAAllocator`` in ``gpu_arena/native/allocator.cpp``.

:func:`install_native` compiles the source against the installed torch (cached), loads it
with ctypes and calls its ``gpu_arena_torch_install_native``, which binds the functions of the
already loaded ``libgpu_arena.so`` and installs the allocator with
``torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator``. Every ``torch.cuda`` memory
API then reaches gpu-arena: graph pools (CUDA graphs, ``torch.compile(mode="reduce-overhead")``'s
cudagraph trees), ``memory_stats``, ``empty_cache``, ``record_stream``, CUDA tensors through
``torch.multiprocessing``. No pybind11 and no ``Python.h``: the object links ``libc10``,
``libc10_cuda``, ``libtorch_cuda`` and ``libtorch_cpu`` only.

The build (:func:`build`), like the ``torch.OutOfMemoryError`` shim's (``torch_oom.py``):

* torch's include and library dirs from ``torch.utils.cpp_extension.include_paths()`` /
  ``library_paths()`` when that module imports, else ``torch/include`` (and its
  ``torch/csrc/api/include``) and ``torch/lib``;
* CUDA's headers (``cuda_runtime_api.h`` and ``crt/host_config.h``) from ``$CUDA_HOME``,
  ``$CUDA_PATH``, ``/usr/local/cuda``, ``nvcc``'s toolkit, ``/usr/local/cuda-*``, then the pip
  packages' ``nvidia/*/include`` (``nvidia-cuda-runtime`` and ``nvidia-cuda-crt``), preferring
  the CUDA major version torch was built with;
* ``$CXX`` (default ``c++``), ``-std=c++17`` (``c++20`` from torch 2.14, whose headers need
  it), ``-D_GLIBCXX_USE_CXX11_ABI`` from ``torch._C._GLIBCXX_USE_CXX11_ABI``;
* cached in ``$GPU_ARENA_CACHE`` (default ``~/.cache/gpu_arena``) as
  ``torch_native-<key>.so``, ``<key>`` a hash of the torch build, the compiler, the flags and
  the sources: built once per torch build (seconds), written to a temporary file and renamed
  into place (concurrent installs are safe).

:func:`check_headers` compiles the source against a torch ``include/`` folder alone (no
torch, no GPU, no linking): CI runs it over the headers of each supported torch version
(``python -m gpu_arena.torch_native check --torch-include DIR --cuda-include DIR``).
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import hashlib
import logging
import os
import re
import shutil
import site
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterable, List, Optional, Sequence, Tuple

from . import _cxx, _lib

log = logging.getLogger("gpu_arena")

NATIVE_DIR = Path(__file__).resolve().parent / "native"
SOURCE = NATIVE_DIR / "allocator.cpp"
HEADERS = tuple(NATIVE_DIR / h for h in ("gpu_arena_api.h", "history.h", "device_util.h",
                                          "ipc_shares.h", "c_entry.h"))
INSTALL_FN = "gpu_arena_torch_install_native"
# The oldest torch whose CUDAAllocator the source bridges (allocator.cpp refuses older).
MIN_TORCH = (2, 8)
WARNINGS = ("-Wall", "-Wextra", "-Werror")


class NativeBuildError(RuntimeError):
    """The native allocator could not be built (the message says why)."""


class NativeInstallError(RuntimeError):
    """``gpu_arena_torch_install_native`` refused (its C++ message is the text)."""


# --------------------------------------------------------------------------------------
# Finding torch, CUDA and the compiler
# --------------------------------------------------------------------------------------


cache_dir = _cxx.cache_dir


def compiler() -> Optional[str]:
    """The C++ compiler (``gpu_arena/_cxx.py``: one whose C++ runtime is torch's), or None."""
    return _cxx.compiler()


def torch_version(torch) -> Tuple[int, int]:
    """(major, minor) of ``torch.__version__`` (``"2.11.0+cu130"`` -> ``(2, 11)``)."""
    m = re.match(r"(\d+)\.(\d+)", str(torch.__version__))
    if not m:
        raise NativeBuildError(f"cannot read torch's version from {torch.__version__!r}")
    return int(m.group(1)), int(m.group(2))


def headers_version(include_dirs: Iterable[Path]) -> Optional[Tuple[int, int]]:
    """(major, minor) from the ``TORCH_VERSION_MAJOR`` / ``MINOR`` defines of the first
    ``torch/version.h`` (or ``torch/headeronly/version.h``) under ``include_dirs``."""
    for d in include_dirs:
        for rel in ("torch/headeronly/version.h", "torch/csrc/api/include/torch/version.h",
                    "torch/version.h"):
            f = Path(d) / rel
            if not f.is_file():
                continue
            text = f.read_text(errors="replace")
            major = re.search(r"#define\s+TORCH_VERSION_MAJOR\s+(\d+)", text)
            minor = re.search(r"#define\s+TORCH_VERSION_MINOR\s+(\d+)", text)
            if major and minor:
                return int(major.group(1)), int(minor.group(1))
    return None


def cxx_std(version: Tuple[int, int]) -> str:
    """The ``-std=`` torch's headers of ``version`` need: C++20 from 2.14, else C++17."""
    return "c++20" if version >= (2, 14) else "c++17"


def torch_dirs(torch) -> Tuple[List[Path], List[Path]]:
    """torch's include dirs and library dirs: ``torch.utils.cpp_extension``'s when it imports,
    else ``torch/include`` (+ ``torch/csrc/api/include``, where ``torch/version.h`` is) and
    ``torch/lib``."""
    root = Path(torch.__file__).resolve().parent
    inc: List[Path] = []
    libs: List[Path] = []
    try:
        from torch.utils import cpp_extension  # imports setuptools; compiles nothing

        inc = [Path(p) for p in cpp_extension.include_paths()]
        libs = [Path(p) for p in cpp_extension.library_paths()]
    except Exception as e:  # noqa: BLE001 - any failure: fall back to the wheel's layout
        log.debug("gpu_arena: torch.utils.cpp_extension unusable (%s); using torch/include", e)
    if not inc:
        inc = [root / "include", root / "include" / "torch" / "csrc" / "api" / "include"]
    if not libs:
        libs = [root / "lib"]
    return inc, libs


def _cuda_major(include_dir: Path) -> Optional[int]:
    f = include_dir / "cuda_runtime_api.h"
    try:
        m = re.search(r"#define\s+CUDART_VERSION\s+(\d+)", f.read_text(errors="replace"))
    except OSError:
        return None
    return int(m.group(1)) // 1000 if m else None


def _site_roots(torch=None) -> List[Path]:
    roots: List[str] = []
    if torch is not None:
        roots.append(str(Path(torch.__file__).resolve().parent.parent))
    try:
        roots += site.getsitepackages()
    except Exception:  # noqa: BLE001 - some virtualenvs lack it
        pass
    try:
        roots.append(site.getusersitepackages())
    except Exception:  # noqa: BLE001
        pass
    roots += [p for p in sys.path if p]
    seen, out = set(), []
    for r in roots:
        p = Path(r)
        if str(p) not in seen and p.is_dir():
            seen.add(str(p))
            out.append(p)
    return out


def cuda_candidates(torch=None) -> List[Path]:
    """Folders that may hold CUDA's headers, in search order (existing ones only)."""
    cands: List[Path] = []
    for var in ("CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"):
        if os.environ.get(var):
            cands.append(Path(os.environ[var]) / "include")
    cands.append(Path("/usr/local/cuda/include"))
    nvcc = shutil.which("nvcc")
    if nvcc:
        cands.append(Path(nvcc).resolve().parent.parent / "include")
    cands += [Path(p) for p in sorted(glob.glob("/usr/local/cuda-*/include"), reverse=True)]
    for root in _site_roots(torch):
        cands += [Path(p) for p in sorted(glob.glob(str(root / "nvidia" / "*" / "include")))]
    seen, out = set(), []
    for c in cands:
        if str(c) not in seen and c.is_dir():
            seen.add(str(c))
            out.append(c)
    return out


def find_cuda_includes(torch=None, candidates: Optional[Sequence[Path]] = None
                       ) -> Tuple[List[Path], str]:
    """The include dirs that give ``cuda_runtime_api.h`` and ``crt/host_config.h`` (one dir
    for a toolkit; two for pip's separate runtime and crt packages), and "" ; or ``[]`` and
    why not. Prefers headers of the CUDA major version torch was built with."""
    cands = list(candidates) if candidates is not None else cuda_candidates(torch)
    want = None
    cuda = getattr(getattr(torch, "version", None), "cuda", None) if torch is not None else None
    if cuda:
        try:
            want = int(str(cuda).split(".")[0])
        except ValueError:
            want = None
    runtime = [c for c in cands if (c / "cuda_runtime_api.h").is_file()]
    if want is not None:
        runtime.sort(key=lambda c: _cuda_major(c) != want)  # stable: matching major first
    if not runtime:
        return [], ("no CUDA headers (cuda_runtime_api.h) in " +
                    (", ".join(map(str, cands)) or "any known place") +
                    ": install the CUDA toolkit and set CUDA_HOME, or "
                    "`pip install nvidia-cuda-runtime nvidia-cuda-crt`")
    rt = runtime[0]
    if (rt / "crt" / "host_config.h").is_file():
        return [rt], ""
    major = _cuda_major(rt)
    crt = [c for c in cands if (c / "crt" / "host_config.h").is_file()]
    crt.sort(key=lambda c: _cuda_major(c) not in (None, major))
    if not crt:
        return [], (f"CUDA's runtime headers at {rt} lack crt/host_config.h, and no other "
                    "folder has it: install the CUDA toolkit (set CUDA_HOME) or "
                    "`pip install nvidia-cuda-crt` of the same CUDA version")
    return [rt, crt[0]], ""


def abi_flag(torch) -> int:
    """``torch._C._GLIBCXX_USE_CXX11_ABI`` as 0/1 (1 when torch does not say)."""
    return int(bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)))


# --------------------------------------------------------------------------------------
# Compiling
# --------------------------------------------------------------------------------------


def compile_flags(torch_includes: Sequence[Path], cuda_includes: Sequence[Path], std: str,
                  abi: int) -> List[str]:
    """Flags shared by the build and the headers-only check (torch's and CUDA's headers as
    system headers, so their own warnings do not fail -Werror)."""
    flags = [f"-std={std}", "-fPIC", "-fvisibility=hidden", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
             *WARNINGS, "-I", str(NATIVE_DIR)]
    for d in [*torch_includes, *cuda_includes]:
        flags += ["-isystem", str(d)]
    return flags


def _sources_digest() -> str:
    h = hashlib.sha256()
    for f in (SOURCE, *HEADERS):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def cache_key(torch, cxx: str, flags: Sequence[str], link: Sequence[str]) -> str:
    """What the object depends on: the torch build, the compiler, flags and the sources."""
    parts = [
        str(torch.__version__),
        str(getattr(getattr(torch, "version", None), "git_version", "")),
        str(Path(torch.__file__).resolve().parent),
        cxx,
        *flags,
        *link,
        _sources_digest(),
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _run(cmd: List[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def build(torch=None) -> Tuple[Optional[Path], str]:
    """The cached native allocator for the installed torch, built if needed: ``(path, "")``,
    or ``(None, why)`` when it cannot be built (torch too old or CPU-only, no C++ compiler,
    no torch or CUDA headers, a compile error)."""
    try:
        if torch is None:
            import torch  # noqa: F811 - the installed one
        return _build(torch), ""
    except NativeBuildError as e:
        return None, str(e)
    except (OSError, subprocess.SubprocessError, ImportError) as e:
        return None, f"{type(e).__name__}: {e}"


def _build(torch) -> Path:
    version = torch_version(torch)
    if version < MIN_TORCH:
        raise NativeBuildError(f"torch {torch.__version__} is older than "
                               f"{MIN_TORCH[0]}.{MIN_TORCH[1]}, the oldest the native allocator "
                               "supports")
    if not getattr(getattr(torch, "version", None), "cuda", None):
        raise NativeBuildError(f"torch {torch.__version__} was built without CUDA")
    if not SOURCE.is_file():
        raise NativeBuildError(f"the allocator's source is missing ({SOURCE})")
    inc, libdirs = torch_dirs(torch)
    if not any((d / "c10" / "cuda" / "CUDACachingAllocator.h").is_file() for d in inc):
        raise NativeBuildError("no torch C++ headers (c10/cuda/CUDACachingAllocator.h) in "
                               + ", ".join(map(str, inc)))
    libdir = next((d for d in libdirs if any(d.glob("libtorch_cuda.*"))), None)
    if libdir is None:
        raise NativeBuildError("no libtorch_cuda in " + ", ".join(map(str, libdirs)))
    cuda_inc, why = find_cuda_includes(torch)
    if not cuda_inc:
        raise NativeBuildError(why)
    flags = ["-O2", *compile_flags(inc, cuda_inc, cxx_std(version), abi_flag(torch))]
    link = ["-shared", "-L", str(libdir), "-lc10", "-lc10_cuda", "-ltorch_cuda", "-ltorch_cpu",
            "-ldl", f"-Wl,-rpath,{libdir}"]
    return _cxx.build_object(
        "object",
        lambda cxx: cache_dir() / f"torch_native-{cache_key(torch, cxx, flags, link)}.so",
        lambda cxx, out: _compile(cxx, flags, link, out),
        NativeBuildError)


def _compile(cxx: str, flags: Sequence[str], link: Sequence[str], out: Path) -> None:
    """Compile the allocator with ``cxx`` into ``out`` (a temporary file renamed into place)."""
    log.info("gpu_arena: building the native torch allocator into %s with %s", out, cxx)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.stem + ".", suffix=".tmp.so", dir=out.parent)
    os.close(fd)
    try:
        cmd = [cxx, *flags, str(SOURCE), "-o", tmp, *link]
        proc = _run(cmd)
        if proc.returncode != 0:
            raise NativeBuildError(f"compiling the native torch allocator failed "
                                   f"({' '.join(cmd)}):\n{proc.stderr[-4000:]}")
        os.replace(tmp, out)  # atomic: a concurrent install sees the old file or the new
    finally:
        Path(tmp).unlink(missing_ok=True)


def check_headers(torch_includes: Sequence[Path], cuda_includes: Sequence[Path] = (), *,
                  cxx: Optional[str] = None, std: Optional[str] = None, abi: int = 1,
                  gpu_arena_header: Optional[Path] = None,
                  syntax_only: bool = False) -> Tuple[bool, str]:
    """Compile the allocator against torch's headers alone (``torch_includes``: a wheel's
    ``torch/include``; its ``torch/csrc/api/include`` is added) and CUDA's, to an object
    thrown away (``-c -o /dev/null``: the warnings that need code generation included), or
    with ``-fsyntax-only``. ``gpu_arena_header``: the folder of ``gpu_arena.h``, to check the
    struct layouts ``gpu_arena_api.h`` repeats. Nothing is linked; no torch, no GPU.
    Returns (passed, the command and the compiler's output)."""
    inc = [Path(d) for d in torch_includes]
    for d in list(inc):
        api = d / "torch" / "csrc" / "api" / "include"
        if api.is_dir() and api not in inc:
            inc.append(api)
    if std is None:
        version = headers_version(inc)
        if version is None:
            return False, f"no torch/version.h under {', '.join(map(str, inc))}"
        std = cxx_std(version)
    cxx = cxx or compiler()
    if cxx is None:
        return False, "no C++ compiler (set CXX)"
    cmd = [cxx, *compile_flags(inc, [Path(d) for d in cuda_includes], std, abi)]
    if gpu_arena_header is not None:
        cmd += ["-DGPU_ARENA_CHECK_LAYOUT", "-I", str(gpu_arena_header)]
    cmd += ["-fsyntax-only"] if syntax_only else ["-O2", "-c", "-o", os.devnull]
    cmd.append(str(SOURCE))
    proc = _run(cmd)
    return proc.returncode == 0, " ".join(cmd) + "\n" + proc.stdout + proc.stderr


# --------------------------------------------------------------------------------------
# Installing
# --------------------------------------------------------------------------------------


def install_native(lib_path: Optional[str] = None) -> Path:
    """Build (if needed) and install gpu-arena's native allocator as torch's CUDA allocator,
    over the ``libgpu_arena.so`` at ``lib_path`` (default: the one gpu_arena loaded; it must
    be loaded in this process already, as ``_lib.lib_path()`` ensures). Call it before torch
    initializes CUDA. Idempotent: a second call with the same library returns at once.

    Returns the path of the native object. Raises :class:`NativeBuildError` when it cannot be
    built (the reason; the caller may fall back to the pluggable route) and
    :class:`NativeInstallError` with the C++ message when the install is refused (a library
    lacking a function it needs, torch's allocator already initialized, ...)."""
    import torch  # noqa: F401 - loads libc10 / libtorch_cuda before the object needs them

    if lib_path is None:
        lib_path = _lib.lib_path()
    path, why = build(torch)
    if path is None:
        raise NativeBuildError(why)
    try:
        obj = ctypes.CDLL(str(path))
    except OSError as e:
        raise NativeBuildError(f"built {path} but could not load it: {e}") from e
    fn = getattr(obj, INSTALL_FN)
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
    err = ctypes.create_string_buffer(4096)
    if fn(os.fsencode(lib_path), err, len(err)) != 0:
        raise NativeInstallError(
            f"gpu-arena's native torch allocator was not installed: "
            f"{err.value.decode(errors='replace') or 'no reason given'}"
        )
    global _installed_object
    _installed_object = obj
    return path


_installed_object: Optional[ctypes.CDLL] = None


def installed_object() -> Optional[ctypes.CDLL]:
    """The native object :func:`install_native` installed in this process (its other C
    entry points: ``gpu_arena_torch_share_blocks``), or None."""
    return _installed_object


# --------------------------------------------------------------------------------------
# Command line: CI's headers-only checks, and a manual build
# --------------------------------------------------------------------------------------


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gpu_arena.torch_native")
    sub = ap.add_subparsers(dest="cmd", required=True)
    chk = sub.add_parser("check", help="compile against torch headers alone (no torch, no GPU)")
    chk.add_argument("--torch-include", action="append", required=True, type=Path,
                     help="a wheel's torch/include (repeat for several torch versions)")
    chk.add_argument("--cuda-include", action="append", default=[], type=Path,
                     help="CUDA include dir(s) (default: searched as for a build)")
    chk.add_argument("--gpu-arena-header", type=Path, help="folder of gpu_arena.h (layouts)")
    chk.add_argument("--abi", type=int, default=1)
    chk.add_argument("--syntax-only", action="store_true")
    sub.add_parser("build", help="build for the installed torch; print the path")
    args = ap.parse_args(argv)
    if args.cmd == "build":
        path, why = build()
        print(path if path else f"not built: {why}")
        return 0 if path else 1
    cuda = args.cuda_include
    if not cuda:
        cuda, why = find_cuda_includes()
        if not cuda:
            print(why, file=sys.stderr)
            return 1
    failed = 0
    for inc in args.torch_include:
        ok, out = check_headers([inc], cuda, abi=args.abi, gpu_arena_header=args.gpu_arena_header,
                                syntax_only=args.syntax_only)
        version = headers_version([inc])
        label = f"torch {version[0]}.{version[1]}" if version else str(inc)
        print(f"{'ok' if ok else 'FAILED'}: {label} ({inc})")
        if not ok:
            failed += 1
            print(out, file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
