"""FUSED SPLIT RULE (tpusync.rl.fused) without an engine: what split_fused gives and refuses.
(That the parts load like the fused tensor is checked against vLLM's loaders in test_vllm_tp.py.)
"""

from __future__ import annotations

import json

import llama_ckpt as C
import numpy as np
import pytest
import torch

from tpusync.rl import vllm as rlvllm
from tpusync.rl.fused import split_fused

QKV = "model.layers.0.self_attn.qkv_proj.weight"
GATE_UP = "model.layers.0.mlp.gate_up_proj.weight"


def test_parts_are_row_views_in_the_fused_tensors_place(tmp_path):
    root = C.phi3_dir(tmp_path)
    params = rlvllm.checkpoint_params(root)
    q, kv, inter = C.HEADS * C.HEAD_DIM, C.KV_HEADS * C.HEAD_DIM, C.INTER
    for make in (torch.randn, lambda *s: np.random.default_rng(0).standard_normal(s)):
        tensors = {n: make(*shape) for n, (shape, _dtype) in params.items()}
        out = split_fused(tensors, root)
        # The parts take the fused tensor's place; everything else is passed on as it is.
        names = list(out)
        at = names.index("model.layers.0.self_attn.q_proj.weight")
        assert names[at : at + 3] == [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
        assert QKV not in out and GATE_UP not in out and len(out) == len(tensors) + 3
        assert all(out[n] is t for n, t in tensors.items() if n not in (QKV, GATE_UP))
        stacked = [("self_attn", QKV, {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)})]
        stacked.append(("mlp", GATE_UP, {"gate": (0, inter), "up": (inter, 2 * inter)}))
        for module, fused, rows in stacked:
            for part, (lo, hi) in rows.items():
                view = out[f"model.layers.0.{module}.{part}_proj.weight"]
                assert view.shape == (hi - lo, C.HIDDEN)
                view[0, 0] = 12345.0  # a view: the write lands in the trainer's fused tensor
                assert tensors[fused][lo, 0] == 12345.0, (fused, part)
    # Shapes and dtypes ([shape, dtype], as checkpoint_params gives) split the same way.
    spec = split_fused(params, root)
    assert spec["model.layers.0.self_attn.k_proj.weight"] == [[kv, C.HIDDEN], "float32"]
    assert spec["model.layers.0.mlp.up_proj.weight"] == [[inter, C.HIDDEN], "float32"]
    assert list(spec) == list(split_fused(tensors, root))


def test_what_it_does_not_know_is_refused(tmp_path):
    root = C.phi3_dir(tmp_path)
    params = rlvllm.checkpoint_params(root)
    shape, dtype = params[QKV]
    short = {**params, QKV: [[shape[0] - 1, shape[1]], dtype]}
    with pytest.raises(ValueError, match=r"qkv_proj.weight has shape \[63, 32\], not the 32 \(q_"):
        split_fused(short, root)
    config = json.loads((root / "config.json").read_text())
    with pytest.raises(ValueError, match="is not one whose engines load split parts"):
        split_fused(params, {**config, "architectures": ["GPTNeoXForCausalLM"]})
    with pytest.raises(ValueError, match="split_fused: cannot read .*config.json"):
        split_fused(params, tmp_path / "nowhere")
    # A model of a known architecture without fused tensors passes through unchanged.
    (tmp_path / "llama").mkdir()
    llama = rlvllm.checkpoint_params(C.llama_dir(tmp_path / "llama"))
    assert split_fused(llama, config) == llama


def test_glm4_splits_its_fused_gate_up():
    """GLM-4-0414's checkpoint fuses gate / up only (its q / k / v are separate, with biases)."""
    config = {"architectures": ["Glm4ForCausalLM"], "intermediate_size": 6, "hidden_size": 4}
    config.update(num_attention_heads=2, num_key_value_heads=1, head_dim=2)
    layer = "model.layers.3."
    tensors = {
        layer + "self_attn.q_proj.bias": torch.zeros(4),
        layer + "mlp.gate_up_proj.weight": torch.arange(48.0).reshape(12, 4),
        layer + "mlp.down_proj.weight": torch.zeros(4, 6),
    }
    out = split_fused(tensors, config)
    assert list(out) == [
        layer + "self_attn.q_proj.bias",
        layer + "mlp.gate_proj.weight",
        layer + "mlp.up_proj.weight",
        layer + "mlp.down_proj.weight",
    ]
    fused = tensors[layer + "mlp.gate_up_proj.weight"]
    assert torch.equal(out[layer + "mlp.gate_proj.weight"], fused[:6])
    assert torch.equal(out[layer + "mlp.up_proj.weight"], fused[6:])
