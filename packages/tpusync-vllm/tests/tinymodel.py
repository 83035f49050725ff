"""The tiny model generator lives in the package (the vllm bench uses it too)."""

from tpusync.vllm.tinymodel import tiny_model_dir

__all__ = ["tiny_model_dir"]
