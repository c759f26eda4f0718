"""The share handle: 128 plain bytes (C: ``gpu_arena_share_t``; layout in
alloc/src/ipc/handle.rs, served by the library). No pointer, no fd: it travels any way bytes
travel."""

from __future__ import annotations

import ctypes
import struct
from typing import Any, Dict, Optional, Tuple, Union

from . import _lib
from ._lib import SHARE_BYTES, GpuArenaShare

__all__ = ["ShareHandle", "as_handle"]

_MAGIC = b"GPUARENA"

# The layout (field -> (first byte, length); integers little-endian) is Rust's
# (alloc/src/ipc/handle.rs, `layout::FIELDS`), read from the library (`gpu_arena_share_layout`:
# loads it, initializes nothing) the first time a field is decoded.
_layout_cache: Optional[Dict[str, Tuple[int, int]]] = None
# The unsigned integer of each length; the device is signed.
_UINT = {2: "H", 4: "I", 8: "Q"}
_device_unpack = None


def _layout() -> Dict[str, Tuple[int, int]]:
    """The handle's fields in byte order, reserved bytes included: name -> (first byte,
    length), as the library serves them."""
    global _layout_cache
    if _layout_cache is None:
        lib = _lib.lib()
        if not _lib.has_ipc():
            raise _lib.LibraryNotFoundError(
                f"{_lib.lib_path()} has no gpu_arena_share_layout (built without IPC?)")
        n = _lib.check(lib.gpu_arena_share_layout(None, 0), "gpu_arena_share_layout")
        fields = (_lib.GpuArenaShareField * n)()
        _lib.check(lib.gpu_arena_share_layout(fields, n), "gpu_arena_share_layout")
        _layout_cache = {f.name.decode(): (f.offset, f.len) for f in fields}
    return _layout_cache


def _device_of(buf, offset: int = 0) -> Tuple[int]:
    """The producer's device (an int32) of the handle at ``offset`` of ``buf``, as
    ``struct.unpack_from`` gives it: ``_device_of(handle, 0)[0]`` (tensors.share() reads it
    per call without the property)."""
    global _device_unpack
    if _device_unpack is None:
        _device_unpack = struct.Struct("<%dxi" % _layout()["device"][0]).unpack_from
    return _device_unpack(buf, offset)


class ShareHandle(bytes):
    """A share handle: exactly 128 bytes (``gpu_arena_share_t``). It is ``bytes``: send it,
    store it, ``.hex()`` it; ``ShareHandle(b)`` / ``ShareHandle.from_hex(s)`` bring it back.

    The properties decode the fields for display and routing (the layout is the library's,
    ``gpu_arena_share_layout``, read on first use); the library validates the handle on every
    use."""

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

    def _field(self, name: str) -> bytes:
        """The raw bytes of field ``name`` (a key of the layout)."""
        at, n = _layout()[name]
        return bytes(self[at:at + n])

    def _u(self, name: str) -> int:
        at, n = _layout()[name]
        return struct.unpack_from("<" + _UINT[n], self, at)[0]

    @property
    def is_gpu_arena(self) -> bool:
        """Whether it starts with gpu-arena's magic."""
        return self._field("magic") == _MAGIC

    @property
    def version(self) -> int:
        return self._u("version")

    @property
    def device(self) -> int:
        """The producer's device index."""
        return _device_of(self, 0)[0]

    @property
    def producer_pid(self) -> int:
        return self._u("producer_pid")

    @property
    def share_key(self) -> int:
        return self._u("share_key")

    @property
    def arena_id(self) -> int:
        return self._u("arena_id")

    @property
    def generation(self) -> int:
        return self._u("generation")

    @property
    def offset(self) -> int:
        """Offset of the shared range in its arena, in bytes."""
        return self._u("offset")

    @property
    def length(self) -> int:
        """Length of the shared range, in bytes."""
        return self._u("len")

    @property
    def arena_bytes(self) -> int:
        return self._u("arena_bytes")

    @property
    def socket_name(self) -> str:
        return self._field("socket_name").split(b"\0", 1)[0].decode("ascii", "replace")

    def __repr__(self) -> str:
        if not self.is_gpu_arena:
            return f"ShareHandle(<not a gpu-arena handle> {bytes(self[:16]).hex()}...)"
        return (
            f"ShareHandle(producer_pid={self.producer_pid}, device={self.device}, "
            f"arena={self.arena_id}, offset={self.offset}, length={self.length})"
        )

    __str__ = __repr__


def as_handle(handle: Any) -> ShareHandle:
    """``handle`` as a :class:`ShareHandle`: a handle, its 128 bytes, or a ``Share`` (its
    ``.handle``)."""
    if isinstance(handle, ShareHandle):
        return handle
    if isinstance(getattr(handle, "handle", None), ShareHandle):  # a gpu_arena.Share
        return handle.handle
    if isinstance(handle, (bytes, bytearray, memoryview)):
        return ShareHandle(handle)
    raise TypeError(
        f"expected a ShareHandle (or its 128 bytes, or a Share), not {type(handle).__name__}"
    )
