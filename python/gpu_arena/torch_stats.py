"""gpu-arena's counters in ``torch.cuda.memory_stats()``'s shape, for tools that read them.

With :func:`gpu_arena.torch.install` PyTorch's own ``torch.cuda.memory_stats()`` raises
(a pluggable allocator has no device stats). Switch a tool with one line::

    stats = gpu_arena.torch.memory_stats()      # was torch.cuda.memory_stats()

Only keys gpu-arena can honour are present (a missing key is better than an invented 0);
read them with ``.get`` where a tool also runs on PyTorch's allocator. From
``gpu_arena.stats()`` (``PoolStats``, alloc/src/stats.rs):

=====================================  ================================================
key                                    gpu-arena counter
=====================================  ================================================
``allocated_bytes.all.current``        ``allocated_bytes``: live allocations, rounded
                                       (to 512 B; 2 MiB above 1 MiB)
``allocated_bytes.all.peak``           ``peak_allocated_bytes``
``active_bytes.all.current/peak``      the same two (see below)
``requested_bytes.all.current``        ``requested_bytes`` (the bytes asked for), when the
                                       library's stats struct has that field
``reserved_bytes.all.current/peak``    ``reserved_bytes`` / ``peak_reserved_bytes``: arenas
``allocation.all.current``             ``allocations`` (live)
``allocation.all.allocated/freed``     ``alloc_count`` / ``free_count`` (ever)
``active.all.current/allocated/freed`` the same three
``segment.all.current``                ``arenas`` (a segment is an arena)
``segment.all.allocated/freed``        ``backend_creates`` / ``backend_destroys``
``num_ooms``                           ``oom_count``
``num_device_alloc/free``              ``backend_creates`` / ``backend_destroys``
``max_split_size``                     -1 (gpu-arena splits blocks of any size)
=====================================  ================================================

Not honoured, hence absent: the ``large_pool``/``small_pool`` splits (gpu-arena keeps blocks
up to 1 MiB in 2 MiB arenas of their own, but its counters are not split by size class;
only ``.all.`` keys exist), the cumulative byte counts
(``*_bytes.all.allocated/freed``), the peaks of counts (``allocation.all.peak``...),
``inactive_split*``, ``oversize_*``, ``num_alloc_retries`` and ``num_sync_all_streams``.
Frees still waiting for a ``record_stream`` stream or a share count as allocated (PyTorch
counts them as active only): ``allocated_bytes`` and ``active_bytes`` are equal.
"""

from __future__ import annotations

import collections
from typing import Dict, Optional

from . import _lib


def _device(device) -> int:
    """PyTorch's device argument (None, an int, "cuda:1", a torch.device) as an index."""
    if device is None:
        try:
            import torch

            if torch.cuda.is_initialized():
                return int(torch.cuda.current_device())
        except ImportError:
            pass
        return 0
    if isinstance(device, str):
        _, _, idx = device.partition(":")
        return int(idx) if idx else 0
    index = getattr(device, "index", device)
    return 0 if index is None else _lib.as_int(index, "device")


def memory_stats(device=None) -> Dict[str, int]:
    """gpu-arena's counters of ``device`` under ``torch.cuda.memory_stats()``'s key names
    (module docs: which keys, from what), sorted like PyTorch's."""
    import gpu_arena

    s = gpu_arena.stats(_device(device))
    out = {
        "allocated_bytes.all.current": s["allocated_bytes"],
        "allocated_bytes.all.peak": s["peak_allocated_bytes"],
        "active_bytes.all.current": s["allocated_bytes"],
        "active_bytes.all.peak": s["peak_allocated_bytes"],
        "reserved_bytes.all.current": s["reserved_bytes"],
        "reserved_bytes.all.peak": s["peak_reserved_bytes"],
        "allocation.all.current": s["allocations"],
        "allocation.all.allocated": s["alloc_count"],
        "allocation.all.freed": s["free_count"],
        "active.all.current": s["allocations"],
        "active.all.allocated": s["alloc_count"],
        "active.all.freed": s["free_count"],
        "segment.all.current": s["arenas"],
        "segment.all.allocated": s["backend_creates"],
        "segment.all.freed": s["backend_destroys"],
        "num_ooms": s["oom_count"],
        "num_device_alloc": s["backend_creates"],
        "num_device_free": s["backend_destroys"],
        "max_split_size": -1,
    }
    # Present only with a library whose PoolStats has the field (the ctypes struct is
    # checked against the header, so the field exists exactly when the library has it).
    if "requested_bytes" in s:
        out["requested_bytes.all.current"] = s["requested_bytes"]
    if "peak_requested_bytes" in s:
        out["requested_bytes.all.peak"] = s["peak_requested_bytes"]
    return collections.OrderedDict(sorted(out.items()))


def memory_allocated(device=None) -> int:
    """``torch.cuda.memory_allocated()``: bytes in live allocations."""
    return memory_stats(device)["allocated_bytes.all.current"]


def max_memory_allocated(device=None) -> int:
    """``torch.cuda.max_memory_allocated()``: the peak of :func:`memory_allocated`."""
    return memory_stats(device)["allocated_bytes.all.peak"]


def memory_reserved(device=None) -> int:
    """``torch.cuda.memory_reserved()``: bytes in gpu-arena's arenas."""
    return memory_stats(device)["reserved_bytes.all.current"]


def max_memory_reserved(device=None) -> int:
    """``torch.cuda.max_memory_reserved()``: the peak of :func:`memory_reserved`."""
    return memory_stats(device)["reserved_bytes.all.peak"]


# ------------------------------------------------------------------------------------------
# memory_summary: torch.cuda.memory_summary()'s table (torch/cuda/memory.py, 2.11)
# ------------------------------------------------------------------------------------------


def _format_scaled(v: Optional[int], pref: Optional[int], units, step: int, limit: int,
                   fmt: str) -> str:
    """PyTorch's ``_format_size``/``_format_count``: move one unit up while the row's
    first value (``pref``) is at least ``limit``; ``n/a`` for a value gpu-arena lacks."""
    if v is None:
        return "    n/a   "
    p = pref if pref is not None else v
    unit = units[0]
    for next_unit in units[1:]:
        if p < limit:
            break
        unit = next_unit
        v //= step
        p /= step
    return fmt.format(v, unit)


def _format_size(sz: Optional[int], pref_sz: Optional[int]) -> str:
    return _format_scaled(sz, pref_sz, ["B  ", "KiB", "MiB", "GiB", "TiB", "PiB"], 1024,
                          768 * 1024, "{:6d} {}")


def _format_count(cnt: Optional[int], pref_cnt: Optional[int]) -> str:
    return _format_scaled(cnt, pref_cnt, [" ", "K", "M"], 1000, 750 * 1000, "{:7d} {} ")


def memory_summary(device=None, abbreviated: bool = False) -> str:
    """A table like ``torch.cuda.memory_summary()``, from :func:`memory_stats`. gpu-arena's
    counters are not split by size class, so there are no "from large/small pool" rows
    (``abbreviated`` is accepted for compatibility); a value gpu-arena does not count shows
    as ``n/a``."""
    del abbreviated
    stats = memory_stats(device)
    dev = _device(device)
    rows = [
        ("allocated_bytes", "Allocated memory", _format_size),
        ("active_bytes", "Active memory", _format_size),
        ("requested_bytes", "Requested memory", _format_size),
        ("reserved_bytes", "GPU reserved memory", _format_size),
        ("allocation", "Allocations", _format_count),
        ("active", "Active allocs", _format_count),
        ("segment", "GPU reserved segments", _format_count),
    ]
    lines = [
        "=" * 75,
        " {:^73} ".format(f"gpu-arena CUDA memory summary, device ID {dev}"),
        "-" * 75,
        " {:^34} | {:^36} ".format(
            f"CUDA OOMs: {stats['num_ooms']}", f"arenas created: {stats['num_device_alloc']}"
        ),
        "=" * 75,
        "        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  ",
    ]
    for key, name, fmt in rows:
        lines.append("-" * 75)
        vals = [stats.get(f"{key}.all.{m}") for m in ("current", "peak", "allocated", "freed")]
        cells = " | ".join(fmt(v, v) for v in vals)
        lines.append(f" {name:<21} | {cells} ")
    lines.append("=" * 75)
    lines.append(
        " {:<73} ".format("Counters not split into small/large pools. n/a: not counted.")
    )
    lines.append("=" * 75)
    return "|" + "|\n|".join(lines) + "|\n"
