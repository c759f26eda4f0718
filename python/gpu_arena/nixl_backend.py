"""NIXL's backend ``GPU_ARENA``: KV transfer over gpu-arena's own sharing, with mappings the
producer can take back. Use it before the first NIXL agent::

    import gpu_arena.nixl_backend
    gpu_arena.nixl_backend.enable()        # sets NIXL_PLUGIN_DIR (builds the plugin once)
    from nixl._api import nixl_agent, nixl_agent_config
    agent = nixl_agent("decode", nixl_agent_config(backends=["GPU_ARENA", "UCX"]))
    reg = agent.register_memory(kv_descs, "VRAM", backends=["GPU_ARENA"])

or from a shell: ``export NIXL_PLUGIN_DIR=$(python -m gpu_arena.nixl_backend)``.

What it is (``python/gpu_arena/native/nixl/``): ``libplugin_GPU_ARENA.so``, a thin C++ map of
NIXL's engine calls onto gpu-arena's transfer engine (``gpu_arena_xfer_*``; the rules are in
``alloc/src/transfer/mod.rs``): a registration is a share of gpu-arena memory (one export per
arena), a peer's registration is imported (one mapping per arena), READ and WRITE are copies
on the importer's own streams, notifications travel on gpu-arena's sockets, and when the
producer deregisters, each consumer finishes its copies and closes its mapping, so the
producer's memory comes back while everyone lives.

The build, at first use, cached in ``$GPU_ARENA_CACHE`` (``~/.cache/gpu_arena``):

* NIXL's wheels ship no C++ headers, so the plugin is compiled against ``nixl_abi.h``, our own
  declarations of the plugin ABI of one NIXL release (:data:`SUPPORTED_NIXL`), checked
  against that release's binaries; another installed version is refused with a clear error
  (NIXL checks nothing but an interface number that did not change while its classes did);
* with the C++ compiler of ``_cxx`` (objects carrying a private C++ runtime are refused), and
  ``-DGPU_ARENA_LIB=<the libgpu_arena.so this package loads>``: the plugin binds that library
  in the process (it shares the pool of gpu_arena and of its PyTorch allocator);
* ``NIXL_PLUGIN_DIR`` replaces NIXL's plugin directory, and the wheel's own plugins find their
  libraries relative to their file (``$ORIGIN/..``, ``$ORIGIN/../../<pkg>.libs``): so the
  directory handed to NIXL is ``<cache>/nixl-<key>/<libs>/plugins``, holding our plugin and
  links to the wheel's plugins, inside a mirror of the wheel's layout made of links, so UCX,
  POSIX and the others load from it as from their own.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List, Optional, Tuple

from . import _cxx, _lib

log = logging.getLogger("gpu_arena.nixl_backend")

#: The NIXL releases whose plugin ABI ``nixl_abi.h`` declares.
SUPPORTED_NIXL = ("1.5.1",)

#: The backend's name in NIXL.
BACKEND = "GPU_ARENA"

NATIVE_DIR = Path(__file__).resolve().parent / "native" / "nixl"
SOURCES = (NATIVE_DIR / "gpu_arena_backend.cpp", NATIVE_DIR / "nixl_abi.h")

# The packages that carry NIXL's libraries, in the order gpu_arena.nixl imports them.
_PACKAGES = ("nixl_cu13", "nixl_cu12")


class NixlBackendError(RuntimeError):
    """The GPU_ARENA backend cannot be built or set up here (the message says why)."""


def nixl_package() -> Tuple[str, str, Path]:
    """``(package, version, libs)`` of the NIXL wheel Python uses: the package behind
    ``nixl._api`` when the meta package is installed, else ``nixl_cu13``, else ``nixl_cu12``;
    ``libs`` is its ``.<package>.mesonpy.libs`` folder (``libnixl.so``, ``plugins/``)."""
    names: List[str] = []
    try:
        api = importlib.import_module("nixl._api")
        names.append(api.__name__.split(".")[0])
    except ImportError:
        pass
    names += [p for p in _PACKAGES if p not in names]
    errors = []
    for name in names:
        try:
            mod = importlib.import_module(name)
        except ImportError as e:
            errors.append(f"{name}: {e}")
            continue
        site = Path(mod.__file__).resolve().parent.parent
        libs = site / f".{name}.mesonpy.libs"
        if not (libs / "plugins").is_dir():
            errors.append(f"{name}: no {libs}/plugins")
            continue
        dist = name.replace("_", "-")
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            errors.append(f"{name}: no distribution {dist}")
            continue
        return name, version, libs
    raise NixlBackendError("no NIXL wheel found: pip install nixl-cu13 (CUDA 13) or nixl-cu12 "
                           f"(CUDA 12), version {' or '.join(SUPPORTED_NIXL)} ["
                           + "; ".join(errors) + "]")


def _digest(*parts: str) -> str:
    h = hashlib.sha256()
    for f in SOURCES:
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    for p in parts:
        h.update(p.encode() + b"\0")
    return h.hexdigest()[:16]


def build_plugin(lib_path: Optional[str] = None) -> Path:
    """``libplugin_GPU_ARENA.so`` for the installed NIXL, built if needed (cached), bound to
    ``lib_path`` (default: the ``libgpu_arena.so`` this package loads). Raises
    :class:`NixlBackendError` for an unsupported NIXL, no compiler, or a failed compile."""
    package, version, _libs = nixl_package()
    if version not in SUPPORTED_NIXL:
        raise NixlBackendError(
            f"{package} {version} is installed, but the GPU_ARENA backend is built for NIXL "
            f"{' / '.join(SUPPORTED_NIXL)} only (NIXL's plugin ABI changes between releases "
            f"and NIXL does not check it): pip install {package.replace('_', '-')}=="
            f"{SUPPORTED_NIXL[-1]}")
    lib = str(Path(lib_path or _lib.lib_path()).resolve())
    flags = ["-std=c++20", "-O2", "-fPIC", "-shared", "-fvisibility=hidden",
             "-fvisibility-inlines-hidden", "-D_GLIBCXX_USE_CXX11_ABI=1", "-Wall", "-Wextra",
             f"-DGPU_ARENA_LIB=\"{lib}\"", "-I", str(NATIVE_DIR)]
    link = ["-ldl", "-Wl,-z,defs"]

    def out_for(cxx: str) -> Path:
        key = _digest(cxx, version, lib, *flags)
        return _cxx.cache_dir() / f"nixl-plugin-{key}" / f"libplugin_{BACKEND}.so"

    def compile_one(cxx: str, out: Path) -> None:
        log.info("gpu_arena: building the NIXL backend into %s with %s", out, cxx)
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix="plugin.", suffix=".tmp.so", dir=out.parent)
        os.close(fd)
        try:
            cmd = [cxx, *flags, str(SOURCES[0]), "-o", tmp, *link]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if proc.returncode != 0:
                raise NixlBackendError(f"compiling the NIXL backend failed ({' '.join(cmd)}):\n"
                                       + proc.stderr[-4000:])
            os.replace(tmp, out)
        finally:
            Path(tmp).unlink(missing_ok=True)

    return _cxx.build_object("NIXL backend", out_for, compile_one, NixlBackendError)


def _link(target: Path, link: Path) -> None:
    """``link`` -> ``target``, replacing what is there (made beside and renamed: atomic)."""
    tmp = link.with_name(link.name + f".{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target)
    os.replace(tmp, link)


def plugin_dir(lib_path: Optional[str] = None) -> Path:
    """The directory to give NIXL as ``NIXL_PLUGIN_DIR``: our plugin beside links to the
    installed wheel's own plugins, inside a mirror of the wheel's layout (module docs)."""
    package, _version, libs = nixl_package()
    plugin = build_plugin(lib_path)
    root = plugin.parent / "dir"
    mirror = root / libs.name
    plugins = mirror / "plugins"
    plugins.mkdir(parents=True, exist_ok=True)
    for entry in libs.iterdir():
        if entry.name != "plugins":
            _link(entry, mirror / entry.name)
    for entry in (libs / "plugins").iterdir():
        if entry.name != plugin.name:
            _link(entry, plugins / entry.name)
    deps = libs.parent / f"{package}.libs"
    if deps.is_dir():
        _link(deps, root / deps.name)
    _link(plugin, plugins / plugin.name)
    return plugins


def enable(lib_path: Optional[str] = None) -> Path:
    """Point NIXL at :func:`plugin_dir` (``NIXL_PLUGIN_DIR``) and return it. Call it before
    the process's first NIXL agent: NIXL reads its plugin directory once."""
    d = plugin_dir(lib_path)
    current = os.environ.get("NIXL_PLUGIN_DIR")
    if current and Path(current).resolve() != d.resolve():
        log.warning("gpu_arena: NIXL_PLUGIN_DIR was %s; now %s", current, d)
    os.environ["NIXL_PLUGIN_DIR"] = str(d)
    return d


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m gpu_arena.nixl_backend``: build, and print the plugin directory."""
    del argv
    try:
        print(plugin_dir())
    except NixlBackendError as e:
        print(f"gpu_arena.nixl_backend: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
