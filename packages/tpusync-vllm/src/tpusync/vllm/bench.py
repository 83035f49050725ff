"""TTFT with a tpusync host hit vs recompute, in one vLLM instance (JSON per tpusync's convention).

``python -m tpusync.vllm.bench --model DIR [--prompt-tokens N] [--repeats R] --json``

For each repeat: vLLM's own prefix cache is reset, a fresh prompt is generated once to fill the
host tier (recompute, timed as the reference), vLLM's prefix cache is reset again and the same
prompt runs again (its prefix loads from tpusync, timed). TTFT = wall time of a 1-token greedy
generation. ``ratio`` = hit / recompute (lower is better). Medians over the repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt-tokens", type=int, default=992)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=150, help="sample prompt ids below this")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    llm = LLM(
        model=args.model,
        tokenizer=args.model,
        dtype="float32",
        block_size=args.block_size,
        max_model_len=args.prompt_tokens + 32,
        max_num_batched_tokens=args.prompt_tokens + 32,
        enforce_eager=True,
        enable_prefix_caching=True,
        kv_transfer_config=KVTransferConfig(
            kv_connector="TpusyncConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"host_bytes": 256 << 20},
        ),
    )
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    rng = random.Random(0)

    def ttft(ids: list[int]) -> tuple[float, int]:
        t0 = time.perf_counter()
        (out,) = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)
        return time.perf_counter() - t0, out.num_cached_tokens

    ttft([rng.randrange(3, args.vocab) for _ in range(args.prompt_tokens)])  # warm-up
    cold, warm = [], []
    for i in range(args.repeats):
        ids = [rng.randrange(3, args.vocab) for _ in range(args.prompt_tokens)]
        llm.reset_prefix_cache()
        t, cached = ttft(ids)
        cold.append(t)
        llm.reset_prefix_cache()
        t, cached = ttft(ids)
        if cached == 0:
            print(f"repeat {i}: no tpusync hit", file=sys.stderr)
            return 1
        warm.append(t)
        print(
            f"repeat {i}: recompute {cold[-1] * 1e3:.1f} ms, hit {t * 1e3:.1f} ms", file=sys.stderr
        )
    hit, ref = statistics.median(warm), statistics.median(cold)
    result = {
        "suite": "vllm-ttft",
        "prompt_tokens": args.prompt_tokens,
        "loaded_tokens": cached,
        "results": [
            {
                "name": "ttft_host_hit",
                "seconds": hit,
                "limit_seconds": ref,
                "limit": "TTFT recomputing the same prompt in the same run",
                "ratio": hit / ref,
                "better": "lower",
            }
        ],
    }
    print(json.dumps(result, indent=2 if not args.json else None))
    os._exit(0)  # vLLM's interpreter teardown is slow; the result is printed


if __name__ == "__main__":
    sys.exit(main())
