"""Sharing by pointer, no PyTorch needed (C: ``gpu_arena_share`` / ``unshare`` /
``import`` / ``close`` / ``imports_live``, ffi/src/ipc_api.rs). See :mod:`gpu_arena.ipc`."""

from __future__ import annotations

import ctypes
from typing import Any

from . import _lib
from ._lib import (
    GPU_ARENA_ERR_INVALID_ARGUMENT,
    GPU_ARENA_ERR_UNAVAILABLE,
    GpuArenaError,
    GpuArenaShare,
    as_int,
)
from .handle import ShareHandle, as_handle

__all__ = [
    "share_ptr",
    "unshare",
    "import_handle",
    "close_import",
    "imports_live",
    "share_ptrs",
    "import_handles",
    "close_imports",
]


def _ipc_lib() -> ctypes.CDLL:
    lib = _lib.lib()
    if not _lib.has_ipc():
        raise GpuArenaError(
            GPU_ARENA_ERR_UNAVAILABLE,
            f"{_lib.lib_path()} has no IPC functions (gpu_arena_share, gpu_arena_import...): "
            "it is an older build; rebuild it with `cargo build -p gpu-arena-ffi`",
        )
    return lib


_fns: dict = {}


def _ipc_fn(name: str):
    """The IPC function ``name`` of the loaded library (looked up once: ``open()`` and
    ``share()`` call these per tensor)."""
    fn = _fns.get(name)
    if fn is None:
        fn = _fns[name] = getattr(_ipc_lib(), name)
    return fn


def share_ptr(ptr: int, nbytes: int) -> ShareHandle:
    """Share ``nbytes`` at ``ptr`` (inside one live gpu-arena allocation of this process)
    with other processes. The arena is exported on its first share (later shares of the same
    arena reuse the export). Raises ``InvalidArgumentError`` for a range that runs past its
    allocation, ``UnknownPointerError`` for memory gpu-arena did not allocate."""
    ptr = as_int(ptr, "ptr")
    nbytes = as_int(nbytes, "nbytes")
    if ptr < 0 or nbytes < 0:
        raise GpuArenaError(
            GPU_ARENA_ERR_INVALID_ARGUMENT,
            f"share_ptr(ptr={ptr:#x}, nbytes={nbytes}): negative pointer or size",
        )
    s = GpuArenaShare()
    rc = _ipc_fn("gpu_arena_share")(ptr or None, nbytes, ctypes.byref(s))
    if rc < 0:
        raise _lib.error(rc, "gpu_arena_share")
    return ShareHandle(bytes(s))


def unshare(handle: Any) -> None:
    """Revoke a share made by this process: no new import succeeds; imports already made
    stay valid until their consumers close them. A second unshare raises ``IpcError``."""
    s = as_handle(handle)._struct()
    _lib.check(_ipc_lib().gpu_arena_unshare(ctypes.byref(s)), "gpu_arena_unshare")


def import_handle(handle: Any) -> int:
    """Import a share (made by another process, or this one) and return the address of its
    first byte in this process, valid until :func:`close_import`. gpu-arena must be
    initialized (``gpu_arena.init()`` or ``gpu_arena.torch.install()``) with the backend
    the producer uses. Raises ``IpcError`` for a bad or revoked handle, a wrong token or an
    unreachable producer."""
    s = GpuArenaShare.from_buffer_copy(as_handle(handle))
    out = ctypes.c_void_p()
    rc = _ipc_fn("gpu_arena_import")(ctypes.byref(s), ctypes.byref(out))
    if rc < 0:
        raise _lib.error(rc, "gpu_arena_import")
    if not out.value:
        raise GpuArenaError(_lib.GPU_ARENA_ERR_INTERNAL, "gpu_arena_import returned NULL")
    return int(out.value)


def close_import(ptr: int) -> None:
    """Close one import of ``ptr`` (from :func:`import_handle`). The last import of an arena
    unmaps it and tells the producer (a producer that exited is fine). The consumer orders
    its own work: finish (synchronize) every use of the memory before closing. Closing a
    pointer that is not imported (or no longer) raises ``UnknownPointerError``."""
    ptr = as_int(ptr, "ptr")
    _lib.check(_ipc_lib().gpu_arena_close(ptr or None), "gpu_arena_close")


def imports_live() -> int:
    """Imports this process holds as a consumer (0 before the first import)."""
    return _lib.check(_ipc_lib().gpu_arena_imports_live(), "gpu_arena_imports_live")


def share_ptrs(ptrs, sizes) -> list:
    """:func:`share_ptr` of many ranges in one call (C: ``gpu_arena_share_many``). All or
    nothing: on an error the shares this call made are revoked again."""
    ptrs = [as_int(p, "ptr") for p in ptrs]
    sizes = [as_int(n, "nbytes") for n in sizes]
    if len(ptrs) != len(sizes):
        raise GpuArenaError(GPU_ARENA_ERR_INVALID_ARGUMENT, "share_ptrs: ptrs and sizes differ in length")
    if any(x < 0 for x in ptrs + sizes):
        raise GpuArenaError(GPU_ARENA_ERR_INVALID_ARGUMENT, "share_ptrs: negative pointer or size")
    n = len(ptrs)
    if n == 0:
        return []
    out = (GpuArenaShare * n)()
    _lib.check(
        _ipc_lib().gpu_arena_share_many(
            (ctypes.c_void_p * n)(*ptrs), (ctypes.c_size_t * n)(*sizes), n, out
        ),
        "gpu_arena_share_many",
    )
    return [ShareHandle(bytes(s.bytes)) for s in out]


def import_handles(handles) -> list:
    """:func:`import_handle` of many shares in one call (C: ``gpu_arena_import_many``): shares
    of arenas this process maps already cost one round trip per producer (per 120 shares).
    All or nothing: on an error no import of this call is left."""
    structs = [as_handle(h)._struct() for h in handles]
    n = len(structs)
    if n == 0:
        return []
    arr = (GpuArenaShare * n)(*structs)
    out = (ctypes.c_void_p * n)()
    _lib.check(_ipc_lib().gpu_arena_import_many(arr, n, out), "gpu_arena_import_many")
    return [int(p) for p in out]


def close_imports(ptrs) -> None:
    """:func:`close_import` of many imports in one call (C: ``gpu_arena_close_many``): one
    message per producer, not waited for. Every pointer must be imported (as often as
    listed), or none is closed (``UnknownPointerError``)."""
    ptrs = [as_int(p, "ptr") for p in ptrs]
    n = len(ptrs)
    if n == 0:
        return
    _lib.check(_ipc_lib().gpu_arena_close_many((ctypes.c_void_p * n)(*ptrs), n), "gpu_arena_close_many")
