"""ctypes binding of ``libgpu_arena.so`` (the C API in ``ffi/src/lib.rs``).

``pip install ./python`` builds the library (with maturin, from ``ffi/``) and installs it
inside the package. It is searched in this order:

1. the environment variable ``GPU_ARENA_LIB`` (a path to the ``.so``, or a folder holding
   ``libgpu_arena.so``; if it is set, it must exist: a wrong path is an error, not a silent
   fall-through);
2. the packaged library, ``gpu_arena/_native/lib_native.so`` (where the wheel puts it; maturin
   names it after the ``_native`` module it sits in, beside a cffi wrapper that is never
   imported: the file is this library, loaded with ctypes like any other);
3. ``$CARGO_TARGET_DIR/release`` then ``$CARGO_TARGET_DIR/debug`` when that variable is set;
4. the cargo target dir of the repository this package sits in (when it runs from a checkout,
   not from site-packages): ``<repo>/target/release`` then ``<repo>/target/debug``
   (``<repo>`` is ``python/..``).

The library is loaded lazily, on the first call that needs it: ``import gpu_arena`` works
without it.
"""

from __future__ import annotations

import ctypes
import operator
import os
import threading
from pathlib import Path
from typing import List, NamedTuple, Optional, Tuple

LIB_NAME = "libgpu_arena.so"
# Where the wheel puts the library, relative to the package (python/pyproject.toml's
# `module-name = "gpu_arena._native"`: maturin writes `lib<module>.so`).
PACKAGED_LIB = Path("_native") / "lib_native.so"

# Error codes: keep in step with `GPU_ARENA_ERR_*` in ffi/include/gpu_arena.h (a test checks).
GPU_ARENA_OK = 0
GPU_ARENA_ERR_INVALID_ARGUMENT = -1
GPU_ARENA_ERR_OUT_OF_MEMORY = -2
GPU_ARENA_ERR_UNKNOWN_POINTER = -3
GPU_ARENA_ERR_BACKEND = -4
GPU_ARENA_ERR_INVALID_DEVICE = -5
GPU_ARENA_ERR_NOT_INITIALIZED = -6
GPU_ARENA_ERR_INVALID_STATE = -7
GPU_ARENA_ERR_UNAVAILABLE = -8
GPU_ARENA_ERR_IPC = -9
GPU_ARENA_ERR_INTERNAL = -10

# code -> its name, e.g. -2 -> "GPU_ARENA_ERR_OUT_OF_MEMORY".
ERROR_NAMES = {v: k for k, v in dict(globals()).items() if k.startswith("GPU_ARENA_ERR_")}


# --------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------


class LibraryNotFoundError(OSError):
    """``libgpu_arena.so`` was not found (or could not be loaded)."""


class GpuArenaError(Exception):
    """A gpu-arena call failed.

    ``code`` is the negative ``GPU_ARENA_ERR_*`` code, ``message`` the text of
    ``gpu_arena_last_error()`` (it names the call, the value and the reason).
    ``GpuArenaError(code, message)`` builds the subclass that matches ``code``.
    """

    code: int = GPU_ARENA_ERR_INTERNAL

    def __new__(cls, code: int = GPU_ARENA_ERR_INTERNAL, message: str = "", *args):
        if cls is GpuArenaError:
            cls = _CLASS_OF_CODE.get(code, GpuArenaError)
        # Exception.__new__, not super(): MemoryError.__new__ refuses subclasses that also
        # derive from another Exception subclass.
        return Exception.__new__(cls, code, message, *args)

    def __init__(self, code: int = GPU_ARENA_ERR_INTERNAL, message: str = "", *args):
        super().__init__(code, message, *args)
        self.code = code
        self.message = message

    @property
    def code_name(self) -> str:
        return ERROR_NAMES.get(self.code, f"code {self.code}")

    def __str__(self) -> str:
        return f"{self.message} [{self.code_name}]" if self.message else self.code_name

    def __reduce__(self):
        return (GpuArenaError, (self.code, self.message))


class InvalidArgumentError(GpuArenaError, ValueError):
    """A bad argument: size, pointer, configuration string, NULL out-parameter."""

    code = GPU_ARENA_ERR_INVALID_ARGUMENT


class OutOfMemoryError(GpuArenaError, MemoryError):
    """Out of device memory (after gpu-arena released its cached arenas and retried)."""

    code = GPU_ARENA_ERR_OUT_OF_MEMORY


class UnknownPointerError(GpuArenaError):
    """A pointer gpu-arena did not allocate, or one already freed."""

    code = GPU_ARENA_ERR_UNKNOWN_POINTER


class BackendError(GpuArenaError):
    """A driver call failed."""

    code = GPU_ARENA_ERR_BACKEND


class InvalidDeviceError(GpuArenaError, ValueError):
    """Device index out of range."""

    code = GPU_ARENA_ERR_INVALID_DEVICE


class NotInitializedError(GpuArenaError):
    """gpu-arena failed to initialize (the message says why), or a call that takes back a
    pointer (``free``, ``record_stream``...) came before anything initialized it."""

    code = GPU_ARENA_ERR_NOT_INITIALIZED


class InvalidStateError(GpuArenaError):
    """Not valid now (e.g. configure after init)."""

    code = GPU_ARENA_ERR_INVALID_STATE


class UnavailableError(GpuArenaError):
    """The requested backend is not available here."""

    code = GPU_ARENA_ERR_UNAVAILABLE


class IpcError(GpuArenaError):
    """Sharing/import failure: bad handle, wrong token, dead peer."""

    code = GPU_ARENA_ERR_IPC


class InternalError(GpuArenaError):
    """A gpu-arena bug (an invariant broke, or a panic was caught)."""

    code = GPU_ARENA_ERR_INTERNAL


# The one map from a code to its exception class (each class names its code).
_CLASS_OF_CODE = {
    cls.code: cls
    for cls in (
        InvalidArgumentError,
        OutOfMemoryError,
        UnknownPointerError,
        BackendError,
        InvalidDeviceError,
        NotInitializedError,
        InvalidStateError,
        UnavailableError,
        IpcError,
        InternalError,
    )
}


# --------------------------------------------------------------------------------------
# The stats struct
# --------------------------------------------------------------------------------------


class GpuArenaStatsField(ctypes.Structure):
    """``gpu_arena_stats_field_t``: one field of ``gpu_arena_stats_t`` and its metric
    (``gpu_arena_stats_fields``); the strings are the library's, static."""

    _fields_ = [("name", ctypes.c_char_p), ("offset", ctypes.c_uint32),
                ("len", ctypes.c_uint32), ("metric", ctypes.c_char_p), ("kind", ctypes.c_char_p),
                ("help", ctypes.c_char_p)]


class StatField(NamedTuple):
    """One field of ``gpu_arena_stats_t`` as the library serves it: its name (the key of
    ``gpu_arena.stats()``), its first byte, and the metric that exposes it (name,
    ``"gauge"`` or ``"counter"``, help text). The table is Rust's ``STAT_FIELDS``
    (alloc/src/stats.rs), beside ``PoolStats``."""

    name: str
    offset: int
    metric: str
    kind: str
    help: str


_stat_fields: Optional[Tuple[StatField, ...]] = None


def stat_fields() -> Tuple[StatField, ...]:
    """Every field of ``gpu_arena_stats_t``, in order, read from the library
    (``gpu_arena_stats_fields``: loads it, does not initialize gpu-arena) once."""
    global _stat_fields
    if _stat_fields is None:
        fn = lib().gpu_arena_stats_fields
        n = check(fn(None, 0), "gpu_arena_stats_fields")
        out = (GpuArenaStatsField * n)()
        check(fn(out, n), "gpu_arena_stats_fields")
        fields = tuple(StatField(f.name.decode(), f.offset, f.metric.decode(), f.kind.decode(),
                                 f.help.decode()) for f in out)
        if [f.offset for f in fields] != [8 * i for i in range(n)] or any(f.len != 8 for f in out):
            raise LibraryNotFoundError(f"{_path}: gpu_arena_stats_fields serves a layout this "
                                       "package cannot read (not consecutive uint64_t fields)")
        _stat_fields = fields
    return _stat_fields


class _ServedFields(type(ctypes.Structure)):
    """The metaclass of :class:`GpuArenaStats`: its ``_fields_`` are the library's, set on
    first use (an instance, or reading ``_fields_``), so importing gpu_arena loads nothing."""

    def _complete(cls) -> None:
        with _lock_fields:
            if "_fields_" not in vars(cls):
                cls._fields_ = [(f.name, ctypes.c_uint64) for f in stat_fields()]

    def __call__(cls, *args, **kwargs):
        cls._complete()
        return super().__call__(*args, **kwargs)

    def __getattr__(cls, name):
        if name == "_fields_" and vars(cls).get("_served"):
            cls._complete()
            return vars(cls)["_fields_"]
        raise AttributeError(name)


_lock_fields = threading.Lock()


class GpuArenaStats(ctypes.Structure, metaclass=_ServedFields):
    """``gpu_arena_stats_t``: counters of one device's pool, all ``uint64_t``, all sizes in
    bytes. Its fields are the ones the library serves (``gpu_arena_stats_fields``, the table
    beside ``PoolStats`` in alloc/src/stats.rs), set on first use: ``ctypes.sizeof`` is 0
    before the first instance."""

    def to_dict(self) -> dict:
        return {name: int(getattr(self, name)) for name, _ in type(self)._fields_}


GpuArenaStats._served = True  # from now on, reading _fields_ completes the class


class GpuArenaConfigKey(ctypes.Structure):
    """``gpu_arena_config_key_t``: one configuration key (``gpu_arena_config_keys``); the
    strings are the library's, static."""

    _fields_ = [("name", ctypes.c_char_p), ("values", ctypes.c_char_p),
                ("default_value", ctypes.c_char_p), ("help", ctypes.c_char_p)]


SHARE_BYTES = 128
GPU_ARENA_BATCH_MAX = 1048576  # most entries of one batch call (gpu_arena_share_many, ...)


class GpuArenaShare(ctypes.Structure):
    """``gpu_arena_share_t``: ``typedef struct { uint8_t bytes[128]; }``."""

    _fields_ = [("bytes", ctypes.c_uint8 * SHARE_BYTES)]


class GpuArenaShareField(ctypes.Structure):
    """``gpu_arena_share_field_t``: one field of a share handle (``gpu_arena_share_layout``)."""

    _fields_ = [("name", ctypes.c_char * 16), ("offset", ctypes.c_uint32),
                ("len", ctypes.c_uint32)]


class GpuArenaShareFields(ctypes.Structure):
    """``gpu_arena_share_fields_t``: a share handle as the library decodes it
    (``gpu_arena_share_fields``)."""

    _fields_ = [
        ("device", ctypes.c_int32),
        ("producer_pid", ctypes.c_uint32),
        ("share_key", ctypes.c_uint32),
        ("generation", ctypes.c_uint32),
        ("arena_id", ctypes.c_uint64),
        ("offset", ctypes.c_uint64),
        ("len", ctypes.c_uint64),
        ("arena_bytes", ctypes.c_uint64),
        ("token", ctypes.c_uint8 * 16),
        ("socket_name", ctypes.c_char * 64),
    ]


class GpuArenaPoolBlock(ctypes.Structure):
    """``gpu_arena_pool_block_t``: a live block of a graph pool."""

    _fields_ = [("ptr", ctypes.c_uint64), ("requested", ctypes.c_uint64),
                ("bytes", ctypes.c_uint64), ("stream", ctypes.c_void_p)]


class GpuArenaSegment(ctypes.Structure):
    """``gpu_arena_segment_t``: an arena as a segment of PyTorch's snapshot."""

    _fields_ = [("address", ctypes.c_uint64), ("bytes", ctypes.c_uint64),
                ("pool_id0", ctypes.c_uint64), ("pool_id1", ctypes.c_uint64),
                ("first_block", ctypes.c_uint64), ("block_count", ctypes.c_uint64),
                ("small", ctypes.c_uint8), ("in_graph_pool", ctypes.c_uint8)]


class GpuArenaSegmentBlock(ctypes.Structure):
    """``gpu_arena_segment_block_t``: a range of a segment."""

    _fields_ = [("address", ctypes.c_uint64), ("bytes", ctypes.c_uint64),
                ("requested", ctypes.c_uint64), ("allocated", ctypes.c_uint8)]


class GpuArenaDlpack(ctypes.Structure):
    """``gpu_arena_dlpack_t``: what ``gpu_arena_import_dlpack`` hands back."""

    _fields_ = [("managed", ctypes.c_void_p), ("id", ctypes.c_uint64), ("flat", ctypes.c_int32),
                ("ndim", ctypes.c_int32)]


class GpuArenaDlpackImport(ctypes.Structure):
    """``gpu_arena_dlpack_import_t``: one live import of ``gpu_arena_import_dlpack``."""

    _fields_ = [
        ("id", ctypes.c_uint64),
        ("ptr", ctypes.c_void_p),
        ("nbytes", ctypes.c_uint64),
        ("device", ctypes.c_int32),
        ("closed", ctypes.c_int32),
        ("share", GpuArenaShare),
    ]


GPU_ARENA_DLPACK_VIEW_HEAD = 8  # int64 entries of the view before its shape and strides


# The transfer engine (ffi/src/transfer_api.rs): what NIXL's backend GPU_ARENA calls
# (gpu_arena/native/nixl/); declared here so every exported function has its signature.
GPU_ARENA_XFER_READ = 0
GPU_ARENA_XFER_WRITE = 1
GPU_ARENA_XFER_IDLE = 0
GPU_ARENA_XFER_IN_PROGRESS = 1
GPU_ARENA_XFER_DONE = 2


class GpuArenaXferDesc(ctypes.Structure):
    """``gpu_arena_xfer_desc_t``: a range and the metadata id of its registration."""

    _fields_ = [("addr", ctypes.c_uint64), ("len", ctypes.c_uint64), ("md", ctypes.c_uint64)]


class GpuArenaXferStats(ctypes.Structure):
    """``gpu_arena_xfer_stats_t``: one engine's counters."""

    _fields_ = [(n, ctypes.c_uint64) for n in (
        "registrations", "remote_loaded", "posted", "copies", "bytes", "notifs_sent",
        "notifs_received", "revokes_sent", "revoked", "revoke_timeouts", "slept", "reloaded")]


XFER_NOTIF_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t,
                                 ctypes.c_char_p, ctypes.c_size_t)


# Arena observers (ffi/src/observers.rs; the Python API is gpu_arena.observers).
GPU_ARENA_ARENA_EXPORTED = 1
GPU_ARENA_ARENA_PINNED = 2


class GpuArenaArenaInfo(ctypes.Structure):
    """``gpu_arena_arena_info_t``: one arena, as an observer callback sees it."""

    _fields_ = [
        ("device", ctypes.c_int32),
        ("flags", ctypes.c_uint32),
        ("arena_id", ctypes.c_uint64),
        ("base", ctypes.c_void_p),
        ("size", ctypes.c_size_t),
    ]


# ``gpu_arena_arena_fn``: int (*)(const gpu_arena_arena_info_t*, void* user).
ARENA_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(GpuArenaArenaInfo), ctypes.c_void_p)


# --------------------------------------------------------------------------------------
# Finding and loading the library
# --------------------------------------------------------------------------------------

_PKG_DIR = Path(__file__).resolve().parent
# python/gpu_arena/_lib.py -> python/ -> the repository root
_REPO_DIR = _PKG_DIR.parent.parent


def candidate_paths() -> List[Path]:
    """The places searched, in order (``GPU_ARENA_LIB`` excluded)."""
    places = [packaged_path()]
    target = os.environ.get("CARGO_TARGET_DIR")
    if target:
        t = Path(target)
        if not t.is_absolute():
            t = _REPO_DIR / t
        places += [t / "release" / LIB_NAME, t / "debug" / LIB_NAME]
    if in_checkout():
        places += [
            _REPO_DIR / "target" / "release" / LIB_NAME,
            _REPO_DIR / "target" / "debug" / LIB_NAME,
        ]
    return places


def packaged_path() -> Path:
    """Where ``pip install`` puts the library (it may not exist: a checkout run without an
    install has none)."""
    return _PKG_DIR / PACKAGED_LIB


def in_checkout() -> bool:
    """Whether the package runs from the gpu-arena repository (python/ beside Cargo.toml),
    as in a checkout or an editable install, rather than from site-packages."""
    return (_REPO_DIR / "Cargo.toml").is_file() and (_PKG_DIR.parent / "pyproject.toml").is_file()


def find_library() -> Path:
    """The path of ``libgpu_arena.so`` per the search order above, or LibraryNotFoundError."""
    env = os.environ.get("GPU_ARENA_LIB")
    if env:
        p = Path(env).expanduser()
        if p.is_dir():
            p = p / LIB_NAME
        if p.is_file():
            return p.resolve()
        raise LibraryNotFoundError(
            f"GPU_ARENA_LIB={env!r} does not name an existing file ({p}). Unset it to search "
            "the default places: " + ", ".join(str(c) for c in candidate_paths())
        )
    places = candidate_paths()
    for p in places:
        if p.is_file():
            return p.resolve()
    raise LibraryNotFoundError(
        f"{LIB_NAME} not found. Searched, in order:\n"
        "  - $GPU_ARENA_LIB (not set)\n"
        + "".join(f"  - {p}\n" for p in places)
        + ("" if in_checkout() else "  (the repository's target/ is searched only when the package "
           "runs from a checkout or an editable install)\n")
        + "Install the package with `pip install ./python` from the repository root (it builds "
        "and ships the library), build it with `cargo build -p gpu-arena-ffi` (or --release) "
        "in the repository, or set GPU_ARENA_LIB=/path/to/libgpu_arena.so."
    )


c_int, c_ssize_t, c_void_p, c_char_p = ctypes.c_int, ctypes.c_ssize_t, ctypes.c_void_p, ctypes.c_char_p

def _xfer_signatures() -> dict:
    u64, size = ctypes.c_uint64, ctypes.c_size_t
    pu64, pint, pstr = ctypes.POINTER(u64), ctypes.POINTER(c_int), ctypes.POINTER(c_void_p)
    desc = ctypes.POINTER(GpuArenaXferDesc)
    sigs = {
        "engine_new": [c_char_p, pu64], "engine_free": [u64], "conn_info": [u64, pstr],
        "load_conn_info": [u64, c_char_p, c_char_p], "forget_agent": [u64, c_char_p],
        "register_mem": [u64, u64, u64, pu64], "deregister_mem": [u64, u64],
        "public_data": [u64, u64, pstr], "load_remote": [u64, c_char_p, c_char_p, size, pu64],
        "load_local": [u64, u64, pu64], "unload": [u64, u64],
        "prepare": [u64, c_int, desc, desc, size, c_char_p, pu64],
        "post": [u64, u64, c_char_p, size, pint], "check": [u64, u64, pint],
        "release": [u64, u64], "notify": [u64, c_char_p, c_char_p, size],
        "take_notifs": [u64, XFER_NOTIF_FN, c_void_p],
        "stats": [u64, ctypes.POINTER(GpuArenaXferStats)],
    }
    return {f"gpu_arena_xfer_{n}": (c_int, args) for n, args in sigs.items()}


# name: (restype, argtypes). Every exported function of ffi/src/lib.rs.
_SIGNATURES = {
    "gpu_arena_malloc": (c_void_p, [c_ssize_t, c_int, c_void_p]),
    "gpu_arena_free": (None, [c_void_p, c_ssize_t, c_int, c_void_p]),
    "gpu_arena_free_checked": (c_int, [c_void_p, c_ssize_t, c_int]),
    "gpu_arena_init": (None, [c_int]),
    "gpu_arena_init_status": (c_int, []),
    "gpu_arena_reset": (None, []),
    "gpu_arena_record_stream": (None, [c_void_p, c_void_p]),
    "gpu_arena_record_stream_checked": (c_int, [c_void_p, c_void_p]),
    "gpu_arena_configure": (c_int, [c_char_p]),
    "gpu_arena_empty_cache": (c_int, [c_int]),
    # The out-parameter is a GpuArenaStats (byref), whose fields are the library's own.
    "gpu_arena_stats": (c_int, [c_int, c_void_p]),
    "gpu_arena_stats_fields": (c_int, [ctypes.POINTER(GpuArenaStatsField), ctypes.c_size_t]),
    "gpu_arena_config_keys": (c_int, [ctypes.POINTER(GpuArenaConfigKey), ctypes.c_size_t]),
    "gpu_arena_validate": (c_int, [c_int]),
    "gpu_arena_device_count": (c_int, []),
    "gpu_arena_backend_name": (c_char_p, []),
    # c_void_p, not c_char_p: the string must be handed back to gpu_arena_string_free.
    "gpu_arena_snapshot_json": (c_void_p, []),
    "gpu_arena_string_free": (None, [c_void_p]),
    "gpu_arena_last_error": (c_char_p, []),
    "gpu_arena_last_error_code": (c_int, []),
    "gpu_arena_set_log_level": (c_int, [c_char_p]),
    # PyTorch helpers (ffi/src/torch_api.rs). gpu_arena_torch_malloc throws a C++ exception
    # on failure: never call it through ctypes (only PyTorch calls it).
    "gpu_arena_torch_malloc": (c_void_p, [c_ssize_t, c_int, c_void_p]),
    "gpu_arena_alloc_error_message": (c_void_p, [c_ssize_t, c_int]),
    "gpu_arena_record_history": (c_int, [c_int, ctypes.c_size_t]),
    "gpu_arena_set_history_context": (ctypes.c_uint32, [ctypes.c_uint32]),
    "gpu_arena_observe_arenas": (c_int, [ARENA_FN, ARENA_FN, c_void_p,
                                         ctypes.POINTER(ctypes.c_uint64)]),
    "gpu_arena_unobserve_arenas": (c_int, [ctypes.c_uint64]),
    # Tags, sleep and wake (ffi/src/sleep_api.rs).
    "gpu_arena_set_tag": (c_int, [c_char_p]),
    "gpu_arena_sleep": (c_int, [c_int, c_char_p]),
    "gpu_arena_sleep_tags": (c_int, [c_int, c_char_p, c_char_p]),
    "gpu_arena_wake": (c_int, [c_int, c_char_p]),
    "gpu_arena_sleep_release_host": (c_int, [c_int]),
    "gpu_arena_sleep_prepare": (c_int, [c_int, c_char_p, ctypes.POINTER(ctypes.c_uint64)]),
    "gpu_arena_trim": (c_int, [c_int, ctypes.POINTER(ctypes.c_uint64)]),
    # What the native torch allocator maps torch's calls onto (ffi/src/torch_allocator_api.rs).
    **{f"gpu_arena_graph_pool_{n}": (c_int, [c_int, ctypes.c_uint64, ctypes.c_uint64])
       for n in ("retain", "release", "use_count", "begin", "end", "empty_cache")},
    "gpu_arena_graph_pool_malloc": (c_void_p, [c_int, ctypes.c_uint64, ctypes.c_uint64,
                                               ctypes.c_size_t, c_void_p]),
    "gpu_arena_graph_pool_blocks": (c_ssize_t, [c_int, ctypes.c_uint64, ctypes.c_uint64,
                                                ctypes.POINTER(GpuArenaPoolBlock),
                                                ctypes.c_size_t]),
    "gpu_arena_graph_pool_restore": (c_int, [c_int, ctypes.c_uint64, ctypes.c_uint64,
                                             ctypes.POINTER(GpuArenaPoolBlock), ctypes.c_size_t]),
    "gpu_arena_reset_peak_stats": (c_int, [c_int]),
    "gpu_arena_reset_accumulated_stats": (c_int, [c_int]),
    "gpu_arena_set_memory_fraction": (c_int, [c_int, ctypes.c_double]),
    "gpu_arena_segments": (c_ssize_t, [c_int, ctypes.POINTER(GpuArenaSegment), ctypes.c_size_t,
                                       ctypes.POINTER(GpuArenaSegmentBlock), ctypes.c_size_t,
                                       ctypes.POINTER(ctypes.c_size_t)]),
    "gpu_arena_free_unsized": (c_int, [c_void_p]),
    "gpu_arena_allocation_of": (c_int, [c_void_p, ctypes.POINTER(c_void_p),
                                        ctypes.POINTER(ctypes.c_size_t),
                                        ctypes.POINTER(c_int)]),
    # The transfer engine (ffi/src/transfer_api.rs; strings out are freed with string_free).
    **_xfer_signatures(),
}

# The IPC part (ffi/src/ipc_api.rs), declared when the library has it (has_ipc() says
# whether all are there).
_IPC_SIGNATURES = {
    "gpu_arena_share": (c_int, [c_void_p, ctypes.c_size_t, ctypes.POINTER(GpuArenaShare)]),
    "gpu_arena_unshare": (c_int, [ctypes.POINTER(GpuArenaShare)]),
    "gpu_arena_import": (c_int, [ctypes.POINTER(GpuArenaShare), ctypes.POINTER(c_void_p)]),
    "gpu_arena_close": (c_int, [c_void_p]),
    "gpu_arena_share_many": (
        c_int,
        [ctypes.POINTER(c_void_p), ctypes.POINTER(ctypes.c_size_t), ctypes.c_size_t, ctypes.POINTER(GpuArenaShare)],
    ),
    "gpu_arena_import_many": (c_int, [ctypes.POINTER(GpuArenaShare), ctypes.c_size_t, ctypes.POINTER(c_void_p)]),
    "gpu_arena_close_many": (c_int, [ctypes.POINTER(c_void_p), ctypes.c_size_t]),
    "gpu_arena_imports_live": (c_int, []),
    "gpu_arena_share_layout": (c_int, [ctypes.POINTER(GpuArenaShareField), ctypes.c_size_t]),
    "gpu_arena_share_fields": (c_int, [ctypes.POINTER(GpuArenaShare),
                                       ctypes.POINTER(GpuArenaShareFields)]),
    # ffi/src/dlpack_api.rs. The share and the view go as bytes (c_char_p: no copy).
    "gpu_arena_import_dlpack": (c_int, [c_char_p, c_char_p, ctypes.c_size_t,
                                        ctypes.POINTER(GpuArenaDlpack)]),
    "gpu_arena_close_dlpack": (c_int, [ctypes.c_uint64]),
    "gpu_arena_release_dlpack": (c_int, [c_void_p]),
    "gpu_arena_dlpack_imports": (c_int, [ctypes.POINTER(GpuArenaDlpackImport), ctypes.c_size_t]),
    "gpu_arena_dlpack_exiting": (None, []),
}

# Newer calls, declared when the library has them: a library older than the package (a
# GPU_ARENA_LIB left pointing at an earlier build) keeps every other call working, and the
# call that needs one of these names it in its error.
_NEWER_SIGNATURES = {
    "gpu_arena_import_dlpack_many": (c_int, [c_char_p, ctypes.c_size_t, c_char_p,
                                             ctypes.POINTER(ctypes.c_size_t),
                                             ctypes.POINTER(GpuArenaDlpack)]),
}

_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_path: Optional[Path] = None
_has_ipc = False


def _declare(lib: ctypes.CDLL, sigs: dict, required: bool) -> bool:
    ok = True
    for name, (restype, argtypes) in sigs.items():
        try:
            fn = getattr(lib, name)
        except AttributeError:
            if required:
                raise LibraryNotFoundError(
                    f"{_path} has no symbol {name}: it is not a (current) gpu-arena library; "
                    "rebuild it with `cargo build -p gpu-arena-ffi`"
                ) from None
            ok = False
            continue
        fn.restype = restype
        fn.argtypes = argtypes
    return ok


def lib() -> ctypes.CDLL:
    """The loaded library (loading it on first use)."""
    global _lib, _path, _has_ipc
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is None:
            path = find_library()
            try:
                handle = ctypes.CDLL(str(path))
            except OSError as e:
                raise LibraryNotFoundError(f"found {path} but could not load it: {e}") from e
            _path = path
            _declare(handle, _SIGNATURES, required=True)
            _has_ipc = _declare(handle, _IPC_SIGNATURES, required=False)
            _declare(handle, _NEWER_SIGNATURES, required=False)
            _lib = handle
    return _lib


def lib_path() -> str:
    """The path of the loaded library (loading it if needed)."""
    lib()
    return str(_path)


def has_ipc() -> bool:
    """Whether the loaded library exports the IPC functions."""
    lib()
    return _has_ipc


def last_error() -> str:
    """The calling thread's last error message ("" if none)."""
    msg = lib().gpu_arena_last_error()
    return msg.decode("utf-8", "replace") if msg else ""


def error(code: int, call: str = "") -> GpuArenaError:
    """The exception for a failed call that returned `code`."""
    msg = last_error()
    if not msg:
        msg = f"{call} failed" if call else "gpu-arena call failed"
    return GpuArenaError(code, msg)


def check(code: int, call: str = "") -> int:
    """Raise the matching GpuArenaError when `code` is negative; return it otherwise."""
    if code < 0:
        raise error(code, call)
    return code


def error_from_last(call: str) -> GpuArenaError:
    """The exception for a failed call that returns no code (NULL): the code is the
    thread's ``gpu_arena_last_error_code()``."""
    code = lib().gpu_arena_last_error_code()
    msg = last_error() or f"{call} failed"
    return GpuArenaError(code if code < 0 else GPU_ARENA_ERR_INTERNAL, msg)


def as_int(value, what: str) -> int:
    """``value`` as an int (anything with ``__index__``), or a TypeError naming ``what``."""
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an int, not {type(value).__name__}") from None


def fn_address(name: str) -> int:
    """The address of an exported C function, for PyTorch's hook setters."""
    addr = ctypes.cast(getattr(lib(), name), ctypes.c_void_p).value
    if not addr:
        raise LibraryNotFoundError(f"{name} has no address in {_path}")
    return int(addr)
