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


def managed_tensor(ptr: int, nbytes: int, kind: str, device: int, ctx: int,
                   deleter: "Deleter") -> Tuple[Any, ...]:
    """A ``DLManagedTensor`` for a 1-D uint8 tensor over ``[ptr, +nbytes)`` on ``kind``
    (``"cpu"``, ``"cuda"``, ``"hip"``) device ``device``, whose deleter gets
    ``manager_ctx == ctx``, with the arrays it points to. Keep the tuple alive until the
    deleter ran: torch points into it."""
    shape = (ctypes.c_int64 * 1)(nbytes)
    strides = (ctypes.c_int64 * 1)(1)
    mt = _DLManagedTensor()
    if kind == "cpu":
        dev = _DLDevice(_kDLCPU, 0)
    elif kind == "hip":
        dev = _DLDevice(_kDLROCM, device)
    else:
        dev = _DLDevice(_kDLCUDA, device)
    mt.dl_tensor = _DLTensor(ptr, dev, 1, _DLDataType(_kDLUInt, 8, 1),
                             ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64)),
                             ctypes.cast(strides, ctypes.POINTER(ctypes.c_int64)), 0)
    mt.manager_ctx = ctx
    mt.deleter = deleter
    return (mt, shape, strides)


def to_torch(torch, managed: Tuple[Any, ...], refused: Callable[[], None]):
    """The torch tensor over ``managed`` (from :func:`managed_tensor`). When torch raises
    without taking the capsule (its deleter will never run), ``refused()`` is called before
    the exception propagates."""
    capsule = _PyCapsule_New(ctypes.addressof(managed[0]), _DLTENSOR_NAME, None)
    try:
        return torch.utils.dlpack.from_dlpack(capsule)
    except BaseException:
        if _PyCapsule_IsValid(capsule, _DLTENSOR_NAME):
            refused()
        raise
