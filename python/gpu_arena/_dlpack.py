"""DLPack from ctypes: a torch tensor over memory gpu-arena imported, whose deleter runs
when torch frees the storage.

Why DLPack and not ``__cuda_array_interface__``: ``torch.as_tensor`` over an object with
``__cuda_array_interface__`` does keep that object alive (torch's
``tensor_from_cuda_array_interface`` takes a reference and drops it in the storage's
deleter), but that path refuses to run when NumPy is not installed ("Numpy is not
available"), and PyTorch does not depend on NumPy. A DLPack capsule gives the same
guarantee (its deleter runs when the storage is freed) without NumPy, and works for CPU
tensors too, which lets the sim backend (host memory) test sharing without a GPU.
"""

from __future__ import annotations

import ctypes
import struct
from typing import Any, Callable, Tuple

__all__ = ["Deleter", "persistent_deleter", "managed_tensor", "to_torch"]


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


Deleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [
    ("dl_tensor", _DLTensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", Deleter),
]

_kDLCPU, _kDLCUDA, _kDLROCM = 1, 2, 10
_kDLUInt = 1
_DLTENSOR_NAME = ctypes.c_char_p(b"dltensor")
# torch may free a tensor over imported memory after the modules' globals are torn down at
# interpreter exit: the capsule name lives for the process's life.
ctypes.pythonapi.Py_IncRef(ctypes.py_object(_DLTENSOR_NAME))

_PyCapsule_New = ctypes.pythonapi.PyCapsule_New
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_PyCapsule_IsValid = ctypes.pythonapi.PyCapsule_IsValid
_PyCapsule_IsValid.restype = ctypes.c_int
_PyCapsule_IsValid.argtypes = [ctypes.py_object, ctypes.c_char_p]


def persistent_deleter(fn: Callable[[Any], None]) -> "Deleter":
    """A C deleter calling ``fn(managed)`` (a ``POINTER(DLManagedTensor)``; read
    ``managed.contents.manager_ctx``), kept alive for the process's life: torch may call it
    after the modules' globals are torn down at interpreter exit."""
    thunk = Deleter(fn)
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(thunk))
    return thunk


# One open() = one ctypes object: the DLManagedTensor with its shape and strides arrays
# after it, every field flat so that a single constructor call fills it (building the nested
# structures and casting the arrays field by field cost more than the rest of the wrapping).
# Same layout as _DLManagedTensor (checked below): the deleter reads it through that type.
class _Flat(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device_type", ctypes.c_int32),
        ("device_id", ctypes.c_int32),
        ("ndim", ctypes.c_int32),
        ("code", ctypes.c_uint8),
        ("bits", ctypes.c_uint8),
        ("lanes", ctypes.c_uint16),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("byte_offset", ctypes.c_uint64),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("shape0", ctypes.c_int64),
        ("strides0", ctypes.c_int64),
    ]


def _check_layout() -> None:
    t = _DLTensor
    pairs = [("data", t.data.offset), ("device_type", t.device.offset),
             ("ndim", t.ndim.offset), ("code", t.dtype.offset), ("shape", t.shape.offset),
             ("strides", t.strides.offset), ("byte_offset", t.byte_offset.offset),
             ("manager_ctx", _DLManagedTensor.manager_ctx.offset),
             ("deleter", _DLManagedTensor.deleter.offset)]
    for name, off in pairs:
        assert getattr(_Flat, name).offset == off, name
    assert _Flat.shape0.offset >= ctypes.sizeof(_DLManagedTensor)
    assert _FLAT_FORMAT.size == ctypes.sizeof(_Flat) == _Flat.strides0.offset + 8
    assert ctypes.sizeof(ctypes.c_void_p) == 8


# _Flat's bytes, native order: data, device (type, id), ndim, dtype (code, bits, lanes),
# shape, strides, byte_offset, manager_ctx, deleter, shape[0], strides[0].
_FLAT_FORMAT = struct.Struct("=QiiiBBHQQQQQqq")
_pack_into = _FLAT_FORMAT.pack_into


_check_layout()
_SHAPE0 = _Flat.shape0.offset
_STRIDES0 = _Flat.strides0.offset
_DEVICE_TYPES = {"cpu": _kDLCPU, "hip": _kDLROCM, "cuda": _kDLCUDA}


def managed_tensor(ptr: int, nbytes: int, kind: str, device: int, ctx: int,
                   deleter: "Deleter") -> Tuple[Any, ...]:
    """A ``DLManagedTensor`` for a 1-D uint8 tensor over ``[ptr, +nbytes)`` on ``kind``
    (``"cpu"``, ``"cuda"``, ``"hip"``) device ``device``, whose deleter gets
    ``manager_ctx == ctx``, with the arrays it points to. Keep the tuple alive until the
    deleter ran: torch points into it."""
    dev_type = _DEVICE_TYPES.get(kind, _kDLCUDA)
    mt = _Flat()
    at = ctypes.addressof(mt)
    # One pack_into fills every field (a ctypes constructor with 14 arguments costs several
    # microseconds: each goes through a field descriptor).
    _pack_into(mt, 0, ptr, dev_type, 0 if dev_type == _kDLCPU else device, 1, _kDLUInt, 8, 1,
               at + _SHAPE0, at + _STRIDES0, 0, ctx, _deleter_address(deleter), nbytes, 1)
    return (mt,)


_deleter_addresses: dict = {}


def _deleter_address(deleter: "Deleter") -> int:
    addr = _deleter_addresses.get(id(deleter))
    if addr is None:
        addr = ctypes.cast(deleter, ctypes.c_void_p).value
        _deleter_addresses[id(deleter)] = addr
    return addr


def to_torch(torch, managed: Tuple[Any, ...], refused: Callable[[], None]):
    """The torch tensor over ``managed`` (from :func:`managed_tensor`). When torch raises
    without taking the capsule (its deleter will never run), ``refused()`` is called before
    the exception propagates."""
    capsule = _PyCapsule_New(ctypes.addressof(managed[0]), _DLTENSOR_NAME, None)
    try:
        # torch._C._from_dlpack is what torch.utils.dlpack.from_dlpack calls for a capsule,
        # without its Python-level dispatch on the argument's type.
        from_capsule = getattr(torch._C, "_from_dlpack", None) or torch.utils.dlpack.from_dlpack
        return from_capsule(capsule)
    except BaseException:
        if _PyCapsule_IsValid(capsule, _DLTENSOR_NAME):
            refused()
        raise
