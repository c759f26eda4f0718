"""Arena observers: be told once when each arena of gpu-arena appears, and once before it
goes, e.g. to register each arena with a transport (UCX, NIXL) and deregister it before its
memory is freed::

    import gpu_arena

    def ready(arena):       # gpu_arena.ArenaInfo(device, flags, arena_id, base, size)
        register(arena.base, arena.size)

    def release(arena):     # the arena is still mapped here
        deregister(arena.base)

    with gpu_arena.observe_arenas(ready, release):
        ...                 # or: h = observe_arenas(...); ...; unobserve_arenas(h)

``ready`` runs for every arena that exists (before ``observe_arenas`` returns, on the calling
thread), then for each new arena before any memory of it is handed out (on the allocating
thread); ``release`` once per arena whose ``ready`` did not raise, while it is still mapped,
before it goes (``empty_cache``, the OOM retry) or when the observer is removed
(``unobserve_arenas`` calls it for every such arena, then nothing more). No gpu-arena lock is
held during a callback: it may call any gpu-arena function.

An exception in ``ready`` refuses the arena: it is logged (logger ``gpu_arena``), counted in
``stats()["observer_errors"]``, the arena stays usable and this observer gets no ``release``
for it. An exception in ``release`` is logged. The ctypes callbacks are kept alive until
``unobserve_arenas``.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Callable, Dict, NamedTuple, Optional, Union

from . import _lib

log = logging.getLogger("gpu_arena")

#: ``ArenaInfo.flags`` bit: the arena has a driver export at the time of the call.
ARENA_EXPORTED = _lib.GPU_ARENA_ARENA_EXPORTED
#: ``ArenaInfo.flags`` bit: the arena is pinned by an export that cannot end.
ARENA_PINNED = _lib.GPU_ARENA_ARENA_PINNED


class ArenaInfo(NamedTuple):
    """One arena (``gpu_arena_arena_info_t``)."""

    device: int
    flags: int
    arena_id: int
    base: int
    size: int

    @property
    def exported(self) -> bool:
        return bool(self.flags & ARENA_EXPORTED)

    @property
    def pinned(self) -> bool:
        return bool(self.flags & ARENA_PINNED)


Callback = Callable[[ArenaInfo], object]


class ArenaObserver:
    """A registered observer, from :func:`observe_arenas`. ``with`` removes it at the end
    of the block (unless it was removed already)."""

    def __init__(self, observer_id: int, keep: tuple):
        self._id = observer_id
        self._keep = keep  # the ctypes callbacks: alive while C may call them
        self.closed = False

    @property
    def id(self) -> int:
        """The C API's observer id."""
        return self._id

    def close(self) -> None:
        """:func:`unobserve_arenas` of this observer."""
        unobserve_arenas(self)

    def __enter__(self) -> "ArenaObserver":
        return self

    def __exit__(self, *exc) -> None:
        if not self.closed:
            self.close()

    def __repr__(self) -> str:
        return f"ArenaObserver(id={self._id}{', closed' if self.closed else ''})"


# id -> observer: the ctypes callbacks stay referenced until unobserve returns.
_live: Dict[int, ArenaObserver] = {}
_live_lock = threading.Lock()


def _wrap(fn: Optional[Callback], what: str):
    """``fn`` as a ``gpu_arena_arena_fn`` (None: NULL): exceptions are logged and returned
    as 1."""
    if fn is None:
        return _lib.ARENA_FN()  # a NULL function pointer
    if not callable(fn):
        raise TypeError(f"{what} must be callable or None, not {type(fn).__name__}")

    def call(info_ptr, _user):
        try:
            i = info_ptr.contents
            fn(ArenaInfo(int(i.device), int(i.flags), int(i.arena_id), int(i.base or 0),
                         int(i.size)))
            return 0
        except BaseException:  # noqa: BLE001  (nothing may unwind into C)
            log.exception("gpu_arena arena observer: %s raised", what)
            return 1

    return _lib.ARENA_FN(call)


def observe_arenas(on_ready: Optional[Callback] = None,
                   on_release: Optional[Callback] = None) -> ArenaObserver:
    """Add an arena observer (module docs: when each callback runs). Either callback may be
    None, not both (``InvalidArgumentError``). Returns its handle."""
    ready, release = _wrap(on_ready, "on_ready"), _wrap(on_release, "on_release")
    out = ctypes.c_uint64()
    _lib.check(
        _lib.lib().gpu_arena_observe_arenas(ready, release, None, ctypes.byref(out)),
        "gpu_arena_observe_arenas",
    )
    handle = ArenaObserver(int(out.value), (ready, release))
    with _live_lock:
        _live[handle.id] = handle
    return handle


def unobserve_arenas(handle: Union[ArenaObserver, int]) -> None:
    """Remove an observer: its ``on_release`` runs for every arena it took, then it is never
    called again. A second call for the same observer raises ``InvalidArgumentError`` and
    changes nothing."""
    observer_id = handle.id if isinstance(handle, ArenaObserver) else _lib.as_int(handle, "handle")
    _lib.check(_lib.lib().gpu_arena_unobserve_arenas(observer_id), "gpu_arena_unobserve_arenas")
    with _live_lock:
        done = _live.pop(observer_id, None)
    if done is not None:
        done.closed = True
