"""``kv_connector_extra_config`` keys of TpusyncConnector (reference: docs/vllm.md).

Every key is checked: an unknown key, a wrong type, or a key whose backing feature is not in this
build raises :class:`ConfigError` when vLLM constructs the connector, never silently ignored.
"""

from __future__ import annotations

import math
import re
import socket
from dataclasses import dataclass
from typing import Any

from tpusync.core import InvalidArgumentError

__all__ = ["PENDING_KEYS", "ConfigError", "TpusyncVllmConfig"]


class ConfigError(InvalidArgumentError):
    """A kv_connector_extra_config key is unknown, malformed or not available in this build."""


# Keys documented now whose features live on branches not merged into this build (none today;
# kept so that a key can be announced before its feature lands).
PENDING_KEYS: dict[str, str] = {}


@dataclass(frozen=True)
class TpusyncVllmConfig:
    host_bytes: int = 1 << 30
    # /dev/shm warm restart: the host tier lives in /dev/shm/tpusync-<namespace>-r<rank>-host and a
    # restarted vLLM with the same model fingerprint re-attaches it (and the disk tier).
    namespace: str | None = None
    disk_dir: str | None = None  # disk tier directory (one sub-directory per rank); None: none
    disk_bytes: int = 0
    lease_s: float = 60.0  # longest a lookup's pins outlive an unreleased request (backstop)
    lookup_timeout_s: float = 5.0  # scheduler -> worker lookup round trip; no answer = a miss
    # With store_nodes: how long get_num_new_matched_tokens waits for a lookup (which may go to
    # the nodes) before answering None, i.e. "ask again next step"; 0: always answer later.
    lookup_wait_ms: float = 5.0
    # P/D (kv_producer / kv_consumer): where the producer listens, and the shared secret's file
    # (default: $TPUSYNC_AUTH_SECRET).
    pd_listen: str = "127.0.0.1:0"
    # P/D on one host: the producer also serves its pool from /dev/shm over a Unix socket, and a
    # consumer on the same host (same boot id) pulls through it instead of TCP.
    pd_same_host: bool = True
    auth_secret_file: str | None = None  # P/D and store nodes (default: $TPUSYNC_AUTH_SECRET)
    # Store nodes (`tpusync store-node`, HOST:PORT each): a last, shared tier under host [-> disk].
    # Every saved block is also written through to them (asynchronously) so that other vLLM
    # instances on the same nodes find it; lookups try the local tiers first, then the nodes.
    store_nodes: tuple[str, ...] = ()
    replicas: int = 1  # copies of each block on distinct nodes
    store_timeout_s: float = 2.0  # one request to one node (must stay below lookup_timeout_s)
    write_through: bool = True  # with store_nodes: publish every save to the nodes at once
    # Prometheus exporter of the worker (connector + store counters) on metrics_port + rank;
    # 0: none.
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"
    metrics: bool = True
    load_timeout_s: float = 60.0
    save_timeout_s: float = 60.0
    kv_events_endpoint: str | None = None
    kv_events_encoding: str = "tagged"
    pod_id: str = ""
    prefault: bool = True
    # Layer-pipelined loads: start_load_kv starts the step's loads and returns; each attention
    # layer waits for its own rows only (wait_for_layer_load). False: loads complete in
    # start_load_kv.
    layerwise_load: bool = True

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> TpusyncVllmConfig:
        extra = dict(extra or {})
        for key, feature in PENDING_KEYS.items():
            if key in extra:
                raise ConfigError(
                    f"kv_connector_extra_config[{key!r}] is not available in this build of "
                    f"tpusync-vllm: it needs {feature}, which is not merged yet (see docs/vllm.md)"
                )
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(
                f"unknown kv_connector_extra_config keys {unknown}; known: {sorted(known)} "
                f"(pending: {sorted(PENDING_KEYS)})"
            )
        kwargs: dict[str, Any] = {}
        for key, value in extra.items():
            default = getattr(cls, key)
            if key in ("namespace", "kv_events_endpoint", "disk_dir", "auth_secret_file"):
                ok = value is None or isinstance(value, str)
            elif key == "store_nodes":
                if isinstance(value, str):  # "h1:p1,h2:p2" (handy on a command line)
                    value = [v.strip() for v in value.split(",") if v.strip()]
                ok = isinstance(value, list | tuple) and all(
                    isinstance(v, str)
                    and re.fullmatch(r"\[?[^\s\]]+\]?:\d{1,5}", v)
                    and 0 < int(v.rpartition(":")[2]) <= 65535
                    for v in value
                )
                value = tuple(value) if ok else value
            elif isinstance(default, bool):
                ok = isinstance(value, bool)
            elif isinstance(default, int):
                ok = isinstance(value, int) and not isinstance(value, bool)
            elif isinstance(default, float):  # NaN and infinity pass every "> 0" check
                ok = (
                    isinstance(value, int | float)
                    and not isinstance(value, bool)
                    and math.isfinite(value)
                )
            else:
                ok = isinstance(value, str)
            if not ok:
                want = "a list of HOST:PORT" if key == "store_nodes" else type(default).__name__
                raise ConfigError(
                    f"kv_connector_extra_config[{key!r}] must be {want}, got {value!r}"
                )
            kwargs[key] = value
        cfg = cls(**kwargs)
        if cfg.host_bytes <= 0:
            raise ConfigError(f"host_bytes must be positive, got {cfg.host_bytes}")
        if min(cfg.load_timeout_s, cfg.save_timeout_s, cfg.lease_s, cfg.lookup_timeout_s) <= 0:
            raise ConfigError(
                "load_timeout_s, save_timeout_s, lease_s and lookup_timeout_s must be positive"
            )
        if cfg.disk_bytes < 0 or (cfg.disk_dir is None) != (cfg.disk_bytes == 0):
            raise ConfigError("disk_dir and disk_bytes (> 0) go together")
        if cfg.namespace is not None and not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", cfg.namespace):
            raise ConfigError(f"namespace must be 1-64 of [A-Za-z0-9_.-], got {cfg.namespace!r}")
        if cfg.replicas < 1 or (cfg.store_nodes and cfg.replicas > len(cfg.store_nodes)):
            raise ConfigError(
                f"replicas must be 1..{len(cfg.store_nodes)} (the number of store_nodes), "
                f"got {cfg.replicas}"
            )
        if cfg.lookup_wait_ms < 0:
            raise ConfigError(f"lookup_wait_ms must be >= 0, got {cfg.lookup_wait_ms}")
        if cfg.store_timeout_s <= 0:
            raise ConfigError(f"store_timeout_s must be positive, got {cfg.store_timeout_s}")
        if cfg.store_nodes and cfg.store_timeout_s >= cfg.lookup_timeout_s:
            # A node lookup runs inside the scheduler's lookup: it must end first, or the
            # scheduler gives up on a lookup that then still takes its lease.
            raise ConfigError(
                f"store_timeout_s ({cfg.store_timeout_s}) must be below lookup_timeout_s "
                f"({cfg.lookup_timeout_s}) with store_nodes"
            )
        if not 0 <= cfg.metrics_port <= 65535:
            raise ConfigError(f"metrics_port must be 0 (off) or a TCP port, got {cfg.metrics_port}")
        if cfg.kv_events_encoding not in ("tagged", "positional"):
            raise ConfigError("kv_events_encoding must be 'tagged' or 'positional'")
        return cfg

    def resolved_pod_id(self) -> str:
        return self.pod_id or socket.gethostname().replace("@", "_")
