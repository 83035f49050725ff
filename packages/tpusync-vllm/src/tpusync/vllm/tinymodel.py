"""A tiny random-weight Llama and a locally trained tokenizer, generated at test time.

Nothing is downloaded and nothing is committed: the model directory is built from a fixed seed
and cached under ``$TPUSYNC_TEST_CACHE/tiny-llama-<hash of this file>``, so a change to this
generator invalidates the cache and repeated runs reuse it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

SEED = 1234
WORDS = (
    "the a an of to in and for on with at by from block cache host disk tier key value page "
    "token prefix store load save pin evict layer head model engine request batch stream copy "
    "memory network router score hit miss tpusync vllm offload restart warm cold fast slow"
).split()


def _corpus(n: int = 4000) -> list[str]:
    import random

    rng = random.Random(SEED)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 30))) for _ in range(n)]


def build(dst: Path) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    dst.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(_corpus(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(dst)
    config = LlamaConfig(
        vocab_size=fast.vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=16384,  # the vllm bench runs 8K-token prompts
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config)
    # Larger-than-default weights make greedy decoding sensitive to every KV value, so a wrong or
    # stale block changes the output instead of hiding under a flat distribution.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model.save_pretrained(dst, safe_serialization=True)


def tiny_model_dir(root: Path | None = None) -> Path:
    """Path of the cached tiny model, building it first if needed (atomic rename)."""
    root = Path(root or os.environ.get("TPUSYNC_TEST_CACHE") or "build/test-cache")
    digest = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]
    final = root / f"tiny-llama-{digest}"
    if (final / "config.json").exists():
        return final
    tmp = root / f".tiny-llama-{digest}.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    build(tmp)
    try:
        tmp.rename(final)
    except OSError:  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
    return final
