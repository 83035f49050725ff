"""A tiny random-weight Llama and a locally trained tokenizer, generated on this machine.

Tests, benchmarks and demos of the framework packages (vLLM, SGLang, RL) need a real model
directory that ``transformers``, vLLM and SGLang load offline. Nothing is downloaded and nothing
is committed: :func:`tiny_model_dir` builds the directory from fixed seeds and caches it under
``<root>/tiny-llama-<digest>``, the digest covering this file's source and the :class:`TinySpec`,
so editing the generator or the spec makes a fresh model and repeated runs reuse it.

CACHE CONTRACT: a cached directory is complete (it appears by an atomic rename of a finished
build); concurrent builders of the same digest race harmlessly (the loser's copy is deleted).

Needs ``torch``, ``transformers`` and ``tokenizers`` (imported when a model is built, never at
import of this module: tpusync-core itself depends on none of them).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
from pathlib import Path
from typing import Any, Literal

WORDS = (
    "the a an of to in and for on with at by from block cache host disk tier key value page "
    "token prefix store load save pin evict layer head model engine request batch stream copy "
    "memory network router score hit miss tpusync vllm sglang offload restart warm cold fast slow"
).split()


@dataclasses.dataclass(frozen=True)
class TinySpec:
    """The shape of a tiny model. Every field is part of the cache digest."""

    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    vocab_size: int = 512
    max_positions: int = 16384
    dtype: Literal["float32", "bfloat16"] = "float32"
    # "whitespace": words are tokens (decode joins them with spaces); "byte_level": decode
    # reproduces any text exactly (what a server that detokenizes streamed output needs).
    tokenizer: Literal["whitespace", "byte_level"] = "whitespace"
    # Larger-than-default weights make greedy decoding sensitive to every KV value, so a wrong or
    # stale block changes the output instead of hiding under a flat distribution. None keeps the
    # initialiser's defaults.
    weight_std: float | None = 0.08
    seed: int = 1234


def _corpus(seed: int, n: int = 4000) -> list[str]:
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 30))) for _ in range(n)]


def build(dst: Path, spec: TinySpec = TinySpec()) -> None:
    """Write the model and tokenizer described by ``spec`` into ``dst`` (created if absent)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    dst.mkdir(parents=True, exist_ok=True)
    specials = ["<unk>", "<s>", "</s>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    if spec.tokenizer == "byte_level":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=spec.vocab_size,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        trainer = trainers.BpeTrainer(vocab_size=spec.vocab_size, special_tokens=specials)
    tok.train_from_iterator(_corpus(spec.seed), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    # VOCAB CONTRACT: the model has exactly spec.vocab_size rows and every one of them decodes.
    # BPE stops merging when the small corpus runs out of pairs, so the rest are unused special
    # tokens (a sampled one decodes to nothing under skip_special_tokens instead of failing).
    spare = spec.vocab_size - len(fast)
    if spare < 0:
        raise ValueError(f"TinySpec.vocab_size={spec.vocab_size} < the tokenizer's {len(fast)}")
    fast.add_special_tokens({"additional_special_tokens": [f"<unused{i}>" for i in range(spare)]})
    fast.save_pretrained(dst)
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_positions,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        tie_word_embeddings=False,
        torch_dtype=spec.dtype,
    )
    _save_random(dst, LlamaForCausalLM, config, spec.weight_std, spec.seed, spec.dtype)


def _save_random(
    dst: Path, model_cls: Any, config: Any, weight_std: float | None, seed: int, dtype: str
) -> None:
    """``model_cls(config)`` with seeded random weights (every matrix from N(0, weight_std);
    None keeps the initialiser's), saved as safetensors in ``dst``."""
    import torch

    torch.manual_seed(seed)
    model = model_cls(config)
    if weight_std is not None:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() > 1:
                    p.normal_(0.0, weight_std)
    model.to(getattr(torch, dtype)).save_pretrained(dst, safe_serialization=True)


def tiny_model_of(
    dst: Path,
    model_cls: Any,
    config_cls: Any,
    *,
    weight_std: float | None = TinySpec.weight_std,
    seed: int = 5,
    **config: Any,
) -> Path:
    """A tiny random-weight model of another architecture, written to ``dst``: the Hugging Face
    ``model_cls(config_cls(**config))`` with the tiny Llama's tokenizer (:func:`tiny_model_dir`;
    its vocabulary size and bos / eos / pad (unk) ids are filled in), float32, weights as in
    :func:`build`. Tests use it for what the tiny Llama does not have (tied heads, learned
    positions, sliding-window layers)."""
    from transformers import AutoTokenizer

    dst.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir())
    tok.save_pretrained(dst)
    config.setdefault("vocab_size", len(tok))
    config.setdefault("bos_token_id", tok.bos_token_id)
    config.setdefault("eos_token_id", tok.eos_token_id)
    config.setdefault("pad_token_id", tok.unk_token_id)
    _save_random(
        dst, model_cls, config_cls(torch_dtype="float32", **config), weight_std, seed, "float32"
    )
    return dst


def tiny_model_dir(root: Path | str | None = None, spec: TinySpec = TinySpec()) -> Path:
    """Path of the cached tiny model for ``spec``, building it first if needed.

    ``root`` defaults to ``$TPUSYNC_TEST_CACHE``, else ``build/test-cache`` under the working
    directory.
    """
    root = Path(root or os.environ.get("TPUSYNC_TEST_CACHE") or "build/test-cache")
    source = Path(__file__).read_bytes() + repr(spec).encode()
    digest = hashlib.sha256(source).hexdigest()[:12]
    final = root / f"tiny-llama-{digest}"
    if (final / "config.json").exists():
        return final
    tmp = root / f".tiny-llama-{digest}.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    build(tmp, spec)
    try:
        tmp.rename(final)
    except OSError:  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
    return final
