"""Which part of each checkpoint tensor a vLLM tensor-parallel worker loads.

A vLLM engine with tensor parallelism ``tp`` loads every checkpoint (Hugging Face) tensor on every
worker and its ``load_weights`` keeps one slice: rows of a column-parallel weight (q/k/v, gate/up,
with grouped-query k/v heads replicated when ``tp`` exceeds their count), columns of a
row-parallel weight (o_proj, down_proj), a vocabulary range of the embedding and the LM head
(padded to 64 rows, then split), the whole of everything else. Sending each worker only that
slice cuts a TP=N engine's pull from N copies of the model to one.

TP SLICE CONTRACT: two functions name the same slices from two sides.

- :func:`tp_layouts` (trainer side, no vLLM import; not needed when the trainer takes the
  workers' report, ``TrainerSync(dst_layouts=None)``) plans them from the model directory's
  ``config.json`` with the Llama-family rules above (Llama, Mistral, Qwen2: the checkpoint names
  ``*.{q,k,v,o,gate,up,down}_proj.*``, ``*embed_tokens.weight``, ``lm_head.weight``): the
  ``dst_layouts`` a :class:`~tpusync.rl.trainer.TrainerSync` publishes with.
- :func:`worker_boxes` (in each vLLM worker) reads them from the live model: the module each name
  loads into (through the model's ``hf_to_vllm_mapper``), its class and its own ``tp_rank``, with
  the same arithmetic as that class's weight loader. Anything it does not recognise exactly
  (another layer class, a quantized method, a fused checkpoint tensor) gets the whole tensor,
  which ``load_weights`` cuts as it always does.

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
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tpusync.rl.layout import Box, ShardLayout

_VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE
_COLUMN = (".q_proj.", ".gate_proj.", ".up_proj.")
_KV = (".k_proj.", ".v_proj.")
_ROW = (".o_proj.weight", ".down_proj.weight")
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
        split = world > 1 and getattr(module, "tp_size", 1) == world
        boxes = [box(module, shard, leaf, shape, r) for r in range(world)] if split else [None]
        if any(b is None for b in boxes):
            boxes = [_whole(shape)] * world
        out[name] = ShardLayout(shape, tuple(enumerate(boxes)))
    return out


def _target(model: Any, name: str) -> tuple[str, Any] | None:
    """The model parameter checkpoint tensor ``name`` loads into, and which shard of it (through
    the model's ``hf_to_vllm_mapper``; the name itself without one); None: ignored by the model."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if hasattr(mapper, "_map_name_with_shard"):
        return mapper._map_name_with_shard(name)
    return name, None


def worker_boxes(model: Any, params: Mapping[str, Any], rank: int, tp: int) -> dict[str, Box]:
    """This worker's part of each checkpoint tensor its ``load_weights`` keeps: tensor-parallel
    rank ``rank`` of ``tp``'s slice (:func:`worker_layouts`), and nothing of a tensor whose layer
    sits on another pipeline stage (PP STAGE RULE: the name's target parameter lies under a
    module vLLM replaced by its missing-layer placeholder on this stage, the test its own
    loaders skip such parameters by). A name this cannot place stays (whole or sliced): a
    worker may receive a tensor it does not load, never miss one it does."""
    from vllm.model_executor.models.utils import get_pp_missing_layer_names

    missing = tuple(get_pp_missing_layer_names(model))
    out = {}
    for name, lay in worker_layouts(model, params, tp).items():
        mapped = _target(model, name)
        if missing and mapped is not None and mapped[0].startswith(missing):
            continue
        out[name] = lay.box_of(rank)
    return out
