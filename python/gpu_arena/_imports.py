"""The imports :func:`gpu_arena.open` made in this process. The library keeps them
(ffi/src/dlpack_api.rs): ``gpu_arena_import_dlpack`` imports a share and builds the DLPack
tensor whose deleter (run by torch when it frees the last tensor over the memory) closes
the import, unless ``gpu_arena_close_dlpack`` (:func:`gpu_arena.close`) closed it first.
Each import has an id, never reused in the process."""

from __future__ import annotations

import atexit
from typing import List, NamedTuple

from . import _lib
from ._lib import GPU_ARENA_ERR_UNKNOWN_POINTER, GpuArenaDlpackImport
from .handle import ShareHandle
from .pointers import _ipc_fn

__all__ = ["Import", "close", "records", "close_imports_of", "release", "at_exit"]


class Import(NamedTuple):
    """One live import (its tensor not freed yet)."""

    id: int
    ptr: int
    nbytes: int
    device: int
    closed: bool
    handle: ShareHandle


def close(import_id: int) -> int:
    """Close import ``import_id`` now (synchronizing its device first): 1 if this call
    closed it, 0 if it was closed already or its tensor is gone."""
    rc = _ipc_fn("gpu_arena_close_dlpack")(import_id)
    if rc == GPU_ARENA_ERR_UNKNOWN_POINTER:
        return 0  # its tensor was freed meanwhile: the deleter closed it
    return _lib.check(rc, "gpu_arena_close_dlpack")


def release(managed: int) -> None:
    """A managed tensor torch did not take: close its import and free it (errors are
    ignored: this runs while another exception propagates)."""
    _ipc_fn("gpu_arena_release_dlpack")(managed)


def records() -> List[Import]:
    """Every live import, oldest first (closed ones too, until their tensor is freed)."""
    fn = _ipc_fn("gpu_arena_dlpack_imports")
    while True:
        n = _lib.check(fn(None, 0), "gpu_arena_dlpack_imports")
        if n == 0:
            return []
        buf = (GpuArenaDlpackImport * (n + 16))()
        got = _lib.check(fn(buf, n + 16), "gpu_arena_dlpack_imports")
        if got <= n + 16:
            return [Import(r.id, r.ptr or 0, r.nbytes, r.device, bool(r.closed),
                           ShareHandle(bytes(r.share.bytes))) for r in buf[:got]]


def close_imports_of(handle: ShareHandle) -> int:
    """Close every open import of ``handle``; returns how many this call closed."""
    return sum(close(r.id) for r in records() if r.handle == handle and not r.closed)


_registered = False


def at_exit() -> None:
    """Once: at interpreter exit, tell the library that the deleters of tensors torch frees
    while Python tears down close nothing (the process's end closes its imports)."""
    global _registered
    if not _registered:
        _registered = True
        atexit.register(_ipc_fn("gpu_arena_dlpack_exiting"))
