"""Weight-sync device side for JAX: flatten a pytree into buckets of host pool blocks and restore
host blocks into arrays with the same shapes, dtypes and shardings as an existing pytree.

JAX arrays are immutable, so "in place" means: :func:`restore_weights` returns a pytree of new
arrays placed exactly like the given ones (same sharding, same devices); the caller swaps it in.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import jax
from tpusync.core import _native, dtype_name
from tpusync.core.kvcache.futures import TransferFuture, from_native, gather
from tpusync.core.kvcache.weights import HostWeights, plan_weights, weight_segments
from tpusync.core.pool import HostBlockPool

__all__ = ["HostWeights", "flatten_weights", "restore_weights"]


def _leaves(tree: Any) -> list[tuple[str, Any]]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(jax.tree_util.keystr(path), leaf) for path, leaf in flat]


def _c_order(x: Any) -> np.ndarray:
    x = np.asarray(x)
    return x if x.flags.c_contiguous else x.copy(order="C")


def flatten_weights(
    tree: Any, pool: HostBlockPool, bucket_bytes: int = 64 << 20
) -> tuple[HostWeights, list[TransferFuture]]:
    """Copy every leaf (fetched to host with ``jax.device_get``) into host blocks, one future per
    bucket. The caller frees the blocks (``HostWeights.free``)."""
    leaves = _leaves(tree)
    host = {k: _c_order(jax.device_get(v)) for k, v in leaves}
    items = [(k, dtype_name(v.dtype), tuple(v.shape), v.nbytes) for k, v in host.items()]
    manifest = plan_weights(items, pool.block_bytes, bucket_bytes)
    out = HostWeights.alloc(pool, manifest)
    futures = []
    try:
        for b, ids in out.ids_of():
            regions = [
                host[e.name].reshape(-1).view(np.uint8) for e in manifest.entries if e.bucket == b
            ]
            segs = weight_segments(manifest, b, list(range(len(regions))))
            nf = _native.put_segments(pool.engine, pool.native, ids, regions, segs)
            futures.append(from_native(nf, f"flatten bucket {b}"))
    except BaseException:
        out.free()  # a block still being filled is recycled only once its copy ends (BORROW)
        raise
    return out, futures


def restore_weights(host: HostWeights, like: Any, timeout: float | None = None) -> Any:
    """A pytree shaped like ``like`` holding the host weights, each leaf on ``like``'s sharding.

    Names (pytree paths), dtypes and shapes must match the manifest (refused naming the field
    before any byte moves). Blocks until the copies are done (at most ``timeout`` seconds).
    """
    leaves = _leaves(like)
    for k, v in leaves:  # before any byte moves: each leaf says where its array goes
        if not hasattr(v, "sharding") or not hasattr(v, "dtype"):
            raise TypeError(
                f"restore_weights: leaf {k} of `like` is a {type(v).__name__}, not a jax.Array "
                "or jax.ShapeDtypeStruct (its dtype, shape and sharding place the restored array)"
            )
    m = host.manifest
    m.check_targets([(k, dtype_name(v.dtype), tuple(v.shape)) for k, v in leaves])
    chosen = host.ids_of()
    bufs = {k: np.empty(v.shape, dtype=v.dtype) for k, v in leaves}
    futures = []
    for b, ids in chosen:
        regions = [bufs[e.name].reshape(-1).view(np.uint8) for e in m.entries if e.bucket == b]
        segs = weight_segments(m, b, list(range(len(regions))))
        nf = _native.get_segments(host.pool.engine, host.pool.native, ids, regions, segs)
        futures.append(from_native(nf, f"restore bucket {b}"))
    gather(futures, "restore_weights").result(timeout)
    out = [jax.device_put(bufs[k], v.sharding) for k, v in leaves]
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(like), out)
