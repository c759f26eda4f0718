"""gpu-arena's pool statistics as Prometheus metrics, through ``prometheus_client``.

Needs the ``prometheus`` extra (``pip install "./python[prometheus]"``); this is the only
module of the package that imports ``prometheus_client``. Serve them on their own port::

    import gpu_arena.prometheus
    gpu_arena.prometheus.start_http_server(9400)       # http://127.0.0.1:9400/metrics

or add the collector to the registry a serving engine already exposes::

    gpu_arena.prometheus.register()                    # prometheus_client.REGISTRY

Every metric has the label ``device`` (the device index) and is one field of
``gpu_arena.stats(device)``, read at each scrape. Names, types and help texts are those of
the one table in docs/metrics.md (``METRICS`` below; a test checks they agree), which the Rust
crate's ``metrics`` facade shares. Before gpu-arena is initialized a scrape shows the metrics
without samples (the collector never initializes gpu-arena itself).
"""

from __future__ import annotations

import threading
import weakref
from typing import Iterable, Iterator, NamedTuple, Optional, Tuple

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client import start_http_server as _start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .runtime import device_count, is_initialized, stats


class MetricDef(NamedTuple):
    """One row of docs/metrics.md."""

    name: str  # as exposed: counters end in _total
    type: str  # "gauge" or "counter"
    field: str  # the gpu_arena.stats() key
    help: str


# The rows of docs/metrics.md, in its order (tests/python/test_prometheus.py compares them):
# name | type | gpu_arena.stats() key | help.
_TABLE = """\
gpu_arena_reserved_bytes | gauge | reserved_bytes | Bytes in arenas held from the backend.
gpu_arena_allocated_bytes | gauge | allocated_bytes | Bytes in live allocations as served, each request rounded up to its block size (freed-but-shared ranges included).
gpu_arena_peak_reserved_bytes | gauge | peak_reserved_bytes | Highest reserved bytes seen.
gpu_arena_peak_allocated_bytes | gauge | peak_allocated_bytes | Highest allocated bytes seen.
gpu_arena_arenas | gauge | arenas | Arenas held.
gpu_arena_backend_creates_total | counter | backend_creates | Driver allocations created through the backend (arenas, a grown arena's chunks, a wake's memory).
gpu_arena_backend_destroys_total | counter | backend_destroys | Driver allocations handed back to the backend (arenas, a grown arena's chunks, a sleep's memory).
gpu_arena_exports_live | gauge | exports_live | Arenas exported right now.
gpu_arena_exports_total | counter | exports_total | Driver exports made.
gpu_arena_shares_live | gauge | shares_live | Shares handed out and not yet unshared.
gpu_arena_imports_live | gauge | imports_live | Consumer leases (imports by other processes) on this pool's memory, live now.
gpu_arena_pinned_bytes | gauge | pinned_bytes | Bytes in arenas pinned by a non-releasable export (recycled, never destroyed).
gpu_arena_allocations_live | gauge | allocations | Live allocations.
gpu_arena_allocations_total | counter | alloc_count | Allocations served.
gpu_arena_frees_total | counter | free_count | Frees.
gpu_arena_oom_total | counter | oom_count | Allocations that failed for lack of memory.
gpu_arena_deferred_free_bytes | gauge | deferred_free_bytes | Bytes freed by the producer but still shared (reused once the shares end).
gpu_arena_pending_free_bytes | gauge | pending_free_bytes | Bytes freed with record_stream streams, waiting for their events.
gpu_arena_requested_bytes | gauge | requested_bytes | Bytes callers asked for in live allocations, before rounding.
gpu_arena_peak_requested_bytes | gauge | peak_requested_bytes | Highest requested bytes seen.
gpu_arena_observer_errors_total | counter | observer_errors | Arena observer callbacks that failed (an on_ready that refused or panicked, an on_release that panicked).
gpu_arena_sleeping_bytes | gauge | sleeping_bytes | Bytes of arenas asleep (`gpu_arena_sleep`): addresses reserved, memory given back to the driver.
gpu_arena_offload_host_bytes | gauge | offload_host_bytes | Bytes of host memory held for sleep offloads: sleeping arenas' contents and buffers kept for the next sleep (`gpu_arena_sleep_release_host` frees those).
gpu_arena_sleep_kept_shared_bytes | gauge | sleep_kept_shared_bytes | Bytes of arenas whose tag sleeps but which kept their memory because another process may map them (shared, exported or pinned).
gpu_arena_arena_growths_total | counter | arena_growths | Growth steps of growing arenas (`grow_arenas=1`): each mapped one more chunk.
"""
METRICS: Tuple[MetricDef, ...] = tuple(
    MetricDef(*(cell.strip() for cell in line.split(" | "))) for line in _TABLE.splitlines()
)


def _family(m: MetricDef) -> Metric:
    if m.type == "counter":
        # prometheus_client adds the _total suffix of the samples back.
        return CounterMetricFamily(m.name[: -len("_total")], m.help, labels=["device"])
    return GaugeMetricFamily(m.name, m.help, labels=["device"])


class GpuArenaCollector(Collector):
    """A ``prometheus_client`` collector of every ``METRICS`` row, per device.

    ``devices``: the device indices to report (default: every device of the backend)."""

    def __init__(self, devices: Optional[Iterable[int]] = None):
        self.devices = None if devices is None else [int(d) for d in devices]

    def describe(self) -> Iterator[Metric]:
        # Lets registering check names without loading the library.
        return (_family(m) for m in METRICS)

    def collect(self) -> Iterator[Metric]:
        families = [_family(m) for m in METRICS]
        if is_initialized():
            devices = self.devices if self.devices is not None else range(device_count())
            for d in devices:
                s = stats(d)
                for m, fam in zip(METRICS, families):
                    fam.add_metric([str(d)], s[m.field])
        return iter(families)


_registered: "weakref.WeakKeyDictionary[CollectorRegistry, GpuArenaCollector]" = (
    weakref.WeakKeyDictionary()
)
_registered_lock = threading.Lock()


def register(registry: CollectorRegistry = REGISTRY) -> GpuArenaCollector:
    """Add a :class:`GpuArenaCollector` (all devices) to ``registry``, once: a second call
    with the same registry returns the collector registered first."""
    with _registered_lock:
        collector = _registered.get(registry)
        if collector is None:
            collector = GpuArenaCollector()
            registry.register(collector)
            _registered[registry] = collector
        return collector


def start_http_server(port: int, addr: str = "127.0.0.1",
                      registry: CollectorRegistry = REGISTRY):
    """Register the collector with ``registry`` (see :func:`register`) and serve it, with
    everything else registered there, at ``http://addr:port/metrics`` from a daemon thread.

    ``port`` 0 picks a free port. Listens on localhost only unless ``addr`` says otherwise
    (``"0.0.0.0"`` for every interface). Returns ``prometheus_client``'s ``(server, thread)``:
    ``server.server_port`` is the port, ``server.shutdown()`` stops it."""
    register(registry)
    return _start_http_server(port, addr=addr, registry=registry)
