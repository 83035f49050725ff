"""The tiny model the vLLM tests and ``tpusync bench vllm`` run (see tpusync.core.tinymodel).

fp32 with a whitespace tokenizer, and 16K positions because the vLLM bench runs 8K-token prompts.
"""

from __future__ import annotations

from pathlib import Path

from tpusync.core.tinymodel import TinySpec
from tpusync.core.tinymodel import tiny_model_dir as _tiny_model_dir

SPEC = TinySpec(max_positions=16384, dtype="float32", tokenizer="whitespace")


def tiny_model_dir(root: Path | None = None) -> Path:
    """Path of the cached vLLM tiny model under ``root`` (default ``$TPUSYNC_TEST_CACHE``)."""
    return _tiny_model_dir(root, SPEC)
