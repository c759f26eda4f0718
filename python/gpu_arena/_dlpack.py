"""DLPack capsules for :func:`gpu_arena.open`: the C library builds the ``DLManagedTensor``
(``gpu_arena_import_dlpack``, ffi/src/dlpack_api.rs: it imports the share, and its deleter,
which torch calls when it frees the storage, closes the import); this module wraps it in a
``"dltensor"`` capsule for torch, and finds the DLPack dtype of a torch dtype.

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
from typing import Any, Callable, Dict, NamedTuple

__all__ = ["DEVICE_TYPES", "DtypeSpec", "dtype_spec", "to_torch"]

_kDLCPU, _kDLCUDA, _kDLROCM = 1, 2, 10
# What open()'s tensors are on (tensors._import_kind) -> DLPack device type.
DEVICE_TYPES = {"cpu": _kDLCPU, "hip": _kDLROCM, "cuda": _kDLCUDA}
_kDLUInt = 1
_DLTENSOR_NAME = ctypes.c_char_p(b"dltensor")
_DTYPE_OFFSET = 20  # DLTensor: data (8), device (4 + 4), ndim (4), then dtype

_PyCapsule_New = ctypes.pythonapi.PyCapsule_New
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_PyCapsule_IsValid = ctypes.pythonapi.PyCapsule_IsValid
_PyCapsule_IsValid.restype = ctypes.c_int
_PyCapsule_IsValid.argtypes = [ctypes.py_object, ctypes.c_char_p]
_PyCapsule_GetPointer = ctypes.pythonapi.PyCapsule_GetPointer
_PyCapsule_GetPointer.restype = ctypes.c_void_p
_PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


class DtypeSpec(NamedTuple):
    """How open() asks the library for a tensor of ``dtype``: the DLPack dtype (code | bits
    << 8 | lanes << 16) and item size it builds the tensor with, and ``reinterpret``: torch
    has no DLPack dtype for it (or does not read back its own), so the tensor comes as bytes
    (uint8, always flat) and open() views it as ``dtype``."""

    dtype: Any
    dl_dtype: int
    itemsize: int
    reinterpret: bool


_specs: Dict[Any, DtypeSpec] = {}


def dtype_spec(torch, dtype) -> DtypeSpec:
    """The :class:`DtypeSpec` of a torch dtype: torch's own DLPack dtype for it (read from
    ``to_dlpack`` of an empty tensor, checked to come back as ``dtype``), found once."""
    spec = _specs.get(dtype)
    if spec is not None:
        return spec
    itemsize = torch.empty(0, dtype=dtype).element_size()
    spec = DtypeSpec(dtype, _kDLUInt | 8 << 8 | 1 << 16, 1, True)
    try:
        capsule = torch._C._to_dlpack(torch.empty(1, dtype=dtype))
        at = _PyCapsule_GetPointer(capsule, _DLTENSOR_NAME)
        code, bits, lanes = ctypes.c_uint8.from_address(at + _DTYPE_OFFSET).value, \
            ctypes.c_uint8.from_address(at + _DTYPE_OFFSET + 1).value, \
            ctypes.c_uint16.from_address(at + _DTYPE_OFFSET + 2).value
        back = torch._C._from_dlpack(capsule)
        if back.dtype is dtype and bits * lanes == 8 * itemsize:
            spec = DtypeSpec(dtype, code | bits << 8 | lanes << 16, itemsize, False)
    except Exception:  # noqa: BLE001 - torch has no DLPack dtype for it: bytes, then a view
        pass
    _specs[dtype] = spec
    return spec


def to_torch(torch, managed: int, refused: Callable[[int], Any]):
    """The torch tensor over the ``DLManagedTensor*`` ``managed``. When torch raises without
    taking the capsule (its deleter will never run), ``refused(managed)`` is called before
    the exception propagates."""
    capsule = None
    try:
        capsule = _PyCapsule_New(managed, _DLTENSOR_NAME, None)
        # torch._C._from_dlpack is what torch.utils.dlpack.from_dlpack calls for a capsule,
        # without its Python-level dispatch on the argument's type.
        return _from_capsule(torch)(capsule)
    except BaseException:
        # No capsule (PyCapsule_New failed), or one torch did not consume (not renamed
        # "used_dltensor"): nobody else will ever call the deleter.
        if capsule is None or _PyCapsule_IsValid(capsule, _DLTENSOR_NAME):
            refused(managed)
        raise


def _from_capsule(torch) -> Callable[[Any], Any]:
    fn = getattr(torch._C, "_from_dlpack", None)
    return fn if fn is not None else torch.utils.dlpack.from_dlpack
