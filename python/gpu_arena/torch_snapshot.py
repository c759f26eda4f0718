"""gpu-arena's memory in ``torch.cuda.memory._snapshot()``'s format, for PyTorch's viewers
(``python -m torch.cuda._memory_viz``, https://pytorch.org/memory_viz).

::

    gpu_arena.torch.record_memory_history(max_entries=100_000)
    ... run ...
    gpu_arena.torch.dump_snapshot("snap.pickle")
    # python -m torch.cuda._memory_viz trace_plot snap.pickle -o trace.html

**What is recorded.** gpu-arena keeps a ring of events per device in Rust
(``alloc/src/history.rs``; nothing is recorded, and nothing measurable is spent, while it is
off): ``alloc``, ``free_requested``, ``free_completed``, ``segment_alloc``, ``segment_free``
(an arena created/destroyed) and ``oom``, with address, size, requested size, stream and
time. :func:`memory_snapshot` turns them into ``device_traces`` and the arenas into
``segments`` (one segment per arena; its blocks tile it in address order: live allocations
as ``active_allocated`` or ``active_pending_free``, free and cached ranges as ``inactive``).

**Stacks: what you get.** PyTorch records the C++/Python stack of every allocation from
inside its allocator. gpu-arena is called from C++ with no view of the Python stack, and
there is no Python hook on tensor creation. What gpu-arena offers instead is *labelled
regions*: inside ``with gpu_arena.torch.annotate("attention"):`` every event recorded by
*that thread* carries the region's id, and the snapshot gives those events (and the blocks
they allocated) the frames ``[{"name": "attention", "filename": "<gpu_arena.annotate>",
"line": 0}]``, followed, with ``record_memory_history(stacks="python")``, by the Python stack
at the ``with`` statement (captured once per entry, innermost first). Allocations outside any
region, or on other threads (autograd's backward runs on its own device threads), have no
frames. Nested regions: the innermost wins.
"""

from __future__ import annotations

import contextlib
import pickle
import threading
import traceback
from typing import Any, Dict, List, Optional

from . import _lib

_lock = threading.Lock()
# context id -> frames (id 0: no frames); (label, stack) -> id, so loops reuse ids.
_frames_of: List[List[Dict[str, Any]]] = [[]]
_id_of: Dict[Any, int] = {}
_capture_python_stacks = False

def _fn(name: str):
    """A history function of the loaded library (declared in ``_lib._SIGNATURES``)."""
    return getattr(_lib.lib(), name)


def record_memory_history(
    enabled: Any = True, max_entries: int = 100_000, stacks: Optional[str] = None
) -> None:
    """Start (``enabled`` true, or PyTorch's ``"all"``) or stop (``False``/``None``)
    recording allocation events, ``max_entries`` per device (oldest overwritten). Starting
    clears earlier events; stopping keeps them for the next snapshot.

    ``stacks="python"``: :func:`annotate` regions also capture the Python stack at their
    entry (module docs). ``None``: regions carry only their label."""
    global _capture_python_stacks
    if stacks not in (None, "python"):
        raise ValueError(
            f"stacks={stacks!r}: gpu-arena offers None or 'python' (see gpu_arena.torch_snapshot)"
        )
    on = bool(enabled) and enabled != "state"
    _lib.check(
        _fn("gpu_arena_record_history")(int(on), _lib.as_int(max_entries, "max_entries")),
        "gpu_arena_record_history",
    )
    _capture_python_stacks = on and stacks == "python"


def _context_id(label: Optional[str], stack: tuple) -> int:
    key = (label, stack)
    with _lock:
        cid = _id_of.get(key)
        if cid is None:
            frames = []
            if label is not None:
                frames.append({"name": str(label), "filename": "<gpu_arena.annotate>", "line": 0})
            frames += [{"name": n, "filename": f, "line": ln} for (f, ln, n) in stack]
            cid = len(_frames_of)
            _frames_of.append(frames)
            _id_of[key] = cid
        return cid


@contextlib.contextmanager
def annotate(label: Optional[str] = None):
    """Label the allocation events this thread records inside the block (module docs)."""
    stack: tuple = ()
    if _capture_python_stacks:
        # Innermost first, as PyTorch lists frames; this function's own frames dropped.
        summary = traceback.extract_stack()[:-2]
        stack = tuple((f.filename, f.lineno or 0, f.name) for f in reversed(summary))
    cid = _context_id(label, stack)
    set_context = _fn("gpu_arena_set_history_context")
    prev = set_context(cid)
    try:
        yield cid
    finally:
        set_context(prev)


def _frames(cid: int) -> List[Dict[str, Any]]:
    with _lock:
        return [dict(f) for f in _frames_of[cid]] if 0 <= cid < len(_frames_of) else []


def _trace_entry(ev: Dict[str, Any]) -> Dict[str, Any]:
    """One history event as a PyTorch trace entry (alloc/free sizes: the requested bytes,
    as PyTorch records them; segment sizes: the arena's)."""
    action = ev["action"]
    frames = _frames(int(ev.get("context", 0)))
    label = frames[0]["name"] if frames and frames[0]["filename"] == "<gpu_arena.annotate>" else ""
    size = ev["size"] if action.startswith("segment") or action == "oom" else ev["requested"]
    entry = {"action": action, "size": size, "stream": ev["stream"], "time_us": ev["time_us"],
             "frames": frames, "compile_context": "N/A", "user_metadata": label}
    if action == "oom":
        entry["device_free"] = ev["device_free"]
    else:
        entry["addr"] = ev["addr"]
    return entry


def _segment(device: int, arena: Dict[str, Any], allocs: Dict[int, Dict[str, Any]],
             frames_at: Dict[int, list]) -> Dict[str, Any]:
    blocks: List[Dict[str, Any]] = []
    for r in arena["ranges"]:
        addr, size = r["offset"], r["len"]
        a = allocs.get(addr) if r["free_tag"] is None else None
        if a is not None:
            blocks.append({"address": addr, "size": size, "requested_size": a["requested"],
                           "state": a["state"], "frames": frames_at.get(addr, [])})
        elif blocks and blocks[-1]["state"] == "inactive":
            blocks[-1]["size"] += size  # free and cached neighbours: one inactive block
        else:
            blocks.append({"address": addr, "size": size, "requested_size": 0,
                           "state": "inactive", "frames": []})
    active = [b for b in blocks if b["state"] != "inactive"]
    return {
        "device": device,
        "address": arena["base"],
        "total_size": arena["bytes"],
        "allocated_size": sum(b["size"] for b in active if b["state"] == "active_allocated"),
        "active_size": sum(b["size"] for b in active),
        "requested_size": sum(b["requested_size"] for b in active),
        "stream": 0,  # arenas serve every stream
        # Blocks up to 1 MiB have 2 MiB arenas of their own (alloc/src/pool/sizes/classes.rs).
        "segment_type": "small" if arena.get("small") else "large",
        "segment_pool_id": (0, 0),
        "is_expandable": False,
        "frames": [],
        "blocks": blocks,
    }


def memory_snapshot(raw: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """gpu-arena's state in ``torch.cuda.memory._snapshot()``'s format:
    ``{"segments", "device_traces", "allocator_settings", "external_annotations"}``.
    ``raw`` is a ``gpu_arena.snapshot()`` (taken now when None)."""
    if raw is None:
        import gpu_arena

        raw = gpu_arena.snapshot()
    segments: List[Dict[str, Any]] = []
    traces: List[List[Dict[str, Any]]] = []
    for dev in raw["devices"]:
        d = dev["device"]
        events = dev.get("history", {}).get("events", [])
        trace = [_trace_entry(ev) for ev in events]
        # A live block's frames: those of the last alloc event at its address.
        frames_at = {t["addr"]: t["frames"] for t in trace if t["action"] == "alloc"}
        allocs = {a["addr"]: a for a in dev.get("allocations", [])}
        for arena in sorted(dev["arenas"], key=lambda a: a["base"]):
            segments.append(_segment(d, arena, allocs, frames_at))
        while len(traces) <= d:
            traces.append([])
        traces[d] = trace
    return {
        "segments": segments,
        "device_traces": traces,
        "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "", "allocator": "gpu-arena",
                               "backend": raw.get("backend", ""), "expandable_segments": False},
        "external_annotations": [],
    }


def dump_snapshot(path: str, snapshot: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Pickle :func:`memory_snapshot` (or ``snapshot``) to ``path`` with protocol 4 (the
    newest MemoryViz.js reads) and return it."""
    snap = memory_snapshot() if snapshot is None else snapshot
    with open(path, "wb") as f:
        pickle.dump(snap, f, protocol=4)
    return snap


_BLOCK_STATES = ("active_allocated", "active_pending_free", "inactive")
_ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
            "segment_map", "segment_unmap", "oom", "snapshot")


def check_snapshot(snap: Dict[str, Any]) -> List[str]:
    """What PyTorch's viewers need of a snapshot (MemoryViz.js and ``_memory_viz.py`` of
    2.11, per the research in issue #11), checked: the problems found ([] when none).

    Segments have int ``device, address, total_size, stream`` and ``blocks`` that tile them
    in address order (the JS recomputes block addresses from the sizes) with a known
    ``state``, an int ``requested_size`` and ``frames`` of ``{name: str, filename: str,
    line: int}``; trace entries have a known ``action``, int ``size`` and ``stream``,
    ``addr`` (``device_free`` for ``oom``) and frames; every ``free_requested`` is followed
    by its ``free_completed`` unless the block is ``active_pending_free`` at the end (the
    JS replays the trace backwards from the final state); no ``category`` field (the JS
    then needs one named 'unknown')."""
    problems: List[str] = []
    for key in ("segments", "device_traces"):
        if not isinstance(snap.get(key), list):
            problems.append(f"top-level {key!r} is not a list")
    if problems:
        return problems

    def frames_ok(where: str, frames: Any) -> None:
        if not isinstance(frames, list):
            problems.append(f"{where}: frames is not a list")
            return
        for f in frames:
            if not (isinstance(f, dict) and isinstance(f.get("name"), str)
                    and isinstance(f.get("filename"), str) and isinstance(f.get("line"), int)):
                problems.append(f"{where}: bad frame {f!r}")

    pending_at_end = set()
    for i, seg in enumerate(snap["segments"]):
        where = f"segment {i}"
        for k in ("device", "address", "total_size", "stream"):
            if not isinstance(seg.get(k), int):
                problems.append(f"{where}: {k} is not an int")
        blocks = seg.get("blocks")
        if not isinstance(blocks, list) or not blocks:
            problems.append(f"{where}: no blocks")
            continue
        at = seg.get("address", 0)
        for j, b in enumerate(blocks):
            bw = f"{where} block {j}"
            if b.get("state") not in _BLOCK_STATES:
                problems.append(f"{bw}: state {b.get('state')!r}")
            if not isinstance(b.get("size"), int) or b["size"] <= 0:
                problems.append(f"{bw}: size {b.get('size')!r}")
                continue
            if not isinstance(b.get("requested_size"), int):
                problems.append(f"{bw}: requested_size is not an int")
            if "address" in b and b["address"] != at:
                problems.append(f"{bw}: address {b['address']:#x}, tiling says {at:#x}")
            if "category" in b:
                problems.append(f"{bw}: has 'category'")
            frames_ok(bw, b.get("frames", []))
            if b.get("state") == "active_pending_free":
                pending_at_end.add((seg.get("device"), at))
            at += b["size"]
        if at != seg.get("address", 0) + seg.get("total_size", 0):
            problems.append(f"{where}: blocks cover {at - seg.get('address', 0)} bytes of "
                            f"{seg.get('total_size')}")
    for d, trace in enumerate(snap["device_traces"]):
        requested = set()
        for j, t in enumerate(trace):
            tw = f"device {d} trace entry {j}"
            a = t.get("action")
            if a not in _ACTIONS:
                problems.append(f"{tw}: action {a!r}")
                continue
            for k in ("size", "stream") + (("device_free",) if a == "oom" else ("addr",)):
                if not isinstance(t.get(k), int):
                    problems.append(f"{tw} ({a}): {k} is not an int")
            if "category" in t:
                problems.append(f"{tw}: has 'category'")
            frames_ok(tw, t.get("frames", []))
            if a == "free_requested":
                requested.add(t.get("addr"))
            elif a == "free_completed":
                requested.discard(t.get("addr"))
        for addr in requested:
            if (d, addr) not in pending_at_end:
                problems.append(f"device {d}: free_requested of {addr:#x} never completed, "
                                "and the block is not active_pending_free at the end")
    return problems
