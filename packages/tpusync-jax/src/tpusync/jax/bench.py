"""``tpusync bench device-jax``: JAX KV cache device <-> host block transfers vs memcpy, same run.

KVCacheManager.d2h / h2d over every layer of half the blocks of a synthetic cache held as JAX
arrays (K and V pages, block axis inside the heads axis) on the default devices, against one
memcpy of the same bytes between prefaulted buffers (calling thread). On CPU devices both
directions are native segment copies straight from / into the arrays' buffers.
"""

from __future__ import annotations

import time

import numpy as np

import jax
import jax.numpy as jnp
from tpusync.core import _native
from tpusync.core.bench.common import measure, progress, result_entry
from tpusync.core.kvcache.layout import KVLayout
from tpusync.core.pool import default_engine
from tpusync.jax.kv_cache import KVCacheManager

GOAL = {"min_ratio": 0.9, "paths": ["d2h", "h2d"]}
LIMIT = "one memcpy of the same bytes between prefaulted buffers, calling thread, same run"


def _one(lay: KVLayout, layers: int, repeats: int) -> dict:
    rng = np.random.default_rng(0)
    caches = [
        tuple(jnp.asarray(rng.standard_normal(lay.shape, np.float32)) for _ in range(2))
        for _ in range(layers)
    ]
    mgr = KVCacheManager(caches, lay, host_blocks=layers * (lay.num_blocks // 2) + 1)
    blocks = np.arange(0, lay.num_blocks, 2)
    ids = mgr.alloc_host(blocks.size)
    nbytes = layers * blocks.size * lay.layer_block_bytes

    def timed(fn):
        def run():
            t0 = time.perf_counter()
            fn().result(timeout=300)
            return time.perf_counter() - t0

        return run

    d2h = measure(timed(lambda: mgr.d2h(blocks, ids)), repeats)
    before = np.asarray(mgr.kv_caches[0][0])
    h2d = measure(timed(lambda: mgr.h2d(blocks, ids)), repeats)
    if not np.array_equal(np.asarray(mgr.kv_caches[0][0]), before):
        raise RuntimeError("bench device-jax: data check failed")
    a = np.full(nbytes, 3, np.uint8)
    b = np.full(nbytes, 4, np.uint8)
    ref = measure(lambda: _native.memcpy_seconds(b, a), repeats)
    mgr.free_host(ids)
    mgr.close()
    return {
        "device": jax.devices()[0].platform,
        "layout": "jax_pages",
        "layers": layers,
        "blocks": int(blocks.size),
        "layer_block_bytes": lay.layer_block_bytes,
        "bytes": nbytes,
        "d2h": result_entry(nbytes, d2h, ref, LIMIT),
        "h2d": result_entry(nbytes, h2d, ref, LIMIT),
    }


def run(total_bytes: int = 256 << 20, repeats: int = 5, show_progress: bool = True) -> dict:
    layers = 8
    probe = KVLayout.jax_pages(2, 8, 16, 128, "float32")
    num_blocks = max(4, 2 * (total_bytes // (layers * probe.layer_block_bytes)))
    lay = KVLayout.jax_pages(num_blocks, 8, 16, 128, "float32")
    with progress(show_progress) as bar:
        task = bar.add_task("bench device-jax", total=1)
        results = [_one(lay, layers, repeats)]
        bar.advance(task)
    met = all(r[p]["ratio"] >= GOAL["min_ratio"] for r in results for p in GOAL["paths"])
    return {
        "suite": "device-jax",
        "framework": f"jax {jax.__version__}",
        "engine_threads": default_engine().num_threads,
        "repeats": repeats,
        "results": results,
        "goal": GOAL,
        "goal_met": met,
    }
