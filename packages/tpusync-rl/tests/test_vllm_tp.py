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
from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers import linear as L  # noqa: E402
from vllm.model_executor.layers import vocab_parallel_embedding as V  # noqa: E402
from vllm.model_executor.layers.fused_moe import FusedMoEFactory  # noqa: E402
from vllm.model_executor.models.llama import LlamaModel  # noqa: E402
from vllm.model_executor.models.qwen3_moe import Qwen3MoeModel  # noqa: E402

from tpusync.rl import vllm as rlvllm  # noqa: E402
from tpusync.rl.fused import split_fused  # noqa: E402
from tpusync.rl.layout import Box  # noqa: E402
from tpusync.rl.vllm.tp import oversent, worker_boxes, worker_layouts  # noqa: E402


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


class ToyMoe(torch.nn.Module):
    """Two mixture-of-experts layers (llama_ckpt.moe_shapes) built as vLLM builds them: a
    replicated router and ``FusedMoEFactory``'s experts, layer 0 with Qwen3 MoE's checkpoint
    names, layer 1 with Mixtral's (``ckpt_names`` w1 / w2 / w3)."""

    hf_to_vllm_mapper = Qwen3MoeModel.hf_to_vllm_mapper

    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([torch.nn.Module(), torch.nn.Module()])
        for i, (block, names) in enumerate(
            (
                ("mlp", ("gate_proj", "down_proj", "up_proj")),
                ("block_sparse_moe", ("w1", "w2", "w3")),
            )
        ):
            moe = torch.nn.Module()
            moe.gate = L.ReplicatedLinear(
                C.HIDDEN, C.EXPERTS, bias=False, params_dtype=torch.float32
            )
            moe.experts = FusedMoEFactory(
                num_experts=C.EXPERTS,
                top_k=2,
                hidden_size=C.HIDDEN,
                intermediate_size=C.INTER,
                params_dtype=torch.float32,
                prefix=f"model.layers.{i}.{block}.experts",
                ckpt_names=names,
            )
            setattr(self.model.layers[i], block, moe)


def _toy_moe(tp: int, rank: int, expert_parallel: bool = False) -> ToyMoe:
    group = mock.Mock(rank_in_group=rank, world_size=tp)
    single = mock.Mock(rank_in_group=0, world_size=1)
    config = VllmConfig(parallel_config=ParallelConfig(enable_expert_parallel=expert_parallel))
    with (
        set_current_vllm_config(config),
        mock.patch.object(parallel_state, "_TP", group),
        mock.patch.object(parallel_state, "_EP", group),
        mock.patch.object(parallel_state, "_DP", single),
        mock.patch.object(parallel_state, "_PCP", single),
    ):
        return ToyMoe()


def _load(model: torch.nn.Module, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """What vLLM's loader leaves in the parameter ``name`` loads into (a fresh NaN-free start);
    for an expert's tensor, in both of its layer's expert parameters, through the layer's own
    ``load_weights`` (what the model's loader hands it)."""
    if ".experts." in name:
        head, _, tail = name.partition(".experts.")
        experts = model.get_submodule(head + ".experts")
        params = [
            p for n, p in experts.named_parameters() if n.endswith(("w13_weight", "w2_weight"))
        ]
        for param in params:
            param.data.fill_(-7.0)
        assert list(experts.load_weights([(tail, tensor)])), name
        return torch.cat([p.data.flatten() for p in params])
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


def _probe(plan: dict, params: dict, tp: int, toy) -> int:
    """For every rank: the worker's layouts equal ``plan`` and vLLM's loaders read exactly the
    planned box of each tensor. Returns how many (rank, tensor) boxes are cut."""
    split = 0
    for rank in range(tp):
        model = toy(tp, rank)
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
    return split


@pytest.mark.parametrize("tp", [2, 4])
def test_each_rank_reads_exactly_the_planned_slice_with_vllms_own_loaders(tmp_path, tp):
    plan = rlvllm.tp_layouts(C.llama_dir(tmp_path), tp)
    params = rlvllm.checkpoint_params(tmp_path)
    # Everything but the norm is cut (k/v shared by two workers at TP=4).
    assert _probe(plan, params, tp, _toy) == tp * (len(params) - 1)


@pytest.mark.parametrize("tp", [2, 4])
def test_each_rank_reads_exactly_its_slice_of_every_expert(tmp_path, tp):
    """MOE SLICE RULE against vLLM's routed experts: Qwen3 MoE and Mixtral names alike."""
    plan = rlvllm.tp_layouts(C.llama_dir(tmp_path, C.moe_shapes()), tp)
    params = rlvllm.checkpoint_params(tmp_path)
    # Every expert tensor is cut; the two routers are whole.
    assert _probe(plan, params, tp, _toy_moe) == tp * (len(params) - 2)


@pytest.mark.parametrize("ep", [2, 4])
def test_expert_parallel_workers_take_only_their_own_experts_whole(tmp_path, ep):
    """EP RULE: with expert parallelism a worker loads its own experts whole and skips the rest,
    so its part is exactly the experts its loader loads (every one whole) plus the routers; the
    trainer's tensor-parallel plan, which cuts every expert, is not what the workers report."""
    plan = rlvllm.tp_layouts(C.llama_dir(tmp_path, C.moe_shapes()), ep)
    params = rlvllm.checkpoint_params(tmp_path)
    experts = [n for n in params if ".experts." in n]
    held = []
    for rank in range(ep):
        model = _toy_moe(ep, rank, expert_parallel=True)
        live = worker_layouts(model, params, ep)
        assert sorted(n for n in params if live[n] != plan[n]) == sorted(experts)
        part = worker_boxes(model, params, rank, ep)
        for name in experts:
            head, _, tail = name.partition(".experts.")
            loads = bool(
                list(
                    model.get_submodule(head + ".experts").load_weights(
                        [(tail, torch.randn(params[name][0]))]
                    )
                )
            )
            assert (name in part) == loads, (rank, name)
            if loads:
                assert part[name].shape == tuple(params[name][0]), name  # whole
                held.append(name)
        assert all(n in part for n in params if ".experts." not in n)  # the routers
    assert sorted(held) == sorted(experts)  # every expert on exactly one worker


@pytest.mark.parametrize("tp", [2, 4])
def test_split_fused_parts_load_like_the_fused_tensor_and_are_cut_like_llamas(tmp_path, tp):
    """FUSED SPLIT RULE against vLLM's own loaders (Phi-3's model takes Llama's names): a fused
    tensor is taken whole by every worker; its split parts, fed through the mapper with their
    shard ids, leave every rank's parameter exactly as the fused tensor does, and each part is
    planned, reported and read like a Llama projection."""
    root = C.phi3_dir(tmp_path)
    (tmp_path / "llama").mkdir()
    fused = rlvllm.checkpoint_params(root)
    params = split_fused(fused, root)
    assert _probe(rlvllm.tp_layouts(root, tp, params), params, tp, _toy) == tp * (len(params) - 1)
    names = [n for n in fused if n.endswith(("qkv_proj.weight", "gate_up_proj.weight"))]
    whole = rlvllm.tp_layouts(root, tp)
    for rank in range(tp):
        model = _toy(tp, rank)
        assert worker_layouts(model, fused, tp) == whole
        for name in names:
            assert whole[name].box_of(rank).shape == tuple(fused[name][0])
            full = torch.randn(fused[name][0])
            expect = _load(model, name, full)
            param = model.get_parameter(name)
            param.data.fill_(-7.0)
            parts = split_fused({name: full}, root)
            assert len(parts) == (3 if "qkv" in name else 2)
            for part, tensor in parts.items():
                target, shard = model.hf_to_vllm_mapper._map_name_with_shard(part)
                assert target == name and shard is not None
                param.weight_loader(param, tensor, shard)
            assert torch.equal(param.data, expect), (name, rank)
        # OVERSENT RULE: the worker names the fused tensors it takes whole and keeps part of;
        # split, or a Llama checkpoint (norms whole: all kept), nothing.
        over = oversent(model, fused, worker_boxes(model, fused, rank, tp))
        assert sorted(over) == sorted(names), over
        qkv = (C.HEADS + 2 * C.KV_HEADS) * C.HEAD_DIM
        kept = (C.HEADS // tp + 2 * max(C.KV_HEADS // tp, 1)) * C.HEAD_DIM
        assert over[names[0]] == (
            f"{qkv * C.HIDDEN} elements for {names[0]} of {kept * C.HIDDEN}"
        ), over
        assert oversent(model, params, worker_boxes(model, params, rank, tp)) == {}
        llama = rlvllm.checkpoint_params(C.llama_dir(tmp_path / "llama"))
        assert oversent(model, llama, worker_boxes(model, llama, rank, tp)) == {}
