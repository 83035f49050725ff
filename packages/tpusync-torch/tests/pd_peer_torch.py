"""P/D producer process for test_torch_pd.py: a torch KVCacheManager serving over TCP.

Usage: python pd_peer_torch.py [--shm NAME --unix PATH] ID=BLOCK,BLOCK... [ID=...]
(secret in $TPUSYNC_AUTH_SECRET). With --shm / --unix the pool lives in /dev/shm/NAME and
same-host consumers are also served on the Unix socket PATH (shm copies, no TCP).
Publishes every transfer and prints {"address": ..., "unix_address": ...}; then, per line read on stdin (at most 60 s
each) naming a transfer id, finishes that send and prints {"released": true} once the pool holds
no block of it any more (the consumer's acknowledgement dropped the P/D references).
"""

from __future__ import annotations

import json
import select
import sys
import time

import torch

import tpusync.core as tc
from tpusync.torch import KVCacheManager, KVLayout, PdBlockTransport

N, H, B, D, LAYERS = 12, 2, 4, 8, 2


def make_caches() -> tuple[list[torch.Tensor], KVLayout]:
    """Deterministic caches both processes can rebuild."""
    lay = KVLayout.hnd(N, H, B, D, torch.float16)
    n = 1
    for s in lay.shape:
        n *= s
    caches = [
        ((torch.arange(n, dtype=torch.int32) * (layer + 3)) % 1021)
        .to(torch.float16)
        .reshape(lay.shape)
        for layer in range(LAYERS)
    ]
    return caches, lay


def main() -> None:
    args = sys.argv[1:]
    shm = unix = None
    while args and args[0].startswith("--"):
        flag, value, args = args[0], args[1], args[2:]
        shm, unix = (value, unix) if flag == "--shm" else (shm, value)
    sends = {a.split("=")[0]: [int(x) for x in a.split("=")[1].split(",")] for a in args}
    caches, lay = make_caches()
    probe = KVCacheManager(caches, lay, host_blocks=1)
    pool = tc.HostBlockPool(probe.host_block_bytes, 64, shm_name=shm)
    transport = PdBlockTransport(pool, unix_path=unix)  # secret from $TPUSYNC_AUTH_SECRET
    mgr = KVCacheManager(caches, lay, pool=pool, transport=transport)
    held = {}
    for tid, blocks in sends.items():
        before = pool.num_free
        mgr.register_send(tid, blocks).result(timeout=30)
        held[tid] = before - pool.num_free  # staging + meta blocks the P/D send holds
    print(
        json.dumps({"address": transport.address, "unix_address": transport.unix_address}),
        flush=True,
    )
    while select.select([sys.stdin], [], [], 60)[0]:
        tid = sys.stdin.readline().strip()
        if not tid:
            break
        held.pop(tid)
        target = pool.num_blocks - sum(held.values())  # every block of tid back in the pool
        mgr.finish_send(tid)
        deadline = time.monotonic() + 10
        while pool.num_free != target and time.monotonic() < deadline:
            time.sleep(0.01)
        print(json.dumps({"released": pool.num_free == target}), flush=True)
    transport.close()


if __name__ == "__main__":
    main()
