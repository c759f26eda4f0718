"""The imports :func:`gpu_arena.open` made in this process: one record per open (one
``gpu_arena_close`` to make), found by key from torch's DLPack deleter, closed once, by
``gpu_arena.close`` or when torch frees the last tensor over the memory."""

from __future__ import annotations

import collections
import itertools
import sys
import threading
import warnings
from typing import Any, Dict, List, Tuple

from . import _dlpack
from .handle import ShareHandle
from .pointers import close_import


class Import:
    """One open() of a share: one import (one gpu_arena_close to make), plus the DLPack
    structures torch points to until its deleter runs."""

    __slots__ = ("key", "ptr", "nbytes", "device", "kind", "handle", "closed", "freed", "lock",
                 "keep")

    def __init__(self, key: int, ptr: int, nbytes: int, device: int, kind: str,
                 handle: ShareHandle):
        self.key, self.ptr, self.nbytes, self.device, self.kind = key, ptr, nbytes, device, kind
        self.handle = handle
        self.closed = False  # gpu_arena_close made (or being made)
        self.freed = False   # torch's deleter ran: the DLPack structures may go
        self.lock = threading.Lock()
        self.keep: Tuple[Any, ...] = ()


# key -> import. Only open() and close() change the dict (under the lock); torch's deleter,
# which may run from the garbage collector inside any of them, only reads it (dict.get is
# atomic), so it can neither deadlock on the lock nor change the dict under an iteration.
# The deleter queues the key of a freed record on `_freed` (deque.append is atomic too), so
# prune() forgets exactly those: it used to scan the whole registry, on every open(), which
# with thousands of imports held cost more than everything else open() does.
_lock = threading.RLock()
_registry: Dict[int, Import] = {}
_freed: "collections.deque[int]" = collections.deque()
_keys = itertools.count(1)


def _mark_freed(rec: Import, _freed=_freed) -> None:
    rec.freed = True
    _freed.append(rec.key)


def register(ptr: int, nbytes: int, device: int, kind: str, handle: ShareHandle) -> Import:
    """A new record for an import just made, under a fresh key."""
    rec = Import(next(_keys), ptr, nbytes, device, kind, handle)
    with _lock:
        _registry[rec.key] = rec
    return rec


def get(key: Any):
    """The record of ``key``, or None (atomic: torch's deleter may call it anywhere)."""
    return _registry.get(key)


def prune() -> None:
    """Forget imports whose tensors are gone (their deleter ran)."""
    if not _freed:
        return
    with _lock:
        while _freed:
            try:
                key = _freed.popleft()
            except IndexError:  # pragma: no cover - emptied by another thread
                break
            _registry.pop(key, None)


def _synchronize(rec: Import) -> None:
    if rec.kind != "cuda":
        return
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.synchronize(rec.device)


def close_record(rec: Import, *, synchronize: bool = True) -> bool:
    """Close `rec`'s import once (no lock held while it synchronizes and closes). Returns
    whether this call closed it."""
    with rec.lock:
        if rec.closed:
            return False
        rec.closed = True
    if synchronize:
        _synchronize(rec)
    close_import(rec.ptr)
    return True


def _dl_deleter_impl(managed, _registry=_registry, _sys=sys, _mark_freed=_mark_freed):
    # Runs when torch frees the storage (any thread; ctypes takes the GIL). Never raises.
    try:
        rec = _registry.get(managed.contents.manager_ctx)
        if rec is None:
            return
        try:
            if not _sys.is_finalizing():  # at interpreter exit, the process's end closes it
                close_record(rec)
        finally:
            _mark_freed(rec)
    except BaseException as e:  # noqa: BLE001 - a deleter must not raise
        try:
            warnings.warn(f"gpu_arena: closing an import when its tensor was freed failed: {e}",
                          RuntimeWarning, stacklevel=1)
        except BaseException:  # noqa: BLE001
            pass


_DL_DELETER = _dlpack.persistent_deleter(_dl_deleter_impl)


def wrap(torch, rec: Import):
    """A 1-D uint8 tensor over [rec.ptr, +rec.nbytes) whose deleter closes `rec`."""

    def refused() -> None:
        _mark_freed(rec)  # torch did not take the capsule: its deleter will never run

    rec.keep = _dlpack.managed_tensor(rec.ptr, rec.nbytes, rec.kind, rec.device, rec.key,
                                      _DL_DELETER)
    return _dlpack.to_torch(torch, rec.keep, refused)


def records() -> List[Import]:
    """Every import open() registered (closed ones too, until pruned)."""
    with _lock:
        return list(_registry.values())


def close_imports_of(handle: ShareHandle) -> int:
    """Close every open import of `handle`; returns how many this call closed."""
    recs = [r for r in records() if r.handle == handle and not r.closed]
    return sum(1 for r in recs if close_record(r))
