"""Fused checkpoint tensors split into the parts an engine's loader stacks again.

Some checkpoints store a layer's stacked projections as one tensor: Phi-3's (and Phi-4's)
``self_attn.qkv_proj.weight`` is q, k and v one after another by rows, its (and GLM-4's)
``mlp.gate_up_proj.weight`` gate then up. A tensor-parallel rank of vLLM or SGLang keeps rows
``[r * n / tp, (r + 1) * n / tp)`` of EACH part, so its share of the fused tensor is not one box
of it, and tpusync sends it the whole tensor (a TP=N engine pulls N copies of every attention and
MLP projection: nearly the whole model per worker).

FUSED SPLIT RULE: :func:`split_fused` replaces each fused tensor by its parts under the names of
an unfused checkpoint of the same layer (``q_proj`` / ``k_proj`` / ``v_proj``, ``gate_proj`` /
``up_proj``), as row views of the trainer's tensor (no copy for torch and numpy arrays). The
engines' loaders for the listed architectures take those names and stack them into the same
parameters as the fused tensor (vLLM's Phi-3 and GLM-4 models load through Llama's model and its
name mapper, SGLang's through their stacked-parameter lists), so each part is cut like any Llama
projection: one copy of the model in all, and :func:`tpusync.rl.vllm.tp_layouts` plans it (a
vLLM worker places the names by its model's mapper, or GLM-4's by the PACKED NAME RULE). The split is exact:
the parts are the rows the fused loader itself hands each shard id (checked against vLLM's own
loaders in the tests). The trainer publishes the split tensors, and the engine is initialised with
the split names (``params=split_fused(checkpoint_params(model_dir), model_dir)``).

An architecture not listed gets a clear error rather than a guess: its engine's loader may not
take the split names, or may stack them in another order.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# Architectures whose engine loaders (vLLM and SGLang) take the split names of their fused
# checkpoint tensors: Phi-3 / Phi-4 (fused q/k/v and gate/up), GLM-4-0414 / GLM-Z1 (gate/up).
_SPLITS = frozenset({"Phi3ForCausalLM", "Glm4ForCausalLM"})
_QKV = (".qkv_proj.weight", ".qkv_proj.bias")
_GATE_UP = ".gate_up_proj.weight"


def _config(model: str | Path | Mapping[str, Any]) -> Mapping[str, Any]:
    if isinstance(model, Mapping):
        return model
    path = Path(model) / "config.json"
    try:
        return json.loads(path.read_text())
    except OSError as e:
        raise ValueError(f"split_fused: cannot read {path}: {e}") from e


def _parts(name: str, config: Mapping[str, Any]) -> list[tuple[str, int]] | None:
    """``[(part name, rows)]`` of fused tensor ``name``; None when ``name`` is not fused."""
    for leaf in _QKV:
        if name.endswith(leaf):
            heads = int(config["num_attention_heads"])
            kv = int(config.get("num_key_value_heads") or heads)
            head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
            stem, kind = name[: -len(leaf)], leaf.rsplit(".", 1)[1]
            return [
                (f"{stem}.q_proj.{kind}", heads * head_dim),
                (f"{stem}.k_proj.{kind}", kv * head_dim),
                (f"{stem}.v_proj.{kind}", kv * head_dim),
            ]
    if name.endswith(_GATE_UP):
        inter, stem = int(config["intermediate_size"]), name[: -len(_GATE_UP)]
        return [(f"{stem}.gate_proj.weight", inter), (f"{stem}.up_proj.weight", inter)]
    return None


def split_fused(
    tensors: Mapping[str, Any], model: str | Path | Mapping[str, Any]
) -> dict[str, Any]:
    """``tensors`` with every fused tensor replaced by its parts (FUSED SPLIT RULE).

    ``tensors``: ``{checkpoint name: tensor}`` (torch, numpy or any array sliced by rows), or
    ``{name: [shape, dtype]}`` as :func:`tpusync.rl.vllm.checkpoint_params` gives. ``model``: the
    model directory (its ``config.json``) or the config as a dict. Order is kept: the parts take
    the fused tensor's place. Raises ValueError for an architecture not listed, or a fused tensor
    whose rows are not the parts' sum.
    """
    config = _config(model)
    archs = list(config.get("architectures") or [])
    if not _SPLITS.intersection(archs):
        raise ValueError(
            f"split_fused: {archs or 'a model without architectures'} is not one whose engines "
            f"load split parts of fused tensors (known: {', '.join(sorted(_SPLITS))}); publish "
            "its checkpoint names as they are"
        )
    out: dict[str, Any] = {}
    for name, value in tensors.items():
        parts = _parts(name, config)
        if parts is None:
            out[name] = value
            continue
        spec = not hasattr(value, "shape")
        shape = [int(n) for n in (value[0] if spec else value.shape)]
        if not shape or shape[0] != sum(rows for _, rows in parts):
            sizes = " + ".join(f"{rows} ({part.rsplit('.', 2)[1]})" for part, rows in parts)
            raise ValueError(
                f"split_fused: {name} has shape {shape}, not the {sizes} rows its config gives"
            )
        at = 0
        for part, rows in parts:
            out[part] = [[rows, *shape[1:]], value[1]] if spec else value[at : at + rows]
            at += rows
    return out
