"""gpu-arena from Python: a ctypes binding of ``libgpu_arena.so``.

Without PyTorch::

    import gpu_arena
    gpu_arena.configure("backend=sim,arena_size=64MiB")   # optional, before first use
    gpu_arena.init()                                      # optional: the first call initializes
    p = gpu_arena.malloc(1 << 20)
    gpu_arena.free(p, 1 << 20)
    gpu_arena.stats()["reserved_bytes"]

With PyTorch, see :mod:`gpu_arena.torch` (``install()`` / ``mem_pool()``).

Sharing memory with other processes (:mod:`gpu_arena.ipc`): ``share_ptr`` / ``unshare`` /
``import_handle`` / ``close_import`` / ``imports_live`` for pointers, ``share(tensor)`` ->
``Share`` / ``open(share)`` -> tensor / ``close(tensor_or_share)`` for PyTorch tensors.

Arena observers (:mod:`gpu_arena.observers`): ``observe_arenas(on_ready, on_release)`` ->
handle (a context manager), ``unobserve_arenas(handle)``: register each arena with a
transport once, deregister it before its memory goes.

Every failure raises :class:`GpuArenaError` (``.code`` is the ``GPU_ARENA_ERR_*`` code,
the message names the call), or the subclass of its code: ``OutOfMemoryError`` (also a
``MemoryError``), ``InvalidArgumentError`` (also a ``ValueError``), ``UnknownPointerError``,
``InvalidStateError``, ``NotInitializedError``...

gpu-arena initializes itself on the first call that needs the pool (``malloc``, ``stats``,
``empty_cache``, ``snapshot``, ``validate``, ``device_count``, sharing), from
:func:`configure`'s settings or ``GPU_ARENA_CONF`` / ``GPU_ARENA_BACKEND``; :func:`init`
does it explicitly and raises the failure's own error. Logs go to stderr at the level of
``GPU_ARENA_LOG`` (default ``warn``), or :func:`set_log_level`.
"""

from __future__ import annotations

from . import _lib  # noqa: F401  (gpu_arena._lib, as before)
from ._lib import (  # noqa: F401  (re-exported)
    GPU_ARENA_ERR_BACKEND,
    GPU_ARENA_ERR_INTERNAL,
    GPU_ARENA_ERR_INVALID_ARGUMENT,
    GPU_ARENA_ERR_INVALID_DEVICE,
    GPU_ARENA_ERR_INVALID_STATE,
    GPU_ARENA_ERR_IPC,
    GPU_ARENA_ERR_NOT_INITIALIZED,
    GPU_ARENA_ERR_OUT_OF_MEMORY,
    GPU_ARENA_ERR_UNAVAILABLE,
    GPU_ARENA_ERR_UNKNOWN_POINTER,
    GPU_ARENA_OK,
    BackendError,
    GpuArenaError,
    GpuArenaStats,
    InternalError,
    InvalidArgumentError,
    InvalidDeviceError,
    InvalidStateError,
    IpcError,
    LibraryNotFoundError,
    NotInitializedError,
    OutOfMemoryError,
    UnavailableError,
    UnknownPointerError,
    last_error,
    lib_path,
)

# The runtime calls (gpu_arena/runtime.py), re-exported.
from .runtime import (  # noqa: F401
    ConfigKey,
    backend_name,
    config_keys,
    configure,
    current_tag,
    device_count,
    empty_cache,
    free,
    init,
    is_initialized,
    malloc,
    record_stream,
    set_log_level,
    set_tag,
    sleep,
    sleep_prepare,
    sleep_release_host,
    snapshot,
    stats,
    trim,
    validate,
    wake,
)

# Re-exported. `open` and `close` are attributes (gpu_arena.open, gpu_arena.close) but not in
# __all__: `from gpu_arena import *` must not shadow the builtins.
from .ipc import (  # noqa: E402,F401
    Share,
    ShareHandle,
    close,
    close_import,
    import_handle,
    imports_live,
    open,
    share,
    share_ptr,
    unshare,
)

from .observers import (  # noqa: E402,F401  (re-exported)
    ARENA_EXPORTED,
    ARENA_PINNED,
    ArenaInfo,
    ArenaObserver,
    observe_arenas,
    unobserve_arenas,
)

__version__ = "0.1.0"

__all__ = [
    "configure",
    "config_keys",
    "ConfigKey",
    "init",
    "is_initialized",
    "set_log_level",
    "stats",
    "empty_cache",
    "trim",
    "set_tag",
    "current_tag",
    "sleep",
    "sleep_prepare",
    "sleep_release_host",
    "wake",
    "snapshot",
    "validate",
    "backend_name",
    "device_count",
    "lib_path",
    "last_error",
    "malloc",
    "free",
    "record_stream",
    "share_ptr",
    "unshare",
    "import_handle",
    "close_import",
    "imports_live",
    "ShareHandle",
    "Share",
    "share",
    "observe_arenas",
    "unobserve_arenas",
    "ArenaInfo",
    "ArenaObserver",
    "ARENA_EXPORTED",
    "ARENA_PINNED",
    "GpuArenaError",
    "GpuArenaStats",
    "InvalidArgumentError",
    "OutOfMemoryError",
    "UnknownPointerError",
    "BackendError",
    "InvalidDeviceError",
    "NotInitializedError",
    "InvalidStateError",
    "UnavailableError",
    "IpcError",
    "InternalError",
    "LibraryNotFoundError",
]
