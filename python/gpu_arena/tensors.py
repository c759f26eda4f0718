"""Sharing PyTorch tensors between processes: :class:`Share` (a handle plus the tensor's
view), :func:`share` (producer), :func:`open` (consumer: a tensor over the producer's memory,
no copy, a DLPack tensor the library builds, see ``_dlpack``) and :func:`close`. Overview in
:mod:`gpu_arena.ipc`."""

from __future__ import annotations

import base64
import ctypes
import json
import struct
import sys
import threading
from typing import Any, Dict, Iterable, List, Union

from . import _dlpack, _imports, _lib
from ._lib import SHARE_BYTES, as_int
from .handle import ShareHandle, _device_of, as_handle
from .pointers import _ipc_fn, unshare
from .runtime import backend_name, init, is_initialized

__all__ = ["Share", "share", "open", "close", "open_imports"]


def _torch():
    torch = sys.modules.get("torch")
    if torch is not None:
        return torch
    try:
        import torch
    except ImportError as e:
        raise ImportError(
            "gpu_arena.share/open need PyTorch (`pip install torch`); without it use "
            "gpu_arena.share_ptr / import_handle"
        ) from e
    return torch


_backend_name = ""  # once gpu-arena is initialized (its backend does not change)


def _backend() -> str:
    global _backend_name
    if _backend_name:
        return _backend_name
    _backend_name = name = backend_name()
    return name


_SHARE_MAGIC = b"GASHARE1"


class Share:
    """A shared tensor: the :class:`ShareHandle` plus how to view the memory (dtype, shape,
    stride, storage offset in elements, device index; ``nbytes`` is the shared storage's
    size). Pickles (any pickler, e.g. torch.multiprocessing queues) to those values;
    ``to_bytes()`` / ``from_bytes()`` give a compact bytes form for anything else.

    ``close()``: in the producer, on the object ``share()`` returned, it unshares
    (idempotent). On any other copy (an unpickled one, in a consumer) it closes every import
    of this share that this process opened with :func:`open` (see :func:`close`)."""

    __slots__ = ("handle", "dtype", "shape", "stride", "storage_offset", "device",
                 "device_type", "nbytes", "_owner", "_closed", "_lock", "__weakref__")

    def __init__(self, handle: Any, dtype: str, shape: Iterable[int], stride: Iterable[int],
                 storage_offset: int, device: int, nbytes: int, device_type: str = "cuda"):
        self.handle = as_handle(handle)
        if not isinstance(dtype, str):
            dtype = str(dtype)
        self.dtype = dtype[len("torch."):] if dtype.startswith("torch.") else dtype
        self.shape = tuple(as_int(s, "shape") for s in shape)
        self.stride = tuple(as_int(s, "stride") for s in stride)
        if len(self.shape) != len(self.stride):
            raise ValueError(f"shape {self.shape} and stride {self.stride} differ in length")
        self.storage_offset = as_int(storage_offset, "storage_offset")
        self.device = as_int(device, "device")
        self.nbytes = as_int(nbytes, "nbytes")
        self.device_type = str(device_type)
        self._owner = False
        self._closed = False
        self._lock = threading.Lock()

    # -- serialization ------------------------------------------------------------------

    def _meta(self) -> Dict[str, Any]:
        return {
            "dtype": self.dtype, "shape": list(self.shape), "stride": list(self.stride),
            "storage_offset": self.storage_offset, "device": self.device,
            "device_type": self.device_type, "nbytes": self.nbytes,
        }

    def __reduce__(self):
        return (Share, (bytes(self.handle), self.dtype, self.shape, self.stride,
                        self.storage_offset, self.device, self.nbytes, self.device_type))

    def to_bytes(self) -> bytes:
        """``b"GASHARE1"`` + the 128 handle bytes + the view as UTF-8 JSON."""
        return _SHARE_MAGIC + bytes(self.handle) + json.dumps(
            self._meta(), separators=(",", ":")).encode("utf-8")

    @classmethod
    def from_bytes(cls, data: Union[bytes, bytearray, memoryview]) -> "Share":
        data = bytes(data)
        head = len(_SHARE_MAGIC)
        if data[:head] != _SHARE_MAGIC or len(data) < head + SHARE_BYTES:
            raise ValueError("not a gpu_arena.Share.to_bytes() encoding")
        try:
            meta = json.loads(data[head + SHARE_BYTES:].decode("utf-8"))
            return cls(data[head:head + SHARE_BYTES], meta["dtype"], meta["shape"],
                       meta["stride"], meta["storage_offset"], meta["device"], meta["nbytes"],
                       meta.get("device_type", "cuda"))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"corrupt gpu_arena.Share encoding: {e}") from None

    def to_base64(self) -> str:
        return base64.b64encode(self.to_bytes()).decode("ascii")

    @classmethod
    def from_base64(cls, text: str) -> "Share":
        return cls.from_bytes(base64.b64decode(text))

    # -- life ---------------------------------------------------------------------------

    @property
    def owner(self) -> bool:
        """Whether this object is the producer's (``close()`` unshares)."""
        return self._owner

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> int:
        """Producer's object: unshare (idempotent; returns 0). Any other copy: close this
        process's imports of the share opened by :func:`open`; returns how many."""
        if not self._owner:
            return _imports.close_imports_of(self.handle)
        with self._lock:
            if self._closed:
                return 0
            unshare(self.handle)
            self._closed = True
            return 0

    def __enter__(self) -> "Share":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        flags = (", owner" if self._owner else "") + (", closed" if self._closed else "")
        return (f"gpu_arena.Share(dtype={self.dtype}, shape={self.shape}, stride={self.stride}, "
                f"storage_offset={self.storage_offset}, device={self.device_type}:{self.device}, "
                f"nbytes={self.nbytes}, producer_pid={self.handle.producer_pid}{flags})")


def share(tensor, *, synchronize: bool = True) -> Share:
    """Share a tensor whose memory gpu-arena allocated (``gpu_arena.torch.install()`` or a
    ``gpu_arena.torch.mem_pool()``) with other processes: its whole untyped storage is
    shared, and the :class:`Share` describes the tensor's view of it.

    ``synchronize`` (default) waits for the work queued on the tensor's device first, so a
    consumer sees everything written before ``share()``; later writes are the caller's to
    order. Close the returned object when consumers no longer need to import
    (``Share.close()`` or ``with``).

    Freeing the tensor while it is shared: with ``gpu_arena.torch.install()`` every tensor
    is its own gpu-arena allocation, and gpu-arena keeps the memory until the share is
    closed and every consumer closed its import, so ``del tensor`` is safe. With a
    ``gpu_arena.torch.mem_pool()`` the tensor is a block of PyTorch's caching allocator
    inside a gpu-arena segment, and PyTorch reuses a freed block without telling gpu-arena:
    keep the tensor alive while it is shared there."""
    torch = _torch()
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"share() takes a torch.Tensor, not {type(tensor).__name__}")
    cuda = tensor.is_cuda
    if not cuda:
        dev = tensor.device
        if dev.type != "cpu":
            raise ValueError(f"share() needs a CUDA tensor, not one on {dev}")
        # Only the sim backend's memory (host memory) can back a CPU tensor gpu-arena shares.
        if _backend() != "sim":
            raise ValueError("share() needs a CUDA tensor allocated by gpu-arena, not a CPU tensor")
    storage = tensor.untyped_storage()
    ptr, nbytes = storage.data_ptr(), storage.nbytes()
    if nbytes == 0:
        raise ValueError("share() of a tensor with an empty storage")
    if synchronize and cuda:
        _synchronize(torch, tensor.get_device())
    out = _ShareOut()
    rc = (_share_fn or _share_fn_of())(ptr or None, nbytes, _byref(out))
    if rc < 0:
        raise _error(rc, "gpu_arena_share")
    h = _new_handle(ShareHandle, bytes(out))
    # Share.__init__ validates what a caller passes; these values come from torch and the
    # library, so fill the slots directly (share() runs per tensor).
    s = object.__new__(Share)
    s.handle = h
    s.dtype = _dtype_names.get(tensor.dtype) or _dtype_name(tensor.dtype)
    s.shape = tuple(tensor.shape)
    s.stride = tensor.stride()
    s.storage_offset = tensor.storage_offset()
    s.device = _device_of(h, 0)[0]
    s.nbytes = nbytes
    s.device_type = "cuda" if cuda else "cpu"
    s._owner = True
    s._closed = False
    s._lock = threading.Lock()
    return s


# Per-call state of share(), found once.
_share_fn = None
_ShareOut = _lib.GpuArenaShare
_new_handle = bytes.__new__  # ShareHandle(b) without its checks: the library made the bytes


def _share_fn_of():
    global _share_fn
    _share_fn = _ipc_fn("gpu_arena_share")
    return _share_fn


def _synchronize(torch, index: int) -> None:
    """``torch.cuda.synchronize(index)``; without its device switch (a context manager)
    when ``index`` is the current device."""
    get, sync = getattr(torch._C, "_cuda_getDevice", None), getattr(torch._C, "_cuda_synchronize", None)
    if get is not None and sync is not None and get() == index:
        sync()
    else:
        torch.cuda.synchronize(index)


_dtype_names: Dict[Any, str] = {}


def _dtype_name(dtype) -> str:
    """``"float16"`` for ``torch.float16`` (cached: ``str()`` of a dtype is not free)."""
    name = _dtype_names.get(dtype)
    if name is None:
        name = str(dtype)
        name = name[len("torch."):] if name.startswith("torch.") else name
        _dtype_names[dtype] = name
    return name


_kind = ""  # what open()'s tensors are on ("cpu" for sim), once gpu-arena is initialized


def _import_kind() -> str:
    """Initialize gpu-arena if nothing did yet; the kind of memory imports are. Cached: the
    backend of an initialized gpu-arena does not change."""
    global _kind
    if _kind:
        return _kind
    if not is_initialized():
        init()
    _kind = {"sim": "cpu", "hip": "hip"}.get(_backend(), "cuda")
    return _kind


def open(share: Share):  # noqa: A001 - the public name is gpu_arena.open
    """Import ``share`` (consumer side) and return a tensor over the producer's memory (no
    copy) with the shared dtype, shape, stride and storage offset. Writes are seen by the
    producer and every other consumer (ordering them is the caller's job).

    Initializes gpu-arena (``gpu_arena.init()``, backend from the environment) if nothing
    did yet; ``gpu_arena.torch.install()`` before it is fine too. The import is closed when
    the last tensor over the memory is garbage-collected, or at once by
    :func:`close` (after which the tensor must not be used).

    One C call (``gpu_arena_import_dlpack``) imports the share and builds the DLPack tensor
    (dtype, shape, strides; its deleter closes the import); torch takes it as a capsule.
    Only a view that does not span its whole storage from offset 0 costs an ``as_strided``
    more."""
    torch = sys.modules.get("torch") or _torch()
    if not isinstance(share, Share):
        if not isinstance(share, (bytes, bytearray, memoryview)):
            raise TypeError(f"open() takes a gpu_arena.Share, not {type(share).__name__}")
        share = Share.from_bytes(share)
    spec = _specs.get(share.dtype) or _spec_of(torch, share.dtype)
    kind = _kind or _import_kind()
    shape, stride = share.shape, share.stride
    ndim = len(shape)
    packer = _view_packers.get(ndim) or _view_packer(ndim)
    view = packer(share.nbytes, spec.dl_dtype, spec.itemsize, _DEVICE_TYPES[kind],
                  0 if kind == "cpu" else share.device, spec.reinterpret,
                  share.storage_offset, ndim, *shape, *stride)
    out = _DlpackOut()
    rc = (_import_dlpack or _import_fn())(share.handle, view, _VIEW_HEAD + 2 * ndim, _byref(out))
    if rc < 0:
        raise _error(rc, "gpu_arena_import_dlpack")
    t = _to_torch(torch, out.managed, _imports.release)
    if out.flat:
        try:
            if spec.reinterpret:
                t = t.view(spec.dtype)
            t = t.as_strided(shape, stride, share.storage_offset)
        except BaseException:
            t = None  # its deleter frees the DLPack tensor
            _imports.close(out.id)
            raise
    t._gpu_arena_import = out.id
    return t


# Per-call state of open(), found once.
_specs: Dict[str, Any] = {}
_view_packers: Dict[int, Any] = {}
_import_dlpack = None
_DlpackOut = _lib.GpuArenaDlpack
_VIEW_HEAD = _lib.GPU_ARENA_DLPACK_VIEW_HEAD
_DEVICE_TYPES = _dlpack.DEVICE_TYPES
_byref = ctypes.byref
_error = _lib.error
_to_torch = _dlpack.to_torch


def _spec_of(torch, name: str):
    """The DLPack spec of dtype ``name`` (``"float16"``), or ValueError."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"open(): unknown dtype {name!r}")
    spec = _specs[name] = _dlpack.dtype_spec(torch, dtype)
    return spec


def _view_packer(ndim: int):
    """``struct.pack`` of a ``gpu_arena_import_dlpack`` view of ``ndim`` dimensions."""
    packer = _view_packers[ndim] = struct.Struct(f"={_VIEW_HEAD + 2 * ndim}q").pack
    return packer


def _import_fn():
    global _import_dlpack
    _import_dlpack = _ipc_fn("gpu_arena_import_dlpack")
    _imports.at_exit()
    return _import_dlpack


def close(obj) -> int:
    """Close explicitly.

    * A tensor from :func:`open` (or a view of it): close its import now (synchronizing
      its device first). The tensor and every view of it must not be used afterwards.
      Closing it again does nothing. Returns 1 if this call closed an import, else 0.
    * A :class:`Share`: ``obj.close()`` (the producer's object unshares; a consumer's copy
      closes this process's imports of it). Returns how many imports it closed.
    """
    if isinstance(obj, Share):
        return obj.close()
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(obj, torch.Tensor):
        raise TypeError(
            f"gpu_arena.close() takes a tensor from gpu_arena.open() or a Share, not "
            f"{type(obj).__name__}")
    key = getattr(obj, "_gpu_arena_import", None)
    if key is not None:
        return _imports.close(key)
    # A view of an opened tensor: find its import by the storage's address.
    ptr = int(obj.untyped_storage().data_ptr())
    mine = [r for r in _imports.records() if r.ptr == ptr]
    if not mine:
        raise ValueError("gpu_arena.close(): this tensor does not come from gpu_arena.open()")
    still_open = [r for r in mine if not r.closed]
    if not still_open:
        return 0  # closed already
    return _imports.close(still_open[-1].id)


def open_imports() -> List[Dict[str, Any]]:
    """The imports :func:`open` made in this process that are not closed yet (for
    debugging): pointer, bytes, device and the producer's pid."""
    recs = [r for r in _imports.records() if not r.closed]
    return [{"ptr": r.ptr, "nbytes": r.nbytes, "device": r.device,
             "producer_pid": r.handle.producer_pid} for r in recs]
