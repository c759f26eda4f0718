"""KV transfer with NIXL: every arena of gpu-arena registered once with a NIXL agent, and
deregistered before its memory goes.

NIXL (vLLM's NixlConnector, Dynamo, SGLang) moves KV caches between processes and nodes over
UCX. Registering tensor by tensor is slow and leaves registrations on memory that is then
freed; a registration that outlives an engine's shutdown keeps the memory (the ROCm IPC pin,
UCX's imported mappings). Here the registrations follow the arenas instead, through arena
observers (:func:`gpu_arena.observe_arenas`)::

    from nixl._api import nixl_agent            # PyPI: nixl-cu13 (CUDA 13) / nixl-cu12
    import gpu_arena.nixl

    agent = nixl_agent("producer")
    reg = gpu_arena.nixl.attach(agent)           # registers every arena, now and later
    kv = torch.empty(..., device="cuda")         # through gpu_arena.torch.install()
    descs = reg.xfer_descs(kv)                   # transfer descriptors (NIXL xfer dlist)
    ...
    reg.detach()                                 # deregisters every arena
    del kv; gpu_arena.torch.empty_cache()        # the memory goes back to the driver

- One registration per arena (an observed class of the default growing arenas makes arenas of
  doubling sizes up to 1 GiB: about a dozen for the first 2 GiB, then one per GiB; fixed arenas:
  one per ``arena_size``), none per tensor; ``registrations`` counts them. An arena that ``empty_cache``, a share's end, sleep
  or the OOM retry releases is deregistered first, while it is still mapped.
- Memory type: ``VRAM`` on the cuda and hip backends, ``DRAM`` on the sim backend (host
  memory: NIXL's UCX backend moves it between processes like any host buffer).
- A failed registration (NIXL raised) is logged, counted in ``stats()["observer_errors"]``
  and in :attr:`NixlRegistrar.failed`; that arena stays usable but unregistered, and
  descriptors of ranges in it are refused with a clear error.
- The callbacks run with no gpu-arena lock held (``observe_arenas``' rules), in the thread
  whose allocation created the arena; NIXL calls are serialised by the registrar's lock.

On the consumer side the peer's descriptors come from the peer (its addresses and devices);
:func:`remote_descs` builds NIXL's descriptor list from ``(addr, len, device)`` tuples.

UCX picks the transport. Between processes on one node, VRAM should move over ``cuda_ipc``;
``tests/gpu/gpu_nixl_kv.py`` checks which one it used (``UCX_PROTO_INFO=y``) instead of
assuming it, and docs/nixl.md says what each memory kind needs.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from . import observers as _observers
from .runtime import backend_name

log = logging.getLogger("gpu_arena.nixl")

Range = Tuple[int, int, int]  # (address, length, device)

# NIXL's Python API lives in `nixl` (the meta package) or directly in the CUDA-specific one.
_NIXL_MODULES = ("nixl._api", "nixl_cu13", "nixl_cu12")


def import_nixl():
    """NIXL's Python API module (``nixl._api``, else ``nixl_cu13``, else ``nixl_cu12``).
    Raises ``ImportError`` naming the packages to install when none is there."""
    errors = []
    for name in _NIXL_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as e:
            errors.append(f"{name}: {e}")
    raise ImportError(
        "gpu_arena.nixl needs NIXL's Python package: pip install nixl-cu13 (CUDA 13) or "
        "nixl-cu12 (CUDA 12) [" + "; ".join(errors) + "]"
    )


def default_mem_type() -> str:
    """``DRAM`` on the sim backend (its arenas are host memory), ``VRAM`` otherwise."""
    return "DRAM" if backend_name() == "sim" else "VRAM"


class NixlRegistrar:
    """Registers each arena of gpu-arena once with ``agent`` (a ``nixl_agent``). Use
    :func:`attach`; :meth:`detach` (or ``with``) deregisters everything."""

    def __init__(self, agent: Any, mem_type: Optional[str] = None,
                 backends: Sequence[str] = ()):
        self.agent = agent
        self.mem_type = mem_type or default_mem_type()
        self.backends = list(backends)
        self._lock = threading.Lock()
        # (device, base) -> (ArenaInfo, NIXL's registration descriptor list)
        self._registered: Dict[Tuple[int, int], Tuple[Any, Any]] = {}
        self._observer: Optional[_observers.ArenaObserver] = None
        #: Registrations made and ended, failures, and the seconds spent in NIXL's calls.
        self.registered_total = 0
        self.deregistered_total = 0
        self.failed = 0
        self.register_seconds = 0.0
        self.deregister_seconds = 0.0

    # -- the observer's callbacks ------------------------------------------------------
    def _on_ready(self, arena) -> None:
        with self._lock:
            t0 = time.perf_counter()
            try:
                reg = self.agent.register_memory(
                    [(arena.base, arena.size, arena.device, "")], self.mem_type,
                    backends=self.backends)
            except BaseException:
                self.failed += 1
                raise  # logged and counted by gpu_arena.observers
            self.register_seconds += time.perf_counter() - t0
            self._registered[(arena.device, arena.base)] = (arena, reg)
            self.registered_total += 1
        log.debug("registered arena %d (%#x, %d bytes) with NIXL as %s", arena.arena_id,
                  arena.base, arena.size, self.mem_type)

    def _on_release(self, arena) -> None:
        with self._lock:
            entry = self._registered.pop((arena.device, arena.base), None)
            if entry is None:  # its registration had failed
                return
            t0 = time.perf_counter()
            try:
                self.agent.deregister_memory(entry[1], backends=self.backends)
            finally:
                self.deregister_seconds += time.perf_counter() - t0
                self.deregistered_total += 1
        log.debug("deregistered arena %d from NIXL", arena.arena_id)

    # -- life --------------------------------------------------------------------------
    def attach(self) -> "NixlRegistrar":
        """Start: every existing arena is registered before this returns, every new one
        before memory from it is handed out. Attaching twice is an error."""
        if self._observer is not None:
            raise RuntimeError("this NixlRegistrar is already attached")
        self._observer = _observers.observe_arenas(self._on_ready, self._on_release)
        return self

    def detach(self) -> None:
        """Deregister every arena and stop (nothing more is registered). Idempotent."""
        observer, self._observer = self._observer, None
        if observer is not None:
            observer.close()

    @property
    def attached(self) -> bool:
        return self._observer is not None

    def __enter__(self) -> "NixlRegistrar":
        return self if self.attached else self.attach()

    def __exit__(self, *exc) -> None:
        self.detach()

    # -- what is registered --------------------------------------------------------------
    @property
    def registrations(self) -> int:
        """Live registrations (one per arena)."""
        with self._lock:
            return len(self._registered)

    def arenas(self) -> List[Any]:
        """The registered arenas (``gpu_arena.ArenaInfo``), by device and address."""
        with self._lock:
            return [info for _, (info, _) in sorted(self._registered.items())]

    def arena_of(self, addr: int, length: int = 1, device: Optional[int] = None):
        """The registered arena holding ``addr .. addr+length`` (on ``device`` if given);
        ``ValueError`` when no registered arena holds all of it."""
        with self._lock:
            for (dev, base), (info, _) in self._registered.items():
                if device is not None and dev != device:
                    continue
                if base <= addr and addr + length <= base + info.size:
                    return info
        raise ValueError(
            f"{addr:#x}+{length} is not inside an arena registered with NIXL (not gpu-arena "
            f"memory, freed, or its registration failed: see stats()['observer_errors'])")

    # -- descriptors ---------------------------------------------------------------------
    def ranges(self, items) -> List[Range]:
        """``(addr, len, device)`` of each item, checked to lie in a registered arena.
        Items: tensors (contiguous, from gpu-arena), ``(addr, len)`` or
        ``(addr, len, device)`` tuples, or one tensor."""
        if not isinstance(items, (list, tuple)) or (items and isinstance(items[0], int)):
            items = [items]
        out: List[Range] = []
        for item in items:
            if isinstance(item, tuple):
                addr, length = int(item[0]), int(item[1])
                device = int(item[2]) if len(item) > 2 else None
            else:  # a tensor
                if not item.is_contiguous():
                    raise ValueError("NIXL descriptors need contiguous tensors")
                addr, length = item.data_ptr(), item.numel() * item.element_size()
                device = item.device.index if item.device.type != "cpu" else None
            info = self.arena_of(addr, length, device)
            out.append((addr, length, info.device))
        return out

    def blocks(self, item, block_bytes: int) -> List[Range]:
        """A tensor (or one range) cut into ``block_bytes`` pieces (the last may be shorter):
        the KV-cache block descriptors of a layer."""
        if block_bytes <= 0:
            raise ValueError("block_bytes must be positive")
        [(addr, length, device)] = self.ranges(item)
        return [(a, min(block_bytes, addr + length - a), device)
                for a in range(addr, addr + length, block_bytes)]

    def xfer_descs(self, items):
        """NIXL's transfer descriptor list for ``items`` (see :meth:`ranges`)."""
        return self.agent.get_xfer_descs(self.ranges(items), self.mem_type)


def attach(agent: Any, mem_type: Optional[str] = None,
           backends: Sequence[str] = ()) -> NixlRegistrar:
    """Register every arena of gpu-arena with ``agent`` from now on (see the module docs)."""
    return NixlRegistrar(agent, mem_type, backends).attach()


def remote_descs(agent: Any, ranges: Iterable[Range], mem_type: str = "VRAM"):
    """NIXL's descriptor list for a peer's ``(addr, len, device)`` ranges (as the peer's
    :meth:`NixlRegistrar.ranges` or :meth:`NixlRegistrar.blocks` gave them)."""
    return agent.get_xfer_descs([tuple(int(v) for v in r) for r in ranges], mem_type)


def wait(agent: Any, handle: Any, timeout: float = 60.0) -> str:
    """Wait for a transfer started with ``agent.transfer(handle)``: its final state
    (``DONE``); ``TimeoutError`` past ``timeout`` seconds, ``RuntimeError`` on ``ERR``."""
    deadline = time.perf_counter() + timeout
    while True:
        state = agent.check_xfer_state(handle)
        if state == "DONE":
            return state
        if state == "ERR":
            raise RuntimeError("NIXL transfer failed (state ERR)")
        if time.perf_counter() > deadline:
            raise TimeoutError(f"NIXL transfer not done after {timeout} s (state {state})")


__all__ = ["NixlRegistrar", "attach", "remote_descs", "wait", "import_nixl",
           "default_mem_type"]
