"""``tpusync bench device``: KV cache device <-> host block transfers vs a plain copy, same run.

CPU tensors: KVCacheManager.d2h / h2d over every layer of half the blocks of a synthetic paged
cache, against one memcpy of the same number of bytes between prefaulted buffers (calling thread).
Two layouts: vLLM's CPU layout (one contiguous run per block) and K/V split HND with the block
axis inside the heads axis (one run per head and K/V: the multi-segment path).

CUDA tensors (when torch sees a GPU): the same on the GPU, against torch's own pinned copy of the
same bytes (one contiguous cuda -> pinned and pinned -> cuda ``copy_``, i.e. a pinned
cudaMemcpyAsync), both timed with a stream synchronisation.
"""

from __future__ import annotations

import time

import numpy as np

import torch
from tpusync.core.bench.common import measure, paired_with_memcpy, progress, result_entry
from tpusync.core.kvcache.layout import KVLayout
from tpusync.torch.kv_cache import KVCacheManager

GOAL = {"min_ratio": 0.9}
CPU_LIMIT = (
    "one memcpy of the same bytes between prefaulted buffers, calling thread, same run, "
    "timed alternately with the transfers"
)
CUDA_LIMIT = "torch copy_ of the same bytes, one contiguous cuda <-> pinned copy, same run"


def _layouts(num_blocks: int):
    h, b, d = 8, 16, 128
    yield "vllm_cpu", KVLayout.vllm_cpu(num_blocks, h, b, d, "float16")
    yield "jax_pages", KVLayout.jax_pages(num_blocks, h, b, d, "float16")


def _one(name, lay, layers, device, repeats):
    shape = lay.shape
    parts = lay.parts_per_layer
    caches = [
        [torch.randn(shape, device=device).to(torch.float16) for _ in range(parts)]
        for _ in range(layers)
    ]
    mgr = KVCacheManager(
        [c if parts > 1 else c[0] for c in caches],
        lay,
        host_blocks=layers * (lay.num_blocks // 2) + 1,
    )
    blocks = np.arange(0, lay.num_blocks, 2)
    ids = mgr.alloc_host(blocks.size)
    nbytes = layers * blocks.size * lay.layer_block_bytes
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def timed(fn):
        def run():
            sync()
            t0 = time.perf_counter()
            fn().result(timeout=120)
            sync()
            return time.perf_counter() - t0

        return run

    ref_host = mgr.pool  # keep the pool alive for the check below
    if device == "cpu":
        # One warm save fills the pool; then every repeat times the memcpy reference, a save and
        # a load back to back (same moments of the machine's load; loads write back what the
        # saves read, so the cache must come out unchanged).
        mgr.d2h(blocks, ids).result(timeout=120)
        snapshot = [p.clone() for p in caches[0]]
        d2h, h2d, cpu_ref = paired_with_memcpy(
            nbytes,
            timed(lambda: mgr.d2h(blocks, ids)),
            timed(lambda: mgr.h2d(blocks, ids)),
            repeats,
        )
    else:
        d2h = measure(timed(lambda: mgr.d2h(blocks, ids)), repeats)
        snapshot = [p.clone() for p in caches[0]]
        h2d = measure(timed(lambda: mgr.h2d(blocks, ids)), repeats)
    for p, s in zip(caches[0], snapshot, strict=True):
        if not torch.equal(p, s):
            raise RuntimeError(f"bench device {name}: data check failed")
    if device == "cuda":
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

        def ref_d2h():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            pinned.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            return time.perf_counter() - t0

        def ref_h2d():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            src.copy_(pinned, non_blocking=True)
            torch.cuda.synchronize()
            return time.perf_counter() - t0

        limit_d2h, limit_h2d, limit = (
            measure(ref_d2h, repeats),
            measure(ref_h2d, repeats),
            CUDA_LIMIT,
        )
        mgr.close()
    else:
        limit_d2h = limit_h2d = cpu_ref
        limit = CPU_LIMIT
    mgr.free_host(ids)
    del ref_host
    return {
        "device": device,
        "layout": name,
        "layers": layers,
        "blocks": int(blocks.size),
        "layer_block_bytes": lay.layer_block_bytes,
        "bytes": nbytes,
        "d2h": result_entry(nbytes, d2h, limit_d2h, limit),
        "h2d": result_entry(nbytes, h2d, limit_h2d, limit),
    }


def run(total_bytes: int = 256 << 20, repeats: int = 5, show_progress: bool = True) -> dict:
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    layers = 8
    results = []
    with progress(show_progress) as bar:
        task = bar.add_task("bench device", total=2 * len(devices))
        for device in devices:
            for name, probe in _layouts(2):
                per_block = probe.layer_block_bytes
                num_blocks = max(4, 2 * (total_bytes // (layers * per_block)))
                lay = dict(_layouts(num_blocks))[name]
                results.append(_one(name, lay, layers, device, repeats))
                bar.advance(task)
    met = all(r[p]["ratio"] >= GOAL["min_ratio"] for r in results for p in ("d2h", "h2d"))
    return {
        "suite": "device",
        "framework": f"torch {torch.__version__}",
        "engine_threads": _default_threads(),
        "repeats": repeats,
        "results": results,
        "goal": GOAL,
        "goal_met": met,
    }


def _default_threads() -> int:
    from tpusync.core.pool import default_engine

    return default_engine().num_threads
