"""JAX on a GPU: tpusync.jax.KVCacheManager's staged path (device gather + device_get /
device_put + donated scatter), checked against the CPU path and timed.

1. correctness: the same pages on the GPU and on the CPU device give byte-identical host blocks
   (one host block format for both paths), and h2d restores them into other GPU blocks exactly,
   for host_memory "unpinned" and (where the GPU offers the memory kind) "pinned_host";
2. D2H / H2D GB/s of the manager, both host_memory variants, against JAX's own transfer of the
   same bytes as one contiguous array, same run: pageable (``jax.device_get`` /
   ``jax.device_put`` of numpy) and pinned (``device_put`` to / from the ``pinned_host`` kind).
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
kinds = [m.kind for m in gpu.addressable_memories()]
print("GPU memory kinds:", kinds)
variants = ["unpinned"] + (["pinned_host"] if "pinned_host" in kinds else [])
mc = KVCacheManager([tuple(jax.device_put(x, cpu) for x in kv) for kv in host], lay, host_blocks=64)
ic = mc.alloc_host(src.size)
mc.d2h(src, ic).result(timeout=120)
for hm in variants:
    mg = KVCacheManager(
        [tuple(jax.device_put(x, gpu) for x in kv) for kv in host],
        lay,
        host_blocks=64,
        host_memory=hm,
    )
    assert mg.staged and not mc.staged, (mg.staged, mc.staged)
    assert mg.format == mc.format
    ig = mg.alloc_host(src.size)
    mg.d2h(src, ig).result(timeout=120)
    for a, b in zip(ig.reshape(-1), ic.reshape(-1), strict=True):
        np.testing.assert_array_equal(mg.pool.view(int(a)), mc.pool.view(int(b)))
    mg.h2d(dst, ig).result(timeout=120)
    ax = lay.block_axis
    for kv_host, kv_gpu in zip(host, mg.kv_caches, strict=True):
        for h, g in zip(kv_host, kv_gpu, strict=True):
            assert next(iter(g.devices())) == gpu
            got = np.asarray(jax.device_get(g))
            np.testing.assert_array_equal(np.take(got, dst, ax), np.take(np.asarray(h), src, ax))
    # host_memory reads back what was used: "unpinned" here after a pinned request would have
    # raised, so equality means the pinned path really ran.
    assert mg.host_memory == hm, (hm, mg.host_memory)
    print(f"correctness jax_pages host_memory={hm}: GPU host bytes == CPU host bytes, h2d exact")
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
nbytes = 8 * (Nb // 2) * lay.layer_block_bytes
gbs = lambda s: nbytes / s / 1e9  # noqa: E731
# References, same run: JAX's own copy of the same bytes as one contiguous array.
# A fresh array per timed device_get: a jax.Array caches its host copy after the first one.
flats = jax.block_until_ready([jnp.full(nbytes // 4, i, jnp.float32, device=gpu) for i in range(6)])
flats = iter(flats)
hostbuf = np.ones(nbytes // 4, np.float32)
refs = {
    "pageable": (
        med(lambda: np.asarray(jax.device_get(next(flats)))),
        med(lambda: jax.device_put(hostbuf, gpu).block_until_ready()),
    )
}
if "pinned_host" in kinds:
    from jax.sharding import SingleDeviceSharding

    pin = SingleDeviceSharding(gpu, memory_kind="pinned_host")
    dev = SingleDeviceSharding(gpu, memory_kind="device")
    x = jnp.ones(nbytes // 4, jnp.float32, device=gpu)
    hx = jax.device_put(x, pin).block_until_ready()
    refs["pinned"] = (
        med(lambda: jax.device_put(x, pin).block_until_ready()),
        med(lambda: jax.device_put(hx, dev).block_until_ready()),
    )
    del x, hx
rows = []
blocks = np.arange(0, Nb, 2)
for hm in variants:
    m = KVCacheManager(caches, lay, host_blocks=8 * (Nb // 2) + 1, host_memory=hm)
    ids = m.alloc_host(blocks.size)
    d2h = med(lambda m=m, ids=ids: m.d2h(blocks, ids).result(timeout=300))
    h2d = med(
        lambda m=m, ids=ids: (
            m.h2d(blocks, ids).result(timeout=300),
            m.kv_caches[-1][-1].block_until_ready(),
        )
    )
    assert m.host_memory == hm, (hm, m.host_memory)
    row = {"host_memory": hm, "d2h_gbps": gbs(d2h), "h2d_gbps": gbs(h2d)}
    for name, (rd, rh) in refs.items():
        row[f"d2h_ratio_vs_{name}"] = rd / d2h
        row[f"h2d_ratio_vs_{name}"] = rh / h2d
    rows.append(row)
    caches = m.kv_caches  # loads replaced the arrays (donated buffers)
    m.free_host(ids)
    m.close()
out = {
    "suite": "jax-gpu",
    "bytes": nbytes,
    "limits": "JAX's own copy of the same bytes as one contiguous array, same run: pageable = "
    "jax.device_get / device_put of numpy; pinned = device_put to / from memory kind pinned_host",
    "limit_gbps": {k: {"d2h": gbs(d), "h2d": gbs(h)} for k, (d, h) in refs.items()},
    "rows": rows,
}
print(json.dumps(out, indent=1))
