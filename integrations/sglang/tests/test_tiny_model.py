"""The test-only tiny model generator (needed by the server scenario): offline, cached, loadable."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import tiny_model


@pytest.fixture(scope="module")
def model_dir() -> Path:
    root = Path(os.environ.get("TPUSYNC_REPO_ROOT", Path(__file__).resolve().parents[3]))
    return tiny_model.ensure(root)


def test_generated_offline_into_build_keyed_by_generator_source(model_dir):
    if os.environ.get("HF_HUB_OFFLINE") != "1":
        pytest.skip("HF_HUB_OFFLINE=1 is set by the integration-sglang nox session")
    assert model_dir.parent.name == "tiny-models" and model_dir.parent.parent.name == "build"
    assert (model_dir / "model.safetensors").exists()
    stamp = (model_dir / "config.json").stat().st_mtime_ns
    assert tiny_model.ensure(model_dir.parents[2]) == model_dir  # cached: not regenerated
    assert (model_dir / "config.json").stat().st_mtime_ns == stamp


def test_model_and_tokenizer_load_and_round_trip(model_dir):
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(model_dir)
    assert (config.model_type, config.num_hidden_layers, config.vocab_size) == ("llama", 2, 512)
    tok = AutoTokenizer.from_pretrained(model_dir)
    text = "the cache page block tpusync sglang"
    ids = tok(text).input_ids
    assert all(0 <= i < 512 for i in ids)
    assert tok.decode(ids, skip_special_tokens=True) == text
