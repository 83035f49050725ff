"""The connector's storage: one tpusync.core.KVStore per worker, and how the scheduler asks it.

SPLIT CONTRACT. vLLM runs the connector twice: a SCHEDULER instance that decides hits and a
WORKER instance per worker process that moves bytes. On vLLM's default engine they live in
different processes. The store therefore has exactly one owner, the WORKER:

- :class:`WorkerStore` owns a :class:`tpusync.core.KVStore` (host tier, optionally in /dev/shm
  under a namespace for warm restart, optional disk tier, optional store nodes as a last, shared
  tier written through on every save) whose block is one vLLM block across every layer of this
  worker. Saves gather the block's rows of every layer into a staging buffer
  and ``put`` it; loads ``get`` into the staging buffer and scatter the rows back.
- The SCHEDULER asks the worker through :class:`LookupClient`: a direct call when both halves
  share a process (vLLM's in-process engine), else one ZeroMQ REQ/REP round trip over a Unix
  socket the worker serves (:class:`LookupServer`), named from vLLM's engine id and the rank.

Rejected alternatives: (1) opening the same /dev/shm namespace from both processes - the host
tier locks its segment (one owner, warm-restart contract in tier/host_tier.h), and a second
index in the scheduler would drift from the store's own eviction; (2) a scheduler-side mirror
seeded through vLLM's handshake metadata - it goes stale as the store evicts or finds corrupted
blocks, so hits would turn into load errors instead of being answered correctly.

LEASE CONTRACT (pins). A lookup that the scheduler may turn into a load pins the hit keys in the
store under the request id (a lease), so that neither eviction nor write-back pressure can drop
them before the load. A lease is released when: the worker finished that request's load, the
scheduler sends the request id as released (finished, aborted, preempted, or the hit was not
used), a new lookup for the same request replaces it, or ``lease_s`` passed (a backstop for a
scheduler that died). Every pin the store holds belongs to exactly one live lease, so
``num_pins == 0`` once no request is in flight.

SHARED KEY CONTRACT (store nodes). Store nodes may be shared by vLLM instances of other models,
dtypes or tensor-parallel layouts, whose block hashes can be equal for equal tokens. With store
nodes, every store key is therefore the vLLM block hash followed by ``key_salt`` (16 bytes of a
digest of what decides a block's bytes: model, dtype, block size, hash algorithm, row geometry,
rank and world size - not the KV cache's capacity); events and callers see the plain hashes.
Without store nodes no salt is added (the host / disk tiers are fingerprinted as a whole).
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch
import zmq

import tpusync.core as tc

__all__ = [
    "LookupClient",
    "LookupResult",
    "LayeredLoad",
    "LookupServer",
    "WorkerStore",
    "lookup_endpoint",
    "model_fingerprint",
    "share_salt",
]

log = logging.getLogger("tpusync.vllm")

# Lookup servers of this process by endpoint: vLLM's in-process engine answers lookups directly.
_LOCAL: dict[str, LookupServer] = {}
_LOCAL_LOCK = threading.Lock()


# Tier names by cost of a read, for merging the ranks' answers (the slowest rank decides).
_SLOWNESS = {"host": 0, "disk": 1, "remote": 2}


def lookup_endpoint(engine_id: str, rank: int) -> str:
    """The Unix socket on which the worker of ``rank`` answers lookups for engine ``engine_id``.

    SOCKET NAME RULE: a readable head of the id plus a digest of all of it (cut to 40
    characters alone, ``<uuid>_dp1`` and ``<uuid>_dp10`` named one socket, and a scheduler asked
    another engine's worker)."""
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in engine_id)[:24]
    tag = hashlib.blake2b(engine_id.encode(), digest_size=8).hexdigest()
    return f"ipc://{tempfile.gettempdir()}/tpusync-vllm-{safe}-{tag}-{rank}.sock"


def _answers(path: str) -> bool:
    """Whether a process accepts connections on the Unix socket ``path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(path)
        except OSError:
            return False
    return True


@dataclass(frozen=True)
class LookupResult:
    """``hit`` leading keys are stored; ``tiers[i]`` is where key ``i`` lives ("host", "disk")."""

    hit: int
    tiers: tuple[str, ...]


class WorkerStore:
    """A KVStore of whole vLLM blocks (all layers of one worker), with request leases.

    ``layers`` are this worker's per-layer row arrays (uint8 views, one row per vLLM block);
    row ``b`` of every array together is block ``b``'s bytes (``key_bytes`` in all).
    """

    def __init__(
        self,
        layers: Sequence[torch.Tensor],
        *,
        host_blocks: int,
        disk_dir: str | None = None,
        disk_blocks: int = 0,
        namespace: str | None = None,
        fingerprint: str = "",
        lease_s: float = 60.0,
        prefault: bool = True,
        put_wait_s: float = 5.0,
        store_nodes: Sequence[str] = (),
        auth_secret_file: str | None = None,
        replicas: int = 1,
        store_timeout_s: float = 2.0,
        write_through: bool = True,
        key_salt: bytes = b"",
        events: bool = False,
    ) -> None:
        if not layers:
            raise tc.InvalidArgumentError("no KV layers to store")
        self.bind(layers)
        self.row_bytes = int(self.layers[0].shape[1])
        self.key_bytes = self.row_bytes * len(self.layers)
        self.store_nodes = list(store_nodes)
        self.key_salt = bytes(key_salt) if self.store_nodes else b""
        self.store = tc.KVStore(
            self.key_bytes,
            host_blocks,
            disk_dir=disk_dir,
            disk_blocks=disk_blocks,
            namespace=namespace,
            fingerprint=fingerprint,
            prefault=prefault,
            put_wait_s=put_wait_s,
            remote=self.store_nodes or None,
            auth_secret_file=auth_secret_file,
            replicas=replicas,
            remote_timeout=store_timeout_s,
            lease_s=min(lease_s, 60.0),
            write_through=write_through and bool(self.store_nodes),
        )
        if events:
            self.store.enable_events()
        self.lease_s = lease_s
        self._health_at = 0.0
        self._health_seen = (0, 0, 0)
        if self.store_nodes:
            self._probe_nodes(auth_secret_file, replicas, store_timeout_s)
        self._staging = np.empty((0, self.key_bytes), dtype=np.uint8)
        self._lock = threading.Lock()  # leases (lookup thread vs. the worker's step thread)
        self._leases: dict[str, tuple[list[bytes], float]] = {}
        self.lookup_seconds = 0.0  # spent answering lookups (never reset; for the benchmark)

    def bind(self, layers: Sequence[torch.Tensor]) -> None:
        """Use ``layers`` as vLLM's row arrays from now on (same geometry)."""
        self.layers = list(layers)
        # numpy views of the same memory: numpy's row gather/scatter is a memcpy per row, where
        # torch's index_select / index_copy_ on uint8 measured ~60x slower (2 vCPUs, 8 MiB).
        self._np = [np.asarray(t) for t in self.layers]

    # ---------------------------------------------------------------- lookups and leases

    def lookup(self, req_id: str, keys: Sequence[bytes], pin_above: int = 0) -> LookupResult:
        """Leading stored run of ``keys``; when it is longer than ``pin_above`` blocks, pin it
        under ``req_id`` (replacing that request's earlier lease)."""
        t0 = time.perf_counter()
        try:
            return self._lookup(req_id, keys, pin_above)
        finally:
            self.lookup_seconds += time.perf_counter() - t0

    def _lookup(self, req_id: str, keys: Sequence[bytes], pin_above: int) -> LookupResult:
        with self._lock:
            self._expire_locked()
            self._release_locked(req_id)
            if not keys:
                return LookupResult(0, ())
            keys = self._salted(keys)
            n, tiers = self.store.lookup(keys)
            if n > pin_above:
                try:
                    self.store.pin(keys[:n])
                except tc.NotFoundError:  # evicted between lookup and pin: report a miss
                    return LookupResult(0, ())
                self._leases[req_id] = (list(keys[:n]), time.monotonic() + self.lease_s)
            return LookupResult(n, tuple(tiers[:n]))

    def release(self, req_ids: Sequence[str]) -> None:
        """End the leases of ``req_ids`` (unknown ids are ignored)."""
        with self._lock:
            for r in req_ids:
                self._release_locked(r)

    def _release_locked(self, req_id: str) -> None:
        lease = self._leases.pop(req_id, None)
        if lease is not None:
            try:
                self.store.unpin(lease[0])
            except tc.TpusyncError as exc:  # cleared meanwhile: nothing left pinned
                log.debug("tpusync: unpin of %s: %s", req_id, exc)

    def _expire_locked(self) -> None:
        now = time.monotonic()
        for r in [r for r, (_, t) in self._leases.items() if t < now]:
            log.warning("tpusync: lease of request %s expired (scheduler never released it)", r)
            self._release_locked(r)

    @property
    def num_pins(self) -> int:
        """Keys pinned by live leases (0 when no request is in flight)."""
        with self._lock:
            return sum(len(k) for k, _ in self._leases.values())

    @property
    def leases(self) -> list[str]:
        with self._lock:
            return sorted(self._leases)

    # ---------------------------------------------------------------- bytes

    def abandon_staging(self) -> None:
        """A load that timed out still owns the staging buffer: later copies use a new one."""
        self._staging = np.empty((0, self.key_bytes), dtype=np.uint8)

    def _wait(self, fut: Any, timeout: float) -> np.ndarray:
        """``fut.mask(timeout)``. STAGING RULE: a wait that raised (a timeout, a closed store)
        leaves the native put / get still reading or writing the staging buffer, so the buffer
        is abandoned first: the next save or load stages into a new one. (Reused, a late get
        wrote the blocks of an earlier load into a later save's rows, which were then stored
        under the later keys.)"""
        try:
            return fut.mask(timeout)
        except BaseException:
            self.abandon_staging()
            raise

    def _stage(self, n: int) -> np.ndarray:
        if self._staging.shape[0] < n:
            self._staging = np.empty(
                (max(n, 2 * self._staging.shape[0]), self.key_bytes), dtype=np.uint8
            )
        return self._staging[:n]

    def save(self, keys: Sequence[bytes], block_ids: Sequence[int], timeout: float) -> int:
        """Store vLLM blocks ``block_ids[i]`` under ``keys[i]``; returns how many are stored
        afterwards (keys already stored count, without a copy). Waits: vLLM reuses the blocks."""
        if not keys:
            return 0
        keys = self._salted(keys)
        stage = self._stage(len(keys))
        idx = np.asarray(block_ids, dtype=np.int64)
        rb = self.row_bytes
        for j, arr in enumerate(self._np):
            stage[:, j * rb : (j + 1) * rb] = arr[idx]
        return int(np.count_nonzero(self._wait(self.store.put(keys, stage), timeout)))

    def load(self, keys: Sequence[bytes], block_ids: Sequence[int], timeout: float) -> list[int]:
        """Read ``keys[i]`` into vLLM block ``block_ids[i]``; returns the block ids whose key was
        not found or failed verification (their bytes in vLLM are left as they were)."""
        if not keys:
            return []
        keys = self._salted(keys)
        stage = self._stage(len(keys))
        found = self._wait(self.store.get(keys, stage), timeout).astype(bool)
        ids = np.asarray(block_ids, dtype=np.int64)
        return self._scatter(stage, found, ids, [list(range(len(self._np)))])

    def _scatter(self, stage, found, ids, groups, landed=None) -> list[int]:
        """Copy the found rows of ``stage`` into vLLM blocks ``ids``, row arrays group by group
        (``landed(g)`` after group ``g``); returns the block ids that were not found."""
        src = stage if found.all() else stage[found]
        dst = ids if found.all() else ids[found]
        rb = self.row_bytes
        for g, group in enumerate(groups):
            for j in group:
                self._np[j][dst] = src[:, j * rb : (j + 1) * rb]
            if landed is not None:
                landed(g)
        return [int(b) for b in ids[~found]]

    def start_load(
        self,
        keys: Sequence[bytes],
        block_ids: Sequence[int],
        timeout: float,
        layer_groups: Sequence[Sequence[int]] | None = None,
        release: Sequence[str] = (),
    ) -> LayeredLoad:
        """:meth:`load`, layer-pipelined: returns at once; a background thread waits for the
        store's ``get`` and scatters the rows of ``layer_groups[0]`` (indices into the row
        arrays; default: one group per array), then of group 1, ... signalling each group as it
        lands, so that vLLM computes layer 0 while later layers are still being copied. The
        leases of ``release`` end once the ``get`` completed. PIPELINE CONTRACT: the staging
        buffer belongs to the load until :meth:`LayeredLoad.finish` returned; the caller
        finishes every load before the next :meth:`save` / :meth:`start_load` (rejected
        alternative: one store key per layer - it multiplies the index, the pins and the
        lookups by the layer count for a copy that is a memcpy per block either way)."""
        groups = [list(g) for g in (layer_groups or [[j] for j in range(len(self._np))])]
        load = LayeredLoad(len(groups), timeout)
        if not keys:
            self.release(release)
            load._complete([], 0.0)
            return load
        salted = self._salted(keys)
        stage = self._stage(len(salted))
        t0 = time.perf_counter()
        fut = self.store.get(salted, stage)
        ids = np.asarray(block_ids, dtype=np.int64)

        def run() -> None:
            failed: list[int] = []
            try:
                try:
                    found = self._wait(fut, timeout).astype(bool)
                finally:
                    self.release(release)  # the bytes are in the staging buffer: lease over
                failed = self._scatter(stage, found, ids, groups, load._layer_ready)
            except Exception as exc:  # noqa: BLE001 - reported as load errors, never raised here
                log.warning("tpusync: layered load of %d blocks failed: %s", len(keys), exc)
                load.error = exc
                failed = [int(b) for b in ids]
            load._complete(failed, time.perf_counter() - t0)

        threading.Thread(target=run, name="tpusync-load", daemon=True).start()
        return load

    def _salted(self, keys: Sequence[bytes]) -> list[bytes]:
        salt = self.key_salt
        return [bytes(k) + salt for k in keys] if salt else list(keys)

    def plain_key(self, key: bytes) -> bytes:
        """The vLLM block hash of a store key (the SHARED KEY CONTRACT's salt removed)."""
        return key[: len(key) - len(self.key_salt)] if self.key_salt else key

    def take_events(self) -> tuple[list[tuple[str, str, bytes]], int]:
        """The store's placement changes since the last call, as ``(kind, tier, block hash)``,
        and the number lost to the queue bound (enable with ``events=True``)."""
        raw, dropped = self.store.take_events()
        if self.key_salt:
            raw = [(kind, tier, self.plain_key(k)) for kind, tier, k in raw]
        return raw, dropped

    def _probe_nodes(self, secret_file: str | None, replicas: int, timeout: float) -> None:
        """One lookup on the nodes at start, so that a wrong address or secret is a clear log
        line now, not a silent miss rate later. Never fatal: the local tiers serve regardless."""
        from tpusync.core.store_node import StoreClient

        try:
            pool = tc.HostBlockPool(self.key_bytes, 1)
            client = StoreClient(
                pool, self.store_nodes, replication=replicas, secret_file=secret_file,
                timeout=timeout,
            )  # fmt: skip
            client.lookup_prefix(["tpusync-probe"])
            log.info("tpusync: store nodes %s answer", ",".join(self.store_nodes))
        except (tc.TpusyncError, ValueError, TypeError) as exc:
            log.warning(
                "tpusync: store nodes %s do not answer (%s); serving from the local tiers, "
                "blocks are recomputed instead of shared until a node is back",
                ",".join(self.store_nodes),
                exc,
            )

    def check_remote(self, every_s: float = 10.0) -> None:
        """Log (at most every ``every_s``) when remote reads or write-through copies failed since
        the last check: the requests still complete (local tiers or recompute)."""
        if not self.store_nodes:
            return
        now = time.monotonic()
        if now < self._health_at:
            return
        self._health_at = now + every_s
        st = self.store.stats()
        remote = st["tiers"].get("remote", {})
        seen = (
            int(remote.get("read_errors", 0)),
            int(st.get("write_through_errors", 0)),
            int(st.get("write_through_dropped", 0)),
        )
        old, self._health_seen = self._health_seen, seen
        if seen != old and (seen[0] > old[0] or seen[1] > old[1]):
            log.warning(
                "tpusync: store nodes %s failing: %d remote read errors, %d write-through "
                "errors, %d copies skipped so far (requests complete from local tiers or recompute)",
                ",".join(self.store_nodes),
                *seen,
            )

    def flush(self, timeout: float = 60.0) -> None:
        self.store.flush(timeout)

    def reset(self) -> None:
        """RESET CONTRACT: forget every stored block (vLLM's ``reset_prefix_cache(
        reset_connector=True)``, e.g. after a weight update: blocks computed with the old weights
        must never load again). Ends every lease and clears the store (``KVStore.clear``: the
        local tiers, and, best effort, the node copies of the blocks this worker placed). Store
        nodes are shared, so other instances may hold more blocks there under the same key salt:
        this worker switches to a fresh random salt, so it never reads a block stored before the
        reset, at the cost of no longer sharing blocks with instances that did not reset with it.
        A load in flight fails its blocks (load errors: vLLM recomputes)."""
        with self._lock:
            self._leases.clear()  # clear() drops their pins
            self.store.clear()
            if self.key_salt:
                self.key_salt = hashlib.blake2b(
                    self.key_salt + os.urandom(16), digest_size=len(self.key_salt)
                ).digest()

    def stats(self) -> dict[str, Any]:
        return self.store.stats()

    def close(self) -> None:
        with self._lock:
            for r in list(self._leases):
                self._release_locked(r)
        self.store.close()


class LayeredLoad:
    """A layer-pipelined load in flight (:meth:`WorkerStore.start_load`).

    :meth:`wait_layer` returns once that layer group's rows are in vLLM's blocks (or the load
    ended); :meth:`finish` waits for all of it and returns the block ids that did not load. Every
    wait has the load's timeout; a load that timed out reports all its blocks failed.
    """

    def __init__(self, groups: int, timeout: float) -> None:
        self.timeout = timeout
        self.error: BaseException | None = None
        self.load_seconds = 0.0  # get + scatter, measured by the loading thread
        self._ready = [threading.Event() for _ in range(groups)]
        self._done = threading.Event()
        self._failed: list[int] = []

    def _layer_ready(self, group: int) -> None:
        self._ready[group].set()

    def _complete(self, failed: list[int], seconds: float) -> None:
        self._failed = failed
        self.load_seconds = seconds
        for e in self._ready:
            e.set()
        self._done.set()

    def wait_layer(self, group: int) -> bool:
        """Wait until layer group ``group`` landed; False when the wait timed out."""
        return self._ready[group].wait(self.timeout)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def finish(self) -> tuple[list[int], bool]:
        """(block ids not loaded, whether the load completed in time). A load that did not
        complete keeps the staging buffer's thread running: the caller reports every block
        failed and must not reuse the buffer until ``done``."""
        if not self._done.wait(self.timeout):
            return [], False
        return list(self._failed), True


def _identity_digest(parts: dict[str, Any]) -> bytes:
    h = hashlib.sha256()
    for k in sorted(parts):
        h.update(f"{k}={parts[k]!r};".encode())
    return h.digest()


def model_fingerprint(**parts: Any) -> str:
    """A short digest of everything that decides a block's bytes (model, dtype, layout, rank):
    the local tiers' fingerprint (warm restart re-attaches only an equal one)."""
    return _identity_digest(parts).hex()[:32]


def share_salt(**parts: Any) -> bytes:
    """16 bytes naming what decides a block's bytes (SHARED KEY CONTRACT): the key salt."""
    return _identity_digest(parts)[:16]


class LookupServer:
    """Answers the scheduler's lookups for one WorkerStore on a ZeroMQ REP socket (a thread).

    Wire: request ``msgpack([op, req_id, keys, pin_above])`` with op ``"lookup"``, ``"release"``
    (keys = request ids), ``"reset"`` or ``"info"``; reply ``msgpack([hit, tiers])``,
    ``[0, info]`` or ``[-1, error]``. Without a store (P/D roles) every lookup is a miss.
    """

    def __init__(
        self, store: WorkerStore | None, endpoint: str, info: dict[str, Any] | None = None
    ) -> None:
        self.store = store
        self.info = dict(info or {})
        self.endpoint = endpoint
        path = endpoint.removeprefix("ipc://")
        if os.path.exists(path):
            if _answers(path):  # SOCKET NAME RULE: never take a live engine's socket
                raise tc.StateError(
                    f"lookup socket {path} is served by another live process (an engine with the "
                    "same engine id and rank); give each engine its own engine_id"
                )
            os.unlink(path)  # a stale socket of a dead process with the same engine id
        self._path = path if endpoint.startswith("ipc://") else None
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="tpusync-lookup", daemon=True)
        self._thread.start()
        with _LOCAL_LOCK:
            _LOCAL[endpoint] = self

    def handle(self, msg: list[Any]) -> list[Any]:
        op, req_id, keys, pin_above = msg
        if op == "info":
            return [0, self.info]
        if op == "release":
            if self.store is not None:
                self.store.release(keys)
            return [0, []]
        if op == "reset":
            if self.store is not None:
                self.store.reset()
            return [0, []]
        if op == "lookup":
            if self.store is None:
                return [0, []]
            r = self.store.lookup(req_id, keys, pin_above)
            return [r.hit, list(r.tiers)]
        return [-1, f"unknown op {op!r}"]

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(200):
                continue
            raw = self._sock.recv()
            try:
                reply = self.handle(msgpack.unpackb(raw))
            except Exception as exc:  # noqa: BLE001 - a bad request must not stop the server
                reply = [-1, f"{type(exc).__name__}: {exc}"]
            self._sock.send(msgpack.packb(reply))

    def close(self) -> None:
        with _LOCAL_LOCK:
            _LOCAL.pop(self.endpoint, None)
        self._stop.set()
        self._thread.join(5)
        self._sock.close(0)
        if self._path is not None:
            try:
                os.unlink(self._path)  # the socket file (left behind, /tmp filled with them)
            except OSError:
                pass


class LookupClient:
    """The scheduler's handle on the worker stores of ``endpoints`` (one per rank).

    A hit is the shortest leading run over all ranks (every rank must hold its shard). A worker
    that does not answer within ``timeout_s`` counts as a miss (logged), never as an error.
    """

    def __init__(self, endpoints: Sequence[str], timeout_s: float = 5.0) -> None:
        self.endpoints = list(endpoints)
        self.timeout_ms = int(timeout_s * 1000)
        self._socks: dict[str, zmq.Socket] = {}
        # The REQ sockets are used by one thread at a time (the connector's lookup thread and the
        # scheduler thread may both call): a socket mid-request must not see a second send.
        self._lock = threading.Lock()

    def _call(self, endpoint: str, msg: list[Any]) -> list[Any] | None:
        with self._lock:
            return self._call_locked(endpoint, msg)

    def _call_locked(self, endpoint: str, msg: list[Any]) -> list[Any] | None:
        with _LOCAL_LOCK:
            local = _LOCAL.get(endpoint)
        if local is not None:
            return local.handle(msg)
        sock = self._socks.get(endpoint)
        if sock is None:
            sock = zmq.Context.instance().socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            self._socks[endpoint] = sock
        sock.send(msgpack.packb(msg))
        if not sock.poll(self.timeout_ms):
            log.warning("tpusync: worker %s did not answer in %d ms", endpoint, self.timeout_ms)
            sock.close(0)  # a REQ socket without its reply is stuck: start over next time
            del self._socks[endpoint]
            return None
        reply = msgpack.unpackb(sock.recv())
        if reply[0] < 0:
            log.warning("tpusync: worker %s refused %s: %s", endpoint, msg[0], reply[1])
            return None
        return reply

    def lookup(self, req_id: str, keys: Sequence[bytes], pin_above: int = 0) -> LookupResult:
        hit, tiers = len(keys), [""] * len(keys)
        for ep in self.endpoints:
            reply = self._call(ep, ["lookup", req_id, list(keys), pin_above])
            if reply is None:
                hit = 0
                break
            hit = min(hit, reply[0])
            for i, t in enumerate(reply[1][:hit]):
                if _SLOWNESS.get(t, 0) >= _SLOWNESS.get(tiers[i], -1):
                    tiers[i] = t  # the slowest rank decides
        if hit <= pin_above:
            self.release([req_id])
        return LookupResult(hit, tuple(tiers[:hit]))

    def release(self, req_ids: Sequence[str]) -> None:
        if req_ids:
            for ep in self.endpoints:
                self._call(ep, ["release", "", list(req_ids), 0])

    def reset(self) -> bool:
        """Every worker forgets its blocks (RESET CONTRACT); False when one did not answer."""
        # A list, not a generator: every worker is asked, also after one failed to answer.
        return all([self._call(ep, ["reset", "", [], 0]) is not None for ep in self.endpoints])

    def info(self, rank: int = 0) -> dict[str, Any]:
        """What the worker of ``rank`` publishes (e.g. its P/D address); {} if it is silent."""
        reply = self._call(self.endpoints[rank], ["info", "", [], 0])
        return dict(reply[1]) if reply is not None else {}

    def close(self) -> None:
        for s in self._socks.values():
            s.close(0)
        self._socks.clear()
