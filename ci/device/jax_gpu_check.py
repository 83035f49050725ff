"""JAX on a GPU: tpusync.jax.KVCacheManager's staged path (device gather + device_get /
device_put + donated scatter), checked against the CPU path and timed.

1. correctness: the same pages on the GPU and on the CPU device give byte-identical host blocks
   (one host block format for both paths), and h2d restores them into other GPU blocks exactly;
2. D2H / H2D GB/s of the manager against JAX's own transfer of the same bytes as one contiguous
   array (``jax.device_get`` / ``jax.device_put``), same run.
Run by ci/device/run_all.sh (XLA_PYTHON_CLIENT_PREALLOCATE=false so torch can share the GPU).
"""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from tpusync.core.kvcache import KVLayout
from tpusync.jax import KVCacheManager

gpus = [d for d in jax.devices() if d.platform == "gpu"]
assert gpus, f"no JAX GPU device: {jax.devices()}"
gpu, cpu = gpus[0], jax.devices("cpu")[0]
print("jax", jax.__version__, gpu.device_kind)

rng = np.random.default_rng(0)
N, H, B, D, layers = 64, 8, 16, 128, 4
lay = KVLayout.jax_pages(N, H, B, D, "bfloat16")
host = [
    tuple(rng.standard_normal(lay.shape, np.float32).astype(jnp.bfloat16) for _ in range(2))
    for _ in range(layers)
]
src, dst = np.array([5, 17, 3, 40, 41]), np.array([0, 1, 2, 60, 63])
mg = KVCacheManager([tuple(jax.device_put(x, gpu) for x in kv) for kv in host], lay, host_blocks=64)
mc = KVCacheManager([tuple(jax.device_put(x, cpu) for x in kv) for kv in host], lay, host_blocks=64)
assert mg.staged and not mc.staged, (mg.staged, mc.staged)
assert mg.format == mc.format
ig, ic = mg.alloc_host(src.size), mc.alloc_host(src.size)
mg.d2h(src, ig).result(timeout=120)
mc.d2h(src, ic).result(timeout=120)
for a, b in zip(ig.reshape(-1), ic.reshape(-1), strict=True):
    np.testing.assert_array_equal(mg.pool.view(int(a)), mc.pool.view(int(b)))
mg.h2d(dst, ig).result(timeout=120)
ax = lay.block_axis
for kv_host, kv_gpu in zip(host, mg.kv_caches, strict=True):
    for h, g in zip(kv_host, kv_gpu, strict=True):
        assert next(iter(g.devices())) == gpu
        got = np.asarray(jax.device_get(g))
        np.testing.assert_array_equal(np.take(got, dst, ax), np.take(np.asarray(h), src, ax))
print("correctness jax_pages: GPU host bytes == CPU host bytes, h2d exact")
mg.close()
mc.close()


def med(fn, reps=5):
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


# Timing: half the blocks of 8 layers, ~512 MiB, float32 pages.
Nb = 2 * ((512 << 20) // (8 * KVLayout.jax_pages(2, 8, 16, 128, "float32").layer_block_bytes))
lay = KVLayout.jax_pages(Nb, 8, 16, 128, "float32")
caches = [
    tuple(
        jax.random.normal(
            jax.random.key(i * 2 + k),
            lay.shape,
            jnp.float32,
        )
        for k in range(2)
    )
    for i in range(8)
]
caches = [tuple(jax.device_put(x, gpu) for x in kv) for kv in caches]
m = KVCacheManager(caches, lay, host_blocks=8 * (Nb // 2) + 1)
blocks = np.arange(0, Nb, 2)
ids = m.alloc_host(blocks.size)
nbytes = 8 * blocks.size * lay.layer_block_bytes
d2h = med(lambda: m.d2h(blocks, ids).result(timeout=300))
h2d = med(lambda: (m.h2d(blocks, ids).result(timeout=300), m.kv_caches[-1][-1].block_until_ready()))
# A fresh array per timed device_get: a jax.Array caches its host copy after the first one.
flats = jax.block_until_ready([jnp.full(nbytes // 4, i, jnp.float32, device=gpu) for i in range(6)])
flats = iter(flats)
hostbuf = np.ones(nbytes // 4, np.float32)
ref_d2h = med(lambda: np.asarray(jax.device_get(next(flats))))
ref_h2d = med(lambda: jax.device_put(hostbuf, gpu).block_until_ready())
gbs = lambda s: nbytes / s / 1e9  # noqa: E731
out = {
    "suite": "jax-gpu",
    "bytes": nbytes,
    "limit": "jax.device_get / device_put of the same bytes as one contiguous array, same run",
    "d2h": {"gbps": gbs(d2h), "limit_gbps": gbs(ref_d2h), "ratio": ref_d2h / d2h},
    "h2d": {"gbps": gbs(h2d), "limit_gbps": gbs(ref_h2d), "ratio": ref_h2d / h2d},
}
print(json.dumps(out, indent=1))
m.close()
