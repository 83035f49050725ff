"""P/D producer process for test_jax_pd.py: a JAX KVCacheManager serving over TCP.

Usage: python pd_peer_jax.py ID=BLOCK,BLOCK... [ID=...]  (secret in $TPUSYNC_AUTH_SECRET)
Publishes every transfer and prints {"address": ...}, then waits (at most 60 s) for stdin to
close and exits.
"""

from __future__ import annotations

import json
import select
import sys

import jax
import jax.numpy as jnp
import numpy as np

import tpusync.core as tc
from tpusync.jax import KVCacheManager, KVLayout, PdBlockTransport

N, H, B, D, LAYERS = 10, 4, 4, 8, 2


def host_caches() -> tuple[list[list[np.ndarray]], KVLayout]:
    """Deterministic K/V arrays both processes can rebuild (JAX pages: K and V separate)."""
    lay = KVLayout.jax_pages(N, H, B, D, jnp.float32)
    n = int(np.prod(lay.shape))
    caches = [
        [
            ((np.arange(n, dtype=np.int64) * (2 * layer + part + 3)) % 1021)
            .astype(np.float32)
            .reshape(lay.shape)
            for part in range(2)
        ]
        for layer in range(LAYERS)
    ]
    return caches, lay


def main() -> None:
    sends = {a.split("=")[0]: [int(x) for x in a.split("=")[1].split(",")] for a in sys.argv[1:]}
    host, lay = host_caches()
    caches = [[jax.device_put(np.array(a, copy=True)) for a in parts] for parts in host]
    probe = KVCacheManager(caches, lay, host_blocks=1)
    pool = tc.HostBlockPool(probe.host_block_bytes, 64)
    transport = PdBlockTransport(pool)  # secret from $TPUSYNC_AUTH_SECRET
    mgr = KVCacheManager(caches, lay, pool=pool, transport=transport)
    for tid, blocks in sends.items():
        mgr.register_send(tid, blocks).result(timeout=30)
    print(json.dumps({"address": transport.address}), flush=True)
    if select.select([sys.stdin], [], [], 60)[0]:
        sys.stdin.read()
    transport.close()


if __name__ == "__main__":
    main()
