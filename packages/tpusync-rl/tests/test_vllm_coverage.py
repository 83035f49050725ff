"""COVERAGE RULE of the vLLM backend (``tpusync.rl.vllm.coverage``) on vLLM's own tensor-parallel
layers and Llama name mapper (the toy model of test_vllm_tp.py, no engine): a trainer that leaves
out a tensor, or one shard of a stacked parameter, is named; a layer that would get only some of
its tensors is torn (TORN LAYER RULE); a trainer tensor the mapping cannot place gives no verdict.
The live engines of test_vllm_sampler.py refuse such an init."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import llama_ckpt as C  # noqa: E402
from test_vllm_tp import _toy, _toy_moe  # noqa: E402

from tpusync.rl.vllm.coverage import unwritten_params  # noqa: E402

LAYER = "model.layers.0."


def _params() -> dict[str, list]:
    """Every tensor the toy loads: the checkpoint's, plus the q and k biases of its biased
    stacked q/k/v (the checkpoint has only the v bias)."""
    shapes = dict(C.llama_shapes())
    shapes[LAYER + "self_attn.q_proj.bias"] = [C.HEADS * C.HEAD_DIM]
    shapes[LAYER + "self_attn.k_proj.bias"] = [C.KV_HEADS * C.HEAD_DIM]
    return {n: [s, "float32"] for n, s in shapes.items()}


@pytest.mark.parametrize("tp, rank", [(1, 0), (2, 1)])
def test_a_trainer_that_leaves_a_tensor_or_a_shard_out_is_named(tp, rank):
    model = _toy(tp, rank)
    params = _params()
    assert unwritten_params(model, params) == ({}, ())
    # A whole layer left out (the norm, one parameter): not torn, so partial=True may allow it.
    less = {n: v for n, v in params.items() if n != LAYER + "input_layernorm.weight"}
    norm = {LAYER + "input_layernorm.weight": "no trainer tensor loads into it"}
    assert unwritten_params(model, less) == (norm, ())
    less = {n: v for n, v in params.items() if not n.startswith(LAYER + "self_attn.k_proj.")}
    less.pop(LAYER + "mlp.up_proj.weight")
    stacked = {
        LAYER + "self_attn.qkv_proj.weight": "no trainer tensor for its shard(s) k",
        LAYER + "self_attn.qkv_proj.bias": "no trainer tensor for its shard(s) k",
        LAYER + "mlp.gate_up_proj.weight": "no trainer tensor for its shard(s) 1",
    }
    assert unwritten_params(model, less) == (stacked, tuple(stacked))  # TORN LAYER RULE
    # The checkpoint alone leaves the q and k rows of the stacked bias unwritten; the layer gets
    # its weight and its v bias, so it is torn.
    bias = {LAYER + "self_attn.qkv_proj.bias": "no trainer tensor for its shard(s) k, q"}
    ckpt = {n: [s, "float32"] for n, s in C.llama_shapes().items()}
    assert unwritten_params(model, ckpt) == (bias, tuple(bias))
    # Only the q/k/v biases left out: each is a whole parameter, but of a layer that gets its
    # weight, so still torn.
    less = {n: v for n, v in params.items() if not n.endswith("_proj.bias")}
    qkv_bias = {LAYER + "self_attn.qkv_proj.bias": "no trainer tensor loads into it"}
    assert unwritten_params(model, less) == (qkv_bias, tuple(qkv_bias))


def test_a_tensor_the_mapping_cannot_place_gives_no_verdict():
    params = _params()
    params["model.layers.0.self_attn.rotary.weight"] = [[4], "float32"]
    assert unwritten_params(_toy(1, 0), params) is None


@pytest.mark.parametrize("tp, rank", [(1, 0), (2, 1)])
def test_an_expert_left_out_is_named_and_its_layer_torn(tp, rank):
    """The routed experts stack every expert's projections into two parameters: one expert's
    tensor left out leaves its shard of one of them unwritten (Qwen3 MoE and Mixtral names)."""
    model = _toy_moe(tp, rank)
    params = {n: [s, "float32"] for n, s in C.moe_shapes().items()}
    assert unwritten_params(model, params) == ({}, ())
    less = dict(params)
    less.pop("model.layers.0.mlp.experts.2.up_proj.weight")
    less.pop("model.layers.1.block_sparse_moe.experts.3.w2.weight")
    want = {
        "model.layers.0.mlp.experts.routed_experts.w13_weight": (
            "no trainer tensor for its shard(s) experts.2.up_proj"
        ),
        "model.layers.1.block_sparse_moe.experts.routed_experts.w2_weight": (
            "no trainer tensor for its shard(s) experts.3.w2"
        ),
    }
    assert unwritten_params(model, less) == (want, tuple(want))
