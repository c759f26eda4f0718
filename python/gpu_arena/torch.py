"""gpu-arena as PyTorch's CUDA allocator.

Two ways in:

* :func:`install` makes gpu-arena the allocator of every CUDA tensor of the process. It must
  run before PyTorch initializes CUDA, i.e. before the first CUDA tensor::

      import gpu_arena.torch
      gpu_arena.torch.install("arena_size=1GiB")
      x = torch.empty(1 << 20, device="cuda")      # served by gpu-arena

  By default (``route="native"``, or ``"auto"``) gpu-arena becomes PyTorch's own allocator:
  a C++ subclass of torch's ``CUDAAllocator`` (``gpu_arena/native/allocator.cpp``, built at
  the first install against the installed torch and cached: ``gpu_arena/torch_native.py``).
  CUDA graphs and their private pools, ``torch.compile(mode="reduce-overhead")``,
  ``torch.cuda.memory_stats`` / ``memory._snapshot`` / ``reset_peak_memory_stats`` /
  ``set_per_process_memory_fraction``, ``empty_cache``, ``record_stream`` and CUDA tensors
  through ``torch.multiprocessing`` then work as with PyTorch's caching allocator.
  ``route="pluggable"`` uses ``torch.cuda.memory.CUDAPluggableAllocator`` +
  ``change_current_allocator`` instead (torch refuses its memory APIs and CUDA IPC there,
  and does not keep a CUDA graph's pool apart); ``"auto"`` falls back to it, with a
  warning, only when the native allocator cannot be built.

* :func:`mem_pool` returns a ``torch.cuda.MemPool`` backed by gpu-arena, for
  ``torch.cuda.use_mem_pool`` (vLLM's way in); it works after CUDA is initialized::

      pool = gpu_arena.torch.mem_pool()
      with torch.cuda.use_mem_pool(pool):
          kv = torch.empty(..., device="cuda")     # served by gpu-arena

On the pluggable route the hooks ``set_init_fn`` (``gpu_arena_init``), ``set_reset_fn``
(``gpu_arena_reset``, run by ``torch.cuda.empty_cache()``) and ``set_record_stream_fn``
(``gpu_arena_record_stream``) are wired, and PyTorch's own ``memory_stats``,
``memory_snapshot`` and CUDA IPC raise: this module's PyTorch-shaped :func:`memory_stats`,
:func:`memory_summary`, :func:`memory_allocated`, :func:`memory_reserved`,
:func:`max_memory_allocated`, :func:`record_memory_history`, :func:`annotate`,
:func:`memory_snapshot` and :func:`dump_snapshot` (``gpu_arena/torch_stats.py``,
``gpu_arena/torch_snapshot.py``) work on both routes.

**Out of memory.** The native route raises ``torch.OutOfMemoryError`` with PyTorch's first
line and gpu-arena's cause. PyTorch's pluggable allocator does not check for NULL, so the
pluggable route uses two allocation functions (two ``CUDAPluggableAllocator`` objects):

* :func:`install` hands PyTorch a function that *throws* when gpu-arena has no memory (after
  gpu-arena released its cached arenas and retried once). ``oom="auto"`` (default): a shim
  compiled against the installed torch (``gpu_arena/torch_oom.py``; cached) raising
  ``torch.OutOfMemoryError``, else ``gpu_arena_torch_malloc`` from ``libgpu_arena.so``
  raising ``RuntimeError``; ``oom="torch"``: the first or an error; ``oom="runtime"``: the
  second. Both messages start with "CUDA out of memory." and name the size, the device,
  gpu-arena's reserved/allocated bytes and the cause.
* :func:`mem_pool` gives PyTorch the plain ``gpu_arena_malloc``, which returns NULL: PyTorch's
  caching allocator then raises ``torch.OutOfMemoryError`` itself and counts ``num_ooms``
  (and a pool made with ``use_on_oom=True`` serves other allocations that ran out).

PyTorch is imported lazily: this module imports without it. Targets torch 2.11 (the native
allocator builds for 2.8 to 2.15); older versions get a clear error for what they lack
(CUDAPluggableAllocator needs >= 2.0, MemPool with an allocator >= 2.6).
"""

from __future__ import annotations

import contextlib
import subprocess
import threading
import warnings
from typing import Any, Optional

from . import _lib
from .torch_snapshot import (  # noqa: F401  (re-exported)
    annotate,
    dump_snapshot,
    memory_snapshot,
    record_memory_history,
)
from .torch_stats import (  # noqa: F401  (re-exported)
    max_memory_allocated,
    max_memory_reserved,
    memory_allocated,
    memory_reserved,
    memory_stats,
    memory_summary,
)

__all__ = [
    "install",
    "installed",
    "oom_route",
    "route_in_use",
    "mem_pool",
    "empty_cache",
    "trim",
    "use_tag",
    "sleep",
    "wake",
    "CuMemAllocatorCompat",
    "memory_stats",
    "memory_summary",
    "memory_allocated",
    "memory_reserved",
    "max_memory_allocated",
    "max_memory_reserved",
    "record_memory_history",
    "annotate",
    "memory_snapshot",
    "dump_snapshot",
    "TorchIntegrationError",
    "AlreadyInitializedError",
]


class TorchIntegrationError(RuntimeError):
    """gpu-arena cannot be plugged into this PyTorch (missing feature, no CUDA, wrong
    backend)."""


class AlreadyInitializedError(TorchIntegrationError):
    """``install()`` came after PyTorch initialized CUDA (and its own allocator)."""


_lock = threading.RLock()
# CUDAPluggableAllocators (one each per process): MemPool's over the plain gpu_arena_malloc
# (NULL on OOM), install()'s over a throwing allocation function.
_pluggable: Any = None
_pluggable_global: Any = None
_installed = False
_oom_route: Optional[str] = None  # "torch" | "runtime" once installed
_route: Optional[str] = None  # "native" | "pluggable" once installed

OOM_ROUTES = ("auto", "torch", "runtime")
ROUTES = ("auto", "native", "pluggable")

_HOOKS = (
    ("set_init_fn", "gpu_arena_init"),
    ("set_reset_fn", "gpu_arena_reset"),
    ("set_record_stream_fn", "gpu_arena_record_stream"),
)


def _import_torch():
    try:
        import torch
    except ImportError as e:
        raise ImportError(
            "gpu_arena.torch needs PyTorch (`pip install torch`); the rest of gpu_arena "
            "(gpu_arena.malloc/free/stats...) works without it"
        ) from e
    memory = getattr(getattr(torch, "cuda", None), "memory", None)
    if memory is None or not hasattr(memory, "CUDAPluggableAllocator"):
        raise TorchIntegrationError(
            f"torch {torch.__version__} has no torch.cuda.memory.CUDAPluggableAllocator "
            "(PyTorch >= 2.0 with CUDA is needed; 2.11 is the target)"
        )
    return torch


def _api():
    import gpu_arena

    return gpu_arena


def _already_initialized_message(torch) -> str:
    try:
        reserved = torch.cuda.memory_reserved()
        detail = f" (its caching allocator has {reserved} bytes reserved)"
    except Exception:  # noqa: BLE001 - only for the message
        detail = ""
    return (
        "gpu_arena.torch.install(): PyTorch has already initialized CUDA in this process"
        f"{detail}, and its allocator cannot be swapped any more: call install() before the "
        "first CUDA allocation (before any tensor on 'cuda', torch.cuda.init(), "
        "torch.cuda.mem_get_info(), torch.cuda.set_device()...). After that point, "
        "gpu_arena.torch.mem_pool() with torch.cuda.use_mem_pool() can still route chosen "
        "allocations to gpu-arena."
    )


def _init_backend(allow_sim: bool, device_count: int = -1) -> None:
    api = _api()
    api.init(device_count)
    name = api.backend_name()
    if name == "sim" and not allow_sim:
        raise TorchIntegrationError(
            "gpu-arena initialized its 'sim' backend (host memory posing as a device: "
            "backend=sim / GPU_ARENA_BACKEND=sim was set, or backend=auto found no usable CUDA "
            "driver; see the log). PyTorch would crash using that memory, so it is not "
            "installed. Configure backend=cuda (or hip) to see why the device is unavailable."
        )


def _get_pluggable(torch):
    """The process's CUDAPluggableAllocator over the plain gpu_arena_malloc (NULL on OOM:
    for MemPool, whose caching allocator raises torch.OutOfMemoryError), hooks wired."""
    global _pluggable
    if _pluggable is None:
        _pluggable = _make_pluggable(torch, _lib.lib_path(), "gpu_arena_malloc", "gpu_arena_free")
    return _pluggable


def _global_allocator(torch, oom: str):
    """install()'s CUDAPluggableAllocator: an allocation function that throws on OOM (see
    the module docs), and which route it is."""
    from . import torch_oom

    if oom not in OOM_ROUTES:
        raise ValueError(f"oom={oom!r}: expected one of {', '.join(OOM_ROUTES)}")
    if oom in ("auto", "torch"):
        try:
            path = torch_oom.build(torch)
            torch_oom.bind(path)
            return _make_pluggable(torch, str(path), torch_oom.MALLOC, torch_oom.FREE), "torch"
        except (torch_oom.ShimBuildError, OSError, subprocess.SubprocessError) as e:
            if oom == "torch":
                raise TorchIntegrationError(
                    f"gpu_arena.torch.install(oom='torch'): cannot build the "
                    f"torch.OutOfMemoryError shim: {e}"
                ) from e
            torch_oom.log.warning(
                "gpu_arena.torch.install(): no torch.OutOfMemoryError shim (%s); an "
                "out-of-memory allocation raises RuntimeError('CUDA out of memory. ...') instead",
                e,
            )
    alloc = _make_pluggable(torch, _lib.lib_path(), "gpu_arena_torch_malloc", "gpu_arena_free")
    return alloc, "runtime"


def _make_pluggable(torch, path: str, malloc_name: str, free_name: str):
    """A CUDAPluggableAllocator over ``path``'s two functions, gpu-arena's hooks wired."""
    alloc = torch.cuda.memory.CUDAPluggableAllocator(path, malloc_name, free_name)
    native = alloc.allocator() if hasattr(alloc, "allocator") else alloc._allocator
    missing = []
    for setter, fn_name in _HOOKS:
        set_fn = getattr(native, setter, None)
        if set_fn is None:
            missing.append(setter)
            continue
        set_fn(_lib.fn_address(fn_name))
    if missing:
        warnings.warn(
            f"torch {torch.__version__}: the pluggable allocator has no {', '.join(missing)}; "
            "gpu-arena runs without those hooks (without set_record_stream_fn, "
            "Tensor.record_stream() does nothing and a tensor used on a side stream may be "
            "reused too early; without set_reset_fn, call gpu_arena.empty_cache() yourself)",
            RuntimeWarning,
            stacklevel=4,
        )
    return alloc


def install(
    conf: Optional[str] = None,
    *,
    allow_sim: bool = False,
    oom: str = "auto",
    route: str = "auto",
):
    """Make gpu-arena PyTorch's CUDA allocator for this process.

    ``route`` picks how gpu-arena reaches PyTorch:

    * ``"native"``: gpu-arena's own subclass of PyTorch's ``CUDAAllocator``
      (``gpu_arena/native/allocator.cpp``, built against the installed torch at the first
      install and cached, ``gpu_arena/torch_native.py``). Every ``torch.cuda`` memory API
      works as with PyTorch's own allocator: CUDA graphs and their private pools (a graph's
      memory is never handed to a tensor allocated after its capture),
      ``torch.compile(mode="reduce-overhead")``, ``memory_stats`` / ``memory_snapshot`` /
      ``reset_peak_memory_stats``, ``empty_cache``, ``record_stream``, CUDA tensors through
      ``torch.multiprocessing`` (over gpu-arena's own share handles). ``TorchIntegrationError``
      when it cannot be built or installed.
    * ``"pluggable"``: ``torch.cuda.memory.CUDAPluggableAllocator`` (the route of earlier
      releases). PyTorch refuses its memory APIs, ``torch.multiprocessing`` of CUDA tensors
      and ``reduce-overhead``, and a CUDA graph's pool is not kept apart: use it only where
      the native route cannot be built and no CUDA graph is captured.
    * ``"auto"`` (default): native; when it cannot be built (no C++ compiler, no torch or
      CUDA headers, a torch older than 2.8), pluggable, with a warning naming what is lost.

    :func:`route_in_use` says which one is installed.

    ``oom`` picks what an allocation gpu-arena cannot serve raises (module docs):
    ``"auto"`` (``torch.OutOfMemoryError`` when the shim can be built, else
    ``RuntimeError``), ``"torch"`` (``torch.OutOfMemoryError`` or ``TorchIntegrationError``
    here), ``"runtime"`` (``RuntimeError``). :func:`oom_route` says which one is in use.

    ``conf`` (optional) is passed to ``gpu_arena.configure`` first, e.g.
    ``"arena_size=1GiB,max_reserved=60GiB"``. gpu-arena is initialized at once so that a
    bad configuration or a missing driver raises here, not at the first tensor. Calling it
    again returns the same allocator (a ``conf`` then raises ``InvalidStateError``).

    Raises ``AlreadyInitializedError`` when PyTorch already initialized CUDA (call install()
    before the first CUDA allocation), ``TorchIntegrationError`` when CUDA is not available
    or gpu-arena fell back to its sim backend (``allow_sim=True`` skips that check: only for
    tests that never touch the memory).

    Returns the ``torch.cuda.memory.CUDAPluggableAllocator`` of the pluggable route, or
    ``None`` on the native route (``torch.cuda.memory._get_current_allocator()`` is then
    torch's handle on it).
    """
    global _installed, _pluggable_global, _oom_route, _route
    torch = _import_torch()
    api = _api()
    if route not in ROUTES:
        raise ValueError(f"route={route!r}: expected one of {', '.join(ROUTES)}")
    with _lock:
        if _installed:
            if conf is not None:
                api.configure(conf)  # raises InvalidStateError: gpu-arena is initialized
            return _pluggable_global
        if not torch.cuda.is_available():
            raise TorchIntegrationError(
                "gpu_arena.torch.install(): torch.cuda.is_available() is False (no CUDA "
                f"device, or a CPU-only torch {torch.__version__})"
            )
        if torch.cuda.is_initialized():
            raise AlreadyInitializedError(_already_initialized_message(torch))
        if conf is not None:
            api.configure(conf)
        # torch.cuda.device_count() does not initialize CUDA in PyTorch.
        _init_backend(allow_sim, torch.cuda.device_count())
        if route in ("auto", "native") and _install_native(torch, route):
            _pluggable_global, _oom_route, _route, _installed = None, "torch", "native", True
            return None
        alloc, oom_route_used = _global_allocator(torch, oom)
        try:
            torch.cuda.memory.change_current_allocator(alloc)
        except RuntimeError as e:
            if "initialized" in str(e).lower():
                raise AlreadyInitializedError(_already_initialized_message(torch)) from e
            raise
        _pluggable_global, _oom_route, _route, _installed = alloc, oom_route_used, "pluggable", True
        return alloc


def _install_native(torch, route: str) -> bool:
    """Install the native allocator; on ``route="auto"``, False (and a warning naming what
    the pluggable route loses) when it cannot be built, else raise."""
    from . import torch_native

    try:
        torch_native.install_native(_lib.lib_path())
        # CUDA tensors through torch.multiprocessing as gpu-arena shares (torch_ipc.py).
        from . import torch_ipc

        torch_ipc.register(torch, torch_native.installed_object())
        return True
    except torch_native.NativeBuildError as e:
        if route == "native":
            raise TorchIntegrationError(
                f"gpu_arena.torch.install(route='native'): the native allocator cannot be "
                f"built: {e}"
            ) from e
        warnings.warn(
            "gpu_arena.torch.install(): gpu-arena's native torch allocator cannot be built "
            f"({e}); falling back to torch's CUDAPluggableAllocator, which loses: CUDA graph "
            "pools (a graph's memory may be reused by tensors allocated after its capture), "
            "torch.compile(mode='reduce-overhead'), torch.cuda.memory_stats / "
            "memory_snapshot, and CUDA tensors through torch.multiprocessing",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    except torch_native.NativeInstallError as e:
        if "initialized" in str(e).lower():
            raise AlreadyInitializedError(_already_initialized_message(torch)) from e
        raise TorchIntegrationError(str(e)) from e


def route_in_use() -> Optional[str]:
    """How :func:`install` reached PyTorch: ``"native"`` (gpu-arena's own ``CUDAAllocator``),
    ``"pluggable"`` (``CUDAPluggableAllocator``), or ``None`` before install()."""
    return _route


def oom_route() -> Optional[str]:
    """What an out-of-memory allocation raises under :func:`install`: ``"torch"``
    (``torch.OutOfMemoryError``), ``"runtime"`` (``RuntimeError``), or ``None`` before
    install()."""
    return _oom_route


def installed() -> bool:
    """Whether :func:`install` succeeded in this process."""
    return _installed


def mem_pool(*, allow_sim: bool = False, **kwargs):
    """A ``torch.cuda.MemPool`` whose memory comes from gpu-arena, for
    ``torch.cuda.use_mem_pool(pool)``. ``kwargs`` go to ``MemPool`` (``use_on_oom``,
    ``no_split`` in recent PyTorch). Initializes gpu-arena if needed (configure first if
    you want a non-default configuration).

    Out of memory: gpu-arena returns NULL (after releasing its cached arenas and retrying)
    and PyTorch raises ``torch.OutOfMemoryError`` and counts it in ``num_ooms``. Inside
    ``use_mem_pool`` PyTorch does not free its own cached blocks and retry.

    PyTorch's caching allocator manages the pool's blocks and asks gpu-arena for segments:
    to give memory back, drop the tensors and the pool, then call :func:`empty_cache`
    (``torch.cuda.empty_cache()`` alone does not reach gpu-arena for a MemPool).
    """
    torch = _import_torch()
    MemPool = getattr(torch.cuda, "MemPool", None) or getattr(torch.cuda.memory, "MemPool", None)
    if MemPool is None or not hasattr(torch.cuda, "use_mem_pool"):
        raise TorchIntegrationError(
            f"torch {torch.__version__} has no torch.cuda.MemPool / torch.cuda.use_mem_pool "
            "(PyTorch >= 2.6 is needed for a MemPool over a pluggable allocator; 2.11 is the "
            "target); use gpu_arena.torch.install() instead"
        )
    if not torch.cuda.is_available():
        raise TorchIntegrationError(
            "gpu_arena.torch.mem_pool(): torch.cuda.is_available() is False"
        )
    if _route == "native":
        # gpu-arena is torch's allocator: a plain MemPool is one of its graph pools.
        return MemPool(**kwargs)
    with _lock:
        dc = torch.cuda.device_count()
        _init_backend(allow_sim, dc)
        alloc = _get_pluggable(torch)
    native = alloc.allocator() if hasattr(alloc, "allocator") else alloc._allocator
    try:
        return MemPool(native, **kwargs)
    except TypeError as e:
        raise TorchIntegrationError(
            f"torch {torch.__version__}: torch.cuda.MemPool({', '.join(kwargs)}) failed: {e}"
        ) from e


def empty_cache() -> None:
    """``torch.cuda.empty_cache()`` (which hands PyTorch's unused MemPool segments back to
    gpu-arena) then ``gpu_arena.empty_cache()`` (which hands gpu-arena's empty arenas back
    to the driver)."""
    _torch_empty_cache()
    api = _api()
    if api.is_initialized():
        api.empty_cache(-1)


def _torch_empty_cache() -> None:
    """PyTorch's side of ``empty_cache``: its unused MemPool segments back to gpu-arena."""
    torch = _import_torch()
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def trim() -> int:
    """``empty_cache()`` then ``gpu_arena.trim()``: arenas that still hold live tensors are
    cut down to the 2 MiB pages those tensors use. Call it at an idle point (as ``sleep``):
    it synchronizes, and no other thread may run work on gpu-arena memory until it returns.
    Returns the bytes gpu-arena gave back to the driver (``gpu_arena.trim`` runs gpu-arena's
    own empty_cache first)."""
    _torch_empty_cache()
    api = _api()
    return api.trim(-1) if api.is_initialized() else 0


@contextlib.contextmanager
def use_tag(tag: Optional[str]):
    """Allocations of this thread inside the block carry ``tag`` (``gpu_arena.set_tag``);
    the previous tag is restored on exit, also on an exception. Under :func:`install` every
    tensor allocated in the block is tagged: ``with use_tag("kv_cache"): kv = torch.empty(...)``."""
    api = _api()
    previous = api.current_tag()
    api.set_tag(tag)
    try:
        yield
    finally:
        api.set_tag(previous)


def sleep(offload_tags=None, device: int = -1, tags=None) -> None:
    """Synchronize, then ``gpu_arena.sleep``: the tags in ``tags`` (None: every awake tag)
    sleep, the others stay awake; ``offload_tags`` keep their contents on the host; the
    memory goes back to the driver, addresses stay."""
    try:
        import torch
    except ImportError:  # gpu-arena alone (sim): nothing of torch's to wait for
        torch = None
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    _api().sleep(offload_tags, device, tags)


def wake(tags=None, device: int = -1) -> None:
    """``gpu_arena.wake``: ``tags`` (None: all sleeping) mapped again at the same addresses,
    offloaded contents copied back."""
    _api().wake(tags, device)


class CuMemAllocatorCompat:
    """The shape of vLLM's ``CuMemAllocator`` (``vllm/device_allocator/cumem.py``) over
    gpu-arena, for an engine running under :func:`install`: ``use_memory_pool(tag=...)``
    tags the allocations made in the block, ``sleep(offload_tags=...)`` offloads those tags
    and discards the rest, ``wake_up(tags=None)`` maps everything (or the named tags) again
    at the same addresses, so captured CUDA graphs stay valid.

    As in vLLM, the default tag is ``"default"`` and ``sleep()`` with no argument offloads
    it. Unlike vLLM, no allocation is recorded in Python: gpu-arena tracks tags itself.
    """

    default_tag = "default"
    _instance: Optional["CuMemAllocatorCompat"] = None

    @staticmethod
    def get_instance() -> "CuMemAllocatorCompat":
        if CuMemAllocatorCompat._instance is None:
            CuMemAllocatorCompat._instance = CuMemAllocatorCompat()
        return CuMemAllocatorCompat._instance

    @contextlib.contextmanager
    def use_memory_pool(self, tag: Optional[str] = None):
        with use_tag(tag or self.default_tag):
            yield

    def sleep(self, offload_tags=None, tags=None) -> None:
        """vLLM's ``sleep(offload_tags)``; ``tags`` (an addition: None, as in vLLM, for
        every tag) sleeps only those tags, the others stay awake. With ``tags`` given and
        ``offload_tags`` None, nothing is offloaded unless the default tag is among them."""
        if isinstance(tags, str):
            tags = (tags,)
        if offload_tags is None:
            offload_tags = (self.default_tag,)
            if tags is not None and self.default_tag not in tags:
                offload_tags = ()
        elif isinstance(offload_tags, str):
            offload_tags = (offload_tags,)
        sleep(list(offload_tags), tags=None if tags is None else list(tags))

    def wake_up(self, tags=None) -> None:
        wake(None if tags is None else list(tags))

    def get_current_usage(self) -> int:
        """Bytes of device memory gpu-arena holds now (every device)."""
        api = _api()
        return sum(api.stats(d)["reserved_bytes"] for d in range(api.device_count()))
