"""Prometheus metrics for tpusync stores (prometheus-client).

:func:`register_store` adds a collector that reads ``store.stats()`` at every scrape, so counters
are never duplicated in Python and cost nothing between scrapes. :func:`serve` starts the
prometheus-client HTTP exporter on request.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

__all__ = ["StoreCollector", "register_store", "serve"]

# (stats key, metric suffix, help, counter?)
_STORE_FIELDS = [
    ("puts", "put_keys", "Keys offered to put", True),
    ("put_stored", "put_stored_keys", "Keys newly written by put", True),
    ("put_rejected", "put_rejected_keys", "Keys put could not store", True),
    ("gets", "get_keys", "Keys asked of get", True),
    ("misses", "misses", "Keys found in no tier (corrupted reads included)", True),
    ("evicted", "evicted_keys", "Keys that left the store for lack of room", True),
    ("corrupted", "corrupted_blocks", "Corrupted or truncated blocks detected on read", True),
    ("writeback_errors", "writeback_errors", "Failed write-back writes (ENOSPC included)", True),
    ("writeback_inflight", "writeback_queue_blocks", "Blocks being written down now", False),
    ("write_through", "write_through_blocks", "Blocks copied to the last tier on put", True),
    ("write_through_dropped", "write_through_dropped_blocks", "Write-through copies skipped", True),
    ("write_through_errors", "write_through_errors", "Write-through copies that failed", True),
    ("engine_queue", "engine_queue_tasks", "Tasks queued on the copy engine", False),
    ("keys", "keys", "Keys stored", False),
]
_TIER_FIELDS = [
    ("hits", "hits", "Get keys served from the tier", True),
    ("evictions", "evictions", "Blocks dropped from the tier to make room", True),
    ("promotions_in", "promotions", "Blocks promoted into the tier", True),
    ("demotions_in", "demotions", "Blocks written into the tier by write-back", True),
    ("bytes_written", "written_bytes", "Bytes written to the tier", True),
    ("bytes_read", "read_bytes", "Bytes read from the tier", True),
    ("write_errors", "write_errors", "Failed block writes", True),
    ("no_space_errors", "no_space_errors", "Block writes refused with ENOSPC", True),
    ("read_errors", "read_errors", "Failed block reads (I/O errors)", True),
    ("corrupted", "corrupted_blocks", "Checksum, key or length mismatches", True),
    ("used_blocks", "used_blocks", "Blocks in use", False),
    ("capacity_blocks", "capacity_blocks", "Capacity in blocks", False),
]


class StoreCollector:
    """A prometheus-client collector over one store's ``stats()``."""

    def __init__(self, store: Any, prefix: str = "tpusync_store") -> None:
        self._store = store
        self._prefix = prefix

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self._store.stats()
        p = self._prefix
        for key, name, doc, counter in _STORE_FIELDS:
            family = CounterMetricFamily if counter else GaugeMetricFamily
            yield family(f"{p}_{name}", doc, value=s[key])
        for key, name, doc, counter in _TIER_FIELDS:
            family = CounterMetricFamily if counter else GaugeMetricFamily
            m = family(f"{p}_tier_{name}", doc, labels=["tier"])
            for tier, t in s["tiers"].items():
                m.add_metric([tier], t[key])
            yield m
        for op in ("put", "get"):
            lat = s[f"{op}_latency"]
            m = GaugeMetricFamily(
                f"{p}_{op}_latency_seconds", f"{op} latency (count, sum, max)", labels=["stat"]
            )
            m.add_metric(["count"], lat["count"])
            m.add_metric(["sum"], lat["total_s"])
            m.add_metric(["max"], lat["max_s"])
            yield m


def register_store(
    store: Any, registry: Any = None, prefix: str = "tpusync_store"
) -> StoreCollector:
    """Register a :class:`StoreCollector` (default registry: prometheus_client.REGISTRY)."""
    from prometheus_client import REGISTRY

    collector = StoreCollector(store, prefix)
    (registry if registry is not None else REGISTRY).register(collector)
    return collector


def serve(port: int, addr: str = "127.0.0.1", registry: Any = None) -> Any:
    """Start prometheus-client's HTTP exporter (a daemon thread) and return its server."""
    from prometheus_client import REGISTRY, start_http_server

    return start_http_server(
        port, addr=addr, registry=registry if registry is not None else REGISTRY
    )
