"""The vLLM glue's pure parts (no vLLM needed): checkpoint headers, init info, lazy import."""

from __future__ import annotations

import subprocess
import sys

import pytest
from llama_ckpt import llama_dir, moe_shapes, write_safetensors

from tpusync.rl import vllm as rlvllm


def test_checkpoint_params_reads_names_shapes_dtypes_from_headers(tmp_path):
    write_safetensors(
        tmp_path / "model-00001.safetensors",
        {
            "model.embed_tokens.weight": ("F32", [10, 4], 160),
            "lm_head.weight": ("BF16", [10, 4], 80),
        },
    )
    write_safetensors(tmp_path / "model-00002.safetensors", {"model.norm.weight": ("F32", [4], 16)})
    assert rlvllm.checkpoint_params(tmp_path) == {
        "model.embed_tokens.weight": [[10, 4], "float32"],
        "lm_head.weight": [[10, 4], "bfloat16"],
        "model.norm.weight": [[4], "float32"],
    }
    info = rlvllm.init_info(
        control="tcp://127.0.0.1:1", replica=2, params=rlvllm.checkpoint_params(tmp_path)
    )
    assert info["replica"] == 2 and info["params"]["model.norm.weight"] == [[4], "float32"]


def test_checkpoint_params_refuses_a_directory_without_safetensors(tmp_path):
    with pytest.raises(ValueError, match="no \\*.safetensors file"):
        rlvllm.checkpoint_params(tmp_path)
    write_safetensors(tmp_path / "x.safetensors", {"w": ("F8_E4M3", [2], 2)})
    with pytest.raises(ValueError, match="unsupported dtype F8_E4M3"):
        rlvllm.checkpoint_params(tmp_path)


def test_importing_the_glue_does_not_import_vllm():
    code = "import sys, tpusync.rl.vllm; assert 'vllm' not in sys.modules, 'vllm imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _boxes(layout):
    return {r: (b.lo, b.hi) for r, b in layout.shards}


def test_tp_layouts_give_each_worker_the_slice_its_vllm_loader_keeps(tmp_path):
    plan = rlvllm.tp_layouts(llama_dir(tmp_path), 2)
    a = "model.layers.0.self_attn."
    assert _boxes(plan[a + "q_proj.weight"]) == {0: ((0, 0), (16, 32)), 1: ((16, 0), (32, 32))}
    assert _boxes(plan[a + "k_proj.weight"]) == {0: ((0, 0), (8, 32)), 1: ((8, 0), (16, 32))}
    assert _boxes(plan[a + "v_proj.bias"]) == {0: ((0,), (8,)), 1: ((8,), (16,))}
    # Row-parallel: columns; the MLP the same way.
    assert _boxes(plan[a + "o_proj.weight"]) == {0: ((0, 0), (32, 16)), 1: ((0, 16), (32, 32))}
    m = "model.layers.0.mlp."
    assert _boxes(plan[m + "gate_proj.weight"]) == {0: ((0, 0), (24, 32)), 1: ((24, 0), (48, 32))}
    assert _boxes(plan[m + "down_proj.weight"]) == {0: ((0, 0), (32, 24)), 1: ((0, 24), (32, 48))}
    # The vocabulary is padded to 128 rows and split 64 / 64: worker 1 holds the 36 real ones.
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert _boxes(plan[name]) == {0: ((0, 0), (64, 32)), 1: ((64, 0), (100, 32))}
    assert _boxes(plan["model.layers.0.input_layernorm.weight"]) == {
        0: ((0,), (32,)),
        1: ((0,), (32,)),
    }


def test_tp_layouts_cut_every_expert_like_a_dense_mlp_and_keep_the_router_whole(tmp_path):
    """MOE SLICE RULE, plan side: under Qwen3 MoE's names and Mixtral's alike, each expert's gate
    and up projections are cut by rows and its down projection by columns; the router is whole."""
    plan = rlvllm.tp_layouts(llama_dir(tmp_path, moe_shapes()), 2)
    rows = {0: ((0, 0), (24, 32)), 1: ((24, 0), (48, 32))}
    columns = {0: ((0, 0), (32, 24)), 1: ((0, 24), (32, 48))}
    for e in range(4):
        q, m = f"model.layers.0.mlp.experts.{e}.", f"model.layers.1.block_sparse_moe.experts.{e}."
        for name in (
            q + "gate_proj.weight",
            q + "up_proj.weight",
            m + "w1.weight",
            m + "w3.weight",
        ):
            assert _boxes(plan[name]) == rows, name
        for name in (q + "down_proj.weight", m + "w2.weight"):
            assert _boxes(plan[name]) == columns, name
    whole = {0: ((0, 0), (4, 32)), 1: ((0, 0), (4, 32))}
    assert _boxes(plan["model.layers.0.mlp.gate.weight"]) == whole
    assert _boxes(plan["model.layers.1.block_sparse_moe.gate.weight"]) == whole


def test_tp_layouts_replicate_kv_heads_when_tp_exceeds_them_and_refuse_uneven_splits(tmp_path):
    plan = rlvllm.tp_layouts(llama_dir(tmp_path), 4)
    k = _boxes(plan["model.layers.0.self_attn.k_proj.weight"])
    # Two kv heads of 8 rows for four workers: workers 0, 1 share head 0; workers 2, 3 head 1.
    assert k == {
        0: ((0, 0), (8, 32)),
        1: ((0, 0), (8, 32)),
        2: ((8, 0), (16, 32)),
        3: ((8, 0), (16, 32)),
    }
    q = _boxes(plan["model.layers.0.self_attn.q_proj.weight"])
    assert [q[r][0][0] for r in range(4)] == [0, 8, 16, 24]
    assert all(lay.shape for lay in rlvllm.tp_layouts(tmp_path, 1).values())
    with pytest.raises(ValueError, match="does not split 3 ways"):
        rlvllm.tp_layouts(tmp_path, 3)
