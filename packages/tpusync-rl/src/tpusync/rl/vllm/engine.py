"""The worker side of the ``tpusync`` vLLM weight-transfer backend (imports vLLM).

One engine per vLLM worker process. ``init_transfer_engine`` opens a
:class:`~tpusync.rl.sampler.SamplerSync` whose :class:`~tpusync.rl.chunks.WeightSubscriber` stages
the trainer's tensors under their checkpoint names (shadow mode, double-buffered); every
``update_weights`` pulls one version, loads it into the model once it verified on every worker
(vLLM's layerwise reload: ``load_weights`` followed by the same post-load processing as a fresh
load), and commits it only once every worker loaded it (LOAD FAILURE RULE). SHARDING CONTRACT: with
``sharded`` (the default) worker ``r`` of an engine is sampler rank ``r`` and receives only the
slice of each checkpoint tensor its ``load_weights`` keeps, and nothing of the tensors of other
pipeline stages (:mod:`tpusync.rl.vllm.tp`, TP SLICE CONTRACT and PP STAGE RULE). At ``init`` the
workers exchange their parts, so every worker reports the same engine-wide layouts to a trainer
without ``dst_layouts`` (SAMPLER LAYOUTS CONTRACT); or, for tensor parallelism alone, the trainer's
``dst_layouts`` are :func:`~tpusync.rl.vllm.tp.tp_layouts`. Before the load each slice is placed in
a tensor of the checkpoint's shape, of which ``load_weights`` reads only that slice. With
``sharded=False`` every worker receives whole tensors (``dst_layouts``:
``ShardLayout.replicated(shape, range(world))``). Either way ``init`` is refused when a trainer
tensor's shape is not the one the worker's loader takes (SHAPE RULE,
:mod:`tpusync.rl.vllm.shapes`), and when the trainer's tensors would leave some of a worker's
parameters unwritten, unless ``partial`` (COVERAGE RULE, :mod:`tpusync.rl.vllm.coverage`).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from tpusync.rl.chunks import UpdateRejectedError, WeightSubscriber, _torch_dtype
from tpusync.rl.layout import Box, ShardLayout
from tpusync.rl.reports import listed
from tpusync.rl.sampler import SamplerSync
from tpusync.rl.vllm.coverage import unwritten_params
from tpusync.rl.vllm.shapes import shape_mismatches
from tpusync.rl.vllm.tp import oversent, worker_boxes

log = logging.getLogger("tpusync.rl")


def _named(found: dict[str, str]) -> str:
    """``"name: what; ..."`` for the first four of ``found``, then how many more."""
    return listed([f"{n}: {what}" for n, what in found.items()])


@dataclass
class TpusyncInitInfo(WeightTransferInitInfo):
    control: str
    replica: int
    params: dict[str, list] = field(default_factory=dict)
    dtype: str | None = None
    block_bytes: int = 4 << 20
    pool_bytes: int = 256 << 20
    streams: int = 4
    window: int = 1  # bucket pulls in flight per source (HOP LAG CONTRACT, sampler.py)
    listen: str = "127.0.0.1:0"
    same_host: bool = False
    sharded: bool = True
    partial: bool = False  # the trainer publishes only some parameters (COVERAGE RULE)


@dataclass
class TpusyncUpdateInfo(WeightTransferUpdateInfo):
    timeout: float = 60.0
    version: int | None = None


def _refresh_tied(model: torch.nn.Module) -> None:
    """TIED WEIGHTS CONTRACT: vLLM's layerwise reload post-processes only the modules that got a
    checkpoint tensor. A module whose weight is tied to another's - an LM head tied to the token
    embedding has no checkpoint name of its own - shares the new values but keeps what its own
    post-load processing derived from the old ones: on CPU a packed copy of the weight that its
    GEMM reads, so the logits would still come from the old head. So every embedding-method module
    sharing its weight storage with another module is post-processed again (for the unquantized
    embedding method this only rebuilds that derived copy). Other tied quantization methods are
    not re-run (their processing may rewrite the weight itself)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    owners: dict[int, list[torch.nn.Module]] = collections.defaultdict(list)
    for module in model.modules():
        weight = module._parameters.get("weight")
        if weight is not None and weight.numel():
            owners[weight.untyped_storage().data_ptr()].append(module)
    for modules in owners.values():
        if len(modules) < 2:
            continue
        for module in modules:
            method = getattr(module, "quant_method", None)
            if type(method) is UnquantizedEmbeddingMethod:
                method.process_weights_after_loading(module)


def _repack_experts(model: torch.nn.Module) -> None:
    """PREPACKED EXPERTS RULE: vLLM 0.32's CPU kernels for unquantized routed experts
    (``CPUUnquantizedExperts`` and its x86 / Arm / Power kinds) read ``w13_weight`` and
    ``w2_weight`` prepacked into their grouped-GEMM layout, which their experts' own
    ``process_weights_after_loading`` makes once, at the first load. A weight update (the
    layerwise reload) runs the layer's method again but skips that step: it counts as an
    update of a kernel already set up. The reload then leaves the new weights in checkpoint
    layout where the kernel reads packed ones, and the engine serves garbage (measured: a tiny
    Qwen3 MoE's greedy outputs after an update matched neither version). So after every reload
    those experts prepack the new weights again, by the same call vLLM makes at the first load.
    Other experts (GPU kernels, quantized CPU ones) are left as vLLM leaves them."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    for module in model.modules():
        if not isinstance(module, RoutedExperts):
            continue
        kernel = getattr(module.quant_method, "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(module)


def _engine_outcomes(mine: tuple) -> list[tuple]:
    """Every worker's ``(rank, version, failure)`` of this engine (ENGINE OUTCOME CONTRACT): a
    gather over the tensor-parallel group, then over the pipeline-parallel group (both within
    this engine; vLLM's world group may also span data-parallel engines that are not in this
    RPC). Every worker of the engine runs the same update RPC, so each takes part."""
    import torch.distributed as dist
    from vllm.distributed import parallel_state as ps

    rows = [mine]
    for get in (ps.get_tp_group, ps.get_pp_group):
        group = get()
        if group.world_size <= 1:
            continue
        parts: list[Any] = [None] * group.world_size
        dist.all_gather_object(parts, rows, group=group.cpu_group)
        rows = [row for part in parts for row in part]
    return sorted(rows, key=lambda row: row[0])


def _why(error: BaseException | None) -> tuple[str, str] | None:
    return None if error is None else (type(error).__name__, str(error))


def _engine_layouts(params: dict[str, list], rows: list[tuple]) -> dict[str, ShardLayout]:
    """Every checkpoint tensor's layout over the engine's workers, from each worker's parts
    (``rows``: ``(rank, {name: (lo, hi)}, None)``, every worker's the same): the same on every
    worker, so the trainer plans for one group. A worker's pipeline stage without the tensor
    holds no part of it."""
    out = {}
    for name, (shape, _dtype) in params.items():
        shards = tuple(
            (r, Box(tuple(part[name][0]), tuple(part[name][1])))
            for r, part, _f in rows
            if name in part
        )
        # A tensor no stage loads (its layer is missing everywhere) goes whole to every worker,
        # as without sharding; load_weights skips it.
        out[name] = (
            ShardLayout(tuple(shape), shards)
            if shards
            else ShardLayout.replicated(shape, (r for r, _p, _f in rows))
        )
    return out


def _failures(outcomes: list[tuple]) -> list[tuple[int, tuple[str, str]]]:
    """The workers that did not verify, as ``(rank, (kind, reason))``; when every worker
    verified but not the same version (they polled across an announcement), all of them."""
    failed = [(r, f) for r, _v, f in outcomes if f is not None]
    versions = {v for _r, v, f in outcomes if f is None}
    if not failed and len(versions) > 1:
        failed = [(r, ("rejected", f"verified version {v}")) for r, v, _f in outcomes]
    return failed


class TpusyncWeightTransferEngine(WeightTransferEngine[TpusyncInitInfo, TpusyncUpdateInfo]):
    init_info_cls = TpusyncInitInfo
    update_info_cls = TpusyncUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self.sampler: SamplerSync | None = None
        self.last_version = 0
        self._rank, self._world = 0, 1
        # name -> (checkpoint shape, this worker's slice of it): SHARDING CONTRACT
        self._slices: dict[str, tuple[tuple[int, ...], Box]] = {}

    def init_transfer_engine(self, init_info: TpusyncInitInfo) -> None:
        """Set up this worker's sampler, or raise on the engine's last worker only.

        ENGINE OUTCOME CONTRACT, set-up, in two exchanges every worker takes part in: first
        each worker's part of every checkpoint tensor (or why it has none: a refused option),
        from which every worker builds the same engine-wide layouts (SHARDING CONTRACT); then,
        once each opened its sampler, whether that worked (a port in use). If any worker failed,
        those that succeeded close their sampler again, so a corrected ``init`` finds every
        worker as before, and only the engine's last worker raises, with every worker's reason
        (see :meth:`receive_weights` for why one).
        """
        rank = self.parallel_config.rank if hasattr(self.parallel_config, "rank") else 0
        self._rank, self._world = int(rank), max(int(self.parallel_config.world_size), 1)
        fresh = self.sampler is None
        part, error = None, None
        try:
            part = self._my_boxes(init_info)
        except Exception as e:  # noqa: BLE001 - reported below, by the last worker
            error = e
        rows = _engine_outcomes((self._rank, part, _why(error)))
        failed = [(r, f) for r, _p, f in rows if f is not None]
        if not failed:
            try:
                self._open(init_info, _engine_layouts(init_info.params, rows))
            except Exception as e:  # noqa: BLE001 - reported below, by the last worker
                error = e
            rows = _engine_outcomes((self._rank, None, _why(error)))
            failed = [(r, f) for r, _p, f in rows if f is not None]
        if not failed:
            return
        if error is None and fresh and self.sampler is not None:
            self.sampler.close()  # another worker failed: undo this one's set-up
            self.sampler = None
        if self._rank != self._world - 1:
            return
        why = "; ".join(f"worker {r}: {kind}: {msg}" for r, (kind, msg) in failed)
        if all(kind == "ValueError" for _r, (kind, _m) in failed):
            raise ValueError(f"tpusync weight transfer engine not set up on this engine: {why}")
        raise RuntimeError(f"tpusync weight transfer engine not set up on this engine: {why}")

    def _my_boxes(self, init_info: TpusyncInitInfo) -> dict[str, tuple[list, list]]:
        """This worker's part of each checkpoint tensor it loads, ``name -> (lo, hi)``
        (SHARDING CONTRACT); raises for a refused set-up."""
        if self.sampler is not None:
            raise RuntimeError("the tpusync weight transfer engine is already initialized")
        if not init_info.params:
            raise ValueError("init_info.params is empty: pass checkpoint_params(model_dir)")
        wrong = shape_mismatches(self.model, init_info.params)  # SHAPE RULE
        if wrong:
            raise ValueError(
                f"{len(wrong)} of the trainer's tensors do not have the shape this worker's "
                f"model loads ({_named(wrong)}): the trainer's model config is not the engine's"
            )
        cover = unwritten_params(self.model, init_info.params)
        if cover is None:
            log.info("tpusync: a trainer tensor maps to no parameter here; coverage not checked")
        elif cover.torn or (cover.unwritten and not init_info.partial):  # COVERAGE RULE
            # TORN LAYER RULE: a layer that gets only some tensors is refused even if partial.
            bad = (
                {n: cover.unwritten[n] for n in cover.torn}
                if init_info.partial
                else cover.unwritten
            )
            way = (
                "partial=True does not cover a layer that gets only some of its tensors: vLLM "
                "rebuilds such a layer whole"
                if cover.torn
                else "or pass partial=True if the trainer publishes only the parameters it trains"
            )
            raise ValueError(
                f"the trainer's tensors leave {len(bad)} of this worker's parameters unwritten "
                f"({_named(bad)}): vLLM would serve them at the old version, or uninitialised, "
                f"beside the new one; publish every tensor of the model ({way})"
            )
        elif cover.unwritten:
            log.warning("tpusync: partial trainer, these keep their values: %s", cover.unwritten)
        if not init_info.sharded:
            return {
                n: ([0] * len(shape), list(shape)) for n, (shape, _d) in init_info.params.items()
            }
        from vllm.distributed import parallel_state as ps

        tp = ps.get_tp_group()
        boxes = worker_boxes(self.model, init_info.params, tp.rank_in_group, tp.world_size)
        # OVERSENT RULE (tensor parallelism only: at TP=1 every worker keeps all it is sent).
        more = oversent(self.model, init_info.params, boxes) if tp.world_size > 1 else {}
        if more:
            log.warning(
                "tpusync: worker %d takes %d tensors whole of which it keeps only part, so the "
                "engine pulls them once per worker: %s (fused checkpoint tensors of a Phi-3, Phi-4 "
                "or GLM-4 model: publish tpusync.rl.fused.split_fused(...) of them instead)",
                self._rank,
                len(more),
                _named(more),
            )
        return {n: (list(b.lo), list(b.hi)) for n, b in boxes.items()}

    def _open(self, init_info: TpusyncInitInfo, layouts: dict[str, ShardLayout]) -> None:
        """Stage buffers for this worker's parts and open its sampler."""
        rank = self._rank
        dtype = _torch_dtype(init_info.dtype) if init_info.dtype else self.model_config.dtype
        self._slices = {
            name: (lay.shape, lay.box_of(rank))
            for name, lay in layouts.items()
            if rank in lay.ranks
        }
        weights = {
            name: torch.zeros(box.shape, dtype=dtype, device="cpu")
            for name, (_shape, box) in self._slices.items()
        }
        sub = WeightSubscriber(rank, weights, layouts, mode="shadow", recycle=True)
        self.sampler = SamplerSync(
            sub,
            replica=init_info.replica,
            control=init_info.control,
            listen=init_info.listen,
            same_host=init_info.same_host,
            block_bytes=init_info.block_bytes,
            pool_bytes=init_info.pool_bytes,
            streams=init_info.streams,
            window=init_info.window,
        )

    def start_weight_update(self) -> None:
        """Nothing: the model is only touched once a whole version verified (receive_weights)."""

    def finish_weight_update(self) -> None:
        """Nothing: receive_weights loads and post-processes the model in one step."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class synchronizes the accelerator afterwards; this engine loads synchronously.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: TpusyncUpdateInfo) -> None:
        """Pull one version and load it, or raise on the engine's last worker only.

        ENGINE OUTCOME CONTRACT: the workers of one engine (its tensor- and pipeline-parallel
        ranks) agree on the outcome before any of them commits or touches its model: each pulls
        and verifies its slices, then they exchange outcomes (a gather over the engine's CPU
        process groups; for a worker that verified, inside its sampler's GROUP COMMIT CONTRACT
        callback), and the version is loaded on every worker or on none. Only a version every
        worker loaded is committed (the load runs inside the same callback, LOAD FAILURE RULE),
        so the engine never serves two versions at once and the trainer's report counts a
        worker committed only when its engine serves the version. When it is not loaded, only
        the engine's last worker (rank world - 1) raises, with every worker's reason; the others
        return normally. vLLM's multiprocess executor reads the workers' replies in rank order
        and stops at the first error, so an error of any earlier worker would stay queued and be
        read as the reply to the engine's next RPC: every later call failed with that stale
        error (a TP=2 engine after one timed-out update), and a pipeline-parallel engine died at
        its next step. The workers that returned normally still hold vLLM's update session open;
        :func:`tpusync.rl.vllm.update` and ``update_server`` end it with ``finish_weight_update``
        after a failure.
        """
        if self.sampler is None:
            raise RuntimeError("call init_weight_transfer_engine before update_weights")
        sampler = self.sampler
        want = update_info.version
        gathered: list[list[tuple]] = []  # the one exchange of this RPC, once it happened
        load_failed: list[UpdateRejectedError] = []  # the verified version did not load

        def confirm(version: int) -> str | None:
            gathered.append(_engine_outcomes((self._rank, version, None)))
            failed = _failures(gathered[0])
            if failed:
                why = "; ".join(f"worker {r}: {msg}" for r, (_kind, msg) in failed)
                return (
                    f"verified here but not loaded: other workers of this engine failed it: {why}"
                )
            try:  # LOAD FAILURE RULE: load before committing
                self._load_or_undo(sampler.sub, version)
            except UpdateRejectedError as e:  # the trainer is told why; the last worker raises
                load_failed.append(e)
                return str(e)
            return None

        result = None
        if want is not None and sampler.version >= want:
            failure = (
                "rejected",
                f"version {want} requested but this worker already took {sampler.version}",
            )
        else:
            result = sampler.update(timeout=update_info.timeout, confirm=confirm)
            if result is None:
                failure = (
                    "timeout",
                    f"no version newer than {sampler.version} was announced within "
                    f"{update_info.timeout} s",
                )
            elif not result.ok:
                failure = (
                    "rejected",
                    f"update to version {result.version} rejected: {result.reason}",
                )
            else:
                failure = None
        if not gathered:  # this worker failed before its version verified
            gathered.append(_engine_outcomes((self._rank, None, failure)))
        failed = _failures(gathered[0])
        if not failed and not load_failed:
            assert result is not None and result.ok, result
            if want is not None and result.version != want:
                log.warning("asked for version %d, version %d arrived", want, result.version)
            self.last_version = result.version
            log.info("vLLM worker now serves version %d (%.3f s)", result.version, result.seconds)
            return
        if self._rank != self._world - 1:
            return
        if load_failed:
            raise load_failed[0]
        why = "; ".join(f"worker {r}: {msg}" for r, (_kind, msg) in failed)
        if all(kind == "timeout" for _r, (kind, _m) in failed):
            raise TimeoutError(
                f"no new version reached this engine: {why}; still serving version "
                f"{self.last_version}"
            )
        raise UpdateRejectedError(
            f"update not loaded on this engine: {why}; still serving version {self.last_version}"
        )

    def _load_or_undo(self, sub: WeightSubscriber, version: int) -> None:
        """Load ``sub``'s staged version ``version`` (verified on every worker, not committed
        yet), or raise UpdateRejectedError on every worker of the engine when any of them failed to
        (the same message on each: the version is then rejected, and the trainer's report says
        why).

        LOAD FAILURE RULE: a reload that raises half way (a loader ``init`` could not check)
        leaves vLLM's model part new, part old, part on the ``meta`` device, and the engine
        would die at its next step. So the workers exchange their load outcomes, and if any
        failed, every worker ends its reload and loads again what it served before: ``sub``'s
        committed version (the subscriber stages every version elsewhere), or before the
        sampler's first version the engine's checkpoint, read again by vLLM's model
        loader. Only if that fails too is the engine left to be restarted.
        """
        try:
            self._load((n, self._full(n, t)) for n, t in sub.staged().items())
            why = None
        except Exception as e:  # noqa: BLE001 - every worker is told, the last one raises
            log.error("vLLM worker %d: loading version %d failed: %s", self._rank, version, e)
            why = ("load", f"{type(e).__name__}: {e}")
        failed = _failures(_engine_outcomes((self._rank, version, why)))
        if not failed:
            return
        reasons = "; ".join(f"worker {r}: {msg}" for r, (_kind, msg) in failed)
        back = None
        if why is not None:
            back = self._end_failed_reload()
        if back is None:
            try:
                if sub.version > 0:
                    self._load((n, self._full(n, t)) for n, t in sub.weights.items())
                else:
                    self._load(self._checkpoint())
            except Exception as e:  # noqa: BLE001 - reported below
                back = f"{type(e).__name__}: {e}"
        undone = _failures(_engine_outcomes((self._rank, version, back and ("undo", back))))
        was = f"version {self.last_version}" if self.last_version > 0 else "its checkpoint"
        if not undone:
            raise UpdateRejectedError(
                f"version {version} verified but vLLM's reload failed ({reasons}): every "
                f"worker of this engine loaded {was} again and serves it"
            )
        stuck = "; ".join(f"worker {r}: {msg}" for r, (_kind, msg) in undone)
        raise UpdateRejectedError(
            f"version {version} verified but vLLM's reload failed ({reasons}), and {was} could "
            f"not be loaded again ({stuck}): restart this engine"
        )

    def _checkpoint(self) -> Any:
        """The engine's checkpoint tensors, ``(name, tensor)`` as vLLM's model loader reads them
        from the model's files (what the engine served before its first tpusync version)."""
        from vllm.model_executor.model_loader import get_model_loader

        if self.last_version > 0:
            raise RuntimeError(
                f"this engine serves version {self.last_version}, which its sampler (set up "
                "again since) does not hold"
            )
        loader = get_model_loader(self.vllm_config.load_config)
        if not hasattr(loader, "get_all_weights"):
            raise RuntimeError(
                f"vLLM's {self.vllm_config.load_config.load_format!r} loader cannot read the "
                "checkpoint again"
            )
        return loader.get_all_weights(self.model_config, self.model)

    def _end_failed_reload(self) -> str | None:
        """End vLLM's layerwise reload after ``load_weights`` raised, so no layer stays on the
        ``meta`` device; None when that worked, else why not."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        try:
            finalize_layerwise_reload(self.model, self.model_config)
        except Exception as e:  # noqa: BLE001 - reported by the caller
            return f"ending the failed reload: {type(e).__name__}: {e}"
        return None

    def _load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """vLLM's layerwise reload of ``weights``, checkpoint names and shapes: tpusync's parts
        placed by :meth:`_full`, or the checkpoint's own tensors (:meth:`_checkpoint`)."""
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        initialize_layerwise_reload(self.model)
        self.model.load_weights(weights)
        finalize_layerwise_reload(self.model, self.model_config)
        _refresh_tied(self.model)
        _repack_experts(self.model)

    def _full(self, name: str, part: torch.Tensor) -> torch.Tensor:
        """``part`` in a tensor of the checkpoint's shape (SHARDING CONTRACT: only it is read)."""
        shape, box = self._slices[name]
        if box.shape == shape:
            return part.to(self.device)
        out = torch.empty(shape, dtype=part.dtype, device=self.device)
        out[Box((0,) * len(shape), shape).local_slices(box)] = part
        return out

    def shutdown(self) -> None:
        if self.sampler is not None:
            self.sampler.close()
            self.sampler = None
