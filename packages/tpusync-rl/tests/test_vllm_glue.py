"""The vLLM glue's pure parts (no vLLM needed): checkpoint headers, init info, lazy import."""

from __future__ import annotations

import json
import struct
import subprocess
import sys

import pytest

from tpusync.rl import vllm as rlvllm


def _write_safetensors(path, tensors: dict) -> None:
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, (dtype, shape, nbytes) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))


def test_checkpoint_params_reads_names_shapes_dtypes_from_headers(tmp_path):
    _write_safetensors(
        tmp_path / "model-00001.safetensors",
        {
            "model.embed_tokens.weight": ("F32", [10, 4], 160),
            "lm_head.weight": ("BF16", [10, 4], 80),
        },
    )
    _write_safetensors(
        tmp_path / "model-00002.safetensors", {"model.norm.weight": ("F32", [4], 16)}
    )
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
    _write_safetensors(tmp_path / "x.safetensors", {"w": ("F8_E4M3", [2], 2)})
    with pytest.raises(ValueError, match="unsupported dtype F8_E4M3"):
        rlvllm.checkpoint_params(tmp_path)


def test_importing_the_glue_does_not_import_vllm():
    code = "import sys, tpusync.rl.vllm; assert 'vllm' not in sys.modules, 'vllm imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
