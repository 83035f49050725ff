"""COVERAGE RULE of the vLLM backend (``tpusync.rl.vllm.coverage``) on vLLM's own tensor-parallel
layers and Llama name mapper (the toy model of test_vllm_tp.py, no engine): a trainer that leaves
out a tensor, or one shard of a stacked parameter, is named; a layer that would get only some of
its tensors is torn (TORN LAYER RULE); a trainer tensor the mapping cannot place gives no verdict;
stacked names without a mapper are placed by the model's packed modules (PACKED NAME RULE), and
parameters vLLM derives after loading need no trainer tensor (DERIVED PARAMETER RULE). The live
engines of test_vllm_sampler.py refuse such an init."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import llama_ckpt as C  # noqa: E402
import torch  # noqa: E402
from test_vllm_tp import _toy, _toy_moe  # noqa: E402
from vllm.model_executor.model_loader.reload import record_metadata_for_reloading  # noqa: E402

from tpusync.rl.vllm.coverage import unwritten_params  # noqa: E402
from tpusync.rl.vllm.tp import worker_layouts  # noqa: E402

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


def _packed(tp: int, rank: int) -> torch.nn.Module:
    """The toy stacked the way DeepSeek-V2/V3 stack: no name mapper, the stacked modules listed
    in ``packed_modules_mapping`` (PACKED NAME RULE)."""
    model = _toy(tp, rank)
    model.hf_to_vllm_mapper = None
    model.packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
    return model


@pytest.mark.parametrize("tp, rank", [(1, 0), (2, 1)])
def test_stacked_names_without_a_mapper_are_placed_by_the_packed_modules(tp, rank):
    """PACKED NAME RULE: without it no q / k / v or gate / up tensor maps to a parameter, so
    there is no verdict at all; with it the verdicts and the slices are the mapper's."""
    model, mapped = _packed(tp, rank), _toy(tp, rank)
    params = _params()
    assert unwritten_params(model, params) == ({}, ())
    assert worker_layouts(model, params, tp) == worker_layouts(mapped, params, tp)
    less = dict(params)
    less.pop(LAYER + "mlp.up_proj.weight")
    less.pop(LAYER + "self_attn.v_proj.weight")
    want = {
        LAYER + "self_attn.qkv_proj.weight": "no trainer tensor for its shard(s) v",
        LAYER + "mlp.gate_up_proj.weight": "no trainer tensor for its shard(s) 1",
    }
    assert unwritten_params(model, less) == (want, tuple(want))
    # A name the packed table does not list is still no verdict.
    assert unwritten_params(model, {**params, LAYER + "mlp.fc9.weight": [[4], "float32"]}) is None


def test_parameters_vllm_derives_after_loading_are_nobody_s_to_write():
    """DERIVED PARAMETER RULE: a parameter registered on a layer after vLLM recorded the built
    model (as MLA attention's W_UV after loading) needs no trainer tensor; one the record has
    (the norm) still does."""
    model = _toy(1, 0)
    record_metadata_for_reloading(model)
    attn = model.get_submodule(LAYER + "self_attn")
    attn.W_UV = torch.nn.Parameter(torch.zeros(2, 3), requires_grad=False)
    params = _params()
    assert unwritten_params(model, params) == ({}, ())
    less = {n: v for n, v in params.items() if n != LAYER + "input_layernorm.weight"}
    norm = {LAYER + "input_layernorm.weight": "no trainer tensor loads into it"}
    assert unwritten_params(model, less) == (norm, ())
    # Without vLLM's record every parameter counts: the derived one is named (not torn: its
    # module holds no other parameter of its own).
    bare = _toy(1, 0)
    bare.get_submodule(LAYER + "self_attn").W_UV = torch.nn.Parameter(torch.zeros(2, 3))
    derived = {LAYER + "self_attn.W_UV": "no trainer tensor loads into it"}
    assert unwritten_params(bare, params) == (derived, ())
