"""CUDA tensors of gpu-arena through ``torch.multiprocessing``, handed over as gpu-arena
shares instead of torch's CUDA IPC.

:func:`gpu_arena.torch.install` (native route) registers :func:`reduce_tensor` and
:func:`reduce_storage` with ``multiprocessing``'s ``ForkingPickler`` in place of torch's
(and as ``torch.multiprocessing.reductions.reduce_tensor`` / ``reduce_storage``, for programs
that call them by hand: RLHF frameworks pickle ``reduce_tensor(t)`` and call its rebuild
function in the receiver). A CUDA tensor allocated by gpu-arena then travels as its
allocation's share handle (128 bytes) plus its view; anything else (CPU tensors, memory
gpu-arena did not allocate, sparse or nested tensors) goes through torch's own reductions.

Why not torch's own path (``storage._share_cuda_()``, which also reaches gpu-arena through
the native allocator's ``shareIpcHandle``): torch wraps every storage it sends in a
reference-counted record whose counter (a shared-memory file) each receiver decrements when
it drops its copy; a storage the sender drops while a counter is above zero waits in torch's
"limbo" until something collects it (``torch.cuda.ipc_collect()``, the next free of a sent
storage, or an allocation that runs out of memory). A sender that drops its last tensors
before the receiver does, or a receiver that dies, leaves them there: held for good. Over
gpu-arena's shares that bookkeeping is not needed: the share holds the allocation while the
sender has it, each receiver's import (a lease on the producer's broker) holds it while the
receiver has it, and a lease ends with its process. So memory comes back when the last of
them is done, with no call.

Lifetime, precisely:

* sender: the allocation's share is made on its first send and reused by later ones (one
  per allocation; ``native/ipc_shares.h``); it ends when the sender frees the allocation.
  A receiver must import a tensor before the sender frees it (torch asks the same: keep the
  tensor alive while others use it); a later import fails with "unshared".
* receiver: each rebuilt tensor holds one import; when torch frees its storage, the device
  is synchronized (the receiver's work on it is done) and the import closed.
* the sender's free is deferred by gpu-arena until the last import of the allocation is
  closed (or its process died); then ``empty_cache`` gives the memory back.

Ordering: the sender's current stream is synchronized before a tensor is handed over (torch
records an interprocess event instead; a weight sync waits for its receiver anyway), so the
receiver reads what the sender wrote before the send.
"""

from __future__ import annotations

import ctypes
import sys
from typing import List, Optional, Sequence, Tuple

from ._lib import SHARE_BYTES
from .handle import ShareHandle
from .tensors import Share, open as _open

__all__ = ["register", "unregister", "registered", "reduce_tensor", "reduce_storage", "rebuild_tensor",
           "rebuild_storage", "share_blocks"]

_torch_reduce_tensor = None  # torch's own reductions, for everything that is not ours
_torch_reduce_storage = None
_share_blocks_fn = None  # gpu_arena_torch_share_blocks of the native object


def register(torch, native: ctypes.CDLL) -> None:
    """Hand gpu-arena's CUDA tensors to ``torch.multiprocessing`` as gpu-arena shares (module
    docs). ``native`` is the loaded native allocator (its ``gpu_arena_torch_share_blocks``).
    Idempotent."""
    global _torch_reduce_tensor, _torch_reduce_storage, _share_blocks_fn
    fn = native.gpu_arena_torch_share_blocks
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t, ctypes.c_char_p,
                   ctypes.POINTER(ctypes.c_uint64), ctypes.c_char_p, ctypes.c_size_t]
    _share_blocks_fn = fn
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing.reductions as reductions  # registers torch's first

    if _torch_reduce_tensor is None:
        _torch_reduce_tensor = reductions.reduce_tensor
        _torch_reduce_storage = reductions.reduce_storage
    reductions.reduce_tensor = reduce_tensor
    reductions.reduce_storage = reduce_storage
    for cls in (*torch._tensor_classes, torch.Tensor, torch.nn.parameter.Parameter):
        ForkingPickler.register(cls, reduce_tensor)
    ForkingPickler.register(torch.UntypedStorage, reduce_storage)


def unregister(torch) -> None:
    """Put torch's own CUDA IPC reductions back (gpu-arena's allocator stays): sent tensors
    then go through torch's reference counting and limbo again, as before :func:`register`
    (benchmarks compare the two). Does nothing if :func:`register` did not run."""
    global _share_blocks_fn
    if _torch_reduce_tensor is None:
        return
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing.reductions as reductions

    reductions.reduce_tensor = _torch_reduce_tensor
    reductions.reduce_storage = _torch_reduce_storage
    for cls in (*torch._tensor_classes, torch.Tensor, torch.nn.parameter.Parameter):
        ForkingPickler.register(cls, _torch_reduce_tensor)
    ForkingPickler.register(torch.UntypedStorage, _torch_reduce_storage)
    _share_blocks_fn = None


def registered() -> bool:
    """Whether :func:`register` ran in this process."""
    return _share_blocks_fn is not None


def share_blocks(ptrs: Sequence[int]) -> Tuple[List[ShareHandle], List[int]]:
    """The share handles of the allocations holding ``ptrs`` (made on first use, one per
    allocation, ended at its free) and each pointer's offset in its allocation. Raises
    ``RuntimeError`` for a pointer that is not inside a live allocation of gpu-arena's
    native torch allocator."""
    n = len(ptrs)
    if _share_blocks_fn is None:
        raise RuntimeError("gpu-arena's torch reductions are not registered "
                           "(gpu_arena.torch.install() on the native route does it)")
    c_ptrs = (ctypes.c_uint64 * n)(*ptrs)
    out = ctypes.create_string_buffer(SHARE_BYTES * n)
    offsets = (ctypes.c_uint64 * n)()
    err = ctypes.create_string_buffer(1024)
    if _share_blocks_fn(c_ptrs, n, out, offsets, err, len(err)) != 0:
        raise RuntimeError(f"gpu_arena_torch_share_blocks: {err.value.decode(errors='replace')}")
    raw = out.raw
    handles = [ShareHandle(raw[i * SHARE_BYTES:(i + 1) * SHARE_BYTES]) for i in range(n)]
    return handles, list(offsets)


def ours(torch, tensor) -> bool:
    """Whether ``tensor`` is a plain strided CUDA tensor whose storage gpu-arena's native
    allocator may hold (its pointer is checked when it is shared)."""
    return (type(tensor) in (torch.Tensor, torch.nn.parameter.Parameter)
            and tensor.is_cuda and tensor.layout is torch.strided and not tensor.is_nested
            and not tensor.is_conj() and not tensor.is_neg()
            and not (tensor.requires_grad and not tensor.is_leaf)
            and tensor.untyped_storage().nbytes() > 0)


def _handed_over(torch, storage, device: int) -> Optional[Tuple[ShareHandle, int]]:
    """The share of ``storage``'s allocation and its offset there, after the sender's stream
    is synchronized; None when gpu-arena did not allocate it (torch's path takes it)."""
    if _share_blocks_fn is None:
        return None
    try:
        handles, offsets = share_blocks([storage.data_ptr()])
    except RuntimeError:
        return None  # not gpu-arena's memory (e.g. an import of another process's)
    torch.cuda.current_stream(device).synchronize()
    return handles[0], offsets[0]


def reduce_tensor(tensor):
    """``ForkingPickler``'s reduction of a tensor (module docs)."""
    torch = sys.modules["torch"]
    if ours(torch, tensor):
        storage = tensor.untyped_storage()
        got = _handed_over(torch, storage, tensor.get_device())
        if got is not None:
            handle, offset = got
            return (rebuild_tensor, (type(tensor), bytes(handle), offset, storage.nbytes(),
                                     str(tensor.dtype)[len("torch."):], tuple(tensor.shape),
                                     tuple(tensor.stride()), tensor.storage_offset(),
                                     tensor.requires_grad))
    return _torch_reduce_tensor(tensor)


def reduce_storage(storage):
    """``ForkingPickler``'s reduction of an untyped storage (module docs)."""
    torch = sys.modules["torch"]
    if storage.is_cuda and storage.nbytes() > 0:
        got = _handed_over(torch, storage, storage.device.index)
        if got is not None:
            handle, offset = got
            return (rebuild_storage, (bytes(handle), offset, storage.nbytes()))
    return _torch_reduce_storage(storage)


def _import_whole(handle: ShareHandle):
    """A uint8 tensor over the whole shared allocation, holding one import (closed when
    torch frees its storage)."""
    n = handle.length
    return _open(Share(handle, "uint8", (n,), (1,), 0, handle.device, n))


def rebuild_tensor(cls, handle: bytes, offset: int, nbytes: int, dtype: str, shape, stride,
                   storage_offset: int, requires_grad: bool):
    """The receiver's side of :func:`reduce_tensor`: a tensor over the sender's memory (one
    import, no copy)."""
    torch = sys.modules.get("torch") or __import__("torch")
    h = ShareHandle(handle)
    if offset == 0 and nbytes == h.length:
        t = _open(Share(h, dtype, shape, stride, storage_offset, h.device, nbytes))
    else:
        dt = getattr(torch, dtype)
        item = dt.itemsize
        if offset % item:
            raise ValueError(f"storage offset {offset} B is not a multiple of {dt}'s {item} B")
        t = _import_whole(h).view(dt).as_strided(
            shape, stride, storage_offset + offset // item)
    if cls is torch.nn.parameter.Parameter:
        return torch.nn.parameter.Parameter(t, requires_grad=requires_grad)
    t.requires_grad_(requires_grad)
    return t


def rebuild_storage(handle: bytes, offset: int, nbytes: int):
    """The receiver's side of :func:`reduce_storage` (a storage is a whole allocation)."""
    h = ShareHandle(handle)
    if offset != 0 or nbytes != h.length:
        raise ValueError(f"a storage of {nbytes} bytes at offset {offset} of a "
                         f"{h.length}-byte allocation: not a whole allocation")
    return _import_whole(h).untyped_storage()
