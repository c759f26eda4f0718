"""The C++ compiler that gpu_arena's install-time builds against torch use (the native
allocator, ``torch_native.py``, and the OOM shim, ``torch_oom.py``): one choice for both.

A compiler whose C++ runtime is not the one this process loaded is a trap: a newer GCC (an
``/opt/gcc`` set as ``$CXX``, as on the project's H200 image) links a private copy of its
libstdc++ into the object (or needs a newer one than the system's), so two C++ runtimes run
in one process, and the first exception thrown from the object into torch (an out-of-memory
``c10::OutOfMemoryError``) crashes it with a segmentation fault. So the compiler is
``$GPU_ARENA_CXX`` when set (used as it is), else the first of ``$CXX``, ``c++`` and ``g++``
on PATH whose ``libstdc++.so.6`` is the file this process has mapped (torch loads it), else
the first one found (when no libstdc++ is loaded yet, as for a headers-only check). A
compiler may point at the system's libstdc++ and still link its runtime or unwinder
statically (the H200 image's ``/opt/gcc`` does: measured, bench/results): so the builds
check each object they make (``private_runtime``) and try the next compiler when it
carries a copy.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Callable, List, Optional, Type


def cache_dir() -> Path:
    """Where the install-time builds are cached: ``$GPU_ARENA_CACHE``, else
    ``~/.cache/gpu_arena`` (the native allocator, the OOM shim, the NIXL backend)."""
    env = os.environ.get("GPU_ARENA_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "gpu_arena"


def loaded_libstdcxx() -> Optional[str]:
    """The real path of the libstdc++ this process has mapped, or None."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                path = line.split()[-1] if line.strip() else ""
                if "/libstdc++.so" in path:
                    return os.path.realpath(path)
    except OSError:
        return None
    return None


def runtime_of(cxx: str) -> Optional[str]:
    """The real path of the libstdc++ compiler ``cxx`` links (its ``libstdc++.so``, the link
    the linker takes, else ``libstdc++.so.6``), or None. A name the compiler does not find
    comes back bare: not a path."""
    for name in ("libstdc++.so", "libstdc++.so.6"):
        try:
            out = subprocess.run([cxx, f"-print-file-name={name}"], capture_output=True,
                                 text=True, timeout=60).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None
        if os.path.isabs(out) and os.path.exists(out):
            return os.path.realpath(out)
    return None


def candidates() -> List[str]:
    """``$CXX``, ``c++``, ``g++``: those on PATH, each once, in that order."""
    found: List[str] = []
    for name in (os.environ.get("CXX"), "c++", "g++"):
        path = shutil.which(name) if name else None
        if path and path not in found:
            found.append(path)
    return found


def ordered() -> List[str]:
    """Every candidate compiler, the preferred first (``compiler()``'s order): a build
    whose object carries a private runtime (``private_runtime``) moves on to the next."""
    forced = os.environ.get("GPU_ARENA_CXX")
    if forced:
        path = shutil.which(forced)
        return [path] if path else []
    first = compiler()
    return ([first] if first else []) + [c for c in candidates() if c != first]


def compiler() -> Optional[str]:
    """The compiler to build against the loaded torch with (module docs), or None."""
    forced = os.environ.get("GPU_ARENA_CXX")
    if forced:
        return shutil.which(forced)
    found = candidates()
    loaded = loaded_libstdcxx()
    if loaded is not None:
        for cxx in found:
            if runtime_of(cxx) == loaded:
                return cxx
    return found[0] if found else None


#: Symbols of the C++ runtime and the unwinder: an object that defines one carries a
#: private copy (linked statically), which must not share a process with torch's.
RUNTIME_SYMBOLS = ("__cxa_throw", "__gxx_personality_v0", "_Unwind_RaiseException")


def private_runtime(obj: str) -> Optional[str]:
    """The first C++ runtime or unwinder symbol that the shared object ``obj`` defines
    itself (a static ``-static-libstdc++`` / ``-static-libgcc`` copy), or None. Read with
    ``nm`` (binutils, beside every compiler); None when ``nm`` is missing."""
    nm = shutil.which("nm")
    if nm is None:
        return None
    try:
        out = subprocess.run([nm, "--defined-only", obj], capture_output=True, text=True,
                             timeout=120).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[2] in RUNTIME_SYMBOLS:
            return parts[2]
    return None


def describe() -> str:
    """What was looked for, for an error message."""
    forced = os.environ.get("GPU_ARENA_CXX")
    if forced:
        return f"GPU_ARENA_CXX={forced} is not on PATH"
    return ("$GPU_ARENA_CXX, else $CXX, c++ or g++ on PATH (one whose libstdc++ is the one "
            "torch loaded is preferred)")


def build_object(what: str, out_for: Callable[[str], Path], compile_one: Callable[[str, Path], None],
                 error: Type[Exception]) -> Path:
    """Build ``what`` (the native allocator, the OOM shim) with the first compiler of
    ``ordered()`` whose object carries no private C++ runtime: ``out_for(cxx)`` is its cached
    path (built by ``compile_one(cxx, path)`` when missing). Raises ``error`` when there is
    no compiler, or when every one links a private runtime in (two C++ runtimes in one
    process: the first exception thrown across them crashes)."""
    compilers = ordered()
    if not compilers:
        raise error(f"no C++ compiler ({describe()})")
    refused = []
    for cxx in compilers:
        out = out_for(cxx)
        if not out.is_file():
            compile_one(cxx, out)
        private = private_runtime(str(out))
        if private is None:
            return out
        refused.append(f"{cxx} (its object defines {private})")
        out.unlink(missing_ok=True)
    raise error(f"every C++ compiler links a private C++ runtime into the {what}: "
                + "; ".join(refused) + " (set GPU_ARENA_CXX to one that does not)")
