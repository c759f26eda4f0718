"""Weight sync for RLHF frameworks: a list of CUDA tensors sent to another process on the
same GPU as one message, received as tensors over the sender's memory (no copy).

A colocated trainer pushing its weights into an inference engine each step::

    # trainer (under gpu_arena.torch.install())
    from gpu_arena import weight_sync
    for names, tensors in weight_sync.buckets(model.named_parameters(), bucket_bytes=1 << 30):
        conn.send(weight_sync.send(tensors, names=names))  # any pickling channel
        conn.recv()  # the engine's ack: keep `tensors` alive until then
    conn.send(None)

    # inference engine (under gpu_arena.torch.install())
    rx = weight_sync.Receiver()  # keeps its imports from step to step
    while (bucket := conn.recv()) is not None:
        for name, t in rx.receive(bucket, named=True):
            engine_weights[name].copy_(t)
        conn.send("ok")
    rx.prune()  # the imports no bucket of this step used are closed

One :func:`send` is one handle batch: every allocation behind the tensors is shared once
(one C call; each allocation's share is made on its first send and ended at its free) and
the sender's streams are synchronized once per device. One :func:`receive` is one import
batch (one round trip to the sender per 120 allocations) and one tensor per entry, each a
view of its allocation's import.

Lifetime (the rules of gpu-arena's ``torch.multiprocessing`` path, :mod:`gpu_arena.torch_ipc`):
the sender keeps its tensors until the receiver has called :func:`receive` (after that it may
drop them at once); the receiver's tensors stay valid until it drops them, also when the
sender frees its tensors or dies; the memory comes back to the sender's ``empty_cache`` when
both have dropped it, or one has dropped it and the other died. No ``ipc_collect``.
"""

from __future__ import annotations

import ctypes
import struct
import sys
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

from . import _imports, _lib
from ._lib import SHARE_BYTES
from .handle import ShareHandle
from .pointers import _ipc_fn
from .tensors import _import_kind

__all__ = ["WeightBucket", "Receiver", "send", "receive", "buckets"]


class WeightBucket:
    """What :func:`send` returns and :func:`receive` takes: the share handles of the
    allocations (one per allocation) and, per tensor, which allocation, where in it and how
    to view it. Pickles to plain bytes, tuples and strings (any channel that pickles)."""

    __slots__ = ("handles", "entries", "names")

    def __init__(self, handles: Sequence[bytes], entries: Sequence[tuple],
                 names: Optional[Sequence[str]] = None):
        self.handles = [ShareHandle(h) for h in handles]
        # (allocation index, byte offset of the storage in it, dtype name, shape, stride,
        #  storage offset in elements)
        self.entries = [tuple(e) for e in entries]
        self.names = list(names) if names is not None else None
        if self.names is not None and len(self.names) != len(self.entries):
            raise ValueError(f"{len(self.names)} names for {len(self.entries)} tensors")

    def __reduce__(self):
        return (WeightBucket, ([bytes(h) for h in self.handles], self.entries, self.names))

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def nbytes(self) -> int:
        """Bytes of the allocations the bucket shares."""
        return sum(h.length for h in self.handles)

    def __repr__(self) -> str:
        return (f"gpu_arena.weight_sync.WeightBucket({len(self.entries)} tensors in "
                f"{len(self.handles)} allocations, {self.nbytes} bytes)")


def _torch():
    return sys.modules.get("torch") or __import__("torch")


def send(tensors: Iterable[Any], names: Optional[Sequence[str]] = None) -> WeightBucket:
    """Share CUDA tensors allocated by gpu-arena (``gpu_arena.torch.install()``, native route)
    as one :class:`WeightBucket`. The sender's current streams are synchronized first, so the
    receiver sees everything written before the call. Keep the tensors alive until the
    receiver has called :func:`receive`. Raises ``ValueError`` for a tensor that is not a
    CUDA tensor of gpu-arena's (a CPU tensor, memory of another allocator or process)."""
    from . import torch_ipc

    torch = _torch()
    tensors = list(tensors)
    storages: Dict[int, int] = {}  # storage pointer -> index in ptrs
    ptrs: List[int] = []
    views = []
    devices = set()
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor) or not torch_ipc.ours(torch, t):
            raise ValueError(f"weight_sync.send: tensor {i} is not a plain CUDA tensor "
                             f"({getattr(t, 'device', type(t).__name__)})")
        ptr = t.untyped_storage().data_ptr()
        k = storages.setdefault(ptr, len(ptrs))
        if k == len(ptrs):
            ptrs.append(ptr)
            devices.add(t.get_device())
        views.append((k, str(t.dtype)[len("torch."):], tuple(t.shape), tuple(t.stride()),
                      t.storage_offset()))
    try:
        handles, offsets = torch_ipc.share_blocks(ptrs)
    except RuntimeError as e:
        raise ValueError(f"weight_sync.send: {e}") from None
    # One share per allocation: storages that are parts of one allocation share its handle.
    index: Dict[bytes, int] = {}
    unique: List[bytes] = []
    entries = []
    for k, dtype, shape, stride, so in views:
        h = bytes(handles[k])
        j = index.setdefault(h, len(unique))
        if j == len(unique):
            unique.append(h)
        entries.append((j, offsets[k], dtype, shape, stride, so))
    for d in devices:
        torch.cuda.current_stream(d).synchronize()
    return WeightBucket(unique, entries, names)


def receive(bucket: WeightBucket, named: bool = False):
    """Import a :class:`WeightBucket` (one batch) and return its tensors, in the order sent
    (``named=True``: ``(name, tensor)`` pairs). Each allocation is imported once and its
    tensors are views of it; the import closes when the last of them is freed. A receiver
    that syncs every step from the same sender keeps its imports with :class:`Receiver`."""
    torch = _torch()
    return _views(torch, bucket, _import_all(torch, bucket.handles), named)


class Receiver:
    """Receives a sender's buckets step after step, keeping each allocation's import between
    steps: a bucket naming allocations it holds already (a trainer that updates its weights
    in place shares the same allocations, with the same handles, every step) costs no round
    trip and no mapping, only the views.

    Each :meth:`receive` imports what it does not hold (one batch) and marks what the bucket
    uses; :meth:`prune` (call it once a step's buckets are all received) closes the imports
    no bucket used since the last prune, so the sender's memory it no longer sends comes
    back; :meth:`close` closes them all. While held, an import keeps the sender's memory
    (its free waits, as for any import): prune every step."""

    def __init__(self):
        self._held: Dict[bytes, Any] = {}  # handle bytes -> the uint8 tensor over its allocation
        self._used: set = set()

    def receive(self, bucket: WeightBucket, named: bool = False):
        """:func:`receive`, reusing the imports held."""
        torch = _torch()
        keys = [bytes(h) for h in bucket.handles]
        new = [i for i, k in enumerate(keys) if k not in self._held]
        if new:
            got = _import_all(torch, [bucket.handles[i] for i in new])
            for i, w in zip(new, got):
                self._held[keys[i]] = w
        self._used.update(keys)
        return _views(torch, bucket, [self._held[k] for k in keys], named)

    def prune(self) -> int:
        """Close the imports no bucket used since the last prune (each when the last tensor
        over it is freed); returns how many."""
        gone = [k for k in self._held if k not in self._used]
        for k in gone:
            del self._held[k]
        self._used = set()
        return len(gone)

    def close(self) -> None:
        """Let go of every import held (each closes when the last tensor over it is freed)."""
        self._held.clear()
        self._used = set()

    def __len__(self) -> int:
        return len(self._held)

    def __enter__(self) -> "Receiver":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _views(torch, bucket: WeightBucket, wholes: List[Any], named: bool):
    """The bucket's tensors, as views of the uint8 tensors over its allocations."""
    out = []
    for j, offset, dtype, shape, stride, so in bucket.entries:
        dt = _dtype(torch, dtype)
        item = dt.itemsize  # torch >= 2.1 (the native allocator needs 2.8)
        if offset % item:
            raise ValueError(f"a {dtype} tensor at byte {offset} of its allocation: not "
                             f"aligned to its {item}-byte elements")
        w = wholes[j]
        base = w if dt is torch.uint8 else _typed(w, dt, item)
        out.append(base.as_strided(shape, stride, so + offset // item))
    if named:
        if bucket.names is None:
            raise ValueError("receive(named=True) of a bucket sent without names")
        return list(zip(bucket.names, out))
    return out


def buckets(named_tensors: Iterable[Tuple[str, Any]],
            bucket_bytes: int = 1 << 30) -> Iterator[Tuple[List[str], List[Any]]]:
    """Split ``(name, tensor)`` pairs (``model.named_parameters()``) into buckets of at most
    ``bucket_bytes`` each (a larger tensor is a bucket of its own), in order: ``(names,
    tensors)`` per bucket, for :func:`send`."""
    names: List[str] = []
    tensors: List[Any] = []
    size = 0
    for name, t in named_tensors:
        n = t.numel() * t.element_size()
        if tensors and size + n > bucket_bytes:
            yield names, tensors
            names, tensors, size = [], [], 0
        names.append(name)
        tensors.append(t.detach() if getattr(t, "requires_grad", False) else t)
        size += n
    if tensors:
        yield names, tensors


# --- the imports ------------------------------------------------------------------------

_dtypes: Dict[str, Any] = {}


def _dtype(torch, name: str):
    dt = _dtypes.get(name)
    if dt is None:
        dt = getattr(torch, name, None)
        if not isinstance(dt, torch.dtype):
            raise ValueError(f"weight_sync.receive: unknown dtype {name!r}")
        _dtypes[name] = dt
    return dt



def _typed(whole, dt, item: int):
    """The uint8 tensor over a whole allocation viewed as ``dt`` (its tail that is no whole
    element left out: the tensors' views never reach it)."""
    n = whole.numel() // item * item
    return (whole if n == whole.numel() else whole[:n]).view(dt)


def _import_all(torch, handles: Sequence[ShareHandle]) -> List[Any]:
    """One uint8 tensor over each shared allocation, imported in one batch
    (``gpu_arena_import_dlpack_many``): each holds its import until torch frees it."""
    n = len(handles)
    if n == 0:
        return []
    kind = _import_kind()
    from ._dlpack import DEVICE_TYPES, dtype_spec, to_torch

    spec = dtype_spec(torch, torch.uint8)
    head = _lib.GPU_ARENA_DLPACK_VIEW_HEAD
    pack = struct.Struct(f"={head + 2}q").pack
    views = b"".join(pack(h.length, spec.dl_dtype, 1, DEVICE_TYPES[kind],
                          0 if kind == "cpu" else h.device, 0, 0, 1, h.length, 1)
                     for h in handles)
    lens = (ctypes.c_size_t * n)(*([head + 2] * n))
    outs = (_lib.GpuArenaDlpack * n)()
    shares = b"".join(bytes(h) for h in handles)
    if len(shares) != n * SHARE_BYTES:  # ShareHandle checks each; a caller may pass bytes
        raise ValueError(f"{n} share handles of {SHARE_BYTES} bytes expected")
    try:
        fn = _ipc_fn("gpu_arena_import_dlpack_many")
    except AttributeError:
        raise _lib.LibraryNotFoundError(
            f"{_lib.lib_path()} has no gpu_arena_import_dlpack_many: a library older than "
            "this package; rebuild it") from None
    rc = fn(shares, n, views, lens, outs)
    if rc < 0:
        raise _lib.error(rc, "gpu_arena_import_dlpack_many")
    _imports.at_exit()
    out = []
    for i in range(n):
        try:
            out.append(to_torch(torch, outs[i].managed, _imports.release))
        except BaseException:
            for o in outs[i + 1:]:
                _imports.release(o.managed)
            raise
    return out
