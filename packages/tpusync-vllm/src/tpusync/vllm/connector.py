"""TpusyncConnector: vLLM KV connector (v1 API) for host/disk offload and prefix reuse.

Role ``kv_both``: every full KV block a request computes is stored in tpusync's tiered KVStore
(host DRAM, optionally in /dev/shm for warm restart, and an optional disk tier), keyed by vLLM's
own ``request.block_hashes``; a later request - in this process or in a restarted one - whose
prefix blocks are stored loads them instead of recomputing.

DATA FLOW (store.py has the SPLIT and LEASE contracts). The WORKER owns the store; the SCHEDULER
asks it (direct call in vLLM's in-process engine, else a Unix-socket round trip):

1. ``get_num_new_matched_tokens`` looks the request's block hashes up in the worker's store; a hit
   that beats vLLM's own prefix cache is pinned under the request id (a lease).
2. ``update_state_after_alloc`` queues a load of (keys -> vLLM block ids); ``build_connector_meta``
   adds saves of newly full blocks.
3. The worker runs the step's loads in ``start_load_kv`` (before the forward; then it ends the
   lease) and its saves in ``wait_for_save`` (after every layer wrote its KV; it waits before the
   step ends, so vLLM may reuse the blocks). A put of a stored key copies nothing.
4. A block that is missing or fails its checksum (disk) is reported through
   ``get_block_ids_with_load_errors``; vLLM recomputes or fails the request per
   ``kv_load_failure_policy``, and the scheduler plans the recomputed blocks' saves again.
5. ``request_finished`` (also on abort and failure) ends the request's lease.

Loads and saves are synchronous per step (no ``finished_recving``/``finished_sending``).

With ``store_nodes``, the store's last tier is a set of ``tpusync store-node`` processes shared by
several vLLM instances: every save is written through to them (asynchronously, after the local
put), and a lookup that ends early in the local tiers continues on the nodes, so a prefix that
another instance computed loads from the nodes (SHARED KEY CONTRACT in store.py).

EVENT CONTRACT (KV events for llm-d). The worker's store records every placement change (put,
write-back demotion host -> disk, write-through to the nodes, promotion, LRU drop, corruption,
clear); the worker hands them to vLLM with each step's output
(``get_kv_connector_kv_cache_events``), and the scheduler's ``take_events`` returns them as vLLM's
BlockStored / BlockRemoved with ``medium`` CPU, DISK or REMOTE, keyed by vLLM's block hashes
(AllBlocksCleared when the store was cleared or its event queue overflowed). BlockStored carries
the blocks' token ids and parent hash when the scheduler planned that save itself (the usual
case); blocks it never planned (e.g. re-attached after a restart) are announced without tokens.
With tensor or pipeline parallelism an event is announced once every worker reported it (a
block is in a tier only when every rank's part is). Events of work the store does between steps
reach vLLM with the next step.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import logging
import os
import time
from array import array
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

import tpusync.core as tc
from tpusync.core import events as tev
from tpusync.vllm.config import ConfigError, TpusyncVllmConfig
from tpusync.vllm.pd import PdWorker, head_plan, rank_heads, spare_replica, transfer_id_for
from tpusync.vllm.store import (
    LayeredLoad,
    LookupClient,
    LookupResult,
    LookupServer,
    WorkerStore,
    lookup_endpoint,
    model_fingerprint,
    share_salt,
)
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["TpusyncConnector", "TpusyncKVEvents", "TpusyncMetadata", "TpusyncStats", "Transfer"]

log = logging.getLogger("tpusync.vllm")

# What a bad transfer can raise (tpusync errors; nanobind's TypeError for a wrong array): caught
# per transfer and reported as a load error / failed save, never propagated into vLLM's step.
_TRANSFER_ERRORS = (tc.TpusyncError, TypeError, ValueError)


@dataclass
class Transfer:
    """One request's blocks to move: store key ``keys[i]`` <-> vLLM block ``block_ids[i]``."""

    req_id: str
    keys: list[bytes]
    block_ids: list[int]
    first_block: int = 0  # index of keys[0] in the request's block_hashes


@dataclass
class TpusyncMetadata(KVConnectorMetadata):
    """The scheduler's decisions for one step (pickled to the workers)."""

    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)
    pd_sends: list[PdSend] = field(default_factory=list)  # kv_producer
    pd_recvs: list[PdRecv] = field(default_factory=list)  # kv_consumer


@dataclass
class PdSend:
    """Producer: offer vLLM blocks ``block_ids`` (a finished prefill) under ``transfer_id``."""

    req_id: str
    transfer_id: int
    block_ids: list[int]


@dataclass
class PdRecv:
    """Consumer: pull ``len(block_ids)`` blocks of ``transfer_id`` into ``block_ids`` (-1
    entries: computed locally already, dropped on arrival); worker rank ``r`` pulls from the
    producer's rank ``r``, ``peers[r]`` (PER-RANK P/D CONTRACT), or, from a producer of another
    tensor size, from the ranks holding its heads (HEAD RESHARD CONTRACT, pd.py)."""

    req_id: str
    transfer_id: int
    # Per producer rank: (TCP "host:port", "unix:PATH" of the same-host path or "", host id).
    peers: list[tuple[str, str, str]]
    block_ids: list[int]
    layout: list[int]  # the producer's [tensor, pipeline] (HEAD RESHARD CONTRACT when not ours)
    # Per producer rank, the model layer of each row of its blocks (LAYER PLAN CONTRACT, pd.py);
    # None from a producer that did not say (older, or layer names without one index).
    rank_layers: list[list[int]] | None = None
    # Per consumer pipeline stage, the model layer of each row (LAYER PLAN CONTRACT); set when
    # the producer's pipeline size differs from this instance's.
    stage_rows: list[list[int]] | None = None


_WORKER_COUNTERS = (
    "loaded_blocks",
    "saved_blocks",
    "load_failures",
    "save_failures",
    "load_seconds",  # store get + copies into vLLM's blocks (on the loading thread if layered)
    "save_seconds",
    "load_issue_seconds",  # start_load_kv's own time (the forward waits for it)
    "layered_loads",  # steps whose loads ran layer-pipelined
    "layer_waits",  # wait_for_layer_load calls during a layered load
    "layer_wait_seconds",  # time the forward spent blocked in them
    "pd_shm_blocks",  # P/D blocks pulled over the same-host /dev/shm path (not TCP)
    "pd_abandoned",  # P/D receives dropped because their request finished (ABANDON CONTRACT)
)


@dataclass
class TpusyncStats(KVConnectorStats):
    """Worker-side transfer counters for one logging interval (summed across workers)."""

    def __post_init__(self) -> None:
        for k in _WORKER_COUNTERS:
            self.data.setdefault(k, 0)

    def reset(self) -> None:
        self.data = dict.fromkeys(_WORKER_COUNTERS, 0)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in _WORKER_COUNTERS)


class TpusyncKVEvents(KVConnectorKVEvents):
    """One step's store events of the workers, one event per block (vLLM's output aggregator
    concatenates the workers' lists and counts the workers; the scheduler matches them up)."""

    def __init__(self, events: list[KVCacheEvent] | None = None, num_workers: int = 1) -> None:
        self._events: list[KVCacheEvent] = list(events or [])
        self._workers = num_workers

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._events.extend(events)

    def aggregate(self) -> TpusyncKVEvents:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return list(self._events)

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._events = []


# The medium each store tier is announced with (tpusync.core.events.TIER_MEDIUM).
_MEDIUM = tev.TIER_MEDIUM
# Block hashes whose tokens the scheduler remembers for BlockStored events (4 bytes per token).
_PLANNED_BLOCKS = 1 << 14
# Per-block events of some but not all workers kept for matching (beyond: dropped, logged).
_PENDING_EVENTS = 1 << 16


def _key_geometry(kv_cache_config: KVCacheConfig) -> tuple[int, int]:
    """(bytes of one block across all layers of this worker, number of layers).

    ONE GROUP CONTRACT: a store key holds one token block of every layer, so the connector
    needs every layer in one KV cache group with one block table. It does not implement vLLM's
    ``SupportsHMA``, so vLLM turns its hybrid KV cache manager off and gives a hybrid model
    (sliding-window layers next to full-attention ones: Gemma 2 / 3, gpt-oss, ...) one group in
    which the sliding-window layers keep the whole context (vLLM's warning says so at start; the
    attention computed is unchanged). Rejected: per-group keys with the window's blocks only
    (what HMA would allow: less KV memory for those layers, but a hit then needs different block
    runs per group). Several groups reach this point only where HMA was forced on or a model has
    state layers (Mamba), which vLLM itself refuses without HMA.
    """
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConfigError(
            f"TpusyncConnector supports one KV cache group; this model has {len(groups)} "
            f"(vLLM's hybrid KV cache manager is on: leave --disable-hybrid-kv-cache-manager "
            f"unset or set it; models with Mamba / state layers are not supported)"
        )
    spec = groups[0].kv_cache_spec
    return int(spec.page_size_bytes) * len(groups[0].layer_names), len(groups[0].layer_names)


def dp_endpoint(endpoint: str, dp_rank: int) -> str:
    """The KV-event endpoint of data-parallel rank ``dp_rank`` (DP RULE): a TCP port plus the
    rank (port 0 stays 0: the OS picks), an ipc path or inproc name with ``_dp<rank>``; rank 0
    keeps the endpoint as configured."""
    if dp_rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        if port.isdigit():
            return endpoint if int(port) == 0 else f"{base}:{int(port) + dp_rank}"
    return f"{endpoint}_dp{dp_rank}"


def _tokens_digest(tokens: Any, count: int) -> str:
    """A digest of the first ``count`` prompt tokens (P/D IDENTITY RULE): the producer's and the
    consumer's must agree before a consumer takes the producer's KV for its prompt."""
    head = list(tokens[:count]) if tokens is not None else []
    return hashlib.blake2b(array("q", head).tobytes(), digest_size=16).hexdigest()


class TpusyncConnector(KVConnectorBase_V1):
    """Host-tier KV offload and prefix reuse for vLLM (see the module docstring)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        if ktc.kv_role not in ("kv_both", "kv_producer", "kv_consumer"):
            raise ConfigError(f"unknown kv_role {ktc.kv_role!r}")
        # kv_both: offload + prefix reuse through the store; kv_producer / kv_consumer: P/D.
        self.kv_role = str(ktc.kv_role)
        self.config = TpusyncVllmConfig.from_extra(ktc.kv_connector_extra_config)
        self.block_size = vllm_config.cache_config.block_size
        self.key_bytes, self.num_layers = _key_geometry(kv_cache_config)
        self.host_blocks = self.config.host_bytes // self.key_bytes
        if self.host_blocks < 1:
            raise ConfigError(
                f"host_bytes={self.config.host_bytes} cannot hold one block of "
                f"{self.key_bytes} bytes (all layers)"
            )
        self.disk_blocks = self.config.disk_bytes // self.key_bytes
        model = vllm_config.model_config.served_model_name or vllm_config.model_config.model
        self.model_name = str(model).replace("@", "_")
        pc = vllm_config.parallel_config
        self.world_size = pc.world_size
        # RANK CONTRACT: worker r (vLLM's world rank: pipeline stage x tensor rank) stores only
        # what it holds - its stage's layers, its heads - under the plain block hashes; a hit is
        # the run every rank holds. P/D pairs rank r with rank r of a producer of this layout,
        # and reshards the heads from one of another tensor size (HEAD RESHARD CONTRACT, pd.py).
        self.layout = [int(pc.tensor_parallel_size), int(pc.pipeline_parallel_size)]
        self._total_kv_heads = _total_kv_heads(vllm_config)
        # REPLICA RULE (pd.py): with more tensor ranks than kv heads, only the first rank holding
        # a head offers it for P/D, and every consumer pulls it from that rank (a head plan, even
        # from a producer of this very layout).
        self._replicated = 0 < self._total_kv_heads < self.layout[0]
        self._spare = False  # this worker holds another rank's heads (set in register_kv_caches)
        # One lookup socket per (engine, data-parallel rank, worker rank).
        self._engine_key = f"{ktc.engine_id}-dp{pc.data_parallel_rank}"
        # Scheduler side.
        self.client: LookupClient | None = None
        self._requests: dict[str, Request] = {}
        self._saved_upto: dict[str, int] = {}
        self._lookups: dict[str, tuple[int, int, tuple[str, ...]]] = {}
        self._leased: set[str] = set()
        # ASYNC LOOKUP CONTRACT (store_nodes only): a lookup that may go to the store nodes runs
        # on one lookup thread; get_num_new_matched_tokens waits lookup_wait_ms for it, else
        # answers None (vLLM asks again on a later step) and keeps the future here. Lookups and
        # lease releases of that mode run on the same thread, in submission order, so a release
        # always follows the lookup whose lease it ends (a request finished with its lookup in
        # flight gets its release queued behind it). Local-only stores answer synchronously: an
        # in-process or same-host lookup costs microseconds, a thread hop would cost more.
        self._lookup_pool: cf.ThreadPoolExecutor | None = None
        self._inflight: dict[str, tuple[cf.Future, int]] = {}
        self._pending_loads: list[Transfer] = []
        # block id -> (req, block index, key) of the loads of the last two steps (two: with async
        # scheduling, step N+1's metadata is built before step N's output arrives).
        self._load_history: deque[dict[int, tuple[str, int, bytes]]] = deque(maxlen=2)
        # KV events: block hash -> (parent hash, token ids) of saves this scheduler planned, and
        # the per-block events the workers reported that are not announced yet.
        self._planned: OrderedDict[Any, tuple[Any, array]] = OrderedDict()
        self._worker_events: list[KVCacheEvent] = []
        self._pending_events: Counter[KVCacheEvent] = Counter()
        self._pd_lookups: dict[str, tuple[dict[str, Any], int]] = {}
        self._pd_pending_recvs: list[PdRecv] = []
        self._pd_published: dict[str, tuple[int, list[int]]] = {}
        # Requests that already pulled (or tried to): a second lookup - after a failed pull or a
        # preemption - computes locally instead of pulling again (no retry loop).
        self._pd_tried: set[str] = set()
        self._pd_address: str | None = None
        self._pd_ranks: list[list[str]] = []  # per producer rank: [TCP, unix, host id]
        self._pd_rank_layers: list[list[int]] | None = None  # LAYER PLAN CONTRACT (pd.py)
        self._my_rows: list[list[int]] | None = None  # per stage, for the consumer's layer plan
        self._pd_same_host: dict[str, str] = {}
        self._kv_identity_text: str | None = None
        self.stats: dict[str, int] = {
            "pd_sent_blocks": 0,
            "pd_recv_blocks": 0,
            "queries": 0,
            "hit_blocks": 0,
            "disk_hit_blocks": 0,
            "remote_hit_blocks": 0,
            "hit_tokens": 0,
            "planned_saves": 0,
            "load_errors_seen": 0,
            "lookups_deferred": 0,
        }
        self._publisher: tev.KVEventPublisher | None = None
        # Worker side.
        self._rank = 0  # this worker's rank in vLLM's world group (register_kv_caches)
        self.store: WorkerStore | None = None
        self.pd: PdWorker | None = None
        self._pd_failed: dict[str, list[int]] = {}
        self._server: LookupServer | None = None
        self._row_arrays: list[torch.Tensor] = []
        self._row_layers: list[int] | None = None  # the model layer of each row (LAYER PLAN)
        # Layer-pipelined loads: layer name -> index of its group of row arrays (K, V).
        self._layer_index: dict[str, int] = {}
        self._layer_groups: list[list[int]] = []
        self._load: LayeredLoad | None = None
        self._load_transfers: list[Transfer] = []
        self._layers_waited: set[int] = set()
        self._layers_late: set[int] = set()  # waits that timed out: the forward read them unloaded
        self._load_errors: set[int] = set()
        self._worker_stats = TpusyncStats()
        self.totals = TpusyncStats()  # never reset: for diagnostics and tests
        kec = getattr(vllm_config, "kv_events_config", None)
        self._events_wanted = bool(
            self.config.kv_events_endpoint or (kec is not None and kec.enable_kv_cache_events)
        )
        self._metrics_server: Any = None
        if role == KVConnectorRole.SCHEDULER:
            self.client = LookupClient(
                [lookup_endpoint(self._engine_key, r) for r in range(self.world_size)],
                timeout_s=self.config.lookup_timeout_s,
            )
            if self.config.store_nodes and self.kv_role == "kv_both":
                self._lookup_pool = cf.ThreadPoolExecutor(1, thread_name_prefix="tpusync-lookup")
            if self.config.kv_events_endpoint:
                # DP RULE: each data-parallel engine publishes on its own endpoint (the port
                # offset by its DP rank, as vLLM's own publisher does) and names its rank.
                dp = int(getattr(vllm_config.parallel_config, "data_parallel_rank", 0) or 0)
                self._publisher = tev.KVEventPublisher(
                    dp_endpoint(self.config.kv_events_endpoint, dp),
                    pod_id=self.config.resolved_pod_id(),
                    model=self.model_name,
                    dp_rank=dp,
                    encoding=self.config.kv_events_encoding,  # type: ignore[arg-type]
                )
        log.info(
            "TpusyncConnector(%s): host tier %d blocks, disk tier %d blocks, x %d bytes "
            "(%d layers)",
            role.name,
            self.host_blocks,
            self.disk_blocks,
            self.key_bytes,
            self.num_layers,
        )

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self.client is not None
        self.stats["queries"] += 1
        if self.kv_role != "kv_both":
            return self._pd_matched(request, num_computed_tokens)
        # Never claim the whole prompt: vLLM must compute at least one token to sample from.
        max_blocks = max(0, (request.num_tokens - 1) // self.block_size)
        keys = list(request.block_hashes[:max_blocks])
        local_blocks = num_computed_tokens // self.block_size
        # The only side effect: a hit longer than vLLM's own is leased (pinned) for the load.
        answer = self._lookup(request.request_id, keys, local_blocks)
        if answer is None:
            self.stats["lookups_deferred"] += 1
            return None, False
        r, pinned_above = answer
        if r.hit > pinned_above:
            self._leased.add(request.request_id)
        hit_tokens = r.hit * self.block_size
        if hit_tokens <= num_computed_tokens:
            self._lookups.pop(request.request_id, None)
            self._release(request.request_id)  # a lease taken above an older local hit
            return 0, False
        self._lookups[request.request_id] = (num_computed_tokens, r.hit, r.tiers)
        return hit_tokens - num_computed_tokens, False

    def _lookup(self, req_id: str, keys: list, local_blocks: int) -> tuple[Any, int] | None:
        """(result, pin_above it was asked with), or None while it runs (ASYNC LOOKUP CONTRACT)."""
        assert self.client is not None
        if self._lookup_pool is None:
            return self.client.lookup(req_id, keys, pin_above=local_blocks), local_blocks
        entry = self._inflight.get(req_id)
        if entry is None:
            fut = self._lookup_pool.submit(self.client.lookup, req_id, keys, local_blocks)
            entry = self._inflight[req_id] = (fut, local_blocks)
            if self.config.lookup_wait_ms <= 0:
                return None
            try:
                fut.result(timeout=self.config.lookup_wait_ms / 1000)
            except cf.TimeoutError:
                return None
            except Exception:  # noqa: BLE001 - reported below, as a miss
                pass
        elif not entry[0].done():
            return None
        fut, pinned_above = self._inflight.pop(req_id)
        try:
            return fut.result(timeout=0), pinned_above
        except Exception as e:  # noqa: BLE001 - a failed lookup is a miss, never an error
            log.warning("tpusync: lookup of %s failed (%s): treated as a miss", req_id, e)
            return LookupResult(0, ()), pinned_above

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self.client is not None
        req_id = request.request_id
        self._requests[req_id] = request
        self._saved_upto.setdefault(req_id, 0)
        pd_lookup = self._pd_lookups.pop(req_id, None)
        if pd_lookup is not None:
            pd, local_tokens = pd_lookup
            if num_external_tokens > 0:
                self._pd_tried.add(req_id)
                n = int(pd["tpusync_num_blocks"])
                local = local_tokens // self.block_size  # blocks vLLM's own cache holds
                ids = blocks.get_block_ids()[0][:n]
                self._pd_pending_recvs.append(
                    PdRecv(
                        req_id,
                        int(pd["tpusync_transfer_id"]),
                        peers := _pd_peers(pd),
                        [-1 if i < local else b for i, b in enumerate(ids)],
                        layout := _pd_layout(pd, len(peers)),
                        _pd_rank_layers(pd, len(peers)),
                        self._stage_rows() if layout[1] != self.layout[1] else None,
                    )
                )
                self.stats["pd_recv_blocks"] += n - local
            return
        lookup = self._lookups.pop(req_id, None)
        if num_external_tokens <= 0 or lookup is None:
            self._release(req_id)  # the hit is not used: end its lease now
            return
        _, hit_blocks, tiers = lookup
        end = hit_blocks
        first = max(0, (hit_blocks * self.block_size - num_external_tokens) // self.block_size)
        keys = list(request.block_hashes[first:end])
        block_ids = blocks.get_block_ids()[0][first:end]
        self._pending_loads.append(Transfer(req_id, keys, list(block_ids), first))
        self._saved_upto[req_id] = max(self._saved_upto[req_id], end)
        self.stats["hit_blocks"] += len(keys)
        self.stats["disk_hit_blocks"] += sum(1 for t in tiers[first:end] if t == "disk")
        self.stats["remote_hit_blocks"] += sum(1 for t in tiers[first:end] if t == "remote")
        self.stats["hit_tokens"] += num_external_tokens

    def _pd_matched(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        params = request.kv_transfer_params or {}
        if self.kv_role != "kv_consumer" or not params.get("do_remote_prefill"):
            return 0, False
        try:
            n = int(params["tpusync_num_blocks"])
            int(params["tpusync_transfer_id"])
            peers = _pd_peers(params)
            layout = _pd_layout(params, len(peers))
            rank_layers = _pd_rank_layers(params, len(peers))
        except (KeyError, TypeError, ValueError):
            log.warning(
                "tpusync: request %s has malformed kv_transfer_params %r; computing it locally",
                request.request_id,
                params,
            )
            return 0, False
        # PER-RANK P/D CONTRACT: rank r holds the KV of its own heads and pipeline stage's
        # layers; another tensor size is resharded by heads (HEAD RESHARD CONTRACT, heads
        # replicated on either side included: REPLICA RULE), another pipeline size by layers
        # (LAYER PLAN CONTRACT). Every worker rank must have a plan.
        if len(peers) != layout[0] * layout[1] or (
            layout != self.layout
            and any(
                head_plan(
                    self._total_kv_heads,
                    layout,
                    self.layout,
                    rank,
                    rank_layers,
                    self._stage_rows() if layout[1] != self.layout[1] else None,
                )
                is None
                for rank in range(self.world_size)
            )
        ):
            log.warning(
                "tpusync: request %s was prefilled by %d producer rank(s) of layout TP=%s x PP=%s, "
                "this instance has %d worker(s) of TP=%d x PP=%d (%d kv heads): computing it "
                "locally",
                request.request_id,
                len(peers),
                layout[0],
                layout[1],
                self.world_size,
                *self.layout,
                self._total_kv_heads,
            )
            return 0, False
        # P/D IDENTITY RULE: the producer's KV must be of this model as loaded here (dtype,
        # block size, config) and of this request's prompt; equal page sizes hid both before.
        why = None
        if params.get("tpusync_kv_identity") != self._kv_identity():
            why = "of another model, dtype, block size or KV cache dtype"
        elif params.get("tpusync_tokens") != _tokens_digest(
            request.prompt_token_ids, n * self.block_size
        ):
            why = "of another prompt"
        if why is not None:
            log.warning(
                "tpusync: request %s was prefilled with KV %s than this instance's (or by an "
                "older tpusync); computing it locally",
                request.request_id,
                why,
            )
            return 0, False
        if request.request_id in self._pd_tried:
            return 0, False
        tokens = min(n * self.block_size, max(0, request.num_tokens - 1))
        if tokens <= num_computed_tokens:
            return 0, False
        self._pd_lookups[request.request_id] = (params, num_computed_tokens)
        return tokens - num_computed_tokens, True  # asynchronous: pulled while others run

    def _stage_rows(self) -> list[list[int]] | None:
        """Per pipeline stage of this instance, the model layer of each row (LAYER PLAN CONTRACT,
        from the lookup-server info of the stage's first worker; asked once, when a producer of
        another pipeline size first shows up). None when a worker did not say."""
        if self._my_rows is None and self.client is not None:
            tp, pp = self.layout
            infos = [self.client.info(s * tp).get("pd_layers") for s in range(pp)]
            rows = [[int(x) for x in r] for r in infos if isinstance(r, list)]
            self._my_rows = rows if len(rows) == pp else []
        return self._my_rows or None

    def _release(self, req_id: str) -> None:
        if req_id in self._leased and self.client is not None:
            self._leased.discard(req_id)
            if self._lookup_pool is not None:  # after any lookup still queued (ASYNC LOOKUP)
                self._lookup_pool.submit(self.client.release, [req_id])
            else:
                self.client.release([req_id])

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = TpusyncMetadata(loads=self._pending_loads, pd_recvs=self._pd_pending_recvs)
        self._pending_loads = []
        self._pd_pending_recvs = []
        if self.kv_role == "kv_producer":
            self._plan_pd_sends(scheduler_output, meta)
            return meta
        if self.kv_role == "kv_consumer":
            return meta
        self._load_history.append(
            {
                b: (t.req_id, t.first_block + i, k)
                for t in meta.loads
                for i, (b, k) in enumerate(zip(t.block_ids, t.keys, strict=True))
            }
        )
        for req_id, n_sched in scheduler_output.num_scheduled_tokens.items():
            request = self._requests.get(req_id)
            if request is None:
                continue
            full = min(
                (request.num_computed_tokens + n_sched) // self.block_size,
                len(request.block_hashes),
            )
            start = self._saved_upto.get(req_id, 0)
            if full <= start:
                continue
            self._saved_upto[req_id] = full
            # Keys the store already holds are offered again: its put copies nothing for them
            # (content addressing), which is cheaper than asking the worker first.
            all_block_ids = self._kv_cache_manager.get_block_ids(req_id)[0]
            meta.saves.append(
                Transfer(
                    req_id,
                    list(request.block_hashes[start:full]),
                    list(all_block_ids[start:full]),
                    start,
                )
            )
            self.stats["planned_saves"] += full - start
            if self._events_wanted:
                self._remember_tokens(request, start, full)
        return meta

    def _plan_pd_sends(self, scheduler_output: SchedulerOutput, meta: TpusyncMetadata) -> None:
        """Offer a do_remote_decode request's full prompt blocks in the step that ends its
        prefill (the worker copies them after the forward, so nothing is held afterwards)."""
        for req_id, n_sched in scheduler_output.num_scheduled_tokens.items():
            request = self._requests.get(req_id)
            if request is None or req_id in self._pd_published:
                continue
            if not (request.kv_transfer_params or {}).get("do_remote_decode"):
                continue
            if request.num_computed_tokens + n_sched < request.num_prompt_tokens:
                continue
            n = max(0, request.num_prompt_tokens - 1) // self.block_size
            if n == 0:
                continue
            ids = list(self._kv_cache_manager.get_block_ids(req_id)[0][:n])
            tid = transfer_id_for(self._engine_key, req_id)
            meta.pd_sends.append(PdSend(req_id, tid, ids))
            self._pd_published[req_id] = (tid, ids)
            self.stats["pd_sent_blocks"] += n

    def _remember_tokens(self, request: Request, start: int, end: int) -> None:
        """Keep the tokens and parent of blocks start..end-1 for their BlockStored events."""
        bs = self.block_size
        tokens = request.all_token_ids
        hashes = request.block_hashes
        for i in range(start, end):
            h = maybe_convert_block_hash(hashes[i])
            parent = maybe_convert_block_hash(hashes[i - 1]) if i > 0 else None
            self._planned[h] = (parent, array("I", tokens[i * bs : (i + 1) * bs]))
            self._planned.move_to_end(h)
        while len(self._planned) > _PLANNED_BLOCKS:
            self._planned.popitem(last=False)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        events = getattr(connector_output, "kv_cache_events", None)
        if isinstance(events, TpusyncKVEvents):
            self._collect_worker_events(events)
        bad = getattr(connector_output, "invalid_block_ids", None) or set()
        if not bad:
            return
        self.stats["load_errors_seen"] += len(bad)
        # vLLM recomputes (or fails) from the first failed block; the store already dropped what
        # it found corrupted, so the recomputed blocks are saved again from there on.
        for b in bad:
            for step in reversed(self._load_history):
                if b in step:
                    req_id, index, _ = step[b]
                    if req_id in self._saved_upto:
                        self._saved_upto[req_id] = min(self._saved_upto[req_id], index)
                    break

    def reset_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache(reset_connector=True)`` (also ``pause_generation(
        clear_cache=True)``; RL frameworks call it after a weight update): every worker forgets
        its stored blocks (RESET CONTRACT in store.py). False - vLLM then reports the reset as
        failed - when a worker did not answer within ``lookup_timeout_s``. A hit already granted
        to a request (``get_num_new_matched_tokens``) still plans its load; the blocks are gone,
        so it fails as load errors and vLLM recomputes them. P/D roles store nothing."""
        if self.kv_role != "kv_both":
            return True
        assert self.client is not None
        # A lookup still queued on the lookup thread (ASYNC LOOKUP CONTRACT) runs before or after
        # this, never during (the client serialises its calls): before, its lease ends here;
        # after, it finds only blocks saved after the reset.
        ok = self.client.reset()
        self._leased.clear()  # the workers ended every lease
        if not ok:
            log.warning("tpusync: reset_cache: a worker did not answer; its blocks may remain")
        return ok

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return False, self._finish(request)

    def _finish(self, request: Request) -> dict[str, Any] | None:
        """Forget the request; a producer's published prefill returns its kv_transfer_params.
        Nothing is held: the blocks were copied into the P/D pool when the prefill ran."""
        self._forget(request.request_id)
        published = self._pd_published.pop(request.request_id, None)
        if published is None:
            return None
        if self._pd_address is None:
            assert self.client is not None
            infos = [self.client.info(r) for r in range(self.world_size)]
            self._pd_ranks = [
                [str(i.get("pd_address", "")), str(i.get("pd_unix", "")), str(i.get("pd_host", ""))]
                for i in infos
            ]
            layers = [i.get("pd_layers") for i in infos]  # LAYER PLAN CONTRACT (pd.py)
            self._pd_rank_layers = layers if all(isinstance(x, list) for x in layers) else None
            self._pd_address = self._pd_ranks[0][0]
            self._pd_same_host = {
                "tpusync_unix": self._pd_ranks[0][1],
                "tpusync_host": self._pd_ranks[0][2],
            }
        host, _, port = self._pd_address.rpartition(":")
        tid, ids = published
        return {
            # P/D IDENTITY RULE: what the consumer checks before it takes these blocks.
            "tpusync_kv_identity": self._kv_identity(),
            "tpusync_tokens": _tokens_digest(request.prompt_token_ids, len(ids) * self.block_size),
            **self._pd_same_host,
            # PER-RANK P/D CONTRACT: worker r of the consumer pulls from rank r's entry; the
            # top-level address fields are rank 0's.
            "tpusync_ranks": self._pd_ranks,
            "tpusync_layout": self.layout,
            **({"tpusync_rank_layers": self._pd_rank_layers} if self._pd_rank_layers else {}),
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self._engine_key,
            "remote_host": host,
            "remote_port": int(port) if port else 0,
            "remote_block_ids": ids,
            "tpusync_transfer_id": tid,
            "tpusync_num_blocks": len(ids),
        }

    def _forget(self, req_id: str) -> None:
        """Release everything a finished, aborted or failed request holds (idempotent)."""
        self._requests.pop(req_id, None)
        self._saved_upto.pop(req_id, None)
        self._lookups.pop(req_id, None)
        self._pd_lookups.pop(req_id, None)
        self._pd_tried.discard(req_id)
        if self._inflight.pop(req_id, None) is not None:
            self._leased.add(req_id)  # the lookup in flight may lease: end it after the lookup
        self._release(req_id)

    def _collect_worker_events(self, events: TpusyncKVEvents) -> None:
        """Announce an event once every worker reported it (EVENT CONTRACT)."""
        got = events.get_all_events()
        if self.world_size == 1:
            self._worker_events.extend(got)
            return
        for e in got:
            if isinstance(e, AllBlocksCleared):  # any rank losing its shards clears the pod
                self._pending_events.clear()
                self._worker_events.append(e)
                continue
            self._pending_events[e] += 1
            if self._pending_events[e] >= self.world_size:
                del self._pending_events[e]
                self._worker_events.append(e)
        if len(self._pending_events) > _PENDING_EVENTS:
            log.warning("tpusync: %d unmatched worker events dropped", len(self._pending_events))
            self._pending_events.clear()

    def take_events(self) -> Iterable[Any]:
        """What the workers' stores did since the last call, as vLLM KV events (EVENT CONTRACT):
        runs of one kind and medium become one event; BlockStored runs are split where the
        planned token chain breaks so that ``parent_block_hash`` / ``token_ids`` stay exact."""
        raw, self._worker_events = self._worker_events, []
        out: list[Any] = []
        run: list[Any] = []
        run_kind: tuple[str, Any, bool] | None = None

        def flush() -> None:
            if not run or run_kind is None:
                return
            kind, medium, known = run_kind
            if kind == "removed":
                out.append(BlockRemoved(block_hashes=list(run), medium=medium))
                return
            parent, tokens = None, []
            if known:
                parent = self._planned[run[0]][0]
                for h in run:
                    tokens.extend(self._planned[h][1])
            out.append(
                BlockStored(
                    block_hashes=list(run),
                    parent_block_hash=parent,
                    token_ids=tokens,
                    block_size=self.block_size,
                    lora_id=None,
                    medium=medium,
                    lora_name=None,
                )
            )

        for e in raw:
            if isinstance(e, AllBlocksCleared):
                flush()
                run, run_kind = [], None
                out.append(AllBlocksCleared())
                continue
            for h in e.block_hashes:
                if isinstance(e, BlockStored):
                    known = h in self._planned
                    key = ("stored", e.medium, known)
                    chained = not known or not run or self._planned[h][0] == run[-1]
                else:
                    key, chained = ("removed", e.medium, False), True
                if key != run_kind or not chained:
                    flush()
                    run, run_kind = [], key
                run.append(h)
        flush()
        if out and self._publisher is not None:
            self._publisher.publish([_to_tpusync_event(e) for e in out])
        return out

    @property
    def num_leases(self) -> int:
        """Requests whose lookup pinned blocks and that have not been released yet."""
        return len(self._leased)

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        arrays: list[torch.Tensor] = []
        row_layers: list[int] | None = []  # LAYER PLAN CONTRACT (pd.py): the layer of each row
        for name, t in kv_caches.items():
            if t.device.type != "cpu":
                raise ConfigError(
                    f"layer {name} lives on {t.device}; this build of tpusync-vllm moves KV of CPU "
                    "tensors only (device KV needs tpusync-torch's KVCacheManager, not merged yet)"
                )
            parts = [t[0], t[1]] if self._kv_apart(t) else [t]  # K and V apart: two rows
            layer = _layer_number(name)
            row_layers = (
                None if row_layers is None or layer is None else row_layers + [layer] * len(parts)
            )
            self._layer_index[name] = len(self._layer_groups)
            self._layer_groups.append(list(range(len(arrays), len(arrays) + len(parts))))
            for p in parts:
                if p.shape[0] != self._kv_cache_config.num_blocks:
                    raise ConfigError(
                        f"layer {name}: unsupported KV layout {tuple(t.shape)} (strides "
                        f"{t.stride()}); expected block-major [num_blocks, ...]"
                    )
                row = p.flatten(1) if p.dim() > 2 else p
                if row.stride(-1) != 1 or (p.dim() > 2 and not p[0].is_contiguous()):
                    raise ConfigError(f"layer {name}: a block's bytes are not contiguous")
                arrays.append(row.view(torch.uint8) if row.dtype != torch.uint8 else row)
        row_bytes = {a.shape[1] for a in arrays}
        if len(row_bytes) != 1:
            raise ConfigError(f"layers have different block sizes in bytes: {sorted(row_bytes)}")
        rb = row_bytes.pop()
        if rb * len(arrays) != self.key_bytes:
            raise ConfigError(
                f"registered KV tensors hold {rb * len(arrays)} bytes per block, the KV cache "
                f"spec says {self.key_bytes}"
            )
        self._row_arrays = arrays
        self._row_layers = row_layers
        rank = self._rank = _worker_rank()
        self._spare = spare_replica(self._total_kv_heads, self.layout[0], rank % self.layout[0])
        disk_dir = None
        if self.config.disk_dir is not None:
            disk_dir = os.path.join(self.config.disk_dir, f"rank{rank}")
            os.makedirs(disk_dir, exist_ok=True)
        # BLOCK IDENTITY: one set of fields decides a block's bytes; the local tiers'
        # fingerprint adds the KV tensors' shapes (a resized cache cannot re-attach), the store
        # nodes' key salt leaves them out (instances of any capacity share blocks).
        identity = self._block_identity(row_bytes=rb, rows=len(arrays), rank=rank)
        fingerprint = model_fingerprint(
            **identity, shapes=[tuple(t.shape) for t in kv_caches.values()]
        )
        if self.kv_role != "kv_both":
            try:
                self.pd = PdWorker(
                    arrays,
                    producer=self.kv_role == "kv_producer",
                    pool_blocks=self.host_blocks,
                    listen=self.config.pd_listen,
                    secret_file=self.config.auth_secret_file,
                    timeout_s=self.config.load_timeout_s,
                    same_host=self.config.pd_same_host,
                    name=f"{self._engine_key}-{rank}",
                    heads=self._head_layout(kv_caches),
                )
            except ValueError as exc:  # no or short secret
                raise ConfigError(f"{self.kv_role}: {exc} (auth_secret_file)") from exc
            info: dict[str, Any] = {"pd_address": self.pd.address}
            if row_layers is not None:
                info["pd_layers"] = row_layers
            if self.pd.unix_address:
                info.update(pd_unix=self.pd.unix_address, pd_host=self.pd.host)
            self._server = LookupServer(None, lookup_endpoint(self._engine_key, rank), info)
            return
        if self.config.store_nodes:
            from tpusync.core.pd import load_secret

            try:  # the store nodes' secret: a clear error now, not a failed engine start later
                load_secret(self.config.auth_secret_file)
            except (OSError, ValueError) as exc:
                raise ConfigError(f"store_nodes: {exc} (auth_secret_file)") from exc
        self.store = WorkerStore(
            arrays,
            host_blocks=self.host_blocks,
            disk_dir=disk_dir,
            disk_blocks=self.disk_blocks,
            namespace=f"{self.config.namespace}-r{rank}" if self.config.namespace else None,
            fingerprint=fingerprint,
            lease_s=self.config.lease_s,
            prefault=self.config.prefault,
            store_nodes=self.config.store_nodes,
            auth_secret_file=self.config.auth_secret_file,
            replicas=self.config.replicas,
            store_timeout_s=self.config.store_timeout_s,
            write_through=self.config.write_through,
            key_salt=share_salt(**identity),
            events=self._events_wanted,
        )
        self._server = LookupServer(self.store, lookup_endpoint(self._engine_key, rank))
        if self.config.metrics_port:
            self._start_metrics(rank)

    def _kv_apart(self, t: torch.Tensor) -> bool:
        """Whether a layer's tensor holds K and V apart ([2, num_blocks, ...]: two rows per
        block) rather than block-major ([num_blocks, ...]: one row)."""
        return t.dim() >= 3 and t.shape[0] == 2 and t.shape[1] == self._kv_cache_config.num_blocks

    def _head_layout(self, kv_caches: dict[str, torch.Tensor]) -> tuple[int, int, int] | None:
        """(kv heads, outer, inner bytes) such that every registered row is [outer, heads,
        inner] bytes (HEAD RESHARD CONTRACT, pd.py), read from the tensors' shapes: the one
        per-block axis as long as this rank's kv heads. None when no axis or several match, or
        the parts disagree (P/D then pairs only producers of this layout)."""
        heads = rank_heads(self._total_kv_heads, self.layout[0], 0)
        if heads is None:
            return None
        own = heads[1] - heads[0]
        found = set()
        for t in kv_caches.values():
            per_block = tuple(t.shape[2:] if self._kv_apart(t) else t.shape[1:])
            axes = [i for i, d in enumerate(per_block) if d == own]
            if len(axes) != 1:
                return None
            i = axes[0]
            outer = int(torch.Size(per_block[:i]).numel())
            inner = int(torch.Size(per_block[i + 1 :]).numel()) * t.element_size()
            found.add((own, outer, inner))
        return found.pop() if len(found) == 1 else None

    def _model_identity(self) -> dict[str, Any]:
        """What decides the KV of a token prefix on any rank: the model as vLLM loaded it (its
        effective HF config, hf_overrides applied: a rope_theta override changes every K),
        revision, quantization, dtypes, block size and hash algorithm."""
        mc = self._vllm_config.model_config
        cc = self._vllm_config.cache_config
        hf = getattr(mc, "hf_config", None)
        try:
            hf_text = hf.to_json_string(use_diff=False) if hf is not None else ""
        except (TypeError, ValueError, AttributeError):  # a config json cannot serialise
            hf_text = repr(sorted(vars(hf).items())) if hf is not None else ""
        return {
            "model": mc.model,
            "revision": getattr(mc, "revision", None),
            "hf_config": hashlib.sha256(hf_text.encode()).hexdigest(),
            "quantization": getattr(mc, "quantization", None),
            "dtype": str(mc.dtype),
            "kv_cache_dtype": cc.cache_dtype,
            "block_size": self.block_size,
            "hash_algo": getattr(cc, "prefix_caching_hash_algo", None),
        }

    def _kv_identity(self) -> str:
        """The model identity as one string (P/D IDENTITY RULE), computed once."""
        if self._kv_identity_text is None:
            self._kv_identity_text = model_fingerprint(**self._model_identity())
        return self._kv_identity_text

    def _block_identity(self, *, row_bytes: int, rows: int, rank: int) -> dict[str, Any]:
        """What decides a stored block's bytes (the model identity, layout, rank) - the single
        source of the local tiers' fingerprint and the store nodes' key salt."""
        return {
            **self._model_identity(),
            "row_bytes": row_bytes,
            "rows": rows,
            "rank": rank,
            "world": self.world_size,
            "layout": self.layout,  # [tensor, pipeline]: PP=2 and TP=2 ranks hold other bytes
        }

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._finish_load()  # a previous step's load that no wait_for_save collected
        meta = self._get_connector_metadata()
        if isinstance(meta, TpusyncMetadata) and meta.pd_recvs and self.pd is not None:
            for rv in meta.pd_recvs:  # asynchronous: get_finished reports them
                try:
                    if rv.layout == self.layout and not self._replicated:
                        peer = self.pd.peer_for(*rv.peers[self._rank])
                        self.pd.start(rv.req_id, rv.transfer_id, peer, rv.block_ids)
                    else:  # HEAD RESHARD CONTRACT (pd.py)
                        stage = self._rank // self.layout[0]
                        if rv.stage_rows is not None and rv.stage_rows[stage] != self._row_layers:
                            raise ValueError(
                                f"the scheduler's layers of stage {stage} {rv.stage_rows[stage]} "
                                f"are not this worker's {self._row_layers}"
                            )
                        plan = head_plan(
                            self._total_kv_heads,
                            rv.layout,
                            self.layout,
                            self._rank,
                            rv.rank_layers,
                            rv.stage_rows,
                        )
                        if plan is None:
                            raise ValueError(f"no head / layer plan from layout {rv.layout}")
                        parts = [(self.pd.peer_for(*rv.peers[p.producer_rank]), p) for p in plan]
                        self.pd.start_parts(rv.req_id, rv.transfer_id, parts, rv.block_ids)
                except _TRANSFER_ERRORS as exc:
                    log.warning("tpusync P/D receive of %s not started: %s", rv.req_id, exc)
                    self._pd_failed[rv.req_id] = [b for b in rv.block_ids if b >= 0]
        if not isinstance(meta, TpusyncMetadata) or not meta.loads or self.store is None:
            return
        t0 = time.perf_counter()
        if self.config.layerwise_load:
            # PIPELINE CONTRACT (store.py): the copies run on a loading thread; each attention
            # layer waits for its own rows in wait_for_layer_load, so layer 0 computes while
            # later layers still land. Results are collected in _finish_load.
            keys = [k for tr in meta.loads for k in tr.keys]
            block_ids = [b for tr in meta.loads for b in tr.block_ids]
            try:
                self._load = self.store.start_load(
                    keys,
                    block_ids,
                    self.config.load_timeout_s,
                    layer_groups=self._layer_groups,
                    release=[tr.req_id for tr in meta.loads],
                )
                self._load_transfers = list(meta.loads)
                self._layers_waited = set()
                self._layers_late = set()
                self._count("layered_loads", 1)
            except _TRANSFER_ERRORS as exc:
                log.warning("tpusync load of %d blocks not started: %s", len(keys), exc)
                self.store.release([tr.req_id for tr in meta.loads])
                self._load_errors.update(block_ids)
                self._count("load_failures", len(meta.loads))
            self._count("load_issue_seconds", time.perf_counter() - t0)
            return
        # The forward reads these blocks next: each load completes here.
        for tr in meta.loads:
            try:
                failed = self.store.load(tr.keys, tr.block_ids, self.config.load_timeout_s)
            except _TRANSFER_ERRORS as exc:  # a malformed transfer must not kill the engine
                log.warning("tpusync load of %s failed: %s", tr.req_id, exc)
                failed = list(tr.block_ids)
            finally:
                self.store.release([tr.req_id])  # the bytes are in vLLM's blocks: lease over
            self._note_load(tr, failed)
        self._count("load_seconds", time.perf_counter() - t0)
        self._count("load_issue_seconds", time.perf_counter() - t0)
        self.store.check_remote()

    def _note_load(self, tr: Transfer, failed: list[int]) -> None:
        if failed:
            log.warning(
                "tpusync: %d of %d blocks of %s not loaded (missing or corrupted)",
                len(failed),
                len(tr.keys),
                tr.req_id,
            )
            self._load_errors.update(failed)
            self._count("load_failures", 1)
        self._count("loaded_blocks", len(tr.keys) - len(failed))

    def wait_for_layer_load(self, layer_name: str) -> None:
        load = self._load
        if load is None:
            return
        group = self._layer_index.get(layer_name)
        if group is None:
            return
        t0 = time.perf_counter()
        if load.wait_layer(group):
            self._layers_waited.add(group)
        else:
            # LATE LAYER RULE: the forward goes on and reads this layer's KV unloaded; the load
            # may still land afterwards, "in time" for finish(), so the step's blocks are failed
            # there by this set, never counted as loaded.
            log.warning("tpusync: layer %s not loaded in %.0f s", layer_name, load.timeout)
            self._layers_late.add(group)
        self._count("layer_waits", 1)
        self._count("layer_wait_seconds", time.perf_counter() - t0)

    def _finish_load(self) -> None:
        """Collect the step's layered load (idempotent): failed blocks become load errors. A
        layer the forward never waited for may have been read before it landed: its load counts
        as failed (vLLM recomputes), never as a silent hit."""
        load, self._load = self._load, None
        if load is None or self.store is None:
            return
        failed, in_time = load.finish()
        late = len(self._layers_late)
        unwaited = len(self._layer_groups) - len(self._layers_waited) - late
        all_ids = {b for tr in self._load_transfers for b in tr.block_ids}
        if not in_time:
            log.warning("tpusync: a load did not complete in %.0f s", load.timeout)
            failed = list(all_ids)
            self.store.abandon_staging()
        elif late:
            log.warning(
                "tpusync: %d of %d layers' loads landed after the forward read them; their "
                "blocks are recomputed",
                late,
                len(self._layer_groups),
            )
            failed = list(all_ids)
        elif unwaited:
            log.warning(
                "tpusync: vLLM did not wait for %d of %d layers' loads; their blocks are "
                "recomputed (set layerwise_load=false for this model)",
                unwaited,
                len(self._layer_groups),
            )
            failed = list(all_ids)
        bad = set(failed)
        for tr in self._load_transfers:
            self._note_load(tr, [b for b in tr.block_ids if b in bad])
        self._load_transfers = []
        self._count("load_seconds", load.load_seconds)
        self.store.check_remote()

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # saves run in wait_for_save, once every layer has written its KV

    def wait_for_save(self) -> None:
        self._finish_load()  # every layer ran: the step's loads are over
        meta = self._get_connector_metadata()
        if isinstance(meta, TpusyncMetadata) and meta.pd_sends and self.pd is not None:
            for sd in meta.pd_sends:  # the prefill's KV is complete now
                if self._spare:  # REPLICA RULE (pd.py): a lower rank offers these heads
                    continue
                try:
                    self.pd.publish(sd.transfer_id, sd.block_ids)
                    self._count("saved_blocks", len(sd.block_ids))
                except _TRANSFER_ERRORS as exc:  # the consumer's pull fails and it recomputes
                    log.warning("tpusync P/D offer of %s failed: %s", sd.req_id, exc)
                    self._count("save_failures", 1)
        if not isinstance(meta, TpusyncMetadata) or not meta.saves or self.store is None:
            return
        t0 = time.perf_counter()
        keys = [k for tr in meta.saves for k in tr.keys]
        block_ids = [b for tr in meta.saves for b in tr.block_ids]
        # vLLM may reuse these blocks after the step: save() waits for the copies.
        try:
            stored = self.store.save(keys, block_ids, self.config.save_timeout_s)
        except _TRANSFER_ERRORS as exc:  # not stored: later lookups miss, nothing is wrong
            log.warning("tpusync save of %d blocks failed: %s", len(keys), exc)
            stored = 0
        self._count("saved_blocks", stored)
        self._count("save_failures", len(keys) - stored)
        self._count("save_seconds", time.perf_counter() - t0)
        self.store.check_remote()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.pd is None:
            return None, None
        # ABANDON CONTRACT (pd.py): a finished request still loading was aborted. Its receive is
        # dropped (never scattered) and reported finished now, so vLLM frees its blocks; the
        # producer is told to drop its prefill copy in the background.
        abandoned = (
            self.pd.abandon(finished_req_ids, "request finished while loading (aborted)")
            if finished_req_ids
            else set()
        )
        self._count("pd_abandoned", len(abandoned))
        before, before_shm = self.pd.received, self.pd.received_shm
        done, failed = self.pd.poll()
        self._count("loaded_blocks", self.pd.received - before)
        self._count("pd_shm_blocks", self.pd.received_shm - before_shm)
        failed.update(self._pd_failed)
        self._pd_failed = {}
        for ids in failed.values():
            self._load_errors.update(ids)
            self._count("load_failures", 1)
        recving = done | set(failed) | abandoned
        return None, (recving or None)

    def get_kv_connector_kv_cache_events(self) -> TpusyncKVEvents | None:
        """This worker's store events since the last step, one per block (EVENT CONTRACT)."""
        if self.store is None or not self._events_wanted:
            return None
        raw, dropped = self.store.take_events()
        if not raw and not dropped:
            return None
        events: list[KVCacheEvent] = [AllBlocksCleared()] if dropped else []
        if dropped:
            log.warning("tpusync: %d store events lost (queue bound); announced a clear", dropped)
        for kind, tier, key in raw:
            if kind == "cleared":
                events.append(AllBlocksCleared())
                continue
            h = maybe_convert_block_hash(key)
            if kind == "stored":
                events.append(
                    BlockStored(
                        block_hashes=[h],
                        parent_block_hash=None,
                        token_ids=[],
                        block_size=self.block_size,
                        lora_id=None,
                        medium=_MEDIUM[tier],
                        lora_name=None,
                    )
                )
            else:
                events.append(BlockRemoved(block_hashes=[h], medium=_MEDIUM[tier]))
        return TpusyncKVEvents(events)

    def _start_metrics(self, rank: int) -> None:
        """Prometheus exporter of this worker on metrics_port + rank (connector + store)."""
        from prometheus_client import CollectorRegistry, start_http_server

        from tpusync.core.metrics import StoreCollector

        assert self.store is not None
        registry = CollectorRegistry()
        registry.register(StoreCollector(self.store.store, prefix="tpusync_vllm_store"))
        registry.register(_ConnectorCollector(self))
        port = self.config.metrics_port + rank
        try:
            self._metrics_server = start_http_server(
                port, addr=self.config.metrics_host, registry=registry
            )
        except OSError as exc:
            raise ConfigError(
                f"metrics_port: cannot serve on {self.config.metrics_host}:{port}: {exc}"
            ) from exc
        log.info("tpusync: metrics on http://%s:%d/metrics", self.config.metrics_host, port)

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._finish_load()
        out, self._load_errors = self._load_errors, set()
        return out

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._worker_stats.is_empty():
            return None
        out, self._worker_stats = self._worker_stats, TpusyncStats()
        return out if self.config.metrics else None

    def _count(self, key: str, value: float) -> None:
        self._worker_stats.data[key] += value
        self.totals.data[key] += value

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return TpusyncStats(data=dict(data or {}))

    def shutdown(self) -> None:
        if self._metrics_server is not None:
            server = self._metrics_server[0] if isinstance(self._metrics_server, tuple) else None
            if server is not None:
                server.shutdown()
                server.server_close()
            self._metrics_server = None
        if self._publisher is not None:
            self._publisher.close()
            self._publisher = None
        if self._lookup_pool is not None:  # queued lookups / releases end within lookup_timeout_s
            self._lookup_pool.shutdown(wait=True, cancel_futures=False)
            self._lookup_pool = None
        if self.client is not None:
            self.client.close()
        if self._server is not None:
            self._server.close()
            self._server = None
        if self.pd is not None:
            self.pd.close()
            self.pd = None
        self._finish_load()
        if self.store is not None:
            try:  # dirty host blocks reach the disk tier before the process ends
                self.store.flush(self.config.save_timeout_s)
            except tc.TpusyncError as exc:
                log.warning("tpusync: flush at shutdown: %s", exc)
            self.store.close()
            self.store = None


class _ConnectorCollector:
    """prometheus-client collector over one worker connector's never-reset totals."""

    _HELP = {
        "loaded_blocks": "Blocks loaded into vLLM from tpusync",
        "saved_blocks": "Blocks saved from vLLM into tpusync (already stored ones included)",
        "load_failures": "Transfers with blocks not loaded (missing, corrupted, errors)",
        "save_failures": "Blocks a save could not store",
        "load_seconds": "Seconds spent in loads",
        "save_seconds": "Seconds spent in saves",
        "load_issue_seconds": "Seconds start_load_kv held the forward",
        "layered_loads": "Steps whose loads ran layer-pipelined",
        "layer_waits": "Per-layer waits of layer-pipelined loads",
        "layer_wait_seconds": "Seconds the forward waited for layer loads",
        "pd_shm_blocks": "P/D blocks pulled over the same-host shared-memory path",
    }

    def __init__(self, connector: TpusyncConnector) -> None:
        self._c = connector

    def collect(self) -> Iterable[Any]:
        from prometheus_client.core import CounterMetricFamily

        data = dict(self._c.totals.data)
        for key, doc in self._HELP.items():
            yield CounterMetricFamily(f"tpusync_vllm_{key}", doc, value=data.get(key, 0))


def _pd_peers(params: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Per producer rank, (TCP address, unix address, host id) from a producer's
    kv_transfer_params (PER-RANK P/D CONTRACT; without ``tpusync_ranks``: one rank, the
    top-level fields). Raises KeyError / TypeError / ValueError on malformed ones."""
    ranks = params.get("tpusync_ranks")
    if ranks is None:
        host, port = str(params["remote_host"]), int(params["remote_port"])
        ranks = [
            [f"{host}:{port}", params.get("tpusync_unix") or "", params.get("tpusync_host") or ""]
        ]
    if not isinstance(ranks, list) or not ranks:
        raise ValueError(f"tpusync_ranks must be a non-empty list, not {ranks!r}")
    peers = []
    for entry in ranks:
        tcp, unix, host = (str(x) for x in entry)
        if not tcp.rpartition(":")[2].isdigit():
            raise ValueError(f"bad producer address {tcp!r}")
        peers.append((tcp, unix, host))
    return peers


def _pd_layout(params: dict[str, Any], ranks: int) -> list[int]:
    """The producer's [tensor, pipeline] parallel sizes from its kv_transfer_params (PER-RANK P/D
    CONTRACT; without ``tpusync_layout``, an older producer: ``ranks`` tensor-parallel ranks).
    Raises TypeError / ValueError on a malformed one."""
    raw = params.get("tpusync_layout", [ranks, 1])
    if not isinstance(raw, list | tuple) or len(raw) != 2:
        raise ValueError(f"tpusync_layout must be [tensor, pipeline], not {raw!r}")
    return [int(x) for x in raw]


def _pd_rank_layers(params: dict[str, Any], ranks: int) -> list[list[int]] | None:
    """Per producer rank, the model layer of each row of its blocks (LAYER PLAN CONTRACT), or
    None where the producer did not send them. Raises TypeError / ValueError on malformed ones."""
    raw = params.get("tpusync_rank_layers")
    if raw is None:
        return None
    if not isinstance(raw, list) or len(raw) != ranks or not all(isinstance(r, list) for r in raw):
        raise ValueError(f"tpusync_rank_layers must be one list per producer rank, not {raw!r}")
    return [[int(x) for x in r] for r in raw]


def _layer_number(name: str) -> int | None:
    """The model layer of a registered KV layer name, by vLLM's own rule (the one integer in the
    name, e.g. ``model.layers.3.self_attn.attn``); None for a name without exactly one."""
    try:
        from vllm.model_executor.models.utils import extract_layer_index

        return int(extract_layer_index(name))
    except (AssertionError, ValueError, ImportError):
        return None


def _total_kv_heads(vllm_config: VllmConfig) -> int:
    """The model's kv heads over all tensor ranks (0 where the config does not say)."""
    try:
        return int(vllm_config.model_config.get_total_num_kv_heads())
    except (AttributeError, TypeError, ValueError):
        return 0


def _worker_rank() -> int:
    """This worker's rank in vLLM's world group (0 outside a distributed setup)."""
    try:
        from vllm.distributed.parallel_state import get_world_group

        return int(get_world_group().rank_in_group)
    except (ImportError, AssertionError, AttributeError):
        return 0


def _to_tpusync_event(e: Any) -> tev.KVEvent:
    if isinstance(e, BlockStored):
        return tev.BlockStored(
            list(e.block_hashes),
            e.parent_block_hash,
            list(e.token_ids),
            e.block_size,
            e.lora_id,
            e.medium,
        )
    if isinstance(e, BlockRemoved):
        return tev.BlockRemoved(list(e.block_hashes), e.medium)
    return tev.AllBlocksCleared()
