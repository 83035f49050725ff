"""The distributed prefix cache: store nodes and their client.

A store node (``tpusync store-node``) keeps fixed-size blocks by key in a host pool and serves
put / get / lookup / remove over the authenticated transport. :class:`StoreClient` spreads keys
over several nodes with rendezvous hashing, keeps ``replication`` copies and fails over to the
next replica when a node is down.

Contracts (native/include/tpusync/node/store_node.h): a put is two-phase (reserved, received and
checksum-verified, then committed), so no reader sees a partial block; the first committed writer
of a key wins; a get leases its blocks while sending them; a full node evicts least-recently-used
keys.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
from collections.abc import Sequence

from tpusync.core import _native
from tpusync.core.pd import _secret
from tpusync.core.pool import HostBlockPool, _counts, _ids

__all__ = ["StoreClient", "StoreNode", "parse_size", "run_store_node"]

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tib": 1 << 40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}  # fmt: skip


def parse_size(text: str) -> int:
    """``8GiB`` / ``512MiB`` / ``64KiB`` / ``1000`` -> bytes (ValueError on anything else)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size (e.g. 8GiB, 512MiB, 4096)")
    size = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if size >= 1 << 63:
        raise ValueError(f"{text!r} is too large a size (at most 8 EiB)")
    return size


class StoreNode:
    """An in-process store node (the CLI runs one of these).

    Blocks live in the node's own tiered KVStore: ``capacity`` bytes of host DRAM and, with
    ``disk_dir``, ``disk_capacity`` bytes of disk below it (LRU, checksums, counters).

    With ``name_space`` the DRAM tier lives in ``/dev/shm/tpusync-<name_space>-host`` and survives
    the process: a node restarted (even after SIGKILL) with the same namespace, capacity, block
    size and ``fingerprint`` serves the blocks it held, each verified against its checksum; any
    mismatch is a cold start whose reason is :attr:`cold_start_reason` (also logged on stderr).
    """

    def __init__(
        self,
        *,
        listen: str = "127.0.0.1:0",
        capacity: int = 1 << 30,
        block_bytes: int = 256 << 10,
        secret: bytes | None = None,
        secret_file: str | None = None,
        disk_dir: str | os.PathLike[str] | None = None,
        disk_capacity: int = 0,
        name_space: str = "",
        fingerprint: str = "",
    ) -> None:
        _counts(
            "StoreNode", capacity=capacity, block_bytes=block_bytes, disk_capacity=disk_capacity
        )
        self._native = _native.StoreNode.start(
            _secret(secret, secret_file),
            listen=listen,
            capacity_bytes=capacity,
            block_bytes=block_bytes,
            disk_dir=os.fspath(disk_dir) if disk_dir is not None else "",
            disk_capacity_bytes=disk_capacity,
            name_space=name_space,
            fingerprint=fingerprint,
        )

    @property
    def address(self) -> str:
        return self._native.address

    @property
    def cold_start_reason(self) -> str:
        """Why cached blocks were discarded at start; empty for a warm (or first) start."""
        return self._native.cold_start_reason

    def stats(self) -> dict[str, int]:
        return self._native.stats()

    def stop(self) -> None:
        """Stop accepting, end every connection, join every thread."""
        self._native.stop()


class StoreClient:
    """Client of the store nodes ``nodes`` (``HOST:PORT`` each), moving blocks of ``pool``."""

    def __init__(
        self,
        pool: HostBlockPool,
        nodes: Sequence[str],
        *,
        replication: int = 1,
        secret: bytes | None = None,
        secret_file: str | None = None,
        timeout: float = 10.0,
    ) -> None:
        _counts("StoreClient", replication=replication)
        self._pool = pool
        self._native = _native.StoreClient.create(
            pool.native, _secret(secret, secret_file), node_list(nodes, "StoreClient nodes"),
            replication=replication, timeout=timeout,
        )  # fmt: skip

    def rank(self, key: Key) -> list[int]:
        """Node indices for ``key``, best first (the first ``replication`` hold it)."""
        return self._native.rank(_keys([key])[0])

    def put(self, keys: Sequence[Key], blocks: Sequence[int]) -> list[int]:
        """Store block i under keys[i]; returns how many replicas hold each key afterwards."""
        return self._native.put(_keys(keys), _ids(blocks))

    def get(self, keys: Sequence[Key], dst: Sequence[int]) -> list[bool]:
        """Copy keys[i] into block dst[i] when any replica has it; returns found flags."""
        return self._native.get(_keys(keys), _ids(dst, "destination block ids"))

    def lookup_prefix(self, keys: Sequence[Key], lease: float = 0.0) -> int:
        """Length of the leading run of ``keys`` stored somewhere (batched per node). With
        ``lease`` > 0 (seconds) each key of that run stays on its node until read or the lease
        ends; keys found past the run are not left leased."""
        return self._native.lookup_prefix(_keys(keys), lease=lease)

    def remove(self, keys: Sequence[Key]) -> list[bool]:
        return self._native.remove(_keys(keys))

    def check_nodes(self) -> None:
        """Ask every node once; raise for a node that refuses this client for good (another
        block size, another secret). Nodes that are down or silent are skipped."""
        self._native.check_nodes()


Key = str | bytes


def _keys(keys: Sequence[Key]) -> list[bytes]:
    """Keys as bytes: bytes as given (block hashes, like KVStore's), str as UTF-8."""
    if isinstance(keys, (str, bytes)):
        raise TypeError("keys must be a sequence of keys, got a single key")
    out = []
    for i, k in enumerate(keys):
        if isinstance(k, (bytes, bytearray, memoryview)):
            out.append(bytes(k))
        elif isinstance(k, str):
            try:
                out.append(k.encode())
            except UnicodeEncodeError as e:
                raise ValueError(
                    f"key {i} is not valid UTF-8 text ({e.reason}); pass bytes"
                ) from None
        else:
            raise TypeError(f"key {i} must be str or bytes, got {type(k).__name__}")
    return out


def node_list(nodes: str | Sequence[str], what: str) -> list[str]:
    """``HOST:PORT`` strings; one string is one node (iterating it gave one-character
    "addresses")."""
    if isinstance(nodes, str):
        return [nodes]
    out = list(nodes)
    for i, n in enumerate(out):
        if not isinstance(n, str):
            raise TypeError(f"{what}: node {i} must be a 'HOST:PORT' str, got {type(n).__name__}")
    return out


def _metrics(node: StoreNode, host: str, port: int) -> object:
    """Serve the node's counters as Prometheus metrics on host:port (prometheus-client)."""
    from prometheus_client import start_http_server
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from prometheus_client.registry import REGISTRY

    gauges = {"blocks_total", "blocks_used", "leases_active", "disk_blocks_total",
              "disk_blocks_used", "recovered_blocks"}  # fmt: skip

    class Collector:
        def collect(self):
            for name, value in node.stats().items():
                if name in gauges:
                    yield GaugeMetricFamily(f"tpusync_store_{name}", name, value=value)
                else:
                    yield CounterMetricFamily(f"tpusync_store_{name}", name, value=value)

    collector = Collector()
    REGISTRY.register(collector)
    try:
        start_http_server(port, addr=host)
    except OSError as e:
        REGISTRY.unregister(collector)
        raise OSError(f"metrics port {port} on {host}: {e.strerror or e}") from None
    return collector


def run_store_node(
    listen: str,
    capacity: int,
    block_bytes: int,
    secret_file: str | None,
    metrics_port: int | None,
    disk_dir: str | None = None,
    disk_capacity: int = 0,
    name_space: str = "",
    fingerprint: str = "",
) -> int:
    """Run a store node until SIGTERM / SIGINT, then shut it down cleanly (exit 0).

    Prints one JSON line ``{"address", "metrics", "pid", "namespace", "recovered_blocks",
    "cold_start_reason"}`` on stdout once serving.
    """
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    node = StoreNode(listen=listen, capacity=capacity, block_bytes=block_bytes,
                     secret_file=secret_file, disk_dir=disk_dir,
                     disk_capacity=disk_capacity, name_space=name_space,
                     fingerprint=fingerprint)  # fmt: skip
    metrics = collector = None
    if metrics_port is not None:
        # The host of --listen; a node on a Unix socket serves its metrics on loopback.
        unix = node.address.startswith(("unix:", "/"))
        host = "127.0.0.1" if unix else node.address.rsplit(":", 1)[0].strip("[]")
        try:
            collector = _metrics(node, host, metrics_port)
        except OSError:
            node.stop()
            raise
        metrics = f"http://{host}:{metrics_port}/metrics"
    info = {
        "address": node.address,
        "metrics": metrics,
        "pid": os.getpid(),
        "namespace": name_space or None,
        "recovered_blocks": node.stats()["recovered_blocks"],
        "cold_start_reason": node.cold_start_reason or None,
    }
    print(json.dumps(info), flush=True)
    while not stop.wait(0.2):
        pass
    node.stop()
    if collector is not None:
        from prometheus_client.registry import REGISTRY

        REGISTRY.unregister(collector)
    print(json.dumps({"stopped": True, "stats": node.stats()}), flush=True)
    sys.stdout.flush()
    return 0
