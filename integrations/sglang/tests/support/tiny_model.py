"""TEST-ONLY: the tiny model the SGLang scenarios serve (generator: tpusync.core.tinymodel).

bf16 with a byte-level tokenizer (the server detokenizes streamed output, which must reproduce the
prompt's text exactly), cached under ``<repo>/build/tiny-models``.

Usage: ``path = tiny_model.ensure(root)`` -> a directory that ``transformers`` and SGLang load with
``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

from pathlib import Path

from tpusync.core.tinymodel import TinySpec, tiny_model_dir

SPEC = TinySpec(
    hidden_size=64,
    intermediate_size=128,
    head_dim=16,
    max_positions=512,
    dtype="bfloat16",
    tokenizer="byte_level",
    weight_std=None,
    seed=11,
)


def ensure(repo_root: Path | str) -> Path:
    """The cached tiny model directory, generating it first if needed (atomic rename)."""
    return tiny_model_dir(Path(repo_root) / "build" / "tiny-models", SPEC)
