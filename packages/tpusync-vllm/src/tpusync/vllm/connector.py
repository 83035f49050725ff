"""TpusyncConnector: vLLM KV connector (v1 API) for host offload and prefix reuse.

Role ``kv_both``: every full KV block a request computes is copied to tpusync's host tier, and a
later request whose prefix blocks (vLLM's own ``request.block_hashes``) are stored there loads them
instead of recomputing - also after vLLM's own prefix cache dropped them.

DATA FLOW. The SCHEDULER instance decides and the WORKER instances move bytes; they may live in
different processes (vLLM's default CPU engine), so they share nothing but the per-step
:class:`TpusyncMetadata`:

1. ``get_num_new_matched_tokens`` asks the scheduler-side directory (no side effects).
2. ``update_state_after_alloc`` pins the hit keys (PIN CONTRACT in store.py) and queues a load of
   (slots -> vLLM block ids); ``build_connector_meta`` adds saves of newly full blocks, with slots
   the directory reserved (evicting LRU unpinned keys).
3. The worker runs the step's loads in ``start_load_kv`` (engine threads scatter host rows into the
   paged KV tensors; it waits before the forward starts) and its saves in ``wait_for_save`` (after
   every layer wrote its KV; it waits before the step ends, so vLLM may reuse the blocks).
4. A load that fails is reported through ``get_block_ids_with_load_errors``; vLLM then recomputes
   or fails the request per ``kv_load_failure_policy``, and the scheduler drops those keys.
5. ``request_finished`` (also on abort) releases every pin the request took.

Loads and saves are synchronous per step (no ``finished_recving``/``finished_sending`` tracking);
layer-pipelined loads and async saves are future work.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

import tpusync.core as tc
from tpusync.core import events as tev
from tpusync.vllm.config import ConfigError, TpusyncVllmConfig
from tpusync.vllm.store import HostDirectory, HostSlots, KVDirectory, KVSlotData
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
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

__all__ = ["TpusyncConnector", "TpusyncMetadata", "TpusyncStats", "Transfer"]

log = logging.getLogger("tpusync.vllm")

# What a bad transfer can raise (tpusync errors; nanobind's TypeError for a wrong array): caught
# per transfer and reported as a load error / failed save, never propagated into vLLM's step.
_TRANSFER_ERRORS = (tc.TpusyncError, TypeError, ValueError)


@dataclass
class Transfer:
    """One request's blocks to move: ``keys[i]`` <-> host ``slots[i]`` <-> vLLM ``block_ids[i]``."""

    req_id: str
    keys: list[bytes]
    slots: list[int]
    block_ids: list[int]
    first_block: int = 0  # index of keys[0] in the request's block_hashes


@dataclass
class TpusyncMetadata(KVConnectorMetadata):
    """The scheduler's decisions for one step (pickled to the workers)."""

    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)


_WORKER_COUNTERS = (
    "loaded_blocks",
    "saved_blocks",
    "load_failures",
    "save_failures",
    "load_seconds",
    "save_seconds",
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


def _key_geometry(kv_cache_config: KVCacheConfig) -> tuple[int, int]:
    """(bytes of one block across all layers of this worker, number of layers)."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConfigError(
            f"TpusyncConnector supports one KV cache group (full attention) in this build; this "
            f"model has {len(groups)} (hybrid / sliding-window models are not available yet)"
        )
    spec = groups[0].kv_cache_spec
    return int(spec.page_size_bytes) * len(groups[0].layer_names), len(groups[0].layer_names)


class TpusyncConnector(KVConnectorBase_V1, SupportsHMA):
    """Host-tier KV offload and prefix reuse for vLLM (see the module docstring)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        if ktc.kv_role != "kv_both":
            raise ConfigError(
                f"kv_role {ktc.kv_role!r} is not available in this build of tpusync-vllm: "
                "prefill/decode disaggregation needs the network transport (use 'kv_both')"
            )
        if vllm_config.parallel_config.pipeline_parallel_size > 1:
            raise ConfigError("pipeline parallelism is not available in this build of tpusync-vllm")
        self.config = TpusyncVllmConfig.from_extra(ktc.kv_connector_extra_config)
        self.block_size = vllm_config.cache_config.block_size
        self.key_bytes, self.num_layers = _key_geometry(kv_cache_config)
        self.num_slots = self.config.host_bytes // self.key_bytes
        if self.num_slots < 1:
            raise ConfigError(
                f"host_bytes={self.config.host_bytes} cannot hold one block of "
                f"{self.key_bytes} bytes (all layers)"
            )
        model = self.config.namespace or vllm_config.model_config.served_model_name or "model"
        self.model_name = str(model).replace("@", "_")
        # Scheduler side.
        self.directory: KVDirectory | None = None
        self._requests: dict[str, Request] = {}
        self._saved_upto: dict[str, int] = {}
        self._lookups: dict[str, tuple[int, int]] = {}
        self._pins: dict[str, list[bytes]] = {}
        self._pending_loads: list[Transfer] = []
        # block id -> (req, block index, key) of the loads of the last two steps (two: with async
        # scheduling, step N+1's metadata is built before step N's output arrives).
        self._load_history: deque[dict[int, tuple[str, int, bytes]]] = deque(maxlen=2)
        self._stored_events: list[BlockStored] = []
        self.stats: dict[str, int] = {
            "queries": 0,
            "hit_blocks": 0,
            "hit_tokens": 0,
            "planned_saves": 0,
            "load_errors_seen": 0,
        }
        self._publisher: tev.KVEventPublisher | None = None
        # Worker side.
        self.slots: KVSlotData | None = None
        self._row_arrays: list[torch.Tensor] = []
        self._load_errors: set[int] = set()
        self._worker_stats = TpusyncStats()
        self.totals = TpusyncStats()  # never reset: for diagnostics and tests
        if role == KVConnectorRole.SCHEDULER:
            self.directory = HostDirectory(self.num_slots)
            if self.config.kv_events_endpoint:
                self._publisher = tev.KVEventPublisher(
                    self.config.kv_events_endpoint,
                    pod_id=self.config.resolved_pod_id(),
                    model=self.model_name,
                    encoding=self.config.kv_events_encoding,  # type: ignore[arg-type]
                )
        log.info(
            "TpusyncConnector(%s): host tier %d slots x %d bytes (%d layers)",
            role.name,
            self.num_slots,
            self.key_bytes,
            self.num_layers,
        )

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self.directory is not None
        self.stats["queries"] += 1
        # Never claim the whole prompt: vLLM must compute at least one token to sample from.
        max_blocks = max(0, (request.num_tokens - 1) // self.block_size)
        keys = list(request.block_hashes[:max_blocks])
        hit_blocks = self.directory.lookup(keys) if keys else 0
        hit_tokens = hit_blocks * self.block_size
        if hit_tokens <= num_computed_tokens:
            self._lookups.pop(request.request_id, None)
            return 0, False
        self._lookups[request.request_id] = (num_computed_tokens, hit_blocks)
        return hit_tokens - num_computed_tokens, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self.directory is not None
        req_id = request.request_id
        self._requests[req_id] = request
        self._saved_upto.setdefault(req_id, 0)
        lookup = self._lookups.pop(req_id, None)
        if num_external_tokens <= 0 or lookup is None:
            return
        _, hit_blocks = lookup
        end = hit_blocks
        first = max(0, (hit_blocks * self.block_size - num_external_tokens) // self.block_size)
        keys = list(request.block_hashes[first:end])
        block_ids = blocks.get_block_ids()[0][first:end]
        # Same thread as the lookup and no eviction in between, so the keys are still there; if
        # not (a bug), the load is sent with slot -1, which the worker rejects as a load error:
        # vLLM recomputes instead of the scheduler crashing.
        try:
            self.directory.pin(keys)
        except tc.NotFoundError:
            log.warning("tpusync: prefix of %s vanished before it was pinned", req_id)
            slots = [-1] * len(keys)
        else:
            self._pins.setdefault(req_id, []).extend(keys)
            slots = self.directory.slots(keys)
        self._pending_loads.append(Transfer(req_id, keys, slots, list(block_ids), first))
        self._saved_upto[req_id] = max(self._saved_upto[req_id], end)
        self.stats["hit_blocks"] += len(keys)
        self.stats["hit_tokens"] += num_external_tokens

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.directory is not None
        meta = TpusyncMetadata(loads=self._pending_loads)
        self._pending_loads = []
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
            hashes = list(request.block_hashes[start:full])
            placed = self.directory.reserve(hashes)
            if not placed:
                continue
            all_block_ids = self._kv_cache_manager.get_block_ids(req_id)[0]
            position = {k: start + i for i, k in enumerate(hashes)}
            keys = [k for k, _ in placed]
            meta.saves.append(
                Transfer(
                    req_id,
                    keys,
                    [s for _, s in placed],
                    [all_block_ids[position[k]] for k in keys],
                )
            )
            self.stats["planned_saves"] += len(keys)
            self._record_stored(request, [position[k] for k in keys])
        return meta

    def _record_stored(self, request: Request, positions: list[int]) -> None:
        bs = self.block_size
        tokens = request.all_token_ids
        # One event per contiguous run, chained to the block before it (llm-d rebuilds chains).
        run: list[int] = []
        for p in [*positions, -2]:
            if run and p != run[-1] + 1:
                first = run[0]
                parent = request.block_hashes[first - 1] if first > 0 else None
                self._stored_events.append(
                    BlockStored(
                        block_hashes=[
                            maybe_convert_block_hash(request.block_hashes[i]) for i in run
                        ],
                        parent_block_hash=None
                        if parent is None
                        else maybe_convert_block_hash(parent),
                        token_ids=list(tokens[first * bs : (run[-1] + 1) * bs]),
                        block_size=bs,
                        lora_id=None,
                        medium=self.directory.medium if self.directory else "CPU",
                        lora_name=None,
                    )
                )
                run = []
            run.append(p)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        bad = getattr(connector_output, "invalid_block_ids", None) or set()
        if bad and self.directory is not None:
            failed = []
            for b in bad:
                for step in reversed(self._load_history):
                    if b in step:
                        failed.append(step[b])
                        break
            self.stats["load_errors_seen"] += len(bad)
            # Do not offer these keys again; vLLM recomputes (or fails) the blocks, and the
            # request saves them again from the first failed block on.
            self.directory.remove([k for _, _, k in failed])
            for req_id, index, _ in failed:
                if req_id in self._saved_upto:
                    self._saved_upto[req_id] = min(self._saved_upto[req_id], index)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._forget(request.request_id)
        return False, None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._forget(request.request_id)
        return False, None

    def _forget(self, req_id: str) -> None:
        """Release everything a finished, aborted or failed request holds (idempotent)."""
        self._requests.pop(req_id, None)
        self._saved_upto.pop(req_id, None)
        self._lookups.pop(req_id, None)
        pins = self._pins.pop(req_id, [])
        if pins and self.directory is not None:
            self.directory.unpin(pins)

    def take_events(self) -> Iterable[Any]:
        out: list[Any] = []
        if self.directory is not None:
            for ev in self.directory.take_events():
                if ev.kind == "removed":
                    out.append(
                        BlockRemoved(
                            block_hashes=[maybe_convert_block_hash(k) for k in ev.keys],
                            medium=ev.medium,
                        )
                    )
                elif ev.kind == "cleared":
                    out.append(AllBlocksCleared())
        out.extend(self._stored_events)
        self._stored_events = []
        if out and self._publisher is not None:
            self._publisher.publish([_to_tpusync_event(e) for e in out])
        return out

    def reset_cache(self) -> bool | None:
        if self.directory is not None:
            self.directory.clear()
            for req_id in list(self._pins):
                self._pins[req_id] = []
        return True

    @property
    def num_pins(self) -> int:
        return 0 if self.directory is None else self.directory.num_pins

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        arrays: list[torch.Tensor] = []
        for name, t in kv_caches.items():
            if t.device.type != "cpu":
                raise ConfigError(
                    f"layer {name} lives on {t.device}; this build of tpusync-vllm moves KV of CPU "
                    "tensors only (device KV needs tpusync-torch's KVCacheManager, not merged yet)"
                )
            if t.dim() >= 3 and t.shape[0] == 2 and t.shape[1] == self._kv_cache_config.num_blocks:
                parts = [t[0], t[1]]  # K and V stored apart: two rows per block
            else:
                parts = [t]
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
        self.slots = HostSlots(self.num_slots, rb, len(arrays), prefault=self.config.prefault)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, TpusyncMetadata) or not meta.loads or self.slots is None:
            return
        t0 = time.perf_counter()
        pending = []
        for tr in meta.loads:
            try:
                pending.append(
                    (tr, self.slots.load(tr.slots, tr.keys, self._row_arrays, tr.block_ids))
                )
            except _TRANSFER_ERRORS as exc:  # a malformed transfer must not kill the engine
                log.warning("tpusync load of %s rejected: %s", tr.req_id, exc)
                self._fail_load(tr)
        # The forward reads these blocks next: wait here (the copies run on engine threads).
        for tr, fut in pending:
            try:
                fut.result(self.config.load_timeout_s)
                self._count("loaded_blocks", len(tr.keys))
            except _TRANSFER_ERRORS as exc:
                log.warning("tpusync load of %s failed: %s", tr.req_id, exc)
                self._fail_load(tr)
        self._count("load_seconds", time.perf_counter() - t0)

    def _fail_load(self, tr: Transfer) -> None:
        self._load_errors.update(tr.block_ids)
        self._count("load_failures", 1)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads completed in start_load_kv

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # saves run in wait_for_save, once every layer has written its KV

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, TpusyncMetadata) or not meta.saves or self.slots is None:
            return
        t0 = time.perf_counter()
        pending = []
        for tr in meta.saves:
            try:
                pending.append(
                    (tr, self.slots.save(tr.slots, tr.keys, self._row_arrays, tr.block_ids))
                )
            except _TRANSFER_ERRORS as exc:
                log.warning("tpusync save of %s rejected: %s", tr.req_id, exc)
                self._count("save_failures", 1)
        # vLLM may reuse these blocks after the step: the copies must be finished.
        for tr, fut in pending:
            try:
                fut.result(self.config.save_timeout_s)
                self._count("saved_blocks", len(tr.keys))
            except _TRANSFER_ERRORS as exc:  # the slot stays unreadable; a later load fails cleanly
                log.warning("tpusync save of %s failed: %s", tr.req_id, exc)
                self._count("save_failures", 1)
        self._count("save_seconds", time.perf_counter() - t0)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
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
        if self._publisher is not None:
            self._publisher.close()
            self._publisher = None


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
