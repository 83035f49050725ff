"""``tpusync bench device-jax``: JAX KV cache device <-> host block transfers, same-run limits.

KVCacheManager.d2h / h2d over every layer of half the blocks of a synthetic cache held as JAX
arrays (K and V pages, block axis inside the heads axis) on the default devices.

CPU devices: the default path (native segment copies straight from / into the arrays' buffers,
DLPack, GIL released) against one memcpy of the same bytes between prefaulted buffers (calling
thread); the goal applies to these rows. Two more rows time the staged path (device gather +
device_get / device_put) with host_memory "unpinned" and "pinned_host" against the same memcpy:
they show what the staged path costs on CPU and are not part of the goal.

Other devices (GPU, TPU): the staged path with host_memory "auto" (pinned_host where offered) and
"unpinned", against JAX's own contiguous copy of the same bytes between device memory and
pinned host memory (``device_put`` to / from the ``pinned_host`` memory kind), or, where the
device offers no pinned_host kind, a plain ``device_get`` / ``device_put`` of the same bytes.
"""

from __future__ import annotations

import time

import numpy as np

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding
from tpusync.core import _native
from tpusync.core.bench.common import measure, paired_with_memcpy, progress, result_entry
from tpusync.core.kvcache.layout import KVLayout
from tpusync.core.pool import default_engine
from tpusync.jax.kv_cache import KVCacheManager, _has_pinned

GOAL = {"min_ratio": 0.9, "paths": ["d2h", "h2d"], "rows": "goal: true"}
CPU_LIMIT = (
    "one memcpy of the same bytes between prefaulted buffers, calling thread, same run "
    "(goal row: timed alternately with the transfers)"
)
PINNED_LIMIT = "one contiguous device <-> pinned_host device_put of the same bytes, same run"
PLAIN_LIMIT = "one contiguous device_get / device_put of the same bytes, same run"


def _timed(fn):
    def run():
        t0 = time.perf_counter()
        fn().result(timeout=300)
        return time.perf_counter() - t0

    return run


def _ready(x) -> None:
    if isinstance(x, jax.Array):
        x.block_until_ready()


def _limits(nbytes: int, repeats: int, dev) -> tuple[float, float, str]:
    """(d2h seconds, h2d seconds, description) of the same-run reference copy."""
    if dev.platform == "cpu":
        a = np.full(nbytes, 3, np.uint8)
        b = np.full(nbytes, 4, np.uint8)
        t = measure(lambda: _native.memcpy_seconds(b, a), repeats)
        return t, t, CPU_LIMIT
    x = jax.device_put(jnp.ones(nbytes // 4, jnp.float32), dev).block_until_ready()
    if _has_pinned(dev):
        pinned = SingleDeviceSharding(dev, memory_kind="pinned_host")
        on_dev = SingleDeviceSharding(dev, memory_kind="device")
        h = jax.device_put(x, pinned).block_until_ready()
        d2h = measure(lambda: _ready(jax.device_put(x, pinned)), repeats)
        h2d = measure(lambda: _ready(jax.device_put(h, on_dev)), repeats)
        return d2h, h2d, PINNED_LIMIT
    host = np.asarray(x)

    def plain_d2h() -> float:
        y = (x + 0).block_until_ready()  # a fresh array: device_get caches its numpy value
        t0 = time.perf_counter()
        np.asarray(y)
        return time.perf_counter() - t0

    d2h = measure(plain_d2h, repeats)
    h2d = measure(lambda: _ready(jax.device_put(host, dev)), repeats)
    return d2h, h2d, PLAIN_LIMIT


def _one(lay: KVLayout, layers: int, repeats: int, limits, **opts) -> dict:
    rng = np.random.default_rng(0)
    caches = [
        tuple(jnp.asarray(rng.standard_normal(lay.shape, np.float32)) for _ in range(2))
        for _ in range(layers)
    ]
    mgr = KVCacheManager(caches, lay, host_blocks=layers * (lay.num_blocks // 2) + 1, **opts)
    blocks = np.arange(0, lay.num_blocks, 2)
    ids = mgr.alloc_host(blocks.size)
    nbytes = layers * blocks.size * lay.layer_block_bytes
    if limits is None:
        # CPU goal row: one warm save fills the pool; then every repeat times the memcpy
        # reference, a save and a load back to back (same moments of the machine's load).
        mgr.d2h(blocks, ids).result(timeout=300)
        before = np.array(mgr.kv_caches[0][0], copy=True)  # a copy: a CPU load writes in place
        d2h, h2d, ref = paired_with_memcpy(
            nbytes,
            _timed(lambda: mgr.d2h(blocks, ids)),
            _timed(lambda: mgr.h2d(blocks, ids)),
            repeats,
        )
        limits = (ref, ref, CPU_LIMIT)
    else:
        d2h = measure(_timed(lambda: mgr.d2h(blocks, ids)), repeats)
        before = np.array(mgr.kv_caches[0][0], copy=True)  # a copy: a CPU load writes in place
        mgr.kv_caches[0][0].block_until_ready()
        h2d = measure(_timed(lambda: mgr.h2d(blocks, ids)), repeats)
    if not np.array_equal(np.asarray(mgr.kv_caches[0][0]), before):
        raise RuntimeError("bench device-jax: data check failed")
    mgr.free_host(ids)
    mgr.close()
    ref_d2h, ref_h2d, limit = limits
    return {
        "device": jax.devices()[0].platform,
        "layout": "jax_pages",
        "path": "staged" if mgr.staged else "native",
        "host_memory": mgr.host_memory if mgr.staged else "-",
        "layers": layers,
        "blocks": int(blocks.size),
        "layer_block_bytes": lay.layer_block_bytes,
        "bytes": nbytes,
        "d2h": result_entry(nbytes, d2h, ref_d2h, limit),
        "h2d": result_entry(nbytes, h2d, ref_h2d, limit),
    }


def run(total_bytes: int = 256 << 20, repeats: int = 5, show_progress: bool = True) -> dict:
    layers = 8
    probe = KVLayout.jax_pages(2, 8, 16, 128, "float32")
    num_blocks = max(4, 2 * (total_bytes // (layers * probe.layer_block_bytes)))
    lay = KVLayout.jax_pages(num_blocks, 8, 16, 128, "float32")
    dev = jax.devices()[0]
    nbytes = layers * (num_blocks // 2) * probe.layer_block_bytes
    if dev.platform == "cpu":
        variants = [
            ({}, True),
            ({"staged": True, "host_memory": "unpinned"}, False),
            ({"staged": True, "host_memory": "auto"}, False),
        ]
    else:
        variants = [({"host_memory": "auto"}, True), ({"host_memory": "unpinned"}, False)]
    results = []
    with progress(show_progress) as bar:
        task = bar.add_task("bench device-jax", total=len(variants))
        for opts, goal in variants:
            # The reference is re-measured next to every row: same run, same load (the CPU goal
            # row times it alternately with the transfers, inside _one).
            paired = dev.platform == "cpu" and goal
            limits = None if paired else _limits(nbytes, repeats, dev)
            row = _one(lay, layers, repeats, limits, **opts)
            row["goal"] = goal
            results.append(row)
            bar.advance(task)
    met = all(
        r[p]["ratio"] >= GOAL["min_ratio"] for r in results if r["goal"] for p in GOAL["paths"]
    )
    return {
        "suite": "device-jax",
        "framework": f"jax {jax.__version__}",
        "engine_threads": default_engine().num_threads,
        "repeats": repeats,
        "results": results,
        "goal": GOAL,
        "goal_met": met,
    }
