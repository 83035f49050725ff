"""``tpusync bench memory``: host block pool put/get throughput vs a plain memcpy, same run.

For each block size, the same number of bytes is copied (a) from a prefaulted caller buffer into
pool blocks (put), (b) from pool blocks into a prefaulted caller buffer (get), both as one batched
engine call, and (c) with one plain memcpy between two prefaulted buffers on one thread: the limit.
Figures are medians of several repeats.
"""

from __future__ import annotations

import numpy as np

from tpusync.core import _native
from tpusync.core.bench.common import measure, progress, result_entry
from tpusync.core.pool import HostBlockPool, default_engine

DEFAULT_SIZES = [16 << 10, 64 << 10, 256 << 10, 1 << 20, 2 << 20]
GOAL = {"min_ratio": 0.9, "from_block_bytes": 256 << 10}
LIMIT = "one memcpy of the same bytes between prefaulted buffers, calling thread, same run"


def run(
    total_bytes: int = 256 << 20,
    repeats: int = 5,
    sizes: list[int] | None = None,
    show_progress: bool = True,
) -> dict:
    sizes = sizes or DEFAULT_SIZES
    if total_bytes < max(sizes):
        raise ValueError(
            f"bench memory: {total_bytes} bytes hold no block of {max(sizes)} bytes (the largest "
            f"size measured): give at least {max(sizes) >> 20 or 1} MiB"
        )
    engine = default_engine()
    src = np.full(total_bytes, 7, dtype=np.uint8)  # written = prefaulted
    dst = np.zeros(total_bytes, dtype=np.uint8)
    dst[:] = 1
    results = []
    with progress(show_progress) as bar:
        task = bar.add_task("bench memory", total=len(sizes))
        for block in sizes:
            results.append(_one_size(engine, block, src, dst, repeats))
            bar.advance(task)
    met = all(
        r[path]["ratio"] >= GOAL["min_ratio"]
        for r in results
        if r["block_bytes"] >= GOAL["from_block_bytes"]
        for path in ("put", "get")
    )
    return {
        "suite": "memory",
        "engine_threads": engine.num_threads,
        "repeats": repeats,
        "results": results,
        "goal": GOAL,
        "goal_met": met,
    }


def _one_size(engine, block: int, src: np.ndarray, dst: np.ndarray, repeats: int) -> dict:
    n = src.nbytes // block
    nbytes = n * block
    pool = HostBlockPool(block, n, engine=engine)
    ids = pool.alloc(n)
    s, d = src[:nbytes], dst[:nbytes]
    put_s = measure(lambda: pool.put(ids, s).result(), repeats)
    get_s = measure(lambda: pool.get(ids, d).result(), repeats)
    ref_s = measure(lambda: _native.memcpy_seconds(d, s), repeats)
    if not np.array_equal(d[:block], s[:block]):
        raise RuntimeError("bench memory: data check failed")
    pool.free(ids)
    return {
        "block_bytes": block,
        "blocks": n,
        "bytes": nbytes,
        "put": result_entry(nbytes, put_s, ref_s, LIMIT),
        "get": result_entry(nbytes, get_s, ref_s, LIMIT),
    }
