"""TP SLICE CONTRACT against vLLM's own weight loaders, for every rank of TP=2 and TP=4.

No engine runs: vLLM's tensor-parallel layers are built for each rank (the TP group stubbed to
that rank and size) in a toy model with Llama's names, and each checkpoint tensor is fed to the
layer's real weight loader. The slice the worker reads from the live model must equal the plan the
trainer computes from config.json, and must be exactly what the loader reads: the loader's result
is the same when everything outside the slice is NaN (it reads nothing else), and NaN inside the
slice all reaches the parameter (it reads all of it).
"""

from __future__ import annotations

from unittest import mock

import pytest

pytest.importorskip("vllm")

import llama_ckpt as C  # noqa: E402
import torch  # noqa: E402
import vllm.distributed.parallel_state as parallel_state  # noqa: E402
from vllm.model_executor.layers import linear as L  # noqa: E402
from vllm.model_executor.layers import vocab_parallel_embedding as V  # noqa: E402
from vllm.model_executor.models.llama import LlamaModel  # noqa: E402

from tpusync.rl import vllm as rlvllm  # noqa: E402
from tpusync.rl.layout import Box  # noqa: E402
from tpusync.rl.vllm.tp import worker_layouts  # noqa: E402


class ToyLlama(torch.nn.Module):
    """One Llama layer's tensor-parallel modules under the names vLLM's Llama gives them."""

    hf_to_vllm_mapper = LlamaModel.hf_to_vllm_mapper

    def __init__(self) -> None:
        super().__init__()
        f32 = {"params_dtype": torch.float32}
        attn, mlp, layer = torch.nn.Module(), torch.nn.Module(), torch.nn.Module()
        attn.qkv_proj = L.QKVParallelLinear(
            C.HIDDEN, C.HEAD_DIM, C.HEADS, C.KV_HEADS, bias=True, **f32
        )
        attn.o_proj = L.RowParallelLinear(C.HEADS * C.HEAD_DIM, C.HIDDEN, bias=False, **f32)
        mlp.gate_up_proj = L.MergedColumnParallelLinear(C.HIDDEN, [C.INTER] * 2, bias=False, **f32)
        mlp.down_proj = L.RowParallelLinear(C.INTER, C.HIDDEN, bias=False, **f32)
        layer.self_attn, layer.mlp = attn, mlp
        layer.input_layernorm = torch.nn.Module()
        layer.input_layernorm.weight = torch.nn.Parameter(torch.zeros(C.HIDDEN))
        self.model = torch.nn.Module()
        self.model.embed_tokens = V.VocabParallelEmbedding(C.VOCAB, C.HIDDEN, **f32)
        self.model.layers = torch.nn.ModuleList([layer])
        self.lm_head = V.ParallelLMHead(C.VOCAB, C.HIDDEN, **f32)


def _toy(tp: int, rank: int) -> ToyLlama:
    group = mock.Mock(rank_in_group=rank, world_size=tp)
    with mock.patch.object(parallel_state, "_TP", group):
        return ToyLlama()


def _load(model: ToyLlama, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """What vLLM's loader leaves in the parameter ``name`` loads into (a fresh NaN-free start)."""
    target, shard = model.hf_to_vllm_mapper._map_name_with_shard(name)
    param = model.get_parameter(target)
    param.data.fill_(-7.0)
    loader = getattr(param, "weight_loader", None)
    if loader is None:  # a plain parameter (the norm): copied whole
        param.data.copy_(tensor)
    elif shard is None:
        loader(param, tensor)
    else:
        loader(param, tensor, shard)
    return param.data.clone()


@pytest.mark.parametrize("tp", [2, 4])
def test_each_rank_reads_exactly_the_planned_slice_with_vllms_own_loaders(tmp_path, tp):
    plan = rlvllm.tp_layouts(C.llama_dir(tmp_path), tp)
    params = rlvllm.checkpoint_params(tmp_path)
    split = 0
    for rank in range(tp):
        model = _toy(tp, rank)
        live = worker_layouts(model, params, tp)
        assert live == plan  # the worker's sampler layout is the trainer's plan, every tensor
        for name, (shape, _dtype) in params.items():
            box = plan[name].box_of(rank)
            inside = Box((0,) * len(shape), tuple(shape)).local_slices(box)
            full = torch.randn(shape)
            expect = _load(model, name, full)
            outside_nan = torch.full(shape, float("nan"))
            outside_nan[inside] = full[inside]
            assert torch.equal(_load(model, name, outside_nan), expect), (name, rank)
            inside_nan = full.clone()
            inside_nan[inside] = float("nan")
            assert int(_load(model, name, inside_nan).isnan().sum()) == box.size, (name, rank)
            split += box.shape != tuple(shape)
    # Everything but the norm is cut (k/v shared by two workers at TP=4).
    assert split == tp * (len(params) - 1)
