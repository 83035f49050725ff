"""One side of a prefill -> decode KV handoff: ``prefill`` or ``decode`` (used by run.py here and
by ../multihost_disagg/run.py).

prefill: builds a paged torch KV cache (CPU tensors, vLLM's CPU layout), fills the prompt's
    blocks with deterministic values, publishes them through a PdBlockTransport (TCP on
    ``--listen``, plus a Unix socket for same-host consumers with ``--unix``), prints one JSON
    line ``{"tcp": ..., "unix": ..., "sha256": ...}`` and waits for "done" on stdin.
decode: pulls the blocks from ``--peer`` into *other* block slots of its own cache, checks that
    every byte equals what prefill wrote (recomputed from the seed), prints one JSON line.

The shared secret comes from $TPUSYNC_AUTH_SECRET (run.py sets a random one).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time

import torch

import tpusync.core as tc
from tpusync.torch import KVCacheManager, KVLayout, PdBlockTransport

LAYERS, HEADS, BLOCK_TOKENS, HEAD_DIM, NUM_BLOCKS = 4, 2, 16, 64, 64
DTYPE = torch.float16


def make_cache(layout: KVLayout) -> list[torch.Tensor]:
    return [torch.zeros(layout.shape, dtype=DTYPE) for _ in range(LAYERS)]


def prompt_kv(layout: KVLayout, num_blocks: int, seed: int) -> list[torch.Tensor]:
    """What the prefill step 'computed': per layer [num_blocks, heads, tokens, 2*dim]."""
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, *layout.shape[1:])
    return [torch.randn(shape, generator=g, dtype=torch.float32).to(DTYPE) for _ in range(LAYERS)]


def digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("role", choices=["prefill", "decode"])
    ap.add_argument("--blocks", type=int, default=12, help="prompt blocks to hand off")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--listen", default="127.0.0.1:0", help="prefill: HOST:PORT to serve on")
    ap.add_argument("--unix", default=None, help="prefill: also serve on this Unix socket")
    ap.add_argument("--shm", default=None, help="prefill: /dev/shm name of the host pool")
    ap.add_argument("--peer", default=None, help="decode: HOST:PORT or unix:PATH of prefill")
    ap.add_argument("--request", default="req-0")
    args = ap.parse_args()
    if args.blocks < 1:
        ap.error(f"--blocks {args.blocks}: at least 1")
    # The cache holds the prompt twice over, so the decode's slots are really other slots.
    num_blocks = max(NUM_BLOCKS, 2 * args.blocks)

    layout = KVLayout.vllm_cpu(num_blocks, HEADS, BLOCK_TOKENS, HEAD_DIM, DTYPE)
    caches = make_cache(layout)
    probe = KVCacheManager(caches, layout, host_blocks=1)
    pool = tc.HostBlockPool(probe.host_block_bytes, 4 * args.blocks * LAYERS, shm_name=args.shm)
    transport = PdBlockTransport(pool, listen=args.listen, unix_path=args.unix)
    mgr = KVCacheManager(caches, layout, pool=pool, transport=transport)
    expected = prompt_kv(layout, args.blocks, args.seed)

    if args.role == "prefill":
        src_blocks = list(range(args.blocks))  # where prefill put the prompt
        for layer, t in enumerate(expected):
            caches[layer][src_blocks] = t
        t0 = time.perf_counter()
        mgr.register_send(args.request, src_blocks).result(timeout=30)
        print(
            json.dumps(
                {
                    "role": "prefill",
                    "tcp": transport.address,
                    "unix": transport.unix_address,
                    "blocks": args.blocks,
                    "bytes": args.blocks * LAYERS * mgr.host_block_bytes,
                    "stage_s": round(time.perf_counter() - t0, 4),
                    "sha256": digest([c[src_blocks] for c in caches]),
                }
            ),
            flush=True,
        )
        sys.stdin.readline()  # the driver says when decode is done
        mgr.finish_send(args.request)
        transport.close()
        return 0

    if not args.peer:
        ap.error("decode needs --peer")
    dst_blocks = list(range(num_blocks - args.blocks, num_blocks))  # other slots on purpose
    t0 = time.perf_counter()
    mgr.start_recv(args.peer, args.request, dst_blocks, timeout=30).result(timeout=60)
    took = time.perf_counter() - t0
    got = [c[dst_blocks] for c in caches]
    equal = all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
    untouched = all(bool((c[: num_blocks - args.blocks] == 0).all()) for c in caches)
    nbytes = args.blocks * LAYERS * mgr.host_block_bytes
    print(
        json.dumps(
            {
                "role": "decode",
                "peer": args.peer,
                "blocks": args.blocks,
                "bytes": nbytes,
                "recv_s": round(took, 4),
                "sha256": digest(got),
                "bytes_equal": equal,
                "other_blocks_untouched": untouched,
            }
        ),
        flush=True,
    )
    transport.close()
    return 0 if equal and untouched else 1


if __name__ == "__main__":
    raise SystemExit(main())
