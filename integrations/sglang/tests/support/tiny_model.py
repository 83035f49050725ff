"""TEST-ONLY: a tiny random-weight Llama model and a locally trained tokenizer, made at test time.

Nothing is downloaded and nothing is committed. The model directory is cached under
``<repo>/build/tiny-models/<hash>``, the hash being this file's source, so editing the generator
makes a fresh model. Generation is deterministic (fixed seeds).

Usage: ``path = tiny_model.ensure(root)`` -> a directory that ``transformers`` and SGLang load with
``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

VOCAB = 512
CORPUS_SEED = 7
WEIGHT_SEED = 11


def _corpus(n_lines: int = 2000) -> list[str]:
    import random

    rng = random.Random(CORPUS_SEED)
    words = [
        "the", "cache", "page", "block", "host", "disk", "token", "model", "prefix", "hit",
        "miss", "store", "load", "copy", "layer", "head", "key", "value", "tpusync", "sglang",
    ]  # fmt: skip
    return [" ".join(rng.choice(words) for _ in range(rng.randint(4, 16))) for _ in range(n_lines)]


def _build(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(out)

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(WEIGHT_SEED)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)


def ensure(repo_root: Path | str) -> Path:
    """The cached tiny model directory, generating it first if needed (atomic rename)."""
    digest = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]
    target = Path(repo_root) / "build" / "tiny-models" / f"llama-{digest}"
    if (target / "config.json").exists():
        return target
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _build(tmp)
    try:
        tmp.rename(target)
    except OSError:  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
    return target
