"""SHAPE RULE of the vLLM backend (``tpusync.rl.vllm.shapes``) on vLLM's own tensor-parallel layers
and Llama name mapper (the toy model of test_vllm_tp.py, no engine): the checkpoint's shapes fit
every rank; a tensor one row or column off is named, also where vLLM's own loader would take it
without a word; a name the mapping cannot place is left to the COVERAGE RULE. The live engines
of test_vllm_sampler.py refuse such an init."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import llama_ckpt as C  # noqa: E402
import torch  # noqa: E402
from test_vllm_tp import _load, _toy, _toy_moe  # noqa: E402

from tpusync.rl.vllm.shapes import shape_mismatches  # noqa: E402

RANKS = [(1, 0), (2, 1), (4, 3)]


def _params(**shapes: list[int]) -> dict[str, list]:
    out = {n: [s, "float32"] for n, s in C.llama_shapes().items()}
    out.update({n: [s, "float32"] for n, s in shapes.items()})
    return out


@pytest.mark.parametrize("tp, rank", RANKS)
def test_the_checkpoints_shapes_fit_every_rank(tp, rank):
    model = _toy(tp, rank)
    assert shape_mismatches(model, _params()) == {}
    for name, shape in C.llama_shapes().items():  # and vLLM's own loaders take them
        _load(model, name, torch.randn(shape))


def _one_off(model, shapes: dict[str, list[int]]) -> list[tuple[str, int]]:
    """Each tensor of ``shapes`` one row or column longer than the checkpoint's is named by the
    SHAPE RULE; returns the ``(name, dim)`` that vLLM's own loader takes without a word."""
    params = {n: [s, "float32"] for n, s in shapes.items()}
    silent = []
    for name, shape in shapes.items():
        for dim in range(len(shape)):
            off = list(shape)
            off[dim] += 1
            wrong = shape_mismatches(model, {**params, name: [off, "float32"]})
            assert wrong == {name: f"the trainer's is {off}, this engine loads {shape}"}, name
            try:
                _load(model, name, torch.randn(off))
                silent.append((name, dim))
            except (AssertionError, RuntimeError):
                pass
    return silent


@pytest.mark.parametrize("tp, rank", RANKS)
def test_a_tensor_one_row_or_column_off_is_named(tp, rank):
    silent = _one_off(_toy(tp, rank), C.llama_shapes())
    # The column-parallel loaders narrow the rows they keep from row 0 at every TP size: a
    # tensor with an extra row loads, wrongly, unless refused here.
    layer = "model.layers.0."
    rows = [(layer + p, 0) for p in ("self_attn.q_proj.weight", "mlp.gate_proj.weight")]
    assert set(rows) <= set(silent), silent


def test_a_trainer_of_another_vocabulary_is_named_for_both_vocabulary_tensors():
    vocab = [C.VOCAB + 28, C.HIDDEN]  # a tokenizer with added tokens
    wrong = shape_mismatches(
        _toy(2, 0), _params(**{"model.embed_tokens.weight": vocab, "lm_head.weight": vocab})
    )
    want = f"the trainer's is {vocab}, this engine loads {[C.VOCAB, C.HIDDEN]}"
    assert wrong == {"model.embed_tokens.weight": want, "lm_head.weight": want}


def test_a_name_the_mapping_cannot_place_is_not_checked_here():
    params = _params(**{"model.layers.0.self_attn.rotary.weight": [4]})
    assert shape_mismatches(_toy(1, 0), params) == {}


@pytest.mark.parametrize("tp, rank", RANKS)
def test_an_expert_one_row_or_column_off_is_named(tp, rank):
    """Qwen3 MoE and Mixtral names: the checkpoint's shapes fit; an expert one row or column off
    is named, also where the routed experts' loader would take it without a word."""
    model = _toy_moe(tp, rank)
    params = {n: [s, "float32"] for n, s in C.moe_shapes().items()}
    assert shape_mismatches(model, params) == {}
    for name, shape in C.moe_shapes().items():  # and the loaders take them
        _load(model, name, torch.randn(shape))
    silent = _one_off(model, C.moe_shapes())
    # Split across ranks, the loader takes rows // tp of a gate projection from each rank's
    # offset: one extra row goes unnoticed.
    gate = ("model.layers.0.mlp.experts.0.gate_proj.weight", 0)
    assert (gate in silent) == (tp > 1), silent
