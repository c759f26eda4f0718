"""The runtime calls of gpu-arena's C API: configuration and initialization, the pool's
counters and snapshot, ``empty_cache`` / ``trim``, tags with sleep and wake, and raw
``malloc`` / ``free`` / ``record_stream``. The package's face (``gpu_arena``) re-exports
every one of them; modules of the package import them from here."""

from __future__ import annotations

import ctypes
import json
import threading
from typing import Any, Dict, NamedTuple, Optional, Tuple

from . import _lib
from ._lib import GPU_ARENA_OK, GpuArenaStats
from ._lib import as_int as _int

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
    "sleep_release_host",
    "wake",
    "snapshot",
    "validate",
    "backend_name",
    "device_count",
    "malloc",
    "free",
    "record_stream",
]


def configure(conf: str) -> None:
    """Configure before first use, e.g. ``"backend=sim,arena_size=1GiB"``: comma-separated
    ``key=value`` pairs. The keys, their values, defaults and meaning: :func:`config_keys`
    (the library's table; docs/configuration.md is generated from it). Several calls
    accumulate. Once initialized (by :func:`init` or the first call that needs the pool):
    ``InvalidStateError``; an unknown key or a bad value: ``InvalidArgumentError`` naming
    the key, the value and the accepted forms."""
    if not isinstance(conf, str):
        raise TypeError(f"conf must be a str, not {type(conf).__name__}")
    if "\0" in conf:
        raise ValueError("conf must not contain NUL characters")
    _lib.check(_lib.lib().gpu_arena_configure(conf.encode("utf-8")), "gpu_arena_configure")


class ConfigKey(NamedTuple):
    """One configuration key, as the library serves it (Markdown text)."""

    name: str
    values: str
    default: str
    help: str


_config_keys: Optional[Tuple[ConfigKey, ...]] = None


def config_keys() -> Tuple[ConfigKey, ...]:
    """Every key :func:`configure` (and ``GPU_ARENA_CONF``) takes, with its values, default
    and meaning: the library's table (``gpu_arena_config_keys``; Rust's ``KEY_TABLE``, from
    which docs/configuration.md is generated). Loads the library, does not initialize it."""
    global _config_keys
    if _config_keys is None:
        fn = _lib.lib().gpu_arena_config_keys
        n = _lib.check(fn(None, 0), "gpu_arena_config_keys")
        out = (_lib.GpuArenaConfigKey * n)()
        _lib.check(fn(out, n), "gpu_arena_config_keys")
        _config_keys = tuple(ConfigKey(k.name.decode(), k.values.decode(),
                                       k.default_value.decode(), k.help.decode()) for k in out)
    return _config_keys


def init(device_count: int = -1) -> None:
    """Initialize gpu-arena (idempotent): ``gpu_arena_init`` then ``gpu_arena_init_status``.

    ``device_count`` is the caller's device count, checked against the backend's (-1: do not
    check). Raises the error of a failed init (e.g. ``UnavailableError`` for a backend that
    is not there, ``InvalidArgumentError`` for a bad ``GPU_ARENA_CONF``)."""
    lib = _lib.lib()
    lib.gpu_arena_init(_int(device_count, "device_count"))
    code = lib.gpu_arena_init_status()
    if code < 0:
        # The failed init's own code (e.g. UNAVAILABLE), not NOT_INITIALIZED.
        raise _lib.error(code, "gpu_arena_init")


def is_initialized() -> bool:
    """Whether gpu-arena is initialized and usable (never raises, never initializes)."""
    return _lib.lib().gpu_arena_init_status() == GPU_ARENA_OK


def set_log_level(level: str) -> None:
    """Set the level of gpu-arena's stderr log: ``"off"``, ``"error"``, ``"warn"``,
    ``"info"``, ``"debug"`` or ``"trace"`` (``GPU_ARENA_LOG`` sets the first one)."""
    if not isinstance(level, str):
        raise TypeError(f"level must be a str, not {type(level).__name__}")
    if "\0" in level:
        raise ValueError("level must not contain NUL characters")
    _lib.check(
        _lib.lib().gpu_arena_set_log_level(level.encode("utf-8", "replace")),
        "gpu_arena_set_log_level",
    )


def stats(device: int = 0) -> Dict[str, int]:
    """The counters of ``device``'s pool (``gpu_arena_stats_t``) as a dict of ints
    (``allocated_bytes``: the rounded sizes served; ``requested_bytes``: what callers asked
    for). Initializes gpu-arena if needed."""
    out = GpuArenaStats()
    _lib.check(
        _lib.lib().gpu_arena_stats(_int(device, "device"), ctypes.byref(out)), "gpu_arena_stats"
    )
    return out.to_dict()


def empty_cache(device: int = -1) -> None:
    """Synchronize and release every arena of ``device`` (-1: all) that holds no live
    allocation and no share."""
    _lib.check(_lib.lib().gpu_arena_empty_cache(_int(device, "device")), "gpu_arena_empty_cache")


def trim(device: int = -1) -> int:
    """``empty_cache``, then cut every arena of ``device`` (-1: all) that still holds live
    allocations down to the 2 MiB pages they use (same addresses and contents; the rest goes
    back to the driver). Returns the bytes given back. Call it at an idle point, as
    ``sleep``: nothing may use gpu-arena memory on the device until it returns (it
    synchronizes first; the cut arenas' addresses are briefly unmapped)."""
    out = ctypes.c_uint64(0)
    _lib.check(_lib.lib().gpu_arena_trim(_int(device, "device"), ctypes.byref(out)), "gpu_arena_trim")
    return out.value


_tag_state = threading.local()


def _tag_list(tags, what: str) -> Optional[bytes]:
    """A comma-separated tag list as bytes: None, a string, or an iterable of strings."""
    if tags is None:
        return None
    if isinstance(tags, str):
        return tags.encode()
    if isinstance(tags, bytes):
        return tags
    try:
        names = list(tags)
    except TypeError:
        raise TypeError(f"{what} must be a string or a list of strings") from None
    for n in names:
        if not isinstance(n, str):
            raise TypeError(f"{what} must be a string or a list of strings, not {n!r}")
    return ",".join(names).encode()


def set_tag(tag: Optional[str] = None) -> None:
    """Set this thread's allocation tag ("default" for None or ""): every later allocation
    of this thread carries it; allocations of different tags never share an arena, so a tag
    sleeps and wakes on its own. At most 63 bytes of ``[A-Za-z0-9_.-]``."""
    if tag is not None and not isinstance(tag, str):
        raise TypeError(f"tag must be a string or None, not {type(tag).__name__}")
    _lib.check(
        _lib.lib().gpu_arena_set_tag(tag.encode() if tag else None), "gpu_arena_set_tag"
    )
    _tag_state.tag = tag or "default"


def current_tag() -> str:
    """This thread's allocation tag, as last set through :func:`set_tag`."""
    return getattr(_tag_state, "tag", "default")


def sleep(offload_tags=None, device: int = -1, tags=None) -> None:
    """Put the tags in ``tags`` (a comma-separated string or a list; None: every awake tag)
    of ``device`` (-1: all) to sleep, the other tags staying awake: the contents of
    ``offload_tags`` (each one of ``tags``) are copied to host memory, the rest is
    discarded, and the memory goes back to the driver while every address stays reserved.
    Arenas shared with other processes keep their memory. Raises InvalidStateError when a
    named tag, or every tag, already sleeps, InvalidArgumentError for an offload tag that is
    not put to sleep (nothing changes)."""
    offload = _tag_list(offload_tags, "offload_tags")
    if tags is None:
        _lib.check(_lib.lib().gpu_arena_sleep(_int(device, "device"), offload), "gpu_arena_sleep")
        return
    _lib.check(
        _lib.lib().gpu_arena_sleep_tags(_int(device, "device"), _tag_list(tags, "tags"), offload),
        "gpu_arena_sleep_tags",
    )


def sleep_release_host(device: int = -1) -> None:
    """Free the host buffers kept for the next sleep on ``device`` (-1: all). A wake keeps
    the pinned buffer of each offloaded arena so that the next sleep need not pin again
    (``stats()["offload_host_bytes"]`` counts them); buffers of sleeping arenas stay."""
    _lib.check(
        _lib.lib().gpu_arena_sleep_release_host(_int(device, "device")),
        "gpu_arena_sleep_release_host",
    )


def sleep_prepare(offload_tags, device: int = -1) -> int:
    """Pin ahead: make now the host buffers a sleep offloading ``offload_tags`` (a
    comma-separated string or a list, at least one) of ``device`` (-1: all) would need, so
    the first such sleep copies at copy speed instead of pinning fresh host memory. Sized
    from the live allocations now. Returns the bytes of host memory made (0 when kept
    buffers suffice). Blocking; ctypes releases the GIL, so a thread can run it while the
    engine works. ``sleep_release_host()`` frees them."""
    made = ctypes.c_uint64(0)
    _lib.check(
        _lib.lib().gpu_arena_sleep_prepare(_int(device, "device"),
                                           _tag_list(offload_tags, "offload_tags"),
                                           ctypes.byref(made)),
        "gpu_arena_sleep_prepare",
    )
    return made.value


def wake(tags=None, device: int = -1) -> None:
    """Wake ``tags`` (None: every sleeping tag) on ``device`` (-1: all): memory mapped again
    at the same addresses, offloaded contents copied back. Raises InvalidStateError for a
    tag that is awake or a CUDA graph capture open on the device, OutOfMemoryError when the device has no room or the wake would pass
    ``max_reserved`` (what the wake had already woken goes back to sleep): either way nothing
    changes."""
    _lib.check(
        _lib.lib().gpu_arena_wake(_int(device, "device"), _tag_list(tags, "tags")),
        "gpu_arena_wake",
    )


def snapshot() -> Dict[str, Any]:
    """A snapshot of every device, arena and range (parsed ``gpu_arena_snapshot_json``)."""
    lib = _lib.lib()
    ptr = lib.gpu_arena_snapshot_json()
    if not ptr:
        raise _lib.error_from_last("gpu_arena_snapshot_json")
    try:
        text = ctypes.string_at(ptr).decode("utf-8")
    finally:
        lib.gpu_arena_string_free(ptr)
    return json.loads(text)


def validate(device: int = 0) -> None:
    """Check every invariant of ``device``'s pool; raises (``InternalError``) on the first
    violation."""
    _lib.check(_lib.lib().gpu_arena_validate(_int(device, "device")), "gpu_arena_validate")


def backend_name() -> str:
    """``"sim"``, ``"cuda"``, ``"hip"``, or ``""`` before init."""
    name = _lib.lib().gpu_arena_backend_name()
    return name.decode("ascii", "replace") if name else ""


def device_count() -> int:
    """Number of devices of the backend (initializes gpu-arena if needed)."""
    return _lib.check(_lib.lib().gpu_arena_device_count(), "gpu_arena_device_count")


def malloc(size: int, device: int = 0, stream: int = 0) -> int:
    """Allocate ``size`` bytes on ``device`` for use on ``stream`` (a ``cudaStream_t`` as an
    int; 0 is the default stream). Returns the device pointer as an int; ``size == 0``
    returns 0. Free it with :func:`free` and the same size and device."""
    size = _int(size, "size")
    device = _int(device, "device")
    stream = _int(stream, "stream")
    ptr = _lib.lib().gpu_arena_malloc(size, device, stream or None)
    if ptr:
        return int(ptr)
    if size == 0:
        return 0
    raise _lib.error_from_last("gpu_arena_malloc")


def free(ptr: int, size: int, device: int = 0) -> None:
    """Free a pointer from :func:`malloc`; ``size`` and ``device`` must be the allocation's.
    A double free, an unknown pointer or a wrong size raises and changes nothing. Freeing 0
    does nothing."""
    ptr = _int(ptr, "ptr")
    _lib.check(
        _lib.lib().gpu_arena_free_checked(ptr or None, _int(size, "size"), _int(device, "device")),
        "gpu_arena_free",
    )


def record_stream(ptr: int, stream: int) -> None:
    """Mark the live allocation ``ptr`` as used on ``stream`` too: after its free, its
    memory is reused only once the work queued on ``stream`` has completed."""
    _lib.check(
        _lib.lib().gpu_arena_record_stream_checked(
            _int(ptr, "ptr") or None, _int(stream, "stream") or None
        ),
        "gpu_arena_record_stream",
    )
