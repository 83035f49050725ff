"""Which of a vLLM worker's parameters the trainer's tensors would leave unwritten.

A trainer that leaves a checkpoint tensor out (or publishes it under a name the model maps
nowhere) does not make vLLM's reload fail. vLLM 0.32's layerwise reload puts a layer that got no
tensor back as it was, with a warning in the log ("Failed to load weights"), so the engine serves
that layer's old version beside the new ones; and it rebuilds a layer that got only some of its
tensors (a stacked ``qkv_proj`` without its k rows) from fresh, uninitialised memory where the
missing ones should be. Neither is what an RL sampler may serve.

COVERAGE RULE (vLLM backend): :func:`unwritten_params` names, at ``init``, every parameter of
this worker's model that no trainer tensor loads into, and every stacked parameter (vLLM's
``QKVParallelLinear``, ``MergedColumnParallelLinear``) some of whose shards no trainer tensor
names, by the same name mapping the slices use (:func:`tpusync.rl.vllm.tp._target`, the model's
``hf_to_vllm_mapper``). It looks at names only, never at values. It decides only when it can
place every trainer tensor: a name that maps to no parameter of this worker, other than one of
another pipeline stage, means the mapping is not the model's own (a model whose
``load_weights`` stacks by rules of its own), and then it returns None - no verdict - rather than
refuse a complete trainer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tpusync.rl.vllm.tp import _target


def _shards(module: Any) -> set[Any] | None:
    """The shard ids a stacked vLLM layer's parameters are loaded from; None: not stacked."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear

    if isinstance(module, QKVParallelLinear):
        return {"q", "k", "v"}
    if isinstance(module, MergedColumnParallelLinear):
        return set(range(len(module.output_sizes)))
    return None


def unwritten_params(model: Any, params: Mapping[str, Any]) -> dict[str, str] | None:
    """``{parameter: what no trainer tensor writes}`` for this worker's ``model`` and the
    trainer's ``params`` (``{checkpoint name: [shape, dtype]}``), or None when a trainer tensor
    cannot be placed (COVERAGE RULE: no verdict)."""
    from vllm.model_executor.models.utils import get_pp_missing_layer_names

    elsewhere = tuple(get_pp_missing_layer_names(model))
    own = dict(model.named_parameters())  # a tied parameter once, under its first name
    got: dict[str, set[Any]] = {}
    for name in params:
        mapped = _target(model, name)
        if mapped is None:  # the model's mapper drops it: nothing of the model needs it
            continue
        target, shard = mapped
        if elsewhere and target.startswith(elsewhere):
            continue
        if target not in own:
            return None
        got.setdefault(target, set()).add(shard)
    out = {}
    for pname in own:
        have = got.get(pname)
        if not have:
            out[pname] = "no trainer tensor loads into it"
            continue
        if None in have:  # a tensor for the whole parameter (a fused checkpoint tensor)
            continue
        module = model.get_submodule(pname.rpartition(".")[0])
        need = _shards(module) or set()
        if need - have:
            missing = ", ".join(sorted(str(s) for s in need - have))
            out[pname] = f"no trainer tensor for its shard(s) {missing}"
    return out
