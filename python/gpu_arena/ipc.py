"""Sharing gpu-arena memory between processes (C: ``gpu_arena_share`` / ``unshare`` /
``import`` / ``close``, ffi/src/ipc_api.rs).

Two levels.

**Pointers** (no PyTorch needed)::

    # producer                                   # consumer
    h = gpu_arena.share_ptr(ptr, nbytes)         p = gpu_arena.import_handle(h)
    send(bytes(h))        ------------------>    ...use [p, p + nbytes)...
    ...                                          gpu_arena.close_import(p)
    gpu_arena.unshare(h)

A :class:`ShareHandle` is 128 plain bytes (a ``bytes`` subclass): no pointer, no fd. It
travels any way bytes travel (pickle, a pipe, HTTP). ``import_handle`` connects to the
producer's broker (a Unix socket; only the producer's uid is accepted by default), receives
the arena's export once per arena, maps it, and returns the address of the share's first
byte. Every ``import_handle`` must be matched by one ``close_import`` (a second close of the
same pointer raises ``UnknownPointerError``). ``unshare`` stops new imports; imports already
made stay valid until their consumers close them (or die: a killed consumer's imports end
when the kernel closes its socket), and the memory is reused only after that.

**Tensors** (PyTorch)::

    # producer                                   # consumer
    s = gpu_arena.share(kv)  # -> Share          t = gpu_arena.open(s)   # a tensor, no copy
    queue.put(s)   (or s.to_bytes())  ------>    ...use t...
    ...                                          gpu_arena.close(t)      # or just drop t
    s.close()                # unshare

``share(tensor)`` shares the tensor's whole untyped storage ``[storage.data_ptr(),
+storage.nbytes())``, so views and storage offsets survive; the :class:`Share` it returns
pickles to the 128 handle bytes plus dtype, shape, stride, storage offset and device, and
``Share.to_bytes()`` / ``Share.from_bytes()`` carry the same through anything else. Only the
producer's own ``Share`` object (the one ``share()`` returned) unshares on ``close()``: it is
not closed when it is garbage-collected (a share handed to a queue must outlive the local
object), so call ``close()`` (or use ``with``) when the consumers no longer need to import.

``open(share)`` imports the share and returns a tensor over the imported memory (built with
DLPack, see below). The import stays open while any tensor over that memory (the returned
tensor or any view of it) is alive, and is closed automatically when the last one is
garbage-collected. ``close(tensor)`` closes it at once: after that the tensor and every view
of it point to unmapped memory and **must not be used** (on CUDA a kernel touching it raises
an illegal-address error that poisons the CUDA context). Closing (explicitly or by garbage
collection) synchronizes the device first, so work already queued on the tensor finishes
before the memory is unmapped.

Why DLPack and not ``__cuda_array_interface__``: ``torch.as_tensor`` over an object with
``__cuda_array_interface__`` does keep that object alive (torch's
``tensor_from_cuda_array_interface`` takes a reference and drops it in the storage's
deleter), but that path refuses to run when NumPy is not installed ("Numpy is not
available"), and PyTorch does not depend on NumPy. A DLPack capsule gives the same
guarantee (its deleter runs when the storage is freed) without NumPy, and works for CPU
tensors too, which lets the sim backend (host memory) test all of this without a GPU.

Devices: the handle names the producer's device index, and the consumer maps the memory on
the device with the same index in *its* numbering: run producer and consumer with the same
``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import base64
import ctypes
import itertools
import json
import operator
import struct
import sys
import threading
import warnings
from typing import Any, Dict, Iterable, List, Tuple, Union

from . import _lib
from ._lib import (
    GPU_ARENA_ERR_INVALID_ARGUMENT,
    GPU_ARENA_ERR_UNAVAILABLE,
    SHARE_BYTES,
    GpuArenaError,
    GpuArenaShare,
)

__all__ = [
    "ShareHandle",
    "share_ptr",
    "unshare",
    "import_handle",
    "close_import",
    "imports_live",
    "Share",
    "share",
    "open",
    "close",
]


def _int(value: Any, what: str) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an int, not {type(value).__name__}") from None


def _ipc_lib() -> ctypes.CDLL:
    lib = _lib.lib()
    if not _lib.has_ipc():
        raise GpuArenaError(
            GPU_ARENA_ERR_UNAVAILABLE,
            f"{_lib.lib_path()} has no IPC functions (gpu_arena_share, gpu_arena_import...): "
            "it is an older build; rebuild it with `cargo build -p gpu-arena-ffi`",
        )
    return lib


# --------------------------------------------------------------------------------------
# The handle
# --------------------------------------------------------------------------------------

_MAGIC = b"GPUARENA"


class ShareHandle(bytes):
    """A share handle: exactly 128 bytes (``gpu_arena_share_t``). It is ``bytes``: send it,
    store it, ``.hex()`` it; ``ShareHandle(b)`` / ``ShareHandle.from_hex(s)`` bring it back.

    The properties decode the fields for display and routing (layout in
    alloc/src/ipc/handle.rs); the library validates the handle on every use."""

    __slots__ = ()

    SIZE = SHARE_BYTES

    def __new__(cls, data: Union[bytes, bytearray, memoryview, "ShareHandle"]):
        if isinstance(data, str):
            raise TypeError("ShareHandle takes bytes; use ShareHandle.from_hex() for a hex string")
        b = bytes(data)
        if len(b) != SHARE_BYTES:
            raise ValueError(f"a share handle is {SHARE_BYTES} bytes, not {len(b)}")
        return super().__new__(cls, b)

    @classmethod
    def from_hex(cls, text: str) -> "ShareHandle":
        return cls(bytes.fromhex(text))

    def to_bytes(self) -> bytes:
        """The 128 bytes as a plain ``bytes``."""
        return bytes(self)

    def __reduce__(self):
        return (ShareHandle, (bytes(self),))

    def _struct(self) -> GpuArenaShare:
        s = GpuArenaShare()
        ctypes.memmove(ctypes.addressof(s), bytes(self), SHARE_BYTES)
        return s

    def _u(self, fmt: str, at: int) -> int:
        return struct.unpack_from("<" + fmt, self, at)[0]

    @property
    def is_gpu_arena(self) -> bool:
        """Whether it starts with gpu-arena's magic."""
        return self[:8] == _MAGIC

    @property
    def version(self) -> int:
        return self._u("H", 8)

    @property
    def device(self) -> int:
        """The producer's device index."""
        return self._u("i", 12)

    @property
    def producer_pid(self) -> int:
        return self._u("I", 16)

    @property
    def share_key(self) -> int:
        return self._u("I", 20)

    @property
    def arena_id(self) -> int:
        return self._u("Q", 24)

    @property
    def generation(self) -> int:
        return self._u("I", 32)

    @property
    def offset(self) -> int:
        """Offset of the shared range in its arena, in bytes."""
        return self._u("Q", 40)

    @property
    def length(self) -> int:
        """Length of the shared range, in bytes."""
        return self._u("Q", 48)

    @property
    def arena_bytes(self) -> int:
        return self._u("Q", 56)

    @property
    def socket_name(self) -> str:
        return bytes(self[80:128]).split(b"\0", 1)[0].decode("ascii", "replace")

    def __repr__(self) -> str:
        if not self.is_gpu_arena:
            return f"ShareHandle(<not a gpu-arena handle> {bytes(self[:16]).hex()}...)"
        return (
            f"ShareHandle(producer_pid={self.producer_pid}, device={self.device}, "
            f"arena={self.arena_id}, offset={self.offset}, length={self.length})"
        )

    __str__ = __repr__


def _as_handle(handle: Any) -> ShareHandle:
    if isinstance(handle, ShareHandle):
        return handle
    if isinstance(handle, Share):
        return handle.handle
    if isinstance(handle, (bytes, bytearray, memoryview)):
        return ShareHandle(handle)
    raise TypeError(
        f"expected a ShareHandle (or its 128 bytes, or a Share), not {type(handle).__name__}"
    )


# --------------------------------------------------------------------------------------
# Low level: pointers
# --------------------------------------------------------------------------------------


def share_ptr(ptr: int, nbytes: int) -> ShareHandle:
    """Share ``nbytes`` at ``ptr`` (inside one live gpu-arena allocation of this process)
    with other processes. The arena is exported on its first share (later shares of the same
    arena reuse the export). Raises ``InvalidArgumentError`` for a range that runs past its
    allocation, ``UnknownPointerError`` for memory gpu-arena did not allocate."""
    ptr = _int(ptr, "ptr")
    nbytes = _int(nbytes, "nbytes")
    if ptr < 0 or nbytes < 0:
        raise GpuArenaError(
            GPU_ARENA_ERR_INVALID_ARGUMENT,
            f"share_ptr(ptr={ptr:#x}, nbytes={nbytes}): negative pointer or size",
        )
    s = GpuArenaShare()
    _lib.check(_ipc_lib().gpu_arena_share(ptr or None, nbytes, ctypes.byref(s)), "gpu_arena_share")
    return ShareHandle(bytes(s.bytes))


def unshare(handle: Any) -> None:
    """Revoke a share made by this process: no new import succeeds; imports already made
    stay valid until their consumers close them. A second unshare raises ``IpcError``."""
    s = _as_handle(handle)._struct()
    _lib.check(_ipc_lib().gpu_arena_unshare(ctypes.byref(s)), "gpu_arena_unshare")


def import_handle(handle: Any) -> int:
    """Import a share (made by another process, or this one) and return the address of its
    first byte in this process, valid until :func:`close_import`. gpu-arena must be
    initialized (``gpu_arena.init()`` or ``gpu_arena.torch.install()``) with the backend
    the producer uses. Raises ``IpcError`` for a bad or revoked handle, a wrong token or an
    unreachable producer."""
    s = _as_handle(handle)._struct()
    out = ctypes.c_void_p()
    _lib.check(_ipc_lib().gpu_arena_import(ctypes.byref(s), ctypes.byref(out)), "gpu_arena_import")
    if not out.value:
        raise GpuArenaError(_lib.GPU_ARENA_ERR_INTERNAL, "gpu_arena_import returned NULL")
    return int(out.value)


def close_import(ptr: int) -> None:
    """Close one import of ``ptr`` (from :func:`import_handle`). The last import of an arena
    unmaps it and tells the producer (a producer that exited is fine). The consumer orders
    its own work: finish (synchronize) every use of the memory before closing. Closing a
    pointer that is not imported (or no longer) raises ``UnknownPointerError``."""
    ptr = _int(ptr, "ptr")
    _lib.check(_ipc_lib().gpu_arena_close(ptr or None), "gpu_arena_close")


def imports_live() -> int:
    """Imports this process holds as a consumer (0 before the first import)."""
    return _lib.check(_ipc_lib().gpu_arena_imports_live(), "gpu_arena_imports_live")


# --------------------------------------------------------------------------------------
# Tensor level
# --------------------------------------------------------------------------------------


def _torch():
    try:
        import torch
    except ImportError as e:
        raise ImportError(
            "gpu_arena.share/open need PyTorch (`pip install torch`); without it use "
            "gpu_arena.share_ptr / import_handle"
        ) from e
    return torch


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
        self.handle = _as_handle(handle)
        if not isinstance(dtype, str):
            dtype = str(dtype)
        self.dtype = dtype[len("torch."):] if dtype.startswith("torch.") else dtype
        self.shape = tuple(_int(s, "shape") for s in shape)
        self.stride = tuple(_int(s, "stride") for s in stride)
        if len(self.shape) != len(self.stride):
            raise ValueError(f"shape {self.shape} and stride {self.stride} differ in length")
        self.storage_offset = _int(storage_offset, "storage_offset")
        self.device = _int(device, "device")
        self.nbytes = _int(nbytes, "nbytes")
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
            return _close_imports_of(self.handle)
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
    dev = tensor.device
    if dev.type == "cpu":
        # Only the sim backend's memory (host memory) can back a CPU tensor gpu-arena shares.
        if _backend() != "sim":
            raise ValueError("share() needs a CUDA tensor allocated by gpu-arena, not a CPU tensor")
    elif dev.type != "cuda":
        raise ValueError(f"share() needs a CUDA tensor, not one on {dev}")
    storage = tensor.untyped_storage()
    ptr, nbytes = int(storage.data_ptr()), int(storage.nbytes())
    if nbytes == 0:
        raise ValueError("share() of a tensor with an empty storage")
    if synchronize and dev.type == "cuda":
        torch.cuda.synchronize(dev)
    h = share_ptr(ptr, nbytes)
    s = Share(h, str(tensor.dtype), tuple(tensor.shape), tuple(tensor.stride()),
              tensor.storage_offset(), h.device, nbytes, dev.type)
    s._owner = True
    return s


# -- DLPack: a tensor over imported memory whose deleter closes the import ----------------


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    pass


_DLDeleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [
    ("dl_tensor", _DLTensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", _DLDeleter),
]

_kDLCPU, _kDLCUDA, _kDLROCM = 1, 2, 10
_kDLUInt = 1
_DLTENSOR_NAME = ctypes.c_char_p(b"dltensor")  # lives as long as the module (and longer: see below)

_PyCapsule_New = ctypes.pythonapi.PyCapsule_New
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_PyCapsule_IsValid = ctypes.pythonapi.PyCapsule_IsValid
_PyCapsule_IsValid.restype = ctypes.c_int
_PyCapsule_IsValid.argtypes = [ctypes.py_object, ctypes.c_char_p]


class _Import:
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
_registry_lock = threading.RLock()
_registry: Dict[int, _Import] = {}
_keys = itertools.count(1)


def _prune() -> None:
    """Forget imports whose tensors are gone (their deleter ran)."""
    with _registry_lock:
        for key in [k for k, r in list(_registry.items()) if r.freed]:
            _registry.pop(key, None)


def _synchronize(rec: _Import) -> None:
    if rec.kind != "cuda":
        return
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.synchronize(rec.device)


def _close_record(rec: _Import, *, synchronize: bool = True) -> bool:
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


def _dl_deleter_impl(managed, _registry=_registry, _sys=sys):
    # Runs when torch frees the storage (any thread; ctypes takes the GIL). Never raises.
    try:
        rec = _registry.get(managed.contents.manager_ctx)
        if rec is None:
            return
        try:
            if not _sys.is_finalizing():  # at interpreter exit, the process's end closes it
                _close_record(rec)
        finally:
            rec.freed = True
    except BaseException as e:  # noqa: BLE001 - a deleter must not raise
        try:
            warnings.warn(f"gpu_arena: closing an import when its tensor was freed failed: {e}",
                          RuntimeWarning, stacklevel=1)
        except BaseException:  # noqa: BLE001
            pass


_DL_DELETER = _DLDeleter(_dl_deleter_impl)
# torch may free a tensor over imported memory after this module's globals are torn down at
# interpreter exit: keep the C thunk (and the capsule name) alive for the process's life.
ctypes.pythonapi.Py_IncRef(ctypes.py_object(_DL_DELETER))
ctypes.pythonapi.Py_IncRef(ctypes.py_object(_DLTENSOR_NAME))


def _backend() -> str:
    return _lib.lib().gpu_arena_backend_name().decode("ascii", "replace")


def _wrap(torch, rec: _Import):
    """A 1-D uint8 tensor over [rec.ptr, +rec.nbytes) whose deleter closes `rec`."""
    shape = (ctypes.c_int64 * 1)(rec.nbytes)
    strides = (ctypes.c_int64 * 1)(1)
    mt = _DLManagedTensor()
    if rec.kind == "cpu":
        dev = _DLDevice(_kDLCPU, 0)
    elif rec.kind == "hip":
        dev = _DLDevice(_kDLROCM, rec.device)
    else:
        dev = _DLDevice(_kDLCUDA, rec.device)
    mt.dl_tensor = _DLTensor(rec.ptr, dev, 1, _DLDataType(_kDLUInt, 8, 1),
                             ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64)),
                             ctypes.cast(strides, ctypes.POINTER(ctypes.c_int64)), 0)
    mt.manager_ctx = rec.key
    mt.deleter = _DL_DELETER
    rec.keep = (mt, shape, strides)
    capsule = _PyCapsule_New(ctypes.addressof(mt), _DLTENSOR_NAME, None)
    try:
        return torch.utils.dlpack.from_dlpack(capsule)
    except BaseException:
        if _PyCapsule_IsValid(capsule, _DLTENSOR_NAME):
            rec.freed = True  # torch did not take it: its deleter will never run
        raise


def _ensure_initialized() -> None:
    from . import init, is_initialized

    if not is_initialized():
        init()


def open(share: Share):  # noqa: A001 - the public name is gpu_arena.open
    """Import ``share`` (consumer side) and return a tensor over the producer's memory (no
    copy) with the shared dtype, shape, stride and storage offset. Writes are seen by the
    producer and every other consumer (ordering them is the caller's job).

    Initializes gpu-arena (``gpu_arena.init()``, backend from the environment) if nothing
    did yet; ``gpu_arena.torch.install()`` before it is fine too. The import is closed when
    the last tensor over the memory is garbage-collected, or at once by
    :func:`close` (after which the tensor must not be used)."""
    torch = _torch()
    if isinstance(share, (bytes, bytearray, memoryview)):
        share = Share.from_bytes(share)
    if not isinstance(share, Share):
        raise TypeError(f"open() takes a gpu_arena.Share, not {type(share).__name__}")
    dtype = getattr(torch, share.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"open(): unknown dtype {share.dtype!r}")
    if share.nbytes != share.handle.length:
        raise ValueError(
            f"open(): the share says {share.nbytes} bytes, its handle {share.handle.length}")
    _ensure_initialized()
    backend = _backend()
    kind = {"sim": "cpu", "hip": "hip"}.get(backend, "cuda")
    _prune()
    ptr = import_handle(share.handle)
    rec = _Import(next(_keys), ptr, share.nbytes, share.device, kind, share.handle)
    with _registry_lock:
        _registry[rec.key] = rec
    try:
        raw = _wrap(torch, rec)
    except BaseException:
        _close_record(rec, synchronize=False)
        raise
    try:
        t = raw.view(dtype).as_strided(share.shape, share.stride, share.storage_offset)
    except BaseException:
        raw = None  # its deleter closes the import
        _close_record(rec, synchronize=False)
        raise
    raw = None
    try:
        t._gpu_arena_import = rec.key
    except (AttributeError, TypeError):  # pragma: no cover - torch always allows it
        pass
    return t


def _records() -> List[_Import]:
    with _registry_lock:
        return list(_registry.values())


def _close_imports_of(handle: ShareHandle) -> int:
    recs = [r for r in _records() if r.handle == handle and not r.closed]
    return sum(1 for r in recs if _close_record(r))


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
    rec = _registry.get(key) if key is not None else None
    if rec is None:  # a view of an opened tensor: find its import by the storage's address
        ptr = int(obj.untyped_storage().data_ptr())
        mine = [r for r in _records() if r.ptr == ptr and not r.freed]
        if not mine:
            raise ValueError("gpu_arena.close(): this tensor does not come from gpu_arena.open()")
        still_open = [r for r in mine if not r.closed]
        if not still_open:
            return 0  # closed already
        rec = still_open[-1]
    return 1 if _close_record(rec) else 0


def open_imports() -> List[Dict[str, Any]]:
    """The imports :func:`open` made in this process that are not closed yet (for
    debugging): pointer, bytes, device and the producer's pid."""
    recs = [r for r in _records() if not r.closed]
    return [{"ptr": r.ptr, "nbytes": r.nbytes, "device": r.device,
             "producer_pid": r.handle.producer_pid} for r in recs]
