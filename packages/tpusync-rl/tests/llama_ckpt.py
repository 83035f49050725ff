"""A Llama-shaped checkpoint directory made of headers only: ``config.json`` and a safetensors
file whose header names the tensors (the data is zeros). Enough for ``checkpoint_params`` and
``tp_layouts``, which read nothing else."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

# The toy model of the TP slice tests: 4 query heads, 2 key/value heads of 8, a 100-word vocabulary.
HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTER, VOCAB = 4, 2, 8, 32, 48, 100
# Its mixture-of-experts kin: 4 experts of INTER rows in each of two layers.
EXPERTS = 4


def write_safetensors(path: Path, tensors: dict) -> None:
    """``tensors``: ``{name: (safetensors dtype, shape, nbytes)}``."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, (dtype, shape, nbytes) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))


def llama_shapes() -> dict[str, list[int]]:
    layer = "model.layers.0."
    return {
        "model.embed_tokens.weight": [VOCAB, HIDDEN],
        layer + "self_attn.q_proj.weight": [HEADS * HEAD_DIM, HIDDEN],
        layer + "self_attn.k_proj.weight": [KV_HEADS * HEAD_DIM, HIDDEN],
        layer + "self_attn.v_proj.weight": [KV_HEADS * HEAD_DIM, HIDDEN],
        layer + "self_attn.v_proj.bias": [KV_HEADS * HEAD_DIM],
        layer + "self_attn.o_proj.weight": [HIDDEN, HEADS * HEAD_DIM],
        layer + "mlp.gate_proj.weight": [INTER, HIDDEN],
        layer + "mlp.up_proj.weight": [INTER, HIDDEN],
        layer + "mlp.down_proj.weight": [HIDDEN, INTER],
        layer + "input_layernorm.weight": [HIDDEN],
        "lm_head.weight": [VOCAB, HIDDEN],
    }


def moe_shapes() -> dict[str, list[int]]:
    """Two mixture-of-experts layers: layer 0 with Qwen3 MoE's names (``mlp.gate`` routes,
    ``mlp.experts.<i>.{gate,up,down}_proj``), layer 1 with Mixtral's (``block_sparse_moe.gate``,
    ``block_sparse_moe.experts.<i>.{w1,w3,w2}``)."""
    qwen, mixtral = "model.layers.0.mlp.", "model.layers.1.block_sparse_moe."
    out = {qwen + "gate.weight": [EXPERTS, HIDDEN], mixtral + "gate.weight": [EXPERTS, HIDDEN]}
    for e in range(EXPERTS):
        for prefix, (gate, up, down) in (
            (qwen, ("gate_proj", "up_proj", "down_proj")),
            (mixtral, ("w1", "w3", "w2")),
        ):
            out[f"{prefix}experts.{e}.{gate}.weight"] = [INTER, HIDDEN]
            out[f"{prefix}experts.{e}.{up}.weight"] = [INTER, HIDDEN]
            out[f"{prefix}experts.{e}.{down}.weight"] = [HIDDEN, INTER]
    return out


def llama_dir(root: Path, shapes: dict[str, list[int]] | None = None) -> Path:
    """The checkpoint of ``shapes`` (default :func:`llama_shapes`) in ``root``."""
    config = {"num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "vocab_size": VOCAB}
    (root / "config.json").write_text(json.dumps(config))
    shapes = llama_shapes() if shapes is None else shapes
    write_safetensors(
        root / "model.safetensors", {n: ("F32", s, 4 * math.prod(s)) for n, s in shapes.items()}
    )
    return root


def phi3_dir(root: Path) -> Path:
    """The toy layer's checkpoint as Phi-3 stores it (``config.json`` names Phi3ForCausalLM): q /
    k / v fused into ``qkv_proj``, gate / up into ``gate_up_proj``."""
    layer, fused = "model.layers.0.", ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    shapes = {n: s for n, s in llama_shapes().items() if n.split(".")[-2] not in fused}
    shapes[layer + "self_attn.qkv_proj.weight"] = [(HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN]
    shapes[layer + "mlp.gate_up_proj.weight"] = [2 * INTER, HIDDEN]
    llama_dir(root, shapes)
    config = json.loads((root / "config.json").read_text())
    config.update(architectures=["Phi3ForCausalLM"], hidden_size=HIDDEN, intermediate_size=INTER)
    (root / "config.json").write_text(json.dumps(config))
    return root
