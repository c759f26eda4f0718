"""gpu-arena's pool statistics as Prometheus metrics, through ``prometheus_client``.

Needs the ``prometheus`` extra (``pip install "./python[prometheus]"``); this is the only
module of the package that imports ``prometheus_client``. Serve them on their own port::

    import gpu_arena.prometheus
    gpu_arena.prometheus.start_http_server(9400)       # http://127.0.0.1:9400/metrics

or add the collector to the registry a serving engine already exposes::

    gpu_arena.prometheus.register()                    # prometheus_client.REGISTRY

Every metric has the label ``device`` (the device index) and is one field of
``gpu_arena.stats(device)``, read at each scrape. Names, types and help texts are those the
library serves with the stats fields (``gpu_arena_stats_fields``: the one table, Rust's
``STAT_FIELDS`` beside ``PoolStats``, from which docs/metrics.md is generated and which the
Rust crate's ``metrics`` facade shares); ``METRICS`` holds them, read from the library on
first use. Describing or collecting loads the library (registering a collector does), never
initializes gpu-arena: before init a scrape shows the metrics without samples.
"""

from __future__ import annotations

import threading
import weakref
from typing import Iterable, Iterator, NamedTuple, Optional, Tuple

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client import start_http_server as _start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from . import _lib
from .runtime import device_count, is_initialized, stats


class MetricDef(NamedTuple):
    """One row of the metric table (docs/metrics.md)."""

    name: str  # as exposed: counters end in _total
    type: str  # "gauge" or "counter"
    field: str  # the gpu_arena.stats() key
    help: str


def metrics() -> Tuple[MetricDef, ...]:
    """Every metric, in the stats struct's order, as the library serves them (loads the
    library, does not initialize gpu-arena)."""
    return tuple(MetricDef(f.metric, f.kind, f.name, f.help) for f in _lib.stat_fields())


def __getattr__(name: str):
    # ``METRICS``: the rows, read from the library when first asked for.
    if name == "METRICS":
        return metrics()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _family(m: MetricDef) -> Metric:
    if m.type == "counter":
        # prometheus_client adds the _total suffix of the samples back.
        return CounterMetricFamily(m.name[: -len("_total")], m.help, labels=["device"])
    return GaugeMetricFamily(m.name, m.help, labels=["device"])


class GpuArenaCollector(Collector):
    """A ``prometheus_client`` collector of every metric (``METRICS``), per device.

    ``devices``: the device indices to report (default: every device of the backend)."""

    def __init__(self, devices: Optional[Iterable[int]] = None):
        self.devices = None if devices is None else [int(d) for d in devices]

    def describe(self) -> Iterator[Metric]:
        # Lets registering check names (loads the library, initializes nothing).
        return (_family(m) for m in metrics())

    def collect(self) -> Iterator[Metric]:
        rows = metrics()
        families = [_family(m) for m in rows]
        if is_initialized():
            devices = self.devices if self.devices is not None else range(device_count())
            for d in devices:
                s = stats(d)
                for m, fam in zip(rows, families):
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
