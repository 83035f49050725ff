"""Which of a vLLM worker's parameters the trainer's tensors would leave unwritten.

A trainer that leaves a checkpoint tensor out (or publishes it under a name the model maps
nowhere) does not make vLLM's reload fail. vLLM 0.32's layerwise reload puts a layer that got no
tensor back as it was, with a warning in the log ("Failed to load weights"), so the engine serves
that layer's old version beside the new ones; and it rebuilds a layer that got only some of its
tensors (a stacked ``qkv_proj`` without its k rows) from fresh, uninitialised memory where the
missing ones should be. Neither is what an RL sampler may serve.

COVERAGE RULE (vLLM backend): :func:`unwritten_params` names, at ``init``, every parameter of
this worker's model that no trainer tensor loads into, and every stacked parameter (vLLM's
``QKVParallelLinear``, ``MergedColumnParallelLinear``, and the routed experts' stacked
``w13_weight`` / ``w2_weight``: one shard per expert and projection) some of whose shards no
trainer tensor names, by the same name mapping the slices use
(:func:`tpusync.rl.vllm.tp._target`: the model's ``hf_to_vllm_mapper``, for one expert's
tensor its layer's expert mapping, MOE SLICE RULE, and for a model that stacks by a list of its
own the model's ``packed_modules_mapping``, PACKED NAME RULE). Parameters vLLM derives from
others after loading (DERIVED PARAMETER RULE, :func:`_derived`) need no trainer tensor. It
looks at names only, never at values. It decides only when it can place every trainer tensor:
a name that maps to no parameter of this worker, other than one of another pipeline stage,
means the mapping is not the model's own (a model whose ``load_weights`` stacks by rules of its
own that its packed modules do not list), and then it returns None - no verdict - rather than
refuse a complete trainer.

TORN LAYER RULE: vLLM reloads layer by layer, a layer being one module with the parameters it
holds directly. A layer that gets no tensor at all keeps its old values, which a trainer that
publishes only the parameters it trains may want (``partial``); a layer that gets some tensors
but not all is rebuilt whole with the rest uninitialised, which nobody wants. So
:func:`unwritten_params` also says which unwritten parameters lie in such a torn layer, and the
engine refuses those even with ``partial``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from tpusync.rl.vllm.tp import _target, expert_shards


class Coverage(NamedTuple):
    """What the trainer's tensors leave unwritten on one worker (COVERAGE RULE)."""

    unwritten: dict[str, str]  # parameter -> what no trainer tensor writes of it
    torn: tuple[str, ...]  # those of them whose layer gets other tensors (TORN LAYER RULE)


def _shards(module: Any, leaf: str) -> set[Any]:
    """The shard ids a stacked vLLM layer's parameter ``leaf`` is loaded from; empty: not
    stacked. Routed experts: one per expert and projection (:func:`tp.expert_shards`)."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear

    if isinstance(module, RoutedExperts):
        return expert_shards(module, leaf)
    if isinstance(module, QKVParallelLinear):
        return {"q", "k", "v"}
    if isinstance(module, MergedColumnParallelLinear):
        return set(range(len(module.output_sizes)))
    return set()


def _derived(model: Any) -> set[int]:
    """DERIVED PARAMETER RULE: the ids of the parameters vLLM's post-load processing registered
    on a layer after the model was built (MLA attention's ``W_UV`` / ``W_UK_T``, computed from
    ``kv_b_proj`` by ``process_weights_after_loading`` and computed again after every reload).
    No checkpoint tensor loads into them, so they are no trainer's to write. Found by vLLM's
    reload record (``record_metadata_for_reloading``, taken right after the model was built):
    a layer's parameter that the record lacks, other than the names the record always leaves
    out (``SKIP_TENSORS``: biases, routing biases, expert maps). Empty where the record is not
    there (another vLLM): then every parameter counts."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
        from vllm.model_executor.model_loader.reload.meta import SKIP_TENSORS
    except ImportError:
        return set()
    out = set()
    for layer in model.modules():
        info = LAYERWISE_INFO.get(layer)
        if info is None:
            continue
        recorded = info.restore_metadata[0]
        for leaf, param in layer.named_parameters(recurse=False):
            if leaf not in recorded and leaf not in SKIP_TENSORS:
                out.add(id(param))
    return out


def unwritten_params(model: Any, params: Mapping[str, Any]) -> Coverage | None:
    """What the trainer's ``params`` (``{checkpoint name: [shape, dtype]}``) leave unwritten of
    this worker's ``model``, or None when a trainer tensor cannot be placed (COVERAGE RULE: no
    verdict)."""
    from vllm.model_executor.models.utils import get_pp_missing_layer_names

    elsewhere = tuple(get_pp_missing_layer_names(model))
    derived = _derived(model)
    # A tied parameter once, under its first name; none that vLLM derives after loading.
    own = {n: p for n, p in model.named_parameters() if id(p) not in derived}
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
    unwritten = {}
    for pname in own:
        have = got.get(pname)
        if not have:
            unwritten[pname] = "no trainer tensor loads into it"
            continue
        if None in have:  # a tensor for the whole parameter (a fused checkpoint tensor)
            continue
        path, _, leaf = pname.rpartition(".")
        need = _shards(model.get_submodule(path), leaf)
        if need - have:
            missing = ", ".join(sorted(str(s) for s in need - have))
            unwritten[pname] = f"no trainer tensor for its shard(s) {missing}"
    fed = {p.rpartition(".")[0] for p in got}  # layers that get some tensor
    torn = tuple(p for p in unwritten if p.rpartition(".")[0] in fed)
    return Coverage(unwritten, torn)
