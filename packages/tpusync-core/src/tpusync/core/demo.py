"""``tpusync demo``: offload a synthetic paged KV cache to the host pool and back.

The "device" cache here is host memory laid out like vLLM's CPU KV cache, one array per layer of
shape [num_blocks, kv_heads, block_size, 2 * head_dim] (float16). The demo saves half of the
blocks of every layer into pool blocks, wipes them, restores them, verifies every byte and prints
the throughput of both directions.
"""

from __future__ import annotations

import time

import numpy as np

from tpusync.core.pool import HostBlockPool


def run(
    layers: int = 16,
    num_blocks: int = 256,
    kv_heads: int = 8,
    block_size: int = 32,
    head_dim: int = 128,
    seed: int = 0,
) -> dict:
    if num_blocks < 2:
        raise ValueError(f"demo: blocks {num_blocks}: at least 2 (half of them are offloaded)")
    rng = np.random.default_rng(seed)
    shape = (num_blocks, kv_heads, block_size, 2 * head_dim)
    cache = [rng.standard_normal(shape, dtype=np.float32).astype(np.float16) for _ in range(layers)]
    block_bytes = int(np.prod(shape[1:])) * 2
    chosen = np.sort(rng.choice(num_blocks, num_blocks // 2, replace=False))
    pool = HostBlockPool(block_bytes, layers * len(chosen))
    originals = [c[chosen].copy() for c in cache]

    t0 = time.perf_counter()
    host_ids = []
    futures = []
    for c in cache:
        ids = pool.alloc(len(chosen))
        host_ids.append(ids)
        # One batched engine gather per layer, straight from the paged cache rows.
        futures.append(pool.put(ids, c, rows=chosen))
    for f in futures:
        f.result()
    save_s = time.perf_counter() - t0

    for c in cache:
        c[chosen] = 0
    t0 = time.perf_counter()
    futures = [pool.get(ids, c, rows=chosen) for ids, c in zip(host_ids, cache, strict=True)]
    for f in futures:
        f.result()
    load_s = time.perf_counter() - t0

    ok = all(np.array_equal(c[chosen], o) for c, o in zip(cache, originals, strict=True))
    nbytes = layers * len(chosen) * block_bytes
    for ids in host_ids:
        pool.free(ids)
    return {
        "layers": layers,
        "blocks_per_layer": int(len(chosen)),
        "block_bytes": block_bytes,
        "bytes": nbytes,
        "save_gbps": round(nbytes / save_s / 1e9, 3),
        "load_gbps": round(nbytes / load_s / 1e9, 3),
        "verified": ok,
    }
